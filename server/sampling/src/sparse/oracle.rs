//! The property the sparse step promises, as a check: run a chain over a
//! dense row and over a sparse row that stands for it, and compare. The
//! property tests (`server/sampling/tests/sparse.rs`) and the fuzzer
//! (`fuzz/fuzz_targets/sparse.rs`) drive it with rows built to be
//! consistent (every unsent logit at most the smallest sent one, the
//! rest's log-sum-exp computed from the dense row).

use crate::chain::Chain;
use crate::error::{SampleError, SparseRefusal};
use crate::step::{self, Logits, NoDeferral, ProbsRequest, StepOutput};
use crate::{Sequence, TokenBuffer};

use super::SparseRow;

/// How the two runs compared.
#[derive(Debug)]
pub enum Outcome {
    /// The sparse step answered, and as the dense one did.
    Same(StepOutput),
    /// Both failed alike (the same error).
    BothFailed(SampleError),
    /// The proof refused the sparse row.
    Refused(SparseRefusal),
}

/// The largest difference allowed between the dense and the sparse
/// `logprob` (and a raw candidate's), given the row's log-sum-exp `lse`
/// (the token's logit minus its dense logprob): the dense row's
/// log-sum-exp is the fused scan's f32 sum over every logit, which
/// `scan.rs`'s tests hold to 1e-5 relative of the exact one (its error
/// grows with the row: one f32 rounding per term of a chunk), the sparse
/// one an f64 sum of far fewer terms. Four ulps of the logprob alone, the
/// bound this replaced, failed on a 301-token row at 3.8e-6 apart.
pub fn logprob_tolerance(lse: f32) -> f32 {
    1.5e-6 + 1e-5 * lse.abs().max(1.0)
}

/// Whether a sparse row's value (a logprob, or a raw probability) stands
/// for the dense row's: within `tolerance`, or the same infinity (a token
/// the softmax gives nothing, in both). A difference of infinities is
/// NaN, and an infinite tolerance would let a finite value pass for
/// `-inf`: neither may decide.
pub fn logprobs_agree(dense: f32, sparse: f32, tolerance: f32) -> bool {
    if dense.is_infinite() || sparse.is_infinite() {
        return dense == sparse;
    }
    (dense - sparse).abs() <= tolerance
}

fn sequence(chain: &Chain, window: &[u32]) -> Result<Sequence, SampleError> {
    let mut seq = chain.new_sequence()?;
    seq.accept_history(window)?;
    Ok(seq)
}

/// Runs `chain` (a fresh sequence with `window` accepted) over `dense` and
/// over `row` at (`seed`, `step`) and compares: the token, the post-chain
/// probability and post-chain candidates bit for bit, raw candidates' ids
/// exactly, every log-probability within [`logprob_tolerance`]. `Err`
/// describes the first difference.
pub fn compare(
    chain: &Chain,
    window: &[u32],
    dense: &[f32],
    row: SparseRow<'_>,
    seed: u64,
    step: u64,
    probs: ProbsRequest,
) -> Result<Outcome, String> {
    let mut buf = TokenBuffer::new();
    let want = sequence(chain, window).and_then(|mut seq| {
        let logits = Logits::Floats(dense);
        let lse = step::load::<NoDeferral>(&mut buf, logits, None)?;
        step::run(&mut seq, &mut buf, logits, lse, seed, step, probs)
    });
    let got = sequence(chain, window)
        .and_then(|mut seq| super::run(&mut seq, &mut buf, row, seed, step, probs));
    let (want, got) = match (want, got) {
        (_, Err(SampleError::Sparse(r))) => return Ok(Outcome::Refused(r)),
        (Err(a), Err(b)) if a == b => return Ok(Outcome::BothFailed(a)),
        (Ok(w), Ok(g)) => (w, g),
        (w, g) => return Err(format!("dense {w:?}, sparse {g:?}")),
    };
    // The row's log-sum-exp, from the chosen token's logit and logprob.
    let lse = dense[want.token_id as usize] - want.logprob;
    let tolerance = if lse.is_finite() {
        logprob_tolerance(lse)
    } else {
        0.0
    };
    let close = |a: f32, b: f32| logprobs_agree(a, b, tolerance);
    if want.token_id != got.token_id {
        return Err(format!(
            "token: dense {}, sparse {}",
            want.token_id, got.token_id
        ));
    }
    if want.probability.to_bits() != got.probability.to_bits() {
        return Err(format!(
            "probability: dense {}, sparse {}",
            want.probability, got.probability
        ));
    }
    if !close(want.logprob, got.logprob) {
        return Err(format!(
            "logprob: dense {}, sparse {}",
            want.logprob, got.logprob
        ));
    }
    if want.probs.len() != got.probs.len() {
        return Err(format!(
            "probs: dense {} candidates, sparse {}",
            want.probs.len(),
            got.probs.len()
        ));
    }
    for (i, (w, g)) in want.probs.iter().zip(&got.probs).enumerate() {
        let same_p = if probs.post_sampling {
            w.probability.to_bits() == g.probability.to_bits()
        } else {
            close(w.probability, g.probability)
        };
        if w.token_id != g.token_id || !same_p || !close(w.logprob, g.logprob) {
            return Err(format!("probs[{i}]: dense {w:?}, sparse {g:?}"));
        }
    }
    Ok(Outcome::Same(got))
}

#[cfg(test)]
mod tests {
    use super::logprobs_agree;

    #[test]
    fn equal_infinities_agree_and_nothing_else_passes_for_one() {
        let t = super::logprob_tolerance(-3.0);
        assert!(logprobs_agree(f32::NEG_INFINITY, f32::NEG_INFINITY, t));
        assert!(!logprobs_agree(f32::NEG_INFINITY, -80.0, f32::INFINITY));
        assert!(!logprobs_agree(-80.0, f32::NEG_INFINITY, f32::INFINITY));
        assert!(logprobs_agree(-2.7725906, -2.7725868, t));
        assert!(!logprobs_agree(-3.0, -3.001, t));
        assert!(!logprobs_agree(f32::NAN, f32::NAN, t));
    }
}
