//! The state of agent-server that may outlive one process: engines, session histories,
//! run records with their idempotency keys and stop requests, and (through
//! `agentrt-events`) run event logs.
//!
//! Every store is an `async` trait returning `Result`, over serializable domain types.
//! The in-memory stores are the embedded default and the test double; the Redis stores
//! ([`redis::Redis`]) let any number of replicas share one state. Both pass the same
//! conformance suites (`agentrt-test-support`).

mod engines;
mod record;
pub mod redis;
mod runs;

pub use agentrt_context::{Exchange, InMemorySessionStore, SessionLimits, SessionStore};
pub use agentrt_core::{StateError, StateResult};
pub use agentrt_events::{Action, BusError, BusLimits, EventBus, InMemoryBus, PendingCall};
pub use engines::{EngineBudgets, EngineStore, MemoryEngineStore, StoredEngine, principal_of};
pub use record::{
    RunError, RunRecord, RunStatus, StepRecord, StopReason, TokenUsage, ToolCallRecord,
};
pub use runs::{
    Answered, Answers, CheckpointError, Claim, LAPSED_WAITS_SCAN, Lease, LeaseRenewer,
    MemoryRunStore, Progress, Resumable, RunRetention, RunStore, StopRequest, StopRequests,
    agent_id, checkpoint_apart, end_apart,
};
