//! Q5_1 weights kept natively (llama.cpp's fallback for Q5_K_M/Q5_K_S
//! tensors whose rows are not a multiple of 256).
//!
//! `x = d·q + m` with a 5-bit `q` laid out like Q5_0's. ggml's
//! `ggml_vec_dot_q5_1_q8_1` (AVX2) multiplies the unsigned values with the
//! Q8_1 activations (`mul_sum_us8_pairs_float`), one `fma(q, d·d8, acc)` per
//! block, `hsum_float_8`, plus `Σ m·s` (an fma chain; `m·s` is exact, both
//! being f16 values, so fused or not gives the same bits). 28 bytes per block
//! in memory (f16 scale and minimum widened).

use crate::quant::{BlockQ8_1, QK};
use half::f16;

/// A Q5_1 weight block.
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct BlockQ5_1 {
    pub d: f32,
    pub m: f32,
    pub qh: u32,
    pub qs: [u8; QK / 2],
}

/// Bytes of one stored block (f16 d, f16 m, u32 qh, 16 × u8).
pub const Q5_1_BYTES: usize = 24;

/// Blocks from raw GGUF bytes, or `None` for a partial block.
pub fn from_bytes(raw: &[u8]) -> Option<Vec<BlockQ5_1>> {
    if !raw.len().is_multiple_of(Q5_1_BYTES) {
        return None;
    }
    Some(
        raw.chunks_exact(Q5_1_BYTES)
            .map(|c| {
                let mut qs = [0u8; QK / 2];
                qs.copy_from_slice(&c[8..24]);
                BlockQ5_1 {
                    d: f16::from_le_bytes([c[0], c[1]]).to_f32(),
                    m: f16::from_le_bytes([c[2], c[3]]).to_f32(),
                    qh: u32::from_le_bytes([c[4], c[5], c[6], c[7]]),
                    qs,
                }
            })
            .collect(),
    )
}

/// The 32 unsigned 5-bit values of a block.
#[inline(always)]
pub fn values(b: &BlockQ5_1) -> [u8; QK] {
    let mut v = [0u8; QK];
    for j in 0..QK / 2 {
        v[j] = (b.qs[j] & 0x0F) | ((((b.qh >> j) & 1) as u8) << 4);
        v[j + 16] = (b.qs[j] >> 4) | ((((b.qh >> (j + 16)) & 1) as u8) << 4);
    }
    v
}

/// ggml's `dequantize_row_q5_1` (`x·d + m`).
pub fn dequant(blocks: &[BlockQ5_1], out: &mut [f32]) {
    for (b, o) in blocks.iter().zip(out.chunks_exact_mut(QK)) {
        for (x, q) in o.iter_mut().zip(values(b)) {
            *x = q as f32 * b.d + b.m;
        }
    }
}

/// Portable reference, lane by lane as the AVX2 kernel.
pub mod scalar {
    use super::*;

    pub fn dot(w: &[BlockQ5_1], a: &[BlockQ8_1]) -> f32 {
        let mut acc = [0f32; 8];
        let mut summs = 0f32;
        for (w, a) in w.iter().zip(a) {
            summs = w.m.mul_add(a.s, summs);
            let d = w.d * a.d;
            let q = values(w);
            for (l, acc) in acc.iter_mut().enumerate() {
                let s: i32 = (4 * l..4 * l + 4)
                    .map(|j| q[j] as i32 * a.qs[j] as i32)
                    .sum();
                *acc = (s as f32).mul_add(d, *acc);
            }
        }
        crate::quant_k::scalar::hsum8(&acc) + summs
    }

    pub fn rows(w: &[BlockQ5_1], a: &[BlockQ8_1], out: &mut [f32]) {
        for (o, row) in out.iter_mut().zip(w.chunks_exact(a.len())) {
            *o = dot(row, a);
        }
    }
}

#[cfg(target_arch = "x86_64")]
pub mod avx2 {
    use super::*;
    use std::arch::x86_64::*;

    pub fn rows_safe(w: &[BlockQ5_1], a: &[BlockQ8_1], out: &mut [f32]) {
        // SAFETY: installed in `quant::kernels()` only after
        // `samplerd_numerics::features()` reported AVX2 and FMA.
        unsafe { rows(w, a, out) }
    }

    #[inline(always)]
    unsafe fn block(w: &BlockQ5_1, qy: __m256i) -> __m256 {
        // SAFETY: avx2 enabled by the callers; the 16-byte load is `w.qs`.
        unsafe {
            let b = _mm_loadu_si128(w.qs.as_ptr() as *const __m128i);
            let nib = _mm256_and_si256(
                _mm256_set_m128i(_mm_srli_epi16(b, 4), b),
                _mm256_set1_epi8(0x0F),
            );
            let hi = _mm256_and_si256(
                crate::quant_q5_0::avx2::bytes_from_bits_32(w.qh),
                _mm256_set1_epi8(0x10),
            );
            let p = _mm256_maddubs_epi16(_mm256_or_si256(nib, hi), qy);
            _mm256_cvtepi32_ps(_mm256_madd_epi16(p, _mm256_set1_epi16(1)))
        }
    }

    #[inline(always)]
    unsafe fn hsum(v: __m256) -> f32 {
        // SAFETY: avx2 enabled by the callers.
        unsafe {
            let s = _mm_add_ps(_mm256_extractf128_ps(v, 1), _mm256_castps256_ps128(v));
            let s = _mm_add_ps(s, _mm_movehl_ps(s, s));
            let s = _mm_add_ss(s, _mm_movehdup_ps(s));
            _mm_cvtss_f32(s)
        }
    }

    #[target_feature(enable = "avx2,fma")]
    unsafe fn rows(w: &[BlockQ5_1], a: &[BlockQ8_1], out: &mut [f32]) {
        let nb = a.len();
        assert!(w.len() >= out.len() * nb);
        let mut r = 0;
        while r < out.len() {
            let k = if r + 2 <= out.len() { 2 } else { 1 };
            let mut acc = [_mm256_setzero_ps(); 2];
            let mut summs = [0f32; 2];
            for (i, y) in a.iter().enumerate() {
                // SAFETY: avx2 and fma are enabled here; the load is `y.qs`.
                let qy = unsafe { _mm256_loadu_si256(y.qs.as_ptr() as *const __m256i) };
                for q in 0..k {
                    let x = &w[(r + q) * nb + i];
                    summs[q] = x.m.mul_add(y.s, summs[q]);
                    // SAFETY: avx2 and fma are enabled in this function.
                    unsafe {
                        acc[q] = _mm256_fmadd_ps(block(x, qy), _mm256_set1_ps(x.d * y.d), acc[q]);
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
}
