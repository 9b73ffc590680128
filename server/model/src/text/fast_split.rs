//! The pieces the GPT-2 and SmolLM pre-tokenizers make, found without
//! `fancy-regex`'s backtracking VM and without `tokenizers`'
//! `NormalizedString` bookkeeping, then byte-level mapped: what
//! [`super::tokenizer`] hands to BPE when a text holds no added token.
//!
//! Why: for 4 KB of prose and code (1,298 tokens) `tokenizers`'
//! pre-tokenization took 635 µs of the whole encode's 817 µs — an
//! alignment entry per byte copied at every split, a `String` per piece,
//! and GPT-2's `\s+(?!\S)` run by the backtracking VM — so `Tokenize` could
//! not answer within 1 ms however fast BPE (with its word cache) was.
//!
//! The lookahead is the only part of GPT-2's pattern a DFA cannot run:
//! `\s+(?!\S)|\s+` matches a whitespace run, less its last character when
//! a non-space follows and the run is longer than one character (the last
//! space then starts the next piece, " word"). So the pattern here ends
//! with a plain `\s+` and that rule is applied to its matches; every other
//! alternative of the pattern can never match whitespace alone, so a
//! whitespace-only match is always that branch's. Leftmost-first
//! alternation (the `regex` crate's, as PCRE's and `fancy-regex`'s) picks
//! the same branch at every position. The SmolLM family first isolates
//! every `\p{N}` character; the GPT-2 pattern then runs on each piece in
//! between on its own (its lookahead sees the piece's end, as
//! `tokenizers`' `Split` does). Equality with `tokenizers`' pipeline is a
//! property test (`tests` below) and llama.cpp's ids are the parity
//! tests'.

#![forbid(unsafe_code)]

use regex::Regex;

use super::pre_tokenizer::PreTokenizer;
use super::vocab::bytes_to_unicode;

/// GPT-2's pattern with `\s+(?!\S)|\s+` as `\s+` (see the module docs).
const GPT2_NO_LOOKAHEAD: &str = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+";

/// The splitter of one family.
#[derive(Debug)]
pub struct FastSplit {
    gpt2: Regex,
    /// SmolLM: every `\p{N}` character is a piece of its own first.
    digits: Option<Regex>,
    /// GPT-2's byte-to-character map.
    bytes: [char; 256],
}

impl FastSplit {
    /// The splitter of `family`, for the families it covers (GPT-2's
    /// pattern alone, or after SmolLM's digit split).
    pub fn for_family(family: PreTokenizer) -> Option<Self> {
        let digits = match family {
            PreTokenizer::Gpt2 => None,
            PreTokenizer::Smollm => Some(Regex::new(r"\p{N}").ok()?),
            _ => return None,
        };
        Some(FastSplit {
            gpt2: Regex::new(GPT2_NO_LOOKAHEAD).ok()?,
            digits,
            bytes: bytes_to_unicode(),
        })
    }

    /// Calls `each` with every piece of `text`, byte-level mapped, in
    /// order.
    pub fn for_each<E>(
        &self,
        text: &str,
        mut each: impl FnMut(&str) -> Result<(), E>,
    ) -> Result<(), E> {
        let mut mapped = String::with_capacity(64);
        let mut piece = |p: &str| {
            mapped.clear();
            mapped.extend(p.bytes().map(|b| self.bytes[b as usize]));
            each(&mapped)
        };
        let Some(digits) = &self.digits else {
            return self.gpt2_pieces(text, &mut piece);
        };
        let mut at = 0;
        for d in digits.find_iter(text) {
            if d.start() > at {
                self.gpt2_pieces(&text[at..d.start()], &mut piece)?;
            }
            piece(d.as_str())?;
            at = d.end();
        }
        if at < text.len() {
            self.gpt2_pieces(&text[at..], &mut piece)?;
        }
        Ok(())
    }

    /// GPT-2's pieces of `s` (a whole text, or the piece between two
    /// digits).
    fn gpt2_pieces<E>(
        &self,
        s: &str,
        piece: &mut impl FnMut(&str) -> Result<(), E>,
    ) -> Result<(), E> {
        let mut at = 0;
        while at < s.len() {
            let Some(m) = self.gpt2.find_at(s, at) else {
                // Unreachable (`\s+` and the class of everything else
                // cover every character), kept as `tokenizers` would: the
                // rest is one piece.
                return piece(&s[at..]);
            };
            if m.start() > at {
                piece(&s[at..m.start()])?;
            }
            let mut end = m.end();
            let run = m.as_str();
            if run.chars().all(char::is_whitespace) && end < s.len() {
                let next = s[end..].chars().next().unwrap_or(' ');
                let last = run.char_indices().next_back().map_or(0, |(i, _)| i);
                if !next.is_whitespace() && last > 0 {
                    end = m.start() + last;
                }
            }
            piece(&s[m.start()..end])?;
            at = end;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;
    use tokenizers::{OffsetReferential, OffsetType, PreTokenizedString, PreTokenizer as _};

    fn reference(family: PreTokenizer, text: &str) -> Vec<String> {
        let mut s = PreTokenizedString::from(text);
        family.build().unwrap().pre_tokenize(&mut s).unwrap();
        s.get_splits(OffsetReferential::Original, OffsetType::Byte)
            .into_iter()
            .map(|(piece, _, _)| piece.to_string())
            .collect()
    }

    fn fast(family: PreTokenizer, text: &str) -> Vec<String> {
        let mut out = Vec::new();
        FastSplit::for_family(family)
            .unwrap()
            .for_each(text, |p| {
                out.push(p.to_string());
                Ok::<_, ()>(())
            })
            .unwrap();
        out
    }

    #[test]
    fn whitespace_runs_split_as_the_lookahead_splits_them() {
        for family in [PreTokenizer::Gpt2, PreTokenizer::Smollm] {
            for text in [
                "a  b",
                "a   b",
                "a\n\nb",
                "a \n b",
                "a\tb",
                "a \t",
                "  ",
                " ",
                "x\u{3000}\u{3000}y",
                "end  ",
                "1  2",
                "don't  I'LL 've",
                "fn main() {\n    println!(\"hi\");\n}\n",
                "Naïve café — 12.5% at 3:45 p.m.",
                "½ ² ٣ x²",
            ] {
                assert_eq!(
                    fast(family, text),
                    reference(family, text),
                    "{family:?} {text:?}"
                );
            }
        }
    }

    fn text() -> impl Strategy<Value = String> {
        let pieces = prop::sample::select(vec![
            " ", "  ", "\n", "\t", "\r\n", "a", "Z", "é", "ß", "日本", "1", "42", "½", "'s", "'ll",
            "'", "!", "?!", ".", "—", "😀", "\u{3000}", "\u{a0}", "x", "don", "t",
        ]);
        prop::collection::vec(pieces, 0..40).prop_map(|v| v.concat())
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(2000))]
        /// The pieces equal `tokenizers`' pre-tokenizer's, byte for byte.
        #[test]
        fn pieces_equal_the_tokenizers_pre_tokenizer(t in text(), smollm in any::<bool>()) {
            let family = if smollm { PreTokenizer::Smollm } else { PreTokenizer::Gpt2 };
            prop_assert_eq!(fast(family, &t), reference(family, &t));
        }
    }
}
