//! `agentrt-bench`: measures the real stack, client -> agent-server -> model simulator
//! (HTTP/SSE) -> tool-executor (gRPC), and prints each figure.
//!
//! ```sh
//! cargo build --release --workspace --bins && target/release/agentrt-bench
//! ```
//!
//! CPU time and memory are read from `/proc` for the server processes only, so the bench
//! client's own work does not count. Linux only.
//!
//! With `--state redis://...` the agent-servers share their state through that Redis
//! (`--replicas N` of them, clients spread over all), and Redis's own CPU (from its
//! `INFO cpu`) and memory per ended run (`INFO memory`, before and after, with the runs'
//! keys still retained) are printed beside the figures.

use std::{
    path::{Path, PathBuf},
    sync::Arc,
    time::{Duration, Instant},
};

use agentrt::v1::{
    self, agent_engine_client::AgentEngineClient, agent_service_client::AgentServiceClient,
};
use agentrt_test_support::Server;
use anyhow::{Context, bail};
use clap::Parser;
use futures_util::StreamExt;
use tonic::transport::{Channel, Endpoint};

mod durability;
mod tool_sources;
mod waiting;

/// mimalloc, as in the servers: the bench client shares the cores with the stack it
/// measures, so its own allocation costs should stay small.
#[global_allocator]
static ALLOCATOR: mimalloc::MiMalloc = mimalloc::MiMalloc;

/// Benchmarks the real stack and prints the figures.
#[derive(Debug, Parser)]
#[command(name = "agentrt-bench", version, about)]
struct Cli {
    /// Concurrent runs in the load figure.
    #[arg(long, default_value_t = 10_000)]
    concurrent: usize,
    /// Model latency per call in the load figure, in milliseconds.
    #[arg(long, default_value_t = 1000)]
    latency_ms: u64,
    /// The agent-servers' state: `memory`, or a Redis URL shared by every replica.
    #[arg(long, default_value = "memory")]
    state: String,
    /// Agent-server replicas (more than one needs a Redis `--state`); the bench's clients
    /// spread their runs over all of them.
    #[arg(long, default_value_t = 1)]
    replicas: usize,
    /// Runs of the tool-loop figure (10 tool iterations each).
    #[arg(long, default_value_t = 200)]
    tool_runs: usize,
    /// Runs of the streaming figure (2,000 answer deltas each).
    #[arg(long, default_value_t = 200)]
    stream_runs: usize,
    /// Runs streaming at once in the streaming figure.
    #[arg(long, default_value_t = 100)]
    stream_concurrency: usize,
    /// Sequential runs of the first-event figure.
    #[arg(long, default_value_t = 500)]
    latency_runs: usize,
    /// Call the model over HTTP/1.1, one connection per call in flight, instead of
    /// HTTP/2 (h2c) sharing one connection.
    #[arg(long)]
    model_http1: bool,
    /// The agent-server's HTTP client of the model: `lean` (the h2c client) or `general`
    /// (reqwest on hyper, with HTTP/2 prior knowledge unless `--model-http1`).
    #[arg(long, default_value = "lean", value_parser = ["lean", "general"])]
    model_client: String,
    /// Serve the simulator over HTTPS, HTTP/2 negotiated by ALPN, as hosted providers
    /// serve (a CA of the bench's own, trusted by agent-server through `SSL_CERT_FILE`):
    /// agent-server calls it with the general client (reqwest, rustls).
    #[arg(long, conflicts_with = "model_http1")]
    model_tls: bool,
    /// Measure the tool executor's tool sources (MCP over stdio, OpenAPI) instead of the
    /// stack: see `tool_sources.rs`.
    #[arg(long)]
    tool_sources: bool,
    /// The MCP server `--tool-sources` runs with node: server-everything's entry point.
    #[arg(
        long,
        default_value = "tests/mcp/node_modules/@modelcontextprotocol/server-everything/dist/index.js"
    )]
    mcp_server_js: PathBuf,
    /// Measure how fast runs move between replicas (hand-over on SIGTERM, take-over after
    /// a kill, lease renewal) instead: see `durability.rs`. Needs a Redis `--state`.
    #[arg(long)]
    durability: bool,
    /// Runs in flight in each `--durability` figure.
    #[arg(long, default_value_t = 1000)]
    durable_runs: usize,
    /// The replicas' `runs.takeover_after` in `--durability`, in milliseconds.
    #[arg(long, default_value_t = 10_000)]
    takeover_after_ms: u64,
    /// Measure what runs waiting for their client cost (memory while they wait, CPU to
    /// resume them) instead: see `waiting.rs`.
    #[arg(long)]
    waiting: bool,
    /// Runs waiting at once in `--waiting`.
    #[arg(long, default_value_t = 100_000)]
    waiting_runs: usize,
    /// Print the load figure at several concurrencies instead (each on a fresh stack):
    /// failures, wall time, CPU and memory per run, the simulator's and the bench
    /// client's own CPU, descriptors, and health-check latency during the load.
    #[arg(long)]
    scale: bool,
    /// The concurrencies of `--scale`.
    #[arg(long, value_delimiter = ',', default_value = "1000,10000,50000,100000")]
    scale_levels: Vec<usize>,
}

/// Characters, streamed one per delta, of the `long_answer` scenario.
const LONG_ANSWER_CHARS: usize = 2000;

/// Tool rounds of the `tool_loop` scenario: each a different call, so that the engine's
/// repetition guard lets every one run.
const TOOL_LOOP_ROUNDS: usize = 10;

fn scenarios(latency_ms: u64) -> String {
    let tool_turn = |i: usize| {
        format!(
            r#"{{"tool_calls": [{{"name": "calculator", "arguments": {{"expression": "{i} * 7"}}}}]}}"#
        )
    };
    let tool_loop: Vec<String> = (1..=TOOL_LOOP_ROUNDS)
        .map(tool_turn)
        .chain([r#"{"content": "done"}"#.to_owned()])
        .collect();
    let slow_tool = format!(
        r#"{{"latency_ms": {latency_ms}, "tool_calls": [{{"name": "calculator", "arguments": {{"expression": "6 * 7"}}}}]}}"#
    );
    let slow_answer = format!(r#"{{"latency_ms": {latency_ms}, "content": "The answer is 42."}}"#);
    format!(
        r#"{{"scenarios": {{
            "hello": {{"turns": [{{"content": "hi"}}]}},
            "tool_loop": {{"turns": [{}]}},
            "long_answer": {{"turns": [{{"content": "{}", "chunk_chars": 1}}]}},
            "three_calls": {{"turns": [{slow_tool}, {slow_tool}, {slow_answer}]}}
        }}}}"#,
        tool_loop.join(","),
        "x".repeat(LONG_ANSWER_CHARS),
    )
}

/// CPU time a process has used so far, in nanoseconds: the sum of its threads'
/// `schedstat` run times (clock ticks in `/proc/<pid>/stat` are too coarse).
fn cpu_time(pid: u32) -> anyhow::Result<Duration> {
    let mut total = 0u64;
    for task in std::fs::read_dir(format!("/proc/{pid}/task"))? {
        let path = task?.path().join("schedstat");
        // A thread may end between listing and reading; it no longer counts.
        if let Ok(stat) = std::fs::read_to_string(path) {
            total += stat
                .split_whitespace()
                .next()
                .context("malformed schedstat")?
                .parse::<u64>()?;
        }
    }
    Ok(Duration::from_nanos(total))
}

/// The simulator on some scenarios and a tool executor, for a figure that starts its own
/// agent-servers; the files they read are removed when dropped.
pub(crate) struct Backends {
    /// The model simulator (kept running while this lives).
    _model: Server,
    /// The tool executor.
    pub tools: Server,
    /// An agent-server config naming the simulator as provider `simulator` (over h2c).
    pub config_file: PathBuf,
    scenarios_file: PathBuf,
}

impl Backends {
    /// Starts them; `name` tells the files of this figure apart.
    pub async fn start(dir: &Path, name: &str, scenarios: &str) -> anyhow::Result<Self> {
        let tag = format!("agentrt-bench-{name}-{}", std::process::id());
        let scenarios_file = std::env::temp_dir().join(format!("{tag}.json"));
        std::fs::write(&scenarios_file, scenarios)?;
        let config_file = std::env::temp_dir().join(format!("{tag}.toml"));
        let model = Server::start_at(
            &dir.join("model-simulator"),
            &[
                "--listen",
                "127.0.0.1:0",
                "--scenarios",
                &scenarios_file.to_string_lossy(),
            ],
            &[],
        )
        .await;
        std::fs::write(
            &config_file,
            format!(
                "[providers.simulator]\nbase_url = \"{}/v1\"\nhttp2_prior_knowledge = true\n",
                model.url()
            ),
        )?;
        let tools = Server::start_at(
            &dir.join("tool-executor"),
            &["--listen", "127.0.0.1:0"],
            &[],
        )
        .await;
        Ok(Self {
            _model: model,
            tools,
            config_file,
            scenarios_file,
        })
    }
}

impl Drop for Backends {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.scenarios_file);
        let _ = std::fs::remove_file(&self.config_file);
    }
}

/// Resident memory of a process, in KiB.
fn rss_kib(pid: u32) -> anyhow::Result<u64> {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status"))?;
    let line = status
        .lines()
        .find(|l| l.starts_with("VmRSS:"))
        .context("no VmRSS")?;
    Ok(line
        .split_whitespace()
        .nth(1)
        .context("malformed VmRSS")?
        .parse()?)
}

struct Stack {
    /// The simulator.
    model: Server,
    tools: Server,
    agents: Vec<Server>,
    channels: Vec<Channel>,
}

impl Stack {
    fn pids(&self) -> anyhow::Result<(Vec<u32>, u32)> {
        Ok((
            self.agents
                .iter()
                .map(|a| a.pid().context("agent-server exited"))
                .collect::<anyhow::Result<_>>()?,
            self.tools.pid().context("tool-executor exited")?,
        ))
    }

    fn service(&self) -> AgentServiceClient<Channel> {
        AgentServiceClient::new(self.channels[0].clone())
    }

    fn engine(&self, i: usize) -> AgentEngineClient<Channel> {
        AgentEngineClient::new(self.channels[i % self.channels.len()].clone())
    }

    /// One engine per run, so that every run starts with an empty history.
    async fn engines(&self, model: &str, count: usize) -> anyhow::Result<Vec<String>> {
        let config = v1::AgentConfig {
            name: "bench".into(),
            model: Some(v1::ModelConfig {
                name: model.into(),
                ..Default::default()
            }),
            tools: vec![v1::ToolRef {
                name: "calculator".into(),
                require_approval: false,
            }],
            max_iterations: 20,
            ..Default::default()
        };
        let mut ids = Vec::with_capacity(count);
        let mut service = self.service();
        for _ in 0..count {
            let request = v1::CreateAgentEngineRequest {
                config: Some(config.clone()),
                session_id: String::new(),
            };
            ids.push(
                service
                    .create_agent_engine(request)
                    .await?
                    .into_inner()
                    .engine_id,
            );
        }
        Ok(ids)
    }

    /// Runs one turn to its end; returns what it did, and why it failed if it did not
    /// answer.
    async fn run(&self, i: usize, engine_id: String) -> anyhow::Result<RunOutcome> {
        let started = Instant::now();
        let request = v1::ExecuteRequest {
            engine_id,
            query: "What is 6 * 7?".into(),
            ..Default::default()
        };
        let mut stream = self.engine(i).execute(request).await?.into_inner();
        let mut outcome = RunOutcome {
            failure: Some("the stream ended without a done event".to_owned()),
            ..RunOutcome::default()
        };
        while let Some(event) = stream.next().await {
            let event = match event {
                Ok(event) => event,
                Err(status) => {
                    outcome.failure = Some(format!("{:?}: {}", status.code(), status.message()));
                    break;
                }
            };
            outcome.first_event.get_or_insert_with(|| started.elapsed());
            outcome.events += 1;
            let kind = v1::EventType::try_from(event.r#type).unwrap_or_default();
            if matches!(kind, v1::EventType::Thought | v1::EventType::FinalAnswer) && !event.done {
                outcome
                    .first_output
                    .get_or_insert_with(|| started.elapsed());
                outcome.deltas += 1;
            }
            if kind == v1::EventType::ToolResult {
                outcome.tool_results += 1;
            }
            if event.done {
                outcome.failure =
                    (kind != v1::EventType::FinalAnswer).then(|| event.content.clone());
                outcome.stop_reason = event
                    .data
                    .as_ref()
                    .map(agentrt::json::struct_to_json)
                    .and_then(|d| d["stop_reason"].as_str().map(str::to_owned))
                    .unwrap_or_default();
            }
        }
        Ok(outcome)
    }

    /// Runs every engine's turn, at most `concurrency` at once.
    async fn run_all(
        self: &Arc<Self>,
        engines: Vec<String>,
        concurrency: usize,
    ) -> anyhow::Result<Totals> {
        let results: Vec<anyhow::Result<RunOutcome>> =
            futures_util::stream::iter(engines.into_iter().enumerate())
                .map(|(i, id)| {
                    let stack = self.clone();
                    async move { tokio::spawn(async move { stack.run(i, id).await }).await? }
                })
                .buffer_unordered(concurrency)
                .collect()
                .await;
        let mut totals = Totals::default();
        let mut failures = std::collections::BTreeMap::<String, usize>::new();
        for result in results {
            let outcome = result.unwrap_or_else(|error| RunOutcome {
                failure: Some(format!("{error:#}")),
                ..RunOutcome::default()
            });
            totals.events += outcome.events;
            totals.deltas += outcome.deltas;
            totals.tool_results += outcome.tool_results;
            *totals.stop_reasons.entry(outcome.stop_reason).or_default() += 1;
            if let Some(failure) = outcome.failure {
                *failures.entry(failure).or_default() += 1;
            }
        }
        for (failure, count) in &failures {
            eprintln!("  {count} runs failed: {failure}");
        }
        totals.failed = failures.values().sum();
        Ok(totals)
    }
}

/// What one run did, as its client saw it.
#[derive(Debug, Default)]
struct RunOutcome {
    /// Time to the first event (EVENT_TYPE_RUN_STARTED).
    first_event: Option<Duration>,
    /// Time to the first text the model produced.
    first_output: Option<Duration>,
    events: usize,
    deltas: usize,
    tool_results: usize,
    stop_reason: String,
    failure: Option<String>,
}

/// What a batch of runs did, all together.
#[derive(Debug, Default)]
struct Totals {
    events: usize,
    deltas: usize,
    tool_results: usize,
    stop_reasons: std::collections::BTreeMap<String, usize>,
    failed: usize,
}

impl Totals {
    /// Refuses to go on when the runs did other work than a figure assumes: a figure from
    /// such runs would count work that did not happen.
    fn expect(
        &self,
        what: &str,
        runs: usize,
        tool_results: usize,
        stop_reason: &str,
    ) -> anyhow::Result<()> {
        if self.failed > 0
            || self.tool_results != tool_results
            || self.stop_reasons.get(stop_reason) != Some(&runs)
        {
            bail!(
                "{what}: the runs did not do the work the figure counts: expected {runs} runs \
                 ending {stop_reason:?} with {tool_results} tool results, got {} tool results, \
                 stop reasons {:?}, {} failed runs",
                self.tool_results,
                self.stop_reasons,
                self.failed
            );
        }
        Ok(())
    }
}

/// How the bench's agent-server speaks to the simulator.
fn model_protocol(cli: &Cli) -> &'static str {
    if cli.model_http1 {
        "HTTP/1.1"
    } else if cli.model_tls {
        "HTTPS, HTTP/2 by ALPN"
    } else {
        "HTTP/2"
    }
}

/// The agent-server's client of the simulator (the lean one speaks only h2c).
fn model_client(cli: &Cli) -> &str {
    if cli.model_tls {
        "general"
    } else {
        &cli.model_client
    }
}

/// The simulator's certificate and key, and the CA agent-server trusts it through.
struct Pki {
    ca: String,
    cert: String,
    key: String,
}

/// Writes a CA and a certificate it signs for `localhost` into `dir`.
fn write_pki(dir: &Path) -> anyhow::Result<Pki> {
    use rcgen::{BasicConstraints, CertificateParams, CertifiedIssuer, IsCa, KeyPair};
    let mut params = CertificateParams::new(Vec::<String>::new())?;
    params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
    let ca = CertifiedIssuer::self_signed(params, KeyPair::generate()?)?;
    let key = KeyPair::generate()?;
    let cert = CertificateParams::new(vec!["localhost".to_owned()])?.signed_by(&key, &ca)?;
    let path = |file: &str| dir.join(file).to_string_lossy().into_owned();
    let pki = Pki {
        ca: path("bench-ca.pem"),
        cert: path("bench-simulator.pem"),
        key: path("bench-simulator.key"),
    };
    std::fs::write(&pki.ca, ca.pem())?;
    std::fs::write(&pki.cert, cert.pem())?;
    std::fs::write(&pki.key, key.serialize_pem())?;
    Ok(pki)
}

async fn start(
    dir: &Path,
    cli: &Cli,
    concurrent: usize,
    scenarios_file: &Path,
    config_file: &Path,
) -> anyhow::Result<Arc<Stack>> {
    let scenarios_file = &*scenarios_file.to_string_lossy();
    let mut model_args = vec!["--listen", "127.0.0.1:0", "--scenarios", scenarios_file];
    let pki = cli.model_tls.then(|| write_pki(dir)).transpose()?;
    if let Some(pki) = &pki {
        model_args.extend(["--tls-cert", &pki.cert, "--tls-key", &pki.key]);
    }
    let model = Server::start_at(&dir.join("model-simulator"), &model_args, &[]).await;
    let model_url = match &pki {
        Some(_) => format!("https://localhost:{}", model.addr.port()),
        None => model.url(),
    };
    let tools = Server::start_at(
        &dir.join("tool-executor"),
        &["--listen", "127.0.0.1:0"],
        &[],
    )
    .await;
    std::fs::write(
        config_file,
        format!(
            "[providers.simulator]\nbase_url = \"{}/v1\"\nhttp2_prior_knowledge = {}\nhttp_client = \"{}\"\n",
            model_url,
            !cli.model_http1 && !cli.model_tls,
            cli.model_client
        ),
    )?;
    let max_engines = (concurrent * 2 + 10_000).to_string();
    let prefix = format!("agentrt-bench-{}", std::process::id());
    let mut agent_env = vec![("RUST_LOG", "warn,agentrt_grpc=info")];
    if let Some(pki) = &pki {
        agent_env.push(("SSL_CERT_FILE", pki.ca.as_str()));
    }
    let mut agents = Vec::with_capacity(cli.replicas);
    for _ in 0..cli.replicas.max(1) {
        agents.push(
            Server::start_at(
                &dir.join("agent-server"),
                &[
                    "--listen",
                    "127.0.0.1:0",
                    "--tool-executor",
                    &tools.url(),
                    "--max-engines",
                    &max_engines,
                    "--max-active-runs",
                    &max_engines,
                    "--config",
                    &config_file.to_string_lossy(),
                    "--state",
                    &cli.state,
                    "--state-key-prefix",
                    &prefix,
                    "--health-listen",
                    "127.0.0.1:0",
                ],
                &agent_env,
            )
            .await,
        );
    }
    // Enough connections that no one carries more streams than the server allows, and at
    // least one per replica.
    let connections = concurrent.div_ceil(512).max(agents.len());
    let mut channels = Vec::with_capacity(connections);
    for i in 0..connections {
        channels.push(
            Endpoint::from_shared(agents[i % agents.len()].url())?
                .initial_connection_window_size(16 * 1024 * 1024)
                .initial_stream_window_size(1024 * 1024)
                .tcp_nodelay(true)
                .connect()
                .await?,
        );
    }
    Ok(Arc::new(Stack {
        model,
        tools,
        agents,
        channels,
    }))
}

/// Redis's CPU (user + system) and memory, from `INFO`.
struct RedisStats {
    url: String,
}

impl RedisStats {
    fn info(&self) -> anyhow::Result<(Duration, u64)> {
        let client = redis::Client::open(self.url.as_str())?;
        let mut connection = client.get_connection()?;
        let info: String = redis::cmd("INFO").arg("cpu").query(&mut connection)?;
        let memory: String = redis::cmd("INFO").arg("memory").query(&mut connection)?;
        let field = |text: &str, name: &str| -> anyhow::Result<f64> {
            text.lines()
                .find_map(|l| l.strip_prefix(name)?.strip_prefix(':'))
                .context("INFO field missing")?
                .trim()
                .parse::<f64>()
                .map_err(Into::into)
        };
        let cpu = field(&info, "used_cpu_user")? + field(&info, "used_cpu_sys")?;
        Ok((
            Duration::from_secs_f64(cpu),
            field(&memory, "used_memory")? as u64,
        ))
    }
}

fn percentile(sorted: &[Duration], p: f64) -> Duration {
    let index = ((sorted.len() as f64 - 1.0) * p).round() as usize;
    sorted[index.min(sorted.len() - 1)]
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let cli = Cli::parse();
    let dir: PathBuf = std::env::current_exe()?
        .parent()
        .context("no directory")?
        .to_path_buf();
    if cli.tool_sources {
        return tool_sources::run(&dir, &cli.mcp_server_js).await;
    }
    if cli.waiting {
        return waiting::run(&dir, &cli.state, cli.waiting_runs).await;
    }
    if cli.durability {
        return durability::run(
            &dir,
            &cli.state,
            cli.durable_runs,
            cli.concurrent,
            Duration::from_millis(cli.takeover_after_ms),
        )
        .await;
    }
    for binary in ["agent-server", "tool-executor", "model-simulator"] {
        if !dir.join(binary).exists() {
            bail!(
                "{binary} is missing beside the bench: run `cargo build --release --workspace --bins` first"
            );
        }
    }
    let scenarios_file =
        std::env::temp_dir().join(format!("agentrt-bench-{}.json", std::process::id()));
    std::fs::write(&scenarios_file, scenarios(cli.latency_ms))?;
    let config_file =
        std::env::temp_dir().join(format!("agentrt-bench-{}.toml", std::process::id()));
    if cli.replicas > 1 && cli.state == "memory" {
        bail!(
            "--replicas {} needs a shared state: --state redis://...",
            cli.replicas
        );
    }
    let redis = (cli.state != "memory").then(|| RedisStats {
        url: cli.state.clone(),
    });
    if cli.scale {
        let result = scale(&dir, &cli, &scenarios_file, &config_file).await;
        let _ = std::fs::remove_file(&scenarios_file);
        let _ = std::fs::remove_file(&config_file);
        return result;
    }
    let stack = start(&dir, &cli, cli.concurrent, &scenarios_file, &config_file).await?;
    let (agent_pids, tools_pid) = stack.pids()?;
    let agents_cpu =
        |pids: &[u32]| -> anyhow::Result<Duration> { pids.iter().map(|pid| cpu_time(*pid)).sum() };
    let cpu = || -> anyhow::Result<(Duration, Duration)> {
        Ok((agents_cpu(&agent_pids)?, cpu_time(tools_pid)?))
    };
    let redis_cpu = || -> anyhow::Result<Duration> {
        redis
            .as_ref()
            .map_or(Ok(Duration::ZERO), |r| r.info().map(|(cpu, _)| cpu))
    };
    println!(
        "agentrt-bench: {} cores; client -> {} agent-server{} (state: {}) -> simulator ({} SSE) -> tool-executor (gRPC)",
        std::thread::available_parallelism().map_or(1, |n| n.get()),
        stack.agents.len(),
        if stack.agents.len() == 1 { "" } else { "s" },
        if redis.is_some() { "Redis" } else { "memory" },
        model_protocol(&cli),
    );
    println!("model client: {}", model_client(&cli));

    // Warm up connections, caches and the tokenizer.
    let warm = stack.engines("tool_loop", 20).await?;
    stack
        .run_all(warm, 10)
        .await?
        .expect("warm-up", 20, 20 * TOOL_LOOP_ROUNDS, "final_answer")?;

    // 1. CPU per tool iteration: 10 model rounds with a (different) tool call each, plus
    // an answer; every run is checked to have made its 10 tool calls and answered.
    let engines = stack.engines("tool_loop", cli.tool_runs).await?;
    let (a0, t0) = cpu()?;
    let (r0, memory0) = match &redis {
        Some(r) => r.info()?,
        None => (Duration::ZERO, 0),
    };
    let totals = stack.run_all(engines, 16).await?;
    let (a1, t1) = cpu()?;
    let (r1, memory1) = match &redis {
        Some(r) => r.info()?,
        None => (Duration::ZERO, 0),
    };
    totals.expect(
        "tool iterations",
        cli.tool_runs,
        cli.tool_runs * TOOL_LOOP_ROUNDS,
        "final_answer",
    )?;
    let iterations = cli.tool_runs * TOOL_LOOP_ROUNDS;
    let per_iteration = (a1 - a0 + t1 - t0) / iterations as u32;
    println!(
        "tool iteration CPU (agent-server + tool-executor): {:.1} us per iteration  [{} runs x {TOOL_LOOP_ROUNDS} tool calls, all run; agent-server {:?}, tool-executor {:?}]",
        per_iteration.as_secs_f64() * 1e6,
        cli.tool_runs,
        a1 - a0,
        t1 - t0
    );
    if redis.is_some() {
        println!(
            "Redis: CPU {:.1} us per tool iteration, {:.0} us per run; memory {:.1} KB per ended run (retained)  [{} runs]",
            (r1 - r0).as_secs_f64() * 1e6 / iterations as f64,
            (r1 - r0).as_secs_f64() * 1e6 / cli.tool_runs as f64,
            memory1.saturating_sub(memory0) as f64 / 1000.0 / cli.tool_runs as f64,
            cli.tool_runs
        );
    }

    // 2. agent-server CPU per streamed answer delta.
    let engines = stack.engines("long_answer", cli.stream_runs).await?;
    let (a0, _) = cpu()?;
    let r0 = redis_cpu()?;
    let totals = stack.run_all(engines, cli.stream_concurrency).await?;
    let (a1, _) = cpu()?;
    let r1 = redis_cpu()?;
    totals.expect("answer deltas", cli.stream_runs, 0, "final_answer")?;
    if totals.deltas != cli.stream_runs * LONG_ANSWER_CHARS {
        bail!(
            "answer deltas: expected {} deltas, got {}",
            cli.stream_runs * LONG_ANSWER_CHARS,
            totals.deltas
        );
    }
    println!(
        "answer delta CPU (agent-server): {:.2} us per delta  [{} runs, {} at once, {} deltas, {} events]",
        (a1 - a0).as_secs_f64() * 1e6 / totals.deltas as f64,
        cli.stream_runs,
        cli.stream_concurrency,
        totals.deltas,
        totals.events
    );
    if redis.is_some() {
        println!(
            "Redis: CPU {:.2} us per delta",
            (r1 - r0).as_secs_f64() * 1e6 / totals.deltas as f64
        );
    }

    // 3. Time to the first event, measured at the client (an upper bound of the time after
    // Execute reaches the server): sequential runs, no model latency.
    let engines = stack.engines("hello", cli.latency_runs).await?;
    let mut firsts = Vec::with_capacity(engines.len());
    let mut outputs = Vec::with_capacity(engines.len());
    for (i, id) in engines.into_iter().enumerate() {
        let outcome = stack.run(i, id).await?;
        match (outcome.first_event, outcome.first_output, &outcome.failure) {
            (Some(event), Some(output), None) => {
                firsts.push(event);
                outputs.push(output);
            }
            _ => bail!("first event: a run did not answer with text: {outcome:?}"),
        }
    }
    firsts.sort();
    outputs.sort();
    println!(
        "first event (run started), client-observed: p50 {:.3} ms, p99 {:.3} ms; first model output: p50 {:.3} ms, p99 {:.3} ms  [{} sequential runs]",
        percentile(&firsts, 0.5).as_secs_f64() * 1e3,
        percentile(&firsts, 0.99).as_secs_f64() * 1e3,
        percentile(&outputs, 0.5).as_secs_f64() * 1e3,
        percentile(&outputs, 0.99).as_secs_f64() * 1e3,
        cli.latency_runs
    );

    // 4. Load: runs of 3 model calls (each with the model latency) and 2 tool calls, all at
    // once; CPU per run at 100 and at full concurrency; memory per in-flight run.
    let small = 100.min(cli.concurrent);
    let engines = stack.engines("three_calls", small).await?;
    let (a0, t0) = cpu()?;
    stack.run_all(engines, small).await?.expect(
        "load, 100 runs",
        small,
        small * 2,
        "final_answer",
    )?;
    let (a1, t1) = cpu()?;
    let cpu_small = (a1 - a0 + t1 - t0) / small as u32;

    let r0 = redis_cpu()?;
    let load = load(&stack, cli.concurrent).await?;
    let r1 = redis_cpu()?;
    println!(
        "{} concurrent runs (3 model calls of {} ms, 2 tool calls each): wall {:.2} s; failed runs: {}  [CPU in s: agent-server {:.2}, tool-executor {:.2}, simulator {:.2}, bench client {:.2}]",
        cli.concurrent,
        cli.latency_ms,
        load.wall.as_secs_f64(),
        load.failed,
        load.agents_cpu.as_secs_f64(),
        load.tools_cpu.as_secs_f64(),
        load.model_cpu.as_secs_f64(),
        load.bench_cpu.as_secs_f64(),
    );
    if redis.is_some() {
        println!(
            "Redis: CPU {:.2} s in the load, {:.0} us per run",
            (r1 - r0).as_secs_f64(),
            (r1 - r0).as_secs_f64() * 1e6 / cli.concurrent as f64
        );
    }
    println!(
        "agent-server memory per in-flight run: {:.1} KB  [RSS {} KiB before, peak {} KiB]",
        load.memory_per_run_kb(),
        load.rss_before,
        load.rss_peak
    );
    println!(
        "CPU per run (agent-server + tool-executor): {:.0} us at {small} concurrent, {:.0} us at {}",
        cpu_small.as_secs_f64() * 1e6,
        load.cpu_per_run().as_secs_f64() * 1e6,
        cli.concurrent
    );
    let _ = std::fs::remove_file(&scenarios_file);
    let _ = std::fs::remove_file(&config_file);
    Ok(())
}

/// What one load of `concurrent` runs (3 model calls and 2 tool calls each, all at once)
/// cost and did.
struct Load {
    concurrent: usize,
    failed: usize,
    wall: Duration,
    agents_cpu: Duration,
    tools_cpu: Duration,
    model_cpu: Duration,
    bench_cpu: Duration,
    rss_before: u64,
    rss_peak: u64,
    /// Open descriptors of agent-server, most seen during the load.
    fds_peak: usize,
    /// Health checks on agent-server's health port during the load, each 50 ms apart.
    health: Vec<Duration>,
    /// Health checks that failed, said NOT_SERVING, or took over a second.
    health_failed: usize,
}

impl Load {
    fn cpu_per_run(&self) -> Duration {
        (self.agents_cpu + self.tools_cpu) / self.concurrent as u32
    }

    fn memory_per_run_kb(&self) -> f64 {
        self.rss_peak.saturating_sub(self.rss_before) as f64 * 1.024 / self.concurrent as f64
    }
}

/// Open descriptors of process `pid`.
fn open_fds(pid: u32) -> usize {
    std::fs::read_dir(format!("/proc/{pid}/fd")).map_or(0, Iterator::count)
}

/// Runs `concurrent` runs of `three_calls` at once on `stack`, sampling agent-server's
/// memory and descriptors and timing health checks meanwhile. Unless some failed, every
/// run is checked to have answered after its 2 tool calls.
async fn load(stack: &Arc<Stack>, concurrent: usize) -> anyhow::Result<Load> {
    use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering::Relaxed};
    let (agent_pids, tools_pid) = stack.pids()?;
    let engines = stack.engines("three_calls", concurrent).await?;
    let rss = |pids: &[u32]| -> anyhow::Result<u64> { pids.iter().map(|pid| rss_kib(*pid)).sum() };
    let cpu_of =
        |pids: &[u32]| -> anyhow::Result<Duration> { pids.iter().map(|pid| cpu_time(*pid)).sum() };
    let rss_before = rss(&agent_pids)?;
    let model_pid = stack.model.pid().context("model-simulator exited")?;
    let bench_pid = std::process::id();
    let (m0, b0) = (cpu_time(model_pid)?, cpu_time(bench_pid)?);
    let (a0, t0) = (cpu_of(&agent_pids)?, cpu_time(tools_pid)?);
    let peak = Arc::new(AtomicU64::new(rss_before));
    let fds_peak = Arc::new(AtomicUsize::new(0));
    let sampler = {
        let (peak, fds_peak, pids) = (peak.clone(), fds_peak.clone(), agent_pids.clone());
        tokio::spawn(async move {
            loop {
                if let Ok(rss) = pids
                    .iter()
                    .map(|pid| rss_kib(*pid))
                    .sum::<anyhow::Result<u64>>()
                {
                    peak.fetch_max(rss, Relaxed);
                }
                fds_peak.fetch_max(pids.iter().map(|pid| open_fds(*pid)).sum(), Relaxed);
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
        })
    };
    // Health checks as a kubelet makes them: on the health port, one call at a time, a
    // one-second deadline.
    let health_addr = stack.agents[0].logged_addr("health_addr").await;
    let health_channel = Endpoint::from_shared(format!("http://{health_addr}"))?
        .tcp_nodelay(true)
        .connect()
        .await?;
    let probes = Arc::new(std::sync::Mutex::new((Vec::<Duration>::new(), 0usize)));
    let prober = tokio::spawn({
        let probes = probes.clone();
        async move {
            let mut client = tonic_health::pb::health_client::HealthClient::new(health_channel);
            loop {
                let asked = Instant::now();
                let check = client.check(tonic_health::pb::HealthCheckRequest {
                    service: String::new(),
                });
                let answered = tokio::time::timeout(Duration::from_secs(1), check).await;
                {
                    let mut probes = probes.lock().unwrap_or_else(|e| e.into_inner());
                    match answered {
                        // Answered SERVING; NOT_SERVING counts as a failed check.
                        Ok(Ok(answer)) if answer.get_ref().status == 1 => {
                            probes.0.push(asked.elapsed());
                        }
                        _ => probes.1 += 1,
                    }
                }
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
        }
    });
    let started = Instant::now();
    let totals = stack.run_all(engines, concurrent).await?;
    let wall = started.elapsed();
    sampler.abort();
    prober.abort();
    let (mut health, health_failed) =
        std::mem::take(&mut *probes.lock().unwrap_or_else(|e| e.into_inner()));
    health.sort();
    let failed = totals.failed;
    if failed > 0 {
        for (name, server) in [
            ("model-simulator", &stack.model),
            ("agent-server", &stack.agents[0]),
        ] {
            let logs = server.logs();
            let tail: Vec<&str> = logs.lines().rev().take(10).collect();
            eprintln!("  last lines of the {name} log:");
            for line in tail.iter().rev() {
                eprintln!("    {line}");
            }
        }
    } else {
        totals.expect("load", concurrent, concurrent * 2, "final_answer")?;
    }
    let (a1, t1) = (cpu_of(&agent_pids)?, cpu_time(tools_pid)?);
    let (m1, b1) = (cpu_time(model_pid)?, cpu_time(bench_pid)?);
    Ok(Load {
        concurrent,
        failed,
        wall,
        agents_cpu: a1 - a0,
        tools_cpu: t1 - t0,
        model_cpu: m1 - m0,
        bench_cpu: b1 - b0,
        rss_before,
        rss_peak: peak.load(Relaxed),
        fds_peak: fds_peak.load(Relaxed),
        health,
        health_failed,
    })
}

/// `--scale`: the load figure at each of `--scale-levels`, each on a fresh stack, as a table.
async fn scale(
    dir: &Path,
    cli: &Cli,
    scenarios_file: &Path,
    config_file: &Path,
) -> anyhow::Result<()> {
    println!(
        "agentrt-bench --scale: {} cores; runs of 3 model calls of {} ms and 2 tool calls, all at once, each level on a fresh stack (state: {}; model over {}, {} client)",
        std::thread::available_parallelism().map_or(1, |n| n.get()),
        cli.latency_ms,
        cli.state,
        model_protocol(cli),
        model_client(cli)
    );
    let mut rows = Vec::new();
    for &level in &cli.scale_levels {
        let stack = start(dir, cli, level, scenarios_file, config_file).await?;
        let warm = stack.engines("three_calls", 100.min(level)).await?;
        stack.run_all(warm, 100.min(level)).await?.expect(
            "warm-up",
            100.min(level),
            2 * 100.min(level),
            "final_answer",
        )?;
        let load = load(&stack, level).await?;
        let health_p99 = if load.health.is_empty() {
            "none".to_owned()
        } else {
            format!(
                "{:.1} ms",
                percentile(&load.health, 0.99).as_secs_f64() * 1e3
            )
        };
        let row = format!(
            "| {} | {} | {:.1} s | {:.0} us ({:.0} + {:.0}) | {:.1} KB | {:.1} s | {:.1} s | {} | {} ({} failed or over 1 s) |",
            load.concurrent,
            load.failed,
            load.wall.as_secs_f64(),
            load.cpu_per_run().as_secs_f64() * 1e6,
            load.agents_cpu.as_secs_f64() * 1e6 / load.concurrent as f64,
            load.tools_cpu.as_secs_f64() * 1e6 / load.concurrent as f64,
            load.memory_per_run_kb(),
            load.model_cpu.as_secs_f64(),
            load.bench_cpu.as_secs_f64(),
            load.fds_peak,
            health_p99,
            load.health_failed,
        );
        println!("{row}");
        rows.push(row);
        drop(stack);
        // Let the old stack's processes and sockets go before the next level.
        tokio::time::sleep(Duration::from_secs(2)).await;
    }
    println!();
    println!(
        "| concurrent runs | failed runs | wall | agent-server + tool-executor CPU per run (each) | agent-server memory per in-flight run | simulator CPU | bench client CPU | agent-server descriptors (peak) | health check p99 |"
    );
    println!("|---|---|---|---|---|---|---|---|---|");
    for row in rows {
        println!("{row}");
    }
    Ok(())
}
