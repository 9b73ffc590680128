//! The exps of the large top_p path, importing no sibling: libm's `expf`
//! (the values llama.cpp adds, called only where an approximation cannot
//! decide a rounding), the error bound that both approximations (the
//! portable `exp_f32` and the AVX-512 `exp16x4`) are held to, `exp16x4`
//! itself and the probabilities computed with it (`exp_div`).

/// Bound on `|exp(x) - expf(x)| / expf(x)` for `x <= 0` where `expf(x)` is
/// normal, for both approximations: `exp_f32` (under 2 ulp, 2^-22, on every
/// 97th f32) and the AVX-512 `exp16x4` (2.1e-7 on every f32 in range, the
/// ignored `exp16_every_float` test); this is more than twice each (the
/// `exp_error_bound` tests), so a 1-ulp difference between libm versions
/// still fits. Below e^-87.3 both return 0 and libm a value < 2^-126, far
/// below every grid unit we use.
pub(super) const EXP_REL_ERR: f32 = 1.0 / 2_097_152.0; // 2^-21

/// libm's `expf`, the function llama.cpp calls (never inlined into a
/// vectorised loop, so it stays the real libm call).
#[inline(never)]
pub(super) fn libm_exp(x: f32) -> f32 {
    x.exp()
}

#[cfg(target_arch = "x86_64")]
use std::arch::x86_64::*;

/// Coefficients of `exp16x4`'s polynomial, highest degree first (the
/// constant term is 1, fixed): relative minimax error 9.2e-8 on [-ln2/2,
/// ln2/2], 1.5e-7 evaluated in f32 with fused multiply-adds.
#[cfg(target_arch = "x86_64")]
pub(super) const EXP16_P: [f32; 6] = [
    0.008_290_272,
    0.041_898_16,
    0.166_676_39,
    0.499_991_48,
    0.999_999_7,
    1.0,
];

/// `exp(x)` for `x <= 0` on four registers of 16 lanes: `exp_f32`'s
/// range reduction on fused multiply-adds, a degree-5 polynomial (two
/// degrees below `exp_f32`'s), scaled by `vscalefps` (within
/// [`EXP_REL_ERR`] of libm; tested), the four chains interleaved.
/// Lanes below `LO` (and -inf) give 0; no clamping is needed above, as
/// `x <= 0`.
#[cfg(target_arch = "x86_64")]
#[inline(always)]
pub(super) unsafe fn exp16x4(x: [__m512; 4]) -> [__m512; 4] {
    use samplerd_numerics::exp::consts::{C1, C2, LO, LOG2E, MAGIC as RMAGIC};
    // SAFETY: (the whole body) register-only AVX-512F operations; the
    // caller runs with AVX-512F enabled.
    unsafe {
        let lo = _mm512_set1_ps(LO);
        let rmagic = _mm512_set1_ps(RMAGIC);
        // the lanes that do not flush to 0 (below LO the reduction is
        // garbage, and masked off)
        let keep = x.map(|v| _mm512_cmp_ps_mask::<_CMP_GE_OQ>(v, lo));
        let t = x.map(|v| _mm512_fmadd_ps(v, _mm512_set1_ps(LOG2E), rmagic));
        let n = t.map(|t| _mm512_sub_ps(t, rmagic));
        let mut r = [_mm512_setzero_ps(); 4];
        for k in 0..4 {
            r[k] = _mm512_fnmadd_ps(n[k], _mm512_set1_ps(C1), x[k]);
            r[k] = _mm512_fnmadd_ps(n[k], _mm512_set1_ps(C2), r[k]);
        }
        // a degree-5 polynomial with constant term 1 (relative
        // minimax on [-ln2/2, ln2/2], coefficients from the highest)
        let mut y = [_mm512_set1_ps(EXP16_P[0]); 4];
        for &c in &EXP16_P[1..] {
            for k in 0..4 {
                y[k] = _mm512_fmadd_ps(y[k], r[k], _mm512_set1_ps(c));
            }
        }
        let mut out = [_mm512_setzero_ps(); 4];
        for k in 0..4 {
            // y · 2^n (n is integral; the result is normal for x >= LO)
            out[k] = _mm512_maskz_scalef_ps(keep[k], y[k], n[k]);
        }
        out
    }
}

/// `out[i] = exp(val[i] - max) / z` (the FMA exp of the normaliser pass);
/// returns their sum (f32 lanes).
///
/// # Safety
/// The CPU must support AVX-512F and POPCNT.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,popcnt")]
pub(super) unsafe fn exp_div(val: &[f32], max: f32, z: f32, out: &mut Vec<f32>) -> f32 {
    let n = val.len();
    out.clear();
    out.reserve(n + 64);
    let vmax = _mm512_set1_ps(max);
    let vz = _mm512_set1_ps(z);
    let src = val.as_ptr();
    let dst = out.as_mut_ptr();
    let mut sum = [_mm512_setzero_ps(); 4];
    let mut i = 0;
    while i < n {
        // SAFETY: lanes at or past n are masked off the loads (they read
        // -inf, whose exp is 0); the stores write 64 lanes at i < n, inside
        // the reserved n + 64.
        unsafe {
            let x: [__m512; 4] = std::array::from_fn(|k| {
                let at = i + 16 * k;
                let live = lanes_below(n, at);
                _mm512_mask_loadu_ps(_mm512_set1_ps(f32::NEG_INFINITY), live, src.add(at.min(n)))
            });
            let e = exp16x4(x.map(|x| _mm512_sub_ps(x, vmax)));
            for (k, ek) in e.iter().enumerate() {
                let p = _mm512_div_ps(*ek, vz);
                _mm512_storeu_ps(dst.add(i + 16 * k), p);
                sum[k] = _mm512_add_ps(sum[k], p);
            }
        }
        i += 64;
    }
    // SAFETY: n values were written.
    unsafe { out.set_len(n) };
    let sum = _mm512_add_ps(_mm512_add_ps(sum[0], sum[1]), _mm512_add_ps(sum[2], sum[3]));
    _mm512_reduce_add_ps(sum)
}

/// The mask of lanes `at + j < n`.
#[cfg(target_arch = "x86_64")]
#[inline(always)]
pub(super) fn lanes_below(n: usize, at: usize) -> __mmask16 {
    let live = n.saturating_sub(at).min(16);
    ((1u32 << live) - 1) as __mmask16
}
