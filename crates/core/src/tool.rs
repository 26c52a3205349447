use std::sync::Arc;

use serde::{Deserialize, Serialize};
use serde_json::{Value, value::RawValue};

/// A JSON value shared read-only, written out once: tool schemas go into every model
/// request and token count of every run, and writing the same tree again each time was a
/// visible share of a run's CPU. It dereferences to the value and serializes as its text.
#[derive(Clone)]
pub struct SharedJson(Arc<SharedJsonInner>);

struct SharedJsonInner {
    value: Value,
    /// The text; `None` only if writing failed, which a `Value` never does.
    text: Option<Box<RawValue>>,
}

impl SharedJson {
    /// The JSON text, as written once.
    pub fn text(&self) -> std::borrow::Cow<'_, str> {
        match &self.0.text {
            Some(text) => text.get().into(),
            None => self.0.value.to_string().into(),
        }
    }
}

impl From<Value> for SharedJson {
    fn from(value: Value) -> Self {
        let text = serde_json::value::to_raw_value(&value).ok();
        Self(Arc::new(SharedJsonInner { value, text }))
    }
}

impl<'de> Deserialize<'de> for SharedJson {
    fn deserialize<D: serde::Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        Value::deserialize(deserializer).map(Self::from)
    }
}

impl std::ops::Deref for SharedJson {
    type Target = Value;

    fn deref(&self) -> &Value {
        &self.0.value
    }
}

impl PartialEq for SharedJson {
    fn eq(&self, other: &Self) -> bool {
        Arc::ptr_eq(&self.0, &other.0) || self.0.value == other.0.value
    }
}

impl std::fmt::Debug for SharedJson {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        std::fmt::Debug::fmt(&self.0.value, f)
    }
}

impl std::fmt::Display for SharedJson {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.text())
    }
}

impl Serialize for SharedJson {
    fn serialize<S: serde::Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        match &self.0.text {
            Some(text) => text.serialize(serializer),
            None => self.0.value.serialize(serializer),
        }
    }
}

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
    /// A tool the caller of the run executes itself (`AgentConfig.client_tools`).
    Client,
}

/// What the model and the validator know of a tool.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ToolSpec {
    /// Unique name, as agent configs and model tool calls use it.
    pub name: String,
    /// What the tool does, written for the model.
    pub description: String,
    /// JSON Schema of the arguments object, shared by every engine and run that offers
    /// the tool to a model.
    pub input_schema: SharedJson,
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
    /// It could not be reached or did not answer in time. The message names neither the
    /// endpoint nor transport details: it reaches clients, and those go to the log.
    #[error("the tool executor is unavailable: {reason}")]
    Unavailable {
        /// Where it was expected (for the log, not for clients).
        endpoint: String,
        /// What went wrong, in terms a client may see.
        reason: String,
    },
    /// It answered, but not as a tool executor this server may use: it refused this
    /// server's credentials, or it does not speak gRPC. No retry helps until an operator
    /// changes a setting, which the message names.
    #[error("the tool executor cannot be used: {reason}")]
    Misconfigured {
        /// Where it was expected (for the log, not for clients).
        endpoint: String,
        /// What went wrong and what to change, in terms a client may see.
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
    /// The call's id, as the model gave it.
    pub call_id: String,
    /// The call's idempotency key, unique among the calls of every run: the run, the
    /// round and the call's id (models number their calls per round, some the same way in
    /// every round: `functions.create:0`). A call sent again (by the replica that takes
    /// its run over, or after its connection broke) has the same key. Empty: the call id.
    pub key: String,
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

/// How deep JSON a tool gives (an input schema, a structured output) may nest. As a
/// `google.protobuf.Struct` on the wire, each level of JSON is up to three levels of Protobuf
/// messages, and Protobuf decoders (prost, Python, Go, Java) refuse more than 100; callers
/// carry it on a few levels deeper in their own messages.
pub const MAX_JSON_DEPTH: usize = 24;

/// How deep a JSON value nests: 1 for a scalar or an empty container.
pub fn json_depth(value: &serde_json::Value) -> usize {
    match value {
        serde_json::Value::Array(items) => 1 + items.iter().map(json_depth).max().unwrap_or(0),
        serde_json::Value::Object(map) => 1 + map.values().map(json_depth).max().unwrap_or(0),
        _ => 1,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn shared_json_writes_as_its_value_would() {
        let value = json!({"type": "object", "properties": {"q": {"type": "string", "description": "a \"quoted\" é"}}});
        let shared = SharedJson::from(value.clone());
        assert_eq!(*shared, value);
        assert_eq!(shared.text(), value.to_string());
        assert_eq!(shared.to_string(), value.to_string());
        let nested = json!({"parameters": &value, "name": "t"});
        #[derive(Serialize)]
        struct Wire<'a> {
            parameters: &'a SharedJson,
            name: &'a str,
        }
        let written = serde_json::to_string(&Wire {
            parameters: &shared,
            name: "t",
        })
        .unwrap();
        assert_eq!(
            serde_json::from_str::<Value>(&written).unwrap(),
            nested,
            "{written}"
        );
        assert_eq!(shared.clone(), shared);
    }
}
