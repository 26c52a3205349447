//! Principals: each token acts as a principal (`principal=NAME` in the tokens file), and
//! engines, sessions, runs and idempotency keys belong to the principal that made them.
//! Another principal gets NOT_FOUND, worded as for an id that does not exist; a session id
//! chosen by two principals is two sessions; an operator (`scope=operator`) acts on all.
//!
//! The Redis case needs Redis at `AGENTRT_TEST_REDIS` (default `redis://127.0.0.1:6379/0`;
//! `scripts/test` starts one when none answers), under a key prefix of its own.
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use agentrt::v1::{
    self, agent_engine_client::AgentEngineClient, agent_service_client::AgentServiceClient,
};
use agentrt_test_support::conformance::{redis_prefix, redis_url};
use common::{Stack, TempDir, agent, collect, text};
use tonic::{Code, Request, Status, transport::Channel};

const SCENARIOS: &str = r#"{"scenarios": {
  "count": {"turns": [{"content": "users={user_messages}"}]}
}}"#;

const TOKENS: &str = "\
alice-token-0123456789 principal=alice
alice-rotated-0123456789 principal=alice
bob-token-0123456789 * principal=bob
ops-token-0123456789 principal=ops scope=operator
";

/// A principal's clients: every call carries its token.
struct Caller {
    token: &'static str,
    service: AgentServiceClient<Channel>,
    engine: AgentEngineClient<Channel>,
}

impl Caller {
    async fn new(stack: &Stack, token: &'static str) -> Self {
        let channel = agentrt_test_support::connect(&stack.agents.url()).await;
        Self {
            token,
            service: AgentServiceClient::new(channel.clone()),
            engine: AgentEngineClient::new(channel),
        }
    }

    fn request<T>(&self, message: T) -> Request<T> {
        let mut request = Request::new(message);
        request.metadata_mut().insert(
            "authorization",
            format!("Bearer {}", self.token).parse().unwrap(),
        );
        request
    }

    async fn create(&mut self, session_id: &str) -> v1::CreateAgentEngineResponse {
        let request = self.request(v1::CreateAgentEngineRequest {
            config: Some(agent("count", &[])),
            session_id: session_id.into(),
        });
        self.service
            .create_agent_engine(request)
            .await
            .unwrap()
            .into_inner()
    }

    async fn execute(
        &mut self,
        engine_id: &str,
        message_id: &str,
    ) -> Result<Vec<v1::AgentStreamEvent>, Status> {
        let request = self.request(v1::ExecuteRequest {
            engine_id: engine_id.into(),
            query: "hello".into(),
            message_id: message_id.into(),
            ..Default::default()
        });
        Ok(collect(self.engine.execute(request).await?.into_inner()).await)
    }

    async fn get_run(&mut self, run_id: &str) -> Result<v1::AgentState, Status> {
        let request = self.request(v1::GetRunRequest {
            run_id: run_id.into(),
        });
        Ok(self.engine.get_run(request).await?.into_inner())
    }

    async fn get_engine(&mut self, engine_id: &str) -> Result<v1::GetAgentEngineResponse, Status> {
        let request = self.request(v1::GetAgentEngineRequest {
            engine_id: engine_id.into(),
        });
        Ok(self.service.get_agent_engine(request).await?.into_inner())
    }

    /// Every call on a run or an engine another principal may not reach, each answered
    /// with its status and message (`id` replaced by `ID`, to compare with unknown ids).
    async fn reach(&mut self, engine_id: &str, run_id: &str) -> Vec<(&'static str, Code, String)> {
        let mut answers = Vec::new();
        let mut note = |call: &'static str, result: Result<(), Status>, id: &str| {
            let status = result.expect_err(call);
            answers.push((call, status.code(), status.message().replace(id, "ID")));
        };
        note(
            "GetAgentEngine",
            self.get_engine(engine_id).await.map(drop),
            engine_id,
        );
        let request = self.request(v1::DeleteAgentEngineRequest {
            engine_id: engine_id.into(),
        });
        note(
            "DeleteAgentEngine",
            self.service.delete_agent_engine(request).await.map(drop),
            engine_id,
        );
        note(
            "Execute",
            self.execute(engine_id, "").await.map(drop),
            engine_id,
        );
        note("GetRun", self.get_run(run_id).await.map(drop), run_id);
        let request = self.request(v1::SubscribeRequest {
            run_id: run_id.into(),
            after_sequence: 0,
        });
        note(
            "Subscribe",
            self.engine.subscribe(request).await.map(drop),
            run_id,
        );
        let request = self.request(v1::CancelRequest {
            run_id: run_id.into(),
        });
        note(
            "Cancel",
            self.engine.cancel(request).await.map(drop),
            run_id,
        );
        let request = self.request(v1::SubmitToolOutputsRequest {
            run_id: run_id.into(),
            outputs: vec![v1::ToolOutput {
                tool_call_id: "call_1".into(),
                output: "x".into(),
                is_error: false,
            }],
        });
        note(
            "SubmitToolOutputs",
            self.engine.submit_tool_outputs(request).await.map(drop),
            run_id,
        );
        let request = self.request(v1::ApproveToolCallsRequest {
            run_id: run_id.into(),
            decisions: vec![v1::ToolCallDecision {
                tool_call_id: "call_1".into(),
                approved: true,
                reason: String::new(),
            }],
        });
        note(
            "ApproveToolCalls",
            self.engine.approve_tool_calls(request).await.map(drop),
            run_id,
        );
        answers
    }
}

fn answer(events: &[v1::AgentStreamEvent]) -> String {
    text(events, v1::EventType::FinalAnswer)
}

async fn principals_are_kept_apart(state: &[&str]) {
    let dir = TempDir::new("tenants");
    let tokens = dir.write("tokens", TOKENS);
    let tokens = tokens.to_string_lossy().into_owned();
    let mut args = vec!["--auth-tokens-file", tokens.as_str()];
    args.extend_from_slice(state);
    let stack = Stack::up(SCENARIOS, &args).await;
    let mut alice = Caller::new(&stack, "alice-token-0123456789").await;
    let mut alice_again = Caller::new(&stack, "alice-rotated-0123456789").await;
    let mut bob = Caller::new(&stack, "bob-token-0123456789").await;
    let mut ops = Caller::new(&stack, "ops-token-0123456789").await;

    // Alice's engine, session and first run.
    let created = alice.create("chat").await;
    assert_eq!(
        created.session_id, "chat",
        "clients see their own session id"
    );
    let alices = created.engine_id;
    let events = alice.execute(&alices, "m1").await.unwrap();
    assert_eq!(answer(&events), "users=1");
    assert!(events.iter().all(|e| e.session_id == "chat"), "{events:?}");
    let alices_run = events[0].run_id.clone();

    // Bob, choosing the same session id and message id, gets a session and a run of his
    // own: Alice's history is not in his prompt, and her run is not his.
    let bobs = bob.create("chat").await.engine_id;
    let events = bob.execute(&bobs, "m1").await.unwrap();
    assert_eq!(
        answer(&events),
        "users=1",
        "Bob's prompt holds no history of Alice's"
    );
    assert_ne!(events[0].run_id, alices_run, "the message id is Bob's own");

    // Nothing of Alice's is reachable for Bob, and nothing tells him that it exists: each
    // call is answered as for ids that do not exist.
    let foreign = bob.reach(&alices, &alices_run).await;
    let unknown = bob
        .reach(
            "00000000-0000-4000-8000-000000000000",
            "00000000-0000-4000-8000-000000000001",
        )
        .await;
    assert_eq!(foreign, unknown);
    assert!(
        foreign.iter().all(|(_, code, _)| *code == Code::NotFound),
        "{foreign:?}"
    );

    // Alice's engine and session are untouched: her next turn sees her first one only.
    let events = alice.execute(&alices, "m2").await.unwrap();
    assert_eq!(answer(&events), "users=2");
    // Her other token is the same principal; the operator reaches everything.
    let state = alice_again.get_run(&alices_run).await.unwrap();
    assert_eq!(
        (state.session_id.as_str(), state.engine_id.as_str()),
        ("chat", alices.as_str())
    );
    let state = ops.get_run(&alices_run).await.unwrap();
    assert_eq!(state.final_answer, "users=1");
    assert_eq!(ops.get_engine(&alices).await.unwrap().session_id, "chat");
    // A message id Alice used before names her run again, not a new one.
    let again = alice.execute(&alices, "m1").await.unwrap();
    assert_eq!(again[0].run_id, alices_run);
}

#[tokio::test]
async fn principals_are_kept_apart_in_memory() {
    principals_are_kept_apart(&[]).await;
}

#[tokio::test]
async fn principals_are_kept_apart_with_redis_and_their_sessions_are_keyed_apart() {
    let prefix = redis_prefix("tenants");
    let url = redis_url();
    principals_are_kept_apart(&["--state", &url, "--state-key-prefix", &prefix]).await;
    let client = redis::Client::open(url.as_str()).unwrap();
    let mut connection = client.get_multiplexed_async_connection().await.unwrap();
    let mut sessions: Vec<String> = redis::cmd("KEYS")
        .arg(format!("{prefix}:session:*"))
        .query_async(&mut connection)
        .await
        .unwrap();
    sessions.sort();
    assert_eq!(
        sessions,
        [
            format!("{prefix}:session:alice/chat"),
            format!("{prefix}:session:bob/chat")
        ]
    );
}
