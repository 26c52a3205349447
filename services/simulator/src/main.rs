//! `model-simulator`: parses settings, starts logging, binds and serves.

use agentrt_simulator::Cli;
use anyhow::Context;

/// mimalloc: the system allocator took a third of the simulator's CPU under load, and
/// the simulator shares the machine with the servers it feeds.
#[global_allocator]
static ALLOCATOR: mimalloc::MiMalloc = mimalloc::MiMalloc;

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let cli: Cli = agentrt_grpc::config::parse_cli(Cli::ENV_PREFIX);
    let settings = cli.settings();
    let _telemetry = agentrt_telemetry::init("model-simulator").map_err(anyhow::Error::msg)?;
    // Before binding: a signal that arrives while starting must still drain and exit.
    let shutdown = agentrt_grpc::shutdown::signal();
    let listener = tokio::net::TcpListener::bind(settings.listen)
        .await
        .with_context(|| format!("cannot listen on {}", settings.listen))?;
    agentrt_simulator::serve(settings, listener, shutdown).await?;
    Ok(())
}
