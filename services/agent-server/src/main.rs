//! `agent-server`: parses settings, starts logging, binds and serves.

use agentrt_agent_server::Cli;
use anyhow::Context;

/// mimalloc: per-thread free lists keep allocation cheap on the event path, and freed
/// memory goes back to the OS instead of piling up in per-thread arenas.
#[cfg(not(feature = "system-allocator"))]
#[global_allocator]
static ALLOCATOR: mimalloc::MiMalloc = mimalloc::MiMalloc;

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let cli: Cli = agentrt_grpc::config::parse_cli(Cli::ENV_PREFIX);
    let mut settings = cli.settings()?;
    if cli.common.print_config {
        // Show the providers the environment registers too, with keys masked.
        settings.providers = agentrt_agent_server::providers(&settings)?
            .settings()
            .clone();
        print!("{}", agentrt_grpc::config::to_toml(&settings));
        return Ok(());
    }
    let _telemetry = agentrt_telemetry::init("agent-server").map_err(anyhow::Error::msg)?;
    // Before binding: a signal that arrives while starting must still drain and exit.
    let shutdown = agentrt_grpc::shutdown::signal();
    let listener = tokio::net::TcpListener::bind(settings.server.listen)
        .await
        .with_context(|| format!("cannot listen on {}", settings.server.listen))?;
    agentrt_agent_server::serve(settings, listener, shutdown).await?;
    Ok(())
}
