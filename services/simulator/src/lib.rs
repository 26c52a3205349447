//! An OpenAI-compatible chat completions simulator for the demo, the tests and the
//! benchmarks: `POST /v1/chat/completions` streams scripted turns the way real providers
//! stream them (role chunk, content and argument fragments, interleaved parallel tool
//! calls, a finish chunk, a usage chunk, `[DONE]`), with scripted errors, delays and
//! broken streams, or answers one `chat.completion` object to a request without
//! `stream: true`; `POST /v1/rerank` ranks documents deterministically. See [`scenario`]
//! for the scripts, the ways a turn can misbehave, and the reranker.
//!
//! Every error, scripted or not (an unknown path, a wrong method, a body over
//! [`MAX_BODY_BYTES`]), is answered in OpenAI's shape:
//! `{"error": {"message": ..., "type": ..., "param": ..., "code": ...}}`.

mod rerank;
pub mod scenario;

use std::{
    collections::{BTreeSet, HashMap, VecDeque},
    future::Future,
    hash::{DefaultHasher, Hash, Hasher},
    net::SocketAddr,
    path::PathBuf,
    sync::{Arc, Mutex},
    time::Duration,
};

use axum::{
    Json, Router,
    body::Body,
    extract::{DefaultBodyLimit, State, rejection::BytesRejection},
    http::{HeaderName, HeaderValue, Method, StatusCode, Uri, header},
    response::{IntoResponse, Response},
    routing::{get, post},
};
use bytes::Bytes;
use hyper_util::{
    rt::{TokioExecutor, TokioIo},
    server::{conn::auto, graceful::GracefulShutdown},
    service::TowerToHyperService,
};
use serde::{Deserialize, Serialize};
use serde_json::{Value, json};
use tokio::net::TcpListener;
use tracing::{info, warn};

use scenario::{ChatRequestIn, Conversation, Scenarios, Turn};

/// The simulator's settings.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct Settings {
    /// Address to listen on.
    pub listen: SocketAddr,
    /// Latency added before every answer.
    #[serde(with = "agentrt_grpc::config::duration")]
    pub latency: Duration,
    /// Scenarios file: JSON, or TOML when its name ends in `.toml`; the built-in `demo`
    /// model is always there.
    pub scenarios: Option<PathBuf>,
    /// Most HTTP/2 streams (calls) one connection may have open at once, as real servers
    /// limit them (often to 100 or so); unset, a connection takes as many as a client opens.
    pub max_concurrent_streams: Option<u32>,
    /// Refuse requests holding a message whose `content` is `null` with HTTP 500, as
    /// llama-cpp-python does, for every model (a scenario can also ask for it alone).
    pub strict_messages: bool,
    /// Serve HTTPS with this certificate and key, HTTP/2 negotiated by ALPN (`h2`), as
    /// hosted providers serve; unset, plain HTTP (HTTP/1.1, and HTTP/2 with prior
    /// knowledge).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub tls: Option<agentrt_grpc::security::TlsSettings>,
}

impl Default for Settings {
    fn default() -> Self {
        Self {
            listen: SocketAddr::from(([127, 0, 0, 1], 50053)),
            latency: Duration::ZERO,
            scenarios: None,
            max_concurrent_streams: None,
            strict_messages: false,
            tls: None,
        }
    }
}

/// The simulator's command line; every flag also reads `MODEL_SIMULATOR_<FLAG>`.
#[derive(Debug, Clone, Default, clap::Parser)]
#[command(
    name = "model-simulator",
    version,
    about = "An OpenAI-compatible chat completions simulator.",
    long_about = "An OpenAI-compatible chat completions simulator: POST /v1/chat/completions \
        streams scripted turns (the scenarios file; the built-in `demo` model uses the \
        calculator), or answers one object to a request without `stream: true`, \
        honouring `stop`, `max_tokens` and `tool_choice: \"none\"`; turns can misbehave \
        as some servers do (README, \"Scripting the simulator\"). POST /v1/rerank ranks documents by the share of \
        the query's words they hold; the rerank model `fail` answers HTTP 500 and `slow` \
        answers after 30 s."
)]
pub struct Cli {
    /// Address to listen on, HOST:PORT (port 0 picks a free port).
    #[arg(long, value_name = "HOST:PORT", value_parser = agentrt_grpc::config::parse_listen)]
    pub listen: Option<SocketAddr>,
    /// Latency added before every answer, e.g. `1s`.
    #[arg(long, value_name = "DURATION", value_parser = agentrt_grpc::config::parse_duration)]
    pub latency: Option<Duration>,
    /// Scenarios file: JSON, or TOML when its name ends in `.toml`.
    #[arg(long, value_name = "FILE")]
    pub scenarios: Option<PathBuf>,
    /// Most HTTP/2 streams open at once on one connection (unlimited when unset).
    #[arg(long, value_name = "N")]
    pub max_concurrent_streams: Option<u32>,
    /// Refuse messages whose `content` is `null` with HTTP 500, as llama-cpp-python does.
    #[arg(long)]
    pub strict_messages: bool,
    /// Serve HTTPS (HTTP/2 negotiated by ALPN) with this certificate chain, PEM; needs
    /// `--tls-key`.
    #[arg(long, value_name = "FILE", requires = "tls_key")]
    pub tls_cert: Option<PathBuf>,
    /// The private key of `--tls-cert`, PEM.
    #[arg(long, value_name = "FILE", requires = "tls_cert")]
    pub tls_key: Option<PathBuf>,
}

impl Cli {
    /// The prefix of the environment variables that stand for flags.
    pub const ENV_PREFIX: &'static str = "MODEL_SIMULATOR";

    /// Defaults overridden by flags and environment.
    pub fn settings(&self) -> Settings {
        let mut settings = Settings::default();
        agentrt_grpc::config::override_with(&mut settings.listen, self.listen);
        agentrt_grpc::config::override_with(&mut settings.latency, self.latency);
        if self.scenarios.is_some() {
            settings.scenarios.clone_from(&self.scenarios);
        }
        if self.max_concurrent_streams.is_some() {
            settings.max_concurrent_streams = self.max_concurrent_streams;
        }
        settings.strict_messages |= self.strict_messages;
        if let (Some(cert_file), Some(key_file)) = (&self.tls_cert, &self.tls_key) {
            settings.tls = Some(agentrt_grpc::security::TlsSettings {
                cert_file: cert_file.clone(),
                key_file: key_file.clone(),
                client_ca_file: None,
                allowed_client_names: Vec::new(),
            });
        }
        settings
    }
}

/// Why the simulator could not start.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// The scenarios file could not be read or parsed.
    #[error("cannot load scenarios from {path}: {reason}")]
    Scenarios {
        /// The file.
        path: String,
        /// Why.
        reason: String,
    },
    /// The listener failed.
    #[error("simulator server error: {0}")]
    Io(#[from] std::io::Error),
    /// The TLS certificate or key could not be used.
    #[error("{0}")]
    Tls(#[from] agentrt_grpc::config::ConfigError),
}

/// How long a client may take over its TLS handshake.
const HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(10);

/// Loads the scenarios the settings name.
pub fn load_scenarios(settings: &Settings) -> Result<Scenarios, Error> {
    let Some(path) = &settings.scenarios else {
        return Ok(Scenarios::default());
    };
    let failed = |reason: String| Error::Scenarios {
        path: path.display().to_string(),
        reason,
    };
    if path.extension().is_some_and(|e| e == "toml") {
        return agentrt_grpc::config::load_file(path).map_err(|e| failed(e.to_string()));
    }
    let text = std::fs::read_to_string(path).map_err(|e| failed(e.to_string()))?;
    serde_json::from_str(&text).map_err(|e| failed(e.to_string()))
}

/// The largest request body taken (real providers take contexts of megabytes); a larger
/// one is refused with a 413.
pub const MAX_BODY_BYTES: usize = 32 << 20;

/// The most conversations whose failed attempts are remembered (see [`Attempts`]).
const MAX_ATTEMPTS_KEPT: usize = 65_536;

struct Simulator {
    scenarios: Scenarios,
    latency: Duration,
    strict_messages: bool,
    /// Failed attempts per conversation, for errors scripted to pass after `times`.
    attempts: Mutex<Attempts>,
}

/// Attempts of turns scripted to fail `times` times, by conversation: a hash of the model
/// and the request's messages (the turn played follows from them), so that each
/// conversation, and a retry of it, fails its own first attempts. At most `limit`
/// conversations are remembered, the oldest forgotten first: a load of distinct
/// conversations holds a bounded amount.
struct Attempts {
    counts: HashMap<u64, u32>,
    /// The conversations in the order first seen.
    order: VecDeque<u64>,
    limit: usize,
}

impl Attempts {
    fn new(limit: usize) -> Self {
        Self {
            counts: HashMap::new(),
            order: VecDeque::new(),
            limit: limit.max(1),
        }
    }

    /// The attempts of `conversation` so far, this one included.
    fn count(&mut self, conversation: u64) -> u32 {
        if let Some(count) = self.counts.get_mut(&conversation) {
            *count = count.saturating_add(1);
            return *count;
        }
        if self.order.len() >= self.limit
            && let Some(oldest) = self.order.pop_front()
        {
            self.counts.remove(&oldest);
        }
        self.order.push_back(conversation);
        self.counts.insert(conversation, 1);
        1
    }
}

/// The key of a conversation in [`Attempts`].
fn conversation_key(model: &str, messages: &str) -> u64 {
    let mut hasher = DefaultHasher::new();
    model.hash(&mut hasher);
    messages.hash(&mut hasher);
    hasher.finish()
}

/// Serves the simulator on `listener` until `shutdown` resolves.
pub async fn serve(
    settings: Settings,
    listener: TcpListener,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> Result<(), Error> {
    let simulator = Arc::new(Simulator {
        scenarios: load_scenarios(&settings)?,
        latency: settings.latency,
        strict_messages: settings.strict_messages,
        attempts: Mutex::new(Attempts::new(MAX_ATTEMPTS_KEPT)),
    });
    let app = Router::new()
        .route("/v1/chat/completions", post(chat_completions))
        .route("/v1/models", get(models))
        .route("/v1/rerank", post(rerank::rerank))
        .fallback(unknown_path)
        .method_not_allowed_fallback(method_not_allowed)
        .layer(DefaultBodyLimit::max(MAX_BODY_BYTES))
        .with_state(simulator);
    let tls = settings
        .tls
        .as_ref()
        .map(|tls| tls.acceptor())
        .transpose()?;
    info!(
        service = "model-simulator",
        addr = %listener.local_addr()?,
        scheme = if tls.is_some() { "https" } else { "http" },
        "listening"
    );
    // HTTP/1.1 and HTTP/2 (h2c with prior knowledge) on one port. Unless limited, HTTP/2
    // allows as many concurrent calls per connection as a client opens, so that a load
    // test runs over a few connections instead of thousands.
    let mut http = auto::Builder::new(TokioExecutor::new());
    http.http2()
        .max_concurrent_streams(settings.max_concurrent_streams)
        .initial_connection_window_size(16 * 1024 * 1024)
        .initial_stream_window_size(1024 * 1024);
    let service = TowerToHyperService::new(app);
    let graceful = GracefulShutdown::new();
    let mut shutdown = std::pin::pin!(shutdown);
    loop {
        let (stream, _) = tokio::select! {
            accepted = listener.accept() => match accepted {
                Ok(accepted) => accepted,
                Err(error) => {
                    // Out of file descriptors and the like: wait, then go on accepting.
                    warn!(%error, "accept failed");
                    tokio::time::sleep(Duration::from_millis(50)).await;
                    continue;
                }
            },
            () = &mut shutdown => break,
        };
        let _ = stream.set_nodelay(true);
        let stream = agentrt_coalesce::Coalesced::new(stream);
        let (http, service, watcher) = (http.clone(), service.clone(), graceful.watcher());
        let tls = tls.clone();
        tokio::spawn(async move {
            let served = match tls {
                None => {
                    let connection =
                        http.serve_connection_with_upgrades(TokioIo::new(stream), service);
                    watcher.watch(connection.into_owned()).await
                }
                // The handshake runs in the connection's task: a slow client holds up no
                // other.
                Some(tls) => {
                    let stream =
                        match tokio::time::timeout(HANDSHAKE_TIMEOUT, tls.accept(stream)).await {
                            Ok(Ok(stream)) => stream,
                            Ok(Err(error)) => {
                                warn!(%error, "TLS handshake failed");
                                return;
                            }
                            Err(_) => {
                                warn!("TLS handshake timed out");
                                return;
                            }
                        };
                    let alpn = stream
                        .get_ref()
                        .1
                        .alpn_protocol()
                        .map(String::from_utf8_lossy);
                    info!(alpn = alpn.as_deref().unwrap_or("none"), "TLS connection");
                    let connection =
                        http.serve_connection_with_upgrades(TokioIo::new(stream), service);
                    watcher.watch(connection.into_owned()).await
                }
            };
            if let Err(error) = served {
                warn!(error = ?error, "connection ended with an error");
            }
        });
    }
    graceful.shutdown().await;
    Ok(())
}

/// The models, each once (a scenario named `demo` stands in for the built-in one), in
/// OpenAI's shape; `created` is 0, as in the answers, for they are the same at every start.
async fn models(State(sim): State<Arc<Simulator>>) -> Json<Value> {
    let mut names: BTreeSet<&str> = sim.scenarios.scenarios.keys().map(String::as_str).collect();
    names.insert(scenario::DEMO);
    let data: Vec<Value> = names
        .iter()
        .map(|n| json!({"id": n, "object": "model", "created": 0, "owned_by": "simulator"}))
        .collect();
    Json(json!({"object": "list", "data": data}))
}

/// A path the simulator does not serve: a 404 worded as OpenAI words it.
async fn unknown_path(method: Method, uri: Uri) -> Response {
    api_error(
        404,
        &format!("Invalid URL ({method} {})", uri.path()),
        None,
        None,
    )
}

/// A method a path does not take.
async fn method_not_allowed(method: Method, uri: Uri) -> Response {
    api_error(
        405,
        &format!("Invalid method for URL ({method} {})", uri.path()),
        None,
        None,
    )
}

/// A body that could not be read (over [`MAX_BODY_BYTES`], or cut off), as a JSON error.
fn body_refused(rejection: &BytesRejection) -> Response {
    let status = rejection.status();
    if status == StatusCode::PAYLOAD_TOO_LARGE {
        let message = format!(
            "The request body is larger than the simulator's limit of {MAX_BODY_BYTES} bytes"
        );
        return api_error(413, &message, None, None);
    }
    api_error(status.as_u16(), &rejection.body_text(), None, None)
}

async fn chat_completions(
    State(sim): State<Arc<Simulator>>,
    headers: axum::http::HeaderMap,
    body: Result<Bytes, BytesRejection>,
) -> Response {
    let body = match body {
        Ok(body) => body,
        Err(rejection) => return body_refused(&rejection),
    };
    // Read typed and borrowed: a JSON tree of every request (tool schemas included) was
    // the larger part of the simulator's cost under load.
    let parsed = std::str::from_utf8(&body)
        .map_err(|e| e.to_string())
        .and_then(|text| ChatRequestIn::parse(text).map_err(|e| e.to_string()))
        .and_then(|request| {
            let conversation = Conversation::of(&request).map_err(|e| e.to_string())?;
            Ok((request, conversation))
        });
    let (request, conversation) = match parsed {
        Ok(parsed) => parsed,
        Err(error) => {
            return error_response(400, &format!("invalid request body: {error}"), None);
        }
    };
    if let Some(n) = request.n.filter(|n| *n != 1) {
        return api_error(
            400,
            &format!("n = {n} is not supported: the simulator answers one choice"),
            Some("n"),
            None,
        );
    }
    // Refused as OpenAI refuses them, so that a client's mistake does not pass here.
    if request.model.is_empty() {
        return api_error(
            400,
            "you must provide a model parameter",
            Some("model"),
            None,
        );
    }
    if request
        .messages
        .get()
        .chars()
        .filter(|c| !c.is_whitespace())
        .eq("[]".chars())
    {
        return api_error(400, "[] is too short - 'messages'", Some("messages"), None);
    }
    if request.stream_options.is_some() && request.stream != Some(true) {
        return api_error(
            400,
            "The 'stream_options' parameter is only allowed when 'stream' is enabled.",
            Some("stream_options"),
            None,
        );
    }
    let model = request.model.clone().into_owned();
    // Shows that callers propagate their trace context (W3C `traceparent`).
    if let Some(traceparent) = headers.get("traceparent").and_then(|v| v.to_str().ok()) {
        info!(%model, traceparent, "chat completion request");
    }
    let scenario = sim.scenarios.scenarios.get(&model);
    if (sim.strict_messages || scenario.is_some_and(|s| s.strict_messages))
        && let Some(role) = &conversation.null_content
    {
        // What llama-cpp-python's pydantic models answer.
        let message = format!(
            "1 validation error for ChatCompletionRequest{}Message\ncontent\n  Input should be \
             a valid string [type=string_type, input_value=None, input_type=NoneType]",
            capitalized(role)
        );
        return error_response(500, &message, None);
    }
    let turn = match scenario {
        Some(scenario) => scenario.turn(&conversation),
        None if model == scenario::DEMO => scenario::demo(&conversation),
        None => {
            return error_response(
                404,
                &format!(
                    "The model `{model}` does not exist (simulator models: demo and the scenarios file's)"
                ),
                None,
            );
        }
    };
    let asked = Asked::of(&request);
    let stream = request.stream == Some(true);
    let include_usage = request
        .stream_options
        .as_ref()
        .and_then(|o| o["include_usage"].as_bool())
        .unwrap_or(false);
    let prompt_chars = request.messages.get().len();
    // Only for turns scripted to pass after some failures: hashing every body would cost
    // the load for nothing.
    let attempt_key = turn
        .error
        .as_ref()
        .filter(|error| error.times > 0)
        .map(|_| conversation_key(&model, request.messages.get()));
    // Only what the reply needs is kept over the latency: ten thousand requests waiting
    // at once must not hold their whole body.
    drop(request);
    drop((body, headers));
    let latency = sim.latency + Duration::from_millis(turn.latency_ms);
    if !latency.is_zero() {
        tokio::time::sleep(latency).await;
    }
    if let Some(location) = &turn.redirect_to {
        let status = StatusCode::from_u16(turn.redirect_status.unwrap_or(307))
            .unwrap_or(StatusCode::TEMPORARY_REDIRECT);
        let mut response = status.into_response();
        if let Ok(value) = HeaderValue::from_str(location) {
            response.headers_mut().insert(header::LOCATION, value);
        }
        return response;
    }
    if let Some(error) = &turn.error {
        let failing = match attempt_key {
            None => true,
            Some(key) => {
                let attempts = sim
                    .attempts
                    .lock()
                    .unwrap_or_else(std::sync::PoisonError::into_inner)
                    .count(key);
                attempts <= error.times
            }
        };
        if failing {
            return error_response(error.status, &error.message, error.retry_after);
        }
    }
    if let Some(body) = &turn.plain_body {
        let kind = turn
            .plain_content_type
            .as_deref()
            .unwrap_or("application/json");
        let mut response = Response::new(Body::from(body.clone()));
        if let Ok(value) = HeaderValue::from_str(kind) {
            response.headers_mut().insert(header::CONTENT_TYPE, value);
        }
        return response;
    }
    let answer = answer(&turn, &asked);
    if !stream {
        return Json(completion(&model, &turn, &answer, prompt_chars)).into_response();
    }
    let endless = turn.endless_line;
    let chunks = sse_chunks(&model, &turn, &answer, include_usage, prompt_chars);
    let delay = Duration::from_millis(turn.chunk_delay_ms);
    let linger = Duration::from_millis(turn.linger_ms);
    let stream = futures_util::stream::unfold(
        (chunks.into_iter(), true),
        move |(mut chunks, first)| async move {
            let Some(chunk) = chunks.next() else {
                tokio::time::sleep(linger).await;
                return None;
            };
            if !first && !delay.is_zero() {
                tokio::time::sleep(delay).await;
            }
            if chunk.is_err() {
                // Let what came before reach the client, so that the drop is mid-stream.
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
            Some((chunk, (chunks, false)))
        },
    );
    let stream = if endless {
        // A line begun and never ended, as fast as the client reads.
        use futures_util::StreamExt;
        static LINE: [u8; 16 * 1024] = [b'x'; 16 * 1024];
        let start = Bytes::from_static(b"data: {\"choices\":[{\"delta\":{\"content\":\"");
        let line = futures_util::stream::iter([Ok(start)]).chain(
            futures_util::stream::repeat_with(|| Ok(Bytes::from_static(&LINE))),
        );
        stream.chain(line).left_stream()
    } else {
        use futures_util::StreamExt;
        stream.right_stream()
    };
    let mut response = Response::new(Body::from_stream(stream));
    response.headers_mut().insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("text/event-stream"),
    );
    response
        .headers_mut()
        .insert(header::CACHE_CONTROL, HeaderValue::from_static("no-cache"));
    response
}

/// `role` with a capital first letter.
fn capitalized(role: &str) -> String {
    let mut chars = role.chars();
    chars
        .next()
        .map(|first| first.to_uppercase().chain(chars).collect())
        .unwrap_or_default()
}

/// An error answered with `status` (a scripted one too), with the code OpenAI gives that
/// status, and, when a wait is given, the headers OpenAI sends with it: `retry-after-ms`,
/// and `Retry-After` in whole seconds (rounded up: the header has no fractions).
fn error_response(status: u16, message: &str, retry_after: Option<f64>) -> Response {
    let code = match status {
        401 => Some("invalid_api_key"),
        404 => Some("model_not_found"),
        429 => Some("rate_limit_exceeded"),
        _ => None,
    };
    let mut response = api_error(status, message, None, code);
    if let Some(seconds) = retry_after.filter(|s| s.is_finite() && *s >= 0.0) {
        let headers = response.headers_mut();
        // Bounded: a scenario's number is any f64.
        let millis = (seconds * 1000.0).round().min(1e12);
        headers.insert(
            HeaderName::from_static("retry-after-ms"),
            HeaderValue::from(millis as u64),
        );
        headers.insert(
            header::RETRY_AFTER,
            HeaderValue::from(seconds.ceil().min(1e9) as u64),
        );
    }
    response
}

/// An error in OpenAI's shape, `{"error": {"message", "type", "param", "code"}}`, its type
/// the one OpenAI gives the status.
fn api_error(status: u16, message: &str, param: Option<&str>, code: Option<&str>) -> Response {
    let status = StatusCode::from_u16(status).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR);
    let kind = match status.as_u16() {
        401 => "authentication_error",
        429 => "rate_limit_error",
        400..=499 => "invalid_request_error",
        _ => "server_error",
    };
    let body = json!({"error": {"message": message, "type": kind, "param": param, "code": code}});
    (status, Json(body)).into_response()
}

type Chunk = Result<Bytes, std::io::Error>;

/// One streamed chunk, written straight from borrowed parts (a JSON tree per chunk was most
/// of the simulator's cost under load). Fields in the order a JSON object map writes them.
#[derive(serde::Serialize)]
struct ChunkOut<'a> {
    choices: [ChoiceOut<'a>; 1],
    created: u64,
    id: &'a str,
    model: &'a str,
    object: &'static str,
}

#[derive(serde::Serialize)]
struct ChoiceOut<'a> {
    delta: DeltaOut<'a>,
    finish_reason: Option<&'a str>,
    index: u32,
}

/// A chunk's delta, one shape per kind of chunk; fields in the order a JSON object map
/// writes them.
#[derive(serde::Serialize)]
#[serde(untagged)]
enum DeltaOut<'a> {
    /// The first chunk.
    Role {
        content: &'static str,
        role: &'static str,
    },
    Reasoning {
        content: Option<&'a str>,
        reasoning_content: &'a str,
    },
    Content {
        content: &'a str,
    },
    Call {
        tool_calls: [CallOut<'a>; 1],
    },
    /// The finish chunk.
    Empty {},
}

#[derive(serde::Serialize)]
struct CallOut<'a> {
    function: FunctionOut<'a>,
    #[serde(skip_serializing_if = "Option::is_none")]
    id: Option<&'a str>,
    index: usize,
    #[serde(rename = "type", skip_serializing_if = "Option::is_none")]
    kind: Option<&'static str>,
}

#[derive(serde::Serialize)]
struct FunctionOut<'a> {
    arguments: &'a str,
    #[serde(skip_serializing_if = "Option::is_none")]
    name: Option<&'a str>,
}

/// `value` as one SSE `data:` event.
fn sse_data(value: &impl serde::Serialize) -> Bytes {
    let mut out = b"data: ".to_vec();
    // Writing plain data into a Vec cannot fail.
    let _ = serde_json::to_writer(&mut out, value);
    out.extend_from_slice(b"\n\n");
    Bytes::from(out)
}

/// What a request asks of its answer beside the turn.
#[derive(Debug, Default)]
struct Asked {
    /// Stop sequences.
    stops: Vec<String>,
    /// `max_completion_tokens` (or `max_tokens`) in bytes, at 4 a token.
    max_bytes: Option<usize>,
    /// `tool_choice: "none"`: no tool calls.
    no_tools: bool,
}

impl Asked {
    fn of(request: &ChatRequestIn<'_>) -> Self {
        let stops = match &request.stop {
            Some(Value::String(s)) => vec![s.clone()],
            Some(Value::Array(items)) => items
                .iter()
                .filter_map(|s| s.as_str().map(str::to_owned))
                .collect(),
            _ => Vec::new(),
        };
        let max_bytes = request
            .max_completion_tokens
            .or(request.max_tokens)
            .map(|tokens| {
                usize::try_from(tokens)
                    .unwrap_or(usize::MAX)
                    .saturating_mul(4)
            });
        Self {
            stops,
            max_bytes,
            no_tools: request.tool_choice.as_ref().and_then(Value::as_str) == Some("none"),
        }
    }
}

/// A turn's answer once the request's `stop`, token limit and `tool_choice` are applied:
/// what both the event stream and the single `chat.completion` object are built from.
#[derive(Debug)]
struct Answer {
    /// Sent as `reasoning_content`; empty when the reasoning is in `content`'s `<think>`
    /// tags.
    reasoning: String,
    content: String,
    calls: Vec<CallAnswer>,
    finish: String,
    /// The length of the reasoning, content and arguments, for the usage.
    completion_chars: usize,
}

#[derive(Debug)]
struct CallAnswer {
    id: String,
    name: String,
    arguments: String,
}

/// The answer `turn` gives to what was `asked`.
fn answer(turn: &Turn, asked: &Asked) -> Answer {
    let mut content = if turn.repeat_content > 1 {
        turn.content.repeat(turn.repeat_content)
    } else {
        turn.content.clone()
    };
    if !turn.ignore_stop
        && let Some(at) = asked
            .stops
            .iter()
            .filter_map(|s| content.find(s.as_str()))
            .min()
    {
        content.truncate(at);
    }
    let mut reasoning = turn.reasoning.clone();
    let mut calls: Vec<CallAnswer> = if asked.no_tools {
        Vec::new()
    } else {
        turn.tool_calls
            .iter()
            .enumerate()
            .map(|(index, call)| CallAnswer {
                id: if call.id.is_empty() {
                    format!("call_sim_{index}")
                } else {
                    call.id.clone()
                },
                name: call.name.clone(),
                arguments: call
                    .raw_arguments
                    .clone()
                    .unwrap_or_else(|| call.arguments.to_string()),
            })
            .collect()
    };
    // The token budget takes the reasoning, then the content, then the arguments, as a
    // model writes them; a call reached with nothing left is not made.
    let mut cut = false;
    if let Some(mut left) = asked.max_bytes {
        cut |= cut_to(&mut reasoning, &mut left);
        cut |= cut_to(&mut content, &mut left);
        calls.retain_mut(|call| {
            if left == 0 {
                cut = true;
                return false;
            }
            cut |= cut_to(&mut call.arguments, &mut left);
            true
        });
    }
    let completion_chars =
        content.len() + reasoning.len() + calls.iter().map(|c| c.arguments.len()).sum::<usize>();
    if turn.think_tags && !reasoning.is_empty() {
        content = format!("<think>{reasoning}</think>{content}");
        reasoning.clear();
    }
    let finish = if cut {
        "length".to_owned()
    } else {
        turn.finish_reason.clone().unwrap_or_else(|| {
            if calls.is_empty() {
                "stop".into()
            } else {
                "tool_calls".into()
            }
        })
    };
    Answer {
        reasoning,
        content,
        calls,
        finish,
        completion_chars,
    }
}

/// `text` cut to the `left` bytes of the budget (at a character's start), which it takes
/// from; whether it was cut.
fn cut_to(text: &mut String, left: &mut usize) -> bool {
    if text.len() <= *left {
        *left -= text.len();
        return false;
    }
    let mut at = *left;
    while !text.is_char_boundary(at) {
        at -= 1;
    }
    text.truncate(at);
    *left = 0;
    true
}

/// The usage of an answer, estimated at 4 bytes a token.
fn usage(prompt_chars: usize, completion_chars: usize) -> Value {
    let (prompt, completion) = (prompt_chars / 4, completion_chars.div_ceil(4));
    json!({"prompt_tokens": prompt, "completion_tokens": completion,
           "total_tokens": prompt + completion})
}

/// The `chat.completion` object that answers a request without `stream: true`.
fn completion(model: &str, turn: &Turn, answer: &Answer, prompt_chars: usize) -> Value {
    // As OpenAI: `null` content beside tool calls.
    let content = if answer.content.is_empty() && !answer.calls.is_empty() {
        Value::Null
    } else {
        Value::from(answer.content.as_str())
    };
    let mut message = json!({"role": "assistant", "content": content});
    if !answer.reasoning.is_empty() {
        message["reasoning_content"] = Value::from(answer.reasoning.as_str());
    }
    if !answer.calls.is_empty() {
        let calls: Vec<Value> = answer
            .calls
            .iter()
            .map(|call| {
                json!({"id": call.id, "type": "function",
                       "function": {"name": call.name, "arguments": call.arguments}})
            })
            .collect();
        message["tool_calls"] = Value::from(calls);
    }
    let finish = (!turn.omit_finish).then_some(answer.finish.as_str());
    let mut body = json!({
        "id": format!("chatcmpl-sim-{prompt_chars}"), "object": "chat.completion", "created": 0,
        "model": model,
        "choices": [{"index": 0, "message": message, "finish_reason": finish}],
    });
    if !turn.omit_usage {
        body["usage"] = usage(prompt_chars, answer.completion_chars);
    }
    body
}

/// The SSE events of a turn's answer, as a real provider would send them.
fn sse_chunks(
    model: &str,
    turn: &Turn,
    answer: &Answer,
    include_usage: bool,
    prompt_chars: usize,
) -> Vec<Chunk> {
    let id = format!("chatcmpl-sim-{}", prompt_chars);
    let event = |delta: DeltaOut<'_>, finish: Option<&str>| -> Chunk {
        let chunk = ChunkOut {
            choices: [ChoiceOut {
                delta,
                finish_reason: finish,
                index: 0,
            }],
            created: 0,
            id: &id,
            model,
            object: "chat.completion.chunk",
        };
        Ok(sse_data(&chunk))
    };
    let size = turn.chunk_chars.max(1);
    let mut events = vec![event(
        DeltaOut::Role {
            content: "",
            role: "assistant",
        },
        None,
    )];
    for piece in pieces(&answer.reasoning, size) {
        events.push(event(
            DeltaOut::Reasoning {
                content: None,
                reasoning_content: &piece,
            },
            None,
        ));
    }
    for piece in pieces(&answer.content, size) {
        events.push(event(DeltaOut::Content { content: &piece }, None));
    }

    // Tool calls: a header chunk per call, then argument fragments, interleaved.
    let fragments: Vec<Vec<String>> = answer
        .calls
        .iter()
        .map(|call| pieces(&call.arguments, size))
        .collect();
    for (index, call) in answer.calls.iter().enumerate() {
        events.push(event(
            DeltaOut::Call {
                tool_calls: [CallOut {
                    function: FunctionOut {
                        arguments: "",
                        name: Some(&call.name),
                    },
                    id: Some(&call.id),
                    index,
                    kind: Some("function"),
                }],
            },
            None,
        ));
    }
    let longest = fragments.iter().map(Vec::len).max().unwrap_or(0);
    for round in 0..longest {
        for (index, fragments) in fragments.iter().enumerate() {
            if let Some(fragment) = fragments.get(round) {
                events.push(event(
                    DeltaOut::Call {
                        tool_calls: [CallOut {
                            function: FunctionOut {
                                arguments: fragment,
                                name: None,
                            },
                            id: None,
                            index,
                            kind: None,
                        }],
                    },
                    None,
                ));
            }
        }
    }

    if turn.malformed {
        events.insert(
            1.min(events.len()),
            Ok(Bytes::from_static(
                b"data: {\"choices\": [{\"delta\": {\"content\": \"broken\"\n\n",
            )),
        );
    }
    if let Some(after) = turn.drop_after_chunks {
        events.truncate(after);
        events.push(Err(std::io::Error::other("simulated connection drop")));
        return events;
    }
    if turn.endless_line {
        // The endless line follows the first chunk.
        events.truncate(1);
        return events;
    }
    if turn.omit_finish {
        return events;
    }
    events.push(event(DeltaOut::Empty {}, Some(&answer.finish)));
    if include_usage && !turn.omit_usage {
        let usage = json!({
            "id": id, "object": "chat.completion.chunk", "created": 0, "model": model, "choices": [],
            "usage": usage(prompt_chars, answer.completion_chars),
        });
        events.push(Ok(sse_data(&usage)));
    }
    events.push(Ok(Bytes::from_static(b"data: [DONE]\n\n")));
    if turn.unterminated_last_line
        && let Some(Ok(last)) = events.last_mut()
    {
        last.truncate(last.len() - 2);
    }
    events
}

/// `text` cut into pieces of `size` characters.
fn pieces(text: &str, size: usize) -> Vec<String> {
    let chars: Vec<char> = text.chars().collect();
    chars.chunks(size).map(|c| c.iter().collect()).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every kind of chunk is written exactly as the JSON object of its fields would be.
    #[test]
    fn chunks_are_the_json_objects_providers_send() {
        let call = |function, id, kind| DeltaOut::Call {
            tool_calls: [CallOut {
                function,
                id,
                index: 1,
                kind,
            }],
        };
        let cases = [
            (
                DeltaOut::Role {
                    content: "",
                    role: "assistant",
                },
                None,
                json!({"role": "assistant", "content": ""}),
            ),
            (
                DeltaOut::Reasoning {
                    content: None,
                    reasoning_content: "hm\"m",
                },
                None,
                json!({"reasoning_content": "hm\"m", "content": null}),
            ),
            (
                DeltaOut::Content { content: "é\n" },
                None,
                json!({"content": "é\n"}),
            ),
            (
                call(
                    FunctionOut {
                        arguments: "",
                        name: Some("calculator"),
                    },
                    Some("call_1"),
                    Some("function"),
                ),
                None,
                json!({"tool_calls": [{"index": 1, "id": "call_1", "type": "function",
                                       "function": {"name": "calculator", "arguments": ""}}]}),
            ),
            (
                call(
                    FunctionOut {
                        arguments: "{\"a\"",
                        name: None,
                    },
                    None,
                    None,
                ),
                None,
                json!({"tool_calls": [{"index": 1, "function": {"arguments": "{\"a\""}}]}),
            ),
            (DeltaOut::Empty {}, Some("stop"), json!({})),
        ];
        for (delta, finish_reason, expected) in cases {
            let chunk = ChunkOut {
                choices: [ChoiceOut {
                    delta,
                    finish_reason,
                    index: 0,
                }],
                created: 0,
                id: "chatcmpl-sim-7",
                model: "m",
                object: "chat.completion.chunk",
            };
            let object = json!({
                "id": "chatcmpl-sim-7", "object": "chat.completion.chunk", "created": 0, "model": "m",
                "choices": [{"index": 0, "delta": expected, "finish_reason": finish_reason}],
            });
            assert_eq!(sse_data(&chunk), Bytes::from(format!("data: {object}\n\n")));
        }
    }

    /// The text of every content chunk of `events`, and the events' text.
    fn played(events: &[Chunk]) -> (Vec<String>, String) {
        let text: String = events
            .iter()
            .map(|e| String::from_utf8_lossy(e.as_ref().unwrap()).into_owned())
            .collect();
        let contents = text
            .split("\n\n")
            .filter_map(|e| e.strip_prefix("data: "))
            .filter_map(|e| serde_json::from_str::<Value>(e).ok())
            .filter_map(|e| {
                e["choices"][0]["delta"]["content"]
                    .as_str()
                    .map(str::to_owned)
            })
            .filter(|c| !c.is_empty())
            .collect();
        (contents, text)
    }

    fn turn(content: &str) -> Turn {
        Turn {
            content: content.into(),
            ..Turn::default()
        }
    }

    /// The events of `turn` streamed to model `m`, with these stop sequences.
    fn streamed(
        turn: Turn,
        stops: &[String],
        include_usage: bool,
        prompt_chars: usize,
    ) -> Vec<Chunk> {
        let asked = Asked {
            stops: stops.to_vec(),
            ..Asked::default()
        };
        sse_chunks(
            "m",
            &turn,
            &answer(&turn, &asked),
            include_usage,
            prompt_chars,
        )
    }

    #[test]
    fn stop_is_honoured_unless_the_turn_ignores_it() {
        let stops = ["Observation:".to_owned()];
        let content = "Action: x\nObservation: invented";
        let (contents, text) = played(&streamed(turn(content), &stops, false, 0));
        assert_eq!(contents.concat(), "Action: x\n");
        assert!(text.contains("\"finish_reason\":\"stop\""));
        let ignoring = Turn {
            ignore_stop: true,
            ..turn(content)
        };
        let (contents, _) = played(&streamed(ignoring, &stops, false, 0));
        assert_eq!(contents.concat(), content);
    }

    #[test]
    fn content_repeats_into_one_huge_delta() {
        let huge = Turn {
            repeat_content: 1000,
            chunk_chars: 1_000_000,
            ..turn("0123456789")
        };
        let (contents, _) = played(&streamed(huge, &[], false, 0));
        assert_eq!(contents.len(), 1);
        assert_eq!(contents[0].len(), 10_000);
    }

    #[test]
    fn usage_can_be_left_out_and_the_last_line_left_open() {
        let (_, text) = played(&streamed(turn("ok"), &[], true, 40));
        assert!(text.contains("\"usage\""));
        assert!(text.ends_with("data: [DONE]\n\n"));
        let quiet = Turn {
            omit_usage: true,
            unterminated_last_line: true,
            ..turn("ok")
        };
        let (_, text) = played(&streamed(quiet, &[], true, 40));
        assert!(!text.contains("\"usage\""));
        assert!(text.ends_with("\"finish_reason\":\"stop\",\"index\":0}],\"created\":0,\"id\":\"chatcmpl-sim-40\",\"model\":\"m\",\"object\":\"chat.completion.chunk\"}\n\ndata: [DONE]"), "{text}");
        let endless = Turn {
            endless_line: true,
            ..turn("ok")
        };
        // The first chunk only: the endless line follows it.
        assert_eq!(streamed(endless, &[], true, 0).len(), 1);
    }

    /// Sends one HTTP/1.1 request to the simulator; the status line and headers, and the
    /// body (at most `limit` bytes of it).
    async fn call(addr: SocketAddr, path: &str, body: &Value, limit: usize) -> (String, Vec<u8>) {
        send(addr, "POST", path, body.to_string().as_bytes(), limit).await
    }

    /// Sends one HTTP/1.1 request with this method and body; the status line and headers,
    /// and the body (at most `limit` bytes of it).
    async fn send(
        addr: SocketAddr,
        method: &str,
        path: &str,
        body: &[u8],
        limit: usize,
    ) -> (String, Vec<u8>) {
        use tokio::io::{AsyncReadExt, AsyncWriteExt};
        let mut stream = tokio::net::TcpStream::connect(addr).await.unwrap();
        let head = format!(
            "{method} {path} HTTP/1.1\r\nhost: sim\r\ncontent-type: application/json\r\n\
             content-length: {}\r\nconnection: close\r\n\r\n",
            body.len()
        );
        stream.write_all(head.as_bytes()).await.unwrap();
        stream.write_all(body).await.unwrap();
        let mut answer = Vec::new();
        let mut buffer = [0; 64 * 1024];
        while answer.len() < limit {
            let read = stream.read(&mut buffer).await.unwrap();
            if read == 0 {
                break;
            }
            answer.extend_from_slice(&buffer[..read]);
        }
        let split = answer
            .windows(4)
            .position(|w| w == b"\r\n\r\n")
            .unwrap_or(answer.len());
        let head = String::from_utf8_lossy(&answer[..split]).into_owned();
        let body = answer.get(split + 4..).unwrap_or_default().to_vec();
        (head, body)
    }

    /// The body of a chunked HTTP/1.1 answer, without its framing.
    fn dechunked(mut body: &[u8]) -> Vec<u8> {
        let mut out = Vec::new();
        while let Some(end) = body.windows(2).position(|w| w == b"\r\n") {
            let size =
                usize::from_str_radix(std::str::from_utf8(&body[..end]).unwrap(), 16).unwrap();
            if size == 0 {
                break;
            }
            out.extend_from_slice(&body[end + 2..end + 2 + size]);
            body = &body[end + 2 + size + 2..];
        }
        out
    }

    /// The status and the JSON body of a request's answer.
    async fn answered(addr: SocketAddr, path: &str, body: &Value) -> (u16, String, Value) {
        let (head, body) = call(addr, path, body, usize::MAX).await;
        let status = head[9..12].parse().unwrap();
        let body = serde_json::from_slice(&body).unwrap_or_else(|e| {
            panic!("{e}: {head}\n{}", String::from_utf8_lossy(&body));
        });
        (status, head, body)
    }

    async fn started(
        scenarios: Value,
        strict_messages: bool,
    ) -> (SocketAddr, tokio_util::sync::CancellationToken) {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let file = std::env::temp_dir().join(format!(
            "agentrt-sim-unit-{}-{}.json",
            std::process::id(),
            addr.port()
        ));
        std::fs::write(&file, scenarios.to_string()).unwrap();
        let settings = Settings {
            scenarios: Some(file),
            strict_messages,
            ..Settings::default()
        };
        let stop = tokio_util::sync::CancellationToken::new();
        tokio::spawn(serve(settings, listener, stop.clone().cancelled_owned()));
        (addr, stop)
    }

    #[tokio::test]
    async fn turns_answer_plain_bodies_redirects_and_endless_lines() {
        let (addr, _stop) = started(
            json!({"scenarios": {
                "json": {"turns": [{"plain_body": "{\"choices\": []}"}]},
                "html": {"turns": [{"plain_body": "<html></html>", "plain_content_type": "text/html"}]},
                "moved": {"turns": [{"redirect_to": "http://127.0.0.1:9/v1/chat/completions", "redirect_status": 302}]},
                "flood": {"turns": [{"endless_line": true}]},
            }}),
            false,
        )
        .await;
        let ask = |model: &str| json!({"model": model, "stream": true, "messages": [{"role": "user", "content": "hi"}]});
        let (head, body) = call(addr, "/v1/chat/completions", &ask("json"), usize::MAX).await;
        assert!(head.starts_with("HTTP/1.1 200"), "{head}");
        assert!(head.contains("content-type: application/json"), "{head}");
        assert_eq!(body, b"{\"choices\": []}");
        let (head, _) = call(addr, "/v1/chat/completions", &ask("html"), usize::MAX).await;
        assert!(head.contains("content-type: text/html"), "{head}");
        let (head, _) = call(addr, "/v1/chat/completions", &ask("moved"), usize::MAX).await;
        assert!(head.starts_with("HTTP/1.1 302"), "{head}");
        assert!(
            head.contains("location: http://127.0.0.1:9/v1/chat/completions"),
            "{head}"
        );
        // Far more than any answer, in one line.
        let (head, body) = call(addr, "/v1/chat/completions", &ask("flood"), 4 << 20).await;
        assert!(head.contains("text/event-stream"), "{head}");
        let tail = &body[body.len() - 1000..];
        assert!(
            tail.iter()
                .all(|b| *b == b'x' || b.is_ascii_hexdigit() || *b == b'\r' || *b == b'\n')
        );
        assert!(body.len() >= 3 << 20);
    }

    #[tokio::test]
    async fn strict_messages_refuse_null_content_with_a_500() {
        let null = json!({"model": "demo", "messages": [
            {"role": "user", "content": "What is 6 * 7?"},
            {"role": "assistant", "content": null, "tool_calls": [{"id": "a", "type": "function", "function": {"name": "calculator", "arguments": "{}"}}]},
            {"role": "tool", "tool_call_id": "a", "content": "42"}]});
        let empty = {
            let mut empty = null.clone();
            empty["messages"][1]["content"] = json!("");
            empty
        };
        // Per scenario, or for every model.
        let (addr, _stop) = started(
            json!({"scenarios": {"strict": {"strict_messages": true, "turns": [{"content": "ok"}]}}}),
            false,
        )
        .await;
        let mut strict = null.clone();
        strict["model"] = json!("strict");
        let (head, body) = call(addr, "/v1/chat/completions", &strict, usize::MAX).await;
        assert!(head.starts_with("HTTP/1.1 500"), "{head}");
        let body = String::from_utf8_lossy(&body);
        assert!(
            body.contains("validation error for ChatCompletionRequestAssistantMessage"),
            "{body}"
        );
        let (head, _) = call(addr, "/v1/chat/completions", &null, usize::MAX).await;
        assert!(head.starts_with("HTTP/1.1 200"), "{head}");

        let (addr, _stop) = started(json!({}), true).await;
        let (head, _) = call(addr, "/v1/chat/completions", &null, usize::MAX).await;
        assert!(head.starts_with("HTTP/1.1 500"), "{head}");
        let (head, _) = call(addr, "/v1/chat/completions", &empty, usize::MAX).await;
        assert!(head.starts_with("HTTP/1.1 200"), "{head}");
    }

    #[test]
    fn scenarios_files_are_json_or_toml() {
        let file = std::env::temp_dir().join(format!("agentrt-sim-{}.toml", std::process::id()));
        std::fs::write(
            &file,
            "[scenarios.torn]\nstrict_messages = true\n\n[[scenarios.torn.turns]]\n\
             content = \"ok\"\nunterminated_last_line = true\n\n\
             [[scenarios.torn.turns.tool_calls]]\nname = \"calculator\"\n\
             arguments = { expression = \"6*7\" }\n",
        )
        .unwrap();
        let settings = Settings {
            scenarios: Some(file.clone()),
            ..Settings::default()
        };
        let scenarios = load_scenarios(&settings).unwrap();
        let torn = &scenarios.scenarios["torn"];
        assert!(torn.strict_messages);
        assert!(torn.turns[0].unterminated_last_line);
        assert_eq!(
            torn.turns[0].tool_calls[0].arguments,
            json!({"expression": "6*7"})
        );
        std::fs::write(&file, "[scenarios.x]\nturns = [{ typo = 1 }]\n").unwrap();
        assert!(load_scenarios(&settings).is_err());
        let _ = std::fs::remove_file(file);
    }

    #[tokio::test]
    async fn rerank_is_served() {
        let (addr, _stop) = started(json!({}), false).await;
        let request =
            json!({"model": "m", "query": "red apple", "documents": ["pear", "red apple"]});
        let (head, body) = call(addr, "/v1/rerank", &request, usize::MAX).await;
        assert!(head.starts_with("HTTP/1.1 200"), "{head}");
        let answer: Value = serde_json::from_slice(&body).unwrap();
        assert_eq!(answer["results"][0]["index"], 1);
        assert_eq!(answer["results"][1]["relevance_score"], 0.0);
    }

    #[test]
    fn requests_are_read_typed() {
        let body = json!({
            "model": "m", "stop": ["Observation:"], "stream_options": {"include_usage": true},
            "messages": [
                {"role": "system", "content": "be brief"},
                {"role": "user", "content": [{"type": "text", "text": "parts"}]},
                {"role": "user", "content": "What is 6 * 7?"},
                {"role": "assistant", "content": null, "tool_calls": [{"id": "a"}]},
                {"role": "tool", "tool_call_id": "a", "content": "42"},
            ],
            "tools": [{"type": "function", "function": {"name": "calculator", "parameters": {"type": "object"}}}],
        })
        .to_string();
        let request = ChatRequestIn::parse(&body).unwrap();
        assert_eq!(request.model, "m");
        let conversation = Conversation::of(&request).unwrap();
        assert_eq!(conversation.turn, 1);
        assert_eq!(conversation.user_messages, 2);
        assert_eq!(conversation.query, "What is 6 * 7?");
        assert_eq!(conversation.tool_results, ["42"]);
        assert_eq!(conversation.tools, ["calculator"]);
        assert!(ChatRequestIn::parse(r#"{"model": "m"}"#).is_err());
    }

    #[tokio::test]
    async fn requests_without_stream_get_one_chat_completion_object() {
        let (addr, _stop) = started(
            json!({"scenarios": {
                "calls": {"turns": [{"content": "let me see", "reasoning": "hm",
                    "tool_calls": [{"name": "calculator", "arguments": {"expression": "6*7"}},
                                   {"id": "w1", "name": "weather", "raw_arguments": "{\"q\":\"Par"}]}]},
                "plain": {"turns": [{"content": "hello {query}"}]},
            }}),
            false,
        )
        .await;
        let messages = json!([{"role": "user", "content": "hi"}]);
        let prompt_tokens = messages.to_string().len() / 4;
        let ask = json!({"model": "calls", "messages": messages});
        let (status, head, body) = answered(addr, "/v1/chat/completions", &ask).await;
        assert_eq!(status, 200, "{head}");
        assert!(head.contains("content-type: application/json"), "{head}");
        let completion_tokens = ("let me see".len() + "hm".len() + 18 + 11_usize).div_ceil(4);
        assert_eq!(
            body,
            json!({
                "id": format!("chatcmpl-sim-{}", messages.to_string().len()),
                "object": "chat.completion", "created": 0, "model": "calls",
                "choices": [{"index": 0, "finish_reason": "tool_calls", "message": {
                    "role": "assistant", "content": "let me see", "reasoning_content": "hm",
                    "tool_calls": [
                        {"id": "call_sim_0", "type": "function",
                         "function": {"name": "calculator", "arguments": "{\"expression\":\"6*7\"}"}},
                        {"id": "w1", "type": "function",
                         "function": {"name": "weather", "arguments": "{\"q\":\"Par"}}]}}],
                "usage": {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
                          "total_tokens": prompt_tokens + completion_tokens},
            })
        );

        let ask = json!({"model": "plain", "stream": false, "messages": messages});
        let (_, _, body) = answered(addr, "/v1/chat/completions", &ask).await;
        assert_eq!(
            body["choices"][0]["message"],
            json!({"role": "assistant", "content": "hello hi"})
        );
        assert_eq!(body["choices"][0]["finish_reason"], "stop");

        // The demo's call, with no content beside it.
        let ask = json!({"model": "demo", "messages": [{"role": "user", "content": "What is 6 * 7?"}],
                         "tools": [{"type": "function", "function": {"name": "calculator"}}]});
        let (_, _, body) = answered(addr, "/v1/chat/completions", &ask).await;
        let message = &body["choices"][0]["message"];
        assert_eq!(message["content"], Value::Null);
        assert_eq!(message["tool_calls"][0]["function"]["name"], "calculator");

        // Asked for, a stream as before.
        let ask = json!({"model": "plain", "stream": true, "messages": messages});
        let (head, body) = call(addr, "/v1/chat/completions", &ask, usize::MAX).await;
        assert!(head.contains("content-type: text/event-stream"), "{head}");
        assert!(dechunked(&body).ends_with(b"data: [DONE]\n\n"));
    }

    #[test]
    fn a_token_limit_cuts_the_reasoning_then_the_content_then_the_arguments() {
        let long = Turn {
            reasoning: "abcdefgh".into(),
            tool_calls: vec![scenario::ScriptedCall {
                name: "calculator".into(),
                arguments: json!({"expression": "6*7"}),
                ..scenario::ScriptedCall::default()
            }],
            ..turn("0123456789")
        };
        let limited = |max_bytes| Asked {
            max_bytes: Some(max_bytes),
            ..Asked::default()
        };
        let cut = answer(&long, &limited(12));
        assert_eq!(
            (
                cut.reasoning.as_str(),
                cut.content.as_str(),
                cut.calls.len()
            ),
            ("abcdefgh", "0123", 0)
        );
        assert_eq!((cut.finish.as_str(), cut.completion_chars), ("length", 12));
        let cut = answer(&long, &limited(24));
        assert_eq!(cut.calls[0].arguments, "{\"expr");
        assert_eq!((cut.finish.as_str(), cut.completion_chars), ("length", 24));
        // Enough for all: the turn's own finish.
        let whole = answer(&long, &limited(1000));
        assert_eq!(whole.calls[0].arguments, "{\"expression\":\"6*7\"}");
        assert_eq!(whole.finish, "tool_calls");
        // Cut at a character's start.
        let cut = answer(&turn("ééé"), &limited(3));
        assert_eq!((cut.content.as_str(), cut.completion_chars), ("é", 2));
    }

    #[tokio::test]
    async fn max_tokens_cut_the_answer_and_finish_with_length() {
        let (addr, _stop) = started(
            json!({"scenarios": {"long": {"turns": [{"content": "0123456789".repeat(10)}]}}}),
            false,
        )
        .await;
        let ask = |limits: Value| {
            let mut ask = json!({"model": "long", "stream": true,
                "stream_options": {"include_usage": true},
                "messages": [{"role": "user", "content": "hi"}]});
            ask.as_object_mut()
                .unwrap()
                .extend(limits.as_object().unwrap().clone());
            ask
        };
        let (_, body) = call(
            addr,
            "/v1/chat/completions",
            &ask(json!({"max_tokens": 5})),
            usize::MAX,
        )
        .await;
        let (contents, text) = played(&[Ok(Bytes::from(dechunked(&body)))]);
        assert_eq!(contents.concat(), "01234567890123456789");
        assert!(text.contains("\"finish_reason\":\"length\""), "{text}");
        assert!(text.contains("\"completion_tokens\":5"), "{text}");

        // `max_completion_tokens` is read first; the object says the same.
        let mut limits = ask(json!({"max_completion_tokens": 2, "max_tokens": 100}));
        limits["stream"] = json!(false);
        // Only with `stream`, as OpenAI has it.
        limits.as_object_mut().unwrap().remove("stream_options");
        let (_, _, body) = answered(addr, "/v1/chat/completions", &limits).await;
        assert_eq!(body["choices"][0]["message"]["content"], "01234567");
        assert_eq!(body["choices"][0]["finish_reason"], "length");
        assert_eq!(body["usage"]["completion_tokens"], 2);

        // An answer within the limit is whole.
        let (_, body) = call(
            addr,
            "/v1/chat/completions",
            &ask(json!({"max_tokens": 25})),
            usize::MAX,
        )
        .await;
        let (contents, text) = played(&[Ok(Bytes::from(dechunked(&body)))]);
        assert_eq!(contents.concat().len(), 100);
        assert!(text.contains("\"finish_reason\":\"stop\""), "{text}");
    }

    #[tokio::test]
    async fn tool_choice_none_answers_the_content_alone() {
        let (addr, _stop) = started(
            json!({"scenarios": {"calls": {"turns": [{"content": "no call then",
                "tool_calls": [{"name": "calculator", "arguments": {"expression": "6*7"}}]}]}}}),
            false,
        )
        .await;
        let ask = json!({"model": "calls", "tool_choice": "none",
                         "messages": [{"role": "user", "content": "hi"}],
                         "tools": [{"type": "function", "function": {"name": "calculator"}}]});
        let (_, _, body) = answered(addr, "/v1/chat/completions", &ask).await;
        assert_eq!(
            body["choices"][0]["message"],
            json!({"role": "assistant", "content": "no call then"})
        );
        assert_eq!(body["choices"][0]["finish_reason"], "stop");
        // Any other choice leaves the calls in.
        let mut auto = ask.clone();
        auto["tool_choice"] = json!("auto");
        let (_, _, body) = answered(addr, "/v1/chat/completions", &auto).await;
        assert_eq!(body["choices"][0]["finish_reason"], "tool_calls");
    }

    #[tokio::test]
    async fn n_other_than_one_is_refused_with_a_400() {
        let (addr, _stop) = started(json!({}), false).await;
        let ask = |n: Value| json!({"model": "demo", "n": n, "messages": [{"role": "user", "content": "hi"}]});
        let (status, _, body) = answered(addr, "/v1/chat/completions", &ask(json!(2))).await;
        assert_eq!(status, 400);
        assert_eq!(body["error"]["type"], "invalid_request_error");
        assert_eq!(body["error"]["param"], "n");
        assert_eq!(body["error"]["code"], Value::Null);
        assert!(
            body["error"]["message"]
                .as_str()
                .unwrap()
                .contains("not supported"),
            "{body}"
        );
        for n in [json!(1), Value::Null] {
            let (status, _, _) = answered(addr, "/v1/chat/completions", &ask(n)).await;
            assert_eq!(status, 200);
        }
    }

    #[tokio::test]
    async fn requests_openai_refuses_are_refused() {
        let (addr, _stop) = started(json!({"scenarios": {}}), false).await;
        let hi = json!([{"role": "user", "content": "hi"}]);
        for (request, param) in [
            (json!({"stream": true, "messages": hi}), "model"),
            (
                json!({"model": "demo", "stream": true, "messages": [ ]}),
                "messages",
            ),
            (
                json!({"model": "demo", "messages": hi, "stream_options": {"include_usage": true}}),
                "stream_options",
            ),
        ] {
            let (status, _, body) = answered(addr, "/v1/chat/completions", &request).await;
            assert_eq!(status, 400, "{request}");
            assert_eq!(body["error"]["param"], param, "{body}");
            assert_eq!(body["error"]["type"], "invalid_request_error", "{body}");
        }
    }

    #[tokio::test]
    async fn errors_are_in_openais_shape() {
        let (addr, _stop) = started(
            json!({"scenarios": {
                "limited": {"turns": [{"error": {"status": 429, "message": "slow down", "retry_after": 0.5}}]},
                "denied": {"turns": [{"error": {"status": 401, "message": "bad key"}}]},
                "down": {"turns": [{"error": {"status": 503, "message": "overloaded"}}]},
                "refused": {"turns": [{"error": {"status": 400, "message": "messages is required"}}]},
            }}),
            false,
        )
        .await;
        let ask = |model: &str| json!({"model": model, "stream": true, "messages": [{"role": "user", "content": "hi"}]});
        let error = |message: &str, kind: &str, code: Option<&str>| json!({"error": {"message": message, "type": kind, "param": null, "code": code}});
        let cases = [
            (
                "limited",
                429,
                error("slow down", "rate_limit_error", Some("rate_limit_exceeded")),
            ),
            (
                "denied",
                401,
                error("bad key", "authentication_error", Some("invalid_api_key")),
            ),
            ("down", 503, error("overloaded", "server_error", None)),
            (
                "refused",
                400,
                error("messages is required", "invalid_request_error", None),
            ),
            (
                "nothing",
                404,
                error(
                    "The model `nothing` does not exist (simulator models: demo and the scenarios file's)",
                    "invalid_request_error",
                    Some("model_not_found"),
                ),
            ),
        ];
        for (model, status, expected) in cases {
            let (got, head, body) = answered(addr, "/v1/chat/completions", &ask(model)).await;
            assert_eq!((got, body), (status, expected), "{model}");
            assert!(head.contains("content-type: application/json"), "{head}");
            assert_eq!(
                head.contains("retry-after: 1\r\n") && head.contains("retry-after-ms: 500\r\n"),
                model == "limited",
                "{head}"
            );
        }

        // What the router refuses is in the same shape.
        let (head, body) = send(
            addr,
            "POST",
            "/v1/chat/completions",
            b"{not json",
            usize::MAX,
        )
        .await;
        assert!(head.starts_with("HTTP/1.1 400"), "{head}");
        let body: Value = serde_json::from_slice(&body).unwrap();
        assert_eq!(body["error"]["type"], "invalid_request_error");
        let (head, body) = send(addr, "POST", "/v1/nope", b"{}", usize::MAX).await;
        assert!(head.starts_with("HTTP/1.1 404"), "{head}");
        assert_eq!(
            serde_json::from_slice::<Value>(&body).unwrap(),
            error("Invalid URL (POST /v1/nope)", "invalid_request_error", None)
        );
        let (head, body) = send(addr, "GET", "/v1/chat/completions", b"", usize::MAX).await;
        assert!(head.starts_with("HTTP/1.1 405"), "{head}");
        assert_eq!(
            serde_json::from_slice::<Value>(&body).unwrap(),
            error(
                "Invalid method for URL (GET /v1/chat/completions)",
                "invalid_request_error",
                None
            )
        );
        let (head, body) = send(addr, "POST", "/v1/rerank", b"[]", usize::MAX).await;
        assert!(head.starts_with("HTTP/1.1 400"), "{head}");
        let body: Value = serde_json::from_slice(&body).unwrap();
        assert_eq!(body["error"]["param"], Value::Null);
    }

    #[tokio::test]
    async fn bodies_up_to_the_limit_are_taken_and_larger_ones_refused_in_json() {
        let (addr, _stop) = started(json!({}), false).await;
        // Over axum's default 2 MB.
        let large = json!({"model": "demo", "messages": [{"role": "user", "content": "x".repeat(3 << 20)}]});
        let (status, _, body) = answered(addr, "/v1/chat/completions", &large).await;
        assert_eq!(status, 200);
        assert_eq!(body["object"], "chat.completion");
        // One byte over: read whole before it is refused, so that the answer is not lost
        // to a reset.
        let over = vec![b' '; MAX_BODY_BYTES + 1];
        let (head, body) = send(addr, "POST", "/v1/chat/completions", &over, usize::MAX).await;
        assert!(head.starts_with("HTTP/1.1 413"), "{head}");
        let body: Value = serde_json::from_slice(&body).unwrap();
        assert_eq!(body["error"]["type"], "invalid_request_error");
        assert!(
            body["error"]["message"]
                .as_str()
                .unwrap()
                .contains(&MAX_BODY_BYTES.to_string()),
            "{body}"
        );
    }

    #[tokio::test]
    async fn scripted_failures_are_counted_per_conversation() {
        let (addr, _stop) = started(
            json!({"scenarios": {"flaky": {"turns": [{"content": "ok",
                "error": {"status": 503, "message": "busy", "times": 1}}]}}}),
            false,
        )
        .await;
        let ask = |system: &str| {
            json!({"model": "flaky", "messages": [
                {"role": "system", "content": system}, {"role": "user", "content": "hi"}]})
        };
        let status =
            |body: Value| async move { answered(addr, "/v1/chat/completions", &body).await.0 };
        // Two conversations with one query: each fails its own first attempt.
        assert_eq!(status(ask("first")).await, 503);
        assert_eq!(status(ask("first")).await, 200);
        assert_eq!(status(ask("second")).await, 503);
        assert_eq!(status(ask("second")).await, 200);
        assert_eq!(status(ask("first")).await, 200);
    }

    #[test]
    fn attempts_are_remembered_for_a_bounded_number_of_conversations() {
        let mut attempts = Attempts::new(3);
        assert_eq!(attempts.count(1), 1);
        assert_eq!(attempts.count(1), 2);
        assert_eq!(attempts.count(2), 1);
        assert_eq!(attempts.count(3), 1);
        // A fourth forgets the oldest.
        assert_eq!(attempts.count(4), 1);
        assert_eq!(attempts.count(1), 1);
        assert_eq!(attempts.count(3), 2);
        assert_eq!((attempts.counts.len(), attempts.order.len()), (3, 3));
        assert_eq!(MAX_ATTEMPTS_KEPT, 65_536);
    }

    #[tokio::test]
    async fn models_are_listed_once_each_with_created() {
        let (addr, _stop) = started(
            json!({"scenarios": {"demo": {"turns": [{"content": "mine"}]}, "calc": {"turns": []}}}),
            false,
        )
        .await;
        let (head, body) = send(addr, "GET", "/v1/models", b"", usize::MAX).await;
        assert!(head.starts_with("HTTP/1.1 200"), "{head}");
        let body: Value = serde_json::from_slice(&body).unwrap();
        let model =
            |id: &str| json!({"id": id, "object": "model", "created": 0, "owned_by": "simulator"});
        assert_eq!(
            body,
            json!({"object": "list", "data": [model("calc"), model("demo")]})
        );
    }
}
