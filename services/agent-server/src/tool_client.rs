//! The tool executor as seen from the agent server: a gRPC client behind [`ToolCatalog`].

use std::{
    pin::Pin,
    sync::{
        Arc,
        atomic::{AtomicUsize, Ordering},
    },
    time::Duration,
};

use agentrt::v1::{self, tool_executor_client::ToolExecutorClient};
use agentrt_core::Secret;
use agentrt_core::{
    Reference, ToolCatalog, ToolInvocation, ToolResult, ToolRunner, ToolServiceError, ToolSource,
    ToolSpec,
};
use async_trait::async_trait;
use tokio::time::Instant;
use tonic::{
    Code, ConnectError, Status,
    metadata::{Ascii, MetadataValue},
    transport::{ClientTlsConfig, Endpoint},
};

mod checked;
mod unary;

use checked::CheckedChannel;

/// A lazily connected gRPC client of `agent.v1.ToolExecutor`, over a few connections.
///
/// Calls take the connections in turn (tool calls to a cleartext tool executor take the
/// least busy, in turn among the equally busy, through [`unary`]). Behind a load balancer
/// that spreads connections (a Kubernetes Service), each connection may reach another tool
/// executor replica, so one
/// agent-server spreads its calls over several; a tool executor with
/// `server.max_connection_age` makes the connections move now and then, so replicas added
/// later get their share. A call the tool executor never received (it could not be reached,
/// or it refused the call's stream while closing a connection) is sent again.
#[derive(Clone)]
pub struct GrpcToolClient {
    endpoint: String,
    clients: Arc<[ToolExecutorClient<CheckedChannel>]>,
    next: Arc<AtomicUsize>,
    timeout: Duration,
    authorization: Option<MetadataValue<Ascii>>,
    /// `ExecuteTool` over the lean HTTP/2 client, for a cleartext tool executor.
    execute: Option<Arc<Execute>>,
}

/// `ExecuteTool` over h2c, and the credentials its calls carry.
struct Execute {
    unary: unary::Unary,
    authorization: Option<http::HeaderValue>,
}

/// How many times a call the tool executor refused unprocessed (a stream past its GOAWAY,
/// `REFUSED_STREAM`) is sent again at once: each refusal comes from a connection that is
/// closing, and the next try goes on another one.
const MAX_REFUSED: u32 = 4;
/// The first wait before calling again a tool executor that could not be reached; each
/// wait doubles, up to [`MOST_UNREACHABLE_WAIT`], for as long as `tool_executor_timeout`
/// and the call's own deadline allow.
const FIRST_UNREACHABLE_WAIT: Duration = Duration::from_millis(50);
const MOST_UNREACHABLE_WAIT: Duration = Duration::from_secs(1);

/// Why a call is sent again: it never reached the tool executor (sending it again cannot
/// run a tool twice), or its connection was lost under it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Unsent {
    /// No connection could be made.
    Unreachable,
    /// The connection refused the call's stream before processing it.
    Refused,
    /// The connection broke under the call (the tool executor crashed or was killed, or
    /// the call went out on a connection it had just closed): the call may have run. It
    /// goes again with its `call_id`, the idempotency key, as after a replica's take-over.
    Lost,
    /// The tool executor stopped the call as it shut down, or lost its source's connection
    /// under it (`UNAVAILABLE`, `ErrorInfo` `sent` true): the call may have run, and goes
    /// again once with its `call_id`, as a lost one does.
    Stopped,
    /// The tool's source is down and the call never reached it (`UNAVAILABLE`, `ErrorInfo`
    /// `TOOL_SOURCE_UNAVAILABLE` with `sent` false): it goes again once the `RetryInfo`'s
    /// wait is over, while the call's deadline allows.
    SourceDown(Duration),
}

/// Waits before a call whose source is down goes again: the tool executor's `RetryInfo`,
/// within these bounds.
const SOURCE_DOWN_WAIT: std::ops::RangeInclusive<Duration> =
    Duration::from_millis(100)..=Duration::from_secs(5);

/// What the tool executor said of a call it did not run to its end (see [`Unsent`]).
fn unsent_by_executor(status: &Status) -> Option<Unsent> {
    use tonic_types::StatusExt;
    if status.code() != Code::Unavailable {
        return None;
    }
    let details = status.get_error_details();
    let info = details.error_info()?;
    let sent = info.metadata.get("sent").map(String::as_str);
    match (info.reason.as_str(), sent) {
        ("TOOL_EXECUTOR_DRAINING", _) | ("TOOL_SOURCE_UNAVAILABLE", Some("true")) => {
            Some(Unsent::Stopped)
        }
        ("TOOL_SOURCE_UNAVAILABLE", Some("false")) => {
            let wait = details
                .retry_info()
                .and_then(|r| r.retry_delay)
                .unwrap_or(*SOURCE_DOWN_WAIT.start());
            Some(Unsent::SourceDown(
                wait.clamp(*SOURCE_DOWN_WAIT.start(), *SOURCE_DOWN_WAIT.end()),
            ))
        }
        _ => None,
    }
}

/// Whether `status` says the call is to go again, and why: it never reached the tool
/// executor, or its connection broke under it. A status the tool executor sent itself
/// (with `grpc-status`) has no transport error behind it, and is final.
/// The errors under `status`, outermost first.
fn causes(status: &Status) -> impl Iterator<Item = &(dyn std::error::Error + 'static)> {
    std::iter::successors(std::error::Error::source(status), |e| e.source())
}

fn unsent(status: &Status) -> Option<Unsent> {
    if let Some(why) = unsent_by_executor(status) {
        return Some(why);
    }
    for current in causes(status) {
        if let Some(unary::NotReceived(why)) = current.downcast_ref::<unary::NotReceived>() {
            return Some(*why);
        }
        if current.downcast_ref::<ConnectError>().is_some() {
            return Some(Unsent::Unreachable);
        }
        if let Some(h2) = current.downcast_ref::<h2::Error>() {
            // RFC 9113: streams refused with REFUSED_STREAM, and streams past a GOAWAY's
            // last stream id, were not processed. h2 does not say which side of that id a
            // stream failed by a GOAWAY was on; after a graceful one (NO_ERROR: the tool
            // executor ageing a connection out, or draining) the streams below it end
            // normally, so one that fails with it was past it. After a GOAWAY for an error,
            // a failed stream may have been processed, and is not sent again.
            let refused = h2.reason() == Some(h2::Reason::REFUSED_STREAM)
                || (h2.is_go_away() && h2.is_remote() && h2.reason() == Some(h2::Reason::NO_ERROR));
            if refused {
                return Some(Unsent::Refused);
            }
            return h2.is_io().then_some(Unsent::Lost);
        }
        if let Some(hyper) = current.downcast_ref::<hyper::Error>()
            && hyper.is_canceled()
        {
            // On HTTP/2, hyper cancels only requests it has not sent: ones still queued
            // for a connection that closed ("connection closed"), or given to one that was
            // not ready.
            return Some(Unsent::Refused);
        }
        if current.downcast_ref::<std::io::Error>().is_some() {
            // The connection broke under the call (hyper passes h2's "stream closed
            // because of a broken pipe" on as an I/O error).
            return Some(Unsent::Lost);
        }
    }
    None
}

/// Whether `status` comes from a peer that does not speak gRPC over HTTP/2: an HTTP/2
/// protocol error under it (an HTTP/1 server answering the preface).
fn speaks_no_grpc(status: &Status) -> bool {
    causes(status)
        .find_map(|e| e.downcast_ref::<h2::Error>())
        .is_some_and(|h2| h2.reason() == Some(h2::Reason::PROTOCOL_ERROR) || h2.is_go_away())
}

/// `Bearer TOKEN` as a header value kept out of HPACK's dynamic table.
fn bearer(token: &Secret) -> Result<http::HeaderValue, String> {
    let mut value = http::HeaderValue::try_from(format!("Bearer {}", token.expose()))
        .map_err(|_| "the tool executor token has characters a header cannot carry")?;
    value.set_sensitive(true);
    Ok(value)
}

/// How to reach the tool executor.
pub struct ToolClientOptions {
    /// Each call gives up after this long, connecting included.
    pub timeout: Duration,
    /// Largest message either way.
    pub max_message_bytes: usize,
    /// TLS, for an `https://` URL.
    pub tls: Option<ClientTlsConfig>,
    /// The bearer token to send.
    pub token: Option<Secret>,
    /// Connections to open (lazily), which calls take in turn; tool calls to a cleartext
    /// tool executor keep at least this many open, and open more while every one is at
    /// the tool executor's limit of concurrent streams.
    pub connections: usize,
}

impl GrpcToolClient {
    /// A client of the tool executor at `url`; nothing is dialled until the first call.
    pub fn new(url: &str, options: ToolClientOptions) -> Result<Self, String> {
        let ToolClientOptions {
            timeout,
            max_message_bytes,
            tls,
            token,
            connections,
        } = options;
        let mut endpoint = Endpoint::from_shared(url.to_owned())
            .map_err(|e| format!("invalid tool executor URL {url:?}: {e}"))?;
        let secure = tls.is_some();
        if let Some(tls) = tls {
            endpoint = endpoint
                .tls_config(tls)
                .map_err(|e| format!("invalid TLS settings for {url:?}: {e}"))?;
        }
        let execute = if !secure && url.starts_with("http://") {
            let authorization = token.as_ref().map(bearer).transpose()?;
            let unary = unary::Unary::new(
                url,
                "/agent.v1.ToolExecutor/ExecuteTool",
                timeout,
                connections,
                max_message_bytes,
                max_message_bytes,
            )?;
            Some(Arc::new(Execute {
                unary,
                authorization,
            }))
        } else {
            None
        };
        let authorization = token
            .as_ref()
            .map(bearer)
            .transpose()?
            .map(|value| {
                let mut value = MetadataValue::<Ascii>::try_from(value.as_bytes())
                    .map_err(|_| "the tool executor token has characters a header cannot carry")?;
                value.set_sensitive(true);
                Ok::<_, String>(value)
            })
            .transpose()?;
        let endpoint = endpoint
            .connect_timeout(timeout)
            .tcp_nodelay(true)
            .http2_keep_alive_interval(Duration::from_secs(30))
            .keep_alive_while_idle(true)
            // Every call in flight shares the connection, and each result arrives as a
            // small DATA frame: h2 allows unread small frames up to half the connection
            // window, so thousands of results at once need a large one.
            .initial_connection_window_size(16 * 1024 * 1024);
        // Each channel is a connection of its own (made again when it closes). With tool
        // calls over h2c, one serves `ListTools`, called once per engine.
        let channels = if execute.is_some() {
            1
        } else {
            connections.max(1)
        };
        let clients = (0..channels)
            .map(|_| {
                ToolExecutorClient::new(CheckedChannel(endpoint.connect_lazy()))
                    // The catalogue may be larger than a message a peer may send.
                    .max_decoding_message_size(
                        max_message_bytes.max(agentrt_grpc::MAX_CATALOGUE_BYTES),
                    )
                    .max_encoding_message_size(max_message_bytes)
            })
            .collect();
        Ok(Self {
            endpoint: url.to_owned(),
            clients,
            next: Arc::new(AtomicUsize::new(0)),
            timeout,
            authorization,
            execute,
        })
    }

    /// Wraps `message` with the deadline and credentials every call carries.
    fn request<T>(&self, message: T, timeout: Duration) -> tonic::Request<T> {
        let mut request = tonic::Request::new(message);
        request.set_timeout(timeout);
        if let Some(value) = &self.authorization {
            request
                .metadata_mut()
                .insert("authorization", value.clone());
        }
        if agentrt_telemetry::tracing_enabled() {
            // The tool executor's span joins this trace, under the current
            // `execute_tool` span.
            let mut headers = tonic::codegen::http::HeaderMap::new();
            agentrt_telemetry::inject(&mut headers);
            for (name, value) in &headers {
                if let (Ok(key), Ok(value)) = (
                    tonic::metadata::MetadataKey::from_bytes(name.as_str().as_bytes()),
                    value.to_str().map(MetadataValue::try_from),
                ) && let Ok(value) = value
                {
                    request.metadata_mut().insert(key, value);
                }
            }
        }
        request
    }

    /// The client of the next connection in turn.
    fn client(&self) -> ToolExecutorClient<CheckedChannel> {
        let turn = self.next.fetch_add(1, Ordering::Relaxed);
        self.clients[turn % self.clients.len()].clone()
    }

    /// Makes the call `call` (given the time left) until the tool executor
    /// receives it or `deadline` passes: a call that never reached it goes again, at once
    /// on another connection when a closing connection refused it, after a short wait
    /// when none could be made (within `tool_executor_timeout`). `Err(())` when the
    /// deadline passed first.
    async fn send<T, F, Fut>(&self, deadline: Instant, mut call: F) -> Result<Result<T, Status>, ()>
    where
        F: FnMut(Duration) -> Fut,
        Fut: Future<Output = Result<T, Status>>,
    {
        // `tool_executor_timeout` from the first of the attempts in a row that found no
        // connection (a call lost with its connection looks for the tool executor anew).
        let mut unreachable_until: Option<Instant> = None;
        let mut refused = 0;
        let mut lost = false;
        let mut wait = FIRST_UNREACHABLE_WAIT;
        loop {
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                return Err(());
            }
            let outcome = tokio::time::timeout(left, call(left))
                .await
                .map_err(|_| ())?;
            let Err(status) = &outcome else {
                return Ok(outcome);
            };
            let why = unsent(status);
            let until = if why == Some(Unsent::Unreachable) {
                *unreachable_until.get_or_insert_with(|| Instant::now() + self.timeout)
            } else {
                unreachable_until = None;
                deadline
            };
            match why {
                Some(Unsent::Refused) if refused < MAX_REFUSED => {
                    refused += 1;
                    tracing::debug!(endpoint = %agentrt_core::mask_url_credentials(&self.endpoint), "a call the tool executor refused unprocessed goes again");
                }
                Some(Unsent::Lost) if !lost => {
                    lost = true;
                    tracing::info!(endpoint = %agentrt_core::mask_url_credentials(&self.endpoint), "the connection to the tool executor broke under a call; it goes again, once, with its call_id");
                }
                Some(Unsent::Stopped) if !lost => {
                    lost = true;
                    tracing::info!(status = %status.message(), "the tool executor stopped a call it may have run; it goes again, once, with its call_id");
                }
                Some(Unsent::SourceDown(wait)) if Instant::now() + wait < deadline => {
                    tracing::debug!(status = %status.message(), ?wait, "the tool's source is down; calling again");
                    tokio::time::sleep(wait).await;
                }
                Some(Unsent::Unreachable) if Instant::now() + wait < until.min(deadline) => {
                    tracing::debug!(endpoint = %agentrt_core::mask_url_credentials(&self.endpoint), ?wait, "tool executor unreachable; calling again");
                    tokio::time::sleep(wait).await;
                    wait = (wait * 2).min(MOST_UNREACHABLE_WAIT);
                }
                _ => return Ok(outcome),
            }
        }
    }

    /// The error clients see (`reason`), after logging the details they must not see.
    fn unavailable(&self, reason: String, detail: &str) -> ToolServiceError {
        self.log_unavailable(detail);
        ToolServiceError::Unavailable {
            endpoint: self.endpoint.clone(),
            reason,
        }
    }
    /// Logs why the tool executor could not be used, with details clients must not see.
    fn log_unavailable(&self, detail: &str) {
        tracing::warn!(endpoint = %agentrt_core::mask_url_credentials(&self.endpoint), %detail, "tool executor unavailable");
    }
}

#[async_trait]
impl ToolCatalog for GrpcToolClient {
    async fn list_tools(&self) -> Result<Vec<ToolSpec>, ToolServiceError> {
        // The client enforces the limit itself too: a server that accepts the connection
        // but never answers must not hang validation.
        let response = self
            .send(Instant::now() + self.timeout, |left| {
                let mut client = self.client();
                let request = self.request(v1::ListToolsRequest {}, left);
                async move { client.list_tools(request).await }
            })
            .await
            .map_err(|()| {
                let reason = format!("no answer within {:?}", self.timeout);
                self.unavailable(reason.clone(), &reason)
            })?
            .map_err(|status| {
                let refused = match status.code() {
                    Code::Unauthenticated => Some(
                        "it refused this server's credentials; set tool_executor_token \
                         (AGENT_SERVER_TOOL_EXECUTOR_TOKEN) to a token it accepts",
                    ),
                    Code::PermissionDenied => Some(
                        "the token it was sent does not grant agent.v1.ToolExecutor; give \
                         tool_executor_token a token that does",
                    ),
                    Code::Unimplemented => Some(
                        "it does not serve agent.v1.ToolExecutor; check that tool_executor \
                         (--tool-executor) is the tool executor's gRPC address",
                    ),
                    Code::Internal | Code::Unknown if speaks_no_grpc(&status) => Some(
                        "it does not answer in gRPC over HTTP/2; check that tool_executor \
                         (--tool-executor) is the tool executor's gRPC address",
                    ),
                    _ => None,
                };
                if let Some(reason) = refused {
                    tracing::warn!(endpoint = %agentrt_core::mask_url_credentials(&self.endpoint), code = ?status.code(), detail = %status.message(), "the tool executor cannot be used");
                    return ToolServiceError::Misconfigured {
                        endpoint: self.endpoint.clone(),
                        reason: format!("{reason} ({:?}: {})", status.code(), status.message()),
                    };
                }
                let reason = match status.code() {
                    // The call's own deadline (`tool_executor_timeout`) passed: the tool
                    // executor did not answer, it cancelled nothing.
                    Code::Cancelled | Code::DeadlineExceeded => {
                        format!("no answer within {:?}", self.timeout)
                    }
                    // A connection that could not be made is not an answer (it said "it
                    // answered Unavailable" of a tool executor that was down).
                    _ if matches!(unsent(&status), Some(Unsent::Unreachable)) => {
                        format!(
                            "it cannot be reached (no connection within {:?})",
                            self.timeout
                        )
                    }
                    code => format!("it answered {code:?}"),
                };
                self.unavailable(
                    reason,
                    &format!("{:?}: {}", status.code(), status.message()),
                )
            })?;
        Ok(response
            .into_inner()
            .tools
            .into_iter()
            .map(|tool| ToolSpec {
                input_schema: tool
                    .input_schema
                    .as_ref()
                    .map_or(serde_json::Value::Null, agentrt::json::struct_to_json)
                    .into(),
                source: match v1::ToolSource::try_from(tool.source) {
                    Ok(v1::ToolSource::Http) => ToolSource::Http,
                    Ok(v1::ToolSource::Mcp) => ToolSource::Mcp,
                    _ => ToolSource::Builtin,
                },
                name: tool.name,
                description: tool.description,
            })
            .collect())
    }
}

impl ToolRunner for GrpcToolClient {
    // Not an `async fn`: calls in flight wait in this future, and an `async fn` would keep
    // room for the call as its argument and its local, though the message made of it is
    // all that is sent.
    fn run<'a, 'f>(
        &'a self,
        call: ToolInvocation,
        timeout: Duration,
    ) -> Pin<Box<dyn Future<Output = ToolResult> + Send + 'f>>
    where
        'a: 'f,
    {
        let name = call.name.clone();
        // The deadline travels to the tool executor, which stops the work when it passes;
        // the local timer covers an executor that does not answer at all.
        let arguments = agentrt::json::json_to_struct(&call.arguments);
        // The parsed arguments are not needed while the call runs, which may be long.
        drop(call.arguments);
        let message = v1::ExecuteToolRequest {
            // The tool executor's idempotency key: unique among every run's calls.
            call_id: if call.key.is_empty() {
                call.call_id
            } else {
                call.key
            },
            tool_name: call.name,
            arguments,
            run_id: call.run_id,
            session_id: call.session_id,
        };
        // Over h2c the call keeps its encoded body only: the message (its arguments as a
        // tree of maps, its ids) takes more room, and is not needed again.
        let message = match &self.execute {
            Some(execute) => Message::Encoded(execute.clone(), execute.unary.encode(&message)),
            None => Message::Decoded(message),
        };
        Box::pin(self.execute(name, message, timeout))
    }
}

/// A call to the tool executor, as it waits to be sent (again).
enum Message {
    /// Its body over h2c, or why it cannot be sent.
    Encoded(Arc<Execute>, Result<bytes::Bytes, Status>),
    /// The message, for tonic's channel.
    Decoded(v1::ExecuteToolRequest),
}

impl GrpcToolClient {
    /// [`ToolRunner::run`] of a call's message (an `async` block: an `async fn` would keep
    /// its arguments twice).
    #[allow(
        clippy::manual_async_fn,
        reason = "an async fn keeps its arguments twice"
    )]
    fn execute(
        &self,
        name: String,
        message: Message,
        timeout: Duration,
    ) -> impl Future<Output = ToolResult> + Send + '_ {
        async move {
            let timed_out =
                || ToolResult::error(format!("tool {name:?} did not finish within {timeout:?}"));
            let deadline = Instant::now() + timeout;
            let response = match &message {
                Message::Encoded(execute, Ok(body)) => {
                    self.send(deadline, |left| {
                        execute
                            .unary
                            .call(body, left, execute.authorization.as_ref())
                    })
                    .await
                }
                Message::Encoded(_, Err(status)) => Ok(Err(status.clone())),
                Message::Decoded(message) => Box::pin(self.send(deadline, |left| {
                    let mut client = self.client();
                    let request = self.request(message.clone(), left);
                    async move { client.execute_tool(request).await }
                }))
                .await
                .map(|outcome| outcome.map(tonic::Response::into_inner)),
            };
            let Ok(response) = response else {
                return timed_out();
            };
            match response {
                Ok(response) => ToolResult {
                    output: response.output,
                    is_error: response.is_error,
                    references: response
                        .references
                        .into_iter()
                        .map(|r| Reference {
                            title: r.title,
                            url: r.url,
                            snippet: r.snippet,
                            score: r.score,
                            source: r.source,
                        })
                        .collect(),
                },
                Err(status) => match status.code() {
                    Code::InvalidArgument => ToolResult::error(format!(
                        "invalid arguments for tool {name:?}: {}",
                        status.message()
                    )),
                    Code::NotFound => ToolResult::error(format!(
                        "tool {name:?} does not exist on the tool executor"
                    )),
                    Code::DeadlineExceeded => timed_out(),
                    // Cancelled by the tool executor (or a proxy) before the deadline: not
                    // a timeout, whatever the code.
                    Code::Cancelled if Instant::now() < deadline => ToolResult::error(format!(
                        "tool {name:?} failed: the tool executor cancelled the call: {}",
                        status.message()
                    )),
                    Code::Cancelled => timed_out(),
                    // Its address and the error's details are for the operator, in the log;
                    // the model and the client read what happened.
                    code => match unsent(&status) {
                        Some(Unsent::Unreachable) => {
                            self.log_unavailable(status.message());
                            ToolResult::error(format!(
                                "tool {name:?} failed: the tool executor cannot be reached"
                            ))
                        }
                        Some(Unsent::Lost) => {
                            self.log_unavailable(status.message());
                            ToolResult::error(format!(
                                "tool {name:?} failed: the connection to the tool executor broke \
                                 during the call, twice"
                            ))
                        }
                        _ => ToolResult::error(format!(
                            "tool {name:?} failed: {code:?}: {}",
                            status.message()
                        )),
                    },
                },
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn what_the_tool_executor_says_of_a_call_it_did_not_run_is_read() {
        let down = |sent: &str, retry: Duration| {
            agentrt_grpc::status::unavailable_about(
                "TOOL_SOURCE_UNAVAILABLE",
                "tool \"docs__search\" is unavailable".into(),
                retry,
                &[("tool", "docs__search"), ("source", "docs"), ("sent", sent)],
            )
        };
        // Never sent: again after the RetryInfo's wait, within bounds.
        assert_eq!(
            unsent(&down("false", Duration::from_secs(1))),
            Some(Unsent::SourceDown(Duration::from_secs(1)))
        );
        assert_eq!(
            unsent(&down("false", Duration::from_secs(60))),
            Some(Unsent::SourceDown(Duration::from_secs(5)))
        );
        // Sent, then the source went away: it may have run.
        assert_eq!(
            unsent(&down("true", Duration::from_secs(1))),
            Some(Unsent::Stopped)
        );
        let draining = agentrt_grpc::status::unavailable_about(
            "TOOL_EXECUTOR_DRAINING",
            "stopped".into(),
            Duration::ZERO,
            &[("tool", "sleep"), ("sent", "true")],
        );
        assert_eq!(unsent(&draining), Some(Unsent::Stopped));
        // Anything else the tool executor says is final.
        assert_eq!(unsent(&Status::unavailable("no reason given")), None);
        assert_eq!(
            unsent(&agentrt_grpc::status::not_found(
                "TOOL_NOT_FOUND",
                "tool",
                "x"
            )),
            None
        );
    }

    /// A tool executor that fails every call with `DATA_LOSS` and status details that are
    /// not base64: in its headers (trailers only), or in trailers after the headers.
    async fn garbled_details_server(in_trailers: bool) -> String {
        unary::tests::raw_server(move |mut respond| {
            let grpc =
                http::Response::builder().header(http::header::CONTENT_TYPE, "application/grpc");
            let mut status = http::HeaderMap::new();
            status.insert("grpc-status", http::HeaderValue::from_static("15"));
            status.insert(
                "grpc-status-details-bin",
                http::HeaderValue::from_static("not base64!"),
            );
            if in_trailers {
                let mut stream = respond
                    .send_response(grpc.body(()).unwrap(), false)
                    .unwrap();
                stream.send_trailers(status).unwrap();
            } else {
                let mut response = grpc.body(()).unwrap();
                response.headers_mut().extend(status);
                respond.send_response(response, true).unwrap();
            }
        })
        .await
    }

    #[tokio::test]
    async fn status_details_that_are_not_base64_are_left_out_not_a_panic() {
        for in_trailers in [false, true] {
            let url = garbled_details_server(in_trailers).await;
            let options = ToolClientOptions {
                timeout: Duration::from_secs(5),
                max_message_bytes: 1 << 20,
                tls: None,
                token: None,
                connections: 1,
            };
            let client = GrpcToolClient::new(&url, options).unwrap();
            // Through tonic's channel, as every call to an `https://` tool executor.
            let error = client.list_tools().await.unwrap_err();
            assert_eq!(
                error.to_string(),
                "the tool executor is unavailable: it answered DataLoss",
                "in trailers: {in_trailers}"
            );
        }
    }
}
