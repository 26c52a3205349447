//! An OpenAI-compatible chat completions simulator for the demo, the tests and the
//! benchmarks: `POST /v1/chat/completions` streams scripted turns the way real providers
//! stream them (role chunk, content and argument fragments, interleaved parallel tool
//! calls, a finish chunk, a usage chunk, `[DONE]`), with scripted errors, delays and
//! broken streams. See [`scenario`] for the scripts.

pub mod scenario;

use std::{
    collections::HashMap,
    future::Future,
    net::SocketAddr,
    path::PathBuf,
    sync::{Arc, Mutex},
    time::Duration,
};

use axum::{
    Json, Router,
    body::Body,
    extract::State,
    http::{HeaderValue, StatusCode, header},
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
    #[serde(with = "agentrt_server::config::duration")]
    pub latency: Duration,
    /// Scenarios file (JSON); the built-in `demo` model is always there.
    pub scenarios: Option<PathBuf>,
    /// Most HTTP/2 streams (calls) one connection may have open at once, as real servers
    /// limit them (often to 100 or so); unset, a connection takes as many as a client opens.
    pub max_concurrent_streams: Option<u32>,
}

impl Default for Settings {
    fn default() -> Self {
        Self {
            listen: SocketAddr::from(([127, 0, 0, 1], 50053)),
            latency: Duration::ZERO,
            scenarios: None,
            max_concurrent_streams: None,
        }
    }
}

/// The simulator's command line; every flag also reads `MODEL_SIMULATOR_<FLAG>`.
#[derive(Debug, Clone, Default, clap::Parser)]
#[command(
    name = "model-simulator",
    version,
    about = "An OpenAI-compatible chat completions simulator."
)]
pub struct Cli {
    /// Address to listen on, HOST:PORT (port 0 picks a free port).
    #[arg(long, value_name = "HOST:PORT")]
    pub listen: Option<SocketAddr>,
    /// Latency added before every answer, e.g. `1s`.
    #[arg(long, value_name = "DURATION", value_parser = agentrt_server::config::parse_duration)]
    pub latency: Option<Duration>,
    /// Scenarios file (JSON).
    #[arg(long, value_name = "FILE")]
    pub scenarios: Option<PathBuf>,
    /// Most HTTP/2 streams open at once on one connection (unlimited when unset).
    #[arg(long, value_name = "N")]
    pub max_concurrent_streams: Option<u32>,
}

impl Cli {
    /// The prefix of the environment variables that stand for flags.
    pub const ENV_PREFIX: &'static str = "MODEL_SIMULATOR";

    /// Defaults overridden by flags and environment.
    pub fn settings(&self) -> Settings {
        let mut settings = Settings::default();
        agentrt_server::config::override_with(&mut settings.listen, self.listen);
        agentrt_server::config::override_with(&mut settings.latency, self.latency);
        if self.scenarios.is_some() {
            settings.scenarios.clone_from(&self.scenarios);
        }
        if self.max_concurrent_streams.is_some() {
            settings.max_concurrent_streams = self.max_concurrent_streams;
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
}

/// Loads the scenarios the settings name.
pub fn load_scenarios(settings: &Settings) -> Result<Scenarios, Error> {
    let Some(path) = &settings.scenarios else {
        return Ok(Scenarios::default());
    };
    let failed = |reason: String| Error::Scenarios {
        path: path.display().to_string(),
        reason,
    };
    let text = std::fs::read_to_string(path).map_err(|e| failed(e.to_string()))?;
    serde_json::from_str(&text).map_err(|e| failed(e.to_string()))
}

struct Simulator {
    scenarios: Scenarios,
    latency: Duration,
    /// Failed attempts per (model, turn, query), for errors scripted to pass after `times`.
    attempts: Mutex<HashMap<(String, usize, String), u32>>,
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
        attempts: Mutex::new(HashMap::new()),
    });
    let app = Router::new()
        .route("/v1/chat/completions", post(chat_completions))
        .route("/v1/models", get(models))
        .with_state(simulator);
    info!(service = "model-simulator", addr = %listener.local_addr()?, "listening");
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
        let connection = http
            .serve_connection_with_upgrades(
                TokioIo::new(agentrt_io::Coalesced::new(stream)),
                service.clone(),
            )
            .into_owned();
        let connection = graceful.watch(connection);
        tokio::spawn(async move {
            if let Err(error) = connection.await {
                warn!(error = ?error, "connection ended with an error");
            }
        });
    }
    graceful.shutdown().await;
    Ok(())
}

async fn models(State(sim): State<Arc<Simulator>>) -> Json<Value> {
    let mut names: Vec<&str> = sim.scenarios.scenarios.keys().map(String::as_str).collect();
    names.push("demo");
    names.sort_unstable();
    let data: Vec<Value> = names
        .iter()
        .map(|n| json!({"id": n, "object": "model", "owned_by": "simulator"}))
        .collect();
    Json(json!({"object": "list", "data": data}))
}

async fn chat_completions(
    State(sim): State<Arc<Simulator>>,
    headers: axum::http::HeaderMap,
    body: Bytes,
) -> Response {
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
    let model = request.model.clone().into_owned();
    // Shows that callers propagate their trace context (W3C `traceparent`).
    if let Some(traceparent) = headers.get("traceparent").and_then(|v| v.to_str().ok()) {
        info!(%model, traceparent, "chat completion request");
    }
    let turn = match sim.scenarios.scenarios.get(&model) {
        Some(scenario) => scenario.turn(&conversation),
        None if model == "demo" => scenario::demo(&conversation),
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
    let stops: Vec<String> = match &request.stop {
        Some(Value::String(s)) => vec![s.clone()],
        Some(Value::Array(items)) => items
            .iter()
            .filter_map(|s| s.as_str().map(str::to_owned))
            .collect(),
        _ => Vec::new(),
    };
    let include_usage = request
        .stream_options
        .as_ref()
        .and_then(|o| o["include_usage"].as_bool())
        .unwrap_or(false);
    let prompt_chars = request.messages.get().len();
    // Only what the reply needs is kept over the latency: ten thousand requests waiting
    // at once must not hold their whole body.
    drop(request);
    drop((body, headers));
    let latency = sim.latency + Duration::from_millis(turn.latency_ms);
    if !latency.is_zero() {
        tokio::time::sleep(latency).await;
    }
    if let Some(error) = &turn.error {
        let key = (model.clone(), conversation.turn, conversation.query.clone());
        let failures = {
            let mut attempts = sim
                .attempts
                .lock()
                .unwrap_or_else(std::sync::PoisonError::into_inner);
            let count = attempts.entry(key).or_insert(0);
            *count += 1;
            *count
        };
        if error.times == 0 || failures <= error.times {
            return error_response(error.status, &error.message, error.retry_after);
        }
    }
    let chunks = sse_chunks(&model, turn.clone(), &stops, include_usage, prompt_chars);
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

fn error_response(status: u16, message: &str, retry_after: Option<f64>) -> Response {
    let status = StatusCode::from_u16(status).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR);
    let body =
        json!({"error": {"message": message, "type": "simulated_error", "code": status.as_u16()}});
    let mut response = (status, Json(body)).into_response();
    if let Some(seconds) = retry_after
        && let Ok(value) = HeaderValue::from_str(&seconds.to_string())
    {
        response.headers_mut().insert(header::RETRY_AFTER, value);
    }
    response
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

/// The SSE events of a turn, as a real provider would send them.
fn sse_chunks(
    model: &str,
    turn: Turn,
    stops: &[String],
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

    let mut content = turn.content.clone();
    if let Some(at) = stops.iter().filter_map(|s| content.find(s.as_str())).min() {
        content.truncate(at);
    }
    let mut completion_chars = content.len() + turn.reasoning.len();
    if turn.think_tags && !turn.reasoning.is_empty() {
        content = format!("<think>{}</think>{content}", turn.reasoning);
    } else {
        for piece in pieces(&turn.reasoning, size) {
            events.push(event(
                DeltaOut::Reasoning {
                    content: None,
                    reasoning_content: &piece,
                },
                None,
            ));
        }
    }
    for piece in pieces(&content, size) {
        events.push(event(DeltaOut::Content { content: &piece }, None));
    }

    // Tool calls: a header chunk per call, then argument fragments, interleaved.
    let calls: Vec<(String, String, Vec<String>)> = turn
        .tool_calls
        .iter()
        .enumerate()
        .map(|(index, call)| {
            let id = if call.id.is_empty() {
                format!("call_sim_{index}")
            } else {
                call.id.clone()
            };
            let arguments = call
                .raw_arguments
                .clone()
                .unwrap_or_else(|| call.arguments.to_string());
            completion_chars += arguments.len();
            (id, call.name.clone(), pieces(&arguments, size))
        })
        .collect();
    for (index, (id, name, _)) in calls.iter().enumerate() {
        events.push(event(
            DeltaOut::Call {
                tool_calls: [CallOut {
                    function: FunctionOut {
                        arguments: "",
                        name: Some(name),
                    },
                    id: Some(id),
                    index,
                    kind: Some("function"),
                }],
            },
            None,
        ));
    }
    let longest = calls.iter().map(|(_, _, p)| p.len()).max().unwrap_or(0);
    for round in 0..longest {
        for (index, (_, _, fragments)) in calls.iter().enumerate() {
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
    if turn.omit_finish {
        return events;
    }
    let finish = turn.finish_reason.clone().unwrap_or_else(|| {
        if calls.is_empty() {
            "stop".into()
        } else {
            "tool_calls".into()
        }
    });
    events.push(event(DeltaOut::Empty {}, Some(&finish)));
    if include_usage {
        let usage = json!({
            "id": id, "object": "chat.completion.chunk", "created": 0, "model": model, "choices": [],
            "usage": {"prompt_tokens": prompt_chars / 4, "completion_tokens": completion_chars.div_ceil(4),
                      "total_tokens": prompt_chars / 4 + completion_chars.div_ceil(4)},
        });
        events.push(Ok(sse_data(&usage)));
    }
    events.push(Ok(Bytes::from_static(b"data: [DONE]\n\n")));
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
}
