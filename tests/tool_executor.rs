//! `agent.v1.ToolExecutor` over real gRPC against the real `tool-executor` binary.

// Tests fail by panicking, with the value that was wrong.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::time::{Duration, Instant};

use agentrt::{
    json::{json_to_struct, struct_to_json},
    v1::{self, tool_executor_client::ToolExecutorClient},
};
use agentrt_test_support::{connect, tool_executor};
use serde_json::json;
use tonic::{Code, transport::Channel};
use tonic_types::StatusExt;

async fn client() -> (agentrt_test_support::Server, ToolExecutorClient<Channel>) {
    let server = tool_executor(&[]).await;
    let client = ToolExecutorClient::new(connect(&server.url()).await);
    (server, client)
}

fn call(tool: &str, arguments: serde_json::Value) -> v1::ExecuteToolRequest {
    v1::ExecuteToolRequest {
        call_id: "call-1".into(),
        tool_name: tool.into(),
        arguments: json_to_struct(&arguments),
        run_id: "run-1".into(),
        session_id: "session-1".into(),
    }
}

#[tokio::test]
async fn list_tools_describes_every_builtin_with_its_schema() {
    let (_server, mut client) = client().await;
    let tools = client
        .list_tools(v1::ListToolsRequest {})
        .await
        .unwrap()
        .into_inner()
        .tools;
    let names: Vec<&str> = tools.iter().map(|t| t.name.as_str()).collect();
    assert_eq!(names, ["calculator", "current_time", "sleep"]);
    for tool in &tools {
        assert!(
            !tool.description.is_empty(),
            "{} has no description",
            tool.name
        );
        assert_eq!(tool.source, v1::ToolSource::Builtin as i32);
        let schema = struct_to_json(tool.input_schema.as_ref().unwrap());
        assert_eq!(schema["type"], "object", "{}", tool.name);
    }
    let calculator = struct_to_json(tools[0].input_schema.as_ref().unwrap());
    assert_eq!(calculator["required"], json!(["expression"]));
}

#[tokio::test]
async fn calculator_answers_and_reports_its_errors_as_results() {
    let (_server, mut client) = client().await;
    let out = client
        .execute_tool(call(
            "calculator",
            json!({"expression": "(2 + 3) * -4 ^ 2 / 8"}),
        ))
        .await
        .unwrap()
        .into_inner();
    assert_eq!(out.call_id, "call-1");
    assert!(!out.is_error, "{}", out.output);
    assert_eq!(out.output, "-10");
    assert!(out.duration.is_some());

    let out = client
        .execute_tool(call("calculator", json!({"expression": "1 / (3 - 3)"})))
        .await
        .unwrap()
        .into_inner();
    assert!(out.is_error);
    assert!(out.output.contains("division by zero"), "{}", out.output);

    let out = client
        .execute_tool(call("calculator", json!({"expression": "2 +* 3"})))
        .await
        .unwrap()
        .into_inner();
    assert!(out.is_error);
    assert!(
        out.output.contains("malformed expression"),
        "{}",
        out.output
    );
}

#[tokio::test]
async fn current_time_accepts_an_iana_zone() {
    let (_server, mut client) = client().await;
    let out = client
        .execute_tool(call(
            "current_time",
            json!({"timezone": "America/New_York"}),
        ))
        .await
        .unwrap()
        .into_inner();
    assert!(!out.is_error, "{}", out.output);
    let value = agentrt::json::value_to_json(out.structured_output.as_ref().unwrap());
    assert_eq!(value["timezone"], "America/New_York");
    assert!(out.output.contains("America/New_York"));
}

#[tokio::test]
async fn schema_violations_are_invalid_argument_with_field_violations() {
    let (_server, mut client) = client().await;
    let status = client
        .execute_tool(call(
            "calculator",
            json!({"expression": 42, "precision": 3}),
        ))
        .await
        .unwrap_err();
    assert_eq!(status.code(), Code::InvalidArgument);
    let bad_request = status
        .get_details_bad_request()
        .expect("BadRequest details");
    let fields: Vec<&str> = bad_request
        .field_violations
        .iter()
        .map(|v| v.field.as_str())
        .collect();
    assert!(fields.contains(&"arguments.expression"), "{fields:?}");
    assert!(
        fields.contains(&"arguments.precision"),
        "the unexpected property is named: {fields:?}"
    );
    assert!(
        status.message().contains("arguments.expression"),
        "{}",
        status.message()
    );

    let status = client
        .execute_tool(call("calculator", json!({})))
        .await
        .unwrap_err();
    assert_eq!(status.code(), Code::InvalidArgument);
    let violation = &status.get_details_bad_request().unwrap().field_violations[0];
    assert_eq!(violation.field, "arguments.expression");
    assert_eq!(violation.description, "required property is missing");
}

#[tokio::test]
async fn unknown_tools_and_missing_names_are_told_apart() {
    let (_server, mut client) = client().await;
    let status = client
        .execute_tool(call("teleport", json!({})))
        .await
        .unwrap_err();
    assert_eq!(status.code(), Code::NotFound);
    assert!(status.message().contains("teleport"));
    assert_eq!(
        status.get_details_error_info().unwrap().reason,
        "TOOL_NOT_FOUND"
    );

    let status = client.execute_tool(call("", json!({}))).await.unwrap_err();
    assert_eq!(status.code(), Code::InvalidArgument);
    assert_eq!(
        status.get_details_bad_request().unwrap().field_violations[0].field,
        "tool_name"
    );

    // Names and ids past 256 bytes are refused before anything runs, each named.
    let status = client
        .execute_tool(v1::ExecuteToolRequest {
            call_id: "c".repeat(300),
            ..call(&"t".repeat(1000), json!({}))
        })
        .await
        .unwrap_err();
    assert_eq!(status.code(), Code::InvalidArgument);
    assert!(status.message().len() < 1024, "{}", status.message());
    assert_eq!(violated_fields(&status), ["tool_name", "call_id"]);

    // A missing name and an id past its bound, both at once.
    let status = client
        .execute_tool(v1::ExecuteToolRequest {
            call_id: "c".repeat(300),
            ..call("", json!({}))
        })
        .await
        .unwrap_err();
    assert_eq!(
        violated_fields(&status),
        ["tool_name", "call_id"],
        "{status:?}"
    );
}

/// The fields a `BadRequest` in `status` names, in order.
fn violated_fields(status: &tonic::Status) -> Vec<String> {
    status
        .get_details_bad_request()
        .unwrap()
        .field_violations
        .iter()
        .map(|v| v.field.clone())
        .collect()
}

/// A client without a timer of its own: tonic's `Channel` also ends a call locally when its
/// `grpc-timeout` passes (as `CANCELLED`), racing the server's answer under load.
fn client_without_local_timeout(
    url: &str,
) -> ToolExecutorClient<
    hyper_util::client::legacy::Client<
        hyper_util::client::legacy::connect::HttpConnector,
        tonic::body::Body,
    >,
> {
    let http = hyper_util::client::legacy::Client::builder(hyper_util::rt::TokioExecutor::new())
        .http2_only(true)
        .build_http();
    ToolExecutorClient::with_origin(http, url.parse().unwrap())
}

#[tokio::test]
async fn the_deadline_bounds_the_call() {
    let (server, mut client) = client().await;
    let mut request = tonic::Request::new(call("sleep", json!({"seconds": 30})));
    request.set_timeout(Duration::from_millis(300));
    let started = Instant::now();
    let status = client_without_local_timeout(&server.url())
        .execute_tool(request)
        .await
        .unwrap_err();
    // The server itself answers, before the deadline.
    assert_eq!(status.code(), Code::DeadlineExceeded, "{status:?}");
    assert!(
        started.elapsed() < Duration::from_secs(5),
        "took {:?}",
        started.elapsed()
    );

    // The server is still fine afterwards, and a call within its deadline succeeds.
    let mut request = tonic::Request::new(call("sleep", json!({"seconds": 0.05})));
    request.set_timeout(Duration::from_secs(5));
    let out = client.execute_tool(request).await.unwrap().into_inner();
    assert!(!out.is_error, "{}", out.output);
}

/// SIGTERM gives calls in progress the drain grace: a call that finishes within it
/// answers as usual; one that would outlast it is stopped before the grace is over.
#[tokio::test]
async fn sigterm_lets_calls_in_progress_finish_within_the_grace() {
    let mut server = tool_executor(&["--drain-grace", "6s"]).await;
    let client = ToolExecutorClient::new(connect(&server.url()).await);
    let start = |seconds: f64| {
        let mut caller = client.clone();
        tokio::spawn(async move {
            caller
                .execute_tool(call("sleep", json!({"seconds": seconds})))
                .await
        })
    };
    let short = start(1.5);
    let long = start(60.0);
    tokio::time::sleep(Duration::from_millis(300)).await;
    let terminated = Instant::now();
    server.terminate();
    let out = short.await.unwrap().unwrap().into_inner();
    assert!(
        !out.is_error,
        "the call finished in the grace: {}",
        out.output
    );
    let stopped = long.await.unwrap();
    let elapsed = terminated.elapsed();
    assert!(
        elapsed >= Duration::from_secs(3) && elapsed < Duration::from_secs(6),
        "the long call was stopped within the grace, not at once: {elapsed:?}"
    );
    // Not the tool's failure: UNAVAILABLE, saying the call may have run, for the caller
    // to send again (with its call_id) to another tool executor.
    let status = stopped.unwrap_err();
    assert_eq!(status.code(), tonic::Code::Unavailable, "{status:?}");
    assert!(status.message().contains("shutting down"), "{status:?}");
    let details = tonic_types::StatusExt::get_error_details(&status);
    let info = details.error_info().expect("an ErrorInfo");
    assert_eq!(info.reason, "TOOL_EXECUTOR_DRAINING");
    assert_eq!(info.metadata["sent"], "true");
    assert!(server.wait(Duration::from_secs(20)).await.success());
}

#[tokio::test]
async fn a_cancelled_call_stops_its_work() {
    let (server, client) = client().await;
    let mut caller = client.clone();
    let call = tokio::spawn(async move {
        caller
            .execute_tool(call("sleep", json!({"seconds": 30})))
            .await
    });
    tokio::time::sleep(Duration::from_millis(300)).await;
    call.abort(); // drops the client's stream: the server sees the call cancelled
    let _ = call.await;
    // Draining finishes at once when nothing runs any more; a sleep still running would
    // hold the drain for the whole grace period.
    tokio::time::sleep(Duration::from_millis(200)).await;
    let mut server = server;
    server.terminate();
    let started = Instant::now();
    let status = server.wait(Duration::from_secs(20)).await;
    assert!(status.success(), "{status:?}");
    assert!(
        started.elapsed() < Duration::from_secs(3),
        "drain took {:?}",
        started.elapsed()
    );
}
