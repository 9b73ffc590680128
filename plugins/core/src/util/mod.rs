//! Shared helpers of the built-in stages, by subject: parameter validation
//! (`params`), max and sum folds (`fold`, over `samplerd_numerics::fold`),
//! the vectorisable exp (`samplerd_numerics::exp`) and the dense exp
//! passes (`exp`), SIMD compare filters (`masks`) and the
//! candidate view (`candidates`). Everything is re-exported here, so
//! stages write `util::max_scan`, `util::exp_f32`, ...

mod candidates;
mod exp;
mod fold;
mod masks;
mod params;

pub use candidates::{desc, max_logit, softmax_into, sort_candidates, to_candidates};
pub use exp::{exp_consts, exp_f32, exp_shifted, exp_shifted_candidates};
pub use fold::{candidates_max, chunk_max, chunk_maxima, max_scan, sum_chunk};
pub use masks::{ge_mask, indices_at_least, sign_mask, sum_at_least};
pub use params::{integer, min_keep, non_negative, number, number_in, unit_interval};

/// Scan granularity of the dense helpers: 64 floats = 4 cache lines.
pub use samplerd_numerics::fold::CHUNK;

/// Candidate lists at most this long are sorted outright by the stages that
/// would otherwise leave a large result unsorted (top_p, top_n_sigma).
pub const SORT_LIMIT: usize = 1024;

/// `new`, the result of arithmetic on the logit `old`, kept finite: a finite
/// logit must not overflow to +inf (which poisons every later softmax: inf -
/// inf = NaN) nor to -inf (which would mask the token); a masked logit
/// (`old` = -inf) stays masked. Found by fuzzing (fuzz/fuzz_targets/chain.rs).
#[inline(always)]
pub fn saturate(old: f32, new: f32) -> f32 {
    if old == f32::NEG_INFINITY {
        old
    } else {
        new.clamp(-f32::MAX, f32::MAX)
    }
}
