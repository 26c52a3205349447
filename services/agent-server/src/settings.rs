use std::{collections::BTreeMap, net::SocketAddr, path::PathBuf, time::Duration};

use agentrt_core::Secret;
use agentrt_grpc::{
    config::{self, CommonArgs, ConfigError, ServerSettings, parse_duration},
    security::ClientTlsSettings,
};
use agentrt_models::ProviderSettings;
use serde::{Deserialize, Serialize};

/// The agent server's settings, as a config file writes them.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct Settings {
    /// Listening, limits and drain.
    pub server: ServerSettings,
    /// URL of the tool executor, e.g. `http://127.0.0.1:50052`.
    pub tool_executor: String,
    /// How long a call to the tool executor may take to connect and answer `ListTools`.
    #[serde(with = "config::duration")]
    pub tool_executor_timeout: Duration,
    /// Connections to the tool executor, which tool calls take in turn: behind a load
    /// balancer that spreads connections (a Kubernetes Service), calls reach up to this
    /// many tool executor replicas. One by default: calls that share a connection share
    /// its writes, and a tool iteration costs about a tenth less CPU than over four.
    pub tool_executor_connections: usize,
    /// TLS towards an `https://` tool executor: its CA, and this server's certificate
    /// when the tool executor requires mutual TLS.
    #[serde(skip_serializing_if = "ClientTlsSettings::is_unset")]
    pub tool_executor_tls: ClientTlsSettings,
    /// The bearer token sent to the tool executor, when it requires one.
    #[serde(skip_serializing_if = "Secret::is_empty")]
    pub tool_executor_token: Secret,
    /// A file holding that token (a mounted Secret), read at start-up.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub tool_executor_token_file: Option<PathBuf>,
    /// Where engines, sessions, runs and their events live: `memory` (this process
    /// only) or the URL of a Redis every replica shares (`redis://host:port/db`,
    /// `rediss://...` for TLS). Credentials in the URL are masked when printed.
    #[serde(serialize_with = "masked_url")]
    pub state: String,
    /// The prefix of every key in the shared Redis, so that several deployments (or
    /// tests) can share one Redis.
    pub state_key_prefix: String,
    /// The engine registry's bounds.
    pub engines: EngineSettings,
    /// Bounds of runs and their events.
    pub runs: RunSettings,
    /// Bounds of the conversation histories kept per session.
    pub sessions: SessionSettings,
    /// The provider used when a config names none; the only provider when unset and
    /// exactly one is configured.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub default_provider: Option<String>,
    /// Model providers by name. When empty, `OPENAI_BASE_URL`/`OPENAI_API_KEY` register
    /// `openai`.
    pub providers: BTreeMap<String, ProviderSettings>,
}

fn masked_url<S: serde::Serializer>(url: &str, serializer: S) -> Result<S::Ok, S::Error> {
    serializer.serialize_str(&agentrt_core::mask_url_credentials(url))
}

/// Where the state lives, as the `state` setting says.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum StateSetting {
    /// In this process.
    Memory,
    /// In the Redis at this URL.
    Redis(String),
}

/// Bounds of the engine registry.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct EngineSettings {
    /// An engine unused for this long expires.
    #[serde(with = "config::duration")]
    pub ttl: Duration,
    /// Most engines kept; beyond, the least recently used one is dropped.
    pub max_engines: usize,
    /// Most bytes of engines' configs and tool specs kept in memory (with `state =
    /// memory`), all engines together; beyond, `CreateAgentEngine` is
    /// `RESOURCE_EXHAUSTED` (no engine is dropped for a new one).
    pub max_bytes: usize,
    /// Most engines of one principal (with authentication); beyond, `CreateAgentEngine`
    /// is `RESOURCE_EXHAUSTED`.
    pub max_per_principal: usize,
}

/// Bounds of runs and their events.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct RunSettings {
    /// Runs in progress at once; beyond, `Execute` is `RESOURCE_EXHAUSTED`.
    pub max_active: usize,
    /// How long an ended run stays readable by `Subscribe`, `GetRun` and a repeated
    /// `Execute`.
    #[serde(with = "config::duration")]
    pub retention: Duration,
    /// Events kept per run for replay; a reader further behind is told what it lost.
    pub events_per_run: usize,
    /// Events kept for replay in the logs of ended runs, all together; beyond, the runs
    /// that ended first can no longer be subscribed to, before their retention is over.
    pub retained_events: usize,
    /// Longest `query` accepted, in characters; beyond, `Execute` is `INVALID_ARGUMENT`.
    pub max_query_chars: usize,
    /// Most `llm_context` messages one `Execute` may carry.
    pub max_context_messages: usize,
    /// Most characters of `llm_context` content, all messages together.
    pub max_context_chars: usize,
    /// Longest tool output given to the model, in bytes; longer outputs are cut and end
    /// with a `[tool output truncated: ...]` marker.
    pub max_tool_output_bytes: usize,
    /// With shared state: how long a run's lease lasts unrenewed (its replica renews it
    /// three times as often); when it lapses, another replica takes the run over and
    /// continues it. Between 1s and 10m.
    #[serde(with = "config::duration")]
    pub takeover_after: Duration,
    /// Most bytes of queries and `llm_context` held by the runs in progress on this
    /// replica; beyond, `Execute` is `RESOURCE_EXHAUSTED`.
    pub max_active_bytes: usize,
    /// Most runs of one principal in progress on this replica; beyond, `Execute` is
    /// `RESOURCE_EXHAUSTED`.
    pub max_active_per_principal: usize,
    /// Most open `Execute` and `Subscribe` streams of one principal on this replica;
    /// beyond, a new one is `RESOURCE_EXHAUSTED`.
    pub max_streams_per_principal: usize,
    /// Most bytes of the records of ended runs kept for the retention (with `state =
    /// memory`); beyond, the runs that ended first are forgotten early.
    pub retained_bytes: usize,
    /// Most bytes held by the runs waiting for answers (with `state = memory`: packed, and
    /// about 512 bytes each besides); beyond, a run that would wait fails instead.
    pub max_waiting_bytes: usize,
    /// Most runs of one principal waiting for answers at once (with Redis, on all
    /// replicas together); beyond, a run that would wait fails instead.
    pub max_waiting_per_principal: usize,
}

impl Default for RunSettings {
    fn default() -> Self {
        Self {
            max_active: 20_000,
            retention: Duration::from_secs(600),
            events_per_run: 10_000,
            retained_events: 1_000_000,
            max_query_chars: 100_000,
            max_context_messages: 1_000,
            max_context_chars: 1_000_000,
            max_tool_output_bytes: agentrt_engine::DEFAULT_MAX_TOOL_OUTPUT_BYTES,
            takeover_after: Duration::from_secs(10),
            max_active_bytes: DEFAULT_BUDGET_BYTES,
            max_active_per_principal: 5_000,
            max_streams_per_principal: 5_000,
            retained_bytes: DEFAULT_BUDGET_BYTES,
            max_waiting_bytes: DEFAULT_BUDGET_BYTES,
            max_waiting_per_principal: 25_000,
        }
    }
}

/// Each memory budget's default: four of them (engines, sessions, runs in progress,
/// ended runs) fit the 1 GiB the manifests give a replica that keeps its state in memory,
/// with room for the rest.
pub const DEFAULT_BUDGET_BYTES: usize = 128 * 1024 * 1024;
/// The default bound of one session's history: 8 MiB, some two million tokens, more than
/// any model's context holds.
pub const DEFAULT_HISTORY_BYTES: usize = 8 * 1024 * 1024;

/// Bounds of the conversation histories kept per session.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct SessionSettings {
    /// A session unused for this long is forgotten.
    #[serde(with = "config::duration")]
    pub ttl: Duration,
    /// Most sessions kept; beyond, the least recently used is forgotten.
    pub max_sessions: usize,
    /// Most turns kept per session.
    pub max_turns: usize,
    /// Most bytes of history kept in memory (with `state = memory`), all sessions
    /// together; beyond, the least recently used sessions are forgotten.
    pub max_bytes: usize,
    /// Most bytes of one session's history (in memory and in Redis); beyond, its oldest
    /// turns are forgotten (its newest is always kept). Every run reads its session's
    /// history whole: this bounds what one run of a long session reads and holds.
    pub max_history_bytes: usize,
}

impl Default for SessionSettings {
    fn default() -> Self {
        Self {
            ttl: Duration::from_secs(3600),
            max_sessions: 100_000,
            max_turns: 200,
            max_bytes: DEFAULT_BUDGET_BYTES,
            max_history_bytes: DEFAULT_HISTORY_BYTES,
        }
    }
}

impl Default for EngineSettings {
    fn default() -> Self {
        Self {
            ttl: Duration::from_secs(3600),
            max_engines: 10_000,
            max_bytes: DEFAULT_BUDGET_BYTES,
            max_per_principal: 2_500,
        }
    }
}

impl Default for Settings {
    fn default() -> Self {
        Self {
            server: ServerSettings::listening_on(SocketAddr::from(([127, 0, 0, 1], 50051))),
            tool_executor: "http://127.0.0.1:50052".into(),
            tool_executor_timeout: Duration::from_secs(5),
            tool_executor_connections: 1,
            tool_executor_tls: ClientTlsSettings::default(),
            tool_executor_token: Secret::default(),
            tool_executor_token_file: None,
            state: "memory".into(),
            state_key_prefix: "agentrt".into(),
            engines: EngineSettings::default(),
            runs: RunSettings::default(),
            sessions: SessionSettings::default(),
            default_provider: None,
            providers: BTreeMap::new(),
        }
    }
}

/// Refuses a tool executor URL with parts agent-server would not use: credentials (the
/// token goes in `tool_executor_token`), a path or a query (gRPC calls go to
/// `/agent.v1.ToolExecutor/...` at its root), a port out of range, no host.
fn check_tool_executor_url(url: &str) -> Result<(), ConfigError> {
    let invalid = |message: String| ConfigError::Invalid {
        field: "tool_executor",
        message,
    };
    let shown = agentrt_core::mask_url_credentials(url);
    let uri: http::Uri = url
        .parse()
        .map_err(|e| invalid(format!("{shown:?} is not a URL: {e}")))?;
    let authority = uri
        .authority()
        .ok_or_else(|| invalid(format!("{shown:?} has no host")))?;
    if authority.as_str().contains('@') {
        return Err(invalid(format!(
            "{shown:?} holds credentials: give the token in tool_executor_token (or \
             tool_executor_token_file) instead"
        )));
    }
    if authority.host().is_empty() {
        return Err(invalid(format!("{shown:?} has no host")));
    }
    // Credentials are refused above: what follows the host is its port, if anything.
    if let Some(port) = authority
        .as_str()
        .get(authority.host().len()..)
        .and_then(|rest| rest.strip_prefix(':'))
        && !port.parse::<u16>().is_ok_and(|p| p > 0)
    {
        return Err(invalid(format!(
            "{shown:?} has port {port:?}: a port is 1 to 65535"
        )));
    }
    if !matches!(uri.path(), "" | "/") || uri.query().is_some() {
        return Err(invalid(format!(
            "{shown:?} has a path or a query, which gRPC calls do not use: give the tool \
             executor's address only, as http://host:port"
        )));
    }
    Ok(())
}

impl Settings {
    /// The bearer token for the tool executor, from the setting or its file; `None` when
    /// none is configured.
    /// Read once, when the server starts.
    pub fn tool_executor_token(&self) -> Result<Option<Secret>, ConfigError> {
        let token = match &self.tool_executor_token_file {
            Some(path) => {
                let text = std::fs::read_to_string(path).map_err(|e| ConfigError::Invalid {
                    field: "tool_executor_token_file",
                    message: format!("cannot read {}: {e}", path.display()),
                })?;
                Secret::new(text.trim())
            }
            None if self.tool_executor_token.is_empty() => return Ok(None),
            None => self.tool_executor_token.clone(),
        };
        if token.is_empty() || token.expose().contains(char::is_whitespace) {
            return Err(ConfigError::Invalid {
                field: "tool_executor_token",
                message: "must be one token, without whitespace".into(),
            });
        }
        Ok(Some(token))
    }

    /// Where the state lives.
    pub fn state(&self) -> Result<StateSetting, ConfigError> {
        let state = self.state.trim();
        if state.eq_ignore_ascii_case("memory") {
            return Ok(StateSetting::Memory);
        }
        if state.starts_with("redis://") || state.starts_with("rediss://") {
            return Ok(StateSetting::Redis(state.to_owned()));
        }
        Err(ConfigError::Invalid {
            field: "state",
            message: format!(
                "{:?} must be `memory` or a redis:// or rediss:// URL",
                agentrt_core::mask_url_credentials(state)
            ),
        })
    }

    /// Checks ranges once at start-up.
    pub fn validate(&self) -> Result<(), ConfigError> {
        self.server.validate()?;
        self.state()?;
        // Printable ASCII: it names every Redis key, and shows in logs and redis-cli.
        if self.state_key_prefix.is_empty()
            || self.state_key_prefix.len() > 64
            || !self.state_key_prefix.bytes().all(|b| b.is_ascii_graphic())
        {
            return Err(ConfigError::Invalid {
                field: "state_key_prefix",
                message: format!(
                    "must be 1 to 64 printable ASCII characters without whitespace, got {:?}",
                    agentrt_grpc::status::bounded(&self.state_key_prefix, 80)
                ),
            });
        }
        if !(self.tool_executor.starts_with("http://")
            || self.tool_executor.starts_with("https://"))
        {
            return Err(ConfigError::Invalid {
                field: "tool_executor",
                message: format!(
                    "{:?} must be an http:// or https:// URL",
                    self.tool_executor
                ),
            });
        }
        check_tool_executor_url(&self.tool_executor)?;
        if self.tool_executor.starts_with("https://") {
            // The files are read once, when the server starts, before it listens.
            self.tool_executor_tls.check("tool_executor_tls")?;
        } else if self.tool_executor_tls.is_set() {
            return Err(ConfigError::Invalid {
                field: "tool_executor_tls",
                message: format!(
                    "TLS settings need an https:// tool executor, not {:?}",
                    self.tool_executor
                ),
            });
        }
        if !self.tool_executor_token.is_empty() && self.tool_executor_token_file.is_some() {
            return Err(ConfigError::Invalid {
                field: "tool_executor_token",
                message: "give the token or a token file, not both".into(),
            });
        }
        if self.tool_executor_timeout < Duration::from_millis(1)
            || self.tool_executor_timeout > Duration::from_secs(300)
        {
            return Err(ConfigError::Invalid {
                field: "tool_executor_timeout",
                message: "must be between 1ms and 5m".into(),
            });
        }
        if !(1..=64).contains(&self.tool_executor_connections) {
            return Err(ConfigError::Invalid {
                field: "tool_executor_connections",
                message: format!(
                    "must be between 1 and 64, got {}",
                    self.tool_executor_connections
                ),
            });
        }
        for (field, value) in [
            ("engines.ttl", self.engines.ttl),
            ("runs.retention", self.runs.retention),
            ("sessions.ttl", self.sessions.ttl),
        ] {
            if value.is_zero() {
                return Err(ConfigError::Invalid {
                    field,
                    message: "must be positive".into(),
                });
            }
        }
        for (field, value) in [
            ("runs.max_active", self.runs.max_active),
            ("runs.events_per_run", self.runs.events_per_run),
            ("runs.retained_events", self.runs.retained_events),
            ("runs.max_query_chars", self.runs.max_query_chars),
            ("runs.max_context_messages", self.runs.max_context_messages),
            ("runs.max_context_chars", self.runs.max_context_chars),
        ] {
            if value == 0 {
                return Err(ConfigError::Invalid {
                    field,
                    message: "must be positive".into(),
                });
            }
        }
        if self.runs.takeover_after < Duration::from_secs(1)
            || self.runs.takeover_after > Duration::from_secs(600)
        {
            return Err(ConfigError::Invalid {
                field: "runs.takeover_after",
                message: "must be between 1s and 10m".into(),
            });
        }
        if self.runs.max_tool_output_bytes < 256 {
            return Err(ConfigError::Invalid {
                field: "runs.max_tool_output_bytes",
                message: "must be at least 256".into(),
            });
        }
        if self.engines.max_engines == 0 {
            return Err(ConfigError::Invalid {
                field: "engines.max_engines",
                message: "must be positive".into(),
            });
        }
        for (field, value) in [
            ("engines.max_bytes", self.engines.max_bytes),
            ("engines.max_per_principal", self.engines.max_per_principal),
            ("runs.max_active_bytes", self.runs.max_active_bytes),
            (
                "runs.max_active_per_principal",
                self.runs.max_active_per_principal,
            ),
            (
                "runs.max_streams_per_principal",
                self.runs.max_streams_per_principal,
            ),
            ("runs.retained_bytes", self.runs.retained_bytes),
            ("runs.max_waiting_bytes", self.runs.max_waiting_bytes),
            (
                "runs.max_waiting_per_principal",
                self.runs.max_waiting_per_principal,
            ),
            ("sessions.max_bytes", self.sessions.max_bytes),
            (
                "sessions.max_history_bytes",
                self.sessions.max_history_bytes,
            ),
            ("sessions.max_sessions", self.sessions.max_sessions),
            ("sessions.max_turns", self.sessions.max_turns),
        ] {
            if value == 0 {
                return Err(ConfigError::Invalid {
                    field,
                    message: "must be positive".into(),
                });
            }
        }
        Ok(())
    }
}

/// The agent server's command line. Every flag also reads `AGENT_SERVER_<FLAG>` from the
/// environment, e.g. `AGENT_SERVER_TOOL_EXECUTOR`.
#[derive(Debug, Clone, Default, clap::Parser)]
#[command(
    name = "agent-server",
    version,
    about = "Runs LLM agents for any gRPC client."
)]
pub struct Cli {
    #[command(flatten)]
    #[allow(missing_docs)]
    pub common: CommonArgs,
    /// URL of the tool executor.
    #[arg(long, value_name = "URL")]
    pub tool_executor: Option<String>,
    /// Time limit for reaching the tool executor, e.g. `5s`.
    #[arg(long, value_name = "DURATION", value_parser = parse_duration)]
    pub tool_executor_timeout: Option<Duration>,
    /// Connections to the tool executor, which tool calls take in turn.
    #[arg(long, value_name = "N")]
    pub tool_executor_connections: Option<usize>,
    /// CA certificates (PEM) of an `https://` tool executor.
    #[arg(long, value_name = "FILE")]
    pub tool_executor_ca: Option<PathBuf>,
    /// This server's certificate (PEM) for a tool executor that requires mutual TLS.
    #[arg(long, value_name = "FILE")]
    pub tool_executor_cert: Option<PathBuf>,
    /// The private key (PEM) of `--tool-executor-cert`.
    #[arg(long, value_name = "FILE")]
    pub tool_executor_key: Option<PathBuf>,
    /// The bearer token for the tool executor. Prefer the environment variable or
    /// `--tool-executor-token-file`: command lines are visible to other processes.
    #[arg(long, value_name = "TOKEN", hide_env_values = true)]
    pub tool_executor_token: Option<String>,
    /// A file holding the bearer token for the tool executor.
    #[arg(long, value_name = "FILE")]
    pub tool_executor_token_file: Option<PathBuf>,
    /// Where engines, sessions, runs and events live: `memory` (the default: this process
    /// only) or a Redis URL (`redis://host:port/db`, `rediss://...`) shared by every
    /// replica. A URL with a password is better given by the environment variable or a
    /// file: command lines are visible to other processes.
    #[arg(long, value_name = "memory|URL", hide_env_values = true)]
    pub state: Option<String>,
    /// The prefix of every key in the shared Redis.
    #[arg(long, value_name = "PREFIX")]
    pub state_key_prefix: Option<String>,
    /// Unused engines expire after this long, e.g. `1h`.
    #[arg(long, value_name = "DURATION", value_parser = parse_duration)]
    pub engine_ttl: Option<Duration>,
    /// Most engines kept at once.
    #[arg(long, value_name = "N")]
    pub max_engines: Option<usize>,
    /// Provider used when a config names none.
    #[arg(long, value_name = "NAME")]
    pub default_provider: Option<String>,
    /// Runs in progress at once.
    #[arg(long, value_name = "N")]
    pub max_active_runs: Option<usize>,
    /// Longest query accepted, in characters.
    #[arg(long, value_name = "N")]
    pub max_query_chars: Option<usize>,
    /// Most `llm_context` messages per Execute.
    #[arg(long, value_name = "N")]
    pub max_context_messages: Option<usize>,
    /// Most characters of `llm_context` content per Execute.
    #[arg(long, value_name = "N")]
    pub max_context_chars: Option<usize>,
    /// Longest tool output given to the model, in bytes (longer ones are cut and marked).
    #[arg(long, value_name = "BYTES")]
    pub max_tool_output_bytes: Option<usize>,
    /// With shared state: another replica takes a run over once its replica has not
    /// renewed its lease for this long, e.g. `10s`.
    #[arg(long, value_name = "DURATION", value_parser = parse_duration)]
    pub takeover_after: Option<Duration>,
}

impl Cli {
    /// The prefix of the environment variables that stand for flags.
    pub const ENV_PREFIX: &'static str = "AGENT_SERVER";

    /// Layers defaults, the config file, then environment and flags, and validates.
    pub fn settings(&self) -> Result<Settings, ConfigError> {
        let mut settings: Settings = self.common.base(|s: &mut Settings| &mut s.server)?;
        config::override_with(&mut settings.tool_executor, self.tool_executor.clone());
        config::override_with(
            &mut settings.tool_executor_timeout,
            self.tool_executor_timeout,
        );
        config::override_with(
            &mut settings.tool_executor_connections,
            self.tool_executor_connections,
        );
        let tls = &mut settings.tool_executor_tls;
        if self.tool_executor_ca.is_some() {
            tls.ca_file.clone_from(&self.tool_executor_ca);
        }
        if self.tool_executor_cert.is_some() {
            tls.cert_file.clone_from(&self.tool_executor_cert);
        }
        if self.tool_executor_key.is_some() {
            tls.key_file.clone_from(&self.tool_executor_key);
        }
        if let Some(token) = &self.tool_executor_token {
            settings.tool_executor_token = Secret::new(token.clone());
        }
        if self.tool_executor_token_file.is_some() {
            settings
                .tool_executor_token_file
                .clone_from(&self.tool_executor_token_file);
        }
        config::override_with(&mut settings.state, self.state.clone());
        config::override_with(
            &mut settings.state_key_prefix,
            self.state_key_prefix.clone(),
        );
        config::override_with(&mut settings.engines.ttl, self.engine_ttl);
        config::override_with(&mut settings.engines.max_engines, self.max_engines);
        config::override_with(&mut settings.runs.max_active, self.max_active_runs);
        config::override_with(&mut settings.runs.max_query_chars, self.max_query_chars);
        config::override_with(
            &mut settings.runs.max_context_messages,
            self.max_context_messages,
        );
        config::override_with(&mut settings.runs.max_context_chars, self.max_context_chars);
        config::override_with(
            &mut settings.runs.max_tool_output_bytes,
            self.max_tool_output_bytes,
        );
        config::override_with(&mut settings.runs.takeover_after, self.takeover_after);
        if self.default_provider.is_some() {
            settings.default_provider.clone_from(&self.default_provider);
        }
        settings.validate()?;
        Ok(settings)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_tool_executor_url_with_parts_grpc_does_not_use_is_refused() {
        for good in [
            "http://127.0.0.1:50052",
            "http://tools:50052/",
            "https://tools.example",
            "http://[::1]:50052",
            "http://[::1]",
        ] {
            assert!(check_tool_executor_url(good).is_ok(), "{good}");
        }
        for (bad, says) in [
            ("http://127.0.0.1:99999", "a port is 1 to 65535"),
            ("http://127.0.0.1:0", "a port is 1 to 65535"),
            ("http://user:pw@127.0.0.1:50052", "tool_executor_token"),
            ("http://127.0.0.1:50052/some/path", "a path or a query"),
            ("http://127.0.0.1:50052?x=1", "a path or a query"),
        ] {
            let error = check_tool_executor_url(bad).unwrap_err().to_string();
            assert!(error.contains("tool_executor"), "{bad}: {error}");
            assert!(error.contains(says), "{bad}: {error}");
            assert!(!error.contains("pw"), "{bad}: {error}");
        }
    }

    #[test]
    fn settings_are_held_to_what_their_messages_say() {
        type Set = fn(&mut Settings);
        let cases: [(&str, Set); 3] = [
            ("tool_executor_timeout", |s| {
                s.tool_executor_timeout = Duration::from_micros(500);
            }),
            ("state_key_prefix", |s| {
                s.state_key_prefix = "agent\u{7}rt".into()
            }),
            ("state_key_prefix", |s| {
                s.state_key_prefix = "agentré".into()
            }),
        ];
        for (field, set) in cases {
            let mut settings = Settings::default();
            set(&mut settings);
            let error = settings.validate().unwrap_err().to_string();
            assert!(error.contains(field), "{field}: {error}");
        }
        let settings = Settings {
            tool_executor_timeout: Duration::from_millis(1),
            state_key_prefix: "team-a:agentrt".into(),
            ..Settings::default()
        };
        assert!(settings.validate().is_ok());
    }

    #[test]
    fn zero_retention_ttls_and_session_bounds_are_refused_naming_the_setting() {
        assert!(Settings::default().validate().is_ok());
        type Zero = fn(&mut Settings);
        let cases: [(&str, Zero); 7] = [
            ("runs.retention", |s| s.runs.retention = Duration::ZERO),
            // Each named alone (they were named together as `runs`).
            ("runs.max_active", |s| s.runs.max_active = 0),
            ("runs.events_per_run", |s| s.runs.events_per_run = 0),
            ("runs.retained_events", |s| s.runs.retained_events = 0),
            ("sessions.ttl", |s| s.sessions.ttl = Duration::ZERO),
            ("sessions.max_sessions", |s| s.sessions.max_sessions = 0),
            ("sessions.max_turns", |s| s.sessions.max_turns = 0),
        ];
        for (field, zero) in cases {
            let mut settings = Settings::default();
            zero(&mut settings);
            match settings.validate() {
                Err(ConfigError::Invalid {
                    field: named,
                    message,
                }) => {
                    assert_eq!(named, field);
                    assert_eq!(message, "must be positive");
                }
                other => panic!("{field}: {other:?}"),
            }
        }
    }
}
