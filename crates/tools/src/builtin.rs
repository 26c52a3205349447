//! The tools built into the tool executor, offered under their bare names.

use std::{collections::BTreeMap, sync::Arc, time::Duration};

use agentrt_core::{ToolSource, ToolSpec};
use async_trait::async_trait;
use serde_json::json;

use crate::{
    CallError, Error, ListedTool, Result, Tool, ToolContext, ToolOutput, Toolset, calculator,
};

/// Names of the built-in tools, for configuration.
pub const NAMES: [&str; 3] = ["calculator", "current_time", "sleep"];

/// The name of the built-ins' toolset, in logs and errors.
pub const SOURCE_NAME: &str = "builtin";

/// The built-in tools as a toolset.
pub struct Builtins {
    tools: BTreeMap<String, Arc<dyn Tool>>,
}

impl Builtins {
    /// Every built-in tool.
    pub fn all() -> Self {
        Self {
            tools: all()
                .into_iter()
                .map(|t| (t.spec().name.clone(), t))
                .collect(),
        }
    }

    /// The built-in tools named, each once.
    pub fn named(names: &[impl AsRef<str>]) -> Result<Self> {
        let mut tools = BTreeMap::new();
        for name in names {
            let name = name.as_ref();
            let tool = by_name(name).ok_or_else(|| {
                Error::source(
                    SOURCE_NAME,
                    format!("unknown tool {name:?}; known: {}", NAMES.join(", ")),
                )
            })?;
            tools.insert(name.to_owned(), tool);
        }
        Ok(Self { tools })
    }
}

#[async_trait]
impl Toolset for Builtins {
    fn name(&self) -> &str {
        SOURCE_NAME
    }

    async fn list(&self) -> Result<Vec<ListedTool>> {
        Ok(self
            .tools
            .iter()
            .map(|(name, tool)| ListedTool {
                spec: tool.spec().clone(),
                source_name: name.clone(),
                origin: format!("built-in tool {name:?}"),
            })
            .collect())
    }

    async fn call(
        &self,
        tool: &str,
        arguments: serde_json::Value,
        ctx: &ToolContext,
    ) -> Result<ToolOutput, CallError> {
        let tool = self
            .tools
            .get(tool)
            .ok_or_else(|| CallError::Gone(tool.to_owned()))?;
        Ok(tool.call(arguments, ctx).await)
    }

    async fn refresh(&self) -> Result<()> {
        Ok(())
    }
}

/// Every built-in tool.
pub fn all() -> Vec<Arc<dyn Tool>> {
    NAMES.iter().filter_map(|name| by_name(name)).collect()
}

/// The built-in tool called `name`, if there is one.
pub fn by_name(name: &str) -> Option<Arc<dyn Tool>> {
    match name {
        "calculator" => Some(Arc::new(Calculator::new())),
        "current_time" => Some(Arc::new(CurrentTime::new())),
        "sleep" => Some(Arc::new(Sleep::new())),
        _ => None,
    }
}

fn builtin_spec(name: &str, description: &str, input_schema: serde_json::Value) -> ToolSpec {
    ToolSpec {
        name: name.into(),
        description: description.into(),
        input_schema: input_schema.into(),
        source: ToolSource::Builtin,
    }
}

/// Evaluates arithmetic expressions.
pub struct Calculator {
    spec: ToolSpec,
}

impl Calculator {
    fn new() -> Self {
        Self {
            spec: builtin_spec(
                "calculator",
                "Evaluates an arithmetic expression and returns the number. Supports + - * / \
                 % ^ (power), parentheses, unary minus and decimals, e.g. \"(2 + 3) * 4.5\".",
                json!({
                    "type": "object",
                    "properties": {
                        "expression": {
                            "type": "string",
                            "description": "The expression to evaluate (at most 10000 bytes), e.g. \"2 ^ 10 / 4\".",
                            "minLength": 1
                        }
                    },
                    "required": ["expression"],
                    "additionalProperties": false
                }),
            ),
        }
    }
}

#[async_trait]
impl Tool for Calculator {
    fn spec(&self) -> &ToolSpec {
        &self.spec
    }

    async fn call(&self, arguments: serde_json::Value, _ctx: &ToolContext) -> ToolOutput {
        let expression = arguments["expression"].as_str().unwrap_or_default();
        // The bound lives here, not in the schema: some model servers (llama.cpp) refuse
        // to compile schemas with large `maxLength`s into grammars.
        if expression.len() > calculator::MAX_LEN {
            return ToolOutput::error(format!(
                "the expression is {} bytes long; at most {} are accepted",
                expression.len(),
                calculator::MAX_LEN
            ));
        }
        match calculator::evaluate(expression) {
            Ok(value) => ToolOutput {
                text: calculator::format_number(value),
                // -0 is 0, in the structured output as in the text.
                structured: Some(json!(if value == 0.0 { 0.0 } else { value })),
                ..ToolOutput::default()
            },
            Err(e) => ToolOutput::error(format!("cannot evaluate {expression:?}: {e}")),
        }
    }
}

/// Tells the current time, in UTC or an IANA time zone.
pub struct CurrentTime {
    spec: ToolSpec,
}

impl CurrentTime {
    fn new() -> Self {
        Self {
            spec: builtin_spec(
                "current_time",
                "Returns the current date and time, in UTC or in the given IANA time zone \
                 (e.g. \"Europe/Paris\").",
                json!({
                    "type": "object",
                    "properties": {
                        "timezone": {
                            "type": "string",
                            "description": "IANA time zone name; UTC when omitted.",
                            "minLength": 1,
                            "maxLength": 64
                        }
                    },
                    "additionalProperties": false
                }),
            ),
        }
    }
}

#[async_trait]
impl Tool for CurrentTime {
    fn spec(&self) -> &ToolSpec {
        &self.spec
    }

    async fn call(&self, arguments: serde_json::Value, _ctx: &ToolContext) -> ToolOutput {
        let name = arguments["timezone"].as_str().unwrap_or("UTC");
        // The zone database may read a file, or walk its directory for a name it does not
        // know, under a lock of its own: not on a worker that serves other calls.
        let owned = name.to_owned();
        let found = tokio::task::spawn_blocking(move || jiff::tz::TimeZone::get(&owned)).await;
        let zone = match found {
            Ok(Ok(zone)) => zone,
            Ok(Err(_)) | Err(_) => {
                return ToolOutput::error(format!(
                    "unknown time zone {name:?}: use an IANA name such as \"UTC\" or \
                     \"America/New_York\""
                ));
            }
        };
        let now = jiff::Timestamp::now().to_zoned(zone);
        let offset = now.offset();
        let value = json!({
            "datetime": now.strftime("%Y-%m-%dT%H:%M:%S%.3f%:z").to_string(),
            "timezone": name,
            "utc_offset": offset.to_string(),
            "weekday": now.strftime("%A").to_string(),
            "unix_seconds": now.timestamp().as_second(),
        });
        ToolOutput {
            text: format!(
                "{} ({name}, {})",
                value["datetime"].as_str().unwrap_or_default(),
                value["weekday"].as_str().unwrap_or_default()
            ),
            structured: Some(value),
            ..ToolOutput::default()
        }
    }
}

/// Waits, then reports how long it waited: for demos of timeouts and cancellation.
pub struct Sleep {
    spec: ToolSpec,
}

impl Sleep {
    /// Longest wait accepted, in seconds.
    const MAX_SECONDS: f64 = 300.0;

    fn new() -> Self {
        Self {
            spec: builtin_spec(
                "sleep",
                "Waits the given number of seconds (at most 300), then returns. Useful to \
                 try out timeouts and cancellation.",
                json!({
                    "type": "object",
                    "properties": {
                        "seconds": {
                            "type": "number",
                            "description": "How long to wait, in seconds.",
                            "minimum": 0,
                            "maximum": Self::MAX_SECONDS
                        }
                    },
                    "required": ["seconds"],
                    "additionalProperties": false
                }),
            ),
        }
    }
}

#[async_trait]
impl Tool for Sleep {
    fn spec(&self) -> &ToolSpec {
        &self.spec
    }

    async fn call(&self, arguments: serde_json::Value, ctx: &ToolContext) -> ToolOutput {
        let seconds = arguments["seconds"]
            .as_f64()
            .unwrap_or(0.0)
            .clamp(0.0, Self::MAX_SECONDS);
        tokio::select! {
            () = tokio::time::sleep(Duration::from_secs_f64(seconds)) => {
                ToolOutput::json(json!({ "slept_seconds": seconds }))
            }
            () = ctx.cancel.cancelled() => ToolOutput::stopped(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    async fn call(name: &str, arguments: serde_json::Value) -> ToolOutput {
        by_name(name)
            .unwrap()
            .call(arguments, &ToolContext::default())
            .await
    }

    #[tokio::test]
    async fn calculator_returns_the_number() {
        let out = call("calculator", json!({"expression": "(2 + 3) * 4.5"})).await;
        assert!(!out.is_error);
        assert_eq!(out.text, "22.5");
        assert_eq!(out.structured, Some(json!(22.5)));
        // Negative zero is zero, in the structured output as in the text.
        let out = call("calculator", json!({"expression": "0 * -1"})).await;
        let structured = out.structured.map(|v| v.to_string());
        assert_eq!(
            (out.text.as_str(), structured.as_deref()),
            ("0", Some("0.0"))
        );
    }

    #[tokio::test]
    async fn calculator_errors_are_tool_errors() {
        let out = call("calculator", json!({"expression": "1/0"})).await;
        assert!(out.is_error);
        assert!(out.text.contains("division by zero"), "{}", out.text);
    }

    #[tokio::test]
    async fn calculator_bounds_the_expression_in_the_tool_not_the_schema() {
        let tool = by_name("calculator").unwrap();
        let schema = &tool.spec().input_schema["properties"]["expression"];
        assert!(schema.get("maxLength").is_none(), "{schema}");
        let long = format!("1{}", "+1".repeat(calculator::MAX_LEN));
        let out = call("calculator", json!({ "expression": long })).await;
        assert!(out.is_error);
        assert!(
            out.text.contains("at most 10000 are accepted"),
            "{}",
            out.text
        );
        assert!(out.text.len() < 200, "the expression is not echoed back");
        let at_limit = format!("1{}", "+1".repeat((calculator::MAX_LEN - 1) / 2));
        let out = call("calculator", json!({ "expression": at_limit })).await;
        assert!(!out.is_error, "{}", out.text);
    }

    #[tokio::test]
    async fn current_time_honours_the_zone() {
        let out = call("current_time", json!({"timezone": "Asia/Tokyo"})).await;
        assert!(!out.is_error, "{}", out.text);
        let value = out.structured.unwrap();
        assert_eq!(value["utc_offset"], "+09");
        assert!(value["datetime"].as_str().unwrap().ends_with("+09:00"));
        let utc = call("current_time", json!({})).await.structured.unwrap();
        assert_eq!(utc["timezone"], "UTC");
    }

    #[tokio::test]
    async fn current_time_rejects_unknown_zones() {
        let out = call("current_time", json!({"timezone": "Mars/Olympus"})).await;
        assert!(out.is_error);
        assert!(out.text.contains("Mars/Olympus"));
    }

    #[tokio::test(start_paused = true)]
    async fn sleep_stops_when_cancelled() {
        let ctx = ToolContext::default();
        let cancel = ctx.cancel.clone();
        let tool = by_name("sleep").unwrap();
        let started = tokio::time::Instant::now();
        let call = tool.call(json!({"seconds": 100}), &ctx);
        let canceller = async {
            tokio::time::sleep(Duration::from_secs(1)).await;
            cancel.cancel();
        };
        let (out, ()) = tokio::join!(call, canceller);
        assert!(out.is_error);
        assert_eq!(started.elapsed(), Duration::from_secs(1));
    }
}
