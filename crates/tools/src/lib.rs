//! The tools the tool executor serves.
//!
//! Tools come from *toolsets* behind one trait, [`Toolset`]: the built-in tools
//! ([`builtin::Builtins`]), the tools of MCP servers ([`mcp::McpToolset`]) and the
//! operations of OpenAPI documents ([`openapi::OpenApiToolset`]). The [`Catalogue`]
//! combines them under one namespace (`<source>__<tool>`, built-ins by their bare names),
//! checks arguments against each tool's JSON Schema before a call, and swaps in a new
//! snapshot when a toolset's tools change, while calls on the old one go on.

pub mod builtin;
mod calculator;
mod catalogue;
mod http;
pub mod mcp;
pub mod openapi;
pub mod secret;
mod toolset;

use agentrt_core::{Reference, ToolSpec};
use async_trait::async_trait;
use tokio_util::sync::CancellationToken;

pub use catalogue::{Catalogue, ExecuteError};
pub use toolset::{
    CallError, Changes, ListedTool, MAX_SOURCE_NAME_LEN, Toolset, check_source_name, offered_name,
};

/// Why a toolset or the catalogue could not be built.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// Two tools would be offered under the same name.
    #[error("tool name {name:?} is offered twice: by {first} and by {second}")]
    Duplicate {
        /// The offered name.
        name: String,
        /// Where the first one comes from.
        first: String,
        /// Where the second one comes from.
        second: String,
    },
    /// A tool's input schema is not a valid JSON Schema.
    #[error("tool {tool:?} has an invalid input schema: {reason}")]
    InvalidSchema {
        /// The tool.
        tool: String,
        /// What the schema compiler said.
        reason: String,
    },
    /// A tool source's settings or document cannot be used.
    #[error("tool source {source_name:?}: {message}")]
    Source {
        /// The source, as named in the config.
        source_name: String,
        /// What is wrong.
        message: String,
    },
}

impl Error {
    /// A problem with the source called `name`.
    pub fn source(name: &str, message: impl Into<String>) -> Self {
        Self::Source {
            source_name: name.to_owned(),
            message: message.into(),
        }
    }
}

/// The result of building toolsets and the catalogue.
pub type Result<T, E = Error> = std::result::Result<T, E>;

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
    /// The call's idempotency key: its id, as the caller gave it, under the caller's
    /// principal when it has one (`PRINCIPAL/ID`).
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
    /// Whether it failed by taking longer than its source allows (the source's own
    /// `timeout`): counted as a `timeout`, not an `error`.
    pub timed_out: bool,
    /// Whether the call was stopped before it finished because the tool executor is
    /// shutting down (it may have done part of its work): its caller sends it again, with
    /// its `call_id`, to a tool executor that is not.
    pub stopped: bool,
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

    /// A failure by taking longer than the source allows ([`ToolOutput::timed_out`]).
    pub fn timed_out(message: impl Into<String>) -> Self {
        Self {
            timed_out: true,
            ..Self::error(message)
        }
    }

    /// The result of a call stopped before it finished: the tool executor is shutting
    /// down (a caller that went away reads no result).
    pub fn stopped() -> Self {
        Self {
            stopped: true,
            ..Self::error(
                "the call was stopped before it finished: the tool executor is shutting down \
                 (the tool may have done part of its work)",
            )
        }
    }
}

/// Cuts `text` to at most `max` bytes on a character boundary, saying that it did.
pub(crate) fn truncate_text(text: &mut String, max: usize) {
    if text.len() <= max {
        return;
    }
    cut_at(text, max);
    text.push_str(&format!("\n[output truncated at {max} bytes]"));
}

/// Most bytes of a tool's description as offered (MCP and OpenAPI alike): the model reads
/// every description in every round.
pub(crate) const MAX_DESCRIPTION_BYTES: usize = 4096;

/// Cuts a tool's description to [`MAX_DESCRIPTION_BYTES`] on a character boundary, ending
/// it with `…` (a marker of cut output would read to the model as part of the tool's
/// description).
pub(crate) fn cut_description(text: &mut String) {
    if text.len() <= MAX_DESCRIPTION_BYTES {
        return;
    }
    cut_at(text, MAX_DESCRIPTION_BYTES - '…'.len_utf8());
    text.push('…');
}

/// Cuts `text` to at most `max` bytes, on a character boundary.
fn cut_at(text: &mut String, max: usize) {
    let mut end = max.min(text.len());
    while !text.is_char_boundary(end) {
        end -= 1;
    }
    text.truncate(end);
}

/// `url` as errors and logs show it: a user and password in it (`http://user:pass@host`)
/// and the values of its query (where some servers take their keys) masked.
pub(crate) fn shown_url(url: &str) -> String {
    let Ok(mut parsed) = reqwest::Url::parse(url) else {
        return url.to_owned();
    };
    if parsed.username().is_empty() && parsed.password().is_none() && parsed.query().is_none() {
        return url.to_owned();
    }
    if !parsed.username().is_empty() || parsed.password().is_some() {
        let _ = parsed.set_password(None);
        let _ = parsed.set_username("***");
    }
    if parsed.query().is_some() {
        let names: Vec<String> = parsed.query_pairs().map(|(name, _)| name.into()).collect();
        let mut pairs = parsed.query_pairs_mut();
        pairs.clear();
        for name in &names {
            pairs.append_pair(name, "***");
        }
    }
    parsed.to_string()
}

/// Refuses a URL that carries credentials: they would sit in the config and in every log
/// and error that names the URL, and no request sends them.
pub(crate) fn no_credentials(url: &reqwest::Url) -> Result<(), String> {
    if url.username().is_empty() && url.password().is_none() {
        return Ok(());
    }
    Err(
        "it carries credentials (`user:password@`), which no request sends and every log \
         would show: give them in `headers` instead (`Authorization = { env = \"...\", \
         prefix = \"Basic \" }`, the value base64 of `user:password`)"
            .into(),
    )
}

#[cfg(test)]
mod description_tests {
    use super::*;

    #[test]
    fn long_descriptions_are_cut_with_an_ellipsis_on_a_character_boundary() {
        let mut short = "adds two numbers".to_owned();
        cut_description(&mut short);
        assert_eq!(short, "adds two numbers");
        let mut long = "é".repeat(3000);
        cut_description(&mut long);
        assert!(long.len() <= MAX_DESCRIPTION_BYTES, "{}", long.len());
        assert!(long.ends_with("é…"));
        assert!(!long.contains("truncated"));
    }
}
