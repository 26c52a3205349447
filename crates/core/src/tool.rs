use serde::{Deserialize, Serialize};

/// Where a tool comes from.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum ToolSource {
    /// Built into the tool executor.
    Builtin,
    /// An HTTP endpoint configured on the tool executor.
    Http,
    /// A tool of an MCP server.
    Mcp,
}

/// What the model and the validator know of a tool.
#[derive(Debug, Clone, PartialEq)]
pub struct ToolSpec {
    /// Unique name, as agent configs and model tool calls use it.
    pub name: String,
    /// What the tool does, written for the model.
    pub description: String,
    /// JSON Schema of the arguments object, shared by every engine and run that offers
    /// the tool to a model.
    pub input_schema: std::sync::Arc<serde_json::Value>,
    /// Where the tool comes from.
    pub source: ToolSource,
}

/// A document a tool's output is drawn from, for citation.
#[derive(Debug, Clone, PartialEq, Default, Serialize, Deserialize)]
pub struct Reference {
    /// The document's title.
    pub title: String,
    /// Where the document can be found.
    pub url: String,
    /// The relevant passage.
    pub snippet: String,
    /// Relevance score, higher is better; 0 when unknown.
    pub score: f64,
    /// Which tool or knowledge base produced it.
    pub source: String,
}

/// Why the tool service could not answer.
#[derive(Debug, Clone, thiserror::Error, PartialEq, Eq)]
pub enum ToolServiceError {
    /// It could not be reached or did not answer in time.
    #[error("tool executor at {endpoint} is unavailable: {reason}")]
    Unavailable {
        /// Where it was expected.
        endpoint: String,
        /// What went wrong.
        reason: String,
    },
}

/// The catalogue of tools an agent may use, as the tool executor reports it. A trait so
/// that tests and other deployments can supply their own.
#[async_trait::async_trait]
pub trait ToolCatalog: Send + Sync {
    /// Every tool on offer, asked live.
    async fn list_tools(&self) -> Result<Vec<ToolSpec>, ToolServiceError>;
}

/// One tool call the engine asks for.
#[derive(Debug, Clone, PartialEq)]
pub struct ToolInvocation {
    /// The call's id.
    pub call_id: String,
    /// The tool.
    pub name: String,
    /// The parsed arguments.
    pub arguments: serde_json::Value,
    /// The run making the call.
    pub run_id: String,
    /// The session of the run.
    pub session_id: String,
}

/// What came of a tool call, as the model will read it. Failures of any kind (the tool's
/// own, bad arguments, timeouts, an unreachable executor) are results with `is_error`, so
/// that the model can react; they never end a run.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct ToolResult {
    /// The output, or what went wrong.
    pub output: String,
    /// Whether it failed.
    pub is_error: bool,
    /// Documents the output is drawn from.
    pub references: Vec<Reference>,
}

impl ToolResult {
    /// A failure the model should read.
    pub fn error(message: impl Into<String>) -> Self {
        Self {
            output: message.into(),
            is_error: true,
            references: Vec::new(),
        }
    }
}

/// Runs tool calls for the engine. Dropping the future cancels the call.
#[async_trait::async_trait]
pub trait ToolRunner: Send + Sync {
    /// Runs one call within `timeout`.
    async fn run(&self, call: ToolInvocation, timeout: std::time::Duration) -> ToolResult;
}
