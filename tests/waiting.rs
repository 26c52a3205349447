//! Runs that wait: tools whose calls need a person's approval (`ToolRef.require_approval`)
//! and tools the caller runs itself (`AgentConfig.client_tools`). A round's calls that
//! need nothing run at once; the others produce one EVENT_TYPE_ACTION_REQUIRED event, the
//! run says RUN_STATUS_REQUIRES_ACTION and holds nothing until `ApproveToolCalls` and
//! `SubmitToolOutputs` have answered every call, then goes on in the same stream.
//!
//! The tests with Redis need it at `AGENTRT_TEST_REDIS` (default
//! `redis://127.0.0.1:6379/0`); `scripts/test` starts one when none answers. Each keeps
//! its keys under a prefix of its own.
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use std::time::Duration;

use agentrt::v1::{
    self, agent_engine_client::AgentEngineClient, agent_service_client::AgentServiceClient,
};
use agentrt_test_support::{
    Server, agent_server_with_model,
    conformance::{redis_prefix, redis_url},
    connect,
};
use common::{Stack, assert_well_formed, create_engine, data, done, get_run, kind, of_kind, rest};
use serde_json::{Value, json};
use tokio_stream::StreamExt;
use tonic::{Code, Streaming, transport::Channel};

type Event = v1::AgentStreamEvent;

const SCENARIOS: &str = r#"{"scenarios": {
  "one": {"turns": [
    {"tool_calls": [{"id": "c1", "name": "calculator", "arguments": {"expression": "6 * 7"}}]},
    {"content": "results: {tool_results}"}]},
  "mix": {"turns": [
    {"tool_calls": [
      {"id": "t1", "name": "calculator", "arguments": {"expression": "1 + 1"}},
      {"id": "t2", "name": "lookup_order", "arguments": {"order_id": "A-17"}},
      {"id": "t3", "name": "sleep", "arguments": {"seconds": 0}},
      {"id": "t4", "name": "lookup_order", "arguments": {"order": 17}},
      {"id": "t5", "name": "lookup_order", "arguments": {"order_id": "B-2"}}]},
    {"content": "results: {tool_results}"}]},
  "client": {"turns": [
    {"tool_calls": [{"id": "k1", "name": "lookup_order", "arguments": {"order_id": "A-17"}}]},
    {"content": "results: {tool_results}"}]},
  "client_counting": {"turns": [
    {"tool_calls": [{"id": "k1", "name": "lookup_order", "arguments": {"order_id": "A-17"}}]},
    {"content": "users: {user_messages}"}]},
  "twice": {"turns": [
    {"tool_calls": [{"id": "w1", "name": "lookup_order", "arguments": {"order_id": "A-17"}}]},
    {"tool_calls": [{"id": "w2", "name": "lookup_order", "arguments": {"order_id": "B-2"}}]},
    {"content": "results: {tool_results}"}]},
  "same_ids": {"turns": [
    {"tool_calls": [{"id": "r1", "name": "sleep", "arguments": {"seconds": 0}}]},
    {"tool_calls": [{"id": "r1", "name": "sleep", "arguments": {"seconds": 1}}]},
    {"tool_calls": [{"id": "r1", "name": "lookup_order", "arguments": {"order_id": "A-17"}}]},
    {"content": "results: {tool_results}"}]},
  "two_client": {"turns": [
    {"tool_calls": [
      {"id": "k1", "name": "lookup_order", "arguments": {"order_id": "A-17"}},
      {"id": "k2", "name": "lookup_order", "arguments": {"order_id": "B-2"}}]},
    {"content": "results: {tool_results}"}]},
  "bad_approval": {"turns": [
    {"tool_calls": [
      {"id": "b1", "name": "sleep", "arguments": {"seconds": "soon"}},
      {"id": "b2", "name": "sleep", "arguments": {"seconds": 0}}]},
    {"content": "results: {tool_results}"}]},
  "plain": {"turns": [{"content": "an answer"}]},
  "busy": {"turns": [{"content": "done at last", "latency_ms": 6000}]},
  "client_late": {"turns": [
    {"tool_calls": [{"id": "k1", "name": "lookup_order", "arguments": {"order_id": "A-17"}}],
     "latency_ms": 1500},
    {"content": "results: {tool_results}"}]},
  "client_slow": {"turns": [
    {"tool_calls": [{"id": "k1", "name": "lookup_order", "arguments": {"order_id": "A-17"}}]},
    {"content": "results: {tool_results}", "latency_ms": 1500}]},
  "react": {"turns": [
    {"content": "Thought: I need the order.\nAction: lookup_order\nAction Input: {\"order_id\": \"A-17\"}"},
    {"content": "Thought: I know it now.\nFinal Answer: the order is shipped"}]}
}}"#;

/// The client tool of these tests.
fn lookup_order() -> v1::ClientTool {
    v1::ClientTool {
        name: "lookup_order".into(),
        description: "Finds an order of the caller's shop by its id.".into(),
        input_schema: agentrt::json::json_to_struct(&json!({
            "type": "object",
            "properties": {"order_id": {"type": "string"}},
            "required": ["order_id"],
            "additionalProperties": false,
        })),
    }
}

/// An agent on `model` with the calculator, `sleep` (needing approval when `approve_sleep`)
/// and the client tool `lookup_order`; `approve_calculator` makes the calculator need
/// approval too.
fn waiting_agent(model: &str, approve_calculator: bool) -> v1::AgentConfig {
    v1::AgentConfig {
        name: "waiter".into(),
        model: Some(v1::ModelConfig {
            name: model.into(),
            ..Default::default()
        }),
        tools: vec![
            v1::ToolRef {
                name: "calculator".into(),
                require_approval: approve_calculator,
            },
            v1::ToolRef {
                name: "sleep".into(),
                require_approval: true,
            },
        ],
        client_tools: vec![lookup_order()],
        parallel_tool_calls: true,
        ..Default::default()
    }
}

/// Starts a run of `config` on `stack` and reads its `Execute` stream up to its
/// EVENT_TYPE_ACTION_REQUIRED event: the stream, the events read, that event's data, the
/// run's id.
async fn waiting_run(
    stack: &mut Stack,
    config: v1::AgentConfig,
) -> (Streaming<Event>, Vec<Event>, Value, String) {
    let engine_id = stack.engine_for(config).await;
    let mut stream = execute(&mut stack.engine, &engine_id).await;
    let (before, action) = until_action(&mut stream).await;
    let run_id = before[0].run_id.clone();
    (stream, before, action, run_id)
}

/// Reads `stream` until its EVENT_TYPE_ACTION_REQUIRED event: the events read, that
/// event's data.
async fn until_action(stream: &mut Streaming<Event>) -> (Vec<Event>, Value) {
    let mut events = Vec::new();
    loop {
        let event = tokio::time::timeout(Duration::from_secs(30), stream.next())
            .await
            .expect("no ACTION_REQUIRED event within 30 s")
            .expect("the stream ended before ACTION_REQUIRED")
            .expect("the stream failed before ACTION_REQUIRED");
        assert!(!event.done, "the run ended without waiting: {event:?}");
        let action = kind(&event) == v1::EventType::ActionRequired;
        let payload = action.then(|| data(&event));
        events.push(event);
        if let Some(payload) = payload {
            return (events, payload);
        }
    }
}

async fn execute(engine: &mut AgentEngineClient<Channel>, engine_id: &str) -> Streaming<Event> {
    engine
        .execute(v1::ExecuteRequest {
            engine_id: engine_id.into(),
            query: "where is my order?".into(),
            ..Default::default()
        })
        .await
        .unwrap()
        .into_inner()
}

async fn approve(
    engine: &mut AgentEngineClient<Channel>,
    run_id: &str,
    decisions: &[(&str, bool, &str)],
) -> Result<v1::ToolAnswersResponse, tonic::Status> {
    engine
        .approve_tool_calls(v1::ApproveToolCallsRequest {
            run_id: run_id.into(),
            decisions: decisions
                .iter()
                .map(|(id, approved, reason)| v1::ToolCallDecision {
                    tool_call_id: (*id).into(),
                    approved: *approved,
                    reason: (*reason).into(),
                })
                .collect(),
        })
        .await
        .map(tonic::Response::into_inner)
}

async fn submit(
    engine: &mut AgentEngineClient<Channel>,
    run_id: &str,
    outputs: &[(&str, &str)],
) -> Result<v1::ToolAnswersResponse, tonic::Status> {
    engine
        .submit_tool_outputs(v1::SubmitToolOutputsRequest {
            run_id: run_id.into(),
            outputs: outputs
                .iter()
                .map(|(id, output)| v1::ToolOutput {
                    tool_call_id: (*id).into(),
                    output: (*output).into(),
                    is_error: false,
                })
                .collect(),
        })
        .await
        .map(tonic::Response::into_inner)
}

/// The answer text of a run's events.
fn answer(events: &[Event]) -> String {
    events
        .iter()
        .filter(|e| kind(e) == v1::EventType::FinalAnswer && !e.done)
        .map(|e| e.content.as_str())
        .collect()
}

/// The pending calls of ACTION_REQUIRED data, as (id, name, action).
fn pending(action: &Value) -> Vec<(String, String, String)> {
    action["tool_calls"]
        .as_array()
        .expect("tool_calls")
        .iter()
        .map(|c| {
            (
                c["id"].as_str().unwrap().to_owned(),
                c["name"].as_str().unwrap().to_owned(),
                c["action"].as_str().unwrap().to_owned(),
            )
        })
        .collect()
}

fn status_reason(status: &tonic::Status) -> String {
    tonic_types::StatusExt::get_details_error_info(status)
        .map(|info| info.reason)
        .unwrap_or_default()
}

#[tokio::test]
async fn an_approved_call_runs_and_the_run_goes_on_in_the_same_stream() {
    let mut stack = Stack::up(SCENARIOS, &[]).await;
    let (stream, before, action, run_id) =
        waiting_run(&mut stack, waiting_agent("one", true)).await;
    assert_eq!(
        pending(&action),
        [(
            "c1".to_owned(),
            "calculator".to_owned(),
            "approve".to_owned()
        )]
    );
    assert_eq!(action["tool_calls"][0]["arguments"]["expression"], "6 * 7");
    assert!(
        of_kind(&before, v1::EventType::ToolCall)
            .iter()
            .any(|c| c["id"] == "c1"),
        "the call is announced before the wait"
    );
    assert!(of_kind(&before, v1::EventType::ToolResult).is_empty());

    let state = get_run(&mut stack.engine, &run_id).await;
    assert_eq!(state.status, v1::RunStatus::RequiresAction as i32);
    assert_eq!(state.stop_reason, v1::StopReason::Unspecified as i32);
    assert_eq!(state.pending_tool_calls.len(), 1);
    let call = &state.pending_tool_calls[0];
    assert_eq!(
        (call.id.as_str(), call.name.as_str(), call.action.as_str()),
        ("c1", "calculator", "approve")
    );
    assert!(!call.answered);
    // Its record has no output and no duration yet: it has not run.
    let record = state
        .steps
        .iter()
        .flat_map(|step| &step.tool_calls)
        .find(|c| c.id == "c1")
        .expect("the call's record");
    assert_eq!(record.output, "");
    assert_eq!(record.duration, None);

    let answered = approve(&mut stack.engine, &run_id, &[("c1", true, "")])
        .await
        .unwrap();
    assert_eq!(answered.status, v1::RunStatus::Running as i32);
    assert!(answered.pending_tool_call_ids.is_empty());

    let after = rest(stream).await;
    let events: Vec<Event> = before.into_iter().chain(after).collect();
    assert_well_formed(&events);
    let results = of_kind(&events, v1::EventType::ToolResult);
    assert_eq!(results.len(), 1, "{results:?}");
    assert_eq!(results[0]["id"], "c1");
    assert_eq!(results[0]["output"], "42");
    assert_eq!(results[0]["is_error"], false);
    assert_eq!(answer(&events), "results: 42");
    assert_eq!(done(&events)["stop_reason"], "final_answer");
    let state = get_run(&mut stack.engine, &run_id).await;
    assert_eq!(state.status, v1::RunStatus::Succeeded as i32);
    assert_eq!(state.final_answer, "results: 42");
    assert!(state.pending_tool_calls.is_empty());

    // Answered again once it went on (an approval's reason, which nothing reads, aside):
    // accepted once, nothing changes.
    let again = approve(&mut stack.engine, &run_id, &[("c1", true, "looks fine")])
        .await
        .unwrap();
    assert!(again.pending_tool_call_ids.is_empty());
    assert_eq!(
        again.status,
        v1::RunStatus::Succeeded as i32,
        "where the run is now"
    );
    // Another answer once it went on: FAILED_PRECONDITION, the first answer stands.
    let late = approve(&mut stack.engine, &run_id, &[("c1", false, "no")])
        .await
        .unwrap_err();
    assert_eq!(late.code(), Code::FailedPrecondition, "{late:?}");
    assert_eq!(status_reason(&late), "TOOL_CALL_ANSWERED");
}

/// A person is asked only about calls that can run: a call its tool's schema refuses goes
/// back to the model at once, as a client tool's does.
#[tokio::test]
async fn a_call_whose_arguments_its_tool_refuses_is_not_put_to_a_person() {
    let mut stack = Stack::up(SCENARIOS, &[]).await;
    let (stream, before, action, run_id) =
        waiting_run(&mut stack, waiting_agent("bad_approval", false)).await;
    assert_eq!(
        pending(&action),
        [("b2".to_owned(), "sleep".to_owned(), "approve".to_owned())]
    );
    let results = of_kind(&before, v1::EventType::ToolResult);
    assert_eq!(results.len(), 1, "{results:?}");
    assert_eq!(results[0]["id"], "b1");
    assert_eq!(results[0]["is_error"], true);
    let error = results[0]["output"].as_str().unwrap();
    assert!(error.contains("input schema"), "{error}");
    assert!(error.contains("seconds"), "{error}");
    approve(&mut stack.engine, &run_id, &[("b2", true, "")])
        .await
        .unwrap();
    let events: Vec<Event> = before.into_iter().chain(rest(stream).await).collect();
    assert_well_formed(&events);
    assert_eq!(done(&events)["stop_reason"], "final_answer");
}

#[tokio::test]
async fn a_denied_call_goes_back_to_the_model_with_the_reason() {
    let mut stack = Stack::up(SCENARIOS, &[]).await;
    let (stream, before, _, run_id) = waiting_run(&mut stack, waiting_agent("one", true)).await;
    approve(
        &mut stack.engine,
        &run_id,
        &[("c1", false, "arithmetic is not allowed today")],
    )
    .await
    .unwrap();
    let events: Vec<Event> = before.into_iter().chain(rest(stream).await).collect();
    assert_well_formed(&events);
    let results = of_kind(&events, v1::EventType::ToolResult);
    assert_eq!(results.len(), 1);
    assert_eq!(results[0]["is_error"], true);
    let output = results[0]["output"].as_str().unwrap();
    assert!(output.contains("denied"), "{output}");
    assert!(
        output.contains("arithmetic is not allowed today"),
        "{output}"
    );
    // The model read it: the simulator echoes the tool results it was sent.
    let said = answer(&events);
    assert!(said.contains("arithmetic is not allowed today"), "{said}");
    assert_eq!(done(&events)["stop_reason"], "final_answer");

    // A reason is held to the bound of a tool output, as everything the model reads.
    let mut stack = Stack::up(SCENARIOS, &["--max-tool-output-bytes", "300"]).await;
    let (stream, before, _, run_id) = waiting_run(&mut stack, waiting_agent("one", true)).await;
    let reason = "no ".repeat(1000);
    approve(
        &mut stack.engine,
        &run_id,
        &[("c1", false, reason.as_str())],
    )
    .await
    .unwrap();
    let events: Vec<Event> = before.into_iter().chain(rest(stream).await).collect();
    let results = of_kind(&events, v1::EventType::ToolResult);
    let output = results[0]["output"].as_str().unwrap();
    assert!(output.starts_with("the call was denied"), "{output}");
    assert!(output.contains("tool output truncated"), "{output}");
    assert!(output.len() < 400, "{} bytes", output.len());
}

/// One round with an ordinary call, two client calls (one with arguments that break the
/// tool's schema) and a call needing approval: the ordinary call runs at once, the bad
/// client call goes back to the model, the others wait and are answered in any order,
/// one at a time, with repeats, an unknown id and an answer of the wrong kind on the way.
#[tokio::test]
async fn a_mixed_round_answered_in_any_order_with_repeats_and_mistakes() {
    let mut stack = Stack::up(SCENARIOS, &[]).await;
    let (stream, before, action, run_id) =
        waiting_run(&mut stack, waiting_agent("mix", false)).await;
    assert_eq!(
        pending(&action),
        [
            (
                "t2".to_owned(),
                "lookup_order".to_owned(),
                "client_execute".to_owned()
            ),
            ("t3".to_owned(), "sleep".to_owned(), "approve".to_owned()),
            (
                "t5".to_owned(),
                "lookup_order".to_owned(),
                "client_execute".to_owned()
            ),
        ]
    );
    // Before the wait: five calls announced, the two that need nothing have results.
    assert_eq!(of_kind(&before, v1::EventType::ToolCall).len(), 5);
    let results = of_kind(&before, v1::EventType::ToolResult);
    let by_id = |id: &str| {
        results
            .iter()
            .find(|r| r["id"] == id)
            .unwrap_or_else(|| panic!("no result of {id}: {results:?}"))
    };
    assert_eq!(results.len(), 2, "{results:?}");
    assert_eq!(by_id("t1")["output"], "2");
    assert_eq!(by_id("t4")["is_error"], true);
    let schema_error = by_id("t4")["output"].as_str().unwrap();
    assert!(schema_error.contains("input schema"), "{schema_error}");
    assert!(schema_error.contains("order_id"), "{schema_error}");

    // An id the run does not wait for, and an answer of the wrong kind: refused, nothing
    // kept.
    let unknown = submit(&mut stack.engine, &run_id, &[("t2", "x"), ("nope", "y")])
        .await
        .unwrap_err();
    assert_eq!(unknown.code(), Code::FailedPrecondition, "{unknown:?}");
    assert_eq!(status_reason(&unknown), "TOOL_CALL_NOT_PENDING");
    assert!(unknown.message().contains("nope"), "{unknown:?}");
    let wrong = submit(&mut stack.engine, &run_id, &[("t3", "done")])
        .await
        .unwrap_err();
    assert_eq!(wrong.code(), Code::FailedPrecondition, "{wrong:?}");
    assert!(wrong.message().contains("ApproveToolCalls"), "{wrong:?}");
    let ran = of_kind(&before, v1::EventType::ToolCall);
    assert_eq!(ran.len(), 5);
    // A request naming one call twice is malformed.
    let twice = submit(&mut stack.engine, &run_id, &[("t2", "a"), ("t2", "b")])
        .await
        .unwrap_err();
    assert_eq!(twice.code(), Code::InvalidArgument, "{twice:?}");

    // The last call first, then the approval, then the first call, with a repeat.
    let first = submit(
        &mut stack.engine,
        &run_id,
        &[("t5", "order B-2: in transit")],
    )
    .await
    .unwrap();
    assert_eq!(first.status, v1::RunStatus::RequiresAction as i32);
    assert_eq!(first.pending_tool_call_ids, ["t2", "t3"]);
    let repeat = submit(
        &mut stack.engine,
        &run_id,
        &[("t5", "order B-2: in transit")],
    )
    .await
    .unwrap();
    assert_eq!(repeat.pending_tool_call_ids, ["t2", "t3"]);
    let otherwise = submit(
        &mut stack.engine,
        &run_id,
        &[("t2", "x"), ("t5", "changed my mind")],
    )
    .await
    .unwrap_err();
    assert_eq!(otherwise.code(), Code::FailedPrecondition, "{otherwise:?}");
    assert_eq!(status_reason(&otherwise), "TOOL_CALL_ANSWERED");
    let state = get_run(&mut stack.engine, &run_id).await;
    assert_eq!(state.status, v1::RunStatus::RequiresAction as i32);
    let answered: Vec<(&str, bool)> = state.pending_tool_call_ids_answered().into_iter().collect();
    assert_eq!(answered, [("t2", false), ("t3", false), ("t5", true)]);
    let second = approve(&mut stack.engine, &run_id, &[("t3", true, "fine")])
        .await
        .unwrap();
    assert_eq!(second.pending_tool_call_ids, ["t2"]);
    let last = submit(&mut stack.engine, &run_id, &[("t2", "order A-17: shipped")])
        .await
        .unwrap();
    assert_eq!(last.status, v1::RunStatus::Running as i32);

    let events: Vec<Event> = before.into_iter().chain(rest(stream).await).collect();
    assert_well_formed(&events);
    assert_eq!(
        of_kind(&events, v1::EventType::ActionRequired).len(),
        1,
        "one ACTION_REQUIRED event per wait"
    );
    let results = of_kind(&events, v1::EventType::ToolResult);
    let mut ids: Vec<&str> = results.iter().map(|r| r["id"].as_str().unwrap()).collect();
    ids.sort_unstable();
    assert_eq!(
        ids,
        ["t1", "t2", "t3", "t4", "t5"],
        "each call has one result"
    );
    let said = answer(&events);
    // The model gets the results in call order; the first answer of t5 is the one kept.
    assert!(
        said.starts_with("results: 2, order A-17: shipped, "),
        "{said}"
    );
    assert!(said.ends_with(", order B-2: in transit"), "{said}");
    assert!(!said.contains("changed my mind"), "{said}");
    assert_eq!(done(&events)["stop_reason"], "final_answer");
}

/// A request of `AgentState` listing each pending call with whether it was answered.
trait PendingAnswered {
    fn pending_tool_call_ids_answered(&self) -> Vec<(&str, bool)>;
}

impl PendingAnswered for v1::AgentState {
    fn pending_tool_call_ids_answered(&self) -> Vec<(&str, bool)> {
        self.pending_tool_calls
            .iter()
            .map(|c| (c.id.as_str(), c.answered))
            .collect()
    }
}

/// A client that retries a request whose reply it lost may do so after the run moved on
/// to another wait, and after it ended: the same answer is accepted again, another is
/// refused as a conflict.
#[tokio::test]
async fn answers_of_an_earlier_wait_may_be_repeated_and_not_changed() {
    let mut stack = Stack::up(SCENARIOS, &[]).await;
    let (mut stream, _, action, run_id) =
        waiting_run(&mut stack, waiting_agent("twice", false)).await;
    assert_eq!(pending(&action)[0].0, "w1");
    submit(&mut stack.engine, &run_id, &[("w1", "shipped")])
        .await
        .unwrap();
    let (_, action) = until_action(&mut stream).await;
    assert_eq!(pending(&action)[0].0, "w2");

    let again = submit(&mut stack.engine, &run_id, &[("w1", "shipped")])
        .await
        .unwrap();
    assert_eq!(again.status(), v1::RunStatus::RequiresAction);
    let changed = submit(&mut stack.engine, &run_id, &[("w1", "lost")])
        .await
        .unwrap_err();
    assert_eq!(changed.code(), Code::FailedPrecondition, "{changed:?}");
    assert_eq!(status_reason(&changed), "TOOL_CALL_ANSWERED");
    // The last request again, with the new call's answer: that one counts.
    submit(
        &mut stack.engine,
        &run_id,
        &[("w1", "shipped"), ("w2", "packed")],
    )
    .await
    .unwrap();
    let mut events = Vec::new();
    while let Some(event) = stream.next().await {
        events.push(event.unwrap());
    }
    assert!(answer(&events).contains("packed"), "{}", answer(&events));

    let late = submit(&mut stack.engine, &run_id, &[("w1", "shipped")])
        .await
        .unwrap();
    assert_eq!(late.status(), v1::RunStatus::Succeeded);
    let changed = submit(&mut stack.engine, &run_id, &[("w1", "lost")])
        .await
        .unwrap_err();
    assert_eq!(status_reason(&changed), "TOOL_CALL_ANSWERED", "{changed:?}");
}

/// A model that numbers its calls anew in each round (as the simulator, and some servers
/// do): each call is published under an id of its own in the run, so that an answer to an
/// earlier call, sent again (a client retrying), cannot approve or answer a later one.
#[tokio::test]
async fn an_answer_sent_again_never_answers_a_later_call_the_model_gave_the_same_id() {
    let mut stack = Stack::up(SCENARIOS, &[]).await;
    let (mut stream, mut events, action, run_id) =
        waiting_run(&mut stack, waiting_agent("same_ids", false)).await;
    assert_eq!(pending(&action)[0].0, "r1");
    approve(&mut stack.engine, &run_id, &[("r1", true, "")])
        .await
        .unwrap();

    let (read, action) = until_action(&mut stream).await;
    events.extend(read);
    let (second, name, _) = pending(&action).remove(0);
    assert_eq!(name, "sleep");
    assert_ne!(second, "r1", "a second call under the first one's id");
    // The first approval again: the run received it, and it stays the first call's.
    let again = approve(&mut stack.engine, &run_id, &[("r1", true, "")])
        .await
        .unwrap();
    assert_eq!(again.status(), v1::RunStatus::RequiresAction);
    assert!(again.pending_tool_call_ids.contains(&second), "{again:?}");
    let changed = approve(&mut stack.engine, &run_id, &[("r1", false, "no")])
        .await
        .unwrap_err();
    assert_eq!(status_reason(&changed), "TOOL_CALL_ANSWERED", "{changed:?}");
    approve(&mut stack.engine, &run_id, &[(&second, false, "not now")])
        .await
        .unwrap();

    let (read, action) = until_action(&mut stream).await;
    events.extend(read);
    let (third, name, _) = pending(&action).remove(0);
    assert_eq!(name, "lookup_order");
    assert!(third != "r1" && third != second, "{third} is taken");
    let again = approve(
        &mut stack.engine,
        &run_id,
        &[("r1", true, ""), (&second, false, "not now")],
    )
    .await
    .unwrap();
    assert_eq!(again.status(), v1::RunStatus::RequiresAction);
    submit(&mut stack.engine, &run_id, &[(&third, "shipped")])
        .await
        .unwrap();
    events.extend(rest(stream).await);
    assert_well_formed(&events);
    let calls: Vec<String> = of_kind(&events, v1::EventType::ToolCall)
        .iter()
        .map(|call| call["id"].as_str().unwrap().to_owned())
        .collect();
    assert_eq!(calls, ["r1", second.as_str(), third.as_str()]);
    // The first call ran, the second did not (its denial is its result), and the third
    // has the client's output.
    let results = of_kind(&events, v1::EventType::ToolResult);
    let result = |id: &str| {
        results
            .iter()
            .find(|r| r["id"] == id)
            .unwrap_or_else(|| panic!("no result for {id}: {results:?}"))
            .clone()
    };
    assert_eq!(result("r1")["is_error"], false, "{results:?}");
    let denied = result(&second);
    assert!(
        denied["is_error"] == true && denied["output"].as_str().unwrap().contains("not now"),
        "{denied}"
    );
    assert_eq!(result(&third)["output"], "shipped");
    assert_eq!(answer(&events), "results: shipped");
}

#[tokio::test]
async fn answers_to_unknown_runs_runs_not_waiting_and_malformed_requests() {
    let mut stack = Stack::up(SCENARIOS, &[]).await;
    let unknown = submit(&mut stack.engine, "no-such-run", &[("c1", "x")])
        .await
        .unwrap_err();
    assert_eq!(unknown.code(), Code::NotFound, "{unknown:?}");
    let empty = stack
        .engine
        .approve_tool_calls(v1::ApproveToolCallsRequest {
            run_id: "r".into(),
            decisions: Vec::new(),
        })
        .await
        .unwrap_err();
    assert_eq!(empty.code(), Code::InvalidArgument, "{empty:?}");
    let no_id = submit(&mut stack.engine, "", &[("", "x")])
        .await
        .unwrap_err();
    assert_eq!(no_id.code(), Code::InvalidArgument, "{no_id:?}");

    // A run that never waited (its calculator needs nothing).
    let events = stack
        .run(common::agent("one", &["calculator"]), "6*7?")
        .await;
    let run_id = events[0].run_id.clone();
    let refused = submit(&mut stack.engine, &run_id, &[("c1", "x")])
        .await
        .unwrap_err();
    assert_eq!(refused.code(), Code::FailedPrecondition, "{refused:?}");
    assert_eq!(status_reason(&refused), "RUN_NOT_WAITING");
    // How it ended, as its `done` event says.
    assert!(
        refused
            .message()
            .ends_with("(it is succeeded, ended with stop reason final_answer)"),
        "{refused:?}"
    );
}

/// A wait longer than `timeouts.action` ends the run with STOP_REASON_ACTION_TIMEOUT; the
/// run's own time limit is paused meanwhile (here shorter than the wait).
#[tokio::test]
async fn the_action_timeout_ends_a_wait_and_the_run_timeout_is_paused() {
    let mut stack = Stack::up(SCENARIOS, &[]).await;
    let secs = |seconds| Some(prost_types::Duration { seconds, nanos: 0 });
    // Waits longer than its run timeout, then is answered: it succeeds.
    let mut patient = waiting_agent("client", false);
    patient.timeouts = Some(v1::Timeouts {
        run: secs(2),
        model_call: secs(2),
        tool_call: secs(2),
        action: secs(60),
    });
    let (stream, before, _, run_id) = waiting_run(&mut stack, patient).await;
    tokio::time::sleep(Duration::from_millis(2500)).await;
    submit(&mut stack.engine, &run_id, &[("k1", "shipped")])
        .await
        .unwrap();
    let events: Vec<Event> = before.into_iter().chain(rest(stream).await).collect();
    assert_eq!(done(&events)["stop_reason"], "final_answer", "{events:?}");
    assert_eq!(answer(&events), "results: shipped");

    // Not answered within its action timeout: it ends.
    let mut hasty = waiting_agent("client", false);
    hasty.timeouts = Some(v1::Timeouts {
        action: secs(1),
        ..Default::default()
    });
    let (stream, before, _, run_id) = waiting_run(&mut stack, hasty).await;
    let events: Vec<Event> = before.into_iter().chain(rest(stream).await).collect();
    assert_well_formed(&events);
    let end = done(&events);
    assert_eq!(end["stop_reason"], "action_timeout", "{end}");
    assert_eq!(end["code"], "ACTION_TIMEOUT", "{end}");
    let state = get_run(&mut stack.engine, &run_id).await;
    assert_eq!(state.status, v1::RunStatus::Failed as i32);
    assert_eq!(state.stop_reason, v1::StopReason::ActionTimeout as i32);
    let late = submit(&mut stack.engine, &run_id, &[("k1", "shipped")])
        .await
        .unwrap_err();
    assert_eq!(late.code(), Code::FailedPrecondition, "{late:?}");
}

/// The client of `Execute` goes away while the run waits: the run is not cancelled; it is
/// answered, and `Subscribe` shows it whole.
#[tokio::test]
async fn a_disconnect_while_waiting_does_not_cancel_and_subscribe_follows_it() {
    let mut stack = Stack::up(SCENARIOS, &[]).await;
    let (stream, before, _, run_id) = waiting_run(&mut stack, waiting_agent("client", false)).await;
    drop(stream);
    tokio::time::sleep(Duration::from_millis(500)).await;
    let state = get_run(&mut stack.engine, &run_id).await;
    assert_eq!(state.status, v1::RunStatus::RequiresAction as i32);

    let mut answering = stack.engine.clone();
    follow_and_answer(&mut stack.engine, &mut answering, &run_id, before.len()).await;
}

#[tokio::test]
async fn a_disconnect_after_the_wait_does_not_cancel_the_run_either() {
    let mut stack = Stack::up(SCENARIOS, &[]).await;
    let (stream, before, _, run_id) =
        waiting_run(&mut stack, waiting_agent("client_slow", false)).await;
    // Answered while its client still follows it; the client goes away during the next
    // (slow) model round: what was decided stands, and the run ends with its answer.
    submit(&mut stack.engine, &run_id, &[("k1", "shipped")])
        .await
        .unwrap();
    tokio::time::sleep(Duration::from_millis(300)).await;
    drop(stream);
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert_eq!(
        get_run(&mut stack.engine, &run_id).await.status,
        v1::RunStatus::Running as i32
    );
    let mut stream = stack
        .engine
        .subscribe(v1::SubscribeRequest {
            run_id: run_id.clone(),
            after_sequence: before.len() as u64,
        })
        .await
        .unwrap()
        .into_inner();
    let mut events = before;
    while let Some(event) = stream.next().await {
        events.push(event.unwrap());
    }
    assert_well_formed(&events);
    assert_eq!(answer(&events), "results: shipped");
    assert_eq!(done(&events)["stop_reason"], "final_answer");
}

#[tokio::test]
async fn a_run_that_waited_goes_on_with_the_history_it_started_with() {
    let mut stack = Stack::up(SCENARIOS, &[]).await;
    let waiting = stack
        .service
        .create_agent_engine(v1::CreateAgentEngineRequest {
            config: Some(waiting_agent("client_counting", false)),
            session_id: String::new(),
        })
        .await
        .unwrap()
        .into_inner();
    let mut stream = execute(&mut stack.engine, &waiting.engine_id).await;
    let (before, _) = until_action(&mut stream).await;
    let run_id = before[0].run_id.clone();
    // Another turn of the same session ends while the first waits.
    let other = stack
        .service
        .create_agent_engine(v1::CreateAgentEngineRequest {
            config: Some(waiting_agent("plain", false)),
            session_id: waiting.session_id.clone(),
        })
        .await
        .unwrap()
        .into_inner();
    let events = common::collect(stack.start(&other.engine_id, "another question").await).await;
    assert_eq!(answer(&events), "an answer");
    submit(&mut stack.engine, &run_id, &[("k1", "shipped")])
        .await
        .unwrap();
    // The model is asked with the question the run started with and none that came later
    // (which would also have come before it).
    let events = rest(stream).await;
    assert_eq!(answer(&events), "users: 1");
}

/// Follows waiting run `run_id` from its start with `Subscribe` on `follower` (`waited`
/// events up to its ACTION_REQUIRED), answers its `lookup_order` call through
/// `answering`, and checks that it ends with the answer.
async fn follow_and_answer(
    follower: &mut AgentEngineClient<Channel>,
    answering: &mut AgentEngineClient<Channel>,
    run_id: &str,
    waited: usize,
) {
    let mut stream = follower
        .subscribe(v1::SubscribeRequest {
            run_id: run_id.into(),
            after_sequence: 0,
        })
        .await
        .unwrap()
        .into_inner();
    let (replayed, _) = until_action(&mut stream).await;
    assert_eq!(replayed.len(), waited);
    submit(answering, run_id, &[("k1", "shipped")])
        .await
        .unwrap();
    let events: Vec<Event> = replayed.into_iter().chain(rest(stream).await).collect();
    assert_well_formed(&events);
    assert_eq!(answer(&events), "results: shipped");
    assert_eq!(done(&events)["stop_reason"], "final_answer");
}

/// Cancels waiting run `run_id` (`stream` its `Execute` stream, `before` the events read
/// from it) and follows it to its end: its events and its record, both checked to say
/// that it was cancelled.
async fn cancel_and_follow(
    stack: &mut Stack,
    run_id: &str,
    stream: Streaming<Event>,
    before: Vec<Event>,
) -> (Vec<Event>, v1::AgentState) {
    let cancelled = stack
        .engine
        .cancel(v1::CancelRequest {
            run_id: run_id.to_owned(),
        })
        .await
        .unwrap()
        .into_inner();
    assert_eq!(cancelled.status, v1::RunStatus::Cancelled as i32);
    let events: Vec<Event> = before.into_iter().chain(rest(stream).await).collect();
    assert_well_formed(&events);
    assert_eq!(done(&events)["stop_reason"], "cancelled");
    let state = get_run(&mut stack.engine, run_id).await;
    assert_eq!(state.status, v1::RunStatus::Cancelled as i32);
    (events, state)
}

/// A waiting run holds no slot of `runs.max_active`, and its `Cancel` needs none: with
/// every slot taken by a run in progress, it still ends at once.
#[tokio::test]
async fn cancel_ends_a_waiting_run_when_no_slot_is_free() {
    let mut stack = Stack::up(SCENARIOS, &["--max-active-runs", "1"]).await;
    let (stream, before, _, run_id) = waiting_run(&mut stack, waiting_agent("client", false)).await;
    // The one slot: a run whose model takes 6 s to answer.
    let busy = stack.engine_for(waiting_agent("busy", false)).await;
    let mut other = execute(&mut stack.engine, &busy).await;
    let first = other.next().await.unwrap().unwrap();
    assert!(!first.done, "{first:?}");
    let asked = std::time::Instant::now();
    cancel_and_follow(&mut stack, &run_id, stream, before).await;
    assert!(
        asked.elapsed() < Duration::from_secs(4),
        "ended at once, not once the slot was free: {:?}",
        asked.elapsed()
    );
}

#[tokio::test]
async fn cancel_ends_a_waiting_run() {
    let mut stack = Stack::up(SCENARIOS, &[]).await;
    let (stream, before, _, run_id) = waiting_run(&mut stack, waiting_agent("client", false)).await;
    let (_, state) = cancel_and_follow(&mut stack, &run_id, stream, before).await;
    // The call that waited for its output is not an empty success.
    let call = &state.steps.last().unwrap().tool_calls[0];
    assert!(
        call.is_error
            && call
                .output
                .starts_with("not finished: the run ended (cancelled)"),
        "{call:?}"
    );
    let late = submit(&mut stack.engine, &run_id, &[("k1", "shipped")])
        .await
        .unwrap_err();
    assert_eq!(late.code(), Code::FailedPrecondition, "{late:?}");
}

/// An answer accepted before the run was cancelled is not lost: it is published and
/// recorded, and sending it again is a repeat, while the call left unanswered ends "not
/// finished" and takes no answer any more.
#[tokio::test]
async fn cancel_keeps_the_answers_a_waiting_run_accepted() {
    let mut stack = Stack::up(SCENARIOS, &[]).await;
    let (stream, before, _, run_id) =
        waiting_run(&mut stack, waiting_agent("two_client", false)).await;
    let accepted = submit(&mut stack.engine, &run_id, &[("k1", "shipped")])
        .await
        .unwrap();
    assert_eq!(accepted.pending_tool_call_ids, ["k2"]);
    let (events, state) = cancel_and_follow(&mut stack, &run_id, stream, before).await;
    let results = of_kind(&events, v1::EventType::ToolResult);
    assert_eq!(results.len(), 1, "{results:?}");
    assert_eq!(results[0]["id"], "k1");
    assert_eq!(results[0]["output"], "shipped");
    let calls = &state.steps.last().unwrap().tool_calls;
    assert!(
        calls[0].output == "shipped" && !calls[0].is_error,
        "{calls:?}"
    );
    assert!(
        calls[1].is_error
            && calls[1]
                .output
                .starts_with("not finished: the run ended (cancelled)"),
        "{calls:?}"
    );
    let again = submit(&mut stack.engine, &run_id, &[("k1", "shipped")])
        .await
        .unwrap();
    assert_eq!(again.status(), v1::RunStatus::Cancelled);
    assert!(again.pending_tool_call_ids.is_empty(), "{again:?}");
    let changed = submit(&mut stack.engine, &run_id, &[("k1", "lost")])
        .await
        .unwrap_err();
    assert_eq!(status_reason(&changed), "TOOL_CALL_ANSWERED", "{changed:?}");
    let late = submit(&mut stack.engine, &run_id, &[("k2", "packed")])
        .await
        .unwrap_err();
    assert_eq!(status_reason(&late), "RUN_NOT_WAITING", "{late:?}");
}

/// With state in memory, waiting runs have budgets (`runs.max_waiting_bytes`,
/// `runs.max_waiting_per_principal`): past them a run that would wait fails, naming the
/// budget, and the runs already waiting are kept and go on when answered.
#[tokio::test]
async fn a_run_that_would_wait_past_its_budget_fails_and_says_why() {
    let file = std::env::temp_dir().join(format!(
        "agentrt-waiting-budget-{}.toml",
        std::process::id()
    ));
    std::fs::write(&file, "[runs]\nmax_waiting_bytes = 1\n").unwrap();
    let mut stack = Stack::up(SCENARIOS, &["--config", &file.to_string_lossy()]).await;
    let (first, _, _, first_id) = waiting_run(&mut stack, waiting_agent("client", false)).await;

    let engine_id = stack.engine_for(waiting_agent("client", false)).await;
    let events = rest(execute(&mut stack.engine, &engine_id).await).await;
    assert_well_formed(&events);
    let end = events.last().unwrap();
    assert!(end.done && kind(end) == v1::EventType::Error, "{events:#?}");
    assert_eq!(done(&events)["code"], "BUDGET_EXCEEDED", "{end:?}");
    assert_eq!(done(&events)["category"], "budget", "{end:?}");
    assert_eq!(done(&events)["stop_reason"], "budget_exceeded", "{end:?}");
    assert!(end.content.contains("runs.max_waiting_bytes"), "{end:?}");
    // It never said it waits: a client would have acted for a run it cannot answer.
    assert!(
        !events
            .iter()
            .any(|e| kind(e) == v1::EventType::ActionRequired),
        "{events:#?}"
    );
    let state = get_run(&mut stack.engine, &end.run_id).await;
    assert_eq!(state.status, v1::RunStatus::Failed as i32);
    assert_eq!(state.stop_reason, v1::StopReason::BudgetExceeded as i32);
    // Its last sequence is its `done` event's: the ACTION_REQUIRED left out is not counted.
    assert_eq!(state.last_sequence, end.sequence, "{state:?}");
    // It waits for nothing (it listed the call it would have waited for).
    assert!(state.pending_tool_calls.is_empty(), "{state:?}");

    submit(&mut stack.engine, &first_id, &[("k1", "shipped")])
        .await
        .unwrap();
    let first = rest(first).await;
    assert!(answer(&first).contains("shipped"), "{first:#?}");
    let _ = std::fs::remove_file(&file);
}

/// ReAct makes one call a round: a client tool's call waits like any other.
#[tokio::test]
async fn react_waits_for_a_client_tool_too() {
    let mut stack = Stack::up(SCENARIOS, &[]).await;
    let mut config = waiting_agent("react", false);
    config.strategy = v1::Strategy::React as i32;
    let (stream, before, action, run_id) = waiting_run(&mut stack, config).await;
    let calls = pending(&action);
    assert_eq!(calls.len(), 1, "{action}");
    assert_eq!(calls[0].1, "lookup_order");
    assert_eq!(calls[0].2, "client_execute");
    assert_eq!(action["tool_calls"][0]["arguments"]["order_id"], "A-17");
    submit(&mut stack.engine, &run_id, &[(&calls[0].0, "shipped")])
        .await
        .unwrap();
    let events: Vec<Event> = before.into_iter().chain(rest(stream).await).collect();
    assert_well_formed(&events);
    let results = of_kind(&events, v1::EventType::ToolResult);
    assert_eq!(results.len(), 1);
    assert_eq!(results[0]["output"], "shipped");
    assert_eq!(answer(&events), "the order is shipped");
}

// ---------------------------------------------------------------------------------------
// With shared state.
// ---------------------------------------------------------------------------------------

struct Replica {
    server: Server,
    engine: AgentEngineClient<Channel>,
    service: AgentServiceClient<Channel>,
}

async fn replica(stack: &Stack, args: &[&str]) -> Replica {
    let server = agent_server_with_model(
        &stack.tools.url(),
        &format!("{}/v1", stack.model.url()),
        args,
    )
    .await;
    let channel = connect(&server.url()).await;
    Replica {
        server,
        engine: AgentEngineClient::new(channel.clone()),
        service: AgentServiceClient::new(channel),
    }
}

/// A run waiting on replica A is answered through replica B, whose `Execute` stream was
/// never open: the stream on A goes on to the end.
#[tokio::test]
async fn with_redis_an_answer_through_another_replica_continues_the_run() {
    let prefix = redis_prefix("wait-other");
    let url = redis_url();
    let args = [
        "--state",
        url.as_str(),
        "--state-key-prefix",
        prefix.as_str(),
    ];
    let mut a = Stack::up(SCENARIOS, &args).await;
    let mut b = replica(&a, &args).await;
    let (stream, before, _, run_id) = waiting_run(&mut a, waiting_agent("mix", false)).await;
    let state = get_run(&mut b.engine, &run_id).await;
    assert_eq!(state.status, v1::RunStatus::RequiresAction as i32);
    assert_eq!(state.pending_tool_calls.len(), 3);
    // Answers through both replicas.
    submit(&mut a.engine, &run_id, &[("t5", "in transit")])
        .await
        .unwrap();
    approve(&mut b.engine, &run_id, &[("t3", true, "")])
        .await
        .unwrap();
    let last = submit(&mut b.engine, &run_id, &[("t2", "shipped")])
        .await
        .unwrap();
    assert_eq!(last.status, v1::RunStatus::Running as i32);
    let events: Vec<Event> = before.into_iter().chain(rest(stream).await).collect();
    assert_well_formed(&events);
    let said = answer(&events);
    assert!(said.starts_with("results: 2, shipped, "), "{said}");
    assert!(said.ends_with(", in transit"), "{said}");
    let state = get_run(&mut a.engine, &run_id).await;
    assert_eq!(state.status, v1::RunStatus::Succeeded as i32);
    assert_eq!(state.final_answer, said);
}

/// A waiting run outlives every replica: both stop (kill -9), two new ones start, and the
/// run is answered and followed through them.
#[tokio::test]
async fn with_redis_a_waiting_run_outlives_a_restart_of_every_replica() {
    let prefix = redis_prefix("wait-restart");
    let url = redis_url();
    let args = [
        "--state",
        url.as_str(),
        "--state-key-prefix",
        prefix.as_str(),
    ];
    let mut stack = Stack::up(SCENARIOS, &args).await;
    let mut first = replica(&stack, &args).await;
    let engine_id = create_engine(&mut first.service, waiting_agent("client", false)).await;
    let mut stream = execute(&mut first.engine, &engine_id).await;
    let (before, _) = until_action(&mut stream).await;
    let run_id = before[0].run_id.clone();
    drop(stream);
    // Every replica goes away.
    for server in [&mut stack.agents, &mut first.server] {
        let pid = server.pid().expect("running");
        std::process::Command::new("kill")
            .args(["-KILL", &pid.to_string()])
            .status()
            .unwrap();
        server.wait(Duration::from_secs(10)).await;
    }
    let mut c = replica(&stack, &args).await;
    let mut d = replica(&stack, &args).await;
    let state = get_run(&mut c.engine, &run_id).await;
    assert_eq!(state.status, v1::RunStatus::RequiresAction as i32);
    follow_and_answer(&mut c.engine, &mut d.engine, &run_id, before.len()).await;
}

/// With state in memory, a run that begins to wait after SIGTERM, while the runs in
/// progress finish, ends too, with its ERROR `done` event, well before the grace is out.
#[tokio::test]
async fn a_run_that_begins_to_wait_during_the_drain_ends_with_a_done_event() {
    let mut stack = Stack::up(SCENARIOS, &["--drain-grace", "20s"]).await;
    let engine_id = stack.engine_for(waiting_agent("client_late", false)).await;
    let mut stream = execute(&mut stack.engine, &engine_id).await;
    let first = stream.next().await.unwrap().unwrap();
    assert!(!first.done, "{first:?}");
    let terminated = std::time::Instant::now();
    stack.agents.terminate();
    let mut events = vec![first];
    events.extend(rest(stream).await);
    assert_well_formed(&events);
    assert!(
        events
            .iter()
            .any(|e| kind(e) == v1::EventType::ActionRequired),
        "it waited: {events:#?}"
    );
    assert_eq!(
        kind(events.last().unwrap()),
        v1::EventType::Error,
        "{events:#?}"
    );
    assert_eq!(done(&events)["stop_reason"], "shutdown");
    assert!(
        terminated.elapsed() < Duration::from_secs(8),
        "ended once it waited, not at the end of the grace: {:?}",
        terminated.elapsed()
    );
    assert_eq!(
        stack.agents.wait(Duration::from_secs(25)).await.code(),
        Some(0)
    );
}

/// With state in memory, SIGTERM ends a run that waits for answers at once, with an ERROR
/// `done` event (stop reason shutdown) on its `Execute` stream and on a `Subscribe` to it,
/// rather than leaving its clients with broken streams; the process exits 0.
#[tokio::test]
async fn sigterm_ends_a_run_waiting_in_memory_with_a_done_event() {
    let mut stack = Stack::up(SCENARIOS, &["--drain-grace", "10s"]).await;
    let (stream, before, _, run_id) = waiting_run(&mut stack, waiting_agent("client", false)).await;
    let mut follower = stack
        .engine
        .subscribe(v1::SubscribeRequest {
            run_id: run_id.clone(),
            after_sequence: before.last().unwrap().sequence,
        })
        .await
        .unwrap()
        .into_inner();
    let terminated = std::time::Instant::now();
    stack.agents.terminate();
    let mut events = before;
    events.extend(rest(stream).await);
    assert_well_formed(&events);
    let last = events.last().unwrap();
    assert_eq!(kind(last), v1::EventType::Error, "{events:#?}");
    assert_eq!(done(&events)["stop_reason"], "shutdown");
    assert!(
        terminated.elapsed() < Duration::from_secs(5),
        "ended at once, not at the end of the grace: {:?}",
        terminated.elapsed()
    );
    let followed = tokio::time::timeout(Duration::from_secs(10), follower.next())
        .await
        .expect("the subscriber hears of the end")
        .expect("an event")
        .expect("not an error");
    assert!(followed.done, "{followed:?}");
    assert_eq!(followed.sequence, last.sequence);
    assert_eq!(
        stack.agents.wait(Duration::from_secs(15)).await.code(),
        Some(0)
    );
}

/// A run answered while its principal has every run it may have in progress here
/// (`runs.max_active_per_principal`) is left for when one of them ends; cancelled
/// meanwhile, it ends at once, and `Cancel` says so (it answered that the run still waited,
/// and the run sat for a lease taken by nobody).
#[tokio::test]
async fn an_answered_run_whose_principal_has_no_room_is_cancelled_at_once() {
    let dir = common::TempDir::new("waiting-principal-full");
    let tokens = dir.write("tokens", "alice-token-0123456789 principal=alice\n");
    let config = dir.write(
        "agent-server.toml",
        "[runs]\nmax_active_per_principal = 1\n",
    );
    let (tokens, config) = (tokens.to_string_lossy(), config.to_string_lossy());
    let mut stack = Stack::up(
        SCENARIOS,
        &["--auth-tokens-file", &tokens, "--config", &config],
    )
    .await;
    fn alice<T>(mut request: tonic::Request<T>) -> tonic::Request<T> {
        request.metadata_mut().insert(
            "authorization",
            "Bearer alice-token-0123456789".parse().unwrap(),
        );
        request
    }
    let mut engines = Vec::new();
    for model in ["client", "busy"] {
        let created = stack
            .service
            .create_agent_engine(alice(tonic::Request::new(v1::CreateAgentEngineRequest {
                config: Some(waiting_agent(model, false)),
                session_id: String::new(),
            })))
            .await
            .unwrap()
            .into_inner();
        engines.push(created.engine_id);
    }
    let execute = |engine_id: &str| {
        alice(tonic::Request::new(v1::ExecuteRequest {
            engine_id: engine_id.into(),
            query: "where is my order?".into(),
            ..Default::default()
        }))
    };
    let mut waiting = stack
        .engine
        .execute(execute(&engines[0]))
        .await
        .unwrap()
        .into_inner();
    let (before, _) = until_action(&mut waiting).await;
    let run_id = before[0].run_id.clone();
    // Alice's one run in progress: its model takes 6 s to answer. (The waiting run lets
    // its share of her runs go just after its last event.)
    let mut busy = common::when_room(|| {
        let mut engine = stack.engine.clone();
        let request = execute(&engines[1]);
        async move { engine.execute(request).await }
    })
    .await;
    assert!(!busy.next().await.unwrap().unwrap().done);
    let answered = stack
        .engine
        .submit_tool_outputs(alice(tonic::Request::new(v1::SubmitToolOutputsRequest {
            run_id: run_id.clone(),
            outputs: vec![v1::ToolOutput {
                tool_call_id: "k1".into(),
                output: "shipped".into(),
                is_error: false,
            }],
        })))
        .await
        .unwrap()
        .into_inner();
    assert!(answered.pending_tool_call_ids.is_empty(), "{answered:?}");
    tokio::time::sleep(Duration::from_millis(300)).await;
    let asked = std::time::Instant::now();
    let cancelled = stack
        .engine
        .cancel(alice(tonic::Request::new(v1::CancelRequest {
            run_id: run_id.clone(),
        })))
        .await
        .unwrap()
        .into_inner();
    assert_eq!(cancelled.status, v1::RunStatus::Cancelled as i32);
    let events: Vec<Event> = before.into_iter().chain(rest(waiting).await).collect();
    assert!(
        asked.elapsed() < Duration::from_secs(3),
        "ended at once, not after a lease or once the busy run ended: {:?}",
        asked.elapsed()
    );
    assert_well_formed(&events);
    assert_eq!(done(&events)["stop_reason"], "cancelled");
}
