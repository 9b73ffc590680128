//! ggml's vectorised `expf` (`ggml_v_expf`) and the SwiGLU activation built on it.
//!
//! One lane at a time (`expf_lane`, the reference) and eight lanes in AVX2
//! registers (`expf8`, the same operations, so the same bits).

use super::flavor::{Flavor, has_fma};

/// `ggml_v_expf`'s constants ([`expf_lane`] and [`expf8`] use them).
mod expf_consts {
    pub(super) const R: u32 = 0x4b40_0000; // 0x1.8p23
    pub(super) const LOG2E: u32 = 0x3fb8_aa3b; // 0x1.715476p+0
    pub(super) const LN2_LO: u32 = 0x35bf_be8e; // 0x1.7f7d1cp-20
    pub(super) const LN2_HI: u32 = 0x3f31_7200; // 0x1.62e4p-1
    pub(super) const C5: u32 = 0x3c07_2010; // 0x1.0e4020p-7
    pub(super) const C4: u32 = 0x3d2b_9f17; // 0x1.573e2ep-5
    pub(super) const C3: u32 = 0x3e2a_af33; // 0x1.555e66p-3
    pub(super) const C2: u32 = 0x3eff_fedb; // 0x1.fffdb6p-2
    pub(super) const C1: u32 = 0x3f7f_fff6; // 0x1.ffffecp-1
}
use expf_consts::*;

#[inline(always)]
fn f(b: u32) -> f32 {
    f32::from_bits(b)
}

/// `2^n` as f64 for an integral `n` in [-1022, 1023].
#[inline(always)]
fn pow2(n: f32) -> f64 {
    f64::from_bits(((n as i64 + 1023) as u64) << 52)
}

/// `j * 2^n` rounded once (AVX-512 `scalef`, and the AVX2 far-range path).
#[inline(always)]
fn scale2(j: f32, n: f32) -> f32 {
    if (-125.0..=127.0).contains(&n) {
        j * f32::from_bits(((n as i32 + 127) as u32) << 23) // exact power of two
    } else {
        (j as f64 * pow2(n)) as f32
    }
}

/// ggml's `ggml_v_expf`, one lane.
#[inline(always)]
pub(crate) fn expf_lane(x: f32, fl: Flavor) -> f32 {
    let r = f(R);
    let z = x.mul_add(f(LOG2E), r);
    let n = z - r;
    let b = (-n).mul_add(f(LN2_LO), (-n).mul_add(f(LN2_HI), x));
    let u = b * b;
    let p = f(C5).mul_add(b, f(C4)).mul_add(u, f(C3).mul_add(b, f(C2)));
    // Out of range (both flavours): overflow, underflow or NaN.
    if n.abs() > 192.0 || n.is_nan() {
        return if x > 0.0 {
            f32::INFINITY
        } else if x.is_nan() {
            x
        } else {
            0.0
        };
    }
    match fl {
        Flavor::Avx512 => {
            let j = p.mul_add(u, f(C1).mul_add(b, 1.0));
            scale2(j, n)
        }
        Flavor::Avx2 => {
            let j = p.mul_add(u, f(C1) * b);
            if n.abs() > 126.0 {
                return ((j as f64 + 1.0) * pow2(n)) as f32;
            }
            let k = f32::from_bits(((n as i32 + 127) as u32) << 23); // exact power of two
            j.mul_add(k, k)
        }
    }
}

/// `ggml_vec_swiglu_f32`: `out = silu(g) * u` (vector lanes; the scalar
/// tail, never hit for multiples of 8/16, uses libm like ggml).
pub fn swiglu(g: &[f32], u: &[f32], out: &mut [f32], fl: Flavor) {
    #[cfg(target_arch = "x86_64")]
    if has_fma() {
        // SAFETY: `has_fma()` checked that the CPU supports avx2 and fma.
        unsafe { swiglu_fma(g, u, out, fl) };
        return;
    }
    swiglu_body(g, u, out, fl)
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
unsafe fn swiglu_fma(g: &[f32], u: &[f32], out: &mut [f32], fl: Flavor) {
    // SAFETY: avx2 and fma are enabled in this function.
    unsafe { swiglu_vec(g, u, out, fl) }
}

#[inline(always)]
fn swiglu_body(g: &[f32], u: &[f32], out: &mut [f32], fl: Flavor) {
    let w = fl.lanes();
    let nv = g.len() / w * w;
    for i in 0..nv {
        let x = g[i];
        let e = expf_lane(0.0 - x, fl);
        out[i] = (x / (1.0 + e)) * u[i];
    }
    swiglu_tail(g, u, out, nv);
}

/// The scalar tail of [`swiglu`] from `from` on.
#[inline(always)]
fn swiglu_tail(g: &[f32], u: &[f32], out: &mut [f32], from: usize) {
    for i in from..g.len() {
        let x = g[i];
        out[i] = (x / (1.0 + (-x).exp())) * u[i];
    }
}

/// [`swiglu_body`] eight lanes at a time ([`expf8`]; the same operations,
/// so the same bits: tested below).
#[cfg(target_arch = "x86_64")]
#[inline(always)]
unsafe fn swiglu_vec(g: &[f32], u: &[f32], out: &mut [f32], fl: Flavor) {
    use std::arch::x86_64::*;
    let nv = g.len() / fl.lanes() * fl.lanes();
    assert!(u.len() >= g.len() && out.len() >= g.len());
    let mut i = 0;
    while i < nv {
        // SAFETY: avx2 and fma are enabled by the caller; `i + 8 <= nv`,
        // inside all three slices (asserted above).
        unsafe {
            let x = _mm256_loadu_ps(g.as_ptr().add(i));
            let e = expf8(_mm256_sub_ps(_mm256_setzero_ps(), x), fl);
            let s = _mm256_div_ps(x, _mm256_add_ps(_mm256_set1_ps(1.0), e));
            let y = _mm256_mul_ps(s, _mm256_loadu_ps(u.as_ptr().add(i)));
            _mm256_storeu_ps(out.as_mut_ptr().add(i), y);
        }
        i += 8;
    }
    swiglu_tail(g, u, out, nv);
}

/// [`expf_lane`] on eight lanes: the common range in vectors, the
/// rare far-range lanes (|n| > 126, overflow, NaN) through the scalar
/// lane function.
#[cfg(target_arch = "x86_64")]
#[inline(always)]
pub(crate) unsafe fn expf8(x: std::arch::x86_64::__m256, fl: Flavor) -> std::arch::x86_64::__m256 {
    use expf_consts as c;
    use std::arch::x86_64::*;
    // SAFETY: avx2 and fma are enabled in every caller.
    unsafe {
        let f = |b: u32| _mm256_set1_ps(f32::from_bits(b));
        let r = f(c::R);
        let z = _mm256_fmadd_ps(x, f(c::LOG2E), r);
        let n = _mm256_sub_ps(z, r);
        let b = _mm256_fnmadd_ps(n, f(c::LN2_LO), _mm256_fnmadd_ps(n, f(c::LN2_HI), x));
        let u = _mm256_mul_ps(b, b);
        let p = _mm256_fmadd_ps(
            _mm256_fmadd_ps(f(c::C5), b, f(c::C4)),
            u,
            _mm256_fmadd_ps(f(c::C3), b, f(c::C2)),
        );
        let k = _mm256_castsi256_ps(_mm256_slli_epi32(
            _mm256_add_epi32(_mm256_cvttps_epi32(n), _mm256_set1_epi32(127)),
            23,
        ));
        let (y, ok) = match fl {
            Flavor::Avx2 => {
                let j = _mm256_fmadd_ps(p, u, _mm256_mul_ps(f(c::C1), b));
                let abs = _mm256_andnot_ps(_mm256_set1_ps(-0.0), n);
                (
                    _mm256_fmadd_ps(j, k, k),
                    _mm256_cmp_ps(abs, _mm256_set1_ps(126.0), _CMP_LE_OQ),
                )
            }
            Flavor::Avx512 => {
                let j = _mm256_fmadd_ps(p, u, _mm256_fmadd_ps(f(c::C1), b, _mm256_set1_ps(1.0)));
                let lo = _mm256_cmp_ps(n, _mm256_set1_ps(-125.0), _CMP_GE_OQ);
                let hi = _mm256_cmp_ps(n, _mm256_set1_ps(127.0), _CMP_LE_OQ);
                (_mm256_mul_ps(j, k), _mm256_and_ps(lo, hi))
            }
        };
        if _mm256_movemask_ps(ok) == 0xff {
            return y;
        }
        let (mut xs, mut ys) = ([0f32; 8], [0f32; 8]);
        _mm256_storeu_ps(xs.as_mut_ptr(), x);
        _mm256_storeu_ps(ys.as_mut_ptr(), y);
        let okm = _mm256_movemask_ps(ok);
        for e in 0..8 {
            if okm & (1 << e) == 0 {
                ys[e] = expf_lane(xs[e], fl);
            }
        }
        _mm256_loadu_ps(ys.as_ptr())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn expf_is_close_to_libm() {
        for fl in [Flavor::Avx512, Flavor::Avx2] {
            for i in -2000..2000 {
                let x = i as f32 * 0.05;
                let (a, b) = (expf_lane(x, fl), x.exp());
                let ok = if b.is_infinite() {
                    a == b
                } else if b > 1e-30 {
                    ((a - b) / b).abs() < 1e-6
                } else {
                    (a - b).abs() < 1e-36
                };
                assert!(ok, "{fl:?} exp({x}) = {a}, libm {b}");
            }
            assert_eq!(expf_lane(f32::NEG_INFINITY, fl), 0.0);
        }
    }

    /// The vectorised SwiGLU equals the lane-by-lane one bit for bit, in
    /// both orders, over the whole range of the exponential (including the
    /// far-range lanes and the scalar tail).
    #[test]
    fn swiglu_vectors_equal_lanes() {
        let mut r = crate::test_rng::Lcg(3);
        for fl in [Flavor::Avx2, Flavor::Avx512] {
            for n in [8usize, 16, 1536, 1541] {
                let g: Vec<f32> = (0..n)
                    .map(|i| r.f() * if i % 7 == 0 { 200.0 } else { 12.0 })
                    .collect();
                let u: Vec<f32> = (0..n).map(|_| r.f() * 3.0).collect();
                let (mut a, mut b) = (vec![0f32; n], vec![0f32; n]);
                swiglu(&g, &u, &mut a, fl);
                swiglu_body(&g, &u, &mut b, fl);
                let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
                assert_eq!(bits(&a), bits(&b), "{fl:?} n {n}");
            }
        }
    }
}
