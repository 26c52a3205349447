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
mod health;
mod listener;
pub mod metrics;
pub mod security;
pub mod trace;

pub use grpc::{GrpcServer, ServerError};

/// The largest `ListTools` answer: the tool executor's own catalogue, which its config
/// bounds (at most 1,000 tools a source), may outgrow `server.max_message_bytes`, the
/// bound on what a peer sends; past this one it is refused, naming it.
pub const MAX_CATALOGUE_BYTES: usize = 64 * 1024 * 1024;
pub mod status;

/// A `grpc-timeout` header's value: digits followed by a unit (H, M, S, m, u, n).
pub fn parse_grpc_timeout(value: &str) -> Option<std::time::Duration> {
    use std::time::Duration;
    let (digits, unit) = value.split_at(value.len().checked_sub(1)?);
    let amount: u64 = digits.parse().ok()?;
    Some(match unit {
        "H" => Duration::from_secs(amount.saturating_mul(3600)),
        "M" => Duration::from_secs(amount.saturating_mul(60)),
        "S" => Duration::from_secs(amount),
        "m" => Duration::from_millis(amount),
        "u" => Duration::from_micros(amount),
        "n" => Duration::from_nanos(amount),
        _ => return None,
    })
}

/// The service and method of a gRPC call's path (`/package.Service/Method`); `None` for
/// anything else.
pub(crate) fn grpc_route(path: &str) -> Option<(&str, &str)> {
    path.strip_prefix('/')?.split_once('/')
}
