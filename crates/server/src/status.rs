//! Building `tonic::Status` values with `google.rpc` rich details, so that every service
//! reports errors the same way.

use std::time::Duration;

use agentrt_core::Violation;
use tonic::{Code, Status};
use tonic_types::{ErrorDetails, FieldViolation, StatusExt};

/// The error domain of `google.rpc.ErrorInfo` details.
pub const ERROR_DOMAIN: &str = "agent.v1";

/// `INVALID_ARGUMENT` with one `BadRequest` field violation per problem. The message lists
/// them too, for clients that do not read details (e.g. grpcurl's default output).
pub fn invalid_argument(summary: &str, violations: &[Violation]) -> Status {
    let listed: Vec<String> = violations.iter().map(ToString::to_string).collect();
    let message = format!("{summary}: {}", listed.join("; "));
    let details = ErrorDetails::with_bad_request(
        violations
            .iter()
            .map(|v| FieldViolation::new(v.field.clone(), v.description.clone()))
            .collect::<Vec<_>>(),
    );
    Status::with_error_details(Code::InvalidArgument, message, details)
}

/// `NOT_FOUND` with an `ErrorInfo` naming the kind of thing and its id.
pub fn not_found(reason: &str, what: &str, id: &str) -> Status {
    let details =
        ErrorDetails::with_error_info(reason, ERROR_DOMAIN, [(what.to_owned(), id.to_owned())]);
    Status::with_error_details(Code::NotFound, format!("{what} {id:?} not found"), details)
}

/// `UNAVAILABLE` with an `ErrorInfo` and a `RetryInfo` telling when to try again.
pub fn unavailable(reason: &str, message: String, retry_after: Duration) -> Status {
    let mut details = ErrorDetails::with_error_info(reason, ERROR_DOMAIN, []);
    details.set_retry_info(Some(retry_after));
    Status::with_error_details(Code::Unavailable, message, details)
}

/// `RESOURCE_EXHAUSTED` with an `ErrorInfo` and a `RetryInfo` telling when to try again.
pub fn resource_exhausted(reason: &str, message: String, retry_after: Duration) -> Status {
    let mut details = ErrorDetails::with_error_info(reason, ERROR_DOMAIN, []);
    details.set_retry_info(Some(retry_after));
    Status::with_error_details(Code::ResourceExhausted, message, details)
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
