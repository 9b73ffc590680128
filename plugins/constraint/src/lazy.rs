//! Lazy constraints: the output is free text until a trigger appears, then
//! the grammar holds from right after the trigger.
//!
//! llama.cpp's `grammar_lazy` with `grammar_triggers` (common/sampling.cpp,
//! `common_sampler_init`, which turns each trigger word into the pattern
//! `[\s\S]*?(<word>)[\s\S]*` and passes it with the trigger tokens to
//! `llama_sampler_init_grammar_lazy_patterns`, src/llama-sampling.cpp).
//! Its grammar waits in `llama_grammar_accept_impl` (src/llama-grammar.cpp):
//! each accepted token's text is appended to a buffer; a trigger token, or
//! the buffer matching a pattern, ends the wait, and the text from the
//! trigger's start (the first capturing group: the word itself) to the end
//! of the buffer — the rest of that token included — is fed to the grammar.
//!
//! samplerd differs in one respect, the trigger itself: the grammar starts
//! at the trigger's *end*. Its grammars are JSON Schemas and the like that
//! describe what follows a marker (`</think>`, "```json"), not the marker,
//! so feeding them the trigger would fail every time; llama.cpp's grammars
//! for lazy use (its tool-call grammars) spell the trigger out instead. The
//! rest of the token that completes a trigger string (the `{` of a token
//! `json\n{`) is fed to the grammar as llama.cpp feeds it, so the output
//! after the trigger matches the grammar byte for byte; if the grammar
//! refuses that text, the step fails as it would for any refused token
//! (INVALID_ARGUMENT: the text is named). A trigger token's own text is
//! the trigger, so nothing of it is fed. Before the trigger the stage
//! changes nothing (no mask, no randomness), so the output up to and
//! including the trigger is the unconstrained output.
//!
//! A trigger string may end inside a token and span several: the last
//! `longest trigger − 1` bytes of output are kept (bounded memory), and a
//! token triggers when the kept bytes plus its text contain a trigger
//! string. Among several completed by one token, the one that ends first
//! wins (the first to appear in the text). Special tokens match by their
//! text (`</think>`), as llama.cpp's `token_to_piece` renders them.

use std::sync::Arc;
use std::time::Duration;

use llguidance::Matcher;
use samplerd_plugin_sdk::input_error;

use crate::ahead::{SeqState, grammar_failed};
use crate::tokenv::TokenEnv;

/// Most trigger strings plus trigger tokens a stage takes (the host's
/// `limits.max_constraint_triggers` is the request's bound; this bounds a
/// hand-written chain).
pub const MAX_TRIGGERS: usize = 1024;
/// Longest trigger string in bytes (likewise; the host's is
/// `limits.max_constraint_trigger_bytes`).
pub const MAX_TRIGGER_BYTES: usize = 1024;

/// What ends the wait: the stage's `trigger_strings` and `trigger_tokens`.
#[derive(Debug, Default)]
pub struct Triggers {
    strings: Vec<Vec<u8>>,
    /// Ascending, deduplicated.
    tokens: Vec<u32>,
    /// Bytes of output kept between tokens: the longest string less one.
    keep: usize,
}

/// Why the trigger parameters are refused. The `Display` text follows
/// `constraint: `.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum TriggerError {
    #[error("trigger_strings[{0}]: must not be empty (an empty trigger is always there)")]
    Empty(usize),
    #[error("trigger_strings[{index}]: {len} bytes is over the limit of {MAX_TRIGGER_BYTES}")]
    TooLong { index: usize, len: usize },
    #[error("trigger_strings and trigger_tokens: {0} triggers is over the limit of {MAX_TRIGGERS}")]
    TooMany(usize),
    #[error("trigger_tokens[{index}]: {value:?} is not a token id (a decimal number)")]
    NotAnId { index: usize, value: String },
    #[error("trigger_tokens[{index}]: token {id} is outside the vocabulary of {n_vocab} tokens")]
    OutsideVocab {
        index: usize,
        id: u32,
        n_vocab: usize,
    },
}

impl Triggers {
    /// From the parameters' values (`None` when neither is given: the
    /// grammar holds from the first token).
    pub fn new(
        strings: &[&str],
        tokens: &[&str],
        n_vocab: usize,
    ) -> Result<Option<Triggers>, TriggerError> {
        if strings.is_empty() && tokens.is_empty() {
            return Ok(None);
        }
        if strings.len() + tokens.len() > MAX_TRIGGERS {
            return Err(TriggerError::TooMany(strings.len() + tokens.len()));
        }
        for (index, s) in strings.iter().enumerate() {
            if s.is_empty() {
                return Err(TriggerError::Empty(index));
            }
            if s.len() > MAX_TRIGGER_BYTES {
                return Err(TriggerError::TooLong {
                    index,
                    len: s.len(),
                });
            }
        }
        let mut ids = Vec::with_capacity(tokens.len());
        for (index, t) in tokens.iter().enumerate() {
            let id: u32 = t.trim().parse().map_err(|_| TriggerError::NotAnId {
                index,
                value: t.chars().take(40).collect(),
            })?;
            if id as usize >= n_vocab {
                return Err(TriggerError::OutsideVocab { index, id, n_vocab });
            }
            ids.push(id);
        }
        ids.sort_unstable();
        ids.dedup();
        let keep = strings.iter().map(|s| s.len()).max().unwrap_or(1) - 1;
        Ok(Some(Triggers {
            strings: strings.iter().map(|s| s.as_bytes().to_vec()).collect(),
            tokens: ids,
            keep,
        }))
    }

    /// Where the grammar starts if `token` (whose text is `text`) ends
    /// the wait after the kept bytes `tail`: the offset into `text` just
    /// past the trigger (`Some(text.len())` for a trigger token).
    fn fired(&self, tail: &[u8], token: u32, text: &[u8]) -> Option<usize> {
        if self.tokens.binary_search(&token).is_ok() {
            return Some(text.len());
        }
        let joined = [tail, text].concat();
        self.strings
            .iter()
            .filter_map(|s| {
                joined
                    .windows(s.len())
                    .position(|w| w == s.as_slice())
                    .map(|at| at + s.len())
            })
            .min()
            .map(|end| end.saturating_sub(tail.len()))
    }
}

/// Per sequence: waiting for a trigger (with the last bytes of output),
/// or under the grammar.
#[derive(Clone)]
pub struct LazyState {
    /// `Some`: still waiting, holding the kept bytes of output.
    waiting: Option<Vec<u8>>,
    pub grammar: SeqState,
}

impl LazyState {
    pub fn new(matcher: Matcher, triggers: Option<&Triggers>) -> Self {
        LazyState {
            waiting: triggers.map(|_| Vec::new()),
            grammar: SeqState::new(matcher),
        }
    }

    /// Whether the grammar holds yet.
    pub fn active(&self) -> bool {
        self.waiting.is_none()
    }

    /// Takes `token` while waiting: `Ok(true)` when it was taken here (the
    /// wait goes on, or it ended and the rest of the token went to the
    /// grammar), `Ok(false)` when the grammar already holds and should
    /// take it.
    pub fn take_waiting(
        &mut self,
        env: &Arc<TokenEnv>,
        ahead_min: Duration,
        triggers: &Triggers,
        token: u32,
    ) -> Result<bool, String> {
        let Some(tail) = self.waiting.as_mut() else {
            return Ok(false);
        };
        let trie = env.factory.tok_env().tok_trie();
        let text = token_text(trie.token(token));
        let Some(start) = triggers.fired(tail, token, text) else {
            tail.extend_from_slice(text);
            let excess = tail.len().saturating_sub(triggers.keep);
            tail.drain(..excess);
            return Ok(true);
        };
        self.waiting = None;
        let rest = &text[start..];
        if rest.is_empty() {
            return Ok(true);
        }
        // The rest of the token, in the vocabulary's tokens (any split of
        // the bytes: llguidance follows the grammar byte by byte).
        let tokens = trie.greedy_tokenize(rest);
        self.grammar.advance(env, ahead_min, |m| {
            let valid = m
                .validate_tokens(&tokens)
                .map_err(|e| grammar_failed(&e.to_string()))?;
            if valid < tokens.len() {
                return Err(input_error(format!(
                    "constraint: the text {} after the trigger in token {token} is not allowed \
                     by the grammar",
                    crate::tokenv::describe(rest)
                )));
            }
            m.consume_tokens(&tokens)
                .map_err(|e| grammar_failed(&e.to_string()))?;
            Ok(false)
        })?;
        Ok(true)
    }
}

/// A token's text as the output shows it: llguidance's special-token
/// marker dropped.
fn token_text(bytes: &[u8]) -> &[u8] {
    match bytes.split_first() {
        Some((&toktrie::TokTrie::SPECIAL_TOKEN_MARKER, name)) => name,
        _ => bytes,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn t(strings: &[&str], tokens: &[&str]) -> Triggers {
        Triggers::new(strings, tokens, 100).unwrap().unwrap()
    }

    #[test]
    fn a_string_fires_where_it_ends_even_across_tokens() {
        let tr = t(&["</think>"], &[]);
        assert_eq!(tr.keep, 7);
        assert_eq!(tr.fired(b"", 1, b"a</think>{"), Some(9));
        assert_eq!(tr.fired(b"ab</th", 1, b"ink>\n{"), Some(4));
        assert_eq!(tr.fired(b"ab</th", 1, b"ink"), None);
        assert_eq!(tr.fired(b"", 1, b"</think>"), Some(8));
    }

    #[test]
    fn the_first_trigger_to_end_wins_and_tokens_fire_whole() {
        let tr = t(&["xyz", "ab"], &["7"]);
        assert_eq!(tr.fired(b"", 1, b"abxyz"), Some(2));
        assert_eq!(tr.fired(b"x", 1, b"yzab"), Some(2));
        assert_eq!(tr.fired(b"", 7, b"anything"), Some(8));
    }

    #[test]
    fn bad_triggers_are_named() {
        assert_eq!(Triggers::new(&[], &[], 10).unwrap().map(|_| ()), None);
        assert_eq!(
            Triggers::new(&["a", ""], &[], 10).unwrap_err(),
            TriggerError::Empty(1)
        );
        assert_eq!(
            Triggers::new(&[], &["3", "10"], 10).unwrap_err(),
            TriggerError::OutsideVocab {
                index: 1,
                id: 10,
                n_vocab: 10
            }
        );
        assert!(matches!(
            Triggers::new(&[], &["x"], 10).unwrap_err(),
            TriggerError::NotAnId { index: 0, .. }
        ));
        let long = "a".repeat(MAX_TRIGGER_BYTES + 1);
        assert!(matches!(
            Triggers::new(&[long.as_str()], &[], 10).unwrap_err(),
            TriggerError::TooLong { index: 0, .. }
        ));
    }
}
