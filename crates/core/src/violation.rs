use std::fmt;

/// One problem with one field of a request, reported to clients as a
/// `google.rpc.BadRequest.FieldViolation` or a `ConfigViolation`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Violation {
    /// Path of the field in the request, e.g. `tools[1].name` or `arguments.expression`.
    pub field: String,
    /// What is wrong and what is accepted.
    pub description: String,
}

impl Violation {
    /// A violation of `field`.
    pub fn new(field: impl Into<String>, description: impl Into<String>) -> Self {
        Self {
            field: field.into(),
            description: description.into(),
        }
    }
}

impl fmt::Display for Violation {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}: {}", self.field, self.description)
    }
}
