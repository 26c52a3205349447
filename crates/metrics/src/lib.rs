//! The process's Prometheus metrics, in one registry that every crate records into and the
//! server's admin endpoint encodes (`GET /metrics`, OpenMetrics text, which Prometheus reads).
//!
//! Labels stay bounded, whatever clients send: gRPC services and methods are only those
//! the server registered (anything else is `unknown`), status codes, stop reasons and
//! outcomes are fixed sets, and model and tool names, which clients and models choose,
//! keep at most [`MAX_NAME_LABELS`] distinct values each (later ones count as `other`). A
//! model name takes one of those values only once a provider has answered a call of it, so
//! that calls of made-up model names, which fail, cannot use them up for everyone.
//!
//! A process says which server it is ([`Metrics::serve_as`]) and exposes that server's
//! metrics only: the tool executor has no runs, models or event bus to report.

use std::{
    collections::HashSet,
    sync::{LazyLock, Mutex, OnceLock, PoisonError},
    time::{Duration, Instant},
};

use prometheus_client::{
    encoding::text::encode,
    metrics::{
        counter::Counter,
        family::Family,
        gauge::Gauge,
        histogram::{Histogram, exponential_buckets},
    },
    registry::Registry,
};

type Labels<const N: usize> = [(&'static str, String); N];

/// Distinct values a label that clients or models choose (a model name, a tool name)
/// takes at most; later values are recorded as `other`.
pub const MAX_NAME_LABELS: usize = 100;

/// The value recorded for a label beyond [`MAX_NAME_LABELS`].
pub const OTHER: &str = "other";

/// The values one label has taken, up to a bound.
#[derive(Default)]
struct BoundedLabel(Mutex<HashSet<String>>);

impl BoundedLabel {
    /// `value` if it is known or there is room for it, else [`OTHER`].
    fn value(&self, value: &str) -> String {
        let mut seen = self.0.lock().unwrap_or_else(PoisonError::into_inner);
        if seen.contains(value) {
            return value.to_owned();
        }
        if seen.len() < MAX_NAME_LABELS {
            seen.insert(value.to_owned());
            return value.to_owned();
        }
        OTHER.to_owned()
    }

    /// `value` if it is known, else [`OTHER`]: for a value that must not take a place.
    fn known(&self, value: &str) -> String {
        let seen = self.0.lock().unwrap_or_else(PoisonError::into_inner);
        if seen.contains(value) {
            value.to_owned()
        } else {
            OTHER.to_owned()
        }
    }
}

/// Which server a process is, for the metrics it exposes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Role {
    /// agent-server: every metric.
    AgentServer,
    /// tool-executor: its gRPC calls and tool calls.
    ToolExecutor,
}

/// The process's role, once said; a process that says none exposes every metric.
static ROLE: OnceLock<Role> = OnceLock::new();

/// Every metric of the process.
pub struct Metrics {
    models: BoundedLabel,
    tools: BoundedLabel,
    registry: Registry,
    rpc_handled: Family<Labels<3>, Counter>,
    rpc_seconds: Family<Labels<2>, Histogram>,
    runs_active: Gauge,
    runs_finished: Family<Labels<1>, Counter>,
    model_seconds: Family<Labels<2>, Histogram>,
    model_first_token_seconds: Family<Labels<1>, Histogram>,
    tokens: Family<Labels<2>, Counter>,
    /// Tokens of calls whose provider reported no usage, counted by the server.
    estimated_tokens: Family<Labels<2>, Counter>,
    tool_calls: Family<Labels<2>, Counter>,
    tool_seconds: Family<Labels<1>, Histogram>,
    bus_lagged: Counter,
    bus_reader_lag: Histogram,
    runs_taken_over: Family<Labels<1>, Counter>,
    runs_handed_over: Counter,
    leases_lost: Counter,
    lease_renewals_failed: Counter,
}

fn seconds() -> Histogram {
    // 0.5 ms to ~65 s.
    Histogram::new(exponential_buckets(0.0005, 2.0, 18))
}

impl Metrics {
    /// Says which server this process is, before its metrics are first used (once said,
    /// or once they are used, it changes nothing).
    pub fn serve_as(role: Role) {
        let _ = ROLE.set(role);
    }

    fn new() -> Self {
        Self::for_role(ROLE.get().copied())
    }

    fn for_role(role: Option<Role>) -> Self {
        let mut registry = Registry::with_prefix("agentrt");
        let metrics = Self {
            models: BoundedLabel::default(),
            tools: BoundedLabel::default(),
            rpc_handled: Family::default(),
            rpc_seconds: Family::new_with_constructor(seconds),
            runs_active: Gauge::default(),
            runs_finished: Family::default(),
            model_seconds: Family::new_with_constructor(seconds),
            model_first_token_seconds: Family::new_with_constructor(seconds),
            tokens: Family::default(),
            estimated_tokens: Family::default(),
            tool_calls: Family::default(),
            tool_seconds: Family::new_with_constructor(seconds),
            bus_lagged: Counter::default(),
            bus_reader_lag: Histogram::new(exponential_buckets(1.0, 4.0, 10)),
            runs_taken_over: Family::default(),
            runs_handed_over: Counter::default(),
            leases_lost: Counter::default(),
            lease_renewals_failed: Counter::default(),
            registry: Registry::default(),
        };
        registry.register(
            "grpc_server_handled",
            "gRPC calls finished, by service, method and status code",
            metrics.rpc_handled.clone(),
        );
        registry.register(
            "grpc_server_handling_seconds",
            "gRPC call duration, from the request to the end of the response",
            metrics.rpc_seconds.clone(),
        );
        registry.register(
            "tool_calls",
            "Tool calls finished, by tool and outcome (ok, error; on the tool executor also \
             timeout, cancelled, unavailable)",
            metrics.tool_calls.clone(),
        );
        registry.register(
            "tool_call_seconds",
            "Tool call duration, by tool",
            metrics.tool_seconds.clone(),
        );
        if role != Some(Role::ToolExecutor) {
            registry.register(
                "runs_active",
                "Runs in progress",
                metrics.runs_active.clone(),
            );
            registry.register(
                "runs_finished",
                "Runs finished, by stop reason",
                metrics.runs_finished.clone(),
            );
            registry.register(
                "model_request_seconds",
                "Model call duration, from the request to the end of the stream, by model and outcome",
                metrics.model_seconds.clone(),
            );
            registry.register(
                "model_time_to_first_token_seconds",
                "Time from a model request to its first streamed delta, by model",
                metrics.model_first_token_seconds.clone(),
            );
            registry.register(
                "model_tokens",
                "Tokens the model reported, by model and type (input, output)",
                metrics.tokens.clone(),
            );
            registry.register(
                "model_tokens_estimated",
                "Tokens of model calls whose provider reported no usage, counted by the \
                 server (o200k tokenizer), by model and type (input, output)",
                metrics.estimated_tokens.clone(),
            );
            registry.register(
                "event_bus_lagged",
                "Subscribers told they fell behind the bounded replay log",
                metrics.bus_lagged.clone(),
            );
            registry.register(
                "event_bus_reader_lag_events",
                "Events a subscriber was behind the run's latest event when it read",
                metrics.bus_reader_lag.clone(),
            );
            registry.register(
                "runs_taken_over",
                "Runs this replica took over from another, by how (takeover: the owner's lease lapsed; handover: the owner let it go as it shut down)",
                metrics.runs_taken_over.clone(),
            );
            registry.register(
                "runs_handed_over",
                "Runs this replica let go to the others as it shut down",
                metrics.runs_handed_over.clone(),
            );
            registry.register(
                "run_leases_lost",
                "Runs this replica stopped because another replica took them over (it was paused or cut off past the lease)",
                metrics.leases_lost.clone(),
            );
            registry.register(
                "run_lease_renewals_failed",
                "Lease renewals (of all the runs of this replica at once) that failed",
                metrics.lease_renewals_failed.clone(),
            );
        }
        Self {
            registry,
            ..metrics
        }
    }

    /// The process's metrics.
    pub fn global() -> &'static Self {
        static METRICS: LazyLock<Metrics> = LazyLock::new(Metrics::new);
        &METRICS
    }

    /// Every metric in the OpenMetrics text format (`application/openmetrics-text`).
    pub fn encode(&self) -> String {
        let mut text = String::new();
        // Writing to a String cannot fail.
        let _ = encode(&mut text, &self.registry);
        text
    }

    /// A gRPC call finished with `code` (the numeric `grpc-status`) after `elapsed`.
    pub fn rpc(&self, service: &str, method: &str, code: i32, elapsed: Duration) {
        self.rpc_handled
            .get_or_create(&[
                ("grpc_service", service.to_owned()),
                ("grpc_method", method.to_owned()),
                ("grpc_code", code_name(code).to_owned()),
            ])
            .inc();
        self.rpc_seconds
            .get_or_create(&[
                ("grpc_service", service.to_owned()),
                ("grpc_method", method.to_owned()),
            ])
            .observe(elapsed.as_secs_f64());
    }

    /// A run started; the guard counts it active until dropped.
    pub fn run_started(&'static self) -> ActiveRun {
        self.runs_active.inc();
        ActiveRun(self)
    }

    /// A run ended with `stop_reason`.
    pub fn run_finished(&self, stop_reason: &str) {
        self.runs_finished
            .get_or_create(&[("stop_reason", stop_reason.to_owned())])
            .inc();
    }

    /// A model call ended (`ok` false when it failed), with its time to first delta if
    /// one came.
    pub fn model_call(&self, model: &str, ok: bool, started: Instant, first: Option<Instant>) {
        let outcome = if ok { "ok" } else { "error" };
        let model = &if ok {
            self.models.value(model)
        } else {
            self.models.known(model)
        };
        self.model_seconds
            .get_or_create(&[("model", model.to_owned()), ("outcome", outcome.to_owned())])
            .observe(started.elapsed().as_secs_f64());
        if let Some(first) = first {
            self.model_first_token_seconds
                .get_or_create(&[("model", model.to_owned())])
                .observe(first.duration_since(started).as_secs_f64());
        }
    }

    /// Tokens a model call used.
    pub fn tokens(&self, model: &str, input: u64, output: u64, estimated: bool) {
        let model = &self.models.value(model);
        let family = if estimated {
            &self.estimated_tokens
        } else {
            &self.tokens
        };
        for (kind, count) in [("input", input), ("output", output)] {
            family
                .get_or_create(&[("model", model.to_owned()), ("type", kind.to_owned())])
                .inc_by(count);
        }
    }

    /// A tool call ended.
    pub fn tool_call(&self, tool: &str, is_error: bool, elapsed: Duration) {
        self.tool_call_ended(tool, if is_error { "error" } else { "ok" }, elapsed);
    }

    /// Counts a tool call that ended with `outcome` (`ok`, `error`, `timeout`,
    /// `cancelled`, `unavailable`) after `elapsed`.
    pub fn tool_call_ended(&self, tool: &str, outcome: &'static str, elapsed: Duration) {
        let tool = &self.tools.value(tool);
        self.tool_calls
            .get_or_create(&[("tool", tool.to_owned()), ("outcome", outcome.to_owned())])
            .inc();
        self.tool_seconds
            .get_or_create(&[("tool", tool.to_owned())])
            .observe(elapsed.as_secs_f64());
    }

    /// A subscriber read while `behind` events behind the newest.
    pub fn bus_read(&self, behind: u64) {
        self.bus_reader_lag.observe(behind as f64);
    }

    /// A subscriber fell behind the replay log.
    pub fn bus_lagged(&self) {
        self.bus_lagged.inc();
    }

    /// Counts a run taken over from another replica.
    pub fn run_taken_over(&self, handover: bool) {
        let how = if handover { "handover" } else { "takeover" };
        self.runs_taken_over
            .get_or_create(&[("how", how.to_owned())])
            .inc();
    }

    /// Counts runs let go to the other replicas.
    pub fn runs_handed_over(&self, runs: usize) {
        self.runs_handed_over.inc_by(runs as u64);
    }

    /// Counts a run stopped here because another replica took it over.
    pub fn lease_lost(&self) {
        self.leases_lost.inc();
    }

    /// Counts a failed renewal of this replica's leases.
    pub fn lease_renewal_failed(&self) {
        self.lease_renewals_failed.inc();
    }
}

/// Counts a run as active while it lives.
#[must_use = "the run counts as active only while this guard lives"]
pub struct ActiveRun(&'static Metrics);

impl Drop for ActiveRun {
    fn drop(&mut self) {
        self.0.runs_active.dec();
    }
}

/// The canonical name of a gRPC status code.
fn code_name(code: i32) -> &'static str {
    const NAMES: [&str; 17] = [
        "OK",
        "CANCELLED",
        "UNKNOWN",
        "INVALID_ARGUMENT",
        "DEADLINE_EXCEEDED",
        "NOT_FOUND",
        "ALREADY_EXISTS",
        "PERMISSION_DENIED",
        "RESOURCE_EXHAUSTED",
        "FAILED_PRECONDITION",
        "ABORTED",
        "OUT_OF_RANGE",
        "UNIMPLEMENTED",
        "INTERNAL",
        "UNAVAILABLE",
        "DATA_LOSS",
        "UNAUTHENTICATED",
    ];
    usize::try_from(code)
        .ok()
        .and_then(|i| NAMES.get(i))
        .copied()
        .unwrap_or("UNKNOWN")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_clients_choose_keep_a_bounded_number_of_series() {
        let metrics = Metrics::new();
        for i in 0..MAX_NAME_LABELS + 50 {
            metrics.tool_call(&format!("made_up_{i}"), true, Duration::from_millis(1));
            metrics.tokens(&format!("model-{i}"), 1, 1, false);
        }
        let text = metrics.encode();
        let series = |prefix: &str| text.lines().filter(|l| l.starts_with(prefix)).count();
        assert_eq!(series("agentrt_tool_calls_total{"), MAX_NAME_LABELS + 1);
        assert_eq!(
            series("agentrt_model_tokens_total{"),
            2 * (MAX_NAME_LABELS + 1)
        );
        assert!(text.contains(r#"agentrt_tool_calls_total{tool="other",outcome="error"} 50"#));
        // A name seen before the bound keeps its own series.
        metrics.tool_call("made_up_0", true, Duration::from_millis(1));
        assert!(
            metrics
                .encode()
                .contains(r#"agentrt_tool_calls_total{tool="made_up_0",outcome="error"} 2"#)
        );
    }

    #[test]
    fn failed_calls_of_unknown_models_take_no_label() {
        let metrics = Metrics::new();
        let started = Instant::now();
        for i in 0..MAX_NAME_LABELS + 50 {
            metrics.model_call(&format!("made-up-{i}"), false, started, None);
        }
        metrics.model_call("real", true, started, None);
        metrics.model_call("real", false, started, None);
        let text = metrics.encode();
        assert!(
            text.contains(
                r#"agentrt_model_request_seconds_count{model="other",outcome="error"} 150"#
            ),
            "{text}"
        );
        assert!(
            text.contains(r#"agentrt_model_request_seconds_count{model="real",outcome="ok"} 1"#)
        );
        assert!(
            text.contains(r#"agentrt_model_request_seconds_count{model="real",outcome="error"} 1"#)
        );
        assert!(!text.contains("made-up"));
    }

    #[test]
    fn the_tool_executor_exposes_its_own_metrics_only() {
        let metrics = Metrics::for_role(Some(Role::ToolExecutor));
        metrics.tool_call("calculator", false, Duration::from_millis(2));
        metrics.rpc(
            "agent.v1.ToolExecutor",
            "ExecuteTool",
            0,
            Duration::from_millis(2),
        );
        let text = metrics.encode();
        assert!(text.contains(r#"agentrt_tool_calls_total{tool="calculator",outcome="ok"} 1"#));
        assert!(text.contains("agentrt_grpc_server_handled"));
        for agent_only in ["runs_active", "model_", "event_bus", "lease", "taken_over"] {
            assert!(!text.contains(agent_only), "{agent_only} in:\n{text}");
        }
    }

    #[test]
    fn records_show_up_in_the_exposition() {
        let metrics = Metrics::new();
        metrics.rpc(
            "agent.v1.AgentEngine",
            "Execute",
            0,
            Duration::from_millis(3),
        );
        metrics.rpc(
            "agent.v1.AgentEngine",
            "Execute",
            5,
            Duration::from_millis(1),
        );
        metrics.run_finished("final_answer");
        metrics.tokens("demo", 10, 4, false);
        metrics.tokens("demo", 7, 3, true);
        metrics.tool_call("calculator", false, Duration::from_millis(2));
        let text = metrics.encode();
        for line in [
            r#"agentrt_grpc_server_handled_total{grpc_service="agent.v1.AgentEngine",grpc_method="Execute",grpc_code="OK"} 1"#,
            r#"agentrt_grpc_server_handled_total{grpc_service="agent.v1.AgentEngine",grpc_method="Execute",grpc_code="NOT_FOUND"} 1"#,
            r#"agentrt_runs_finished_total{stop_reason="final_answer"} 1"#,
            r#"agentrt_model_tokens_total{model="demo",type="input"} 10"#,
            r#"agentrt_model_tokens_estimated_total{model="demo",type="input"} 7"#,
            r#"agentrt_tool_calls_total{tool="calculator",outcome="ok"} 1"#,
            "agentrt_runs_active 0",
        ] {
            assert!(text.contains(line), "{line} missing from:\n{text}");
        }
        assert_eq!(code_name(99), "UNKNOWN");
    }
}
