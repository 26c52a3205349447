//! A run as data: the state of one user turn between its steps, and the transitions that
//! model replies and tool results make. Nothing here does I/O or waits: the driver
//! (`Engine::drive`) asks [`RunState::next`] what to do, does it (calls the model, runs the
//! tools, publishes events) and feeds the result back, so that the state can be stored
//! between two steps and the run continued from it.

use std::sync::Arc;

use agentrt_context::{Exchange, TokenCounter};
use agentrt_core::ToolResult;
use agentrt_events::PendingCall;
use agentrt_models::{ChatMessage, ModelToolCall};
use serde::{Deserialize, Serialize};

use crate::{RunError, StopReason, strategy::Strategy};

/// The whole state of a run between two steps.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct RunState {
    /// This turn's messages so far, the user's query first, each with its token count.
    pub messages: Vec<(ChatMessage, u32)>,
    /// The last model round made; 0 before the first.
    pub iteration: u32,
    /// Rounds the model may call tools in.
    pub max_iterations: u32,
    /// What happens next.
    pub phase: Phase,
    /// The calls of the last tool round, to catch a model that repeats itself.
    previous_calls: Option<Vec<(String, String)>>,
    /// How many rounds in a row asked for exactly those calls.
    repeats: u32,
    /// How long the run has waited for answers, in milliseconds, not counting a wait
    /// under way: time that does not count against its time limit.
    #[serde(default)]
    pub waited_ms: u64,
    /// Whether the run has waited for answers: from then on it outlives the client of its
    /// `Execute`, also on the replica that takes it over.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub has_waited: bool,
}

/// Where a run is.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub enum Phase {
    /// The model is asked next, with tools.
    AskModel,
    /// The calls the model asked for in the last round run next.
    RunTools {
        /// The text the model wrote beside them.
        content: String,
        /// The calls.
        calls: Vec<ModelToolCall>,
    },
    /// Some calls of the last round wait for answers the run cannot produce itself
    /// (approvals, outputs of the caller's own tools); the others have their results.
    Waiting {
        /// The text the model wrote beside the calls.
        content: String,
        /// The calls.
        calls: Vec<ModelToolCall>,
        /// The result of each call, in call order; `None` for a call that waits.
        results: Vec<Option<CallResult>>,
        /// The calls that wait.
        pending: Vec<PendingCall>,
        /// When the wait began, in milliseconds since the Unix epoch (`u64::MAX` once it
        /// was answered and counted).
        since_ms: u64,
        /// Once answered: the calls approved, which run next (the others have their
        /// results).
        #[serde(default)]
        approved: Vec<String>,
    },
    /// Out of rounds (or stuck): the model is asked next for an answer, with no tool call allowed.
    AskFinal,
    /// The run has its outcome.
    Ended(Ending),
}

/// How a run ended.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub enum Ending {
    /// With an answer.
    Answered {
        /// The answer.
        answer: String,
        /// Why the run stopped.
        reason: StopReason,
    },
    /// Without one.
    Failed {
        /// Why the run stopped.
        reason: StopReason,
        /// What went wrong.
        error: RunError,
    },
}

/// What the driver does next.
#[derive(Debug, PartialEq)]
pub enum Step<'a> {
    /// Calls the model for round `iteration`, offering tools or not.
    Model {
        /// The round.
        iteration: u32,
        /// Whether tools are offered (not for the final request).
        with_tools: bool,
    },
    /// Runs these calls of the last round.
    Tools(&'a [ModelToolCall]),
    /// Goes on with the answers to the calls the run waited for.
    Answers {
        /// The round's calls.
        calls: &'a [ModelToolCall],
        /// Their results so far.
        results: &'a [Option<CallResult>],
        /// The calls that waited.
        pending: &'a [PendingCall],
    },
    /// Nothing: the run has ended.
    End(&'a Ending),
}

/// The result of a call, as a waiting run keeps it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct CallResult {
    /// What the model is given.
    pub output: String,
    /// Whether it failed.
    pub is_error: bool,
}

impl From<&ToolResult> for CallResult {
    fn from(result: &ToolResult) -> Self {
        Self {
            output: result.output.clone(),
            is_error: result.is_error,
        }
    }
}

/// What a model round produced, as the driver read it.
#[derive(Debug, Clone, PartialEq)]
pub enum Reply {
    /// An answer; `cut_short` when the model stopped at its token limit.
    Answer {
        /// The answer.
        text: String,
        /// Whether it was cut at the token limit.
        cut_short: bool,
    },
    /// Tool calls, and the text written before them.
    Tools {
        /// The text.
        content: String,
        /// The calls.
        calls: Vec<ModelToolCall>,
        /// Whether the reply was cut at the token limit (the text then answers, cut
        /// short, when it is the final round's).
        cut_short: bool,
    },
    /// A text reply that neither acts nor answers.
    Unreadable {
        /// The text.
        content: String,
    },
}

/// Calls of a reply that will not run, and why; the driver gives each its events.
#[derive(Debug, Clone, PartialEq)]
pub struct Refused {
    /// The calls.
    pub calls: Vec<ModelToolCall>,
    /// Why, as their results say.
    pub why: &'static str,
}

pub(crate) const REPEATED: &str = "not run: this exact call was already made twice with the same \
    arguments and returned the results above; answer from them";
pub(crate) const NO_MORE_CALLS: &str = "not run: no more tool calls are allowed in this run";

impl RunState {
    /// The state of a turn that asks `query`, with up to `max_iterations` tool rounds.
    pub fn new(query: &str, max_iterations: u32, counter: &TokenCounter) -> Self {
        let user = ChatMessage::User(query.to_owned());
        let tokens = counter.message(&user);
        Self {
            messages: vec![(user, tokens)],
            iteration: 0,
            max_iterations,
            phase: if max_iterations == 0 {
                Phase::AskFinal
            } else {
                Phase::AskModel
            },
            previous_calls: None,
            repeats: 0,
            waited_ms: 0,
            has_waited: false,
        }
    }

    /// How long the run has waited for answers, by `now_ms` (milliseconds since the Unix
    /// epoch), the wait under way included.
    pub fn waited(&self, now_ms: u64) -> std::time::Duration {
        let current = match &self.phase {
            Phase::Waiting { since_ms, .. } => now_ms.saturating_sub(*since_ms),
            _ => 0,
        };
        std::time::Duration::from_millis(self.waited_ms.saturating_add(current))
    }

    /// What the driver does next.
    pub fn next(&self) -> Step<'_> {
        match &self.phase {
            Phase::AskModel => Step::Model {
                iteration: self.iteration + 1,
                with_tools: true,
            },
            Phase::AskFinal => Step::Model {
                iteration: self.iteration + 1,
                with_tools: false,
            },
            Phase::RunTools { calls, .. } => Step::Tools(calls),
            Phase::Waiting {
                calls,
                results,
                pending,
                ..
            } => Step::Answers {
                calls,
                results,
                pending,
            },
            Phase::Ended(ending) => Step::End(ending),
        }
    }

    /// After a tool round or an unreadable reply: the next round, or the final request
    /// when the rounds are used up.
    fn after_round(&mut self) {
        self.phase = if self.iteration >= self.max_iterations {
            Phase::AskFinal
        } else {
            Phase::AskModel
        };
    }

    /// The model's reply to the round [`RunState::next`] asked for; calls that will not
    /// run come back for the driver to report.
    #[cfg(test)]
    pub(crate) fn model_replied(
        &mut self,
        iteration: u32,
        reply: Reply,
        strategy: &dyn Strategy,
        counter: &TokenCounter,
    ) -> Option<Refused> {
        self.model_replied_after(iteration, reply, strategy, counter, &[])
    }

    /// [`RunState::model_replied`], for a turn that comes after `history` in the prompt:
    /// the reply's calls get ids none of its calls has either.
    pub(crate) fn model_replied_after(
        &mut self,
        iteration: u32,
        reply: Reply,
        strategy: &dyn Strategy,
        counter: &TokenCounter,
        history: &[Arc<Exchange>],
    ) -> Option<Refused> {
        self.iteration = iteration;
        let mut reply = reply;
        if let Reply::Tools { calls, .. } = &mut reply {
            self.fresh_ids(calls, history);
        }
        let last = matches!(self.phase, Phase::AskFinal);
        match (last, reply) {
            (false, Reply::Answer { text, cut_short }) => {
                self.end_answered(text, cut_short, StopReason::FinalAnswer);
                None
            }
            (true, Reply::Answer { text, cut_short }) => {
                self.end_answered(text, cut_short, StopReason::MaxIterations);
                None
            }
            (false, Reply::Unreadable { content }) => {
                strategy.record_unreadable(&mut self.messages, content, counter);
                self.after_round();
                None
            }
            (false, Reply::Tools { content, calls, .. }) => {
                // A model that asks for the same calls round after round is stuck: its
                // calls do not run again, and it is asked for an answer.
                let signature: Vec<(String, String)> = calls
                    .iter()
                    .map(|c| (c.name.clone(), c.arguments.clone()))
                    .collect();
                if self.previous_calls.as_ref() == Some(&signature) {
                    self.repeats += 1;
                } else {
                    self.repeats = 0;
                }
                self.previous_calls = Some(signature);
                if self.repeats >= 2 {
                    // The round and its refusal go to the model with the final request, as
                    // the events and the record say: it answers knowing the calls did not
                    // run again.
                    let refusals = calls.iter().map(|_| ToolResult::error(REPEATED)).collect();
                    strategy.record_tools(&mut self.messages, content, &calls, refusals, counter);
                    self.phase = Phase::AskFinal;
                    return Some(Refused {
                        calls,
                        why: REPEATED,
                    });
                }
                self.phase = Phase::RunTools { content, calls };
                None
            }
            (
                true,
                Reply::Tools {
                    content,
                    calls,
                    cut_short,
                },
            ) => {
                // Allowed no call, it called some anyway: none runs. Text it wrote beside
                // them still answers, when the strategy streams it as an answer.
                match strategy.answer_beside_calls(content) {
                    Some(answer) => {
                        self.end_answered(answer, cut_short, StopReason::MaxIterations);
                    }
                    None => self.end_without_answer(),
                }
                Some(Refused {
                    calls,
                    why: NO_MORE_CALLS,
                })
            }
            (true, Reply::Unreadable { .. }) => {
                self.end_without_answer();
                None
            }
        }
    }

    /// Gives each call an id no earlier call of the turn, nor of the `history` before it,
    /// has. Clients answer calls by id over the whole run, and a model (or server) that
    /// numbers its calls anew in each round would otherwise let an answer to an earlier
    /// call, sent again, answer a later one: approve a call nobody approved, or give it
    /// another call's output; and providers that pair results with calls by id (Anthropic
    /// behind a proxy, chat templates) refuse a prompt with two calls of one id, as a
    /// server that numbers calls anew in each turn (`call_0`) would make the session's
    /// next. A reused id gets a suffix, the first free one from the round's number on
    /// (`call_0` of round 2 becomes `call_0_2`); the model sees its calls under the ids
    /// the events name.
    fn fresh_ids(&self, calls: &mut [ModelToolCall], history: &[Arc<Exchange>]) {
        // Looked up in place: a turn has a few dozen calls at most, and most rounds have
        // none to rename.
        let called = |message: &ChatMessage, id: &str| {
            matches!(message, ChatMessage::Assistant { tool_calls, .. }
                if tool_calls.iter().any(|call| call.id == id))
        };
        let earlier = |id: &str| {
            self.messages.iter().any(|(message, _)| called(message, id))
                || history
                    .iter()
                    .any(|exchange| exchange.messages.iter().any(|m| called(m, id)))
        };
        for at in 0..calls.len() {
            if !earlier(&calls[at].id) {
                continue;
            }
            let mut n = self.iteration;
            let id = loop {
                let id = format!("{}_{n}", calls[at].id);
                if !earlier(&id) && calls.iter().all(|c| c.id != id) {
                    break id;
                }
                n += 1;
            };
            calls[at].id = id;
        }
    }

    /// The results of the calls of [`Phase::RunTools`], in call order.
    pub(crate) fn tools_ran(
        &mut self,
        results: Vec<ToolResult>,
        strategy: &dyn Strategy,
        counter: &TokenCounter,
    ) {
        let Phase::RunTools { content, calls } =
            std::mem::replace(&mut self.phase, Phase::AskModel)
        else {
            return;
        };
        strategy.record_tools(&mut self.messages, content, &calls, results, counter);
        self.after_round();
    }

    /// Some calls of [`Phase::RunTools`] wait for answers: `results` has the others'.
    pub(crate) fn wait(
        &mut self,
        results: Vec<Option<CallResult>>,
        pending: Vec<PendingCall>,
        now_ms: u64,
    ) {
        let Phase::RunTools { content, calls } =
            std::mem::replace(&mut self.phase, Phase::AskModel)
        else {
            return;
        };
        self.phase = Phase::Waiting {
            content,
            calls,
            results,
            pending,
            since_ms: now_ms,
            approved: Vec::new(),
        };
        self.has_waited = true;
    }

    /// The answers of [`Phase::Waiting`] arrived: `results` has those of the calls that
    /// do not run, `to_run` names the approved calls.
    /// The wait ends at `now_ms`: the approved calls run after it, not in it.
    pub(crate) fn decided(
        &mut self,
        decided: Vec<Option<CallResult>>,
        to_run: &[String],
        now_ms: u64,
    ) {
        if let Phase::Waiting {
            results,
            approved,
            since_ms,
            ..
        } = &mut self.phase
        {
            *results = decided;
            *approved = to_run.to_vec();
            self.waited_ms = self
                .waited_ms
                .saturating_add(now_ms.saturating_sub(*since_ms));
            // Counted: nothing more of this wait is (see `waited` and `answered`).
            *since_ms = u64::MAX;
        }
    }

    /// The approved calls of [`Phase::Waiting`], once answered.
    pub(crate) fn approved(&self) -> &[String] {
        match &self.phase {
            Phase::Waiting { approved, .. } => approved,
            _ => &[],
        }
    }

    /// Every call of [`Phase::Waiting`] has its result now, in call order.
    pub(crate) fn answered(
        &mut self,
        results: Vec<ToolResult>,
        now_ms: u64,
        strategy: &dyn Strategy,
        counter: &TokenCounter,
    ) {
        let Phase::Waiting {
            content,
            calls,
            since_ms,
            ..
        } = std::mem::replace(&mut self.phase, Phase::AskModel)
        else {
            return;
        };
        self.waited_ms = self
            .waited_ms
            .saturating_add(now_ms.saturating_sub(since_ms));
        strategy.record_tools(&mut self.messages, content, &calls, results, counter);
        self.after_round();
    }

    /// Ends the run with a failure that is not the model's reply (a model error, a
    /// timeout): the step machine has nothing more to do.
    pub fn fail(&mut self, reason: StopReason, error: RunError) {
        self.phase = Phase::Ended(Ending::Failed { reason, error });
    }

    fn end_answered(&mut self, answer: String, cut_short: bool, reason: StopReason) {
        self.phase = Phase::Ended(Ending::Answered {
            answer,
            reason: if cut_short {
                StopReason::MaxTokens
            } else {
                reason
            },
        });
    }

    fn end_without_answer(&mut self) {
        self.fail(
            StopReason::ModelError,
            RunError {
                code: "MODEL_NO_ANSWER".into(),
                message: "asked for a final answer with no tool call allowed, the model wrote none"
                    .into(),
                category: "model",
                retryable: true,
            },
        );
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::strategy;

    fn call(id: &str, arguments: &str) -> ModelToolCall {
        ModelToolCall {
            id: id.into(),
            name: "calc".into(),
            arguments: arguments.into(),
        }
    }

    fn result(output: &str) -> ToolResult {
        ToolResult {
            output: output.into(),
            ..ToolResult::default()
        }
    }

    /// A run of at most one round, after that round: `content` and a call `call_id`,
    /// which answered "2".
    fn one_round_ran(strategy: &dyn Strategy, content: &str, call_id: &str) -> RunState {
        let counter = TokenCounter::shared();
        let mut state = RunState::new("q", 1, counter);
        state.model_replied(
            1,
            Reply::Tools {
                content: content.into(),
                calls: vec![call(call_id, "{}")],
                cut_short: false,
            },
            strategy,
            counter,
        );
        state.tools_ran(vec![result("2")], strategy, counter);
        state
    }

    /// A server that numbers its calls anew in each turn (`call_0`) gives the session's
    /// next turn a call of an id its history has: it gets another, as a call of an id
    /// the turn has does.
    #[test]
    fn a_call_gets_an_id_no_call_of_the_history_has() {
        let counter = TokenCounter::shared();
        let fc = strategy::of(agentrt_core::Strategy::FunctionCall);
        let history = Exchange::group(
            vec![
                ChatMessage::User("q0".into()),
                ChatMessage::Assistant {
                    content: String::new(),
                    tool_calls: vec![call("call_0", "{}"), call("call_0_1", "{}")],
                },
                ChatMessage::Tool {
                    call_id: "call_0".into(),
                    content: "1".into(),
                },
                ChatMessage::Tool {
                    call_id: "call_0_1".into(),
                    content: "1".into(),
                },
                ChatMessage::Assistant {
                    content: "done".into(),
                    tool_calls: Vec::new(),
                },
            ],
            counter,
        );
        let mut state = RunState::new("q1", 3, counter);
        state.model_replied_after(
            1,
            Reply::Tools {
                content: String::new(),
                calls: vec![call("call_0", "{}"), call("call_1", "{}")],
                cut_short: false,
            },
            fc,
            counter,
            &history,
        );
        let Phase::RunTools { calls, .. } = &state.phase else {
            panic!("{:?}", state.phase)
        };
        let ids: Vec<&str> = calls.iter().map(|c| c.id.as_str()).collect();
        assert_eq!(ids, ["call_0_2", "call_1"]);
    }

    #[test]
    fn a_wait_ends_when_it_is_answered_not_when_the_approved_calls_have_run() {
        let counter = TokenCounter::shared();
        let fc = strategy::of(agentrt_core::Strategy::FunctionCall);
        let mut state = RunState::new("6*7?", 3, counter);
        state.model_replied(
            1,
            Reply::Tools {
                content: String::new(),
                calls: vec![call("a", "{}")],
                cut_short: false,
            },
            fc,
            counter,
        );
        assert!(!state.has_waited);
        state.wait(vec![None], Vec::new(), 10_000);
        assert_eq!(state.waited(12_000).as_millis(), 2_000);
        state.decided(vec![None], &["a".to_owned()], 13_000);
        // The approved call runs for a minute: no part of the wait.
        assert_eq!(state.waited(73_000).as_millis(), 3_000);
        let mut state: RunState =
            serde_json::from_str(&serde_json::to_string(&state).unwrap()).unwrap();
        state.answered(vec![result("42")], 73_000, fc, counter);
        assert_eq!(state.waited(80_000).as_millis(), 3_000);
        // Gone on, it still says it waited (a replica that takes it over lets it outlive
        // its client), also as saved.
        let state: RunState =
            serde_json::from_str(&serde_json::to_string(&state).unwrap()).unwrap();
        assert!(state.has_waited);
    }

    #[test]
    fn a_tool_round_then_an_answer_and_the_state_survives_a_round_trip() {
        let counter = TokenCounter::shared();
        let fc = strategy::of(agentrt_core::Strategy::FunctionCall);
        let mut state = RunState::new("6*7?", 3, counter);
        assert_eq!(
            state.next(),
            Step::Model {
                iteration: 1,
                with_tools: true
            }
        );
        let refused = state.model_replied(
            1,
            Reply::Tools {
                content: String::new(),
                calls: vec![call("a", r#"{"x":1}"#)],
                cut_short: false,
            },
            fc,
            counter,
        );
        assert!(refused.is_none());
        assert_eq!(state.next(), Step::Tools(&[call("a", r#"{"x":1}"#)]));
        // Stored between steps and taken up elsewhere.
        let mut state: RunState =
            serde_json::from_str(&serde_json::to_string(&state).unwrap()).unwrap();
        state.tools_ran(vec![result("42")], fc, counter);
        assert_eq!(
            state.messages.len(),
            3,
            "user, assistant with the call, tool"
        );
        assert_eq!(
            state.next(),
            Step::Model {
                iteration: 2,
                with_tools: true
            }
        );
        state.model_replied(
            2,
            Reply::Answer {
                text: "42".into(),
                cut_short: false,
            },
            fc,
            counter,
        );
        assert_eq!(
            state.next(),
            Step::End(&Ending::Answered {
                answer: "42".into(),
                reason: StopReason::FinalAnswer
            })
        );
    }

    #[test]
    fn repeated_calls_are_refused_and_the_last_round_has_no_tools() {
        let counter = TokenCounter::shared();
        let fc = strategy::of(agentrt_core::Strategy::FunctionCall);
        let mut state = RunState::new("q", 10, counter);
        for iteration in 1..=2 {
            let refused = state.model_replied(
                iteration,
                Reply::Tools {
                    content: String::new(),
                    calls: vec![call("a", "{}")],
                    cut_short: false,
                },
                fc,
                counter,
            );
            assert!(refused.is_none());
            state.tools_ran(vec![result("same")], fc, counter);
        }
        let refused = state
            .model_replied(
                3,
                Reply::Tools {
                    content: String::new(),
                    calls: vec![call("a", "{}")],
                    cut_short: false,
                },
                fc,
                counter,
            )
            .expect("the third identical round is refused");
        assert_eq!(refused.why, REPEATED);
        // The model is told: its refused round and the refusal are in what it reads next.
        assert!(
            matches!(&state.messages.last().unwrap().0, ChatMessage::Tool { content, .. } if content == REPEATED),
            "{:?}",
            state.messages.last()
        );
        assert_eq!(
            state.next(),
            Step::Model {
                iteration: 4,
                with_tools: false
            }
        );
        state.model_replied(
            4,
            Reply::Answer {
                text: "done".into(),
                cut_short: false,
            },
            fc,
            counter,
        );
        assert!(matches!(
            state.next(),
            Step::End(Ending::Answered {
                reason: StopReason::MaxIterations,
                ..
            })
        ));
    }

    #[test]
    fn a_final_reply_cut_at_the_token_limit_beside_calls_says_so() {
        // Offered no tools, the model wrote text and called one anyway, and was cut at its
        // token limit: the text answers, cut short (it ended SUCCEEDED, max_iterations).
        let counter = TokenCounter::shared();
        let fc = strategy::of(agentrt_core::Strategy::FunctionCall);
        let mut state = one_round_ran(fc, "", "a");
        let refused = state.model_replied(
            2,
            Reply::Tools {
                content: "x".into(),
                calls: vec![call("b", "{}")],
                cut_short: true,
            },
            fc,
            counter,
        );
        assert_eq!(refused.map(|r| r.why), Some(NO_MORE_CALLS));
        assert_eq!(
            state.next(),
            Step::End(&Ending::Answered {
                answer: "x".into(),
                reason: StopReason::MaxTokens
            })
        );
    }

    #[test]
    fn react_keeps_one_observation_and_a_final_reply_that_acts_has_no_answer() {
        let counter = TokenCounter::shared();
        let react = strategy::of(agentrt_core::Strategy::React);
        let mut state = one_round_ran(react, "Thought: add\nAction: calc", "react_1");
        assert!(
            matches!(&state.messages[2].0, ChatMessage::User(text) if text == "Observation: 2")
        );
        let refused = state.model_replied(
            2,
            Reply::Tools {
                content: "Action: calc".into(),
                calls: vec![call("react_2", "{}")],
                cut_short: false,
            },
            react,
            counter,
        );
        assert_eq!(refused.map(|r| r.why), Some(NO_MORE_CALLS));
        assert!(matches!(
            state.next(),
            Step::End(Ending::Failed {
                reason: StopReason::ModelError,
                ..
            })
        ));
    }

    #[test]
    fn a_call_id_used_in_an_earlier_round_is_made_new() {
        let counter = TokenCounter::shared();
        let native = strategy::of(agentrt_core::Strategy::FunctionCall);
        let mut state = RunState::new("q", 3, counter);
        let round = |ids: &[&str]| Reply::Tools {
            content: String::new(),
            calls: ids.iter().map(|id| call(id, "{}")).collect(),
            cut_short: false,
        };
        state.model_replied(1, round(&["c", "d"]), native, counter);
        state.tools_ran(vec![result("1"), result("2")], native, counter);
        // `c` is taken, and so is its first free name in round 2 by a call of the round.
        state.model_replied(2, round(&["c", "c_2", "e"]), native, counter);
        let Step::Tools(calls) = state.next() else {
            panic!("the calls run next")
        };
        let ids: Vec<&str> = calls.iter().map(|c| c.id.as_str()).collect();
        assert_eq!(ids, ["c_3", "c_2", "e"]);
        state.tools_ran(vec![result("3"), result("4"), result("5")], native, counter);
        // The conversation names each call as the events did.
        let Some((ChatMessage::Assistant { tool_calls, .. }, _)) = state.messages.get(4) else {
            panic!("round 2 is in the conversation: {:?}", state.messages)
        };
        assert_eq!(tool_calls[0].id, "c_3");
        assert!(matches!(
            &state.messages[5].0,
            ChatMessage::Tool { call_id, .. } if call_id == "c_3"
        ));
        state.model_replied(3, round(&["c", "c_3"]), native, counter);
        let Step::Tools(calls) = state.next() else {
            panic!("the calls run next")
        };
        let ids: Vec<&str> = calls.iter().map(|c| c.id.as_str()).collect();
        assert_eq!(ids, ["c_4", "c_3_3"]);
    }
}
