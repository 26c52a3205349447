//! The tool executor as seen from the agent server: a gRPC client behind [`ToolCatalog`].

use std::time::Duration;

use agentrt::v1::{self, tool_executor_client::ToolExecutorClient};
use agentrt_core::Secret;
use agentrt_core::{
    Reference, ToolCatalog, ToolInvocation, ToolResult, ToolRunner, ToolServiceError, ToolSource,
    ToolSpec,
};
use async_trait::async_trait;
use tonic::{
    Code,
    metadata::{Ascii, MetadataValue},
    transport::{Channel, ClientTlsConfig, Endpoint},
};

/// A lazily connected gRPC client of `agent.v1.ToolExecutor`.
#[derive(Clone)]
pub struct GrpcToolClient {
    endpoint: String,
    client: ToolExecutorClient<Channel>,
    timeout: Duration,
    authorization: Option<MetadataValue<Ascii>>,
}

/// How to reach the tool executor.
pub struct ToolClientOptions {
    /// Each call gives up after this long, connecting included.
    pub timeout: Duration,
    /// Largest message either way.
    pub max_message_bytes: usize,
    /// TLS, for an `https://` URL.
    pub tls: Option<ClientTlsConfig>,
    /// The bearer token to send.
    pub token: Option<Secret>,
}

impl GrpcToolClient {
    /// A client of the tool executor at `url`; nothing is dialled until the first call.
    pub fn new(url: &str, options: ToolClientOptions) -> Result<Self, String> {
        let ToolClientOptions {
            timeout,
            max_message_bytes,
            tls,
            token,
        } = options;
        let mut endpoint = Endpoint::from_shared(url.to_owned())
            .map_err(|e| format!("invalid tool executor URL {url:?}: {e}"))?;
        if let Some(tls) = tls {
            endpoint = endpoint
                .tls_config(tls)
                .map_err(|e| format!("invalid TLS settings for {url:?}: {e}"))?;
        }
        let authorization = token
            .map(|token| {
                let mut value = MetadataValue::try_from(format!("Bearer {}", token.expose()))
                    .map_err(|_| "the tool executor token has characters a header cannot carry")?;
                // Keeps the token out of HPACK's dynamic table.
                value.set_sensitive(true);
                Ok::<_, String>(value)
            })
            .transpose()?;
        let channel = endpoint
            .connect_timeout(timeout)
            .tcp_nodelay(true)
            .http2_keep_alive_interval(Duration::from_secs(30))
            .keep_alive_while_idle(true)
            // Every call in flight shares the connection, and each result arrives as a
            // small DATA frame: h2 allows unread small frames up to half the connection
            // window, so thousands of results at once need a large one.
            .initial_connection_window_size(16 * 1024 * 1024)
            .connect_lazy();
        Ok(Self {
            endpoint: url.to_owned(),
            client: ToolExecutorClient::new(channel)
                .max_decoding_message_size(max_message_bytes)
                .max_encoding_message_size(max_message_bytes),
            timeout,
            authorization,
        })
    }

    /// Wraps `message` with the deadline and credentials every call carries.
    fn request<T>(&self, message: T, timeout: Duration) -> tonic::Request<T> {
        let mut request = tonic::Request::new(message);
        request.set_timeout(timeout);
        if let Some(value) = &self.authorization {
            request
                .metadata_mut()
                .insert("authorization", value.clone());
        }
        if agentrt_telemetry::tracing_enabled() {
            // The tool executor's span joins this trace, under the current
            // `execute_tool` span.
            let mut headers = tonic::codegen::http::HeaderMap::new();
            agentrt_telemetry::inject(&mut headers);
            for (name, value) in &headers {
                if let (Ok(key), Ok(value)) = (
                    tonic::metadata::MetadataKey::from_bytes(name.as_str().as_bytes()),
                    value.to_str().map(MetadataValue::try_from),
                ) && let Ok(value) = value
                {
                    request.metadata_mut().insert(key, value);
                }
            }
        }
        request
    }

    /// The error clients see (`reason`), after logging the details they must not see.
    fn unavailable(&self, reason: String, detail: &str) -> ToolServiceError {
        tracing::warn!(endpoint = %agentrt_core::mask_url_credentials(&self.endpoint), %detail, "tool executor unavailable");
        ToolServiceError::Unavailable {
            endpoint: self.endpoint.clone(),
            reason,
        }
    }
}

#[async_trait]
impl ToolCatalog for GrpcToolClient {
    async fn list_tools(&self) -> Result<Vec<ToolSpec>, ToolServiceError> {
        let request = self.request(v1::ListToolsRequest {}, self.timeout);
        let mut client = self.client.clone();
        let call = client.list_tools(request);
        // The client enforces the limit itself too: a server that accepts the connection
        // but never answers must not hang validation.
        let response = tokio::time::timeout(self.timeout, call)
            .await
            .map_err(|_| {
                let reason = format!("no answer within {:?}", self.timeout);
                self.unavailable(reason.clone(), &reason)
            })?
            .map_err(|status| {
                self.unavailable(
                    format!("it answered {:?}", status.code()),
                    &format!("{:?}: {}", status.code(), status.message()),
                )
            })?;
        Ok(response
            .into_inner()
            .tools
            .into_iter()
            .map(|tool| ToolSpec {
                input_schema: tool
                    .input_schema
                    .as_ref()
                    .map_or(serde_json::Value::Null, agentrt::json::struct_to_json)
                    .into(),
                source: match v1::ToolSource::try_from(tool.source) {
                    Ok(v1::ToolSource::Http) => ToolSource::Http,
                    Ok(v1::ToolSource::Mcp) => ToolSource::Mcp,
                    _ => ToolSource::Builtin,
                },
                name: tool.name,
                description: tool.description,
            })
            .collect())
    }
}

#[async_trait]
impl ToolRunner for GrpcToolClient {
    async fn run(&self, call: ToolInvocation, timeout: Duration) -> ToolResult {
        let name = call.name.clone();
        // The deadline travels to the tool executor, which stops the work when it passes;
        // the local timer covers an executor that does not answer at all.
        let arguments = agentrt::json::json_to_struct(&call.arguments);
        // The parsed arguments are not needed while the call runs, which may be long.
        drop(call.arguments);
        let request = self.request(
            v1::ExecuteToolRequest {
                call_id: call.call_id,
                tool_name: call.name,
                arguments,
                run_id: call.run_id,
                session_id: call.session_id,
            },
            timeout,
        );
        let mut client = self.client.clone();
        let timed_out =
            || ToolResult::error(format!("tool {name:?} did not finish within {timeout:?}"));
        let response = match tokio::time::timeout(timeout, client.execute_tool(request)).await {
            Err(_) => return timed_out(),
            Ok(response) => response,
        };
        match response {
            Ok(response) => {
                let response = response.into_inner();
                ToolResult {
                    output: response.output,
                    is_error: response.is_error,
                    references: response
                        .references
                        .into_iter()
                        .map(|r| Reference {
                            title: r.title,
                            url: r.url,
                            snippet: r.snippet,
                            score: r.score,
                            source: r.source,
                        })
                        .collect(),
                }
            }
            Err(status) => match status.code() {
                Code::InvalidArgument => ToolResult::error(format!(
                    "invalid arguments for tool {name:?}: {}",
                    status.message()
                )),
                Code::NotFound => {
                    ToolResult::error(format!("tool {name:?} does not exist on the tool executor"))
                }
                Code::DeadlineExceeded | Code::Cancelled => timed_out(),
                code => ToolResult::error(format!(
                    "tool {name:?} failed: {code:?}: {}",
                    status.message()
                )),
            },
        }
    }
}
