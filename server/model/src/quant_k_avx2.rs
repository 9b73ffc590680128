//! AVX2 K-quant products: ggml's `ggml_vec_dot_q{4,5,6}_K_q8_K` AVX2 code,
//! two rows at a time (the two fma chains overlap) with each row keeping
//! ggml's own order: one `fma(d, lanes, acc)` per super-block, blocks in
//! order, `hsum_float_8`, then the minimum term. Installed by
//! `quant::kernels()` only when the CPU has AVX2 and FMA.

use crate::quant_k::{BlockQ4K, BlockQ5K, BlockQ6K, BlockQ8K};
use std::arch::x86_64::*;

pub fn rows_q4k_safe(w: &[BlockQ4K], a: &[BlockQ8K], out: &mut [f32]) {
    // SAFETY: installed in `quant::kernels()` only after
    // `samplerd_numerics::features()` reported AVX2 and FMA.
    unsafe { rows_q4k(w, a, out) }
}

pub fn rows_q5k_safe(w: &[BlockQ5K], a: &[BlockQ8K], out: &mut [f32]) {
    // SAFETY: as for `rows_q4k_safe`.
    unsafe { rows_q5k(w, a, out) }
}

pub fn rows_q6k_safe(w: &[BlockQ6K], a: &[BlockQ8K], out: &mut [f32]) {
    // SAFETY: as for `rows_q4k_safe`.
    unsafe { rows_q6k(w, a, out) }
}

/// ggml's `hsum_float_8`.
#[inline(always)]
unsafe fn hsum(v: __m256) -> f32 {
    // SAFETY: callers run with avx2 enabled (target_feature functions).
    unsafe {
        let s = _mm_add_ps(_mm256_extractf128_ps(v, 1), _mm256_castps256_ps128(v));
        let s = _mm_add_ps(s, _mm_movehl_ps(s, s));
        let s = _mm_add_ss(s, _mm_movehdup_ps(s));
        _mm_cvtss_f32(s)
    }
}

/// `madd(mins, hadd(bsums lo, bsums hi))`: the four int32 minimum products
/// of a Q4_K/Q5_K block.
#[inline(always)]
unsafe fn min_prods(m: &[u8; 8], y: &BlockQ8K) -> __m128i {
    // SAFETY: avx2 enabled by the callers; the loads read `m` (8 bytes) and
    // `y.bsums` (32 bytes).
    unsafe {
        let mins = _mm_cvtepu8_epi16(_mm_loadl_epi64(m.as_ptr() as *const __m128i));
        let q8sums = _mm256_loadu_si256(y.bsums.as_ptr() as *const __m256i);
        let q8s = _mm_hadd_epi16(
            _mm256_castsi256_si128(q8sums),
            _mm256_extracti128_si256(q8sums, 1),
        );
        _mm_madd_epi16(mins, q8s)
    }
}

/// The eight int32 lanes of one Q4_K block times one Q8_K block.
#[inline(always)]
unsafe fn q4k_lanes(x: &BlockQ4K, y: &BlockQ8K) -> __m256i {
    // SAFETY: avx2 enabled by the callers; every 32-byte load lies inside
    // `x.qs` (128 bytes) or `y.qs` (256 bytes).
    unsafe {
        let m4 = _mm256_set1_epi8(0xF);
        let mut sumi = _mm256_setzero_si256();
        for j in 0..4 {
            let scale_l = _mm256_set1_epi16(x.sc[2 * j] as i16);
            let scale_h = _mm256_set1_epi16(x.sc[2 * j + 1] as i16);
            let q4bits = _mm256_loadu_si256(x.qs.as_ptr().add(32 * j) as *const __m256i);
            let q4l = _mm256_and_si256(q4bits, m4);
            let q4h = _mm256_and_si256(_mm256_srli_epi16(q4bits, 4), m4);
            let q8l = _mm256_loadu_si256(y.qs.as_ptr().add(64 * j) as *const __m256i);
            let q8h = _mm256_loadu_si256(y.qs.as_ptr().add(64 * j + 32) as *const __m256i);
            let p16l = _mm256_madd_epi16(scale_l, _mm256_maddubs_epi16(q4l, q8l));
            let p16h = _mm256_madd_epi16(scale_h, _mm256_maddubs_epi16(q4h, q8h));
            sumi = _mm256_add_epi32(sumi, _mm256_add_epi32(p16l, p16h));
        }
        sumi
    }
}

#[inline(always)]
unsafe fn q5k_lanes(x: &BlockQ5K, y: &BlockQ8K) -> __m256i {
    // SAFETY: avx2 enabled by the callers; the loads lie inside `x.qs`
    // (128 bytes), `x.qh` (32 bytes) and `y.qs` (256 bytes).
    unsafe {
        let m4 = _mm256_set1_epi8(0xF);
        let m16 = _mm256_set1_epi8(16);
        let hbits = _mm256_loadu_si256(x.qh.as_ptr() as *const __m256i);
        let mut sumi = _mm256_setzero_si256();
        for j in 0..4 {
            let scale_0 = _mm256_set1_epi16(x.sc[2 * j] as i16);
            let scale_1 = _mm256_set1_epi16(x.sc[2 * j + 1] as i16);
            let q5bits = _mm256_loadu_si256(x.qs.as_ptr().add(32 * j) as *const __m256i);
            // Fifth bits 2j and 2j + 1 of each qh byte, as 16 or 0.
            let h0 = _mm256_set1_epi8(1 << (2 * j));
            let h1 = _mm256_set1_epi8(1 << (2 * j + 1));
            let q5h_0 = _mm256_and_si256(_mm256_cmpeq_epi8(_mm256_and_si256(hbits, h0), h0), m16);
            let q5h_1 = _mm256_and_si256(_mm256_cmpeq_epi8(_mm256_and_si256(hbits, h1), h1), m16);
            let q5_0 = _mm256_add_epi8(_mm256_and_si256(q5bits, m4), q5h_0);
            let q5_1 = _mm256_add_epi8(_mm256_and_si256(_mm256_srli_epi16(q5bits, 4), m4), q5h_1);
            let q8_0 = _mm256_loadu_si256(y.qs.as_ptr().add(64 * j) as *const __m256i);
            let q8_1 = _mm256_loadu_si256(y.qs.as_ptr().add(64 * j + 32) as *const __m256i);
            let p16_0 = _mm256_madd_epi16(scale_0, _mm256_maddubs_epi16(q5_0, q8_0));
            let p16_1 = _mm256_madd_epi16(scale_1, _mm256_maddubs_epi16(q5_1, q8_1));
            sumi = _mm256_add_epi32(sumi, _mm256_add_epi32(p16_0, p16_1));
        }
        sumi
    }
}

#[inline(always)]
unsafe fn q6k_lanes(x: &BlockQ6K, y: &BlockQ8K) -> __m256i {
    // SAFETY: avx2 enabled by the callers; the loads lie inside `x.ql`
    // (128 bytes), `x.qh` (64 bytes), `x.scales` (16 bytes), `y.qs` (256
    // bytes) and `y.bsums` (32 bytes).
    unsafe {
        let m4 = _mm256_set1_epi8(0xF);
        let m3 = _mm256_set1_epi8(3);
        // The `- 32` offset as ggml applies it: `32·madd(bsums, scales)`
        // subtracted from the lanes at the end.
        let scales16 = _mm256_cvtepi8_epi16(_mm_loadu_si128(x.scales.as_ptr() as *const __m128i));
        let bsums = _mm256_loadu_si256(y.bsums.as_ptr() as *const __m256i);
        let q8sclsub = _mm256_slli_epi32(_mm256_madd_epi16(bsums, scales16), 5);
        let mut sumi = _mm256_setzero_si256();
        for j in 0..2 {
            let q4bits1 = _mm256_loadu_si256(x.ql.as_ptr().add(64 * j) as *const __m256i);
            let q4bits2 = _mm256_loadu_si256(x.ql.as_ptr().add(64 * j + 32) as *const __m256i);
            let q4bits_h = _mm256_loadu_si256(x.qh.as_ptr().add(32 * j) as *const __m256i);
            let h0 = _mm256_slli_epi16(_mm256_and_si256(q4bits_h, m3), 4);
            let h1 = _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(q4bits_h, 2), m3), 4);
            let h2 = _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(q4bits_h, 4), m3), 4);
            let h3 = _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(q4bits_h, 6), m3), 4);
            let q = [
                _mm256_or_si256(_mm256_and_si256(q4bits1, m4), h0),
                _mm256_or_si256(_mm256_and_si256(q4bits2, m4), h1),
                _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(q4bits1, 4), m4), h2),
                _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(q4bits2, 4), m4), h3),
            ];
            let mut p = [_mm256_setzero_si256(); 4];
            for c in 0..4 {
                let q8 = _mm256_loadu_si256(y.qs.as_ptr().add(128 * j + 32 * c) as *const __m256i);
                let p16 = _mm256_maddubs_epi16(q[c], q8);
                let s = 8 * j + 2 * c;
                let scale = _mm256_set_m128i(
                    _mm_set1_epi16(x.scales[s + 1] as i16),
                    _mm_set1_epi16(x.scales[s] as i16),
                );
                p[c] = _mm256_madd_epi16(scale, p16);
            }
            sumi = _mm256_add_epi32(sumi, _mm256_add_epi32(p[0], p[1]));
            sumi = _mm256_add_epi32(sumi, _mm256_add_epi32(p[2], p[3]));
        }
        _mm256_sub_epi32(sumi, q8sclsub)
    }
}

#[target_feature(enable = "avx2,fma")]
unsafe fn rows_q4k(w: &[BlockQ4K], a: &[BlockQ8K], out: &mut [f32]) {
    let nb = a.len();
    assert!(w.len() >= out.len() * nb);
    let mut r = 0;
    while r < out.len() {
        let k = if r + 2 <= out.len() { 2 } else { 1 };
        let mut acc = [_mm256_setzero_ps(); 2];
        let mut acc_m = [_mm_setzero_ps(); 2];
        for (i, y) in a.iter().enumerate() {
            for q in 0..k {
                let x = &w[(r + q) * nb + i];
                let d = y.d * x.d;
                let dmin = -y.d * x.dmin;
                // SAFETY: avx2 and fma are enabled in this function.
                unsafe {
                    let prod = min_prods(&x.m, y);
                    acc_m[q] = _mm_fmadd_ps(_mm_set1_ps(dmin), _mm_cvtepi32_ps(prod), acc_m[q]);
                    let sumi = q4k_lanes(x, y);
                    acc[q] = _mm256_fmadd_ps(_mm256_set1_ps(d), _mm256_cvtepi32_ps(sumi), acc[q]);
                }
            }
        }
        for q in 0..k {
            // SAFETY: avx2 is enabled in this function.
            out[r + q] = unsafe {
                let m = _mm_add_ps(acc_m[q], _mm_movehl_ps(acc_m[q], acc_m[q]));
                let m = _mm_add_ss(m, _mm_movehdup_ps(m));
                hsum(acc[q]) + _mm_cvtss_f32(m)
            };
        }
        r += k;
    }
}

#[target_feature(enable = "avx2,fma")]
unsafe fn rows_q5k(w: &[BlockQ5K], a: &[BlockQ8K], out: &mut [f32]) {
    let nb = a.len();
    assert!(w.len() >= out.len() * nb);
    let mut r = 0;
    while r < out.len() {
        let k = if r + 2 <= out.len() { 2 } else { 1 };
        let mut acc = [_mm256_setzero_ps(); 2];
        let mut summs = [0f32; 2];
        for (i, y) in a.iter().enumerate() {
            for q in 0..k {
                let x = &w[(r + q) * nb + i];
                let d = y.d * x.d;
                let dmin = -y.d * x.dmin;
                // SAFETY: avx2 and fma are enabled in this function.
                unsafe {
                    let p = min_prods(&x.m, y);
                    let s = _mm_cvtsi128_si32(_mm_hadd_epi32(
                        _mm_hadd_epi32(p, _mm_setzero_si128()),
                        _mm_setzero_si128(),
                    ));
                    // GCC contracts ggml's `summs += dmin * s` into an fma.
                    summs[q] = dmin.mul_add(s as f32, summs[q]);
                    let sumi = q5k_lanes(x, y);
                    acc[q] = _mm256_fmadd_ps(_mm256_set1_ps(d), _mm256_cvtepi32_ps(sumi), acc[q]);
                }
            }
        }
        for q in 0..k {
            // SAFETY: avx2 is enabled in this function.
            out[r + q] = unsafe { hsum(acc[q]) } + summs[q];
        }
        r += k;
    }
}

#[target_feature(enable = "avx2,fma")]
unsafe fn rows_q6k(w: &[BlockQ6K], a: &[BlockQ8K], out: &mut [f32]) {
    let nb = a.len();
    assert!(w.len() >= out.len() * nb);
    let mut r = 0;
    while r < out.len() {
        let k = if r + 2 <= out.len() { 2 } else { 1 };
        let mut acc = [_mm256_setzero_ps(); 2];
        for (i, y) in a.iter().enumerate() {
            for q in 0..k {
                let x = &w[(r + q) * nb + i];
                let d = y.d * x.d;
                // SAFETY: avx2 and fma are enabled in this function.
                unsafe {
                    let sumi = q6k_lanes(x, y);
                    acc[q] = _mm256_fmadd_ps(_mm256_set1_ps(d), _mm256_cvtepi32_ps(sumi), acc[q]);
                }
            }
        }
        for q in 0..k {
            // SAFETY: avx2 is enabled in this function.
            out[r + q] = unsafe { hsum(acc[q]) };
        }
        r += k;
    }
}

/// Sum of the eight int32 lanes (exact).
#[inline(always)]
unsafe fn hsum_i32(v: __m256i) -> i32 {
    // SAFETY: avx2 enabled by the callers.
    unsafe {
        let s = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
        let s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0b10_11_00_01));
        let s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0b01_00_11_10));
        _mm_cvtsi128_si32(s)
    }
}

/// Sum of four int32 lanes (exact).
#[inline(always)]
unsafe fn hsum_i32_4(v: __m128i) -> i32 {
    // SAFETY: avx2 enabled by the callers.
    unsafe {
        let s = _mm_add_epi32(v, _mm_shuffle_epi32(v, 0b10_11_00_01));
        let s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0b01_00_11_10));
        _mm_cvtsi128_si32(s)
    }
}

// ggml's tiled matmul (8+ row batches): the same integer lanes, summed per
// super-block, then `quant_k::scalar::tiled_step` (see the `quant_k` module
// comment).

pub fn tiled_rows_q4k_safe(w: &[BlockQ4K], a: &[BlockQ8K], out: &mut [f32], fused: bool) {
    // SAFETY: as for `rows_q4k_safe`.
    unsafe { tiled_rows_q4k(w, a, out, fused) }
}

pub fn tiled_rows_q5k_safe(w: &[BlockQ5K], a: &[BlockQ8K], out: &mut [f32], fused: bool) {
    // SAFETY: as for `rows_q4k_safe`.
    unsafe { tiled_rows_q5k(w, a, out, fused) }
}

pub fn tiled_rows_q6k_safe(w: &[BlockQ6K], a: &[BlockQ8K], out: &mut [f32], fused: bool) {
    // SAFETY: as for `rows_q4k_safe`.
    unsafe { tiled_rows_q6k(w, a, out, fused) }
}

use crate::quant_k::scalar::tiled_step;

#[target_feature(enable = "avx2,fma")]
unsafe fn tiled_rows_q4k(w: &[BlockQ4K], a: &[BlockQ8K], out: &mut [f32], fused: bool) {
    let nb = a.len();
    assert!(w.len() >= out.len() * nb);
    for (o, row) in out.iter_mut().zip(w.chunks_exact(nb)) {
        let mut acc = 0f32;
        for (x, y) in row.iter().zip(a) {
            // SAFETY: avx2 and fma are enabled in this function.
            let (s1, s2) = unsafe { (hsum_i32(q4k_lanes(x, y)), hsum_i32_4(min_prods(&x.m, y))) };
            acc = tiled_step(s1, s2, x.d, x.dmin, y.d, acc, fused);
        }
        *o = acc;
    }
}

#[target_feature(enable = "avx2,fma")]
unsafe fn tiled_rows_q5k(w: &[BlockQ5K], a: &[BlockQ8K], out: &mut [f32], fused: bool) {
    let nb = a.len();
    assert!(w.len() >= out.len() * nb);
    for (o, row) in out.iter_mut().zip(w.chunks_exact(nb)) {
        let mut acc = 0f32;
        for (x, y) in row.iter().zip(a) {
            // SAFETY: avx2 and fma are enabled in this function.
            let (s1, s2) = unsafe { (hsum_i32(q5k_lanes(x, y)), hsum_i32_4(min_prods(&x.m, y))) };
            acc = tiled_step(s1, s2, x.d, x.dmin, y.d, acc, fused);
        }
        *o = acc;
    }
}

#[target_feature(enable = "avx2,fma")]
unsafe fn tiled_rows_q6k(w: &[BlockQ6K], a: &[BlockQ8K], out: &mut [f32], fused: bool) {
    let nb = a.len();
    assert!(w.len() >= out.len() * nb);
    for (o, row) in out.iter_mut().zip(w.chunks_exact(nb)) {
        let mut acc = 0f32;
        for (x, y) in row.iter().zip(a) {
            // SAFETY: avx2 and fma are enabled in this function.
            let s1 = unsafe { hsum_i32(q6k_lanes(x, y)) };
            acc = tiled_step(s1, 0, x.d, 0.0, y.d, acc, fused);
        }
        *o = acc;
    }
}
