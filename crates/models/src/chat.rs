use std::{pin::Pin, time::Duration};

use futures_util::Stream;
use tokio_util::sync::CancellationToken;

/// One message of the conversation sent to a model.
#[derive(Debug, Clone, PartialEq, serde::Serialize, serde::Deserialize)]
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
#[derive(Debug, Clone, PartialEq, Eq, Default, serde::Serialize, serde::Deserialize)]
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
    /// Whether the model may ask for several tools in one round. Only `false` is sent (with
    /// tools): `true` is what providers do when it is left out.
    pub parallel_tool_calls: bool,
    /// The tools are offered, but the model may call none (`tool_choice: "none"`): a
    /// round that must be answered in words keeps the prompt the rounds before had (and
    /// providers that refuse a conversation with tool calls but no tools accept it).
    pub no_calls: bool,
    /// Sampling temperature; `None` leaves the provider's default.
    pub temperature: Option<f32>,
    /// Generation cap; `None` leaves the provider's default.
    pub max_tokens: Option<u32>,
    /// Sequences at which the model stops (the ReAct protocol stops at `Observation:`).
    pub stop: Vec<String>,
    /// When the call must have finished by. A retry whose wait would end past it is not
    /// made: the call fails at once with the error it would have retried (a `429` with a
    /// long `Retry-After` is reported as such, not as a timeout later). `None`: no bound.
    pub deadline: Option<tokio::time::Instant>,
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
    /// The provider ended the stream with `[DONE]` without a finish reason, or gave one
    /// this client does not know. (A stream that ends with neither is
    /// [`ModelError::Incomplete`], never a finish.)
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
    /// The model refused to answer (OpenAI's `refusal`), with its words (at most 4 KiB),
    /// before the `Finish`.
    Refusal(String),
    /// The end of the call.
    Finish {
        /// Why it ended.
        reason: FinishReason,
        /// Tokens used, when the provider reported them: `None` when it reported none, or
        /// only part of them, or zero for both (servers that do not count say zero), so
        /// that the caller estimates instead of recording a fabricated zero.
        usage: Option<Usage>,
    },
}

/// Why a model call failed.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum ModelError {
    /// The provider could not be reached.
    #[error("cannot reach the model provider: {0}")]
    Connect(String),
    /// The provider answered with an HTTP error (a redirect included: redirects are not
    /// followed, so that a provider cannot send the prompt elsewhere).
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
    /// The connection was lost while the answer streamed.
    #[error("model stream failed: connection lost mid-stream: {0}")]
    Lost(String),
    /// The provider accepted the call (it answered success), and the connection was lost
    /// before the answer began: as transient as a provider not reached (the call is
    /// retried, and reported as `MODEL_UNREACHABLE`), but the provider may have processed
    /// the prompt, which counts.
    #[error("model call failed: {0}")]
    LostBeforeAnswer(String),
    /// The response ended before the model did: no finish reason and no `[DONE]`, or a
    /// last line or event cut off. What streamed before is not a whole answer.
    #[error("model response incomplete: {0}")]
    Incomplete(String),
    /// The provider answered success with something that is not the API's answer: a
    /// chat completion that is not an event stream (`text/event-stream`), or a rerank
    /// answer that is not its JSON.
    #[error("model provider answered something unreadable: {0}")]
    InvalidResponse(String),
    /// Something the provider sent passed a bound set on what a peer may make the client
    /// hold: the call is ended rather than letting a provider grow memory without end.
    #[error("model response too large: {what} passed the bound of {limit} bytes")]
    TooLarge {
        /// What grew too large, e.g. "one SSE line".
        what: &'static str,
        /// The bound, in bytes.
        limit: usize,
    },
    /// The provider's settings do not match the server found at its URL, e.g. HTTP/2
    /// with prior knowledge against a server that speaks only HTTP/1.1.
    #[error("model provider misconfigured: {0}")]
    Misconfigured(String),
    /// The call took longer than its timeout.
    #[error("model call timed out after {0:?}")]
    Timeout(Duration),
    /// The call was cancelled.
    #[error("model call cancelled")]
    Cancelled,
}

/// Words of a 5xx error message that say the request itself was refused, so that sending
/// it again fails the same way: servers built on pydantic or FastAPI (llama-cpp-python,
/// mockllm, some LiteLLM routes) answer a request that fails their schema with HTTP 500
/// and a message such as "1 validation error for ChatCompletionRequest...". Compared in
/// lowercase, as substrings of the provider's message.
pub const DETERMINISTIC_5XX_MARKERS: &[&str] = &[
    "validation error",
    "validationerror",
    "validation failed",
    "invalid request",
    "invalid_request_error",
    "unprocessable",
];

/// Whether a 5xx message says that the request was refused as invalid (see
/// [`DETERMINISTIC_5XX_MARKERS`]).
fn refused_as_invalid(message: &str) -> bool {
    let message = message.to_lowercase();
    DETERMINISTIC_5XX_MARKERS
        .iter()
        .any(|marker| message.contains(marker))
}

/// The code of a `429` that is no rate limit but an account out of quota (OpenAI's and
/// Azure's): asking again gets it again.
pub const QUOTA_EXHAUSTED: &str = "insufficient_quota";

impl ModelError {
    /// Whether sending the same request again may succeed. Deterministic refusals are not
    /// retried: a 4xx other than 408 and 429, a redirect, a 5xx whose message says the
    /// request failed validation ([`DETERMINISTIC_5XX_MARKERS`]), an answer that is not an
    /// event stream, a bound passed, a misconfiguration. Nor is anything that happens once
    /// the answer streams, as text may have reached the caller.
    pub fn is_retryable(&self) -> bool {
        match self {
            Self::Connect(_) | Self::LostBeforeAnswer(_) | Self::Timeout(_) => true,
            Self::Http {
                status, message, ..
            } => {
                *status == 408
                    || (*status == 429 && !message.contains(QUOTA_EXHAUSTED))
                    || (*status >= 500 && !refused_as_invalid(message))
            }
            Self::Stream(_)
            | Self::Lost(_)
            | Self::Incomplete(_)
            | Self::InvalidResponse(_)
            | Self::TooLarge { .. }
            | Self::Misconfigured(_)
            | Self::Cancelled => false,
        }
    }

    /// Whether the provider certainly did not process the request, so that it used no
    /// tokens: it refused it (an HTTP error), or was never reached, or is not what the
    /// provider's settings say.
    pub fn never_processed(&self) -> bool {
        matches!(
            self,
            Self::Connect(_) | Self::Http { .. } | Self::Misconfigured(_)
        )
    }

    /// A stable code for clients, e.g. `MODEL_HTTP_429`.
    pub fn code(&self) -> String {
        match self {
            Self::Connect(_) | Self::LostBeforeAnswer(_) => "MODEL_UNREACHABLE".into(),
            Self::Http { status, .. } => format!("MODEL_HTTP_{status}"),
            Self::Stream(_) | Self::Lost(_) => "MODEL_STREAM_ERROR".into(),
            Self::Incomplete(_) => "MODEL_INCOMPLETE_RESPONSE".into(),
            Self::InvalidResponse(_) => "MODEL_INVALID_RESPONSE".into(),
            Self::TooLarge { .. } => "MODEL_RESPONSE_TOO_LARGE".into(),
            Self::Misconfigured(_) => "MODEL_PROVIDER_MISCONFIGURED".into(),
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

#[cfg(test)]
mod tests {
    use super::*;

    fn http(status: u16, message: &str) -> ModelError {
        ModelError::Http {
            status,
            message: message.into(),
            retry_after: None,
        }
    }

    /// Only what may pass on a second try is retried: not a 4xx (but 408 and 429), not a
    /// redirect, not a 500 that says the request failed validation.
    #[test]
    fn deterministic_refusals_are_not_retried() {
        for (error, retryable) in [
            (http(503, "busy"), true),
            (http(500, "internal error"), true),
            (http(429, "slow down"), true),
            (http(408, "timeout"), true),
            (http(400, "bad"), false),
            (http(404, "not found"), false),
            (http(307, "redirect"), false),
            (
                http(
                    500,
                    "1 validation error for ChatCompletionRequestAssistantMessage\ncontent\n  \
                     Input should be a valid string",
                ),
                false,
            ),
            (http(502, "Invalid request: messages[2]"), false),
            (http(429, "Rate limit reached for requests"), true),
            (
                http(
                    429,
                    "You exceeded your current quota, please check your plan and billing \
                     details. (insufficient_quota)",
                ),
                false,
            ),
            (ModelError::Connect("refused".into()), true),
            (ModelError::Incomplete("cut".into()), false),
            (
                ModelError::TooLarge {
                    what: "x",
                    limit: 1,
                },
                false,
            ),
            (ModelError::InvalidResponse("html".into()), false),
            (ModelError::Misconfigured("h2c".into()), false),
        ] {
            assert_eq!(error.is_retryable(), retryable, "{error}");
        }
    }
}
