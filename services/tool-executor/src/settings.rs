use std::net::SocketAddr;

use agentrt_grpc::config::{self, CommonArgs, ConfigError, ServerSettings};
use agentrt_tools::{builtin, mcp::McpServerConfig, openapi::OpenApiConfig};
use serde::{Deserialize, Serialize};

/// The tool executor's settings, as a config file writes them.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct Settings {
    /// Listening, limits and drain.
    pub server: ServerSettings,
    /// Built-in tools to serve, by name.
    pub builtin_tools: Vec<String>,
    /// MCP servers whose tools to serve, as `<name>__<tool>`.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub mcp_servers: Vec<McpServerConfig>,
    /// OpenAPI documents whose operations to serve, as `<name>__<operationId>`.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub openapi: Vec<OpenApiConfig>,
}

impl Default for Settings {
    fn default() -> Self {
        Self {
            server: ServerSettings::listening_on(SocketAddr::from(([127, 0, 0, 1], 50052))),
            builtin_tools: builtin::NAMES.iter().map(|s| (*s).to_owned()).collect(),
            mcp_servers: Vec::new(),
            openapi: Vec::new(),
        }
    }
}

/// The tool executor's command line. Every flag also reads `TOOL_EXECUTOR_<FLAG>` from
/// the environment, e.g. `TOOL_EXECUTOR_LISTEN`.
#[derive(Debug, Clone, Default, clap::Parser)]
#[command(
    name = "tool-executor",
    version,
    about = "Lists and runs the tools agents call, over gRPC."
)]
pub struct Cli {
    #[command(flatten)]
    #[allow(missing_docs)]
    pub common: CommonArgs,
    /// Built-in tools to serve, comma-separated (default: all).
    #[arg(long, value_name = "NAMES", value_delimiter = ',')]
    pub builtin_tools: Option<Vec<String>>,
}

impl Cli {
    /// The prefix of the environment variables that stand for flags.
    pub const ENV_PREFIX: &'static str = "TOOL_EXECUTOR";

    /// Layers defaults, the config file, then environment and flags, and validates.
    pub fn settings(&self) -> Result<Settings, ConfigError> {
        let mut settings: Settings = self.common.base(|s: &mut Settings| &mut s.server)?;
        config::override_with(&mut settings.builtin_tools, self.builtin_tools.clone());
        settings.server.validate()?;
        if let Some(unknown) = settings
            .builtin_tools
            .iter()
            .find(|name| builtin::by_name(name).is_none())
        {
            return Err(ConfigError::Invalid {
                field: "builtin_tools",
                message: format!(
                    "unknown tool {unknown:?}; known: {}",
                    builtin::NAMES.join(", ")
                ),
            });
        }
        // Paths in the config file are relative to it.
        let dir = match self.common.config.as_deref().and_then(|p| p.parent()) {
            Some(dir) if !dir.as_os_str().is_empty() => dir.to_path_buf(),
            _ => std::path::PathBuf::from("."),
        };
        let mut names = std::collections::BTreeSet::new();
        for server in &mut settings.mcp_servers {
            server.resolve_paths(&dir);
            server.check().map_err(|message| ConfigError::Invalid {
                field: "mcp_servers",
                message: format!("{:?}: {message}", server.name),
            })?;
            if !names.insert(server.name.clone()) {
                return Err(duplicate_source("mcp_servers", &server.name));
            }
        }
        for source in &mut settings.openapi {
            source.resolve_paths(&dir);
            source.check().map_err(|message| ConfigError::Invalid {
                field: "openapi",
                message: format!("{:?}: {message}", source.name),
            })?;
            if !names.insert(source.name.clone()) {
                return Err(duplicate_source("openapi", &source.name));
            }
        }
        Ok(settings)
    }
}

/// A second source named `name`, found in `field` (the setting of the second one).
fn duplicate_source(field: &'static str, name: &str) -> ConfigError {
    ConfigError::Invalid {
        field,
        message: format!("two tool sources are named {name:?}; each needs its own name"),
    }
}
