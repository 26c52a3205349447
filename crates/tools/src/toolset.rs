//! The seam every tool source sits behind.

use std::sync::Arc;

use agentrt_core::ToolSpec;
use async_trait::async_trait;
use tokio::sync::Notify;

use crate::{Result, ToolContext, ToolOutput};

/// Longest source name accepted.
pub const MAX_SOURCE_NAME_LEN: usize = 32;

/// Longest name a model API accepts for a function (OpenAI's limit, the strictest).
const MAX_OFFERED_NAME_LEN: usize = 64;

/// A source of tools: the built-ins, one MCP server, one OpenAPI document.
///
/// A toolset names its tools as the catalogue offers them ([`offered_name`]), keeps the
/// list it last knew and calls a tool by the name its source knows it by. It tells the
/// catalogue that its list changed through the [`Changes`] it was built with.
#[async_trait]
pub trait Toolset: Send + Sync {
    /// The source's name, as the config gives it (`builtin` for the built-ins).
    fn name(&self) -> &str;

    /// The tools on offer now. A source that is down keeps offering the tools it last
    /// listed: calling them is `UNAVAILABLE` until it is back.
    async fn list(&self) -> Result<Vec<ListedTool>>;

    /// Calls the tool its source knows as `tool` with arguments already checked against
    /// its input schema.
    async fn call(
        &self,
        tool: &str,
        arguments: serde_json::Value,
        ctx: &ToolContext,
    ) -> Result<ToolOutput, CallError>;

    /// Asks the source for its tools again.
    async fn refresh(&self) -> Result<()>;

    /// Why the source cannot be reached now, when it cannot (a server down, or not
    /// connected yet), as [`CallError::Unavailable`]: a call of a tool it does not list
    /// (yet) is then `UNAVAILABLE` rather than `NOT_FOUND`.
    fn down(&self) -> Option<CallError> {
        None
    }

    /// Whether its tools are what a third party lists at run time (an MCP server), rather
    /// than what the operator configured (the built-ins, an OpenAPI document). Two of its
    /// tools that end up with one name are then the server's doing, not a config error: the
    /// catalogue leaves the second out with a warning, at start as later, instead of
    /// refusing to start.
    fn lists_at_run_time(&self) -> bool {
        false
    }

    /// Stops what the toolset runs (child processes, connections); calls after this
    /// are `UNAVAILABLE`.
    async fn shutdown(&self) {}
}

/// A tool as a toolset offers it.
#[derive(Debug, Clone, PartialEq)]
pub struct ListedTool {
    /// Name, description and schema, as the catalogue offers it.
    pub spec: ToolSpec,
    /// The name its source knows it by, for [`Toolset::call`].
    pub source_name: String,
    /// Where it comes from, for people: `MCP server "docs", tool "search"`.
    pub origin: String,
}

/// Why a call could not be made.
#[derive(Debug, Clone, thiserror::Error, PartialEq, Eq)]
pub enum CallError {
    /// The tool's source cannot be reached now (a crashed MCP server, being restarted).
    #[error("tool source {source_name:?} is unavailable: {reason}")]
    Unavailable {
        /// The source, as named in the config.
        source_name: String,
        /// What is wrong, and what is being done about it.
        reason: String,
        /// When the source may be back: its next reconnect, as far as it knows.
        retry_after: std::time::Duration,
        /// Whether the call reached the source (and so may have run) before it failed.
        sent: bool,
    },
    /// The source no longer has the tool.
    #[error("tool {0:?} is no longer offered by its source")]
    Gone(String),
}

/// How a toolset tells the catalogue that its list changed: a shared wake-up that the
/// catalogue's refresher waits on (a change before it waits is kept, not lost).
#[derive(Debug, Clone, Default)]
pub struct Changes(Arc<Notify>);

impl Changes {
    /// A new signal.
    pub fn new() -> Self {
        Self::default()
    }

    /// Says that some toolset's list changed.
    pub fn notify(&self) {
        self.0.notify_one();
    }

    /// Waits for the next change.
    pub async fn changed(&self) {
        self.0.notified().await;
    }
}

/// Checks a source name from the config: a letter, then letters, digits, `_` or `-`, at
/// most [`MAX_SOURCE_NAME_LEN`] characters.
pub fn check_source_name(name: &str) -> std::result::Result<(), String> {
    let mut chars = name.chars();
    let Some(first) = chars.next() else {
        return Err("a name is required".into());
    };
    if !first.is_ascii_alphabetic() {
        return Err(format!("{name:?} must start with a letter"));
    }
    if name.len() > MAX_SOURCE_NAME_LEN {
        return Err(format!(
            "{name:?} is longer than {MAX_SOURCE_NAME_LEN} characters"
        ));
    }
    if let Some(bad) = chars.find(|c| !(c.is_ascii_alphanumeric() || *c == '_' || *c == '-')) {
        return Err(format!(
            "{name:?} may hold only letters, digits, `_` and `-`, not {bad:?}"
        ));
    }
    // `__` may appear too, as the contract's rule allows: tool names two sources would
    // share (`a` with tool `b__c`, `a__b` with tool `c`) stop the start as any collision.
    Ok(())
}

/// The name the catalogue offers `tool` of `source` under: `<source>__<tool>`, with every
/// character a model API does not accept in function names (anything but ASCII letters,
/// digits, `_` and `-`) replaced by `_`, within the 64 characters those APIs allow: a
/// longer one keeps its first 55 and ends with `_` and 8 hex digits of a digest of the
/// whole, so that long names alike in their start stay apart (GitHub's API has such
/// operations) and each keeps its name from start to start.
pub fn offered_name(source: &str, tool: &str) -> String {
    let mut name = String::with_capacity(source.len() + 2 + tool.len());
    name.push_str(source);
    name.push_str("__");
    name.extend(tool.chars().map(|c| {
        if c.is_ascii_alphanumeric() || c == '_' || c == '-' {
            c
        } else {
            '_'
        }
    }));
    if name.len() > MAX_OFFERED_NAME_LEN {
        // FNV-1a: the same on every machine and in every version.
        let digest = name.bytes().fold(0x811c_9dc5_u32, |hash, byte| {
            (hash ^ u32::from(byte)).wrapping_mul(0x0100_0193)
        });
        // Only ASCII is left, so any byte index is a character boundary.
        name.truncate(MAX_OFFERED_NAME_LEN - 9);
        name.push_str(&format!("_{digest:08x}"));
    }
    name
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn source_names_follow_the_rule() {
        for good in ["a", "docs", "pet-store_2", "a__b", &"x".repeat(32)] {
            assert_eq!(check_source_name(good), Ok(()), "{good}");
        }
        for bad in ["", "1docs", "_x", "a.b", "a b", "été", &"x".repeat(33)] {
            assert!(check_source_name(bad).is_err(), "{bad:?}");
        }
    }

    #[test]
    fn offered_names_replace_what_model_apis_refuse() {
        assert_eq!(offered_name("docs", "search"), "docs__search");
        assert_eq!(offered_name("ev", "get-sum"), "ev__get-sum");
        assert_eq!(offered_name("fs", "read.file/v2"), "fs__read_file_v2");
        assert_eq!(offered_name("x", "café"), "x__caf_");
        assert_eq!(offered_name("x", &"t".repeat(100)).len(), 64);
        // Two long names alike in their first 64 characters stay apart, each the same
        // every time.
        let organization = offered_name(
            "github",
            "actions/get-github-actions-default-workflow-permissions-organization",
        );
        let repository = offered_name(
            "github",
            "actions/get-github-actions-default-workflow-permissions-repository",
        );
        assert_eq!(organization.len(), 64);
        assert_eq!(repository.len(), 64);
        assert_ne!(organization, repository);
        assert!(
            organization.starts_with("github__actions_get-github-actions-default-workflow-per_"),
            "{organization}"
        );
        assert_eq!(
            organization,
            offered_name(
                "github",
                "actions/get-github-actions-default-workflow-permissions-organization"
            )
        );
        // A name of 64 characters is kept whole.
        let exact = format!("x__{}", "t".repeat(61));
        assert_eq!(offered_name("x", &"t".repeat(61)), exact);
    }
}
