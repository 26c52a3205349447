//! MCP servers as toolsets, through the official SDK (`rmcp`): over stdio (a child process
//! the tool executor starts) or streamable HTTP.
//!
//! Each server has a supervisor task that connects (start, `initialize`, `tools/list`,
//! each bounded by `connect_timeout`), then waits: for `notifications/tools/list_changed`
//! (it lists again and the catalogue is refreshed), for the connection to end (it
//! reconnects with backoff; meanwhile the server's tools answer `UNAVAILABLE` naming it),
//! or for shutdown (it stops the child process, and what that started: its process group).
//! An HTTP server is asked for its tools again every [`HTTP_CHECK_EVERY`]: one that stopped
//! answering on its session is reconnected, and tools it changed are found; a stdio server
//! is asked once a call of it timed out, and one that does not answer either (hung, not
//! merely slow on that call) is stopped and started again. Calls go
//! straight to the current connection; a call abandoned by its caller, or past its deadline
//! or the server's `timeout`, sends `notifications/cancelled` (rmcp does when the call's
//! future is dropped).

mod bounded;
mod content;
mod describe;
mod lenient;

use std::{
    collections::{BTreeMap, HashMap},
    path::{Path, PathBuf},
    process::Stdio,
    sync::{
        Arc, RwLock,
        atomic::{AtomicU64, AtomicUsize, Ordering},
    },
    time::Duration,
};

use agentrt_core::{Secret, ToolSource, ToolSpec};
use async_trait::async_trait;
use rmcp::{
    ClientHandler, RoleClient, ServiceExt,
    model::{
        CallToolRequestParams, ClientCapabilities, ClientConfig, Implementation,
        PaginatedRequestParams, RequestMetaObject,
    },
    service::{ClientCacheConfig, NotificationContext, Peer, RunningService, ServiceError},
    transport::{
        StreamableHttpClientTransport, async_rw::AsyncRwTransport,
        streamable_http_client::StreamableHttpClientTransportConfig,
    },
};
use serde::{Deserialize, Serialize};
use tokio::{
    io::AsyncReadExt,
    process::{Child, Command},
    sync::{Notify, oneshot},
    task::JoinHandle,
    time::Instant,
};
use tokio_util::sync::CancellationToken;
use tracing::{Instrument, debug, info, info_span, warn};

use crate::{
    CallError, Changes, Error, ListedTool, Result, ToolContext, ToolOutput, Toolset,
    check_source_name, offered_name, secret::SecretRef, truncate_text,
};

/// Most tools one server may list; the rest are left out.
const MAX_TOOLS: usize = 1000;
/// The `_meta` key of `tools/call` that carries the call's id as its idempotency key.
pub const IDEMPOTENCY_META: &str = "io.agentrt/idempotencyKey";
/// Most `tools/list` pages followed.
const MAX_PAGES: usize = 100;
/// Largest tool one server may list, its name, description and input schema together, in
/// bytes; a larger one is left out. Descriptions are cut to 4 KiB; schemas are not, and a
/// generated server's can be large.
const MAX_TOOL_BYTES: usize = 256 * 1024;
/// Most bytes of tools one server may list, all together; the rest are left out. The
/// catalogue's answer is bounded ([`agentrt_grpc::MAX_CATALOGUE_BYTES`]) and refused whole
/// past it, for every caller: one server must not take it all.
const MAX_LISTED_BYTES: usize = 8 * 1024 * 1024;
/// The first wait before reconnecting; it doubles up to [`MAX_BACKOFF`].
const FIRST_BACKOFF: Duration = Duration::from_millis(500);
/// The longest wait before reconnecting.
const MAX_BACKOFF: Duration = Duration::from_secs(30);
/// A connection that lasted this long starts the backoff over: a server that fails now and
/// then is reached again at once, one that fails soon after each start waits longer each
/// time. (At 60 s, a server that failed every minute was down 30 s each time.)
const STABLE: Duration = Duration::from_secs(10);

/// How long after a failed `tools/list` (asked for by `notifications/tools/list_changed`)
/// it is asked again.
const RELIST_RETRY: Duration = Duration::from_secs(2);
/// Least time between two lists asked for by `notifications/tools/list_changed`: changes
/// announced meanwhile are listed together, once it has passed. A server that announces a
/// change after every list (or thousands a second) is not asked for its list on end.
const RELIST_EVERY: Duration = Duration::from_secs(1);
/// How long a child process may take to exit once its stdin is closed.
const EXIT_GRACE: Duration = Duration::from_secs(2);
/// When a client may try a server's tool again while the server is being connected (the
/// `RetryInfo` of `UNAVAILABLE`); while it waits to reconnect, when it will.
const RETRY_WHILE_CONNECTING: Duration = Duration::from_secs(1);
/// How often an HTTP server is asked for its tools while connected. A server restarted
/// behind the same URL refuses the old session (404, or a 400 saying so): a new session
/// is made at once, and the server may offer other tools on it. One that stops answering
/// is found too: when `tools/list` gets no answer within `connect_timeout`, the connection
/// is dropped and made again.
const HTTP_CHECK_EVERY: Duration = Duration::from_secs(10);
/// Environment variables a child process inherits from the tool executor; everything
/// else it gets from its `env` setting, so that the executor's own secrets stay its own.
const INHERITED_ENV: [&str; 9] = [
    "PATH",
    "HOME",
    "USER",
    "LANG",
    "LC_ALL",
    "TZ",
    "TMPDIR",
    "SYSTEMROOT",
    "NODE_PATH",
];

/// One `[[mcp_servers]]` entry of the tool executor's config.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct McpServerConfig {
    /// The source name: its tools are offered as `<name>__<tool>`.
    pub name: String,
    /// For stdio: the program to start.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub command: Option<String>,
    /// For stdio: its arguments.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub args: Vec<String>,
    /// For stdio: environment variables, each a value or a secret read from the tool
    /// executor's environment or a file (`{ env = "GITHUB_TOKEN" }`). The child inherits
    /// only `PATH`, `HOME`, `USER`, `LANG`, `LC_ALL`, `TZ`, `TMPDIR` and `NODE_PATH` besides.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub env: BTreeMap<String, EnvValue>,
    /// For stdio: the working directory; relative to the config file.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cwd: Option<PathBuf>,
    /// For streamable HTTP: the endpoint, e.g. `http://127.0.0.1:3001/mcp`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub url: Option<String>,
    /// For streamable HTTP: headers sent with every request, their values read from the
    /// environment or a file (`Authorization = { env = "DOCS_TOKEN", prefix = "Bearer " }`),
    /// again at each connection (a token rotated in its file is picked up when the server
    /// is next connected to).
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub headers: BTreeMap<String, SecretRef>,
    /// For streamable HTTP: query parameters added to `url`, their values secrets read as
    /// `headers`' are (`query = { apiKey = { env = "SEARCH_KEY" } }`), for servers that
    /// take their key in the URL; messages and logs never show a URL's query values.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub query: BTreeMap<String, SecretRef>,
    /// Upper bound of one call (the caller's deadline may be shorter).
    #[serde(default = "default_timeout", with = "agentrt_core::duration")]
    pub timeout: Duration,
    /// Upper bound of starting and connecting: process start, `initialize`, `tools/list`.
    #[serde(default = "default_connect_timeout", with = "agentrt_core::duration")]
    pub connect_timeout: Duration,
    /// Longest output text of one call, in bytes; longer output is cut, saying so.
    #[serde(default = "default_max_output_bytes")]
    pub max_output_bytes: usize,
    /// Largest message accepted from the server, in bytes; larger ones are dropped, and
    /// a call whose answer is larger is an error result naming this setting.
    #[serde(default = "default_max_message_bytes")]
    pub max_message_bytes: usize,
}

fn default_timeout() -> Duration {
    Duration::from_secs(30)
}
fn default_connect_timeout() -> Duration {
    Duration::from_secs(10)
}
fn default_max_output_bytes() -> usize {
    1024 * 1024
}
fn default_max_message_bytes() -> usize {
    4 * 1024 * 1024
}

/// The value of an environment variable for a child process: given, or a secret.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
#[serde(untagged)]
pub enum EnvValue {
    /// A value written in the config: not secret.
    Plain(String),
    /// A secret read from the tool executor's environment or a file.
    Secret(SecretRef),
}

/// A string (a number or a boolean is taken as its text), or a table saying where to read
/// a secret; anything else is refused saying what is accepted.
impl<'de> Deserialize<'de> for EnvValue {
    fn deserialize<D: serde::Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        struct Value;
        impl<'de> serde::de::Visitor<'de> for Value {
            type Value = EnvValue;

            fn expecting(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
                f.write_str(
                    "a variable's value: a string, or where to read a secret \
                     (`{ env = \"VAR\" }` or `{ file = \"path\" }`)",
                )
            }

            fn visit_str<E: serde::de::Error>(self, text: &str) -> Result<EnvValue, E> {
                Ok(EnvValue::Plain(text.to_owned()))
            }

            fn visit_i64<E: serde::de::Error>(self, n: i64) -> Result<EnvValue, E> {
                Ok(EnvValue::Plain(n.to_string()))
            }

            fn visit_u64<E: serde::de::Error>(self, n: u64) -> Result<EnvValue, E> {
                Ok(EnvValue::Plain(n.to_string()))
            }

            fn visit_f64<E: serde::de::Error>(self, n: f64) -> Result<EnvValue, E> {
                Ok(EnvValue::Plain(n.to_string()))
            }

            fn visit_bool<E: serde::de::Error>(self, b: bool) -> Result<EnvValue, E> {
                Ok(EnvValue::Plain(b.to_string()))
            }

            fn visit_map<A: serde::de::MapAccess<'de>>(self, map: A) -> Result<EnvValue, A::Error> {
                SecretRef::deserialize(serde::de::value::MapAccessDeserializer::new(map))
                    .map(EnvValue::Secret)
            }
        }
        deserializer.deserialize_any(Value)
    }
}

impl McpServerConfig {
    /// Makes relative paths (the working directory, secret files) relative to `dir`.
    pub fn resolve_paths(&mut self, dir: &Path) {
        if let Some(cwd) = &mut self.cwd
            && cwd.is_relative()
        {
            *cwd = dir.join(&*cwd);
        }
        for value in self.env.values_mut() {
            if let EnvValue::Secret(secret) = value {
                secret.resolve_paths(dir);
            }
        }
        for secret in self.headers.values_mut().chain(self.query.values_mut()) {
            secret.resolve_paths(dir);
        }
    }

    /// Checks the entry without reading secrets.
    pub fn check(&self) -> std::result::Result<(), String> {
        check_source_name(&self.name)?;
        match (&self.command, &self.url) {
            (Some(command), None) if !command.is_empty() => {}
            (None, Some(url)) => {
                let shown = crate::shown_url(url);
                let parsed = reqwest::Url::parse(url).map_err(|e| format!("url {shown:?}: {e}"))?;
                if !matches!(parsed.scheme(), "http" | "https") {
                    return Err(format!("url {shown:?} must be http or https"));
                }
                crate::no_credentials(&parsed).map_err(|e| format!("url {shown:?}: {e}"))?;
            }
            _ => return Err("give either `command` (stdio) or `url` (streamable HTTP)".into()),
        }
        if self.url.is_none() && (!self.headers.is_empty() || !self.query.is_empty()) {
            return Err("`headers` and `query` apply to `url` servers only".into());
        }
        for (name, secret) in &self.query {
            if name.is_empty() {
                return Err("a `query` parameter needs a name".into());
            }
            secret.check().map_err(|e| format!("query {name}: {e}"))?;
        }
        if self.url.is_some() && (!self.env.is_empty() || !self.args.is_empty()) {
            return Err("`args` and `env` apply to `command` servers only".into());
        }
        for (name, value) in &self.env {
            if let EnvValue::Secret(secret) = value {
                secret.check().map_err(|e| format!("env {name}: {e}"))?;
            }
        }
        for (name, secret) in &self.headers {
            reqwest::header::HeaderName::from_bytes(name.as_bytes())
                .map_err(|_| format!("{name:?} is not a valid header name"))?;
            // The transport sets these itself (the SDK would refuse every request).
            if [
                "accept",
                "mcp-session-id",
                "mcp-protocol-version",
                "last-event-id",
            ]
            .iter()
            .any(|own| name.eq_ignore_ascii_case(own))
            {
                return Err(format!(
                    "header {name:?} is the MCP transport's own to set: leave it out"
                ));
            }
            secret.check().map_err(|e| format!("header {name}: {e}"))?;
        }
        if self.timeout.is_zero() || self.connect_timeout.is_zero() {
            return Err("`timeout` and `connect_timeout` must be positive".into());
        }
        if self.max_output_bytes < 1024 || self.max_message_bytes < 1024 {
            return Err("`max_output_bytes` and `max_message_bytes` must be at least 1024".into());
        }
        Ok(())
    }
}

/// How to reach the server (a stdio server's secrets read).
enum Transport {
    Stdio {
        command: String,
        args: Vec<String>,
        env: Vec<(String, Secret)>,
        cwd: Option<PathBuf>,
    },
    /// Its secrets are read at each connection (see [`http_endpoint`]).
    Http {
        url: String,
        client: reqwest::Client,
    },
}

/// What the server is now.
struct State {
    /// The live connection; `None` while the server is down.
    peer: Option<Peer<RoleClient>>,
    /// Why it is down, for `UNAVAILABLE` messages.
    down: String,
    /// When the supervisor tries to connect again, while it waits to.
    retry_at: Option<Instant>,
    /// The tools it last listed.
    tools: Vec<ListedTool>,
    /// Which connection `peer` is (counted from 1): a call that saw its connection fail
    /// asks for that one to be dropped, not a newer one.
    connection: u64,
    /// The tools last left out because they can only be called as tasks (warned of when
    /// they change, not at every listing).
    task_only: Vec<String>,
    /// The tools of the last listing offered as taking any object (listed without
    /// `inputSchema`), logged when they change rather than at every listing.
    schemaless: Vec<String>,
    /// Tools left out for their size at the last listing ([`MAX_TOOL_BYTES`],
    /// [`MAX_LISTED_BYTES`]), as warned of.
    oversized: (Vec<String>, bool),
}

struct Shared {
    config: McpServerConfig,
    transport: Transport,
    state: RwLock<State>,
    /// Tells the catalogue that the list changed.
    changes: Changes,
    /// The server said its tools changed: list them again.
    relist: Notify,
    /// A call saw the connection fail: drop it and connect again.
    reconnect: Notify,
    /// A call timed out: ask the server whether it still answers.
    probe: Notify,
    /// The connection the last such call saw fail (see [`State::connection`]).
    failed_connection: AtomicU64,
    /// Calls in flight: while there are, an HTTP server is not checked (see [`serve`]).
    calls: AtomicUsize,
    /// Why the stdio server's output was cut off, when this replica cut it (a message that
    /// would not end; see [`bounded::BoundedLines`]): said of the calls that fail with it,
    /// and of the connection's end, instead of "the connection closed".
    cut_off: bounded::CutOff,
}

impl Shared {
    fn name(&self) -> &str {
        &self.config.name
    }

    /// A call refused while the server is down (`state`): why, and when it is tried
    /// again.
    fn unavailable(&self, state: &State) -> CallError {
        let retry_after = state
            .retry_at
            .map(|at| at.saturating_duration_since(Instant::now()))
            .filter(|wait| !wait.is_zero())
            .unwrap_or(RETRY_WHILE_CONNECTING);
        CallError::Unavailable {
            source_name: self.name().to_owned(),
            reason: format!("MCP server {:?} is down: {}", self.name(), state.down),
            retry_after,
            sent: false,
        }
    }

    fn set_down(&self, reason: String) {
        let mut state = self.state.write().unwrap_or_else(|e| e.into_inner());
        state.peer = None;
        state.down = reason;
    }
}

/// An MCP server's tools.
pub struct McpToolset {
    shared: Arc<Shared>,
    stop: CancellationToken,
    supervisor: tokio::sync::Mutex<Option<JoinHandle<()>>>,
}

impl McpToolset {
    /// Reads the server's secrets, starts its supervisor and waits for its first connection
    /// attempt (at most `connect_timeout`). A server that cannot be reached yet is not an
    /// error: its supervisor keeps trying, and its tools appear once it answers.
    pub async fn start(config: McpServerConfig, changes: Changes) -> Result<Self> {
        config
            .check()
            .map_err(|message| Error::source(&config.name, message))?;
        let transport = if let Some(url) = &config.url {
            // Read now so that a missing secret fails the start, and again at each
            // connection.
            http_endpoint(&config, url).map_err(|e| Error::source(&config.name, e))?;
            Transport::Http {
                url: url.clone(),
                client: crate::http::client().map_err(|e| Error::source(&config.name, e))?,
            }
        } else {
            let mut env = Vec::new();
            for (name, value) in &config.env {
                let value = match value {
                    EnvValue::Plain(value) => Secret::new(value.clone()),
                    EnvValue::Secret(secret) => secret
                        .read()
                        .map_err(|e| Error::source(&config.name, format!("env {name}: {e}")))?,
                };
                env.push((name.clone(), value));
            }
            Transport::Stdio {
                command: config.command.clone().unwrap_or_default(),
                args: config.args.clone(),
                env,
                cwd: config.cwd.clone(),
            }
        };
        let shared = Arc::new(Shared {
            transport,
            state: RwLock::new(State {
                peer: None,
                down: "not connected yet".into(),
                retry_at: None,
                tools: Vec::new(),
                connection: 0,
                task_only: Vec::new(),
                schemaless: Vec::new(),
                oversized: (Vec::new(), false),
            }),
            changes,
            relist: Notify::new(),
            probe: Notify::new(),
            reconnect: Notify::new(),
            failed_connection: AtomicU64::new(0),
            calls: AtomicUsize::new(0),
            cut_off: bounded::CutOff::default(),
            config,
        });
        let stop = CancellationToken::new();
        let (first_tx, first_rx) = oneshot::channel();
        let span = info_span!("mcp_server", source = %shared.name());
        let supervisor =
            tokio::spawn(supervise(shared.clone(), stop.clone(), first_tx).instrument(span));
        // The supervisor bounds its attempt by `connect_timeout`; this bound is a backstop.
        let limit = shared.config.connect_timeout + Duration::from_secs(5);
        let _ = tokio::time::timeout(limit, first_rx).await;
        Ok(Self {
            shared,
            stop,
            supervisor: tokio::sync::Mutex::new(Some(supervisor)),
        })
    }

    /// Whether the server is connected now.
    pub fn is_connected(&self) -> bool {
        self.shared
            .state
            .read()
            .map(|s| s.peer.is_some())
            .unwrap_or(false)
    }
}

#[async_trait]
impl Toolset for McpToolset {
    fn name(&self) -> &str {
        self.shared.name()
    }

    async fn list(&self) -> Result<Vec<ListedTool>> {
        let state = self.shared.state.read().unwrap_or_else(|e| e.into_inner());
        Ok(state.tools.clone())
    }

    async fn call(
        &self,
        tool: &str,
        arguments: serde_json::Value,
        ctx: &ToolContext,
    ) -> Result<ToolOutput, CallError> {
        let shared = &self.shared;
        let (peer, connection) = {
            let state = shared.state.read().unwrap_or_else(|e| e.into_inner());
            match &state.peer {
                Some(peer) => (peer.clone(), state.connection),
                None => return Err(shared.unavailable(&state)),
            }
        };
        let arguments = match arguments {
            serde_json::Value::Object(map) => map,
            _ => serde_json::Map::new(),
        };
        let mut params = CallToolRequestParams::new(tool.to_owned()).with_arguments(arguments);
        if !ctx.call_id.is_empty() {
            // A call sent again (after a take-over) carries the same key: a server that
            // honours it does the work once.
            let mut meta = RequestMetaObject::new();
            meta.0
                .0
                .insert(IDEMPOTENCY_META.to_owned(), ctx.call_id.clone().into());
            params.meta = Some(meta);
        }
        let timeout = shared.config.timeout;
        // Dropping the call (here on timeout or cancel, or by the caller) sends
        // `notifications/cancelled` for it.
        let mut in_flight = InFlight::new(&shared.calls, &shared.probe);
        let outcome = tokio::select! {
            outcome = tokio::time::timeout(timeout, peer.call_tool(params)) => outcome,
            () = ctx.cancel.cancelled() => {
                in_flight.finished();
                return Ok(ToolOutput::stopped());
            }
        };
        in_flight.finished();
        // Counted no more when the probe asks what else is in flight.
        drop(in_flight);
        let offered = offered_name(shared.name(), tool);
        match outcome {
            Err(_) => {
                shared.probe.notify_one();
                Ok(ToolOutput::timed_out(format!(
                    "MCP server {:?} did not finish tool {tool:?} within {timeout:?}; the call \
                     was cancelled",
                    shared.name()
                )))
            }
            Ok(Ok(result)) => Ok(content::to_output(
                result,
                &offered,
                shared.config.max_output_bytes,
            )),
            Ok(Err(ServiceError::McpError(error)))
                if let Some(max) = bounded::is_too_large(error.data.as_ref()) =>
            {
                Ok(ToolOutput::error(too_large(shared.name(), tool, max)))
            }
            Ok(Err(ServiceError::McpError(error))) => {
                let mut message = format!(
                    "MCP server {:?} refused the call of {tool:?}: {} (code {})",
                    shared.name(),
                    error.message,
                    error.code.0
                );
                truncate_text(&mut message, shared.config.max_output_bytes);
                Ok(ToolOutput::error(message))
            }
            Ok(Err(ServiceError::TransportSend(error)))
                if let Some(outcome) =
                    request_failed(shared, tool, connection, error.error.as_ref()) =>
            {
                outcome
            }
            Ok(Err(error @ (ServiceError::TransportClosed | ServiceError::TransportSend(_)))) => {
                debug!(source = %shared.name(), %error, "the connection failed during a call");
                // Only that connection is dropped: a failure noticed after the server was
                // connected again leaves the new connection alone.
                shared
                    .failed_connection
                    .store(connection, Ordering::Release);
                shared.reconnect.notify_one();
                // The server is down (a proxy's 502 says so too): UNAVAILABLE, saying what
                // it did in words, not in the SDK's types.
                Err(CallError::Unavailable {
                    source_name: shared.name().to_owned(),
                    reason: format!(
                        "the call to MCP server {:?} failed: {}; reconnecting",
                        shared.name(),
                        shared
                            .cut_off
                            .why()
                            .unwrap_or_else(|| describe::service_error(&error))
                    ),
                    retry_after: RETRY_WHILE_CONNECTING,
                    sent: true,
                })
            }
            Ok(Err(error)) => Ok(ToolOutput::error(format!(
                "the call of {tool:?} to MCP server {:?} failed: {}",
                shared.name(),
                describe::service_error(&error)
            ))),
        }
    }

    async fn refresh(&self) -> Result<()> {
        self.shared.relist.notify_one();
        Ok(())
    }

    fn lists_at_run_time(&self) -> bool {
        true
    }

    fn down(&self) -> Option<CallError> {
        let state = self.shared.state.read().unwrap_or_else(|e| e.into_inner());
        state
            .peer
            .is_none()
            .then(|| self.shared.unavailable(&state))
    }

    async fn shutdown(&self) {
        self.stop.cancel();
        if let Some(supervisor) = self.supervisor.lock().await.take() {
            let _ = supervisor.await;
        }
    }
}

impl Drop for McpToolset {
    fn drop(&mut self) {
        // The supervisor stops (and with it the child process) even without `shutdown`.
        self.stop.cancel();
    }
}

/// The error result of a call whose answer was over `max_message_bytes` (`max`).
fn too_large(source: &str, tool: &str, max: u64) -> String {
    format!(
        "the answer of MCP server {source:?} to {tool:?} is larger than `max_message_bytes` \
         ({max} bytes), the most the tool executor accepts; it was not read"
    )
}

/// The client side of one connection: hears `notifications/tools/list_changed`.
struct Handler {
    shared: Arc<Shared>,
}

impl ClientHandler for Handler {
    async fn on_tool_list_changed(&self, _context: NotificationContext<RoleClient>) {
        debug!(source = %self.shared.name(), "tool list changed");
        self.shared.relist.notify_one();
    }

    fn get_info(&self) -> ClientConfig {
        ClientConfig::new(
            ClientCapabilities::default(),
            Implementation::new("agentrt-tool-executor", env!("CARGO_PKG_VERSION")),
        )
    }
}

/// A live connection, and the child process behind it for stdio.
struct Connection {
    service: RunningService<RoleClient, Handler>,
    child: Option<ServerProcess>,
}

/// A stdio server's child process, leader of a process group of its own: stopping the
/// server stops what it started as well (`npx` runs the server as a child of its own, and
/// a server may start helpers), which stopping the child alone would leave running.
struct ServerProcess {
    child: Child,
    /// The group's id (the child's pid); `None` once the group was killed.
    group: Option<rustix::process::Pid>,
}

impl ServerProcess {
    fn new(child: Child) -> Self {
        let group = child
            .id()
            .and_then(|id| i32::try_from(id).ok())
            .and_then(rustix::process::Pid::from_raw);
        if let Some(group) = group {
            agentrt_core::children::started(group.as_raw_nonzero().get());
        }
        Self { child, group }
    }

    /// Kills every process left in the group, once (right after the child is gone: a
    /// group with no process left has an id that may be given again).
    fn kill_group(&mut self) {
        if let Some(group) = self.group.take() {
            // Fails (ESRCH) when no process is left.
            let _ = rustix::process::kill_process_group(group, rustix::process::Signal::KILL);
            agentrt_core::children::ended(group.as_raw_nonzero().get());
        }
    }
}

impl Drop for ServerProcess {
    fn drop(&mut self) {
        self.kill_group();
    }
}

/// Connects, serves, and reconnects with backoff until `stop`.
async fn supervise(shared: Arc<Shared>, stop: CancellationToken, first: oneshot::Sender<()>) {
    let mut first = Some(first);
    let mut backoff = FIRST_BACKOFF;
    loop {
        let attempt = tokio::select! {
            () = stop.cancelled() => return,
            attempt = tokio::time::timeout(shared.config.connect_timeout, connect(&shared)) => attempt,
        };
        match attempt {
            Ok(Ok(connection)) => {
                // How long the connection lasted, not how long it took to make.
                let started = Instant::now();
                info!("connected to the MCP server");
                if let Some(first) = first.take() {
                    let _ = first.send(());
                }
                let reason = serve(&shared, connection, &stop).await;
                if stop.is_cancelled() {
                    shared.set_down("the tool executor is shutting down".into());
                    return;
                }
                warn!(%reason, "MCP server disconnected; reconnecting");
                shared.set_down(format!("{reason}; the tool executor connects again"));
                if started.elapsed() > STABLE {
                    backoff = FIRST_BACKOFF;
                }
            }
            failed => {
                let reason = match failed {
                    Ok(Err(reason)) => reason,
                    _ => format!(
                        "it did not start and answer `initialize` and `tools/list` within {:?}",
                        shared.config.connect_timeout
                    ),
                };
                warn!(%reason, retry_in = ?backoff, "cannot connect to the MCP server");
                shared.set_down(format!(
                    "{reason}; the tool executor tries again, waiting {backoff:?}"
                ));
            }
        }
        if let Some(first) = first.take() {
            let _ = first.send(());
        }
        shared
            .state
            .write()
            .unwrap_or_else(|e| e.into_inner())
            .retry_at = Some(Instant::now() + backoff);
        tokio::select! {
            () = stop.cancelled() => return,
            () = tokio::time::sleep(backoff) => {}
        }
        shared
            .state
            .write()
            .unwrap_or_else(|e| e.into_inner())
            .retry_at = None;
        backoff = (backoff * 2).min(MAX_BACKOFF);
    }
}

/// The URL (`url` with the `query` secrets) and headers of an HTTP server's requests, their
/// secrets read now.
fn http_endpoint(
    config: &McpServerConfig,
    url: &str,
) -> std::result::Result<
    (
        String,
        HashMap<reqwest::header::HeaderName, reqwest::header::HeaderValue>,
    ),
    String,
> {
    let mut headers = HashMap::new();
    for (name, secret) in &config.headers {
        let value = secret.read().map_err(|e| format!("header {name}: {e}"))?;
        let name =
            reqwest::header::HeaderName::from_bytes(name.as_bytes()).map_err(|e| e.to_string())?;
        let mut value = reqwest::header::HeaderValue::from_str(value.expose())
            .map_err(|_| format!("header {name}: not a valid value"))?;
        value.set_sensitive(true);
        headers.insert(name, value);
    }
    if config.query.is_empty() {
        return Ok((url.to_owned(), headers));
    }
    let mut parsed = reqwest::Url::parse(url).map_err(|e| e.to_string())?;
    {
        let mut pairs = parsed.query_pairs_mut();
        for (name, secret) in &config.query {
            let value = secret.read().map_err(|e| format!("query {name}: {e}"))?;
            pairs.append_pair(name, value.expose());
        }
    }
    Ok((parsed.into(), headers))
}

/// Starts (stdio) or reaches (HTTP) the server, initializes and lists its tools. Dropping
/// the future part-way kills a child process it started.
async fn connect(shared: &Arc<Shared>) -> std::result::Result<Connection, String> {
    let handler = Handler {
        shared: shared.clone(),
    };
    let (service, child) = match &shared.transport {
        Transport::Stdio {
            command,
            args,
            env,
            cwd,
        } => {
            let mut cmd = Command::new(command);
            cmd.args(args)
                .env_clear()
                .stdin(Stdio::piped())
                .stdout(Stdio::piped())
                .stderr(Stdio::piped())
                .process_group(0)
                .kill_on_drop(true);
            for name in INHERITED_ENV {
                if let Some(value) = std::env::var_os(name) {
                    cmd.env(name, value);
                }
            }
            for (name, value) in env {
                cmd.env(name, value.expose());
            }
            if let Some(cwd) = cwd {
                cmd.current_dir(cwd);
            }
            let child = cmd.spawn().map_err(|e| {
                // A working directory that is not there fails the start as a missing
                // command would (ENOENT): say which it is.
                match cwd {
                    Some(cwd) if !std::path::Path::new(cwd).is_dir() => format!(
                        "cannot start {command:?}: its working directory (cwd) {cwd:?} is not \
                         a directory that exists"
                    ),
                    _ => format!("cannot start {command:?}: {e}"),
                }
            })?;
            let mut process = ServerProcess::new(child);
            let child = &mut process.child;
            let (Some(stdin), Some(stdout)) = (child.stdin.take(), child.stdout.take()) else {
                return Err("the child process has no stdin or stdout".into());
            };
            let mut stderr = child
                .stderr
                .take()
                .map(|stderr| tokio::spawn(log_stderr(stderr).in_current_span()));
            // The bound is enforced (and an oversized answer answered for) before the
            // SDK reads a line; its own bound only backs that up.
            let max = shared.config.max_message_bytes;
            shared.cut_off.clear();
            let stdout = lenient::ToolListLines::new(
                bounded::BoundedLines::new(stdout, max).telling(shared.cut_off.clone()),
            );
            let transport =
                AsyncRwTransport::new(stdout, stdin).with_max_line_length(max.saturating_add(1));
            let service = match handler.serve(lenient::Lenient(transport)).await {
                Ok(service) => service,
                // A process that exits before it answers (a script that is not there, a
                // package not installed) said why on stderr: the reason says it too.
                Err(error) => {
                    let mut why = describe::init_error(&error);
                    if let Ok(Ok(status)) =
                        tokio::time::timeout(EXIT_NOTICE, process.child.wait()).await
                    {
                        why = format!("{why}: the process exited ({status})");
                        if let Some(task) = stderr.take()
                            && let Ok(Ok(Some(last))) =
                                tokio::time::timeout(EXIT_NOTICE, task).await
                        {
                            why = format!(
                                "{why}; the last line it wrote to stderr: {}",
                                crate::http::quoted(&last)
                            );
                        }
                    }
                    return Err(why);
                }
            };
            (service, Some(process))
        }
        Transport::Http { url, client } => {
            let (url, headers) = http_endpoint(&shared.config, url)?;
            let config = StreamableHttpClientTransportConfig::with_uri(url)
                .custom_headers(headers)
                .max_json_response_size(shared.config.max_message_bytes)
                .max_sse_event_size(shared.config.max_message_bytes);
            let transport = StreamableHttpClientTransport::with_client(
                bounded::BoundedHttpClient(client.clone()),
                config,
            );
            let service = handler
                .serve(lenient::Lenient(transport))
                .await
                .map_err(|e| {
                    format!(
                        "cannot connect to {}: {}",
                        crate::shown_url(&shared.config.url.clone().unwrap_or_default()),
                        describe::init_error(&e)
                    )
                })?;
            (service, None)
        }
    };
    // Every `tools/list` asks the server: rmcp's response cache would answer the health
    // checks and the probe of a hung server from memory (for a server that gives its
    // lists a `ttlMs`), and keep a stale list when a refresh fails.
    service
        .peer()
        .set_response_cache_config(ClientCacheConfig::disabled())
        .await;
    let tools = list_tools(shared, service.peer(), false).await?;
    install(shared, service.peer().clone(), tools);
    Ok(Connection { service, child })
}

/// Why a `tools/list` failed: said in words, and whether the server answered it (with an
/// error), which shows it is there, or did not.
struct Unlisted {
    reason: String,
    answered: bool,
}

impl From<Unlisted> for String {
    fn from(unlisted: Unlisted) -> Self {
        unlisted.reason
    }
}

/// Lists every tool, following pages up to the bounds (and not a cursor the server gave
/// before, nor a tool it listed before). Tools that can only be called as tasks are left
/// out: every plain call of one fails. A tool's input schema without a `type` is offered
/// as an object's (its arguments are one), which model APIs ask of every function.
async fn list_tools(
    shared: &Shared,
    peer: &Peer<RoleClient>,
    again: bool,
) -> std::result::Result<Vec<ListedTool>, Unlisted> {
    let name = shared.name();
    let mut tools = Vec::new();
    let mut listed = std::collections::HashSet::new();
    let mut cursors = std::collections::HashSet::new();
    let mut task_only = Vec::new();
    let mut schemaless = Vec::new();
    let mut oversized = Vec::new();
    let mut over_budget = false;
    let mut listed_bytes = 0;
    let mut cursor: Option<String> = None;
    let mut pages = 0;
    'pages: loop {
        if pages == MAX_PAGES {
            warn!(
                max = MAX_PAGES,
                "the MCP server lists too many pages; the rest are left out"
            );
            break;
        }
        pages += 1;
        let params = PaginatedRequestParams::default().with_cursor(cursor);
        let page = match peer.list_tools(Some(params)).await {
            Ok(page) => page,
            // On a list asked for again, a later page the server refuses (its cursor
            // unknown to a server restarted since the first page, an error of its own)
            // keeps the list it had: tools of later pages do not go missing for a while.
            Err(ServiceError::McpError(error)) if pages > 1 && again => {
                return Err(Unlisted {
                    reason: format!("`tools/list` refused page {pages}: {}", error.message),
                    answered: true,
                });
            }
            // The first list of a connection: a later page the server refuses leaves the
            // tools of the pages before it listed, not none of the server's.
            Err(ServiceError::McpError(error)) if pages > 1 => {
                warn!(
                    page = pages,
                    error = %error.message,
                    "the MCP server refused a page of its tools; the rest are left out"
                );
                break;
            }
            Err(e) => {
                return Err(Unlisted {
                    reason: format!("`tools/list` failed: {}", describe::service_error(&e)),
                    // A proxy's refusal (502, 503, 504) says the server behind it is not
                    // there; a 429, that it is, busy.
                    answered: match &e {
                        ServiceError::McpError(_) => true,
                        ServiceError::TransportSend(error) => {
                            match describe::send_failure(error.error.as_ref()) {
                                describe::SendFailure::Answered { refusal, .. } => {
                                    refusal.is_none_or(|refusal| refusal.busy)
                                }
                                _ => false,
                            }
                        }
                        _ => false,
                    },
                });
            }
        };
        for tool in page.tools {
            if !listed.insert(tool.name.clone()) {
                continue;
            }
            if tools.len() == MAX_TOOLS {
                warn!(
                    max = MAX_TOOLS,
                    "the MCP server lists too many tools; the rest are left out"
                );
                break 'pages;
            }
            if only_as_task(&tool) {
                if task_only.len() < MAX_TOOLS {
                    task_only.push(tool.name.into_owned());
                }
                continue;
            }
            if tool
                .meta
                .as_ref()
                .is_some_and(|meta| meta.0.contains_key(lenient::NO_SCHEMA_META))
            {
                schemaless.push(tool.name.to_string());
            }
            let mut description = tool
                .description
                .map(|d| d.into_owned())
                .or(tool.title)
                .unwrap_or_default();
            crate::cut_description(&mut description);
            let input_schema = offered_schema(&tool.input_schema);
            let size = tool.name.len()
                + description.len()
                + serde_json::to_vec(&input_schema).map_or(usize::MAX, |json| json.len());
            if size > MAX_TOOL_BYTES {
                if oversized.len() < MAX_TOOLS {
                    oversized.push(tool.name.into_owned());
                }
                continue;
            }
            if listed_bytes + size > MAX_LISTED_BYTES {
                over_budget = true;
                break 'pages;
            }
            listed_bytes += size;
            tools.push(ListedTool {
                spec: ToolSpec {
                    name: offered_name(name, &tool.name),
                    description,
                    input_schema: input_schema.into(),
                    source: ToolSource::Mcp,
                },
                origin: format!("MCP server {name:?}, tool {:?}", tool.name),
                source_name: tool.name.into_owned(),
            });
        }
        cursor = page.next_cursor;
        match &cursor {
            None => break,
            Some(next) if !cursors.insert(next.clone()) => {
                warn!(
                    cursor = %crate::http::quoted(next),
                    "the MCP server gave a `nextCursor` it gave before; its listing ends there"
                );
                break;
            }
            Some(_) => {}
        }
    }
    let mut state = shared.state.write().unwrap_or_else(|e| e.into_inner());
    if state.schemaless != schemaless {
        if !schemaless.is_empty() {
            warn!(
                tools = ?schemaless,
                "MCP tools listed without `inputSchema` are offered as taking any object"
            );
        }
        state.schemaless = schemaless;
    }
    if state.task_only != task_only {
        if !task_only.is_empty() {
            warn!(
                tools = ?task_only,
                "MCP tools that can only be called as tasks (`execution.taskSupport` \
                 \"required\") are left out of the catalogue: the tool executor makes plain calls"
            );
        }
        state.task_only = task_only;
    }
    let oversized = (oversized, over_budget);
    if state.oversized != oversized {
        if !oversized.0.is_empty() {
            warn!(
                tools = ?oversized.0,
                max_bytes = MAX_TOOL_BYTES,
                "MCP tools larger than a tool may be (name, description and input schema) \
                 are left out of the catalogue"
            );
        }
        if oversized.1 {
            warn!(
                offered = tools.len(),
                max_bytes = MAX_LISTED_BYTES,
                "the MCP server lists more bytes of tools than one server may; the rest \
                 are left out"
            );
        }
        state.oversized = oversized;
    }
    Ok(tools)
}

/// A tool's input schema as offered: as listed, with `"type": "object"` when it names no
/// type (`{}` for a tool without arguments is common; OpenAI refuses a function whose
/// schema is not an object's, failing the whole request).
fn offered_schema(schema: &serde_json::Map<String, serde_json::Value>) -> serde_json::Value {
    let mut schema = schema.clone();
    if !schema.contains_key("type") {
        schema.insert("type".into(), "object".into());
    }
    serde_json::Value::Object(schema)
}

/// Whether `tool` can only be called as a task (MCP 2025-11-25), as kept in its `_meta`
/// by [`lenient::mend_tool_list`].
fn only_as_task(tool: &rmcp::model::Tool) -> bool {
    tool.meta
        .as_ref()
        .and_then(|meta| meta.0.get(lenient::TASK_SUPPORT_META))
        .and_then(serde_json::Value::as_str)
        == Some("required")
}

/// One call counted in flight until it is dropped.
struct InFlight<'a> {
    calls: &'a AtomicUsize,
    /// Notified when the call is dropped unfinished after [`PROBE_AFTER`].
    probe: &'a Notify,
    started: Instant,
    finished: bool,
}

/// How long a call dropped unfinished by its caller (its gRPC deadline passed, usually
/// before the source's own `timeout`) must have waited for the server to have it checked,
/// as a call that timed out has: a server that stopped answering is otherwise never
/// found out, its every call ending at its caller's deadline.
const PROBE_AFTER: Duration = Duration::from_secs(1);
/// How often a probe put off while other calls are in flight looks again.
const PROBE_PUT_OFF: Duration = Duration::from_millis(200);

impl<'a> InFlight<'a> {
    fn new(calls: &'a AtomicUsize, probe: &'a Notify) -> Self {
        calls.fetch_add(1, Ordering::AcqRel);
        Self {
            calls,
            probe,
            started: Instant::now(),
            finished: false,
        }
    }

    /// The call has its outcome (or its caller cancelled it): nothing to check.
    fn finished(&mut self) {
        self.finished = true;
    }
}

impl Drop for InFlight<'_> {
    fn drop(&mut self) {
        self.calls.fetch_sub(1, Ordering::AcqRel);
        if !self.finished && self.started.elapsed() >= PROBE_AFTER {
            self.probe.notify_one();
        }
    }
}

/// The outcome of a call whose request failed on its own (see [`describe::SendFailure`]),
/// or `None` when its connection failed under it. The server's error answer is the call's
/// error result, and its session goes on. A refusal for now (429, 503, a proxy's 502 or
/// 504) is `UNAVAILABLE`, saying whether the call may have run, its session kept (the
/// checks of the server tell whether it is down). A server that cannot be reached is
/// `UNAVAILABLE`, the call not sent, and the connection is made again.
fn request_failed(
    shared: &Shared,
    tool: &str,
    connection: u64,
    error: &(dyn std::error::Error + Send + Sync + 'static),
) -> Option<Result<ToolOutput, CallError>> {
    let name = shared.name();
    Some(match describe::send_failure(error) {
        describe::SendFailure::Connection => return None,
        describe::SendFailure::Answered { why, refusal: None } => {
            debug!(source = %name, %why, "a call's request failed on its own");
            let mut message = format!("the call of {tool:?} to MCP server {name:?} failed: {why}");
            truncate_text(&mut message, shared.config.max_output_bytes);
            Ok(ToolOutput::error(message))
        }
        describe::SendFailure::Answered {
            why,
            refusal: Some(refusal),
        } => Err(CallError::Unavailable {
            source_name: name.to_owned(),
            reason: format!("MCP server {name:?} did not serve the call of {tool:?}: {why}"),
            retry_after: refusal.retry_after.map_or(RETRY_WHILE_CONNECTING, |secs| {
                Duration::from_secs(secs.min(MAX_BACKOFF.as_secs()))
            }),
            sent: refusal.sent,
        }),
        describe::SendFailure::Unreached(why) => {
            shared
                .failed_connection
                .store(connection, Ordering::Release);
            shared.reconnect.notify_one();
            Err(CallError::Unavailable {
                source_name: name.to_owned(),
                reason: format!("MCP server {name:?}: {why}; the tool executor connects again"),
                retry_after: RETRY_WHILE_CONNECTING,
                sent: false,
            })
        }
    })
}

/// Makes `peer` the live connection with `tools`, and tells the catalogue when they changed.
fn install(shared: &Shared, peer: Peer<RoleClient>, tools: Vec<ListedTool>) {
    let changed = {
        let mut state = shared.state.write().unwrap_or_else(|e| e.into_inner());
        if state.peer.is_none() {
            state.connection += 1;
        }
        state.peer = Some(peer);
        state.down.clear();
        let changed = state.tools != tools;
        state.tools = tools;
        changed
    };
    if changed {
        shared.changes.notify();
    }
}

/// Serves one connection until it ends or `stop`; says why it ended.
async fn serve(shared: &Arc<Shared>, connection: Connection, stop: &CancellationToken) -> String {
    let Connection { service, mut child } = connection;
    let peer = service.peer().clone();
    let connection = shared
        .state
        .read()
        .unwrap_or_else(|e| e.into_inner())
        .connection;
    let mut cancel = Some(service.cancellation_token());
    let waiting = service.waiting();
    tokio::pin!(waiting);
    let http = child.is_none();
    let mut check = tokio::time::interval_at(
        tokio::time::Instant::now() + HTTP_CHECK_EVERY,
        HTTP_CHECK_EVERY,
    );
    check.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    // A list asked for after `list_changed` that failed, asked for again at this time.
    let mut relist_again: Option<std::pin::Pin<Box<tokio::time::Sleep>>> = None;
    // When the tools were last listed again.
    let mut relisted: Option<Instant> = None;
    // A probe asked for (since that time) and put off while other calls are in flight,
    // looked at again at this time.
    let mut probe_put_off: Option<(Instant, std::pin::Pin<Box<tokio::time::Sleep>>)> = None;
    let reason = loop {
        tokio::select! {
            () = stop.cancelled() => {
                if let Some(cancel) = cancel.take() {
                    cancel.cancel();
                }
                let _ = tokio::time::timeout(EXIT_GRACE, &mut waiting).await;
                break "stopped".to_owned();
            }
            quit = &mut waiting => {
                break shared.cut_off.why().unwrap_or_else(|| describe::quit_reason(&quit));
            }
            status = async { match child.as_mut() { Some(c) => c.child.wait().await, None => std::future::pending().await } } => {
                break match status {
                    Ok(status) => format!("the process exited ({status})"),
                    Err(e) => format!("the process is gone ({e})"),
                };
            }
            () = shared.reconnect.notified() => {
                if shared.failed_connection.load(Ordering::Acquire) == connection {
                    if let Some(cancel) = cancel.take() {
                        cancel.cancel();
                    }
                    break "the connection failed during a call".to_owned();
                }
            }
            _ = check.tick(), if http => {
                // Calls in flight are bounded by their own timeouts, and one that times out
                // has the server probed (below): a server busy with a long call (one that
                // serves a call at a time, say) is not taken for one that stopped answering.
                if shared.calls.load(Ordering::Acquire) > 0 {
                    continue;
                }
                let limit = shared.config.connect_timeout;
                match tokio::time::timeout(limit, list_tools(shared, &peer, true)).await {
                    Ok(Ok(tools)) => install(shared, peer.clone(), tools),
                    // It answered (an HTTP 429, a JSON-RPC error): it is there, and its
                    // session goes on; its list is asked for again at the next check.
                    Ok(Err(Unlisted { reason, answered: true })) => {
                        debug!(%reason, "the server answered the check with an error");
                    }
                    Ok(Err(Unlisted { reason, .. })) => break format!("the server stopped answering: {reason}"),
                    Err(_) => break format!("the server did not answer `tools/list` within {limit:?}"),
                }
            }
            asked = async {
                match probe_put_off.as_mut() {
                    Some((asked, at)) => {
                        at.await;
                        *asked
                    }
                    None => {
                        shared.probe.notified().await;
                        Instant::now()
                    }
                }
            } => {
                probe_put_off = None;
                // A server that serves a call at a time answers nothing else while it
                // works on a long call: the probe waits for the calls in flight to end,
                // at most for as long as one may take (the source's `timeout`), after
                // which a server still silent is taken for a hung one.
                if shared.calls.load(Ordering::Acquire) > 0
                    && asked.elapsed() < shared.config.timeout
                {
                    probe_put_off = Some((asked, Box::pin(tokio::time::sleep(PROBE_PUT_OFF))));
                    continue;
                }
                let limit = shared.config.connect_timeout;
                match tokio::time::timeout(limit, list_tools(shared, &peer, true)).await {
                    Ok(Ok(tools)) => install(shared, peer.clone(), tools),
                    Ok(Err(Unlisted { answered: true, .. })) => {}
                    Ok(Err(Unlisted { reason, .. })) => break format!("the server stopped answering: {reason}"),
                    Err(_) => break format!(
                        "a call timed out, and the server did not answer `tools/list` within \
                         {limit:?} either"
                    ),
                }
            }
            notified = async {
                match relist_again.as_mut() {
                    Some(at) => {
                        at.await;
                        false
                    }
                    None => {
                        shared.relist.notified().await;
                        true
                    }
                }
            } => {
                relist_again = None;
                if notified
                    && let Some(last) = relisted
                    && last.elapsed() < RELIST_EVERY
                {
                    relist_again = Some(Box::pin(tokio::time::sleep_until(last + RELIST_EVERY)));
                    continue;
                }
                relisted = Some(Instant::now());
                let limit = shared.config.connect_timeout;
                match tokio::time::timeout(limit, list_tools(shared, &peer, true)).await {
                    Ok(Ok(tools)) => install(shared, peer.clone(), tools),
                    // Asked again until it answers: the list changed, and the catalogue
                    // would otherwise keep the old one until the next change.
                    Ok(Err(Unlisted { reason, .. })) => {
                        warn!(%reason, retry_in = ?RELIST_RETRY, "cannot list the tools again");
                        relist_again = Some(Box::pin(tokio::time::sleep(RELIST_RETRY)));
                    }
                    Err(_) => {
                        warn!(retry_in = ?RELIST_RETRY, "`tools/list` did not answer within {limit:?}");
                        relist_again = Some(Box::pin(tokio::time::sleep(RELIST_RETRY)));
                    }
                }
            }
        }
    };
    shared.set_down(reason.clone());
    if let Some(cancel) = cancel.take() {
        cancel.cancel();
    }
    if let Some(mut child) = child {
        stop_child(&mut child).await;
    }
    reason
}

/// Stops a child process as MCP's stdio transport has it: its stdin closed, then (after
/// [`EXIT_GRACE`]) SIGTERM to its group, then (after as long again) SIGKILL; then kills
/// what it left running. A server that cleans up on SIGTERM (`docker run` stopping its
/// container, say) gets to.
async fn stop_child(process: &mut ServerProcess) {
    drop(process.child.stdin.take());
    if tokio::time::timeout(EXIT_GRACE, process.child.wait())
        .await
        .is_ok()
    {
        process.kill_group();
        return;
    }
    if let Some(group) = process.group {
        // Fails (ESRCH) when no process is left.
        let _ = rustix::process::kill_process_group(group, rustix::process::Signal::TERM);
    }
    if tokio::time::timeout(EXIT_GRACE, process.child.wait())
        .await
        .is_err()
    {
        let _ = process.child.kill().await;
    }
    process.kill_group();
}

/// Lines of a child's stderr logged at once at most ([`StderrBudget`]).
const STDERR_BURST: u32 = 100;
/// Lines of a child's stderr logged per second past the burst.
const STDERR_PER_SECOND: u32 = 10;

/// How many of a child's stderr lines may be logged now: a server that chatters (or
/// writes without end) does not flood the tool executor's log, and the log says how
/// many lines it left out.
struct StderrBudget {
    tokens: f64,
    last: Instant,
    left_out: u64,
}

impl StderrBudget {
    fn new() -> Self {
        Self {
            tokens: f64::from(STDERR_BURST),
            last: Instant::now(),
            left_out: 0,
        }
    }

    /// Whether one more line is logged; when it is, how many were left out before it.
    fn take(&mut self, now: Instant) -> Option<u64> {
        let refill =
            now.saturating_duration_since(self.last).as_secs_f64() * f64::from(STDERR_PER_SECOND);
        self.tokens = (self.tokens + refill).min(f64::from(STDERR_BURST));
        self.last = now;
        if self.tokens < 1.0 {
            self.left_out += 1;
            return None;
        }
        self.tokens -= 1.0;
        Some(std::mem::take(&mut self.left_out))
    }
}

/// How long a child that failed to answer `initialize` is given to exit, and its stderr to
/// be read to its end, for the reason to say why.
const EXIT_NOTICE: Duration = Duration::from_millis(500);

/// Most bytes kept of a child's last stderr line, for a reason that quotes it.
const LAST_LINE_BYTES: usize = 300;

/// Logs what a child process writes to stderr, a chunk at a time (so a line without end
/// never piles up), within a [`StderrBudget`], until it closes; answers the last line
/// it wrote (cut at [`LAST_LINE_BYTES`]).
async fn log_stderr(mut stderr: tokio::process::ChildStderr) -> Option<String> {
    let mut buf = vec![0u8; 8192];
    let mut budget = StderrBudget::new();
    let mut last: Option<String> = None;
    loop {
        match stderr.read(&mut buf).await {
            Ok(0) | Err(_) => break,
            Ok(n) => {
                let text = String::from_utf8_lossy(&buf[..n]);
                if let Some(line) = text.lines().rev().find(|l| !l.trim().is_empty()) {
                    let mut line = line.trim().to_owned();
                    crate::cut_at(&mut line, LAST_LINE_BYTES);
                    last = Some(line);
                }
                for line in text.lines().filter(|l| !l.trim().is_empty()) {
                    match budget.take(Instant::now()) {
                        Some(0) => info!(stderr = %line, "mcp server says"),
                        Some(left_out) => {
                            info!(stderr = %line, left_out, "mcp server says (after lines left out: it wrote more than the log takes)");
                        }
                        None => {}
                    }
                }
            }
        }
    }
    if budget.left_out > 0 {
        info!(
            left_out = budget.left_out,
            "mcp server's last stderr lines were left out of the log"
        );
    }
    last
}

#[cfg(test)]
mod tests;
