//! Several agent-server replicas sharing one Redis (`--state`): any replica serves any
//! engine, session and run.
//!
//! Needs Redis at `AGENTRT_TEST_REDIS` (default `redis://127.0.0.1:6379/0`); `scripts/test`
//! starts one when none answers. Each test keeps its keys under a prefix of its own.
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use std::time::Duration;

use agentrt::v1::{
    self, agent_engine_client::AgentEngineClient, agent_service_client::AgentServiceClient,
};
use agentrt_test_support::{
    OwnRedis, Server, agent_server_with_model,
    conformance::{redis_prefix, redis_url},
    connect,
};
use common::{Stack, agent, assert_well_formed, collect, data, done, get_run, kind, text};
use tonic::transport::Channel;

const SCENARIOS: &str = r#"{"scenarios": {
  "calc": {"turns": [
    {"tool_calls": [{"name": "calculator", "arguments": {"expression": "6 * 7"}}]},
    {"content": "the answer is 42"}]},
  "memory": {"turns": [{"content": "seen {user_messages}"}]},
  "slow": {"turns": [{"content": "a very slow answer, one character at a time, taking its time", "chunk_chars": 1, "chunk_delay_ms": 50}]},
  "steps": {"turns": [
    {"tool_calls": [{"name": "calculator", "arguments": {"expression": "1 + 1"}}], "latency_ms": 300},
    {"tool_calls": [{"name": "calculator", "arguments": {"expression": "2 + 2"}}], "latency_ms": 300},
    {"tool_calls": [{"name": "calculator", "arguments": {"expression": "3 + 3"}}], "latency_ms": 300},
    {"tool_calls": [{"name": "calculator", "arguments": {"expression": "4 + 4"}}], "latency_ms": 300},
    {"tool_calls": [{"name": "calculator", "arguments": {"expression": "5 + 5"}}], "latency_ms": 300},
    {"tool_calls": [{"name": "calculator", "arguments": {"expression": "6 + 6"}}], "latency_ms": 300},
    {"content": "done at last"}]}
}}"#;

struct Replica {
    _server: Server,
    service: AgentServiceClient<Channel>,
    engine: AgentEngineClient<Channel>,
}

/// A stack (replica A) and a second agent-server (replica B) on the same Redis.
async fn replicas(test: &str) -> (Stack, Replica) {
    replicas_under(&redis_prefix(test)).await
}

/// [`replicas`], keeping their keys under `prefix`.
async fn replicas_under(prefix: &str) -> (Stack, Replica) {
    replicas_on(&redis_url(), prefix).await
}

/// [`replicas_under`], on the Redis at `url`.
async fn replicas_on(url: &str, prefix: &str) -> (Stack, Replica) {
    let args = ["--state", url, "--state-key-prefix", prefix];
    let a = Stack::up(SCENARIOS, &args).await;
    let server =
        agent_server_with_model(&a.tools.url(), &format!("{}/v1", a.model.url()), &args).await;
    let channel = connect(&server.url()).await;
    let b = Replica {
        _server: server,
        service: AgentServiceClient::new(channel.clone()),
        engine: AgentEngineClient::new(channel),
    };
    (a, b)
}

#[tokio::test]
async fn an_engine_made_on_one_replica_runs_on_another_and_both_agree_on_the_run() {
    let (mut a, mut b) = replicas("engine").await;
    let engine_id = a.engine_for(agent("calc", &["calculator"])).await;
    let got = b
        .service
        .get_agent_engine(v1::GetAgentEngineRequest {
            engine_id: engine_id.clone(),
        })
        .await
        .unwrap()
        .into_inner();
    assert_eq!(got.engine_id, engine_id);
    let events = collect(
        b.engine
            .execute(v1::ExecuteRequest {
                engine_id: engine_id.clone(),
                query: "what is 6 * 7?".into(),
                ..Default::default()
            })
            .await
            .unwrap()
            .into_inner(),
    )
    .await;
    assert_well_formed(&events);
    assert_eq!(done(&events)["stop_reason"], "final_answer");
    assert_eq!(
        text(&events, v1::EventType::FinalAnswer),
        "the answer is 42"
    );
    let run_id = events[0].run_id.clone();
    // GetRun agrees everywhere, and so does a replay from either replica.
    let on_a = a.state(&run_id).await;
    let on_b = get_run(&mut b.engine, &run_id).await;
    assert_eq!(on_a, on_b);
    assert_eq!(on_a.status, v1::RunStatus::Succeeded as i32);
    assert_eq!(on_a.final_answer, "the answer is 42");
    assert_eq!(on_a.last_sequence, events.len() as u64);
    let replay = collect(
        a.engine
            .subscribe(v1::SubscribeRequest {
                run_id: run_id.clone(),
                after_sequence: 0,
            })
            .await
            .unwrap()
            .into_inner(),
    )
    .await;
    assert_eq!(replay, events);
    let results: Vec<_> = events
        .iter()
        .filter(|e| kind(e) == v1::EventType::ToolResult)
        .map(|e| data(e)["output"].clone())
        .collect();
    assert_eq!(results, [serde_json::json!("42")]);
}

/// Cancels `run_id` through `engine` (another replica than its owner's): the run is
/// cancelled, and the answer comes within a second.
async fn cancel_within_a_second(engine: &mut AgentEngineClient<Channel>, run_id: &str) {
    let asked = tokio::time::Instant::now();
    let cancelled = engine
        .cancel(v1::CancelRequest {
            run_id: run_id.to_owned(),
        })
        .await
        .unwrap()
        .into_inner();
    let took = asked.elapsed();
    assert_eq!(cancelled.status, v1::RunStatus::Cancelled as i32);
    assert!(
        took < Duration::from_millis(1000),
        "Cancel on another replica took {took:?}"
    );
}

#[tokio::test]
async fn subscribe_and_cancel_on_another_replica_reach_the_run() {
    let (mut a, mut b) = replicas("cancel").await;
    let engine_id = a.engine_for(agent("slow", &[])).await;
    let mut execute = a.start(&engine_id, "take your time").await;
    let first = execute.message().await.unwrap().unwrap();
    let run_id = first.run_id.clone();
    let follower = tokio::spawn(collect(subscribe(&mut b.engine, &run_id).await));
    tokio::time::sleep(Duration::from_millis(500)).await;
    cancel_within_a_second(&mut b.engine, &run_id).await;
    let mut rest = vec![first];
    rest.extend(common::rest(execute).await);
    assert_well_formed(&rest);
    assert_eq!(done(&rest)["stop_reason"], "cancelled");
    let followed = follower.await.unwrap();
    assert_eq!(
        followed, rest,
        "every event exactly once, on the other replica too"
    );
    let on_a = a.state(&run_id).await;
    assert_eq!(on_a, get_run(&mut b.engine, &run_id).await);
    assert_eq!(on_a.status, v1::RunStatus::Cancelled as i32);
}

#[tokio::test]
async fn a_session_carries_across_replicas_and_a_message_id_makes_one_run() {
    let (mut a, mut b) = replicas("session").await;
    let engine_id = a.engine_for(agent("memory", &[])).await;
    let ask = |query: &str, message_id: &str| v1::ExecuteRequest {
        engine_id: engine_id.clone(),
        query: query.into(),
        message_id: message_id.into(),
        ..Default::default()
    };
    let first = collect(
        a.engine
            .execute(ask("first", "m1"))
            .await
            .unwrap()
            .into_inner(),
    )
    .await;
    assert_eq!(done(&first)["stop_reason"], "final_answer");
    let second = collect(
        b.engine
            .execute(ask("second", "m2"))
            .await
            .unwrap()
            .into_inner(),
    )
    .await;
    assert_eq!(
        text(&second, v1::EventType::FinalAnswer),
        "seen 2",
        "replica B saw the turn made on A"
    );
    // The same message id sent to both replicas at once makes one run.
    let (mut ea, mut eb) = (a.engine.clone(), b.engine.clone());
    let (left, right) = tokio::join!(
        ea.execute(ask("third", "m3")),
        eb.execute(ask("third", "m3"))
    );
    let left = collect(left.unwrap().into_inner()).await;
    let right = collect(right.unwrap().into_inner()).await;
    assert_eq!(left[0].run_id, right[0].run_id);
    assert_eq!(left, right);
}

async fn readiness(url: &str) -> i32 {
    use tonic_health::pb::{HealthCheckRequest, health_client::HealthClient};
    HealthClient::new(connect(url).await)
        .check(HealthCheckRequest {
            service: "agent.v1.AgentEngine".into(),
        })
        .await
        .unwrap()
        .into_inner()
        .status
}

async fn readiness_becomes(url: &str, status: i32, what: &str) {
    let deadline = tokio::time::Instant::now() + Duration::from_secs(20);
    while readiness(url).await != status {
        assert!(tokio::time::Instant::now() < deadline, "{what}");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

#[tokio::test]
async fn redis_stopped_and_started_again() {
    const SERVING: i32 = 1;
    const NOT_SERVING: i32 = 2;
    let port = agentrt_test_support::unused_addr().port();
    let mut redis = OwnRedis::start(port).await;
    let url = redis.url();
    let prefix = redis_prefix("outage");
    let mut a = Stack::up(
        SCENARIOS,
        &[
            "--state",
            url.as_str(),
            "--state-key-prefix",
            prefix.as_str(),
        ],
    )
    .await;
    let agents = a.agents.url();
    readiness_becomes(&agents, SERVING, "serving with Redis up").await;
    let engine_id = a.engine_for(agent("slow", &[])).await;
    let mut running = a.start(&engine_id, "take your time").await;
    assert!(running.message().await.unwrap().is_some());

    redis.stop().await;
    // A run in flight cannot go on without its store: its stream ends, it does not hang.
    let ended = tokio::time::timeout(Duration::from_secs(20), async {
        loop {
            match running.message().await {
                Ok(Some(event)) if event.done => return Ok(event),
                Ok(Some(_)) => {}
                Ok(None) => panic!("the stream ended without a status"),
                Err(status) => return Err(status),
            }
        }
    })
    .await
    .expect("the run's stream ends while Redis is down");
    if let Err(status) = ended {
        assert_eq!(status.code(), tonic::Code::Unavailable, "{status:?}");
        assert!(status.message().contains("Redis"), "{status:?}");
    }
    let refused = a
        .service
        .create_agent_engine(v1::CreateAgentEngineRequest {
            config: Some(agent("calc", &["calculator"])),
            session_id: String::new(),
        })
        .await
        .unwrap_err();
    assert_eq!(refused.code(), tonic::Code::Unavailable, "{refused:?}");
    assert!(refused.message().contains("Redis"), "{refused:?}");
    // Its address is the operator's, not every client's.
    assert!(
        !refused.message().contains(&port.to_string()),
        "{refused:?}"
    );
    readiness_becomes(&agents, NOT_SERVING, "NOT_SERVING while Redis is down").await;

    let _redis = OwnRedis::start(port).await;
    readiness_becomes(&agents, SERVING, "serving again once Redis is back").await;
    let events = a
        .run(agent("calc", &["calculator"]), "what is 6 * 7?")
        .await;
    assert_eq!(done(&events)["stop_reason"], "final_answer");
}

/// A replica is not ready until its Redis has answered: one started against a Redis that
/// accepts connections but answers nothing (an address that black-holes, a wrong host
/// behind a proxy) says `NOT_SERVING` from its first answer on, so that a rollout does not
/// count it available.
#[tokio::test]
async fn a_replica_is_not_ready_before_its_redis_has_answered() {
    const NOT_SERVING: i32 = 2;
    let silent = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("redis://{}/0", silent.local_addr().unwrap());
    let held = tokio::spawn(async move {
        let mut connections = Vec::new();
        while let Ok((connection, _)) = silent.accept().await {
            connections.push(connection);
        }
    });
    let agents = Server::start("agent-server", &["--state", url.as_str()], &[]).await;
    let started = tokio::time::Instant::now();
    while started.elapsed() < Duration::from_millis(1500) {
        assert_eq!(
            readiness(&agents.url()).await,
            NOT_SERVING,
            "ready after {:?} though Redis never answered",
            started.elapsed()
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    held.abort();
}

/// `run_id`'s log from its start, as `engine`'s replica serves it.
async fn subscribe(
    engine: &mut AgentEngineClient<Channel>,
    run_id: &str,
) -> tonic::Streaming<v1::AgentStreamEvent> {
    engine
        .subscribe(v1::SubscribeRequest {
            run_id: run_id.into(),
            after_sequence: 0,
        })
        .await
        .unwrap()
        .into_inner()
}

/// The whole log of `run_id` as `engine`'s replica serves it.
async fn log_of(
    engine: &mut AgentEngineClient<Channel>,
    run_id: &str,
) -> Vec<v1::AgentStreamEvent> {
    common::rest(subscribe(engine, run_id).await).await
}

#[tokio::test]
async fn a_run_that_ends_while_it_writes_reads_the_same_everywhere() {
    // Run timeouts of a few milliseconds end runs at every point, among them while a
    // checkpoint is being written to Redis: the run's own replica, the other one and
    // GetRun must then still agree on every event and on the one `done`. (A run that
    // dropped such a write once numbered its later events otherwise on its own replica:
    // two `done` events, at 2 there and at 9 elsewhere.)
    let (mut a, mut b) = replicas("ends-while-writing").await;
    let mut engines = Vec::new();
    for ms in [2, 4, 6, 8, 10, 13, 16, 20] {
        let mut config = agent("calc", &["calculator"]);
        config.timeouts = Some(v1::Timeouts {
            run: Some(prost_types::Duration {
                seconds: 0,
                nanos: ms * 1_000_000,
            }),
            ..Default::default()
        });
        engines.push(a.engine_for(config).await);
    }
    // How many runs end early depends on how fast the machine steps: rounds go on until
    // at least 10 did (and at least 6 rounds ran), so a faster build still checks runs
    // cut at every point.
    let mut ended_early = 0;
    let mut round = 0;
    while round < 6 || (ended_early < 10 && round < 40) {
        round += 1;
        for engine_id in &engines {
            let events = collect(
                a.start(engine_id, &format!("what is 6 * 7? ({round})"))
                    .await,
            )
            .await;
            let run_id = events[0].run_id.clone();
            if done(&events)["stop_reason"] == "timeout" {
                ended_early += 1;
            }
            assert_eq!(
                log_of(&mut a.engine, &run_id).await,
                events,
                "on its own replica"
            );
            assert_eq!(
                log_of(&mut b.engine, &run_id).await,
                events,
                "on the other replica"
            );
            let state = get_run(&mut b.engine, &run_id).await;
            assert_eq!(
                state.last_sequence,
                events.last().unwrap().sequence,
                "GetRun's last sequence"
            );
        }
    }
    assert!(
        ended_early >= 10,
        "only {ended_early} runs timed out in {round} rounds"
    );
}

/// How a stream ends: its `done` event, or the status it ends with (`None`: it ended
/// without either). Panics when it does not end within `limit`.
async fn ending(
    stream: &mut tonic::Streaming<v1::AgentStreamEvent>,
    limit: Duration,
    what: &str,
) -> Result<Option<v1::AgentStreamEvent>, tonic::Status> {
    tokio::time::timeout(limit, async {
        loop {
            match stream.message().await {
                Ok(Some(event)) if event.done => return Ok(Some(event)),
                Ok(Some(_)) => {}
                Ok(None) => return Ok(None),
                Err(status) => return Err(status),
            }
        }
    })
    .await
    .unwrap_or_else(|_| panic!("{what} still waits after {limit:?}"))
}

#[tokio::test]
async fn a_run_whose_redis_comes_back_empty_stops_and_its_readers_are_told() {
    // A Redis that loses its data (restarted without persistence, a failover to an empty
    // replica) while a run executes: the run's replica must not write the run back
    // piecemeal (keys without a time to live, a record without an owner that fences its
    // own next write), and no reader may wait for ever. Before, the run's next write made
    // its log and record again, the one after was refused as another replica's, and the
    // run stopped silently: its readers waited for a `done` that never came.
    let prefix = redis_prefix("emptied");
    let (mut a, mut b) = replicas_under(&prefix).await;
    let engine_id = a.engine_for(agent("steps", &["calculator"])).await;
    let mut execute = a.start(&engine_id, "count up").await;
    let first = execute.message().await.unwrap().unwrap();
    let run_id = first.run_id.clone();
    let mut subscribed = subscribe(&mut b.engine, &run_id).await;
    // Once the first tool ran, everything the run had in Redis is gone.
    loop {
        let event = execute.message().await.unwrap().unwrap();
        assert!(!event.done, "the run ended before its state was lost");
        if kind(&event) == v1::EventType::ToolResult {
            break;
        }
    }
    let mut redis = redis::Client::open(redis_url())
        .unwrap()
        .get_multiplexed_async_connection()
        .await
        .unwrap();
    let keys = async |redis: &mut redis::aio::MultiplexedConnection| -> Vec<String> {
        redis::cmd("KEYS")
            .arg(format!("{prefix}:*"))
            .query_async(redis)
            .await
            .unwrap()
    };
    let _: () = redis::cmd("DEL")
        .arg(keys(&mut redis).await)
        .query_async(&mut redis)
        .await
        .unwrap();

    for (stream, what) in [
        (&mut execute, "Execute on the run's replica"),
        (&mut subscribed, "Subscribe on the other replica"),
    ] {
        match ending(stream, Duration::from_secs(20), what).await {
            Err(status) => {
                assert!(
                    matches!(
                        status.code(),
                        tonic::Code::NotFound | tonic::Code::Unavailable
                    ),
                    "{what}: {status:?}"
                );
                // The run, by its id: not the store's key (it named that).
                assert!(!status.message().contains(&prefix), "{what}: {status:?}");
            }
            Ok(end) => panic!("{what} ended with {end:?} although the run's state was lost"),
        }
    }
    // The run is forgotten everywhere, and nothing of it is left in Redis for ever.
    for engine in [&mut a.engine, &mut b.engine] {
        let status = engine
            .get_run(v1::GetRunRequest {
                run_id: run_id.clone(),
            })
            .await
            .unwrap_err();
        assert_eq!(status.code(), tonic::Code::NotFound, "{status:?}");
    }
    tokio::time::sleep(Duration::from_secs(2)).await;
    for key in keys(&mut redis).await {
        let ttl: i64 = redis::cmd("PTTL")
            .arg(&key)
            .query_async(&mut redis)
            .await
            .unwrap();
        assert!(
            ttl != -1 || key.ends_with(":leases:all"),
            "{key} was written again without a time to live"
        );
    }
    // The replicas serve new runs as before.
    let events = a
        .run(agent("calc", &["calculator"]), "what is 6 * 7?")
        .await;
    assert_eq!(done(&events)["stop_reason"], "final_answer");
}

#[tokio::test]
async fn a_replica_started_while_redis_is_down_is_ready_only_once_cancels_reach_it() {
    const SERVING: i32 = 1;
    let port = agentrt_test_support::unused_addr().port();
    let url = format!("redis://127.0.0.1:{port}/0");
    // Both replicas start with Redis down: their subscriptions to stop requests wait.
    let (mut a, mut b) = replicas_on(&url, &redis_prefix("late-redis")).await;
    // Long enough for the background subscription's retries to space out past a second.
    tokio::time::sleep(Duration::from_millis(3500)).await;
    let _redis = OwnRedis::start(port).await;
    readiness_becomes(&a.agents.url(), SERVING, "serving once Redis is up").await;

    // Ready means a Cancel through the other replica reaches A's run at once.
    let engine_id = a.engine_for(agent("slow", &[])).await;
    let mut execute = a.start(&engine_id, "take your time").await;
    let run_id = execute.message().await.unwrap().unwrap().run_id;
    cancel_within_a_second(&mut b.engine, &run_id).await;
    let rest = common::rest(execute).await;
    assert_eq!(done(&rest)["stop_reason"], "cancelled");
}
