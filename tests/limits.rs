//! Limits and backpressure, each a setting: request sizes, message sizes, concurrent runs
//! per server and concurrent streams per connection. (The tool-output cut is tested in
//! the engine crate, where the exact text the model receives can be read.)

// Tests fail by panicking, with the value that was wrong.
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use std::time::Duration;

use agentrt::v1::{
    self, agent_engine_client::AgentEngineClient, agent_service_client::AgentServiceClient,
};
use agentrt_test_support::{Server, agent_server_with_model, connect, simulator, tool_executor};
use common::{calculator_agent, create_engine};
use tokio_stream::StreamExt;
use tonic::{Code, Streaming, transport::Channel};
use tonic_types::StatusExt;

const SCENARIOS: &str = r#"{"scenarios": {
  "slow": {"turns": [{"content": "a slow answer, one character at a time", "chunk_chars": 1, "chunk_delay_ms": 100}]},
  "quick": {"turns": [{"content": "quick"}]}
}}"#;

struct Stack {
    _model: Server,
    _tools: Server,
    agents: Server,
    service: AgentServiceClient<Channel>,
    engine: AgentEngineClient<Channel>,
}

async fn stack(args: &[&str]) -> Stack {
    let model = simulator(SCENARIOS, &[]).await;
    let tools = tool_executor(&[]).await;
    let agents = agent_server_with_model(&tools.url(), &format!("{}/v1", model.url()), args).await;
    let channel = connect(&agents.url()).await;
    Stack {
        _model: model,
        _tools: tools,
        agents,
        service: AgentServiceClient::new(channel.clone()),
        engine: AgentEngineClient::new(channel),
    }
}

async fn engine_for(service: &mut AgentServiceClient<Channel>, model: &str) -> String {
    let config = v1::AgentConfig {
        tools: Vec::new(),
        ..calculator_agent("limited", model)
    };
    create_engine(service, config).await
}

fn message(role: v1::Role, content: &str) -> v1::ChatMessage {
    v1::ChatMessage {
        role: role.into(),
        content: content.into(),
        ..Default::default()
    }
}

fn execute(engine_id: &str, query: &str) -> v1::ExecuteRequest {
    v1::ExecuteRequest {
        engine_id: engine_id.into(),
        query: query.into(),
        ..Default::default()
    }
}

/// The answer text of `events`, from `first` (already read, if any) to the end.
async fn final_text(
    first: Option<v1::AgentStreamEvent>,
    mut events: Streaming<v1::AgentStreamEvent>,
) -> String {
    let mut text = String::new();
    let mut next = first;
    loop {
        if let Some(event) = next.take()
            && event.r#type == v1::EventType::FinalAnswer as i32
        {
            text.push_str(&event.content);
        }
        match events.next().await {
            Some(event) => next = Some(event.unwrap()),
            None => return text,
        }
    }
}

async fn answer(engine: &mut AgentEngineClient<Channel>, request: v1::ExecuteRequest) -> String {
    final_text(None, engine.execute(request).await.unwrap().into_inner()).await
}

/// Starts the run and waits for its first event, so that it surely holds its slot.
async fn start_slow(
    engine: &mut AgentEngineClient<Channel>,
    engine_id: &str,
) -> (v1::AgentStreamEvent, Streaming<v1::AgentStreamEvent>) {
    start(engine, execute(engine_id, "take your time")).await
}

/// Starts `request`: its first event and the rest of its stream.
async fn start(
    engine: &mut AgentEngineClient<Channel>,
    request: v1::ExecuteRequest,
) -> (v1::AgentStreamEvent, Streaming<v1::AgentStreamEvent>) {
    let mut running = engine.execute(request).await.unwrap().into_inner();
    let first = running.next().await.unwrap().unwrap();
    (first, running)
}

#[tokio::test]
async fn queries_and_contexts_beyond_their_limits_are_invalid_argument() {
    let mut s = stack(&[
        "--max-query-chars",
        "20",
        "--max-context-messages",
        "2",
        "--max-context-chars",
        "30",
    ])
    .await;
    let engine_id = engine_for(&mut s.service, "quick").await;
    let request = |query: &str, context: Vec<v1::ChatMessage>| v1::ExecuteRequest {
        engine_id: engine_id.clone(),
        query: query.into(),
        llm_context: context,
        ..Default::default()
    };

    // At the limits, runs go ahead.
    let at_limits = request(
        &"q".repeat(20),
        vec![
            message(v1::Role::User, &"u".repeat(15)),
            message(v1::Role::Assistant, &"a".repeat(15)),
        ],
    );
    assert_eq!(answer(&mut s.engine, at_limits).await, "quick");

    let cases = [
        (
            request(&"q".repeat(21), vec![]),
            "query",
            "must be at most 20 characters (runs.max_query_chars)",
        ),
        (
            request("hi", vec![message(v1::Role::User, "x"); 3]),
            "llm_context",
            "has 3 messages; at most 2 are accepted (runs.max_context_messages)",
        ),
        (
            request(
                "hi",
                vec![
                    message(v1::Role::User, &"u".repeat(16)),
                    message(v1::Role::Assistant, &"a".repeat(15)),
                ],
            ),
            "llm_context",
            "has 31 characters of content and tool calls; at most 30 are accepted \
             (runs.max_context_chars)",
        ),
    ];
    for (request, field, description) in cases {
        let status = s.engine.execute(request).await.unwrap_err();
        assert_eq!(status.code(), Code::InvalidArgument, "{status:?}");
        let bad_request = status.get_details_bad_request().unwrap();
        assert_eq!(bad_request.field_violations.len(), 1, "{bad_request:?}");
        assert_eq!(bad_request.field_violations[0].field, field);
        assert_eq!(bad_request.field_violations[0].description, description);
    }
}

#[tokio::test]
async fn messages_beyond_the_size_limit_are_refused_and_the_server_goes_on() {
    let mut s = stack(&["--max-message-bytes", "4096"]).await;
    let engine_id = engine_for(&mut s.service, "quick").await;
    let status = s
        .engine
        .execute(execute(&engine_id, &"q".repeat(5000)))
        .await
        .unwrap_err();
    // gRPC's code for a message larger than the limit, naming the setting and the sizes.
    assert_eq!(status.code(), Code::ResourceExhausted, "{status:?}");
    assert!(
        status.message().contains("server.max_message_bytes")
            && status.message().contains("the limit is: 4096 bytes"),
        "{status:?}"
    );
    assert_eq!(
        status.get_details_error_info().unwrap().reason,
        "MESSAGE_TOO_LARGE",
        "{status:?}"
    );
    // The same connection still serves calls within the limit.
    let small = execute(&engine_id, &"q".repeat(3000));
    assert_eq!(answer(&mut s.engine, small).await, "quick");
}

#[tokio::test]
async fn runs_beyond_the_limit_are_resource_exhausted_with_a_retry_hint() {
    let mut s = stack(&["--max-active-runs", "1"]).await;
    let slow = engine_for(&mut s.service, "slow").await;
    let quick = engine_for(&mut s.service, "quick").await;
    let (first, running) = start_slow(&mut s.engine, &slow).await;

    let status = s.engine.execute(execute(&quick, "now")).await.unwrap_err();
    assert_eq!(status.code(), Code::ResourceExhausted, "{status:?}");
    assert!(
        status.message().contains("already runs 1 runs"),
        "{status:?}"
    );
    let details = status.get_error_details();
    assert_eq!(details.error_info().unwrap().reason, "TOO_MANY_RUNS");
    assert!(details.retry_info().unwrap().retry_delay.is_some());

    // Nothing accepted is lost: the running run finishes, and then there is room again.
    assert_eq!(
        final_text(Some(first), running).await,
        "a slow answer, one character at a time"
    );
    assert_eq!(answer(&mut s.engine, execute(&quick, "now")).await, "quick");
}

/// A retry of a run (its message id again) takes no room of `runs.max_active`: with no
/// room left, it still gets its run back rather than `RESOURCE_EXHAUSTED`.
#[tokio::test]
async fn a_retry_gets_its_run_back_when_no_room_is_left() {
    let mut s = stack(&["--max-active-runs", "1"]).await;
    let slow = engine_for(&mut s.service, "slow").await;
    let request = v1::ExecuteRequest {
        message_id: "order-17".into(),
        ..execute(&slow, "take your time")
    };
    let (first, running) = start(&mut s.engine, request.clone()).await;
    // The same key with another query is another request: refused as such, not for room.
    let status = s
        .engine
        .execute(v1::ExecuteRequest {
            query: "something else".into(),
            ..request.clone()
        })
        .await
        .unwrap_err();
    assert_eq!(status.code(), Code::AlreadyExists, "{status:?}");
    let (again, retried) = start(&mut s.engine, request).await;
    assert_eq!(again.run_id, first.run_id, "the same run");
    assert_eq!(
        final_text(Some(again), retried).await,
        "a slow answer, one character at a time"
    );
    drop(running);
}

#[tokio::test]
async fn streams_per_connection_are_capped_and_queue_until_one_ends() {
    let mut s = stack(&["--max-concurrent-streams", "1"]).await;
    let slow_id = engine_for(&mut s.service, "slow").await;
    let quick = engine_for(&mut s.service, "quick").await;
    let (_, running) = start_slow(&mut s.engine, &slow_id).await;

    // The connection's only stream is taken: a second call on it waits...
    let mut engine = s.engine.clone();
    let queued = tokio::spawn(async move { answer(&mut engine, execute(&quick, "queued")).await });
    tokio::time::sleep(Duration::from_millis(500)).await;
    assert!(!queued.is_finished(), "the second stream must wait");
    // ... while another connection is served at once.
    let mut other = AgentServiceClient::new(connect(&s.agents.url()).await);
    other
        .get_agent_engine(v1::GetAgentEngineRequest {
            engine_id: slow_id.clone(),
        })
        .await
        .unwrap();

    // Ending the first stream lets the queued call through.
    drop(running);
    let text = tokio::time::timeout(Duration::from_secs(10), queued)
        .await
        .expect("the queued call proceeds once the stream is free")
        .unwrap();
    assert_eq!(text, "quick");
}
