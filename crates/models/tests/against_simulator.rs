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
    ChatDelta, ChatMessage, ChatModel, ChatRequest, FinishReason, HttpClient, ModelError,
    OpenAiChat, ProviderKind, ProviderSettings, RetryPolicy, ToolDefinition,
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
    client_of(url, http2_prior_knowledge, HttpClient::Lean)
}

fn client_of(url: &str, http2_prior_knowledge: bool, http_client: HttpClient) -> OpenAiChat {
    let settings = ProviderSettings {
        kind: ProviderKind::Openai,
        base_url: url.into(),
        api_key: Secret::new("k"),
        api_key_env: None,
        api_key_header: None,
        http2_prior_knowledge,
        http_client,
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
    // HTTP/1.1, the lean h2c client, and the general client with HTTP/2 prior knowledge
    // (`http_client = "general"`).
    for (http2, http_client) in [
        (false, HttpClient::Lean),
        (true, HttpClient::Lean),
        (true, HttpClient::General),
    ] {
        let (url, _stop) = simulator(json!({})).await;
        let deltas = collect(&client_of(&url, http2, http_client), request("demo"))
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
        "dropped_at_once": {"turns": [{"content": "never sent", "drop_after_chunks": 0}]},
        "garbage": {"turns": [{"content": "hello", "malformed": true}]},
        "abrupt": {"turns": [{"content": "no finish chunk", "omit_finish": true}]}
    }})).await;
    let model = client_with(&url, http2);
    let deltas = collect(&model, request("dropped")).await.unwrap();
    assert!(
        matches!(deltas.last().unwrap(), Err(ModelError::Lost(_))),
        "{deltas:?}"
    );
    // Lost before the first delta: nothing streamed, so it is retried, and in the end
    // reported as transient.
    let err = collect(&model, request("dropped_at_once"))
        .await
        .unwrap_err();
    assert!(
        matches!(&err, ModelError::LostBeforeAnswer(m) if m.contains("lost before the answer began")),
        "{err:?}"
    );
    assert!(err.is_retryable());
    let deltas = collect(&model, request("garbage")).await.unwrap();
    assert!(
        matches!(deltas.last().unwrap(), Err(ModelError::Stream(m)) if m.contains("invalid JSON")),
        "{deltas:?}"
    );
    // No finish reason and no `[DONE]`: not an answer (it used to end as `Stop`).
    let deltas = collect(&model, request("abrupt")).await.unwrap();
    assert!(
        matches!(deltas.last().unwrap(), Err(ModelError::Incomplete(_))),
        "{deltas:?}"
    );
}

#[tokio::test]
async fn cancellation_ends_a_retry_wait_at_once() {
    // A wait the policy allows (at most 2 s here; a longer one is not waited at all).
    let (url, _stop) = simulator(json!({"scenarios": {
        "down": {"turns": [{"error": {"status": 503, "message": "down", "retry_after": 1.5}}]}
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
async fn a_retry_that_would_pass_the_deadline_is_not_waited_for() {
    let (url, _stop) = simulator(json!({"scenarios": {
        "limited": {"turns": [{"error": {"status": 429, "message": "slow down", "retry_after": 1.5}}]}
    }}))
    .await;
    let model = client(&url);
    let started = Instant::now();
    let req = ChatRequest {
        deadline: Some(tokio::time::Instant::now() + Duration::from_secs(1)),
        ..request("limited")
    };
    let err = model
        .stream(req, CancellationToken::new())
        .await
        .err()
        .unwrap();
    // The provider's own answer, at once, saying why it was not retried; not a timeout
    // when the deadline comes.
    match &err {
        ModelError::Http {
            status: 429,
            message,
            ..
        } => assert!(
            message.contains("slow down") && message.contains("would pass the call's deadline"),
            "{message}"
        ),
        other => panic!("{other:?}"),
    }
    assert!(
        started.elapsed() < Duration::from_millis(500),
        "{:?}",
        started.elapsed()
    );

    // With time for the wait, the call is retried as before.
    let (url, _stop) = simulator(json!({"scenarios": {
        "limited": {"turns": [{"content": "ok", "error": {"status": 429, "message": "slow down", "times": 1, "retry_after": 0.2}}]}
    }}))
    .await;
    let model = client(&url);
    let req = ChatRequest {
        deadline: Some(tokio::time::Instant::now() + Duration::from_secs(5)),
        ..request("limited")
    };
    let deltas = model.stream(req, CancellationToken::new()).await.unwrap();
    let deltas: Vec<_> = deltas.collect().await;
    assert!(
        deltas
            .iter()
            .any(|d| matches!(d, Ok(ChatDelta::Content(text)) if text.contains("ok"))),
        "{deltas:?}"
    );
}

/// A provider that asks to wait longer than the retry policy's longest wait is not asked
/// again: its 429 is the call's error at once (the wait was cut to the policy's and the
/// retry made anyway, too soon for the provider).
#[tokio::test]
async fn a_retry_after_longer_than_the_longest_wait_fails_the_call_at_once() {
    // Scripted once: a retry would have been answered.
    let (url, _stop) = simulator(json!({"scenarios": {
        "limited": {"turns": [{"content": "ok", "error": {"status": 429, "message": "slow down", "times": 1, "retry_after": 30}}]}
    }}))
    .await;
    let model = client(&url);
    let started = Instant::now();
    let err = collect(&model, request("limited")).await.unwrap_err();
    match &err {
        ModelError::Http {
            status: 429,
            message,
            retry_after,
        } => {
            assert!(
                message.contains("slow down")
                    && message.contains("not retried")
                    && message.contains("30s"),
                "{message}"
            );
            assert_eq!(*retry_after, Some(Duration::from_secs(30)));
        }
        other => panic!("{other:?}"),
    }
    // Still a rate limit, which the caller may try again after the wait.
    assert!(err.is_retryable());
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
        let model = named(&format!("http://{addr}/v1"), http2);
        let err = collect(&model, request("demo")).await.unwrap_err();
        let ModelError::Connect(message) = &err else {
            panic!("{err:?}")
        };
        // The error reaches clients (the run's ERROR event): it names the provider, not
        // the address, which only the debug log shows.
        assert!(message.starts_with("provider \"local\": "), "{message}");
        assert!(!message.contains("127.0.0.1"), "{message}");
        assert!(err.never_processed());
    }
}

/// Over h2c, a call the server saw, then reset or dropped the connection of before
/// answering, is lost before the answer: retried as transient, but the server may have
/// processed the prompt, which counts (it was `Connect`, whose usage is dropped). The
/// error names the provider, not the address.
#[tokio::test]
async fn h2c_calls_cut_off_after_they_were_sent_are_lost_before_the_answer() {
    for reset in [true, false] {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let url = format!("http://{}/v1", listener.local_addr().unwrap());
        let seen = Arc::new(AtomicUsize::new(0));
        let counted = seen.clone();
        tokio::spawn(async move {
            while let Ok((socket, _)) = listener.accept().await {
                let counted = counted.clone();
                tokio::spawn(async move {
                    let mut connection = h2::server::handshake(socket).await.unwrap();
                    while let Some(Ok((_, mut respond))) = connection.accept().await {
                        counted.fetch_add(1, Ordering::SeqCst);
                        if !reset {
                            // The connection, and its socket, are dropped.
                            break;
                        }
                        respond.send_reset(h2::Reason::INTERNAL_ERROR);
                    }
                });
            }
        });
        assert_lost_before_answer(&named(&url, true), &seen).await;
    }
}

/// Over HTTP/1.1 too (llama.cpp's and Ollama's servers speak nothing else): a call the
/// server read whole, then closed the connection of before answering (a crash during
/// prefill), is lost before the answer, not "unreachable", and its prompt counts.
#[tokio::test]
async fn http1_calls_cut_off_after_they_were_sent_are_lost_before_the_answer() {
    use tokio::io::AsyncReadExt;
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("http://{}/v1", listener.local_addr().unwrap());
    let seen = Arc::new(AtomicUsize::new(0));
    let counted = seen.clone();
    tokio::spawn(async move {
        while let Ok((mut socket, _)) = listener.accept().await {
            let counted = counted.clone();
            tokio::spawn(async move {
                // The whole request (its headers, then as many bytes as they announce),
                // then the connection closed with no answer.
                let mut read = Vec::new();
                let mut buffer = [0; 4096];
                loop {
                    let Ok(n) = socket.read(&mut buffer).await else {
                        return;
                    };
                    if n == 0 {
                        return;
                    }
                    read.extend_from_slice(&buffer[..n]);
                    let text = String::from_utf8_lossy(&read).to_ascii_lowercase();
                    if let Some(end) = text.find("\r\n\r\n") {
                        let length: usize = text[..end]
                            .lines()
                            .find_map(|line| line.strip_prefix("content-length:"))
                            .and_then(|v| v.trim().parse().ok())
                            .unwrap_or(0);
                        if read.len() >= end + 4 + length {
                            break;
                        }
                    }
                }
                counted.fetch_add(1, Ordering::SeqCst);
            });
        }
    });
    assert_lost_before_answer(&named(&url, false), &seen).await;
}

/// A call of `model` to a server that cuts every call off after it was sent (counting
/// them in `seen`) fails lost before the answer, its prompt counted, after 3 retries; the
/// error names the provider, not the address.
async fn assert_lost_before_answer(model: &OpenAiChat, seen: &AtomicUsize) {
    let err = collect(model, request("demo")).await.unwrap_err();
    let ModelError::LostBeforeAnswer(message) = &err else {
        panic!("{err:?}")
    };
    assert!(message.starts_with("provider \"local\": "), "{message}");
    assert!(!message.contains("127.0.0.1"), "{message}");
    assert!(!err.never_processed());
    assert_eq!(
        seen.load(Ordering::SeqCst),
        4,
        "the first call and 3 retries"
    );
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

fn named(url: &str, http2_prior_knowledge: bool) -> OpenAiChat {
    client_with(url, http2_prior_knowledge).with_name("local")
}

fn text_of(deltas: &[Result<ChatDelta, ModelError>]) -> String {
    deltas
        .iter()
        .filter_map(|d| match d {
            Ok(ChatDelta::Content(t)) => Some(t.as_str()),
            _ => None,
        })
        .collect()
}

/// The next round after a tool call is accepted by a server that refuses `content: null`
/// (it was refused with a 500, retried three times, and the run failed); a 500 that says
/// the request failed validation is sent once, not retried.
#[tokio::test]
async fn strict_servers_take_tool_call_turns_and_validation_errors_are_not_retried() {
    for http2 in [false, true] {
        let (url, _stop) = simulator(json!({"scenarios": {
            "strict": {"strict_messages": true, "turns": [{"content": "ok"}]},
            "pydantic": {"turns": [{"content": "second try", "error": {"status": 500,
                "message": "1 validation error for ChatCompletionRequestAssistantMessage", "times": 1}}]}
        }}))
        .await;
        let model = client_with(&url, http2);
        let mut next_round = request("strict");
        next_round.messages.extend([
            ChatMessage::Assistant {
                content: String::new(),
                tool_calls: vec![agentrt_models::ModelToolCall {
                    id: "a".into(),
                    name: "calculator".into(),
                    arguments: "{\"expression\":\"6*7\"}".into(),
                }],
            },
            ChatMessage::Tool {
                call_id: "a".into(),
                content: "42".into(),
            },
        ]);
        let deltas = collect(&model, next_round).await.unwrap();
        assert_eq!(text_of(&deltas), "ok", "{deltas:?}");

        // A retry would have passed (the error is scripted once): the call was sent once.
        let err = collect(&model, request("pydantic")).await.unwrap_err();
        assert!(
            matches!(&err, ModelError::Http { status: 500, message, .. } if message.contains("validation error")),
            "{err:?}"
        );
    }
}

/// Misbehaving servers: no finish reason nor `[DONE]`, a 200
/// that is not an event stream are errors; `length` and a missing usage come through as
/// they are; a single 5 MB delta passes.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dishonest_answers_are_errors_and_honest_ones_pass() {
    let content = "0123456789";
    for http2 in [false, true] {
        let (url, _stop) = simulator(json!({"scenarios": {
            "torn": {"turns": [{"content": "ok", "unterminated_last_line": true, "omit_usage": true}]},
            "torn-after-usage": {"turns": [{"content": "ok", "unterminated_last_line": true}]},
            "json": {"turns": [{"plain_body": "{\"choices\": [{\"message\": {\"content\": \"hi\"}}]}"}]},
            "json-error": {"turns": [{"plain_body": "{\"error\": {\"message\": \"no such model\", \"code\": 404}}"}]},
            "html": {"turns": [{"plain_body": "<html>gateway</html>", "plain_content_type": "text/html"}]},
            "capped": {"turns": [{"content": "cut sho", "finish_reason": "length"}]},
            "no-usage": {"turns": [{"content": "ok", "omit_usage": true}]},
            "huge": {"turns": [{"content": content, "repeat_content": 500_000, "chunk_chars": 5_000_000}]},
        }}))
        .await;
        let model = client_with(&url, http2);
        // Torn in its last line (`[DONE]`), after the finish reason, with or without the
        // usage before it: the answer is whole. (Torn before the finish reason, a stream
        // is an error: `broken_streams_end_with_an_error`.)
        for torn in ["torn", "torn-after-usage"] {
            let deltas = collect(&model, request(torn)).await.unwrap();
            assert_eq!(text_of(&deltas), "ok", "{deltas:?}");
            assert!(
                matches!(deltas.last().unwrap(), Ok(ChatDelta::Finish { .. })),
                "{torn}: {deltas:?}"
            );
        }
        for plain in ["json", "html"] {
            let err = collect(&model, request(plain)).await.unwrap_err();
            assert!(
                matches!(&err, ModelError::InvalidResponse(m) if m.contains("not an event stream")),
                "{err:?}"
            );
            assert!(!err.is_retryable());
        }
        // A gateway's error sent with a 200 is that error.
        let err = collect(&model, request("json-error")).await.unwrap_err();
        assert!(
            matches!(&err, ModelError::Http { status: 404, message, .. } if message.contains("no such model")),
            "{err:?}"
        );
        let deltas = collect(&model, request("capped")).await.unwrap();
        assert!(
            matches!(
                deltas.last().unwrap(),
                Ok(ChatDelta::Finish {
                    reason: FinishReason::Length,
                    usage: Some(_)
                })
            ),
            "{deltas:?}"
        );
        let deltas = collect(&model, request("no-usage")).await.unwrap();
        assert_eq!(
            deltas.last().unwrap(),
            &Ok(ChatDelta::Finish {
                reason: FinishReason::Stop,
                usage: None
            })
        );
        let deltas = collect(&model, request("huge")).await.unwrap();
        assert_eq!(deltas.len(), 2, "one delta, then the finish");
        assert_eq!(text_of(&deltas).len(), content.len() * 500_000);
    }
}

/// A provider that sends one endless line: the call fails with an error naming the bound,
/// and the client goes on serving calls.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_endless_line_fails_the_call_at_its_bound() {
    for http2 in [false, true] {
        let (url, _stop) = simulator(json!({"scenarios": {
            "flood": {"turns": [{"endless_line": true}]},
            "short": {"turns": [{"content": "forty-two"}]}
        }}))
        .await;
        let model = client_with(&url, http2);
        let deltas =
            tokio::time::timeout(Duration::from_secs(60), collect(&model, request("flood")))
                .await
                .expect("an endless line must not be read for ever")
                .unwrap();
        assert_eq!(
            deltas.last().unwrap(),
            &Err(ModelError::TooLarge {
                what: "one SSE line of the answer",
                limit: agentrt_models::MAX_SSE_EVENT_BYTES
            })
        );
        assert_eq!(answer(&model).await, "forty-two");
    }
}

/// Redirects are not followed (a 307 re-sent the prompt elsewhere): the call fails naming
/// the status.
#[tokio::test]
async fn redirects_are_not_followed() {
    let (elsewhere, _stop_elsewhere) = simulator(json!({"scenarios": {
        "moved": {"turns": [{"content": "the prompt reached another server"}]}
    }}))
    .await;
    for status in [307, 302] {
        for http2 in [false, true] {
            let (url, _stop) = simulator(json!({"scenarios": {
                "moved": {"turns": [{"redirect_to": format!("{elsewhere}/chat/completions"), "redirect_status": status}]}
            }}))
            .await;
            let err = collect(&named(&url, http2), request("moved"))
                .await
                .unwrap_err();
            let ModelError::Http {
                status: answered,
                message,
                ..
            } = &err
            else {
                panic!("{err:?}")
            };
            assert_eq!(*answered, status);
            assert!(
                message.contains("redirect, which is not followed"),
                "{message}"
            );
            assert!(!err.is_retryable());
        }
    }
}

/// A 404 names the provider and the path called, not the host; credentials in the URL
/// never appear.
#[tokio::test]
async fn a_404_names_the_provider_and_the_path() {
    let (url, _stop) = simulator(json!({})).await;
    let wrong = url
        .replace("http://", "http://user:secret@")
        .replace("/v1", "/api");
    for http2 in [false, true] {
        let err = collect(&named(&wrong, http2), request("demo"))
            .await
            .unwrap_err();
        let text = err.to_string();
        assert!(
            text.contains("provider \"local\" answered POST /api/chat/completions with 404"),
            "{text}"
        );
        assert!(text.contains("base_url"), "{text}");
        assert!(
            !text.contains("secret") && !text.contains("127.0.0.1"),
            "{text}"
        );
    }
}

/// HTTP/2 with prior knowledge against a server that speaks only HTTP/1.1 says so.
#[tokio::test]
async fn h2c_against_an_http1_server_says_so() {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("http://{}/v1", listener.local_addr().unwrap());
    tokio::spawn(async move {
        // What an HTTP/1.1 server answers to the HTTP/2 preface, closing as such servers
        // do (a lingering close: the answer is sent, then what the client still sends is
        // read until it closes; closing with unread bytes would reset the connection and
        // could discard the answer before the client reads it).
        while let Ok((mut socket, _)) = listener.accept().await {
            tokio::spawn(async move {
                let mut buffer = [0; 1024];
                let _ = socket.read(&mut buffer).await;
                let _ = socket
                    .write_all(
                        b"HTTP/1.1 400 Bad Request\r\ncontent-length: 0\r\nconnection: close\r\n\r\n",
                    )
                    .await;
                let _ = socket.shutdown().await;
                let drain =
                    async { while matches!(socket.read(&mut buffer).await, Ok(n) if n > 0) {} };
                let _ = tokio::time::timeout(std::time::Duration::from_secs(5), drain).await;
            });
        }
    });
    let err = collect(&named(&url, true), request("demo"))
        .await
        .unwrap_err();
    assert!(
        matches!(&err, ModelError::Misconfigured(m)
            if m.contains("provider \"local\"") && m.contains("unset http2_prior_knowledge")),
        "{err:?}"
    );
    assert!(!err.is_retryable());
}

/// The simulator honours `stop` as real servers do, unless the turn ignores it.
#[tokio::test]
async fn stop_sequences_are_honoured_unless_ignored() {
    let content = "Action: calculator\nObservation: invented";
    let (url, _stop) = simulator(json!({"scenarios": {
        "honest": {"turns": [{"content": content}]},
        "sloppy": {"turns": [{"content": content, "ignore_stop": true}]}
    }}))
    .await;
    let model = client(&url);
    for (name, expected) in [("honest", "Action: calculator\n"), ("sloppy", content)] {
        let mut req = request(name);
        req.stop = vec!["Observation:".into()];
        let deltas = collect(&model, req).await.unwrap();
        assert_eq!(text_of(&deltas), expected);
    }
}

mod rerank {
    use super::*;
    use agentrt_models::{HttpReranker, RerankRequest, RerankResult, Reranker};

    fn reranker(url: &str, http2_prior_knowledge: bool) -> HttpReranker {
        HttpReranker::new(&ProviderSettings {
            kind: ProviderKind::Openai,
            base_url: url.into(),
            api_key: Secret::new("k"),
            api_key_env: None,
            api_key_header: None,
            http2_prior_knowledge,
            http_client: HttpClient::Lean,
        })
        .unwrap()
        .with_name("local")
    }

    fn ask(model: &str) -> RerankRequest {
        RerankRequest {
            model: model.into(),
            query: "red apple".into(),
            documents: vec![
                "a green pear".into(),
                "red wine".into(),
                "a red apple".into(),
            ],
            top_n: Some(2),
        }
    }

    #[tokio::test]
    async fn documents_are_ranked_by_the_provider() {
        let (url, _stop) = simulator(json!({})).await;
        for http2 in [false, true] {
            let results = reranker(&url, http2)
                .rerank(ask("m"), CancellationToken::new())
                .await
                .unwrap();
            assert_eq!(
                results,
                [
                    RerankResult {
                        index: 2,
                        relevance_score: 1.0
                    },
                    RerankResult {
                        index: 1,
                        relevance_score: 0.5
                    }
                ]
            );
        }
    }

    #[tokio::test]
    async fn failing_slow_and_cancelled_rerankers_end_with_an_error() {
        let (url, _stop) = simulator(json!({})).await;
        let err = reranker(&url, false)
            .rerank(ask("fail"), CancellationToken::new())
            .await
            .unwrap_err();
        assert!(
            matches!(err, ModelError::Http { status: 500, .. }),
            "{err:?}"
        );

        let started = Instant::now();
        let err = reranker(&url, false)
            .with_timeout(Duration::from_millis(200))
            .rerank(ask("slow"), CancellationToken::new())
            .await
            .unwrap_err();
        assert_eq!(err, ModelError::Timeout(Duration::from_millis(200)));
        assert!(started.elapsed() < Duration::from_secs(10));

        let cancel = CancellationToken::new();
        let canceller = cancel.clone();
        tokio::spawn(async move {
            tokio::time::sleep(Duration::from_millis(100)).await;
            canceller.cancel();
        });
        let err = reranker(&url, true)
            .rerank(ask("slow"), cancel)
            .await
            .unwrap_err();
        assert_eq!(err, ModelError::Cancelled);

        // An answer larger than the bound is refused, not read to its end.
        let err = reranker(&url, false)
            .with_max_response_bytes(16)
            .rerank(ask("m"), CancellationToken::new())
            .await
            .unwrap_err();
        assert!(
            matches!(err, ModelError::TooLarge { limit: 16, .. }),
            "{err:?}"
        );

        // A wrong base URL names the path.
        let err = reranker(&url.replace("/v1", "/nope"), false)
            .rerank(ask("m"), CancellationToken::new())
            .await
            .unwrap_err();
        assert!(
            err.to_string().contains("POST /nope/rerank with 404"),
            "{err}"
        );
    }
}

/// A body in an encoding that was not asked for is said to be one, not misread as a broken
/// event stream.
#[tokio::test]
async fn an_answer_in_an_encoding_not_asked_for_is_named() {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("http://{}/v1", listener.local_addr().unwrap());
    tokio::spawn(async move {
        while let Ok((mut socket, _)) = listener.accept().await {
            tokio::spawn(async move {
                // The request's headers and body, enough of them to answer after.
                let mut request = vec![0; 64 * 1024];
                let _ = socket.read(&mut request).await;
                let body = [0x1f, 0x8b, 0x08, 0x00, 0x00, 0x00, 0x00, 0x00];
                let head = format!(
                    "HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\n\
                     content-encoding: gzip\r\ncontent-length: {}\r\n\r\n",
                    body.len()
                );
                let _ = socket.write_all(head.as_bytes()).await;
                let _ = socket.write_all(&body).await;
            });
        }
    });
    let err = collect(&named(&url, false), request("any"))
        .await
        .unwrap_err();
    assert!(
        matches!(&err, ModelError::InvalidResponse(m) if m.contains("content-encoding \"gzip\"")),
        "{err:?}"
    );
}

/// A server answering every call with the event stream `answer(model)` gives the model
/// the request names, over HTTP/1.1; the calls it took.
async fn event_stream_server(answer: fn(&str) -> String) -> (String, Arc<AtomicUsize>) {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("http://{}/v1", listener.local_addr().unwrap());
    let calls = Arc::new(AtomicUsize::new(0));
    let counted = calls.clone();
    tokio::spawn(async move {
        while let Ok((mut socket, _)) = listener.accept().await {
            counted.fetch_add(1, Ordering::SeqCst);
            tokio::spawn(async move {
                // The request, its head and as much of its body as its length says.
                let mut request = Vec::new();
                let mut buffer = [0; 4096];
                let body = loop {
                    let Ok(read @ 1..) = socket.read(&mut buffer).await else {
                        return;
                    };
                    request.extend_from_slice(&buffer[..read]);
                    let text = String::from_utf8_lossy(&request).into_owned();
                    let Some((head, body)) = text.split_once("\r\n\r\n") else {
                        continue;
                    };
                    let length = head
                        .lines()
                        .find_map(|l| {
                            l.to_ascii_lowercase()
                                .strip_prefix("content-length:")
                                .map(|n| n.trim().parse::<usize>().unwrap())
                        })
                        .unwrap_or(0);
                    if body.len() >= length {
                        break body.to_owned();
                    }
                };
                let model = serde_json::from_str::<serde_json::Value>(&body).unwrap()["model"]
                    .as_str()
                    .unwrap()
                    .to_owned();
                let head = "HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\n\
                            connection: close\r\n\r\n";
                let _ = socket.write_all(head.as_bytes()).await;
                let _ = socket.write_all(answer(&model).as_bytes()).await;
                let _ = socket.shutdown().await;
            });
        }
    });
    (url, calls)
}

/// llama.cpp's server reports a failure in the stream as an `error:` line, then sends
/// `[DONE]`. Its message and status reach the caller (it was "a line that is neither data
/// nor another SSE field"), and one that comes before any text is retried as the same
/// error in a `data:` line is; after text, the call ends with it.
#[tokio::test]
async fn an_error_line_reaches_the_caller_and_is_retried_before_the_answer() {
    let (url, calls) = event_stream_server(|model| {
        let error = "error: {\"code\":500,\"message\":\"context shift is disabled\",\"type\":\"server_error\"}\n\n";
        let text = "data: {\"choices\":[{\"delta\":{\"content\":\"par\"}}]}\n\n";
        match model {
            "at-once" => format!("{error}data: [DONE]\n\n"),
            _ => format!("{text}{error}data: [DONE]\n\n"),
        }
    })
    .await;
    let model = named(&url, false);
    let err = collect(&model, request("at-once")).await.unwrap_err();
    assert_eq!(
        err,
        ModelError::Http {
            status: 500,
            message: "provider reported an error: context shift is disabled".into(),
            retry_after: None
        }
    );
    assert_eq!(
        calls.load(Ordering::SeqCst),
        4,
        "the first call and 3 retries"
    );
    let deltas = collect(&model, request("mid-answer")).await.unwrap();
    assert_eq!(
        calls.load(Ordering::SeqCst),
        5,
        "not retried once text streamed"
    );
    assert_eq!(deltas[0], Ok(ChatDelta::Content("par".into())));
    assert!(
        matches!(&deltas[1..], [Err(ModelError::Http { status: 500, message, .. })]
            if message.contains("context shift is disabled")),
        "{deltas:?}"
    );
}
