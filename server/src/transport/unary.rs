//! What gRPC asks of a unary request that tonic does not check: exactly
//! one message (tonic serves the first of two and answers INTERNAL to
//! none; the gRPC spec's code for a cardinality violation is
//! UNIMPLEMENTED), and — samplerd's own rule — a per-method size limit
//! enforced from the length prefix, before the message is read.
//!
//! tonic's `max_decoding_message_size` is one limit for every method of a
//! service, and it is checked only once tonic has buffered the message's
//! bytes. `Sample` needs a large one (a whole vocabulary of logits), while
//! `Generate` has no reason to accept more than its prompt limit and some
//! parameters: a 16 MB prompt would otherwise be buffered (16 MB), decoded
//! (16 MB more) and only then refused. [`UnaryGuard`] reads a limited
//! method's first message prefix (5 bytes, normally in the first DATA
//! frame) and answers RESOURCE_EXHAUSTED at once when the declared length
//! is over that method's limit, naming the limit and its configuration key;
//! the rest of the body is never read. Otherwise the frames read to find
//! the prefix are replayed in front of the rest, and the body is watched
//! (`OneMessage`): a second message, or none at all, ends it with
//! UNIMPLEMENTED, which tonic passes on as the call's status (it reads a
//! unary body to its end before calling the handler).
//!
//! A compressed message's prefix gives only its compressed length (16 KB
//! of gzip inflate to 16 MB), so a limited method is also served by an
//! instance of the generated service of its own ([`SplitMethod`]) whose
//! tonic `max_decoding_message_size` is that limit: tonic inflates into a
//! buffer limited to it and stops there, and its refusal is rewritten here
//! to the same RESOURCE_EXHAUSTED naming the key.

#![forbid(unsafe_code)]

use std::convert::Infallible;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};

use http_body::Frame;
use http_body_util::{BodyExt, BodyStream, StreamBody};
use prost::bytes::Bytes;
use tokio_stream::{self as stream, StreamExt};
use tonic::Status;
use tonic::body::Body;
use tonic::server::NamedService;
use tower::{Service, ServiceExt};

use super::middleware::{HttpResponse, Middleware, ResponseFuture};
use super::status_fixup::DECOMPRESSED_TOO_LARGE;
use crate::status::{Failure, Reason, status};

/// gRPC's length prefix: a compressed flag and a big-endian u32 length.
const PREFIX: usize = 5;

/// One unary method.
#[derive(Clone, Debug)]
pub struct UnaryMethod {
    /// The HTTP/2 path, e.g. `/samplerd.v1.Sampler/Generate`.
    pub path: &'static str,
    /// Largest message accepted, in bytes, and the configuration key that
    /// sets it (named in the refusal); `None`: tonic's limit alone.
    pub limit: Option<(usize, &'static str)>,
}

/// The middleware around a gRPC service's unary methods:
/// `Wrap::new(UnaryGuard::new(methods), service)`.
#[derive(Clone, Debug)]
pub struct UnaryGuard {
    methods: Arc<[UnaryMethod]>,
}

impl UnaryGuard {
    pub fn new(methods: Vec<UnaryMethod>) -> Self {
        UnaryGuard {
            methods: methods.into(),
        }
    }
}

impl<S> Middleware<S, Body> for UnaryGuard
where
    S: Service<http::Request<Body>, Response = HttpResponse, Error = Infallible> + Send + 'static,
    S::Future: Send + 'static,
{
    fn call(&self, mut inner: S, req: http::Request<Body>) -> ResponseFuture<Infallible> {
        let Some(method) = self
            .methods
            .iter()
            .find(|m| m.path == req.uri().path())
            .cloned()
        else {
            return Box::pin(inner.call(req));
        };
        let Some((max_bytes, key)) = method.limit else {
            let (parts, body) = req.into_parts();
            let body = Body::new(OneMessage::new(body));
            return Box::pin(inner.call(http::Request::from_parts(parts, body)));
        };
        Box::pin(async move {
            let (parts, body) = req.into_parts();
            let (held, declared, rest) = read_prefix(body).await;
            let name = method.path.rsplit('/').next().unwrap_or(method.path);
            if let Some(len) = declared
                && len > max_bytes
            {
                let status = Failure::new(
                    Reason::MessageTooLarge,
                    format!(
                        "{name} request of {len} bytes exceeds the limit of {max_bytes} bytes ({key})"
                    ),
                )
                .limit(key)
                .into_status();
                tracing::debug!(len, limit = max_bytes, "request refused by its size");
                return Ok(status.into_http());
            }
            let held = stream::iter(held.into_iter().map(Ok::<_, Status>));
            let body = Body::new(OneMessage::new(Body::new(StreamBody::new(
                held.chain(BodyStream::new(rest)),
            ))));
            // The replaced `inner` was ready; the generated service always is.
            let resp = inner
                .ready()
                .await?
                .call(http::Request::from_parts(parts, body))
                .await?;
            Ok(name_inflated_limit(resp, name, max_bytes, key))
        })
    }
}

/// Rewrites tonic's refusal of a compressed message that inflated past the
/// method's limit to the refusal of an over-size one, naming `key`.
fn name_inflated_limit(
    resp: HttpResponse,
    name: &str,
    max_bytes: usize,
    key: &str,
) -> HttpResponse {
    match Status::from_header_map(resp.headers()) {
        Some(s)
            if s.code() == tonic::Code::ResourceExhausted
                && s.message().starts_with(DECOMPRESSED_TOO_LARGE) =>
        {
            tracing::debug!(
                limit = max_bytes,
                "compressed request refused by its inflated size"
            );
            Failure::new(
                Reason::MessageTooLarge,
                format!(
                    "{name} request decompresses to more than the limit of {max_bytes} bytes ({key})"
                ),
            )
            .limit(key)
            .into_status()
            .into_http()
        }
        _ => resp,
    }
}

/// One method of a generated service served by an instance of its own:
/// requests for `path` go to `method`, all others to `rest`. The two are
/// instances of the same service with different tonic limits (tonic's
/// `max_decoding_message_size` is per service instance; see the module
/// docs for why a method needs its own).
#[derive(Clone, Debug)]
pub struct SplitMethod<A, B> {
    path: &'static str,
    method: A,
    rest: B,
}

impl<A, B> SplitMethod<A, B> {
    pub fn new(path: &'static str, method: A, rest: B) -> Self {
        SplitMethod { path, method, rest }
    }
}

impl<A, B: NamedService> NamedService for SplitMethod<A, B> {
    const NAME: &'static str = B::NAME;
}

impl<A, B> Service<http::Request<Body>> for SplitMethod<A, B>
where
    A: Service<http::Request<Body>, Response = HttpResponse, Error = Infallible>,
    A::Future: Send + 'static,
    B: Service<http::Request<Body>, Response = HttpResponse, Error = Infallible>,
    B::Future: Send + 'static,
{
    type Response = HttpResponse;
    type Error = Infallible;
    type Future = ResponseFuture<Infallible>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Infallible>> {
        // Both, since either may take the next request (tonic's generated
        // services are always ready).
        std::task::ready!(self.method.poll_ready(cx))?;
        self.rest.poll_ready(cx)
    }

    fn call(&mut self, req: http::Request<Body>) -> Self::Future {
        if req.uri().path() == self.path {
            Box::pin(self.method.call(req))
        } else {
            Box::pin(self.rest.call(req))
        }
    }
}

/// Reads frames until the first message's prefix is complete: the frames
/// read, the declared length (None if the body ended or failed first) and
/// the rest of the body. At most 5 data bytes are needed, so at most five
/// non-empty frames are held (empty ones are dropped).
async fn read_prefix(mut body: Body) -> (Vec<Frame<Bytes>>, Option<usize>, Body) {
    let mut held = Vec::with_capacity(1);
    let mut prefix = [0u8; PREFIX];
    let mut n = 0;
    while n < PREFIX {
        let frame = match body.frame().await {
            Some(Ok(frame)) => frame,
            None => return (held, None, body),
            // tonic reports the error as it always does.
            Some(Err(e)) => {
                let rest = Body::new(StreamBody::new(stream::iter([Err::<Frame<Bytes>, _>(e)])));
                return (held, None, rest);
            }
        };
        if let Some(data) = frame.data_ref() {
            if data.is_empty() {
                continue;
            }
            let k = (PREFIX - n).min(data.len());
            prefix[n..n + k].copy_from_slice(&data[..k]);
            n += k;
        }
        held.push(frame);
    }
    let len = u32::from_be_bytes([prefix[1], prefix[2], prefix[3], prefix[4]]) as usize;
    (held, Some(len), body)
}

/// A unary request body, watched for gRPC's one-message rule: it ends with
/// UNIMPLEMENTED at the start of a second message, or at the end of a body
/// that held none. Only the 5-byte prefixes are looked at.
struct OneMessage {
    inner: Body,
    /// Messages started so far (0, 1; a second is an error).
    started: usize,
    /// Bytes of the current prefix seen (`< PREFIX` while reading one).
    prefix: [u8; PREFIX],
    prefix_seen: usize,
    /// Message bytes still to come after the prefix.
    left: usize,
    done: bool,
}

impl OneMessage {
    fn new(inner: Body) -> Self {
        OneMessage {
            inner,
            started: 0,
            prefix: [0; PREFIX],
            prefix_seen: 0,
            left: 0,
            done: false,
        }
    }

    /// Follows the framing through `data`; an error once a second message
    /// starts.
    fn follow(&mut self, mut data: &[u8]) -> Result<(), Status> {
        while !data.is_empty() {
            if self.left > 0 {
                let k = self.left.min(data.len());
                self.left -= k;
                data = &data[k..];
                continue;
            }
            if self.prefix_seen == 0 {
                self.started += 1;
                if self.started > 1 {
                    return Err(status(
                        Reason::WrongMessageCount,
                        "a unary call carried more than one request message",
                    ));
                }
            }
            let k = (PREFIX - self.prefix_seen).min(data.len());
            self.prefix[self.prefix_seen..self.prefix_seen + k].copy_from_slice(&data[..k]);
            self.prefix_seen += k;
            data = &data[k..];
            if self.prefix_seen == PREFIX {
                let p = self.prefix;
                self.left = u32::from_be_bytes([p[1], p[2], p[3], p[4]]) as usize;
                self.prefix_seen = 0;
            }
        }
        Ok(())
    }
}

impl http_body::Body for OneMessage {
    type Data = Bytes;
    type Error = Status;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, Status>>> {
        let this = &mut *self;
        if this.done {
            return Poll::Ready(None);
        }
        match std::task::ready!(Pin::new(&mut this.inner).poll_frame(cx)) {
            Some(Ok(frame)) => {
                if let Some(data) = frame.data_ref()
                    && let Err(e) = this.follow(data)
                {
                    this.done = true;
                    return Poll::Ready(Some(Err(e)));
                }
                Poll::Ready(Some(Ok(frame)))
            }
            Some(Err(e)) => Poll::Ready(Some(Err(e))),
            None if this.started == 0 => {
                this.done = true;
                Poll::Ready(Some(Err(status(
                    Reason::WrongMessageCount,
                    "a unary call carried no request message",
                ))))
            }
            None => Poll::Ready(None),
        }
    }

    // Not the inner body's: an empty request must still be polled once to
    // fail (tonic's `Body::new` turns a body that says it has ended into an
    // empty one without polling it).
    fn is_end_stream(&self) -> bool {
        self.done || (self.started > 0 && self.inner.is_end_stream())
    }
}
