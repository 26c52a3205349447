//! The bound on messages from a stdio MCP server, enforced before the SDK reads them.
//!
//! The SDK's own bound (`AsyncRwTransport::with_max_line_length`) drops an oversized line
//! and logs it, and nothing else: the call it answers waits for its timeout, and the
//! SDK's API says nothing of which call that was. [`BoundedLines`] sits between the child's
//! stdout and the SDK instead: it passes each line on up to `max_message_bytes`, cuts a
//! longer one there (the SDK ignores the cut line, which is not valid JSON), and, when the
//! line was an answer whose id it can read from the line's start or end, hands the SDK an
//! error answer for that id in its place. The call then ends at once, with an error that
//! names the bound ([`is_too_large`]).
//!
//! Over streamable HTTP the SDK refuses an oversized answer by ending the whole connection
//! (a JSON body) or the answer's event stream (an SSE event), and the call fails as if the
//! server had gone. [`BoundedHttpClient`] knows which request each answer is for, and
//! gives the SDK the same error answer instead.
//!
//! Two more things are put right on the way: a request refused because the server does
//! not know its session (a 400 saying so, where MCP says 404) is handed to the SDK as the
//! 404 it handles, by making a new session and sending the request again; and the event
//! stream of a `tools/list` answer keeps what the SDK would drop of the tools
//! ([`super::lenient::mend_tool_list`]).

use std::{
    io,
    pin::Pin,
    task::{Context, Poll, ready},
};

use std::{collections::HashMap, sync::Arc};

use futures_util::{Stream, StreamExt};
use reqwest::header::{HeaderName, HeaderValue};
use rmcp::{
    model::{ClientJsonRpcMessage, ClientRequest, JsonRpcMessage, ServerJsonRpcMessage},
    transport::common::client_side_sse::BoxedSseResponse,
    transport::streamable_http_client::{
        SseError, StreamableHttpClient, StreamableHttpError, StreamableHttpPostResponse,
        StreamableHttpResponseLimits,
    },
};
use serde_json::{Value, json};
use tokio::io::{AsyncRead, ReadBuf};
use tracing::{debug, warn};

use super::lenient::mend_tool_list;

/// The `data` key of the error answer put in place of an oversized one; its value is the
/// bound.
const TOO_LARGE_KEY: &str = "io.agentrt/messageTooLarge";
/// How much of a line's start is kept to find its id (`{"jsonrpc":"2.0","id":7,...`).
const HEAD: usize = 256;
/// How much of an oversized line's end is kept to find its id (`...},"id":7}`), for
/// servers that write the id last (the TypeScript SDK does).
const TAIL: usize = 256;
/// Bytes read from the child at a time.
const CHUNK: usize = 64 * 1024;
/// How far past `max_message_bytes` an oversized line may run, in multiples of the bound,
/// before the server is taken as broken: its newline is waited for (to answer for the
/// line's call and keep the connection) only that long, so that a server that writes
/// without end is stopped and started again rather than read from for ever.
const OVERRUN: usize = 8;

/// A reader of newline-delimited messages that cuts lines longer than `max` bytes and
/// answers for them (see the module's documentation).
pub(super) struct BoundedLines<R> {
    inner: R,
    max: usize,
    buf: Box<[u8]>,
    /// The unread part of `buf`.
    pos: usize,
    len: usize,
    /// Bytes of the current line passed on so far (its newline not counted).
    line_len: usize,
    /// The current line's first [`HEAD`] bytes.
    head: Vec<u8>,
    /// The current line is over the bound: its bytes are dropped until its newline.
    discarding: bool,
    /// The last [`TAIL`] bytes of the line being dropped.
    tail: Vec<u8>,
    /// Bytes of the line being dropped, dropped so far.
    dropped: usize,
    /// A line ran on past [`OVERRUN`] times the bound: once `pending` is handed out, the
    /// stream ends, as if the server had closed it.
    broken: bool,
    /// Where to say why the stream was ended.
    cut_off: Option<CutOff>,
    /// An error answer to hand out before anything else.
    pending: Unread,
}

/// Why a [`BoundedLines`] ended its stream, for those who see the connection end.
#[derive(Clone, Default)]
pub(super) struct CutOff(Arc<std::sync::Mutex<Option<String>>>);

impl CutOff {
    fn set(&self, why: String) {
        *self
            .0
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner) = Some(why);
    }

    /// Why the stream was ended, if it was.
    pub(super) fn why(&self) -> Option<String> {
        self.0
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .clone()
    }

    /// Forgets it, for a new connection.
    pub(super) fn clear(&self) {
        *self
            .0
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner) = None;
    }
}

/// Bytes a reader has made and not yet handed out, and how far they went out.
#[derive(Default)]
pub(super) struct Unread {
    bytes: Vec<u8>,
    pos: usize,
}

impl Unread {
    /// Appends `bytes` to what is to be handed out.
    pub(super) fn push(&mut self, bytes: &[u8]) {
        self.bytes.extend_from_slice(bytes);
    }

    /// Hands out into `out` what fits of the bytes not yet handed out; false when there
    /// were none.
    pub(super) fn hand_out(&mut self, out: &mut ReadBuf<'_>) -> bool {
        if self.pos == self.bytes.len() {
            return false;
        }
        let rest = &self.bytes[self.pos..];
        let n = rest.len().min(out.remaining());
        out.put_slice(&rest[..n]);
        self.pos += n;
        if self.pos == self.bytes.len() {
            self.bytes.clear();
            self.pos = 0;
        }
        true
    }
}

impl<R> BoundedLines<R> {
    /// Lines of `inner` longer than `max` bytes are cut; the SDK reading this needs a
    /// bound of at least `max + 1` (the line and its newline).
    pub(super) fn new(inner: R, max: usize) -> Self {
        Self {
            inner,
            max,
            buf: vec![0; CHUNK].into_boxed_slice(),
            pos: 0,
            len: 0,
            line_len: 0,
            head: Vec::with_capacity(HEAD),
            discarding: false,
            tail: Vec::with_capacity(TAIL * 2),
            dropped: 0,
            broken: false,
            cut_off: None,
            pending: Unread::default(),
        }
    }

    /// Says in `cut_off` why, should the stream be ended here.
    pub(super) fn telling(mut self, cut_off: CutOff) -> Self {
        self.cut_off = Some(cut_off);
        self
    }

    /// The dropped line ran on past [`OVERRUN`] times the bound without ending: answer for
    /// it when its start names its call, and end the stream (the server is stopped and
    /// started again, its other calls fail as when it exits).
    fn give_up_on_oversized(&mut self) {
        let id = response_id(&self.head, &[]);
        warn!(
            max_message_bytes = self.max,
            dropped = self.dropped,
            "a message from the MCP server went on past {OVERRUN} times `max_message_bytes` \
             without ending: the connection is ended, and the server started again"
        );
        if let Some(id) = id {
            let mut answer = too_large_answer(id, self.max).to_string().into_bytes();
            answer.push(b'\n');
            self.pending.push(&answer);
        }
        if let Some(cut_off) = &self.cut_off {
            cut_off.set(format!(
                "the server wrote a message of more than {} bytes without ending it, over \
                 {OVERRUN} times `max_message_bytes` ({}), and was stopped",
                self.dropped.saturating_add(self.max),
                self.max
            ));
        }
        self.broken = true;
    }

    /// The dropped line ended: queue an error answer for it, when it was an answer.
    fn finish_oversized(&mut self) {
        let id = response_id(&self.head, &self.tail);
        self.head.clear();
        self.tail.clear();
        self.discarding = false;
        self.dropped = 0;
        self.line_len = 0;
        let Some(id) = id else {
            warn!(
                max_message_bytes = self.max,
                "a message from the MCP server was larger than `max_message_bytes` and was \
                 dropped; it was not an answer whose id could be read"
            );
            return;
        };
        warn!(
            max_message_bytes = self.max,
            %id,
            "an answer from the MCP server was larger than `max_message_bytes` and was \
             dropped; its call gets an error"
        );
        let mut answer = too_large_answer(id, self.max).to_string().into_bytes();
        answer.push(b'\n');
        self.pending.push(&answer);
    }
}

/// Appends `bytes` to `kept`, keeping its last `max` bytes.
fn keep_last(kept: &mut Vec<u8>, bytes: &[u8], max: usize) {
    let bytes = &bytes[bytes.len().saturating_sub(max)..];
    kept.extend_from_slice(bytes);
    if kept.len() > max {
        kept.drain(..kept.len() - max);
    }
}

/// Appends to `kept` what fits of `bytes` in `max` bytes.
fn keep_first(kept: &mut Vec<u8>, bytes: &[u8], max: usize) {
    let room = max.saturating_sub(kept.len());
    kept.extend_from_slice(&bytes[..room.min(bytes.len())]);
}

impl<R: AsyncRead + Unpin> AsyncRead for BoundedLines<R> {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        out: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        let this = self.get_mut();
        if out.remaining() == 0 {
            return Poll::Ready(Ok(()));
        }
        loop {
            if this.pending.hand_out(out) {
                return Poll::Ready(Ok(()));
            }
            if this.broken {
                return Poll::Ready(Ok(()));
            }
            if this.pos == this.len {
                let mut read = ReadBuf::new(&mut this.buf);
                ready!(Pin::new(&mut this.inner).poll_read(cx, &mut read))?;
                let n = read.filled().len();
                if n == 0 {
                    // The end: what is left of a cut line is dropped, as the SDK would.
                    return Poll::Ready(Ok(()));
                }
                this.pos = 0;
                this.len = n;
            }
            let before = out.filled().len();
            while this.pos < this.len && out.remaining() > 0 {
                let available = &this.buf[this.pos..this.len];
                let newline = available.iter().position(|b| *b == b'\n');
                if this.discarding {
                    let take = newline.map_or(available.len(), |i| i + 1);
                    keep_last(&mut this.tail, &available[..take], TAIL);
                    this.pos += take;
                    this.dropped = this.dropped.saturating_add(take);
                    if newline.is_some() {
                        this.finish_oversized();
                        // The error answer goes out before the lines that follow.
                        break;
                    }
                    if this.dropped > this.max.saturating_mul(OVERRUN) {
                        this.give_up_on_oversized();
                        break;
                    }
                    continue;
                }
                let room = this.max - this.line_len;
                match newline {
                    Some(i) if i <= room => {
                        let take = (i + 1).min(out.remaining());
                        out.put_slice(&available[..take]);
                        keep_first(&mut this.head, &available[..take], HEAD);
                        this.pos += take;
                        if take == i + 1 {
                            this.line_len = 0;
                            this.head.clear();
                        } else {
                            this.line_len += take;
                        }
                    }
                    _ if available.len() <= room => {
                        let take = available.len().min(out.remaining());
                        out.put_slice(&available[..take]);
                        keep_first(&mut this.head, &available[..take], HEAD);
                        this.pos += take;
                        this.line_len += take;
                    }
                    _ if room > 0 => {
                        // Up to the bound now; the cut comes next.
                        let take = room.min(out.remaining());
                        out.put_slice(&available[..take]);
                        keep_first(&mut this.head, &available[..take], HEAD);
                        this.pos += take;
                        this.line_len += take;
                    }
                    _ => {
                        // The line goes over the bound: end it here for the SDK, which
                        // drops it as unreadable, and drop the rest.
                        out.put_slice(b"\n");
                        this.discarding = true;
                    }
                }
            }
            if out.filled().len() > before {
                return Poll::Ready(Ok(()));
            }
        }
    }
}

/// The error answer put in place of an answer to request `id` over `max` bytes.
fn too_large_answer(id: Value, max: usize) -> Value {
    json!({
        "jsonrpc": "2.0",
        "id": id,
        "error": {
            "code": -32603,
            "message": format!("the answer is larger than `max_message_bytes` ({max} bytes)"),
            "data": {TOO_LARGE_KEY: max},
        },
    })
}

/// The SDK's reqwest client, with an oversized answer to a request turned into an error
/// answer for that request (see the module's documentation).
#[derive(Clone)]
pub(super) struct BoundedHttpClient(pub(super) reqwest::Client);

/// The error answer for `id` as the SDK's message; `None` if the SDK would not read it.
fn too_large_message(id: &Value, max: usize) -> Option<ServerJsonRpcMessage> {
    warn!(
        max_message_bytes = max,
        %id,
        "an answer from the MCP server was larger than `max_message_bytes`; its call gets \
         an error"
    );
    serde_json::from_value(too_large_answer(id.clone(), max)).ok()
}

/// An SSE message event carrying `data`. (The SDK's event type is another crate's, of a
/// version this workspace does not otherwise use: it is named through the SDK's stream.)
fn sse_message(data: String) -> <BoxedSseResponse as Stream>::Item {
    let mut item: <BoxedSseResponse as Stream>::Item = Ok(Default::default());
    if let Ok(event) = &mut item {
        event.data = Some(data);
    }
    item
}

/// Whether an SSE stream failed on an event over its bound. The SDK's error type for it
/// is private: it is known by its message.
fn is_event_too_large(error: &SseError) -> bool {
    match error {
        SseError::Body(body) => body
            .to_string()
            .contains("SSE event exceeded the maximum size"),
        _ => false,
    }
}

/// Whether `response` refuses a request because the server does not know its session.
/// MCP says a server answers 404 (which the SDK handles), but servers in the TypeScript
/// SDK's example style, server-everything among them, answer 400 with a JSON-RPC error
/// saying so (`Bad Request: No valid session ID provided`, often without the request's
/// id), and older Python SDK servers a 400 with such a text: after a restart behind the
/// same URL, each call would fail, or wait for its timeout.
fn refuses_session(
    response: &Result<StreamableHttpPostResponse, StreamableHttpError<reqwest::Error>>,
) -> bool {
    match response {
        Ok(StreamableHttpPostResponse::Json(JsonRpcMessage::Error(error), _)) => {
            // The codes servers use for a request refused before any method ran.
            matches!(error.error.code.0, -32000 | -32001 | -32600)
                && names_unknown_session(&error.error.message)
        }
        Err(StreamableHttpError::UnexpectedServerResponse(text)) => {
            text.starts_with("HTTP 400") && names_unknown_session(text)
        }
        _ => false,
    }
}

/// Whether `text` says that a session is unknown, invalid or expired.
fn names_unknown_session(text: &str) -> bool {
    let text = text.to_ascii_lowercase();
    text.contains("session")
        && ["no valid", "invalid", "unknown", "not found", "expired"]
            .iter()
            .any(|words| text.contains(words))
}

impl StreamableHttpClient for BoundedHttpClient {
    type Error = reqwest::Error;

    async fn post_message(
        &self,
        uri: Arc<str>,
        message: ClientJsonRpcMessage,
        session_id: Option<Arc<str>>,
        auth_header: Option<String>,
        custom_headers: HashMap<HeaderName, HeaderValue>,
    ) -> Result<StreamableHttpPostResponse, StreamableHttpError<Self::Error>> {
        self.0
            .post_message(uri, message, session_id, auth_header, custom_headers)
            .await
    }

    async fn post_message_with_max_sse_event_size(
        &self,
        uri: Arc<str>,
        message: ClientJsonRpcMessage,
        session_id: Option<Arc<str>>,
        auth_header: Option<String>,
        custom_headers: HashMap<HeaderName, HeaderValue>,
        max_sse_event_size: usize,
    ) -> Result<StreamableHttpPostResponse, StreamableHttpError<Self::Error>> {
        self.0
            .post_message_with_max_sse_event_size(
                uri,
                message,
                session_id,
                auth_header,
                custom_headers,
                max_sse_event_size,
            )
            .await
    }

    async fn post_message_with_response_limits(
        &self,
        uri: Arc<str>,
        message: ClientJsonRpcMessage,
        session_id: Option<Arc<str>>,
        auth_header: Option<String>,
        custom_headers: HashMap<HeaderName, HeaderValue>,
        limits: StreamableHttpResponseLimits,
    ) -> Result<StreamableHttpPostResponse, StreamableHttpError<Self::Error>> {
        let (id, lists_tools, on_session) = match &message {
            JsonRpcMessage::Request(request) => (
                serde_json::to_value(&request.id).ok(),
                matches!(request.request, ClientRequest::ListToolsRequest(_)),
                session_id.is_some()
                    && !matches!(request.request, ClientRequest::InitializeRequest(_)),
            ),
            _ => (None, false, false),
        };
        let max_event = limits.max_sse_event_size;
        let response = self
            .0
            .post_message_with_response_limits(
                uri,
                message,
                session_id,
                auth_header,
                custom_headers,
                limits,
            )
            .await;
        let Some(id) = id else {
            return response;
        };
        match response {
            // The SDK makes a new session and sends the request again, once, for a 404;
            // the request was not processed either way.
            response if on_session && refuses_session(&response) => {
                debug!("the MCP server does not know the session; a new one is made");
                Err(StreamableHttpError::SessionExpired)
            }
            Err(StreamableHttpError::ResponseBodyTooLarge { max_size }) => {
                match too_large_message(&id, max_size) {
                    Some(answer) => Ok(StreamableHttpPostResponse::Json(answer, None)),
                    None => Err(StreamableHttpError::ResponseBodyTooLarge { max_size }),
                }
            }
            // A plain JSON body: the SDK read it already, and a `tools/list` answer it could
            // not read as one (a tool without `inputSchema`) is a custom result; written
            // back, mended and read again, it is the list.
            Ok(StreamableHttpPostResponse::Json(message, session)) if lists_tools => {
                let mended = serde_json::to_vec(&message)
                    .ok()
                    .and_then(|raw| mend_tool_list(&raw))
                    .and_then(|raw| serde_json::from_slice::<ServerJsonRpcMessage>(&raw).ok());
                Ok(StreamableHttpPostResponse::Json(
                    mended.unwrap_or(message),
                    session,
                ))
            }
            Ok(StreamableHttpPostResponse::Sse(stream, session)) => {
                // The event over the bound becomes the error answer, and ends the stream.
                let stream = stream
                    .scan(false, move |ended, event| {
                        let next = match event {
                            _ if *ended => None,
                            Err(error) if is_event_too_large(&error) => {
                                *ended = true;
                                let answer = too_large_answer(id.clone(), max_event);
                                warn!(
                                    max_message_bytes = max_event,
                                    %id,
                                    "an answer from the MCP server was larger than \
                                     `max_message_bytes`; its call gets an error"
                                );
                                Some(sse_message(answer.to_string()))
                            }
                            Ok(mut event) if lists_tools => {
                                // What the SDK would drop of the tools, kept where it looks.
                                if let Some(data) = event
                                    .data
                                    .as_deref()
                                    .and_then(|data| mend_tool_list(data.as_bytes()))
                                {
                                    event.data = Some(String::from_utf8_lossy(&data).into_owned());
                                }
                                Some(Ok(event))
                            }
                            event => Some(event),
                        };
                        std::future::ready(next)
                    })
                    .boxed();
                Ok(StreamableHttpPostResponse::Sse(stream, session))
            }
            response => response,
        }
    }

    async fn delete_session(
        &self,
        uri: Arc<str>,
        session_id: Arc<str>,
        auth_header: Option<String>,
        custom_headers: HashMap<HeaderName, HeaderValue>,
    ) -> Result<(), StreamableHttpError<Self::Error>> {
        self.0
            .delete_session(uri, session_id, auth_header, custom_headers)
            .await
    }

    async fn get_stream(
        &self,
        uri: Arc<str>,
        session_id: Option<Arc<str>>,
        last_event_id: Option<String>,
        auth_header: Option<String>,
        custom_headers: HashMap<HeaderName, HeaderValue>,
    ) -> Result<BoxedSseResponse, StreamableHttpError<Self::Error>> {
        self.0
            .get_stream(uri, session_id, last_event_id, auth_header, custom_headers)
            .await
    }

    async fn get_stream_with_max_sse_event_size(
        &self,
        uri: Arc<str>,
        session_id: Option<Arc<str>>,
        last_event_id: Option<String>,
        auth_header: Option<String>,
        custom_headers: HashMap<HeaderName, HeaderValue>,
        max_sse_event_size: usize,
    ) -> Result<BoxedSseResponse, StreamableHttpError<Self::Error>> {
        self.0
            .get_stream_with_max_sse_event_size(
                uri,
                session_id,
                last_event_id,
                auth_header,
                custom_headers,
                max_sse_event_size,
            )
            .await
    }
}

/// Whether a JSON-RPC error answer is the one put in place of an oversized answer, and
/// if so the bound it was over.
pub(super) fn is_too_large(data: Option<&Value>) -> Option<u64> {
    data?.get(TOO_LARGE_KEY)?.as_u64()
}

/// The id of the answer a line starts with (`head`) and ends with (`tail`), when the line
/// is an answer (`result` or `error`, no `method`) and the id is among the members before
/// its first object or array, or its last member.
fn response_id(head: &[u8], tail: &[u8]) -> Option<Value> {
    let mut scan = Scanner { text: head, at: 0 };
    scan.byte(b'{')?;
    let mut id = None;
    let mut answer = false;
    loop {
        let key = scan.string()?;
        scan.byte(b':')?;
        match key.as_slice() {
            b"result" | b"error" => {
                answer = true;
                break;
            }
            b"method" => return None,
            _ => {}
        }
        let value = scan.scalar()?;
        if key == b"id" {
            id = Some(value);
        }
        if scan.byte(b',').is_none() {
            break;
        }
    }
    if !answer {
        return None;
    }
    let id = match id {
        Some(id) => id,
        None => last_member_id(tail)?,
    };
    let id: Value = serde_json::from_slice(&id).ok()?;
    (id.is_string() || id.is_i64() || id.is_u64()).then_some(id)
}

/// The value of a line's last member when it is `"id": <number or string>`.
fn last_member_id(tail: &[u8]) -> Option<Vec<u8>> {
    let text = tail.trim_ascii_end();
    let text = text.strip_suffix(b"}")?.trim_ascii_end();
    let value_start = if text.ends_with(b"\"") {
        let inner = &text[..text.len() - 1];
        inner.iter().rposition(|b| *b == b'"')?
    } else {
        text.iter()
            .rposition(|b| !(b.is_ascii_digit() || *b == b'-'))?
            + 1
    };
    let value = &text[value_start..];
    let before = text[..value_start].trim_ascii_end().strip_suffix(b":")?;
    let before = before.trim_ascii_end().strip_suffix(b"\"id\"")?;
    matches!(before.trim_ascii_end().last(), Some(b',' | b'{')).then(|| value.to_vec())
}

/// A cursor over the start of a JSON object, reading just enough to find its id.
struct Scanner<'a> {
    text: &'a [u8],
    at: usize,
}

impl Scanner<'_> {
    fn skip_space(&mut self) {
        while self.text.get(self.at).is_some_and(u8::is_ascii_whitespace) {
            self.at += 1;
        }
    }

    fn byte(&mut self, expected: u8) -> Option<()> {
        self.skip_space();
        (self.text.get(self.at) == Some(&expected)).then(|| self.at += 1)
    }

    /// A string's raw bytes, quotes and escapes included.
    fn raw_string(&mut self) -> Option<&[u8]> {
        self.skip_space();
        let start = self.at;
        if self.text.get(self.at) != Some(&b'"') {
            return None;
        }
        self.at += 1;
        loop {
            match self.text.get(self.at)? {
                b'\\' => self.at += 2,
                b'"' => {
                    self.at += 1;
                    return Some(&self.text[start..self.at]);
                }
                _ => self.at += 1,
            }
        }
    }

    /// A string's bytes without its quotes (escapes kept: keys that matter have none).
    fn string(&mut self) -> Option<Vec<u8>> {
        let raw = self.raw_string()?;
        Some(raw[1..raw.len() - 1].to_vec())
    }

    /// A string, number, `true`, `false` or `null`, as its raw text; `None` for an
    /// object or an array, or when the text ends first.
    fn scalar(&mut self) -> Option<Vec<u8>> {
        self.skip_space();
        match self.text.get(self.at)? {
            b'"' => self.raw_string().map(<[u8]>::to_vec),
            b'{' | b'[' => None,
            _ => {
                let start = self.at;
                while self
                    .text
                    .get(self.at)
                    .is_some_and(|b| !matches!(b, b',' | b'}') && !b.is_ascii_whitespace())
                {
                    self.at += 1;
                }
                // A value cut by the end of `head` is not known whole.
                (self.at < self.text.len()).then(|| self.text[start..self.at].to_vec())
            }
        }
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]

    use std::time::Duration;

    use tokio::io::AsyncReadExt;

    use super::*;

    async fn read_all(input: &[u8], max: usize, chunk: usize) -> String {
        let mut reader = BoundedLines::new(input, max);
        let mut out = Vec::new();
        let mut buf = vec![0u8; chunk];
        loop {
            let n = reader.read(&mut buf).await.unwrap();
            if n == 0 {
                break;
            }
            out.extend_from_slice(&buf[..n]);
        }
        String::from_utf8(out).unwrap()
    }

    #[tokio::test]
    async fn long_lines_are_cut_and_answered_for_short_ones_pass() {
        let big = "x".repeat(5000);
        let input = format!(
            "{{\"jsonrpc\":\"2.0\",\"id\":1,\"result\":{{}}}}\n\
             {{\"jsonrpc\":\"2.0\",\"id\":2,\"result\":{{\"text\":\"{big}\"}}}}\n\
             {{\"result\":{{\"text\":\"{big}\"}},\"jsonrpc\":\"2.0\",\"id\":\"s-3\"}}\n\
             {{\"jsonrpc\":\"2.0\",\"method\":\"notifications/message\",\"params\":{{\"data\":\"{big}\"}}}}\n\
             {{\"jsonrpc\":\"2.0\",\"id\":4,\"result\":{{}}}}\n"
        );
        for chunk in [1, 7, 100, 8192] {
            let out = read_all(input.as_bytes(), 1024, chunk).await;
            let lines: Vec<&str> = out.lines().collect();
            assert_eq!(lines[0], r#"{"jsonrpc":"2.0","id":1,"result":{}}"#);
            assert_eq!(lines[1].len(), 1024, "cut at the bound");
            let answer: Value = serde_json::from_str(lines[2]).unwrap();
            assert_eq!(answer["id"], 2);
            assert_eq!(is_too_large(answer["error"].get("data")), Some(1024));
            assert_eq!(lines[3].len(), 1024);
            let answer: Value = serde_json::from_str(lines[4]).unwrap();
            assert_eq!(answer["id"], "s-3", "an id written last is found");
            // A notification is cut without an answer.
            assert_eq!(lines[5].len(), 1024);
            assert_eq!(lines[6], r#"{"jsonrpc":"2.0","id":4,"result":{}}"#);
            assert_eq!(lines.len(), 7, "{chunk}: {lines:?}");
        }
    }

    /// A reader of a line that does not end: `start`, then `x` (1 MiB in all, then it
    /// waits for ever, its server writing nothing more).
    struct Endless {
        start: Vec<u8>,
        sent: usize,
    }

    impl AsyncRead for Endless {
        fn poll_read(
            mut self: Pin<&mut Self>,
            _: &mut Context<'_>,
            out: &mut ReadBuf<'_>,
        ) -> Poll<io::Result<()>> {
            let n = out.remaining().min(4096).min((1 << 20) - self.sent);
            if n == 0 {
                return Poll::Pending;
            }
            for _ in 0..n {
                let byte = self.start.get(self.sent).copied().unwrap_or(b'x');
                out.put_slice(&[byte]);
                self.sent += 1;
            }
            Poll::Ready(Ok(()))
        }
    }

    #[tokio::test]
    async fn a_line_without_end_ends_the_stream_and_answers_for_its_call() {
        let start = br#"{"jsonrpc":"2.0","id":9,"result":{"text":""#.to_vec();
        let cut_off = CutOff::default();
        let mut reader =
            BoundedLines::new(Endless { start, sent: 0 }, 1024).telling(cut_off.clone());
        let mut out = Vec::new();
        let mut buf = vec![0u8; 512];
        loop {
            let read = tokio::time::timeout(Duration::from_secs(5), reader.read(&mut buf));
            let n = read.await.expect("the stream ends").unwrap();
            if n == 0 {
                break;
            }
            out.extend_from_slice(&buf[..n]);
        }
        let sent = reader.inner.sent;
        assert!(sent <= 1024 * (OVERRUN + 1) + CHUNK, "{sent} bytes read");
        let out = String::from_utf8(out).unwrap();
        let lines: Vec<&str> = out.lines().collect();
        assert_eq!(lines.len(), 2, "{lines:?}");
        assert_eq!(lines[0].len(), 1024, "cut at the bound");
        let answer: Value = serde_json::from_str(lines[1]).unwrap();
        assert_eq!(answer["id"], 9);
        assert_eq!(is_too_large(answer["error"].get("data")), Some(1024));
        let why = cut_off.why().unwrap();
        assert!(why.contains("`max_message_bytes` (1024)"), "{why}");
    }

    #[test]
    fn refusals_of_an_unknown_session_are_told_from_other_errors() {
        let error = |code: i32, message: &str| {
            let answer =
                json!({"jsonrpc": "2.0", "id": 1, "error": {"code": code, "message": message}});
            Ok(StreamableHttpPostResponse::Json(
                serde_json::from_value(answer).unwrap(),
                None,
            ))
        };
        let text = |text: &str| {
            Err(StreamableHttpError::UnexpectedServerResponse(
                text.to_owned().into(),
            ))
        };
        // server-everything, the TypeScript SDK, older Python SDK servers (plain text).
        assert!(refuses_session(&error(
            -32000,
            "Bad Request: No valid session ID provided"
        )));
        assert!(refuses_session(&error(-32001, "Session not found")));
        assert!(refuses_session(&text(
            "HTTP 400 Bad Request: Bad Request: No valid session ID provided"
        )));
        // A tool's own errors, a missing header, other statuses: not a session refused.
        assert!(!refuses_session(&error(
            -32602,
            "unknown session id argument"
        )));
        assert!(!refuses_session(&error(
            -32000,
            "Bad Request: Mcp-Session-Id header is required"
        )));
        assert!(!refuses_session(&text(
            "HTTP 500 Internal Server Error: session store: unknown error"
        )));
        assert!(!refuses_session(&Err(StreamableHttpError::SessionExpired)));
    }

    #[test]
    fn ids_are_read_only_from_answers() {
        let id = |head: &str, tail: &str| response_id(head.as_bytes(), tail.as_bytes());
        assert_eq!(
            id(r#"{"jsonrpc": "2.0", "id": 7, "result": {"#, ""),
            Some(json!(7))
        );
        assert_eq!(id(r#"{"id":"a\"b","error":{"#, ""), Some(json!("a\"b")));
        assert_eq!(
            id(
                r#"{"result":{"x":"#,
                r#"xxx"}}, "jsonrpc": "2.0", "id": 12 }"#
            ),
            Some(json!(12))
        );
        assert_eq!(
            id(
                r#"{"jsonrpc":"2.0","id":3,"method":"sampling/x","params":{"#,
                ""
            ),
            None
        );
        assert_eq!(
            id(r#"{"result":{"x":"#, r#"xx","id": 9}, "other": 1}"#),
            None
        );
        assert_eq!(id(r#"{"jsonrpc":"2.0","params":{"#, r#","id":1}"#), None);
        assert_eq!(id("not json", ""), None);
    }
}
