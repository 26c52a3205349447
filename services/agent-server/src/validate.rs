//! Checks an `AgentConfig` from the wire: applies defaults, then collects every violation
//! with the path of its field, against the tools the tool executor offers (its catalogue,
//! kept for a while rather than asked for on every check).

use std::{
    collections::HashMap,
    sync::{Arc, PoisonError},
    time::Duration,
};

use tokio::time::Instant;

use agentrt::v1;
use agentrt_core::{ToolCatalog, ToolServiceError, ToolSpec, Violation, limits};
use agentrt_models::ProviderRegistry;

/// The shortest time limit a config may set: timers count whole milliseconds.
const MIN_TIMEOUT: Duration = Duration::from_millis(1);

/// The outcome of a check.
#[derive(Debug, Clone, PartialEq)]
pub struct Checked {
    /// The config with defaults applied, as far as they could be.
    pub effective: v1::AgentConfig,
    /// Every problem, in field order.
    pub violations: Vec<Violation>,
    /// Specs of the config's tools that the tool executor offers, in config order.
    pub tools: Vec<ToolSpec>,
}

/// Checks configs against this server's providers and the tool executor's tools.
#[derive(Clone)]
pub struct ConfigValidator {
    providers: Arc<ProviderRegistry>,
    tools: Arc<CatalogCache>,
}

/// How long the tool executor's catalogue is used before it is asked again.
const CATALOG_MAX_AGE: Duration = Duration::from_secs(30);
/// How soon a config naming a tool the kept catalogue lacks makes it be asked again: a
/// tool just added is seen at once, and configs full of unknown names cannot make every
/// check a call.
const CATALOG_MIN_AGE: Duration = Duration::from_secs(1);

/// The tool executor's catalogue as validation uses it: kept for [`CATALOG_MAX_AGE`], and
/// asked again sooner when a config names a tool it lacks. A fresh enough copy is answered
/// at once, even while the catalogue is being asked for again; one caller asks at a time,
/// and the others that were waiting take its answer, a failure included (rather than each
/// asking again, one after the other, of a tool executor that does not answer).
pub struct CatalogCache {
    source: Arc<dyn ToolCatalog>,
    /// The last catalogue, and when it was listed.
    kept: std::sync::Mutex<Option<(Instant, Arc<Vec<ToolSpec>>)>>,
    /// The last failure to list it, and when it ended.
    failed: std::sync::Mutex<Option<(Instant, ToolServiceError)>>,
    /// Held by the one caller asking the tool executor.
    asking: tokio::sync::Mutex<()>,
}

impl CatalogCache {
    /// A cache in front of `source`.
    pub fn new(source: Arc<dyn ToolCatalog>) -> Self {
        Self {
            source,
            kept: std::sync::Mutex::new(None),
            failed: std::sync::Mutex::new(None),
            asking: tokio::sync::Mutex::new(()),
        }
    }

    /// The kept catalogue when it is fresh enough for a config that names `wanted`, or
    /// was listed after `since`.
    fn fresh(&self, wanted: &[&str], since: Option<Instant>) -> Option<Arc<Vec<ToolSpec>>> {
        let kept = self.kept.lock().unwrap_or_else(PoisonError::into_inner);
        let (at, tools) = kept.as_ref()?;
        if since.is_some_and(|since| *at >= since) {
            return Some(tools.clone());
        }
        let age = at.elapsed();
        let has_all = || {
            wanted
                .iter()
                .all(|name| tools.iter().any(|t| t.name == *name))
        };
        (age < CATALOG_MAX_AGE && (age < CATALOG_MIN_AGE || has_all())).then(|| tools.clone())
    }

    /// The catalogue, fresh enough for a config that names `wanted`.
    pub async fn offering(&self, wanted: &[&str]) -> Result<Arc<Vec<ToolSpec>>, ToolServiceError> {
        if let Some(tools) = self.fresh(wanted, None) {
            return Ok(tools);
        }
        let waited_from = Instant::now();
        let _asking = self.asking.lock().await;
        // Another caller asked while this one waited: its answer is this one's.
        if let Some(tools) = self.fresh(wanted, Some(waited_from)) {
            return Ok(tools);
        }
        if let Some((at, error)) = &*self.failed.lock().unwrap_or_else(PoisonError::into_inner)
            && *at >= waited_from
        {
            return Err(error.clone());
        }
        match self.source.list_tools().await {
            Ok(tools) => {
                let tools = Arc::new(tools);
                *self.kept.lock().unwrap_or_else(PoisonError::into_inner) =
                    Some((Instant::now(), tools.clone()));
                Ok(tools)
            }
            Err(error) => {
                *self.failed.lock().unwrap_or_else(PoisonError::into_inner) =
                    Some((Instant::now(), error.clone()));
                Err(error)
            }
        }
    }
}

impl ConfigValidator {
    /// A validator for this server.
    pub fn new(providers: Arc<ProviderRegistry>, tools: Arc<dyn ToolCatalog>) -> Self {
        Self {
            providers,
            tools: Arc::new(CatalogCache::new(tools)),
        }
    }

    /// Checks `config`; `None` is reported as a missing config. Fails only when the tool
    /// executor must be asked and cannot answer.
    pub async fn check(
        &self,
        config: Option<&v1::AgentConfig>,
    ) -> Result<Checked, ToolServiceError> {
        // A missing config is the one problem reported; its effective config still shows
        // the defaults an empty one gets.
        let missing = config.is_none();
        let mut effective = config.cloned().unwrap_or_default();
        let mut check = Check::default();
        check.name(&effective.name);
        check.system_prompt(&effective.system_prompt);
        self.model(&mut check, &mut effective);
        self.rerank_model(&mut check, &mut effective);
        check.strategy(&mut effective.strategy);
        check.max_iterations(&mut effective.max_iterations);
        // Over the bound, a list is reported by its length alone: its items are not looked
        // at (a request of 4 MiB of names would otherwise cost a violation each).
        let tools_fit = check.count("tools", effective.tools.len(), 0);
        let client_tools_fit = tools_fit
            && check.count(
                "client_tools",
                effective.tools.len(),
                effective.client_tools.len(),
            );
        let (wanted, mut tool_violations) = if tools_fit {
            check.tool_names(&effective.tools)
        } else {
            Default::default()
        };
        let mut tools = Vec::new();
        if !wanted.is_empty() {
            let names: Vec<&str> = wanted.iter().map(|(_, name)| name.as_str()).collect();
            let offered = self.tools.offering(&names).await?;
            tools = wanted
                .iter()
                .filter_map(|(_, name)| offered.iter().find(|t| &t.name == name).cloned())
                .collect();
            let names: Vec<&str> = offered.iter().map(|t| t.name.as_str()).collect();
            for (index, name) in wanted {
                if !names.contains(&name.as_str()) {
                    // A source's tools are listed once it is up: one that is still
                    // starting, or down, offers none. Said first: a long description is
                    // cut at its end.
                    let source_down =
                        name.split_once("__")
                            .map(|(source, _)| source)
                            .filter(|source| {
                                !names.iter().any(|offered| {
                                    offered
                                        .strip_prefix(source)
                                        .is_some_and(|rest| rest.starts_with("__"))
                                })
                            });
                    let description = match source_down {
                        Some(source) => format!(
                            "tool {name:?} is not offered by the tool executor, nor any tool \
                             of source {source:?}: if it is an MCP server still starting or \
                             down, try again once ListTools lists its tools (offered: {})",
                            list_or_none(&names)
                        ),
                        None => format!(
                            "tool {name:?} is not offered by the tool executor (offered: {})",
                            list_or_none(&names)
                        ),
                    };
                    tool_violations.push((
                        index,
                        Violation::new(format!("tools[{index}].name"), description),
                    ));
                }
            }
        }
        tool_violations.sort_by_key(|(index, _)| *index);
        check
            .violations
            .extend(tool_violations.into_iter().map(|(_, v)| v));
        if client_tools_fit {
            tools.extend(check.client_tools(&effective.tools, &effective.client_tools));
            // The schemas as they are used, defaults filled in.
            for tool in &mut effective.client_tools {
                tool.input_schema = agentrt::json::json_to_struct(&client_tool_schema(tool));
            }
        }
        check.parallel(&mut effective.max_parallel_tool_calls);
        check.context(effective.context.get_or_insert_default());
        check.timeouts(effective.timeouts.get_or_insert_default());
        // Every violation at once, this one too, whenever what it counts is valid: the
        // system prompt, the strategy (ReAct's instructions) and the budget. A tool not
        // offered only makes the count smaller, so a prompt over budget without it is over
        // with it too.
        let countable = !check.violations.iter().any(|v| {
            v.field == "system_prompt" || v.field == "strategy" || v.field.starts_with("context")
        });
        if countable && !missing {
            check.fixed_prompt(&effective, &tools);
        }
        if missing {
            check.violations = vec![Violation::new("config", "required")];
        }
        Ok(Checked {
            effective,
            violations: check.violations,
            tools,
        })
    }

    fn model(&self, check: &mut Check, config: &mut v1::AgentConfig) {
        let Some(model) = config.model.as_mut() else {
            check.violation(
                "model",
                "required: name a provider configured on this server and a model",
            );
            return;
        };
        self.provider(check, "model.provider", &mut model.provider);
        if model.name.is_empty() {
            check.violation(
                "model.name",
                "required: the provider's model id, e.g. \"gpt-4o-mini\"",
            );
        } else {
            check.model_name("model.name", &model.name);
        }
        if let Some(t) = model.temperature
            && !limits::TEMPERATURE.contains(&t)
        {
            check.violation(
                "model.temperature",
                format!("must be between 0 and 2, got {t}"),
            );
        }
        if !limits::MAX_TOKENS.contains(&model.max_tokens) {
            check.violation(
                "model.max_tokens",
                format!(
                    "must be between 0 (provider default) and 1000000, got {}",
                    model.max_tokens
                ),
            );
        }
    }

    fn rerank_model(&self, check: &mut Check, config: &mut v1::AgentConfig) {
        let Some(rerank) = config.rerank_model.as_mut() else {
            return;
        };
        self.provider(check, "rerank_model.provider", &mut rerank.provider);
        if rerank.name.is_empty() {
            check.violation("rerank_model.name", "required when a rerank model is given");
        } else {
            check.model_name("rerank_model.name", &rerank.name);
        }
        if rerank.top_n == 0 {
            rerank.top_n = limits::DEFAULT_RERANK_TOP_N;
        }
        if !limits::RERANK_TOP_N.contains(&rerank.top_n) {
            check.violation(
                "rerank_model.top_n",
                format!("must be between 1 and 100, got {}", rerank.top_n),
            );
        }
        if !limits::RERANK_MIN_SCORE.contains(&rerank.min_score) {
            check.violation(
                "rerank_model.min_score",
                format!("must be between 0 and 1, got {}", rerank.min_score),
            );
        }
    }

    fn provider(&self, check: &mut Check, field: &str, provider: &mut String) {
        if provider.is_empty() {
            match self.providers.default_provider() {
                Some(default) => default.clone_into(provider),
                None => {
                    let configured: Vec<&str> = self.providers.names().collect();
                    check.violation(
                        field,
                        format!(
                            "required: this server has no default provider (configured: {})",
                            list_or_none(&configured)
                        ),
                    );
                }
            }
        } else if self.providers.get(provider).is_none() {
            let configured: Vec<&str> = self.providers.names().collect();
            check.violation(
                field,
                format!(
                    "provider {} is not configured on this server (configured: {})",
                    shown(provider),
                    list_or_none(&configured)
                ),
            );
        }
    }
}

/// The input schema of a client tool: an object of any properties when none is given.
pub fn client_tool_schema(tool: &v1::ClientTool) -> serde_json::Value {
    let mut schema = tool.input_schema.as_ref().map_or_else(
        || serde_json::json!({"type": "object", "properties": {}}),
        agentrt::json::struct_to_json,
    );
    // Arguments are an object: said, as model APIs want it said.
    if let Some(schema) = schema.as_object_mut() {
        schema
            .entry("type")
            .or_insert_with(|| serde_json::Value::from("object"));
    }
    schema
}

/// Names listed in a message at most; a catalogue of many MCP tools would otherwise put
/// all of them in every violation.
const LISTED_NAMES: usize = 20;

fn list_or_none(names: &[&str]) -> String {
    match names.len() {
        0 => "none".into(),
        n if n <= LISTED_NAMES => names.join(", "),
        n => format!(
            "{} and {} more; ListTools lists them all",
            names[..LISTED_NAMES].join(", "),
            n - LISTED_NAMES
        ),
    }
}

/// Longest part of a client's text a violation quotes, in bytes.
const SHOWN_BYTES: usize = 80;

/// A client's text as a violation quotes it: its start, and its length when it was cut
/// (a description never grows with what the client sent).
fn shown(text: &str) -> String {
    let start = agentrt_grpc::status::bounded(text, SHOWN_BYTES);
    if start.len() == text.len() {
        format!("{text:?}")
    } else {
        format!("{start:?} ({} characters)", text.chars().count())
    }
}

/// Whether `name` is a well-formed agent or tool name.
fn well_formed(name: &str) -> bool {
    let mut chars = name.chars();
    chars.next().is_some_and(|c| c.is_ascii_alphabetic())
        && chars.all(|c| c.is_ascii_alphanumeric() || matches!(c, '_' | '-' | '.'))
        && name.len() <= limits::NAME_MAX_CHARS
}

const NAME_RULE: &str =
    "must start with a letter, then letters, digits, '_', '-' or '.', at most 64 characters";

/// Violations of list items, with the item's index, to be merged in field order.
type IndexedViolations = Vec<(usize, Violation)>;

#[derive(Default)]
struct Check {
    violations: Vec<Violation>,
}

impl Check {
    fn violation(&mut self, field: impl Into<String>, description: impl Into<String>) {
        self.violations.push(Violation::new(field, description));
    }

    /// A model's id: bounded, without spaces or control characters (it goes into every
    /// request, span and metric of the model).
    fn model_name(&mut self, field: &str, name: &str) {
        if name.chars().count() > limits::MODEL_NAME_MAX_CHARS
            || name.chars().any(|c| c.is_whitespace() || c.is_control())
        {
            self.violation(
                field,
                format!(
                    "must be at most {} characters without spaces or control characters",
                    limits::MODEL_NAME_MAX_CHARS
                ),
            );
        }
    }

    /// Whether `tools` tools and `client` client tools are within [`limits::MAX_TOOLS`];
    /// a violation of `field` when they are not.
    fn count(&mut self, field: &str, tools: usize, client: usize) -> bool {
        if tools + client <= limits::MAX_TOOLS {
            return true;
        }
        let description = if client == 0 {
            format!("at most {} tools, got {tools}", limits::MAX_TOOLS)
        } else {
            format!(
                "at most {} tools and client tools together, got {}",
                limits::MAX_TOOLS,
                tools + client
            )
        };
        self.violation(field, description);
        false
    }

    /// What every request of the agent sends whatever the conversation (its system prompt,
    /// with ReAct's instructions, and its tools' definitions) must leave room in
    /// `context.max_prompt_tokens` for the conversation: otherwise every run would send
    /// no history and every tool result cut to nothing.
    fn fixed_prompt(&mut self, config: &v1::AgentConfig, tools: &[ToolSpec]) {
        let budget = config.context.as_ref().map_or(0, |c| c.max_prompt_tokens);
        let fixed =
            agentrt_engine::fixed_prompt_tokens(&crate::convert::config_from_wire(config), tools);
        if i64::from(fixed) >= i64::from(budget) {
            self.violation(
                "context.max_prompt_tokens",
                format!(
                    "the system prompt and the tools' definitions take about {fixed} tokens of \
                     the {budget} a request may have, leaving none for the conversation: raise \
                     it, or shorten the prompt or offer fewer tools"
                ),
            );
        }
    }

    fn name(&mut self, name: &str) {
        if name.is_empty() {
            self.violation("name", "required");
        } else if !well_formed(name) {
            self.violation("name", format!("{} {NAME_RULE}", shown(name)));
        }
    }

    fn system_prompt(&mut self, prompt: &str) {
        let chars = prompt.chars().count();
        if chars > limits::SYSTEM_PROMPT_MAX_CHARS {
            self.violation(
                "system_prompt",
                format!(
                    "must be at most {} characters, got {chars}",
                    limits::SYSTEM_PROMPT_MAX_CHARS
                ),
            );
        }
    }

    fn strategy(&mut self, strategy: &mut i32) {
        match v1::Strategy::try_from(*strategy) {
            Ok(v1::Strategy::Unspecified) => *strategy = v1::Strategy::FunctionCall as i32,
            Ok(_) => {}
            Err(_) => self.violation(
                "strategy",
                format!("unknown value {strategy}; use STRATEGY_FUNCTION_CALL or STRATEGY_REACT"),
            ),
        }
    }

    fn max_iterations(&mut self, max: &mut i32) {
        if *max == 0 {
            *max = limits::DEFAULT_MAX_ITERATIONS;
        }
        if !limits::MAX_ITERATIONS.contains(max) {
            self.violation(
                "max_iterations",
                format!("must be between 1 and 99, got {max}"),
            );
        }
    }

    /// Checks the form of the tool names. Returns the well-formed, distinct ones with their
    /// index, to be looked up on the tool executor, and the violations by index, so that
    /// the caller can merge the look-up's own in field order.
    fn tool_names(&mut self, tools: &[v1::ToolRef]) -> (Vec<(usize, String)>, IndexedViolations) {
        let mut first_index: HashMap<&str, usize> = HashMap::new();
        let mut wanted = Vec::new();
        let mut violations = Vec::new();
        for (index, tool) in tools.iter().enumerate() {
            let field = format!("tools[{index}].name");
            if tool.name.is_empty() {
                violations.push((index, Violation::new(field, "required")));
            } else if !well_formed(&tool.name) {
                violations.push((
                    index,
                    Violation::new(field, format!("{} {NAME_RULE}", shown(&tool.name))),
                ));
            } else if let Some(first) = first_index.get(tool.name.as_str()) {
                let description = format!("duplicate of tools[{first}] ({:?})", tool.name);
                violations.push((index, Violation::new(field, description)));
            } else {
                first_index.insert(&tool.name, index);
                wanted.push((index, tool.name.clone()));
            }
        }
        (wanted, violations)
    }

    /// Checks the client tools (names well formed, unique, not also an executor tool of
    /// the config; descriptions bounded; input schemas valid JSON Schema of an object);
    /// answers the specs the model is offered for those that pass.
    fn client_tools(&mut self, tools: &[v1::ToolRef], client: &[v1::ClientTool]) -> Vec<ToolSpec> {
        let mut specs = Vec::new();
        let mut seen: HashMap<&str, usize> = HashMap::new();
        for (index, tool) in client.iter().enumerate() {
            let field = format!("client_tools[{index}]");
            let mut valid = true;
            if tool.name.is_empty() {
                self.violation(format!("{field}.name"), "required");
                valid = false;
            } else if tool.name.len() > 64
                || !tool
                    .name
                    .bytes()
                    .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'_' | b'-'))
            {
                self.violation(
                    format!("{field}.name"),
                    format!(
                        "{} must be 1 to 64 characters of A-Z, a-z, 0-9, '_' or '-'",
                        shown(&tool.name)
                    ),
                );
                valid = false;
            } else if let Some(first) = seen.get(tool.name.as_str()) {
                self.violation(
                    format!("{field}.name"),
                    format!("duplicate of client_tools[{first}] ({:?})", tool.name),
                );
                valid = false;
            } else if let Some(at) = tools.iter().position(|t| t.name == tool.name) {
                self.violation(
                    format!("{field}.name"),
                    format!(
                        "{:?} is also tools[{at}]: a client tool may not have the name of a tool of the executor",
                        tool.name
                    ),
                );
                valid = false;
            } else {
                seen.insert(&tool.name, index);
            }
            let chars = tool.description.chars().count();
            if chars > limits::CLIENT_TOOL_DESCRIPTION_MAX_CHARS {
                self.violation(
                    format!("{field}.description"),
                    format!(
                        "must be at most {} characters, got {chars}",
                        limits::CLIENT_TOOL_DESCRIPTION_MAX_CHARS
                    ),
                );
                valid = false;
            }
            let schema = client_tool_schema(tool);
            if let Err(why) = agentrt_engine::check_input_schema(&schema) {
                self.violation(format!("{field}.input_schema"), why);
                valid = false;
            }
            if valid {
                specs.push(ToolSpec {
                    name: tool.name.clone(),
                    description: tool.description.clone(),
                    input_schema: schema.into(),
                    source: agentrt_core::ToolSource::Client,
                });
            }
        }
        specs
    }

    fn parallel(&mut self, cap: &mut i32) {
        if *cap == 0 {
            *cap = limits::DEFAULT_PARALLEL_TOOL_CALLS;
        }
        if !limits::PARALLEL_TOOL_CALLS.contains(cap) {
            self.violation(
                "max_parallel_tool_calls",
                format!("must be between 1 and 64, got {cap}"),
            );
        }
    }

    fn context(&mut self, context: &mut v1::ContextConfig) {
        if context.max_prompt_tokens == 0 {
            context.max_prompt_tokens = limits::DEFAULT_PROMPT_TOKENS;
        }
        if !limits::PROMPT_TOKENS.contains(&context.max_prompt_tokens) {
            self.violation(
                "context.max_prompt_tokens",
                format!(
                    "must be between 256 and 2000000, got {}",
                    context.max_prompt_tokens
                ),
            );
        }
    }

    /// Violations in field order (run, model_call, tool_call, action), each timeout
    /// checked also when another is wrong.
    fn timeouts(&mut self, timeouts: &mut v1::Timeouts) {
        let run = self.timeout(
            "timeouts.run",
            &mut timeouts.run,
            limits::DEFAULT_RUN_TIMEOUT,
        );
        if let Some(run) = run
            && run > limits::MAX_RUN_TIMEOUT
        {
            self.violation(
                "timeouts.run",
                format!("must be at most 3600s, got {run:?}"),
            );
        }
        // The default of a call is never longer than the run it is part of: a config that
        // sets only a short run is valid.
        let within_run = |default: Duration| run.map_or(default, |run| default.min(run));
        for (field, slot, default) in [
            (
                "timeouts.model_call",
                &mut timeouts.model_call,
                limits::DEFAULT_MODEL_CALL_TIMEOUT,
            ),
            (
                "timeouts.tool_call",
                &mut timeouts.tool_call,
                limits::DEFAULT_TOOL_CALL_TIMEOUT,
            ),
        ] {
            let call = self.timeout(field, slot, within_run(default));
            // A run over its own limit is reported above; calls are held to the limit.
            match (call, run.filter(|run| *run <= limits::MAX_RUN_TIMEOUT)) {
                (Some(call), Some(run)) if call > run => {
                    self.violation(field, "must not exceed timeouts.run");
                }
                // With no usable run to compare with, a call is still held to the
                // longest run there may be.
                (Some(call), None) if call > limits::MAX_RUN_TIMEOUT => {
                    self.violation(
                        field,
                        format!("must be at most 3600s (the longest run), got {call:?}"),
                    );
                }
                _ => {}
            }
        }
        let action = self.timeout(
            "timeouts.action",
            &mut timeouts.action,
            limits::DEFAULT_ACTION_TIMEOUT,
        );
        if action.is_some_and(|a| a > limits::MAX_ACTION_TIMEOUT) {
            self.violation("timeouts.action", "must be at most 7 days (604800s)");
        }
    }

    /// Fills in `default` when unset; reports a set duration that is malformed, not
    /// positive or under [`MIN_TIMEOUT`]. Returns the effective duration when it is usable.
    fn timeout(
        &mut self,
        field: &str,
        slot: &mut Option<prost_types::Duration>,
        default: Duration,
    ) -> Option<Duration> {
        let wire = slot
            .get_or_insert_with(|| prost_types::Duration::try_from(default).unwrap_or_default());
        let valid_nanos = (0..1_000_000_000).contains(&wire.nanos);
        match Duration::try_from(*wire) {
            Ok(d) if valid_nanos && d >= MIN_TIMEOUT => Some(d),
            // Timers count whole milliseconds: a shorter limit would not be kept.
            Ok(d) if valid_nanos && !d.is_zero() => {
                self.violation(
                    field,
                    format!("must be at least 1ms (timers count whole milliseconds), got {d:?}"),
                );
                None
            }
            _ => {
                let malformed = !(-999_999_999..=999_999_999).contains(&wire.nanos)
                    || (wire.seconds > 0 && wire.nanos < 0)
                    || (wire.seconds < 0 && wire.nanos > 0);
                let description = if malformed {
                    // Not a `google.protobuf.Duration` at all.
                    format!(
                        "is not a valid duration: seconds {} and nanos {} (nanos must be 0 to 999999999, of the sign of seconds)",
                        wire.seconds, wire.nanos
                    )
                } else if wire.nanos == 0 {
                    format!("must be a positive duration, got {}s", wire.seconds)
                } else {
                    format!(
                        "must be a positive duration, got {}s and {}ns",
                        wire.seconds, wire.nanos
                    )
                };
                self.violation(field, description);
                None
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The fields the violations name, in order.
    fn fields_of(violations: &[Violation]) -> Vec<&str> {
        violations.iter().map(|v| v.field.as_str()).collect()
    }
    use agentrt_core::{ToolSource, ToolSpec};
    use std::collections::BTreeMap;

    struct FixedTools(Result<Vec<ToolSpec>, ToolServiceError>);

    #[async_trait::async_trait]
    impl ToolCatalog for FixedTools {
        async fn list_tools(&self) -> Result<Vec<ToolSpec>, ToolServiceError> {
            self.0.clone()
        }
    }

    /// Counts the calls, and offers `extra` too once it is set.
    #[derive(Default)]
    struct CountingTools {
        calls: std::sync::atomic::AtomicUsize,
        extra: std::sync::Mutex<Option<ToolSpec>>,
    }

    #[async_trait::async_trait]
    impl ToolCatalog for CountingTools {
        async fn list_tools(&self) -> Result<Vec<ToolSpec>, ToolServiceError> {
            self.calls.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
            Ok([calculator()]
                .into_iter()
                .chain(self.extra.lock().unwrap().clone())
                .collect())
        }
    }

    #[tokio::test(start_paused = true)]
    async fn the_catalogue_is_kept_and_asked_again_when_it_lacks_a_named_tool() {
        let source = Arc::new(CountingTools::default());
        let cache = CatalogCache::new(source.clone());
        let calls = || source.calls.load(std::sync::atomic::Ordering::SeqCst);
        for _ in 0..5 {
            cache.offering(&["calculator"]).await.unwrap();
        }
        assert_eq!(calls(), 1, "kept between checks");
        // A tool added since: an unknown name asks again (once the kept copy is a second
        // old), and the new tool is known at once.
        *source.extra.lock().unwrap() = Some(ToolSpec {
            name: "docs__search".into(),
            ..calculator()
        });
        tokio::time::advance(CATALOG_MIN_AGE).await;
        let tools = cache.offering(&["docs__search"]).await.unwrap();
        assert!(tools.iter().any(|t| t.name == "docs__search"));
        assert_eq!(calls(), 2);
        // Unknown names cannot make every check a call.
        for _ in 0..5 {
            cache.offering(&["nope"]).await.unwrap();
        }
        assert_eq!(calls(), 2);
        // And the catalogue is asked again when it is old.
        tokio::time::advance(CATALOG_MAX_AGE).await;
        cache.offering(&["calculator"]).await.unwrap();
        assert_eq!(calls(), 3);
    }

    fn validator(tools: Result<Vec<ToolSpec>, ToolServiceError>) -> ConfigValidator {
        let providers = ProviderRegistry::new(BTreeMap::new(), None, |name| {
            (name == "OPENAI_BASE_URL").then(|| "http://127.0.0.1:1/v1".to_owned())
        })
        .unwrap();
        ConfigValidator::new(Arc::new(providers), Arc::new(FixedTools(tools)))
    }

    fn calculator() -> ToolSpec {
        ToolSpec {
            name: "calculator".into(),
            description: String::new(),
            input_schema: serde_json::json!({}).into(),
            source: ToolSource::Builtin,
        }
    }

    fn minimal() -> v1::AgentConfig {
        v1::AgentConfig {
            name: "helper".into(),
            model: Some(v1::ModelConfig {
                name: "m".into(),
                ..Default::default()
            }),
            ..Default::default()
        }
    }

    #[tokio::test]
    async fn defaults_are_applied_without_touching_the_input() {
        let input = minimal();
        let checked = validator(Ok(vec![])).check(Some(&input)).await.unwrap();
        assert_eq!(checked.violations, vec![]);
        assert_eq!(input, minimal());
        let e = checked.effective;
        assert_eq!(e.model.unwrap().provider, "openai");
        assert_eq!(e.strategy, v1::Strategy::FunctionCall as i32);
        assert_eq!(e.max_iterations, 10);
        assert_eq!(e.max_parallel_tool_calls, 4);
        assert_eq!(e.context.unwrap().max_prompt_tokens, 8192);
        assert_eq!(e.timeouts.unwrap().run.unwrap().seconds, 300);
    }

    #[tokio::test]
    async fn call_timeouts_default_to_at_most_the_run_and_client_schemas_are_filled_in() {
        let mut input = minimal();
        input.timeouts = Some(v1::Timeouts {
            run: Some(prost_types::Duration {
                seconds: 20,
                nanos: 0,
            }),
            ..Default::default()
        });
        input.client_tools = vec![
            v1::ClientTool {
                name: "bare".into(),
                ..Default::default()
            },
            v1::ClientTool {
                name: "untyped".into(),
                input_schema: agentrt::json::json_to_struct(
                    &serde_json::json!({"properties": {"n": {"type": "integer"}}}),
                ),
                ..Default::default()
            },
        ];
        let checked = validator(Ok(vec![])).check(Some(&input)).await.unwrap();
        assert_eq!(checked.violations, vec![]);
        let timeouts = checked.effective.timeouts.unwrap();
        assert_eq!(timeouts.model_call.unwrap().seconds, 20);
        assert_eq!(timeouts.tool_call.unwrap().seconds, 20);
        let schemas: Vec<serde_json::Value> = checked
            .effective
            .client_tools
            .iter()
            .map(|t| agentrt::json::struct_to_json(t.input_schema.as_ref().unwrap()))
            .collect();
        assert_eq!(
            schemas,
            [
                serde_json::json!({"type": "object", "properties": {}}),
                serde_json::json!({"type": "object", "properties": {"n": {"type": "integer"}}}),
            ]
        );
        // What the model is offered is the same.
        let offered: Vec<serde_json::Value> = checked
            .tools
            .iter()
            .map(|t| serde_json::from_str(&t.input_schema.text()).unwrap())
            .collect();
        assert_eq!(offered, schemas);

        // A zero duration is named plainly.
        let mut zero = minimal();
        zero.timeouts = Some(v1::Timeouts {
            run: Some(prost_types::Duration::default()),
            ..Default::default()
        });
        let checked = validator(Ok(vec![])).check(Some(&zero)).await.unwrap();
        assert_eq!(
            checked.violations,
            vec![Violation::new(
                "timeouts.run",
                "must be a positive duration, got 0s"
            )]
        );

        // A run over its limit holds its calls to the limit, not to itself.
        let duration = |seconds, nanos| Some(prost_types::Duration { seconds, nanos });

        // Under a millisecond is refused (timers count whole milliseconds); 1ms is kept.
        let mut short = minimal();
        short.timeouts = Some(v1::Timeouts {
            run: duration(0, 1),
            tool_call: duration(0, 999_999),
            model_call: duration(0, 1_000_000),
            ..Default::default()
        });
        let checked = validator(Ok(vec![])).check(Some(&short)).await.unwrap();
        assert_eq!(
            checked.violations,
            vec![
                Violation::new(
                    "timeouts.run",
                    "must be at least 1ms (timers count whole milliseconds), got 1ns"
                ),
                Violation::new(
                    "timeouts.tool_call",
                    "must be at least 1ms (timers count whole milliseconds), got 999.999µs"
                ),
            ]
        );
        let mut long = minimal();
        long.timeouts = Some(v1::Timeouts {
            run: duration(7200, 0),
            model_call: duration(5000, 0),
            ..Default::default()
        });
        let checked = validator(Ok(vec![])).check(Some(&long)).await.unwrap();
        let fields = fields_of(&checked.violations);
        assert_eq!(
            fields,
            ["timeouts.run", "timeouts.model_call"],
            "{:?}",
            checked.violations
        );

        // Every timeout is checked, in field order, also when the run's is wrong; a
        // malformed Duration is called so, not "not positive".
        let mut wrong = minimal();
        wrong.timeouts = Some(v1::Timeouts {
            run: duration(-1, 0),
            model_call: duration(7200, 0),
            tool_call: duration(5, -5),
            action: duration(5, 2_000_000_000),
        });
        let checked = validator(Ok(vec![])).check(Some(&wrong)).await.unwrap();
        let fields = fields_of(&checked.violations);
        assert_eq!(
            fields,
            [
                "timeouts.run",
                "timeouts.model_call",
                "timeouts.tool_call",
                "timeouts.action"
            ],
            "{:?}",
            checked.violations
        );
        assert_eq!(
            checked.violations[1].description,
            "must be at most 3600s (the longest run), got 7200s"
        );
        for malformed in &checked.violations[2..] {
            assert!(
                malformed.description.starts_with("is not a valid duration"),
                "{malformed:?}"
            );
        }
    }

    #[tokio::test]
    async fn every_violation_is_reported() {
        let config = v1::AgentConfig {
            name: "9lives".into(),
            model: Some(v1::ModelConfig {
                provider: "anthropic".into(),
                name: "has space".into(),
                temperature: Some(3.0),
                max_tokens: -1,
            }),
            strategy: 9,
            max_iterations: 100,
            tools: vec![
                v1::ToolRef {
                    name: "calculator".into(),
                    require_approval: false,
                },
                v1::ToolRef {
                    name: "calculator".into(),
                    require_approval: false,
                },
                v1::ToolRef {
                    name: "nope".into(),
                    require_approval: false,
                },
                v1::ToolRef {
                    name: String::new(),
                    require_approval: false,
                },
            ],
            max_parallel_tool_calls: 65,
            context: Some(v1::ContextConfig {
                max_prompt_tokens: 10,
            }),
            timeouts: Some(v1::Timeouts {
                run: Some(prost_types::Duration {
                    seconds: 10,
                    nanos: 0,
                }),
                model_call: Some(prost_types::Duration {
                    seconds: 0,
                    nanos: 0,
                }),
                tool_call: Some(prost_types::Duration {
                    seconds: 20,
                    nanos: 0,
                }),
                action: Some(prost_types::Duration {
                    seconds: 8 * 24 * 3600,
                    nanos: 0,
                }),
            }),
            client_tools: vec![
                v1::ClientTool {
                    name: "lookup order".into(),
                    ..Default::default()
                },
                v1::ClientTool {
                    name: "calculator".into(),
                    ..Default::default()
                },
                v1::ClientTool {
                    name: "book".into(),
                    input_schema: agentrt::json::json_to_struct(
                        &serde_json::json!({"type": "object", "properties": {"n": {"type": 7}}}),
                    ),
                    ..Default::default()
                },
                v1::ClientTool {
                    name: "book".into(),
                    input_schema: agentrt::json::json_to_struct(
                        &serde_json::json!({"type": "array"}),
                    ),
                    ..Default::default()
                },
            ],
            ..Default::default()
        };
        let checked = validator(Ok(vec![calculator()]))
            .check(Some(&config))
            .await
            .unwrap();
        let fields = fields_of(&checked.violations);
        assert_eq!(
            fields,
            [
                "name",
                "model.provider",
                "model.name",
                "model.temperature",
                "model.max_tokens",
                "strategy",
                "max_iterations",
                "tools[1].name",
                "tools[2].name",
                "tools[3].name",
                "client_tools[0].name",
                "client_tools[1].name",
                "client_tools[2].input_schema",
                "client_tools[3].name",
                "client_tools[3].input_schema",
                "max_parallel_tool_calls",
                "context.max_prompt_tokens",
                // In field order, as the proto says (action is field 4).
                "timeouts.model_call",
                "timeouts.tool_call",
                "timeouts.action",
            ]
        );
        let about = |field: &str| {
            checked
                .violations
                .iter()
                .find(|v| v.field == field)
                .map(|v| v.description.clone())
                .unwrap()
        };
        assert!(about("client_tools[1].name").contains("also tools[0]"));
        assert!(about("client_tools[2].input_schema").contains("not a valid JSON Schema"));
        assert!(about("client_tools[3].name").contains("duplicate of client_tools[2]"));
        assert!(about("client_tools[3].input_schema").contains("must describe an object"));
        assert!(about("timeouts.action").contains("7 days"));
        assert!(
            checked.violations[7]
                .description
                .contains("duplicate of tools[0]")
        );
        assert!(
            checked.violations[8]
                .description
                .contains("offered: calculator")
        );
    }

    #[tokio::test]
    async fn an_unreachable_tool_executor_is_an_error_only_when_tools_are_asked_for() {
        let down = Err(ToolServiceError::Unavailable {
            endpoint: "http://x".into(),
            reason: "connection refused".into(),
        });
        let v = validator(down);
        assert!(v.check(Some(&minimal())).await.is_ok());
        let mut with_tools = minimal();
        with_tools.tools.push(v1::ToolRef {
            name: "calculator".into(),
            require_approval: false,
        });
        assert!(v.check(Some(&with_tools)).await.is_err());
    }

    #[tokio::test]
    async fn a_missing_config_is_a_violation() {
        let checked = validator(Ok(vec![])).check(None).await.unwrap();
        assert_eq!(
            checked.violations,
            vec![Violation::new("config", "required")]
        );
        // The defaults an empty config gets are still shown.
        let timeouts = checked.effective.timeouts.expect("timeouts filled in");
        assert!(timeouts.action.is_some(), "{timeouts:?}");
        assert!(checked.effective.max_iterations > 0);
        assert!(checked.effective.context.is_some());
    }

    /// A list over the bound is one violation, its length: its items are not looked at,
    /// nor the catalogue asked for them (a request of 4 MiB of names would otherwise cost
    /// a violation, and a look-up, each).
    #[tokio::test]
    async fn a_list_of_too_many_tools_is_one_violation_and_its_items_are_not_looked_at() {
        let source = Arc::new(CountingTools::default());
        let providers = ProviderRegistry::new(BTreeMap::new(), None, |name| {
            (name == "OPENAI_BASE_URL").then(|| "http://127.0.0.1:1/v1".to_owned())
        })
        .unwrap();
        let v = ConfigValidator::new(Arc::new(providers), source.clone());
        let mut config = minimal();
        config.tools = (0..10_000)
            .map(|i| v1::ToolRef {
                name: format!("unknown{i}"),
                require_approval: false,
            })
            .collect();
        config.client_tools = vec![v1::ClientTool {
            name: "bad name".into(),
            ..Default::default()
        }];
        let checked = v.check(Some(&config)).await.unwrap();
        assert_eq!(fields_of(&checked.violations), ["tools"]);
        assert_eq!(
            checked.violations[0].description,
            "at most 128 tools, got 10000"
        );
        assert_eq!(source.calls.load(std::sync::atomic::Ordering::SeqCst), 0);

        // Tools within the bound, with client tools over it together: the client tools'
        // violation, and theirs only.
        config.tools.truncate(100);
        config.client_tools = (0..50)
            .map(|i| v1::ClientTool {
                name: format!("bad name {i}"),
                ..Default::default()
            })
            .collect();
        let checked = v.check(Some(&config)).await.unwrap();
        let fields = fields_of(&checked.violations);
        assert_eq!(fields.iter().filter(|f| **f == "client_tools").count(), 1);
        assert!(
            !fields.iter().any(|f| f.starts_with("client_tools[")),
            "{fields:?}"
        );
        // 128 tools and no client tools are within the bound.
        config.tools = (0..128)
            .map(|_| v1::ToolRef {
                name: "calculator".into(),
                require_approval: false,
            })
            .collect();
        config.client_tools.clear();
        let checked = v.check(Some(&config)).await.unwrap();
        assert!(
            !fields_of(&checked.violations).contains(&"client_tools"),
            "{:?}",
            checked.violations
        );
    }

    /// A violation quotes at most the start of what the client sent, saying its length:
    /// the answer never grows with the input (a 2 MB name would make it too large to send).
    #[tokio::test]
    async fn violations_quote_only_the_start_of_a_long_value() {
        let mut config = minimal();
        config.name = "\u{1}".repeat(700_000);
        config.tools = vec![v1::ToolRef {
            name: "x".repeat(100_000),
            require_approval: false,
        }];
        config.client_tools = vec![v1::ClientTool {
            name: "y ".repeat(50_000),
            ..Default::default()
        }];
        config.model.as_mut().unwrap().provider = "p".repeat(100_000);
        let checked = validator(Ok(vec![calculator()]))
            .check(Some(&config))
            .await
            .unwrap();
        assert_eq!(
            fields_of(&checked.violations),
            [
                "name",
                "model.provider",
                "tools[0].name",
                "client_tools[0].name"
            ]
        );
        for violation in &checked.violations {
            assert!(
                violation.description.len() < 1_000,
                "{}: {} bytes",
                violation.field,
                violation.description.len()
            );
        }
        assert!(
            checked.violations[0]
                .description
                .contains("(700000 characters)")
        );
    }

    /// A rerank model's id is held to the model's rule.
    #[tokio::test]
    async fn a_rerank_model_name_is_bounded_as_a_model_name_is() {
        let mut config = minimal();
        config.rerank_model = Some(v1::RerankModelConfig {
            name: "a\nb".into(),
            ..Default::default()
        });
        let checked = validator(Ok(vec![])).check(Some(&config)).await.unwrap();
        assert_eq!(fields_of(&checked.violations), ["rerank_model.name"]);
    }

    /// A system prompt and tool definitions that fill the prompt's budget leave no room for
    /// the conversation: refused, naming both numbers, rather than a valid config whose runs
    /// send no history and no tool output.
    #[tokio::test]
    async fn a_fixed_prompt_over_the_token_budget_is_refused() {
        let mut config = minimal();
        config.system_prompt = "word ".repeat(9_000);
        let checked = validator(Ok(vec![])).check(Some(&config)).await.unwrap();
        assert_eq!(
            fields_of(&checked.violations),
            ["context.max_prompt_tokens"]
        );
        let description = &checked.violations[0].description;
        assert!(description.contains("of the 8192"), "{description}");
        // Raised, it fits.
        config.context = Some(v1::ContextConfig {
            max_prompt_tokens: 16_000,
        });
        let checked = validator(Ok(vec![])).check(Some(&config)).await.unwrap();
        assert_eq!(checked.violations, vec![]);
        // Tools count too.
        let big_tool = ToolSpec {
            name: "big".into(),
            description: "word ".repeat(20_000),
            ..calculator()
        };
        config.tools = vec![v1::ToolRef {
            name: "big".into(),
            require_approval: false,
        }];
        let checked = validator(Ok(vec![big_tool]))
            .check(Some(&config))
            .await
            .unwrap();
        assert_eq!(
            fields_of(&checked.violations),
            ["context.max_prompt_tokens"]
        );
    }

    /// Callers that wait while one asks the tool executor take its answer, a failure
    /// included, rather than each asking again in turn.
    #[tokio::test(start_paused = true)]
    async fn callers_waiting_for_the_catalogue_share_one_answer_a_failure_included() {
        struct Slow(std::sync::atomic::AtomicUsize);
        #[async_trait::async_trait]
        impl ToolCatalog for Slow {
            async fn list_tools(&self) -> Result<Vec<ToolSpec>, ToolServiceError> {
                self.0.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
                tokio::time::sleep(Duration::from_secs(5)).await;
                Err(ToolServiceError::Unavailable {
                    endpoint: "x".into(),
                    reason: "did not answer".into(),
                })
            }
        }
        let source = Arc::new(Slow(Default::default()));
        let cache = Arc::new(CatalogCache::new(source.clone()));
        let started = Instant::now();
        let callers: Vec<_> = (0..20)
            .map(|_| {
                let cache = cache.clone();
                tokio::spawn(async move { cache.offering(&["calculator"]).await })
            })
            .collect();
        for caller in callers {
            assert!(caller.await.unwrap().is_err());
        }
        assert_eq!(source.0.load(std::sync::atomic::Ordering::SeqCst), 1);
        assert!(
            started.elapsed() < Duration::from_secs(6),
            "{:?}",
            started.elapsed()
        );
    }

    /// A tool of a source that offers none (an MCP server still starting, or down) is
    /// named as such, before the list of what is offered.
    #[tokio::test]
    async fn a_tool_of_a_source_that_offers_none_says_so_first() {
        let mut config = minimal();
        config.tools = vec![
            v1::ToolRef {
                name: "docs__search".into(),
                require_approval: false,
            },
            v1::ToolRef {
                name: "calculator__nope".into(),
                require_approval: false,
            },
        ];
        let tools = vec![ToolSpec {
            name: "calculator__add".into(),
            ..calculator()
        }];
        let checked = validator(Ok(tools)).check(Some(&config)).await.unwrap();
        assert!(
            checked.violations[0]
                .description
                .starts_with("tool \"docs__search\" is not offered by the tool executor, nor any tool of source \"docs\""),
            "{}",
            checked.violations[0].description
        );
        assert!(
            !checked.violations[1].description.contains("nor any tool"),
            "{}",
            checked.violations[1].description
        );
    }
}
