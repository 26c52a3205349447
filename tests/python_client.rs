//! The Python example client (grpcio, stubs generated from `proto/`) runs a tool-using
//! `Execute` against the real binaries.
//!
//! Needs python3 with grpcio and grpcio-tools: `pip install grpcio grpcio-tools`.

// Tests fail by panicking, with the value that was wrong.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use agentrt_test_support::{agent_server_with_model, simulator, tool_executor};

#[tokio::test]
async fn the_python_example_runs_a_tool_using_turn() {
    let probe = std::process::Command::new("python3")
        .args(["-c", "import grpc, grpc_tools"])
        .output();
    assert!(
        probe.is_ok_and(|o| o.status.success()),
        "this test runs examples/python with python3: install its packages with `pip install grpcio grpcio-tools`"
    );
    let model = simulator(r#"{"scenarios": {}}"#, &[]).await;
    let tools = tool_executor(&[]).await;
    let agents = agent_server_with_model(&tools.url(), &format!("{}/v1", model.url()), &[]).await;
    let script = concat!(env!("CARGO_MANIFEST_DIR"), "/examples/python/run_agent.py");
    let output = tokio::process::Command::new("python3")
        .args([
            script,
            "--target",
            &agents.addr.to_string(),
            "--query",
            "What is 6 * 7?",
        ])
        .output()
        .await
        .unwrap();
    let stdout = String::from_utf8_lossy(&output.stdout);
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(
        output.status.success(),
        "stdout:\n{stdout}\nstderr:\n{stderr}"
    );
    assert!(
        stdout.contains("[tool call] calculator({'expression': '6 * 7'})"),
        "{stdout}"
    );
    assert!(
        stdout.contains("[tool result] calculator -> 42"),
        "{stdout}"
    );
    assert!(stdout.contains("answer: The answer is 42."), "{stdout}");
    assert!(
        stdout.contains("done: EVENT_TYPE_FINAL_ANSWER stop_reason=final_answer"),
        "{stdout}"
    );
}
