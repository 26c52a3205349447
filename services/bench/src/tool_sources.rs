//! `agentrt-bench --tool-sources`: the tool executor's own CPU per call to an MCP server
//! over stdio (`@modelcontextprotocol/server-everything`'s `echo`, a child process whose
//! CPU is not counted) and per call of an OpenAPI operation against an HTTP server in
//! this process (not counted either), and 1,000 MCP calls at once to one server.
//!
//! Every figure is printed only after checking that each call returned the expected
//! result, not an error.

use std::{path::Path, time::Instant};

use agentrt::{
    json::json_to_struct,
    v1::{self, tool_executor_client::ToolExecutorClient},
};
use agentrt_test_support::Server;
use anyhow::{Context, bail, ensure};
use futures_util::{StreamExt, stream};
use tonic::transport::{Channel, Endpoint};

use crate::cpu::CpuMeter;

/// Calls measured per figure.
const CALLS: usize = 5_000;
/// Calls in flight while measuring CPU per call.
const IN_FLIGHT: usize = 32;
/// Calls at once in the burst figure.
const BURST: usize = 1_000;

const OPENAPI: &str = r#"{"openapi": "3.1.0", "info": {"title": "bench", "version": "1"},
  "paths": {"/items/{id}": {"get": {"operationId": "getItem",
    "parameters": [{"name": "id", "in": "path", "required": true, "schema": {"type": "string"}},
                   {"name": "verbose", "in": "query", "schema": {"type": "boolean"}}],
    "responses": {"200": {"description": "the item"}}}}}}"#;

/// Runs the tool-source figures with the binaries in `dir` and the MCP server at
/// `everything_js` (installed by `scripts/test` under `tests/mcp`).
pub(crate) async fn run(dir: &Path, everything_js: &Path) -> anyhow::Result<()> {
    if !dir.join("tool-executor").exists() {
        bail!(
            "tool-executor is missing beside the bench: run `cargo build --release -p \
             agentrt-tool-executor -p agentrt-bench` first"
        );
    }
    if !everything_js.exists() {
        bail!(
            "{} is missing: run `npm ci --prefix tests/mcp` (scripts/test does) or pass \
             --mcp-server-js",
            everything_js.display()
        );
    }
    // The HTTP API the OpenAPI document describes, served by this process.
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
    let api = listener.local_addr()?;
    let router = axum::Router::new().route(
        "/items/{id}",
        axum::routing::get(
            |axum::extract::Path(id): axum::extract::Path<String>| async move {
                axum::Json(serde_json::json!({"id": id, "stock": 7}))
            },
        ),
    );
    let api_task = tokio::spawn(async move { axum::serve(listener, router).await });

    let work = std::env::temp_dir().join(format!("agentrt-bench-tools-{}", std::process::id()));
    std::fs::create_dir_all(&work)?;
    std::fs::write(work.join("api.json"), OPENAPI)?;
    let config = work.join("tool-executor.toml");
    std::fs::write(
        &config,
        format!(
            "[[mcp_servers]]\nname = \"everything\"\ncommand = \"node\"\nargs = [{:?}, \
             \"stdio\"]\n\n[[openapi]]\nname = \"api\"\nspec = \"api.json\"\nbase_url = \
             \"http://{api}\"\n",
            everything_js.display().to_string()
        ),
    )?;
    let tools = Server::start_at(
        &dir.join("tool-executor"),
        &[
            "--listen",
            "127.0.0.1:0",
            "--config",
            &config.to_string_lossy(),
        ],
        &[("RUST_LOG", "warn,agentrt_grpc=info")],
    )
    .await;
    let cpu = CpuMeter::start(&[tools.pid().context("tool-executor has no pid")?])?;
    let channel = Endpoint::from_shared(tools.url())?
        .tcp_nodelay(true)
        .connect()
        .await?;
    let client = ToolExecutorClient::new(channel);

    // Warm up both paths, and check that the tools are there.
    calls(&client, mcp_call, 200, IN_FLIGHT).await?;
    calls(&client, openapi_call, 200, IN_FLIGHT).await?;

    let t0 = cpu.now()?;
    let started = Instant::now();
    calls(&client, mcp_call, CALLS, IN_FLIGHT).await?;
    let mcp_wall = started.elapsed();
    let mcp_cpu = cpu.now()?.saturating_sub(t0) / CALLS as u32;

    let t0 = cpu.now()?;
    let started = Instant::now();
    calls(&client, openapi_call, CALLS, IN_FLIGHT).await?;
    let openapi_wall = started.elapsed();
    let openapi_cpu = cpu.now()?.saturating_sub(t0) / CALLS as u32;

    // The same gRPC call to a built-in: what any tool call costs before its source.
    calls(&client, builtin_call, 200, IN_FLIGHT).await?;
    let t0 = cpu.now()?;
    calls(&client, builtin_call, CALLS, IN_FLIGHT).await?;
    let builtin_cpu = cpu.now()?.saturating_sub(t0) / CALLS as u32;

    let started = Instant::now();
    calls(&client, mcp_call, BURST, BURST).await?;
    let burst = started.elapsed();

    println!(
        "tool sources ({CALLS} calls, {IN_FLIGHT} in flight; tool-executor CPU only):\n  \
         MCP over stdio (server-everything echo): {:.1} us CPU per call (target < 100), \
         {:.0} calls/s\n  OpenAPI GET against a local HTTP server: {:.1} us CPU per call \
         (target < 60), {:.0} calls/s\n  for comparison, the built-in calculator: {:.1} us \
         CPU per call (gRPC, validation, the tool)\n  {BURST} MCP calls at once to one \
         server: all answered, in {:.2} s",
        mcp_cpu.as_secs_f64() * 1e6,
        CALLS as f64 / mcp_wall.as_secs_f64(),
        openapi_cpu.as_secs_f64() * 1e6,
        CALLS as f64 / openapi_wall.as_secs_f64(),
        builtin_cpu.as_secs_f64() * 1e6,
        burst.as_secs_f64(),
    );
    drop(tools);
    api_task.abort();
    let _ = std::fs::remove_dir_all(work);
    Ok(())
}

/// A call of `everything__echo` and the output it must give.
fn mcp_call(i: usize) -> (v1::ExecuteToolRequest, String) {
    let message = format!("bench {i}");
    (
        request("everything__echo", serde_json::json!({"message": message})),
        format!("Echo: {message}"),
    )
}

/// A call of the built-in calculator and the output it must give.
fn builtin_call(i: usize) -> (v1::ExecuteToolRequest, String) {
    (
        request(
            "calculator",
            serde_json::json!({"expression": format!("{i} + 1")}),
        ),
        (i + 1).to_string(),
    )
}

/// A call of `api__getItem` and the output it must give.
fn openapi_call(i: usize) -> (v1::ExecuteToolRequest, String) {
    (
        request(
            "api__getItem",
            serde_json::json!({"id": format!("sku-{i}")}),
        ),
        format!(r#"{{"id":"sku-{i}","stock":7}}"#),
    )
}

fn request(tool: &str, arguments: serde_json::Value) -> v1::ExecuteToolRequest {
    v1::ExecuteToolRequest {
        call_id: "bench".into(),
        tool_name: tool.into(),
        arguments: json_to_struct(&arguments),
        run_id: "bench".into(),
        session_id: "bench".into(),
    }
}

/// Makes `count` calls, `in_flight` at a time; fails unless each gave its expected output.
async fn calls(
    client: &ToolExecutorClient<Channel>,
    call: fn(usize) -> (v1::ExecuteToolRequest, String),
    count: usize,
    in_flight: usize,
) -> anyhow::Result<()> {
    let results: Vec<anyhow::Result<()>> = stream::iter(0..count)
        .map(|i| {
            let mut client = client.clone();
            async move {
                let (request, expected) = call(i);
                let tool = request.tool_name.clone();
                let out = client
                    .execute_tool(request)
                    .await
                    .with_context(|| format!("{tool} failed"))?
                    .into_inner();
                ensure!(
                    !out.is_error && out.output == expected,
                    "{tool} answered {:?} (is_error {}), expected {expected:?}",
                    out.output,
                    out.is_error
                );
                Ok(())
            }
        })
        .buffer_unordered(in_flight)
        .collect()
        .await;
    results.into_iter().collect()
}
