//! The runs this replica executes, and the ways to reach any run: starting one (or finding
//! the one a message id already names), stopping one wherever it executes, reading its
//! record. What a client can observe comes from the shared stores, so it does not depend
//! on which replica it asks.

use std::{
    collections::{HashMap, HashSet},
    sync::{
        Arc, Mutex, MutexGuard, PoisonError, Weak,
        atomic::{AtomicBool, AtomicUsize, Ordering},
    },
    time::Duration,
};

use agentrt_engine::{Engine, RunControl, RunError, RunSpec, StartedRun, StopReason, ToolAnswer};
use agentrt_events::{BusError, EventBus, EventStream};
use agentrt_metrics::Metrics;
use agentrt_state::{
    Action, Answered, Claim, Lease, LeaseRenewer, RunRecord, RunStatus, RunStore, StateError,
};
use futures_util::{FutureExt, StreamExt};
use tokio_util::sync::{CancellationToken, DropGuard};
use tracing::{Instrument, debug, error, info, warn};

/// Why a run could not start.
#[derive(Debug, thiserror::Error)]
pub enum RunStartError {
    /// The server runs as many runs as it may.
    #[error("this server already runs {0} runs, its limit")]
    Busy(usize),
    /// The run would take this replica past a budget of its runs in progress.
    #[error("{message} ({budget})")]
    OverBudget {
        /// The setting that sets the budget.
        budget: &'static str,
        /// What is full.
        message: String,
    },
    /// The bus refused the run.
    #[error(transparent)]
    Bus(#[from] BusError),
    /// The shared state cannot be reached.
    #[error(transparent)]
    State(#[from] StateError),
    /// The run could not be started.
    #[error("{}", .0.message)]
    Failed(RunError),
    /// The session's message id belongs to a run of another query (or engine).
    #[error(
        "message id {message_id:?} was already used in this session for run {run_id:?}, {what}"
    )]
    MessageIdReused {
        /// The message id.
        message_id: String,
        /// The run that has it.
        run_id: String,
        /// What differs: `with another query` or `on another engine`.
        what: &'static str,
    },
}

/// Whether `start` made a new run or found the one with the same idempotency key.
pub enum Started {
    /// A new run, executing here.
    New(String),
    /// The run that already has this session and message id (on any replica).
    Existing(String),
}

/// Bounds of the run manager.
#[derive(Debug, Clone, Copy)]
pub struct RunLimits {
    /// Runs in progress at once on this replica.
    pub max_active: usize,
    /// With shared state: how long a run's lease lasts unrenewed, after which another
    /// replica takes it over. `None` in memory: runs live and die with this process.
    pub takeover_after: Option<Duration>,
    /// How long a lease lasts unrenewed: with shared state, `takeover_after`; in memory,
    /// the lease of a run that waited and goes on (its store's lease).
    pub lease: Duration,
    /// Runs of one (named) principal in progress at once on this replica.
    pub max_active_per_principal: usize,
    /// Bytes of the queries and `llm_context` of the runs in progress on this replica.
    pub max_active_bytes: usize,
}

/// What a run in progress takes of the budgets of [`RunLimits`].
#[derive(Debug, Default)]
struct Charge {
    /// Its principal (empty: the anonymous one).
    principal: String,
    /// Bytes of its query and context.
    bytes: usize,
}

/// The budgets taken by the runs in progress here.
#[derive(Debug, Default)]
struct Usage {
    bytes: usize,
    per_principal: HashMap<String, usize>,
}

/// The bytes a run's spec holds while it runs: its query and context text.
fn spec_bytes(spec: &RunSpec) -> usize {
    spec.query.len()
        + spec.llm_context.as_ref().map_or(0, |context| {
            context
                .iter()
                .map(|message| match message {
                    agentrt_models::ChatMessage::System(text)
                    | agentrt_models::ChatMessage::User(text) => text.len(),
                    agentrt_models::ChatMessage::Assistant {
                        content,
                        tool_calls,
                    } => {
                        content.len() + tool_calls.iter().map(|c| c.arguments.len()).sum::<usize>()
                    }
                    agentrt_models::ChatMessage::Tool { content, .. } => content.len(),
                })
                .sum()
        })
}

/// Where a run is after answers to the calls it waits for.
pub struct AnswerOutcome {
    /// `RequiresAction` while calls are left; `Running` once it goes on.
    pub status: RunStatus,
    /// The calls still without an answer.
    pub left: Vec<String>,
}

/// How often, at most, a replica looks for runs to take over (less often with a longer
/// lease: a quarter of it).
const TAKEOVER_POLL: Duration = Duration::from_millis(100);
/// Lapsed runs asked for at once.
const TAKEOVER_BATCH: usize = 256;
/// Waits over without their answers ended at once, at most, when no room is left.
const LAPSED_WAITS_BATCH: usize = 32;
/// Runs being taken over at once. Enough to hide Redis's round trips; more only makes
/// each run wait longer between its take-over and its start here (its log is read back
/// and decoded meanwhile), and a burst of hundreds of runs handed over starves the
/// replica's other work, its lease renewals included.
const TAKEOVER_CONCURRENCY: usize = 16;
/// How long a replica handing its runs over waits, at most, for one to stop.
const HANDOVER_PATIENCE: Duration = Duration::from_secs(5);

/// How long a claimed message id may go without its run's record before another request
/// takes it over (the replica that claimed it writes the record at once, unless it died).
const CLAIM_PATIENCE: Duration = Duration::from_secs(2);

/// When a run taken over whose principal has no room for it here is let go, to be taken
/// again.
const NO_ROOM_RETRY: Duration = Duration::from_secs(1);

/// How long an answer waits for a running run's record to say it waits: the record is
/// written before the run's EVENT_TYPE_ACTION_REQUIRED, but a client may answer a client
/// tool's EVENT_TYPE_TOOL_CALL, which comes before both.
const ANSWER_PATIENCE: Duration = Duration::from_secs(1);
/// How often `Cancel` asks again for a run executing on another replica while it waits for
/// it to end.
const STOP_ASKED_AGAIN: Duration = Duration::from_millis(250);

/// A run taken over that resumes here (its run id and lease token): its lease is among
/// those renewed until this goes.
struct Resuming<'a>(&'a RunManager, &'a str, &'a str);

impl Drop for Resuming<'_> {
    fn drop(&mut self) {
        // Another take-over of the run here (an answer's, beside the look for lapsed
        // runs) may have put its own token there since: that one stays.
        let mut resuming = self.0.resuming();
        if resuming.get(self.1).is_some_and(|token| token == self.2) {
            resuming.remove(self.1);
            drop(resuming);
            self.0.held.early_stops().remove(self.1);
        }
    }
}

/// A run executing on this replica.
struct LocalRun {
    control: Arc<RunControl>,
    ended: Arc<RunEnd>,
    /// Its lease token.
    token: String,
    /// Its `Execute` streams whose client going away cancels it (see
    /// [`RunManager::attach`]).
    clients: usize,
    /// Whether such a stream ended otherwise (its client fell behind and resumes with
    /// `Subscribe`): disconnects no longer cancel the run.
    kept: bool,
}

/// What the run holding a message id's key is to a request with that key.
enum Holder {
    /// The same request's run: the request gets it back.
    Same(String),
    /// A run its client gave up: a new run replaces it.
    GivenUp(String),
    /// A run whose record is not written (yet, or ever).
    Unwritten(String),
}

/// Whether a run's task ended, and its waiters. (A `watch` channel did this in 344 bytes
/// per run in flight, for its eight wait lists; this takes 48.)
#[derive(Default)]
struct RunEnd {
    done: AtomicBool,
    waiters: tokio::sync::Notify,
}

impl RunEnd {
    fn is_done(&self) -> bool {
        self.done.load(Ordering::Acquire)
    }

    /// Said by the run's task, as it ends ([`EndOnDrop`]).
    fn finish(&self) {
        self.done.store(true, Ordering::Release);
        self.waiters.notify_waiters();
    }

    /// Returns once the task ended.
    async fn wait(&self) {
        loop {
            let notified = self.waiters.notified();
            let mut notified = std::pin::pin!(notified);
            // Registered before the check: an end between the two still wakes it.
            notified.as_mut().enable();
            if self.is_done() {
                return;
            }
            notified.await;
        }
    }
}

/// Says that a run's task ended when dropped.
struct EndOnDrop(Arc<RunEnd>);

impl Drop for EndOnDrop {
    fn drop(&mut self) {
        self.0.finish();
    }
}

/// Starts runs here and reaches runs anywhere.
pub struct RunManager {
    engine: Engine,
    bus: Arc<dyn EventBus>,
    store: Arc<dyn RunStore>,
    limits: RunLimits,
    active: AtomicUsize,
    /// What the runs in progress take of the budgets.
    usage: Mutex<Usage>,
    /// Woken when the last active run ends.
    idle: tokio::sync::Notify,
    /// The runs it holds the leases of, shared with the thread that renews them.
    held: Arc<Held>,
    /// This process's part of the lease tokens.
    replica: String,
    /// Tokens made so far.
    tokens: AtomicUsize,
    /// Cancelled when the replica hands its runs over: the streams it serves end.
    draining: CancellationToken,
    /// With state in memory, the runs that went to wait here (some may have gone on
    /// since): they end when the process does (see [`RunManager::end_waiting`]).
    waiting: Mutex<HashSet<String>>,
    /// Stops the lease renewals when the manager goes.
    _renewals: DropGuard,
}

/// The runs whose leases this replica holds.
#[derive(Default)]
struct Held {
    local: Mutex<HashMap<String, LocalRun>>,
    /// Runs taken over and still resuming (not in `local` yet), by id, with their lease
    /// tokens: their leases are renewed meanwhile, for resuming many runs at once can take
    /// longer than a lease, and a lapsed lease would let a third replica take them.
    resuming: Mutex<HashMap<String, String>>,
    /// Stops requested for runs while they were resuming here (not in `local` yet): each
    /// is applied once its run is (a request is heard once, and would be lost).
    early_stops: Mutex<HashMap<String, StopReason>>,
}

impl Held {
    fn early_stops(&self) -> MutexGuard<'_, HashMap<String, StopReason>> {
        self.early_stops
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
    }

    fn local(&self) -> MutexGuard<'_, HashMap<String, LocalRun>> {
        // Each critical section leaves the map consistent before anything can panic.
        self.local.lock().unwrap_or_else(PoisonError::into_inner)
    }

    fn resuming(&self) -> MutexGuard<'_, HashMap<String, String>> {
        self.resuming.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// The leases of the runs executing here, and of those resuming here (a run taken
    /// over from this replica itself, which had lost its lease, keeps the lease of its
    /// copy still executing until the one resuming replaces it: a lease reported lost
    /// stops the copy that executes).
    fn leases(&self) -> Vec<Lease> {
        let local = self.local();
        let mut leases: Vec<Lease> = local
            .iter()
            .filter(|(_, run)| !run.token.is_empty())
            .map(|(run_id, run)| Lease {
                run_id: run_id.clone(),
                token: run.token.clone(),
            })
            .collect();
        leases.extend(
            self.resuming()
                .iter()
                .filter(|(run_id, _)| !local.contains_key(*run_id))
                .map(|(run_id, token)| Lease {
                    run_id: run_id.clone(),
                    token: token.clone(),
                }),
        );
        leases
    }

    /// Stops here, without ending it, a run whose lease (`token`) another replica took
    /// (this one was paused past it). A run here under another lease (taken over again
    /// since the renewal was sent) is left alone.
    fn lost(&self, run_id: &str, token: &str) {
        let control = self
            .local()
            .get(run_id)
            .filter(|r| r.token == token)
            .map(|r| r.control.clone());
        if let Some(control) = control {
            Metrics::global().lease_lost();
            warn!(
                %run_id,
                "lost the run's lease (another replica took the run over, or Redis lost \
                 it): stopping it here"
            );
            control.let_go();
        }
    }
}

/// A slot of `max_active`, with the run's charge on the budgets, given back when
/// dropped.
struct Slot<'a>(&'a RunManager, Charge);

impl Drop for Slot<'_> {
    fn drop(&mut self) {
        self.0.release(&self.1);
    }
}

impl RunManager {
    /// A manager running `engine`, publishing on `bus` and recording in `store`; it
    /// follows the stop requests made on any replica.
    pub async fn new(
        engine: Engine,
        bus: Arc<dyn EventBus>,
        store: Arc<dyn RunStore>,
        limits: RunLimits,
    ) -> Result<Arc<Self>, StateError> {
        let held = Arc::new(Held::default());
        let renewals = CancellationToken::new();
        let manager = Arc::new(Self {
            engine,
            bus,
            store: store.clone(),
            limits,
            active: AtomicUsize::new(0),
            usage: Mutex::new(Usage::default()),
            idle: tokio::sync::Notify::new(),
            held: held.clone(),
            replica: uuid::Uuid::new_v4().simple().to_string(),
            tokens: AtomicUsize::new(0),
            draining: CancellationToken::new(),
            waiting: Mutex::new(HashSet::new()),
            _renewals: renewals.clone().drop_guard(),
        });
        let mut requests = store.stop_requests().await?;
        let weak: Weak<Self> = Arc::downgrade(&manager);
        tokio::spawn(async move {
            while let Some(request) = requests.next().await {
                let Some(manager) = weak.upgrade() else {
                    return;
                };
                // Under the lock of the runs executing here: a run being taken over here
                // (not among them yet) gets the stop as soon as it is.
                let local = manager.lock();
                if let Some(run) = local.get(&request.run_id) {
                    info!(run_id = %request.run_id, reason = request.reason.as_str(), "stop requested");
                    run.control.stop(request.reason);
                } else if manager.resuming().contains_key(&request.run_id) {
                    info!(run_id = %request.run_id, reason = request.reason.as_str(), "stop requested of a run being taken over here");
                    manager
                        .held
                        .early_stops()
                        .insert(request.run_id, request.reason);
                }
            }
        });
        // With state in memory too: a run that waited is continued from the store, by
        // this replica, when it is answered, cancelled or out of time.
        spawn_lease_renewals(held, store, limits.lease, renewals).await?;
        tokio::spawn(take_over_runs(Arc::downgrade(&manager), limits.lease));
        Ok(manager)
    }

    /// A lease token of its own for a run starting or taken over here.
    fn new_token(&self) -> String {
        let n = self.tokens.fetch_add(1, Ordering::Relaxed);
        format!("{}.{n}", self.replica)
    }

    /// Cancelled when this replica hands its runs over and its streams end.
    pub fn draining(&self) -> Option<CancellationToken> {
        self.limits.takeover_after.map(|_| self.draining.clone())
    }

    fn resuming(&self) -> MutexGuard<'_, HashMap<String, String>> {
        self.held.resuming()
    }

    /// Takes over, and continues here, the runs whose lease lapsed, as many as there is
    /// room for.
    async fn take_over_lapsed(self: &Arc<Self>) -> Result<(), StateError> {
        loop {
            let room = self
                .limits
                .max_active
                .saturating_sub(self.active.load(Ordering::Acquire))
                .min(TAKEOVER_BATCH);
            if self.draining.is_cancelled() {
                return Ok(());
            }
            if room == 0 {
                return self.end_lapsed_waits().await;
            }
            let lapsed = self.store.lapsed(room).await?;
            if lapsed.is_empty() {
                return Ok(());
            }
            let taken: Vec<Result<bool, StateError>> = futures_util::stream::iter(lapsed)
                .map(|run_id| self.take_over(run_id, None, false))
                .buffer_unordered(TAKEOVER_CONCURRENCY)
                .collect()
                .await;
            // Others took them all, or none can be taken now: look again at the next tick.
            if !taken.iter().any(|t| matches!(t, Ok(true))) {
                return taken.into_iter().find_map(Result::err).map_or(Ok(()), Err);
            }
        }
    }

    /// With no room left for runs that go on: ends here the waits that are over without
    /// their answers (out of time, or cancelled), which call no model, rather than leave
    /// them waiting past `timeouts.action` until a run ends here.
    async fn end_lapsed_waits(self: &Arc<Self>) -> Result<(), StateError> {
        let over = self.store.lapsed_waits(LAPSED_WAITS_BATCH).await?;
        let ended: Vec<Result<bool, StateError>> = futures_util::stream::iter(over)
            .map(|run_id| self.take_over(run_id, None, true))
            .buffer_unordered(TAKEOVER_CONCURRENCY)
            .collect()
            .await;
        ended.into_iter().find_map(Result::err).map_or(Ok(()), Err)
    }

    /// Takes `run_id` over and continues it here, or with `stop`, ends it here at once
    /// for that reason; true when it did. `ends`: the run ends at once (cancelled or
    /// stopped), calling no model, so it is taken even when no room is left.
    async fn take_over(
        self: &Arc<Self>,
        run_id: String,
        stop: Option<StopReason>,
        ends: bool,
    ) -> Result<bool, StateError> {
        if self.draining.is_cancelled() {
            return Ok(false);
        }
        let active = self.active.fetch_add(1, Ordering::AcqRel);
        let mut slot = Slot(self, Charge::default());
        // A run ended here at once (cancelled, or at shutdown) calls no model: it is never
        // kept waiting for room, nor its `Cancel` answered as if it still waited.
        if active >= self.limits.max_active && !ends {
            return Ok(false);
        }
        let token = self.new_token();
        // Its lease is renewed from before it is taken until the run is spawned (or not
        // resumed): the renewals, on their own thread, keep it from the moment Redis gives
        // it, however late this runtime reads the answer (a renewal before that is refused,
        // and does nothing).
        self.resuming().insert(run_id.clone(), token.clone());
        let resuming = Resuming(self, &run_id, &token);
        let Some(taken) = self.store.take_over(&run_id, &token).await? else {
            return Ok(false);
        };
        // Taken as this replica began to hand its runs over (after it looked for them):
        // let go at once, for the others, not left to lapse.
        if self.draining.is_cancelled() {
            drop(resuming);
            self.let_go_now(Lease { run_id, token }).await;
            return Ok(false);
        }
        let charge = Charge {
            principal: agentrt_state::principal_of(&taken.record.session_id).to_owned(),
            bytes: taken.record.query.len(),
        };
        // A run that goes on (answered, or its owner gone) counts against its principal's
        // runs here as any: with them all taken, it is left to lapse again, and taken
        // when the principal has room (its answers all at once must not run a principal's
        // runs past its quota). One that ends at once always may.
        // Ends at once, calling no model: cancelled or stopped, or a wait that ran out
        // of time with calls unanswered.
        let ends_here = ends
            || stop.is_some()
            || taken.stop.is_some()
            || taken.waited.as_ref().is_some_and(|told| {
                told.cancelled
                    || taken
                        .record
                        .pending
                        .iter()
                        .any(|call| !told.answers.contains_key(&call.id))
            });
        if !ends_here
            && principal_full(&self.usage(), &charge, self.limits.max_active_per_principal)
        {
            debug!(%run_id, principal = %charge.principal, "its principal has no room for it here yet");
            // Let go soon, to be taken again (here or elsewhere) once its principal has
            // room, or it is cancelled: left to lapse, it would sit for a lease taken by
            // nobody. Soon, not at once: behind the runs that lapsed before it, so that
            // a principal's runs never keep the others' from being taken over.
            drop(resuming);
            let lease = Lease {
                run_id: run_id.clone(),
                token,
            };
            if let Err(error) = self.store.defer(&lease, NO_ROOM_RETRY).await {
                debug!(%run_id, %error, "cannot let a run its principal has no room for go");
            }
            return Ok(false);
        }
        // Accepted before: charged, never refused.
        if self.charge(&charge, false).is_ok() {
            slot.1 = charge;
        }
        let previous = taken.previous_owner.clone();
        let handover = taken.handed_over;
        let waited = taken.waited.is_some();
        let control = Arc::new(RunControl::default());
        if waited {
            control.outlive_client();
        }
        // A stop asked of the run while no replica executed it ends it here.
        if let Some(reason) = stop.or(taken.stop) {
            control.stop(reason);
        }
        match self
            .engine
            .resume(
                taken,
                handover,
                self.bus.as_ref(),
                self.store.clone(),
                control.clone(),
            )
            .await
        {
            Ok(started) => {
                self.waiting().remove(&run_id);
                if waited {
                    info!(%run_id, "run that waited goes on");
                } else {
                    Metrics::global().run_taken_over(handover);
                    info!(%run_id, previous_owner = %previous, handover, "run taken over");
                }
                self.spawn(started, &run_id, control, token.clone(), slot);
                // A stop requested while it was being taken over.
                let early = self.held.early_stops().remove(&run_id);
                if let Some(reason) = early
                    && let Some(run) = self.lock().get(&run_id)
                {
                    run.control.stop(reason);
                }
                Ok(true)
            }
            // Its log held its end already: its record now says so too.
            Err(error) if error.code == "RUN_ENDED" => {
                info!(%run_id, "{}", error.message);
                Ok(false)
            }
            Err(error) => {
                // Left to lapse again: another replica, or this one later, tries.
                warn!(%run_id, error = %error.message, "cannot continue a run taken over");
                Ok(false)
            }
        }
    }

    /// Hands every run executing here over to the other replicas, at once: each stops
    /// here without ending (its last events written), then its lease is let go, and the
    /// streams this replica serves end, so that their clients resume elsewhere.
    pub async fn hand_over_all(&self) {
        self.draining.cancel();
        let started = tokio::time::Instant::now();
        let mut seen: HashSet<(String, String)> = HashSet::new();
        let (mut total, mut handed_over) = (0, 0);
        // Until a look finds no run it has not handed over: a run spawned as the drain
        // began (a take-over, an answer, an `Execute` past its checks) is handed over too.
        loop {
            let runs: Vec<(Lease, Arc<RunControl>, Arc<RunEnd>)> = self
                .lock()
                .iter()
                .filter(|(run_id, run)| !seen.contains(&((*run_id).clone(), run.token.clone())))
                .map(|(run_id, run)| {
                    (
                        Lease {
                            run_id: run_id.clone(),
                            token: run.token.clone(),
                        },
                        run.control.clone(),
                        run.ended.clone(),
                    )
                })
                .collect();
            if runs.is_empty() {
                break;
            }
            total += runs.len();
            for (lease, control, _) in &runs {
                seen.insert((lease.run_id.clone(), lease.token.clone()));
                control.let_go();
            }
            handed_over += self.release_once_stopped(runs).await;
        }
        if total > 0 {
            info!(
                runs = handed_over,
                left_to_lapse = total - handed_over,
                took = ?started.elapsed(),
                "runs handed over to the other replicas"
            );
        }
    }

    /// Lets `lease` go at once, for another replica to take its run over.
    async fn let_go_now(&self, lease: Lease) {
        let run_id = lease.run_id.clone();
        match self.store.release(&[lease]).await {
            Ok(()) => Metrics::global().runs_handed_over(1),
            Err(error) => {
                warn!(%run_id, %error, "cannot hand a run over: it is taken over when its lease lapses");
            }
        }
    }

    /// Lets each lease of `runs` go as soon as its run has stopped here (its last events
    /// written), in batches of the runs stopped meanwhile; the leases of runs still
    /// stopping are renewed meanwhile. Answers how many were let go.
    async fn release_once_stopped(
        &self,
        runs: Vec<(Lease, Arc<RunControl>, Arc<RunEnd>)>,
    ) -> usize {
        let mut stopping: futures_util::stream::FuturesUnordered<_> = runs
            .into_iter()
            .map(|(lease, _, ended)| async move {
                let _ = tokio::time::timeout(HANDOVER_PATIENCE, ended.wait()).await;
                lease
            })
            .collect();
        let mut handed_over = 0;
        while let Some(first) = stopping.next().await {
            let mut leases = vec![first];
            while let Some(Some(lease)) = stopping.next().now_or_never() {
                leases.push(lease);
            }
            match self.store.release(&leases).await {
                Ok(()) => {
                    handed_over += leases.len();
                    Metrics::global().runs_handed_over(leases.len());
                }
                Err(error) => {
                    warn!(%error, runs = leases.len(), "cannot hand runs over: they are taken over when their leases lapse");
                }
            }
        }
        handed_over
    }

    fn lock(&self) -> MutexGuard<'_, HashMap<String, LocalRun>> {
        self.held.local()
    }

    /// Forgets the run whose task (stopped by `control`) ended, and with state in memory,
    /// remembers it when it `waits`. The run's entry is that task's own unless the run,
    /// answered or taken over meanwhile, already goes on here in a task of its own: that
    /// one's entry stays (it is how the run is stopped and its lease renewed).
    fn run_ended(&self, run_id: &str, control: &Arc<RunControl>, waits: bool) {
        let ours = {
            let mut local = self.lock();
            let ours = local
                .get(run_id)
                .is_some_and(|run| Arc::ptr_eq(&run.control, control));
            if ours {
                local.remove(run_id);
            }
            ours
        };
        if ours && waits && self.limits.takeover_after.is_none() {
            self.waiting().insert(run_id.to_owned());
        }
    }

    /// Whether a run waits here for answers (with state in memory).
    pub fn any_waiting(&self) -> bool {
        !self.waiting().is_empty()
    }

    fn waiting(&self) -> MutexGuard<'_, HashSet<String>> {
        // Each critical section leaves the set consistent before anything can panic.
        self.waiting.lock().unwrap_or_else(PoisonError::into_inner)
    }

    fn usage(&self) -> MutexGuard<'_, Usage> {
        self.usage.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Charges a run to the budgets; with `check`, refuses it when it would take them past
    /// their bounds (a run taken over was accepted already: it is only charged).
    fn charge(&self, charge: &Charge, check: bool) -> Result<(), RunStartError> {
        let mut usage = self.usage();
        if check {
            if usage.bytes.saturating_add(charge.bytes) > self.limits.max_active_bytes {
                return Err(RunStartError::OverBudget {
                    budget: "runs.max_active_bytes",
                    message: format!(
                        "no room is left among the runs in progress here for this one's {} \
                         bytes of query and context; retry later",
                        charge.bytes
                    ),
                });
            }
            if principal_full(&usage, charge, self.limits.max_active_per_principal) {
                return Err(RunStartError::OverBudget {
                    budget: "runs.max_active_per_principal",
                    message: format!(
                        "this principal has {} runs in progress here, its most; retry later",
                        self.limits.max_active_per_principal
                    ),
                });
            }
        }
        usage.bytes += charge.bytes;
        if !charge.principal.is_empty() {
            *usage
                .per_principal
                .entry(charge.principal.clone())
                .or_default() += 1;
        }
        Ok(())
    }

    fn release(&self, charge: &Charge) {
        {
            let mut usage = self.usage();
            usage.bytes = usage.bytes.saturating_sub(charge.bytes);
            if let Some(count) = usage.per_principal.get_mut(&charge.principal) {
                *count -= 1;
                if *count == 0 {
                    usage.per_principal.remove(&charge.principal);
                }
            }
        }
        if self.active.fetch_sub(1, Ordering::AcqRel) == 1 {
            self.idle.notify_waiters();
        }
    }

    /// Starts the run `spec`, or finds the run with the same session and message id.
    pub async fn start(self: &Arc<Self>, spec: RunSpec) -> Result<Started, RunStartError> {
        let active = self.active.fetch_add(1, Ordering::AcqRel);
        let charge = Charge {
            principal: agentrt_state::principal_of(&spec.session_id).to_owned(),
            bytes: spec_bytes(&spec),
        };
        let refused = match self.charge(&charge, active < self.limits.max_active) {
            Err(refused) => {
                self.release(&Charge::default());
                Some(refused)
            }
            Ok(()) if active >= self.limits.max_active => {
                self.release(&charge);
                Some(RunStartError::Busy(active))
            }
            Ok(()) => None,
        };
        if let Some(refused) = refused {
            // A retry of a run that exists takes no room: it gets the run back, however
            // full this replica is.
            return match self.existing(&spec).await? {
                Some(run_id) => Ok(Started::Existing(run_id)),
                None => Err(refused),
            };
        }
        let slot = Slot(self, charge);
        if let Some(existing) = self.claim(&spec).await? {
            return Ok(Started::Existing(existing));
        }
        let token = if self.limits.takeover_after.is_some() {
            self.new_token()
        } else {
            String::new()
        };
        let publisher = self.bus.open(&spec.run_id, &token).await?;
        let control = Arc::new(RunControl::default());
        let run_id = spec.run_id.clone();
        let session_id = spec.session_id.clone();
        let message_id = spec.message_id.clone();
        let started = match self
            .engine
            .start(spec, &token, publisher, self.store.clone(), control.clone())
            .await
        {
            Ok(started) => started,
            Err(error) => {
                // A retry on another replica took the message id over while this run's
                // first write was on its way (refused then): the id makes one run, that
                // one, and this client follows it.
                if let Ok(Some(holder)) = self.store.holder(&session_id, &message_id).await
                    && holder != run_id
                {
                    info!(%run_id, %holder, "the message id went to another run; following it");
                    return Ok(Started::Existing(holder));
                }
                return Err(RunStartError::Failed(error));
            }
        };
        info!(%run_id, %session_id, "run started");
        self.spawn(started, &run_id, control, token, slot);
        Ok(Started::New(run_id))
    }

    /// Runs `started` in a task of its own, holding `slot`.
    fn spawn(
        self: &Arc<Self>,
        started: StartedRun,
        run_id: &str,
        control: Arc<RunControl>,
        token: String,
        mut slot: Slot<'_>,
    ) {
        let ended = Arc::new(RunEnd::default());
        // Said when the task ends, or is dropped (the runtime shutting down).
        let done = EndOnDrop(ended.clone());
        let task_control = control.clone();
        // Empty (nothing held) unless runs are taken over.
        let task_token = token.clone();
        self.lock().insert(
            run_id.to_owned(),
            LocalRun {
                control,
                ended,
                token,
                clients: 0,
                kept: false,
            },
        );
        // Spawned as this replica hands its runs over: let go at once, for the others.
        if self.draining.is_cancelled() && self.limits.takeover_after.is_some() {
            task_control.let_go();
        }
        // Given back by the run's task.
        let charge = std::mem::take(&mut slot.1);
        std::mem::forget(slot);
        let manager = self.clone();
        // The run belongs to the call that started it: its spans are children of the
        // call's span (and so of the caller's trace). It is owned by the manager: it always
        // ends (bounded by its timeout, stopped by `stop_all` on shutdown), and a panic in
        // it ends it too, with one `done` event.
        let call_span = tracing::Span::current();
        let task_run_id = run_id.to_owned();
        tokio::spawn(
            async move {
                let outcome = std::panic::AssertUnwindSafe(started.run())
                    .catch_unwind()
                    .await;
                let waits = outcome.is_ok() && task_control.parked();
                if outcome.is_err() {
                    error!(run_id = %task_run_id, "the run panicked");
                    manager.record_panic(&task_run_id).await;
                }
                // Let go as this replica hands its runs over, maybe after the hand-over
                // last looked (spawned as it began): its lease goes now, not when it
                // lapses. (Let go twice, the second time does nothing.)
                if !waits
                    && task_control.is_let_go()
                    && manager.draining.is_cancelled()
                    && manager.limits.takeover_after.is_some()
                {
                    let lease = Lease {
                        run_id: task_run_id.clone(),
                        token: task_token,
                    };
                    manager.let_go_now(lease).await;
                }
                manager.run_ended(&task_run_id, &task_control, waits);
                manager.release(&charge);
                drop(done);
            }
            .instrument(call_span),
        );
    }

    /// The run a retry of `spec` would get back, claiming nothing; `MESSAGE_ID_REUSED`
    /// when its key is another request's.
    async fn existing(&self, spec: &RunSpec) -> Result<Option<String>, RunStartError> {
        let Some(holder) = self
            .store
            .holder(&spec.session_id, &spec.message_id)
            .await?
        else {
            return Ok(None);
        };
        Ok(match self.judge(spec, holder).await? {
            Holder::Same(holder) => Some(holder),
            Holder::GivenUp(_) | Holder::Unwritten(_) => None,
        })
    }

    /// What the run `holder`, which holds the key of `spec`, is to a request of `spec`.
    async fn judge(&self, spec: &RunSpec, holder: String) -> Result<Holder, RunStartError> {
        let abandoned_here = self
            .lock()
            .get(&holder)
            .is_some_and(|run| run.control.is_abandoned());
        Ok(match self.store.load(&holder).await? {
            Some(record) if !record.abandoned && !abandoned_here => {
                // A repeat gets the run back, provided it asks the same.
                if record.query == spec.query && record.engine_id == spec.engine_id {
                    Holder::Same(holder)
                } else {
                    return Err(RunStartError::MessageIdReused {
                        message_id: spec.message_id.clone(),
                        run_id: holder,
                        what: if record.query == spec.query {
                            "on another engine"
                        } else {
                            "with another query"
                        },
                    });
                }
            }
            Some(_) => Holder::GivenUp(holder),
            None => Holder::Unwritten(holder),
        })
    }

    /// Claims the run's message id; `Some` with the run that already has it.
    async fn claim(&self, spec: &RunSpec) -> Result<Option<String>, RunStartError> {
        let mut replacing: Option<String> = None;
        let mut waited = Duration::ZERO;
        loop {
            let claim = self
                .store
                .claim(
                    &spec.session_id,
                    &spec.message_id,
                    &spec.run_id,
                    replacing.as_deref(),
                )
                .await?;
            let holder = match claim {
                Claim::Claimed => return Ok(None),
                Claim::Taken(holder) => holder,
            };
            match self.judge(spec, holder).await? {
                Holder::Same(holder) => return Ok(Some(holder)),
                // Given up by its client: a retry gets a new run (the old one stays
                // readable by its id).
                Holder::GivenUp(holder) => replacing = Some(holder),
                // Claimed a moment ago, its record not written yet; or its replica died
                // before writing it.
                Holder::Unwritten(_) if waited < CLAIM_PATIENCE => {
                    tokio::time::sleep(Duration::from_millis(20)).await;
                    waited += Duration::from_millis(20);
                }
                Holder::Unwritten(holder) => replacing = Some(holder),
            }
        }
    }

    /// Records that a run ended in a panic (its events end by themselves).
    async fn record_panic(&self, run_id: &str) {
        match self.store.load(run_id).await {
            Ok(Some(mut record)) if !record.ended() => {
                record.status = RunStatus::Failed;
                record.stop_reason = Some(StopReason::InternalError);
                record.error = Some(RunError {
                    code: "INTERNAL".into(),
                    message: "the run ended without a final event".into(),
                    category: "internal",
                    retryable: true,
                });
                // Calls it ended without say so, as any run's end has them.
                let steps = record
                    .end_unfinished_calls(StopReason::InternalError.as_str())
                    .unwrap_or(record.steps.len());
                if let Some(run) = self.lock().get(run_id) {
                    record.owner.clone_from(&run.token);
                }
                if let Err(error) = self.store.save(&record, steps, None).await {
                    warn!(%run_id, %error, "cannot record the end of a run that panicked");
                }
            }
            _ => {}
        }
    }

    /// The run's record, from the shared store.
    pub async fn record(&self, run_id: &str) -> Result<Option<RunRecord>, StateError> {
        self.store.load(run_id).await
    }

    /// The run's events after `after_sequence`.
    pub async fn events(&self, run_id: &str, after_sequence: u64) -> Result<EventStream, BusError> {
        self.bus.subscribe(run_id, after_sequence).await
    }

    /// Counts an `Execute` stream of a run executing here whose client going away
    /// cancels the run once no other such stream is left: the stream that started the
    /// run (`first`), or a retry of it with the same message id while the run is still so
    /// followed (a retry must not lose its run when the first stream's broken connection
    /// is noticed, later). False when the run is not executing here, or not followed so
    /// (started with `detach`).
    pub fn attach(&self, run_id: &str, first: bool) -> bool {
        match self.lock().get_mut(run_id) {
            Some(run) if !run.kept && !run.ended.is_done() && (first || run.clients > 0) => {
                run.clients += 1;
                true
            }
            _ => false,
        }
    }

    /// A retry of `run_id` with `detach` asks that it outlive its clients: disconnects no
    /// longer cancel it (the first stream's broken connection, noticed later, included).
    pub fn keep(&self, run_id: &str) {
        if let Some(run) = self.lock().get_mut(run_id) {
            run.kept = true;
        }
    }

    /// A stream counted by [`RunManager::attach`] ended: its client went away (`gone`),
    /// which cancels the run when no other such stream is left, or it ended otherwise,
    /// after which disconnects no longer cancel the run.
    pub fn detach(&self, run_id: &str, gone: bool) {
        let abandoned = match self.lock().get_mut(run_id) {
            Some(run) => {
                run.clients = run.clients.saturating_sub(1);
                run.kept |= !gone;
                run.clients == 0 && !run.kept
            }
            None => false,
        };
        if abandoned {
            self.abandon(run_id);
        }
    }

    /// Stops a run executing here because the client of its `Execute` went away.
    fn abandon(&self, run_id: &str) {
        // A replica handing its runs over ends its streams: their clients resume
        // elsewhere, and the runs go on.
        if self.draining.is_cancelled() {
            return;
        }
        if let Some(run) = self.lock().get(run_id)
            && !run.ended.is_done()
        {
            info!(%run_id, "client disconnected, cancelling the run");
            run.control.abandon();
        }
    }

    /// Answers calls that the run of `record` (as just read) waits for, through any
    /// replica; the run goes on here once the last one is answered.
    pub async fn answer(
        self: &Arc<Self>,
        mut record: RunRecord,
        answers: Vec<(String, ToolAnswer)>,
    ) -> Result<AnswerOutcome, crate::error::Error> {
        use crate::error::Error;
        // Looked at soon, then less often: an answer to a run that does not wait reads its
        // record a handful of times, not fifty.
        let mut waited = Duration::ZERO;
        let mut pause = Duration::from_millis(20);
        while !record.waiting() && !record.ended() && waited < ANSWER_PATIENCE {
            tokio::time::sleep(pause).await;
            waited += pause;
            pause = (pause * 2).min(Duration::from_millis(250));
            match self.store.load(&record.run_id).await? {
                Some(fresh) => record = fresh,
                None => break,
            }
        }
        let run_id = record.run_id.as_str();
        let waiting = || {
            record
                .pending
                .iter()
                .filter(|p| !p.answered)
                .map(|p| p.id.as_str())
                .collect::<Vec<_>>()
                .join(", ")
        };
        if record.waiting() {
            for (call_id, answer) in &answers {
                match record.pending.iter().find(|p| p.id == *call_id) {
                    // Of no call it waits for now: the store knows whether it is one of
                    // an earlier wait (its answer repeated, or another).
                    None => {}
                    Some(pending) if !answer.answers(pending.action) => {
                        let (wanted, rpc) = match pending.action {
                            Action::Approve => ("an approval", "ApproveToolCalls"),
                            Action::ClientExecute => ("the client's output", "SubmitToolOutputs"),
                        };
                        return Err(Error::WrongAnswer {
                            run_id: run_id.to_owned(),
                            call_id: call_id.clone(),
                            wanted,
                            rpc,
                        });
                    }
                    Some(_) => {}
                }
            }
        }
        // Kept as the model would be given them: a waiting run holds no more.
        let encoded: Vec<(String, String)> = answers
            .into_iter()
            .map(|(id, answer)| (id, self.engine.bounded_answer(answer).encode()))
            .collect();
        match self.store.answer(run_id, &encoded).await? {
            Answered::NotWaiting => Err(Error::RunNotWaiting {
                run_id: run_id.to_owned(),
                // Its record, read before, may still say it waits: its wait ended since
                // (all answered, cancelled, or out of time) or is ending.
                status: if record.waiting() {
                    "done waiting: answered, cancelled or out of time (timeouts.action)".into()
                } else {
                    match record.stop_reason {
                        // Why it ended, as its `done` event says it.
                        Some(reason) if record.ended() => format!(
                            "{}, ended with stop reason {}",
                            status_name(record.status),
                            reason.as_str()
                        ),
                        _ => status_name(record.status).into(),
                    }
                },
            }),
            Answered::NotPending(call_id) => Err(Error::CallNotPending {
                run_id: run_id.to_owned(),
                call_id,
                waiting: waiting(),
            }),
            Answered::Conflict(call_id) => Err(Error::AnsweredOtherwise {
                run_id: run_id.to_owned(),
                call_id,
            }),
            Answered::Accepted { left, completed } => {
                if completed {
                    // Goes on here at once; should this replica not get it (another took
                    // it first, or there is no room), the take-over loops will.
                    match self.take_over(run_id.to_owned(), None, false).await {
                        Ok(_) => {}
                        Err(error) => {
                            warn!(%run_id, %error, "cannot continue an answered run here yet");
                        }
                    }
                }
                // A repeat after the run went on (or was cancelled) says where it is now.
                let status = match (left.is_empty(), record.waiting()) {
                    (false, _) => RunStatus::RequiresAction,
                    (true, true) if completed => RunStatus::Running,
                    (true, true) => match self.store.load(run_id).await? {
                        Some(now) if now.ended() => now.status,
                        _ => RunStatus::Running,
                    },
                    (true, false) => record.status,
                };
                Ok(AnswerOutcome { status, left })
            }
        }
    }

    /// Stops the run wherever it executes and waits, at most `wait`, for it to end;
    /// answers its record then. `None` for an unknown run.
    pub async fn cancel(
        self: &Arc<Self>,
        run_id: &str,
        wait: Duration,
    ) -> Result<Option<RunRecord>, StateError> {
        let deadline = tokio::time::Instant::now() + wait;
        let Some(mut record) = self.store.load(run_id).await? else {
            return Ok(None);
        };
        loop {
            if record.ended() {
                return Ok(Some(record));
            }
            let was_waiting = record.waiting();
            record = self.cancel_once(run_id, record, deadline).await?;
            // A run that began to wait as it was stopped (its wait was written first)
            // waits still: its wait is cancelled next.
            if record.ended()
                || was_waiting
                || !record.waiting()
                || tokio::time::Instant::now() >= deadline
            {
                return Ok(Some(record));
            }
        }
    }

    /// One try of [`RunManager::cancel`] at `record`, the run as it was last read: stops
    /// it, or cancels its wait, and waits until `deadline` for it to end, or to begin to
    /// wait. Answers its record then.
    async fn cancel_once(
        self: &Arc<Self>,
        run_id: &str,
        record: RunRecord,
        deadline: tokio::time::Instant,
    ) -> Result<RunRecord, StateError> {
        // Nobody executes a waiting run: cancelled, it ends here, or on whichever replica
        // takes it first, told so by the store. Not stopped besides: it publishes the
        // answers it accepted before it ends.
        let was_waiting = record.waiting();
        let wait_cancelled = was_waiting && self.store.cancel_waiting(run_id).await?;
        if wait_cancelled && let Err(error) = self.take_over(run_id.to_owned(), None, true).await {
            warn!(%run_id, %error, "cannot end a cancelled waiting run here yet");
        }
        let local = self
            .lock()
            .get(run_id)
            .map(|run| (run.control.clone(), run.ended.clone()));
        match local {
            Some((control, ended)) => {
                if !wait_cancelled {
                    control.stop(StopReason::Cancelled);
                }
                let _ = tokio::time::timeout_at(deadline, ended.wait()).await;
                // A run let go here as it was stopped (handed over in a drain, its lease
                // lost) goes on elsewhere: the replica that takes it over is asked to end
                // it, as for a run of another replica.
                if !wait_cancelled
                    && let Some(record) = self.store.load(run_id).await?
                    && !record.ended()
                    && !record.waiting()
                    && ended.is_done()
                {
                    self.store
                        .request_stop(run_id, StopReason::Cancelled)
                        .await?;
                    return Ok(record);
                }
            }
            None => {
                if !wait_cancelled {
                    self.store
                        .request_stop(run_id, StopReason::Cancelled)
                        .await?;
                }
                let mut asked = tokio::time::Instant::now();
                // The owner stops the run within milliseconds: look soon, then less often.
                let mut pause = Duration::from_millis(2);
                while tokio::time::Instant::now() < deadline {
                    tokio::time::sleep(pause).await;
                    pause = (pause * 2).min(Duration::from_millis(20));
                    // A run that begins to wait as it is stopped is answered waiting (its
                    // wait is cancelled next); one that waited already, and whose wait
                    // was taken (all answered, going on somewhere), is followed to its end.
                    if let Some(record) = self.store.load(run_id).await?
                        && (record.ended() || (!wait_cancelled && !was_waiting && record.waiting()))
                    {
                        return Ok(record);
                    }
                    // A replica that took the run over as it was asked may have missed
                    // the request before it knew the run: ask again.
                    if !wait_cancelled && asked.elapsed() >= STOP_ASKED_AGAIN {
                        self.store
                            .request_stop(run_id, StopReason::Cancelled)
                            .await?;
                        asked = tokio::time::Instant::now();
                    }
                }
            }
        }
        Ok(self.store.load(run_id).await?.unwrap_or(record))
    }

    /// Resolves once no run is in progress here.
    pub async fn all_ended(&self) {
        loop {
            let idle = self.idle.notified();
            tokio::pin!(idle);
            idle.as_mut().enable();
            if self.active.load(Ordering::Acquire) == 0 {
                return;
            }
            idle.await;
        }
    }

    /// With state in memory, ends every run that waits here for answers, for `reason`,
    /// with its `done` event: its state does not outlive the process, and its clients
    /// learn how it ended rather than losing their streams. With shared state waiting runs
    /// hold nothing here and go on through any replica: nothing to do.
    pub async fn end_waiting(self: &Arc<Self>, reason: StopReason) {
        let runs: Vec<String> = self.waiting().drain().collect();
        let mut ended = 0;
        for run_id in runs {
            // A run answered meanwhile goes on (and ends with the others in progress).
            match self.store.cancel_waiting(&run_id).await {
                Ok(true) => {}
                Ok(false) => continue,
                Err(error) => {
                    warn!(%run_id, %error, "cannot end a waiting run");
                    continue;
                }
            }
            match self.take_over(run_id.clone(), Some(reason), true).await {
                Ok(true) => ended += 1,
                Ok(false) => warn!(%run_id, "cannot end a waiting run here"),
                Err(error) => warn!(%run_id, %error, "cannot end a waiting run"),
            }
        }
        if ended > 0 {
            info!(ended, "ended the runs that waited for answers");
        }
    }

    /// Stops every run in progress here for `reason`.
    pub fn stop_all(&self, reason: StopReason) {
        let controls: Vec<Arc<RunControl>> = self
            .lock()
            .values()
            .map(|run| run.control.clone())
            .collect();
        for control in controls {
            control.stop(reason);
        }
    }
}

/// A status's name, for messages.
fn status_name(status: RunStatus) -> &'static str {
    match status {
        RunStatus::Running => "running",
        RunStatus::Succeeded => "succeeded",
        RunStatus::Failed => "failed",
        RunStatus::Cancelled => "cancelled",
        RunStatus::Incomplete => "incomplete",
        RunStatus::RequiresAction => "waiting",
    }
}

/// Renews the leases of the runs `held` here, all in one call, three times per lease,
/// until `stop` is cancelled; a run whose lease was lost (this replica was paused past it,
/// and another took the run over) stops here at once, without ending.
///
/// The renewals run on a thread with a runtime and a store connection of their own: a
/// replica busy with other work (hundreds of runs taken over at once, each read back and
/// decoded, on a loaded machine) delayed renewals made on its runtime past the lease, and
/// another replica took over runs that were alive.
async fn spawn_lease_renewals(
    held: Arc<Held>,
    store: Arc<dyn RunStore>,
    lease: Duration,
    stop: CancellationToken,
) -> Result<(), StateError> {
    fn cannot(e: &dyn std::fmt::Display) -> StateError {
        StateError::Unavailable(format!("cannot start the thread that renews leases: {e}"))
    }
    // The runtime and its connection are made, used and dropped on the thread (a runtime
    // cannot be dropped on another's); it says when it is ready, or why it cannot be.
    let (ready, started) = tokio::sync::oneshot::channel();
    std::thread::Builder::new()
        .name("lease-renewals".into())
        .spawn(move || {
            let runtime = match tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
            {
                Ok(runtime) => runtime,
                Err(e) => {
                    let _ = ready.send(Err(cannot(&e)));
                    return;
                }
            };
            let renewer = {
                let _entered = runtime.enter();
                store.lease_renewer()
            };
            match renewer {
                Ok(renewer) => {
                    let _ = ready.send(Ok(()));
                    runtime.block_on(renew_leases(&held, renewer.as_ref(), lease, &stop));
                }
                Err(e) => {
                    let _ = ready.send(Err(e));
                }
            }
        })
        .map_err(|e| cannot(&e))?;
    started
        .await
        .unwrap_or_else(|_| Err(cannot(&"the thread ended")))
}

/// The renewals, three times per lease, until `stop` is cancelled.
async fn renew_leases(
    held: &Held,
    renewer: &dyn LeaseRenewer,
    lease: Duration,
    stop: &CancellationToken,
) {
    let mut tick = tokio::time::interval(lease / 3);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tokio::select! {
            () = stop.cancelled() => return,
            _ = tick.tick() => {}
        }
        // Also while the replica hands its runs over: those still stopping keep theirs.
        let leases = held.leases();
        if leases.is_empty() {
            continue;
        }
        let renewed = tokio::select! {
            () = stop.cancelled() => return,
            renewed = renewer.renew(&leases) => renewed,
        };
        match renewed {
            Ok(lost) if lost.is_empty() => {}
            Ok(lost) => {
                // Each with the token it was renewed with.
                let tokens: HashMap<&str, &str> = leases
                    .iter()
                    .map(|lease| (lease.run_id.as_str(), lease.token.as_str()))
                    .collect();
                for run_id in lost {
                    if let Some(token) = tokens.get(run_id.as_str()) {
                        held.lost(&run_id, token);
                    }
                }
            }
            Err(error) => {
                Metrics::global().lease_renewal_failed();
                warn!(%error, runs = leases.len(), "cannot renew the runs' leases");
            }
        }
    }
}

/// Looks for runs whose lease lapsed (their replica died, or handed them over) and
/// continues them here.
async fn take_over_runs(manager: Weak<RunManager>, lease: Duration) {
    let every = (lease / 4).min(TAKEOVER_POLL);
    let mut tick = tokio::time::interval(every);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tick.tick().await;
        let Some(manager) = manager.upgrade() else {
            return;
        };
        if manager.draining.is_cancelled() {
            return;
        }
        if let Err(error) = manager.take_over_lapsed().await {
            debug!(%error, "cannot look for runs to take over");
        }
    }
}

/// Whether `charge`'s principal has `most` runs in progress here (the anonymous principal
/// has no bound of its own).
fn principal_full(usage: &Usage, charge: &Charge, most: usize) -> bool {
    !charge.principal.is_empty()
        && usage
            .per_principal
            .get(&charge.principal)
            .is_some_and(|running| *running >= most)
}

#[cfg(test)]
mod tests {
    use agentrt_state::{
        Answered, InMemoryBus, InMemorySessionStore, MemoryRunStore, Progress, Resumable,
        RunRetention, StopRequests,
    };

    use super::*;

    /// An in-memory run store whose leases last `lease`.
    fn store(lease: Duration) -> Arc<MemoryRunStore> {
        Arc::new(MemoryRunStore::new(RunRetention::unbounded(
            Duration::from_secs(60),
            lease,
        )))
    }

    /// A record of run `run_id` owned by `owner`: its first save takes the lease.
    async fn owned_run(store: &MemoryRunStore, run_id: &str, owner: &str) {
        let mut record = RunRecord::new(run_id, "e", "s", "m", "q");
        record.owner = owner.into();
        let progress = Progress {
            spec: Some("{}".into()),
            agent: Some("{}".into()),
            state: "{}".into(),
            ..Progress::default()
        };
        store.save(&record, 0, Some(&progress)).await.unwrap();
    }

    /// A replica whose runtime is kept from running anything for several leases (as a
    /// burst of runs taken over did on a loaded machine) still holds its runs' leases:
    /// they are renewed from a thread of their own. Once the manager goes, they lapse.
    #[tokio::test(flavor = "current_thread")]
    async fn leases_are_renewed_while_the_runtime_is_busy() {
        let lease = Duration::from_millis(300);
        let store = store(lease);
        owned_run(&store, "r1", "here.1").await;
        let held = Arc::new(Held::default());
        held.resuming().insert("r1".into(), "here.1".into());
        let stop = CancellationToken::new();
        spawn_lease_renewals(held, store.clone(), lease, stop.clone())
            .await
            .unwrap();

        // Nothing else runs on this runtime for four leases.
        std::thread::sleep(lease * 4);
        assert_eq!(
            store.lapsed(10).await.unwrap(),
            Vec::<String>::new(),
            "the lease was renewed while the runtime was busy"
        );

        stop.cancel();
        tokio::time::sleep(lease * 2).await;
        assert_eq!(store.lapsed(10).await.unwrap(), vec!["r1".to_owned()]);
    }

    /// A run store whose take-overs are read late: the call returns only after the
    /// runtime was kept from running anything for four leases, and notes which runs had
    /// lapsed by then.
    struct SlowTakeOver {
        inner: Arc<MemoryRunStore>,
        stall: Duration,
        lapsed_after_take_over: Mutex<Option<Vec<String>>>,
        /// When given, a take-over answers only once a permit is added.
        gate: Option<tokio::sync::Semaphore>,
    }

    #[async_trait::async_trait]
    impl RunStore for SlowTakeOver {
        async fn claim(
            &self,
            session_id: &str,
            message_id: &str,
            run_id: &str,
            replacing: Option<&str>,
        ) -> agentrt_state::StateResult<Claim> {
            self.inner
                .claim(session_id, message_id, run_id, replacing)
                .await
        }
        async fn holder(
            &self,
            session_id: &str,
            message_id: &str,
        ) -> agentrt_state::StateResult<Option<String>> {
            self.inner.holder(session_id, message_id).await
        }
        async fn save(
            &self,
            record: &RunRecord,
            from_step: usize,
            progress: Option<&Progress>,
        ) -> agentrt_state::StateResult<()> {
            self.inner.save(record, from_step, progress).await
        }
        fn lease_renewer(self: Arc<Self>) -> agentrt_state::StateResult<Box<dyn LeaseRenewer>> {
            self.inner.clone().lease_renewer()
        }
        async fn release(&self, leases: &[Lease]) -> agentrt_state::StateResult<()> {
            self.inner.release(leases).await
        }
        async fn defer(&self, lease: &Lease, by: Duration) -> agentrt_state::StateResult<()> {
            self.inner.defer(lease, by).await
        }
        async fn lapsed(&self, limit: usize) -> agentrt_state::StateResult<Vec<String>> {
            self.inner.lapsed(limit).await
        }
        async fn lapsed_waits(&self, limit: usize) -> agentrt_state::StateResult<Vec<String>> {
            self.inner.lapsed_waits(limit).await
        }
        async fn take_over(
            &self,
            run_id: &str,
            token: &str,
        ) -> agentrt_state::StateResult<Option<Resumable>> {
            let taken = self.inner.take_over(run_id, token).await;
            if let Some(gate) = &self.gate
                && let Ok(permit) = gate.acquire().await
            {
                permit.forget();
            }
            std::thread::sleep(self.stall);
            let lapsed = self.inner.lapsed(10).await?;
            *self
                .lapsed_after_take_over
                .lock()
                .unwrap_or_else(PoisonError::into_inner) = Some(lapsed);
            taken
        }
        async fn answer(
            &self,
            run_id: &str,
            answers: &[(String, String)],
        ) -> agentrt_state::StateResult<Answered> {
            self.inner.answer(run_id, answers).await
        }
        async fn cancel_waiting(&self, run_id: &str) -> agentrt_state::StateResult<bool> {
            self.inner.cancel_waiting(run_id).await
        }
        async fn load(&self, run_id: &str) -> agentrt_state::StateResult<Option<RunRecord>> {
            self.inner.load(run_id).await
        }
        async fn request_stop(
            &self,
            run_id: &str,
            reason: StopReason,
        ) -> agentrt_state::StateResult<()> {
            self.inner.request_stop(run_id, reason).await
        }
        async fn stop_requests(&self) -> agentrt_state::StateResult<StopRequests> {
            self.inner.stop_requests().await
        }
    }

    struct NoTools;

    #[async_trait::async_trait]
    impl agentrt_core::ToolRunner for NoTools {
        async fn run(
            &self,
            _call: agentrt_core::ToolInvocation,
            _timeout: Duration,
        ) -> agentrt_core::ToolResult {
            agentrt_core::ToolResult::error("no tools here")
        }
    }

    /// Who waits for a run's end is woken when it ends (here by a task dropped without
    /// ending it), and who comes after does not wait.
    #[tokio::test]
    async fn a_run_end_wakes_who_waits_for_it_and_who_comes_after() {
        let end = Arc::new(RunEnd::default());
        let waiter = tokio::spawn({
            let end = end.clone();
            async move { end.wait().await }
        });
        tokio::task::yield_now().await;
        assert!(!end.is_done() && !waiter.is_finished());
        drop(EndOnDrop(end.clone()));
        tokio::time::timeout(Duration::from_secs(5), waiter)
            .await
            .expect("the waiter woke")
            .unwrap();
        assert!(end.is_done());
        tokio::time::timeout(Duration::from_secs(5), end.wait())
            .await
            .expect("an ended run does not wait");
    }

    /// The task of a run that went to wait ends after the run, answered at once, goes on
    /// here in a new task: the new task's entry stays (it was once removed by the old
    /// task, leaving the run beyond `Cancel` and its lease unrenewed).
    #[tokio::test]
    async fn an_old_task_ending_late_leaves_the_new_task_of_its_run_alone() {
        let manager = RunManager::new(
            Engine::new(
                agentrt_models::ChatModels::default(),
                Arc::new(NoTools),
                Arc::new(InMemorySessionStore::new(
                    agentrt_context::SessionLimits::default(),
                )),
            ),
            Arc::new(InMemoryBus::new(agentrt_events::BusLimits::default())),
            store(Duration::from_secs(10)),
            RunLimits {
                max_active: 10,
                takeover_after: None,
                lease: Duration::from_secs(10),
                max_active_per_principal: 10,
                max_active_bytes: 1 << 20,
            },
        )
        .await
        .unwrap();
        let old = Arc::new(RunControl::default());
        let new = Arc::new(RunControl::default());
        manager.lock().insert(
            "r".into(),
            LocalRun {
                control: new.clone(),
                ended: Arc::default(),
                token: "t2".into(),
                clients: 0,
                kept: false,
            },
        );
        manager.run_ended("r", &old, true);
        assert!(
            manager
                .lock()
                .get("r")
                .is_some_and(|run| Arc::ptr_eq(&run.control, &new)),
            "the new task's entry stays"
        );
        assert!(
            manager.waiting().is_empty(),
            "a run that goes on is not waiting"
        );
        manager.run_ended("r", &new, true);
        assert!(manager.lock().is_empty());
        assert!(manager.waiting().contains("r"), "it waits again");
    }

    /// A run taken over holds its lease from the moment the store gives it, however late
    /// the replica's runtime reads the answer: its lease is renewed (from the renewals'
    /// thread) from before the take-over.
    #[tokio::test(flavor = "current_thread")]
    async fn a_run_taken_over_keeps_its_lease_while_the_answer_is_read_late() {
        let lease = Duration::from_millis(300);
        let inner = lapsed_run(lease).await;

        let store = Arc::new(SlowTakeOver {
            inner: inner.clone(),
            stall: lease * 4,
            lapsed_after_take_over: Mutex::new(None),
            gate: None,
        });
        // This replica looks for lapsed runs at once, and takes r1 over.
        let manager = taking_over(store.clone(), lease).await;
        let lapsed = loop {
            let noted = store
                .lapsed_after_take_over
                .lock()
                .unwrap_or_else(PoisonError::into_inner)
                .take();
            if let Some(lapsed) = noted {
                break lapsed;
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        };
        assert_eq!(
            lapsed,
            Vec::<String>::new(),
            "the lease of the run taken over was renewed while the runtime could not read the take-over's answer"
        );
        drop(manager);
    }

    /// A store with leases of `lease` holding run `r1` of another replica, which died:
    /// its lease lapsed.
    async fn lapsed_run(lease: Duration) -> Arc<MemoryRunStore> {
        let inner = store(lease);
        owned_run(&inner, "r1", "gone.1").await;
        tokio::time::sleep(lease + Duration::from_millis(100)).await;
        assert_eq!(inner.lapsed(10).await.unwrap(), vec!["r1".to_owned()]);
        inner
    }

    /// A run manager on `store` that takes lapsed runs over, with leases of `lease`.
    async fn taking_over(store: Arc<SlowTakeOver>, lease: Duration) -> Arc<RunManager> {
        let engine = Engine::new(
            agentrt_models::ChatModels::default(),
            Arc::new(NoTools),
            Arc::new(InMemorySessionStore::new(
                agentrt_context::SessionLimits::default(),
            )),
        );
        RunManager::new(
            engine,
            Arc::new(InMemoryBus::new(agentrt_events::BusLimits::default())),
            store,
            RunLimits {
                max_active: 10,
                takeover_after: Some(lease),
                lease,
                max_active_per_principal: 10,
                max_active_bytes: 1 << 20,
            },
        )
        .await
        .unwrap()
    }

    /// A run whose take-over ends after this replica began to hand its runs over (and
    /// found none) is let go at once, not left to lapse.
    #[tokio::test]
    async fn a_run_taken_over_as_the_hand_over_began_is_let_go_at_once() {
        let lease = Duration::from_secs(1);
        let inner = lapsed_run(lease).await;

        let store = Arc::new(SlowTakeOver {
            inner: inner.clone(),
            stall: Duration::ZERO,
            lapsed_after_take_over: Mutex::new(None),
            gate: Some(tokio::sync::Semaphore::new(0)),
        });
        let manager = taking_over(store.clone(), lease).await;
        // Taken (its lease this replica's), its take-over not answered yet.
        while !inner.lapsed(10).await.unwrap().is_empty() {
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        manager.hand_over_all().await;
        store.gate.as_ref().unwrap().add_permits(1);
        tokio::time::sleep(Duration::from_millis(300)).await;
        assert_eq!(
            inner.lapsed(10).await.unwrap(),
            vec!["r1".to_owned()],
            "let go at once, well before its lease of 1 s lapses"
        );
        drop(manager);
    }

    /// A renewer that renews nothing: every lease it is sent is lost, and it answers once
    /// told to.
    struct LosesAll {
        sent: tokio::sync::Notify,
        answer: tokio::sync::Semaphore,
    }

    #[async_trait::async_trait]
    impl LeaseRenewer for LosesAll {
        async fn renew(&self, leases: &[Lease]) -> agentrt_state::StateResult<Vec<String>> {
            self.sent.notify_one();
            if let Ok(permit) = self.answer.acquire().await {
                permit.forget();
            }
            Ok(leases.iter().map(|lease| lease.run_id.clone()).collect())
        }
    }

    fn local_run(token: &str) -> (LocalRun, Arc<RunControl>) {
        let control = Arc::new(RunControl::default());
        let run = LocalRun {
            control: control.clone(),
            ended: Arc::default(),
            token: token.into(),
            clients: 0,
            kept: false,
        };
        (run, control)
    }

    /// A lease lost as the renewal answers it stops the run that held that lease, not the
    /// run taken over here again since under another.
    #[tokio::test]
    async fn a_lost_lease_stops_only_the_run_that_held_it() {
        let held = Held::default();
        let (old, old_control) = local_run("t1");
        held.local().insert("r".into(), old);
        let renewer = LosesAll {
            sent: tokio::sync::Notify::new(),
            answer: tokio::sync::Semaphore::new(0),
        };
        let stop = CancellationToken::new();
        let renewals = renew_leases(&held, &renewer, Duration::from_millis(30), &stop);
        let swap = async {
            renewer.sent.notified().await;
            // Taken over again here meanwhile, under a new lease.
            let (new, new_control) = local_run("t2");
            held.local().insert("r".into(), new);
            renewer.answer.add_permits(1);
            tokio::time::sleep(Duration::from_millis(50)).await;
            stop.cancel();
            new_control
        };
        let ((), new_control) = tokio::join!(renewals, swap);
        assert!(!new_control.is_let_go(), "the new lease's run goes on");
        assert!(!old_control.is_let_go(), "gone from here already");

        // The lease it holds lost: stopped.
        let stop = CancellationToken::new();
        renewer.answer.add_permits(1000);
        let renewals = renew_leases(&held, &renewer, Duration::from_millis(30), &stop);
        let stopping = async {
            tokio::time::sleep(Duration::from_millis(100)).await;
            stop.cancel();
        };
        tokio::join!(renewals, stopping);
        assert!(new_control.is_let_go());
    }
}
