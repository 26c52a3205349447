use std::{pin::Pin, time::Duration};

use futures_util::Stream;
use tokio_util::sync::CancellationToken;

/// One message of the conversation sent to a model.
#[derive(Debug, Clone, PartialEq)]
pub enum ChatMessage {
    /// Instructions.
    System(String),
    /// The user.
    User(String),
    /// The model's earlier turn: text and the tools it called.
    Assistant {
        /// The text, possibly empty.
        content: String,
        /// The calls it made.
        tool_calls: Vec<ModelToolCall>,
    },
    /// A tool's result, answering the call `call_id`.
    Tool {
        /// The call answered.
        call_id: String,
        /// The output.
        content: String,
    },
}

/// A tool call as the model made it: arguments are the model's raw JSON text, which may
/// be malformed or truncated.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct ModelToolCall {
    /// The call's id.
    pub id: String,
    /// The tool's name.
    pub name: String,
    /// The arguments as the model wrote them.
    pub arguments: String,
}

/// A tool the model may call (native function calling).
#[derive(Debug, Clone, PartialEq)]
pub struct ToolDefinition {
    /// The tool's name.
    pub name: String,
    /// What it does.
    pub description: String,
    /// JSON Schema of its arguments, written out once.
    pub parameters: agentrt_core::SharedJson,
}

/// One streaming chat call.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct ChatRequest {
    /// The provider's model id.
    pub model: String,
    /// The conversation.
    pub messages: Vec<ChatMessage>,
    /// Tools offered for native calling; empty offers none. Shared: every round of a run
    /// offers the same tools.
    pub tools: std::sync::Arc<[ToolDefinition]>,
    /// Whether the model may ask for several tools in one round.
    pub parallel_tool_calls: bool,
    /// Sampling temperature; `None` leaves the provider's default.
    pub temperature: Option<f32>,
    /// Generation cap; `None` leaves the provider's default.
    pub max_tokens: Option<u32>,
    /// Sequences at which the model stops (the ReAct protocol stops at `Observation:`).
    pub stop: Vec<String>,
}

/// Why a model stopped generating.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FinishReason {
    /// It finished its answer (or hit a stop sequence).
    Stop,
    /// It asked for tools.
    ToolCalls,
    /// It ran out of tokens.
    Length,
    /// The provider filtered the output.
    ContentFilter,
    /// The stream ended without saying.
    Unknown,
}

/// Tokens used by a call.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Usage {
    /// Prompt tokens.
    pub prompt_tokens: u64,
    /// Generated tokens.
    pub completion_tokens: u64,
}

/// What a streaming call yields, in order: text deltas as they arrive, then each complete
/// tool call, then exactly one `Finish`.
#[derive(Debug, Clone, PartialEq)]
pub enum ChatDelta {
    /// Reasoning text (`reasoning_content`, or text inside `<think>...</think>`).
    Reasoning(String),
    /// Answer text.
    Content(String),
    /// A tool call, complete.
    ToolCall(ModelToolCall),
    /// The end of the call.
    Finish {
        /// Why it ended.
        reason: FinishReason,
        /// Tokens used, when the provider reported them.
        usage: Option<Usage>,
    },
}

/// Why a model call failed.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum ModelError {
    /// The provider could not be reached.
    #[error("cannot reach the model provider: {0}")]
    Connect(String),
    /// The provider answered with an HTTP error.
    #[error("model provider answered HTTP {status}: {message}")]
    Http {
        /// The HTTP status.
        status: u16,
        /// The provider's message.
        message: String,
        /// How long the provider asked to wait before retrying.
        retry_after: Option<Duration>,
    },
    /// The stream broke or carried something unreadable.
    #[error("model stream failed: {0}")]
    Stream(String),
    /// The call took longer than its timeout.
    #[error("model call timed out after {0:?}")]
    Timeout(Duration),
    /// The call was cancelled.
    #[error("model call cancelled")]
    Cancelled,
}

impl ModelError {
    /// Whether sending the same request again may succeed.
    pub fn is_retryable(&self) -> bool {
        match self {
            Self::Connect(_) | Self::Timeout(_) => true,
            Self::Http { status, .. } => *status == 408 || *status == 429 || *status >= 500,
            Self::Stream(_) | Self::Cancelled => false,
        }
    }

    /// A stable code for clients, e.g. `MODEL_HTTP_429`.
    pub fn code(&self) -> String {
        match self {
            Self::Connect(_) => "MODEL_UNREACHABLE".into(),
            Self::Http { status, .. } => format!("MODEL_HTTP_{status}"),
            Self::Stream(_) => "MODEL_STREAM_ERROR".into(),
            Self::Timeout(_) => "MODEL_TIMEOUT".into(),
            Self::Cancelled => "CANCELLED".into(),
        }
    }
}

/// A stream of one call's deltas.
pub type ChatStream = Pin<Box<dyn Stream<Item = Result<ChatDelta, ModelError>> + Send>>;

/// A chat model. Implementations retry transient failures that happen before the first
/// delta; once text has streamed, a failure ends the stream with an error.
#[async_trait::async_trait]
pub trait ChatModel: Send + Sync {
    /// Starts a call. `cancel` aborts it at any point, including while waiting to retry.
    async fn stream(
        &self,
        request: ChatRequest,
        cancel: CancellationToken,
    ) -> Result<ChatStream, ModelError>;
}
