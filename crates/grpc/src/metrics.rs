//! Metrics of every gRPC call (a tower layer) and the admin HTTP endpoint that serves the
//! process's metrics to Prometheus.

use std::{
    collections::HashSet,
    convert::Infallible,
    future::Future,
    net::SocketAddr,
    pin::Pin,
    sync::Arc,
    task::{Context, Poll},
    time::{Duration, Instant},
};

use agentrt_metrics::Metrics;
use bytes::Bytes;
use http::{HeaderMap, Request, Response, StatusCode, header};
use http_body::{Body, Frame, SizeHint};
use http_body_util::Full;
use hyper_util::rt::TokioIo;
use tokio::net::TcpListener;
use tokio_util::sync::CancellationToken;
use tracing::{debug, info};

/// Records every call's status code and duration in [`Metrics`], and stamps each request
/// with its [`Arrival`]. Calls are labelled by service and method only when the server
/// registered that method; any other path (a client can send any) counts as
/// `unknown`/`unknown`, so that no client can grow the metrics. Being the layer that sees
/// every call's status first, it also gives a request over the size limit gRPC's code for
/// it (see `oversize_is_resource_exhausted`), and records that code.
#[derive(Debug, Clone, Default)]
pub struct RpcMetricsLayer {
    /// The registered methods, as `/package.Service/Method`.
    methods: Arc<HashSet<String>>,
}

/// The label of a service or method the server did not register.
pub const UNKNOWN: &str = "unknown";

impl RpcMetricsLayer {
    /// A layer that labels calls of these methods (`/package.Service/Method`).
    pub fn new(methods: impl IntoIterator<Item = String>) -> Self {
        Self {
            methods: Arc::new(methods.into_iter().collect()),
        }
    }
}

/// The methods of `services` as `/package.Service/Method`, read from encoded
/// `FileDescriptorSet`s; services not in them are left out.
pub fn registered_methods(descriptor_sets: &[&[u8]], services: &[&str]) -> Vec<String> {
    use prost::Message;
    let mut methods = Vec::new();
    for set in descriptor_sets {
        let Ok(set) = prost_types::FileDescriptorSet::decode(*set) else {
            continue;
        };
        for file in set.file {
            let package = file.package.unwrap_or_default();
            for service in file.service {
                let name = format!("{package}.{}", service.name.unwrap_or_default());
                if !services.contains(&name.as_str()) {
                    continue;
                }
                methods.extend(
                    service
                        .method
                        .iter()
                        .map(|m| format!("/{name}/{}", m.name.as_deref().unwrap_or_default())),
                );
            }
        }
    }
    methods
}

/// When a call reached the server's services, before its body was read: the moment
/// tonic starts the timer of the call's `grpc-timeout`. A handler that ends its work by
/// `arrival + timeout`, less a margin, answers before tonic cuts the call off with
/// `CANCELLED`, however late the handler itself started.
#[derive(Debug, Clone, Copy)]
pub struct Arrival(pub tokio::time::Instant);

/// Marks a call to a method the server serves (the others are answered `UNIMPLEMENTED`):
/// only those are named after their path in spans, so that a caller cannot make spans of
/// any name it likes.
#[derive(Debug, Clone, Copy)]
pub(crate) struct KnownRoute;

impl<S> tower_layer::Layer<S> for RpcMetricsLayer {
    type Service = RpcMetrics<S>;

    fn layer(&self, inner: S) -> Self::Service {
        RpcMetrics {
            inner,
            methods: self.methods.clone(),
        }
    }
}

/// See [`RpcMetricsLayer`].
#[derive(Debug, Clone)]
pub struct RpcMetrics<S> {
    inner: S,
    methods: Arc<HashSet<String>>,
}

impl<S, ReqBody, ResBody> tower_service::Service<Request<ReqBody>> for RpcMetrics<S>
where
    S: tower_service::Service<Request<ReqBody>, Response = Response<ResBody>>,
    S::Future: Send + 'static,
{
    type Response = Response<MeteredBody<ResBody>>;
    type Error = S::Error;
    type Future =
        Pin<Box<dyn Future<Output = Result<Self::Response, Self::Error>> + Send + 'static>>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, mut request: Request<ReqBody>) -> Self::Future {
        let started = Instant::now();
        request
            .extensions_mut()
            .insert(Arrival(tokio::time::Instant::now()));
        // `/package.Service/Method` of a registered method; anything else is one label.
        let path = request.uri().path();
        let (service, method) = match crate::grpc_route(path) {
            Some((service, method)) if self.methods.contains(path) => {
                (service.to_owned(), method.to_owned())
            }
            _ => (UNKNOWN.to_owned(), UNKNOWN.to_owned()),
        };
        if service != UNKNOWN {
            request.extensions_mut().insert(KnownRoute);
        }
        let deadline = request
            .headers()
            .get("grpc-timeout")
            .and_then(|value| value.to_str().ok())
            .and_then(crate::parse_grpc_timeout);
        let response = self.inner.call(request);
        Box::pin(async move {
            // Until the response starts, the call is recorded if it is dropped: tonic cuts
            // a call off at its deadline, and a client may reset it, before any answer.
            let mut unanswered = Unanswered {
                call: Some(Call {
                    service,
                    method,
                    started,
                    code: None,
                }),
                deadline,
            };
            let mut response = response.await?;
            // A trailers-only response (an error before any message) has it here.
            let mut code = grpc_status(response.headers());
            if code == Some(OUT_OF_RANGE) && oversize_is_resource_exhausted(response.headers_mut())
            {
                code = Some(RESOURCE_EXHAUSTED);
            }
            let mut call = unanswered.call.take();
            if let Some(call) = &mut call {
                call.code = code;
            }
            Ok(response.map(|inner| MeteredBody { inner, call }))
        })
    }
}

struct Call {
    service: String,
    method: String,
    started: Instant,
    code: Option<i32>,
}

impl Call {
    fn record(self, code: i32) {
        Metrics::global().rpc(&self.service, &self.method, code, self.started.elapsed());
    }
}

/// A call whose response has not started: recorded when it is dropped as
/// `DEADLINE_EXCEEDED` once its `grpc-timeout` has passed, as `CANCELLED` otherwise.
struct Unanswered {
    call: Option<Call>,
    deadline: Option<Duration>,
}

impl Drop for Unanswered {
    fn drop(&mut self) {
        let Some(call) = self.call.take() else {
            return;
        };
        let past_deadline = self
            .deadline
            .is_some_and(|deadline| call.started.elapsed() >= deadline);
        call.record(if past_deadline {
            DEADLINE_EXCEEDED
        } else {
            CANCELLED
        });
    }
}

/// tonic refuses a request message beyond its decoding limit (`server.max_message_bytes`)
/// with `OUT_OF_RANGE`, before the handler sees it, as a trailers-only response. gRPC's
/// status codes give `RESOURCE_EXHAUSTED` for a message larger than the limit, which is what
/// clients and their retry policies expect: such a response is rewritten to it, naming the
/// setting.
/// True when it rewrote one.
fn oversize_is_resource_exhausted(headers: &mut HeaderMap) -> bool {
    const TONIC_TOO_LARGE: &str = "Error, decoded message length too large: ";
    let Some(status) = tonic::Status::from_header_map(headers) else {
        return false;
    };
    let Some(found) = status.message().strip_prefix(TONIC_TOO_LARGE) else {
        return false;
    };
    // With the reason an oversized answer has, for clients that branch on it.
    let exhausted = crate::status::resource_exhausted_for_good(
        "MESSAGE_TOO_LARGE",
        format!(
            "request message larger than the server accepts (server.max_message_bytes): {found}"
        ),
    );
    exhausted.add_header(headers).is_ok()
}

fn grpc_status(headers: &HeaderMap) -> Option<i32> {
    headers.get("grpc-status")?.to_str().ok()?.parse().ok()
}

/// A response body that records its call when the status arrives in the trailers, when it
/// ends, or, if the client goes away first, as CANCELLED when it is dropped.
pub struct MeteredBody<B> {
    inner: B,
    call: Option<Call>,
}

/// gRPC's CANCELLED.
const CANCELLED: i32 = 1;
/// gRPC's DEADLINE_EXCEEDED.
const DEADLINE_EXCEEDED: i32 = 4;
/// gRPC's RESOURCE_EXHAUSTED.
const RESOURCE_EXHAUSTED: i32 = 8;
/// gRPC's OUT_OF_RANGE.
const OUT_OF_RANGE: i32 = 11;

impl<B: Body + Unpin> Body for MeteredBody<B> {
    type Data = B::Data;
    type Error = B::Error;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Self::Data>, Self::Error>>> {
        let polled = Pin::new(&mut self.inner).poll_frame(cx);
        match &polled {
            Poll::Ready(Some(Ok(frame))) => {
                if let Some(code) = frame.trailers_ref().and_then(grpc_status)
                    && let Some(call) = self.call.take()
                {
                    call.record(code);
                }
            }
            Poll::Ready(Some(Err(_))) => {
                if let Some(call) = self.call.take() {
                    call.record(CANCELLED);
                }
            }
            Poll::Ready(None) => {
                if let Some(call) = self.call.take() {
                    let code = call.code.unwrap_or(0);
                    call.record(code);
                }
            }
            Poll::Pending => {}
        }
        polled
    }

    fn is_end_stream(&self) -> bool {
        self.inner.is_end_stream()
    }

    fn size_hint(&self) -> SizeHint {
        self.inner.size_hint()
    }
}

impl<B> Drop for MeteredBody<B> {
    fn drop(&mut self) {
        if let Some(call) = self.call.take() {
            let code = call.code.unwrap_or(CANCELLED);
            call.record(code);
        }
    }
}

/// How long a connection to the metrics port lasts before it ends after its current answer.
const METRICS_CONNECTION_AGE: Duration = Duration::from_secs(60);
/// How long that answer may then take to be read.
const METRICS_CONNECTION_GRACE: Duration = Duration::from_secs(10);

/// Serves `GET /metrics` (OpenMetrics text, which Prometheus reads) on `listener` until `stop` is cancelled,
/// taking connections within `limits` (a request's headers must arrive within the
/// handshake timeout).
pub(crate) async fn serve_metrics(
    listener: TcpListener,
    limits: crate::listener::Limits,
    stop: CancellationToken,
) {
    let addr: Option<SocketAddr> = listener.local_addr().ok();
    if let Some(addr) = addr {
        info!(metrics_addr = %addr, "metrics endpoint ready");
    }
    let mut incoming = crate::listener::admit(
        "metrics",
        listener,
        limits,
        |tcp| async move { Ok(tcp) },
        stop.clone(),
    );
    while let Some(Ok(stream)) = tokio_stream::StreamExt::next(&mut incoming).await {
        let stop = stop.clone();
        tokio::spawn(async move {
            let connection = hyper::server::conn::http1::Builder::new()
                .timer(hyper_util::rt::TokioTimer::new())
                .header_read_timeout(limits.handshake_timeout)
                .serve_connection(
                    TokioIo::new(stream),
                    hyper::service::service_fn(metrics_response),
                );
            tokio::pin!(connection);
            // A connection lasts a while, then ends after the answer it is writing: a
            // client that asks and never reads its answers (hyper has no write timeout)
            // holds a slot for that long at most. Prometheus connects again.
            let aged = tokio::time::sleep(METRICS_CONNECTION_AGE);
            tokio::pin!(aged);
            tokio::select! {
                result = connection.as_mut() => {
                    if let Err(error) = result {
                        debug!(%error, "metrics connection ended with an error");
                    }
                    return;
                }
                () = &mut aged => connection.as_mut().graceful_shutdown(),
                () = stop.cancelled() => return,
            }
            tokio::select! {
                _ = tokio::time::timeout(METRICS_CONNECTION_GRACE, connection) => {}
                () = stop.cancelled() => {}
            }
        });
    }
}

async fn metrics_response<B>(request: Request<B>) -> Result<Response<Full<Bytes>>, Infallible> {
    let response = if request.uri().path() == "/metrics" {
        Response::builder()
            // What the encoder writes (counters typed by their name without `_total`,
            // `# EOF`); Prometheus reads it by this type.
            .header(
                header::CONTENT_TYPE,
                "application/openmetrics-text; version=1.0.0; charset=utf-8",
            )
            .body(Full::new(Bytes::from(Metrics::global().encode())))
    } else {
        Response::builder()
            .status(StatusCode::NOT_FOUND)
            .body(Full::new(Bytes::from_static(
                b"only /metrics is served here\n",
            )))
    };
    // The builders above are given only valid parts.
    Ok(response.unwrap_or_default())
}

#[cfg(test)]
mod registered_tests {
    use super::*;

    #[test]
    fn registered_methods_come_from_the_descriptors_of_the_served_services() {
        let methods = registered_methods(
            &[
                agentrt::FILE_DESCRIPTOR_SET,
                tonic_health::pb::FILE_DESCRIPTOR_SET,
            ],
            &["agent.v1.ToolExecutor", "grpc.health.v1.Health"],
        );
        for path in [
            "/agent.v1.ToolExecutor/ListTools",
            "/agent.v1.ToolExecutor/ExecuteTool",
            "/grpc.health.v1.Health/Check",
            "/grpc.health.v1.Health/Watch",
        ] {
            assert!(methods.iter().any(|m| m == path), "{path}: {methods:?}");
        }
        assert!(
            !methods
                .iter()
                .any(|m| m.starts_with("/agent.v1.AgentEngine/")),
            "services this server does not serve are left out"
        );
    }
}

#[cfg(test)]
mod tests {
    // Tests fail by panicking, with the value that was wrong.
    #![allow(clippy::unwrap_used, clippy::expect_used)]

    use std::convert::Infallible;

    use tower_layer::Layer;
    use tower_service::Service;

    use super::*;

    /// A service that never answers.
    #[derive(Clone)]
    struct Silent;

    impl Service<Request<()>> for Silent {
        type Response = Response<()>;
        type Error = Infallible;
        type Future = std::future::Pending<Result<Response<()>, Infallible>>;

        fn poll_ready(&mut self, _: &mut Context<'_>) -> Poll<Result<(), Infallible>> {
            Poll::Ready(Ok(()))
        }

        fn call(&mut self, _: Request<()>) -> Self::Future {
            std::future::pending()
        }
    }

    fn handled(method: &str, code: &str) -> f64 {
        Metrics::global()
            .encode()
            .lines()
            .find(|line| {
                line.starts_with("agentrt_grpc_server_handled_total")
                    && line.contains(&format!("grpc_method=\"{method}\""))
                    && line.contains(&format!("grpc_code=\"{code}\""))
            })
            .and_then(|line| line.rsplit(' ').next()?.parse().ok())
            .unwrap_or(0.0)
    }

    /// A call dropped before its response started (tonic cuts it off at its deadline, or
    /// the client resets it) is counted: `DEADLINE_EXCEEDED` once its `grpc-timeout` has
    /// passed, `CANCELLED` before.
    #[tokio::test]
    async fn calls_dropped_before_an_answer_are_counted() {
        let methods = Arc::new(HashSet::from([
            "/test.Slow/Late".to_owned(),
            "/test.Slow/Gone".to_owned(),
        ]));
        let mut service = RpcMetricsLayer { methods }.layer(Silent);
        let request = |path: &str, timeout: &str| {
            Request::builder()
                .uri(path)
                .header("grpc-timeout", timeout)
                .body(())
                .unwrap()
        };
        let late = service.call(request("/test.Slow/Late", "20m"));
        let _ = tokio::time::timeout(Duration::from_millis(50), late).await;
        let gone = service.call(request("/test.Slow/Gone", "10S"));
        let _ = tokio::time::timeout(Duration::from_millis(10), gone).await;
        assert_eq!(handled("Late", "DEADLINE_EXCEEDED"), 1.0);
        assert_eq!(handled("Gone", "CANCELLED"), 1.0);
    }
}
