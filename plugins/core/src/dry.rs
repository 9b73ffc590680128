//! `dry` ("don't repeat yourself"): llama.cpp's DRY repetition penalty
//! (`llama_sampler_dry_apply` in `src/llama-sampling.cpp`, from
//! Koboldcpp). A token that would extend a sequence already seen in the
//! window by more than `allowed_length` tokens loses
//! `multiplier × base^(length − allowed_length)` from its logit, where
//! `length` is the longest such repeat it would continue. Sequence
//! breakers (`\n`, `:`, `"`, `*` by default) cut the repeats: a repeat
//! never reaches back past the most recent breaker, and a single-token
//! breaker itself is never penalised.
//!
//! Off when `multiplier = 0`, `base < 1` or `penalty_last_n = 0`, as in
//! llama.cpp (which accepts those values and then does nothing).
//!
//! State: the window of accepted tokens (a ring buffer, like
//! `penalties`), plus scratch reused across steps. `apply` is llama.cpp's
//! four steps, O(window) each: the restart scan, the reverse Z-algorithm
//! (repeat lengths of every suffix), the longest repeat each next token
//! would continue, the penalties (only the tokens found, dense or
//! candidate view).
//!
//! Breakers need the token bytes, so the stage reads the vocabulary in
//! `config_new` (see [`breakers`]). Without one (a Sample that names no
//! `params.vocabulary`) an enabled DRY with any non-empty breaker is
//! refused, naming the reason and the fix:
//! llama.cpp always has a vocabulary, and running without the breakers
//! would silently penalise differently. `sequence_breakers = [""]` (no
//! breaker: llama.cpp skips empty ones) works without a vocabulary.

#![forbid(unsafe_code)]

pub mod breakers;
#[cfg(test)]
mod tests;

use std::collections::HashMap;
use std::ffi::CStr;
use std::hash::BuildHasherDefault;

use samplerd_plugin_sdk::defaults::{self, MAX_PENALTY_WINDOW};
use samplerd_plugin_sdk::prelude::*;

use crate::penalties::IdHasher;
use crate::util;
pub use breakers::{Breakers, MAX_BREAKER_BYTES, MAX_TAIL_TOKENS, TokenText};

/// At most this many breakers (llama.cpp has no limit; each one costs a
/// pass over the vocabulary at every chain build).
pub const MAX_BREAKERS: usize = 64;

/// `FLOAT_MAX_LOG` of llama.cpp: the exponent is clamped so that
/// `base^exponent` stays below `f32::MAX`.
const FLOAT_MAX_LOG: f32 = 88.722_84;

pub struct Dry {
    multiplier: f32,
    base: f32,
    allowed: i64,
    /// Window capacity; 0 = off.
    window: usize,
    breakers: Breakers,
}

type IdMap<V> = HashMap<u32, V, BuildHasherDefault<IdHasher>>;

/// One sequence's window and the scratch of `apply`.
#[derive(Clone, Default)]
pub struct History {
    /// Ring buffer; grows up to the window, then `head` is the oldest.
    ring: Vec<u32>,
    head: usize,
    /// The window newest first (llama.cpp's `last_tokens.rat(i)`).
    rev: Vec<u32>,
    /// llama.cpp's `dry_repeat_count`.
    repeat: Vec<usize>,
    /// llama.cpp's `dry_max_token_repeat`.
    max_repeat: IdMap<usize>,
}

impl History {
    fn push(&mut self, cap: usize, id: u32) {
        if self.ring.len() < cap {
            self.ring.push(id);
        } else if cap > 0 {
            self.ring[self.head] = id;
            self.head = (self.head + 1) % cap;
        }
    }

    /// `rev` = the last `n` tokens, newest first.
    fn fill_rev(&mut self, n: usize) {
        let len = self.ring.len();
        // the newest token sits just before `head` (once the ring is full)
        let newest = (self.head + len - 1) % len.max(1);
        self.rev.clear();
        self.rev
            .extend((0..n).map(|i| self.ring[(newest + len - i) % len]));
    }
}

impl Dry {
    fn enabled(&self) -> bool {
        self.multiplier != 0.0 && self.base >= 1.0 && self.window != 0
    }

    /// llama.cpp's penalty for a token continuing a repeat of `len`.
    fn penalty(&self, len: usize) -> f32 {
        let max_exponent = if self.base > 1.000_001 {
            (FLOAT_MAX_LOG / self.base.ln()) as i64
        } else {
            0
        };
        let mut exp = len as i64 - self.allowed;
        if max_exponent > 0 && exp > max_exponent {
            exp = max_exponent;
        }
        // C++'s std::pow(float, int) computes in double; the product is
        // rounded to float once, as llama.cpp's `float penalty = …`.
        (self.multiplier as f64 * (self.base as f64).powf(exp as f64)) as f32
    }

    /// Steps 1–3 of llama.cpp: fills `st.max_repeat` with, per token, the
    /// longest repeat (>= allowed_length) emitting it would continue.
    /// False when nothing can be penalised.
    fn find_repeats(&self, st: &mut History) -> bool {
        let n = st.ring.len().min(self.window);
        // (n = 0 with a negative allowed_length: llama.cpp's loops run
        // zero times)
        if n == 0 || n as i64 <= self.allowed {
            return false;
        }
        st.fill_rev(n);
        let rev = &st.rev;

        // Step 1: the most recent restart sequence limits the repeats.
        let mut rep_limit = n;
        for i in 0..n {
            let t = rev[i];
            let mut longest: i64 = if self.breakers.is_single(t) { 0 } else { -1 };
            for tail in self.breakers.tails(t) {
                let len = tail.len();
                if len as i64 > longest
                    && len <= i
                    && tail.iter().enumerate().all(|(o, &x)| x == rev[i - o - 1])
                {
                    longest = len as i64;
                }
            }
            if longest >= 0 {
                rep_limit = i - longest as usize;
                break;
            }
        }
        if (rep_limit as i64) < self.allowed {
            return false;
        }

        // Step 2: reverse Z-algorithm, `repeat[last - k]` = how far the
        // window's suffix matches the window ending k tokens earlier,
        // clamped to rep_limit (llama.cpp's loop, clamped values and all).
        st.repeat.clear();
        st.repeat.resize(n, 0);
        let cnt = &mut st.repeat;
        let last = n - 1;
        let (mut lt, mut rt) = (0usize, 0usize);
        for k in 1..n {
            if k > rt {
                let mut m = 0;
                while m + k < n && rev[m] == rev[m + k] {
                    m += 1;
                }
                cnt[last - k] = m.min(rep_limit);
                if m > 0 {
                    lt = k;
                    rt = k + m - 1;
                }
            } else {
                let p = k - lt;
                let right_part_len = rt - k + 1;
                if cnt[last - p] < right_part_len {
                    cnt[last - k] = cnt[last - p].min(rep_limit);
                } else {
                    let mut i = rt + 1;
                    while i < n && rev[i] == rev[i - k] {
                        i += 1;
                    }
                    cnt[last - k] = (i - k).min(rep_limit);
                    lt = k;
                    rt = i - 1;
                }
            }
        }

        // Step 3: the token after each repeat would extend it.
        st.max_repeat.clear();
        for i in 0..n - 1 {
            let len = cnt[i];
            if len as i64 >= self.allowed {
                let t = rev[n - 2 - i];
                let e = st.max_repeat.entry(t).or_insert(len);
                *e = (*e).max(len);
            }
        }
        !st.max_repeat.is_empty()
    }
}

impl Stage for Dry {
    const NAME: &'static CStr = c"dry";
    const DESCRIPTION: &'static CStr = c"DRY: penalises tokens that extend a repeated sequence beyond allowed_length (llama.cpp dry)";
    const PARAMS: &'static [SdParamSpec] = &[
        number_param(
            c"multiplier",
            c"penalty scale; 0 = off (llama.cpp dry_multiplier)",
            defaults::DRY_MULTIPLIER,
        ),
        number_param(
            c"base",
            c"penalty = multiplier x base^(length - allowed_length); < 1 = off",
            defaults::DRY_BASE,
        ),
        number_param(
            c"allowed_length",
            c"longest repeat left unpenalised",
            defaults::DRY_ALLOWED_LENGTH as f64,
        ),
        number_param(
            c"penalty_last_n",
            c"window of accepted tokens; 0 = off, -1 = whole history (at most 65536)",
            defaults::DRY_PENALTY_LAST_N as f64,
        ),
        param_spec(
            SD_PARAM_STRING_LIST,
            c"sequence_breakers",
            c"strings that end a repeat; default [\"\\n\", \":\", \"\\\"\", \"*\"]; [\"\"] = none; needs the model vocabulary",
            0.0,
        ),
    ];
    const FLAGS: u32 = SD_STAGE_DENSE_OK;
    type State = History;

    fn new(params: &Params<'_>, vocab: Option<&Vocab<'_>>) -> Result<Self, String> {
        const S: &str = "dry";
        let multiplier = util::number_in(params, S, "multiplier", "finite", f64::is_finite)?;
        let base = util::number_in(params, S, "base", "finite", f64::is_finite)?;
        let allowed = util::integer(
            params,
            S,
            "allowed_length",
            i32::MIN as i64,
            i32::MAX as i64,
        )?;
        let last_n = util::integer(params, S, "penalty_last_n", -1, MAX_PENALTY_WINDOW as i64)?;
        let given = params.strings("sequence_breakers");
        let list: Vec<&str> = given
            .clone()
            .unwrap_or_else(|| defaults::DRY_SEQUENCE_BREAKERS.to_vec());
        if list.len() > MAX_BREAKERS {
            return Err(format!(
                "{S}: sequence_breakers must be at most {MAX_BREAKERS} strings, got {}",
                list.len()
            ));
        }
        let mut dry = Dry {
            multiplier: multiplier as f32,
            base: base as f32,
            allowed,
            window: if last_n < 0 {
                MAX_PENALTY_WINDOW
            } else {
                last_n as usize
            },
            breakers: Breakers::default(),
        };
        // llama.cpp processes the breakers only when DRY is on.
        if dry.enabled() && list.iter().any(|s| !s.is_empty()) {
            let Some(vocab) = vocab else {
                // The hint comes before the list: the ABI cuts a message
                // at 511 bytes, and the list can be long.
                return Err(format!(
                    "{S}: sequence_breakers must be [\"\"] (none) without a vocabulary, and this \
                     request has none (Sample: name one in params.vocabulary; a breaker's \
                     tokens are found in it), got {list:?}"
                ));
            };
            dry.breakers = Breakers::from_strings(vocab, &list);
        }
        Ok(dry)
    }

    fn new_state(&self) -> History {
        let mut h = History::default();
        h.ring.reserve(self.window.min(256));
        h
    }

    fn accept(&self, state: &mut History, token: u32) {
        // llama.cpp keeps no history while DRY is off
        if self.enabled() {
            state.push(self.window, token);
        }
    }

    fn apply(
        &self,
        state: &mut History,
        tokens: &mut Tokens<'_>,
        _rng: &mut HostRng<'_>,
    ) -> Result<(), String> {
        if !self.enabled() || !self.find_repeats(state) {
            return Ok(());
        }
        // Step 4: penalise, except single-token breakers.
        let penalise = |l: f32, len: usize| util::saturate(l, l - self.penalty(len));
        match tokens.view() {
            ViewKind::Dense => {
                let dense = tokens.dense_mut();
                for (&id, &len) in &state.max_repeat {
                    if self.breakers.is_single(id) {
                        continue;
                    }
                    // ids outside the vocabulary are skipped, never a panic
                    if let Some(l) = dense.get_mut(id as usize) {
                        *l = penalise(*l, len);
                    }
                }
            }
            ViewKind::Candidates => {
                let mut touched = false;
                for c in tokens.candidates_mut() {
                    if let Some(&len) = state.max_repeat.get(&c.id)
                        && !self.breakers.is_single(c.id)
                    {
                        c.logit = penalise(c.logit, len);
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
