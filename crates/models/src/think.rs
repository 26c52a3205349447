//! Splits `<think>...</think>` out of streamed answer text, for models (DeepSeek-R1,
//! Qwen3, ...) that put their reasoning inline. Tags may be split across chunks.

use std::borrow::Cow;

const OPEN: &str = "<think>";
const CLOSE: &str = "</think>";

/// A piece of routed text.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Piece {
    /// Inside `<think>`.
    Reasoning(String),
    /// Outside it.
    Content(String),
}

/// Streaming splitter: feed chunks, get pieces; holds back only what could be the start
/// of a tag.
#[derive(Debug, Default)]
pub struct ThinkSplitter {
    inside: bool,
    pending: String,
}

impl ThinkSplitter {
    /// Routes `chunk`, handing the pieces it completes to `out`.
    pub fn push(&mut self, chunk: Cow<'_, str>, mut out: impl FnMut(Piece)) {
        // Most chunks hold no tag nor the start of one: they pass whole, uncopied.
        if self.pending.is_empty() && !chunk.contains('<') {
            self.emit(chunk.into_owned(), &mut out);
            return;
        }
        self.pending.push_str(&chunk);
        loop {
            let tag = if self.inside { CLOSE } else { OPEN };
            if let Some(at) = self.pending.find(tag) {
                let before: String = self.pending[..at].to_owned();
                self.emit(before, &mut out);
                self.pending.drain(..at + tag.len());
                self.inside = !self.inside;
                continue;
            }
            // Keep a tail that may be the beginning of the tag.
            let keep = partial_suffix(&self.pending, tag);
            let ready = self.pending.len() - keep;
            if ready > 0 {
                let text = self.pending[..ready].to_owned();
                self.pending.drain(..ready);
                self.emit(text, &mut out);
            }
            return;
        }
    }

    /// Flushes what is held back at the end of the stream.
    pub fn finish(&mut self, mut out: impl FnMut(Piece)) {
        let rest = std::mem::take(&mut self.pending);
        self.emit(rest, &mut out);
    }

    fn emit(&self, text: String, out: &mut impl FnMut(Piece)) {
        if text.is_empty() {
            return;
        }
        out(if self.inside {
            Piece::Reasoning(text)
        } else {
            Piece::Content(text)
        });
    }
}

/// Length of the longest suffix of `text` that is a proper prefix of `tag`.
fn partial_suffix(text: &str, tag: &str) -> usize {
    (1..tag.len())
        .rev()
        .find(|&n| {
            text.len() >= n
                && text.is_char_boundary(text.len() - n)
                && tag.starts_with(&text[text.len() - n..])
        })
        .unwrap_or(0)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn split(chunks: &[&str]) -> Vec<Piece> {
        let mut splitter = ThinkSplitter::default();
        let mut out = Vec::new();
        for chunk in chunks {
            splitter.push((*chunk).into(), |p| out.push(p));
        }
        splitter.finish(|p| out.push(p));
        // Merge neighbours of the same kind, as a reader of the deltas would.
        let mut merged: Vec<Piece> = Vec::new();
        for piece in out {
            match (merged.last_mut(), piece) {
                (Some(Piece::Reasoning(a)), Piece::Reasoning(b))
                | (Some(Piece::Content(a)), Piece::Content(b)) => a.push_str(&b),
                (_, piece) => merged.push(piece),
            }
        }
        merged
    }

    #[test]
    fn tags_split_across_chunks_are_routed() {
        assert_eq!(
            split(&["<thi", "nk>let me ", "see</th", "ink>The answer", " is 4."]),
            [
                Piece::Reasoning("let me see".into()),
                Piece::Content("The answer is 4.".into())
            ]
        );
    }

    #[test]
    fn plain_text_and_lone_angles_pass_through() {
        assert_eq!(
            split(&["a < b", " and <b>bold</b> <"]),
            [Piece::Content("a < b and <b>bold</b> <".into())]
        );
        assert_eq!(split(&["héllo <th"]), [Piece::Content("héllo <th".into())]);
    }

    #[test]
    fn nothing_is_held_back_longer_than_needed() {
        let mut splitter = ThinkSplitter::default();
        let mut out = Vec::new();
        splitter.push("abc<".into(), |p| out.push(p));
        assert_eq!(out, [Piece::Content("abc".into())]);
    }
}
