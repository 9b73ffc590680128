//! The one vectorisable `exp`: Cephes' `expf` polynomial, branch-free so
//! that loops over it vectorise (libm's `expf` is a scalar call), and its
//! AVX-512 form, operation for operation the same (no fused multiply-adds:
//! Rust never contracts `a * b + c`), so both give the same bits.
//!
//! Measured error against the exact exponential (f64 `exp`), over every
//! 7th f32 in [`consts::LO`, `consts::HI`] where the result is a normal
//! f32: at most 8.2e-8 relative (1.4 · 2^-24; measured 2026-12-01 by the
//! `measured_error_bound` test, which holds it to [`MAX_REL_ERR`] =
//! 2^-23). libm's `expf` is within about 0.5 ulp of exact, so the two
//! differ by under 2 ulp.

/// A bound on `|exp(x) - e^x| / e^x` where `e^x` is a normal f32: 2^-23,
/// above the measured 8.2e-8 (see the module docs).
pub const MAX_REL_ERR: f64 = 1.0 / 8_388_608.0;

/// The constants of [`exp`] (Cephes `expf`), shared with the AVX-512 form
/// and with approximations built on the same range reduction.
pub mod consts {
    pub const LOG2E: f32 = std::f32::consts::LOG2_E;
    /// 1.5 * 2^23: round-to-nearest trick.
    pub const MAGIC: f32 = 12_582_912.0;
    /// ln 2 split in two for the range reduction.
    pub const C1: f32 = 0.693_359_4;
    pub const C2: f32 = -2.121_944_4e-4;
    /// Input range: below LO the result flushes to 0.
    pub const LO: f32 = -87.336_55;
    pub const HI: f32 = 88.376_26;
    /// Polynomial coefficients, highest degree first.
    pub const P: [f32; 6] = [
        1.987_569_1e-4,
        1.398_199_9e-3,
        8.333_452e-3,
        4.166_579_6e-2,
        1.666_666_5e-1,
        0.5,
    ];
}

/// `exp(x)` for f32 within [`MAX_REL_ERR`] (measured), branch-free so loops
/// over it vectorise. `exp(-inf) = 0`, and results below e^-87.3 (~1e-38)
/// flush to 0 instead of becoming subnormal; inputs above 88.38 give
/// e^88.38.
#[inline(always)]
pub fn exp(x: f32) -> f32 {
    use consts::*;
    let under = x < LO;
    let xc = if x > HI {
        HI
    } else if under {
        LO
    } else {
        x
    };
    let t = xc * LOG2E + MAGIC;
    let n_bits = t.to_bits() as i32 - MAGIC.to_bits() as i32; // round(x*log2e)
    let n = t - MAGIC;
    let r = xc - n * C1 - n * C2;
    let mut y = P[0];
    for c in &P[1..] {
        y = y * r + c;
    }
    y = y * r * r + r + 1.0;
    let scale = f32::from_bits(((n_bits + 127) as u32) << 23);
    if under { 0.0 } else { y * scale }
}

/// [`exp`] on 16 lanes with AVX-512F intrinsics.
#[cfg(target_arch = "x86_64")]
pub mod avx512 {
    use std::arch::x86_64::*;

    use super::consts::*;

    /// [`exp`](super::exp) of 16 lanes `x <= 0` (as after subtracting the
    /// max; only the lower clamp is applied), bit for bit: the same
    /// operations in the same order, unfused.
    ///
    /// # Safety
    /// The CPU must support AVX-512F (the caller runs with it enabled).
    #[inline(always)]
    pub unsafe fn exp16_nonpositive(x: __m512) -> __m512 {
        // SAFETY: register-only AVX-512F operations; the caller guarantees
        // AVX-512F.
        unsafe {
            let lo = _mm512_set1_ps(LO);
            let magic = _mm512_set1_ps(MAGIC);
            let magic_bits = _mm512_set1_epi32(MAGIC.to_bits() as i32);
            let under = _mm512_cmp_ps_mask::<_CMP_LT_OQ>(x, lo);
            let xc = _mm512_max_ps(x, lo);
            let t = _mm512_add_ps(_mm512_mul_ps(xc, _mm512_set1_ps(LOG2E)), magic);
            let n_bits = _mm512_sub_epi32(_mm512_castps_si512(t), magic_bits);
            let n = _mm512_sub_ps(t, magic);
            let r = _mm512_sub_ps(
                _mm512_sub_ps(xc, _mm512_mul_ps(n, _mm512_set1_ps(C1))),
                _mm512_mul_ps(n, _mm512_set1_ps(C2)),
            );
            let mut y = _mm512_set1_ps(P[0]);
            for &c in &P[1..] {
                y = _mm512_add_ps(_mm512_mul_ps(y, r), _mm512_set1_ps(c));
            }
            y = _mm512_add_ps(
                _mm512_add_ps(_mm512_mul_ps(_mm512_mul_ps(y, r), r), r),
                _mm512_set1_ps(1.0),
            );
            let scale = _mm512_castsi512_ps(_mm512_slli_epi32::<23>(_mm512_add_epi32(
                n_bits,
                _mm512_set1_epi32(127),
            )));
            _mm512_maskz_mul_ps(!under, y, scale)
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The worst relative error of [`exp`] against f64 over every `step`-th
    /// f32 in [LO, HI] whose exact result is a normal f32.
    fn worst_error(step: u32) -> f64 {
        let mut worst = 0.0f64;
        let mut check = |x: f32| {
            let want = (x as f64).exp();
            if want >= f32::MIN_POSITIVE as f64 {
                worst = worst.max(((exp(x) as f64 - want) / want).abs());
            }
        };
        // negative floats: bit patterns from -0.0 up to LO
        let (mut b, top) = (0x8000_0000u32, consts::LO.to_bits());
        while b <= top {
            check(f32::from_bits(b));
            b += step;
        }
        let (mut b, top) = (0u32, consts::HI.to_bits());
        while b <= top {
            check(f32::from_bits(b));
            b += step;
        }
        worst
    }

    #[test]
    fn measured_error_bound() {
        let worst = worst_error(7);
        eprintln!("exp: worst relative error {worst:e} (bound {MAX_REL_ERR:e})");
        assert!(worst <= MAX_REL_ERR, "worst {worst:e}");
    }

    #[test]
    fn edges() {
        assert_eq!(exp(f32::NEG_INFINITY), 0.0);
        assert_eq!(exp(-100.0), 0.0);
        assert_eq!(exp(0.0), 1.0);
        assert_eq!(exp(-0.0), 1.0);
        assert!(exp(consts::LO) > 0.0);
    }

    #[cfg(target_arch = "x86_64")]
    #[test]
    fn avx512_form_is_bit_identical() {
        if !crate::features().avx512f() {
            return;
        }
        #[target_feature(enable = "avx512f")]
        fn run(xs: &[f32; 16]) -> [f32; 16] {
            use std::arch::x86_64::*;
            let mut out = [0.0f32; 16];
            // SAFETY: 16 floats in and out; AVX-512F is enabled here.
            unsafe {
                let e = avx512::exp16_nonpositive(_mm512_loadu_ps(xs.as_ptr()));
                _mm512_storeu_ps(out.as_mut_ptr(), e);
            }
            out
        }
        let mut b = 0x8000_0000u32;
        let top = 0xC2B0_0000u32; // -88.0
        while b <= top {
            let xs: [f32; 16] =
                std::array::from_fn(|j| f32::from_bits((b + 613 * j as u32).min(top)));
            // SAFETY: AVX-512F checked above.
            let got = unsafe { run(&xs) };
            for (x, g) in xs.iter().zip(got) {
                assert_eq!(g.to_bits(), exp(*x).to_bits(), "x = {x}");
            }
            b += 613 * 16;
        }
        let xs = [f32::NEG_INFINITY; 16];
        // SAFETY: as above.
        assert_eq!(unsafe { run(&xs) }, [0.0; 16]);
    }
}
