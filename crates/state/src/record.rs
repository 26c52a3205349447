//! What is known of a run while and after it runs: `AgentEngine.GetRun` reads it from the
//! run store, on whichever replica it is asked.

use std::time::{Duration, SystemTime};

use serde::{Deserialize, Serialize};

/// Where a run is in its life.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub enum RunStatus {
    /// In progress.
    Running,
    /// Produced a final answer.
    Succeeded,
    /// Ended with an error.
    Failed,
    /// Cancelled by a client or by shutdown.
    Cancelled,
    /// Ended with an answer cut short at the model's token limit.
    Incomplete,
    /// Waits for tool outputs or approvals ([`RunRecord::pending`]); not an end.
    RequiresAction,
}

/// Why a run ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub enum StopReason {
    /// The model answered.
    FinalAnswer,
    /// `max_iterations` was reached and the model answered without tools.
    MaxIterations,
    /// A client cancelled it, or went away.
    Cancelled,
    /// The run timeout elapsed.
    Timeout,
    /// The model failed.
    ModelError,
    /// The server shut down.
    Shutdown,
    /// A bug.
    InternalError,
    /// The model stopped at its token limit; the run ended with the partial answer.
    MaxTokens,
    /// The run waited for tool outputs or approvals longer than `timeouts.action`.
    ActionTimeout,
    /// A budget the operator set refused what the run needed (to wait for answers).
    BudgetExceeded,
}

impl StopReason {
    /// The name clients see in event data.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::FinalAnswer => "final_answer",
            Self::MaxIterations => "max_iterations",
            Self::Cancelled => "cancelled",
            Self::Timeout => "timeout",
            Self::ModelError => "model_error",
            Self::Shutdown => "shutdown",
            Self::InternalError => "internal_error",
            Self::MaxTokens => "max_tokens",
            Self::ActionTimeout => "action_timeout",
            Self::BudgetExceeded => "budget_exceeded",
        }
    }

    /// Every reason.
    pub const ALL: [Self; 10] = [
        Self::FinalAnswer,
        Self::MaxIterations,
        Self::Cancelled,
        Self::Timeout,
        Self::ModelError,
        Self::Shutdown,
        Self::InternalError,
        Self::MaxTokens,
        Self::ActionTimeout,
        Self::BudgetExceeded,
    ];

    /// The reason named `name` (as [`StopReason::as_str`] gives it).
    pub fn from_name(name: &str) -> Option<Self> {
        Self::ALL.into_iter().find(|reason| reason.as_str() == name)
    }

    /// The status a run that stopped for this reason ends with.
    pub fn status(self) -> RunStatus {
        match self {
            Self::FinalAnswer | Self::MaxIterations => RunStatus::Succeeded,
            Self::MaxTokens => RunStatus::Incomplete,
            Self::Cancelled | Self::Shutdown => RunStatus::Cancelled,
            Self::Timeout
            | Self::ModelError
            | Self::InternalError
            | Self::ActionTimeout
            | Self::BudgetExceeded => RunStatus::Failed,
        }
    }
}

/// Why a run failed, for clients.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct RunError {
    /// Stable machine-readable code.
    pub code: String,
    /// For people.
    pub message: String,
    /// `model`, `tool`, `timeout`, `cancelled`, `budget` or `internal`.
    pub category: &'static str,
    /// Whether sending the same request again may succeed.
    pub retryable: bool,
}

/// One tool call of a step.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ToolCallRecord {
    /// The call's id.
    pub id: String,
    /// The tool.
    pub name: String,
    /// The arguments (the raw text as a string when they were not valid JSON).
    pub arguments: agentrt_events::JsonText,
    /// The output given to the model.
    pub output: String,
    /// Whether it failed.
    pub is_error: bool,
    /// How long it took.
    pub duration: Duration,
    /// The references it returned (reranked when the agent has a rerank model).
    pub references: Vec<agentrt_core::Reference>,
    /// Whether it has its result: false while it runs or waits for its answer. A run that
    /// ends without a call's result says so in the call's record (see
    /// [`ToolCallRecord::end_unfinished`]). Written only when false.
    #[serde(default = "finished", skip_serializing_if = "is_finished")]
    pub finished: bool,
}

fn finished() -> bool {
    true
}

#[allow(clippy::trivially_copy_pass_by_ref)] // serde's `skip_serializing_if` passes a reference
fn is_finished(finished: &bool) -> bool {
    *finished
}

impl ToolCallRecord {
    /// Marks a call the run ended without (cancelled, timed out, failed while the call ran
    /// or waited for its answer) as failed, saying so, instead of leaving an empty success.
    pub fn end_unfinished(&mut self, stop_reason: &str) {
        if self.finished {
            return;
        }
        self.finished = true;
        self.is_error = true;
        self.output =
            format!("not finished: the run ended ({stop_reason}) before the call had its result");
    }
}

/// One model round.
#[derive(Debug, Clone, PartialEq, Default, Serialize, Deserialize)]
pub struct StepRecord {
    /// The round, from 1.
    pub iteration: u32,
    /// Its reasoning text.
    pub thought: String,
    /// Its tool calls, in call order.
    pub tool_calls: Vec<ToolCallRecord>,
    /// Answer text it produced.
    pub answer: String,
}

/// Tokens used by a run.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
pub struct TokenUsage {
    /// In prompts.
    pub prompt_tokens: u64,
    /// Generated.
    pub completion_tokens: u64,
    /// Whether the server counted the tokens of at least one call whose provider
    /// reported none.
    pub estimated: bool,
}

/// Everything known of a run.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct RunRecord {
    /// The run.
    pub run_id: String,
    /// Its engine.
    pub engine_id: String,
    /// Its session.
    pub session_id: String,
    /// Its message id.
    pub message_id: String,
    /// The user's query.
    pub query: String,
    /// Where it is.
    pub status: RunStatus,
    /// Why it ended.
    pub stop_reason: Option<StopReason>,
    /// Its rounds. Stores keep them apart from the rest of the record, so that saving a
    /// round does not write the rounds before it again.
    #[serde(skip)]
    pub steps: Vec<StepRecord>,
    /// The final answer.
    pub final_answer: String,
    /// Tokens used.
    pub usage: TokenUsage,
    /// Why it failed.
    pub error: Option<RunError>,
    /// Sequence of its last event.
    pub last_sequence: u64,
    /// When it started.
    pub create_time: SystemTime,
    /// When it last changed.
    pub update_time: SystemTime,
    /// Whether the client of its `Execute` went away and so cancelled it: a retry with the
    /// same message id then starts a new run instead of getting this one back.
    #[serde(default)]
    pub abandoned: bool,
    /// Who executes it: the lease token of the replica that owns it (empty for a run that
    /// no other replica may take over). Stores refuse a write from an owner that lost it.
    #[serde(default)]
    pub owner: String,
    /// While the run waits ([`RunStatus::RequiresAction`]): the calls it waits for.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub pending: Vec<agentrt_events::PendingCall>,
}

impl<'de> Deserialize<'de> for RunError {
    fn deserialize<D: serde::Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        /// [`RunError`] as stored, with an owned category.
        #[derive(Deserialize)]
        struct Stored {
            code: String,
            message: String,
            category: String,
            retryable: bool,
        }
        let stored = Stored::deserialize(deserializer)?;
        Ok(Self {
            code: stored.code,
            message: stored.message,
            category: agentrt_events::static_name_of(&stored.category),
            retryable: stored.retryable,
        })
    }
}

impl RunRecord {
    /// The record of a run that starts now.
    pub fn new(
        run_id: &str,
        engine_id: &str,
        session_id: &str,
        message_id: &str,
        query: &str,
    ) -> Self {
        let now = SystemTime::now();
        Self {
            run_id: run_id.into(),
            engine_id: engine_id.into(),
            session_id: session_id.into(),
            message_id: message_id.into(),
            query: query.into(),
            status: RunStatus::Running,
            stop_reason: None,
            steps: Vec::new(),
            final_answer: String::new(),
            usage: TokenUsage::default(),
            error: None,
            last_sequence: 0,
            create_time: now,
            update_time: now,
            abandoned: false,
            owner: String::new(),
            pending: Vec::new(),
        }
    }

    /// Makes this record `source` but for its rounds, which it keeps: in place, reusing
    /// the strings it holds (a store's copy of a running record changes at every round).
    pub fn copy_head_from(&mut self, source: &Self) {
        // Every field named: one added to the record is not forgotten here.
        let Self {
            run_id,
            engine_id,
            session_id,
            message_id,
            query,
            status,
            stop_reason,
            steps: _,
            final_answer,
            usage,
            error,
            last_sequence,
            create_time,
            update_time,
            abandoned,
            owner,
            pending,
        } = source;
        self.run_id.clone_from(run_id);
        self.engine_id.clone_from(engine_id);
        self.session_id.clone_from(session_id);
        self.message_id.clone_from(message_id);
        self.query.clone_from(query);
        self.status = *status;
        self.stop_reason = *stop_reason;
        self.final_answer.clone_from(final_answer);
        self.usage = *usage;
        self.error.clone_from(error);
        self.last_sequence = *last_sequence;
        self.create_time = *create_time;
        self.update_time = *update_time;
        self.abandoned = *abandoned;
        self.owner.clone_from(owner);
        self.pending.clone_from(pending);
    }

    /// Marks the calls the run ends without (see [`ToolCallRecord::end_unfinished`]);
    /// the first step that changed, when one did (saves write from there).
    pub fn end_unfinished_calls(&mut self, stop_reason: &str) -> Option<usize> {
        let mut first = None;
        for (index, step) in self.steps.iter_mut().enumerate() {
            for call in step.tool_calls.iter_mut().filter(|c| !c.finished) {
                call.end_unfinished(stop_reason);
                first.get_or_insert(index);
            }
        }
        first
    }

    /// Whether the run has ended.
    pub fn ended(&self) -> bool {
        !matches!(self.status, RunStatus::Running | RunStatus::RequiresAction)
    }

    /// Whether the run waits for answers.
    pub fn waiting(&self) -> bool {
        self.status == RunStatus::RequiresAction
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_copy_of_the_head_is_the_record_but_for_its_steps() {
        let step = |iteration| StepRecord {
            iteration,
            thought: String::new(),
            tool_calls: Vec::new(),
            answer: String::new(),
        };
        let mut copy = RunRecord::new("r", "e", "s", "m", "old query");
        copy.steps = vec![step(1)];
        let mut source = RunRecord::new("r", "e2", "s2", "m2", "a query");
        source.status = RunStatus::Succeeded;
        source.stop_reason = Some(StopReason::FinalAnswer);
        source.final_answer = "42".into();
        source.last_sequence = 9;
        source.owner = "o".into();
        source.abandoned = true;
        source.steps = vec![step(1), step(2)];
        copy.copy_head_from(&source);
        assert_eq!(copy.steps, vec![step(1)], "its own steps are kept");
        copy.steps.clone_from(&source.steps);
        assert_eq!(copy, source);
    }

    /// A stop reason read back from a store (a `done` event on the Redis bus) keeps its
    /// name: every one is among the names the events crate knows (`budget_exceeded` read
    /// back as `unknown`).
    #[test]
    fn every_stop_reason_survives_a_store() {
        for reason in StopReason::ALL {
            assert_eq!(
                agentrt_events::static_name_of(reason.as_str()),
                reason.as_str()
            );
            assert_eq!(StopReason::from_name(reason.as_str()), Some(reason));
        }
        for category in [
            "model",
            "tool",
            "timeout",
            "cancelled",
            "budget",
            "internal",
        ] {
            assert_eq!(agentrt_events::static_name_of(category), category);
        }
    }
}
