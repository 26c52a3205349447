//! Prometheus metrics: both binaries serve `/metrics` on their admin port, and a
//! tool-using run shows up there (RPCs, runs, model calls, tokens, tool calls, bus reads).

// Tests fail by panicking, with the value that was wrong.
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use std::net::SocketAddr;

use agentrt::v1::{
    self, agent_engine_client::AgentEngineClient, agent_service_client::AgentServiceClient,
};
use agentrt_test_support::{agent_server_with_model, connect, simulator, tool_executor};
use common::{calculator_agent, create_engine};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio_stream::StreamExt;

/// `GET path` over HTTP/1.1: the status line and the body.
async fn get(addr: SocketAddr, path: &str) -> (String, String) {
    let mut stream = tokio::net::TcpStream::connect(addr).await.unwrap();
    stream
        .write_all(
            format!("GET {path} HTTP/1.1\r\nHost: test\r\nConnection: close\r\n\r\n").as_bytes(),
        )
        .await
        .unwrap();
    let mut response = String::new();
    stream.read_to_string(&mut response).await.unwrap();
    let (head, body) = response.split_once("\r\n\r\n").unwrap();
    (head.to_owned(), body.to_owned())
}

/// The value of the sample `name{labels}` (labels as the exposition writes them).
fn sample(text: &str, series: &str) -> f64 {
    text.lines()
        .find_map(|line| line.strip_prefix(series)?.trim().parse().ok())
        .unwrap_or_else(|| panic!("no sample {series} in:\n{text}"))
}

#[tokio::test]
async fn a_tool_using_run_shows_up_in_both_servers_metrics() {
    let model = simulator("{}", &[]).await;
    let tools = tool_executor(&["--metrics-listen", "127.0.0.1:0"]).await;
    let agents = agent_server_with_model(
        &tools.url(),
        &format!("{}/v1", model.url()),
        &["--metrics-listen", "127.0.0.1:0"],
    )
    .await;
    let channel = connect(&agents.url()).await;
    let engine_id = create_engine(
        &mut AgentServiceClient::new(channel.clone()),
        calculator_agent("metered", "demo"),
    )
    .await;
    let mut stream = AgentEngineClient::new(channel)
        .execute(v1::ExecuteRequest {
            engine_id,
            query: "What is 6 * 7?".into(),
            ..Default::default()
        })
        .await
        .unwrap()
        .into_inner();
    let mut last = None;
    while let Some(event) = stream.next().await {
        last = Some(event.unwrap());
    }
    let last = last.unwrap();
    assert!(
        last.done && last.r#type == v1::EventType::FinalAnswer as i32,
        "{last:?}"
    );
    // A call that fails, to see an error code counted.
    let missing = AgentServiceClient::new(connect(&agents.url()).await)
        .get_agent_engine(v1::GetAgentEngineRequest {
            engine_id: "no-such-engine".into(),
        })
        .await;
    assert_eq!(missing.unwrap_err().code(), tonic::Code::NotFound);

    let (head, text) = get(agents.logged_addr("metrics_addr").await, "/metrics").await;
    assert!(head.starts_with("HTTP/1.1 200"), "{head}");
    // The text is OpenMetrics (counters typed without `_total`, samples with it, `# EOF`),
    // and says so: served as the classic format, parsers typed the counters wrongly.
    assert!(
        head.to_ascii_lowercase()
            .contains("content-type: application/openmetrics-text; version=1.0.0; charset=utf-8"),
        "{head}"
    );
    assert!(text.ends_with("# EOF\n"), "{text}");
    let rpc = |method: &str, code: &str| {
        sample(
            &text,
            &format!(
                r#"agentrt_grpc_server_handled_total{{grpc_service="agent.v1.{method}",grpc_code="{code}"}}"#
            ),
        )
    };
    assert_eq!(rpc(r#"AgentEngine",grpc_method="Execute"#, "OK"), 1.0);
    assert_eq!(
        rpc(r#"AgentService",grpc_method="CreateAgentEngine"#, "OK"),
        1.0
    );
    assert_eq!(
        rpc(r#"AgentService",grpc_method="GetAgentEngine"#, "NOT_FOUND"),
        1.0
    );
    assert!(text.contains(r#"agentrt_grpc_server_handling_seconds_count{grpc_service="agent.v1.AgentEngine",grpc_method="Execute"} 1"#), "{text}");
    assert_eq!(
        sample(
            &text,
            r#"agentrt_runs_finished_total{stop_reason="final_answer"}"#
        ),
        1.0
    );
    assert_eq!(sample(&text, "agentrt_runs_active"), 0.0);
    assert_eq!(
        sample(
            &text,
            r#"agentrt_model_request_seconds_count{model="demo",outcome="ok"}"#
        ),
        2.0
    );
    assert_eq!(
        sample(
            &text,
            r#"agentrt_model_time_to_first_token_seconds_count{model="demo"}"#
        ),
        2.0
    );
    assert!(
        sample(
            &text,
            r#"agentrt_model_tokens_total{model="demo",type="output"}"#
        ) > 0.0
    );
    assert_eq!(
        sample(
            &text,
            r#"agentrt_tool_calls_total{tool="calculator",outcome="ok"}"#
        ),
        1.0
    );
    assert!(sample(&text, "agentrt_event_bus_reader_lag_events_count") >= 1.0);
    assert_eq!(sample(&text, "agentrt_event_bus_lagged_total"), 0.0);

    let (_, text) = get(tools.logged_addr("metrics_addr").await, "/metrics").await;
    assert!(
        sample(
            &text,
            r#"agentrt_grpc_server_handled_total{grpc_service="agent.v1.ToolExecutor",grpc_method="ExecuteTool",grpc_code="OK"}"#
        ) >= 1.0
    );
    assert_eq!(
        sample(
            &text,
            r#"agentrt_tool_calls_total{tool="calculator",outcome="ok"}"#
        ),
        1.0
    );

    // The tool executor has no runs, models or event bus: it does not show their metrics.
    for agent_only in [
        "agentrt_runs_",
        "agentrt_model_",
        "agentrt_event_bus_",
        "lease",
    ] {
        assert!(!text.contains(agent_only), "{agent_only} in:\n{text}");
    }

    let (status, _) = get(tools.logged_addr("metrics_addr").await, "/other").await;
    assert!(status.contains("404"), "{status}");
}

/// Calls to paths the server did not register, even rejected ones, cannot grow the
/// metrics: they count under one `unknown` label (with tokens on, as an attacker without a
/// token would send them).
#[tokio::test]
async fn unregistered_paths_cannot_grow_the_metrics() {
    let tools = agentrt_test_support::Server::start(
        "tool-executor",
        &["--listen", "127.0.0.1:0", "--metrics-listen", "127.0.0.1:0"],
        &[(
            "TOOL_EXECUTOR_AUTH_TOKENS",
            "tool-token-0123456789 agent.v1.ToolExecutor",
        )],
    )
    .await;
    let metrics = tools.logged_addr("metrics_addr").await;
    let channel = connect(&tools.url()).await;
    let mut grpc = tonic::client::Grpc::new(channel);
    for i in 0..300 {
        grpc.ready().await.unwrap();
        let path: http::uri::PathAndQuery =
            format!("/attack.Service{i}/Method{i}").parse().unwrap();
        let status = grpc
            .unary::<_, v1::ListToolsResponse, _>(
                tonic::Request::new(v1::ListToolsRequest {}),
                path,
                tonic_prost::ProstCodec::default(),
            )
            .await
            .unwrap_err();
        assert_eq!(status.code(), tonic::Code::Unauthenticated);
    }
    let (_, text) = get(metrics, "/metrics").await;
    assert!(
        !text.contains("attack."),
        "a client-chosen path became a label"
    );
    assert_eq!(
        sample(
            &text,
            r#"agentrt_grpc_server_handled_total{grpc_service="unknown",grpc_method="unknown",grpc_code="UNAUTHENTICATED"}"#
        ),
        300.0
    );
}

/// Tool calls that end without finishing are counted too, by how they ended: one whose
/// deadline passed (`timeout`), one past its source's own `timeout` (an API that never
/// answers: `timeout` as well, not `error`) and one whose caller went away (`cancelled`).
#[tokio::test]
async fn tool_calls_that_time_out_or_are_cancelled_are_counted() {
    // An API that takes connections (the listener's backlog) and never answers.
    let silent = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let dir = std::env::temp_dir().join(format!(
        "agentrt-metrics-timeout-{}-{}",
        std::process::id(),
        silent.local_addr().unwrap().port()
    ));
    std::fs::create_dir_all(&dir).unwrap();
    std::fs::write(
        dir.join("api.json"),
        r#"{"openapi": "3.1.0", "paths": {"/slow": {"get": {"operationId": "slow"}}}}"#,
    )
    .unwrap();
    let config = dir.join("tool-executor.toml");
    std::fs::write(
        &config,
        format!(
            "[[openapi]]\nname = \"api\"\nspec = \"api.json\"\nbase_url = \"http://{}\"\n\
             timeout = \"300ms\"\n",
            silent.local_addr().unwrap()
        ),
    )
    .unwrap();
    let tools = tool_executor(&[
        "--metrics-listen",
        "127.0.0.1:0",
        "--config",
        config.to_str().unwrap(),
    ])
    .await;
    let mut client = v1::tool_executor_client::ToolExecutorClient::new(connect(&tools.url()).await);
    let nap = || v1::ExecuteToolRequest {
        call_id: "nap".into(),
        tool_name: "sleep".into(),
        arguments: agentrt::json::json_to_struct(&serde_json::json!({"seconds": 5})),
        ..Default::default()
    };
    let mut timed = tonic::Request::new(nap());
    timed.set_timeout(std::time::Duration::from_millis(300));
    let status = client.execute_tool(timed).await.unwrap_err();
    assert_eq!(status.code(), tonic::Code::DeadlineExceeded, "{status:?}");
    let unanswered = client
        .execute_tool(v1::ExecuteToolRequest {
            call_id: "slow".into(),
            tool_name: "api__slow".into(),
            ..Default::default()
        })
        .await
        .unwrap()
        .into_inner();
    assert!(
        unanswered.is_error && unanswered.output.contains("did not answer within 300ms"),
        "{unanswered:?}"
    );
    // The caller goes away 300 ms into the call.
    let mut cancelled = client.clone();
    let _ = tokio::time::timeout(
        std::time::Duration::from_millis(300),
        cancelled.execute_tool(nap()),
    )
    .await;
    let addr = tools.logged_addr("metrics_addr").await;
    let mut text = String::new();
    for _ in 0..50 {
        text = get(addr, "/metrics").await.1;
        if text.contains(r#"tool="sleep",outcome="cancelled""#) {
            break;
        }
        tokio::time::sleep(std::time::Duration::from_millis(50)).await;
    }
    for outcome in ["timeout", "cancelled"] {
        assert_eq!(
            sample(
                &text,
                &format!(r#"agentrt_tool_calls_total{{tool="sleep",outcome="{outcome}"}}"#)
            ),
            1.0,
            "{outcome}"
        );
    }
    assert_eq!(
        sample(
            &text,
            r#"agentrt_tool_calls_total{tool="api__slow",outcome="timeout"}"#
        ),
        1.0,
        "{text}"
    );
    drop(silent);
    let _ = std::fs::remove_dir_all(&dir);
}
