//! How a model asks for tools: natively (function calling) or in text (ReAct). A strategy
//! is a type; the driver and the step machine ask it, and never test which one it is.

use std::sync::Arc;

use agentrt_context::TokenCounter;
use agentrt_core::{AgentConfig, ToolResult, ToolSpec};
use agentrt_models::{ChatMessage, ModelToolCall, ToolDefinition};

use crate::react;

/// What a model round is told and how its reply and the tool results become messages.
pub(crate) trait Strategy: Send + Sync {
    /// The system message: the agent's prompt, and what the strategy must teach.
    fn system_message(&self, config: &AgentConfig, tools: &[ToolSpec]) -> Option<ChatMessage>;
    /// The tools offered natively with each request.
    fn tool_definitions(&self, tools: &[ToolSpec]) -> Arc<[ToolDefinition]>;
    /// Stop sequences of each request.
    fn stop(&self) -> Vec<String>;
    /// A parser of the reply's text, when the strategy reads tool calls from text.
    fn reply_parser(&self) -> Option<react::Parser>;
    /// Adds a round that called tools, and their results, to the turn's messages.
    fn record_tools(
        &self,
        messages: &mut Vec<(ChatMessage, u32)>,
        content: String,
        calls: &[ModelToolCall],
        results: Vec<ToolResult>,
        counter: &TokenCounter,
    );
    /// Adds a reply that neither acted nor answered, and what the model is told then.
    fn record_unreadable(
        &self,
        messages: &mut Vec<(ChatMessage, u32)>,
        content: String,
        counter: &TokenCounter,
    );
    /// What the model is asked when it may use no more tools.
    fn final_request(&self) -> String;
    /// The answer in a final reply that called tools anyway (they do not run): its text,
    /// when the strategy streams it as an answer.
    fn answer_beside_calls(&self, content: String) -> Option<String>;
}

/// Native tool calling.
pub(crate) struct FunctionCalling;

/// The ReAct text protocol, for models without tool calling.
pub(crate) struct React;

/// The strategy a config asks for.
pub(crate) fn of(strategy: agentrt_core::Strategy) -> &'static dyn Strategy {
    match strategy {
        agentrt_core::Strategy::FunctionCall => &FunctionCalling,
        agentrt_core::Strategy::React => &React,
    }
}

/// Asked after the last allowed round, so that the run still ends with an answer.
const FINAL_REQUEST: &str = "You have used all the steps you may take. Without calling any tool, \
    answer the original question now, as well as you can from the information above.";

/// What the model is told when a ReAct reply neither acts nor answers.
const REACT_FORMAT_REMINDER: &str = "Invalid format: your reply had neither `Action:` with \
    `Action Input:` nor `Final Answer:`. Reply in the format described above.";

pub(crate) fn push(
    messages: &mut Vec<(ChatMessage, u32)>,
    message: ChatMessage,
    counter: &TokenCounter,
) {
    let tokens = counter.message(&message);
    messages.push((message, tokens));
}

fn prompt(config: &AgentConfig) -> Option<ChatMessage> {
    (!config.system_prompt.is_empty()).then(|| ChatMessage::System(config.system_prompt.clone()))
}

impl Strategy for FunctionCalling {
    fn system_message(&self, config: &AgentConfig, _tools: &[ToolSpec]) -> Option<ChatMessage> {
        prompt(config)
    }

    fn tool_definitions(&self, tools: &[ToolSpec]) -> Arc<[ToolDefinition]> {
        tools
            .iter()
            .map(|t| ToolDefinition {
                name: t.name.clone(),
                description: t.description.clone(),
                parameters: t.input_schema.clone(),
            })
            .collect()
    }

    fn stop(&self) -> Vec<String> {
        Vec::new()
    }

    fn reply_parser(&self) -> Option<react::Parser> {
        None
    }

    fn record_tools(
        &self,
        messages: &mut Vec<(ChatMessage, u32)>,
        content: String,
        calls: &[ModelToolCall],
        results: Vec<ToolResult>,
        counter: &TokenCounter,
    ) {
        push(
            messages,
            ChatMessage::Assistant {
                content,
                tool_calls: calls.to_vec(),
            },
            counter,
        );
        for (call, result) in calls.iter().zip(results) {
            push(
                messages,
                ChatMessage::Tool {
                    call_id: call.id.clone(),
                    content: result.output,
                },
                counter,
            );
        }
    }

    fn record_unreadable(
        &self,
        messages: &mut Vec<(ChatMessage, u32)>,
        content: String,
        counter: &TokenCounter,
    ) {
        // Native replies are always readable; kept for symmetry.
        push(
            messages,
            ChatMessage::Assistant {
                content,
                tool_calls: Vec::new(),
            },
            counter,
        );
    }

    fn final_request(&self) -> String {
        FINAL_REQUEST.to_owned()
    }

    fn answer_beside_calls(&self, content: String) -> Option<String> {
        (!content.trim().is_empty()).then_some(content)
    }
}

impl Strategy for React {
    fn system_message(&self, config: &AgentConfig, tools: &[ToolSpec]) -> Option<ChatMessage> {
        let mut text = config.system_prompt.clone();
        if !text.is_empty() {
            text.push_str("\n\n");
        }
        text.push_str(&react::instructions(tools));
        Some(ChatMessage::System(text))
    }

    fn tool_definitions(&self, _tools: &[ToolSpec]) -> Arc<[ToolDefinition]> {
        Arc::default()
    }

    fn stop(&self) -> Vec<String> {
        vec![react::STOP.to_owned()]
    }

    fn reply_parser(&self) -> Option<react::Parser> {
        Some(react::Parser::default())
    }

    fn record_tools(
        &self,
        messages: &mut Vec<(ChatMessage, u32)>,
        content: String,
        _calls: &[ModelToolCall],
        results: Vec<ToolResult>,
        counter: &TokenCounter,
    ) {
        let observation = results
            .into_iter()
            .next()
            .map(|r| r.output)
            .unwrap_or_default();
        push(
            messages,
            ChatMessage::Assistant {
                content,
                tool_calls: Vec::new(),
            },
            counter,
        );
        push(
            messages,
            ChatMessage::User(format!("{} {observation}", react::STOP)),
            counter,
        );
    }

    fn record_unreadable(
        &self,
        messages: &mut Vec<(ChatMessage, u32)>,
        content: String,
        counter: &TokenCounter,
    ) {
        push(
            messages,
            ChatMessage::Assistant {
                content,
                tool_calls: Vec::new(),
            },
            counter,
        );
        push(
            messages,
            ChatMessage::User(format!("{} {REACT_FORMAT_REMINDER}", react::STOP)),
            counter,
        );
    }

    fn final_request(&self) -> String {
        format!("{FINAL_REQUEST} Reply with `Final Answer:` followed by the answer.")
    }

    fn answer_beside_calls(&self, _content: String) -> Option<String> {
        // The text of a ReAct reply that acts is its reasoning, not an answer.
        None
    }
}
