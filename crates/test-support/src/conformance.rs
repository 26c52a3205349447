//! The conformance suites of the state stores: every backend (in memory, Redis) runs the
//! same tests, so that nothing a client observes depends on where the state lives. A new
//! backend is done when it passes them.
//!
//! Each suite takes a factory that makes a fresh, empty store (a store per test: for a
//! shared backend, under a key prefix of its own); the run-store and bus suites take two
//! handles on one store where it matters that two replicas share it.

use std::{future::Future, sync::Arc, time::Duration};

use agentrt_state::{
    BusError, BusLimits, Claim, EngineStore, EventBus, Exchange, Lease, Progress, Resumable,
    RunRecord, RunStatus, RunStore, SessionStore, StateError, StepRecord, StopReason, StoredEngine,
};
use futures_util::StreamExt;

use agentrt_events::{EventKind, RunEvent};

fn delta(text: &str) -> RunEvent {
    RunEvent::new(EventKind::FinalAnswer, 1, text.into(), None)
}

fn done() -> RunEvent {
    RunEvent {
        done: true,
        ..RunEvent::new(EventKind::FinalAnswer, 1, String::new(), None)
    }
}

async fn sequences(bus: &dyn EventBus, run_id: &str, after: u64) -> Vec<Result<u64, BusError>> {
    let stream = bus.subscribe(run_id, after).await.unwrap();
    tokio::time::timeout(
        Duration::from_secs(10),
        stream.map(|e| e.map(|e| e.sequence)).collect::<Vec<_>>(),
    )
    .await
    .expect("the stream ends")
}

/// The event bus suite. `new` makes a bus with the given bounds; `pair` makes two buses
/// sharing one log (two replicas; for the in-memory bus, the same bus twice).
pub async fn event_bus<F, Fut>(new: F)
where
    F: Fn(BusLimits) -> Fut,
    Fut: Future<Output = (Arc<dyn EventBus>, Arc<dyn EventBus>)>,
{
    let (bus, other) = new(BusLimits::default()).await;

    // Replay from any offset, then live, on either replica; nothing after `done`.
    let publisher = bus.open("r1", "").await.unwrap();
    publisher
        .publish(vec![delta("a"), delta("b")])
        .await
        .unwrap();
    let live = {
        let other = other.clone();
        tokio::spawn(async move { sequences(&*other, "r1", 0).await })
    };
    let from_two = {
        let other = other.clone();
        tokio::spawn(async move { sequences(&*other, "r1", 2).await })
    };
    tokio::time::sleep(Duration::from_millis(50)).await;
    publisher.publish(vec![delta("c")]).await.unwrap();
    publisher
        .publish(vec![done(), delta("late")])
        .await
        .unwrap();
    publisher.publish(vec![delta("later")]).await.unwrap();
    assert_eq!(live.await.unwrap(), [Ok(1), Ok(2), Ok(3), Ok(4)]);
    assert_eq!(from_two.await.unwrap(), [Ok(3), Ok(4)]);
    assert_eq!(
        sequences(&*bus, "r1", 4).await,
        [],
        "nothing beyond the end"
    );
    assert_eq!(sequences(&*other, "r1", u64::MAX).await, []);

    // A cursor at or beyond the end of a running run waits, then ends with `done`.
    let publisher = bus.open("r2", "").await.unwrap();
    publisher
        .publish(vec![delta("a"), delta("b")])
        .await
        .unwrap();
    let at_end = {
        let other = other.clone();
        tokio::spawn(async move { sequences(&*other, "r2", 2).await })
    };
    let beyond = {
        let other = other.clone();
        tokio::spawn(async move { sequences(&*other, "r2", u64::MAX).await })
    };
    tokio::time::sleep(Duration::from_millis(50)).await;
    publisher.publish(vec![delta("c"), done()]).await.unwrap();
    assert_eq!(at_end.await.unwrap(), [Ok(3), Ok(4)]);
    assert_eq!(
        beyond.await.unwrap(),
        [Ok(4)],
        "a running run owes its done"
    );

    // Readers that follow a run from its start get every event, in order, however the
    // writes fall between their reads.
    for round in 0..100u64 {
        let run_id = format!("many-{round}");
        let publisher = bus.open(&run_id, "").await.unwrap();
        let started = RunEvent::new(
            EventKind::RunStarted,
            1,
            String::new(),
            Some(agentrt_events::EventData::RunStarted {
                engine_id: "e".into(),
                agent: "a".into(),
            }),
        );
        publisher.publish(vec![started]).await.unwrap();
        let reader = {
            let other = other.clone();
            let run_id = run_id.clone();
            tokio::spawn(async move { sequences(&*other, &run_id, 0).await })
        };
        if round % 2 == 1 {
            tokio::time::sleep(Duration::from_millis(round % 7)).await;
        }
        publisher.publish(vec![delta("a")]).await.unwrap();
        if round % 4 == 1 {
            tokio::time::sleep(Duration::from_millis(round % 3)).await;
        }
        publisher.publish(vec![done()]).await.unwrap();
        assert_eq!(
            reader.await.unwrap(),
            [Ok(1), Ok(2), Ok(3)],
            "round {round}"
        );
    }

    // Ids are unique; unknown runs are reported.
    assert_eq!(
        bus.open("r2", "").await.err(),
        Some(BusError::DuplicateRun("r2".into()))
    );
    assert_eq!(
        other.subscribe("nope", 0).await.err(),
        Some(BusError::UnknownRun("nope".into()))
    );

    // A reader behind the bound is told what it lost.
    let (bus, other) = new(BusLimits {
        events_per_run: 3,
        ..BusLimits::default()
    })
    .await;
    let publisher = bus.open("r3", "").await.unwrap();
    for text in ["a", "b", "c", "d", "e"] {
        publisher.publish(vec![delta(text)]).await.unwrap();
    }
    publisher.publish(vec![done()]).await.unwrap();
    assert_eq!(
        sequences(&*other, "r3", 0).await,
        [Err(BusError::Lagged { from: 1, to: 3 })]
    );
    assert_eq!(sequences(&*other, "r3", 3).await, [Ok(4), Ok(5), Ok(6)]);
}

/// The session store suite; `new` makes a store keeping 3 exchanges per session, and
/// `pair` two handles on one.
pub async fn session_store<F, Fut>(new: F)
where
    F: Fn() -> Fut,
    Fut: Future<Output = (Arc<dyn SessionStore>, Arc<dyn SessionStore>)>,
{
    let (store, other) = new().await;
    let exchange = |n: u32| Exchange {
        messages: vec![agentrt_models_message(n)],
        tokens: n,
    };
    assert!(store.history("s").await.unwrap().is_empty(), "unknown");
    store.append("s", exchange(1)).await.unwrap();
    other.append("s", exchange(2)).await.unwrap();
    let history = other.history("s").await.unwrap();
    assert_eq!(
        history.iter().map(|e| e.tokens).collect::<Vec<_>>(),
        [1, 2],
        "in the order appended, whichever replica appended"
    );
    assert_eq!(*history[0], exchange(1), "kept as appended");
    for n in 3..=5 {
        store.append("s", exchange(n)).await.unwrap();
    }
    let tokens: Vec<u32> = store
        .history("s")
        .await
        .unwrap()
        .iter()
        .map(|e| e.tokens)
        .collect();
    assert_eq!(tokens, [3, 4, 5], "the oldest beyond the bound go first");

    // Appends made at once from two replicas all land, each whole.
    let (a, b) = (store.clone(), other.clone());
    let left = tokio::spawn(async move {
        for n in 0..20 {
            a.append("busy", exchange(100 + n)).await.unwrap();
        }
    });
    let right = tokio::spawn(async move {
        for n in 0..20 {
            b.append("busy", exchange(200 + n)).await.unwrap();
        }
    });
    left.await.unwrap();
    right.await.unwrap();
    let history = store.history("busy").await.unwrap();
    assert_eq!(history.len(), 3);
    assert!(history.iter().all(|e| e.messages.len() == 1));
}

fn agentrt_models_message(n: u32) -> agentrt_models::ChatMessage {
    agentrt_models::ChatMessage::User(format!("turn {n}"))
}

/// The engine store suite; `new` makes a store with a one-hour TTL.
pub async fn engine_store<F, Fut>(new: F)
where
    F: Fn() -> Fut,
    Fut: Future<Output = (Arc<dyn EngineStore>, Arc<dyn EngineStore>)>,
{
    let (store, other) = new().await;
    let engine = StoredEngine {
        id: "e1".into(),
        session_id: "s1".into(),
        config: Arc::new(agentrt_core::AgentConfig {
            name: "a".into(),
            system_prompt: "be brief".into(),
            model: agentrt_core::ModelSelection {
                provider: "openai".into(),
                name: "m".into(),
                temperature: Some(0.5),
                max_tokens: None,
            },
            rerank_model: None,
            strategy: agentrt_core::Strategy::React,
            max_iterations: 7,
            tools: vec!["calculator".into()],
            parallel_tool_calls: true,
            max_parallel_tool_calls: 4,
            context: agentrt_core::ContextBudget {
                max_prompt_tokens: 8192,
            },
            timeouts: agentrt_core::Timeouts::default(),
        }),
        tools: Arc::new([agentrt_core::ToolSpec {
            name: "calculator".into(),
            description: "adds".into(),
            input_schema: serde_json::json!({"type": "object"}).into(),
            source: agentrt_core::ToolSource::Builtin,
        }]),
        create_time: std::time::SystemTime::UNIX_EPOCH + Duration::from_secs(1_700_000_000),
        expire_time: std::time::SystemTime::now(),
    };
    let stored = store.insert(engine.clone()).await.unwrap();
    assert!(stored.expire_time > std::time::SystemTime::now());
    let read = other
        .get("e1")
        .await
        .unwrap()
        .expect("any replica reads it");
    assert_eq!(
        StoredEngine {
            expire_time: engine.expire_time,
            ..read
        },
        engine,
        "read back as written"
    );
    assert!(other.get("nope").await.unwrap().is_none());
    assert!(other.remove("e1").await.unwrap());
    assert!(!store.remove("e1").await.unwrap());
    assert!(store.get("e1").await.unwrap().is_none());
}

/// The run store suite; `new` makes two handles on one store (two replicas).
pub async fn run_store<F, Fut>(new: F)
where
    F: Fn() -> Fut,
    Fut: Future<Output = (Arc<dyn RunStore>, Arc<dyn RunStore>)>,
{
    let (store, other) = new().await;

    // A message id names one run, whichever replica claims it, also at once.
    let claims = futures_util::future::join_all((0..6).map(|i| {
        let store = if i % 2 == 0 { &store } else { &other };
        let run_id = format!("run-{i}");
        async move { store.claim("s", "m", &run_id, None).await.unwrap() }
    }))
    .await;
    let claimed: Vec<usize> = claims
        .iter()
        .enumerate()
        .filter(|(_, c)| **c == Claim::Claimed)
        .map(|(i, _)| i)
        .collect();
    assert_eq!(claimed.len(), 1, "{claims:?}");
    let holder = format!("run-{}", claimed[0]);
    assert_eq!(
        other.claim("s", "m", "late", None).await.unwrap(),
        Claim::Taken(holder.clone())
    );
    // Replacing takes it only from the run named.
    assert_eq!(
        other.claim("s", "m", "new", Some("wrong")).await.unwrap(),
        Claim::Taken(holder.clone())
    );
    assert_eq!(
        store.claim("s", "m", "new", Some(&holder)).await.unwrap(),
        Claim::Claimed
    );
    assert_eq!(
        other.claim("s", "m", "newer", None).await.unwrap(),
        Claim::Taken("new".into())
    );
    assert_eq!(
        store.claim("s", "m2", "x", None).await.unwrap(),
        Claim::Claimed,
        "another message id is another key"
    );

    // Records round-trip, saved round by round, read from any replica.
    assert!(other.load("r").await.unwrap().is_none());
    let mut record = RunRecord::new("r", "e", "s", "m", "what is 6*7?");
    store.save(&record, 0, None).await.unwrap();
    assert_eq!(other.load("r").await.unwrap().unwrap(), record);
    record.steps.push(StepRecord {
        iteration: 1,
        thought: "let me think".into(),
        ..StepRecord::default()
    });
    store.save(&record, 0, None).await.unwrap();
    record.steps[0].answer = "4".into();
    record.steps.push(StepRecord {
        iteration: 2,
        answer: "42".into(),
        ..StepRecord::default()
    });
    record.status = RunStatus::Succeeded;
    record.stop_reason = Some(StopReason::FinalAnswer);
    record.final_answer = "42".into();
    record.last_sequence = 9;
    store.save(&record, 0, None).await.unwrap();
    assert_eq!(other.load("r").await.unwrap().unwrap(), record);
    // Rounds before `from_step` are as last saved.
    let mut changed = record.clone();
    changed.steps[0].answer = "not saved".into();
    changed.steps[1].answer = "42!".into();
    store.save(&changed, 1, None).await.unwrap();
    let read = other.load("r").await.unwrap().unwrap();
    assert_eq!(read.steps[0].answer, "4");
    assert_eq!(read.steps[1].answer, "42!");

    // A stop request made on one replica reaches the others at once.
    let mut requests = other.stop_requests().await.unwrap();
    tokio::time::sleep(Duration::from_millis(200)).await; // subscribed
    store
        .request_stop("r-stop", StopReason::Cancelled)
        .await
        .unwrap();
    let request = tokio::time::timeout(Duration::from_secs(5), requests.next())
        .await
        .expect("the request arrives")
        .unwrap();
    assert_eq!(
        (request.run_id.as_str(), request.reason),
        ("r-stop", StopReason::Cancelled)
    );
}

/// How long the leases of the stores given to [`run_leases`] last.
pub const TEST_LEASE: Duration = Duration::from_millis(300);

/// The lease suite of run stores; `new` makes two handles on one store (two replicas)
/// whose leases last [`TEST_LEASE`].
pub async fn run_leases<F, Fut>(new: F)
where
    F: Fn() -> Fut,
    Fut: Future<Output = (Arc<dyn RunStore>, Arc<dyn RunStore>)>,
{
    let (store, other) = new().await;
    let lease = |run: &str, token: &str| Lease {
        run_id: run.into(),
        token: token.into(),
    };
    let progress = |first: usize, messages: &[&str]| Progress {
        spec: (first == 0).then(|| "{\"spec\":1}".to_owned()),
        state: format!("state-{first}"),
        messages: messages.iter().map(|m| (*m).to_owned()).collect(),
        first_message: first,
    };

    // The first save of an owned run takes its lease; another owner cannot write it.
    let mut record = RunRecord::new("lr", "e", "s", "m", "q");
    record.owner = "a.1".into();
    store
        .save(&record, 0, Some(&progress(0, &["m0"])))
        .await
        .unwrap();
    let mut intruder = record.clone();
    intruder.owner = "b.1".into();
    assert_eq!(
        other.save(&intruder, 0, None).await,
        Err(StateError::Fenced("lr".into()))
    );
    record.steps.push(StepRecord {
        iteration: 1,
        ..StepRecord::default()
    });
    store
        .save(&record, 0, Some(&progress(1, &["m1", "m2"])))
        .await
        .unwrap();
    assert_eq!(
        store.renew(&[lease("lr", "a.1")]).await.unwrap(),
        Vec::<String>::new()
    );
    assert_eq!(
        store
            .renew(&[lease("lr", "b.1"), lease("unknown", "a.1")])
            .await
            .unwrap(),
        vec!["lr".to_owned(), "unknown".to_owned()],
        "a lease another holds, or none holds, is lost"
    );
    assert!(other.lapsed(10).await.unwrap().is_empty());
    assert_eq!(
        other.take_over("lr", "b.1").await.unwrap(),
        None,
        "the lease holds"
    );

    // Unrenewed, it lapses; exactly one of several replicas takes the run over.
    tokio::time::sleep(TEST_LEASE + Duration::from_millis(100)).await;
    assert_eq!(other.lapsed(10).await.unwrap(), vec!["lr".to_owned()]);
    let tries = futures_util::future::join_all((0..6).map(|i| {
        let store = if i % 2 == 0 { &store } else { &other };
        async move { store.take_over("lr", &format!("t.{i}")).await.unwrap() }
    }))
    .await;
    let taken: Vec<&Resumable> = tries.iter().flatten().collect();
    assert_eq!(taken.len(), 1, "{tries:?}");
    let taken = taken[0];
    let winner = taken.record.owner.clone();
    assert!(winner.starts_with("t."));
    assert_eq!(taken.previous_owner, "a.1");
    assert!(!taken.handed_over);
    assert_eq!(taken.spec, "{\"spec\":1}");
    assert_eq!(taken.state, "state-1");
    assert_eq!(taken.messages, ["m0", "m1", "m2"]);
    assert_eq!(taken.record.steps.len(), 1);
    assert!(other.lapsed(10).await.unwrap().is_empty());

    // The old owner is fenced off; the new one writes, renews, and can let the run go.
    assert_eq!(
        store.save(&record, 0, None).await,
        Err(StateError::Fenced("lr".into()))
    );
    assert_eq!(
        store.renew(&[lease("lr", "a.1")]).await.unwrap(),
        vec!["lr".to_owned()]
    );
    let mut record = taken.record.clone();
    other.save(&record, 0, None).await.unwrap();
    assert!(
        other
            .renew(&[lease("lr", &winner)])
            .await
            .unwrap()
            .is_empty()
    );
    other.release(&[lease("lr", "a.1")]).await.unwrap();
    assert!(
        store.lapsed(10).await.unwrap().is_empty(),
        "only the owner lets go"
    );
    other.release(&[lease("lr", &winner)]).await.unwrap();
    assert_eq!(store.lapsed(10).await.unwrap(), vec!["lr".to_owned()]);
    let handed = store.take_over("lr", "c.1").await.unwrap().unwrap();
    assert!(handed.handed_over);
    assert_eq!(handed.previous_owner, winner);

    // An ended run has no lease: nobody takes it over, and nobody writes it again.
    record.owner = "c.1".into();
    record.status = RunStatus::Succeeded;
    record.stop_reason = Some(StopReason::FinalAnswer);
    store.save(&record, 0, None).await.unwrap();
    tokio::time::sleep(TEST_LEASE + Duration::from_millis(100)).await;
    assert!(other.lapsed(10).await.unwrap().is_empty());
    assert_eq!(other.take_over("lr", "d.1").await.unwrap(), None);
    assert_eq!(
        other.renew(&[lease("lr", "c.1")]).await.unwrap(),
        vec!["lr".to_owned()]
    );
    record.owner = winner;
    assert_eq!(
        other.save(&record, 0, None).await,
        Err(StateError::Fenced("lr".into()))
    );
    assert_eq!(other.load("lr").await.unwrap().unwrap().owner, "c.1");

    // A run without an owner has no lease (a store used by one process).
    let free = RunRecord::new("free", "e", "s", "m2", "q");
    store.save(&free, 0, None).await.unwrap();
    tokio::time::sleep(TEST_LEASE + Duration::from_millis(100)).await;
    assert!(other.lapsed(10).await.unwrap().is_empty());
}

/// The Redis the tests use: `AGENTRT_TEST_REDIS`, or the local default. `scripts/test`
/// starts one when none answers.
pub fn redis_url() -> String {
    std::env::var("AGENTRT_TEST_REDIS").unwrap_or_else(|_| "redis://127.0.0.1:6379/0".into())
}

/// A key prefix no other test uses.
pub fn redis_prefix(test: &str) -> String {
    format!(
        "agentrt-test-{test}-{}-{}",
        std::process::id(),
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .unwrap_or_default()
            .as_nanos()
    )
}
