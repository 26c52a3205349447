use std::{
    collections::{BTreeSet, HashMap, VecDeque},
    sync::{Arc, Mutex, PoisonError},
    time::Duration,
};

use agentrt_core::StateResult;
use tokio::time::Instant;

use crate::Exchange;

/// Where sessions' histories are kept: in this process, or shared (Redis) when several
/// replicas serve the same sessions.
#[async_trait::async_trait]
pub trait SessionStore: Send + Sync {
    /// The session's exchanges, oldest first; empty for an unknown session.
    async fn history(&self, session_id: &str) -> StateResult<Vec<Arc<Exchange>>>;
    /// Appends an exchange to the session, creating it if needed, and extends the
    /// session's life. Appends of one session land in the order they are made, also when
    /// several replicas append at once; the oldest exchanges beyond the bound go.
    async fn append(&self, session_id: &str, exchange: Exchange) -> StateResult<()>;
}

/// Bounds of the in-memory store.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SessionLimits {
    /// A session unused for this long is dropped.
    pub ttl: Duration,
    /// Most sessions kept; beyond, the least recently used is dropped.
    pub max_sessions: usize,
    /// Most exchanges kept per session; older ones are dropped first.
    pub max_exchanges: usize,
}

impl Default for SessionLimits {
    fn default() -> Self {
        Self {
            ttl: Duration::from_secs(3600),
            max_sessions: 100_000,
            max_exchanges: 200,
        }
    }
}

/// The in-memory store, bounded in sessions, exchanges and time.
pub struct InMemorySessionStore {
    limits: SessionLimits,
    inner: Mutex<Inner>,
}

#[derive(Default)]
struct Inner {
    sessions: HashMap<String, Session>,
    by_expiry: BTreeSet<(Instant, String)>,
}

struct Session {
    exchanges: VecDeque<Arc<Exchange>>,
    expires_at: Instant,
}

impl InMemorySessionStore {
    /// A store with these bounds.
    pub fn new(limits: SessionLimits) -> Self {
        Self {
            limits,
            inner: Mutex::new(Inner::default()),
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Inner> {
        // Each critical section leaves the maps consistent before anything can panic.
        self.inner.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Sessions held.
    pub fn sessions(&self) -> usize {
        let mut inner = self.lock();
        inner.expire(Instant::now());
        inner.sessions.len()
    }
}

impl Inner {
    fn expire(&mut self, now: Instant) {
        while let Some((at, _)) = self.by_expiry.first() {
            if *at > now {
                break;
            }
            if let Some((_, id)) = self.by_expiry.pop_first() {
                self.sessions.remove(&id);
            }
        }
    }
}

#[async_trait::async_trait]
impl SessionStore for InMemorySessionStore {
    async fn history(&self, session_id: &str) -> StateResult<Vec<Arc<Exchange>>> {
        let mut inner = self.lock();
        inner.expire(Instant::now());
        Ok(inner
            .sessions
            .get(session_id)
            .map(|s| s.exchanges.iter().cloned().collect())
            .unwrap_or_default())
    }

    async fn append(&self, session_id: &str, exchange: Exchange) -> StateResult<()> {
        let now = Instant::now();
        let expires_at = now + self.limits.ttl;
        let mut inner = self.lock();
        inner.expire(now);
        let previous = inner.sessions.get(session_id).map(|s| s.expires_at);
        if let Some(previous) = previous {
            inner.by_expiry.remove(&(previous, session_id.to_owned()));
        } else {
            while inner.sessions.len() >= self.limits.max_sessions.max(1) {
                let Some((_, oldest)) = inner.by_expiry.pop_first() else {
                    break;
                };
                inner.sessions.remove(&oldest);
            }
        }
        inner.by_expiry.insert((expires_at, session_id.to_owned()));
        let session = inner
            .sessions
            .entry(session_id.to_owned())
            .or_insert_with(|| Session {
                exchanges: VecDeque::new(),
                expires_at,
            });
        session.expires_at = expires_at;
        session.exchanges.push_back(Arc::new(exchange));
        while session.exchanges.len() > self.limits.max_exchanges.max(1) {
            session.exchanges.pop_front();
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn exchange(n: u32) -> Exchange {
        Exchange {
            messages: vec![],
            tokens: n,
        }
    }

    #[tokio::test(start_paused = true)]
    async fn sessions_are_bounded_in_time_count_and_length() {
        let store = InMemorySessionStore::new(SessionLimits {
            ttl: Duration::from_secs(60),
            max_sessions: 2,
            max_exchanges: 3,
        });
        for n in 0..5 {
            store.append("a", exchange(n)).await.unwrap();
        }
        let tokens: Vec<u32> = store
            .history("a")
            .await
            .unwrap()
            .iter()
            .map(|e| e.tokens)
            .collect();
        assert_eq!(tokens, [2, 3, 4], "oldest exchanges go first");

        tokio::time::advance(Duration::from_secs(1)).await;
        store.append("b", exchange(0)).await.unwrap();
        tokio::time::advance(Duration::from_secs(1)).await;
        store.append("c", exchange(0)).await.unwrap();
        assert!(
            store.history("a").await.unwrap().is_empty(),
            "the least recently used session made room"
        );
        assert_eq!(store.sessions(), 2);

        tokio::time::advance(Duration::from_secs(61)).await;
        assert_eq!(store.sessions(), 0, "unused sessions expire");
    }
}
