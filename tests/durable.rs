//! Durable runs with shared state: a run is owned by one agent-server replica through a
//! lease; when that replica dies (kill -9), is paused past its lease (SIGSTOP) or drains
//! (SIGTERM), another replica goes on with the run from its last completed step, and the
//! run's log stays whole: sequences 1..n without gap or repeat, exactly one `done`, and the
//! final answer rule (the FINAL_ANSWER deltas of the done event's iteration after the last
//! EVENT_TYPE_ROUND_RESTARTED of that iteration) gives `AgentState.final_answer`.
//!
//! Every test here (but the settings one, which only needs it when the setting is wrongly
//! accepted) needs Redis at `AGENTRT_TEST_REDIS` (default `redis://127.0.0.1:6379/0`);
//! `scripts/test` starts one when none answers. Each test keeps its keys under a prefix of
//! its own. The replicas are real `agent-server` processes on one Redis, all with
//! `--takeover-after 1s`, on a real `model-simulator`; the tool executor is a small one
//! served by the test itself, so that it can tell which calls (and `call_id`s) reached it.
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use std::{
    sync::{
        Arc, Mutex,
        atomic::{AtomicUsize, Ordering},
    },
    time::{Duration, Instant},
};

use agentrt::v1::{
    self,
    agent_engine_client::AgentEngineClient,
    agent_service_client::AgentServiceClient,
    tool_executor_server::{ToolExecutor, ToolExecutorServer},
};
use agentrt_test_support::{
    Server, agent_server_with_model, binary,
    conformance::{redis_prefix, redis_url},
    connect, simulator,
};
use common::{agent, assert_well_formed, create_engine, data, done, kind};
use serde_json::json;
use tonic::{Code, Request, Response, Status, Streaming, transport::Channel};

type Event = v1::AgentStreamEvent;
/// The replicas a client may resume on, by id.
type Live = Arc<Mutex<Vec<(usize, AgentEngineClient<Channel>)>>>;

/// What every replica is given as `--takeover-after`.
const TAKEOVER_AFTER: &str = "1s";
/// How long a take-over after a kill may take at most: the lease (1 s) plus a fraction of
/// it, with room for a loaded test machine (the default lease is 10 s).
const TAKEOVER_BOUND: Duration = Duration::from_secs(5);
/// Longest wait for one event before a stream counts as stalled.
const STALL: Duration = Duration::from_secs(30);

/// The answer of `slow`, streamed two characters every `SLOW_DELAY_MS` (about 2 s).
const SLOW_ANSWER: &str = "a durable run goes on from its last step when its replica goes away";
const SLOW_DELAY_MS: u64 = 60;
/// The answer of `steady` (the rolling restart), about 9 s: long enough for the three
/// replicas to be restarted while every run streams it.
const STEADY_ANSWER: &str =
    "every event exactly once, every run to its end, whatever the replicas do";
/// What the test's tool executor answers to `sleep {seconds: 3}`.
const NAP_RESULT: &str = "slept 3 s";

fn scenarios() -> String {
    json!({"scenarios": {
        "slow": {"turns": [{"content": SLOW_ANSWER, "chunk_chars": 2, "chunk_delay_ms": SLOW_DELAY_MS}]},
        "steady": {"turns": [{"content": STEADY_ANSWER, "chunk_chars": 2, "chunk_delay_ms": 250}]},
        "nap": {"turns": [
            {"tool_calls": [{"id": "nap-1", "name": "sleep", "arguments": {"seconds": 3}}]},
            {"content": "rested: {tool_results}"}]},
        "quick": {"turns": [{"content": "still here"}]},
        "naps": {"turns": [
            {"tool_calls": [{"id": "nap-1", "name": "sleep", "arguments": {"seconds": 0}}]},
            {"tool_calls": [{"id": "nap-1", "name": "sleep", "arguments": {"seconds": 0.01}}]},
            {"content": "rested twice"}]},
        "slow_nap": {"turns": [
            {"content": SLOW_ANSWER, "chunk_chars": 2, "chunk_delay_ms": SLOW_DELAY_MS,
             "tool_calls": [{"id": "nap-2", "name": "sleep", "arguments": {"seconds": 0}}]},
            {"content": "rested: {tool_results}"}]}
    }})
    .to_string()
}

// ---------------------------------------------------------------------------------------
// A tool executor of the test's own: `sleep {seconds}`, recording every call it receives.
// ---------------------------------------------------------------------------------------

/// One `ExecuteTool` call as the tool executor received it.
#[derive(Debug, Clone)]
struct CallSeen {
    call_id: String,
    run_id: String,
    at: Instant,
}

#[derive(Default)]
struct ToolLog {
    calls: Mutex<Vec<CallSeen>>,
}

impl ToolLog {
    fn calls(&self) -> Vec<CallSeen> {
        self.calls.lock().unwrap().clone()
    }

    /// Waits until at least `n` calls arrived (at most `limit`).
    async fn wait_for(&self, n: usize, limit: Duration) -> Vec<CallSeen> {
        let deadline = Instant::now() + limit;
        loop {
            let calls = self.calls();
            if calls.len() >= n {
                return calls;
            }
            assert!(
                Instant::now() < deadline,
                "the tool executor received {} calls within {limit:?}, not {n}: {calls:?}",
                calls.len()
            );
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    }
}

#[derive(Clone)]
struct TestTools(Arc<ToolLog>);

#[tonic::async_trait]
impl ToolExecutor for TestTools {
    async fn list_tools(
        &self,
        _: Request<v1::ListToolsRequest>,
    ) -> Result<Response<v1::ListToolsResponse>, Status> {
        let schema = json!({
            "type": "object",
            "properties": {"seconds": {"type": "number", "minimum": 0}},
            "required": ["seconds"]
        });
        Ok(Response::new(v1::ListToolsResponse {
            tools: vec![v1::Tool {
                name: "sleep".into(),
                description: "Waits the given number of seconds.".into(),
                input_schema: agentrt::json::json_to_struct(&schema),
                source: v1::ToolSource::Builtin as i32,
            }],
        }))
    }

    async fn execute_tool(
        &self,
        request: Request<v1::ExecuteToolRequest>,
    ) -> Result<Response<v1::ExecuteToolResponse>, Status> {
        let request = request.into_inner();
        self.0.calls.lock().unwrap().push(CallSeen {
            call_id: request.call_id.clone(),
            run_id: request.run_id.clone(),
            at: Instant::now(),
        });
        let arguments = request
            .arguments
            .as_ref()
            .map_or(serde_json::Value::Null, agentrt::json::struct_to_json);
        let seconds = arguments["seconds"].as_f64().unwrap_or(0.0);
        tokio::time::sleep(Duration::from_secs_f64(seconds)).await;
        Ok(Response::new(v1::ExecuteToolResponse {
            call_id: request.call_id,
            output: format!("slept {seconds} s"),
            ..Default::default()
        }))
    }
}

/// Serves [`TestTools`] on a free port of 127.0.0.1 for the rest of the test.
async fn serve_tools() -> (String, Arc<ToolLog>) {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let log = Arc::new(ToolLog::default());
    let service = ToolExecutorServer::new(TestTools(log.clone()));
    tokio::spawn(
        tonic::transport::Server::builder()
            .add_service(service)
            .serve_with_incoming(tokio_stream::wrappers::TcpListenerStream::new(listener)),
    );
    (format!("http://{addr}"), log)
}

// ---------------------------------------------------------------------------------------
// Replicas on one Redis.
// ---------------------------------------------------------------------------------------

struct Replica {
    /// 0, 1, 2, ... in start order, for messages.
    id: usize,
    server: Server,
    service: AgentServiceClient<Channel>,
    engine: AgentEngineClient<Channel>,
}

impl Replica {
    /// Sends `signal` (`-KILL`, `-STOP`, `-CONT`, ...) with `kill(1)`.
    fn signal(&self, signal: &str) {
        let pid = self.server.pid().expect("the replica's process is running");
        let sent = std::process::Command::new("kill")
            .args([signal, &pid.to_string()])
            .status()
            .unwrap();
        assert!(sent.success(), "kill {signal} {pid} failed");
    }

    /// Whether the process still exists (`kill -0`).
    fn alive(&self) -> bool {
        self.server.pid().is_some_and(|pid| {
            std::process::Command::new("kill")
                .args(["-0", &pid.to_string()])
                .status()
                .is_ok_and(|s| s.success())
        })
    }

    /// kill -9, and waits for the process to be gone.
    async fn kill(&mut self) {
        self.signal("-KILL");
        let status = self.server.wait(Duration::from_secs(10)).await;
        assert!(!status.success(), "{status:?}");
    }
}

/// The simulator, the test's tool executor and agent-server replicas sharing one Redis
/// under this test's prefix. On a failing test, prints every replica's log.
struct Cluster {
    model: Server,
    tools_url: String,
    tools: Arc<ToolLog>,
    args: Vec<String>,
    replicas: Vec<Replica>,
    /// Replicas that were stopped, kept for their logs.
    retired: Vec<Replica>,
    started: usize,
}

impl Cluster {
    async fn up(test: &str, replicas: usize) -> Self {
        let (tools_url, tools) = serve_tools().await;
        let model = simulator(&scenarios(), &[]).await;
        let args = vec![
            "--state".into(),
            redis_url(),
            "--state-key-prefix".into(),
            redis_prefix(test),
            "--takeover-after".into(),
            TAKEOVER_AFTER.into(),
        ];
        let mut cluster = Self {
            model,
            tools_url,
            tools,
            args,
            replicas: Vec::new(),
            retired: Vec::new(),
            started: 0,
        };
        for _ in 0..replicas {
            let replica = cluster.start_replica().await;
            cluster.replicas.push(replica);
        }
        cluster
    }

    /// Starts one more replica with the same settings (not added to `replicas`).
    async fn start_replica(&mut self) -> Replica {
        let args: Vec<&str> = self.args.iter().map(String::as_str).collect();
        let server =
            agent_server_with_model(&self.tools_url, &format!("{}/v1", self.model.url()), &args)
                .await;
        let channel = connect(&server.url()).await;
        let id = self.started;
        self.started += 1;
        Replica {
            id,
            server,
            service: AgentServiceClient::new(channel.clone()),
            engine: AgentEngineClient::new(channel),
        }
    }
}

impl Drop for Cluster {
    fn drop(&mut self) {
        if std::thread::panicking() {
            for replica in self.replicas.iter().chain(&self.retired) {
                eprintln!(
                    "----- log of replica {} -----\n{}",
                    replica.id,
                    replica.server.logs()
                );
            }
        }
    }
}

// ---------------------------------------------------------------------------------------
// Reading runs.
// ---------------------------------------------------------------------------------------

/// Starts a slow run on replica 0 with `Execute` and reads its stream until the model
/// round is under way (a few answer deltas): the stream, and the events read.
async fn slow_run_streaming(c: &mut Cluster) -> (Streaming<Event>, Vec<Event>) {
    let engine_id = create_engine(&mut c.replicas[0].service, agent("slow", &[])).await;
    let mut stream = execute(&mut c.replicas[0].engine, &engine_id).await;
    let mut received = Vec::new();
    read_until(&mut stream, &mut received, |events| {
        answer_deltas(events) >= 3
    })
    .await;
    (stream, received)
}

async fn execute(engine: &mut AgentEngineClient<Channel>, engine_id: &str) -> Streaming<Event> {
    engine
        .execute(v1::ExecuteRequest {
            engine_id: engine_id.into(),
            query: "go on".into(),
            ..Default::default()
        })
        .await
        .unwrap()
        .into_inner()
}

async fn subscribe(
    engine: &mut AgentEngineClient<Channel>,
    run_id: &str,
    after_sequence: u64,
) -> Streaming<Event> {
    engine
        .subscribe(v1::SubscribeRequest {
            run_id: run_id.into(),
            after_sequence,
        })
        .await
        .unwrap_or_else(|status| panic!("Subscribe({run_id}, {after_sequence}): {status:?}"))
        .into_inner()
}

/// The next message of a stream; panics when none comes within [`STALL`].
async fn next(stream: &mut Streaming<Event>) -> Result<Option<Event>, Status> {
    tokio::time::timeout(STALL, stream.message())
        .await
        .unwrap_or_else(|_| panic!("a stalled stream: no event within {STALL:?}"))
}

/// How a stream ended.
#[derive(Debug)]
enum End {
    /// With the run's `done` event.
    Done,
    /// With a status, and no `done` event.
    Status(Status),
    /// Without a status and without a `done` event.
    Closed,
}

/// Reads `stream` into `events` until the done event or the end of the stream.
async fn read_to_end(stream: &mut Streaming<Event>, events: &mut Vec<Event>) -> End {
    loop {
        match next(stream).await {
            Ok(Some(event)) => {
                let last = event.done;
                events.push(event);
                if last {
                    return End::Done;
                }
            }
            Ok(None) => return End::Closed,
            Err(status) => return End::Status(status),
        }
    }
}

/// Reads `stream` until `enough` holds for what was read, which must come before the
/// run ends.
async fn read_until(
    stream: &mut Streaming<Event>,
    events: &mut Vec<Event>,
    enough: impl Fn(&[Event]) -> bool,
) {
    while !enough(events) {
        match next(stream).await {
            Ok(Some(event)) => {
                assert!(
                    !event.done,
                    "the run ended too early: {events:#?}\n{event:#?}"
                );
                events.push(event);
            }
            other => panic!("the stream ended too early ({other:?}) after {events:#?}"),
        }
    }
}

fn answer_deltas(events: &[Event]) -> usize {
    events
        .iter()
        .filter(|e| kind(e) == v1::EventType::FinalAnswer && !e.done)
        .count()
}

/// The whole log of a run, from `Subscribe(run_id, 0)`, up to its done event.
async fn whole_log(engine: &mut AgentEngineClient<Channel>, run_id: &str) -> Vec<Event> {
    let mut stream = subscribe(engine, run_id, 0).await;
    let mut events = Vec::new();
    let end = read_to_end(&mut stream, &mut events).await;
    assert!(
        matches!(end, End::Done),
        "Subscribe({run_id}, 0) ended with {end:?} after {events:#?}"
    );
    events
}

async fn get_run(engine: &mut AgentEngineClient<Channel>, run_id: &str) -> v1::AgentState {
    engine
        .get_run(v1::GetRunRequest {
            run_id: run_id.into(),
        })
        .await
        .unwrap_or_else(|status| panic!("GetRun({run_id}): {status:?}"))
        .into_inner()
}

/// The run's state once it is no longer running (at most 30 s).
async fn ended(engine: &mut AgentEngineClient<Channel>, run_id: &str) -> v1::AgentState {
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let state = get_run(engine, run_id).await;
        if state.status != v1::RunStatus::Running as i32 {
            return state;
        }
        assert!(
            Instant::now() < deadline,
            "GetRun still says running 30 s later: {state:#?}"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// The EVENT_TYPE_ROUND_RESTARTED events of a log, as `(iteration, reason)`; checks that
/// each says the iteration it belongs to.
fn restarts(events: &[Event]) -> Vec<(i32, String)> {
    events
        .iter()
        .filter(|e| kind(e) == v1::EventType::RoundRestarted)
        .map(|e| {
            let data = data(e);
            assert_eq!(
                data["iteration"], e.iteration,
                "ROUND_RESTARTED data.iteration is the event's iteration: {e:#?}"
            );
            assert!(e.content.is_empty(), "{e:#?}");
            assert!(!e.done, "{e:#?}");
            (
                e.iteration,
                data["reason"].as_str().unwrap_or("").to_owned(),
            )
        })
        .collect()
}

/// The final answer by the rule: the FINAL_ANSWER deltas of the done event's iteration,
/// after the last ROUND_RESTARTED of that iteration.
fn answer(events: &[Event]) -> String {
    let iteration = events.last().unwrap().iteration;
    let start = events
        .iter()
        .rposition(|e| kind(e) == v1::EventType::RoundRestarted && e.iteration == iteration)
        .map_or(0, |at| at + 1);
    events[start..]
        .iter()
        .filter(|e| kind(e) == v1::EventType::FinalAnswer && !e.done && e.iteration == iteration)
        .map(|e| e.content.as_str())
        .collect()
}

/// A whole log and the run's state agree on a run that succeeded with `expected`.
fn assert_succeeded(log: &[Event], state: &v1::AgentState, expected: &str) {
    assert_well_formed(log);
    let last = log.last().unwrap();
    assert_eq!(kind(last), v1::EventType::FinalAnswer, "{last:#?}");
    assert_eq!(done(log)["stop_reason"], "final_answer", "{last:#?}");
    assert!(
        !log.iter().any(|e| kind(e) == v1::EventType::Error),
        "no ERROR event: {log:#?}"
    );
    assert_eq!(answer(log), expected, "the final answer rule, on {log:#?}");
    assert_eq!(
        state.status,
        v1::RunStatus::Succeeded as i32,
        "GetRun: {state:#?}"
    );
    assert_eq!(state.final_answer, expected, "GetRun's final_answer");
    assert_eq!(
        state.last_sequence,
        log.len() as u64,
        "GetRun's last_sequence"
    );
    assert_eq!(state.iterations, last.iteration, "GetRun's iterations");
    // A round run again holds the text of its second run only, as its events say.
    let step = state
        .steps
        .iter()
        .find(|s| s.iteration == last.iteration)
        .unwrap_or_else(|| panic!("GetRun has no step {}: {state:#?}", last.iteration));
    assert_eq!(
        step.answer, expected,
        "GetRun's step {} holds the answer once (without the void text of an interrupted \
         run of the round)",
        last.iteration
    );
}

/// Whatever a client received from a stream is what the run's log says at those
/// sequences (so that resuming after the last sequence received is right).
fn assert_received_is_logged(received: &[Event], log: &[Event], what: &str) {
    for event in received {
        let logged = log.get(event.sequence.saturating_sub(1) as usize);
        assert_eq!(
            Some(event),
            logged,
            "{what}: event {} as the client received it is not the log's event {}",
            event.sequence,
            event.sequence
        );
    }
}

// ---------------------------------------------------------------------------------------
// The tests.
// ---------------------------------------------------------------------------------------

/// Needs Redis. The owner of a run is killed (-9) in the middle of a model round while a
/// client streams the run with `Execute` on it: the stream breaks; the client resumes with
/// `Subscribe(run_id, last sequence)` on replica B, which takes the run over once the lease
/// lapses and runs the round again after one ROUND_RESTARTED (`takeover`).
#[tokio::test]
async fn killed_mid_round_the_run_is_taken_over_and_the_client_resumes_on_another_replica() {
    let mut c = Cluster::up("durable-kill-mid-round", 2).await;
    let (mut stream, mut received) = slow_run_streaming(&mut c).await;
    let run_id = received[0].run_id.clone();
    let interrupted = received.last().unwrap().iteration;

    let killed = Instant::now();
    c.replicas[0].kill().await;
    let end = read_to_end(&mut stream, &mut received).await;
    assert!(
        !matches!(end, End::Done),
        "the owner was killed mid-answer, yet its stream ended the run: {received:#?}"
    );
    drop(stream);

    let b = &mut c.replicas[1];
    let after = received.last().unwrap().sequence;
    let mut resumed = subscribe(&mut b.engine, &run_id, after).await;
    let mut rest = Vec::new();
    let mut restarted_after = None;
    loop {
        match next(&mut resumed).await {
            Ok(Some(event)) => {
                if kind(&event) == v1::EventType::RoundRestarted && restarted_after.is_none() {
                    restarted_after = Some(killed.elapsed());
                }
                let last = event.done;
                rest.push(event);
                if last {
                    break;
                }
            }
            other => panic!("Subscribe on B ended with {other:?} after {rest:#?}"),
        }
    }
    let took = restarted_after.expect("no ROUND_RESTARTED reached the resumed client");
    assert!(
        took < TAKEOVER_BOUND,
        "the run was taken over {took:?} after the kill (takeover_after is {TAKEOVER_AFTER})"
    );

    let log = whole_log(&mut b.engine, &run_id).await;
    let mut union = received.clone();
    union.extend(rest);
    assert_eq!(
        union, log,
        "what the client got from A, then from B after sequence {after}, is the run's log"
    );
    assert_eq!(
        restarts(&log),
        [(interrupted, "takeover".to_owned())],
        "one ROUND_RESTARTED, for the interrupted iteration: {log:#?}"
    );
    let state = ended(&mut b.engine, &run_id).await;
    assert_succeeded(&log, &state, SLOW_ANSWER);
    // The interrupted call counts too, estimated: more prompt than the one call B made.
    let usage = state.usage.unwrap();
    assert!(usage.estimated, "{usage:?}");
}

/// Needs Redis. `Cancel` on replica B of a run whose owner A was just killed (-9), before
/// any replica took it over: the request is kept, and the replica that takes the run over
/// ends it cancelled (it used to be lost, and the run went on to its answer).
#[tokio::test]
async fn a_run_cancelled_after_its_owner_died_ends_cancelled_once_taken_over() {
    let mut c = Cluster::up("durable-cancel-orphan", 2).await;
    let (stream, received) = slow_run_streaming(&mut c).await;
    let run_id = received[0].run_id.clone();
    c.replicas[0].kill().await;
    drop(stream);

    let b = &mut c.replicas[1];
    b.engine
        .cancel(v1::CancelRequest {
            run_id: run_id.clone(),
        })
        .await
        .unwrap();
    let state = ended(&mut b.engine, &run_id).await;
    assert_eq!(
        (state.status, state.stop_reason),
        (
            v1::RunStatus::Cancelled as i32,
            v1::StopReason::Cancelled as i32
        ),
        "{state:#?}"
    );
    // The model call the owner died in was never reported by its provider: it counts,
    // estimated, with the deltas it streamed (it was an exact zero).
    let usage = state.usage.unwrap();
    assert!(
        usage.estimated && usage.prompt_tokens > 0 && usage.completion_tokens > 0,
        "{usage:?}"
    );
    let log = whole_log(&mut b.engine, &run_id).await;
    let done = log.last().unwrap();
    assert_eq!(kind(done), v1::EventType::Error, "{log:#?}");
    assert_eq!(log.iter().filter(|e| e.done).count(), 1);
    for (i, event) in log.iter().enumerate() {
        assert_eq!(event.sequence, i as u64 + 1, "{log:#?}");
    }
    // GetRun and the `done` event agree on the rounds: the one the owner died in counts.
    assert_eq!(
        i64::from(state.iterations),
        data(done)["iterations"].as_i64().unwrap(),
        "{state:#?}"
    );
    assert_eq!(state.iterations, 1, "{state:#?}");
}

/// Needs Redis. The owner is killed (-9) while a tool call is in flight, with the run's
/// `Execute` stream kept open until then (dropping it would cancel the run). Replica B
/// takes the run over and sends the call again with the same `call_id`; the log read on B
/// from 0 has every event once, the TOOL_CALL and the TOOL_RESULT of that call once, and no
/// ROUND_RESTARTED (only model rounds are run again).
#[tokio::test]
async fn killed_mid_tool_call_the_call_is_sent_again_with_its_id_and_its_result_logged_once() {
    let mut c = Cluster::up("durable-kill-mid-tool", 2).await;
    let engine_id = create_engine(&mut c.replicas[0].service, agent("nap", &["sleep"])).await;
    let mut stream = execute(&mut c.replicas[0].engine, &engine_id).await;
    let mut received = Vec::new();
    read_until(&mut stream, &mut received, |events| {
        events.iter().any(|e| kind(e) == v1::EventType::ToolCall)
    })
    .await;
    let run_id = received[0].run_id.clone();
    let call = data(
        received
            .iter()
            .find(|e| kind(e) == v1::EventType::ToolCall)
            .unwrap(),
    );
    assert_eq!(call["name"], "sleep", "{call}");
    let call_id = call["id"].as_str().unwrap().to_owned();
    let round = received
        .iter()
        .find(|e| kind(e) == v1::EventType::ToolCall)
        .unwrap()
        .iteration;
    // The tool executor's idempotency key: the run, the round and the model's call id.
    let key = format!("{run_id}.{round}.{call_id}");
    // The call is running on the tool executor (3 s) when the owner dies.
    let first = c.tools.wait_for(1, Duration::from_secs(10)).await;
    assert_eq!(first[0].call_id, key);

    let killed = Instant::now();
    c.replicas[0].kill().await;
    let end = read_to_end(&mut stream, &mut received).await;
    assert!(!matches!(end, End::Done), "{received:#?}");
    drop(stream);

    let b = &mut c.replicas[1];
    let log = whole_log(&mut b.engine, &run_id).await;
    assert_well_formed(&log);
    assert_received_is_logged(&received, &log, "the Execute stream on the killed owner");
    let calls: Vec<_> = log
        .iter()
        .filter(|e| kind(e) == v1::EventType::ToolCall)
        .map(data)
        .collect();
    assert_eq!(
        calls.len(),
        1,
        "the round that asked for the call finished before the kill; it is not redone: \
         {log:#?}"
    );
    let results: Vec<_> = log
        .iter()
        .filter(|e| kind(e) == v1::EventType::ToolResult)
        .map(data)
        .collect();
    assert_eq!(results.len(), 1, "one TOOL_RESULT: {log:#?}");
    assert_eq!(results[0]["id"], call_id.as_str(), "{}", results[0]);
    assert_eq!(results[0]["output"], NAP_RESULT, "{}", results[0]);
    assert_eq!(results[0]["is_error"], false, "{}", results[0]);
    assert_eq!(
        restarts(&log),
        [],
        "no model round was interrupted, so none is restarted: {log:#?}"
    );

    // The tool executor saw the call twice: from A, then from B with the same call_id.
    let seen = c.tools.calls();
    assert_eq!(
        seen.iter().map(|s| s.call_id.as_str()).collect::<Vec<_>>(),
        [key.as_str(), key.as_str()],
        "the call in flight is sent again, once, with the same call_id: {seen:?}"
    );
    assert!(seen.iter().all(|s| s.run_id == run_id), "{seen:?}");
    let again = seen[1].at.saturating_duration_since(killed);
    assert!(
        seen[1].at > killed && again < TAKEOVER_BOUND,
        "the call was sent again {again:?} after the kill (takeover_after is {TAKEOVER_AFTER})"
    );

    let expected = format!("rested: {NAP_RESULT}");
    let state = ended(&mut b.engine, &run_id).await;
    assert_succeeded(&log, &state, &expected);
    let calls = &state.steps[0].tool_calls;
    assert_eq!(calls.len(), 1, "{state:#?}");
    assert_eq!(calls[0].id, call_id);
    assert_eq!(calls[0].output, NAP_RESULT);
}

/// Needs Redis. The tool executor's `call_id` is the call's idempotency key (an OpenAPI
/// `Idempotency-Key`): calls of other runs, or of other rounds of one run, never share one,
/// although the model gives them the same id (as models that number their calls per round
/// do: `functions.create:0`). They did: another user's create was taken for a repeat.
#[tokio::test]
async fn calls_the_model_gives_the_same_id_reach_the_tool_executor_under_keys_of_their_own() {
    let mut c = Cluster::up("durable-call-keys", 1).await;
    let mut runs = Vec::new();
    for _ in 0..2 {
        // An engine, and so a session, of its own: the same conversation again.
        let engine_id = create_engine(&mut c.replicas[0].service, agent("naps", &["sleep"])).await;
        let mut stream = execute(&mut c.replicas[0].engine, &engine_id).await;
        let mut events = Vec::new();
        assert!(matches!(
            read_to_end(&mut stream, &mut events).await,
            End::Done
        ));
        assert_eq!(done(&events)["stop_reason"], "final_answer", "{events:#?}");
        runs.push(events[0].run_id.clone());
    }
    let seen = c.tools.calls();
    let keys: Vec<&str> = seen.iter().map(|s| s.call_id.as_str()).collect();
    assert_eq!(keys.len(), 4, "{seen:?}");
    let mut unique = keys.clone();
    unique.sort_unstable();
    unique.dedup();
    assert_eq!(unique.len(), 4, "every call has a key of its own: {keys:?}");
    // The second round's call, under the first one's id, is named anew in its run (as
    // its events name it): `nap-1_2`.
    let expected = [
        (&runs[0], ".1.nap-1"),
        (&runs[0], ".2.nap-1_2"),
        (&runs[1], ".1.nap-1"),
        (&runs[1], ".2.nap-1_2"),
    ];
    for (seen, (run_id, end)) in seen.iter().zip(expected) {
        assert_eq!(&seen.run_id, run_id);
        assert!(
            seen.call_id.starts_with(run_id.as_str()) && seen.call_id.ends_with(end),
            "{seen:?}"
        );
    }
}

/// Needs Redis. The owner is killed (-9) while the model streams the text of a round that
/// ends with a tool call: B runs the round again, and the call it asks for is announced
/// (TOOL_CALL before its TOOL_RESULT, once) and run, as in a run never interrupted.
#[tokio::test]
async fn killed_in_a_round_that_calls_a_tool_the_call_is_announced_once_taken_over() {
    let mut c = Cluster::up("durable-kill-before-call", 2).await;
    let engine_id = create_engine(&mut c.replicas[0].service, agent("slow_nap", &["sleep"])).await;
    let mut stream = execute(&mut c.replicas[0].engine, &engine_id).await;
    let mut received = Vec::new();
    read_until(&mut stream, &mut received, |events| {
        answer_deltas(events) >= 3
    })
    .await;
    let run_id = received[0].run_id.clone();
    c.replicas[0].kill().await;
    let end = read_to_end(&mut stream, &mut received).await;
    assert!(!matches!(end, End::Done), "{received:#?}");
    drop(stream);

    let b = &mut c.replicas[1];
    let state = ended(&mut b.engine, &run_id).await;
    let log = whole_log(&mut b.engine, &run_id).await;
    assert_well_formed(&log);
    assert_received_is_logged(&received, &log, "the Execute stream on the killed owner");
    let kinds: Vec<v1::EventType> = log
        .iter()
        .map(kind)
        .filter(|k| matches!(k, v1::EventType::ToolCall | v1::EventType::ToolResult))
        .collect();
    assert_eq!(
        kinds,
        [v1::EventType::ToolCall, v1::EventType::ToolResult],
        "the call is announced, then its result: {log:#?}"
    );
    assert_eq!(restarts(&log), [(1, "takeover".to_owned())], "{log:#?}");
    assert_succeeded(&log, &state, "rested: slept 0 s");
    assert_eq!(state.steps[0].tool_calls.len(), 1, "{state:#?}");
}

/// Needs Redis. SIGTERM on the owner while a run streams: the draining replica hands the
/// run over to B at once (not after the lease: within 1 s), ends its Execute and Subscribe
/// streams with UNAVAILABLE after their last event (no ERROR, no done), and exits 0; the
/// client resumes with `Subscribe(run_id, last sequence)` on B and gets the rest.
#[tokio::test]
async fn sigterm_hands_the_run_over_at_once_and_ends_the_streams_with_unavailable() {
    let mut c = Cluster::up("durable-sigterm", 2).await;
    let (mut stream, mut received) = slow_run_streaming(&mut c).await;
    let run_id = received[0].run_id.clone();
    let interrupted = received.last().unwrap().iteration;
    // A second client follows the run on A, another one on B (which sees when the run
    // goes on there, whatever the clients on A do).
    let mut on_a = subscribe(&mut c.replicas[0].engine, &run_id, 0).await;
    let mut watcher = subscribe(&mut c.replicas[1].engine, &run_id, 0).await;
    let watched = tokio::spawn(async move {
        let mut events = Vec::new();
        loop {
            match next(&mut watcher).await {
                Ok(Some(event)) => {
                    let last = event.done;
                    events.push((Instant::now(), event));
                    if last {
                        return Ok(events);
                    }
                }
                other => return Err(format!("{other:?} after {events:#?}")),
            }
        }
    });
    // The follower on A has caught up before the signal.
    let mut followed = Vec::new();
    read_until(&mut on_a, &mut followed, |events| {
        answer_deltas(events) >= 3
    })
    .await;

    let terminated = Instant::now();
    c.replicas[0].server.terminate();
    let end = read_to_end(&mut stream, &mut received).await;
    let stream_ended = terminated.elapsed();
    match &end {
        End::Status(status) => {
            assert_eq!(
                status.code(),
                Code::Unavailable,
                "the Execute stream on the draining replica ends with UNAVAILABLE: {status:?}"
            );
            // Where to resume, also for a program to read.
            use tonic_types::StatusExt;
            let info = status.get_error_details().error_info().cloned().unwrap();
            assert_eq!(info.reason, "REPLICA_SHUTTING_DOWN");
            assert_eq!(
                info.metadata["after_sequence"],
                received.last().unwrap().sequence.to_string(),
                "{status:?}"
            );
            assert_eq!(info.metadata["run"], run_id);
        }
        other => panic!(
            "the Execute stream on the draining replica ended with {other:?}, not \
             UNAVAILABLE, after {received:#?}"
        ),
    }
    assert!(
        !received
            .iter()
            .any(|e| e.done || kind(e) == v1::EventType::Error),
        "no ERROR and no done event on the draining replica: {received:#?}"
    );
    let end = read_to_end(&mut on_a, &mut followed).await;
    match &end {
        End::Status(status) => assert_eq!(
            status.code(),
            Code::Unavailable,
            "the Subscribe stream on the draining replica ends with UNAVAILABLE: {status:?}"
        ),
        other => panic!(
            "the Subscribe stream on the draining replica ended with {other:?}, not \
             UNAVAILABLE"
        ),
    }

    let after = received.last().unwrap().sequence;
    let b = &mut c.replicas[1];
    let mut resumed = subscribe(&mut b.engine, &run_id, after).await;
    let mut rest = Vec::new();
    let first_new = match next(&mut resumed).await {
        Ok(Some(event)) => {
            let at = terminated.elapsed();
            let last = event.done;
            rest.push(event);
            assert!(!last, "{rest:#?}");
            at
        }
        other => panic!("Subscribe on B: {other:?}"),
    };
    let end = read_to_end(&mut resumed, &mut rest).await;
    assert!(matches!(end, End::Done), "{end:?} after {rest:#?}");

    let mut a = c.replicas.remove(0);
    let status = a.server.wait(Duration::from_secs(30)).await;
    assert_eq!(
        status.code(),
        Some(0),
        "the SIGTERMed replica exits 0: {status:?}"
    );
    c.retired.push(a);
    let b = &mut c.replicas[0];

    let log = whole_log(&mut b.engine, &run_id).await;
    let watched = watched.await.unwrap().unwrap_or_else(|e| {
        panic!("the watcher on B: {e}");
    });
    assert_eq!(
        watched.iter().map(|(_, e)| e.clone()).collect::<Vec<_>>(),
        log,
        "a client following on B all along"
    );
    let mut union = received.clone();
    union.extend(rest);
    assert_eq!(
        union, log,
        "what the client got from A, then from B after sequence {after}, is the run's log"
    );
    assert_received_is_logged(
        &followed,
        &log,
        "the Subscribe stream on the draining replica",
    );
    assert_eq!(
        restarts(&log),
        [(interrupted, "handover".to_owned())],
        "one ROUND_RESTARTED, a handover, for the interrupted iteration: {log:#?}"
    );
    // The run went on at B within 1 s of the signal (plus one chunk of the model).
    let bound = Duration::from_secs(1) + Duration::from_millis(SLOW_DELAY_MS);
    let restarted_at = watched
        .iter()
        .find(|(_, e)| kind(e) == v1::EventType::RoundRestarted)
        .map(|(at, _)| at.saturating_duration_since(terminated))
        .unwrap();
    assert!(
        restarted_at < bound,
        "the run went on at B {restarted_at:?} after SIGTERM to its owner (at most {bound:?})"
    );
    assert!(
        first_new < bound,
        "the resuming client got its next event {first_new:?} after SIGTERM to the owner \
         (at most {bound:?}; the owner's stream ended after {stream_ended:?})"
    );
    let state = ended(&mut b.engine, &run_id).await;
    assert_succeeded(&log, &state, SLOW_ANSWER);
}

/// When the paused owner of [`fencing`] comes back.
#[derive(Debug, Clone, Copy, PartialEq)]
enum Resume {
    /// Once B has finished the run (and at least 3 s after the pause).
    AfterTheRunEnded,
    /// As soon as B has taken the run over, while B runs the round again.
    WhileTheNewOwnerStreams,
}

/// The owner is paused (SIGSTOP) in the middle of a model round, longer than its lease; B
/// takes the run over; the owner comes back (SIGCONT). It can no longer publish to the
/// run: the log read from 0 on either replica is B's, whole and unchanged, and the ended
/// run's record stays as B wrote it, a second later too. The owner still serves new runs.
async fn fencing(test: &str, resume: Resume) {
    let mut c = Cluster::up(test, 2).await;
    // The client's stream on A stays open throughout: dropping it would cancel the run.
    let (mut stream, mut received) = slow_run_streaming(&mut c).await;
    let run_id = received[0].run_id.clone();
    let interrupted = received.last().unwrap().iteration;
    let mut on_b = subscribe(&mut c.replicas[1].engine, &run_id, 0).await;
    let mut log = Vec::new();
    read_until(&mut on_b, &mut log, |events| answer_deltas(events) >= 3).await;

    let stopped = Instant::now();
    c.replicas[0].signal("-STOP");
    read_until(&mut on_b, &mut log, |events| {
        events
            .iter()
            .any(|e| kind(e) == v1::EventType::RoundRestarted)
    })
    .await;
    let took = stopped.elapsed();
    assert!(
        took < TAKEOVER_BOUND,
        "B took the run over {took:?} after its owner stopped (takeover_after is \
         {TAKEOVER_AFTER})"
    );
    let mut snapshot = None;
    if resume == Resume::AfterTheRunEnded {
        let end = read_to_end(&mut on_b, &mut log).await;
        assert!(matches!(end, End::Done), "{end:?} after {log:#?}");
        snapshot = Some(ended(&mut c.replicas[1].engine, &run_id).await);
        let pause = Duration::from_secs(3);
        if stopped.elapsed() < pause {
            tokio::time::sleep(pause - stopped.elapsed()).await;
        }
    }
    let resumed = Instant::now();
    c.replicas[0].signal("-CONT");
    if resume == Resume::WhileTheNewOwnerStreams {
        let end = read_to_end(&mut on_b, &mut log).await;
        assert!(matches!(end, End::Done), "{end:?} after {log:#?}");
        snapshot = Some(ended(&mut c.replicas[1].engine, &run_id).await);
    }
    let snapshot = snapshot.unwrap();

    // Whatever the old owner still sends its client must be the run's log.
    let _ = tokio::time::timeout(
        Duration::from_secs(3),
        read_to_end(&mut stream, &mut received),
    )
    .await;
    drop(stream);
    let settle = Duration::from_millis(1500);
    if resumed.elapsed() < settle {
        tokio::time::sleep(settle - resumed.elapsed()).await;
    }

    assert_well_formed(&log);
    assert_eq!(
        restarts(&log),
        [(interrupted, "takeover".to_owned())],
        "one ROUND_RESTARTED, for the interrupted iteration: {log:#?}"
    );
    assert_succeeded(&log, &snapshot, SLOW_ANSWER);
    assert_received_is_logged(
        &received,
        &log,
        "the Execute stream on the paused and resumed owner",
    );
    assert!(
        c.replicas[0].alive(),
        "the resumed owner is still running after being fenced off"
    );
    for at in 0..2 {
        let replica = &mut c.replicas[at];
        assert_eq!(
            whole_log(&mut replica.engine, &run_id).await,
            log,
            "the log read from 0 on replica {}, {:?} after SIGCONT",
            replica.id,
            resumed.elapsed()
        );
        assert_eq!(
            get_run(&mut replica.engine, &run_id).await,
            snapshot,
            "the ended run's record as B wrote it, on replica {}, {:?} after SIGCONT",
            replica.id,
            resumed.elapsed()
        );
    }

    // The fenced replica goes on serving.
    let a = &mut c.replicas[0];
    let engine_id = create_engine(&mut a.service, agent("quick", &[])).await;
    let mut stream = execute(&mut a.engine, &engine_id).await;
    let mut events = Vec::new();
    let end = read_to_end(&mut stream, &mut events).await;
    assert!(matches!(end, End::Done), "{end:?} after {events:#?}");
    let state = ended(&mut a.engine, &events[0].run_id).await;
    assert_succeeded(&events, &state, "still here");
}

/// Needs Redis. See [`fencing`]: the owner comes back after B has finished the run.
#[tokio::test]
async fn a_paused_owner_that_comes_back_after_the_run_ended_elsewhere_cannot_touch_it() {
    fencing("durable-fencing-ended", Resume::AfterTheRunEnded).await;
}

/// Needs Redis. See [`fencing`]: the owner comes back while B is running the round again.
#[tokio::test]
async fn a_paused_owner_that_comes_back_while_the_new_owner_streams_cannot_publish() {
    fencing("durable-fencing-streaming", Resume::WhileTheNewOwnerStreams).await;
}

/// What a client of the rolling restart saw of its run.
struct Followed {
    events: Vec<Event>,
    resumes: usize,
}

/// Follows a run like a client: from its `Execute` stream, resuming with
/// `Subscribe(run_id, last sequence)` on a live replica whenever a stream ends with
/// UNAVAILABLE; anything else is an error.
async fn follow(
    mut stream: Streaming<Event>,
    mut events: Vec<Event>,
    live: Live,
    streaming: Arc<AtomicUsize>,
) -> Result<Followed, String> {
    let run_id = events[0].run_id.clone();
    let mut resumes = 0;
    let mut counted = false;
    loop {
        let next = tokio::time::timeout(Duration::from_secs(60), stream.message())
            .await
            .map_err(|_| format!("{run_id}: no event within 60 s after {}", events.len()))?;
        match next {
            Ok(Some(event)) => {
                let last = event.done;
                if !counted && kind(&event) == v1::EventType::FinalAnswer {
                    counted = true;
                    streaming.fetch_add(1, Ordering::SeqCst);
                }
                events.push(event);
                if last {
                    return Ok(Followed { events, resumes });
                }
            }
            Ok(None) => {
                return Err(format!(
                    "{run_id}: a stream ended without done and without a status after \
                     sequence {}",
                    events.last().map_or(0, |e| e.sequence)
                ));
            }
            Err(status) if status.code() == Code::Unavailable => {
                let after = events.last().map_or(0, |e| e.sequence);
                let mut attempt = 0;
                stream = loop {
                    let (id, mut client) = {
                        let live = live.lock().unwrap();
                        live[(resumes + attempt) % live.len()].clone()
                    };
                    match client
                        .subscribe(v1::SubscribeRequest {
                            run_id: run_id.clone(),
                            after_sequence: after,
                        })
                        .await
                    {
                        Ok(response) => break response.into_inner(),
                        Err(status) if status.code() == Code::Unavailable && attempt < 50 => {
                            attempt += 1;
                            tokio::time::sleep(Duration::from_millis(200)).await;
                        }
                        Err(status) => {
                            return Err(format!(
                                "{run_id}: Subscribe after {after} on replica {id}: {status:?}"
                            ));
                        }
                    }
                };
                resumes += 1;
            }
            Err(status) => {
                return Err(format!(
                    "{run_id}: a stream ended with {status:?} after sequence {}",
                    events.last().map_or(0, |e| e.sequence)
                ));
            }
        }
    }
}

/// Needs Redis. A rolling restart: three replicas run 500 runs (about 9 s of answer
/// each); the replicas are SIGTERMed one at a time, each replaced by a new one once it
/// exited. Every client follows its run as the contract says (resuming on UNAVAILABLE
/// with `Subscribe` on a live replica): every run succeeds with every event exactly once,
/// as the log read from 0 on a live replica at the end says too.
#[tokio::test]
async fn a_rolling_restart_loses_no_run_and_repeats_no_event() {
    const RUNS: usize = 500;
    let mut c = Cluster::up("durable-rolling", 3).await;
    let live: Live = Arc::new(Mutex::new(
        c.replicas
            .iter()
            .map(|r| (r.id, r.engine.clone()))
            .collect(),
    ));
    let streaming = Arc::new(AtomicUsize::new(0));
    // The runs start at once (64 clients starting at a time), spread over the replicas.
    let starting = Arc::new(tokio::sync::Semaphore::new(64));
    let mut started = Vec::new();
    for i in 0..RUNS {
        let replica = &c.replicas[i % 3];
        let (mut service, mut engine) = (replica.service.clone(), replica.engine.clone());
        let (starting, live, streaming) = (starting.clone(), live.clone(), streaming.clone());
        started.push(tokio::spawn(async move {
            let permit = starting.acquire_owned().await.unwrap();
            let engine_id = create_engine(&mut service, agent("steady", &[])).await;
            let mut stream = execute(&mut engine, &engine_id).await;
            let first = match next(&mut stream).await {
                Ok(Some(event)) => event,
                other => panic!("run {i}: {other:?}"),
            };
            drop(permit);
            assert_eq!(kind(&first), v1::EventType::RunStarted);
            let run_id = first.run_id.clone();
            let task = tokio::spawn(follow(stream, vec![first], live, streaming));
            (run_id, task)
        }));
    }
    let mut clients = Vec::new();
    for start in started {
        clients.push(start.await.unwrap());
    }
    // Every run is in the middle of its answer when the first replica drains.
    let deadline = Instant::now() + Duration::from_secs(30);
    while streaming.load(Ordering::SeqCst) < RUNS {
        assert!(
            Instant::now() < deadline,
            "only {} of {RUNS} runs answering",
            streaming.load(Ordering::SeqCst)
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }

    for _ in 0..3 {
        let mut old = c.replicas.remove(0);
        live.lock().unwrap().retain(|(id, _)| *id != old.id);
        old.server.terminate();
        let status = old.server.wait(Duration::from_secs(30)).await;
        let id = old.id;
        c.retired.push(old);
        assert_eq!(status.code(), Some(0), "replica {id} exits 0: {status:?}");
        let new = c.start_replica().await;
        live.lock().unwrap().push((new.id, new.engine.clone()));
        c.replicas.push(new);
    }

    let mut failures = Vec::new();
    let mut followed = Vec::new();
    for (run_id, task) in clients {
        match tokio::time::timeout(Duration::from_secs(120), task).await {
            Ok(Ok(Ok(f))) => followed.push((run_id, f)),
            Ok(Ok(Err(e))) => failures.push(e),
            Ok(Err(e)) => failures.push(format!("{run_id}: the client panicked: {e}")),
            Err(_) => failures.push(format!("{run_id}: not ended within 120 s")),
        }
    }
    assert!(
        failures.is_empty(),
        "{} of {RUNS} clients failed:\n{}",
        failures.len(),
        failures.join("\n")
    );

    let (mut handovers, mut takeovers, mut resumes) = (0, 0, 0);
    let engine = &mut c.replicas[0].engine;
    for (run_id, f) in &followed {
        let log = whole_log(engine, run_id).await;
        assert_eq!(
            &f.events, &log,
            "{run_id}: what its client got, across {} resumes, is the run's log",
            f.resumes
        );
        let state = ended(engine, run_id).await;
        assert_succeeded(&log, &state, STEADY_ANSWER);
        for (_, reason) in restarts(&log) {
            match reason.as_str() {
                "handover" => handovers += 1,
                "takeover" => takeovers += 1,
                other => panic!("{run_id}: ROUND_RESTARTED with reason {other:?}"),
            }
        }
        resumes += f.resumes;
    }
    assert!(
        handovers > 0 && resumes > 0,
        "the restart handed runs over ({handovers} rounds restarted, {resumes} resumes)"
    );
    assert_eq!(
        takeovers, 0,
        "a SIGTERMed replica hands its runs over: none waits for its lease to lapse"
    );
}

/// Needs nothing but the `agent-server` binary, unless a wrong value is accepted (the
/// settings are given with shared state, where they apply; a server that starts then
/// reaches for Redis). `takeover_after` is a setting like the others (flag, environment,
/// `[runs]` in the config file, 10 s by default); zero or nonsense is refused at start-up
/// with a message naming it.
#[tokio::test]
async fn takeover_after_is_a_setting_and_zero_or_nonsense_is_refused_at_start_up() {
    let prefix = redis_prefix("durable-settings");
    let dir = common::TempDir::new("durable-settings");
    let base = [
        "--listen",
        "127.0.0.1:0",
        "--tool-executor",
        "http://127.0.0.1:9",
        "--state",
    ];
    let url = redis_url();
    let command = |args: &[&str], env: &[(&str, &str)]| {
        let mut command = tokio::process::Command::new(binary("agent-server"));
        command
            .args(base)
            .args([url.as_str(), "--state-key-prefix", prefix.as_str()])
            .args(args)
            .envs(env.iter().copied())
            .env("OPENAI_BASE_URL", "http://127.0.0.1:9/v1")
            .env("OPENAI_API_KEY", "test-key")
            .kill_on_drop(true);
        command
    };
    let printed = async |args: &[&str], env: &[(&str, &str)]| {
        let mut args = args.to_vec();
        args.push("--print-config");
        let out = command(&args, env).output().await.unwrap();
        let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
        assert!(
            out.status.success(),
            "{args:?} {env:?}: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        runs_setting(&stdout, "takeover_after")
            .unwrap_or_else(|| panic!("no takeover_after under [runs] in:\n{stdout}"))
    };
    assert_eq!(printed(&[], &[]).await, "\"10s\"", "the default");
    assert_eq!(printed(&["--takeover-after", "3s"], &[]).await, "\"3s\"");
    assert_eq!(
        printed(&[], &[("AGENT_SERVER_TAKEOVER_AFTER", "2500ms")]).await,
        "\"2500ms\""
    );
    let file = dir.write("agent-server.toml", "[runs]\ntakeover_after = \"4s\"\n");
    let file = file.to_str().unwrap();
    assert_eq!(printed(&["--config", file], &[]).await, "\"4s\"");
    assert_eq!(
        printed(&["--config", file, "--takeover-after", "1s"], &[]).await,
        "\"1s\"",
        "a flag beats the file"
    );

    let zero_file = dir.write("zero.toml", "[runs]\ntakeover_after = \"0s\"\n");
    let zero_file = zero_file.to_str().unwrap();
    type Case<'a> = (&'a [&'a str], &'a [(&'a str, &'a str)]);
    let refused: [Case; 5] = [
        (&["--takeover-after", "0s"], &[]),
        (&["--takeover-after", "0"], &[]),
        (&["--takeover-after", "soon"], &[]),
        (&[], &[("AGENT_SERVER_TAKEOVER_AFTER", "0s")]),
        (&["--config", zero_file], &[]),
    ];
    for (args, env) in refused {
        let out = tokio::time::timeout(Duration::from_secs(30), command(args, env).output())
            .await
            .unwrap_or_else(|_| panic!("{args:?} {env:?} was not refused: the server ran"))
            .unwrap();
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(
            !out.status.success(),
            "{args:?} {env:?} is refused: {stderr}"
        );
        assert!(
            stderr.contains("takeover_after") || stderr.contains("takeover-after"),
            "{args:?} {env:?}: the message names the setting: {stderr}"
        );
        assert!(!stderr.contains("panicked"), "{stderr}");
    }
}

/// The value of `key` in the `[runs]` table of a printed config, as written.
fn runs_setting(toml: &str, key: &str) -> Option<String> {
    let mut in_runs = false;
    for line in toml.lines() {
        let line = line.trim();
        if line.starts_with('[') {
            in_runs = line == "[runs]";
        } else if in_runs
            && let Some((k, v)) = line.split_once('=')
            && k.trim() == key
        {
            return Some(v.trim().to_owned());
        }
    }
    None
}
