//! OpenAPI 3.0 and 3.1 documents as toolsets: every operation with an `operationId` is a
//! tool named `<source>__<operationId>`.
//!
//! A tool's arguments hold the operation's path, query and header parameters by name and
//! its JSON request body under `body` (a parameter named `body`, or two parameters with
//! one name, are prefixed with their place: `query_body`, `header_id`). The call fills the
//! path template (each value percent-escaped, so a value never leaves its segment), adds
//! the query and headers, sends the body as JSON, and follows no redirects: requests go to
//! the base URL's host only. The response body is the output (JSON also as structured
//! output), bounded by `max_response_bytes`; a 3xx, 4xx or 5xx answer is an error result
//! naming the status.

mod document;
mod plain;

use std::{
    collections::BTreeMap,
    path::{Path, PathBuf},
    time::Duration,
};

use agentrt_core::{Secret, ToolSource, ToolSpec};
use async_trait::async_trait;
use bytes::Bytes;
use futures_util::StreamExt;
use percent_encoding::{AsciiSet, NON_ALPHANUMERIC, utf8_percent_encode};
use serde::{Deserialize, Serialize};
use serde_json::Value;
use tracing::{info, warn};

use crate::{
    CallError, Error, ListedTool, Result, ToolContext, ToolOutput, Toolset, check_source_name,
    offered_name, secret::SecretRef, truncate_text,
};
use document::{Location, Operation};

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
    operations: BTreeMap<String, Operation>,
    headers: Vec<(reqwest::header::HeaderName, reqwest::header::HeaderValue)>,
    query: Vec<(String, Secret)>,
    timeout: Duration,
    max_response_bytes: usize,
    transport: Transport,
}

/// How requests reach the base URL.
enum Transport {
    /// `http://`: pooled HTTP/1.1 connections driven by the calls themselves, with the
    /// `Host` header they send.
    Plain(plain::Pool, reqwest::header::HeaderValue),
    /// `https://`: the shared client (rustls).
    Shared(reqwest::Client),
}

/// A request built from a call's arguments.
#[derive(Debug)]
struct Outgoing {
    method: reqwest::Method,
    url: reqwest::Url,
    headers: reqwest::header::HeaderMap,
    body: Option<Bytes>,
}

/// An answer, its body read up to the source's bound.
struct Reply {
    status: reqwest::StatusCode,
    headers: reqwest::header::HeaderMap,
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
        let base = config
            .base_url
            .clone()
            .or(doc.first_server)
            .ok_or_else(|| fail("the document names no server: set `base_url`".into()))?;
        let base = reqwest::Url::parse(&base).map_err(|e| {
            fail(format!(
                "base URL {base:?}: {e} (a relative server URL needs `base_url`)"
            ))
        })?;
        if !matches!(base.scheme(), "http" | "https") || base.host().is_none() {
            return Err(fail(format!("base URL {base} must be http(s) with a host")));
        }
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
        let mut query = Vec::new();
        for (name, secret) in &config.query {
            query.push((
                name.clone(),
                secret
                    .read()
                    .map_err(|e| fail(format!("query {name}: {e}")))?,
            ));
        }
        let operations = doc
            .operations
            .into_iter()
            .map(|op| (op.id.clone(), op))
            .collect::<BTreeMap<_, _>>();
        let transport = match (base.scheme(), base.host_str()) {
            ("http", Some(host)) => {
                let authority = match base.port() {
                    Some(port) => format!("{host}:{port}"),
                    None => host.to_owned(),
                };
                let host_header = reqwest::header::HeaderValue::from_str(&authority)
                    .map_err(|_| fail(format!("base URL {base}: not a valid host")))?;
                let port = base.port_or_known_default().unwrap_or(80);
                Transport::Plain(plain::Pool::new(host, port), host_header)
            }
            _ => Transport::Shared(crate::http::client().map_err(fail)?),
        };
        info!(source = %config.name, operations = operations.len(), %base, "OpenAPI document loaded");
        Ok(Self {
            name: config.name.clone(),
            base,
            operations,
            headers,
            query,
            timeout: config.timeout,
            max_response_bytes: config.max_response_bytes,
            transport,
        })
    }

    /// The request `op` makes with `arguments`.
    fn request(&self, op: &Operation, arguments: &Value) -> std::result::Result<Outgoing, String> {
        let mut path = op.path.clone();
        let mut query: Vec<(String, String)> = Vec::new();
        let mut headers = reqwest::header::HeaderMap::new();
        for param in &op.parameters {
            let Some(value) = arguments.get(&param.key).filter(|v| !v.is_null()) else {
                continue;
            };
            match param.location {
                Location::Path => {
                    let text = scalar_text(value);
                    if text.is_empty() || text == "." || text == ".." {
                        return Err(format!(
                            "path parameter {:?} cannot be {text:?}",
                            param.name
                        ));
                    }
                    let escaped = utf8_percent_encode(&text, SEGMENT).to_string();
                    path = path.replace(&format!("{{{}}}", param.name), &escaped);
                }
                Location::Query => match value {
                    Value::Array(items) if param.explode => {
                        for item in items {
                            query.push((param.name.clone(), scalar_text(item)));
                        }
                    }
                    _ => query.push((param.name.clone(), scalar_text(value))),
                },
                Location::Header => {
                    let name = reqwest::header::HeaderName::from_bytes(param.name.as_bytes())
                        .map_err(|_| format!("{:?} is not a valid header name", param.name))?;
                    let value = reqwest::header::HeaderValue::from_str(&scalar_text(value))
                        .map_err(|_| format!("header {:?}: not a valid value", param.name))?;
                    headers.insert(name, value);
                }
            }
        }
        let mut url = self.base.clone();
        let joined = format!("{}{path}", self.base.path().trim_end_matches('/'));
        url.set_path(&joined);
        if url.host() != self.base.host()
            || url.port_or_known_default() != self.base.port_or_known_default()
        {
            return Err("the request would leave the base URL's host".into());
        }
        for (name, value) in &self.headers {
            headers.insert(name.clone(), value.clone());
        }
        for (name, value) in &self.query {
            query.push((name.clone(), value.expose().to_owned()));
        }
        if !query.is_empty() {
            url.query_pairs_mut().extend_pairs(&query);
        }
        let body = if op.has_body
            && let Some(body) = arguments.get("body")
        {
            headers.insert(
                reqwest::header::CONTENT_TYPE,
                reqwest::header::HeaderValue::from_static("application/json"),
            );
            Some(Bytes::from(body.to_string()))
        } else {
            None
        };
        Ok(Outgoing {
            method: op.method.clone(),
            url,
            headers,
            body,
        })
    }

    /// Sends the request and reads at most `max_response_bytes` of the answer, all within
    /// the source's timeout.
    async fn send(&self, op: &Operation, request: Outgoing) -> ToolOutput {
        let what = format!("{} {}", op.method, op.path);
        match tokio::time::timeout(self.timeout, self.exchange(request)).await {
            Ok(Ok(reply)) => self.output(&what, reply),
            Ok(Err(e)) => ToolOutput::error(format!("{what} failed: {e}")),
            Err(_) => ToolOutput::error(format!("{what} did not answer within {:?}", self.timeout)),
        }
    }

    async fn exchange(&self, request: Outgoing) -> std::result::Result<Reply, String> {
        let Outgoing {
            method,
            url,
            mut headers,
            body,
        } = request;
        match &self.transport {
            Transport::Plain(pool, host) => {
                let mut target = url.path().to_owned();
                if let Some(query) = url.query() {
                    target.push('?');
                    target.push_str(query);
                }
                headers.insert(reqwest::header::HOST, host.clone());
                headers
                    .entry(reqwest::header::ACCEPT)
                    .or_insert_with(|| reqwest::header::HeaderValue::from_static("*/*"));
                let mut request =
                    hyper::Request::new(http_body_util::Full::new(body.unwrap_or_default()));
                *request.method_mut() = method;
                *request.uri_mut() = target
                    .parse()
                    .map_err(|e| format!("the request's path {target:?}: {e}"))?;
                *request.headers_mut() = headers;
                pool.send(request, self.max_response_bytes).await
            }
            Transport::Shared(client) => {
                let mut request = client.request(method, url).headers(headers);
                if let Some(body) = body {
                    request = request.body(body);
                }
                let response = request.send().await.map_err(|e| e.to_string())?;
                let mut reply = Reply {
                    status: response.status(),
                    headers: response.headers().clone(),
                    body: Vec::new(),
                    too_large: false,
                };
                if response
                    .content_length()
                    .is_some_and(|n| n > self.max_response_bytes as u64)
                {
                    reply.too_large = true;
                    return Ok(reply);
                }
                let mut stream = response.bytes_stream();
                while let Some(chunk) = stream.next().await {
                    let chunk = chunk.map_err(|e| format!("reading the body: {e}"))?;
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
            headers,
            body,
            ..
        } = reply;
        let structured = serde_json::from_slice::<Value>(&body).ok();
        if status.is_redirection() {
            let location = headers
                .get(reqwest::header::LOCATION)
                .and_then(|v| v.to_str().ok());
            return ToolOutput::error(format!(
                "{what} answered {status} with a redirect to {}, which is not followed: this \
                 source only calls {}",
                location.unwrap_or("nowhere"),
                self.base.origin().ascii_serialization()
            ));
        }
        let mut text = String::from_utf8(body)
            .unwrap_or_else(|e| String::from_utf8_lossy(e.as_bytes()).into_owned());
        if status.is_client_error() || status.is_server_error() {
            truncate_text(&mut text, MAX_ERROR_BODY_BYTES);
            return ToolOutput {
                text: format!("{what} answered {status}: {text}"),
                structured,
                references: Vec::new(),
                is_error: true,
            };
        }
        ToolOutput {
            text,
            structured,
            references: Vec::new(),
            is_error: false,
        }
    }
}

/// A parameter value as request text: strings as they are, arrays comma-separated, other
/// values as JSON.
fn scalar_text(value: &Value) -> String {
    match value {
        Value::String(s) => s.clone(),
        Value::Array(items) => items.iter().map(scalar_text).collect::<Vec<_>>().join(","),
        other => other.to_string(),
    }
}

#[async_trait]
impl Toolset for OpenApiToolset {
    fn name(&self) -> &str {
        &self.name
    }

    async fn list(&self) -> Result<Vec<ListedTool>> {
        Ok(self
            .operations
            .values()
            .map(|op| ListedTool {
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
        let op = self
            .operations
            .get(tool)
            .ok_or_else(|| CallError::Gone(tool.to_owned()))?;
        let request = match self.request(op, &arguments) {
            Ok(request) => request,
            Err(message) => return Ok(ToolOutput::error(message)),
        };
        tokio::select! {
            out = self.send(op, request) => Ok(out),
            () = ctx.cancel.cancelled() => Ok(ToolOutput::error("cancelled")),
        }
    }

    async fn refresh(&self) -> Result<()> {
        Ok(())
    }
}

#[cfg(test)]
mod tests;
