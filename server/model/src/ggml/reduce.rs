//! Horizontal sums of vector lanes in the orders of ggml's reductions.

/// Horizontal sum of 16 lanes in GCC's `_mm512_reduce_add_ps` order.
#[inline(always)]
pub(crate) fn reduce16(v: &[f32; 16]) -> f32 {
    let mut t3 = [0f32; 8];
    for k in 0..8 {
        t3[k] = v[8 + k] + v[k];
    }
    let mut t6 = [0f32; 4];
    for m in 0..4 {
        t6[m] = t3[4 + m] + t3[m];
    }
    (t6[0] + t6[2]) + (t6[1] + t6[3])
}

/// Horizontal sum of 8 lanes: `hi128 + lo128`, then `(v0+v2) + (v1+v3)`
/// (ggml's `hsum_float_8` / tinyBLAS `hsum`; also the weight products' final
/// sum, `quant`).
#[inline(always)]
pub(crate) fn hsum8(v: &[f32; 8]) -> f32 {
    let t = [v[4] + v[0], v[5] + v[1], v[6] + v[2], v[7] + v[3]];
    (t[0] + t[2]) + (t[1] + t[3])
}

/// [`hsum8`] of the first 8 of 16 lanes.
#[inline(always)]
pub(crate) fn reduce8(v: &[f32; 16]) -> f32 {
    hsum8(v.first_chunk().expect("16 lanes"))
}

/// GGML_F16_VEC_REDUCE: `x0+x2`, `x1+x3`, then `x0+x1`, then horizontal.
#[inline(always)]
pub(crate) fn reduce_vec_dot(l: &[f32; 64], w: usize) -> f64 {
    let mut x = [0f32; 16];
    for e in 0..w {
        let x0 = l[e] + l[2 * w + e];
        let x1 = l[w + e] + l[3 * w + e];
        x[e] = x0 + x1;
    }
    if w == 16 {
        reduce16(&x) as f64
    } else {
        // GGML_F32x8_REDUCE: t = lo128 + hi128; hadd(hadd(t, t), t)[0].
        let t = [x[0] + x[4], x[1] + x[5], x[2] + x[6], x[3] + x[7]];
        ((t[0] + t[1]) + (t[2] + t[3])) as f64
    }
}

/// [`hsum8`] of a register (ggml's `hsum_float_8`).
#[cfg(target_arch = "x86_64")]
#[inline(always)]
pub(crate) unsafe fn hsum(v: std::arch::x86_64::__m256) -> f32 {
    use std::arch::x86_64::*;
    // SAFETY: callers run with avx2 enabled (target_feature functions).
    unsafe {
        let s = _mm_add_ps(_mm256_extractf128_ps(v, 1), _mm256_castps256_ps128(v));
        let s = _mm_add_ps(s, _mm_movehl_ps(s, s));
        let s = _mm_add_ss(s, _mm_movehdup_ps(s));
        _mm_cvtss_f32(s)
    }
}
