//! A lean HTTP/2 client for cleartext servers that speak HTTP/2 from the first byte (h2c
//! with prior knowledge) beside the agent-server in the same cluster: model servers (vLLM,
//! the simulator) and the tool executor, whose unary gRPC calls go over it.
//!
//! Calls in flight share a few connections, and a call is one HTTP/2 stream on one of them,
//! driven by the caller's own task through `h2`. The general client (connection pool,
//! proxies, redirects, TLS) added about 4.5 KB to each call in flight, and a client built
//! on hyper spawns two tasks per call (one sends the body, one waits for the answer), about
//! 3 KB more (measured with `agentrt-bench`); that adds up when ten thousand runs wait on
//! their model at once. Here the body is handed to the stream whole and the answer is read
//! where it is awaited, so a call spawns nothing.
//!
//! A call takes the least busy connection that has a stream to spare under the server's
//! limit (`SETTINGS_MAX_CONCURRENT_STREAMS`, often about 100), the kept connections taking
//! turns among the equally busy; when none has, another connection is opened (up to 256),
//! so that calls never queue behind each other while the server would take them. A
//! connection is opened by the call that needs it, without holding the pool: the other
//! calls go on over the connections open, and wait for it only when none has room. At
//! least two connections are kept by default ([`H2cClient::with_min_connections`]): a
//! connection's state is locked by its driver task while it receives, and by every call
//! reading from it, and with two the worker threads wait on each other less (the
//! agent-server's CPU per streamed delta fell by 5 to 10% in `agentrt-bench`). Connections
//! beyond those kept that took no call for 90 s are closed. When another connection cannot
//! be opened while some are, calls go on over those and the next attempt waits 10 s. A
//! connection that closes (the server restarted, sent GOAWAY, stopped answering pings) is
//! dropped from the pool, and the next call opens another.
//!
//! A call the server did not process is sent again at once (on another connection when
//! its own is going away), without counting as a retry: one refused with
//! `REFUSED_STREAM`, one above the last stream id of the server's GOAWAY, one that failed
//! before its stream opened (RFC 9113, section 8.7). A call whose connection broke under it
//! after its stream opened fails as [`Failure::Lost`], and one whose stream the server
//! reset otherwise as [`Failure::Reset`]: the server may have processed either.
//!
//! Streams this client resets (a run cancelled mid-answer, a server slow to end its stream
//! after `[DONE]`) may still receive the frames the server had sent. RFC 9113 says to
//! ignore them, and h2 does, but only for the streams it remembers: by default the last 50
//! reset in the last second. Under load, frames for streams it forgot count as protocol
//! errors, answered with RST_STREAM, and at 1,024 of them in a connection's life h2 closes
//! the connection with GOAWAY `ENHANCE_YOUR_CALM` "too_many_internal_resets", failing every
//! call on it. So resets are remembered longer and in greater number
//! ([`RESETS_REMEMBERED`] for [`RESET_MEMORY`]).

use std::{
    pin::Pin,
    sync::{
        Arc,
        atomic::{AtomicBool, AtomicU32, AtomicU64, AtomicUsize, Ordering},
    },
    task::{Context, Poll},
    time::{Duration, Instant},
};

use bytes::Bytes;
use futures_util::Stream;
use h2::{RecvStream, client::SendRequest};
use http::{HeaderMap, HeaderValue, Request, Response, Uri, header::CONTENT_LENGTH};
use tokio::{net::TcpStream, sync::Mutex};
use tracing::debug;

/// Why a call failed, as far as sending it again is concerned.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Failure {
    /// No connection could be made: the server never saw the call.
    Unreachable,
    /// The server answered in HTTP/1: it does not speak HTTP/2 with prior knowledge.
    NotHttp2,
    /// The server did not process the call (it refused the stream, or the stream was
    /// past its GOAWAY), even after it was sent again on other connections.
    Unprocessed,
    /// The call was sent, and its connection broke (or went away) before the answer
    /// came: the server may have processed it.
    Lost,
    /// The call was sent, and the server reset its stream (other than refused) before the
    /// answer came: the server may have processed it, and it chose to end the call; the
    /// error's [`PostError::reason`] says with which code.
    Reset,
    /// Anything else (the request could not be made, and was not sent).
    Other,
}

/// A call that failed: why, and what happened.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PostError {
    /// Why, as far as sending it again is concerned.
    pub failure: Failure,
    /// What happened, for a log or an error message. It does not name the server's
    /// address (which the debug log does): callers say whom they called in their terms.
    pub message: String,
    /// The HTTP/2 error code, when the stream or the connection was ended with one.
    pub reason: Option<h2::Reason>,
}

impl PostError {
    fn new(failure: Failure, message: impl Into<String>) -> Self {
        Self {
            failure,
            message: message.into(),
            reason: None,
        }
    }

    fn of_h2(failure: Failure, error: &h2::Error) -> Self {
        Self {
            failure,
            message: error_chain(error),
            reason: error.reason(),
        }
    }
}

impl std::fmt::Display for PostError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.message)
    }
}

impl std::error::Error for PostError {}

/// `error` and its sources, `: `-separated.
#[must_use]
pub fn error_chain(error: &dyn std::error::Error) -> String {
    let mut text = error.to_string();
    let mut source = error.source();
    while let Some(cause) = source {
        text.push_str(": ");
        text.push_str(&cause.to_string());
        source = cause.source();
    }
    text
}

/// How often an open connection is pinged, and how long a pong may take before the
/// connection counts as dead.
const KEEP_ALIVE_INTERVAL: Duration = Duration::from_secs(30);
const KEEP_ALIVE_TIMEOUT: Duration = Duration::from_secs(10);
/// Streams reset by this client that h2 remembers, per connection, and for how long: a
/// frame the server sent before it saw the reset is then ignored instead of counting as a
/// protocol error (of which h2 tolerates 1,024 in a connection's life). A remembered reset
/// costs h2 a few hundred bytes, only while remembered: as many as a connection carries
/// calls when a whole load of them is cancelled at once (the simulator takes any number
/// of streams per connection; real servers about 100 to 1,000).
const RESETS_REMEMBERED: usize = 65_536;
const RESET_MEMORY: Duration = Duration::from_secs(10);
/// Times one call is sent again because the server did not process it (refused, or past
/// its GOAWAY, whose connection takes no more calls), before it fails.
const MAX_UNPROCESSED_RESENDS: usize = 4;
/// A connection whose streams reached this id takes no more calls: a client's stream ids
/// are the odd numbers below 2^31, and h2 refuses to open a stream past the last one.
const RETIRE_AFTER_STREAM_ID: u32 = (1 << 31) - (1 << 20);
/// Connections opened before calls share them, and kept open when idle, unless
/// [`H2cClient::with_min_connections`] says otherwise.
const MIN_CONNECTIONS: usize = 2;
/// Most connections to one endpoint; when all are at the server's stream limit, a call
/// waits for a stream on the least busy one.
const MAX_CONNECTIONS: usize = 256;
/// A connection beyond the minimum that took no call for this long is closed, so that a
/// burst does not leave its connections open for good.
const IDLE_TIMEOUT: Duration = Duration::from_secs(90);
/// After a failed attempt to open another connection while some are open, calls use those
/// for this long before another attempt: a server that takes fewer connections, or one
/// that stopped answering, must not make every call wait for a connect.
const CONNECT_BACKOFF: Duration = Duration::from_secs(10);

/// A cleartext HTTP/2 client of one endpoint.
pub struct H2cClient {
    uri: Uri,
    /// `host:port` to connect to.
    address: String,
    connect_timeout: Duration,
    idle_timeout: Duration,
    /// Connections opened before calls share them, and kept open when idle.
    min_connections: usize,
    /// What to do about a server that answers in HTTP/1, for its errors.
    http1_hint: Option<&'static str>,
    pool: Mutex<Pool>,
    /// Connections being opened, by calls that do not hold the pool meanwhile; each is
    /// counted by a [`Connecting`] guard, so that a call dropped while it connects (its
    /// deadline passed, its run was cancelled) does not leave the others waiting for a
    /// connection nobody opens.
    connecting: AtomicUsize,
    /// Told when a connection being opened is open, or could not be.
    connected: tokio::sync::Notify,
    /// The origin of the connections' times of last use.
    epoch: Instant,
}

/// The open connections (none until the first call), and until when no other is opened.
#[derive(Default)]
struct Pool {
    connections: Vec<Connection>,
    /// Milliseconds from the client's epoch.
    no_connect_before: u64,
    /// Where the next look for the least busy connection starts, so that calls made one
    /// at a time take the kept connections in turn (behind a load balancer, each may
    /// reach another replica of the server).
    turn: usize,
    /// Attempts to connect that failed while no connection was open, and the last one's
    /// error: the calls that waited for such an attempt fail with it, instead of each
    /// trying again in turn until their deadlines pass.
    failed_connects: u64,
    last_connect_failure: Option<PostError>,
}

/// A connection being opened, counted on the client until the guard is dropped, whether
/// the attempt ended or the call making it was dropped; the calls waiting for it are told.
struct Connecting<'a>(&'a H2cClient);

impl<'a> Connecting<'a> {
    fn start(client: &'a H2cClient) -> Self {
        client.connecting.fetch_add(1, Ordering::SeqCst);
        Self(client)
    }
}

impl Drop for Connecting<'_> {
    fn drop(&mut self) {
        self.0.connecting.fetch_sub(1, Ordering::SeqCst);
        self.0.connected.notify_waiters();
    }
}

/// Whole milliseconds of `duration`, the unit of the pool's times.
fn millis(duration: Duration) -> u64 {
    u64::try_from(duration.as_millis()).unwrap_or(u64::MAX)
}

/// One open connection: the handle that opens streams on it, whether its driver ended, and
/// how many calls are on it.
#[derive(Clone)]
struct Connection {
    sender: SendRequest<Bytes>,
    closed: Arc<AtomicBool>,
    usage: Arc<Load>,
    /// The last stream id of the server's GOAWAY, once one came.
    last_stream_id: Arc<AtomicU32>,
}

/// The calls on a connection, and when it last took one.
#[derive(Default)]
struct Load {
    calls: AtomicUsize,
    /// Milliseconds from the client's epoch.
    last_call: AtomicU64,
}

impl Connection {
    fn is_open(&self) -> bool {
        !self.closed.load(Ordering::Acquire)
    }

    fn calls(&self) -> usize {
        self.usage.calls.load(Ordering::Relaxed)
    }

    /// Whether the server takes another stream on it now.
    fn has_room(&self) -> bool {
        self.calls() < self.sender.current_max_send_streams()
    }

    /// Whether the server said, with GOAWAY, that it will not process stream `id`.
    fn refused_by_go_away(&self, id: u32) -> bool {
        id > self.last_stream_id.load(Ordering::Acquire)
    }

    /// Whether it has had no call since `since` (milliseconds from the client's epoch).
    fn idle_since(&self, since: u64) -> bool {
        self.calls() == 0 && self.usage.last_call.load(Ordering::Relaxed) < since
    }

    /// Counts a call on this connection, made at `now`, until the guard is dropped.
    fn call(&self, now: u64) -> CallGuard {
        self.usage.calls.fetch_add(1, Ordering::Relaxed);
        self.usage.last_call.store(now, Ordering::Relaxed);
        CallGuard(self.usage.clone())
    }
}

/// A call counted on its connection, from the moment it took it until its answer is read
/// or dropped.
struct CallGuard(Arc<Load>);

impl Drop for CallGuard {
    fn drop(&mut self) {
        self.0.calls.fetch_sub(1, Ordering::Relaxed);
    }
}

impl H2cClient {
    /// A client of `uri`, an `http://` URL; nothing connects before the first call.
    ///
    /// # Errors
    /// When `uri` is not an `http://` URL with a host.
    pub fn new(uri: &str, connect_timeout: Duration) -> Result<Self, String> {
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
            idle_timeout: IDLE_TIMEOUT,
            min_connections: MIN_CONNECTIONS,
            http1_hint: None,
            pool: Mutex::default(),
            connecting: AtomicUsize::new(0),
            connected: tokio::sync::Notify::new(),
            epoch: Instant::now(),
        })
    }

    /// Keeps at least `connections` open (at least one) once calls began.
    #[must_use]
    pub fn with_min_connections(mut self, connections: usize) -> Self {
        self.min_connections = connections.max(1);
        self
    }

    /// What a server that answers in HTTP/1 calls for, said in its errors (for example
    /// the setting to change).
    #[must_use]
    pub fn with_http1_hint(mut self, hint: &'static str) -> Self {
        self.http1_hint = Some(hint);
        self
    }

    fn millis_since_epoch(&self) -> u64 {
        millis(self.epoch.elapsed())
    }

    /// The connection for the next call, counted on it: the least busy open one with a
    /// stream to spare, or a new one while there are fewer than the minimum or all are full.
    /// The call that opens a connection takes it; the pool is not held meanwhile, so other
    /// calls go on over the connections open (and wait for it only when none has room).
    async fn connection(&self) -> Result<(Connection, CallGuard), PostError> {
        // Connect attempts that had failed when this call began waiting for one.
        let mut waited_after: Option<u64> = None;
        loop {
            // Made before the count of connections being opened is read: an attempt that
            // ends after that still wakes this call.
            let connected = self.connected.notified();
            let mut guard = self.pool.lock().await;
            let Pool {
                connections: pool,
                no_connect_before,
                turn,
                failed_connects,
                last_connect_failure,
            } = &mut *guard;
            if let Some(before) = waited_after
                && *failed_connects > before
                && pool.is_empty()
                && let Some(error) = last_connect_failure
            {
                // The attempt this call waited for found the server unreachable.
                return Err(error.clone());
            }
            let now = self.millis_since_epoch();
            let idle_since = now.saturating_sub(millis(self.idle_timeout));
            pool.retain(Connection::is_open);
            // Calls are only counted on a connection under this lock, so one found idle
            // here takes none while it is dropped; its driver ends once its last stream is
            // done.
            let mut closable = pool.len().saturating_sub(self.min_connections);
            pool.retain(|connection| {
                let close = closable > 0 && connection.idle_since(idle_since);
                closable -= usize::from(close);
                !close
            });
            // The kept connections take turns among the equally busy; those opened beyond
            // them for a burst come last, so that they fall idle and close once it passed.
            let kept = pool.len().min(self.min_connections);
            *turn = turn.wrapping_add(1);
            let start = *turn % kept.max(1);
            let spare = pool[start..kept]
                .iter()
                .chain(&pool[..start])
                .chain(&pool[kept..])
                .filter(|c| c.has_room())
                .min_by_key(|c| c.calls())
                .cloned();
            let connecting = self.connecting.load(Ordering::SeqCst);
            if spare.is_none() && connecting > 0 {
                // Another call is opening a connection: this one waits for it.
                waited_after.get_or_insert(*failed_connects);
                drop(guard);
                connected.await;
                continue;
            }
            let opened = pool.len() + connecting;
            let wanted = opened < self.min_connections || spare.is_none();
            let allowed = opened == 0 || (opened < MAX_CONNECTIONS && now >= *no_connect_before);
            if wanted && allowed {
                let attempt = Connecting::start(self);
                drop(guard);
                // Boxed: the handshake's state is large, and a future that held it inline
                // would carry that room through every call, though few calls connect.
                let result = Box::pin(self.connect()).await;
                let mut guard = self.pool.lock().await;
                let outcome = match result {
                    Ok(connection) => {
                        guard.connections.push(connection.clone());
                        let call = connection.call(self.millis_since_epoch());
                        Some(Ok((connection, call)))
                    }
                    Err(error) if guard.connections.is_empty() => {
                        guard.failed_connects += 1;
                        guard.last_connect_failure = Some(error.clone());
                        Some(Err(error))
                    }
                    Err(error) => {
                        debug!(address = %self.address, %error, "no other connection for now");
                        guard.no_connect_before = self
                            .millis_since_epoch()
                            .saturating_add(millis(CONNECT_BACKOFF));
                        None
                    }
                };
                // The waiting calls are told once the pool shows the outcome.
                drop(guard);
                drop(attempt);
                match outcome {
                    Some(outcome) => return outcome,
                    None => continue,
                }
            }
            // Else one with a stream to spare; with none, h2 queues the call on the least
            // busy one until the server takes another stream.
            let chosen = spare
                .or_else(|| pool.iter().min_by_key(|c| c.calls()).cloned())
                .ok_or_else(|| PostError::new(Failure::Unreachable, "no connection"))?;
            let call = chosen.call(now);
            return Ok((chosen, call));
        }
    }

    async fn connect(&self) -> Result<Connection, PostError> {
        // The address stays in the log: the message reaches callers' clients.
        let unreachable = |e: &dyn std::fmt::Display| {
            debug!(address = %self.address, error = %e, "cannot connect");
            PostError::new(Failure::Unreachable, format!("cannot connect: {e}"))
        };
        let stream = tokio::time::timeout(self.connect_timeout, TcpStream::connect(&self.address))
            .await
            .map_err(|_| unreachable(&"timed out"))?
            .map_err(|e| unreachable(&e))?;
        let _ = stream.set_nodelay(true);
        // The first bytes the server sends tell an HTTP/1 server from a broken one.
        let (stream, first_bytes, last_stream_id) = Sniff::new(stream);
        let not_h2 = |e: &dyn std::fmt::Display| {
            let answered = first_bytes.get().map(Vec::as_slice).unwrap_or_default();
            if answered.starts_with(b"HTTP/") {
                debug!(address = %self.address, "the server answered the HTTP/2 preface in HTTP/1");
                PostError::new(
                    Failure::NotHttp2,
                    format!(
                        "the server answered in HTTP/1: it does not speak HTTP/2 with prior \
                         knowledge (h2c){}",
                        self.http1_hint
                            .map(|h| format!("; {h}"))
                            .unwrap_or_default()
                    ),
                )
            } else {
                unreachable(&match self.http1_hint {
                    Some(hint) => {
                        format!(
                            "{e} (a server that speaks only HTTP/1.1 may do this: if so, {hint})"
                        )
                    }
                    None => format!("{e} (a server that speaks only HTTP/1.1 may do this)"),
                })
            }
        };
        let (sender, mut connection) = h2::client::Builder::new()
            // Large windows so that streaming calls never wait on flow control. The
            // connection window also sets h2's budget for small DATA frames not yet read
            // (half the window): SSE sends an event per frame, and when thousands of calls
            // answer at once, a small window makes h2 close the connection with every call
            // on it ("too_many_data_frames").
            .initial_connection_window_size(64 * 1024 * 1024)
            .initial_window_size(1024 * 1024)
            .max_concurrent_reset_streams(RESETS_REMEMBERED)
            .reset_stream_duration(RESET_MEMORY)
            .enable_push(false)
            .handshake::<_, Bytes>(stream)
            .await
            .map_err(|e| not_h2(&error_chain(&e)))?;
        let closed = Arc::new(AtomicBool::new(false));
        let mut pings = connection.ping_pong();
        let address = self.address.clone();
        let ended = closed.clone();
        let (settled, settling) = tokio::sync::oneshot::channel();
        tokio::spawn(async move {
            // Pings notice a peer that stopped answering; a connection that outlives its
            // pong is dropped, and the calls on it see the error on their own streams.
            let keep_alive = async {
                let Some(pings) = pings.as_mut() else {
                    let _ = settled.send(());
                    return std::future::pending().await;
                };
                // The server's settings come before its answer to a first ping: once that
                // is back, its limit on concurrent streams is known.
                if let Err(error) = pings.ping(h2::Ping::opaque()).await {
                    return error_chain(&error);
                }
                let _ = settled.send(());
                loop {
                    tokio::time::sleep(KEEP_ALIVE_INTERVAL).await;
                    match tokio::time::timeout(KEEP_ALIVE_TIMEOUT, pings.ping(h2::Ping::opaque()))
                        .await
                    {
                        Ok(Ok(_)) => {}
                        Ok(Err(error)) => return error_chain(&error),
                        Err(_) => return "no answer to a keep-alive ping".to_owned(),
                    }
                }
            };
            // Ends when the peer closes or every sender is dropped.
            let reason = tokio::select! {
                ended = &mut connection => match ended {
                    Ok(()) => "closed".to_owned(),
                    Err(error) => error_chain(&error),
                },
                reason = keep_alive => reason,
            };
            ended.store(true, Ordering::Release);
            debug!(%address, %reason, "connection closed");
        });
        match tokio::time::timeout(self.connect_timeout, settling).await {
            Ok(Ok(())) => {}
            Ok(Err(_)) => return Err(not_h2(&"the connection closed at its start")),
            Err(_) => return Err(not_h2(&"no answer to the first ping")),
        }
        debug!(
            address = %self.address,
            max_streams = sender.current_max_send_streams(),
            "connection open"
        );
        Ok(Connection {
            sender,
            closed,
            usage: Arc::default(),
            last_stream_id,
        })
    }

    /// POSTs `body` with `headers`; the response, its body still to read. A call the
    /// server did not process is sent again on another connection, up to
    /// [`MAX_UNPROCESSED_RESENDS`] times.
    ///
    /// Runs in flight spend most of their time in this future, waiting for the answer:
    /// it is an `async` block rather than an `async fn` (which keeps a second copy of its
    /// arguments), and what an attempt builds to send is gone before it awaits the answer.
    #[allow(
        clippy::manual_async_fn,
        reason = "an async fn keeps its arguments twice"
    )]
    pub fn post(
        &self,
        body: Bytes,
        headers: HeaderMap,
    ) -> impl Future<Output = Result<Response<H2Body>, PostError>> + Send + '_ {
        async move {
            let mut resent = 0;
            loop {
                match self.post_once(&body, &headers).await {
                    Ok(response) => return Ok(response),
                    Err(Attempt::Unprocessed(error)) if resent < MAX_UNPROCESSED_RESENDS => {
                        resent += 1;
                        debug!(
                            address = %self.address,
                            %error,
                            resent,
                            "the server did not process the call; sent again"
                        );
                    }
                    Err(Attempt::Unprocessed(error) | Attempt::Failed(error)) => return Err(error),
                }
            }
        }
    }

    async fn post_once(
        &self,
        body: &Bytes,
        headers: &HeaderMap,
    ) -> Result<Response<H2Body>, Attempt> {
        let (connection, call) = self.connection().await.map_err(Attempt::Failed)?;
        // Not usable for new calls: the next call opens another connection.
        let unusable = |e: &h2::Error| {
            if e.is_go_away() || e.is_io() {
                connection.closed.store(true, Ordering::Release);
            }
        };
        // Nothing was sent before the stream opened: whatever failed, the server has not
        // seen the call.
        let unsent = |e: h2::Error| {
            unusable(&e);
            Attempt::Unprocessed(PostError::of_h2(Failure::Unprocessed, &e))
        };
        // A connection that cannot open a stream (it broke, or its stream ids ran out) takes
        // no other call.
        let sender = connection.sender.clone().ready().await.map_err(|e| {
            connection.closed.store(true, Ordering::Release);
            unsent(e)
        })?;
        // After the stream opened, the server saw the call unless it refused the stream or
        // its GOAWAY's last stream id is below it.
        let sent = |id: u32, e: h2::Error| {
            unusable(&e);
            let refused = e.is_remote()
                && ((e.is_reset() && e.reason() == Some(h2::Reason::REFUSED_STREAM))
                    || (e.is_go_away() && connection.refused_by_go_away(id)));
            if refused {
                Attempt::Unprocessed(PostError::of_h2(Failure::Unprocessed, &e))
            } else if e.is_remote() && e.is_reset() {
                // The server, still there, ended the stream with an error code.
                Attempt::Failed(PostError::of_h2(Failure::Reset, &e))
            } else {
                // The connection broke, or went away with a GOAWAY that covers the
                // stream: the server may have processed the call.
                Attempt::Failed(PostError::of_h2(Failure::Lost, &e))
            }
        };
        // Sent in a block of its own: the request, the sender and the sending half of the
        // stream are dropped before the answer is awaited, and take no room while it is.
        let (response, id) = {
            let mut sender = sender;
            let mut request = Request::post(self.uri.clone()).body(()).map_err(|e| {
                Attempt::Failed(PostError::new(
                    Failure::Other,
                    format!("invalid request: {e}"),
                ))
            })?;
            let request_headers = request.headers_mut();
            request_headers.clone_from(headers);
            request_headers.insert(CONTENT_LENGTH, HeaderValue::from(body.len()));
            let (response, mut stream) = sender.send_request(request, false).map_err(unsent)?;
            let id = u32::from(response.stream_id());
            if id >= RETIRE_AFTER_STREAM_ID {
                // Its stream ids run out soon: the calls on it end there, the next ones go
                // to another connection.
                connection.closed.store(true, Ordering::Release);
            }
            // The whole body is queued at once; h2 sends it as the stream's window allows.
            stream
                .send_data(body.clone(), true)
                .map_err(|e| sent(id, e))?;
            (response, id)
        };
        let response = response.await.map_err(|e| sent(id, e))?;
        Ok(response.map(|body| H2Body {
            body,
            unreleased: 0,
            _call: call,
        }))
    }
}

/// How one attempt at a call failed.
enum Attempt {
    /// The server did not process the call: it may be sent again at once.
    Unprocessed(PostError),
    /// Anything else.
    Failed(PostError),
}

/// A connection that keeps the first bytes it reads (at most 8), until they are read, and
/// watches the frames it reads for a GOAWAY, whose last stream id it keeps: h2 fails the
/// streams above it without saying which id the server named.
struct Sniff {
    io: TcpStream,
    first: Option<Arc<std::sync::OnceLock<Vec<u8>>>>,
    frames: FrameWatch,
}

impl Sniff {
    fn new(io: TcpStream) -> (Self, Arc<std::sync::OnceLock<Vec<u8>>>, Arc<AtomicU32>) {
        let first = Arc::new(std::sync::OnceLock::new());
        let last_stream_id = Arc::new(AtomicU32::new(u32::MAX));
        let sniff = Self {
            io,
            first: Some(first.clone()),
            frames: FrameWatch::new(last_stream_id.clone()),
        };
        (sniff, first, last_stream_id)
    }
}

impl tokio::io::AsyncRead for Sniff {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut tokio::io::ReadBuf<'_>,
    ) -> Poll<std::io::Result<()>> {
        let before = buf.filled().len();
        std::task::ready!(Pin::new(&mut self.io).poll_read(cx, buf))?;
        let read = &buf.filled()[before..];
        if let Some(first) = self.first.take() {
            if read.is_empty() {
                self.first = Some(first);
            } else {
                let _ = first.set(read[..read.len().min(8)].to_vec());
            }
        }
        self.frames.read(read);
        Poll::Ready(Ok(()))
    }
}

/// Follows the HTTP/2 frames a server sends (from its first byte: a server's preface is a
/// SETTINGS frame) by their headers, skipping payloads, and keeps the last stream id of
/// the latest GOAWAY. Costs a few comparisons per frame.
struct FrameWatch {
    /// The frame header being read, and how much of it has arrived.
    header: [u8; 9],
    header_len: usize,
    /// Payload bytes of the current frame still to come.
    payload_left: usize,
    /// Whether the current frame is a GOAWAY, and the first four bytes of its payload
    /// (the last stream id) read so far.
    go_away: Option<([u8; 4], usize)>,
    last_stream_id: Arc<AtomicU32>,
}

impl FrameWatch {
    const GOAWAY: u8 = 0x7;

    fn new(last_stream_id: Arc<AtomicU32>) -> Self {
        Self {
            header: [0; 9],
            header_len: 0,
            payload_left: 0,
            go_away: None,
            last_stream_id,
        }
    }

    fn read(&mut self, mut bytes: &[u8]) {
        while !bytes.is_empty() {
            if self.payload_left > 0 {
                let n = self.payload_left.min(bytes.len());
                if let Some((id, got)) = &mut self.go_away
                    && *got < 4
                {
                    let take = (4 - *got).min(n);
                    id[*got..*got + take].copy_from_slice(&bytes[..take]);
                    *got += take;
                    if *got == 4 {
                        let last = u32::from_be_bytes(*id) & 0x7fff_ffff;
                        self.last_stream_id.store(last, Ordering::Release);
                    }
                }
                self.payload_left -= n;
                bytes = &bytes[n..];
                continue;
            }
            let n = (9 - self.header_len).min(bytes.len());
            self.header[self.header_len..self.header_len + n].copy_from_slice(&bytes[..n]);
            self.header_len += n;
            bytes = &bytes[n..];
            if self.header_len == 9 {
                self.header_len = 0;
                let h = self.header;
                self.payload_left =
                    usize::from(h[0]) << 16 | usize::from(h[1]) << 8 | usize::from(h[2]);
                self.go_away = (h[3] == Self::GOAWAY).then_some(([0; 4], 0));
            }
        }
    }
}

impl tokio::io::AsyncWrite for Sniff {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<std::io::Result<usize>> {
        Pin::new(&mut self.io).poll_write(cx, buf)
    }

    fn poll_write_vectored(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[std::io::IoSlice<'_>],
    ) -> Poll<std::io::Result<usize>> {
        Pin::new(&mut self.io).poll_write_vectored(cx, bufs)
    }

    fn is_write_vectored(&self) -> bool {
        self.io.is_write_vectored()
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.io).poll_flush(cx)
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.io).poll_shutdown(cx)
    }
}

/// Bytes of a response read before their room is given back to the server, unless the
/// reader waits first. Giving room back locks the connection's state, which its driver
/// task holds while it receives frames: once per chunk (an SSE event each) was a sixth
/// of the cost of a streamed delta. Kept far below the stream's window, and given back
/// whenever the reader would wait, so that neither a stream nor the connection ever
/// stalls on room held here.
const RELEASE_AT: usize = 16 * 1024;

/// A response body as a stream of bytes, the room of what was read given back to the
/// peer in batches. Dropped before its end, it resets the stream, and the server stops;
/// h2 gives back the room of a closed stream itself.
pub struct H2Body {
    body: RecvStream,
    /// Bytes read and not yet given back.
    unreleased: usize,
    /// Counts the call on its connection while the answer is read.
    _call: CallGuard,
}

impl H2Body {
    /// The trailers that end the response, once its data is read.
    ///
    /// # Errors
    /// When the stream fails before they come.
    pub async fn trailers(&mut self) -> Result<Option<HeaderMap>, h2::Error> {
        self.release();
        self.body.trailers().await
    }

    fn release(&mut self) {
        if self.unreleased > 0 {
            // Giving back what was read cannot fail while the stream is open, and once
            // it is closed there is nothing to give back.
            let _ = self.body.flow_control().release_capacity(self.unreleased);
            self.unreleased = 0;
        }
    }
}

impl Stream for H2Body {
    type Item = Result<Bytes, h2::Error>;

    fn poll_next(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Self::Item>> {
        let this = self.get_mut();
        match this.body.poll_data(cx) {
            Poll::Ready(Some(Ok(chunk))) => {
                this.unreleased += chunk.len();
                if this.unreleased >= RELEASE_AT {
                    this.release();
                }
                Poll::Ready(Some(Ok(chunk)))
            }
            Poll::Pending => {
                this.release();
                Poll::Pending
            }
            ended => ended,
        }
    }
}

#[cfg(test)]
mod tests {
    use futures_util::StreamExt;

    use super::*;

    /// Connection errors a raw HTTP/2 server saw, and requests it answered.
    #[derive(Default)]
    struct Seen {
        errors: std::sync::Mutex<Vec<String>>,
        answered: AtomicUsize,
    }

    /// A raw HTTP/2 server on a free port: `answer(n, request, respond)` answers the `n`th
    /// request of its connection; `shutdown_after` starts a graceful shutdown (GOAWAY) of
    /// a connection once it has accepted that many requests.
    async fn h2_server<F, Fut>(answer: F, shutdown_after: Option<usize>) -> (String, Arc<Seen>)
    where
        F: Fn(usize, Bytes, h2::server::SendResponse<Bytes>) -> Fut + Send + Sync + 'static,
        Fut: std::future::Future<Output = ()> + Send + 'static,
    {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let url = format!(
            "http://{}/v1/chat/completions",
            listener.local_addr().unwrap()
        );
        let seen = Arc::new(Seen::default());
        let answer = Arc::new(answer);
        let server_seen = seen.clone();
        tokio::spawn(async move {
            loop {
                let (socket, _) = listener.accept().await.unwrap();
                let (answer, seen) = (answer.clone(), server_seen.clone());
                tokio::spawn(async move {
                    let mut connection = h2::server::Builder::new()
                        .max_concurrent_streams(100_000)
                        .initial_window_size(1024 * 1024)
                        .handshake::<_, Bytes>(socket)
                        .await
                        .unwrap();
                    let mut accepted = 0;
                    while let Some(request) = connection.accept().await {
                        let (request, respond) = match request {
                            Ok(request) => request,
                            Err(error) => {
                                seen.errors.lock().unwrap().push(error.to_string());
                                break;
                            }
                        };
                        accepted += 1;
                        if shutdown_after == Some(accepted) {
                            connection.graceful_shutdown();
                        }
                        let (answer, seen, n) = (answer.clone(), seen.clone(), accepted);
                        tokio::spawn(async move {
                            let mut body = request.into_body();
                            let mut read = Vec::new();
                            while let Some(Ok(chunk)) = body.data().await {
                                let _ = body.flow_control().release_capacity(chunk.len());
                                read.extend_from_slice(&chunk);
                            }
                            answer(n, Bytes::from(read), respond).await;
                            seen.answered.fetch_add(1, Ordering::Relaxed);
                        });
                    }
                });
            }
        });
        (url, seen)
    }

    fn event_stream() -> Response<()> {
        Response::builder()
            .header("content-type", "text/event-stream")
            .body(())
            .unwrap()
    }

    /// Reads an answer to its end; the bytes read.
    async fn read_all(mut body: H2Body) -> Result<Vec<u8>, h2::Error> {
        let mut read = Vec::new();
        while let Some(chunk) = body.next().await {
            read.extend_from_slice(&chunk?);
        }
        Ok(read)
    }

    /// One call of `client` made after `delay`, its answer read to the end.
    async fn answer_after(client: &H2cClient, delay: Duration) -> Result<Vec<u8>, PostError> {
        tokio::time::sleep(delay).await;
        let answer = client
            .post(Bytes::from_static(b"q"), HeaderMap::new())
            .await?;
        read_all(answer.into_body())
            .await
            .map_err(|e| PostError::new(Failure::Other, e.to_string()))
    }

    /// Streams reset by the client still get the frames the server sent before it saw
    /// the reset. Under load h2 forgot such streams (it remembered 50, for a second) and
    /// counted each late frame as a protocol error; at 1,024 in a connection's life it
    /// closed the connection with GOAWAY ENHANCE_YOUR_CALM "too_many_internal_resets",
    /// failing every call on it. Here thousands of calls are dropped while their answers
    /// stream (runs cancelled or timed out mid-answer, or given up after `[DONE]` by a
    /// reader that fell behind), while a few slow calls share the connections.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn late_frames_on_streams_reset_under_load_do_not_close_the_connection() {
        let (url, seen) = h2_server(
            |_, request, mut respond| async move {
                let mut stream = respond.send_response(event_stream(), false).unwrap();
                let (chunks, pause) = if request.starts_with(b"slow") {
                    (40, Duration::from_millis(100))
                } else {
                    (1000, Duration::from_millis(2))
                };
                for _ in 0..chunks {
                    let chunk = Bytes::from_static(b"data: {}\n\n");
                    if stream.send_data(chunk, false).is_err() {
                        return;
                    }
                    tokio::time::sleep(pause).await;
                }
                let _ = stream.send_data(Bytes::from_static(b"data: [DONE]\n\n"), true);
            },
            None,
        )
        .await;
        let client = Arc::new(H2cClient::new(&url, Duration::from_secs(5)).unwrap());
        let slow: Vec<_> = (0..4)
            .map(|_| {
                let client = client.clone();
                tokio::spawn(async move {
                    let answer = client.post(Bytes::from_static(b"slow"), HeaderMap::new());
                    read_all(answer.await.map_err(|e| e.to_string())?.into_body())
                        .await
                        .map_err(|e| e.to_string())
                })
            })
            .collect();
        tokio::time::sleep(Duration::from_millis(100)).await;
        // Two waves of 3,000 calls dropped mid-answer: more than 1,024 per connection.
        for _ in 0..2 {
            let quick = (0..3000).map(|_| {
                let client = client.clone();
                async move {
                    let answer = client.post(Bytes::from_static(b"quick"), HeaderMap::new());
                    let mut body = answer.await.unwrap().into_body();
                    // The first chunk, then the answer is dropped: its stream is reset
                    // while the server is still sending.
                    body.next().await.unwrap().unwrap();
                }
            });
            futures_util::future::join_all(quick).await;
        }
        for call in slow {
            let read = call
                .await
                .unwrap()
                .expect("a slow answer on a busy connection");
            assert!(read.ends_with(b"data: [DONE]\n\n"));
        }
        tokio::time::sleep(Duration::from_millis(1500)).await;
        assert_eq!(*seen.errors.lock().unwrap(), Vec::<String>::new());
    }

    /// Calls above the last stream id of a server's GOAWAY were not processed: they are
    /// sent again on another connection, and each call is answered once.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn calls_a_goaway_left_unprocessed_are_sent_again_on_another_connection() {
        let (url, seen) = h2_server(
            |_, _, mut respond| async move {
                let mut stream = respond.send_response(event_stream(), false).unwrap();
                tokio::time::sleep(Duration::from_millis(100)).await;
                let _ = stream.send_data(Bytes::from_static(b"data: [DONE]\n\n"), true);
            },
            Some(10),
        )
        .await;
        let client = H2cClient::new(&url, Duration::from_secs(5)).unwrap();
        // A call every 2 ms: calls keep coming while connections go away.
        let calls = (0..60u64).map(|i| answer_after(&client, Duration::from_millis(2 * i)));
        for answer in futures_util::future::join_all(calls).await {
            assert_eq!(answer.unwrap(), b"data: [DONE]\n\n");
        }
        assert_eq!(seen.answered.load(Ordering::Relaxed), 60);
    }

    /// The last stream id of a GOAWAY is found among other frames, however the reads
    /// cut them.
    #[test]
    fn the_frame_watch_keeps_the_last_stream_id_of_a_goaway() {
        let frame = |kind: u8, stream: u32, payload: &[u8]| {
            let mut frame = u32::try_from(payload.len()).unwrap().to_be_bytes()[1..].to_vec();
            frame.extend_from_slice(&[kind, 0]);
            frame.extend_from_slice(&stream.to_be_bytes());
            frame.extend_from_slice(payload);
            frame
        };
        let mut bytes = frame(0x4, 0, &[0, 3, 0, 0, 0, 100]); // SETTINGS
        bytes.extend(frame(0x0, 7, b"data: [DONE]\n\n")); // DATA
        let mut go_away = 0x8000_0009u32.to_be_bytes().to_vec(); // reserved bit set
        go_away.extend_from_slice(&[0, 0, 0, 0]);
        go_away.extend_from_slice(b"bye");
        bytes.extend(frame(0x7, 0, &go_away));
        bytes.extend(frame(0x6, 0, &[0; 8])); // PING
        for cut in [1, 2, 5, 9, 10, 64] {
            let last = Arc::new(AtomicU32::new(u32::MAX));
            let mut watch = FrameWatch::new(last.clone());
            for chunk in bytes.chunks(cut) {
                watch.read(chunk);
            }
            assert_eq!(last.load(Ordering::Relaxed), 9, "reads of {cut} bytes");
        }
    }

    /// A stream refused with REFUSED_STREAM was not processed: the call is sent again.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn refused_streams_are_sent_again() {
        let (url, seen) = h2_server(
            |n, _, mut respond| async move {
                if n <= 2 {
                    respond.send_reset(h2::Reason::REFUSED_STREAM);
                    return;
                }
                let mut stream = respond.send_response(event_stream(), false).unwrap();
                let _ = stream.send_data(Bytes::from_static(b"data: [DONE]\n\n"), true);
            },
            None,
        )
        .await;
        let client = H2cClient::new(&url, Duration::from_secs(5)).unwrap();
        let calls = (0..20).map(|_| answer_after(&client, Duration::ZERO));
        for answer in futures_util::future::join_all(calls).await {
            assert_eq!(answer.unwrap(), b"data: [DONE]\n\n");
        }
        // Two refused on each of the two connections, each answered when sent again.
        assert_eq!(seen.answered.load(Ordering::Relaxed), 24);
    }

    /// A call the server saw, whose stream it then reset or whose connection it dropped
    /// before answering, is reset or lost (the server may have processed it), not
    /// unreachable.
    #[tokio::test]
    async fn a_call_reset_or_cut_off_after_it_was_sent_is_lost() {
        let (url, seen) = h2_server(
            |_, _, mut respond| async move { respond.send_reset(h2::Reason::INTERNAL_ERROR) },
            None,
        )
        .await;
        let client = H2cClient::new(&url, Duration::from_secs(5)).unwrap();
        let error = answer_after(&client, Duration::ZERO).await.unwrap_err();
        assert_eq!(error.failure, Failure::Reset, "{error}");
        assert_eq!(error.reason, Some(h2::Reason::INTERNAL_ERROR));
        assert_eq!(seen.answered.load(Ordering::Relaxed), 1);

        // A server that drops the connection once it has read a request.
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let url = format!("http://{}/v1", listener.local_addr().unwrap());
        tokio::spawn(async move {
            while let Ok((socket, _)) = listener.accept().await {
                tokio::spawn(async move {
                    let mut connection = h2::server::handshake(socket).await.unwrap();
                    // The connection, and the socket with it, are dropped at the first
                    // request.
                    let _request = connection.accept().await;
                });
            }
        });
        let client = H2cClient::new(&url, Duration::from_secs(5)).unwrap();
        let error = answer_after(&client, Duration::ZERO).await.unwrap_err();
        assert_eq!(error.failure, Failure::Lost, "{error}");
    }

    /// A server whose first connection never answers the handshake, and whose later ones
    /// are served; it counts the connections it accepted.
    async fn first_connection_silent() -> (String, Arc<AtomicUsize>) {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let url = format!("http://{}/v1", listener.local_addr().unwrap());
        let accepted = Arc::new(AtomicUsize::new(0));
        let counted = accepted.clone();
        tokio::spawn(async move {
            let mut silent = Vec::new();
            while let Ok((socket, _)) = listener.accept().await {
                if counted.fetch_add(1, Ordering::SeqCst) == 0 {
                    silent.push(socket);
                    continue;
                }
                tokio::spawn(async move {
                    let mut connection = h2::server::handshake(socket).await.unwrap();
                    while let Some(Ok((_, mut respond))) = connection.accept().await {
                        let mut stream = respond.send_response(event_stream(), false).unwrap();
                        let _ = stream.send_data(Bytes::from_static(b"data: [DONE]\n\n"), true);
                    }
                });
            }
        });
        (url, accepted)
    }

    /// A call dropped while it opens a connection (its deadline passed, its run was
    /// cancelled) must not leave the calls after it waiting for that connection forever.
    #[tokio::test]
    async fn a_call_dropped_while_it_connects_does_not_stop_the_next_from_connecting() {
        let (url, _) = first_connection_silent().await;
        let client = H2cClient::new(&url, Duration::from_secs(30)).unwrap();
        let first = tokio::time::timeout(
            Duration::from_millis(200),
            answer_after(&client, Duration::ZERO),
        )
        .await;
        assert!(first.is_err(), "the first connection is never answered");
        let next = tokio::time::timeout(
            Duration::from_secs(10),
            answer_after(&client, Duration::ZERO),
        )
        .await
        .expect("the next call opened a connection of its own")
        .unwrap();
        assert_eq!(next, b"data: [DONE]\n\n");
    }

    /// Calls that waited for a connection that could not be opened fail with its error,
    /// instead of each trying again in turn until their deadlines pass.
    #[tokio::test]
    async fn calls_waiting_for_a_connection_that_failed_fail_with_it() {
        let (url, accepted) = first_connection_silent().await;
        let client = H2cClient::new(&url, Duration::from_millis(300)).unwrap();
        let calls = (0..5).map(|_| answer_after(&client, Duration::ZERO));
        let errors = futures_util::future::join_all(calls).await;
        for error in errors {
            let error = error.unwrap_err();
            assert_eq!(error.failure, Failure::Unreachable, "{error}");
            assert!(
                error.message.contains("no answer to the first ping"),
                "{error}"
            );
        }
        assert_eq!(accepted.load(Ordering::SeqCst), 1, "one attempt, shared");
    }

    /// A server that cannot be reached is not named by its address in the message, which
    /// callers pass on to their clients; they name it in their own terms.
    #[tokio::test]
    async fn an_unreachable_server_is_not_named_by_its_address() {
        let address = std::net::TcpListener::bind("127.0.0.1:0")
            .unwrap()
            .local_addr()
            .unwrap();
        let client =
            H2cClient::new(&format!("http://{address}/v1"), Duration::from_secs(5)).unwrap();
        let error = answer_after(&client, Duration::ZERO).await.unwrap_err();
        assert_eq!(error.failure, Failure::Unreachable, "{error}");
        assert!(error.message.starts_with("cannot connect: "), "{error}");
        assert!(!error.message.contains("127.0.0.1"), "{error}");
    }

    /// Calls made one at a time take the connections in turn: behind a load balancer,
    /// each connection may reach another replica of the server.
    #[tokio::test]
    async fn calls_one_at_a_time_take_the_connections_in_turn() {
        let counts = Arc::new(std::sync::Mutex::new(Vec::new()));
        let seen_counts = counts.clone();
        let (url, _) = h2_server(
            move |n, _, mut respond| {
                seen_counts.lock().unwrap().push(n);
                async move {
                    let mut stream = respond.send_response(event_stream(), false).unwrap();
                    let _ = stream.send_data(Bytes::from_static(b"data: [DONE]\n\n"), true);
                }
            },
            None,
        )
        .await;
        let client = H2cClient::new(&url, Duration::from_secs(5))
            .unwrap()
            .with_min_connections(3);
        for _ in 0..6 {
            answer_after(&client, Duration::ZERO).await.unwrap();
        }
        // Each of the three connections answered its first and its second call.
        let mut counts = counts.lock().unwrap().clone();
        counts.sort_unstable();
        assert_eq!(counts, [1, 1, 1, 2, 2, 2]);
    }

    /// Connections opened for a burst are closed once idle, down to the minimum.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn connections_beyond_the_minimum_close_once_idle() {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let url = format!(
            "http://{}/v1/chat/completions",
            listener.local_addr().unwrap()
        );
        let settings = agentrt_simulator::Settings {
            max_concurrent_streams: Some(1),
            ..Default::default()
        };
        let stop = tokio_util::sync::CancellationToken::new();
        tokio::spawn(agentrt_simulator::serve(
            settings,
            listener,
            stop.clone().cancelled_owned(),
        ));
        let mut client = H2cClient::new(&url, Duration::from_secs(5)).unwrap();
        client.idle_timeout = Duration::from_millis(200);
        let body = Bytes::from_static(
            br#"{"model":"demo","stream":true,"messages":[{"role":"user","content":"hi"}]}"#,
        );
        let call = || client.post(body.clone(), HeaderMap::new());
        // One stream per connection: four calls at once need four connections.
        let answers = futures_util::future::join_all([call(), call(), call(), call()]).await;
        assert!(answers.iter().all(Result::is_ok));
        assert_eq!(client.pool.lock().await.connections.len(), 4);
        drop(answers);
        // Calls one at a time meanwhile go to the kept connections only: those opened for
        // the burst fall idle.
        for _ in 0..8 {
            tokio::time::sleep(Duration::from_millis(50)).await;
            let answer = call().await.unwrap();
            assert_eq!(answer.status(), 200);
        }
        assert_eq!(client.pool.lock().await.connections.len(), MIN_CONNECTIONS);
        stop.cancel();
    }
}
