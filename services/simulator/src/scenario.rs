//! Scripted scenarios: what the simulated model answers, turn by turn.
//!
//! A request's `model` names a scenario. The turn played is the number of assistant
//! messages already in the request, so that a scenario is deterministic and stateless
//! across concurrent conversations (past the last turn, the last one repeats).
//! The built-in `demo` model answers by rules instead (see [`demo`]): arithmetic with the
//! calculator tool, a query that names another offered tool with that tool.
//!
//! Like real servers, the simulator honours `stop`: the content is cut at the first stop
//! sequence and the turn finishes with `stop`. It honours `max_completion_tokens` (or
//! `max_tokens`) too, at 4 bytes a token: the reasoning, then the content, then the tool
//! calls' arguments are cut where the budget ends (a call reached with nothing left is not
//! made), the turn finishes with `length`, and the usage counts what was sent.
//! `tool_choice: "none"` leaves the turn's tool calls out; `n` other than 1 is refused
//! with a 400.
//!
//! A request with `stream: true` gets an event stream; without it (as in OpenAI's API),
//! one `chat.completion` object built from the same turn. The options that break a
//! stream (`malformed`, `drop_after_chunks`, `endless_line`, `unterminated_last_line`,
//! `linger_ms`, the chunk sizes and delays) do not apply to that object; `omit_finish`
//! leaves its `finish_reason` null, `omit_usage` its usage out.
//!
//! Turns can also misbehave as some servers do, for the tests of the clients that must
//! survive them (every option below is off by default):
//!
//! | option | what the turn does |
//! |---|---|
//! | `omit_finish` | no finish chunk, no usage, no `[DONE]`: the stream just ends |
//! | `finish_reason = "length"` | finishes with that reason (any string) |
//! | `omit_usage` | no usage chunk, even when asked for |
//! | `ignore_stop` | streams the whole content although a stop sequence is in it |
//! | `repeat_content = N` | the content repeated N times (with a large `chunk_chars`, one huge delta) |
//! | `endless_line` | after the first chunk, one SSE line that never ends |
//! | `unterminated_last_line` | the last event is sent without its line end |
//! | `plain_body = "..."` | a 200 whose body is that text, not an event stream (`plain_content_type`, default `application/json`) |
//! | `redirect_to = "http://..."` | a redirect there (`redirect_status`, default 307) |
//!
//! A scenario with `strict_messages = true` (or the simulator's `--strict-messages`)
//! refuses a request with a message whose `content` is `null`, with HTTP 500 and a
//! pydantic validation message, as llama-cpp-python does.
//!
//! `POST /v1/rerank` ranks documents deterministically: a document's relevance is the
//! share of the query's distinct lowercase words (letters and digits) found among its own.
//! The rerank model `fail` answers HTTP 500, and `slow` answers after 30 s.
//!
//! A scenarios file (JSON, or TOML when its name ends in `.toml`), e.g.:
//!
//! ```json
//! {"scenarios": {
//!   "cut":      {"turns": [{"content": "partial", "omit_finish": true}]},
//!   "strict":   {"strict_messages": true, "turns": [{"content": "ok"}]},
//!   "chatty":   {"turns": [{"content": "Action: x\nObservation: made up", "ignore_stop": true}]},
//!   "flood":    {"turns": [{"endless_line": true}]},
//!   "huge":     {"turns": [{"content": "0123456789", "repeat_content": 500000, "chunk_chars": 5000000}]},
//!   "no-usage": {"turns": [{"content": "ok", "omit_usage": true}]},
//!   "capped":   {"turns": [{"content": "cut sho", "finish_reason": "length"}]},
//!   "json":     {"turns": [{"plain_body": "{\"choices\": []}"}]},
//!   "torn":     {"turns": [{"content": "ok", "unterminated_last_line": true}]},
//!   "moved":    {"turns": [{"redirect_to": "http://127.0.0.1:9/v1/chat/completions", "redirect_status": 302}]}
//! }}
//! ```
//!
//! or in TOML:
//!
//! ```toml
//! [scenarios.strict]
//! strict_messages = true
//! turns = [{ content = "ok" }]
//!
//! [scenarios.flood]
//! turns = [{ endless_line = true }]
//!
//! [scenarios.moved]
//! turns = [{ redirect_to = "http://127.0.0.1:9/v1/chat/completions", redirect_status = 302 }]
//! ```

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
    /// Refuse a request holding a message whose `content` is `null` with HTTP 500, as
    /// llama-cpp-python's server does.
    #[serde(default)]
    pub strict_messages: bool,
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
    /// Leave out the usage chunk, also when the request asks for it.
    pub omit_usage: bool,
    /// Stream the whole content although it holds a stop sequence of the request (as
    /// servers that ignore `stop` do); by default the content is cut at the first one.
    pub ignore_stop: bool,
    /// Repeat the content this many times (0 and 1 send it once).
    pub repeat_content: usize,
    /// After the first chunk, send one SSE line that never ends, until the client leaves.
    pub endless_line: bool,
    /// Send the last event without its line end.
    pub unterminated_last_line: bool,
    /// Answer 200 with this body instead of an event stream.
    pub plain_body: Option<String>,
    /// The content type of `plain_body`; `application/json` by default.
    pub plain_content_type: Option<String>,
    /// Answer with a redirect to this URL.
    pub redirect_to: Option<String>,
    /// The status of the redirect; 307 by default.
    pub redirect_status: Option<u16>,
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
            omit_usage: false,
            ignore_stop: false,
            repeat_content: 0,
            endless_line: false,
            unterminated_last_line: false,
            plain_body: None,
            plain_content_type: None,
            redirect_to: None,
            redirect_status: None,
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
    /// Fail only the first `times` attempts of this turn of a conversation (requests for
    /// this model with the same messages), then play the turn; 0 fails every attempt.
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
    /// `true` asks for an event stream; otherwise (`false` or absent, as in OpenAI's API)
    /// one `chat.completion` object answers.
    #[serde(default)]
    pub stream: Option<bool>,
    /// The most tokens the answer may take (the older name of `max_completion_tokens`).
    #[serde(default)]
    pub max_tokens: Option<u64>,
    /// The most tokens the answer may take; read before `max_tokens`.
    #[serde(default)]
    pub max_completion_tokens: Option<u64>,
    /// `"none"` forbids tool calls: the turn's content alone answers.
    #[serde(default)]
    pub tool_choice: Option<Value>,
    /// How many choices to answer; only 1 is supported.
    #[serde(default)]
    pub n: Option<u64>,
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
    /// A function's parameters (a JSON Schema), when given; read only by the `demo` model.
    #[serde(default, borrow)]
    pub parameters: Option<&'a RawValue>,
}

/// One message, as far as the scenarios look.
#[derive(Deserialize)]
struct MessageIn<'a> {
    #[serde(default, borrow)]
    role: Cow<'a, str>,
    /// The content, text or not.
    #[serde(default, borrow)]
    content: ContentIn<'a>,
}

/// A message's content: text, `null`, or anything else (a list of parts); absent is
/// [`ContentIn::Other`] too.
#[derive(Default)]
enum ContentIn<'a> {
    Text(Cow<'a, str>),
    Null,
    #[default]
    Other,
}

impl<'a> ContentIn<'a> {
    fn text(&self) -> Option<&str> {
        match self {
            Self::Text(text) => Some(text),
            Self::Null | Self::Other => None,
        }
    }
}

impl<'de: 'a, 'a> Deserialize<'de> for ContentIn<'a> {
    fn deserialize<D: serde::Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        use serde::de::{IgnoredAny, MapAccess, SeqAccess, Visitor};
        struct Text<'a>(std::marker::PhantomData<&'a ()>);
        impl<'de: 'a, 'a> Visitor<'de> for Text<'a> {
            type Value = ContentIn<'a>;
            fn expecting(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
                f.write_str("message content")
            }
            fn visit_borrowed_str<E>(self, v: &'de str) -> Result<Self::Value, E> {
                Ok(ContentIn::Text(Cow::Borrowed(v)))
            }
            fn visit_str<E>(self, v: &str) -> Result<Self::Value, E> {
                Ok(ContentIn::Text(Cow::Owned(v.to_owned())))
            }
            fn visit_unit<E>(self) -> Result<Self::Value, E> {
                Ok(ContentIn::Null)
            }
            fn visit_none<E>(self) -> Result<Self::Value, E> {
                Ok(ContentIn::Null)
            }
            fn visit_bool<E>(self, _: bool) -> Result<Self::Value, E> {
                Ok(ContentIn::Other)
            }
            fn visit_i64<E>(self, _: i64) -> Result<Self::Value, E> {
                Ok(ContentIn::Other)
            }
            fn visit_u64<E>(self, _: u64) -> Result<Self::Value, E> {
                Ok(ContentIn::Other)
            }
            fn visit_f64<E>(self, _: f64) -> Result<Self::Value, E> {
                Ok(ContentIn::Other)
            }
            fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<Self::Value, A::Error> {
                while seq.next_element::<IgnoredAny>()?.is_some() {}
                Ok(ContentIn::Other)
            }
            fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<Self::Value, A::Error> {
                while map.next_entry::<IgnoredAny, IgnoredAny>()?.is_some() {}
                Ok(ContentIn::Other)
            }
        }
        deserializer.deserialize_any(Text(std::marker::PhantomData))
    }
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
    /// Names of the tools offered; with the ReAct text protocol, those the system prompt
    /// lists (`Action: the tool to use, one of [a, b]`).
    pub tools: Vec<String>,
    /// The parameters of the tools offered that have them (JSON Schema text), by name;
    /// read for the [`DEMO`] model only.
    pub parameters: HashMap<String, String>,
    /// Whether the request uses the ReAct text protocol (no tools offered, and the
    /// system prompt describes `Action Input:`).
    pub react: bool,
    /// The last `Observation:` the ReAct conversation carries, if any.
    pub observation: Option<String>,
    /// The role of the first message whose `content` is `null`, if any (a strict server
    /// refuses it).
    pub null_content: Option<String>,
}

impl Conversation {
    /// Reads the parts of a chat completions request the scenarios use.
    pub fn of(request: &ChatRequestIn<'_>) -> Result<Self, serde_json::Error> {
        let messages: Vec<MessageIn<'_>> = serde_json::from_str(request.messages.get())?;
        fn role<'m>(message: &'m MessageIn<'_>) -> &'m str {
            &message.role
        }
        let text = |m: &MessageIn<'_>| m.content.text().unwrap_or_default().to_owned();
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
        // Only the `demo` model reads them: a scripted one is not made to copy every
        // tool's schema (the benchmarks send one with each request).
        let parameters = if request.model == DEMO {
            request
                .tools
                .iter()
                .filter_map(|t| {
                    let function = t.function.as_ref()?;
                    let parameters = function.parameters?.get().to_owned();
                    Some((function.name.as_deref()?.to_owned(), parameters))
                })
                .collect()
        } else {
            HashMap::new()
        };
        let system = messages
            .iter()
            .find(|m| role(m) == "system")
            .map(text)
            .unwrap_or_default();
        let react = tools.is_empty() && system.contains("Action Input:");
        let tools = if react { react_tools(&system) } else { tools };
        let observation = react
            .then(|| {
                query
                    .strip_prefix("Observation:")
                    .map(|o| o.trim().to_owned())
            })
            .flatten();
        let null_content = messages
            .iter()
            .find(|m| matches!(m.content, ContentIn::Null))
            .map(|m| role(m).to_owned());
        Ok(Self {
            turn,
            query,
            tool_results,
            user_messages,
            tools,
            parameters,
            react,
            observation,
            null_content,
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
            content: fill(&turn.content, conversation),
            ..turn
        }
    }
}

/// `template` with its placeholders replaced, in one pass: text put in (a tool result
/// that reads `{query}`) is not read as a placeholder again.
fn fill(template: &str, conversation: &Conversation) -> String {
    let mut out = String::with_capacity(template.len());
    let mut rest = template;
    while let Some(at) = rest.find('{') {
        out.push_str(&rest[..at]);
        rest = &rest[at..];
        let value = [
            ("{tool_results}", conversation.tool_results.join(", ")),
            ("{query}", conversation.query.clone()),
            ("{user_messages}", conversation.user_messages.to_string()),
        ]
        .into_iter()
        .find(|(name, _)| rest.starts_with(name));
        match value {
            Some((name, value)) => {
                out.push_str(&value);
                rest = &rest[name.len()..];
            }
            None => {
                out.push('{');
                rest = &rest[1..];
            }
        }
    }
    out.push_str(rest);
    out
}

/// The built-in `demo` model, deterministic:
///
/// - arithmetic in the query, with the calculator offered: calls `calculator` with
///   `{"expression": <the arithmetic>}`;
/// - else, when the query names an offered tool other than the calculator (its name as a
///   whole word, in any case; the first such tool in the order offered): calls that tool
///   with `{"query": <the query>}`, or with what its parameters ask for (see
///   [`demo_arguments`]), so that a client tool or one needing approval can be shown with
///   any tool;
/// - else answers `You said: <the query>`;
/// - once the request carries tool results, answers `The answer is <the results, joined by
///   ", ">.`
///
/// It makes at most one call a round, whose id is then `call_sim_0`. With the ReAct text
/// protocol it follows the same rules in ReAct's format (the calculator need not be
/// offered there), and answers with the last `Observation:`.
pub fn demo(conversation: &Conversation) -> Turn {
    if conversation.react {
        return demo_react(conversation);
    }
    let call = demo_call(conversation);
    if !conversation.tool_results.is_empty() {
        let results = conversation.tool_results.join(", ");
        let tool = match &call {
            Some(call) if call.name != "calculator" => format!("The {} tool", call.name),
            _ => "The calculator".to_owned(),
        };
        return Turn {
            reasoning: format!("{tool} returned {results}."),
            content: format!("The answer is {results}."),
            ..Turn::default()
        };
    }
    match call {
        Some(call) => Turn {
            reasoning: match call.name.as_str() {
                "calculator" => format!(
                    "I should compute {} with the calculator.",
                    call.arguments["expression"].as_str().unwrap_or_default()
                ),
                name => format!("I should ask the {name} tool."),
            },
            tool_calls: vec![call],
            ..Turn::default()
        },
        None => Turn {
            content: format!("You said: {}", conversation.query),
            ..Turn::default()
        },
    }
}

/// The name of the built-in model [`demo`] plays.
pub const DEMO: &str = "demo";

/// The call the `demo` model makes for the query, if any (see [`demo`]).
fn demo_call(conversation: &Conversation) -> Option<ScriptedCall> {
    let calculator = conversation.tools.iter().any(|t| t == "calculator");
    if let Some(expression) = arithmetic_in(&conversation.query).filter(|_| calculator) {
        return Some(ScriptedCall {
            name: "calculator".into(),
            arguments: serde_json::json!({ "expression": expression }),
            ..ScriptedCall::default()
        });
    }
    named_tool(&conversation.query, &conversation.tools).map(|name| ScriptedCall {
        name: name.to_owned(),
        arguments: demo_arguments(
            conversation
                .parameters
                .get(name)
                .and_then(|p| serde_json::from_str(p).ok())
                .as_ref(),
            &conversation.query,
        ),
        ..ScriptedCall::default()
    })
}

/// The arguments the `demo` model gives a tool the query names: `{"query": <the query>}`,
/// unless its parameters have properties and `query` is not one of them; then each of its
/// required properties (or, none being required, its first property) is: when a string,
/// the query's first word holding a digit (`A-17` in "Where is order A-17?"), or the
/// whole query when none does; when a number or an integer, the query's first word that
/// is one (`10` in "Sleep for 10 seconds"), left out when none is. With no property set,
/// `{"query": <the query>}`.
fn demo_arguments(parameters: Option<&Value>, query: &str) -> Value {
    let whole = || serde_json::json!({ "query": query });
    let Some(properties) = parameters
        .and_then(|p| p.get("properties"))
        .and_then(Value::as_object)
        .filter(|p| !p.is_empty() && !p.contains_key("query"))
    else {
        return whole();
    };
    let required: Vec<&str> = parameters
        .and_then(|p| p.get("required"))
        .and_then(Value::as_array)
        .map(|r| r.iter().filter_map(Value::as_str).collect())
        .unwrap_or_default();
    let names: Vec<&str> = if required.is_empty() {
        properties.keys().take(1).map(String::as_str).collect()
    } else {
        required
    };
    let words = || {
        query
            .split_whitespace()
            .map(|word| word.trim_matches(|c: char| !c.is_alphanumeric() && c != '.' && c != '-'))
    };
    let value = words()
        .map(|word| word.trim_matches(|c: char| !c.is_alphanumeric()))
        .find(|word| word.chars().any(|c| c.is_ascii_digit()))
        .unwrap_or(query);
    let integer = words().find_map(|word| word.parse::<i64>().ok());
    let number = words().find_map(|word| {
        word.parse::<f64>()
            .ok()
            .and_then(serde_json::Number::from_f64)
    });
    let arguments: serde_json::Map<String, Value> = names
        .into_iter()
        .filter_map(|name| {
            let given = match properties.get(name)?.get("type") {
                None => Value::from(value),
                Some(Value::String(kind)) if kind == "string" => Value::from(value),
                Some(Value::String(kind)) if kind == "integer" => Value::from(integer?),
                Some(Value::String(kind)) if kind == "number" => Value::Number(number.clone()?),
                Some(_) => return None,
            };
            Some((name.to_owned(), given))
        })
        .collect();
    if arguments.is_empty() {
        whole()
    } else {
        Value::Object(arguments)
    }
}

fn demo_react(conversation: &Conversation) -> Turn {
    let action = |thought: &str, tool: &str, input: Value| {
        format!(
            "Thought: {thought}\nAction: {tool}\nAction Input: {input}\n\
             Observation: (the model would go on imagining here)"
        )
    };
    let content = match (
        &conversation.observation,
        arithmetic_in(&conversation.query),
        named_tool(&conversation.query, &conversation.tools),
    ) {
        (Some(observation), _, _) => {
            format!("Thought: I have the result.\nFinal Answer: The answer is {observation}.")
        }
        (None, Some(expression), _) => action(
            &format!("I should compute {expression} with the calculator."),
            "calculator",
            serde_json::json!({ "expression": expression }),
        ),
        (None, None, Some(tool)) => action(
            &format!("I should ask the {tool} tool."),
            tool,
            serde_json::json!({ "query": conversation.query }),
        ),
        (None, None, None) => format!(
            "Thought: No tool is needed.\nFinal Answer: You said: {}",
            conversation.query
        ),
    };
    Turn {
        content,
        ..Turn::default()
    }
}

/// The first of `tools`, other than the calculator, whose name `query` holds as a whole
/// word (not inside a longer name of letters, digits and `_`), in any case.
fn named_tool<'t>(query: &str, tools: &'t [String]) -> Option<&'t str> {
    let query = query.to_lowercase();
    let word = |c: Option<char>| c.is_some_and(|c| c.is_alphanumeric() || c == '_');
    tools
        .iter()
        .filter(|name| !name.is_empty() && name.as_str() != "calculator")
        .find(|name| {
            let name = name.to_lowercase();
            query.match_indices(&name).any(|(at, _)| {
                !word(query[..at].chars().next_back())
                    && !word(query[at + name.len()..].chars().next())
            })
        })
        .map(String::as_str)
}

/// The tool names a ReAct system prompt lists: `Action: the tool to use, one of [a, b]`.
fn react_tools(system: &str) -> Vec<String> {
    system
        .lines()
        .filter(|line| line.starts_with("Action:"))
        .filter_map(|line| line.split_once("one of [")?.1.split_once(']'))
        .flat_map(|(names, _)| names.split(','))
        .map(str::trim)
        .filter(|name| !name.is_empty())
        .map(str::to_owned)
        .collect()
}

/// The longest run of arithmetic characters with a digit and an operator in it.
fn arithmetic_in(text: &str) -> Option<String> {
    text.split(|c: char| !(c.is_ascii_digit() || " +-*/^%().".contains(c)))
        .map(str::trim)
        .filter(|run| binary_operator_in(run))
        .max_by_key(|run| run.len())
        .map(|run| run.trim_end_matches(['.', ' ']).to_owned())
}

/// Whether `run` applies an operator to a number or a bracket before it (`6 * 7`, not the
/// sign of `-17`, as in an order id `A-17`).
fn binary_operator_in(run: &str) -> bool {
    let mut before = None;
    for c in run.chars().filter(|c| !c.is_whitespace()) {
        if "+-*/^%".contains(c) && before.is_some_and(|b: char| b.is_ascii_digit() || b == ')') {
            return true;
        }
        before = Some(c);
    }
    false
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
        assert_eq!(arithmetic_in("Where is order A-17?"), None);
        assert_eq!(arithmetic_in("What is -3 + 4?"), Some("-3 + 4".into()));
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
            ..Scenario::default()
        };
        assert_eq!(scenario.turn(&conversation).content, "got 1, 2 for q");
    }

    #[test]
    fn placeholders_in_what_is_put_in_are_left_as_they_are() {
        let request = json!({"messages": [
            {"role": "user", "content": "17 * 3"},
            {"role": "assistant", "tool_calls": [{"id": "a", "type": "function",
                "function": {"name": "calculator", "arguments": "{}"}}]},
            {"role": "tool", "tool_call_id": "a", "content": "cannot evaluate \"{query}\""},
        ]});
        let scenario = Scenario {
            turns: vec![
                Turn::default(),
                Turn {
                    content: "R={tool_results} Q={query} {other}".into(),
                    ..Turn::default()
                },
            ],
            ..Scenario::default()
        };
        assert_eq!(
            scenario.turn(&conversation(&request)).content,
            "R=cannot evaluate \"{query}\" Q=17 * 3 {other}"
        );
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

    #[test]
    fn the_demo_calls_a_tool_the_query_names_with_the_query() {
        let tools = json!([
            {"type": "function", "function": {"name": "calculator"}},
            {"type": "function", "function": {"name": "weather"}},
            {"type": "function", "function": {"name": "weather_alerts"}}]);
        let ask = |query: &str| {
            demo(&conversation(
                &json!({"messages": [{"role": "user", "content": query}], "tools": tools}),
            ))
        };
        let first = ask("What is the Weather in Paris?");
        assert_eq!(first.tool_calls.len(), 1);
        assert_eq!(first.tool_calls[0].name, "weather");
        assert_eq!(
            first.tool_calls[0].arguments,
            json!({"query": "What is the Weather in Paris?"})
        );
        assert!(
            first.tool_calls[0].id.is_empty(),
            "the simulator numbers it"
        );
        assert_eq!(
            ask("Any weather_alerts?").tool_calls[0].name,
            "weather_alerts"
        );
        // Arithmetic still goes to the calculator; a name inside a word, the calculator's
        // name without arithmetic, or a tool not offered call nothing.
        assert_eq!(ask("weather: 6 * 7?").tool_calls[0].name, "calculator");
        for query in ["Is it weathery?", "Use the calculator", "Ask the oracle"] {
            let turn = ask(query);
            assert!(turn.tool_calls.is_empty(), "{query}");
            assert_eq!(turn.content, format!("You said: {query}"));
        }

        let answered = json!({"messages": [
            {"role": "user", "content": "What is the weather in Paris?"},
            {"role": "assistant", "content": null},
            {"role": "tool", "tool_call_id": "call_sim_0", "content": "Sunny, 21 °C"}],
            "tools": tools});
        let last = demo(&conversation(&answered));
        assert!(last.tool_calls.is_empty());
        assert_eq!(last.reasoning, "The weather tool returned Sunny, 21 °C.");
        assert_eq!(last.content, "The answer is Sunny, 21 °C.");
    }

    #[test]
    fn the_demo_gives_a_tool_the_arguments_its_parameters_ask_for() {
        let tools = json!([
            {"type": "function", "function": {"name": "lookup_order", "parameters": {
                "type": "object",
                "properties": {"order_id": {"type": "string"}, "note": {"type": "string"}},
                "required": ["order_id"], "additionalProperties": false}}},
            {"type": "function", "function": {"name": "search", "parameters": {
                "type": "object", "properties": {"query": {"type": "string"}}}}},
            {"type": "function", "function": {"name": "count", "parameters": {
                "type": "object", "properties": {"n": {"type": "integer"}},
                "required": ["n"]}}}]);
        let ask = |query: &str| {
            demo(&conversation(&json!({"model": "demo",
                "messages": [{"role": "user", "content": query}], "tools": tools})))
            .tool_calls[0]
                .arguments
                .clone()
        };
        assert_eq!(
            ask("Where is order A-17? Use lookup_order."),
            json!({"order_id": "A-17"})
        );
        assert_eq!(
            ask("lookup_order, please"),
            json!({"order_id": "lookup_order, please"})
        );
        assert_eq!(ask("search for 42"), json!({"query": "search for 42"}));
        // Numbers from the query's first word that is one.
        assert_eq!(ask("count 3"), json!({"n": 3}));
        assert_eq!(ask("count to 2.5, then 3"), json!({"n": 3}));
        // What it cannot fill, it leaves to the tool to refuse.
        assert_eq!(ask("count them"), json!({"query": "count them"}));
    }

    #[test]
    fn the_demo_names_tools_in_react_too() {
        let system = "Answer the user's question. You can use these tools:\n\n\
                      Use exactly this format:\n\n\
                      Action: the tool to use, one of [calculator, weather]\n\
                      Action Input: the tool's input as a JSON object\n";
        let ask = |messages: Value| demo(&conversation(&json!({"messages": messages})));
        let first = ask(json!([
            {"role": "system", "content": system},
            {"role": "user", "content": "What is the weather in Paris?"}]));
        assert!(
            first.content.starts_with(
                "Thought: I should ask the weather tool.\nAction: weather\n\
                 Action Input: {\"query\":\"What is the weather in Paris?\"}\n"
            ),
            "{}",
            first.content
        );
        let arithmetic = ask(json!([
            {"role": "system", "content": system},
            {"role": "user", "content": "weather: 6 * 7?"}]));
        assert!(arithmetic.content.contains("Action: calculator\n"));
        let last = ask(json!([
            {"role": "system", "content": system},
            {"role": "user", "content": "What is the weather in Paris?"},
            {"role": "assistant", "content": "Thought: ...\nAction: weather\nAction Input: {}"},
            {"role": "user", "content": "Observation: Sunny"}]));
        assert_eq!(
            last.content,
            "Thought: I have the result.\nFinal Answer: The answer is Sunny."
        );
    }
}
