//! The catalogue: every toolset's tools under one namespace, as a snapshot that is
//! swapped whole when a list changes, so that calls in flight keep the one they started
//! with.

use std::{collections::BTreeMap, sync::Arc};

use agentrt_core::{ToolSpec, Violation};
use arc_swap::ArcSwap;
use tokio_util::sync::CancellationToken;
use tracing::{info, warn};

use crate::{CallError, Changes, Error, ListedTool, Result, ToolContext, ToolOutput, Toolset};

/// How deep a tool's input schema may nest.
const MAX_SCHEMA_DEPTH: usize = agentrt_core::MAX_JSON_DEPTH;

/// Why a call did not run.
#[derive(Debug, thiserror::Error, PartialEq)]
pub enum ExecuteError {
    /// No tool has this name.
    #[error("no tool named {0:?}")]
    NotFound(String),
    /// The arguments do not match the tool's input schema.
    #[error("arguments do not match the input schema of {tool:?}")]
    InvalidArguments {
        /// The tool called.
        tool: String,
        /// One entry per problem; fields are named `arguments.<path>`.
        violations: Vec<Violation>,
    },
    /// The tool's source cannot be reached now.
    #[error("tool {tool:?} is unavailable: source {source_name:?} {reason}")]
    Unavailable {
        /// The tool called.
        tool: String,
        /// Its source, as the config names it.
        source_name: String,
        /// What is wrong.
        reason: String,
        /// When the source may be back.
        retry_after: std::time::Duration,
        /// Whether the call reached the source (and so may have run) before it failed.
        sent: bool,
    },
}

struct Entry {
    listed: ListedTool,
    toolset: Arc<dyn Toolset>,
    validator: Arc<jsonschema::Validator>,
}

/// One version of the catalogue.
#[derive(Default)]
struct Snapshot {
    tools: BTreeMap<String, Entry>,
    /// Why tools were left out, each warned of when it first is (a rebuild comes at every
    /// change of any source's list, and would say it all again).
    left_out: std::collections::BTreeSet<String>,
}

/// Leaves a tool out of `snapshot` for `error`, warning unless `previous` did too.
fn leave_out(snapshot: &mut Snapshot, previous: Option<&Snapshot>, error: &Error) {
    let why = error.to_string();
    if !previous.is_some_and(|p| p.left_out.contains(&why)) {
        warn!(%error, "tool left out of the catalogue");
    }
    snapshot.left_out.insert(why);
}

/// Every tool on offer, by the name the catalogue offers it under, each with its compiled
/// argument validator.
pub struct Catalogue {
    toolsets: Vec<Arc<dyn Toolset>>,
    snapshot: ArcSwap<Snapshot>,
    changes: Changes,
}

impl Catalogue {
    /// Lists every toolset and builds the first snapshot. Two tools offered under one
    /// name (unless both come from one MCP server: the second is left out with a
    /// warning), or a built-in with an invalid schema, are errors naming both; a tool of
    /// an outside source whose schema does not compile is left out with a warning.
    pub async fn new(toolsets: Vec<Arc<dyn Toolset>>, changes: Changes) -> Result<Self> {
        let catalogue = Self {
            toolsets,
            snapshot: ArcSwap::from_pointee(Snapshot::default()),
            changes,
        };
        let snapshot = catalogue.build(None, true).await?;
        catalogue.snapshot.store(Arc::new(snapshot));
        Ok(catalogue)
    }

    /// Rebuilds the snapshot whenever a toolset says its list changed, until `stop`.
    pub async fn keep_fresh(&self, stop: CancellationToken) {
        loop {
            tokio::select! {
                () = stop.cancelled() => return,
                () = self.changes.changed() => {}
            }
            self.rebuild().await;
        }
    }

    /// Builds a new snapshot from the toolsets' current lists and swaps it in. At run
    /// time a clash is not fatal: the tool listed second is left out, with a warning.
    pub async fn rebuild(&self) {
        let previous = self.snapshot.load_full();
        match self.build(Some(&previous), false).await {
            Ok(snapshot) => {
                info!(tools = snapshot.tools.len(), "tool catalogue refreshed");
                self.snapshot.store(Arc::new(snapshot));
            }
            Err(error) => warn!(%error, "tool catalogue not refreshed"),
        }
    }

    async fn build(&self, previous: Option<&Snapshot>, strict: bool) -> Result<Snapshot> {
        let lists = futures_util::future::join_all(self.toolsets.iter().map(|t| t.list())).await;
        let mut snapshot = Snapshot::default();
        for (toolset, listed) in self.toolsets.iter().zip(lists) {
            let listed = match listed {
                Ok(listed) => listed,
                Err(error) if !strict => {
                    warn!(source = toolset.name(), %error, "cannot list tools");
                    continue;
                }
                Err(error) => return Err(error),
            };
            for tool in listed {
                let name = tool.spec.name.clone();
                if let Some(first) = snapshot.tools.get(&name) {
                    let error = Error::Duplicate {
                        name,
                        first: first.listed.origin.clone(),
                        second: tool.origin.clone(),
                    };
                    // Two tools of one MCP server (`a.b` and `a_b`, or names alike in
                    // their first 55 characters and digest) are that server's doing: one third-party
                    // server does not stop the executor. Tools of two sources, or of a
                    // document the operator gave, are a config error: the start stops.
                    let one_server =
                        Arc::ptr_eq(&first.toolset, toolset) && toolset.lists_at_run_time();
                    if strict && !one_server {
                        return Err(error);
                    }
                    leave_out(&mut snapshot, previous, &error);
                    continue;
                }
                let depth = agentrt_core::json_depth(&tool.spec.input_schema);
                if depth > MAX_SCHEMA_DEPTH {
                    // Offered, it would make the whole list unreadable to gRPC clients.
                    let error = Error::InvalidSchema {
                        tool: tool.origin.clone(),
                        reason: format!(
                            "it nests {depth} levels deep, more than {MAX_SCHEMA_DEPTH}: \
                             Protobuf decoders (100 levels) could not read the tool list"
                        ),
                    };
                    if toolset.name() == crate::builtin::SOURCE_NAME {
                        return Err(error);
                    }
                    leave_out(&mut snapshot, previous, &error);
                    continue;
                }
                let kind = tool.spec.input_schema.get("type");
                if !tool.spec.input_schema.is_object()
                    || kind.is_some_and(|kind| kind.as_str() != Some("object"))
                {
                    // Every call would fail (arguments are an object), and model APIs
                    // refuse such a function schema.
                    let error = Error::InvalidSchema {
                        tool: tool.origin.clone(),
                        reason: match kind {
                            Some(kind) => format!(
                                "its type is {kind}, not \"object\": a tool's arguments are \
                                 an object, and model APIs refuse other function schemas"
                            ),
                            None => "it is not a JSON object".into(),
                        },
                    };
                    if toolset.name() == crate::builtin::SOURCE_NAME {
                        return Err(error);
                    }
                    leave_out(&mut snapshot, previous, &error);
                    continue;
                }
                let reused = previous
                    .and_then(|p| p.tools.get(&name))
                    .filter(|e| e.listed.spec.input_schema == tool.spec.input_schema)
                    .map(|e| e.validator.clone());
                let validator = match reused {
                    Some(validator) => validator,
                    None => match jsonschema::validator_for(&tool.spec.input_schema) {
                        Ok(validator) => Arc::new(validator),
                        Err(e) => {
                            let error = Error::InvalidSchema {
                                tool: tool.origin.clone(),
                                reason: e.to_string(),
                            };
                            if toolset.name() == crate::builtin::SOURCE_NAME {
                                return Err(error);
                            }
                            leave_out(&mut snapshot, previous, &error);
                            continue;
                        }
                    },
                };
                snapshot.tools.insert(
                    name,
                    Entry {
                        listed: tool,
                        toolset: toolset.clone(),
                        validator,
                    },
                );
            }
        }
        Ok(snapshot)
    }

    /// Every tool's spec, ordered by name.
    pub fn specs(&self) -> Vec<ToolSpec> {
        self.snapshot
            .load()
            .tools
            .values()
            .map(|e| e.listed.spec.clone())
            .collect()
    }

    /// Checks `arguments` against the tool's schema, then runs it.
    pub async fn execute(
        &self,
        name: &str,
        arguments: serde_json::Value,
        ctx: &ToolContext,
    ) -> Result<ToolOutput, ExecuteError> {
        // Holds this version of the catalogue for the call, however it changes meanwhile.
        let snapshot = self.snapshot.load_full();
        let entry = snapshot
            .tools
            .get(name)
            .ok_or_else(|| self.not_listed(name))?;
        // The first violations are named (a status carries a few dozen), the rest counted:
        // arguments with a million wrong items cost no million messages.
        let mut violations: Vec<Violation> = Vec::new();
        let mut left_out = 0usize;
        for error in entry.validator.iter_errors(&arguments) {
            let room = MAX_VIOLATIONS.saturating_sub(violations.len());
            let (named, more) = violations_of(&error, &arguments, room);
            violations.extend(named);
            left_out = left_out.saturating_add(more);
        }
        if left_out > 0 {
            violations.push(Violation::new(
                "arguments",
                format!("and {left_out} more violations, left out"),
            ));
        }
        if !violations.is_empty() {
            return Err(ExecuteError::InvalidArguments {
                tool: name.to_owned(),
                violations,
            });
        }
        entry
            .toolset
            .call(&entry.listed.source_name, arguments, ctx)
            .await
            .map_err(|error| match error {
                CallError::Unavailable {
                    source_name,
                    reason,
                    retry_after,
                    sent,
                } => ExecuteError::Unavailable {
                    tool: name.to_owned(),
                    source_name,
                    reason,
                    retry_after,
                    sent,
                },
                CallError::Gone(_) => ExecuteError::NotFound(name.to_owned()),
            })
    }

    /// Why no listed tool is `name`: it is not found, unless it is named as a tool of a
    /// source that is down (one not connected yet lists nothing): then it is unavailable.
    fn not_listed(&self, name: &str) -> ExecuteError {
        // The source whose name is the longest prefix (`a__b` rather than `a`).
        let down = self
            .toolsets
            .iter()
            .filter(|toolset| {
                name.strip_prefix(toolset.name())
                    .is_some_and(|rest| rest.starts_with("__"))
            })
            .max_by_key(|toolset| toolset.name().len())
            .and_then(|toolset| toolset.down());
        match down {
            Some(CallError::Unavailable {
                source_name,
                reason,
                retry_after,
                ..
            }) => ExecuteError::Unavailable {
                tool: name.to_owned(),
                source_name,
                reason: format!("{reason}; its tools are known once it is up"),
                retry_after,
                sent: false,
            },
            _ => ExecuteError::NotFound(name.to_owned()),
        }
    }

    /// Stops every toolset: child processes exit, connections close.
    pub async fn shutdown(&self) {
        futures_util::future::join_all(self.toolsets.iter().map(|t| t.shutdown())).await;
    }
}

/// The violations one schema error stands for, each naming the field a client should fix:
/// a missing or unexpected property is named itself, not the object that holds it. At most
/// `room` are made; the others are counted.
fn violations_of(
    error: &jsonschema::ValidationError<'_>,
    arguments: &serde_json::Value,
    room: usize,
) -> (Vec<Violation>, usize) {
    use jsonschema::error::ValidationErrorKind as Kind;
    let count = match error.kind() {
        Kind::AdditionalProperties { unexpected } | Kind::UnevaluatedProperties { unexpected } => {
            unexpected.len()
        }
        _ => 1,
    };
    if room == 0 {
        return (Vec::new(), count);
    }
    let at = argument_path(error.instance_path().as_str(), arguments);
    let named = match error.kind() {
        Kind::Required { property } => {
            let name = property
                .as_str()
                .map_or_else(|| property.to_string(), str::to_owned);
            vec![Violation::new(
                format!("{at}.{name}"),
                "required property is missing",
            )]
        }
        Kind::AdditionalProperties { unexpected } | Kind::UnevaluatedProperties { unexpected } => {
            unexpected
                .iter()
                .take(room)
                .map(|name| {
                    Violation::new(
                        format!("{at}.{name}"),
                        "unexpected property: the tool's input schema does not allow it",
                    )
                })
                .collect()
        }
        _ => vec![Violation::new(at, error.to_string())],
    };
    let more = count.saturating_sub(named.len());
    (named, more)
}

/// Violations of a call's arguments named one by one; the rest are counted.
const MAX_VIOLATIONS: usize = 50;

/// Turns a JSON pointer into `arguments`' field path: `/items/0/name` becomes
/// `arguments.items[0].name`, and the root becomes `arguments`. A segment is an index
/// where `arguments` holds an array there (a property may be named `0` too).
fn argument_path(pointer: &str, arguments: &serde_json::Value) -> String {
    let mut path = String::from("arguments");
    let mut at = Some(arguments);
    for segment in pointer.split('/').skip(1) {
        let segment = segment.replace("~1", "/").replace("~0", "~");
        at = match at {
            Some(serde_json::Value::Array(items)) => {
                path.push('[');
                path.push_str(&segment);
                path.push(']');
                segment.parse::<usize>().ok().and_then(|i| items.get(i))
            }
            node => {
                path.push('.');
                path.push_str(&segment);
                node.and_then(|node| node.get(&segment))
            }
        };
    }
    path
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::builtin;
    use serde_json::json;

    async fn catalogue() -> Catalogue {
        Catalogue::new(
            vec![Arc::new(builtin::Builtins::all()) as Arc<dyn Toolset>],
            Changes::new(),
        )
        .await
        .unwrap()
    }

    #[test]
    fn pointers_become_field_paths() {
        let arguments = json!({"expression": "1", "items": [{"a/b": 1}], "0": {"1": [2]}});
        assert_eq!(argument_path("", &arguments), "arguments");
        assert_eq!(
            argument_path("/expression", &arguments),
            "arguments.expression"
        );
        assert_eq!(
            argument_path("/items/0/a~1b", &arguments),
            "arguments.items[0].a/b"
        );
        // Properties named with digits are properties, not indexes.
        assert_eq!(argument_path("/0/1/0", &arguments), "arguments.0.1[0]");
    }

    #[tokio::test]
    async fn schema_violations_name_every_field() {
        let err = catalogue()
            .await
            .execute(
                "calculator",
                json!({"expression": 5, "extra": true}),
                &ToolContext::default(),
            )
            .await
            .unwrap_err();
        let ExecuteError::InvalidArguments { violations, .. } = err else {
            panic!("expected invalid arguments, got {err:?}");
        };
        let fields: Vec<_> = violations.iter().map(|v| v.field.as_str()).collect();
        assert!(fields.contains(&"arguments.expression"), "{violations:?}");
        assert!(
            fields.contains(&"arguments.extra"),
            "the unexpected property is named: {violations:?}"
        );

        let err = catalogue()
            .await
            .execute("calculator", json!({}), &ToolContext::default())
            .await
            .unwrap_err();
        let ExecuteError::InvalidArguments { violations, .. } = err else {
            panic!("expected invalid arguments, got {err:?}");
        };
        assert_eq!(
            violations,
            [Violation::new(
                "arguments.expression",
                "required property is missing"
            )]
        );
    }

    #[tokio::test]
    async fn a_flood_of_violations_is_named_in_part_and_counted() {
        let mut arguments = serde_json::Map::new();
        arguments.insert("expression".into(), json!("1"));
        for i in 0..10_000 {
            arguments.insert(format!("k{i}"), json!(null));
        }
        let err = catalogue()
            .await
            .execute("calculator", arguments.into(), &ToolContext::default())
            .await
            .unwrap_err();
        let ExecuteError::InvalidArguments { violations, .. } = err else {
            panic!("expected invalid arguments, got {err:?}");
        };
        assert_eq!(violations.len(), MAX_VIOLATIONS + 1);
        assert_eq!(
            violations.last().unwrap(),
            &Violation::new(
                "arguments",
                format!("and {} more violations, left out", 10_000 - MAX_VIOLATIONS)
            )
        );
    }

    /// A source offering a tool `shallow` and a tool `deep` whose schema nests 30 levels.
    struct Nested;

    #[async_trait::async_trait]
    impl Toolset for Nested {
        fn name(&self) -> &str {
            "nested"
        }

        async fn list(&self) -> Result<Vec<ListedTool>> {
            let mut deep = json!({"type": "string"});
            for _ in 0..15 {
                deep = json!({"type": "object", "properties": {"next": deep}});
            }
            Ok([("shallow", json!({"type": "object"})), ("deep", deep)]
                .into_iter()
                .map(|(name, schema)| ListedTool {
                    spec: ToolSpec {
                        name: format!("nested__{name}"),
                        description: String::new(),
                        input_schema: schema.into(),
                        source: agentrt_core::ToolSource::Mcp,
                    },
                    source_name: name.to_owned(),
                    origin: format!("MCP server \"nested\", tool {name:?}"),
                })
                .collect())
        }

        async fn call(
            &self,
            _: &str,
            _: serde_json::Value,
            _: &ToolContext,
        ) -> std::result::Result<ToolOutput, CallError> {
            Ok(ToolOutput::default())
        }

        async fn refresh(&self) -> Result<()> {
            Ok(())
        }
    }

    /// A source that never connected: it lists nothing yet.
    struct Down;

    #[async_trait::async_trait]
    impl Toolset for Down {
        fn name(&self) -> &str {
            "late"
        }

        async fn list(&self) -> Result<Vec<ListedTool>> {
            Ok(Vec::new())
        }

        async fn call(
            &self,
            tool: &str,
            _: serde_json::Value,
            _: &ToolContext,
        ) -> std::result::Result<ToolOutput, CallError> {
            Err(CallError::Gone(tool.to_owned()))
        }

        async fn refresh(&self) -> Result<()> {
            Ok(())
        }

        fn down(&self) -> Option<CallError> {
            Some(CallError::Unavailable {
                source_name: "late".into(),
                reason: "MCP server \"late\" is down: not connected yet".into(),
                retry_after: std::time::Duration::from_secs(4),
                sent: false,
            })
        }
    }

    #[tokio::test]
    async fn a_tool_of_a_source_that_is_down_is_unavailable_naming_it() {
        let catalogue = Catalogue::new(vec![Arc::new(Down) as Arc<dyn Toolset>], Changes::new())
            .await
            .unwrap();
        let err = catalogue
            .execute("late__hello", json!({}), &ToolContext::default())
            .await
            .unwrap_err();
        let ExecuteError::Unavailable {
            source_name,
            reason,
            retry_after,
            ..
        } = &err
        else {
            panic!("{err:?}");
        };
        assert_eq!(source_name, "late");
        assert_eq!(*retry_after, std::time::Duration::from_secs(4));
        assert!(reason.contains("\"late\" is down"), "{reason}");
        for name in ["lately__hello", "other__hello", "late"] {
            let err = catalogue
                .execute(name, json!({}), &ToolContext::default())
                .await
                .unwrap_err();
            assert_eq!(err, ExecuteError::NotFound(name.into()));
        }
    }

    #[tokio::test]
    async fn a_schema_too_deep_for_protobuf_decoders_is_left_out_alone() {
        let catalogue = Catalogue::new(vec![Arc::new(Nested) as Arc<dyn Toolset>], Changes::new())
            .await
            .unwrap();
        let names: Vec<String> = catalogue.specs().into_iter().map(|s| s.name).collect();
        assert_eq!(names, ["nested__shallow"]);
    }

    #[tokio::test]
    async fn unknown_tools_are_not_found() {
        let err = catalogue()
            .await
            .execute("nope", json!({}), &ToolContext::default())
            .await
            .unwrap_err();
        assert_eq!(err, ExecuteError::NotFound("nope".into()));
    }

    #[tokio::test]
    async fn duplicate_names_are_refused_naming_both() {
        let toolsets: Vec<Arc<dyn Toolset>> = vec![
            Arc::new(builtin::Builtins::all()),
            Arc::new(builtin::Builtins::named(&["calculator"]).unwrap()),
        ];
        let Err(error) = Catalogue::new(toolsets, Changes::new()).await else {
            panic!("a duplicate must be refused");
        };
        let message = error.to_string();
        assert!(matches!(error, Error::Duplicate { .. }), "{message}");
        assert_eq!(
            message,
            "tool name \"calculator\" is offered twice: by built-in tool \"calculator\" and by \
             built-in tool \"calculator\""
        );
    }

    #[tokio::test]
    async fn specs_are_sorted_by_name() {
        let names: Vec<_> = catalogue()
            .await
            .specs()
            .into_iter()
            .map(|s| s.name)
            .collect();
        let mut sorted = names.clone();
        sorted.sort();
        assert_eq!(names, sorted);
        assert!(names.contains(&"calculator".to_string()));
    }
}
