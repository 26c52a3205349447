//! The HTTP client outside tool sources are reached with.

use std::{error::Error as StdError, time::Duration};

/// How long opening a connection may take.
const CONNECT_TIMEOUT: Duration = Duration::from_secs(10);

/// The `User-Agent` of requests to tool sources that set none themselves: some APIs
/// (GitHub's, Wikimedia's) refuse requests without one.
pub(crate) const USER_AGENT: &str = concat!("agentrt-tool-executor/", env!("CARGO_PKG_VERSION"));

/// A client that follows no redirects: a tool source's requests go to the host its
/// config names and nowhere else, whatever the server answers.
pub(crate) fn client() -> Result<reqwest::Client, String> {
    // TLS uses ring; installing it twice is harmless, so ignore "already installed".
    let _ = rustls::crypto::ring::default_provider().install_default();
    reqwest::Client::builder()
        .user_agent(USER_AGENT)
        .connect_timeout(CONNECT_TIMEOUT)
        .tcp_nodelay(true)
        .pool_idle_timeout(Duration::from_secs(90))
        .redirect(reqwest::redirect::Policy::none())
        .build()
        .map_err(|e| format!("cannot build the HTTP client: {e}"))
}

/// What went wrong with a request to a tool source, in words: its kind and its cause,
/// never the error's own text, where reqwest names the URL (whose query may hold the
/// source's secrets: the words reach the model and the logs).
pub(crate) fn request_error(error: &reqwest::Error) -> String {
    if error.is_timeout() {
        return "the request timed out".into();
    }
    let what = if error.is_connect() {
        "it cannot be reached"
    } else {
        "the request failed"
    };
    match error.source() {
        Some(cause) => format!("{what} ({})", quoted(&innermost(cause))),
        None => what.into(),
    }
}

/// The message of the last error in `error`'s chain: the cause, without the wrappers.
pub(crate) fn innermost(error: &(dyn StdError + 'static)) -> String {
    let mut error = error;
    while let Some(source) = error.source() {
        error = source;
    }
    error.to_string()
}

/// Longest text of a server's quoted in a message, in bytes.
const MAX_QUOTED_BYTES: usize = 200;

/// `text` from a server, on one line and cut to [`MAX_QUOTED_BYTES`].
pub(crate) fn quoted(text: &str) -> String {
    let mut text = text.split_whitespace().collect::<Vec<_>>().join(" ");
    if text.len() > MAX_QUOTED_BYTES {
        let mut end = MAX_QUOTED_BYTES;
        while !text.is_char_boundary(end) {
            end -= 1;
        }
        text.truncate(end);
        text.push('…');
    }
    text
}
