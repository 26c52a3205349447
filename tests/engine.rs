//! `agent.v1.AgentEngine` end to end: the real `agent-server`, `tool-executor` and
//! `model-simulator` binaries, over real gRPC and real HTTP/SSE.

// Tests fail by panicking, with the value that was wrong.
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use std::time::{Duration, Instant};

use agentrt::v1;
use common::{Stack, agent, assert_well_formed, collect, done, kind, of_kind, rest, text};
use serde_json::json;
use tokio_stream::StreamExt;
use tonic::{Code, Streaming};

const SCENARIOS: &str = r#"{"scenarios": {
  "parallel": {"turns": [
    {"reasoning": "two sums at once", "chunk_chars": 3, "tool_calls": [
      {"name": "calculator", "arguments": {"expression": "1 + 1"}},
      {"name": "calculator", "arguments": {"expression": "2 * 3"}}]},
    {"content": "results: {tool_results}"}]},
  "thinker": {"turns": [{"reasoning": "deep thoughts here", "think_tags": true, "chunk_chars": 4, "content": "Forty-two."}]},
  "stubborn": {"turns": [
    {"tool_calls": [{"name": "calculator", "arguments": {"expression": "1 + 1"}}]},
    {"tool_calls": [{"name": "calculator", "arguments": {"expression": "2 + 2"}}]},
    {"content": "gave up after {tool_results}"}]},
  "flaky": {"turns": [{"content": "recovered", "error": {"status": 503, "message": "overloaded", "times": 2}}]},
  "limited": {"turns": [{"content": "patient", "error": {"status": 429, "message": "rate limited", "times": 1, "retry_after": 0.2}}]},
  "garbage": {"turns": [{"content": "never whole", "malformed": true}]},
  "clumsy": {"turns": [
    {"tool_calls": [
      {"name": "calculator", "arguments": {"expression": "1 / 0"}},
      {"name": "teleport", "arguments": {}},
      {"name": "calculator", "raw_arguments": "{\"expression\": \"2 +"}]},
    {"content": "tools said: {tool_results}"}]},
  "sleepy": {"turns": [{"tool_calls": [{"name": "sleep", "arguments": {"seconds": 30}}]}, {"content": "woke"}]},
  "slow": {"turns": [{"content": "a very slow answer, one character at a time, taking its time", "chunk_chars": 1, "chunk_delay_ms": 50}]},
  "slower": {"turns": [{"content": "an answer slower than the drain grace, one character at a time", "chunk_chars": 1, "chunk_delay_ms": 200}]},
  "memory": {"turns": [{"content": "seen {user_messages}"}]}
}}"#;

async fn stack() -> Stack {
    stack_with(&[]).await
}

/// The stack on this file's scenarios, with these extra agent-server arguments.
async fn stack_with(agent_server_args: &[&str]) -> Stack {
    Stack::up(SCENARIOS, agent_server_args).await
}

#[tokio::test]
async fn a_tool_using_run_streams_thoughts_calls_results_and_answer() {
    let mut s = stack().await;
    let events = s
        .run(agent("demo", &["calculator"]), "What is (2 + 3) * 4.5?")
        .await;
    use v1::EventType::*;
    let order: Vec<v1::EventType> = events
        .iter()
        .map(kind)
        .collect::<Vec<_>>()
        .into_iter()
        .fold(Vec::new(), |mut acc, k| {
            if acc.last() != Some(&k) {
                acc.push(k);
            }
            acc
        });
    assert_eq!(
        order,
        [
            RunStarted,
            Thought,
            ToolCall,
            ToolResult,
            Thought,
            FinalAnswer
        ]
    );
    assert!(
        events.iter().filter(|e| kind(e) == Thought).count() > 2,
        "reasoning arrives as deltas"
    );
    assert_eq!(
        text(&events, Thought).split("calculator.").next().unwrap(),
        "I should compute (2 + 3) * 4.5 with the "
    );
    let call = &of_kind(&events, ToolCall)[0];
    assert_eq!(call["name"], "calculator");
    assert_eq!(call["arguments"], json!({"expression": "(2 + 3) * 4.5"}));
    let result = &of_kind(&events, ToolResult)[0];
    assert_eq!(
        (
            result["id"].clone(),
            result["output"].clone(),
            result["is_error"].clone()
        ),
        (call["id"].clone(), json!("22.5"), json!(false))
    );
    assert!(result["duration_ms"].is_number());
    assert_eq!(text(&events, FinalAnswer), "The answer is 22.5.");
    let summary = done(&events);
    assert_eq!(summary["stop_reason"], "final_answer");
    assert_eq!(summary["iterations"], 2);
    assert!(summary["usage"]["total_tokens"].as_f64().unwrap() > 0.0);
    assert_eq!(kind(events.last().unwrap()), FinalAnswer);

    let state = s.state(&events[0].run_id).await;
    assert_eq!(state.status, v1::RunStatus::Succeeded as i32);
    assert_eq!(state.stop_reason, v1::StopReason::FinalAnswer as i32);
    assert_eq!(state.final_answer, "The answer is 22.5.");
    assert_eq!(state.steps.len(), 2);
    assert_eq!(state.steps[0].tool_calls[0].output, "22.5");
    assert_eq!(state.last_sequence, events.len() as u64);
    assert_eq!(state.query, "What is (2 + 3) * 4.5?");
}

#[tokio::test]
async fn parallel_calls_are_assembled_from_fragments_and_answered_in_call_order() {
    let mut s = stack().await;
    let events = s.run(agent("parallel", &["calculator"]), "sums").await;
    let calls = of_kind(&events, v1::EventType::ToolCall);
    assert_eq!(calls.len(), 2);
    assert_eq!(calls[0]["arguments"], json!({"expression": "1 + 1"}));
    assert_eq!(calls[1]["arguments"], json!({"expression": "2 * 3"}));
    assert_eq!(of_kind(&events, v1::EventType::ToolResult).len(), 2);
    assert_eq!(text(&events, v1::EventType::FinalAnswer), "results: 2, 6");
}

#[tokio::test]
async fn react_runs_on_models_without_tool_calling() {
    let mut s = stack().await;
    let mut config = agent("demo", &["calculator"]);
    config.strategy = v1::Strategy::React as i32;
    let events = s.run(config, "What is 6 * 7?").await;
    let call = &of_kind(&events, v1::EventType::ToolCall)[0];
    assert_eq!(call["arguments"], json!({"expression": "6 * 7"}));
    assert_eq!(
        of_kind(&events, v1::EventType::ToolResult)[0]["output"],
        "42"
    );
    assert!(text(&events, v1::EventType::Thought).contains("I should compute 6 * 7"));
    assert!(
        !text(&events, v1::EventType::Thought).contains("imagining"),
        "generation stops at Observation:"
    );
    assert_eq!(
        text(&events, v1::EventType::FinalAnswer),
        "The answer is 42."
    );
    assert_eq!(done(&events)["stop_reason"], "final_answer");
}

#[tokio::test]
async fn think_tags_stream_as_reasoning() {
    let mut s = stack().await;
    let events = s.run(agent("thinker", &[]), "?").await;
    assert_eq!(text(&events, v1::EventType::Thought), "deep thoughts here");
    assert_eq!(text(&events, v1::EventType::FinalAnswer), "Forty-two.");
}

#[tokio::test]
async fn max_iterations_ends_with_an_answer_without_tools() {
    let mut s = stack().await;
    let mut config = agent("stubborn", &["calculator"]);
    config.max_iterations = 2;
    let events = s.run(config, "loop").await;
    assert_eq!(of_kind(&events, v1::EventType::ToolCall).len(), 2);
    // The last call allows no tool call but shows the last round's results.
    assert_eq!(text(&events, v1::EventType::FinalAnswer), "gave up after 4");
    assert_eq!(done(&events)["stop_reason"], "max_iterations");
    assert_eq!(
        s.state(&events[0].run_id).await.stop_reason,
        v1::StopReason::MaxIterations as i32
    );
}

#[tokio::test]
async fn overloaded_and_rate_limited_models_are_retried() {
    let mut s = stack().await;
    let events = s.run(agent("flaky", &[]), "hi").await;
    assert_eq!(text(&events, v1::EventType::FinalAnswer), "recovered");
    let started = Instant::now();
    let events = s.run(agent("limited", &[]), "hi").await;
    assert_eq!(text(&events, v1::EventType::FinalAnswer), "patient");
    assert!(
        started.elapsed() >= Duration::from_millis(200),
        "Retry-After honoured"
    );
}

#[tokio::test]
async fn a_malformed_stream_fails_the_run_cleanly() {
    let mut s = stack().await;
    let events = s.run(agent("garbage", &[]), "hi").await;
    let last = events.last().unwrap();
    assert_eq!(kind(last), v1::EventType::Error);
    let summary = done(&events);
    assert_eq!(summary["stop_reason"], "model_error");
    assert_eq!(summary["code"], "MODEL_STREAM_ERROR");
    assert_eq!(summary["category"], "model");
    let state = s.state(&last.run_id).await;
    assert_eq!(state.status, v1::RunStatus::Failed as i32);
    assert_eq!(state.error.unwrap().code, "MODEL_STREAM_ERROR");
}

#[tokio::test]
async fn tool_failures_go_back_to_the_model() {
    let mut s = stack().await;
    let events = s
        .run(agent("clumsy", &["calculator"]), "break things")
        .await;
    let results = of_kind(&events, v1::EventType::ToolResult);
    assert_eq!(results.len(), 3);
    assert!(results.iter().all(|r| r["is_error"] == true), "{results:?}");
    let answer = text(&events, v1::EventType::FinalAnswer);
    assert!(answer.contains("division by zero"), "{answer}");
    assert!(answer.contains("not available to this agent"), "{answer}");
    assert!(answer.contains("not valid JSON"), "{answer}");
    assert_eq!(done(&events)["stop_reason"], "final_answer");
    // Arguments that are not a JSON object are an object all the same, in the call's
    // event and in GetRun: the model's text under `raw`.
    let calls = of_kind(&events, v1::EventType::ToolCall);
    assert_eq!(
        calls[2]["arguments"],
        json!({"raw": "{\"expression\": \"2 +"})
    );
    assert!(
        calls.iter().all(|c| c["arguments"].is_object()),
        "{calls:?}"
    );
    let state = s.state(&events[0].run_id).await;
    let recorded = &state.steps[0].tool_calls[2];
    assert_eq!(
        agentrt::json::struct_to_json(recorded.arguments.as_ref().unwrap()),
        json!({"raw": "{\"expression\": \"2 +"})
    );
}

#[tokio::test]
async fn cancel_stops_a_running_tool_call() {
    let mut s = stack().await;
    let engine_id = s.engine_for(agent("sleepy", &["sleep"])).await;
    let mut stream = s.start(&engine_id, "nap").await;
    let mut events = Vec::new();
    while let Some(event) = stream.next().await {
        let event = event.unwrap();
        let call = kind(&event) == v1::EventType::ToolCall;
        events.push(event);
        if call {
            break;
        }
    }
    tokio::time::sleep(Duration::from_millis(200)).await; // the tool is sleeping now
    let run_id = events[0].run_id.clone();
    let cancelled_at = Instant::now();
    let response = s
        .engine
        .cancel(v1::CancelRequest {
            run_id: run_id.clone(),
        })
        .await
        .unwrap()
        .into_inner();
    events.extend(rest(stream).await);
    assert_eq!(
        response.status,
        v1::RunStatus::Cancelled as i32,
        "{events:#?}"
    );
    assert!(
        cancelled_at.elapsed() < Duration::from_secs(1),
        "took {:?}",
        cancelled_at.elapsed()
    );
    assert_well_formed(&events);
    assert_eq!(kind(events.last().unwrap()), v1::EventType::Error);
    assert_eq!(done(&events)["stop_reason"], "cancelled");
    let state = s.state(&run_id).await;
    assert_eq!(state.status, v1::RunStatus::Cancelled as i32);
    // The call the run ended without is not an empty success.
    let call = &state.steps.last().unwrap().tool_calls[0];
    assert!(
        call.is_error
            && call.output
                == "not finished: the run ended (cancelled) before the call had its result",
        "{call:?}"
    );
    // Cancelling again is fine and changes nothing.
    let again = s
        .engine
        .cancel(v1::CancelRequest { run_id })
        .await
        .unwrap()
        .into_inner();
    assert_eq!(again.status, v1::RunStatus::Cancelled as i32);

    // The tool executor stopped the sleep: with no call in flight it drains at once
    // (a call still sleeping would hold the drain for its 10s grace).
    s.tools.terminate();
    let drain_started = Instant::now();
    assert!(s.tools.wait(Duration::from_secs(20)).await.success());
    assert!(
        drain_started.elapsed() < Duration::from_secs(3),
        "drain took {:?}",
        drain_started.elapsed()
    );
}

#[tokio::test]
async fn cancel_stops_a_streaming_model_call() {
    let mut s = stack().await;
    let engine_id = s.engine_for(agent("slow", &[])).await;
    let mut stream = s.start(&engine_id, "talk").await;
    let started = stream.next().await.unwrap().unwrap();
    assert_eq!(kind(&started), v1::EventType::RunStarted);
    let first = stream.next().await.unwrap().unwrap();
    assert_eq!(
        kind(&first),
        v1::EventType::FinalAnswer,
        "the model streams"
    );
    let cancelled_at = Instant::now();
    s.engine
        .cancel(v1::CancelRequest {
            run_id: first.run_id.clone(),
        })
        .await
        .unwrap();
    let tail = rest(stream).await;
    assert!(
        cancelled_at.elapsed() < Duration::from_millis(500),
        "took {:?}",
        cancelled_at.elapsed()
    );
    let mut events = vec![started, first];
    events.extend(tail.iter().cloned());
    assert_well_formed(&events);
    assert_eq!(done(&tail)["stop_reason"], "cancelled");
    let answer_len = tail
        .iter()
        .filter(|e| kind(e) == v1::EventType::FinalAnswer && !e.done)
        .count();
    assert!(
        answer_len < 10,
        "the model stream was cut, not drained: {answer_len} more deltas"
    );
}

#[tokio::test]
async fn a_client_that_disconnects_cancels_its_run_unless_detached() {
    let mut s = stack().await;
    let engine_id = s.engine_for(agent("slow", &[])).await;
    let mut stream = s.start(&engine_id, "bye").await;
    let run_id = stream.next().await.unwrap().unwrap().run_id;
    drop(stream);
    let state = s
        .ended(
            &run_id,
            Duration::from_secs(5),
            "the run kept going after the client left",
        )
        .await;
    assert_eq!(
        state.status,
        v1::RunStatus::Cancelled as i32,
        "{:?}\n{}",
        state.error,
        s.agents.logs()
    );

    let mut detached = s
        .engine
        .execute(v1::ExecuteRequest {
            engine_id,
            query: "stay".into(),
            detach: true,
            ..Default::default()
        })
        .await
        .unwrap()
        .into_inner();
    let run_id = detached.next().await.unwrap().unwrap().run_id;
    drop(detached);
    let replay = s
        .engine
        .subscribe(v1::SubscribeRequest {
            run_id: run_id.clone(),
            after_sequence: 0,
        })
        .await
        .unwrap()
        .into_inner();
    let events = collect(replay).await;
    assert_eq!(
        done(&events)["stop_reason"],
        "final_answer",
        "a detached run goes on"
    );
}

/// A retry with `detach` of a run started without it keeps the run going when the first
/// client goes away: the retry's stream gets the run's answer, not a cancel.
#[tokio::test]
async fn a_detached_retry_keeps_its_run_when_the_first_client_leaves() {
    let mut s = stack().await;
    let engine_id = s.engine_for(agent("slow", &[])).await;
    let request = v1::ExecuteRequest {
        engine_id,
        query: "stay".into(),
        message_id: "m-detached-retry".into(),
        ..Default::default()
    };
    let mut first = s
        .engine
        .execute(request.clone())
        .await
        .unwrap()
        .into_inner();
    let run_id = first.next().await.unwrap().unwrap().run_id;
    let retried = s
        .engine
        .execute(v1::ExecuteRequest {
            detach: true,
            ..request
        })
        .await
        .unwrap()
        .into_inner();
    drop(first);
    let events = collect(retried).await;
    assert!(events.iter().all(|e| e.run_id == run_id), "the same run");
    assert_eq!(
        done(&events)["stop_reason"],
        "final_answer",
        "the run outlives the client that left: {events:#?}"
    );
}

/// Starts a run of `engine_id` with `message_id` and retries it at once: both streams,
/// and the retry's first event (checked to be the first run's).
async fn execute_and_retry(
    s: &mut Stack,
    engine_id: &str,
    message_id: &str,
) -> (
    Streaming<v1::AgentStreamEvent>,
    Streaming<v1::AgentStreamEvent>,
    v1::AgentStreamEvent,
) {
    let request = common::turn(engine_id, message_id);
    let mut first = s
        .engine
        .execute(request.clone())
        .await
        .unwrap()
        .into_inner();
    let run_id = first.next().await.unwrap().unwrap().run_id;
    let mut retry = s.engine.execute(request).await.unwrap().into_inner();
    let replayed = retry.next().await.unwrap().unwrap();
    assert_eq!(replayed.run_id, run_id, "the retry re-attached");
    (first, retry, replayed)
}

#[tokio::test]
async fn a_retry_attached_before_the_first_disconnect_is_noticed_keeps_the_run() {
    // A client whose connection broke retries with the same message id; the server
    // notices the first connection's end only later. The retry has the run: the first
    // stream's end does not cancel it, and the run ends as it would have.
    let mut s = stack().await;
    let engine_id = s.engine_for(agent("slow", &[])).await;
    let (first, retry, replayed) = execute_and_retry(&mut s, &engine_id, "turn-1").await;
    drop(first);
    let mut events = vec![replayed];
    events.extend(rest(retry).await);
    assert_well_formed(&events);
    assert_eq!(
        done(&events)["stop_reason"],
        "final_answer",
        "{}",
        s.agents.logs()
    );

    // Once the last of them goes, the run is cancelled as before.
    let (first, retry, replayed) = execute_and_retry(&mut s, &engine_id, "turn-2").await;
    let run_id = replayed.run_id;
    drop(first);
    drop(retry);
    let state = s
        .ended(
            &run_id,
            Duration::from_secs(5),
            "the run kept going after both streams left",
        )
        .await;
    assert_eq!(state.status, v1::RunStatus::Cancelled as i32);
}

#[tokio::test]
async fn subscribe_replays_from_an_offset_live_and_after_the_end() {
    let mut s = stack().await;
    let engine_id = s.engine_for(agent("slow", &[])).await;
    let mut stream = s.start(&engine_id, "watch").await;
    let first = stream.next().await.unwrap().unwrap();
    let live = s
        .engine
        .subscribe(v1::SubscribeRequest {
            run_id: first.run_id.clone(),
            after_sequence: 1,
        })
        .await
        .unwrap()
        .into_inner();
    let mut all = vec![first.clone()];
    all.extend(rest(stream).await);
    assert_well_formed(&all);
    let mut followed = Vec::new();
    let mut live = live;
    while let Some(event) = live.next().await {
        followed.push(event.unwrap());
    }
    assert_eq!(followed.first().unwrap().sequence, 2);
    assert_eq!(
        followed.len() + 1,
        all.len(),
        "every later event exactly once"
    );

    let after_end = s
        .engine
        .subscribe(v1::SubscribeRequest {
            run_id: first.run_id.clone(),
            after_sequence: 5,
        })
        .await
        .unwrap()
        .into_inner();
    let tail: Vec<u64> = collect_tail(after_end).await;
    assert_eq!(tail, (6..=all.len() as u64).collect::<Vec<_>>());

    let status = s
        .engine
        .subscribe(v1::SubscribeRequest {
            run_id: "no-such-run".into(),
            after_sequence: 0,
        })
        .await
        .unwrap_err();
    assert_eq!(status.code(), Code::NotFound);
}

async fn collect_tail(mut stream: Streaming<v1::AgentStreamEvent>) -> Vec<u64> {
    let mut sequences = Vec::new();
    while let Some(event) = stream.next().await {
        sequences.push(event.unwrap().sequence);
    }
    sequences
}

/// Ended runs keep at most `runs.retained_events` events for replay, all together: the
/// log of the run that ended first goes early, `Subscribe` to it says so precisely, and
/// `GetRun` still tells how it ended.
#[tokio::test]
async fn ended_runs_beyond_the_retained_events_cannot_be_replayed_but_are_still_known() {
    let dir = std::env::temp_dir().join(format!("agentrt-retained-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let config = dir.join("agent-server.toml");
    std::fs::write(&config, "[runs]\nretained_events = 3\n").unwrap();
    let mut s = stack_with(&["--config", config.to_str().unwrap()]).await;
    let engine_id = s.engine_for(agent("memory", &[])).await;
    let mut runs = Vec::new();
    for query in ["first", "second"] {
        let events = rest(s.start(&engine_id, query).await).await;
        assert_well_formed(&events);
        assert_eq!(
            events.len(),
            3,
            "run started, an answer delta and done: {events:?}"
        );
        runs.push(events[0].run_id.clone());
    }
    let subscribe = |run_id: &str| {
        let mut engine = s.engine.clone();
        let request = v1::SubscribeRequest {
            run_id: run_id.into(),
            after_sequence: 0,
        };
        async move { engine.subscribe(request).await }
    };
    let dropped = subscribe(&runs[0]).await.unwrap_err();
    assert_eq!(dropped.code(), Code::OutOfRange, "{dropped:?}");
    assert!(
        dropped.message().contains("no longer retained") && dropped.message().contains("GetRun"),
        "{dropped:?}"
    );
    let kept = collect_tail(subscribe(&runs[1]).await.unwrap().into_inner()).await;
    assert_eq!(kept, [1, 2, 3]);
    let state = s
        .engine
        .get_run(v1::GetRunRequest {
            run_id: runs[0].clone(),
        })
        .await
        .unwrap()
        .into_inner();
    assert_eq!(state.status, v1::RunStatus::Succeeded as i32);
    std::fs::remove_dir_all(&dir).ok();
}

#[tokio::test]
async fn the_same_message_id_reattaches_instead_of_running_twice() {
    let mut s = stack().await;
    let engine_id = s.engine_for(agent("demo", &["calculator"])).await;
    let request = v1::ExecuteRequest {
        engine_id,
        query: "What is 1 + 2?".into(),
        message_id: "msg-1".into(),
        ..Default::default()
    };
    let first = collect(
        s.engine
            .execute(request.clone())
            .await
            .unwrap()
            .into_inner(),
    )
    .await;
    let second = collect(s.engine.execute(request).await.unwrap().into_inner()).await;
    assert_eq!(first[0].run_id, second[0].run_id);
    assert_eq!(first.len(), second.len());
    assert_eq!(second[0].message_id, "msg-1");
}

#[tokio::test]
async fn history_carries_across_runs_within_the_budget() {
    let mut s = stack().await;
    let engine_id = s.engine_for(agent("memory", &[])).await;
    let first = collect(s.start(&engine_id, "one").await).await;
    assert_eq!(text(&first, v1::EventType::FinalAnswer), "seen 1");
    let second = collect(s.start(&engine_id, "two").await).await;
    assert_eq!(
        text(&second, v1::EventType::FinalAnswer),
        "seen 2",
        "the session's history was sent"
    );

    // Explicit context replaces the session's history.
    let explicit = s
        .engine
        .execute(v1::ExecuteRequest {
            engine_id: engine_id.clone(),
            query: "three".into(),
            llm_context: vec![
                v1::ChatMessage {
                    role: v1::Role::User as i32,
                    content: "a".into(),
                    ..Default::default()
                },
                v1::ChatMessage {
                    role: v1::Role::Assistant as i32,
                    content: "b".into(),
                    ..Default::default()
                },
                v1::ChatMessage {
                    role: v1::Role::User as i32,
                    content: "c".into(),
                    ..Default::default()
                },
            ],
            ..Default::default()
        })
        .await
        .unwrap()
        .into_inner();
    assert_eq!(
        text(&collect(explicit).await, v1::EventType::FinalAnswer),
        "seen 3"
    );

    // A tight budget drops the oldest turns first.
    let mut tight = agent("memory", &[]);
    tight.context = Some(v1::ContextConfig {
        max_prompt_tokens: 256,
    });
    let engine_id = s.engine_for(tight).await;
    let long = "word ".repeat(400);
    collect(s.start(&engine_id, &long).await).await;
    let trimmed = collect(s.start(&engine_id, "short").await).await;
    assert_eq!(
        text(&trimmed, v1::EventType::FinalAnswer),
        "seen 1",
        "the long turn no longer fits"
    );
}

#[tokio::test]
async fn bad_execute_requests_are_refused_precisely() {
    let mut s = stack().await;
    let status = s
        .engine
        .execute(v1::ExecuteRequest {
            engine_id: "nope".into(),
            query: "q".into(),
            ..Default::default()
        })
        .await
        .unwrap_err();
    assert_eq!(status.code(), Code::NotFound);
    let engine_id = s.engine_for(agent("demo", &[])).await;
    let status = s
        .engine
        .execute(v1::ExecuteRequest {
            engine_id: engine_id.clone(),
            query: "  ".into(),
            ..Default::default()
        })
        .await
        .unwrap_err();
    assert_eq!(status.code(), Code::InvalidArgument);
    assert!(status.message().contains("query"));
    let status = s
        .engine
        .execute(v1::ExecuteRequest {
            engine_id: engine_id.clone(),
            query: "q".into(),
            session_id: "other".into(),
            ..Default::default()
        })
        .await
        .unwrap_err();
    assert_eq!(status.code(), Code::InvalidArgument);
    assert!(status.message().contains("session_id"));
    let status = s
        .engine
        .execute(v1::ExecuteRequest {
            engine_id,
            query: "q".into(),
            llm_context: vec![v1::ChatMessage::default()],
            ..Default::default()
        })
        .await
        .unwrap_err();
    assert!(
        status.message().contains("llm_context[0].role"),
        "{}",
        status.message()
    );
    for status in [
        s.engine
            .get_run(v1::GetRunRequest {
                run_id: "nope".into(),
            })
            .await
            .unwrap_err(),
        s.engine
            .cancel(v1::CancelRequest {
                run_id: "nope".into(),
            })
            .await
            .unwrap_err(),
    ] {
        assert_eq!(status.code(), Code::NotFound);
    }
}

/// SIGTERM gives runs in progress the drain grace to finish: one that finishes within it
/// ends with its answer.
#[tokio::test]
async fn sigterm_lets_running_runs_finish_within_the_grace() {
    let mut s = stack().await;
    let engine_id = s.engine_for(agent("slow", &[])).await;
    let mut stream = s.start(&engine_id, "long").await;
    let first = stream.next().await.unwrap().unwrap();
    s.agents.terminate();
    let mut events = vec![first];
    events.extend(rest(stream).await);
    assert_well_formed(&events);
    assert_eq!(done(&events)["stop_reason"], "final_answer");
    assert_eq!(
        text(&events, v1::EventType::FinalAnswer),
        "a very slow answer, one character at a time, taking its time"
    );
    assert_eq!(s.agents.wait(Duration::from_secs(15)).await.code(), Some(0));
    let _ = &s.model;
}

/// A run that outlives the drain grace ends with an ERROR `done` event (stop reason
/// shutdown) before the grace is over, and the process exits 0.
#[tokio::test]
async fn sigterm_ends_runs_that_outlive_the_grace_with_a_done_event() {
    let mut s = stack_with(&["--drain-grace", "4s"]).await;
    let engine_id = s.engine_for(agent("slower", &[])).await;
    let mut stream = s.start(&engine_id, "long").await;
    let first = stream.next().await.unwrap().unwrap();
    let terminated = Instant::now();
    s.agents.terminate();
    let mut events = vec![first];
    // The stream ends whole (the server closes what is left when the grace is over, which
    // would break it), having had most of the grace to finish.
    events.extend(rest(stream).await);
    assert!(
        terminated.elapsed() >= Duration::from_secs(2),
        "the run was not given the grace: stopped after {:?}",
        terminated.elapsed()
    );
    assert_well_formed(&events);
    assert_eq!(done(&events)["stop_reason"], "shutdown");
    assert_eq!(done(&events)["retryable"], true);
    assert_eq!(s.agents.wait(Duration::from_secs(15)).await.code(), Some(0));
    let _ = &s.model;
}
