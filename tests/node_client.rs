//! The Node.js example client (@grpc/grpc-js, @grpc/proto-loader reading `proto/`) runs a
//! tool-using `Execute` against the real binaries.
//!
//! Needs node 18+ and the example's packages: `npm ci --prefix examples/node`.

// Tests fail by panicking, with the value that was wrong.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::path::Path;

use agentrt_test_support::run_example_client;

#[tokio::test]
async fn the_node_example_runs_a_tool_using_turn() {
    let example = Path::new(env!("CARGO_MANIFEST_DIR")).join("examples/node");
    let node = std::process::Command::new("node").arg("--version").output();
    assert!(
        node.is_ok_and(|o| o.status.success()),
        "this test runs examples/node with node (18 or later), which is not on PATH"
    );
    assert!(
        example.join("node_modules/@grpc/grpc-js").is_dir()
            && example.join("node_modules/@grpc/proto-loader").is_dir(),
        "this test needs the Node example's packages: run `npm ci --prefix examples/node`"
    );
    let stdout = run_example_client("node", &example.join("run_agent.js")).await;
    for line in [
        r#"[tool call] calculator({"expression":"6 * 7"})"#,
        "[tool result] calculator -> 42",
        "answer: The answer is 42.",
        "done: EVENT_TYPE_FINAL_ANSWER stop_reason=final_answer",
    ] {
        assert!(stdout.contains(line), "{line} missing from:\n{stdout}");
    }
}
