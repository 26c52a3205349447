//! `agentrt-bench --durability --state redis://...`: how fast runs move between replicas.
//!
//! - Hand-over: `--durable-runs` runs stream slowly on replica A; A gets SIGTERM. Figure:
//!   for each run, the time from the signal to the `EVENT_TYPE_ROUND_RESTARTED` event
//!   (reason `handover`) that the replica continuing it published.
//! - Take-over: the same on replica B, killed with SIGKILL. Figure: for each run, the time
//!   from the moment its lease lapsed (read from Redis after the kill, when nobody renews
//!   it any more) to the restart event (reason `takeover`) of the replica continuing it.
//! - Lease renewal: the CPU one renewal of `--concurrent` leases costs (the same call the
//!   servers make, three times per `--takeover-after`), as a share of one core.
//!
//! Every run is read back whole and checked before a figure is printed: sequences 1..n
//! without a gap or a repeat, exactly one `done`, the answer right, one restart event.

use std::{
    path::Path,
    time::{Duration, Instant, SystemTime},
};

use agentrt::v1::{
    self, agent_engine_client::AgentEngineClient, agent_service_client::AgentServiceClient,
};
use agentrt_test_support::Server;
use anyhow::{Context, bail};
use futures_util::StreamExt;
use tonic::transport::{Channel, Endpoint};

use crate::{Backends, cpu::CpuMeter, percentile};

const ANSWER: &str = "a durable answer, streamed slowly, one character at a time, to the end";

fn scenarios() -> String {
    format!(
        r#"{{"scenarios": {{"slow": {{"turns": [{{"content": "{ANSWER}", "chunk_chars": 1, "chunk_delay_ms": 40}}]}}}}}}"#
    )
}

struct Cluster<'a> {
    dir: &'a Path,
    state: &'a str,
    prefix: String,
    takeover_after: Duration,
    backends: Backends,
}

impl Cluster<'_> {
    async fn replica(&self) -> anyhow::Result<(Server, Channel)> {
        let server = Server::start_at(
            &self.dir.join("agent-server"),
            &[
                "--listen",
                "127.0.0.1:0",
                "--tool-executor",
                &self.backends.tools.url(),
                "--config",
                &self.backends.config_file.to_string_lossy(),
                "--state",
                self.state,
                "--state-key-prefix",
                &self.prefix,
                "--takeover-after",
                &format!("{}ms", self.takeover_after.as_millis()),
                "--max-engines",
                "100000",
                "--max-active-runs",
                "100000",
            ],
            &[("RUST_LOG", "warn,agentrt_grpc=info")],
        )
        .await;
        let channel = Endpoint::from_shared(server.url())?
            .tcp_nodelay(true)
            .connect()
            .await?;
        Ok((server, channel))
    }
}

/// Starts `runs` slow runs through `channel`; answers their ids once each has streamed a
/// few deltas (the streams stay open, detached: their runs go on without them).
async fn start_runs(
    channel: &Channel,
    runs: usize,
) -> anyhow::Result<(Vec<String>, Vec<tonic::Streaming<v1::AgentStreamEvent>>)> {
    let mut service = AgentServiceClient::new(channel.clone());
    let config = v1::AgentConfig {
        name: "durable".into(),
        model: Some(v1::ModelConfig {
            name: "slow".into(),
            ..Default::default()
        }),
        ..Default::default()
    };
    let mut engine_ids = Vec::with_capacity(runs);
    for _ in 0..runs {
        engine_ids.push(
            service
                .create_agent_engine(v1::CreateAgentEngineRequest {
                    config: Some(config.clone()),
                    session_id: String::new(),
                })
                .await?
                .into_inner()
                .engine_id,
        );
    }
    let started = futures_util::future::join_all(engine_ids.into_iter().map(|engine_id| {
        let mut engine = AgentEngineClient::new(channel.clone());
        async move {
            let mut stream = engine
                .execute(v1::ExecuteRequest {
                    engine_id,
                    query: "go".into(),
                    detach: true,
                    ..Default::default()
                })
                .await?
                .into_inner();
            let mut run_id = String::new();
            let mut deltas = 0;
            while deltas < 3 {
                let event = stream.message().await?.context("the run ended early")?;
                run_id = event.run_id.clone();
                if event.r#type == v1::EventType::FinalAnswer as i32 {
                    deltas += 1;
                }
            }
            anyhow::Ok((run_id, stream))
        }
    }))
    .await;
    let mut ids = Vec::with_capacity(runs);
    let mut streams = Vec::with_capacity(runs);
    for result in started {
        let (id, stream) = result?;
        ids.push(id);
        streams.push(stream);
    }
    Ok((ids, streams))
}

/// Reads each run whole through `channel`, checks it, and answers when its restart event
/// for `reason` was made.
async fn restarts(
    channel: &Channel,
    run_ids: &[String],
    reason: &str,
) -> anyhow::Result<Vec<SystemTime>> {
    let read = futures_util::stream::iter(run_ids.iter().cloned())
        .map(|run_id| {
            let mut engine = AgentEngineClient::new(channel.clone());
            async move {
                let stream = engine
                    .subscribe(v1::SubscribeRequest {
                        run_id: run_id.clone(),
                        after_sequence: 0,
                    })
                    .await?
                    .into_inner();
                let events: Vec<v1::AgentStreamEvent> = tokio::time::timeout(
                    Duration::from_secs(120),
                    stream
                        .map(|e| e.map_err(anyhow::Error::from))
                        .collect::<Vec<_>>(),
                )
                .await
                .context("a run did not end")?
                .into_iter()
                .collect::<anyhow::Result<_>>()?;
                anyhow::Ok((run_id, events))
            }
        })
        .buffer_unordered(256)
        .collect::<Vec<_>>()
        .await;
    let mut times = Vec::with_capacity(run_ids.len());
    for result in read {
        let (run_id, events) = result?;
        let sequences: Vec<u64> = events.iter().map(|e| e.sequence).collect();
        if sequences != (1..=events.len() as u64).collect::<Vec<_>>() {
            bail!("run {run_id}: sequences are not 1..n: {sequences:?}");
        }
        if events.iter().filter(|e| e.done).count() != 1 || !events.last().is_some_and(|e| e.done) {
            bail!("run {run_id}: not exactly one done event, last");
        }
        let last = events.last().context("no events")?;
        if last.r#type != v1::EventType::FinalAnswer as i32 {
            bail!("run {run_id} failed: {}", last.content);
        }
        let restarted: Vec<&v1::AgentStreamEvent> = events
            .iter()
            .filter(|e| e.r#type == v1::EventType::RoundRestarted as i32)
            .collect();
        let [restart] = restarted.as_slice() else {
            bail!(
                "run {run_id}: expected one restart event, got {}",
                restarted.len()
            );
        };
        let data = restart
            .data
            .as_ref()
            .map(agentrt::json::struct_to_json)
            .unwrap_or_default();
        if data["reason"] != reason {
            bail!(
                "run {run_id}: restarted for {:?}, not {reason}",
                data["reason"]
            );
        }
        // The answer: the deltas of the done event's round after its restart.
        let position = events
            .iter()
            .position(|e| e.sequence == restart.sequence)
            .unwrap_or(0);
        let answer: String = events[position..]
            .iter()
            .filter(|e| e.r#type == v1::EventType::FinalAnswer as i32 && !e.done)
            .map(|e| e.content.as_str())
            .collect();
        if answer != ANSWER {
            bail!("run {run_id}: answer {answer:?}");
        }
        let time = restart.create_time.context("no create_time")?;
        times.push(
            SystemTime::UNIX_EPOCH
                + Duration::new(u64::try_from(time.seconds)?, u32::try_from(time.nanos)?),
        );
    }
    Ok(times)
}

fn after(times: &[SystemTime], from: &[SystemTime]) -> Vec<Duration> {
    let mut delays: Vec<Duration> = times
        .iter()
        .zip(from)
        .map(|(t, f)| t.duration_since(*f).unwrap_or_default())
        .collect();
    delays.sort();
    delays
}

fn kill(server: &Server, signal: &str) -> anyhow::Result<()> {
    let pid = server.pid().context("the replica exited already")?;
    let status = std::process::Command::new("kill")
        .args([signal, &pid.to_string()])
        .status()?;
    if !status.success() {
        bail!("kill {signal} {pid} failed");
    }
    Ok(())
}

pub async fn run(
    dir: &Path,
    state: &str,
    runs: usize,
    leases: usize,
    takeover_after: Duration,
) -> anyhow::Result<()> {
    if state == "memory" {
        bail!("--durability needs a shared state: --state redis://...");
    }
    let backends = Backends::start(dir, "durable", &scenarios()).await?;
    let cluster = Cluster {
        dir,
        state,
        prefix: format!("agentrt-bench-durable-{}", std::process::id()),
        takeover_after,
        backends,
    };
    println!(
        "agentrt-bench --durability: {runs} runs of {} deltas (40 ms apart) per figure, runs.takeover_after {takeover_after:?}",
        ANSWER.len()
    );

    // Hand-over: A gets SIGTERM; B continues its runs.
    let (mut a, to_a) = cluster.replica().await?;
    let (b, to_b) = cluster.replica().await?;
    let (run_ids, streams) = start_runs(&to_a, runs).await?;
    let signalled = SystemTime::now();
    kill(&a, "-TERM")?;
    let exit = a.wait(Duration::from_secs(30)).await;
    let exited = signalled.elapsed().unwrap_or_default();
    drop(streams);
    let times = restarts(&to_b, &run_ids, "handover").await?;
    let delays = after(&times, &vec![signalled; times.len()]);
    println!(
        "hand-over on SIGTERM: runs continue on another replica after p50 {:.0} ms, p99 {:.0} ms, max {:.0} ms  [{runs} runs in flight; the replica exited {exit} after {:.2} s; every run checked: no gap, one done, the whole answer]",
        percentile(&delays, 0.5).as_secs_f64() * 1e3,
        percentile(&delays, 0.99).as_secs_f64() * 1e3,
        delays.last().copied().unwrap_or_default().as_secs_f64() * 1e3,
        exited.as_secs_f64(),
    );

    // Take-over: B is killed; C continues its runs once their leases lapse.
    let (_c, to_c) = cluster.replica().await?;
    let (run_ids, streams) = start_runs(&to_b, runs).await?;
    kill(&b, "-KILL")?;
    // Nobody renews them any more: their lapse times are final.
    let client = redis::Client::open(state)?;
    let mut connection = client.get_multiplexed_async_connection().await?;
    let scores: Vec<(String, f64)> = redis::cmd("ZRANGE")
        .arg(format!("{}:leases:all", cluster.prefix))
        .arg(0)
        .arg(-1)
        .arg("WITHSCORES")
        .query_async(&mut connection)
        .await?;
    let lapses: std::collections::HashMap<String, SystemTime> = scores
        .into_iter()
        .map(|(run, ms)| {
            (
                run,
                SystemTime::UNIX_EPOCH + Duration::from_millis(ms as u64),
            )
        })
        .collect();
    drop(streams);
    let times = restarts(&to_c, &run_ids, "takeover").await?;
    let from: Vec<SystemTime> = run_ids
        .iter()
        .map(|id| lapses.get(id).copied().context("a run had no lease"))
        .collect::<anyhow::Result<_>>()?;
    let delays = after(&times, &from);
    println!(
        "take-over after a kill: runs continue p50 {:.0} ms, p99 {:.0} ms, max {:.0} ms after their lease lapsed  [{runs} runs in flight; every run checked]",
        percentile(&delays, 0.5).as_secs_f64() * 1e3,
        percentile(&delays, 0.99).as_secs_f64() * 1e3,
        delays.last().copied().unwrap_or_default().as_secs_f64() * 1e3,
    );

    // Lease renewal: the call a replica makes for all its runs at once.
    let store = agentrt_state::redis::Redis::connect(
        state,
        &format!("{}-leases", cluster.prefix),
        agentrt_state::redis::RedisLimits {
            engine_ttl: Duration::from_secs(60),
            session_ttl: Duration::from_secs(60),
            max_exchanges: 1,
            max_history_bytes: usize::MAX,
            run_retention: Duration::from_secs(60),
            events_per_run: 100,
            retained_events: 100,
            lease: takeover_after,
            max_waiting_per_principal: usize::MAX,
        },
    )?
    .runs();
    let mut held = Vec::with_capacity(leases);
    for i in 0..leases {
        let mut record =
            agentrt_state::RunRecord::new(&format!("lease-{i}"), "e", "s", &format!("m{i}"), "q");
        record.owner = "bench.0".into();
        store.save(&record, 0, None).await?;
        held.push(agentrt_state::Lease {
            run_id: record.run_id,
            token: record.owner,
        });
    }
    // A replica renews with a renewer on a connection of its own: made by its first call.
    let renewer = store.clone().lease_renewer()?;
    renewer.renew(&held).await?;
    let rounds = 20;
    let me = CpuMeter::start(&[std::process::id()])?;
    let (cpu0, wall0) = (me.now()?, Instant::now());
    for _ in 0..rounds {
        let lost = renewer.renew(&held).await?;
        if !lost.is_empty() {
            bail!("lease renewal lost {} leases", lost.len());
        }
    }
    let per_renewal = me.now()?.saturating_sub(cpu0) / rounds;
    let wall = wall0.elapsed() / rounds;
    let share = per_renewal.as_secs_f64() * 3.0 / takeover_after.as_secs_f64();
    println!(
        "lease renewal: {:.2} ms of CPU per renewal of {leases} leases ({:.1} ms wall), three per {takeover_after:?}: {:.3}% of one core  [{rounds} renewals, none lost]",
        per_renewal.as_secs_f64() * 1e3,
        wall.as_secs_f64() * 1e3,
        share * 100.0,
    );
    Ok(())
}
