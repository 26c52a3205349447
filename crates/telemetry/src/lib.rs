//! Logging and tracing set-up shared by every binary.
//!
//! Logs go to standard error, so that standard output stays free for what a command is
//! asked to print (e.g. `--print-config`). `LOG_FORMAT=json` switches to one JSON object
//! per line; `RUST_LOG` (default `info`, MCP client internals at `warn`) sets the level per module.
//!
//! Traces are exported over OTLP/gRPC when `OTEL_EXPORTER_OTLP_ENDPOINT` (or
//! `OTEL_EXPORTER_OTLP_TRACES_ENDPOINT`) is set, and not at all otherwise. The service is
//! named by `OTEL_SERVICE_NAME`, else after the binary. W3C trace context (`traceparent`)
//! is read from incoming calls with [`extract`] and written to outgoing ones with
//! [`inject`]. Message contents (queries, tool arguments) go into spans only when
//! `OTEL_INSTRUMENTATION_GENAI_CAPTURE_MESSAGE_CONTENT=true` ([`capture_content`]).

use std::{
    sync::{
        Arc, OnceLock,
        atomic::{AtomicBool, Ordering},
    },
    time::Duration,
};

use opentelemetry::{
    propagation::{Extractor, Injector, TextMapPropagator},
    trace::TracerProvider as _,
};
use opentelemetry_sdk::{
    Resource,
    error::OTelSdkResult,
    propagation::TraceContextPropagator,
    trace::{SdkTracerProvider, SpanData, SpanExporter},
};
use tracing_opentelemetry::OpenTelemetrySpanExt;
use tracing_subscriber::{EnvFilter, Layer, fmt, prelude::*};

/// The log line format.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LogFormat {
    /// Human-readable lines.
    Text,
    /// One JSON object per line, for log collectors.
    Json,
}

impl LogFormat {
    /// Reads `LOG_FORMAT` (`text` or `json`, default `text`).
    pub fn from_env() -> Result<Self, String> {
        match std::env::var("LOG_FORMAT").as_deref() {
            Err(_) | Ok("" | "text") => Ok(Self::Text),
            Ok("json") => Ok(Self::Json),
            Ok(other) => Err(format!(
                "LOG_FORMAT must be `text` or `json`, not {other:?}"
            )),
        }
    }
}

static TRACING: AtomicBool = AtomicBool::new(false);
static CAPTURE_CONTENT: AtomicBool = AtomicBool::new(false);
static PROPAGATOR: OnceLock<TraceContextPropagator> = OnceLock::new();

/// Whether spans are exported, so that trace context is worth reading and writing.
pub fn tracing_enabled() -> bool {
    TRACING.load(Ordering::Relaxed)
}

/// Whether message contents (queries, tool arguments) may be recorded in spans.
pub fn capture_content() -> bool {
    CAPTURE_CONTENT.load(Ordering::Relaxed)
}

/// Flushes and stops trace export when dropped (or on [`Telemetry::shutdown`]).
#[must_use = "dropping it stops trace export"]
pub struct Telemetry {
    provider: Option<SdkTracerProvider>,
    runtime: Option<tokio::runtime::Runtime>,
}

impl Telemetry {
    /// Exports the spans still buffered and stops. Blocks for at most a few seconds; call
    /// it from outside the async runtime (e.g. `spawn_blocking`) or at the end of `main`.
    pub fn shutdown(mut self) {
        self.stop();
    }

    fn stop(&mut self) {
        if let Some(provider) = self.provider.take()
            && let Err(error) = provider.shutdown_with_timeout(Duration::from_secs(5))
        {
            eprintln!("trace export did not shut down cleanly: {error}");
        }
        if let Some(runtime) = self.runtime.take() {
            runtime.shutdown_background();
        }
    }
}

impl Drop for Telemetry {
    fn drop(&mut self) {
        self.stop();
    }
}

/// Installs the global subscriber: logs, and traces when OTLP is configured. Call once,
/// at the start of `main`; keep the returned guard until the end.
pub fn init(default_service_name: &'static str) -> Result<Telemetry, String> {
    let format = LogFormat::from_env()?;
    let filter = EnvFilter::try_from_default_env()
        // rmcp logs each MCP server's whole self-description at info on every connect.
        .or_else(|_| EnvFilter::try_new("info,rmcp=warn"))
        .map_err(|e| format!("invalid RUST_LOG: {e}"))?;
    CAPTURE_CONTENT.store(
        std::env::var("OTEL_INSTRUMENTATION_GENAI_CAPTURE_MESSAGE_CONTENT")
            .is_ok_and(|v| v.eq_ignore_ascii_case("true")),
        Ordering::Relaxed,
    );
    let (provider, runtime) = match otlp_endpoint_configured() {
        true => {
            let (provider, runtime) = tracer_provider(default_service_name)?;
            (Some(provider), Some(runtime))
        }
        false => (None, None),
    };
    let logs = match format {
        LogFormat::Text => fmt::layer()
            .with_writer(std::io::stderr)
            .with_ansi(false)
            .boxed(),
        LogFormat::Json => fmt::layer()
            .json()
            .flatten_event(true)
            .with_current_span(true)
            .with_writer(std::io::stderr)
            .boxed(),
    };
    let traces = provider.as_ref().map(|provider| {
        tracing_opentelemetry::layer()
            .with_tracer(provider.tracer(default_service_name))
            .with_tracked_inactivity(false)
    });
    tracing_subscriber::registry()
        .with(filter)
        .with(logs)
        .with(traces)
        .try_init()
        .map_err(|e| format!("cannot install the log subscriber: {e}"))?;
    TRACING.store(provider.is_some(), Ordering::Relaxed);
    if provider.is_some() {
        tracing::info!("exporting traces over OTLP");
    }
    Ok(Telemetry { provider, runtime })
}

fn otlp_endpoint_configured() -> bool {
    [
        "OTEL_EXPORTER_OTLP_ENDPOINT",
        "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT",
    ]
    .iter()
    .any(|name| std::env::var(name).is_ok_and(|v| !v.trim().is_empty()))
}

fn tracer_provider(
    default_service_name: &'static str,
) -> Result<(SdkTracerProvider, tokio::runtime::Runtime), String> {
    // The SDK's batch processor exports from a thread of its own, without a Tokio
    // reactor, which the gRPC exporter needs: exports run on a small runtime of their own,
    // which also keeps them off the request-serving threads.
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .thread_name("otlp-export")
        .enable_all()
        .build()
        .map_err(|e| format!("cannot start the trace export runtime: {e}"))?;
    let exporter = {
        let _context = runtime.enter();
        opentelemetry_otlp::SpanExporter::builder()
            .with_tonic()
            .build()
            .map_err(|e| format!("invalid OTLP exporter settings: {e}"))?
    };
    let exporter = OnRuntime {
        inner: Arc::new(exporter),
        runtime: runtime.handle().clone(),
    };
    let mut resource = Resource::builder();
    if std::env::var("OTEL_SERVICE_NAME").is_err() {
        resource = resource.with_service_name(default_service_name);
    }
    let provider = SdkTracerProvider::builder()
        .with_batch_exporter(exporter)
        .with_resource(resource.build())
        .build();
    Ok((provider, runtime))
}

/// A span exporter whose exports run on a given Tokio runtime.
#[derive(Debug)]
struct OnRuntime<E> {
    inner: Arc<E>,
    runtime: tokio::runtime::Handle,
}

impl<E: SpanExporter + 'static> SpanExporter for OnRuntime<E> {
    async fn export(&self, batch: Vec<SpanData>) -> OTelSdkResult {
        let inner = self.inner.clone();
        match self
            .runtime
            .spawn(async move { inner.export(batch).await })
            .await
        {
            Ok(result) => result,
            Err(error) => Err(opentelemetry_sdk::error::OTelSdkError::InternalFailure(
                format!("trace export task failed: {error}"),
            )),
        }
    }

    fn shutdown_with_timeout(&self, timeout: Duration) -> OTelSdkResult {
        self.inner.shutdown_with_timeout(timeout)
    }

    fn force_flush(&self) -> OTelSdkResult {
        self.inner.force_flush()
    }

    fn set_resource(&mut self, resource: &Resource) {
        // Called once, while building, before any export shares the exporter.
        if let Some(inner) = Arc::get_mut(&mut self.inner) {
            inner.set_resource(resource);
        }
    }
}

fn propagator() -> &'static TraceContextPropagator {
    PROPAGATOR.get_or_init(TraceContextPropagator::new)
}

struct HeaderExtractor<'a>(&'a http::HeaderMap);

impl Extractor for HeaderExtractor<'_> {
    fn get(&self, key: &str) -> Option<&str> {
        self.0.get(key).and_then(|v| v.to_str().ok())
    }

    fn keys(&self) -> Vec<&str> {
        self.0.keys().map(http::HeaderName::as_str).collect()
    }
}

struct HeaderInjector<'a>(&'a mut http::HeaderMap);

impl Injector for HeaderInjector<'_> {
    fn set(&mut self, key: &str, value: String) {
        if let (Ok(name), Ok(value)) = (
            http::HeaderName::from_bytes(key.as_bytes()),
            http::HeaderValue::from_str(&value),
        ) {
            self.0.insert(name, value);
        }
    }
}

/// Makes `span` a child of the trace context (`traceparent`, `tracestate`) in `headers`,
/// when there is one and traces are exported.
pub fn extract(span: &tracing::Span, headers: &http::HeaderMap) {
    if !tracing_enabled() || !headers.contains_key("traceparent") {
        return;
    }
    let parent = propagator().extract(&HeaderExtractor(headers));
    let _ = span.set_parent(parent);
}

/// Writes the trace context of the current span into `headers` (`traceparent`), when
/// traces are exported.
pub fn inject(headers: &mut http::HeaderMap) {
    if !tracing_enabled() {
        return;
    }
    let context = tracing::Span::current().context();
    propagator().inject_context(&context, &mut HeaderInjector(headers));
}
