//! The candidate view: the stages' total order, sorting, the dense →
//! candidate conversion, the max logit of either view and a candidate
//! softmax.

#![forbid(unsafe_code)]

use std::cmp::Ordering;

use samplerd_plugin_sdk::prelude::*;

use super::exp::exp_f32;
use super::fold::{candidates_max, fmax, max_scan};

/// Descending by logit, ties by ascending id (a total, deterministic order).
#[inline]
pub fn desc(a: &SdCandidate, b: &SdCandidate) -> Ordering {
    b.logit.total_cmp(&a.logit).then(a.id.cmp(&b.id))
}

/// Sorts the live candidates descending (ties: lower id first) unless the
/// buffer says they already are.
pub fn sort_candidates(tokens: &mut Tokens<'_>) {
    if !tokens.is_sorted() {
        tokens.candidates_mut().sort_unstable_by(desc);
        let n = tokens.len();
        tokens.set_candidates(n, true);
    }
}

/// Switches a dense buffer to the candidate view holding every token in id
/// order (what the host does for a stage without DENSE_OK). No-op in the
/// candidate view.
pub fn to_candidates(tokens: &mut Tokens<'_>) {
    if tokens.view() == ViewKind::Dense {
        let (dense, cand) = tokens.dense_and_buffer();
        for (i, (c, &l)) in cand.iter_mut().zip(dense).enumerate() {
            *c = SdCandidate {
                id: i as u32,
                logit: l,
            };
        }
        let n = dense.len();
        tokens.set_candidates(n, false);
    }
}

/// Max logit of the live entries (either view); -inf when empty.
pub fn max_logit(tokens: &Tokens<'_>) -> f32 {
    match tokens.view() {
        ViewKind::Dense => max_scan(tokens.dense()),
        ViewKind::Candidates => {
            if tokens.is_sorted() {
                tokens
                    .candidates()
                    .first()
                    .map_or(f32::NEG_INFINITY, |c| c.logit)
            } else {
                candidates_max(tokens.candidates())
            }
        }
    }
}

/// Softmax of a candidate list in its current order: `probs[i]` (f32) and
/// the f64 normaliser. `probs` is cleared and refilled (no allocation once
/// its capacity suffices).
pub fn softmax_into(cands: &[SdCandidate], probs: &mut Vec<f32>) -> f64 {
    probs.clear();
    let max = cands
        .iter()
        .fold(f32::NEG_INFINITY, |m, c| fmax(m, c.logit));
    if max == f32::NEG_INFINITY {
        probs.resize(cands.len(), 0.0);
        return 0.0;
    }
    let mut sum = 0.0f64;
    for c in cands {
        let e = exp_f32(c.logit - max);
        probs.push(e);
        sum += e as f64;
    }
    if sum > 0.0 {
        for p in probs.iter_mut() {
            *p = (*p as f64 / sum) as f32;
        }
    }
    sum
}
