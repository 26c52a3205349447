//! tonic's channel, with the status details a peer sends made safe for tonic to read.
//!
//! tonic reads a failed call's `grpc-status-details-bin` (in the answer's headers, or in
//! its trailers) with `Status::from_header_map`, which panics on a value that is not
//! base64: a proxy or another implementation of the tool executor could end a run, or a
//! `CreateAgentEngine`, with a panic. The channel here hands tonic the details decoded as
//! leniently as the lean client reads them ([`super::unary`]) and written again as standard
//! base64, and leaves out details that are not base64 at all.

use std::{
    pin::Pin,
    task::{Context, Poll, ready},
};

use http::{HeaderMap, HeaderValue};
use hyper::body::{Body, Frame, SizeHint};
use tonic::{codegen::Service, transport::Channel};

const DETAILS: &str = "grpc-status-details-bin";

/// A [`Channel`] whose answers' status details tonic can read without panicking.
#[derive(Clone)]
pub(super) struct CheckedChannel(pub(super) Channel);

impl Service<http::Request<tonic::body::Body>> for CheckedChannel {
    type Response = http::Response<CheckedBody>;
    type Error = tonic::transport::Error;
    type Future = Pin<Box<dyn Future<Output = Result<Self::Response, Self::Error>> + Send>>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        self.0.poll_ready(cx)
    }

    fn call(&mut self, request: http::Request<tonic::body::Body>) -> Self::Future {
        let response = self.0.call(request);
        Box::pin(async move {
            let mut response = response.await?;
            check_details(response.headers_mut());
            Ok(response.map(CheckedBody))
        })
    }
}

/// An answer's body, whose trailers are checked as its headers were.
pub(super) struct CheckedBody(tonic::body::Body);

impl Body for CheckedBody {
    type Data = bytes::Bytes;
    type Error = tonic::Status;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Self::Data>, Self::Error>>> {
        let frame = ready!(Pin::new(&mut self.0).poll_frame(cx));
        Poll::Ready(frame.map(|frame| {
            frame.map(|mut frame| {
                if let Some(trailers) = frame.trailers_mut() {
                    check_details(trailers);
                }
                frame
            })
        }))
    }

    fn is_end_stream(&self) -> bool {
        self.0.is_end_stream()
    }

    fn size_hint(&self) -> SizeHint {
        self.0.size_hint()
    }
}

/// Makes `headers`' status details standard base64, or leaves them out when they are not
/// base64 at all.
fn check_details(headers: &mut HeaderMap) {
    let Some(value) = headers.get(DETAILS) else {
        return;
    };
    match super::unary::base64_decode(value.as_bytes()) {
        Some(details) => {
            use base64::Engine as _;
            let encoded = base64::engine::general_purpose::STANDARD_NO_PAD.encode(details);
            // Base64 is always a valid header value.
            if let Ok(value) = HeaderValue::from_str(&encoded) {
                headers.insert(DETAILS, value);
            }
        }
        None => {
            headers.remove(DETAILS);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn details_are_made_standard_base64_or_left_out() {
        let mut headers = HeaderMap::new();
        headers.insert("grpc-status", HeaderValue::from_static("13"));
        // URL-safe and padded: read, and written again as standard base64 unpadded.
        headers.insert(DETAILS, HeaderValue::from_static("-_8="));
        check_details(&mut headers);
        assert_eq!(headers[DETAILS], "+/8");
        let status = tonic::Status::from_header_map(&headers).unwrap();
        assert_eq!(status.details(), [0xfb, 0xff]);

        headers.insert(DETAILS, HeaderValue::from_static("not base64!"));
        check_details(&mut headers);
        assert!(headers.get(DETAILS).is_none());
    }
}
