//! Distributed traces: both binaries export spans over OTLP to a receiver in this test
//! process, and one trace runs from the client's `traceparent` through agent-server's
//! call, run, model call and tool call into tool-executor, with the model's HTTP request
//! carrying the trace context too. Message contents stay out unless enabled.

// Tests fail by panicking, with the value that was wrong.
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use std::{
    sync::{Arc, Mutex},
    time::Duration,
};

use agentrt::v1::{
    self, agent_engine_client::AgentEngineClient, agent_service_client::AgentServiceClient,
};
use agentrt_test_support::{Server, connect, simulator};
use common::{calculator_agent, create_engine};
use opentelemetry_proto::tonic::{
    collector::trace::v1::{
        ExportTraceServiceRequest, ExportTraceServiceResponse,
        trace_service_server::{TraceService, TraceServiceServer},
    },
    common::v1::{AnyValue, KeyValue, any_value},
    trace::v1::{Span, span::SpanKind},
};
use tokio_stream::StreamExt;
use tonic::{Request, Response, Status};

const SCENARIOS: &str = r#"{"scenarios": {
  "adder": {"turns": [
    {"tool_calls": [{"name": "calculator", "arguments": {"expression": "20 + 22"}}]},
    {"content": "got {tool_results}"}]}
}}"#;

const TRACE_ID: &str = "4bf92f3577b34da6a3ce929d0e0e4736";
const CLIENT_SPAN_ID: &str = "00f067aa0ba902b7";

/// An OTLP/gRPC trace receiver keeping every span with its service's name.
#[derive(Clone, Default)]
struct Receiver {
    spans: Arc<Mutex<Vec<(String, Span)>>>,
}

#[tonic::async_trait]
impl TraceService for Receiver {
    async fn export(
        &self,
        request: Request<ExportTraceServiceRequest>,
    ) -> Result<Response<ExportTraceServiceResponse>, Status> {
        let mut spans = self.spans.lock().unwrap();
        for resource_spans in request.into_inner().resource_spans {
            let service = resource_spans
                .resource
                .as_ref()
                .and_then(|r| text(&r.attributes, "service.name"))
                .unwrap_or_default();
            for scope in resource_spans.scope_spans {
                spans.extend(scope.spans.into_iter().map(|s| (service.clone(), s)));
            }
        }
        Ok(Response::new(ExportTraceServiceResponse {
            partial_success: None,
        }))
    }
}

fn text(attributes: &[KeyValue], key: &str) -> Option<String> {
    attributes
        .iter()
        .find(|kv| kv.key == key)
        .and_then(|kv| kv.value.as_ref())
        .map(|value: &AnyValue| match &value.value {
            Some(any_value::Value::StringValue(s)) => s.clone(),
            Some(any_value::Value::IntValue(i)) => i.to_string(),
            other => format!("{other:?}"),
        })
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

async fn receiver() -> (Receiver, String) {
    let receiver = Receiver::default();
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let service = TraceServiceServer::new(receiver.clone());
    tokio::spawn(
        tonic::transport::Server::builder()
            .add_service(service)
            .serve_with_incoming(tonic::transport::server::TcpIncoming::from(listener)),
    );
    (receiver, format!("http://{addr}"))
}

/// Finds the span named `name` of `service`.
fn find<'a>(spans: &'a [(String, Span)], service: &str, name: &str) -> Option<&'a Span> {
    spans
        .iter()
        .find(|(s, span)| s == service && span.name == name)
        .map(|(_, span)| span)
}

#[tokio::test]
async fn one_trace_spans_client_agent_server_model_call_and_tool_executor() {
    let (receiver, endpoint) = receiver().await;
    let otel = [
        ("OTEL_EXPORTER_OTLP_ENDPOINT", endpoint.as_str()),
        ("OTEL_BSP_SCHEDULE_DELAY", "100"),
    ];
    let model = simulator(SCENARIOS, &[]).await;
    let tools = Server::start("tool-executor", &["--listen", "127.0.0.1:0"], &otel).await;
    let model_url = format!("{}/v1", model.url());
    let agents = Server::start(
        "agent-server",
        &["--listen", "127.0.0.1:0", "--tool-executor", &tools.url()],
        &[
            otel[0],
            otel[1],
            ("OPENAI_BASE_URL", &model_url),
            ("OPENAI_API_KEY", "test-key"),
        ],
    )
    .await;

    let channel = connect(&agents.url()).await;
    let engine_id = create_engine(
        &mut AgentServiceClient::new(channel.clone()),
        calculator_agent("tracer", "adder"),
    )
    .await;
    let mut request = Request::new(v1::ExecuteRequest {
        engine_id,
        query: "secret question: add".into(),
        ..Default::default()
    });
    request.metadata_mut().insert(
        "traceparent",
        format!("00-{TRACE_ID}-{CLIENT_SPAN_ID}-01")
            .parse()
            .unwrap(),
    );
    let mut events = AgentEngineClient::new(channel)
        .execute(request)
        .await
        .unwrap()
        .into_inner();
    while let Some(event) = events.next().await {
        assert_ne!(event.unwrap().r#type, v1::EventType::Error as i32);
    }

    // Spans are exported in batches every 100 ms, and a span is exported when it ends: the
    // `Execute` span ends after the run's, when its response stream is dropped, so it can come
    // in a later batch. Wait for every span the test reads.
    const EXPECTED: [(&str, &str); 6] = [
        ("agent-server", "agent.v1.AgentEngine/Execute"),
        ("agent-server", "invoke_agent tracer"),
        ("agent-server", "chat adder"),
        ("agent-server", "execute_tool calculator"),
        ("tool-executor", "agent.v1.ToolExecutor/ExecuteTool"),
        ("tool-executor", "execute_tool"),
    ];
    let mut spans = Vec::new();
    for _ in 0..100 {
        spans = receiver.spans.lock().unwrap().clone();
        if EXPECTED
            .iter()
            .all(|(service, name)| find(&spans, service, name).is_some())
        {
            break;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let names: Vec<(String, String)> = spans
        .iter()
        .map(|(s, span)| (s.clone(), span.name.clone()))
        .collect();
    let span = |service: &str, name: &str| {
        find(&spans, service, name)
            .unwrap_or_else(|| panic!("no span {name:?} from {service}; got {names:?}"))
    };
    let execute = span("agent-server", "agent.v1.AgentEngine/Execute");
    let run = span("agent-server", "invoke_agent tracer");
    let chat = span("agent-server", "chat adder");
    let tool_call = span("agent-server", "execute_tool calculator");
    let tool_rpc = span("tool-executor", "agent.v1.ToolExecutor/ExecuteTool");
    let tool_run = span("tool-executor", "execute_tool");

    for (name, s) in [
        ("Execute", execute),
        ("invoke_agent", run),
        ("chat", chat),
        ("execute_tool", tool_call),
        ("ExecuteTool", tool_rpc),
        ("tool-executor execute_tool", tool_run),
    ] {
        assert_eq!(
            hex(&s.trace_id),
            TRACE_ID,
            "{name} is in the client's trace"
        );
    }
    let parent_of = |child: &Span, parent: &Span| {
        assert_eq!(
            hex(&child.parent_span_id),
            hex(&parent.span_id),
            "{} must be a child of {}",
            child.name,
            parent.name
        );
    };
    assert_eq!(hex(&execute.parent_span_id), CLIENT_SPAN_ID);
    assert_eq!(execute.kind, SpanKind::Server as i32);
    parent_of(run, execute);
    parent_of(chat, run);
    parent_of(tool_call, run);
    parent_of(tool_rpc, tool_call);
    parent_of(tool_run, tool_rpc);
    assert_eq!(tool_rpc.kind, SpanKind::Server as i32);
    assert_eq!(chat.kind, SpanKind::Client as i32);

    // GenAI attributes.
    assert_eq!(
        text(&run.attributes, "gen_ai.operation.name").as_deref(),
        Some("invoke_agent")
    );
    assert_eq!(
        text(&chat.attributes, "gen_ai.request.model").as_deref(),
        Some("adder")
    );
    assert_eq!(
        text(&chat.attributes, "gen_ai.system").as_deref(),
        Some("openai")
    );
    assert!(text(&chat.attributes, "gen_ai.usage.input_tokens").is_some());
    assert!(text(&chat.attributes, "gen_ai.usage.output_tokens").is_some());
    assert_eq!(
        text(&tool_call.attributes, "gen_ai.tool.name").as_deref(),
        Some("calculator")
    );
    assert!(text(&tool_call.attributes, "gen_ai.tool.call.id").is_some());

    // Contents stay out by default.
    for (_, s) in &spans {
        for kv in &s.attributes {
            assert!(
                !matches!(
                    kv.key.as_str(),
                    "gen_ai.input.messages" | "gen_ai.tool.call.arguments"
                ),
                "{} recorded {}",
                s.name,
                kv.key
            );
            let value = text(&s.attributes, &kv.key).unwrap_or_default();
            assert!(
                !value.contains("secret question"),
                "{} leaked the query",
                s.name
            );
            assert!(
                !value.contains("20 + 22"),
                "{} leaked tool arguments",
                s.name
            );
        }
    }

    // The model's HTTP requests carried the trace context of their `chat` spans.
    let logs = model.logs();
    let carried: Vec<&str> = logs
        .lines()
        .filter_map(|l| l.split("traceparent=").nth(1))
        .filter_map(|rest| rest.split_whitespace().next())
        .collect();
    assert_eq!(carried.len(), 2, "two model calls: {logs}");
    let chat_spans: Vec<String> = spans
        .iter()
        .filter(|(_, s)| s.name == "chat adder")
        .map(|(_, s)| hex(&s.span_id))
        .collect();
    for traceparent in carried {
        let parts: Vec<&str> = traceparent.trim_matches('"').split('-').collect();
        assert_eq!(parts[1], TRACE_ID, "{traceparent}");
        assert!(chat_spans.iter().any(|id| id == parts[2]), "{traceparent}");
    }
}
