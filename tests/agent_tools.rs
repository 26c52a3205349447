//! Agents using the tool executor's tool sources end to end: a run through the model
//! simulator calls an MCP tool (`@modelcontextprotocol/server-everything` over stdio,
//! installed by `scripts/test` into `tests/mcp/node_modules`) and an OpenAPI tool (an API
//! served by the test, described by a document in a temporary directory), streams their
//! results and references, reranks the references through the simulator's deterministic
//! reranker (or says why not), and reads a tool that left the catalogue as an error.

// Tests fail by panicking, with the value that was wrong.
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use std::{
    collections::{HashMap, HashSet},
    sync::{
        Arc,
        atomic::{AtomicUsize, Ordering},
    },
    time::{Duration, Instant},
};

use agentrt::{
    json::json_to_struct,
    v1::{self, tool_executor_client::ToolExecutorClient},
};
use agentrt_test_support::{Server, connect};
use common::{Stack, TempDir, agent, collect, data, done, kind, mcp_server, serve_http, text};
use serde_json::{Value, json};
use tonic::Code;

const SCENARIOS: &str = r#"{"scenarios": {
  "tools": {"turns": [
    {"tool_calls": [
      {"id": "call_echo", "name": "everything__echo", "arguments": {"message": "hello from the agent"}},
      {"id": "call_links", "name": "everything__get-resource-links", "arguments": {"count": 3}},
      {"id": "call_embedded", "name": "everything__get-resource-reference", "arguments": {"resourceType": "Text", "resourceId": 2}},
      {"id": "call_api", "name": "weather__getForecast", "arguments": {"city": "Paris", "days": 2}}]},
    {"content": "Done: {tool_results}"}]},
  "ranked": {"turns": [
    {"tool_calls": [
      {"id": "call_six", "name": "everything__get-resource-links", "arguments": {"count": 6}},
      {"id": "call_four", "name": "everything__get-resource-links", "arguments": {"count": 4}},
      {"id": "call_echo", "name": "everything__echo", "arguments": {"message": "no references"}}]},
    {"content": "Ranked."}]},
  "gone": {"turns": [
    {"tool_calls": [{"id": "call_gone", "name": "everything__echo", "arguments": {"message": "anyone?"}}]},
    {"content": "The tool said: {tool_results}"}]}
}}"#;

/// The tools of the runs: server-everything's, and the weather API's.
const TOOLS: &[&str] = &[
    "everything__echo",
    "everything__get-resource-links",
    "everything__get-resource-reference",
    "weather__getForecast",
];

const WEATHER_API: &str = r#"openapi: 3.1.0
info: {title: weather, version: "1"}
servers: [{url: "http://127.0.0.1:BASE_PORT"}]
paths:
  /forecast/{city}:
    get:
      operationId: getForecast
      summary: The weather forecast for a city
      parameters:
        - {name: city, in: path, required: true, schema: {type: string}}
        - {name: days, in: query, schema: {type: integer, minimum: 1, maximum: 7}}
      responses: {200: {description: the forecast}}
"#;

/// A stack whose tool executor serves server-everything over stdio as `everything` and
/// the weather API as `weather`, with the API's calls counted.
struct Fixture {
    stack: Stack,
    api_calls: Arc<AtomicUsize>,
    _api: tokio_util::sync::DropGuard,
    _dir: TempDir,
}

async fn fixture(test: &str) -> Fixture {
    let api_calls = Arc::new(AtomicUsize::new(0));
    let counter = api_calls.clone();
    let (api, guard) = serve_http(axum::Router::new().route(
        "/forecast/{city}",
        axum::routing::get(
            move |axum::extract::Path(city): axum::extract::Path<String>, uri: axum::http::Uri| {
                let counter = counter.clone();
                async move {
                    counter.fetch_add(1, Ordering::SeqCst);
                    axum::Json(json!({"city": city, "query": uri.query(), "forecast": "sunny"}))
                }
            },
        ),
    ))
    .await;
    let dir = TempDir::new(test);
    dir.write(
        "weather.yaml",
        &WEATHER_API.replace("BASE_PORT", &api.port().to_string()),
    );
    let config = format!(
        "[[mcp_servers]]\nname = \"everything\"\ncommand = \"node\"\nargs = [{:?}, \"stdio\"]\n\n\
         [[openapi]]\nname = \"weather\"\nspec = \"weather.yaml\"\n",
        mcp_server("server-everything")
    );
    let path = dir.write("tool-executor.toml", &config);
    let stack = Stack::up_with(SCENARIOS, &["--config", path.to_str().unwrap()], &[]).await;
    Fixture {
        stack,
        api_calls,
        _api: guard,
        _dir: dir,
    }
}

/// The payloads of the TOOL_RESULT events by call id.
fn results(events: &[v1::AgentStreamEvent]) -> HashMap<String, Value> {
    events
        .iter()
        .filter(|e| kind(e) == v1::EventType::ToolResult)
        .map(|e| {
            let d = data(e);
            (d["id"].as_str().unwrap().to_owned(), d)
        })
        .collect()
}

/// The payloads of the REFERENCES events by call id, checked to come one per call, each
/// right after its call's TOOL_RESULT.
fn references(events: &[v1::AgentStreamEvent]) -> HashMap<String, Value> {
    let mut by_call = HashMap::new();
    for (i, event) in events.iter().enumerate() {
        if kind(event) != v1::EventType::References {
            continue;
        }
        let d = data(event);
        let id = d["tool_call_id"].as_str().unwrap().to_owned();
        let before = &events[i - 1];
        assert_eq!(
            kind(before),
            v1::EventType::ToolResult,
            "REFERENCES of {id} does not follow a TOOL_RESULT: {events:#?}"
        );
        assert_eq!(data(before)["id"], id.as_str(), "{events:#?}");
        assert_eq!(event.iteration, before.iteration);
        assert!(
            by_call.insert(id.clone(), d).is_none(),
            "two REFERENCES events for {id}"
        );
    }
    by_call
}

/// The URLs of a REFERENCES payload, in order.
fn urls(payload: &Value) -> Vec<&str> {
    payload["references"]
        .as_array()
        .unwrap()
        .iter()
        .map(|r| r["url"].as_str().unwrap())
        .collect()
}

/// What server-everything's `get-resource-links` returns for `count`: (url, title,
/// snippet) in its order. Even ids are text resources, odd ones blobs; the description
/// (the snippet) calls each a plaintext resource, as all are `text/plain`.
fn resource_links(count: usize) -> Vec<(String, String, String)> {
    (1..=count)
        .map(|id| {
            let (kind, title) = if id % 2 == 0 {
                ("text", "Text")
            } else {
                ("blob", "Blob")
            };
            (
                format!("demo://resource/dynamic/{kind}/{id}"),
                format!("{title} Resource {id}"),
                format!("Resource {id}: plaintext resource"),
            )
        })
        .collect()
}

/// The simulator's reranking rule: the share of the query's distinct lowercase words
/// (runs of letters and digits) found among the document's.
fn relevance(query: &str, document: &str) -> f64 {
    fn words(text: &str) -> HashSet<String> {
        text.split(|c: char| !c.is_alphanumeric())
            .filter(|w| !w.is_empty())
            .map(str::to_lowercase)
            .collect()
    }
    let query = words(query);
    let document = words(document);
    query.iter().filter(|w| document.contains(*w)).count() as f64 / query.len() as f64
}

/// The references a reranker following the rule keeps: (url, score), best first (ties in
/// the tool's order), at least `min_score`, at most `top_n`.
fn expected_ranking(
    query: &str,
    links: &[(String, String, String)],
    top_n: usize,
    min_score: f64,
) -> Vec<(String, f64)> {
    let mut scored: Vec<(String, f64)> = links
        .iter()
        .map(|(url, _, snippet)| (url.clone(), relevance(query, snippet)))
        .collect();
    scored.sort_by(|a, b| b.1.total_cmp(&a.1));
    scored
        .into_iter()
        .filter(|(_, score)| *score >= min_score)
        .take(top_n)
        .collect()
}

/// The tool call `id` of the run's state.
fn call_record<'a>(state: &'a v1::AgentState, id: &str) -> &'a v1::ToolCallRecord {
    state
        .steps
        .iter()
        .flat_map(|s| &s.tool_calls)
        .find(|c| c.id == id)
        .unwrap_or_else(|| panic!("no call {id} in {state:#?}"))
}

/// GetRun keeps each call's references exactly as its REFERENCES event carried them.
fn assert_kept(state: &v1::AgentState, id: &str, payload: &Value) {
    let kept = &call_record(state, id).references;
    let sent = payload["references"].as_array().unwrap();
    assert_eq!(kept.len(), sent.len(), "{id}: {kept:?} vs {sent:?}");
    for (kept, sent) in kept.iter().zip(sent) {
        assert_eq!(kept.url, sent["url"].as_str().unwrap());
        assert_eq!(kept.title, sent["title"].as_str().unwrap());
        assert_eq!(kept.snippet, sent["snippet"].as_str().unwrap());
        assert_eq!(kept.source, sent["source"].as_str().unwrap());
        assert!((kept.score - sent["score"].as_f64().unwrap()).abs() < 1e-6);
    }
}

#[tokio::test]
async fn an_agent_calls_an_mcp_tool_and_an_openapi_tool_and_streams_their_references() {
    let mut f = fixture("agent-tools").await;
    let events = f.stack.run(agent("tools", TOOLS), "Use every tool.").await;
    assert_eq!(kind(events.last().unwrap()), v1::EventType::FinalAnswer);
    assert_eq!(done(&events)["stop_reason"], "final_answer");

    // Every call is streamed as it is made, and its result as it comes back.
    let calls: Vec<Value> = events
        .iter()
        .filter(|e| kind(e) == v1::EventType::ToolCall)
        .map(data)
        .collect();
    let called: Vec<&str> = calls.iter().map(|c| c["name"].as_str().unwrap()).collect();
    assert_eq!(called, TOOLS, "{calls:?}");
    assert_eq!(calls[3]["arguments"], json!({"city": "Paris", "days": 2}));
    let results = results(&events);
    assert_eq!(results.len(), 4, "{results:?}");
    for result in results.values() {
        assert_eq!(result["is_error"], false, "{result}");
    }
    assert_eq!(results["call_echo"]["output"], "Echo: hello from the agent");
    assert_eq!(results["call_echo"]["name"], "everything__echo");
    let forecast: Value =
        serde_json::from_str(results["call_api"]["output"].as_str().unwrap()).unwrap();
    assert_eq!(
        forecast,
        json!({"city": "Paris", "query": "days=2", "forecast": "sunny"})
    );
    assert_eq!(f.api_calls.load(Ordering::SeqCst), 1);
    assert!(
        results["call_links"]["output"]
            .as_str()
            .unwrap()
            .contains("[resource link: Text Resource 2 <demo://resource/dynamic/text/2>]"),
        "{}",
        results["call_links"]
    );

    // One REFERENCES event per call that returned references, right after its result,
    // in the tool's order, unscored and without a rerank status (no rerank model).
    let references = references(&events);
    let mut with_references: Vec<&str> = references.keys().map(String::as_str).collect();
    with_references.sort_unstable();
    assert_eq!(with_references, ["call_embedded", "call_links"]);
    let links = &references["call_links"];
    assert!(links.get("rerank").is_none(), "{links}");
    let expected = resource_links(3);
    let sent = links["references"].as_array().unwrap();
    assert_eq!(sent.len(), 3, "{links}");
    for (reference, (url, title, snippet)) in sent.iter().zip(&expected) {
        assert_eq!(reference["url"], url.as_str());
        assert_eq!(reference["title"], title.as_str());
        assert_eq!(reference["snippet"], snippet.as_str());
        assert_eq!(reference["score"], 0.0);
        assert_eq!(reference["source"], "everything__get-resource-links");
    }
    let embedded = &references["call_embedded"];
    assert_eq!(urls(embedded), ["demo://resource/dynamic/text/2"]);
    let reference = &embedded["references"][0];
    assert!(
        reference["snippet"]
            .as_str()
            .unwrap()
            .starts_with("Resource 2: This is a plaintext resource"),
        "{embedded}"
    );
    assert_eq!(reference["source"], "everything__get-resource-reference");

    // The model read every result.
    let answer = text(&events, v1::EventType::FinalAnswer);
    assert!(answer.starts_with("Done: "), "{answer}");
    assert!(answer.contains("Echo: hello from the agent"), "{answer}");
    assert!(answer.contains("sunny"), "{answer}");

    // GetRun keeps the references on their calls.
    let state = f.stack.state(&events[0].run_id).await;
    assert_eq!(state.status, v1::RunStatus::Succeeded as i32);
    assert_kept(&state, "call_links", links);
    assert_kept(&state, "call_embedded", embedded);
    assert!(call_record(&state, "call_echo").references.is_empty());
    assert!(call_record(&state, "call_api").references.is_empty());
}

/// An agent of the `ranked` scenario reranking with the simulator's model `model`.
fn reranking(model: &str, top_n: i32, min_score: f32) -> v1::AgentConfig {
    v1::AgentConfig {
        rerank_model: Some(v1::RerankModelConfig {
            provider: "openai".into(),
            name: model.into(),
            top_n,
            min_score,
        }),
        ..agent("ranked", TOOLS)
    }
}

/// By the simulator's rule, resource 4 scores 3/5 (plaintext, resource, 4) and every
/// other 2/5.
const RANKED_QUERY: &str = "Which plaintext resource is 4?";

/// Checks a reranked run against the rule: both calls' references, best first, with the
/// reranker's scores, the `top_n` best of those scoring at least `min_score`; GetRun
/// keeps them. Returns the REFERENCES payloads by call.
async fn assert_reranked(stack: &mut Stack, top_n: i32, min_score: f32) -> HashMap<String, Value> {
    let events = stack
        .run(reranking("sim-rerank", top_n, min_score), RANKED_QUERY)
        .await;
    assert_eq!(done(&events)["stop_reason"], "final_answer", "{events:#?}");
    let references = references(&events);
    assert_eq!(references.len(), 2, "{references:?}");
    let state = stack.state(&events[0].run_id).await;
    assert_eq!(state.status, v1::RunStatus::Succeeded as i32);
    for (call, count) in [("call_six", 6), ("call_four", 4)] {
        let payload = &references[call];
        assert_eq!(
            payload["rerank"],
            json!({"status": "reranked"}),
            "{payload}"
        );
        let expected = expected_ranking(
            RANKED_QUERY,
            &resource_links(count),
            usize::try_from(top_n).unwrap(),
            // As the client wrote it.
            min_score.to_string().parse::<f64>().unwrap(),
        );
        let got: Vec<(String, f64)> = payload["references"]
            .as_array()
            .unwrap()
            .iter()
            .map(|r| {
                (
                    r["url"].as_str().unwrap().to_owned(),
                    r["score"].as_f64().unwrap(),
                )
            })
            .collect();
        assert_eq!(got.len(), expected.len(), "{call}: {got:?} vs {expected:?}");
        for ((url, score), (want_url, want_score)) in got.iter().zip(&expected) {
            assert_eq!(url, want_url, "{call}: {got:?} vs {expected:?}");
            assert!((score - want_score).abs() < 1e-6, "{call}: {got:?}");
        }
        assert_kept(&state, call, payload);
    }
    assert!(call_record(&state, "call_echo").references.is_empty());
    references
}

#[tokio::test]
async fn references_are_reranked_best_first_with_the_rerankers_scores() {
    let mut f = fixture("reranked").await;

    // top_n cuts: resource 4 comes first, then the first of the rest (ties keep the
    // tool's order).
    let references = assert_reranked(&mut f.stack, 2, 0.3).await;
    for call in ["call_six", "call_four"] {
        assert_eq!(
            urls(&references[call]),
            [
                "demo://resource/dynamic/text/4",
                "demo://resource/dynamic/blob/1"
            ]
        );
        let scores: Vec<f64> = references[call]["references"]
            .as_array()
            .unwrap()
            .iter()
            .map(|r| r["score"].as_f64().unwrap())
            .collect();
        assert!((scores[0] - 0.6).abs() < 1e-6, "{scores:?}");
        assert!((scores[1] - 0.4).abs() < 1e-6, "{scores:?}");
    }

    // A score of exactly min_score is kept: resource 1 scores 0.4 (it was cut, against the
    // float 0.4 widened to 0.4000000059604645).
    let references = assert_reranked(&mut f.stack, 5, 0.4).await;
    for call in ["call_six", "call_four"] {
        assert!(
            urls(&references[call]).contains(&"demo://resource/dynamic/blob/1"),
            "{:?}",
            urls(&references[call])
        );
    }

    // min_score cuts: only resource 4 scores 0.5 or more.
    let references = assert_reranked(&mut f.stack, 5, 0.5).await;
    for call in ["call_six", "call_four"] {
        assert_eq!(urls(&references[call]), ["demo://resource/dynamic/text/4"]);
    }
}

/// The references of a run whose rerank failed: each call's, in the tool's order,
/// unscored, with the failure said.
fn assert_rerank_failed(events: &[v1::AgentStreamEvent], error_has: &str) {
    assert_eq!(kind(events.last().unwrap()), v1::EventType::FinalAnswer);
    assert_eq!(done(events)["stop_reason"], "final_answer");
    assert_eq!(text(events, v1::EventType::FinalAnswer), "Ranked.");
    let references = references(events);
    assert_eq!(references.len(), 2, "{references:?}");
    for (call, count) in [("call_six", 6), ("call_four", 4)] {
        let payload = &references[call];
        assert_eq!(payload["rerank"]["status"], "failed", "{payload}");
        let error = payload["rerank"]["error"].as_str().unwrap();
        assert!(error.contains(error_has), "{error}");
        let expected: Vec<String> = resource_links(count).into_iter().map(|l| l.0).collect();
        assert_eq!(urls(payload), expected);
        for reference in payload["references"].as_array().unwrap() {
            assert_eq!(reference["score"], 0.0, "{payload}");
        }
    }
}

#[tokio::test]
async fn a_failing_reranker_leaves_the_tools_order_and_the_run_succeeds() {
    let mut f = fixture("rerank-fails").await;
    let events = f.stack.run(reranking("fail", 2, 0.2), RANKED_QUERY).await;
    assert_rerank_failed(&events, "500");
    let state = f.stack.state(&events[0].run_id).await;
    assert_eq!(state.status, v1::RunStatus::Succeeded as i32);
    assert_eq!(call_record(&state, "call_six").references.len(), 6);
}

#[tokio::test]
async fn a_slow_reranker_is_bounded_by_the_tool_call_timeout() {
    let mut f = fixture("rerank-slow").await;
    let config = v1::AgentConfig {
        timeouts: Some(v1::Timeouts {
            tool_call: Some(prost_types::Duration {
                seconds: 2,
                nanos: 0,
            }),
            ..Default::default()
        }),
        ..reranking("slow", 2, 0.2)
    };
    let engine_id = f.stack.engine_for(config).await;
    let started = Instant::now();
    let events = collect(f.stack.start(&engine_id, RANKED_QUERY).await).await;
    let took = started.elapsed();
    // Bounded by the agent's 2 s, not by the rerank client's own 10 s
    // (`agentrt_models::RERANK_TIMEOUT`), nor the 30 s the slow model takes.
    assert_rerank_failed(&events, "did not answer within 2s");
    assert!(
        took < Duration::from_secs(10),
        "the slow reranker held the run for {took:?}: {events:#?}"
    );
    assert!(took >= Duration::from_secs(2), "{took:?}");
    let state = f.stack.state(&events[0].run_id).await;
    assert_eq!(state.status, v1::RunStatus::Succeeded as i32);
}

/// Calls `tool` on the tool executor at `url` until it answers `code`.
async fn until_executor_says(url: &str, tool: &str, code: Code) {
    let mut client = ToolExecutorClient::new(connect(url).await);
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        let outcome = client
            .execute_tool(v1::ExecuteToolRequest {
                call_id: "probe".into(),
                tool_name: tool.into(),
                arguments: json_to_struct(&json!({"message": "probe"})),
                ..Default::default()
            })
            .await;
        match outcome {
            Err(status) if status.code() == code => return,
            other => assert!(
                Instant::now() < deadline,
                "{tool} never answered {code:?}: {other:?}"
            ),
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// Runs the `gone` scenario on `engine_id` and checks that the call failed as a result
/// the model read, with `says` in it, and the run succeeded.
async fn run_reads_the_error(stack: &mut Stack, engine_id: &str, says: &str) {
    let events = collect(stack.start(engine_id, "Echo something.").await).await;
    assert_eq!(
        kind(events.last().unwrap()),
        v1::EventType::FinalAnswer,
        "{events:#?}"
    );
    assert_eq!(done(&events)["stop_reason"], "final_answer");
    let results = results(&events);
    let result = &results["call_gone"];
    assert_eq!(result["is_error"], true, "{result}");
    let output = result["output"].as_str().unwrap();
    assert!(output.contains(says), "{output}");
    let answer = text(&events, v1::EventType::FinalAnswer);
    assert_eq!(answer, format!("The tool said: {output}"));
    let state = stack.state(&events[0].run_id).await;
    assert_eq!(state.status, v1::RunStatus::Succeeded as i32);
    assert!(call_record(&state, "call_gone").is_error);
}

#[tokio::test]
async fn a_tool_gone_from_the_catalogue_is_an_error_the_model_reads() {
    // server-everything, started once: after it is killed, its restarts fail at once, so
    // that its tools stay listed but UNAVAILABLE.
    let dir = TempDir::new("agent-tool-gone");
    let marker = dir.0.join("started");
    let pid_file = dir.0.join("pid");
    let script = format!(
        "if [ -e {marker} ]; then exit 1; fi; touch {marker}; echo $$ > {pid}; exec node {server} stdio",
        marker = marker.display(),
        pid = pid_file.display(),
        server = mcp_server("server-everything"),
    );
    let config = format!(
        "[[mcp_servers]]\nname = \"everything\"\ncommand = \"sh\"\nargs = [\"-c\", {script:?}]\n"
    );
    let path = dir.write("tool-executor.toml", &config);
    let mut stack = Stack::up_with(SCENARIOS, &["--config", path.to_str().unwrap()], &[]).await;
    // Two engines made while the tool is there, for two sessions of one turn each.
    let unavailable = stack.engine_for(agent("gone", &["everything__echo"])).await;
    let not_found = stack.engine_for(agent("gone", &["everything__echo"])).await;

    // The MCP server dies: its tool is UNAVAILABLE, which the model reads.
    let pid = std::fs::read_to_string(&pid_file).unwrap();
    let killed = std::process::Command::new("kill")
        .args(["-9", pid.trim()])
        .status()
        .unwrap();
    assert!(killed.success());
    until_executor_says(&stack.tools.url(), "everything__echo", Code::Unavailable).await;
    run_reads_the_error(&mut stack, &unavailable, "\"everything\"").await;

    // The tool executor comes back on its address without the source: the tool is gone
    // (NOT_FOUND), which the model reads too.
    let addr = stack.tools.addr.to_string();
    stack.tools.terminate();
    assert!(stack.tools.wait(Duration::from_secs(20)).await.success());
    stack.tools = Server::start("tool-executor", &["--listen", &addr], &[]).await;
    until_executor_says(&stack.tools.url(), "everything__echo", Code::NotFound).await;
    run_reads_the_error(
        &mut stack,
        &not_found,
        "tool \"everything__echo\" does not exist on the tool executor",
    )
    .await;
}
