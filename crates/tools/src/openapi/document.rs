//! Reading an OpenAPI 3.0 or 3.1 document into operations: each with an `operationId`
//! becomes one tool whose input schema joins its path, query and header parameters and
//! its JSON request body (under `body`) as one object schema.

use std::collections::HashMap;

use serde_json::{Map, Value, json};

/// How deep `$ref`s are followed; a schema nested deeper accepts anything below that
/// depth. A recursive reference (one met again inside its own expansion: a tree, a
/// linked list) accepts anything at once, so that the schema stays shallow enough for
/// every gRPC client to decode (Protobuf decoders stop at 100 levels of nesting).
const MAX_REF_DEPTH: usize = 16;
/// Most schema nodes one operation's input schema may hold once `$ref`s are inlined.
const MAX_NODES: usize = 20_000;

/// Schema keywords that only describe (JSON Schema's annotations): beside a `$ref`, they
/// are merged into the schema it points at rather than put beside it.
const ANNOTATIONS: [&str; 7] = [
    "title",
    "description",
    "default",
    "deprecated",
    "readOnly",
    "writeOnly",
    "$comment",
];

/// Header parameters left out of every operation (see [`operation`]).
const NOT_PARAMETERS: [&str; 12] = [
    "accept",
    "content-type",
    "authorization",
    "idempotency-key",
    "host",
    "content-length",
    "transfer-encoding",
    "connection",
    "te",
    "upgrade",
    "keep-alive",
    "expect",
];

const METHODS: [&str; 8] = [
    "get", "put", "post", "delete", "patch", "head", "options", "trace",
];

/// Where a parameter goes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Location {
    Path,
    Query,
    Header,
}

impl Location {
    fn as_str(self) -> &'static str {
        match self {
            Self::Path => "path",
            Self::Query => "query",
            Self::Header => "header",
        }
    }
}

/// How a parameter's array or object value is written (OpenAPI's `style`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Style {
    /// `a,b` (path and header default).
    Simple,
    /// `.a,b` or `.a.b` (path).
    Label,
    /// `;id=a,b` or `;id=a;id=b` (path).
    Matrix,
    /// `id=a,b` or `id=a&id=b` (query default).
    Form,
    /// `id=a b` (query arrays).
    SpaceDelimited,
    /// `id=a|b` (query arrays).
    PipeDelimited,
    /// `id[k]=v` (query objects).
    DeepObject,
}

/// One parameter of an operation.
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct Parameter {
    /// Its property in the tool's arguments.
    pub key: String,
    /// Its name in the request.
    pub name: String,
    pub location: Location,
    pub style: Style,
    /// Whether arrays and objects are written a name-value pair per item (the default for
    /// `form` only).
    pub explode: bool,
    /// Whether it is described by a JSON media type (`content`) rather than a schema:
    /// its value is sent as one JSON text.
    pub json: bool,
}

/// One operation offered as a tool.
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct Operation {
    pub id: String,
    pub method: reqwest::Method,
    /// The path template, e.g. `/pets/{petId}`.
    pub path: String,
    pub description: String,
    pub parameters: Vec<Parameter>,
    /// The media type of its JSON body (`body` in the arguments), as the document
    /// declares it (`application/merge-patch+json`); `None` when it takes none.
    pub body_type: Option<reqwest::header::HeaderValue>,
    /// `Some` when its body is sent as a form (`application/x-www-form-urlencoded`, for
    /// an operation that takes no JSON): the body's properties written as deep objects
    /// (`metadata[key]=value`, as its `encoding` says), the others exploded.
    pub form: Option<Vec<String>>,
    /// The properties of its JSON body that are the server's to set (`readOnly`), at any
    /// depth: left out of the input schema, and refused in a call.
    pub read_only: Vec<ReadOnly>,
    pub input_schema: Value,
    /// The cookie parameters it requires: not arguments, so only a source that sends a
    /// `Cookie` header of its own can call it.
    pub cookies: Vec<String>,
}

impl Operation {
    /// Leaves out the parameters for which `set_by_source` holds (those the source sets
    /// itself, its secret query parameters and headers): they leave the input schema, and
    /// a call never sends a value the model gave for them.
    pub(crate) fn drop_parameters(&mut self, set_by_source: impl Fn(&Parameter) -> bool) {
        let (dropped, kept): (Vec<_>, Vec<_>) = std::mem::take(&mut self.parameters)
            .into_iter()
            .partition(|param| set_by_source(param));
        self.parameters = kept;
        // Looked up, not indexed: indexing a missing key of a JSON object adds it, as
        // null (a `"required": null` made the schema invalid and the tool left out).
        let Some(schema) = self.input_schema.as_object_mut() else {
            return;
        };
        for param in dropped {
            if let Some(properties) = schema.get_mut("properties").and_then(Value::as_object_mut) {
                properties.remove(&param.key);
            }
            if let Some(required) = schema.get_mut("required").and_then(Value::as_array_mut) {
                required.retain(|key| key.as_str() != Some(param.key.as_str()));
            }
        }
        if schema
            .get("required")
            .and_then(Value::as_array)
            .is_some_and(Vec::is_empty)
        {
            schema.remove("required");
        }
    }
}

/// What a document holds.
#[derive(Debug)]
pub(crate) struct Document {
    pub operations: Vec<Operation>,
    /// The first server's URL, variables replaced by their defaults.
    pub first_server: Option<String>,
    /// Operations left out, and why.
    pub skipped: Vec<String>,
    /// Operations offered with parts of their input that accept anything (their schemas are
    /// in other documents, which are not read), and which.
    pub loose: Vec<String>,
}

/// Parses `text` (JSON or YAML) as an OpenAPI 3.0 or 3.1 document.
pub(crate) fn parse(text: &str) -> Result<Document, String> {
    let doc: Value = if text.trim_start().starts_with('{') {
        serde_json::from_str(text).map_err(|e| format!("not valid JSON: {e}"))?
    } else {
        let mut yaml: yaml_serde::Value =
            yaml_serde::from_str(text).map_err(|e| format!("not valid YAML: {e}"))?;
        // Merge keys (`<<: *base`), as YAML 1.1 has them and documents written by hand use
        // them. One pass leaves the merge keys of what it merged (a `<<: *b` where `b` has
        // `<<: *a`): each pass applies one level, and there are no more levels than the
        // nesting the parser allows.
        while has_merge_key(&yaml) {
            yaml.apply_merge()
                .map_err(|e| format!("not valid YAML: {e}"))?;
        }
        yaml_to_json(yaml)
    };
    let version = match &doc["openapi"] {
        Value::String(version) => version.clone(),
        // `openapi: 3.1` unquoted in YAML is a number; the version is the text.
        Value::Number(number) => number.to_string(),
        _ if doc.get("swagger").is_some() => {
            return Err(format!(
                "a Swagger {} document is not supported: convert it to OpenAPI 3.0 or 3.1",
                doc["swagger"]
            ));
        }
        _ if !doc.is_object() => {
            return Err(
                "the document is not an object: give an OpenAPI 3.0 or 3.1 document".into(),
            );
        }
        _ => {
            return Err(
                "the document has no `openapi` version: give an OpenAPI 3.0 or 3.1 document".into(),
            );
        }
    };
    let legacy = if version.starts_with("3.0") {
        true
    } else if version.starts_with("3.1") {
        false
    } else {
        return Err(format!(
            "`openapi: {version}` is not supported: give an OpenAPI 3.0 or 3.1 document"
        ));
    };
    let first_server = doc["servers"].get(0).and_then(server_url);
    let mut operations = Vec::new();
    let mut skipped = Vec::new();
    // Operations without an operationId: not tools, named together below.
    let mut unnamed: Vec<String> = Vec::new();
    let mut loose = Vec::new();
    let Some(paths) = doc["paths"].as_object() else {
        return Ok(Document {
            operations,
            first_server,
            skipped,
            loose,
        });
    };
    // Where each operationId is, to refuse one used twice: a tool per operation.
    let mut ids: HashMap<String, String> = HashMap::new();
    for (path, item) in paths {
        let item = match resolve_ref(&doc, item) {
            Ok(item) => item,
            Err(why) => {
                skipped.push(format!("path {path}: {why}"));
                continue;
            }
        };
        for method in METHODS {
            let Some(op) = item.get(method) else { continue };
            let Some(id) = op["operationId"].as_str() else {
                unnamed.push(format!("{} {path}", method.to_ascii_uppercase()));
                continue;
            };
            let place = format!("{} {path}", method.to_ascii_uppercase());
            if let Some(first) = ids.insert(id.to_owned(), place.clone()) {
                return Err(format!(
                    "operationId {id:?} is used twice, by {first} and by {place}: each \
                     operation is one tool, named by its operationId"
                ));
            }
            match operation(
                &doc,
                first_server.as_deref(),
                legacy,
                path,
                method,
                &item,
                op,
                id,
            ) {
                Ok((operation, external)) => {
                    if !external.is_empty() {
                        loose.push(format!(
                            "{id}: `$ref` {} in another document, which is not read: \
                             that part of its input accepts anything",
                            external.join(", ")
                        ));
                    }
                    operations.push(operation);
                }
                Err(why) => skipped.push(format!("{id}: {why}")),
            }
        }
    }
    if !unnamed.is_empty() {
        const NAMED: usize = 5;
        let more = unnamed.len().saturating_sub(NAMED);
        skipped.push(format!(
            "{} without an operationId (only an operation with one is a tool){}{}",
            unnamed[..unnamed.len().min(NAMED)].join(", "),
            if more > 0 { ", and " } else { "" },
            if more > 0 {
                format!("{more} more")
            } else {
                String::new()
            },
        ));
    }
    Ok(Document {
        operations,
        first_server,
        skipped,
        loose,
    })
}

#[allow(clippy::too_many_arguments)] // the document, once read, and the operation's place in it
fn operation(
    doc: &Value,
    first_server: Option<&str>,
    legacy: bool,
    path: &str,
    method: &str,
    item: &Value,
    op: &Value,
    id: &str,
) -> Result<(Operation, Vec<String>), String> {
    let method = reqwest::Method::from_bytes(method.to_ascii_uppercase().as_bytes())
        .map_err(|e| e.to_string())?;
    // An operation of another server (Stripe's uploads go to files.stripe.com) would be
    // sent to the wrong one.
    let own_server = [op, item]
        .into_iter()
        .find_map(|at| at["servers"].get(0))
        .and_then(server_url);
    if let Some(own) = own_server
        && Some(own.as_str()) != first_server
    {
        return Err(format!(
            "it is served from {own:?}, not from the document's server, which is the one \
             this source calls"
        ));
    }
    // Operation parameters override path-item ones with the same name and place.
    let mut raw: Vec<Value> = Vec::new();
    for list in [&item["parameters"], &op["parameters"]] {
        for p in list.as_array().into_iter().flatten() {
            let p = resolve_ref(doc, p)?;
            raw.retain(|q| !(q["name"] == p["name"] && q["in"] == p["in"]));
            raw.push(p);
        }
    }
    let mut properties = Map::new();
    let mut required = Vec::new();
    let mut parameters = Vec::new();
    let mut cookies = Vec::new();
    let mut walk = Walk {
        budget: MAX_NODES,
        external: Vec::new(),
    };
    for p in raw {
        let name = p["name"].as_str().unwrap_or_default().to_owned();
        let location = match p["in"].as_str() {
            Some("path") => Location::Path,
            Some("query") => Location::Query,
            Some("header") => Location::Header,
            // Cookies are the caller's session, not the model's to set: an operation that
            // needs one can be called only when the source sends a `Cookie` header.
            Some("cookie") if p["required"].as_bool() == Some(true) => {
                cookies.push(name);
                continue;
            }
            Some("cookie") => continue,
            other => return Err(format!("parameter {name:?} has an unknown place {other:?}")),
        };
        if name.is_empty() {
            return Err("a parameter has no name".into());
        }
        // Described by the document otherwise (the media types, the security schemes):
        // OpenAPI has such header parameters ignored. The idempotency key is the call's
        // (unique among every run's calls), not the model's to choose, and the headers
        // that frame the message or manage the connection are the HTTP client's: a
        // model's `Content-Length` or `Transfer-Encoding` could desynchronize it.
        if location == Location::Header
            && NOT_PARAMETERS.iter().any(|h| name.eq_ignore_ascii_case(h))
        {
            continue;
        }
        let style = match (p["style"].as_str(), location) {
            (None | Some("simple"), Location::Path | Location::Header) => Style::Simple,
            (Some("label"), Location::Path) => Style::Label,
            (Some("matrix"), Location::Path) => Style::Matrix,
            (None | Some("form"), Location::Query) => Style::Form,
            (Some("spaceDelimited"), Location::Query) => Style::SpaceDelimited,
            (Some("pipeDelimited"), Location::Query) => Style::PipeDelimited,
            (Some("deepObject"), Location::Query) => Style::DeepObject,
            (Some(other), _) => {
                return Err(format!(
                    "parameter {name:?} has style {other:?}, which a {} parameter cannot have",
                    location.as_str()
                ));
            }
        };
        let schema = p
            .get("schema")
            .or_else(|| p["content"].as_object()?.values().next()?.get("schema"))
            .cloned()
            .unwrap_or_else(|| json!({}));
        let mut schema = inline(doc, &schema, &mut Vec::new(), &mut walk, legacy)?;
        if let (Some(description), Some(obj)) = (p["description"].as_str(), schema.as_object_mut())
        {
            obj.entry("description")
                .or_insert_with(|| Value::String(description.to_owned()));
        }
        if parameters
            .iter()
            .any(|other: &Parameter| other.name == name && other.location == location)
        {
            return Err(format!("parameter {name:?} is given twice"));
        }
        let key = argument_key(&name, location, |key| {
            key == "body" || properties.contains_key(key)
        });
        if location == Location::Path || p["required"].as_bool() == Some(true) {
            required.push(Value::String(key.clone()));
        }
        properties.insert(key.clone(), schema);
        parameters.push(Parameter {
            key,
            name,
            location,
            style,
            explode: p["explode"]
                .as_bool()
                .unwrap_or(matches!(style, Style::Form | Style::DeepObject)),
            json: p.get("schema").is_none()
                && p["content"]
                    .as_object()
                    .and_then(|content| content.keys().next())
                    .is_some_and(|media| is_json(media)),
        });
    }
    // Every placeholder of the path needs its parameter: one the document does not declare
    // would be sent as it is (`/pets/%7Bid%7D`).
    let mut rest = path;
    while let Some(open) = rest.find('{') {
        let Some(close) = rest[open..].find('}') else {
            break;
        };
        let placeholder = &rest[open + 1..open + close];
        if !parameters
            .iter()
            .any(|p| p.location == Location::Path && p.name == placeholder)
        {
            return Err(format!(
                "its path names {{{placeholder}}}, which no path parameter declares"
            ));
        }
        rest = &rest[open + close + 1..];
    }
    let mut body_type = None;
    let mut form = None;
    let mut read_only = Vec::new();
    if let Some(body) = op.get("requestBody") {
        let body = resolve_ref(doc, body)?;
        let content = body["content"].as_object();
        // The JSON type that fits best ([`json_rank`]).
        let json_media = content.and_then(|c| {
            c.iter()
                .filter_map(|entry| json_rank(entry.0).map(|rank| (rank, entry)))
                .min_by_key(|(rank, _)| *rank)
                .map(|(_, entry)| entry)
        });
        // Else a form (Stripe's API takes only forms).
        let form_media = content.and_then(|c| {
            c.iter()
                .find(|(media, _)| media_essence(media) == "application/x-www-form-urlencoded")
        });
        let chosen = json_media
            .map(|media| (media, false))
            .or(form_media.map(|media| (media, true)));
        match chosen {
            Some(((media, m), is_form)) => {
                if is_form {
                    form = Some(
                        m["encoding"]
                            .as_object()
                            .map(|encoding| {
                                encoding
                                    .iter()
                                    .filter(|(_, how)| how["style"] == "deepObject")
                                    .map(|(name, _)| name.clone())
                                    .collect()
                            })
                            .unwrap_or_default(),
                    );
                }
                let schema = m.get("schema").cloned().unwrap_or_else(|| json!({}));
                let mut schema = inline(doc, &schema, &mut Vec::new(), &mut walk, legacy)?;
                drop_read_only(&mut schema, &mut Vec::new(), &mut read_only);
                read_only.sort();
                read_only.dedup();
                if let (Some(description), Some(obj)) =
                    (body["description"].as_str(), schema.as_object_mut())
                {
                    obj.entry("description")
                        .or_insert_with(|| Value::String(description.to_owned()));
                }
                properties.insert("body".into(), schema);
                if body["required"].as_bool() == Some(true) {
                    required.push(Value::String("body".into()));
                }
                // A range (`application/*+json`) names no type to send: plain JSON is.
                let sent = if media.contains('*') {
                    "application/json"
                } else {
                    media.as_str()
                };
                body_type = Some(reqwest::header::HeaderValue::from_str(sent).map_err(|_| {
                    format!("its request body's media type {media:?} is not a valid header")
                })?);
            }
            None if body["required"].as_bool() == Some(true) => {
                let offered = content
                    .map(|c| c.keys().map(String::as_str).collect::<Vec<_>>().join(", "))
                    .unwrap_or_default();
                return Err(format!(
                    "its request body is required but neither JSON nor a form ({}): only \
                     those are sent",
                    if offered.is_empty() {
                        "no media type"
                    } else {
                        &offered
                    }
                ));
            }
            None => {}
        }
    }
    let mut description = [op["summary"].as_str(), op["description"].as_str()]
        .into_iter()
        .flatten()
        .filter(|s| !s.trim().is_empty())
        .collect::<Vec<_>>()
        .join("\n\n");
    if description.is_empty() {
        description = format!("{method} {path}");
    }
    crate::cut_description(&mut description);
    let mut input_schema = json!({
        "type": "object",
        "properties": properties,
        "additionalProperties": false,
    });
    if !required.is_empty() {
        input_schema["required"] = Value::Array(required);
    }
    let external = walk.external.iter().map(|r| format!("{r:?}")).collect();
    Ok((
        Operation {
            id: id.to_owned(),
            method,
            path: path.to_owned(),
            description,
            parameters,
            body_type,
            form,
            read_only,
            input_schema,
            cookies,
        },
        external,
    ))
}

/// What inlining one operation's schemas counts and notes.
struct Walk {
    /// Schema nodes it may still make.
    budget: usize,
    /// The `$ref`s to other documents met (each once), which accept anything.
    external: Vec<String>,
}

/// Where a `readOnly` property of a request body sits: the steps from the body to it.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord)]
pub struct ReadOnly(Vec<Step>);

#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord)]
enum Step {
    /// The object's property of that name.
    Property(String),
    /// Each item of an array (`items`).
    Item,
    /// Each property of an object but those it declares (`additionalProperties`).
    Other(Vec<String>),
}

impl ReadOnly {
    /// Where `body` gives a value for this property (`id`, `parts[0].made`), if anywhere.
    pub fn given_in(&self, body: &Value) -> Option<String> {
        let mut at = String::new();
        find(body, &self.0, &mut at).then_some(at)
    }
}

/// Whether `value` has something at `steps`, written after `at` when it has.
fn find(value: &Value, steps: &[Step], at: &mut String) -> bool {
    let Some((step, rest)) = steps.split_first() else {
        return true;
    };
    let inside = |inner: &Value, name: std::fmt::Arguments<'_>, at: &mut String| {
        let len = at.len();
        // `write!` to a String cannot fail.
        let _ = std::fmt::Write::write_fmt(at, name);
        let found = find(inner, rest, at);
        if !found {
            at.truncate(len);
        }
        found
    };
    let dot = if at.is_empty() { "" } else { "." };
    match step {
        Step::Property(name) => value
            .get(name)
            .is_some_and(|inner| inside(inner, format_args!("{dot}{name}"), at)),
        Step::Item => value.as_array().is_some_and(|items| {
            items
                .iter()
                .enumerate()
                .any(|(i, item)| inside(item, format_args!("[{i}]"), at))
        }),
        Step::Other(declared) => value.as_object().is_some_and(|object| {
            object
                .iter()
                .filter(|(key, _)| !declared.contains(key))
                .any(|(key, inner)| inside(inner, format_args!("{dot}{key}"), at))
        }),
    }
}

/// Leaves out of `schema` (of a request body, or a part of one at `at`) its `readOnly`
/// properties, at any depth: they are the server's to set, are not sent, and are required
/// in responses only. Adds where each sat to `found`, and answers the names of those of
/// the object itself (its `allOf`, `anyOf` and `oneOf` members' too), which neither it nor
/// any of those members requires any longer.
fn drop_read_only(
    schema: &mut Value,
    at: &mut Vec<Step>,
    found: &mut Vec<ReadOnly>,
) -> Vec<String> {
    let Some(object) = schema.as_object_mut() else {
        return Vec::new();
    };
    let mut dropped = Vec::new();
    let mut declared = Vec::new();
    if let Some(properties) = object.get_mut("properties").and_then(Value::as_object_mut) {
        declared.extend(properties.keys().cloned());
        properties.retain(|name, property| {
            let read_only = property.get("readOnly").and_then(Value::as_bool) == Some(true);
            if read_only {
                dropped.push(name.clone());
                let mut path = at.clone();
                path.push(Step::Property(name.clone()));
                found.push(ReadOnly(path));
            }
            !read_only
        });
        for (name, property) in properties.iter_mut() {
            at.push(Step::Property(name.clone()));
            drop_read_only(property, at, found);
            at.pop();
        }
    }
    if let Some(items) = object.get_mut("items") {
        at.push(Step::Item);
        drop_read_only(items, at, found);
        at.pop();
    }
    if let Some(others) = object.get_mut("additionalProperties") {
        at.push(Step::Other(declared));
        drop_read_only(others, at, found);
        at.pop();
    }
    for key in ["allOf", "anyOf", "oneOf"] {
        if let Some(list) = object.get_mut(key).and_then(Value::as_array_mut) {
            for member in list {
                dropped.extend(drop_read_only(member, at, found));
            }
        }
    }
    if !dropped.is_empty() {
        unrequire(schema, &dropped);
    }
    dropped
}

/// Takes `names` out of the `required` of `schema` and of its `allOf`, `anyOf` and `oneOf`
/// members, at any depth: a property one member declares `readOnly` may be required by
/// another, which would make the body impossible to give.
fn unrequire(schema: &mut Value, names: &[String]) {
    let Some(object) = schema.as_object_mut() else {
        return;
    };
    if let Some(required) = object.get_mut("required").and_then(Value::as_array_mut) {
        required.retain(|name| !names.iter().any(|d| name.as_str() == Some(d)));
    }
    for key in ["allOf", "anyOf", "oneOf"] {
        if let Some(list) = object.get_mut(key).and_then(Value::as_array_mut) {
            for member in list {
                unrequire(member, names);
            }
        }
    }
}

/// The argument a parameter named `name` is given as: its name where model APIs take it
/// as a property name (Anthropic's and Bedrock's `^[a-zA-Z0-9_.-]{1,64}$`, which refuse
/// the whole request otherwise), else with each run of other characters made one `_`
/// (`$top` is `top`, `filter[status]` is `filter_status`), at most 64 bytes; then, when
/// `taken`, prefixed with its location (`query_id`), then numbered (`filter_status_2`).
fn argument_key(name: &str, location: Location, taken: impl Fn(&str) -> bool) -> String {
    let allowed = |c: char| c.is_ascii_alphanumeric() || matches!(c, '_' | '.' | '-');
    let mut key = String::with_capacity(name.len());
    for c in name.chars() {
        if allowed(c) {
            key.push(c);
        } else if !key.ends_with('_') {
            key.push('_');
        }
    }
    let mut key = key.trim_matches('_').to_owned();
    if key.is_empty() {
        key = "param".to_owned();
    }
    if key.len() > MAX_KEY_BYTES {
        // Room for a prefix and a number, should it clash.
        key.truncate(MAX_KEY_BYTES - 10);
    }
    if !taken(&key) {
        return key;
    }
    let prefixed = format!("{}_{key}", location.as_str());
    if !taken(&prefixed) {
        return prefixed;
    }
    (2..)
        .map(|n| format!("{prefixed}_{n}"))
        .find(|numbered| !taken(numbered))
        .unwrap_or(prefixed)
}

/// Longest argument name model APIs take.
const MAX_KEY_BYTES: usize = 64;

/// How well a request body's media type takes the model's JSON, best first: `None` for a
/// type that takes no JSON. `application/json`; then a merge patch, which takes an object
/// as the model writes one; then other `+json` types; then a JSON Patch, which takes only
/// a list of operations (Kubernetes offers both for PATCH); then a range that admits JSON
/// (`*/*`, `application/*`, as Kubernetes declares its create and replace bodies), sent
/// as `application/json`.
fn json_rank(media: &str) -> Option<u8> {
    let essence = media_essence(media);
    match essence.as_str() {
        "application/json" => Some(0),
        "application/merge-patch+json" => Some(1),
        "application/json-patch+json" => Some(3),
        "*/*" | "application/*" => Some(4),
        _ if essence.ends_with("+json") => Some(2),
        _ => None,
    }
}

fn is_json(media: &str) -> bool {
    let media = media_essence(media);
    media == "application/json" || media.ends_with("+json")
}

/// A media type without its parameters: `application/json; charset=utf-8` is
/// `application/json`.
pub(crate) fn media_essence(media: &str) -> String {
    media
        .split(';')
        .next()
        .unwrap_or_default()
        .trim()
        .to_ascii_lowercase()
}

/// The value `value` stands for when it is a local `$ref`, followed a bounded number of
/// times; anything else as it is. A reference to nothing, to another document, or in a
/// chain too long is an error naming it.
fn resolve_ref(doc: &Value, value: &Value) -> Result<Value, String> {
    let mut current = value;
    for _ in 0..MAX_REF_DEPTH {
        match current.get("$ref").and_then(Value::as_str) {
            Some(reference) => {
                current = lookup(doc, reference).ok_or_else(|| unresolved(reference))?
            }
            None => return Ok(current.clone()),
        }
    }
    Err(format!("its `$ref`s chain more than {MAX_REF_DEPTH} deep"))
}

/// Why `reference` cannot be followed.
fn unresolved(reference: &str) -> String {
    if reference.starts_with('#') {
        format!("`$ref` {reference:?} points at nothing in the document")
    } else {
        format!("`$ref` {reference:?} is in another document, which is not read")
    }
}

/// The value at a local reference (`#/components/schemas/Pet`). A pointer in a URI
/// fragment is percent-encoded (RFC 6901, section 6), as bundlers write refs into paths
/// (`#/paths/~1pets~1%7Bid%7D/...`): decoded first; as written when that points at
/// nothing (a `%` in a name, written unencoded).
fn lookup<'a>(doc: &'a Value, reference: &str) -> Option<&'a Value> {
    let pointer = reference.strip_prefix('#')?;
    if !pointer.contains('%') {
        return doc.pointer(pointer);
    }
    percent_encoding::percent_decode_str(pointer)
        .decode_utf8()
        .ok()
        .and_then(|decoded| doc.pointer(&decoded))
        .or_else(|| doc.pointer(pointer))
}

/// A copy of `schema` with every local `$ref` inlined (recursive refs, refs deeper than
/// [`MAX_REF_DEPTH`] and refs to other documents become `{}`), and OpenAPI 3.0's dialect
/// turned into JSON Schema (`nullable`, boolean `exclusiveMinimum`/`exclusiveMaximum`).
/// `expanding` holds the refs being inlined around `schema`.
fn inline<'d>(
    doc: &'d Value,
    schema: &'d Value,
    expanding: &mut Vec<&'d str>,
    walk: &mut Walk,
    legacy: bool,
) -> Result<Value, String> {
    if walk.budget == 0 {
        return Err(format!(
            "its schemas hold more than {MAX_NODES} nodes once references are inlined"
        ));
    }
    walk.budget -= 1;
    match schema {
        Value::Object(map) => {
            let referenced = match map.get("$ref").and_then(Value::as_str) {
                Some(reference) => Some(inline_ref(doc, reference, expanding, walk, legacy)?),
                None => None,
            };
            let mut out = Map::with_capacity(map.len());
            for (key, value) in map {
                // Examples and vendor extensions are not for validation.
                if key.starts_with("x-")
                    || key == "example"
                    || key == "examples"
                    || (key == "$ref" && referenced.is_some())
                {
                    continue;
                }
                let value = match (key.as_str(), value.as_object()) {
                    // Schemas by name: every name stays (a property may be called
                    // `examples`, `nullable` or `x-total`).
                    (
                        "properties" | "patternProperties" | "$defs" | "definitions"
                        | "dependentSchemas",
                        Some(named),
                    ) => {
                        let mut schemas = Map::with_capacity(named.len());
                        for (name, schema) in named {
                            schemas.insert(
                                name.clone(),
                                inline(doc, schema, expanding, walk, legacy)?,
                            );
                        }
                        Value::Object(schemas)
                    }
                    // Values, not schemas.
                    ("enum" | "const" | "default", _) => value.clone(),
                    _ => inline(doc, value, expanding, walk, legacy)?,
                };
                out.insert(key.clone(), value);
            }
            // Keywords beside a `$ref` apply with it (JSON Schema 2020-12 says so, and
            // 3.0 documents put `nullable` there): annotations (a `description`, a
            // `readOnly`) go into the schema it points at, others beside it in an `allOf`,
            // which does not nest the schema deeper where there is no need to.
            match referenced {
                None => {}
                Some(referenced) if out.is_empty() => return Ok(referenced),
                Some(Value::Object(mut target))
                    if out.keys().all(|key| ANNOTATIONS.contains(&key.as_str())) =>
                {
                    target.extend(out);
                    return Ok(Value::Object(target));
                }
                Some(referenced) => match out.get_mut("allOf") {
                    Some(Value::Array(members)) => members.insert(0, referenced),
                    _ => {
                        out.insert("allOf".into(), json!([referenced]));
                    }
                },
            }
            if legacy {
                dialect_3_0(&mut out);
            }
            Ok(Value::Object(out))
        }
        Value::Array(items) => items
            .iter()
            .map(|v| inline(doc, v, expanding, walk, legacy))
            .collect::<Result<Vec<_>, _>>()
            .map(Value::Array),
        other => Ok(other.clone()),
    }
}

/// The schema `reference` points at, inlined; `{}` when it recurs, is nested too deep,
/// or is in another document (noted in `walk`).
fn inline_ref<'d>(
    doc: &'d Value,
    reference: &'d str,
    expanding: &mut Vec<&'d str>,
    walk: &mut Walk,
    legacy: bool,
) -> Result<Value, String> {
    if expanding.len() >= MAX_REF_DEPTH || expanding.contains(&reference) {
        return Ok(json!({}));
    }
    let Some(target) = lookup(doc, reference) else {
        // Another document's schema is not read: it accepts anything.
        if reference.starts_with('#') {
            return Err(unresolved(reference));
        }
        if !walk.external.iter().any(|r| r == reference) {
            walk.external.push(reference.to_owned());
        }
        return Ok(json!({}));
    };
    expanding.push(reference);
    let inlined = inline(doc, target, expanding, walk, legacy);
    expanding.pop();
    inlined
}

/// OpenAPI 3.0 schema keywords that mean something else in JSON Schema 2020-12.
fn dialect_3_0(schema: &mut Map<String, Value>) {
    if schema.remove("nullable") == Some(Value::Bool(true)) {
        // `null` is one more value it takes: by its type, its enum, or beside the rest.
        match schema.get_mut("type") {
            Some(Value::String(kind)) => {
                let kind = std::mem::take(kind);
                schema.insert("type".into(), json!([kind, "null"]));
            }
            Some(Value::Array(kinds)) if !kinds.contains(&json!("null")) => {
                kinds.push(json!("null"));
            }
            _ => {}
        }
        if let Some(Value::Array(values)) = schema.get_mut("enum")
            && !values.contains(&Value::Null)
        {
            values.push(Value::Null);
        }
        let constrains = |key: &String| {
            !matches!(
                key.as_str(),
                "title" | "description" | "deprecated" | "readOnly" | "writeOnly"
            )
        };
        if !schema.contains_key("type") && schema.keys().any(constrains) {
            let rest = std::mem::take(schema);
            schema.insert(
                "anyOf".into(),
                json!([Value::Object(rest), {"type": "null"}]),
            );
        }
    }
    for (exclusive, bound) in [
        ("exclusiveMinimum", "minimum"),
        ("exclusiveMaximum", "maximum"),
    ] {
        if let Some(Value::Bool(on)) = schema.get(exclusive).cloned() {
            schema.remove(exclusive);
            if on && let Some(limit) = schema.remove(bound) {
                schema.insert(exclusive.into(), limit);
            }
        }
    }
}

/// A server object's URL with its variables replaced by their defaults.
fn server_url(server: &Value) -> Option<String> {
    let mut url = server["url"].as_str()?.to_owned();
    if let Some(variables) = server["variables"].as_object() {
        for (name, variable) in variables {
            if let Some(default) = variable["default"].as_str() {
                url = url.replace(&format!("{{{name}}}"), default);
            }
        }
    }
    Some(url)
}

/// Whether a mapping in `value` has a merge key (`<<`).
fn has_merge_key(value: &yaml_serde::Value) -> bool {
    use yaml_serde::Value as Y;
    match value {
        Y::Mapping(map) => map
            .iter()
            .any(|(key, value)| key.as_str() == Some("<<") || has_merge_key(value)),
        Y::Sequence(items) => items.iter().any(has_merge_key),
        Y::Tagged(tagged) => has_merge_key(&tagged.value),
        _ => false,
    }
}

/// YAML as JSON: keys that are not strings (`200:` in `responses`) become their text.
fn yaml_to_json(value: yaml_serde::Value) -> Value {
    use yaml_serde::Value as Y;
    match value {
        Y::Null => Value::Null,
        Y::Bool(b) => Value::Bool(b),
        Y::Number(n) => {
            if let Some(i) = n.as_i64() {
                json!(i)
            } else if let Some(u) = n.as_u64() {
                json!(u)
            } else {
                n.as_f64()
                    .and_then(serde_json::Number::from_f64)
                    .map_or(Value::Null, Value::Number)
            }
        }
        Y::String(s) => Value::String(s),
        Y::Sequence(items) => Value::Array(items.into_iter().map(yaml_to_json).collect()),
        Y::Mapping(map) => Value::Object(
            map.into_iter()
                .map(|(k, v)| {
                    let key = match yaml_to_json(k) {
                        Value::String(s) => s,
                        other => other.to_string(),
                    };
                    (key, yaml_to_json(v))
                })
                .collect(),
        ),
        Y::Tagged(tagged) => yaml_to_json(tagged.value),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const PETSTORE: &str = r##"
openapi: 3.0.3
info: {title: pets, version: "1"}
servers:
  - url: "http://{host}:8080/v1"
    variables: {host: {default: localhost}}
paths:
  /pets/{petId}:
    parameters:
      - $ref: "#/components/parameters/PetId"
    get:
      operationId: showPetById
      summary: Info for a pet
      parameters:
        - name: verbose
          in: query
          schema: {type: boolean, nullable: true}
        - name: X-Trace
          in: header
          required: true
          schema: {type: string}
      responses:
        200: {description: ok}
  /pets:
    post:
      operationId: createPet
      requestBody:
        required: true
        content:
          application/json:
            schema: {$ref: "#/components/schemas/Pet"}
      responses:
        201: {description: created}
    put:
      requestBody:
        content: {application/json: {schema: {type: object}}}
      responses: {200: {description: no id, so not a tool}}
  /upload:
    post:
      operationId: upload
      requestBody:
        required: true
        content: {multipart/form-data: {schema: {type: object}}}
      responses: {200: {description: ok}}
components:
  parameters:
    PetId: {name: petId, in: path, required: true, schema: {type: integer, minimum: 0, exclusiveMinimum: true}}
  schemas:
    Pet:
      type: object
      required: [name]
      properties:
        name: {type: string}
        parent: {$ref: "#/components/schemas/Pet"}
"##;

    #[test]
    fn operations_become_tools_with_one_schema() {
        let doc = parse(PETSTORE).unwrap();
        assert_eq!(
            doc.first_server.as_deref(),
            Some("http://localhost:8080/v1")
        );
        let ids: Vec<_> = doc.operations.iter().map(|o| o.id.as_str()).collect();
        assert_eq!(ids, ["createPet", "showPetById"]);
        assert_eq!(doc.skipped.len(), 2, "{:?}", doc.skipped);
        assert!(doc.skipped[0].starts_with("upload:"));
        // Not a tool, and said so.
        assert_eq!(
            doc.skipped[1],
            "PUT /pets without an operationId (only an operation with one is a tool)"
        );

        let show = &doc.operations[1];
        assert_eq!(show.method, reqwest::Method::GET);
        assert_eq!(
            show.input_schema,
            json!({
                "type": "object",
                "properties": {
                    "petId": {"type": "integer", "exclusiveMinimum": 0},
                    "verbose": {"type": ["boolean", "null"]},
                    "X-Trace": {"type": "string"},
                },
                "required": ["petId", "X-Trace"],
                "additionalProperties": false,
            })
        );
        let create = &doc.operations[0];
        assert_eq!(create.body_type.as_ref().unwrap(), "application/json");
        assert_eq!(create.input_schema["required"], json!(["body"]));
        let body = &create.input_schema["properties"]["body"];
        assert_eq!(body["required"], json!(["name"]));
        // `Pet.parent` is a Pet: a recursive reference accepts anything, rather than
        // unrolling the tree into a schema too deep for gRPC clients to decode.
        assert_eq!(body["properties"]["parent"], json!({}));
        assert!(agentrt_core::json_depth(&create.input_schema) < 8);
        jsonschema::validator_for(&create.input_schema).unwrap();
        jsonschema::validator_for(&show.input_schema).unwrap();
    }

    #[test]
    fn mutually_recursive_schemas_stay_shallow() {
        let doc = parse(
            r##"{"openapi": "3.1.0", "paths": {"/t": {"post": {"operationId": "tree",
                "requestBody": {"content": {"application/json": {"schema": {"$ref": "#/components/schemas/Node"}}}}}}},
              "components": {"schemas": {
                "Node": {"type": "object", "properties": {"value": {"type": "string"},
                  "children": {"type": "array", "items": {"$ref": "#/components/schemas/Edge"}}}},
                "Edge": {"type": "object", "properties": {"to": {"$ref": "#/components/schemas/Node"}}}}}}"##,
        )
        .unwrap();
        let schema = &doc.operations[0].input_schema;
        let edge = &schema["properties"]["body"]["properties"]["children"]["items"];
        assert_eq!(edge["properties"]["to"], json!({}), "{schema}");
        assert!(agentrt_core::json_depth(schema) < 10, "{schema}");
    }

    #[test]
    fn a_schema_in_another_document_accepts_anything_and_is_named() {
        let doc = parse(
            r##"{"openapi": "3.1.0", "paths": {
                "/a": {"post": {"operationId": "a",
                  "parameters": [{"name": "q", "in": "query", "schema": {"$ref": "common.yaml#/Q"}}],
                  "requestBody": {"content": {"application/json": {"schema": {"type": "object",
                    "properties": {"x": {"$ref": "common.yaml#/X"}, "y": {"$ref": "common.yaml#/X"}}}}}}}},
                "/b": {"get": {"operationId": "b"}}}}"##,
        )
        .unwrap();
        assert_eq!(doc.operations.len(), 2);
        let schema = &doc.operations[0].input_schema;
        assert_eq!(schema["properties"]["q"], json!({}), "{schema}");
        assert_eq!(
            schema["properties"]["body"]["properties"]["x"],
            json!({}),
            "{schema}"
        );
        assert_eq!(doc.loose.len(), 1, "{:?}", doc.loose);
        assert!(
            doc.loose[0].starts_with("a: `$ref` \"common.yaml#/Q\", \"common.yaml#/X\" in another"),
            "{:?}",
            doc.loose
        );
    }

    #[test]
    fn a_reference_to_nothing_is_named_and_an_operation_id_used_twice_refused() {
        let doc = parse(
            r##"{"openapi": "3.1.0", "paths": {
                "/a": {"get": {"operationId": "a", "parameters": [{"$ref": "#/components/parameters/Missing"}]}},
                "/b": {"post": {"operationId": "b", "requestBody": {"content": {"application/json":
                  {"schema": {"type": "object", "properties": {"x": {"$ref": "#/components/schemas/Gone"}}}}}}}},
                "/c": {"get": {"operationId": "c"}}}}"##,
        )
        .unwrap();
        let ids: Vec<_> = doc.operations.iter().map(|o| o.id.as_str()).collect();
        assert_eq!(ids, ["c"]);
        assert_eq!(doc.skipped.len(), 2, "{:?}", doc.skipped);
        assert!(
            doc.skipped[0].starts_with("a: ")
                && doc.skipped[0].contains("\"#/components/parameters/Missing\" points at nothing"),
            "{:?}",
            doc.skipped
        );
        assert!(
            doc.skipped[1].contains("\"#/components/schemas/Gone\""),
            "{:?}",
            doc.skipped
        );
        let twice = parse(
            r#"{"openapi": "3.1.0", "paths": {"/a": {"get": {"operationId": "same"}},
                "/b": {"get": {"operationId": "same"}}}}"#,
        )
        .unwrap_err();
        assert!(
            twice.contains("\"same\" is used twice, by GET /a and by GET /b"),
            "{twice}"
        );
    }

    #[test]
    fn json_documents_and_3_1_are_read_and_others_refused() {
        let doc = parse(
            r#"{"openapi": "3.1.0", "paths": {"/x": {"get": {"operationId": "x",
                "parameters": [{"name": "q", "in": "query", "schema": {"type": ["string", "null"]}}]}}}}"#,
        )
        .unwrap();
        assert_eq!(
            doc.operations[0].input_schema["properties"]["q"]["type"],
            json!(["string", "null"])
        );
        assert!(doc.first_server.is_none());
        assert!(parse("swagger: '2.0'").unwrap_err().contains("3.0 or 3.1"));
        assert!(parse("{not json").unwrap_err().contains("JSON"));
    }

    #[test]
    fn bodies_keep_their_json_type_and_operations_that_cannot_be_sent_are_left_out() {
        let doc = parse(
            r#"{"openapi": "3.1.0", "paths": {
                "/a": {"patch": {"operationId": "mergePatch", "requestBody": {"content": {
                    "application/merge-patch+json": {"schema": {"type": "object"}}}}}},
                "/b": {"post": {"operationId": "several", "requestBody": {"content": {
                    "application/xml": {}, "application/vnd.api+json": {},
                    "application/json; charset=utf-8": {}}}}},
                "/c": {"post": {"operationId": "form", "requestBody": {"required": true,
                    "content": {"application/x-www-form-urlencoded": {"schema": {"type": "object"}}}}}},
                "/f": {"post": {"operationId": "upload", "requestBody": {"required": true,
                    "content": {"multipart/form-data": {"schema": {"type": "object"}}}}}},
                "/g": {"servers": [{"url": "https://files.example.test/"}],
                    "get": {"operationId": "elsewhere"}},
                "/d": {"get": {"operationId": "cookie", "parameters": [
                    {"name": "session", "in": "cookie", "required": true, "schema": {"type": "string"}}]}},
                "/e": {"get": {"operationId": "optionalCookie", "parameters": [
                    {"name": "theme", "in": "cookie", "schema": {"type": "string"}}]}}}}"#,
        )
        .unwrap();
        let types: Vec<_> = doc
            .operations
            .iter()
            .map(|o| (o.id.as_str(), o.body_type.clone()))
            .collect();
        assert_eq!(
            types,
            [
                (
                    "mergePatch",
                    Some(reqwest::header::HeaderValue::from_static(
                        "application/merge-patch+json"
                    ))
                ),
                (
                    "several",
                    Some(reqwest::header::HeaderValue::from_static(
                        "application/json; charset=utf-8"
                    ))
                ),
                // A form is sent as one (see `form_bodies_are_sent_as_forms`).
                (
                    "form",
                    Some(reqwest::header::HeaderValue::from_static(
                        "application/x-www-form-urlencoded"
                    ))
                ),
                // Callable when the source sends a Cookie header (see
                // `a_required_cookie_is_sent_by_the_source_or_its_operation_left_out`).
                ("cookie", None),
                ("optionalCookie", None),
            ]
        );
        assert_eq!(doc.operations[3].cookies, ["session"]);
        assert!(doc.operations[4].cookies.is_empty());
        assert_eq!(doc.skipped.len(), 2, "{:?}", doc.skipped);
        assert!(
            doc.skipped[1].starts_with("elsewhere: ")
                && doc.skipped[1].contains("\"https://files.example.test/\""),
            "{:?}",
            doc.skipped
        );
        assert!(
            doc.skipped[0].starts_with("upload: ")
                && doc.skipped[0].contains("multipart/form-data"),
            "{:?}",
            doc.skipped
        );
    }

    /// JSON Schema 2020-12 applies the keywords beside a `$ref`, and 3.0 documents put
    /// `nullable` there: they were dropped (a nullable reference refused `null`, a
    /// `readOnly` one was asked of the model).
    #[test]
    fn keywords_beside_a_ref_apply_with_it() {
        let doc = parse(
            r##"{"openapi": "3.0.3", "paths": {"/t": {"post": {"operationId": "t",
                "requestBody": {"content": {"application/json": {"schema": {"type": "object",
                  "properties": {
                    "size": {"$ref": "#/components/schemas/Size", "nullable": true},
                    "plain": {"$ref": "#/components/schemas/Size"},
                    "named": {"$ref": "#/components/schemas/Size", "description": "the size",
                      "x-note": "dropped"}}}}}}}}},
              "components": {"schemas": {"Size": {"type": "string", "enum": ["s", "m"],
                "description": "a size"}}}}"##,
        )
        .unwrap();
        let body = &doc.operations[0].input_schema["properties"]["body"];
        let properties = &body["properties"];
        let size = json!({"type": "string", "enum": ["s", "m"], "description": "a size"});
        assert_eq!(properties["plain"], size, "{body}");
        // Only described: the description goes into the schema, not beside it.
        assert_eq!(
            properties["named"],
            json!({"type": "string", "enum": ["s", "m"], "description": "the size"}),
            "{body}"
        );
        assert_eq!(
            properties["size"],
            json!({"anyOf": [{"allOf": [size]}, {"type": "null"}]}),
            "{body}"
        );
        let validator = jsonschema::validator_for(body).unwrap();
        for (value, valid) in [
            (json!({"size": null}), true),
            (json!({"size": "m"}), true),
            (json!({"size": "xl"}), false),
            (json!({"plain": null}), false),
        ] {
            assert_eq!(validator.is_valid(&value), valid, "{value}");
        }

        let doc = parse(
            r##"{"openapi": "3.1.0", "paths": {"/t": {"post": {"operationId": "t",
                "requestBody": {"content": {"application/json": {"schema": {"type": "object",
                  "required": ["id", "name"],
                  "properties": {
                    "id": {"$ref": "#/components/schemas/Id", "readOnly": true},
                    "name": {"$ref": "#/components/schemas/Name", "maxLength": 3}}}}}}}}},
              "components": {"schemas": {"Id": {"type": "integer"},
                "Name": {"type": "string", "minLength": 1}}}}"##,
        )
        .unwrap();
        let op = &doc.operations[0];
        let body = &op.input_schema["properties"]["body"];
        assert!(body["properties"].get("id").is_none(), "{body}");
        assert_eq!(body["required"], json!(["name"]), "{body}");
        assert_eq!(op.read_only[0].given_in(&json!({"id": 1})).unwrap(), "id");
        assert_eq!(
            body["properties"]["name"],
            json!({"allOf": [{"type": "string", "minLength": 1}], "maxLength": 3}),
            "{body}"
        );
    }

    /// A property one `allOf` member marks `readOnly` leaves the `required` of every other
    /// member too: one that still required it made the operation impossible to call.
    #[test]
    fn a_read_only_property_is_required_by_no_member() {
        let doc = parse(
            r##"{"openapi": "3.1.0", "paths": {"/t": {"post": {"operationId": "t",
                "requestBody": {"required": true, "content": {"application/json": {"schema": {
                  "required": ["id"],
                  "allOf": [
                    {"$ref": "#/components/schemas/Entity"},
                    {"type": "object", "required": ["id", "name"],
                      "properties": {"name": {"type": "string"}}},
                    {"anyOf": [{"required": ["id"]}, {"required": ["name"]}]}]}}}}}}},
              "components": {"schemas": {"Entity": {"type": "object",
                "properties": {"id": {"type": "string", "readOnly": true}}}}}}"##,
        )
        .unwrap();
        let body = &doc.operations[0].input_schema["properties"]["body"];
        assert_eq!(body["required"], json!([]), "{body}");
        assert_eq!(body["allOf"][1]["required"], json!(["name"]), "{body}");
        assert_eq!(
            body["allOf"][2]["anyOf"][0]["required"],
            json!([]),
            "{body}"
        );
        let validator = jsonschema::validator_for(body).unwrap();
        assert!(validator.is_valid(&json!({"name": "x"})), "{body}");
    }

    /// YAML documents written by hand share parts with merge keys (`<<: *base`), a merge of
    /// a mapping that merges another too.
    #[test]
    fn yaml_merge_keys_are_applied() {
        let doc = parse(
            r##"
openapi: 3.0.3
info: {title: merged, version: "1"}
x-common:
  page: &page {name: page, in: query, schema: {type: integer}}
  limit: &limit
    <<: *page
    name: limit
  sized: &sized
    <<: *limit
    description: how many
paths:
  /items:
    get:
      operationId: list
      parameters:
        - <<: *page
        - <<: [*sized]
          required: true
"##,
        )
        .unwrap();
        let op = &doc.operations[0];
        let names: Vec<_> = op.parameters.iter().map(|p| p.name.as_str()).collect();
        assert_eq!(names, ["page", "limit"]);
        assert_eq!(
            op.input_schema["properties"]["limit"],
            json!({"type": "integer", "description": "how many"})
        );
        assert_eq!(op.input_schema["required"], json!(["limit"]));
        let err = parse("openapi: 3.0.3\na: {<<: 1}\n").unwrap_err();
        assert!(err.starts_with("not valid YAML: "), "{err}");
    }

    /// Header parameters that frame the message or manage the connection are the HTTP
    /// client's, not the model's: a `Content-Length` the model chose reached the wire.
    #[test]
    fn framing_headers_are_not_parameters() {
        let doc = parse(
            r##"{"openapi": "3.1.0", "paths": {"/t": {"get": {"operationId": "t",
                "parameters": [
                  {"name": "Host", "in": "header"},
                  {"name": "content-length", "in": "header"},
                  {"name": "Transfer-Encoding", "in": "header"},
                  {"name": "CONNECTION", "in": "header"},
                  {"name": "TE", "in": "header"},
                  {"name": "Upgrade", "in": "header"},
                  {"name": "Keep-Alive", "in": "header"},
                  {"name": "Expect", "in": "header"},
                  {"name": "X-Kept", "in": "header"},
                  {"name": "te", "in": "query"}]}}}}"##,
        )
        .unwrap();
        let op = &doc.operations[0];
        let kept: Vec<_> = op
            .parameters
            .iter()
            .map(|p| (p.name.as_str(), p.location))
            .collect();
        assert_eq!(
            kept,
            [("X-Kept", Location::Header), ("te", Location::Query)]
        );
        let properties: Vec<_> = op.input_schema["properties"]
            .as_object()
            .unwrap()
            .keys()
            .cloned()
            .collect();
        assert_eq!(properties, ["X-Kept", "te"]);
    }
}
