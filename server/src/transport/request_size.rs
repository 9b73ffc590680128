//! Per-method request size limits, enforced from the gRPC length prefix
//! before the message is read.
//!
//! tonic's `max_decoding_message_size` is one limit for every method of a
//! service, and it is checked only once tonic has buffered the message's
//! bytes. `Sample` needs a large one (a whole vocabulary of logits), while
//! `Generate` has no reason to accept more than its prompt limit and some
//! parameters: a 16 MB prompt would otherwise be buffered (16 MB), decoded
//! (16 MB more) and only then refused. [`RequestSizeLimit`] reads a limited
//! method's first message prefix (5 bytes, normally in the first DATA
//! frame) and answers RESOURCE_EXHAUSTED at once when the declared length
//! is over that method's limit, naming the limit and its configuration key;
//! the rest of the body is never read. Other requests pass untouched (the
//! frames read to find the prefix are replayed in front of the rest).

#![forbid(unsafe_code)]

use std::convert::Infallible;
use std::future::Future;
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

/// gRPC's length prefix: a compressed flag and a big-endian u32 length.
const PREFIX: usize = 5;

/// One method's limit.
#[derive(Clone, Debug)]
pub struct MethodLimit {
    /// The HTTP/2 path, e.g. `/samplerd.v1.Sampler/Generate`.
    pub path: &'static str,
    /// Largest message accepted, in bytes.
    pub max_bytes: usize,
    /// The configuration key that sets it (named in the refusal).
    pub key: &'static str,
}

/// Wraps a gRPC service with per-method message size limits.
#[derive(Clone)]
pub struct RequestSizeLimit<S> {
    inner: S,
    limits: Arc<[MethodLimit]>,
}

impl<S> RequestSizeLimit<S> {
    pub fn new(inner: S, limits: Vec<MethodLimit>) -> Self {
        RequestSizeLimit {
            inner,
            limits: limits.into(),
        }
    }
}

impl<S: NamedService> NamedService for RequestSizeLimit<S> {
    const NAME: &'static str = S::NAME;
}

impl<S> Service<http::Request<Body>> for RequestSizeLimit<S>
where
    S: Service<http::Request<Body>, Response = http::Response<Body>, Error = Infallible>
        + Clone
        + Send
        + 'static,
    S::Future: Send + 'static,
{
    type Response = http::Response<Body>;
    type Error = Infallible;
    type Future = Pin<Box<dyn Future<Output = Result<Self::Response, Infallible>> + Send>>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Infallible>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, req: http::Request<Body>) -> Self::Future {
        // The clone is the one left behind: `self.inner` was polled ready.
        let clone = self.inner.clone();
        let mut inner = std::mem::replace(&mut self.inner, clone);
        let Some(limit) = self
            .limits
            .iter()
            .find(|l| l.path == req.uri().path())
            .cloned()
        else {
            return Box::pin(inner.call(req));
        };
        Box::pin(async move {
            let (parts, body) = req.into_parts();
            let (held, declared, rest) = read_prefix(body).await;
            if let Some(len) = declared
                && len > limit.max_bytes
            {
                let method = limit.path.rsplit('/').next().unwrap_or(limit.path);
                let status = Status::resource_exhausted(format!(
                    "{method} request of {len} bytes exceeds the limit of {} bytes ({})",
                    limit.max_bytes, limit.key
                ));
                tracing::debug!(len, limit = limit.max_bytes, "request refused by its size");
                return Ok(status.into_http());
            }
            let held = stream::iter(held.into_iter().map(Ok::<_, Status>));
            let body = Body::new(StreamBody::new(held.chain(BodyStream::new(rest))));
            // The replaced `inner` was ready; the generated service always is.
            inner
                .ready()
                .await?
                .call(http::Request::from_parts(parts, body))
                .await
        })
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
