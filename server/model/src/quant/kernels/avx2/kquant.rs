//! AVX2 K-quant products, in ggml's vector-dot order and in its tiled matmul's.
//!
//! ggml's `ggml_vec_dot_q{4,5,6}_K_q8_K` AVX2 code
//! as [`RowDot`]s, run two rows at a time by `rows::rows_safe` (the
//! two fma chains overlap) with each row keeping ggml's own order: one
//! `fma(d, lanes, acc)` per super-block, blocks in order, `hsum_float_8`,
//! then the minimum term; and the same integer lanes in the order of ggml's
//! tiled matmul ([`tiled_safe`]). Installed by the kernel table only when
//! the CPU has AVX2 and FMA.

use crate::ggml::reduce::hsum;
use crate::quant::format::kquant::{BlockQ4K, BlockQ5K, BlockQ6K, BlockQ8K};
use crate::quant::kernels::avx2::rows::{RowDot, prefetch_ahead, token_major};
use crate::quant::kernels::scalar::tiled_step;
use std::arch::x86_64::*;

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

/// A K-quant block's AVX2 integer products with a Q8_K block.
pub(crate) trait KLanes {
    /// The eight int32 lanes of the block times each of `T` Q8_K blocks
    /// (ggml's `sumi`), the weights unpacked once for all of them.
    unsafe fn lanes_tokens<const T: usize>(&self, ys: [&BlockQ8K; T]) -> [__m256i; T];
    /// The eight int32 lanes of the block times `y`.
    #[inline(always)]
    unsafe fn lanes(&self, y: &BlockQ8K) -> __m256i {
        // SAFETY: the callers' contract (avx2 enabled).
        let [l] = unsafe { self.lanes_tokens([y]) };
        l
    }
    /// The sub-block minimums and their scale `dmin` (Q4_K, Q5_K; Q6_K has
    /// none: its `- 32` is in the lanes).
    fn mins(&self) -> Option<(&[u8; 8], f32)>;
    fn d(&self) -> f32;
}

/// The eight int32 lanes of a Q4_K block, or with `qh` a Q5_K one (its
/// fifth bits added as 16), times each of `T` Q8_K blocks.
#[inline(always)]
unsafe fn k45_lanes<const T: usize>(
    sc: &[u8; 8],
    qs: &[u8; 128],
    qh: Option<&[u8; 32]>,
    ys: [&BlockQ8K; T],
) -> [__m256i; T] {
    // SAFETY: avx2 enabled by the callers; every 32-byte load lies inside
    // `qs` (128 bytes), `qh` (32 bytes) or `y.qs` (256 bytes).
    unsafe {
        let m4 = _mm256_set1_epi8(0xF);
        let m16 = _mm256_set1_epi8(16);
        // Not `Option::map`: the closure would not have AVX2 enabled, so the
        // load would not be inlined into it.
        #[allow(clippy::manual_map)]
        let hbits = match qh {
            Some(qh) => Some(_mm256_loadu_si256(qh.as_ptr() as *const __m256i)),
            None => None,
        };
        let mut sumi = [_mm256_setzero_si256(); T];
        for j in 0..4 {
            let scale_0 = _mm256_set1_epi16(sc[2 * j] as i16);
            let scale_1 = _mm256_set1_epi16(sc[2 * j + 1] as i16);
            let bits = _mm256_loadu_si256(qs.as_ptr().add(32 * j) as *const __m256i);
            let mut q_0 = _mm256_and_si256(bits, m4);
            let mut q_1 = _mm256_and_si256(_mm256_srli_epi16(bits, 4), m4);
            if let Some(hbits) = hbits {
                // Fifth bits 2j and 2j + 1 of each qh byte, as 16 or 0.
                let h0 = _mm256_set1_epi8(1 << (2 * j));
                let h1 = _mm256_set1_epi8(1 << (2 * j + 1));
                let q5h_0 =
                    _mm256_and_si256(_mm256_cmpeq_epi8(_mm256_and_si256(hbits, h0), h0), m16);
                let q5h_1 =
                    _mm256_and_si256(_mm256_cmpeq_epi8(_mm256_and_si256(hbits, h1), h1), m16);
                q_0 = _mm256_add_epi8(q_0, q5h_0);
                q_1 = _mm256_add_epi8(q_1, q5h_1);
            }
            for (y, sumi) in ys.iter().zip(&mut sumi) {
                let q8_0 = _mm256_loadu_si256(y.qs.as_ptr().add(64 * j) as *const __m256i);
                let q8_1 = _mm256_loadu_si256(y.qs.as_ptr().add(64 * j + 32) as *const __m256i);
                let p16_0 = _mm256_madd_epi16(scale_0, _mm256_maddubs_epi16(q_0, q8_0));
                let p16_1 = _mm256_madd_epi16(scale_1, _mm256_maddubs_epi16(q_1, q8_1));
                *sumi = _mm256_add_epi32(*sumi, _mm256_add_epi32(p16_0, p16_1));
            }
        }
        sumi
    }
}

/// [`KLanes`] for Q4_K / Q5_K (`qh`: the field of Q5_K's fifth bits).
macro_rules! k45 {
    ($t:ty $(, $qh:ident)?) => {
        impl KLanes for $t {
            #[inline(always)]
            unsafe fn lanes_tokens<const T: usize>(&self, ys: [&BlockQ8K; T]) -> [__m256i; T] {
                // SAFETY: avx2 enabled by the callers.
                unsafe { k45_lanes(&self.sc, &self.qs, k45!(@qh self $(, $qh)?), ys) }
            }
            #[inline(always)]
            fn mins(&self) -> Option<(&[u8; 8], f32)> {
                Some((&self.m, self.dmin))
            }
            #[inline(always)]
            fn d(&self) -> f32 {
                self.d
            }
        }
    };
    (@qh $b:ident) => {
        None
    };
    (@qh $b:ident, $qh:ident) => {
        Some(&$b.$qh)
    };
}

k45!(BlockQ4K);
k45!(BlockQ5K, qh);

impl KLanes for BlockQ6K {
    #[inline(always)]
    unsafe fn lanes_tokens<const T: usize>(&self, ys: [&BlockQ8K; T]) -> [__m256i; T] {
        // SAFETY: avx2 enabled by the callers; the loads lie inside `self.ql`
        // (128 bytes), `self.qh` (64 bytes), `self.scales` (16 bytes), `y.qs` (256
        // bytes) and `y.bsums` (32 bytes).
        unsafe {
            let m4 = _mm256_set1_epi8(0xF);
            let m3 = _mm256_set1_epi8(3);
            // The `- 32` offset as ggml applies it: `32·madd(bsums, scales)`
            // subtracted from the lanes at the end.
            let scales16 =
                _mm256_cvtepi8_epi16(_mm_loadu_si128(self.scales.as_ptr() as *const __m128i));
            let q8sclsub = ys.map(|y| {
                let bsums = _mm256_loadu_si256(y.bsums.as_ptr() as *const __m256i);
                _mm256_slli_epi32(_mm256_madd_epi16(bsums, scales16), 5)
            });
            let mut sumi = [_mm256_setzero_si256(); T];
            for j in 0..2 {
                let q4bits1 = _mm256_loadu_si256(self.ql.as_ptr().add(64 * j) as *const __m256i);
                let q4bits2 =
                    _mm256_loadu_si256(self.ql.as_ptr().add(64 * j + 32) as *const __m256i);
                let q4bits_h = _mm256_loadu_si256(self.qh.as_ptr().add(32 * j) as *const __m256i);
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
                let scale: [__m256i; 4] = std::array::from_fn(|c| {
                    let s = 8 * j + 2 * c;
                    _mm256_set_m128i(
                        _mm_set1_epi16(self.scales[s + 1] as i16),
                        _mm_set1_epi16(self.scales[s] as i16),
                    )
                });
                for (y, sumi) in ys.iter().zip(&mut sumi) {
                    let mut p = [_mm256_setzero_si256(); 4];
                    for c in 0..4 {
                        let q8 = _mm256_loadu_si256(
                            y.qs.as_ptr().add(128 * j + 32 * c) as *const __m256i
                        );
                        p[c] = _mm256_madd_epi16(scale[c], _mm256_maddubs_epi16(q[c], q8));
                    }
                    *sumi = _mm256_add_epi32(*sumi, _mm256_add_epi32(p[0], p[1]));
                    *sumi = _mm256_add_epi32(*sumi, _mm256_add_epi32(p[2], p[3]));
                }
            }
            std::array::from_fn(|t| _mm256_sub_epi32(sumi[t], q8sclsub[t]))
        }
    }
    #[inline(always)]
    fn mins(&self) -> Option<(&[u8; 8], f32)> {
        None
    }
    #[inline(always)]
    fn d(&self) -> f32 {
        self.d
    }
}

// The row products: `d = d8·d` and `dmin = −d8·dmin` per block, the lanes'
// fma, and each format's minimum term.

impl RowDot for BlockQ4K {
    type W = BlockQ4K;
    type A = BlockQ8K;
    /// The lanes' accumulator and the minimum term's four f32 lanes.
    type Acc = (__m256, __m128);
    type Shared = ();
    #[inline(always)]
    unsafe fn zero() -> (__m256, __m128) {
        // SAFETY: avx2 enabled by the callers.
        unsafe { (_mm256_setzero_ps(), _mm_setzero_ps()) }
    }
    #[inline(always)]
    unsafe fn share(_: &BlockQ8K) {}
    #[inline(always)]
    unsafe fn step(
        (acc, acc_m): (__m256, __m128),
        x: &BlockQ4K,
        y: &BlockQ8K,
        _: (),
    ) -> (__m256, __m128) {
        let d = y.d * x.d;
        let dmin = -y.d * x.dmin;
        // SAFETY: avx2 and fma enabled by the callers.
        unsafe {
            let prod = min_prods(&x.m, y);
            let acc_m = _mm_fmadd_ps(_mm_set1_ps(dmin), _mm_cvtepi32_ps(prod), acc_m);
            let sumi = x.lanes(y);
            let acc = _mm256_fmadd_ps(_mm256_set1_ps(d), _mm256_cvtepi32_ps(sumi), acc);
            (acc, acc_m)
        }
    }
    #[inline(always)]
    unsafe fn finish((acc, acc_m): (__m256, __m128)) -> f32 {
        // SAFETY: avx2 enabled by the callers.
        unsafe {
            let m = _mm_add_ps(acc_m, _mm_movehl_ps(acc_m, acc_m));
            let m = _mm_add_ss(m, _mm_movehdup_ps(m));
            hsum(acc) + _mm_cvtss_f32(m)
        }
    }
}

impl RowDot for BlockQ5K {
    type W = BlockQ5K;
    type A = BlockQ8K;
    /// The lanes' accumulator and the minimum term, one scalar chain.
    type Acc = (__m256, f32);
    type Shared = ();
    #[inline(always)]
    unsafe fn zero() -> (__m256, f32) {
        // SAFETY: avx2 enabled by the callers.
        (unsafe { _mm256_setzero_ps() }, 0.0)
    }
    #[inline(always)]
    unsafe fn share(_: &BlockQ8K) {}
    #[inline(always)]
    unsafe fn step(
        (acc, summs): (__m256, f32),
        x: &BlockQ5K,
        y: &BlockQ8K,
        _: (),
    ) -> (__m256, f32) {
        let d = y.d * x.d;
        let dmin = -y.d * x.dmin;
        // SAFETY: avx2 and fma enabled by the callers.
        unsafe {
            let p = min_prods(&x.m, y);
            let s = _mm_cvtsi128_si32(_mm_hadd_epi32(
                _mm_hadd_epi32(p, _mm_setzero_si128()),
                _mm_setzero_si128(),
            ));
            // GCC contracts ggml's `summs += dmin * s` into an fma.
            let summs = dmin.mul_add(s as f32, summs);
            let sumi = x.lanes(y);
            let acc = _mm256_fmadd_ps(_mm256_set1_ps(d), _mm256_cvtepi32_ps(sumi), acc);
            (acc, summs)
        }
    }
    #[inline(always)]
    unsafe fn finish((acc, summs): (__m256, f32)) -> f32 {
        // SAFETY: avx2 enabled by the callers.
        unsafe { hsum(acc) + summs }
    }
}

impl RowDot for BlockQ6K {
    type W = BlockQ6K;
    type A = BlockQ8K;
    type Acc = __m256;
    type Shared = ();
    #[inline(always)]
    unsafe fn zero() -> __m256 {
        // SAFETY: avx2 enabled by the callers.
        unsafe { _mm256_setzero_ps() }
    }
    #[inline(always)]
    unsafe fn share(_: &BlockQ8K) {}
    #[inline(always)]
    unsafe fn step(acc: __m256, x: &BlockQ6K, y: &BlockQ8K, _: ()) -> __m256 {
        let d = y.d * x.d;
        // SAFETY: avx2 and fma enabled by the callers.
        unsafe { _mm256_fmadd_ps(_mm256_set1_ps(d), _mm256_cvtepi32_ps(x.lanes(y)), acc) }
    }
    #[inline(always)]
    unsafe fn finish(acc: __m256) -> f32 {
        // SAFETY: avx2 enabled by the callers.
        unsafe { hsum(acc) }
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
// super-block, then `scalar::tiled_step` (see the `scalar` module
// comment).

/// Every row of `w` in the tiled order.
pub(crate) fn tiled_safe<B: KLanes>(w: &[B], a: &[BlockQ8K], out: &mut [f32]) {
    // SAFETY: installed in `quant::kernels()` (and called by the tests) only
    // after `samplerd_numerics::features()` reported AVX2 and FMA.
    unsafe { tiled_rows(w, a, out) }
}

#[target_feature(enable = "avx2,fma")]
unsafe fn tiled_rows<B: KLanes>(w: &[B], a: &[BlockQ8K], out: &mut [f32]) {
    let nb = a.len();
    assert!(w.len() >= out.len() * nb);
    for (o, row) in out.iter_mut().zip(w.chunks_exact(nb)) {
        let mut acc = 0f32;
        for (x, y) in row.iter().zip(a) {
            // SAFETY: a hint only (see `prefetch_ahead`).
            unsafe { prefetch_ahead((x as *const B).cast(), 0, std::mem::size_of::<B>()) };
            // SAFETY: avx2 and fma are enabled in this function.
            let s1 = unsafe { hsum_i32(x.lanes(y)) };
            // (A match, not a closure: see `k45_lanes`.)
            let (s2, dmin) = match x.mins() {
                // SAFETY: as above.
                Some((m, dmin)) => (unsafe { hsum_i32_4(min_prods(m, y)) }, dmin),
                None => (0, 0.0),
            };
            acc = tiled_step(s1, s2, x.d(), dmin, y.d, acc);
        }
        *o = acc;
    }
}

/// [`tiled_safe`] for the `n_tok` tokens whose blocks follow one another
/// in `a` (`out` token-major): `T` tokens at a time, each weight block
/// unpacked once for all of them; every output keeps its own order.
pub(crate) fn tiled_tokens_safe<B: KLanes, const T: usize>(
    w: &[B],
    a: &[BlockQ8K],
    n_tok: usize,
    out: &mut [f32],
) {
    // SAFETY: as for `tiled_safe`.
    unsafe { tiled_tokens::<B, T>(w, a, n_tok, out) }
}

#[target_feature(enable = "avx2,fma")]
unsafe fn tiled_tokens<B: KLanes, const T: usize>(
    w: &[B],
    a: &[BlockQ8K],
    n_tok: usize,
    out: &mut [f32],
) {
    let (nb, n_rows) = token_major(n_tok, a.len(), out.len(), w.len());
    let mut t = 0;
    while t + T <= n_tok {
        let ys: [&[BlockQ8K]; T] = std::array::from_fn(|i| &a[(t + i) * nb..(t + i + 1) * nb]);
        for (r, row) in w.chunks_exact(nb).take(n_rows).enumerate() {
            let mut acc = [0f32; T];
            for (i, x) in row.iter().enumerate() {
                // SAFETY: a hint only (see `prefetch_ahead`).
                unsafe { prefetch_ahead((x as *const B).cast(), 0, std::mem::size_of::<B>()) };
                let y: [&BlockQ8K; T] = std::array::from_fn(|k| &ys[k][i]);
                // SAFETY: avx2 and fma are enabled in this function.
                let lanes = unsafe { x.lanes_tokens(y) };
                for k in 0..T {
                    // SAFETY: as above.
                    let s1 = unsafe { hsum_i32(lanes[k]) };
                    let (s2, dmin) = match x.mins() {
                        // SAFETY: as above.
                        Some((m, dmin)) => (unsafe { hsum_i32_4(min_prods(m, y[k])) }, dmin),
                        None => (0, 0.0),
                    };
                    acc[k] = tiled_step(s1, s2, x.d(), dmin, y[k].d, acc[k]);
                }
            }
            for (k, acc) in acc.iter().enumerate() {
                out[(t + k) * n_rows + r] = *acc;
            }
        }
        t += T;
    }
    while t < n_tok {
        let o = &mut out[t * n_rows..(t + 1) * n_rows];
        // SAFETY: as above.
        unsafe { tiled_rows(w, &a[t * nb..(t + 1) * nb], o) };
        t += 1;
    }
}
