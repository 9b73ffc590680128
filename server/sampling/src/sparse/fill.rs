//! The token buffer for a sparse row: the sent entries by id, loaded as a
//! candidate view, or the whole row with the unsent tokens at one value
//! (see [`super::proof::Layout`]).

use samplerd_plugin_sdk::abi::SdCandidate;

use super::row::SparseRow;
use crate::buffer::TokenBuffer;
use crate::error::LogitsError;

/// The row's entries by ascending id (−∞ ones included). Ids sent in
/// ascending order are copied as they are; others are sorted (ids are
/// unique, so the order is total).
pub(crate) fn by_id(row: SparseRow<'_>) -> Vec<SdCandidate> {
    let mut out: Vec<SdCandidate> = row
        .ids()
        .iter()
        .zip(row.values())
        .map(|(&id, &logit)| SdCandidate { id, logit })
        .collect();
    if !row.ascending() {
        out.sort_unstable_by_key(|c| c.id);
    }
    out
}

/// The sent entries above −∞ as a candidate view in id order (what
/// `materialize` would make of the dense row, less the unsent tokens).
pub(crate) fn candidates(
    buf: &mut TokenBuffer,
    row: SparseRow<'_>,
    by_id: &[SdCandidate],
) -> Result<(), LogitsError> {
    if by_id.iter().all(|c| c.logit > f32::NEG_INFINITY) {
        return buf.load_candidates(row.n_vocab(), by_id, false);
    }
    let live: Vec<SdCandidate> = by_id
        .iter()
        .copied()
        .filter(|c| c.logit > f32::NEG_INFINITY)
        .collect();
    buf.load_candidates(row.n_vocab(), &live, false)
}

/// The value every unsent token takes in the dense layout: their
/// log-sum-exp spread evenly, `rest − ln(unsent)` rounded to f32, never
/// above `bound` (−∞ when the rest is).
pub(crate) fn unsent_value(row: SparseRow<'_>) -> f32 {
    if row.unsent() == 0 || row.rest_lse() == f64::NEG_INFINITY {
        return f32::NEG_INFINITY;
    }
    let v = (row.rest_lse() - (row.unsent() as f64).ln()) as f32;
    v.min(row.unsent_bound())
}

/// The whole row, dense: every unsent token at [`unsent_value`], the sent
/// ones in place.
pub(crate) fn dense(
    buf: &mut TokenBuffer,
    row: SparseRow<'_>,
    by_id: &[SdCandidate],
) -> Result<(), LogitsError> {
    let fill = unsent_value(row);
    buf.load_with(row.n_vocab(), |dense| {
        dense.fill(fill);
        for c in by_id {
            dense[c.id as usize] = c.logit;
        }
    })
}
