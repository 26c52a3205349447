//! Building `tonic::Status` values with `google.rpc` rich details, so that every service
//! reports errors the same way.

use std::time::Duration;

use agentrt_core::Violation;
use tonic::{Code, Status};
use tonic_types::{ErrorDetails, FieldViolation, StatusExt};

/// The error domain of `google.rpc.ErrorInfo` details.
pub const ERROR_DOMAIN: &str = "agent.v1";

/// Violations a status names in its message; the rest are counted.
const LISTED_IN_MESSAGE: usize = 5;
/// Bytes of `BadRequest` details a status carries (about 5.5 KB once base64-encoded in
/// the trailers, with room for the message under the 8 KiB of metadata gRPC's C core
/// accepts by default): every violation while they fit (dozens of usual ones), the rest
/// counted in the message and in an `ErrorInfo` (`VIOLATIONS_LEFT_OUT`).
const DETAILS_BYTES: usize = 4096;
/// Longest status message, in bytes. Statuses travel in HTTP/2 headers, which clients
/// commonly limit to 16 KiB in all (and `grpc-message` percent-encodes non-ASCII text,
/// tripling it): a status copying a client's input unbounded would reach the client as
/// `RESOURCE_EXHAUSTED` instead of the error it describes.
const MESSAGE_BYTES: usize = 1024;
/// Longest field path and description in the details, in bytes.
const FIELD_BYTES: usize = 128;
const DESCRIPTION_BYTES: usize = 300;
/// Longest id echoed back in a status.
const ID_BYTES: usize = 128;

/// `text` cut to at most `max` bytes at a character boundary, marked with `…` when cut.
pub fn bounded(text: &str, max: usize) -> std::borrow::Cow<'_, str> {
    if text.len() <= max {
        return text.into();
    }
    let mut cut = max.saturating_sub('…'.len_utf8());
    while !text.is_char_boundary(cut) {
        cut -= 1;
    }
    format!("{}…", &text[..cut]).into()
}

/// `INVALID_ARGUMENT` with one `BadRequest` field violation per problem. The message lists
/// them too, for clients that do not read details (e.g. grpcurl's default output). Both
/// are bounded: the first violations are named and the others counted; the details carry
/// every one that fits [`DETAILS_BYTES`], and say how many are left out when some are.
pub fn invalid_argument(summary: &str, violations: &[Violation]) -> Status {
    let listed: Vec<String> = violations
        .iter()
        .take(LISTED_IN_MESSAGE)
        .map(|v| bounded(&v.to_string(), MESSAGE_BYTES / LISTED_IN_MESSAGE).into_owned())
        .collect();
    let mut message = format!("{summary}: {}", listed.join("; "));
    if violations.len() > LISTED_IN_MESSAGE {
        message.push_str(&format!(
            "; and {} more",
            violations.len() - LISTED_IN_MESSAGE
        ));
    }
    let mut size = 0;
    let carried: Vec<FieldViolation> = violations
        .iter()
        .map(|v| {
            FieldViolation::new(
                bounded(&v.field, FIELD_BYTES),
                bounded(&v.description, DESCRIPTION_BYTES),
            )
        })
        .take_while(|v| {
            // A violation's encoded size: its two strings, their tags and lengths, and
            // its own.
            size += v.field.len() + v.description.len() + 8;
            size <= DETAILS_BYTES
        })
        .collect();
    let left_out = violations.len() - carried.len();
    let mut details = ErrorDetails::with_bad_request(carried);
    if left_out > 0 {
        details.set_error_info(
            "VIOLATIONS_LEFT_OUT",
            ERROR_DOMAIN,
            [
                (
                    "listed".to_owned(),
                    (violations.len() - left_out).to_string(),
                ),
                ("total".to_owned(), violations.len().to_string()),
            ],
        );
    }
    let message = bounded(&message, MESSAGE_BYTES + 64).into_owned();
    Status::with_error_details(Code::InvalidArgument, message, details)
}

/// `NOT_FOUND` with an `ErrorInfo` naming the kind of thing and its id.
pub fn not_found(reason: &str, what: &str, id: &str) -> Status {
    not_found_because(reason, what, id, "")
}

/// [`not_found`], its message going on with `hint` (what may have become of it, what to
/// do) unless that is empty.
pub fn not_found_because(reason: &str, what: &str, id: &str, hint: &str) -> Status {
    let id = bounded(id, ID_BYTES);
    let details =
        ErrorDetails::with_error_info(reason, ERROR_DOMAIN, [(what.to_owned(), id.to_string())]);
    let message = if hint.is_empty() {
        format!("{what} {id:?} not found")
    } else {
        format!("{what} {id:?} not found: {hint}")
    };
    Status::with_error_details(Code::NotFound, message, details)
}

/// A status with `details` and `message`, bounded: messages often quote what a client
/// sent (an id, a name).
fn with_details(code: Code, message: String, details: ErrorDetails) -> Status {
    let message = match bounded(&message, MESSAGE_BYTES + 64) {
        std::borrow::Cow::Borrowed(_) => message,
        std::borrow::Cow::Owned(cut) => cut,
    };
    Status::with_error_details(code, message, details)
}

/// `FAILED_PRECONDITION` with an `ErrorInfo` naming the reason.
pub fn failed_precondition(reason: &str, message: String) -> Status {
    let details = ErrorDetails::with_error_info(reason, ERROR_DOMAIN, []);
    with_details(Code::FailedPrecondition, message, details)
}

/// `INTERNAL` with an `ErrorInfo` naming the reason: the server cannot serve the request
/// as it is set up, and no retry helps until an operator changes what the message names.
pub fn misconfigured(reason: &str, message: String) -> Status {
    let details = ErrorDetails::with_error_info(reason, ERROR_DOMAIN, []);
    with_details(Code::Internal, message, details)
}

/// `ALREADY_EXISTS` with an `ErrorInfo` naming the reason.
pub fn already_exists(reason: &str, message: String) -> Status {
    let details = ErrorDetails::with_error_info(reason, ERROR_DOMAIN, []);
    with_details(Code::AlreadyExists, message, details)
}

/// `OUT_OF_RANGE` with an `ErrorInfo` naming the reason, with `metadata` (what is out of
/// range, and where to go on from: each value bounded).
pub fn out_of_range(reason: &str, message: String, metadata: &[(&str, &str)]) -> Status {
    let details = ErrorDetails::with_error_info(
        reason,
        ERROR_DOMAIN,
        metadata
            .iter()
            .map(|(what, value)| ((*what).to_owned(), bounded(value, ID_BYTES).to_string()))
            .collect::<std::collections::HashMap<_, _>>(),
    );
    with_details(Code::OutOfRange, message, details)
}

/// `INTERNAL` with an `ErrorInfo`: what no client did wrong and no retry mends (state
/// that cannot be read, a broken invariant).
pub fn internal(reason: &str, message: String) -> Status {
    let details = ErrorDetails::with_error_info(
        reason,
        ERROR_DOMAIN,
        std::collections::HashMap::<String, String>::new(),
    );
    with_details(Code::Internal, message, details)
}

/// `UNAVAILABLE` with an `ErrorInfo` and a `RetryInfo` telling when to try again.
pub fn unavailable(reason: &str, message: String, retry_after: Duration) -> Status {
    unavailable_about(reason, message, retry_after, &[])
}

/// [`unavailable`], with `ErrorInfo` metadata naming what is unavailable (`("tool",
/// name)`, ...; each value bounded as ids are).
pub fn unavailable_about(
    reason: &str,
    message: String,
    retry_after: Duration,
    about: &[(&str, &str)],
) -> Status {
    let metadata: std::collections::HashMap<String, String> = about
        .iter()
        .map(|(what, id)| ((*what).to_owned(), bounded(id, ID_BYTES).to_string()))
        .collect();
    let mut details = ErrorDetails::with_error_info(reason, ERROR_DOMAIN, metadata);
    details.set_retry_info(Some(retry_after));
    with_details(Code::Unavailable, message, details)
}

/// `RESOURCE_EXHAUSTED` with an `ErrorInfo`, for what no retry changes (a limit of the
/// server's that the request goes past).
pub fn resource_exhausted_for_good(reason: &str, message: String) -> Status {
    let details = ErrorDetails::with_error_info(reason, ERROR_DOMAIN, []);
    with_details(Code::ResourceExhausted, message, details)
}

/// `RESOURCE_EXHAUSTED` with an `ErrorInfo` and a `RetryInfo` telling when to try again.
pub fn resource_exhausted(reason: &str, message: String, retry_after: Duration) -> Status {
    let mut details = ErrorDetails::with_error_info(reason, ERROR_DOMAIN, []);
    details.set_retry_info(Some(retry_after));
    with_details(Code::ResourceExhausted, message, details)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn invalid_argument_carries_every_violation() {
        let status = invalid_argument(
            "invalid config",
            &[
                Violation::new("name", "required"),
                Violation::new("tools[0].name", "unknown"),
            ],
        );
        assert_eq!(status.code(), Code::InvalidArgument);
        assert!(
            status
                .message()
                .contains("name: required; tools[0].name: unknown")
        );
        let bad_request = status.get_details_bad_request().unwrap();
        let fields: Vec<_> = bad_request
            .field_violations
            .iter()
            .map(|v| v.field.as_str())
            .collect();
        assert_eq!(fields, ["name", "tools[0].name"]);
        assert!(status.get_details_error_info().is_none());
    }

    #[test]
    fn the_details_carry_every_usual_violation() {
        let violations: Vec<Violation> = (0..40)
            .map(|i| {
                Violation::new(
                    format!("tools[{i}].name"),
                    "not offered by the tool executor",
                )
            })
            .collect();
        let status = invalid_argument("invalid agent config", &violations);
        let bad_request = status.get_details_bad_request().unwrap();
        assert_eq!(bad_request.field_violations.len(), 40);
        assert_eq!(bad_request.field_violations[39].field, "tools[39].name");
        assert!(status.get_details_error_info().is_none());
        assert!(status.details().len() <= 6 * 1024);
    }

    #[test]
    fn statuses_stay_small_whatever_the_input() {
        let violations: Vec<Violation> = (0..40)
            .map(|i| {
                Violation::new(
                    format!("tools[{i}].name"),
                    format!("tool {:?} is not offered", "é".repeat(5000)),
                )
            })
            .collect();
        let status = invalid_argument("invalid agent config", &violations);
        assert!(status.message().len() <= 2048, "{}", status.message().len());
        assert!(status.message().contains("tools[0].name"));
        assert!(
            status.message().ends_with("and 35 more"),
            "{}",
            status.message()
        );
        assert!(
            status.details().len() <= 6 * 1024,
            "{}",
            status.details().len()
        );
        let bad_request = status.get_details_bad_request().unwrap();
        let carried = bad_request.field_violations.len();
        assert!((8..40).contains(&carried), "{carried}");
        assert!(bad_request.field_violations[0].description.ends_with('…'));
        let left_out = status.get_details_error_info().unwrap();
        assert_eq!(left_out.reason, "VIOLATIONS_LEFT_OUT");
        assert_eq!(left_out.metadata["listed"], carried.to_string());
        assert_eq!(left_out.metadata["total"], "40");
        let status = not_found("RUN_NOT_FOUND", "run", &"x".repeat(100_000));
        assert!(status.message().len() < 200);
        // A message quoting a client's id, whatever its length.
        let message = format!("run is not waiting for call {:?}", "é".repeat(50_000));
        let status = failed_precondition("TOOL_CALL_NOT_PENDING", message);
        assert!(
            status.message().len() <= MESSAGE_BYTES + 64,
            "{}",
            status.message().len()
        );
        assert!(status.message().ends_with('…'));
        assert_eq!(
            status.get_details_error_info().unwrap().reason,
            "TOOL_CALL_NOT_PENDING"
        );
    }

    #[test]
    fn unavailable_says_when_to_retry() {
        let status = unavailable("X", "down".into(), Duration::from_secs(2));
        assert_eq!(status.code(), Code::Unavailable);
        assert_eq!(
            status.get_details_retry_info().unwrap().retry_delay,
            Some(Duration::from_secs(2))
        );
        assert_eq!(status.get_details_error_info().unwrap().reason, "X");
    }
}
