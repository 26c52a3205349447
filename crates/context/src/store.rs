use std::{
    collections::{BTreeSet, HashMap, VecDeque},
    sync::{Arc, Mutex, PoisonError},
    time::Duration,
};

use agentrt_core::{StateResult, principal_of};
use tokio::time::Instant;

use crate::{ChatMessage, Exchange};

/// Where sessions' histories are kept: in this process, or shared (Redis) when several
/// replicas serve the same sessions.
#[async_trait::async_trait]
pub trait SessionStore: Send + Sync {
    /// The session's exchanges, oldest first; empty for an unknown session. Reading a
    /// session uses it: its life is extended as by an append (a run of it is under way).
    async fn history(&self, session_id: &str) -> StateResult<Vec<Arc<Exchange>>>;
    /// Keeps the session at least `wait` longer than its time to live from now: a run of
    /// it waits that long (for answers) before it reads the history again.
    async fn keep(&self, session_id: &str, wait: Duration) -> StateResult<()>;
    /// Appends an exchange to the session, creating it if needed, and extends the
    /// session's life. Appends of one session land in the order they are made, also when
    /// several replicas append at once; the oldest exchanges beyond the bound go.
    /// Shared: a caller that may have to append it again keeps its own reference.
    async fn append(&self, session_id: &str, exchange: Arc<Exchange>) -> StateResult<()>;
    /// This store as `Any`: a run store kept in the same backend may keep a run's turn
    /// with the run's end, in one write (see the state crate's `RunStore::end`). `None`
    /// when it cannot.
    fn as_any(&self) -> Option<&(dyn std::any::Any + Send + Sync)> {
        None
    }
}

/// Bounds of the in-memory store.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SessionLimits {
    /// A session unused for this long is dropped.
    pub ttl: Duration,
    /// Most sessions kept; beyond, the least recently used of the principal holding the
    /// most sessions is dropped.
    pub max_sessions: usize,
    /// Most exchanges kept per session; older ones are dropped first.
    pub max_exchanges: usize,
    /// Most bytes of message text kept, all sessions together; beyond, the least recently
    /// used sessions of the principal holding the most bytes are dropped first (and a
    /// session alone past it keeps its newest exchanges that fit, at least the last one).
    pub max_bytes: usize,
    /// Most bytes of one session's exchanges; beyond, its oldest are dropped (the newest
    /// stays).
    pub max_history_bytes: usize,
}

impl Default for SessionLimits {
    fn default() -> Self {
        Self {
            ttl: Duration::from_secs(3600),
            max_sessions: 100_000,
            max_exchanges: 200,
            max_bytes: usize::MAX,
            max_history_bytes: usize::MAX,
        }
    }
}

/// What an exchange weighs: the bytes of its messages' text, and a little for each
/// message and call kept.
fn weight(exchange: &Exchange) -> usize {
    const PER_ITEM: usize = 64;
    exchange
        .messages
        .iter()
        .map(|message| {
            PER_ITEM
                + match message {
                    ChatMessage::System(text) | ChatMessage::User(text) => text.len(),
                    ChatMessage::Assistant {
                        content,
                        tool_calls,
                    } => {
                        content.len()
                            + tool_calls
                                .iter()
                                .map(|c| PER_ITEM + c.id.len() + c.name.len() + c.arguments.len())
                                .sum::<usize>()
                    }
                    ChatMessage::Tool { call_id, content } => call_id.len() + content.len(),
                }
        })
        .sum()
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
    /// Bytes of all sessions' exchanges.
    bytes: usize,
    /// What each principal holding sessions holds (the anonymous one under "").
    principals: HashMap<String, Share>,
}

/// The sessions a principal holds, and their bytes.
#[derive(Default, Clone, Copy)]
struct Share {
    sessions: usize,
    bytes: usize,
}

struct Session {
    /// Each exchange with its weight.
    exchanges: VecDeque<(Arc<Exchange>, usize)>,
    /// Their weights together.
    bytes: usize,
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
                self.forget(&id);
            }
        }
    }

    /// Keeps session `id`, if there is one, until `until` at least; it is then the most
    /// recently used.
    fn extend(&mut self, id: &str, until: Instant) {
        let Some(session) = self.sessions.get_mut(id) else {
            return;
        };
        let previous = session.expires_at;
        if previous >= until {
            return;
        }
        session.expires_at = until;
        self.by_expiry.remove(&(previous, id.to_owned()));
        self.by_expiry.insert((until, id.to_owned()));
    }

    /// Drops session `id` from the map and the totals (not from `by_expiry`).
    fn forget(&mut self, id: &str) {
        if let Some(session) = self.sessions.remove(id) {
            self.bytes = self.bytes.saturating_sub(session.bytes);
            let principal = principal_of(id);
            if let Some(share) = self.principals.get_mut(principal) {
                share.sessions = share.sessions.saturating_sub(1);
                share.bytes = share.bytes.saturating_sub(session.bytes);
                if share.sessions == 0 {
                    self.principals.remove(principal);
                }
            }
        }
    }

    fn share(&self, principal: &str) -> Share {
        self.principals.get(principal).copied().unwrap_or_default()
    }

    /// The session a full store drops for `caller`'s session `keep`: the least recently
    /// used one (other than `keep`) of the principal holding the most (sessions, or bytes
    /// when `by_bytes`), the caller on a tie. One principal never drops the history of
    /// another that holds less; `None` when only the caller's `keep` is left to give.
    fn victim(&self, caller: &str, keep: &str, by_bytes: bool) -> Option<(Instant, String)> {
        let measure = |share: Share| {
            if by_bytes {
                share.bytes
            } else {
                share.sessions
            }
        };
        let mut giver = caller;
        let mut most = measure(self.share(caller));
        for (principal, share) in &self.principals {
            if measure(*share) > most {
                most = measure(*share);
                giver = principal;
            }
        }
        self.by_expiry
            .iter()
            .find(|(_, id)| id != keep && principal_of(id) == giver)
            .cloned()
    }
}

#[async_trait::async_trait]
impl SessionStore for InMemorySessionStore {
    async fn history(&self, session_id: &str) -> StateResult<Vec<Arc<Exchange>>> {
        let now = Instant::now();
        let mut inner = self.lock();
        inner.expire(now);
        inner.extend(session_id, now + self.limits.ttl);
        Ok(inner
            .sessions
            .get(session_id)
            .map(|s| s.exchanges.iter().map(|(e, _)| e.clone()).collect())
            .unwrap_or_default())
    }

    async fn keep(&self, session_id: &str, wait: Duration) -> StateResult<()> {
        let now = Instant::now();
        let mut inner = self.lock();
        inner.expire(now);
        inner.extend(session_id, now + wait + self.limits.ttl);
        Ok(())
    }

    async fn append(&self, session_id: &str, exchange: Arc<Exchange>) -> StateResult<()> {
        let now = Instant::now();
        let expires_at = now + self.limits.ttl;
        let mut inner = self.lock();
        inner.expire(now);
        let previous = inner.sessions.get(session_id).map(|s| s.expires_at);
        // Never shorter than it was kept for (a run of it may wait).
        let expires_at = previous.map_or(expires_at, |previous| previous.max(expires_at));
        let caller = principal_of(session_id);
        if let Some(previous) = previous {
            inner.by_expiry.remove(&(previous, session_id.to_owned()));
        } else {
            // Room for one more session: the least recently used goes, but never another
            // principal's for a principal holding as many as it or more.
            while inner.sessions.len() >= self.limits.max_sessions.max(1) {
                let Some(victim) = inner.victim(caller, session_id, false) else {
                    break;
                };
                inner.by_expiry.remove(&victim);
                inner.forget(&victim.1);
            }
        }
        let bytes = weight(&exchange);
        // Room in bytes: the least recently used other sessions go first, as above by
        // bytes; then this session's own oldest exchanges (below).
        while inner.bytes.saturating_add(bytes) > self.limits.max_bytes {
            let Some(victim) = inner.victim(caller, session_id, true) else {
                break;
            };
            inner.by_expiry.remove(&victim);
            inner.forget(&victim.1);
        }
        inner.by_expiry.insert((expires_at, session_id.to_owned()));
        let Inner {
            sessions,
            bytes: total,
            principals,
            ..
        } = &mut *inner;
        let share = principals.entry(caller.to_owned()).or_default();
        let session = sessions.entry(session_id.to_owned()).or_insert_with(|| {
            share.sessions += 1;
            Session {
                exchanges: VecDeque::new(),
                bytes: 0,
                expires_at,
            }
        });
        session.expires_at = expires_at;
        session.exchanges.push_back((exchange, bytes));
        session.bytes += bytes;
        share.bytes += bytes;
        *total += bytes;
        // Then its own oldest exchanges, beyond the count or the bytes, its own or all
        // sessions' (the newest stays).
        while session.exchanges.len() > self.limits.max_exchanges.max(1)
            || ((*total > self.limits.max_bytes || session.bytes > self.limits.max_history_bytes)
                && session.exchanges.len() > 1)
        {
            if let Some((_, dropped)) = session.exchanges.pop_front() {
                *total = total.saturating_sub(dropped);
                session.bytes = session.bytes.saturating_sub(dropped);
                share.bytes = share.bytes.saturating_sub(dropped);
            }
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
            kept_ms: 0,
        }
    }

    #[tokio::test(start_paused = true)]
    async fn sessions_are_bounded_in_time_count_and_length() {
        let store = InMemorySessionStore::new(SessionLimits {
            ttl: Duration::from_secs(60),
            max_sessions: 2,
            max_exchanges: 3,
            max_bytes: usize::MAX,
            max_history_bytes: usize::MAX,
        });
        for n in 0..5 {
            store.append("a", exchange(n).into()).await.unwrap();
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
        store.append("b", exchange(0).into()).await.unwrap();
        tokio::time::advance(Duration::from_secs(1)).await;
        store.append("c", exchange(0).into()).await.unwrap();
        assert!(
            store.history("a").await.unwrap().is_empty(),
            "the least recently used session made room"
        );
        assert_eq!(store.sessions(), 2);

        tokio::time::advance(Duration::from_secs(61)).await;
        assert_eq!(store.sessions(), 0, "unused sessions expire");
    }

    fn said(text: &str) -> Exchange {
        Exchange {
            messages: vec![ChatMessage::User(text.into())],
            tokens: 1,
            kept_ms: 0,
        }
    }

    #[tokio::test(start_paused = true)]
    async fn sessions_are_bounded_in_bytes_least_recently_used_first() {
        let one = weight(&said(&"x".repeat(1000)));
        let store = InMemorySessionStore::new(SessionLimits {
            max_bytes: one * 3,
            ..SessionLimits::default()
        });
        for session in ["a", "b", "c"] {
            store
                .append(session, said(&"x".repeat(1000)).into())
                .await
                .unwrap();
            tokio::time::advance(Duration::from_secs(1)).await;
        }
        // Read (a run of it started): used last, then.
        store.history("a").await.unwrap();
        store
            .append("d", said(&"x".repeat(1000)).into())
            .await
            .unwrap();
        assert!(
            store.history("b").await.unwrap().is_empty(),
            "the least recently used session made room"
        );
        for session in ["a", "c", "d"] {
            assert_eq!(store.history(session).await.unwrap().len(), 1, "{session}");
        }
        // One session past the budget alone keeps its newest exchanges that fit.
        for _ in 0..5 {
            store
                .append("d", said(&"x".repeat(1000)).into())
                .await
                .unwrap();
        }
        assert_eq!(store.history("d").await.unwrap().len(), 3);
        assert_eq!(store.sessions(), 1);
        store
            .append("e", said(&"y".repeat(5000)).into())
            .await
            .unwrap();
        assert_eq!(
            store.history("e").await.unwrap().len(),
            1,
            "the newest stays"
        );
    }

    /// A principal filling the store drops its own sessions, not another's that holds
    /// less: in sessions, and in bytes.
    #[tokio::test(start_paused = true)]
    async fn one_principal_does_not_push_out_anothers_sessions() {
        let text = "x".repeat(1000);
        let one = weight(&said(&text));
        let store = InMemorySessionStore::new(SessionLimits {
            max_sessions: 3,
            max_bytes: one * 4,
            ..SessionLimits::default()
        });
        store
            .append("alice/chat", said(&text).into())
            .await
            .unwrap();
        tokio::time::advance(Duration::from_secs(1)).await;
        for n in 0..6 {
            store
                .append(&format!("bob/s{n}"), said(&text).into())
                .await
                .unwrap();
            tokio::time::advance(Duration::from_secs(1)).await;
        }
        assert_eq!(store.history("alice/chat").await.unwrap().len(), 1);
        assert_eq!(store.sessions(), 3);
        assert_eq!(store.history("bob/s5").await.unwrap().len(), 1);
        assert!(store.history("bob/s0").await.unwrap().is_empty());
        // In bytes: bob's one long session gives its own oldest exchanges.
        for _ in 0..6 {
            store.append("bob/s5", said(&text).into()).await.unwrap();
        }
        assert_eq!(store.history("alice/chat").await.unwrap().len(), 1);
        assert!(store.history("bob/s5").await.unwrap().len() <= 3);
        // A new principal makes room at the cost of the one holding the most.
        store.append("carol/c", said(&text).into()).await.unwrap();
        assert_eq!(store.history("carol/c").await.unwrap().len(), 1);
        assert_eq!(store.history("alice/chat").await.unwrap().len(), 1);
        assert!(store.history("bob/s5").await.unwrap().is_empty());
    }
}
