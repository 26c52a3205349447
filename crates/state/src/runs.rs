//! Run records, idempotency keys and stop requests.

use std::{
    collections::{HashMap, VecDeque},
    pin::Pin,
    sync::{Mutex, MutexGuard, PoisonError},
    time::Duration,
};

use agentrt_core::{StateError, StateResult};
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

/// The right to execute a run, held by one replica at a time: its owner writes the run's
/// events and record with `token`, and renews it; when it lapses (the owner died) or is
/// let go (the owner shuts down), another replica takes the run over with a token of its
/// own, and writes with the old one are refused.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Lease {
    /// The run.
    pub run_id: String,
    /// Its owner's token.
    pub token: String,
}

/// What a replica needs to continue a run another one executed: written by the engine
/// at its checkpoints, opaque to the store (JSON the engine reads back).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Progress {
    /// What the run is (its ids, query and context); written with the first record.
    pub spec: Option<String>,
    /// The agent's config and tools, written with the first record: what the runs of one
    /// agent share, however many engines and sessions run it. Stores keep one copy of each
    /// (by [`agent_id`]) as long as one of its runs may be continued.
    pub agent: Option<String>,
    /// The step machine's state, without the turn's messages.
    pub state: String,
    /// The turn's messages from `first_message` on (those before are as last saved).
    pub messages: Vec<String>,
    /// The index of `messages[0]` in the turn.
    pub first_message: usize,
    /// With a record that waits ([`RunStatus::RequiresAction`](crate::RunStatus)): how
    /// long the wait may last. The save lets the run's lease go (nobody executes a waiting
    /// run) until every pending call is answered, the run is cancelled, or this elapses;
    /// then any replica takes it over.
    pub wait: Option<Duration>,
}

/// What a waiting run was told while it waited, as a replica taking it over reads it.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Answers {
    /// The answers that arrived, by call id (opaque to the store: JSON the engine reads).
    pub answers: HashMap<String, String>,
    /// Whether the run was cancelled while it waited.
    pub cancelled: bool,
}

/// The outcome of [`RunStore::answer`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Answered {
    /// The answers are kept (an answer for a call answered already changes nothing).
    Accepted {
        /// The pending calls still without an answer.
        left: Vec<String>,
        /// Whether these answers were the last ones missing: the run may go on now (its
        /// lease lapses at once, for whichever replica takes it first).
        completed: bool,
    },
    /// The run does not wait (any more, or at all), and the answers are not ones it
    /// received while it waited.
    NotWaiting,
    /// The run waits, but not for this call.
    NotPending(String),
    /// This call was answered already, with another answer (the first one stands).
    Conflict(String),
}

/// A run taken over: its record (with its steps) and what continuing it needs.
#[derive(Debug, Clone, PartialEq)]
pub struct Resumable {
    /// The record as last saved; its `owner` is the new token.
    pub record: RunRecord,
    /// [`Progress::spec`].
    pub spec: String,
    /// [`Progress::agent`] (empty when the store has none: the spec of a run saved
    /// before agents were kept apart carries it).
    pub agent: String,
    /// [`Progress::state`] as last saved.
    pub state: String,
    /// Every message of the turn saved so far.
    pub messages: Vec<String>,
    /// The token of the owner it was taken from.
    pub previous_owner: String,
    /// Whether that owner let it go (it shut down) rather than let its lease lapse.
    pub handed_over: bool,
    /// For a run that waited ([`RunStatus::RequiresAction`](crate::RunStatus)): what it
    /// was told meanwhile.
    pub waited: Option<Answers>,
}

/// The name stores keep an agent ([`Progress::agent`]) under: a digest of its text
/// (128 bits of SHA-256, in hex), the same on every replica.
pub fn agent_id(agent: &str) -> String {
    use std::fmt::Write;
    let digest = ring::digest::digest(&ring::digest::SHA256, agent.as_bytes());
    digest.as_ref()[..16]
        .iter()
        .fold(String::with_capacity(32), |mut hex, byte| {
            let _ = write!(hex, "{byte:02x}");
            hex
        })
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
    /// steps before are as last saved), with `progress` when given. A record that has
    /// ended is kept for the retention (its progress is dropped). With an `owner`, the
    /// first save takes the run's lease for it, and a save from an owner that no longer
    /// holds the lease (or of a run that ended meanwhile) fails with
    /// [`StateError::Fenced`](agentrt_core::StateError::Fenced), writing nothing.
    async fn save(
        &self,
        record: &RunRecord,
        from_step: usize,
        progress: Option<&Progress>,
    ) -> StateResult<()>;

    /// Renews `leases` (in one call, whatever their number); answers the runs among them
    /// whose lease was lost: taken over by another replica, or ended.
    async fn renew(&self, leases: &[Lease]) -> StateResult<Vec<String>>;

    /// Lets `leases` go at once: other replicas may take the runs over now.
    async fn release(&self, leases: &[Lease]) -> StateResult<()>;

    /// Runs whose lease lapsed or was let go, at most `limit`, longest lapsed first.
    async fn lapsed(&self, limit: usize) -> StateResult<Vec<String>>;

    /// Takes `run_id` over for `token` when its lease has lapsed or was let go: exactly one
    /// of several replicas trying at once gets it. `None` when the run is not to be taken
    /// (its lease holds, it ended, or another replica got it).
    async fn take_over(&self, run_id: &str, token: &str) -> StateResult<Option<Resumable>>;

    /// Keeps answers (call id, answer) for the calls waiting run `run_id` waits for,
    /// checking every call id first (nothing is kept when one is not pending). Exactly one
    /// of several callers answering at once gets `completed`.
    async fn answer(&self, run_id: &str, answers: &[(String, String)]) -> StateResult<Answered>;

    /// Cancels waiting run `run_id`: its lease lapses at once, and the replica that takes
    /// it over ends it cancelled. False when the run does not wait.
    async fn cancel_waiting(&self, run_id: &str) -> StateResult<bool>;

    /// The run's record, while it runs and for the retention after it ended; for a
    /// waiting run, each pending call says whether it was answered.
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

/// How long records and leases are kept.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RunRetention {
    /// How long an ended run stays readable.
    pub ended: Duration,
    /// How long a lease lasts without being renewed.
    pub lease: Duration,
    /// Most bytes of ended runs' records kept (by the in-memory store); beyond, the runs
    /// that ended first are forgotten before their retention is over.
    pub max_bytes: usize,
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
    /// Ended runs in the order they ended, with what their records weigh.
    ended: VecDeque<(Instant, String, usize)>,
    /// What the records of `ended` weigh, all together.
    ended_bytes: usize,
    /// The leases of running and waiting runs.
    leases: Leases,
    /// What continuing each running run needs.
    progress: HashMap<String, Continuation>,
    /// The agents of the runs in `progress`, by [`agent_id`], with how many runs use each.
    agents: HashMap<String, (String, usize)>,
    /// The waits of runs that wait or waited, until their record expires.
    waits: HashMap<String, Wait>,
}

/// Leases by run, and in the order they lapse: looking for lapsed ones costs what they
/// number, not what all leases number (100,000 waiting runs are 100,000 leases).
#[derive(Default)]
struct Leases {
    /// Token (empty while the run waits), when it lapses, whether it was let go.
    by_run: HashMap<String, (String, Instant, bool)>,
    by_time: std::collections::BTreeSet<(Instant, String)>,
}

impl Leases {
    fn token(&self, run_id: &str) -> Option<&str> {
        self.by_run.get(run_id).map(|(token, ..)| token.as_str())
    }

    fn set(&mut self, run_id: &str, token: String, at: Instant, released: bool) {
        if let Some((_, old, _)) = self.by_run.insert(run_id.to_owned(), (token, at, released)) {
            self.by_time.remove(&(old, run_id.to_owned()));
        }
        self.by_time.insert((at, run_id.to_owned()));
    }

    fn remove(&mut self, run_id: &str) {
        if let Some((_, at, _)) = self.by_run.remove(run_id) {
            self.by_time.remove(&(at, run_id.to_owned()));
        }
    }

    /// Moves the lease of `run_id` (held by `token`, when given) to lapse at `at`; false
    /// when there is no such lease.
    /// `released` says whether it was let go (`None`: as it was).
    fn moved(
        &mut self,
        run_id: &str,
        token: Option<&str>,
        at: Instant,
        released: Option<bool>,
    ) -> bool {
        let Some((held, old, was)) = self.by_run.get_mut(run_id) else {
            return false;
        };
        if token.is_some_and(|token| token != held) {
            return false;
        }
        let previous = std::mem::replace(old, at);
        if let Some(released) = released {
            *was = released;
        }
        self.by_time.remove(&(previous, run_id.to_owned()));
        self.by_time.insert((at, run_id.to_owned()));
        true
    }

    fn lapsed(&self, now: Instant, limit: usize) -> Vec<String> {
        self.by_time
            .iter()
            .take_while(|(at, _)| *at <= now)
            .take(limit)
            .map(|(_, run_id)| run_id.clone())
            .collect()
    }
}

/// What continuing a run needs ([`Progress`], as kept).
#[derive(Default)]
struct Continuation {
    spec: String,
    /// The [`agent_id`] of its agent (empty when it was saved without one).
    agent: String,
    state: String,
    messages: Vec<String>,
}

/// What a waiting run was told.
#[derive(Default)]
struct Wait {
    /// Each pending call, in call order, with its answer once it came.
    answers: Vec<(String, Option<String>)>,
    cancelled: bool,
    /// Set when a replica took the run over: it waits no more.
    taken: bool,
}

/// What a record weighs in memory: its text, and a little for each part.
fn weight(record: &RunRecord) -> usize {
    const PER_ITEM: usize = 64;
    let steps: usize = record
        .steps
        .iter()
        .map(|step| {
            PER_ITEM
                + step.thought.len()
                + step.answer.len()
                + step
                    .tool_calls
                    .iter()
                    .map(|call| {
                        PER_ITEM
                            + call.id.len()
                            + call.name.len()
                            + call.arguments.as_str().len()
                            + call.output.len()
                    })
                    .sum::<usize>()
        })
        .sum();
    4 * PER_ITEM
        + record.run_id.len()
        + record.engine_id.len()
        + record.session_id.len()
        + record.message_id.len()
        + record.query.len()
        + record.final_answer.len()
        + record.error.as_ref().map_or(0, |e| e.message.len())
        + steps
}

impl Inner {
    fn expire(&mut self, retention: RunRetention) {
        let now = Instant::now();
        while let Some((at, _, bytes)) = self.ended.front() {
            if now.duration_since(*at) < retention.ended && self.ended_bytes <= retention.max_bytes
            {
                break;
            }
            self.ended_bytes = self.ended_bytes.saturating_sub(*bytes);
            if let Some((_, run_id, _)) = self.ended.pop_front()
                && let Some(record) = self.records.remove(&run_id)
            {
                self.waits.remove(&run_id);
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
        inner.expire(self.retention);
        let key = (session_id.to_owned(), message_id.to_owned());
        match inner.keys.get(&key) {
            Some(holder) if Some(holder.as_str()) != replacing => Ok(Claim::Taken(holder.clone())),
            _ => {
                inner.keys.insert(key, run_id.to_owned());
                Ok(Claim::Claimed)
            }
        }
    }

    async fn save(
        &self,
        record: &RunRecord,
        from_step: usize,
        progress: Option<&Progress>,
    ) -> StateResult<()> {
        let mut inner = self.lock();
        inner.expire(self.retention);
        if !record.owner.is_empty() {
            match inner.leases.token(&record.run_id) {
                Some(token) if token != record.owner => {
                    return Err(StateError::Fenced(record.run_id.clone()));
                }
                Some(_) => {}
                None if inner.records.contains_key(&record.run_id) => {
                    return Err(StateError::Fenced(record.run_id.clone()));
                }
                None => {
                    let lapses = Instant::now() + self.retention.lease;
                    inner
                        .leases
                        .set(&record.run_id, record.owner.clone(), lapses, false);
                }
            }
        }
        if record.ended() {
            inner.leases.remove(&record.run_id);
            if let Some(continuation) = inner.progress.remove(&record.run_id)
                && let Some((_, users)) = inner.agents.get_mut(&continuation.agent)
            {
                *users -= 1;
                if *users == 0 {
                    inner.agents.remove(&continuation.agent);
                }
            }
            if let Some(wait) = inner.waits.get_mut(&record.run_id) {
                wait.taken = true;
            }
        } else if let Some(progress) = progress {
            let new_agent = match &progress.agent {
                Some(json) if !inner.progress.contains_key(&record.run_id) => {
                    let id = agent_id(json);
                    let (_, users) = inner
                        .agents
                        .entry(id.clone())
                        .or_insert_with(|| (json.clone(), 0));
                    *users += 1;
                    Some(id)
                }
                _ => None,
            };
            let entry = inner.progress.entry(record.run_id.clone()).or_default();
            if let Some(id) = new_agent {
                entry.agent = id;
            }
            if let Some(spec) = &progress.spec {
                entry.spec.clone_from(spec);
            }
            entry.state.clone_from(&progress.state);
            entry.messages.truncate(progress.first_message);
            entry.messages.extend(progress.messages.iter().cloned());
            if record.waiting() {
                // Nobody executes the run until it is answered, cancelled or out of time.
                let lapses = Instant::now() + progress.wait.unwrap_or(self.retention.lease);
                inner
                    .leases
                    .set(&record.run_id, String::new(), lapses, false);
                let wait = Wait {
                    answers: record
                        .pending
                        .iter()
                        .map(|p| (p.id.clone(), None))
                        .collect(),
                    ..Wait::default()
                };
                inner.waits.insert(record.run_id.clone(), wait);
            }
        }
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
            let bytes = inner.records.get(&record.run_id).map_or(0, weight);
            inner.ended_bytes += bytes;
            inner
                .ended
                .push_back((Instant::now(), record.run_id.clone(), bytes));
            inner.expire(self.retention);
        }
        Ok(())
    }

    async fn load(&self, run_id: &str) -> StateResult<Option<RunRecord>> {
        let mut inner = self.lock();
        inner.expire(self.retention);
        let Some(mut record) = inner.records.get(run_id).cloned() else {
            return Ok(None);
        };
        if record.waiting()
            && let Some(wait) = inner.waits.get(run_id)
        {
            for call in &mut record.pending {
                call.answered = wait
                    .answers
                    .iter()
                    .any(|(id, answer)| *id == call.id && answer.is_some());
            }
        }
        Ok(Some(record))
    }

    async fn answer(&self, run_id: &str, answers: &[(String, String)]) -> StateResult<Answered> {
        let mut inner = self.lock();
        let Some(wait) = inner.waits.get_mut(run_id) else {
            return Ok(Answered::NotWaiting);
        };
        let kept = |wait: &Wait, id: &str| -> Option<String> {
            wait.answers
                .iter()
                .find(|(pending, _)| pending == id)
                .and_then(|(_, answer)| answer.clone())
        };
        let complete = wait.answers.iter().all(|(_, a)| a.is_some());
        if wait.taken || wait.cancelled || complete {
            // A repeat of an answer the run received is accepted; anything else is late.
            if wait.cancelled {
                return Ok(Answered::NotWaiting);
            }
            for (id, answer) in answers {
                match kept(wait, id) {
                    Some(first) if first == *answer => {}
                    Some(_) => return Ok(Answered::Conflict(id.clone())),
                    None => return Ok(Answered::NotWaiting),
                }
            }
            return Ok(Answered::Accepted {
                left: Vec::new(),
                completed: false,
            });
        }
        if let Some((id, _)) = answers
            .iter()
            .find(|(id, _)| !wait.answers.iter().any(|(pending, _)| pending == id))
        {
            return Ok(Answered::NotPending(id.clone()));
        }
        if let Some((id, _)) = answers
            .iter()
            .find(|(id, answer)| kept(wait, id).is_some_and(|first| first != *answer))
        {
            return Ok(Answered::Conflict(id.clone()));
        }
        for (id, answer) in answers {
            if let Some((_, slot)) = wait.answers.iter_mut().find(|(pending, _)| pending == id)
                && slot.is_none()
            {
                *slot = Some(answer.clone());
            }
        }
        let left: Vec<String> = wait
            .answers
            .iter()
            .filter(|(_, a)| a.is_none())
            .map(|(id, _)| id.clone())
            .collect();
        let completed = left.is_empty();
        if completed {
            inner.leases.moved(run_id, None, Instant::now(), Some(true));
        }
        Ok(Answered::Accepted { left, completed })
    }

    async fn cancel_waiting(&self, run_id: &str) -> StateResult<bool> {
        let mut inner = self.lock();
        let Some(wait) = inner.waits.get_mut(run_id) else {
            return Ok(false);
        };
        if wait.taken || wait.cancelled {
            return Ok(false);
        }
        wait.cancelled = true;
        inner.leases.moved(run_id, None, Instant::now(), Some(true));
        Ok(true)
    }

    async fn renew(&self, leases: &[Lease]) -> StateResult<Vec<String>> {
        let mut inner = self.lock();
        let lapses = Instant::now() + self.retention.lease;
        let mut lost = Vec::new();
        for lease in leases {
            if !inner
                .leases
                .moved(&lease.run_id, Some(&lease.token), lapses, None)
            {
                lost.push(lease.run_id.clone());
            }
        }
        Ok(lost)
    }

    async fn release(&self, leases: &[Lease]) -> StateResult<()> {
        let mut inner = self.lock();
        let now = Instant::now();
        for lease in leases {
            inner
                .leases
                .moved(&lease.run_id, Some(&lease.token), now, Some(true));
        }
        Ok(())
    }

    async fn lapsed(&self, limit: usize) -> StateResult<Vec<String>> {
        Ok(self.lock().leases.lapsed(Instant::now(), limit))
    }

    async fn take_over(&self, run_id: &str, token: &str) -> StateResult<Option<Resumable>> {
        let mut inner = self.lock();
        let now = Instant::now();
        if !inner.progress.contains_key(run_id) || !inner.records.contains_key(run_id) {
            return Ok(None);
        }
        let (previous_owner, handed_over) = match inner.leases.by_run.get(run_id) {
            Some((owner, at, released)) if *at <= now => (owner.clone(), *released),
            _ => return Ok(None),
        };
        inner
            .leases
            .set(run_id, token.to_owned(), now + self.retention.lease, false);
        let (Some(record), Some(continuation)) =
            (inner.records.get(run_id), inner.progress.get(run_id))
        else {
            return Ok(None);
        };
        let mut record = record.clone();
        token.clone_into(&mut record.owner);
        let agent = inner
            .agents
            .get(&continuation.agent)
            .map(|(json, _)| json.clone())
            .unwrap_or_default();
        let mut resumable = Resumable {
            record,
            spec: continuation.spec.clone(),
            agent,
            state: continuation.state.clone(),
            messages: continuation.messages.clone(),
            previous_owner,
            handed_over,
            waited: None,
        };
        if let Some(wait) = inner.waits.get_mut(run_id)
            && !wait.taken
        {
            wait.taken = true;
            resumable.waited = Some(Answers {
                answers: wait
                    .answers
                    .iter()
                    .filter_map(|(id, answer)| Some((id.clone(), answer.clone()?)))
                    .collect(),
                cancelled: wait.cancelled,
            });
        }
        Ok(Some(resumable))
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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::RunStatus;

    #[tokio::test]
    async fn ended_runs_beyond_the_byte_budget_go_first_ended_first() {
        let ended = |id: &str| {
            let mut record = RunRecord::new(id, "e", "s", id, &"q".repeat(10_000));
            record.status = RunStatus::Succeeded;
            record
        };
        let one = weight(&ended("r0"));
        let store = MemoryRunStore::new(RunRetention {
            ended: Duration::from_secs(600),
            lease: Duration::from_secs(10),
            max_bytes: one * 3,
        });
        let running = RunRecord::new("live", "e", "s", "live", &"q".repeat(10_000));
        store.save(&running, 0, None).await.unwrap();
        for id in ["r0", "r1", "r2", "r3", "r4"] {
            store.save(&ended(id), 0, None).await.unwrap();
        }
        for (id, kept) in [
            ("r0", false),
            ("r1", false),
            ("r2", true),
            ("r3", true),
            ("r4", true),
            ("live", true),
        ] {
            assert_eq!(store.load(id).await.unwrap().is_some(), kept, "{id}");
        }
    }
}
