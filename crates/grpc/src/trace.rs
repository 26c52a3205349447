//! A span per gRPC call, child of the caller's W3C trace context, when traces are exported.

use std::task::{Context, Poll};

use http::Request;
use tracing::{Instrument, Span, instrument::Instrumented};

/// Opens a server span for every call of a method the server serves but health checks
/// (it runs inside [`crate::metrics::RpcMetricsLayer`], which says which those are), named
/// `package.Service/Method`
/// after the OpenTelemetry RPC conventions, with the `traceparent` of the request as its
/// parent. Costs nothing but a check when traces are not exported.
#[derive(Debug, Clone, Copy, Default)]
pub struct RpcSpanLayer;

impl<S> tower_layer::Layer<S> for RpcSpanLayer {
    type Service = RpcSpan<S>;

    fn layer(&self, inner: S) -> Self::Service {
        RpcSpan { inner }
    }
}

/// See [`RpcSpanLayer`].
#[derive(Debug, Clone)]
pub struct RpcSpan<S> {
    inner: S,
}

impl<S, ReqBody> tower_service::Service<Request<ReqBody>> for RpcSpan<S>
where
    S: tower_service::Service<Request<ReqBody>>,
{
    type Response = S::Response;
    type Error = S::Error;
    type Future = Instrumented<S::Future>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, request: Request<ReqBody>) -> Self::Future {
        let span = if agentrt_telemetry::tracing_enabled() {
            rpc_span(&request)
        } else {
            Span::none()
        };
        self.inner.call(request).instrument(span)
    }
}

fn rpc_span<B>(request: &Request<B>) -> Span {
    // A path the server does not serve gets no span (see [`crate::metrics::KnownRoute`]).
    if request
        .extensions()
        .get::<crate::metrics::KnownRoute>()
        .is_none()
    {
        return Span::none();
    }
    let Some((service, method)) = crate::grpc_route(request.uri().path()) else {
        return Span::none();
    };
    if service == "grpc.health.v1.Health" {
        return Span::none();
    }
    let span = tracing::info_span!(
        "rpc",
        otel.name = %format!("{service}/{method}"),
        otel.kind = "server",
        rpc.system = "grpc",
        rpc.service = %service,
        rpc.method = %method,
    );
    agentrt_telemetry::extract(&span, request.headers());
    span
}
