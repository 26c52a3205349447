//! Memory has byte budgets, and principals quotas: what would take the server past one is
//! refused with RESOURCE_EXHAUSTED naming the setting (reason `BUDGET_EXCEEDED`), and
//! nothing accepted before is lost; ended runs and session histories beyond theirs are
//! forgotten oldest first.
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use std::time::Duration;

use agentrt::v1::{
    self, agent_engine_client::AgentEngineClient, agent_service_client::AgentServiceClient,
};
use common::{Stack, TempDir, agent, collect, done, text, when_room};
use tonic::{Code, Request, Status, transport::Channel};

const SCENARIOS: &str = r#"{"scenarios": {
  "count": {"turns": [{"content": "users={user_messages}"}]},
  "slow": {"turns": [{"content": "slowly, slowly", "chunk_chars": 1, "chunk_delay_ms": 100}]},
  "slower": {"turns": [{"content": "slowly, slowly, slowly, slowly, slowly", "chunk_chars": 1, "chunk_delay_ms": 200}]},
  "client": {"turns": [
    {"tool_calls": [{"id": "k1", "name": "lookup_order", "arguments": {"order_id": "A-17"}}]},
    {"content": "found: {tool_results}"}]}
}}"#;

/// A stack whose agent-server reads `toml` as its config file (and `tokens`, if any).
async fn stack(dir: &TempDir, toml: &str, tokens: Option<&str>) -> Stack {
    let config = dir.write("agent-server.toml", toml);
    let config = config.to_string_lossy().into_owned();
    let mut args = vec!["--config".to_owned(), config];
    if let Some(tokens) = tokens {
        let file = dir.write("tokens", tokens);
        args.extend([
            "--auth-tokens-file".to_owned(),
            file.to_string_lossy().into(),
        ]);
    }
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    Stack::up(SCENARIOS, &args).await
}

/// The call was refused for the budget `setting`.
fn over(result: Result<impl std::fmt::Debug, Status>, setting: &str) {
    let status = result.expect_err(setting);
    assert_eq!(status.code(), Code::ResourceExhausted, "{status:?}");
    assert!(status.message().contains(setting), "{status:?}");
    let details = tonic_types::StatusExt::get_error_details(&status);
    let info = details.error_info().expect("an ErrorInfo");
    assert_eq!(info.reason, "BUDGET_EXCEEDED");
}

fn with_token<T>(message: T, token: &str) -> Request<T> {
    let mut request = Request::new(message);
    request
        .metadata_mut()
        .insert("authorization", format!("Bearer {token}").parse().unwrap());
    request
}

fn create(model: &str, prompt: &str, session: &str) -> v1::CreateAgentEngineRequest {
    v1::CreateAgentEngineRequest {
        config: Some(v1::AgentConfig {
            system_prompt: prompt.into(),
            // Large prompts fill the budgets: the token budget leaves room for them (a
            // fixed prompt that fills it is refused).
            context: Some(v1::ContextConfig {
                max_prompt_tokens: 2_000_000,
            }),
            ..agent(model, &[])
        }),
        session_id: session.into(),
    }
}

/// An agent of the `client` scenario, whose first round calls its client tool.
fn client_tool_agent() -> v1::AgentConfig {
    let mut agent = agent("client", &[]);
    agent.client_tools = vec![v1::ClientTool {
        name: "lookup_order".into(),
        description: "Finds an order by its id.".into(),
        input_schema: None,
    }];
    agent
}

fn execute(engine_id: &str, query: &str) -> v1::ExecuteRequest {
    v1::ExecuteRequest {
        engine_id: engine_id.into(),
        query: query.into(),
        ..Default::default()
    }
}

#[tokio::test]
async fn memory_budgets_refuse_new_engines_and_runs_and_keep_what_they_accepted() {
    let dir = TempDir::new("budgets-memory");
    // About three engines of 100,000 four-byte characters; three queries of 100 KB.
    let mut stack = stack(
        &dir,
        "[engines]\nmax_bytes = 1300000\n[runs]\nmax_active_bytes = 350000\n",
        None,
    )
    .await;
    let prompt = "\u{1F600}".repeat(100_000);
    let mut kept = Vec::new();
    let refused = loop {
        match stack
            .service
            .create_agent_engine(create("slow", &prompt, ""))
            .await
        {
            Ok(created) => kept.push(created.into_inner().engine_id),
            Err(status) => break status,
        }
        assert!(kept.len() < 10, "engines.max_bytes does not bound engines");
    };
    assert_eq!(kept.len(), 3, "{refused:?}");
    over(Err::<(), _>(refused), "engines.max_bytes");
    for engine_id in &kept {
        let got = stack
            .service
            .get_agent_engine(v1::GetAgentEngineRequest {
                engine_id: engine_id.clone(),
            })
            .await
            .unwrap()
            .into_inner();
        assert_eq!(got.config.unwrap().system_prompt, prompt, "kept whole");
    }
    // Engines without the big prompt fit once one of those is gone.
    assert!(
        stack
            .service
            .delete_agent_engine(v1::DeleteAgentEngineRequest {
                engine_id: kept.pop().unwrap(),
            })
            .await
            .is_ok()
    );
    let small = stack.engine_for(agent("slow", &[])).await;

    // Runs in progress hold their queries: past the budget, a new one is refused, and the
    // runs accepted go on to their answer.
    let query = "q".repeat(100_000);
    let mut running = Vec::new();
    for _ in 0..3 {
        running.push(
            stack
                .engine
                .execute(execute(&small, &query))
                .await
                .unwrap()
                .into_inner(),
        );
    }
    over(
        stack.engine.execute(execute(&small, &query)).await,
        "runs.max_active_bytes",
    );
    for stream in running {
        let events = collect(stream).await;
        assert_eq!(text(&events, v1::EventType::FinalAnswer), "slowly, slowly");
    }
    // Once they ended, there is room again.
    let events = collect(
        when_room(|| {
            let mut engine = stack.engine.clone();
            let request = execute(&small, &query);
            async move { engine.execute(request).await }
        })
        .await,
    )
    .await;
    assert_eq!(text(&events, v1::EventType::FinalAnswer), "slowly, slowly");
}

#[tokio::test]
async fn ended_runs_and_histories_past_their_budgets_are_forgotten_oldest_first() {
    let dir = TempDir::new("budgets-retained");
    // Room for three ended runs of 8 KB queries, and two sessions of them (whose
    // histories fit the prompt's token budget).
    let mut stack = stack(
        &dir,
        "[runs]\nretained_bytes = 28000\n[sessions]\nmax_bytes = 20000\n",
        None,
    )
    .await;
    let query = "hello world ".repeat(667);
    let mut runs = Vec::new();
    for session in ["s1", "s2", "s3", "s4", "s5"] {
        let engine_id = stack
            .service
            .create_agent_engine(v1::CreateAgentEngineRequest {
                config: Some(agent("count", &[])),
                session_id: session.into(),
            })
            .await
            .unwrap()
            .into_inner()
            .engine_id;
        let events = collect(
            stack
                .engine
                .execute(execute(&engine_id, &query))
                .await
                .unwrap()
                .into_inner(),
        )
        .await;
        assert_eq!(text(&events, v1::EventType::FinalAnswer), "users=1");
        runs.push((engine_id, events[0].run_id.clone()));
    }
    // The runs that ended first are forgotten; the last three are kept.
    for (index, (_, run_id)) in runs.iter().enumerate() {
        let found = stack
            .engine
            .get_run(v1::GetRunRequest {
                run_id: run_id.clone(),
            })
            .await;
        match index {
            0 | 1 => assert_eq!(found.unwrap_err().code(), Code::NotFound, "run {index}"),
            _ => assert_eq!(found.unwrap().into_inner().final_answer, "users=1"),
        }
    }
    // The least recently used histories went: a new turn in s1 starts afresh, in s5 it
    // continues.
    for (index, seen) in [(0, "users=1"), (4, "users=2")] {
        let events = collect(
            stack
                .engine
                .execute(execute(&runs[index].0, "again"))
                .await
                .unwrap()
                .into_inner(),
        )
        .await;
        assert_eq!(
            text(&events, v1::EventType::FinalAnswer),
            seen,
            "session {index}"
        );
    }
}

#[tokio::test]
async fn principals_have_quotas_of_engines_runs_and_streams() {
    let dir = TempDir::new("budgets-quotas");
    let stack = stack(
        &dir,
        "[engines]\nmax_per_principal = 2\n\
         [runs]\nmax_active_per_principal = 1\nmax_streams_per_principal = 2\n",
        Some("alice-token-0123456789 principal=alice\nbob-token-0123456789 principal=bob\n"),
    )
    .await;
    let channel = agentrt_test_support::connect(&stack.agents.url()).await;
    let mut service = AgentServiceClient::new(channel.clone());
    let mut engine = AgentEngineClient::new(channel.clone());
    let alice = "alice-token-0123456789";
    let bob = "bob-token-0123456789";
    let mut engines = Vec::new();
    for _ in 0..2 {
        engines.push(
            service
                .create_agent_engine(with_token(create("slow", "", ""), alice))
                .await
                .unwrap()
                .into_inner()
                .engine_id,
        );
    }
    over(
        service
            .create_agent_engine(with_token(create("slow", "", ""), alice))
            .await,
        "engines.max_per_principal",
    );
    let bobs = service
        .create_agent_engine(with_token(create("slow", "", ""), bob))
        .await
        .unwrap()
        .into_inner()
        .engine_id;

    // One run of Alice's at a time; Bob's are his own.
    let first = engine
        .execute(with_token(execute(&engines[0], "one"), alice))
        .await
        .unwrap()
        .into_inner();
    over(
        engine
            .execute(with_token(execute(&engines[1], "two"), alice))
            .await,
        "runs.max_active_per_principal",
    );
    let bobs_run = engine
        .execute(with_token(execute(&bobs, "his"), bob))
        .await
        .unwrap()
        .into_inner();

    // Two streams of Alice's at a time (her Execute is one).
    let run_id = first_event(first).await;
    let second = subscribe(&mut engine, alice, &run_id).await.unwrap();
    over(
        subscribe(&mut engine, alice, &run_id).await,
        "runs.max_streams_per_principal",
    );
    drop(second);
    tokio::time::sleep(Duration::from_millis(200)).await;
    let third = subscribe(&mut engine, alice, &run_id).await.unwrap();
    let events = collect(third).await;
    assert_eq!(text(&events, v1::EventType::FinalAnswer), "slowly, slowly");
    let events = collect(bobs_run).await;
    assert_eq!(text(&events, v1::EventType::FinalAnswer), "slowly, slowly");
    // Alice's accepted run ended as it should, and she may run again.
    let state = get_run_as(&mut engine, alice, &run_id).await;
    assert_eq!(state.final_answer, "slowly, slowly");
    let again = when_room(|| {
        let mut engine = engine.clone();
        let request = with_token(execute(&engines[1], "two"), alice);
        async move { engine.execute(request).await }
    })
    .await;
    let events = collect(again).await;
    assert_eq!(text(&events, v1::EventType::FinalAnswer), "slowly, slowly");
}

/// Reads the first event of `stream` (the stream stays open, as a stream of its
/// principal) and returns its run id.
async fn first_event(mut stream: tonic::Streaming<v1::AgentStreamEvent>) -> String {
    let event = stream.message().await.unwrap().unwrap();
    // The stream stays open until the run ends.
    tokio::spawn(async move { while let Ok(Some(_)) = stream.message().await {} });
    event.run_id
}

async fn subscribe(
    engine: &mut AgentEngineClient<Channel>,
    token: &str,
    run_id: &str,
) -> Result<tonic::Streaming<v1::AgentStreamEvent>, Status> {
    Ok(engine
        .subscribe(with_token(
            v1::SubscribeRequest {
                run_id: run_id.into(),
                after_sequence: 0,
            },
            token,
        ))
        .await?
        .into_inner())
}

async fn get_run_as(
    engine: &mut AgentEngineClient<Channel>,
    token: &str,
    run_id: &str,
) -> v1::AgentState {
    engine
        .get_run(with_token(
            v1::GetRunRequest {
                run_id: run_id.into(),
            },
            token,
        ))
        .await
        .unwrap()
        .into_inner()
}

/// A run that waited goes on counted against its principal's runs, as any: answered while
/// the principal has all the runs it may in progress, it goes on once one of them ended,
/// not at once past the quota.
#[tokio::test]
async fn an_answered_run_waits_for_room_in_its_principals_quota() {
    let dir = TempDir::new("budgets-answered");
    let stack = stack(
        &dir,
        "[runs]\nmax_active_per_principal = 1\ntakeover_after = \"1s\"\n",
        Some("alice-token-0123456789 principal=alice\n"),
    )
    .await;
    let alice = "alice-token-0123456789";
    let channel = agentrt_test_support::connect(&stack.agents.url()).await;
    let mut service = AgentServiceClient::new(channel.clone());
    let mut engine = AgentEngineClient::new(channel.clone());
    let waiting_agent = client_tool_agent();
    let waits = service
        .create_agent_engine(with_token(
            v1::CreateAgentEngineRequest {
                config: Some(waiting_agent),
                session_id: String::new(),
            },
            alice,
        ))
        .await
        .unwrap()
        .into_inner()
        .engine_id;
    let slow = service
        .create_agent_engine(with_token(create("slow", "", ""), alice))
        .await
        .unwrap()
        .into_inner()
        .engine_id;
    // The first run waits for its client tool: it holds no run of Alice's meanwhile.
    let mut first = engine
        .execute(with_token(execute(&waits, "find A-17"), alice))
        .await
        .unwrap()
        .into_inner();
    let mut run_id = String::new();
    while let Some(event) = first.message().await.unwrap() {
        run_id.clone_from(&event.run_id);
        if event.r#type == v1::EventType::ActionRequired as i32 {
            break;
        }
    }
    // Her one run in progress: the slow one.
    let second = when_room(|| {
        let mut engine = engine.clone();
        let request = with_token(execute(&slow, "take your time"), alice);
        async move { engine.execute(request).await }
    })
    .await;
    let slow_ended = tokio::spawn(async move {
        collect(second).await;
        tokio::time::Instant::now()
    });
    engine
        .submit_tool_outputs(with_token(
            v1::SubmitToolOutputsRequest {
                run_id: run_id.clone(),
                outputs: vec![v1::ToolOutput {
                    tool_call_id: "k1".into(),
                    output: "shipped".into(),
                    is_error: false,
                }],
            },
            alice,
        ))
        .await
        .unwrap();
    // The rest of the first run's stream, to its end.
    let mut events = Vec::new();
    while let Some(event) = tokio::time::timeout(Duration::from_secs(30), first.message())
        .await
        .expect("a stalled stream")
        .unwrap()
    {
        events.push(event);
    }
    let answered_ended = tokio::time::Instant::now();
    assert!(
        text(&events, v1::EventType::FinalAnswer).contains("shipped"),
        "{events:#?}"
    );
    let slow_ended = slow_ended.await.unwrap();
    assert!(
        answered_ended >= slow_ended,
        "the answered run went on past its principal's quota, while her slow run ran"
    );
}

/// A wait out of time (`timeouts.action`) ends the run then, calling no model, even while
/// the replica has no room for runs that go on: not once a run ends there.
#[tokio::test]
async fn a_wait_out_of_time_ends_while_no_room_is_left() {
    let dir = TempDir::new("budgets-full-wait");
    let stack = stack(&dir, "[runs]\nmax_active = 1\n", None).await;
    let channel = agentrt_test_support::connect(&stack.agents.url()).await;
    let mut service = AgentServiceClient::new(channel.clone());
    let mut engine = AgentEngineClient::new(channel.clone());
    let mut waiting_agent = client_tool_agent();
    waiting_agent.timeouts = Some(v1::Timeouts {
        action: Some(prost_types::Duration {
            seconds: 1,
            nanos: 0,
        }),
        ..Default::default()
    });
    let waits = service
        .create_agent_engine(v1::CreateAgentEngineRequest {
            config: Some(waiting_agent),
            session_id: String::new(),
        })
        .await
        .unwrap()
        .into_inner()
        .engine_id;
    let slower = service
        .create_agent_engine(create("slower", "", ""))
        .await
        .unwrap()
        .into_inner()
        .engine_id;
    let mut first = engine
        .execute(execute(&waits, "find A-17"))
        .await
        .unwrap()
        .into_inner();
    let mut events = Vec::new();
    while let Some(event) = first.message().await.unwrap() {
        let waits = event.r#type == v1::EventType::ActionRequired as i32;
        events.push(event);
        if waits {
            break;
        }
    }
    // The one run the replica may have in progress: about 8 s long.
    let second = when_room(|| {
        let mut engine = engine.clone();
        let request = execute(&slower, "take your time");
        async move { engine.execute(request).await }
    })
    .await;
    let slower_run = tokio::spawn(collect(second));
    while let Some(event) = tokio::time::timeout(Duration::from_secs(30), first.message())
        .await
        .expect("a stalled stream")
        .unwrap()
    {
        events.push(event);
    }
    assert!(
        !slower_run.is_finished(),
        "the wait ended only once the replica had room"
    );
    assert_eq!(
        done(&events)["stop_reason"],
        "action_timeout",
        "{events:#?}"
    );
    let slower_events = slower_run.await.unwrap();
    assert_eq!(done(&slower_events)["stop_reason"], "final_answer");
}
