//! Streaming UTF-8: token bytes in, complete characters out.
//!
//! Byte-level BPE tokens may end inside a multi-byte character (CJK, emoji).
//! [`Utf8Streamer::push`] returns only complete, valid UTF-8 and holds back
//! an incomplete trailing sequence (at most 3 bytes) until the next token
//! completes it. Invalid bytes become U+FFFD as soon as they are known to be
//! invalid; a sequence that is merely incomplete becomes U+FFFD only at
//! [`Utf8Streamer::finish`].

#![forbid(unsafe_code)]

/// See the module docs.
#[derive(Debug, Default, Clone)]
pub struct Utf8Streamer {
    pending: Vec<u8>,
}

impl Utf8Streamer {
    pub fn new() -> Self {
        Self::default()
    }

    /// Feeds `bytes`; returns the text that is now complete (may be empty).
    pub fn push(&mut self, bytes: &[u8]) -> String {
        self.pending.extend_from_slice(bytes);
        let mut out = String::new();
        let mut keep = 0;
        let mut chunks = self.pending.utf8_chunks().peekable();
        while let Some(chunk) = chunks.next() {
            out.push_str(chunk.valid());
            let invalid = chunk.invalid();
            if invalid.is_empty() {
                continue;
            }
            // The last chunk's invalid part is either bytes that can never
            // start a character or the start of one cut off by the end of
            // the input; only the latter may still be completed by the next
            // token (`error_len` is None exactly for it), so it is held.
            let incomplete = chunks.peek().is_none()
                && std::str::from_utf8(invalid).is_err_and(|e| e.error_len().is_none());
            if incomplete {
                keep = invalid.len();
            } else {
                out.push('\u{FFFD}');
            }
        }
        let start = self.pending.len() - keep;
        self.pending.drain(..start);
        out
    }

    /// Bytes held back (an incomplete character).
    pub fn pending(&self) -> &[u8] {
        &self.pending
    }

    /// Ends the stream: held bytes become U+FFFD.
    pub fn finish(&mut self) -> String {
        let s = String::from_utf8_lossy(&self.pending).into_owned();
        self.pending.clear();
        s
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cjk_split_across_tokens_is_held() {
        let bytes = "你好".as_bytes(); // e4 bd a0 e5 a5 bd
        let mut s = Utf8Streamer::new();
        assert_eq!(s.push(&bytes[..1]), "");
        assert_eq!(s.push(&bytes[1..2]), "");
        assert_eq!(s.push(&bytes[2..4]), "你");
        assert_eq!(s.pending(), &bytes[3..4]);
        assert_eq!(s.push(&bytes[4..]), "好");
        assert_eq!(s.finish(), "");
    }

    #[test]
    fn emoji_and_ascii() {
        let b = "a😀b".as_bytes();
        let mut s = Utf8Streamer::new();
        let mut out = String::new();
        for c in b.chunks(1) {
            out += &s.push(c);
        }
        out += &s.finish();
        assert_eq!(out, "a😀b");
    }

    #[test]
    fn incomplete_at_end_becomes_replacement_only_at_finish() {
        let mut s = Utf8Streamer::new();
        assert_eq!(s.push(b"ok\xe4\xbd"), "ok");
        assert_eq!(s.finish(), "\u{FFFD}");
    }

    #[test]
    fn invalid_bytes_mid_stream() {
        let mut s = Utf8Streamer::new();
        assert_eq!(s.push(b"a\xffb"), "a\u{FFFD}b");
        // A lead byte followed by a non-continuation is invalid once seen.
        assert_eq!(s.push(b"\xe4"), "");
        assert_eq!(s.push(b"x"), "\u{FFFD}x");
        assert_eq!(s.finish(), "");
    }
    /// However the bytes are split into tokens, the streamed text is the
    /// lossy decoding of all of them (one U+FFFD per invalid sequence).
    #[test]
    fn any_split_gives_the_lossy_decoding_of_the_whole() {
        let cases: [&[u8]; 6] = [
            "a你😀b".as_bytes(),
            b"\xe4\xbd\xff\xe4x",
            b"\xf0\x9f\x98",
            b"\xe0\x80\xc0\xaf\xed\xa0\x80z",
            b"\xf4\x90\x80\x80\xf5",
            b"ok\xc2",
        ];
        for bytes in cases {
            for a in 0..=bytes.len() {
                for b in a..=bytes.len() {
                    let mut s = Utf8Streamer::new();
                    let mut out = s.push(&bytes[..a]);
                    out += &s.push(&bytes[a..b]);
                    out += &s.push(&bytes[b..]);
                    out += &s.finish();
                    assert_eq!(
                        out,
                        String::from_utf8_lossy(bytes),
                        "{bytes:x?} split at {a}, {b}"
                    );
                }
            }
        }
    }
}
