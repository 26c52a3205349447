//! The tool executor's tool sources end to end, over real gRPC against the real binary:
//! the MCP reference servers (`@modelcontextprotocol/server-everything` over stdio and
//! streamable HTTP, `@modelcontextprotocol/server-filesystem`), installed by
//! `scripts/test` into `tests/mcp/node_modules`, and an HTTP API served by the test with
//! an OpenAPI document.

// Tests fail by panicking, with the value that was wrong.
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use std::{
    path::Path,
    sync::{
        Arc,
        atomic::{AtomicUsize, Ordering},
    },
    time::{Duration, Instant},
};

use agentrt::{
    json::{json_to_struct, struct_to_json, value_to_json},
    v1::{self, tool_executor_client::ToolExecutorClient},
};
use agentrt_test_support::{Server, connect, tool_executor, unused_addr};
use common::{TempDir, mcp_server, serve_http};
use serde_json::json;
use tonic::{Code, transport::Channel};
use tonic_health::pb::{
    HealthCheckRequest, health_check_response::ServingStatus, health_client::HealthClient,
};
use tonic_types::StatusExt;

/// Starts a tool executor with `config` (TOML) written into `dir`.
async fn executor_with(
    dir: &TempDir,
    config: &str,
    env: &[(&str, &str)],
) -> (Server, ToolExecutorClient<Channel>) {
    let path = dir.write("tool-executor.toml", config);
    let server = Server::start(
        "tool-executor",
        &[
            "--listen",
            "127.0.0.1:0",
            "--config",
            path.to_str().unwrap(),
        ],
        env,
    )
    .await;
    let client = ToolExecutorClient::new(connect(&server.url()).await);
    (server, client)
}

fn call(tool: &str, arguments: serde_json::Value) -> v1::ExecuteToolRequest {
    v1::ExecuteToolRequest {
        call_id: "call-1".into(),
        tool_name: tool.into(),
        arguments: json_to_struct(&arguments),
        run_id: "run-1".into(),
        session_id: "session-1".into(),
    }
}

async fn execute(
    client: &mut ToolExecutorClient<Channel>,
    tool: &str,
    arguments: serde_json::Value,
) -> v1::ExecuteToolResponse {
    client
        .execute_tool(call(tool, arguments))
        .await
        .unwrap_or_else(|status| panic!("{tool}: {status:?}"))
        .into_inner()
}

async fn tools(client: &mut ToolExecutorClient<Channel>) -> Vec<v1::Tool> {
    client
        .list_tools(v1::ListToolsRequest {})
        .await
        .unwrap()
        .into_inner()
        .tools
}

fn everything_stdio(name: &str) -> String {
    format!(
        "[[mcp_servers]]\nname = \"{name}\"\ncommand = \"node\"\nargs = [{:?}, \"stdio\"]\n",
        mcp_server("server-everything")
    )
}

#[tokio::test]
async fn server_everything_over_stdio_lists_and_calls_with_every_kind_of_content() {
    let dir = TempDir::new("stdio");
    let (_server, mut client) = executor_with(&dir, &everything_stdio("everything"), &[]).await;
    let listed = tools(&mut client).await;
    let names: Vec<&str> = listed.iter().map(|t| t.name.as_str()).collect();
    for name in [
        "calculator",
        "current_time",
        "sleep",
        "everything__echo",
        "everything__get-sum",
        "everything__get-resource-links",
        "everything__trigger-long-running-operation",
    ] {
        assert!(names.contains(&name), "{name} missing from {names:?}");
    }
    // It can only be called as a task (`execution.taskSupport` "required"): every plain
    // call would fail.
    assert!(
        !names.contains(&"everything__simulate-research-query"),
        "{names:?}"
    );
    let echo = listed
        .iter()
        .find(|t| t.name == "everything__echo")
        .unwrap();
    assert_eq!(echo.source, v1::ToolSource::Mcp as i32);
    assert!(!echo.description.is_empty());
    let schema = struct_to_json(echo.input_schema.as_ref().unwrap());
    assert_eq!(
        schema["properties"]["message"]["type"], "string",
        "{schema}"
    );
    let calculator = listed.iter().find(|t| t.name == "calculator").unwrap();
    assert_eq!(calculator.source, v1::ToolSource::Builtin as i32);

    let out = execute(&mut client, "everything__echo", json!({"message": "hi"})).await;
    assert!(!out.is_error, "{}", out.output);
    assert_eq!(out.output, "Echo: hi");
    assert_eq!(out.call_id, "call-1");

    let out = execute(&mut client, "everything__get-sum", json!({"a": 2, "b": 3})).await;
    assert!(out.output.contains('5'), "{}", out.output);

    let out = execute(
        &mut client,
        "everything__get-structured-content",
        json!({"location": "Chicago"}),
    )
    .await;
    assert!(!out.is_error, "{}", out.output);
    let structured = value_to_json(out.structured_output.as_ref().expect("structured output"));
    assert!(structured["temperature"].is_number(), "{structured}");

    let out = execute(
        &mut client,
        "everything__get-resource-links",
        json!({"count": 3}),
    )
    .await;
    assert!(!out.is_error, "{}", out.output);
    assert_eq!(out.references.len(), 3, "{out:?}");
    for reference in &out.references {
        assert!(reference.url.starts_with("demo://"), "{reference:?}");
        assert!(!reference.title.is_empty());
        assert_eq!(reference.source, "everything__get-resource-links");
    }

    let out = execute(&mut client, "everything__get-tiny-image", json!({})).await;
    assert!(out.output.contains("[image: image/png, "), "{}", out.output);

    // Arguments are checked against the MCP tool's schema as for built-ins.
    let status = client
        .execute_tool(call("everything__echo", json!({"message": 5})))
        .await
        .unwrap_err();
    assert_eq!(status.code(), Code::InvalidArgument);
    assert_eq!(
        status.get_details_bad_request().unwrap().field_violations[0].field,
        "arguments.message"
    );
}

/// A stdio proxy in front of an MCP server: copies what the tool executor sends into a
/// log file, so that the test can see `notifications/cancelled` arrive.
const TEE_PROXY: &str = r#"
import subprocess, sys, threading
log = open(sys.argv[1], "a", buffering=1)
child = subprocess.Popen(sys.argv[2:], stdin=subprocess.PIPE, stdout=sys.stdout)
for line in sys.stdin:
    log.write(line)
    child.stdin.write(line.encode())
    child.stdin.flush()
child.stdin.close()
child.wait()
"#;

#[tokio::test]
async fn a_deadline_on_a_long_running_tool_cancels_it_at_the_server() {
    let dir = TempDir::new("deadline");
    let proxy = dir.write("tee.py", TEE_PROXY);
    let log = dir.0.join("sent.jsonl");
    let config = format!(
        "[[mcp_servers]]\nname = \"everything\"\ncommand = \"python3\"\nargs = [{:?}, {:?}, \
         \"node\", {:?}, \"stdio\"]\n",
        proxy.display().to_string(),
        log.display().to_string(),
        mcp_server("server-everything")
    );
    let (_server, mut client) = executor_with(&dir, &config, &[]).await;
    let mut request = tonic::Request::new(call(
        "everything__trigger-long-running-operation",
        json!({"duration": 30, "steps": 30}),
    ));
    request.set_timeout(Duration::from_millis(1500));
    let started = Instant::now();
    let status = client.execute_tool(request).await.unwrap_err();
    assert!(
        matches!(status.code(), Code::DeadlineExceeded | Code::Cancelled),
        "{status:?}"
    );
    assert!(started.elapsed() < Duration::from_secs(10));
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let sent = std::fs::read_to_string(&log).unwrap_or_default();
        if sent.contains("notifications/cancelled") {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "no notifications/cancelled was sent; sent:\n{sent}"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let out = execute(&mut client, "everything__echo", json!({"message": "after"})).await;
    assert_eq!(out.output, "Echo: after");
}

/// A stdio MCP server that writes its pid to `argv[1]`, answers, and once its input ends
/// does not exit (as a server may not).
const STUBBORN_SERVER: &str = r#"
import json, os, sys, time
with open(sys.argv[1] + ".tmp", "w") as f:
    f.write(str(os.getpid()))
os.replace(sys.argv[1] + ".tmp", sys.argv[1])
for line in sys.stdin:
    msg = json.loads(line)
    mid, method = msg.get("id"), msg.get("method")
    if method == "initialize":
        result = {"protocolVersion": "2025-06-18", "capabilities": {"tools": {}},
                  "serverInfo": {"name": "stubborn", "version": "1"}}
    elif method == "tools/list":
        result = {"tools": [{"name": "noop", "inputSchema": {"type": "object"}}]}
    elif mid is not None:
        result = {}
    else:
        continue
    sys.stdout.write(json.dumps({"jsonrpc": "2.0", "id": mid, "result": result}) + "\n")
    sys.stdout.flush()
time.sleep(600)
"#;

/// A second SIGTERM exits at once, without the drain: the stdio servers the tool executor
/// started go with it (they run in process groups of their own, which no signal to the
/// tool executor reaches, and were left running).
#[tokio::test]
async fn a_second_sigterm_stops_the_stdio_servers_too() {
    let dir = TempDir::new("second-sigterm");
    let script = dir.write("stubborn.py", STUBBORN_SERVER);
    let pid_file = dir.0.join("pid");
    let config = format!(
        "[[mcp_servers]]\nname = \"stubborn\"\ncommand = \"python3\"\nargs = [{:?}, {:?}]\n",
        script.display().to_string(),
        pid_file.display().to_string()
    );
    let (mut server, mut client) = executor_with(&dir, &config, &[]).await;
    assert!(
        tools(&mut client)
            .await
            .iter()
            .any(|t| t.name == "stubborn__noop")
    );
    let pid: u32 = std::fs::read_to_string(&pid_file)
        .unwrap()
        .trim()
        .parse()
        .unwrap();
    let alive = |pid: u32| {
        std::fs::read_to_string(format!("/proc/{pid}/stat"))
            .is_ok_and(|stat| !stat.contains(") Z "))
    };
    assert!(alive(pid));
    server.terminate();
    tokio::time::sleep(Duration::from_millis(300)).await;
    server.terminate();
    let status = server.wait(Duration::from_secs(10)).await;
    assert_eq!(status.code(), Some(130), "{status:?}");
    let deadline = Instant::now() + Duration::from_secs(5);
    while alive(pid) {
        assert!(
            Instant::now() < deadline,
            "the stdio server {pid} outlived the tool executor"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

#[tokio::test]
async fn a_server_killed_mid_call_is_unavailable_then_restarted() {
    let dir = TempDir::new("killed");
    let pid_file = dir.0.join("pid");
    let config = format!(
        "[[mcp_servers]]\nname = \"everything\"\ncommand = \"sh\"\nargs = [\"-c\", \
         \"echo $$ > {} && exec node {} stdio\"]\n",
        pid_file.display(),
        mcp_server("server-everything")
    );
    let (server, mut client) = executor_with(&dir, &config, &[]).await;
    let first_pid = std::fs::read_to_string(&pid_file).unwrap();
    let mut caller = client.clone();
    let long_call = tokio::spawn(async move {
        caller
            .execute_tool(call(
                "everything__trigger-long-running-operation",
                json!({"duration": 30, "steps": 30}),
            ))
            .await
    });
    tokio::time::sleep(Duration::from_millis(500)).await;
    let killed = std::process::Command::new("kill")
        .args(["-9", first_pid.trim()])
        .status()
        .unwrap();
    assert!(killed.success());
    let status = long_call.await.unwrap().unwrap_err();
    assert_eq!(status.code(), Code::Unavailable, "{status:?}");
    assert!(status.message().contains("\"everything\""), "{status:?}");
    let info = status.get_details_error_info().unwrap();
    assert_eq!(info.reason, "TOOL_SOURCE_UNAVAILABLE");
    assert_eq!(info.metadata["source"], "everything", "{info:?}");
    assert_eq!(
        info.metadata["tool"], "everything__trigger-long-running-operation",
        "{info:?}"
    );

    // The rest of the executor serves on: built-ins answer and health is SERVING.
    let out = execute(&mut client, "calculator", json!({"expression": "1 + 1"})).await;
    assert_eq!(out.output, "2");
    let health = HealthClient::new(connect(&server.url()).await)
        .check(HealthCheckRequest {
            service: String::new(),
        })
        .await
        .unwrap()
        .into_inner();
    assert_eq!(health.status, ServingStatus::Serving as i32);

    // The server is restarted, with backoff, and its tools answer again.
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        match client
            .execute_tool(call("everything__echo", json!({"message": "back"})))
            .await
        {
            Ok(out) => {
                assert_eq!(out.into_inner().output, "Echo: back");
                break;
            }
            Err(status) => {
                assert_eq!(status.code(), Code::Unavailable, "{status:?}");
                assert!(Instant::now() < deadline, "not restarted: {status:?}");
            }
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let second_pid = std::fs::read_to_string(&pid_file).unwrap();
    assert_ne!(first_pid, second_pid);

    // Draining stops the child process.
    let mut server = server;
    server.terminate();
    assert!(server.wait(Duration::from_secs(20)).await.success());
    let pid = second_pid.trim();
    let deadline = Instant::now() + Duration::from_secs(5);
    while Path::new(&format!("/proc/{pid}")).exists()
        && !std::fs::read_to_string(format!("/proc/{pid}/stat"))
            .unwrap_or_default()
            .contains(") Z ")
    {
        assert!(
            Instant::now() < deadline,
            "the MCP server outlived the executor"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// Starts server-everything over streamable HTTP on a free port; killed when dropped.
async fn everything_over_http() -> (tokio::process::Child, String) {
    let port = unused_addr().port();
    let child = everything_on(port).await;
    (child, format!("http://127.0.0.1:{port}/mcp"))
}

/// Starts server-everything over streamable HTTP on `port`, once it listens; killed when
/// dropped.
async fn everything_on(port: u16) -> tokio::process::Child {
    let child = tokio::process::Command::new("node")
        .args([mcp_server("server-everything").as_str(), "streamableHttp"])
        .env("PORT", port.to_string())
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .kill_on_drop(true)
        .spawn()
        .unwrap();
    let deadline = Instant::now() + Duration::from_secs(20);
    while tokio::net::TcpStream::connect(("127.0.0.1", port))
        .await
        .is_err()
    {
        assert!(
            Instant::now() < deadline,
            "server-everything did not listen"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    child
}

/// The port of an `everything_over_http` URL.
fn port_of(url: &str) -> u16 {
    url.trim_start_matches("http://127.0.0.1:")
        .trim_end_matches("/mcp")
        .parse()
        .unwrap()
}

#[tokio::test]
async fn server_everything_over_streamable_http_with_a_secret_header() {
    let (_everything, url) = everything_over_http().await;
    let dir = TempDir::new("http");
    let config = format!(
        "[[mcp_servers]]\nname = \"docs\"\nurl = {url:?}\ntimeout = \"20s\"\n\
         headers = {{ Authorization = {{ env = \"DOCS_TOKEN\", prefix = \"Bearer \" }} }}\n"
    );
    let (_server, mut client) =
        executor_with(&dir, &config, &[("DOCS_TOKEN", "very-secret-token")]).await;
    let names: Vec<String> = tools(&mut client)
        .await
        .into_iter()
        .map(|t| t.name)
        .collect();
    assert!(names.contains(&"docs__echo".to_owned()), "{names:?}");
    assert!(
        !names.contains(&"docs__simulate-research-query".to_owned()),
        "a tool that can only be called as a task is left out: {names:?}"
    );
    let out = execute(&mut client, "docs__echo", json!({"message": "over http"})).await;
    assert_eq!(out.output, "Echo: over http");
    let out = execute(&mut client, "docs__get-resource-links", json!({"count": 2})).await;
    assert_eq!(out.references.len(), 2);

    // The config names where the secret is, never the secret.
    let printed = std::process::Command::new(agentrt_test_support::binary("tool-executor"))
        .args([
            "--config",
            dir.0.join("tool-executor.toml").to_str().unwrap(),
        ])
        .arg("--print-config")
        .env("DOCS_TOKEN", "very-secret-token")
        .output()
        .unwrap();
    let printed = String::from_utf8_lossy(&printed.stdout);
    assert!(printed.contains("DOCS_TOKEN"), "{printed}");
    assert!(!printed.contains("very-secret-token"), "{printed}");
}

#[tokio::test]
async fn an_http_server_that_goes_away_is_unavailable_then_reconnected() {
    let (everything, url) = everything_over_http().await;
    let dir = TempDir::new("http-down");
    let config = format!("[[mcp_servers]]\nname = \"docs\"\nurl = {url:?}\n");
    let (_server, mut client) = executor_with(&dir, &config, &[]).await;
    let out = execute(&mut client, "docs__echo", json!({"message": "one"})).await;
    assert_eq!(out.output, "Echo: one");
    drop(everything);
    tokio::time::sleep(Duration::from_millis(300)).await;
    let status = client
        .execute_tool(call("docs__echo", json!({"message": "two"})))
        .await
        .unwrap_err();
    assert_eq!(status.code(), Code::Unavailable, "{status:?}");
    assert!(status.message().contains("\"docs\""), "{status:?}");

    // Back on the same port: the executor reconnects.
    let _again = everything_on(port_of(&url)).await;
    let deadline = Instant::now() + Duration::from_secs(40);
    loop {
        match client
            .execute_tool(call("docs__echo", json!({"message": "three"})))
            .await
        {
            Ok(out) => {
                assert_eq!(out.into_inner().output, "Echo: three");
                break;
            }
            Err(status) => assert!(Instant::now() < deadline, "not reconnected: {status:?}"),
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

/// server-everything restarted at once behind the same URL refuses the old session with
/// a 400 (`No valid session ID provided`) where MCP says 404: the executor makes a new
/// session at once and sends the call, which the server did not process, again on it.
#[tokio::test]
async fn an_http_server_restarted_behind_the_same_url_is_reached_again() {
    let (everything, url) = everything_over_http().await;
    let dir = TempDir::new("http-restart");
    let config =
        format!("[[mcp_servers]]\nname = \"docs\"\nurl = {url:?}\nconnect_timeout = \"2s\"\n");
    let (_server, mut client) = executor_with(&dir, &config, &[]).await;
    let out = execute(&mut client, "docs__echo", json!({"message": "one"})).await;
    assert_eq!(out.output, "Echo: one");
    drop(everything);
    let port = port_of(&url);
    // Wait until the port is free, then start it again at once: the executor's next call
    // goes to the new server, on the old session.
    let deadline = Instant::now() + Duration::from_secs(10);
    while tokio::net::TcpStream::connect(("127.0.0.1", port))
        .await
        .is_ok()
    {
        assert!(Instant::now() < deadline, "server-everything did not stop");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let _again = everything_on(port).await;
    let restarted = Instant::now();
    // The first call goes through; should the executor's periodic `tools/list` have found
    // the server gone in the moment it was down, the call is UNAVAILABLE while it connects
    // again, for a moment.
    loop {
        let mut request = tonic::Request::new(call("docs__echo", json!({"message": "two"})));
        request.set_timeout(Duration::from_secs(3));
        match client.execute_tool(request).await {
            Ok(out) => {
                let out = out.into_inner();
                assert!(!out.is_error, "the old session was not replaced: {out:?}");
                assert_eq!(out.output, "Echo: two");
                break;
            }
            Err(status) => {
                assert_eq!(status.code(), Code::Unavailable, "{status:?}");
                assert!(
                    restarted.elapsed() < Duration::from_secs(5),
                    "not reached again at once: {status:?}"
                );
            }
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    assert!(
        restarted.elapsed() < Duration::from_secs(5),
        "{:?}",
        restarted.elapsed()
    );
}

#[tokio::test]
async fn server_filesystem_reads_a_directory() {
    let dir = TempDir::new("fs");
    let files = dir.0.join("files");
    std::fs::create_dir_all(&files).unwrap();
    std::fs::write(files.join("notes.txt"), "the answer is 42\n").unwrap();
    let config = format!(
        "[[mcp_servers]]\nname = \"fs\"\ncommand = \"node\"\nargs = [{:?}, {:?}]\n",
        mcp_server("server-filesystem"),
        files.display().to_string()
    );
    let (_server, mut client) = executor_with(&dir, &config, &[]).await;
    let out = execute(
        &mut client,
        "fs__read_text_file",
        json!({"path": files.join("notes.txt").display().to_string()}),
    )
    .await;
    assert!(!out.is_error, "{}", out.output);
    assert!(out.output.contains("the answer is 42"), "{}", out.output);
    let out = execute(
        &mut client,
        "fs__read_text_file",
        json!({"path": "/etc/passwd"}),
    )
    .await;
    assert!(
        out.is_error,
        "outside the allowed directory: {}",
        out.output
    );
}

const PETSTORE: &str = r##"openapi: 3.0.3
info: {title: pets, version: "1"}
servers: [{url: "http://127.0.0.1:BASE_PORT/v1"}]
paths:
  /pets/{petId}:
    get:
      operationId: getPet
      summary: One pet
      parameters:
        - {name: petId, in: path, required: true, schema: {type: string}}
        - {name: verbose, in: query, schema: {type: boolean}}
        - {name: X-Trace, in: header, schema: {type: string}}
      responses: {200: {description: ok}}
  /pets:
    post:
      operationId: createPet
      requestBody:
        required: true
        content:
          application/json:
            schema: {$ref: "#/components/schemas/Pet"}
      responses: {201: {description: created}}
  /missing: {get: {operationId: missing, responses: {404: {description: no}}}}
  /boom: {get: {operationId: boom, responses: {500: {description: no}}}}
  /big: {get: {operationId: big, responses: {200: {description: big}}}}
  /moved: {get: {operationId: moved, responses: {302: {description: elsewhere}}}}
components:
  schemas:
    Pet:
      type: object
      required: [name]
      properties:
        name: {type: string}
        tag: {type: string, nullable: true}
"##;

/// The API the document describes: echoes what it was sent.
async fn pets_api(
    other_origin: String,
    uri: axum::http::Uri,
    method: axum::http::Method,
    headers: axum::http::HeaderMap,
    body: axum::body::Bytes,
) -> axum::response::Response {
    use axum::{http::StatusCode, response::IntoResponse};
    let header = |name: &str| {
        headers
            .get(name)
            .and_then(|v| v.to_str().ok())
            .unwrap_or_default()
            .to_owned()
    };
    match uri.path() {
        "/v1/missing" => (StatusCode::NOT_FOUND, "no such thing").into_response(),
        "/v1/boom" => (StatusCode::INTERNAL_SERVER_ERROR, "it broke").into_response(),
        "/v1/big" => "x".repeat(2 * 1024 * 1024).into_response(),
        "/v1/moved" => (
            StatusCode::FOUND,
            [("location", format!("{other_origin}/stolen"))],
        )
            .into_response(),
        path => axum::Json(json!({
            "method": method.as_str(),
            "path": path,
            "query": uri.query(),
            "trace": header("x-trace"),
            "authorization": header("authorization"),
            "body": serde_json::from_slice::<serde_json::Value>(&body).ok(),
        }))
        .into_response(),
    }
}

#[tokio::test]
async fn an_openapi_document_calls_the_api_it_describes() {
    // Another origin, which the API redirects to: it must never be called.
    let stolen = Arc::new(AtomicUsize::new(0));
    let counter = stolen.clone();
    let (other, _other_guard) = serve_http(axum::Router::new().fallback(move || {
        let counter = counter.clone();
        async move {
            counter.fetch_add(1, Ordering::SeqCst);
            "stolen"
        }
    }))
    .await;
    let other_origin = format!("http://127.0.0.1:{}", other.port());
    let (api, _api_guard) = serve_http(axum::Router::new().fallback(
        move |uri, method, headers, body| {
            pets_api(other_origin.clone(), uri, method, headers, body)
        },
    ))
    .await;

    let dir = TempDir::new("openapi");
    dir.write(
        "petstore.yaml",
        &PETSTORE.replace("BASE_PORT", &api.port().to_string()),
    );
    dir.write("pets-token", "pets-secret\n");
    let config = "[[openapi]]\nname = \"pets\"\nspec = \"petstore.yaml\"\n\
                  headers = { Authorization = { file = \"pets-token\", prefix = \"Bearer \" } }\n";
    let (_server, mut client) = executor_with(&dir, config, &[]).await;

    let listed = tools(&mut client).await;
    let get_pet = listed.iter().find(|t| t.name == "pets__getPet").unwrap();
    assert_eq!(get_pet.source, v1::ToolSource::Http as i32);
    assert_eq!(get_pet.description, "One pet");
    let schema = struct_to_json(get_pet.input_schema.as_ref().unwrap());
    assert_eq!(schema["required"], json!(["petId"]));
    assert_eq!(
        schema["properties"].as_object().unwrap().len(),
        3,
        "{schema}"
    );

    let out = execute(
        &mut client,
        "pets__getPet",
        json!({"petId": "rex/1 a", "verbose": true, "X-Trace": "t-1"}),
    )
    .await;
    assert!(!out.is_error, "{}", out.output);
    let echoed = value_to_json(out.structured_output.as_ref().unwrap());
    assert_eq!(echoed["method"], "GET");
    assert_eq!(echoed["path"], "/v1/pets/rex%2F1%20a");
    assert_eq!(echoed["query"], "verbose=true");
    assert_eq!(echoed["trace"], "t-1");
    assert_eq!(echoed["authorization"], "Bearer pets-secret");

    let out = execute(
        &mut client,
        "pets__createPet",
        json!({"body": {"name": "Rex", "tag": null}}),
    )
    .await;
    let echoed = value_to_json(out.structured_output.as_ref().unwrap());
    assert_eq!(echoed["method"], "POST");
    assert_eq!(echoed["body"], json!({"name": "Rex", "tag": null}));
    let status = client
        .execute_tool(call("pets__createPet", json!({"body": {"tag": "x"}})))
        .await
        .unwrap_err();
    assert_eq!(status.code(), Code::InvalidArgument);

    let out = execute(&mut client, "pets__missing", json!({})).await;
    assert!(out.is_error);
    assert!(out.output.contains("404"), "{}", out.output);
    let out = execute(&mut client, "pets__boom", json!({})).await;
    assert!(out.is_error);
    assert!(out.output.contains("500"), "{}", out.output);
    assert!(out.output.contains("it broke"), "{}", out.output);
    let out = execute(&mut client, "pets__big", json!({})).await;
    assert!(out.is_error);
    assert!(
        out.output.contains("larger than 1048576 bytes"),
        "{}",
        out.output
    );
    let out = execute(&mut client, "pets__moved", json!({})).await;
    assert!(out.is_error);
    assert!(out.output.contains("not followed"), "{}", out.output);
    assert_eq!(
        stolen.load(Ordering::SeqCst),
        0,
        "the redirect was followed"
    );
}

#[tokio::test]
async fn two_tools_with_one_name_stop_the_start_naming_both() {
    let dir = TempDir::new("dup");
    dir.write(
        "api.json",
        r#"{"openapi": "3.1.0", "paths": {
            "/a": {"get": {"operationId": "get.pet"}},
            "/b": {"get": {"operationId": "get_pet"}}}}"#,
    );
    let config = dir.write(
        "tool-executor.toml",
        "[[openapi]]\nname = \"api\"\nspec = \"api.json\"\nbase_url = \"http://127.0.0.1:9\"\n",
    );
    let stderr = refused_start(&config).await;
    assert!(stderr.contains("\"api__get_pet\""), "{stderr}");
    assert!(stderr.contains("operation \"get.pet\""), "{stderr}");
    assert!(stderr.contains("operation \"get_pet\""), "{stderr}");
}

#[tokio::test]
async fn config_errors_name_the_setting_that_is_wrong() {
    let dir = TempDir::new("badcfg");
    dir.write("api.json", r#"{"openapi": "3.1.0", "paths": {}}"#);
    dir.write("swagger.json", r#"{"swagger": "2.0", "paths": {}}"#);
    for (config, setting, wrong) in [
        (
            "[[openapi]]\nname = \"api\"\nspec = \"api.json\"\nbase_url = \"http://127.0.0.1:9\"\n\
             [[openapi]]\nname = \"api\"\nspec = \"api.json\"\nbase_url = \"http://127.0.0.1:9\"\n",
            "invalid setting `openapi`: two tool sources are named \"api\"",
            "`mcp_servers`",
        ),
        (
            "[[openapi]]\nname = \"api\"\nspec = \"api.json\"\nbase_url = \"not a url\"\n",
            "invalid setting `openapi`: \"api\": `base_url` \"not a url\": ",
            "a relative server URL needs",
        ),
        // Credentials in a URL: refused, and the password shown nowhere. (They were
        // logged and put in errors that reach clients, or dropped without a word.)
        (
            "[[openapi]]\nname = \"api\"\nspec = \"api.json\"\n\
             base_url = \"http://u:hunter2@127.0.0.1:9/v1\"\n",
            "`base_url` \"http://***@127.0.0.1:9/v1\": it carries credentials",
            "hunter2",
        ),
        (
            "[[mcp_servers]]\nname = \"docs\"\nurl = \"http://u:hunter2@127.0.0.1:9/mcp\"\n",
            "url \"http://***@127.0.0.1:9/mcp\": it carries credentials",
            "hunter2",
        ),
        // A secret written inline: refused saying how to give one (it said "expected
        // struct SecretRef").
        (
            "[[openapi]]\nname = \"api\"\nspec = \"api.json\"\nbase_url = \"http://127.0.0.1:9\"\n\
             headers = { X-Api-Key = \"literal-secret\" }\n",
            "a secret is never written in the config",
            "SecretRef",
        ),
        // A Swagger 2.0 document (it said "`openapi: ` is not supported").
        (
            "[[openapi]]\nname = \"api\"\nspec = \"swagger.json\"\nbase_url = \"http://127.0.0.1:9\"\n",
            "a Swagger \"2.0\" document is not supported",
            "`openapi: `",
        ),
    ] {
        let config = dir.write("tool-executor.toml", config);
        let stderr = refused_start(&config).await;
        assert!(stderr.contains(setting), "{stderr}");
        assert!(!stderr.contains(wrong), "{stderr}");
    }
}

/// Starts the tool executor with `config`, which it must refuse: what it said.
async fn refused_start(config: &std::path::Path) -> String {
    let output = tokio::process::Command::new(agentrt_test_support::binary("tool-executor"))
        .args(["--listen", "127.0.0.1:0", "--config"])
        .arg(config)
        .output()
        .await
        .unwrap();
    assert!(!output.status.success(), "the start was not refused");
    String::from_utf8_lossy(&output.stderr).into_owned()
}

#[tokio::test]
async fn the_builtins_alone_are_unchanged() {
    let server = tool_executor(&[]).await;
    let mut client = ToolExecutorClient::new(connect(&server.url()).await);
    let names: Vec<String> = tools(&mut client)
        .await
        .into_iter()
        .map(|t| t.name)
        .collect();
    assert_eq!(names, ["calculator", "current_time", "sleep"]);
}

#[test]
fn the_readme_tool_sources_config_is_accepted_with_secrets_masked() {
    let readme =
        std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/README.md")).unwrap();
    let section = &readme[readme.find("## Tool sources").unwrap()..];
    let start = section.find("```toml\n").unwrap() + "```toml\n".len();
    let config = &section[start..start + section[start..].find("```").unwrap()];
    let dir = TempDir::new("readme");
    let path = dir.write("tool-executor.toml", config);
    let printed = std::process::Command::new(agentrt_test_support::binary("tool-executor"))
        .arg("--config")
        .arg(&path)
        .arg("--print-config")
        .env("DOCS_TOKEN", "readme-secret")
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&printed.stdout);
    assert!(
        printed.status.success(),
        "{stdout}{}",
        String::from_utf8_lossy(&printed.stderr)
    );
    for expected in [
        "everything",
        "docs",
        "petstore",
        "DOCS_TOKEN",
        "petstore.key",
    ] {
        assert!(stdout.contains(expected), "{expected} missing: {stdout}");
    }
    assert!(!stdout.contains("readme-secret"), "{stdout}");
}

#[tokio::test]
async fn a_catalogue_larger_than_a_message_is_listed_and_offered() {
    // 1,100 operations with descriptions of 4,000 bytes: a catalogue of about 4.5 MB, over
    // the 4 MiB a peer's message may have (`server.max_message_bytes`). ListTools answered
    // OUT_OF_RANGE, and agent-server, which lists the catalogue to check a config, refused
    // every engine, even one asking for the calculator alone.
    let dir = TempDir::new("large-catalogue");
    let description = "d".repeat(4000);
    let paths: serde_json::Map<String, serde_json::Value> = (0..1100)
        .map(|i| {
            (
                format!("/op{i}"),
                json!({"get": {"operationId": format!("op{i}"), "description": description}}),
            )
        })
        .collect();
    dir.write(
        "api.json",
        &json!({"openapi": "3.1.0", "info": {"title": "large", "version": "1"}, "paths": paths})
            .to_string(),
    );
    let (server, client) = executor_with(
        &dir,
        "[[openapi]]\nname = \"large\"\nspec = \"api.json\"\nbase_url = \"http://127.0.0.1:9\"\n",
        &[],
    )
    .await;
    let listed = client
        .max_decoding_message_size(usize::MAX)
        .list_tools(v1::ListToolsRequest {})
        .await
        .unwrap()
        .into_inner();
    assert!(
        prost::Message::encoded_len(&listed) > 4 * 1024 * 1024,
        "the catalogue is larger than a message"
    );
    assert_eq!(listed.tools.len(), 1100 + 3, "with the built-ins");

    let agents =
        agentrt_test_support::agent_server_with_model(&server.url(), "http://127.0.0.1:9/v1", &[])
            .await;
    let mut service =
        v1::agent_service_client::AgentServiceClient::new(connect(&agents.url()).await);
    for tools in [vec!["calculator"], vec!["large__op1099", "calculator"]] {
        let created = service
            .create_agent_engine(v1::CreateAgentEngineRequest {
                config: Some(common::agent("m", &tools)),
                session_id: String::new(),
            })
            .await;
        assert!(created.is_ok(), "{tools:?}: {created:?}");
    }
}
