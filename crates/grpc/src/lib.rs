//! The gRPC serving plumbing both services share.
//!
//! - [`config`]: layered settings (defaults, file, environment, flags) and durations.
//! - [`shutdown`]: the drain signal (SIGTERM/SIGINT; a second one exits at once).
//! - [`GrpcServer`]: health, reflection v1 and v1alpha, limits, and a drain with a grace
//!   period around the services a binary registers.
//! - [`metrics`]: per-call gRPC metrics and the Prometheus endpoint.
//! - [`security`]: TLS settings and bearer-token authentication.
//! - [`trace`]: a span per call, joined to the caller's trace.

pub mod config;
pub mod shutdown;

mod grpc;
mod listener;
pub mod metrics;
pub mod security;
pub mod trace;

pub use grpc::{GrpcServer, ServerError};
pub mod status;

/// The service and method of a gRPC call's path (`/package.Service/Method`); `None` for
/// anything else.
pub(crate) fn grpc_route(path: &str) -> Option<(&str, &str)> {
    path.strip_prefix('/')?.split_once('/')
}
