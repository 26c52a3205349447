//! Model providers and the chat models behind them.
//!
//! - [`ProviderRegistry`]: the providers configured on the server. An agent config names
//!   a provider (`model.provider = "openai"`); what that name means (endpoint,
//!   credentials) is known only here, so that credentials never travel in a request.
//! - [`ChatModel`]: one streaming chat call, whatever the provider; [`OpenAiChat`] speaks
//!   OpenAI-compatible chat completions (OpenAI, vLLM, Ollama, llama.cpp, LiteLLM,
//!   DeepSeek, ...).
//! - [`Reranker`]: ranks documents against a query; [`HttpReranker`] calls a provider's
//!   `POST {base_url}/rerank` (vLLM, Jina, Cohere-compatible servers).
//!
//! What a provider sends is bounded ([`ResponseLimits`]), and an answer that is cut,
//! unreadable or too large is a [`ModelError`], never a short answer.

mod chat;
mod openai;
mod providers;
mod rerank;
mod think;

pub use chat::{
    ChatDelta, ChatMessage, ChatModel, ChatRequest, ChatStream, DETERMINISTIC_5XX_MARKERS,
    FinishReason, ModelError, ModelToolCall, ToolDefinition, Usage,
};
pub use openai::{
    MAX_ERROR_BODY_BYTES, MAX_REPLY_TEXT_BYTES, MAX_SSE_EVENT_BYTES, MAX_TOOL_ARGUMENTS_BYTES,
    OpenAiChat, ResponseLimits, RetryPolicy, mask_credentials,
};
pub use providers::{HttpClient, ProviderError, ProviderKind, ProviderRegistry, ProviderSettings};
pub use rerank::{
    HttpReranker, MAX_RERANK_RESPONSE_BYTES, RERANK_TIMEOUT, RerankRequest, RerankResult, Reranker,
};

use std::{collections::HashMap, sync::Arc};

/// The chat model and the reranker of each configured provider, by provider name.
#[derive(Clone, Default)]
pub struct ChatModels {
    by_provider: HashMap<String, Arc<dyn ChatModel>>,
    rerankers: HashMap<String, Arc<dyn Reranker>>,
}

impl ChatModels {
    /// A client for every provider of `registry`.
    pub fn from_providers(
        registry: &ProviderRegistry,
        retry: RetryPolicy,
    ) -> Result<Self, ModelError> {
        let mut models = Self::default();
        for (name, settings) in registry.settings() {
            let (model, reranker): (Arc<dyn ChatModel>, Arc<dyn Reranker>) = match settings.kind {
                ProviderKind::Openai => (
                    Arc::new(OpenAiChat::new(settings, retry)?.with_name(name)),
                    Arc::new(HttpReranker::new(settings)?.with_name(name)),
                ),
            };
            models.by_provider.insert(name.clone(), model);
            models.rerankers.insert(name.clone(), reranker);
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

    /// Adds (or replaces) the reranker of `provider`.
    pub fn insert_reranker(&mut self, provider: impl Into<String>, reranker: Arc<dyn Reranker>) {
        self.rerankers.insert(provider.into(), reranker);
    }

    /// The reranker of `provider` (`POST {base_url}/rerank`), for an agent config's
    /// `rerank_model`.
    pub fn reranker(&self, provider: &str) -> Option<Arc<dyn Reranker>> {
        self.rerankers.get(provider).cloned()
    }
}
