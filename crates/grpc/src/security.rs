//! Secure transport and access: TLS settings (server and client side) and bearer-token
//! authentication of gRPC calls.
//!
//! Tokens come from a mounted file or an environment variable, one entry per line (or
//! separated by `;`): `TOKEN` grants every service, `TOKEN SERVICE[,SERVICE...]` only the
//! services named (full names, e.g. `agent.v1.AgentEngine`). Lines starting with `#` are
//! comments. A call without a valid token is `UNAUTHENTICATED`; a valid token calling a
//! service it was not granted is `PERMISSION_DENIED`. Health is always open, so that
//! probes need no secret; reflection is open to every valid token. Tokens are compared by
//! their SHA-256 digests in constant time, against every entry, so that neither the
//! position nor the length of a match shows in the timing.

use std::{
    future::Future,
    path::{Path, PathBuf},
    pin::Pin,
    sync::Arc,
    task::{Context, Poll},
};

use agentrt_core::Secret;
use http::{Request, Response};
use ring::digest::{SHA256, digest};
use serde::{Deserialize, Serialize};
use tonic::{
    Status,
    transport::{Certificate, ClientTlsConfig, Identity, ServerTlsConfig},
};

use crate::config::ConfigError;

/// TLS of a server.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct TlsSettings {
    /// The server's certificate chain, PEM.
    pub cert_file: PathBuf,
    /// The server's private key, PEM.
    pub key_file: PathBuf,
    /// CA certificates (PEM) that client certificates must chain to; when set, every
    /// client must present one (mutual TLS).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub client_ca_file: Option<PathBuf>,
}

impl TlsSettings {
    /// Reads the files into tonic's server TLS configuration.
    pub fn server_config(&self) -> Result<ServerTlsConfig, ConfigError> {
        let identity = Identity::from_pem(
            read("server.tls.cert_file", &self.cert_file)?,
            read("server.tls.key_file", &self.key_file)?,
        );
        let mut config = ServerTlsConfig::new().identity(identity);
        if let Some(ca) = &self.client_ca_file {
            config = config.client_ca_root(Certificate::from_pem(read(
                "server.tls.client_ca_file",
                ca,
            )?));
        }
        Ok(config)
    }
}

/// TLS of a client (the agent server calling the tool executor over `https://`).
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct ClientTlsSettings {
    /// CA certificates (PEM) the server's certificate must chain to.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub ca_file: Option<PathBuf>,
    /// This client's certificate chain (PEM), for servers that require mutual TLS.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub cert_file: Option<PathBuf>,
    /// This client's private key (PEM).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub key_file: Option<PathBuf>,
    /// The name the server's certificate must carry, when not the URL's host.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub domain: Option<String>,
}

impl ClientTlsSettings {
    /// Checks that the settings go together, without reading the files; `field` names
    /// these settings in errors.
    pub fn check(&self, field: &'static str) -> Result<(), ConfigError> {
        if self.ca_file.is_none() {
            return Err(ConfigError::Invalid {
                field,
                message: "an https:// endpoint needs `ca_file`, the CA its certificate chains to"
                    .into(),
            });
        }
        if self.cert_file.is_some() != self.key_file.is_some() {
            return Err(ConfigError::Invalid {
                field,
                message: "`cert_file` and `key_file` go together".into(),
            });
        }
        Ok(())
    }

    /// Reads the files into tonic's client TLS configuration; `field` names these settings
    /// in errors.
    pub fn client_config(&self, field: &'static str) -> Result<ClientTlsConfig, ConfigError> {
        self.check(field)?;
        let mut config = ClientTlsConfig::new();
        if let Some(ca) = &self.ca_file {
            config = config.ca_certificate(Certificate::from_pem(read(field, ca)?));
        }
        if let (Some(cert), Some(key)) = (&self.cert_file, &self.key_file) {
            config = config.identity(Identity::from_pem(read(field, cert)?, read(field, key)?));
        }
        if let Some(domain) = &self.domain {
            config = config.domain_name(domain.clone());
        }
        Ok(config)
    }

    /// Whether any setting was given.
    pub fn is_set(&self) -> bool {
        self != &Self::default()
    }

    /// Whether no setting was given.
    pub fn is_unset(&self) -> bool {
        !self.is_set()
    }
}

fn read(field: &'static str, path: &Path) -> Result<Vec<u8>, ConfigError> {
    std::fs::read(path).map_err(|e| ConfigError::Invalid {
        field,
        message: format!("cannot read {}: {e}", path.display()),
    })
}

/// Where a server's bearer tokens come from; no tokens means no authentication.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct AuthSettings {
    /// A file of token entries (a mounted Secret, typically).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub tokens_file: Option<PathBuf>,
    /// Token entries given inline (an environment variable, typically); masked when
    /// printed. `Some` even when empty: a setting that is given but holds no token is an
    /// error, never a server without authentication.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub tokens: Option<Secret>,
}

impl AuthSettings {
    /// Reads and parses every entry; `None` when no token source is configured. A source
    /// that is configured but holds no token (an empty file, only comments, an empty
    /// variable: an empty key in a Secret, typically) is an error: authentication fails
    /// closed.
    pub fn load(&self) -> Result<Option<Arc<TokenSet>>, ConfigError> {
        let mut entries = Vec::new();
        if let Some(path) = &self.tokens_file {
            let text = std::fs::read_to_string(path).map_err(|e| ConfigError::Invalid {
                field: "server.auth.tokens_file",
                message: format!("cannot read {}: {e}", path.display()),
            })?;
            let from_file = parse_entries("server.auth.tokens_file", &text)?;
            if from_file.is_empty() {
                return Err(ConfigError::Invalid {
                    field: "server.auth.tokens_file",
                    message: format!(
                        "{} holds no token (empty, or only comments): the server would run \
                         without authentication; give it tokens, or remove the setting",
                        path.display()
                    ),
                });
            }
            entries.extend(from_file);
        }
        if let Some(tokens) = &self.tokens {
            let inline = parse_entries("server.auth.tokens", tokens.expose())?;
            if inline.is_empty() {
                return Err(ConfigError::Invalid {
                    field: "server.auth.tokens",
                    message: "is set but holds no token: the server would run without \
                              authentication; give it tokens, or unset it"
                        .into(),
                });
            }
            entries.extend(inline);
        }
        Ok((!entries.is_empty()).then(|| Arc::new(TokenSet { entries })))
    }
}

/// Shortest token accepted: shorter ones are guessable.
pub const MIN_TOKEN_CHARS: usize = 16;

fn parse_entries(field: &'static str, text: &str) -> Result<Vec<TokenEntry>, ConfigError> {
    let mut entries = Vec::new();
    for (index, line) in text.split(['\n', ';']).enumerate() {
        let line = line.trim();
        if line.is_empty() || line.starts_with('#') {
            continue;
        }
        let mut parts = line.split_whitespace();
        let token = parts.next().unwrap_or_default();
        if token.chars().count() < MIN_TOKEN_CHARS {
            // Never echo the token itself.
            return Err(ConfigError::Invalid {
                field,
                message: format!(
                    "entry {}: tokens must be at least {MIN_TOKEN_CHARS} characters",
                    index + 1
                ),
            });
        }
        let services = match parts.next() {
            None | Some("*") => None,
            Some(list) => Some(
                list.split(',')
                    .filter(|s| !s.is_empty())
                    .map(str::to_owned)
                    .collect(),
            ),
        };
        if parts.next().is_some() {
            return Err(ConfigError::Invalid {
                field,
                message: format!(
                    "entry {}: write `TOKEN` or `TOKEN SERVICE,SERVICE`, services separated by \
                     commas without spaces",
                    index + 1
                ),
            });
        }
        entries.push(TokenEntry {
            digest: sha256(token.as_bytes()),
            services,
        });
    }
    Ok(entries)
}

fn sha256(bytes: &[u8]) -> [u8; 32] {
    let mut out = [0; 32];
    out.copy_from_slice(digest(&SHA256, bytes).as_ref());
    out
}

/// The accepted tokens, each with the services it grants.
#[derive(Debug)]
pub struct TokenSet {
    entries: Vec<TokenEntry>,
}

impl TokenSet {
    /// How many tokens there are.
    pub fn len(&self) -> usize {
        self.entries.len()
    }

    /// Whether there is none (never, for a set [`AuthSettings::load`] made).
    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }
}

#[derive(Debug)]
struct TokenEntry {
    digest: [u8; 32],
    /// `None`: every service.
    services: Option<Vec<String>>,
}

/// What a token may do.
#[derive(Debug, PartialEq, Eq)]
pub enum Access {
    /// The token is valid and grants the service.
    Granted,
    /// The token is valid but does not grant the service.
    Denied,
    /// No entry has this token.
    Unknown,
}

impl TokenSet {
    /// Checks `token` for a call of `service`, in time independent of which entry matches.
    pub fn check(&self, token: &str, service: &str) -> Access {
        let presented = sha256(token.as_bytes());
        let mut found: Option<&TokenEntry> = None;
        for entry in &self.entries {
            let difference = entry
                .digest
                .iter()
                .zip(presented.iter())
                .fold(0u8, |acc, (a, b)| acc | (a ^ b));
            if std::hint::black_box(difference) == 0 && found.is_none() {
                found = Some(entry);
            }
        }
        match found {
            None => Access::Unknown,
            Some(entry) => match &entry.services {
                None => Access::Granted,
                Some(_) if is_reflection(service) => Access::Granted,
                Some(services) if services.iter().any(|s| s == service) => Access::Granted,
                Some(_) => Access::Denied,
            },
        }
    }

    /// Services named by some entry that are not in `served`.
    pub fn unknown_services<'a>(&'a self, served: &[&str]) -> Vec<&'a str> {
        let mut unknown: Vec<&str> = self
            .entries
            .iter()
            .filter_map(|e| e.services.as_ref())
            .flatten()
            .map(String::as_str)
            .filter(|s| !served.contains(s))
            .collect();
        unknown.sort_unstable();
        unknown.dedup();
        unknown
    }
}

fn is_reflection(service: &str) -> bool {
    service.starts_with("grpc.reflection.")
}

/// The health service: always reachable, with or without a token.
const HEALTH_SERVICE: &str = "grpc.health.v1.Health";

/// Authenticates every call but health's against a [`TokenSet`].
#[derive(Debug, Clone)]
pub struct AuthLayer {
    tokens: Option<Arc<TokenSet>>,
}

impl AuthLayer {
    /// Checks calls against `tokens`; `None` lets every call through.
    pub fn new(tokens: Option<Arc<TokenSet>>) -> Self {
        Self { tokens }
    }
}

impl<S> tower_layer::Layer<S> for AuthLayer {
    type Service = Auth<S>;

    fn layer(&self, inner: S) -> Self::Service {
        Auth {
            inner,
            tokens: self.tokens.clone(),
        }
    }
}

/// See [`AuthLayer`].
#[derive(Debug, Clone)]
pub struct Auth<S> {
    inner: S,
    tokens: Option<Arc<TokenSet>>,
}

impl<S, ReqBody> tower_service::Service<Request<ReqBody>> for Auth<S>
where
    S: tower_service::Service<Request<ReqBody>, Response = Response<tonic::body::Body>>,
    S::Future: Send + 'static,
    S::Error: Send + 'static,
{
    type Response = Response<tonic::body::Body>;
    type Error = S::Error;
    type Future =
        Pin<Box<dyn Future<Output = Result<Self::Response, Self::Error>> + Send + 'static>>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, request: Request<ReqBody>) -> Self::Future {
        if let Some(tokens) = &self.tokens
            && let Err(status) = authorize(tokens, &request)
        {
            return Box::pin(std::future::ready(Ok(status.into_http())));
        }
        Box::pin(self.inner.call(request))
    }
}

fn authorize<B>(tokens: &TokenSet, request: &Request<B>) -> Result<(), Status> {
    let service = crate::grpc_route(request.uri().path()).map_or("", |(service, _)| service);
    if service == HEALTH_SERVICE {
        return Ok(());
    }
    let mut values = request
        .headers()
        .get_all(http::header::AUTHORIZATION)
        .iter();
    let Some(header) = values.next() else {
        return Err(Status::unauthenticated(
            "missing credentials: send the metadata `authorization: Bearer <token>`",
        ));
    };
    if values.next().is_some() {
        // Which one a proxy or another server would read is anyone's guess: refuse both.
        return Err(Status::unauthenticated(
            "more than one `authorization` metadata value: send exactly one",
        ));
    }
    let token = header
        .to_str()
        .ok()
        .and_then(|value| {
            let (scheme, token) = value.split_once(' ')?;
            scheme.eq_ignore_ascii_case("bearer").then(|| token.trim())
        })
        .ok_or_else(|| {
            Status::unauthenticated("malformed `authorization` metadata: expected `Bearer <token>`")
        })?;
    match tokens.check(token, service) {
        Access::Granted => Ok(()),
        Access::Unknown => Err(Status::unauthenticated("invalid bearer token")),
        Access::Denied => Err(Status::permission_denied(format!(
            "this token does not grant access to {service}"
        ))),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn set(text: &str) -> TokenSet {
        TokenSet {
            entries: parse_entries("t", text).unwrap(),
        }
    }

    #[test]
    fn tokens_grant_all_or_the_services_they_name() {
        let tokens = set("# admins\nadmin-token-0123456789\n\
             runner-token-0123456789 agent.v1.AgentEngine;star-token-0123456789 *");
        assert_eq!(
            tokens.check("admin-token-0123456789", "agent.v1.AgentService"),
            Access::Granted
        );
        assert_eq!(
            tokens.check("runner-token-0123456789", "agent.v1.AgentEngine"),
            Access::Granted
        );
        assert_eq!(
            tokens.check("runner-token-0123456789", "agent.v1.AgentService"),
            Access::Denied
        );
        assert_eq!(
            tokens.check(
                "runner-token-0123456789",
                "grpc.reflection.v1.ServerReflection"
            ),
            Access::Granted
        );
        assert_eq!(
            tokens.check("star-token-0123456789", "agent.v1.ToolExecutor"),
            Access::Granted
        );
        assert_eq!(
            tokens.check("admin-token-012345678", "agent.v1.AgentService"),
            Access::Unknown
        );
        assert_eq!(
            tokens.unknown_services(&["agent.v1.AgentService"]),
            ["agent.v1.AgentEngine"]
        );
    }

    #[test]
    fn short_tokens_and_bad_entries_are_refused_without_echoing_them() {
        let err = parse_entries("server.auth.tokens", "ok-token-0123456789\nshort")
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("entry 2") && err.contains("at least 16"),
            "{err}"
        );
        assert!(!err.contains("short"), "{err}");
        let err = parse_entries("t", "ok-token-0123456789 a, b").unwrap_err();
        assert!(err.to_string().contains("without spaces"), "{err}");
    }
}
