//! Unary gRPC calls to a cleartext (`http://`) tool executor over the lean HTTP/2 client of
//! [`agentrt_h2c`], the one model calls take.
//!
//! A call in flight through tonic's channel holds about 9 KB (a boxed call future of 3 KB,
//! a task of hyper's that pipes the request body, its place in the channel's buffer, the
//! request and response header maps); here it is the caller's future, the message
//! encoded once, and its HTTP/2 stream, which is what ten thousand runs that call tools at
//! once add up to (`scripts/profile heap`). Over TLS the tool executor is reached through
//! tonic, as is `ListTools`, which is called once per engine.

use std::time::Duration;

use agentrt_h2c::{Failure, H2cClient, PostError};
use bytes::{Buf, BufMut, Bytes, BytesMut};
use futures_util::StreamExt;
use http::{
    HeaderMap, HeaderValue,
    header::{AUTHORIZATION, CONTENT_TYPE, TE},
};
use tonic::{Code, Status};

use super::Unsent;

/// The marker a failed call's [`Status`] carries when sending it again is safe or
/// expected: what [`super::unsent`] reads.
#[derive(Debug)]
pub(super) struct NotReceived(pub(super) Unsent);

impl std::fmt::Display for NotReceived {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self.0 {
            Unsent::Unreachable => f.write_str("no connection could be made"),
            Unsent::Refused => f.write_str("the call was refused unprocessed"),
            Unsent::Lost => f.write_str("the connection broke under the call"),
            Unsent::Stopped => f.write_str("the tool executor stopped the call"),
            Unsent::SourceDown(_) => f.write_str("the tool's source is down"),
        }
    }
}

impl std::error::Error for NotReceived {}

/// A unary method of the tool executor, called over h2c.
pub(super) struct Unary {
    client: H2cClient,
    /// Largest message sent, and largest answer read.
    max_send_bytes: usize,
    max_answer_bytes: usize,
}

impl Unary {
    /// `method` (`/package.Service/Method`) of the server at `url`, an `http://` URL whose
    /// path, if any, is not used (as with tonic); at least `connections` kept open once
    /// calls began, each dialled within `connect_timeout`.
    pub(super) fn new(
        url: &str,
        method: &str,
        connect_timeout: Duration,
        connections: usize,
        max_send_bytes: usize,
        max_answer_bytes: usize,
    ) -> Result<Self, String> {
        let uri: http::Uri = url
            .parse()
            .map_err(|e| format!("invalid tool executor URL {url:?}: {e}"))?;
        let authority = uri
            .authority()
            .ok_or_else(|| format!("invalid tool executor URL {url:?}: it has no host"))?;
        let client = H2cClient::new(&format!("http://{authority}{method}"), connect_timeout)?
            .with_min_connections(connections)
            .with_http1_hint(
                "check that tool_executor (--tool-executor) is the tool executor's gRPC address",
            );
        Ok(Self {
            client,
            max_send_bytes,
            max_answer_bytes,
        })
    }

    /// `message` as the body of a call: a gRPC frame, checked against the limit of what is
    /// sent. A call in flight keeps this (to send it again if it was not received), not
    /// the message it was made of.
    pub(super) fn encode<M: prost::Message>(&self, message: &M) -> Result<Bytes, Status> {
        let len = message.encoded_len();
        if len > self.max_send_bytes {
            return Err(Status::out_of_range(format!(
                "the call is {len} bytes, over the limit of {} bytes \
                 (server.max_message_bytes)",
                self.max_send_bytes
            )));
        }
        let mut body = BytesMut::with_capacity(5 + len);
        body.put_u8(0);
        body.put_u32(u32::try_from(len).map_err(|_| Status::out_of_range("call too large"))?);
        message
            .encode(&mut body)
            .map_err(|e| Status::internal(format!("cannot encode the call: {e}")))?;
        Ok(body.freeze())
    }

    /// Calls the method with `body` (made by [`Unary::encode`]), the deadline `timeout`
    /// away, sending `authorization` if given.
    pub(super) async fn call<R: prost::Message + Default>(
        &self,
        body: &Bytes,
        timeout: Duration,
        authorization: Option<&HeaderValue>,
    ) -> Result<R, Status> {
        // Made in a block of its own: the call's headers, moved into the post, take no
        // room in this future while it waits for the answer.
        let posting = {
            let mut headers = HeaderMap::with_capacity(8);
            headers.insert(CONTENT_TYPE, HeaderValue::from_static("application/grpc"));
            headers.insert(TE, HeaderValue::from_static("trailers"));
            headers.insert("grpc-timeout", grpc_timeout(timeout));
            if let Some(value) = authorization {
                headers.insert(AUTHORIZATION, value.clone());
            }
            // The tool executor's span joins this trace, under the current `execute_tool` span.
            agentrt_telemetry::inject(&mut headers);
            self.client.post(body.clone(), headers)
        };
        let response = posting.await.map_err(not_sent)?;
        let (parts, mut body) = response.into_parts();
        // A trailers-only answer: the status is in the headers, and there is no message.
        if let Some(status) = status_of(&parts.headers) {
            return Err(status.err().unwrap_or_else(no_message));
        }
        if parts.status != http::StatusCode::OK {
            return Err(Status::new(
                http_code(parts.status),
                format!("the tool executor answered HTTP {}", parts.status),
            ));
        }
        // `application/grpc`, or with a suffix (`+proto`) or parameters; not gRPC-Web.
        let grpc = parts
            .headers
            .get(CONTENT_TYPE)
            .and_then(|v| v.to_str().ok())
            .and_then(|v| v.strip_prefix("application/grpc"))
            .is_some_and(|rest| rest.is_empty() || rest.starts_with(['+', ';']));
        if !grpc {
            return Err(Status::unknown(format!(
                "the tool executor answered content-type {:?}, not gRPC",
                parts.headers.get(CONTENT_TYPE)
            )));
        }
        // An answer in one chunk is kept as it came; one in more is joined.
        let mut first = Bytes::new();
        let mut joined = BytesMut::new();
        while let Some(chunk) = body.next().await {
            let chunk = chunk.map_err(|e| stream_failure(&e))?;
            if first.len() + joined.len() + chunk.len() > 5 + self.max_answer_bytes {
                return Err(Status::out_of_range(format!(
                    "the tool executor's answer is over the limit of {} bytes",
                    self.max_answer_bytes
                )));
            }
            if first.is_empty() && joined.is_empty() {
                first = chunk;
            } else {
                joined.extend_from_slice(&std::mem::take(&mut first));
                joined.extend_from_slice(&chunk);
            }
        }
        let trailers = body.trailers().await.map_err(|e| stream_failure(&e))?;
        let status = trailers
            .as_ref()
            .and_then(status_of)
            .ok_or_else(|| Status::internal("the tool executor's answer ended without a status"))?;
        status?;
        let mut data = if joined.is_empty() {
            first
        } else {
            joined.freeze()
        };
        if data.len() < 5 {
            return Err(no_message());
        }
        let compressed = data.get_u8();
        let len = data.get_u32() as usize;
        if compressed != 0 {
            return Err(Status::internal(
                "the tool executor compressed its answer, though it was not asked to",
            ));
        }
        if data.len() < len {
            return Err(Status::internal(format!(
                "the tool executor's answer is cut: {} bytes of the {len} its prefix says",
                data.len()
            )));
        }
        if data.len() > len {
            return Err(Status::internal(
                "the tool executor answered more than one message to a unary call",
            ));
        }
        R::decode(data).map_err(|e| Status::internal(format!("cannot decode the answer: {e}")))
    }
}

fn no_message() -> Status {
    Status::internal("the tool executor answered OK without a message")
}

/// `grpc-timeout`: at most 8 digits, in the finest unit that holds them, and at least 1.
fn grpc_timeout(timeout: Duration) -> HeaderValue {
    const MOST: u128 = 99_999_999;
    let (value, unit) = [
        (timeout.as_nanos().max(1), 'n'),
        (timeout.as_micros(), 'u'),
        (timeout.as_millis(), 'm'),
        (u128::from(timeout.as_secs()), 'S'),
    ]
    .into_iter()
    .find(|(value, _)| *value <= MOST)
    .unwrap_or((u128::from(timeout.as_secs() / 3600).min(MOST), 'H'));
    HeaderValue::try_from(format!("{value}{unit}"))
        .unwrap_or_else(|_| HeaderValue::from_static("99999999H"))
}

/// The status `grpc-status` and `grpc-message` in `headers` say: `Ok(())` for OK, `None`
/// when there is none.
fn status_of(headers: &HeaderMap) -> Option<Result<(), Status>> {
    let code = headers.get("grpc-status")?;
    let code = code
        .to_str()
        .ok()
        .and_then(|c| c.parse::<i32>().ok())
        .map_or(Code::Unknown, Code::from);
    if code == Code::Ok {
        return Some(Ok(()));
    }
    let message = headers
        .get("grpc-message")
        .map(|m| percent_decode(m.as_bytes()))
        .unwrap_or_default();
    // With its details (`grpc-status-details-bin`: the ErrorInfo that says whether an
    // unavailable call may have run, and the RetryInfo that says when to try again).
    // Decoded here, leniently: tonic's `Status::from_header_map` panics on a value that is
    // not base64, which a proxy or another implementation of the tool executor may send;
    // such details are left out.
    let details = headers
        .get("grpc-status-details-bin")
        .and_then(|value| base64_decode(value.as_bytes()))
        .unwrap_or_default();
    Some(Err(Status::with_details(code, message, details.into())))
}

/// `text` decoded as base64, standard or URL-safe, padded or not (gRPC's binary headers
/// are sent unpadded and received either way); `None` when it is not base64.
pub(super) fn base64_decode(text: &[u8]) -> Option<Vec<u8>> {
    use base64::{
        Engine as _, alphabet,
        engine::{DecodePaddingMode, GeneralPurpose, GeneralPurposeConfig},
    };
    const LENIENT: GeneralPurposeConfig = GeneralPurposeConfig::new()
        .with_decode_padding_mode(DecodePaddingMode::Indifferent)
        .with_decode_allow_trailing_bits(true);
    const STANDARD: GeneralPurpose = GeneralPurpose::new(&alphabet::STANDARD, LENIENT);
    const URL_SAFE: GeneralPurpose = GeneralPurpose::new(&alphabet::URL_SAFE, LENIENT);
    STANDARD
        .decode(text)
        .or_else(|_| URL_SAFE.decode(text))
        .ok()
}

/// `grpc-message` as sent: percent-encoded UTF-8.
fn percent_decode(bytes: &[u8]) -> String {
    let mut out = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while i < bytes.len() {
        let hex = |b: u8| char::from(b).to_digit(16);
        if bytes[i] == b'%'
            && let (Some(high), Some(low)) = (
                bytes.get(i + 1).copied().and_then(hex),
                bytes.get(i + 2).copied().and_then(hex),
            )
        {
            out.push(u8::try_from(high * 16 + low).unwrap_or(b'?'));
            i += 3;
        } else {
            out.push(bytes[i]);
            i += 1;
        }
    }
    String::from_utf8_lossy(&out).into_owned()
}

/// The gRPC code of an HTTP status that is not 200 (gRPC's "HTTP to gRPC status code
/// mapping").
fn http_code(status: http::StatusCode) -> Code {
    match status.as_u16() {
        400 => Code::Internal,
        401 => Code::Unauthenticated,
        403 => Code::PermissionDenied,
        404 => Code::Unimplemented,
        429 | 502..=504 => Code::Unavailable,
        _ => Code::Unknown,
    }
}

/// A call that failed before its answer began, marked with why when it may go again.
fn not_sent(error: PostError) -> Status {
    let (mark, code) = match error.failure {
        Failure::Unreachable => (Some(Unsent::Unreachable), Code::Unavailable),
        Failure::Lost => (Some(Unsent::Lost), Code::Unavailable),
        // Sent again by the client already, as often as a call refused through tonic.
        Failure::Unprocessed | Failure::NotHttp2 => (None, Code::Unavailable),
        // The tool executor reset the stream with an HTTP/2 error code (a handler that
        // failed, a call it cancelled): it decided the call's end, which may have run, and
        // it is not sent again.
        Failure::Reset | Failure::Other => (None, code_of(error.reason)),
    };
    let mut status = Status::new(code, error.message);
    if let Some(mark) = mark {
        status.set_source(std::sync::Arc::new(NotReceived(mark)));
    }
    status
}

/// A stream that failed while its answer was read.
fn stream_failure(error: &h2::Error) -> Status {
    if error.is_io() {
        let mut status = Status::unavailable(agentrt_h2c::error_chain(error));
        status.set_source(std::sync::Arc::new(NotReceived(Unsent::Lost)));
        return status;
    }
    Status::new(code_of(error.reason()), agentrt_h2c::error_chain(error))
}

/// The gRPC code of a stream ended with HTTP/2 error code `reason` (gRPC's "Errors"
/// table for HTTP/2).
fn code_of(reason: Option<h2::Reason>) -> Code {
    match reason {
        Some(h2::Reason::CANCEL) => Code::Cancelled,
        Some(h2::Reason::REFUSED_STREAM) => Code::Unavailable,
        Some(h2::Reason::ENHANCE_YOUR_CALM) => Code::ResourceExhausted,
        Some(h2::Reason::INADEQUATE_SECURITY) => Code::PermissionDenied,
        Some(_) => Code::Internal,
        None => Code::Unknown,
    }
}

#[cfg(test)]
pub(super) mod tests {
    use agentrt::v1;

    use super::*;

    /// How the test server answers a call.
    #[derive(Clone, Copy)]
    enum Answer {
        /// The message in two DATA frames, then OK.
        Split,
        /// Trailers only: NOT_FOUND.
        NotFound,
        /// A message larger than the client reads.
        Large,
        /// The message, and no status after it.
        NoStatus,
        /// The stream reset with INTERNAL_ERROR before any answer (a handler that failed).
        Reset,
    }

    /// A raw HTTP/2 server on a free port that answers every call with `respond`.
    pub(in crate::tool_client) async fn raw_server<F>(respond: F) -> String
    where
        F: Fn(h2::server::SendResponse<Bytes>) + Clone + Send + 'static,
    {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let url = format!("http://{}", listener.local_addr().unwrap());
        tokio::spawn(async move {
            while let Ok((io, _)) = listener.accept().await {
                let respond = respond.clone();
                tokio::spawn(async move {
                    let mut connection = h2::server::handshake(io).await.unwrap();
                    while let Some(Ok((_, sender))) = connection.accept().await {
                        respond(sender);
                    }
                });
            }
        });
        url
    }

    /// A raw HTTP/2 server on a free port that answers every call as `answer` says.
    async fn server(answer: Answer) -> String {
        raw_server(move |mut respond| {
            let message = v1::ExecuteToolResponse {
                output: if matches!(answer, Answer::Large) {
                    "x".repeat(4096)
                } else {
                    "42".into()
                },
                ..Default::default()
            };
            let mut framed = BytesMut::new();
            framed.put_u8(0);
            framed.put_u32(u32::try_from(prost::Message::encoded_len(&message)).unwrap());
            prost::Message::encode(&message, &mut framed).unwrap();
            let framed = framed.freeze();
            let grpc = http::Response::builder().header(CONTENT_TYPE, "application/grpc");
            let mut ok = HeaderMap::new();
            ok.insert("grpc-status", HeaderValue::from_static("0"));
            match answer {
                Answer::Reset => respond.send_reset(h2::Reason::INTERNAL_ERROR),
                Answer::NotFound => {
                    let response = grpc
                        .header("grpc-status", "5")
                        .header("grpc-message", "no%20such%20tool")
                        .body(())
                        .unwrap();
                    respond.send_response(response, true).unwrap();
                }
                Answer::Split | Answer::Large | Answer::NoStatus => {
                    let mut stream = respond
                        .send_response(grpc.body(()).unwrap(), false)
                        .unwrap();
                    stream.send_data(framed.slice(..3), false).unwrap();
                    if matches!(answer, Answer::NoStatus) {
                        stream.send_data(framed.slice(3..), true).unwrap();
                    } else {
                        stream.send_data(framed.slice(3..), false).unwrap();
                        stream.send_trailers(ok).unwrap();
                    }
                }
            }
        })
        .await
    }

    async fn call(url: &str) -> Result<v1::ExecuteToolResponse, Status> {
        let unary = Unary::new(
            url,
            "/agent.v1.ToolExecutor/ExecuteTool",
            Duration::from_secs(5),
            1,
            1024,
            1024,
        )
        .unwrap();
        let body = unary.encode(&v1::ExecuteToolRequest::default())?;
        unary.call(&body, Duration::from_secs(5), None).await
    }

    /// A call over the limit of what is sent is refused before anything is sent.
    #[test]
    fn a_call_over_the_send_limit_is_refused_when_encoded() {
        let unary = Unary::new(
            "http://127.0.0.1:1",
            "/agent.v1.ToolExecutor/ExecuteTool",
            Duration::from_secs(5),
            1,
            1024,
            1024,
        )
        .unwrap();
        let large = v1::ExecuteToolRequest {
            tool_name: "x".repeat(2000),
            ..Default::default()
        };
        let status = unary.encode(&large).unwrap_err();
        assert_eq!(status.code(), Code::OutOfRange);
        assert!(
            status.message().contains("over the limit of 1024 bytes"),
            "{status:?}"
        );
        // The body is the message framed as gRPC: no compression, its length, itself.
        let small = v1::ExecuteToolRequest {
            tool_name: "calculator".into(),
            ..Default::default()
        };
        let body = unary.encode(&small).unwrap();
        assert_eq!(body[0], 0);
        assert_eq!(body[1..5], 12u32.to_be_bytes());
        assert_eq!(body.len(), 5 + 12);
    }

    #[tokio::test]
    async fn answers_and_statuses_are_read_as_grpc_says() {
        let answer = call(&server(Answer::Split).await).await.unwrap();
        assert_eq!(answer.output, "42");
        let status = call(&server(Answer::NotFound).await).await.unwrap_err();
        assert_eq!(
            (status.code(), status.message()),
            (Code::NotFound, "no such tool")
        );
        let status = call(&server(Answer::Large).await).await.unwrap_err();
        assert_eq!(status.code(), Code::OutOfRange, "{status:?}");
        let status = call(&server(Answer::NoStatus).await).await.unwrap_err();
        assert_eq!(status.code(), Code::Internal, "{status:?}");
        assert!(status.message().contains("without a status"), "{status:?}");
        // A stream the tool executor reset is its answer: the call may have run, and is
        // not sent again as one whose connection broke would be.
        let status = call(&server(Answer::Reset).await).await.unwrap_err();
        assert_eq!(status.code(), Code::Internal, "{status:?}");
        assert_eq!(super::super::unsent(&status), None, "{status:?}");
    }

    #[tokio::test]
    async fn a_server_that_answers_in_http1_is_named_with_the_setting_to_check() {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let url = format!("http://{}", listener.local_addr().unwrap());
        tokio::spawn(async move {
            use tokio::io::AsyncWriteExt;
            while let Ok((mut io, _)) = listener.accept().await {
                tokio::spawn(async move {
                    let _ = io
                        .write_all(b"HTTP/1.1 400 Bad Request\r\ncontent-length: 0\r\n\r\n")
                        .await;
                    // Open until the client gives up on it.
                    tokio::time::sleep(Duration::from_secs(10)).await;
                });
            }
        });
        let status = call(&url).await.unwrap_err();
        assert_eq!(status.code(), Code::Unavailable);
        assert!(
            status.message().contains("tool_executor (--tool-executor)"),
            "{status:?}"
        );
        // Final: not a call that went unsent.
        assert_eq!(super::super::unsent(&status), None);
    }

    #[test]
    fn timeouts_take_the_finest_unit_that_holds_them() {
        let text = |d| grpc_timeout(d).to_str().unwrap().to_owned();
        assert_eq!(text(Duration::ZERO), "1n");
        assert_eq!(text(Duration::from_micros(20)), "20000n");
        assert_eq!(text(Duration::from_millis(1500)), "1500000u");
        assert_eq!(text(Duration::from_secs(600)), "600000m");
        assert_eq!(text(Duration::from_secs(7 * 24 * 3600)), "604800S");
        assert_eq!(text(Duration::from_secs(200_000_000)), "55555H");
    }

    #[test]
    fn messages_are_percent_decoded() {
        assert_eq!(
            percent_decode(b"no%20such%20tool: %E2%9C%93"),
            "no such tool: \u{2713}"
        );
        assert_eq!(percent_decode(b"100% sure"), "100% sure");
        assert_eq!(percent_decode(b"cut %4"), "cut %4");
    }

    #[test]
    fn statuses_are_read_from_headers() {
        let mut headers = HeaderMap::new();
        assert!(status_of(&headers).is_none());
        headers.insert("grpc-status", HeaderValue::from_static("0"));
        assert!(matches!(status_of(&headers), Some(Ok(()))));
        headers.insert("grpc-status", HeaderValue::from_static("5"));
        headers.insert("grpc-message", HeaderValue::from_static("no%20tool"));
        let status = status_of(&headers).unwrap().unwrap_err();
        assert_eq!(
            (status.code(), status.message()),
            (Code::NotFound, "no tool")
        );
        headers.insert("grpc-status", HeaderValue::from_static("x"));
        assert_eq!(
            status_of(&headers).unwrap().unwrap_err().code(),
            Code::Unknown
        );
        // Details (ErrorInfo, RetryInfo) come with the status.
        let sent = agentrt_grpc::status::unavailable_about(
            "TOOL_SOURCE_UNAVAILABLE",
            "down".into(),
            Duration::from_secs(2),
            &[("sent", "false")],
        );
        let headers = sent.clone().into_http::<()>().headers().clone();
        let read = status_of(&headers).unwrap().unwrap_err();
        assert_eq!((read.code(), read.message()), (Code::Unavailable, "down"));
        assert_eq!(read.details(), sent.details());
        // Details that are not base64 (a proxy's, another implementation's) are left out,
        // the status kept: tonic's own reading of them panics.
        let mut headers = headers;
        headers.insert(
            "grpc-status-details-bin",
            HeaderValue::from_static("not base64!"),
        );
        let read = status_of(&headers).unwrap().unwrap_err();
        assert_eq!((read.code(), read.message()), (Code::Unavailable, "down"));
        assert!(read.details().is_empty());
    }

    #[test]
    fn base64_is_read_padded_or_not_standard_or_url_safe() {
        for (text, bytes) in [
            (&b""[..], &b""[..]),
            (b"Zg", b"f"),
            (b"Zg==", b"f"),
            (b"Zm8", b"fo"),
            (b"Zm8=", b"fo"),
            (b"Zm9v", b"foo"),
            (b"Zm9vYg", b"foob"),
            (b"-_-_", &[0xfb, 0xff, 0xbf]),
            (b"+/+/", &[0xfb, 0xff, 0xbf]),
        ] {
            assert_eq!(base64_decode(text).as_deref(), Some(bytes), "{text:?}");
        }
        for text in [&b"Z"[..], b"Zm9v!", b"Zm 9v", b"Zm9vY"] {
            assert_eq!(base64_decode(text), None, "{text:?}");
        }
    }
}
