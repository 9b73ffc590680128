//! The request body seen by tonic: each message decoded here from its
//! frames replaced by an empty message, everything else passed on as sent.

#![forbid(unsafe_code)]

use std::collections::VecDeque;
use std::marker::PhantomData;
use std::pin::Pin;
use std::task::{Context, Poll, ready};

use http_body::Frame;
use prost::Message;
use prost::bytes::Bytes;
use tonic::Status;
use tonic::body::Body;

use super::Predecoded;
use super::rope::{Rope, Scratch};

/// gRPC's length prefix: a compressed flag and a big-endian u32 length.
const PREFIX: usize = 5;
/// A gRPC message of zero bytes: what tonic decodes in place of a message
/// decoded here.
const EMPTY_MESSAGE: [u8; PREFIX] = [0; PREFIX];

/// Where the body is in gRPC's length-prefixed framing.
#[derive(Debug)]
enum Framing {
    /// `n` bytes of a message's prefix seen (0: between messages).
    Prefix { bytes: [u8; PREFIX], n: usize },
    /// Gathering a message to decode here, `left` bytes to go.
    Gather {
        prefix: [u8; PREFIX],
        left: usize,
        rope: Rope,
    },
    /// Passing a message on to tonic as it comes, `left` bytes to go.
    Pass { left: usize },
}

const BOUNDARY: Framing = Framing::Prefix {
    bytes: [0; PREFIX],
    n: 0,
};

/// A request body of `M` messages (see the module docs).
pub(super) struct Messages<M> {
    inner: Body,
    queue: Predecoded<M>,
    max_message_bytes: usize,
    framing: Framing,
    /// What tonic gets next, in order.
    out: VecDeque<Result<Frame<Bytes>, Status>>,
    /// The inner body has ended.
    done: bool,
    /// What this stream copies into; kept from message to message.
    scratch: Scratch,
    _message: PhantomData<fn() -> M>,
}

impl<M: Message + Default> Messages<M> {
    pub(super) fn new(inner: Body, queue: Predecoded<M>, max_message_bytes: usize) -> Self {
        Messages {
            inner,
            queue,
            max_message_bytes,
            framing: BOUNDARY,
            out: VecDeque::new(),
            done: false,
            scratch: Scratch::default(),
            _message: PhantomData,
        }
    }

    fn emit(&mut self, data: Bytes) {
        if !data.is_empty() {
            self.out.push_back(Ok(Frame::data(data)));
        }
    }

    /// Follows one DATA frame through the framing.
    fn feed(&mut self, mut data: Bytes) {
        while !data.is_empty() {
            self.framing = match std::mem::replace(&mut self.framing, BOUNDARY) {
                Framing::Prefix { mut bytes, n } => {
                    let k = (PREFIX - n).min(data.len());
                    bytes[n..n + k].copy_from_slice(&data.split_to(k));
                    if n + k < PREFIX {
                        Framing::Prefix { bytes, n: n + k }
                    } else {
                        self.start(bytes)
                    }
                }
                Framing::Gather {
                    prefix,
                    left,
                    mut rope,
                } => {
                    let k = left.min(data.len());
                    rope.push(data.split_to(k), &mut self.scratch);
                    if left == k {
                        self.finish(prefix, rope);
                        BOUNDARY
                    } else {
                        Framing::Gather {
                            prefix,
                            left: left - k,
                            rope,
                        }
                    }
                }
                Framing::Pass { left } => {
                    let k = left.min(data.len());
                    self.emit(data.split_to(k));
                    match left - k {
                        0 => BOUNDARY,
                        left => Framing::Pass { left },
                    }
                }
            };
        }
    }

    /// A message with this prefix begins.
    fn start(&mut self, prefix: [u8; PREFIX]) -> Framing {
        let len = u32::from_be_bytes([prefix[1], prefix[2], prefix[3], prefix[4]]) as usize;
        if prefix[0] != 0 || len > self.max_message_bytes || len == 0 {
            // tonic's to judge (or, for an empty message, trivial).
            self.queue.push(None);
            self.emit(Bytes::copy_from_slice(&prefix));
            return match len {
                0 => BOUNDARY,
                left => Framing::Pass { left },
            };
        }
        Framing::Gather {
            prefix,
            left: len,
            rope: Rope::new(len, &mut self.scratch),
        }
    }

    /// The whole message is here: decoded, or passed on for tonic to
    /// refuse as it does.
    fn finish(&mut self, prefix: [u8; PREFIX], mut rope: Rope) {
        rope.seal(&mut self.scratch);
        let pieces: Vec<Bytes> = rope.pieces().cloned().collect();
        match M::decode(rope.into_buf(&mut self.scratch)) {
            Ok(message) => {
                self.queue.push(Some(message));
                self.emit(Bytes::from_static(&EMPTY_MESSAGE));
            }
            Err(_) => self.pass_on(prefix, pieces),
        }
    }

    /// A message's bytes, for tonic.
    fn pass_on(&mut self, prefix: [u8; PREFIX], pieces: Vec<Bytes>) {
        self.queue.push(None);
        self.emit(Bytes::copy_from_slice(&prefix));
        for piece in pieces {
            self.emit(piece);
        }
    }

    /// The body ends (or trailers come) inside a message: what was held
    /// goes to tonic, which reports the cut message as it does.
    fn flush(&mut self) {
        match std::mem::replace(&mut self.framing, BOUNDARY) {
            Framing::Prefix { bytes, n } => {
                if n > 0 {
                    self.emit(Bytes::copy_from_slice(&bytes[..n]));
                }
            }
            Framing::Gather {
                prefix, mut rope, ..
            } => {
                rope.seal(&mut self.scratch);
                let pieces = rope.pieces().cloned().collect();
                self.pass_on(prefix, pieces);
            }
            Framing::Pass { .. } => {}
        }
    }
}

impl<M: Message + Default> http_body::Body for Messages<M> {
    type Data = Bytes;
    type Error = Status;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, Status>>> {
        let this = &mut *self;
        loop {
            if let Some(next) = this.out.pop_front() {
                return Poll::Ready(Some(next));
            }
            if this.done {
                return Poll::Ready(None);
            }
            match ready!(Pin::new(&mut this.inner).poll_frame(cx)) {
                Some(Ok(frame)) => match frame.into_data() {
                    Ok(data) => this.feed(data),
                    Err(frame) => {
                        this.flush();
                        this.out.push_back(Ok(frame));
                    }
                },
                // tonic reports the error as it always does.
                Some(Err(e)) => this.out.push_back(Err(e)),
                None => {
                    this.flush();
                    this.done = true;
                }
            }
        }
    }

    fn is_end_stream(&self) -> bool {
        self.done && self.out.is_empty()
    }
}

#[cfg(test)]
mod tests {
    use http_body_util::{BodyExt, StreamBody};
    use samplerd_api::v1;
    use tokio_stream as stream;

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

    /// Splits the length-prefixed messages of `body` (tonic's view).
    fn messages<M: Message + Default>(mut body: &[u8]) -> Vec<M> {
        let mut out = Vec::new();
        while !body.is_empty() {
            let len = u32::from_be_bytes(body[1..5].try_into().unwrap()) as usize;
            out.push(M::decode(&body[5..5 + len]).unwrap());
            body = &body[5 + len..];
        }
        out
    }

    fn adapted<M: Message + Default + 'static>(
        frames: Vec<Frame<Bytes>>,
        max: usize,
    ) -> (Body, Predecoded<M>) {
        let queue = Predecoded::default();
        (
            Body::new(Messages::new(body(frames), queue.clone(), max)),
            queue,
        )
    }

    fn row(id: u64, n: usize) -> v1::BatchStreamRow {
        v1::BatchStreamRow {
            sequence_id: id,
            logits: (0..n)
                .map(|i| (i as u64 * 37 + id) as u8)
                .collect::<Vec<_>>()
                .into(),
            previous_tokens: vec![1, 2, 3],
            ..Default::default()
        }
    }

    #[tokio::test]
    async fn a_message_in_one_frame_is_decoded_without_its_bytes_moving() {
        let req = v1::SampleRequest {
            logits_f32le: vec![3u8; 4000].into(),
            previous_tokens: vec![1, 2, 3],
            step: 7,
            ..Default::default()
        };
        let wire = Bytes::from(framed(&req.encode_to_vec(), false));
        let mut trailers = http::HeaderMap::new();
        trailers.insert("x-note", "kept".parse().unwrap());
        let frames = vec![
            Frame::data(wire.clone()),
            data(&[]),
            Frame::trailers(trailers.clone()),
        ];
        let (body, queue) = adapted::<v1::SampleRequest>(frames, 1 << 20);
        let (bytes, got_trailers) = collect(body).await;
        assert_eq!(bytes, EMPTY_MESSAGE, "tonic gets an empty message");
        assert_eq!(got_trailers, Some(trailers));
        let got = queue.take(v1::SampleRequest::default());
        assert_eq!(got, req);
        // A slice of the frame, not a copy.
        assert!(wire.as_ptr_range().contains(&got.logits_f32le.as_ptr()));
    }

    /// A batch message over many frames: each row held whole by one frame
    /// is a slice of it; only the rows a frame boundary cuts are copies.
    #[tokio::test]
    async fn batch_rows_inside_a_frame_are_slices_of_it() {
        let msg = v1::SampleBatchStreamRequest {
            rows: (0..8).map(|i| row(i, 100_000)).collect(),
            ..Default::default()
        };
        let wire = Bytes::from(framed(&msg.encode_to_vec(), false));
        let frame_bytes = 256 * 1024;
        let frames: Vec<Bytes> = (0..wire.len())
            .step_by(frame_bytes)
            .map(|at| wire.slice(at..(at + frame_bytes).min(wire.len())))
            .collect();
        let (body, queue) = adapted::<v1::SampleBatchStreamRequest>(
            frames.iter().cloned().map(Frame::data).collect(),
            1 << 30,
        );
        let (bytes, _) = collect(body).await;
        assert_eq!(bytes, EMPTY_MESSAGE);
        let got = queue.take(Default::default());
        assert_eq!(got, msg);
        let in_frame = |b: &Bytes| {
            frames
                .iter()
                .any(|f| f.as_ptr_range().contains(&b.as_ptr()))
        };
        let sliced = got.rows.iter().filter(|r| in_frame(&r.logits)).count();
        // 8 rows of 100 KB over 256 KiB frames: three boundaries cut rows.
        assert_eq!(sliced, 5, "rows decoded in place");
    }

    /// Compressed, oversized, malformed and cut messages reach tonic
    /// exactly as sent, with a `None` in the queue for each that begins.
    #[tokio::test]
    async fn anything_else_is_passed_on_byte_for_byte() {
        let message = v1::SampleRequest {
            logits_f32le: vec![9u8; 300].into(),
            ..Default::default()
        }
        .encode_to_vec();
        let wire = framed(&message, false);
        let mut trailers = http::HeaderMap::new();
        trailers.insert("x-note", "kept".parse().unwrap());
        let cases: Vec<(&str, Vec<Frame<Bytes>>, usize, usize)> = vec![
            (
                "compressed",
                vec![data(&framed(&message, true))],
                1 << 20,
                1,
            ),
            ("over the limit", vec![data(&wire)], message.len() - 1, 1),
            (
                "malformed",
                vec![data(&framed(&[0xff, 0xff, 0xff], false))],
                1 << 20,
                1,
            ),
            ("cut", vec![data(&wire[..100])], 1 << 20, 1),
            (
                "cut, then trailers",
                vec![data(&wire[..100]), Frame::trailers(trailers.clone())],
                1 << 20,
                1,
            ),
            ("prefix only", vec![data(&wire[..4])], 1 << 20, 0),
            ("empty message", vec![data(&framed(&[], false))], 1 << 20, 1),
        ];
        for (name, frames, limit, entries) in cases {
            let sent: Vec<u8> = frames
                .iter()
                .filter_map(|f| f.data_ref())
                .flat_map(|d| d.to_vec())
                .collect();
            let sent_trailers = frames.iter().find_map(|f| f.trailers_ref().cloned());
            let (body, queue) = adapted::<v1::SampleRequest>(frames, limit);
            let (bytes, got_trailers) = collect(body).await;
            assert_eq!(bytes, sent, "{name}");
            assert_eq!(got_trailers, sent_trailers, "{name}");
            let queued = queue.queue().len();
            assert_eq!(queued, entries, "{name}");
            assert!(queue.queue().iter().all(Option::is_none), "{name}");
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

    /// Random streams cut into random frames (whole messages, split ones,
    /// several per frame, one-byte frames, empty frames, messages over the
    /// size limit among them): what the handler gets — tonic's messages
    /// with the queued ones in their place — is what was sent.
    #[tokio::test]
    async fn a_stream_reads_the_same_messages_however_it_is_framed() {
        let mut rng = Rng(0x9E37_79B9_7F4A_7C15);
        let (mut decoded_here, mut left_to_tonic) = (0, 0);
        for round in 0..200 {
            let sent: Vec<v1::SampleBatchStreamRequest> = (0..1 + rng.below(6))
                .map(|i| v1::SampleBatchStreamRequest {
                    rows: (0..rng.below(4))
                        .map(|r| row((r + i) as u64, rng.below(200_000)))
                        .collect(),
                    leave: vec![round],
                    ..Default::default()
                })
                .collect();
            let mut wire = Vec::new();
            for m in &sent {
                wire.extend(framed(&m.encode_to_vec(), false));
            }
            let mut frames = Vec::new();
            let mut at = 0;
            while at < wire.len() {
                let len = match rng.below(5) {
                    0 => 1,
                    1 => 0,
                    2 => 1 + rng.below(64 * 1024),
                    _ => 1 + rng.below(1 << 20),
                }
                .min(wire.len() - at);
                frames.push(data(&wire[at..at + len]));
                at += len;
            }
            // Messages over 300 KB are tonic's (to refuse, in a server).
            let (body, queue) = adapted::<v1::SampleBatchStreamRequest>(frames, 300_000);
            let (bytes, _) = collect(body).await;
            let here = queue.queue().iter().filter(|e| e.is_some()).count();
            decoded_here += here;
            left_to_tonic += queue.queue().len() - here;
            let seen: Vec<_> = messages::<v1::SampleBatchStreamRequest>(&bytes)
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
