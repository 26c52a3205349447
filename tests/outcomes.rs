//! Honest run outcomes end to end: the real binaries against a model simulator that
//! misbehaves as third-party OpenAI-compatible servers do (ignoring `stop`, refusing
//! `content: null`, ending streams early, reporting no usage, endless or huge lines), and
//! clients that send what a careful client would not.
//!
//! Needs nothing beyond the workspace's own binaries.

// Tests fail by panicking, with the value that was wrong.
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use std::time::{Duration, Instant};

use agentrt::v1;
use common::{Stack, agent, assert_well_formed, collect, done, kind, of_kind, rest, text};
use tokio_stream::StreamExt;
use tonic::Code;

const SCENARIOS: &str = r#"{"scenarios": {
  "late": {"turns": [{"content": "finally", "latency_ms": 3000}]},
  "strict": {"strict_messages": true, "turns": [
    {"tool_calls": [{"name": "calculator", "arguments": {"expression": "6 * 7"}}]},
    {"content": "it is {tool_results}"}]},
  "chatty": {"turns": [
    {"content": "Let me compute that.", "tool_calls": [{"name": "calculator", "arguments": {"expression": "6 * 7"}}]},
    {"content": "It is {tool_results}.", "chunk_chars": 3}]},
  "inventive": {"turns": [
    {"content": "Thought: I need the calculator.\nAction: calculator\nAction Input: {\"expression\": \"6 * 7\"}\nObservation: 99\nThought: done\nFinal Answer: invented 99", "ignore_stop": true},
    {"content": "Thought: now I know\nFinal Answer:  it is 42", "ignore_stop": true}]},
  "plain": {"turns": [{"content": "Just 42, no protocol.", "chunk_chars": 4}]},
  "empty": {"turns": [{"content": ""}]},
  "unfinished": {"turns": [{"content": "half an ans", "omit_finish": true}]},
  "not_sse": {"turns": [{"plain_body": "{\"choices\": [{\"message\": {\"content\": \"hi\"}}]}", "plain_content_type": "application/json"}]},
  "unterminated": {"turns": [{"content": "cut", "unterminated_last_line": true, "omit_usage": true}]},
  "cut_short": {"turns": [{"content": "The answer is forty", "finish_reason": "length"}]},
  "filtered": {"turns": [{"content": "The answer is", "finish_reason": "content_filter"}]},
  "quiet": {"turns": [{"content": "hello world", "omit_usage": true}]},
  "lingering": {"turns": [
    {"tool_calls": [{"name": "calculator", "arguments": {"expression": "6 * 7"}}], "linger_ms": 5000},
    {"content": "it is {tool_results}", "linger_ms": 5000}]},
  "endless": {"turns": [{"content": "start", "endless_line": true}]},
  "huge_delta": {"turns": [{"content": "abcd", "repeat_content": 1310720, "chunk_chars": 6000000}]},
  "big_answer": {"turns": [{"content": "ab", "repeat_content": 1048576, "chunk_chars": 65536}]},
  "ten_mb": {"turns": [{"content": "word ", "repeat_content": 2097152, "chunk_chars": 16384}]},
  "quick": {"turns": [{"content": "ok"}]},
  "slow": {"turns": [{"content": "a very slow answer, one character at a time, taking its time", "chunk_chars": 1, "chunk_delay_ms": 50}]},
  "flood": {"turns": [{"content": "x", "repeat_content": 20000, "chunk_chars": 1}]},
  "deep": {"turns": [
    {"tool_calls": [{"name": "calculator", "raw_arguments": "{\"a\":{\"a\":{\"a\":{\"a\":{\"a\":{\"a\":{\"a\":{\"a\":{\"a\":{\"a\":{\"a\":{\"a\":{\"a\":{\"a\":{\"a\":{\"a\":{\"a\":{\"a\":{\"a\":{\"a\":{\"a\":{\"a\":{\"a\":{\"a\":{\"a\":{\"a\":{\"a\":{\"a\":{\"a\":{\"a\":{\"a\":{\"a\":{\"a\":{\"a\":{\"a\":1}}}}}}}}}}}}}}}}}}}}}}}}}}}}}}}}}}}"}]},
    {"content": "the tool said: {tool_results}"}]}
}}"#;

async fn stack() -> Stack {
    Stack::up(SCENARIOS, &[]).await
}

/// The final answer rule of the contract: the answer deltas of the `done` event's round.
fn answer_by_the_rule(events: &[v1::AgentStreamEvent]) -> String {
    let last = events.last().unwrap();
    events
        .iter()
        .filter(|e| {
            kind(e) == v1::EventType::FinalAnswer && !e.done && e.iteration == last.iteration
        })
        .map(|e| e.content.as_str())
        .collect()
}

async fn run(s: &mut Stack, config: v1::AgentConfig, query: &str) -> Vec<v1::AgentStreamEvent> {
    s.run(config, query).await
}

fn react(model: &str) -> v1::AgentConfig {
    v1::AgentConfig {
        strategy: v1::Strategy::React as i32,
        ..agent(model, &["calculator"])
    }
}

#[tokio::test]
async fn the_run_id_comes_first_before_a_slow_model_answers() {
    let mut s = stack().await;
    let engine_id = s.engine_for(agent("late", &[])).await;
    let asked = Instant::now();
    let mut stream = s.start(&engine_id, "anyone there?").await;
    let first = stream.next().await.unwrap().unwrap();
    assert!(
        asked.elapsed() < Duration::from_millis(2500),
        "the first event waited for the model: {:?}",
        asked.elapsed()
    );
    assert_eq!(kind(&first), v1::EventType::RunStarted);
    assert_eq!(first.sequence, 1);
    assert!(!first.run_id.is_empty());
    // The run id is usable at once.
    let state = s.state(&first.run_id).await;
    assert_eq!(state.status, v1::RunStatus::Running as i32);
    s.engine
        .cancel(v1::CancelRequest {
            run_id: first.run_id.clone(),
        })
        .await
        .unwrap();
    let mut events = vec![first];
    events.extend(rest(stream).await);
    assert_well_formed(&events);
    assert_eq!(done(&events)["stop_reason"], "cancelled");
}

#[tokio::test]
async fn tool_rounds_work_on_servers_that_refuse_null_content() {
    let mut s = stack().await;
    let events = run(&mut s, agent("strict", &["calculator"]), "6 * 7?").await;
    assert_eq!(done(&events)["stop_reason"], "final_answer", "{events:#?}");
    assert_eq!(answer_by_the_rule(&events), "it is 42");
}

#[tokio::test]
async fn text_before_tool_calls_is_not_part_of_the_answer() {
    let mut s = stack().await;
    let events = run(&mut s, agent("chatty", &["calculator"]), "6 * 7?").await;
    assert_eq!(done(&events)["stop_reason"], "final_answer");
    let answer = answer_by_the_rule(&events);
    assert_eq!(answer, "It is 42.");
    let state = s.state(&events[0].run_id).await;
    assert_eq!(state.final_answer, answer, "GetRun follows the rule");
    assert!(!state.truncated);
}

#[tokio::test]
async fn react_cuts_at_the_stop_sequence_when_the_server_ignores_it() {
    let mut s = stack().await;
    let events = run(&mut s, react("inventive"), "6 * 7?").await;
    let results = of_kind(&events, v1::EventType::ToolResult);
    assert_eq!(results.len(), 1, "the action ran: {events:#?}");
    assert_eq!(results[0]["output"], "42");
    assert_eq!(done(&events)["stop_reason"], "final_answer");
    assert_eq!(
        answer_by_the_rule(&events),
        "it is 42",
        "no stray leading space"
    );
    assert!(
        events.iter().all(|e| !e.content.contains("invented")),
        "the model's invented observation and answer were cut"
    );
}

#[tokio::test]
async fn react_replies_without_markers_are_streamed_once_as_the_answer() {
    let mut s = stack().await;
    let events = run(&mut s, react("plain"), "6 * 7?").await;
    assert_eq!(
        text(&events, v1::EventType::Thought),
        "",
        "not streamed twice"
    );
    assert_eq!(answer_by_the_rule(&events), "Just 42, no protocol.");
    assert_eq!(done(&events)["stop_reason"], "final_answer");
}

#[tokio::test]
async fn empty_and_broken_responses_are_model_errors_never_answers() {
    let mut s = stack().await;
    for (model, code) in [
        ("empty", "MODEL_EMPTY_RESPONSE"),
        ("unfinished", ""),
        ("not_sse", ""),
    ] {
        let events = run(&mut s, agent(model, &[]), "hi").await;
        let last = events.last().unwrap();
        assert_eq!(kind(last), v1::EventType::Error, "{model}: {events:#?}");
        assert_eq!(done(&events)["stop_reason"], "model_error", "{model}");
        if !code.is_empty() {
            assert_eq!(done(&events)["code"], code, "{model}");
        }
        let state = s.state(&last.run_id).await;
        assert_eq!(state.status, v1::RunStatus::Failed as i32, "{model}");
        assert_eq!(state.final_answer, "", "{model}");
    }
    // Torn in its last line after the finish reason: only `[DONE]` is lost, and the answer
    // stands (its usage estimated, as the provider's was lost with the end).
    let events = run(&mut s, agent("unterminated", &[]), "hi").await;
    assert_eq!(done(&events)["stop_reason"], "final_answer", "{events:#?}");
    assert_eq!(answer_by_the_rule(&events), "cut");
    assert_eq!(done(&events)["usage"]["estimated"], true, "{events:#?}");
}

#[tokio::test]
async fn a_token_limit_ends_with_the_partial_answer_and_says_so() {
    let mut s = stack().await;
    let events = run(&mut s, agent("cut_short", &[]), "hi").await;
    let last = events.last().unwrap();
    assert_eq!(kind(last), v1::EventType::FinalAnswer);
    assert_eq!(done(&events)["stop_reason"], "max_tokens");
    assert!(
        done(&events)["message"]
            .as_str()
            .unwrap()
            .contains("cut short")
    );
    let state = s.state(&last.run_id).await;
    assert_eq!(state.stop_reason, v1::StopReason::MaxTokens as i32);
    assert_eq!(state.status, v1::RunStatus::Incomplete as i32);
    assert_eq!(state.final_answer, "The answer is forty");
}

#[tokio::test]
async fn an_answer_the_content_filter_stopped_is_an_error_without_an_answer() {
    let mut s = stack().await;
    let events = run(&mut s, agent("filtered", &[]), "hi").await;
    let last = events.last().unwrap();
    assert_eq!(kind(last), v1::EventType::Error);
    assert_eq!(done(&events)["stop_reason"], "model_error");
    assert_eq!(done(&events)["code"], "MODEL_CONTENT_FILTERED");
    let state = s.state(&last.run_id).await;
    assert_eq!(state.stop_reason, v1::StopReason::ModelError as i32);
    assert_eq!(state.status, v1::RunStatus::Failed as i32);
    assert_eq!(state.final_answer, "");
}

#[tokio::test]
async fn usage_a_provider_does_not_report_is_counted_and_marked() {
    let mut s = stack().await;
    let events = run(&mut s, agent("quiet", &[]), "hi").await;
    let usage = &done(&events)["usage"];
    assert_eq!(usage["estimated"], true, "{usage}");
    assert_eq!(
        usage["completion_tokens"], 2.0,
        "\"hello world\" is two tokens"
    );
    assert!(usage["prompt_tokens"].as_f64().unwrap() > 0.0);
    let state = s.state(&events[0].run_id).await;
    assert!(state.usage.unwrap().estimated);
    // A provider that reports usage is not marked.
    let events = run(&mut s, agent("quick", &[]), "hi").await;
    assert_eq!(done(&events)["usage"]["estimated"], false);
}

#[tokio::test]
async fn arguments_nested_too_deep_go_back_to_the_model_as_a_bad_call() {
    let mut s = stack().await;
    let events = run(&mut s, agent("deep", &["calculator"]), "hi").await;
    let results = of_kind(&events, v1::EventType::ToolResult);
    assert_eq!(results[0]["is_error"], true);
    assert!(
        results[0]["output"]
            .as_str()
            .unwrap()
            .contains("nest deeper")
    );
    assert!(
        of_kind(&events, v1::EventType::ToolCall)[0]["arguments"]["raw"].is_string(),
        "the call event carries the raw text, which every client decodes"
    );
    assert_eq!(done(&events)["stop_reason"], "final_answer");
}

#[tokio::test]
async fn an_endless_sse_line_fails_the_run_and_memory_stays_bounded() {
    let mut s = stack().await;
    let started = Instant::now();
    let events = run(&mut s, agent("endless", &[]), "hi").await;
    assert_eq!(done(&events)["stop_reason"], "model_error", "{events:#?}");
    assert!(
        done(&events)["message"].as_str().unwrap().contains("MiB")
            || done(&events)["message"].as_str().unwrap().contains("bytes"),
        "the error names the bound: {}",
        done(&events)["message"]
    );
    assert!(started.elapsed() < Duration::from_secs(30));
    let rss_kb = rss_kb(s.agents.pid().unwrap());
    assert!(rss_kb < 300 * 1024, "agent-server holds {rss_kb} KiB");
}

fn rss_kb(pid: u32) -> u64 {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap();
    status
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
        .unwrap()
}

#[tokio::test]
async fn a_huge_delta_and_a_big_answer_stay_within_the_message_limit() {
    let mut s = stack().await;
    // One 5 MiB delta from the model: more than the 4 MiB message limit.
    let events = run(&mut s, agent("huge_delta", &[]), "hi").await;
    assert_eq!(done(&events)["stop_reason"], "final_answer");
    let answer = answer_by_the_rule(&events);
    assert_eq!(answer.len(), 4 * 1_310_720);
    assert!(events.iter().all(|e| e.content.len() <= 64 * 1024));
    // GetRun of a 5 MiB answer (held by its step and as the final answer) answers,
    // within the limit, and says what it cut.
    let state = s.state(&events[0].run_id).await;
    assert!(state.truncated);
    assert!(state.final_answer.len() < 4 * 1024 * 1024);

    // A 2 MiB answer: the response would hold it twice; the answer itself is kept whole.
    let events = run(&mut s, agent("big_answer", &[]), "hi").await;
    let answer = answer_by_the_rule(&events);
    assert_eq!(answer.len(), 2 * 1_048_576);
    let state = s.state(&events[0].run_id).await;
    assert_eq!(state.final_answer, answer);
    assert!(state.truncated, "the step's copy was cut instead");
}

#[tokio::test]
async fn a_ten_megabyte_answer_does_not_hold_up_other_runs() {
    let mut s = stack().await;
    let big_engine = s.engine_for(agent("ten_mb", &[])).await;
    let quick_engine = s.engine_for(agent("quick", &[])).await;
    let mut big = s.start(&big_engine, "write a lot").await;
    // Wait until the big answer streams, then start other runs meanwhile.
    loop {
        let event = big.next().await.unwrap().unwrap();
        if kind(&event) == v1::EventType::FinalAnswer {
            break;
        }
    }
    let big_run = tokio::spawn(rest(big));
    let mut slowest = Duration::ZERO;
    for _ in 0..5 {
        let asked = Instant::now();
        let mut stream = s.start(&quick_engine, "hi").await;
        stream.next().await.unwrap().unwrap();
        slowest = slowest.max(asked.elapsed());
        rest(stream).await;
    }
    let events = big_run.await.unwrap();
    assert!(events.last().unwrap().done);
    assert!(
        slowest < Duration::from_millis(1500),
        "another run's first event took {slowest:?} while one answer streamed 10 MB"
    );
}

#[tokio::test]
async fn a_retry_after_the_clients_own_disconnect_gets_a_new_run() {
    let mut s = stack().await;
    let engine_id = s.engine_for(agent("slow", &[])).await;
    let request = common::turn(&engine_id, "turn-1");
    let mut first = s
        .engine
        .execute(request.clone())
        .await
        .unwrap()
        .into_inner();
    let first_run = first.next().await.unwrap().unwrap().run_id;
    drop(first);
    s.ended(
        &first_run,
        Duration::from_secs(10),
        "the disconnect did not cancel the run",
    )
    .await;
    let retry = collect(
        s.engine
            .execute(request.clone())
            .await
            .unwrap()
            .into_inner(),
    )
    .await;
    assert_ne!(
        retry[0].run_id, first_run,
        "not the run its disconnect cancelled"
    );
    assert_eq!(done(&retry)["stop_reason"], "final_answer");
    // A repeat of a run that is not cancelled gets that run back.
    let again = collect(
        s.engine
            .execute(request.clone())
            .await
            .unwrap()
            .into_inner(),
    )
    .await;
    assert_eq!(again[0].run_id, retry[0].run_id);
    // The same message id with another query is refused, not answered with the other's.
    let status = s
        .engine
        .execute(v1::ExecuteRequest {
            query: "something else".into(),
            ..request.clone()
        })
        .await
        .unwrap_err();
    assert_eq!(status.code(), Code::AlreadyExists, "{status:?}");
    assert!(
        status.message().contains("with another query"),
        "{status:?}"
    );
    assert_eq!(
        tonic_types::StatusExt::get_details_error_info(&status)
            .expect("an ErrorInfo")
            .reason,
        "MESSAGE_ID_REUSED"
    );
}

#[tokio::test]
async fn a_client_that_lags_behind_the_replay_log_does_not_cancel_its_run() {
    let dir = std::env::temp_dir().join(format!("agentrt-lag-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let config = dir.join("agent-server.toml");
    std::fs::write(&config, "[runs]\nevents_per_run = 50\n").unwrap();
    let mut s = Stack::up(SCENARIOS, &["--config", config.to_str().unwrap()]).await;
    let engine_id = s.engine_for(agent("flood", &[])).await;
    let mut stream = s.start(&engine_id, "flood me").await;
    let run_id = stream.next().await.unwrap().unwrap().run_id;
    // Read nothing while the run publishes 20,000 deltas: the log keeps 50.
    tokio::time::sleep(Duration::from_secs(3)).await;
    let mut lagged = None;
    while let Some(item) = stream.next().await {
        if let Err(status) = item {
            lagged = Some(status);
            break;
        }
    }
    let status = lagged.expect("the lagging client was told");
    assert_eq!(status.code(), Code::OutOfRange, "{status:?}");
    let info = tonic_types::StatusExt::get_details_error_info(&status).expect("an ErrorInfo");
    assert_eq!(info.reason, "EVENTS_LAGGED");
    // The client of an Execute may have no run id yet: the error gives it, to resume with.
    assert_eq!(info.metadata.get("run"), Some(&run_id), "{status:?}");
    assert!(
        status.message().contains(&run_id) && status.message().contains("Subscribe"),
        "{status:?}"
    );
    let mut resume_after = resume_after_of(&status);
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let state = s.state(&run_id).await;
        if state.status != v1::RunStatus::Running as i32 {
            assert_eq!(
                state.status,
                v1::RunStatus::Succeeded as i32,
                "not cancelled"
            );
            break;
        }
        assert!(Instant::now() < deadline);
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    // A client goes on from where the error says (from its own cursor it would be told
    // the same again): it reaches the run's end.
    let mut tries = 0;
    let events = loop {
        tries += 1;
        assert!(tries <= 3, "still lagging");
        let resumed = s
            .engine
            .subscribe(v1::SubscribeRequest {
                run_id: run_id.clone(),
                after_sequence: resume_after,
            })
            .await
            .unwrap()
            .into_inner();
        match resumed.collect::<Vec<_>>().await.into_iter().collect() {
            Ok(events) => break events,
            Err(status) => {
                let next = resume_after_of(&status);
                assert!(next > resume_after, "{status:?}");
                resume_after = next;
            }
        }
    };
    let events: Vec<v1::AgentStreamEvent> = events;
    assert_eq!(events.first().map(|e| e.sequence), Some(resume_after + 1));
    assert!(events.last().is_some_and(|e| e.done), "read on to the end");
}

/// The `ErrorInfo` metadata `resume_after` of an `EVENTS_LAGGED` status, which its
/// `after_sequence` (as every status a stream resumes from has it) repeats.
fn resume_after_of(status: &tonic::Status) -> u64 {
    assert_eq!(status.code(), Code::OutOfRange, "{status:?}");
    let info = tonic_types::StatusExt::get_details_error_info(status).expect("an ErrorInfo");
    assert_eq!(info.reason, "EVENTS_LAGGED");
    let resume_after = info.metadata.get("resume_after").expect("where to resume");
    assert_eq!(info.metadata.get("after_sequence"), Some(resume_after));
    resume_after.parse().unwrap()
}

#[tokio::test]
async fn subscribe_at_or_beyond_the_end() {
    let mut s = stack().await;
    // An ended run: nothing is sent, and the stream ends OK.
    let events = run(&mut s, agent("quick", &[]), "hi").await;
    let run_id = events[0].run_id.clone();
    let last = events.last().unwrap().sequence;
    for after_sequence in [last, last + 1, u64::MAX] {
        let replay = s
            .engine
            .subscribe(v1::SubscribeRequest {
                run_id: run_id.clone(),
                after_sequence,
            })
            .await
            .unwrap()
            .into_inner();
        assert!(rest(replay).await.is_empty(), "after {after_sequence}");
    }
    // A running run: the subscriber waits, and gets the `done` event like anyone.
    let engine_id = s.engine_for(agent("slow", &[])).await;
    let mut stream = s.start(&engine_id, "talk").await;
    let run_id = stream.next().await.unwrap().unwrap().run_id;
    let beyond = s
        .engine
        .subscribe(v1::SubscribeRequest {
            run_id: run_id.clone(),
            after_sequence: u64::MAX,
        })
        .await
        .unwrap()
        .into_inner();
    let tail = rest(beyond).await;
    assert_eq!(tail.len(), 1, "{tail:#?}");
    assert!(tail[0].done);
    assert_eq!(done(&tail)["stop_reason"], "final_answer");
    drop(stream);
}

#[tokio::test]
async fn statuses_stay_within_what_standard_clients_accept() {
    let mut s = stack().await;
    let mut config = agent("quick", &[]);
    config.tools = (0..40)
        .map(|i| v1::ToolRef {
            name: format!("unknown_tool_with_a_rather_long_name_number_{i:02}"),
            require_approval: false,
        })
        .collect();
    let status = s
        .service
        .create_agent_engine(v1::CreateAgentEngineRequest {
            config: Some(config),
            session_id: String::new(),
        })
        .await
        .unwrap_err();
    assert_eq!(status.code(), Code::InvalidArgument, "{status:?}");
    assert!(status.message().contains("tools[0].name"));
    assert!(status.message().contains("more"), "{}", status.message());
    assert!(status.message().len() + status.details().len() < 8 * 1024);
}

#[tokio::test]
async fn limits_in_characters_count_characters() {
    let mut s = stack().await;
    let engine_id = s.engine_for(agent("quick", &[])).await;
    let request = |message_id: String| v1::ExecuteRequest {
        engine_id: engine_id.clone(),
        message_id,
        query: "hi".into(),
        ..Default::default()
    };
    let events = collect(
        s.engine
            .execute(request("é".repeat(128)))
            .await
            .unwrap()
            .into_inner(),
    )
    .await;
    assert_eq!(done(&events)["stop_reason"], "final_answer");
    let status = s
        .engine
        .execute(request("é".repeat(129)))
        .await
        .unwrap_err();
    assert_eq!(status.code(), Code::InvalidArgument);
}

/// Sends bytes as a request, unencoded, and reads the answer as bytes.
#[derive(Clone, Default)]
struct RawCodec;

struct RawEncoder;
struct RawDecoder;

impl tonic::codec::Codec for RawCodec {
    type Encode = Vec<u8>;
    type Decode = Vec<u8>;
    type Encoder = RawEncoder;
    type Decoder = RawDecoder;
    fn encoder(&mut self) -> RawEncoder {
        RawEncoder
    }
    fn decoder(&mut self) -> RawDecoder {
        RawDecoder
    }
}

impl tonic::codec::Encoder for RawEncoder {
    type Item = Vec<u8>;
    type Error = tonic::Status;
    fn encode(
        &mut self,
        item: Vec<u8>,
        dst: &mut tonic::codec::EncodeBuf<'_>,
    ) -> Result<(), tonic::Status> {
        use bytes::BufMut;
        dst.put_slice(&item);
        Ok(())
    }
}

impl tonic::codec::Decoder for RawDecoder {
    type Item = Vec<u8>;
    type Error = tonic::Status;
    fn decode(
        &mut self,
        src: &mut tonic::codec::DecodeBuf<'_>,
    ) -> Result<Option<Vec<u8>>, tonic::Status> {
        use bytes::Buf;
        Ok(Some(src.copy_to_bytes(src.remaining()).to_vec()))
    }
}

#[tokio::test]
async fn malformed_protobuf_is_invalid_argument_on_every_rpc() {
    let s = stack().await;
    // Field 1, length-delimited, with a length running past the end.
    let malformed = vec![0x0a, 0xff, 0x01, 0x41];
    let calls = [
        (
            s.agents.url(),
            "/agent.v1.AgentService/ValidateConfig",
            false,
        ),
        (
            s.agents.url(),
            "/agent.v1.AgentService/CreateAgentEngine",
            false,
        ),
        (
            s.agents.url(),
            "/agent.v1.AgentService/GetAgentEngine",
            false,
        ),
        (
            s.agents.url(),
            "/agent.v1.AgentService/DeleteAgentEngine",
            false,
        ),
        (s.agents.url(), "/agent.v1.AgentEngine/Execute", true),
        (s.agents.url(), "/agent.v1.AgentEngine/Subscribe", true),
        (s.agents.url(), "/agent.v1.AgentEngine/Cancel", false),
        (s.agents.url(), "/agent.v1.AgentEngine/GetRun", false),
        (s.tools.url(), "/agent.v1.ToolExecutor/ListTools", false),
        (s.tools.url(), "/agent.v1.ToolExecutor/ExecuteTool", false),
    ];
    for (url, path, streaming) in calls {
        let channel = agentrt_test_support::connect(&url).await;
        let mut grpc = tonic::client::Grpc::new(channel);
        grpc.ready().await.unwrap();
        let path = http::uri::PathAndQuery::from_static(path);
        let request = tonic::Request::new(malformed.clone());
        let status = if streaming {
            match grpc.server_streaming(request, path.clone(), RawCodec).await {
                Err(status) => status,
                Ok(response) => {
                    let mut stream = response.into_inner();
                    match stream.next().await {
                        Some(Err(status)) => status,
                        other => panic!("{path}: {other:?}"),
                    }
                }
            }
        } else {
            grpc.unary(request, path.clone(), RawCodec)
                .await
                .unwrap_err()
        };
        assert_eq!(status.code(), Code::InvalidArgument, "{path}: {status:?}");
    }
}

#[tokio::test]
async fn startup_warns_when_no_model_provider_is_configured() {
    let tools = agentrt_test_support::tool_executor(&[]).await;
    let agents = agentrt_test_support::Server::start(
        "agent-server",
        &["--listen", "127.0.0.1:0", "--tool-executor", &tools.url()],
        &[("OPENAI_BASE_URL", ""), ("OPENAI_API_KEY", "")],
    )
    .await;
    assert!(
        agents.logs().contains("no model provider is configured"),
        "{}",
        agents.logs()
    );
    assert!(
        agents.logs().contains("auth=\"none\""),
        "the authentication mode is logged: {}",
        agents.logs()
    );
}

#[tokio::test]
async fn a_server_that_keeps_its_stream_open_after_done_does_not_hold_the_run() {
    // Each answer is whole at `[DONE]`; the server keeps the response open 5 s more. The
    // client reads that end (up to 2 s) rather than resetting the stream, but not on the
    // run's time: each round waited those 2 s before it went on.
    let mut s = stack().await;
    let started = std::time::Instant::now();
    let events = run(&mut s, agent("lingering", &["calculator"]), "6 * 7?").await;
    let took = started.elapsed();
    assert_eq!(done(&events)["stop_reason"], "final_answer", "{events:#?}");
    assert_eq!(answer_by_the_rule(&events), "it is 42");
    assert!(
        took < std::time::Duration::from_millis(1500),
        "two rounds took {took:?}"
    );
}
