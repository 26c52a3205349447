//! Logging set-up shared by every binary.
//!
//! Logs go to standard error, so that standard output stays free for what a command is
//! asked to print (e.g. `--print-config`). `LOG_FORMAT=json` switches to one JSON object
//! per line; `RUST_LOG` (default `info`) sets the level per module.

use tracing_subscriber::{EnvFilter, fmt, prelude::*};

/// The log line format.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LogFormat {
    /// Human-readable lines.
    Text,
    /// One JSON object per line, for log collectors.
    Json,
}

impl LogFormat {
    /// Reads `LOG_FORMAT` (`text` or `json`, default `text`).
    pub fn from_env() -> Result<Self, String> {
        match std::env::var("LOG_FORMAT").as_deref() {
            Err(_) | Ok("" | "text") => Ok(Self::Text),
            Ok("json") => Ok(Self::Json),
            Ok(other) => Err(format!(
                "LOG_FORMAT must be `text` or `json`, not {other:?}"
            )),
        }
    }
}

/// Installs the global subscriber. Call once, at the start of `main`.
pub fn init() -> Result<(), String> {
    let format = LogFormat::from_env()?;
    let filter = EnvFilter::try_from_default_env()
        .or_else(|_| EnvFilter::try_new("info"))
        .map_err(|e| format!("invalid RUST_LOG: {e}"))?;
    let registry = tracing_subscriber::registry().with(filter);
    let result = match format {
        LogFormat::Text => registry
            .with(fmt::layer().with_writer(std::io::stderr).with_ansi(false))
            .try_init(),
        LogFormat::Json => registry
            .with(
                fmt::layer()
                    .json()
                    .flatten_event(true)
                    .with_current_span(true)
                    .with_writer(std::io::stderr),
            )
            .try_init(),
    };
    result.map_err(|e| format!("cannot install the log subscriber: {e}"))
}
