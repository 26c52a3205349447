//! `agent.v1.AgentService` over real gRPC against the real `agent-server` and
//! `tool-executor` binaries.

// Tests fail by panicking, with the value that was wrong.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::time::Duration;

use agentrt::v1::{self, agent_service_client::AgentServiceClient};
use agentrt_test_support::{Server, agent_server, connect, refusing_addr, tool_executor};
use tonic::{Code, transport::Channel};
use tonic_types::StatusExt;

struct Stack {
    _tools: Server,
    _agents: Server,
    client: AgentServiceClient<Channel>,
}

async fn stack() -> Stack {
    let tools = tool_executor(&[]).await;
    let agents = agent_server(&tools.url(), &[]).await;
    let client = AgentServiceClient::new(connect(&agents.url()).await);
    Stack {
        _tools: tools,
        _agents: agents,
        client,
    }
}

fn valid() -> v1::AgentConfig {
    v1::AgentConfig {
        name: "math-helper".into(),
        system_prompt: "You solve arithmetic with the calculator.".into(),
        model: Some(v1::ModelConfig {
            provider: "openai".into(),
            name: "gpt-4o-mini".into(),
            temperature: Some(0.2),
            max_tokens: 512,
        }),
        tools: vec![
            v1::ToolRef {
                name: "calculator".into(),
                require_approval: false,
            },
            v1::ToolRef {
                name: "current_time".into(),
                require_approval: false,
            },
        ],
        parallel_tool_calls: true,
        ..Default::default()
    }
}

fn secs(seconds: i64) -> Option<prost_types::Duration> {
    Some(prost_types::Duration { seconds, nanos: 0 })
}

async fn violations(
    client: &mut AgentServiceClient<Channel>,
    config: v1::AgentConfig,
) -> Vec<v1::ConfigViolation> {
    let response = client
        .validate_config(v1::ValidateConfigRequest {
            config: Some(config),
        })
        .await
        .unwrap()
        .into_inner();
    assert_eq!(response.valid, response.violations.is_empty());
    response.violations
}

/// The fields of the violations of `config`, in order.
async fn invalid_fields(
    client: &mut AgentServiceClient<Channel>,
    config: v1::AgentConfig,
) -> Vec<String> {
    violations(client, config)
        .await
        .into_iter()
        .map(|v| v.field)
        .collect()
}

#[tokio::test]
async fn a_valid_config_comes_back_with_defaults_applied() {
    let mut s = stack().await;
    let mut config = valid();
    config.model.as_mut().unwrap().provider.clear(); // the only provider is the default
    let response = s
        .client
        .validate_config(v1::ValidateConfigRequest {
            config: Some(config.clone()),
        })
        .await
        .unwrap()
        .into_inner();
    assert!(response.valid, "{:?}", response.violations);
    let effective = response.effective_config.unwrap();
    assert_eq!(effective.model.as_ref().unwrap().provider, "openai");
    assert_eq!(effective.strategy, v1::Strategy::FunctionCall as i32);
    assert_eq!(effective.max_iterations, 10);
    assert_eq!(effective.max_parallel_tool_calls, 4);
    assert_eq!(effective.context.unwrap().max_prompt_tokens, 8192);
    let timeouts = effective.timeouts.unwrap();
    assert_eq!(
        (timeouts.run, timeouts.model_call, timeouts.tool_call),
        (secs(300), secs(120), secs(30))
    );
    assert_eq!(effective.tools, config.tools);
}

#[tokio::test]
async fn each_invalid_config_names_its_violation() {
    let mut s = stack().await;
    type Edit = fn(&mut v1::AgentConfig);
    let table: Vec<(&str, Edit, &str, &str)> = vec![
        ("missing name", |c| c.name.clear(), "name", "required"),
        (
            "malformed name",
            |c| c.name = "1 bad name".into(),
            "name",
            "must start with a letter",
        ),
        (
            "name too long",
            |c| c.name = "a".repeat(65),
            "name",
            "at most 64",
        ),
        ("no model", |c| c.model = None, "model", "required"),
        (
            "unknown provider",
            |c| c.model.as_mut().unwrap().provider = "anthropic".into(),
            "model.provider",
            "not configured on this server (configured: openai)",
        ),
        (
            "no model name",
            |c| c.model.as_mut().unwrap().name.clear(),
            "model.name",
            "required",
        ),
        (
            "model name with spaces",
            |c| c.model.as_mut().unwrap().name = "gpt 4".into(),
            "model.name",
            "without spaces",
        ),
        (
            "temperature too high",
            |c| c.model.as_mut().unwrap().temperature = Some(2.5),
            "model.temperature",
            "between 0 and 2",
        ),
        (
            "negative temperature",
            |c| c.model.as_mut().unwrap().temperature = Some(-0.1),
            "model.temperature",
            "between 0 and 2",
        ),
        (
            "negative max tokens",
            |c| c.model.as_mut().unwrap().max_tokens = -5,
            "model.max_tokens",
            "between 0",
        ),
        (
            "unknown strategy",
            |c| c.strategy = 42,
            "strategy",
            "unknown value 42",
        ),
        (
            "too many iterations",
            |c| c.max_iterations = 100,
            "max_iterations",
            "between 1 and 99",
        ),
        (
            "negative iterations",
            |c| c.max_iterations = -1,
            "max_iterations",
            "between 1 and 99",
        ),
        (
            "unknown tool",
            |c| {
                c.tools.push(v1::ToolRef {
                    name: "web_search".into(),
                    require_approval: false,
                })
            },
            "tools[2].name",
            "not offered by the tool executor",
        ),
        (
            "duplicate tool",
            |c| {
                c.tools.push(v1::ToolRef {
                    name: "calculator".into(),
                    require_approval: false,
                })
            },
            "tools[2].name",
            "duplicate of tools[0]",
        ),
        (
            "empty tool name",
            |c| c.tools.insert(0, v1::ToolRef::default()),
            "tools[0].name",
            "required",
        ),
        (
            "too much parallelism",
            |c| c.max_parallel_tool_calls = 65,
            "max_parallel_tool_calls",
            "between 1 and 64",
        ),
        (
            "tiny context budget",
            |c| {
                c.context = Some(v1::ContextConfig {
                    max_prompt_tokens: 100,
                })
            },
            "context.max_prompt_tokens",
            "between 256",
        ),
        (
            "zero run timeout",
            |c| {
                c.timeouts = Some(v1::Timeouts {
                    run: secs(0),
                    ..Default::default()
                })
            },
            "timeouts.run",
            "positive",
        ),
        (
            "negative tool timeout",
            |c| {
                c.timeouts = Some(v1::Timeouts {
                    tool_call: secs(-3),
                    ..Default::default()
                })
            },
            "timeouts.tool_call",
            "positive",
        ),
        (
            "run timeout too long",
            |c| {
                c.timeouts = Some(v1::Timeouts {
                    run: secs(7200),
                    ..Default::default()
                })
            },
            "timeouts.run",
            "at most 3600s",
        ),
        (
            "model call longer than run",
            |c| {
                c.timeouts = Some(v1::Timeouts {
                    run: secs(60),
                    model_call: secs(61),
                    tool_call: secs(5),
                    action: None,
                })
            },
            "timeouts.model_call",
            "must not exceed timeouts.run",
        ),
        (
            "rerank without name",
            |c| c.rerank_model = Some(v1::RerankModelConfig::default()),
            "rerank_model.name",
            "required",
        ),
        (
            "rerank min score",
            |c| {
                c.rerank_model = Some(v1::RerankModelConfig {
                    name: "r".into(),
                    min_score: 1.5,
                    ..Default::default()
                })
            },
            "rerank_model.min_score",
            "between 0 and 1",
        ),
        (
            "prompt too long",
            |c| c.system_prompt = "x".repeat(100_001),
            "system_prompt",
            "at most 100000",
        ),
    ];
    for (case, edit, field, needle) in table {
        let mut config = valid();
        edit(&mut config);
        let found = violations(&mut s.client, config).await;
        assert_eq!(
            found.len(),
            1,
            "{case}: expected exactly one violation, got {found:?}"
        );
        assert_eq!(found[0].field, field, "{case}: {found:?}");
        assert!(
            found[0].description.contains(needle),
            "{case}: {:?} lacks {needle:?}",
            found[0].description
        );
    }
}

#[tokio::test]
async fn every_violation_is_reported_at_once() {
    let mut s = stack().await;
    let config = v1::AgentConfig {
        name: String::new(),
        model: Some(v1::ModelConfig {
            provider: "nope".into(),
            ..Default::default()
        }),
        max_iterations: 500,
        tools: vec![v1::ToolRef {
            name: "ghost".into(),
            require_approval: false,
        }],
        ..Default::default()
    };
    let fields: Vec<String> = invalid_fields(&mut s.client, config).await;
    assert_eq!(
        fields,
        [
            "name",
            "model.provider",
            "model.name",
            "max_iterations",
            "tools[0].name"
        ]
    );
    // The prompt's budget too, beside the others (it was checked only once they were
    // mended).
    let config = v1::AgentConfig {
        name: String::new(),
        model: Some(v1::ModelConfig {
            name: "demo".into(),
            ..Default::default()
        }),
        system_prompt: "lorem ipsum dolor sit amet ".repeat(3000),
        ..Default::default()
    };
    let fields: Vec<String> = invalid_fields(&mut s.client, config).await;
    assert_eq!(fields, ["name", "context.max_prompt_tokens"]);
    let missing: Vec<String> = invalid_fields(&mut s.client, v1::AgentConfig::default()).await;
    assert_eq!(missing, ["name", "model"]);
}

#[tokio::test]
async fn create_get_delete_an_engine() {
    let mut s = stack().await;
    let created = s
        .client
        .create_agent_engine(v1::CreateAgentEngineRequest {
            config: Some(valid()),
            session_id: String::new(),
        })
        .await
        .unwrap()
        .into_inner();
    assert!(!created.engine_id.is_empty());
    assert!(!created.session_id.is_empty(), "a session id is generated");
    assert_eq!(created.config.as_ref().unwrap().max_iterations, 10);
    assert!(created.expire_time.unwrap().seconds > created.create_time.unwrap().seconds);

    let chosen = s
        .client
        .create_agent_engine(v1::CreateAgentEngineRequest {
            config: Some(valid()),
            session_id: "user-7:chat".into(),
        })
        .await
        .unwrap()
        .into_inner();
    assert_eq!(chosen.session_id, "user-7:chat");
    assert_ne!(chosen.engine_id, created.engine_id);

    let got = s
        .client
        .get_agent_engine(v1::GetAgentEngineRequest {
            engine_id: created.engine_id.clone(),
        })
        .await
        .unwrap()
        .into_inner();
    assert_eq!(got.session_id, created.session_id);
    assert_eq!(got.config, created.config);

    s.client
        .delete_agent_engine(v1::DeleteAgentEngineRequest {
            engine_id: created.engine_id.clone(),
        })
        .await
        .unwrap();
    for status in [
        s.client
            .get_agent_engine(v1::GetAgentEngineRequest {
                engine_id: created.engine_id.clone(),
            })
            .await
            .unwrap_err(),
        s.client
            .delete_agent_engine(v1::DeleteAgentEngineRequest {
                engine_id: created.engine_id.clone(),
            })
            .await
            .unwrap_err(),
    ] {
        assert_eq!(status.code(), Code::NotFound, "{status:?}");
        assert_eq!(
            status.get_details_error_info().unwrap().reason,
            "ENGINE_NOT_FOUND"
        );
    }
}

/// The fields of a status's BadRequest details, in order.
fn violated_fields(status: &tonic::Status) -> Vec<String> {
    status
        .get_details_bad_request()
        .expect("BadRequest details")
        .field_violations
        .into_iter()
        .map(|v| v.field)
        .collect()
}

#[tokio::test]
async fn create_refuses_invalid_configs_with_bad_request_details() {
    let mut s = stack().await;
    let mut config = valid();
    config.name.clear();
    config.tools.push(v1::ToolRef {
        name: "ghost".into(),
        require_approval: false,
    });
    let status = s
        .client
        .create_agent_engine(v1::CreateAgentEngineRequest {
            config: Some(config),
            session_id: "bad session".into(),
        })
        .await
        .unwrap_err();
    assert_eq!(status.code(), Code::InvalidArgument);
    let fields = violated_fields(&status);
    assert_eq!(fields, ["name", "tools[2].name", "session_id"]);
    assert!(
        status.message().contains("tools[2].name"),
        "{}",
        status.message()
    );

    // Every violation is in the details (the first ten were, and nothing said the list
    // was cut); the message names five and counts the rest.
    let mut config = valid();
    config.tools = (0..12)
        .map(|i| v1::ToolRef {
            name: format!("ghost{i}"),
            require_approval: false,
        })
        .collect();
    let status = s
        .client
        .create_agent_engine(v1::CreateAgentEngineRequest {
            config: Some(config),
            session_id: String::new(),
        })
        .await
        .unwrap_err();
    let fields = violated_fields(&status);
    let expected: Vec<String> = (0..12).map(|i| format!("tools[{i}].name")).collect();
    assert_eq!(fields, expected);
    assert!(status.get_details_error_info().is_none());
    assert!(
        status.message().ends_with("and 7 more"),
        "{}",
        status.message()
    );

    // A good config with a bad session id: the request is wrong, not the config, and the
    // message says what is wrong with the id (it said "at most 128 characters" of 5).
    let status = s
        .client
        .create_agent_engine(v1::CreateAgentEngineRequest {
            config: Some(valid()),
            session_id: "a b/c".into(),
        })
        .await
        .unwrap_err();
    assert_eq!(status.code(), Code::InvalidArgument);
    assert!(
        status.message().starts_with("invalid request")
            && status.message().contains("(it holds ' ')"),
        "{}",
        status.message()
    );

    let status = s
        .client
        .create_agent_engine(v1::CreateAgentEngineRequest::default())
        .await
        .unwrap_err();
    assert_eq!(status.code(), Code::InvalidArgument);
    assert_eq!(
        status.get_details_bad_request().unwrap().field_violations[0].field,
        "config"
    );

    let status = s
        .client
        .get_agent_engine(v1::GetAgentEngineRequest::default())
        .await
        .unwrap_err();
    assert_eq!(status.code(), Code::InvalidArgument);
}

#[tokio::test]
async fn an_answer_over_the_message_limit_is_refused_before_anything_is_done() {
    // A config whose echo in the answer would pass server.max_message_bytes: the client
    // is told so (it got OUT_OF_RANGE from the encoder, after the engine was made, its id
    // never sent), and no engine is made.
    let tools = tool_executor(&[]).await;
    let agents = agent_server(&tools.url(), &["--max-message-bytes", "4096"]).await;
    let mut client = AgentServiceClient::new(connect(&agents.url()).await);
    let config = v1::AgentConfig {
        system_prompt: "x".repeat(3950),
        ..valid()
    };
    let status = client
        .create_agent_engine(v1::CreateAgentEngineRequest {
            config: Some(config.clone()),
            session_id: String::new(),
        })
        .await
        .unwrap_err();
    assert_eq!(status.code(), Code::ResourceExhausted, "{status:?}");
    assert!(
        status.message().contains("server.max_message_bytes"),
        "{}",
        status.message()
    );
    assert_eq!(
        status.get_details_error_info().unwrap().reason,
        "MESSAGE_TOO_LARGE"
    );
    assert!(
        !agents.logs().contains("engine created"),
        "{}",
        agents.logs()
    );
    // ValidateConfig's answer (the config, without ids and times) still fits.
    let checked = client
        .validate_config(v1::ValidateConfigRequest {
            config: Some(config),
        })
        .await
        .unwrap()
        .into_inner();
    assert!(checked.valid);
    // What fits is answered.
    let created = client
        .create_agent_engine(v1::CreateAgentEngineRequest {
            config: Some(valid()),
            session_id: String::new(),
        })
        .await
        .unwrap()
        .into_inner();
    assert!(!created.engine_id.is_empty());
}

/// An agent server whose tool executor is at `url` (asked within `timeout`), how it
/// refuses to validate a good config, and how long that took.
async fn validation_refused(url: &str, timeout: &str) -> (Server, tonic::Status, Duration) {
    let agents = agent_server(url, &["--tool-executor-timeout", timeout]).await;
    let mut client = AgentServiceClient::new(connect(&agents.url()).await);
    let started = std::time::Instant::now();
    let status = client
        .validate_config(v1::ValidateConfigRequest {
            config: Some(valid()),
        })
        .await
        .unwrap_err();
    (agents, status, started.elapsed())
}

#[tokio::test]
async fn a_tool_executor_that_never_answers_is_said_to_be_silent() {
    // It accepts connections and reads nothing back: the message says it did not answer
    // in time (it said "it answered Cancelled").
    let silent = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("http://{}", silent.local_addr().unwrap());
    let _held = tokio::spawn(async move {
        let mut open = Vec::new();
        while let Ok((socket, _)) = silent.accept().await {
            open.push(socket);
        }
    });
    let (_agents, status, _) = validation_refused(&url, "1s").await;
    assert_eq!(status.code(), Code::Unavailable, "{status:?}");
    assert!(
        status.message().contains("no answer within 1s"),
        "{}",
        status.message()
    );
}

#[tokio::test]
async fn an_unreachable_tool_executor_is_a_prompt_unavailable() {
    let (refusing, _held) = refusing_addr();
    let nowhere = format!("http://{refusing}");
    let (agents, status, took) = validation_refused(&nowhere, "2s").await;
    assert_eq!(status.code(), Code::Unavailable, "{status:?}");
    // It says what is down, but not where: internal addresses stay in the log.
    assert!(
        status.message().contains("tool executor is unavailable")
            && status.message().contains("it cannot be reached"),
        "{}",
        status.message()
    );
    assert!(!status.message().contains(&nowhere), "{}", status.message());
    assert!(agents.logs().contains(&nowhere), "{}", agents.logs());
    assert_eq!(
        status.get_details_error_info().unwrap().reason,
        "TOOL_EXECUTOR_UNAVAILABLE"
    );
    assert!(status.get_details_retry_info().is_some());
    assert!(took < Duration::from_secs(5), "took {took:?}");

    // A config without tools does not need the tool executor.
    let mut no_tools = valid();
    no_tools.tools.clear();
    let response = AgentServiceClient::new(connect(&agents.url()).await)
        .validate_config(v1::ValidateConfigRequest {
            config: Some(no_tools),
        })
        .await
        .unwrap()
        .into_inner();
    assert!(response.valid, "{:?}", response.violations);
}
