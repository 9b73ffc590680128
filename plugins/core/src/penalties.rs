//! `penalties`: llama.cpp's repetition penalties over the last
//! `repeat_last_n` accepted tokens. For each token of the window with
//! `count` occurrences, first the repeat rule (logit <= 0: × repeat,
//! else ÷ repeat), then `logit -= count * frequency + (count > 0) * presence`.
//!
//! `exclude_tokens` are never penalised (they still take their place in
//! the window): llama.cpp's former `penalize_nl = false`, which restored
//! the newline's logit after the penalties (`llama_sampler_penalties_apply`,
//! src/llama-sampling.cpp, before the option was removed), for any ids — what
//! TGI/transformers users ask of a repetition penalty that must spare
//! punctuation or a format's tokens.
//!
//! State: a fixed-capacity ring buffer of the window, per-token counts kept
//! incrementally on `accept` (O(1)), and the list of distinct ids with their
//! counts, so `apply` touches only the window's distinct ids in the dense
//! view (O(window)); in the candidate view it looks each candidate up in a
//! small hash map (O(candidates)).

#![forbid(unsafe_code)]

use std::collections::HashMap;
use std::ffi::CStr;
use std::hash::{BuildHasherDefault, Hasher};

use samplerd_plugin_sdk::defaults::{self, MAX_PENALTY_WINDOW};
use samplerd_plugin_sdk::prelude::*;

use crate::util;

/// Multiplicative hash for u32 keys (ids are not attacker-chosen hash-flood
/// material: the window holds at most 65,536 of them).
#[derive(Default, Clone, Copy)]
pub struct IdHasher(u64);

impl Hasher for IdHasher {
    fn finish(&self) -> u64 {
        // fold the well-mixed high half into the low bits the table indexes with
        self.0 ^ (self.0 >> 29)
    }
    fn write(&mut self, bytes: &[u8]) {
        for &b in bytes {
            self.0 = (self.0.rotate_left(5) ^ b as u64).wrapping_mul(0x517c_c1b7_2722_0a95);
        }
    }
    fn write_u32(&mut self, v: u32) {
        self.0 = (v as u64 ^ 0x9e37_79b9).wrapping_mul(0x9e37_79b9_7f4a_7c15);
    }
}

type IdMap = HashMap<u32, u32, BuildHasherDefault<IdHasher>>;

pub struct Penalties {
    window: usize,
    repeat: f32,
    frequency: f32,
    presence: f32,
    /// Ids spared, sorted.
    exclude: Vec<u32>,
}

/// Most `exclude_tokens` (a vocabulary's worth of ids is the host's bound;
/// this bounds a hand-written chain).
pub const MAX_EXCLUDE_TOKENS: usize = 262_144;

/// The penalty window of one sequence.
#[derive(Clone, Default)]
pub struct Window {
    /// Ring buffer; grows up to the capacity, then `head` is the oldest.
    ring: Vec<u32>,
    head: usize,
    /// Distinct ids in the window with their counts.
    distinct: Vec<(u32, u32)>,
    /// id → index into `distinct`.
    index: IdMap,
}

impl Window {
    fn inc(&mut self, id: u32) {
        match self.index.get(&id) {
            Some(&pos) => self.distinct[pos as usize].1 += 1,
            None => {
                self.index.insert(id, self.distinct.len() as u32);
                self.distinct.push((id, 1));
            }
        }
    }

    fn dec(&mut self, id: u32) {
        let Some(&pos) = self.index.get(&id) else {
            return;
        };
        let pos = pos as usize;
        let e = &mut self.distinct[pos].1;
        *e -= 1;
        if *e == 0 {
            self.index.remove(&id);
            self.distinct.swap_remove(pos);
            if let Some(&(moved, _)) = self.distinct.get(pos) {
                self.index.insert(moved, pos as u32);
            }
        }
    }

    fn push(&mut self, cap: usize, id: u32) {
        if cap == 0 {
            return;
        }
        if self.ring.len() < cap {
            self.ring.push(id);
        } else {
            let old = std::mem::replace(&mut self.ring[self.head], id);
            self.head = (self.head + 1) % cap;
            self.dec(old);
        }
        self.inc(id);
    }

    /// The window's distinct ids with their counts (any order).
    pub fn counts(&self) -> &[(u32, u32)] {
        &self.distinct
    }

    /// Count of `id` in the window.
    pub fn count(&self, id: u32) -> u32 {
        self.index
            .get(&id)
            .map_or(0, |&p| self.distinct[p as usize].1)
    }
}

impl Penalties {
    #[inline]
    fn penalise(&self, logit: f32, count: u32) -> f32 {
        // llama.cpp order: the ÷/× repeat rule first, then the subtraction.
        // Saturated (see `util::saturate`): a huge logit stays finite.
        let l = if logit <= 0.0 {
            logit * self.repeat
        } else {
            logit / self.repeat
        };
        let l = util::saturate(logit, l);
        util::saturate(
            logit,
            l - (count as f32 * self.frequency + (count > 0) as u32 as f32 * self.presence),
        )
    }

    fn spared(&self, id: u32) -> bool {
        !self.exclude.is_empty() && self.exclude.binary_search(&id).is_ok()
    }

    fn is_noop(&self) -> bool {
        self.window == 0 || (self.repeat == 1.0 && self.frequency == 0.0 && self.presence == 0.0)
    }
}

impl Stage for Penalties {
    const NAME: &'static CStr = c"penalties";
    const DESCRIPTION: &'static CStr = c"repeat (÷/×), frequency and presence penalties over the last repeat_last_n tokens (llama.cpp order)";
    const PARAMS: &'static [SdParamSpec] = &[
        number_param(
            c"repeat_last_n",
            c"window of accepted tokens; 0 = off, -1 = whole history (at most 65536)",
            defaults::REPEAT_LAST_N as f64,
        ),
        number_param(
            c"repeat_penalty",
            c"÷ positive / × negative logits of repeated tokens; 1 = off",
            defaults::REPEAT_PENALTY,
        ),
        number_param(
            c"frequency_penalty",
            c"subtracted once per occurrence in the window",
            defaults::FREQUENCY_PENALTY,
        ),
        number_param(
            c"presence_penalty",
            c"subtracted once if the token occurs in the window",
            defaults::PRESENCE_PENALTY,
        ),
        param_spec(
            SD_PARAM_STRING_LIST,
            c"exclude_tokens",
            c"token ids (decimal strings) never penalised; they still count in the window",
            0.0,
        ),
    ];
    const FLAGS: u32 = SD_STAGE_DENSE_OK;
    type State = Window;

    fn new(params: &Params<'_>, _vocab: Option<&Vocab<'_>>) -> Result<Self, String> {
        const S: &str = "penalties";
        let last_n = util::integer(params, S, "repeat_last_n", -1, MAX_PENALTY_WINDOW as i64)?;
        let repeat = util::number_in(params, S, "repeat_penalty", "finite and > 0", |v| {
            v.is_finite() && v > 0.0
        })?;
        let frequency = util::non_negative(params, S, "frequency_penalty")?;
        let presence = util::non_negative(params, S, "presence_penalty")?;
        let given = params.strings("exclude_tokens").unwrap_or_default();
        if given.len() > MAX_EXCLUDE_TOKENS {
            return Err(format!(
                "{S}: exclude_tokens must be at most {MAX_EXCLUDE_TOKENS} ids, got {}",
                given.len()
            ));
        }
        let mut exclude = given
            .iter()
            .map(|s| {
                s.trim().parse::<u32>().map_err(|_| {
                    let shown: String = s.chars().take(24).collect();
                    format!(
                        "{S}: exclude_tokens holds {shown:?}, which is not a token id (a decimal u32)"
                    )
                })
            })
            .collect::<Result<Vec<u32>, String>>()?;
        exclude.sort_unstable();
        exclude.dedup();
        Ok(Penalties {
            window: if last_n < 0 {
                MAX_PENALTY_WINDOW
            } else {
                last_n as usize
            },
            repeat: repeat as f32,
            frequency: frequency as f32,
            presence: presence as f32,
            exclude,
        })
    }

    fn new_state(&self) -> Window {
        let mut w = Window::default();
        let cap = self.window.min(256);
        w.ring.reserve(cap);
        w.distinct.reserve(cap);
        w.index.reserve(cap);
        w
    }

    fn accept(&self, state: &mut Window, token: u32) {
        state.push(self.window, token);
    }

    fn apply(
        &self,
        state: &mut Window,
        tokens: &mut Tokens<'_>,
        _rng: &mut HostRng<'_>,
    ) -> Result<(), String> {
        if self.is_noop() || state.distinct.is_empty() {
            return Ok(());
        }
        match tokens.view() {
            ViewKind::Dense => {
                let dense = tokens.dense_mut();
                for &(id, count) in &state.distinct {
                    if self.spared(id) {
                        continue;
                    }
                    // ids outside the vocabulary are skipped, never a panic
                    if let Some(l) = dense.get_mut(id as usize) {
                        *l = self.penalise(*l, count);
                    }
                }
            }
            ViewKind::Candidates => {
                let mut touched = false;
                for c in tokens.candidates_mut() {
                    if let Some(&pos) = state.index.get(&c.id)
                        && !self.spared(c.id)
                    {
                        c.logit = self.penalise(c.logit, state.distinct[pos as usize].1);
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

#[cfg(test)]
mod tests {
    use super::*;

    /// Fuzz find: a huge positive logit divided by a repeat penalty < 1 was
    /// +inf, +inf minus a huge frequency penalty NaN, and a huge penalty
    /// masked the token (-inf); a masked token stays masked.
    #[test]
    fn a_huge_logit_saturates_instead_of_overflowing() {
        let p = Penalties {
            window: 64,
            repeat: 0.5,
            frequency: 0.0,
            presence: 0.0,
            exclude: Vec::new(),
        };
        assert_eq!(p.penalise(3e38, 1), f32::MAX);
        let p = Penalties {
            frequency: 3e38,
            ..p
        };
        assert_eq!(p.penalise(3e38, 2), -f32::MAX);
        assert_eq!(p.penalise(-3e38, 2), -f32::MAX);
        assert!(p.penalise(3e38, 1).is_finite());
        assert_eq!(p.penalise(f32::NEG_INFINITY, 2), f32::NEG_INFINITY);
    }
}
