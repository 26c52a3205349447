//! Domain types shared by the engine, the tools and the services.
//!
//! These types know nothing of Protobuf: the services convert wire messages into them at
//! the edge, so that the engine and the tools never depend on generated code.

pub mod children;
mod config;
pub mod duration;
pub mod packed;
mod secret;
mod state;
pub mod throttle;
mod tool;
mod violation;

pub use config::{
    AgentConfig, ClientTool, ContextBudget, ModelSelection, RerankSelection, Strategy, Timeouts,
    limits,
};
pub use secret::{Secret, mask_url_credentials, push_masked_query};
pub use state::{StateError, StateResult, principal_of};
pub use tool::{
    MAX_JSON_DEPTH, Reference, SharedJson, ToolCatalog, ToolInvocation, ToolResult, ToolRunner,
    ToolServiceError, ToolSource, ToolSpec, json_depth,
};
pub use violation::Violation;

/// Cuts `text` to at most `max` bytes at a character boundary. Returns how many bytes were
/// left out and how many there were, when it cut, so that the caller can say so.
pub fn truncate_at_char_boundary(text: &mut String, max: usize) -> Option<(usize, usize)> {
    if text.len() <= max {
        return None;
    }
    let total = text.len();
    let mut cut = max;
    while !text.is_char_boundary(cut) {
        cut -= 1;
    }
    text.truncate(cut);
    Some((total - cut, total))
}
