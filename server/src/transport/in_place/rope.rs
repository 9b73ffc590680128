//! One gRPC message's bytes as the HTTP/2 DATA frames brought them, and the
//! [`bytes::Buf`] prost decodes from without gathering them first.
//!
//! tonic copies every frame into one growing buffer before it decodes; for
//! a `SampleBatchStream` message of 32 rows of 151,936 f32 logits that is
//! 19 MB moved, and, because the buffer is fresh memory, 19 MB of page
//! faults — together ~20 % of the server's time under that load. Here the
//! frames are kept as they are: prost's `bytes` fields
//! ([`Buf::copy_to_bytes`]) become slices of the frame that holds them, and
//! only a field cut by a frame boundary is copied, into the stream's
//! scratch buffer, whose memory is the same from message to message once
//! the previous message's rows are dropped ([`BytesMut::reserve`] reclaims
//! it). A small message that arrives whole is kept whole; other pieces too
//! small to be worth a `Bytes` each (a client's 16 KiB frames, or one-byte
//! frames from a hostile one) are gathered into the scratch as they come,
//! so the pieces kept stay few whatever the client sends.

#![forbid(unsafe_code)]

use std::collections::VecDeque;

use prost::bytes::{Buf, Bytes, BytesMut};

/// A frame at least this long is kept as it is; shorter ones are copied
/// together. 64 KiB: copying a piece this small costs less than the
/// bookkeeping of keeping it, and a message of `n` bytes is then at most
/// `2n / 64 KiB + 1` pieces.
pub const KEEP_BYTES: usize = 64 * 1024;

/// The bytes of one message so far.
#[derive(Debug)]
pub struct Rope {
    pieces: VecDeque<Bytes>,
    len: usize,
    /// The whole message's length.
    message_len: usize,
}

impl Rope {
    /// A message of `message_len` bytes; `scratch` is told, so that it
    /// reserves the whole message when it must grow (every copy of one
    /// message then fits in one reservation).
    pub fn new(message_len: usize, scratch: &mut Scratch) -> Self {
        scratch.reserve = message_len;
        Rope {
            pieces: VecDeque::new(),
            len: 0,
            message_len,
        }
    }

    /// Appends `data` (the part of a frame that belongs to this message):
    /// kept when long or when it is the whole message, copied into
    /// `scratch` otherwise.
    pub fn push(&mut self, data: Bytes, scratch: &mut Scratch) {
        self.len += data.len();
        if data.len() >= KEEP_BYTES || data.len() == self.message_len {
            self.seal(scratch);
            self.pieces.push_back(data);
        } else {
            scratch.put(&data);
        }
    }

    /// Ends the copied run in `scratch` as a piece of its own.
    pub fn seal(&mut self, scratch: &mut Scratch) {
        if let Some(piece) = scratch.take() {
            self.pieces.push_back(piece);
        }
    }

    /// The message's bytes, in order (the pieces share their memory).
    pub fn pieces(&self) -> impl Iterator<Item = &Bytes> {
        self.pieces.iter()
    }

    /// A [`Buf`] over the message for prost, copying into `scratch` only
    /// what straddles two pieces.
    pub fn into_buf(self, scratch: &mut Scratch) -> RopeBuf<'_> {
        RopeBuf {
            pieces: self.pieces,
            remaining: self.len,
            scratch,
        }
    }
}

/// The copy buffer of one stream: what frames too small to keep and
/// fields cut by a frame boundary are copied into.
#[derive(Debug, Default)]
pub struct Scratch {
    buf: BytesMut,
    /// The current message's length: the most one message can copy.
    reserve: usize,
}

impl Scratch {
    /// Copies `data` behind what is being gathered. The first copy of a
    /// message that does not fit reserves the whole message: one
    /// reservation a message, and the same memory every message once the
    /// previous one's pieces are dropped.
    fn put(&mut self, data: &[u8]) {
        if self.buf.capacity() - self.buf.len() < data.len() {
            self.buf.reserve(self.reserve.max(data.len()));
        }
        self.buf.extend_from_slice(data);
    }

    /// What has been gathered since the last take, if anything.
    fn take(&mut self) -> Option<Bytes> {
        (!self.buf.is_empty()).then(|| self.buf.split().freeze())
    }
}

/// [`Rope::into_buf`]'s [`Buf`].
#[derive(Debug)]
pub struct RopeBuf<'a> {
    /// Never holds an empty piece.
    pieces: VecDeque<Bytes>,
    remaining: usize,
    scratch: &'a mut Scratch,
}

impl Buf for RopeBuf<'_> {
    fn remaining(&self) -> usize {
        self.remaining
    }

    fn chunk(&self) -> &[u8] {
        self.pieces.front().map_or(&[], |p| p.as_ref())
    }

    fn advance(&mut self, mut cnt: usize) {
        assert!(cnt <= self.remaining, "advance past the message's end");
        self.remaining -= cnt;
        while cnt > 0 {
            let Some(front) = self.pieces.front_mut() else {
                return;
            };
            if cnt < front.len() {
                front.advance(cnt);
                return;
            }
            cnt -= front.len();
            self.pieces.pop_front();
        }
    }

    /// A field inside one piece is a slice of it; one across pieces is
    /// copied into the scratch buffer.
    fn copy_to_bytes(&mut self, len: usize) -> Bytes {
        assert!(len <= self.remaining, "copy past the message's end");
        if let Some(front) = self.pieces.front_mut()
            && front.len() >= len
        {
            let field = front.split_to(len);
            if front.is_empty() {
                self.pieces.pop_front();
            }
            self.remaining -= len;
            return field;
        }
        let mut left = len;
        while left > 0 {
            let k = left.min(self.chunk().len());
            let piece = self.pieces.front().expect("remaining counts the pieces");
            self.scratch.put(&piece[..k]);
            self.advance(k);
            left -= k;
        }
        self.scratch.take().unwrap_or_default()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn rope_of(frames: &[&[u8]], scratch: &mut Scratch) -> Rope {
        let mut rope = Rope::new(frames.iter().map(|f| f.len()).sum(), scratch);
        for f in frames {
            rope.push(Bytes::copy_from_slice(f), scratch);
        }
        rope.seal(scratch);
        rope
    }

    #[test]
    fn a_field_inside_a_frame_is_a_slice_of_it_and_one_across_frames_a_copy() {
        let big = vec![7u8; KEEP_BYTES * 2];
        let mut scratch = Scratch::default();
        let (a, b) = (Bytes::from(big.clone()), Bytes::from(big.clone()));
        let mut rope = Rope::new(a.len() + b.len(), &mut scratch);
        rope.push(a.clone(), &mut scratch);
        rope.push(b.clone(), &mut scratch);
        rope.seal(&mut scratch);
        let mut buf = rope.into_buf(&mut scratch);
        let inside = buf.copy_to_bytes(100);
        assert!(a.as_ptr_range().contains(&inside.as_ptr()), "not a slice");
        let across = buf.copy_to_bytes(a.len());
        assert!(!a.as_ptr_range().contains(&across.as_ptr()));
        assert!(!b.as_ptr_range().contains(&across.as_ptr()));
        assert_eq!(across.len(), a.len());
        assert_eq!(buf.remaining(), b.len() - 100);
        let rest = buf.copy_to_bytes(b.len() - 100);
        assert!(b.as_ptr_range().contains(&rest.as_ptr()), "not a slice");
        assert_eq!(buf.remaining(), 0);
    }

    /// Every way of cutting a message into frames reads back the same
    /// bytes, through `chunk`/`advance` and through `copy_to_bytes`.
    #[test]
    fn any_framing_reads_back_the_same_bytes() {
        let message: Vec<u8> = (0..3 * KEEP_BYTES + 17)
            .map(|i| (i * 31 % 251) as u8)
            .collect();
        let mut state = 0x2545_F491_4F6C_DD1Du64;
        let mut next = |n: usize| {
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            (state % n as u64) as usize
        };
        for round in 0..300 {
            let mut frames: Vec<&[u8]> = Vec::new();
            let mut at = 0;
            while at < message.len() {
                let len = match next(3) {
                    0 => 1 + next(16),
                    1 => 1 + next(KEEP_BYTES),
                    _ => KEEP_BYTES + next(2 * KEEP_BYTES),
                }
                .min(message.len() - at);
                frames.push(&message[at..at + len]);
                at += len;
            }
            let mut scratch = Scratch::default();
            let rope = rope_of(&frames, &mut scratch);
            assert_eq!(rope.pieces().map(Bytes::len).sum::<usize>(), message.len());
            assert!(rope.pieces().count() <= 2 * message.len() / KEEP_BYTES + 1);
            let mut buf = rope.into_buf(&mut scratch);
            let mut got = Vec::new();
            while buf.has_remaining() {
                let n = (1 + next(KEEP_BYTES * 2)).min(buf.remaining());
                if next(2) == 0 {
                    got.extend_from_slice(&buf.copy_to_bytes(n));
                } else {
                    let k = n.min(buf.chunk().len());
                    got.extend_from_slice(&buf.chunk()[..k]);
                    buf.advance(k);
                }
            }
            assert!(got == message, "round {round}");
        }
    }

    /// Once the previous message's fields are dropped, the next message's
    /// copies land in the same memory: no fresh pages per message.
    #[test]
    fn the_scratch_memory_is_reused_from_message_to_message() {
        let frames: Vec<Vec<u8>> = (0..8).map(|i| vec![i as u8; 1000]).collect();
        let frames: Vec<&[u8]> = frames.iter().map(|f| f.as_slice()).collect();
        let mut scratch = Scratch::default();
        let mut starts = Vec::new();
        for _ in 0..4 {
            let rope = rope_of(&frames, &mut scratch);
            let mut buf = rope.into_buf(&mut scratch);
            let all = buf.copy_to_bytes(8000);
            assert_eq!(all[7999], 7);
            starts.push(all.as_ptr());
            drop(all);
        }
        assert!(starts.windows(2).all(|w| w[0] == w[1]), "{starts:?}");
    }
}
