//! OpenAI-compatible chat completions, streamed over SSE.

use std::{
    borrow::Cow, collections::BTreeMap, collections::VecDeque, pin::Pin, sync::Arc, time::Duration,
};

use agentrt_h2c::{Failure, H2cClient};
use futures_util::{Stream, StreamExt};
use http::header::{ACCEPT, AUTHORIZATION, CONTENT_TYPE, HeaderMap, HeaderValue, RETRY_AFTER};
use http_body_util::BodyDataStream;
use serde_json::Value;
use tokio_util::sync::CancellationToken;
use tracing::{debug, warn};

use crate::{
    ChatDelta, ChatMessage, ChatModel, ChatRequest, ChatStream, FinishReason, ModelError,
    ModelToolCall, ProviderSettings, ToolDefinition, Usage,
    think::{Piece, ThinkSplitter},
};

/// Default bound of one SSE event (and so of one line) of a streamed answer, in bytes. A
/// provider that sends one endless line grew the server by gigabytes; real chunks carry a
/// few characters, but an answer streamed as one delta of a few megabytes must still
/// pass (the engine splits it into events of its own).
pub const MAX_SSE_EVENT_BYTES: usize = 8 * 1024 * 1024;
/// Default bound of one tool call's arguments, assembled from their fragments, in bytes.
pub const MAX_TOOL_ARGUMENTS_BYTES: usize = 1024 * 1024;
/// Default bound of the body read from a failed or unreadable response, in bytes; what
/// passes it is cut, and the message says so. An `error:` line in an event stream is read
/// up to this bound too.
pub const MAX_ERROR_BODY_BYTES: usize = 16 * 1024;
/// Default bound of the text of one reply, its answer, its reasoning and its tool calls
/// (their ids, names and arguments) together, in bytes.
/// Each event is bounded, but a model looping without `max_tokens`, or a server that
/// misbehaves, streamed events until the call's timeout, and the reply is held whole (by
/// the engine, and in the conversation of the next round). Real replies are far smaller:
/// 16 MiB is some four million tokens.
pub const MAX_REPLY_TEXT_BYTES: usize = 16 * 1024 * 1024;

/// Bounds on what a provider's answer may make the client hold. Passing one ends the call
/// with [`ModelError::TooLarge`] naming it. Checking them costs a length comparison per
/// chunk, no copy.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ResponseLimits {
    /// One SSE event, its lines together, in bytes ([`MAX_SSE_EVENT_BYTES`]).
    pub max_event_bytes: usize,
    /// One tool call's arguments, in bytes ([`MAX_TOOL_ARGUMENTS_BYTES`]).
    pub max_tool_arguments_bytes: usize,
    /// The body read from an error response, in bytes ([`MAX_ERROR_BODY_BYTES`]).
    pub max_error_body_bytes: usize,
    /// The text of one reply, answer, reasoning and tool calls together, in bytes
    /// ([`MAX_REPLY_TEXT_BYTES`]).
    pub max_reply_text_bytes: usize,
}

impl Default for ResponseLimits {
    fn default() -> Self {
        Self {
            max_event_bytes: MAX_SSE_EVENT_BYTES,
            max_tool_arguments_bytes: MAX_TOOL_ARGUMENTS_BYTES,
            max_error_body_bytes: MAX_ERROR_BODY_BYTES,
            max_reply_text_bytes: MAX_REPLY_TEXT_BYTES,
        }
    }
}

/// How transient failures before the first delta are retried.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RetryPolicy {
    /// Retries after the first attempt.
    pub max_retries: u32,
    /// Backoff of the first retry; doubled each time, with full jitter.
    pub base_delay: Duration,
    /// Longest wait between attempts. A provider that asks for a longer one (its
    /// `Retry-After`) is not asked again: the call fails at once with its answer.
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
    /// The wait before retry number `attempt` (0-based): the provider's `Retry-After` in
    /// full when given, otherwise exponential backoff with full jitter, at most
    /// `max_delay`. `None` when the `Retry-After` is longer than `max_delay`: there is no
    /// retry, for one made sooner than the provider asked would be refused again.
    pub fn delay(&self, attempt: u32, retry_after: Option<Duration>) -> Option<Duration> {
        match retry_after {
            Some(wait) => (wait <= self.max_delay).then_some(wait),
            None => {
                let ceiling = self.base_delay.saturating_mul(1 << attempt.min(16));
                Some(ceiling.mul_f64(fastrand::f64()).min(self.max_delay))
            }
        }
    }
}

/// A client of one OpenAI-compatible provider.
///
/// Calls follow no redirects: a 3xx is an [`ModelError::Http`] error naming the status, so
/// that a provider cannot send the user's prompt to another address.
#[derive(Clone)]
pub struct OpenAiChat {
    transport: std::sync::Arc<Transport>,
    /// The headers of every call, built once (the key marked sensitive).
    headers: HeaderMap,
    retry: RetryPolicy,
    limits: ResponseLimits,
    site: std::sync::Arc<Site>,
    /// The bound on generated tokens is sent as `max_completion_tokens` (OpenAI's and
    /// Azure OpenAI's name, which their reasoning models require) rather than
    /// `max_tokens` (every other server's).
    completion_tokens: bool,
}

/// Whether `url` is OpenAI's or Azure OpenAI's API, whose reasoning models refuse
/// `max_tokens` and take `max_completion_tokens`.
fn takes_max_completion_tokens(url: &str) -> bool {
    reqwest::Url::parse(url)
        .ok()
        .and_then(|url| url.host_str().map(str::to_ascii_lowercase))
        .is_some_and(|host| host == "api.openai.com" || host.ends_with(".openai.azure.com"))
}

/// Who the calls go to, as errors and logs name it.
#[derive(Debug, Clone, Default)]
pub(crate) struct Site {
    /// The provider's configured name; empty when the client was not named.
    provider: String,
    /// The path called, e.g. `/v1/chat/completions`: errors, which reach clients, name the
    /// provider and the path, never the host, which only the log shows.
    path: String,
    /// The URL called, any credentials in it masked, for the log.
    url: String,
}

impl Site {
    pub(crate) fn new(url: &str) -> Self {
        let after_scheme = url.split_once("://").map_or(url, |(_, rest)| rest);
        let path = after_scheme.find('/').map_or("/", |at| &after_scheme[at..]);
        let path = path.split(['?', '#']).next().unwrap_or(path);
        Self {
            provider: String::new(),
            path: path.to_owned(),
            url: mask_credentials(url),
        }
    }

    pub(crate) fn set_provider(&mut self, provider: String) {
        self.provider = provider;
    }

    /// The path called.
    pub(crate) fn path(&self) -> &str {
        &self.path
    }

    /// The URL called, credentials masked.
    pub(crate) fn url(&self) -> &str {
        &self.url
    }

    /// `provider "local"`, or `the provider` when unnamed.
    pub(crate) fn who(&self) -> String {
        if self.provider.is_empty() {
            "the provider".to_owned()
        } else {
            format!("provider {:?}", self.provider)
        }
    }
}

/// `url`, one URL, with the credentials it may carry masked, for logs and messages: a user
/// and password (`http://user:pass@host`), and the value of every query parameter
/// (`?api-key=***`: Azure API Management takes its key as `?subscription-key=`, Google as
/// `?key=`). Unlike [`agentrt_core::mask_url_credentials`], which finds URLs in text, the
/// whole of `url` is one URL: its query runs to its end (a space or a `#` does not end
/// it), and one without a scheme (a `base_url` refused for that) is masked all the same.
pub fn mask_credentials(url: &str) -> String {
    let (scheme, rest) = match url.find("://") {
        Some(at) => url.split_at(at + 3),
        None => ("", url),
    };
    let (before_query, query) = match rest.split_once('?') {
        Some((before, query)) => (before, Some(query)),
        None => (rest, None),
    };
    let authority_end = before_query.find(['/', '#']).unwrap_or(before_query.len());
    let mut shown = String::with_capacity(url.len());
    shown.push_str(scheme);
    match before_query[..authority_end].rfind('@') {
        Some(user_end) => {
            shown.push_str("***");
            shown.push_str(&before_query[user_end..]);
        }
        None => shown.push_str(before_query),
    }
    if let Some(query) = query {
        shown.push('?');
        agentrt_core::push_masked_query(&mut shown, query);
    }
    shown
}

/// The headers of every request to a provider: a JSON body, the answer type wanted, and
/// the API key (kept out of HPACK's dynamic table) when there is one.
pub(crate) fn request_headers(
    settings: &ProviderSettings,
    accept: &'static str,
) -> Result<HeaderMap, ModelError> {
    let mut headers = HeaderMap::new();
    headers.insert(CONTENT_TYPE, HeaderValue::from_static("application/json"));
    headers.insert(ACCEPT, HeaderValue::from_static(accept));
    let key = settings.api_key.expose();
    if !key.is_empty() {
        let (name, value) = match settings.api_key_header.as_deref() {
            Some(name) => (
                http::header::HeaderName::from_bytes(name.as_bytes())
                    .ok()
                    .filter(|name| *name != CONTENT_TYPE && *name != ACCEPT)
                    .ok_or_else(|| {
                        ModelError::Misconfigured(format!(
                            "api_key_header {name:?} is not a header the key can go in"
                        ))
                    })?,
                key.to_owned(),
            ),
            None => (AUTHORIZATION, format!("Bearer {key}")),
        };
        let mut value = HeaderValue::try_from(value).map_err(|_| {
            ModelError::Connect("the API key holds characters a header cannot carry".into())
        })?;
        value.set_sensitive(true);
        headers.insert(name, value);
    }
    Ok(headers)
}

/// How calls reach the provider.
enum Transport {
    /// The general client: HTTP/1.1 or HTTP/2, TLS, proxies.
    General {
        http: reqwest::Client,
        /// Parsed once: parsing it on every call costs more than the rest of the request.
        url: reqwest::Url,
    },
    /// Cleartext HTTP/2 with prior knowledge, over a few shared connections.
    H2c(Box<H2cClient>),
}

const CONNECT_TIMEOUT: Duration = Duration::from_secs(10);

impl OpenAiChat {
    /// A client for `settings`, retrying as `retry` says.
    pub fn new(settings: &ProviderSettings, retry: RetryPolicy) -> Result<Self, ModelError> {
        let url = crate::providers::endpoint(&settings.base_url, "chat/completions");
        let site = Site::new(&url);
        let invalid = |e: &dyn std::fmt::Display| {
            ModelError::Connect(format!("invalid base URL {:?}: {e}", site.url))
        };
        let lean = settings.http_client == crate::HttpClient::Lean;
        let transport = if lean && settings.http2_prior_knowledge && url.starts_with("http://") {
            Transport::H2c(Box::new(
                H2cClient::new(&url, CONNECT_TIMEOUT)
                    .map_err(|e| invalid(&e))?
                    .with_http1_hint("unset http2_prior_knowledge for this provider"),
            ))
        } else {
            Transport::General {
                http: general_client(settings.http2_prior_knowledge)?,
                url: reqwest::Url::parse(&url).map_err(|e| invalid(&e))?,
            }
        };
        let headers = request_headers(settings, "text/event-stream")?;
        Ok(Self {
            transport: std::sync::Arc::new(transport),
            headers,
            retry,
            limits: ResponseLimits::default(),
            site: std::sync::Arc::new(site),
            completion_tokens: takes_max_completion_tokens(&url),
        })
    }

    /// Names the client after its provider's configured name, which its errors then give
    /// (errors reach clients: they name the provider and path, not the host).
    #[must_use]
    pub fn with_name(mut self, provider: impl Into<String>) -> Self {
        let mut site = (*self.site).clone();
        site.provider = provider.into();
        self.site = std::sync::Arc::new(site);
        self
    }

    /// Sets the bounds on what an answer may make the client hold.
    #[must_use]
    pub fn with_limits(mut self, limits: ResponseLimits) -> Self {
        self.limits = limits;
        self
    }

    /// The headers of a call.
    fn call_headers(&self) -> HeaderMap {
        let mut headers = self.headers.clone();
        if agentrt_telemetry::tracing_enabled() {
            // The model call joins the caller's trace: `traceparent` of the `chat` span.
            agentrt_telemetry::inject(&mut headers);
        }
        headers
    }

    async fn send_once(&self, body: &bytes::Bytes) -> Result<ResponseBody, ModelError> {
        match &*self.transport {
            Transport::General { http, url } => {
                // Boxed, so that the general client's large request future does not
                // enlarge every h2c call's future too.
                let mut response = Box::pin(
                    http.post(url.clone())
                        .headers(self.call_headers())
                        .body(body.clone())
                        .send(),
                )
                .await
                .map_err(|e| self.general_error(e))?;
                let status = response.status().as_u16();
                let headers = std::mem::take(response.headers_mut());
                let body = ResponseBody::General(BodyDataStream::new(response.into()));
                self.checked(status, &headers, body).await
            }
            Transport::H2c(client) => {
                let (parts, body) = client
                    .post(body.clone(), self.call_headers())
                    .await
                    .map_err(|e| self.h2c_error(&e))?
                    .into_parts();
                let body = ResponseBody::H2c(body);
                self.checked(parts.status.as_u16(), &parts.headers, body)
                    .await
            }
        }
    }
}

impl OpenAiChat {
    /// The error of a call over h2c that failed. It names the provider, never the address
    /// (which only the log shows: the message reaches clients); a call the server may have
    /// processed (sent, then its connection broke or its stream was reset) is
    /// [`ModelError::LostBeforeAnswer`], whose prompt counts, and only one that was never
    /// sent or that the server did not process is [`ModelError::Connect`].
    /// What a failure of the general client before the answer's headers is: unreachable
    /// only when no connection was made (the call was never sent); a connection lost or
    /// reset after it was sent (a server that crashed during prefill, as llama.cpp's and
    /// Ollama's, which speak HTTP/1.1, can) is [`ModelError::LostBeforeAnswer`], whose
    /// prompt counts, as over h2c.
    fn general_error(&self, e: reqwest::Error) -> ModelError {
        // The URL (and any credentials in it) stays out of the message.
        debug!(url = %self.site.url, error = %error_chain(&e), "model call failed");
        let who = self.site.who();
        let connect = e.is_connect();
        let message = error_chain(&e.without_url());
        if connect {
            ModelError::Connect(format!("{who}: {message}"))
        } else {
            ModelError::LostBeforeAnswer(format!(
                "{who}: the call was cut off after it was sent, before the answer began: \
                 {message}"
            ))
        }
    }

    fn h2c_error(&self, e: &agentrt_h2c::PostError) -> ModelError {
        debug!(url = %self.site.url, failure = ?e.failure, error = %e, "model call failed");
        let who = self.site.who();
        match e.failure {
            Failure::NotHttp2 => ModelError::Misconfigured(format!("{who}: {}", e.message)),
            Failure::Lost => ModelError::LostBeforeAnswer(format!(
                "{who}: the call was cut off after it was sent, before the answer began: {}",
                e.message
            )),
            Failure::Reset => ModelError::LostBeforeAnswer(format!(
                "{who}: the server reset the call after it was sent, before the answer \
                 began: {}",
                e.message
            )),
            Failure::Unreachable | Failure::Unprocessed | Failure::Other => {
                ModelError::Connect(format!("{who}: {}", e.message))
            }
        }
    }
}

/// The general client, with the HTTP/2 settings of [`H2cClient`] for servers that
/// negotiate HTTP/2. It follows no redirects.
pub(crate) fn general_client(http2_prior_knowledge: bool) -> Result<reqwest::Client, ModelError> {
    // TLS uses ring; installing it twice is harmless, so ignore "already installed".
    let _ = rustls::crypto::ring::default_provider().install_default();
    let mut http = reqwest::Client::builder()
        // A 307 would re-send the prompt elsewhere, a 302 turn it into a GET to another
        // host: a redirect is an error, never followed.
        .redirect(reqwest::redirect::Policy::none())
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

impl OpenAiChat {
    /// The body of a successful streaming response; a failed one, or a success that is not
    /// an event stream, becomes its error.
    async fn checked(
        &self,
        status: u16,
        headers: &HeaderMap,
        body: ResponseBody,
    ) -> Result<ResponseBody, ModelError> {
        if !(200..300).contains(&status) {
            return Err(http_error(status, headers, body, &self.site, &self.limits).await);
        }
        // No encoding is asked for: one the body has anyway cannot be read.
        if let Some(encoding) = headers
            .get(http::header::CONTENT_ENCODING)
            .map(|v| String::from_utf8_lossy(v.as_bytes()))
            .filter(|v| !v.trim().eq_ignore_ascii_case("identity"))
        {
            return Err(ModelError::InvalidResponse(format!(
                "{} answered POST {} with content-encoding {encoding:?}, which was not asked \
                 for (the answer is read as it is sent)",
                self.site.who(),
                self.site.path
            )));
        }
        // A server that does not stream (a JSON completion, an HTML page from a proxy)
        // answers something else; no content type at all is given the benefit of the doubt.
        let content_type = headers
            .get(CONTENT_TYPE)
            .map(|v| v.to_str().unwrap_or("(not text)"));
        match content_type {
            Some(kind) if !is_event_stream(kind) => {
                let (text, _) = read_bounded(body, self.limits.max_error_body_bytes).await;
                // A gateway's error sent with a 200 (`{"error": {...}}`) is that error: a
                // rate limit or an overloaded server is then tried again as its status is.
                if let Ok(value) = serde_json::from_str::<Value>(text.trim())
                    && value["error"].is_object()
                {
                    return Err(in_stream_error(&value["error"]));
                }
                let shown: String = text.trim().chars().take(300).collect();
                Err(ModelError::InvalidResponse(format!(
                    "{} answered POST {} with {status} and content-type {kind:?}, not an \
                     event stream (text/event-stream): {shown}",
                    self.site.who(),
                    self.site.path
                )))
            }
            _ => Ok(body),
        }
    }
}

/// Whether a content type is `text/event-stream` (parameters and case aside).
fn is_event_stream(content_type: &str) -> bool {
    content_type
        .split(';')
        .next()
        .is_some_and(|kind| kind.trim().eq_ignore_ascii_case("text/event-stream"))
}

/// How long the body of an error answer (or of one that does not stream) is read: what
/// came by then is its message. A proxy that sends `503` and `Retry-After` and then stalls
/// its body would otherwise hold the call to its timeout, and the status (and its retry)
/// would be lost.
const ERROR_BODY_PATIENCE: Duration = Duration::from_secs(5);

/// Reads at most `limit` bytes of a body, as text, for at most [`ERROR_BODY_PATIENCE`];
/// whether it was cut there.
pub(crate) async fn read_bounded<S, E>(mut chunks: S, limit: usize) -> (String, bool)
where
    S: Stream<Item = Result<bytes::Bytes, E>> + Unpin,
{
    let deadline = tokio::time::Instant::now() + ERROR_BODY_PATIENCE;
    let mut body = Vec::new();
    let mut cut = false;
    loop {
        let chunk = match tokio::time::timeout_at(deadline, chunks.next()).await {
            Ok(Some(Ok(chunk))) => chunk,
            Ok(_) => break,
            Err(_) => {
                cut = true;
                break;
            }
        };
        let room = limit - body.len();
        if chunk.len() > room {
            body.extend_from_slice(&chunk[..room]);
            cut = true;
            break;
        }
        body.extend_from_slice(&chunk);
    }
    (String::from_utf8_lossy(&body).into_owned(), cut)
}

/// A response body, from either transport, as a stream of bytes.
enum ResponseBody {
    General(BodyDataStream<reqwest::Body>),
    H2c(agentrt_h2c::H2Body),
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

impl ChatModel for OpenAiChat {
    // Not an `async fn`: a run in flight holds this future while it waits for the model,
    // and an `async fn` would keep the request in it (twice: the argument and its local)
    // though only its encoded body is sent.
    fn stream<'a, 'f>(
        &'a self,
        request: ChatRequest,
        cancel: CancellationToken,
    ) -> Pin<Box<dyn Future<Output = Result<ChatStream, ModelError>> + Send + 'f>>
    where
        'a: 'f,
    {
        let body = held(request_body(&request, self.completion_tokens));
        let deadline = request.deadline;
        let offered = request.tools.clone();
        // The body is all that is sent; the messages need not wait with it for the reply.
        drop(request);
        Box::pin(self.call(body, deadline, offered, cancel))
    }
}

impl OpenAiChat {
    /// [`ChatModel::stream`] of an encoded request (an `async` block: an `async fn` would
    /// keep its arguments twice).
    #[allow(
        clippy::manual_async_fn,
        reason = "an async fn keeps its arguments twice"
    )]
    fn call(
        &self,
        body: bytes::Bytes,
        deadline: Option<tokio::time::Instant>,
        offered: Arc<[ToolDefinition]>,
        cancel: CancellationToken,
    ) -> impl Future<Output = Result<ChatStream, ModelError>> + Send + '_ {
        async move {
            let mut attempt = 0;
            loop {
                let outcome = tokio::select! {
                    outcome = self.send_once(&body) => outcome,
                    () = cancel.cancelled() => return Err(ModelError::Cancelled),
                };
                let error = match outcome {
                    Ok(body) => {
                        // Nothing has streamed before the first delta: a connection lost
                        // until then is as transient as one lost before the answer began.
                        let mut deltas = decode(body, self.limits, offered.clone());
                        let first = tokio::select! {
                            first = std::future::poll_fn(|cx| deltas.poll_first(cx)) => first,
                            () = cancel.cancelled() => return Err(ModelError::Cancelled),
                        };
                        match first {
                            Ok(()) => return Ok(Box::pin(deltas) as ChatStream),
                            Err(ModelError::Lost(lost)) => ModelError::LostBeforeAnswer(format!(
                                "{}: the connection was lost before the answer began: {lost}",
                                self.site.who()
                            )),
                            // An error the provider sent before the answer began.
                            Err(error) => error,
                        }
                    }
                    Err(error) => error,
                };
                if !error.is_retryable() || attempt >= self.retry.max_retries {
                    return Err(error);
                }
                let retry_after = match &error {
                    ModelError::Http { retry_after, .. } => *retry_after,
                    _ => None,
                };
                // A wait longer than the policy allows, or past the deadline, is not
                // waited for: the provider's answer is the call's, at once (a timeout
                // later, or the same refusal after a shorter wait, would hide it).
                let Some(delay) = self.retry.delay(attempt, retry_after) else {
                    let why = format!(
                        "the provider asked to wait {:?} before a retry, longer than the \
                         longest wait between attempts ({:?})",
                        retry_after.unwrap_or_default(),
                        self.retry.max_delay
                    );
                    return Err(not_retried(error, &why));
                };
                if deadline.is_some_and(|deadline| tokio::time::Instant::now() + delay >= deadline)
                {
                    let why = format!(
                        "the wait before a retry ({delay:?}) would pass the call's deadline"
                    );
                    return Err(not_retried(error, &why));
                }
                warn!(error = %error, attempt = attempt + 1, ?delay, "model call failed, retrying");
                tokio::select! {
                    () = tokio::time::sleep(delay) => {}
                    () = cancel.cancelled() => return Err(ModelError::Cancelled),
                }
                attempt += 1;
            }
        }
    }
}

/// The error a retry would have followed, saying why it was not made.
fn not_retried(error: ModelError, why: &str) -> ModelError {
    let why = format!("not retried: {why}");
    match error {
        ModelError::Http {
            status,
            message,
            retry_after,
        } => ModelError::Http {
            status,
            message: format!("{message} ({why})"),
            retry_after,
        },
        ModelError::Connect(message) => ModelError::Connect(format!("{message} ({why})")),
        ModelError::LostBeforeAnswer(message) => {
            ModelError::LostBeforeAnswer(format!("{message} ({why})"))
        }
        other => other,
    }
}

pub(crate) use agentrt_h2c::error_chain;

/// Reads a failed response: the provider's JSON `error.message` when there is one, at most
/// `limits.max_error_body_bytes` of it. A 404 names the path called (a wrong `base_url` is
/// the usual cause), a redirect says it was not followed.
pub(crate) async fn http_error<S, E>(
    status: u16,
    headers: &HeaderMap,
    chunks: S,
    site: &Site,
    limits: &ResponseLimits,
) -> ModelError
where
    S: Stream<Item = Result<bytes::Bytes, E>> + Unpin,
{
    let retry_after = retry_after_of(headers);
    if (300..400).contains(&status) {
        let location = headers
            .get(http::header::LOCATION)
            .map(|v| mask_credentials(&String::from_utf8_lossy(v.as_bytes())));
        warn!(url = %site.url, ?location, status, "model provider answered a redirect; not followed");
        return ModelError::Http {
            status,
            message: format!(
                "{} answered POST {} with a redirect, which is not followed; set its base_url \
                 to the address that answers",
                site.who(),
                site.path
            ),
            retry_after: None,
        };
    }
    let (text, cut) = read_bounded(chunks, limits.max_error_body_bytes).await;
    let parsed = serde_json::from_str::<Value>(&text).ok();
    let mut message = parsed
        .as_ref()
        .and_then(|v| {
            v["error"]["message"]
                .as_str()
                .or_else(|| v["error"].as_str())
                .or_else(|| v["message"].as_str())
                .or_else(|| v["detail"].as_str())
                .map(str::to_owned)
        })
        .unwrap_or_else(|| text.trim().chars().take(500).collect());
    // The error's code says what its status does not: a 429 of `insufficient_quota` (a
    // billing matter, not a rate) is not retried.
    if let Some(code) = parsed
        .as_ref()
        .and_then(|v| v["error"]["code"].as_str())
        .filter(|code| !code.is_empty() && code.len() <= 64 && !message.contains(code))
    {
        message.push_str(&format!(" ({code})"));
    }
    if cut {
        message.push_str(&format!(
            " [error body cut at {} bytes]",
            limits.max_error_body_bytes
        ));
    }
    if status == 404 {
        // Once every 10 s at most: a client's config names the model, and may name one
        // the provider does not have on every call.
        static WARNINGS: agentrt_core::throttle::Throttle =
            agentrt_core::throttle::Throttle::new(std::time::Duration::from_secs(10));
        if let Some(left_out) = WARNINGS.take() {
            warn!(url = %site.url, status, left_out, "model provider answered 404 (left_out: those since the last such warning)");
        }
        message = format!(
            "{} answered POST {} with 404 ({message}); check the model name and the \
             provider's base_url",
            site.who(),
            site.path
        );
    }
    ModelError::Http {
        status,
        message,
        retry_after,
    }
}

/// The header in which OpenAI and Azure OpenAI say the wait more precisely than in
/// `Retry-After`, in milliseconds.
const RETRY_AFTER_MS: &str = "retry-after-ms";

/// The wait a failed response asks for before a retry: its `retry-after-ms` when it can be
/// read, otherwise its `Retry-After`.
fn retry_after_of(headers: &HeaderMap) -> Option<Duration> {
    let header = |name| headers.get(name).and_then(|v| v.to_str().ok());
    header(RETRY_AFTER_MS)
        .and_then(|ms| ms.trim().parse::<f64>().ok())
        .and_then(|ms| Duration::try_from_secs_f64(ms / 1000.0).ok())
        .or_else(|| header(RETRY_AFTER.as_str()).and_then(retry_after_delay))
}

/// The wait a `Retry-After` value asks for: seconds, or an HTTP date (RFC 9110, section
/// 10.2.3), a date already past asking for none.
fn retry_after_delay(value: &str) -> Option<Duration> {
    let value = value.trim();
    if let Ok(seconds) = value.parse::<f64>() {
        return Duration::try_from_secs_f64(seconds).ok();
    }
    let at = httpdate::parse_http_date(value).ok()?;
    Some(
        at.duration_since(std::time::SystemTime::now())
            .unwrap_or_default(),
    )
}

/// The JSON body of a streaming chat completions request, serialized straight from the
/// request (no intermediate JSON tree: this runs on every model call).
/// `body` as it is kept until the call is answered (for a retry): in a buffer of its own
/// size when growing it left much room spare (it doubled as it was written), for that
/// room would be held by every call in flight.
fn held(body: Vec<u8>) -> bytes::Bytes {
    if body.capacity() - body.len() > body.len() / 8 {
        bytes::Bytes::copy_from_slice(&body)
    } else {
        bytes::Bytes::from(body)
    }
}

pub(crate) fn request_body(request: &ChatRequest, completion_tokens: bool) -> Vec<u8> {
    let body = Body {
        model: &request.model,
        messages: request.messages.iter().map(WireMessage).collect(),
        stream: true,
        stream_options: StreamOptions {
            include_usage: true,
        },
        tools: request.tools.iter().map(WireTool::new).collect(),
        // Only `false`, and only with tools: `true` is the API's default, and OpenAI's
        // reasoning models (o1, o3, o4-mini) refuse the parameter whatever its value.
        parallel_tool_calls: (!request.tools.is_empty()
            && !request.parallel_tool_calls
            && !request.no_calls)
            .then_some(false),
        tool_choice: (!request.tools.is_empty() && request.no_calls).then_some("none"),
        temperature: request.temperature,
        max_tokens: request.max_tokens.filter(|_| !completion_tokens),
        max_completion_tokens: request.max_tokens.filter(|_| completion_tokens),
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
    tool_choice: Option<&'static str>,
    #[serde(skip_serializing_if = "Option::is_none")]
    temperature: Option<f32>,
    #[serde(skip_serializing_if = "Option::is_none")]
    max_tokens: Option<u32>,
    #[serde(skip_serializing_if = "Option::is_none")]
    max_completion_tokens: Option<u32>,
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
                // Never `null`: strict servers (llama-cpp-python, mockllm) refuse it with a
                // 500, while every server takes a string, empty or the text written before
                // the calls.
                map.serialize_entry("content", content)?;
                let calls: Vec<WireCall<'_>> = tool_calls
                    .iter()
                    .map(|c| WireCall {
                        id: &c.id,
                        r#type: "function",
                        function: WireFunction {
                            name: &c.name,
                            description: None,
                            parameters: None,
                            arguments: Some(sent_arguments(&c.arguments)),
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

/// A tool call's arguments as they are sent back in the conversation: as the model wrote
/// them when they are a JSON object, otherwise `{}`. Arguments that are not one (cut
/// short, empty, a string) have had their call answered with a result saying so; sent
/// back as written, they would make servers that parse every call's arguments (vLLM,
/// Ollama) refuse the whole request, and so every later round of the run. Checked without
/// building the value: this runs for every call of every round.
fn sent_arguments(arguments: &str) -> &str {
    let object = arguments.trim_start().starts_with('{')
        && serde_json::from_str::<serde::de::IgnoredAny>(arguments).is_ok();
    if object { arguments } else { "{}" }
}

/// Trailing events read after `[DONE]` so that the body is complete when it is dropped. A
/// body dropped early is reset: an HTTP/1.1 connection then cannot be reused, and over
/// HTTP/2 the frames still in flight for the reset stream count as protocol errors, of
/// which h2 tolerates 1,024 per connection before it closes it with every call on it.
const MAX_TRAILING_EVENTS: usize = 16;
/// How long a server that keeps the stream open after `[DONE]` is given to close it. The
/// end usually comes with `[DONE]`, and is read at once; but under load the task that reads
/// the connection may not run for hundreds of milliseconds, and with 200 ms here most
/// answers at 100,000 runs in flight were reset though their end had arrived: thousands of
/// needless RST_STREAMs a second, the kind that providers' edges count as rapid resets, and
/// through the general client (h2's default reset memory) 51,000 to 87,000 failed runs of
/// 100,000. At 2 s, none failed (`agentrt-bench --model-client general --scale`). A server
/// that really keeps its streams open costs each answer this long.
const DRAIN_GRACE: Duration = Duration::from_secs(2);

/// Turns an SSE byte stream into deltas.
fn decode<S, E>(
    bytes: S,
    limits: ResponseLimits,
    offered: std::sync::Arc<[ToolDefinition]>,
) -> Decoder<Bounded<S>>
where
    S: Stream<Item = Result<bytes::Bytes, E>> + Send + Unpin + 'static,
    E: std::error::Error + Send + Sync + 'static,
{
    Decoder {
        events: sse_stream::SseByteStream::new(Bounded::new(bytes, &limits)),
        assembler: Assembler {
            max_arguments: limits.max_tool_arguments_bytes,
            max_text: limits.max_reply_text_bytes,
            offered,
            ..Assembler::default()
        },
        ready: VecDeque::new(),
        failure: None,
        state: DecodeState::Streaming,
        finish_grace: None,
    }
}

/// Most tool calls one reply may make: a model looping on calls (or a server sending
/// thousands in one event) ends the call instead of making them all.
const MAX_CALLS_PER_REPLY: usize = 128;

/// The bytes of an event stream on their way to the SSE parser, with the bytes since the
/// last line end and since the last event end (an empty line) counted: an event longer
/// than the bound ends the body with [`ModelError::TooLarge`], and a body that ends inside
/// a line with [`ModelError::Incomplete`] (the parser would drop that line silently).
/// A line of the `error` field ends the body with the error it carries ([`ErrorField`]).
/// Chunks pass uncopied; each is scanned backwards to its last line end, which for a chunk
/// of whole events is its last byte, and forwards from line start to line start.
struct Bounded<S> {
    inner: S,
    limit: usize,
    /// Bytes since the last line end.
    line: usize,
    /// Bytes since the last empty line.
    event: usize,
    /// The last two bytes seen, for line and event ends split between chunks.
    last: [u8; 2],
    ended: bool,
    /// Looks for an `error:` line.
    error_field: ErrorField,
    /// The error an `error:` line reported, given once the bytes before the line are.
    reported: Option<ModelError>,
}

impl<S> Bounded<S> {
    fn new(inner: S, limits: &ResponseLimits) -> Self {
        Self {
            inner,
            limit: limits.max_event_bytes,
            line: 0,
            event: 0,
            last: [b'\n', b'\n'],
            ended: false,
            error_field: ErrorField::new(limits.max_error_body_bytes),
            reported: None,
        }
    }

    /// Counts `chunk`.
    fn count(&mut self, chunk: &[u8]) {
        let at = |i: isize| -> u8 {
            match usize::try_from(i) {
                Ok(i) => chunk[i],
                // Before the chunk: the end of the previous ones (i is -1 or -2 here).
                Err(_) => self.last[usize::try_from(2 + i).unwrap_or(0)],
            }
        };
        let is_end = |b: u8| b == b'\n' || b == b'\r';
        let mut line_end = None;
        let mut event_end = None;
        for i in (0..chunk.len()).rev() {
            let byte = chunk[i];
            if !is_end(byte) {
                continue;
            }
            line_end.get_or_insert(i);
            // An empty line ends the event: LF LF, CR CR, LF CR, LF CR LF, CR CR LF.
            let i = i as isize;
            let before = at(i - 1);
            let empty_line = match byte {
                b'\n' => before == b'\n' || (before == b'\r' && is_end(at(i - 2))),
                _ => is_end(before),
            };
            if empty_line {
                event_end = Some(i as usize);
                break;
            }
        }
        self.line = line_end.map_or(self.line + chunk.len(), |end| chunk.len() - end - 1);
        self.event = event_end.map_or(self.event + chunk.len(), |end| chunk.len() - end - 1);
        match chunk {
            [.., a, b] => self.last = [*a, *b],
            [b] => self.last = [self.last[1], *b],
            [] => {}
        }
    }
}

impl<S, E> Stream for Bounded<S>
where
    S: Stream<Item = Result<bytes::Bytes, E>> + Unpin,
    E: std::error::Error + Send + Sync + 'static,
{
    type Item = Result<bytes::Bytes, ModelError>;

    fn poll_next(
        self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<Option<Self::Item>> {
        use std::task::Poll;
        let this = self.get_mut();
        loop {
            if this.ended {
                return Poll::Ready(None);
            }
            if let Some(error) = this.reported.take() {
                this.ended = true;
                return Poll::Ready(Some(Err(error)));
            }
            let item = match std::task::ready!(this.inner.poll_next_unpin(cx)) {
                Some(Ok(mut chunk)) => {
                    if let Some(start) = this.error_field.scan(&chunk) {
                        // What came before the `error:` line passes; the error follows.
                        chunk.truncate(start);
                        this.reported = this.error_field.read();
                        if chunk.is_empty() {
                            continue;
                        }
                    }
                    this.count(&chunk);
                    if this.event <= this.limit {
                        return Poll::Ready(Some(Ok(chunk)));
                    }
                    ModelError::TooLarge {
                        what: if this.line > this.limit {
                            "one SSE line of the answer"
                        } else {
                            "one SSE event of the answer"
                        },
                        limit: this.limit,
                    }
                }
                // An `error:` line the body ended in says more than the end.
                Some(Err(e)) => this
                    .error_field
                    .cut_short()
                    .unwrap_or_else(|| ModelError::Lost(error_chain(&e))),
                None => match this.error_field.cut_short() {
                    Some(error) => error,
                    None if this.line > 0 => ModelError::Incomplete(format!(
                        "the stream ended inside a line ({} bytes after the last line end)",
                        this.line
                    )),
                    None => return Poll::Ready(None),
                },
            };
            this.ended = true;
            return Poll::Ready(Some(Err(item)));
        }
    }
}

/// How a line of the `error` field begins. llama.cpp's server reports a failure in the
/// stream (`context shift is disabled`, a slot that failed) as such a line,
/// `error: {"code":500,"message":"...","type":"server_error"}`, then sends `[DONE]`.
const ERROR_FIELD: &[u8] = b"error:";
/// The same at the start of a body that begins with a byte order mark.
const ERROR_FIELD_AFTER_BOM: &[u8] = b"\xEF\xBB\xBFerror:";

/// Finds the first line of the `error` field in an event stream, and reads its value, at
/// most `limit` bytes of it. The SSE parser knows only the spec's fields: it ignores a line
/// of another (or, built with sse-stream's `strict-fields`, refuses it without saying
/// what it held), so that llama.cpp's error would be lost, and the `[DONE]` after it would
/// make what streamed before look like a whole answer. Costs a comparison of a line's
/// first byte (two or so for lines beginning with `e`), and a search for its end.
struct ErrorField {
    /// The first bytes of the current line, while they may still begin the field.
    head: [u8; ERROR_FIELD_AFTER_BOM.len()],
    head_len: usize,
    line: LineKind,
    /// Whether the current line is the body's first, which may begin with a byte order
    /// mark.
    first_line: bool,
    /// The field's value read so far.
    value: Vec<u8>,
    limit: usize,
}

/// What the current line is, as far as [`ErrorField`] is concerned.
#[derive(Clone, Copy, PartialEq, Eq)]
enum LineKind {
    /// Its first bytes do not yet say.
    Undecided,
    /// A line of another field (or an empty line).
    Other,
    /// The `error:` line, its value being read.
    Error,
    /// The `error:` line, its value read to its end (`cut`: to the bound).
    Read { cut: bool },
}

impl ErrorField {
    fn new(limit: usize) -> Self {
        Self {
            head: [0; ERROR_FIELD_AFTER_BOM.len()],
            head_len: 0,
            line: LineKind::Undecided,
            first_line: true,
            value: Vec::new(),
            limit,
        }
    }

    fn is_line_end(byte: u8) -> bool {
        byte == b'\n' || byte == b'\r'
    }

    fn next_line(&mut self) {
        self.line = LineKind::Undecided;
        self.head_len = 0;
        self.first_line = false;
    }

    /// Scans `chunk`: `None` when no `error:` line began in it or before it; otherwise
    /// where that line begins in it (0 when it began before), its value read as far as the
    /// chunk goes.
    fn scan(&mut self, chunk: &[u8]) -> Option<usize> {
        let mut at = 0;
        let mut line_start = 0;
        while at < chunk.len() {
            match self.line {
                LineKind::Other => {
                    let end = chunk[at..].iter().position(|&b| Self::is_line_end(b))?;
                    at += end + 1;
                    line_start = at;
                    self.next_line();
                }
                LineKind::Undecided => {
                    let byte = chunk[at];
                    at += 1;
                    if Self::is_line_end(byte) {
                        line_start = at;
                        self.next_line();
                        continue;
                    }
                    self.head[self.head_len] = byte;
                    self.head_len += 1;
                    let head = &self.head[..self.head_len];
                    let field = if self.first_line && head.first() == Some(&0xEF) {
                        ERROR_FIELD_AFTER_BOM
                    } else {
                        ERROR_FIELD
                    };
                    if head == field {
                        self.line = LineKind::Error;
                    } else if !field.starts_with(head) {
                        self.line = LineKind::Other;
                    }
                }
                LineKind::Error => {
                    let rest = &chunk[at..];
                    let end = rest.iter().position(|&b| Self::is_line_end(b));
                    let room = self.limit - self.value.len();
                    let value = &rest[..end.unwrap_or(rest.len())];
                    self.value
                        .extend_from_slice(&value[..value.len().min(room)]);
                    if value.len() > room {
                        self.line = LineKind::Read { cut: true };
                    } else if end.is_some() {
                        self.line = LineKind::Read { cut: false };
                    }
                    return Some(line_start);
                }
                LineKind::Read { .. } => return Some(line_start),
            }
        }
        matches!(self.line, LineKind::Error | LineKind::Read { .. }).then_some(line_start)
    }

    /// The error of the `error:` line, once its value is read to its end or its bound.
    fn read(&mut self) -> Option<ModelError> {
        match self.line {
            LineKind::Read { cut } => Some(self.error(cut)),
            _ => None,
        }
    }

    /// The error of an `error:` line the body ended in: what came of its value.
    fn cut_short(&mut self) -> Option<ModelError> {
        match self.line {
            LineKind::Error => Some(self.error(false)),
            LineKind::Read { cut } => Some(self.error(cut)),
            _ => None,
        }
    }

    fn error(&mut self, cut: bool) -> ModelError {
        self.line = LineKind::Other;
        let value = std::mem::take(&mut self.value);
        let value = value.strip_prefix(b" ").unwrap_or(&value);
        let parsed = serde_json::from_slice::<Value>(value)
            .ok()
            .filter(Value::is_object);
        if let Some(parsed) = parsed {
            // The error object itself (llama.cpp's), or one under `error`, as in `data:`.
            let error = match parsed.get("error") {
                Some(error) if !error.is_null() => error,
                _ => &parsed,
            };
            return in_stream_error(error);
        }
        let mut message: String = String::from_utf8_lossy(value)
            .trim()
            .chars()
            .take(500)
            .collect();
        if cut {
            message.push_str(&format!(" [error line cut at {} bytes]", self.limit));
        }
        ModelError::Stream(format!("provider reported an error: {message}"))
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
    /// Once the finish reason came: how long what may follow it (the usage, `[DONE]`, the
    /// end) is waited for before the answer stands without it.
    finish_grace: Option<std::pin::Pin<Box<tokio::time::Sleep>>>,
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

impl<S> Decoder<S>
where
    S: Stream<Item = Result<bytes::Bytes, ModelError>> + Unpin,
{
    /// Waits for the first delta, or the end, and leaves it to be taken; the connection's
    /// loss ([`ModelError::Lost`]), or an error a retry may mend (one the provider sent
    /// in the stream with a rate limit's or an overloaded server's code), when it came
    /// first.
    fn poll_first(
        &mut self,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<Result<(), ModelError>> {
        use std::task::Poll;
        if !self.ready.is_empty() {
            return Poll::Ready(Ok(()));
        }
        match std::task::ready!(std::pin::Pin::new(&mut *self).poll_next(cx)) {
            Some(Ok(delta)) => self.ready.push_front(delta),
            // Nothing streamed yet: as transient as before the answer began.
            Some(Err(error @ ModelError::Lost(_))) => return Poll::Ready(Err(error)),
            Some(Err(error)) if error.is_retryable() => return Poll::Ready(Err(error)),
            // Given by the next poll, as it would have been.
            Some(Err(error)) => self.failure = Some(error),
            None => {}
        }
        Poll::Ready(Ok(()))
    }
}

impl<S> Stream for Decoder<S>
where
    S: Stream<Item = Result<bytes::Bytes, ModelError>> + Unpin,
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
                    // The answer is whole: its last deltas go out at once, and the rest
                    // of the body is read for whoever reads on.
                    if let Some(delta) = this.ready.pop_front() {
                        return Poll::Ready(Some(Ok(delta)));
                    }
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
            let event = match this.events.poll_next_unpin(cx) {
                Poll::Ready(event) => event,
                Poll::Pending if this.assembler.finish.is_some() => {
                    // The answer is whole once the model said why it stopped: a server
                    // that then sends nothing more, and keeps the stream open, does not
                    // hold it past the grace.
                    let grace = this
                        .finish_grace
                        .get_or_insert_with(|| Box::pin(tokio::time::sleep(DRAIN_GRACE)));
                    if grace.as_mut().poll(cx).is_pending() {
                        return Poll::Pending;
                    }
                    debug!("nothing followed the finish reason within the grace");
                    this.assembler.finish(&mut this.ready);
                    this.state = DecodeState::Ended;
                    continue;
                }
                Poll::Pending => return Poll::Pending,
            };
            let Some(event) = event else {
                this.state = DecodeState::Ended;
                if this.assembler.finish.is_some() {
                    // No `[DONE]`, but the model said why it stopped: some servers just
                    // close after the finish chunk. What arrived stands.
                    debug!("model stream ended without [DONE]");
                    this.assembler.finish(&mut this.ready);
                } else {
                    // Neither: the answer may be cut anywhere, and is not one.
                    this.failure = Some(ModelError::Incomplete(
                        "the stream ended without a finish reason or [DONE]".into(),
                    ));
                }
                continue;
            };
            let event = match event {
                Ok(event) => event,
                // After the finish reason only the usage and `[DONE]` can come: a stream
                // that breaks then loses them, not the answer.
                Err(e) if this.assembler.finish.is_some() => {
                    debug!(error = %error_chain(&e), "the model stream broke after its finish reason");
                    this.assembler.finish(&mut this.ready);
                    this.state = DecodeState::Ended;
                    continue;
                }
                Err(sse_stream::Error::Body(e)) => {
                    this.state = DecodeState::Ended;
                    this.failure = Some(match e.downcast::<ModelError>() {
                        Ok(error) => *error,
                        Err(e) => ModelError::Lost(error_chain(&*e)),
                    });
                    continue;
                }
                // Only when sse-stream is built with `strict-fields`: a line of a field
                // other than the spec's (and `error`, which `Bounded` reads first).
                Err(sse_stream::Error::UnknownField) => {
                    this.state = DecodeState::Ended;
                    this.failure = Some(ModelError::Stream(
                        "the stream carried a line of a field other than data, event, id, \
                         retry and error"
                            .into(),
                    ));
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
            // An event of type `error` (`event: error`, as proxies in front of Anthropic-
            // style servers send one) is the provider's error, whatever its data says.
            if event.event.as_deref().map(str::trim) == Some("error") {
                let value = serde_json::from_str::<Value>(data)
                    .unwrap_or_else(|_| Value::String(data.to_owned()));
                let error = match value.get("error") {
                    Some(inner) if !inner.is_null() => inner.clone(),
                    _ => value,
                };
                this.state = DecodeState::Ended;
                this.failure = Some(in_stream_error(&error));
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
                Err(e) if this.assembler.finish.is_some() => {
                    debug!(error = %e, "unreadable model stream after its finish reason");
                    this.assembler.finish(&mut this.ready);
                    this.state = DecodeState::Ended;
                    continue;
                }
                Err(e) => {
                    this.state = DecodeState::Ended;
                    let shown: String = data.chars().take(200).collect();
                    let error =
                        ModelError::Stream(format!("invalid JSON in the stream ({e}): {shown}"));
                    this.failure = Some(error);
                    continue;
                }
            };
            // The usage after the finish reason (in a chunk of its own, or in the finish
            // chunk) is the answer's last: what follows is `[DONE]` and the end, read as
            // after `[DONE]` itself, so that a server that sends neither does not hold a
            // complete answer.
            let last = chunk.usage.is_some();
            if let Err(error) = this.assembler.chunk(chunk, &mut this.ready) {
                this.state = DecodeState::Ended;
                this.failure = Some(error);
            } else if last && this.assembler.finish.is_some() {
                this.assembler.finish(&mut this.ready);
                this.state = DecodeState::Draining {
                    left: MAX_TRAILING_EVENTS,
                    grace: None,
                };
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
    /// Which answer it is: only the first (0) is read, as `n` is never set; a server that
    /// sends others anyway does not get them mixed into it.
    #[serde(default)]
    index: Option<u64>,
    #[serde(default, borrow)]
    delta: Option<Delta<'a>>,
    #[serde(default, borrow)]
    finish_reason: Option<Cow<'a, str>>,
}

#[derive(serde::Deserialize)]
struct Delta<'a> {
    #[serde(default, borrow, deserialize_with = "content_parts")]
    content: Option<Content<'a>>,
    #[serde(default, borrow)]
    reasoning_content: Option<Cow<'a, str>>,
    #[serde(default, borrow)]
    reasoning: Option<Cow<'a, str>>,
    #[serde(default, borrow)]
    tool_calls: Option<Vec<CallDelta<'a>>>,
    /// The model's refusal (OpenAI's `refusal`), in place of an answer.
    #[serde(default, borrow)]
    refusal: Option<Cow<'a, str>>,
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
    /// A string of JSON, as the API has it; some servers send the JSON object itself,
    /// which is taken as its text.
    #[serde(default, borrow, deserialize_with = "arguments_text")]
    arguments: Option<Cow<'a, str>>,
}

/// A delta's `content`: its answer text and, from servers that stream it as a list of
/// parts, its reasoning.
#[derive(Default)]
struct Content<'a> {
    text: Option<Cow<'a, str>>,
    reasoning: Option<String>,
}

/// `content` as the API has it, a string, or as a list of parts, as Mistral's reasoning
/// models (Magistral) stream it: `{"type": "text", "text": ...}` parts are the answer,
/// `{"type": "thinking", "thinking": ...}` parts (text, or a list of text parts) its
/// reasoning; parts of other types are left out.
fn content_parts<'de, D: serde::Deserializer<'de>>(
    deserializer: D,
) -> Result<Option<Content<'de>>, D::Error> {
    struct Parts;
    impl<'de> serde::de::Visitor<'de> for Parts {
        type Value = Option<Content<'de>>;

        fn expecting(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
            f.write_str("content: a string, or a list of content parts")
        }

        fn visit_unit<E>(self) -> Result<Self::Value, E> {
            Ok(None)
        }

        fn visit_none<E>(self) -> Result<Self::Value, E> {
            Ok(None)
        }

        fn visit_borrowed_str<E>(self, text: &'de str) -> Result<Self::Value, E> {
            Ok(Some(Content {
                text: Some(Cow::Borrowed(text)),
                reasoning: None,
            }))
        }

        fn visit_str<E>(self, text: &str) -> Result<Self::Value, E> {
            Ok(Some(Content {
                text: Some(Cow::Owned(text.to_owned())),
                reasoning: None,
            }))
        }

        fn visit_string<E>(self, text: String) -> Result<Self::Value, E> {
            Ok(Some(Content {
                text: Some(Cow::Owned(text)),
                reasoning: None,
            }))
        }

        fn visit_seq<A: serde::de::SeqAccess<'de>>(
            self,
            mut seq: A,
        ) -> Result<Self::Value, A::Error> {
            fn texts(value: &Value, into: &mut String) {
                match value {
                    Value::String(text) => into.push_str(text),
                    Value::Array(parts) => {
                        for part in parts {
                            texts(&part["text"], into);
                        }
                    }
                    _ => {}
                }
            }
            let (mut text, mut reasoning) = (String::new(), String::new());
            while let Some(part) = seq.next_element::<Value>()? {
                match part["type"].as_str() {
                    Some("text") => texts(&part["text"], &mut text),
                    Some("thinking" | "reasoning") => {
                        texts(&part["thinking"], &mut reasoning);
                        texts(&part["reasoning"], &mut reasoning);
                        texts(&part["text"], &mut reasoning);
                    }
                    _ => {}
                }
            }
            Ok(Some(Content {
                text: Some(Cow::Owned(text)),
                reasoning: Some(reasoning),
            }))
        }
    }
    deserializer.deserialize_any(Parts)
}

/// Tool-call arguments as text: a string as it is, an object or array as its JSON.
fn arguments_text<'de, D: serde::Deserializer<'de>>(
    deserializer: D,
) -> Result<Option<Cow<'de, str>>, D::Error> {
    struct Text;
    impl<'de> serde::de::Visitor<'de> for Text {
        type Value = Option<Cow<'de, str>>;

        fn expecting(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
            f.write_str("tool-call arguments: a string of JSON, or a JSON object")
        }

        fn visit_unit<E>(self) -> Result<Self::Value, E> {
            Ok(None)
        }

        fn visit_none<E>(self) -> Result<Self::Value, E> {
            Ok(None)
        }

        fn visit_borrowed_str<E>(self, text: &'de str) -> Result<Self::Value, E> {
            Ok(Some(Cow::Borrowed(text)))
        }

        fn visit_str<E>(self, text: &str) -> Result<Self::Value, E> {
            Ok(Some(Cow::Owned(text.to_owned())))
        }

        fn visit_string<E>(self, text: String) -> Result<Self::Value, E> {
            Ok(Some(Cow::Owned(text)))
        }

        fn visit_map<A: serde::de::MapAccess<'de>>(self, map: A) -> Result<Self::Value, A::Error> {
            let value: Value =
                serde::Deserialize::deserialize(serde::de::value::MapAccessDeserializer::new(map))?;
            Ok(Some(Cow::Owned(value.to_string())))
        }

        fn visit_seq<A: serde::de::SeqAccess<'de>>(self, seq: A) -> Result<Self::Value, A::Error> {
            let value: Value =
                serde::Deserialize::deserialize(serde::de::value::SeqAccessDeserializer::new(seq))?;
            Ok(Some(Cow::Owned(value.to_string())))
        }
    }
    deserializer.deserialize_any(Text)
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
    /// The bound of one call's arguments, in bytes.
    max_arguments: usize,
    /// The bound of the reply's text, answer, reasoning and calls together, in bytes.
    max_text: usize,
    /// The reply's text so far, answer, reasoning and calls together, in bytes.
    text: usize,
    /// The calls, as they began, with the `index` their fragments carry.
    calls: Vec<(u64, PartialCall)>,
    /// For each `index`, the call its next fragments continue.
    open: BTreeMap<u64, usize>,
    think: ThinkSplitter,
    /// The tools the request offered: a name sent in pieces is put together into one of
    /// theirs (see [`continued_name`]).
    offered: std::sync::Arc<[ToolDefinition]>,
    /// The refusal's text so far, at most [`MAX_REFUSAL_BYTES`].
    refusal: String,
    finish: Option<FinishReason>,
    usage: Option<Usage>,
    finished: bool,
}

/// The HTTP status an error object sent in the stream stands for, when it says one: its
/// `code` as a status, or a code or type that names a rate limit or an overloaded server.
fn in_stream_status(error: &Value) -> Option<u16> {
    // A number, or a number written as a string (as LiteLLM writes it: `"429"`).
    let code = error["code"]
        .as_u64()
        .and_then(|c| u16::try_from(c).ok())
        .or_else(|| error["code"].as_str()?.trim().parse().ok());
    if let Some(code) = code
        && (400..600).contains(&code)
    {
        return Some(code);
    }
    let named = |key: &str| error[key].as_str().unwrap_or_default().to_ascii_lowercase();
    [named("code"), named("type")]
        .iter()
        .find_map(|name| match name.as_str() {
            "rate_limit_exceeded" | "rate_limit_error" | "too_many_requests" => Some(429),
            "server_error"
            | "overloaded"
            | "overloaded_error"
            | "service_unavailable"
            | "internal_server_error"
            | "api_error" => Some(503),
            _ => None,
        })
}

/// The error a provider reported in its stream, in a `data:` line's `error` or in an
/// `error:` line. One a status would have said (a rate limit, an overloaded server, as
/// OpenRouter, Azure and LiteLLM send them in a stream already begun, or llama.cpp's
/// `"code": 500`) is that status: before anything streamed, the call is tried again.
fn in_stream_error(error: &Value) -> ModelError {
    let message = error["message"]
        .as_str()
        .or_else(|| error.as_str())
        .map_or_else(|| error.to_string(), str::to_owned);
    let message = format!("provider reported an error: {message}");
    match in_stream_status(error) {
        Some(status) => ModelError::Http {
            status,
            message,
            retry_after: None,
        },
        None => ModelError::Stream(message),
    }
}

/// Longest id, and longest name, of a tool call in a reply, in bytes. Providers' ids are
/// some 40 bytes and tool names at most 64 characters; a longer one is a server that
/// misbehaves, and would be held (up to an SSE event's bound each) until the reply ends.
const MAX_CALL_LABEL_BYTES: usize = 1024;

/// What [`ModelError::TooLarge`] names when a reply passes [`ResponseLimits::max_reply_text_bytes`].
const REPLY_TEXT: &str = "the text of one reply (answer, reasoning and tool calls)";

/// What is kept of a refusal's text: it is said in an error message, not streamed.
const MAX_REFUSAL_BYTES: usize = 4096;

impl Assembler {
    fn chunk(&mut self, chunk: Chunk<'_>, out: &mut VecDeque<ChatDelta>) -> Result<(), ModelError> {
        if let Some(error) = chunk.error.filter(|e| !e.is_null()) {
            return Err(in_stream_error(&error));
        }
        if let Some(usage) = chunk.usage {
            // Both figures, or none: a missing one is not zero, and servers that do not
            // count report zero for both.
            self.usage = match (usage.prompt_tokens, usage.completion_tokens) {
                (Some(0), Some(0)) | (None, _) | (_, None) => None,
                (Some(prompt_tokens), Some(completion_tokens)) => Some(Usage {
                    prompt_tokens,
                    completion_tokens,
                }),
            };
        }
        let Some(choice) = chunk.choices.filter(|c| c.index.unwrap_or(0) == 0) else {
            return Ok(());
        };
        if let Some(delta) = choice.delta {
            if let Some(text) = delta.refusal.filter(|t| !t.is_empty()) {
                let room = MAX_REFUSAL_BYTES.saturating_sub(self.refusal.len());
                let mut cut = room.min(text.len());
                while !text.is_char_boundary(cut) {
                    cut -= 1;
                }
                self.refusal.push_str(&text[..cut]);
            }
            // One name or the other: servers that send the text under both (mlx, some
            // proxies) send it once.
            let Content {
                text: content,
                reasoning: in_content,
            } = delta.content.unwrap_or_default();
            let reasoning = delta
                .reasoning_content
                .filter(|t| !t.is_empty())
                .or(delta.reasoning)
                .filter(|t| !t.is_empty())
                .or(in_content.map(Cow::Owned))
                .filter(|t| !t.is_empty());
            let content = content.filter(|t| !t.is_empty());
            self.text += reasoning.as_ref().map_or(0, |t| t.len());
            self.text += content.as_ref().map_or(0, |t| t.len());
            if self.text > self.max_text {
                return Err(ModelError::TooLarge {
                    what: REPLY_TEXT,
                    limit: self.max_text,
                });
            }
            if let Some(text) = reasoning {
                out.push_back(ChatDelta::Reasoning(text.into_owned()));
            }
            if let Some(text) = content {
                self.think
                    .push(text, |piece| out.push_back(piece_delta(piece)));
            }
            for (position, call) in delta.tool_calls.into_iter().flatten().enumerate() {
                let index = call.index.unwrap_or(position as u64);
                let name = call
                    .function
                    .as_ref()
                    .and_then(|f| f.name.as_deref())
                    .filter(|n| !n.is_empty());
                let slot = match self.open.get(&index) {
                    // Some servers send every call with index 0: a fragment that names a
                    // function under an id other than the call's begins another call.
                    // (Servers that repeat the id or the name on every fragment, or send
                    // a new id without a name, continue the call.)
                    Some(&slot)
                        if !starts_another(
                            &self.calls[slot].1,
                            call.id.as_deref(),
                            name,
                            call.function.as_ref().and_then(|f| f.arguments.as_deref()),
                            &self.offered,
                        ) =>
                    {
                        slot
                    }
                    _ if self.calls.len() >= MAX_CALLS_PER_REPLY => {
                        return Err(ModelError::InvalidResponse(format!(
                            "the reply has more than {MAX_CALLS_PER_REPLY} tool calls"
                        )));
                    }
                    _ => {
                        self.calls.push((index, PartialCall::default()));
                        self.open.insert(index, self.calls.len() - 1);
                        self.calls.len() - 1
                    }
                };
                let entry = &mut self.calls[slot].1;
                let before = entry.id.len() + entry.name.len() + entry.arguments.len();
                // Some servers repeat the id (or send a new one) on every chunk: the first
                // one names the call.
                if entry.id.is_empty()
                    && let Some(id) = call.id
                {
                    if id.len() > MAX_CALL_LABEL_BYTES {
                        return Err(ModelError::TooLarge {
                            what: "the id of one tool call",
                            limit: MAX_CALL_LABEL_BYTES,
                        });
                    }
                    entry.id = id.into_owned();
                }
                if let Some(function) = call.function {
                    if let Some(name) = function.name.filter(|n| !n.is_empty()) {
                        if entry.name.is_empty() {
                            entry.name = name.into_owned();
                        } else if let Some(whole) = continued_name(entry, &name, &self.offered) {
                            // A name sent in pieces, as its arguments are.
                            entry.name = whole;
                        }
                        if entry.name.len() > MAX_CALL_LABEL_BYTES {
                            return Err(ModelError::TooLarge {
                                what: "the name of one tool call",
                                limit: MAX_CALL_LABEL_BYTES,
                            });
                        }
                    }
                    if let Some(arguments) = function.arguments {
                        if entry.arguments.len() + arguments.len() > self.max_arguments {
                            return Err(ModelError::TooLarge {
                                what: "the arguments of one tool call",
                                limit: self.max_arguments,
                            });
                        }
                        entry.arguments.push_str(&arguments);
                    }
                }
                // Calls count too: their ids, names and arguments are held until the end.
                self.text += (entry.id.len() + entry.name.len() + entry.arguments.len()) - before;
                if self.text > self.max_text {
                    return Err(ModelError::TooLarge {
                        what: REPLY_TEXT,
                        limit: self.max_text,
                    });
                }
            }
        }
        if let Some(reason) = choice.finish_reason.filter(|r| !r.is_empty()) {
            // Read whatever the case: gateways pass Gemini's own (`MAX_TOKENS`, `SAFETY`)
            // through.
            self.finish = Some(match reason.to_ascii_lowercase().as_str() {
                // With the words other servers use for the same (TGI, Anthropic-style
                // proxies, vLLM).
                "stop" | "eos" | "eos_token" | "end_turn" | "stop_sequence" => FinishReason::Stop,
                "tool_calls" | "function_call" | "tool_use" => FinishReason::ToolCalls,
                "length" | "max_tokens" | "model_length" => FinishReason::Length,
                "content_filter" | "safety" | "recitation" | "prohibited_content" => {
                    FinishReason::ContentFilter
                }
                // The provider stopped the answer itself (DeepSeek's
                // `insufficient_system_resource`, vLLM's `abort`): what streamed is not a
                // whole answer.
                "insufficient_system_resource"
                | "abort"
                | "aborted"
                | "error"
                | "cancelled"
                | "canceled"
                | "interrupted"
                | "timeout" => {
                    return Err(ModelError::Incomplete(format!(
                        "the provider ended the answer with finish_reason {reason:?}"
                    )));
                }
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
        if !self.refusal.is_empty() {
            out.push_back(ChatDelta::Refusal(std::mem::take(&mut self.refusal)));
        }
        let mut calls = std::mem::take(&mut self.calls);
        // In the order of their index; calls that shared one, in the order they came.
        calls.sort_by_key(|(index, _)| *index);
        for (position, (_, call)) in calls.into_iter().enumerate() {
            // A call that names no tool is no call: sent back in the conversation with an
            // empty name, providers refuse every later request of the run.
            if call.name.is_empty() {
                warn!(id = %call.id, "the model made a tool call without a name; it is left out");
                continue;
            }
            out.push_back(ChatDelta::ToolCall(ModelToolCall {
                // Made unique beyond this reply: the session's history holds the calls of
                // earlier turns, and providers (Anthropic behind a proxy, templates that
                // pair results with calls by id) refuse two calls of one id in a prompt.
                id: if call.id.is_empty() {
                    format!("call_{:012x}_{position}", fastrand::u64(..) >> 16)
                } else {
                    call.id
                },
                name: call.name,
                arguments: call.arguments,
            }));
        }
        // `[DONE]` without a finish reason: the server ended the answer without saying why.
        out.push_back(ChatDelta::Finish {
            reason: self.finish.unwrap_or(FinishReason::Unknown),
            usage: self.usage,
        });
    }
}

/// Whether a fragment with this id, function name and arguments begins a call other than
/// `call`: it names a function, the call has one already, and either the name or the id
/// is another, or (servers that send parallel calls of one tool under one index and no
/// ids, as some Gemini adapters do) the call's arguments are whole and the fragment's
/// begin another object.
fn starts_another(
    call: &PartialCall,
    id: Option<&str>,
    name: Option<&str>,
    arguments: Option<&str>,
    offered: &[ToolDefinition],
) -> bool {
    let other_id = id.is_some_and(|id| !id.is_empty() && !call.id.is_empty() && id != call.id);
    name.is_some_and(|name| {
        !call.name.is_empty()
            && (other_id
                || (name != call.name && continued_name(call, name, offered).is_none())
                || arguments.is_some_and(|more| begins_after_whole(&call.arguments, more)))
    })
}

/// Whether `arguments` are a whole JSON object and `more` begins another: appended, they
/// would be no JSON at all. Parsed only when the one ends with `}` and the other begins
/// with `{`, which a fragment continuing an object never does.
fn begins_after_whole(arguments: &str, more: &str) -> bool {
    more.trim_start().starts_with('{')
        && arguments.trim_end().ends_with('}')
        && serde_json::from_str::<serde_json::Map<String, Value>>(arguments).is_ok()
}

/// The name `name` makes of the name of `call` (which has one, and no other id) when it
/// continues it rather than begins another call (servers that send every call under index
/// 0): the rest of a name sent in pieces (`calcu`, `lator`), or the name sent again longer
/// (`calcu`, `calculator`). Only a call without arguments yet (a name comes before them),
/// whose name is no offered tool's, continues, and only into (the start of) an offered
/// tool's name; a parameterless call of an offered tool is whole.
fn continued_name(call: &PartialCall, name: &str, offered: &[ToolDefinition]) -> Option<String> {
    if !call.arguments.is_empty()
        || name == call.name
        || offered.iter().any(|t| t.name == call.name)
    {
        return None;
    }
    let whole = if name.starts_with(&call.name) {
        name.to_owned()
    } else {
        format!("{}{name}", call.name)
    };
    offered
        .iter()
        .any(|t| t.name.starts_with(&whole))
        .then_some(whole)
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
        // Arbitrary cuts, as the network makes them.
        run_in_pieces(sse.as_bytes(), 7).await
    }

    /// The tools the tests' requests offer.
    fn offered() -> std::sync::Arc<[ToolDefinition]> {
        ["calculator", "current_time", "t"]
            .into_iter()
            .map(|name| ToolDefinition {
                name: name.into(),
                description: String::new(),
                parameters: serde_json::json!({"type": "object"}).into(),
            })
            .collect()
    }

    /// The deltas of `answer`, sent by a server that then keeps the stream open.
    fn held_open(answer: &str) -> impl Stream<Item = Result<ChatDelta, ModelError>> + Unpin {
        let body = futures_util::stream::iter([Ok::<_, std::io::Error>(bytes::Bytes::from(
            answer.to_owned(),
        ))])
        .chain(futures_util::stream::pending());
        decode(Box::pin(body), ResponseLimits::default(), offered())
    }

    /// The end of an answer that stopped without reporting usage.
    const STOPPED: ChatDelta = ChatDelta::Finish {
        reason: FinishReason::Stop,
        usage: None,
    };

    /// The tool calls among `deltas`, which must all be fine.
    fn tool_calls(deltas: Vec<Result<ChatDelta, ModelError>>) -> Vec<ModelToolCall> {
        ok(deltas)
            .into_iter()
            .filter_map(|d| match d {
                ChatDelta::ToolCall(call) => Some(call),
                _ => None,
            })
            .collect()
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
        let deltas = ok(decode(Box::pin(body), ResponseLimits::default(), offered())
            .collect()
            .await);
        assert_eq!(deltas[0], ChatDelta::Content("hi".into()));
        assert!(
            ended.load(std::sync::atomic::Ordering::SeqCst),
            "the end was read"
        );

        // A server that keeps the stream open after `[DONE]` does not hold the call.
        let started = tokio::time::Instant::now();
        let deltas = ok(held_open(answer).collect().await);
        assert_eq!(deltas.len(), 2, "{deltas:?}");
        assert!(started.elapsed() <= DRAIN_GRACE + Duration::from_millis(50));

        // Its deltas, the finish included, go out at once: only the reader of the rest
        // waits (the engine reads it in the background).
        let started = tokio::time::Instant::now();
        let mut deltas = held_open(answer);
        assert_eq!(
            deltas.next().await.unwrap().unwrap(),
            ChatDelta::Content("hi".into())
        );
        assert!(matches!(
            deltas.next().await.unwrap().unwrap(),
            ChatDelta::Finish { .. }
        ));
        assert_eq!(started.elapsed(), Duration::ZERO);
        assert!(deltas.next().await.is_none());
        assert!(started.elapsed() >= DRAIN_GRACE);
    }

    #[tokio::test(start_paused = true)]
    async fn the_usage_after_the_finish_ends_an_answer_whose_stream_stays_open() {
        // Neither `[DONE]` nor the end follows: the answer stands once its grace is over,
        // with the usage reported, instead of waiting for the call's timeout.
        let answer = concat!(
            "data: {\"choices\":[{\"delta\":{\"content\":\"hi\"},\"finish_reason\":\"stop\"}]}\n\n",
            "data: {\"choices\":[],\"usage\":{\"prompt_tokens\":11,\"completion_tokens\":7}}\n\n",
        );
        let started = tokio::time::Instant::now();
        let deltas = ok(held_open(answer).collect().await);
        assert_eq!(
            deltas,
            [
                ChatDelta::Content("hi".into()),
                ChatDelta::Finish {
                    reason: FinishReason::Stop,
                    usage: Some(Usage {
                        prompt_tokens: 11,
                        completion_tokens: 7
                    })
                }
            ]
        );
        assert!(started.elapsed() <= DRAIN_GRACE + Duration::from_millis(50));
    }

    #[tokio::test(start_paused = true)]
    async fn after_the_finish_reason_silence_or_a_broken_stream_leaves_the_answer_whole() {
        // The usage in the finish chunk: the answer is whole at once.
        let with_usage = "data: {\"choices\":[{\"delta\":{\"content\":\"hi\"},\"finish_reason\":\"stop\"}],\"usage\":{\"prompt_tokens\":11,\"completion_tokens\":7}}\n\n";
        // No usage: the answer stands once nothing more came within the grace.
        let without =
            "data: {\"choices\":[{\"delta\":{\"content\":\"hi\"},\"finish_reason\":\"stop\"}]}\n\n";
        for (answer, usage, waited) in [
            (
                with_usage,
                Some(Usage {
                    prompt_tokens: 11,
                    completion_tokens: 7,
                }),
                Duration::ZERO,
            ),
            (without, None, DRAIN_GRACE),
        ] {
            let started = tokio::time::Instant::now();
            let mut deltas = held_open(answer);
            assert_eq!(
                deltas.next().await.unwrap().unwrap(),
                ChatDelta::Content("hi".into())
            );
            assert_eq!(
                deltas.next().await.unwrap().unwrap(),
                ChatDelta::Finish {
                    reason: FinishReason::Stop,
                    usage
                }
            );
            assert_eq!(started.elapsed(), waited);
        }
        // Broken after the finish reason: the answer stands (it failed as a lost stream).
        let body = futures_util::stream::iter([
            Ok(bytes::Bytes::from(without)),
            Err(std::io::Error::other("connection reset")),
        ]);
        assert_eq!(
            ok(decode(Box::pin(body), ResponseLimits::default(), offered())
                .collect()
                .await),
            [ChatDelta::Content("hi".into()), STOPPED]
        );
    }

    #[tokio::test]
    async fn a_name_sent_in_pieces_is_one_call() {
        let sse = concat!(
            "data: {\"choices\":[{\"delta\":{\"tool_calls\":[{\"index\":0,\"id\":\"call_A\",\"function\":{\"name\":\"calcu\",\"arguments\":\"\"}}]}}]}\n\n",
            "data: {\"choices\":[{\"delta\":{\"tool_calls\":[{\"index\":0,\"function\":{\"name\":\"lator\"}}]}}]}\n\n",
            "data: {\"choices\":[{\"delta\":{\"tool_calls\":[{\"index\":0,\"function\":{\"arguments\":\"{\\\"expression\\\":\"}}]}}]}\n\n",
            "data: {\"choices\":[{\"delta\":{\"tool_calls\":[{\"index\":0,\"function\":{\"arguments\":\"\\\"6 * 7\\\"}\"}}]},\"finish_reason\":\"tool_calls\"}]}\n\n",
            "data: [DONE]\n\n",
        );
        let calls: Vec<_> = tool_calls(run(sse).await);
        assert_eq!(
            calls,
            [ModelToolCall {
                id: "call_A".into(),
                name: "calculator".into(),
                arguments: "{\"expression\":\"6 * 7\"}".into(),
            }]
        );

        // Sent again longer; and, under index 0 without ids, a call of an offered tool
        // without arguments, then another call: two calls, not one made-up name.
        let sse = concat!(
            "data: {\"choices\":[{\"delta\":{\"tool_calls\":[{\"index\":0,\"function\":{\"name\":\"calcu\"}}]}}]}\n\n",
            "data: {\"choices\":[{\"delta\":{\"tool_calls\":[{\"index\":0,\"function\":{\"name\":\"calculator\",\"arguments\":\"{}\"}}]}}]}\n\n",
            "data: {\"choices\":[{\"delta\":{\"tool_calls\":[{\"index\":1,\"function\":{\"name\":\"current_time\",\"arguments\":\"\"}}]}}]}\n\n",
            "data: {\"choices\":[{\"delta\":{\"tool_calls\":[{\"index\":1,\"function\":{\"name\":\"t\"}}]},\"finish_reason\":\"tool_calls\"}]}\n\n",
            "data: [DONE]\n\n",
        );
        let names: Vec<String> = tool_calls(run(sse).await)
            .into_iter()
            .map(|call| call.name)
            .collect();
        assert_eq!(names, ["calculator", "current_time", "t"]);
    }

    #[tokio::test]
    async fn a_tool_call_without_a_name_is_left_out() {
        let sse = concat!(
            "data: {\"choices\":[{\"delta\":{\"tool_calls\":[{\"index\":0,\"id\":\"a\",\"function\":{\"arguments\":\"{}\"}}]}}]}\n\n",
            "data: {\"choices\":[{\"delta\":{\"tool_calls\":[{\"index\":1,\"id\":\"b\",\"function\":{\"name\":\"t\",\"arguments\":\"{}\"}}]},\"finish_reason\":\"tool_calls\"}]}\n\n",
            "data: [DONE]\n\n",
        );
        let calls: Vec<String> = tool_calls(run(sse).await)
            .into_iter()
            .map(|call| call.id)
            .collect();
        assert_eq!(calls, ["b"]);
    }

    #[tokio::test]
    async fn a_refusal_is_said_and_other_choices_are_left_out() {
        let sse = concat!(
            "data: {\"choices\":[{\"index\":0,\"delta\":{\"role\":\"assistant\",\"refusal\":\"I cannot \"}}]}\n\n",
            "data: {\"choices\":[{\"index\":1,\"delta\":{\"content\":\"ONE\"}}]}\n\n",
            "data: {\"choices\":[{\"index\":0,\"delta\":{\"refusal\":\"help with that.\"},\"finish_reason\":\"stop\"}]}\n\n",
            "data: [DONE]\n\n",
        );
        assert_eq!(
            ok(run(sse).await),
            [
                ChatDelta::Refusal("I cannot help with that.".into()),
                STOPPED,
            ]
        );
    }

    #[tokio::test]
    async fn parallel_tool_calls_all_sent_with_index_zero_stay_apart() {
        // As some OpenAI-compatible servers send them: every call under index 0, each
        // begun by its id and name, whole or in fragments.
        let sse = concat!(
            "data: {\"choices\":[{\"delta\":{\"tool_calls\":[{\"index\":0,\"id\":\"a\",\"function\":{\"name\":\"calculator\",\"arguments\":\"{\\\"expression\\\":\"}}]}}]}\n\n",
            "data: {\"choices\":[{\"delta\":{\"tool_calls\":[{\"index\":0,\"function\":{\"arguments\":\"\\\"1+1\\\"}\"}}]}}]}\n\n",
            "data: {\"choices\":[{\"delta\":{\"tool_calls\":[{\"index\":0,\"id\":\"b\",\"function\":{\"name\":\"calculator\",\"arguments\":\"{\\\"expression\\\":\\\"2+2\\\"}\"}}]}}]}\n\n",
            "data: {\"choices\":[{\"delta\":{\"tool_calls\":[{\"index\":0,\"function\":{\"name\":\"current_time\",\"arguments\":\"{}\"}}]},\"finish_reason\":\"tool_calls\"}]}\n\n",
            "data: [DONE]\n\n",
        );
        let calls: Vec<_> = ok(run(sse).await)
            .into_iter()
            .filter_map(|d| match d {
                ChatDelta::ToolCall(call) => Some((call.id, call.name, call.arguments)),
                _ => None,
            })
            .collect();
        assert_eq!(
            calls,
            [
                (
                    "a".into(),
                    "calculator".into(),
                    "{\"expression\":\"1+1\"}".into()
                ),
                (
                    "b".into(),
                    "calculator".into(),
                    "{\"expression\":\"2+2\"}".into()
                ),
                (calls[2].0.clone(), "current_time".into(), "{}".into()),
            ]
        );
        // A call the server gave no id gets one of its own, unique beyond the reply.
        assert!(
            calls[2].0.starts_with("call_") && calls[2].0.ends_with("_2"),
            "{calls:?}"
        );
        let again: Vec<_> = ok(run(sse).await)
            .into_iter()
            .filter_map(|d| match d {
                ChatDelta::ToolCall(call) => Some(call.id),
                _ => None,
            })
            .collect();
        assert_ne!(again[2], calls[2].0);

        // A server that repeats the id and the name on every fragment makes one call.
        let sse = concat!(
            "data: {\"choices\":[{\"delta\":{\"tool_calls\":[{\"index\":0,\"id\":\"a\",\"function\":{\"name\":\"calculator\",\"arguments\":\"{\\\"expression\\\":\"}}]}}]}\n\n",
            "data: {\"choices\":[{\"delta\":{\"tool_calls\":[{\"index\":0,\"id\":\"a\",\"function\":{\"name\":\"calculator\",\"arguments\":\"\\\"1+1\\\"}\"}}]},\"finish_reason\":\"tool_calls\"}]}\n\n",
            "data: [DONE]\n\n",
        );
        let calls = ok(run(sse).await);
        assert_eq!(
            calls[0],
            ChatDelta::ToolCall(ModelToolCall {
                id: "a".into(),
                name: "calculator".into(),
                arguments: "{\"expression\":\"1+1\"}".into()
            })
        );
        assert_eq!(calls.len(), 2, "{calls:?}");

        // Parallel calls of one tool, under index 0 with no ids (Gemini adapters): a whole
        // call's arguments, then another object, begin another call.
        let sse = concat!(
            "data: {\"choices\":[{\"delta\":{\"tool_calls\":[{\"index\":0,\"function\":{\"name\":\"calculator\",\"arguments\":\"{\\\"expression\\\":\\\"1\\\"}\"}}]}}]}\n\n",
            "data: {\"choices\":[{\"delta\":{\"tool_calls\":[{\"index\":0,\"id\":\"\",\"function\":{\"name\":\"calculator\",\"arguments\":\"{\\\"expression\\\":\"}}]}}]}\n\n",
            "data: {\"choices\":[{\"delta\":{\"tool_calls\":[{\"index\":0,\"function\":{\"name\":\"calculator\",\"arguments\":\"\\\"2\\\"}\"}}]},\"finish_reason\":\"tool_calls\"}]}\n\n",
        );
        let calls: Vec<_> = ok(run(sse).await)
            .into_iter()
            .filter_map(|d| match d {
                ChatDelta::ToolCall(call) => Some(call.arguments),
                _ => None,
            })
            .collect();
        assert_eq!(calls, ["{\"expression\":\"1\"}", "{\"expression\":\"2\"}"]);
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
            // The same text under both names is the same text.
            "data: {\"choices\":[{\"delta\":{\"reasoning_content\":\"!\",\"reasoning\":\"!\"}}]}\n\n",
            "data: {\"choices\":[{\"delta\":{\"reasoning\":\"?\"}}]}\n\n",
            "data: {\"choices\":[{\"delta\":{\"content\":\"<think>more\"}}]}\n\n",
            "data: {\"choices\":[{\"delta\":{\"content\":\"</think>Four.\"},\"finish_reason\":\"stop\"}]}\n\n",
        );
        assert_eq!(
            ok(run(sse).await),
            [
                ChatDelta::Reasoning("hmm".into()),
                ChatDelta::Reasoning("!".into()),
                ChatDelta::Reasoning("?".into()),
                ChatDelta::Reasoning("more".into()),
                ChatDelta::Content("Four.".into()),
                STOPPED,
            ]
        );
    }

    /// A stream that ends with neither a finish reason nor `[DONE]` is not an answer (it
    /// used to end as `Stop`, which the contract now forbids).
    #[tokio::test]
    async fn a_stream_without_finish_reason_or_done_is_incomplete() {
        let sse = "data: {\"choices\":[{\"delta\":{\"content\":\"hi\"}}]}\n\n";
        let deltas = run(sse).await;
        assert_eq!(deltas[0], Ok(ChatDelta::Content("hi".into())));
        assert!(
            matches!(&deltas[1], Err(e @ ModelError::Incomplete(m))
                if m.contains("without a finish reason or [DONE]") && !e.is_retryable()
                    && e.code() == "MODEL_INCOMPLETE_RESPONSE"),
            "{deltas:?}"
        );
        assert_eq!(deltas.len(), 2);

        // A call assembled so far is not handed out either.
        let sse = "data: {\"choices\":[{\"delta\":{\"tool_calls\":[{\"index\":0,\"id\":\"a\",\"function\":{\"name\":\"t\",\"arguments\":\"{\"}}]}}]}\n\n";
        let deltas = run(sse).await;
        assert!(
            matches!(&deltas[..], [Err(ModelError::Incomplete(_))]),
            "{deltas:?}"
        );
    }

    /// `[DONE]` without a finish reason ends the call, as `Unknown`; a finish reason without
    /// `[DONE]` ends it with that reason.
    #[tokio::test]
    async fn a_reply_of_too_many_calls_ends_the_call() {
        let calls: Vec<String> = (0..=MAX_CALLS_PER_REPLY)
            .map(|i| format!("{{\"index\":{i},\"id\":\"c{i}\",\"function\":{{\"name\":\"t\",\"arguments\":\"{{}}\"}}}}"))
            .collect();
        let sse = format!(
            "data: {{\"choices\":[{{\"delta\":{{\"tool_calls\":[{}]}},\"finish_reason\":\"tool_calls\"}}]}}\n\n",
            calls.join(",")
        );
        let deltas = run(&sse).await;
        assert!(
            matches!(deltas.last(), Some(Err(ModelError::InvalidResponse(m))) if m.contains("more than 128 tool calls")),
            "{deltas:?}"
        );
    }

    /// The deltas of `sse` cut into pieces of `width` bytes.
    async fn run_in_pieces(sse: &[u8], width: usize) -> Vec<Result<ChatDelta, ModelError>> {
        let chunks: Vec<Result<bytes::Bytes, std::io::Error>> = sse
            .chunks(width)
            .map(|c| Ok(bytes::Bytes::copy_from_slice(c)))
            .collect();
        decode(
            futures_util::stream::iter(chunks),
            ResponseLimits::default(),
            offered(),
        )
        .collect()
        .await
    }

    /// llama.cpp's server reports a failure after part of the answer as an `error:` line,
    /// then sends `[DONE]`: the call ends with its message and status (read as the same
    /// error in a `data:` line is), however the network cuts the line, and the `[DONE]`
    /// after it does not make what streamed an answer.
    #[tokio::test]
    async fn an_error_line_in_the_stream_is_the_providers_error() {
        let sse = "data: {\"choices\":[{\"delta\":{\"content\":\"hal\"}}]}\n\nerror: {\"code\":500,\"message\":\"context shift is disabled\",\"type\":\"server_error\"}\n\ndata: [DONE]\n\n";
        for width in 1..=sse.len() {
            let deltas = run_in_pieces(sse.as_bytes(), width).await;
            assert_eq!(deltas.len(), 2, "pieces of {width}: {deltas:?}");
            assert_eq!(deltas[0], Ok(ChatDelta::Content("hal".into())));
            assert_eq!(
                deltas[1],
                Err(ModelError::Http {
                    status: 500,
                    message: "provider reported an error: context shift is disabled".into(),
                    retry_after: None,
                }),
                "pieces of {width}"
            );
        }
        // First in the body (after a byte order mark), CR LF line ends, the error under
        // `error` as in a `data:` line, a rate limit by its code: retried before any text.
        let sse = "\u{feff}error: {\"error\":{\"message\":\"slow down\",\"code\":\"rate_limit_exceeded\"}}\r\n\r\ndata: [DONE]\r\n\r\n";
        for width in [1, 2, 3, 4, 7, sse.len()] {
            let deltas = run_in_pieces(sse.as_bytes(), width).await;
            assert!(
                matches!(&deltas[..], [Err(e @ ModelError::Http { status: 429, message, .. })]
                    if message.contains("slow down") && e.is_retryable()),
                "pieces of {width}: {deltas:?}"
            );
        }
        // A value that is no JSON is said as it is; one past the bound is cut there.
        let deltas = run("error: the model crashed\n\ndata: [DONE]\n\n").await;
        assert_eq!(
            deltas,
            [Err(ModelError::Stream(
                "provider reported an error: the model crashed".into()
            ))]
        );
        let sse = format!("error: {}\n\n", "x".repeat(MAX_ERROR_BODY_BYTES + 10));
        let deltas = run(&sse).await;
        assert!(
            matches!(&deltas[..], [Err(ModelError::Stream(m))]
                if m.ends_with(&format!("[error line cut at {MAX_ERROR_BODY_BYTES} bytes]"))),
            "{deltas:?}"
        );
        // A body that ends inside the line still says the error.
        let deltas = run("error: {\"message\":\"gone\"}").await;
        assert_eq!(
            deltas,
            [Err(ModelError::Stream(
                "provider reported an error: gone".into()
            ))]
        );
        // Fields whose names only begin like it, and `error` in a value, are no error.
        let sse = "errors: x\nerr: y\ndata: {\"choices\":[{\"delta\":{\"content\":\"error: no\"},\"finish_reason\":\"stop\"}]}\n\ndata: [DONE]\n\n";
        if !unknown_fields_refused() {
            assert_eq!(
                ok(run(sse).await),
                [ChatDelta::Content("error: no".into()), STOPPED]
            );
        }
        let sse = "data: {\"choices\":[{\"delta\":{\"content\":\"error: no\"},\"finish_reason\":\"stop\"}]}\n\n: error: a comment\ndata: [DONE]\n\n";
        assert_eq!(
            ok(run(sse).await),
            [ChatDelta::Content("error: no".into()), STOPPED]
        );
    }

    /// Whether the SSE parser refuses lines of fields the spec does not know (sse-stream
    /// built with `strict-fields`) rather than ignoring them.
    fn unknown_fields_refused() -> bool {
        let body = futures_util::stream::iter([Ok::<_, std::io::Error>(
            bytes::Bytes::from_static(b"other: x\n\n"),
        )]);
        let first =
            futures_util::FutureExt::now_or_never(sse_stream::SseByteStream::new(body).next());
        matches!(first, Some(Some(Err(_))))
    }

    /// Lines of fields the SSE spec does not know are ignored, as it says (with sse-stream
    /// built with `strict-fields`, they end the call with an error that says so).
    #[tokio::test]
    async fn lines_of_other_fields_are_ignored() {
        let sse = "id: 1\nevent: message\nretry: 100\nserver: llama\nx-trace\ndata: {\"choices\":[{\"delta\":{\"content\":\"hi\"},\"finish_reason\":\"stop\"}]}\n\ndata: [DONE]\n\n";
        let deltas = run(sse).await;
        if unknown_fields_refused() {
            assert!(
                matches!(&deltas[..], [Err(ModelError::Stream(m))] if m.contains("a field other than data")),
                "{deltas:?}"
            );
        } else {
            assert_eq!(ok(deltas), [ChatDelta::Content("hi".into()), STOPPED]);
        }
    }

    #[tokio::test]
    async fn a_finish_reason_that_says_the_provider_stopped_is_no_answer() {
        for (reason, ends) in [
            ("insufficient_system_resource", None),
            ("abort", None),
            ("eos_token", Some(FinishReason::Stop)),
            ("max_tokens", Some(FinishReason::Length)),
            // Gemini's own, as gateways pass them through.
            ("MAX_TOKENS", Some(FinishReason::Length)),
            ("SAFETY", Some(FinishReason::ContentFilter)),
            ("STOP", Some(FinishReason::Stop)),
            ("tool_use", Some(FinishReason::ToolCalls)),
            ("something_new", Some(FinishReason::Unknown)),
        ] {
            let sse = format!(
                "data: {{\"choices\":[{{\"delta\":{{\"content\":\"hal\"}},\"finish_reason\":\"{reason}\"}}]}}\n\ndata: [DONE]\n\n"
            );
            let deltas = run(&sse).await;
            match ends {
                None => assert!(
                    deltas
                        .iter()
                        .any(|d| matches!(d, Err(ModelError::Incomplete(m)) if m.contains(reason))),
                    "{reason}: {deltas:?}"
                ),
                Some(expected) => assert!(
                    deltas.iter().any(
                        |d| matches!(d, Ok(ChatDelta::Finish { reason, .. }) if *reason == expected)
                    ),
                    "{reason}: {deltas:?}"
                ),
            }
        }
    }

    #[tokio::test]
    async fn done_or_a_finish_reason_ends_the_call() {
        let sse = "data: {\"choices\":[{\"delta\":{\"content\":\"hi\"}}]}\n\ndata: [DONE]\n\n";
        assert_eq!(
            ok(run(sse).await),
            [
                ChatDelta::Content("hi".into()),
                ChatDelta::Finish {
                    reason: FinishReason::Unknown,
                    usage: None
                }
            ]
        );
        let sse = "data: {\"choices\":[{\"delta\":{\"content\":\"hi\"},\"finish_reason\":\"length\"}]}\n\n";
        assert_eq!(
            ok(run(sse).await),
            [
                ChatDelta::Content("hi".into()),
                ChatDelta::Finish {
                    reason: FinishReason::Length,
                    usage: None
                }
            ]
        );
        // An empty finish reason is none.
        let sse =
            "data: {\"choices\":[{\"delta\":{\"content\":\"hi\"},\"finish_reason\":\"\"}]}\n\n";
        assert!(matches!(
            run(sse).await.last(),
            Some(Err(ModelError::Incomplete(_)))
        ));
    }

    /// Usage is reported only when the provider gave both figures, not both zero.
    #[tokio::test]
    async fn usage_is_never_made_up() {
        for (usage, expected) in [
            (
                "{\"prompt_tokens\":3,\"completion_tokens\":2}",
                Some(Usage {
                    prompt_tokens: 3,
                    completion_tokens: 2,
                }),
            ),
            ("{\"prompt_tokens\":3}", None),
            ("{\"prompt_tokens\":0,\"completion_tokens\":0}", None),
            ("null", None),
        ] {
            let sse = format!(
                "data: {{\"choices\":[{{\"delta\":{{\"content\":\"hi\"}},\"finish_reason\":\"stop\"}}]}}\n\n\
                 data: {{\"choices\":[],\"usage\":{usage}}}\n\ndata: [DONE]\n\n"
            );
            assert_eq!(
                ok(run(&sse).await).last(),
                Some(&ChatDelta::Finish {
                    reason: FinishReason::Stop,
                    usage: expected
                }),
                "{usage}"
            );
        }
    }

    /// A last line without its line end is an error before the finish chunk (the parser
    /// would drop it without a word); after it, only the usage or `[DONE]` is torn, and the
    /// answer stands without them (its usage then estimated).
    #[tokio::test]
    async fn an_unterminated_last_line_is_incomplete() {
        let sse = "data: {\"choices\":[{\"delta\":{\"content\":\"hi\"}}]}\n\ndata: {\"choices\":[{\"delta\":{\"content\":\" there\"},\"finish_reason\":\"stop\"}]}";
        let deltas = run(sse).await;
        assert_eq!(deltas[0], Ok(ChatDelta::Content("hi".into())));
        assert!(
            matches!(deltas.last(), Some(Err(ModelError::Incomplete(m))) if m.contains("inside a line")),
            "{deltas:?}"
        );
        let sse = "data: {\"choices\":[{\"delta\":{\"content\":\"hi\"},\"finish_reason\":\"stop\"}]}\n\ndata: {\"choices\":[],\"usage\":{\"prompt";
        assert_eq!(
            ok(run(sse).await),
            [ChatDelta::Content("hi".into()), STOPPED]
        );
        // Events ended by CR LF (or CR alone) are whole.
        let sse = "data: {\"choices\":[{\"delta\":{\"content\":\"a\"}}]}\r\n\r\ndata: {\"choices\":[{\"delta\":{\"content\":\"b\"},\"finish_reason\":\"stop\"}]}\r\rdata: [DONE]\r\n\r\n";
        assert_eq!(ok(run(sse).await).len(), 3);
    }

    /// Counts the chunks a decoder pulls from an endless body.
    fn endless(
        chunk: &'static [u8],
        start: &'static [u8],
        pulled: std::sync::Arc<std::sync::atomic::AtomicUsize>,
    ) -> impl Stream<Item = Result<bytes::Bytes, std::io::Error>> + Send + Unpin + 'static {
        futures_util::stream::iter([Ok(bytes::Bytes::from_static(start))]).chain(
            futures_util::stream::repeat_with(move || {
                pulled.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
                Ok(bytes::Bytes::from_static(chunk))
            }),
        )
    }

    /// An endless line, or an endless event of short lines, ends the call with an error
    /// naming the bound once it is passed: nothing more is read.
    #[tokio::test]
    async fn endless_lines_and_events_pass_a_bound_and_end_the_call() {
        let limits = ResponseLimits {
            max_event_bytes: 64 * 1024,
            ..ResponseLimits::default()
        };
        let start: &'static [u8] = b"data: {\"choices\":[{\"delta\":{\"content\":\"a\"}}]}\n\ndata: {\"choices\":[{\"delta\":{\"content\":\"";
        for (chunk, what) in [
            (&[b'x'; 1000][..], "one SSE line of the answer"),
            (&b"data: xxxxxxxxxx\n"[..], "one SSE event of the answer"),
        ] {
            let pulled = std::sync::Arc::new(std::sync::atomic::AtomicUsize::new(0));
            let deltas: Vec<_> = decode(endless(chunk, start, pulled.clone()), limits, offered())
                .collect()
                .await;
            assert_eq!(deltas[0], Ok(ChatDelta::Content("a".into())));
            assert_eq!(
                deltas[1],
                Err(ModelError::TooLarge {
                    what,
                    limit: 64 * 1024
                })
            );
            assert_eq!(deltas.len(), 2);
            assert!(
                pulled.load(std::sync::atomic::Ordering::SeqCst) * chunk.len() <= 65 * 1024,
                "read past the bound"
            );
        }

        // Whole events below the bound pass, however many.
        let event = "data: {\"choices\":[{\"delta\":{\"content\":\"a\"}}]}\n\n";
        let sse = format!(
            "{}data: {{\"choices\":[{{\"delta\":{{}},\"finish_reason\":\"stop\"}}]}}\n\n",
            event.repeat(10_000)
        );
        let chunks: Vec<Result<bytes::Bytes, std::io::Error>> = sse
            .as_bytes()
            .chunks(4096)
            .map(|c| Ok(bytes::Bytes::copy_from_slice(c)))
            .collect();
        let deltas: Vec<_> = decode(futures_util::stream::iter(chunks), limits, offered())
            .collect()
            .await;
        assert_eq!(deltas.len(), 10_001);
        assert!(deltas.iter().all(Result::is_ok));
    }

    /// The arguments of one tool call are bounded too.
    #[tokio::test]
    async fn tool_call_arguments_are_bounded() {
        let limits = ResponseLimits {
            max_tool_arguments_bytes: 100,
            ..ResponseLimits::default()
        };
        let fragment = "data: {\"choices\":[{\"delta\":{\"tool_calls\":[{\"index\":0,\"function\":{\"arguments\":\"0123456789012345678901234567890123456789\"}}]}}]}\n\n";
        let sse = fragment.repeat(3);
        let chunks = [Ok::<_, std::io::Error>(bytes::Bytes::from(sse))];
        let deltas: Vec<_> = decode(futures_util::stream::iter(chunks), limits, offered())
            .collect()
            .await;
        assert_eq!(
            deltas,
            [Err(ModelError::TooLarge {
                what: "the arguments of one tool call",
                limit: 100
            })]
        );
    }

    /// A reply's tool calls count toward its bound: their ids, names and arguments are
    /// held until it ends, and no id or name is longer than a kilobyte.
    #[tokio::test]
    async fn a_replys_tool_calls_count_toward_its_bound() {
        let limits = ResponseLimits {
            max_reply_text_bytes: 10_000,
            ..ResponseLimits::default()
        };
        let run = |sse: String| async move {
            let chunks = [Ok::<_, std::io::Error>(bytes::Bytes::from(sse))];
            decode(futures_util::stream::iter(chunks), limits, offered())
                .collect::<Vec<_>>()
                .await
        };
        // 128 calls of 1,000 bytes of arguments each: the eleventh passes the bound.
        let call = |index: usize| {
            format!(
                "data: {{\"choices\":[{{\"delta\":{{\"tool_calls\":[{{\"index\":{index},\"id\":\"c{index}\",\"function\":{{\"name\":\"calculator\",\"arguments\":\"{}\"}}}}]}}}}]}}\n\n",
                "x".repeat(1000)
            )
        };
        let deltas = run((0..128).map(call).collect()).await;
        assert_eq!(
            deltas,
            [Err(ModelError::TooLarge {
                what: REPLY_TEXT,
                limit: 10_000
            })]
        );
        // Ids repeated on every fragment count once, as they are held once.
        let fragment = "data: {\"choices\":[{\"delta\":{\"tool_calls\":[{\"index\":0,\"id\":\"call_0123456789\",\"function\":{\"name\":\"calculator\",\"arguments\":\"1\"}}]}}]}\n\n";
        let finish = "data: {\"choices\":[{\"delta\":{},\"finish_reason\":\"tool_calls\"}]}\n\n";
        let deltas = run(format!("{}{finish}", fragment.repeat(5000))).await;
        assert_eq!(deltas.len(), 2, "{:?}", deltas.last());
        assert!(
            matches!(&deltas[0], Ok(ChatDelta::ToolCall(call)) if call.arguments.len() == 5000)
        );
        // An id or a name of more than a kilobyte is refused as it comes.
        for (field, what) in [
            ("\"id\":\"{}\"", "the id of one tool call"),
            (
                "\"function\":{{\"name\":\"{}\"}}",
                "the name of one tool call",
            ),
        ] {
            let long = field
                .replace("{}", &"n".repeat(1025))
                .replace("{{", "{")
                .replace("}}", "}");
            let sse = format!(
                "data: {{\"choices\":[{{\"delta\":{{\"tool_calls\":[{{\"index\":0,{long}}}]}}}}]}}\n\n{finish}"
            );
            assert_eq!(
                run(sse).await,
                [Err(ModelError::TooLarge { what, limit: 1024 })]
            );
        }
    }

    /// The text of one reply, answer and reasoning together, is bounded: a model that
    /// loops (or a server that misbehaves) ends the call once it passes the bound, and
    /// nothing more is read.
    #[tokio::test]
    async fn the_text_of_one_reply_is_bounded() {
        let limits = ResponseLimits {
            max_reply_text_bytes: 100,
            ..ResponseLimits::default()
        };
        let start: &'static [u8] =
            b"data: {\"choices\":[{\"delta\":{\"reasoning_content\":\"0123456789012345678901234567890123456789\"}}]}\n\n";
        let chunk: &'static [u8] =
            b"data: {\"choices\":[{\"delta\":{\"content\":\"0123456789012345678901234567890123456789\"}}]}\n\n";
        // A thousand chunks, then the finish: the call ends at the third.
        let pulled = std::sync::Arc::new(std::sync::atomic::AtomicUsize::new(0));
        let finish: &'static [u8] =
            b"data: {\"choices\":[{\"delta\":{},\"finish_reason\":\"stop\"}]}\n\n";
        let body =
            endless(chunk, start, pulled.clone())
                .take(1001)
                .chain(futures_util::stream::iter([Ok(bytes::Bytes::from_static(
                    finish,
                ))]));
        let deltas: Vec<_> = decode(body, limits, offered()).collect().await;
        assert_eq!(deltas.len(), 3, "the call went on to {:?}", deltas.last());
        let forty = "0123456789012345678901234567890123456789";
        assert_eq!(
            deltas,
            [
                Ok(ChatDelta::Reasoning(forty.into())),
                Ok(ChatDelta::Content(forty.into())),
                Err(ModelError::TooLarge {
                    what: REPLY_TEXT,
                    limit: 100
                })
            ]
        );
        assert_eq!(pulled.load(std::sync::atomic::Ordering::SeqCst), 2);
        // A reply of exactly the bound passes.
        let sse = format!(
            "data: {{\"choices\":[{{\"delta\":{{\"content\":\"{}\"}},\"finish_reason\":\"stop\"}}]}}\n\n",
            "x".repeat(100)
        );
        let chunks = [Ok::<_, std::io::Error>(bytes::Bytes::from(sse))];
        let deltas: Vec<_> = decode(futures_util::stream::iter(chunks), limits, offered())
            .collect()
            .await;
        assert_eq!(ok(deltas), [ChatDelta::Content("x".repeat(100)), STOPPED]);
    }

    #[test]
    fn credentials_in_urls_are_masked_and_errors_name_the_path() {
        assert_eq!(
            mask_credentials("http://user:pass@host:8000/v1?x=@"),
            "http://***@host:8000/v1?x=***"
        );
        assert_eq!(mask_credentials("https://host/v1"), "https://host/v1");
        let site = Site::new("http://u:p@host:1/v1/chat/completions?a=b");
        assert_eq!(site.path, "/v1/chat/completions");
        assert_eq!(site.url, "http://***@host:1/v1/chat/completions?a=***");
    }

    /// Keys in the query of a base URL (`?api-key=`, Azure API Management's
    /// `?subscription-key=`, Google's `?key=`) stay out of the URL logs show (a 404, a
    /// redirect, a failed call), however the URL is written.
    #[test]
    fn keys_in_the_query_are_masked_in_the_url_logs_show() {
        let site = Site::new(
            "https://apim.example.com/openai/deployments/d/chat/completions?api-version=2024-10-21&subscription-key=s3cr3t",
        );
        assert_eq!(
            site.url(),
            "https://apim.example.com/openai/deployments/d/chat/completions?api-version=***&subscription-key=***"
        );
        for (url, shown) in [
            (
                "http://h/v1?key=s3cr3t&stream",
                "http://h/v1?key=***&stream",
            ),
            ("http://h/v1?a=1;key=s3cr3t", "http://h/v1?a=***"),
            ("http://h/v1#x?key=s3cr3t", "http://h/v1#x?key=***"),
            ("http://h/v1?key=s3 cr3t", "http://h/v1?key=***"),
            ("h:1/v1?api-key=s3cr3t", "h:1/v1?api-key=***"),
            ("http://us er:s3cr3t@h/v1", "http://***@h/v1"),
        ] {
            assert_eq!(mask_credentials(url), shown);
        }
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
            [ChatDelta::Content("a <b> \"c\"".into()), STOPPED]
        );
    }

    /// `content` as a list of parts, as Mistral's reasoning models stream it: text parts
    /// are the answer, thinking parts its reasoning, other parts left out.
    #[tokio::test]
    async fn content_sent_as_parts_is_answer_and_reasoning() {
        let sse = concat!(
            "data: {\"choices\":[{\"delta\":{\"content\":[{\"type\":\"thinking\",\"thinking\":[{\"type\":\"text\",\"text\":\"hmm\"}]}]}}]}\n\n",
            "data: {\"choices\":[{\"delta\":{\"content\":[{\"type\":\"thinking\",\"thinking\":\", so\"}]}}]}\n\n",
            "data: {\"choices\":[{\"delta\":{\"content\":[{\"type\":\"text\",\"text\":\"Hi\"},{\"type\":\"image_url\",\"image_url\":{}},{\"type\":\"text\",\"text\":\" there\"}]}}]}\n\n",
            "data: {\"choices\":[{\"delta\":{\"content\":[]},\"finish_reason\":\"stop\"}]}\n\n",
        );
        assert_eq!(
            ok(run(sse).await),
            [
                ChatDelta::Reasoning("hmm".into()),
                ChatDelta::Reasoning(", so".into()),
                ChatDelta::Content("Hi there".into()),
                STOPPED
            ]
        );
    }

    /// An event of type `error` fails the call with its message, whatever its data: what
    /// streamed before it is no whole answer.
    #[tokio::test]
    async fn an_event_of_type_error_is_the_providers_error() {
        for (data, message) in [
            (
                r#"{"type":"error","message":"upstream timeout"}"#,
                "upstream timeout",
            ),
            (
                r#"{"type":"error","error":{"type":"overloaded_error","message":"Overloaded"}}"#,
                "Overloaded",
            ),
            ("gateway gave up", "gateway gave up"),
        ] {
            let sse = format!(
                "data: {{\"choices\":[{{\"delta\":{{\"content\":\"Part\"}}}}]}}\n\nevent: error\ndata: {data}\n\ndata: [DONE]\n\n"
            );
            let deltas = run(&sse).await;
            assert_eq!(deltas[0], Ok(ChatDelta::Content("Part".into())));
            assert_eq!(deltas.len(), 2, "{deltas:?}");
            match &deltas[1] {
                Err(ModelError::Stream(m) | ModelError::Http { message: m, .. }) => {
                    assert!(m.contains(message), "{m}")
                }
                other => panic!("{other:?}"),
            }
        }
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
        // With a code a status would have said: that status, retried before any text.
        for (error, status) in [
            (r#"{"message": "Rate limit exceeded", "code": 429}"#, 429),
            (r#"{"message": "busy", "code": "rate_limit_exceeded"}"#, 429),
            (
                r#"{"message": "Overloaded", "type": "overloaded_error"}"#,
                503,
            ),
            (r#"{"message": "oops", "code": 502}"#, 502),
            // As LiteLLM writes its codes.
            (r#"{"message": "slow down", "code": "429"}"#, 429),
        ] {
            let deltas = run(&format!("data: {{\"error\": {error}}}\n\n")).await;
            assert!(
                matches!(&deltas[0], Err(e @ ModelError::Http { status: s, .. }) if *s == status && e.is_retryable()),
                "{error}: {deltas:?}"
            );
        }
        let deltas =
            run("data: {\"error\": {\"message\": \"no\", \"code\": \"invalid_prompt\"}}\n\n").await;
        assert!(
            matches!(&deltas[0], Err(ModelError::Stream(_))),
            "{deltas:?}"
        );
    }

    #[test]
    fn request_bodies_follow_the_api() {
        let body = request_body(
            &ChatRequest {
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
                no_calls: false,
                temperature: Some(0.5),
                max_tokens: Some(10),
                stop: vec!["Observation:".into()],
                deadline: None,
            },
            false,
        );
        let body: Value = serde_json::from_slice(&body).unwrap();
        assert_eq!(body["stream"], true);
        assert_eq!(body["model"], "m");
        assert_eq!(body["stream_options"]["include_usage"], true);
        assert_eq!(
            body["messages"][0],
            json!({"role": "system", "content": "s"})
        );
        assert_eq!(body["messages"][1], json!({"role": "user", "content": "u"}));
        // Never `null` (strict servers refuse it): the text before the calls, or empty.
        assert_eq!(body["messages"][2]["content"], "");
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
        // `true` is the API's default, left out (OpenAI's reasoning models refuse it).
        assert!(body.get("parallel_tool_calls").is_none());
        assert!(body.get("tool_choice").is_none());
        assert_eq!(body["temperature"], 0.5);
        assert_eq!(body["stop"][0], "Observation:");
        assert_eq!(body["max_tokens"], 10);
        assert!(body.get("max_completion_tokens").is_none());

        // Nothing optional is sent when the request leaves it out.
        let plain = request_body(
            &ChatRequest {
                model: "m".into(),
                messages: vec![ChatMessage::Assistant {
                    content: "a".into(),
                    tool_calls: Vec::new(),
                }],
                ..ChatRequest::default()
            },
            false,
        );
        let plain: Value = serde_json::from_slice(&plain).unwrap();
        assert_eq!(
            plain,
            json!({"model": "m", "messages": [{"role": "assistant", "content": "a"}],
                "stream": true, "stream_options": {"include_usage": true}})
        );

        // A round that must be answered in words offers the tools, calls refused.
        let answer_now = ChatRequest {
            model: "m".into(),
            tools: [ToolDefinition {
                name: "t".into(),
                description: "d".into(),
                parameters: json!({"type": "object"}).into(),
            }]
            .into(),
            no_calls: true,
            ..ChatRequest::default()
        };
        let body: Value = serde_json::from_slice(&request_body(&answer_now, false)).unwrap();
        assert_eq!(body["tool_choice"], "none");
        assert_eq!(body["tools"][0]["function"]["name"], "t");
        assert!(body.get("parallel_tool_calls").is_none());

        // OpenAI's and Azure's API take the bound under its newer name (their reasoning
        // models refuse the other).
        let bounded = ChatRequest {
            model: "o3".into(),
            max_tokens: Some(10),
            ..ChatRequest::default()
        };
        let body: Value = serde_json::from_slice(&request_body(&bounded, true)).unwrap();
        assert_eq!(body["max_completion_tokens"], 10);
        assert!(body.get("max_tokens").is_none());
        for (url, takes) in [
            ("https://api.openai.com/v1/chat/completions", true),
            (
                "https://me.openai.azure.com/openai/deployments/d/chat/completions",
                true,
            ),
            ("https://API.OpenAI.com:443/v1", true),
            ("http://127.0.0.1:8000/v1/chat/completions", false),
            ("https://openrouter.ai/api/v1/chat/completions", false),
            ("https://api.openai.com.evil.test/v1", false),
        ] {
            assert_eq!(takes_max_completion_tokens(url), takes, "{url}");
        }
    }

    /// Arguments that are not a JSON object go back as `{}`: repeated as written, servers
    /// that parse every call's arguments (vLLM, Ollama) refused every later request.
    #[test]
    fn tool_call_arguments_that_are_no_json_object_are_sent_back_as_an_empty_object() {
        let written = [
            "{\"x\": ",
            "",
            "   ",
            "\"6 * 7\"",
            "[1, 2]",
            "null",
            "{\"x\": 1} trailing",
            "{\"x\": 1}}",
            "{\"x\": 1}",
            " {\"x\": {\"y\": [1, \"}\"]}}\n",
            "{}",
        ];
        let request = ChatRequest {
            model: "m".into(),
            messages: vec![ChatMessage::Assistant {
                content: String::new(),
                tool_calls: written
                    .iter()
                    .enumerate()
                    .map(|(i, arguments)| ModelToolCall {
                        id: format!("c{i}"),
                        name: "t".into(),
                        arguments: (*arguments).into(),
                    })
                    .collect(),
            }],
            ..ChatRequest::default()
        };
        let body: Value = serde_json::from_slice(&request_body(&request, false)).unwrap();
        let sent: Vec<&str> = body["messages"][0]["tool_calls"]
            .as_array()
            .unwrap()
            .iter()
            .map(|call| call["function"]["arguments"].as_str().unwrap())
            .collect();
        assert_eq!(
            sent,
            [
                "{}",
                "{}",
                "{}",
                "{}",
                "{}",
                "{}",
                "{}",
                "{}",
                // A JSON object goes as the model wrote it.
                "{\"x\": 1}",
                " {\"x\": {\"y\": [1, \"}\"]}}\n",
                "{}",
            ]
        );
    }

    /// `parallel_tool_calls` is sent only as `false`, and only with tools: `true` is the
    /// API's default, and OpenAI's reasoning models refuse the parameter.
    #[test]
    fn parallel_tool_calls_is_sent_only_to_turn_it_off() {
        let tools: std::sync::Arc<[ToolDefinition]> = [ToolDefinition {
            name: "t".into(),
            description: "d".into(),
            parameters: json!({"type": "object"}).into(),
        }]
        .into();
        for (tools, parallel, sent) in [
            (tools.clone(), true, None),
            (tools, false, Some(json!(false))),
            (std::sync::Arc::from([]), false, None),
            (std::sync::Arc::from([]), true, None),
        ] {
            let request = ChatRequest {
                model: "o3".into(),
                tools,
                parallel_tool_calls: parallel,
                ..ChatRequest::default()
            };
            let body: Value = serde_json::from_slice(&request_body(&request, true)).unwrap();
            assert_eq!(body.get("parallel_tool_calls"), sent.as_ref(), "{body}");
        }
    }

    /// A `<think>` the model writes in its answer stays in the answer, through the decoder
    /// (it used to turn the rest of the answer into reasoning).
    #[tokio::test]
    async fn a_think_tag_in_the_answer_is_answer_text() {
        let sse = concat!(
            "data: {\"choices\":[{\"delta\":{\"content\":\"<think>plan</think>\"}}]}\n\n",
            "data: {\"choices\":[{\"delta\":{\"content\":\"Qwen writes <think>\"}}]}\n\n",
            "data: {\"choices\":[{\"delta\":{\"content\":\" first.\"},\"finish_reason\":\"stop\"}]}\n\n",
        );
        let deltas = ok(run(sse).await);
        let reasoning: String = deltas
            .iter()
            .filter_map(|d| match d {
                ChatDelta::Reasoning(text) => Some(text.as_str()),
                _ => None,
            })
            .collect();
        let content: String = deltas
            .iter()
            .filter_map(|d| match d {
                ChatDelta::Content(text) => Some(text.as_str()),
                _ => None,
            })
            .collect();
        assert_eq!(reasoning, "plan");
        assert_eq!(content, "Qwen writes <think> first.");
        assert_eq!(deltas.last(), Some(&STOPPED));
    }

    #[tokio::test]
    async fn tool_call_arguments_sent_as_an_object_are_taken_as_their_json() {
        let sse = concat!(
            "data: {\"choices\":[{\"delta\":{\"tool_calls\":[{\"index\":0,\"id\":\"a\",\"function\":{\"name\":\"t\",\"arguments\":{\"x\":[1,\"two\"]}}}]},\"finish_reason\":\"tool_calls\"}]}\n\n",
            "data: [DONE]\n\n",
        );
        let deltas = ok(run(sse).await);
        assert_eq!(
            deltas[0],
            ChatDelta::ToolCall(ModelToolCall {
                id: "a".into(),
                name: "t".into(),
                arguments: r#"{"x":[1,"two"]}"#.into(),
            })
        );
    }

    #[test]
    fn the_key_goes_in_the_header_the_provider_names() {
        let settings = |header: Option<&str>| ProviderSettings {
            kind: crate::ProviderKind::Openai,
            base_url: "https://me.openai.azure.com/openai/deployments/d".into(),
            api_key: agentrt_core::Secret::new("k3y"),
            api_key_env: None,
            api_key_header: header.map(str::to_owned),
            http2_prior_knowledge: false,
            http_client: crate::HttpClient::Lean,
        };
        let bearer = request_headers(&settings(None), "text/event-stream").unwrap();
        assert_eq!(bearer[AUTHORIZATION], "Bearer k3y");
        // Azure OpenAI's way: the key as it is, in `api-key`.
        let azure = request_headers(&settings(Some("api-key")), "text/event-stream").unwrap();
        assert_eq!(azure["api-key"], "k3y");
        assert!(azure[&"api-key".parse::<http::header::HeaderName>().unwrap()].is_sensitive());
        assert!(azure.get(AUTHORIZATION).is_none());
        for bad in ["bad header", "content-type"] {
            assert!(
                matches!(request_headers(&settings(Some(bad)), "x"), Err(ModelError::Misconfigured(m)) if m.contains("api_key_header")),
                "{bad}"
            );
        }
    }

    #[tokio::test]
    async fn an_account_out_of_quota_is_not_a_rate_limit() {
        let body = |text: &'static str| {
            futures_util::stream::iter([Ok::<_, std::io::Error>(bytes::Bytes::from(text))])
        };
        let quota = http_error(
            429,
            &HeaderMap::new(),
            body(r#"{"error": {"message": "You exceeded your current quota.", "type": "insufficient_quota", "code": "insufficient_quota"}}"#),
            &Site::default(),
            &ResponseLimits::default(),
        )
        .await;
        assert!(
            quota.to_string().contains("(insufficient_quota)"),
            "{quota}"
        );
        assert!(!quota.is_retryable());
        let rate = http_error(
            429,
            &HeaderMap::new(),
            body(r#"{"error": {"message": "Rate limit reached.", "code": "rate_limit_exceeded"}}"#),
            &Site::default(),
            &ResponseLimits::default(),
        )
        .await;
        assert!(rate.is_retryable(), "{rate}");
    }

    /// A `503` whose body stalls is still a `503` (with its `Retry-After`), read in
    /// seconds: not a call held to its timeout.
    #[tokio::test(start_paused = true)]
    async fn an_error_whose_body_stalls_is_still_its_status() {
        let body =
            futures_util::stream::iter([Ok::<_, std::io::Error>(bytes::Bytes::from("busy"))])
                .chain(futures_util::stream::pending());
        let mut headers = HeaderMap::new();
        headers.insert(http::header::RETRY_AFTER, "1".parse().unwrap());
        let started = tokio::time::Instant::now();
        let error = http_error(
            503,
            &headers,
            body,
            &Site::default(),
            &ResponseLimits::default(),
        )
        .await;
        assert_eq!(started.elapsed(), ERROR_BODY_PATIENCE);
        match &error {
            ModelError::Http {
                status: 503,
                message,
                retry_after: Some(after),
            } => {
                assert!(message.contains("busy"), "{message}");
                assert_eq!(*after, Duration::from_secs(1));
            }
            other => panic!("{other:?}"),
        }
        assert!(error.is_retryable());
    }

    #[test]
    fn retry_after_is_read_in_seconds_or_as_an_http_date() {
        assert_eq!(retry_after_delay(" 2 "), Some(Duration::from_secs(2)));
        assert_eq!(retry_after_delay("0.5"), Some(Duration::from_millis(500)));
        let later = std::time::SystemTime::now() + Duration::from_secs(30);
        let delay = retry_after_delay(&httpdate::fmt_http_date(later)).unwrap();
        assert!(
            (Duration::from_secs(28)..=Duration::from_secs(30)).contains(&delay),
            "{delay:?}"
        );
        assert_eq!(
            retry_after_delay("Wed, 21 Oct 2015 07:28:00 GMT"),
            Some(Duration::ZERO),
            "a date past asks for no wait"
        );
        assert_eq!(retry_after_delay("soon"), None);
        assert_eq!(retry_after_delay("-1"), None);
    }

    /// `Retry-After` is waited in full up to the cap; a longer one is not waited at all
    /// (it used to be cut to the cap, and the retry refused again). Backoff stays under
    /// the cap.
    #[test]
    fn backoff_honours_retry_after_and_the_cap() {
        let policy = RetryPolicy::default();
        assert_eq!(
            policy.delay(0, Some(Duration::from_secs(2))),
            Some(Duration::from_secs(2))
        );
        assert_eq!(
            policy.delay(0, Some(policy.max_delay)),
            Some(policy.max_delay)
        );
        assert_eq!(policy.delay(0, Some(Duration::from_secs(600))), None);
        for attempt in 0..5 {
            let delay = policy.delay(attempt, None).unwrap();
            assert!(delay <= policy.base_delay * (1 << attempt));
        }
        let capped = RetryPolicy {
            max_delay: Duration::from_millis(100),
            ..policy
        };
        assert!(capped.delay(10, None).unwrap() <= Duration::from_millis(100));
    }

    /// OpenAI's and Azure's `retry-after-ms` says the wait in milliseconds, and is taken
    /// before `Retry-After`, which remains when it is absent or unreadable.
    #[tokio::test]
    async fn retry_after_ms_is_preferred_to_retry_after() {
        let error = |headers: &[(&'static str, &'static str)]| {
            let mut map = HeaderMap::new();
            for (name, value) in headers {
                map.insert(*name, HeaderValue::from_static(value));
            }
            async move {
                let body = futures_util::stream::iter([Ok::<_, std::io::Error>(
                    bytes::Bytes::from_static(b"{\"error\": {\"message\": \"slow down\"}}"),
                )]);
                match http_error(
                    429,
                    &map,
                    body,
                    &Site::default(),
                    &ResponseLimits::default(),
                )
                .await
                {
                    ModelError::Http { retry_after, .. } => retry_after,
                    other => panic!("{other:?}"),
                }
            }
        };
        assert_eq!(
            error(&[("retry-after-ms", "1500"), ("retry-after", "2")]).await,
            Some(Duration::from_millis(1500))
        );
        assert_eq!(
            error(&[("retry-after-ms", " 250.5 ")]).await,
            Some(Duration::from_micros(250_500))
        );
        assert_eq!(
            error(&[("retry-after-ms", "soon"), ("retry-after", "2")]).await,
            Some(Duration::from_secs(2))
        );
        assert_eq!(
            error(&[("retry-after-ms", "-5"), ("retry-after", "3")]).await,
            Some(Duration::from_secs(3))
        );
        assert_eq!(error(&[]).await, None);
    }
}
