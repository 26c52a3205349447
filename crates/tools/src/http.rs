//! The HTTP client outside tool sources are reached with.

use std::time::Duration;

/// How long opening a connection may take.
const CONNECT_TIMEOUT: Duration = Duration::from_secs(10);

/// A client that follows no redirects: a tool source's requests go to the host its
/// config names and nowhere else, whatever the server answers.
pub(crate) fn client() -> Result<reqwest::Client, String> {
    // TLS uses ring; installing it twice is harmless, so ignore "already installed".
    let _ = rustls::crypto::ring::default_provider().install_default();
    reqwest::Client::builder()
        .connect_timeout(CONNECT_TIMEOUT)
        .tcp_nodelay(true)
        .pool_idle_timeout(Duration::from_secs(90))
        .redirect(reqwest::redirect::Policy::none())
        .build()
        .map_err(|e| format!("cannot build the HTTP client: {e}"))
}
