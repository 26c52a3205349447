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
    toolset_of(dir, DOC)
}

/// The source `api` of document `doc`, with a query parameter and a header it sets itself.
fn toolset_of(dir: &Path, doc: &str) -> OpenApiToolset {
    std::fs::create_dir_all(dir).unwrap();
    std::fs::write(dir.join("api.json"), doc).unwrap();
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

    let op = &toolset.routes["put.item"];
    let request = toolset
        .request(
            op,
            &json!({"id": "a/b c?", "tag": ["x", "y z"], "query_body": 3, "X-Mode": "fast",
                    "body": {"n": 1}}),
            "call_1",
        )
        .unwrap();
    assert_eq!(
        toolset.url(&request.target).as_str(),
        "http://api.example.test/v1/items/a%2Fb%20c%3F?tag=x&tag=y+z&body=3&api_key=k3y"
    );
    assert_eq!(request.method, reqwest::Method::POST);
    assert_eq!(request.headers["x-mode"], "fast");
    assert_eq!(request.headers["authorization"], "Bearer k3y");
    assert!(request.headers["authorization"].is_sensitive());
    assert_eq!(request.headers["content-type"], "application/json");
    assert_eq!(request.body.as_deref().unwrap(), br#"{"n":1}"#);
    let Transport::Plain(pool) = &toolset.transport else {
        panic!("an http:// base URL is served by the plain pool");
    };
    assert_eq!(
        String::from_utf8(pool.encode(&request)).unwrap(),
        format!(
            "POST /v1/items/a%2Fb%20c%3F?tag=x&tag=y+z&body=3&api_key=k3y HTTP/1.1\r\n\
             host: api.example.test\r\n\
             x-mode: fast\r\n\
             authorization: Bearer k3y\r\n\
             idempotency-key: call_1\r\n\
             content-type: application/json\r\n\
             accept: */*\r\n\
             user-agent: {}\r\n\
             content-length: 7\r\n\
             \r\n\
             {{\"n\":1}}",
            crate::http::USER_AGENT
        )
    );

    // A call id that cannot be a header value as it is goes escaped, not left out.
    let request = toolset
        .request(op, &json!({"id": "a"}), "call\n%2")
        .unwrap();
    assert_eq!(request.headers["idempotency-key"], "call%0A%252");

    for dots in ["..", "."] {
        let err = toolset.request(op, &json!({"id": dots}), "c").unwrap_err();
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

/// The request target and URL as the `url` crate made them before paths were
/// precomputed (`Url::set_path` on the filled template, `query_pairs_mut`): what
/// [`OpenApiToolset::target`] must still give.
fn reference(
    base: &reqwest::Url,
    op: &Operation,
    arguments: &Value,
    fixed: &[(&str, &str)],
) -> std::result::Result<(String, String), String> {
    let mut path = op.path.clone();
    let mut query: Vec<(String, String)> = Vec::new();
    for param in &op.parameters {
        let Some(value) = arguments.get(&param.key).filter(|v| !v.is_null()) else {
            continue;
        };
        match param.location {
            Location::Path => {
                let text = scalar_text(value);
                if text.is_empty() || text == "." || text == ".." {
                    return Err(format!(
                        "path parameter {:?} cannot be {text:?}",
                        param.name
                    ));
                }
                // The `simple` style: each item escaped, joined by a literal `,`.
                let escaped = match value {
                    Value::Array(items) => items
                        .iter()
                        .map(|item| utf8_percent_encode(&scalar_text(item), SEGMENT).to_string())
                        .collect::<Vec<_>>()
                        .join(","),
                    _ => utf8_percent_encode(&text, SEGMENT).to_string(),
                };
                path = path.replace(&format!("{{{}}}", param.name), &escaped);
            }
            Location::Query => match value {
                Value::Array(items) if param.explode => {
                    for item in items {
                        query.push((param.name.clone(), scalar_text(item).into_owned()));
                    }
                }
                _ => query.push((param.name.clone(), scalar_text(value).into_owned())),
            },
            Location::Header => {}
        }
    }
    // Once the values are checked, a path parameter with none (or null) cannot fill it.
    if let Some(param) = op
        .parameters
        .iter()
        .find(|p| p.location == Location::Path && arguments.get(&p.key).is_none_or(Value::is_null))
    {
        return Err(format!(
            "path parameter {:?} is required (not null)",
            param.name
        ));
    }
    let mut url = base.clone();
    url.set_path(&format!("{}{path}", base.path().trim_end_matches('/')));
    for (name, value) in fixed {
        query.push(((*name).to_owned(), (*value).to_owned()));
    }
    if !query.is_empty() {
        url.query_pairs_mut().extend_pairs(&query);
    }
    let mut target = url.path().to_owned();
    if let Some(query) = url.query() {
        target.push('?');
        target.push_str(query);
    }
    Ok((target, url.to_string()))
}

#[test]
fn precomputed_paths_and_queries_match_the_url_crate() {
    let dir = std::env::temp_dir().join(format!("agentrt-openapi-paths-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    std::fs::write(dir.join("key"), "k 3&y=ü\n").unwrap();
    let templates = [
        "/items/{id}",
        "/a/{id}/b/{id}",
        "/files/{id}.json",
        "/{id}/",
        "/{id}{other}",
        "/sp ace/{id}",
        "/a/./b/../{id}",
        "/a/{id}/..",
        "/back\\slash/{id}",
        "/%2e%2E/{id}/%2E",
        "/q?x#y/{id}",
        "no-slash/{id}",
        "/ü/{id}",
        "/a//b/{id}/{missing}",
        "/{id}/{other}/{idx}",
    ];
    let mut paths = serde_json::Map::new();
    for (i, template) in templates.iter().enumerate() {
        let mut parameters = vec![
            json!({"name": "q", "in": "query", "schema": {}}),
            json!({"name": "list", "in": "query", "explode": false, "schema": {}}),
        ];
        for name in ["id", "other", "missing", "idx"] {
            if template.contains(&format!("{{{name}}}")) {
                parameters
                    .push(json!({"name": name, "in": "path", "required": true, "schema": {}}));
            }
        }
        paths.insert(
            (*template).to_owned(),
            json!({"get": {"operationId": format!("op{i}"), "parameters": parameters}}),
        );
    }
    let doc = json!({"openapi": "3.1.0", "paths": paths});
    std::fs::write(dir.join("api.json"), doc.to_string()).unwrap();
    let values = [
        json!("a/b c?"),
        json!("ü"),
        json!("..."),
        json!("%2e"),
        json!("2e"),
        json!("x#y{id}"),
        json!("a\\b"),
        json!(3),
        json!(true),
        json!(["a b", "c"]),
        json!("."),
        Value::Null,
    ];
    let queries = [
        json!({}),
        json!({"q": "a b&c=d+ü"}),
        json!({"q": ["x", "y z"], "list": ["1", "2"]}),
        json!({"q": 1.5, "list": "a,b"}),
    ];
    let bases = [
        "http://h.test/v1/",
        "http://h.test/v1",
        "http://h.test",
        "http://h.test/v1?k=1",
        "http://h.test/v1/?",
        "http://h.test:8080/base%20x/#frag",
        "https://h.test/api/",
    ];
    for base in bases {
        for with_key in [false, true] {
            let mut config = json!({"name": "api", "spec": dir.join("api.json"), "base_url": base});
            if with_key {
                config["query"] = json!({"api key": {"file": dir.join("key")}});
            }
            let toolset =
                OpenApiToolset::load(&serde_json::from_value::<OpenApiConfig>(config).unwrap())
                    .unwrap();
            let fixed: &[(&str, &str)] = if with_key {
                &[("api key", "k 3&y=ü")]
            } else {
                &[]
            };
            for route in toolset.routes.values() {
                for value in &values {
                    for query in &queries {
                        let mut arguments = query.clone();
                        arguments["id"] = value.clone();
                        arguments["other"] = json!("o");
                        arguments["idx"] = json!(".");
                        let expected = reference(&toolset.base, &route.op, &arguments, fixed);
                        let got = toolset.request(route, &arguments, "").map(|request| {
                            let url = toolset.url(&request.target).to_string();
                            (request.target, url)
                        });
                        assert_eq!(
                            got, expected,
                            "base {base}, path {}, arguments {arguments}",
                            route.op.path
                        );
                    }
                }
            }
        }
    }
    std::fs::remove_dir_all(dir).unwrap();
}

#[test]
fn the_fast_path_check_only_passes_what_url_keeps() {
    let base = reqwest::Url::parse("http://h.test/").unwrap();
    let samples = [
        "/",
        "/a",
        "/a/b/",
        "//a",
        "/a%2Fb",
        "/a%zz",
        "/%2e",
        "/%2E%2e/x",
        "/.a",
        "/a..",
        "/a/.",
        "/a/..",
        "/a/.%2e",
        "/a/...",
        "/a b",
        "/a\\b",
        "/a?b",
        "/a#b",
        "/a{b}",
        "/ü",
        "/a\tb",
        "a",
        "",
        "/!$&'()*+,;=:@[]^|~-_",
    ];
    for path in samples {
        let mut url = base.clone();
        url.set_path(path);
        if is_normalized_path(path) {
            assert_eq!(url.path(), path, "{path:?} was taken as already normalized");
        }
    }
    assert!(is_normalized_path("/items/a%2Fb%20c%3F"));
    assert!(!is_normalized_path("/a/%2e%2E"));
}

#[tokio::test]
async fn parameters_the_source_sets_are_neither_offered_nor_taken_from_the_model() {
    let dir = std::env::temp_dir().join(format!("agentrt-openapi-set-{}", std::process::id()));
    let toolset = toolset_of(
        &dir,
        r#"{"openapi": "3.1.0", "servers": [{"url": "http://api.example.test"}],
          "paths": {"/things/{id}": {"get": {"operationId": "getThing", "parameters": [
            {"name": "id", "in": "path", "required": true, "schema": {"type": "string"}},
            {"name": "verbose", "in": "query", "schema": {"type": "boolean"}},
            {"name": "api_key", "in": "query", "required": true, "schema": {"type": "string"}},
            {"name": "authorization", "in": "header", "schema": {"type": "string"}},
            {"name": "X-Other", "in": "header", "schema": {"type": "string"}}]}}}}"#,
    );
    let _ = std::fs::remove_dir_all(&dir);

    let listed = toolset.list().await.unwrap();
    let schema = &listed[0].spec.input_schema;
    let properties: Vec<_> = schema["properties"]
        .as_object()
        .unwrap()
        .keys()
        .cloned()
        .collect();
    assert_eq!(properties, ["X-Other", "id", "verbose"], "{schema}");
    assert_eq!(schema["required"], json!(["id"]), "{schema}");

    // Even given (the catalogue's schema check would refuse it first), the model's value
    // never goes out: the source's does, once.
    let request = toolset
        .request(
            &toolset.routes["getThing"],
            &json!({"id": "abc", "verbose": true, "api_key": "MODEL-SUPPLIED",
                    "authorization": "Bearer model", "X-Other": "o"}),
            "",
        )
        .unwrap();
    assert_eq!(request.target, "/things/abc?verbose=true&api_key=k3y");
    assert_eq!(request.headers["authorization"], "Bearer k3y");
    assert_eq!(request.headers.get_all("authorization").iter().count(), 1);
    assert_eq!(request.headers["x-other"], "o");
}

#[tokio::test]
async fn an_operation_whose_parameters_the_source_sets_are_optional_stays_listed() {
    // Optional parameters the source sets (an API key declared optional, as specs often
    // do), and no required one left: the schema has no `required` (it got
    // `"required": null`, which is not a schema, and the operation was left out).
    let dir = std::env::temp_dir().join(format!("agentrt-openapi-opt-{}", std::process::id()));
    let toolset = toolset_of(
        &dir,
        r#"{"openapi": "3.1.0", "servers": [{"url": "http://api.example.test"}],
          "paths": {"/a": {"get": {"operationId": "optional", "parameters": [
            {"name": "api_key", "in": "query", "schema": {"type": "string"}},
            {"name": "q", "in": "query", "schema": {"type": "string"}}]}},
                    "/b": {"get": {"operationId": "headerOnly", "parameters": [
            {"name": "authorization", "in": "header", "schema": {"type": "string"}}]}}}}"#,
    );
    let _ = std::fs::remove_dir_all(&dir);
    let listed = toolset.list().await.unwrap();
    assert_eq!(listed.len(), 2, "{listed:?}");
    for tool in &listed {
        let schema = &tool.spec.input_schema;
        assert!(schema.get("required").is_none(), "{schema}");
        assert!(
            jsonschema::validator_for(schema).is_ok(),
            "{}: {schema}",
            tool.spec.name
        );
    }
}

#[test]
fn a_bad_base_url_is_named_as_the_setting_or_the_documents_server() {
    let dir = std::env::temp_dir().join(format!("agentrt-openapi-base-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    std::fs::write(
        dir.join("api.json"),
        r#"{"openapi": "3.0.0", "servers": [{"url": "/v1"}], "paths": {}}"#,
    )
    .unwrap();
    let config = |base_url: Option<&str>| {
        let mut value = json!({"name": "api", "spec": dir.join("api.json")});
        if let Some(base_url) = base_url {
            value["base_url"] = json!(base_url);
        }
        serde_json::from_value::<OpenApiConfig>(value).unwrap()
    };
    for bad in ["not a url", "ftp://example.test", "http://"] {
        let err = config(Some(bad)).check().unwrap_err();
        assert!(err.starts_with(&format!("`base_url` {bad:?}: ")), "{err}");
        let err = OpenApiToolset::load(&config(Some(bad))).err().unwrap();
        assert!(err.to_string().contains("`base_url`"), "{err}");
    }
    // The document's own server is relative: that is what the message names.
    let err = OpenApiToolset::load(&config(None))
        .err()
        .unwrap()
        .to_string();
    assert!(
        err.contains("the document's first server URL \"/v1\"") && err.contains("set `base_url`"),
        "{err}"
    );
    std::fs::remove_dir_all(dir).unwrap();
}

#[test]
fn a_body_goes_out_with_the_json_media_type_the_document_declares() {
    let dir = std::env::temp_dir().join(format!("agentrt-openapi-media-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    std::fs::write(
        dir.join("api.json"),
        r#"{"openapi": "3.1.0", "servers": [{"url": "http://api.example.test"}],
          "paths": {"/things/{id}": {"patch": {"operationId": "patchThing",
            "parameters": [{"name": "id", "in": "path", "required": true}],
            "requestBody": {"content": {"application/merge-patch+json": {}}}}}}}"#,
    )
    .unwrap();
    let config: OpenApiConfig =
        serde_json::from_value(json!({"name": "api", "spec": dir.join("api.json")})).unwrap();
    let toolset = OpenApiToolset::load(&config).unwrap();
    let _ = std::fs::remove_dir_all(&dir);
    let request = toolset
        .request(
            &toolset.routes["patchThing"],
            &json!({"id": "a", "body": {"name": null}}),
            "call_1",
        )
        .unwrap();
    assert_eq!(
        request.headers["content-type"],
        "application/merge-patch+json"
    );
    assert_eq!(request.body.as_deref().unwrap(), br#"{"name":null}"#);

    // As Kubernetes declares its bodies: a range for create and replace (sent as JSON),
    // and five patch types, of which a merge patch takes the object the model writes.
    std::fs::create_dir_all(&dir).unwrap();
    std::fs::write(
        dir.join("api.json"),
        r#"{"openapi": "3.0.0", "servers": [{"url": "http://api.example.test"}],
          "paths": {"/things/{id}": {
            "put": {"operationId": "replaceThing",
              "parameters": [{"name": "id", "in": "path", "required": true}],
              "requestBody": {"required": true, "content": {"*/*": {"schema": {"type": "object"}}}}},
            "patch": {"operationId": "patchThing",
              "parameters": [{"name": "id", "in": "path", "required": true}],
              "requestBody": {"required": true, "content": {
                "application/apply-patch+cbor": {"schema": {"type": "object"}},
                "application/apply-patch+yaml": {"schema": {"type": "object"}},
                "application/json-patch+json": {"schema": {"type": "object"}},
                "application/merge-patch+json": {"schema": {"type": "object"}},
                "application/strategic-merge-patch+json": {"schema": {"type": "object"}}}}}}}}"#,
    )
    .unwrap();
    let toolset = OpenApiToolset::load(&config).unwrap();
    let _ = std::fs::remove_dir_all(&dir);
    for (operation, sent) in [
        ("replaceThing", "application/json"),
        ("patchThing", "application/merge-patch+json"),
    ] {
        let request = toolset
            .request(
                &toolset.routes[operation],
                &json!({"id": "a", "body": {"name": "b"}}),
                "call_1",
            )
            .unwrap();
        assert_eq!(request.headers["content-type"], sent, "{operation}");
    }
}

/// Parameter names model APIs refuse as property names (`$top`, `filter[status]`,
/// `statuses[]`) are offered under names they take; the request still sends the names
/// the API reads.
#[test]
fn parameters_are_offered_under_names_model_apis_take() {
    let dir = std::env::temp_dir().join(format!("agentrt-openapi-keys-{}", std::process::id()));
    let doc = r#"{"openapi": "3.1.0",
      "servers": [{"url": "http://api.example.test"}],
      "paths": {"/items/{id}": {"get": {"operationId": "items",
        "parameters": [
          {"name": "id", "in": "path", "required": true, "schema": {"type": "string"}},
          {"name": "id", "in": "query", "schema": {"type": "string"}},
          {"name": "$top", "in": "query", "schema": {"type": "integer"}},
          {"name": "filter[status]", "in": "query", "schema": {"type": "string"}},
          {"name": "filter_status", "in": "query", "schema": {"type": "string"}},
          {"name": "statuses[]", "in": "query", "schema": {"type": "string"}}]}}}}"#;
    let toolset = toolset_of(&dir, doc);
    let route = &toolset.routes["items"];
    let keys: Vec<&str> = route.op.parameters.iter().map(|p| p.key.as_str()).collect();
    assert_eq!(
        keys,
        [
            "id",
            "query_id",
            "top",
            "filter_status",
            "query_filter_status",
            "statuses"
        ]
    );
    let sent = toolset
        .request(
            route,
            &json!({"id": "a", "query_id": "b", "top": 5, "filter_status": "open",
                    "query_filter_status": "x", "statuses": "s"}),
            "c",
        )
        .unwrap();
    assert_eq!(
        sent.target,
        "/items/a?id=b&%24top=5&filter%5Bstatus%5D=open&filter_status=x&statuses%5B%5D=s&api_key=k3y"
    );
    std::fs::remove_dir_all(dir).unwrap();
}

/// An operation that requires a cookie is callable when the source sends a `Cookie`
/// header of its own, and left out otherwise: cookies are not arguments.
#[test]
fn a_required_cookie_is_sent_by_the_source_or_its_operation_left_out() {
    let dir = std::env::temp_dir().join(format!("agentrt-openapi-cookie-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    std::fs::write(
        dir.join("api.json"),
        r#"{"openapi": "3.1.0", "servers": [{"url": "http://api.example.test"}],
          "paths": {"/me": {"get": {"operationId": "me", "parameters": [
            {"name": "session", "in": "cookie", "required": true, "schema": {"type": "string"}}]}},
            "/open": {"get": {"operationId": "open"}}}}"#,
    )
    .unwrap();
    std::fs::write(dir.join("cookie"), "s3cr3t\n").unwrap();
    let load = |headers: Value| {
        let config: OpenApiConfig = serde_json::from_value(json!({
            "name": "api", "spec": dir.join("api.json"), "headers": headers,
        }))
        .unwrap();
        OpenApiToolset::load(&config).unwrap()
    };
    let without = load(json!({}));
    assert_eq!(without.routes.keys().collect::<Vec<_>>(), ["open"]);
    let with = load(json!({"Cookie": {"file": dir.join("cookie"), "prefix": "session="}}));
    assert_eq!(with.routes.keys().collect::<Vec<_>>(), ["me", "open"]);
    let sent = with.request(&with.routes["me"], &json!({}), "c").unwrap();
    assert_eq!(sent.headers["cookie"], "session=s3cr3t");
    std::fs::remove_dir_all(dir).unwrap();
}

/// A `$ref` written as a URI fragment, percent-encoded (as bundlers write refs into
/// paths and names with spaces), points where it says.
#[tokio::test]
async fn percent_encoded_refs_are_followed() {
    let dir = std::env::temp_dir().join(format!("agentrt-openapi-refs-{}", std::process::id()));
    let doc = r##"{"openapi": "3.1.0",
      "servers": [{"url": "http://api.example.test"}],
      "components": {"schemas": {"My Type": {"type": "object",
        "properties": {"size": {"type": "integer"}}}}},
      "paths": {
        "/pets/{id}": {"post": {"operationId": "first",
          "parameters": [{"name": "id", "in": "path", "required": true, "schema": {"type": "string"}}],
          "requestBody": {"content": {"application/json": {"schema": {"$ref": "#/components/schemas/My%20Type"}}}}}},
        "/other": {"post": {"operationId": "second",
          "requestBody": {"content": {"application/json": {"schema": {
            "$ref": "#/paths/~1pets~1%7Bid%7D/post/requestBody/content/application~1json/schema"}}}}}}
      }}"##;
    let toolset = toolset_of(&dir, doc);
    let listed = toolset.list().await.unwrap();
    let names: Vec<&str> = listed.iter().map(|t| t.spec.name.as_str()).collect();
    assert_eq!(names, ["api__first", "api__second"]);
    for tool in &listed {
        let body = &tool.spec.input_schema["properties"]["body"];
        assert_eq!(body["properties"]["size"]["type"], "integer", "{body}");
    }
    std::fs::remove_dir_all(dir).unwrap();
}

/// A key in the base URL's query (`?key=...`, as some APIs take theirs) stays out of the
/// logs: the URL is logged with its query values masked.
#[test]
fn a_key_in_the_base_url_is_not_logged() {
    #[derive(Clone, Default)]
    struct Captured(std::sync::Arc<std::sync::Mutex<Vec<u8>>>);
    impl std::io::Write for Captured {
        fn write(&mut self, bytes: &[u8]) -> std::io::Result<usize> {
            self.0.lock().unwrap().extend_from_slice(bytes);
            Ok(bytes.len())
        }
        fn flush(&mut self) -> std::io::Result<()> {
            Ok(())
        }
    }
    let dir = std::env::temp_dir().join(format!("agentrt-openapi-key-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    std::fs::write(
        dir.join("api.json"),
        r#"{"openapi": "3.1.0", "paths": {"/x": {"get": {"operationId": "x"}}}}"#,
    )
    .unwrap();
    let config: OpenApiConfig = serde_json::from_value(json!({
        "name": "maps",
        "spec": dir.join("api.json"),
        "base_url": "https://maps.example.test/api?key=SECRET-123",
    }))
    .unwrap();
    let captured = Captured::default();
    let writer = captured.clone();
    // The process's subscriber, not this thread's: a callsite another test's thread met
    // first, with no subscriber, may keep its interest of then for a scoped one. Only
    // this module's logs, which the other tests here do not look at.
    let subscriber = tracing_subscriber::fmt()
        .with_writer(move || writer.clone())
        .with_env_filter("agentrt_tools::openapi=info")
        .finish();
    tracing::subscriber::set_global_default(subscriber).unwrap();
    OpenApiToolset::load(&config).unwrap();
    let logged = String::from_utf8(captured.0.lock().unwrap().clone()).unwrap();
    assert!(logged.contains("OpenAPI document loaded"), "{logged}");
    assert!(logged.contains("key=***"), "{logged}");
    assert!(!logged.contains("SECRET-123"), "{logged}");
    std::fs::remove_dir_all(dir).unwrap();
}

/// A path value never leaves its segment, whatever its style writes (a `label` array of
/// empty strings is `..`), and a path parameter given null is refused, not sent as its
/// placeholder.
#[test]
fn path_values_stay_in_their_segment() {
    let dir = std::env::temp_dir().join(format!("agentrt-openapi-dots-{}", std::process::id()));
    let doc = r#"{"openapi": "3.1.0",
      "servers": [{"url": "http://api.example.test/v1"}],
      "paths": {
        "/{p}/admin": {"get": {"operationId": "dots",
          "parameters": [
            {"name": "p", "in": "path", "required": true, "style": "label", "explode": true,
             "schema": {"type": ["array", "object", "null"]}}]}},
        "/users/{id}/keys": {"get": {"operationId": "keys",
          "parameters": [{"name": "id", "in": "path", "required": true, "schema": {}}]}}}}"#;
    let toolset = toolset_of(&dir, doc);
    let route = &toolset.routes["dots"];
    for (p, error) in [
        (json!(["", ""]), "cannot make a \"..\" segment"),
        (json!({}), "cannot make a \".\" segment"),
        (json!(null), "path parameter \"p\" is required"),
    ] {
        let refused = toolset.request(route, &json!({ "p": p }), "c").err();
        assert!(
            refused.as_deref().is_some_and(|e| e.contains(error)),
            "{p}: {refused:?}"
        );
    }
    let sent = toolset
        .request(route, &json!({"p": ["a", "b"]}), "c")
        .unwrap();
    assert_eq!(sent.target.split('?').next(), Some("/v1/.a.b/admin"));
    // A value that writes nothing (an empty object or array) leaves no empty segment.
    let route = &toolset.routes["keys"];
    for (id, error) in [
        (json!({}), "cannot make a \"\" segment"),
        (json!([]), "cannot be \"\""),
    ] {
        let refused = toolset.request(route, &json!({ "id": id }), "c").err();
        assert!(
            refused.as_deref().is_some_and(|e| e.contains(error)),
            "{id}: {refused:?}"
        );
    }
    std::fs::remove_dir_all(dir).unwrap();
}

#[tokio::test]
async fn parameters_are_written_in_their_style() {
    let dir = std::env::temp_dir().join(format!("agentrt-openapi-style-{}", std::process::id()));
    let doc = r#"{"openapi": "3.1.0",
      "servers": [{"url": "http://api.example.test"}],
      "paths": {
        "/l/{label}/m/{matrix}/{exploded}/s/{simple}": {"get": {"operationId": "styles",
          "parameters": [
            {"name": "label", "in": "path", "required": true, "style": "label", "explode": true,
             "schema": {"type": "array"}},
            {"name": "matrix", "in": "path", "required": true, "style": "matrix",
             "schema": {"type": "array"}},
            {"name": "exploded", "in": "path", "required": true, "style": "matrix", "explode": true,
             "schema": {"type": "object"}},
            {"name": "simple", "in": "path", "required": true, "explode": true,
             "schema": {"type": "object"}},
            {"name": "filter", "in": "query", "style": "deepObject", "schema": {"type": "object"}},
            {"name": "point", "in": "query", "schema": {"type": "object"}},
            {"name": "flat", "in": "query", "explode": false, "schema": {"type": "object"}},
            {"name": "ids", "in": "query", "style": "pipeDelimited", "explode": false,
             "schema": {"type": "array"}},
            {"name": "words", "in": "query", "style": "spaceDelimited", "explode": false,
             "schema": {"type": "array"}},
            {"name": "X-Pair", "in": "header", "schema": {"type": "object"}},
            {"name": "Accept", "in": "header", "schema": {"type": "string"}},
            {"name": "Content-Type", "in": "header", "schema": {"type": "string"}},
            {"name": "Authorization", "in": "header", "schema": {"type": "string"}},
            {"name": "Idempotency-Key", "in": "header", "schema": {"type": "string"}}]}},
        "/undeclared/{id}": {"get": {"operationId": "undeclared"}},
        "/things": {"post": {"operationId": "create",
          "requestBody": {"required": true, "content": {"application/json": {"schema": {
            "type": "object", "required": ["id", "name"],
            "properties": {"id": {"type": "integer", "readOnly": true}, "name": {"type": "string"},
              "parts": {"type": "array", "items": {"type": "object", "required": ["made"],
                "properties": {"made": {"type": "string", "readOnly": true}}}},
              "labels": {"type": "object", "additionalProperties": {"type": "object",
                "properties": {"by": {"type": "string"},
                  "at": {"type": "integer", "readOnly": true}}}}}}}}}}}
      }}"#;
    let toolset = toolset_of(&dir, doc);
    let listed = toolset.list().await.unwrap();
    let names: Vec<&str> = listed.iter().map(|t| t.spec.name.as_str()).collect();
    // A path placeholder no parameter declares: left out (it was sent as `%7Bid%7D`).
    assert_eq!(names, ["api__create", "api__styles"]);
    // Headers the document describes otherwise are not the model's to set.
    let styles = &listed[1].spec.input_schema;
    for header in ["Accept", "Content-Type", "Authorization", "Idempotency-Key"] {
        assert!(styles["properties"].get(header).is_none(), "{styles}");
    }
    // readOnly properties are the server's: not asked for, not required.
    let body = &listed[0].spec.input_schema["properties"]["body"];
    assert!(body["properties"].get("id").is_none(), "{body}");
    assert_eq!(body["required"], json!(["name"]), "{body}");
    assert_eq!(
        body["properties"]["parts"]["items"]["required"],
        json!([]),
        "{body}"
    );
    // ... and refused when the model gives them anyway (they are not in the schema, which
    // does not forbid other properties).
    let refused = toolset
        .request(
            &toolset.routes["create"],
            &json!({"body": {"id": 7, "name": "x"}}),
            "c",
        )
        .err()
        .unwrap();
    assert_eq!(
        refused,
        "the body's \"id\" is read-only (the API sets it): leave it out"
    );
    // Also in objects nested in it, named where the call gave them.
    let refused = toolset
        .request(
            &toolset.routes["create"],
            &json!({"body": {"name": "x", "parts": [{}, {"made": "now"}]}}),
            "c",
        )
        .err()
        .unwrap();
    assert_eq!(
        refused,
        "the body's \"parts[1].made\" is read-only (the API sets it): leave it out"
    );
    let refused = toolset
        .request(
            &toolset.routes["create"],
            &json!({"body": {"name": "x", "labels": {"a": {"by": "me"}, "b": {"at": 1}}}}),
            "c",
        )
        .err()
        .unwrap();
    assert_eq!(
        refused,
        "the body's \"labels.b.at\" is read-only (the API sets it): leave it out"
    );
    assert!(
        toolset
            .request(
                &toolset.routes["create"],
                &json!({"body": {"name": "x", "parts": [{"other": 1}],
                    "labels": {"a": {"by": "me"}}}}),
                "c"
            )
            .is_ok()
    );

    let request = toolset
        .request(
            &toolset.routes["styles"],
            &json!({
                "label": ["a", "b"], "matrix": ["c", "d"], "exploded": {"x": 1, "y": 2},
                "simple": {"r": 1, "g": 2},
                "filter": {"color": "brown", "age": 3}, "point": {"x": 1, "y": 2},
                "flat": {"r": 1, "g": 2}, "ids": [1, 2, 3], "words": ["a b", "c"],
                "X-Pair": {"k": "v", "n": 2}
            }),
            "c",
        )
        .unwrap();
    assert_eq!(
        request.target,
        "/l/.a.b/m/;matrix=c,d/;x=1;y=2/s/g=2,r=1\
         ?filter%5Bage%5D=3&filter%5Bcolor%5D=brown&x=1&y=2&flat=g%2C2%2Cr%2C1\
         &ids=1%7C2%7C3&words=a+b+c&api_key=k3y"
    );
    assert_eq!(request.headers["x-pair"], "k,v,n,2");

    // A deep object at any depth, its arrays by index (Stripe's `expand[0]=a`), nulls left
    // out.
    let request = toolset
        .request(
            &toolset.routes["styles"],
            &json!({
                "label": ["a"], "matrix": ["c"], "exploded": {"x": 1}, "simple": {"r": 1},
                "filter": {"expand": ["customer", "invoice"], "tax": {"liability": {"type": "self"}}, "gone": null}
            }),
            "c",
        )
        .unwrap();
    assert_eq!(
        request.target.split_once('?').unwrap().1,
        "filter%5Bexpand%5D%5B0%5D=customer&filter%5Bexpand%5D%5B1%5D=invoice\
         &filter%5Btax%5D%5Bliability%5D%5Btype%5D=self&api_key=k3y"
    );
    let request = toolset
        .request(
            &toolset.routes["styles"],
            &json!({
                "label": ["a"], "matrix": ["c"], "exploded": {"x": 1}, "simple": {"r": 1},
                "filter": ["customer", "invoice"]
            }),
            "c",
        )
        .unwrap();
    assert_eq!(
        request.target.split_once('?').unwrap().1,
        "filter%5B0%5D=customer&filter%5B1%5D=invoice&api_key=k3y"
    );
    std::fs::remove_dir_all(dir).unwrap();
}

/// A response body is shown to the model as text in its charset, and one that is not text
/// is described, not shown as garbage.
#[test]
fn bodies_are_read_in_their_charset_and_binary_ones_described() {
    let text = |body: &[u8], content_type: Option<&str>| body_text(body.to_vec(), content_type);
    assert_eq!(text("héllo".as_bytes(), None).unwrap(), "héllo");
    assert_eq!(
        text(&[0x68, 0xe9], Some("text/plain; charset=ISO-8859-1")).unwrap(),
        "hé"
    );
    assert_eq!(
        text(
            &[0x80, 0x93, 0x41, 0x94],
            Some("text/html;charset=\"windows-1252\"")
        )
        .unwrap(),
        "€“A”"
    );
    // UTF-16 with a byte-order mark, and without one (big-endian).
    assert_eq!(
        text(
            &[0xff, 0xfe, 0x68, 0, 0xe9, 0],
            Some("text/plain; charset=utf-16")
        )
        .unwrap(),
        "hé"
    );
    assert_eq!(
        text(&[0, 0x68, 0, 0xe9], Some("text/plain; charset=UTF-16")).unwrap(),
        "hé"
    );
    // Text that is not valid UTF-8 is read as far as it goes.
    assert_eq!(
        text(&[0x68, 0xff, 0x69], Some("application/json")).unwrap(),
        "h\u{fffd}i"
    );
    // A binary body is described; one that happens to be UTF-8 is text.
    let png = text(&[0x89, b'P', b'N', b'G', 0xff, 0], Some("image/png")).unwrap_err();
    assert_eq!(png, "6 bytes of image/png, which is not text (not shown)");
    assert_eq!(
        text(b"plain", Some("application/octet-stream")).unwrap(),
        "plain"
    );
    let unnamed = text(&[0xff, 0xfe, 0xfd], Some("application/pdf")).unwrap_err();
    assert!(
        unnamed.starts_with("3 bytes of application/pdf"),
        "{unnamed}"
    );
    let unread = text(&[0x82, 0xa0], Some("text/plain; charset=Shift_JIS")).unwrap_err();
    assert_eq!(
        unread,
        "2 bytes of text/plain in charset \"shift_jis\", which is not read (not shown)"
    );
}

/// A failed request over https never names its URL: the source's own query (its secret
/// `api_key`) would reach the model; nor does a redirect it refuses.
#[tokio::test]
async fn failures_never_show_the_sources_secret_query() {
    use crate::{ToolContext, Toolset};
    let dir = std::env::temp_dir().join(format!("agentrt-openapi-secret-{}", std::process::id()));
    // A port nothing listens on.
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let doc = DOC.replace(
        "http://api.example.test/v1/",
        &format!("https://127.0.0.1:{port}/v1/"),
    );
    let toolset = toolset_of(&dir, &doc);
    let out = toolset
        .call(
            "put.item",
            json!({"id": "a", "body": {}}),
            &ToolContext::default(),
        )
        .await
        .unwrap();
    assert!(out.is_error, "{out:?}");
    assert!(out.text.contains("it cannot be reached"), "{}", out.text);
    assert!(!out.text.contains("k3y"), "{}", out.text);

    let redirect = Reply {
        status: reqwest::StatusCode::MOVED_PERMANENTLY,
        location: Some("https://other.test/v1/items/a/?api_key=k3y&tag=x".into()),
        content_type: None,
        body: Vec::new(),
        too_large: false,
    };
    let out = toolset.output("POST /items/a", redirect);
    assert!(
        out.text.contains("https://other.test/v1/items/a/,"),
        "{}",
        out.text
    );
    assert!(!out.text.contains("k3y"), "{}", out.text);
}

/// Property names that are also keywords stay; OpenAPI 3.0's `nullable` takes `null` also
/// beside an enum, `allOf` or a list of types.
#[tokio::test]
async fn property_names_that_are_keywords_stay_and_nullable_always_takes_null() {
    let dir = std::env::temp_dir().join(format!("agentrt-openapi-names-{}", std::process::id()));
    let doc = r##"{"openapi": "3.0.3",
      "servers": [{"url": "http://api.example.test/"}],
      "components": {"schemas": {"Size": {"type": "string", "enum": ["s", "m"]}}},
      "paths": {"/things": {"post": {"operationId": "create",
        "requestBody": {"content": {"application/json": {"schema": {
          "type": "object", "required": ["examples", "x-total"],
          "properties": {
            "examples": {"type": "array", "items": {"type": "string"}},
            "x-total": {"type": "integer"},
            "nullable": {"type": "boolean"},
            "size": {"type": "string", "enum": ["s", "m"], "nullable": true},
            "shape": {"allOf": [{"$ref": "#/components/schemas/Size"}], "nullable": true,
              "description": "the shape"},
            "note": {"nullable": true, "description": "anything"}}}}}}}}}}"##;
    let toolset = toolset_of(&dir, doc);
    let listed = toolset.list().await.unwrap();
    let body = &listed[0].spec.input_schema["properties"]["body"];
    let properties = &body["properties"];
    for name in ["examples", "x-total", "nullable"] {
        assert!(properties[name].is_object(), "{name}: {body}");
    }
    assert_eq!(body["required"], json!(["examples", "x-total"]), "{body}");
    assert_eq!(properties["size"]["type"], json!(["string", "null"]));
    assert_eq!(properties["size"]["enum"], json!(["s", "m", null]));
    let shape = &properties["shape"]["anyOf"];
    assert_eq!(shape[1], json!({"type": "null"}), "{body}");
    assert!(shape[0]["allOf"].is_array(), "{body}");
    // No constraint to widen: it takes anything already.
    assert_eq!(properties["note"], json!({"description": "anything"}));
    let validator = jsonschema::validator_for(body).unwrap();
    for (value, valid) in [
        (
            json!({"examples": [], "x-total": 1, "size": null, "shape": null}),
            true,
        ),
        (
            json!({"examples": [], "x-total": 1, "size": "m", "shape": "s"}),
            true,
        ),
        (json!({"examples": [], "x-total": 1, "shape": "xl"}), false),
        (json!({"x-total": 1}), false),
    ] {
        assert_eq!(validator.is_valid(&value), valid, "{value}");
    }
}

/// An operation that takes a form (and no JSON) is sent one, as OpenAPI encodes it by
/// default, with the properties its `encoding` names as deep objects (Stripe's way).
#[tokio::test]
async fn form_bodies_are_sent_as_forms() {
    let dir = std::env::temp_dir().join(format!("agentrt-openapi-form-{}", std::process::id()));
    let doc = r##"{"openapi": "3.0.3",
      "servers": [{"url": "http://api.example.test/"}],
      "paths": {"/v1/customers": {"post": {"operationId": "PostCustomers",
        "requestBody": {"content": {"application/x-www-form-urlencoded": {
          "encoding": {"metadata": {"style": "deepObject", "explode": true},
                       "items": {"style": "deepObject", "explode": true}},
          "schema": {"type": "object", "properties": {
            "email": {"type": "string"}, "expand": {"type": "array", "items": {"type": "string"}},
            "metadata": {"type": "object"}, "items": {"type": "array"},
            "address": {"type": "object"}, "note": {"type": "string", "nullable": true}}}}}}}}}}"##;
    let toolset = toolset_of(&dir, doc);
    let listed = toolset.list().await.unwrap();
    assert!(listed[0].spec.input_schema["properties"]["body"]["properties"]["email"].is_object());
    let request = toolset
        .request(
            &toolset.routes["PostCustomers"],
            &json!({"body": {
                "email": "a b@example.com", "expand": ["x", "y"],
                "metadata": {"order": "17"}, "items": [{"price": "p_1", "quantity": 2}],
                "address": {"city": "Köln"}, "note": null}}),
            "c",
        )
        .unwrap();
    assert_eq!(
        request.headers[reqwest::header::CONTENT_TYPE],
        "application/x-www-form-urlencoded"
    );
    let body = String::from_utf8(request.body.unwrap().to_vec()).unwrap();
    assert_eq!(
        body,
        "city=K%C3%B6ln&email=a+b%40example.com&expand=x&expand=y\
         &items%5B0%5D%5Bprice%5D=p_1&items%5B0%5D%5Bquantity%5D=2\
         &metadata%5Border%5D=17"
    );
}

/// A parameter described by a JSON media type (`content`) is sent as one JSON text, not
/// spread out in its style.
#[tokio::test]
async fn parameters_with_json_content_are_sent_as_json() {
    let dir = std::env::temp_dir().join(format!("agentrt-openapi-content-{}", std::process::id()));
    let doc = r##"{"openapi": "3.1.0",
      "servers": [{"url": "http://api.example.test/"}],
      "paths": {"/issues": {"get": {"operationId": "search", "parameters": [
        {"name": "filter", "in": "query",
         "content": {"application/json": {"schema": {"type": "object"}}}},
        {"name": "X-Where", "in": "header",
         "content": {"application/json": {"schema": {"type": "array"}}}},
        {"name": "plain", "in": "query", "schema": {"type": "object"}}]}}}}"##;
    let toolset = toolset_of(&dir, doc);
    let request = toolset
        .request(
            &toolset.routes["search"],
            &json!({"filter": {"status": "open"}, "X-Where": [1, "a"], "plain": {"a": 1}}),
            "c",
        )
        .unwrap();
    let url = reqwest::Url::parse(&format!("http://h{}", request.target)).unwrap();
    let pairs: Vec<(String, String)> = url.query_pairs().into_owned().collect();
    assert!(
        pairs.contains(&("filter".into(), r#"{"status":"open"}"#.into())),
        "{pairs:?}"
    );
    // The other, described by a schema, is exploded as `form` says.
    assert!(pairs.contains(&("a".into(), "1".into())), "{pairs:?}");
    assert_eq!(request.headers["X-Where"], r#"[1,"a"]"#);
}

/// Only a 2xx answer is a result: a final 1xx, or a status past 599, is an error naming
/// it, as a 4xx or 5xx is.
#[test]
fn answers_that_are_not_2xx_are_errors_naming_the_status() {
    let dir = std::env::temp_dir().join(format!("agentrt-openapi-status-{}", std::process::id()));
    let toolset = toolset(&dir);
    let _ = std::fs::remove_dir_all(&dir);
    for (status, error) in [
        (101, true),
        (200, false),
        (204, false),
        (299, false),
        (404, true),
        (600, true),
        (999, true),
    ] {
        let out = toolset.output(
            "GET /x",
            Reply {
                status: reqwest::StatusCode::from_u16(status).unwrap(),
                location: None,
                content_type: None,
                body: b"body".to_vec(),
                too_large: false,
            },
        );
        assert_eq!(out.is_error, error, "{status}: {out:?}");
        if error {
            assert!(
                out.text.starts_with(&format!("GET /x answered {status}")),
                "{}",
                out.text
            );
        } else {
            assert_eq!(out.text, "body");
        }
    }
}

/// Source `config` (its `spec` `api.json`, holding `doc`; a secret in the file `key`),
/// loaded from a directory of its own named after `tag`.
fn loaded(tag: &str, doc: &str, config: serde_json::Value) -> OpenApiToolset {
    let dir = std::env::temp_dir().join(format!("agentrt-openapi-{tag}-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    std::fs::write(dir.join("api.json"), doc).unwrap();
    std::fs::write(dir.join("key"), "k3y\n").unwrap();
    let mut config: OpenApiConfig = serde_json::from_value(config).unwrap();
    config.resolve_paths(&dir);
    let toolset = OpenApiToolset::load(&config).unwrap();
    let _ = std::fs::remove_dir_all(&dir);
    toolset
}

/// The source's own query parameter (an API key) goes last; a server that reads the first
/// of two would read the model's instead, so no argument may write that name: not as an
/// exploded object's property, not as a deep object's pair, in whatever letter case.
#[test]
fn query_names_the_source_sets_cannot_come_from_the_arguments() {
    let toolset = loaded(
        "own",
        r#"{"openapi": "3.1.0", "servers": [{"url": "http://api.example.test"}],
          "paths": {"/search": {"get": {"operationId": "search", "parameters": [
            {"name": "filter", "in": "query", "schema": {"type": "object"}},
            {"name": "page", "in": "query", "style": "deepObject", "schema": {"type": "object"}},
            {"name": "tags", "in": "query", "schema": {"type": "array"}},
            {"name": "api_key", "in": "query", "schema": {"type": "string"}}]}}}}"#,
        json!({
            "name": "api",
            "spec": "api.json",
            "query": {"api_key": {"file": "key"}, "page[token]": {"file": "key"}},
        }),
    );
    let route = &toolset.routes["search"];
    // The parameter the document declares with the source's name is not offered.
    assert!(route.op.parameters.iter().all(|p| p.name != "api_key"));

    let ok = toolset
        .request(
            route,
            &json!({"filter": {"color": "red"}, "page": {"size": 2}, "tags": ["a"]}),
            "",
        )
        .unwrap();
    assert_eq!(
        ok.target,
        "/search?color=red&page%5Bsize%5D=2&tags=a&api_key=k3y&page%5Btoken%5D=k3y"
    );
    for (arguments, key, name) in [
        (json!({"filter": {"api_key": "x"}}), "filter", "api_key"),
        (
            json!({"filter": {"color": "red", "API_Key": "x"}}),
            "filter",
            "API_Key",
        ),
        (json!({"page": {"token": "x"}}), "page", "page[token]"),
    ] {
        let err = toolset.request(route, &arguments, "").unwrap_err();
        assert_eq!(
            err,
            format!(
                "{key:?} would send the query parameter {name:?}, which this source sets \
                 itself: leave it out"
            )
        );
    }

    // A key written into the base URL's query is the source's as well, and a parameter
    // the document declares under another letter case is not offered either.
    let toolset = loaded(
        "own2",
        r#"{"openapi": "3.1.0", "servers": [{"url": "http://api.example.test"}],
          "paths": {"/search": {"get": {"operationId": "search", "parameters": [
            {"name": "filter", "in": "query", "schema": {"type": "object"}},
            {"name": "key", "in": "query", "required": true, "schema": {"type": "string"}},
            {"name": "TOKEN", "in": "query", "required": true, "schema": {"type": "string"}}]}}}}"#,
        json!({
            "name": "api",
            "spec": "api.json",
            "base_url": "http://maps.example.test/api?key=K",
            "query": {"token": {"file": "key"}},
        }),
    );
    let route = &toolset.routes["search"];
    let offered: Vec<&str> = route
        .op
        .parameters
        .iter()
        .map(|p| p.name.as_str())
        .collect();
    assert_eq!(offered, ["filter"]);
    assert_eq!(
        toolset
            .request(route, &json!({"filter": {"q": "x"}}), "")
            .unwrap()
            .target,
        "/api/search?key=K&q=x&token=k3y"
    );
    let err = toolset
        .request(route, &json!({"filter": {"key": "x"}}), "")
        .unwrap_err();
    assert!(
        err.contains("\"key\", which this source sets itself"),
        "{err}"
    );
}

/// A relative server (`/api/v3`) is resolved against a `base_url` giving only the origin;
/// a `base_url` with a path of its own replaces it.
#[tokio::test]
async fn a_relative_server_is_resolved_against_an_origin_base_url() {
    let doc = r#"{"openapi": "3.0.3", "servers": [{"url": "/api/v3"}],
          "paths": {"/pet/{id}": {"get": {"operationId": "get_pet",
            "parameters": [{"name": "id", "in": "path", "required": true,
                            "schema": {"type": "integer"}}]}}}}"#;
    for (base_url, expected) in [
        (
            "http://pets.example.test",
            "http://pets.example.test/api/v3/pet/7",
        ),
        (
            "http://pets.example.test/",
            "http://pets.example.test/api/v3/pet/7",
        ),
        (
            "http://pets.example.test/other",
            "http://pets.example.test/other/pet/7",
        ),
    ] {
        let toolset = loaded(
            "rel",
            doc,
            json!({"name": "pets", "spec": "api.json", "base_url": base_url}),
        );
        let request = toolset
            .request(&toolset.routes["get_pet"], &json!({"id": 7}), "c")
            .unwrap();
        assert_eq!(
            toolset.url(&request.target).as_str(),
            expected,
            "{base_url}"
        );
    }
}
