//! What both binaries share: health per service, reflection v1 and v1alpha, settings from
//! flags, environment and files, and a clean exit on SIGTERM.

// Tests fail by panicking, with the value that was wrong.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::time::Duration;

use agentrt_test_support::{Server, agent_server, binary, connect, tool_executor};
use tokio_stream::StreamExt;
use tonic_health::pb::{
    HealthCheckRequest, health_check_response::ServingStatus, health_client::HealthClient,
};

async fn health(url: &str, service: &str) -> Result<i32, tonic::Status> {
    let mut client = HealthClient::new(connect(url).await);
    let response = client
        .check(HealthCheckRequest {
            service: service.into(),
        })
        .await?;
    Ok(response.into_inner().status)
}

#[tokio::test]
async fn health_reports_the_server_and_each_service() {
    let tools = tool_executor(&[]).await;
    let agents = agent_server(&tools.url(), &[]).await;
    for (server, service) in [
        (&tools, ""),
        (&tools, "agent.v1.ToolExecutor"),
        (&agents, ""),
        (&agents, "agent.v1.AgentService"),
        (&agents, "agent.v1.AgentEngine"),
    ] {
        assert_eq!(
            health(&server.url(), service).await.unwrap(),
            ServingStatus::Serving as i32,
            "{service:?}"
        );
    }
    let status = health(&tools.url(), "agent.v1.AgentService")
        .await
        .unwrap_err();
    assert_eq!(status.code(), tonic::Code::NotFound);

    // Watch follows the health checking protocol: a known service's status, and for an
    // unknown one SERVICE_UNKNOWN on a call that stays open (it ended NOT_FOUND).
    let mut client = HealthClient::new(connect(&agents.url()).await);
    for (service, expected) in [
        ("agent.v1.AgentEngine", ServingStatus::Serving),
        ("agent.v1.ToolExecutor", ServingStatus::ServiceUnknown),
    ] {
        let mut statuses = client
            .watch(HealthCheckRequest {
                service: service.into(),
            })
            .await
            .unwrap()
            .into_inner();
        let first = statuses.next().await.unwrap().unwrap();
        assert_eq!(first.status, expected as i32, "{service:?}");
        let more = tokio::time::timeout(Duration::from_millis(300), statuses.next()).await;
        assert!(more.is_err(), "{service:?}: {more:?}");
    }
}

async fn reflected_services(url: &str) -> Vec<String> {
    use tonic_reflection::pb::v1alpha::{
        ServerReflectionRequest, server_reflection_client::ServerReflectionClient,
        server_reflection_request::MessageRequest, server_reflection_response::MessageResponse,
    };
    let mut client = ServerReflectionClient::new(connect(url).await);
    let request = ServerReflectionRequest {
        host: String::new(),
        message_request: Some(MessageRequest::ListServices(String::new())),
    };
    let mut responses = client
        .server_reflection_info(tokio_stream::once(request))
        .await
        .unwrap()
        .into_inner();
    let response = responses.next().await.unwrap().unwrap();
    let Some(MessageResponse::ListServicesResponse(list)) = response.message_response else {
        panic!("unexpected reflection response {response:?}");
    };
    let mut names: Vec<String> = list.service.into_iter().map(|s| s.name).collect();
    names.sort();
    names
}

#[tokio::test]
async fn reflection_v1alpha_lists_the_services() {
    let tools = tool_executor(&[]).await;
    let agents = agent_server(&tools.url(), &[]).await;
    let reflection = [
        "grpc.reflection.v1.ServerReflection",
        "grpc.reflection.v1alpha.ServerReflection",
    ];
    let mut expected = vec![
        "agent.v1.AgentEngine",
        "agent.v1.AgentService",
        "grpc.health.v1.Health",
    ];
    expected.extend(reflection);
    assert_eq!(
        reflected_services(&agents.url()).await,
        expected,
        "exactly what agent-server serves"
    );
    let mut expected = vec!["agent.v1.ToolExecutor", "grpc.health.v1.Health"];
    expected.extend(reflection);
    assert_eq!(
        reflected_services(&tools.url()).await,
        expected,
        "exactly what tool-executor serves"
    );
}

#[tokio::test]
async fn reflection_can_be_switched_off() {
    let tools = tool_executor(&["--reflection", "false"]).await;
    use tonic_reflection::pb::v1alpha::server_reflection_client::ServerReflectionClient;
    let mut client = ServerReflectionClient::new(connect(&tools.url()).await);
    let status = client
        .server_reflection_info(tokio_stream::empty())
        .await
        .unwrap_err();
    assert_eq!(status.code(), tonic::Code::Unimplemented);
}

#[tokio::test]
async fn sigterm_drains_and_exits_zero() {
    let mut tools = tool_executor(&[]).await;
    let mut agents = agent_server(&tools.url(), &[]).await;
    for server in [&mut agents, &mut tools] {
        server.terminate();
        let status = server.wait(Duration::from_secs(15)).await;
        assert_eq!(status.code(), Some(0), "log:\n{}", server.logs());
        assert!(server.logs().contains("draining"), "{}", server.logs());
    }
}

/// An open `Watch` (clients with client-side health checking keep one) is told
/// NOT_SERVING and ended when the server drains, rather than holding the drain for its
/// whole grace; and a health request is a few bytes, not the 4 MiB any call may carry.
#[tokio::test]
async fn a_drain_ends_open_watches_and_health_requests_are_small() {
    let tools = tool_executor(&[]).await;
    let mut agents = agent_server(&tools.url(), &["--drain-grace", "20s"]).await;
    let status = health(&agents.url(), &"x".repeat(2048)).await.unwrap_err();
    assert_eq!(status.code(), tonic::Code::ResourceExhausted, "{status:?}");
    let mut client = HealthClient::new(connect(&agents.url()).await);
    let mut statuses = client
        .watch(HealthCheckRequest {
            service: "agent.v1.AgentEngine".into(),
        })
        .await
        .unwrap()
        .into_inner();
    let first = statuses.next().await.unwrap().unwrap();
    assert_eq!(first.status, ServingStatus::Serving as i32);
    let started = std::time::Instant::now();
    agents.terminate();
    let mut last = None;
    while let Some(status) = tokio::time::timeout(Duration::from_secs(10), statuses.next())
        .await
        .expect("the Watch ends at the drain")
    {
        last = Some(status.unwrap().status);
    }
    assert_eq!(last, Some(ServingStatus::NotServing as i32));
    let exit = agents.wait(Duration::from_secs(15)).await;
    assert_eq!(exit.code(), Some(0), "log:\n{}", agents.logs());
    assert!(
        started.elapsed() < Duration::from_secs(10),
        "the drain waited {:?} for the Watch",
        started.elapsed()
    );
}

#[tokio::test]
async fn settings_come_from_environment_and_files_with_flags_on_top() {
    let dir = std::env::temp_dir().join(format!("agentrt-serving-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let file = dir.join("tool-executor.toml");
    std::fs::write(
        &file,
        "builtin_tools = [\"calculator\"]\n[server]\nlisten = \"127.0.0.1:1\"\n",
    )
    .unwrap();
    let file_arg = file.to_str().unwrap();

    // The file says port 1; the environment overrides it with port 0.
    let server = Server::start(
        "tool-executor",
        &["--config", file_arg],
        &[("TOOL_EXECUTOR_LISTEN", "127.0.0.1:0")],
    )
    .await;
    let mut client =
        agentrt::v1::tool_executor_client::ToolExecutorClient::new(connect(&server.url()).await);
    let tools = client
        .list_tools(agentrt::v1::ListToolsRequest {})
        .await
        .unwrap()
        .into_inner()
        .tools;
    assert_eq!(tools.len(), 1, "the file limits the built-ins");

    // A flag beats the environment.
    let out = tokio::process::Command::new(binary("tool-executor"))
        .args([
            "--config",
            file_arg,
            "--print-config",
            "--builtin-tools",
            "sleep",
        ])
        .env("TOOL_EXECUTOR_BUILTIN_TOOLS", "current_time")
        .output()
        .await
        .unwrap();
    let printed = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "{printed}");
    assert!(printed.contains("builtin_tools = [\"sleep\"]"), "{printed}");
    assert!(printed.contains("listen = \"127.0.0.1:1\""), "{printed}");

    // Mistakes are refused at start-up with the setting's name.
    std::fs::write(&file, "bultin_tools = []\n").unwrap();
    let out = tokio::process::Command::new(binary("tool-executor"))
        .args(["--config", file_arg])
        .output()
        .await
        .unwrap();
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("bultin_tools"));
    std::fs::remove_dir_all(dir).unwrap();
}

/// A provider whose key is to come from a variable that is not set is said at start
/// (its runs failed later, at the provider, with nothing said before).
#[tokio::test]
async fn a_provider_key_variable_that_is_not_set_is_said_at_start() {
    let file = std::env::temp_dir().join(format!("agentrt-unset-key-{}.toml", std::process::id()));
    std::fs::write(
        &file,
        "[providers.local]\nbase_url = \"http://127.0.0.1:9/v1\"\napi_key_env = \"AGENTRT_TEST_KEY_NOT_SET\"\n",
    )
    .unwrap();
    let tools = tool_executor(&[]).await;
    let agents = agent_server(&tools.url(), &["--config", &file.to_string_lossy()]).await;
    let logs = agents.logs();
    assert!(
        logs.contains("api_key_env names a variable that is not set")
            && logs.contains("AGENTRT_TEST_KEY_NOT_SET"),
        "{logs}"
    );
    let _ = std::fs::remove_file(&file);
}

#[tokio::test]
async fn print_config_masks_secrets() {
    let out = tokio::process::Command::new(binary("agent-server"))
        .args(["--print-config", "--tool-executor", "http://tools:50052"])
        .env("OPENAI_BASE_URL", "http://127.0.0.1:8000/v1")
        .env("OPENAI_API_KEY", "very-secret-value")
        .output()
        .await
        .unwrap();
    let printed = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(
        printed.contains("tool_executor = \"http://tools:50052\""),
        "{printed}"
    );
    assert!(printed.contains("[providers.openai]"), "{printed}");
    assert!(printed.contains("api_key = \"****\""), "{printed}");
    assert!(!printed.contains("very-secret-value"), "{printed}");

    // Credentials inside URLs are masked too.
    let out = tokio::process::Command::new(binary("agent-server"))
        .args(["--print-config"])
        .env(
            "OPENAI_BASE_URL",
            "http://user:url-password@127.0.0.1:8000/v1",
        )
        .output()
        .await
        .unwrap();
    let printed = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success());
    assert!(!printed.contains("password"), "{printed}");
    assert!(
        printed.contains("http://***@127.0.0.1:8000/v1"),
        "{printed}"
    );
    // A tool executor URL with credentials is refused (the token has a setting of its
    // own), and the refusal does not show them.
    let out = tokio::process::Command::new(binary("agent-server"))
        .args([
            "--print-config",
            "--tool-executor",
            "http://tools-user:tools-password@tools:50052",
        ])
        .output()
        .await
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "{stderr}");
    assert!(!stderr.contains("tools-password"), "{stderr}");
    assert!(stderr.contains("tool_executor_token"), "{stderr}");
}

#[tokio::test]
async fn bad_settings_fail_fast_with_a_clear_message() {
    let out = tokio::process::Command::new(binary("agent-server"))
        .args(["--tool-executor", "tools:50052"])
        .output()
        .await
        .unwrap();
    assert!(!out.status.success());
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        stderr.contains("tool_executor") && stderr.contains("http://"),
        "{stderr}"
    );

    // A side port that is taken is named with its setting (it said "listener error:
    // Address already in use" alone).
    let taken = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let taken = taken.local_addr().unwrap().to_string();
    for flag in ["--metrics-listen", "--health-listen"] {
        let out = tokio::process::Command::new(binary("tool-executor"))
            .args(["--listen", "127.0.0.1:0", flag, &taken])
            .output()
            .await
            .unwrap();
        assert!(!out.status.success());
        let stderr = String::from_utf8_lossy(&out.stderr);
        let setting = flag.trim_start_matches("--").replace('-', "_");
        assert!(
            stderr.contains(&format!("cannot listen on {taken} (server.{setting})")),
            "{stderr}"
        );
    }
}
