//! agent-server's connections to the tool executor (`tool_executor_connections`,
//! `server.max_connection_age`): tool calls take several connections in turn, so that a load
//! balancer that spreads connections spreads the calls; a tool executor that ages its
//! connections out (GOAWAY) loses no call; a tool executor restarted while a run calls it
//! runs the call once it is back. A TCP relay written here counts the connections. Needs
//! nothing beyond the workspace's binaries.

// Tests fail by panicking, with the value that was wrong.
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use std::{
    sync::{
        Arc,
        atomic::{AtomicUsize, Ordering},
    },
    time::Duration,
};

use agentrt::v1::{self, EventType};
use agentrt_test_support::{Server, agent_server_with_model, connect, simulator, tool_executor};
use common::{agent, collect, create_engine, data, done, kind};
use tokio::net::{TcpListener, TcpStream};

const SCENARIOS: &str = r#"{"scenarios": {
  "four": {"turns": [
    {"tool_calls": [
      {"name": "calculator", "arguments": {"expression": "1 + 1"}},
      {"name": "calculator", "arguments": {"expression": "2 + 2"}},
      {"name": "calculator", "arguments": {"expression": "3 + 3"}},
      {"name": "calculator", "arguments": {"expression": "4 + 4"}}]},
    {"content": "sums: {tool_results}"}]},
  "nap": {"turns": [
    {"tool_calls": [{"name": "sleep", "arguments": {"seconds": 1}}]},
    {"content": "rested: {tool_results}"}]},
  "long_nap": {"turns": [
    {"tool_calls": [{"name": "sleep", "arguments": {"seconds": 3}}]},
    {"content": "rested: {tool_results}"}]}
}}"#;

/// A TCP relay to `target` that counts the connections it accepts.
async fn relay(target: std::net::SocketAddr) -> (String, Arc<AtomicUsize>) {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("http://{}", listener.local_addr().unwrap());
    let accepted = Arc::new(AtomicUsize::new(0));
    let counter = accepted.clone();
    tokio::spawn(async move {
        while let Ok((mut inbound, _)) = listener.accept().await {
            counter.fetch_add(1, Ordering::SeqCst);
            tokio::spawn(async move {
                if let Ok(mut outbound) = TcpStream::connect(target).await {
                    let _ = tokio::io::copy_bidirectional(&mut inbound, &mut outbound).await;
                }
            });
        }
    });
    (url, accepted)
}

/// An agent (on a session of its own) of `scenario`, offered `tools`.
async fn engine_of(agents: &Server, scenario: &str, tools: &[&str]) -> String {
    let mut service =
        v1::agent_service_client::AgentServiceClient::new(connect(&agents.url()).await);
    create_engine(&mut service, agent(scenario, tools)).await
}

/// An agent (on a session of its own) whose run makes four tool calls at once.
async fn four_calls(agents: &Server) -> String {
    engine_of(agents, "four", &["calculator"]).await
}

/// Runs an agent of its own once and checks that its four tool calls all ran.
async fn run_four(agents: &Server) {
    let engine_id = four_calls(agents).await;
    run(agents, engine_id).await;
}

/// Runs `engine_id` once and checks that its four tool calls all ran.
async fn run(agents: &Server, engine_id: String) {
    run_making(agents, engine_id, 4).await;
}

/// Runs `engine_id` once and checks that its `calls` tool calls all ran and that it
/// answered.
async fn run_making(agents: &Server, engine_id: String, calls: usize) {
    let mut engine = v1::agent_engine_client::AgentEngineClient::new(connect(&agents.url()).await);
    let stream = engine
        .execute(v1::ExecuteRequest {
            engine_id,
            query: "go".into(),
            ..Default::default()
        })
        .await
        .unwrap()
        .into_inner();
    let events = collect(stream).await;
    let results: Vec<_> = events
        .iter()
        .filter(|e| kind(e) == EventType::ToolResult)
        .map(data)
        .collect();
    assert_eq!(results.len(), calls, "{events:#?}");
    for result in &results {
        assert_eq!(result["is_error"], false, "a tool call failed: {result}");
    }
    assert_eq!(done(&events)["stop_reason"], "final_answer", "{events:#?}");
}

/// A stack whose tool executor asks connections to go after 1 s, reached through a
/// counting relay by an agent-server with `connections` connections to it; checks that
/// the first run's calls took every connection, then runs four runs at a time for 3.5 s
/// and checks that every call ran and that the connections were replaced.
async fn calls_survive_connections_aging_out(connections: usize) {
    let model = simulator(SCENARIOS, &[]).await;
    let tools = tool_executor(&["--max-connection-age", "1s"]).await;
    let (tools_url, accepted) = relay(tools.addr).await;
    let agents = agent_server_with_model(
        &tools_url,
        &format!("{}/v1", model.url()),
        &["--tool-executor-connections", &connections.to_string()],
    )
    .await;
    // Engine creation lists the tools on one connection; the run's four calls take the
    // connections in turn.
    run_four(&agents).await;
    let first = accepted.load(Ordering::SeqCst);
    assert!(
        first >= connections,
        "tool calls went over {first} connection(s), not the {connections} configured"
    );

    // For 3.5 s the tool executor asks each connection to go after 1 s, while runs keep
    // calling it (four runs at once): every call still runs, on new connections.
    let until = tokio::time::Instant::now() + Duration::from_millis(3500);
    while tokio::time::Instant::now() < until {
        tokio::join!(
            run_four(&agents),
            run_four(&agents),
            run_four(&agents),
            run_four(&agents)
        );
    }
    let total = accepted.load(Ordering::SeqCst);
    assert!(
        total >= first + connections,
        "connections older than 1s were not replaced: {first} before, {total} after 3.5 s"
    );
}

#[tokio::test]
async fn calls_spread_over_the_connections_and_none_is_lost_when_connections_age_out() {
    calls_survive_connections_aging_out(3).await;
}

#[tokio::test]
async fn over_one_connection_no_call_is_lost_when_it_ages_out() {
    calls_survive_connections_aging_out(1).await;
}

#[tokio::test]
async fn a_call_made_while_the_tool_executor_restarts_runs_once_it_is_back() {
    let model = simulator(SCENARIOS, &[]).await;
    let tools = tool_executor(&[]).await;
    let addr = tools.addr;
    let agents = agent_server_with_model(&tools.url(), &format!("{}/v1", model.url()), &[]).await;
    run_four(&agents).await;
    let engine_id = four_calls(&agents).await;

    // The tool executor goes away; its replacement comes up on the same address 700 ms
    // later, within agent-server's `tool_executor_timeout` (5 s by default).
    drop(tools);
    let listen = addr.to_string();
    let restart = tokio::spawn(async move {
        tokio::time::sleep(Duration::from_millis(700)).await;
        agentrt_test_support::Server::start("tool-executor", &["--listen", &listen], &[]).await
    });
    run(&agents, engine_id).await;
    drop(restart.await.unwrap());
}

/// Runs `scenario` (one `sleep` call) on an agent-server started with `args`, killing its
/// tool executor `dies_after` into the run and starting another on the same address
/// `back_after` later: the call must go again, once, with its call_id, and the run end
/// with its result.
async fn a_call_survives_its_tool_executor(
    scenario: &str,
    args: &[&str],
    dies_after: Duration,
    back_after: Duration,
) {
    let model = simulator(SCENARIOS, &[]).await;
    let tools = tool_executor(&[]).await;
    let listen = tools.addr.to_string();
    let agents = agent_server_with_model(&tools.url(), &format!("{}/v1", model.url()), args).await;
    let engine_id = engine_of(&agents, scenario, &["sleep"]).await;
    let restart = tokio::spawn(async move {
        tokio::time::sleep(dies_after).await;
        drop(tools);
        tokio::time::sleep(back_after).await;
        Server::start("tool-executor", &["--listen", &listen], &[]).await
    });
    run_making(&agents, engine_id, 1).await;
    drop(restart.await.unwrap());
}

#[tokio::test]
async fn a_call_in_flight_when_the_tool_executor_dies_goes_again_to_its_replacement() {
    // Killed while a 1 s call runs, back 300 ms later (the run ended with "Unknown:
    // transport error" given to the model).
    a_call_survives_its_tool_executor(
        "nap",
        &[],
        Duration::from_millis(400),
        Duration::from_millis(300),
    )
    .await;
}

#[tokio::test]
async fn a_call_that_ran_past_the_tool_executor_timeout_before_it_died_goes_again_too() {
    // The time the tool executor may take to come back counts from the call's loss, not
    // from its start: killed 1.5 s into a 3 s call, past agent-server's
    // `tool_executor_timeout` of 1 s, and back 300 ms later (the call failed: its
    // unreachable time had run out before it was lost).
    a_call_survives_its_tool_executor(
        "long_nap",
        &["--tool-executor-timeout", "1s"],
        Duration::from_millis(1500),
        Duration::from_millis(300),
    )
    .await;
}

/// A tool executor that shuts down (SIGTERM) stops a call that would outlast its drain
/// grace and answers `UNAVAILABLE` (`TOOL_EXECUTOR_DRAINING`): the call goes again, with
/// its call_id, to the tool executor that replaces it, and the model reads its result
/// (it read "the tool executor is shutting down" as the tool's failure).
#[tokio::test]
async fn a_call_stopped_by_the_tool_executors_drain_goes_again_to_its_replacement() {
    let model = simulator(SCENARIOS, &[]).await;
    let mut tools = Server::start("tool-executor", &["--drain-grace", "1s"], &[]).await;
    let listen = tools.addr.to_string();
    let agents = agent_server_with_model(&tools.url(), &format!("{}/v1", model.url()), &[]).await;
    let engine_id = engine_of(&agents, "long_nap", &["sleep"]).await;
    let restart = tokio::spawn(async move {
        tokio::time::sleep(Duration::from_millis(500)).await;
        tools.terminate();
        assert!(tools.wait(Duration::from_secs(10)).await.success());
        Server::start("tool-executor", &["--listen", &listen], &[]).await
    });
    run_making(&agents, engine_id, 1).await;
    drop(restart.await.unwrap());
}

#[tokio::test]
async fn a_connection_count_out_of_range_is_refused_at_start() {
    for count in ["0", "65"] {
        let out = tokio::process::Command::new(agentrt_test_support::binary("agent-server"))
            .args([
                "--listen",
                "127.0.0.1:0",
                "--tool-executor-connections",
                count,
            ])
            .output()
            .await
            .unwrap();
        assert!(!out.status.success(), "{count} connections must not start");
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(
            stderr.contains("tool_executor_connections") && stderr.contains("between 1 and 64"),
            "{count}: {stderr}"
        );
    }
}
