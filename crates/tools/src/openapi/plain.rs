//! `http://` calls over HTTP/1.1 connections to the base URL's origin, written and read by
//! the call itself: a call is one write and, most often, one read on a socket already
//! open. Idle connections wait in a pool for the next call.
//!
//! Why not hyper's client connection: it takes the request and gives back the response
//! and its body over in-process channels, and each hand-over wakes the calling task once
//! more. On the multi-threaded runtime such a wake-up can unpark another worker, and those
//! wake-ups (futex calls, context switches) cost more CPU than the rest of the call. Here
//! the request's bytes are built at once, written with one system call, and the response
//! is parsed from one buffer, so the task wakes only when the answer arrives.
//!
//! Only what the OpenAPI source sends is implemented: requests whose body, if any, has a
//! `Content-Length`. Responses are read as RFC 9112 (section 6.3) frames them, with the
//! rules hyper applies: no body for `HEAD`, 1xx, 204 and 304, then `Transfer-Encoding` (`chunked`, or up to
//! the end of the connection), then `Content-Length`, else up to the end of the connection.
//! Informational (1xx) answers before the final one are skipped.

use std::{
    io::Write as _,
    sync::Mutex,
    task::{Context, Poll, Waker},
    time::{Duration, Instant},
};

use tokio::{
    io::{AsyncReadExt, AsyncWriteExt},
    net::TcpStream,
};

use super::{Outgoing, Reply};

/// How long opening a connection may take (as the shared client's).
const CONNECT_TIMEOUT: Duration = Duration::from_secs(10);
/// An idle connection older than this is closed rather than used (as the shared client's).
const IDLE_TIMEOUT: Duration = Duration::from_secs(90);
/// Most idle connections kept.
const MAX_IDLE: usize = 256;
/// Longest response head (status line and headers) read, and longest chunk-size line or
/// trailer section of a chunked body: a bound on what a server can make a call buffer
/// besides the body, which `max_response_bytes` bounds.
const MAX_HEAD_BYTES: usize = 64 * 1024;
/// Room made in a connection's read buffer before each read.
const READ_BYTES: usize = 8 * 1024;

/// Connections to one `host:port`.
pub(super) struct Pool {
    host: String,
    port: u16,
    /// `host: <authority>\r\n`: the same in every request, so written once.
    host_line: Vec<u8>,
    idle: Mutex<Vec<Conn>>,
}

struct Conn {
    stream: TcpStream,
    /// Bytes read and not used yet; empty between calls on a healthy connection.
    buf: Vec<u8>,
    idle_since: Instant,
}

/// Why an exchange failed.
enum Failure {
    /// Not a byte of the request was written: it can go on another connection.
    Unsent(String),
    Failed(String),
}

impl Pool {
    /// `authority` is the `Host` header's value (`host[:port]` as the base URL has it),
    /// already checked to be a valid header value.
    pub(super) fn new(host: &str, port: u16, authority: &str) -> Self {
        // An IPv6 literal comes bracketed in a URL; the resolver wants it bare.
        let host = host
            .trim_start_matches('[')
            .trim_end_matches(']')
            .to_owned();
        Self {
            host,
            port,
            host_line: format!("host: {authority}\r\n").into_bytes(),
            idle: Mutex::new(Vec::new()),
        }
    }

    /// The bytes of `request` on the wire: request line, headers and body.
    ///
    /// `Host` is the base URL's, `Accept` is `*/*` and `User-Agent` the tool executor's
    /// unless the request sets them, and the
    /// body's `Content-Length` is counted here. Headers of the request with these framing
    /// names (`Host`, `Content-Length`, `Transfer-Encoding`) are left out: the framing is
    /// the client's, and a model-given `Content-Length` could otherwise desynchronize the
    /// connection.
    pub(super) fn encode(&self, request: &Outgoing) -> Vec<u8> {
        use reqwest::header::{ACCEPT, CONTENT_LENGTH, HOST, TRANSFER_ENCODING, USER_AGENT};
        let body = request.body.as_deref().unwrap_or_default();
        let headers_len: usize = request
            .headers
            .iter()
            .map(|(name, value)| name.as_str().len() + value.len() + 4)
            .sum();
        let mut out = Vec::with_capacity(
            request.method.as_str().len()
                + request.target.len()
                + self.host_line.len()
                + headers_len
                + body.len()
                + 64,
        );
        out.extend_from_slice(request.method.as_str().as_bytes());
        out.push(b' ');
        out.extend_from_slice(request.target.as_bytes());
        out.extend_from_slice(b" HTTP/1.1\r\n");
        out.extend_from_slice(&self.host_line);
        for (name, value) in &request.headers {
            if name == HOST || name == CONTENT_LENGTH || name == TRANSFER_ENCODING {
                continue;
            }
            out.extend_from_slice(name.as_str().as_bytes());
            out.extend_from_slice(b": ");
            out.extend_from_slice(value.as_bytes());
            out.extend_from_slice(b"\r\n");
        }
        if !request.headers.contains_key(ACCEPT) {
            out.extend_from_slice(b"accept: */*\r\n");
        }
        if !request.headers.contains_key(USER_AGENT) {
            out.extend_from_slice(b"user-agent: ");
            out.extend_from_slice(crate::http::USER_AGENT.as_bytes());
            out.extend_from_slice(b"\r\n");
        }
        if !body.is_empty() {
            // Writing to a Vec cannot fail.
            let _ = write!(out, "content-length: {}\r\n", body.len());
        }
        out.extend_from_slice(b"\r\n");
        out.extend_from_slice(body);
        out
    }

    /// Sends `request` and reads at most `max_body` bytes of the answer's body.
    pub(super) async fn send(&self, request: &Outgoing, max_body: usize) -> Result<Reply, String> {
        let bytes = self.encode(request);
        let head_only = request.method == reqwest::Method::HEAD;
        loop {
            let (mut conn, pooled) = match self.checkout() {
                Some(conn) => (conn, true),
                None => (self.connect().await?, false),
            };
            match conn.exchange(&bytes, head_only, max_body).await {
                Ok((reply, reusable)) => {
                    if reusable {
                        self.checkin(conn);
                    }
                    return Ok(reply);
                }
                // A pooled connection the server has closed meanwhile: the request goes
                // on the next one, or a new one.
                Err(Failure::Unsent(_)) if pooled => {}
                Err(Failure::Unsent(e) | Failure::Failed(e)) => return Err(e),
            }
        }
    }

    /// An idle connection the server has not closed, if one is left.
    fn checkout(&self) -> Option<Conn> {
        loop {
            let conn = self.idle.lock().ok()?.pop()?;
            if conn.idle_since.elapsed() <= IDLE_TIMEOUT && conn.is_open() {
                return Some(conn);
            }
        }
    }

    fn checkin(&self, mut conn: Conn) {
        conn.idle_since = Instant::now();
        // A large head grew the buffer: idle connections keep only the usual room.
        conn.buf.shrink_to(READ_BYTES);
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
        Ok(Conn {
            stream,
            buf: Vec::with_capacity(READ_BYTES),
            idle_since: Instant::now(),
        })
    }
}

impl Conn {
    /// Whether the server has neither closed the connection nor sent anything while it was
    /// idle.
    ///
    /// Asks the runtime's readiness first: when the socket has had no event since its
    /// last read, it cannot have been closed, and that costs no system call.
    fn is_open(&self) -> bool {
        let mut cx = Context::from_waker(Waker::noop());
        match self.stream.poll_read_ready(&mut cx) {
            Poll::Pending => true,
            Poll::Ready(Err(_)) => false,
            // Readable: at the end (closed), with bytes nobody asked for, or a stale
            // event, which reading `WouldBlock` clears.
            Poll::Ready(Ok(())) => matches!(
                self.stream.try_read(&mut [0; 1]),
                Err(e) if e.kind() == std::io::ErrorKind::WouldBlock
            ),
        }
    }

    /// Writes `request`, reads the answer; says whether the connection can take another
    /// request.
    async fn exchange(
        &mut self,
        request: &[u8],
        head_only: bool,
        max_body: usize,
    ) -> Result<(Reply, bool), Failure> {
        self.send_request(request).await?;
        let head = loop {
            let head = self.read_head().await.map_err(Failure::Failed)?;
            if !head.is_interim() {
                break head;
            }
        };
        self.read_body(head, head_only, max_body)
            .await
            .map_err(Failure::Failed)
    }

    async fn send_request(&mut self, mut bytes: &[u8]) -> Result<(), Failure> {
        let mut written = false;
        while !bytes.is_empty() {
            match self.stream.write(bytes).await {
                Ok(0) => {
                    return Err(Failure::Failed(
                        "the connection closed while the request was sent".into(),
                    ));
                }
                Ok(n) => {
                    bytes = &bytes[n..];
                    written = true;
                }
                Err(e) if !written => {
                    return Err(Failure::Unsent(format!("sending the request: {e}")));
                }
                Err(e) => return Err(Failure::Failed(format!("sending the request: {e}"))),
            }
        }
        Ok(())
    }

    /// Reads more bytes into the buffer; an error when the connection has ended.
    async fn fill(&mut self, what: &str) -> Result<(), String> {
        if self.buf.capacity() - self.buf.len() < READ_BYTES / 2 {
            self.buf.reserve(READ_BYTES);
        }
        match self.stream.read_buf(&mut self.buf).await {
            Ok(0) => Err(format!("the connection closed before the end of {what}")),
            Ok(_) => Ok(()),
            Err(e) => Err(format!("reading {what}: {e}")),
        }
    }

    /// Reads and parses one response head, which then leaves the buffer.
    async fn read_head(&mut self) -> Result<Head, String> {
        let mut scanned = 0;
        loop {
            // Empty lines before a status line are skipped (as httparse does).
            let blank = self
                .buf
                .iter()
                .take_while(|&&b| b == b'\r' || b == b'\n')
                .count();
            if blank > 0 {
                self.buf.drain(..blank);
                scanned = 0;
            }
            if let Some(end) = head_end(&self.buf, scanned) {
                let head = parse_head(&self.buf[..end])?;
                self.buf.drain(..end);
                return Ok(head);
            }
            if self.buf.len() > MAX_HEAD_BYTES {
                return Err(format!(
                    "the response head is larger than {MAX_HEAD_BYTES} bytes"
                ));
            }
            // Where the search goes on: the end's first bytes may already be here.
            scanned = self.buf.len();
            self.fill("the response head").await?;
        }
    }

    /// Reads the body `head` announces; says whether the connection can be used again.
    async fn read_body(
        &mut self,
        head: Head,
        head_only: bool,
        max_body: usize,
    ) -> Result<(Reply, bool), String> {
        let framing = head.framing(head_only)?;
        let mut reply = Reply {
            status: reqwest::StatusCode::from_u16(head.status)
                .map_err(|_| format!("invalid status {} in the response", head.status))?,
            location: head.location,
            content_type: head.content_type,
            body: Vec::new(),
            too_large: false,
        };
        // Only a body framed by its length is known too large before it is read: a
        // `Content-Length` says nothing of the body of an answer to HEAD, of a 204 or 304
        // (which have none), or of a chunked one (RFC 9112 has it ignored then).
        if let Framing::Length(n) = framing
            && n > max_body as u64
        {
            reply.too_large = true;
            return Ok((reply, false));
        }
        let complete = match framing {
            Framing::Empty => true,
            // Not above `max_body`: checked just above.
            Framing::Length(n) => {
                reply.body = Vec::with_capacity(n as usize);
                self.read_exact(&mut reply.body, n as usize).await?;
                true
            }
            Framing::Chunked => self.read_chunked(&mut reply.body, max_body).await?,
            Framing::Close => self.read_to_end(&mut reply.body, max_body).await?,
        };
        if !complete {
            reply.too_large = true;
            reply.body = Vec::new();
            return Ok((reply, false));
        }
        // Bytes after the answer were not asked for: the connection is not trusted again.
        let reusable = head.keep_alive
            && head.status != 101
            && !matches!(framing, Framing::Close)
            && self.buf.is_empty();
        Ok((reply, reusable))
    }

    /// Appends the next `n` body bytes to `out`: those already read, then the rest read
    /// straight into `out` (a large body is not copied twice).
    async fn read_exact(&mut self, out: &mut Vec<u8>, n: usize) -> Result<(), String> {
        let buffered = self.buf.len().min(n);
        out.extend_from_slice(&self.buf[..buffered]);
        self.buf.drain(..buffered);
        let end = out.len() + (n - buffered);
        while out.len() < end {
            out.reserve(end - out.len());
            let read = (&mut self.stream)
                .take((end - out.len()) as u64)
                .read_buf(out)
                .await
                .map_err(|e| format!("reading the body: {e}"))?;
            if read == 0 {
                return Err("reading the body: the connection closed before its end".into());
            }
        }
        Ok(())
    }

    /// A `chunked` body into `out`; false when it is larger than `max_body`.
    async fn read_chunked(&mut self, out: &mut Vec<u8>, max_body: usize) -> Result<bool, String> {
        loop {
            let end = self.line("a chunk size").await?;
            let size = chunk_size(trim_cr(&self.buf[..end]))
                .ok_or("reading the body: invalid chunk size")?;
            self.buf.drain(..=end);
            if size == 0 {
                // Trailers, up to an empty line; not kept.
                let mut trailers = 0;
                loop {
                    let end = self.line("the trailers").await?;
                    let blank = trim_cr(&self.buf[..end]).is_empty();
                    self.buf.drain(..=end);
                    trailers += end + 1;
                    if blank {
                        return Ok(true);
                    }
                    if trailers > MAX_HEAD_BYTES {
                        return Err(format!(
                            "reading the body: trailers larger than {MAX_HEAD_BYTES} bytes"
                        ));
                    }
                }
            }
            if size > (max_body - out.len()) as u64 {
                return Ok(false);
            }
            self.read_exact(out, size as usize).await?;
            let end = self.line("a chunk").await?;
            if !trim_cr(&self.buf[..end]).is_empty() {
                return Err("reading the body: a chunk is longer than its size".into());
            }
            self.buf.drain(..=end);
        }
    }

    /// A body that ends with the connection, into `out`; false when it is larger than
    /// `max_body`.
    async fn read_to_end(&mut self, out: &mut Vec<u8>, max_body: usize) -> Result<bool, String> {
        *out = std::mem::take(&mut self.buf);
        loop {
            if out.len() > max_body {
                return Ok(false);
            }
            out.reserve(READ_BYTES);
            // One byte more than allowed tells a body that is too large.
            let read = (&mut self.stream)
                .take((max_body + 1 - out.len()) as u64)
                .read_buf(out)
                .await
                .map_err(|e| format!("reading the body: {e}"))?;
            if read == 0 {
                return Ok(true);
            }
        }
    }

    /// The position of the next `\n` in the buffer, reading until there is one.
    async fn line(&mut self, what: &str) -> Result<usize, String> {
        let mut scanned = 0;
        loop {
            if let Some(at) = self.buf[scanned..].iter().position(|&b| b == b'\n') {
                return Ok(scanned + at);
            }
            if self.buf.len() > MAX_HEAD_BYTES {
                return Err(format!(
                    "reading the body: {what} is longer than {MAX_HEAD_BYTES} bytes"
                ));
            }
            scanned = self.buf.len();
            self.fill("the body").await?;
        }
    }
}

/// Where the head in `buf` ends (after its empty line), searching from about `from`.
fn head_end(buf: &[u8], from: usize) -> Option<usize> {
    let start = from.saturating_sub(2);
    let mut at = start;
    while let Some(i) = buf[at..].iter().position(|&b| b == b'\n') {
        let nl = at + i;
        match &buf[nl + 1..] {
            [b'\n', ..] => return Some(nl + 2),
            [b'\r', b'\n', ..] => return Some(nl + 3),
            _ => at = nl + 1,
        }
    }
    None
}

fn trim_cr(line: &[u8]) -> &[u8] {
    line.strip_suffix(b"\r").unwrap_or(line)
}

/// What a response head says.
#[derive(Debug)]
struct Head {
    status: u16,
    http_11: bool,
    /// Whether the server keeps the connection open after this response.
    keep_alive: bool,
    /// `Content-Length` when given: its value, or an error when its values are not all
    /// the same number.
    content_length: Option<Result<u64, ()>>,
    /// `Transfer-Encoding` when given: whether `chunked` is its last coding.
    chunked: Option<bool>,
    /// The first `Location`, when it is visible ASCII.
    location: Option<String>,
    /// The first `Content-Type`, when it is visible ASCII.
    content_type: Option<String>,
}

/// How a response body is delimited.
#[derive(Debug, Clone, Copy, PartialEq)]
enum Framing {
    Empty,
    Length(u64),
    Chunked,
    Close,
}

impl Head {
    /// An informational answer the final one follows (`101` ends the exchange instead).
    fn is_interim(&self) -> bool {
        (100..200).contains(&self.status) && self.status != 101
    }

    /// How the body is delimited (RFC 9112, section 6.3).
    fn framing(&self, head_only: bool) -> Result<Framing, String> {
        if head_only || matches!(self.status, 100..=199 | 204 | 304) {
            return Ok(Framing::Empty);
        }
        match (self.chunked, self.content_length) {
            (Some(_), _) if !self.http_11 => {
                Err("an HTTP/1.0 response with a Transfer-Encoding".into())
            }
            (Some(true), _) => Ok(Framing::Chunked),
            (Some(false), _) => Ok(Framing::Close),
            (None, Some(Ok(n))) => Ok(Framing::Length(n)),
            (None, Some(Err(()))) => Err("the response has an invalid Content-Length".into()),
            (None, None) => Ok(Framing::Close),
        }
    }
}

/// Parses a response head, its final empty line included.
fn parse_head(head: &[u8]) -> Result<Head, String> {
    let invalid = || "the response head is not valid HTTP/1.1".to_owned();
    let mut lines = head.split(|&b| b == b'\n').map(trim_cr);
    let status_line = lines.next().ok_or_else(invalid)?;
    let (http_11, status) = parse_status_line(status_line).ok_or_else(invalid)?;
    let mut parsed = Head {
        status,
        http_11,
        keep_alive: http_11,
        content_length: None,
        chunked: None,
        location: None,
        content_type: None,
    };
    let mut location_seen = false;
    let mut close = false;
    for line in lines.filter(|line| !line.is_empty()) {
        let colon = line.iter().position(|&b| b == b':').ok_or_else(invalid)?;
        let name = &line[..colon];
        let value = trim_ows(&line[colon + 1..]);
        if name.is_empty()
            || !name.iter().all(|&b| is_token(b))
            || value.iter().any(|&b| (b < b' ' && b != b'\t') || b == 0x7f)
        {
            return Err(invalid());
        }
        // The list headers below are read as hyper reads them: as text, or not at all.
        let text = std::str::from_utf8(value)
            .ok()
            .filter(|_| is_visible(value));
        if name.eq_ignore_ascii_case(b"content-length") {
            // All the values of all the lines must be one number.
            let this = text.and_then(|t| {
                let mut seen = None;
                for v in t.split(',') {
                    let n = digits(v.trim().as_bytes())?;
                    if seen.is_some_and(|m| m != n) {
                        return None;
                    }
                    seen = Some(n);
                }
                seen
            });
            parsed.content_length = match (parsed.content_length, this) {
                (None, Some(n)) => Some(Ok(n)),
                (Some(Ok(m)), Some(n)) if m == n => Some(Ok(n)),
                _ => Some(Err(())),
            };
        } else if name.eq_ignore_ascii_case(b"transfer-encoding") {
            parsed.chunked = Some(text.is_some_and(|t| {
                t.rsplit(',')
                    .next()
                    .is_some_and(|last| last.trim().eq_ignore_ascii_case("chunked"))
            }));
        } else if name.eq_ignore_ascii_case(b"connection") {
            let has = |token: &str| {
                text.is_some_and(|t| t.split(',').any(|v| v.trim().eq_ignore_ascii_case(token)))
            };
            // One `close` among several `Connection` lines wins over any `keep-alive`.
            if close || has("close") {
                close = true;
                parsed.keep_alive = false;
            } else if !parsed.keep_alive {
                parsed.keep_alive = has("keep-alive");
            }
        } else if name.eq_ignore_ascii_case(b"location") && !location_seen {
            location_seen = true;
            parsed.location = text.map(str::to_owned);
        } else if name.eq_ignore_ascii_case(b"content-type") && parsed.content_type.is_none() {
            parsed.content_type = text.map(str::to_owned);
        }
    }
    Ok(parsed)
}

/// `HTTP/1.x NNN [reason]`: whether it is HTTP/1.1, and the status.
fn parse_status_line(line: &[u8]) -> Option<(bool, u16)> {
    let rest = line.strip_prefix(b"HTTP/1.")?;
    let (http_11, rest) = match rest {
        [b'1', b' ', rest @ ..] => (true, rest),
        [b'0', b' ', rest @ ..] => (false, rest),
        _ => return None,
    };
    let (code, reason) = rest.split_at_checked(3)?;
    if !(reason.is_empty() || reason[0] == b' ')
        || reason
            .iter()
            .any(|&b| (b < b' ' && b != b'\t') || b == 0x7f)
    {
        return None;
    }
    let status = u16::try_from(digits(code)?).ok()?;
    Some((http_11, status))
}

/// A decimal number of digits only (no sign, no spaces).
fn digits(bytes: &[u8]) -> Option<u64> {
    if bytes.is_empty() {
        return None;
    }
    bytes.iter().try_fold(0u64, |n, &b| {
        let digit = (b as char).to_digit(10)?;
        n.checked_mul(10)?.checked_add(u64::from(digit))
    })
}

/// A chunk-size line's size: hex digits, then optional whitespace and extensions.
fn chunk_size(line: &[u8]) -> Option<u64> {
    let hex = line.iter().take_while(|b| b.is_ascii_hexdigit()).count();
    if hex == 0 {
        return None;
    }
    let rest = trim_ows(&line[hex..]);
    if !(rest.is_empty() || rest[0] == b';') {
        return None;
    }
    line[..hex].iter().try_fold(0u64, |n, &b| {
        let digit = (b as char).to_digit(16)?;
        n.checked_mul(16)?.checked_add(u64::from(digit))
    })
}

fn trim_ows(bytes: &[u8]) -> &[u8] {
    let start = bytes
        .iter()
        .position(|&b| b != b' ' && b != b'\t')
        .unwrap_or(bytes.len());
    let end = bytes
        .iter()
        .rposition(|&b| b != b' ' && b != b'\t')
        .map_or(start, |i| i + 1);
    &bytes[start..end]
}

/// A header value that is text as `HeaderValue::to_str` takes it: visible ASCII, spaces
/// and tabs.
fn is_visible(value: &[u8]) -> bool {
    value
        .iter()
        .all(|&b| b == b'\t' || (b' '..0x7f).contains(&b))
}

/// RFC 9110's `tchar`: what a header name is made of.
fn is_token(b: u8) -> bool {
    b.is_ascii_alphanumeric() || b"!#$%&'*+-.^_`|~".contains(&b)
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]

    use std::sync::{
        Arc,
        atomic::{AtomicUsize, Ordering},
    };

    use tokio::net::TcpListener;

    use super::*;

    /// A server answering each request with the response its path names (`/echo` sends
    /// back the request's bytes); the count of connections it accepted.
    async fn scripted_server() -> (u16, Arc<AtomicUsize>) {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let port = listener.local_addr().unwrap().port();
        let accepted = Arc::new(AtomicUsize::new(0));
        let counter = accepted.clone();
        tokio::spawn(async move {
            loop {
                let (mut socket, _) = listener.accept().await.unwrap();
                counter.fetch_add(1, Ordering::SeqCst);
                tokio::spawn(async move {
                    let mut buf = Vec::new();
                    let mut chunk = [0; 4096];
                    loop {
                        let end = loop {
                            if let Some(end) = head_end(&buf, 0) {
                                break end;
                            }
                            match socket.read(&mut chunk).await {
                                Ok(0) | Err(_) => return,
                                Ok(n) => buf.extend_from_slice(&chunk[..n]),
                            }
                        };
                        let head = String::from_utf8(buf.drain(..end).collect()).unwrap();
                        let length: usize = head
                            .lines()
                            .find_map(|line| line.strip_prefix("content-length: "))
                            .map_or(0, |n| n.parse().unwrap());
                        while buf.len() < length {
                            let n = socket.read(&mut chunk).await.unwrap();
                            buf.extend_from_slice(&chunk[..n]);
                        }
                        let body: Vec<u8> = buf.drain(..length).collect();
                        let (response, close) = match head.split(' ').nth(1).unwrap() {
                            "/chunked" => (
                                "HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n\
                                 4;x=y\r\nWiki\r\n5\r\npedia\r\n0\r\nx-trailer: 1\r\n\r\n"
                                    .to_owned(),
                                false,
                            ),
                            "/interim" => (
                                "HTTP/1.1 100 Continue\r\n\r\nHTTP/1.1 103 Early Hints\r\n\
                                 link: </a>\r\n\r\nHTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\nok"
                                    .to_owned(),
                                false,
                            ),
                            "/head" => (
                                "HTTP/1.1 200 OK\r\ncontent-length: 10\r\n\r\n".to_owned(),
                                false,
                            ),
                            "/extra" => (
                                "HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\nokEXTRA".to_owned(),
                                false,
                            ),
                            "/close" => (
                                "HTTP/1.1 200 OK\r\nconnection: close\r\ncontent-length: 3\r\n\r\nbye"
                                    .to_owned(),
                                true,
                            ),
                            "/eof" => ("HTTP/1.1 200 OK\r\n\r\nuntil the end".to_owned(), true),
                            // Closes without saying so.
                            "/drop" => (
                                "HTTP/1.1 200 OK\r\ncontent-length: 4\r\n\r\ndrop".to_owned(),
                                true,
                            ),
                            "/big" => (
                                "HTTP/1.1 200 OK\r\ncontent-length: 5000\r\n\r\n".to_owned(),
                                true,
                            ),
                            "/big-chunked" => (
                                format!(
                                    "HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n\
                                     400\r\n{}\r\n1\r\nx\r\n0\r\n\r\n",
                                    "x".repeat(1024)
                                ),
                                false,
                            ),
                            // A length that frames nothing: a 204 has no body, and
                            // `chunked` wins over `Content-Length`.
                            "/no-content" => (
                                "HTTP/1.1 204 No Content\r\ncontent-length: 5000\r\n\r\n"
                                    .to_owned(),
                                false,
                            ),
                            "/chunked-length" => (
                                "HTTP/1.1 200 OK\r\ncontent-length: 5000\r\n\
                                 transfer-encoding: chunked\r\n\r\n2\r\nok\r\n0\r\n\r\n"
                                    .to_owned(),
                                false,
                            ),
                            "/redirect" => (
                                "HTTP/1.1 302 Found\r\nlocation: http://elsewhere.test/x\r\n\
                                 content-length: 0\r\n\r\n"
                                    .to_owned(),
                                false,
                            ),
                            "/echo" => (
                                format!(
                                    "HTTP/1.1 200 OK\r\ncontent-length: {}\r\n\r\n{head}{}",
                                    head.len() + body.len(),
                                    String::from_utf8(body).unwrap()
                                ),
                                false,
                            ),
                            _ => ("SMTP ready\r\n\r\n".to_owned(), true),
                        };
                        socket.write_all(response.as_bytes()).await.unwrap();
                        if close {
                            return;
                        }
                    }
                });
            }
        });
        (port, accepted)
    }

    fn get(target: &str) -> Outgoing {
        Outgoing {
            method: reqwest::Method::GET,
            target: target.to_owned(),
            headers: reqwest::header::HeaderMap::new(),
            body: None,
        }
    }

    #[tokio::test]
    async fn responses_are_read_as_framed_and_connections_reused_only_when_clean() {
        let (port, accepted) = scripted_server().await;
        let pool = Pool::new("127.0.0.1", port, &format!("127.0.0.1:{port}"));
        let max = 1024;
        let connections = || accepted.load(Ordering::SeqCst);

        let reply = pool.send(&get("/chunked"), max).await.unwrap();
        assert_eq!(
            (reply.status.as_u16(), &reply.body[..]),
            (200, &b"Wikipedia"[..])
        );
        let reply = pool.send(&get("/interim"), max).await.unwrap();
        assert_eq!((reply.status.as_u16(), &reply.body[..]), (200, &b"ok"[..]));
        let mut head = get("/head");
        head.method = reqwest::Method::HEAD;
        let reply = pool.send(&head, max).await.unwrap();
        assert!(reply.body.is_empty() && !reply.too_large);
        let mut echo = get("/echo");
        echo.method = reqwest::Method::POST;
        echo.headers.insert("x-mode", "fast".parse().unwrap());
        echo.headers.insert("content-length", "1".parse().unwrap());
        echo.body = Some(bytes::Bytes::from_static(br#"{"n":1}"#));
        let reply = pool.send(&echo, max).await.unwrap();
        assert_eq!(
            String::from_utf8(reply.body).unwrap(),
            format!(
                "POST /echo HTTP/1.1\r\nhost: 127.0.0.1:{port}\r\nx-mode: fast\r\n\
                 accept: */*\r\nuser-agent: {}\r\ncontent-length: 7\r\n\r\n{{\"n\":1}}",
                crate::http::USER_AGENT
            )
        );
        assert_eq!(connections(), 1, "one connection for all of these");

        // Bytes past the answer: the connection is not used again.
        let reply = pool.send(&get("/extra"), max).await.unwrap();
        assert_eq!(reply.body, b"ok");
        pool.send(&get("/chunked"), max).await.unwrap();
        assert_eq!(connections(), 2);
        for (target, body) in [("/close", "bye"), ("/eof", "until the end")] {
            let reply = pool.send(&get(target), max).await.unwrap();
            assert_eq!(reply.body, body.as_bytes());
            pool.send(&get("/chunked"), max).await.unwrap();
        }
        assert_eq!(connections(), 4);
        // The server closes a connection it kept: the next call notices and opens one.
        pool.send(&get("/drop"), max).await.unwrap();
        tokio::time::sleep(Duration::from_millis(50)).await;
        let reply = pool.send(&get("/chunked"), max).await.unwrap();
        assert_eq!(reply.body, b"Wikipedia");
        assert_eq!(connections(), 5);

        for target in ["/big", "/big-chunked"] {
            let reply = pool.send(&get(target), max).await.unwrap();
            assert!(reply.too_large, "{target}");
        }
        let reply = pool.send(&get("/redirect"), max).await.unwrap();
        assert_eq!(reply.status.as_u16(), 302);
        assert_eq!(reply.location.as_deref(), Some("http://elsewhere.test/x"));
        let err = pool.send(&get("/smtp"), max).await.err().unwrap();
        assert!(err.contains("not valid HTTP/1.1"), "{err}");
    }

    /// A `Content-Length` above the bound makes an answer too large only when it frames
    /// the body: an answer to HEAD, a 204 or a 304 has none, and a chunked body is as long
    /// as its chunks. These were refused as too large, and their connection closed.
    #[tokio::test]
    async fn a_content_length_counts_only_where_it_frames_the_body() {
        let (port, accepted) = scripted_server().await;
        let pool = Pool::new("127.0.0.1", port, &format!("127.0.0.1:{port}"));
        let max = 1024;

        let reply = pool.send(&get("/no-content"), max).await.unwrap();
        assert_eq!(reply.status.as_u16(), 204);
        assert!(!reply.too_large && reply.body.is_empty());
        let reply = pool.send(&get("/chunked-length"), max).await.unwrap();
        assert!(!reply.too_large);
        assert_eq!(reply.body, b"ok");
        let mut head = get("/big");
        head.method = reqwest::Method::HEAD;
        let reply = pool.send(&head, max).await.unwrap();
        assert!(!reply.too_large && reply.body.is_empty());
        // Each read to its end: the connection was used again.
        assert_eq!(accepted.load(Ordering::SeqCst), 1);
    }

    fn head(text: &str) -> Head {
        parse_head(text.as_bytes()).unwrap()
    }

    #[test]
    fn heads_are_framed_as_rfc_9112_says() {
        let h = head(
            "HTTP/1.1 200 OK\r\nContent-Length: 12\r\nLocation: /x\r\n\
             Content-Type: text/plain; charset=latin1\r\nContent-Type: image/png\r\n\r\n",
        );
        assert_eq!(h.framing(false).unwrap(), Framing::Length(12));
        assert_eq!(h.framing(true).unwrap(), Framing::Empty);
        assert!(h.keep_alive);
        assert_eq!(h.location.as_deref(), Some("/x"));
        assert_eq!(
            h.content_type.as_deref(),
            Some("text/plain; charset=latin1")
        );

        let h = head(
            "HTTP/1.1 200 OK\r\ncontent-length: 5\r\ntransfer-encoding: gzip, chunked\r\n\r\n",
        );
        assert_eq!(h.framing(false).unwrap(), Framing::Chunked);
        let h = head("HTTP/1.1 200 OK\r\ntransfer-encoding: chunked, gzip\r\n\r\n");
        assert_eq!(h.framing(false).unwrap(), Framing::Close);
        let h = head("HTTP/1.1 204 No Content\r\ncontent-length: 5\r\n\r\n");
        assert_eq!(h.framing(false).unwrap(), Framing::Empty);
        let h = head("HTTP/1.1 200 OK\r\nContent-Length: 3, 3\r\ncontent-length: 3\r\n\r\n");
        assert_eq!(h.framing(false).unwrap(), Framing::Length(3));
        for bad in ["3, 4", "+3", "", "0x3"] {
            let h = head(&format!("HTTP/1.1 200 OK\r\ncontent-length: {bad}\r\n\r\n"));
            assert!(h.framing(false).is_err(), "{bad:?}");
        }
        let h = head("HTTP/1.0 200 OK\nContent-Length: 3\n\n");
        assert!(!h.http_11 && !h.keep_alive);
        let h = head("HTTP/1.0 200 OK\r\nConnection: Keep-Alive\r\n\r\n");
        assert!(h.keep_alive);
        assert_eq!(h.framing(false).unwrap(), Framing::Close);
        let h = head(
            "HTTP/1.1 200 OK\r\nConnection: keep-alive, close\r\nconnection: keep-alive\r\n\r\n",
        );
        assert!(!h.keep_alive);
        assert!(head("HTTP/1.1 100 Continue\r\n\r\n").is_interim());
        assert!(!head("HTTP/1.1 101 Switching Protocols\r\n\r\n").is_interim());
        assert_eq!(head("HTTP/1.1 404\r\n\r\n").status, 404);
    }

    #[test]
    fn malformed_heads_are_refused() {
        for bad in [
            "HTTP/2 200 OK\r\n\r\n",
            "HTTP/1.1 20 OK\r\n\r\n",
            "HTTP/1.1 2000 OK\r\n\r\n",
            "HTTP/1.1 200 OK\r\nno colon\r\n\r\n",
            "HTTP/1.1 200 OK\r\nbad name: x\r\n\r\n",
            "HTTP/1.1 200 OK\r\nx: a\r\n folded\r\n\r\n",
            "HTTP/1.1 200 OK\r\nx: a\0b\r\n\r\n",
        ] {
            assert!(parse_head(bad.as_bytes()).is_err(), "{bad:?}");
        }
    }

    #[test]
    fn heads_end_at_the_first_empty_line() {
        assert_eq!(head_end(b"HTTP/1.1 200 OK\r\n\r\nbody", 0), Some(19));
        assert_eq!(head_end(b"HTTP/1.1 200 OK\n\nbody", 0), Some(17));
        assert_eq!(head_end(b"HTTP/1.1 200 OK\r\nx: y\r\n", 0), None);
        // The search resumes where the last one stopped, an end split across reads too.
        assert_eq!(head_end(b"HTTP/1.1 200 OK\r\n\r\n", 17), Some(19));
        assert_eq!(chunk_size(b"1aF ; name=value"), Some(0x1af));
        assert_eq!(chunk_size(b"0"), Some(0));
        assert_eq!(chunk_size(b"x"), None);
        assert_eq!(chunk_size(b"10000000000000000"), None);
    }
}
