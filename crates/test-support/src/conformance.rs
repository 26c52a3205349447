//! The conformance suites of the state stores: every backend (in memory, Redis) runs the
//! same tests, so that nothing a client observes depends on where the state lives. A new
//! backend is done when it passes them.
//!
//! Each suite takes a factory that makes a fresh, empty store (a store per test: for a
//! shared backend, under a key prefix of its own); the run-store and bus suites take two
//! handles on one store where it matters that two replicas share it.

use std::{future::Future, sync::Arc, time::Duration};

use agentrt_state::{
    Action, Answered, Answers, BusError, BusLimits, Claim, EngineStore, EventBus, Exchange, Lease,
    PendingCall, Progress, Resumable, RunRecord, RunStatus, RunStore, SessionStore, StateError,
    StepRecord, StopReason, StoredEngine,
};
use futures_util::StreamExt;

use agentrt_events::{EventKind, JsonText, RunEvent};

fn delta(text: &str) -> RunEvent {
    RunEvent::new(EventKind::FinalAnswer, 1, text.into(), None)
}

fn started() -> RunEvent {
    RunEvent::new(
        EventKind::RunStarted,
        1,
        String::new(),
        Some(agentrt_events::EventData::RunStarted {
            engine_id: "e".into(),
            agent: "a".into(),
        }),
    )
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

    // A run taken over whose log holds its `done` has ended: its publisher, dropped
    // unused, adds no second `done`, whichever replica resumed it.
    let publisher = bus.open("ended", "").await.unwrap();
    publisher.publish(vec![started(), done()]).await.unwrap();
    drop(publisher);
    for after in [1, 2] {
        let resumed = other.resume("ended", "", after).await.unwrap();
        drop(resumed);
        tokio::time::sleep(Duration::from_millis(200)).await;
        assert_eq!(sequences(&*other, "ended", 0).await, [Ok(1), Ok(2)]);
        // (A reader ends at the first `done`: a second one is found past it.)
        assert_eq!(
            sequences(&*other, "ended", 2).await,
            [],
            "resumed after {after}"
        );
    }

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
        publisher.publish(vec![started()]).await.unwrap();
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

    // Events published soon reach every replica's readers, in order, with nothing
    // published after them.
    let publisher = bus.open("soon", "").await.unwrap();
    publisher.publish(vec![started()]).await.unwrap();
    publisher
        .publish_soon(vec![started(), delta("a")])
        .await
        .unwrap();
    let mut reader = other.subscribe("soon", 0).await.unwrap();
    let mut read = Vec::new();
    while read.len() < 3 {
        let event = tokio::time::timeout(Duration::from_secs(2), reader.next())
            .await
            .expect("events published soon are read within moments");
        read.push(event.unwrap().unwrap().sequence);
    }
    assert_eq!(read, [1, 2, 3]);
    publisher.publish(vec![done()]).await.unwrap();

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

    // A publish its caller gave up on part way (a run stopped or timed out while it
    // wrote) loses nothing and numbers nothing twice: the log reads the same here and
    // elsewhere.
    let (bus, other) = new(BusLimits::default()).await;
    let publisher = bus.open("dropped", "").await.unwrap();
    publisher.publish(vec![started()]).await.unwrap();
    {
        let mut write = std::pin::pin!(publisher.publish(vec![started()]));
        // Polled once, so that it is under way, then dropped.
        let _ = futures_util::FutureExt::now_or_never(write.as_mut());
    }
    publisher.publish(vec![done()]).await.unwrap();
    assert_eq!(
        sequences(&*bus, "dropped", 0).await,
        [Ok(1), Ok(2), Ok(3)],
        "the log where the run was published"
    );
    assert_eq!(
        sequences(&*other, "dropped", 0).await,
        [Ok(1), Ok(2), Ok(3)],
        "the log elsewhere"
    );
}

/// The session store suite; `new` makes a store keeping 3 exchanges per session and 2500
/// bytes of them, and `pair` two handles on one.
pub async fn session_store<F, Fut>(new: F)
where
    F: Fn() -> Fut,
    Fut: Future<Output = (Arc<dyn SessionStore>, Arc<dyn SessionStore>)>,
{
    let (store, other) = new().await;
    let exchange = |n: u32| Exchange {
        messages: vec![agentrt_models_message(n)],
        tokens: n,
        kept_ms: 0,
    };
    assert!(store.history("s").await.unwrap().is_empty(), "unknown");
    store.append("s", exchange(1).into()).await.unwrap();
    other.append("s", exchange(2).into()).await.unwrap();
    let history = other.history("s").await.unwrap();
    assert_eq!(
        history.iter().map(|e| e.tokens).collect::<Vec<_>>(),
        [1, 2],
        "in the order appended, whichever replica appended"
    );
    assert_eq!(*history[0], exchange(1), "kept as appended");
    for n in 3..=5 {
        store.append("s", exchange(n).into()).await.unwrap();
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
            a.append("busy", exchange(100 + n).into()).await.unwrap();
        }
    });
    let right = tokio::spawn(async move {
        for n in 0..20 {
            b.append("busy", exchange(200 + n).into()).await.unwrap();
        }
    });
    left.await.unwrap();
    right.await.unwrap();
    let history = store.history("busy").await.unwrap();
    assert_eq!(history.len(), 3);
    assert!(history.iter().all(|e| e.messages.len() == 1));

    // Beyond the bytes a session keeps (about two exchanges of a thousand bytes here), its
    // oldest exchanges go; its newest stays, however large, whichever replica kept it.
    let large = |n: u32, bytes: usize| Exchange {
        messages: vec![agentrt_models::ChatMessage::User("x".repeat(bytes))],
        tokens: n,
        kept_ms: 0,
    };
    let tokens =
        |history: Vec<Arc<Exchange>>| -> Vec<u32> { history.iter().map(|e| e.tokens).collect() };
    for n in 1..=3 {
        store.append("long", large(n, 1000).into()).await.unwrap();
    }
    assert_eq!(tokens(other.history("long").await.unwrap()), [2, 3]);
    other.append("long", large(4, 10_000).into()).await.unwrap();
    assert_eq!(tokens(store.history("long").await.unwrap()), [4]);
    store.append("long", large(5, 100).into()).await.unwrap();
    assert_eq!(tokens(other.history("long").await.unwrap()), [5]);
}

/// Session lifetimes, for stores whose sessions live 1 s from their last use: reading a
/// session uses it, `keep` holds it through a run's wait, and an append never shortens
/// what `keep` asked for.
pub async fn session_lifetimes<F, Fut>(new: F)
where
    F: Fn() -> Fut,
    Fut: Future<Output = (Arc<dyn SessionStore>, Arc<dyn SessionStore>)>,
{
    let (store, other) = new().await;
    let exchange = |n: u32| {
        Arc::new(Exchange {
            messages: vec![agentrt_models_message(n)],
            tokens: n,
            kept_ms: 0,
        })
    };
    let sleep = |ms: u64| tokio::time::sleep(Duration::from_millis(ms));
    store.append("read", exchange(1)).await.unwrap();
    sleep(600).await;
    assert_eq!(other.history("read").await.unwrap().len(), 1);
    sleep(600).await;
    assert_eq!(
        store.history("read").await.unwrap().len(),
        1,
        "a session read (a run of it started) lives its time to live from then"
    );
    sleep(1300).await;
    assert!(
        store.history("read").await.unwrap().is_empty(),
        "then it goes"
    );

    store.append("waits", exchange(1)).await.unwrap();
    other.keep("waits", Duration::from_secs(2)).await.unwrap();
    sleep(1500).await;
    // Another turn of it meanwhile does not cut the wait short.
    other.append("waits", exchange(2)).await.unwrap();
    sleep(1200).await;
    assert_eq!(
        store.history("waits").await.unwrap().len(),
        2,
        "kept through the wait and its time to live after"
    );
    store.keep("unknown", Duration::from_secs(1)).await.unwrap();
    assert!(store.history("unknown").await.unwrap().is_empty());
}

fn agentrt_models_message(n: u32) -> agentrt_models::ChatMessage {
    agentrt_models::ChatMessage::User(format!("turn {n}"))
}

/// The config of the engines the suites store.
pub fn sample_config() -> agentrt_core::AgentConfig {
    agentrt_core::AgentConfig {
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
        approval: Vec::new(),
        client_tools: Vec::new(),
        parallel_tool_calls: true,
        max_parallel_tool_calls: 4,
        context: agentrt_core::ContextBudget {
            max_prompt_tokens: 8192,
        },
        timeouts: agentrt_core::Timeouts::default(),
    }
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
        config: Arc::new(sample_config()),
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
        .get("e1", None)
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
    assert!(other.get("nope", None).await.unwrap().is_none());
    // A replica that read an engine reads it as it is now: replaced on another replica
    // by one of the same id that runs something else, it is the new one.
    let mut replaced = engine.clone();
    Arc::make_mut(&mut replaced.config).system_prompt = "something else".into();
    assert!(store.remove("e1").await.unwrap());
    store.insert(replaced.clone()).await.unwrap();
    let read = other.get("e1", None).await.unwrap().expect("replaced");
    assert_eq!(read.config, replaced.config, "read as replaced");
    assert_eq!(
        other
            .get("e1", None)
            .await
            .unwrap()
            .expect("read again")
            .config,
        replaced.config
    );
    assert!(other.remove("e1").await.unwrap());
    assert!(!store.remove("e1").await.unwrap());
    assert!(store.get("e1", None).await.unwrap().is_none());
}

/// An engine is found for its own principal (or for any, when no owner is given: an
/// operator) and for no other, and another principal's lookup does not extend its life.
/// `new` makes two handles on one store (two replicas) whose engines live `ttl`.
pub async fn engine_owners<F, Fut>(new: F)
where
    F: Fn(Duration) -> Fut,
    Fut: Future<Output = (Arc<dyn EngineStore>, Arc<dyn EngineStore>)>,
{
    const TTL: Duration = Duration::from_secs(1);
    let (store, other) = new(TTL).await;
    let engine = |id: &str| StoredEngine {
        id: id.into(),
        session_id: "alice/s".into(),
        config: Arc::new(sample_config()),
        tools: Arc::new([]),
        create_time: std::time::SystemTime::now(),
        expire_time: std::time::SystemTime::now(),
    };
    store.insert(engine("o1")).await.unwrap();
    assert!(other.get("o1", Some("alice")).await.unwrap().is_some());
    assert!(other.get("o1", None).await.unwrap().is_some(), "any owner");
    assert!(other.get("o1", Some("bob")).await.unwrap().is_none());
    assert!(other.get("o1", Some("")).await.unwrap().is_none());
    assert!(other.get("o1", Some("alice")).await.unwrap().is_some());

    store.insert(engine("o2")).await.unwrap();
    tokio::time::sleep(TTL * 6 / 10).await;
    assert!(other.get("o2", Some("bob")).await.unwrap().is_none());
    tokio::time::sleep(TTL * 6 / 10).await;
    assert!(
        other.get("o2", Some("alice")).await.unwrap().is_none(),
        "expired: another principal's lookup did not keep it"
    );
}

/// The engine store's bounds; `new` makes two handles on one store (two replicas) that
/// keeps at most 3 engines, and at most 2 of one named principal.
pub async fn engine_budgets<F, Fut>(new: F)
where
    F: Fn() -> Fut,
    Fut: Future<Output = (Arc<dyn EngineStore>, Arc<dyn EngineStore>)>,
{
    let (store, other) = new().await;
    let engine = |id: &str, session: &str| StoredEngine {
        id: id.into(),
        session_id: session.into(),
        config: Arc::new(sample_config()),
        tools: Arc::new([]),
        create_time: std::time::SystemTime::now(),
        expire_time: std::time::SystemTime::now(),
    };
    // Apart in time, so that the order of last use is clear.
    let tick = || tokio::time::sleep(Duration::from_millis(5));
    store.insert(engine("e1", "alice/s")).await.unwrap();
    tick().await;
    other.insert(engine("e2", "alice/t")).await.unwrap();
    tick().await;
    let refused = other.insert(engine("e3", "alice/s")).await.unwrap_err();
    assert!(
        matches!(&refused, StateError::OverBudget { budget, .. } if *budget == "engines.max_per_principal"),
        "{refused:?}"
    );
    assert!(store.get("e3", None).await.unwrap().is_none());
    // The anonymous principal is bound by the store's count alone.
    store.insert(engine("a1", "s")).await.unwrap();
    tick().await;
    assert!(other.get("e1", None).await.unwrap().is_some());
    tick().await;
    // Full: a new engine drops the least recently used one (e2), and gives its principal
    // room again.
    other.insert(engine("b1", "bob/s")).await.unwrap();
    tick().await;
    assert!(
        store.get("e2", None).await.unwrap().is_none(),
        "e2 was dropped"
    );
    for kept in ["a1", "b1", "e1"] {
        assert!(
            store.get(kept, None).await.unwrap().is_some(),
            "{kept} is kept"
        );
        tick().await;
    }
    // a1 is now the least recently used; but alice, with one engine, does not drop the
    // anonymous principal's one to hold two: its own least recently used (e1) goes.
    store.insert(engine("e3", "alice/s")).await.unwrap();
    tick().await;
    assert!(
        other.get("e1", None).await.unwrap().is_none(),
        "e1 was dropped"
    );
    assert!(other.get("a1", None).await.unwrap().is_some(), "a1 is kept");
    tick().await;
    // A removed engine gives its principal room again too.
    assert!(other.remove("e3").await.unwrap());
    assert!(other.remove("b1").await.unwrap());
    store.insert(engine("e4", "alice/u")).await.unwrap();
    tick().await;
    store.insert(engine("e5", "alice/u")).await.unwrap();
    tick().await;
    let refused = store.insert(engine("e6", "alice/u")).await.unwrap_err();
    assert!(
        matches!(refused, StateError::OverBudget { .. }),
        "{refused:?}"
    );
    // Full (a1, e4, e5): bob, with none, drops the least recently used (a1, whose
    // principal has one); then alice's (e4: she has two, bob one).
    other.insert(engine("b2", "bob/s")).await.unwrap();
    tick().await;
    assert!(
        store.get("a1", None).await.unwrap().is_none(),
        "a1 was dropped"
    );
    other.insert(engine("b3", "bob/s")).await.unwrap();
    tick().await;
    assert!(
        store.get("e4", None).await.unwrap().is_none(),
        "e4 was dropped"
    );
    for kept in ["e5", "b2", "b3"] {
        assert!(
            store.get(kept, None).await.unwrap().is_some(),
            "{kept} is kept"
        );
    }
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
    // Read without claiming, from any replica.
    assert_eq!(other.holder("s", "m").await.unwrap(), Some(holder.clone()));
    assert_eq!(store.holder("s", "unclaimed").await.unwrap(), None);
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
    // A run whose claim was taken over (its opening write slow, a retry elsewhere gave
    // up on it) is not written: the message id makes one run, the one that holds it.
    let mut replaced = RunRecord::new("late", "e", "s", "m", "q");
    replaced.owner = "a.9".into();
    assert_eq!(
        store.save(&replaced, 0, None).await,
        Err(StateError::Fenced("late".into()))
    );
    assert!(other.load("late").await.unwrap().is_none());
    let mut holding = RunRecord::new("new", "e", "s", "m", "q");
    holding.owner = "b.9".into();
    other.save(&holding, 0, None).await.unwrap();
    assert_eq!(store.load("new").await.unwrap().unwrap(), holding);

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
    // Each replica renews its leases with a renewer of its own.
    let renewers = (
        store.clone().lease_renewer().unwrap(),
        other.clone().lease_renewer().unwrap(),
    );
    let lease = |run: &str, token: &str| Lease {
        run_id: run.into(),
        token: token.into(),
    };
    let progress = |first: usize, messages: &[&str]| Progress {
        spec: (first == 0).then(|| "{\"spec\":1}".to_owned()),
        agent: (first == 0).then(|| "{\"agent\":\"e\"}".to_owned()),
        state: format!("state-{first}"),
        messages: messages.iter().map(|m| (*m).to_owned()).collect(),
        first_message: first,
        wait: None,
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
        renewers.0.renew(&[lease("lr", "a.1")]).await.unwrap(),
        Vec::<String>::new()
    );
    assert_eq!(
        renewers
            .0
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
    assert_eq!(taken.agent, "{\"agent\":\"e\"}");
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
        renewers.0.renew(&[lease("lr", "a.1")]).await.unwrap(),
        vec!["lr".to_owned()]
    );
    let mut record = taken.record.clone();
    other.save(&record, 0, None).await.unwrap();
    assert!(
        renewers
            .1
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
    // Let go, it stays let go: its renewal (the run still stopping there) is refused.
    assert_eq!(
        renewers.1.renew(&[lease("lr", &winner)]).await.unwrap(),
        vec!["lr".to_owned()],
        "a lease let go is not renewed"
    );
    assert_eq!(store.lapsed(10).await.unwrap(), vec!["lr".to_owned()]);
    let handed = store.take_over("lr", "c.1").await.unwrap().unwrap();
    assert!(handed.handed_over);
    assert_eq!(handed.previous_owner, winner);
    assert_eq!(handed.stop, None);
    // A run taken over that cannot go on there yet is let go a while later, by its owner
    // only.
    other
        .defer(&lease("lr", "x.1"), Duration::ZERO)
        .await
        .unwrap();
    assert!(!is_lapsed(&*store, "lr").await, "only the owner defers");
    other
        .defer(&lease("lr", "c.1"), Duration::from_millis(150))
        .await
        .unwrap();
    assert!(!is_lapsed(&*store, "lr").await);
    tokio::time::sleep(Duration::from_millis(250)).await;
    assert!(is_lapsed(&*store, "lr").await, "lapsed once deferred");

    // A stop requested of a run whose owner is gone is kept for the replica that takes it
    // over.
    other
        .request_stop("lr", StopReason::Cancelled)
        .await
        .unwrap();
    tokio::time::sleep(TEST_LEASE + Duration::from_millis(100)).await;
    let stopped = other.take_over("lr", "c.2").await.unwrap().unwrap();
    assert_eq!(stopped.stop, Some(StopReason::Cancelled));

    // An ended run has no lease: nobody takes it over, and nobody writes it again.
    record.owner = "c.2".into();
    record.status = RunStatus::Succeeded;
    record.stop_reason = Some(StopReason::FinalAnswer);
    store.save(&record, 0, None).await.unwrap();
    tokio::time::sleep(TEST_LEASE + Duration::from_millis(100)).await;
    assert!(other.lapsed(10).await.unwrap().is_empty());
    assert_eq!(other.take_over("lr", "d.1").await.unwrap(), None);
    assert_eq!(
        renewers.1.renew(&[lease("lr", "c.2")]).await.unwrap(),
        vec!["lr".to_owned()]
    );
    record.owner = winner;
    assert_eq!(
        other.save(&record, 0, None).await,
        Err(StateError::Fenced("lr".into()))
    );
    assert_eq!(other.load("lr").await.unwrap().unwrap().owner, "c.2");

    // Runs of one agent share one copy of it, kept while one of them may go on, whatever
    // their engines: a run taken over after another of its agent ended reads it still;
    // another agent's runs read theirs.
    let started = |agent: &str| Progress {
        spec: Some("{\"spec\":2}".to_owned()),
        agent: Some(format!("{{\"agent\":\"{agent}\"}}")),
        state: "state".into(),
        messages: Vec::new(),
        first_message: 0,
        wait: None,
    };
    let mut runs = Vec::new();
    for (run, engine, agent) in [
        ("sa", "e1", "shared"),
        ("sb", "e2", "shared"),
        ("sc", "e3", "apart"),
    ] {
        let mut record = RunRecord::new(run, engine, "s", &format!("m-{run}"), "q");
        record.owner = format!("{run}.a");
        store.save(&record, 0, Some(&started(agent))).await.unwrap();
        runs.push(record);
    }
    runs[0].status = RunStatus::Succeeded;
    runs[0].stop_reason = Some(StopReason::FinalAnswer);
    store.save(&runs[0], 0, None).await.unwrap();
    tokio::time::sleep(TEST_LEASE + Duration::from_millis(100)).await;
    let sb = other.take_over("sb", "sb.b").await.unwrap().unwrap();
    assert_eq!(sb.agent, "{\"agent\":\"shared\"}");
    assert_eq!(sb.spec, "{\"spec\":2}");
    let sc = other.take_over("sc", "sc.b").await.unwrap().unwrap();
    assert_eq!(sc.agent, "{\"agent\":\"apart\"}");
    for mut record in [sb.record, sc.record] {
        record.status = RunStatus::Succeeded;
        record.stop_reason = Some(StopReason::FinalAnswer);
        other.save(&record, 0, None).await.unwrap();
    }

    // A run without an owner has no lease (a store used by one process).
    let free = RunRecord::new("free", "e", "s", "m2", "q");
    store.save(&free, 0, None).await.unwrap();
    tokio::time::sleep(TEST_LEASE + Duration::from_millis(100)).await;
    assert!(other.lapsed(10).await.unwrap().is_empty());
}

/// A pending call of the waits suite: tool `tool`, arguments `{"n": 1}`, not answered.
fn pending_call(id: &str, action: Action) -> PendingCall {
    PendingCall {
        id: id.into(),
        name: "tool".into(),
        arguments: JsonText::new(&serde_json::json!({"n": 1})),
        action,
        answered: false,
    }
}

/// `(call id, answer)` pairs, as [`RunStore::answer`] takes them.
fn answers(pairs: &[(&str, &str)]) -> Vec<(String, String)> {
    pairs
        .iter()
        .map(|(id, answer)| ((*id).to_owned(), (*answer).to_owned()))
        .collect()
}

fn accepted(left: &[&str], completed: bool) -> Answered {
    Answered::Accepted {
        left: left.iter().map(|id| (*id).to_owned()).collect(),
        completed,
    }
}

fn told(pairs: &[(&str, &str)], cancelled: bool) -> Option<Answers> {
    Some(Answers {
        answers: pairs
            .iter()
            .map(|(id, answer)| ((*id).to_owned(), (*answer).to_owned()))
            .collect(),
        cancelled,
    })
}

/// Whether `lapsed` lists `run_id` (other runs of the suite may lapse meanwhile).
async fn is_lapsed(store: &dyn RunStore, run_id: &str) -> bool {
    store
        .lapsed(1000)
        .await
        .unwrap()
        .iter()
        .any(|lapsed| lapsed == run_id)
}

/// Starts run `run_id` owned by `{run_id}.a` (it takes the lease), then makes it wait
/// for `calls` for at most `wait`, as the engine does at a round that needs its client.
async fn start_waiting(
    store: &dyn RunStore,
    run_id: &str,
    calls: Vec<PendingCall>,
    wait: Duration,
) -> RunRecord {
    start_waiting_in(store, run_id, "s", calls, wait)
        .await
        .unwrap()
}

/// [`start_waiting`] in session `session` (`PRINCIPAL/SESSION` for a named principal's);
/// the waiting save's error when the store refuses it.
async fn start_waiting_in(
    store: &dyn RunStore,
    run_id: &str,
    session: &str,
    calls: Vec<PendingCall>,
    wait: Duration,
) -> Result<RunRecord, StateError> {
    let mut record = RunRecord::new(run_id, "e", session, &format!("m-{run_id}"), "q");
    record.owner = format!("{run_id}.a");
    let started = Progress {
        spec: Some("{\"spec\":1}".into()),
        agent: Some("{\"agent\":1}".into()),
        state: "running".into(),
        messages: vec!["m0".into()],
        first_message: 0,
        wait: None,
    };
    store.save(&record, 0, Some(&started)).await.unwrap();
    record.steps.push(StepRecord {
        iteration: 1,
        thought: "the client has to help".into(),
        ..StepRecord::default()
    });
    record.status = RunStatus::RequiresAction;
    record.pending = calls;
    let waiting = Progress {
        spec: None,
        agent: None,
        state: "waiting".into(),
        messages: vec!["m1".into()],
        first_message: 1,
        wait: Some(wait),
    };
    store.save(&record, 0, Some(&waiting)).await?;
    Ok(record)
}

/// Among the runs whose lease lapsed, the waits over without their answers (out of time,
/// or cancelled), which end calling no model: not a wait answered in full (its run goes
/// on), nor one still open. `new` makes two handles on one store (two replicas).
pub async fn lapsed_waits<F, Fut>(new: F)
where
    F: Fn() -> Fut,
    Fut: Future<Output = (Arc<dyn RunStore>, Arc<dyn RunStore>)>,
{
    const LONG: Duration = Duration::from_secs(60);
    let (store, other) = new().await;
    let calls = || vec![pending_call("c1", Action::ClientExecute)];
    start_waiting(&*store, "lw-out", calls(), Duration::from_millis(200)).await;
    start_waiting(&*store, "lw-answered", calls(), LONG).await;
    start_waiting(&*store, "lw-cancelled", calls(), LONG).await;
    start_waiting(&*store, "lw-open", calls(), LONG).await;
    assert_eq!(
        other
            .answer("lw-answered", &answers(&[("c1", "\"x\"")]))
            .await
            .unwrap(),
        accepted(&[], true)
    );
    assert!(other.cancel_waiting("lw-cancelled").await.unwrap());
    tokio::time::sleep(Duration::from_millis(400)).await;
    assert!(is_lapsed(&*other, "lw-answered").await, "it goes on");
    let mut over = other.lapsed_waits(10).await.unwrap();
    over.sort();
    assert_eq!(over, ["lw-cancelled", "lw-out"]);
    assert_eq!(
        other.lapsed_waits(1).await.unwrap().len(),
        1,
        "at most the limit"
    );
}

/// The budget of a principal's waiting runs; `new` makes two handles on one store (two
/// replicas) that let a named principal have at most one run waiting at once.
pub async fn waiting_budget<F, Fut>(new: F)
where
    F: Fn() -> Fut,
    Fut: Future<Output = (Arc<dyn RunStore>, Arc<dyn RunStore>)>,
{
    const LONG: Duration = Duration::from_secs(60);
    let (store, other) = new().await;
    let calls = || vec![pending_call("c1", Action::ClientExecute)];
    start_waiting_in(&*store, "wb1", "alice/s", calls(), LONG)
        .await
        .unwrap();
    // A second run of alice's, on either replica, cannot begin to wait.
    let refused = start_waiting_in(&*other, "wb2", "alice/t", calls(), LONG)
        .await
        .unwrap_err();
    assert!(
        matches!(&refused, StateError::OverBudget { budget, .. } if budget == &"runs.max_waiting_per_principal"),
        "{refused:?}"
    );
    assert!(
        !other.load("wb2").await.unwrap().unwrap().waiting(),
        "nothing of the refused wait is saved"
    );
    // Other principals, and the anonymous one, are not bound by alice's waits.
    for (run, session) in [("wb3", "bob/s"), ("wb4", "s"), ("wb5", "s")] {
        start_waiting_in(&*other, run, session, calls(), LONG)
            .await
            .unwrap();
    }
    // A cancelled wait leaves the count at once, before any replica takes the run over;
    // so does a wait that has all its answers.
    assert!(store.cancel_waiting("wb1").await.unwrap());
    start_waiting_in(&*other, "wb6", "alice/u", calls(), LONG)
        .await
        .unwrap();
    assert!(
        start_waiting_in(&*store, "wb7", "alice/v", calls(), LONG)
            .await
            .is_err()
    );
    other
        .answer("wb6", &answers(&[("c1", "\"out\"")]))
        .await
        .unwrap();
    start_waiting_in(&*store, "wb8", "alice/w", calls(), LONG)
        .await
        .unwrap();
    // A run that ended after its wait counts no more either.
    assert!(store.cancel_waiting("wb8").await.unwrap());
    let mut ended = take_over_once(&store, &other, "wb8").await.record;
    ended.status = RunStatus::Cancelled;
    ended.stop_reason = Some(StopReason::Cancelled);
    ended.pending.clear();
    store.save(&ended, 0, None).await.unwrap();
    start_waiting_in(&*other, "wb9", "alice/x", calls(), LONG)
        .await
        .unwrap();
}

/// A wait the store refuses (past the principal's budget of waiting runs) is no wait: the
/// round's other events are published, its ACTION_REQUIRED is not (the client would act
/// for a run that cannot be answered), and the log stays gapless to the run's end. `new`
/// makes a store that lets a named principal have at most one run waiting, and the bus
/// its runs publish on.
pub async fn refused_wait<F, Fut>(new: F)
where
    F: Fn() -> Fut,
    Fut: Future<Output = (Arc<dyn RunStore>, Arc<dyn EventBus>)>,
{
    const LONG: Duration = Duration::from_secs(60);
    let (store, bus) = new().await;
    let calls = || vec![pending_call("c1", Action::ClientExecute)];
    start_waiting_in(&*store, "rw1", "alice/s", calls(), LONG)
        .await
        .unwrap();
    let mut record = RunRecord::new("rw2", "e", "alice/t", "m-rw2", "q");
    record.owner = "rw2.a".into();
    let running = Progress {
        spec: Some("{\"spec\":1}".into()),
        agent: Some("{\"agent\":1}".into()),
        state: "running".into(),
        messages: vec!["m0".into()],
        first_message: 0,
        wait: None,
    };
    store.save(&record, 0, Some(&running)).await.unwrap();
    let publisher = bus.open("rw2", "rw2.a").await.unwrap();
    store
        .checkpoint(&*publisher, vec![started()], &record, 0, None)
        .await
        .unwrap();
    record.status = RunStatus::RequiresAction;
    record.pending = calls();
    let waiting = Progress {
        wait: Some(LONG),
        state: "waiting".into(),
        messages: vec![],
        first_message: 1,
        ..running.clone()
    };
    let call = RunEvent::new(EventKind::ToolCall, 1, String::new(), None);
    let action = RunEvent::new(EventKind::ActionRequired, 1, String::new(), None);
    let refused = store
        .checkpoint(&*publisher, vec![call, action], &record, 0, Some(&waiting))
        .await
        .unwrap_err();
    assert!(
        matches!(
            &refused,
            agentrt_state::CheckpointError::Record(StateError::OverBudget { .. })
        ),
        "{refused:?}"
    );
    // The run ends with the failure.
    record.status = RunStatus::Failed;
    record.stop_reason = Some(StopReason::BudgetExceeded);
    record.pending.clear();
    let end = RunEvent {
        done: true,
        ..RunEvent::new(EventKind::Error, 1, "over budget".into(), None)
    };
    store
        .checkpoint(&*publisher, vec![end], &record, 0, None)
        .await
        .unwrap();
    let stream = bus.subscribe("rw2", 0).await.unwrap();
    let events: Vec<(u64, EventKind)> = tokio::time::timeout(
        Duration::from_secs(10),
        stream
            .map(|e| {
                let e = e.unwrap();
                (e.sequence, e.kind)
            })
            .collect::<Vec<_>>(),
    )
    .await
    .expect("the stream ends");
    assert_eq!(
        events,
        [
            (1, EventKind::RunStarted),
            (2, EventKind::ToolCall),
            (3, EventKind::Error),
        ]
    );
}

/// Takes `run_id` over from both replicas at once (six tries): exactly one gets it.
async fn take_over_once(
    store: &Arc<dyn RunStore>,
    other: &Arc<dyn RunStore>,
    run_id: &str,
) -> Resumable {
    let tries = futures_util::future::join_all((0..6).map(|i| {
        let store = if i % 2 == 0 { store } else { other };
        async move {
            store
                .take_over(run_id, &format!("{run_id}.t{i}"))
                .await
                .unwrap()
        }
    }))
    .await;
    let mut taken: Vec<Resumable> = tries.into_iter().flatten().collect();
    assert_eq!(taken.len(), 1, "exactly one replica takes {run_id} over");
    taken.remove(0)
}

/// The suite of runs that wait (for tool outputs or approvals from their client, holding
/// no task on any replica); `new` makes two handles on one store (two replicas) whose
/// leases last [`TEST_LEASE`]. A waiting save lets the run's lease go until every pending
/// call is answered (exactly one of several replicas answering at once completes it), it
/// is cancelled, or its wait elapses; then the lease lapses, and the replica taking the
/// run over is told what the run was told while it waited (and so is the next one, until
/// the run saves progress past the wait). Answers are checked
/// whole, the first answer of a call wins, and late answers are refused unless they
/// repeat ones the run received.
pub async fn run_waits<F, Fut>(new: F)
where
    F: Fn() -> Fut,
    Fut: Future<Output = (Arc<dyn RunStore>, Arc<dyn RunStore>)>,
{
    const LONG: Duration = Duration::from_secs(60);
    let (store, other) = new().await;
    // Each replica renews its leases with a renewer of its own.
    let renewers = (
        store.clone().lease_renewer().unwrap(),
        other.clone().lease_renewer().unwrap(),
    );
    let lease = |run: &str, token: &str| Lease {
        run_id: run.into(),
        token: token.into(),
    };
    let running = |state: &str, first: usize, messages: &[&str]| Progress {
        spec: None,
        agent: None,
        state: state.into(),
        messages: messages.iter().map(|m| (*m).to_owned()).collect(),
        first_message: first,
        wait: None,
    };

    // A run that never waited, or no run at all, takes no answers and no cancellation.
    let mut plain = RunRecord::new("plain", "e", "s", "m-plain", "q");
    plain.owner = "plain.a".into();
    store
        .save(&plain, 0, Some(&running("running", 0, &["m0"])))
        .await
        .unwrap();
    assert_eq!(
        other
            .answer("plain", &answers(&[("c1", "{}")]))
            .await
            .unwrap(),
        Answered::NotWaiting
    );
    assert!(!other.cancel_waiting("plain").await.unwrap());
    assert_eq!(
        store
            .answer("nope", &answers(&[("c1", "{}")]))
            .await
            .unwrap(),
        Answered::NotWaiting
    );
    assert!(!store.cancel_waiting("nope").await.unwrap());
    plain.status = RunStatus::Succeeded;
    plain.stop_reason = Some(StopReason::FinalAnswer);
    store.save(&plain, 0, None).await.unwrap();
    assert_eq!(
        other
            .answer("plain", &answers(&[("c1", "{}")]))
            .await
            .unwrap(),
        Answered::NotWaiting
    );
    assert!(!other.cancel_waiting("plain").await.unwrap());

    // A waiting save lets the run go: nobody owns it, its previous owner is fenced off,
    // and no replica takes it over while it waits; every pending call starts unanswered.
    let calls = vec![
        pending_call("c1", Action::ClientExecute),
        pending_call("c2", Action::Approve),
    ];
    let record = start_waiting(&*store, "w1", calls.clone(), LONG).await;
    let loaded = other.load("w1").await.unwrap().unwrap();
    assert_eq!(loaded, record, "read back as saved, nothing answered");
    assert_eq!(loaded.status, RunStatus::RequiresAction);
    assert!(loaded.waiting() && !loaded.ended());
    assert!(loaded.pending.iter().all(|call| !call.answered));
    assert_eq!(
        store.save(&record, 0, None).await,
        Err(StateError::Fenced("w1".into())),
        "the owner that made it wait owns it no more"
    );
    assert_eq!(
        renewers.0.renew(&[lease("w1", "w1.a")]).await.unwrap(),
        vec!["w1".to_owned()]
    );
    store.release(&[lease("w1", "w1.a")]).await.unwrap();
    assert!(
        !is_lapsed(&*other, "w1").await,
        "a waiting run does not lapse"
    );
    assert_eq!(other.take_over("w1", "x.1").await.unwrap(), None);

    // Answers are checked whole: one call it does not wait for, and nothing is kept.
    assert_eq!(
        other
            .answer("w1", &answers(&[("c1", "\"early\""), ("c9", "\"x\"")]))
            .await
            .unwrap(),
        Answered::NotPending("c9".into())
    );
    let loaded = store.load("w1").await.unwrap().unwrap();
    assert!(
        loaded.pending.iter().all(|call| !call.answered),
        "nothing kept: {:?}",
        loaded.pending
    );

    // An answer is kept, on any replica; `load` says which calls are answered; the first
    // answer of a call wins; a partial answer lets nothing go.
    assert_eq!(
        store
            .answer("w1", &answers(&[("c1", "\"first\"")]))
            .await
            .unwrap(),
        accepted(&["c2"], false)
    );
    let loaded = other.load("w1").await.unwrap().unwrap();
    let answered: Vec<(&str, bool)> = loaded
        .pending
        .iter()
        .map(|call| (call.id.as_str(), call.answered))
        .collect();
    assert_eq!(answered, [("c1", true), ("c2", false)]);
    assert_eq!(
        loaded,
        RunRecord {
            pending: vec![
                PendingCall {
                    answered: true,
                    ..calls[0].clone()
                },
                calls[1].clone(),
            ],
            ..record.clone()
        }
    );
    assert_eq!(
        other
            .answer("w1", &answers(&[("c1", "\"first\"")]))
            .await
            .unwrap(),
        accepted(&["c2"], false),
        "the same answer again changes nothing"
    );
    assert_eq!(
        other
            .answer("w1", &answers(&[("c2", "true"), ("c1", "\"second\"")]))
            .await
            .unwrap(),
        Answered::Conflict("c1".into()),
        "another answer for a call answered already is refused, and nothing is kept"
    );
    let loaded = store.load("w1").await.unwrap().unwrap();
    assert!(!loaded.pending[1].answered);
    assert!(!is_lapsed(&*store, "w1").await);
    assert_eq!(store.take_over("w1", "x.1").await.unwrap(), None);

    // The last missing answer completes the wait: the lease lapses at once.
    assert_eq!(
        other
            .answer("w1", &answers(&[("c2", "true"), ("c1", "\"first\"")]))
            .await
            .unwrap(),
        accepted(&[], true)
    );
    assert!(
        is_lapsed(&*store, "w1").await,
        "answered: it lapses at once"
    );
    assert_eq!(
        store
            .answer("w1", &answers(&[("c2", "true")]))
            .await
            .unwrap(),
        accepted(&[], false),
        "completed once only"
    );
    let loaded = store.load("w1").await.unwrap().unwrap();
    assert!(loaded.pending.iter().all(|call| call.answered));

    // Exactly one replica takes it over at once, told what the run was told (the first
    // answer of each call).
    let taken = take_over_once(&store, &other, "w1").await;
    assert_eq!(
        taken.waited,
        told(&[("c1", "\"first\""), ("c2", "true")], false)
    );
    assert_eq!(taken.previous_owner, "", "nobody owned it while it waited");
    assert_eq!(taken.spec, "{\"spec\":1}");
    assert_eq!(taken.state, "waiting");
    assert_eq!(taken.messages, ["m0", "m1"]);
    assert_eq!(taken.record.status, RunStatus::RequiresAction);
    assert_eq!(taken.record.steps, record.steps);
    assert_eq!(
        taken
            .record
            .pending
            .iter()
            .map(|call| call.id.as_str())
            .collect::<Vec<_>>(),
        ["c1", "c2"]
    );
    let winner = taken.record.owner.clone();
    assert!(winner.starts_with("w1.t"), "{winner}");
    assert!(!is_lapsed(&*other, "w1").await);

    // Taken over, it waits no more: repeating answers it received is accepted (and
    // changes nothing), anything else is late; it cannot be cancelled as waiting.
    for repeat in [
        &[("c1", "\"first\"")][..],
        &[("c2", "true"), ("c1", "\"first\"")],
    ] {
        assert_eq!(
            store.answer("w1", &answers(repeat)).await.unwrap(),
            accepted(&[], false),
            "{repeat:?}"
        );
    }
    assert_eq!(
        other
            .answer("w1", &answers(&[("c9", "\"x\"")]))
            .await
            .unwrap(),
        Answered::NotWaiting
    );
    assert_eq!(
        other
            .answer("w1", &answers(&[("c1", "\"first\""), ("c9", "\"x\"")]))
            .await
            .unwrap(),
        Answered::NotWaiting
    );
    assert!(!store.cancel_waiting("w1").await.unwrap());

    // Should the replica that took it over go before it saves anything (killed, or shut
    // down, the moment it was answered), the next one is told again: what the run was
    // told is in no saved state yet. (It was told nothing, and the run failed with its
    // answers lost.)
    other.release(&[lease("w1", &winner)]).await.unwrap();
    assert!(is_lapsed(&*store, "w1").await);
    let retaken = store.take_over("w1", "w1.t9").await.unwrap().unwrap();
    assert_eq!(retaken.waited, taken.waited);
    assert_eq!(retaken.state, taken.state);
    let taken = retaken;
    let winner = taken.record.owner.clone();
    assert_eq!(winner, "w1.t9");

    // The new owner goes on with the run; the one that made it wait is still fenced off.
    assert_eq!(
        store.save(&record, 0, None).await,
        Err(StateError::Fenced("w1".into()))
    );
    let mut record = taken.record.clone();
    record.status = RunStatus::Running;
    record.pending.clear();
    record.steps.push(StepRecord {
        iteration: 2,
        ..StepRecord::default()
    });
    other
        .save(&record, 1, Some(&running("running-again", 2, &["m2"])))
        .await
        .unwrap();
    assert!(
        renewers
            .1
            .renew(&[lease("w1", &winner)])
            .await
            .unwrap()
            .is_empty()
    );
    let loaded = store.load("w1").await.unwrap().unwrap();
    assert_eq!(loaded.status, RunStatus::Running);
    assert!(loaded.pending.is_empty());
    assert_eq!(loaded.owner, winner);

    // It ran again: a later take-over is told nothing (what it was told is told once).
    other.release(&[lease("w1", &winner)]).await.unwrap();
    assert!(is_lapsed(&*store, "w1").await);
    let again = store.take_over("w1", "w1.b").await.unwrap().unwrap();
    assert_eq!(again.waited, None);
    assert_eq!(again.previous_owner, winner);
    assert_eq!(again.state, "running-again");
    assert_eq!(again.messages, ["m0", "m1", "m2"]);
    assert_eq!(
        store
            .answer("w1", &answers(&[("c1", "\"first\"")]))
            .await
            .unwrap(),
        accepted(&[], false)
    );

    // A run that waits again waits for its new calls only, each unanswered at first.
    let mut record = again.record.clone();
    record.status = RunStatus::RequiresAction;
    record.pending = vec![pending_call("c3", Action::Approve)];
    store
        .save(
            &record,
            2,
            Some(&Progress {
                wait: Some(LONG),
                ..running("waiting-again", 3, &["m3"])
            }),
        )
        .await
        .unwrap();
    let loaded = other.load("w1").await.unwrap().unwrap();
    assert_eq!(loaded.pending, record.pending);
    assert!(!loaded.pending[0].answered);
    assert!(!is_lapsed(&*other, "w1").await);
    // A call of the first wait takes its answer again (a client retrying a request
    // whose reply it lost) and no other; with the new calls' answers, those count.
    assert_eq!(
        other
            .answer("w1", &answers(&[("c1", "\"first\"")]))
            .await
            .unwrap(),
        accepted(&["c3"], false),
        "an answer of the first wait, repeated"
    );
    assert_eq!(
        other
            .answer("w1", &answers(&[("c3", "false"), ("c1", "\"other\"")]))
            .await
            .unwrap(),
        Answered::Conflict("c1".into()),
        "another answer for a call of the first wait"
    );
    assert_eq!(
        other
            .answer("w1", &answers(&[("c9", "false")]))
            .await
            .unwrap(),
        Answered::NotPending("c9".into())
    );
    assert_eq!(
        other
            .answer("w1", &answers(&[("c1", "\"first\""), ("c3", "false")]))
            .await
            .unwrap(),
        accepted(&[], true)
    );
    let third = take_over_once(&store, &other, "w1").await;
    assert_eq!(third.waited, told(&[("c3", "false")], false));
    assert_eq!(third.state, "waiting-again");
    assert_eq!(third.messages, ["m0", "m1", "m2", "m3"]);

    // Ended, it takes no answers but repeats of the ones it received.
    let mut record = third.record.clone();
    record.status = RunStatus::Running;
    record.pending.clear();
    other
        .save(&record, 2, Some(&running("running-3", 4, &["m4"])))
        .await
        .unwrap();
    record.status = RunStatus::Succeeded;
    record.stop_reason = Some(StopReason::FinalAnswer);
    record.final_answer = "done".into();
    other.save(&record, 2, None).await.unwrap();
    for repeat in [
        &[("c3", "false")][..],
        &[("c1", "\"first\""), ("c3", "false")],
    ] {
        assert_eq!(
            store.answer("w1", &answers(repeat)).await.unwrap(),
            accepted(&[], false),
            "{repeat:?}"
        );
    }
    assert_eq!(
        store
            .answer("w1", &answers(&[("c1", "true")]))
            .await
            .unwrap(),
        Answered::Conflict("c1".into()),
        "another answer for a call of the first wait, after the end"
    );
    for late in [&[("c4", "true")][..], &[("c3", "false"), ("c4", "true")]] {
        assert_eq!(
            store.answer("w1", &answers(late)).await.unwrap(),
            Answered::NotWaiting,
            "{late:?}"
        );
    }
    assert!(!store.cancel_waiting("w1").await.unwrap());
    assert!(!is_lapsed(&*other, "w1").await);
    assert_eq!(other.take_over("w1", "x.2").await.unwrap(), None);
    assert_eq!(
        other.load("w1").await.unwrap().unwrap().status,
        RunStatus::Succeeded
    );

    // Several replicas answering at once, each every call: exactly one completes the
    // wait, and the run is told that one's answers.
    for round in 0..4 {
        let run_id = format!("race-{round}");
        let ids = ["c1", "c2", "c3"];
        let calls = ids
            .iter()
            .map(|id| pending_call(id, Action::ClientExecute))
            .collect();
        start_waiting(&*store, &run_id, calls, LONG).await;
        let sent: Vec<Vec<(String, String)>> = (0..6)
            .map(|i| {
                ids.iter()
                    .map(|id| ((*id).to_owned(), format!("\"{id} from {i}\"")))
                    .collect()
            })
            .collect();
        let replies = futures_util::future::join_all(sent.iter().enumerate().map(|(i, sent)| {
            let store = if i % 2 == 0 { &store } else { &other };
            let run_id = &run_id;
            async move { store.answer(run_id, sent).await.unwrap() }
        }))
        .await;
        let completed: Vec<usize> = replies
            .iter()
            .enumerate()
            .filter(|(_, reply)| **reply == accepted(&[], true))
            .map(|(i, _)| i)
            .collect();
        assert_eq!(completed.len(), 1, "{replies:?}");
        assert!(
            replies.iter().all(|reply| *reply == accepted(&[], true)
                || matches!(reply, Answered::Conflict(id) if ids.contains(&id.as_str()))),
            "the others answered otherwise: {replies:?}"
        );
        assert!(is_lapsed(&*other, &run_id).await);
        let taken = take_over_once(&store, &other, &run_id).await;
        assert_eq!(
            taken.waited,
            Some(Answers {
                answers: sent[completed[0]].iter().cloned().collect(),
                cancelled: false,
            }),
            "the first answer of each call wins"
        );
    }

    // Several replicas answering at once, each one call: exactly one supplies the last
    // missing answer.
    for round in 0..4 {
        let run_id = format!("split-{round}");
        let ids = ["c1", "c2", "c3"];
        let calls = ids
            .iter()
            .map(|id| pending_call(id, Action::Approve))
            .collect();
        start_waiting(&*store, &run_id, calls, LONG).await;
        let replies = futures_util::future::join_all((0..6).map(|i| {
            let store = if i % 2 == 0 { &store } else { &other };
            let run_id = &run_id;
            let sent = answers(&[(ids[i % 3], if i < 3 { "true" } else { "false" })]);
            async move { store.answer(run_id, &sent).await.unwrap() }
        }))
        .await;
        let completed = replies
            .iter()
            .filter(|reply| **reply == accepted(&[], true))
            .count();
        assert_eq!(completed, 1, "{replies:?}");
        assert!(
            replies.iter().all(|reply| match reply {
                Answered::Accepted { left, .. } => left.iter().all(|id| ids.contains(&id.as_str())),
                Answered::Conflict(id) => ids.contains(&id.as_str()),
                _ => false,
            }),
            "{replies:?}"
        );
        assert!(is_lapsed(&*store, &run_id).await);
        let taken = take_over_once(&store, &other, &run_id).await;
        let waited = taken.waited.expect("it waited");
        assert!(!waited.cancelled);
        let mut answered: Vec<&str> = waited.answers.keys().map(String::as_str).collect();
        answered.sort_unstable();
        assert_eq!(answered, ids);
        assert!(
            waited
                .answers
                .values()
                .all(|answer| answer == "true" || answer == "false")
        );
    }

    // Cancelled, a waiting run lapses at once; it is cancelled once, takes no more
    // answers (an answer it received, sent again, is still a repeat), and the replica
    // taking it over is told.
    let calls = vec![
        pending_call("c1", Action::ClientExecute),
        pending_call("c2", Action::Approve),
    ];
    start_waiting(&*store, "wc", calls, LONG).await;
    assert_eq!(
        store
            .answer("wc", &answers(&[("c1", "\"out\"")]))
            .await
            .unwrap(),
        accepted(&["c2"], false)
    );
    assert!(!is_lapsed(&*store, "wc").await);
    let cancels = futures_util::future::join_all((0..4).map(|i| {
        let store = if i % 2 == 0 { &store } else { &other };
        async move { store.cancel_waiting("wc").await.unwrap() }
    }))
    .await;
    assert_eq!(
        cancels.iter().filter(|cancelled| **cancelled).count(),
        1,
        "cancelled once: {cancels:?}"
    );
    assert!(!store.cancel_waiting("wc").await.unwrap());
    assert!(
        is_lapsed(&*other, "wc").await,
        "cancelled: it lapses at once"
    );
    assert_eq!(
        other
            .answer("wc", &answers(&[("c2", "true")]))
            .await
            .unwrap(),
        Answered::NotWaiting
    );
    assert_eq!(
        other
            .answer("wc", &answers(&[("c1", "\"out\"")]))
            .await
            .unwrap(),
        accepted(&[], false)
    );
    assert_eq!(
        store
            .answer("wc", &answers(&[("c1", "\"other\"")]))
            .await
            .unwrap(),
        Answered::Conflict("c1".into())
    );
    let taken = take_over_once(&store, &other, "wc").await;
    assert_eq!(taken.waited, told(&[("c1", "\"out\"")], true));
    assert!(!other.cancel_waiting("wc").await.unwrap());
    assert_eq!(
        store
            .answer("wc", &answers(&[("c2", "true")]))
            .await
            .unwrap(),
        Answered::NotWaiting
    );
    assert_eq!(
        store
            .answer("wc", &answers(&[("c1", "\"out\"")]))
            .await
            .unwrap(),
        accepted(&[], false)
    );

    // Out of time, a waiting run lapses when its wait elapses, and is told what came.
    let calls = vec![
        pending_call("c1", Action::ClientExecute),
        pending_call("c2", Action::ClientExecute),
    ];
    start_waiting(&*store, "wt", calls, TEST_LEASE).await;
    assert_eq!(
        other
            .answer("wt", &answers(&[("c2", "\"out\"")]))
            .await
            .unwrap(),
        accepted(&["c1"], false)
    );
    assert!(!is_lapsed(&*store, "wt").await);
    assert_eq!(store.take_over("wt", "x.3").await.unwrap(), None);
    tokio::time::sleep(TEST_LEASE + Duration::from_millis(100)).await;
    assert!(is_lapsed(&*store, "wt").await, "out of time: it lapses");
    // Before any replica takes it over (none may have room), it takes no more answers:
    // a repeat is accepted as before, a new one is late.
    assert_eq!(
        other
            .answer("wt", &answers(&[("c1", "\"late\"")]))
            .await
            .unwrap(),
        Answered::NotWaiting
    );
    assert_eq!(
        other
            .answer("wt", &answers(&[("c2", "\"out\"")]))
            .await
            .unwrap(),
        accepted(&[], false)
    );
    let taken = take_over_once(&store, &other, "wt").await;
    assert_eq!(taken.waited, told(&[("c2", "\"out\"")], false));
    assert_eq!(taken.previous_owner, "");
    assert_eq!(
        store
            .answer("wt", &answers(&[("c1", "\"late\"")]))
            .await
            .unwrap(),
        Answered::NotWaiting
    );
    assert_eq!(
        store
            .answer("wt", &answers(&[("c2", "\"out\"")]))
            .await
            .unwrap(),
        accepted(&[], false)
    );
    assert!(!other.cancel_waiting("wt").await.unwrap());

    // Models that give no ids get the same ids in every round: a call of the next wait
    // with the id of an answered one is answered afresh, and its answer then stands.
    start_waiting(
        &*store,
        "wr",
        vec![pending_call("c1", Action::ClientExecute)],
        LONG,
    )
    .await;
    assert_eq!(
        other
            .answer("wr", &answers(&[("c1", "\"a\"")]))
            .await
            .unwrap(),
        accepted(&[], true)
    );
    let taken = take_over_once(&store, &other, "wr").await;
    let mut again = taken.record.clone();
    again.status = RunStatus::RequiresAction;
    again.pending = vec![pending_call("c1", Action::ClientExecute)];
    store
        .save(
            &again,
            0,
            Some(&Progress {
                wait: Some(LONG),
                ..running("waiting-again", 1, &["m1"])
            }),
        )
        .await
        .unwrap();
    assert_eq!(
        other
            .answer("wr", &answers(&[("c1", "\"b\"")]))
            .await
            .unwrap(),
        accepted(&[], true),
        "the same id in the next wait takes another answer"
    );
    take_over_once(&store, &other, "wr").await;
    assert_eq!(
        store
            .answer("wr", &answers(&[("c1", "\"b\"")]))
            .await
            .unwrap(),
        accepted(&[], false)
    );
    assert_eq!(
        store
            .answer("wr", &answers(&[("c1", "\"a\"")]))
            .await
            .unwrap(),
        Answered::Conflict("c1".into()),
        "the latest answer of the id stands"
    );
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
