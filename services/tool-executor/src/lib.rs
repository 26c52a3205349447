//! The tool-executor service: `agent.v1.ToolExecutor` over a tool [`Catalogue`]: the
//! built-in tools, MCP servers' tools and OpenAPI documents' operations.
//!
//! [`serve`] is the whole server; `main.rs` only parses settings, starts logging, binds
//! and calls it, so tests and the local stack run exactly what production runs.

mod service;
mod settings;

use std::{future::Future, sync::Arc};

use agentrt::service_names;
use agentrt_grpc::{GrpcServer, ServerError};
use agentrt_tools::{
    Catalogue, Changes, Toolset, builtin::Builtins, mcp::McpToolset, openapi::OpenApiToolset,
};
use tokio::net::TcpListener;
use tokio_util::sync::CancellationToken;
use tonic::service::Routes;

pub use settings::{Cli, Settings};

/// Why the server could not start or stopped with an error.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// A tool source could not be set up, or two tools share a name.
    #[error(transparent)]
    Tools(#[from] agentrt_tools::Error),
    /// The gRPC server failed.
    #[error(transparent)]
    Server(#[from] ServerError),
}

/// Builds the catalogue the settings describe: built-ins, OpenAPI documents, and MCP
/// servers (started together, each waited for at most its `connect_timeout`). A clash of
/// names is an error naming both tools; MCP servers already started are stopped then.
pub async fn catalogue(settings: &Settings, changes: Changes) -> Result<Catalogue, Error> {
    let mut toolsets: Vec<Arc<dyn Toolset>> =
        vec![Arc::new(Builtins::named(&settings.builtin_tools)?)];
    for source in &settings.openapi {
        toolsets.push(Arc::new(OpenApiToolset::load(source)?));
    }
    let started = futures_util::future::join_all(
        settings
            .mcp_servers
            .iter()
            .map(|server| McpToolset::start(server.clone(), changes.clone())),
    )
    .await;
    let mut failed = None;
    for toolset in started {
        match toolset {
            Ok(toolset) => toolsets.push(Arc::new(toolset)),
            Err(error) => failed = failed.or(Some(error)),
        }
    }
    if let Some(error) = failed {
        stop_all(&toolsets).await;
        return Err(error.into());
    }
    match Catalogue::new(toolsets.clone(), changes).await {
        Ok(catalogue) => Ok(catalogue),
        Err(error) => {
            stop_all(&toolsets).await;
            Err(error.into())
        }
    }
}

async fn stop_all(toolsets: &[Arc<dyn Toolset>]) {
    futures_util::future::join_all(toolsets.iter().map(|t| t.shutdown())).await;
}

/// How long before the end of the drain grace calls still running are told to stop (at
/// most a quarter of the grace), so that their answers go out within it.
const CALL_STOP_MARGIN: std::time::Duration = std::time::Duration::from_secs(2);

/// Serves `ToolExecutor` on `listener` until `shutdown` resolves, then drains.
pub async fn serve(
    settings: Settings,
    listener: TcpListener,
    shutdown: impl Future<Output = ()>,
) -> Result<(), Error> {
    agentrt_metrics::Metrics::serve_as(agentrt_metrics::Role::ToolExecutor);
    let changes = Changes::new();
    let catalogue = Arc::new(catalogue(&settings, changes).await?);
    // Refreshes the catalogue when a source's tools change, until the server has drained.
    let stop = CancellationToken::new();
    let refresher = tokio::spawn({
        let catalogue = catalogue.clone();
        let stop = stop.clone();
        async move { catalogue.keep_fresh(stop).await }
    });
    let drain = CancellationToken::new();
    // Calls in progress get the drain grace to finish; those still running then are told
    // to stop, leaving the rest of the grace for their answers to go out.
    let stop_calls = CancellationToken::new();
    let grace = settings.server.drain_grace;
    let stopper = tokio::spawn({
        let drain = drain.clone();
        let stop_calls = stop_calls.clone();
        async move {
            drain.cancelled().await;
            tokio::time::sleep(grace.saturating_sub((grace / 4).min(CALL_STOP_MARGIN))).await;
            stop_calls.cancel();
        }
    });
    let max = settings.server.max_message_bytes;
    let service = service::ToolExecutorService::new(catalogue.clone(), stop_calls, max);
    let routes = Routes::new(
        agentrt::v1::tool_executor_server::ToolExecutorServer::new(service)
            .max_decoding_message_size(max)
            // Answers: the catalogue, bounded on its own (see `list_tools`), and tool
            // outputs, bounded by `max_output_bytes`.
            .max_encoding_message_size(max.max(agentrt_grpc::MAX_CATALOGUE_BYTES)),
    );
    let served = GrpcServer::new("tool-executor", settings.server)
        .reporting(service_names::TOOL_EXECUTOR)
        .serve(routes, listener, shutdown, drain)
        .await;
    // Drained (or failed): stop the refresher, then MCP servers' child processes.
    stopper.abort();
    stop.cancel();
    let _ = refresher.await;
    catalogue.shutdown().await;
    served?;
    Ok(())
}
