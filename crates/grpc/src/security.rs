//! Secure transport and access: TLS settings (server and client side), the allow-list of
//! client certificate names of mutual TLS, and bearer-token authentication of gRPC calls,
//! each token acting as a [`Principal`].
//!
//! Tokens come from a mounted file or an environment variable, one entry per line (or
//! separated by `;`): `TOKEN` grants every service, `TOKEN SERVICE[,SERVICE...]` only the
//! services named (full names, e.g. `agent.v1.AgentEngine`); `principal=NAME` names the
//! principal it acts as, `scope=operator` lets it act on every principal's objects. Lines
//! starting with `#` are comments. A call without a valid token is `UNAUTHENTICATED`; a valid token calling a
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
    transport::{Certificate, ClientTlsConfig, Identity},
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
    /// With mutual TLS: the identities a client certificate must carry one of (a DNS name
    /// or IP address in its subject alternative names, matched as a TLS client matches a
    /// server's name, so a certificate for `*.example.com` carries `a.example.com`).
    /// Every call of a client whose certificate carries none is `PERMISSION_DENIED`.
    /// Empty: every certificate the CA issued (a warning at start).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub allowed_client_names: Vec<String>,
}

impl TlsSettings {
    /// Reads the files into the TLS acceptor of the server's handshakes: TLS 1.2 and 1.3
    /// (ring), ALPN `h2`, and with a client CA, client certificates required.
    pub fn acceptor(&self) -> Result<tokio_rustls::TlsAcceptor, ConfigError> {
        use rustls_pki_types::{CertificateDer, PrivateKeyDer, pem::PemObject};
        use tokio_rustls::rustls;

        let certificates = |field: &'static str, path: &Path| {
            let pem = read(field, path)?;
            let certs = CertificateDer::pem_slice_iter(&pem)
                .collect::<Result<Vec<_>, _>>()
                .map_err(|e| ConfigError::Invalid {
                    field,
                    message: format!("{} is not PEM certificates: {e}", path.display()),
                })?;
            if certs.is_empty() {
                return Err(ConfigError::Invalid {
                    field,
                    message: format!("{} holds no certificate", path.display()),
                });
            }
            Ok(certs)
        };
        let invalid = |field: &'static str| {
            move |e: rustls::Error| ConfigError::Invalid {
                field,
                message: e.to_string(),
            }
        };
        let chain = certificates("server.tls.cert_file", &self.cert_file)?;
        let key = PrivateKeyDer::from_pem_slice(&read("server.tls.key_file", &self.key_file)?)
            .map_err(|e| ConfigError::Invalid {
                field: "server.tls.key_file",
                message: format!(
                    "{} holds no usable private key: {e}",
                    self.key_file.display()
                ),
            })?;
        let provider = Arc::new(rustls::crypto::ring::default_provider());
        let builder = rustls::ServerConfig::builder_with_provider(provider.clone())
            .with_safe_default_protocol_versions()
            .map_err(invalid("server.tls"))?;
        let builder = match &self.client_ca_file {
            None => builder.with_no_client_auth(),
            Some(ca) => {
                let mut roots = rustls::RootCertStore::empty();
                for cert in certificates("server.tls.client_ca_file", ca)? {
                    roots
                        .add(cert)
                        .map_err(invalid("server.tls.client_ca_file"))?;
                }
                let verifier = rustls::server::WebPkiClientVerifier::builder_with_provider(
                    Arc::new(roots),
                    provider,
                )
                .build()
                .map_err(|e| ConfigError::Invalid {
                    field: "server.tls.client_ca_file",
                    message: e.to_string(),
                })?;
                builder.with_client_cert_verifier(verifier)
            }
        };
        let mut config = builder
            .with_single_cert(chain, key)
            .map_err(invalid("server.tls.key_file"))?;
        config.alpn_protocols = vec![b"h2".to_vec()];
        Ok(tokio_rustls::TlsAcceptor::from(Arc::new(config)))
    }

    /// The allow-list of client identities, checked; `None` when every client the CA
    /// vouches for is let in.
    pub fn client_names(&self) -> Result<Option<Arc<ClientNames>>, ConfigError> {
        if self.allowed_client_names.is_empty() {
            return Ok(None);
        }
        if self.client_ca_file.is_none() {
            return Err(ConfigError::Invalid {
                field: "server.tls.allowed_client_names",
                message: "needs mutual TLS: set the client CA (--tls-client-ca) too".into(),
            });
        }
        let names = self
            .allowed_client_names
            .iter()
            .map(|name| {
                rustls_pki_types::ServerName::try_from(name.as_str())
                    .map(|parsed| parsed.to_owned())
                    .map_err(|_| ConfigError::Invalid {
                        field: "server.tls.allowed_client_names",
                        message: format!("{name:?} is not a DNS name or an IP address"),
                    })
            })
            .collect::<Result<Vec<_>, _>>()?;
        Ok(Some(Arc::new(ClientNames { names })))
    }
}

/// The identities a client certificate must carry one of (`allowed_client_names`).
#[derive(Debug)]
pub struct ClientNames {
    names: Vec<rustls_pki_types::ServerName<'static>>,
}

impl ClientNames {
    /// Whether the end-entity certificate `cert` (DER) carries one of the names.
    pub fn admits(&self, cert: &rustls_pki_types::CertificateDer<'_>) -> bool {
        let Ok(cert) = webpki::EndEntityCert::try_from(cert) else {
            return false;
        };
        self.names
            .iter()
            .any(|name| cert.verify_is_valid_for_subject_name(name).is_ok())
    }

    /// The names, for logs.
    pub fn describe(&self) -> String {
        self.names
            .iter()
            .map(|name| name.to_str().into_owned())
            .collect::<Vec<_>>()
            .join(", ")
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
            let from_file = parse_entries("server.auth.tokens_file", &text, &['\n'])?;
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
            let inline = parse_entries("server.auth.tokens", tokens.expose(), &['\n', ';'])?;
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
        refuse_conflicts(&entries)?;
        Ok((!entries.is_empty()).then(|| Arc::new(TokenSet { entries })))
    }
}

/// Refuses a token given twice (on two lines, or in the file and inline) with other
/// services, principal or scope: only the first would apply, silently.
fn refuse_conflicts(entries: &[TokenEntry]) -> Result<(), ConfigError> {
    for (index, entry) in entries.iter().enumerate() {
        if entries[..index]
            .iter()
            .any(|e| e.digest == entry.digest && e != entry)
        {
            return Err(ConfigError::Invalid {
                field: "server.auth.tokens",
                message: "a token is given twice with different services, principal or \
                          scope: give each token once"
                    .into(),
            });
        }
    }
    Ok(())
}

/// Shortest token accepted: shorter ones are guessable.
pub const MIN_TOKEN_CHARS: usize = 16;

/// The entries of `text`, one per line (and per `;` in the inline setting: a file's tokens
/// may hold `;`).
fn parse_entries(
    field: &'static str,
    text: &str,
    separators: &[char],
) -> Result<Vec<TokenEntry>, ConfigError> {
    let mut entries = Vec::new();
    for (index, line) in text.split(separators).enumerate() {
        let line = line.trim();
        if line.is_empty() || line.starts_with('#') {
            continue;
        }
        let invalid = |message: String| ConfigError::Invalid {
            field,
            message: format!("entry {}: {message}", index + 1),
        };
        let mut parts = line.split_whitespace();
        let token = parts.next().unwrap_or_default();
        // Services or an option where the token goes: the token was left out (what is
        // there would be a token anyone can guess).
        let services_list = token == "*"
            || token.contains(',')
            || ["agent.v1.", "grpc."].iter().any(|s| token.starts_with(s));
        if services_list {
            return Err(invalid(
                "the line starts with services: the token is missing (write `TOKEN \
                 [SERVICE,...] [principal=NAME] [scope=operator]`)"
                    .into(),
            ));
        }
        if ["principal=", "scope="]
            .iter()
            .any(|o| token.starts_with(o))
        {
            return Err(invalid(
                "the line starts with an option: the token is missing (write `TOKEN \
                 [SERVICE,...] [principal=NAME] [scope=operator]`)"
                    .into(),
            ));
        }
        // What an `authorization` header can carry: printable ASCII (a token that is not
        // could never be presented).
        if !token.bytes().all(|b| b.is_ascii_graphic()) {
            return Err(invalid(
                "a token is printable ASCII, without spaces (it could never be presented \
                 in an `authorization` header)"
                    .into(),
            ));
        }
        if token.chars().count() < MIN_TOKEN_CHARS {
            // Never echo the token itself.
            return Err(invalid(format!(
                "tokens must be at least {MIN_TOKEN_CHARS} characters"
            )));
        }
        let digest = sha256(token.as_bytes());
        let mut services = None;
        let mut principal = None;
        let mut operator = false;
        for (position, part) in parts.enumerate() {
            match part.split_once('=') {
                Some(("principal", _)) if principal.is_some() => {
                    return Err(invalid("`principal=` given twice".into()));
                }
                Some(("principal", name)) => {
                    check_principal(name).map_err(invalid)?;
                    principal = Some(name);
                }
                Some(("scope", _)) if operator => {
                    return Err(invalid("`scope=` given twice".into()));
                }
                Some(("scope", "operator")) => operator = true,
                Some(("scope", other)) => {
                    return Err(invalid(format!(
                        "unknown scope {other:?}: the one scope is `scope=operator`"
                    )));
                }
                Some((option, _)) => {
                    return Err(invalid(format!(
                        "unknown option {option:?}: write `TOKEN [SERVICE,...] \
                         [principal=NAME] [scope=operator]`"
                    )));
                }
                None if position == 0 => {
                    services = (part != "*").then(|| {
                        part.split(',')
                            .filter(|s| !s.is_empty())
                            .map(str::to_owned)
                            .collect()
                    });
                }
                None => {
                    return Err(invalid(
                        "write `TOKEN [SERVICE,...] [principal=NAME] [scope=operator]`, \
                         services separated by commas without spaces"
                            .into(),
                    ));
                }
            }
        }
        // A token without a name is a principal of its own, named after its digest.
        let name = principal.map_or_else(
            || format!("{DERIVED_PREFIX}{}", hex(&digest[..6])),
            str::to_owned,
        );
        entries.push(TokenEntry {
            digest,
            services,
            principal: Principal {
                name: name.into(),
                operator,
            },
        });
    }
    Ok(entries)
}

/// How the name of a principal whose token was given without one begins.
const DERIVED_PREFIX: &str = "token-";

/// Longest principal name.
pub const MAX_PRINCIPAL_CHARS: usize = 64;

fn check_principal(name: &str) -> Result<(), String> {
    // The names of tokens given without one: a name of that form would make its tokens
    // and such a token one principal.
    if name.starts_with(DERIVED_PREFIX) {
        return Err(format!(
            "principal names starting with '{DERIVED_PREFIX}' are those of tokens given \
             without a name; choose another"
        ));
    }
    let ok = !name.is_empty()
        && name.len() <= MAX_PRINCIPAL_CHARS
        && name
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'_' | b'-' | b'.'));
    if ok {
        Ok(())
    } else {
        Err(format!(
            "principal names are 1 to {MAX_PRINCIPAL_CHARS} letters, digits, '_', '-' or '.'"
        ))
    }
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

/// Who makes a call: the principal of its token. [`Auth`] puts it in the extensions of
/// every request it lets through; without authentication there is none, and every call is
/// the anonymous principal's. Engines, sessions and runs belong to the principal that made
/// them.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Principal {
    /// Its name (`principal=NAME` in the tokens file, else `token-` and 12 hex digits of
    /// the token's SHA-256); empty for the anonymous principal.
    pub name: Arc<str>,
    /// Whether it may act on every principal's objects (`scope=operator`).
    pub operator: bool,
}

impl Principal {
    /// The principal of `request` (the anonymous one when it carries none).
    pub fn of<T>(request: &tonic::Request<T>) -> Self {
        request
            .extensions()
            .get::<Self>()
            .cloned()
            .unwrap_or_default()
    }

    /// Whether it may act on an object that belongs to `owner`.
    pub fn may_act_on(&self, owner: &str) -> bool {
        self.operator || *self.name == *owner
    }
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

#[derive(Debug, PartialEq, Eq)]
struct TokenEntry {
    digest: [u8; 32],
    /// `None`: every service.
    services: Option<Vec<String>>,
    principal: Principal,
}

/// What a token may do.
#[derive(Debug, PartialEq, Eq)]
pub enum Access {
    /// The token is valid and grants the service, to this principal.
    Granted(Principal),
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
                Some(_) if is_reflection(service) => Access::Granted(entry.principal.clone()),
                Some(services) if !services.iter().any(|s| s == service) => Access::Denied,
                _ => Access::Granted(entry.principal.clone()),
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

/// Admits calls: with an allow-list of client names ([`ClientNames`]), only those whose
/// client certificate carries one (every call, health included); with tokens, every call
/// but health's must carry a valid one ([`TokenSet`]).
#[derive(Debug, Clone)]
pub struct AuthLayer {
    tokens: Option<Arc<TokenSet>>,
    client_names: Option<Arc<ClientNames>>,
}

impl AuthLayer {
    /// Checks calls against `tokens`; `None` lets every call through.
    pub fn new(tokens: Option<Arc<TokenSet>>) -> Self {
        Self {
            tokens,
            client_names: None,
        }
    }

    /// Also lets in only clients whose certificate carries one of `names` (when given).
    pub fn with_client_names(mut self, names: Option<Arc<ClientNames>>) -> Self {
        self.client_names = names;
        self
    }
}

impl<S> tower_layer::Layer<S> for AuthLayer {
    type Service = Auth<S>;

    fn layer(&self, inner: S) -> Self::Service {
        Auth {
            inner,
            tokens: self.tokens.clone(),
            client_names: self.client_names.clone(),
        }
    }
}

/// See [`AuthLayer`].
#[derive(Debug, Clone)]
pub struct Auth<S> {
    inner: S,
    tokens: Option<Arc<TokenSet>>,
    client_names: Option<Arc<ClientNames>>,
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

    fn call(&mut self, mut request: Request<ReqBody>) -> Self::Future {
        if let Some(names) = &self.client_names
            && let Err(status) = admit_client(names, &request)
        {
            return Box::pin(std::future::ready(Ok(status.into_http())));
        }
        if let Some(tokens) = &self.tokens {
            match authorize(tokens, &request) {
                Ok(Some(principal)) => {
                    request.extensions_mut().insert(principal);
                }
                Ok(None) => {}
                Err(status) => return Box::pin(std::future::ready(Ok(status.into_http()))),
            }
        }
        Box::pin(self.inner.call(request))
    }
}

/// Whether the client certificate of `request`'s connection carries one of `names`.
fn admit_client<B>(names: &ClientNames, request: &Request<B>) -> Result<(), Status> {
    use tonic::transport::server::{TcpConnectInfo, TlsConnectInfo};
    let info = request.extensions().get::<TlsConnectInfo<TcpConnectInfo>>();
    let admitted = info
        .and_then(TlsConnectInfo::peer_certs)
        .is_some_and(|certs| certs.first().is_some_and(|cert| names.admits(cert)));
    if admitted {
        return Ok(());
    }
    // Once every 10 s at most: a client can be refused on every call.
    static WARNINGS: agentrt_core::throttle::Throttle =
        agentrt_core::throttle::Throttle::new(std::time::Duration::from_secs(10));
    if let Some(left_out) = WARNINGS.take() {
        tracing::warn!(
            peer = ?info.and_then(|i| i.get_ref().remote_addr()),
            allowed = %names.describe(),
            left_out,
            "a client certificate without an allowed name was refused (left_out: those \
             refused since the last such warning)"
        );
    }
    Err(Status::permission_denied(
        "this client's certificate does not carry a name the server allows \
         (server.tls.allowed_client_names)",
    ))
}

/// The principal of an authorized call (`None` for health, which needs no token).
fn authorize<B>(tokens: &TokenSet, request: &Request<B>) -> Result<Option<Principal>, Status> {
    let service = crate::grpc_route(request.uri().path()).map_or("", |(service, _)| service);
    if service == HEALTH_SERVICE {
        return Ok(None);
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
        Access::Granted(principal) => Ok(Some(principal)),
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
            entries: parse_entries("t", text, &['\n', ';']).unwrap(),
        }
    }

    /// The principal `token` acts as on `service`: `Err` with the access otherwise.
    fn principal(tokens: &TokenSet, token: &str, service: &str) -> Result<Principal, Access> {
        match tokens.check(token, service) {
            Access::Granted(principal) => Ok(principal),
            other => Err(other),
        }
    }

    #[test]
    fn tokens_grant_all_or_the_services_they_name() {
        let tokens = set("# admins\nadmin-token-0123456789\n\
             runner-token-0123456789 agent.v1.AgentEngine;star-token-0123456789 *");
        assert!(principal(&tokens, "admin-token-0123456789", "agent.v1.AgentService").is_ok());
        assert!(principal(&tokens, "runner-token-0123456789", "agent.v1.AgentEngine").is_ok());
        assert_eq!(
            tokens.check("runner-token-0123456789", "agent.v1.AgentService"),
            Access::Denied
        );
        assert!(
            principal(
                &tokens,
                "runner-token-0123456789",
                "grpc.reflection.v1.ServerReflection"
            )
            .is_ok()
        );
        assert!(principal(&tokens, "star-token-0123456789", "agent.v1.ToolExecutor").is_ok());
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
    fn each_token_acts_as_its_principal() {
        let tokens = set("alice-token-0123456789 principal=alice\n\
             alice-rotated-0123456789 * principal=alice\n\
             ops-token-0123456789 agent.v1.AgentEngine principal=ops scope=operator\n\
             nameless-token-0123456789");
        let service = "agent.v1.AgentEngine";
        let alice = principal(&tokens, "alice-token-0123456789", service).unwrap();
        assert_eq!((&*alice.name, alice.operator), ("alice", false));
        assert_eq!(
            principal(&tokens, "alice-rotated-0123456789", service).unwrap(),
            alice,
            "two tokens of one principal"
        );
        let ops = principal(&tokens, "ops-token-0123456789", service).unwrap();
        assert_eq!((&*ops.name, ops.operator), ("ops", true));
        assert!(ops.may_act_on("alice") && alice.may_act_on("alice"));
        assert!(!alice.may_act_on("ops") && !alice.may_act_on(""));
        // A token without a name is its own principal, named after its digest, never
        // after the token itself.
        let nameless = principal(&tokens, "nameless-token-0123456789", service).unwrap();
        assert!(nameless.name.starts_with("token-") && nameless.name.len() == 18);
        assert!(!nameless.name.contains("nameless"));
        assert_eq!(Principal::default().name.as_ref(), "");
    }

    #[test]
    fn bad_principal_options_are_refused() {
        for (entry, says) in [
            ("ok-token-0123456789 principal=", "principal names"),
            ("ok-token-0123456789 principal=a/b", "principal names"),
            (
                "ok-token-0123456789 principal=token-0123456789ab",
                "tokens given without a name",
            ),
            ("ok-token-0123456789 scope=admin", "unknown scope"),
            ("ok-token-0123456789 role=x", "unknown option"),
            ("ok-token-0123456789 principal=a extra", "write `TOKEN"),
            ("ok-token-0123456789 principal=a principal=b", "given twice"),
            (
                "ok-token-0123456789 scope=operator scope=operator",
                "given twice",
            ),
            // The token left out: its option is no token.
            ("principal=abcdefghijklmnop", "the token is missing"),
            ("scope=operator-abcdefghij", "the token is missing"),
            ("ok-token-012345678é", "printable ASCII"),
            // Services where the token goes.
            ("agent.v1.AgentEngine principal=ops", "the token is missing"),
            (
                "agent.v1.AgentEngine,agent.v1.AgentService",
                "the token is missing",
            ),
        ] {
            let err = parse_entries("t", entry, &['\n', ';'])
                .unwrap_err()
                .to_string();
            assert!(err.contains(says), "{entry}: {err}");
            assert!(!err.contains("ok-token"), "{err}");
        }
    }

    #[test]
    fn a_file_token_may_hold_a_semicolon() {
        let entries = parse_entries("t", "semi;colon-token-0123 principal=ci\n", &['\n']).unwrap();
        assert_eq!(entries.len(), 1);
        assert_eq!(entries[0].digest, sha256(b"semi;colon-token-0123"));
    }

    #[test]
    fn a_token_given_twice_with_other_rights_is_refused() {
        let twice = |text: &str| refuse_conflicts(&parse_entries("t", text, &['\n', ';']).unwrap());
        let err = twice(
            "dup-token-0123456789 agent.v1.AgentEngine principal=bob\n\
             dup-token-0123456789 principal=alice",
        )
        .unwrap_err()
        .to_string();
        assert!(err.contains("given twice"), "{err}");
        assert!(!err.contains("dup-token"), "{err}");
        assert!(
            twice("dup-token-0123456789 principal=a\ndup-token-0123456789 * principal=a").is_ok()
        );
        assert!(
            twice("dup-token-0123456789 principal=a\nother-token-0123456789 principal=b").is_ok()
        );
    }

    #[test]
    fn short_tokens_and_bad_entries_are_refused_without_echoing_them() {
        let err = parse_entries(
            "server.auth.tokens",
            "ok-token-0123456789\nshort",
            &['\n', ';'],
        )
        .unwrap_err()
        .to_string();
        assert!(
            err.contains("entry 2") && err.contains("at least 16"),
            "{err}"
        );
        assert!(!err.contains("short"), "{err}");
        let err = parse_entries("t", "ok-token-0123456789 a, b", &['\n', ';']).unwrap_err();
        assert!(err.to_string().contains("without spaces"), "{err}");
    }
}
