//! The ReAct text protocol, for models without native tool calling: the prompt that
//! teaches it, and a parser that reads the model's text while it streams.
//!
//! ```text
//! Thought: what to do next
//! Action: tool name
//! Action Input: {"json": "arguments"}
//! Observation: (written by the engine, never by the model: generation stops here)
//! ... repeated ...
//! Thought: I know the answer
//! Final Answer: the answer
//! ```

use agentrt_core::ToolSpec;

/// The stop sequence that ends a ReAct round: the engine writes observations.
pub const STOP: &str = "Observation:";

/// The protocol instructions, with every tool and its input schema.
pub fn instructions(tools: &[ToolSpec]) -> String {
    let mut text = String::from("Answer the user's question. You can use these tools:\n\n");
    for tool in tools {
        text.push_str(&format!(
            "- {}: {}\n  Input schema: {}\n",
            tool.name, tool.description, tool.input_schema
        ));
    }
    let names: Vec<&str> = tools.iter().map(|t| t.name.as_str()).collect();
    text.push_str(&format!(
        "\nUse exactly this format:\n\n\
         Thought: think about what to do next\n\
         Action: the tool to use, one of [{}]\n\
         Action Input: the tool's input as a JSON object\n\
         Observation: the tool's result (provided to you; never write it yourself)\n\
         ... (Thought/Action/Action Input/Observation can repeat)\n\
         Thought: I now know the final answer\n\
         Final Answer: the answer to the user's question\n",
        names.join(", ")
    ));
    text
}

/// Cuts a model's text at the stop sequence, as a server that honours `stop` would: many
/// local servers ignore it, and a model left to go on invents the observation and an
/// answer. Text that may be the start of the stop sequence is held back until the next
/// chunk decides it.
#[derive(Debug, Default)]
pub struct StopCut {
    held: String,
    stopped: bool,
}

impl StopCut {
    /// The part of `chunk` that comes before the stop sequence; empty once it was seen.
    pub fn push(&mut self, chunk: &str) -> String {
        if self.stopped {
            return String::new();
        }
        let mut text = std::mem::take(&mut self.held);
        text.push_str(chunk);
        if let Some(at) = text.find(STOP) {
            self.stopped = true;
            text.truncate(at);
            return text;
        }
        // Hold back the longest end of the text that begins the stop sequence.
        let keep = (1..STOP.len().min(text.len() + 1))
            .rev()
            .find(|&n| {
                text.is_char_boundary(text.len() - n) && STOP.starts_with(&text[text.len() - n..])
            })
            .unwrap_or(0);
        self.held = text.split_off(text.len() - keep);
        text
    }

    /// What is still held back at the end of the text.
    pub fn finish(&mut self) -> String {
        std::mem::take(&mut self.held)
    }

    /// Whether the stop sequence was seen: the rest of the model's output is not read.
    pub fn stopped(&self) -> bool {
        self.stopped
    }
}

/// A segment of a ReAct reply, routed to the thought or the answer.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Segment {
    /// Reasoning text (Thought, and anything outside the markers).
    Thought(String),
    /// Final answer text.
    Answer(String),
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Section {
    Thought,
    Action,
    ActionInput,
    Answer,
}

const MARKERS: [(&str, Section); 4] = [
    ("Thought:", Section::Thought),
    ("Action:", Section::Action),
    ("Action Input:", Section::ActionInput),
    ("Final Answer:", Section::Answer),
];

/// Reads ReAct text as it streams. Marker lines are recognised at the start of a line,
/// even when split across chunks; text is passed on as soon as it cannot be a marker.
#[derive(Debug)]
pub struct Parser {
    section: Section,
    /// Text at the start of the current line that may still turn out to be a marker.
    line_start: String,
    /// Whether `line_start` is still being decided (we are at the start of a line).
    deciding: bool,
    action: String,
    action_input: String,
    answer: String,
    saw_marker: bool,
    /// Text before the first marker: reasoning if a marker follows, else the whole reply
    /// is the answer. Held back so that it is streamed once, as what it turns out to be.
    unmarked: String,
    /// Whitespace right after `Thought:` or `Final Answer:` is dropped, also when the
    /// marker and the text come in different chunks.
    trim_next: bool,
    /// Whether the reply's action is whole (its input is followed by another marker): a
    /// round makes one call, the first the model wrote; the `Action:` and `Action Input:`
    /// of later ones are not read (they were appended to the first, making one call of a
    /// tool named `calculator\ncalculator`).
    action_done: bool,
    /// Bytes of text pushed so far, where the current line began, and where the text
    /// after the reply's action begins (the line of the marker that ended it).
    consumed: usize,
    line_begin: usize,
    action_end: Option<usize>,
}

impl Default for Parser {
    fn default() -> Self {
        Self {
            section: Section::Thought,
            line_start: String::new(),
            deciding: true,
            action: String::new(),
            action_input: String::new(),
            answer: String::new(),
            saw_marker: false,
            unmarked: String::new(),
            trim_next: false,
            action_done: false,
            consumed: 0,
            line_begin: 0,
            action_end: None,
        }
    }
}

impl Parser {
    /// Routes a chunk of model text.
    pub fn push(&mut self, chunk: &str, out: &mut Vec<Segment>) {
        for line in chunk.split_inclusive('\n') {
            if self.deciding && self.line_start.is_empty() {
                self.line_begin = self.consumed;
            }
            self.push_line_part(line, out);
            self.consumed += line.len();
        }
    }

    fn push_line_part(&mut self, part: &str, out: &mut Vec<Segment>) {
        let ends_line = part.ends_with('\n');
        if self.section == Section::Answer {
            // Everything after `Final Answer:` is the answer.
            self.emit(part.to_owned(), out);
            return;
        }
        if !self.deciding {
            self.emit(part.to_owned(), out);
        } else {
            self.line_start.push_str(part);
            let trimmed = self.line_start.trim_start();
            if let Some((marker, section)) = MARKERS
                .iter()
                .filter(|(m, _)| trimmed.starts_with(m))
                .max_by_key(|(m, _)| m.len())
            {
                // `Action:` is a prefix of nothing else, but `Action Input:` must win over
                // a longer line that merely starts with `Action`.
                let rest = trimmed[marker.len()..].to_owned();
                if !self.saw_marker && !self.unmarked.is_empty() {
                    out.push(Segment::Thought(std::mem::take(&mut self.unmarked)));
                }
                if self.section == Section::ActionInput
                    && *section != Section::ActionInput
                    && !self.action_done
                {
                    self.action_done = true;
                    self.action_end = Some(self.line_begin);
                } else if *section == Section::Action && !self.action_done {
                    // A tool named again before its input: the later name stands.
                    self.action.clear();
                }
                self.section = *section;
                self.saw_marker = true;
                self.line_start.clear();
                self.deciding = false;
                self.trim_next = matches!(section, Section::Answer | Section::Thought);
                self.emit(rest, out);
            } else if !MARKERS.iter().any(|(m, _)| m.starts_with(trimmed)) || ends_line {
                let text = std::mem::take(&mut self.line_start);
                self.deciding = false;
                self.emit(text, out);
            }
        }
        if ends_line {
            self.deciding = true;
        }
    }

    fn emit(&mut self, mut text: String, out: &mut Vec<Segment>) {
        if self.trim_next {
            let start = text.len() - text.trim_start().len();
            text.drain(..start);
            if text.is_empty() {
                return;
            }
            self.trim_next = false;
        }
        if text.is_empty() {
            return;
        }
        match self.section {
            // What follows the action is not read (its reasoning is for an action that
            // does not run), but for a final answer.
            Section::Thought | Section::Action | Section::ActionInput if self.action_done => {}
            Section::Thought if !self.saw_marker => self.unmarked.push_str(&text),
            Section::Thought => out.push(Segment::Thought(text)),
            Section::Action => self.action.push_str(&text),
            Section::ActionInput => self.action_input.push_str(&text),
            Section::Answer => {
                self.answer.push_str(&text);
                out.push(Segment::Answer(text));
            }
        }
    }

    /// Flushes what is held back at the end of the model's output.
    pub fn finish(&mut self, out: &mut Vec<Segment>) {
        let rest = std::mem::take(&mut self.line_start);
        self.deciding = false;
        self.emit(rest, out);
    }

    /// Whether the model wrote `Final Answer:`.
    pub fn answered(&self) -> bool {
        self.section == Section::Answer
    }

    /// The final answer text so far.
    pub fn answer(&self) -> &str {
        self.answer.trim()
    }

    /// The action the model asked for, with its raw input text (out of the Markdown code
    /// fence open models often put it in: ```` ```json ... ``` ````).
    pub fn action(&self) -> Option<(String, String)> {
        let name = self.action.trim();
        (!name.is_empty()).then(|| {
            (
                name.to_owned(),
                unfenced(self.action_input.trim()).to_owned(),
            )
        })
    }

    /// Where the text after the reply's action begins, when more followed it: the reply
    /// kept in the conversation ends there, so that the action's observation follows the
    /// action it belongs to.
    pub fn action_end(&self) -> Option<usize> {
        self.action_end
    }

    /// Whether any marker appeared at all.
    pub fn saw_marker(&self) -> bool {
        self.saw_marker
    }

    /// The whole reply, when it had no marker at all (after [`Parser::finish`]): a model
    /// that ignores the protocol answers in plain text.
    pub fn unmarked(&self) -> Option<&str> {
        (!self.saw_marker).then_some(self.unmarked.as_str())
    }
}

/// `text` without the Markdown code fence around it, if it has one.
fn unfenced(text: &str) -> &str {
    let Some(fenced) = text.strip_prefix("```") else {
        return text;
    };
    // The opening line may name a language (```json).
    let Some((_, body)) = fenced.split_once('\n') else {
        return text;
    };
    body.trim_end().strip_suffix("```").unwrap_or(body).trim()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse(chunks: &[&str]) -> (Parser, String, String) {
        let mut parser = Parser::default();
        let mut out = Vec::new();
        for chunk in chunks {
            parser.push(chunk, &mut out);
        }
        parser.finish(&mut out);
        let mut thought = String::new();
        let mut answer = String::new();
        for piece in out {
            match piece {
                Segment::Thought(t) => thought.push_str(&t),
                Segment::Answer(a) => answer.push_str(&a),
            }
        }
        (parser, thought, answer)
    }

    #[test]
    fn actions_are_read_across_chunk_boundaries() {
        let (parser, thought, answer) = parse(&[
            "Thought: I need the calc",
            "ulator.\nAct",
            "ion: calculator\nAction In",
            "put: {\"expression\": \"6 * 7\"}\n",
        ]);
        assert_eq!(thought, "I need the calculator.\n");
        assert_eq!(answer, "");
        assert_eq!(
            parser.action(),
            Some(("calculator".into(), "{\"expression\": \"6 * 7\"}".into()))
        );
        assert!(!parser.answered());
    }

    #[test]
    fn a_round_makes_the_first_action_the_model_wrote() {
        let first =
            "Thought: first.\nAction: calculator\nAction Input: {\"expression\": \"1 + 1\"}\n";
        let (parser, thought, _) = parse(&[
            first,
            "Thought: and another.\nAction: calculator\nAction Input: {\"expression\": \"2 + 2\"}\n",
        ]);
        // The reply kept ends with the first action, and the reasoning for the second is
        // not streamed.
        assert_eq!(parser.action_end(), Some(first.len()));
        assert_eq!(thought, "first.\n");
        assert_eq!(
            parser.action(),
            Some(("calculator".into(), "{\"expression\": \"1 + 1\"}".into()))
        );
        let (parser, _, _) = parse(&["Action: calculator\nAction: sleep\nAction Input: {}\n"]);
        assert_eq!(parser.action(), Some(("sleep".into(), "{}".into())));
    }

    #[test]
    fn an_action_input_in_a_code_fence_is_read_out_of_it() {
        for input in [
            "```json\n{\"expression\": \"6 * 7\"}\n```",
            "```\n{\"expression\": \"6 * 7\"}\n```\n",
            "{\"expression\": \"6 * 7\"}",
        ] {
            let (parser, _, _) = parse(&[&format!("Action: calculator\nAction Input: {input}")]);
            assert_eq!(
                parser.action(),
                Some(("calculator".into(), "{\"expression\": \"6 * 7\"}".into())),
                "{input:?}"
            );
        }
    }

    #[test]
    fn the_final_answer_streams_as_answer() {
        let (parser, thought, answer) =
            parse(&["Thought: done.\nFinal An", "swer: It is", " 42.\nReally."]);
        assert_eq!(thought, "done.\n");
        assert_eq!(answer, "It is 42.\nReally.");
        assert!(parser.answered());
        assert_eq!(parser.answer(), "It is 42.\nReally.");
    }

    #[test]
    fn text_without_markers_is_held_back_and_given_once() {
        let (parser, thought, answer) = parse(&["Just some ", "text\nover lines"]);
        assert_eq!(thought, "", "not streamed as reasoning first");
        assert_eq!(answer, "");
        assert!(!parser.saw_marker());
        assert_eq!(parser.unmarked(), Some("Just some text\nover lines"));
        assert_eq!(parser.action(), None);
    }

    #[test]
    fn text_before_the_first_marker_is_reasoning() {
        let (parser, thought, answer) =
            parse(&["I should compute.\n", "Final Answer:", " ", " 42"]);
        assert_eq!(thought, "I should compute.\n");
        assert_eq!(answer, "42", "no stray leading space across chunks");
        assert_eq!(parser.unmarked(), None);
    }

    #[test]
    fn text_is_cut_at_the_stop_sequence_across_chunks() {
        let mut cut = StopCut::default();
        let mut kept = String::new();
        for chunk in [
            "Action: calculator\nAction Input: {}\nObs",
            "ervation: 42\nFinal Answer: 42",
        ] {
            kept.push_str(&cut.push(chunk));
        }
        kept.push_str(&cut.finish());
        assert_eq!(kept, "Action: calculator\nAction Input: {}\n");
        assert!(cut.stopped());
        // A held-back start that turns out not to be the stop sequence is passed on.
        let mut cut = StopCut::default();
        assert_eq!(cut.push("x Obs"), "x ");
        assert_eq!(cut.push("cure é"), "Obscure é");
        assert_eq!(cut.finish(), "");
        assert!(!cut.stopped());
    }

    #[test]
    fn the_prompt_lists_tools_with_schemas() {
        let tools = [ToolSpec {
            name: "calculator".into(),
            description: "math".into(),
            input_schema: serde_json::json!({"type": "object"}).into(),
            source: agentrt_core::ToolSource::Builtin,
        }];
        let text = instructions(&tools);
        assert!(text.contains("- calculator: math\n  Input schema: {\"type\":\"object\"}"));
        assert!(text.contains("one of [calculator]"));
        assert!(text.contains("Final Answer:"));
    }
}
