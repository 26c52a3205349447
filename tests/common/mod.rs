//! Fixtures the end-to-end tests share.

// Each test binary compiles this module and uses a part of it.
#![allow(dead_code)]

use std::{
    path::{Path, PathBuf},
    time::Duration,
};

use agentrt::{
    json::struct_to_json,
    v1::{self, agent_engine_client::AgentEngineClient, agent_service_client::AgentServiceClient},
};
use agentrt_test_support::{Server, agent_server_with_model, connect, simulator, tool_executor};
use serde_json::Value;
use tokio_stream::StreamExt;
use tonic::{Streaming, transport::Channel};

/// An agent named `name` on the simulator's `model`, with the calculator tool.
pub fn calculator_agent(name: &str, model: &str) -> v1::AgentConfig {
    v1::AgentConfig {
        name: name.into(),
        model: Some(v1::ModelConfig {
            name: model.into(),
            ..Default::default()
        }),
        tools: vec![v1::ToolRef {
            name: "calculator".into(),
            require_approval: false,
        }],
        ..Default::default()
    }
}

/// Creates an engine for `config`, in a new session, and returns its id.
pub async fn create_engine(
    service: &mut AgentServiceClient<Channel>,
    config: v1::AgentConfig,
) -> String {
    service
        .create_agent_engine(v1::CreateAgentEngineRequest {
            config: Some(config),
            session_id: String::new(),
        })
        .await
        .unwrap_or_else(|status| panic!("CreateAgentEngine failed: {status:?}"))
        .into_inner()
        .engine_id
}

/// The three binaries of a run, started on free ports: the model simulator on some
/// scenarios, the tool executor and the agent server, with clients of the agent server.
pub struct Stack {
    /// The model simulator.
    pub model: Server,
    /// The tool executor.
    pub tools: Server,
    /// The agent server.
    pub agents: Server,
    /// `AgentService` on the agent server.
    pub service: AgentServiceClient<Channel>,
    /// `AgentEngine` on the agent server.
    pub engine: AgentEngineClient<Channel>,
}

/// An agent named `tester` on the simulator's `model`, with these tools.
/// An `Execute` of the turn `message_id` on `engine_id`, asking "talk".
pub fn turn(engine_id: &str, message_id: &str) -> v1::ExecuteRequest {
    v1::ExecuteRequest {
        engine_id: engine_id.into(),
        message_id: message_id.into(),
        query: "talk".into(),
        ..Default::default()
    }
}

pub fn agent(model: &str, tools: &[&str]) -> v1::AgentConfig {
    v1::AgentConfig {
        name: "tester".into(),
        model: Some(v1::ModelConfig {
            name: model.into(),
            ..Default::default()
        }),
        tools: tools
            .iter()
            .map(|t| v1::ToolRef {
                name: (*t).into(),
                require_approval: false,
            })
            .collect(),
        parallel_tool_calls: true,
        ..Default::default()
    }
}

impl Stack {
    /// Starts the stack: the simulator on `scenarios` (JSON), and an agent server with
    /// these extra arguments.
    pub async fn up(scenarios: &str, agent_server_args: &[&str]) -> Self {
        Self::up_with(scenarios, &[], agent_server_args).await
    }

    /// Like [`Stack::up`], with extra arguments for the tool executor too (e.g.
    /// `["--config", "tool-executor.toml"]` for its tool sources).
    pub async fn up_with(
        scenarios: &str,
        tool_executor_args: &[&str],
        agent_server_args: &[&str],
    ) -> Self {
        let model = simulator(scenarios, &[]).await;
        let tools = tool_executor(tool_executor_args).await;
        let agents = agent_server_with_model(
            &tools.url(),
            &format!("{}/v1", model.url()),
            agent_server_args,
        )
        .await;
        let channel = connect(&agents.url()).await;
        Stack {
            model,
            tools,
            agents,
            service: AgentServiceClient::new(channel.clone()),
            engine: AgentEngineClient::new(channel),
        }
    }

    pub async fn engine_for(&mut self, config: v1::AgentConfig) -> String {
        create_engine(&mut self.service, config).await
    }

    pub async fn start(&mut self, engine_id: &str, query: &str) -> Streaming<v1::AgentStreamEvent> {
        self.engine
            .execute(v1::ExecuteRequest {
                engine_id: engine_id.into(),
                query: query.into(),
                ..Default::default()
            })
            .await
            .unwrap()
            .into_inner()
    }

    pub async fn run(&mut self, config: v1::AgentConfig, query: &str) -> Vec<v1::AgentStreamEvent> {
        let engine_id = self.engine_for(config).await;
        collect(self.start(&engine_id, query).await).await
    }

    /// Waits until the run is no longer running (at most `limit`, else panics with
    /// `what`) and returns its state.
    pub async fn ended(&mut self, run_id: &str, limit: Duration, what: &str) -> v1::AgentState {
        let deadline = tokio::time::Instant::now() + limit;
        loop {
            let state = self.state(run_id).await;
            if state.status != v1::RunStatus::Running as i32 {
                return state;
            }
            assert!(tokio::time::Instant::now() < deadline, "{what}");
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }

    pub async fn state(&mut self, run_id: &str) -> v1::AgentState {
        get_run(&mut self.engine, run_id).await
    }
}

/// `GetRun` of `run_id` through `engine`.
pub async fn get_run(engine: &mut AgentEngineClient<Channel>, run_id: &str) -> v1::AgentState {
    engine
        .get_run(v1::GetRunRequest {
            run_id: run_id.into(),
        })
        .await
        .unwrap()
        .into_inner()
}

/// A whole run's events, checked for well-formedness.
pub async fn collect(stream: Streaming<v1::AgentStreamEvent>) -> Vec<v1::AgentStreamEvent> {
    let events = rest(stream).await;
    assert_well_formed(&events);
    events
}

/// What is left of a stream.
pub async fn rest(mut stream: Streaming<v1::AgentStreamEvent>) -> Vec<v1::AgentStreamEvent> {
    let mut events = Vec::new();
    while let Some(event) = tokio::time::timeout(Duration::from_secs(30), stream.next())
        .await
        .expect("a stalled stream")
    {
        events.push(event.unwrap());
    }
    events
}

/// Sequences 1..n without gaps, one run, exactly one `done`, last.
pub fn assert_well_formed(events: &[v1::AgentStreamEvent]) {
    assert!(!events.is_empty());
    assert_eq!(
        kind(&events[0]),
        v1::EventType::RunStarted,
        "every run starts with RUN_STARTED"
    );
    for (i, event) in events.iter().enumerate() {
        assert_eq!(event.sequence, i as u64 + 1, "{events:#?}");
        assert_eq!(
            event.done,
            i + 1 == events.len(),
            "exactly one done event, last"
        );
        assert_eq!(event.run_id, events[0].run_id);
        assert!(event.iteration >= 1);
        assert!(event.create_time.is_some());
    }
}

/// The event's type.
pub fn kind(event: &v1::AgentStreamEvent) -> v1::EventType {
    v1::EventType::try_from(event.r#type).unwrap()
}

/// The event's payload as JSON.
pub fn data(event: &v1::AgentStreamEvent) -> Value {
    event.data.as_ref().map_or(Value::Null, struct_to_json)
}

/// The text of the events of one type, concatenated.
pub fn text(events: &[v1::AgentStreamEvent], of: v1::EventType) -> String {
    events
        .iter()
        .filter(|e| kind(e) == of && !e.done)
        .map(|e| e.content.as_str())
        .collect()
}

/// The payloads of the events of one type.
pub fn of_kind(events: &[v1::AgentStreamEvent], of: v1::EventType) -> Vec<Value> {
    events.iter().filter(|e| kind(e) == of).map(data).collect()
}

/// The payload of the last event.
pub fn done(events: &[v1::AgentStreamEvent]) -> Value {
    data(events.last().unwrap())
}

/// The installed MCP reference server `package`'s entry point (e.g. `server-everything`),
/// which `scripts/test` installs under `tests/mcp/node_modules`; panics saying so when it
/// is missing.
pub fn mcp_server(package: &str) -> String {
    let path = Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("tests/mcp/node_modules/@modelcontextprotocol")
        .join(package)
        .join("dist/index.js");
    assert!(
        path.exists(),
        "{} is missing: run `scripts/test` (it installs the MCP reference servers with \
         `npm ci --prefix tests/mcp`)",
        path.display()
    );
    path.display().to_string()
}

/// A temporary directory for one test, removed when dropped.
pub struct TempDir(pub PathBuf);

impl TempDir {
    pub fn new(test: &str) -> Self {
        let nanos = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .unwrap()
            .as_nanos();
        let dir = std::env::temp_dir().join(format!(
            "agentrt-tool-sources-{test}-{}-{nanos}",
            std::process::id()
        ));
        std::fs::create_dir_all(&dir).unwrap();
        Self(dir)
    }

    pub fn write(&self, name: &str, text: &str) -> PathBuf {
        let path = self.0.join(name);
        std::fs::write(&path, text).unwrap();
        path
    }
}

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// Serves `router` on a free port of 127.0.0.1 until the guard is dropped.
pub async fn serve_http(
    router: axum::Router,
) -> (std::net::SocketAddr, tokio_util::sync::DropGuard) {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let stop = tokio_util::sync::CancellationToken::new();
    let guard = stop.clone().drop_guard();
    tokio::spawn(async move {
        axum::serve(listener, router)
            .with_graceful_shutdown(async move { stop.cancelled().await })
            .await
            .unwrap();
    });
    (addr, guard)
}

/// Models whose runs end otherwise than with a complete answer, or speak before they call
/// a tool: what the example clients' outcome tests run against.
pub const EXAMPLE_OUTCOMES: &str = r#"{"scenarios": {
  "chatty": {"turns": [
    {"content": "Let me work that out.", "tool_calls": [
      {"id": "c1", "name": "calculator", "arguments": {"expression": "6 * 7"}}]},
    {"content": "It is 42."}]},
  "cut": {"turns": [{"content": "The answer is", "finish_reason": "length"}]},
  "broken": {"turns": [{"error": {"status": 400, "message": "the prompt is malformed"}}]}
}}"#;

/// Checks that an example client tells a complete answer from a cut one and from a failed
/// run, and prints as the answer only the text of the run's last round, against a stack of
/// [`EXAMPLE_OUTCOMES`]. `run(args, code)` runs the example with `args`, fails unless it
/// exits with `code`, and returns what it printed.
pub async fn example_reports_each_outcome<F, Fut>(run: F)
where
    F: Fn(&'static [&'static str], i32) -> Fut,
    Fut: std::future::Future<Output = String>,
{
    let stdout = run(&["--model", "chatty", "--query", "6 * 7?"], 0).await;
    assert!(stdout.contains("answer: It is 42.\n"), "{stdout}");
    assert!(
        !stdout.contains("Let me work that out.It is 42."),
        "{stdout}"
    );

    let output = run(&["--model", "cut", "--query", "6 * 7?"], 1).await;
    assert!(output.contains("answer: The answer is"), "{output}");
    assert!(
        output.contains("the answer is incomplete (max_tokens)"),
        "{output}"
    );

    let output = run(&["--model", "broken", "--query", "6 * 7?"], 1).await;
    assert!(!output.contains("answer: "), "{output}");
    assert!(output.contains("run failed: "), "{output}");
    assert!(output.contains("the prompt is malformed"), "{output}");
}

/// Runs example client `script` with `program` (python3, node) against `stack`, with
/// `args` and `stdin` piped in; fails unless it exits with `code` within 60 s. Returns its
/// standard output when it was to succeed, both outputs otherwise.
pub async fn run_example_exiting(
    program: &str,
    script: &Path,
    stack: &Stack,
    args: &[&str],
    stdin: &str,
    code: i32,
) -> String {
    use tokio::io::AsyncWriteExt;
    let mut child = tokio::process::Command::new(program)
        .arg(script)
        .args(["--target", &stack.agents.addr.to_string()])
        .args(args)
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .kill_on_drop(true)
        .spawn()
        .unwrap_or_else(|e| panic!("cannot run {program}: {e}"));
    let mut input = child.stdin.take().unwrap();
    input.write_all(stdin.as_bytes()).await.unwrap();
    drop(input);
    let output = tokio::time::timeout(Duration::from_secs(60), child.wait_with_output())
        .await
        .unwrap_or_else(|_| panic!("the example with {args:?} did not end within 60 s"))
        .unwrap();
    let stdout = String::from_utf8_lossy(&output.stdout).into_owned();
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert_eq!(
        output.status.code(),
        Some(code),
        "the example with {args:?} exited {} (not {code})\nstdout:\n{stdout}\nstderr:\n{stderr}",
        output.status
    );
    if code == 0 {
        stdout
    } else {
        format!("{stdout}{stderr}")
    }
}

/// Calls `call` until it is not refused for a budget (a run frees its share of the
/// budgets just after its last event), for at most two seconds.
pub async fn when_room<F, Fut>(mut call: F) -> tonic::Streaming<v1::AgentStreamEvent>
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<
            Output = Result<tonic::Response<tonic::Streaming<v1::AgentStreamEvent>>, tonic::Status>,
        >,
{
    let deadline = tokio::time::Instant::now() + Duration::from_secs(2);
    loop {
        match call().await {
            Ok(response) => return response.into_inner(),
            Err(status)
                if status.code() == tonic::Code::ResourceExhausted
                    && tokio::time::Instant::now() < deadline =>
            {
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
            Err(status) => panic!("{status:?}"),
        }
    }
}
