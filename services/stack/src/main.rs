//! `agent-stack`: the tool executor and the agent server in one process, on embedded
//! in-memory defaults, for trying the runtime locally. Ctrl-C stops both.

use std::{net::SocketAddr, path::PathBuf};

use agentrt_grpc::config::parse_listen;
use anyhow::Context;
use clap::Parser;
use tokio_util::sync::CancellationToken;

/// Starts the whole stack locally.
#[derive(Debug, Parser)]
#[command(name = "agent-stack", version, about)]
struct Cli {
    /// Address of the agent server (AgentService, AgentEngine).
    #[arg(
        long,
        env = "AGENT_STACK_LISTEN",
        default_value = "127.0.0.1:50051",
        value_parser = parse_listen
    )]
    listen: SocketAddr,
    /// Address of the tool executor.
    #[arg(
        long,
        env = "AGENT_STACK_TOOL_EXECUTOR_LISTEN",
        default_value = "127.0.0.1:50052",
        value_parser = parse_listen
    )]
    tool_executor_listen: SocketAddr,
    /// Address of the model simulator, started when neither OPENAI_BASE_URL nor OPENAI_API_KEY
    /// is set (either one registers the provider `openai` instead).
    #[arg(
        long,
        env = "AGENT_STACK_SIMULATOR_LISTEN",
        default_value = "127.0.0.1:50053",
        value_parser = parse_listen
    )]
    simulator_listen: SocketAddr,
    /// A tool-executor config file (TOML) whose tool sources (`mcp_servers`, `openapi`)
    /// the tool executor serves beside its built-ins, e.g. `examples/tool-sources.toml`.
    #[arg(long, env = "AGENT_STACK_TOOL_CONFIG", value_name = "FILE")]
    tool_config: Option<PathBuf>,
    /// A scenarios file (JSON, or TOML when its name ends in `.toml`) the model simulator
    /// plays beside its `demo` model (see "Scripting the simulator" in the README).
    #[arg(long, env = "AGENT_STACK_SCENARIOS", value_name = "FILE")]
    scenarios: Option<PathBuf>,
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let cli = Cli::parse();
    let _telemetry = agentrt_telemetry::init("agent-stack").map_err(anyhow::Error::msg)?;
    // Before binding: a Ctrl-C while starting must still stop everything cleanly.
    let first_signal = agentrt_grpc::shutdown::signal();

    let tools_listener = tokio::net::TcpListener::bind(cli.tool_executor_listen)
        .await
        .with_context(|| format!("cannot listen on {}", cli.tool_executor_listen))?;
    let agents_listener = tokio::net::TcpListener::bind(cli.listen)
        .await
        .with_context(|| format!("cannot listen on {}", cli.listen))?;
    // With no model endpoint configured, the simulator stands in for one.
    // Set but empty counts as unset, as agent-server reads them.
    let unset = |name: &str| std::env::var_os(name).is_none_or(|v| v.is_empty());
    let simulator = if unset("OPENAI_BASE_URL") && unset("OPENAI_API_KEY") {
        let listener = tokio::net::TcpListener::bind(cli.simulator_listen)
            .await
            .with_context(|| format!("cannot listen on {}", cli.simulator_listen))?;
        Some(listener)
    } else {
        if cli.scenarios.is_some() {
            anyhow::bail!(
                "--scenarios scripts the built-in model simulator, which does not start when \
                 OPENAI_BASE_URL or OPENAI_API_KEY is set: unset them, or leave --scenarios out"
            );
        }
        None
    };
    let tools_addr = tools_listener.local_addr()?;
    let agents_addr = agents_listener.local_addr()?;

    let mut tools_settings = match &cli.tool_config {
        // Read as the tool executor reads its `--config`: paths relative to the file.
        Some(path) => agentrt_tool_executor::Cli {
            common: agentrt_grpc::config::CommonArgs {
                config: Some(path.clone()),
                ..Default::default()
            },
            ..Default::default()
        }
        .settings()
        .with_context(|| format!("tool config {}", path.display()))?,
        None => agentrt_tool_executor::Settings::default(),
    };
    tools_settings.server.listen = tools_addr;
    let mut agent_settings = agentrt_agent_server::Settings::default();
    if let Some(listener) = &simulator {
        agent_settings.providers.insert(
            "openai".into(),
            agentrt_models::ProviderSettings {
                kind: agentrt_models::ProviderKind::Openai,
                base_url: format!("http://{}/v1", listener.local_addr()?),
                api_key: agentrt_core::Secret::default(),
                api_key_env: None,
                api_key_header: None,
                http2_prior_knowledge: true,
                http_client: agentrt_models::HttpClient::Lean,
            },
        );
    }
    agent_settings.server.listen = agents_addr;
    agent_settings.tool_executor = format!("http://{tools_addr}");
    let providers = agentrt_agent_server::providers(&agent_settings)?;
    let provider_line = match providers
        .default_provider()
        .and_then(|name| providers.get(name).map(|p| (name, p)))
    {
        Some((name, p)) if simulator.is_some() => format!(
            "model provider: {name} at {} (the built-in simulator; model \"demo\")",
            p.base_url
        ),
        Some((name, p)) => format!("model provider: {name} at {}", p.base_url),
        None => {
            "model provider: none (set OPENAI_BASE_URL and/or OPENAI_API_KEY to register `openai`)"
                .to_owned()
        }
    };

    println!("agent stack is up:");
    println!("  agent-server  (AgentService, AgentEngine)  {agents_addr}");
    println!("  tool-executor (ToolExecutor)               {tools_addr}");
    println!("  {provider_line}");
    println!("try:");
    println!("  grpcurl -plaintext {agents_addr} list");
    println!(
        "  grpcurl -plaintext -d '{{\"tool_name\": \"calculator\", \"arguments\": {{\"expression\": \"2 ^ 10\"}}}}' {tools_addr} agent.v1.ToolExecutor/ExecuteTool"
    );
    println!("press Ctrl-C to stop");

    let stop = CancellationToken::new();
    let signal = {
        let stop = stop.clone();
        async move {
            first_signal.await;
            stop.cancel();
        }
    };
    // Whichever server stops first, for a signal or a failure, stops the other.
    let tools = async {
        let result = agentrt_tool_executor::serve(
            tools_settings,
            tools_listener,
            stop.clone().cancelled_owned(),
        )
        .await;
        stop.cancel();
        result
    };
    let agents = async {
        let result = agentrt_agent_server::serve(
            agent_settings,
            agents_listener,
            stop.clone().cancelled_owned(),
        )
        .await;
        stop.cancel();
        result
    };
    let models = async {
        match simulator {
            Some(listener) => {
                let result = agentrt_simulator::serve(
                    agentrt_simulator::Settings {
                        scenarios: cli.scenarios.clone(),
                        ..agentrt_simulator::Settings::default()
                    },
                    listener,
                    stop.clone().cancelled_owned(),
                )
                .await;
                stop.cancel();
                result.map_err(anyhow::Error::from)
            }
            None => Ok(()),
        }
    };
    let (tools, agents, models, ()) = tokio::join!(tools, agents, models, async {
        tokio::select! {
            () = signal => {}
            () = stop.cancelled() => {}
        }
    });
    tools.context("tool-executor failed")?;
    agents.context("agent-server failed")?;
    models.context("model simulator failed")?;
    println!("agent stack stopped");
    Ok(())
}
