//! Speculative verification: K draft tokens checked against K + 1 target
//! rows as a loop of the one sampling step ([`crate::step`]) over a
//! [`Sequence`], for any chain. Position `j` (0 ≤ j ≤ K) is step
//! `first_step + j`; it runs the whole chain on target row `j` with the
//! sequence's state advanced through the drafts accepted before it
//! (penalty window, DRY history, grammar, every stage's `accept`). The
//! loop stops at the first position that does not accept its draft, so
//! nothing is ever rolled back: after `n` accepted drafts the sequence has
//! accepted exactly those `n` tokens, as `n` one-by-one steps would have.
//! The `n + 1`-th token (the correction, or the bonus token after K
//! accepted drafts) is reported and, like [`crate::step::run`]'s token,
//! left for the caller to `accept`. A row may be dense or sparse
//! ([`StepLogits`]): a sparse position answers exactly what its dense row
//! would (`crate::sparse`), so verifying over sparse rows reads the top of
//! each row instead of the whole vocabulary.
//!
//! The rules ([`Mode`]):
//! - EXACT (sample-and-match, llama.cpp's
//!   `common_sampler_sample_and_accept_n` in `common/sampling.cpp`): a
//!   draft is accepted while the chain's own draw at its step equals it.
//!   Every reported token is the step's, so the output is bit-identical to
//!   sampling the same rows one step at a time with the same seed.
//! - REJECTION (Leviathan et al. 2023, "Fast inference from transformers
//!   via speculative decoding", as vLLM's `RejectionSampler`): with `p` the
//!   target row's post-chain distribution and `q` the drafter row's (the
//!   same chain run on the drafter's logits, on a copy of the sequence's
//!   state — the distribution a drafter sampling through samplerd with the
//!   same parameters drew from), draft `x` is accepted with probability
//!   `min(1, p(x)/q(x))`; on rejection the token is drawn from
//!   `norm(max(0, p − q))`; after K accepted drafts the bonus token is the
//!   chain's draw on row K. The uniforms come from the step's verification
//!   range ([`StepRng::verification`]): the first decides acceptance, the
//!   second (on rejection) walks the residual in ascending id order. The
//!   output follows the target's distribution exactly; the chain must end
//!   with `dist` or `coupled` (a stage whose draw is the softmax of what
//!   the chain left: `greedy` or `mirostat`, which updates μ from its own
//!   draw, would make `p` mean something else).
//! - COUPLED (drafter-invariant, Daliri et al., arXiv 2408.07978): EXACT
//!   over a chain that ends with the `coupled` stage, whose draw is keyed by
//!   `(seed, step, token)`. The tokens are those of one-by-one sampling
//!   whatever the drafter proposed; a drafter drawing with the same keys
//!   proposes them as often as the two distributions allow.

use crate::buffer::TokenBuffer;
use crate::error::{LogitsError, SampleError};
use crate::input::StepLogits;
use crate::logits;
use crate::rng::StepRng;
use crate::sequence::Sequence;
use crate::sparse;
use crate::step::{self, NoDeferral, ProbsRequest, StepOutput};

/// The rule that accepts or rejects a draft token.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Mode {
    Exact,
    Rejection,
    Coupled,
}

impl Mode {
    /// The terminal stages the rule needs (`None`: any).
    pub fn terminals(self) -> Option<&'static [&'static str]> {
        match self {
            Mode::Exact => None,
            Mode::Rejection => Some(&["dist", "coupled"]),
            Mode::Coupled => Some(&["coupled"]),
        }
    }

    /// The protocol's name of the mode.
    pub fn name(self) -> &'static str {
        match self {
            Mode::Exact => "VERIFY_MODE_EXACT",
            Mode::Rejection => "VERIFY_MODE_REJECTION",
            Mode::Coupled => "VERIFY_MODE_COUPLED",
        }
    }
}

/// What to verify.
#[derive(Clone, Copy, Debug)]
pub struct Draft<'a> {
    /// The K draft tokens.
    pub tokens: &'a [u32],
    /// K + 1 target rows: row `j` is the target's logits after the
    /// sequence and drafts `0..j`.
    pub target: &'a [StepLogits<'a>],
    /// REJECTION only: the drafter's K rows (row `j` produced draft `j`).
    pub drafter: &'a [StepLogits<'a>],
}

/// The outcome: `accepted` drafts, then `tokens` (`accepted + 1`
/// entries: the accepted drafts, then the correction or the bonus token),
/// token `j` at step `first_step + j`.
#[derive(Clone, Debug, PartialEq)]
pub struct Verified {
    pub accepted: usize,
    pub tokens: Vec<StepOutput>,
}

/// Which of the request's rows an error is about.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Row {
    Target(usize),
    Drafter(usize),
}

impl std::fmt::Display for Row {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Row::Target(i) => write!(f, "target_rows[{i}]"),
            Row::Drafter(i) => write!(f, "drafter_rows[{i}]"),
        }
    }
}

/// Why a verification failed.
#[derive(Debug, thiserror::Error)]
pub enum VerifyError {
    /// The rows or drafts do not fit together (the server's validation
    /// refuses these first, naming the request's fields).
    #[error("{0}")]
    Shape(String),
    #[error(
        "{} needs a chain that ends with {}; this chain ends with `{got}`",
        mode.name(),
        mode.terminals().unwrap_or_default().join(" or ")
    )]
    Terminal { mode: Mode, got: String },
    #[error("{row}: {source}")]
    Logits { row: Row, source: LogitsError },
    #[error("{row}: {source}")]
    Sample { row: Row, source: SampleError },
}

/// Checks that `seq`'s chain suits `mode` (its terminal stage).
pub fn check_chain(seq: &Sequence, mode: Mode) -> Result<(), VerifyError> {
    let Some(want) = mode.terminals() else {
        return Ok(());
    };
    let names = seq.chain().stage_names();
    let last = names.last().copied().unwrap_or_default();
    if want.contains(&last) {
        Ok(())
    } else {
        Err(VerifyError::Terminal {
            mode,
            got: last.to_string(),
        })
    }
}

/// Verifies `draft` on `seq` (see the module doc). `buf` holds each
/// target row in turn; `scratch` the drafter's rows (REJECTION). The
/// accepted drafts are accepted into `seq`; the last reported token is
/// not. On an error the drafts accepted before it stay accepted.
#[allow(clippy::too_many_arguments)]
pub fn verify(
    seq: &mut Sequence,
    buf: &mut TokenBuffer,
    scratch: &mut TokenBuffer,
    mode: Mode,
    draft: Draft<'_>,
    seed: u64,
    first_step: u64,
    probs: ProbsRequest,
) -> Result<Verified, VerifyError> {
    let k = draft.tokens.len();
    if draft.target.len() != k + 1 {
        return Err(VerifyError::Shape(format!(
            "{k} draft tokens need {} target rows, got {}",
            k + 1,
            draft.target.len()
        )));
    }
    let want_drafter = if mode == Mode::Rejection { k } else { 0 };
    if draft.drafter.len() != want_drafter {
        return Err(VerifyError::Shape(format!(
            "{} takes {want_drafter} drafter rows, got {}",
            mode.name(),
            draft.drafter.len()
        )));
    }
    check_chain(seq, mode)?;
    // The drafter's chain runs on a copy, so a stage's `apply` side
    // effects on the drafter's rows never reach the target's state.
    let mut drafter_seq = match mode {
        Mode::Rejection if k > 0 => {
            Some(seq.try_clone().map_err(|source| VerifyError::Sample {
                row: Row::Drafter(0),
                source,
            })?)
        }
        _ => None,
    };
    let mut tokens = Vec::with_capacity(k + 1);
    for (j, &logits) in draft.target.iter().enumerate() {
        let step = first_step + j as u64;
        let row = Row::Target(j);
        let proposed = draft.tokens.get(j).copied();
        let out = match (proposed, drafter_seq.as_mut()) {
            (Some(x), Some(dseq)) => {
                // q: the drafter row through the same chain, same step.
                let drow = Row::Drafter(j);
                run_row(
                    dseq,
                    scratch,
                    draft.drafter[j],
                    seed,
                    step,
                    ProbsRequest::default(),
                    drow,
                    |_, chosen| Ok(chosen),
                )?;
                let q = probabilities(scratch);
                run_row(seq, buf, logits, seed, step, probs, row, |buf, _| {
                    Ok(rejection_rule(&probabilities(buf), &q, x, seed, step))
                })
            }
            _ => run_row(seq, buf, logits, seed, step, probs, row, |_, chosen| {
                Ok(chosen)
            }),
        }?;
        let token = out.token_id;
        tokens.push(out);
        if proposed != Some(token) {
            break;
        }
        seq.accept(token)
            .map_err(|source| VerifyError::Sample { row, source })?;
        if let Some(dseq) = drafter_seq.as_mut() {
            dseq.accept(token).map_err(|source| VerifyError::Sample {
                row: Row::Drafter(j),
                source,
            })?;
        }
    }
    Ok(Verified {
        accepted: tokens.len() - 1,
        tokens,
    })
}

/// One step of `seq` over `logits` (loaded into `buf`), `choose` picking
/// the reported token from the chain's result: [`step::run_choosing`] for
/// a dense row, [`sparse::run_choosing`] for a sparse one. Errors name
/// `row`.
#[allow(clippy::too_many_arguments)]
fn run_row(
    seq: &mut Sequence,
    buf: &mut TokenBuffer,
    logits: StepLogits<'_>,
    seed: u64,
    step: u64,
    probs: ProbsRequest,
    row: Row,
    choose: impl FnOnce(&TokenBuffer, u32) -> Result<u32, SampleError>,
) -> Result<StepOutput, VerifyError> {
    match logits {
        StepLogits::Dense(logits) => {
            let lse = step::load::<NoDeferral>(buf, logits, None)
                .map_err(|source| VerifyError::Logits { row, source })?;
            step::run_choosing(seq, buf, logits, lse, seed, step, probs, choose)
        }
        StepLogits::Sparse(r) => sparse::run_choosing(seq, buf, r, seed, step, probs, choose),
    }
    .map_err(|source| VerifyError::Sample { row, source })
}

/// The post-chain distribution of `buf` as (id, probability) in
/// ascending id order, computed as [`TokenBuffer::distribution`] does
/// (softmax over the survivors, sum in f64).
fn probabilities(buf: &TokenBuffer) -> Vec<(u32, f64)> {
    let max = buf
        .survivors()
        .fold(f32::NEG_INFINITY, |m, (_, l)| m.max(l));
    if max == f32::NEG_INFINITY {
        return Vec::new();
    }
    let mut p: Vec<(u32, f64)> = buf
        .survivors()
        .map(|(id, l)| (id, logits::exp_f32(l - max) as f64))
        .collect();
    let sum: f64 = p.iter().map(|e| e.1).sum();
    for e in &mut p {
        e.1 /= sum;
    }
    p.sort_unstable_by_key(|e| e.0);
    p
}

fn prob_of(dist: &[(u32, f64)], id: u32) -> f64 {
    dist.binary_search_by_key(&id, |e| e.0)
        .map_or(0.0, |i| dist[i].1)
}

/// REJECTION at one step: `x` if `u · q(x) < p(x)` (`u` the first
/// verification uniform, so a draft with `q(x) = 0` is accepted iff
/// `p(x) > 0`), else the draw from `norm(max(0, p − q))` with the second
/// uniform, in ascending id order (from `p` itself should the residual
/// vanish in rounding).
fn rejection_rule(p: &[(u32, f64)], q: &[(u32, f64)], x: u32, seed: u64, step: u64) -> u32 {
    let mut rng = StepRng::verification(seed, step);
    let u = rng.uniform_f64();
    let (px, qx) = (prob_of(p, x), prob_of(q, x));
    if u * qx < px {
        return x;
    }
    let residual: Vec<(u32, f64)> = p
        .iter()
        .map(|&(id, pi)| (id, (pi - prob_of(q, id)).max(0.0)))
        .collect();
    let total: f64 = residual.iter().map(|e| e.1).sum();
    let (weights, total) = if total > 0.0 {
        (residual, total)
    } else {
        (p.to_vec(), p.iter().map(|e| e.1).sum())
    };
    let target = rng.uniform_f64() * total;
    let mut run = 0.0;
    let mut last = x;
    for (id, w) in weights {
        if w > 0.0 {
            run += w;
            last = id;
            if run > target {
                return id;
            }
        }
    }
    last
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rejection_rule_keeps_a_draft_the_target_likes_more() {
        // p(x) >= q(x): always accepted, whatever the uniform.
        let p = [(0, 0.2), (1, 0.8)];
        let q = [(0, 0.5), (1, 0.5)];
        for step in 0..200 {
            assert_eq!(rejection_rule(&p, &q, 1, 7, step), 1);
        }
    }

    #[test]
    fn rejection_rule_never_returns_what_the_target_excludes() {
        // p(0) = 0: the draft 0 is always rejected, the correction is 1.
        let p = [(1, 0.6), (2, 0.4)];
        let q = [(0, 0.9), (1, 0.1)];
        for step in 0..200 {
            let t = rejection_rule(&p, &q, 0, 3, step);
            assert!(t == 1 || t == 2, "{t}");
        }
    }
}
