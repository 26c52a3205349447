//! A lean HTTP/2 client for cleartext model servers that speak HTTP/2 from the first byte
//! (h2c with prior knowledge): vLLM or a simulator beside the server in the same cluster.
//!
//! Every call in flight shares one connection, and a call is one HTTP/2 stream on it,
//! sent straight through hyper. The general client (connection pool, proxies, redirects,
//! TLS) added about 4.5 KB to each call in flight (measured with `agentrt-bench`), which
//! adds up when ten thousand runs wait on their model at once. A connection that closes (the
//! server restarted, sent GOAWAY, stopped answering pings) is replaced by the next call.

use std::time::Duration;

use bytes::Bytes;
use http_body_util::Full;
use hyper::{
    Request, Response, Uri,
    body::Incoming,
    client::conn::http2::{self, SendRequest},
    header::HeaderMap,
};
use hyper_util::rt::{TokioExecutor, TokioIo, TokioTimer};
use tokio::{net::TcpStream, sync::Mutex};
use tracing::debug;

use crate::{ModelError, openai::error_chain};

/// A cleartext HTTP/2 client of one endpoint.
pub(crate) struct H2cClient {
    uri: Uri,
    /// `host:port` to connect to.
    address: String,
    connect_timeout: Duration,
    /// The shared connection; `None` until the first call, replaced once it closes.
    connection: Mutex<Option<SendRequest<Full<Bytes>>>>,
}

impl H2cClient {
    /// A client of `uri`, an `http://` URL; nothing connects before the first call.
    pub(crate) fn new(uri: &str, connect_timeout: Duration) -> Result<Self, String> {
        let uri: Uri = uri.parse().map_err(|e| format!("{e}"))?;
        if uri.scheme_str() != Some("http") {
            return Err("HTTP/2 with prior knowledge needs an http:// URL".into());
        }
        let authority = uri.authority().ok_or("the URL has no host")?;
        let address = format!(
            "{}:{}",
            authority.host(),
            authority.port_u16().unwrap_or(80)
        );
        Ok(Self {
            uri,
            address,
            connect_timeout,
            connection: Mutex::new(None),
        })
    }

    /// The open connection, or a new one when there is none or it closed.
    async fn sender(&self) -> Result<SendRequest<Full<Bytes>>, ModelError> {
        let mut slot = self.connection.lock().await;
        if let Some(sender) = slot.as_ref().filter(|s| !s.is_closed()) {
            return Ok(sender.clone());
        }
        *slot = None;
        // Boxed: the handshake's state is large, and a future that held it inline would
        // carry that room through every call, though only the first call connects.
        let sender = Box::pin(self.connect()).await?;
        *slot = Some(sender.clone());
        Ok(sender)
    }

    async fn connect(&self) -> Result<SendRequest<Full<Bytes>>, ModelError> {
        let unreachable = |e: &dyn std::fmt::Display| {
            ModelError::Connect(format!("cannot connect to {}: {e}", self.address))
        };
        let stream = tokio::time::timeout(self.connect_timeout, TcpStream::connect(&self.address))
            .await
            .map_err(|_| unreachable(&"timed out"))?
            .map_err(|e| unreachable(&e))?;
        let _ = stream.set_nodelay(true);
        let (sender, connection) = http2::Builder::new(TokioExecutor::new())
            .timer(TokioTimer::new())
            // Large windows so that streaming calls never wait on flow control. The
            // connection window also sets h2's budget for small DATA frames not yet read
            // (half the window): SSE sends an event per frame, and when thousands of calls
            // answer at once, a small window makes h2 close the connection with every call
            // on it ("too_many_data_frames"). Pings notice a dead peer.
            .initial_connection_window_size(64 * 1024 * 1024)
            .initial_stream_window_size(1024 * 1024)
            .keep_alive_interval(Duration::from_secs(30))
            .keep_alive_timeout(Duration::from_secs(10))
            .handshake(TokioIo::new(stream))
            .await
            .map_err(|e| unreachable(&error_chain(&e)))?;
        let address = self.address.clone();
        tokio::spawn(async move {
            // Ends when the peer closes or every sender is dropped; calls still on it see
            // the error on their own streams.
            if let Err(error) = connection.await {
                debug!(%address, error = %error_chain(&error), "model connection closed");
            }
        });
        debug!(address = %self.address, "model connection open");
        Ok(sender)
    }

    /// POSTs `body` with `headers`; the response, its body still to read.
    pub(crate) async fn post(
        &self,
        body: Bytes,
        headers: HeaderMap,
    ) -> Result<Response<Incoming>, ModelError> {
        let mut sender = self.sender().await?;
        let mut request = Request::post(self.uri.clone())
            .body(Full::new(body))
            .map_err(|e| ModelError::Connect(format!("invalid request: {e}")))?;
        *request.headers_mut() = headers;
        let lost = |e: hyper::Error| ModelError::Connect(error_chain(&e));
        sender.ready().await.map_err(lost)?;
        sender.send_request(request).await.map_err(lost)
    }
}
