//! Run records, idempotency keys and stop requests.

use std::{
    collections::{HashMap, VecDeque},
    pin::Pin,
    sync::{Arc, LazyLock, Mutex, MutexGuard, PoisonError},
    time::Duration,
};

use agentrt_context::{Exchange, SessionStore};
use agentrt_core::{StateError, StateResult, packed::Packer};
use agentrt_events::{BusError, EventKind, RunEvent, RunPublisher};
use futures_util::Stream;
use serde::{Deserialize, Serialize};
use tokio::{sync::broadcast, time::Instant};

use crate::{
    engines::principal_of,
    record::{RunRecord, StepRecord, StopReason},
};

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
    /// A stop requested for the run ([`RunStore::request_stop`]) that its owner may not
    /// have seen: the run is to end for it at once.
    pub stop: Option<StopReason>,
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

/// The ids ([`agent_id`]) of the agents saved last, so that the runs of one agent hash
/// its text once rather than at every run's first save.
#[derive(Default)]
pub(crate) struct AgentIds(Mutex<VecDeque<(String, String)>>);

/// How many agents [`AgentIds`] remembers.
const AGENT_IDS_KEPT: usize = 16;

impl AgentIds {
    /// [`agent_id`] of `agent`.
    pub(crate) fn of(&self, agent: &str) -> String {
        {
            let mut known = self.known();
            if let Some(at) = known.iter().position(|(text, _)| text == agent) {
                let entry = known.remove(at).unwrap_or_default();
                let id = entry.1.clone();
                known.push_front(entry);
                return id;
            }
        }
        // Hashed without the lock, which other runs' saves take.
        let id = agent_id(agent);
        let mut known = self.known();
        if !known.iter().any(|(text, _)| text == agent) {
            known.truncate(AGENT_IDS_KEPT - 1);
            known.push_front((agent.to_owned(), id.clone()));
        }
        id
    }

    fn known(&self) -> MutexGuard<'_, VecDeque<(String, String)>> {
        self.0.lock().unwrap_or_else(PoisonError::into_inner)
    }
}

/// Why a checkpoint ([`RunStore::checkpoint`]) failed.
#[derive(Debug, Clone)]
pub enum CheckpointError {
    /// Neither the events nor the record were written.
    Events(BusError),
    /// The record was written, the events were not (a store apart from the bus).
    EventsAfterRecord(BusError),
    /// The events were written, the record was not.
    Record(StateError),
    /// Nothing was written: the run's turn could not be kept in its session's history
    /// ([`RunStore::end`]).
    Turn(StateError),
}

/// A checkpoint written as two calls (with a remote store they share the wait): the
/// events through `publisher`, the record through `store`. Both are tried whatever the
/// other's outcome. Sent at once, except a run's end and its waits: the record is saved
/// before the `done` or `ACTION_REQUIRED` event is published, so that a reader who sees
/// it and asks for the run sees it ended, or waiting.
pub async fn checkpoint_apart<S: RunStore + ?Sized>(
    store: &S,
    publisher: &dyn RunPublisher,
    events: Vec<RunEvent>,
    record: &RunRecord,
    from_step: usize,
    progress: Option<&Progress>,
) -> Result<(), CheckpointError> {
    // The record before the events when they end the run or ask for answers: a client
    // that sees `done` or ACTION_REQUIRED and asks GetRun sees the end or the wait.
    let ends = events.last().is_some_and(|event| event.done) || record.waiting();
    let publish = |events: Vec<RunEvent>| async move {
        if events.is_empty() {
            return Ok(());
        }
        publisher.publish(events).await
    };
    let save = store.save(record, from_step, progress);
    let (published, saved) = if ends {
        let saved = save.await;
        let mut events = events;
        // A wait that was not saved (refused by a budget, or the store failed) is not a
        // wait: ACTION_REQUIRED would have the client act (run its tool, ask a person) for
        // a run that cannot be answered. The rest of the round's events go out; the run
        // then ends with the failure.
        if saved.is_err() && record.waiting() {
            events.retain(|event| event.kind != EventKind::ActionRequired);
        }
        (publish(events).await, saved)
    } else {
        tokio::join!(publish(events), save)
    };
    match (published, saved) {
        (Ok(()), Ok(())) => Ok(()),
        (Ok(()), Err(error)) => Err(CheckpointError::Record(error)),
        (Err(error), Ok(())) => Err(CheckpointError::EventsAfterRecord(error)),
        (Err(error), Err(_)) => Err(CheckpointError::Events(error)),
    }
}

/// A run's end written as two calls (see [`RunStore::end`]): the turn kept in the
/// session's history first, so that a client that sees `done` finds it there, then the
/// end as [`checkpoint_apart`] writes it. `turn` is taken once it is kept.
pub async fn end_apart<S: RunStore + ?Sized>(
    store: &S,
    publisher: &dyn RunPublisher,
    events: Vec<RunEvent>,
    record: &RunRecord,
    from_step: usize,
    (sessions, turn): (&dyn SessionStore, &mut Option<Arc<Exchange>>),
) -> Result<(), CheckpointError> {
    if let Some(exchange) = turn {
        sessions
            .append(&record.session_id, exchange.clone())
            .await
            .map_err(CheckpointError::Turn)?;
        *turn = None;
    }
    store
        .checkpoint(publisher, events, record, from_step, None)
        .await
}

/// Renews leases, apart from a store's other calls (see [`RunStore::lease_renewer`]).
#[async_trait::async_trait]
pub trait LeaseRenewer: Send + Sync {
    /// Renews `leases` (in one call, whatever their number); answers the runs among them
    /// whose lease was lost: taken over by another replica, or ended.
    async fn renew(&self, leases: &[Lease]) -> StateResult<Vec<String>>;
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

    /// The run that holds the message id `message_id` of `session_id`, if one does;
    /// claims nothing.
    async fn holder(&self, session_id: &str, message_id: &str) -> StateResult<Option<String>>;

    /// Writes `record`: the steps from `from_step` on, and the rest of the record (the
    /// steps before are as last saved), with `progress` when given. A record that has
    /// ended is kept for the retention (its progress is dropped). With an `owner`, the
    /// first save takes the run's lease for it, and a save from an owner that no longer
    /// holds the lease (or of a run that ended meanwhile, or whose keys the store lost)
    /// fails with [`StateError::Fenced`](agentrt_core::StateError::Fenced), writing
    /// nothing; so does the first save of a run whose message id another run holds.
    async fn save(
        &self,
        record: &RunRecord,
        from_step: usize,
        progress: Option<&Progress>,
    ) -> StateResult<()>;

    /// A run's checkpoint: publishes `events` through `publisher` and saves `record` as
    /// [`RunStore::save`] does. A store kept in the same backend as the bus writes both
    /// in one call, whole or not at all, after any events the publisher still holds;
    /// otherwise both are sent at once (see [`checkpoint_apart`]).
    async fn checkpoint(
        &self,
        publisher: &dyn RunPublisher,
        events: Vec<RunEvent>,
        record: &RunRecord,
        from_step: usize,
        progress: Option<&Progress>,
    ) -> Result<(), CheckpointError> {
        checkpoint_apart(self, publisher, events, record, from_step, progress).await
    }

    /// The end of a run that answered: keeps its turn (`turn`) in `sessions`, in the
    /// history of the record's session, and writes the run's last `events` and its ended
    /// `record` as [`RunStore::checkpoint`] does; `turn` is taken once it is kept. A store
    /// kept in the same backend as `sessions` and the bus writes all of it in one call,
    /// whole or not at all: a replica that dies on the way leaves the run to be continued
    /// with no turn kept (its successor keeps its own), never a turn kept twice, nor a
    /// history whose answer is not the run's. Otherwise the turn is kept first (see
    /// [`end_apart`]).
    async fn end(
        &self,
        publisher: &dyn RunPublisher,
        events: Vec<RunEvent>,
        record: &RunRecord,
        from_step: usize,
        turn: (&dyn SessionStore, &mut Option<Arc<Exchange>>),
    ) -> Result<(), CheckpointError> {
        end_apart(self, publisher, events, record, from_step, turn).await
    }

    /// What renews leases ([`LeaseRenewer::renew`]), on a connection of its own, made on
    /// the runtime that calls this. A replica renews its leases from a thread and runtime
    /// of their own with it, so that nothing else it does (hundreds of runs taken over at
    /// once, a busy runtime, commands queued on the shared connection) delays a renewal
    /// past the lease and lets another replica take its runs.
    fn lease_renewer(self: Arc<Self>) -> StateResult<Box<dyn LeaseRenewer>>;

    /// Lets `leases` go at once: other replicas may take the runs over now.
    async fn release(&self, leases: &[Lease]) -> StateResult<()>;

    /// Lets `lease` go `by` from now, for a run taken over that cannot go on here yet:
    /// it lapses then (not handed over), behind the runs that lapsed before. Nothing
    /// when `lease` is no longer the run's.
    async fn defer(&self, lease: &Lease, by: Duration) -> StateResult<()>;

    /// Runs whose lease lapsed or was let go, at most `limit`, longest lapsed first.
    async fn lapsed(&self, limit: usize) -> StateResult<Vec<String>>;

    /// Of the runs whose lease lapsed, at most `limit` whose wait is over without all its
    /// answers (out of time, or cancelled): they end at once, calling no model, so a
    /// replica with no room left for runs that go on still takes them. Looks at most
    /// [`LAPSED_WAITS_SCAN`] times `limit` lapsed runs.
    async fn lapsed_waits(&self, limit: usize) -> StateResult<Vec<String>>;

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

    /// Asks the replica executing `run_id` to stop it (at once, wherever it runs), and
    /// keeps the request for the replica that takes the run over, should its owner be gone
    /// ([`Resumable::stop`]).
    async fn request_stop(&self, run_id: &str, reason: StopReason) -> StateResult<()>;

    /// The stop requests made from now on, on any replica. A request may come more than
    /// once (a store that can miss one while its connection is remade looks again for
    /// those of the runs whose leases it renews).
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

/// How many lapsed runs [`RunStore::lapsed_waits`] looks at, per run it may answer.
pub const LAPSED_WAITS_SCAN: usize = 16;

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
    /// Most bytes the runs waiting for answers hold (packed, with a little for each run),
    /// in the in-memory store; beyond, a run that would wait fails instead
    /// ([`StateError::OverBudget`]), and no waiting run is dropped.
    pub max_waiting_bytes: usize,
    /// Most runs of one named principal waiting at once, in the in-memory store.
    pub max_waiting_per_principal: usize,
}

impl RunRetention {
    /// Retention for `ended` and leases of `lease`, the other bounds unlimited.
    pub fn unbounded(ended: Duration, lease: Duration) -> Self {
        Self {
            ended,
            lease,
            max_bytes: usize::MAX,
            max_waiting_bytes: usize::MAX,
            max_waiting_per_principal: usize::MAX,
        }
    }
}

/// What a waiting run is counted for against [`RunRetention::max_waiting_bytes`] beyond its
/// packed bytes: its entries in the maps.
const WAITING_ENTRY_BYTES: usize = 512;

/// Runs kept in this process.
pub struct MemoryRunStore {
    retention: RunRetention,
    inner: Mutex<Inner>,
    stops: broadcast::Sender<StopRequest>,
}

#[derive(Default)]
struct Inner {
    /// Boxed: a map's table holds room for more entries than it has, and a record is
    /// a few hundred bytes.
    records: HashMap<String, Box<RunRecord>>,
    /// The run that holds each idempotency key, by [`key_digest`].
    keys: HashMap<[u8; 16], Box<str>>,
    /// Ended runs, by [principal](crate::principal_of), each's in the order they ended.
    ended: HashMap<String, Ended>,
    /// What the records of `ended` weigh, all together.
    ended_bytes: usize,
    /// When the first of `ended` ended (the earliest of the principals' first): until the
    /// retention has passed since, and within the budget, nothing is to be forgotten, and
    /// the principals are not looked at.
    first_end: Option<Instant>,
    /// The leases of running and waiting runs.
    leases: Leases,
    /// What continuing each running run needs.
    progress: HashMap<String, Continuation>,
    /// The agents of the runs in `progress`, by [`agent_id`], with how many runs use each.
    agents: HashMap<String, (String, usize)>,
    /// The waits of runs that wait or waited, until their record expires.
    waits: HashMap<String, Wait>,
    /// Runs that wait for answers, packed: their records, continuations, waits and
    /// leases are in none of the maps above (100,000 runs may wait at once, each for
    /// hours), only their idempotency keys and their place in the order of leases.
    parked: HashMap<Arc<str>, ParkedRun>,
    /// What the runs in `parked` weigh ([`WAITING_ENTRY_BYTES`] each and their bytes).
    parked_bytes: usize,
    /// The runs in `parked` of each named principal.
    parked_by_principal: HashMap<String, usize>,
}

/// One principal's ended runs, in the order they ended, with what their records weigh.
#[derive(Default)]
struct Ended {
    runs: VecDeque<(Instant, String, usize)>,
    bytes: usize,
}

/// A run that waits, as [`Inner::parked`] keeps it.
struct ParkedRun {
    /// Its [`Parked`] state.
    packed: Box<[u8]>,
    /// When its lease lapses (its wait ends), and whether it was let go.
    lapses: Instant,
    released: bool,
}

/// The name [`Inner::keys`] keeps the idempotency key of `message_id` in `session_id`
/// under: 128 bits of SHA-256 of both, which no two keys share in practice (a copy of the
/// ids would cost a waiting run a hundred bytes more).
fn key_digest(session_id: &str, message_id: &str) -> [u8; 16] {
    digest_of(&[
        &(session_id.len() as u64).to_le_bytes(),
        session_id.as_bytes(),
        message_id.as_bytes(),
    ])
}

/// The first 128 bits of the SHA-256 of `parts`, one after the other.
fn digest_of(parts: &[&[u8]]) -> [u8; 16] {
    let mut context = ring::digest::Context::new(&ring::digest::SHA256);
    for part in parts {
        context.update(part);
    }
    let mut digest = [0; 16];
    digest.copy_from_slice(&context.finish().as_ref()[..16]);
    digest
}

/// What an answer's digest in [`Wait::earlier`] is.
fn answer_digest(answer: &str) -> [u8; 16] {
    digest_of(&[answer.as_bytes()])
}

/// A waiting run, as it is packed.
#[derive(Serialize, Deserialize)]
struct Parked {
    record: RunRecord,
    steps: Vec<StepRecord>,
    spec: String,
    agent: String,
    state: String,
    messages: Vec<String>,
    answers: Vec<(String, Option<String>)>,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    earlier: Vec<(String, [u8; 16])>,
}

/// Packs waiting runs, primed with one that waits for a tool call: its record, and its
/// continuation as the engine writes it (text the store does not read: only how small
/// runs pack depends on it).
static PACKER: LazyLock<Packer> = LazyLock::new(|| {
    let id = "00000000-0000-0000-0000-000000000000";
    let call = r#"{"id":"call_","name":"","arguments":"{\"\":\"\"}"}"#;
    let mut record = RunRecord::new(id, id, id, id, "");
    record.status = crate::RunStatus::RequiresAction;
    record.pending = vec![agentrt_events::PendingCall {
        id: "call_".into(),
        name: String::new(),
        arguments: agentrt_events::JsonText::new(&serde_json::json!({"": ""})),
        action: agentrt_events::Action::ClientExecute,
        answered: false,
    }];
    let steps = vec![StepRecord {
        iteration: 1,
        tool_calls: vec![crate::record::ToolCallRecord {
            id: "call_".into(),
            name: String::new(),
            arguments: agentrt_events::JsonText::new(&serde_json::json!({"": ""})),
            output: String::new(),
            is_error: false,
            duration: Duration::ZERO,
            references: Vec::new(),
            finished: false,
        }],
        ..StepRecord::default()
    }];
    let sample = Parked {
        record,
        steps,
        spec: format!(
            r#"{{"run_id":"{id}","engine_id":"{id}","session_id":"{id}","message_id":"{id}","query":"","llm_context":null}}"#
        ),
        agent: String::new(),
        state: format!(
            r#"{{"messages":[],"iteration":1,"max_iterations":10,"phase":{{"Waiting":{{"content":"","calls":[{call}],"results":[null],"pending":[{call}],"since_ms":0,"approved":[]}}}},"previous_calls":[],"repeats":0,"waited_ms":0}}"#
        ),
        messages: vec![
            r#"[{"User":""},0]"#.into(),
            r#"[{"Assistant":{"content":"","tool_calls":[]}},0]"#.into(),
        ],
        answers: vec![("call_".into(), None)],
        earlier: Vec::new(),
    };
    Packer::new(serde_json::to_vec(&sample).unwrap_or_default())
});

/// Leases by run, and in the order they lapse: looking for lapsed ones costs what they
/// number, not what all leases number (100,000 waiting runs are 100,000 leases). Both
/// share one copy of each run id. A packed run's lease is kept with it
/// ([`ParkedRun`]), and its place in the order here.
#[derive(Default)]
struct Leases {
    /// Token (empty while the run waits), when it lapses, whether it was let go.
    by_run: HashMap<Arc<str>, (String, Instant, bool)>,
    by_time: std::collections::BTreeSet<(Instant, Arc<str>)>,
}

impl Leases {
    fn token(&self, run_id: &str) -> Option<&str> {
        self.by_run.get(run_id).map(|(token, ..)| token.as_str())
    }

    /// The copy of `run_id` the leases share, or a new one.
    fn id(&self, run_id: &str) -> Arc<str> {
        self.by_run
            .get_key_value(run_id)
            .map_or_else(|| Arc::from(run_id), |(id, _)| id.clone())
    }

    fn set(&mut self, run_id: &str, token: String, at: Instant, released: bool) {
        let id = self.id(run_id);
        if let Some((_, old, _)) = self.by_run.insert(id.clone(), (token, at, released)) {
            self.by_time.remove(&(old, id.clone()));
        }
        self.by_time.insert((at, id));
    }

    fn remove(&mut self, run_id: &str) {
        if let Some((id, (_, at, _))) = self.by_run.remove_entry(run_id) {
            self.by_time.remove(&(at, id));
        }
    }

    /// Takes the lease of waiting run `run_id` out, to be kept with the packed run: its id,
    /// when it lapses, whether it was let go. Its place in the order stays.
    fn park(&mut self, run_id: &str) -> Option<(Arc<str>, Instant, bool)> {
        let (id, (_, at, released)) = self.by_run.remove_entry(run_id)?;
        Some((id, at, released))
    }

    /// Puts back the lease of a run [`Leases::park`] took out.
    fn unpark(&mut self, id: Arc<str>, at: Instant, released: bool) {
        self.by_run.insert(id, (String::new(), at, released));
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
        let Some(id) = self.by_run.get_key_value(run_id).map(|(id, _)| id.clone()) else {
            return false;
        };
        let Some((held, old, was)) = self.by_run.get_mut(run_id) else {
            return false;
        };
        if token.is_some_and(|token| token != held) {
            return false;
        }
        // A renewal (no `released` said) of a lease let go: it stays let go, for the
        // replicas it was handed to.
        if released.is_none() && *was {
            return false;
        }
        let previous = std::mem::replace(old, at);
        if let Some(released) = released {
            *was = released;
        }
        self.by_time.remove(&(previous, id.clone()));
        self.by_time.insert((at, id));
        true
    }

    fn lapsed(&self, now: Instant, limit: usize) -> Vec<String> {
        self.by_time
            .iter()
            .take_while(|(at, _)| *at <= now)
            .take(limit)
            .map(|(_, run_id)| run_id.to_string())
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
    /// A stop requested for the run.
    stop: Option<StopReason>,
}

/// What a waiting run was told.
#[derive(Default)]
struct Wait {
    /// Each pending call, in call order, with its answer once it came.
    answers: Vec<(String, Option<String>)>,
    /// The calls of the run's earlier waits that were answered, with a digest of their
    /// answer ([`answer_digest`]): the same answer again is a repeat, another conflicts.
    earlier: Vec<(String, [u8; 16])>,
    cancelled: bool,
    /// Set when a replica took the run over: it waits no more.
    taken: bool,
    /// Set when the run saved progress since it was taken over: what it was told is in
    /// its state, and a later take-over is told nothing. Until then, every take-over is
    /// told (the replica that took it over may have died before it saved anything).
    past: bool,
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

/// The waiting run `run_id`, packed as `packed`.
fn read_parked(run_id: &str, packed: &[u8]) -> StateResult<Parked> {
    PACKER
        .unpack(packed)
        .map_err(|e| e.to_string())
        .and_then(|json| serde_json::from_slice(&json).map_err(|e| e.to_string()))
        .map_err(|e| StateError::Corrupt {
            what: "waiting run",
            detail: format!("{run_id:?}: {e}"),
        })
}

impl Inner {
    /// Packs run `run_id` when it waits (for answers still missing, not cancelled, not
    /// taken over): see [`Inner::parked`].
    fn park(&mut self, run_id: &str) {
        let waits = self.waits.get(run_id).is_some_and(|wait| {
            !wait.taken && !wait.cancelled && wait.answers.iter().any(|(_, a)| a.is_none())
        });
        if !waits
            || !self.records.get(run_id).is_some_and(|r| r.waiting())
            || !self.progress.contains_key(run_id)
            || self.leases.token(run_id) != Some("")
        {
            return;
        }
        let Some((id, lapses, released)) = self.leases.park(run_id) else {
            return;
        };
        let (Some(mut record), Some(continuation), Some(wait)) = (
            self.records.remove(run_id),
            self.progress.remove(run_id),
            self.waits.remove(run_id),
        ) else {
            return;
        };
        let parked = Parked {
            steps: std::mem::take(&mut record.steps),
            record: *record,
            spec: continuation.spec,
            agent: continuation.agent,
            state: continuation.state,
            messages: continuation.messages,
            answers: wait.answers,
            earlier: wait.earlier,
        };
        match serde_json::to_vec(&parked) {
            Ok(json) => {
                let packed = PACKER.pack(&json);
                self.parked_bytes += WAITING_ENTRY_BYTES + packed.len();
                let principal = principal_of(&parked.record.session_id);
                if !principal.is_empty() {
                    *self
                        .parked_by_principal
                        .entry(principal.to_owned())
                        .or_default() += 1;
                }
                self.parked.insert(
                    id,
                    ParkedRun {
                        packed,
                        lapses,
                        released,
                    },
                );
            }
            // Cannot happen (the record's maps have string keys); were it to, the run
            // stays as it is.
            Err(_) => {
                self.leases.unpark(id, lapses, released);
                self.restore(parked);
            }
        }
    }

    /// Refuses a new wait of a run of session `session_id` past the budgets of waiting
    /// runs.
    fn check_waiting_budget(&self, session_id: &str, retention: RunRetention) -> StateResult<()> {
        if self.parked_bytes >= retention.max_waiting_bytes {
            return Err(StateError::OverBudget {
                budget: "runs.max_waiting_bytes",
                message: "no room is left among the runs waiting for answers here; answer or \
                     cancel some"
                    .to_owned(),
            });
        }
        let principal = principal_of(session_id);
        let waiting = self
            .parked_by_principal
            .get(principal)
            .copied()
            .unwrap_or(0);
        if !principal.is_empty() && waiting >= retention.max_waiting_per_principal {
            return Err(StateError::OverBudget {
                budget: "runs.max_waiting_per_principal",
                message: format!(
                    "this principal has {waiting} runs waiting for answers here, its most; \
                     answer or cancel some"
                ),
            });
        }
        Ok(())
    }

    /// Unpacks run `run_id` when it is packed, into the maps of the runs that are not.
    fn unpark(&mut self, run_id: &str) -> StateResult<()> {
        let Some((id, run)) = self.parked.remove_entry(run_id) else {
            return Ok(());
        };
        self.leases.unpark(id, run.lapses, run.released);
        self.parked_bytes = self
            .parked_bytes
            .saturating_sub(WAITING_ENTRY_BYTES + run.packed.len());
        let parked = read_parked(run_id, &run.packed)?;
        let principal = principal_of(&parked.record.session_id);
        if let Some(count) = self.parked_by_principal.get_mut(principal) {
            *count -= 1;
            if *count == 0 {
                self.parked_by_principal.remove(principal);
            }
        }
        self.restore(parked);
        Ok(())
    }

    fn restore(&mut self, parked: Parked) {
        let Parked {
            mut record,
            steps,
            spec,
            agent,
            state,
            messages,
            answers,
            earlier,
        } = parked;
        record.steps = steps;
        let run_id = record.run_id.clone();
        self.progress.insert(
            run_id.clone(),
            Continuation {
                spec,
                agent,
                state,
                messages,
                stop: None,
            },
        );
        self.waits.insert(
            run_id.clone(),
            Wait {
                answers,
                earlier,
                ..Wait::default()
            },
        );
        self.records.insert(run_id, Box::new(record));
    }

    /// Forgets the ended runs past the retention; then, while their records weigh more
    /// than the budget, the first ended of the principal whose records weigh the most:
    /// one principal's runs never push another's out early (with them, their idempotency
    /// keys, and a retry would run its turn again).
    fn expire(&mut self, retention: RunRetention) {
        let now = Instant::now();
        let out_of_time = self
            .first_end
            .is_some_and(|first| now.duration_since(first) >= retention.ended);
        if !out_of_time && self.ended_bytes <= retention.max_bytes {
            return;
        }
        let mut gone = Vec::new();
        for ended in self.ended.values_mut() {
            while let Some((at, _, _)) = ended.runs.front()
                && now.duration_since(*at) >= retention.ended
            {
                if let Some((_, run_id, bytes)) = ended.runs.pop_front() {
                    ended.bytes = ended.bytes.saturating_sub(bytes);
                    self.ended_bytes = self.ended_bytes.saturating_sub(bytes);
                    gone.push(run_id);
                }
            }
        }
        while self.ended_bytes > retention.max_bytes {
            let Some(ended) = self.ended.values_mut().max_by_key(|ended| ended.bytes) else {
                break;
            };
            let Some((_, run_id, bytes)) = ended.runs.pop_front() else {
                break;
            };
            ended.bytes = ended.bytes.saturating_sub(bytes);
            self.ended_bytes = self.ended_bytes.saturating_sub(bytes);
            gone.push(run_id);
        }
        self.ended.retain(|_, ended| !ended.runs.is_empty());
        self.first_end = self
            .ended
            .values()
            .filter_map(|ended| ended.runs.front().map(|(at, _, _)| *at))
            .min();
        for run_id in gone {
            if let Some(record) = self.records.remove(&run_id) {
                self.waits.remove(&run_id);
                let key = key_digest(&record.session_id, &record.message_id);
                if self
                    .keys
                    .get(&key)
                    .is_some_and(|holder| **holder == *run_id)
                {
                    self.keys.remove(&key);
                }
            }
        }
    }
}

/// The in-memory store's renewals: the store itself (it has no connection to wait on).
struct MemoryRenewer(Arc<MemoryRunStore>);

#[async_trait::async_trait]
impl LeaseRenewer for MemoryRenewer {
    async fn renew(&self, leases: &[Lease]) -> StateResult<Vec<String>> {
        let store = &self.0;
        let mut inner = store.lock();
        let lapses = Instant::now() + store.retention.lease;
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

    /// Runs `f` on the maps with run `run_id` unpacked (when it waits, packed), and packs it
    /// again after, when it still waits.
    fn with_run<T>(
        &self,
        run_id: &str,
        f: impl FnOnce(&mut Inner) -> StateResult<T>,
    ) -> StateResult<T> {
        let mut inner = self.lock();
        inner.unpark(run_id)?;
        let out = f(&mut inner);
        inner.park(run_id);
        out
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
        let key = key_digest(session_id, message_id);
        match inner.keys.get(&key) {
            Some(holder) if Some(&**holder) != replacing => Ok(Claim::Taken(holder.to_string())),
            _ => {
                inner.keys.insert(key, run_id.into());
                Ok(Claim::Claimed)
            }
        }
    }

    async fn holder(&self, session_id: &str, message_id: &str) -> StateResult<Option<String>> {
        let mut inner = self.lock();
        inner.expire(self.retention);
        Ok(inner
            .keys
            .get(&key_digest(session_id, message_id))
            .map(|holder| holder.to_string()))
    }

    async fn save(
        &self,
        record: &RunRecord,
        from_step: usize,
        progress: Option<&Progress>,
    ) -> StateResult<()> {
        self.with_run(&record.run_id, |inner| {
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
                    // Its message id went to another run (a retry took the claim over
                    // while this opening save was on its way): that one is the run.
                    None if inner
                        .keys
                        .get(&key_digest(&record.session_id, &record.message_id))
                        .is_some_and(|holder| **holder != *record.run_id) =>
                    {
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
            let starts_waiting = record.waiting()
                && progress.is_some()
                && !inner
                    .records
                    .get(&record.run_id)
                    .is_some_and(|r| r.waiting());
            if starts_waiting {
                inner.check_waiting_budget(&record.session_id, self.retention)?;
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
                let waits =
                    progress.wait.is_some() && record.waiting() && !record.pending.is_empty();
                if !waits
                    && let Some(wait) = inner.waits.get_mut(&record.run_id)
                    && wait.taken
                {
                    wait.past = true;
                }
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
                    // The answers of its earlier waits stay known, as digests.
                    let earlier = inner
                        .waits
                        .remove(&record.run_id)
                        .map(|old| {
                            // The latest answer of an id stands (ids may repeat).
                            let mut earlier = old.earlier;
                            for (id, answer) in old.answers {
                                if let Some(answer) = answer {
                                    earlier.retain(|(call, _)| *call != id);
                                    earlier.push((id, answer_digest(&answer)));
                                }
                            }
                            earlier
                        })
                        .unwrap_or_default();
                    let wait = Wait {
                        answers: record
                            .pending
                            .iter()
                            .map(|p| (p.id.clone(), None))
                            .collect(),
                        earlier,
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
            // A running record is saved at every round: its copy is updated in place.
            match inner.records.get_mut(&record.run_id) {
                Some(stored) => {
                    stored.copy_head_from(record);
                    stored.steps.truncate(from_step);
                    stored
                        .steps
                        .extend(record.steps.iter().skip(from_step).cloned());
                }
                None => {
                    inner
                        .records
                        .insert(record.run_id.clone(), Box::new(record.clone()));
                }
            }
            if newly_ended {
                let bytes = inner.records.get(&record.run_id).map_or(0, |r| weight(r));
                inner.ended_bytes += bytes;
                let ended = inner
                    .ended
                    .entry(crate::principal_of(&record.session_id).to_owned())
                    .or_default();
                ended.bytes += bytes;
                let now = Instant::now();
                ended.runs.push_back((now, record.run_id.clone(), bytes));
                inner.first_end = inner.first_end.or(Some(now));
                inner.expire(self.retention);
            }
            Ok(())
        })
    }

    async fn load(&self, run_id: &str) -> StateResult<Option<RunRecord>> {
        let (mut record, answers) = {
            let mut inner = self.lock();
            inner.expire(self.retention);
            match inner.parked.get(run_id) {
                // Read from a copy, after the lock: it stays packed.
                Some(run) => {
                    let packed = run.packed.clone();
                    drop(inner);
                    let parked = read_parked(run_id, &packed)?;
                    let mut record = parked.record;
                    record.steps = parked.steps;
                    (record, parked.answers)
                }
                None => {
                    let Some(record) = inner.records.get(run_id).map(|r| RunRecord::clone(r))
                    else {
                        return Ok(None);
                    };
                    let answers = match inner.waits.get(run_id) {
                        Some(wait) if record.waiting() => wait.answers.clone(),
                        _ => Vec::new(),
                    };
                    (record, answers)
                }
            }
        };
        if record.waiting() {
            for call in &mut record.pending {
                call.answered = answers
                    .iter()
                    .any(|(id, answer)| *id == call.id && answer.is_some());
            }
        }
        Ok(Some(record))
    }

    async fn answer(&self, run_id: &str, answers: &[(String, String)]) -> StateResult<Answered> {
        self.with_run(run_id, |inner| {
            let Some(wait) = inner.waits.get_mut(run_id) else {
                return Ok(Answered::NotWaiting);
            };
            let kept = |wait: &Wait, id: &str| -> Option<String> {
                wait.answers
                    .iter()
                    .find(|(pending, _)| pending == id)
                    .and_then(|(_, answer)| answer.clone())
            };
            // Whether `id` is a call of this wait.
            let pending = |wait: &Wait, id: &str| wait.answers.iter().any(|(call, _)| call == id);
            // For a call of an earlier wait: whether `answer` is the one it received.
            let earlier = |wait: &Wait, id: &str, answer: &str| -> Option<bool> {
                wait.earlier
                    .iter()
                    .find(|(call, _)| call == id)
                    .map(|(_, digest)| *digest == answer_digest(answer))
            };
            let complete = wait.answers.iter().all(|(_, a)| a.is_some());
            // Out of time (`timeouts.action`): the replica that takes the run over ends it,
            // however soon that is.
            let ran_out = inner
                .leases
                .by_run
                .get(run_id)
                .is_some_and(|(_, lapses, _)| *lapses <= Instant::now());
            if wait.taken || wait.cancelled || complete || ran_out {
                // A repeat of an answer the run received is accepted (cancelled, the run
                // still publishes it); anything else is late.
                for (id, answer) in answers {
                    match (kept(wait, id), earlier(wait, id, answer)) {
                        (Some(first), _) if first == *answer => {}
                        (None, Some(true)) => {}
                        (Some(_), _) | (None, Some(false)) => {
                            return Ok(Answered::Conflict(id.clone()));
                        }
                        (None, None) => return Ok(Answered::NotWaiting),
                    }
                }
                return Ok(Answered::Accepted {
                    left: Vec::new(),
                    completed: false,
                });
            }
            if let Some((id, _)) = answers.iter().find(|(id, _)| {
                !pending(wait, id) && !wait.earlier.iter().any(|(call, _)| call == id)
            }) {
                return Ok(Answered::NotPending(id.clone()));
            }
            // A call of this wait is judged by this wait alone (the engine gives each call
            // of a run an id of its own); one of an earlier wait by its digest.
            if let Some((id, _)) = answers.iter().find(|(id, answer)| {
                kept(wait, id).is_some_and(|first| first != *answer)
                    || (!pending(wait, id) && earlier(wait, id, answer) == Some(false))
            }) {
                return Ok(Answered::Conflict(id.clone()));
            }
            // An answer that leaves the run waiting may not take the waiting runs past
            // their budget (one that completes its wait lets the run go on).
            let open = |id: &str| wait.answers.iter().any(|(p, a)| p == id && a.is_none());
            let added: usize = answers
                .iter()
                .filter(|(id, _)| open(id))
                .map(|(_, answer)| answer.len())
                .sum();
            let completes = wait
                .answers
                .iter()
                .all(|(p, a)| a.is_some() || answers.iter().any(|(id, _)| id == p));
            if !completes && inner.parked_bytes + added > self.retention.max_waiting_bytes {
                return Err(StateError::OverBudget {
                    budget: "runs.max_waiting_bytes",
                    message: format!(
                        "no room is left among the runs waiting for answers here for these \
                         answers' {added} bytes; answer all of the run's calls at once, or \
                         cancel some runs"
                    ),
                });
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
        })
    }

    async fn cancel_waiting(&self, run_id: &str) -> StateResult<bool> {
        self.with_run(run_id, |inner| {
            let Some(wait) = inner.waits.get_mut(run_id) else {
                return Ok(false);
            };
            if wait.taken || wait.cancelled {
                return Ok(false);
            }
            wait.cancelled = true;
            inner.leases.moved(run_id, None, Instant::now(), Some(true));
            Ok(true)
        })
    }

    fn lease_renewer(self: Arc<Self>) -> StateResult<Box<dyn LeaseRenewer>> {
        Ok(Box::new(MemoryRenewer(self)))
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

    async fn defer(&self, lease: &Lease, by: Duration) -> StateResult<()> {
        self.lock().leases.moved(
            &lease.run_id,
            Some(&lease.token),
            Instant::now() + by,
            Some(false),
        );
        Ok(())
    }

    async fn lapsed(&self, limit: usize) -> StateResult<Vec<String>> {
        Ok(self.lock().leases.lapsed(Instant::now(), limit))
    }

    async fn lapsed_waits(&self, limit: usize) -> StateResult<Vec<String>> {
        let inner = self.lock();
        let now = Instant::now();
        // A packed run waits for answers still missing (else it is not packed).
        let over = |run_id: &str| {
            inner.parked.contains_key(run_id)
                || inner.waits.get(run_id).is_some_and(|wait| {
                    !wait.taken && (wait.cancelled || wait.answers.iter().any(|(_, a)| a.is_none()))
                })
        };
        Ok(inner
            .leases
            .by_time
            .iter()
            .take_while(|(at, _)| *at <= now)
            .take(limit.saturating_mul(LAPSED_WAITS_SCAN))
            .filter(|(_, run_id)| over(run_id))
            .take(limit)
            .map(|(_, run_id)| run_id.to_string())
            .collect())
    }

    async fn take_over(&self, run_id: &str, token: &str) -> StateResult<Option<Resumable>> {
        self.with_run(run_id, |inner| {
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
                record: *record,
                spec: continuation.spec.clone(),
                agent,
                state: continuation.state.clone(),
                messages: continuation.messages.clone(),
                previous_owner,
                handed_over,
                waited: None,
                stop: continuation.stop,
            };
            if let Some(wait) = inner.waits.get_mut(run_id)
                && !wait.past
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
        })
    }

    async fn request_stop(&self, run_id: &str, reason: StopReason) -> StateResult<()> {
        if let Some(continuation) = self.lock().progress.get_mut(run_id) {
            continuation.stop = Some(reason);
        }
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

    #[test]
    fn agent_ids_kept_are_the_digests_and_stay_bounded() {
        let ids = AgentIds::default();
        let agents: Vec<String> = (0..AGENT_IDS_KEPT + 4)
            .map(|n| format!(r#"{{"config":{{"name":"agent {n}"}}}}"#))
            .collect();
        for _ in 0..2 {
            for agent in &agents {
                assert_eq!(ids.of(agent), agent_id(agent));
                assert!(ids.known().len() <= AGENT_IDS_KEPT);
            }
        }
        // The last used are the ones kept.
        assert_eq!(ids.known()[0].0, agents[agents.len() - 1]);
        assert_eq!(ids.of(&agents[3]), agent_id(&agents[3]));
    }

    #[tokio::test]
    async fn a_waiting_run_is_kept_packed_until_it_goes_on() {
        let store = MemoryRunStore::new(RunRetention::unbounded(
            Duration::from_secs(600),
            Duration::from_secs(10),
        ));
        let packed = |store: &MemoryRunStore| {
            let inner = store.lock();
            (
                inner.parked.len(),
                inner.records.len() + inner.progress.len() + inner.waits.len(),
            )
        };
        let mut record = RunRecord::new("w", "e", "s", "m", "where is my order?");
        record.owner = "w.a".into();
        let progress = |state: &str, wait| Progress {
            spec: Some(r#"{"run_id":"w"}"#.into()),
            agent: Some(r#"{"name":"agent"}"#.into()),
            state: state.into(),
            messages: vec![r#"[{"User":"where is my order?"},9]"#.into()],
            first_message: 0,
            wait,
        };
        store
            .save(&record, 0, Some(&progress("running", None)))
            .await
            .unwrap();
        assert_eq!(packed(&store), (0, 3 - 1), "a running run is not packed");
        record.status = RunStatus::RequiresAction;
        record.steps.push(StepRecord {
            iteration: 1,
            thought: "asking".into(),
            ..StepRecord::default()
        });
        record.pending = ["c1", "c2"]
            .into_iter()
            .map(|id| agentrt_events::PendingCall {
                id: id.into(),
                name: "lookup_order".into(),
                arguments: agentrt_events::JsonText::new(&serde_json::json!({"order_id": "A-17"})),
                action: agentrt_events::Action::ClientExecute,
                answered: false,
            })
            .collect();
        store
            .save(
                &record,
                0,
                Some(&progress("waiting", Some(Duration::from_secs(60)))),
            )
            .await
            .unwrap();
        assert_eq!(packed(&store), (1, 0), "waiting, it is only packed");
        let mut waiting = record.clone();
        assert_eq!(store.load("w").await.unwrap(), Some(waiting.clone()));
        assert_eq!(packed(&store), (1, 0), "reading it leaves it packed");

        let answer = |id: &str| vec![(id.to_owned(), "\"A-17 ships today\"".to_owned())];
        assert_eq!(
            store.answer("w", &answer("c1")).await.unwrap(),
            Answered::Accepted {
                left: vec!["c2".into()],
                completed: false
            }
        );
        assert_eq!(packed(&store), (1, 0), "still waiting, packed again");
        waiting.pending[0].answered = true;
        assert_eq!(store.load("w").await.unwrap(), Some(waiting));

        assert_eq!(
            store.answer("w", &answer("c2")).await.unwrap(),
            Answered::Accepted {
                left: Vec::new(),
                completed: true
            }
        );
        let taken = store.take_over("w", "w.b").await.unwrap().unwrap();
        assert_eq!(packed(&store).0, 0, "it goes on: unpacked");
        assert_eq!(taken.spec, r#"{"run_id":"w"}"#);
        assert_eq!(taken.agent, r#"{"name":"agent"}"#);
        assert_eq!(taken.state, "waiting");
        assert_eq!(taken.messages, [r#"[{"User":"where is my order?"},9]"#]);
        assert_eq!(taken.record.steps, record.steps);
        assert_eq!(taken.waited.unwrap().answers.len(), 2);
    }

    #[tokio::test]
    async fn a_waiting_run_packs_to_a_few_hundred_bytes() {
        let store = MemoryRunStore::new(RunRetention::unbounded(
            Duration::from_secs(600),
            Duration::from_secs(10),
        ));
        let [run, engine, session, message] = [
            "26488e94-294b-4f0a-b057-d44ae4d12a86",
            "93a722db-80a0-4f4e-9572-5ca629249863",
            "4374d486-b0ee-4a50-a6d7-0bbdde60b35b",
            "8fa2ba29-4a96-4a13-a095-d230722b1dc7",
        ];
        let query = "where is my order?";
        let call = r#"{"id":"call_1","name":"lookup_order","arguments":"{\"order_id\":\"A-17\"}"}"#;
        let mut record = RunRecord::new(run, engine, session, message, query);
        record.owner = format!("{run}.a");
        record.status = RunStatus::RequiresAction;
        record.steps.push(StepRecord {
            iteration: 1,
            ..StepRecord::default()
        });
        record.pending = vec![agentrt_events::PendingCall {
            id: "call_1".into(),
            name: "lookup_order".into(),
            arguments: agentrt_events::JsonText::new(&serde_json::json!({"order_id": "A-17"})),
            action: agentrt_events::Action::ClientExecute,
            answered: false,
        }];
        // As the engine writes them.
        let progress = Progress {
            spec: Some(format!(
                r#"{{"run_id":"{run}","engine_id":"{engine}","session_id":"{session}","message_id":"{message}","query":"{query}","llm_context":null}}"#
            )),
            agent: Some(r#"{"name":"waiting"}"#.into()),
            state: format!(
                r#"{{"messages":[],"iteration":1,"max_iterations":10,"phase":{{"Waiting":{{"content":"","calls":[{call}],"results":[null],"pending":[{call}],"since_ms":1795677837595,"approved":[]}}}},"previous_calls":[["lookup_order","{{\"order_id\":\"A-17\"}}"]],"repeats":0,"waited_ms":0}}"#
            ),
            messages: vec![format!(r#"[{{"User":"{query}"}},9]"#)],
            first_message: 0,
            wait: Some(Duration::from_secs(60)),
        };
        store.save(&record, 0, Some(&progress)).await.unwrap();
        let inner = store.lock();
        let packed = inner.parked.get(run).unwrap().packed.len();
        let json = read_parked(run, &inner.parked.get(run).unwrap().packed)
            .map(|parked| serde_json::to_vec(&parked).unwrap().len())
            .unwrap();
        assert!(json > 1700, "{json} bytes of JSON");
        assert!(packed < 360, "{json} bytes of JSON packed into {packed}");
    }

    /// Saves a run of `session` that starts waiting for one call (`None`: it could not).
    async fn wait_in(store: &MemoryRunStore, run_id: &str, session: &str) -> StateResult<()> {
        wait_on(store, run_id, session, &["c1"]).await
    }

    /// Saves run `run_id` waiting for the outputs of `calls`.
    async fn wait_on(
        store: &MemoryRunStore,
        run_id: &str,
        session: &str,
        calls: &[&str],
    ) -> StateResult<()> {
        let mut record = RunRecord::new(run_id, "e", session, run_id, "q");
        record.owner = format!("{run_id}.a");
        let progress = |wait| Progress {
            spec: Some("{}".into()),
            agent: None,
            state: "s".into(),
            messages: Vec::new(),
            first_message: 0,
            wait,
        };
        store.save(&record, 0, Some(&progress(None))).await?;
        record.status = RunStatus::RequiresAction;
        record.pending = calls
            .iter()
            .map(|id| agentrt_events::PendingCall {
                id: (*id).into(),
                name: "tool".into(),
                arguments: agentrt_events::JsonText::new(&serde_json::json!({})),
                action: agentrt_events::Action::ClientExecute,
                answered: false,
            })
            .collect();
        store
            .save(&record, 0, Some(&progress(Some(Duration::from_secs(60)))))
            .await
    }

    fn budget(result: StateResult<()>) -> &'static str {
        match result {
            Err(StateError::OverBudget { budget, .. }) => budget,
            other => panic!("not over a budget: {other:?}"),
        }
    }

    #[tokio::test]
    async fn waiting_runs_have_budgets_of_bytes_and_per_principal() {
        let store = MemoryRunStore::new(RunRetention {
            max_waiting_per_principal: 1,
            ..RunRetention::unbounded(Duration::from_secs(600), Duration::from_secs(10))
        });
        wait_in(&store, "a1", "alice/s1").await.unwrap();
        assert_eq!(
            budget(wait_in(&store, "a2", "alice/s2").await),
            "runs.max_waiting_per_principal"
        );
        wait_in(&store, "b1", "bob/s1").await.unwrap();
        wait_in(&store, "n1", "s1").await.unwrap();
        wait_in(&store, "n2", "s2").await.unwrap();
        // Answered and gone on, alice's run waits no more: she may make another wait.
        store
            .answer("a1", &[("c1".into(), "\"x\"".into())])
            .await
            .unwrap();
        assert!(store.take_over("a1", "a1.b").await.unwrap().is_some());
        wait_in(&store, "a3", "alice/s3").await.unwrap();
        // Reading a waiting run changes nothing of the count.
        store.load("a3").await.unwrap();
        assert_eq!(
            budget(wait_in(&store, "a4", "alice/s4").await),
            "runs.max_waiting_per_principal"
        );

        let store = MemoryRunStore::new(RunRetention {
            max_waiting_bytes: 1,
            ..RunRetention::unbounded(Duration::from_secs(600), Duration::from_secs(10))
        });
        wait_in(&store, "x1", "s1").await.unwrap();
        assert_eq!(
            budget(wait_in(&store, "x2", "s2").await),
            "runs.max_waiting_bytes"
        );
        assert!(!store.load("x2").await.unwrap().unwrap().waiting());
    }

    #[tokio::test]
    async fn answers_that_leave_a_run_waiting_stay_within_the_byte_budget() {
        let store = MemoryRunStore::new(RunRetention {
            max_waiting_bytes: 64 * 1024,
            ..RunRetention::unbounded(Duration::from_secs(600), Duration::from_secs(10))
        });
        wait_on(&store, "r1", "s1", &["c1", "c2"]).await.unwrap();
        let big = format!("\"{}\"", "x".repeat(100 * 1024));
        // One of two outputs, past the budget: refused, and nothing of it kept.
        assert_eq!(
            budget(
                store
                    .answer("r1", &[("c1".into(), big.clone())])
                    .await
                    .map(drop)
            ),
            "runs.max_waiting_bytes"
        );
        assert!(
            store
                .load("r1")
                .await
                .unwrap()
                .unwrap()
                .pending
                .iter()
                .all(|p| !p.answered)
        );
        // A small one is taken; the big one with the last, which lets the run go on, too.
        let small = "\"ok\"".to_owned();
        assert!(matches!(
            store.answer("r1", &[("c2".into(), small)]).await.unwrap(),
            Answered::Accepted {
                completed: false,
                ..
            }
        ));
        assert!(matches!(
            store.answer("r1", &[("c1".into(), big)]).await.unwrap(),
            Answered::Accepted {
                completed: true,
                ..
            }
        ));
    }

    #[tokio::test]
    async fn ended_runs_beyond_the_byte_budget_go_first_ended_first() {
        let ended = |id: &str| {
            let mut record = RunRecord::new(id, "e", "s", id, &"q".repeat(10_000));
            record.status = RunStatus::Succeeded;
            record
        };
        let one = weight(&ended("r0"));
        let store = MemoryRunStore::new(RunRetention {
            max_bytes: one * 3,
            ..RunRetention::unbounded(Duration::from_secs(600), Duration::from_secs(10))
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

    /// Over the byte budget, the principal whose ended runs weigh the most loses its
    /// first ended: one that ended a run before another's flood keeps it, and with it the
    /// run's idempotency key.
    #[tokio::test]
    async fn a_principals_ended_runs_do_not_push_out_anothers() {
        let ended = |id: &str, principal: &str| {
            let session = format!("{principal}/s");
            let mut record = RunRecord::new(id, "e", &session, id, &"q".repeat(10_000));
            record.status = RunStatus::Succeeded;
            record
        };
        let one = weight(&ended("a0", "alice"));
        let store = MemoryRunStore::new(RunRetention {
            max_bytes: one * 3,
            ..RunRetention::unbounded(Duration::from_secs(600), Duration::from_secs(10))
        });
        for (id, principal) in [
            ("a0", "alice"),
            ("b0", "bob"),
            ("b1", "bob"),
            ("b2", "bob"),
            ("b3", "bob"),
            ("b4", "bob"),
        ] {
            let session = format!("{principal}/s");
            let claim = store.claim(&session, id, id, None).await.unwrap();
            assert!(matches!(claim, Claim::Claimed), "{id}");
            store.save(&ended(id, principal), 0, None).await.unwrap();
        }
        for (id, kept) in [
            ("a0", true),
            ("b0", false),
            ("b1", false),
            ("b2", false),
            ("b3", true),
            ("b4", true),
        ] {
            assert_eq!(store.load(id).await.unwrap().is_some(), kept, "{id}");
        }
        assert_eq!(
            store.holder("alice/s", "a0").await.unwrap().as_deref(),
            Some("a0"),
            "its idempotency key is kept with it"
        );
    }
}
