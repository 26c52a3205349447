//! Domain types shared by the engine, the tools and the services.
//!
//! These types know nothing of Protobuf: the services convert wire messages into them at
//! the edge, so that the engine and the tools never depend on generated code.

mod config;
mod secret;
mod tool;
mod violation;

pub use config::{
    AgentConfig, ContextBudget, ModelSelection, RerankSelection, Strategy, Timeouts, limits,
};
pub use secret::Secret;
pub use tool::{
    Reference, SharedJson, ToolCatalog, ToolInvocation, ToolResult, ToolRunner, ToolServiceError,
    ToolSource, ToolSpec,
};
pub use violation::Violation;
