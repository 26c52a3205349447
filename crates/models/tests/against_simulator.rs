//! The OpenAI-compatible client against the simulator, over real HTTP and SSE.

#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::{
    sync::{
        Arc,
        atomic::{AtomicUsize, Ordering},
    },
    time::{Duration, Instant},
};

use agentrt_core::Secret;
use agentrt_models::{
    ChatDelta, ChatMessage, ChatModel, ChatRequest, FinishReason, ModelError, OpenAiChat,
    ProviderKind, ProviderSettings, RetryPolicy, ToolDefinition,
};
use futures_util::StreamExt;
use serde_json::json;
use tokio_util::sync::CancellationToken;

async fn simulator(scenarios: serde_json::Value) -> (String, CancellationToken) {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("http://{}/v1", listener.local_addr().unwrap());
    (url, serve_on(listener, scenarios))
}

/// Serves the simulator with `scenarios` on `listener` until the token is cancelled.
fn serve_on(listener: tokio::net::TcpListener, scenarios: serde_json::Value) -> CancellationToken {
    serve_with(listener, scenarios, None)
}

/// Serves the simulator with `scenarios` and at most `max_streams` concurrent HTTP/2
/// streams per connection.
fn serve_with(
    listener: tokio::net::TcpListener,
    scenarios: serde_json::Value,
    max_streams: Option<u32>,
) -> CancellationToken {
    let dir = std::env::temp_dir().join(format!(
        "agentrt-sim-{}-{}",
        std::process::id(),
        fastrand::u64(..)
    ));
    std::fs::create_dir_all(&dir).unwrap();
    let file = dir.join("scenarios.json");
    std::fs::write(&file, scenarios.to_string()).unwrap();
    let settings = agentrt_simulator::Settings {
        scenarios: Some(file),
        max_concurrent_streams: max_streams,
        ..Default::default()
    };
    let stop = CancellationToken::new();
    tokio::spawn(agentrt_simulator::serve(
        settings,
        listener,
        stop.clone().cancelled_owned(),
    ));
    stop
}

fn client(url: &str) -> OpenAiChat {
    client_with(url, false)
}

fn client_with(url: &str, http2_prior_knowledge: bool) -> OpenAiChat {
    let settings = ProviderSettings {
        kind: ProviderKind::Openai,
        base_url: url.into(),
        api_key: Secret::new("k"),
        api_key_env: None,
        http2_prior_knowledge,
    };
    let retry = RetryPolicy {
        max_retries: 3,
        base_delay: Duration::from_millis(10),
        max_delay: Duration::from_secs(2),
    };
    OpenAiChat::new(&settings, retry).unwrap()
}

fn request(model: &str) -> ChatRequest {
    ChatRequest {
        model: model.into(),
        messages: vec![ChatMessage::User("What is 6 * 7?".into())],
        tools: vec![ToolDefinition {
            name: "calculator".into(),
            description: "d".into(),
            parameters: json!({"type": "object"}).into(),
        }]
        .into(),
        ..Default::default()
    }
}

async fn collect(
    model: &OpenAiChat,
    req: ChatRequest,
) -> Result<Vec<Result<ChatDelta, ModelError>>, ModelError> {
    let stream = model.stream(req, CancellationToken::new()).await?;
    Ok(stream.collect().await)
}

#[tokio::test]
async fn demo_streams_reasoning_and_a_fragmented_tool_call() {
    for http2 in [false, true] {
        let (url, _stop) = simulator(json!({})).await;
        let deltas = collect(&client_with(&url, http2), request("demo"))
            .await
            .unwrap();
        demo_deltas_are_complete(deltas);
    }
}

fn demo_deltas_are_complete(deltas: Vec<Result<ChatDelta, ModelError>>) {
    let deltas: Vec<ChatDelta> = deltas.into_iter().map(Result::unwrap).collect();
    let reasoning: String = deltas
        .iter()
        .filter_map(|d| match d {
            ChatDelta::Reasoning(t) => Some(t.as_str()),
            _ => None,
        })
        .collect();
    assert_eq!(reasoning, "I should compute 6 * 7 with the calculator.");
    assert!(
        deltas
            .iter()
            .filter(|d| matches!(d, ChatDelta::Reasoning(_)))
            .count()
            > 1,
        "reasoning arrives in deltas"
    );
    let call = deltas
        .iter()
        .find_map(|d| match d {
            ChatDelta::ToolCall(c) => Some(c.clone()),
            _ => None,
        })
        .unwrap();
    assert_eq!(call.name, "calculator");
    assert_eq!(
        serde_json::from_str::<serde_json::Value>(&call.arguments).unwrap(),
        json!({"expression": "6 * 7"})
    );
    let ChatDelta::Finish { reason, usage } = deltas.last().unwrap() else {
        panic!("no finish")
    };
    assert_eq!(*reason, FinishReason::ToolCalls);
    assert!(usage.unwrap().prompt_tokens > 0);
}

#[tokio::test]
async fn transient_errors_are_retried_and_retry_after_is_honoured() {
    for http2 in [false, true] {
        transient_errors_are_retried_over(http2).await;
    }
}

async fn transient_errors_are_retried_over(http2: bool) {
    let (url, _stop) = simulator(json!({"scenarios": {
        "flaky": {"turns": [{"content": "ok", "error": {"status": 503, "message": "busy", "times": 2}}]},
        "limited": {"turns": [{"content": "ok", "error": {"status": 429, "message": "slow down", "times": 1, "retry_after": 0.3}}]},
        "broken": {"turns": [{"error": {"status": 400, "message": "bad request: messages is required"}}]}
    }})).await;
    let model = client_with(&url, http2);
    let deltas = collect(&model, request("flaky")).await.unwrap();
    assert_eq!(
        deltas[0].as_ref().unwrap(),
        &ChatDelta::Content("ok".into())
    );

    let started = Instant::now();
    collect(&model, request("limited")).await.unwrap();
    assert!(
        started.elapsed() >= Duration::from_millis(300),
        "Retry-After was not honoured: {:?}",
        started.elapsed()
    );

    let err = collect(&model, request("broken")).await.unwrap_err();
    assert_eq!(
        err,
        ModelError::Http {
            status: 400,
            message: "bad request: messages is required".into(),
            retry_after: None
        }
    );
}

#[tokio::test]
async fn broken_streams_end_with_an_error() {
    for http2 in [false, true] {
        broken_streams_end_with_an_error_over(http2).await;
    }
}

async fn broken_streams_end_with_an_error_over(http2: bool) {
    let (url, _stop) = simulator(json!({"scenarios": {
        "dropped": {"turns": [{"content": "a long answer that will not arrive whole", "chunk_chars": 4, "drop_after_chunks": 3}]},
        "garbage": {"turns": [{"content": "hello", "malformed": true}]},
        "abrupt": {"turns": [{"content": "no finish chunk", "omit_finish": true}]}
    }})).await;
    let model = client_with(&url, http2);
    let deltas = collect(&model, request("dropped")).await.unwrap();
    assert!(
        matches!(deltas.last().unwrap(), Err(ModelError::Stream(_))),
        "{deltas:?}"
    );
    let deltas = collect(&model, request("garbage")).await.unwrap();
    assert!(
        matches!(deltas.last().unwrap(), Err(ModelError::Stream(m)) if m.contains("invalid JSON")),
        "{deltas:?}"
    );
    let deltas = collect(&model, request("abrupt")).await.unwrap();
    assert!(
        matches!(
            deltas.last().unwrap(),
            Ok(ChatDelta::Finish {
                reason: FinishReason::Stop,
                ..
            })
        ),
        "{deltas:?}"
    );
}

#[tokio::test]
async fn cancellation_ends_a_retry_wait_at_once() {
    let (url, _stop) = simulator(json!({"scenarios": {
        "down": {"turns": [{"error": {"status": 503, "message": "down", "retry_after": 30}}]}
    }}))
    .await;
    let model = client(&url);
    let cancel = CancellationToken::new();
    let canceller = cancel.clone();
    tokio::spawn(async move {
        tokio::time::sleep(Duration::from_millis(200)).await;
        canceller.cancel();
    });
    let started = Instant::now();
    let err = model.stream(request("down"), cancel).await.err().unwrap();
    assert_eq!(err, ModelError::Cancelled);
    assert!(
        started.elapsed() < Duration::from_secs(1),
        "{:?}",
        started.elapsed()
    );
}

#[tokio::test]
async fn unreachable_providers_fail_with_a_connect_error() {
    let addr = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap();
    for http2 in [false, true] {
        let model = client_with(&format!("http://{addr}/v1"), http2);
        let err = collect(&model, request("demo")).await.unwrap_err();
        assert!(matches!(err, ModelError::Connect(_)), "{err:?}");
    }
}

/// Thousands of calls at once share the HTTP/2 connections and every one completes, also
/// when the server ends each response a little after `[DONE]`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn many_calls_share_http2_connections() {
    let (url, _stop) = simulator(json!({"scenarios": {
        "short": {"turns": [{"content": "forty-two", "chunk_chars": 3, "linger_ms": 20}]}
    }}))
    .await;
    let model = Arc::new(client_with(&url, true));
    let results: Vec<Result<String, ModelError>> = futures_util::stream::iter(0..6_000)
        .map(|_| {
            let model = model.clone();
            async move {
                let deltas = collect(&model, request("short")).await?;
                let mut text = String::new();
                for delta in deltas {
                    if let ChatDelta::Content(t) = delta? {
                        text.push_str(&t);
                    }
                }
                Ok(text)
            }
        })
        .buffer_unordered(3_000)
        .collect()
        .await;
    for result in results {
        assert_eq!(result.unwrap(), "forty-two");
    }
}

async fn answer(model: &OpenAiChat) -> String {
    let mut text = String::new();
    for delta in collect(model, request("short")).await.unwrap() {
        if let ChatDelta::Content(t) = delta.unwrap() {
            text.push_str(&t);
        }
    }
    text
}

/// The shared HTTP/2 connection is replaced when the server goes away: a call after a
/// restart of the server succeeds.
#[tokio::test]
async fn a_closed_http2_connection_is_replaced() {
    let scenarios = json!({"scenarios": {"short": {"turns": [{"content": "forty-two"}]}}});
    let (url, stop) = simulator(scenarios.clone()).await;
    let model = client_with(&url, true);
    assert_eq!(answer(&model).await, "forty-two");
    stop.cancel();
    let addr = url
        .trim_start_matches("http://")
        .trim_end_matches("/v1")
        .to_owned();
    // The old server closes its connections; a new one takes over the same port.
    let listener = loop {
        match tokio::net::TcpListener::bind(&addr).await {
            Ok(listener) => break listener,
            Err(_) => tokio::time::sleep(Duration::from_millis(10)).await,
        }
    };
    let _stop = serve_on(listener, scenarios);
    assert_eq!(answer(&model).await, "forty-two");
}

/// Over HTTP/2 the room of what was read is given back to the server in batches: answers
/// far larger than a stream's window (1 MiB), and together larger than the connection's
/// (64 MiB), still stream to their end, several at once on the shared connection.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn http2_answers_larger_than_the_flow_control_windows_stream_to_the_end() {
    let content = "0123456789abcdef".repeat(3 * 1024 * 1024 / 16);
    let (url, _stop) = simulator(json!({"scenarios": {
        "large": {"turns": [{"content": content, "chunk_chars": 1000}]}
    }}))
    .await;
    let model = Arc::new(client_with(&url, true));
    let calls = futures_util::stream::iter(0..24)
        .map(|_| {
            let model = model.clone();
            async move {
                let mut length = 0;
                for delta in collect(&model, request("large")).await? {
                    if let ChatDelta::Content(t) = delta? {
                        length += t.len();
                    }
                }
                Ok(length)
            }
        })
        .buffer_unordered(6)
        .collect::<Vec<Result<usize, ModelError>>>();
    let lengths = tokio::time::timeout(Duration::from_secs(60), calls)
        .await
        .expect("the answers stalled: read room is not given back to the server");
    for length in lengths {
        assert_eq!(length.unwrap(), content.len());
    }
}

/// Forwards the connections made to an address of its own to `target`, counting them;
/// those after the first `forwarded` are closed at once.
async fn counting_proxy(
    target: std::net::SocketAddr,
    forwarded: usize,
) -> (String, Arc<AtomicUsize>) {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("http://{}/v1", listener.local_addr().unwrap());
    let connections = Arc::new(AtomicUsize::new(0));
    let counted = connections.clone();
    tokio::spawn(async move {
        while let Ok((mut inbound, _)) = listener.accept().await {
            if counted.fetch_add(1, Ordering::SeqCst) >= forwarded {
                continue;
            }
            tokio::spawn(async move {
                if let Ok(mut outbound) = tokio::net::TcpStream::connect(target).await {
                    let _ = tokio::io::copy_bidirectional(&mut inbound, &mut outbound).await;
                }
            });
        }
    });
    (url, connections)
}

/// A server that takes few streams per connection (`SETTINGS_MAX_CONCURRENT_STREAMS`) gets
/// more connections, so that calls run at once instead of queueing behind each other.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn http2_calls_beyond_the_servers_stream_limit_open_more_connections() {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let target = listener.local_addr().unwrap();
    let scenarios = json!({"scenarios": {
        "slow": {"turns": [{"content": "forty-two", "latency_ms": 500}]}
    }});
    let _stop = serve_with(listener, scenarios, Some(4));
    let (url, connections) = counting_proxy(target, usize::MAX).await;
    let model = Arc::new(client_with(&url, true));
    let answers: Vec<String> = futures_util::stream::iter(0..40)
        .map(|_| {
            let model = model.clone();
            async move {
                let mut text = String::new();
                for delta in collect(&model, request("slow")).await.unwrap() {
                    if let ChatDelta::Content(t) = delta.unwrap() {
                        text.push_str(&t);
                    }
                }
                text
            }
        })
        .buffer_unordered(40)
        .collect()
        .await;
    assert!(answers.iter().all(|a| a == "forty-two"), "{answers:?}");
    // 40 calls at once, 4 streams per connection: 10 connections, none more.
    assert_eq!(connections.load(Ordering::SeqCst), 10);
}

/// A server that takes one connection only: opening a second one fails once, and calls go
/// on over the first without trying again at every call.
#[tokio::test]
async fn http2_calls_go_on_over_the_open_connection_when_another_cannot_be_opened() {
    let (url, _stop) = simulator(json!({"scenarios": {
        "short": {"turns": [{"content": "forty-two"}]}
    }}))
    .await;
    let target = url
        .trim_start_matches("http://")
        .trim_end_matches("/v1")
        .parse()
        .unwrap();
    let (url, connections) = counting_proxy(target, 1).await;
    let model = client_with(&url, true);
    for _ in 0..5 {
        assert_eq!(answer(&model).await, "forty-two");
    }
    assert_eq!(
        connections.load(Ordering::SeqCst),
        2,
        "one connection, one refused, and no other attempt within the backoff"
    );
}
