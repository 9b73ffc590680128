//! `Sample` and `SampleStream` messages decoded straight from the HTTP/2
//! DATA frame that carries them, instead of from tonic's message buffer.
//!
//! tonic copies every incoming DATA frame into one growing buffer and
//! decodes messages from there. For 151,936 raw logits that copy is 600 KB
//! (for a unary call into freshly allocated memory), as much as the
//! handler's own copy into the token buffer, and on the critical path of
//! every step. When a whole gRPC message arrives in a single frame (what
//! clients that honour samplerd's 1 MiB `SETTINGS_MAX_FRAME_SIZE` send,
//! tonic's among them), [`OneFrameDecode`] decodes it with prost straight
//! from that frame: `logits_f32le` becomes a slice of the frame, no byte is
//! copied. tonic gets an empty message in its place and still does
//! everything else (metadata, response encoding, status codes, compression
//! of the response); the handler takes the decoded message from the
//! request's extensions: [`Predecoded`] for `Sample`, the queue
//! [`PredecodedStream`] for `SampleStream`.
//!
//! Anything else — another method, a compressed request, a message split
//! over several frames or sharing one, one over the size limit or that
//! prost rejects — reaches tonic byte for byte as the client sent it (for
//! `Sample`, the frames read so far are replayed in front of the rest of
//! the body; at most two frames are held back), and tonic answers as it
//! always does.

#![forbid(unsafe_code)]

use std::collections::VecDeque;
use std::convert::Infallible;
use std::pin::Pin;
use std::sync::{Arc, Mutex, PoisonError};
use std::task::{Context, Poll, ready};

use http_body::Frame;
use http_body_util::{BodyExt, BodyStream, StreamBody};
use prost::Message;
use prost::bytes::Bytes;
use samplerd_api::v1;
use tokio_stream::{self as stream, StreamExt};
use tonic::Status;
use tonic::body::Body;
use tower::{Service, ServiceExt};

use super::middleware::{HttpResponse, Middleware, ResponseFuture};

/// The paths of the methods decoded here.
const SAMPLE_PATH: &str = "/samplerd.v1.Sampler/Sample";
const SAMPLE_STREAM_PATH: &str = "/samplerd.v1.Sampler/SampleStream";
/// gRPC's length prefix: a compressed flag and a big-endian u32 length.
const PREFIX: usize = 5;
/// A gRPC message of zero bytes: what the generated service decodes when
/// the request was decoded here.
const EMPTY_MESSAGE: [u8; PREFIX] = [0; PREFIX];

/// A `SampleRequest` decoded by [`OneFrameDecode`]; the handler takes it
/// instead of the (empty) message tonic decoded.
#[derive(Clone, Debug)]
pub struct Predecoded(pub v1::SampleRequest);

/// The `SampleStreamRequest`s of one stream decoded by [`OneFrameDecode`]:
/// one entry per message of the stream, in order — `Some` for a message
/// decoded here (tonic yields an empty one in its place), `None` for one
/// left to tonic. An entry is queued before tonic can yield its message.
#[derive(Clone, Debug, Default)]
pub struct PredecodedStream(Arc<Mutex<VecDeque<Option<v1::SampleStreamRequest>>>>);

impl PredecodedStream {
    /// The message to use for the one tonic just yielded.
    pub fn take(&self, from_tonic: v1::SampleStreamRequest) -> v1::SampleStreamRequest {
        self.queue().pop_front().flatten().unwrap_or(from_tonic)
    }

    fn push(&self, entry: Option<v1::SampleStreamRequest>) {
        self.queue().push_back(entry);
    }

    fn queue(&self) -> std::sync::MutexGuard<'_, VecDeque<Option<v1::SampleStreamRequest>>> {
        // Nothing panics while holding the lock.
        self.0.lock().unwrap_or_else(PoisonError::into_inner)
    }
}

/// The middleware around the generated `Sampler` service (see the module
/// docs): `Wrap::new(OneFrameDecode::new(max), service)`.
#[derive(Clone, Copy, Debug)]
pub struct OneFrameDecode {
    /// The service's `max_decoding_message_size`: larger messages go to
    /// tonic, which answers `RESOURCE_EXHAUSTED`.
    max_message_bytes: usize,
}

impl OneFrameDecode {
    pub fn new(max_message_bytes: usize) -> Self {
        OneFrameDecode { max_message_bytes }
    }
}

impl<S> Middleware<S, Body> for OneFrameDecode
where
    S: Service<http::Request<Body>, Response = HttpResponse, Error = Infallible> + Send + 'static,
    S::Future: Send + 'static,
{
    fn call(&self, mut inner: S, req: http::Request<Body>) -> ResponseFuture<Infallible> {
        let max = self.max_message_bytes;
        if !uncompressed(&req) {
            return Box::pin(inner.call(req));
        }
        if req.uri().path() == SAMPLE_STREAM_PATH {
            let queue = PredecodedStream::default();
            let (mut parts, body) = req.into_parts();
            parts.extensions.insert(queue.clone());
            let body = Body::new(StreamMessages {
                inner: body,
                queue,
                framing: Framing::Boundary,
                max_message_bytes: max,
            });
            return Box::pin(inner.call(http::Request::from_parts(parts, body)));
        }
        if req.uri().path() != SAMPLE_PATH {
            return Box::pin(inner.call(req));
        }
        Box::pin(async move {
            let (mut parts, body) = req.into_parts();
            let body = match read_one_frame(body, max).await {
                Read::Decoded(request, trailers) => {
                    parts.extensions.insert(Predecoded(*request));
                    let empty = Frame::data(Bytes::from_static(&EMPTY_MESSAGE));
                    let frames = std::iter::once(empty).chain(trailers.map(Frame::trailers));
                    Body::new(StreamBody::new(stream::iter(frames.map(Ok::<_, Status>))))
                }
                Read::Replay(held, rest) => {
                    let held = stream::iter(held.into_iter().map(Ok::<_, Status>));
                    Body::new(StreamBody::new(held.chain(BodyStream::new(rest))))
                }
            };
            // The replaced `inner` was ready; the generated service always is.
            inner
                .ready()
                .await?
                .call(http::Request::from_parts(parts, body))
                .await
        })
    }
}

/// No `grpc-encoding`, or `identity`.
fn uncompressed<B>(req: &http::Request<B>) -> bool {
    req.headers()
        .get("grpc-encoding")
        .is_none_or(|v| v.as_bytes() == b"identity")
}

/// What [`read_one_frame`] found.
enum Read {
    /// The whole body was one message in one frame (plus the request's
    /// trailers, if any).
    Decoded(Box<v1::SampleRequest>, Option<http::HeaderMap>),
    /// For tonic: the frames read so far, then the rest of the body.
    Replay(Vec<Frame<Bytes>>, Body),
}

/// Reads the body while it can still be one message in one DATA frame
/// (empty frames aside); decodes it at its end.
async fn read_one_frame(mut body: Body, max_message_bytes: usize) -> Read {
    let mut held: Vec<Frame<Bytes>> = Vec::with_capacity(2);
    let mut message: Option<Bytes> = None;
    loop {
        let frame = match body.frame().await {
            None => break,
            Some(Ok(frame)) => frame,
            // tonic reports the error as it always does.
            Some(Err(e)) => {
                let rest = Body::new(StreamBody::new(stream::iter([Err::<Frame<Bytes>, _>(e)])));
                return Read::Replay(held, rest);
            }
        };
        // Empty DATA frames carry nothing for tonic: not holding them keeps
        // what is held bounded whatever the client sends.
        if frame.data_ref().is_some_and(|d| d.is_empty()) {
            continue;
        }
        let data = frame.data_ref().cloned();
        held.push(frame);
        if let Some(data) = data {
            if message.is_some() {
                return Read::Replay(held, body);
            }
            match whole_message(&data, max_message_bytes) {
                Some(m) => message = Some(m),
                None => return Read::Replay(held, body),
            }
        }
    }
    let trailers = held.iter().find_map(|f| f.trailers_ref().cloned());
    match message.map(v1::SampleRequest::decode) {
        // `decode` from `Bytes` slices `logits_f32le` out of the frame.
        Some(Ok(request)) => Read::Decoded(Box::new(request), trailers),
        _ => Read::Replay(held, body),
    }
}

/// The message in `data` when `data` is exactly one uncompressed,
/// length-prefixed gRPC message within the size limit.
fn whole_message(data: &Bytes, max_message_bytes: usize) -> Option<Bytes> {
    let (prefix, _) = data.split_at_checked(PREFIX)?;
    let len = u32::from_be_bytes([prefix[1], prefix[2], prefix[3], prefix[4]]) as usize;
    (prefix[0] == 0 && len <= max_message_bytes && data.len() == PREFIX + len)
        .then(|| data.slice(PREFIX..))
}

/// Where a stream's bytes are in gRPC's length-prefixed framing.
#[derive(Clone, Copy, Debug)]
enum Framing {
    /// Between messages.
    Boundary,
    /// `n` bytes of a message's 5-byte prefix seen.
    Prefix { bytes: [u8; PREFIX], n: usize },
    /// Inside a message, `left` bytes to go.
    Message { left: usize },
}

/// A `SampleStream` request body that replaces each frame holding exactly
/// one message with an empty message, queueing the decoded one.
struct StreamMessages {
    inner: Body,
    queue: PredecodedStream,
    framing: Framing,
    max_message_bytes: usize,
}

impl StreamMessages {
    /// Follows the framing through bytes passed on to tonic, queueing a
    /// `None` for every message that starts in them.
    fn pass(&mut self, mut data: &[u8]) {
        while !data.is_empty() {
            self.framing = match self.framing {
                Framing::Boundary => {
                    self.queue.push(None);
                    Framing::Prefix {
                        bytes: [0; PREFIX],
                        n: 0,
                    }
                }
                Framing::Prefix { mut bytes, n } => {
                    let k = (PREFIX - n).min(data.len());
                    bytes[n..n + k].copy_from_slice(&data[..k]);
                    data = &data[k..];
                    if n + k < PREFIX {
                        Framing::Prefix { bytes, n: n + k }
                    } else {
                        match u32::from_be_bytes([bytes[1], bytes[2], bytes[3], bytes[4]]) {
                            0 => Framing::Boundary,
                            len => Framing::Message { left: len as usize },
                        }
                    }
                }
                Framing::Message { left } => {
                    let k = left.min(data.len());
                    data = &data[k..];
                    match left - k {
                        0 => Framing::Boundary,
                        left => Framing::Message { left },
                    }
                }
            };
        }
    }
}

impl http_body::Body for StreamMessages {
    type Data = Bytes;
    type Error = Status;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, Status>>> {
        let this = &mut *self;
        let frame = match ready!(Pin::new(&mut this.inner).poll_frame(cx)) {
            Some(Ok(frame)) => frame,
            other => return Poll::Ready(other),
        };
        let data = match frame.into_data() {
            Ok(data) => data,
            Err(frame) => return Poll::Ready(Some(Ok(frame))),
        };
        if matches!(this.framing, Framing::Boundary)
            && let Some(message) = whole_message(&data, this.max_message_bytes)
            && let Ok(request) = v1::SampleStreamRequest::decode(message)
        {
            this.queue.push(Some(request));
            return Poll::Ready(Some(Ok(Frame::data(Bytes::from_static(&EMPTY_MESSAGE)))));
        }
        this.pass(&data);
        Poll::Ready(Some(Ok(Frame::data(data))))
    }

    fn is_end_stream(&self) -> bool {
        self.inner.is_end_stream()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn framed(message: &[u8], compressed: bool) -> Vec<u8> {
        let mut out = vec![u8::from(compressed)];
        out.extend((message.len() as u32).to_be_bytes());
        out.extend_from_slice(message);
        out
    }

    fn body(frames: Vec<Frame<Bytes>>) -> Body {
        Body::new(StreamBody::new(stream::iter(
            frames.into_iter().map(Ok::<_, Status>),
        )))
    }

    fn data(bytes: &[u8]) -> Frame<Bytes> {
        Frame::data(Bytes::copy_from_slice(bytes))
    }

    /// Every data byte and the trailers of a body.
    async fn collect(body: Body) -> (Vec<u8>, Option<http::HeaderMap>) {
        let collected = body.collect().await.expect("body");
        let trailers = collected.trailers().cloned();
        (collected.to_bytes().to_vec(), trailers)
    }

    fn sample_request(seed: u64) -> v1::SampleRequest {
        let logits: Vec<f32> = (0..1000)
            .map(|i| ((i * 37 + seed) % 101) as f32 / 7.0)
            .collect();
        v1::SampleRequest {
            logits_f32le: logits.iter().flat_map(|f| f.to_le_bytes()).collect(),
            previous_tokens: vec![1, 2, 3],
            step: seed,
            ..Default::default()
        }
    }

    #[tokio::test]
    async fn a_message_in_one_frame_is_decoded_without_its_bytes_moving() {
        let req = sample_request(7);
        let wire = Bytes::from(framed(&req.encode_to_vec(), false));
        let mut trailers = http::HeaderMap::new();
        trailers.insert("x-note", "kept".parse().unwrap());
        let frames = vec![
            Frame::data(wire.clone()),
            data(&[]),
            Frame::trailers(trailers.clone()),
        ];
        match read_one_frame(body(frames), 1 << 20).await {
            Read::Decoded(got, got_trailers) => {
                assert_eq!(*got, req);
                // A slice of the frame, not a copy.
                let frame = wire.as_ptr_range();
                assert!(frame.contains(&got.logits_f32le.as_ptr()));
                assert_eq!(got_trailers, Some(trailers));
            }
            Read::Replay(..) => panic!("a one-frame message was not decoded"),
        }
    }

    /// Split, compressed, oversized, malformed or doubled messages reach
    /// tonic exactly as sent.
    #[tokio::test]
    async fn anything_else_is_replayed_byte_for_byte() {
        let message = sample_request(3).encode_to_vec();
        let wire = framed(&message, false);
        let mut trailers = http::HeaderMap::new();
        trailers.insert("x-note", "kept".parse().unwrap());
        let cases: Vec<(&str, Vec<Frame<Bytes>>, usize)> = vec![
            (
                "split",
                vec![data(&wire[..100]), data(&wire[100..])],
                1 << 20,
            ),
            (
                "split, trailers",
                vec![
                    data(&wire[..3]),
                    data(&wire[3..]),
                    Frame::trailers(trailers.clone()),
                ],
                1 << 20,
            ),
            ("compressed", vec![data(&framed(&message, true))], 1 << 20),
            ("over the limit", vec![data(&wire)], message.len() - 1),
            (
                "malformed",
                vec![data(&framed(&[0xff, 0xff, 0xff], false))],
                1 << 20,
            ),
            ("two messages", vec![data(&wire), data(&wire)], 1 << 20),
            (
                "two in one frame",
                vec![data(&[wire.clone(), wire.clone()].concat())],
                1 << 20,
            ),
            ("prefix only", vec![data(&wire[..4])], 1 << 20),
        ];
        for (name, frames, limit) in cases {
            let sent: Vec<u8> = frames
                .iter()
                .filter_map(|f| f.data_ref())
                .flat_map(|d| d.to_vec())
                .collect();
            let sent_trailers = frames.iter().find_map(|f| f.trailers_ref().cloned());
            match read_one_frame(body(frames), limit).await {
                Read::Decoded(..) => panic!("{name}: decoded"),
                Read::Replay(held, rest) => {
                    let held = stream::iter(held.into_iter().map(Ok::<_, Status>));
                    let replayed = Body::new(StreamBody::new(held.chain(BodyStream::new(rest))));
                    let (bytes, got_trailers) = collect(replayed).await;
                    assert_eq!(bytes, sent, "{name}");
                    assert_eq!(got_trailers, sent_trailers, "{name}");
                }
            }
        }
    }

    /// A tiny xorshift: reproducible frame boundaries.
    struct Rng(u64);

    impl Rng {
        fn below(&mut self, n: usize) -> usize {
            self.0 ^= self.0 << 13;
            self.0 ^= self.0 >> 7;
            self.0 ^= self.0 << 17;
            (self.0 % n as u64) as usize
        }
    }

    /// Splits the length-prefixed messages of `body` (tonic's view).
    fn messages(mut body: &[u8]) -> Vec<v1::SampleStreamRequest> {
        let mut out = Vec::new();
        while !body.is_empty() {
            let len = u32::from_be_bytes(body[1..5].try_into().unwrap()) as usize;
            out.push(v1::SampleStreamRequest::decode(&body[5..5 + len]).unwrap());
            body = &body[5 + len..];
        }
        out
    }

    /// Random streams cut into random frames (whole messages, split ones,
    /// several per frame, empty frames): what the handler gets — tonic's
    /// messages with the queued ones in their place — is what was sent.
    #[tokio::test]
    async fn a_stream_reads_the_same_messages_however_it_is_framed() {
        let mut rng = Rng(0x9E37_79B9_7F4A_7C15);
        let (mut decoded_here, mut left_to_tonic) = (0, 0);
        for round in 0..200 {
            let sent: Vec<v1::SampleStreamRequest> = (0..1 + rng.below(6))
                .map(|i| v1::SampleStreamRequest {
                    logits_f32le: vec![i as u8; 4 * rng.below(300)].into(),
                    first_step: round,
                    ..Default::default()
                })
                .collect();
            let mut frames = Vec::new();
            for m in &sent {
                let wire = framed(&m.encode_to_vec(), false);
                match rng.below(4) {
                    // Whole, in a frame of its own.
                    0 | 1 => frames.push(wire),
                    // Split at a random byte.
                    2 => {
                        let at = rng.below(wire.len());
                        frames.push(wire[..at].to_vec());
                        frames.push(wire[at..].to_vec());
                    }
                    // Glued to the previous frame.
                    _ => match frames.last_mut() {
                        Some(last) => last.extend(wire),
                        None => frames.push(wire),
                    },
                }
            }
            let queue = PredecodedStream::default();
            let adapted = Body::new(StreamMessages {
                inner: body(frames.iter().map(|f| data(f)).collect()),
                queue: queue.clone(),
                framing: Framing::Boundary,
                max_message_bytes: 1 << 20,
            });
            let (bytes, _) = collect(adapted).await;
            let here = queue.queue().iter().filter(|e| e.is_some()).count();
            decoded_here += here;
            left_to_tonic += queue.queue().len() - here;
            let seen: Vec<_> = messages(&bytes)
                .into_iter()
                .map(|m| queue.take(m))
                .collect();
            assert_eq!(seen, sent, "round {round}");
            assert!(queue.queue().is_empty(), "round {round}: entries left");
        }
        // Both paths were taken.
        assert!(
            decoded_here > 0 && left_to_tonic > 0,
            "{decoded_here} / {left_to_tonic}"
        );
    }
}
