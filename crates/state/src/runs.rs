//! Run records, idempotency keys and stop requests.

use std::{
    collections::{HashMap, VecDeque},
    pin::Pin,
    sync::{Mutex, MutexGuard, PoisonError},
    time::Duration,
};

use agentrt_core::StateResult;
use futures_util::Stream;
use tokio::{sync::broadcast, time::Instant};

use crate::record::{RunRecord, StepRecord, StopReason};

/// The outcome of [`RunStore::claim`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Claim {
    /// The key is now the run's.
    Claimed,
    /// Another run holds the key.
    Taken(String),
}

/// A request, made on any replica, to stop a run.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StopRequest {
    /// The run.
    pub run_id: String,
    /// Why.
    pub reason: StopReason,
}

/// Stop requests as they are made.
pub type StopRequests = Pin<Box<dyn Stream<Item = StopRequest> + Send>>;

/// Where runs are known: their records (for `GetRun`), the idempotency keys of `Execute`
/// (a session's message id names one run), and the stop requests that reach the replica
/// executing a run from whichever replica a client asked.
#[async_trait::async_trait]
pub trait RunStore: Send + Sync {
    /// Claims the message id `message_id` of `session_id` for `run_id`. When another run
    /// holds it, answers [`Claim::Taken`] with that run; with `replacing`, takes it from
    /// that run instead, provided that run still holds it. Exactly one of several replicas
    /// claiming one key at once gets it.
    async fn claim(
        &self,
        session_id: &str,
        message_id: &str,
        run_id: &str,
        replacing: Option<&str>,
    ) -> StateResult<Claim>;

    /// Writes `record`: the steps from `from_step` on, and the rest of the record (the
    /// steps before are as last saved). A record that has ended is kept for the retention.
    async fn save(&self, record: &RunRecord, from_step: usize) -> StateResult<()>;

    /// The run's record, while it runs and for the retention after it ended.
    async fn load(&self, run_id: &str) -> StateResult<Option<RunRecord>>;

    /// Asks the replica executing `run_id` to stop it (at once, wherever it runs).
    async fn request_stop(&self, run_id: &str, reason: StopReason) -> StateResult<()>;

    /// The stop requests made from now on, on any replica.
    async fn stop_requests(&self) -> StateResult<StopRequests>;
}

/// The stop requests a broadcast receiver gets, as a stream; requests a slow receiver
/// missed are skipped (the run they name is stopped through its own replica's receiver).
pub(crate) fn stop_stream(receiver: broadcast::Receiver<StopRequest>) -> StopRequests {
    Box::pin(futures_util::stream::unfold(
        receiver,
        |mut receiver| async move {
            loop {
                match receiver.recv().await {
                    Ok(request) => return Some((request, receiver)),
                    Err(broadcast::error::RecvError::Lagged(_)) => continue,
                    Err(broadcast::error::RecvError::Closed) => return None,
                }
            }
        },
    ))
}

/// How long records are kept.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RunRetention {
    /// How long an ended run stays readable.
    pub ended: Duration,
}

/// Runs kept in this process.
pub struct MemoryRunStore {
    retention: RunRetention,
    inner: Mutex<Inner>,
    stops: broadcast::Sender<StopRequest>,
}

#[derive(Default)]
struct Inner {
    records: HashMap<String, RunRecord>,
    keys: HashMap<(String, String), String>,
    /// Ended runs in the order they ended.
    ended: VecDeque<(Instant, String)>,
}

impl Inner {
    fn expire(&mut self, retention: Duration) {
        let now = Instant::now();
        while let Some((at, _)) = self.ended.front() {
            if now.duration_since(*at) < retention {
                break;
            }
            if let Some((_, run_id)) = self.ended.pop_front()
                && let Some(record) = self.records.remove(&run_id)
            {
                let key = (record.session_id, record.message_id);
                if self.keys.get(&key) == Some(&run_id) {
                    self.keys.remove(&key);
                }
            }
        }
    }
}

impl MemoryRunStore {
    /// A store keeping ended runs for `retention`.
    pub fn new(retention: RunRetention) -> Self {
        Self {
            retention,
            inner: Mutex::new(Inner::default()),
            stops: broadcast::channel(1024).0,
        }
    }

    fn lock(&self) -> MutexGuard<'_, Inner> {
        // Each critical section leaves the maps consistent before anything can panic.
        self.inner.lock().unwrap_or_else(PoisonError::into_inner)
    }
}

#[async_trait::async_trait]
impl RunStore for MemoryRunStore {
    async fn claim(
        &self,
        session_id: &str,
        message_id: &str,
        run_id: &str,
        replacing: Option<&str>,
    ) -> StateResult<Claim> {
        let mut inner = self.lock();
        inner.expire(self.retention.ended);
        let key = (session_id.to_owned(), message_id.to_owned());
        match inner.keys.get(&key) {
            Some(holder) if Some(holder.as_str()) != replacing => Ok(Claim::Taken(holder.clone())),
            _ => {
                inner.keys.insert(key, run_id.to_owned());
                Ok(Claim::Claimed)
            }
        }
    }

    async fn save(&self, record: &RunRecord, from_step: usize) -> StateResult<()> {
        let mut inner = self.lock();
        inner.expire(self.retention.ended);
        let newly_ended = record.ended()
            && inner
                .records
                .get(&record.run_id)
                .is_none_or(|stored| !stored.ended());
        let steps: Vec<StepRecord> = match inner.records.remove(&record.run_id) {
            Some(mut stored) => {
                stored.steps.truncate(from_step);
                stored
                    .steps
                    .extend(record.steps.iter().skip(from_step).cloned());
                stored.steps
            }
            None => record.steps.clone(),
        };
        let mut stored = record.without_steps();
        stored.steps = steps;
        inner.records.insert(record.run_id.clone(), stored);
        if newly_ended {
            inner
                .ended
                .push_back((Instant::now(), record.run_id.clone()));
        }
        Ok(())
    }

    async fn load(&self, run_id: &str) -> StateResult<Option<RunRecord>> {
        let mut inner = self.lock();
        inner.expire(self.retention.ended);
        Ok(inner.records.get(run_id).cloned())
    }

    async fn request_stop(&self, run_id: &str, reason: StopReason) -> StateResult<()> {
        // No receiver means no run can be stopped here: nothing to do.
        let _ = self.stops.send(StopRequest {
            run_id: run_id.to_owned(),
            reason,
        });
        Ok(())
    }

    async fn stop_requests(&self) -> StateResult<StopRequests> {
        Ok(stop_stream(self.stops.subscribe()))
    }
}
