use std::{
    collections::HashMap,
    hash::{BuildHasher, RandomState},
    sync::{Mutex, MutexGuard, OnceLock, PoisonError},
};

use agentrt_models::ChatMessage;
use tracing::warn;

/// Tokens a chat message costs beyond its text (role and separators), as OpenAI documents
/// for its chat format.
const PER_MESSAGE: u32 = 4;

/// Counts tokens with the `o200k_base` BPE (the GPT-4o family's); other models' counts
/// differ by a few percent, which the budget's margin absorbs.
pub struct TokenCounter {
    bpe: Option<tiktoken_rs::CoreBPE>,
    /// Counts of texts by hash: tool names, descriptions and schemas, system prompts and
    /// tool outputs come back run after run, and BPE (with its regex pre-tokenizer) costs
    /// microseconds even for a word, where hashing costs tens of nanoseconds.
    memo: Mutex<HashMap<u64, u32>>,
    hasher: RandomState,
}

/// Entries the memo holds before it starts over, which bounds its memory (~100 KB).
const MEMO_CAPACITY: usize = 4096;

impl TokenCounter {
    /// The process-wide counter; the BPE tables are built once, on first use.
    pub fn shared() -> &'static Self {
        static COUNTER: OnceLock<TokenCounter> = OnceLock::new();
        COUNTER.get_or_init(|| match tiktoken_rs::o200k_base() {
            Ok(bpe) => Self::with(Some(bpe)),
            Err(e) => {
                warn!(error = %e, "cannot load the o200k tokenizer; estimating 4 characters per token");
                Self::with(None)
            }
        })
    }

    fn with(bpe: Option<tiktoken_rs::CoreBPE>) -> Self {
        Self {
            bpe,
            memo: Mutex::new(HashMap::new()),
            hasher: RandomState::new(),
        }
    }

    /// Tokens of `text`.
    pub fn text(&self, text: &str) -> u32 {
        if text.is_empty() {
            return 0;
        }
        let Some(bpe) = &self.bpe else {
            return u32::try_from(text.len().div_ceil(4)).unwrap_or(u32::MAX);
        };
        let count = |text: &str| u32::try_from(bpe.encode_ordinary(text).len()).unwrap_or(u32::MAX);
        let key = self.hasher.hash_one(text);
        if let Some(&tokens) = self.memo().get(&key) {
            return tokens;
        }
        let tokens = count(text);
        let mut memo = self.memo();
        if memo.len() >= MEMO_CAPACITY {
            memo.clear();
        }
        memo.insert(key, tokens);
        tokens
    }

    fn memo(&self) -> MutexGuard<'_, HashMap<u64, u32>> {
        // A poisoned memo only holds counts; carry on with them.
        self.memo.lock().unwrap_or_else(PoisonError::into_inner)
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

    #[test]
    fn remembered_counts_match_and_the_memo_stays_bounded() {
        let counter = TokenCounter::with(tiktoken_rs::o200k_base().ok());
        let long = "The quick brown fox jumps over the lazy dog. ".repeat(100);
        let first = counter.text(&long);
        assert_eq!(counter.memo().len(), 1);
        assert_eq!(counter.text(&long), first);
        for i in 0..MEMO_CAPACITY + 10 {
            counter.text(&format!("{long}{i}"));
        }
        assert!(counter.memo().len() <= MEMO_CAPACITY);
    }
}
