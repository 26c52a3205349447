//! The agent server's errors and their one mapping to gRPC statuses.

use std::time::Duration;

use agentrt_core::{StateError, ToolServiceError, Violation};
use agentrt_events::BusError;

use crate::runs::RunStartError;
use agentrt_grpc::status;
use tonic::Status;

/// What can go wrong in a call to the agent server.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// The config has problems; every one is listed.
    #[error("invalid agent config")]
    InvalidConfig(Vec<Violation>),
    /// A request field other than the config is wrong.
    #[error("invalid request")]
    InvalidRequest(Vec<Violation>),
    /// No engine has this id (or it expired).
    #[error("engine {0:?} not found")]
    EngineNotFound(String),
    /// The tool executor could not be asked.
    #[error(transparent)]
    ToolService(#[from] ToolServiceError),
    /// The shared state could not be read or written.
    #[error(transparent)]
    State(#[from] StateError),
    /// A run's events could not be read.
    #[error(transparent)]
    Bus(#[from] BusError),
    /// No run has this id (or it expired).
    #[error("run {0:?} not found")]
    RunNotFound(String),
    /// The run is known, but its events are no longer kept.
    #[error(
        "the events of run {0:?} are no longer retained (runs.retained_events); GetRun returns how it ended"
    )]
    EventsExpired(String),
    /// An answer would be larger than a client may be sent.
    #[error(
        "the answer would be {bytes} bytes, more than server.max_message_bytes ({max}); nothing was done"
    )]
    AnswerTooLarge {
        /// Its size, encoded.
        bytes: usize,
        /// The limit.
        max: usize,
    },
    /// A reader of the run asked for, or fell behind to, events its log no longer keeps.
    #[error(
        "events {from} to {to} of run {run_id:?} are no longer retained (runs.events_per_run); resume with Subscribe after {to}"
    )]
    EventsLagged {
        /// The run.
        run_id: String,
        /// First event lost.
        from: u64,
        /// Last event lost.
        to: u64,
    },
    /// A stream's run went on on another replica while the stream read this one's copy
    /// of its events.
    #[error(
        "run {run_id:?} is now executed by another replica; resume with Subscribe after sequence {after}"
    )]
    RunMoved {
        /// The run streamed.
        run_id: String,
        /// The last event the client was sent.
        after: u64,
    },
    /// A run could not start.
    #[error(transparent)]
    RunStart(#[from] crate::runs::RunStartError),
    /// The run does not wait for tool outputs or approvals.
    #[error("run {run_id:?} is not waiting for tool outputs or approvals (it is {status})")]
    RunNotWaiting {
        /// The run.
        run_id: String,
        /// What it is doing instead, or how it ended.
        status: String,
    },
    /// The run waits, but not for this call.
    #[error("run {run_id:?} is not waiting for tool call {call_id:?} (it waits for: {waiting})")]
    CallNotPending {
        /// The run.
        run_id: String,
        /// The call.
        call_id: String,
        /// The calls it waits for.
        waiting: String,
    },
    /// The call was answered already, otherwise.
    #[error(
        "tool call {call_id:?} of run {run_id:?} was answered already, with another answer; the first answer stands"
    )]
    AnsweredOtherwise {
        /// The run.
        run_id: String,
        /// The call.
        call_id: String,
    },
    /// The call waits for the other kind of answer.
    #[error("tool call {call_id:?} of run {run_id:?} waits for {wanted}; answer it with {rpc}")]
    WrongAnswer {
        /// The run.
        run_id: String,
        /// The call.
        call_id: String,
        /// What it waits for.
        wanted: &'static str,
        /// The RPC that answers it.
        rpc: &'static str,
    },
    /// This replica shuts down and hands its runs over: a stream it served resumes on
    /// another one.
    #[error(
        "this replica is shutting down; resume run {run_id:?} with Subscribe after sequence {after} on another replica"
    )]
    ShuttingDown {
        /// The run streamed.
        run_id: String,
        /// The last event the client was sent.
        after: u64,
    },
}

/// A `Result` with this crate's [`Error`].
pub type Result<T> = std::result::Result<T, Error>;

impl From<Error> for Status {
    fn from(error: Error) -> Self {
        match error {
            Error::InvalidConfig(violations) => {
                status::invalid_argument("invalid agent config", &violations)
            }
            error @ Error::AnswerTooLarge { .. } => {
                status::resource_exhausted_for_good("MESSAGE_TOO_LARGE", error.to_string())
            }
            Error::InvalidRequest(violations) => {
                status::invalid_argument("invalid request", &violations)
            }
            Error::EngineNotFound(id) => status::not_found_because(
                "ENGINE_NOT_FOUND",
                "engine",
                &id,
                "an engine is kept for engines.ttl after its last use, and with state in \
                 memory a restart of the server loses it; create it again",
            ),
            Error::ToolService(e @ ToolServiceError::Unavailable { .. }) => status::unavailable(
                "TOOL_EXECUTOR_UNAVAILABLE",
                format!("cannot check the config's tools: {e}"),
                Duration::from_secs(1),
            ),
            Error::ToolService(e @ ToolServiceError::Misconfigured { .. }) => {
                status::misconfigured(
                    "TOOL_EXECUTOR_MISCONFIGURED",
                    format!("cannot check the config's tools: {e}"),
                )
            }
            // Said without the store's address and the system's error, which are the
            // operator's (and logged), not every client's.
            Error::State(StateError::Unavailable(message))
            | Error::Bus(BusError::Unavailable(message)) => {
                tracing::debug!(%message, "a call failed: the shared state is unavailable");
                status::unavailable(
                    "STATE_UNAVAILABLE",
                    "Redis, where this server keeps its state, cannot be reached; retry \
                     shortly (the server's log says why)"
                        .into(),
                    Duration::from_secs(1),
                )
            }
            Error::State(error @ StateError::Corrupt { .. }) => {
                status::internal("STATE_CORRUPT", error.to_string())
            }
            Error::State(error @ StateError::OverBudget { .. }) => status::resource_exhausted(
                "BUDGET_EXCEEDED",
                error.to_string(),
                Duration::from_secs(1),
            ),
            // The run goes on on another replica: the client resumes there.
            Error::State(error @ StateError::Fenced(_)) => {
                status::unavailable("RUN_MOVED", error.to_string(), Duration::from_millis(100))
            }
            Error::Bus(error @ (BusError::Fenced(_) | BusError::Moved { .. })) => {
                status::unavailable("RUN_MOVED", error.to_string(), Duration::from_millis(100))
            }
            Error::RunNotFound(id) | Error::Bus(BusError::UnknownRun(id)) => {
                status::not_found("RUN_NOT_FOUND", "run", &id)
            }
            // `resume_after`: the last event lost, where a `Subscribe` goes on from (one
            // from the reader's own cursor would be refused again).
            Error::Bus(error @ BusError::Lagged { to, .. }) => status::out_of_range(
                "EVENTS_LAGGED",
                error.to_string(),
                &[
                    ("resume_after", &to.to_string()),
                    ("after_sequence", &to.to_string()),
                ],
            ),
            // `after_sequence` as every status a stream resumes from has it; `resume_after`
            // too, as the first clients read it.
            Error::EventsLagged { ref run_id, to, .. } => status::out_of_range(
                "EVENTS_LAGGED",
                error.to_string(),
                &[
                    ("run", run_id),
                    ("resume_after", &to.to_string()),
                    ("after_sequence", &to.to_string()),
                ],
            ),
            Error::RunMoved { ref run_id, after } => status::unavailable_about(
                "RUN_MOVED",
                error.to_string(),
                Duration::from_millis(100),
                &[("run", run_id), ("after_sequence", &after.to_string())],
            ),
            Error::Bus(error @ BusError::DuplicateRun(_)) => {
                status::internal("DUPLICATE_RUN", error.to_string())
            }
            Error::EventsExpired(ref run_id) => {
                status::out_of_range("EVENTS_EXPIRED", error.to_string(), &[("run", run_id)])
            }
            error @ Error::RunNotWaiting { .. } => {
                status::failed_precondition("RUN_NOT_WAITING", error.to_string())
            }
            error @ Error::CallNotPending { .. } => {
                status::failed_precondition("TOOL_CALL_NOT_PENDING", error.to_string())
            }
            error @ Error::AnsweredOtherwise { .. } => {
                status::failed_precondition("TOOL_CALL_ANSWERED", error.to_string())
            }
            error @ Error::WrongAnswer { .. } => {
                status::failed_precondition("WRONG_ANSWER_KIND", error.to_string())
            }
            Error::ShuttingDown { ref run_id, after } => status::unavailable_about(
                "REPLICA_SHUTTING_DOWN",
                error.to_string(),
                Duration::from_millis(100),
                &[("run", run_id), ("after_sequence", &after.to_string())],
            ),
            Error::RunStart(error) => match error {
                RunStartError::Busy(active) => status::resource_exhausted(
                    "TOO_MANY_RUNS",
                    format!("this server already runs {active} runs; retry later"),
                    Duration::from_secs(1),
                ),
                error @ RunStartError::OverBudget { .. } => status::resource_exhausted(
                    "BUDGET_EXCEEDED",
                    error.to_string(),
                    Duration::from_secs(1),
                ),
                RunStartError::Bus(error) => Error::Bus(error).into(),
                RunStartError::State(error) => Error::State(error).into(),
                RunStartError::Failed(error) => {
                    status::unavailable(&error.code, error.message, Duration::from_secs(1))
                }
                error @ RunStartError::MessageIdReused { .. } => {
                    status::already_exists("MESSAGE_ID_REUSED", error.to_string())
                }
            },
        }
    }
}
