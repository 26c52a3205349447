//! Splits `<think>...</think>` out of streamed answer text, for models (DeepSeek-R1,
//! Qwen3, ...) that put their reasoning inline. Tags may be split across chunks.
//!
//! Only a reply that begins with `<think>` (after whitespace) has its reasoning split out,
//! once: after its `</think>` everything is answer, so that a model that writes the tag
//! in its answer (explaining these models, quoting a prompt) does not have the rest of
//! its answer taken for reasoning. A reply that does not begin with it passes as it is,
//! nothing held back once it has begun otherwise. (A reply that only closes the tag, its
//! template having opened it in the prompt, is not split: its reasoning has streamed as
//! answer before the `</think>` that would say so.)

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

/// Where a reply's text is.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
enum Mode {
    /// Nothing but whitespace yet: a `<think>` may still open the reply.
    #[default]
    Start,
    /// Inside the reply's opening `<think>`.
    Inside,
    /// The answer: after `</think>`, or in a reply that began otherwise.
    Answer,
}

/// Streaming splitter of one reply: feed chunks, get pieces; holds back only what could
/// be the start of the tag it waits for (at the reply's start, or inside its reasoning).
#[derive(Debug, Default)]
pub struct ThinkSplitter {
    mode: Mode,
    pending: String,
}

impl ThinkSplitter {
    /// Routes `chunk`, handing the pieces it completes to `out`.
    pub fn push(&mut self, chunk: Cow<'_, str>, mut out: impl FnMut(Piece)) {
        // Most chunks hold no tag nor the start of one: they pass whole, uncopied.
        if self.pending.is_empty() && (self.mode == Mode::Answer || !chunk.contains('<')) {
            if self.mode == Mode::Start && !chunk.trim_start().is_empty() {
                self.mode = Mode::Answer;
            }
            self.emit(chunk.into_owned(), &mut out);
            return;
        }
        self.pending.push_str(&chunk);
        loop {
            match self.mode {
                Mode::Start => {
                    let text = self.pending.trim_start();
                    let blank = self.pending.len() - text.len();
                    if text.starts_with(OPEN) {
                        // Whitespace before the tag is answer text, as it always was.
                        let before: String = self.pending[..blank].to_owned();
                        self.emit(before, &mut out);
                        self.pending.drain(..blank + OPEN.len());
                        self.mode = Mode::Inside;
                        continue;
                    }
                    if !text.is_empty() && OPEN.starts_with(text) {
                        // The tag may be arriving: only it is held back.
                        let before: String = self.pending[..blank].to_owned();
                        self.pending.drain(..blank);
                        self.emit(before, &mut out);
                        return;
                    }
                    if !text.is_empty() {
                        self.mode = Mode::Answer;
                    }
                    let text = std::mem::take(&mut self.pending);
                    self.emit(text, &mut out);
                    return;
                }
                Mode::Inside => {
                    if let Some(at) = self.pending.find(CLOSE) {
                        let reasoning: String = self.pending[..at].to_owned();
                        self.emit(reasoning, &mut out);
                        self.pending.drain(..at + CLOSE.len());
                        self.mode = Mode::Answer;
                        continue;
                    }
                    // Keep a tail that may be the beginning of the tag.
                    let keep = partial_suffix(&self.pending, CLOSE);
                    let ready = self.pending.len() - keep;
                    if ready > 0 {
                        let text = self.pending[..ready].to_owned();
                        self.pending.drain(..ready);
                        self.emit(text, &mut out);
                    }
                    return;
                }
                Mode::Answer => {
                    let text = std::mem::take(&mut self.pending);
                    self.emit(text, &mut out);
                    return;
                }
            }
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
        out(if self.mode == Mode::Inside {
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

    /// What is held back is only what may be the tag waited for: at the reply's start, or
    /// inside its reasoning; once the answer has begun, nothing.
    #[test]
    fn nothing_is_held_back_longer_than_needed() {
        fn pushed(splitter: &mut ThinkSplitter, chunk: &str) -> Vec<Piece> {
            let mut out = Vec::new();
            splitter.push(chunk.into(), |p| out.push(p));
            out
        }
        let mut splitter = ThinkSplitter::default();
        assert_eq!(
            pushed(&mut splitter, "\n<th"),
            [Piece::Content("\n".into())]
        );
        assert_eq!(
            pushed(&mut splitter, "ink>hmm</th"),
            [Piece::Reasoning("hmm".into())]
        );
        assert_eq!(
            pushed(&mut splitter, "ink>a <"),
            [Piece::Content("a <".into())]
        );
        let mut splitter = ThinkSplitter::default();
        assert_eq!(
            pushed(&mut splitter, "abc<"),
            [Piece::Content("abc<".into())]
        );
    }

    /// A model that writes the tag in its answer (explaining it, quoting a prompt) has its
    /// whole answer sent as answer: it used to go on as reasoning from there.
    #[test]
    fn a_think_tag_after_the_answer_began_is_answer_text() {
        assert_eq!(
            split(&["Wrap it in <thi", "nk>", " and </think> tags", "; done."]),
            [Piece::Content(
                "Wrap it in <think> and </think> tags; done.".into()
            )]
        );
        assert_eq!(
            split(&["Sure", "<think>x</think>"]),
            [Piece::Content("Sure<think>x</think>".into())]
        );
    }

    /// The reply's reasoning is split out once: a second `<think>` is answer text.
    #[test]
    fn only_the_opening_think_block_is_reasoning() {
        assert_eq!(
            split(&[
                "<think>plan</think>",
                "Use <think>x</think> to mark ",
                "<think>it"
            ]),
            [
                Piece::Reasoning("plan".into()),
                Piece::Content("Use <think>x</think> to mark <think>it".into())
            ]
        );
    }

    /// Whitespace may come before the opening tag (it stays answer text, as it was), and a
    /// reply cut inside its reasoning has only reasoning.
    #[test]
    fn whitespace_may_precede_the_opening_tag() {
        assert_eq!(
            split(&["\n\n", " <think>", "r</think>", "\n\nanswer"]),
            [
                Piece::Content("\n\n ".into()),
                Piece::Reasoning("r".into()),
                Piece::Content("\n\nanswer".into())
            ]
        );
        assert_eq!(
            split(&["<think>cut sh"]),
            [Piece::Reasoning("cut sh".into())]
        );
    }

    /// A reply that only closes the tag (its template opened it in the prompt) is not
    /// split: what came before the `</think>` has streamed as answer by then, and holding
    /// every reply back in case it comes would delay every model's answer.
    #[test]
    fn a_reply_that_only_closes_the_tag_passes_as_it_is() {
        assert_eq!(
            split(&["let me see", "</think>", "Four."]),
            [Piece::Content("let me see</think>Four.".into())]
        );
    }
}
