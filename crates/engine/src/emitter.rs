//! Publishes a run's events and keeps its record in step with them.

use std::{sync::Arc, time::Duration};

use agentrt_core::ToolResult;
use agentrt_events::{
    EventData, EventKind, JsonText, RunEvent, RunFailure, RunPublisher, RunSummary,
};
use agentrt_models::Usage;
use serde_json::{Value, json};

use crate::{
    react::Piece,
    record::{RunError, RunRecord, RunState, StepRecord, StopReason, ToolCallRecord},
};

pub(crate) struct Emitter {
    publisher: Arc<dyn RunPublisher>,
    state: Arc<RunState>,
    iteration: u32,
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

    /// A reasoning delta: a plain event, no structured payload, one lock.
    pub(crate) fn thought(&mut self, text: String) {
        let mut record = self.state.lock();
        self.step(&mut record).thought.push_str(&text);
        self.publish(
            RunEvent::new(EventKind::Thought, self.iteration, text, None),
            &mut record,
        );
    }

    /// An answer delta.
    pub(crate) fn answer(&mut self, text: String) {
        let mut record = self.state.lock();
        self.step(&mut record).answer.push_str(&text);
        self.publish(
            RunEvent::new(EventKind::FinalAnswer, self.iteration, text, None),
            &mut record,
        );
    }

    pub(crate) fn pieces(&mut self, pieces: impl Iterator<Item = Piece>) {
        for piece in pieces {
            match piece {
                Piece::Thought(text) => self.thought(text),
                Piece::Answer(text) => self.answer(text),
            }
        }
    }

    pub(crate) fn usage(&mut self, usage: Usage) {
        let mut record = self.state.lock();
        record.usage.prompt_tokens += usage.prompt_tokens;
        record.usage.completion_tokens += usage.completion_tokens;
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

    pub(crate) fn tool_result(
        &mut self,
        id: &str,
        name: &str,
        result: &ToolResult,
        duration: Duration,
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
        if !result.references.is_empty() {
            let references: Vec<Value> = result
                .references
                .iter()
                .map(|r| json!({"title": r.title, "url": r.url, "snippet": r.snippet, "score": r.score, "source": r.source}))
                .collect();
            let data = EventData::References {
                tool_call_id: id.into(),
                references,
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
            iterations: self.iteration,
            error: None,
        }
    }

    pub(crate) fn finish_answered(self, reason: StopReason) {
        let mut record = self.state.lock();
        record.status = reason.status();
        record.stop_reason = Some(reason);
        record.final_answer = record
            .steps
            .last()
            .map(|s| s.answer.trim().to_owned())
            .unwrap_or_default();
        let data = self.summary(&record, reason);
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
        record.status = reason.status();
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
