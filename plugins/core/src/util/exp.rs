//! The dense `exp(x - max)` passes over logits or candidates, with the
//! one vectorisable exp ([`exp_f32`], `samplerd_numerics::exp`),
//! bit-identical on every instruction set.

use samplerd_numerics::fold::CHUNK;
use samplerd_plugin_sdk::prelude::*;

use super::fold::sum_chunk;

/// The stages' exp: `samplerd_numerics::exp::exp` (Cephes `expf`, within
/// 2^-23 of exact), under the name the stages use.
pub use samplerd_numerics::exp::consts as exp_consts;
pub use samplerd_numerics::exp::exp as exp_f32;

/// `out = exp(x - max)` over one chunk (a plain map: LLVM vectorises it).
#[inline(always)]
fn exp_chunk(x: &[f32; CHUNK], max: f32, out: &mut [f32; CHUNK]) {
    for (o, &v) in out.iter_mut().zip(x.iter()) {
        *o = exp_f32(v - max);
    }
}

/// `out[i] = exp(x[i] - max)`; returns the sum (8 f32 lanes per chunk of 64,
/// accumulated in f64 across chunks). When `chunk_sums` is given it receives
/// the sum of every chunk (the last one may be partial).
pub fn exp_shifted(x: &[f32], max: f32, out: &mut [f32], chunk_sums: Option<&mut Vec<f64>>) -> f64 {
    #[cfg(target_arch = "x86_64")]
    let cpu = samplerd_numerics::features();
    #[cfg(target_arch = "x86_64")]
    if cpu.avx512f() {
        // SAFETY: the CPU supports AVX-512F (checked just above).
        return unsafe { exp_shifted_avx512(x, max, out, chunk_sums) };
    }
    #[cfg(target_arch = "x86_64")]
    if cpu.avx2() {
        // SAFETY: the CPU supports AVX2 (checked just above).
        return unsafe { exp_shifted_avx2(x, max, out, chunk_sums) };
    }
    exp_shifted_impl(x, max, out, chunk_sums)
}

/// [`exp_shifted`] compiled for AVX2 (8 lanes). Bit-identical to the SSE2
/// build: the same operations in the same order (Rust never contracts
/// mul + add into FMA).
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
unsafe fn exp_shifted_avx2(
    x: &[f32],
    max: f32,
    out: &mut [f32],
    chunk_sums: Option<&mut Vec<f64>>,
) -> f64 {
    exp_shifted_impl(x, max, out, chunk_sums)
}

/// [`exp_shifted`] on 16 lanes with intrinsics: [`exp_f32`]'s operations
/// one for one (separate multiplies and adds, no fused ones) and
/// [`sum_chunk`]'s addition order, so every value and sum is bit-identical
/// to the portable build (a seed draws the same token on every CPU).
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
unsafe fn exp_shifted_avx512(
    x: &[f32],
    max: f32,
    out: &mut [f32],
    chunk_sums: Option<&mut Vec<f64>>,
) -> f64 {
    use std::arch::x86_64::*;
    assert_eq!(x.len(), out.len(), "exp_shifted: lengths differ");
    let src = x.as_ptr();
    // SAFETY: `exp_shifted_avx512_from` loads 16 logits at i only when
    // i + 16 <= x.len().
    let load = |i: usize| unsafe { _mm512_loadu_ps(src.add(i)) };
    // SAFETY: AVX-512F is enabled in this function.
    unsafe { exp_shifted_avx512_from(load, |i| x[i], max, out, chunk_sums) }
}

/// [`exp_shifted`] of the logits of `cands` (in list order), without a
/// copy of them: the pairs are split in registers. The same values and
/// sums as `exp_shifted` over the copied logits.
pub fn exp_shifted_candidates(
    cands: &[SdCandidate],
    max: f32,
    out: &mut [f32],
    scratch: &mut Vec<f32>,
    chunk_sums: Option<&mut Vec<f64>>,
) -> f64 {
    assert_eq!(
        cands.len(),
        out.len(),
        "exp_shifted_candidates: lengths differ"
    );
    #[cfg(target_arch = "x86_64")]
    if samplerd_numerics::features().avx512f() {
        // SAFETY: the CPU supports AVX-512F (checked just above).
        return unsafe { exp_shifted_candidates_avx512(cands, max, out, chunk_sums) };
    }
    scratch.clear();
    scratch.extend(cands.iter().map(|c| c.logit));
    exp_shifted(scratch, max, out, chunk_sums)
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
unsafe fn exp_shifted_candidates_avx512(
    cands: &[SdCandidate],
    max: f32,
    out: &mut [f32],
    chunk_sums: Option<&mut Vec<f64>>,
) -> f64 {
    use std::arch::x86_64::*;
    const _: () = assert!(std::mem::size_of::<SdCandidate>() == 8);
    let src = cands.as_ptr().cast::<f32>();
    let odd = _mm512_setr_epi32(1, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23, 25, 27, 29, 31);
    // SAFETY: `exp_shifted_avx512_from` loads at i only when i + 16 <=
    // cands.len(): 32 f32 of 16 pairs in bounds.
    let load = |i: usize| unsafe {
        let a = _mm512_loadu_ps(src.add(2 * i));
        let b = _mm512_loadu_ps(src.add(2 * i + 16));
        _mm512_permutex2var_ps(a, odd, b)
    };
    // SAFETY: AVX-512F is enabled in this function.
    unsafe { exp_shifted_avx512_from(load, |i| cands[i].logit, max, out, chunk_sums) }
}

/// The body of the AVX-512 `exp_shifted`s: `load(i)` gives the 16 logits
/// from i (called with i + 16 <= out.len()), `get(i)` one logit.
///
/// # Safety
/// The CPU must support AVX-512F.
#[cfg(target_arch = "x86_64")]
#[inline(always)]
unsafe fn exp_shifted_avx512_from(
    load: impl Fn(usize) -> std::arch::x86_64::__m512,
    get: impl Fn(usize) -> f32,
    max: f32,
    out: &mut [f32],
    mut chunk_sums: Option<&mut Vec<f64>>,
) -> f64 {
    use samplerd_numerics::exp::avx512::exp16_nonpositive;
    use std::arch::x86_64::*;
    if let Some(cs) = chunk_sums.as_deref_mut() {
        cs.clear();
    }
    // SAFETY: (the whole body) register-only AVX-512F operations (the caller
    // runs with AVX-512F enabled), and stores checked below.
    unsafe {
        let vmax = _mm512_set1_ps(max);
        // x <= 0 (max is the maximum): the exp's non-positive form
        let exp16 = |v: __m512| exp16_nonpositive(_mm512_sub_ps(v, vmax));
        let n = out.len();
        let mut total = 0.0f64;
        let full = n / CHUNK;
        for ci in 0..full {
            let base = ci * CHUNK;
            let mut acc = _mm512_setzero_ps();
            for k in 0..CHUNK / 16 {
                let e = exp16(load(base + 16 * k));
                // base + 16k + 16 <= n: in bounds
                _mm512_storeu_ps(out.as_mut_ptr().add(base + 16 * k), e);
                acc = if k == 0 { e } else { _mm512_add_ps(acc, e) };
            }
            // sum_chunk's tree: quarters (0 + 2) + (1 + 3), then lanes
            let q0 = _mm512_castps512_ps128(acc);
            let q1 = _mm512_extractf32x4_ps::<1>(acc);
            let q2 = _mm512_extractf32x4_ps::<2>(acc);
            let q3 = _mm512_extractf32x4_ps::<3>(acc);
            let m = _mm_add_ps(_mm_add_ps(q0, q2), _mm_add_ps(q1, q3));
            let h = _mm_add_ps(m, _mm_movehl_ps(m, m));
            let cs = _mm_cvtss_f32(_mm_add_ss(h, _mm_shuffle_ps::<0b01>(h, h))) as f64;
            if let Some(v) = chunk_sums.as_deref_mut() {
                v.push(cs);
            }
            total += cs;
        }
        let base = full * CHUNK;
        let mut cs = 0.0f64;
        for (i, o) in out.iter_mut().enumerate().skip(base) {
            let e = exp_f32(get(i) - max);
            *o = e;
            cs += e as f64;
        }
        if base < n {
            if let Some(v) = chunk_sums {
                v.push(cs);
            }
            total += cs;
        }
        total
    }
}

#[inline(always)]
fn exp_shifted_impl(
    x: &[f32],
    max: f32,
    out: &mut [f32],
    mut chunk_sums: Option<&mut Vec<f64>>,
) -> f64 {
    debug_assert_eq!(x.len(), out.len());
    if let Some(cs) = chunk_sums.as_deref_mut() {
        cs.clear();
    }
    let mut total = 0.0f64;
    let mut xs = x.chunks_exact(CHUNK);
    let mut os = out.chunks_exact_mut(CHUNK);
    for (xc, oc) in (&mut xs).zip(&mut os) {
        let xc: &[f32; CHUNK] = xc.try_into().expect("chunk");
        let oc: &mut [f32; CHUNK] = oc.try_into().expect("chunk");
        exp_chunk(xc, max, oc);
        let cs = sum_chunk(oc) as f64;
        if let Some(v) = chunk_sums.as_deref_mut() {
            v.push(cs);
        }
        total += cs;
    }
    let mut cs = 0.0f64;
    let rem = xs.remainder();
    for (&v, o) in rem.iter().zip(os.into_remainder()) {
        let e = exp_f32(v - max);
        *o = e;
        cs += e as f64;
    }
    if !rem.is_empty() {
        if let Some(v) = chunk_sums {
            v.push(cs);
        }
        total += cs;
    }
    total
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::util::fold::candidates_max;

    #[test]
    fn exp_matches_std_within_a_few_ulp() {
        let mut x = -90.0f32;
        while x < 88.0 {
            let want = x.exp();
            let got = exp_f32(x);
            if want > 1.2e-38 {
                let rel = ((got - want) / want).abs();
                assert!(rel < 4e-7, "exp({x}) = {got}, std {want}");
            } else {
                assert!(got <= 1.2e-38);
            }
            x += 0.01731;
        }
        assert_eq!(exp_f32(f32::NEG_INFINITY), 0.0);
        assert_eq!(exp_f32(0.0), 1.0);
    }

    #[cfg(target_arch = "x86_64")]
    #[test]
    fn exp_shifted_avx512_is_bit_identical() {
        if !samplerd_numerics::features().avx512f() {
            return;
        }
        let mut seed = 0x9E37_79B9_7F4A_7C15u64;
        let mut rnd = move || {
            seed ^= seed << 13;
            seed ^= seed >> 7;
            seed ^= seed << 17;
            (seed >> 11) as f64 / (1u64 << 53) as f64
        };
        for case in 0..60 {
            let n = [1usize, 63, 64, 65, 1000, 4097, 151_936][case % 7];
            let sd = [0.5, 3.0, 20.0, 60.0][case % 4];
            let mut x: Vec<f32> = (0..n).map(|_| ((rnd() - 0.5) * 2.0 * sd) as f32).collect();
            for v in x.iter_mut().step_by(7 + case) {
                *v = f32::NEG_INFINITY;
            }
            let max = x.iter().copied().fold(f32::NEG_INFINITY, f32::max);
            let max = if max == f32::NEG_INFINITY { 0.0 } else { max };
            let (mut a, mut b) = (vec![0.0; n], vec![0.0; n]);
            let (mut ca, mut cb) = (Vec::new(), Vec::new());
            let ta = exp_shifted_impl(&x, max, &mut a, Some(&mut ca));
            // SAFETY: AVX-512F checked above.
            let tb = unsafe { exp_shifted_avx512(&x, max, &mut b, Some(&mut cb)) };
            assert_eq!(ta.to_bits(), tb.to_bits(), "case {case}: total");
            assert!(a.iter().zip(&b).all(|(p, q)| p.to_bits() == q.to_bits()));
            assert!(ca.iter().zip(&cb).all(|(p, q)| p.to_bits() == q.to_bits()));
            assert_eq!(ca.len(), cb.len());
        }
    }

    #[test]
    fn candidate_exp_matches_the_copied_logits() {
        for n in [0usize, 5, 64, 100, 1000, 20_000] {
            let cands: Vec<SdCandidate> = (0..n as u32)
                .map(|i| SdCandidate {
                    id: i * 3,
                    logit: ((i * 7919) % 1000) as f32 * 0.013 - 6.0,
                })
                .collect();
            let mut scratch = Vec::new();
            let max = candidates_max(&cands);
            let want_max = cands.iter().fold(f32::NEG_INFINITY, |m, c| m.max(c.logit));
            assert_eq!(max, want_max, "n {n}");
            let logits: Vec<f32> = cands.iter().map(|c| c.logit).collect();
            let (mut a, mut b) = (vec![0.0; n], vec![0.0; n]);
            let (mut ca, mut cb) = (Vec::new(), Vec::new());
            let ta = exp_shifted(&logits, max, &mut a, Some(&mut ca));
            let tb = exp_shifted_candidates(&cands, max, &mut b, &mut scratch, Some(&mut cb));
            assert_eq!(ta.to_bits(), tb.to_bits(), "n {n}");
            assert!(a.iter().zip(&b).all(|(p, q)| p.to_bits() == q.to_bits()));
            assert_eq!(ca, cb);
        }
    }

    #[test]
    fn exp_shifted_sums() {
        let x: Vec<f32> = (0..200).map(|i| (i as f32) * 0.01).collect();
        let mut out = vec![0.0; 200];
        let mut cs = Vec::new();
        let s = exp_shifted(&x, 1.99, &mut out, Some(&mut cs));
        assert_eq!(cs.len(), 4);
        assert!((cs.iter().sum::<f64>() - s).abs() < 1e-9);
        let want: f64 = x.iter().map(|&v| ((v - 1.99) as f64).exp()).sum();
        assert!((s - want).abs() / want < 1e-6);
        assert!((out[199] - 1.0).abs() < 1e-6);
    }
}
