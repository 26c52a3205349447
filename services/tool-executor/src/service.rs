use std::{sync::Arc, time::Duration};

use agentrt::{
    json,
    v1::{self, tool_executor_server::ToolExecutor},
};
use agentrt_core::{ToolSource, ToolSpec, Violation};
use agentrt_grpc::status;
use agentrt_tools::{Catalogue, ExecuteError, ToolContext, ToolOutput};
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;
use tonic::{Request, Response, Status, metadata::MetadataMap};
use tracing::{Instrument, debug, info_span};

/// Tonic answers CANCELLED itself when the `grpc-timeout` it read passes, counted from
/// the call's arrival, and the client's own timer fires then too. Finishing this much
/// earlier, counted from the same moment, lets the handler's DEADLINE_EXCEEDED reach the
/// client first, as gRPC clients expect, also on a loaded machine.
const DEADLINE_MARGIN: Duration = Duration::from_millis(50);

/// What the handler keeps of a call's `limit`: all but [`DEADLINE_MARGIN`], or a quarter
/// of it for a short one, so that a call given 40 ms still has 30 to run (all but 50 ms
/// left it none: it failed at once, however quick the tool).
fn handler_limit(limit: Duration) -> Duration {
    limit.saturating_sub(DEADLINE_MARGIN.min(limit / 4))
}

/// `agent.v1.ToolExecutor` over a tool catalogue.
pub struct ToolExecutorService {
    catalogue: Arc<Catalogue>,
    /// Cancelled near the end of the drain grace: tools still running are told to stop.
    drain: CancellationToken,
    /// Largest answer to `ExecuteTool` (`server.max_message_bytes`).
    max_answer_bytes: usize,
}

impl ToolExecutorService {
    pub fn new(
        catalogue: Arc<Catalogue>,
        drain: CancellationToken,
        max_answer_bytes: usize,
    ) -> Self {
        Self {
            catalogue,
            drain,
            max_answer_bytes,
        }
    }
}

#[tonic::async_trait]
impl ToolExecutor for ToolExecutorService {
    async fn list_tools(
        &self,
        _request: Request<v1::ListToolsRequest>,
    ) -> Result<Response<v1::ListToolsResponse>, Status> {
        let tools = self.catalogue.specs().iter().map(tool_to_wire).collect();
        let response = v1::ListToolsResponse { tools };
        let size = prost::Message::encoded_len(&response);
        if size > agentrt_grpc::MAX_CATALOGUE_BYTES {
            return Err(status::resource_exhausted_for_good(
                "CATALOGUE_TOO_LARGE",
                format!(
                    "the tool catalogue takes {size} bytes, over the {} a ListTools answer \
                     may have: configure fewer tools, or sources with shorter descriptions \
                     and schemas",
                    agentrt_grpc::MAX_CATALOGUE_BYTES
                ),
            ));
        }
        Ok(Response::new(response))
    }

    async fn execute_tool(
        &self,
        request: Request<v1::ExecuteToolRequest>,
    ) -> Result<Response<v1::ExecuteToolResponse>, Status> {
        let limit = grpc_timeout(request.metadata());
        // Counted from the arrival, as tonic counts it: reading the body and waiting for a
        // worker under load come out of the call's time, not on top of it.
        let arrival = request
            .extensions()
            .get::<agentrt_grpc::metrics::Arrival>()
            .map_or_else(Instant::now, |arrival| arrival.0);
        let caller = agentrt_grpc::security::Principal::of(&request);
        let deadline =
            limit.and_then(|limit| Some((limit, arrival.checked_add(handler_limit(limit))?)));
        let request = request.into_inner();
        // Every violation at once. Names and ids go into logs, metrics, errors and the
        // calls' headers: bounded, and refused before anything runs.
        let violations: Vec<Violation> = request
            .tool_name
            .is_empty()
            .then(|| Violation::new("tool_name", "required"))
            .into_iter()
            .chain(
                [
                    ("tool_name", &request.tool_name),
                    ("call_id", &request.call_id),
                    ("run_id", &request.run_id),
                    ("session_id", &request.session_id),
                ]
                .into_iter()
                .filter(|(_, value)| value.len() > MAX_ID_BYTES)
                .map(|(field, value)| {
                    Violation::new(
                        field,
                        format!("at most {MAX_ID_BYTES} bytes, got {}", value.len()),
                    )
                }),
            )
            .collect();
        if !violations.is_empty() {
            return Err(status::invalid_argument("invalid tool call", &violations));
        }
        let arguments = request
            .arguments
            .as_ref()
            .map_or_else(|| serde_json::json!({}), json::struct_to_json);
        let ctx = ToolContext {
            call_id: idempotency_key(&caller, &request.call_id),
            run_id: request.run_id.clone(),
            session_id: request.session_id.clone(),
            cancel: self.drain.child_token(),
        };
        // When the caller cancels or the deadline passes, tonic drops this future: the
        // guard then tells work running outside it to stop too.
        let _stop_on_drop = ctx.cancel.clone().drop_guard();
        let span = info_span!(
            "execute_tool",
            gen_ai.operation.name = "execute_tool",
            gen_ai.tool.name = %request.tool_name,
            gen_ai.tool.call.id = %request.call_id,
            run_id = %request.run_id,
        );
        let started = Instant::now();
        // Counted and logged however the call ends: a caller that goes away (or whose
        // deadline tonic enforces) drops this future with the guard in it.
        let mut ended = Ended {
            tool: &request.tool_name,
            started,
            outcome: "cancelled",
        };
        let execution = self
            .catalogue
            .execute(&request.tool_name, arguments, &ctx)
            .instrument(span);
        let outcome =
            match deadline {
                Some((limit, deadline)) => tokio::time::timeout_at(deadline, execution)
                    .await
                    .map_err(|_| {
                        ctx.cancel.cancel();
                        ended.outcome = "timeout";
                        Status::deadline_exceeded(format!(
                            "tool {:?} did not finish within the call's deadline of {limit:?}",
                            request.tool_name
                        ))
                    })?,
                None => execution.await,
            };
        let duration = started.elapsed();
        let output = outcome.map_err(|e| {
            ended.outcome = match e {
                ExecuteError::Unavailable { .. } => "unavailable",
                ExecuteError::NotFound(_) | ExecuteError::InvalidArguments { .. } => "error",
            };
            // A name the caller made up (none listed, or under a source that is down) is
            // no series of its own: callers cannot use up the metric's tool names.
            if matches!(
                e,
                ExecuteError::NotFound(_) | ExecuteError::Unavailable { .. }
            ) {
                ended.tool = "unknown";
            }
            execute_error_to_status(&e)
        })?;
        // Stopped by this server's shutdown, not by the tool: the caller is to send it
        // again elsewhere (with its call_id), not to read it as the tool's failure.
        if output.stopped {
            ended.outcome = "unavailable";
            return Err(status::unavailable_about(
                "TOOL_EXECUTOR_DRAINING",
                format!(
                    "tool {:?} was stopped before it finished: the tool executor is shutting \
                     down (the tool may have done part of its work); send it again, with its \
                     call_id, to another tool executor",
                    request.tool_name
                ),
                Duration::ZERO,
                &[("tool", &request.tool_name), ("sent", "true")],
            ));
        }
        ended.outcome = match (output.timed_out, output.is_error) {
            (true, _) => "timeout",
            (false, true) => "error",
            (false, false) => "ok",
        };
        let mut answer = output_to_wire(request.call_id, output, duration);
        // A source's own limits (`max_output_bytes`, `max_response_bytes`) may be set above
        // the server's: the structured output (often the text again, parsed) goes first,
        // as an oversized one does at its source; an answer still too large is refused
        // rather than sent to callers that would refuse it themselves.
        let mut len = prost::Message::encoded_len(&answer);
        if len > self.max_answer_bytes && answer.structured_output.is_some() {
            answer.structured_output = None;
            len = prost::Message::encoded_len(&answer);
            debug!(tool = %request.tool_name, "structured output left out: the answer was over server.max_message_bytes");
        }
        if len > self.max_answer_bytes {
            ended.outcome = "error";
            return Err(status::resource_exhausted_for_good(
                "MESSAGE_TOO_LARGE",
                format!(
                    "the answer of tool {:?} is {len} bytes, over the limit of {} bytes \
                     (server.max_message_bytes); lower the source's limit of its output, or \
                     raise server.max_message_bytes (and what the callers accept)",
                    request.tool_name, self.max_answer_bytes
                ),
            ));
        }
        Ok(Response::new(answer))
    }
}

/// Longest tool name, call id, run id or session id a call may give, in bytes.
const MAX_ID_BYTES: usize = 256;

/// A tool call as it ends: logged and counted by outcome when dropped.
struct Ended<'a> {
    tool: &'a str,
    started: Instant,
    outcome: &'static str,
}

impl Drop for Ended<'_> {
    fn drop(&mut self) {
        let duration = self.started.elapsed();
        match self.outcome {
            "cancelled" => {
                debug!(tool = %self.tool, ?duration, "tool call stopped: its caller went away or its deadline passed");
            }
            outcome => {
                debug!(tool = %self.tool, ?duration, outcome, "tool call finished");
            }
        }
        agentrt_metrics::Metrics::global().tool_call_ended(self.tool, self.outcome, duration);
    }
}

fn execute_error_to_status(error: &ExecuteError) -> Status {
    match error {
        ExecuteError::NotFound(name) => status::not_found("TOOL_NOT_FOUND", "tool", name),
        ExecuteError::InvalidArguments { tool, violations } => status::invalid_argument(
            &format!("arguments do not match the input schema of tool {tool:?}"),
            violations,
        ),
        ExecuteError::Unavailable {
            tool,
            source_name,
            reason,
            retry_after,
            sent,
        } => status::unavailable_about(
            "TOOL_SOURCE_UNAVAILABLE",
            format!("tool {tool:?} is unavailable: {reason}"),
            *retry_after,
            // `sent`: whether the call reached the source, and so may have run.
            &[
                ("tool", tool),
                ("source", source_name),
                ("sent", if *sent { "true" } else { "false" }),
            ],
        ),
    }
}

fn tool_to_wire(spec: &ToolSpec) -> v1::Tool {
    v1::Tool {
        name: spec.name.clone(),
        description: spec.description.clone(),
        input_schema: json::json_to_struct(&spec.input_schema),
        source: match spec.source {
            ToolSource::Builtin => v1::ToolSource::Builtin,
            ToolSource::Http => v1::ToolSource::Http,
            ToolSource::Mcp => v1::ToolSource::Mcp,
            // The executor lists only its own tools.
            ToolSource::Client => v1::ToolSource::Unspecified,
        } as i32,
    }
}

/// How deep a call's structured output may nest.
const MAX_STRUCTURED_DEPTH: usize = agentrt_core::MAX_JSON_DEPTH;

fn output_to_wire(
    call_id: String,
    output: ToolOutput,
    duration: Duration,
) -> v1::ExecuteToolResponse {
    v1::ExecuteToolResponse {
        call_id,
        output: output.text,
        is_error: output.is_error,
        // Nested too deep for the callers' Protobuf decoders (each JSON level is up to
        // three message levels, and they refuse more than 100), the structured copy is
        // left out: the call's text still says what it answered.
        structured_output: output
            .structured
            .as_ref()
            .filter(|value| agentrt_core::json_depth(value) <= MAX_STRUCTURED_DEPTH)
            .map(json::json_to_value),
        references: output
            .references
            .into_iter()
            .map(|r| v1::Reference {
                title: r.title,
                url: r.url,
                snippet: r.snippet,
                score: r.score,
                source: r.source,
            })
            .collect(),
        duration: prost_types::Duration::try_from(duration).ok(),
    }
}

/// Reads the `grpc-timeout` header.
fn grpc_timeout(metadata: &MetadataMap) -> Option<Duration> {
    agentrt_grpc::parse_grpc_timeout(metadata.get("grpc-timeout")?.to_str().ok()?)
}

/// The idempotency key sources are sent for a call (`Idempotency-Key`, MCP's `_meta`): its
/// `call_id`, under its caller's principal when it has one (`PRINCIPAL/ID`), so that two
/// callers' calls of the same id are never taken for one.
fn idempotency_key(caller: &agentrt_grpc::security::Principal, call_id: &str) -> String {
    if caller.name.is_empty() || call_id.is_empty() {
        call_id.to_owned()
    } else {
        format!("{}/{call_id}", caller.name)
    }
}

#[cfg(test)]
mod tests {
    /// A call keeps all its time but a margin, small for a short deadline: one given 40 ms
    /// is not over before it begins.
    #[test]
    fn a_short_deadline_leaves_time_to_run() {
        let ms = Duration::from_millis;
        assert_eq!(handler_limit(ms(30_000)), ms(29_950));
        assert_eq!(handler_limit(ms(200)), ms(150));
        assert_eq!(handler_limit(ms(100)), ms(75));
        assert_eq!(handler_limit(ms(40)), ms(30));
        assert_eq!(handler_limit(Duration::ZERO), Duration::ZERO);
    }

    #[test]
    fn a_callers_calls_have_keys_of_their_own() {
        let caller = |name: &str| agentrt_grpc::security::Principal {
            name: name.into(),
            operator: false,
        };
        assert_eq!(idempotency_key(&caller(""), "call-1"), "call-1");
        assert_eq!(idempotency_key(&caller("shop"), "call-1"), "shop/call-1");
        assert_ne!(
            idempotency_key(&caller("shop"), "call-1"),
            idempotency_key(&caller("billing"), "call-1")
        );
        assert_eq!(idempotency_key(&caller("shop"), ""), "", "no id, no key");
    }

    use super::*;

    fn metadata(timeout: &str) -> MetadataMap {
        let mut map = MetadataMap::new();
        map.insert("grpc-timeout", timeout.parse().unwrap());
        map
    }

    #[test]
    fn grpc_timeouts_parse_every_unit() {
        assert_eq!(
            grpc_timeout(&metadata("2H")),
            Some(Duration::from_secs(7200))
        );
        assert_eq!(
            grpc_timeout(&metadata("3M")),
            Some(Duration::from_secs(180))
        );
        assert_eq!(grpc_timeout(&metadata("5S")), Some(Duration::from_secs(5)));
        assert_eq!(
            grpc_timeout(&metadata("250m")),
            Some(Duration::from_millis(250))
        );
        assert_eq!(
            grpc_timeout(&metadata("7u")),
            Some(Duration::from_micros(7))
        );
        assert_eq!(grpc_timeout(&metadata("9n")), Some(Duration::from_nanos(9)));
        assert_eq!(grpc_timeout(&metadata("5x")), None);
        assert_eq!(grpc_timeout(&metadata("S")), None);
        assert_eq!(grpc_timeout(&MetadataMap::new()), None);
    }

    /// A structured output nested deeper than callers' Protobuf decoders accept is left
    /// out, the text kept; one within the bound goes as it is.
    #[test]
    fn structured_output_nested_too_deep_is_left_out_and_the_text_kept() {
        let nested = |depth: usize| {
            (0..depth).fold(
                serde_json::json!(1),
                |inner, _| serde_json::json!({"a": inner}),
            )
        };
        let answer = |structured: serde_json::Value| {
            let output = ToolOutput {
                text: "the text".into(),
                structured: Some(structured),
                ..ToolOutput::default()
            };
            output_to_wire("c".into(), output, Duration::ZERO)
        };
        let deep = answer(nested(40));
        assert_eq!(deep.output, "the text");
        assert!(deep.structured_output.is_none());
        let shallow = answer(nested(MAX_STRUCTURED_DEPTH - 1));
        assert!(shallow.structured_output.is_some());
        // What is sent decodes (prost refuses messages nested past 100 levels).
        let bytes = prost::Message::encode_to_vec(&answer(nested(MAX_STRUCTURED_DEPTH - 1)));
        <v1::ExecuteToolResponse as prost::Message>::decode(bytes.as_slice()).unwrap();
    }

    /// The service of the built-in tools, answering at most `max_answer_bytes`.
    async fn builtins(max_answer_bytes: usize) -> ToolExecutorService {
        let catalogue = Catalogue::new(
            vec![Arc::new(agentrt_tools::builtin::Builtins::all())],
            agentrt_tools::Changes::new(),
        )
        .await
        .unwrap();
        ToolExecutorService::new(
            Arc::new(catalogue),
            CancellationToken::new(),
            max_answer_bytes,
        )
    }

    /// An answer over `server.max_message_bytes` (a source's own limits set above it) is
    /// refused as the README says, naming the setting, not sent to callers that refuse it.
    #[tokio::test]
    async fn answers_over_the_message_limit_are_resource_exhausted() {
        let service = builtins(8).await;
        let status = service
            .execute_tool(Request::new(v1::ExecuteToolRequest {
                call_id: "c1".into(),
                tool_name: "calculator".into(),
                arguments: json::json_to_struct(&serde_json::json!({"expression": "6 * 7"})),
                ..Default::default()
            }))
            .await
            .unwrap_err();
        assert_eq!(status.code(), tonic::Code::ResourceExhausted);
        assert!(
            status
                .message()
                .contains("over the limit of 8 bytes (server.max_message_bytes)"),
            "{status:?}"
        );
    }

    #[tokio::test]
    async fn tool_errors_are_results_and_unknown_tools_not_found() {
        let service = builtins(4 * 1024 * 1024).await;
        let call = |name: &str, args: serde_json::Value| {
            Request::new(v1::ExecuteToolRequest {
                call_id: "c1".into(),
                tool_name: name.into(),
                arguments: json::json_to_struct(&args),
                ..Default::default()
            })
        };
        let out = service
            .execute_tool(call(
                "calculator",
                serde_json::json!({"expression": "7 % 0"}),
            ))
            .await
            .unwrap()
            .into_inner();
        assert!(out.is_error);
        assert_eq!(out.call_id, "c1");
        let err = service
            .execute_tool(call("missing", serde_json::json!({})))
            .await
            .unwrap_err();
        assert_eq!(err.code(), tonic::Code::NotFound);
    }
}
