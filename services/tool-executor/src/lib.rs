//! The tool-executor service: `agent.v1.ToolExecutor` over a [`ToolRegistry`].
//!
//! [`serve`] is the whole server; `main.rs` only parses settings, starts logging, binds
//! and calls it, so tests and the local stack run exactly what production runs.

mod service;
mod settings;

use std::{future::Future, sync::Arc};

use agentrt::service_names;
use agentrt_server::{GrpcServer, ServerError};
use agentrt_tools::{ToolRegistry, builtin};
use tokio::net::TcpListener;
use tokio_util::sync::CancellationToken;
use tonic::service::Routes;

pub use settings::{Cli, Settings};

/// Why the server could not start or stopped with an error.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// The settings name a built-in tool that does not exist.
    #[error("unknown built-in tool {0:?} (known: {known})", known = builtin::NAMES.join(", "))]
    UnknownBuiltin(String),
    /// A tool could not be registered.
    #[error(transparent)]
    Registry(#[from] agentrt_tools::RegistryError),
    /// The gRPC server failed.
    #[error(transparent)]
    Server(#[from] ServerError),
}

/// Builds the tool registry the settings describe.
pub fn registry(settings: &Settings) -> Result<ToolRegistry, Error> {
    let mut registry = ToolRegistry::new();
    for name in &settings.builtin_tools {
        let tool = builtin::by_name(name).ok_or_else(|| Error::UnknownBuiltin(name.clone()))?;
        registry.register(tool)?;
    }
    Ok(registry)
}

/// Serves `ToolExecutor` on `listener` until `shutdown` resolves, then drains.
pub async fn serve(
    settings: Settings,
    listener: TcpListener,
    shutdown: impl Future<Output = ()>,
) -> Result<(), Error> {
    let registry = Arc::new(registry(&settings)?);
    let drain = CancellationToken::new();
    let service = service::ToolExecutorService::new(registry, drain.clone());
    let max = settings.server.max_message_bytes;
    let routes = Routes::new(
        agentrt::v1::tool_executor_server::ToolExecutorServer::new(service)
            .max_decoding_message_size(max)
            .max_encoding_message_size(max),
    );
    GrpcServer::new("tool-executor", settings.server)
        .reporting(service_names::TOOL_EXECUTOR)
        .serve(routes, listener, shutdown, drain)
        .await?;
    Ok(())
}
