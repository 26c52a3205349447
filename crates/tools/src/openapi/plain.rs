//! `http://` calls over HTTP/1.1 connections to the base URL's origin, each driven by the
//! call using it (no connection task, no channel between tasks): a call is a write and a
//! read on a socket already open. Idle connections wait in a pool for the next call.

use std::{
    sync::Mutex,
    time::{Duration, Instant},
};

use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use hyper::client::conn::http1::{self, Connection, SendRequest};
use hyper_util::rt::TokioIo;
use tokio::net::TcpStream;

use super::Reply;

/// How long opening a connection may take (as the shared client's).
const CONNECT_TIMEOUT: Duration = Duration::from_secs(10);
/// An idle connection older than this is closed rather than used (as the shared client's).
const IDLE_TIMEOUT: Duration = Duration::from_secs(90);
/// Most idle connections kept.
const MAX_IDLE: usize = 256;

type Body = Full<Bytes>;

struct Conn {
    sender: SendRequest<Body>,
    conn: Connection<TokioIo<TcpStream>, Body>,
    idle_since: Instant,
}

/// Connections to one `host:port`.
pub(super) struct Pool {
    host: String,
    port: u16,
    idle: Mutex<Vec<Conn>>,
}

impl Pool {
    pub(super) fn new(host: &str, port: u16) -> Self {
        // An IPv6 literal comes bracketed in a URL; the resolver wants it bare.
        let host = host
            .trim_start_matches('[')
            .trim_end_matches(']')
            .to_owned();
        Self {
            host,
            port,
            idle: Mutex::new(Vec::new()),
        }
    }

    /// Sends `request` (origin-form URI, `Host` set) and reads at most `max_body` bytes of
    /// the answer.
    pub(super) async fn send(
        &self,
        request: hyper::Request<Body>,
        max_body: usize,
    ) -> Result<Reply, String> {
        let mut request = request;
        loop {
            // A pooled connection the server has closed meanwhile gives the request back
            // unsent: it then goes on the next one, or a new one.
            let (mut conn, pooled) = match self.checkout().await {
                Some(conn) => (conn, true),
                None => (self.connect().await?, false),
            };
            let response = conn.sender.try_send_request(request);
            match exchange(&mut conn, response, max_body).await {
                Ok((reply, reusable)) => {
                    if reusable {
                        self.checkin(conn);
                    }
                    return Ok(reply);
                }
                Err(Failure::Unsent(back)) if pooled => request = *back,
                Err(Failure::Unsent(_)) => {
                    return Err("the connection closed before the request was sent".into());
                }
                Err(Failure::Failed(e)) => return Err(e),
            }
        }
    }

    /// An idle connection ready for a request, if one is left.
    async fn checkout(&self) -> Option<Conn> {
        loop {
            let mut conn = self.idle.lock().ok()?.pop()?;
            if conn.idle_since.elapsed() > IDLE_TIMEOUT {
                continue;
            }
            let ready = tokio::select! {
                biased;
                // The connection ended (the server closed it): not usable.
                _ = &mut conn.conn => false,
                ready = conn.sender.ready() => ready.is_ok(),
            };
            if ready {
                return Some(conn);
            }
        }
    }

    fn checkin(&self, mut conn: Conn) {
        conn.idle_since = Instant::now();
        if let Ok(mut idle) = self.idle.lock()
            && idle.len() < MAX_IDLE
        {
            idle.push(conn);
        }
    }

    async fn connect(&self) -> Result<Conn, String> {
        let stream = tokio::time::timeout(
            CONNECT_TIMEOUT,
            TcpStream::connect((self.host.as_str(), self.port)),
        )
        .await
        .map_err(|_| format!("connecting to {}:{} timed out", self.host, self.port))?
        .map_err(|e| format!("cannot connect to {}:{}: {e}", self.host, self.port))?;
        stream
            .set_nodelay(true)
            .map_err(|e| format!("cannot set TCP_NODELAY: {e}"))?;
        let (sender, conn) = http1::handshake(TokioIo::new(stream))
            .await
            .map_err(|e| format!("HTTP handshake failed: {e}"))?;
        Ok(Conn {
            sender,
            conn,
            idle_since: Instant::now(),
        })
    }
}

enum Failure {
    /// The request was not sent: it can go on another connection.
    Unsent(Box<hyper::Request<Body>>),
    Failed(String),
}

/// Drives `conn` while `response` is awaited and its body read; says whether the
/// connection can take another request.
async fn exchange(
    conn: &mut Conn,
    response: impl Future<
        Output = Result<
            hyper::Response<hyper::body::Incoming>,
            hyper::client::conn::TrySendError<hyper::Request<Body>>,
        >,
    >,
    max_body: usize,
) -> Result<(Reply, bool), Failure> {
    let call = async {
        let response = match response.await {
            Ok(response) => response,
            Err(mut e) => {
                return Err(match e.take_message() {
                    Some(request) => Failure::Unsent(Box::new(request)),
                    None => Failure::Failed(e.into_error().to_string()),
                });
            }
        };
        let (parts, mut body) = response.into_parts();
        let declared = parts
            .headers
            .get(hyper::header::CONTENT_LENGTH)
            .and_then(|v| v.to_str().ok())
            .and_then(|v| v.parse::<u64>().ok());
        let mut reply = Reply {
            status: parts.status,
            headers: parts.headers,
            body: Vec::new(),
            too_large: false,
        };
        if declared.is_some_and(|n| n > max_body as u64) {
            reply.too_large = true;
            return Ok((reply, false));
        }
        let mut data = Vec::with_capacity(declared.map_or(0, |n| n as usize));
        while let Some(frame) = body.frame().await {
            let frame = frame.map_err(|e| Failure::Failed(format!("reading the body: {e}")))?;
            if let Ok(chunk) = frame.into_data() {
                if data.len() + chunk.len() > max_body {
                    reply.too_large = true;
                    return Ok((reply, false));
                }
                data.extend_from_slice(&chunk);
            }
        }
        reply.body = data;
        Ok((reply, true))
    };
    tokio::pin!(call);
    let mut ended = false;
    let (reply, reusable) = loop {
        tokio::select! {
            out = &mut call => break out?,
            // The connection finished (a `Connection: close` answer, or an error the call
            // sees too): the call goes on with what it delivered.
            _ = &mut conn.conn, if !ended => ended = true,
        }
    };
    Ok((reply, reusable && !ended))
}
