//! Limits and backpressure, each a setting: request sizes, message sizes, concurrent runs
//! per server and concurrent streams per connection. (The tool-output cut is tested in
//! the engine crate, where the exact text the model receives can be read.)

// Tests fail by panicking, with the value that was wrong.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::time::Duration;

use agentrt::v1::{
    self, agent_engine_client::AgentEngineClient, agent_service_client::AgentServiceClient,
};
use agentrt_test_support::{Server, agent_server_with_model, connect, simulator, tool_executor};
use tokio_stream::StreamExt;
use tonic::{Code, transport::Channel};
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
    service
        .create_agent_engine(v1::CreateAgentEngineRequest {
            config: Some(v1::AgentConfig {
                name: "limited".into(),
                model: Some(v1::ModelConfig {
                    name: model.into(),
                    ..Default::default()
                }),
                ..Default::default()
            }),
            session_id: String::new(),
        })
        .await
        .unwrap()
        .into_inner()
        .engine_id
}

fn message(role: v1::Role, content: &str) -> v1::ChatMessage {
    v1::ChatMessage {
        role: role.into(),
        content: content.into(),
        ..Default::default()
    }
}

async fn answer(engine: &mut AgentEngineClient<Channel>, request: v1::ExecuteRequest) -> String {
    let mut stream = engine.execute(request).await.unwrap().into_inner();
    let mut text = String::new();
    while let Some(event) = stream.next().await {
        let event = event.unwrap();
        if event.r#type == v1::EventType::FinalAnswer as i32 {
            text.push_str(&event.content);
        }
    }
    text
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
            "has 31 characters of content; at most 30 are accepted (runs.max_context_chars)",
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
        .execute(v1::ExecuteRequest {
            engine_id: engine_id.clone(),
            query: "q".repeat(5000),
            ..Default::default()
        })
        .await
        .unwrap_err();
    assert_eq!(status.code(), Code::OutOfRange, "{status:?}");
    assert!(
        status.message().contains("message length too large"),
        "{status:?}"
    );
    // The same connection still serves calls within the limit.
    let small = v1::ExecuteRequest {
        engine_id,
        query: "q".repeat(3000),
        ..Default::default()
    };
    assert_eq!(answer(&mut s.engine, small).await, "quick");
}

#[tokio::test]
async fn runs_beyond_the_limit_are_resource_exhausted_with_a_retry_hint() {
    let mut s = stack(&["--max-active-runs", "1"]).await;
    let slow = engine_for(&mut s.service, "slow").await;
    let quick = engine_for(&mut s.service, "quick").await;
    let mut running = s
        .engine
        .execute(v1::ExecuteRequest {
            engine_id: slow,
            query: "take your time".into(),
            ..Default::default()
        })
        .await
        .unwrap()
        .into_inner();
    let first = running.next().await.unwrap().unwrap();

    let status = s
        .engine
        .execute(v1::ExecuteRequest {
            engine_id: quick.clone(),
            query: "now".into(),
            ..Default::default()
        })
        .await
        .unwrap_err();
    assert_eq!(status.code(), Code::ResourceExhausted, "{status:?}");
    assert!(
        status.message().contains("already runs 1 runs"),
        "{status:?}"
    );
    let details = status.get_error_details();
    assert_eq!(details.error_info().unwrap().reason, "TOO_MANY_RUNS");
    assert!(details.retry_info().unwrap().retry_delay.is_some());

    // Nothing accepted is lost: the running run finishes, and then there is room again.
    let mut text = String::new();
    if first.r#type == v1::EventType::FinalAnswer as i32 {
        text.push_str(&first.content);
    }
    while let Some(event) = running.next().await {
        let event = event.unwrap();
        if event.r#type == v1::EventType::FinalAnswer as i32 {
            text.push_str(&event.content);
        }
    }
    assert_eq!(text, "a slow answer, one character at a time");
    let retried = v1::ExecuteRequest {
        engine_id: quick,
        query: "now".into(),
        ..Default::default()
    };
    assert_eq!(answer(&mut s.engine, retried).await, "quick");
}

#[tokio::test]
async fn streams_per_connection_are_capped_and_queue_until_one_ends() {
    let mut s = stack(&["--max-concurrent-streams", "1"]).await;
    let slow_id = engine_for(&mut s.service, "slow").await;
    let quick = engine_for(&mut s.service, "quick").await;
    let mut running = s
        .engine
        .execute(v1::ExecuteRequest {
            engine_id: slow_id.clone(),
            query: "take your time".into(),
            ..Default::default()
        })
        .await
        .unwrap()
        .into_inner();
    running.next().await.unwrap().unwrap();

    // The connection's only stream is taken: a second call on it waits...
    let mut engine = s.engine.clone();
    let queued = tokio::spawn(async move {
        answer(
            &mut engine,
            v1::ExecuteRequest {
                engine_id: quick,
                query: "queued".into(),
                ..Default::default()
            },
        )
        .await
    });
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
