//! `token_controls`: the token-level controls of a generation as one
//! masking stage with per-sequence state, so that every step that samples
//! the sequence — a decode step, a resumed run's next step, each position
//! of a speculative verification — masks exactly the same tokens.
//!
//! - `min_tokens` with `end_tokens`: while fewer than `min_tokens` tokens
//!   were accepted, every id of `end_tokens` (the model's end-of-generation
//!   tokens and a request's stop token ids) gets -inf (vLLM's
//!   `MinTokensLogitsProcessor`, vllm/v1/sample/logits_processor/builtin.py).
//! - `bad_words`: token sequences; the last token of a sequence gets -inf
//!   when the tokens accepted last equal the ones before it (vLLM's
//!   `_apply_bad_words_single_batch`, vllm/v1/sample/ops/bad_words.py; a
//!   one-token sequence is always banned).
//!
//! Output-only (`SD_STAGE_OUTPUT_ONLY`): like vLLM, it counts and matches
//! the generated tokens, never the prompt. A token it masks cannot be
//! accepted (`try_accept` refuses it), so a replay — a resumed run's
//! tokens — that could not have been sampled is an error, not a new state.
//!
//! Ids are given as decimal strings (`end_tokens = ["2"]`, a bad word
//! `"523 9102"`); ids outside the vocabulary are skipped when masking.

#![forbid(unsafe_code)]

use std::collections::VecDeque;
use std::ffi::CStr;

use samplerd_plugin_sdk::prelude::*;

use crate::util;

const S: &str = "token_controls";
/// Most `end_tokens`: a vocabulary's end-of-generation tokens plus a
/// request's stop ids are a handful; this bounds a hand-written chain.
pub const MAX_END_TOKENS: usize = 4096;
/// Most `bad_words` sequences (the host's own limit is lower).
pub const MAX_BAD_WORDS: usize = 1024;
/// Most tokens in one `bad_words` sequence.
pub const MAX_BAD_WORD_TOKENS: usize = 256;

pub struct TokenControls {
    min_tokens: u64,
    end_tokens: Vec<u32>,
    bad_words: Vec<Vec<u32>>,
    /// The longest bad word's prefix: how many accepted tokens to keep.
    keep: usize,
}

/// One sequence's view of its output.
#[derive(Clone, Default)]
pub struct Output {
    /// Tokens accepted so far.
    generated: u64,
    /// The last `keep` accepted tokens, oldest first.
    recent: VecDeque<u32>,
    /// The ids masked at this step (reused).
    banned: Vec<u32>,
}

/// Parses a decimal token id; the error quotes at most 24 characters of
/// what it got (a parameter can be as long as a request).
fn id(param: &str, s: &str) -> Result<u32, String> {
    s.trim().parse::<u32>().map_err(|_| {
        let shown: String = s.chars().take(24).collect();
        format!("{S}: {param} holds {shown:?}, which is not a token id (a decimal u32)")
    })
}

impl TokenControls {
    /// Whether the accepted tokens end with `prefix`.
    fn ends_with(recent: &VecDeque<u32>, prefix: &[u32]) -> bool {
        prefix.len() <= recent.len()
            && recent
                .iter()
                .skip(recent.len() - prefix.len())
                .eq(prefix.iter())
    }

    /// The ids masked after the tokens `st` has seen (into `st.banned`).
    fn banned(&self, st: &mut Output) {
        st.banned.clear();
        if st.generated < self.min_tokens {
            st.banned.extend_from_slice(&self.end_tokens);
        }
        for word in &self.bad_words {
            let (last, prefix) = word.split_last().expect("non-empty, checked in new");
            if Self::ends_with(&st.recent, prefix) {
                st.banned.push(*last);
            }
        }
    }
}

impl Stage for TokenControls {
    const NAME: &'static CStr = c"token_controls";
    const DESCRIPTION: &'static CStr = c"masks end tokens until min_tokens were generated and the last token of each bad-word sequence after its prefix (vLLM min_tokens / bad_words)";
    const PARAMS: &'static [SdParamSpec] = &[
        number_param(
            c"min_tokens",
            c"end_tokens are masked until this many tokens were accepted; 0 = off",
            0.0,
        ),
        param_spec(
            SD_PARAM_STRING_LIST,
            c"end_tokens",
            c"token ids (decimal strings) masked while fewer than min_tokens were accepted",
            0.0,
        ),
        param_spec(
            SD_PARAM_STRING_LIST,
            c"bad_words",
            c"token sequences (space-separated decimal ids): the last is masked after the others",
            0.0,
        ),
    ];
    const FLAGS: u32 = SD_STAGE_DENSE_OK | SD_STAGE_OUTPUT_ONLY;
    type State = Output;

    fn new(params: &Params<'_>, _vocab: Option<&Vocab<'_>>) -> Result<Self, String> {
        let min_tokens = util::integer(params, S, "min_tokens", 0, u32::MAX as i64)? as u64;
        let end = params.strings("end_tokens").unwrap_or_default();
        if end.len() > MAX_END_TOKENS {
            return Err(format!(
                "{S}: end_tokens must be at most {MAX_END_TOKENS} ids, got {}",
                end.len()
            ));
        }
        let mut end_tokens = end
            .iter()
            .map(|s| id("end_tokens", s))
            .collect::<Result<Vec<_>, _>>()?;
        end_tokens.sort_unstable();
        end_tokens.dedup();
        let words = params.strings("bad_words").unwrap_or_default();
        if words.len() > MAX_BAD_WORDS {
            return Err(format!(
                "{S}: bad_words must be at most {MAX_BAD_WORDS} sequences, got {}",
                words.len()
            ));
        }
        let mut bad_words = Vec::with_capacity(words.len());
        for (i, w) in words.iter().enumerate() {
            let seq = w
                .split_ascii_whitespace()
                .take(MAX_BAD_WORD_TOKENS + 1)
                .map(|s| id("bad_words", s))
                .collect::<Result<Vec<_>, _>>()?;
            if seq.is_empty() {
                return Err(format!("{S}: bad_words[{i}] holds no token id"));
            }
            if seq.len() > MAX_BAD_WORD_TOKENS {
                return Err(format!(
                    "{S}: bad_words[{i}] must be at most {MAX_BAD_WORD_TOKENS} ids"
                ));
            }
            bad_words.push(seq);
        }
        let keep = bad_words.iter().map(|w| w.len() - 1).max().unwrap_or(0);
        Ok(TokenControls {
            min_tokens,
            end_tokens,
            bad_words,
            keep,
        })
    }

    fn new_state(&self) -> Output {
        Output {
            recent: VecDeque::with_capacity(self.keep),
            ..Default::default()
        }
    }

    fn try_accept(&self, st: &mut Output, token: u32) -> Result<(), String> {
        self.banned(st);
        if st.banned.contains(&token) {
            return Err(format!(
                "{S}: token {token} is masked after {} generated tokens (an end token before \
                 min_tokens, or a bad word's last token)",
                st.generated
            ));
        }
        st.generated += 1;
        if self.keep > 0 {
            if st.recent.len() == self.keep {
                st.recent.pop_front();
            }
            st.recent.push_back(token);
        }
        Ok(())
    }

    fn apply(
        &self,
        st: &mut Output,
        tokens: &mut Tokens<'_>,
        _rng: &mut HostRng<'_>,
    ) -> Result<(), String> {
        self.banned(st);
        if st.banned.is_empty() {
            return Ok(());
        }
        match tokens.view() {
            ViewKind::Dense => {
                let dense = tokens.dense_mut();
                for &id in &st.banned {
                    // ids outside the vocabulary are skipped, never a panic
                    if let Some(l) = dense.get_mut(id as usize) {
                        *l = f32::NEG_INFINITY;
                    }
                }
            }
            ViewKind::Candidates => {
                let mut touched = false;
                for c in tokens.candidates_mut() {
                    if st.banned.contains(&c.id) && c.logit != f32::NEG_INFINITY {
                        c.logit = f32::NEG_INFINITY;
                        touched = true;
                    }
                }
                if touched {
                    tokens.set_sorted(false);
                }
            }
        }
        Ok(())
    }
}
