//! Engines by id: a validated agent config bound to a session, kept for a time after its
//! last use.

use std::{
    collections::{BTreeSet, HashMap},
    sync::{Arc, Mutex},
    time::{Duration, SystemTime},
};

use agentrt_core::{AgentConfig, StateError, StateResult, ToolSpec};
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
    /// The engine, if it exists, has not expired and, when `owner` is given, belongs to
    /// that principal ([`principal_of`] its session); extends the life of the engine it
    /// answers, and of no other (a caller that may not see an engine cannot keep it).
    async fn get(&self, id: &str, owner: Option<&str>) -> StateResult<Option<StoredEngine>>;
    /// Drops the engine; false when there was none.
    async fn remove(&self, id: &str) -> StateResult<bool>;
}

/// The in-memory store: a map plus an index ordered by expiry, which is also the order of
/// last use, so that expired and least-recently-used engines are found in O(log n).
pub struct MemoryEngineStore {
    ttl: Duration,
    max_engines: usize,
    budgets: EngineBudgets,
    inner: Mutex<Inner>,
}

/// What engines may take of memory: in bytes, all together, and in engines, per
/// principal (the anonymous one is bound by the store's count alone).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct EngineBudgets {
    /// Bytes of all engines' configs and tool specs together.
    pub max_bytes: usize,
    /// Engines of one principal.
    pub max_per_principal: usize,
}

impl Default for EngineBudgets {
    fn default() -> Self {
        Self {
            max_bytes: usize::MAX,
            max_per_principal: usize::MAX,
        }
    }
}

#[derive(Default)]
struct Inner {
    engines: HashMap<String, Entry>,
    by_expiry: BTreeSet<(Instant, String)>,
    /// Bytes of all engines.
    bytes: usize,
    /// Engines by principal (named principals only).
    per_principal: HashMap<String, usize>,
}

struct Entry {
    engine: StoredEngine,
    expires_at: Instant,
    bytes: usize,
}

pub use agentrt_core::principal_of;

/// What an engine weighs: the bytes of its config and tool specs as stored.
fn weight(engine: &StoredEngine) -> usize {
    serde_json::to_vec(engine).map_or(0, |json| json.len())
}

impl MemoryEngineStore {
    /// A store keeping at most `max_engines`, each for `ttl` after its last use.
    pub fn new(ttl: Duration, max_engines: usize) -> Self {
        Self {
            ttl,
            max_engines: max_engines.max(1),
            budgets: EngineBudgets::default(),
            inner: Mutex::new(Inner::default()),
        }
    }

    /// The same store, within `budgets`: an engine that would take it past one is
    /// refused ([`StateError::OverBudget`](agentrt_core::StateError::OverBudget)).
    pub fn with_budgets(mut self, budgets: EngineBudgets) -> Self {
        self.budgets = budgets;
        self
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
    /// Engines of `principal` (the anonymous one: those of no named principal).
    fn count(&self, principal: &str) -> usize {
        if principal.is_empty() {
            self.engines.len() - self.per_principal.values().sum::<usize>()
        } else {
            self.per_principal.get(principal).copied().unwrap_or(0)
        }
    }

    /// The engine a full store drops for one of `caller`'s: the least recently used, when
    /// its principal has more engines than the caller; else the caller's own least
    /// recently used. One principal never drops another's engines to hold more than it
    /// (four principals at their quota dropped every other principal's engines).
    fn victim(&self, caller: &str) -> Option<(Instant, String)> {
        let oldest = self.by_expiry.first()?;
        let principal_of_id = |id: &str| {
            self.engines
                .get(id)
                .map_or("", |entry| principal_of(&entry.engine.session_id))
        };
        let theirs = principal_of_id(&oldest.1);
        if theirs == caller || self.count(theirs) > self.count(caller) {
            return Some(oldest.clone());
        }
        self.by_expiry
            .iter()
            .find(|(_, id)| principal_of_id(id) == caller)
            .or(Some(oldest))
            .cloned()
    }

    fn purge_expired(&mut self, now: Instant) {
        while let Some((expires_at, _)) = self.by_expiry.first() {
            if *expires_at > now {
                break;
            }
            if let Some((_, id)) = self.by_expiry.pop_first() {
                debug!(engine_id = %id, "engine expired");
                self.forget(&id);
            }
        }
    }

    /// Drops engine `id` from the map and the totals (not from `by_expiry`).
    fn forget(&mut self, id: &str) -> Option<Entry> {
        let entry = self.engines.remove(id)?;
        self.bytes = self.bytes.saturating_sub(entry.bytes);
        let principal = principal_of(&entry.engine.session_id);
        if let Some(count) = self.per_principal.get_mut(principal) {
            *count = count.saturating_sub(1);
            if *count == 0 {
                self.per_principal.remove(principal);
            }
        }
        Some(entry)
    }
}

#[async_trait]
impl EngineStore for MemoryEngineStore {
    async fn insert(&self, mut engine: StoredEngine) -> StateResult<StoredEngine> {
        let now = Instant::now();
        let (expires_at, expire_time) = self.expiry(now);
        engine.expire_time = expire_time;
        let bytes = weight(&engine);
        let mut inner = self.lock();
        inner.purge_expired(now);
        if let Some(old) = inner.forget(&engine.id) {
            inner.by_expiry.remove(&(old.expires_at, engine.id.clone()));
        }
        // Budgets refuse the new engine; nothing kept is dropped for it.
        if inner.bytes.saturating_add(bytes) > self.budgets.max_bytes {
            return Err(StateError::OverBudget {
                budget: "engines.max_bytes",
                message: format!(
                    "no room is left among the engines kept for this one's {bytes} bytes; \
                     delete engines, or wait for unused ones to expire"
                ),
            });
        }
        let principal = principal_of(&engine.session_id).to_owned();
        let owned = inner.per_principal.get(&principal).copied().unwrap_or(0);
        if !principal.is_empty() && owned >= self.budgets.max_per_principal {
            return Err(StateError::OverBudget {
                budget: "engines.max_per_principal",
                message: format!(
                    "this principal has {owned} engines, its most; delete engines, or wait \
                     for unused ones to expire"
                ),
            });
        }
        while inner.engines.len() >= self.max_engines {
            let Some(victim) = inner.victim(&principal) else {
                break;
            };
            debug!(engine_id = %victim.1, "engine registry full, dropping the least recently used engine");
            inner.by_expiry.remove(&victim);
            inner.forget(&victim.1);
        }
        inner.by_expiry.insert((expires_at, engine.id.clone()));
        inner.bytes += bytes;
        if !principal.is_empty() {
            *inner.per_principal.entry(principal).or_default() += 1;
        }
        inner.engines.insert(
            engine.id.clone(),
            Entry {
                engine: engine.clone(),
                expires_at,
                bytes,
            },
        );
        Ok(engine)
    }

    async fn get(&self, id: &str, owner: Option<&str>) -> StateResult<Option<StoredEngine>> {
        let now = Instant::now();
        let (expires_at, expire_time) = self.expiry(now);
        let mut inner = self.lock();
        inner.purge_expired(now);
        let Some(entry) = inner.engines.get_mut(id) else {
            return Ok(None);
        };
        if owner.is_some_and(|owner| principal_of(&entry.engine.session_id) != owner) {
            return Ok(None);
        }
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
        Ok(match inner.forget(id) {
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
            store.get("a", None).await.unwrap().is_some(),
            "a use extends the life"
        );
        tokio::time::advance(Duration::from_secs(45)).await;
        assert!(store.get("a", None).await.unwrap().is_some());
        assert!(
            store.get("b", None).await.unwrap().is_none(),
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
        store.get("a", None).await.unwrap();
        store.insert(engine("c")).await.unwrap();
        assert!(store.get("a", None).await.unwrap().is_some());
        assert!(store.get("b", None).await.unwrap().is_none());
        assert!(store.get("c", None).await.unwrap().is_some());
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

    #[tokio::test(start_paused = true)]
    async fn budgets_refuse_new_engines_and_keep_those_accepted() {
        let one = weight(&engine("a"));
        let store =
            MemoryEngineStore::new(Duration::from_secs(60), 100).with_budgets(EngineBudgets {
                max_bytes: one * 3 + one / 2,
                max_per_principal: 2,
            });
        let owned = |id: &str, principal: &str| StoredEngine {
            session_id: format!("{principal}/s"),
            ..engine(id)
        };
        store.insert(owned("a1", "alice")).await.unwrap();
        store.insert(owned("a2", "alice")).await.unwrap();
        let refused = store.insert(owned("a3", "alice")).await.unwrap_err();
        assert!(
            matches!(
                refused,
                StateError::OverBudget {
                    budget: "engines.max_per_principal",
                    ..
                }
            ),
            "{refused:?}"
        );
        store.insert(owned("b1", "bob")).await.unwrap();
        let refused = store.insert(owned("b2", "bob")).await.unwrap_err();
        assert!(
            matches!(
                refused,
                StateError::OverBudget {
                    budget: "engines.max_bytes",
                    ..
                }
            ),
            "{refused:?}"
        );
        for id in ["a1", "a2", "b1"] {
            assert!(store.get(id, None).await.unwrap().is_some(), "{id} is kept");
        }
        // Room comes back as engines go, whichever way they go.
        assert!(store.remove("a1").await.unwrap());
        store.insert(owned("a3", "alice")).await.unwrap();
        tokio::time::advance(Duration::from_secs(61)).await;
        store.insert(owned("a4", "alice")).await.unwrap();
        store.insert(owned("a5", "alice")).await.unwrap();
        store.insert(owned("b2", "bob")).await.unwrap();
        // The anonymous principal is bound by the totals alone.
        let anonymous =
            MemoryEngineStore::new(Duration::from_secs(60), 100).with_budgets(EngineBudgets {
                max_bytes: usize::MAX,
                max_per_principal: 1,
            });
        for id in ["x", "y", "z"] {
            anonymous.insert(engine(id)).await.unwrap();
        }
    }
}
