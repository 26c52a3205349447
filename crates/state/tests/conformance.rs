//! Every store backend runs the same conformance suites (`agentrt-test-support`): the
//! in-memory stores, and the Redis stores against a real Redis (`AGENTRT_TEST_REDIS`, by
//! default `redis://127.0.0.1:6379/0`; `scripts/test` starts one when none answers). Each
//! Redis test keeps its keys under a prefix of its own.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::{sync::Arc, time::Duration};

use agentrt_events::{EventData, EventKind, RunEvent};
use agentrt_state::{
    BusError, BusLimits, EngineBudgets, EngineStore, EventBus, InMemoryBus, InMemorySessionStore,
    Lease, MemoryEngineStore, MemoryRunStore, Progress, RunRecord, RunRetention, RunStore,
    SessionLimits, SessionStore, StopReason,
    redis::{Redis, RedisLimits},
};
use agentrt_test_support::{
    OwnRedis,
    conformance::{self, redis_prefix, redis_url},
};
use futures_util::StreamExt;

const HOUR: Duration = Duration::from_secs(3600);

fn limits(events_per_run: usize) -> RedisLimits {
    RedisLimits {
        engine_ttl: HOUR,
        session_ttl: HOUR,
        max_exchanges: 3,
        max_history_bytes: 2500,
        run_retention: Duration::from_secs(600),
        events_per_run,
        retained_events: 1_000_000,
        lease: conformance::TEST_LEASE,
        max_waiting_per_principal: usize::MAX,
    }
}

/// Two replicas' connections to one Redis, under a fresh prefix.
async fn redis_pair(test: &str, events_per_run: usize) -> (Redis, Redis) {
    let prefix = redis_prefix(test);
    let connect = || Redis::connect(&redis_url(), &prefix, limits(events_per_run)).unwrap();
    let (a, b) = (connect(), connect());
    a.ping().await.unwrap_or_else(|e| {
        panic!(
            "this test needs Redis at {} (scripts/test starts one): {e}",
            redis_url()
        )
    });
    (a, b)
}

#[tokio::test]
async fn memory_event_bus() {
    conformance::event_bus(|limits| async move {
        let bus: Arc<dyn EventBus> = Arc::new(InMemoryBus::new(limits));
        (bus.clone(), bus)
    })
    .await;
}

#[tokio::test]
async fn redis_event_bus() {
    conformance::event_bus(|limits: BusLimits| async move {
        let (a, b) = redis_pair("bus", limits.events_per_run).await;
        (a.bus(), b.bus())
    })
    .await;
}

#[tokio::test]
async fn memory_session_store() {
    conformance::session_store(|| async {
        let store: Arc<dyn SessionStore> = Arc::new(InMemorySessionStore::new(SessionLimits {
            max_exchanges: 3,
            max_history_bytes: 2500,
            ..SessionLimits::default()
        }));
        (store.clone(), store)
    })
    .await;
}

#[tokio::test]
async fn redis_session_store() {
    conformance::session_store(|| async {
        let (a, b) = redis_pair("sessions", 100).await;
        (a.sessions(), b.sessions())
    })
    .await;
}

#[tokio::test]
async fn memory_session_lifetimes() {
    conformance::session_lifetimes(|| async {
        let store: Arc<dyn SessionStore> = Arc::new(InMemorySessionStore::new(SessionLimits {
            ttl: Duration::from_secs(1),
            ..SessionLimits::default()
        }));
        (store.clone(), store)
    })
    .await;
}

#[tokio::test]
async fn redis_session_lifetimes() {
    conformance::session_lifetimes(|| async {
        let prefix = redis_prefix("session-lifetimes");
        let connect = || {
            let limits = RedisLimits {
                session_ttl: Duration::from_secs(1),
                ..limits(100)
            };
            Redis::connect(&redis_url(), &prefix, limits).unwrap()
        };
        let (a, b) = (connect(), connect());
        (a.sessions(), b.sessions())
    })
    .await;
}

#[tokio::test]
async fn memory_engine_store() {
    conformance::engine_store(|| async {
        let store: Arc<dyn EngineStore> = Arc::new(MemoryEngineStore::new(HOUR, 100));
        (store.clone(), store)
    })
    .await;
}

#[tokio::test]
async fn redis_engine_store() {
    conformance::engine_store(|| async {
        let (a, b) = redis_pair("engines", 100).await;
        (a.engines(), b.engines())
    })
    .await;
}

#[tokio::test]
async fn memory_engine_owners() {
    conformance::engine_owners(|ttl| async move {
        let store: Arc<dyn EngineStore> = Arc::new(MemoryEngineStore::new(ttl, 100));
        (store.clone(), store)
    })
    .await;
}

#[tokio::test]
async fn redis_engine_owners() {
    conformance::engine_owners(|ttl| async move {
        let prefix = redis_prefix("engine-owners");
        let connect = || {
            Redis::connect(
                &redis_url(),
                &prefix,
                RedisLimits {
                    engine_ttl: ttl,
                    ..limits(100)
                },
            )
            .unwrap()
        };
        (connect().engines(), connect().engines())
    })
    .await;
}

#[tokio::test]
async fn memory_engine_budgets() {
    conformance::engine_budgets(|| async {
        let store: Arc<dyn EngineStore> =
            Arc::new(MemoryEngineStore::new(HOUR, 3).with_budgets(EngineBudgets {
                max_bytes: usize::MAX,
                max_per_principal: 2,
            }));
        (store.clone(), store)
    })
    .await;
}

#[tokio::test]
async fn memory_waiting_budget() {
    conformance::waiting_budget(|| async {
        let store: Arc<dyn RunStore> = Arc::new(MemoryRunStore::new(RunRetention {
            max_waiting_per_principal: 1,
            ..RunRetention::unbounded(Duration::from_secs(600), conformance::TEST_LEASE)
        }));
        (store.clone(), store)
    })
    .await;
}

#[tokio::test]
async fn redis_waiting_budget() {
    conformance::waiting_budget(|| async {
        let prefix = redis_prefix("waiting-budget");
        let connect = || {
            Redis::connect(
                &redis_url(),
                &prefix,
                RedisLimits {
                    max_waiting_per_principal: 1,
                    ..limits(100)
                },
            )
            .unwrap()
        };
        (connect().runs(), connect().runs())
    })
    .await;
}

#[tokio::test]
async fn memory_refused_wait() {
    conformance::refused_wait(|| async {
        let store: Arc<dyn RunStore> = Arc::new(MemoryRunStore::new(RunRetention {
            max_waiting_per_principal: 1,
            ..RunRetention::unbounded(Duration::from_secs(600), conformance::TEST_LEASE)
        }));
        let bus: Arc<dyn EventBus> = Arc::new(InMemoryBus::new(BusLimits::default()));
        (store, bus)
    })
    .await;
}

#[tokio::test]
async fn redis_refused_wait() {
    conformance::refused_wait(|| async {
        let redis = Redis::connect(
            &redis_url(),
            &redis_prefix("refused-wait"),
            RedisLimits {
                max_waiting_per_principal: 1,
                ..limits(100)
            },
        )
        .unwrap();
        (redis.runs(), redis.bus())
    })
    .await;
}

#[tokio::test]
async fn redis_engine_budgets() {
    conformance::engine_budgets(|| async {
        let (a, b) = redis_pair("engine-budgets", 100).await;
        (a.engines_within(3, 2), b.engines_within(3, 2))
    })
    .await;
}

/// One in-memory run store: the two replicas of a process share it.
fn memory_runs() -> Arc<dyn RunStore> {
    Arc::new(MemoryRunStore::new(RunRetention::unbounded(
        Duration::from_secs(600),
        conformance::TEST_LEASE,
    )))
}

#[tokio::test]
async fn memory_lapsed_waits() {
    conformance::lapsed_waits(|| async {
        let store = memory_runs();
        (store.clone(), store)
    })
    .await;
}

#[tokio::test]
async fn redis_lapsed_waits() {
    conformance::lapsed_waits(|| async {
        let (a, b) = redis_pair("lapsed-waits", 100).await;
        (a.runs(), b.runs())
    })
    .await;
}

#[tokio::test]
async fn memory_run_store() {
    conformance::run_store(|| async {
        let store = memory_runs();
        (store.clone(), store)
    })
    .await;
}

#[tokio::test]
async fn memory_run_leases() {
    conformance::run_leases(|| async {
        let store = memory_runs();
        (store.clone(), store)
    })
    .await;
}

#[tokio::test]
async fn redis_run_leases() {
    conformance::run_leases(|| async {
        let (a, b) = redis_pair("leases", 100).await;
        (a.runs(), b.runs())
    })
    .await;
}

#[tokio::test]
async fn memory_run_waits() {
    conformance::run_waits(|| async {
        let store = memory_runs();
        (store.clone(), store)
    })
    .await;
}

#[tokio::test]
async fn redis_run_waits() {
    conformance::run_waits(|| async {
        let (a, b) = redis_pair("waits", 100).await;
        (a.runs(), b.runs())
    })
    .await;
}

#[tokio::test]
async fn redis_run_store() {
    conformance::run_store(|| async {
        let (a, b) = redis_pair("runs", 100).await;
        (a.runs(), b.runs())
    })
    .await;
}

fn started() -> RunEvent {
    RunEvent::new(
        EventKind::RunStarted,
        1,
        String::new(),
        Some(EventData::RunStarted {
            engine_id: "e".into(),
            agent: "a".into(),
        }),
    )
}

/// A replica that lost a run to another cannot publish to it any more; its readers of the
/// run go on reading the shared log, where the new owner continues it: every event once.
#[tokio::test]
async fn redis_bus_fences_a_replaced_owner_and_the_new_one_continues_the_log() {
    let (a, b) = redis_pair("fence", 100).await;
    let publisher = a.bus().open("fr", "a.1").await.unwrap();
    let mut record = RunRecord::new("fr", "e", "s", "m", "q");
    record.owner = "a.1".into();
    let progress = Progress {
        spec: Some("{}".into()),
        state: "{}".into(),
        ..Progress::default()
    };
    a.runs().save(&record, 0, Some(&progress)).await.unwrap();
    publisher.publish(vec![started()]).await.unwrap();
    publisher.publish(vec![started()]).await.unwrap();
    let reader = a.bus().subscribe("fr", 0).await.unwrap();

    tokio::time::sleep(conformance::TEST_LEASE + Duration::from_millis(100)).await;
    let taken = b.runs().take_over("fr", "b.1").await.unwrap().unwrap();
    assert_eq!(taken.record.owner, "b.1");
    assert_eq!(
        publisher.publish(vec![started()]).await,
        Err(BusError::Fenced("fr".into()))
    );

    let resumed = b.bus().resume("fr", "b.1", 1).await.unwrap();
    let tail: Vec<u64> = resumed.tail.iter().map(|e| e.sequence).collect();
    assert_eq!(tail, [2]);
    resumed
        .publisher
        .publish(vec![RunEvent {
            done: true,
            ..started()
        }])
        .await
        .unwrap();
    drop(publisher);
    // The reader on the replica that lost the run read its copy, then the shared log.
    let read: Vec<Result<u64, BusError>> =
        tokio::time::timeout(Duration::from_secs(5), reader.collect::<Vec<_>>())
            .await
            .expect("the reader ends")
            .into_iter()
            .map(|e| e.map(|e| e.sequence))
            .collect();
    assert_eq!(read, [Ok(1), Ok(2), Ok(3)]);
    let all: Vec<u64> = b
        .bus()
        .subscribe("fr", 0)
        .await
        .unwrap()
        .map(|e| e.unwrap().sequence)
        .collect()
        .await;
    assert_eq!(all, [1, 2, 3], "no gap, no repeat, one end");
}

/// A write that timed out while Redis hung may have run all the same: its events are in
/// the log when the publisher writes them again. They are not written twice, and the rest
/// goes on (the retry used to fail for ever on the ids Redis already had).
#[tokio::test]
async fn redis_events_written_by_a_write_that_timed_out_are_not_written_again() {
    let prefix = redis_prefix("timed-out-write");
    let a = Redis::connect(&redis_url(), &prefix, limits(100)).unwrap();
    let publisher = a.bus().open("tw", "").await.unwrap();
    publisher.publish(vec![started()]).await.unwrap();
    // Event 2 as the write that timed out left it in the log.
    let mut second = started();
    second.sequence = 2;
    let mut connection = redis::Client::open(redis_url())
        .unwrap()
        .get_multiplexed_async_connection()
        .await
        .unwrap();
    let _: String = redis::cmd("XADD")
        .arg(format!("{prefix}:events:tw"))
        .arg("2-1")
        .arg("e")
        .arg(serde_json::to_vec(&second).unwrap())
        .query_async(&mut connection)
        .await
        .unwrap();
    // The publisher writes 2 again with 3: 2 is there already, 3 is written.
    publisher
        .publish(vec![
            started(),
            RunEvent {
                done: true,
                ..started()
            },
        ])
        .await
        .unwrap();
    let all: Vec<u64> = a
        .bus()
        .subscribe("tw", 0)
        .await
        .unwrap()
        .map(|e| e.unwrap().sequence)
        .collect()
        .await;
    assert_eq!(all, [1, 2, 3], "no gap, no repeat, one end");
}

/// A checkpoint writes the run's events and its record in one call: both are read on
/// another replica at once, after any events the publisher held back, in order; an owner
/// that lost the run writes neither.
#[tokio::test]
async fn redis_checkpoint_writes_events_and_record_together_or_neither() {
    let (a, b) = redis_pair("checkpoint", 100).await;
    let publisher = a.bus().open("cp", "a.1").await.unwrap();
    let (mut record, progress) = owned_run("cp", "s");
    // A checkpoint of replica A with one more event.
    let runs = a.runs();
    let checkpoint = |record: &RunRecord| {
        let record = record.clone();
        let (runs, publisher, progress) = (&runs, &publisher, &progress);
        async move {
            runs.checkpoint(
                publisher.as_ref(),
                vec![started()],
                &record,
                0,
                Some(progress),
            )
            .await
        }
    };
    checkpoint(&record).await.unwrap();
    assert_eq!(b.runs().load("cp").await.unwrap().unwrap(), record);
    let sequences = |redis: Redis| async move {
        let mut reader = redis.bus().subscribe("cp", 0).await.unwrap();
        let mut read = Vec::new();
        while let Ok(Some(event)) =
            tokio::time::timeout(Duration::from_millis(300), reader.next()).await
        {
            read.push(event.unwrap().sequence);
        }
        read
    };
    assert_eq!(sequences(b.clone()).await, [1]);

    // A text delta the publisher holds back goes out first, with the checkpoint.
    publisher
        .publish(vec![RunEvent::new(
            EventKind::FinalAnswer,
            1,
            "4".into(),
            None,
        )])
        .await
        .unwrap();
    record.steps.push(agentrt_state::StepRecord {
        iteration: 1,
        answer: "4".into(),
        ..Default::default()
    });
    record.last_sequence = 3;
    checkpoint(&record).await.unwrap();
    assert_eq!(b.runs().load("cp").await.unwrap().unwrap(), record);
    assert_eq!(sequences(b.clone()).await, [1, 2, 3]);

    // Taken over: the old owner's checkpoint writes nothing.
    tokio::time::sleep(conformance::TEST_LEASE + Duration::from_millis(100)).await;
    b.runs().take_over("cp", "b.1").await.unwrap().unwrap();
    let mut stale = record.clone();
    stale.last_sequence = 4;
    stale.steps[0].answer = "stale".into();
    let written = checkpoint(&stale).await;
    assert!(
        matches!(
            written,
            Err(agentrt_state::CheckpointError::Events(BusError::Fenced(_)))
        ),
        "{written:?}"
    );
    let kept = b.runs().load("cp").await.unwrap().unwrap();
    assert_eq!(
        (kept.last_sequence, kept.steps[0].answer.as_str()),
        (3, "4")
    );
    assert_eq!(sequences(b).await, [1, 2, 3]);
}

/// A store apart from the bus writes a run's end before its `done` event: a reader who
/// sees `done` and asks for the run finds it ended.
#[tokio::test]
async fn memory_checkpoint_saves_a_run_end_before_its_done_event() {
    /// Notes, as each batch is published, whether the run's record had ended.
    struct Watching {
        inner: Box<dyn agentrt_events::RunPublisher>,
        runs: Arc<dyn RunStore>,
        seen: std::sync::Mutex<Vec<bool>>,
    }
    #[async_trait::async_trait]
    impl agentrt_events::RunPublisher for Watching {
        async fn publish(&self, events: Vec<RunEvent>) -> Result<(), BusError> {
            let record = self.runs.load("end").await.unwrap();
            let ended = record.is_some_and(|r| r.ended());
            self.seen.lock().unwrap().push(ended);
            self.inner.publish(events).await
        }
        async fn release(&self) -> Result<(), BusError> {
            self.inner.release().await
        }
    }
    let runs = memory_runs();
    let bus = InMemoryBus::new(BusLimits::default());
    let publisher = Watching {
        inner: bus.open("end", "a.1").await.unwrap(),
        runs: runs.clone(),
        seen: std::sync::Mutex::default(),
    };
    let mut record = RunRecord::new("end", "e", "s", "m", "q");
    record.owner = "a.1".into();
    record.last_sequence = 1;
    runs.checkpoint(&publisher, vec![started()], &record, 0, None)
        .await
        .unwrap();
    let reason = agentrt_state::StopReason::FinalAnswer;
    record.status = reason.status();
    record.stop_reason = Some(reason);
    record.last_sequence = 2;
    let done = RunEvent {
        done: true,
        ..RunEvent::new(EventKind::FinalAnswer, 1, String::new(), None)
    };
    runs.checkpoint(&publisher, vec![done], &record, 0, None)
        .await
        .unwrap();
    assert_eq!(*publisher.seen.lock().unwrap(), [false, true]);
    assert!(runs.load("end").await.unwrap().unwrap().ended());
}

/// Run `run_id` of session `session_id`, owned by `a.1`, with its first event published,
/// and what continuing it needs.
fn owned_run(run_id: &str, session_id: &str) -> (RunRecord, Progress) {
    let mut record = RunRecord::new(run_id, "e", session_id, "m", "q");
    record.owner = "a.1".into();
    record.last_sequence = 1;
    let progress = Progress {
        spec: Some("{}".into()),
        state: "{}".into(),
        ..Progress::default()
    };
    (record, progress)
}

/// [`owned_run`], opened on `bus` and saved in `runs` with its first event.
async fn started_run(
    runs: &dyn RunStore,
    bus: &dyn EventBus,
    run_id: &str,
    session_id: &str,
) -> (Box<dyn agentrt_events::RunPublisher>, RunRecord) {
    let publisher = bus.open(run_id, "a.1").await.unwrap();
    let (record, progress) = owned_run(run_id, session_id);
    runs.checkpoint(
        publisher.as_ref(),
        vec![started()],
        &record,
        0,
        Some(&progress),
    )
    .await
    .unwrap();
    (publisher, record)
}

/// Ends `record` with an answer; its `done` event.
fn answered(record: &mut RunRecord) -> RunEvent {
    let reason = agentrt_state::StopReason::FinalAnswer;
    record.status = reason.status();
    record.stop_reason = Some(reason);
    record.last_sequence = 2;
    RunEvent {
        done: true,
        ..RunEvent::new(EventKind::FinalAnswer, 1, String::new(), None)
    }
}

/// A run that answered ends with its turn kept in its session's history: the end and the
/// turn are both written (`RunStore::end`), and the turn is taken once kept.
async fn end_keeps_the_turn(
    runs: Arc<dyn RunStore>,
    bus: Arc<dyn EventBus>,
    sessions: Arc<dyn SessionStore>,
) {
    let (publisher, mut record) = started_run(&*runs, &*bus, "turn", "s-turn").await;
    let done = answered(&mut record);
    let exchange = agentrt_state::Exchange {
        messages: vec![agentrt_models::ChatMessage::User("What is 2 + 2?".into())],
        tokens: 7,
        kept_ms: 1,
    };
    let mut turn = Some(Arc::new(exchange.clone()));
    runs.end(
        publisher.as_ref(),
        vec![done],
        &record,
        0,
        (&*sessions, &mut turn),
    )
    .await
    .unwrap();
    assert_eq!(turn, None, "the turn is taken once kept");
    let history = sessions.history("s-turn").await.unwrap();
    assert_eq!(
        history.iter().map(|e| (**e).clone()).collect::<Vec<_>>(),
        [exchange]
    );
    assert!(runs.load("turn").await.unwrap().unwrap().ended());
    let mut reader = bus.subscribe("turn", 0).await.unwrap();
    let mut read = Vec::new();
    while let Some(event) = reader.next().await {
        read.push(event.unwrap().sequence);
    }
    assert_eq!(read, [1, 2]);
}

#[tokio::test]
async fn memory_end_keeps_the_turn() {
    let bus: Arc<dyn EventBus> = Arc::new(InMemoryBus::new(BusLimits::default()));
    let sessions: Arc<dyn SessionStore> =
        Arc::new(InMemorySessionStore::new(SessionLimits::default()));
    end_keeps_the_turn(memory_runs(), bus, sessions).await;
}

#[tokio::test]
async fn redis_end_keeps_the_turn() {
    let (a, _) = redis_pair("end-turn", 100).await;
    end_keeps_the_turn(a.runs(), a.bus(), a.sessions()).await;
    // The end written again (as after a write that timed out once Redis had run it)
    // keeps no second turn.
    let publisher = a.bus().resume("turn", "a.1", 2).await.unwrap().publisher;
    let mut record = a.runs().load("turn").await.unwrap().unwrap();
    record.owner = "a.1".into();
    let sessions = a.sessions();
    let mut turn = Some(Arc::new(agentrt_state::Exchange {
        messages: vec![agentrt_models::ChatMessage::User("What is 2 + 2?".into())],
        tokens: 7,
        kept_ms: 1,
    }));
    a.runs()
        .end(
            publisher.as_ref(),
            Vec::new(),
            &record,
            0,
            (&*sessions, &mut turn),
        )
        .await
        .unwrap();
    assert_eq!(sessions.history("s-turn").await.unwrap().len(), 1);
}

/// With Redis, a run's end and its turn are one write: a replica that lost the run keeps
/// no turn (the replica that took it over keeps its own).
#[tokio::test]
async fn redis_end_writes_the_turn_with_the_end_or_neither() {
    let (a, b) = redis_pair("end-fenced", 100).await;
    let (publisher, mut record) = started_run(&*a.runs(), &*a.bus(), "tf", "s-tf").await;
    // Replica B takes the run over while A still answers.
    tokio::time::sleep(conformance::TEST_LEASE + Duration::from_millis(100)).await;
    b.runs().take_over("tf", "b.1").await.unwrap().unwrap();
    let done = answered(&mut record);
    let mut turn = Some(Arc::new(agentrt_state::Exchange {
        messages: vec![agentrt_models::ChatMessage::User("stale".into())],
        tokens: 1,
        kept_ms: 1,
    }));
    let sessions = a.sessions();
    let written = a
        .runs()
        .end(
            publisher.as_ref(),
            vec![done],
            &record,
            0,
            (&*sessions, &mut turn),
        )
        .await;
    assert!(
        matches!(
            written,
            Err(agentrt_state::CheckpointError::Events(BusError::Fenced(_)))
        ),
        "{written:?}"
    );
    assert!(turn.is_some(), "a turn not kept stays to keep");
    assert!(sessions.history("s-tf").await.unwrap().is_empty());
    assert!(!b.runs().load("tf").await.unwrap().unwrap().ended());
}

/// A TCP relay to the test Redis that can be cut: while `down`, it closes the connections
/// it has and every one it accepts.
async fn breakable_relay() -> (String, Arc<tokio::sync::watch::Sender<bool>>) {
    let target = redis_url();
    let target = target
        .strip_prefix("redis://")
        .unwrap()
        .split('/')
        .next()
        .unwrap()
        .to_owned();
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let address = listener.local_addr().unwrap();
    let (down, watch) = tokio::sync::watch::channel(false);
    tokio::spawn(async move {
        while let Ok((mut inbound, _)) = listener.accept().await {
            let mut watch = watch.clone();
            if *watch.borrow() {
                continue;
            }
            let target = target.clone();
            tokio::spawn(async move {
                let Ok(mut outbound) = tokio::net::TcpStream::connect(&target).await else {
                    return;
                };
                tokio::select! {
                    _ = tokio::io::copy_bidirectional(&mut inbound, &mut outbound) => {}
                    _ = watch.wait_for(|down| *down) => {}
                }
            });
        }
    });
    (format!("redis://{address}/0"), Arc::new(down))
}

/// Events a publisher let wait (published soon: a tool result before the next model call)
/// whose write failed are written again once Redis is back, not held until the run's next
/// event, which may be a long model call away.
#[tokio::test]
async fn redis_events_let_wait_are_written_after_a_failed_write_without_another_publish() {
    let prefix = redis_prefix("flush-retry");
    let (relayed, down) = breakable_relay().await;
    let a = Redis::connect(&relayed, &prefix, limits(100)).unwrap();
    let reader = Redis::connect(&redis_url(), &prefix, limits(100)).unwrap();
    let publisher = a.bus().open("fr", "").await.unwrap();
    publisher.publish(vec![started()]).await.unwrap();
    down.send_replace(true);
    publisher
        .publish_soon(vec![RunEvent::new(
            EventKind::ToolResult,
            1,
            String::new(),
            None,
        )])
        .await
        .unwrap();
    // The flusher's write fails while Redis cannot be reached.
    tokio::time::sleep(Duration::from_millis(300)).await;
    down.send_replace(false);
    let mut events = reader.bus().subscribe("fr", 0).await.unwrap();
    let first = events.next().await.unwrap().unwrap();
    assert_eq!(first.sequence, 1);
    let second = tokio::time::timeout(Duration::from_secs(10), events.next())
        .await
        .expect("the event let wait was written once Redis was back")
        .unwrap()
        .unwrap();
    assert_eq!((second.sequence, second.kind), (2, EventKind::ToolResult));
    drop(publisher);
}

/// A reader of an ended run's log that expires before it is read to its end is told so
/// (the stream ends with an error), not ended as if the run had ended where it stopped.
#[tokio::test]
async fn redis_a_log_that_expires_under_its_reader_is_an_error_not_an_end() {
    let prefix = redis_prefix("expiring-log");
    let connect = || Redis::connect(&redis_url(), &prefix, limits(10_000)).unwrap();
    let (a, b) = (connect(), connect());
    let (a, b) = (a.bus(), b.bus());
    let publisher = a.open("long", "").await.unwrap();
    let mut events = vec![started()];
    for i in 0..600 {
        events.push(RunEvent::new(
            EventKind::FinalAnswer,
            1,
            format!("{i} "),
            None,
        ));
    }
    events.push(RunEvent {
        done: true,
        ..RunEvent::new(EventKind::FinalAnswer, 1, String::new(), None)
    });
    publisher.publish(events).await.unwrap();
    drop(publisher);
    // Another replica reads the shared log, slowly: it expires after the first batch.
    let mut reader = b.subscribe("long", 0).await.unwrap();
    assert_eq!(reader.next().await.unwrap().unwrap().sequence, 1);
    let client = redis::Client::open(redis_url()).unwrap();
    let mut connection = client.get_multiplexed_async_connection().await.unwrap();
    let _: () = redis::cmd("DEL")
        .arg(format!("{prefix}:events:long"))
        .query_async(&mut connection)
        .await
        .unwrap();
    let rest: Vec<_> = tokio::time::timeout(Duration::from_secs(10), reader.collect::<Vec<_>>())
        .await
        .unwrap();
    assert!(
        !rest.iter().any(|e| e.as_ref().is_ok_and(|e| e.done)),
        "the log was gone before its end"
    );
    assert!(
        matches!(rest.last(), Some(Err(BusError::UnknownRun(_)))),
        "{:?}",
        rest.last()
    );
}

/// A reader waits for notices of new events; the notice of one written while its
/// replica's subscription connection was down never comes. Once the connection is back
/// and has subscribed again, the reader looks at once, not at its next poll. With a Redis
/// of the test's own, whose connections the test cuts.
#[tokio::test]
async fn redis_a_reader_finds_what_was_written_while_its_notices_were_lost() {
    let own = OwnRedis::start(agentrt_test_support::unused_addr().port()).await;
    let prefix = redis_prefix("lost-notices");
    let a = Redis::connect(&own.url(), &prefix, limits(100)).unwrap();
    let b = Redis::connect(&own.url(), &prefix, limits(100)).unwrap();
    let publisher = a.bus().open("ln", "").await.unwrap();
    publisher.publish(vec![started()]).await.unwrap();
    let mut reader = b.bus().subscribe("ln", 0).await.unwrap();
    assert_eq!(reader.next().await.unwrap().unwrap().sequence, 1);
    let waiting = tokio::spawn(async move { reader.next().await });
    tokio::time::sleep(Duration::from_millis(500)).await;

    // Event 2, written without its notice (as one lost while the connection was down).
    let mut connection = redis::Client::open(own.url())
        .unwrap()
        .get_multiplexed_async_connection()
        .await
        .unwrap();
    let mut second = started();
    second.sequence = 2;
    let _: String = redis::cmd("XADD")
        .arg(format!("{prefix}:events:ln"))
        .arg("2-0")
        .arg("e")
        .arg(serde_json::to_vec(&second).unwrap())
        .query_async(&mut connection)
        .await
        .unwrap();
    tokio::time::sleep(Duration::from_millis(700)).await;
    assert!(!waiting.is_finished(), "read without a notice");

    // The one connection subscribed to anything is B's: cut, it subscribes again.
    let clients: String = redis::cmd("CLIENT")
        .arg("LIST")
        .query_async(&mut connection)
        .await
        .unwrap();
    let subscriber = clients
        .lines()
        .find(|line| line.contains(" sub=1 "))
        .and_then(|line| line.strip_prefix("id="))
        .and_then(|rest| rest.split(' ').next())
        .expect("B's subscription connection")
        .to_owned();
    let _: () = redis::cmd("CLIENT")
        .arg("KILL")
        .arg("ID")
        .arg(&subscriber)
        .query_async(&mut connection)
        .await
        .unwrap();
    let read = tokio::time::timeout(Duration::from_secs(5), waiting)
        .await
        .expect("read once the subscription is back, not at the next poll")
        .unwrap();
    assert_eq!(read.unwrap().unwrap().sequence, 2);
}

/// A stop request is announced once, to the replicas subscribed then: one made while the
/// owner's subscription was being remade never reached it. The owner's next lease
/// renewal finds it and hands it to the run managers there.
#[tokio::test]
async fn redis_a_stop_request_the_owner_missed_reaches_it_at_its_next_renewal() {
    let prefix = redis_prefix("missed-stop");
    let a = Redis::connect(&redis_url(), &prefix, limits(100)).unwrap();
    let runs = a.runs();
    let _run = started_run(runs.as_ref(), a.bus().as_ref(), "ms", "s").await;
    let mut requests = runs.stop_requests().await.unwrap();
    // The request as it is kept, without its announcement.
    let mut connection = redis::Client::open(redis_url())
        .unwrap()
        .get_multiplexed_async_connection()
        .await
        .unwrap();
    let _: () = redis::cmd("SET")
        .arg(format!("{prefix}:stop:ms"))
        .arg(StopReason::Cancelled.as_str())
        .query_async(&mut connection)
        .await
        .unwrap();
    let lost = runs
        .clone()
        .lease_renewer()
        .unwrap()
        .renew(&[Lease {
            run_id: "ms".into(),
            token: "a.1".into(),
        }])
        .await
        .unwrap();
    assert!(lost.is_empty(), "{lost:?}");
    let request = tokio::time::timeout(Duration::from_secs(2), requests.next())
        .await
        .expect("the renewal hands the request on")
        .unwrap();
    assert_eq!(request.run_id, "ms");
    assert_eq!(request.reason, StopReason::Cancelled);
}
