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
    sync::{
        Arc, Mutex,
        atomic::{AtomicUsize, Ordering::Relaxed},
    },
    time::{Duration, Instant},
};

use agentrt::v1::{
    self, agent_engine_client::AgentEngineClient, agent_service_client::AgentServiceClient,
};
use agentrt_test_support::Server;
use anyhow::{Context, bail};
use clap::Parser;
use cpu::CpuMeter;
use futures_util::StreamExt;
use tonic::transport::{Channel, Endpoint};

mod cpu;
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

/// How long the bench waits for a run's `done` event: agent-server ends a run after its
/// run timeout (300 s unless the config says, and the bench's says nothing), so a run
/// still going 30 s later is a failed run, not one to wait for forever.
const RUN_DEADLINE: Duration = Duration::from_secs(330);

/// How long the bench waits for the answer to a unary call (creating an engine): far
/// longer than any takes, so that a stack that no longer answers fails the bench instead
/// of holding it forever.
const CALL_DEADLINE: Duration = Duration::from_secs(60);

/// The stop reason of a run that answered.
const ANSWERED: &str = "final_answer";

/// What each run of a scenario must have done for a figure to count it, checked run by
/// run: totals over all runs can hide a run whose tool call failed (its result an error,
/// which the scripted model takes as any other) behind another's.
#[derive(Debug)]
struct Workload {
    /// The outputs of its tool results, in order, none of them an error.
    tool_outputs: Vec<String>,
    /// The answer deltas it streams, when the figure counts them.
    deltas: Option<usize>,
    /// Its model rounds, as its `done` event counts them (`iterations`).
    iterations: u64,
}

impl Workload {
    /// `tool_loop`: the calculator's answers to `1 * 7` ... `10 * 7`, then the answer.
    fn tool_loop() -> Self {
        Self {
            tool_outputs: (1..=TOOL_LOOP_ROUNDS)
                .map(|i| (i * 7).to_string())
                .collect(),
            deltas: None,
            iterations: TOOL_LOOP_ROUNDS as u64 + 1,
        }
    }

    /// `three_calls`: `6 * 7` twice, then the answer.
    fn three_calls() -> Self {
        Self {
            tool_outputs: vec!["42".to_owned(); 2],
            deltas: None,
            iterations: 3,
        }
    }

    /// `long_answer`: one round streaming the answer a character per delta.
    fn long_answer() -> Self {
        Self {
            tool_outputs: Vec::new(),
            deltas: Some(LONG_ANSWER_CHARS),
            iterations: 1,
        }
    }

    /// `hello`: one round, a short answer.
    fn hello() -> Self {
        Self {
            tool_outputs: Vec::new(),
            deltas: None,
            iterations: 1,
        }
    }

    /// The work, in words, for the message that refuses a figure.
    fn describe(&self) -> String {
        let deltas = self
            .deltas
            .map(|d| format!(", {d} answer deltas"))
            .unwrap_or_default();
        format!(
            "{} tool results {:?}, none an error, {} iterations, stop reason {ANSWERED}{deltas}",
            self.tool_outputs.len(),
            self.tool_outputs,
            self.iterations
        )
    }
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
    /// CPU of the agent-servers (all together), of the tool executor, of the simulator,
    /// and of the bench client itself, metered from the stack's start.
    agents_cpu: CpuMeter,
    tools_cpu: CpuMeter,
    model_cpu: CpuMeter,
    bench_cpu: CpuMeter,
    /// Runs in flight: from their first event to their end.
    in_flight: AtomicUsize,
}

/// Counts a run in flight while it lives, however its stream ends.
struct InFlight<'a>(&'a AtomicUsize);

impl<'a> InFlight<'a> {
    fn enter(count: &'a AtomicUsize) -> Self {
        count.fetch_add(1, Relaxed);
        Self(count)
    }
}

impl Drop for InFlight<'_> {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Relaxed);
    }
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
        for i in 0..count {
            let request = v1::CreateAgentEngineRequest {
                config: Some(config.clone()),
                session_id: String::new(),
            };
            let created = tokio::time::timeout(CALL_DEADLINE, service.create_agent_engine(request))
                .await
                .with_context(|| {
                    format!("creating engine {i} of {count}: no answer within {CALL_DEADLINE:?}")
                })??;
            ids.push(created.into_inner().engine_id);
        }
        Ok(ids)
    }

    /// Runs one turn to its end; returns what it did, and why it failed if it did not
    /// answer. The run counts as in flight from its first event to its `done` event.
    async fn run(&self, i: usize, engine_id: String) -> anyhow::Result<RunOutcome> {
        let started = Instant::now();
        let request = v1::ExecuteRequest {
            engine_id,
            query: "What is 6 * 7?".into(),
            ..Default::default()
        };
        let deadline = tokio::time::Instant::now() + RUN_DEADLINE;
        let late = || RunOutcome {
            failure: Some(format!("no done event within {RUN_DEADLINE:?}")),
            late: true,
            ..RunOutcome::default()
        };
        let Ok(execute) = tokio::time::timeout_at(deadline, self.engine(i).execute(request)).await
        else {
            return Ok(late());
        };
        let mut stream = execute?.into_inner();
        let mut outcome = RunOutcome {
            failure: Some("the stream ended without a done event".to_owned()),
            ..RunOutcome::default()
        };
        let mut in_flight = None;
        loop {
            let event = match tokio::time::timeout_at(deadline, stream.next()).await {
                Ok(Some(Ok(event))) => event,
                Ok(None) => break,
                Ok(Some(Err(status))) => {
                    outcome.failure = Some(format!("{:?}: {}", status.code(), status.message()));
                    break;
                }
                Err(_) => {
                    let late = late();
                    (outcome.failure, outcome.late) = (late.failure, late.late);
                    break;
                }
            };
            outcome.first_event.get_or_insert_with(|| started.elapsed());
            in_flight.get_or_insert_with(|| InFlight::enter(&self.in_flight));
            outcome.events += 1;
            let kind = v1::EventType::try_from(event.r#type).unwrap_or_default();
            if matches!(kind, v1::EventType::Thought | v1::EventType::FinalAnswer) && !event.done {
                outcome
                    .first_output
                    .get_or_insert_with(|| started.elapsed());
                outcome.deltas += 1;
            }
            let data = || {
                event
                    .data
                    .as_ref()
                    .map(agentrt::json::struct_to_json)
                    .unwrap_or_default()
            };
            if kind == v1::EventType::ToolResult {
                let data = data();
                outcome.tool_results.push(ToolResultSeen {
                    // A result that does not say it succeeded counts as an error.
                    is_error: data["is_error"].as_bool() != Some(false),
                    output: data["output"].as_str().unwrap_or_default().to_owned(),
                });
            }
            if event.done {
                drop(in_flight.take());
                outcome.failure =
                    (kind != v1::EventType::FinalAnswer).then(|| event.content.clone());
                let summary = data();
                outcome.stop_reason = summary["stop_reason"]
                    .as_str()
                    .unwrap_or_default()
                    .to_owned();
                outcome.iterations = summary["iterations"].as_u64();
            }
        }
        Ok(outcome)
    }

    /// Runs every engine's turn, at most `concurrency` at once, and checks each run
    /// against `workload`: the totals count only the runs that did all of it. Once a run
    /// has gone past [`RUN_DEADLINE`] the runs not yet started are not started (they fail):
    /// a stack that holds runs forever would otherwise take that long per `concurrency`
    /// runs.
    async fn run_all(
        self: &Arc<Self>,
        engines: Vec<String>,
        concurrency: usize,
        workload: &Workload,
    ) -> anyhow::Result<Totals> {
        let hung = Arc::new(std::sync::atomic::AtomicBool::new(false));
        let results: Vec<(usize, anyhow::Result<RunOutcome>)> = futures_util::stream::iter(
            engines.into_iter().enumerate(),
        )
        .map(|(i, id)| {
            let (stack, hung) = (self.clone(), hung.clone());
            async move {
                if hung.load(Relaxed) {
                    let not_started = anyhow::anyhow!(
                        "not started: an earlier run had no done event within {RUN_DEADLINE:?}"
                    );
                    return (i, Err(not_started));
                }
                let outcome = tokio::spawn(async move { stack.run(i, id).await }).await;
                let outcome = outcome.map_err(Into::into).and_then(|outcome| outcome);
                if outcome.as_ref().is_ok_and(|outcome| outcome.late) {
                    hung.store(true, Relaxed);
                }
                (i, outcome)
            }
        })
        .buffer_unordered(concurrency)
        .collect()
        .await;
        Ok(Totals::tally(results, workload))
    }
}

/// One EVENT_TYPE_TOOL_RESULT, as its client saw it.
#[derive(Debug)]
struct ToolResultSeen {
    is_error: bool,
    output: String,
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
    /// Its tool results, in order.
    tool_results: Vec<ToolResultSeen>,
    /// From its `done` event.
    stop_reason: String,
    /// Its model rounds, from its `done` event.
    iterations: Option<u64>,
    failure: Option<String>,
    /// It had no `done` event within [`RUN_DEADLINE`].
    late: bool,
}

impl RunOutcome {
    /// How the run differs from `workload`, if it does, in words.
    fn differs_from(&self, workload: &Workload) -> Option<String> {
        if let Some(failure) = &self.failure {
            return Some(format!("it did not answer: {failure}"));
        }
        let errors: Vec<&ToolResultSeen> =
            self.tool_results.iter().filter(|r| r.is_error).collect();
        if let Some(first) = errors.first() {
            let output: String = first.output.chars().take(300).collect();
            return Some(format!(
                "{} tool results ran, {} {} an error: {output}",
                self.tool_results.len() - errors.len(),
                errors.len(),
                if errors.len() == 1 { "was" } else { "were" }
            ));
        }
        let outputs: Vec<&str> = self.tool_results.iter().map(|r| &*r.output).collect();
        if outputs != workload.tool_outputs {
            return Some(format!(
                "its tool results were {outputs:?}, not {:?}",
                workload.tool_outputs
            ));
        }
        if self.stop_reason != ANSWERED {
            return Some(format!(
                "it stopped with {:?}, not {ANSWERED}",
                self.stop_reason
            ));
        }
        if self.iterations != Some(workload.iterations) {
            return Some(format!(
                "its done event counts {} iterations, not {}",
                self.iterations
                    .map_or_else(|| "no".to_owned(), |n| n.to_string()),
                workload.iterations
            ));
        }
        if let Some(deltas) = workload.deltas
            && self.deltas != deltas
        {
            return Some(format!(
                "it streamed {} answer deltas, not {deltas}",
                self.deltas
            ));
        }
        None
    }
}

/// What a batch of runs did: the runs that did their whole workload, all together, and
/// how the others differed.
#[derive(Debug, Default)]
struct Totals {
    runs: usize,
    /// The workload, in words.
    workload: String,
    /// Runs that did all of their workload; the sums below are over them only.
    completed: usize,
    events: usize,
    deltas: usize,
    tool_results: usize,
    /// Runs that did not.
    failed: usize,
    /// The first few of them, each as "run N: how it differed".
    differences: Vec<String>,
}

impl Totals {
    /// Differing runs named in a refusal.
    const DIFFERENCES_KEPT: usize = 5;

    /// Checks each run (numbered) against `workload` and adds up the ones that did all of
    /// it; says on stderr how the others differed, grouped.
    fn tally(mut results: Vec<(usize, anyhow::Result<RunOutcome>)>, workload: &Workload) -> Self {
        results.sort_by_key(|(i, _)| *i);
        let mut totals = Self {
            runs: results.len(),
            workload: workload.describe(),
            ..Self::default()
        };
        let mut failures = std::collections::BTreeMap::<String, usize>::new();
        for (i, result) in results {
            let outcome = result.unwrap_or_else(|error| RunOutcome {
                failure: Some(format!("{error:#}")),
                ..RunOutcome::default()
            });
            if let Some(difference) = outcome.differs_from(workload) {
                if totals.differences.len() < Self::DIFFERENCES_KEPT {
                    totals.differences.push(format!("run {i}: {difference}"));
                }
                *failures.entry(difference).or_default() += 1;
                continue;
            }
            totals.completed += 1;
            totals.events += outcome.events;
            totals.deltas += outcome.deltas;
            totals.tool_results += outcome.tool_results.len();
        }
        for (failure, count) in &failures {
            eprintln!("  {count} runs failed: {failure}");
        }
        totals.failed = failures.values().sum();
        totals
    }

    /// Refuses to go on unless every run did its whole workload (`runs` of them): a
    /// figure from other runs would count work that did not happen.
    fn expect(&self, what: &str, runs: usize) -> anyhow::Result<()> {
        if self.failed > 0 || self.runs != runs || self.completed != runs {
            let shown = if self.failed > self.differences.len() {
                format!(" (the first {})", self.differences.len())
            } else {
                String::new()
            };
            bail!(
                "{what}: {} of {} runs (of {runs} expected) did not do the work the figure \
                 counts (each: {}), so it is not printed; they differed{shown}: {}",
                self.failed,
                self.runs,
                self.workload,
                self.differences.join("; ")
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

/// The agent-server's client of the simulator: the lean one speaks only h2c, so over
/// HTTPS or HTTP/1.1 agent-server takes the general one whatever `--model-client` says.
fn model_client(cli: &Cli) -> &str {
    if cli.model_tls || cli.model_http1 {
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
    let agent_pids = agents
        .iter()
        .map(|a| a.pid().context("agent-server exited"))
        .collect::<anyhow::Result<Vec<u32>>>()?;
    let pid = |server: &Server, name: &str| server.pid().with_context(|| format!("{name} exited"));
    Ok(Arc::new(Stack {
        agents_cpu: CpuMeter::start(&agent_pids)?,
        tools_cpu: CpuMeter::start(&[pid(&tools, "tool-executor")?])?,
        model_cpu: CpuMeter::start(&[pid(&model, "model-simulator")?])?,
        bench_cpu: CpuMeter::start(&[std::process::id()])?,
        in_flight: AtomicUsize::new(0),
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
    let cpu = || -> anyhow::Result<(Duration, Duration)> {
        Ok((stack.agents_cpu.now()?, stack.tools_cpu.now()?))
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
        .run_all(warm, 10, &Workload::tool_loop())
        .await?
        .expect("warm-up", 20)?;

    // 1. CPU per tool iteration: 10 model rounds with a (different) tool call each, plus
    // an answer; every run is checked to have had its 10 calculator results, none an
    // error, each the expected number, and to have answered after 11 rounds.
    let engines = stack.engines("tool_loop", cli.tool_runs).await?;
    let (a0, t0) = cpu()?;
    let (r0, memory0) = match &redis {
        Some(r) => r.info()?,
        None => (Duration::ZERO, 0),
    };
    let totals = stack.run_all(engines, 16, &Workload::tool_loop()).await?;
    // The work first: were a server gone, its runs' failures are what to report.
    totals.expect("tool iterations", cli.tool_runs)?;
    let (a1, t1) = cpu()?;
    let (r1, memory1) = match &redis {
        Some(r) => r.info()?,
        None => (Duration::ZERO, 0),
    };
    // Every run had its 10 results, each the right number: these are the iterations.
    let iterations = totals.tool_results;
    let (agents_used, tools_used) = (a1.saturating_sub(a0), t1.saturating_sub(t0));
    let per_iteration = (agents_used + tools_used) / iterations as u32;
    println!(
        "tool iteration CPU (agent-server + tool-executor): {:.1} us per iteration  [{} runs x {TOOL_LOOP_ROUNDS} tool calls, all run; agent-server {:?}, tool-executor {:?}]",
        per_iteration.as_secs_f64() * 1e6,
        cli.tool_runs,
        agents_used,
        tools_used
    );
    if redis.is_some() {
        let redis_used = r1.saturating_sub(r0);
        println!(
            "Redis: CPU {:.1} us per tool iteration, {:.0} us per run; memory {:.1} KB per ended run (retained)  [{} runs]",
            redis_used.as_secs_f64() * 1e6 / iterations as f64,
            redis_used.as_secs_f64() * 1e6 / cli.tool_runs as f64,
            memory1.saturating_sub(memory0) as f64 / 1000.0 / cli.tool_runs as f64,
            cli.tool_runs
        );
    }

    // 2. agent-server CPU per streamed answer delta; every run is checked to have streamed
    // its 2,000 deltas.
    let engines = stack.engines("long_answer", cli.stream_runs).await?;
    let (a0, _) = cpu()?;
    let r0 = redis_cpu()?;
    let totals = stack
        .run_all(engines, cli.stream_concurrency, &Workload::long_answer())
        .await?;
    totals.expect("answer deltas", cli.stream_runs)?;
    let (a1, _) = cpu()?;
    let r1 = redis_cpu()?;
    println!(
        "answer delta CPU (agent-server): {:.2} us per delta  [{} runs, {} at once, {} deltas, {} events]",
        a1.saturating_sub(a0).as_secs_f64() * 1e6 / totals.deltas as f64,
        cli.stream_runs,
        cli.stream_concurrency,
        totals.deltas,
        totals.events
    );
    if redis.is_some() {
        println!(
            "Redis: CPU {:.2} us per delta",
            r1.saturating_sub(r0).as_secs_f64() * 1e6 / totals.deltas as f64
        );
    }

    // 3. Time to the first event, measured at the client (an upper bound of the time after
    // Execute reaches the server): sequential runs, no model latency.
    let engines = stack.engines("hello", cli.latency_runs).await?;
    let hello = Workload::hello();
    let mut firsts = Vec::with_capacity(engines.len());
    let mut outputs = Vec::with_capacity(engines.len());
    for (i, id) in engines.into_iter().enumerate() {
        let outcome = stack.run(i, id).await?;
        if let Some(difference) = outcome.differs_from(&hello) {
            bail!(
                "first event: run {i} did not do the work the figure counts (each: {}), so it is not printed: {difference}",
                hello.describe()
            );
        }
        match (outcome.first_event, outcome.first_output) {
            (Some(event), Some(output)) => {
                firsts.push(event);
                outputs.push(output);
            }
            _ => bail!("first event: run {i} did not answer with text: {outcome:?}"),
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
    // once; CPU per run at 100 and at full concurrency; memory per in-flight run. Every run
    // is checked to have had its 2 calculator results (42, not errors) and answered.
    let small = 100.min(cli.concurrent);
    let engines = stack.engines("three_calls", small).await?;
    let (a0, t0) = cpu()?;
    stack
        .run_all(engines, small, &Workload::three_calls())
        .await?
        .expect("load, 100 runs", small)?;
    let (a1, t1) = cpu()?;
    let cpu_small = (a1.saturating_sub(a0) + t1.saturating_sub(t0)) / small as u32;

    let r0 = redis_cpu()?;
    let load = load(&stack, cli.concurrent).await?;
    let r1 = redis_cpu()?;
    load.totals.expect("load", cli.concurrent)?;
    let (Some(cpu_per_run), Some(memory_per_run)) = (load.cpu_per_run(), load.memory_per_run_kb())
    else {
        bail!(
            "load: no sample of agent-server's memory saw a run in flight, so memory per in-flight run is not printed"
        );
    };
    println!(
        "{} concurrent runs (3 model calls of {} ms, 2 tool calls each): wall {:.2} s; failed runs: {}  [CPU in s: agent-server {:.2}, tool-executor {:.2}, simulator {:.2}, bench client {:.2}]",
        cli.concurrent,
        cli.latency_ms,
        load.wall.as_secs_f64(),
        load.totals.failed,
        load.agents_cpu.as_secs_f64(),
        load.tools_cpu.as_secs_f64(),
        load.model_cpu.as_secs_f64(),
        load.bench_cpu.as_secs_f64(),
    );
    if redis.is_some() {
        let redis_used = r1.saturating_sub(r0);
        println!(
            "Redis: CPU {:.2} s in the load, {:.0} us per run",
            redis_used.as_secs_f64(),
            redis_used.as_secs_f64() * 1e6 / cli.concurrent as f64
        );
    }
    println!(
        "agent-server memory per in-flight run: {:.1} KB  [RSS {} KiB before, {} KiB with {} of {} runs in flight (the most seen), peak {} KiB]",
        memory_per_run,
        load.rss_before,
        load.rss_most_in_flight,
        load.most_in_flight,
        cli.concurrent,
        load.rss_peak
    );
    println!(
        "CPU per run (agent-server + tool-executor): {:.0} us at {small} concurrent, {:.0} us at {}",
        cpu_small.as_secs_f64() * 1e6,
        cpu_per_run.as_secs_f64() * 1e6,
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
    /// The runs, each checked against the `three_calls` workload.
    totals: Totals,
    wall: Duration,
    agents_cpu: Duration,
    tools_cpu: Duration,
    model_cpu: Duration,
    bench_cpu: Duration,
    rss_before: u64,
    rss_peak: u64,
    /// The most runs in flight any memory sample saw (counted before and after reading
    /// the memory, the smaller count), and agent-server's RSS then: the highest RSS of the
    /// samples that saw that many.
    most_in_flight: usize,
    rss_most_in_flight: u64,
    /// Open descriptors of agent-server, most seen during the load.
    fds_peak: usize,
    /// Health checks on agent-server's health port during the load, each 50 ms apart.
    health: Vec<Duration>,
    /// Health checks that failed, said NOT_SERVING, or took over a second.
    health_failed: usize,
}

impl Load {
    /// agent-server and tool-executor CPU per run that did its whole workload (the CPU
    /// of runs that failed is in the sum, so with failures it is an upper bound); none
    /// when no run did.
    fn cpu_per_run(&self) -> Option<Duration> {
        (self.totals.completed > 0)
            .then(|| (self.agents_cpu + self.tools_cpu) / self.totals.completed as u32)
    }

    /// agent-server's memory per run in flight, in KB: its RSS when the most runs were in
    /// flight, less before, over that many runs; none when no sample saw a run in flight.
    fn memory_per_run_kb(&self) -> Option<f64> {
        (self.most_in_flight > 0).then(|| {
            self.rss_most_in_flight.saturating_sub(self.rss_before) as f64 * 1.024
                / self.most_in_flight as f64
        })
    }

    /// The load's row of the `--scale` table, and the notes under the table that go with
    /// it: with failed runs, CPU per run is over the runs that finished their whole
    /// workload, marked `*` and noted.
    fn scale_row(&self) -> (String, Vec<String>) {
        let health_p99 = if self.health.is_empty() {
            "none".to_owned()
        } else {
            format!(
                "{:.1} ms",
                percentile(&self.health, 0.99).as_secs_f64() * 1e3
            )
        };
        let (completed, failed) = (self.totals.completed, self.totals.failed);
        let partial = if failed > 0 { "*" } else { "" };
        let cpu = match self.cpu_per_run() {
            Some(per_run) => format!(
                "{:.0} us{partial} ({:.0} + {:.0})",
                per_run.as_secs_f64() * 1e6,
                self.agents_cpu.as_secs_f64() * 1e6 / completed as f64,
                self.tools_cpu.as_secs_f64() * 1e6 / completed as f64,
            ),
            None => "none finished*".to_owned(),
        };
        let memory = self.memory_per_run_kb().map_or_else(
            || "none in flight at a sample".to_owned(),
            |kb| format!("{kb:.1} KB"),
        );
        let row = format!(
            "| {} | {} | {:.1} s | {cpu} | {memory} | {:.1} s | {:.1} s | {} | {} ({} failed or over 1 s) |",
            self.concurrent,
            failed,
            self.wall.as_secs_f64(),
            self.model_cpu.as_secs_f64(),
            self.bench_cpu.as_secs_f64(),
            self.fds_peak,
            health_p99,
            self.health_failed,
        );
        let level = self.concurrent;
        let mut notes = Vec::new();
        if failed > 0 {
            notes.push(format!(
                "* at {level} concurrent runs: over the {completed} runs that finished their whole workload; {failed} failed"
            ));
        }
        notes.push(format!(
            "memory at {level} concurrent runs: {} KiB with {} runs in flight (the most a sample saw), {} KiB before, peak {} KiB",
            self.rss_most_in_flight, self.most_in_flight, self.rss_before, self.rss_peak
        ));
        (row, notes)
    }
}

/// Open descriptors of process `pid`.
fn open_fds(pid: u32) -> usize {
    std::fs::read_dir(format!("/proc/{pid}/fd")).map_or(0, Iterator::count)
}

/// Resident memory of processes `pids` together, in KiB.
fn rss_of(pids: &[u32]) -> anyhow::Result<u64> {
    pids.iter().map(|pid| rss_kib(*pid)).sum()
}

/// What the load's sampler saw of agent-server's memory.
#[derive(Default)]
struct MemorySamples {
    peak: u64,
    most_in_flight: usize,
    rss_most_in_flight: u64,
}

/// Runs `concurrent` runs of `three_calls` at once on `stack`, sampling agent-server's
/// memory (with the runs in flight at each sample) and descriptors and timing health
/// checks meanwhile. Every run is checked against the workload; the caller decides what
/// to do with runs that failed.
async fn load(stack: &Arc<Stack>, concurrent: usize) -> anyhow::Result<Load> {
    let (agent_pids, _) = stack.pids()?;
    let engines = stack.engines("three_calls", concurrent).await?;
    let rss_before = rss_of(&agent_pids)?;
    let cpu = || -> anyhow::Result<[Duration; 4]> {
        Ok([
            stack.agents_cpu.now()?,
            stack.tools_cpu.now()?,
            stack.model_cpu.now()?,
            stack.bench_cpu.now()?,
        ])
    };
    let cpu0 = cpu()?;
    let samples = Arc::new(Mutex::new(MemorySamples {
        peak: rss_before,
        ..MemorySamples::default()
    }));
    let fds_peak = Arc::new(AtomicUsize::new(0));
    let sampler = {
        let (samples, fds_peak, pids, stack) = (
            samples.clone(),
            fds_peak.clone(),
            agent_pids.clone(),
            stack.clone(),
        );
        tokio::spawn(async move {
            loop {
                let before = stack.in_flight.load(Relaxed);
                if let Ok(rss) = rss_of(&pids) {
                    // Runs that ended while the memory was read may have freed theirs.
                    let in_flight = before.min(stack.in_flight.load(Relaxed));
                    let mut samples = samples.lock().unwrap_or_else(|e| e.into_inner());
                    samples.peak = samples.peak.max(rss);
                    if in_flight > samples.most_in_flight
                        || (in_flight > 0
                            && in_flight == samples.most_in_flight
                            && rss > samples.rss_most_in_flight)
                    {
                        samples.most_in_flight = in_flight;
                        samples.rss_most_in_flight = rss;
                    }
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
    let totals = stack
        .run_all(engines, concurrent, &Workload::three_calls())
        .await?;
    let wall = started.elapsed();
    sampler.abort();
    prober.abort();
    let (mut health, health_failed) =
        std::mem::take(&mut *probes.lock().unwrap_or_else(|e| e.into_inner()));
    health.sort();
    if totals.failed > 0 {
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
    }
    // Read after the logs: a server that died is reported, its runs' failures first.
    let cpu1 = cpu()?;
    let [agents_cpu, tools_cpu, model_cpu, bench_cpu] =
        std::array::from_fn(|i| cpu1[i].saturating_sub(cpu0[i]));
    let samples = std::mem::take(&mut *samples.lock().unwrap_or_else(|e| e.into_inner()));
    Ok(Load {
        concurrent,
        totals,
        wall,
        agents_cpu,
        tools_cpu,
        model_cpu,
        bench_cpu,
        rss_before,
        rss_peak: samples.peak,
        most_in_flight: samples.most_in_flight,
        rss_most_in_flight: samples.rss_most_in_flight,
        fds_peak: fds_peak.load(Relaxed),
        health,
        health_failed,
    })
}

/// `--scale`: the load figure at each of `--scale-levels`, each on a fresh stack, as a
/// table. A level where runs failed keeps its row (how many fail is what the table
/// shows), its CPU per run taken over the runs that did their whole workload and marked
/// `*`, with a note under the table.
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
    let mut notes = Vec::new();
    for &level in &cli.scale_levels {
        let stack = start(dir, cli, level, scenarios_file, config_file).await?;
        let warm = stack.engines("three_calls", 100.min(level)).await?;
        stack
            .run_all(warm, 100.min(level), &Workload::three_calls())
            .await?
            .expect("warm-up", 100.min(level))?;
        let load = load(&stack, level).await?;
        let (row, level_notes) = load.scale_row();
        println!("{row}");
        rows.push(row);
        notes.extend(level_notes);
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
    for note in notes {
        println!("{note}");
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A `tool_loop` run as it went: its calculator results (output, is_error).
    fn tool_loop_run(results: &[(&str, bool)]) -> RunOutcome {
        RunOutcome {
            tool_results: results
                .iter()
                .map(|&(output, is_error)| ToolResultSeen {
                    is_error,
                    output: output.to_owned(),
                })
                .collect(),
            stop_reason: ANSWERED.to_owned(),
            iterations: Some(TOOL_LOOP_ROUNDS as u64 + 1),
            ..RunOutcome::default()
        }
    }

    fn all_ran() -> Vec<(String, bool)> {
        (1..=TOOL_LOOP_ROUNDS)
            .map(|i| ((i * 7).to_string(), false))
            .collect()
    }

    fn as_refs(results: &[(String, bool)]) -> Vec<(&str, bool)> {
        results.iter().map(|(o, e)| (o.as_str(), *e)).collect()
    }

    #[test]
    fn a_run_that_did_its_workload_counts() {
        let run = tool_loop_run(&as_refs(&all_ran()));
        assert_eq!(run.differs_from(&Workload::tool_loop()), None);
    }

    #[test]
    fn a_failed_tool_call_is_not_an_iteration_though_the_run_answered() {
        let mut results = all_ran();
        results[3] = ("calling tool-executor: UNAVAILABLE".to_owned(), true);
        let failed = tool_loop_run(&as_refs(&results));
        let ok = tool_loop_run(&as_refs(&all_ran()));
        let totals = Totals::tally(vec![(0, Ok(ok)), (17, Ok(failed))], &Workload::tool_loop());
        assert_eq!((totals.completed, totals.failed), (1, 1));
        assert_eq!(
            totals.tool_results, TOOL_LOOP_ROUNDS,
            "only the whole run's"
        );
        let refused = totals.expect("tool iterations", 2).unwrap_err().to_string();
        assert!(
            refused.contains(
                "run 17: 9 tool results ran, 1 was an error: calling tool-executor: UNAVAILABLE"
            ),
            "{refused}"
        );
    }

    #[test]
    fn a_wrong_result_or_iteration_count_is_refused() {
        let mut results = all_ran();
        results[0].0 = "8".to_owned();
        let wrong = tool_loop_run(&as_refs(&results));
        assert!(
            wrong
                .differs_from(&Workload::tool_loop())
                .is_some_and(|d| d.contains("its tool results were")),
        );
        let mut short = tool_loop_run(&as_refs(&all_ran()));
        short.iterations = Some(10);
        assert_eq!(
            short.differs_from(&Workload::tool_loop()).as_deref(),
            Some("its done event counts 10 iterations, not 11")
        );
        let mut stopped = tool_loop_run(&as_refs(&all_ran()));
        stopped.stop_reason = "max_iterations".to_owned();
        assert!(stopped.differs_from(&Workload::tool_loop()).is_some());
    }

    #[test]
    fn a_scale_row_with_failed_runs_is_over_the_runs_that_finished_and_marked() {
        let load = Load {
            concurrent: 1000,
            totals: Totals {
                runs: 1000,
                completed: 800,
                failed: 200,
                ..Totals::default()
            },
            wall: Duration::from_secs(3),
            agents_cpu: Duration::from_millis(400),
            tools_cpu: Duration::from_millis(80),
            model_cpu: Duration::from_millis(100),
            bench_cpu: Duration::from_millis(100),
            rss_before: 60_000,
            rss_peak: 82_000,
            most_in_flight: 500,
            rss_most_in_flight: 80_000,
            fds_peak: 28,
            health: vec![Duration::from_millis(4)],
            health_failed: 0,
        };
        let (row, notes) = load.scale_row();
        assert!(
            row.starts_with("| 1000 | 200 | 3.0 s | 600 us* (500 + 100) | 41.0 KB |"),
            "{row}"
        );
        assert_eq!(
            notes[0],
            "* at 1000 concurrent runs: over the 800 runs that finished their whole workload; 200 failed"
        );
    }

    #[test]
    fn runs_missing_from_the_batch_are_refused() {
        let ok = tool_loop_run(&as_refs(&all_ran()));
        let totals = Totals::tally(vec![(0, Ok(ok))], &Workload::tool_loop());
        assert!(totals.expect("tool iterations", 1).is_ok());
        assert!(totals.expect("tool iterations", 2).is_err());
    }
}
