//! `top_p`'s check while unsent tokens are still live: the nucleus it cuts
//! is exact when the cut falls inside the sent entries above the bound on
//! every unsent logit, at the same place for every normaliser the dense row
//! could give.
//!
//! The stage (`plugins/core/src/top_p/mod.rs`, llama.cpp's
//! `llama_sampler_top_p_apply` in `src/llama-sampling.cpp`) computes
//! `Z = Σ expf(l − max)` as an f32 running sum in id order over the whole
//! row, then walks the tokens by descending logit adding `expf(l − max) / Z`
//! to an f32 running sum and cuts at the first sum `>= p` with at least
//! `min_keep` kept. Of `Z` only an interval is known here: the unsent
//! tokens' mass is an interval (their log-sum-exp), and the f32 sum's
//! rounding depends on where the unsent values sit. The walk itself only
//! reads the sent entries up to the cut (they sort first: each lies above
//! every unsent logit), so it is replayed here in f32 exactly as the stage
//! does it, at both ends of `Z`'s interval. Each step `fl(e / Z)` falls as
//! `Z` grows and f32 addition is monotone, so the cut can only move later
//! as `Z` grows: the same cut at both ends is the same cut for every `Z`
//! between.

use super::row::{f32_at_least, f32_at_most};

/// The unit roundoff of f32 (half an ulp of 1).
const U: f64 = 1.0 / 16_777_216.0;

/// What the check is given: the live sent logits as the stages before left
/// them (any order), the bound on every unsent logit, the interval of the
/// unsent tokens' log-sum-exp, how many tokens were not sent, the row's
/// length and the stage's parameters.
pub(super) struct Inputs<'a> {
    pub sent: &'a [f32],
    pub m: f32,
    pub rest_lo: f64,
    pub rest_hi: f64,
    pub unsent: usize,
    pub n_vocab: usize,
    pub p: f32,
    pub min_keep: usize,
}

/// The check's answer.
#[derive(Debug, Clone, PartialEq)]
pub(super) enum Nucleus {
    /// The nucleus is this many sent entries, whatever the unsent values.
    Kept(usize),
    /// The running sum does not reach p inside the sent entries above the
    /// bound, for the largest normaliser the row allows; `share` is the
    /// part of the row's mass (estimated) those entries hold.
    Open { share: f64 },
    /// The cut lies inside the sent entries but moves with the normaliser:
    /// after `first` entries at its smallest, `last` at its largest.
    Uncertain { first: usize, last: usize },
    /// No sent entry lies above the bound: the row's maximum may be unsent.
    NoMax,
    /// A row so long that the rounding bound on its f32 sum is useless.
    TooLarge,
}

/// How far `Z`'s f32 running sum over `n` non-negative terms may stray from
/// their exact sum, relative to it: `γ(n−1) = (n−1)u / (1 − (n−1)u)`
/// (Higham, *Accuracy and Stability of Numerical Algorithms*, §4.2).
fn sum_error(n: usize) -> Option<f64> {
    let nu = n.saturating_sub(1) as f64 * U;
    (nu < 0.5).then(|| nu / (1.0 - nu))
}

/// How far one unsent term `expf(fl(l − max))` may stray from
/// `exp(l − max)`, relative to it, for `l − max >= −88`: the subtraction's
/// rounding moves the exponent by at most 88u, `expf` adds at most an ulp
/// (2u). Smaller terms are bounded in absolute value ([`TINY`]).
const TERM_ERROR: f64 = 96.0 * U;

/// Beyond `exp(−88)` a term may be subnormal (no relative bound): each is
/// below this in absolute value, rounding included.
const TINY: f64 = 1e-38;

/// Replays the stage's walk over `desc` (the sent terms `expf(l − max)` in
/// descending order of logit) with the normaliser `z`: the number kept when
/// the cut falls inside them.
fn cut(desc: &[f32], z: f32, p: f32, min_keep: usize) -> Option<usize> {
    let mut cum = 0.0f32;
    for (i, &e) in desc.iter().enumerate() {
        cum += e / z;
        if cum >= p && i + 1 >= min_keep {
            return Some(i + 1);
        }
    }
    None
}

/// Whether the nucleus over the row is the same set of sent entries for
/// every row the inputs stand for (see the module doc).
pub(super) fn prove(x: &Inputs<'_>) -> Nucleus {
    let max = x.sent.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    // With the maximum sent (and no unsent logit above it) the stage's
    // `max` is this value whichever token holds it.
    if max == f32::NEG_INFINITY || max < x.m {
        return Nucleus::NoMax;
    }
    let Some(gamma) = sum_error(x.n_vocab) else {
        return Nucleus::TooLarge;
    };
    // The sent terms as the stage computes them (libm `expf`), and their
    // exact sum (f64: 2^29 times finer than f32, its own error far inside
    // the margin added below).
    let mut above: Vec<f32> = x.sent.iter().copied().filter(|&l| l > x.m).collect();
    above.sort_unstable_by(|a, b| b.total_cmp(a));
    let terms: Vec<f32> = above.iter().map(|&l| (l - max).exp()).collect();
    let sent_sum: f64 = x.sent.iter().map(|&l| (l - max).exp() as f64).sum();
    let above_sum: f64 = terms.iter().map(|&e| e as f64).sum();
    // The unsent tokens' terms: their exact mass relative to `max`, each
    // term off by at most TERM_ERROR, or TINY when it is tiny.
    let rest = |lse: f64| {
        if lse == f64::NEG_INFINITY {
            0.0
        } else {
            (lse - max as f64).exp()
        }
    };
    let slack = x.unsent as f64 * TINY;
    let rest_lo = (rest(x.rest_lo) * (1.0 - TERM_ERROR) - slack).max(0.0);
    let rest_hi = rest(x.rest_hi) * (1.0 + TERM_ERROR) + slack;
    let exact_lo = sent_sum * (1.0 - 1e-12) + rest_lo;
    let exact_hi = sent_sum * (1.0 + 1e-12) + rest_hi;
    let z_lo = f32_at_most(exact_lo * (1.0 - gamma));
    let z_hi = f32_at_least(exact_hi * (1.0 + gamma));
    let (first, last) = (
        cut(&terms, z_lo, x.p, x.min_keep),
        cut(&terms, z_hi, x.p, x.min_keep),
    );
    match (first, last) {
        (Some(a), Some(b)) if a == b => Nucleus::Kept(a),
        (Some(first), Some(last)) => Nucleus::Uncertain { first, last },
        _ => Nucleus::Open {
            share: above_sum / (sent_sum + 0.5 * (rest(x.rest_lo) + rest(x.rest_hi))),
        },
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn inputs(sent: &[f32], m: f32, rest: f64, unsent: usize, p: f32) -> Inputs<'_> {
        Inputs {
            sent,
            m,
            rest_lo: rest,
            rest_hi: rest,
            unsent,
            n_vocab: sent.len() + unsent,
            p,
            min_keep: 1,
        }
    }

    #[test]
    fn a_peaked_row_closes_and_a_flat_one_does_not() {
        let sent = [10.0f32, 9.0, 8.0, 0.0];
        // The rest holds next to nothing: p = 0.9 closes after 2.
        let x = inputs(&sent, 0.0, -5.0, 1000, 0.9);
        assert_eq!(prove(&x), Nucleus::Kept(2));
        // The rest holds most of the mass: the sent entries never reach p.
        let x = inputs(&sent, 0.0, 12.0, 1000, 0.9);
        assert!(matches!(prove(&x), Nucleus::Open { share } if share < 0.2));
        // The maximum may be unsent.
        let x = inputs(&sent, 10.5, 0.0, 1000, 0.9);
        assert_eq!(prove(&x), Nucleus::NoMax);
    }

    #[test]
    fn a_cut_on_the_edge_moves_with_the_normaliser() {
        // The first entry alone holds just about p: which side of p its
        // share lands on depends on the normaliser's last bits, and on
        // the vocabulary's rounding margin.
        let sent = [5.0f32, 4.0, 3.0];
        let z = 1.0 + (-1.0f64).exp() + (-2.0f64).exp();
        let p = (1.0 / z) as f32;
        let mut x = inputs(&sent, 3.0, f64::NEG_INFINITY, 150_000, p);
        x.rest_lo = f64::NEG_INFINITY;
        assert!(matches!(
            prove(&x),
            Nucleus::Uncertain { first: 1, last: 2 }
        ));
        // Clear of the edge by more than the margin: decided.
        let x = Inputs { p: p * 0.98, ..x };
        assert_eq!(prove(&x), Nucleus::Kept(1));
    }

    #[test]
    fn the_sum_error_bound_refuses_absurd_vocabularies() {
        assert!(sum_error(151_936).unwrap() < 0.01);
        assert_eq!(sum_error((1 << 24) + 2), None);
    }
}
