//! The event bus: every run publishes its events here, and every reader of a run
//! (`Execute`, `Subscribe`, any number of them) follows it from here.
//!
//! Each run has a log: events get sequence numbers 1, 2, 3, ... as they are published and
//! stay in the log (up to a bound) so that a reader can attach at any point, replay what
//! it missed and follow live until the `done` event. Readers read the log at their own
//! pace: a slow reader never blocks the run or other readers; if it falls further behind
//! than the log keeps, it is told exactly which events it lost. After a run ends its log
//! is kept for a time-to-live, then dropped; the logs of ended runs together keep at most
//! a set number of events, and the oldest go first when more runs end.

use std::{
    collections::{HashMap, VecDeque},
    pin::Pin,
    sync::{Arc, LazyLock, Mutex, MutexGuard, PoisonError, Weak},
    time::{Duration, SystemTime},
};

use agentrt_core::{StateError, packed::Packer};
use futures_util::Stream;
use serde::{Deserialize, Serialize};
use tokio::{sync::Notify, time::Instant};

/// What an event carries.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub enum EventKind {
    /// A reasoning delta.
    Thought,
    /// A complete tool call.
    ToolCall,
    /// A tool's result.
    ToolResult,
    /// An answer delta, or the successful end of a run.
    FinalAnswer,
    /// References returned by tools.
    References,
    /// An error, or the failed end of a run.
    Error,
    /// The first event of every run, published before the model is called.
    RunStarted,
    /// A model round runs again on another replica: the text deltas of its iteration
    /// published before are void.
    RoundRestarted,
    /// The run waits for tool outputs or approvals.
    ActionRequired,
}

/// One event of a run.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct RunEvent {
    /// What it carries.
    pub kind: EventKind,
    /// Text delta, or an error message.
    pub content: String,
    /// Structured payload; `None` on plain text deltas, which keeps them cheap (boxed, so
    /// that a delta does not carry the room of the largest payload).
    pub data: Option<Box<EventData>>,
    /// Whether this is the run's last event.
    pub done: bool,
    /// The model round, from 1.
    pub iteration: u32,
    /// Position in the run, from 1; assigned when published.
    pub sequence: u64,
    /// When it was made.
    pub time: SystemTime,
}

impl RunEvent {
    /// About how many bytes the event holds (its text and data, and what every event
    /// costs), as a bound on what the logs of ended runs keep counts it.
    pub fn weight(&self) -> usize {
        const EVENT: usize = 160;
        let data = match self.data.as_deref() {
            None => 0,
            Some(EventData::ToolCall {
                id,
                name,
                arguments,
            }) => id.len() + name.len() + arguments.as_str().len(),
            Some(EventData::ToolResult {
                id, name, output, ..
            }) => id.len() + name.len() + output.len(),
            Some(EventData::References {
                tool_call_id,
                references,
                ..
            }) => {
                tool_call_id.len()
                    + references
                        .iter()
                        .map(|r| r.to_string().len() * 4)
                        .sum::<usize>()
            }
            Some(EventData::RunStarted { engine_id, agent }) => engine_id.len() + agent.len(),
            Some(EventData::RoundRestarted { reason, .. }) => reason.len(),
            Some(EventData::ActionRequired { tool_calls }) => tool_calls
                .iter()
                .map(|c| EVENT + c.id.len() + c.name.len() + c.arguments.as_str().len())
                .sum(),
            Some(EventData::End(summary)) => summary
                .error
                .as_ref()
                .map_or(0, |e| e.code.len() + e.message.len()),
        };
        EVENT + self.content.len() + data
    }

    /// The `done` event a bus publishes for a run whose publisher went away without one
    /// (a bug, or a panic in the run), so that no reader waits forever.
    pub fn ended_without_end() -> Self {
        let message = "the run ended without a final event";
        // What the run used is not known here: not said to be nothing (estimated). Its
        // iteration is 0, of no round: by the final answer rule, it ends with no answer.
        let data = EventData::End(RunSummary {
            stop_reason: "internal_error",
            prompt_tokens: 0,
            completion_tokens: 0,
            usage_estimated: true,
            iterations: 0,
            note: None,
            error: Some(RunFailure {
                code: "INTERNAL".into(),
                message: message.into(),
                category: "internal",
                retryable: true,
            }),
        });
        Self {
            done: true,
            ..Self::new(EventKind::Error, 0, message.into(), Some(data))
        }
    }

    /// A new event; its sequence is assigned when it is published.
    pub fn new(kind: EventKind, iteration: u32, content: String, data: Option<EventData>) -> Self {
        Self {
            kind,
            content,
            data: data.map(Box::new),
            done: false,
            iteration,
            sequence: 0,
            time: SystemTime::now(),
        }
    }
}

/// The structured payload of an event, typed: a JSON tree per event cost more memory than
/// the rest of a run. Clients see it as the object [`EventData::to_json`] gives.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub enum EventData {
    /// A complete tool call.
    ToolCall {
        /// The call's id.
        id: String,
        /// The tool.
        name: String,
        /// The arguments (the raw text as a string when they were not valid JSON),
        /// shared with the run's record.
        arguments: JsonText,
    },
    /// A tool's result.
    ToolResult {
        /// The call's id.
        id: String,
        /// The tool.
        name: String,
        /// What the model is given.
        output: String,
        /// Whether the call failed.
        is_error: bool,
        /// How long it took.
        duration_ms: u64,
    },
    /// References a tool returned.
    References {
        /// The call that returned them.
        tool_call_id: String,
        /// Objects with `title`, `url`, `snippet`, `score` and `source`.
        references: Vec<serde_json::Value>,
        /// How reranking went, when the agent has a rerank model.
        rerank: Option<RerankOutcome>,
    },
    /// The start of a run.
    RunStarted {
        /// The engine the run is on.
        engine_id: String,
        /// The agent's name.
        agent: String,
    },
    /// A model round that runs again on a new owner.
    RoundRestarted {
        /// The round.
        iteration: u32,
        /// `takeover` (the previous owner's lease lapsed) or `handover` (it let the run
        /// go as it shut down).
        reason: String,
    },
    /// The run waits for answers to these calls.
    ActionRequired {
        /// The calls, in call order.
        tool_calls: Vec<PendingCall>,
    },
    /// The end of a run.
    End(RunSummary),
}

/// What a waiting run needs for a call.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub enum Action {
    /// A decision: the tool requires approval.
    Approve,
    /// An output: the caller runs the tool itself.
    ClientExecute,
}

impl Action {
    /// The name clients see.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Approve => "approve",
            Self::ClientExecute => "client_execute",
        }
    }
}

/// A call a waiting run needs an answer for.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct PendingCall {
    /// The call's id.
    pub id: String,
    /// The tool.
    pub name: String,
    /// The arguments the model gave.
    pub arguments: JsonText,
    /// What it needs.
    pub action: Action,
    /// Whether its answer arrived (filled in by the store when the record is read).
    #[serde(default, skip_serializing)]
    pub answered: bool,
}

/// How the reranking of a call's references went.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub enum RerankOutcome {
    /// The references are the reranker's best, best first, scored by it.
    Reranked,
    /// The reranker failed: the references are in the tool's order.
    Failed(String),
}

/// A JSON value kept as its text, shared: a parsed object costs twenty times the memory of
/// its text, and tool-call arguments are kept for as long as their run's log and record.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct JsonText(Arc<str>);

impl JsonText {
    /// The text of `value`.
    pub fn new(value: &serde_json::Value) -> Self {
        Self(value.to_string().into())
    }

    /// The value, parsed again.
    pub fn value(&self) -> serde_json::Value {
        // The text was written from a value, so it parses.
        serde_json::from_str(&self.0).unwrap_or_default()
    }

    /// The text.
    pub fn as_str(&self) -> &str {
        &self.0
    }
}

/// How a run ended: the payload of its `done` event.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct RunSummary {
    /// Why it ended, e.g. `final_answer` or `cancelled`.
    pub stop_reason: &'static str,
    /// Tokens in prompts.
    pub prompt_tokens: u64,
    /// Tokens generated.
    pub completion_tokens: u64,
    /// Whether the token counts were counted by the server for at least one model call
    /// whose provider reported none.
    pub usage_estimated: bool,
    /// Model rounds.
    pub iterations: u32,
    /// A note for people on how the run ended, when the stop reason needs one (the answer
    /// of a `max_tokens` run is cut short).
    pub note: Option<String>,
    /// Why it failed, when it did.
    pub error: Option<RunFailure>,
}

/// Why a run failed, in its `done` event.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct RunFailure {
    /// Stable machine-readable code.
    pub code: String,
    /// For people.
    pub message: String,
    /// `model`, `tool`, `timeout`, `cancelled`, `budget` or `internal`.
    pub category: &'static str,
    /// Whether sending the same request again may succeed.
    pub retryable: bool,
}

/// The names a run's stop reason and an error's category take, so that they stay
/// `&'static str` when read back from a store.
const NAMES: &[&str] = &[
    "final_answer",
    "max_iterations",
    "cancelled",
    "timeout",
    "model_error",
    "shutdown",
    "internal_error",
    "max_tokens",
    "action_timeout",
    "budget_exceeded",
    "model",
    "tool",
    "budget",
    "internal",
];

/// `name` as one of [`NAMES`]; a name this version does not know reads as `unknown`.
pub fn static_name_of(name: &str) -> &'static str {
    NAMES
        .iter()
        .find(|n| **n == name)
        .copied()
        .unwrap_or("unknown")
}

/// [`RunSummary`] as stored, with owned names.
#[derive(Deserialize)]
struct StoredSummary {
    stop_reason: String,
    prompt_tokens: u64,
    completion_tokens: u64,
    usage_estimated: bool,
    iterations: u32,
    note: Option<String>,
    error: Option<RunFailure>,
}

impl<'de> Deserialize<'de> for RunSummary {
    fn deserialize<D: serde::Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        StoredSummary::deserialize(deserializer).map(Self::from)
    }
}

impl<'de> Deserialize<'de> for RunFailure {
    fn deserialize<D: serde::Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        StoredFailure::deserialize(deserializer).map(Self::from)
    }
}

impl From<StoredSummary> for RunSummary {
    fn from(stored: StoredSummary) -> Self {
        Self {
            stop_reason: static_name_of(&stored.stop_reason),
            prompt_tokens: stored.prompt_tokens,
            completion_tokens: stored.completion_tokens,
            usage_estimated: stored.usage_estimated,
            iterations: stored.iterations,
            note: stored.note,
            error: stored.error,
        }
    }
}

/// [`RunFailure`] as stored, with owned names.
#[derive(Deserialize)]
struct StoredFailure {
    code: String,
    message: String,
    category: String,
    retryable: bool,
}

impl From<StoredFailure> for RunFailure {
    fn from(stored: StoredFailure) -> Self {
        Self {
            code: stored.code,
            message: stored.message,
            category: static_name_of(&stored.category),
            retryable: stored.retryable,
        }
    }
}

impl EventData {
    /// The payload as the JSON object clients see.
    pub fn to_json(&self) -> serde_json::Value {
        use serde_json::json;
        match self {
            Self::ToolCall {
                id,
                name,
                arguments,
            } => json!({"id": id, "name": name, "arguments": arguments.value()}),
            Self::ToolResult {
                id,
                name,
                output,
                is_error,
                duration_ms,
            } => json!({
                "id": id, "name": name, "output": output,
                "is_error": is_error, "duration_ms": duration_ms,
            }),
            Self::References {
                tool_call_id,
                references,
                rerank,
            } => {
                let mut data = json!({"tool_call_id": tool_call_id, "references": references});
                match rerank {
                    Some(RerankOutcome::Reranked) => data["rerank"] = json!({"status": "reranked"}),
                    Some(RerankOutcome::Failed(error)) => {
                        data["rerank"] = json!({"status": "failed", "error": error});
                    }
                    None => {}
                }
                data
            }
            Self::RunStarted { engine_id, agent } => {
                json!({"engine_id": engine_id, "agent": agent})
            }
            Self::RoundRestarted { iteration, reason } => {
                json!({"iteration": iteration, "reason": reason})
            }
            Self::ActionRequired { tool_calls } => {
                let calls: Vec<serde_json::Value> = tool_calls
                    .iter()
                    .map(|c| {
                        json!({
                            "id": c.id, "name": c.name,
                            "arguments": c.arguments.value(), "action": c.action.as_str(),
                        })
                    })
                    .collect();
                json!({"tool_calls": calls})
            }
            Self::End(summary) => {
                let mut data = json!({
                    "stop_reason": summary.stop_reason,
                    "usage": {
                        "prompt_tokens": summary.prompt_tokens,
                        "completion_tokens": summary.completion_tokens,
                        "total_tokens": summary.prompt_tokens.saturating_add(summary.completion_tokens),
                        "estimated": summary.usage_estimated,
                    },
                    "iterations": summary.iterations,
                });
                if let Some(note) = &summary.note {
                    data["message"] = json!(note);
                }
                if let Some(error) = &summary.error {
                    data["code"] = json!(error.code);
                    data["message"] = json!(error.message);
                    data["category"] = json!(error.category);
                    data["retryable"] = json!(error.retryable);
                }
                data
            }
        }
    }
}

/// Why a run's events cannot be read.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum BusError {
    /// No run has this id, or its log expired.
    #[error("no events for run {0:?}: unknown, or expired after the run ended")]
    UnknownRun(String),
    /// A run with this id already publishes.
    #[error("run {0:?} already exists")]
    DuplicateRun(String),
    /// The bus's store cannot be reached; the message names it.
    #[error("{0}")]
    Unavailable(String),
    /// The run is no longer this publisher's: another replica took it over.
    #[error("run {0:?} is now executed by another replica")]
    Fenced(String),
    /// The run moved to another replica while this one served the stream: the reader
    /// resumes, on any replica, after `after`.
    #[error("the run moved to another replica; resume with Subscribe after sequence {after}")]
    Moved {
        /// The last event the reader was given.
        after: u64,
    },
    /// The reader asked for, or fell behind to, events the log no longer keeps.
    #[error(
        "events {from} to {to} of this run are no longer retained (runs.events_per_run); resume after {to}"
    )]
    Lagged {
        /// First event lost.
        from: u64,
        /// Last event lost.
        to: u64,
    },
}

impl From<StateError> for BusError {
    fn from(error: StateError) -> Self {
        match error {
            StateError::Fenced(run_id) => Self::Fenced(run_id),
            error => Self::Unavailable(error.to_string()),
        }
    }
}

/// A reader's stream of a run's events, ending after the `done` event.
pub type EventStream = Pin<Box<dyn Stream<Item = Result<Arc<RunEvent>, BusError>> + Send>>;

/// Publishes the events of one run. The run is its only publisher.
///
/// Events are published in batches: a run gathers the text deltas of a model chunk and
/// publishes them together with the next complete event or before it waits for anything,
/// so that readers wake, and a shared store is written, once per batch rather than once
/// per delta.
#[async_trait::async_trait]
pub trait RunPublisher: Send + Sync {
    /// Appends `events` in order, giving each the next sequence number. After an event
    /// with `done`, later events are dropped: a run ends exactly once. Once this returns,
    /// every reader can read the events, except that a shared bus may hold plain text
    /// deltas for a few milliseconds to write them together (anything else, and the
    /// deltas before it, is readable on return). On an error the events are kept, with
    /// their numbers, and written by the next call (which may publish nothing new).
    async fn publish(&self, events: Vec<RunEvent>) -> Result<(), BusError>;

    /// As [`RunPublisher::publish`], except that a shared bus may hold any of the events
    /// for a few milliseconds, or until the next publish or checkpoint, to write them
    /// together with what follows: for events published just before the run waits on a
    /// call that is often quick (a model's next reply). Readers still get every event,
    /// in order, within those milliseconds.
    async fn publish_soon(&self, events: Vec<RunEvent>) -> Result<(), BusError> {
        self.publish(events).await
    }

    /// Writes what is buffered and lets the run go without ending it: another replica
    /// continues it. Readers following the run through this publisher's copy get
    /// [`BusError::Moved`] after its last event; nothing more is published here.
    async fn release(&self) -> Result<(), BusError>;

    /// Writes what is buffered and lets the log go without ending it, because the run
    /// waits (for tool outputs or approvals): readers keep following it, and whichever
    /// replica continues the run later resumes the log (`EventBus::resume`). A shared bus
    /// does this as [`RunPublisher::release`] does (its readers go on reading the shared
    /// log).
    async fn park(&self) -> Result<(), BusError> {
        self.release().await
    }

    /// This publisher as `Any`: a run store kept in the same backend as the bus may
    /// write a checkpoint's events together with the run's record (see the state crate's
    /// `RunStore::checkpoint`). `None` when it cannot.
    fn as_any(&self) -> Option<&(dyn std::any::Any + Send + Sync)> {
        None
    }
}

/// A log continued by a new owner: what was published after the point it resumes from,
/// and the publisher that goes on from the log's end.
pub struct Resumed {
    /// The events after the sequence asked for, in order.
    pub tail: Vec<Arc<RunEvent>>,
    /// Publishes from the log's last sequence on.
    pub publisher: Box<dyn RunPublisher>,
}

/// Where runs publish their events and readers follow them, from any replica when the
/// bus is shared.
#[async_trait::async_trait]
pub trait EventBus: Send + Sync {
    /// Opens the log of a new run, executed by `owner` (its lease token; see
    /// `RunStore`): on a shared bus, a publisher whose owner lost the run to another
    /// replica fails with [`BusError::Fenced`], writing nothing.
    async fn open(&self, run_id: &str, owner: &str) -> Result<Box<dyn RunPublisher>, BusError>;
    /// Continues the log of a run that `owner` took over: the events after `after`, and
    /// a publisher numbering on from the log's last event.
    async fn resume(&self, run_id: &str, owner: &str, after: u64) -> Result<Resumed, BusError>;
    /// Follows a run from `after_sequence` (0 for the start), replaying what the log
    /// keeps, until its `done` event.
    async fn subscribe(&self, run_id: &str, after_sequence: u64) -> Result<EventStream, BusError>;
}

/// Bounds of the in-process bus.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct BusLimits {
    /// Events kept per run; older ones are dropped first.
    pub events_per_run: usize,
    /// How long a finished run's log stays readable.
    pub retention: Duration,
    /// Events kept in the logs of finished runs, all together: when a run ends beyond it,
    /// the logs of the runs that ended first are dropped before their retention is over.
    /// Readers already following a dropped log still read it to its end.
    pub retained_events: usize,
    /// Bytes of the events (their text and data, about) kept in the logs of finished runs,
    /// all together; beyond, the logs of the runs that ended first are dropped as with
    /// `retained_events`.
    pub retained_bytes: usize,
}

impl Default for BusLimits {
    fn default() -> Self {
        Self {
            events_per_run: 10_000,
            retention: Duration::from_secs(600),
            retained_events: 1_000_000,
            retained_bytes: 128 * 1024 * 1024,
        }
    }
}

/// The in-process bus.
pub struct InMemoryBus {
    limits: BusLimits,
    inner: Arc<Mutex<BusState>>,
}

#[derive(Default)]
struct BusState {
    runs: HashMap<Box<str>, Log>,
    /// Finished runs in the order they finished, with the events their logs keep.
    finished: VecDeque<Finished>,
    /// Events in the logs of `finished`, all together.
    retained: usize,
    /// Bytes ([`RunEvent::weight`]) of the events in `finished`.
    retained_bytes: usize,
}

struct Finished {
    at: Instant,
    run_id: String,
    events: usize,
    bytes: usize,
}

impl BusState {
    /// Drops the log of the run that finished first.
    fn drop_oldest(&mut self) {
        if let Some(oldest) = self.finished.pop_front() {
            self.runs.remove(oldest.run_id.as_str());
            self.retained = self.retained.saturating_sub(oldest.events);
            self.retained_bytes = self.retained_bytes.saturating_sub(oldest.bytes);
        }
    }
}

/// A run's log, as the bus holds it.
enum Log {
    /// Its run runs (or ended): the bus holds the log, with its publisher and readers.
    Open(Arc<RunLog>),
    /// Its run waits for answers: the readers that still follow it hold the log, the bus
    /// does not; the last of them to let it go packs it.
    Waiting(Weak<RunLog>),
    /// Its run waits and nobody follows it: its events, packed (100,000 runs may wait at
    /// once, each for hours). A reader, or the run going on, opens it again.
    Packed(Box<[u8]>),
}

impl Log {
    /// Whether this entry is `log` (open, or waiting and followed).
    fn is(&self, log: *const RunLog) -> bool {
        match self {
            Self::Open(open) => std::ptr::eq(Arc::as_ptr(open), log),
            Self::Waiting(weak) => std::ptr::eq(weak.as_ptr(), log),
            Self::Packed(_) => false,
        }
    }
}

/// A waiting run's log as it is packed.
#[derive(Serialize)]
struct PackingLog<'a> {
    first: u64,
    next: u64,
    events: Vec<&'a RunEvent>,
}

/// A waiting run's log as it is unpacked.
#[derive(Deserialize)]
struct PackedLog {
    first: u64,
    next: u64,
    events: Vec<RunEvent>,
}

/// Packs waiting runs' logs, primed with the log of a run that waits for a tool call.
static PACKER: LazyLock<Packer> = LazyLock::new(|| {
    let event = |kind, data| RunEvent {
        sequence: 1,
        iteration: 1,
        time: SystemTime::UNIX_EPOCH,
        ..RunEvent::new(kind, 1, String::new(), Some(data))
    };
    let call = PendingCall {
        id: "call_".into(),
        name: String::new(),
        arguments: JsonText::new(&serde_json::json!({})),
        action: Action::ClientExecute,
        answered: false,
    };
    let events = [
        event(
            EventKind::RunStarted,
            EventData::RunStarted {
                engine_id: "00000000-0000-0000-0000-000000000000".into(),
                agent: String::new(),
            },
        ),
        event(
            EventKind::ToolCall,
            EventData::ToolCall {
                id: call.id.clone(),
                name: String::new(),
                arguments: call.arguments.clone(),
            },
        ),
        event(
            EventKind::ActionRequired,
            EventData::ActionRequired {
                tool_calls: vec![
                    PendingCall {
                        action: Action::Approve,
                        ..call.clone()
                    },
                    call,
                ],
            },
        ),
    ];
    let sample = PackingLog {
        first: 1,
        next: 4,
        events: events.iter().collect(),
    };
    Packer::new(serde_json::to_vec(&sample).unwrap_or_default())
});

struct RunLog {
    /// The run.
    run_id: Box<str>,
    /// The bus, which gets the log packed when the run waits and its last holder lets it
    /// go.
    bus: Weak<Mutex<BusState>>,
    state: Mutex<LogState>,
    /// Wakes the readers waiting for more (a `Notify` is 32 bytes, a `watch` channel about
    /// 350: every run has a log, and 100,000 may be in flight or waiting).
    published: Notify,
    capacity: usize,
}

struct LogState {
    events: VecDeque<Arc<RunEvent>>,
    /// Sequence of `events[0]`.
    first: u64,
    /// Sequence the next event gets.
    next: u64,
    done: bool,
    /// Whether its publisher let the run go to another replica.
    moved: bool,
    /// Whether the run waits: no publisher now, no end yet.
    parked: bool,
}

fn lock<T>(mutex: &Mutex<T>) -> MutexGuard<'_, T> {
    // Every critical section here leaves the state consistent before it can panic.
    mutex.lock().unwrap_or_else(PoisonError::into_inner)
}

impl RunLog {
    /// The log `packed` holds, of the waiting run `run_id`.
    fn unpack(
        run_id: &str,
        packed: &[u8],
        bus: &Arc<Mutex<BusState>>,
        capacity: usize,
    ) -> Result<Self, BusError> {
        let unreadable = |error: String| {
            BusError::Unavailable(format!(
                "the events of run {run_id:?} cannot be read: {error}"
            ))
        };
        let json = PACKER
            .unpack(packed)
            .map_err(|e| unreadable(e.to_string()))?;
        let log: PackedLog =
            serde_json::from_slice(&json).map_err(|e| unreadable(e.to_string()))?;
        Ok(Self {
            run_id: run_id.into(),
            bus: Arc::downgrade(bus),
            state: Mutex::new(LogState {
                events: log.events.into_iter().map(Arc::new).collect(),
                first: log.first,
                next: log.next,
                done: false,
                moved: false,
                parked: true,
            }),
            published: Notify::new(),
            capacity,
        })
    }
}

impl Drop for RunLog {
    /// The last holder of a waiting run's log packs it into the bus. (No holder lets one go
    /// while it holds the bus's lock: the bus holds no waiting run's log itself.)
    fn drop(&mut self) {
        let state = self.state.get_mut().unwrap_or_else(PoisonError::into_inner);
        if !state.parked || state.done || state.moved {
            return;
        }
        let Some(bus) = self.bus.upgrade() else {
            return;
        };
        let sample = PackingLog {
            first: state.first,
            next: state.next,
            events: state.events.iter().map(|event| &**event).collect(),
        };
        // Serializing events cannot fail (their maps have string keys); were it to, the
        // log would be forgotten (its readers told the run is unknown), not left unread.
        let packed = serde_json::to_vec(&sample)
            .ok()
            .map(|json| PACKER.pack(&json));
        let this: *const Self = self;
        let mut bus = lock(&bus);
        if let Some(entry) = bus.runs.get_mut(&*self.run_id)
            && entry.is(this)
        {
            match packed {
                Some(packed) => *entry = Log::Packed(packed),
                None => {
                    bus.runs.remove(&*self.run_id);
                }
            }
        }
    }
}

impl InMemoryBus {
    /// A bus with these bounds.
    pub fn new(limits: BusLimits) -> Self {
        Self {
            limits,
            inner: Arc::new(Mutex::new(BusState::default())),
        }
    }

    /// The log of `run_id`, unless it expired; with `going_on`, the bus holds it again
    /// (its run waited and goes on).
    async fn log(&self, run_id: &str, going_on: bool) -> Result<Arc<RunLog>, BusError> {
        loop {
            let found = {
                let mut state = lock(&self.inner);
                expire(&mut state, self.limits.retention);
                let entry = state
                    .runs
                    .get_mut(run_id)
                    .ok_or_else(|| BusError::UnknownRun(run_id.to_owned()))?;
                let log = match entry {
                    Log::Open(log) => Some(log.clone()),
                    // `None`: its last holder packs it at this moment.
                    Log::Waiting(weak) => weak.upgrade(),
                    Log::Packed(packed) => {
                        let capacity = self.limits.events_per_run.max(1);
                        let log = Arc::new(RunLog::unpack(run_id, packed, &self.inner, capacity)?);
                        *entry = Log::Waiting(Arc::downgrade(&log));
                        Some(log)
                    }
                };
                if going_on && let Some(log) = &log {
                    *entry = Log::Open(log.clone());
                }
                log
            };
            match found {
                Some(log) => return Ok(log),
                None => tokio::task::yield_now().await,
            }
        }
    }

    /// Logs of waiting runs held packed.
    #[cfg(test)]
    fn packed_runs(&self) -> usize {
        lock(&self.inner)
            .runs
            .values()
            .filter(|log| matches!(log, Log::Packed(_)))
            .count()
    }

    /// Runs whose logs are held (running, or finished within the retention).
    pub fn runs(&self) -> usize {
        let mut state = lock(&self.inner);
        expire(&mut state, self.limits.retention);
        state.runs.len()
    }
}

fn expire(state: &mut BusState, retention: Duration) {
    let now = Instant::now();
    while let Some(oldest) = state.finished.front() {
        if now.duration_since(oldest.at) < retention {
            break;
        }
        state.drop_oldest();
    }
}

#[async_trait::async_trait]
impl EventBus for InMemoryBus {
    async fn open(&self, run_id: &str, _owner: &str) -> Result<Box<dyn RunPublisher>, BusError> {
        // One process: no other owner can take the run.
        let mut state = lock(&self.inner);
        expire(&mut state, self.limits.retention);
        if state.runs.contains_key(run_id) {
            return Err(BusError::DuplicateRun(run_id.to_owned()));
        }
        let log = Arc::new(RunLog {
            run_id: run_id.into(),
            bus: Arc::downgrade(&self.inner),
            state: Mutex::new(LogState {
                events: VecDeque::new(),
                first: 1,
                next: 1,
                done: false,
                moved: false,
                parked: false,
            }),
            published: Notify::new(),
            capacity: self.limits.events_per_run.max(1),
        });
        state.runs.insert(run_id.into(), Log::Open(log.clone()));
        Ok(Box::new(Publisher {
            log,
            bus: self.inner.clone(),
            limits: self.limits,
        }))
    }

    async fn resume(&self, run_id: &str, _owner: &str, after: u64) -> Result<Resumed, BusError> {
        let log = self.log(run_id, true).await?;
        let tail = {
            let mut state = lock(&log.state);
            state.moved = false;
            state.parked = false;
            let start = usize::try_from(after.saturating_add(1).saturating_sub(state.first))
                .unwrap_or(usize::MAX);
            state.events.iter().skip(start).cloned().collect()
        };
        Ok(Resumed {
            tail,
            publisher: Box::new(Publisher {
                log,
                bus: self.inner.clone(),
                limits: self.limits,
            }),
        })
    }

    async fn subscribe(&self, run_id: &str, after_sequence: u64) -> Result<EventStream, BusError> {
        let log = self.log(run_id, false).await?;
        // A reader that attaches while the run runs always ends with its `done` event,
        // even when it asked to start beyond it; one that attaches to an ended run gets
        // only the events after its cursor (none, at or beyond the end).
        let running = !lock(&log.state).done;
        let reader = Reader {
            log,
            cursor: after_sequence,
            batch: VecDeque::new(),
            finished: false,
            owes_done: running,
        };
        Ok(Box::pin(futures_util::stream::unfold(reader, Reader::next)))
    }
}

struct Publisher {
    log: Arc<RunLog>,
    bus: Arc<Mutex<BusState>>,
    limits: BusLimits,
}

impl Publisher {
    /// Appends one event; true when it ended the run.
    fn append(&self, mut event: RunEvent) -> bool {
        let done = event.done;
        let kept = {
            let mut state = lock(&self.log.state);
            if state.done {
                return false;
            }
            event.sequence = state.next;
            state.next += 1;
            state.done = done;
            state.events.push_back(Arc::new(event));
            if state.events.len() > self.log.capacity {
                state.events.pop_front();
                state.first += 1;
            }
            let bytes = if done {
                state.events.iter().map(|e| e.weight()).sum()
            } else {
                0
            };
            (state.events.len(), bytes)
        };
        let (kept, bytes) = kept;
        if done {
            let mut bus = lock(&self.bus);
            // A run that ends as it begins to wait: the bus holds its log again.
            if let Some(entry) = bus.runs.get_mut(&*self.log.run_id)
                && matches!(entry, Log::Waiting(_))
                && entry.is(Arc::as_ptr(&self.log))
            {
                *entry = Log::Open(self.log.clone());
            }
            bus.finished.push_back(Finished {
                at: Instant::now(),
                run_id: self.log.run_id.to_string(),
                events: kept,
                bytes,
            });
            bus.retained += kept;
            bus.retained_bytes += bytes;
            while bus.retained > self.limits.retained_events
                || bus.retained_bytes > self.limits.retained_bytes
            {
                bus.drop_oldest();
            }
        }
        done
    }

    /// Wakes the readers for everything published so far.
    fn wake(&self) {
        self.log.published.notify_waiters();
    }
}

#[async_trait::async_trait]
impl RunPublisher for Publisher {
    async fn publish(&self, events: Vec<RunEvent>) -> Result<(), BusError> {
        for event in events {
            if self.append(event) {
                break;
            }
        }
        self.wake();
        Ok(())
    }

    async fn release(&self) -> Result<(), BusError> {
        {
            let mut state = lock(&self.log.state);
            if state.done {
                return Ok(());
            }
            state.moved = true;
        }
        // New readers here find the run elsewhere.
        let mut bus = lock(&self.bus);
        let ours = bus
            .runs
            .get(&*self.log.run_id)
            .is_some_and(|entry| entry.is(Arc::as_ptr(&self.log)));
        // Let go once the lock is: no log is let go under it.
        let removed = ours.then(|| bus.runs.remove(&*self.log.run_id));
        drop(bus);
        drop(removed);
        // Readers waiting for more learn that it comes from elsewhere.
        self.log.published.notify_waiters();
        Ok(())
    }

    async fn park(&self) -> Result<(), BusError> {
        {
            let mut state = lock(&self.log.state);
            if state.done {
                return Ok(());
            }
            state.parked = true;
        }
        // The bus holds the log no more: its publisher and its readers do, and the last of
        // them to let it go packs it.
        let mut bus = lock(&self.bus);
        let open = bus
            .runs
            .get_mut(&*self.log.run_id)
            .filter(|entry| entry.is(Arc::as_ptr(&self.log)))
            .map(|entry| std::mem::replace(entry, Log::Waiting(Arc::downgrade(&self.log))));
        drop(bus);
        drop(open);
        Ok(())
    }
}

impl Drop for Publisher {
    /// A run whose publisher goes away without a `done` event (a bug, or a panic in the
    /// run) still ends exactly once, so that no reader waits forever.
    fn drop(&mut self) {
        let state = lock(&self.log.state);
        if !state.done && !state.moved && !state.parked {
            drop(state);
            self.append(RunEvent::ended_without_end());
            self.wake();
        }
    }
}

/// Events a reader takes from the log at once, to lock it once per batch, not per event.
const BATCH: usize = 256;

struct Reader {
    log: Arc<RunLog>,
    cursor: u64,
    batch: VecDeque<Arc<RunEvent>>,
    finished: bool,
    /// Whether the reader attached while the run ran and has not yet been given its
    /// `done` event.
    owes_done: bool,
}

impl Reader {
    async fn next(mut self) -> Option<(Result<Arc<RunEvent>, BusError>, Self)> {
        loop {
            if let Some(event) = self.batch.pop_front() {
                self.cursor = self.cursor.max(event.sequence);
                if event.done {
                    self.owes_done = false;
                }
                return Some((Ok(event), self));
            }
            if self.finished {
                return None;
            }
            // Registered before the log is read: a publish that lands after the read
            // wakes it (`notify_waiters` wakes only registered waiters).
            let log = self.log.clone();
            let published = log.published.notified();
            tokio::pin!(published);
            published.as_mut().enable();
            let (lost, ended) = {
                let state = lock(&self.log.state);
                let moved = state.moved && !state.done;
                // `cursor` comes from a client: no arithmetic on it may overflow.
                let wanted = self.cursor.saturating_add(1);
                if wanted < state.first {
                    (
                        Some(BusError::Lagged {
                            from: wanted,
                            to: state.first - 1,
                        }),
                        false,
                    )
                } else {
                    let start = usize::try_from(wanted - state.first).unwrap_or(usize::MAX);
                    let behind = state.events.len().saturating_sub(start);
                    if behind > 0 {
                        agentrt_metrics::Metrics::global().bus_read(behind as u64);
                    }
                    self.batch
                        .extend(state.events.iter().skip(start).take(BATCH).cloned());
                    if self.batch.is_empty() && state.done && self.owes_done {
                        // Attached beyond the end of a run that has ended since: its
                        // `done` event still closes the stream.
                        self.owes_done = false;
                        self.batch.extend(state.events.back().cloned());
                    }
                    if self.batch.is_empty() && moved {
                        (Some(BusError::Moved { after: self.cursor }), false)
                    } else {
                        (None, self.batch.is_empty() && state.done)
                    }
                }
            };
            if let Some(lost) = lost {
                if matches!(lost, BusError::Lagged { .. }) {
                    agentrt_metrics::Metrics::global().bus_lagged();
                }
                self.finished = true;
                return Some((Err(lost), self));
            }
            if ended {
                return None;
            }
            if self.batch.is_empty() {
                // Nothing new: wait for the publisher. One that goes away without a `done`
                // event publishes one as it drops, and wakes this.
                published.await;
            }
        }
    }
}

/// Behaviour every bus shares is tested by the conformance suite in `agentrt-test-support`,
/// which this bus runs; what follows is particular to the in-process bus.
#[cfg(test)]
mod tests {
    use super::*;
    use futures_util::StreamExt;

    fn delta(text: &str) -> RunEvent {
        RunEvent::new(EventKind::FinalAnswer, 1, text.into(), None)
    }

    fn done() -> RunEvent {
        RunEvent {
            done: true,
            ..RunEvent::new(EventKind::FinalAnswer, 1, String::new(), None)
        }
    }

    async fn read_all(stream: EventStream) -> Vec<Result<u64, BusError>> {
        stream.map(|e| e.map(|e| e.sequence)).collect().await
    }

    /// The events of a run that waits for a client tool, as the engine publishes them.
    fn waiting_run() -> Vec<RunEvent> {
        let call = PendingCall {
            id: "call_1".into(),
            name: "lookup_order".into(),
            arguments: JsonText::new(&serde_json::json!({"order_id": "A-17"})),
            action: Action::ClientExecute,
            answered: false,
        };
        vec![
            RunEvent::new(
                EventKind::RunStarted,
                1,
                String::new(),
                Some(EventData::RunStarted {
                    engine_id: "5a94c7f8-0925-46ef-8e58-c252560b8096".into(),
                    agent: "waiting".into(),
                }),
            ),
            delta("Let me look."),
            RunEvent::new(
                EventKind::ActionRequired,
                1,
                String::new(),
                Some(EventData::ActionRequired {
                    tool_calls: vec![call],
                }),
            ),
        ]
    }

    async fn events(stream: EventStream) -> Vec<RunEvent> {
        stream.map(|e| (*e.unwrap()).clone()).collect().await
    }

    #[tokio::test]
    async fn a_waiting_runs_log_is_packed_once_nobody_follows_it_and_reads_the_same() {
        let bus = InMemoryBus::new(BusLimits::default());
        let publisher = bus.open("r", "").await.unwrap();
        publisher.publish(waiting_run()).await.unwrap();
        let following = bus.subscribe("r", 0).await.unwrap();
        publisher.park().await.unwrap();
        drop(publisher);
        // A reader still follows it: it stays open.
        assert_eq!(bus.packed_runs(), 0);
        drop(following);
        assert_eq!(bus.packed_runs(), 1);

        // Read packed, the log is what was published, with its numbers and times.
        let published: Vec<RunEvent> = {
            let reader = bus.subscribe("r", 0).await.unwrap();
            assert_eq!(bus.packed_runs(), 0, "opened for its reader");
            let mut reader = reader;
            let mut read = Vec::new();
            for _ in 0..3 {
                read.push((*reader.next().await.unwrap().unwrap()).clone());
            }
            read
        };
        assert_eq!(bus.packed_runs(), 1, "packed again when its reader went");
        let packed: usize = lock(&bus.inner)
            .runs
            .values()
            .map(|log| match log {
                Log::Packed(packed) => packed.len(),
                _ => 0,
            })
            .sum();
        // Its 700 bytes of JSON, packed.
        assert!(packed < 200, "{packed} bytes");
        assert_eq!(
            published.iter().map(|e| e.sequence).collect::<Vec<_>>(),
            [1, 2, 3]
        );
        let mut expected = waiting_run();
        for (event, n) in expected.iter_mut().zip(1..) {
            event.sequence = n;
        }
        for (read, expected) in published.iter().zip(&expected) {
            assert_eq!(
                (&read.kind, &read.content, &read.data, read.iteration),
                (
                    &expected.kind,
                    &expected.content,
                    &expected.data,
                    expected.iteration
                )
            );
        }

        // A reader that attaches while it is packed follows the run when it goes on.
        let follower = bus.subscribe("r", 2).await.unwrap();
        let resumed = bus.resume("r", "", 3).await.unwrap();
        assert!(resumed.tail.is_empty());
        resumed
            .publisher
            .publish(vec![delta("found"), done()])
            .await
            .unwrap();
        drop(resumed);
        assert_eq!(
            read_all(follower).await,
            [Ok(3), Ok(4), Ok(5)],
            "the reader attached while packed sees the run go on"
        );
        let all = events(bus.subscribe("r", 0).await.unwrap()).await;
        assert_eq!(all.len(), 5);
        assert_eq!(all[0].time, published[0].time);
        assert_eq!(bus.packed_runs(), 0);
    }

    #[tokio::test(start_paused = true)]
    async fn finished_runs_expire_after_the_retention() {
        let bus = InMemoryBus::new(BusLimits {
            retention: Duration::from_secs(60),
            ..BusLimits::default()
        });
        let publisher = bus.open("r", "").await.unwrap();
        publisher.publish(vec![done()]).await.unwrap();
        let running = bus.open("still-running", "").await.unwrap();
        running.publish(vec![delta("x")]).await.unwrap();
        tokio::time::advance(Duration::from_secs(59)).await;
        assert!(bus.subscribe("r", 0).await.is_ok());
        tokio::time::advance(Duration::from_secs(2)).await;
        assert_eq!(
            bus.subscribe("r", 0).await.err(),
            Some(BusError::UnknownRun("r".into()))
        );
        assert!(
            bus.subscribe("still-running", 0).await.is_ok(),
            "running runs never expire"
        );
        assert_eq!(bus.runs(), 1);
    }

    #[tokio::test]
    async fn ended_logs_beyond_the_bytes_bound_are_dropped_oldest_first() {
        // Room for about two logs of a 40 KB output each, not three.
        let bus = InMemoryBus::new(BusLimits {
            retained_bytes: 100_000,
            ..BusLimits::default()
        });
        let output = "x".repeat(40_000);
        for run in ["first", "second", "third"] {
            let publisher = bus.open(run, "").await.unwrap();
            let result = RunEvent::new(
                EventKind::ToolResult,
                1,
                String::new(),
                Some(EventData::ToolResult {
                    id: "c".into(),
                    name: "search".into(),
                    output: output.clone(),
                    is_error: false,
                    duration_ms: 1,
                }),
            );
            assert!(result.weight() > 40_000);
            publisher.publish(vec![result, done()]).await.unwrap();
        }
        assert_eq!(
            bus.subscribe("first", 0).await.err(),
            Some(BusError::UnknownRun("first".into())),
            "the oldest goes"
        );
        assert!(bus.subscribe("second", 0).await.is_ok());
        assert!(bus.subscribe("third", 0).await.is_ok());
    }

    #[tokio::test]
    async fn ended_logs_beyond_the_total_bound_are_dropped_oldest_first() {
        let bus = InMemoryBus::new(BusLimits {
            retained_events: 5,
            ..BusLimits::default()
        });
        let first = bus.open("first", "").await.unwrap();
        first.publish(vec![delta("a")]).await.unwrap();
        first.publish(vec![done()]).await.unwrap();
        let following = bus.subscribe("first", 0).await.unwrap();
        let running = bus.open("running", "").await.unwrap();
        for text in ["c", "d", "e", "f"] {
            running.publish(vec![delta(text)]).await.unwrap();
        }
        let second = bus.open("second", "").await.unwrap();
        second.publish(vec![delta("b")]).await.unwrap();
        second.publish(vec![done()]).await.unwrap();
        assert!(
            bus.subscribe("first", 0).await.is_ok(),
            "running logs do not count"
        );
        let third = bus.open("third", "").await.unwrap();
        third.publish(vec![delta("g")]).await.unwrap();
        third.publish(vec![done()]).await.unwrap();
        // 2 + 2 + 2 events ended: the oldest log goes, and no more.
        assert_eq!(
            bus.subscribe("first", 0).await.err(),
            Some(BusError::UnknownRun("first".into()))
        );
        assert_eq!(
            read_all(following).await,
            [Ok(1), Ok(2)],
            "a reader keeps its log"
        );
        assert_eq!(
            read_all(bus.subscribe("second", 0).await.unwrap()).await,
            [Ok(1), Ok(2)]
        );
        assert_eq!(
            read_all(bus.subscribe("third", 1).await.unwrap()).await,
            [Ok(2)]
        );
        assert!(bus.subscribe("running", 0).await.is_ok());
        assert_eq!(bus.runs(), 3);
    }

    #[tokio::test]
    async fn a_dropped_publisher_still_ends_the_run_once() {
        let bus = InMemoryBus::new(BusLimits::default());
        let publisher = bus.open("r", "").await.unwrap();
        publisher.publish(vec![delta("a")]).await.unwrap();
        let reader = bus.subscribe("r", 0).await.unwrap();
        drop(publisher);
        let events: Vec<Arc<RunEvent>> =
            tokio::time::timeout(Duration::from_secs(5), reader.collect::<Vec<_>>())
                .await
                .unwrap()
                .into_iter()
                .map(Result::unwrap)
                .collect();
        assert_eq!(events.len(), 2);
        assert!(events[1].done);
        assert_eq!(events[1].kind, EventKind::Error);
    }
}
