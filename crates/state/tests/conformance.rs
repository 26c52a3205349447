//! Every store backend runs the same conformance suites (`agentrt-test-support`): the
//! in-memory stores, and the Redis stores against a real Redis (`AGENTRT_TEST_REDIS`, by
//! default `redis://127.0.0.1:6379/0`; `scripts/test` starts one when none answers). Each
//! Redis test keeps its keys under a prefix of its own.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::{sync::Arc, time::Duration};

use agentrt_state::{
    BusLimits, EngineStore, EventBus, InMemoryBus, InMemorySessionStore, MemoryEngineStore,
    MemoryRunStore, RunRetention, RunStore, SessionLimits, SessionStore,
    redis::{Redis, RedisLimits},
};
use agentrt_test_support::conformance::{self, redis_prefix, redis_url};

const HOUR: Duration = Duration::from_secs(3600);

fn limits(events_per_run: usize) -> RedisLimits {
    RedisLimits {
        engine_ttl: HOUR,
        session_ttl: HOUR,
        max_exchanges: 3,
        run_retention: Duration::from_secs(600),
        events_per_run,
        retained_events: 1_000_000,
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
async fn memory_run_store() {
    conformance::run_store(|| async {
        let store: Arc<dyn RunStore> = Arc::new(MemoryRunStore::new(RunRetention {
            ended: Duration::from_secs(600),
        }));
        (store.clone(), store)
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
