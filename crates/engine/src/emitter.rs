//! Publishes a run's events and keeps its record in step with them.

use std::{sync::Arc, time::Duration};

use agentrt_core::ToolResult;
use agentrt_events::{
    EventData, EventKind, JsonText, RerankOutcome, RunEvent, RunFailure, RunPublisher, RunSummary,
};
use agentrt_models::Usage;
use serde_json::{Value, json};

use crate::{
    react::Piece,
    record::{RunError, RunRecord, RunState, RunStatus, StepRecord, StopReason, ToolCallRecord},
};

/// The longest text one event carries: a longer delta goes out as several, so that no
/// event comes near the gRPC message limit however much text a model sends at once.
pub const MAX_DELTA_BYTES: usize = 64 * 1024;

pub(crate) struct Emitter {
    publisher: Arc<dyn RunPublisher>,
    state: Arc<RunState>,
    iteration: u32,
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
    pub(crate) fn new(publisher: Arc<dyn RunPublisher>, state: Arc<RunState>) -> Self {
        Self {
            publisher,
            state,
            iteration: 0,
        }
    }

    pub(crate) fn iteration(&self) -> u32 {
        self.iteration
    }

    /// Wakes readers for the deltas published so far; called before the run waits.
    pub(crate) fn flush(&self) {
        self.publisher.flush();
    }

    /// Publishes `event`. Text deltas wait for the next [`Emitter::flush`], so that bursts
    /// go out together; anything with a payload (tool calls, results, references, the end)
    /// wakes readers at once.
    fn publish(&self, event: RunEvent, record: &mut RunRecord) {
        let structured = event.data.is_some();
        record.update_time = event.time;
        record.last_sequence = self.publisher.publish(event);
        if structured {
            self.publisher.flush();
        }
    }

    fn step<'a>(&self, record: &'a mut RunRecord) -> &'a mut StepRecord {
        if record
            .steps
            .last()
            .is_none_or(|s| s.iteration != self.iteration)
        {
            record.steps.push(StepRecord {
                iteration: self.iteration,
                ..StepRecord::default()
            });
        }
        // Just ensured non-empty.
        let last = record.steps.len() - 1;
        &mut record.steps[last]
    }

    pub(crate) fn begin_round(&mut self, iteration: u32) {
        self.iteration = iteration;
        let mut record = self.state.lock();
        self.step(&mut record);
    }

    /// The run's first event: it says the run exists before the model is called.
    pub(crate) fn run_started(&mut self, engine_id: &str, agent: &str) {
        let mut record = self.state.lock();
        let data = EventData::RunStarted {
            engine_id: engine_id.to_owned(),
            agent: agent.to_owned(),
        };
        self.publish(
            RunEvent::new(EventKind::RunStarted, 1, String::new(), Some(data)),
            &mut record,
        );
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
        let mut record = self.state.lock();
        let step = self.step(&mut record);
        match kind {
            EventKind::Thought => step.thought.push_str(&text),
            _ => step.answer.push_str(&text),
        }
        if text.len() <= MAX_DELTA_BYTES {
            self.publish(RunEvent::new(kind, self.iteration, text, None), &mut record);
        } else {
            for piece in split_text(&text, MAX_DELTA_BYTES) {
                self.publish(
                    RunEvent::new(kind, self.iteration, piece, None),
                    &mut record,
                );
            }
        }
    }

    pub(crate) fn pieces(&mut self, pieces: impl Iterator<Item = Piece>) {
        for piece in pieces {
            match piece {
                Piece::Thought(text) => self.thought(text),
                Piece::Answer(text) => self.answer(text),
            }
        }
    }

    /// Adds a model call's usage; `estimated` when the server counted it because the
    /// provider reported none.
    pub(crate) fn usage(&mut self, usage: Usage, estimated: bool) {
        let mut record = self.state.lock();
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

    /// Makes room in the round's record for `count` tool calls.
    pub(crate) fn expect_tool_calls(&mut self, count: usize) {
        let mut record = self.state.lock();
        self.step(&mut record).tool_calls.reserve_exact(count);
    }

    pub(crate) fn tool_call(&mut self, id: &str, name: &str, arguments: &Value) {
        let mut record = self.state.lock();
        let arguments = JsonText::new(arguments);
        self.step(&mut record).tool_calls.push(ToolCallRecord {
            id: id.into(),
            name: name.into(),
            arguments: arguments.clone(),
            output: String::new(),
            is_error: false,
            duration: Duration::ZERO,
            references: Vec::new(),
        });
        let data = EventData::ToolCall {
            id: id.into(),
            name: name.into(),
            arguments,
        };
        self.publish(
            RunEvent::new(
                EventKind::ToolCall,
                self.iteration,
                String::new(),
                Some(data),
            ),
            &mut record,
        );
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
        let mut record = self.state.lock();
        if let Some(call) = self
            .step(&mut record)
            .tool_calls
            .iter_mut()
            .find(|c| c.id == id)
        {
            call.output.clone_from(&result.output);
            call.is_error = result.is_error;
            call.duration = duration;
            call.references.clone_from(&result.references);
        }
        let duration_ms = u64::try_from(duration.as_millis()).unwrap_or(u64::MAX);
        let data = EventData::ToolResult {
            id: id.into(),
            name: name.into(),
            output: result.output.clone(),
            is_error: result.is_error,
            duration_ms,
        };
        self.publish(
            RunEvent::new(
                EventKind::ToolResult,
                self.iteration,
                String::new(),
                Some(data),
            ),
            &mut record,
        );
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
            self.publish(
                RunEvent::new(
                    EventKind::References,
                    self.iteration,
                    String::new(),
                    Some(data),
                ),
                &mut record,
            );
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

    pub(crate) fn finish_answered(self, reason: StopReason) {
        let mut record = self.state.lock();
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
        let mut data = self.summary(&record, reason);
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
        self.publish(event, &mut record);
    }

    pub(crate) fn finish_failed(self, reason: StopReason, error: RunError) {
        let mut record = self.state.lock();
        // A run that failed is failed, whatever its stop reason would end it with when
        // it has an answer (a token limit reached before any answer text).
        record.status = match reason.status() {
            RunStatus::Succeeded | RunStatus::Incomplete => RunStatus::Failed,
            status => status,
        };
        record.stop_reason = Some(reason);
        let mut data = self.summary(&record, reason);
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
        record.error = Some(error);
        self.publish(event, &mut record);
    }
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
}
