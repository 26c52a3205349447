//! `agent-stack`: the tool executor and the agent server in one process, on embedded
//! in-memory defaults, for trying the runtime locally. Ctrl-C stops both.

use std::net::SocketAddr;

use anyhow::Context;
use clap::Parser;
use tokio_util::sync::CancellationToken;

/// Starts the whole stack locally.
#[derive(Debug, Parser)]
#[command(name = "agent-stack", version, about)]
struct Cli {
    /// Address of the agent server (AgentService, AgentEngine).
    #[arg(long, env = "AGENT_STACK_LISTEN", default_value = "127.0.0.1:50051")]
    listen: SocketAddr,
    /// Address of the tool executor.
    #[arg(
        long,
        env = "AGENT_STACK_TOOL_EXECUTOR_LISTEN",
        default_value = "127.0.0.1:50052"
    )]
    tool_executor_listen: SocketAddr,
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let cli = Cli::parse();
    agentrt_telemetry::init().map_err(anyhow::Error::msg)?;

    let tools_listener = tokio::net::TcpListener::bind(cli.tool_executor_listen)
        .await
        .with_context(|| format!("cannot listen on {}", cli.tool_executor_listen))?;
    let agents_listener = tokio::net::TcpListener::bind(cli.listen)
        .await
        .with_context(|| format!("cannot listen on {}", cli.listen))?;
    let tools_addr = tools_listener.local_addr()?;
    let agents_addr = agents_listener.local_addr()?;

    let mut tools_settings = agentrt_tool_executor::Settings::default();
    tools_settings.server.listen = tools_addr;
    let mut agent_settings = agentrt_agent_server::Settings::default();
    agent_settings.server.listen = agents_addr;
    agent_settings.tool_executor = format!("http://{tools_addr}");
    let providers = agentrt_agent_server::providers(&agent_settings)?;
    let provider_line = match providers
        .default_provider()
        .and_then(|name| providers.get(name).map(|p| (name, p)))
    {
        Some((name, p)) => format!("model provider: {name} at {}", p.base_url),
        None => {
            "model provider: none (set OPENAI_BASE_URL and OPENAI_API_KEY to register `openai`)"
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
            agentrt_server::shutdown::signal().await;
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
    let (tools, agents, ()) = tokio::join!(tools, agents, async {
        tokio::select! {
            () = signal => {}
            () = stop.cancelled() => {}
        }
    });
    tools.context("tool-executor failed")?;
    agents.context("agent-server failed")?;
    println!("agent stack stopped");
    Ok(())
}
