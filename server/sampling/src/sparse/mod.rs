//! Sparse rows: a step's logits as the top of the row — some token ids with
//! their logits — plus the log-sum-exp of every logit that was not sent
//! (vLLM's and llama.cpp's backend sampling keep probabilities exact the
//! same way). The step samples as if the whole row held the sent values,
//! with every unsent logit at most `min(values)` and their log-sum-exp the
//! one given, and answers exactly what the dense row answers — the same
//! token, post-chain `probability` and candidates, bit for bit — or
//! refuses ([`SparseRefusal`]) naming the stage whose outcome could depend
//! on the logits that were not sent.
//!
//! - [`row`]: [`SparseRow`], the checked input.
//! - `rules`: what the proof knows of each stage of the chain.
//! - `proof`: the bound on unsent logits carried to the first stage that
//!   cuts the row (top_k, min_p, top_p, greedy, temperature 0), checked
//!   there against the sent values; after the cut the chain runs on exactly
//!   the dense row's candidates.
//! - `nucleus`: top_p's check while unsent tokens are live.
//! - `fill`: the sent entries into the token buffer.
//! - [`oracle`]: the promise as a check (dense against sparse), for the
//!   property tests and the fuzzer.
//!
//! The raw `logprob` uses the whole row's log-sum-exp, `logaddexp(lse(sent),
//! rest)` in f64 (the dense row's f32 sum differs in its last bits), and so
//! do the raw candidates' probabilities; which candidates and in which
//! order is exact.

mod fill;
mod nucleus;
pub mod oracle;
mod proof;
pub mod row;
mod rules;

use samplerd_plugin_sdk::abi::SdCandidate;

use crate::Sequence;
use crate::TokenBuffer;
use crate::error::{SampleError, SparseRefusal};
use crate::step::{ProbsRequest, StepOutput, report};
pub use row::{SparseRow, SparseRowError};

use proof::{Layout, Proof, count};

/// One step over a sparse row: the proof planned for `seq`'s chain, the
/// row loaded into `buf` as the proof's layout needs, the chain run with
/// the proof checking its deciding stage, and the output as
/// [`crate::step::run`] reports it. Does not accept the token.
pub fn run(
    seq: &mut Sequence,
    buf: &mut TokenBuffer,
    row: SparseRow<'_>,
    seed: u64,
    step: u64,
    probs: ProbsRequest,
) -> Result<StepOutput, SampleError> {
    run_choosing(seq, buf, row, seed, step, probs, |_, chosen| Ok(chosen))
}

/// [`run`], with `choose` deciding the token reported from the buffer as
/// the chain left it (exactly the dense row's survivors once the proof
/// held) and the token the chain chose — `crate::step::run_choosing` for a
/// sparse row, for speculative verification's REJECTION rule.
pub fn run_choosing(
    seq: &mut Sequence,
    buf: &mut TokenBuffer,
    row: SparseRow<'_>,
    seed: u64,
    step: u64,
    probs: ProbsRequest,
    choose: impl FnOnce(&TokenBuffer, u32) -> Result<u32, SampleError>,
) -> Result<StepOutput, SampleError> {
    let by_id = fill::by_id(row);
    let raw_top = if probs.n > 0 && !probs.post_sampling {
        Some(raw_top(row, &by_id, probs.n)?)
    } else {
        None
    };
    let mut proof = Proof::plan(seq.chain(), row, &by_id)?;
    match proof.layout() {
        Layout::Candidates => fill::candidates(buf, row, &by_id)?,
        Layout::Dense => fill::dense(buf, row, &by_id)?,
    }
    let chosen = seq.sample_gated(buf, seed, step, &mut proof)?.token_id;
    let token_id = choose(buf, chosen)?;
    let raw = |id: u32| {
        by_id
            .binary_search_by_key(&id, |c| c.id)
            .map_or(f32::NEG_INFINITY, |i| by_id[i].logit)
    };
    Ok(report(
        buf,
        token_id,
        raw_top,
        probs,
        || row.log_sum_exp() as f32,
        raw,
    ))
}

/// The `n` largest raw logits as (id, logit), descending, ties by id — the
/// dense row's `logits::top_n` — when they are sure to be sent ones: the
/// `n`-th must lie above the bound on every unsent logit.
fn raw_top(
    row: SparseRow<'_>,
    by_id: &[SdCandidate],
    n: usize,
) -> Result<Vec<(u32, f32)>, SparseRefusal> {
    let mut top: Vec<(u32, f32)> = by_id.iter().map(|c| (c.id, c.logit)).collect();
    let by_logit = |a: &(u32, f32), b: &(u32, f32)| b.1.total_cmp(&a.1).then(a.0.cmp(&b.0));
    let m = row.unsent_bound();
    let refuse = |why: String| SparseRefusal {
        stage: None,
        field: Some("n_probs"),
        message: format!("n_probs = {n}: {why}; send more entries or ask for fewer candidates"),
        sent: row.len(),
        entries_needed: Some(n + 1),
    };
    if n > top.len() {
        // Every token is sent only when nothing is unsent: then the top n
        // of the whole row are known (−∞ ones included).
        if m > f32::NEG_INFINITY || row.unsent() > 0 {
            return Err(refuse(format!(
                "more raw candidates than the {} entries sent",
                count(row.len())
            )));
        }
    }
    if n < top.len() {
        top.select_nth_unstable_by(n - 1, by_logit);
        top.truncate(n);
    }
    top.sort_by(by_logit);
    if let Some(&(_, last)) = top.last()
        && row.unsent() > 0
        && last.partial_cmp(&m) != Some(std::cmp::Ordering::Greater)
    {
        return Err(refuse(format!(
            "the {n}th largest sent logit ({last}) does not lie above {m}, the bound on every \
             unsent logit, so unsent tokens may be among the top {n}"
        )));
    }
    Ok(top)
}
