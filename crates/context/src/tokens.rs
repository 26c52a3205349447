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

/// Counts tokens with the `o200k_base` BPE (the GPT-4o family's). Other models' counts
/// differ, by more for text their vocabularies cover less (CJK text, emoji); no margin is
/// added: a budget is set below the model's window by as much as its counts may exceed.
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

/// Texts longer than this are counted in pieces, off the async workers.
const LARGE_TEXT_BYTES: usize = 64 * 1024;

/// The pieces a long text is counted in; cut at whitespace where there is some, so that
/// the count differs from the whole text's by a token or so per piece at most.
const PIECE_BYTES: usize = 4 * 1024;

/// A run of text without whitespace is cut this short: BPE's cost grows with the square of
/// a word's length.
const WORD_BYTES: usize = 128;

/// How much of a long text is counted; the rest is extrapolated.
const COUNTED_BYTES: usize = 1024 * 1024;

/// `text` in pieces of about `size` bytes, each ending at whitespace when the piece has
/// some (else after at most [`WORD_BYTES`]), always at a character boundary.
fn pieces(text: &str, size: usize) -> impl Iterator<Item = &str> {
    let mut rest = text;
    std::iter::from_fn(move || {
        if rest.is_empty() {
            return None;
        }
        let mut cut = size.min(rest.len());
        while !rest.is_char_boundary(cut) {
            cut -= 1;
        }
        if cut < rest.len() {
            match rest[..cut].rfind(char::is_whitespace) {
                Some(space) if space > 0 => cut = space,
                _ => {
                    cut = WORD_BYTES.min(cut);
                    while !rest.is_char_boundary(cut) {
                        cut -= 1;
                    }
                }
            }
        }
        let (piece, tail) = rest.split_at(cut.max(1).min(rest.len()));
        rest = tail;
        Some(piece)
    })
}

/// Runs CPU-heavy `work` without holding up the other tasks of a multi-threaded tokio
/// runtime (they move to another worker meanwhile); elsewhere it just runs.
fn off_the_async_workers<T>(work: impl FnOnce() -> T) -> T {
    match tokio::runtime::Handle::try_current() {
        Ok(handle) if handle.runtime_flavor() == tokio::runtime::RuntimeFlavor::MultiThread => {
            tokio::task::block_in_place(work)
        }
        _ => work(),
    }
}

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
        let tokens = if text.len() <= LARGE_TEXT_BYTES {
            count(text)
        } else {
            // A long text (a model's 10 MB answer) takes seconds of BPE, and BPE is
            // quadratic in the length of a word: count it in short pieces, off the async
            // workers so that other runs are not held up meanwhile, and beyond
            // `COUNTED_BYTES` extrapolate from what was counted: such a text never fits a
            // prompt whole, and its count only has to be close.
            off_the_async_workers(|| {
                let mut counted_bytes = 0usize;
                let mut tokens = 0u64;
                for piece in pieces(text, PIECE_BYTES) {
                    if counted_bytes >= COUNTED_BYTES {
                        break;
                    }
                    counted_bytes += piece.len();
                    tokens += u64::from(count(piece));
                }
                let whole = tokens.saturating_mul(text.len() as u64) / counted_bytes.max(1) as u64;
                u32::try_from(whole).unwrap_or(u32::MAX)
            })
        };
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
    fn long_texts_are_counted_in_pieces_close_to_the_whole() {
        let counter = TokenCounter::with(tiktoken_rs::o200k_base().ok());
        let text = "The quick brown fox jumps over the lazy dog. ".repeat(3000);
        let whole = counter.bpe.as_ref().unwrap().encode_ordinary(&text).len() as f64;
        let counted = f64::from(counter.text(&text));
        assert!(
            (counted - whole).abs() / whole < 0.01,
            "{counted} vs {whole}"
        );
        // No spaces at all, multi-byte characters: still cut at boundaries, still counted.
        let dense = "é".repeat(100_000);
        assert!(counter.text(&dense) > 0);
        assert_eq!(pieces(&dense, 7).map(str::len).sum::<usize>(), dense.len());
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
