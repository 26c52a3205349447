use std::sync::OnceLock;

use agentrt_models::ChatMessage;
use tracing::warn;

/// Tokens a chat message costs beyond its text (role and separators), as OpenAI documents
/// for its chat format.
const PER_MESSAGE: u32 = 4;

/// Counts tokens with the `o200k_base` BPE (the GPT-4o family's); other models' counts
/// differ by a few percent, which the budget's margin absorbs.
pub struct TokenCounter {
    bpe: Option<tiktoken_rs::CoreBPE>,
}

impl TokenCounter {
    /// The process-wide counter; the BPE tables are built once, on first use.
    pub fn shared() -> &'static Self {
        static COUNTER: OnceLock<TokenCounter> = OnceLock::new();
        COUNTER.get_or_init(|| match tiktoken_rs::o200k_base() {
            Ok(bpe) => Self { bpe: Some(bpe) },
            Err(e) => {
                warn!(error = %e, "cannot load the o200k tokenizer; estimating 4 characters per token");
                Self { bpe: None }
            }
        })
    }

    /// Tokens of `text`.
    pub fn text(&self, text: &str) -> u32 {
        if text.is_empty() {
            return 0;
        }
        let count = match &self.bpe {
            Some(bpe) => bpe.encode_ordinary(text).len(),
            None => text.len().div_ceil(4),
        };
        u32::try_from(count).unwrap_or(u32::MAX)
    }

    /// Tokens of a whole message, tool calls included.
    pub fn message(&self, message: &ChatMessage) -> u32 {
        let body = match message {
            ChatMessage::System(text) | ChatMessage::User(text) => self.text(text),
            ChatMessage::Assistant {
                content,
                tool_calls,
            } => {
                self.text(content)
                    + tool_calls
                        .iter()
                        .map(|c| self.text(&c.name) + self.text(&c.arguments) + PER_MESSAGE)
                        .sum::<u32>()
            }
            ChatMessage::Tool { content, .. } => self.text(content),
        };
        body + PER_MESSAGE
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn counts_are_real_bpe_tokens() {
        let counter = TokenCounter::shared();
        assert_eq!(counter.text(""), 0);
        assert_eq!(counter.text("hello world"), 2);
        let long = "The quick brown fox jumps over the lazy dog. ".repeat(100);
        let tokens = counter.text(&long);
        assert!((900..=1100).contains(&tokens), "{tokens}");
        assert_eq!(
            counter.message(&ChatMessage::User("hello world".into())),
            2 + PER_MESSAGE
        );
    }
}
