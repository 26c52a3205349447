//! Fixtures for the end-to-end tests: the real binaries, started on `127.0.0.1:0`, with
//! the bound address read from their log, and stopped by signal or on drop.
//!
//! This crate knows nothing of the contract, so that tests use the contract crate's own
//! generated clients.
// Fixtures fail loudly: a panic with the process log is the most useful test failure.
#![allow(clippy::expect_used, clippy::unwrap_used, clippy::panic)]

pub mod conformance;

use std::{
    net::SocketAddr,
    path::PathBuf,
    process::{ExitStatus, Stdio},
    sync::{Arc, Mutex, OnceLock},
    time::Duration,
};

use tokio::{
    io::{AsyncBufReadExt, BufReader},
    process::{Child, Command},
    sync::oneshot,
};

/// How long a binary may take to log its address.
const START_TIMEOUT: Duration = Duration::from_secs(60);

/// The path of a binary of this workspace, built once per test process if needed.
///
/// Test executables live in `target/<profile>/deps`; the binaries sit one level up. The
/// build runs `cargo build --tests --bins` with the same profile, which is a no-op when
/// they are fresh, so that `cargo test` alone is enough. `--tests` makes cargo resolve
/// features as `cargo test` did (the dev-dependencies' features included: tokio's
/// `test-util`), so the binaries link the libraries the tests were built with instead of
/// building every library again with other features.
pub fn binary(name: &str) -> PathBuf {
    static BUILT: OnceLock<Result<PathBuf, String>> = OnceLock::new();
    let dir = BUILT
        .get_or_init(|| {
            let exe = std::env::current_exe().map_err(|e| e.to_string())?;
            let deps = exe.parent().ok_or("test executable has no directory")?;
            let profile_dir = deps.parent().ok_or("deps has no parent")?.to_path_buf();
            let release = profile_dir.file_name().is_some_and(|n| n == "release");
            let cargo = std::env::var("CARGO").unwrap_or_else(|_| "cargo".into());
            let mut build = std::process::Command::new(cargo);
            build.args(["build", "--quiet", "--workspace", "--tests", "--bins"]);
            if release {
                build.arg("--release");
            }
            let status = build
                .status()
                .map_err(|e| format!("cannot run cargo: {e}"))?;
            if !status.success() {
                return Err(format!("cargo build --tests --bins failed: {status}"));
            }
            Ok(profile_dir)
        })
        .as_ref()
        .unwrap_or_else(|e| panic!("cannot build the workspace binaries: {e}"));
    dir.join(name)
}

/// A running binary of the workspace.
pub struct Server {
    child: Child,
    /// The address it logged as bound.
    pub addr: SocketAddr,
    logs: Arc<Mutex<String>>,
    /// The tasks copying its output into `logs`; they end when the process closes it.
    collectors: Vec<tokio::task::JoinHandle<()>>,
}

impl Server {
    /// Starts `binary` with `args` (which should include `--listen 127.0.0.1:0`) and
    /// extra environment variables, and waits until it logs `listening ... addr=`.
    /// Panics with the log when it does not come up.
    pub async fn start(binary_name: &str, args: &[&str], env: &[(&str, &str)]) -> Self {
        Self::start_at(&binary(binary_name), args, env).await
    }

    /// Like [`Server::start`], for the binary at `path`.
    pub async fn start_at(path: &std::path::Path, args: &[&str], env: &[(&str, &str)]) -> Self {
        let binary_name = path
            .file_name()
            .map(|n| n.to_string_lossy().into_owned())
            .unwrap_or_default();
        let mut command = Command::new(path);
        command
            .args(args)
            .env("LOG_FORMAT", "text")
            .env("RUST_LOG", "info")
            .envs(env.iter().copied())
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .kill_on_drop(true);
        let mut child = command
            .spawn()
            .unwrap_or_else(|e| panic!("cannot start {}: {e}", path.display()));
        let logs = Arc::new(Mutex::new(String::new()));
        let (addr_tx, addr_rx) = oneshot::channel();
        let mut addr_tx = Some(addr_tx);
        let mut collectors = Vec::new();
        if let Some(stdout) = child.stdout.take() {
            collectors.push(tokio::spawn(collect(
                BufReader::new(stdout),
                logs.clone(),
                None,
            )));
        }
        if let Some(stderr) = child.stderr.take() {
            collectors.push(tokio::spawn(collect(
                BufReader::new(stderr),
                logs.clone(),
                addr_tx.take(),
            )));
        }
        let addr = match tokio::time::timeout(START_TIMEOUT, addr_rx).await {
            Ok(Ok(addr)) => addr,
            _ => {
                let status = child.try_wait().ok().flatten();
                panic!(
                    "{binary_name} did not log its address (exit status {status:?}); log:\n{}",
                    logs.lock().map(|l| l.clone()).unwrap_or_default()
                );
            }
        };
        Self {
            child,
            addr,
            logs,
            collectors,
        }
    }

    /// The process id.
    pub fn pid(&self) -> Option<u32> {
        self.child.id()
    }

    /// `http://ADDR`, for gRPC clients.
    pub fn url(&self) -> String {
        format!("http://{}", self.addr)
    }

    /// Everything the process printed so far.
    pub fn logs(&self) -> String {
        self.logs.lock().map(|l| l.clone()).unwrap_or_default()
    }

    /// An address the process logged as `key=ADDR` (e.g. `metrics_addr`), waiting up to
    /// 5 s for the line; panics with the log when it never comes.
    pub async fn logged_addr(&self, key: &str) -> SocketAddr {
        let needle = format!("{key}=");
        for _ in 0..100 {
            if let Some(addr) = self.logs().lines().find_map(|line| {
                let at = line.find(&needle)?;
                // Not a longer key ending in this one (`health_addr` for `addr`).
                if line[..at].ends_with(|c: char| c.is_alphanumeric() || c == '_') {
                    return None;
                }
                line[at + needle.len()..]
                    .split_whitespace()
                    .next()?
                    .trim_matches('"')
                    .parse()
                    .ok()
            }) {
                return addr;
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        panic!("the server never logged `{key}=`:\n{}", self.logs())
    }

    /// Sends SIGTERM.
    pub fn terminate(&self) {
        if let Some(pid) = self.child.id() {
            let sent = std::process::Command::new("kill")
                .args(["-TERM", &pid.to_string()])
                .status();
            assert!(
                sent.is_ok_and(|s| s.success()),
                "cannot send SIGTERM to {pid}"
            );
        }
    }

    /// Waits for the process to exit, at most `limit`, and for its last output to be
    /// collected; panics with the log otherwise.
    pub async fn wait(&mut self, limit: Duration) -> ExitStatus {
        let status = match tokio::time::timeout(limit, self.child.wait()).await {
            Ok(Ok(status)) => status,
            _ => panic!(
                "process did not exit within {limit:?}; log:\n{}",
                self.logs()
            ),
        };
        // The process has exited; its last lines may still be in the pipe.
        for collector in self.collectors.drain(..) {
            let _ = tokio::time::timeout(Duration::from_secs(5), collector).await;
        }
        status
    }
}

async fn collect<R: tokio::io::AsyncBufRead + Unpin>(
    reader: R,
    logs: Arc<Mutex<String>>,
    mut addr_tx: Option<oneshot::Sender<SocketAddr>>,
) {
    let mut lines = reader.lines();
    while let Ok(Some(line)) = lines.next_line().await {
        if let Some(addr) = addr_tx.as_ref().and(listening_addr(&line))
            && let Some(tx) = addr_tx.take()
        {
            let _ = tx.send(addr);
        }
        if let Ok(mut logs) = logs.lock() {
            logs.push_str(&line);
            logs.push('\n');
        }
    }
}

/// The address in a `listening` log line, e.g. `... listening service="x" addr=127.0.0.1:4000`.
fn listening_addr(line: &str) -> Option<SocketAddr> {
    if !line.contains("listening") {
        return None;
    }
    let rest = &line[line.find("addr=")? + "addr=".len()..];
    rest.split_whitespace()
        .next()?
        .trim_matches('"')
        .parse()
        .ok()
}

/// Starts a tool executor on a free port.
pub async fn tool_executor(extra_args: &[&str]) -> Server {
    let mut args = vec!["--listen", "127.0.0.1:0"];
    args.extend_from_slice(extra_args);
    Server::start("tool-executor", &args, &[]).await
}

/// Starts an agent server on a free port, talking to the tool executor at `tools_url`,
/// with an `openai` provider registered through the environment that points nowhere
/// (for tests that make no run).
pub async fn agent_server(tools_url: &str, extra_args: &[&str]) -> Server {
    agent_server_with_model(tools_url, "http://127.0.0.1:9/v1", extra_args).await
}

/// Starts an agent server on a free port with the `openai` provider at `model_url`.
pub async fn agent_server_with_model(
    tools_url: &str,
    model_url: &str,
    extra_args: &[&str],
) -> Server {
    let mut args = vec!["--listen", "127.0.0.1:0", "--tool-executor", tools_url];
    args.extend_from_slice(extra_args);
    Server::start(
        "agent-server",
        &args,
        &[
            ("OPENAI_BASE_URL", model_url),
            ("OPENAI_API_KEY", "test-key"),
        ],
    )
    .await
}

/// Starts the model simulator on a free port with these scenarios (a JSON document as
/// the simulator's `--scenarios` file takes it); `url()` + `/v1` is its API.
pub async fn simulator(scenarios_json: &str, extra_args: &[&str]) -> Server {
    static COUNTER: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);
    let n = COUNTER.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    let path =
        std::env::temp_dir().join(format!("agentrt-scenarios-{}-{n}.json", std::process::id()));
    std::fs::write(&path, scenarios_json).expect("write the scenarios");
    let file = path.to_string_lossy().into_owned();
    let mut args = vec!["--listen", "127.0.0.1:0", "--scenarios", file.as_str()];
    args.extend_from_slice(extra_args);
    let server = Server::start("model-simulator", &args, &[]).await;
    // Read at start: the listening simulator needs it no more.
    let _ = std::fs::remove_file(&path);
    server
}

/// Starts a simulator, a tool executor and an agent server, runs an example client
/// (`program script --target ADDR --query "What is 6 * 7?"`) against them, and returns
/// what it printed; panics with both of its outputs when it fails.
pub async fn run_example_client(program: &str, script: &std::path::Path) -> String {
    let model = simulator(r#"{"scenarios": {}}"#, &[]).await;
    let tools = tool_executor(&[]).await;
    let agents = agent_server_with_model(&tools.url(), &format!("{}/v1", model.url()), &[]).await;
    let output = tokio::process::Command::new(program)
        .arg(script)
        .args([
            "--target",
            &agents.addr.to_string(),
            "--query",
            "What is 6 * 7?",
        ])
        .output()
        .await
        .unwrap_or_else(|e| panic!("cannot run {program}: {e}"));
    let stdout = String::from_utf8_lossy(&output.stdout).into_owned();
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(
        output.status.success(),
        "{} failed\nstdout:\n{stdout}\nstderr:\n{stderr}",
        script.display()
    );
    stdout
}

/// An address nothing listens on: bound, then released.
pub fn unused_addr() -> SocketAddr {
    let listener = std::net::TcpListener::bind("127.0.0.1:0").expect("bind an ephemeral port");
    listener.local_addr().expect("local address")
}

/// An address that refuses connections for as long as the returned socket lives: the
/// socket holds the port (bound, not listening), so no server another test starts can
/// take it meanwhile, as it could take a port that [`unused_addr`] let go.
pub fn refusing_addr() -> (SocketAddr, tokio::net::TcpSocket) {
    let socket = tokio::net::TcpSocket::new_v4().expect("a TCP socket");
    socket
        .bind("127.0.0.1:0".parse().expect("an address"))
        .expect("bind an ephemeral port");
    let addr = socket.local_addr().expect("local address");
    (addr, socket)
}

/// A Redis of a test's own (so that stopping it, or cutting its connections, disturbs no
/// other test), on `port`, without persistence: a restart empties it, as losing a cache
/// node would. Needs `redis-server` on `PATH` (`scripts/test` installs it).
pub struct OwnRedis {
    /// The port it listens on.
    pub port: u16,
    child: Option<Child>,
}

impl OwnRedis {
    /// Starts it and waits until it answers `PING`; panics, saying why, when it exits
    /// first (the port taken meanwhile by another test's server, say) or does not answer
    /// within 10 s, rather than let a test go on against another server.
    pub async fn start(port: u16) -> Self {
        let mut child = Command::new("redis-server")
            .args(["--bind", "127.0.0.1", "--port", &port.to_string()])
            .args(["--save", "", "--appendonly", "no"])
            .stdout(Stdio::null())
            .kill_on_drop(true)
            .spawn()
            .expect("this test needs redis-server on PATH (scripts/test installs it)");
        for _ in 0..200 {
            if let Ok(Some(status)) = child.try_wait() {
                panic!(
                    "redis-server on port {port} exited at start ({status}): was the port taken?"
                );
            }
            if answers_ping(port).await {
                return Self {
                    port,
                    child: Some(child),
                };
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        panic!("redis-server on port {port} did not answer PING within 10 s");
    }

    /// Its URL (database 0).
    pub fn url(&self) -> String {
        format!("redis://127.0.0.1:{}/0", self.port)
    }

    /// Kills it.
    pub async fn stop(&mut self) {
        if let Some(mut child) = self.child.take() {
            child.kill().await.unwrap();
        }
    }
}

/// Whether a Redis on `port` answers `PING` (not merely something accepting there).
async fn answers_ping(port: u16) -> bool {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let Ok(mut conn) = tokio::net::TcpStream::connect(("127.0.0.1", port)).await else {
        return false;
    };
    if conn.write_all(b"PING\r\n").await.is_err() {
        return false;
    }
    let mut answer = [0u8; 7];
    matches!(
        tokio::time::timeout(Duration::from_secs(1), conn.read_exact(&mut answer)).await,
        Ok(Ok(_)) if &answer == b"+PONG\r\n"
    )
}

/// A gRPC channel to `url`, connected now.
pub async fn connect(url: &str) -> tonic::transport::Channel {
    tonic::transport::Endpoint::from_shared(url.to_owned())
        .expect("valid URL")
        .connect_timeout(Duration::from_secs(10))
        .connect()
        .await
        .unwrap_or_else(|e| panic!("cannot connect to {url}: {e}"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn addresses_are_read_from_log_lines() {
        let line = "2026-11-22T08:00:00Z  INFO agentrt_grpc::grpc: listening service=\"tool-executor\" addr=127.0.0.1:41234";
        assert_eq!(
            listening_addr(line),
            Some("127.0.0.1:41234".parse().unwrap())
        );
        assert_eq!(listening_addr("draining addr=1.2.3.4:5"), None);
    }
}
