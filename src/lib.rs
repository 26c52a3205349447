//! The agent runtime's public contract: the `agent.v1` Protobuf API compiled for Rust.
//!
//! Every other crate of the workspace depends on this one for the wire types; the engine
//! and the tools work on domain types and convert at the service edge.

pub mod codec;
pub mod json;

/// The `agent.v1` package: messages, enums, and the tonic clients and servers of
/// `AgentService`, `AgentEngine` and `ToolExecutor`.
#[allow(missing_docs, clippy::all, clippy::pedantic)]
pub mod v1 {
    tonic::include_proto!("agent.v1");
}

/// The encoded `FileDescriptorSet` of `agent.v1` and its imports, with source comments,
/// for gRPC reflection.
pub const FILE_DESCRIPTOR_SET: &[u8] =
    include_bytes!(concat!(env!("OUT_DIR"), "/agent_v1_descriptor.bin"));

/// The encoded `FileDescriptorSet` of the `google.rpc` error details the servers attach to
/// statuses (`BadRequest`, `ErrorInfo`, `RetryInfo`), so that reflection clients can
/// decode them.
pub const ERROR_DETAILS_DESCRIPTOR_SET: &[u8] =
    include_bytes!(concat!(env!("OUT_DIR"), "/error_details_descriptor.bin"));

/// Fully-qualified gRPC service names, as health checks and reflection report them.
pub mod service_names {
    /// `agent.v1.AgentService`.
    pub const AGENT_SERVICE: &str = "agent.v1.AgentService";
    /// `agent.v1.AgentEngine`.
    pub const AGENT_ENGINE: &str = "agent.v1.AgentEngine";
    /// `agent.v1.ToolExecutor`.
    pub const TOOL_EXECUTOR: &str = "agent.v1.ToolExecutor";
}
