//! Requests built from arguments; the end-to-end tests (`tests/tool_sources.rs`) send them
//! to a real HTTP server.

// Tests fail by panicking, with the value that was wrong.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use serde_json::json;

use super::*;

const DOC: &str = r#"{"openapi": "3.1.0",
  "servers": [{"url": "http://api.example.test/v1/"}],
  "paths": {"/items/{id}": {"post": {"operationId": "put.item",
    "parameters": [
      {"name": "id", "in": "path", "required": true, "schema": {"type": "string"}},
      {"name": "tag", "in": "query", "schema": {"type": "array", "items": {"type": "string"}}},
      {"name": "body", "in": "query", "schema": {"type": "integer"}},
      {"name": "X-Mode", "in": "header", "schema": {"type": "string"}}],
    "requestBody": {"content": {"application/json": {"schema": {"type": "object"}}}}}}}}"#;

fn toolset(dir: &Path) -> OpenApiToolset {
    std::fs::create_dir_all(dir).unwrap();
    std::fs::write(dir.join("api.json"), DOC).unwrap();
    std::fs::write(dir.join("key"), "k3y\n").unwrap();
    let mut config: OpenApiConfig = serde_json::from_value(json!({
        "name": "api",
        "spec": "api.json",
        "query": {"api_key": {"file": "key"}},
        "headers": {"Authorization": {"file": "key", "prefix": "Bearer "}},
    }))
    .unwrap();
    config.resolve_paths(dir);
    OpenApiToolset::load(&config).unwrap()
}

#[tokio::test]
async fn arguments_fill_path_query_headers_and_body() {
    let dir = std::env::temp_dir().join(format!("agentrt-openapi-{}", std::process::id()));
    let toolset = toolset(&dir);
    let listed = toolset.list().await.unwrap();
    assert_eq!(listed[0].spec.name, "api__put_item");
    assert_eq!(listed[0].source_name, "put.item");
    let schema = &listed[0].spec.input_schema;
    assert!(schema["properties"]["query_body"].is_object(), "{schema}");
    assert!(schema["properties"]["body"].is_object(), "{schema}");

    let op = &toolset.operations["put.item"];
    let request = toolset
        .request(
            op,
            &json!({"id": "a/b c?", "tag": ["x", "y z"], "query_body": 3, "X-Mode": "fast",
                    "body": {"n": 1}}),
        )
        .unwrap();
    assert_eq!(
        request.url.as_str(),
        "http://api.example.test/v1/items/a%2Fb%20c%3F?tag=x&tag=y+z&body=3&api_key=k3y"
    );
    assert_eq!(request.method, reqwest::Method::POST);
    assert_eq!(request.headers["x-mode"], "fast");
    assert_eq!(request.headers["authorization"], "Bearer k3y");
    assert!(request.headers["authorization"].is_sensitive());
    assert_eq!(request.headers["content-type"], "application/json");
    assert_eq!(request.body.as_deref().unwrap(), br#"{"n":1}"#);

    for dots in ["..", "."] {
        let err = toolset.request(op, &json!({"id": dots})).unwrap_err();
        assert!(err.contains("cannot be"), "{err}");
    }
    std::fs::remove_dir_all(dir).unwrap();
}

#[test]
fn a_missing_secret_or_server_is_a_start_up_error() {
    let dir = std::env::temp_dir().join(format!("agentrt-openapi-err-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    std::fs::write(dir.join("api.json"), r#"{"openapi": "3.0.0", "paths": {}}"#).unwrap();
    let config = |extra: serde_json::Value| {
        let mut value = json!({"name": "api", "spec": dir.join("api.json")});
        value
            .as_object_mut()
            .unwrap()
            .extend(extra.as_object().unwrap().clone());
        serde_json::from_value::<OpenApiConfig>(value).unwrap()
    };
    let err = OpenApiToolset::load(&config(json!({}))).err().unwrap();
    assert!(err.to_string().contains("base_url"), "{err}");
    let err = OpenApiToolset::load(&config(json!({
        "base_url": "http://127.0.0.1:1",
        "headers": {"X-Key": {"env": "AGENTRT_TEST_SURELY_UNSET"}},
    })))
    .err()
    .unwrap();
    assert!(
        err.to_string().contains("AGENTRT_TEST_SURELY_UNSET"),
        "{err}"
    );
    std::fs::remove_dir_all(dir).unwrap();
}
