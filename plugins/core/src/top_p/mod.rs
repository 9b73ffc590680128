//! `top_p` (nucleus): keeps the shortest prefix of the candidates sorted by
//! descending probability whose cumulative probability is >= p, and at
//! least `min_keep` (llama.cpp `top-p`). Survivors keep their raw logits;
//! probabilities are only computed internally. p >= 1: no-op. p <= 0
//! keeps the `max(1, min_keep)` most likely tokens, sorted: llama.cpp's
//! walk stops at its first candidate (`cum_sum >= p` always holds) once
//! `min_keep` are kept; we get there with a top-k selection instead of
//! the softmax walk, so the optimised paths below only ever see p in (0, 1).
//!
//! The arithmetic is llama.cpp's, since the f32 rounding of its sums
//! decides the cut: softmax in the list's current order (libm `expf`, f32
//! running sum Z), then in descending order an f32 running sum of `e / Z`,
//! cut at the first `cum >= p` with at least `min_keep` kept. Output sorted.
//!
//! Small candidate lists (<= 4096, e.g. after top_k) or sorted ones: Z,
//! sort if needed, walk; output sorted.
//!
//! Dense view or large lists (top_k off): `nucleus::nucleus` computes
//! the same f32 sums bit for bit with vectorised block sums and finds the cut without
//! sorting the nucleus (only the logit buckets where the running sum
//! changes binade, meets an uncertain lane or reaches p are sorted). The
//! kept tokens are then written in list order with `sorted = 0`, or sorted
//! when at most `util::SORT_LIMIT` (llama.cpp always sorts; the draw's
//! distribution is the same, see docs/SAMPLING.md).
//!
//! # The large path
//!
//! llama.cpp computes `Z = Σ expf(l - max)` as an f32 running sum in list
//! order, then walks the candidates sorted by logit adding `expf(l - max) /
//! Z` to another f32 running sum. With ~10,000 tokens in the nucleus the
//! rounding of those sums decides the cut, so we must produce the very same
//! f32 values, yet a sequential f32 sum of 151,936 values is latency-bound
//! (~200 µs) and libm `expf` is scalar.
//!
//! The trick: while a running sum `s` stays in one binade `[2^k, 2^(k+1))`,
//! every intermediate result is a multiple of `u = ulp(s)`, and
//! `fl(s + v) = s + round_u(v)` (round to nearest multiple of `u`; ties to
//! even depend on `s`). So a block of additions that stays in the binade
//! and contains no tie equals one integer addition of `Σ round_u(v)`, which
//! is order-independent and vectorises. `round_u(v)` needs `v` only to the
//! precision that separates it from the nearest half-multiple of `u`: we use
//! the branch-free polynomial `exp_f32` (within `exp::EXP_REL_ERR` of libm's
//! `expf`, tested), and call libm only for the rare lanes that land within
//! that error of a rounding boundary. Ties, binade crossings and those lanes
//! are replayed in order with the real f32 addition, as llama.cpp does it.
//!
//! The walk uses the same fact to avoid sorting the nucleus: the gathered
//! tokens (those above a floor estimated from a sample, checked against
//! their mass) are counting-sorted into logit buckets, and a bucket whose
//! additions stay in one binade, hold no tie or uncertain lane and do not
//! reach p is added as one integer sum, in any order. Only the other
//! buckets (the few largest probabilities, the binade crossings and the
//! cut) are sorted and replayed in order. On AVX-512 a faster walk without
//! the counting sort runs first (`ladder`) and hands over to the bucket
//! walk when one of its assumptions fails. The result is the cut: the kept
//! tokens are those ordered at or before its key.
//!
//! Files, each importing only the ones listed before it: `shared.rs` (the
//! CPU check, the order keys, the `Cut`, the gathered
//! tokens, the walk's target and the floor's sample), `exp.rs` (libm's
//! `expf`, the approximations' error bound, the AVX-512 exp and the
//! probabilities), `grid_sum.rs` (the exact f32 running sum on a grid),
//! `normaliser.rs` (the Z pass that also gathers the tokens above the
//! floor), `bucket_walk.rs` (the portable walk and the exact replay),
//! `ladder/` (the AVX-512 walk), `nucleus.rs` (the driver: floor, gather,
//! walk, and the per-sequence scratch), `kept.rs` (writing the kept
//! tokens); this file the stage itself.

use std::ffi::CStr;

use samplerd_plugin_sdk::defaults;
use samplerd_plugin_sdk::prelude::*;

use crate::top_k::{self, Selector};
use crate::util;

mod bucket_walk;
mod exp;
mod grid_sum;
mod kept;
#[cfg(target_arch = "x86_64")]
mod ladder;
mod normaliser;
mod nucleus;
mod shared;
#[cfg(test)]
mod tests;

/// Candidate lists up to this size use the sort-then-cut path.
const SMALL_PATH: usize = 4096;

pub struct TopP {
    p: f32,
    min_keep: usize,
}

#[derive(Clone, Default)]
pub struct TopPState {
    vals: Vec<f32>,
    nucleus: nucleus::Scratch,
    sel: Selector,
}

impl TopP {
    fn small(&self, tokens: &mut Tokens<'_>) {
        // llama.cpp: softmax in the list's current order (max, libm expf,
        // f32 running sum), then sort, then an f32 running sum of the f32
        // probabilities.
        let max = util::max_logit(tokens);
        if max == f32::NEG_INFINITY {
            return; // nothing finite left
        }
        let mut z = 0.0f32;
        for c in tokens.candidates() {
            z += (c.logit - max).exp();
        }
        util::sort_candidates(tokens);
        let mut cum = 0.0f32;
        let mut last = tokens.len();
        for (i, c) in tokens.candidates().iter().enumerate() {
            cum += (c.logit - max).exp() / z;
            if cum >= self.p && i + 1 >= self.min_keep {
                last = i + 1;
                break;
            }
        }
        tokens.truncate(last);
    }

    fn large(&self, st: &mut TopPState, tokens: &mut Tokens<'_>) {
        let dense = tokens.view() == ViewKind::Dense;
        let mut vals = std::mem::take(&mut st.vals);
        if !dense {
            vals.clear();
            vals.extend(tokens.candidates().iter().map(|c| c.logit));
        }
        let x: &[f32] = if dense { tokens.dense() } else { &vals };
        let max = util::max_scan(x);
        if max == f32::NEG_INFINITY {
            st.vals = vals;
            return;
        }
        let cut = nucleus::nucleus(x, max, self.p, self.min_keep, &mut st.nucleus);
        // The kept tokens, in position order (the gathered set holds them
        // all). In the candidate view this compacts the list in place:
        // the write index never passes the read index.
        let g = st.nucleus.gathered();
        let k = cut.kept;
        if dense {
            let (_, cand) = tokens.dense_and_buffer();
            kept::write_kept(g, cut, cand);
        } else {
            kept::compact_kept(g, cut, tokens.candidates_mut());
        }
        st.vals = vals;
        tokens.set_candidates(k, false);
        if k <= util::SORT_LIMIT {
            util::sort_candidates(tokens);
        }
    }
}

impl Stage for TopP {
    const NAME: &'static CStr = c"top_p";
    const DESCRIPTION: &'static CStr =
        c"nucleus: keeps the smallest top set whose probability sums to >= p (p = 1: off)";
    const PARAMS: &'static [SdParamSpec] = &[
        number_param(
            c"p",
            c"cumulative probability to keep, <= 1; 1 = off; <= 0 keeps the most likely token",
            defaults::TOP_P,
        ),
        number_param(c"min_keep", c"keep at least this many candidates", 1.0),
    ];
    const FLAGS: u32 = SD_STAGE_DENSE_OK;
    type State = TopPState;

    fn new(params: &Params<'_>, _vocab: Option<&Vocab<'_>>) -> Result<Self, String> {
        // llama.cpp also takes p > 1 (as a no-op); we refuse it, since it is
        // far more often a percentage (95) than a wish to switch top_p off.
        let p = util::number_in(params, "top_p", "p", "<= 1", |v| v <= 1.0)?;
        let min_keep = util::min_keep(params, "top_p")?;
        Ok(TopP {
            p: p as f32,
            min_keep,
        })
    }

    fn new_state(&self) -> TopPState {
        TopPState::default()
    }

    fn apply(
        &self,
        st: &mut TopPState,
        tokens: &mut Tokens<'_>,
        _rng: &mut HostRng<'_>,
    ) -> Result<(), String> {
        if self.p >= 1.0 || tokens.is_empty() {
            return Ok(());
        }
        if self.p <= 0.0 {
            top_k::keep_top(tokens, self.min_keep.max(1), &mut st.sel);
            return Ok(());
        }
        if tokens.view() == ViewKind::Candidates
            && (tokens.len() <= SMALL_PATH || tokens.is_sorted())
        {
            self.small(tokens);
        } else {
            self.large(st, tokens);
        }
        Ok(())
    }
}
