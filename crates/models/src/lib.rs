//! Model providers and the chat models behind them.
//!
//! - [`ProviderRegistry`]: the providers configured on the server. An agent config names
//!   a provider (`model.provider = "openai"`); what that name means (endpoint,
//!   credentials) is known only here, so that credentials never travel in a request.
//! - [`ChatModel`]: one streaming chat call, whatever the provider; [`OpenAiChat`] speaks
//!   OpenAI-compatible chat completions (OpenAI, vLLM, Ollama, llama.cpp, LiteLLM,
//!   DeepSeek, ...).

mod chat;
mod openai;
mod providers;
mod think;

pub use chat::{
    ChatDelta, ChatMessage, ChatModel, ChatRequest, ChatStream, FinishReason, ModelError,
    ModelToolCall, ToolDefinition, Usage,
};
pub use openai::{OpenAiChat, RetryPolicy};
pub use providers::{ProviderError, ProviderKind, ProviderRegistry, ProviderSettings};
