//! The runs of this server: starting them, finding them again by id or by idempotency key,
//! stopping them, and forgetting them some time after they end.

use std::{
    collections::{HashMap, VecDeque},
    sync::{
        Arc, Mutex, MutexGuard, PoisonError,
        atomic::{AtomicBool, AtomicUsize, Ordering},
    },
    time::Duration,
};

use agentrt_engine::{Engine, RunControl, RunSpec, RunState, StopReason};
use agentrt_events::{BusError, EventBus, EventStream};
use tokio::{sync::watch, time::Instant};
use tracing::{Instrument, info};

/// A run, as the server tracks it.
pub struct RunHandle {
    /// The run's id.
    pub run_id: String,
    /// Its session.
    pub session_id: String,
    /// Its message id.
    pub message_id: String,
    /// Stops it.
    pub control: Arc<RunControl>,
    /// Its record.
    pub state: Arc<RunState>,
    /// Set when the run was cancelled because the client of its `Execute` went away: a
    /// retry with the same message id starts a new run instead of getting this one back.
    pub disconnected: AtomicBool,
    /// True once it has ended.
    ended: watch::Receiver<bool>,
}

impl RunHandle {
    /// Waits until the run has ended, at most `limit`.
    pub async fn ended_within(&self, limit: Duration) -> bool {
        let mut ended = self.ended.clone();
        tokio::time::timeout(limit, ended.wait_for(|done| *done))
            .await
            .is_ok()
    }
}

/// Why a run could not start.
#[derive(Debug, thiserror::Error)]
pub enum StartError {
    /// The server runs as many runs as it may.
    #[error("this server already runs {0} runs, its limit")]
    Busy(usize),
    /// The bus refused the run.
    #[error(transparent)]
    Bus(#[from] BusError),
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
    /// A new run.
    New(Arc<RunHandle>),
    /// The run that already has this session and message id.
    Existing(Arc<RunHandle>),
}

/// Bounds of the run manager.
#[derive(Debug, Clone, Copy)]
pub struct RunLimits {
    /// Runs in progress at once.
    pub max_active: usize,
    /// How long an ended run stays readable (`Subscribe`, `GetRun`, idempotent `Execute`).
    pub retention: Duration,
}

/// Starts and tracks runs.
pub struct RunManager {
    engine: Engine,
    bus: Arc<dyn EventBus>,
    limits: RunLimits,
    active: AtomicUsize,
    /// Woken when the last active run ends.
    idle: tokio::sync::Notify,
    index: Mutex<Index>,
}

#[derive(Default)]
struct Index {
    by_id: HashMap<String, Arc<RunHandle>>,
    by_message: HashMap<(String, String), String>,
    ended: VecDeque<(Instant, String)>,
}

impl Index {
    fn expire(&mut self, retention: Duration) {
        let now = Instant::now();
        while let Some((at, _)) = self.ended.front() {
            if now.duration_since(*at) < retention {
                break;
            }
            if let Some((_, run_id)) = self.ended.pop_front()
                && let Some(handle) = self.by_id.remove(&run_id)
            {
                self.by_message
                    .remove(&(handle.session_id.clone(), handle.message_id.clone()));
            }
        }
    }
}

impl RunManager {
    /// A manager running `engine`, publishing on `bus`.
    pub fn new(engine: Engine, bus: Arc<dyn EventBus>, limits: RunLimits) -> Arc<Self> {
        Arc::new(Self {
            engine,
            bus,
            limits,
            active: AtomicUsize::new(0),
            idle: tokio::sync::Notify::new(),
            index: Mutex::new(Index::default()),
        })
    }

    fn lock(&self) -> MutexGuard<'_, Index> {
        // Each critical section leaves the maps consistent before anything can panic.
        self.index.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Starts the run `spec`, or finds the run with the same session and message id.
    pub fn start(self: &Arc<Self>, spec: RunSpec) -> Result<Started, StartError> {
        let key = (spec.session_id.clone(), spec.message_id.clone());
        let (handle, publisher, control, state, done) = {
            let mut index = self.lock();
            index.expire(self.limits.retention);
            if let Some(existing) = index
                .by_message
                .get(&key)
                .and_then(|id| index.by_id.get(id))
            {
                // A retry after the client's own disconnect cancelled the run gets a new
                // run (the old one stays readable by its id); any other repeat gets the
                // run back, provided it asks the same.
                if !existing.disconnected.load(Ordering::Acquire) {
                    let same = {
                        let record = existing.state.lock();
                        record.query == spec.query && record.engine_id == spec.engine_id
                    };
                    if !same {
                        return Err(StartError::MessageIdReused {
                            message_id: spec.message_id.clone(),
                            run_id: existing.run_id.clone(),
                        });
                    }
                    return Ok(Started::Existing(existing.clone()));
                }
            }
            let active = self.active.load(Ordering::Acquire);
            if active >= self.limits.max_active {
                return Err(StartError::Busy(active));
            }
            let publisher = self.bus.open(&spec.run_id)?;
            self.active.fetch_add(1, Ordering::AcqRel);
            let control = Arc::new(RunControl::default());
            let state = Arc::new(RunState::new(
                &spec.run_id,
                &spec.engine_id,
                &spec.session_id,
                &spec.message_id,
                &spec.query,
            ));
            let (done, ended) = watch::channel(false);
            let handle = Arc::new(RunHandle {
                run_id: spec.run_id.clone(),
                session_id: spec.session_id.clone(),
                message_id: spec.message_id.clone(),
                control: control.clone(),
                state: state.clone(),
                disconnected: AtomicBool::new(false),
                ended,
            });
            index.by_id.insert(spec.run_id.clone(), handle.clone());
            index.by_message.insert(key, spec.run_id.clone());
            (handle, publisher, control, state, done)
        };
        info!(run_id = %spec.run_id, session_id = %spec.session_id, "run started");
        let manager = self.clone();
        let run_id = spec.run_id.clone();
        // The run is owned by the manager: it always ends (it is bounded by its timeout and
        // stopped by `stop_all` on shutdown), and then deregisters itself.
        // The run belongs to the call that started it: its spans are children of the
        // call's span (and so of the caller's trace).
        let call_span = tracing::Span::current();
        tokio::spawn(
            async move {
                manager.engine.run(spec, publisher, state, control).await;
                if manager.active.fetch_sub(1, Ordering::AcqRel) == 1 {
                    manager.idle.notify_waiters();
                }
                manager.lock().ended.push_back((Instant::now(), run_id));
                let _ = done.send(true);
            }
            .instrument(call_span),
        );
        Ok(Started::New(handle))
    }

    /// The run `run_id`, while it runs and for the retention after.
    pub fn get(&self, run_id: &str) -> Option<Arc<RunHandle>> {
        let mut index = self.lock();
        index.expire(self.limits.retention);
        index.by_id.get(run_id).cloned()
    }

    /// The run's events after `after_sequence`.
    pub fn events(&self, run_id: &str, after_sequence: u64) -> Result<EventStream, BusError> {
        self.bus.subscribe(run_id, after_sequence)
    }

    /// Resolves once no run is in progress.
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

    /// Stops every run in progress for `reason`.
    pub fn stop_all(&self, reason: StopReason) {
        let handles: Vec<Arc<RunHandle>> = self.lock().by_id.values().cloned().collect();
        for handle in handles {
            handle.control.stop(reason);
        }
    }
}
