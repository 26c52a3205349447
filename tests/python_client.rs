//! The Python example client (grpcio, stubs generated from `proto/`) runs a tool-using
//! `Execute` against the real binaries.
//!
//! Needs python3 with grpcio and grpcio-tools: `pip install grpcio grpcio-tools`.

// Tests fail by panicking, with the value that was wrong.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use agentrt_test_support::run_example_client;

#[tokio::test]
async fn the_python_example_runs_a_tool_using_turn() {
    let probe = std::process::Command::new("python3")
        .args(["-c", "import grpc, grpc_tools"])
        .output();
    assert!(
        probe.is_ok_and(|o| o.status.success()),
        "this test runs examples/python with python3: install its packages with `pip install grpcio grpcio-tools`"
    );
    let script =
        std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("examples/python/run_agent.py");
    let stdout = run_example_client("python3", &script).await;
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
