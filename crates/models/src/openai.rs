//! OpenAI-compatible chat completions, streamed over SSE.

use std::{borrow::Cow, collections::BTreeMap, collections::VecDeque, time::Duration};

use futures_util::{Stream, StreamExt};
use http::header::{ACCEPT, AUTHORIZATION, CONTENT_TYPE, HeaderMap, HeaderValue, RETRY_AFTER};
use http_body_util::BodyDataStream;
use serde_json::Value;
use tokio_util::sync::CancellationToken;
use tracing::{debug, warn};

use crate::{
    ChatDelta, ChatMessage, ChatModel, ChatRequest, ChatStream, FinishReason, ModelError,
    ModelToolCall, ProviderSettings, Usage,
    h2c::H2cClient,
    think::{Piece, ThinkSplitter},
};

/// Largest error body read from a failed response.
const MAX_ERROR_BODY: usize = 64 * 1024;

/// How transient failures before the first delta are retried.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RetryPolicy {
    /// Retries after the first attempt.
    pub max_retries: u32,
    /// Backoff of the first retry; doubled each time, with full jitter.
    pub base_delay: Duration,
    /// Longest wait between attempts, `Retry-After` included.
    pub max_delay: Duration,
}

impl Default for RetryPolicy {
    fn default() -> Self {
        Self {
            max_retries: 3,
            base_delay: Duration::from_millis(250),
            max_delay: Duration::from_secs(20),
        }
    }
}

impl RetryPolicy {
    /// The wait before retry number `attempt` (0-based): the provider's `Retry-After` when
    /// given, otherwise exponential backoff with full jitter; never above `max_delay`.
    pub fn delay(&self, attempt: u32, retry_after: Option<Duration>) -> Duration {
        let delay = retry_after.unwrap_or_else(|| {
            let ceiling = self.base_delay.saturating_mul(1 << attempt.min(16));
            ceiling.mul_f64(fastrand::f64())
        });
        delay.min(self.max_delay)
    }
}

/// A client of one OpenAI-compatible provider.
#[derive(Clone)]
pub struct OpenAiChat {
    transport: std::sync::Arc<Transport>,
    /// The headers of every call, built once (the key marked sensitive).
    headers: HeaderMap,
    retry: RetryPolicy,
}

/// How calls reach the provider.
enum Transport {
    /// The general client: HTTP/1.1 or HTTP/2, TLS, proxies.
    General {
        http: reqwest::Client,
        /// Parsed once: parsing it on every call costs more than the rest of the request.
        url: reqwest::Url,
    },
    /// Cleartext HTTP/2 with prior knowledge, one shared connection.
    H2c(H2cClient),
}

const CONNECT_TIMEOUT: Duration = Duration::from_secs(10);

impl OpenAiChat {
    /// A client for `settings`, retrying as `retry` says.
    pub fn new(settings: &ProviderSettings, retry: RetryPolicy) -> Result<Self, ModelError> {
        let url = format!(
            "{}/chat/completions",
            settings.base_url.trim_end_matches('/')
        );
        let invalid = |e: &dyn std::fmt::Display| {
            ModelError::Connect(format!("invalid base URL {url:?}: {e}"))
        };
        let transport = if settings.http2_prior_knowledge && url.starts_with("http://") {
            Transport::H2c(H2cClient::new(&url, CONNECT_TIMEOUT).map_err(|e| invalid(&e))?)
        } else {
            Transport::General {
                http: general_client(settings.http2_prior_knowledge)?,
                url: reqwest::Url::parse(&url).map_err(|e| invalid(&e))?,
            }
        };
        let mut headers = HeaderMap::new();
        headers.insert(CONTENT_TYPE, HeaderValue::from_static("application/json"));
        headers.insert(ACCEPT, HeaderValue::from_static("text/event-stream"));
        let key = settings.api_key.expose();
        if !key.is_empty() {
            let mut value = HeaderValue::try_from(format!("Bearer {key}")).map_err(|_| {
                ModelError::Connect("the API key holds characters a header cannot carry".into())
            })?;
            value.set_sensitive(true);
            headers.insert(AUTHORIZATION, value);
        }
        Ok(Self {
            transport: std::sync::Arc::new(transport),
            headers,
            retry,
        })
    }

    async fn send_once(&self, body: &bytes::Bytes) -> Result<ResponseBody, ModelError> {
        let mut headers = self.headers.clone();
        if agentrt_telemetry::tracing_enabled() {
            // The model call joins the caller's trace: `traceparent` of the `chat` span.
            agentrt_telemetry::inject(&mut headers);
        }
        match &*self.transport {
            Transport::General { http, url } => {
                // Boxed, so that the general client's large request future does not
                // enlarge every h2c call's future too.
                let mut response = Box::pin(
                    http.post(url.clone())
                        .headers(headers)
                        .body(body.clone())
                        .send(),
                )
                .await
                .map_err(|e| ModelError::Connect(error_chain(&e)))?;
                let status = response.status().as_u16();
                let headers = std::mem::take(response.headers_mut());
                let body = ResponseBody::General(BodyDataStream::new(response.into()));
                checked(status, &headers, body).await
            }
            Transport::H2c(client) => {
                let (parts, body) = client.post(body.clone(), headers).await?.into_parts();
                let body = ResponseBody::H2c(body);
                checked(parts.status.as_u16(), &parts.headers, body).await
            }
        }
    }
}

/// The general client, with the HTTP/2 settings of [`H2cClient`] for servers that
/// negotiate HTTP/2.
fn general_client(http2_prior_knowledge: bool) -> Result<reqwest::Client, ModelError> {
    // TLS uses ring; installing it twice is harmless, so ignore "already installed".
    let _ = rustls::crypto::ring::default_provider().install_default();
    let mut http = reqwest::Client::builder()
        .connect_timeout(CONNECT_TIMEOUT)
        .tcp_nodelay(true)
        .pool_idle_timeout(Duration::from_secs(90))
        // Over HTTP/2 many calls share a connection: large windows so that streaming
        // calls never wait on flow control nor exhaust h2's budget for small DATA frames
        // (see `H2cClient`), and pings to notice a dead peer.
        .http2_initial_connection_window_size(64 * 1024 * 1024)
        .http2_initial_stream_window_size(1024 * 1024)
        .http2_keep_alive_interval(Duration::from_secs(30))
        .http2_keep_alive_timeout(Duration::from_secs(10));
    if http2_prior_knowledge {
        http = http.http2_prior_knowledge();
    }
    http.build()
        .map_err(|e| ModelError::Connect(format!("cannot build the HTTP client: {e}")))
}

/// The body of a successful response; a failed one becomes its error.
async fn checked(
    status: u16,
    headers: &HeaderMap,
    body: ResponseBody,
) -> Result<ResponseBody, ModelError> {
    if (200..300).contains(&status) {
        Ok(body)
    } else {
        Err(http_error(status, headers, body).await)
    }
}

/// A response body, from either transport, as a stream of bytes.
enum ResponseBody {
    General(BodyDataStream<reqwest::Body>),
    H2c(crate::h2c::H2Body),
}

impl Stream for ResponseBody {
    type Item = Result<bytes::Bytes, std::io::Error>;

    fn poll_next(
        self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<Option<Self::Item>> {
        // The SSE parser shows only the top error; keep the causes in the text.
        let lost = |e: &dyn std::error::Error| std::io::Error::other(error_chain(e));
        match self.get_mut() {
            Self::General(body) => body.poll_next_unpin(cx).map_err(|e| lost(&e)),
            Self::H2c(body) => body.poll_next_unpin(cx).map_err(|e| lost(&e)),
        }
    }
}

#[async_trait::async_trait]
impl ChatModel for OpenAiChat {
    async fn stream(
        &self,
        request: ChatRequest,
        cancel: CancellationToken,
    ) -> Result<ChatStream, ModelError> {
        let body = bytes::Bytes::from(request_body(&request));
        // The body is all that is sent; the messages need not wait with it for the reply.
        drop(request);
        let mut attempt = 0;
        loop {
            let outcome = tokio::select! {
                outcome = self.send_once(&body) => outcome,
                () = cancel.cancelled() => return Err(ModelError::Cancelled),
            };
            let error = match outcome {
                Ok(body) => return Ok(Box::pin(decode(body))),
                Err(error) => error,
            };
            if !error.is_retryable() || attempt >= self.retry.max_retries {
                return Err(error);
            }
            let retry_after = match &error {
                ModelError::Http { retry_after, .. } => *retry_after,
                _ => None,
            };
            let delay = self.retry.delay(attempt, retry_after);
            warn!(error = %error, attempt = attempt + 1, ?delay, "model call failed, retrying");
            tokio::select! {
                () = tokio::time::sleep(delay) => {}
                () = cancel.cancelled() => return Err(ModelError::Cancelled),
            }
            attempt += 1;
        }
    }
}

pub(crate) fn error_chain(error: &dyn std::error::Error) -> String {
    let mut text = error.to_string();
    let mut source = error.source();
    while let Some(cause) = source {
        text.push_str(": ");
        text.push_str(&cause.to_string());
        source = cause.source();
    }
    text
}

/// Reads a failed response: the provider's JSON `error.message` when there is one.
async fn http_error(status: u16, headers: &HeaderMap, mut chunks: ResponseBody) -> ModelError {
    let retry_after = headers
        .get(RETRY_AFTER)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.trim().parse::<f64>().ok())
        .and_then(|s| Duration::try_from_secs_f64(s).ok());
    let mut body = Vec::new();
    while let Some(Ok(chunk)) = chunks.next().await {
        body.extend_from_slice(&chunk);
        if body.len() >= MAX_ERROR_BODY {
            body.truncate(MAX_ERROR_BODY);
            break;
        }
    }
    let text = String::from_utf8_lossy(&body);
    let message = serde_json::from_str::<Value>(&text)
        .ok()
        .and_then(|v| {
            v["error"]["message"]
                .as_str()
                .or_else(|| v["error"].as_str())
                .or_else(|| v["message"].as_str())
                .map(str::to_owned)
        })
        .unwrap_or_else(|| text.trim().chars().take(500).collect());
    ModelError::Http {
        status,
        message,
        retry_after,
    }
}

/// The JSON body of a streaming chat completions request, serialized straight from the
/// request (no intermediate JSON tree: this runs on every model call).
pub(crate) fn request_body(request: &ChatRequest) -> Vec<u8> {
    let body = Body {
        model: &request.model,
        messages: request.messages.iter().map(WireMessage).collect(),
        stream: true,
        stream_options: StreamOptions {
            include_usage: true,
        },
        tools: request.tools.iter().map(WireTool::new).collect(),
        parallel_tool_calls: (!request.tools.is_empty()).then_some(request.parallel_tool_calls),
        temperature: request.temperature,
        max_tokens: request.max_tokens,
        stop: &request.stop,
    };
    // Serializing borrowed strings, numbers and JSON values into a Vec cannot fail.
    serde_json::to_vec(&body).unwrap_or_default()
}

#[derive(serde::Serialize)]
struct Body<'a> {
    model: &'a str,
    messages: Vec<WireMessage<'a>>,
    stream: bool,
    stream_options: StreamOptions,
    #[serde(skip_serializing_if = "Vec::is_empty")]
    tools: Vec<WireTool<'a>>,
    #[serde(skip_serializing_if = "Option::is_none")]
    parallel_tool_calls: Option<bool>,
    #[serde(skip_serializing_if = "Option::is_none")]
    temperature: Option<f32>,
    #[serde(skip_serializing_if = "Option::is_none")]
    max_tokens: Option<u32>,
    #[serde(skip_serializing_if = "<[String]>::is_empty")]
    stop: &'a [String],
}

#[derive(serde::Serialize)]
struct StreamOptions {
    include_usage: bool,
}

#[derive(serde::Serialize)]
struct WireTool<'a> {
    r#type: &'static str,
    function: WireFunction<'a>,
}

impl<'a> WireTool<'a> {
    fn new(tool: &'a crate::ToolDefinition) -> Self {
        Self {
            r#type: "function",
            function: WireFunction {
                name: &tool.name,
                description: Some(&tool.description),
                parameters: Some(&tool.parameters),
                arguments: None,
            },
        }
    }
}

#[derive(serde::Serialize)]
struct WireFunction<'a> {
    name: &'a str,
    #[serde(skip_serializing_if = "Option::is_none")]
    description: Option<&'a str>,
    #[serde(skip_serializing_if = "Option::is_none")]
    parameters: Option<&'a agentrt_core::SharedJson>,
    #[serde(skip_serializing_if = "Option::is_none")]
    arguments: Option<&'a str>,
}

#[derive(serde::Serialize)]
struct WireCall<'a> {
    id: &'a str,
    r#type: &'static str,
    function: WireFunction<'a>,
}

/// One message as the chat completions API takes it.
struct WireMessage<'a>(&'a ChatMessage);

impl serde::Serialize for WireMessage<'_> {
    fn serialize<S: serde::Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        use serde::ser::SerializeMap;
        let mut map = serializer.serialize_map(None)?;
        match self.0 {
            ChatMessage::System(text) => {
                map.serialize_entry("role", "system")?;
                map.serialize_entry("content", text)?;
            }
            ChatMessage::User(text) => {
                map.serialize_entry("role", "user")?;
                map.serialize_entry("content", text)?;
            }
            ChatMessage::Assistant {
                content,
                tool_calls,
            } if tool_calls.is_empty() => {
                map.serialize_entry("role", "assistant")?;
                map.serialize_entry("content", content)?;
            }
            ChatMessage::Assistant {
                content,
                tool_calls,
            } => {
                map.serialize_entry("role", "assistant")?;
                map.serialize_entry("content", &(!content.is_empty()).then_some(content))?;
                let calls: Vec<WireCall<'_>> = tool_calls
                    .iter()
                    .map(|c| WireCall {
                        id: &c.id,
                        r#type: "function",
                        function: WireFunction {
                            name: &c.name,
                            description: None,
                            parameters: None,
                            arguments: Some(&c.arguments),
                        },
                    })
                    .collect();
                map.serialize_entry("tool_calls", &calls)?;
            }
            ChatMessage::Tool { call_id, content } => {
                map.serialize_entry("role", "tool")?;
                map.serialize_entry("tool_call_id", call_id)?;
                map.serialize_entry("content", content)?;
            }
        }
        map.end()
    }
}

/// Trailing events read after `[DONE]` so that the body is complete when it is dropped. A
/// body dropped early is reset: an HTTP/1.1 connection then cannot be reused, and over
/// HTTP/2 the frames still in flight for the reset stream count as protocol errors, of
/// which h2 tolerates 1,024 per connection before it closes it with every call on it.
const MAX_TRAILING_EVENTS: usize = 16;
/// How long a server that keeps the stream open after `[DONE]` is given to close it.
const DRAIN_GRACE: Duration = Duration::from_millis(200);

/// Turns an SSE byte stream into deltas.
fn decode<S, E>(bytes: S) -> Decoder<S>
where
    S: Stream<Item = Result<bytes::Bytes, E>> + Send + Unpin + 'static,
    E: std::error::Error + Send + Sync + 'static,
{
    Decoder {
        events: sse_stream::SseByteStream::new(bytes),
        assembler: Assembler::default(),
        ready: VecDeque::new(),
        failure: None,
        state: DecodeState::Streaming,
    }
}

/// The deltas of one response: a plain state machine polled in place, so that nothing
/// is moved or boxed per event.
struct Decoder<S: futures_util::TryStream> {
    events: sse_stream::SseByteStream<S>,
    assembler: Assembler,
    /// Deltas decoded and not yet taken.
    ready: VecDeque<ChatDelta>,
    /// Why the stream broke; given after the deltas decoded before it.
    failure: Option<ModelError>,
    state: DecodeState,
}

enum DecodeState {
    Streaming,
    /// After `[DONE]`: reading what is left of the body before the last deltas go out.
    Draining {
        left: usize,
        grace: Option<std::pin::Pin<Box<tokio::time::Sleep>>>,
    },
    /// Nothing more is read; the deltas still ready go out, then the stream ends.
    Ended,
}

impl<S, E> Stream for Decoder<S>
where
    S: Stream<Item = Result<bytes::Bytes, E>> + Unpin,
    E: std::error::Error + Send + Sync + 'static,
{
    type Item = Result<ChatDelta, ModelError>;

    fn poll_next(
        self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<Option<Self::Item>> {
        use std::task::Poll;
        let this = self.get_mut();
        loop {
            match &mut this.state {
                DecodeState::Streaming => {
                    if let Some(delta) = this.ready.pop_front() {
                        return Poll::Ready(Some(Ok(delta)));
                    }
                }
                DecodeState::Draining { left, grace } => {
                    match this.events.poll_next_unpin(cx) {
                        Poll::Ready(Some(_)) if *left > 1 => *left -= 1,
                        Poll::Ready(_) => this.state = DecodeState::Ended,
                        Poll::Pending => {
                            // The end usually arrives with `[DONE]`: a timer only when not.
                            let grace = grace
                                .get_or_insert_with(|| Box::pin(tokio::time::sleep(DRAIN_GRACE)));
                            if grace.as_mut().poll(cx).is_pending() {
                                return Poll::Pending;
                            }
                            this.state = DecodeState::Ended;
                        }
                    }
                    continue;
                }
                DecodeState::Ended => {
                    return Poll::Ready(match this.ready.pop_front() {
                        Some(delta) => Some(Ok(delta)),
                        None => this.failure.take().map(Err),
                    });
                }
            }
            let Some(event) = std::task::ready!(this.events.poll_next_unpin(cx)) else {
                // No `[DONE]`: some servers just close. What arrived stands.
                debug!("model stream ended without [DONE]");
                this.assembler.finish(&mut this.ready);
                this.state = DecodeState::Ended;
                continue;
            };
            let event = match event {
                Ok(event) => event,
                Err(sse_stream::Error::Body(e)) => {
                    this.state = DecodeState::Ended;
                    let message = format!("connection lost mid-stream: {}", error_chain(&*e));
                    this.failure = Some(ModelError::Stream(message));
                    continue;
                }
                Err(e) => {
                    this.state = DecodeState::Ended;
                    let message = format!("malformed event stream: {}", error_chain(&e));
                    this.failure = Some(ModelError::Stream(message));
                    continue;
                }
            };
            let data = event.data.as_deref().unwrap_or_default().trim();
            if data.is_empty() {
                continue;
            }
            if data == "[DONE]" {
                this.assembler.finish(&mut this.ready);
                this.state = DecodeState::Draining {
                    left: MAX_TRAILING_EVENTS,
                    grace: None,
                };
                continue;
            }
            let chunk = match serde_json::from_str::<Chunk<'_>>(data) {
                Ok(chunk) => chunk,
                Err(e) => {
                    this.state = DecodeState::Ended;
                    let shown: String = data.chars().take(200).collect();
                    let error =
                        ModelError::Stream(format!("invalid JSON in the stream ({e}): {shown}"));
                    this.failure = Some(error);
                    continue;
                }
            };
            if let Err(error) = this.assembler.chunk(chunk, &mut this.ready) {
                this.state = DecodeState::Ended;
                this.failure = Some(error);
            }
        }
    }
}

/// One streamed chunk, borrowing its strings from the event where it can: most chunks
/// carry a few characters of text, and building a generic JSON tree for each dominated
/// the per-delta cost.
#[derive(serde::Deserialize)]
struct Chunk<'a> {
    /// The first choice: `n` is never set, so there is one (or, on the usage chunk, none).
    #[serde(default, borrow, deserialize_with = "first_choice")]
    choices: Option<Choice<'a>>,
    #[serde(default)]
    usage: Option<ChunkUsage>,
    #[serde(default)]
    error: Option<Value>,
}

/// The first element of `choices`, read without collecting the others.
fn first_choice<'de, D: serde::Deserializer<'de>>(
    deserializer: D,
) -> Result<Option<Choice<'de>>, D::Error> {
    struct First;
    impl<'de> serde::de::Visitor<'de> for First {
        type Value = Option<Choice<'de>>;

        fn expecting(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
            f.write_str("a list of choices")
        }

        fn visit_unit<E>(self) -> Result<Self::Value, E> {
            Ok(None)
        }

        fn visit_seq<A: serde::de::SeqAccess<'de>>(
            self,
            mut seq: A,
        ) -> Result<Self::Value, A::Error> {
            let first = seq.next_element()?;
            while seq.next_element::<serde::de::IgnoredAny>()?.is_some() {}
            Ok(first)
        }
    }
    deserializer.deserialize_any(First)
}

#[derive(serde::Deserialize)]
struct Choice<'a> {
    #[serde(default, borrow)]
    delta: Option<Delta<'a>>,
    #[serde(default, borrow)]
    finish_reason: Option<Cow<'a, str>>,
}

#[derive(serde::Deserialize)]
struct Delta<'a> {
    #[serde(default, borrow)]
    content: Option<Cow<'a, str>>,
    #[serde(default, borrow)]
    reasoning_content: Option<Cow<'a, str>>,
    #[serde(default, borrow)]
    reasoning: Option<Cow<'a, str>>,
    #[serde(default, borrow)]
    tool_calls: Option<Vec<CallDelta<'a>>>,
}

#[derive(serde::Deserialize)]
struct CallDelta<'a> {
    #[serde(default)]
    index: Option<u64>,
    #[serde(default, borrow)]
    id: Option<Cow<'a, str>>,
    #[serde(default, borrow)]
    function: Option<FunctionDelta<'a>>,
}

#[derive(serde::Deserialize)]
struct FunctionDelta<'a> {
    #[serde(default, borrow)]
    name: Option<Cow<'a, str>>,
    #[serde(default, borrow)]
    arguments: Option<Cow<'a, str>>,
}

#[derive(serde::Deserialize)]
struct ChunkUsage {
    #[serde(default)]
    prompt_tokens: Option<u64>,
    #[serde(default)]
    completion_tokens: Option<u64>,
}

#[derive(Default)]
struct PartialCall {
    id: String,
    name: String,
    arguments: String,
}

/// Folds chunks into deltas: text as it comes, tool calls by `index` until the end.
#[derive(Default)]
struct Assembler {
    calls: BTreeMap<u64, PartialCall>,
    think: ThinkSplitter,
    finish: Option<FinishReason>,
    usage: Option<Usage>,
    saw_content: bool,
    finished: bool,
}

impl Assembler {
    fn chunk(&mut self, chunk: Chunk<'_>, out: &mut VecDeque<ChatDelta>) -> Result<(), ModelError> {
        if let Some(error) = chunk.error.filter(|e| !e.is_null()) {
            let message = error["message"]
                .as_str()
                .map_or_else(|| error.to_string(), str::to_owned);
            return Err(ModelError::Stream(format!(
                "provider reported an error: {message}"
            )));
        }
        if let Some(usage) = chunk.usage {
            self.usage = Some(Usage {
                prompt_tokens: usage.prompt_tokens.unwrap_or(0),
                completion_tokens: usage.completion_tokens.unwrap_or(0),
            });
        }
        let Some(choice) = chunk.choices else {
            return Ok(());
        };
        if let Some(delta) = choice.delta {
            for text in [delta.reasoning_content, delta.reasoning]
                .into_iter()
                .flatten()
            {
                if !text.is_empty() {
                    out.push_back(ChatDelta::Reasoning(text.into_owned()));
                }
            }
            if let Some(text) = delta.content.filter(|t| !t.is_empty()) {
                self.saw_content = true;
                self.think
                    .push(text, |piece| out.push_back(piece_delta(piece)));
            }
            for (position, call) in delta.tool_calls.into_iter().flatten().enumerate() {
                let index = call.index.unwrap_or(position as u64);
                let entry = self.calls.entry(index).or_default();
                // Some servers repeat the id (or send a new one) on every chunk: the first
                // one names the call.
                if entry.id.is_empty()
                    && let Some(id) = call.id
                {
                    entry.id = id.into_owned();
                }
                if let Some(function) = call.function {
                    if let Some(name) = function.name.filter(|n| !n.is_empty())
                        && entry.name.is_empty()
                    {
                        entry.name = name.into_owned();
                    }
                    if let Some(arguments) = function.arguments {
                        entry.arguments.push_str(&arguments);
                    }
                }
            }
        }
        if let Some(reason) = choice.finish_reason {
            self.finish = Some(match reason.as_ref() {
                "stop" => FinishReason::Stop,
                "tool_calls" | "function_call" => FinishReason::ToolCalls,
                "length" => FinishReason::Length,
                "content_filter" => FinishReason::ContentFilter,
                _ => FinishReason::Unknown,
            });
        }
        Ok(())
    }

    fn finish(&mut self, out: &mut VecDeque<ChatDelta>) {
        if self.finished {
            return;
        }
        self.finished = true;
        self.think.finish(|piece| out.push_back(piece_delta(piece)));
        let calls = std::mem::take(&mut self.calls);
        let had_calls = !calls.is_empty();
        for (index, call) in calls {
            out.push_back(ChatDelta::ToolCall(ModelToolCall {
                id: if call.id.is_empty() {
                    format!("call_{index}")
                } else {
                    call.id
                },
                name: call.name,
                arguments: call.arguments,
            }));
        }
        let reason = match self.finish {
            Some(reason) => reason,
            None if had_calls => FinishReason::ToolCalls,
            None if self.saw_content => FinishReason::Stop,
            None => FinishReason::Unknown,
        };
        out.push_back(ChatDelta::Finish {
            reason,
            usage: self.usage,
        });
    }
}

fn piece_delta(piece: Piece) -> ChatDelta {
    match piece {
        Piece::Reasoning(text) => ChatDelta::Reasoning(text),
        Piece::Content(text) => ChatDelta::Content(text),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ToolDefinition;
    use serde_json::json;

    async fn run(sse: &str) -> Vec<Result<ChatDelta, ModelError>> {
        let chunks: Vec<Result<bytes::Bytes, std::io::Error>> = sse
            .as_bytes()
            .chunks(7) // arbitrary cuts, as the network makes them
            .map(|c| Ok(bytes::Bytes::copy_from_slice(c)))
            .collect();
        decode(futures_util::stream::iter(chunks)).collect().await
    }

    fn ok(deltas: Vec<Result<ChatDelta, ModelError>>) -> Vec<ChatDelta> {
        deltas.into_iter().map(Result::unwrap).collect()
    }

    #[tokio::test(start_paused = true)]
    async fn the_body_is_read_to_its_end_after_done_within_a_grace() {
        let answer = "data: {\"choices\":[{\"delta\":{\"content\":\"hi\"}}]}\n\ndata: [DONE]\n\n";
        let ended = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
        let end = {
            let ended = ended.clone();
            futures_util::stream::poll_fn(move |_| {
                ended.store(true, std::sync::atomic::Ordering::SeqCst);
                std::task::Poll::Ready(None)
            })
        };
        let body =
            futures_util::stream::iter([Ok::<_, std::io::Error>(bytes::Bytes::from(answer))])
                .chain(end);
        let deltas = ok(decode(Box::pin(body)).collect().await);
        assert_eq!(deltas[0], ChatDelta::Content("hi".into()));
        assert!(
            ended.load(std::sync::atomic::Ordering::SeqCst),
            "the end was read"
        );

        // A server that keeps the stream open after `[DONE]` does not hold the call.
        let body =
            futures_util::stream::iter([Ok::<_, std::io::Error>(bytes::Bytes::from(answer))])
                .chain(futures_util::stream::pending());
        let started = tokio::time::Instant::now();
        let deltas = ok(decode(Box::pin(body)).collect().await);
        assert_eq!(deltas.len(), 2, "{deltas:?}");
        assert!(started.elapsed() <= Duration::from_millis(250));
    }

    #[tokio::test]
    async fn parallel_tool_calls_interleave_by_index() {
        let sse = concat!(
            ": keep-alive\n\n",
            "data: {\"choices\":[{\"delta\":{\"role\":\"assistant\",\"content\":null,\"tool_calls\":[{\"index\":0,\"id\":\"a\",\"function\":{\"name\":\"calculator\",\"arguments\":\"\"}}]}}]}\n\n",
            "data: {\"choices\":[{\"delta\":{\"tool_calls\":[{\"index\":1,\"id\":\"b\",\"function\":{\"name\":\"current_time\",\"arguments\":\"{\\\"time\"}}]}}]}\n\n",
            "data: {\"choices\":[{\"delta\":{\"tool_calls\":[{\"index\":0,\"id\":\"other\",\"function\":{\"arguments\":\"{\\\"expression\\\":\"}}]}}]}\n\n",
            "data: {\"choices\":[{\"delta\":{\"tool_calls\":[{\"index\":1,\"function\":{\"arguments\":\"zone\\\":\\\"UTC\\\"}\"}}]}}]}\n\n",
            "data: {\"choices\":[{\"delta\":{\"tool_calls\":[{\"index\":0,\"function\":{\"arguments\":\"\\\"1+1\\\"}\"}}]},\"finish_reason\":\"tool_calls\"}]}\n\n",
            "data: {\"choices\":[],\"usage\":{\"prompt_tokens\":12,\"completion_tokens\":7}}\n\n",
            "data: [DONE]\n\n",
        );
        assert_eq!(
            ok(run(sse).await),
            [
                ChatDelta::ToolCall(ModelToolCall {
                    id: "a".into(),
                    name: "calculator".into(),
                    arguments: "{\"expression\":\"1+1\"}".into()
                }),
                ChatDelta::ToolCall(ModelToolCall {
                    id: "b".into(),
                    name: "current_time".into(),
                    arguments: "{\"timezone\":\"UTC\"}".into()
                }),
                ChatDelta::Finish {
                    reason: FinishReason::ToolCalls,
                    usage: Some(Usage {
                        prompt_tokens: 12,
                        completion_tokens: 7
                    })
                },
            ]
        );
    }

    #[tokio::test]
    async fn reasoning_and_think_tags_become_reasoning() {
        let sse = concat!(
            "data: {\"choices\":[{\"delta\":{\"reasoning_content\":\"hmm\"}}]}\n\n",
            "data: {\"choices\":[{\"delta\":{\"content\":\"<think>more\"}}]}\n\n",
            "data: {\"choices\":[{\"delta\":{\"content\":\"</think>Four.\"},\"finish_reason\":\"stop\"}]}\n\n",
        );
        assert_eq!(
            ok(run(sse).await),
            [
                ChatDelta::Reasoning("hmm".into()),
                ChatDelta::Reasoning("more".into()),
                ChatDelta::Content("Four.".into()),
                ChatDelta::Finish {
                    reason: FinishReason::Stop,
                    usage: None
                },
            ]
        );
    }

    #[tokio::test]
    async fn a_missing_finish_chunk_and_done_still_end_the_call() {
        let sse = "data: {\"choices\":[{\"delta\":{\"content\":\"hi\"}}]}\n\n";
        assert_eq!(
            ok(run(sse).await),
            [
                ChatDelta::Content("hi".into()),
                ChatDelta::Finish {
                    reason: FinishReason::Stop,
                    usage: None
                }
            ]
        );
    }

    #[tokio::test]
    async fn the_first_choice_counts_and_null_choices_are_none() {
        let sse = concat!(
            "data: {\"choices\":null,\"id\":\"x\"}\n\n",
            "data: {\"choices\":[{\"delta\":{\"content\":\"a <b> \\\"c\\\"\"}},{\"delta\":{\"content\":\"ignored\"}}]}\n\n",
            "data: {\"choices\":[{\"delta\":{},\"finish_reason\":\"stop\"},{\"delta\":{\"content\":[1,{}]}}]}\n\n",
        );
        assert_eq!(
            ok(run(sse).await),
            [
                ChatDelta::Content("a <b> \"c\"".into()),
                ChatDelta::Finish {
                    reason: FinishReason::Stop,
                    usage: None
                }
            ]
        );
    }

    #[tokio::test]
    async fn malformed_json_is_an_error_not_a_hang() {
        let deltas =
            run("data: {\"choices\":[{\"delta\":{\"content\":\"a\"}}]}\n\ndata: {oops\n\n").await;
        assert_eq!(deltas.len(), 2);
        assert!(matches!(&deltas[1], Err(ModelError::Stream(m)) if m.contains("invalid JSON")));
    }

    #[tokio::test]
    async fn in_stream_errors_are_reported() {
        let deltas = run("data: {\"error\":{\"message\":\"overloaded\"}}\n\n").await;
        assert!(matches!(&deltas[0], Err(ModelError::Stream(m)) if m.contains("overloaded")));
    }

    #[test]
    fn request_bodies_follow_the_api() {
        let body = request_body(&ChatRequest {
            model: "m".into(),
            messages: vec![
                ChatMessage::System("s".into()),
                ChatMessage::User("u".into()),
                ChatMessage::Assistant {
                    content: String::new(),
                    tool_calls: vec![ModelToolCall {
                        id: "c".into(),
                        name: "t".into(),
                        arguments: "{}".into(),
                    }],
                },
                ChatMessage::Tool {
                    call_id: "c".into(),
                    content: "42".into(),
                },
            ],
            tools: [ToolDefinition {
                name: "t".into(),
                description: "d".into(),
                parameters: json!({"type": "object"}).into(),
            }]
            .into(),
            parallel_tool_calls: true,
            temperature: Some(0.5),
            max_tokens: Some(10),
            stop: vec!["Observation:".into()],
        });
        let body: Value = serde_json::from_slice(&body).unwrap();
        assert_eq!(body["stream"], true);
        assert_eq!(body["model"], "m");
        assert_eq!(body["stream_options"]["include_usage"], true);
        assert_eq!(
            body["messages"][0],
            json!({"role": "system", "content": "s"})
        );
        assert_eq!(body["messages"][1], json!({"role": "user", "content": "u"}));
        assert_eq!(body["messages"][2]["content"], Value::Null);
        assert_eq!(
            body["messages"][2]["tool_calls"][0]["function"]["name"],
            "t"
        );
        assert_eq!(body["messages"][3]["tool_call_id"], "c");
        assert_eq!(body["tools"][0]["function"]["parameters"]["type"], "object");
        assert_eq!(
            body["messages"][2]["tool_calls"][0],
            json!({"id": "c", "type": "function", "function": {"name": "t", "arguments": "{}"}})
        );
        assert_eq!(
            body["tools"][0],
            json!({"type": "function", "function": {
                "name": "t", "description": "d", "parameters": {"type": "object"}}})
        );
        assert_eq!(body["parallel_tool_calls"], true);
        assert_eq!(body["temperature"], 0.5);
        assert_eq!(body["stop"][0], "Observation:");
        assert_eq!(body["max_tokens"], 10);

        // Nothing optional is sent when the request leaves it out.
        let plain = request_body(&ChatRequest {
            model: "m".into(),
            messages: vec![ChatMessage::Assistant {
                content: "a".into(),
                tool_calls: Vec::new(),
            }],
            ..ChatRequest::default()
        });
        let plain: Value = serde_json::from_slice(&plain).unwrap();
        assert_eq!(
            plain,
            json!({"model": "m", "messages": [{"role": "assistant", "content": "a"}],
                "stream": true, "stream_options": {"include_usage": true}})
        );
    }

    #[test]
    fn backoff_honours_retry_after_and_the_cap() {
        let policy = RetryPolicy::default();
        assert_eq!(
            policy.delay(0, Some(Duration::from_secs(2))),
            Duration::from_secs(2)
        );
        assert_eq!(
            policy.delay(0, Some(Duration::from_secs(600))),
            policy.max_delay
        );
        for attempt in 0..5 {
            assert!(policy.delay(attempt, None) <= policy.base_delay * (1 << attempt));
        }
    }
}
