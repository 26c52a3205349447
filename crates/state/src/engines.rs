//! Engines by id: a validated agent config bound to a session, kept for a time after its
//! last use.

use std::{
    collections::{BTreeSet, HashMap},
    sync::{Arc, Mutex},
    time::{Duration, SystemTime},
};

use agentrt_core::{AgentConfig, StateResult, ToolSpec};
use async_trait::async_trait;
use tokio::time::Instant;
use tracing::debug;

/// An engine as stored: a validated config bound to a session. (The loop that runs it
/// is `agentrt_engine::Engine`.)
#[derive(Debug, Clone, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct StoredEngine {
    /// The engine's id.
    pub id: String,
    /// The session it belongs to.
    pub session_id: String,
    /// What it runs.
    pub config: Arc<AgentConfig>,
    /// Specs of its tools, as the tool executor described them when it was created.
    pub tools: Arc<[ToolSpec]>,
    /// When it was created.
    pub create_time: SystemTime,
    /// When it expires unless used before.
    pub expire_time: SystemTime,
}

/// Where engines are kept: in this process, or shared (Redis) by every replica.
#[async_trait]
pub trait EngineStore: Send + Sync {
    /// Keeps `engine` (a bounded store may drop the least recently used one to make
    /// room) and sets its expiry.
    async fn insert(&self, engine: StoredEngine) -> StateResult<StoredEngine>;
    /// The engine, if it exists and has not expired; extends its life.
    async fn get(&self, id: &str) -> StateResult<Option<StoredEngine>>;
    /// Drops the engine; false when there was none.
    async fn remove(&self, id: &str) -> StateResult<bool>;
}

/// The in-memory store: a map plus an index ordered by expiry, which is also the order of
/// last use, so that expired and least-recently-used engines are found in O(log n).
pub struct MemoryEngineStore {
    ttl: Duration,
    max_engines: usize,
    inner: Mutex<Inner>,
}

#[derive(Default)]
struct Inner {
    engines: HashMap<String, Entry>,
    by_expiry: BTreeSet<(Instant, String)>,
}

struct Entry {
    engine: StoredEngine,
    expires_at: Instant,
}

impl MemoryEngineStore {
    /// A store keeping at most `max_engines`, each for `ttl` after its last use.
    pub fn new(ttl: Duration, max_engines: usize) -> Self {
        Self {
            ttl,
            max_engines: max_engines.max(1),
            inner: Mutex::new(Inner::default()),
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Inner> {
        // A panic while holding the lock cannot leave the maps half-updated in a way that
        // matters more than losing every engine, so recover the guard.
        self.inner
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    fn expiry(&self, now: Instant) -> (Instant, SystemTime) {
        (now + self.ttl, SystemTime::now() + self.ttl)
    }
}

impl Inner {
    fn purge_expired(&mut self, now: Instant) {
        while let Some((expires_at, _)) = self.by_expiry.first() {
            if *expires_at > now {
                break;
            }
            if let Some((_, id)) = self.by_expiry.pop_first() {
                debug!(engine_id = %id, "engine expired");
                self.engines.remove(&id);
            }
        }
    }
}

#[async_trait]
impl EngineStore for MemoryEngineStore {
    async fn insert(&self, mut engine: StoredEngine) -> StateResult<StoredEngine> {
        let now = Instant::now();
        let (expires_at, expire_time) = self.expiry(now);
        engine.expire_time = expire_time;
        let mut inner = self.lock();
        inner.purge_expired(now);
        if let Some(old) = inner.engines.remove(&engine.id) {
            inner.by_expiry.remove(&(old.expires_at, engine.id.clone()));
        }
        while inner.engines.len() >= self.max_engines {
            let Some((_, id)) = inner.by_expiry.pop_first() else {
                break;
            };
            debug!(engine_id = %id, "engine registry full, dropping the least recently used engine");
            inner.engines.remove(&id);
        }
        inner.by_expiry.insert((expires_at, engine.id.clone()));
        inner.engines.insert(
            engine.id.clone(),
            Entry {
                engine: engine.clone(),
                expires_at,
            },
        );
        Ok(engine)
    }

    async fn get(&self, id: &str) -> StateResult<Option<StoredEngine>> {
        let now = Instant::now();
        let (expires_at, expire_time) = self.expiry(now);
        let mut inner = self.lock();
        inner.purge_expired(now);
        let Some(entry) = inner.engines.get_mut(id) else {
            return Ok(None);
        };
        let previous = std::mem::replace(&mut entry.expires_at, expires_at);
        entry.engine.expire_time = expire_time;
        let engine = entry.engine.clone();
        inner.by_expiry.remove(&(previous, id.to_owned()));
        inner.by_expiry.insert((expires_at, id.to_owned()));
        Ok(Some(engine))
    }

    async fn remove(&self, id: &str) -> StateResult<bool> {
        let mut inner = self.lock();
        inner.purge_expired(Instant::now());
        Ok(match inner.engines.remove(id) {
            Some(entry) => {
                inner.by_expiry.remove(&(entry.expires_at, id.to_owned()));
                true
            }
            None => false,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use agentrt_core::{ContextBudget, ModelSelection, Strategy, Timeouts};

    fn engine(id: &str) -> StoredEngine {
        StoredEngine {
            id: id.into(),
            session_id: "s".into(),
            config: Arc::new(AgentConfig {
                name: "a".into(),
                system_prompt: String::new(),
                model: ModelSelection {
                    provider: "openai".into(),
                    name: "m".into(),
                    temperature: None,
                    max_tokens: None,
                },
                rerank_model: None,
                strategy: Strategy::FunctionCall,
                max_iterations: 10,
                tools: vec![],
                approval: Vec::new(),
                client_tools: Vec::new(),
                parallel_tool_calls: false,
                max_parallel_tool_calls: 4,
                context: ContextBudget {
                    max_prompt_tokens: 8192,
                },
                timeouts: Timeouts::default(),
            }),
            tools: Arc::new([]),
            create_time: SystemTime::now(),
            expire_time: SystemTime::now(),
        }
    }

    #[tokio::test(start_paused = true)]
    async fn engines_expire_after_the_ttl_unless_used() {
        let store = MemoryEngineStore::new(Duration::from_secs(60), 10);
        store.insert(engine("a")).await.unwrap();
        store.insert(engine("b")).await.unwrap();
        tokio::time::advance(Duration::from_secs(45)).await;
        assert!(
            store.get("a").await.unwrap().is_some(),
            "a use extends the life"
        );
        tokio::time::advance(Duration::from_secs(45)).await;
        assert!(store.get("a").await.unwrap().is_some());
        assert!(
            store.get("b").await.unwrap().is_none(),
            "b was not used for 90s"
        );
    }

    #[tokio::test(start_paused = true)]
    async fn a_full_store_drops_the_least_recently_used() {
        let store = MemoryEngineStore::new(Duration::from_secs(60), 2);
        store.insert(engine("a")).await.unwrap();
        tokio::time::advance(Duration::from_secs(1)).await;
        store.insert(engine("b")).await.unwrap();
        tokio::time::advance(Duration::from_secs(1)).await;
        store.get("a").await.unwrap();
        store.insert(engine("c")).await.unwrap();
        assert!(store.get("a").await.unwrap().is_some());
        assert!(store.get("b").await.unwrap().is_none());
        assert!(store.get("c").await.unwrap().is_some());
        assert_eq!(store.lock().engines.len(), 2);
        assert_eq!(store.lock().by_expiry.len(), 2);
    }

    #[tokio::test]
    async fn remove_reports_whether_there_was_one() {
        let store = MemoryEngineStore::new(Duration::from_secs(60), 2);
        store.insert(engine("a")).await.unwrap();
        assert!(store.remove("a").await.unwrap());
        assert!(!store.remove("a").await.unwrap());
        assert!(store.lock().by_expiry.is_empty());
    }
}
