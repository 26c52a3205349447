//! The Python example client (grpcio, stubs generated from `proto/`) runs a tool-using
//! `Execute` against the real binaries, and answers a run that waits: it runs its client
//! tool and approves or denies a call, by flag or on the terminal.
//!
//! Needs python3 with grpcio and grpcio-tools: `pip install grpcio grpcio-tools`.

// Tests fail by panicking, with the value that was wrong.
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use std::path::PathBuf;

use agentrt_test_support::run_example_client;
use common::Stack;

/// A model that calls the example's client tool and the calculator in one round, then
/// answers with the tool results it was sent.
const SHOP: &str = r#"{"scenarios": {"shop": {"turns": [
  {"tool_calls": [
    {"id": "k1", "name": "lookup_order", "arguments": {"order_id": "A-17"}},
    {"id": "c1", "name": "calculator", "arguments": {"expression": "6 * 7"}}]},
  {"content": "results: {tool_results}"}]}}}"#;

fn script() -> PathBuf {
    let probe = std::process::Command::new("python3")
        .args(["-c", "import grpc, grpc_tools"])
        .output();
    assert!(
        probe.is_ok_and(|o| o.status.success()),
        "this test runs examples/python with python3: install its packages with `pip install grpcio grpcio-tools`"
    );
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("examples/python/run_agent.py")
}

#[tokio::test]
async fn the_python_example_runs_a_tool_using_turn() {
    let stdout = run_example_client("python3", &script()).await;
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

/// Runs the example against `stack` with `args` and `stdin` piped in; panics with both of
/// its outputs unless it exits 0. Returns what it printed.
async fn run_example(stack: &Stack, args: &[&str], stdin: &str) -> String {
    common::run_example_exiting("python3", &script(), stack, args, stdin, 0).await
}

/// The example tells a complete answer from a cut one and from a failed run, and prints as
/// the answer only the text of the run's last round.
#[tokio::test]
async fn the_example_reports_each_outcome_as_it_is() {
    let stack = Stack::up(common::EXAMPLE_OUTCOMES, &[]).await;
    let script = script();
    common::example_reports_each_outcome(|args, code| {
        common::run_example_exiting("python3", &script, &stack, args, "", code)
    })
    .await;
}

/// The `answer: ` line the example printed.
fn answer(stdout: &str) -> &str {
    stdout
        .lines()
        .find_map(|line| line.strip_prefix("answer: "))
        .unwrap_or_else(|| panic!("no answer line in:\n{stdout}"))
}

/// The README's client-tool example, on the stack the README starts: the `demo` model
/// calls the tool the query names with the order id its schema asks for.
#[tokio::test]
async fn the_readmes_client_tool_example_runs_with_the_demo_model() {
    let stack = Stack::up(SHOP, &[]).await;
    let stdout = run_example(
        &stack,
        &["--query", "Where is order A-17? Use lookup_order."],
        "",
    )
    .await;
    for line in [
        "[tool call] lookup_order({'order_id': 'A-17'})",
        "[action required] 1 tool call(s) wait for an answer",
        "answer: The answer is order A-17: shipped on 2026-11-20, arriving Friday.",
    ] {
        assert!(stdout.contains(line), "{line} missing from:\n{stdout}");
    }
}

#[tokio::test]
async fn the_python_example_runs_its_client_tool_and_asks_for_approval() {
    let stack = Stack::up(SHOP, &[]).await;
    let waiting = [
        "--model",
        "shop",
        "--query",
        "Where is order A-17, and what is 6 * 7?",
        "--approve-tool",
        "calculator",
    ];
    let order = "order A-17: shipped on 2026-11-20, arriving Friday";

    // Approved by flag: the calculator runs after the approval, beside the client tool.
    let stdout = run_example(
        &stack,
        &[&waiting[..], &["--auto-approve", "yes"]].concat(),
        "",
    )
    .await;
    for line in [
        "[tool call] lookup_order({'order_id': 'A-17'})",
        "[action required] 2 tool call(s) wait for an answer",
        &format!("[client tool] lookup_order({{'order_id': 'A-17'}}) -> {order}"),
        "[approved] calculator({'expression': '6 * 7'})",
        &format!("[tool result] lookup_order -> {order}"),
        "[tool result] calculator -> 42",
        &format!("answer: results: {order}, 42"),
        "done: EVENT_TYPE_FINAL_ANSWER stop_reason=final_answer",
    ] {
        assert!(stdout.contains(line), "{line} missing from:\n{stdout}");
    }

    // Denied by flag: the model reads the reason instead of a result.
    let denied = [
        &waiting[..],
        &[
            "--auto-approve",
            "no",
            "--deny-reason",
            "no arithmetic today",
        ],
    ]
    .concat();
    let stdout = run_example(&stack, &denied, "").await;
    assert!(
        stdout.contains("[denied] calculator({'expression': '6 * 7'}): no arithmetic today"),
        "{stdout}"
    );
    let said = answer(&stdout);
    assert!(said.starts_with(&format!("results: {order}, ")), "{said}");
    assert!(
        said.contains("denied") && said.contains("no arithmetic today"),
        "{said}"
    );
    assert!(!said.contains("42"), "{said}");
    assert!(stdout.contains("stop_reason=final_answer"), "{stdout}");

    // Asked on the terminal: "n", then the reason.
    let stdout = run_example(&stack, &waiting, "n\nask me tomorrow\n").await;
    assert!(
        stdout.contains("approve calculator({'expression': '6 * 7'})? [y/N] "),
        "{stdout}"
    );
    assert!(
        stdout.contains("[denied] calculator({'expression': '6 * 7'}): ask me tomorrow"),
        "{stdout}"
    );
    let said = answer(&stdout);
    assert!(
        said.contains("ask me tomorrow") && !said.contains("42"),
        "{said}"
    );
}
