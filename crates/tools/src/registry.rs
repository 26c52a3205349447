use std::{collections::BTreeMap, sync::Arc};

use agentrt_core::{ToolSpec, Violation};

use crate::{Tool, ToolContext, ToolOutput};

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
}

/// Why a tool could not be registered.
#[derive(Debug, thiserror::Error)]
pub enum RegistryError {
    /// Two tools have the same name.
    #[error("tool {0:?} is registered twice")]
    Duplicate(String),
    /// A tool's input schema is not a valid JSON Schema.
    #[error("tool {tool:?} has an invalid input schema: {reason}")]
    InvalidSchema {
        /// The tool.
        tool: String,
        /// What the schema compiler said.
        reason: String,
    },
}

struct Registered {
    tool: Arc<dyn Tool>,
    validator: jsonschema::Validator,
}

/// The tools the executor serves, by name, each with its compiled argument validator.
#[derive(Default)]
pub struct ToolRegistry {
    tools: BTreeMap<String, Registered>,
}

impl ToolRegistry {
    /// An empty registry.
    pub fn new() -> Self {
        Self::default()
    }

    /// Adds a tool, compiling its input schema once.
    pub fn register(&mut self, tool: Arc<dyn Tool>) -> Result<(), RegistryError> {
        let spec = tool.spec();
        if self.tools.contains_key(&spec.name) {
            return Err(RegistryError::Duplicate(spec.name.clone()));
        }
        let validator = jsonschema::validator_for(&spec.input_schema).map_err(|e| {
            RegistryError::InvalidSchema {
                tool: spec.name.clone(),
                reason: e.to_string(),
            }
        })?;
        self.tools
            .insert(spec.name.clone(), Registered { tool, validator });
        Ok(())
    }

    /// Every tool's spec, ordered by name.
    pub fn specs(&self) -> impl Iterator<Item = &ToolSpec> {
        self.tools.values().map(|r| r.tool.spec())
    }

    /// Checks `arguments` against the tool's schema, then runs it.
    pub async fn execute(
        &self,
        name: &str,
        arguments: serde_json::Value,
        ctx: &ToolContext,
    ) -> Result<ToolOutput, ExecuteError> {
        let registered = self
            .tools
            .get(name)
            .ok_or_else(|| ExecuteError::NotFound(name.to_owned()))?;
        let violations: Vec<Violation> = registered
            .validator
            .iter_errors(&arguments)
            .flat_map(|error| violations_of(&error))
            .collect();
        if !violations.is_empty() {
            return Err(ExecuteError::InvalidArguments {
                tool: name.to_owned(),
                violations,
            });
        }
        Ok(registered.tool.call(arguments, ctx).await)
    }
}

/// The violations one schema error stands for, each naming the field a client should fix:
/// a missing or unexpected property is named itself, not the object that holds it.
fn violations_of(error: &jsonschema::ValidationError<'_>) -> Vec<Violation> {
    use jsonschema::error::ValidationErrorKind as Kind;
    let at = argument_path(error.instance_path().as_str());
    match error.kind() {
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
                .map(|name| {
                    Violation::new(
                        format!("{at}.{name}"),
                        "unexpected property: the tool's input schema does not allow it",
                    )
                })
                .collect()
        }
        _ => vec![Violation::new(at, error.to_string())],
    }
}

/// Turns a JSON pointer into the request's field path: `/items/0/name` becomes
/// `arguments.items[0].name`, and the root becomes `arguments`.
fn argument_path(pointer: &str) -> String {
    let mut path = String::from("arguments");
    for segment in pointer.split('/').skip(1) {
        let segment = segment.replace("~1", "/").replace("~0", "~");
        if !segment.is_empty() && segment.bytes().all(|b| b.is_ascii_digit()) {
            path.push('[');
            path.push_str(&segment);
            path.push(']');
        } else {
            path.push('.');
            path.push_str(&segment);
        }
    }
    path
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::builtin;
    use serde_json::json;

    fn registry() -> ToolRegistry {
        let mut registry = ToolRegistry::new();
        for tool in builtin::all() {
            registry.register(tool).unwrap();
        }
        registry
    }

    #[test]
    fn pointers_become_field_paths() {
        assert_eq!(argument_path(""), "arguments");
        assert_eq!(argument_path("/expression"), "arguments.expression");
        assert_eq!(argument_path("/items/0/a~1b"), "arguments.items[0].a/b");
    }

    #[tokio::test]
    async fn schema_violations_name_every_field() {
        let err = registry()
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

        let err = registry()
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
    async fn unknown_tools_are_not_found() {
        let err = registry()
            .execute("nope", json!({}), &ToolContext::default())
            .await
            .unwrap_err();
        assert_eq!(err, ExecuteError::NotFound("nope".into()));
    }

    #[test]
    fn duplicate_names_are_refused() {
        let mut registry = registry();
        let again = builtin::all().into_iter().next().unwrap();
        assert!(matches!(
            registry.register(again),
            Err(RegistryError::Duplicate(_))
        ));
    }

    #[test]
    fn specs_are_sorted_by_name() {
        let names: Vec<_> = registry().specs().map(|s| s.name.clone()).collect();
        let mut sorted = names.clone();
        sorted.sort();
        assert_eq!(names, sorted);
        assert!(names.contains(&"calculator".to_string()));
    }
}
