//! OpenAPI 3.0 and 3.1 documents as toolsets: every operation with an `operationId` is a
//! tool named `<source>__<operationId>`.
//!
//! A tool's arguments hold the operation's path, query and header parameters by name and
//! its JSON request body under `body` (a parameter named `body`, or two parameters with
//! one name, are prefixed with their place: `query_body`, `header_id`). Query parameters
//! and headers the source sets itself (its `query` and `headers` settings) are not
//! arguments: the model neither sees them nor sets them (a call whose arguments would
//! write one of those query names, as an exploded object's property say, is refused).
//! The call fills the path template (each value percent-escaped, so a value never leaves
//! its segment), adds the query and headers, sends the body as JSON (with the JSON media
//! type the document declares for it), and follows no redirects: requests go to the base
//! URL's host only. The response body is the output (JSON also as structured output),
//! bounded by `max_response_bytes`; an answer that is not 2xx is an error result naming
//! the status.

mod document;
mod plain;

use std::{
    borrow::Cow,
    collections::BTreeMap,
    path::{Path, PathBuf},
    time::Duration,
};

use agentrt_core::{Secret, ToolSource, ToolSpec};
use async_trait::async_trait;
use bytes::Bytes;
use futures_util::StreamExt;
use percent_encoding::{AsciiSet, NON_ALPHANUMERIC, percent_encode_byte, utf8_percent_encode};
use serde::{Deserialize, Serialize};
use serde_json::Value;
use tracing::{info, warn};

use crate::{
    CallError, Error, ListedTool, Result, ToolContext, ToolOutput, Toolset, check_source_name,
    http::request_error, offered_name, secret::SecretRef, truncate_text,
};
use document::{Location, Operation, Parameter, Style};

/// The header that carries a call's id on requests that may change something.
const IDEMPOTENCY_KEY: reqwest::header::HeaderName =
    reqwest::header::HeaderName::from_static("idempotency-key");

/// What an idempotency key that cannot be a header value as it is has escaped.
const KEY_ESCAPED: &AsciiSet = &percent_encoding::CONTROLS.add(b'%');
/// What stays unescaped in a path segment: RFC 3986's unreserved characters.
const SEGMENT: &AsciiSet = &NON_ALPHANUMERIC
    .remove(b'-')
    .remove(b'.')
    .remove(b'_')
    .remove(b'~');

/// Longest error body quoted in an error result.
const MAX_ERROR_BODY_BYTES: usize = 4096;

/// One `[[openapi]]` entry of the tool executor's config.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct OpenApiConfig {
    /// The source name: its operations are offered as `<name>__<operationId>`.
    pub name: String,
    /// The document: OpenAPI 3.0 or 3.1, JSON or YAML; relative to the config file.
    pub spec: PathBuf,
    /// Where requests go; the document's first server when not given.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub base_url: Option<String>,
    /// Headers sent with every request (API keys, bearer tokens), their values read from
    /// the environment or a file: `Authorization = { env = "PETS_TOKEN", prefix = "Bearer " }`.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub headers: BTreeMap<String, SecretRef>,
    /// Query parameters sent with every request (API keys some APIs want there), read
    /// the same way: `api_key = { env = "PETS_KEY" }`.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub query: BTreeMap<String, SecretRef>,
    /// Upper bound of one call (the caller's deadline may be shorter).
    #[serde(default = "default_timeout", with = "agentrt_core::duration")]
    pub timeout: Duration,
    /// Largest response body read, in bytes; a larger one is an error result.
    #[serde(default = "default_max_response_bytes")]
    pub max_response_bytes: usize,
}

fn default_timeout() -> Duration {
    Duration::from_secs(30)
}
fn default_max_response_bytes() -> usize {
    1024 * 1024
}

impl OpenApiConfig {
    /// Makes relative paths (the document, secret files) relative to `dir`.
    pub fn resolve_paths(&mut self, dir: &Path) {
        if self.spec.is_relative() {
            self.spec = dir.join(&self.spec);
        }
        for secret in self.headers.values_mut().chain(self.query.values_mut()) {
            secret.resolve_paths(dir);
        }
    }

    /// Checks the entry without reading the document or secrets.
    pub fn check(&self) -> std::result::Result<(), String> {
        check_source_name(&self.name)?;
        if self.spec.as_os_str().is_empty() {
            return Err("`spec` (the document's path) is required".into());
        }
        for (name, secret) in &self.headers {
            reqwest::header::HeaderName::from_bytes(name.as_bytes())
                .map_err(|_| format!("{name:?} is not a valid header name"))?;
            secret.check().map_err(|e| format!("header {name}: {e}"))?;
        }
        for (name, secret) in &self.query {
            secret.check().map_err(|e| format!("query {name}: {e}"))?;
        }
        if let Some(base_url) = &self.base_url {
            check_base_url(base_url)
                .map_err(|e| format!("`base_url` {:?}: {e}", crate::shown_url(base_url)))?;
        }
        if self.timeout.is_zero() {
            return Err("`timeout` must be positive".into());
        }
        if self.max_response_bytes < 1024 {
            return Err("`max_response_bytes` must be at least 1024".into());
        }
        Ok(())
    }
}

/// An OpenAPI document's operations.
pub struct OpenApiToolset {
    name: String,
    base: reqwest::Url,
    /// The base URL's query, which the call's own parameters follow.
    base_query: Option<String>,
    routes: BTreeMap<String, Route>,
    headers: Vec<(reqwest::header::HeaderName, reqwest::header::HeaderValue)>,
    /// The source's query parameters, form-encoded once (`name=value&...`); empty when
    /// there are none.
    query: Secret,
    /// Their names, and those of the base URL's query, which no query parameter a call
    /// writes may have (letter case aside): the server might read the model's value rather
    /// than the source's.
    query_names: Vec<String>,
    timeout: Duration,
    max_response_bytes: usize,
    transport: Transport,
}

/// An operation, with what its calls need worked out once when the document is loaded.
struct Route {
    op: Operation,
    /// The request path (the base URL's path, then the operation's) cut at the
    /// placeholders of its path parameters, so that a call only joins pieces.
    path: Vec<Piece>,
    /// Per parameter, in `op.parameters`' order: a header parameter's name as a header,
    /// or `None` when it is not a valid one (an error when a call gives it).
    header_names: Vec<Option<reqwest::header::HeaderName>>,
    /// `GET /pets/{petId}`: how messages name the operation.
    what: String,
}

/// A piece of a request path.
enum Piece {
    Text(String),
    /// The value of `op.parameters[i]`, escaped.
    Param(usize),
}

impl Route {
    /// `base_path` is the base URL's path without its trailing `/`.
    fn new(op: Operation, base_path: &str) -> Self {
        // One parameter after the other, as `str::replace` on the whole template would,
        // looking at template text only: an escaped value holds no braces.
        let mut path = vec![Piece::Text(op.path.clone())];
        for (index, param) in op.parameters.iter().enumerate() {
            if param.location != Location::Path {
                continue;
            }
            let placeholder = format!("{{{}}}", param.name);
            path = path
                .into_iter()
                .flat_map(|piece| match piece {
                    Piece::Text(text) if text.contains(&placeholder) => {
                        let mut pieces = Vec::new();
                        for (i, part) in text.split(&placeholder).enumerate() {
                            if i > 0 {
                                pieces.push(Piece::Param(index));
                            }
                            if !part.is_empty() {
                                pieces.push(Piece::Text(part.to_owned()));
                            }
                        }
                        pieces
                    }
                    piece => vec![piece],
                })
                .collect();
        }
        if !base_path.is_empty() {
            match path.first_mut() {
                Some(Piece::Text(text)) => text.insert_str(0, base_path),
                _ => path.insert(0, Piece::Text(base_path.to_owned())),
            }
        }
        let header_names = op
            .parameters
            .iter()
            .map(|param| match param.location {
                Location::Header => {
                    reqwest::header::HeaderName::from_bytes(param.name.as_bytes()).ok()
                }
                Location::Path | Location::Query => None,
            })
            .collect();
        Self {
            path,
            header_names,
            what: format!("{} {}", op.method, op.path),
            op,
        }
    }
}

/// How requests reach the base URL.
enum Transport {
    /// `http://`: pooled HTTP/1.1 connections driven by the calls themselves.
    Plain(plain::Pool),
    /// `https://`: the shared client (rustls).
    Shared(reqwest::Client),
}

/// A request built from a call's arguments.
#[derive(Debug)]
struct Outgoing {
    method: reqwest::Method,
    /// The request target in origin form: path and query, escaped.
    target: String,
    /// The call's header parameters, the source's headers and the body's type; the
    /// transport adds `Host`, `Accept` when not given, and the body's `Content-Length`.
    headers: reqwest::header::HeaderMap,
    body: Option<Bytes>,
}

/// A response body as text for the model: decoded by its `Content-Type`'s charset (UTF-8
/// when it names none; ISO-8859-1, windows-1252 and UTF-16 too). A body that is not text
/// (an image, a PDF: not UTF-8, and of a type that is not text) or in a charset not read
/// is not shown as garbage: `Err` says what it is.
fn body_text(body: Vec<u8>, content_type: Option<&str>) -> std::result::Result<String, String> {
    let media = content_type
        .map(document::media_essence)
        .unwrap_or_default();
    let charset = content_type
        .into_iter()
        .flat_map(|t| t.split(';').skip(1))
        .filter_map(|param| param.split_once('='))
        .find(|(name, _)| name.trim().eq_ignore_ascii_case("charset"))
        .map(|(_, value)| value.trim().trim_matches('"').to_ascii_lowercase());
    let described = |body: &[u8]| {
        let media = if media.is_empty() {
            "an unnamed type"
        } else {
            &media
        };
        format!("{} bytes of {media}", body.len())
    };
    match charset.as_deref() {
        None | Some("utf-8" | "utf8" | "us-ascii" | "ascii") => match String::from_utf8(body) {
            Ok(text) => Ok(text),
            Err(e) => {
                let textual = media.is_empty()
                    || media.starts_with("text/")
                    || [
                        "json",
                        "xml",
                        "javascript",
                        "yaml",
                        "csv",
                        "x-www-form-urlencoded",
                    ]
                    .iter()
                    .any(|kind| media.contains(kind));
                if textual {
                    Ok(String::from_utf8_lossy(e.as_bytes()).into_owned())
                } else {
                    Err(format!(
                        "{}, which is not text (not shown)",
                        described(e.as_bytes())
                    ))
                }
            }
        },
        Some("iso-8859-1" | "latin1" | "latin-1" | "l1") => {
            Ok(body.iter().map(|&b| char::from(b)).collect())
        }
        Some("windows-1252" | "cp1252") => Ok(body.iter().map(|&b| windows_1252(b)).collect()),
        Some(utf16 @ ("utf-16" | "utf-16le" | "utf-16be")) => {
            let (big, bytes) = match body.get(..2) {
                Some([0xfe, 0xff]) if utf16 != "utf-16le" => (true, &body[2..]),
                Some([0xff, 0xfe]) if utf16 != "utf-16be" => (false, &body[2..]),
                // Without a byte-order mark UTF-16 is big-endian (RFC 2781).
                _ => (utf16 != "utf-16le", &body[..]),
            };
            let units = bytes.chunks(2).map(|pair| match (pair, big) {
                ([a, b], true) => u16::from_be_bytes([*a, *b]),
                ([a, b], false) => u16::from_le_bytes([*a, *b]),
                _ => 0xfffd,
            });
            Ok(char::decode_utf16(units)
                .map(|c| c.unwrap_or(char::REPLACEMENT_CHARACTER))
                .collect())
        }
        Some(other) => match String::from_utf8(body) {
            Ok(text) => Ok(text),
            Err(e) => Err(format!(
                "{} in charset {other:?}, which is not read (not shown)",
                described(e.as_bytes())
            )),
        },
    }
}

/// A windows-1252 byte as a character: ISO-8859-1 but for 0x80 to 0x9F.
fn windows_1252(byte: u8) -> char {
    const HIGH: [char; 32] = [
        '€', '\u{81}', '‚', 'ƒ', '„', '…', '†', '‡', 'ˆ', '‰', 'Š', '‹', 'Œ', '\u{8d}', 'Ž',
        '\u{8f}', '\u{90}', '‘', '’', '“', '”', '•', '–', '—', '˜', '™', 'š', '›', 'œ', '\u{9d}',
        'ž', 'Ÿ',
    ];
    match byte {
        0x80..=0x9f => HIGH[usize::from(byte - 0x80)],
        _ => char::from(byte),
    }
}

/// An answer, its body read up to the source's bound.
struct Reply {
    status: reqwest::StatusCode,
    /// Where a redirect points (the first `Location`, when it is text).
    location: Option<String>,
    /// Its `Content-Type`, when it is text.
    content_type: Option<String>,
    body: Vec<u8>,
    /// The body is larger than the bound (and was not read).
    too_large: bool,
}

impl OpenApiToolset {
    /// Reads the document and the secrets. Operations that cannot be offered (a request
    /// body that is not JSON, say) are left out with a warning.
    pub fn load(config: &OpenApiConfig) -> Result<Self> {
        let fail = |message: String| Error::source(&config.name, message);
        config.check().map_err(fail)?;
        let text = std::fs::read_to_string(&config.spec)
            .map_err(|e| fail(format!("cannot read {}: {e}", config.spec.display())))?;
        let doc =
            document::parse(&text).map_err(|e| fail(format!("{}: {e}", config.spec.display())))?;
        for why in &doc.skipped {
            warn!(source = %config.name, operation = %why, "operation left out");
        }
        for what in &doc.loose {
            warn!(source = %config.name, operation = %what, "operation offered with a part of its input unchecked");
        }
        let base = match (&config.base_url, doc.first_server) {
            // A relative server (`/api/v3`, as the petstore's and FastAPI's behind a root
            // path are) is resolved against a `base_url` that gives only the origin.
            (Some(base_url), Some(server))
                if server.starts_with('/')
                    && check_base_url(base_url).is_ok_and(|url| url.path() == "/") =>
            {
                let mut url = check_base_url(base_url).map_err(fail)?;
                url.set_path(&server);
                url
            }
            (Some(base_url), _) => check_base_url(base_url)
                .map_err(|e| fail(format!("`base_url` {:?}: {e}", crate::shown_url(base_url))))?,
            (None, Some(server)) => check_base_url(&server).map_err(|e| {
                fail(format!(
                    "the document's first server URL {:?}: {e} (set `base_url` to call \
                     another)",
                    crate::shown_url(&server)
                ))
            })?,
            (None, None) => {
                return Err(fail("the document names no server: set `base_url`".into()));
            }
        };
        let mut headers = Vec::new();
        for (name, secret) in &config.headers {
            let value = secret
                .read()
                .map_err(|e| fail(format!("header {name}: {e}")))?;
            let name = reqwest::header::HeaderName::from_bytes(name.as_bytes())
                .map_err(|e| fail(e.to_string()))?;
            let mut value = reqwest::header::HeaderValue::from_str(value.expose())
                .map_err(|_| fail(format!("header {name}: not a valid value")))?;
            value.set_sensitive(true);
            headers.push((name, value));
        }
        let mut query = String::new();
        for (name, secret) in &config.query {
            let value = secret
                .read()
                .map_err(|e| fail(format!("query {name}: {e}")))?;
            if !query.is_empty() {
                query.push('&');
            }
            form_encode(&mut query, name);
            query.push('=');
            form_encode(&mut query, value.expose());
        }
        // The query parameters the source sets: its `query`, and those of its base URL
        // (a key written into it).
        let query_names: Vec<String> = config
            .query
            .keys()
            .cloned()
            .chain(base.query_pairs().map(|(name, _)| name.into_owned()))
            .collect();
        let base_path = base.path().trim_end_matches('/');
        let sends_cookies = headers
            .iter()
            .any(|(name, _)| name == reqwest::header::COOKIE);
        let routes = doc
            .operations
            .into_iter()
            .filter(|op| {
                let callable = op.cookies.is_empty() || sends_cookies;
                if !callable {
                    warn!(
                        source = %config.name,
                        operation = %format!(
                            "{}: its required cookie parameter {:?} cannot be sent (cookies are \
                             not arguments): set a Cookie header in the source's headers",
                            op.id, op.cookies[0]
                        ),
                        "operation left out"
                    );
                }
                callable
            })
            .map(|mut op| {
                // What the source sets is not the model's to see or set.
                op.drop_parameters(|param| match param.location {
                    Location::Query => query_names
                        .iter()
                        .any(|name| name.eq_ignore_ascii_case(&param.name)),
                    Location::Header => headers
                        .iter()
                        .any(|(name, _)| name.as_str().eq_ignore_ascii_case(&param.name)),
                    Location::Path => false,
                });
                (op.id.clone(), Route::new(op, base_path))
            })
            .collect::<BTreeMap<_, _>>();
        let transport = match (base.scheme(), base.host_str()) {
            ("http", Some(host)) => {
                let authority = match base.port() {
                    Some(port) => format!("{host}:{port}"),
                    None => host.to_owned(),
                };
                reqwest::header::HeaderValue::from_str(&authority).map_err(|_| {
                    fail(format!(
                        "base URL {}: not a valid host",
                        crate::shown_url(base.as_str())
                    ))
                })?;
                let port = base.port_or_known_default().unwrap_or(80);
                Transport::Plain(plain::Pool::new(host, port, &authority))
            }
            _ => Transport::Shared(crate::http::client().map_err(fail)?),
        };
        info!(
            source = %config.name,
            operations = routes.len(),
            base = %crate::shown_url(base.as_str()),
            "OpenAPI document loaded"
        );
        Ok(Self {
            name: config.name.clone(),
            base_query: base.query().map(str::to_owned),
            base,
            routes,
            headers,
            query: Secret::new(query),
            query_names,
            timeout: config.timeout,
            max_response_bytes: config.max_response_bytes,
            transport,
        })
    }

    /// The request `route` makes with `arguments`, for the call `call_id`: a request that
    /// may change something (not GET, HEAD or OPTIONS) carries it as its
    /// `Idempotency-Key` (unless the source sets one), so that an API that honours the
    /// header does the work once when agentrt sends a call again after a replica died.
    fn request(
        &self,
        route: &Route,
        arguments: &Value,
        call_id: &str,
    ) -> std::result::Result<Outgoing, String> {
        let op = &route.op;
        // The checks, in the parameters' order, and the header parameters; the path and
        // the query are written below, once nothing can fail.
        let mut headers = reqwest::header::HeaderMap::new();
        for (param, header_name) in op.parameters.iter().zip(&route.header_names) {
            let Some(value) = given(arguments, param) else {
                continue;
            };
            match param.location {
                Location::Path => {
                    let text = scalar_text(&value);
                    if text.is_empty() || text == "." || text == ".." {
                        return Err(format!(
                            "path parameter {:?} cannot be {text:?}",
                            param.name
                        ));
                    }
                }
                // An exploded object's properties and a deep object's pairs get names of
                // the model's choosing, and a spec may declare a parameter the source sets.
                Location::Query if !self.query_names.is_empty() => {
                    for (name, _) in query_pairs(param, &value) {
                        // Letter case aside, as some servers (ASP.NET's) read names.
                        if self
                            .query_names
                            .iter()
                            .any(|own| own.eq_ignore_ascii_case(&name))
                        {
                            return Err(format!(
                                "{:?} would send the query parameter {name:?}, which this \
                                 source sets itself: leave it out",
                                param.key
                            ));
                        }
                    }
                }
                Location::Query => {}
                Location::Header => {
                    let name = header_name
                        .clone()
                        .ok_or_else(|| format!("{:?} is not a valid header name", param.name))?;
                    let value = reqwest::header::HeaderValue::try_from(simple_text(param, &value))
                        .map_err(|_| format!("header {:?}: not a valid value", param.name))?;
                    headers.insert(name, value);
                }
            }
        }
        for (name, value) in &self.headers {
            headers.insert(name.clone(), value.clone());
        }
        let safe = matches!(
            op.method,
            reqwest::Method::GET | reqwest::Method::HEAD | reqwest::Method::OPTIONS
        );
        if !safe && !call_id.is_empty() && !headers.contains_key(IDEMPOTENCY_KEY) {
            // A key with control characters cannot be a header value as it is: it goes
            // percent-escaped rather than not at all (a call sent again would then run
            // twice with nothing to tell it).
            let value = reqwest::header::HeaderValue::from_str(call_id).or_else(|_| {
                reqwest::header::HeaderValue::from_str(
                    &utf8_percent_encode(call_id, KEY_ESCAPED).to_string(),
                )
            });
            if let Ok(value) = value {
                headers.insert(IDEMPOTENCY_KEY, value);
            }
        }
        let body = if let Some(body_type) = &op.body_type
            && let Some(body) = arguments.get("body")
        {
            if let Some(at) = op.read_only.iter().find_map(|r| r.given_in(body)) {
                return Err(format!(
                    "the body's {at:?} is read-only (the API sets it): leave it out"
                ));
            }
            headers.insert(reqwest::header::CONTENT_TYPE, body_type.clone());
            let bytes = match &op.form {
                Some(deep) => form_body(body, deep)?.into_bytes(),
                None => serde_json::to_vec(body).map_err(|e| format!("the body: {e}"))?,
            };
            Some(Bytes::from(bytes))
        } else {
            None
        };
        Ok(Outgoing {
            method: op.method.clone(),
            target: self.target(route, arguments)?,
            headers,
            body,
        })
    }

    /// The request target: the path with the call's path parameters, then the base URL's
    /// query, the call's query parameters and the source's, as the `url` crate would
    /// write them.
    fn target(&self, route: &Route, arguments: &Value) -> std::result::Result<String, String> {
        let mut target = String::with_capacity(128);
        // Where each path value went, to check the segments they make.
        let mut filled: Vec<(usize, usize)> = Vec::new();
        for piece in &route.path {
            match piece {
                Piece::Text(text) => target.push_str(text),
                Piece::Param(index) => {
                    let param = &route.op.parameters[*index];
                    match given(arguments, param) {
                        Some(value) => {
                            let start = target.len();
                            push_path_value(&mut target, param, &value);
                            filled.push((start, target.len()));
                        }
                        // Every path parameter is required (a null one too): the template's
                        // placeholder is no value.
                        None => {
                            return Err(format!(
                                "path parameter {:?} is required (not null)",
                                param.name
                            ));
                        }
                    }
                }
            }
        }
        // A value never leaves its segment, whatever its style writes: a `label` array of
        // empty strings is `..`, which would climb out of the base path.
        let segment_of = |(start, end): (usize, usize)| {
            let from = target[..start].rfind('/').map_or(0, |at| at + 1);
            let to = target[end..].find('/').map_or(target.len(), |at| end + at);
            &target[from..to]
        };
        // Nor is a segment of its own left empty (an empty object or array writes
        // nothing): `a//b` is another route once a proxy merges the slashes.
        if let Some(segment) = filled
            .iter()
            .map(|range| segment_of(*range))
            .find(|segment| segment.is_empty() || is_dot_segment(segment))
        {
            return Err(format!(
                "path parameters cannot make a {segment:?} segment: give each a value of \
                 its own"
            ));
        }
        if !is_normalized_path(&target) {
            target = self.normalize_path(&target)?;
        }
        let query_start = target.len();
        if let Some(query) = &self.base_query {
            target.push('?');
            target.push_str(query);
        }
        for param in &route.op.parameters {
            if param.location != Location::Query {
                continue;
            }
            if let Some(value) = given(arguments, param) {
                for (name, text) in query_pairs(param, &value) {
                    push_query_pair(&mut target, query_start, &name, &text);
                }
            }
        }
        let fixed = self.query.expose();
        if !fixed.is_empty() {
            push_query_separator(&mut target, query_start);
            target.push_str(fixed);
        }
        Ok(target)
    }

    /// `path` as the `url` crate writes it under the base URL (escaping what must be,
    /// resolving `.` and `..` segments): the slow way, for the paths
    /// [`is_normalized_path`] cannot vouch for.
    fn normalize_path(&self, path: &str) -> std::result::Result<String, String> {
        let mut url = self.base.clone();
        url.set_path(path);
        if url.host() != self.base.host()
            || url.port_or_known_default() != self.base.port_or_known_default()
        {
            return Err("the request would leave the base URL's host".into());
        }
        Ok(url.path().to_owned())
    }

    /// The full URL of a request target, for the shared client.
    fn url(&self, target: &str) -> reqwest::Url {
        let (path, query) = match target.split_once('?') {
            Some((path, query)) => (path, Some(query)),
            None => (target, None),
        };
        let mut url = self.base.clone();
        url.set_path(path);
        url.set_query(query);
        url
    }

    /// Sends the request and reads at most `max_response_bytes` of the answer, all within
    /// the source's timeout.
    async fn send(&self, route: &Route, request: Outgoing) -> ToolOutput {
        let what = &route.what;
        match tokio::time::timeout(self.timeout, self.exchange(request)).await {
            Ok(Ok(reply)) => self.output(what, reply),
            Ok(Err(e)) => ToolOutput::error(format!("{what} failed: {e}")),
            Err(_) => {
                ToolOutput::timed_out(format!("{what} did not answer within {:?}", self.timeout))
            }
        }
    }

    async fn exchange(&self, request: Outgoing) -> std::result::Result<Reply, String> {
        match &self.transport {
            Transport::Plain(pool) => pool.send(&request, self.max_response_bytes).await,
            Transport::Shared(client) => {
                let Outgoing {
                    method,
                    target,
                    headers,
                    body,
                } = request;
                let head = method == reqwest::Method::HEAD;
                let mut request = client.request(method, self.url(&target)).headers(headers);
                if let Some(body) = body {
                    request = request.body(body);
                }
                let response = request.send().await.map_err(|e| request_error(&e))?;
                let mut reply = Reply {
                    status: response.status(),
                    location: response
                        .headers()
                        .get(reqwest::header::LOCATION)
                        .and_then(|v| v.to_str().ok())
                        .map(str::to_owned),
                    content_type: response
                        .headers()
                        .get(reqwest::header::CONTENT_TYPE)
                        .and_then(|v| v.to_str().ok())
                        .map(str::to_owned),
                    body: Vec::new(),
                    too_large: false,
                };
                // An answer to HEAD, a 204 or a 304 has no body, whatever length it
                // announces (over HTTP/2 the client passes that length on as the body's).
                let bodiless = head
                    || matches!(
                        reply.status,
                        reqwest::StatusCode::NO_CONTENT | reqwest::StatusCode::NOT_MODIFIED
                    );
                if !bodiless
                    && response
                        .content_length()
                        .is_some_and(|n| n > self.max_response_bytes as u64)
                {
                    reply.too_large = true;
                    return Ok(reply);
                }
                let mut stream = response.bytes_stream();
                while let Some(chunk) = stream.next().await {
                    let chunk =
                        chunk.map_err(|e| format!("reading the body: {}", request_error(&e)))?;
                    if reply.body.len() + chunk.len() > self.max_response_bytes {
                        reply.too_large = true;
                        return Ok(reply);
                    }
                    reply.body.extend_from_slice(&chunk);
                }
                Ok(reply)
            }
        }
    }

    /// The tool's output for `reply`.
    fn output(&self, what: &str, reply: Reply) -> ToolOutput {
        if reply.too_large {
            return ToolOutput::error(format!(
                "the response of {what} is larger than {} bytes, the most this source reads",
                self.max_response_bytes
            ));
        }
        let Reply {
            status,
            location,
            content_type,
            body,
            ..
        } = reply;
        if status.is_redirection() {
            // Without its query, which may carry the source's own (secret) query on.
            let location = location
                .as_deref()
                .map(|l| l.split(['?', '#']).next().unwrap_or(l));
            return ToolOutput::error(format!(
                "{what} answered {status} with a redirect to {}, which is not followed: this \
                 source only calls {}",
                location.unwrap_or("nowhere"),
                self.base.origin().ascii_serialization()
            ));
        }
        let structured = serde_json::from_slice::<Value>(&body).ok();
        let mut text = match body_text(body, content_type.as_deref()) {
            Ok(text) => text,
            Err(what_it_is) if status.is_success() => {
                format!("{what} answered {status} with {what_it_is}")
            }
            // An error answer says its status below.
            Err(what_it_is) => what_it_is,
        };
        // Not only 4xx and 5xx: a final 1xx (`101 Switching Protocols`) or a status past
        // 599 is no answer to the call either.
        if !status.is_success() {
            truncate_text(&mut text, MAX_ERROR_BODY_BYTES);
            return ToolOutput {
                text: format!("{what} answered {status}: {text}"),
                structured,
                is_error: true,
                ..ToolOutput::default()
            };
        }
        ToolOutput {
            text,
            structured,
            ..ToolOutput::default()
        }
    }
}

/// `url` parsed as a base URL: absolute, `http` or `https`, with a host.
fn check_base_url(url: &str) -> std::result::Result<reqwest::Url, String> {
    let parsed = reqwest::Url::parse(url).map_err(|e| e.to_string())?;
    if !matches!(parsed.scheme(), "http" | "https") || parsed.host().is_none() {
        return Err("it must be an http or https URL with a host".into());
    }
    crate::no_credentials(&parsed)?;
    Ok(parsed)
}

/// The argument given for `param`, unless it is missing or null: as JSON text for a
/// parameter described by a JSON media type (`content`).
fn given<'a>(arguments: &'a Value, param: &Parameter) -> Option<Cow<'a, Value>> {
    let value = arguments.get(&param.key).filter(|v| !v.is_null())?;
    Some(if param.json {
        Cow::Owned(Value::String(value.to_string()))
    } else {
        Cow::Borrowed(value)
    })
}

/// A parameter value as request text: strings as they are, arrays comma-separated, other
/// values as JSON.
fn scalar_text(value: &Value) -> Cow<'_, str> {
    match value {
        Value::String(s) => Cow::Borrowed(s),
        Value::Array(items) => {
            Cow::Owned(items.iter().map(scalar_text).collect::<Vec<_>>().join(","))
        }
        other => Cow::Owned(other.to_string()),
    }
}

/// A path, header or query value's items, in the order they are written: an array's items
/// (without names), an object's properties.
fn items(value: &Value) -> Vec<(Option<&str>, Cow<'_, str>)> {
    match value {
        Value::Array(items) => items.iter().map(|item| (None, scalar_text(item))).collect(),
        Value::Object(properties) => properties
            .iter()
            .map(|(name, item)| (Some(name.as_str()), scalar_text(item)))
            .collect(),
        scalar => vec![(None, scalar_text(scalar))],
    }
}

/// `value` as the `simple` style writes it (a header's value): `a,b`; an object `k,v,k2,v2`,
/// or `k=v,k2=v2` exploded.
fn simple_text(param: &Parameter, value: &Value) -> String {
    let mut text = String::new();
    for (i, (name, item)) in items(value).into_iter().enumerate() {
        if i > 0 {
            text.push(',');
        }
        if let Some(name) = name {
            text.push_str(name);
            text.push(if param.explode { '=' } else { ',' });
        }
        text.push_str(&item);
    }
    text
}

/// Writes a path parameter's `value` in its style (`simple`, `label`, `matrix`, exploded or
/// not), each name and value escaped as a path segment's text.
fn push_path_value(target: &mut String, param: &Parameter, value: &Value) {
    let escaped = |text: &str| utf8_percent_encode(text, SEGMENT).to_string();
    let (lead, between) = match (param.style, param.explode) {
        (Style::Label, true) => (".", "."),
        (Style::Label, false) => (".", ","),
        (Style::Matrix, true) => (";", ";"),
        (Style::Matrix, false) => (";", ","),
        _ => ("", ","),
    };
    target.push_str(lead);
    let matrix = param.style == Style::Matrix;
    let named_items = matrix && param.explode && !value.is_object();
    if matrix && !(param.explode && value.is_object()) {
        target.push_str(&escaped(&param.name));
        target.push('=');
    }
    for (i, (name, item)) in items(value).into_iter().enumerate() {
        if i > 0 {
            target.push_str(between);
            if named_items {
                target.push_str(&escaped(&param.name));
                target.push('=');
            }
        }
        if let Some(name) = name {
            target.push_str(&escaped(name));
            target.push_str(if param.explode { "=" } else { "," });
        }
        target.push_str(&escaped(&item));
    }
}

/// The query pairs of `value` in its parameter's style: `form` (`id=a&id=b` exploded,
/// `id=a,b` not; an object's properties as pairs, or `id=k,v,k2,v2`), `spaceDelimited`
/// and `pipeDelimited` (`id=a b`, `id=a|b`), `deepObject` (`id[k]=v`).
fn query_pairs<'a>(param: &'a Parameter, value: &'a Value) -> Vec<(Cow<'a, str>, Cow<'a, str>)> {
    let name = Cow::Borrowed(param.name.as_str());
    match value {
        // At any depth, arrays by index, as forms write them and Stripe reads them:
        // `expand[0]=a`, `f[a][b]=1`.
        Value::Object(_) | Value::Array(_) if param.style == Style::DeepObject => {
            let mut pairs = Vec::new();
            deep_pairs(&param.name, value, &mut |name, text| {
                pairs.push((Cow::Owned(name.to_owned()), Cow::Owned(text.into_owned())));
            });
            pairs
        }
        Value::Object(properties) if param.explode => properties
            .iter()
            .map(|(key, item)| (Cow::Borrowed(key.as_str()), scalar_text(item)))
            .collect(),
        Value::Array(items) if param.explode => items
            .iter()
            .map(|item| (name.clone(), scalar_text(item)))
            .collect(),
        Value::Array(items) => {
            let between = match param.style {
                Style::SpaceDelimited => " ",
                Style::PipeDelimited => "|",
                _ => ",",
            };
            let text = items
                .iter()
                .map(scalar_text)
                .collect::<Vec<_>>()
                .join(between);
            vec![(name, Cow::Owned(text))]
        }
        Value::Object(_) => {
            let text = items(value)
                .into_iter()
                .flat_map(|(key, item)| [Cow::Borrowed(key.unwrap_or_default()), item])
                .collect::<Vec<_>>()
                .join(",");
            vec![(name, Cow::Owned(text))]
        }
        scalar => vec![(name, scalar_text(scalar))],
    }
}

/// Whether the `url` crate would keep `path` as it is, so that it need not be asked: it
/// starts with `/`, holds only characters a path keeps unescaped (no `\`, which `url`
/// reads as `/`), and no `.` or `..` segment (`%2e` counts as a dot), which `url`
/// resolves. Escaped values pass; a template with unusual characters goes the slow way.
fn is_normalized_path(path: &str) -> bool {
    path.starts_with('/')
        && path
            .bytes()
            .all(|b| (b'!'..=b'~').contains(&b) && !b"\"#<>?`{}\\".contains(&b))
        && !path.split('/').any(is_dot_segment)
}

/// `.`, `..`, or either with dots written `%2e` or `%2E`.
fn is_dot_segment(segment: &str) -> bool {
    let mut rest = segment.as_bytes();
    let mut dots = 0;
    while !rest.is_empty() {
        rest = match rest {
            [b'.', tail @ ..] => tail,
            [b'%', b'2', b'e' | b'E', tail @ ..] => tail,
            _ => return false,
        };
        dots += 1;
    }
    dots == 1 || dots == 2
}

/// Appends `name=value` to the query that starts at `query_start` in `target`,
/// `application/x-www-form-urlencoded` as the `url` crate's `query_pairs_mut` writes it.
fn push_query_pair(target: &mut String, query_start: usize, name: &str, value: &str) {
    push_query_separator(target, query_start);
    form_encode(target, name);
    target.push('=');
    form_encode(target, value);
}

/// `?` before the first pair, `&` between pairs.
fn push_query_separator(target: &mut String, query_start: usize) {
    if target.len() == query_start {
        target.push('?');
    } else if target.len() > query_start + 1 {
        target.push('&');
    }
}

/// `body` as a form (`application/x-www-form-urlencoded`), as OpenAPI writes one by
/// default (style `form`, exploded: an array's items under its name one by one, an
/// object's properties under their own names), with the properties named in `deep` as
/// deep objects (`metadata[key]=value`, `items[0][price]=p`). Null values are left out.
/// The pairs of `value` as a deep object named `name` writes them: an object's fields as
/// `name[key]`, an array's items as `name[index]`, at any depth; nulls left out.
fn deep_pairs(name: &str, value: &Value, each: &mut dyn FnMut(&str, Cow<'_, str>)) {
    match value {
        Value::Null => {}
        Value::Object(fields) => {
            for (key, value) in fields {
                deep_pairs(&format!("{name}[{key}]"), value, each);
            }
        }
        Value::Array(items) => {
            for (index, value) in items.iter().enumerate() {
                deep_pairs(&format!("{name}[{index}]"), value, each);
            }
        }
        scalar => each(name, scalar_text(scalar)),
    }
}

fn form_body(body: &Value, deep: &[String]) -> std::result::Result<String, String> {
    fn pair(out: &mut String, name: &str, value: &str) {
        if !out.is_empty() {
            out.push('&');
        }
        form_encode(out, name);
        out.push('=');
        form_encode(out, value);
    }
    fn nested(out: &mut String, name: &str, value: &Value) {
        deep_pairs(name, value, &mut |name, text| pair(out, name, &text));
    }
    let Some(fields) = body.as_object() else {
        return Err("the body must be an object: it is sent as a form".into());
    };
    let mut out = String::new();
    for (name, value) in fields {
        match value {
            Value::Null => {}
            _ if deep.contains(name) => nested(&mut out, name, value),
            Value::Array(items) => {
                for item in items {
                    pair(&mut out, name, &scalar_text(item));
                }
            }
            Value::Object(properties) => {
                for (key, item) in properties {
                    pair(&mut out, key, &scalar_text(item));
                }
            }
            scalar => pair(&mut out, name, &scalar_text(scalar)),
        }
    }
    Ok(out)
}

fn form_encode(out: &mut String, text: &str) {
    for &b in text.as_bytes() {
        match b {
            b'*' | b'-' | b'.' | b'0'..=b'9' | b'A'..=b'Z' | b'_' | b'a'..=b'z' => {
                out.push(char::from(b));
            }
            b' ' => out.push('+'),
            _ => out.push_str(percent_encode_byte(b)),
        }
    }
}

#[async_trait]
impl Toolset for OpenApiToolset {
    fn name(&self) -> &str {
        &self.name
    }

    async fn list(&self) -> Result<Vec<ListedTool>> {
        Ok(self
            .routes
            .values()
            .map(|Route { op, .. }| ListedTool {
                spec: ToolSpec {
                    name: offered_name(&self.name, &op.id),
                    description: op.description.clone(),
                    input_schema: op.input_schema.clone().into(),
                    source: ToolSource::Http,
                },
                source_name: op.id.clone(),
                origin: format!("OpenAPI source {:?}, operation {:?}", self.name, op.id),
            })
            .collect())
    }

    async fn call(
        &self,
        tool: &str,
        arguments: Value,
        ctx: &ToolContext,
    ) -> Result<ToolOutput, CallError> {
        let route = self
            .routes
            .get(tool)
            .ok_or_else(|| CallError::Gone(tool.to_owned()))?;
        let request = match self.request(route, &arguments, &ctx.call_id) {
            Ok(request) => request,
            Err(message) => return Ok(ToolOutput::error(message)),
        };
        tokio::select! {
            out = self.send(route, request) => Ok(out),
            () = ctx.cancel.cancelled() => Ok(ToolOutput::stopped()),
        }
    }

    async fn refresh(&self) -> Result<()> {
        Ok(())
    }
}

#[cfg(test)]
mod tests;
