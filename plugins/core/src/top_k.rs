//! `top_k`: keeps the k highest-logit candidates, sorted descending
//! (llama.cpp `top-k`). In the dense view it selects straight from the
//! 151,936 logits at about the cost of one max-scan: chunk maxima are
//! computed in one vectorised pass, the k-th largest chunk max bounds the
//! k-th best logit from below, and only the chunks reaching that bound are
//! scanned element by element into a small sorted buffer.
//!
//! Ties: exactly k survive; among equal logits the lower token id (dense
//! view) or the earlier position (candidate view) wins. For k > 256 a
//! select-then-sort path is used whose tie order is lower id first.

use std::ffi::CStr;

use samplerd_plugin_sdk::prelude::*;

use crate::util::{self, CHUNK, desc};

/// Above this k the chunk-bound method stops paying off.
const SMALL_K: usize = 256;

pub struct TopK {
    k: usize,
}

/// Reusable scratch of the selection (kept in a stage's state).
#[derive(Clone, Default)]
pub struct Selector {
    chunk_max: Vec<f32>,
    bound: Vec<f32>,
    best: Vec<SdCandidate>,
    vals: Vec<f32>,
}

/// Inserts `c` into `best` (sorted descending, at most `k` long) after any
/// equal logits, so earlier entries win ties.
#[inline]
fn insert(best: &mut Vec<SdCandidate>, k: usize, c: SdCandidate) {
    let pos = best.partition_point(|b| b.logit >= c.logit);
    if pos >= k {
        return;
    }
    if best.len() == k {
        best.pop();
    }
    best.insert(pos, c);
}

impl Selector {
    /// The `k` (1 <= k <= SMALL_K) largest of `x`, as (index, value) in
    /// `self.best`, sorted descending, ties by lower index.
    fn select_small(&mut self, x: &[f32], k: usize) {
        let best = &mut self.best;
        best.clear();
        best.reserve(k + 1);
        util::chunk_maxima(x, &mut self.chunk_max);
        // k-th largest chunk max: k distinct chunks each hold an element
        // >= it, so the k-th best element is >= it too.
        let bound = &mut self.bound;
        bound.clear();
        bound.reserve(k + 1);
        for &m in &self.chunk_max {
            if bound.len() == k && m <= bound[k - 1] {
                continue;
            }
            let pos = bound.partition_point(|&b| b >= m);
            if bound.len() == k {
                bound.pop();
            }
            bound.insert(pos, m);
        }
        let lower = if bound.len() == k {
            bound[k - 1]
        } else {
            f32::NEG_INFINITY
        };
        for (ci, &cm) in self.chunk_max.iter().enumerate() {
            if cm < lower {
                continue;
            }
            let start = ci * CHUNK;
            let end = (start + CHUNK).min(x.len());
            let chunk = &x[start..end];
            // Only the elements reaching the current threshold are visited
            // (compare mask for full chunks).
            let t = if best.len() == k {
                best[k - 1].logit.max(lower)
            } else {
                lower
            };
            let mut mask = match <&[f32; CHUNK]>::try_from(chunk) {
                Ok(full) => util::ge_mask(full, t),
                Err(_) => chunk
                    .iter()
                    .enumerate()
                    .fold(0u64, |m, (j, &v)| m | (((v >= t) as u64) << j)),
            };
            while mask != 0 {
                let j = mask.trailing_zeros() as usize;
                mask &= mask - 1;
                let v = chunk[j];
                if best.len() == k && v <= best[k - 1].logit {
                    continue;
                }
                insert(
                    best,
                    k,
                    SdCandidate {
                        id: (start + j) as u32,
                        logit: v,
                    },
                );
            }
        }
    }
}

/// Keeps the `k` best live entries, sorted descending, in the candidate
/// view (k is clamped to the live length; k == 0 keeps everything but
/// still leaves the buffer as candidates).
pub fn keep_top(tokens: &mut Tokens<'_>, k: usize, sel: &mut Selector) {
    let n = tokens.len();
    let k = k.min(n);
    if tokens.view() == ViewKind::Candidates && tokens.is_sorted() {
        tokens.truncate(k);
        return;
    }
    if k == 0 {
        util::to_candidates(tokens);
        tokens.set_candidates(0, true);
        return;
    }
    if k <= SMALL_K {
        match tokens.view() {
            ViewKind::Dense => {
                sel.select_small(tokens.dense(), k);
                let (_, cand) = tokens.dense_and_buffer();
                cand[..k].copy_from_slice(&sel.best);
            }
            ViewKind::Candidates => {
                let mut vals = std::mem::take(&mut sel.vals);
                vals.clear();
                vals.extend(tokens.candidates().iter().map(|c| c.logit));
                sel.select_small(&vals, k);
                sel.vals = vals;
                let cands = tokens.candidates_mut();
                for b in sel.best.iter_mut() {
                    *b = cands[b.id as usize];
                }
                cands[..k].copy_from_slice(&sel.best);
            }
        }
    } else {
        util::to_candidates(tokens);
        let cands = tokens.candidates_mut();
        if k < cands.len() {
            cands.select_nth_unstable_by(k - 1, desc);
        }
        cands[..k].sort_unstable_by(desc);
    }
    tokens.set_candidates(k, true);
}

impl Stage for TopK {
    const NAME: &'static CStr = c"top_k";
    const DESCRIPTION: &'static CStr =
        c"keeps the k highest logits, sorted descending (k <= 0: off)";
    const PARAMS: &'static [SdParamSpec] = &[number_param(
        c"k",
        c"number of candidates to keep; 0 = off",
        40.0,
    )];
    const FLAGS: u32 = SD_STAGE_DENSE_OK;
    type State = Selector;

    fn new(params: &Params<'_>, _vocab: Option<&Vocab<'_>>) -> Result<Self, String> {
        let k = util::integer(params, "top_k", "k", 0, u32::MAX as i64)? as usize;
        Ok(TopK { k })
    }

    fn new_state(&self) -> Selector {
        Selector::default()
    }

    fn apply(
        &self,
        sel: &mut Selector,
        tokens: &mut Tokens<'_>,
        _rng: &mut HostRng<'_>,
    ) -> Result<(), String> {
        if self.k == 0 {
            return Ok(());
        }
        keep_top(tokens, self.k, sel);
        Ok(())
    }
}
