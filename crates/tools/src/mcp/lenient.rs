//! What the SDK would refuse or drop of a server's messages, put right before it reads
//! them.
//!
//! - A `tools/call` result with a content item of a type the SDK does not know (a later
//!   protocol version's `video`), or of a known type it cannot read, does not parse as a
//!   result: the SDK takes it for a custom result, and the call fails as a whole.
//!   [`Lenient`], a transport around the real one, puts a one-line description in place of
//!   each such item, so that the rest of the result comes through.
//! - A tool that can only be called as a task (`"execution": {"taskSupport": "required"}`,
//!   MCP 2025-11-25) fails on every plain call, and the SDK drops `execution` when it reads
//!   `tools/list`; and a tool listed without `inputSchema` (which MCP requires, and some
//!   servers leave out for tools without arguments) fails the whole `tools/list` answer in
//!   the SDK, and with it every tool of the server. [`mend_tool_list`] copies the first into
//!   the tool's `_meta` (under [`TASK_SUPPORT_META`]), which the SDK keeps, and gives the
//!   second the schema of any object, marked in `_meta` ([`NO_SCHEMA_META`]), in the raw
//!   answer: each line of a stdio server ([`ToolListLines`]) and each event of an HTTP
//!   server's event stream. An HTTP server that answers with a JSON body is read by the
//!   SDK's HTTP client before this crate sees the text: a list it could not read (a tool
//!   without `inputSchema`) comes as a custom result, which is mended the same way; in one
//!   it could read, task-only tools stay listed (their calls fail with the server's
//!   error). A tool the SDK cannot read for its optional parts (`annotations`, `icons`,
//!   `outputSchema`) loses them, and one it cannot read even so is left out; a numeric
//!   `nextCursor` becomes text.

use std::{
    borrow::Cow,
    io,
    pin::Pin,
    task::{Context, Poll, ready},
};

use rmcp::{
    RoleClient,
    model::{
        CallToolResult, ClientJsonRpcMessage, ContentBlock, JsonRpcMessage, ServerJsonRpcMessage,
        ServerResult,
    },
    transport::Transport,
};
use serde::Deserialize;
use serde_json::{Value, json};
use tokio::io::{AsyncRead, ReadBuf};
use tracing::{debug, warn};

use super::bounded::Unread;

/// The `_meta` key of a listed tool that carries its `execution.taskSupport`.
pub(super) const TASK_SUPPORT_META: &str = "io.agentrt/taskSupport";
/// The `_meta` key that marks a listed tool given the schema of any object for the
/// `inputSchema` it did not have.
pub(super) const NO_SCHEMA_META: &str = "io.agentrt/noInputSchema";
/// Content types the SDK reads: an item of one of these that does not parse is malformed,
/// not of a later protocol version.
const KNOWN_CONTENT: [&str; 5] = ["text", "image", "audio", "resource", "resource_link"];
/// Longest content type named in a description; a server chooses it.
const MAX_TYPE_LEN: usize = 40;
/// Bytes read at a time from a stdio server.
const CHUNK: usize = 64 * 1024;

/// A transport whose `tools/call` results keep what the SDK can read of them (see the
/// module's documentation).
pub(super) struct Lenient<T>(pub(super) T);

impl<T: Transport<RoleClient>> Transport<RoleClient> for Lenient<T> {
    type Error = T::Error;

    /// The SDK names the transport in its errors; the default is the Rust type's path.
    fn name() -> Cow<'static, str> {
        "MCP".into()
    }

    fn send(
        &mut self,
        item: ClientJsonRpcMessage,
    ) -> impl Future<Output = Result<(), Self::Error>> + Send + 'static {
        self.0.send(item)
    }

    async fn receive(&mut self) -> Option<ServerJsonRpcMessage> {
        self.0.receive().await.map(repair)
    }

    fn close(&mut self) -> impl Future<Output = Result<(), Self::Error>> + Send {
        self.0.close()
    }
}

/// An answer the SDK took for a custom result because a content item did not parse,
/// made a `tools/call` result again; other messages as they are.
fn repair(message: ServerJsonRpcMessage) -> ServerJsonRpcMessage {
    match message {
        JsonRpcMessage::Response(mut response) => {
            if let ServerResult::CustomResult(custom) = &response.result
                && let Some(result) = call_result(&custom.0)
            {
                debug!("a tool result had content the client cannot read; it is described");
                response.result = ServerResult::CallToolResult(result);
            }
            JsonRpcMessage::Response(response)
        }
        other => other,
    }
}

/// `value` as a `tools/call` result, each content item the SDK cannot read replaced by a
/// text item describing it; `None` when every item reads, or it is no such result.
fn call_result(value: &Value) -> Option<CallToolResult> {
    let object = value.as_object()?;
    let content = object.get("content")?.as_array()?;
    let mut replaced = false;
    let content: Vec<Value> = content
        .iter()
        .map(|item| {
            if ContentBlock::deserialize(item).is_ok() {
                item.clone()
            } else {
                replaced = true;
                json!({"type": "text", "text": describe(item)})
            }
        })
        .collect();
    if !replaced {
        return None;
    }
    let mut object = object.clone();
    object.insert("content".into(), Value::Array(content));
    serde_json::from_value(Value::Object(object)).ok()
}

/// One line saying what a content item the SDK cannot read was.
fn describe(item: &Value) -> String {
    match item.get("type").and_then(Value::as_str) {
        Some(kind) if KNOWN_CONTENT.contains(&kind) => format!("[unreadable {kind} content]"),
        Some(kind) => {
            let kind: String = kind.chars().take(MAX_TYPE_LEN).collect();
            format!("[unsupported content type {kind}]")
        }
        None => "[content without a type]".to_owned(),
    }
}

/// `message` (one raw JSON-RPC message) put right when it is a `tools/list` answer (see
/// the module's documentation): each listed tool's `execution.taskSupport` copied into its
/// `_meta` under [`TASK_SUPPORT_META`], and a tool without `inputSchema` given the schema
/// of any object, marked with [`NO_SCHEMA_META`]; `None` when there is nothing to mend.
pub(super) fn mend_tool_list(message: &[u8]) -> Option<Vec<u8>> {
    const NEEDLE: &[u8] = b"\"tools\"";
    // Most messages are not such answers: they are not parsed again.
    if !message
        .windows(NEEDLE.len())
        .any(|w| w[0] == NEEDLE[0] && w == NEEDLE)
    {
        return None;
    }
    let mut value: Value = serde_json::from_slice(message).ok()?;
    let result = value.get_mut("result")?.as_object_mut()?;
    let mut mended = false;
    // A cursor the SDK cannot read (a number) fails the page: one as text, anything else
    // none (the list ends there).
    match result.get("nextCursor") {
        None | Some(Value::String(_) | Value::Null) => {}
        Some(Value::Number(number)) => {
            let text = number.to_string();
            result.insert("nextCursor".into(), text.into());
            mended = true;
        }
        Some(_) => {
            result.remove("nextCursor");
            mended = true;
        }
    }
    let tools = result.get_mut("tools")?.as_array_mut()?;
    for tool in tools.iter_mut().filter_map(Value::as_object_mut) {
        let support = tool
            .get("execution")
            .and_then(|e| e.get("taskSupport"))
            .and_then(Value::as_str)
            .map(str::to_owned);
        let schemaless = !tool.get("inputSchema").is_some_and(Value::is_object);
        if support.is_none() && !schemaless {
            continue;
        }
        mended = true;
        if schemaless {
            tool.insert("inputSchema".into(), json!({"type": "object"}));
        }
        let meta = tool
            .entry("_meta")
            .or_insert_with(|| Value::Object(Default::default()));
        if let Some(meta) = meta.as_object_mut() {
            if let Some(support) = support {
                meta.insert(TASK_SUPPORT_META.into(), support.into());
            }
            if schemaless {
                meta.insert(NO_SCHEMA_META.into(), true.into());
            }
        }
    }
    // One tool the SDK cannot read fails the whole answer, and with it every tool of the
    // server: its optional parts it cannot read (`annotations` with a hint that is no
    // boolean, `icons`, an `outputSchema` that is no object) are left out, and a tool
    // unreadable even so (a name that is no text) is left out whole, with a warning.
    let before = tools.len();
    tools.retain_mut(|tool| {
        if rmcp::model::Tool::deserialize(&*tool).is_ok() {
            return true;
        }
        mended = true;
        let name = tool["name"].to_string();
        let name: String = name.chars().take(MAX_TYPE_LEN).collect();
        if let Some(fields) = tool.as_object_mut() {
            for optional in ["annotations", "icons", "outputSchema", "title", "execution"] {
                fields.remove(optional);
            }
        }
        if rmcp::model::Tool::deserialize(&*tool).is_ok() {
            warn!(tool = %name, "the MCP server lists a tool with parts that cannot be read; they are left out");
            true
        } else {
            warn!(tool = %name, "the MCP server lists a tool that cannot be read; it is left out");
            false
        }
    });
    mended |= tools.len() != before;
    mended.then(|| serde_json::to_vec(&value).ok()).flatten()
}

/// A reader of newline-delimited messages that passes each through
/// [`mend_tool_list`]. Lines are held whole until their newline: the reader it reads
/// from bounds them ([`super::bounded::BoundedLines`]).
pub(super) struct ToolListLines<R> {
    inner: R,
    buf: Box<[u8]>,
    /// The current line, up to what was read.
    line: Vec<u8>,
    /// Lines ready to hand out.
    out: Unread,
}

impl<R> ToolListLines<R> {
    pub(super) fn new(inner: R) -> Self {
        Self {
            inner,
            buf: vec![0; CHUNK].into_boxed_slice(),
            line: Vec::new(),
            out: Unread::default(),
        }
    }
}

impl<R: AsyncRead + Unpin> AsyncRead for ToolListLines<R> {
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
            if this.out.hand_out(out) {
                return Poll::Ready(Ok(()));
            }
            let mut read = ReadBuf::new(&mut this.buf);
            ready!(Pin::new(&mut this.inner).poll_read(cx, &mut read))?;
            let n = read.filled().len();
            if n == 0 {
                if this.line.is_empty() {
                    return Poll::Ready(Ok(()));
                }
                // The end: a last line without its newline goes as it is.
                this.out.push(&this.line);
                this.line.clear();
                continue;
            }
            let mut rest = &this.buf[..n];
            while let Some(i) = rest.iter().position(|b| *b == b'\n') {
                this.line.extend_from_slice(&rest[..=i]);
                rest = &rest[i + 1..];
                match mend_tool_list(&this.line) {
                    Some(line) => {
                        this.out.push(&line);
                        this.out.push(b"\n");
                    }
                    None => this.out.push(&this.line),
                }
                this.line.clear();
            }
            this.line.extend_from_slice(rest);
        }
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]

    use tokio::io::AsyncReadExt;

    use super::*;

    #[test]
    fn unreadable_content_is_described_and_the_rest_kept() {
        let result = call_result(&json!({
            "content": [
                {"type": "text", "text": "a"},
                {"type": "video", "uri": "x"},
                {"type": "image"},
                {"uri": "y"},
                {"type": "x".repeat(100)}
            ],
            "isError": true
        }))
        .unwrap();
        let texts: Vec<_> = result
            .content
            .iter()
            .map(|c| c.as_text().unwrap().text.clone())
            .collect();
        assert_eq!(
            texts,
            [
                "a".to_owned(),
                "[unsupported content type video]".to_owned(),
                "[unreadable image content]".to_owned(),
                "[content without a type]".to_owned(),
                format!("[unsupported content type {}]", "x".repeat(MAX_TYPE_LEN)),
            ]
        );
        assert_eq!(result.is_error, Some(true));
        // Results the SDK reads, and other values, are left to it.
        assert!(call_result(&json!({"content": [{"type": "text", "text": "a"}]})).is_none());
        assert!(call_result(&json!({"contents": []})).is_none());
    }

    #[tokio::test]
    async fn task_support_is_kept_in_meta_of_listed_tools_only() {
        let list = json!({"jsonrpc": "2.0", "id": 1, "result": {"tools": [
            {"name": "a", "inputSchema": {}, "execution": {"taskSupport": "required"}},
            {"name": "b", "inputSchema": {}, "_meta": {"x": 1}, "execution": {"taskSupport": "optional"}},
            {"name": "c", "inputSchema": {}}
        ]}});
        let other = r#"{"jsonrpc":"2.0","id":2,"result":{"content":[{"type":"text","text":"taskSupport"}]}}"#;
        let input = format!("{list}\n{other}\n{{\"partial\":");
        for chunk in [1, 10, 4096] {
            let mut reader = ToolListLines::new(chunked(input.as_bytes(), chunk));
            let mut read = String::new();
            reader.read_to_string(&mut read).await.unwrap();
            let lines: Vec<&str> = read.lines().collect();
            assert_eq!(lines.len(), 3, "{chunk}: {read}");
            let listed: Value = serde_json::from_str(lines[0]).unwrap();
            let metas: Vec<_> = listed["result"]["tools"]
                .as_array()
                .unwrap()
                .iter()
                .map(|t| t["_meta"].clone())
                .collect();
            assert_eq!(
                metas,
                [
                    json!({TASK_SUPPORT_META: "required"}),
                    json!({"x": 1, TASK_SUPPORT_META: "optional"}),
                    Value::Null
                ]
            );
            assert_eq!(lines[1], other, "other messages pass as they are");
            assert_eq!(lines[2], "{\"partial\":");
        }
    }

    /// `input` read `chunk` bytes at a time.
    fn chunked(input: &[u8], chunk: usize) -> impl AsyncRead + Unpin + '_ {
        struct Chunked<'a>(&'a [u8], usize);
        impl AsyncRead for Chunked<'_> {
            fn poll_read(
                mut self: Pin<&mut Self>,
                _cx: &mut Context<'_>,
                out: &mut ReadBuf<'_>,
            ) -> Poll<io::Result<()>> {
                let n = self.1.min(self.0.len()).min(out.remaining());
                out.put_slice(&self.0[..n]);
                self.0 = &self.0[n..];
                Poll::Ready(Ok(()))
            }
        }
        Chunked(input, chunk)
    }
}
