//! Fuzzes the streaming UTF-8 decoder (`samplerd_model::Utf8Streamer`):
//! arbitrary bytes split into arbitrary chunks (a byte-level BPE token may
//! end anywhere inside a character).
//!
//! Oracle: every push returns valid text (a `String`) and holds back at most
//! 3 bytes (an incomplete character); all pushes plus `finish()` equal
//! `String::from_utf8_lossy` of the whole input, however it was split.

#![no_main]

use libfuzzer_sys::fuzz_target;
use samplerd_model::Utf8Streamer;

fuzz_target!(|input: (Vec<u8>, Vec<u8>)| {
    let (bytes, cuts) = input;
    let mut streamer = Utf8Streamer::new();
    let mut out = String::new();
    let mut rest: &[u8] = &bytes;
    let mut cuts = cuts.iter().map(|&c| usize::from(c % 8));
    while !rest.is_empty() {
        let n = cuts.next().unwrap_or(rest.len()).min(rest.len());
        let (chunk, tail) = rest.split_at(n);
        out.push_str(&streamer.push(chunk));
        assert!(
            streamer.pending().len() <= 3,
            "holds back {} bytes",
            streamer.pending().len()
        );
        rest = tail;
    }
    out.push_str(&streamer.finish());
    assert!(streamer.pending().is_empty());
    assert_eq!(out, String::from_utf8_lossy(&bytes));
});
