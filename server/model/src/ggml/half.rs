//! F16 and BF16 row products in the lane orders of llama.cpp's builds.
//!
//! tinyBLAS (`llamafile_sgemm`) for steps of 2+ tokens, `ggml_vec_dot_f16` /
//! `ggml_vec_dot_bf16` for one token, and the `vdpbf16ps` pairs of an AVX-512
//! BF16 build; in AVX2+F16C registers where the CPU has them, else scalar
//! over the same lanes.

use super::flavor::{Flavor, has_avx512_bf16};
#[cfg(target_arch = "x86_64")]
use super::flavor::{has_f16c, has_fma};
use super::reduce::{reduce_vec_dot, reduce8, reduce16};

/// One row of a half-precision weight matrix: 32-value blocks of f16
/// (IEEE, widened by F16C) or bf16 (widened by a shift) values.
pub trait HalfBlock: Sized + Sync {
    /// bf16 rather than f16.
    const BF16: bool;
    /// The block's 32 stored values, as bits.
    fn bits(&self) -> &[u16; 32];
    /// Value `i` widened to f32 (exact).
    fn value(&self, i: usize) -> f32 {
        let b = self.bits()[i];
        if Self::BF16 {
            f32::from_bits((b as u32) << 16)
        } else {
            half::f16::from_bits(b).to_f32()
        }
    }
}

/// One row of an F16 or BF16 matrix (its blocks, read as they are) times
/// activations already rounded to that type, in the order llama.cpp uses:
/// tinyBLAS (`llamafile_sgemm`) for a step of 2+ tokens (`gemm`), else
/// `ggml_vec_dot_f16` / `ggml_vec_dot_bf16` (the sgemm path takes prompt
/// steps only), for the build `fl` mirrors (BF16 in an AVX-512 build on a
/// CPU with AVX-512 BF16: its `vdpbf16ps` pair order, `dot_bf16_pairs`).
pub fn dot_half_row<B: HalfBlock>(w: &[B], x: &[f32], gemm: bool, fl: Flavor) -> f32 {
    if B::BF16 && fl == Flavor::Avx512 && has_avx512_bf16() {
        return dot_bf16_pairs(w, x, gemm);
    }
    #[cfg(target_arch = "x86_64")]
    if has_fma() && has_f16c() {
        // SAFETY: the CPU supports avx2, fma and f16c (checked just above).
        return unsafe { dot_half_row_simd(w, x, gemm, fl) };
    }
    dot_half_row_scalar(w, x, gemm, fl)
}

/// [`dot_half_row`] for four activation rows of tinyBLAS steps at once
/// (tinyBLAS itself runs blocks of rows × tokens): each result equals
/// `dot_half_row(w, xs[t], true, fl)` bit for bit.
pub fn dot_half_row_x4<B: HalfBlock>(w: &[B], xs: [&[f32]; 4], fl: Flavor) -> [f32; 4] {
    if B::BF16 && fl == Flavor::Avx512 && has_avx512_bf16() {
        return xs.map(|x| dot_bf16_pairs(w, x, true));
    }
    #[cfg(target_arch = "x86_64")]
    if has_fma() && has_f16c() {
        // SAFETY: the CPU supports avx2, fma and f16c (checked just above).
        return unsafe { gemm_half_rows_simd(w, xs, fl) };
    }
    xs.map(|x| dot_half_row_scalar(w, x, true, fl))
}

/// The vector-dot step (values per accumulator round) of `fl` for `B`:
/// `ggml_vec_dot_f16` runs four vectors, `ggml_vec_dot_bf16` 32 values on
/// both x86 builds (four 8-lane vectors, or two 16-lane ones).
fn vec_dot_step<B: HalfBlock>(fl: Flavor) -> usize {
    if B::BF16 { 32 } else { 4 * fl.lanes() }
}

/// The horizontal sums of [`dot_half_row`]'s vector-dot lanes (`lanes[i %
/// step]` holds positions `i`), in f64 as ggml adds them.
fn reduce_vec_dot_half<B: HalfBlock>(lanes: &[f32; 64], fl: Flavor) -> f64 {
    match (B::BF16, fl) {
        (false, _) => reduce_vec_dot(lanes, fl.lanes()),
        // AVX-512F: two 16-lane accumulators, each reduced, summed in f64.
        (true, Flavor::Avx512) => {
            let (c1, c2) = lanes.split_at(16);
            reduce16(c1.try_into().expect("16 lanes")) as f64
                + reduce16(c2[..16].try_into().expect("16 lanes")) as f64
        }
        // AVX2: (c1 + c3) + (c2 + c4), then hi + lo, movehl, movehdup.
        (true, Flavor::Avx2) => {
            let x: [f32; 8] = std::array::from_fn(|e| {
                (lanes[e] + lanes[16 + e]) + (lanes[8 + e] + lanes[24 + e])
            });
            let t = [x[4] + x[0], x[5] + x[1], x[6] + x[2], x[7] + x[3]];
            ((t[0] + t[2]) + (t[1] + t[3])) as f64
        }
    }
}

/// [`dot_half_row`] without intrinsics (the same lane order, scalar).
pub(crate) fn dot_half_row_scalar<B: HalfBlock>(w: &[B], x: &[f32], gemm: bool, fl: Flavor) -> f32 {
    let n = (w.len() * 32).min(x.len());
    let value = |i: usize| w[i / 32].value(i % 32);
    let step = if gemm {
        fl.lanes()
    } else {
        vec_dot_step::<B>(fl)
    };
    let full = n / step * step;
    let mut lanes = [0f32; 64];
    for i in 0..full {
        lanes[i % step] = value(i).mul_add(x[i], lanes[i % step]);
    }
    if gemm {
        let first: &[f32; 16] = lanes.first_chunk().expect("64 lanes");
        let mut s = if fl == Flavor::Avx512 {
            reduce16(first)
        } else {
            reduce8(first)
        };
        for (i, xi) in x.iter().enumerate().take(n).skip(full) {
            s += value(i) * xi;
        }
        s
    } else {
        let mut s = reduce_vec_dot_half::<B>(&lanes, fl);
        for (i, xi) in x.iter().enumerate().take(n).skip(full) {
            s += (value(i) * xi) as f64;
        }
        s as f32
    }
}

/// A BF16 row product as llama.cpp's AVX-512 BF16 build computes it:
/// `vdpbf16ps` lanes, each adding the product of an odd-indexed pair
/// element and then the even one (products exact in f32, each sum rounded;
/// its flushing of subnormals is not reproduced). tinyBLAS (`gemm`, rows
/// of a multiple of 32 values): one 16-lane accumulator over chunks of 32,
/// `_mm512_reduce_add_ps`. `ggml_vec_dot_bf16`: two accumulators over
/// chunks of 64, each reduced, summed in f64, the tail in f64.
pub(crate) fn dot_bf16_pairs<B: HalfBlock>(w: &[B], x: &[f32], gemm: bool) -> f32 {
    let n = (w.len() * 32).min(x.len());
    let value = |i: usize| w[i / 32].value(i % 32);
    let pairs = |lanes: &mut [f32; 16], base: usize| {
        for (j, l) in lanes.iter_mut().enumerate() {
            let (odd, even) = (base + 2 * j + 1, base + 2 * j);
            *l += value(odd) * x[odd];
            *l += value(even) * x[even];
        }
    };
    if gemm && n.is_multiple_of(32) {
        let mut lanes = [0f32; 16];
        for base in (0..n).step_by(32) {
            pairs(&mut lanes, base);
        }
        return reduce16(&lanes);
    }
    let np = n / 64 * 64;
    let (mut c1, mut c2) = ([0f32; 16], [0f32; 16]);
    for base in (0..np).step_by(64) {
        pairs(&mut c1, base);
        pairs(&mut c2, base + 32);
    }
    let mut s = reduce16(&c1) as f64 + reduce16(&c2) as f64;
    for (i, xi) in x.iter().enumerate().take(n).skip(np) {
        s += (value(i) * xi) as f64;
    }
    s as f32
}

/// The lanes of [`dot_half_row`] in 8-wide vectors, for `T` activation rows
/// at once (independent fma chains, so the loop is not bound by the fma
/// latency of one chain): vector `g` (values `8g..8g+8`) is fma'd into
/// accumulator `g % V`, so lane `i % 8V` accumulates positions `i`,
/// `i + 8V`, … in order — the scalar lane order above. Written with
/// intrinsics because the compiler left the scalar form in 128-bit pieces
/// (F16 decode ran at 0.2x llama.cpp's speed). bf16 × bf16 products are
/// exact in f32, so ggml's multiply-then-add for BF16 equals this fma.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn half_lanes<B: HalfBlock, const V: usize, const T: usize>(
    w: &[B],
    xs: [&[f32]; T],
    n_vec: usize,
) -> [[f32; 64]; T] {
    use std::arch::x86_64::*;
    assert!(n_vec <= w.len() * 4, "the row covers the vectors");
    for x in xs {
        assert!(n_vec * 8 <= x.len(), "the activations cover the vectors");
    }
    let mut acc = [[_mm256_setzero_ps(); V]; T];
    for g in 0..n_vec {
        let block = &w[g / 4];
        // SAFETY: values `g % 4 * 8 .. + 8` of a 32-value block (unaligned).
        let raw =
            unsafe { _mm_loadu_si128(block.bits().as_ptr().add(g % 4 * 8) as *const __m128i) };
        let wv = if B::BF16 {
            _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(raw), 16))
        } else {
            _mm256_cvtph_ps(raw)
        };
        for t in 0..T {
            // SAFETY: `8g + 8 <= x.len()` (asserted above); unaligned.
            let xv = unsafe { _mm256_loadu_ps(xs[t].as_ptr().add(8 * g)) };
            acc[t][g % V] = _mm256_fmadd_ps(wv, xv, acc[t][g % V]);
        }
    }
    let mut out = [[0f32; 64]; T];
    for t in 0..T {
        for (v, a) in acc[t].iter().enumerate() {
            // SAFETY: `8v + 8 <= 8V <= 64`.
            unsafe { _mm256_storeu_ps(out[t].as_mut_ptr().add(8 * v), *a) };
        }
    }
    out
}

/// tinyBLAS row products of `T` activation rows at once.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn gemm_half_rows_simd<B: HalfBlock, const T: usize>(
    w: &[B],
    xs: [&[f32]; T],
    fl: Flavor,
) -> [f32; T] {
    let n = xs.iter().fold(w.len() * 32, |n, x| n.min(x.len()));
    let lanes = fl.lanes();
    let c = n / lanes * lanes;
    // SAFETY: avx2, fma and f16c are enabled in this function.
    let acc = unsafe {
        if fl == Flavor::Avx512 {
            half_lanes::<B, 2, T>(w, xs, c / 8)
        } else {
            half_lanes::<B, 1, T>(w, xs, c / 8)
        }
    };
    std::array::from_fn(|t| {
        let first: &[f32; 16] = acc[t].first_chunk().expect("64 lanes");
        let mut s = if lanes == 16 {
            reduce16(first)
        } else {
            reduce8(first)
        };
        for i in c..n {
            s += w[i / 32].value(i % 32) * xs[t][i];
        }
        s
    })
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn dot_half_row_simd<B: HalfBlock>(w: &[B], x: &[f32], gemm: bool, fl: Flavor) -> f32 {
    if gemm {
        // SAFETY: avx2, fma and f16c are enabled in this function.
        let [s] = unsafe { gemm_half_rows_simd(w, [x], fl) };
        return s;
    }
    let n = (w.len() * 32).min(x.len());
    let step = vec_dot_step::<B>(fl);
    let np = n / step * step;
    // SAFETY: as above.
    let [acc] = unsafe {
        match step {
            64 => half_lanes::<B, 8, 1>(w, [x], np / 8),
            _ => half_lanes::<B, 4, 1>(w, [x], np / 8),
        }
    };
    let mut s = reduce_vec_dot_half::<B>(&acc, fl);
    for (i, xi) in x.iter().enumerate().take(n).skip(np) {
        s += (w[i / 32].value(i % 32) * xi) as f64;
    }
    s as f32
}
