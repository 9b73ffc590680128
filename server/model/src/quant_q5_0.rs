//! Q5_0 weights kept natively (llama.cpp's fallback for Q4_K_M/Q4_K_S tensors
//! whose rows are not a multiple of 256 — most matrices of narrow models).
//!
//! `x = d·(q − 16)` with a 5-bit `q`: low nibbles in `qs` (value `j` in the
//! low nibble of `qs[j]`, value `j + 16` in the high one), fifth bits in `qh`
//! (bit `j` for value `j`). ggml's `ggml_vec_dot_q5_0_q8_0` (AVX2) expands a
//! block to 32 signed bytes (`bytes_from_nibbles_32 | andnot(bytes_from_bits_32(qh), 0xF0)`)
//! and then does exactly what `ggml_vec_dot_q8_0_q8_0` does, so the scalar
//! reference below is the Q8_0 one on the expanded values, and it equals the
//! Q8_0 kernels on [`QMatrix::q8_0_from_q4_0_or_q5_0`]'s blocks bit for bit.
//! 24 bytes per block in memory (f16 scale widened) instead of 36 as Q8_0.
//!
//! [`QMatrix::q8_0_from_q4_0_or_q5_0`]: crate::quant::QMatrix::q8_0_from_q4_0_or_q5_0

use crate::quant::{BlockQ8_1, QK};
use half::f16;

/// A Q5_0 weight block.
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct BlockQ5_0 {
    pub d: f32,
    pub qh: u32,
    pub qs: [u8; QK / 2],
}

/// Bytes of one stored block (f16 d, u32 qh, 16 × u8).
pub const Q5_0_BYTES: usize = 22;

/// Blocks from raw GGUF bytes, or `None` for a partial block.
pub fn from_bytes(raw: &[u8]) -> Option<Vec<BlockQ5_0>> {
    if !raw.len().is_multiple_of(Q5_0_BYTES) {
        return None;
    }
    Some(
        raw.chunks_exact(Q5_0_BYTES)
            .map(|c| {
                let mut qs = [0u8; QK / 2];
                qs.copy_from_slice(&c[6..22]);
                BlockQ5_0 {
                    d: f16::from_le_bytes([c[0], c[1]]).to_f32(),
                    qh: u32::from_le_bytes([c[2], c[3], c[4], c[5]]),
                    qs,
                }
            })
            .collect(),
    )
}

/// The 32 signed values `q − 16` of a block (ggml's `dequantize_row_q5_0`
/// without the scale).
#[inline(always)]
pub fn values(b: &BlockQ5_0) -> [i8; QK] {
    let mut v = [0i8; QK];
    for j in 0..QK / 2 {
        let lo = (b.qs[j] & 0x0F) | ((((b.qh >> j) & 1) as u8) << 4);
        let hi = (b.qs[j] >> 4) | ((((b.qh >> (j + 16)) & 1) as u8) << 4);
        v[j] = lo as i8 - 16;
        v[j + 16] = hi as i8 - 16;
    }
    v
}

/// ggml's `dequantize_row_q5_0`.
pub fn dequant(blocks: &[BlockQ5_0], out: &mut [f32]) {
    for (b, o) in blocks.iter().zip(out.chunks_exact_mut(QK)) {
        for (x, q) in o.iter_mut().zip(values(b)) {
            *x = b.d * q as f32;
        }
    }
}

/// Portable reference: eight int32 lanes of four products, one fma per lane
/// and block, `hsum_float_8` (the Q8_0 order).
pub mod scalar {
    use super::*;

    pub fn dot(w: &[BlockQ5_0], a: &[BlockQ8_1]) -> f32 {
        let mut acc = [0f32; 8];
        for (w, a) in w.iter().zip(a) {
            let d = w.d * a.d;
            let q = values(w);
            for (l, acc) in acc.iter_mut().enumerate() {
                let s: i32 = (4 * l..4 * l + 4)
                    .map(|j| q[j] as i32 * a.qs[j] as i32)
                    .sum();
                *acc = d.mul_add(s as f32, *acc);
            }
        }
        crate::quant_k::scalar::hsum8(&acc)
    }

    pub fn rows(w: &[BlockQ5_0], a: &[BlockQ8_1], out: &mut [f32]) {
        for (o, row) in out.iter_mut().zip(w.chunks_exact(a.len())) {
            *o = dot(row, a);
        }
    }
}

#[cfg(target_arch = "x86_64")]
pub mod avx2 {
    use super::*;
    use std::arch::x86_64::*;

    pub fn rows_safe(w: &[BlockQ5_0], a: &[BlockQ8_1], out: &mut [f32]) {
        // SAFETY: installed in `quant::kernels()` only after
        // `samplerd_numerics::features()` reported AVX2 and FMA.
        unsafe { rows(w, a, out) }
    }

    /// ggml's `bytes_from_bits_32`: byte `i` is 0xFF where bit `i` is set.
    #[inline(always)]
    pub(crate) unsafe fn bytes_from_bits_32(x: u32) -> __m256i {
        // SAFETY: avx2 enabled by the callers; register-only intrinsics.
        unsafe {
            let shuf = _mm256_set_epi64x(
                0x0303030303030303,
                0x0202020202020202,
                0x0101010101010101,
                0,
            );
            let bytes = _mm256_shuffle_epi8(_mm256_set1_epi32(x as i32), shuf);
            let bytes = _mm256_or_si256(bytes, _mm256_set1_epi64x(0x7fbfdfeff7fbfdfe));
            _mm256_cmpeq_epi8(bytes, _mm256_set1_epi64x(-1))
        }
    }

    /// The block's 32 signed values and their products with `qy`, as
    /// `mul_sum_i8_pairs_float` gives them.
    #[inline(always)]
    unsafe fn block(w: &BlockQ5_0, qy: __m256i) -> __m256 {
        // SAFETY: avx2 enabled by the callers; the 16-byte load is `w.qs`.
        unsafe {
            let b = _mm_loadu_si128(w.qs.as_ptr() as *const __m128i);
            let nib = _mm256_and_si256(
                _mm256_set_m128i(_mm_srli_epi16(b, 4), b),
                _mm256_set1_epi8(0x0F),
            );
            let hi = _mm256_andnot_si256(bytes_from_bits_32(w.qh), _mm256_set1_epi8(0xF0u8 as i8));
            let qx = _mm256_or_si256(nib, hi);
            let p = _mm256_maddubs_epi16(_mm256_sign_epi8(qx, qx), _mm256_sign_epi8(qy, qx));
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

    // Two rows at a time (overlapping fma chains), each in ggml's order.
    #[target_feature(enable = "avx2,fma")]
    unsafe fn rows(w: &[BlockQ5_0], a: &[BlockQ8_1], out: &mut [f32]) {
        let nb = a.len();
        assert!(w.len() >= out.len() * nb);
        let mut r = 0;
        while r < out.len() {
            let k = if r + 2 <= out.len() { 2 } else { 1 };
            let mut acc = [_mm256_setzero_ps(); 2];
            for (i, y) in a.iter().enumerate() {
                // SAFETY: avx2 and fma are enabled here; the load is `y.qs`.
                let qy = unsafe { _mm256_loadu_si256(y.qs.as_ptr() as *const __m256i) };
                for q in 0..k {
                    let x = &w[(r + q) * nb + i];
                    // SAFETY: avx2 and fma are enabled in this function.
                    unsafe {
                        acc[q] = _mm256_fmadd_ps(_mm256_set1_ps(x.d * y.d), block(x, qy), acc[q]);
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
}
