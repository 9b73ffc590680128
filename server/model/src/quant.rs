//! Quantised weight matrices and the matrix×vector kernels of the hot path.
//!
//! Weights stay in the block formats llama.cpp uses — Q4_1 (4-bit with
//! scale and minimum) and Q8_0 (8-bit with scale), 32 values per block, and
//! the K-quants Q4_K, Q5_K and Q6_K (256 values per block, `quant_k`) — with
//! their f16 scales widened to f32 at load (exact). Q4_0 and Q5_0 become
//! Q8_0 blocks without loss (`d·(q − 8)`, `d·(q − 16)` are Q8_0 values with the
//! same scale, and ggml's `ggml_vec_dot_q{4,5}_0_q8_0` do exactly what
//! `ggml_vec_dot_q8_0_q8_0` does on them: the same int8 products, one fma per
//! block, `hsum_float_8`). Every other GGUF type is dequantised at load and
//! requantised to Q8_0. Activations are quantised per 32-value block to 8
//! bits exactly like llama.cpp's `quantize_row_q8_1` (scale rounded to f16,
//! plus the block sum for Q4_1's minimum term), and for K-quant weights per
//! 256 values like `quantize_row_q8_K_ref` ([`Acts`] carries both), so the
//! dot products are the ones ggml's `ggml_vec_dot_*` compute, in the same
//! order.
//!
//! Kernels: AVX2+FMA chosen at run time (`samplerd_numerics::features`), with a
//! portable scalar fallback (forced with `SAMPLERD_MODEL_SCALAR=1`); [`QMatrix::matmul`] splits output rows over the
//! [`ThreadPool`].

use crate::pool::{ThreadPool, split_range};
pub use crate::quant_convert::KQuant;
use crate::quant_k::{self, BlockQ4K, BlockQ5K, BlockQ6K, BlockQ8K, QK_K};
use crate::quant_q5_0::{self, BlockQ5_0};
use crate::quant_q5_1::{self, BlockQ5_1};
use half::f16;

/// Values per quantisation block.
pub const QK: usize = 32;

/// A Q8_0 weight block: `x[i] = d * qs[i]`.
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct BlockQ8_0 {
    pub d: f32,
    pub qs: [i8; QK],
}

/// A Q4_1 weight block: `x[i] = d * q[i] + m`; `q[j]` is the low nibble of
/// `qs[j]` for `j < 16` and the high nibble of `qs[j - 16]` otherwise.
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct BlockQ4_1 {
    pub d: f32,
    pub m: f32,
    pub qs: [u8; QK / 2],
}

/// A quantised activation block (llama.cpp's `block_q8_1`, scales widened):
/// `x[i] ≈ d * qs[i]`, `s = d * Σ qs` (both rounded through f16).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default)]
pub struct BlockQ8_1 {
    pub d: f32,
    pub s: f32,
    pub qs: [i8; QK],
}

/// A weight matrix, `rows × cols`, row-major, in one of the kernel formats.
#[derive(Debug, Clone)]
pub enum QMatrix {
    Q8_0 {
        rows: usize,
        cols: usize,
        blocks: Vec<BlockQ8_0>,
    },
    Q4_1 {
        rows: usize,
        cols: usize,
        blocks: Vec<BlockQ4_1>,
    },
    Q5_0 {
        rows: usize,
        cols: usize,
        blocks: Vec<BlockQ5_0>,
    },
    Q5_1 {
        rows: usize,
        cols: usize,
        blocks: Vec<BlockQ5_1>,
    },
    Q4K {
        rows: usize,
        cols: usize,
        blocks: Vec<BlockQ4K>,
    },
    Q5K {
        rows: usize,
        cols: usize,
        blocks: Vec<BlockQ5K>,
    },
    Q6K {
        rows: usize,
        cols: usize,
        blocks: Vec<BlockQ6K>,
    },
}

/// One batch of quantised activations (`n_tok` rows): the Q8_1 blocks every
/// 32-value format uses, and the Q8_K blocks K-quant weights use (empty when
/// no consumer needs them; see [`QMatrix::needs_q8k`]).
/// `tiled[t]`: whether token `t`'s K-quant products mirror ggml's tiled
/// matmul (the rows of a sequence's step of 8+ tokens) rather than its vector
/// dot; empty means none (see the `quant_k` module comment).
#[derive(Clone, Copy, Debug)]
pub struct Acts<'a> {
    pub q8: &'a [BlockQ8_1],
    pub q8k: &'a [BlockQ8K],
    pub tiled: &'a [bool],
}

impl<'a> Acts<'a> {
    /// Q8_1 activations only (32-value formats, vector-dot order).
    pub fn q8(q8: &'a [BlockQ8_1]) -> Self {
        Acts {
            q8,
            q8k: &[],
            tiled: &[],
        }
    }
}

fn f16_le(b: &[u8]) -> f32 {
    f16::from_le_bytes([b[0], b[1]]).to_f32()
}

impl QMatrix {
    pub fn rows(&self) -> usize {
        match self {
            QMatrix::Q8_0 { rows, .. }
            | QMatrix::Q4_1 { rows, .. }
            | QMatrix::Q5_0 { rows, .. }
            | QMatrix::Q5_1 { rows, .. }
            | QMatrix::Q4K { rows, .. }
            | QMatrix::Q5K { rows, .. }
            | QMatrix::Q6K { rows, .. } => *rows,
        }
    }
    pub fn cols(&self) -> usize {
        match self {
            QMatrix::Q8_0 { cols, .. }
            | QMatrix::Q4_1 { cols, .. }
            | QMatrix::Q5_0 { cols, .. }
            | QMatrix::Q5_1 { cols, .. }
            | QMatrix::Q4K { cols, .. }
            | QMatrix::Q5K { cols, .. }
            | QMatrix::Q6K { cols, .. } => *cols,
        }
    }
    pub fn format(&self) -> &'static str {
        match self {
            QMatrix::Q8_0 { .. } => "q8_0",
            QMatrix::Q4_1 { .. } => "q4_1",
            QMatrix::Q5_0 { .. } => "q5_0",
            QMatrix::Q5_1 { .. } => "q5_1",
            QMatrix::Q4K { .. } => "q4_K",
            QMatrix::Q5K { .. } => "q5_K",
            QMatrix::Q6K { .. } => "q6_K",
        }
    }

    /// Whether products with this matrix need Q8_K activations.
    pub fn needs_q8k(&self) -> bool {
        matches!(
            self,
            QMatrix::Q4K { .. } | QMatrix::Q5K { .. } | QMatrix::Q6K { .. }
        )
    }

    /// Bytes the weights take in memory.
    pub fn nbytes(&self) -> usize {
        match self {
            QMatrix::Q8_0 { blocks, .. } => std::mem::size_of_val(&blocks[..]),
            QMatrix::Q4_1 { blocks, .. } => std::mem::size_of_val(&blocks[..]),
            QMatrix::Q5_0 { blocks, .. } => std::mem::size_of_val(&blocks[..]),
            QMatrix::Q5_1 { blocks, .. } => std::mem::size_of_val(&blocks[..]),
            QMatrix::Q4K { blocks, .. } => std::mem::size_of_val(&blocks[..]),
            QMatrix::Q5K { blocks, .. } => std::mem::size_of_val(&blocks[..]),
            QMatrix::Q6K { blocks, .. } => std::mem::size_of_val(&blocks[..]),
        }
    }

    /// From raw GGUF Q8_0 bytes (34 bytes per block: f16 d, 32 × i8).
    pub fn from_q8_0_bytes(rows: usize, cols: usize, raw: &[u8]) -> Option<Self> {
        let nb = rows * cols / QK;
        if !cols.is_multiple_of(QK) || raw.len() != nb * 34 {
            return None;
        }
        let blocks = raw
            .chunks_exact(34)
            .map(|c| {
                let mut qs = [0i8; QK];
                for (q, &b) in qs.iter_mut().zip(&c[2..]) {
                    *q = b as i8;
                }
                BlockQ8_0 { d: f16_le(c), qs }
            })
            .collect();
        Some(QMatrix::Q8_0 { rows, cols, blocks })
    }

    /// From raw GGUF Q4_1 bytes (20 bytes per block: f16 d, f16 m, 16 × u8).
    pub fn from_q4_1_bytes(rows: usize, cols: usize, raw: &[u8]) -> Option<Self> {
        let nb = rows * cols / QK;
        if !cols.is_multiple_of(QK) || raw.len() != nb * 20 {
            return None;
        }
        let blocks = raw
            .chunks_exact(20)
            .map(|c| {
                let mut qs = [0u8; QK / 2];
                qs.copy_from_slice(&c[4..20]);
                BlockQ4_1 {
                    d: f16_le(c),
                    m: f16_le(&c[2..]),
                    qs,
                }
            })
            .collect();
        Some(QMatrix::Q4_1 { rows, cols, blocks })
    }

    /// Quantises f32 rows to Q8_0 (llama.cpp's reference `quantize_row_q8_0`,
    /// scale rounded to f16).
    pub fn q8_0_from_f32(rows: usize, cols: usize, data: &[f32]) -> Option<Self> {
        if !cols.is_multiple_of(QK) || data.len() != rows * cols {
            return None;
        }
        let blocks = data
            .chunks_exact(QK)
            .map(|x| {
                let amax = x.iter().fold(0f32, |a, v| a.max(v.abs()));
                let d = amax / 127.0;
                let id = if d != 0.0 { 1.0 / d } else { 0.0 };
                let mut qs = [0i8; QK];
                for (q, v) in qs.iter_mut().zip(x) {
                    *q = (v * id).round() as i8;
                }
                BlockQ8_0 {
                    d: f16::from_f32(d).to_f32(),
                    qs,
                }
            })
            .collect();
        Some(QMatrix::Q8_0 { rows, cols, blocks })
    }

    /// Dequantises row `r` into `out` (`cols` values): the embedding lookup.
    pub fn dequant_row(&self, r: usize, out: &mut [f32]) {
        match self {
            QMatrix::Q8_0 { cols, blocks, .. } => {
                let nb = cols / QK;
                for (b, o) in blocks[r * nb..(r + 1) * nb]
                    .iter()
                    .zip(out.chunks_exact_mut(QK))
                {
                    for (x, &q) in o.iter_mut().zip(&b.qs) {
                        *x = b.d * q as f32;
                    }
                }
            }
            QMatrix::Q4_1 { cols, blocks, .. } => {
                let nb = cols / QK;
                for (b, o) in blocks[r * nb..(r + 1) * nb]
                    .iter()
                    .zip(out.chunks_exact_mut(QK))
                {
                    for j in 0..QK / 2 {
                        o[j] = b.d * (b.qs[j] & 0x0F) as f32 + b.m;
                        o[j + QK / 2] = b.d * (b.qs[j] >> 4) as f32 + b.m;
                    }
                }
            }
            QMatrix::Q5_0 { cols, blocks, .. } => {
                let nb = cols / QK;
                quant_q5_0::dequant(&blocks[r * nb..(r + 1) * nb], out);
            }
            QMatrix::Q5_1 { cols, blocks, .. } => {
                let nb = cols / QK;
                quant_q5_1::dequant(&blocks[r * nb..(r + 1) * nb], out);
            }
            QMatrix::Q4K { cols, blocks, .. } => {
                let nb = cols / QK_K;
                quant_k::dequant_q4k(&blocks[r * nb..(r + 1) * nb], out);
            }
            QMatrix::Q5K { cols, blocks, .. } => {
                let nb = cols / QK_K;
                quant_k::dequant_q5k(&blocks[r * nb..(r + 1) * nb], out);
            }
            QMatrix::Q6K { cols, blocks, .. } => {
                let nb = cols / QK_K;
                quant_k::dequant_q6k(&blocks[r * nb..(r + 1) * nb], out);
            }
        }
    }

    /// `out[t * rows + r] = W[r] · x[t]` for every token `t` of the quantised
    /// activations `xq` (`n_tok × cols/32` Q8_1 blocks, or for K-quants
    /// `n_tok × cols/256` Q8_K blocks), rows split over the pool.
    pub fn matmul(&self, pool: &ThreadPool, xq: Acts<'_>, n_tok: usize, out: &mut [f32]) {
        let rows = self.rows();
        let nb = if self.needs_q8k() {
            assert_eq!(
                xq.q8k.len(),
                n_tok * self.cols() / QK_K,
                "Q8_K activation blocks"
            );
            self.cols() / QK_K
        } else {
            assert_eq!(xq.q8.len(), n_tok * self.cols() / QK, "activation blocks");
            self.cols() / QK
        };
        assert_eq!(out.len(), n_tok * rows, "output length");
        let out_ptr = SyncPtr(out.as_mut_ptr());
        let k = kernels();
        let fused = quant_k::tiled_fused();
        let tiled = |t: usize| xq.tiled.get(t).copied().unwrap_or(false);
        pool.run(&|i, n| {
            let range = split_range(rows, i, n, 16);
            let out_ptr = &out_ptr;
            // Tiles of rows keep a slice of the weights in L1/L2 while every
            // token's activations stream past it.
            let mut r0 = range.start;
            // Several tokens: a Q5_0 tile is expanded once to the equal Q8_0
            // blocks (same products, same order: see `quant_q5_0`) instead of
            // once per token.
            let mut expanded: Vec<BlockQ8_0> = Vec::new();
            while r0 < range.end {
                let r1 = (r0 + 64).min(range.end);
                if let (QMatrix::Q5_0 { blocks, .. }, true) = (self, n_tok > 1) {
                    expanded.clear();
                    expanded.extend(blocks[r0 * nb..r1 * nb].iter().map(|b| BlockQ8_0 {
                        d: b.d,
                        qs: quant_q5_0::values(b),
                    }));
                }
                for t in 0..n_tok {
                    let (a, ak) = if self.needs_q8k() {
                        (&[][..], &xq.q8k[t * nb..(t + 1) * nb])
                    } else {
                        (&xq.q8[t * nb..(t + 1) * nb], &[][..])
                    };
                    // SAFETY: threads write disjoint row ranges of each token's
                    // output row (`split_range` partitions `0..rows`), and
                    // `out` outlives `pool.run`, which returns only after all
                    // parts finish; `t * rows + r1 <= out.len()`.
                    let dst = unsafe {
                        std::slice::from_raw_parts_mut(out_ptr.0.add(t * rows + r0), r1 - r0)
                    };
                    match self {
                        QMatrix::Q8_0 { blocks, .. } => (k.q8_0)(&blocks[r0 * nb..r1 * nb], a, dst),
                        QMatrix::Q4_1 { blocks, .. } => (k.q4_1)(&blocks[r0 * nb..r1 * nb], a, dst),
                        QMatrix::Q5_0 { .. } if n_tok > 1 => (k.q8_0)(&expanded, a, dst),
                        QMatrix::Q5_0 { blocks, .. } => (k.q5_0)(&blocks[r0 * nb..r1 * nb], a, dst),
                        QMatrix::Q5_1 { blocks, .. } => (k.q5_1)(&blocks[r0 * nb..r1 * nb], a, dst),
                        QMatrix::Q4K { blocks, .. } if tiled(t) => {
                            (k.q4k_t)(&blocks[r0 * nb..r1 * nb], ak, dst, fused)
                        }
                        QMatrix::Q5K { blocks, .. } if tiled(t) => {
                            (k.q5k_t)(&blocks[r0 * nb..r1 * nb], ak, dst, fused)
                        }
                        QMatrix::Q6K { blocks, .. } if tiled(t) => {
                            (k.q6k_t)(&blocks[r0 * nb..r1 * nb], ak, dst, fused)
                        }
                        QMatrix::Q4K { blocks, .. } => (k.q4k)(&blocks[r0 * nb..r1 * nb], ak, dst),
                        QMatrix::Q5K { blocks, .. } => (k.q5k)(&blocks[r0 * nb..r1 * nb], ak, dst),
                        QMatrix::Q6K { blocks, .. } => (k.q6k)(&blocks[r0 * nb..r1 * nb], ak, dst),
                    }
                }
                r0 = r1;
            }
        });
    }
}

struct SyncPtr(*mut f32);
// SAFETY: used only to hand disjoint output ranges to pool threads (see matmul).
unsafe impl Sync for SyncPtr {}

/// Quantises `x` (a multiple of 32 values) into Q8_1 activation blocks like
/// llama.cpp's `quantize_row_q8_1` (AVX2 path: `id = 127/amax`, round half to
/// even, `d` and `s` through f16).
pub fn quantize_q8_1(x: &[f32], out: &mut [BlockQ8_1]) {
    debug_assert_eq!(x.len(), out.len() * QK);
    for (b, x) in out.iter_mut().zip(x.chunks_exact(QK)) {
        let amax = x.iter().fold(0f32, |a, v| a.max(v.abs()));
        let d = amax / 127.0;
        let id = if amax != 0.0 { 127.0 / amax } else { 0.0 };
        let mut sum = 0i32;
        for (q, v) in b.qs.iter_mut().zip(x) {
            // Round half to even without a libm call (|v * id| <= 127).
            let r = (((v * id) + 12_582_912.0) - 12_582_912.0) as i32;
            *q = r as i8;
            sum += r;
        }
        b.d = f16::from_f32(d).to_f32();
        b.s = f16::from_f32(d * sum as f32).to_f32();
    }
}

struct Kernels {
    name: &'static str,
    q8_0: fn(&[BlockQ8_0], &[BlockQ8_1], &mut [f32]),
    q4_1: fn(&[BlockQ4_1], &[BlockQ8_1], &mut [f32]),
    q5_0: fn(&[BlockQ5_0], &[BlockQ8_1], &mut [f32]),
    q5_1: fn(&[BlockQ5_1], &[BlockQ8_1], &mut [f32]),
    q4k: fn(&[BlockQ4K], &[BlockQ8K], &mut [f32]),
    q5k: fn(&[BlockQ5K], &[BlockQ8K], &mut [f32]),
    q6k: fn(&[BlockQ6K], &[BlockQ8K], &mut [f32]),
    q4k_t: TiledFn<BlockQ4K>,
    q5k_t: TiledFn<BlockQ5K>,
    q6k_t: TiledFn<BlockQ6K>,
}

/// A tiled-order K-quant kernel (`fused`: see `quant_k::tiled_fused`).
type TiledFn<B> = fn(&[B], &[BlockQ8K], &mut [f32], bool);

fn kernels() -> &'static Kernels {
    static K: std::sync::OnceLock<Kernels> = std::sync::OnceLock::new();
    K.get_or_init(|| {
        #[cfg(target_arch = "x86_64")]
        {
            if std::env::var_os("SAMPLERD_MODEL_SCALAR").is_none()
                && samplerd_numerics::features().avx2()
                && samplerd_numerics::features().fma()
            {
                return Kernels {
                    name: "avx2",
                    q8_0: avx2::rows_q8_0_safe,
                    q4_1: avx2::rows_q4_1_safe,
                    q5_0: quant_q5_0::avx2::rows_safe,
                    q5_1: quant_q5_1::avx2::rows_safe,
                    q4k: crate::quant_k_avx2::rows_q4k_safe,
                    q5k: crate::quant_k_avx2::rows_q5k_safe,
                    q6k: crate::quant_k_avx2::rows_q6k_safe,
                    q4k_t: crate::quant_k_avx2::tiled_rows_q4k_safe,
                    q5k_t: crate::quant_k_avx2::tiled_rows_q5k_safe,
                    q6k_t: crate::quant_k_avx2::tiled_rows_q6k_safe,
                };
            }
        }
        Kernels {
            name: "scalar",
            q8_0: scalar::rows_q8_0,
            q4_1: scalar::rows_q4_1,
            q5_0: quant_q5_0::scalar::rows,
            q5_1: quant_q5_1::scalar::rows,
            q4k: quant_k::scalar::rows_q4k,
            q5k: quant_k::scalar::rows_q5k,
            q6k: quant_k::scalar::rows_q6k,
            q4k_t: quant_k::scalar::tiled_rows_q4k,
            q5k_t: quant_k::scalar::tiled_rows_q5k,
            q6k_t: quant_k::scalar::tiled_rows_q6k,
        }
    })
}

/// Which kernel family is in use ("avx2" or "scalar").
pub fn kernel_name() -> &'static str {
    kernels().name
}

/// Portable kernels (also the reference the AVX2 ones are tested against).
pub mod scalar {
    use super::*;

    // Same arithmetic as the AVX2 kernels, lane by lane: eight int32 lanes
    // of four products each, one fma per lane and block, `hsum_float_8`.

    #[inline(always)]
    fn hsum8(acc: &[f32; 8]) -> f32 {
        let t = [
            acc[0] + acc[4],
            acc[1] + acc[5],
            acc[2] + acc[6],
            acc[3] + acc[7],
        ];
        (t[0] + t[2]) + (t[1] + t[3])
    }

    pub fn dot_q8_0(w: &[BlockQ8_0], a: &[BlockQ8_1]) -> f32 {
        let mut acc = [0f32; 8];
        for (w, a) in w.iter().zip(a) {
            let d = w.d * a.d;
            for (l, acc) in acc.iter_mut().enumerate() {
                let s: i32 = (4 * l..4 * l + 4)
                    .map(|j| w.qs[j] as i32 * a.qs[j] as i32)
                    .sum();
                *acc = d.mul_add(s as f32, *acc);
            }
        }
        hsum8(&acc)
    }

    pub fn dot_q4_1(w: &[BlockQ4_1], a: &[BlockQ8_1]) -> f32 {
        let mut acc = [0f32; 8];
        let mut summs = 0f32;
        for (w, a) in w.iter().zip(a) {
            summs += w.m * a.s;
            let d = w.d * a.d;
            for (l, acc) in acc.iter_mut().enumerate() {
                let s: i32 = (4 * l..4 * l + 4)
                    .map(|j| {
                        let q = if j < QK / 2 {
                            w.qs[j] & 0x0F
                        } else {
                            w.qs[j - QK / 2] >> 4
                        };
                        q as i32 * a.qs[j] as i32
                    })
                    .sum();
                *acc = d.mul_add(s as f32, *acc);
            }
        }
        hsum8(&acc) + summs
    }

    pub fn rows_q8_0(w: &[BlockQ8_0], a: &[BlockQ8_1], out: &mut [f32]) {
        let nb = a.len();
        for (o, row) in out.iter_mut().zip(w.chunks_exact(nb)) {
            *o = dot_q8_0(row, a);
        }
    }

    pub fn rows_q4_1(w: &[BlockQ4_1], a: &[BlockQ8_1], out: &mut [f32]) {
        let nb = a.len();
        for (o, row) in out.iter_mut().zip(w.chunks_exact(nb)) {
            *o = dot_q4_1(row, a);
        }
    }
}

#[cfg(target_arch = "x86_64")]
mod avx2 {
    use super::*;
    use std::arch::x86_64::*;

    pub fn rows_q8_0_safe(w: &[BlockQ8_0], a: &[BlockQ8_1], out: &mut [f32]) {
        // SAFETY: this function is only installed in `kernels()` after
        // `samplerd_numerics::features()` reported AVX2 and FMA.
        unsafe { rows_q8_0(w, a, out) }
    }

    pub fn rows_q4_1_safe(w: &[BlockQ4_1], a: &[BlockQ8_1], out: &mut [f32]) {
        // SAFETY: as for `rows_q8_0_safe`.
        unsafe { rows_q4_1(w, a, out) }
    }

    #[inline(always)]
    unsafe fn hsum(v: __m256) -> f32 {
        // SAFETY: callers run with avx2 enabled (target_feature functions).
        unsafe {
            let lo = _mm256_castps256_ps128(v);
            let hi = _mm256_extractf128_ps(v, 1);
            let s = _mm_add_ps(lo, hi);
            let s = _mm_add_ps(s, _mm_movehl_ps(s, s));
            let s = _mm_add_ss(s, _mm_movehdup_ps(s));
            _mm_cvtss_f32(s)
        }
    }

    /// One Q8_0 block product (llama.cpp's `mul_sum_i8_pairs_float`).
    #[inline(always)]
    unsafe fn q8_block(w: &BlockQ8_0, qy: __m256i, ones: __m256i) -> __m256 {
        // SAFETY: callers run with avx2 enabled; the 32-byte load is `w.qs`.
        unsafe {
            let qx = _mm256_loadu_si256(w.qs.as_ptr() as *const __m256i);
            let p = _mm256_maddubs_epi16(_mm256_sign_epi8(qx, qx), _mm256_sign_epi8(qy, qx));
            _mm256_cvtepi32_ps(_mm256_madd_epi16(p, ones))
        }
    }

    /// One Q4_1 block product (llama.cpp's `mul_sum_us8_pairs_float`).
    #[inline(always)]
    unsafe fn q41_block(w: &BlockQ4_1, qy: __m256i, ones: __m256i, low: __m256i) -> __m256 {
        // SAFETY: callers run with avx2 enabled; the 16-byte load is `w.qs`.
        unsafe {
            let b = _mm_loadu_si128(w.qs.as_ptr() as *const __m128i);
            let qx = _mm256_and_si256(_mm256_set_m128i(_mm_srli_epi16(b, 4), b), low);
            _mm256_cvtepi32_ps(_mm256_madd_epi16(_mm256_maddubs_epi16(qx, qy), ones))
        }
    }

    // Both kernels keep llama.cpp's per-row order exactly (one accumulator
    // per row, blocks in order, `hsum_float_8`, then + the min term) and
    // run four rows at once so the four fma chains overlap.

    #[target_feature(enable = "avx2,fma")]
    unsafe fn rows_q8_0(w: &[BlockQ8_0], a: &[BlockQ8_1], out: &mut [f32]) {
        let nb = a.len();
        assert!(w.len() >= out.len() * nb);
        let ones = _mm256_set1_epi16(1);
        let mut r = 0;
        while r + 4 <= out.len() {
            let rows = [
                &w[r * nb..],
                &w[(r + 1) * nb..],
                &w[(r + 2) * nb..],
                &w[(r + 3) * nb..],
            ];
            let mut acc = [_mm256_setzero_ps(); 4];
            for i in 0..nb {
                // SAFETY: `i < nb`; every row slice has at least `nb` blocks.
                unsafe {
                    let qy = _mm256_loadu_si256(a[i].qs.as_ptr() as *const __m256i);
                    for k in 0..4 {
                        let b = &rows[k][i];
                        acc[k] = _mm256_fmadd_ps(
                            _mm256_set1_ps(b.d * a[i].d),
                            q8_block(b, qy, ones),
                            acc[k],
                        );
                    }
                }
            }
            for k in 0..4 {
                // SAFETY: avx2 is enabled in this function.
                out[r + k] = unsafe { hsum(acc[k]) };
            }
            r += 4;
        }
        while r < out.len() {
            let row = &w[r * nb..(r + 1) * nb];
            let mut acc = _mm256_setzero_ps();
            for i in 0..nb {
                // SAFETY: `i < nb`.
                unsafe {
                    let qy = _mm256_loadu_si256(a[i].qs.as_ptr() as *const __m256i);
                    acc = _mm256_fmadd_ps(
                        _mm256_set1_ps(row[i].d * a[i].d),
                        q8_block(&row[i], qy, ones),
                        acc,
                    );
                }
            }
            // SAFETY: avx2 is enabled in this function.
            out[r] = unsafe { hsum(acc) };
            r += 1;
        }
    }

    #[target_feature(enable = "avx2,fma")]
    unsafe fn rows_q4_1(w: &[BlockQ4_1], a: &[BlockQ8_1], out: &mut [f32]) {
        let nb = a.len();
        assert!(w.len() >= out.len() * nb);
        let ones = _mm256_set1_epi16(1);
        let low = _mm256_set1_epi8(0x0F);
        let mut r = 0;
        while r + 4 <= out.len() {
            let rows = [
                &w[r * nb..],
                &w[(r + 1) * nb..],
                &w[(r + 2) * nb..],
                &w[(r + 3) * nb..],
            ];
            let mut acc = [_mm256_setzero_ps(); 4];
            let mut summs = [0f32; 4];
            for i in 0..nb {
                // SAFETY: `i < nb`; every row slice has at least `nb` blocks.
                unsafe {
                    let qy = _mm256_loadu_si256(a[i].qs.as_ptr() as *const __m256i);
                    for k in 0..4 {
                        let b = &rows[k][i];
                        summs[k] += b.m * a[i].s;
                        acc[k] = _mm256_fmadd_ps(
                            _mm256_set1_ps(b.d * a[i].d),
                            q41_block(b, qy, ones, low),
                            acc[k],
                        );
                    }
                }
            }
            for k in 0..4 {
                // SAFETY: avx2 is enabled in this function.
                out[r + k] = unsafe { hsum(acc[k]) } + summs[k];
            }
            r += 4;
        }
        while r < out.len() {
            let row = &w[r * nb..(r + 1) * nb];
            let mut acc = _mm256_setzero_ps();
            let mut summs = 0f32;
            for i in 0..nb {
                // SAFETY: `i < nb`.
                unsafe {
                    let qy = _mm256_loadu_si256(a[i].qs.as_ptr() as *const __m256i);
                    summs += row[i].m * a[i].s;
                    acc = _mm256_fmadd_ps(
                        _mm256_set1_ps(row[i].d * a[i].d),
                        q41_block(&row[i], qy, ones, low),
                        acc,
                    );
                }
            }
            // SAFETY: avx2 is enabled in this function.
            out[r] = unsafe { hsum(acc) } + summs;
            r += 1;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn lcg(seed: &mut u64) -> f32 {
        *seed = seed
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        ((*seed >> 33) as f32 / (1u64 << 31) as f32) * 2.0 - 1.0
    }

    #[test]
    fn kernels_match_scalar_and_f32() {
        let (rows, cols) = (37, 96);
        let mut seed = 7;
        let w: Vec<f32> = (0..rows * cols).map(|_| lcg(&mut seed)).collect();
        let x: Vec<f32> = (0..cols).map(|_| lcg(&mut seed) * 3.0).collect();
        let mut xq = vec![BlockQ8_1::default(); cols / QK];
        quantize_q8_1(&x, &mut xq);
        let q8 = QMatrix::q8_0_from_f32(rows, cols, &w).unwrap();
        // A Q4_1 matrix from raw bytes (d = 0.1, m = -0.75, nibbles from the lcg).
        let mut raw = Vec::new();
        for _ in 0..rows * cols / QK {
            raw.extend_from_slice(&f16::from_f32(0.1).to_le_bytes());
            raw.extend_from_slice(&f16::from_f32(-0.75).to_le_bytes());
            for _ in 0..16 {
                raw.push(((lcg(&mut seed) + 1.0) * 127.0) as u8);
            }
        }
        let q4 = QMatrix::from_q4_1_bytes(rows, cols, &raw).unwrap();
        let pool = ThreadPool::new(2);
        for m in [&q8, &q4] {
            let mut out = vec![0f32; rows];
            m.matmul(&pool, Acts::q8(&xq), 1, &mut out);
            let mut row = vec![0f32; cols];
            for r in 0..rows {
                let reference = match m {
                    QMatrix::Q8_0 { blocks, .. } => {
                        scalar::dot_q8_0(&blocks[r * 3..r * 3 + 3], &xq)
                    }
                    QMatrix::Q4_1 { blocks, .. } => {
                        scalar::dot_q4_1(&blocks[r * 3..r * 3 + 3], &xq)
                    }
                    _ => unreachable!(),
                };
                // The SIMD kernels and the scalar reference do the same float
                // operations in the same order: equal bits.
                assert_eq!(
                    out[r].to_bits(),
                    reference.to_bits(),
                    "{} row {r}",
                    m.format()
                );
                m.dequant_row(r, &mut row);
                let exact: f32 = row.iter().zip(&x).map(|(a, b)| a * b).sum();
                assert!(
                    (out[r] - exact).abs() < 0.05 * (1.0 + exact.abs()),
                    "{} row {r}: {} vs {exact}",
                    m.format(),
                    out[r]
                );
            }
        }
    }
}
