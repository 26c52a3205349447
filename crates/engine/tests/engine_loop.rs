//! The engine loop against a scripted model and tool runner.

#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::{
    collections::VecDeque,
    sync::{
        Arc, Mutex,
        atomic::{AtomicUsize, Ordering},
    },
    time::Duration,
};

use agentrt_context::{InMemorySessionStore, SessionLimits};
use agentrt_core::{
    AgentConfig, ContextBudget, ModelSelection, Strategy, Timeouts, ToolInvocation, ToolResult,
    ToolRunner, ToolSource, ToolSpec,
};
use agentrt_engine::{Engine, RunControl, RunSpec, RunStatus, StopReason};
use agentrt_events::{BusLimits, EventBus, EventKind, InMemoryBus, RunEvent};
use agentrt_models::{
    ChatDelta, ChatMessage, ChatModel, ChatModels, ChatRequest, ChatStream, FinishReason,
    ModelError, ModelToolCall, Usage,
};
use agentrt_state::{MemoryRunStore, RunRetention, RunStore};
use futures_util::StreamExt;
use serde_json::json;
use tokio_util::sync::CancellationToken;

/// Plays scripted rounds in order and records the requests.
#[derive(Default)]
struct Scripted {
    rounds: Mutex<VecDeque<Result<Vec<ChatDelta>, ModelError>>>,
    requests: Mutex<Vec<ChatRequest>>,
    hang: bool,
    /// Hang from this call on (0 is the first).
    hang_from: Option<usize>,
    /// What the stream of the last scripted round does after its deltas: ends (`None`),
    /// breaks with this error, or (`Some(None)`) never ends.
    then: Option<Option<ModelError>>,
}

#[async_trait::async_trait]
impl ChatModel for Scripted {
    async fn stream(
        &self,
        request: ChatRequest,
        _cancel: CancellationToken,
    ) -> Result<ChatStream, ModelError> {
        let call = {
            let mut requests = self.requests.lock().unwrap();
            requests.push(request);
            requests.len() - 1
        };
        if self.hang || self.hang_from.is_some_and(|from| call >= from) {
            std::future::pending::<()>().await;
        }
        let (round, last) = {
            let mut rounds = self.rounds.lock().unwrap();
            let round = rounds
                .pop_front()
                .unwrap_or_else(|| Ok(answer("out of script")));
            (round, rounds.is_empty())
        };
        let deltas = futures_util::stream::iter(round?.into_iter().map(Ok));
        Ok(match self.then.clone().filter(|_| last) {
            None => Box::pin(deltas),
            Some(Some(error)) => Box::pin(deltas.chain(futures_util::stream::iter([Err(error)]))),
            Some(None) => Box::pin(deltas.chain(futures_util::stream::pending())),
        })
    }
}

fn answer(text: &str) -> Vec<ChatDelta> {
    vec![
        ChatDelta::Content(text[..text.len() / 2].to_owned()),
        ChatDelta::Content(text[text.len() / 2..].to_owned()),
        ChatDelta::Finish {
            reason: FinishReason::Stop,
            usage: Some(Usage {
                prompt_tokens: 10,
                completion_tokens: 5,
            }),
        },
    ]
}

fn call(id: &str, name: &str, arguments: &str) -> ChatDelta {
    ChatDelta::ToolCall(ModelToolCall {
        id: id.into(),
        name: name.into(),
        arguments: arguments.into(),
    })
}

fn tools_round(calls: Vec<ChatDelta>) -> Vec<ChatDelta> {
    let mut deltas = vec![ChatDelta::Reasoning("thinking".into())];
    deltas.extend(calls);
    deltas.push(ChatDelta::Finish {
        reason: FinishReason::ToolCalls,
        usage: Some(Usage {
            prompt_tokens: 7,
            completion_tokens: 3,
        }),
    });
    deltas
}

/// A model that asks for `calls` in its first round and answers "done" in the next.
fn calls_then_done(calls: Vec<ChatDelta>) -> Scripted {
    Scripted {
        rounds: Mutex::new(VecDeque::from([Ok(tools_round(calls)), Ok(answer("done"))])),
        ..Default::default()
    }
}

/// Answers `echo:<arguments>` after a delay taken from the `delay_ms` argument, counting
/// calls in flight and those dropped before finishing.
#[derive(Default)]
struct Tools {
    running: AtomicUsize,
    peak: AtomicUsize,
    abandoned: Arc<AtomicUsize>,
}

struct Abandon(Arc<AtomicUsize>, bool);
impl Drop for Abandon {
    fn drop(&mut self) {
        if !self.1 {
            self.0.fetch_add(1, Ordering::SeqCst);
        }
    }
}

#[async_trait::async_trait]
impl ToolRunner for Tools {
    async fn run(&self, call: ToolInvocation, _timeout: Duration) -> ToolResult {
        let now = self.running.fetch_add(1, Ordering::SeqCst) + 1;
        self.peak.fetch_max(now, Ordering::SeqCst);
        let mut guard = Abandon(self.abandoned.clone(), false);
        let delay = call.arguments["delay_ms"].as_u64().unwrap_or(0);
        tokio::time::sleep(Duration::from_millis(delay)).await;
        guard.1 = true;
        self.running.fetch_sub(1, Ordering::SeqCst);
        if let Some(titles) = call.arguments["refs"].as_array() {
            return ToolResult {
                output: "found".into(),
                references: titles
                    .iter()
                    .map(|t| agentrt_core::Reference {
                        title: t.as_str().unwrap().to_owned(),
                        snippet: format!("about {}", t.as_str().unwrap()),
                        ..Default::default()
                    })
                    .collect(),
                ..ToolResult::default()
            };
        }
        if let Some(size) = call.arguments["output_bytes"].as_u64() {
            // Multi-byte characters, so that a cut must find a character boundary.
            return ToolResult {
                output: "é".repeat(size as usize / 2),
                ..ToolResult::default()
            };
        }
        ToolResult {
            output: format!("echo:{}", call.arguments),
            ..ToolResult::default()
        }
    }
}

fn config(strategy: Strategy, tools: &[&str]) -> AgentConfig {
    AgentConfig {
        name: "t".into(),
        system_prompt: "be brief".into(),
        model: ModelSelection {
            provider: "p".into(),
            name: "m".into(),
            temperature: None,
            max_tokens: None,
        },
        rerank_model: None,
        strategy,
        max_iterations: 4,
        tools: tools.iter().map(|t| (*t).to_owned()).collect(),
        approval: Vec::new(),
        client_tools: Vec::new(),
        parallel_tool_calls: true,
        max_parallel_tool_calls: 2,
        context: ContextBudget {
            max_prompt_tokens: 8192,
        },
        timeouts: Timeouts::default(),
    }
}

fn spec_tool(name: &str) -> ToolSpec {
    ToolSpec {
        name: name.into(),
        description: "echo".into(),
        input_schema: json!({"type": "object"}).into(),
        source: ToolSource::Builtin,
    }
}

fn spec(run_id: &str, config: AgentConfig) -> RunSpec {
    RunSpec {
        run_id: run_id.into(),
        engine_id: "e".into(),
        session_id: "s".into(),
        message_id: run_id.into(),
        query: "what is 6 * 7?".into(),
        llm_context: None,
        tools: config.tools.iter().map(|t| spec_tool(t)).collect(),
        config: Arc::new(config),
    }
}

struct Harness {
    engine: Engine,
    model: Arc<Scripted>,
    tools: Arc<Tools>,
    bus: InMemoryBus,
    store: Arc<MemoryRunStore>,
}

fn harness(model: Scripted) -> Harness {
    let model = Arc::new(model);
    let tools = Arc::new(Tools::default());
    let mut models = ChatModels::default();
    models.insert("p", model.clone());
    let sessions = Arc::new(InMemorySessionStore::new(SessionLimits::default()));
    Harness {
        engine: Engine::new(models, tools.clone(), sessions),
        model,
        tools,
        bus: InMemoryBus::new(BusLimits::default()),
        store: Arc::new(MemoryRunStore::new(RunRetention::unbounded(
            Duration::from_secs(600),
            Duration::from_secs(10),
        ))),
    }
}

impl Harness {
    async fn run(
        &self,
        run_id: &str,
        config: AgentConfig,
        control: Arc<RunControl>,
    ) -> (Vec<Arc<RunEvent>>, agentrt_engine::RunRecord) {
        let spec = spec(run_id, config);
        let publisher = self.bus.open(run_id, "").await.unwrap();
        let reader = self.bus.subscribe(run_id, 0).await.unwrap();
        self.engine
            .start(spec, "", publisher, self.store.clone(), control)
            .await
            .unwrap()
            .run()
            .await;
        let events = reader.map(Result::unwrap).collect().await;
        (events, self.store.load(run_id).await.unwrap().unwrap())
    }
}

fn kinds(events: &[Arc<RunEvent>]) -> Vec<EventKind> {
    events.iter().map(|e| e.kind).collect()
}

fn assert_well_formed(events: &[Arc<RunEvent>]) {
    for (i, event) in events.iter().enumerate() {
        assert_eq!(event.sequence, i as u64 + 1, "sequences have no gaps");
        assert_eq!(
            event.done,
            i == events.len() - 1,
            "exactly one done event, last"
        );
    }
}

#[tokio::test]
async fn a_tool_using_run_streams_every_step_and_ends_once() {
    let h = harness(Scripted {
        rounds: Mutex::new(VecDeque::from([
            Ok(tools_round(vec![call("c1", "calc", r#"{"x":1}"#)])),
            Ok(answer("It is 42.")),
        ])),
        ..Default::default()
    });
    let (events, record) = h
        .run(
            "r1",
            config(Strategy::FunctionCall, &["calc"]),
            Arc::default(),
        )
        .await;
    assert_well_formed(&events);
    use EventKind::*;
    assert_eq!(
        kinds(&events),
        [
            RunStarted,
            Thought,
            ToolCall,
            ToolResult,
            FinalAnswer,
            FinalAnswer,
            FinalAnswer
        ]
    );
    assert_eq!(
        events[0].data.as_ref().unwrap().to_json(),
        json!({"engine_id": "e", "agent": "t"})
    );
    assert_eq!(
        events[2].data.as_ref().unwrap().to_json()["arguments"],
        json!({"x": 1})
    );
    assert_eq!(
        events[3].data.as_ref().unwrap().to_json()["output"],
        "echo:{\"x\":1}"
    );
    assert_eq!((events[1].iteration, events[4].iteration), (1, 2));
    let done = events.last().unwrap().data.as_ref().unwrap().to_json();
    assert_eq!(done["stop_reason"], "final_answer");
    assert_eq!(done["usage"]["total_tokens"], 25);
    assert_eq!(done["usage"]["estimated"], false);
    assert_eq!(record.status, RunStatus::Succeeded);
    assert_eq!(record.final_answer, "It is 42.");
    assert_eq!(record.steps.len(), 2);
    assert_eq!(record.steps[0].tool_calls[0].output, "echo:{\"x\":1}");

    // The second request carries the call and its result.
    let requests = h.model.requests.lock().unwrap();
    let last = requests[1].messages.clone();
    assert!(
        matches!(&last[last.len() - 2], ChatMessage::Assistant { tool_calls, .. } if tool_calls[0].id == "c1")
    );
    assert!(matches!(&last[last.len() - 1], ChatMessage::Tool { call_id, .. } if call_id == "c1"));
}

#[tokio::test(start_paused = true)]
async fn parallel_calls_run_under_the_cap_and_return_in_call_order() {
    let h = harness(calls_then_done(vec![
        call("a", "calc", r#"{"delay_ms":300}"#),
        call("b", "calc", r#"{"delay_ms":100}"#),
        call("c", "calc", r#"{"delay_ms":100}"#),
    ]));
    let (events, _) = h
        .run(
            "r",
            config(Strategy::FunctionCall, &["calc"]),
            Arc::default(),
        )
        .await;
    assert_eq!(
        h.tools.peak.load(Ordering::SeqCst),
        2,
        "at most max_parallel_tool_calls at once"
    );
    assert_eq!(
        call_ids(&events, EventKind::ToolResult),
        ["b", "c", "a"],
        "results are published as they complete"
    );
    let requests = h.model.requests.lock().unwrap();
    assert_eq!(
        result_ids(&requests[1]),
        ["a", "b", "c"],
        "results reach the model in call order"
    );
}

#[tokio::test]
async fn calls_of_a_round_under_one_id_or_none_get_ids_of_their_own() {
    let h = harness(calls_then_done(vec![
        call("d", "calc", r#"{"delay_ms":1}"#),
        call("d", "calc", r#"{"delay_ms":2}"#),
        call("", "calc", r#"{"delay_ms":3}"#),
        call("d_1", "calc", r#"{"delay_ms":4}"#),
    ]));
    let (events, _) = h
        .run(
            "r",
            config(Strategy::FunctionCall, &["calc"]),
            Arc::default(),
        )
        .await;
    assert_well_formed(&events);
    let expected = ["d", "d_1", "call_2", "d_1_3"];
    assert_eq!(call_ids(&events, EventKind::ToolCall), expected);
    let mut results = call_ids(&events, EventKind::ToolResult);
    results.sort();
    assert_eq!(results, ["call_2", "d", "d_1", "d_1_3"]);
    let requests = h.model.requests.lock().unwrap();
    assert_eq!(result_ids(&requests[1]), expected);
}

/// The call ids of the run's events of `kind` (TOOL_CALL or TOOL_RESULT), in order.
fn call_ids(events: &[Arc<RunEvent>], kind: EventKind) -> Vec<String> {
    events
        .iter()
        .filter(|e| e.kind == kind)
        .map(|e| {
            e.data.as_ref().unwrap().to_json()["id"]
                .as_str()
                .unwrap()
                .to_owned()
        })
        .collect()
}

/// The call ids of the tool results a model request carries, in order.
fn result_ids(request: &ChatRequest) -> Vec<&str> {
    request
        .messages
        .iter()
        .filter_map(|m| match m {
            ChatMessage::Tool { call_id, .. } => Some(call_id.as_str()),
            _ => None,
        })
        .collect()
}

#[tokio::test]
async fn bad_calls_become_results_the_model_can_read() {
    let h = harness(Scripted {
        rounds: Mutex::new(VecDeque::from([
            Ok(tools_round(vec![
                call("a", "calc", r#"{"x": "#),
                call("b", "rm_rf", "{}"),
                call("c", "calc", "[1]"),
            ])),
            Ok(answer("sorry")),
        ])),
        ..Default::default()
    });
    let (events, record) = h
        .run(
            "r",
            config(Strategy::FunctionCall, &["calc"]),
            Arc::default(),
        )
        .await;
    assert_eq!(record.status, RunStatus::Succeeded);
    let results: Vec<serde_json::Value> = events
        .iter()
        .filter(|e| e.kind == EventKind::ToolResult)
        .map(|e| e.data.as_ref().unwrap().to_json())
        .collect();
    assert_eq!(results.len(), 3);
    assert!(results.iter().all(|r| r["is_error"] == true));
    assert!(
        results[0]["output"]
            .as_str()
            .unwrap()
            .contains("not valid JSON")
    );
    assert!(
        results[1]["output"]
            .as_str()
            .unwrap()
            .contains("not available to this agent")
    );
    assert!(
        results[2]["output"]
            .as_str()
            .unwrap()
            .contains("must be a JSON object")
    );
    assert_eq!(
        h.tools.peak.load(Ordering::SeqCst),
        0,
        "no bad call reached the tools"
    );
    assert_eq!(
        events[2].data.as_ref().unwrap().to_json()["arguments"],
        serde_json::json!({"raw": r#"{"x": "#}),
        "truncated arguments are shown raw, in an object as all arguments are"
    );
}

#[tokio::test]
async fn max_iterations_ends_with_a_tool_less_answer() {
    let rounds = (0..4).map(|i| {
        Ok(tools_round(vec![call(
            &format!("c{i}"),
            "calc",
            &format!(r#"{{"i":{i}}}"#),
        )]))
    });
    let h = harness(Scripted {
        rounds: Mutex::new(rounds.chain([Ok(answer("best effort"))]).collect()),
        ..Default::default()
    });
    let (events, record) = h
        .run(
            "r",
            config(Strategy::FunctionCall, &["calc"]),
            Arc::default(),
        )
        .await;
    assert_eq!(
        events.last().unwrap().data.as_ref().unwrap().to_json()["stop_reason"],
        "max_iterations"
    );
    assert_eq!(record.stop_reason, Some(StopReason::MaxIterations));
    assert_eq!(record.final_answer, "best effort");
    let requests = h.model.requests.lock().unwrap();
    assert_eq!(requests.len(), 5);
    // The last call offers the tools as the others did (a provider refusing calls in a
    // conversation without tools accepts it), and no call.
    assert_eq!(requests[4].tools, requests[3].tools);
    assert!(!requests[4].tools.is_empty());
    assert!(requests[4].no_calls, "the last call allows no call");
    assert!(requests[..4].iter().all(|r| !r.no_calls));
}

#[tokio::test]
async fn a_model_repeating_itself_is_stopped() {
    let same = || Ok(tools_round(vec![call("c", "calc", r#"{"i":1}"#)]));
    let h = harness(Scripted {
        rounds: Mutex::new(VecDeque::from([same(), same(), same(), Ok(answer("ok"))])),
        ..Default::default()
    });
    let mut cfg = config(Strategy::FunctionCall, &["calc"]);
    cfg.max_iterations = 50;
    let (events, record) = h.run("r", cfg, Arc::default()).await;
    assert_eq!(
        h.model.requests.lock().unwrap().len(),
        4,
        "three identical rounds, then the final answer"
    );
    assert_eq!(record.stop_reason, Some(StopReason::MaxIterations));
    assert_eq!(record.final_answer, "ok");
    // The third round's call did not run, but it has its events, saying so.
    let calls = events
        .iter()
        .filter(|e| e.kind == EventKind::ToolCall)
        .count();
    let results: Vec<_> = events
        .iter()
        .filter(|e| e.kind == EventKind::ToolResult)
        .map(|e| e.data.as_ref().unwrap().to_json())
        .collect();
    assert_eq!((calls, results.len()), (3, 3));
    assert_eq!(
        h.tools.peak.load(Ordering::SeqCst),
        1,
        "two calls ran, one at a time"
    );
    assert_eq!(results[2]["is_error"], true);
    assert!(
        results[2]["output"]
            .as_str()
            .unwrap()
            .starts_with("not run")
    );
    // The iteration count matches the events: three tool rounds and the answer's.
    let done = events.last().unwrap();
    assert_eq!(done.iteration, 4);
    assert_eq!(done.data.as_ref().unwrap().to_json()["iterations"], 4);
    assert_eq!(
        events.iter().map(|e| e.iteration).max(),
        Some(4),
        "no event claims a round that did not happen"
    );
}

/// A run's control, cancelled after `delay`.
fn cancelled_after(delay: Duration) -> Arc<RunControl> {
    let control = Arc::new(RunControl::default());
    let stopper = control.clone();
    tokio::spawn(async move {
        tokio::time::sleep(delay).await;
        stopper.stop(StopReason::Cancelled);
    });
    control
}

#[tokio::test(start_paused = true)]
async fn cancelling_stops_running_tools_at_once() {
    let h = harness(Scripted {
        rounds: Mutex::new(VecDeque::from([Ok(tools_round(vec![call(
            "a",
            "calc",
            r#"{"delay_ms":100000}"#,
        )]))])),
        ..Default::default()
    });
    let control = cancelled_after(Duration::from_millis(50));
    let started = tokio::time::Instant::now();
    let (events, record) = h
        .run("r", config(Strategy::FunctionCall, &["calc"]), control)
        .await;
    assert!(started.elapsed() < Duration::from_millis(100));
    assert_eq!(
        h.tools.abandoned.load(Ordering::SeqCst),
        1,
        "the tool call was dropped"
    );
    let done = events.last().unwrap();
    assert_eq!(done.kind, EventKind::Error);
    assert_eq!(
        done.data.as_ref().unwrap().to_json()["stop_reason"],
        "cancelled"
    );
    assert_eq!(record.status, RunStatus::Cancelled);
    assert_well_formed(&events);
}

#[tokio::test(start_paused = true)]
async fn timeouts_end_runs_and_model_calls() {
    let h = harness(Scripted {
        hang: true,
        ..Default::default()
    });
    let mut cfg = config(Strategy::FunctionCall, &[]);
    cfg.timeouts = Timeouts {
        run: Duration::from_secs(60),
        model_call: Duration::from_secs(5),
        tool_call: Duration::from_secs(5),
        ..Timeouts::default()
    };
    let (events, record) = h.run("r1", cfg.clone(), Arc::default()).await;
    assert_eq!(
        events.last().unwrap().data.as_ref().unwrap().to_json()["code"],
        "MODEL_TIMEOUT"
    );
    assert_eq!(record.stop_reason, Some(StopReason::Timeout));
    cfg.timeouts.run = Duration::from_secs(2);
    let (events, _) = h.run("r2", cfg, Arc::default()).await;
    assert_eq!(
        events.last().unwrap().data.as_ref().unwrap().to_json()["code"],
        "RUN_TIMEOUT"
    );
}

#[tokio::test]
async fn model_failures_end_the_run_with_an_error() {
    let h = harness(Scripted {
        rounds: Mutex::new(VecDeque::from([Err(ModelError::Http {
            status: 503,
            message: "down".into(),
            retry_after: None,
        })])),
        ..Default::default()
    });
    let (events, record) = h
        .run("r", config(Strategy::FunctionCall, &[]), Arc::default())
        .await;
    let data = events.last().unwrap().data.as_ref().unwrap().to_json();
    assert_eq!(data["code"], "MODEL_HTTP_503");
    assert_eq!(data["category"], "model");
    assert_eq!(data["retryable"], true);
    assert_eq!(record.status, RunStatus::Failed);
    // The provider refused the call: it used nothing, and nothing is estimated.
    assert_eq!(record.usage.prompt_tokens, 0, "{:?}", record.usage);
    assert!(!record.usage.estimated);
}

#[tokio::test]
async fn a_call_lost_after_the_provider_accepted_it_counts_its_prompt() {
    // Not reached: nothing used. Accepted, then lost before the answer: the prompt counts.
    for (error, counted) in [
        (ModelError::Connect("connection refused".into()), false),
        (
            ModelError::LostBeforeAnswer("the connection was lost before the answer began".into()),
            true,
        ),
    ] {
        let (events, record) = one_round(Err(error), Strategy::FunctionCall).await;
        assert_well_formed(&events);
        let done = events.last().unwrap().data.as_ref().unwrap().to_json();
        assert_eq!(done["code"], "MODEL_UNREACHABLE", "{done}");
        assert_eq!(done["usage"]["estimated"], counted, "{done}");
        assert_eq!(
            record.usage.prompt_tokens > 0,
            counted,
            "{:?}",
            record.usage
        );
    }
}

#[tokio::test]
async fn react_runs_parse_actions_and_feed_observations() {
    let text = |t: &str| {
        Ok(vec![
            ChatDelta::Content(t.into()),
            ChatDelta::Finish {
                reason: FinishReason::Stop,
                usage: None,
            },
        ])
    };
    let h = harness(Scripted {
        rounds: Mutex::new(VecDeque::from([
            text("Thought: use calc\nAction: calc\nAction Input: {\"x\": 2}\n"),
            text("Thought: got it\nFinal Answer: two"),
        ])),
        ..Default::default()
    });
    let (events, record) = h
        .run("r", config(Strategy::React, &["calc"]), Arc::default())
        .await;
    use EventKind::*;
    assert_eq!(
        kinds(&events),
        [
            RunStarted,
            Thought,
            ToolCall,
            ToolResult,
            Thought,
            FinalAnswer,
            FinalAnswer
        ]
    );
    assert_eq!(events[5].content, "two");
    assert_eq!(record.final_answer, "two");
    let requests = h.model.requests.lock().unwrap();
    assert_eq!(requests[0].stop, ["Observation:"]);
    assert!(requests[0].tools.is_empty());
    assert!(
        matches!(&requests[0].messages[0], ChatMessage::System(s) if s.contains("Action Input:"))
    );
    assert!(
        matches!(requests[1].messages.last().unwrap(), ChatMessage::User(o) if o.starts_with("Observation: echo:"))
    );
}

/// A ReAct run out of rounds is asked for its answer in the same user message as its last
/// observation: chat templates that hold roles to alternating (Llama 2, Mistral, Gemma)
/// refuse two user messages in a row.
#[tokio::test]
async fn react_asks_for_the_final_answer_without_two_user_messages_in_a_row() {
    let act = |i: usize| {
        Ok(vec![
            ChatDelta::Content(format!(
                "Thought: again\nAction: calc\nAction Input: {{\"x\": {i}}}\n"
            )),
            ChatDelta::Finish {
                reason: FinishReason::Stop,
                usage: None,
            },
        ])
    };
    let h = harness(Scripted {
        rounds: Mutex::new(
            (0..4)
                .map(act)
                .chain([Ok(vec![
                    ChatDelta::Content("Final Answer: best effort".into()),
                    ChatDelta::Finish {
                        reason: FinishReason::Stop,
                        usage: None,
                    },
                ])])
                .collect(),
        ),
        ..Default::default()
    });
    let (_, record) = h
        .run("r", config(Strategy::React, &["calc"]), Arc::default())
        .await;
    assert_eq!(record.stop_reason, Some(StopReason::MaxIterations));
    assert_eq!(record.final_answer, "best effort");
    let requests = h.model.requests.lock().unwrap();
    let last = requests.last().unwrap();
    for pair in last.messages.windows(2) {
        assert!(
            !matches!(pair, [ChatMessage::User(_), ChatMessage::User(_)]),
            "{:#?}",
            last.messages
        );
    }
    let Some(ChatMessage::User(asked)) = last.messages.last() else {
        panic!("{:#?}", last.messages)
    };
    assert!(asked.starts_with("Observation: "), "{asked}");
    assert!(asked.ends_with("followed by the answer."), "{asked}");
}

#[tokio::test]
async fn the_session_remembers_earlier_turns() {
    let h = harness(Scripted {
        rounds: Mutex::new(VecDeque::from([Ok(answer("first")), Ok(answer("second"))])),
        ..Default::default()
    });
    h.run("r1", config(Strategy::FunctionCall, &[]), Arc::default())
        .await;
    h.run("r2", config(Strategy::FunctionCall, &[]), Arc::default())
        .await;
    let requests = h.model.requests.lock().unwrap();
    let second = &requests[1].messages;
    assert!(
        second.contains(&ChatMessage::Assistant {
            content: "first".into(),
            tool_calls: vec![]
        }),
        "{second:?}"
    );
}

#[tokio::test(start_paused = true)]
async fn tool_calls_reach_readers_before_the_tool_returns() {
    let h = harness(Scripted {
        rounds: Mutex::new(VecDeque::from([
            Ok(tools_round(vec![call(
                "a",
                "calc",
                r#"{"delay_ms":60000}"#,
            )])),
            Ok(answer("ok")),
        ])),
        ..Default::default()
    });
    let publisher = h.bus.open("r", "").await.unwrap();
    let mut reader = h.bus.subscribe("r", 0).await.unwrap();
    let config = config(Strategy::FunctionCall, &["calc"]);
    let spec = spec("r", config);
    let started = h
        .engine
        .start(spec, "", publisher, h.store.clone(), Arc::default())
        .await
        .unwrap();
    let run = tokio::spawn(started.run());
    let started = tokio::time::Instant::now();
    let mut seen = Vec::new();
    while let Some(event) = reader.next().await {
        let event = event.unwrap();
        seen.push(event.kind);
        if event.kind == EventKind::ToolCall {
            break;
        }
    }
    assert_eq!(
        seen,
        [
            EventKind::RunStarted,
            EventKind::Thought,
            EventKind::ToolCall
        ]
    );
    assert!(
        started.elapsed() < Duration::from_secs(1),
        "the call was announced while the tool runs"
    );
    run.abort();
}

#[tokio::test]
async fn long_tool_outputs_are_cut_with_a_marker_before_the_model_sees_them() {
    let mut h = harness(calls_then_done(vec![
        call("big", "calc", r#"{"output_bytes":10000}"#),
        call("small", "calc", r#"{"output_bytes":100}"#),
    ]));
    h.engine = h.engine.with_max_tool_output_bytes(1001);
    let (events, record) = h
        .run(
            "r1",
            config(Strategy::FunctionCall, &["calc"]),
            Arc::default(),
        )
        .await;
    assert_well_formed(&events);
    let requests = h.model.requests.lock().unwrap();
    let outputs: Vec<&String> = requests[1]
        .messages
        .iter()
        .filter_map(|m| match m {
            ChatMessage::Tool { content, .. } => Some(content),
            _ => None,
        })
        .collect();
    assert_eq!(outputs.len(), 2);
    let (kept, marker) = outputs[0].split_once('\n').unwrap();
    assert_eq!(
        kept,
        "é".repeat(500),
        "cut at the character boundary before 1001 bytes"
    );
    assert_eq!(
        marker,
        "[tool output truncated: 9000 of 10000 bytes omitted]"
    );
    assert_eq!(*outputs[1], "é".repeat(50), "short outputs are untouched");
    // Clients see what the model saw.
    let step = &record.steps[0];
    assert_eq!(step.tool_calls[0].output, *outputs[0]);
}

#[tokio::test]
async fn a_turn_over_the_token_budget_sends_its_tool_results_shortened_not_whole() {
    let h = harness(calls_then_done(vec![call(
        "big",
        "calc",
        r#"{"output_bytes":40000}"#,
    )]));
    let mut config = config(Strategy::FunctionCall, &["calc"]);
    config.context.max_prompt_tokens = 2000;
    let (events, _) = h.run("r1", config, Arc::default()).await;
    assert_well_formed(&events);
    let requests = h.model.requests.lock().unwrap();
    let counter = agentrt_context::TokenCounter::shared();
    let sent: u32 = requests[1]
        .messages
        .iter()
        .map(|m| counter.message(m))
        .sum();
    assert!(
        sent <= 2000,
        "{sent} tokens of messages for a budget of 2000"
    );
    let output = requests[1]
        .messages
        .iter()
        .find_map(|m| match m {
            ChatMessage::Tool { call_id, content } if call_id == "big" => Some(content),
            _ => None,
        })
        .expect("the call keeps its result");
    assert!(output.starts_with("éé"), "{output:.20}");
    assert!(
        output.ends_with("left out to fit the context budget]"),
        "{output}"
    );
}

/// The request for a final answer, in the last round of a turn over its token budget, is
/// sent whole: it is what the round is for, and is not shortened as the turn's tool
/// results are.
#[tokio::test]
async fn the_final_request_is_sent_whole_in_a_turn_over_its_budget() {
    let h = harness(calls_then_done(vec![call("small", "calc", "{}")]));
    let mut config = config(Strategy::FunctionCall, &["calc"]);
    // A system prompt that takes nearly the whole budget: the turn is over it, and its
    // tool result is too short to shorten.
    config.system_prompt = "word ".repeat(1990);
    config.context.max_prompt_tokens = 2000;
    config.max_iterations = 1;
    let (events, record) = h.run("r1", config, Arc::default()).await;
    assert_well_formed(&events);
    assert_eq!(record.stop_reason, Some(StopReason::MaxIterations));
    let requests = h.model.requests.lock().unwrap();
    let last = requests.last().unwrap();
    assert!(last.no_calls, "the last round allows no call");
    let Some(ChatMessage::User(asked)) = last.messages.last() else {
        panic!("{:#?}", last.messages)
    };
    assert!(
        asked.starts_with("You have used all the steps you may take."),
        "{asked}"
    );
    assert!(!asked.contains("left out to fit"), "{asked}");
}

/// Run `r1`, started on replica `a.1` with leases of 50 ms and left there (`leave`: dropped,
/// its events ended by the bus, or forgotten, its log left open as a crash leaves it),
/// then taken over by `b.1`: its store, and what `b.1` took.
async fn taken_over(
    h: &Harness,
    leave: fn(agentrt_engine::StartedRun),
) -> (Arc<MemoryRunStore>, agentrt_state::Resumable) {
    let store = Arc::new(MemoryRunStore::new(RunRetention::unbounded(
        Duration::from_secs(600),
        Duration::from_millis(50),
    )));
    let publisher = h.bus.open("r1", "a.1").await.unwrap();
    let started = h
        .engine
        .start(
            spec("r1", config(Strategy::FunctionCall, &[])),
            "a.1",
            publisher,
            store.clone(),
            Arc::default(),
        )
        .await
        .unwrap();
    leave(started);
    tokio::time::sleep(Duration::from_millis(150)).await;
    let taken = store
        .take_over("r1", "b.1")
        .await
        .unwrap()
        .expect("its lease lapsed");
    (store, taken)
}

/// Checks that a take-over of `r1` ended it, failed, with one `done` event, and that
/// nobody takes it over again: its record.
async fn ended_by_take_over(
    h: &Harness,
    store: &MemoryRunStore,
    resumed: Result<agentrt_engine::StartedRun, agentrt_engine::RunError>,
) -> agentrt_engine::RunRecord {
    let error = resumed.err().expect("it is not continued");
    assert_eq!(error.code, "RUN_ENDED", "{error:?}");
    let record = store.load("r1").await.unwrap().unwrap();
    assert_eq!(
        (record.status, record.stop_reason),
        (RunStatus::Failed, Some(StopReason::InternalError))
    );
    assert!(h.model.requests.lock().unwrap().is_empty(), "no model call");
    let events: Vec<Arc<RunEvent>> = h
        .bus
        .subscribe("r1", 0)
        .await
        .unwrap()
        .map(Result::unwrap)
        .collect()
        .await;
    assert_eq!(events.iter().filter(|e| e.done).count(), 1, "{events:?}");
    assert!(store.take_over("r1", "c.1").await.unwrap().is_none());
    record
}

#[tokio::test]
async fn a_run_whose_log_has_its_done_is_not_continued_by_a_take_over() {
    let h = harness(Scripted::default());
    // Its first replica never runs it (its first write's answer was lost, say): dropped
    // unrun, its events end with the bus's own `done`.
    let (store, taken) = taken_over(&h, drop).await;
    let resumed = h
        .engine
        .resume(taken, false, &h.bus, store.clone(), Arc::default())
        .await;
    ended_by_take_over(&h, &store, resumed).await;
}

fn deltas_then(finish: FinishReason, usage: Option<Usage>, texts: &[&str]) -> Vec<ChatDelta> {
    let mut deltas: Vec<ChatDelta> = texts
        .iter()
        .map(|t| ChatDelta::Content((*t).to_owned()))
        .collect();
    deltas.push(ChatDelta::Finish {
        reason: finish,
        usage,
    });
    deltas
}

/// A run of an agent without tools whose model makes one reply, `round`.
async fn one_round(
    round: Result<Vec<ChatDelta>, ModelError>,
    strategy: Strategy,
) -> (Vec<Arc<RunEvent>>, agentrt_engine::RunRecord) {
    let h = harness(Scripted {
        rounds: Mutex::new(VecDeque::from([round])),
        ..Default::default()
    });
    h.run("r", config(strategy, &[]), Arc::default()).await
}

#[tokio::test]
async fn the_first_event_says_the_run_started_before_the_model_answers() {
    let h = harness(Scripted {
        hang: true,
        ..Default::default()
    });
    let publisher = h.bus.open("r", "").await.unwrap();
    let mut reader = h.bus.subscribe("r", 0).await.unwrap();
    let spec = spec("r", config(Strategy::FunctionCall, &[]));
    let started = h
        .engine
        .start(spec, "", publisher, h.store.clone(), Arc::default())
        .await
        .unwrap();
    let run = tokio::spawn(started.run());
    let first = tokio::time::timeout(Duration::from_secs(5), reader.next())
        .await
        .expect("the first event came while the model had not answered")
        .unwrap()
        .unwrap();
    assert_eq!(
        (first.kind, first.sequence, first.iteration),
        (EventKind::RunStarted, 1, 1)
    );
    run.abort();
}

#[tokio::test]
async fn an_empty_response_is_a_model_error_not_an_answer() {
    for empty in [
        deltas_then(FinishReason::Stop, None, &[]),
        deltas_then(FinishReason::Stop, None, &["  ", "\n"]),
        vec![
            ChatDelta::Reasoning("hmm".into()),
            ChatDelta::Finish {
                reason: FinishReason::Stop,
                usage: None,
            },
        ],
    ] {
        let (events, record) = one_round(Ok(empty), Strategy::FunctionCall).await;
        assert_well_formed(&events);
        let done = events.last().unwrap();
        assert_eq!(done.kind, EventKind::Error);
        let data = done.data.as_ref().unwrap().to_json();
        assert_eq!(data["stop_reason"], "model_error");
        assert_eq!(data["code"], "MODEL_EMPTY_RESPONSE");
        assert_eq!(record.status, RunStatus::Failed);
        assert_eq!(record.final_answer, "");
    }
}

#[tokio::test]
async fn a_react_reply_of_native_tool_calls_only_is_named_as_such() {
    let mut round = vec![call("c1", "calc", r#"{"expression":"6*7"}"#)];
    round.extend(deltas_then(FinishReason::ToolCalls, None, &[]));
    let h = harness(Scripted {
        rounds: Mutex::new(VecDeque::from([Ok(round)])),
        ..Default::default()
    });
    let (events, record) = h
        .run("r", config(Strategy::React, &["calc"]), Arc::default())
        .await;
    assert_well_formed(&events);
    // The calls do not run: no TOOL_CALL, no TOOL_RESULT.
    assert!(
        events
            .iter()
            .all(|e| !matches!(e.kind, EventKind::ToolCall | EventKind::ToolResult))
    );
    let done = events.last().unwrap();
    assert_eq!(done.kind, EventKind::Error);
    let data = done.data.as_ref().unwrap().to_json();
    assert_eq!(data["stop_reason"], "model_error");
    assert_eq!(data["code"], "MODEL_EMPTY_RESPONSE");
    let message = data["message"].as_str().unwrap();
    assert!(
        message.contains("only native tool calls (calc)") && message.contains("ReAct"),
        "{message}"
    );
    assert_eq!(record.status, RunStatus::Failed);

    // Text the stop-sequence cut still holds ("Obs" may begin "Observation:") is text: the
    // reply is read as one, not called calls only.
    let mut round = vec![call("c1", "calc", r#"{"expression":"6*7"}"#)];
    round.extend(deltas_then(FinishReason::ToolCalls, None, &["Obs"]));
    let (events, record) = one_round(Ok(round), Strategy::React).await;
    assert_well_formed(&events);
    let done = events.last().unwrap().data.as_ref().unwrap().to_json();
    assert!(
        !done["message"]
            .as_str()
            .unwrap_or_default()
            .contains("only native tool calls"),
        "{done}"
    );
    assert_eq!(record.final_answer, "Obs", "{done}");
}

#[tokio::test]
async fn a_token_limit_ends_with_the_partial_answer_and_says_so() {
    let h = harness(Scripted {
        rounds: Mutex::new(VecDeque::from([Ok(deltas_then(
            FinishReason::Length,
            Some(Usage {
                prompt_tokens: 3,
                completion_tokens: 4,
            }),
            &["The answer is", " forty"],
        ))])),
        ..Default::default()
    });
    let (events, record) = h
        .run("r", config(Strategy::FunctionCall, &[]), Arc::default())
        .await;
    let done = events.last().unwrap();
    assert_eq!(done.kind, EventKind::FinalAnswer);
    let data = done.data.as_ref().unwrap().to_json();
    assert_eq!(data["stop_reason"], "max_tokens");
    assert!(data["message"].as_str().unwrap().contains("cut short"));
    assert_eq!(record.stop_reason, Some(StopReason::MaxTokens));
    assert_eq!(record.status, RunStatus::Incomplete);
    assert_eq!(record.final_answer, "The answer is forty");

    // Cut before any answer text: a failure, with the same stop reason.
    let h = harness(Scripted {
        rounds: Mutex::new(VecDeque::from([Ok(deltas_then(
            FinishReason::Length,
            None,
            &[],
        ))])),
        ..Default::default()
    });
    let (events, record) = h
        .run("r", config(Strategy::FunctionCall, &[]), Arc::default())
        .await;
    assert_eq!(events.last().unwrap().kind, EventKind::Error);
    assert_eq!(record.stop_reason, Some(StopReason::MaxTokens));
    assert_eq!(record.status, RunStatus::Failed);
}

#[tokio::test]
async fn the_final_answer_is_the_done_rounds_answer_text_only() {
    let mut first = vec![ChatDelta::Content("Let me compute that. ".into())];
    first.extend(tools_round(vec![call("c1", "calc", r#"{"x":1}"#)]));
    let h = harness(Scripted {
        rounds: Mutex::new(VecDeque::from([
            Ok(first),
            Ok(deltas_then(FinishReason::Stop, None, &[" It is", " 42.\n"])),
        ])),
        ..Default::default()
    });
    let (events, record) = h
        .run(
            "r",
            config(Strategy::FunctionCall, &["calc"]),
            Arc::default(),
        )
        .await;
    let done = events.last().unwrap();
    let rule: String = events
        .iter()
        .filter(|e| e.kind == EventKind::FinalAnswer && e.iteration == done.iteration && !e.done)
        .map(|e| e.content.as_str())
        .collect();
    assert_eq!(rule, " It is 42.\n");
    assert_eq!(
        record.final_answer, rule,
        "GetRun's answer follows the rule exactly"
    );
}

#[tokio::test]
async fn usage_a_provider_did_not_report_is_counted_and_marked_estimated() {
    let h = harness(Scripted {
        rounds: Mutex::new(VecDeque::from([Ok(deltas_then(
            FinishReason::Stop,
            None,
            &["hello", " world"],
        ))])),
        ..Default::default()
    });
    let (events, record) = h
        .run("r", config(Strategy::FunctionCall, &[]), Arc::default())
        .await;
    let usage = &events.last().unwrap().data.as_ref().unwrap().to_json()["usage"];
    assert_eq!(usage["estimated"], true);
    assert_eq!(
        usage["completion_tokens"], 2,
        "\"hello world\" is two tokens"
    );
    assert!(usage["prompt_tokens"].as_u64().unwrap() > 5, "{usage}");
    assert!(record.usage.estimated);
}

#[tokio::test]
async fn a_huge_delta_goes_out_as_several_events_within_the_limit() {
    let big = "é".repeat(300 * 1024);
    let h = harness(Scripted {
        rounds: Mutex::new(VecDeque::from([Ok(deltas_then(
            FinishReason::Stop,
            None,
            &[&big],
        ))])),
        ..Default::default()
    });
    let (events, record) = h
        .run("r", config(Strategy::FunctionCall, &[]), Arc::default())
        .await;
    assert_well_formed(&events);
    let deltas: Vec<&Arc<RunEvent>> = events
        .iter()
        .filter(|e| e.kind == EventKind::FinalAnswer && !e.done)
        .collect();
    assert!(deltas.len() >= 10, "{}", deltas.len());
    assert!(deltas.iter().all(|e| e.content.len() <= 64 * 1024));
    let joined: String = deltas.iter().map(|e| e.content.as_str()).collect();
    assert_eq!(joined, big);
    assert_eq!(record.final_answer, big);
}

#[tokio::test]
async fn arguments_nested_too_deep_are_a_bad_call_the_model_reads() {
    let deep = format!("{}1{}", r#"{"a":"#.repeat(40), "}".repeat(40));
    let h = harness(Scripted {
        rounds: Mutex::new(VecDeque::from([
            Ok(tools_round(vec![call("d", "calc", &deep)])),
            Ok(answer("fine")),
        ])),
        ..Default::default()
    });
    let (events, _) = h
        .run(
            "r",
            config(Strategy::FunctionCall, &["calc"]),
            Arc::default(),
        )
        .await;
    let result = events
        .iter()
        .find(|e| e.kind == EventKind::ToolResult)
        .unwrap()
        .data
        .as_ref()
        .unwrap()
        .to_json();
    assert_eq!(result["is_error"], true);
    assert!(result["output"].as_str().unwrap().contains("nest deeper"));
    let call = events
        .iter()
        .find(|e| e.kind == EventKind::ToolCall)
        .unwrap();
    assert!(
        call.data.as_ref().unwrap().to_json()["arguments"]["raw"].is_string(),
        "the event carries the raw text, not a tree too deep to decode"
    );
    assert_eq!(h.tools.peak.load(Ordering::SeqCst), 0);
}

#[tokio::test]
async fn react_cuts_at_the_stop_sequence_when_the_server_does_not() {
    let h = harness(Scripted {
        rounds: Mutex::new(VecDeque::from([
            // A server that ignores `stop`: the model invents the observation and an answer.
            Ok(deltas_then(
                FinishReason::Stop,
                None,
                &[
                    "Thought: use calc\nAction: calc\nAction Input: {\"x\": 2}\nObserva",
                    "tion: 5\nFinal Answer: five",
                ],
            )),
            Ok(deltas_then(
                FinishReason::Stop,
                None,
                &["Thought: ok\nFinal Answer:", " four"],
            )),
        ])),
        ..Default::default()
    });
    let (events, record) = h
        .run("r", config(Strategy::React, &["calc"]), Arc::default())
        .await;
    assert_eq!(h.tools.peak.load(Ordering::SeqCst), 1, "the action ran");
    assert_eq!(
        record.final_answer, "four",
        "no stray leading space, no invented answer"
    );
    assert!(events.iter().all(|e| !e.content.contains("five")));
}

#[tokio::test]
async fn react_replies_without_markers_are_streamed_once_as_the_answer() {
    let h = harness(Scripted {
        rounds: Mutex::new(VecDeque::from([Ok(deltas_then(
            FinishReason::Stop,
            None,
            &["It is ", "42."],
        ))])),
        ..Default::default()
    });
    let (events, record) = h
        .run("r", config(Strategy::React, &["calc"]), Arc::default())
        .await;
    use EventKind::*;
    assert_eq!(kinds(&events), [RunStarted, FinalAnswer, FinalAnswer]);
    assert_eq!(events[1].content, "It is 42.");
    assert_eq!(record.final_answer, "It is 42.");
}

#[tokio::test]
async fn react_replies_that_neither_act_nor_answer_are_sent_back_with_a_reminder() {
    let h = harness(Scripted {
        rounds: Mutex::new(VecDeque::from([
            Ok(deltas_then(
                FinishReason::Stop,
                None,
                &["Thought: I wonder"],
            )),
            Ok(deltas_then(FinishReason::Stop, None, &["Final Answer: 42"])),
        ])),
        ..Default::default()
    });
    let (_, record) = h
        .run("r", config(Strategy::React, &["calc"]), Arc::default())
        .await;
    assert_eq!(record.final_answer, "42");
    let requests = h.model.requests.lock().unwrap();
    assert!(
        matches!(requests[1].messages.last().unwrap(), ChatMessage::User(o) if o.contains("Invalid format"))
    );
}

#[tokio::test]
async fn tool_calls_in_the_final_round_are_not_dropped_silently() {
    let rounds = (0..4).map(|i| {
        Ok(tools_round(vec![call(
            &format!("c{i}"),
            "calc",
            &format!(r#"{{"i":{i}}}"#),
        )]))
    });
    let mut last = vec![ChatDelta::Content("best effort".into())];
    last.extend(tools_round(vec![call("late", "calc", "{}")]));
    let h = harness(Scripted {
        rounds: Mutex::new(rounds.chain([Ok(last)]).collect()),
        ..Default::default()
    });
    let (events, record) = h
        .run(
            "r",
            config(Strategy::FunctionCall, &["calc"]),
            Arc::default(),
        )
        .await;
    let late: Vec<_> = events
        .iter()
        .filter_map(|e| e.data.as_ref().map(|d| d.to_json()))
        .filter(|d| d["id"] == "late")
        .collect();
    assert_eq!(late.len(), 2, "its call and its (refused) result");
    assert_eq!(late[1]["is_error"], true);
    assert_eq!(record.final_answer, "best effort");
    assert_eq!(record.stop_reason, Some(StopReason::MaxIterations));
}

/// Scores documents by a fixed table, or fails.
struct TableReranker(
    Result<Vec<f64>, ()>,
    Mutex<Vec<agentrt_models::RerankRequest>>,
);

#[async_trait::async_trait]
impl agentrt_models::Reranker for TableReranker {
    async fn rerank(
        &self,
        request: agentrt_models::RerankRequest,
        _cancel: CancellationToken,
    ) -> Result<Vec<agentrt_models::RerankResult>, ModelError> {
        self.1.lock().unwrap().push(request);
        let scores = self
            .0
            .clone()
            .map_err(|()| ModelError::Stream("reranker down".into()))?;
        let mut ranked: Vec<agentrt_models::RerankResult> = scores
            .into_iter()
            .enumerate()
            .map(|(index, relevance_score)| agentrt_models::RerankResult {
                index,
                relevance_score,
            })
            .collect();
        ranked.sort_by(|a, b| b.relevance_score.total_cmp(&a.relevance_score));
        Ok(ranked)
    }
}

async fn run_with_reranker(
    scores: Result<Vec<f64>, ()>,
) -> (
    Vec<Arc<RunEvent>>,
    agentrt_engine::RunRecord,
    Vec<agentrt_models::RerankRequest>,
) {
    let model = Arc::new(calls_then_done(vec![call(
        "c1",
        "search",
        r#"{"refs":["a","b","c"]}"#,
    )]));
    let reranker = Arc::new(TableReranker(scores, Mutex::default()));
    let mut models = ChatModels::default();
    models.insert("p", model);
    models.insert_reranker("p", reranker.clone());
    let sessions = Arc::new(InMemorySessionStore::new(SessionLimits::default()));
    let h = Harness {
        engine: Engine::new(models, Arc::new(Tools::default()), sessions),
        model: Arc::new(Scripted::default()),
        tools: Arc::new(Tools::default()),
        bus: InMemoryBus::new(BusLimits::default()),
        store: Arc::new(MemoryRunStore::new(RunRetention::unbounded(
            Duration::from_secs(600),
            Duration::from_secs(10),
        ))),
    };
    let mut cfg = config(Strategy::FunctionCall, &["search"]);
    cfg.rerank_model = Some(agentrt_core::RerankSelection {
        provider: "p".into(),
        name: "ranker".into(),
        top_n: 2,
        min_score: 0.3,
    });
    let (events, record) = h.run("r", cfg, Arc::default()).await;
    let requests = std::mem::take(&mut *reranker.1.lock().unwrap());
    (events, record, requests)
}

#[tokio::test]
async fn references_are_reranked_before_their_event() {
    let (events, record, requests) = run_with_reranker(Ok(vec![0.2, 0.9, 0.5])).await;
    assert_eq!(requests.len(), 1);
    assert_eq!(requests[0].query, "what is 6 * 7?");
    assert_eq!(requests[0].documents, ["about a", "about b", "about c"]);
    assert_eq!(requests[0].top_n, Some(2));
    let kinds: Vec<EventKind> = events.iter().map(|e| e.kind).collect();
    let result = kinds
        .iter()
        .position(|k| *k == EventKind::ToolResult)
        .unwrap();
    assert_eq!(
        kinds[result + 1],
        EventKind::References,
        "right after its result"
    );
    let data = events[result + 1].data.as_ref().unwrap().to_json();
    assert_eq!(data["tool_call_id"], "c1");
    assert_eq!(data["rerank"]["status"], "reranked");
    let titles: Vec<&str> = data["references"]
        .as_array()
        .unwrap()
        .iter()
        .map(|r| r["title"].as_str().unwrap())
        .collect();
    assert_eq!(titles, ["b", "c"], "top 2 above min_score, best first");
    assert_eq!(data["references"][0]["score"], 0.9);
    // GetRun keeps them on their call.
    let kept: Vec<&str> = record.steps[0].tool_calls[0]
        .references
        .iter()
        .map(|r| r.title.as_str())
        .collect();
    assert_eq!(kept, ["b", "c"]);
}

#[tokio::test]
async fn a_failing_reranker_does_not_fail_the_run() {
    let (events, record, _) = run_with_reranker(Err(())).await;
    assert_eq!(record.status, RunStatus::Succeeded);
    let data = events
        .iter()
        .find(|e| e.kind == EventKind::References)
        .unwrap()
        .data
        .as_ref()
        .unwrap()
        .to_json();
    assert_eq!(data["rerank"]["status"], "failed");
    assert!(
        data["rerank"]["error"]
            .as_str()
            .unwrap()
            .contains("reranker down")
    );
    let titles: Vec<&str> = data["references"]
        .as_array()
        .unwrap()
        .iter()
        .map(|r| r["title"].as_str().unwrap())
        .collect();
    assert_eq!(titles, ["a", "b", "c"], "the tool's order");
}

#[tokio::test]
async fn a_rerank_that_keeps_no_reference_still_says_so() {
    let (events, record, _) = run_with_reranker(Ok(vec![0.1, 0.2, 0.1])).await;
    let data = events
        .iter()
        .find(|e| e.kind == EventKind::References)
        .expect("the call's references event, empty")
        .data
        .as_ref()
        .unwrap()
        .to_json();
    assert_eq!(data["rerank"]["status"], "reranked");
    assert_eq!(data["references"], serde_json::json!([]));
    assert!(record.steps[0].tool_calls[0].references.is_empty());
}

#[tokio::test]
async fn a_model_call_a_failed_run_ends_during_counts_as_estimated_usage() {
    // The provider streams text, then its stream breaks: it never reports usage.
    let h = harness(Scripted {
        rounds: Mutex::new(VecDeque::from([Ok(vec![ChatDelta::Content(
            "the beginning of an answer".into(),
        )])])),
        then: Some(Some(ModelError::Incomplete("cut off".into()))),
        ..Default::default()
    });
    let (events, record) = h
        .run("r", config(Strategy::FunctionCall, &[]), Arc::default())
        .await;
    assert_well_formed(&events);
    let done = events.last().unwrap().data.as_ref().unwrap().to_json();
    assert_eq!(done["stop_reason"], "model_error", "{done}");
    let usage = &done["usage"];
    assert_eq!(usage["estimated"], true, "{usage}");
    assert!(usage["prompt_tokens"].as_u64().unwrap() > 5, "{usage}");
    assert!(usage["completion_tokens"].as_u64().unwrap() >= 4, "{usage}");
    assert!(record.usage.estimated);
    assert_eq!(
        record.usage.prompt_tokens,
        usage["prompt_tokens"].as_u64().unwrap()
    );
}

#[tokio::test(start_paused = true)]
async fn a_model_call_a_cancelled_run_ends_during_counts_as_estimated_usage() {
    // The first round is reported; the second streams text and is cancelled.
    let h = harness(Scripted {
        rounds: Mutex::new(VecDeque::from([
            Ok(tools_round(vec![call("a", "calc", "{}")])),
            Ok(vec![ChatDelta::Content("half of an".into())]),
        ])),
        then: Some(None),
        ..Default::default()
    });
    let control = cancelled_after(Duration::from_millis(50));
    let (events, record) = h
        .run("r", config(Strategy::FunctionCall, &["calc"]), control)
        .await;
    assert_well_formed(&events);
    let done = events.last().unwrap().data.as_ref().unwrap().to_json();
    assert_eq!(done["stop_reason"], "cancelled", "{done}");
    let usage = &done["usage"];
    assert_eq!(usage["estimated"], true, "{usage}");
    assert!(
        usage["prompt_tokens"].as_u64().unwrap() > 10,
        "both prompts count: {usage}"
    );
    assert!(
        usage["completion_tokens"].as_u64().unwrap() > 5,
        "the reported round and the cancelled one's text: {usage}"
    );
    assert!(record.usage.estimated);
}

#[tokio::test(start_paused = true)]
async fn a_model_call_that_never_answers_counts_its_prompt_as_estimated_usage() {
    // A first round reported, then a provider that takes the request and never answers
    // (not even its headers) until the model call's timeout.
    let h = harness(Scripted {
        rounds: Mutex::new(VecDeque::from([Ok(tools_round(vec![call(
            "a", "calc", "{}",
        )]))])),
        hang_from: Some(1),
        ..Default::default()
    });
    let mut cfg = config(Strategy::FunctionCall, &["calc"]);
    cfg.timeouts.model_call = Duration::from_secs(5);
    let (events, record) = h.run("r", cfg, Arc::default()).await;
    assert_well_formed(&events);
    let done = events.last().unwrap().data.as_ref().unwrap().to_json();
    assert_eq!(done["code"], "MODEL_TIMEOUT", "{done}");
    let usage = &done["usage"];
    assert_eq!(usage["estimated"], true, "{usage}");
    assert!(
        usage["prompt_tokens"].as_u64().unwrap() > 7,
        "the reported round's 7 and the second prompt: {usage}"
    );
    assert!(record.usage.estimated);
}

/// A run of one round made of `deltas`, which must fail: its `done` event's data and its
/// record.
async fn failed_round(deltas: Vec<ChatDelta>) -> (serde_json::Value, agentrt_engine::RunRecord) {
    let h = harness(Scripted {
        rounds: Mutex::new(VecDeque::from([Ok(deltas)])),
        ..Default::default()
    });
    let (events, record) = h
        .run("r", config(Strategy::FunctionCall, &[]), Arc::default())
        .await;
    assert_well_formed(&events);
    let done = events.last().unwrap();
    assert_eq!(done.kind, EventKind::Error);
    (done.data.as_ref().unwrap().to_json(), record)
}

#[tokio::test]
async fn an_answer_the_content_filter_stopped_is_a_model_error_not_an_answer() {
    let (data, record) = failed_round(vec![
        ChatDelta::Content("Hello world,".into()),
        ChatDelta::Finish {
            reason: FinishReason::ContentFilter,
            usage: None,
        },
    ])
    .await;
    assert_eq!(data["code"], "MODEL_CONTENT_FILTERED", "{data}");
    assert_eq!(data["stop_reason"], "model_error", "{data}");
    assert_eq!(record.stop_reason, Some(StopReason::ModelError));
    assert_eq!(record.final_answer, "", "not an answer");
    assert!(record.usage.estimated && record.usage.completion_tokens > 0);
}

#[tokio::test]
async fn a_reply_cut_at_max_tokens_inside_a_calls_arguments_ends_the_run_so() {
    let (data, record) = failed_round(vec![
        call(
            "c1",
            "write",
            r#"{"path": "a.txt", "text": "once upon a ti"#,
        ),
        ChatDelta::Finish {
            reason: FinishReason::Length,
            usage: None,
        },
    ])
    .await;
    assert_eq!(data["code"], "MODEL_MAX_TOKENS", "{data}");
    assert_eq!(data["stop_reason"], "max_tokens", "{data}");
    assert!(
        data["message"].as_str().unwrap().contains("\"write\""),
        "{data}"
    );
    assert_eq!(record.stop_reason, Some(StopReason::MaxTokens));
    assert!(
        record.steps.iter().all(|s| s.tool_calls.is_empty()),
        "nothing ran"
    );
    // Cut right after the last call's name: no arguments yet, not `{}`.
    let (data, record) = failed_round(vec![
        call("c1", "list", "{}"),
        call("c2", "write", ""),
        ChatDelta::Finish {
            reason: FinishReason::Length,
            usage: None,
        },
    ])
    .await;
    assert_eq!(data["code"], "MODEL_MAX_TOKENS", "{data}");
    assert!(
        data["message"].as_str().unwrap().contains("\"write\""),
        "{data}"
    );
    assert!(
        record.steps.iter().all(|s| s.tool_calls.is_empty()),
        "nothing ran"
    );
}

#[tokio::test]
async fn a_reply_for_tool_calls_without_a_readable_call_is_a_model_error_not_an_answer() {
    let (data, record) = failed_round(vec![
        ChatDelta::Content("Let me look that up.".into()),
        ChatDelta::Finish {
            reason: FinishReason::ToolCalls,
            usage: None,
        },
    ])
    .await;
    assert_eq!(data["code"], "MODEL_TOOL_CALLS_UNREADABLE", "{data}");
    assert_eq!(record.stop_reason, Some(StopReason::ModelError));
    assert_eq!(record.final_answer, "", "not an answer");
}

#[tokio::test]
async fn a_refusal_is_a_model_error_that_says_it_and_is_not_retried() {
    let (data, record) = failed_round(vec![
        ChatDelta::Refusal("I cannot help with that.".into()),
        ChatDelta::Finish {
            reason: FinishReason::Stop,
            usage: None,
        },
    ])
    .await;
    assert_eq!(data["code"], "MODEL_REFUSED", "{data}");
    assert_eq!(data["retryable"], false, "{data}");
    assert!(
        data["message"]
            .as_str()
            .unwrap()
            .contains("I cannot help with that."),
        "{data}"
    );
    assert_eq!(record.stop_reason, Some(StopReason::ModelError));
    assert_eq!(record.final_answer, "", "not an answer");
}

/// A publisher whose write number `fail_at` (0 is the first) fails, as a shared bus's does
/// while its store cannot be reached: it keeps the events, numbered, and writes them with
/// its next call.
struct Flaky {
    inner: Box<dyn agentrt_events::RunPublisher>,
    calls: AtomicUsize,
    fail_at: usize,
    kept: Mutex<Vec<RunEvent>>,
}

#[async_trait::async_trait]
impl agentrt_events::RunPublisher for Flaky {
    async fn publish(&self, events: Vec<RunEvent>) -> Result<(), agentrt_events::BusError> {
        let mut kept = std::mem::take(&mut *self.kept.lock().unwrap());
        kept.extend(events);
        if self.calls.fetch_add(1, Ordering::AcqRel) == self.fail_at {
            *self.kept.lock().unwrap() = kept;
            return Err(agentrt_events::BusError::Unavailable(
                "the store is down".into(),
            ));
        }
        self.inner.publish(kept).await
    }

    async fn release(&self) -> Result<(), agentrt_events::BusError> {
        self.inner.release().await
    }
}

#[tokio::test]
async fn a_run_that_could_not_publish_ends_with_its_record_at_its_last_event() {
    let h = harness(Scripted {
        rounds: Mutex::new(VecDeque::from([Ok(answer("never published whole"))])),
        ..Default::default()
    });
    let publisher = Flaky {
        inner: h.bus.open("r", "").await.unwrap(),
        calls: AtomicUsize::new(0),
        fail_at: 1,
        kept: Mutex::default(),
    };
    let reader = h.bus.subscribe("r", 0).await.unwrap();
    h.engine
        .start(
            spec("r", config(Strategy::FunctionCall, &[])),
            "",
            Box::new(publisher),
            h.store.clone(),
            Arc::default(),
        )
        .await
        .unwrap()
        .run()
        .await;
    let events: Vec<Arc<RunEvent>> = reader.map(Result::unwrap).collect().await;
    assert_well_formed(&events);
    let done = events.last().unwrap();
    assert_eq!(
        done.data.as_ref().unwrap().to_json()["code"],
        "STATE_UNAVAILABLE"
    );
    let record = h.store.load("r").await.unwrap().unwrap();
    assert_eq!(
        record.last_sequence, done.sequence,
        "the record ends at the run's last event"
    );
}

#[tokio::test]
async fn a_run_whose_continuation_cannot_be_read_ends_failed_once() {
    let h = harness(Scripted::default());
    // Its replica stops without a word (its log left open, as a crash leaves it).
    let (store, mut taken) = taken_over(&h, std::mem::forget).await;
    // Written by a version of agent-server that this one cannot read.
    taken.state = "{\"phase\": \"NextVersion\"}".into();
    let resumed = h
        .engine
        .resume(taken, false, &h.bus, store.clone(), Arc::default())
        .await;
    let record = ended_by_take_over(&h, &store, resumed).await;
    assert!(
        record
            .error
            .as_ref()
            .is_some_and(|e| e.message.contains("cannot read the state")),
        "{record:?}"
    );
}

/// A client tool's calls count under one `tool` label, `client`: each caller names its
/// own tools, and the label's values are bounded for every caller together.
#[tokio::test]
async fn client_tool_calls_count_as_client_in_the_metrics() {
    let name = "lookup_order_for_metrics_test";
    let h = harness(calls_then_done(vec![call("c1", name, r#"{"order": 17}"#)]));
    let mut config = config(Strategy::FunctionCall, &[name]);
    config.client_tools = vec![agentrt_core::ClientTool {
        name: name.into(),
        description: "finds an order".into(),
        input_schema: json!({"type": "object", "properties": {"order_id": {"type": "string"}},
            "required": ["order_id"], "additionalProperties": false}),
    }];
    let (events, _) = h.run("r1", config, Arc::default()).await;
    assert_well_formed(&events);
    let text = agentrt_metrics::Metrics::global().encode();
    assert!(
        text.contains(r#"agentrt_tool_calls_total{tool="client",outcome="error"}"#),
        "{text}"
    );
    assert!(!text.contains(name), "{text}");
}
