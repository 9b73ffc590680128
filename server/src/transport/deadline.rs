//! Per-request deadlines: a tower layer that bounds every RPC — the
//! handler *and* its response stream — by the client's `grpc-timeout`
//! capped at `limits.max_request_duration_secs`. A request past its
//! deadline ends with DEADLINE_EXCEEDED (in the trailers when the stream
//! has started); the response body is dropped, which stops a running
//! generation like a client disconnect does.
//!
//! tonic's own `Server::timeout` is not used: it answers CANCELLED and only
//! covers the handler, not a streaming response.

#![forbid(unsafe_code)]

use std::future::Future;
use std::pin::Pin;
use std::task::{Context, Poll, ready};
use std::time::Duration;

use http_body::{Body as _, Frame};
use tokio::time::{Instant, Sleep};
use tonic::codegen::Bytes;

use super::middleware::{HttpResponse, Middleware, ResponseFuture};

/// gRPC's timeout header (`<digits><unit>`, at most 8 digits).
const GRPC_TIMEOUT: &str = "grpc-timeout";
/// Longest deadline applied (a larger cap or `grpc-timeout` — up to 10^8
/// hours — would overflow the clock arithmetic).
const LONGEST_DEADLINE: Duration = Duration::from_secs(30 * 24 * 3600);

/// Parses a `grpc-timeout` value; `None` when malformed (ignored, as the
/// gRPC spec has servers do).
pub fn parse_grpc_timeout(v: &str) -> Option<Duration> {
    if v.len() < 2 || v.len() > 9 {
        return None;
    }
    let (digits, unit) = v.split_at(v.len() - 1);
    let n: u64 = digits.parse().ok()?;
    Some(match unit {
        "H" => Duration::from_secs(n.checked_mul(3600)?),
        "M" => Duration::from_secs(n.checked_mul(60)?),
        "S" => Duration::from_secs(n),
        "m" => Duration::from_millis(n),
        "u" => Duration::from_micros(n),
        "n" => Duration::from_nanos(n),
        _ => return None,
    })
}

/// The layer: `cap` is the server-side maximum for every request.
/// (A layer: `WrapLayer(Deadline::new(cap))`.)
#[derive(Clone, Copy, Debug)]
pub struct Deadline {
    cap: Duration,
}

impl Deadline {
    pub fn new(cap: Duration) -> Self {
        Deadline { cap }
    }
}

/// The status sent when the deadline passes; `source` says which bound hit.
fn exceeded(limit: Duration, from_client: bool) -> tonic::Status {
    let source = if from_client {
        "the client's grpc-timeout"
    } else {
        "limits.max_request_duration_secs"
    };
    crate::status::status(
        crate::status::Reason::DeadlineExceeded,
        format!(
            "deadline of {:.3}s exceeded ({source})",
            limit.as_secs_f64()
        ),
    )
}

impl<S, B> Middleware<S, B> for Deadline
where
    S: tower::Service<http::Request<B>, Response = HttpResponse>,
    S::Future: Send + 'static,
{
    fn call(&self, mut inner: S, req: http::Request<B>) -> ResponseFuture<S::Error> {
        let client = req
            .headers()
            .get(GRPC_TIMEOUT)
            .and_then(|v| v.to_str().ok())
            .and_then(parse_grpc_timeout);
        let (limit, from_client) = match client {
            Some(c) if c < self.cap => (c, true),
            _ => (self.cap, false),
        };
        let deadline = Instant::now() + limit.min(LONGEST_DEADLINE);
        let call = inner.call(req);
        Box::pin(async move {
            match tokio::time::timeout_at(deadline, call).await {
                // A trailers-only answer (an error status) has nothing left
                // to bound.
                Ok(Ok(resp)) if resp.body().is_end_stream() => Ok(resp),
                Ok(Ok(resp)) => Ok(resp.map(|body| {
                    tonic::body::Body::new(DeadlineBody {
                        inner: body,
                        sleep: Box::pin(tokio::time::sleep_until(deadline)),
                        status: Some(exceeded(limit, from_client)),
                    })
                })),
                Ok(Err(e)) => Err(e),
                Err(_) => Ok(exceeded(limit, from_client).into_http()),
            }
        })
    }
}

/// A response body that ends with DEADLINE_EXCEEDED trailers when the
/// deadline passes before the body does.
struct DeadlineBody {
    inner: tonic::body::Body,
    sleep: Pin<Box<Sleep>>,
    /// Taken when the trailers are sent (the body then ends).
    status: Option<tonic::Status>,
}

impl http_body::Body for DeadlineBody {
    type Data = Bytes;
    type Error = tonic::Status;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, tonic::Status>>> {
        if self.status.is_none() {
            return Poll::Ready(None);
        }
        // What the handler has already produced goes out first.
        if let Poll::Ready(frame) = Pin::new(&mut self.inner).poll_frame(cx) {
            if frame.is_none() {
                self.status = None;
            }
            return Poll::Ready(frame);
        }
        ready!(self.sleep.as_mut().poll(cx));
        let status = self.status.take().expect("checked above");
        let mut trailers = http::HeaderMap::new();
        // add_header only fails on a message that is not valid header text,
        // which ours always is; the status code alone is still sent.
        let _ = status.add_header(&mut trailers);
        Poll::Ready(Some(Ok(Frame::trailers(trailers))))
    }

    fn is_end_stream(&self) -> bool {
        self.status.is_none()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn grpc_timeout_units() {
        assert_eq!(parse_grpc_timeout("2S"), Some(Duration::from_secs(2)));
        assert_eq!(parse_grpc_timeout("1H"), Some(Duration::from_secs(3600)));
        assert_eq!(parse_grpc_timeout("3M"), Some(Duration::from_secs(180)));
        assert_eq!(parse_grpc_timeout("250m"), Some(Duration::from_millis(250)));
        assert_eq!(parse_grpc_timeout("7u"), Some(Duration::from_micros(7)));
        assert_eq!(parse_grpc_timeout("9n"), Some(Duration::from_nanos(9)));
        for bad in ["", "S", "12", "5x", "123456789S", "-1S"] {
            assert_eq!(parse_grpc_timeout(bad), None, "{bad:?}");
        }
    }
}
