//! The SDK's errors in words, for the messages clients read (`UNAVAILABLE` reasons, error
//! results). Its own messages name its Rust types (`Transport [rmcp::transport::worker::
//! WorkerTransport<...>] error`), print values with `Debug`, or say little (`Unexpected
//! response type`); these say what the server did.

use std::error::Error as StdError;

use rmcp::{
    service::{ClientInitializeError, QuitReason, ServiceError},
    transport::streamable_http_client::{HttpStatusError, StreamableHttpError},
};

use crate::http::{innermost, quoted, request_error};

/// Why a request failed, as a clause about the server: "it answered HTTP 502".
pub(super) fn service_error(error: &ServiceError) -> String {
    match error {
        ServiceError::McpError(error) => format!(
            "it answered with an error: {} (code {})",
            quoted(&error.message),
            error.code.0
        ),
        ServiceError::TransportSend(error) => transport_error(error.error.as_ref()),
        ServiceError::TransportClosed => "the connection closed".into(),
        ServiceError::UnexpectedResponse => {
            "it answered with something other than the result asked for".into()
        }
        ServiceError::Cancelled { .. } => "the request was cancelled".into(),
        ServiceError::Timeout { timeout } => format!("it did not answer within {timeout:?}"),
        ServiceError::InputRequiredRoundsExceeded { max_rounds } => {
            format!("it asked for more input {max_rounds} times in a row")
        }
        ServiceError::SubscriptionLagged { .. } => {
            "the client fell behind the server's messages".into()
        }
        _ => "the request failed".into(),
    }
}

/// Why `initialize` failed, as a clause about the server.
pub(super) fn init_error(error: &ClientInitializeError) -> String {
    match error {
        ClientInitializeError::TransportError { error, .. } => {
            transport_error(error.error.as_ref())
        }
        ClientInitializeError::ConnectionClosed(_) => {
            "the connection closed before it answered `initialize`".into()
        }
        ClientInitializeError::JsonRpcError(error) => format!(
            "it refused `initialize`: {} (code {})",
            quoted(&error.message),
            error.code.0
        ),
        ClientInitializeError::NoCompatibleProtocolVersion {
            server_supported, ..
        } => {
            let versions: Vec<&str> = server_supported.iter().map(|v| v.as_str()).collect();
            format!(
                "it speaks no MCP version the tool executor does (it offers {})",
                quoted(&versions.join(", "))
            )
        }
        ClientInitializeError::Cancelled => "`initialize` was cancelled".into(),
        ClientInitializeError::LegacyFallbackFailed { fallback, .. } => init_error(fallback),
        _ => "it did not answer `initialize` as the protocol says".into(),
    }
}

/// Why a connection ended, as a clause.
pub(super) fn quit_reason(quit: &Result<QuitReason, tokio::task::JoinError>) -> String {
    match quit {
        Ok(QuitReason::Closed) => "the connection closed".into(),
        Ok(QuitReason::Cancelled) => "the connection was closed by the tool executor".into(),
        _ => "the connection's task failed".into(),
    }
}

/// What a transport's error says, as a clause; the first error in the chain this knows
/// decides.
pub(super) fn transport_error(error: &(dyn StdError + Send + Sync + 'static)) -> String {
    let mut current: Option<&(dyn StdError + 'static)> = Some(error);
    while let Some(error) = current {
        if let Some(error) = error.downcast_ref::<StreamableHttpError<reqwest::Error>>() {
            return http_error(error);
        }
        if let Some(status) = error.downcast_ref::<HttpStatusError>() {
            return format!("it answered HTTP {}", status.status);
        }
        if let Some(error) = error.downcast_ref::<reqwest::Error>() {
            return request_error(error);
        }
        if let Some(error) = error.downcast_ref::<std::io::Error>() {
            return format!("the connection failed ({error})");
        }
        current = error.source();
    }
    format!("the connection failed ({})", quoted(&innermost(error)))
}

/// What a request's failure to go through says of the connection it went on.
#[derive(Debug, PartialEq, Eq)]
pub(super) enum SendFailure {
    /// The server, or a proxy in front of it, answered this request alone with an error
    /// (an HTTP status, a body that is not MCP, an answer over `max_message_bytes`): the
    /// session goes on, and the other calls on it with it.
    Answered {
        /// What it answered, as a clause.
        why: String,
        /// Whether it is a refusal to serve for now (see [`Refusal`]) rather than an
        /// answer to the call.
        refusal: Option<Refusal>,
    },
    /// The request never reached the server: it cannot be reached (nothing ran).
    Unreached(String),
    /// The connection failed under the request (it may have run).
    Connection,
}

/// A refusal to serve a request for now: HTTP 429 or 503 (nothing ran), or a proxy's 502
/// or 504 (the server behind it may have run the call, or may not be there).
#[derive(Debug, PartialEq, Eq)]
pub(super) struct Refusal {
    /// Whether the call may have run.
    pub(super) sent: bool,
    /// Whether the server is there, busy (429): it answers, and its session is kept.
    pub(super) busy: bool,
    /// The `Retry-After` it gave, in seconds.
    pub(super) retry_after: Option<u64>,
}

/// Sorts a transport's error by what it says of the connection; anything it does not
/// know is taken as the connection's failure.
pub(super) fn send_failure(error: &(dyn StdError + Send + Sync + 'static)) -> SendFailure {
    let mut current: Option<&(dyn StdError + 'static)> = Some(error);
    while let Some(error) = current {
        if let Some(http) = error.downcast_ref::<StreamableHttpError<reqwest::Error>>() {
            return match http {
                StreamableHttpError::HttpStatus(status) => answered_status(status),
                StreamableHttpError::UnexpectedServerResponse(_)
                | StreamableHttpError::UnexpectedContentType(_)
                | StreamableHttpError::ResponseBodyTooLarge { .. }
                | StreamableHttpError::InsufficientScope(_) => SendFailure::Answered {
                    why: http_error(http),
                    refusal: None,
                },
                StreamableHttpError::Client(client) if client.is_connect() => {
                    SendFailure::Unreached(request_error(client))
                }
                _ => SendFailure::Connection,
            };
        }
        if let Some(status) = error.downcast_ref::<HttpStatusError>() {
            return answered_status(status);
        }
        if let Some(client) = error.downcast_ref::<reqwest::Error>() {
            return if client.is_connect() {
                SendFailure::Unreached(request_error(client))
            } else {
                SendFailure::Connection
            };
        }
        current = error.source();
    }
    SendFailure::Connection
}

fn answered_status(status: &HttpStatusError) -> SendFailure {
    let refusal = matches!(status.status, 429 | 502..=504).then(|| Refusal {
        sent: matches!(status.status, 502 | 504),
        busy: status.status == 429,
        retry_after: status
            .retry_after
            .as_deref()
            .and_then(|after| after.trim().parse::<u64>().ok()),
    });
    SendFailure::Answered {
        why: format!("it answered HTTP {}", status.status),
        refusal,
    }
}

fn http_error(error: &StreamableHttpError<reqwest::Error>) -> String {
    match error {
        StreamableHttpError::HttpStatus(status) => format!("it answered HTTP {}", status.status),
        StreamableHttpError::Client(error) => request_error(error),
        StreamableHttpError::SessionExpired => "it no longer knows the session".into(),
        StreamableHttpError::UnexpectedServerResponse(text) => {
            format!("it answered unexpectedly: {}", quoted(text))
        }
        StreamableHttpError::UnexpectedContentType(kind) => format!(
            "it answered with content type {}, neither JSON nor an event stream",
            quoted(kind.as_deref().unwrap_or("(none)"))
        ),
        StreamableHttpError::ResponseBodyTooLarge { max_size } => {
            format!("its answer was larger than `max_message_bytes` ({max_size} bytes)")
        }
        StreamableHttpError::AuthRequired(_) => "it asks for authorization (HTTP 401)".into(),
        StreamableHttpError::InsufficientScope(_) => {
            "it refused the credentials it was sent (HTTP 403)".into()
        }
        StreamableHttpError::UnexpectedEndOfStream | StreamableHttpError::Sse(_) => {
            "its event stream broke off".into()
        }
        StreamableHttpError::Io(error) => format!("the connection failed ({error})"),
        StreamableHttpError::TransportChannelClosed => "the connection closed".into(),
        StreamableHttpError::MissingSessionIdInResponse => "it did not give a session id".into(),
        StreamableHttpError::SessionRecoveryTimeout => {
            "it did not make a new session in time".into()
        }
        StreamableHttpError::ReinitializationFailed(error) => format!(
            "it refused a new session: {} (code {})",
            quoted(&error.message),
            error.code.0
        ),
        StreamableHttpError::ReservedHeaderConflict(name) => format!(
            "header {} is the protocol's own and cannot be set in `headers`",
            quoted(name)
        ),
        StreamableHttpError::Deserialize(_) => "its answer is not valid JSON-RPC".into(),
        _ => format!("the request failed ({})", quoted(&innermost(error))),
    }
}

#[cfg(test)]
mod tests {
    use std::any::TypeId;

    use rmcp::transport::DynamicTransportError;

    use super::*;

    fn sent(error: StreamableHttpError<reqwest::Error>) -> ServiceError {
        ServiceError::TransportSend(DynamicTransportError::from_parts(
            "rmcp::transport::worker::WorkerTransport<X>",
            TypeId::of::<()>(),
            Box::new(error),
        ))
    }

    #[test]
    fn transport_errors_say_what_the_server_did_without_rust_types() {
        let bad_gateway = sent(StreamableHttpError::HttpStatus(HttpStatusError::new(
            502, None,
        )));
        assert_eq!(service_error(&bad_gateway), "it answered HTTP 502");
        let expired = sent(StreamableHttpError::SessionExpired);
        assert_eq!(service_error(&expired), "it no longer knows the session");
        let unexpected = sent(StreamableHttpError::UnexpectedServerResponse(
            format!("HTTP 400 Bad Request: <html>\n{}</html>", "x".repeat(500)).into(),
        ));
        let said = service_error(&unexpected);
        assert!(
            said.starts_with("it answered unexpectedly: HTTP 400 Bad Request: <html> xxx"),
            "{said}"
        );
        assert!(said.len() < 250, "{said}");
        let io = ServiceError::TransportSend(DynamicTransportError::from_parts(
            "rmcp::transport::async_rw::AsyncRwTransport",
            TypeId::of::<()>(),
            Box::new(std::io::Error::from(std::io::ErrorKind::BrokenPipe)),
        ));
        assert_eq!(service_error(&io), "the connection failed (broken pipe)");
        for error in [&bad_gateway, &expired, &unexpected, &io] {
            let said = service_error(error);
            assert!(
                !said.contains("rmcp") && !said.contains("Transport"),
                "{said}"
            );
        }
        assert_eq!(
            service_error(&ServiceError::UnexpectedResponse),
            "it answered with something other than the result asked for"
        );
    }
}
