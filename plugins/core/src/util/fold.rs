//! Max and sum folds: the slice and chunk folds are `samplerd_numerics`'s
//! (one implementation for the stages and the host), re-exported; the
//! candidate-list max is here.

use samplerd_plugin_sdk::prelude::*;

pub use samplerd_numerics::fold::{chunk_max, chunk_maxima, fmax, max_scan, sum_chunk};

/// The largest logit of `cands` (AVX-512: the pairs split in registers).
pub fn candidates_max(cands: &[SdCandidate]) -> f32 {
    #[cfg(target_arch = "x86_64")]
    if samplerd_numerics::features().avx512f() {
        // SAFETY: the CPU supports AVX-512F (checked just above).
        return unsafe { candidates_max_avx512(cands) };
    }
    cands
        .iter()
        .fold(f32::NEG_INFINITY, |m, c| fmax(m, c.logit))
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
unsafe fn candidates_max_avx512(cands: &[SdCandidate]) -> f32 {
    use std::arch::x86_64::*;
    let src = cands.as_ptr().cast::<f32>();
    let odd = _mm512_setr_epi32(1, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23, 25, 27, 29, 31);
    let mut m = _mm512_set1_ps(f32::NEG_INFINITY);
    let full = cands.len() / 16 * 16;
    let mut i = 0;
    while i < full {
        // SAFETY: pairs i..i + 16 are in bounds (32 f32).
        let l = unsafe {
            _mm512_permutex2var_ps(
                _mm512_loadu_ps(src.add(2 * i)),
                odd,
                _mm512_loadu_ps(src.add(2 * i + 16)),
            )
        };
        m = _mm512_max_ps(m, l);
        i += 16;
    }
    cands[full..]
        .iter()
        .fold(_mm512_reduce_max_ps(m), |m, c| fmax(m, c.logit))
}
