//! SentencePiece-style tokenization, as llama.cpp runs it.
//!
//! SentencePiece-style tokenization, as llama.cpp runs it for
//! `tokenizer.ggml.model = "llama"` (Llama 1 and 2, Mistral v0.1–v0.3,
//! and other vocabularies converted from a SentencePiece model).
//!
//! Three steps, each llama.cpp's own (`src/llama-vocab.cpp`):
//! 1. **Special tokens first** (`tokenizer_st_partition`): for each
//!    special token, longest text first, every occurrence in the remaining
//!    raw text becomes that token. Control and unknown tokens count only
//!    when special parsing is on; user-defined tokens always.
//! 2. **Each raw fragment** gets a leading space when it starts the text or
//!    follows a special token (`tokenizer.ggml.add_space_prefix`, default
//!    true), and every space becomes `▁` (`llama_escape_whitespace`).
//! 3. **Score-ordered merges** (`llm_tokenizer_spm_session::tokenize`): the
//!    fragment starts as one symbol per character; the adjacent pair whose
//!    concatenation is a token with the highest `tokenizer.ggml.scores`
//!    entry (ties: the leftmost) merges, until no pair is a token. A
//!    remaining symbol that is no token is written as its bytes' `<0xXX>`
//!    tokens (byte fallback).
//!
//! Not mirrored: the lstrip/rstrip attributes llama.cpp gives the special
//! tokens of a few model families by name (Phi-3, Jina, ModernBERT), none of
//! whose architectures the model host runs.

#![forbid(unsafe_code)]

use std::collections::{BinaryHeap, HashMap};

/// A special token for the partition.
#[derive(Debug, Clone)]
pub(crate) struct Special {
    pub id: u32,
    pub text: String,
    /// Control and unknown tokens: matched only with special parsing on.
    pub only_when_parsing_special: bool,
}

/// A piece of the input after the special-token partition.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Fragment<'a> {
    Text(&'a str),
    Token(u32),
}

/// The SentencePiece encoder of one vocabulary.
#[derive(Debug)]
pub(crate) struct SpmEncoder {
    /// Token text → id; a text held twice maps to its last id, as
    /// llama.cpp's `token_to_id` (filled in id order) does.
    ids: HashMap<String, u32>,
    scores: Vec<f32>,
    /// In llama.cpp's partition order: longest text first (stable).
    specials: Vec<Special>,
    /// `<0xXX>` (or, failing that, the byte itself) per byte value.
    byte_ids: [Option<u32>; 256],
    add_space_prefix: bool,
}

impl SpmEncoder {
    pub fn new(
        texts: &[String],
        scores: Vec<f32>,
        mut specials: Vec<Special>,
        add_space_prefix: bool,
    ) -> Self {
        let mut ids = HashMap::with_capacity(texts.len());
        for (i, t) in texts.iter().enumerate() {
            ids.insert(t.clone(), i as u32);
        }
        specials.retain(|s| !s.text.is_empty());
        specials.sort_by_key(|s| std::cmp::Reverse(s.text.len()));
        let byte_ids = std::array::from_fn(|b| {
            ids.get(&format!("<0x{b:02X}>"))
                .or_else(|| {
                    // llama.cpp's `byte_to_token` falls back to the byte as
                    // a one-character token (only ASCII can be one here).
                    (b < 0x80).then(|| ids.get(&char::from(b as u8).to_string()))?
                })
                .copied()
        });
        Self {
            ids,
            scores,
            specials,
            byte_ids,
            add_space_prefix,
        }
    }

    /// The special-token texts that special parsing would turn into tokens
    /// (and plain-text tokenization would not).
    pub fn parsed_special_texts(&self) -> impl Iterator<Item = &str> {
        self.specials
            .iter()
            .filter(|s| s.only_when_parsing_special)
            .map(|s| s.text.as_str())
    }

    /// Splits `text` around its special tokens (step 1 of the module docs).
    pub fn partition<'a>(&self, text: &'a str, parse_special: bool) -> Vec<Fragment<'a>> {
        if text.is_empty() {
            return Vec::new();
        }
        let mut frags = vec![Fragment::Text(text)];
        for special in &self.specials {
            if special.only_when_parsing_special && !parse_special {
                continue;
            }
            let mut next = Vec::with_capacity(frags.len());
            for frag in frags {
                let Fragment::Text(raw) = frag else {
                    next.push(frag);
                    continue;
                };
                let mut rest = raw;
                while let Some(at) = rest.find(&special.text) {
                    if at > 0 {
                        next.push(Fragment::Text(&rest[..at]));
                    }
                    next.push(Fragment::Token(special.id));
                    rest = &rest[at + special.text.len()..];
                }
                if !rest.is_empty() {
                    next.push(Fragment::Text(rest));
                }
            }
            frags = next;
        }
        frags
    }

    /// Token ids of partitioned fragments (steps 2 and 3). Adjacent text
    /// fragments are one text, as if they had been partitioned together.
    pub fn encode_fragments<'a>(
        &self,
        frags: impl IntoIterator<Item = Fragment<'a>>,
        out: &mut Vec<u32>,
    ) -> Result<(), String> {
        let mut prev_special = true;
        let mut pending = String::new();
        for frag in frags {
            match frag {
                Fragment::Text(t) => pending.push_str(t),
                Fragment::Token(id) => {
                    if !pending.is_empty() {
                        self.encode_text(&pending, prev_special, out)?;
                        pending.clear();
                    }
                    out.push(id);
                    prev_special = true;
                }
            }
        }
        if !pending.is_empty() {
            self.encode_text(&pending, prev_special, out)?;
        }
        Ok(())
    }

    fn encode_text(&self, raw: &str, prev_special: bool, out: &mut Vec<u32>) -> Result<(), String> {
        let mut text = String::with_capacity(raw.len() + 3);
        if self.add_space_prefix && prev_special {
            text.push('\u{2581}');
        }
        text.extend(raw.chars().map(|c| if c == ' ' { '\u{2581}' } else { c }));
        self.merge(&text, out)
    }

    /// Step 3 on one escaped fragment.
    fn merge(&self, text: &str, out: &mut Vec<u32>) -> Result<(), String> {
        // One symbol per character, linked to its neighbours; a merge folds
        // the right symbol into the left one (its `len` becomes 0).
        let mut syms: Vec<Symbol> = Vec::with_capacity(text.len());
        for (i, (start, c)) in text.char_indices().enumerate() {
            syms.push(Symbol {
                start,
                len: c.len_utf8(),
                prev: i.checked_sub(1),
                next: (start + c.len_utf8() < text.len()).then_some(i + 1),
            });
        }
        let mut queue = BinaryHeap::new();
        for right in 1..syms.len() {
            self.push_pair(text, &syms, right - 1, right, &mut queue);
        }
        while let Some(pair) = queue.pop() {
            let (l, r) = (syms[pair.left], syms[pair.right]);
            // A stale pair: one side has merged since.
            if l.len == 0 || r.len == 0 || l.len + r.len != pair.len {
                continue;
            }
            syms[pair.left].len += r.len;
            syms[pair.right].len = 0;
            syms[pair.left].next = r.next;
            if let Some(n) = r.next {
                syms[n].prev = Some(pair.left);
            }
            if let Some(p) = l.prev {
                self.push_pair(text, &syms, p, pair.left, &mut queue);
            }
            if let Some(n) = r.next {
                self.push_pair(text, &syms, pair.left, n, &mut queue);
            }
        }
        let mut at = (!syms.is_empty()).then_some(0);
        while let Some(i) = at {
            let s = syms[i];
            let piece = &text[s.start..s.start + s.len];
            match self.ids.get(piece) {
                Some(&id) => out.push(id),
                None => {
                    for &b in piece.as_bytes() {
                        out.push(self.byte_ids[b as usize].ok_or_else(|| {
                            format!(
                                "byte 0x{b:02X} of {piece:?} has no token (the vocabulary has \
                                 neither <0x{b:02X}> nor the byte itself)"
                            )
                        })?);
                    }
                }
            }
            at = s.next;
        }
        Ok(())
    }

    fn push_pair(
        &self,
        text: &str,
        syms: &[Symbol],
        left: usize,
        right: usize,
        queue: &mut BinaryHeap<Pair>,
    ) {
        let len = syms[left].len + syms[right].len;
        let start = syms[left].start;
        if let Some(&id) = self.ids.get(&text[start..start + len]) {
            queue.push(Pair {
                score: self.scores.get(id as usize).copied().unwrap_or(0.0),
                left,
                right,
                len,
            });
        }
    }
}

#[derive(Debug, Clone, Copy)]
struct Symbol {
    start: usize,
    len: usize,
    prev: Option<usize>,
    next: Option<usize>,
}

/// A candidate merge: the highest score first, then the leftmost
/// (`llm_bigram_spm::comparator`).
#[derive(Debug)]
struct Pair {
    score: f32,
    left: usize,
    right: usize,
    len: usize,
}

impl Ord for Pair {
    fn cmp(&self, other: &Self) -> std::cmp::Ordering {
        self.score
            .total_cmp(&other.score)
            .then(other.left.cmp(&self.left))
    }
}
impl PartialOrd for Pair {
    fn partial_cmp(&self, other: &Self) -> Option<std::cmp::Ordering> {
        Some(self.cmp(other))
    }
}
impl PartialEq for Pair {
    fn eq(&self, other: &Self) -> bool {
        self.cmp(other).is_eq()
    }
}
impl Eq for Pair {}

#[cfg(test)]
mod tests {
    use super::*;

    /// A small vocabulary: `<unk> <s> </s>`, the 256 byte tokens, then
    /// pieces with their scores.
    fn encoder(pieces: &[(&str, f32)], specials: &[(&str, bool)]) -> SpmEncoder {
        let mut texts: Vec<String> = ["<unk>", "<s>", "</s>"].map(String::from).to_vec();
        texts.extend((0..256).map(|b| format!("<0x{b:02X}>")));
        let mut scores = vec![0.0; texts.len()];
        for (p, s) in pieces {
            texts.push(p.to_string());
            scores.push(*s);
        }
        let mut sp = vec![
            Special {
                id: 1,
                text: "<s>".into(),
                only_when_parsing_special: true,
            },
            Special {
                id: 2,
                text: "</s>".into(),
                only_when_parsing_special: true,
            },
        ];
        for (t, control) in specials {
            texts.push(t.to_string());
            scores.push(0.0);
            sp.push(Special {
                id: texts.len() as u32 - 1,
                text: t.to_string(),
                only_when_parsing_special: *control,
            });
        }
        SpmEncoder::new(&texts, scores, sp, true)
    }

    fn encode(e: &SpmEncoder, text: &str, parse_special: bool) -> Vec<u32> {
        let mut out = Vec::new();
        e.encode_fragments(e.partition(text, parse_special), &mut out)
            .unwrap();
        out
    }

    const BASE: u32 = 259;

    #[test]
    fn the_best_scoring_pair_merges_first_and_ties_go_left() {
        // "▁ab": ▁a (score -1) beats ab (-2), then ▁ab (-3) is a token.
        let pieces = [
            ("▁", -9.0),
            ("a", -9.0),
            ("b", -9.0),
            ("▁a", -1.0),
            ("ab", -2.0),
            ("▁ab", -3.0),
        ];
        assert_eq!(encode(&encoder(&pieces, &[]), "ab", false), vec![BASE + 5]);
        // Without ▁ab: ▁a then b.
        let e = encoder(&pieces[..5], &[]);
        assert_eq!(encode(&e, "ab", false), vec![BASE + 3, BASE + 2]);
        // A tie: "aaa" merges the left pair first.
        let e = encoder(&[("▁", -9.0), ("a", -9.0), ("aa", -1.0)], &[]);
        assert_eq!(encode(&e, "aaa", false), vec![BASE, BASE + 2, BASE + 1]);
    }

    #[test]
    fn unknown_characters_fall_back_to_byte_tokens() {
        let e = encoder(&[("▁", -1.0), ("a", -1.0)], &[]);
        // é is 0xC3 0xA9; the byte tokens are ids 3 + byte.
        assert_eq!(
            encode(&e, "aé", false),
            vec![BASE, BASE + 1, 3 + 0xC3, 3 + 0xA9]
        );
    }

    #[test]
    fn specials_split_first_and_the_next_text_gets_a_space_prefix() {
        let e = encoder(
            &[("▁", -1.0), ("a", -1.0), ("▁a", 0.0)],
            &[("[INST]", true), ("<u>", false)],
        );
        let inst = BASE + 3;
        let user = BASE + 4;
        assert_eq!(encode(&e, "[INST]a", true), vec![inst, BASE + 2]);
        // Control tokens are text without special parsing ("[" etc. are bytes).
        let plain = encode(&e, "[INST]a", false);
        assert!(!plain.contains(&inst) && plain.len() > 3, "{plain:?}");
        // User-defined tokens split either way.
        assert_eq!(encode(&e, "<u>a", false), vec![user, BASE + 2]);
        // Text fragments given apart but adjacent are one text.
        let mut out = Vec::new();
        e.encode_fragments([Fragment::Text("a"), Fragment::Text("a")], &mut out)
            .unwrap();
        assert_eq!(out, encode(&e, "aa", false));
    }

    #[test]
    fn a_byte_without_any_token_is_an_error_naming_it() {
        let texts: Vec<String> = ["<unk>", "▁"].map(String::from).to_vec();
        let e = SpmEncoder::new(&texts, vec![0.0; 2], Vec::new(), true);
        let mut out = Vec::new();
        let err = e
            .encode_fragments(e.partition("é", false), &mut out)
            .unwrap_err();
        assert!(err.contains("0xC3"), "{err}");
    }
}
