//! Tools the tool executor serves: the [`Tool`] trait, the [`ToolRegistry`] that checks
//! arguments against each tool's JSON Schema before running it, and the built-in tools.

pub mod builtin;
mod calculator;
mod registry;

use agentrt_core::{Reference, ToolSpec};
use async_trait::async_trait;
use tokio_util::sync::CancellationToken;

pub use registry::{ExecuteError, RegistryError, ToolRegistry};

/// A callable tool.
///
/// Arguments reach [`Tool::call`] already checked against [`ToolSpec::input_schema`].
/// The future is dropped when the caller cancels or the deadline passes; a tool that does
/// work outside its future (a spawned task, a blocking thread) must stop when
/// [`ToolContext::cancel`] fires.
#[async_trait]
pub trait Tool: Send + Sync {
    /// The tool's name, description and input schema.
    fn spec(&self) -> &ToolSpec;

    /// Runs one call.
    async fn call(&self, arguments: serde_json::Value, ctx: &ToolContext) -> ToolOutput;
}

/// What a tool call knows of its caller.
#[derive(Debug, Clone, Default)]
pub struct ToolContext {
    /// The call's id, as the caller gave it.
    pub call_id: String,
    /// The run making the call.
    pub run_id: String,
    /// The session of the run.
    pub session_id: String,
    /// Fires when the call is abandoned (cancelled, deadline passed, server draining).
    pub cancel: CancellationToken,
}

/// The outcome of a tool call that ran.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct ToolOutput {
    /// Text for the model: the result, or what went wrong.
    pub text: String,
    /// The result as structured data, when there is any.
    pub structured: Option<serde_json::Value>,
    /// Documents the output is drawn from.
    pub references: Vec<Reference>,
    /// Whether the tool failed; the model reads `text` either way.
    pub is_error: bool,
}

impl ToolOutput {
    /// A successful result with structured data; the text is its JSON.
    pub fn json(value: serde_json::Value) -> Self {
        Self {
            text: value.to_string(),
            structured: Some(value),
            ..Self::default()
        }
    }

    /// A failure the model should read and react to.
    pub fn error(message: impl Into<String>) -> Self {
        Self {
            text: message.into(),
            is_error: true,
            ..Self::default()
        }
    }
}
