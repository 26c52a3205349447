//! What is known of a run while and after it runs: `AgentEngine.GetRun` reads it.

use std::{
    sync::{Mutex, MutexGuard, PoisonError},
    time::{Duration, SystemTime},
};

/// Where a run is in its life.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
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
}

/// Why a run ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
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
        }
    }

    /// The status a run that stopped for this reason ends with.
    pub fn status(self) -> RunStatus {
        match self {
            Self::FinalAnswer | Self::MaxIterations => RunStatus::Succeeded,
            Self::MaxTokens => RunStatus::Incomplete,
            Self::Cancelled | Self::Shutdown => RunStatus::Cancelled,
            Self::Timeout | Self::ModelError | Self::InternalError => RunStatus::Failed,
        }
    }
}

/// Why a run failed, for clients.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RunError {
    /// Stable machine-readable code.
    pub code: String,
    /// For people.
    pub message: String,
    /// `model`, `tool`, `timeout`, `cancelled` or `internal`.
    pub category: &'static str,
    /// Whether sending the same request again may succeed.
    pub retryable: bool,
}

/// One tool call of a step.
#[derive(Debug, Clone, PartialEq)]
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
}

/// One model round.
#[derive(Debug, Clone, PartialEq, Default)]
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
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
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
#[derive(Debug, Clone, PartialEq)]
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
    /// Its rounds.
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
}

/// A run's record, shared by the run and its readers.
#[derive(Debug)]
pub struct RunState(Mutex<RunRecord>);

impl RunState {
    /// The record of a run that starts now.
    pub fn new(
        run_id: &str,
        engine_id: &str,
        session_id: &str,
        message_id: &str,
        query: &str,
    ) -> Self {
        let now = SystemTime::now();
        Self(Mutex::new(RunRecord {
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
        }))
    }

    /// Locks the record for an update or a read.
    pub fn lock(&self) -> MutexGuard<'_, RunRecord> {
        // Updates leave the record consistent before anything can panic.
        self.0.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// A copy of the record.
    pub fn snapshot(&self) -> RunRecord {
        self.lock().clone()
    }
}
