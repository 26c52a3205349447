//! The context manager: keeps each session's turns and fits the prompt to the token
//! budget of the agent's config.
//!
//! History is kept as [`Exchange`]s: one user turn with everything it led to (the
//! assistant's tool calls, the tool results, the final answer). Fitting drops whole
//! exchanges, oldest first, so that a tool call is never separated from its result and
//! the model never sees an answer without its question.

mod store;
mod tokens;

use std::sync::Arc;

use agentrt_models::ChatMessage;

pub use store::{InMemorySessionStore, SessionLimits, SessionStore};
pub use tokens::TokenCounter;

/// One user turn and what it led to, with its token count measured once.
#[derive(Debug, Clone, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct Exchange {
    /// The messages, starting with the user's.
    pub messages: Vec<ChatMessage>,
    /// Their tokens.
    pub tokens: u32,
    /// When the session kept it, in milliseconds since the Unix epoch (0: not said). A
    /// run that goes on after a wait, or on another replica, sees the history as it was
    /// when the run started, without the turns kept since.
    #[serde(default, skip_serializing_if = "is_zero")]
    pub kept_ms: u64,
}

fn is_zero(n: &u64) -> bool {
    *n == 0
}

impl Exchange {
    /// An exchange of `messages`, counted with `counter`.
    pub fn new(messages: Vec<ChatMessage>, counter: &TokenCounter) -> Self {
        let tokens = messages.iter().map(|m| counter.message(m)).sum();
        Self {
            messages,
            tokens,
            kept_ms: 0,
        }
    }

    /// Whether the exchange was in the history at `started_ms`.
    pub fn kept_by(&self, started_ms: u64) -> bool {
        self.kept_ms <= started_ms
    }

    /// Groups explicit messages (a client's `llm_context`) into exchanges: each starts at
    /// a user message; messages before the first user message form their own.
    pub fn group(messages: Vec<ChatMessage>, counter: &TokenCounter) -> Vec<Arc<Self>> {
        let mut groups: Vec<Vec<ChatMessage>> = Vec::new();
        for message in messages {
            let starts = matches!(message, ChatMessage::User(_)) || groups.is_empty();
            if starts {
                groups.push(Vec::new());
            }
            if let Some(group) = groups.last_mut() {
                group.push(message);
            }
        }
        groups
            .into_iter()
            .map(|g| Arc::new(Self::new(g, counter)))
            .collect()
    }
}

/// A prompt fitted to a budget.
#[derive(Debug, Clone, PartialEq)]
pub struct Fitted {
    /// The messages to send.
    pub messages: Vec<ChatMessage>,
    /// Their tokens, plus the reserved ones.
    pub tokens: u32,
    /// Exchanges of history left out to fit.
    pub dropped: usize,
    /// Exchanges of history sent without their tool calls and results, to fit.
    pub compacted: usize,
    /// Tool results of the current turn sent shortened (or left out), to fit.
    pub shortened: usize,
}

/// Tokens a shortened tool result's note costs, about.
const NOTE_TOKENS: u32 = 24;

/// Builds the prompt of one model round within `budget` tokens:
///
/// - `pinned` (the system prompt, and a client's leading system messages) is always sent;
///   `reserved` counts what else the request carries (tool schemas).
/// - The current turn keeps every message, but when it does not fit, its tool results
///   (`Tool` messages, and a ReAct turn's observations: its user messages after the
///   query) are shortened, oldest first, each cut at its end as much as the budget needs
///   and marked so the model knows. A call always keeps its result, which providers
///   require. The query, the model's text and its calls' arguments are never cut: when
///   even that does not fit (a huge query, many rounds of calls with long arguments), the
///   prompt is sent anyway and the provider decides.
/// - History goes in newest first, as much as the room left holds: an exchange that does
///   not fit whole goes in as its question and final answer only, without its tool
///   traffic; one that does not fit even so stops the history there, so that what the
///   model reads stays contiguous.
pub fn fit(
    pinned: &[(ChatMessage, u32)],
    history: &[Arc<Exchange>],
    current: &[(ChatMessage, u32)],
    reserved: u32,
    budget: u32,
    counter: &TokenCounter,
) -> Fitted {
    let pinned_tokens: u32 = pinned.iter().map(|(_, t)| t).sum();
    let current_tokens: u32 = current.iter().map(|(_, t)| t).sum();
    let mut fixed = pinned_tokens + reserved + current_tokens;
    let mut shortened: Vec<(usize, ChatMessage)> = Vec::new();
    if fixed > budget {
        let mut excess = fixed - budget;
        for (index, (message, tokens)) in current.iter().enumerate() {
            if excess == 0 {
                break;
            }
            let text = match message {
                ChatMessage::Tool { content, .. } => content,
                ChatMessage::User(text) if index > 0 => text,
                _ => continue,
            };
            if *tokens <= NOTE_TOKENS + 4 {
                continue;
            }
            let keep = tokens.saturating_sub(excess + NOTE_TOKENS + 4);
            let text = shorten(text, keep, *tokens, counter);
            let message = match message {
                ChatMessage::Tool { call_id, .. } => ChatMessage::Tool {
                    call_id: call_id.clone(),
                    content: text,
                },
                _ => ChatMessage::User(text),
            };
            let now = counter.message(&message);
            if now >= *tokens {
                continue;
            }
            excess = excess.saturating_sub(tokens - now);
            fixed -= tokens - now;
            shortened.push((index, message));
        }
    }
    let mut room = budget.saturating_sub(fixed);
    // Newest first: whole, or as question and answer, until one does not fit.
    let mut kept: Vec<Kept<'_>> = Vec::new();
    for exchange in history.iter().rev() {
        if exchange.tokens <= room {
            room -= exchange.tokens;
            kept.push(Kept::Whole(exchange));
            continue;
        }
        match compact(exchange, counter) {
            Some((messages, tokens)) if tokens <= room => {
                room -= tokens;
                kept.push(Kept::Compact(messages, tokens));
            }
            _ => break,
        }
    }
    kept.reverse();
    let history_tokens: u32 = kept.iter().map(Kept::tokens).sum();
    let compacted = kept
        .iter()
        .filter(|k| matches!(k, Kept::Compact(..)))
        .count();
    let mut messages = Vec::with_capacity(
        pinned.len() + kept.iter().map(|k| k.messages().len()).sum::<usize>() + current.len(),
    );
    messages.extend(pinned.iter().map(|(m, _)| m.clone()));
    for exchange in &kept {
        messages.extend(exchange.messages().iter().cloned());
    }
    let mut shortened_iter = shortened.iter().peekable();
    for (index, (message, _)) in current.iter().enumerate() {
        match shortened_iter.next_if(|(at, _)| *at == index) {
            Some((_, short)) => messages.push(short.clone()),
            None => messages.push(message.clone()),
        }
    }
    Fitted {
        messages,
        tokens: fixed + history_tokens,
        dropped: history.len() - kept.len(),
        compacted,
        shortened: shortened.len(),
    }
}

/// An exchange of history as it goes into a prompt.
enum Kept<'a> {
    Whole(&'a Exchange),
    Compact(Vec<ChatMessage>, u32),
}

impl Kept<'_> {
    fn messages(&self) -> &[ChatMessage] {
        match self {
            Kept::Whole(exchange) => &exchange.messages,
            Kept::Compact(messages, _) => messages,
        }
    }

    fn tokens(&self) -> u32 {
        match self {
            Kept::Whole(exchange) => exchange.tokens,
            Kept::Compact(_, tokens) => *tokens,
        }
    }
}

/// An exchange with tool traffic as its question and final answer alone; `None` when it
/// has none to leave out. Its traffic is whatever lies between the two: native tool calls
/// and results, or a ReAct turn's actions and observations (assistant and user messages of
/// text).
fn compact(exchange: &Exchange, counter: &TokenCounter) -> Option<(Vec<ChatMessage>, u32)> {
    if exchange.messages.len() <= 2 {
        return None;
    }
    let question = exchange
        .messages
        .iter()
        .find(|m| matches!(m, ChatMessage::User(_)))?;
    let answer = exchange.messages.iter().rev().find(
        |m| matches!(m, ChatMessage::Assistant { content, tool_calls } if tool_calls.is_empty() && !content.is_empty()),
    )?;
    let messages = vec![question.clone(), answer.clone()];
    let tokens = messages.iter().map(|m| counter.message(m)).sum();
    Some((messages, tokens))
}

/// The start of `text` (of `total` tokens) within about `keep` tokens, with a note of how
/// much was left out.
fn shorten(text: &str, keep: u32, total: u32, counter: &TokenCounter) -> String {
    let mut head = "";
    let mut head_tokens = 0;
    if keep > 0 {
        let per_token = text.len() as f64 / f64::from(total.max(1));
        let mut bytes = ((f64::from(keep) * per_token) as usize).min(text.len());
        // A few tries: the first guess is close, each next one closer.
        for _ in 0..8 {
            while !text.is_char_boundary(bytes) {
                bytes -= 1;
            }
            let tokens = counter.text(&text[..bytes]);
            if tokens <= keep {
                head = &text[..bytes];
                head_tokens = tokens;
                break;
            }
            bytes = (bytes as u64 * u64::from(keep) / u64::from(tokens)) as usize;
            bytes = bytes.min(text.len()).saturating_sub(1);
        }
    }
    let left_out = total.saturating_sub(head_tokens);
    if head.is_empty() {
        format!("[this output, about {left_out} tokens, was left out to fit the context budget]")
    } else {
        format!(
            "{head}\n[the rest of this output, about {left_out} tokens, was left out to fit the context budget]"
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use agentrt_models::ModelToolCall;

    fn exchange(query: &str, tokens: u32) -> Arc<Exchange> {
        Arc::new(Exchange {
            messages: vec![
                ChatMessage::User(query.into()),
                ChatMessage::Assistant {
                    content: String::new(),
                    tool_calls: vec![ModelToolCall {
                        id: "c".into(),
                        name: "t".into(),
                        arguments: "{}".into(),
                    }],
                },
                ChatMessage::Tool {
                    call_id: "c".into(),
                    content: "r".into(),
                },
                ChatMessage::Assistant {
                    content: format!("answer to {query}"),
                    tool_calls: vec![],
                },
            ],
            tokens,
            kept_ms: 0,
        })
    }

    #[test]
    fn the_oldest_exchanges_go_first_and_whole() {
        let system = ChatMessage::System("s".into());
        let history = [
            exchange("one", 40),
            exchange("two", 30),
            exchange("three", 20),
        ];
        let current = [(ChatMessage::User("four".into()), 10)];
        let fitted = fit(&[(system, 5)], &history, &current, 15, 90, counter());
        assert_eq!(fitted.dropped, 1);
        assert_eq!(fitted.tokens, 5 + 15 + 10 + 30 + 20);
        assert_eq!(fitted.messages.len(), 1 + 4 + 4 + 1);
        assert_eq!(fitted.messages[1], ChatMessage::User("two".into()));
        assert!(
            matches!(fitted.messages[3], ChatMessage::Tool { .. }),
            "calls keep their results"
        );
    }

    #[test]
    fn a_newer_exchange_that_does_not_fit_stops_older_ones_too() {
        let history = [exchange("small old", 5), exchange("big newer", 500)];
        let fitted = fit(
            &[],
            &history,
            &[(ChatMessage::User("q".into()), 10)],
            0,
            100,
            counter(),
        );
        // Its question and answer alone fit (measured), and the older one too.
        assert_eq!(fitted.dropped, 0);
        assert_eq!(fitted.compacted, 1);
        let mut expected = exchange("small old", 5).messages.clone();
        expected.extend([
            ChatMessage::User("big newer".into()),
            ChatMessage::Assistant {
                content: "answer to big newer".into(),
                tool_calls: vec![],
            },
            ChatMessage::User("q".into()),
        ]);
        assert_eq!(fitted.messages, expected);
        // With no room even for that, the history stops there, older exchanges too.
        let fitted = fit(
            &[],
            &history,
            &[(ChatMessage::User("q".into()), 10)],
            0,
            15,
            counter(),
        );
        assert_eq!(fitted.dropped, 2, "history stays contiguous");
    }

    /// A ReAct turn's actions and observations are text (assistant and user messages):
    /// they are its tool traffic all the same, left out when the exchange does not fit
    /// whole.
    #[test]
    fn a_react_exchange_that_does_not_fit_goes_in_as_question_and_answer() {
        let react = Arc::new(Exchange {
            messages: vec![
                ChatMessage::User("big react".into()),
                ChatMessage::Assistant {
                    content: "Thought: look\nAction: search\nAction Input: {}".into(),
                    tool_calls: vec![],
                },
                ChatMessage::User(format!("Observation: {}", "x ".repeat(2000))),
                ChatMessage::Assistant {
                    content: "Thought: done\nFinal Answer: found".into(),
                    tool_calls: vec![],
                },
            ],
            tokens: 2100,
            kept_ms: 0,
        });
        let fitted = fit(
            &[],
            &[react],
            &[(ChatMessage::User("q".into()), 10)],
            0,
            200,
            counter(),
        );
        assert_eq!((fitted.dropped, fitted.compacted), (0, 1));
        assert_eq!(
            fitted.messages,
            [
                ChatMessage::User("big react".into()),
                ChatMessage::Assistant {
                    content: "Thought: done\nFinal Answer: found".into(),
                    tool_calls: vec![],
                },
                ChatMessage::User("q".into()),
            ]
        );
    }

    #[test]
    fn the_current_turn_is_always_kept() {
        let fitted = fit(
            &[],
            &[exchange("old", 5)],
            &[(ChatMessage::User("huge".into()), 1000)],
            0,
            100,
            counter(),
        );
        assert_eq!(fitted.messages, [ChatMessage::User("huge".into())]);
        assert_eq!(fitted.dropped, 1);
    }

    #[test]
    fn tool_results_of_the_current_turn_are_shortened_oldest_first_to_fit() {
        let counter = counter();
        let output = |word: &str| format!("{word} ").repeat(2000);
        let call = |id: &str| ChatMessage::Assistant {
            content: String::new(),
            tool_calls: vec![ModelToolCall {
                id: id.into(),
                name: "search".into(),
                arguments: "{}".into(),
            }],
        };
        let messages = [
            ChatMessage::User("question".into()),
            call("a"),
            ChatMessage::Tool {
                call_id: "a".into(),
                content: output("alpha"),
            },
            call("b"),
            ChatMessage::Tool {
                call_id: "b".into(),
                content: output("beta"),
            },
        ];
        let current: Vec<(ChatMessage, u32)> = messages
            .iter()
            .map(|m| (m.clone(), counter.message(m)))
            .collect();
        let whole: u32 = current.iter().map(|(_, t)| t).sum();
        assert!(whole > 3000, "{whole}");
        let old = Arc::new(Exchange::new(exchange("old", 0).messages.clone(), counter));
        let fitted = fit(&[], &[old], &current, 0, 1500, counter);
        let sent: u32 = fitted.messages.iter().map(|m| counter.message(m)).sum();
        assert!(sent <= 1500, "{sent} tokens sent for a budget of 1500");
        assert!(sent > 1400, "no more is cut than needed: {sent}");
        assert_eq!(fitted.tokens, sent);
        assert_eq!(fitted.messages.len(), 5, "every call keeps its result");
        assert_eq!(fitted.dropped, 1);
        let ChatMessage::Tool { content: first, .. } = &fitted.messages[2] else {
            panic!("{:?}", fitted.messages[2]);
        };
        assert!(
            first.starts_with("[this output, about") && first.contains("left out"),
            "the oldest goes first: {first}"
        );
        let ChatMessage::Tool {
            content: second, ..
        } = &fitted.messages[4]
        else {
            panic!("{:?}", fitted.messages[4]);
        };
        assert!(second.starts_with("beta beta"), "{second:.40}");
        assert!(
            second.ends_with("was left out to fit the context budget]"),
            "{second}"
        );
        assert_eq!(fitted.shortened, 2);
        // Within the budget, nothing is touched.
        let fitted = fit(&[], &[], &current, 0, whole, counter);
        assert_eq!(fitted.shortened, 0);
        assert_eq!(fitted.messages, messages);
    }

    #[test]
    fn pinned_messages_always_go_first() {
        let pinned = [
            (ChatMessage::System("config".into()), 5),
            (ChatMessage::System("client".into()), 5),
        ];
        let fitted = fit(
            &pinned,
            &[exchange("old", 50)],
            &[(ChatMessage::User("q".into()), 10)],
            0,
            30,
            counter(),
        );
        assert_eq!(
            fitted.messages[..2],
            [pinned[0].0.clone(), pinned[1].0.clone()]
        );
        assert_eq!(fitted.tokens, 20);
    }

    fn counter() -> &'static TokenCounter {
        TokenCounter::shared()
    }

    #[test]
    fn explicit_context_is_grouped_at_user_messages() {
        let counter = TokenCounter::shared();
        let groups = Exchange::group(
            vec![
                ChatMessage::System("preamble".into()),
                ChatMessage::User("a".into()),
                ChatMessage::Assistant {
                    content: "b".into(),
                    tool_calls: vec![],
                },
                ChatMessage::User("c".into()),
            ],
            counter,
        );
        assert_eq!(groups.len(), 3);
        assert_eq!(groups[1].messages.len(), 2);
        assert!(groups.iter().all(|g| g.tokens > 0));
    }
}
