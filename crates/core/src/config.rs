use std::time::Duration;

/// Bounds and defaults of an agent config, shared by validation (which enforces them) and
/// the engine (which relies on them).
pub mod limits {
    use std::time::Duration;

    /// Longest agent name.
    pub const NAME_MAX_CHARS: usize = 64;
    /// Longest system prompt.
    pub const SYSTEM_PROMPT_MAX_CHARS: usize = 100_000;
    /// Longest model id.
    pub const MODEL_NAME_MAX_CHARS: usize = 256;
    /// Allowed range of `max_iterations`.
    pub const MAX_ITERATIONS: std::ops::RangeInclusive<i32> = 1..=99;
    /// `max_iterations` when 0.
    pub const DEFAULT_MAX_ITERATIONS: i32 = 10;
    /// Allowed range of the sampling temperature.
    pub const TEMPERATURE: std::ops::RangeInclusive<f32> = 0.0..=2.0;
    /// Allowed range of `max_tokens` (0 means the provider's default).
    pub const MAX_TOKENS: std::ops::RangeInclusive<i32> = 0..=1_000_000;
    /// Most tools one agent may use.
    pub const MAX_TOOLS: usize = 128;
    /// Allowed range of `max_parallel_tool_calls`.
    pub const PARALLEL_TOOL_CALLS: std::ops::RangeInclusive<i32> = 1..=64;
    /// `max_parallel_tool_calls` when 0.
    pub const DEFAULT_PARALLEL_TOOL_CALLS: i32 = 4;
    /// Allowed range of the prompt token budget.
    pub const PROMPT_TOKENS: std::ops::RangeInclusive<i32> = 256..=2_000_000;
    /// Prompt token budget when 0.
    pub const DEFAULT_PROMPT_TOKENS: i32 = 8_192;
    /// Allowed range of the rerank `top_n`.
    pub const RERANK_TOP_N: std::ops::RangeInclusive<i32> = 1..=100;
    /// Rerank `top_n` when 0.
    pub const DEFAULT_RERANK_TOP_N: i32 = 5;
    /// Allowed range of the rerank `min_score`.
    pub const RERANK_MIN_SCORE: std::ops::RangeInclusive<f32> = 0.0..=1.0;
    /// Longest run timeout.
    pub const MAX_RUN_TIMEOUT: Duration = Duration::from_secs(3600);
    /// Run timeout when unset.
    pub const DEFAULT_RUN_TIMEOUT: Duration = Duration::from_secs(300);
    /// Model call timeout when unset.
    pub const DEFAULT_MODEL_CALL_TIMEOUT: Duration = Duration::from_secs(120);
    /// Tool call timeout when unset.
    pub const DEFAULT_TOOL_CALL_TIMEOUT: Duration = Duration::from_secs(30);
    /// Longest wait of a run for tool outputs or approvals.
    pub const MAX_ACTION_TIMEOUT: Duration = Duration::from_secs(7 * 24 * 3600);
    /// Wait for tool outputs or approvals when unset.
    pub const DEFAULT_ACTION_TIMEOUT: Duration = Duration::from_secs(3600);
    /// Longest description of a client tool.
    pub const CLIENT_TOOL_DESCRIPTION_MAX_CHARS: usize = 4096;
}

/// A validated agent config with every default applied: what an engine runs.
#[derive(Debug, Clone, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct AgentConfig {
    /// The agent's name, for logs and traces.
    pub name: String,
    /// The system message, possibly empty.
    pub system_prompt: String,
    /// The chat model.
    pub model: ModelSelection,
    /// The optional reranking model.
    pub rerank_model: Option<RerankSelection>,
    /// How the model asks for tools.
    pub strategy: Strategy,
    /// Maximum model rounds per run.
    pub max_iterations: u32,
    /// Names of the tools the agent may call, each once.
    pub tools: Vec<String>,
    /// Those of `tools` whose calls wait for approval.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub approval: Vec<String>,
    /// Tools the caller runs itself.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub client_tools: Vec<ClientTool>,
    /// Whether the calls of one round run concurrently.
    pub parallel_tool_calls: bool,
    /// How many calls of one round run at once when they run concurrently.
    pub max_parallel_tool_calls: u32,
    /// How much history is sent to the model.
    pub context: ContextBudget,
    /// Time limits.
    pub timeouts: Timeouts,
}

/// A tool the caller runs itself: a call of it waits for the caller's output.
#[derive(Debug, Clone, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct ClientTool {
    /// Its name, as the model sees it.
    pub name: String,
    /// What it does, for the model.
    pub description: String,
    /// The JSON Schema of its arguments.
    pub input_schema: serde_json::Value,
}

impl AgentConfig {
    /// The client tool named `name`.
    pub fn client_tool(&self, name: &str) -> Option<&ClientTool> {
        self.client_tools.iter().find(|t| t.name == name)
    }

    /// Whether calls of `name` wait for approval.
    pub fn needs_approval(&self, name: &str) -> bool {
        self.approval.iter().any(|t| t == name)
    }
}

/// A chat model on a provider configured on the server.
#[derive(Debug, Clone, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct ModelSelection {
    /// The provider's name on this server.
    pub provider: String,
    /// The provider's model id.
    pub name: String,
    /// Sampling temperature; `None` leaves the provider's default.
    pub temperature: Option<f32>,
    /// Generation cap per call; `None` leaves the provider's default.
    pub max_tokens: Option<u32>,
}

/// A reranking model.
#[derive(Debug, Clone, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct RerankSelection {
    /// The provider's name on this server.
    pub provider: String,
    /// The provider's model id.
    pub name: String,
    /// How many references to keep.
    pub top_n: u32,
    /// References scoring below are dropped.
    pub min_score: f32,
}

/// How the model asks for tools.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub enum Strategy {
    /// Native tool calling.
    FunctionCall,
    /// The ReAct text protocol, for models without tool calling.
    React,
}

/// The prompt's token budget.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct ContextBudget {
    /// Tokens the whole prompt may take.
    pub max_prompt_tokens: u32,
}

/// Time limits of a run.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct Timeouts {
    /// The whole run.
    pub run: Duration,
    /// Each model call.
    pub model_call: Duration,
    /// Each tool call.
    pub tool_call: Duration,
    /// Each wait for tool outputs or approvals.
    #[serde(default = "default_action_timeout")]
    pub action: Duration,
}

fn default_action_timeout() -> Duration {
    limits::DEFAULT_ACTION_TIMEOUT
}

impl Default for Timeouts {
    fn default() -> Self {
        Self {
            run: limits::DEFAULT_RUN_TIMEOUT,
            model_call: limits::DEFAULT_MODEL_CALL_TIMEOUT,
            tool_call: limits::DEFAULT_TOOL_CALL_TIMEOUT,
            action: limits::DEFAULT_ACTION_TIMEOUT,
        }
    }
}
