//! `agentrt-bench --waiting [--waiting-runs N] [--state redis://...]`: what runs that wait
//! for their client cost.
//!
//! `N` runs each ask for one call of a client tool and wait (RUN_STATUS_REQUIRES_ACTION).
//! Figures:
//! - memory: agent-server's resident memory with every run waiting, less before, per run;
//!   beside it the bytes of the run's message texts (query, call arguments), which any
//!   store must keep; with Redis, also Redis's memory per waiting run.
//! - resuming: agent-server's CPU from the first `SubmitToolOutputs` to the moment the
//!   server is idle again, per run: taking the answer, continuing the run (its second model
//!   round, through the simulator) and ending it.
//!
//! Before a figure is printed the work is checked: every run reached one
//! EVENT_TYPE_ACTION_REQUIRED and, answered, ended SUCCEEDED with the answer that echoes its
//! tool output.

use std::{
    path::Path,
    time::{Duration, Instant},
};

use agentrt::v1::{
    self, agent_engine_client::AgentEngineClient, agent_service_client::AgentServiceClient,
};
use agentrt_test_support::Server;
use anyhow::{Context, bail};
use futures_util::StreamExt;
use tonic::transport::{Channel, Endpoint};

use crate::{Backends, RedisStats, cpu::CpuMeter, rss_kib};

/// Runs started (or answered) at once.
const CONCURRENCY: usize = 256;
/// The query of every run.
const QUERY: &str = "where is my order?";
/// The arguments the model gives the client tool.
const ARGUMENTS: &str = r#"{"order_id":"A-17"}"#;

fn scenarios() -> String {
    r#"{"scenarios": {"ask": {"turns": [
      {"tool_calls": [{"id": "call_1", "name": "lookup_order", "arguments": {"order_id": "A-17"}}]},
      {"content": "{tool_results}"}]}}}"#
        .to_owned()
}

fn config() -> v1::AgentConfig {
    v1::AgentConfig {
        name: "waiting".into(),
        model: Some(v1::ModelConfig {
            name: "ask".into(),
            ..Default::default()
        }),
        client_tools: vec![v1::ClientTool {
            name: "lookup_order".into(),
            description: "Finds an order by its id.".into(),
            input_schema: agentrt::json::json_to_struct(&serde_json::json!({
                "type": "object",
                "properties": {"order_id": {"type": "string"}},
                "required": ["order_id"],
            })),
        }],
        ..Default::default()
    }
}

/// Waits until the process `cpu` meters has used no CPU for a while.
async fn idle(cpu: &CpuMeter) -> anyhow::Result<()> {
    let mut last = cpu.now()?;
    loop {
        tokio::time::sleep(Duration::from_millis(500)).await;
        let now = cpu.now()?;
        if now.saturating_sub(last) < Duration::from_millis(5) {
            return Ok(());
        }
        last = now;
    }
}

/// Creates `count` engines (each its own session, as each conversation has).
async fn engines(channel: &Channel, count: usize) -> anyhow::Result<Vec<String>> {
    let made = futures_util::stream::iter(0..count)
        .map(|_| {
            let mut service = AgentServiceClient::new(channel.clone());
            async move {
                anyhow::Ok(
                    service
                        .create_agent_engine(v1::CreateAgentEngineRequest {
                            config: Some(config()),
                            session_id: String::new(),
                        })
                        .await?
                        .into_inner()
                        .engine_id,
                )
            }
        })
        .buffer_unordered(CONCURRENCY)
        .collect::<Vec<_>>()
        .await;
    made.into_iter().collect()
}

/// Starts a run on each engine through `channel`; answers their ids once each is waiting.
async fn start_waiting(channel: &Channel, engine_ids: Vec<String>) -> anyhow::Result<Vec<String>> {
    let started = futures_util::stream::iter(engine_ids)
        .map(|engine_id| {
            let mut engine = AgentEngineClient::new(channel.clone());
            async move {
                let mut stream = engine
                    .execute(v1::ExecuteRequest {
                        engine_id,
                        query: QUERY.into(),
                        ..Default::default()
                    })
                    .await?
                    .into_inner();
                loop {
                    let event = stream
                        .message()
                        .await?
                        .context("the run ended without waiting")?;
                    if event.done {
                        bail!("run {} ended without waiting: {event:?}", event.run_id);
                    }
                    if event.r#type == v1::EventType::ActionRequired as i32 {
                        // The client goes away: a waiting run is not cancelled by that.
                        return anyhow::Ok(event.run_id);
                    }
                }
            }
        })
        .buffer_unordered(CONCURRENCY)
        .collect::<Vec<_>>()
        .await;
    started.into_iter().collect()
}

pub async fn run(dir: &Path, state: &str, runs: usize) -> anyhow::Result<()> {
    let tag = std::process::id();
    let backends = Backends::start(dir, "wait", &scenarios()).await?;
    let prefix = format!("agentrt-bench-wait-{tag}");
    let config_path = backends.config_file.to_string_lossy().into_owned();
    let tools_url = backends.tools.url();
    let mut args = vec![
        "--listen",
        "127.0.0.1:0",
        "--tool-executor",
        tools_url.as_str(),
        "--config",
        config_path.as_str(),
        "--max-engines",
        "100000",
        "--max-active-runs",
        "100000",
    ];
    let redis = (state != "memory").then(|| RedisStats {
        url: state.to_owned(),
    });
    if redis.is_some() {
        args.extend(["--state", state, "--state-key-prefix", prefix.as_str()]);
    }
    let server = Server::start_at(
        &dir.join("agent-server"),
        &args,
        &[("RUST_LOG", "warn,agentrt_grpc=info")],
    )
    .await;
    let pid = server.pid().context("agent-server is not running")?;
    let cpu = CpuMeter::start(&[pid])?;
    let channel = Endpoint::from_shared(server.url())?
        .tcp_nodelay(true)
        .connect()
        .await?;
    println!(
        "agentrt-bench --waiting: {runs} runs waiting at once for a client tool's output (state: {})",
        if redis.is_some() { "Redis" } else { "memory" }
    );
    // Warm up: connections, caches, the allocator's first pages.
    let warm = start_waiting(&channel, engines(&channel, CONCURRENCY).await?).await?;
    answer_all(&channel, &warm).await?;
    // The engines (and their sessions) are made before the memory is measured: they are
    // not what a waiting run costs.
    let engine_ids = engines(&channel, runs).await?;
    idle(&cpu).await?;

    let rss_before = rss_kib(pid)?;
    let redis_before = redis.as_ref().map(RedisStats::info).transpose()?;
    let began = Instant::now();
    let ids = start_waiting(&channel, engine_ids).await?;
    idle(&cpu).await?;
    let rss_waiting = rss_kib(pid)?;
    let redis_waiting = redis.as_ref().map(RedisStats::info).transpose()?;
    // Every run waits (checked on a sample spread over all of them, and the count).
    let mut engine = AgentEngineClient::new(channel.clone());
    for run_id in ids.iter().step_by((runs / 1000).max(1)) {
        let state = engine
            .get_run(v1::GetRunRequest {
                run_id: run_id.clone(),
            })
            .await?
            .into_inner();
        if state.status != v1::RunStatus::RequiresAction as i32
            || state.pending_tool_calls.len() != 1
        {
            bail!("run {run_id} does not wait as it should: {state:?}");
        }
    }
    let started_in = began.elapsed();
    idle(&cpu).await?;

    let cpu_before = cpu.now()?;
    let answering = Instant::now();
    answer_all(&channel, &ids).await?;
    idle(&cpu).await?;
    let resumed_in = answering.elapsed();
    let cpu_resuming = cpu.now()?.saturating_sub(cpu_before);

    // Every run ended as it should, before any figure is printed.
    let checked = futures_util::stream::iter(ids.iter())
        .map(|run_id| {
            let mut engine = AgentEngineClient::new(channel.clone());
            async move {
                let state = engine
                    .get_run(v1::GetRunRequest {
                        run_id: run_id.clone(),
                    })
                    .await?
                    .into_inner();
                if state.status != v1::RunStatus::Succeeded as i32
                    || state.stop_reason != v1::StopReason::FinalAnswer as i32
                    || state.final_answer != "shipped"
                {
                    bail!("run {run_id} did not end as it should: {state:?}");
                }
                anyhow::Ok(())
            }
        })
        .buffer_unordered(CONCURRENCY)
        .collect::<Vec<_>>()
        .await;
    checked.into_iter().collect::<anyhow::Result<Vec<()>>>()?;

    let per_run = |kib: u64| kib as f64 * 1024.0 / runs as f64;
    let text = QUERY.len() + ARGUMENTS.len();
    println!(
        "  {runs} runs started and waiting in {:.1} s; all answered and ended SUCCEEDED in {:.1} s",
        started_in.as_secs_f64(),
        resumed_in.as_secs_f64()
    );
    println!(
        "  agent-server memory per waiting run: {:.0} bytes ({} KiB -> {} KiB; message text per run: {text} bytes)",
        per_run(rss_waiting.saturating_sub(rss_before)),
        rss_before,
        rss_waiting
    );
    if let (Some((_, before)), Some((_, waiting))) = (redis_before, redis_waiting) {
        println!(
            "  Redis memory per waiting run: {:.0} bytes",
            waiting.saturating_sub(before) as f64 / runs as f64
        );
    }
    println!(
        "  agent-server CPU per resumed run (answer, second model round, end): {:.0} us",
        cpu_resuming.as_secs_f64() * 1e6 / runs as f64
    );
    drop(server);
    Ok(())
}

/// Answers the client tool call of every run of `ids`.
async fn answer_all(channel: &Channel, ids: &[String]) -> anyhow::Result<()> {
    let answered = futures_util::stream::iter(ids.iter())
        .map(|run_id| {
            let mut engine = AgentEngineClient::new(channel.clone());
            async move {
                let reply = engine
                    .submit_tool_outputs(v1::SubmitToolOutputsRequest {
                        run_id: run_id.clone(),
                        outputs: vec![v1::ToolOutput {
                            tool_call_id: "call_1".into(),
                            output: "shipped".into(),
                            is_error: false,
                        }],
                    })
                    .await?
                    .into_inner();
                if !reply.pending_tool_call_ids.is_empty() {
                    bail!("run {run_id} still waits after its answer: {reply:?}");
                }
                anyhow::Ok(())
            }
        })
        .buffer_unordered(CONCURRENCY)
        .collect::<Vec<_>>()
        .await;
    answered.into_iter().collect::<anyhow::Result<Vec<()>>>()?;
    // Ended (waited for by the caller's idle check, then verified).
    Ok(())
}
