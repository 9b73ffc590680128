//! The logits-carrying requests (`Sample`, `SampleStream`, `SampleBatch`,
//! `SampleBatchStream`) decoded straight from the HTTP/2 DATA frames that
//! carry them, instead of from tonic's message buffer.
//!
//! tonic copies every incoming DATA frame into one growing buffer and
//! decodes messages from there: for 151,936 raw logits 600 KB a row, into
//! fresh memory, as much as the handler's own copy into the token buffer
//! and on the critical path of every step. [`InPlaceDecode`] instead keeps
//! each uncompressed message's frames as they arrive ([`rope`]) and decodes
//! it with prost from them: a row's logits become a slice of the frame that
//! holds them, and only a row cut by a frame boundary is copied, into a
//! buffer the stream reuses message after message ([`messages`]). tonic gets
//! an empty message in each one's place and still does everything else
//! (metadata, response encoding, status codes, compression of the
//! response); the handler takes the decoded messages, in order, from the
//! request's extensions ([`Predecoded`]).
//!
//! A compressed message, one over the size limit, or one prost rejects
//! reaches tonic byte for byte as the client sent it, and tonic answers as
//! it always does.

#![forbid(unsafe_code)]

mod messages;
pub mod rope;

use std::collections::VecDeque;
use std::convert::Infallible;
use std::sync::{Arc, Mutex, PoisonError};

use prost::Message;
use samplerd_api::v1;
use tonic::body::Body;
use tower::Service;

use self::messages::Messages;
use super::middleware::{HttpResponse, Middleware, ResponseFuture};

/// The messages of one request decoded here: one entry per message, in
/// order — `Some` for a message decoded here (tonic yields an empty one in
/// its place), `None` for one left to tonic. An entry is queued before
/// tonic can yield its message.
#[derive(Debug)]
pub struct Predecoded<M>(Arc<Mutex<VecDeque<Option<M>>>>);

impl<M> Clone for Predecoded<M> {
    fn clone(&self) -> Self {
        Predecoded(Arc::clone(&self.0))
    }
}

impl<M> Default for Predecoded<M> {
    fn default() -> Self {
        Predecoded(Arc::default())
    }
}

impl<M> Predecoded<M> {
    /// The message to use for the one tonic just yielded.
    pub fn take(&self, from_tonic: M) -> M {
        self.queue().pop_front().flatten().unwrap_or(from_tonic)
    }

    /// For the message tonic yields for a unary call: `request`'s own when
    /// the request did not come through here.
    pub fn take_from(request: tonic::Request<M>) -> M
    where
        M: Send + Sync + 'static,
    {
        match request.extensions().get::<Predecoded<M>>().cloned() {
            Some(queue) => queue.take(request.into_inner()),
            None => request.into_inner(),
        }
    }

    fn push(&self, entry: Option<M>) {
        self.queue().push_back(entry);
    }

    fn queue(&self) -> std::sync::MutexGuard<'_, VecDeque<Option<M>>> {
        // Nothing panics while holding the lock.
        self.0.lock().unwrap_or_else(PoisonError::into_inner)
    }
}

/// The middleware around the generated `Sampler` service (see the module
/// docs): `Wrap::new(InPlaceDecode::new(max), service)`.
#[derive(Clone, Copy, Debug)]
pub struct InPlaceDecode {
    /// The service's `max_decoding_message_size`: larger messages go to
    /// tonic, which answers `RESOURCE_EXHAUSTED`.
    max_message_bytes: usize,
}

impl InPlaceDecode {
    pub fn new(max_message_bytes: usize) -> Self {
        InPlaceDecode { max_message_bytes }
    }
}

impl<S> Middleware<S, Body> for InPlaceDecode
where
    S: Service<http::Request<Body>, Response = HttpResponse, Error = Infallible> + Send + 'static,
    S::Future: Send + 'static,
{
    fn call(&self, mut inner: S, req: http::Request<Body>) -> ResponseFuture<Infallible> {
        let max = self.max_message_bytes;
        let req = if !uncompressed(&req) {
            req
        } else {
            match req.uri().path() {
                "/samplerd.v1.Sampler/Sample" => adapt::<v1::SampleRequest>(req, max),
                "/samplerd.v1.Sampler/SampleStream" => adapt::<v1::SampleStreamRequest>(req, max),
                "/samplerd.v1.Sampler/SampleBatch" => adapt::<v1::SampleBatchRequest>(req, max),
                "/samplerd.v1.Sampler/SampleBatchStream" => {
                    adapt::<v1::SampleBatchStreamRequest>(req, max)
                }
                _ => req,
            }
        };
        Box::pin(inner.call(req))
    }
}

/// `req` with its body's messages of type `M` decoded here.
fn adapt<M>(req: http::Request<Body>, max_message_bytes: usize) -> http::Request<Body>
where
    M: Message + Default + Send + Sync + 'static,
{
    let queue = Predecoded::<M>::default();
    let (mut parts, body) = req.into_parts();
    parts.extensions.insert(queue.clone());
    let body = Body::new(Messages::new(body, queue, max_message_bytes));
    http::Request::from_parts(parts, body)
}

/// No `grpc-encoding`, or `identity`.
fn uncompressed<B>(req: &http::Request<B>) -> bool {
    req.headers()
        .get("grpc-encoding")
        .is_none_or(|v| v.as_bytes() == b"identity")
}
