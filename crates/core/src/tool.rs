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
    /// JSON Schema of the arguments object.
    pub input_schema: serde_json::Value,
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
