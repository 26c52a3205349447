//! Scripted scenarios: what the simulated model answers, turn by turn.
//!
//! A request's `model` names a scenario. The turn played is the number of assistant
//! messages already in the request, so that a scenario is deterministic and stateless
//! across concurrent conversations (past the last turn, the last one repeats).
//! The built-in `demo` model answers arithmetic with the calculator tool instead.

use std::{borrow::Cow, collections::HashMap};

use serde::Deserialize;
use serde_json::{Value, value::RawValue};

/// Scenarios by model name, as a scenarios file writes them.
#[derive(Debug, Clone, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Scenarios {
    /// The scenarios.
    #[serde(default)]
    pub scenarios: HashMap<String, Scenario>,
}

/// One scripted conversation.
#[derive(Debug, Clone, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Scenario {
    /// The model's turns, in order.
    pub turns: Vec<Turn>,
}

/// One model turn and how it is streamed.
#[derive(Debug, Clone, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct Turn {
    /// Reasoning text, streamed as `reasoning_content` (or inside `<think>` tags).
    pub reasoning: String,
    /// Put the reasoning inside `<think>...</think>` in the content instead.
    pub think_tags: bool,
    /// Answer text. `{tool_results}` is replaced by the tool results of the request's
    /// last round, joined by `, `; `{query}` by the last user message; `{user_messages}`
    /// by the number of user messages the request carries.
    pub content: String,
    /// Tool calls, streamed with their arguments in fragments, interleaved by index.
    pub tool_calls: Vec<ScriptedCall>,
    /// The finish reason sent; by default `tool_calls` when there are calls, else `stop`.
    pub finish_reason: Option<String>,
    /// Answer with an HTTP error instead.
    pub error: Option<ScriptedError>,
    /// Wait before answering, in milliseconds (added to the server's `--latency`).
    pub latency_ms: u64,
    /// Characters per content or argument fragment.
    pub chunk_chars: usize,
    /// Wait between chunks, in milliseconds.
    pub chunk_delay_ms: u64,
    /// Send a line of invalid JSON after the first chunk.
    pub malformed: bool,
    /// Cut the connection after this many chunks.
    pub drop_after_chunks: Option<usize>,
    /// Leave out the chunk carrying `finish_reason`, and `[DONE]`.
    pub omit_finish: bool,
    /// Keep the response open this long after the last chunk, in milliseconds, before
    /// ending it (as proxies that flush late do).
    pub linger_ms: u64,
}

impl Default for Turn {
    fn default() -> Self {
        Self {
            reasoning: String::new(),
            think_tags: false,
            content: String::new(),
            tool_calls: Vec::new(),
            finish_reason: None,
            error: None,
            latency_ms: 0,
            chunk_chars: 8,
            chunk_delay_ms: 0,
            malformed: false,
            drop_after_chunks: None,
            omit_finish: false,
            linger_ms: 0,
        }
    }
}

/// A scripted tool call.
#[derive(Debug, Clone, Default, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct ScriptedCall {
    /// The call's id; generated when empty.
    pub id: String,
    /// The tool.
    pub name: String,
    /// The arguments, sent as their JSON text.
    pub arguments: Value,
    /// Raw argument text sent instead of `arguments` (e.g. truncated JSON).
    pub raw_arguments: Option<String>,
}

/// A scripted HTTP failure.
#[derive(Debug, Clone, Default, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct ScriptedError {
    /// The HTTP status, e.g. 429 or 503.
    pub status: u16,
    /// The message in the JSON error body.
    pub message: String,
    /// Fail only the first `times` attempts of this turn of a conversation, then play the
    /// turn; 0 fails every attempt.
    pub times: u32,
    /// `Retry-After` header, in seconds.
    pub retry_after: Option<f64>,
}

/// The parts of a chat completions request the simulator reads, borrowed from its body:
/// the tools' schemas and everything else are skipped, not built into a JSON tree.
#[derive(Deserialize)]
pub struct ChatRequestIn<'a> {
    /// The scenario to play.
    #[serde(default, borrow)]
    pub model: Cow<'a, str>,
    /// The conversation, as sent.
    #[serde(borrow)]
    pub messages: &'a RawValue,
    /// The tools offered.
    #[serde(default, borrow)]
    pub tools: Vec<ToolIn<'a>>,
    /// Stop sequences: a string or a list of them.
    #[serde(default)]
    pub stop: Option<Value>,
    /// `{"include_usage": true}` asks for a last chunk with usage.
    #[serde(default)]
    pub stream_options: Option<Value>,
}

/// A tool offered.
#[derive(Deserialize)]
pub struct ToolIn<'a> {
    /// The function, named.
    #[serde(default, borrow)]
    pub function: Option<NamedIn<'a>>,
}

/// Something with a name.
#[derive(Deserialize)]
pub struct NamedIn<'a> {
    /// The name.
    #[serde(default, borrow)]
    pub name: Option<Cow<'a, str>>,
}

/// One message, as far as the scenarios look.
#[derive(Deserialize)]
struct MessageIn<'a> {
    #[serde(default, borrow)]
    role: Cow<'a, str>,
    /// Text content; anything else (null, a list of parts) counts as none.
    #[serde(default, borrow, deserialize_with = "text_or_none")]
    content: Option<Cow<'a, str>>,
}

fn text_or_none<'de, D: serde::Deserializer<'de>>(
    deserializer: D,
) -> Result<Option<Cow<'de, str>>, D::Error> {
    use serde::de::{IgnoredAny, MapAccess, SeqAccess, Visitor};
    struct Text;
    impl<'de> Visitor<'de> for Text {
        type Value = Option<Cow<'de, str>>;
        fn expecting(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
            f.write_str("message content")
        }
        fn visit_borrowed_str<E>(self, v: &'de str) -> Result<Self::Value, E> {
            Ok(Some(Cow::Borrowed(v)))
        }
        fn visit_str<E>(self, v: &str) -> Result<Self::Value, E> {
            Ok(Some(Cow::Owned(v.to_owned())))
        }
        fn visit_unit<E>(self) -> Result<Self::Value, E> {
            Ok(None)
        }
        fn visit_bool<E>(self, _: bool) -> Result<Self::Value, E> {
            Ok(None)
        }
        fn visit_i64<E>(self, _: i64) -> Result<Self::Value, E> {
            Ok(None)
        }
        fn visit_u64<E>(self, _: u64) -> Result<Self::Value, E> {
            Ok(None)
        }
        fn visit_f64<E>(self, _: f64) -> Result<Self::Value, E> {
            Ok(None)
        }
        fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<Self::Value, A::Error> {
            while seq.next_element::<IgnoredAny>()?.is_some() {}
            Ok(None)
        }
        fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<Self::Value, A::Error> {
            while map.next_entry::<IgnoredAny, IgnoredAny>()?.is_some() {}
            Ok(None)
        }
    }
    deserializer.deserialize_any(Text)
}

impl<'a> ChatRequestIn<'a> {
    /// Reads a request body.
    pub fn parse(body: &'a str) -> Result<Self, serde_json::Error> {
        serde_json::from_str(body)
    }
}

/// What the simulator knows of a request.
#[derive(Debug, Clone, Default)]
pub struct Conversation {
    /// Assistant messages so far: the turn to play.
    pub turn: usize,
    /// The last user message.
    pub query: String,
    /// The tool results after the last assistant message.
    pub tool_results: Vec<String>,
    /// How many user messages the request carries (history included).
    pub user_messages: usize,
    /// Names of the tools offered.
    pub tools: Vec<String>,
    /// Whether the request uses the ReAct text protocol (no tools offered, and the
    /// system prompt describes `Action Input:`).
    pub react: bool,
    /// The last `Observation:` the ReAct conversation carries, if any.
    pub observation: Option<String>,
}

impl Conversation {
    /// Reads the parts of a chat completions request the scenarios use.
    pub fn of(request: &ChatRequestIn<'_>) -> Result<Self, serde_json::Error> {
        let messages: Vec<MessageIn<'_>> = serde_json::from_str(request.messages.get())?;
        fn role<'m>(message: &'m MessageIn<'_>) -> &'m str {
            &message.role
        }
        let text = |m: &MessageIn<'_>| m.content.as_deref().unwrap_or_default().to_owned();
        let turn = messages.iter().filter(|m| role(m) == "assistant").count();
        let user_messages = messages.iter().filter(|m| role(m) == "user").count();
        let query = messages
            .iter()
            .rev()
            .find(|m| role(m) == "user")
            .map(text)
            .unwrap_or_default();
        let tool_results = messages
            .iter()
            .rev()
            .take_while(|m| role(m) != "assistant")
            .filter(|m| role(m) == "tool")
            .map(text)
            .collect::<Vec<_>>()
            .into_iter()
            .rev()
            .collect();
        let tools: Vec<String> = request
            .tools
            .iter()
            .filter_map(|t| t.function.as_ref()?.name.as_deref().map(str::to_owned))
            .collect();
        let system = messages
            .iter()
            .find(|m| role(m) == "system")
            .map(text)
            .unwrap_or_default();
        let react = tools.is_empty() && system.contains("Action Input:");
        let observation = react
            .then(|| {
                query
                    .strip_prefix("Observation:")
                    .map(|o| o.trim().to_owned())
            })
            .flatten();
        Ok(Self {
            turn,
            query,
            tool_results,
            user_messages,
            tools,
            react,
            observation,
        })
    }
}

impl Scenario {
    /// The turn to play for `conversation`.
    pub fn turn(&self, conversation: &Conversation) -> Turn {
        let turn = self
            .turns
            .get(conversation.turn)
            .or(self.turns.last())
            .cloned()
            .unwrap_or_default();
        Turn {
            content: turn
                .content
                .replace("{tool_results}", &conversation.tool_results.join(", "))
                .replace("{query}", &conversation.query)
                .replace("{user_messages}", &conversation.user_messages.to_string()),
            ..turn
        }
    }
}

/// The built-in `demo` model: uses the calculator for arithmetic in the query, then
/// answers with its result; answers other queries directly.
pub fn demo(conversation: &Conversation) -> Turn {
    if conversation.react {
        return demo_react(conversation);
    }
    if !conversation.tool_results.is_empty() {
        let results = conversation.tool_results.join(", ");
        return Turn {
            reasoning: format!("The calculator returned {results}."),
            content: format!("The answer is {results}."),
            ..Turn::default()
        };
    }
    match arithmetic_in(&conversation.query)
        .filter(|_| conversation.tools.iter().any(|t| t == "calculator"))
    {
        Some(expression) => Turn {
            reasoning: format!("I should compute {expression} with the calculator."),
            tool_calls: vec![ScriptedCall {
                name: "calculator".into(),
                arguments: serde_json::json!({ "expression": expression }),
                ..ScriptedCall::default()
            }],
            ..Turn::default()
        },
        None => Turn {
            content: format!("You said: {}", conversation.query),
            ..Turn::default()
        },
    }
}

fn demo_react(conversation: &Conversation) -> Turn {
    let content = match (
        &conversation.observation,
        arithmetic_in(&conversation.query),
    ) {
        (Some(observation), _) => {
            format!("Thought: I have the result.\nFinal Answer: The answer is {observation}.")
        }
        (None, Some(expression)) => format!(
            "Thought: I should compute {expression} with the calculator.\nAction: calculator\n\
             Action Input: {}\nObservation: (the model would go on imagining here)",
            serde_json::json!({ "expression": expression })
        ),
        (None, None) => format!(
            "Thought: No tool is needed.\nFinal Answer: You said: {}",
            conversation.query
        ),
    };
    Turn {
        content,
        ..Turn::default()
    }
}

/// The longest run of arithmetic characters with a digit and an operator in it.
fn arithmetic_in(text: &str) -> Option<String> {
    text.split(|c: char| !(c.is_ascii_digit() || " +-*/^%().".contains(c)))
        .map(str::trim)
        .filter(|run| {
            run.chars().any(|c| c.is_ascii_digit()) && run.chars().any(|c| "+-*/^%".contains(c))
        })
        .max_by_key(|run| run.len())
        .map(|run| run.trim_end_matches(['.', ' ']).to_owned())
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn arithmetic_is_found_in_questions() {
        assert_eq!(
            arithmetic_in("What is (2 + 3) * 4?").as_deref(),
            Some("(2 + 3) * 4")
        );
        assert_eq!(arithmetic_in("compute 2^10."), Some("2^10".into()));
        assert_eq!(arithmetic_in("hello there"), None);
        assert_eq!(arithmetic_in("in 2026"), None);
    }

    fn conversation(request: &Value) -> Conversation {
        let text = request.to_string();
        Conversation::of(&ChatRequestIn::parse(&text).unwrap()).unwrap()
    }

    #[test]
    fn the_turn_is_the_number_of_assistant_messages() {
        let request = json!({"messages": [
            {"role": "user", "content": "q"},
            {"role": "assistant", "content": null, "tool_calls": []},
            {"role": "tool", "tool_call_id": "a", "content": "1"},
            {"role": "tool", "tool_call_id": "b", "content": "2"},
        ], "tools": [{"type": "function", "function": {"name": "calculator"}}]});
        let conversation = conversation(&request);
        assert_eq!(conversation.turn, 1);
        assert_eq!(conversation.tool_results, ["1", "2"]);
        let scenario = Scenario {
            turns: vec![
                Turn::default(),
                Turn {
                    content: "got {tool_results} for {query}".into(),
                    ..Turn::default()
                },
            ],
        };
        assert_eq!(scenario.turn(&conversation).content, "got 1, 2 for q");
    }

    #[test]
    fn the_demo_calls_the_calculator_then_answers() {
        let ask = json!({"messages": [{"role": "user", "content": "What is 6 * 7?"}],
                          "tools": [{"type": "function", "function": {"name": "calculator"}}]});
        let first = demo(&conversation(&ask));
        assert_eq!(
            first.tool_calls[0].arguments,
            json!({"expression": "6 * 7"})
        );
        let answered = json!({"messages": [
            {"role": "user", "content": "What is 6 * 7?"},
            {"role": "assistant", "content": null},
            {"role": "tool", "tool_call_id": "a", "content": "42"}]});
        assert_eq!(demo(&conversation(&answered)).content, "The answer is 42.");
    }
}
