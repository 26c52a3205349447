//! Conversions between the wire `AgentConfig` and the domain one, at the service edge.

use std::{
    collections::BTreeMap,
    time::{Duration, SystemTime},
};

use agentrt::v1;
use agentrt_core::{
    AgentConfig, ClientTool, ContextBudget, ModelSelection, RerankSelection, Strategy, Timeouts,
    Violation,
};
use agentrt_engine::{RunRecord, RunStatus, StopReason};

use crate::error::Error;
use agentrt_events::{EventData, EventKind, RunEvent};

/// Converts a config that passed validation (defaults applied, every field in range).
/// Fields validation guarantees are read with their defaults as a fallback, never a panic.
pub fn config_from_wire(config: &v1::AgentConfig) -> AgentConfig {
    let model = config.model.clone().unwrap_or_default();
    let timeouts = config.timeouts.unwrap_or_default();
    let defaults = Timeouts::default();
    AgentConfig {
        name: config.name.clone(),
        system_prompt: config.system_prompt.clone(),
        model: ModelSelection {
            provider: model.provider,
            name: model.name,
            temperature: model.temperature,
            max_tokens: u32::try_from(model.max_tokens).ok().filter(|n| *n > 0),
        },
        rerank_model: config.rerank_model.clone().map(|r| RerankSelection {
            provider: r.provider,
            name: r.name,
            top_n: u32::try_from(r.top_n).unwrap_or(1),
            min_score: r.min_score,
        }),
        strategy: match v1::Strategy::try_from(config.strategy) {
            Ok(v1::Strategy::React) => Strategy::React,
            _ => Strategy::FunctionCall,
        },
        max_iterations: u32::try_from(config.max_iterations).unwrap_or(1),
        tools: config.tools.iter().map(|t| t.name.clone()).collect(),
        approval: config
            .tools
            .iter()
            .filter(|t| t.require_approval)
            .map(|t| t.name.clone())
            .collect(),
        client_tools: config
            .client_tools
            .iter()
            .map(|t| ClientTool {
                name: t.name.clone(),
                description: t.description.clone(),
                input_schema: crate::validate::client_tool_schema(t),
            })
            .collect(),
        parallel_tool_calls: config.parallel_tool_calls,
        max_parallel_tool_calls: u32::try_from(config.max_parallel_tool_calls).unwrap_or(1),
        context: ContextBudget {
            max_prompt_tokens: config
                .context
                .map_or(0, |c| u32::try_from(c.max_prompt_tokens).unwrap_or(0)),
        },
        timeouts: Timeouts {
            run: duration_from_wire(timeouts.run).unwrap_or(defaults.run),
            model_call: duration_from_wire(timeouts.model_call).unwrap_or(defaults.model_call),
            tool_call: duration_from_wire(timeouts.tool_call).unwrap_or(defaults.tool_call),
            action: duration_from_wire(timeouts.action).unwrap_or(defaults.action),
        },
    }
}

/// The wire form of a domain config, as `GetAgentEngine` and `CreateAgentEngine` return it.
pub fn config_to_wire(config: &AgentConfig) -> v1::AgentConfig {
    let clamp = |n: u32| i32::try_from(n).unwrap_or(i32::MAX);
    v1::AgentConfig {
        name: config.name.clone(),
        system_prompt: config.system_prompt.clone(),
        model: Some(v1::ModelConfig {
            provider: config.model.provider.clone(),
            name: config.model.name.clone(),
            temperature: config.model.temperature,
            max_tokens: config.model.max_tokens.map_or(0, clamp),
        }),
        rerank_model: config.rerank_model.as_ref().map(|r| v1::RerankModelConfig {
            provider: r.provider.clone(),
            name: r.name.clone(),
            top_n: clamp(r.top_n),
            min_score: r.min_score,
        }),
        strategy: match config.strategy {
            Strategy::FunctionCall => v1::Strategy::FunctionCall,
            Strategy::React => v1::Strategy::React,
        } as i32,
        max_iterations: clamp(config.max_iterations),
        tools: config
            .tools
            .iter()
            .map(|name| v1::ToolRef {
                name: name.clone(),
                require_approval: config.needs_approval(name),
            })
            .collect(),
        client_tools: config
            .client_tools
            .iter()
            .map(|t| v1::ClientTool {
                name: t.name.clone(),
                description: t.description.clone(),
                input_schema: agentrt::json::json_to_struct(&t.input_schema),
            })
            .collect(),
        parallel_tool_calls: config.parallel_tool_calls,
        max_parallel_tool_calls: clamp(config.max_parallel_tool_calls),
        context: Some(v1::ContextConfig {
            max_prompt_tokens: clamp(config.context.max_prompt_tokens),
        }),
        timeouts: Some(v1::Timeouts {
            run: duration_to_wire(config.timeouts.run),
            model_call: duration_to_wire(config.timeouts.model_call),
            tool_call: duration_to_wire(config.timeouts.tool_call),
            action: duration_to_wire(config.timeouts.action),
        }),
    }
}

fn duration_from_wire(d: Option<prost_types::Duration>) -> Option<Duration> {
    d.and_then(|d| Duration::try_from(d).ok())
}

fn duration_to_wire(d: Duration) -> Option<prost_types::Duration> {
    prost_types::Duration::try_from(d).ok()
}

/// A timestamp for the wire.
pub fn timestamp(t: SystemTime) -> prost_types::Timestamp {
    prost_types::Timestamp::from(t)
}

/// An event of the bus as clients see it.
pub fn event_to_wire(
    event: &RunEvent,
    run_id: &str,
    session_id: &str,
    message_id: &str,
) -> v1::AgentStreamEvent {
    v1::AgentStreamEvent {
        r#type: match event.kind {
            EventKind::Thought => v1::EventType::Thought,
            EventKind::ToolCall => v1::EventType::ToolCall,
            EventKind::ToolResult => v1::EventType::ToolResult,
            EventKind::FinalAnswer => v1::EventType::FinalAnswer,
            EventKind::References => v1::EventType::References,
            EventKind::Error => v1::EventType::Error,
            EventKind::RunStarted => v1::EventType::RunStarted,
            EventKind::RoundRestarted => v1::EventType::RoundRestarted,
            EventKind::ActionRequired => v1::EventType::ActionRequired,
        } as i32,
        content: event.content.clone(),
        data: event.data.as_deref().map(event_data_to_wire),
        done: event.done,
        iteration: i32::try_from(event.iteration).unwrap_or(i32::MAX),
        run_id: run_id.to_owned(),
        session_id: session_id.to_owned(),
        message_id: message_id.to_owned(),
        sequence: event.sequence,
        create_time: Some(timestamp(event.time)),
    }
}

/// An event's payload for the wire: the object [`EventData::to_json`] gives. Tool calls
/// and results, a few per run, are built straight into the `Struct`.
pub fn event_data_to_wire(data: &EventData) -> prost_types::Struct {
    use prost_types::{Value, value::Kind};
    let text = |s: &str| Value {
        kind: Some(Kind::StringValue(s.to_owned())),
    };
    fn fields<const N: usize>(pairs: [(&str, Value); N]) -> BTreeMap<String, Value> {
        pairs.into_iter().map(|(k, v)| (k.to_owned(), v)).collect()
    }
    let fields = match data {
        EventData::ToolCall {
            id,
            name,
            arguments,
        } => fields([
            ("id", text(id)),
            ("name", text(name)),
            (
                "arguments",
                agentrt::json::json_to_value(&arguments.value()),
            ),
        ]),
        EventData::ToolResult {
            id,
            name,
            output,
            is_error,
            duration_ms,
        } => fields([
            ("id", text(id)),
            ("name", text(name)),
            ("output", text(output)),
            (
                "is_error",
                Value {
                    kind: Some(Kind::BoolValue(*is_error)),
                },
            ),
            (
                "duration_ms",
                Value {
                    #[allow(clippy::cast_precision_loss)] // durations stay far below 2^53 ms
                    kind: Some(Kind::NumberValue(*duration_ms as f64)),
                },
            ),
        ]),
        EventData::RunStarted { engine_id, agent } => {
            fields([("engine_id", text(engine_id)), ("agent", text(agent))])
        }
        EventData::References { .. }
        | EventData::End(_)
        | EventData::RoundRestarted { .. }
        | EventData::ActionRequired { .. } => {
            return agentrt::json::json_to_struct(&data.to_json()).unwrap_or_default();
        }
    };
    prost_types::Struct { fields }
}

/// A run status for the wire.
pub fn run_status_to_wire(status: RunStatus) -> v1::RunStatus {
    match status {
        RunStatus::Running => v1::RunStatus::Running,
        RunStatus::Succeeded => v1::RunStatus::Succeeded,
        RunStatus::Failed => v1::RunStatus::Failed,
        RunStatus::Cancelled => v1::RunStatus::Cancelled,
        RunStatus::Incomplete => v1::RunStatus::Incomplete,
        RunStatus::RequiresAction => v1::RunStatus::RequiresAction,
    }
}

fn stop_reason_to_wire(reason: Option<StopReason>) -> v1::StopReason {
    match reason {
        None => v1::StopReason::Unspecified,
        Some(StopReason::FinalAnswer) => v1::StopReason::FinalAnswer,
        Some(StopReason::MaxIterations) => v1::StopReason::MaxIterations,
        Some(StopReason::Cancelled) => v1::StopReason::Cancelled,
        Some(StopReason::Timeout) => v1::StopReason::Timeout,
        Some(StopReason::ModelError) => v1::StopReason::ModelError,
        Some(StopReason::Shutdown) => v1::StopReason::Shutdown,
        Some(StopReason::InternalError) => v1::StopReason::InternalError,
        Some(StopReason::MaxTokens) => v1::StopReason::MaxTokens,
        Some(StopReason::ActionTimeout) => v1::StopReason::ActionTimeout,
        Some(StopReason::BudgetExceeded) => v1::StopReason::BudgetExceeded,
    }
}

/// What a response keeps free of its size limit for the gRPC frame and headers.
const RESPONSE_MARGIN_BYTES: usize = 4096;

/// A run's record as `GetRun` answers it, within `max_bytes` encoded: when the whole
/// record does not fit, the steps' texts and tool-call arguments are cut first (the longest
/// first), then the arguments of the calls the run waits for, then the final answer, each
/// cut marked with the size of the whole, and `truncated` says so. The events carry every
/// text whole. A record that does not fit even so (its query alone is larger) is
/// [`Error::AnswerTooLarge`].
pub fn record_to_wire(record: &RunRecord, max_bytes: usize) -> Result<v1::AgentState, Error> {
    use prost::Message;
    let whole = whole_record_to_wire(record);
    let budget = max_bytes.saturating_sub(RESPONSE_MARGIN_BYTES);
    if whole.encoded_len() <= budget {
        return Ok(whole);
    }
    // Halve the room of each step text until the whole fits, cutting from the whole texts
    // each time (a cut of a cut would say its marker's size).
    let mut state = whole.clone();
    let mut room = 64 * 1024;
    while state.encoded_len() > budget && room > 0 {
        state.clone_from(&whole);
        for step in &mut state.steps {
            cut_text(&mut step.thought, room);
            cut_text(&mut step.answer, room);
            for call in &mut step.tool_calls {
                cut_text(&mut call.output, room);
                cut_arguments(&mut call.arguments, room);
            }
        }
        room /= 2;
    }
    state.truncated = true;
    // The calls it waits for (their `TOOL_CALL` events have them whole), the largest
    // first.
    let mut order: Vec<usize> = (0..state.pending_tool_calls.len()).collect();
    order.sort_by_key(|&i| {
        std::cmp::Reverse(
            state.pending_tool_calls[i]
                .arguments
                .as_ref()
                .map_or(0, Message::encoded_len),
        )
    });
    for i in order {
        if state.encoded_len() <= budget {
            break;
        }
        cut_arguments(&mut state.pending_tool_calls[i].arguments, 0);
    }
    let over = state.encoded_len().saturating_sub(budget);
    if over > 0 {
        let keep = state.final_answer.len().saturating_sub(over + 256);
        cut_text(&mut state.final_answer, keep);
    }
    let bytes = state.encoded_len();
    if bytes > max_bytes {
        return Err(Error::AnswerTooLarge {
            bytes,
            max: max_bytes,
        });
    }
    Ok(state)
}

/// Cuts `text` to at most `max` bytes at a character boundary, marking the cut.
fn cut_text(text: &mut String, max: usize) {
    if let Some((omitted, total)) = agentrt_core::truncate_at_char_boundary(text, max) {
        text.push_str(&format!(
            "[cut: {omitted} of {total} bytes; Subscribe to the run for the whole text]"
        ));
    }
}

/// Replaces `arguments` encoded in more than `max` bytes by a note of their size.
fn cut_arguments(arguments: &mut Option<prost_types::Struct>, max: usize) {
    use prost::Message;
    let size = arguments.as_ref().map_or(0, Message::encoded_len);
    if size > max {
        *arguments = agentrt::json::json_to_struct(&serde_json::json!({
            "cut": format!("{size} bytes of arguments; Subscribe to the run for them"),
        }));
    }
}

fn whole_record_to_wire(record: &RunRecord) -> v1::AgentState {
    let usage = record.usage;
    // A run whose every pending call is answered goes on (once a replica with room
    // continues it, which then saves it running): it reads so at once, as the answer that
    // completed its wait said.
    let waits = record.waiting() && record.pending.iter().any(|call| !call.answered);
    let status = if record.waiting() && !waits {
        RunStatus::Running
    } else {
        record.status
    };
    let to_i64 = |n: u64| i64::try_from(n).unwrap_or(i64::MAX);
    v1::AgentState {
        run_id: record.run_id.clone(),
        engine_id: record.engine_id.clone(),
        session_id: crate::tenancy::client_session(&record.session_id).to_owned(),
        message_id: record.message_id.clone(),
        query: record.query.clone(),
        status: run_status_to_wire(status) as i32,
        stop_reason: stop_reason_to_wire(record.stop_reason) as i32,
        steps: record
            .steps
            .iter()
            .map(|step| v1::RunStep {
                iteration: i32::try_from(step.iteration).unwrap_or(i32::MAX),
                thought: step.thought.clone(),
                tool_calls: step
                    .tool_calls
                    .iter()
                    .map(|call| v1::ToolCallRecord {
                        id: call.id.clone(),
                        name: call.name.clone(),
                        arguments: match call.arguments.value() {
                            arguments @ serde_json::Value::Object(_) => {
                                agentrt::json::json_to_struct(&arguments)
                            }
                            raw => {
                                agentrt::json::json_to_struct(&serde_json::json!({ "raw": raw }))
                            }
                        },
                        output: call.output.clone(),
                        is_error: call.is_error,
                        // None while the call runs or waits for its answer: it took no
                        // time yet that a client could read as its own.
                        duration: call
                            .finished
                            .then(|| duration_to_wire(call.duration))
                            .flatten(),
                        references: call
                            .references
                            .iter()
                            .map(|r| v1::Reference {
                                title: r.title.clone(),
                                url: r.url.clone(),
                                snippet: r.snippet.clone(),
                                score: r.score,
                                source: r.source.clone(),
                            })
                            .collect(),
                    })
                    .collect(),
                answer: step.answer.clone(),
            })
            .collect(),
        final_answer: record.final_answer.clone(),
        usage: Some(v1::TokenUsage {
            prompt_tokens: to_i64(usage.prompt_tokens),
            completion_tokens: to_i64(usage.completion_tokens),
            total_tokens: to_i64(usage.prompt_tokens.saturating_add(usage.completion_tokens)),
            estimated: usage.estimated,
        }),
        error: record.error.as_ref().map(|e| v1::RunError {
            code: e.code.clone(),
            message: e.message.clone(),
            category: e.category.to_owned(),
            retryable: e.retryable,
        }),
        iterations: record
            .steps
            .last()
            .map_or(0, |s| i32::try_from(s.iteration).unwrap_or(i32::MAX)),
        last_sequence: record.last_sequence,
        create_time: Some(timestamp(record.create_time)),
        update_time: Some(timestamp(record.update_time)),
        truncated: false,
        // Only while the run waits, as the proto says (a run that failed as it began to
        // wait listed the calls it no longer waited for).
        pending_tool_calls: record
            .pending
            .iter()
            .filter(|_| waits)
            .map(|call| v1::PendingToolCall {
                id: call.id.clone(),
                name: call.name.clone(),
                arguments: agentrt::json::json_to_struct(&call.arguments.value()),
                action: call.action.as_str().to_owned(),
                answered: call.answered,
            })
            .collect(),
    }
}

/// Most tool calls of one `llm_context` message: as many as a model's reply may hold.
pub const MAX_CONTEXT_CALLS: usize = 128;

/// A message of an `Execute` request's `llm_context`, as the model is sent it; `index`
/// names it in the violation when it is not one. Only an assistant message makes tool
/// calls (at most [`MAX_CONTEXT_CALLS`], each with an id and a name, the ids distinct),
/// and only a tool message answers one.
pub fn message_from_wire(
    index: usize,
    message: &v1::ChatMessage,
) -> Result<agentrt_models::ChatMessage, Violation> {
    use agentrt_models::{ChatMessage, ModelToolCall};
    let role = v1::Role::try_from(message.role);
    if !message.tool_calls.is_empty() && role != Ok(v1::Role::Assistant) {
        return Err(Violation::new(
            format!("llm_context[{index}].tool_calls"),
            "only a ROLE_ASSISTANT message makes tool calls",
        ));
    }
    if !message.tool_call_id.is_empty() && role != Ok(v1::Role::Tool) {
        return Err(Violation::new(
            format!("llm_context[{index}].tool_call_id"),
            "only a ROLE_TOOL message answers a tool call",
        ));
    }
    if message.tool_calls.len() > MAX_CONTEXT_CALLS {
        return Err(Violation::new(
            format!("llm_context[{index}].tool_calls"),
            format!(
                "at most {MAX_CONTEXT_CALLS} per message, got {}",
                message.tool_calls.len()
            ),
        ));
    }
    for (call, c) in message.tool_calls.iter().enumerate() {
        // Providers refuse a call without a name or an id (and the whole request with it),
        // and some refuse two calls of one id.
        let field = |what: &str| format!("llm_context[{index}].tool_calls[{call}].{what}");
        if c.id.is_empty() {
            return Err(Violation::new(field("id"), "required"));
        }
        if c.name.is_empty() {
            return Err(Violation::new(field("name"), "required"));
        }
        if let Some(first) = message.tool_calls[..call].iter().position(|o| o.id == c.id) {
            return Err(Violation::new(
                field("id"),
                format!("duplicate of tool_calls[{first}]: each call has an id of its own"),
            ));
        }
    }
    let content = message.content.clone();
    match role {
        Ok(v1::Role::System) => Ok(ChatMessage::System(content)),
        Ok(v1::Role::User) => Ok(ChatMessage::User(content)),
        Ok(v1::Role::Assistant) => Ok(ChatMessage::Assistant {
            content,
            tool_calls: message
                .tool_calls
                .iter()
                .map(|c| ModelToolCall {
                    id: c.id.clone(),
                    name: c.name.clone(),
                    arguments: c.arguments.as_ref().map_or_else(
                        || "{}".to_owned(),
                        |a| agentrt::json::struct_to_json(a).to_string(),
                    ),
                })
                .collect(),
        }),
        Ok(v1::Role::Tool) if message.tool_call_id.is_empty() => Err(Violation::new(
            format!("llm_context[{index}].tool_call_id"),
            "required for ROLE_TOOL",
        )),
        Ok(v1::Role::Tool) => Ok(ChatMessage::Tool {
            call_id: message.tool_call_id.clone(),
            content,
        }),
        Ok(v1::Role::Unspecified) | Err(_) => Err(Violation::new(
            format!("llm_context[{index}].role"),
            "must be ROLE_SYSTEM, ROLE_USER, ROLE_ASSISTANT or ROLE_TOOL",
        )),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every payload reaches the wire as the object `EventData::to_json` describes.
    #[test]
    fn event_payloads_reach_the_wire_as_their_json() {
        use agentrt_events::{RunFailure, RunSummary};
        let payloads = [
            EventData::ToolCall {
                id: "c1".into(),
                name: "calculator".into(),
                arguments: agentrt_events::JsonText::new(
                    &serde_json::json!({"expression": "6 * 7", "n": [1, 2.5]}),
                ),
            },
            EventData::ToolResult {
                id: "c1".into(),
                name: "calculator".into(),
                output: "42".into(),
                is_error: false,
                duration_ms: 3,
            },
            EventData::References {
                tool_call_id: "c1".into(),
                references: vec![serde_json::json!({"title": "t", "url": "u", "score": 0.5})],
                rerank: Some(agentrt_events::RerankOutcome::Failed("down".into())),
            },
            EventData::RunStarted {
                engine_id: "e1".into(),
                agent: "a".into(),
            },
            EventData::End(RunSummary {
                stop_reason: "model_error",
                prompt_tokens: 10,
                completion_tokens: 5,
                usage_estimated: false,
                iterations: 2,
                note: None,
                error: Some(RunFailure {
                    code: "MODEL_HTTP_500".into(),
                    message: "boom".into(),
                    category: "model",
                    retryable: true,
                }),
            }),
        ];
        for data in payloads {
            let wire = agentrt::json::struct_to_json(&event_data_to_wire(&data));
            assert_eq!(wire, data.to_json(), "{data:?}");
        }
        let done = EventData::End(RunSummary {
            stop_reason: "final_answer",
            prompt_tokens: 10,
            completion_tokens: 5,
            usage_estimated: true,
            iterations: 2,
            note: None,
            error: None,
        });
        assert_eq!(
            done.to_json(),
            serde_json::json!({
                "stop_reason": "final_answer",
                "usage": {"prompt_tokens": 10, "completion_tokens": 5, "total_tokens": 15, "estimated": true},
                "iterations": 2,
            })
        );
    }

    /// A waiting run reads as waiting, with its calls, until every call is answered;
    /// then as running (the answer that completed it said so), before a replica with room
    /// continues it and saves it so.
    #[test]
    fn a_run_answered_in_full_reads_running_before_it_goes_on() {
        let mut record = RunRecord::new("r", "e", "s", "m", "q");
        record.status = RunStatus::RequiresAction;
        let call = |id: &str, answered: bool| agentrt_state::PendingCall {
            id: id.into(),
            name: "t".into(),
            arguments: agentrt_events::JsonText::new(&serde_json::json!({})),
            action: agentrt_state::Action::ClientExecute,
            answered,
        };
        record.pending = vec![call("c1", true), call("c2", false)];
        let state = record_to_wire(&record, 1 << 20).unwrap();
        assert_eq!(state.status, v1::RunStatus::RequiresAction as i32);
        assert_eq!(state.pending_tool_calls.len(), 2);
        record.pending[1].answered = true;
        let state = record_to_wire(&record, 1 << 20).unwrap();
        assert_eq!(state.status, v1::RunStatus::Running as i32);
        assert!(state.pending_tool_calls.is_empty());
    }

    #[test]
    fn get_run_answers_stay_within_the_message_limit() {
        use prost::Message;
        let now = SystemTime::now();
        let big = "é".repeat(1024 * 1024);
        let record = RunRecord {
            run_id: "r".into(),
            engine_id: "e".into(),
            session_id: "s".into(),
            message_id: "m".into(),
            query: "q".into(),
            status: RunStatus::Succeeded,
            stop_reason: Some(StopReason::FinalAnswer),
            steps: vec![agentrt_engine::StepRecord {
                iteration: 1,
                thought: big.clone(),
                tool_calls: Vec::new(),
                answer: big.clone(),
            }],
            final_answer: big.clone(),
            usage: agentrt_engine::TokenUsage::default(),
            error: None,
            last_sequence: 3,
            pending: Vec::new(),
            create_time: now,
            update_time: now,
            abandoned: false,
            owner: String::new(),
        };
        let limit = 4 * 1024 * 1024;
        // 2 MiB answers, each held twice and a thought beside: 6 MiB whole.
        let state = record_to_wire(&record, limit).unwrap();
        assert!(state.encoded_len() <= limit, "{}", state.encoded_len());
        assert!(state.truncated);
        assert_eq!(
            state.final_answer, big,
            "the answer is kept whole when it fits"
        );
        assert!(state.steps[0].answer.contains("[cut: "));
        // An answer larger than the limit itself is cut too, and marked.
        let state = record_to_wire(&record, 1024 * 1024).unwrap();
        assert!(state.encoded_len() <= 1024 * 1024);
        // Each cut says the size of the whole text, however often its room was halved.
        let whole = format!(
            "of {} bytes; Subscribe to the run for the whole text]",
            big.len()
        );
        assert!(
            state.steps[0].answer.ends_with(&whole),
            "{}",
            &state.steps[0].answer[..100]
        );
        // A record whose query alone is larger than the limit is refused, not sent over it.
        let asked = RunRecord {
            query: big.clone(),
            ..record.clone()
        };
        assert!(matches!(
            record_to_wire(&asked, 1024 * 1024),
            Err(Error::AnswerTooLarge { max: 1_048_576, .. })
        ));
        assert!(
            state
                .final_answer
                .ends_with("Subscribe to the run for the whole text]")
        );
        // Tool-call arguments too: a step's copies first, then those of the calls the
        // run waits for.
        let arguments = agentrt_events::JsonText::new(&serde_json::json!({"text": big}));
        let call = agentrt_engine::ToolCallRecord {
            id: "c".into(),
            name: "write".into(),
            arguments: arguments.clone(),
            output: String::new(),
            is_error: false,
            duration: std::time::Duration::ZERO,
            references: Vec::new(),
            finished: false,
        };
        let waiting = RunRecord {
            status: RunStatus::RequiresAction,
            stop_reason: None,
            steps: vec![agentrt_engine::StepRecord {
                iteration: 1,
                thought: String::new(),
                tool_calls: vec![call.clone(), call],
                answer: String::new(),
            }],
            final_answer: String::new(),
            pending: vec![agentrt_events::PendingCall {
                id: "c".into(),
                name: "write".into(),
                arguments,
                action: agentrt_events::Action::ClientExecute,
                answered: false,
            }],
            ..record.clone()
        };
        let state = record_to_wire(&waiting, limit).unwrap();
        assert!(state.encoded_len() <= limit, "{}", state.encoded_len());
        assert!(state.truncated);
        let cut = |call: &Option<prost_types::Struct>| {
            agentrt::json::struct_to_json(call.as_ref().unwrap())["cut"]
                .as_str()
                .unwrap_or_default()
                .to_owned()
        };
        assert!(cut(&state.steps[0].tool_calls[0].arguments).contains("bytes of arguments"));
        assert_eq!(
            cut(&state.pending_tool_calls[0].arguments),
            "",
            "kept when it fits"
        );
        let state = record_to_wire(&waiting, 1024 * 1024).unwrap();
        assert!(
            state.encoded_len() <= 1024 * 1024,
            "{}",
            state.encoded_len()
        );
        assert!(
            cut(&state.pending_tool_calls[0].arguments).ends_with("Subscribe to the run for them")
        );
        // A small record is whole and says so.
        let small = RunRecord {
            steps: Vec::new(),
            final_answer: "42".into(),
            ..record
        };
        assert!(!record_to_wire(&small, limit).unwrap().truncated);
    }

    #[test]
    fn an_effective_config_survives_the_round_trip() {
        let wire = v1::AgentConfig {
            name: "a".into(),
            system_prompt: "be brief".into(),
            model: Some(v1::ModelConfig {
                provider: "openai".into(),
                name: "m".into(),
                temperature: Some(0.5),
                max_tokens: 256,
            }),
            rerank_model: Some(v1::RerankModelConfig {
                provider: "openai".into(),
                name: "r".into(),
                top_n: 3,
                min_score: 0.25,
            }),
            strategy: v1::Strategy::React as i32,
            max_iterations: 7,
            tools: vec![v1::ToolRef {
                name: "calculator".into(),
                require_approval: true,
            }],
            parallel_tool_calls: true,
            max_parallel_tool_calls: 2,
            context: Some(v1::ContextConfig {
                max_prompt_tokens: 4096,
            }),
            timeouts: Some(v1::Timeouts {
                run: Some(prost_types::Duration {
                    seconds: 60,
                    nanos: 0,
                }),
                model_call: Some(prost_types::Duration {
                    seconds: 30,
                    nanos: 500_000_000,
                }),
                tool_call: Some(prost_types::Duration {
                    seconds: 10,
                    nanos: 0,
                }),
                action: Some(prost_types::Duration {
                    seconds: 600,
                    nanos: 0,
                }),
            }),
            client_tools: vec![v1::ClientTool {
                name: "lookup_order".into(),
                description: "Finds an order".into(),
                input_schema: agentrt::json::json_to_struct(&serde_json::json!({
                    "type": "object",
                    "properties": {"id": {"type": "string"}},
                    "required": ["id"],
                })),
            }],
        };
        assert_eq!(config_to_wire(&config_from_wire(&wire)), wire);
    }
}
