//! The engine loop: runs one user turn of an agent.
//!
//! A run alternates model rounds and tool calls until the model answers, publishing every
//! step on the event bus as it happens (reasoning and answer text as deltas, each tool
//! call when complete, each result when back) and keeping a [`RunRecord`] for `GetRun`.
//! It ends with exactly one `done` event, whatever happens: an answer, the iteration cap,
//! a model failure, the run timeout, a cancellation or a shutdown.
//!
//! Cancellation is structural: the loop is a future raced against the run's cancellation
//! token and timeout, so stopping drops it, and with it the in-flight model request (the
//! HTTP connection closes) and running tool calls (their gRPC calls are cancelled).

mod emitter;
pub mod machine;
pub mod react;
mod strategy;

use std::{
    collections::HashMap,
    sync::{
        Arc, OnceLock,
        atomic::{AtomicBool, Ordering},
    },
    task::Poll,
    time::Duration,
};

use agentrt_context::{Exchange, SessionStore, TokenCounter, fit};
use agentrt_core::{AgentConfig, Reference, ToolInvocation, ToolResult, ToolRunner, ToolSpec};
use agentrt_events::{EventBus, EventData, EventKind, RerankOutcome, RunPublisher};
use agentrt_metrics::Metrics;
use agentrt_models::{
    ChatDelta, ChatMessage, ChatModel, ChatModels, ChatRequest, FinishReason, ModelError,
    ModelToolCall, RerankRequest, ToolDefinition, Usage,
};
use agentrt_state::{Action, Answers, PendingCall, Progress, Resumable, RunStore};
use futures_util::{FutureExt, StreamExt, task::AtomicWaker};
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;
use tracing::{Instrument, debug, info_span};

pub use agentrt_state::{
    RunError, RunRecord, RunStatus, StepRecord, StopReason, TokenUsage, ToolCallRecord,
};
use emitter::Emitter;
use machine::{CallResult, Ending, Reply, RunState, Step};
use strategy::Strategy as RunStrategy;

/// What the engine needs from the rest of the server.
#[derive(Clone)]
pub struct Engine {
    /// Shared, not copied: each run holds a clone of the engine.
    models: Arc<ChatModels>,
    tools: Arc<dyn ToolRunner>,
    sessions: Arc<dyn SessionStore>,
    max_tool_output_bytes: usize,
}

/// The longest tool output given to the model by default, in bytes.
pub const DEFAULT_MAX_TOOL_OUTPUT_BYTES: usize = 64 * 1024;

/// One run to make.
#[derive(Debug, Clone)]
pub struct RunSpec {
    /// The run's id.
    pub run_id: String,
    /// The engine it runs on.
    pub engine_id: String,
    /// Its session.
    pub session_id: String,
    /// Its message id.
    pub message_id: String,
    /// The user's query.
    pub query: String,
    /// Explicit prior messages; `None` uses the session's history.
    pub llm_context: Option<Vec<ChatMessage>>,
    /// The agent.
    pub config: Arc<AgentConfig>,
    /// Specs of the agent's tools.
    pub tools: Arc<[ToolSpec]>,
}

/// A run's own part of its spec, as saved for another replica to continue it; the agent's
/// part ([`AgentPart`]) is saved once per engine, whatever its number of runs.
#[derive(serde::Serialize)]
struct RunPart<'a> {
    run_id: &'a str,
    engine_id: &'a str,
    session_id: &'a str,
    message_id: &'a str,
    query: &'a str,
    llm_context: Option<&'a [ChatMessage]>,
}

/// What every run of an engine shares, as saved.
#[derive(serde::Serialize)]
struct AgentPart<'a> {
    config: &'a AgentConfig,
    tools: &'a [ToolSpec],
}

/// A run's saved spec, read back: its agent comes apart ([`SavedAgent`]), except in the
/// specs of runs saved before agents were saved once per engine.
#[derive(serde::Deserialize)]
struct SavedSpec {
    run_id: String,
    engine_id: String,
    session_id: String,
    message_id: String,
    query: String,
    llm_context: Option<Vec<ChatMessage>>,
    #[serde(flatten)]
    agent: Option<SavedAgent>,
}

/// An engine's agent, read back.
#[derive(serde::Deserialize)]
struct SavedAgent {
    config: Arc<AgentConfig>,
    tools: Arc<[ToolSpec]>,
}

impl RunSpec {
    /// The run's part of the spec and its agent's part, as saved.
    fn saved(&self) -> serde_json::Result<(String, String)> {
        let run = serde_json::to_string(&RunPart {
            run_id: &self.run_id,
            engine_id: &self.engine_id,
            session_id: &self.session_id,
            message_id: &self.message_id,
            query: &self.query,
            llm_context: self.llm_context.as_deref(),
        })?;
        let agent = serde_json::to_string(&AgentPart {
            config: &self.config,
            tools: &self.tools,
        })?;
        Ok((run, agent))
    }

    /// The spec saved as `spec` (the run's part) and `agent` (its engine's part).
    fn read(spec: &str, agent: &str) -> Result<Self, String> {
        let saved: SavedSpec = serde_json::from_str(spec).map_err(|e| format!("spec: {e}"))?;
        let agent = match saved.agent {
            Some(agent) => agent,
            None if agent.is_empty() => return Err("agent: none is saved".into()),
            None => serde_json::from_str(agent).map_err(|e| format!("agent: {e}"))?,
        };
        Ok(Self {
            run_id: saved.run_id,
            engine_id: saved.engine_id,
            session_id: saved.session_id,
            message_id: saved.message_id,
            query: saved.query,
            llm_context: saved.llm_context,
            config: agent.config,
            tools: agent.tools,
        })
    }
}

/// How a run is stopped from outside.
#[derive(Debug, Default)]
pub struct RunControl {
    /// Cancels the model and tool calls in flight.
    cancel: CancellationToken,
    reason: OnceLock<StopReason>,
    /// Set by `stop`, and the run's task to wake. The run checks this on every wake-up,
    /// a few times per model round; waiting on the token instead locked two mutexes each
    /// time (about 2% of the server's CPU under load).
    stopped: AtomicBool,
    waiter: AtomicWaker,
    /// Set when the client of the run's `Execute` went away.
    abandoned: AtomicBool,
    /// Set when the run goes on on another replica: it stops here without ending.
    let_go: AtomicBool,
    /// Set when the run is about to wait for answers, or goes on after a wait: its client
    /// going away no longer cancels it.
    waiting: AtomicBool,
    /// Set when the run's task ended because the run waits for answers (it was let go,
    /// not ended).
    parked: AtomicBool,
}

impl RunControl {
    /// Stops the run for `reason` (the first reason given wins). Idempotent.
    pub fn stop(&self, reason: StopReason) {
        let _ = self.reason.set(reason);
        self.stopped.store(true, Ordering::Release);
        self.waiter.wake();
        self.cancel.cancel();
    }

    /// Stops the run because the client of its `Execute` went away: a retry with the
    /// same message id starts a new run.
    pub fn abandon(&self) {
        // A run that waits (or is about to) goes on without its client.
        if self.waiting.load(Ordering::Acquire) {
            return;
        }
        self.abandoned.store(true, Ordering::Release);
        self.stop(StopReason::Cancelled);
    }

    /// Lets the run go on when the client of its `Execute` goes away: a run that waited
    /// for answers has outlived the request that started it (its answers may come from
    /// elsewhere, and a retry would ask again for what was decided).
    pub fn outlive_client(&self) {
        self.waiting.store(true, Ordering::Release);
    }

    /// Stops the run here without ending it: another replica continues it (this one
    /// hands it over as it shuts down, or lost its lease).
    pub fn let_go(&self) {
        self.let_go.store(true, Ordering::Release);
        self.stop(StopReason::Shutdown);
    }

    /// Whether the run was let go to another replica.
    pub fn is_let_go(&self) -> bool {
        self.let_go.load(Ordering::Acquire)
    }

    /// Whether the client of the run's `Execute` went away.
    pub fn is_abandoned(&self) -> bool {
        self.abandoned.load(Ordering::Acquire)
    }

    /// Whether the run went to wait for answers (or was about to).
    pub fn is_waiting(&self) -> bool {
        self.waiting.load(Ordering::Acquire)
    }

    /// Whether the run's task ended with the run waiting for answers (not ended: it goes
    /// on once answered, on any replica).
    pub fn parked(&self) -> bool {
        self.parked.load(Ordering::Acquire)
    }

    /// Whether the run was asked to stop.
    pub fn is_stopped(&self) -> bool {
        self.stopped.load(Ordering::Acquire)
    }

    /// Resolves once the run is asked to stop; one task waits on it, the run's own.
    fn stop_requested(&self) -> impl Future<Output = ()> + '_ {
        std::future::poll_fn(|cx| {
            if self.is_stopped() {
                return Poll::Ready(());
            }
            self.waiter.register(cx.waker());
            // A stop between the check and the registration woke no one: check again.
            if self.is_stopped() {
                Poll::Ready(())
            } else {
                Poll::Pending
            }
        })
    }
}

/// How a run ended.
#[derive(Debug)]
pub(crate) enum Outcome {
    Answered(StopReason),
    Failed(StopReason, RunError),
    /// The run is another replica's now: it stops here without ending.
    Moved,
    /// The run waits for answers (stored with its state): it stops here without ending,
    /// and whichever replica is answered last continues it.
    Waiting,
}

/// An answer to a call a waiting run waits for, as the store keeps it.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(tag = "kind", rename_all = "snake_case")]
pub enum ToolAnswer {
    /// The output of a client tool's call.
    Output {
        /// What the tool returned.
        output: String,
        /// Whether it is an error.
        is_error: bool,
    },
    /// A decision on a call that needs approval.
    Decision {
        /// Whether the call runs.
        approved: bool,
        /// Why (for a denial, the model reads it).
        reason: String,
    },
}

/// What a waiting run does with a call's answer.
#[derive(Debug, PartialEq)]
enum Taken {
    /// The call's result, for the model (an output, or why the call did not run).
    Result(ToolResult),
    /// The call was approved: it runs now.
    Run,
    /// Not answered yet.
    Missing,
}

/// What the answer of a call that needed `action` makes of it; outputs and reasons are
/// held to `max_output_bytes`, as what the model reads.
fn answered(action: Action, answer: Option<ToolAnswer>, max_output_bytes: usize) -> Taken {
    let result = match answer {
        None => return Taken::Missing,
        // An answer of the other kind (one that raced the wait's saving past the RPC's
        // check): a client tool is not run on the tool executor because it was
        // "approved", nor is an approval's call answered without a decision.
        Some(answer) if !answer.answers(action) => ToolResult::error(
            match action {
                Action::Approve => {
                    "the call needed a decision (ApproveToolCalls) and was sent an output \
                     instead; it did not run"
                }
                Action::ClientExecute => {
                    "the call needed its output from the client (SubmitToolOutputs) and was \
                     sent a decision instead; it did not run"
                }
            }
            .to_owned(),
        ),
        Some(ToolAnswer::Output {
            mut output,
            is_error,
        }) => {
            truncate_output(&mut output, max_output_bytes);
            ToolResult {
                output,
                is_error,
                references: Vec::new(),
            }
        }
        Some(ToolAnswer::Decision { approved: true, .. }) => return Taken::Run,
        Some(ToolAnswer::Decision {
            approved: false,
            reason,
        }) => {
            let mut output = if reason.trim().is_empty() {
                "the call was denied by the user; it did not run".to_owned()
            } else {
                format!("the call was denied by the user; it did not run. Reason: {reason}")
            };
            truncate_output(&mut output, max_output_bytes);
            ToolResult::error(output)
        }
    };
    Taken::Result(result)
}

impl ToolAnswer {
    /// The answer as the store keeps it.
    pub fn encode(&self) -> String {
        // A plain enum of strings and booleans always encodes.
        serde_json::to_string(self).unwrap_or_default()
    }

    /// Whether this answers a call that needs `action`.
    pub fn answers(&self, action: Action) -> bool {
        matches!(
            (self, action),
            (Self::Output { .. }, Action::ClientExecute) | (Self::Decision { .. }, Action::Approve)
        )
    }
}

/// Milliseconds since the Unix epoch.
fn now_ms() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| u64::try_from(d.as_millis()).unwrap_or(u64::MAX))
}

/// What a run taken over brings to its step loop, until it is used up. Boxed: most runs
/// have none, and inline it would take room in every run's future.
struct Carried {
    /// Results of the pending calls that the previous owner published, by call id, until
    /// a model round runs here.
    recovered: Option<HashMap<String, (ToolResult, Duration)>>,
    /// Model rounds the previous owner had begun to publish: they run again.
    interrupted: Vec<u32>,
    /// `takeover` or `handover`.
    reason: &'static str,
    /// For a run that waited: what it was told meanwhile.
    waited: Option<Answers>,
}

/// A run's answered calls, as [`Engine::answered`] goes on with them.
struct Answered {
    calls: Vec<ModelToolCall>,
    results: Vec<Option<CallResult>>,
    pending: Vec<PendingCall>,
    /// Results the previous owner published, by call id.
    known: HashMap<String, (ToolResult, Duration)>,
    /// What the run was told while it waited; `None` when it was answered already.
    told: Option<Answers>,
}

/// Where a run taken over from another replica goes on from.
struct Resume {
    /// Its state at its last checkpoint.
    state: RunState,
    /// The turn's messages saved so far.
    saved_messages: usize,
    /// What it brings to the step loop.
    carried: Box<Carried>,
    /// When the run started, in milliseconds since the Unix epoch: the session's turns
    /// kept since are not its history.
    started_ms: u64,
}

/// What another replica needs to continue the run from `state`: the state without its
/// messages, and the messages not saved yet (from `*saved` on).
fn progress(
    state: &mut RunState,
    saved: &mut usize,
    spec: Option<&RunSpec>,
) -> Result<Progress, Outcome> {
    let encode_failed = |e: serde_json::Error| {
        Outcome::Failed(
            StopReason::InternalError,
            RunError {
                code: "INTERNAL".into(),
                message: format!("cannot encode the run's progress: {e}"),
                category: "internal",
                retryable: false,
            },
        )
    };
    let messages = std::mem::take(&mut state.messages);
    let encoded = serde_json::to_string(&*state);
    state.messages = messages;
    let first = (*saved).min(state.messages.len());
    let new = state.messages[first..]
        .iter()
        .map(serde_json::to_string)
        .collect::<Result<Vec<_>, _>>()
        .map_err(encode_failed)?;
    *saved = state.messages.len();
    let (spec, agent) = spec
        .map(RunSpec::saved)
        .transpose()
        .map_err(encode_failed)?
        .unzip();
    Ok(Progress {
        spec,
        agent,
        state: encoded.map_err(encode_failed)?,
        messages: new,
        first_message: first,
        wait: None,
    })
}

/// The turn a run that answered keeps in its session's history: its messages, then the
/// answer.
fn turn(current: &[(ChatMessage, u32)], answer: &str, counter: &TokenCounter) -> Exchange {
    // The turn's messages were counted as they were added; only the answer is new.
    let answer = ChatMessage::Assistant {
        content: answer.to_owned(),
        tool_calls: Vec::new(),
    };
    let tokens = current.iter().map(|(_, t)| t).sum::<u32>() + counter.message(&answer);
    let mut messages = Vec::with_capacity(current.len() + 1);
    messages.extend(current.iter().map(|(m, _)| m.clone()));
    messages.push(answer);
    Exchange {
        messages,
        tokens,
        kept_ms: now_ms(),
    }
}

/// What every model round of a run shares.
#[derive(Clone, Copy)]
struct RoundSetup<'a> {
    model: &'a Arc<dyn ChatModel>,
    /// The provider's name, for spans.
    provider: &'a str,
    strategy: &'a dyn RunStrategy,
    timeout: Duration,
    cancel: &'a CancellationToken,
}

/// Deepest nesting of tool-call arguments accepted: each JSON level costs three levels of
/// Protobuf messages on the wire (`Struct`, map entry, `Value`), and decoders commonly stop
/// at 100, so deeper arguments would make events that clients cannot decode.
pub const MAX_ARGUMENT_DEPTH: usize = 20;

impl Engine {
    /// An engine over these parts.
    pub fn new(
        models: ChatModels,
        tools: Arc<dyn ToolRunner>,
        sessions: Arc<dyn SessionStore>,
    ) -> Self {
        Self {
            models: Arc::new(models),
            tools,
            sessions,
            max_tool_output_bytes: DEFAULT_MAX_TOOL_OUTPUT_BYTES,
        }
    }

    /// Cuts tool outputs longer than `bytes` (at a character boundary) and marks the cut,
    /// before the model or any client sees them: one huge result must not blow the
    /// context budget or the event stream.
    pub fn with_max_tool_output_bytes(mut self, bytes: usize) -> Self {
        self.max_tool_output_bytes = bytes;
        self
    }

    /// `answer` as a run keeps it: an output or a reason longer than a tool output may be
    /// is cut as the model would be given it, so that a waiting run never holds more.
    pub fn bounded_answer(&self, mut answer: ToolAnswer) -> ToolAnswer {
        match &mut answer {
            ToolAnswer::Output { output, .. } => {
                truncate_output(output, self.max_tool_output_bytes);
            }
            // Cut again with the words around it when the run goes on.
            ToolAnswer::Decision { reason, .. } => {
                agentrt_core::truncate_at_char_boundary(reason, self.max_tool_output_bytes);
            }
        }
        answer
    }

    /// Starts the run: publishes its first event and saves its first record, so that
    /// the run can be found, followed and cancelled from any replica before the model is
    /// called; [`StartedRun::run`] makes the rest of it. Fails when the store cannot be
    /// written.
    /// `owner` is the lease token the run is written with (see `RunStore::save`).
    pub async fn start(
        &self,
        spec: RunSpec,
        owner: &str,
        publisher: Box<dyn RunPublisher>,
        store: Arc<dyn RunStore>,
        control: Arc<RunControl>,
    ) -> Result<StartedRun, RunError> {
        let mut record = RunRecord::new(
            &spec.run_id,
            &spec.engine_id,
            &spec.session_id,
            &spec.message_id,
            &spec.query,
        );
        owner.clone_into(&mut record.owner);
        let mut emitter = Emitter::new(publisher, store, record);
        // A run without an owner cannot be taken over: nothing to save for that. One
        // with an owner saves its spec and its state before the first round.
        let first = (!owner.is_empty()).then(|| {
            let mut state = RunState::new(
                &spec.query,
                spec.config.max_iterations,
                TokenCounter::shared(),
            );
            progress(&mut state, &mut 0, Some(&spec))
        });
        let started = match first.transpose() {
            Ok(progress) => {
                emitter
                    .run_started(&spec.engine_id, &spec.config.name, progress)
                    .await
            }
            Err(failed) => Err(failed),
        };
        if let Err(outcome) = started {
            return Err(match outcome {
                Outcome::Failed(_, error) => error,
                Outcome::Answered(_) | Outcome::Moved | Outcome::Waiting => {
                    stopped_error(StopReason::InternalError)
                }
            });
        }
        Ok(StartedRun(Box::new(RunParts {
            engine: self.clone(),
            spec,
            emitter,
            control,
            resume: None,
        })))
    }

    /// Continues a run taken over from another replica (see `RunStore::take_over`): reads
    /// what its previous owner published after its last checkpoint from `bus`, and goes
    /// on from there with `taken.record.owner` as the run's owner. `handover` when the
    /// previous owner let it go rather than died.
    pub async fn resume(
        &self,
        taken: Resumable,
        handover: bool,
        bus: &dyn EventBus,
        store: Arc<dyn RunStore>,
        control: Arc<RunControl>,
    ) -> Result<StartedRun, RunError> {
        let corrupt = |what: &str, e: &dyn std::fmt::Display| RunError {
            code: "INTERNAL".into(),
            message: format!("cannot read the {what} of the run taken over: {e}"),
            category: "internal",
            retryable: false,
        };
        let read = || -> Result<(RunSpec, RunState), RunError> {
            let spec = RunSpec::read(&taken.spec, &taken.agent).map_err(|e| corrupt("spec", &e))?;
            let mut state: RunState =
                serde_json::from_str(&taken.state).map_err(|e| corrupt("state", &e))?;
            state.messages = taken
                .messages
                .iter()
                .map(|m| serde_json::from_str(m))
                .collect::<Result<_, _>>()
                .map_err(|e| corrupt("messages", &e))?;
            Ok((spec, state))
        };
        let (spec, state) = match read() {
            Ok(read) => read,
            // What no replica can read (written by another version, or damaged) ends the
            // run here, failed, instead of being taken over again and again for ever.
            Err(error) => return Err(end_unreadable(taken.record, bus, store, error).await),
        };
        // A run that waited once outlives its client on every replica that continues it
        // (the replica that took its answers tells its control so itself).
        if state.has_waited {
            control.outlive_client();
        }
        let mut record = taken.record;
        if record.waiting() {
            // It goes on: it will say so at its next checkpoint.
            record.status = RunStatus::Running;
            record.pending.clear();
        }
        let resumed = bus
            .resume(&record.run_id, &record.owner, record.last_sequence)
            .await
            .map_err(|e| corrupt("events", &e))?;
        let mut results = HashMap::new();
        let mut interrupted = Vec::new();
        let pending: &[ModelToolCall] = match &state.phase {
            machine::Phase::RunTools { calls, .. } | machine::Phase::Waiting { calls, .. } => calls,
            _ => &[],
        };
        let mut last = record.last_sequence;
        // What the model streamed in rounds begun since the checkpoint, whose calls ended
        // with the previous owner: their provider's report of usage went with it.
        let mut lost_completion = 0u64;
        let counter = TokenCounter::shared();
        for event in &resumed.tail {
            last = last.max(event.sequence);
            if event.iteration > state.iteration
                && matches!(event.kind, EventKind::Thought | EventKind::FinalAnswer)
            {
                lost_completion += u64::from(counter.text(&event.content));
            }
            match (event.kind, event.data.as_deref()) {
                (
                    EventKind::ToolResult,
                    Some(EventData::ToolResult {
                        id,
                        output,
                        is_error,
                        duration_ms,
                        ..
                    }),
                ) if pending.iter().any(|c| c.id == *id) => {
                    let result = ToolResult {
                        output: output.clone(),
                        is_error: *is_error,
                        references: Vec::new(),
                    };
                    results.insert(id.clone(), (result, Duration::from_millis(*duration_ms)));
                }
                (
                    EventKind::References,
                    Some(EventData::References {
                        tool_call_id,
                        references,
                        ..
                    }),
                ) => {
                    if let Some((result, _)) = results.get_mut(tool_call_id) {
                        result.references = references
                            .iter()
                            .filter_map(|r| serde_json::from_value(r.clone()).ok())
                            .collect();
                    }
                }
                (EventKind::ToolResult | EventKind::References | EventKind::RunStarted, _) => {}
                // Anything else after the checkpoint belongs to a model round begun
                // since: it runs again.
                _ if event.iteration > state.iteration
                    && !interrupted.contains(&event.iteration) =>
                {
                    interrupted.push(event.iteration);
                }
                _ => {}
            }
        }
        // Its `done` is in its log already: it ended where it was (its replica saw its
        // first write fail, the write having landed all the same, and ended its events).
        // Its record is made to say so, and it does not go on: a second end after the
        // first would be a run its clients saw fail, succeeding unseen.
        if let Some(done) = resumed.tail.iter().find(|e| e.done) {
            let summary = match done.data.as_deref() {
                Some(EventData::End(summary)) => Some(summary),
                _ => None,
            };
            let reason = summary
                .and_then(|s| StopReason::from_name(s.stop_reason))
                .unwrap_or(StopReason::InternalError);
            record.status = reason.status();
            record.stop_reason = Some(reason);
            record.error = summary.and_then(|s| s.error.as_ref()).map(|f| RunError {
                code: f.code.clone(),
                message: f.message.clone(),
                category: f.category,
                retryable: f.retryable,
            });
            record.last_sequence = last;
            record.update_time = std::time::SystemTime::now();
            let at = done.sequence;
            store
                .save(&record, 0, None)
                .await
                .map_err(|e| corrupt("end", &e))?;
            return Err(RunError {
                code: "RUN_ENDED".into(),
                message: format!("the run had ended: its log holds its done event ({at})"),
                category: "internal",
                retryable: false,
            });
        }
        let saved_messages = state.messages.len();
        let iteration = state.iteration.max(1);
        let started_ms = record
            .create_time
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| u64::try_from(d.as_millis()).unwrap_or(u64::MAX));
        let mut emitter = Emitter::resumed(resumed.publisher, store, record, last, iteration);
        if !interrupted.is_empty() {
            // Each interrupted round's call counts, estimated (never silently zero): this
            // turn's messages as its prompt (the system prompt and the session's history
            // are not counted), and what it streamed.
            let prompt: u64 = state
                .messages
                .iter()
                .map(|(_, tokens)| u64::from(*tokens))
                .sum();
            emitter.usage(
                Usage {
                    prompt_tokens: prompt * interrupted.len() as u64,
                    completion_tokens: lost_completion,
                },
                true,
            );
        }
        Ok(StartedRun(Box::new(RunParts {
            engine: self.clone(),
            spec,
            emitter,
            control,
            resume: Some(Box::new(Resume {
                state,
                saved_messages,
                carried: Box::new(Carried {
                    recovered: Some(results),
                    interrupted,
                    reason: if handover { "handover" } else { "takeover" },
                    waited: taken.waited,
                }),
                started_ms,
            })),
        })))
    }
}

/// Ends a run taken over whose continuation cannot be read (`error` says why): its `done`
/// event (`INTERNAL`) and its ended record, as any failed run's. `RUN_ENDED` once ended;
/// `error` itself when even that cannot be written yet (it is tried again, by whichever
/// replica takes the run over next).
async fn end_unreadable(
    mut record: RunRecord,
    bus: &dyn EventBus,
    store: Arc<dyn RunStore>,
    error: RunError,
) -> RunError {
    tracing::error!(run_id = %record.run_id, error = %error.message, "a run taken over cannot be read: it ends");
    if record.waiting() {
        record.status = RunStatus::Running;
    }
    let Ok(resumed) = bus
        .resume(&record.run_id, &record.owner, record.last_sequence)
        .await
    else {
        return error;
    };
    // Ended already (its end is made its record's when it can be read).
    if resumed.tail.iter().any(|event| event.done) {
        return error;
    }
    let last = resumed
        .tail
        .iter()
        .map(|event| event.sequence)
        .fold(record.last_sequence, u64::max);
    let iteration = record.steps.last().map_or(1, |step| step.iteration.max(1));
    let run_id = record.run_id.clone();
    let emitter = Emitter::resumed(resumed.publisher, store.clone(), record, last, iteration);
    emitter
        .finish_failed(
            StopReason::InternalError,
            RunError {
                retryable: false,
                ..error.clone()
            },
        )
        .await;
    match store.load(&run_id).await {
        Ok(Some(record)) if record.ended() => RunError {
            code: "RUN_ENDED".into(),
            message: format!("the run ended: {}", error.message),
            category: "internal",
            retryable: false,
        },
        _ => error,
    }
}

/// A run that has started: its first event is out.
///
/// Its parts live on the heap, once: the task that runs it holds a pointer, so that the
/// future of every run in flight (and there may be 100,000) does not carry copies of them
/// (an `async fn` keeps its arguments beside the locals it moves them into).
pub struct StartedRun(Box<RunParts>);

struct RunParts {
    engine: Engine,
    spec: RunSpec,
    emitter: Emitter,
    control: Arc<RunControl>,
    /// Where a run taken over goes on from.
    resume: Option<Box<Resume>>,
}

impl StartedRun {
    /// Makes the run until it ends; always publishes exactly one `done` event (unless the
    /// store stays unreachable past the end's patience).
    pub async fn run(self) {
        let mut parts = self.0;
        let resume = parts.resume.take();
        let spec = &parts.spec;
        let span = info_span!(
            "invoke_agent",
            otel.name = %format!("invoke_agent {}", spec.config.name),
            gen_ai.operation.name = "invoke_agent",
            gen_ai.agent.name = %spec.config.name,
            gen_ai.conversation.id = %spec.session_id,
            run_id = %spec.run_id,
            gen_ai.input.messages = tracing::field::Empty,
        );
        if agentrt_telemetry::capture_content() {
            span.record("gen_ai.input.messages", spec.query.as_str());
        }
        let metrics = Metrics::global();
        let _active = metrics.run_started();
        let run_timeout = spec.config.timeouts.run;
        // A run taken over has used part of its time already; time it waited for answers
        // does not count.
        let waited = resume
            .as_ref()
            .map_or(Duration::ZERO, |r| r.state.waited(now_ms()));
        let left = run_timeout.saturating_sub(
            std::time::SystemTime::now()
                .duration_since(parts.emitter.started())
                .unwrap_or_default()
                .saturating_sub(waited),
        );
        let outcome = {
            let RunParts {
                engine,
                spec,
                emitter,
                control,
                ..
            } = &mut *parts;
            let drive = engine
                .drive(spec, emitter, control, resume)
                .instrument(span.clone());
            tokio::select! {
                biased;
                () = control.stop_requested() => {
                    let reason = control.reason.get().copied().unwrap_or(StopReason::Cancelled);
                    Outcome::Failed(reason, stopped_error(reason))
                }
                () = tokio::time::sleep(left) => Outcome::Failed(StopReason::Timeout, RunError {
                    code: "RUN_TIMEOUT".into(),
                    message: format!("the run did not finish within its timeout of {run_timeout:?}"),
                    category: "timeout",
                    retryable: true,
                }),
                outcome = drive => match outcome.unwrap_or_else(|failed| failed) {
                    Outcome::Moved => Outcome::Moved,
                    Outcome::Waiting => Outcome::Waiting,
                    // A stop that lands while the run is being polled cancels the calls in
                    // flight before the stop branch above sees it: the failure it caused
                    // is the stop's.
                    Outcome::Failed(..) if control.is_stopped() => {
                        let reason = control.reason.get().copied().unwrap_or(StopReason::Cancelled);
                        Outcome::Failed(reason, stopped_error(reason))
                    }
                    outcome => outcome,
                },
            }
        };
        // The end is a future of its own, made when the run ends: what it takes apart and
        // awaits, held across more than one await here, would be laid out beside every
        // other await of this future, and so take room in every run in flight.
        Box::pin(end(parts, outcome, span, metrics)).await;
    }
}

/// Ends the run with `outcome`: publishes its end (or lets it go) and saves its record.
async fn end(parts: Box<RunParts>, outcome: Outcome, span: tracing::Span, metrics: &Metrics) {
    let RunParts {
        engine,
        mut emitter,
        control,
        spec,
        ..
    } = *parts;
    if control.is_let_go() {
        debug!(parent: &span, "run let go to another replica");
        emitter.release().await;
        return;
    }
    if control.abandoned.load(Ordering::Acquire) {
        emitter.abandoned();
    }
    debug!(parent: &span, ?outcome, "run ended");
    match outcome {
        Outcome::Answered(reason) => {
            metrics.run_finished(reason.as_str());
            emitter
                .finish_answered(reason, &*engine.sessions)
                .instrument(span)
                .await;
        }
        Outcome::Failed(reason, error) => {
            metrics.run_finished(reason.as_str());
            emitter.finish_failed(reason, error).instrument(span).await;
        }
        Outcome::Moved => {
            debug!(parent: &span, "run taken over by another replica");
            emitter.release().await;
        }
        Outcome::Waiting => {
            debug!(parent: &span, "run waits for tool outputs or approvals");
            // Its session's history outlives the wait: the run reads it again when it
            // goes on (a session is otherwise kept for its time to live from last use).
            if spec.llm_context.is_none()
                && let Err(error) = engine
                    .sessions
                    .keep(&spec.session_id, spec.config.timeouts.action)
                    .await
            {
                tracing::warn!(parent: &span, %error, "cannot keep the session of a waiting run for its wait");
            }
            emitter.park().await;
            control.parked.store(true, Ordering::Release);
        }
    }
}

impl Engine {
    /// Drives the run's step machine: asks it what to do, does it, feeds the result back,
    /// until it ends. `Err` carries an outcome that ends the run early (a model failure).
    async fn drive(
        &self,
        spec: &RunSpec,
        em: &mut Emitter,
        control: &RunControl,
        resume: Option<Box<Resume>>,
    ) -> Result<Outcome, Outcome> {
        let cancel = &control.cancel;
        let config = &spec.config;
        let Some(model) = self.models.get(&config.model.provider) else {
            return Err(Outcome::Failed(
                StopReason::InternalError,
                RunError {
                    code: "PROVIDER_NOT_CONFIGURED".into(),
                    message: format!(
                        "provider {:?} is not configured on this server",
                        config.model.provider
                    ),
                    category: "internal",
                    retryable: false,
                },
            ));
        };
        let counter = TokenCounter::shared();
        let strategy = strategy::of(config.strategy);
        let round_setup = RoundSetup {
            model: &model,
            provider: &config.model.provider,
            strategy,
            timeout: config.timeouts.model_call,
            cancel,
        };
        // Always sent: the system prompt, and the system messages a client's context
        // starts with (its instructions, never the first thing dropped to fit).
        let mut pinned: Vec<(ChatMessage, u32)> = strategy
            .system_message(config, &spec.tools)
            .into_iter()
            .chain(spec.llm_context.iter().flat_map(|messages| {
                messages
                    .iter()
                    .take_while(|m| matches!(m, ChatMessage::System(_)))
                    .cloned()
            }))
            .map(|m| {
                let tokens = counter.message(&m);
                (m, tokens)
            })
            .collect();
        pinned.shrink_to_fit();
        let history = match &spec.llm_context {
            Some(messages) => {
                let leading = messages
                    .iter()
                    .take_while(|m| matches!(m, ChatMessage::System(_)))
                    .count();
                Exchange::group(messages[leading..].to_vec(), counter)
            }
            None => {
                let mut history = self
                    .sessions
                    .history(&spec.session_id)
                    .await
                    .map_err(|e| state_failure("session history", &e))?;
                // A run that goes on sees the history it started with: turns of the
                // session that ended meanwhile came after its question.
                if let Some(resume) = &resume {
                    history.retain(|e| e.kept_by(resume.started_ms));
                }
                history
            }
        };
        let definitions = strategy.tool_definitions(&spec.tools);
        let reserved = definitions_tokens(&definitions, counter);
        let (mut state, mut saved_messages, mut carried) = match resume.map(|resume| *resume) {
            Some(resume) => (resume.state, resume.saved_messages, Some(resume.carried)),
            None => {
                // Saved as it is when the run started.
                let state = RunState::new(&spec.query, config.max_iterations, counter);
                let saved = state.messages.len();
                (state, saved, None)
            }
        };
        loop {
            match state.next() {
                Step::Model {
                    iteration,
                    with_tools,
                } => {
                    if let Some(carried) = carried.as_mut() {
                        if let Some(at) = carried.interrupted.iter().position(|i| *i == iteration) {
                            carried.interrupted.swap_remove(at);
                            em.round_restarted(iteration, carried.reason);
                        }
                        // What the previous owner published belongs to the step it saved:
                        // once a model round runs here, the calls it asks for are new,
                        // announced and checkpointed as any (a run taken over in a model
                        // round used to run them unannounced).
                        carried.recovered = None;
                    }
                    em.begin_round(iteration);
                    // The final request is asked once and not kept in the turn. Its room is
                    // reserved, as the tool definitions' is in the other rounds: it is what
                    // the round is for, and is never shortened to fit as the turn's tool
                    // results and observations are.
                    let final_request = (!with_tools).then(|| {
                        let message = ChatMessage::User(strategy.final_request());
                        let tokens = counter.message(&message);
                        (message, tokens)
                    });
                    // The final round offers the tools too, with no call allowed: its
                    // prompt is the rounds' before (a provider's cache of it holds), and
                    // providers that refuse tool calls in a conversation without tools
                    // (Anthropic's and Bedrock's, behind LiteLLM) accept it.
                    let mut fitted = fit(
                        &pinned,
                        &history,
                        &state.messages,
                        final_request
                            .as_ref()
                            .map_or(reserved, |(_, tokens)| reserved + *tokens),
                        config.context.max_prompt_tokens,
                        counter,
                    );
                    if let Some((message, _)) = final_request {
                        fitted.messages.push(message);
                        join_last_user_messages(&mut fitted.messages);
                    }
                    if fitted.dropped + fitted.compacted + fitted.shortened > 0 {
                        debug!(
                            dropped = fitted.dropped,
                            compacted = fitted.compacted,
                            shortened = fitted.shortened,
                            "prompt fitted to the token budget"
                        );
                    }
                    let mut request =
                        self.request(config, fitted.messages, definitions.clone(), strategy);
                    request.no_calls = !with_tools;
                    let reply = self
                        .model_round(&round_setup, request, fitted.tokens, em, iteration)
                        .await?;
                    if let Some(refused) =
                        state.model_replied_after(iteration, reply, strategy, counter, &history)
                    {
                        if refused.why == machine::REPEATED {
                            debug!(
                                "the model repeats the same tool calls; asking for a final answer"
                            );
                        }
                        refuse_calls(em, &refused.calls, refused.why);
                    }
                }
                Step::Tools(calls) => {
                    let calls = calls.to_vec();
                    // The calls and what continuing from here needs are saved before
                    // they run; the results are published as they come (a replica that
                    // takes the run over reads them from the log). A run taken over in
                    // this step has saved that already, and some results are known.
                    let known = carried.as_mut().and_then(|c| c.recovered.take());
                    let checkpoint = match known {
                        Some(_) => None,
                        None if em.durable() => {
                            Some(progress(&mut state, &mut saved_messages, None)?)
                        }
                        None => None,
                    };
                    // Boxed, as are the other steps that are not a model call: the future
                    // of a run is as large as its largest step, and runs in flight spend
                    // most of their time waiting for the model.
                    match Box::pin(self.run_tools(spec, &calls, em, cancel, checkpoint, known))
                        .await?
                    {
                        Ran::All(results) => state.tools_ran(results, strategy, counter),
                        Ran::Waiting { results, pending } => {
                            state.wait(results, pending.clone(), now_ms());
                            // Everything continuing needs is saved with the wait: a run
                            // that saved no progress so far saves all of it now.
                            let mut progress = if em.durable() {
                                progress(&mut state, &mut saved_messages, None)?
                            } else {
                                progress(&mut state, &mut 0, Some(spec))?
                            };
                            progress.wait = Some(config.timeouts.action);
                            // From the ACTION_REQUIRED event on, the client may go away.
                            control.waiting.store(true, Ordering::Release);
                            // Boxed: a wait happens once, and its future would enlarge every run.
                            Box::pin(em.wait(pending, progress)).await?;
                            return Ok(Outcome::Waiting);
                        }
                    }
                }
                Step::Answers {
                    calls,
                    results,
                    pending,
                } => {
                    let answered = Answered {
                        calls: calls.to_vec(),
                        results: results.to_vec(),
                        pending: pending.to_vec(),
                        known: carried
                            .as_mut()
                            .and_then(|c| c.recovered.take())
                            .unwrap_or_default(),
                        told: carried.as_mut().and_then(|c| c.waited.take()),
                    };
                    // A future of its own, made when the run is answered: what it holds
                    // across its awaits would otherwise be laid out beside every await of
                    // this one, and so take room in every run in flight.
                    Box::pin(self.answered(
                        spec,
                        em,
                        cancel,
                        &mut state,
                        &mut saved_messages,
                        answered,
                    ))
                    .await?;
                }
                Step::End(Ending::Answered { answer, reason }) => {
                    let reason = *reason;
                    // Readers see the answer before the session is written.
                    em.flush().await?;
                    // Kept with the run's end, in one write where the stores allow it.
                    em.keep_turn(turn(&state.messages, answer, counter));
                    return Ok(Outcome::Answered(reason));
                }
                Step::End(Ending::Failed { reason, error }) => {
                    return Err(Outcome::Failed(*reason, error.clone()));
                }
            }
        }
    }

    fn request(
        &self,
        config: &AgentConfig,
        messages: Vec<ChatMessage>,
        tools: Arc<[ToolDefinition]>,
        strategy: &dyn RunStrategy,
    ) -> ChatRequest {
        ChatRequest {
            model: config.model.name.clone(),
            messages,
            parallel_tool_calls: config.parallel_tool_calls && !tools.is_empty(),
            no_calls: false,
            tools,
            temperature: config.model.temperature,
            max_tokens: config.model.max_tokens,
            stop: strategy.stop(),
            deadline: None,
        }
    }

    /// One model call, streamed into events. `prompt_tokens` is what the prompt counts,
    /// for the usage of a provider that reports none.
    ///
    /// Not an `async fn`: runs in flight wait in this future for the model, and an `async
    /// fn` would keep room for the request (as its argument and as its local) though the
    /// model took it when the call was made.
    fn model_round(
        &self,
        setup: &RoundSetup<'_>,
        mut request: ChatRequest,
        prompt_tokens: u32,
        em: &mut Emitter,
        iteration: u32,
    ) -> impl Future<Output = Result<Reply, Outcome>> {
        let RoundSetup {
            model,
            provider,
            strategy,
            timeout,
            cancel,
        } = *setup;
        let span = info_span!(
            "chat",
            otel.name = %format!("chat {}", request.model),
            otel.kind = "client",
            gen_ai.operation.name = "chat",
            gen_ai.system = %provider,
            gen_ai.request.model = %request.model,
            gen_ai.usage.input_tokens = tracing::field::Empty,
            gen_ai.usage.output_tokens = tracing::field::Empty,
        );
        let model_name = request.model.clone();
        let started = Instant::now();
        // A retry that could not finish in time is not waited for.
        request.deadline = Some(started + timeout);
        // The call is made now and polled once what waits is published.
        let call = model.stream(request, cancel.child_token());
        async move {
            let mut first_delta = None;
            let work = async {
                em.flush_soon().await?;
                // From here the prompt is on its way: a run that ends before the call reports
                // its usage counts it, estimated, unless the provider refused or was never
                // reached.
                em.model_answering(prompt_tokens);
                let stream = match call.await {
                    Ok(stream) => stream,
                    Err(error) => {
                        if error.never_processed() {
                            em.model_not_answering();
                        }
                        return Err(model_failure(error));
                    }
                };
                // The reply is read by a future of its own, made once the model answers:
                // what it holds while it reads would otherwise take room while the run waits
                // for the answer to begin, which is where most runs in flight are.
                let Streamed {
                    mut stream,
                    parser,
                    mut stop_cut,
                    mut pieces,
                    mut content,
                    reasoning,
                    calls,
                    finish,
                    usage,
                    refusal,
                    finished,
                } = Box::pin(read_reply(stream, strategy, em, &mut first_delta)).await?;
                // After the finish, the answer is whole: the end of the body, which a server
                // may keep open a while after `[DONE]` (the client reads it, up to a grace,
                // rather than resetting the stream), is read without holding the run.
                if finished && stream.next().now_or_never().is_none() {
                    tokio::spawn(async move { while stream.next().await.is_some() {} });
                } else {
                    drop(stream);
                }
                let estimated = usage.is_none();
                let usage = usage.unwrap_or_else(|| Usage {
                    prompt_tokens: u64::from(prompt_tokens),
                    completion_tokens: estimate_completion(&reasoning, &content, &calls),
                });
                tracing::Span::current().record("gen_ai.usage.input_tokens", usage.prompt_tokens);
                tracing::Span::current()
                    .record("gen_ai.usage.output_tokens", usage.completion_tokens);
                Metrics::global().tokens(
                    &model_name,
                    usage.prompt_tokens,
                    usage.completion_tokens,
                    estimated,
                );
                // What follows is published at the next wait: the tools' checkpoint, the next
                // round or the end.
                em.usage(usage, estimated);
                debug!(
                    ?finish,
                    calls = calls.len(),
                    estimated,
                    "model round finished"
                );
                if finish == FinishReason::ContentFilter {
                    // The provider withheld the rest: what streamed is not an answer.
                    return Err(Outcome::Failed(
                        StopReason::ModelError,
                        RunError {
                            code: "MODEL_CONTENT_FILTERED".into(),
                            message: "the provider's content filter stopped the model's response \
                                  (finish_reason: content_filter)"
                                .into(),
                            category: "model",
                            retryable: false,
                        },
                    ));
                }
                if let Some(refusal) =
                    refusal.filter(|_| content.trim().is_empty() && calls.is_empty())
                {
                    // A refusal is the model's, not an empty answer: asking again gets it again.
                    return Err(Outcome::Failed(
                        StopReason::ModelError,
                        RunError {
                            code: "MODEL_REFUSED".into(),
                            message: format!("the model refused to answer: {refusal}"),
                            category: "model",
                            retryable: false,
                        },
                    ));
                }
                let cut_short = finish == FinishReason::Length;
                // The last call cut right after its name has no arguments yet (a call
                // that takes none is sent with `{}`).
                let cut_call = |(index, call): &(usize, &ModelToolCall)| {
                    parse_arguments(&call.arguments).is_err()
                        || (index + 1 == calls.len() && call.arguments.trim().is_empty())
                };
                if cut_short && let Some((_, call)) = calls.iter().enumerate().find(cut_call) {
                    // Cut off inside a call's arguments: not the model's mistake to show it,
                    // and the next round would be cut the same way.
                    return Err(Outcome::Failed(
                        StopReason::MaxTokens,
                        RunError {
                            code: "MODEL_MAX_TOKENS".into(),
                            message: format!(
                                "the model reached its token limit (finish_reason: length) \
                                 inside the arguments of its call of {:?}; raise \
                                 model.max_tokens",
                                call.name.chars().take(64).collect::<String>()
                            ),
                            category: "model",
                            retryable: false,
                        },
                    ));
                }
                if finish == FinishReason::ToolCalls && calls.is_empty() && parser.is_none() {
                    // Its calls were lost (none readable, none named): the text beside them
                    // ("let me look that up") is not an answer.
                    return Err(Outcome::Failed(
                        StopReason::ModelError,
                        RunError {
                            code: "MODEL_TOOL_CALLS_UNREADABLE".into(),
                            message: "the model ended its reply to call tools \
                                      (finish_reason: tool_calls), but gave no call this server \
                                      could read"
                                .into(),
                            category: "model",
                            retryable: true,
                        },
                    ));
                }
                let Some(mut parser) = parser else {
                    if !calls.is_empty() {
                        return Ok(Reply::Tools {
                            content,
                            calls,
                            cut_short,
                        });
                    }
                    return answer_or_error(content, cut_short);
                };
                let held = stop_cut.finish();
                content.push_str(&held);
                if content.trim().is_empty() && !calls.is_empty() {
                    // Not an empty reply: calls the ReAct protocol does not read (it offers no
                    // tools natively), which the client should hear named as such.
                    return Err(native_calls_under_react(&calls));
                }
                parser.push(&held, &mut pieces);
                parser.finish(&mut pieces);
                em.pieces(pieces.drain(..));
                if parser.answered() {
                    return answer_or_error(parser.answer().to_owned(), cut_short);
                }
                if let Some((name, input)) = parser.action() {
                    // The conversation keeps the reply up to its action: its observation then
                    // follows the action it answers, not a later one that does not run.
                    if let Some(end) = parser.action_end() {
                        content.truncate(end);
                    }
                    let call = ModelToolCall {
                        id: format!("react_{iteration}"),
                        name,
                        arguments: input,
                    };
                    return Ok(Reply::Tools {
                        content,
                        calls: vec![call],
                        cut_short,
                    });
                }
                if let Some(text) = parser.unmarked() {
                    // No protocol at all: the reply is the answer, streamed once, as such.
                    let text = text.to_owned();
                    em.answer(text.clone());
                    return answer_or_error(text, cut_short);
                }
                if cut_short {
                    return answer_or_error(String::new(), cut_short);
                }
                Ok(Reply::Unreadable { content })
            }
            .instrument(span);
            let result = tokio::time::timeout(timeout, work).await;
            Metrics::global().model_call(
                &model_name,
                matches!(result, Ok(Ok(_))),
                started.into_std(),
                first_delta.map(Instant::into_std),
            );
            match result {
                Ok(result) => result,
                Err(_) => Err(Outcome::Failed(
                    StopReason::Timeout,
                    RunError {
                        code: "MODEL_TIMEOUT".into(),
                        message: format!("the model call did not finish within {timeout:?}"),
                        category: "timeout",
                        retryable: true,
                    },
                )),
            }
        }
    }

    /// Runs a round's calls (concurrently under the cap when the config allows), those
    /// that need nothing; answers their results in call order, or, when some calls wait
    /// for approval or for the caller's output, the results so far and the calls that
    /// wait.
    async fn run_tools(
        &self,
        spec: &RunSpec,
        calls: &[ModelToolCall],
        em: &mut Emitter,
        cancel: &CancellationToken,
        checkpoint: Option<Progress>,
        known: Option<HashMap<String, (ToolResult, Duration)>>,
    ) -> Result<Ran, Outcome> {
        // A run taken over announced its calls already.
        let resumed = known.is_some();
        let mut known = known.unwrap_or_default();
        if !resumed {
            em.expect_tool_calls(calls.len());
        }
        let mut results: Vec<Option<ToolResult>> = vec![None; calls.len()];
        let mut prepared: Vec<(usize, Result<ToolInvocation, ToolResult>)> =
            Vec::with_capacity(calls.len());
        let mut waiting = Vec::new();
        for (index, call) in calls.iter().enumerate() {
            if let Some((result, duration)) = known.remove(&call.id) {
                em.recovered_result(&call.id, &result, duration);
                results[index] = Some(result);
                continue;
            }
            match self.prepare(spec, call, em, resumed) {
                Prepared::Run(invocation) => prepared.push((index, Ok(invocation))),
                Prepared::Done(result) => prepared.push((index, Err(result))),
                Prepared::Wait(action, arguments) => waiting.push(PendingCall {
                    id: call.id.clone(),
                    name: call.name.clone(),
                    arguments: agentrt_events::JsonText::new(&arguments),
                    action,
                    answered: false,
                }),
            }
        }
        // The calls are announced and recorded before they run: GetRun shows them while
        // they run, on any replica.
        if !resumed {
            em.checkpoint(checkpoint).await?;
        }
        self.execute_calls(spec, calls, prepared, &mut results, em, cancel)
            .await?;
        if waiting.is_empty() {
            return Ok(Ran::All(
                results.into_iter().map(Option::unwrap_or_default).collect(),
            ));
        }
        Ok(Ran::Waiting {
            results: results
                .iter()
                .map(|r| r.as_ref().map(CallResult::from))
                .collect(),
            pending: waiting,
        })
    }

    /// Goes on with a run that was answered (or taken over while its approved calls
    /// ran): takes the answers, saves what was decided, runs the approved calls, and gives
    /// the step machine every call's result.
    async fn answered(
        &self,
        spec: &RunSpec,
        em: &mut Emitter,
        cancel: &CancellationToken,
        state: &mut RunState,
        saved_messages: &mut usize,
        answered: Answered,
    ) -> Result<(), Outcome> {
        let Answered {
            calls,
            mut results,
            pending,
            known,
            told,
        } = answered;
        let to_run = match told {
            Some(told) => {
                let to_run =
                    self.take_answers(spec, &calls, &mut results, &pending, (&told, &known), em)?;
                state.decided(results.clone(), &to_run, now_ms());
                if em.durable() {
                    let progress = progress(state, saved_messages, None)?;
                    em.checkpoint(Some(progress)).await?;
                }
                to_run
            }
            // Answered already, and taken over while the approved calls ran.
            None => state.approved().to_vec(),
        };
        let results = self
            .run_approved(spec, &calls, results, &to_run, known, em, cancel)
            .await?;
        let strategy = strategy::of(spec.config.strategy);
        state.answered(results, now_ms(), strategy, TokenCounter::shared());
        Ok(())
    }

    /// Reads the answers a waiting run was told: the outputs of client tools and the
    /// denials become results (published), the approved calls are answered, to run.
    fn take_answers(
        &self,
        spec: &RunSpec,
        calls: &[ModelToolCall],
        results: &mut [Option<CallResult>],
        pending: &[PendingCall],
        (told, published): (&Answers, &HashMap<String, (ToolResult, Duration)>),
        em: &mut Emitter,
    ) -> Result<Vec<String>, Outcome> {
        let mut to_run = Vec::new();
        let mut missing = Vec::new();
        for call in pending {
            let Some(index) = calls.iter().position(|c| c.id == call.id) else {
                continue;
            };
            let answer = told
                .answers
                .get(&call.id)
                .and_then(|a| serde_json::from_str::<ToolAnswer>(a).ok());
            let result = match answered(call.action, answer, self.max_tool_output_bytes) {
                Taken::Result(result) => result,
                Taken::Run => {
                    to_run.push(call.id.clone());
                    continue;
                }
                Taken::Missing => {
                    missing.push(call.id.as_str());
                    continue;
                }
            };
            // A replica that took the run over before published it (it went before it
            // saved its decisions): not published twice.
            match published.get(&call.id) {
                None => em.tool_result(&call.id, &call.name, &result, Duration::ZERO, None),
                // Its record has it all the same (else it ends "not finished").
                Some((_, duration)) => em.recovered_result(&call.id, &result, *duration),
            }
            results[index] = Some(CallResult::from(&result));
        }
        // Cancelled while it waited, the run still publishes (and records) the answers it
        // accepted before; no approved call runs.
        if told.cancelled {
            return Err(Outcome::Failed(
                StopReason::Cancelled,
                stopped_error(StopReason::Cancelled),
            ));
        }
        if !missing.is_empty() {
            return Err(Outcome::Failed(
                StopReason::ActionTimeout,
                RunError {
                    code: "ACTION_TIMEOUT".into(),
                    message: format!(
                        "no answer within the action timeout of {:?} for tool calls {}",
                        spec.config.timeouts.action,
                        missing.join(", ")
                    ),
                    category: "timeout",
                    retryable: false,
                },
            ));
        }
        Ok(to_run)
    }

    /// Runs the approved calls of a round that waited, and answers every call's result in
    /// call order.
    #[allow(clippy::too_many_arguments)] // the parts of one step, as run_tools takes them
    async fn run_approved(
        &self,
        spec: &RunSpec,
        calls: &[ModelToolCall],
        results: Vec<Option<CallResult>>,
        to_run: &[String],
        mut known: HashMap<String, (ToolResult, Duration)>,
        em: &mut Emitter,
        cancel: &CancellationToken,
    ) -> Result<Vec<ToolResult>, Outcome> {
        let mut out: Vec<Option<ToolResult>> = results
            .into_iter()
            .map(|r| {
                r.map(|r| ToolResult {
                    output: r.output,
                    is_error: r.is_error,
                    references: Vec::new(),
                })
            })
            .collect();
        let mut prepared = Vec::with_capacity(to_run.len());
        for id in to_run {
            let Some(index) = calls.iter().position(|c| c.id == *id) else {
                continue;
            };
            if out[index].is_some() {
                continue;
            }
            let call = &calls[index];
            if let Some((result, duration)) = known.remove(id) {
                // Ran before this replica took the run over.
                em.recovered_result(id, &result, duration);
                out[index] = Some(result);
                continue;
            }
            let invocation = parse_arguments(&call.arguments)
                .map(|arguments| invocation(spec, call, arguments))
                .map_err(ToolResult::error);
            prepared.push((index, invocation));
        }
        self.execute_calls(spec, calls, prepared, &mut out, em, cancel)
            .await?;
        let lost: Vec<&str> = calls
            .iter()
            .zip(&out)
            .filter(|(_, r)| r.is_none())
            .map(|(c, _)| c.id.as_str())
            .collect();
        if !lost.is_empty() {
            return Err(Outcome::Failed(
                StopReason::InternalError,
                RunError {
                    code: "INTERNAL".into(),
                    message: format!("the answers to tool calls {} were lost", lost.join(", ")),
                    category: "internal",
                    retryable: false,
                },
            ));
        }
        Ok(out.into_iter().map(Option::unwrap_or_default).collect())
    }

    /// Runs `prepared` calls of `calls` (concurrently under the cap when the config
    /// allows), publishing each result as it comes, into `results`.
    async fn execute_calls(
        &self,
        spec: &RunSpec,
        calls: &[ModelToolCall],
        prepared: Vec<(usize, Result<ToolInvocation, ToolResult>)>,
        results: &mut [Option<ToolResult>],
        em: &mut Emitter,
        cancel: &CancellationToken,
    ) -> Result<(), Outcome> {
        let config = &spec.config;
        let timeout = config.timeouts.tool_call;
        let runner = &self.tools;
        let max_output = self.max_tool_output_bytes;
        let round = em.iteration();
        let execute = |index: usize, prepared: Result<ToolInvocation, ToolResult>| async move {
            let started = Instant::now();
            let mut result = match prepared {
                Ok(mut invocation) => {
                    invocation.key =
                        format!("{}.{round}.{}", invocation.run_id, invocation.call_id);
                    let span = info_span!(
                        "execute_tool",
                        otel.name = %format!("execute_tool {}", invocation.name),
                        gen_ai.operation.name = "execute_tool",
                        gen_ai.tool.name = %invocation.name,
                        gen_ai.tool.call.id = %invocation.call_id,
                        gen_ai.tool.call.arguments = tracing::field::Empty,
                    );
                    if agentrt_telemetry::capture_content() {
                        span.record(
                            "gen_ai.tool.call.arguments",
                            invocation.arguments.to_string().as_str(),
                        );
                    }
                    runner.run(invocation, timeout).instrument(span).await
                }
                Err(refused) => refused,
            };
            let elapsed = started.elapsed();
            truncate_output(&mut result.output, max_output);
            // A name the model made up (a refused call) is no series of its own: a query
            // can steer the model, and the label's names are bounded.
            let name = calls[index].name.as_str();
            // Nor is a client tool's (each caller names its own): they count together.
            let label = if config.client_tool(name).is_some() {
                "client"
            } else if spec.tools.iter().any(|tool| tool.name == name) {
                name
            } else {
                "unknown"
            };
            Metrics::global().tool_call(label, result.is_error, elapsed);
            let rerank = self
                .rerank(config, &spec.query, &mut result.references, cancel)
                .await;
            (index, result, elapsed, rerank)
        };
        let concurrency = if config.parallel_tool_calls {
            config.max_parallel_tool_calls.max(1) as usize
        } else {
            1
        };
        let finished = |em: &mut Emitter,
                        results: &mut [Option<ToolResult>],
                        (index, result, duration, rerank): (
            usize,
            ToolResult,
            Duration,
            Option<RerankOutcome>,
        )| {
            let call = &calls[index];
            em.tool_result(&call.id, &call.name, &result, duration, rerank);
            results[index] = Some(result);
        };
        if concurrency == 1 || prepared.len() == 1 {
            // One at a time: awaited in place, without a task set to allocate.
            let mut left = prepared.len();
            for (index, prepared) in prepared {
                let done = execute(index, prepared).await;
                finished(em, results, done);
                // The last result goes out with the next round's start.
                left -= 1;
                if left > 0 {
                    em.flush().await?;
                }
            }
        } else {
            let mut left = prepared.len();
            let mut running =
                futures_util::stream::iter(prepared.into_iter().map(|(i, p)| execute(i, p)))
                    .buffer_unordered(concurrency);
            while let Some(done) = running.next().await {
                finished(em, results, done);
                left -= 1;
                if left > 0 {
                    em.flush().await?;
                }
            }
        }
        Ok(())
    }

    /// Announces a call (unless a previous owner of the run did) and says what becomes
    /// of it: it runs on the tool executor, it has its result already (it cannot run), or
    /// it waits for an approval or for the caller's output.
    fn prepare(
        &self,
        spec: &RunSpec,
        call: &ModelToolCall,
        em: &mut Emitter,
        announced: bool,
    ) -> Prepared {
        let config = &spec.config;
        let arguments = parse_arguments(&call.arguments);
        if !announced {
            match &arguments {
                Ok(parsed) => em.tool_call(&call.id, &call.name, parsed),
                Err(_) => em.tool_call(&call.id, &call.name, &unreadable_arguments(call)),
            }
        }
        let arguments = match arguments {
            Ok(arguments) => arguments,
            Err(error) => return Prepared::Done(ToolResult::error(error)),
        };
        if let Some(tool) = config.client_tool(&call.name) {
            // The caller sees only calls that match the tool's schema: the model fixes
            // the others.
            return match schema_violations(&tool.input_schema, &arguments) {
                None => Prepared::Wait(Action::ClientExecute, arguments),
                Some(violations) => Prepared::Done(arguments_refused(&call.name, &violations)),
            };
        }
        if !config.tools.iter().any(|t| t == &call.name) {
            let available: Vec<&str> = config
                .tools
                .iter()
                .map(String::as_str)
                .chain(config.client_tools.iter().map(|t| t.name.as_str()))
                .collect();
            return Prepared::Done(ToolResult::error(format!(
                "tool {:?} is not available to this agent; available tools: {}",
                call.name,
                if available.is_empty() {
                    "none".to_owned()
                } else {
                    available.join(", ")
                }
            )));
        }
        if config.needs_approval(&call.name) {
            // A person is asked only about calls that can run: arguments the tool's
            // schema refuses go back to the model at once, as the tool executor would
            // send them back after the approval. (A schema this validator cannot use is
            // left to the tool executor.)
            let refused = spec
                .tools
                .iter()
                .find(|tool| tool.name == call.name)
                .and_then(|tool| jsonschema::validator_for(&tool.input_schema).ok())
                .and_then(|validator| violations(&validator, &arguments));
            return match refused {
                None => Prepared::Wait(Action::Approve, arguments),
                Some(violations) => Prepared::Done(arguments_refused(&call.name, &violations)),
            };
        }
        Prepared::Run(invocation(spec, call, arguments))
    }
}

/// What becomes of a call of a round.
enum Prepared {
    /// It runs on the tool executor.
    Run(ToolInvocation),
    /// It cannot run: this is its result.
    Done(ToolResult),
    /// It waits for an answer, with these arguments.
    Wait(Action, serde_json::Value),
}

/// How a round's calls went.
enum Ran {
    /// Every call has its result, in call order.
    All(Vec<ToolResult>),
    /// Some calls wait for answers; the others' results, in call order.
    Waiting {
        results: Vec<Option<CallResult>>,
        pending: Vec<PendingCall>,
    },
}

/// The invocation of `call` on the tool executor.
fn invocation(
    spec: &RunSpec,
    call: &ModelToolCall,
    arguments: serde_json::Value,
) -> ToolInvocation {
    ToolInvocation {
        call_id: call.id.clone(),
        key: String::new(),
        name: call.name.clone(),
        arguments,
        run_id: spec.run_id.clone(),
        session_id: spec.session_id.clone(),
    }
}

/// The tokens every model request of an agent sends whatever the conversation: its system
/// message (the system prompt, with ReAct's instructions for its strategy) and its tools'
/// definitions. A budget (`context.max_prompt_tokens`) at or under it leaves no room for
/// the conversation.
pub fn fixed_prompt_tokens(config: &AgentConfig, tools: &[ToolSpec]) -> u32 {
    let counter = TokenCounter::shared();
    let strategy = strategy::of(config.strategy);
    let system = strategy
        .system_message(config, tools)
        .map_or(0, |m| counter.message(&m));
    system + definitions_tokens(&strategy.tool_definitions(tools), counter)
}

/// The tokens of the tools' definitions a request offers natively.
fn definitions_tokens(definitions: &[ToolDefinition], counter: &TokenCounter) -> u32 {
    definitions
        .iter()
        .map(|d| {
            counter.text(&d.name)
                + counter.text(&d.description)
                + counter.text(&d.parameters.text())
        })
        .sum()
}

/// Whether `schema` is a JSON Schema the engine can check a client tool's arguments
/// against (with the validator the tool executor uses): `Err` says why not.
pub fn check_input_schema(schema: &serde_json::Value) -> Result<(), String> {
    if !schema.is_object() {
        return Err("must be a JSON Schema object".into());
    }
    if let Some(kind) = schema.get("type")
        && kind != "object"
    {
        return Err(format!(
            "must describe an object (\"type\": \"object\"), got \"type\": {kind}"
        ));
    }
    if let Some(reference) = outside_reference(schema) {
        return Err(format!(
            "refers to {reference:?}: only references within the schema (\"#/...\") are \
             resolved; put what it refers to under \"$defs\""
        ));
    }
    jsonschema::validator_for(schema)
        .map(drop)
        .map_err(|e| format!("is not a valid JSON Schema: {e}"))
}

/// The first `$ref` of `schema` that points outside it (a URL or another file), if any.
fn outside_reference(schema: &serde_json::Value) -> Option<&str> {
    match schema {
        serde_json::Value::Object(map) => map
            .get("$ref")
            .and_then(serde_json::Value::as_str)
            .filter(|r| !r.starts_with('#'))
            .or_else(|| map.values().find_map(outside_reference)),
        serde_json::Value::Array(items) => items.iter().find_map(outside_reference),
        _ => None,
    }
}

/// The result of a call of `tool` whose arguments break its input schema (`violations`):
/// it does not run, and the model reads why.
fn arguments_refused(tool: &str, violations: &str) -> ToolResult {
    ToolResult::error(format!(
        "the arguments do not match the input schema of tool {tool:?}: {violations}"
    ))
}

/// Where `arguments` break `schema` (a JSON Schema that validation accepted), said for
/// the model; `None` when they match.
fn schema_violations(schema: &serde_json::Value, arguments: &serde_json::Value) -> Option<String> {
    match jsonschema::validator_for(schema) {
        Ok(validator) => violations(&validator, arguments),
        Err(error) => Some(format!("the schema cannot be used: {error}")),
    }
}

/// Where `arguments` break what `validator` checks, said for the model; `None` when they
/// match.
fn violations(validator: &jsonschema::Validator, arguments: &serde_json::Value) -> Option<String> {
    let violations: Vec<String> = validator
        .iter_errors(arguments)
        .take(10)
        .map(|error| {
            let at = error.instance_path().to_string();
            if at.is_empty() {
                error.to_string()
            } else {
                format!("{at}: {error}")
            }
        })
        .collect();
    (!violations.is_empty()).then(|| violations.join("; "))
}

impl Engine {
    /// Reranks a call's references when the agent has a rerank model: the `top_n` best
    /// scoring at least `min_score`, best first, scored by the reranker. A failing
    /// reranker, or one that does not answer within the smaller of the agent's tool-call
    /// timeout and [`agentrt_models::RERANK_TIMEOUT`], never fails the run: the
    /// references stay in the tool's order and the outcome says why.
    async fn rerank(
        &self,
        config: &AgentConfig,
        query: &str,
        references: &mut Vec<Reference>,
        cancel: &CancellationToken,
    ) -> Option<RerankOutcome> {
        let selection = config.rerank_model.as_ref()?;
        if references.is_empty() {
            return None;
        }
        let Some(reranker) = self.models.reranker(&selection.provider) else {
            return Some(RerankOutcome::Failed(format!(
                "provider {:?} is not configured on this server",
                selection.provider
            )));
        };
        let top_n = usize::try_from(selection.top_n)
            .unwrap_or(usize::MAX)
            .max(1);
        let request = RerankRequest {
            model: selection.name.clone(),
            query: query.to_owned(),
            documents: references
                .iter()
                .map(|r| {
                    if r.snippet.is_empty() {
                        r.title.clone()
                    } else {
                        r.snippet.clone()
                    }
                })
                .collect(),
            top_n: Some(top_n),
        };
        let span = info_span!(
            "rerank",
            otel.name = %format!("rerank {}", selection.name),
            gen_ai.request.model = %selection.name,
            documents = references.len(),
        );
        // A reranker is bounded by the agent's tool-call timeout as a tool is (and never
        // longer than the client's own limit): a slow one must not hold up the run.
        let limit = config
            .timeouts
            .tool_call
            .min(agentrt_models::RERANK_TIMEOUT);
        let ranked = match tokio::time::timeout(
            limit,
            reranker
                .rerank(request, cancel.child_token())
                .instrument(span),
        )
        .await
        {
            Ok(ranked) => ranked,
            Err(_) => {
                debug!(?limit, "rerank timed out; references keep the tool's order");
                return Some(RerankOutcome::Failed(format!(
                    "the reranker did not answer within {limit:?}"
                )));
            }
        };
        match ranked {
            Ok(ranked) => {
                // The decimal the client wrote (0.4), not the float it was sent as widened
                // (0.4000000059604645): a reference scored exactly `min_score` is kept.
                let min_score = selection
                    .min_score
                    .to_string()
                    .parse::<f64>()
                    .unwrap_or_else(|_| f64::from(selection.min_score));
                *references = ranked
                    .into_iter()
                    .filter(|r| r.relevance_score >= min_score)
                    .filter_map(|r| {
                        let mut reference = references.get(r.index)?.clone();
                        reference.score = r.relevance_score;
                        Some(reference)
                    })
                    .take(top_n)
                    .collect();
                Some(RerankOutcome::Reranked)
            }
            Err(error) => {
                debug!(%error, "rerank failed; references keep the tool's order");
                Some(RerankOutcome::Failed(error.to_string()))
            }
        }
    }
}

/// Cuts `output` to at most `max` bytes (at a character boundary) followed by a marker
/// saying how much was left out.
fn truncate_output(output: &mut String, max: usize) {
    // Cut here already (a client's output, cut when it was accepted): left as it is.
    if output.len() > max
        && let Some(at) = output.rfind(CUT_MARK)
        && at <= max
        && output.len() - at <= 160
        && output.ends_with(']')
    {
        return;
    }
    // An output the tool executor cut already ends with its own marker, which the cut
    // here would drop: the size it names is the output's.
    let cut_before = output
        .rsplit_once("\n[output truncated at ")
        .and_then(|(_, rest)| rest.strip_suffix(" bytes]"))
        .and_then(|size| size.parse::<u64>().ok());
    if let Some((omitted, total)) = agentrt_core::truncate_at_char_boundary(output, max) {
        output.push_str(&match cut_before {
            Some(size) => format!(
                "{CUT_MARK}{} bytes kept; the tool executor had cut it at {size} bytes \
                 already]",
                total - omitted
            ),
            None => format!("{CUT_MARK}{omitted} of {total} bytes omitted]"),
        });
    }
}

/// How the mark of an output cut here begins.
const CUT_MARK: &str = "\n[tool output truncated: ";

/// Joins the prompt's last two messages into one when both are the user's: the final
/// request after a ReAct observation (itself a user message). Chat templates that hold
/// roles to alternating (Llama 2, Mistral, Gemma, served by vLLM or llama.cpp) refuse two
/// user messages in a row.
fn join_last_user_messages(messages: &mut Vec<ChatMessage>) {
    if let [.., ChatMessage::User(_), ChatMessage::User(_)] = messages.as_slice()
        && let Some(ChatMessage::User(last)) = messages.pop()
        && let Some(ChatMessage::User(before)) = messages.last_mut()
    {
        before.push_str("\n\n");
        before.push_str(&last);
    }
}

/// The failure of a ReAct round whose reply was only native tool calls: the protocol asks
/// for actions in text and offers no tools natively, so the calls are not run.
fn native_calls_under_react(calls: &[ModelToolCall]) -> Outcome {
    let names: Vec<&str> = calls.iter().map(|c| c.name.as_str()).collect();
    Outcome::Failed(
        StopReason::ModelError,
        RunError {
            code: "MODEL_EMPTY_RESPONSE".into(),
            message: format!(
                "the model replied with no text, only native tool calls ({}), which the \
                 ReAct strategy does not read: it asks for actions in text. Use the \
                 function-calling strategy with a model that calls tools natively",
                names.join(", ")
            ),
            category: "model",
            // The same agent asking the same model again gets the same kind of reply.
            retryable: false,
        },
    )
}

/// An answer, unless there is none: an empty reply is a model failure, never a success.
fn answer_or_error(text: String, cut_short: bool) -> Result<Reply, Outcome> {
    if !text.trim().is_empty() {
        return Ok(Reply::Answer { text, cut_short });
    }
    let (reason, code, message) = if cut_short {
        (
            StopReason::MaxTokens,
            "MODEL_MAX_TOKENS",
            "the model reached its token limit (finish_reason: length) before writing any \
             answer; raise model.max_tokens",
        )
    } else {
        (
            StopReason::ModelError,
            "MODEL_EMPTY_RESPONSE",
            "the model returned an empty response: no text and no tool calls",
        )
    };
    Err(Outcome::Failed(
        reason,
        RunError {
            code: code.into(),
            message: message.into(),
            category: "model",
            retryable: !cut_short,
        },
    ))
}

/// What a model's reply streamed (see [`read_reply`]).
struct Streamed {
    stream: agentrt_models::ChatStream,
    parser: Option<react::Parser>,
    stop_cut: react::StopCut,
    pieces: Vec<react::Segment>,
    content: String,
    reasoning: String,
    calls: Vec<ModelToolCall>,
    finish: FinishReason,
    usage: Option<Usage>,
    refusal: Option<String>,
    /// Whether the model said it finished.
    finished: bool,
}

/// Reads a model's reply from `stream` into events, up to its finish (or its end); when
/// its first delta came, into `first_delta`.
async fn read_reply(
    mut stream: agentrt_models::ChatStream,
    strategy: &dyn strategy::Strategy,
    em: &mut Emitter,
    first_delta: &mut Option<Instant>,
) -> Result<Streamed, Outcome> {
    let mut parser = strategy.reply_parser();
    let mut stop_cut = react::StopCut::default();
    let mut pieces = Vec::new();
    let mut content = String::new();
    let mut reasoning = String::new();
    let mut calls = Vec::new();
    let mut finish = FinishReason::Unknown;
    let mut usage = None;
    let mut refusal = None;
    let mut finished = false;
    loop {
        // Deltas that are already here are published as one batch; readers are
        // woken only when the model makes us wait.
        let next = match stream.next().now_or_never() {
            Some(next) => next,
            None => {
                em.flush().await?;
                stream.next().await
            }
        };
        let Some(delta) = next else { break };
        first_delta.get_or_insert_with(Instant::now);
        match delta.map_err(model_failure)? {
            ChatDelta::Reasoning(text) => {
                reasoning.push_str(&text);
                em.thought(text);
            }
            ChatDelta::Content(text) => match parser.as_mut() {
                Some(parser) => {
                    // The server may not honour the stop sequence: cut there.
                    let text = stop_cut.push(&text);
                    content.push_str(&text);
                    parser.push(&text, &mut pieces);
                    em.pieces(pieces.drain(..));
                    if stop_cut.stopped() {
                        finish = FinishReason::Stop;
                        break;
                    }
                }
                None => {
                    content.push_str(&text);
                    em.answer(text);
                }
            },
            ChatDelta::ToolCall(call) => add_call(&mut calls, call),
            ChatDelta::Refusal(text) => refusal = Some(text),
            ChatDelta::Finish {
                reason,
                usage: reported,
            } => {
                finish = reason;
                usage = reported;
                finished = true;
                break;
            }
        }
    }
    Ok(Streamed {
        stream,
        parser,
        stop_cut,
        pieces,
        content,
        reasoning,
        calls,
        finish,
        usage,
        refusal,
        finished,
    })
}

/// Adds a call of a round, under an id no other call of the round has: a model (or server)
/// that sends two calls under one id, or none, would otherwise make their results and
/// answers indistinguishable.
fn add_call(calls: &mut Vec<ModelToolCall>, mut call: ModelToolCall) {
    // An id longer than any provider's (they are a few dozen characters) is the model's
    // invention: it would go into every event, key and answer; it is replaced.
    if call.id.len() > MAX_CALL_ID_BYTES {
        call.id.clear();
    }
    if call.id.is_empty() || calls.iter().any(|c| c.id == call.id) {
        let stem = if call.id.is_empty() { "call" } else { &call.id };
        let mut n = calls.len();
        let mut id = format!("{stem}_{n}");
        while calls.iter().any(|c| c.id == id) {
            n += 1;
            id = format!("{stem}_{n}");
        }
        call.id = id;
    }
    calls.push(call);
}

/// Longest call id kept as the model gave it, in bytes.
const MAX_CALL_ID_BYTES: usize = 64;

/// Tokens a model generated, counted by the server for a provider that reports none.
fn estimate_completion(reasoning: &str, content: &str, calls: &[ModelToolCall]) -> u64 {
    let counter = TokenCounter::shared();
    let calls: u64 = calls
        .iter()
        .map(|c| u64::from(counter.text(&c.name)) + u64::from(counter.text(&c.arguments)))
        .sum();
    u64::from(counter.text(reasoning)) + u64::from(counter.text(content)) + calls
}

/// Publishes calls that will not run, each with its call event and an error result, so
/// that no call the model made goes without events.
fn refuse_calls(em: &mut Emitter, calls: &[ModelToolCall], why: &str) {
    em.expect_tool_calls(calls.len());
    for call in calls {
        let arguments =
            parse_arguments(&call.arguments).unwrap_or_else(|_| unreadable_arguments(call));
        em.tool_call(&call.id, &call.name, &arguments);
        em.tool_result(
            &call.id,
            &call.name,
            &ToolResult::error(why),
            Duration::ZERO,
            None,
        );
    }
}

/// What a call's event and record say of arguments that are not a JSON object (the
/// call does not run): `{"raw": <the model's text>}`, an object as every call's
/// arguments are.
fn unreadable_arguments(call: &ModelToolCall) -> serde_json::Value {
    serde_json::json!({ "raw": call.arguments })
}

/// Parses a model's argument text: an object, or empty for none; anything else is an
/// error the model reads.
fn parse_arguments(text: &str) -> Result<serde_json::Value, String> {
    if text.trim().is_empty() {
        return Ok(serde_json::Value::Object(serde_json::Map::new()));
    }
    match serde_json::from_str::<serde_json::Value>(text) {
        Ok(value @ serde_json::Value::Object(_))
            if agentrt_core::json_depth(&value) > MAX_ARGUMENT_DEPTH =>
        {
            Err(format!(
                "the arguments nest deeper than {MAX_ARGUMENT_DEPTH} levels; send flatter JSON"
            ))
        }
        Ok(value @ serde_json::Value::Object(_)) => Ok(value),
        Ok(_) => Err(format!("the arguments must be a JSON object, got: {text}")),
        Err(e) => Err(format!(
            "the arguments are not valid JSON ({e}); send a complete JSON object: {text}"
        )),
    }
}

/// The failure of a run whose shared state cannot be read or written.
fn state_failure(what: &str, error: &agentrt_core::StateError) -> Outcome {
    Outcome::Failed(
        StopReason::InternalError,
        RunError {
            code: "STATE_UNAVAILABLE".into(),
            message: format!("cannot reach the {what}: {error}"),
            category: "internal",
            retryable: true,
        },
    )
}

fn model_failure(error: ModelError) -> Outcome {
    let reason = match error {
        ModelError::Timeout(_) => StopReason::Timeout,
        _ => StopReason::ModelError,
    };
    Outcome::Failed(
        reason,
        RunError {
            code: error.code(),
            message: error.to_string(),
            category: if reason == StopReason::Timeout {
                "timeout"
            } else {
                "model"
            },
            retryable: error.is_retryable(),
        },
    )
}

fn stopped_error(reason: StopReason) -> RunError {
    match reason {
        StopReason::Shutdown => RunError {
            code: "SHUTDOWN".into(),
            message: "the server is shutting down".into(),
            category: "cancelled",
            retryable: true,
        },
        _ => RunError {
            code: "CANCELLED".into(),
            message: "the run was cancelled".into(),
            category: "cancelled",
            retryable: false,
        },
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn call_ids_past_their_bound_are_replaced() {
        let call = |id: String| ModelToolCall {
            id,
            name: "t".into(),
            arguments: "{}".into(),
        };
        let mut calls = Vec::new();
        add_call(&mut calls, call("x".repeat(MAX_CALL_ID_BYTES + 1)));
        add_call(&mut calls, call("x".repeat(MAX_CALL_ID_BYTES)));
        assert_eq!(calls[0].id, "call_0");
        assert_eq!(calls[1].id, "x".repeat(MAX_CALL_ID_BYTES));
    }

    #[test]
    fn an_answer_of_the_other_kind_runs_nothing() {
        let output = || ToolAnswer::Output {
            output: "42".into(),
            is_error: false,
        };
        let approval = || ToolAnswer::Decision {
            approved: true,
            reason: String::new(),
        };
        assert_eq!(answered(Action::Approve, Some(approval()), 100), Taken::Run);
        assert_eq!(
            answered(Action::ClientExecute, Some(output()), 100),
            Taken::Result(ToolResult {
                output: "42".into(),
                is_error: false,
                references: Vec::new(),
            })
        );
        assert_eq!(answered(Action::Approve, None, 100), Taken::Missing);
        // A client tool "approved" is not run on the tool executor; an approval's call
        // sent an output is not answered by it.
        for (action, answer) in [
            (Action::ClientExecute, approval()),
            (Action::Approve, output()),
        ] {
            let Taken::Result(result) = answered(action, Some(answer), 1000) else {
                panic!("{action:?} ran");
            };
            assert!(result.is_error, "{result:?}");
            assert!(result.output.contains("did not run"), "{result:?}");
        }
    }

    #[test]
    fn an_output_cut_twice_keeps_the_size_the_tool_executor_named() {
        let mut once = "x".repeat(100);
        truncate_output(&mut once, 10);
        assert!(
            once.ends_with("[tool output truncated: 90 of 100 bytes omitted]"),
            "{once}"
        );
        let mut twice = format!("{}\n[output truncated at 1048576 bytes]", "x".repeat(100));
        truncate_output(&mut twice, 10);
        assert!(twice.starts_with("xxxxxxxxxx\n"), "{twice}");
        assert!(twice.contains("10 bytes kept"), "{twice}");
        assert!(twice.contains("cut it at 1048576 bytes already"), "{twice}");
        // An output cut here is not cut again (a client's, cut when it was accepted).
        for cut in [once, twice] {
            let mut again = cut.clone();
            truncate_output(&mut again, 10);
            assert_eq!(again, cut);
        }
    }

    #[test]
    fn schemas_referring_outside_themselves_are_refused_plainly() {
        let remote = serde_json::json!({
            "type": "object",
            "properties": {"a": {"$ref": "https://example.com/a.json"}},
        });
        let why = check_input_schema(&remote).unwrap_err();
        assert!(why.contains("https://example.com/a.json"), "{why}");
        assert!(why.contains("$defs"), "{why}");
        let local = serde_json::json!({
            "type": "object",
            "properties": {"a": {"$ref": "#/$defs/a"}},
            "$defs": {"a": {"type": "string"}},
        });
        assert_eq!(check_input_schema(&local), Ok(()));
    }

    #[test]
    fn a_saved_spec_reads_back_with_its_agent_apart_or_inside_as_saved_before() {
        let spec = RunSpec {
            run_id: "r".into(),
            engine_id: "e".into(),
            session_id: "s".into(),
            message_id: "m".into(),
            query: "q".into(),
            llm_context: Some(vec![ChatMessage::User("before".into())]),
            config: Arc::new(AgentConfig {
                name: "agent".into(),
                system_prompt: String::new(),
                model: agentrt_core::ModelSelection {
                    provider: "p".into(),
                    name: "m".into(),
                    temperature: None,
                    max_tokens: None,
                },
                rerank_model: None,
                strategy: agentrt_core::Strategy::FunctionCall,
                max_iterations: 4,
                tools: Vec::new(),
                approval: Vec::new(),
                client_tools: Vec::new(),
                parallel_tool_calls: true,
                max_parallel_tool_calls: 2,
                context: agentrt_core::ContextBudget {
                    max_prompt_tokens: 8192,
                },
                timeouts: agentrt_core::Timeouts::default(),
            }),
            tools: Arc::from(Vec::new()),
        };
        let (run, agent) = spec.saved().unwrap();
        assert!(
            !run.contains("\"agent\""),
            "the run's part leaves the agent out: {run}"
        );
        let read = RunSpec::read(&run, &agent).unwrap();
        assert_eq!(
            (
                read.run_id.as_str(),
                read.query.as_str(),
                read.config.name.as_str()
            ),
            ("r", "q", "agent")
        );
        assert_eq!(read.llm_context.map(|c| c.len()), Some(1));
        // A spec saved whole, before agents were saved apart, carries its agent.
        let mut whole: serde_json::Value = serde_json::from_str(&run).unwrap();
        let agent_value: serde_json::Value = serde_json::from_str(&agent).unwrap();
        whole["config"] = agent_value["config"].clone();
        whole["tools"] = agent_value["tools"].clone();
        let read = RunSpec::read(&whole.to_string(), "").unwrap();
        assert_eq!(read.config.name, "agent");
        assert!(RunSpec::read(&run, "").unwrap_err().contains("agent"));
    }

    #[tokio::test]
    async fn a_stop_wakes_the_waiting_run_and_an_earlier_stop_is_seen_at_once() {
        let control = Arc::new(RunControl::default());
        let waiting = tokio::spawn({
            let control = control.clone();
            async move { control.stop_requested().await }
        });
        tokio::task::yield_now().await;
        assert!(!waiting.is_finished());
        control.stop(StopReason::Cancelled);
        tokio::time::timeout(Duration::from_secs(5), waiting)
            .await
            .expect("the waiting run was not woken")
            .unwrap();
        assert!(control.is_stopped());
        assert!(
            control.cancel.is_cancelled(),
            "calls in flight are cancelled"
        );
        // Stopped already: resolves on its first poll.
        assert!(futures_util::FutureExt::now_or_never(control.stop_requested()).is_some());
        control.stop(StopReason::Timeout);
        assert_eq!(control.reason.get(), Some(&StopReason::Cancelled));
    }
}
