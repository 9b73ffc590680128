//! The AVX2 row driver every one-token kernel runs in, and the 32-value formats' block products.
//!
//! `N` rows at a time, so their fma chains overlap, each row keeping
//! ggml's own per-row order (one accumulator, blocks in order, the
//! horizontal sum, then the format's minimum term). A format supplies its
//! block product as a [`RowDot`]; the 32-value ones (Q8_0, Q4_1, Q5_0,
//! Q5_1) are here, the K-quants in `kquant`. Installed by the kernel table
//! (`kernels()`) only when the CPU has AVX2 and FMA.

use crate::ggml::reduce::hsum;
use crate::quant::format::block::Block32;
use crate::quant::format::q4_1::BlockQ4_1;
use crate::quant::format::q5_0::BlockQ5_0;
use crate::quant::format::q5_1::BlockQ5_1;
use crate::quant::format::q8::{BlockQ8_0, BlockQ8_1};
use std::arch::x86_64::*;

/// How far ahead of the blocks being multiplied the weights are
/// prefetched, in bytes. A one-token product reads every weight once, and
/// the hardware prefetcher did not keep up with the kernels' interleaved
/// rows: with the next 4 KiB requested in step, one-thread decode of
/// SmolLM2-135M went from 64 to ~140 tok/s (Q4_1) and 68 to ~118 (Q4_K_M);
/// 1 KiB ahead gave ~110, 16 KiB ~96 (docs/PERFORMANCE.md, "Model host and
/// Generate").
pub(crate) const PREFETCH_AHEAD: usize = 4096;

/// Prefetches the cache lines of bytes `from..from + len` past
/// [`PREFETCH_AHEAD`] bytes after `base`: a kernel calls it with the span
/// its step consumes, so the lines are requested at the rate they are
/// used. (A prefetch is a hint: addresses past the weights are harmless.)
#[inline(always)]
pub(crate) unsafe fn prefetch_ahead(base: *const u8, from: usize, len: usize) {
    let mut off = from;
    while off < from + len {
        // SAFETY: sse is baseline on x86_64; a prefetch never faults, and
        // `wrapping_add` makes no claim about the address.
        unsafe { _mm_prefetch::<_MM_HINT_T0>(base.wrapping_add(PREFETCH_AHEAD + off).cast()) };
        off += 64;
    }
}

/// The shape of a several-token product: `a` holds `n_tok` tokens' blocks
/// and `out` their results, token after token, over the rows of `w`;
/// returns (blocks a row, rows), after checking that `w` covers them.
pub(crate) fn token_major(n_tok: usize, a: usize, out: usize, w: usize) -> (usize, usize) {
    assert!(n_tok > 0 && a.is_multiple_of(n_tok) && out.is_multiple_of(n_tok));
    let (nb, n_rows) = (a / n_tok, out / n_tok);
    assert!(w >= n_rows * nb, "the weights cover the rows");
    (nb, n_rows)
}

/// One format's product of a weight row with the activations, block by
/// block in ggml's order. Every method runs with AVX2 and FMA enabled (it
/// is inlined into [`rows_safe`]'s target-feature function).
pub(crate) trait RowDot {
    /// The weight block.
    type W;
    /// The activation block.
    type A;
    /// What one row accumulates over its blocks.
    type Acc: Copy;
    /// What the rows' products with one activation block share (its quants,
    /// loaded once for the `N` rows).
    type Shared: Copy;
    unsafe fn zero() -> Self::Acc;
    unsafe fn share(a: &Self::A) -> Self::Shared;
    unsafe fn step(acc: Self::Acc, w: &Self::W, a: &Self::A, s: Self::Shared) -> Self::Acc;
    unsafe fn finish(acc: Self::Acc) -> f32;
}

/// `out[r] = W[r] · a` for every row of `w` (`a.len()` blocks a row): `N`
/// rows at a time, then the rest one by one.
pub(crate) fn rows_safe<K: RowDot, const N: usize>(w: &[K::W], a: &[K::A], out: &mut [f32]) {
    // SAFETY: installed in `quant::kernels()` (and called by the tests) only
    // after `samplerd_numerics::features()` reported AVX2 and FMA.
    unsafe { rows::<K, N>(w, a, out) }
}

#[target_feature(enable = "avx2,fma")]
unsafe fn rows<K: RowDot, const N: usize>(w: &[K::W], a: &[K::A], out: &mut [f32]) {
    let nb = a.len();
    assert!(w.len() >= out.len() * nb);
    let mut r = 0;
    while r + N <= out.len() {
        // SAFETY: avx2 and fma are enabled in this function.
        unsafe { group::<K, N>(&w[r * nb..], a, &mut out[r..r + N]) };
        r += N;
    }
    while r < out.len() {
        // SAFETY: as above.
        unsafe { group::<K, 1>(&w[r * nb..], a, &mut out[r..r + 1]) };
        r += 1;
    }
}

/// The `N` rows starting at `w[0]` into `out[..N]`.
#[inline(always)]
unsafe fn group<K: RowDot, const N: usize>(w: &[K::W], a: &[K::A], out: &mut [f32]) {
    let nb = a.len();
    // SAFETY: the callers run with avx2 and fma enabled (all blocks below);
    // `w` holds at least `N` rows of `nb` blocks (asserted in `rows`).
    let mut acc = [unsafe { K::zero() }; N];
    // The group's rows are contiguous; each step consumes `step` of its bytes.
    let step = N * std::mem::size_of::<K::W>();
    for (i, y) in a.iter().enumerate() {
        // SAFETY: a hint only (see `prefetch_ahead`).
        unsafe { prefetch_ahead(w.as_ptr().cast(), i * step, step) };
        // SAFETY: as above.
        let s = unsafe { K::share(y) };
        for (q, acc) in acc.iter_mut().enumerate() {
            // SAFETY: as above.
            *acc = unsafe { K::step(*acc, &w[q * nb + i], y, s) };
        }
    }
    for (o, acc) in out.iter_mut().zip(acc) {
        // SAFETY: as above.
        *o = unsafe { K::finish(acc) };
    }
}

/// The activation block's 32 quants in a register.
#[inline(always)]
unsafe fn load_q8_1(a: &BlockQ8_1) -> __m256i {
    // SAFETY: avx2 enabled by the callers; the 32-byte load is `a.qs`.
    unsafe { _mm256_loadu_si256(a.qs.as_ptr() as *const __m256i) }
}

/// ggml's `bytes_from_nibbles_32`: the low nibbles of `qs` in bytes 0..16,
/// the high ones in 16..32.
#[inline(always)]
pub(crate) unsafe fn nibbles_32(qs: &[u8; 16]) -> __m256i {
    // SAFETY: avx2 enabled by the callers; the 16-byte load is `qs`.
    unsafe {
        let b = _mm_loadu_si128(qs.as_ptr() as *const __m128i);
        _mm256_and_si256(
            _mm256_set_m128i(_mm_srli_epi16(b, 4), b),
            _mm256_set1_epi8(0x0F),
        )
    }
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

/// ggml's `mul_sum_i8_pairs_float`: signed `qx` times signed `qy`, eight
/// int32 lanes of four products, as floats.
#[inline(always)]
unsafe fn mul_sum_i8_pairs(qx: __m256i, qy: __m256i) -> __m256 {
    // SAFETY: avx2 enabled by the callers; register-only intrinsics.
    unsafe {
        let p = _mm256_maddubs_epi16(_mm256_sign_epi8(qx, qx), _mm256_sign_epi8(qy, qx));
        _mm256_cvtepi32_ps(_mm256_madd_epi16(p, _mm256_set1_epi16(1)))
    }
}

/// ggml's `mul_sum_us8_pairs_float`: unsigned `qx` times signed `qy`.
#[inline(always)]
unsafe fn mul_sum_us8_pairs(qx: __m256i, qy: __m256i) -> __m256 {
    // SAFETY: avx2 enabled by the callers; register-only intrinsics.
    unsafe {
        let p = _mm256_maddubs_epi16(qx, qy);
        _mm256_cvtepi32_ps(_mm256_madd_epi16(p, _mm256_set1_epi16(1)))
    }
}

/// A 32-value format's block products with the activation quants `qy`,
/// eight float lanes ([`Block32`] has the rest of its arithmetic).
pub(crate) trait Lanes32: Block32 {
    unsafe fn lanes(&self, qy: __m256i) -> __m256;
}

impl<B: Lanes32> RowDot for B {
    type W = B;
    type A = BlockQ8_1;
    type Acc = (__m256, f32);
    type Shared = __m256i;
    #[inline(always)]
    unsafe fn zero() -> (__m256, f32) {
        // SAFETY: avx2 enabled by the callers.
        (unsafe { _mm256_setzero_ps() }, 0.0)
    }
    #[inline(always)]
    unsafe fn share(a: &BlockQ8_1) -> __m256i {
        // SAFETY: as for `zero`.
        unsafe { load_q8_1(a) }
    }
    #[inline(always)]
    unsafe fn step(
        (acc, summs): (__m256, f32),
        w: &B,
        a: &BlockQ8_1,
        qy: __m256i,
    ) -> (__m256, f32) {
        let summs = if B::MIN { summs + w.m() * a.s } else { summs };
        // SAFETY: avx2 and fma enabled by the callers.
        let acc = unsafe { _mm256_fmadd_ps(_mm256_set1_ps(w.d() * a.d), w.lanes(qy), acc) };
        (acc, summs)
    }
    #[inline(always)]
    unsafe fn finish((acc, summs): (__m256, f32)) -> f32 {
        // SAFETY: as for `zero`.
        let v = unsafe { hsum(acc) };
        if B::MIN { v + summs } else { v }
    }
}

impl Lanes32 for BlockQ8_0 {
    #[inline(always)]
    unsafe fn lanes(&self, qy: __m256i) -> __m256 {
        // SAFETY: avx2 enabled by the callers; the 32-byte load is `self.qs`.
        unsafe { mul_sum_i8_pairs(_mm256_loadu_si256(self.qs.as_ptr() as *const __m256i), qy) }
    }
}

impl Lanes32 for BlockQ4_1 {
    #[inline(always)]
    unsafe fn lanes(&self, qy: __m256i) -> __m256 {
        // SAFETY: avx2 enabled by the callers.
        unsafe { mul_sum_us8_pairs(nibbles_32(&self.qs), qy) }
    }
}

/// Q5_0 as ggml's `ggml_vec_dot_q5_0_q8_0` expands it:
/// `bytes_from_nibbles_32 | andnot(bytes_from_bits_32(qh), 0xF0)`, the 32
/// signed values `q − 16`, then Q8_0's product.
impl Lanes32 for BlockQ5_0 {
    #[inline(always)]
    unsafe fn lanes(&self, qy: __m256i) -> __m256 {
        // SAFETY: avx2 enabled by the callers.
        unsafe {
            let hi =
                _mm256_andnot_si256(bytes_from_bits_32(self.qh), _mm256_set1_epi8(0xF0u8 as i8));
            mul_sum_i8_pairs(_mm256_or_si256(nibbles_32(&self.qs), hi), qy)
        }
    }
}

/// Q5_1: the unsigned 5-bit values (fifth bit `0x10` from `qh`), Q4_1's
/// product.
impl Lanes32 for BlockQ5_1 {
    #[inline(always)]
    unsafe fn lanes(&self, qy: __m256i) -> __m256 {
        // SAFETY: avx2 enabled by the callers.
        unsafe {
            let hi = _mm256_and_si256(bytes_from_bits_32(self.qh), _mm256_set1_epi8(0x10));
            mul_sum_us8_pairs(_mm256_or_si256(nibbles_32(&self.qs), hi), qy)
        }
    }
}
