//! Publishes a run's events and keeps its record in step with them.
//!
//! Events are gathered and published in batches: a batch goes out before the run waits
//! for anything (the model's next chunk, a tool), so that a burst of deltas reaches the
//! bus, and readers, once; a shared bus may hold the batch published before a model call
//! for a few milliseconds, to write it with what follows. The record is saved to the run
//! store at the end of each round, in one checkpoint with the round's events, and before
//! the `done` event, so that `GetRun` on any replica agrees with the events.

use std::{sync::Arc, time::Duration};

use agentrt_context::{Exchange, SessionStore, TokenCounter};
use agentrt_core::ToolResult;
use agentrt_events::BusError;
use agentrt_events::{
    EventData, EventKind, JsonText, RerankOutcome, RunEvent, RunFailure, RunPublisher, RunSummary,
};
use agentrt_models::Usage;
use agentrt_state::{
    CheckpointError, Progress, RunError, RunRecord, RunStatus, RunStore, StateError, StepRecord,
    StopReason, ToolCallRecord,
};
use serde_json::{Value, json};
use tracing::warn;

use crate::{Outcome, react::Segment};

/// The longest text one event carries: a longer delta goes out as several, so that no
/// event comes near the gRPC message limit however much text a model sends at once.
pub const MAX_DELTA_BYTES: usize = 64 * 1024;

pub(crate) struct Emitter {
    publisher: Box<dyn RunPublisher>,
    store: Arc<dyn RunStore>,
    record: RunRecord,
    /// Events made but not yet published.
    pending: Vec<RunEvent>,
    /// Events published.
    published: u64,
    /// Steps before this one are saved as they are.
    saved_steps: usize,
    iteration: u32,
    /// The prompt tokens of a model call that is answering and whose usage is not counted
    /// yet: a run that ends before the call finishes estimates it (see
    /// [`Emitter::settle_unreported`]).
    unreported: Option<u64>,
    /// The run's turn, kept in its session's history with its end (see
    /// [`Emitter::keep_turn`]) until it is.
    turn: Option<Arc<Exchange>>,
}

/// How long the end of a run keeps trying to reach the store when it cannot.
const FINISH_PATIENCE: Duration = Duration::from_secs(30);

/// The failure of a run whose record cannot be written; a run another replica took over
/// is no longer this one's to end.
fn unsaved(error: &StateError) -> Outcome {
    match error {
        StateError::Fenced(_) => Outcome::Moved,
        // A run that would wait past a budget of waiting runs.
        StateError::OverBudget { budget, message } => Outcome::Failed(
            StopReason::BudgetExceeded,
            RunError {
                code: "BUDGET_EXCEEDED".into(),
                message: format!("the run cannot wait for answers: {message} ({budget})"),
                category: "budget",
                retryable: true,
            },
        ),
        error => unwritable("record", error),
    }
}

/// The failure of a run whose events cannot be written (see [`unsaved`]).
fn unpublished(error: &BusError) -> Outcome {
    match error {
        BusError::Fenced(_) => Outcome::Moved,
        error => unwritable("events", error),
    }
}

/// The failure of a run whose events or record cannot be written.
fn unwritable(what: &str, error: &dyn std::fmt::Display) -> Outcome {
    Outcome::Failed(
        StopReason::InternalError,
        RunError {
            code: "STATE_UNAVAILABLE".into(),
            message: format!("cannot write the run's {what}: {error}"),
            category: "internal",
            retryable: true,
        },
    )
}

/// `text` in pieces of at most `max` bytes, cut at character boundaries.
fn split_text(text: &str, max: usize) -> Vec<String> {
    let mut pieces = Vec::with_capacity(text.len() / max.max(1) + 1);
    let mut rest = text;
    while !rest.is_empty() {
        let mut cut = max.max(4).min(rest.len());
        while !rest.is_char_boundary(cut) {
            cut -= 1;
        }
        let (piece, tail) = rest.split_at(cut);
        pieces.push(piece.to_owned());
        rest = tail;
    }
    pieces
}

impl Emitter {
    pub(crate) fn new(
        publisher: Box<dyn RunPublisher>,
        store: Arc<dyn RunStore>,
        record: RunRecord,
    ) -> Self {
        Self {
            publisher,
            store,
            record,
            pending: Vec::new(),
            published: 0,
            saved_steps: 0,
            iteration: 0,
            unreported: None,
            turn: None,
        }
    }

    /// The emitter of a run taken over: its record as last saved, its log's last
    /// sequence, the round it was in.
    pub(crate) fn resumed(
        publisher: Box<dyn RunPublisher>,
        store: Arc<dyn RunStore>,
        record: RunRecord,
        published: u64,
        iteration: u32,
    ) -> Self {
        let mut emitter = Self {
            publisher,
            store,
            saved_steps: record.steps.len().saturating_sub(1),
            record,
            pending: Vec::new(),
            published,
            iteration,
            unreported: None,
            turn: None,
        };
        // The round it was in has its step, as the replica that lost the run had made it
        // when the round began: should the run end before the round begins again here,
        // its record still counts the round, as its `done` event does.
        emitter.step();
        emitter
    }

    /// When the run started.
    pub(crate) fn started(&self) -> std::time::SystemTime {
        self.record.create_time
    }

    /// Publishes the events made so far; called before the run waits for anything.
    pub(crate) async fn flush(&mut self) -> Result<(), Outcome> {
        self.publish_pending(false).await
    }

    /// Publishes the events made so far, letting a shared bus hold them for a few
    /// milliseconds to write them with what follows; called before a model call, which
    /// may answer at once (then its first events, or the next checkpoint, go with them).
    pub(crate) async fn flush_soon(&mut self) -> Result<(), Outcome> {
        self.publish_pending(true).await
    }

    async fn publish_pending(&mut self, soon: bool) -> Result<(), Outcome> {
        if self.pending.is_empty() {
            return Ok(());
        }
        let batch = std::mem::take(&mut self.pending);
        // Numbered either way, before the publisher is called: on an error it keeps them,
        // with their numbers, and writes them with its next call (the end's, at the
        // latest), as it does when the run stops while they are being written (this
        // future is then dropped part way).
        self.published += batch.len() as u64;
        self.record.last_sequence = self.published;
        let published = if soon {
            self.publisher.publish_soon(batch).await
        } else {
            self.publisher.publish(batch).await
        };
        published.map_err(|e| unpublished(&e))
    }

    /// Publishes what is pending and saves the record, with `progress` (what another
    /// replica needs to continue the run from here) when given.
    pub(crate) async fn checkpoint(&mut self, progress: Option<Progress>) -> Result<(), Outcome> {
        let batch = std::mem::take(&mut self.pending);
        let asks = batch.iter().any(|e| e.kind == EventKind::ActionRequired);
        // Numbered either way (see `publish_pending`).
        self.published += batch.len() as u64;
        self.record.last_sequence = self.published;
        let written = self
            .store
            .checkpoint(
                self.publisher.as_ref(),
                batch,
                &self.record,
                self.saved_steps,
                progress.as_ref(),
            )
            .await;
        match written {
            Ok(()) => {}
            Err(CheckpointError::Events(error) | CheckpointError::EventsAfterRecord(error)) => {
                return Err(unpublished(&error));
            }
            Err(CheckpointError::Record(error) | CheckpointError::Turn(error)) => {
                if asks && self.record.waiting() {
                    // A wait that was not saved leaves its ACTION_REQUIRED out of the log,
                    // and the events after it take its number: the run's last sequence is
                    // one lower than counted.
                    self.published -= 1;
                    self.record.last_sequence = self.published;
                }
                return Err(unsaved(&error));
            }
        }
        // The current round may still change; the ones before it no longer do.
        self.saved_steps = self.record.steps.len().saturating_sub(1);
        Ok(())
    }

    fn publish(&mut self, event: RunEvent) {
        self.record.update_time = event.time;
        self.pending.push(event);
    }

    fn step(&mut self) -> &mut StepRecord {
        let iteration = self.iteration;
        let record = &mut self.record;
        if record.steps.last().is_none_or(|s| s.iteration != iteration) {
            record.steps.push(StepRecord {
                iteration,
                ..StepRecord::default()
            });
        }
        // Just ensured non-empty.
        let last = record.steps.len() - 1;
        &mut record.steps[last]
    }

    /// The round under way.
    pub(crate) fn iteration(&self) -> u32 {
        self.iteration
    }

    pub(crate) fn begin_round(&mut self, iteration: u32) {
        self.iteration = iteration;
        self.step();
    }

    /// The run's first event, and its first record: they say the run exists before the
    /// model is called.
    pub(crate) async fn run_started(
        &mut self,
        engine_id: &str,
        agent: &str,
        progress: Option<Progress>,
    ) -> Result<(), Outcome> {
        let data = EventData::RunStarted {
            engine_id: engine_id.to_owned(),
            agent: agent.to_owned(),
        };
        self.publish(RunEvent::new(
            EventKind::RunStarted,
            1,
            String::new(),
            Some(data),
        ));
        self.checkpoint(progress).await
    }

    /// Whether another replica may take the run over: it has an owner, and saves what
    /// continuing it needs at its checkpoints.
    pub(crate) fn durable(&self) -> bool {
        !self.record.owner.is_empty()
    }

    /// Says that round `iteration` runs again here (its text so far is void), for
    /// `reason`: `takeover` or `handover`.
    pub(crate) fn round_restarted(&mut self, iteration: u32, reason: &str) {
        self.iteration = iteration;
        let step = self.step();
        step.thought.clear();
        step.answer.clear();
        step.tool_calls.clear();
        let data = EventData::RoundRestarted {
            iteration,
            reason: reason.to_owned(),
        };
        self.publish(RunEvent::new(
            EventKind::RoundRestarted,
            iteration,
            String::new(),
            Some(data),
        ));
    }

    /// Records the result of a call that the previous owner of the run published.
    pub(crate) fn recovered_result(&mut self, id: &str, result: &ToolResult, duration: Duration) {
        if let Some(call) = self.step().tool_calls.iter_mut().find(|c| c.id == id) {
            call.output.clone_from(&result.output);
            call.is_error = result.is_error;
            call.duration = duration;
            call.references.clone_from(&result.references);
            call.finished = true;
        }
    }

    /// Lets the run go to another replica: publishes what is pending (unless the run is
    /// another's already) and stops, without ending it.
    pub(crate) async fn release(mut self) {
        let pending = std::mem::take(&mut self.pending);
        if !pending.is_empty()
            && let Err(error) = self.publisher.publish(pending).await
            && !matches!(error, BusError::Fenced(_))
        {
            warn!(run_id = %self.record.run_id, %error, "cannot publish the last events before letting the run go");
        }
        if let Err(error) = self.publisher.release().await
            && !matches!(error, BusError::Fenced(_))
        {
            warn!(run_id = %self.record.run_id, %error, "cannot let the run go cleanly");
        }
    }

    /// The run waits for answers to `pending`: says so (one event) and saves its record
    /// (waiting) with `progress`, as one checkpoint, which lets the run go: nobody
    /// executes it until it is answered, cancelled or out of time.
    pub(crate) async fn wait(
        &mut self,
        pending: Vec<agentrt_events::PendingCall>,
        progress: Progress,
    ) -> Result<(), Outcome> {
        let data = EventData::ActionRequired {
            tool_calls: within_event(pending.clone()),
        };
        self.publish(RunEvent::new(
            EventKind::ActionRequired,
            self.iteration,
            String::new(),
            Some(data),
        ));
        // The event and the record that says the run waits go as one checkpoint: a client
        // that reads ACTION_REQUIRED and asks GetRun sees REQUIRES_ACTION (the events went
        // first, and GetRun could still say RUNNING). A store apart from the bus saves the
        // record first; a shared one writes both at once, the events before the record
        // takes the run's owner away (nobody may write its log then).
        self.record.status = RunStatus::RequiresAction;
        self.record.pending = pending;
        self.checkpoint(Some(progress)).await
    }

    /// Lets the log go without ending it: the run waits (see [`Emitter::wait`]).
    pub(crate) async fn park(self) {
        if let Err(error) = self.publisher.park().await
            && !matches!(error, BusError::Fenced(_))
        {
            warn!(run_id = %self.record.run_id, %error, "cannot let the log of a waiting run go cleanly");
        }
    }

    /// A reasoning delta: a plain event, no structured payload, one lock.
    pub(crate) fn thought(&mut self, text: String) {
        self.text(EventKind::Thought, text);
    }

    /// An answer delta.
    pub(crate) fn answer(&mut self, text: String) {
        self.text(EventKind::FinalAnswer, text);
    }

    fn text(&mut self, kind: EventKind, text: String) {
        if text.is_empty() {
            return;
        }
        let step = self.step();
        match kind {
            EventKind::Thought => step.thought.push_str(&text),
            _ => step.answer.push_str(&text),
        }
        if text.len() <= MAX_DELTA_BYTES {
            self.publish(RunEvent::new(kind, self.iteration, text, None));
        } else {
            for piece in split_text(&text, MAX_DELTA_BYTES) {
                self.publish(RunEvent::new(kind, self.iteration, piece, None));
            }
        }
    }

    pub(crate) fn pieces(&mut self, pieces: impl Iterator<Item = Segment>) {
        for piece in pieces {
            match piece {
                Segment::Thought(text) => self.thought(text),
                Segment::Answer(text) => self.answer(text),
            }
        }
    }

    /// Adds a model call's usage; `estimated` when the server counted it because the
    /// provider reported none.
    pub(crate) fn usage(&mut self, usage: Usage, estimated: bool) {
        self.unreported = None;
        let record = &mut self.record;
        record.usage.prompt_tokens = record
            .usage
            .prompt_tokens
            .saturating_add(usage.prompt_tokens);
        record.usage.completion_tokens = record
            .usage
            .completion_tokens
            .saturating_add(usage.completion_tokens);
        record.usage.estimated |= estimated;
    }

    /// Says that a model call whose prompt counts `prompt_tokens` is sent: its usage
    /// counts even if the run ends before the provider reports it (unless the provider
    /// never processed it, [`Emitter::model_not_answering`]).
    pub(crate) fn model_answering(&mut self, prompt_tokens: u32) {
        self.unreported = Some(u64::from(prompt_tokens));
    }

    /// The model call failed without the provider processing it (refused, unreachable):
    /// it used nothing.
    pub(crate) fn model_not_answering(&mut self) {
        self.unreported = None;
    }

    /// Counts the usage of a model call the run ended during (failed, cancelled, timed
    /// out, stopped), which its provider never reported: the prompt, and the text it
    /// streamed in this round, marked as estimated rather than left at zero.
    fn settle_unreported(&mut self) {
        let Some(prompt_tokens) = self.unreported.take() else {
            return;
        };
        let counter = TokenCounter::shared();
        let iteration = self.iteration;
        let completion_tokens = self
            .record
            .steps
            .iter()
            .rev()
            .find(|s| s.iteration == iteration)
            .map_or(0, |s| {
                u64::from(counter.text(&s.thought)) + u64::from(counter.text(&s.answer))
            });
        self.usage(
            Usage {
                prompt_tokens,
                completion_tokens,
            },
            true,
        );
    }

    /// Makes room in the round's record for `count` tool calls.
    pub(crate) fn expect_tool_calls(&mut self, count: usize) {
        self.step().tool_calls.reserve_exact(count);
    }

    pub(crate) fn tool_call(&mut self, id: &str, name: &str, arguments: &Value) {
        let arguments = JsonText::new(arguments);
        self.step().tool_calls.push(ToolCallRecord {
            id: id.into(),
            name: name.into(),
            arguments: arguments.clone(),
            output: String::new(),
            is_error: false,
            duration: Duration::ZERO,
            references: Vec::new(),
            finished: false,
        });
        let data = EventData::ToolCall {
            id: id.into(),
            name: name.into(),
            arguments,
        };
        self.publish(RunEvent::new(
            EventKind::ToolCall,
            self.iteration,
            String::new(),
            Some(data),
        ));
    }

    /// A call's result, then its references (one event), with how reranking went.
    pub(crate) fn tool_result(
        &mut self,
        id: &str,
        name: &str,
        result: &ToolResult,
        duration: Duration,
        rerank: Option<RerankOutcome>,
    ) {
        if let Some(call) = self.step().tool_calls.iter_mut().find(|c| c.id == id) {
            call.output.clone_from(&result.output);
            call.is_error = result.is_error;
            call.duration = duration;
            call.references.clone_from(&result.references);
            call.finished = true;
        }
        let duration_ms = u64::try_from(duration.as_millis()).unwrap_or(u64::MAX);
        let data = EventData::ToolResult {
            id: id.into(),
            name: name.into(),
            output: result.output.clone(),
            is_error: result.is_error,
            duration_ms,
        };
        self.publish(RunEvent::new(
            EventKind::ToolResult,
            self.iteration,
            String::new(),
            Some(data),
        ));
        // A call that returned references has its event, also when reranking kept none of
        // them: the event then says so.
        if !result.references.is_empty() || rerank.is_some() {
            let references: Vec<Value> = result
                .references
                .iter()
                .map(|r| json!({"title": r.title, "url": r.url, "snippet": r.snippet, "score": r.score, "source": r.source}))
                .collect();
            let data = EventData::References {
                tool_call_id: id.into(),
                references,
                rerank,
            };
            self.publish(RunEvent::new(
                EventKind::References,
                self.iteration,
                String::new(),
                Some(data),
            ));
        }
    }

    fn summary(&self, record: &RunRecord, reason: StopReason) -> RunSummary {
        RunSummary {
            stop_reason: reason.as_str(),
            prompt_tokens: record.usage.prompt_tokens,
            completion_tokens: record.usage.completion_tokens,
            usage_estimated: record.usage.estimated,
            iterations: self.iteration,
            note: None,
            error: None,
        }
    }

    /// Keeps `turn` in the run's session's history when the run ends as answered, with
    /// its end (see [`RunStore::end`]).
    pub(crate) fn keep_turn(&mut self, turn: Exchange) {
        self.turn = Some(Arc::new(turn));
    }

    /// Ends the run with its answer, and keeps its turn (if [`Emitter::keep_turn`] was
    /// told one) in `sessions`.
    pub(crate) async fn finish_answered(mut self, reason: StopReason, sessions: &dyn SessionStore) {
        self.settle_unreported();
        let record = &mut self.record;
        record.status = reason.status();
        record.stop_reason = Some(reason);
        // The final answer rule: exactly the answer deltas of the `done` event's round.
        let iteration = self.iteration.max(1);
        record.final_answer = record
            .steps
            .iter()
            .rev()
            .find(|s| s.iteration == iteration)
            .map(|s| s.answer.clone())
            .unwrap_or_default();
        let mut data = self.summary(&self.record, reason);
        if reason == StopReason::MaxTokens {
            data.note = Some(
                "the model stopped at its token limit (finish_reason: length): the answer is \
                 cut short; raise model.max_tokens or ask for a shorter answer"
                    .to_owned(),
            );
        }
        let event = RunEvent {
            done: true,
            ..RunEvent::new(
                EventKind::FinalAnswer,
                self.iteration.max(1),
                String::new(),
                Some(EventData::End(data)),
            )
        };
        self.finish(event, Some(sessions)).await;
    }

    pub(crate) async fn finish_failed(mut self, reason: StopReason, error: RunError) {
        self.settle_unreported();
        let record = &mut self.record;
        // A run that failed is failed, whatever its stop reason would end it with when
        // it has an answer (a token limit reached before any answer text).
        record.status = match reason.status() {
            RunStatus::Succeeded | RunStatus::Incomplete => RunStatus::Failed,
            status => status,
        };
        record.stop_reason = Some(reason);
        let mut data = self.summary(&self.record, reason);
        data.error = Some(RunFailure {
            code: error.code.clone(),
            message: error.message.clone(),
            category: error.category,
            retryable: error.retryable,
        });
        let event = RunEvent {
            done: true,
            ..RunEvent::new(
                EventKind::Error,
                self.iteration.max(1),
                error.message.clone(),
                Some(EventData::End(data)),
            )
        };
        self.record.error = Some(error);
        self.finish(event, None).await;
    }

    /// Writes the end: with the run's turn, if it has one still to keep in `sessions`.
    async fn write_end(
        &mut self,
        events: Vec<RunEvent>,
        sessions: Option<&dyn SessionStore>,
    ) -> Result<(), CheckpointError> {
        match sessions.filter(|_| self.turn.is_some()) {
            Some(sessions) => {
                self.store
                    .end(
                        self.publisher.as_ref(),
                        events,
                        &self.record,
                        self.saved_steps,
                        (sessions, &mut self.turn),
                    )
                    .await
            }
            None => {
                self.store
                    .checkpoint(
                        self.publisher.as_ref(),
                        events,
                        &self.record,
                        self.saved_steps,
                        None,
                    )
                    .await
            }
        }
    }

    /// Writes the ended record and the `done` event as one checkpoint, with the run's turn
    /// when `sessions` is given and it has one (a store apart from the bus saves the
    /// record first, so that a client that sees `done` and asks `GetRun` sees the end
    /// too). When the store cannot be reached, keeps trying for a while, each part until
    /// it is written: a run must end where its readers look.
    async fn finish(mut self, done: RunEvent, sessions: Option<&dyn SessionStore>) {
        // Calls the run ends without say so (a cancelled call read as an empty success).
        let reason = self.record.stop_reason.map_or("", StopReason::as_str);
        if let Some(changed) = self.record.end_unfinished_calls(reason) {
            self.saved_steps = self.saved_steps.min(changed);
        }
        self.record.last_sequence = self.published + self.pending.len() as u64 + 1;
        self.record.update_time = done.time;
        self.pending.push(done);
        let started = tokio::time::Instant::now();
        let mut wait = Duration::from_millis(100);
        let events = std::mem::take(&mut self.pending);
        let first = self.write_end(events, sessions).await;
        let (mut saved, mut published, mut failure) = match first {
            Ok(()) => return,
            Err(CheckpointError::Turn(error)) => (false, false, Some(unsaved(&error))),
            Err(CheckpointError::Record(error)) => (false, true, Some(unsaved(&error))),
            Err(CheckpointError::EventsAfterRecord(error)) => {
                (true, false, Some(unpublished(&error)))
            }
            Err(CheckpointError::Events(error)) => (false, false, Some(unpublished(&error))),
        };
        loop {
            match failure {
                None if saved && published => return,
                None => {}
                Some(Outcome::Moved) => {
                    warn!(run_id = %self.record.run_id, "the run was taken over by another replica, or lost by the store, before it ended here");
                    let _ = self.publisher.release().await;
                    return;
                }
                Some(Outcome::Failed(_, error)) if started.elapsed() < FINISH_PATIENCE => {
                    warn!(run_id = %self.record.run_id, error = %error.message, "cannot end the run yet; trying again");
                }
                Some(_) => {
                    warn!(run_id = %self.record.run_id, "gave up writing the end of the run");
                    return;
                }
            }
            tokio::time::sleep(wait).await;
            wait = (wait * 2).min(Duration::from_secs(5));
            failure = None;
            // A publisher keeps a batch it could not write and writes it with the next
            // call: a retry publishes nothing new. While neither part is written, both go
            // again as one checkpoint, so that a store that writes them together (Redis)
            // never holds the end of a run without its record, nor the other way round:
            // a replica that takes the run over meanwhile goes on from one consistent
            // point, and this one's late end is fenced off.
            if !saved && !published {
                match self.write_end(Vec::new(), sessions).await {
                    Ok(()) => (saved, published) = (true, true),
                    Err(CheckpointError::Turn(error)) => failure = Some(unsaved(&error)),
                    Err(CheckpointError::Record(error)) => {
                        published = true;
                        failure = Some(unsaved(&error));
                    }
                    Err(CheckpointError::EventsAfterRecord(error)) => {
                        saved = true;
                        failure = Some(unpublished(&error));
                    }
                    Err(CheckpointError::Events(error)) => failure = Some(unpublished(&error)),
                }
                continue;
            }
            // The turn, if it is still to keep, before the record that ends the run.
            if !saved && let (Some(sessions), Some(turn)) = (sessions, &self.turn) {
                match sessions.append(&self.record.session_id, turn.clone()).await {
                    Ok(()) => self.turn = None,
                    Err(error) => {
                        failure = Some(unsaved(&error));
                        continue;
                    }
                }
            }
            if !saved {
                match self.store.save(&self.record, self.saved_steps, None).await {
                    Ok(()) => saved = true,
                    Err(error) => failure = Some(unsaved(&error)),
                }
            }
            if !published {
                match self.publisher.publish(Vec::new()).await {
                    Ok(()) => published = true,
                    Err(error) => failure = Some(unpublished(&error)),
                }
            }
        }
    }

    /// Marks the run as given up by the client of its `Execute`.
    pub(crate) fn abandoned(&mut self) {
        self.record.abandoned = true;
    }
}

/// Most bytes of arguments an `ACTION_REQUIRED` event carries, all calls together: the
/// largest arguments of a call (1 MiB), so that the event stays far within a message's
/// size (4 MiB by default) however many calls wait.
const MAX_ACTION_ARGUMENT_BYTES: usize = 1024 * 1024;

/// `pending` as an `ACTION_REQUIRED` event carries them: past
/// [`MAX_ACTION_ARGUMENT_BYTES`], the largest arguments are replaced by a note saying where
/// they are whole (each call's `TOOL_CALL` event).
fn within_event(mut pending: Vec<agentrt_events::PendingCall>) -> Vec<agentrt_events::PendingCall> {
    let mut total: usize = pending.iter().map(|p| p.arguments.as_str().len()).sum();
    if total <= MAX_ACTION_ARGUMENT_BYTES {
        return pending;
    }
    let mut largest: Vec<usize> = (0..pending.len()).collect();
    largest.sort_by_key(|&i| std::cmp::Reverse(pending[i].arguments.as_str().len()));
    for i in largest {
        if total <= MAX_ACTION_ARGUMENT_BYTES {
            break;
        }
        let size = pending[i].arguments.as_str().len();
        pending[i].arguments = agentrt_events::JsonText::new(&serde_json::json!({
            "cut": format!(
                "{size} bytes of arguments; they are whole in the call's EVENT_TYPE_TOOL_CALL event"
            ),
        }));
        total = total - size + pending[i].arguments.as_str().len();
    }
    pending
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn long_text_is_split_at_character_boundaries() {
        let text = "é".repeat(10);
        let pieces = split_text(&text, 5);
        assert!(pieces.iter().all(|p| p.len() <= 5 && !p.is_empty()));
        assert_eq!(pieces.concat(), text);
        assert_eq!(split_text("abc", 5), ["abc"]);
    }

    #[test]
    fn an_action_required_event_keeps_its_arguments_within_bounds() {
        let call = |id: &str, bytes: usize| agentrt_events::PendingCall {
            id: id.into(),
            name: "write".into(),
            arguments: agentrt_events::JsonText::new(
                &serde_json::json!({"text": "x".repeat(bytes)}),
            ),
            action: agentrt_events::Action::ClientExecute,
            answered: false,
        };
        let small = vec![call("a", 1000), call("b", 2000)];
        assert_eq!(within_event(small.clone()), small);
        let large = vec![call("a", 600_000), call("b", 700_000), call("c", 100)];
        let kept = within_event(large.clone());
        assert_eq!(kept[0], large[0]);
        assert_eq!(kept[2], large[2]);
        assert!(
            kept[1]
                .arguments
                .as_str()
                .contains("700011 bytes of arguments"),
            "{}",
            kept[1].arguments.as_str()
        );
        let total: usize = kept.iter().map(|p| p.arguments.as_str().len()).sum();
        assert!(total <= MAX_ACTION_ARGUMENT_BYTES);
    }
}
