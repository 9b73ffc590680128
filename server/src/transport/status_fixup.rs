//! Every error status the server sends carries samplerd's details — also
//! the ones tonic writes itself, which carry none: a request message that
//! does not decode (not protobuf of the method's type, corrupt gzip or
//! zstd, a bad compressed flag, a message cut short), one over
//! `limits.max_message_bytes` (declared, or once decompressed), an
//! encoding the server does not accept, a method it does not serve.
//!
//! [`CompleteStatus`] finds such a status where it travels — the headers
//! of a trailers-only response (a unary call or Generate refused before
//! its handler, an unknown method) and the trailers at the end of a
//! stream — and rewrites it with its [`Reason`] ([`complete`]). It runs
//! inside the metrics middleware, so `samplerd_requests_total` counts the
//! code the client gets: a malformed message is the client's
//! INVALID_ARGUMENT, not a server INTERNAL.

#![forbid(unsafe_code)]

use std::pin::Pin;
use std::task::{Context, Poll};

use http::HeaderMap;
use samplerd_sampling::echo::quote;
use tonic::body::Body;
use tonic::codegen::Bytes;
use tonic::{Code, Status};

use super::middleware::{HttpResponse, Middleware, ResponseFuture};
use crate::status::{Failure, Reason};

/// The text of tonic's status for a message whose declared length is over
/// the limit (OUT_OF_RANGE): `decoded message length too large: found N
/// bytes, the limit is: M bytes`.
const TOO_LARGE: &str = "message length too large";
/// tonic's RESOURCE_EXHAUSTED for a compressed message that decompresses
/// past the limit (also `unary.rs`'s, for a method's own limit).
pub(crate) const DECOMPRESSED_TOO_LARGE: &str = "Error decompressing: size limit";
/// tonic's UNIMPLEMENTED for an unknown `grpc-encoding`: "Content is
/// compressed with `X` which isn't supported".
const UNSUPPORTED_ENCODING: (&str, &str) =
    ("Content is compressed with `", "` which isn't supported");
/// The starts of tonic's INTERNAL statuses for a request body that does
/// not decode: prost's error, corrupt compressed data, a compressed flag
/// without an encoding or other than 0 and 1, a body that ends inside a
/// message.
const MALFORMED: &[&str] = &[
    "failed to decode Protobuf message",
    "Error decompressing",
    "protocol error:",
    "Unexpected EOF decoding stream",
];
/// tonic's INTERNAL for a unary call whose body held no message (the
/// methods `UnaryGuard` watches are refused before).
const NO_MESSAGE: &str = "Missing request message";

/// `status` with samplerd's details, or `None` when it needs none: OK, or
/// already carrying details (every status samplerd builds does). `path`,
/// when known, is the request's (an unknown method's status names it).
pub fn complete(status: &Status, path: Option<&str>) -> Option<Status> {
    if status.code() == Code::Ok || !status.details().is_empty() {
        return None;
    }
    let msg = status.message();
    let failure = match status.code() {
        Code::OutOfRange if msg.contains(TOO_LARGE) => Failure::new(
            Reason::MessageTooLarge,
            format!("message too large (limits.max_message_bytes): {msg}"),
        )
        .limit("limits.max_message_bytes"),
        Code::ResourceExhausted if msg.starts_with(DECOMPRESSED_TOO_LARGE) => Failure::new(
            Reason::MessageTooLarge,
            format!("message too large once decompressed (limits.max_message_bytes): {msg}"),
        )
        .limit("limits.max_message_bytes"),
        Code::Unimplemented if msg.starts_with(UNSUPPORTED_ENCODING.0) => {
            let name = msg
                .strip_prefix(UNSUPPORTED_ENCODING.0)
                .and_then(|m| m.strip_suffix(UNSUPPORTED_ENCODING.1))
                .unwrap_or(msg);
            Failure::new(
                Reason::UnsupportedEncoding,
                format!(
                    "grpc-encoding {} is not accepted: compress with gzip or zstd, or not at all \
                     (grpc-accept-encoding lists them)",
                    quote(name)
                ),
            )
        }
        Code::Unimplemented if msg.is_empty() => Failure::new(
            Reason::UnknownMethod,
            match path {
                Some(p) => format!(
                    "no method {} on this server (samplerd.v1.Sampler, grpc.health.v1.Health, \
                     reflection)",
                    quote(p)
                ),
                None => "no such method on this server".to_owned(),
            },
        ),
        Code::Internal if MALFORMED.iter().any(|m| msg.starts_with(m)) => Failure::new(
            Reason::MalformedMessage,
            format!("the request message does not decode: {msg}"),
        ),
        Code::Internal if msg.starts_with(NO_MESSAGE) => Failure::new(
            Reason::WrongMessageCount,
            "the request has no message: a unary call sends exactly one",
        ),
        Code::Internal | Code::Unknown => Failure::new(Reason::Internal, msg.to_owned()),
        // Cancellations and transport failures: nobody reads these, or
        // they were never the server's to describe.
        _ => return None,
    };
    // tonic's own texts quote no client value beyond the ones cut above,
    // but `into_status` bounds the message whatever it holds. (Metadata
    // tonic set, grpc-accept-encoding on an encoding refusal, stays in the
    // headers beside the rewritten status.)
    Some(failure.into_status())
}

/// `status` as [`complete`] completes it, else unchanged: for a stream's
/// receive error, which the handler passes on (and logs).
pub fn completed(status: Status) -> Status {
    complete(&status, None).unwrap_or(status)
}

/// Rewrites the status in `headers` (a trailers-only response's headers,
/// or a stream's trailers) when [`complete`] has details for it.
fn complete_headers(headers: &mut HeaderMap, path: Option<&str>) {
    // OK, or no status here at all: the common case, one lookup.
    match headers.get(Status::GRPC_STATUS) {
        None => return,
        Some(v) if v.as_bytes() == b"0" => return,
        Some(_) => {}
    }
    if headers.contains_key(Status::GRPC_STATUS_DETAILS) {
        return;
    }
    let Some(status) = Status::from_header_map(headers) else {
        return;
    };
    if let Some(done) = complete(&status, path) {
        // The old message goes; `add_header` writes a message only when
        // there is one.
        headers.remove(Status::GRPC_MESSAGE);
        let _ = done.add_header(headers);
    }
}

/// The middleware (no settings; a layer: `WrapLayer(CompleteStatus)`).
#[derive(Clone, Copy, Debug, Default)]
pub struct CompleteStatus;

impl<S> Middleware<S, Body> for CompleteStatus
where
    S: tower::Service<http::Request<Body>, Response = HttpResponse> + Send + 'static,
    S::Future: Send + 'static,
{
    fn call(&self, mut inner: S, req: http::Request<Body>) -> ResponseFuture<S::Error> {
        // A clone of the URI shares its bytes: no copy of the path.
        let uri = req.uri().clone();
        let call = inner.call(req);
        Box::pin(async move {
            let mut resp = call.await?;
            complete_headers(resp.headers_mut(), Some(uri.path()));
            Ok(resp.map(|inner| Body::new(CompleteTrailers { inner })))
        })
    }
}

/// A response body whose trailers [`complete_headers`] sees.
struct CompleteTrailers {
    inner: Body,
}

impl http_body::Body for CompleteTrailers {
    type Data = Bytes;
    type Error = Status;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<http_body::Frame<Bytes>, Status>>> {
        let mut polled = Pin::new(&mut self.inner).poll_frame(cx);
        if let Poll::Ready(Some(Ok(frame))) = &mut polled
            && let Some(trailers) = frame.trailers_mut()
        {
            complete_headers(trailers, None);
        }
        polled
    }

    fn is_end_stream(&self) -> bool {
        self.inner.is_end_stream()
    }

    fn size_hint(&self) -> http_body::SizeHint {
        self.inner.size_hint()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::status::trailer_bytes;
    use tonic_types::StatusExt;

    fn reason(st: &Status) -> String {
        st.get_details_error_info().expect("ErrorInfo").reason
    }

    #[test]
    fn tonics_own_statuses_get_their_reason() {
        let cases = [
            (
                Status::internal("failed to decode Protobuf message: invalid varint"),
                "SAMPLERD_MALFORMED_MESSAGE",
                Code::InvalidArgument,
            ),
            (
                Status::internal(
                    "Error decompressing: corrupt deflate stream, while sending request",
                ),
                "SAMPLERD_MALFORMED_MESSAGE",
                Code::InvalidArgument,
            ),
            (
                Status::out_of_range(
                    "Error, decoded message length too large: found 9 bytes, the limit is: 4 bytes",
                ),
                "SAMPLERD_MESSAGE_TOO_LARGE",
                Code::ResourceExhausted,
            ),
            (
                Status::resource_exhausted(
                    "Error decompressing: size limit, of 4 bytes, exceeded while decompressing message",
                ),
                "SAMPLERD_MESSAGE_TOO_LARGE",
                Code::ResourceExhausted,
            ),
            (
                Status::unimplemented("Content is compressed with `br` which isn't supported"),
                "SAMPLERD_UNSUPPORTED_ENCODING",
                Code::Unimplemented,
            ),
            (
                Status::unimplemented(""),
                "SAMPLERD_UNKNOWN_METHOD",
                Code::Unimplemented,
            ),
            (
                Status::internal("Missing request message."),
                "SAMPLERD_WRONG_MESSAGE_COUNT",
                Code::Unimplemented,
            ),
            (
                Status::internal("something else"),
                "SAMPLERD_INTERNAL",
                Code::Internal,
            ),
        ];
        for (st, want, code) in cases {
            let done = complete(&st, Some("/x.Y/Z")).unwrap_or_else(|| panic!("{st:?}"));
            assert_eq!(
                (reason(&done).as_str(), done.code()),
                (want, code),
                "{st:?}"
            );
        }
        // Ours (with details), OK and cancellations pass.
        let ours = crate::status::status(Reason::Overloaded, "full");
        assert!(complete(&ours, None).is_none());
        assert!(complete(&Status::ok(""), None).is_none());
        assert!(complete(&Status::cancelled("gone"), None).is_none());
    }

    #[test]
    fn a_client_value_in_tonics_text_is_quoted_bounded() {
        let name = "z".repeat(10_000);
        let st = Status::unimplemented(format!(
            "Content is compressed with `{name}` which isn't supported"
        ));
        let done = complete(&st, None).unwrap();
        assert!(
            done.message().contains("(10000 bytes)"),
            "{}",
            done.message()
        );
        assert!(trailer_bytes(&done) < 1024, "{}", trailer_bytes(&done));
        let path = format!("/{}", "p".repeat(10_000));
        let done = complete(&Status::unimplemented(""), Some(&path)).unwrap();
        assert!(
            done.message().contains("(10001 bytes)"),
            "{}",
            done.message()
        );
    }

    #[test]
    fn headers_are_rewritten_in_place_and_metadata_kept() {
        let mut st = Status::unimplemented("Content is compressed with `br` which isn't supported");
        st.metadata_mut()
            .insert("grpc-accept-encoding", "gzip,zstd".parse().unwrap());
        let mut headers = HeaderMap::new();
        st.add_header(&mut headers).unwrap();
        complete_headers(&mut headers, None);
        let got = Status::from_header_map(&headers).unwrap();
        assert_eq!(reason(&got), "SAMPLERD_UNSUPPORTED_ENCODING");
        assert_eq!(headers["grpc-accept-encoding"], "gzip,zstd");
        // An OK trailer is left alone.
        let mut ok = HeaderMap::new();
        Status::ok("").add_header(&mut ok).unwrap();
        let before = ok.clone();
        complete_headers(&mut ok, None);
        assert_eq!(ok, before);
    }
}
