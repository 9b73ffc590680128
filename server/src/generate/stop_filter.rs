//! Byte-level stop strings. `match_stop_suffix` is the plain matcher (does
//! the byte stream now end with a stop string? earliest start wins);
//! `StopFilter` is the streaming form Generate uses: it holds back
//! any tail that could still begin a stop string, so streamed text never
//! contains any part of one, and flushes it when the match fails.
//! Bytes, not `str`: a stop string may complete in the middle of a UTF-8
//! character split across tokens. With [`StopFilter::after`] (`min_tokens`)
//! the first tokens' bytes are not looked at for a stop, as vLLM's
//! detokenizer has it (`IncrementalDetokenizer.update`,
//! vllm/v1/engine/detokenizer.py): a stop string must end in the bytes of
//! a later token, and may begin in the earlier ones.

#![forbid(unsafe_code)]

/// If `buf` ends with one of `stops`, the byte offset where the earliest-
/// starting (i.e. longest) matching stop string begins. Empty stops are
/// ignored.
pub fn match_stop_suffix(buf: &[u8], stops: &[&[u8]]) -> Option<usize> {
    stops
        .iter()
        .filter(|s| !s.is_empty() && buf.ends_with(s))
        .map(|s| buf.len() - s.len())
        .min()
}

/// What one `StopFilter::push` decided.
#[derive(Debug, Default, PartialEq, Eq)]
pub struct StopStep {
    /// Bytes safe to stream now.
    pub emit: Vec<u8>,
    /// A stop string matched: generation ends; `emit` is the text before it.
    pub stopped: bool,
}

/// Streaming stop-string filter with hold-back.
#[derive(Debug, Clone)]
pub struct StopFilter {
    stops: Vec<Vec<u8>>,
    pending: Vec<u8>,
    /// Tokens still to come whose bytes end no stop string.
    unchecked: u32,
    /// How many bytes at the start of `pending` were looked at already: a
    /// match must end after them.
    seen: usize,
}

impl StopFilter {
    /// Empty stop strings are ignored.
    pub fn new<I, S>(stops: I) -> Self
    where
        I: IntoIterator<Item = S>,
        S: AsRef<[u8]>,
    {
        StopFilter {
            stops: stops
                .into_iter()
                .map(|s| s.as_ref().to_vec())
                .filter(|s| !s.is_empty())
                .collect(),
            pending: Vec::new(),
            unchecked: 0,
            seen: 0,
        }
    }

    /// Stop strings end the generation only from token `min_tokens + 1`
    /// on (each [`push`](Self::push) is one token).
    pub fn after(mut self, min_tokens: u32) -> Self {
        self.unchecked = min_tokens;
        self
    }

    /// Bytes held back so far.
    pub fn pending(&self) -> &[u8] {
        &self.pending
    }

    /// Feeds the bytes of the next token.
    pub fn push(&mut self, bytes: &[u8]) -> StopStep {
        self.pending.extend_from_slice(bytes);
        // A complete stop string ending in the new bytes: the earliest
        // start wins (everything before it was not a stop match earlier).
        let hit = if self.unchecked > 0 {
            self.unchecked -= 1;
            None
        } else {
            let seen = self.seen;
            self.stops
                .iter()
                .filter_map(|s| find_ending_after(&self.pending, s, seen))
                .min()
        };
        if let Some(start) = hit {
            let emit = self.pending[..start].to_vec();
            self.pending.clear();
            return StopStep {
                emit,
                stopped: true,
            };
        }
        // Hold back the longest suffix that is a proper prefix of a stop.
        let hold = self
            .stops
            .iter()
            .map(|s| longest_suffix_prefix(&self.pending, s))
            .max()
            .unwrap_or(0);
        let cut = self.pending.len() - hold;
        let emit: Vec<u8> = self.pending.drain(..cut).collect();
        self.seen = self.pending.len();
        StopStep {
            emit,
            stopped: false,
        }
    }

    /// End of generation without a stop: everything held back is text.
    pub fn finish(&mut self) -> Vec<u8> {
        std::mem::take(&mut self.pending)
    }
}

/// The first start of `needle` in `hay` whose match ends after byte
/// `seen` (the bytes before were looked at already).
fn find_ending_after(hay: &[u8], needle: &[u8], seen: usize) -> Option<usize> {
    if needle.len() > hay.len() {
        return None;
    }
    let from = (seen + 1).saturating_sub(needle.len());
    hay[from..]
        .windows(needle.len())
        .position(|w| w == needle)
        .map(|p| p + from)
}

/// Length of the longest suffix of `buf` that is a proper prefix of `stop`.
fn longest_suffix_prefix(buf: &[u8], stop: &[u8]) -> usize {
    let max = (stop.len() - 1).min(buf.len());
    (1..=max)
        .rev()
        .find(|&k| buf[buf.len() - k..] == stop[..k])
        .unwrap_or(0)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn suffix_basics() {
        assert_eq!(match_stop_suffix(b"the cat sat", &[b"sat"]), Some(8));
        assert_eq!(match_stop_suffix(b"the cat sat", &[b"cat"]), None);
        assert_eq!(match_stop_suffix(b"ab", &[b"abc"]), None);
    }

    #[test]
    fn suffix_longest_match_wins() {
        // Both match at the end; the earlier start (longer string) decides.
        assert_eq!(
            match_stop_suffix(b"on the mat", &[b"mat", b"the mat"]),
            Some(3)
        );
        assert_eq!(
            match_stop_suffix(b"on the mat", &[b"the mat", b"mat"]),
            Some(3)
        );
    }

    #[test]
    fn suffix_empty_stop_ignored() {
        assert_eq!(match_stop_suffix(b"abc", &[b""]), None);
        assert_eq!(match_stop_suffix(b"abc", &[b"", b"c"]), Some(2));
    }

    #[test]
    fn suffix_cjk_split_across_tokens() {
        // 中 = E4 B8 AD arrives as two tokens; it matches only on the last byte.
        let stop: &[u8] = "中".as_bytes();
        let mut full = b"xy".to_vec();
        full.extend_from_slice(&[0xE4, 0xB8]);
        assert_eq!(match_stop_suffix(&full, &[stop]), None);
        full.push(0xAD);
        assert_eq!(match_stop_suffix(&full, &[stop]), Some(2));
    }

    fn run(stops: &[&str], tokens: &[&[u8]]) -> (Vec<u8>, bool) {
        run_after(0, stops, tokens)
    }

    fn run_after(min_tokens: u32, stops: &[&str], tokens: &[&[u8]]) -> (Vec<u8>, bool) {
        let mut f = StopFilter::new(stops.iter().map(|s| s.as_bytes())).after(min_tokens);
        let mut out = Vec::new();
        for t in tokens {
            let step = f.push(t);
            out.extend(step.emit);
            if step.stopped {
                return (out, true);
            }
        }
        out.extend(f.finish());
        (out, false)
    }

    #[test]
    fn filter_never_streams_part_of_a_stop() {
        let mut f = StopFilter::new(["world"]);
        assert_eq!(f.push(b"hello wo").emit, b"hello ");
        assert_eq!(f.pending(), b"wo");
        let s = f.push(b"rld!");
        assert!(s.stopped);
        assert_eq!(s.emit, b"");
    }

    #[test]
    fn filter_flushes_when_match_fails() {
        assert_eq!(run(&["world"], &[b"wo", b"rk"]), (b"work".to_vec(), false));
        let mut f = StopFilter::new(["world"]);
        assert_eq!(f.push(b"wo").emit, b"");
        assert_eq!(f.push(b"rk").emit, b"work");
    }

    #[test]
    fn filter_earliest_start_wins() {
        assert_eq!(
            run(&["b c", "a b"], &[b"x a", b" b c"]),
            (b"x ".to_vec(), true)
        );
    }

    #[test]
    fn filter_multibyte_stop_split_across_tokens() {
        let (out, stopped) = run(
            &["中文"],
            &[b"ok ", &[0xE4, 0xB8], &[0xAD, 0xE6, 0x96], &[0x87, b'!']],
        );
        assert!(stopped);
        assert_eq!(out, b"ok ");
    }

    #[test]
    fn filter_without_stops_passes_everything() {
        assert_eq!(run(&[], &[b"a", b"b"]), (b"ab".to_vec(), false));
        assert_eq!(run(&[""], &[b"a", b"b"]), (b"ab".to_vec(), false));
    }

    /// vLLM's own case (tests/detokenizer/test_min_tokens.py): with
    /// min_tokens = 5 the "e" of the first five tokens does not stop, the
    /// one of the eighth does.
    #[test]
    fn min_tokens_skips_the_first_tokens_as_vllm_does() {
        let toks: &[&[u8]] = &[
            b" is",
            b" Lee",
            b",",
            b" and",
            b" I",
            b"'m",
            b" a",
            b" student",
            b" in",
        ];
        assert_eq!(run_after(0, &["e"], toks), (b" is L".to_vec(), true));
        assert_eq!(
            run_after(5, &["e"], toks),
            (b" is Lee, and I'm a stud".to_vec(), true)
        );
    }

    /// A stop string may begin in the unchecked tokens and end after them
    /// (vLLM looks back a stop string's length before the new text), but
    /// one that ends inside them never stops — nor later.
    #[test]
    fn min_tokens_boundary_straddle_and_inside() {
        assert_eq!(run_after(1, &["ab"], &[b"a", b"b"]), (Vec::new(), true));
        assert_eq!(
            run_after(1, &["ab"], &[b"ab", b"c"]),
            (b"abc".to_vec(), false)
        );
        // "ab" ends inside token 1 and is held (it begins "abc"): token 2
        // must not stop on it, but "abc" completed by token 2 does.
        assert_eq!(
            run_after(1, &["ab", "abc"], &[b"ab", b"x"]),
            (b"abx".to_vec(), false)
        );
        assert_eq!(
            run_after(1, &["ab", "abc"], &[b"ab", b"c"]),
            (Vec::new(), true)
        );
        // An empty token after the boundary does not revive the old match.
        assert_eq!(
            run_after(1, &["ab", "abc"], &[b"ab", b"", b"x"]),
            (b"abx".to_vec(), false)
        );
    }
}
