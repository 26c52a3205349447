//! Layered settings: defaults, then an optional TOML file, then environment variables,
//! then flags, validated once at start-up.
//!
//! Every flag `--some-flag` also reads `<PREFIX>_SOME_FLAG` from the environment, so that
//! Kubernetes manifests and shells can set anything a flag can.

use std::{
    net::SocketAddr,
    path::{Path, PathBuf},
    time::Duration,
};

use clap::{ArgMatches, CommandFactory, FromArgMatches};
use serde::{Deserialize, Serialize, de::DeserializeOwned};

use crate::security::{AuthSettings, TlsSettings};

/// Why settings could not be loaded.
#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    /// The config file could not be read.
    #[error("cannot read config file {path}: {source}")]
    Read {
        /// The file.
        path: String,
        /// Why.
        source: std::io::Error,
    },
    /// The config file is not valid TOML for these settings.
    #[error("invalid config file {path}: {message}")]
    Parse {
        /// The file.
        path: String,
        /// What the parser said, with the line.
        message: String,
    },
    /// A setting is out of range.
    #[error("invalid setting `{field}`: {message}")]
    Invalid {
        /// The setting, as named in the config file.
        field: &'static str,
        /// What is accepted.
        message: String,
    },
}

/// Parses the command line of `C`, reading each flag that is not given from the
/// environment variable `<env_prefix>_<FLAG_NAME>`. Exits with usage on a bad command line.
pub fn parse_cli<C: CommandFactory + FromArgMatches>(env_prefix: &str) -> C {
    let command = C::command().mut_args(|arg| {
        let id = arg.get_id().as_str();
        if arg.get_long().is_none() || matches!(id, "help" | "version" | "print_config") {
            return arg;
        }
        let name = format!("{env_prefix}_{}", id.to_uppercase().replace('-', "_"));
        arg.env(name)
    });
    let matches: ArgMatches = command.get_matches();
    C::from_arg_matches(&matches).unwrap_or_else(|e| e.exit())
}

/// Reads settings of type `T` from a TOML file; fields it leaves out keep their defaults
/// and unknown fields are refused, so that a typo does not pass silently.
pub fn load_file<T: DeserializeOwned>(path: &Path) -> Result<T, ConfigError> {
    let text = std::fs::read_to_string(path).map_err(|source| ConfigError::Read {
        path: path.display().to_string(),
        source,
    })?;
    toml::from_str(&text).map_err(|e| ConfigError::Parse {
        path: path.display().to_string(),
        message: parse_error(&e, &text),
    })
}

/// What is wrong with a config file, and where: never its text (toml's own message quotes
/// the line, and a line that is wrong may hold a secret written where it must not be).
fn parse_error(error: &toml::de::Error, text: &str) -> String {
    let message = error.message().trim_end();
    match error.span() {
        Some(span) => {
            let before = &text[..span.start.min(text.len())];
            let line = before.matches('\n').count() + 1;
            let column = before.rsplit('\n').next().map_or(0, |l| l.chars().count()) + 1;
            format!("line {line}, column {column}: {message}")
        }
        None => message.to_owned(),
    }
}

/// The settings of `path` when one is given, else the defaults: the first two layers.
pub fn load_or_default<T: DeserializeOwned + Default>(
    path: Option<&Path>,
) -> Result<T, ConfigError> {
    path.map_or_else(|| Ok(T::default()), load_file)
}

/// Renders effective settings as TOML for `--print-config`. Secrets are masked by their
/// own `Serialize` implementation (see `agentrt_core::Secret`).
pub fn to_toml<T: Serialize>(settings: &T) -> String {
    // Secrets serialize masked; credentials inside URLs are masked here.
    agentrt_core::mask_url_credentials(
        &toml::to_string_pretty(settings).unwrap_or_else(|e| format!("# cannot render: {e}\n")),
    )
}

/// Settings every gRPC server has.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct ServerSettings {
    /// Address to listen on, HOST:PORT (a host name is resolved at start); port 0 picks a
    /// free port (the bound address is logged).
    #[serde(deserialize_with = "listen::deserialize")]
    pub listen: SocketAddr,
    /// How long running calls may take to finish after a shutdown signal.
    #[serde(with = "duration")]
    pub drain_grace: Duration,
    /// Largest request or response message, in bytes.
    pub max_message_bytes: usize,
    /// Most concurrent calls (HTTP/2 streams) on one connection.
    pub max_concurrent_streams: u32,
    /// Whether gRPC reflection (v1 and v1alpha) is served.
    pub reflection: bool,
    /// Time a new connection has to finish its handshake (TLS, then the HTTP/2 client
    /// preface); it is closed when it has not.
    #[serde(with = "duration")]
    pub handshake_timeout: Duration,
    /// Most connections open at once; more wait in the kernel's backlog. Lowered at start
    /// (with a warning) to fit the process's open-files limit.
    pub max_connections: usize,
    /// Most connections still handshaking at once.
    pub max_handshaking_connections: usize,
    /// Most connections open at once from one IP address (at most `max_connections`
    /// count); past it, a new one from that address is closed at once. Zero: no bound
    /// of its own.
    pub max_connections_per_ip: usize,
    /// A connection older than this is asked to go (HTTP/2 GOAWAY): calls in flight on it
    /// finish, new ones go to a new connection, which a load balancer may send to another
    /// replica. Zero (the default) keeps connections as long as their client does.
    #[serde(with = "duration")]
    pub max_connection_age: Duration,
    /// Address of the admin HTTP endpoint serving Prometheus metrics at `/metrics`; none
    /// by default (port 0 picks a free port, logged as `metrics_addr`).
    #[serde(
        default,
        skip_serializing_if = "Option::is_none",
        deserialize_with = "listen::option::deserialize"
    )]
    pub metrics_listen: Option<SocketAddr>,
    /// Address of a plaintext listener serving only `grpc.health.v1`, for probes that
    /// cannot speak TLS (Kubernetes' gRPC probes); none by default.
    #[serde(
        default,
        skip_serializing_if = "Option::is_none",
        deserialize_with = "listen::option::deserialize"
    )]
    pub health_listen: Option<SocketAddr>,
    /// TLS; plaintext (h2c) when absent.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tls: Option<TlsSettings>,
    /// Bearer tokens; every call is let in when none is configured.
    pub auth: AuthSettings,
}

impl ServerSettings {
    /// Defaults, listening on `listen`.
    pub fn listening_on(listen: SocketAddr) -> Self {
        Self {
            listen,
            ..Self::default()
        }
    }

    /// Checks ranges once at start-up.
    pub fn validate(&self) -> Result<(), ConfigError> {
        if self.drain_grace > Duration::from_secs(3600) {
            return Err(ConfigError::Invalid {
                field: "server.drain_grace",
                message: "must be at most 1h".into(),
            });
        }
        if !(1024..=256 * 1024 * 1024).contains(&self.max_message_bytes) {
            return Err(ConfigError::Invalid {
                field: "server.max_message_bytes",
                message: "must be between 1024 and 268435456".into(),
            });
        }
        if let Some(tls) = &self.tls
            && (tls.cert_file.as_os_str().is_empty() || tls.key_file.as_os_str().is_empty())
        {
            return Err(ConfigError::Invalid {
                field: "server.tls",
                message: "TLS needs both a certificate (--tls-cert) and a key (--tls-key)".into(),
            });
        }
        if !(Duration::from_millis(100)..=Duration::from_secs(300))
            .contains(&self.handshake_timeout)
        {
            return Err(ConfigError::Invalid {
                field: "server.handshake_timeout",
                message: "must be between 100ms and 5m".into(),
            });
        }
        if self.max_connections == 0 {
            return Err(ConfigError::Invalid {
                field: "server.max_connections",
                message: "must be positive".into(),
            });
        }
        if !(1..=self.max_connections).contains(&self.max_handshaking_connections) {
            return Err(ConfigError::Invalid {
                field: "server.max_handshaking_connections",
                message: format!(
                    "must be positive and at most server.max_connections ({})",
                    self.max_connections
                ),
            });
        }
        if self.max_concurrent_streams == 0 {
            return Err(ConfigError::Invalid {
                field: "server.max_concurrent_streams",
                message: "must be positive".into(),
            });
        }
        if !self.max_connection_age.is_zero()
            && !(Duration::from_secs(1)..=Duration::from_secs(7 * 24 * 3600))
                .contains(&self.max_connection_age)
        {
            return Err(ConfigError::Invalid {
                field: "server.max_connection_age",
                message: "must be 0s (no limit) or between 1s and 168h".into(),
            });
        }
        Ok(())
    }
}

impl Default for ServerSettings {
    fn default() -> Self {
        Self {
            listen: SocketAddr::from(([127, 0, 0, 1], 0)),
            drain_grace: Duration::from_secs(10),
            max_message_bytes: 4 * 1024 * 1024,
            max_concurrent_streams: 1024,
            reflection: true,
            handshake_timeout: Duration::from_secs(10),
            max_connections: 10_000,
            max_handshaking_connections: 512,
            max_connections_per_ip: 1000,
            max_connection_age: Duration::ZERO,
            metrics_listen: None,
            health_listen: None,
            tls: None,
            auth: AuthSettings::default(),
        }
    }
}

/// The flags every server binary takes: its config file, `--print-config`, and the
/// [`ServerSettings`] flags.
#[derive(Debug, Clone, Default, clap::Args)]
pub struct CommonArgs {
    /// TOML config file; flags and environment variables override it.
    #[arg(long, value_name = "FILE")]
    pub config: Option<std::path::PathBuf>,
    /// Print the effective settings (secrets masked) and exit.
    #[arg(long)]
    pub print_config: bool,
    #[command(flatten)]
    #[allow(missing_docs)]
    pub server: ServerArgs,
}

impl CommonArgs {
    /// The config file's settings (or the defaults) with the server flags applied: the
    /// layers a binary's own flags then go on top of.
    pub fn base<T: DeserializeOwned + Default>(
        &self,
        server: impl FnOnce(&mut T) -> &mut ServerSettings,
    ) -> Result<T, ConfigError> {
        let mut settings: T = load_or_default(self.config.as_deref())?;
        self.server.apply(server(&mut settings));
        Ok(settings)
    }
}

/// Flags for [`ServerSettings`]; each overrides the file and defaults when given.
#[derive(Debug, Clone, Default, clap::Args)]
pub struct ServerArgs {
    /// Address to listen on, HOST:PORT (port 0 picks a free port).
    #[arg(long, value_name = "HOST:PORT", value_parser = parse_listen)]
    pub listen: Option<SocketAddr>,
    /// Grace period for running calls after SIGTERM, e.g. `10s`.
    #[arg(long, value_name = "DURATION", value_parser = parse_duration)]
    pub drain_grace: Option<Duration>,
    /// Largest request or response message, in bytes.
    #[arg(long, value_name = "BYTES")]
    pub max_message_bytes: Option<usize>,
    /// Most concurrent calls on one connection.
    #[arg(long, value_name = "N")]
    pub max_concurrent_streams: Option<u32>,
    /// Serve gRPC reflection (`true` or `false`).
    #[arg(long, value_name = "BOOL")]
    pub reflection: Option<bool>,
    /// Time a connection has for its TLS handshake and HTTP/2 preface, e.g. `10s`.
    #[arg(long, value_name = "DURATION", value_parser = parse_duration)]
    pub handshake_timeout: Option<Duration>,
    /// Most connections open at once.
    #[arg(long, value_name = "N")]
    pub max_connections: Option<usize>,
    /// Most connections still handshaking at once.
    #[arg(long, value_name = "N")]
    pub max_handshaking_connections: Option<usize>,
    /// Most connections open at once from one IP address; 0: no bound of its own.
    #[arg(long, value_name = "N")]
    pub max_connections_per_ip: Option<usize>,
    /// Ask connections older than this to go (GOAWAY), e.g. `5m`; `0s`: never.
    #[arg(long, value_name = "DURATION", value_parser = parse_duration)]
    pub max_connection_age: Option<Duration>,
    /// Serve Prometheus metrics over HTTP at HOST:PORT/metrics.
    #[arg(long, value_name = "HOST:PORT", value_parser = parse_listen)]
    pub metrics_listen: Option<SocketAddr>,
    /// Serve only gRPC health, in plaintext, at HOST:PORT (for probes when TLS is on).
    #[arg(long, value_name = "HOST:PORT", value_parser = parse_listen)]
    pub health_listen: Option<SocketAddr>,
    /// Serve TLS with this certificate chain (PEM); needs `--tls-key`.
    #[arg(long, value_name = "FILE")]
    pub tls_cert: Option<PathBuf>,
    /// The TLS private key (PEM).
    #[arg(long, value_name = "FILE")]
    pub tls_key: Option<PathBuf>,
    /// Require client certificates chaining to these CAs (PEM): mutual TLS.
    #[arg(long, value_name = "FILE")]
    pub tls_client_ca: Option<PathBuf>,
    /// With mutual TLS, let in only clients whose certificate carries one of these names
    /// (DNS names or IP addresses, separated by commas).
    #[arg(long, value_name = "NAMES", value_delimiter = ',')]
    pub tls_allowed_client_names: Option<Vec<String>>,
    /// Require bearer tokens, read from this file: one `TOKEN [SERVICE,...] [principal=NAME]
    /// [scope=operator]` per line.
    #[arg(long, value_name = "FILE")]
    pub auth_tokens_file: Option<PathBuf>,
    /// Require bearer tokens given here, entries separated by `;`. Prefer the environment
    /// variable or a file: command lines are visible to other processes.
    #[arg(long, value_name = "ENTRIES", hide_env_values = true)]
    pub auth_tokens: Option<String>,
}

impl ServerArgs {
    /// Overrides `settings` with the flags (or their environment variables) that were given.
    pub fn apply(&self, settings: &mut ServerSettings) {
        override_with(&mut settings.listen, self.listen);
        override_with(&mut settings.drain_grace, self.drain_grace);
        override_with(&mut settings.max_message_bytes, self.max_message_bytes);
        override_with(
            &mut settings.max_concurrent_streams,
            self.max_concurrent_streams,
        );
        override_with(&mut settings.reflection, self.reflection);
        override_with(&mut settings.handshake_timeout, self.handshake_timeout);
        override_with(&mut settings.max_connections, self.max_connections);
        override_with(
            &mut settings.max_handshaking_connections,
            self.max_handshaking_connections,
        );
        override_with(
            &mut settings.max_connections_per_ip,
            self.max_connections_per_ip,
        );
        override_with(&mut settings.max_connection_age, self.max_connection_age);
        if self.metrics_listen.is_some() {
            settings.metrics_listen = self.metrics_listen;
        }
        if self.health_listen.is_some() {
            settings.health_listen = self.health_listen;
        }
        if self.tls_cert.is_some()
            || self.tls_key.is_some()
            || self.tls_client_ca.is_some()
            || self.tls_allowed_client_names.is_some()
        {
            let current = settings.tls.take();
            let names = self.tls_allowed_client_names.clone().unwrap_or_else(|| {
                current
                    .as_ref()
                    .map(|t| t.allowed_client_names.clone())
                    .unwrap_or_default()
            });
            let pick = |flag: &Option<PathBuf>, file: Option<PathBuf>| flag.clone().or(file);
            settings.tls = Some(TlsSettings {
                cert_file: pick(
                    &self.tls_cert,
                    current.as_ref().map(|t| t.cert_file.clone()),
                )
                .unwrap_or_default(),
                key_file: pick(&self.tls_key, current.as_ref().map(|t| t.key_file.clone()))
                    .unwrap_or_default(),
                client_ca_file: pick(&self.tls_client_ca, current.and_then(|t| t.client_ca_file)),
                allowed_client_names: names
                    .into_iter()
                    .map(|name| name.trim().to_owned())
                    .filter(|name| !name.is_empty())
                    .collect(),
            });
        }
        if self.auth_tokens_file.is_some() {
            settings.auth.tokens_file.clone_from(&self.auth_tokens_file);
        }
        if let Some(tokens) = &self.auth_tokens {
            settings.auth.tokens = Some(agentrt_core::Secret::new(tokens.clone()));
        }
    }
}

/// Sets `slot` when a value was given.
pub fn override_with<T>(slot: &mut T, value: Option<T>) {
    if let Some(value) = value {
        *slot = value;
    }
}

pub use agentrt_core::duration::{format as format_duration, parse as parse_duration};

/// Parses a listening address, `HOST:PORT`: HOST is an IP address (IPv6 in brackets,
/// `[::1]:50051`) or a host name, resolved once here (`localhost:0`); of a name's
/// addresses the first IPv4 one is taken, else the first. Port 0 picks a free port.
pub fn parse_listen(text: &str) -> Result<SocketAddr, String> {
    if let Ok(address) = text.parse::<SocketAddr>() {
        return Ok(address);
    }
    let expected = || format!("`{text}` is not HOST:PORT (e.g. 127.0.0.1:50051, localhost:0)");
    let (host, port) = text.rsplit_once(':').ok_or_else(expected)?;
    let port: u16 = port.parse().map_err(|_| expected())?;
    if host.is_empty() || host.contains(|c: char| c == ':' || c.is_whitespace()) {
        return Err(expected());
    }
    let addresses: Vec<SocketAddr> = std::net::ToSocketAddrs::to_socket_addrs(&(host, port))
        .map_err(|e| format!("cannot resolve the host of `{text}`: {e}"))?
        .collect();
    addresses
        .iter()
        .find(|a| a.is_ipv4())
        .or_else(|| addresses.first())
        .copied()
        .ok_or_else(|| format!("the host of `{text}` has no address"))
}

/// Serde helpers for listening addresses in config files, read as [`parse_listen`] reads
/// them and written as addresses.
pub mod listen {
    use std::net::SocketAddr;

    use serde::{Deserialize, Deserializer};

    /// `HOST:PORT`.
    pub fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<SocketAddr, D::Error> {
        let text = String::deserialize(d)?;
        super::parse_listen(&text).map_err(serde::de::Error::custom)
    }

    /// An optional `HOST:PORT`.
    pub mod option {
        use std::net::SocketAddr;

        use serde::{Deserialize, Deserializer};

        /// An optional `HOST:PORT`.
        pub fn deserialize<'de, D: Deserializer<'de>>(
            d: D,
        ) -> Result<Option<SocketAddr>, D::Error> {
            Option::<String>::deserialize(d)?
                .map(|text| super::super::parse_listen(&text).map_err(serde::de::Error::custom))
                .transpose()
        }
    }
}

/// Serde helpers for durations written as `10s`, `500ms`, ... in config files.
pub use agentrt_core::duration;

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn listening_addresses_take_host_names() {
        let v4 = |port| SocketAddr::from(([127, 0, 0, 1], port));
        assert_eq!(parse_listen("127.0.0.1:50051"), Ok(v4(50051)));
        assert_eq!(parse_listen("localhost:0"), Ok(v4(0)));
        assert_eq!(
            parse_listen("[::1]:7"),
            Ok(SocketAddr::from((std::net::Ipv6Addr::LOCALHOST, 7)))
        );
        for bad in [
            "",
            "localhost",
            ":80",
            "localhost:http",
            "localhost:70000",
            "a b:1",
        ] {
            let error = parse_listen(bad).unwrap_err();
            assert!(error.contains("HOST:PORT"), "{bad:?}: {error}");
        }
        // A config file reads them as the flag does.
        let settings: ServerSettings =
            toml::from_str("listen = \"localhost:9000\"\nhealth_listen = \"localhost:0\"\n")
                .unwrap();
        assert_eq!(settings.listen, v4(9000));
        assert_eq!(settings.health_listen, Some(v4(0)));
        assert_eq!(settings.metrics_listen, None);
        let bad = toml::from_str::<ServerSettings>("listen = \"nowhere\"\n").unwrap_err();
        assert!(bad.to_string().contains("HOST:PORT"), "{bad}");
    }

    #[test]
    fn a_config_error_says_where_without_quoting_the_file() {
        let text = "listen = \"127.0.0.1:9000\"\nnot_a_setting = \"sk-live-0123456789\"\n";
        let error = toml::from_str::<ServerSettings>(text).unwrap_err();
        let message = parse_error(&error, text);
        assert!(message.starts_with("line 2, column 1: "), "{message}");
        assert!(message.contains("not_a_setting"), "{message}");
        assert!(!message.contains("sk-live"), "{message}");
    }

    #[test]
    fn durations_parse_and_format() {
        assert_eq!(parse_duration("10s"), Ok(Duration::from_secs(10)));
        assert_eq!(parse_duration("250ms"), Ok(Duration::from_millis(250)));
        assert_eq!(parse_duration("1m30s"), Ok(Duration::from_secs(90)));
        assert_eq!(parse_duration("2h"), Ok(Duration::from_secs(7200)));
        assert_eq!(parse_duration("1.5"), Ok(Duration::from_millis(1500)));
        // At most 100 years: a deadline that far from now is still a time.
        assert_eq!(
            parse_duration("876000h"),
            Ok(Duration::from_secs(100 * 365 * 24 * 3600))
        );
        for bad in [
            "",
            "s",
            "10x",
            "-1",
            "ten seconds",
            "1s2",
            "1e19",
            "876001h",
        ] {
            assert!(parse_duration(bad).is_err(), "{bad:?}");
        }
        for d in [Duration::from_secs(10), Duration::from_millis(1500)] {
            assert_eq!(parse_duration(&format_duration(d)), Ok(d));
        }
    }

    #[test]
    fn secrets_are_masked() {
        use agentrt_core::Secret;
        let secret = Secret::new("sk-very-secret");
        assert_eq!(format!("{secret:?}"), "\"****\"");
        #[derive(Serialize)]
        struct S {
            key: Secret,
        }
        assert_eq!(to_toml(&S { key: secret }).trim(), "key = \"****\"");
    }

    #[test]
    fn files_layer_over_defaults_and_refuse_typos() {
        let dir = std::env::temp_dir().join(format!("agentrt-config-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let good = dir.join("good.toml");
        std::fs::write(&good, "listen = \"0.0.0.0:9000\"\ndrain_grace = \"3s\"\n").unwrap();
        let settings: ServerSettings = load_file(&good).unwrap();
        assert_eq!(settings.listen, "0.0.0.0:9000".parse().unwrap());
        assert_eq!(settings.drain_grace, Duration::from_secs(3));
        assert_eq!(
            settings.max_message_bytes,
            ServerSettings::default().max_message_bytes
        );

        let typo = dir.join("typo.toml");
        std::fs::write(&typo, "lissen = \"0.0.0.0:9000\"\n").unwrap();
        let err = load_file::<ServerSettings>(&typo).unwrap_err().to_string();
        assert!(err.contains("lissen"), "{err}");
        std::fs::remove_dir_all(dir).unwrap();
    }

    #[test]
    fn flags_override_the_file() {
        let mut settings = ServerSettings::default();
        let args = ServerArgs {
            drain_grace: Some(Duration::from_secs(1)),
            ..ServerArgs::default()
        };
        args.apply(&mut settings);
        assert_eq!(settings.drain_grace, Duration::from_secs(1));
        assert_eq!(settings.listen, ServerSettings::default().listen);
    }
}
