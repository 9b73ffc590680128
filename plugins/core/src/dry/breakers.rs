//! DRY's sequence breakers turned into token sequences, as llama.cpp's
//! `llama_sampler_init_dry` does with `get_overlapping_token_sequences`
//! (`src/llama-sampling.cpp`): for every token of the vocabulary,
//!
//! - a token whose text contains a breaker is a *single-token breaker*
//!   (the head of a restart sequence with an empty tail);
//! - a token whose text ends with a proper prefix of a breaker is the head
//!   of a restart sequence whose tail is the tokenization of the rest of
//!   the breaker, at most [`MAX_TAIL_TOKENS`] tokens.
//!
//! Breakers are cut to [`MAX_BREAKER_BYTES`] bytes first and empty ones
//! are skipped (llama.cpp warns and does the same).
//!
//! The one difference: llama.cpp tokenizes a tail with the model's
//! tokenizer; a plugin sees only the vocabulary's bytes, so a tail is
//! tokenized by greedy longest match over the text tokens. For a tail that
//! is one token (the usual case, and the only one for one-byte breakers,
//! whose tokens either contain the breaker or not) the two agree; a longer
//! tail may be split differently from what a BPE merge order would give.

#![forbid(unsafe_code)]

use std::collections::HashMap;
use std::hash::BuildHasherDefault;

use samplerd_plugin_sdk::abi::{SD_TOKEN_BYTE, SD_TOKEN_UNUSED};
use samplerd_plugin_sdk::prelude::*;

use crate::penalties::IdHasher;

/// llama.cpp's `MAX_CHAR_LEN`: a breaker is cut to this many bytes.
pub const MAX_BREAKER_BYTES: usize = 40;
/// llama.cpp's `MAX_SEQ_LEN`: a restart sequence's tail keeps at most this
/// many tokens (bounds the restart scan to O(window)).
pub const MAX_TAIL_TOKENS: usize = 20;

/// What breaker processing reads of a vocabulary: each token's text (for
/// control tokens their text, as llama.cpp's `detokenize(…, special =
/// true)` gives it) and its `SD_TOKEN_*` bits.
pub trait TokenText {
    fn n_vocab(&self) -> usize;
    fn bytes(&self, id: u32) -> &[u8];
    fn attr(&self, id: u32) -> u32;
}

impl TokenText for Vocab<'_> {
    fn n_vocab(&self) -> usize {
        Vocab::n_vocab(self)
    }
    fn bytes(&self, id: u32) -> &[u8] {
        self.token_bytes(id)
    }
    fn attr(&self, id: u32) -> u32 {
        self.token_attr(id)
    }
}

type TailMap = HashMap<u32, Vec<Vec<u32>>, BuildHasherDefault<IdHasher>>;

/// The processed breakers: llama.cpp's `dry_processed_breakers` multimap
/// (head token → tails), split into a bitset of the heads with an empty
/// tail (often thousands of tokens: every token holding a `\n`) and a map
/// of the non-empty tails.
#[derive(Clone, Default, Debug)]
pub struct Breakers {
    single: Vec<u64>,
    tails: TailMap,
}

impl Breakers {
    /// Whether `id` is a single-token breaker.
    #[inline]
    pub fn is_single(&self, id: u32) -> bool {
        self.single
            .get(id as usize / 64)
            .is_some_and(|w| w >> (id % 64) & 1 != 0)
    }

    /// The non-empty tails of the restart sequences headed by `id`.
    #[inline]
    pub fn tails(&self, id: u32) -> &[Vec<u32>] {
        self.tails.get(&id).map_or(&[], Vec::as_slice)
    }

    pub fn is_empty(&self) -> bool {
        self.tails.is_empty() && self.single.iter().all(|&w| w == 0)
    }

    fn set_single(&mut self, id: u32) {
        let w = id as usize / 64;
        if self.single.len() <= w {
            self.single.resize(w + 1, 0);
        }
        self.single[w] |= 1 << (id % 64);
    }

    fn add_tail(&mut self, id: u32, tail: Vec<u32>) {
        let tails = self.tails.entry(id).or_default();
        // llama.cpp: "ensure we don't already have a duplicate matching
        // tokenization"
        if !tails.contains(&tail) {
            tails.push(tail);
        }
    }

    /// Restart sequences given as token ids (head first), as llama.cpp's
    /// `llama_sampler_init_dry_testing` takes them; empty ones are skipped.
    pub fn from_token_sequences(seqs: &[Vec<u32>]) -> Self {
        let mut b = Breakers::default();
        for s in seqs {
            match s.split_first() {
                None => {}
                Some((&head, [])) => b.set_single(head),
                Some((&head, tail)) => b.add_tail(head, tail.to_vec()),
            }
        }
        b
    }

    /// llama.cpp's breaker processing over `vocab` (see the module docs).
    pub fn from_strings(vocab: &dyn TokenText, breakers: &[&str]) -> Self {
        let breakers: Vec<&[u8]> = breakers
            .iter()
            .map(|s| &s.as_bytes()[..s.len().min(MAX_BREAKER_BYTES)])
            .filter(|s| !s.is_empty())
            .collect();
        let mut out = Breakers::default();
        if breakers.is_empty() {
            return out;
        }
        let tokenizer = TailTokenizer::new(vocab, &breakers);
        // Per breaker, the tokenization of each suffix str[i..] (i >= 1),
        // computed on first use: None = not yet, Some(None) = no tokens.
        let mut memo: Vec<Vec<Option<Option<Vec<u32>>>>> =
            breakers.iter().map(|s| vec![None; s.len()]).collect();
        // One-byte breakers (all of the defaults) only ever make
        // single-token breakers: one pass over each token's bytes against a
        // byte set finds them all, whatever their number.
        let mut one_byte = [false; 256];
        for s in breakers.iter().filter(|s| s.len() == 1) {
            one_byte[s[0] as usize] = true;
        }
        let longer: Vec<(usize, &[u8])> = breakers
            .iter()
            .enumerate()
            .filter(|(_, s)| s.len() > 1)
            .map(|(b, s)| (b, *s))
            .collect();
        for id in 0..vocab.n_vocab() as u32 {
            let word = vocab.bytes(id);
            if word.is_empty() {
                continue;
            }
            if word.iter().any(|&c| one_byte[c as usize]) {
                out.set_single(id);
            }
            for &(b, s) in &longer {
                if contains(word, s) {
                    out.set_single(id);
                    continue;
                }
                // Each position where `word` ends with a proper prefix of
                // `s` (llama.cpp's loop over `word.find(str[0], pos + 1)`).
                for pos in memchr_all(word, s[0]) {
                    let rest = &word[pos..];
                    if rest.len() >= s.len() || !s.starts_with(rest) {
                        continue;
                    }
                    let cut = rest.len();
                    let tail = memo[b][cut]
                        .get_or_insert_with(|| tokenizer.tokenize(&s[cut..]))
                        .clone();
                    // A tail no token sequence spells can never be matched:
                    // leaving it out is what matching it would do.
                    if let Some(tail) = tail {
                        out.add_tail(id, tail);
                    }
                }
            }
        }
        out
    }
}

fn contains(hay: &[u8], needle: &[u8]) -> bool {
    hay.windows(needle.len()).any(|w| w == needle)
}

fn memchr_all(hay: &[u8], b: u8) -> impl Iterator<Item = usize> + '_ {
    hay.iter()
        .enumerate()
        .filter(move |&(_, &x)| x == b)
        .map(|(i, _)| i)
}

/// Greedy longest-match tokenizer over the text tokens that occur inside
/// some breaker (the only ones a tail can be made of).
struct TailTokenizer<'v> {
    pieces: HashMap<&'v [u8], u32>,
    longest: usize,
}

impl<'v> TailTokenizer<'v> {
    fn new(vocab: &'v dyn TokenText, breakers: &[&[u8]]) -> Self {
        let mut pieces: HashMap<&'v [u8], u32> = HashMap::new();
        let mut longest = 0;
        if breakers.iter().all(|s| s.len() == 1) {
            return TailTokenizer { pieces, longest };
        }
        // A tokenizer that does not parse special tokens never emits a
        // control or unused token; a byte token only when no text token
        // spells the byte (byte fallback).
        let skip = SD_TOKEN_CONTROL | SD_TOKEN_UNUSED;
        for id in 0..vocab.n_vocab() as u32 {
            let attr = vocab.attr(id);
            let w = vocab.bytes(id);
            if attr & skip != 0 || w.is_empty() || w.len() > MAX_BREAKER_BYTES {
                continue;
            }
            if !breakers.iter().any(|s| s.len() > 1 && contains(s, w)) {
                continue;
            }
            let replace = match pieces.get(w) {
                None => true,
                // prefer a text token over a byte token, then the lower id
                Some(&old) => vocab.attr(old) & SD_TOKEN_BYTE != 0 && attr & SD_TOKEN_BYTE == 0,
            };
            if replace {
                pieces.insert(w, id);
                longest = longest.max(w.len());
            }
        }
        TailTokenizer { pieces, longest }
    }

    /// The tokens of `text` (at most [`MAX_TAIL_TOKENS`]), or None when
    /// some byte has no token.
    fn tokenize(&self, text: &[u8]) -> Option<Vec<u32>> {
        let mut out = Vec::new();
        let mut rest = text;
        while !rest.is_empty() && out.len() < MAX_TAIL_TOKENS {
            let (len, id) = (1..=self.longest.min(rest.len()))
                .rev()
                .find_map(|l| self.pieces.get(&rest[..l]).map(|&id| (l, id)))?;
            out.push(id);
            rest = &rest[len..];
        }
        Some(out)
    }
}
