//! Errors of the stores that hold state which may outlive one process, and how they
//! tell whose a session is.

/// The principal that owns a session kept under `session_key`: the part before its `/`
/// (`PRINCIPAL/SESSION`); empty, the anonymous principal, for a key without one.
pub fn principal_of(session_key: &str) -> &str {
    session_key.split_once('/').map_or("", |(owner, _)| owner)
}

/// Why shared state could not be read or written.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum StateError {
    /// The store cannot be reached (Redis is down or unreachable); the same call may
    /// succeed later. The message names the store.
    #[error("{0}")]
    Unavailable(String),
    /// The store holds a value this version cannot read.
    #[error("stored {what} cannot be read: {detail}")]
    Corrupt {
        /// What was read.
        what: &'static str,
        /// Why it could not be.
        detail: String,
    },
    /// The run is no longer this owner's: its lease lapsed and another replica took it
    /// over. The writer stops its copy of the run.
    #[error("run {0:?} is now executed by another replica")]
    Fenced(String),
    /// Keeping this would take the store past a budget: nothing kept is dropped to make
    /// room, the new value is refused.
    #[error("{message} ({budget})")]
    OverBudget {
        /// The setting that sets the budget (`engines.max_bytes`, ...).
        budget: &'static str,
        /// What is full, and what to do.
        message: String,
    },
}

/// A store's result.
pub type StateResult<T> = Result<T, StateError>;
