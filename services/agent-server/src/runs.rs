//! The runs this replica executes, and the ways to reach any run: starting one (or finding
//! the one a message id already names), stopping one wherever it executes, reading its
//! record. What a client can observe comes from the shared stores, so it does not depend
//! on which replica it asks.

use std::{
    collections::HashMap,
    sync::{
        Arc, Mutex, MutexGuard, PoisonError, Weak,
        atomic::{AtomicUsize, Ordering},
    },
    time::Duration,
};

use agentrt_engine::{Engine, RunControl, RunError, RunSpec, StopReason};
use agentrt_events::{BusError, EventBus, EventStream};
use agentrt_state::{Claim, RunRecord, RunStatus, RunStore, StateError};
use futures_util::{FutureExt, StreamExt};
use tokio::sync::watch;
use tracing::{Instrument, error, info, warn};

/// Why a run could not start.
#[derive(Debug, thiserror::Error)]
pub enum RunStartError {
    /// The server runs as many runs as it may.
    #[error("this server already runs {0} runs, its limit")]
    Busy(usize),
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
        "message id {message_id:?} was already used in this session for run {run_id:?}, with another query"
    )]
    MessageIdReused {
        /// The message id.
        message_id: String,
        /// The run that has it.
        run_id: String,
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
}

/// How long a claimed message id may go without its run's record before another request
/// takes it over (the replica that claimed it writes the record at once, unless it died).
const CLAIM_PATIENCE: Duration = Duration::from_secs(2);

/// A run executing on this replica.
struct LocalRun {
    control: Arc<RunControl>,
    ended: watch::Receiver<bool>,
}

/// Starts runs here and reaches runs anywhere.
pub struct RunManager {
    engine: Engine,
    bus: Arc<dyn EventBus>,
    store: Arc<dyn RunStore>,
    limits: RunLimits,
    active: AtomicUsize,
    /// Woken when the last active run ends.
    idle: tokio::sync::Notify,
    local: Mutex<HashMap<String, LocalRun>>,
}

/// A slot of `max_active`, given back when dropped.
struct Slot<'a>(&'a RunManager);

impl Drop for Slot<'_> {
    fn drop(&mut self) {
        self.0.release();
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
        let manager = Arc::new(Self {
            engine,
            bus,
            store: store.clone(),
            limits,
            active: AtomicUsize::new(0),
            idle: tokio::sync::Notify::new(),
            local: Mutex::new(HashMap::new()),
        });
        let mut requests = store.stop_requests().await?;
        let weak: Weak<Self> = Arc::downgrade(&manager);
        tokio::spawn(async move {
            while let Some(request) = requests.next().await {
                let Some(manager) = weak.upgrade() else {
                    return;
                };
                if let Some(run) = manager.lock().get(&request.run_id) {
                    info!(run_id = %request.run_id, reason = request.reason.as_str(), "stop requested");
                    run.control.stop(request.reason);
                }
            }
        });
        Ok(manager)
    }

    fn lock(&self) -> MutexGuard<'_, HashMap<String, LocalRun>> {
        // Each critical section leaves the map consistent before anything can panic.
        self.local.lock().unwrap_or_else(PoisonError::into_inner)
    }

    fn release(&self) {
        if self.active.fetch_sub(1, Ordering::AcqRel) == 1 {
            self.idle.notify_waiters();
        }
    }

    /// Starts the run `spec`, or finds the run with the same session and message id.
    pub async fn start(self: &Arc<Self>, spec: RunSpec) -> Result<Started, RunStartError> {
        let active = self.active.fetch_add(1, Ordering::AcqRel);
        let slot = Slot(self);
        if active >= self.limits.max_active {
            return Err(RunStartError::Busy(active));
        }
        if let Some(existing) = self.claim(&spec).await? {
            return Ok(Started::Existing(existing));
        }
        let publisher = self.bus.open(&spec.run_id).await?;
        let control = Arc::new(RunControl::default());
        let run_id = spec.run_id.clone();
        let session_id = spec.session_id.clone();
        let started = self
            .engine
            .start(spec, publisher, self.store.clone(), control.clone())
            .await
            .map_err(RunStartError::Failed)?;
        let (done, ended) = watch::channel(false);
        self.lock()
            .insert(run_id.clone(), LocalRun { control, ended });
        std::mem::forget(slot); // given back by the run's task
        info!(%run_id, %session_id, "run started");
        let manager = self.clone();
        // The run belongs to the call that started it: its spans are children of the
        // call's span (and so of the caller's trace). It is owned by the manager: it always
        // ends (bounded by its timeout, stopped by `stop_all` on shutdown), and a panic in
        // it ends it too, with one `done` event.
        let call_span = tracing::Span::current();
        let task_run_id = run_id.clone();
        tokio::spawn(
            async move {
                let outcome = std::panic::AssertUnwindSafe(started.run())
                    .catch_unwind()
                    .await;
                if outcome.is_err() {
                    error!(run_id = %task_run_id, "the run panicked");
                    manager.record_panic(&task_run_id).await;
                }
                manager.lock().remove(&task_run_id);
                manager.release();
                let _ = done.send(true);
            }
            .instrument(call_span),
        );
        Ok(Started::New(run_id))
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
            let abandoned_here = self
                .lock()
                .get(&holder)
                .is_some_and(|run| run.control.is_abandoned());
            match self.store.load(&holder).await? {
                Some(record) if !record.abandoned && !abandoned_here => {
                    // A repeat gets the run back, provided it asks the same.
                    if record.query == spec.query && record.engine_id == spec.engine_id {
                        return Ok(Some(holder));
                    }
                    return Err(RunStartError::MessageIdReused {
                        message_id: spec.message_id.clone(),
                        run_id: holder,
                    });
                }
                // Given up by its client: a retry gets a new run (the old one stays
                // readable by its id).
                Some(_) => replacing = Some(holder),
                // Claimed a moment ago, its record not written yet; or its replica died
                // before writing it.
                None if waited < CLAIM_PATIENCE => {
                    tokio::time::sleep(Duration::from_millis(20)).await;
                    waited += Duration::from_millis(20);
                }
                None => replacing = Some(holder),
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
                let steps = record.steps.len();
                if let Err(error) = self.store.save(&record, steps).await {
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

    /// Stops a run executing here because the client of its `Execute` went away.
    pub fn abandon(&self, run_id: &str) {
        if let Some(run) = self.lock().get(run_id)
            && !*run.ended.borrow()
        {
            info!(%run_id, "client disconnected, cancelling the run");
            run.control.abandon();
        }
    }

    /// Stops the run wherever it executes and waits, at most `wait`, for it to end;
    /// answers its record then. `None` for an unknown run.
    pub async fn cancel(
        &self,
        run_id: &str,
        wait: Duration,
    ) -> Result<Option<RunRecord>, StateError> {
        let Some(record) = self.store.load(run_id).await? else {
            return Ok(None);
        };
        if record.ended() {
            return Ok(Some(record));
        }
        let local = self
            .lock()
            .get(run_id)
            .map(|run| (run.control.clone(), run.ended.clone()));
        match local {
            Some((control, mut ended)) => {
                control.stop(StopReason::Cancelled);
                let _ = tokio::time::timeout(wait, ended.wait_for(|done| *done)).await;
            }
            None => {
                self.store
                    .request_stop(run_id, StopReason::Cancelled)
                    .await?;
                let deadline = tokio::time::Instant::now() + wait;
                while tokio::time::Instant::now() < deadline {
                    tokio::time::sleep(Duration::from_millis(20)).await;
                    if let Some(record) = self.store.load(run_id).await?
                        && record.ended()
                    {
                        return Ok(Some(record));
                    }
                }
            }
        }
        self.store.load(run_id).await.map(|r| r.or(Some(record)))
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
