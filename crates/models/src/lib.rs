//! Model providers and the chat models behind them.
//!
//! - [`ProviderRegistry`]: the providers configured on the server. An agent config names
//!   a provider (`model.provider = "openai"`); what that name means (endpoint,
//!   credentials) is known only here, so that credentials never travel in a request.
//! - [`ChatModel`]: one streaming chat call, whatever the provider; [`OpenAiChat`] speaks
//!   OpenAI-compatible chat completions (OpenAI, vLLM, Ollama, llama.cpp, LiteLLM,
//!   DeepSeek, ...).

mod chat;
mod h2c;
mod openai;
mod providers;
mod think;

pub use chat::{
    ChatDelta, ChatMessage, ChatModel, ChatRequest, ChatStream, FinishReason, ModelError,
    ModelToolCall, ToolDefinition, Usage,
};
pub use openai::{OpenAiChat, RetryPolicy};
pub use providers::{ProviderError, ProviderKind, ProviderRegistry, ProviderSettings};

use std::{collections::HashMap, sync::Arc};

/// The chat model of each configured provider, by provider name.
#[derive(Clone, Default)]
pub struct ChatModels {
    by_provider: HashMap<String, Arc<dyn ChatModel>>,
}

impl ChatModels {
    /// A client for every provider of `registry`.
    pub fn from_providers(
        registry: &ProviderRegistry,
        retry: RetryPolicy,
    ) -> Result<Self, ModelError> {
        let mut models = Self::default();
        for (name, settings) in registry.settings() {
            let model: Arc<dyn ChatModel> = match settings.kind {
                ProviderKind::Openai => Arc::new(OpenAiChat::new(settings, retry)?),
            };
            models.by_provider.insert(name.clone(), model);
        }
        Ok(models)
    }

    /// Adds (or replaces) the model of `provider`.
    pub fn insert(&mut self, provider: impl Into<String>, model: Arc<dyn ChatModel>) {
        self.by_provider.insert(provider.into(), model);
    }

    /// The model of `provider`.
    pub fn get(&self, provider: &str) -> Option<Arc<dyn ChatModel>> {
        self.by_provider.get(provider).cloned()
    }
}
