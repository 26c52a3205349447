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
}

/// Builds the prompt of one model round: the system prompt, as much history as fits
/// (newest first, whole exchanges), and the current turn, which is always kept whole.
/// `reserved` counts what else the request carries (tool schemas). When even the current
/// turn does not fit, it is sent anyway and the provider decides.
pub fn fit(
    system: Option<(&ChatMessage, u32)>,
    history: &[Arc<Exchange>],
    current: &[(ChatMessage, u32)],
    reserved: u32,
    budget: u32,
) -> Fitted {
    let fixed: u32 =
        system.map_or(0, |(_, t)| t) + reserved + current.iter().map(|(_, t)| t).sum::<u32>();
    let mut room = budget.saturating_sub(fixed);
    let kept = history
        .iter()
        .rev()
        .take_while(|exchange| {
            let fits = exchange.tokens <= room;
            if fits {
                room -= exchange.tokens;
            }
            fits
        })
        .count();
    let kept_history = &history[history.len() - kept..];
    let mut messages = Vec::with_capacity(
        1 + kept_history.iter().map(|e| e.messages.len()).sum::<usize>() + current.len(),
    );
    if let Some((message, _)) = system {
        messages.push(message.clone());
    }
    for exchange in kept_history {
        messages.extend(exchange.messages.iter().cloned());
    }
    messages.extend(current.iter().map(|(m, _)| m.clone()));
    Fitted {
        messages,
        tokens: fixed + kept_history.iter().map(|e| e.tokens).sum::<u32>(),
        dropped: history.len() - kept,
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
        let fitted = fit(Some((&system, 5)), &history, &current, 15, 90);
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
            None,
            &history,
            &[(ChatMessage::User("q".into()), 10)],
            0,
            100,
        );
        assert_eq!(fitted.dropped, 2, "history stays contiguous");
    }

    #[test]
    fn the_current_turn_is_always_kept() {
        let fitted = fit(
            None,
            &[exchange("old", 5)],
            &[(ChatMessage::User("huge".into()), 1000)],
            0,
            100,
        );
        assert_eq!(fitted.messages, [ChatMessage::User("huge".into())]);
        assert_eq!(fitted.dropped, 1);
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
