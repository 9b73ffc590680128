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
//! Kernels (`quant_kernels`): AVX2+FMA chosen at run time
//! (`samplerd_numerics::features`), with a portable scalar fallback (forced
//! with `SAMPLERD_MODEL_SCALAR=1`); [`QMatrix::matmul`] splits output rows
//! over the [`ThreadPool`].

mod convert;
pub mod format;
pub(crate) mod kernels;
#[cfg(test)]
mod tests;

use crate::pool::{ThreadPool, split_range};
pub use crate::quant::convert::KQuant;
use crate::quant::format::kquant::{BlockQ4K, BlockQ5K, BlockQ6K, BlockQ8K, QK_K};
use crate::quant::format::q5_0::{self, BlockQ5_0};
use crate::quant::format::q5_1::BlockQ5_1;
use crate::quant::kernels::{Kernels, kernels};
pub use crate::quant::kernels::{kernel_name, scalar};
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
    F16 {
        rows: usize,
        cols: usize,
        blocks: Vec<crate::quant::format::half::BlockF16>,
    },
    Bf16 {
        rows: usize,
        cols: usize,
        blocks: Vec<crate::quant::format::half::BlockBf16>,
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
    /// The activations themselves (`n_tok × cols`), for F16 matrices, which
    /// round them to f16 instead of quantising; empty when no F16 matrix
    /// consumes them.
    pub x: &'a [f32],
    /// Per token, whether its sequence's step has 2+ tokens (F16 products
    /// then follow tinyBLAS, else `ggml_vec_dot_f16`); empty means none.
    pub gemm: &'a [bool],
    /// Whose lane order F16 products follow (`model.numerics`).
    pub flavor: crate::ggml::Flavor,
}

impl<'a> Acts<'a> {
    /// Q8_1 activations only (32-value formats, vector-dot order).
    pub fn q8(q8: &'a [BlockQ8_1]) -> Self {
        Acts {
            q8,
            q8k: &[],
            tiled: &[],
            x: &[],
            gemm: &[],
            flavor: crate::ggml::Flavor::Avx2,
        }
    }
}

/// An f16 stored little-endian at the start of `b`, widened (exact).
pub(crate) fn f16_le(b: &[u8]) -> f32 {
    f16::from_le_bytes([b[0], b[1]]).to_f32()
}

/// The `M` bytes of `c` from `at`.
#[inline(always)]
pub(crate) fn bytes_at<const M: usize>(c: &[u8], at: usize) -> [u8; M] {
    c[at..at + M].try_into().expect("inside the block")
}

/// Blocks of `N` stored bytes each, decoded by `f`, or `None` when `raw`
/// ends in a partial block.
pub(crate) fn blocks_from_bytes<T, const N: usize>(
    raw: &[u8],
    f: impl Fn(&[u8; N]) -> T,
) -> Option<Vec<T>> {
    let (blocks, rest) = raw.as_chunks::<N>();
    rest.is_empty().then(|| blocks.iter().map(f).collect())
}

/// Whether `raw` holds exactly `rows × cols` values in blocks of `values`
/// values and `bytes` bytes, with whole blocks per row.
pub(crate) fn whole_rows(
    rows: usize,
    cols: usize,
    values: usize,
    bytes: usize,
    raw: &[u8],
) -> bool {
    cols.is_multiple_of(values) && raw.len() == rows * cols / values * bytes
}

/// Calls `$e` with `$b` bound to the matrix's blocks, whatever their format.
macro_rules! with_blocks {
    ($m:expr, $b:ident => $e:expr) => {
        match $m {
            QMatrix::Q8_0 { blocks: $b, .. } => $e,
            QMatrix::Q4_1 { blocks: $b, .. } => $e,
            QMatrix::Q5_0 { blocks: $b, .. } => $e,
            QMatrix::Q5_1 { blocks: $b, .. } => $e,
            QMatrix::Q4K { blocks: $b, .. } => $e,
            QMatrix::Q5K { blocks: $b, .. } => $e,
            QMatrix::Q6K { blocks: $b, .. } => $e,
            QMatrix::F16 { blocks: $b, .. } => $e,
            QMatrix::Bf16 { blocks: $b, .. } => $e,
        }
    };
}

/// A weight block format: how many values a block holds, and ggml's
/// `dequantize_row_*` for it.
pub trait WeightBlock: Sized {
    const VALUES: usize;
    fn dequant(blocks: &[Self], out: &mut [f32]);
}

/// A 32-value weight format against Q8_1 activations, as ggml's
/// `ggml_vec_dot_*_q8_{0,1}` compute it: eight int32 lanes of four products
/// of the block's integer values with the activation quants, one
/// `fma(d·d8, lanes, acc)` per block, `hsum_float_8`, then (when `MIN`) the
/// minimum term `Σ m·s`. `m·s` is exact (two f16 values), so ggml's
/// multiply-and-add and its fma (Q5_1, as GCC contracts it) give the same
/// bits; both are summed as `summs + m·s` here. The AVX2 kernels add the
/// lanes' SIMD form (`quant_avx2`); [`scalar::dot`] is the portable
/// reference. Dequantised (ggml's `dequantize_row_*`) as `d·q (+ m)`.
pub trait Block32: Copy {
    /// Whether the format has a minimum (`x = d·q + m`).
    const MIN: bool;
    fn d(&self) -> f32;
    /// The minimum (0 without one).
    fn m(&self) -> f32;
    /// The 32 integer values `q` (Q8_0's own quants; the other formats' 4 or
    /// 5 bits fit an `i8` too).
    fn values(&self) -> [i8; QK];
}

impl<B: Block32> WeightBlock for B {
    const VALUES: usize = QK;
    fn dequant(blocks: &[Self], out: &mut [f32]) {
        for (b, o) in blocks.iter().zip(out.chunks_exact_mut(QK)) {
            for (x, q) in o.iter_mut().zip(b.values()) {
                *x = if B::MIN {
                    b.d() * q as f32 + b.m()
                } else {
                    b.d() * q as f32
                };
            }
        }
    }
}

/// [`Block32`] for a block type with fields `d` (and `m` when `min`), its
/// integer values given by `values`.
macro_rules! block32 {
    ($t:ty, min: $min:tt, values: $values:expr) => {
        impl Block32 for $t {
            const MIN: bool = $min;
            #[inline(always)]
            fn d(&self) -> f32 {
                self.d
            }
            #[inline(always)]
            fn m(&self) -> f32 {
                block32!(@m self, $min)
            }
            #[inline(always)]
            fn values(&self) -> [i8; QK] {
                $values(self)
            }
        }
    };
    (@m $b:ident, true) => {
        $b.m
    };
    (@m $b:ident, false) => {
        0.0
    };
}

block32!(BlockQ8_0, min: false, values: |b: &BlockQ8_0| b.qs);
block32!(BlockQ4_1, min: true, values: |b: &BlockQ4_1| {
    let mut v = [0i8; QK];
    for j in 0..QK / 2 {
        v[j] = (b.qs[j] & 0x0F) as i8;
        v[j + QK / 2] = (b.qs[j] >> 4) as i8;
    }
    v
});
block32!(BlockQ5_0, min: false, values: crate::quant::format::q5_0::values);
block32!(BlockQ5_1, min: true, values: |b| crate::quant::format::q5_1::values(b).map(|q| q as i8));

impl QMatrix {
    /// `(rows, cols)`.
    pub fn dims(&self) -> (usize, usize) {
        match self {
            QMatrix::Q8_0 { rows, cols, .. }
            | QMatrix::Q4_1 { rows, cols, .. }
            | QMatrix::Q5_0 { rows, cols, .. }
            | QMatrix::Q5_1 { rows, cols, .. }
            | QMatrix::Q4K { rows, cols, .. }
            | QMatrix::Q5K { rows, cols, .. }
            | QMatrix::Q6K { rows, cols, .. }
            | QMatrix::F16 { rows, cols, .. }
            | QMatrix::Bf16 { rows, cols, .. } => (*rows, *cols),
        }
    }
    pub fn rows(&self) -> usize {
        self.dims().0
    }
    pub fn cols(&self) -> usize {
        self.dims().1
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
            QMatrix::F16 { .. } => "f16",
            QMatrix::Bf16 { .. } => "bf16",
        }
    }

    /// Whether products with this matrix need Q8_K activations.
    pub fn needs_q8k(&self) -> bool {
        matches!(
            self,
            QMatrix::Q4K { .. } | QMatrix::Q5K { .. } | QMatrix::Q6K { .. }
        )
    }

    /// Whether products with this matrix need Q8_1 activations (F16 and
    /// BF16 take the f32 activations, the K-quants Q8_K).
    pub fn needs_q8_1(&self) -> bool {
        !self.needs_q8k() && !matches!(self, QMatrix::F16 { .. } | QMatrix::Bf16 { .. })
    }

    /// Bytes the weights take in memory.
    pub fn nbytes(&self) -> usize {
        with_blocks!(self, b => std::mem::size_of_val(&b[..]))
    }

    /// From raw GGUF Q8_0 bytes (34 bytes per block: f16 d, 32 × i8).
    pub fn from_q8_0_bytes(rows: usize, cols: usize, raw: &[u8]) -> Option<Self> {
        if !whole_rows(rows, cols, QK, 34, raw) {
            return None;
        }
        let blocks = blocks_from_bytes(raw, |c: &[u8; 34]| BlockQ8_0 {
            d: f16_le(c),
            qs: std::array::from_fn(|i| c[2 + i] as i8),
        })?;
        Some(QMatrix::Q8_0 { rows, cols, blocks })
    }

    /// From raw GGUF Q4_1 bytes (20 bytes per block: f16 d, f16 m, 16 × u8).
    pub fn from_q4_1_bytes(rows: usize, cols: usize, raw: &[u8]) -> Option<Self> {
        if !whole_rows(rows, cols, QK, 20, raw) {
            return None;
        }
        let blocks = blocks_from_bytes(raw, |c: &[u8; 20]| BlockQ4_1 {
            d: f16_le(c),
            m: f16_le(&c[2..]),
            qs: bytes_at(c, 4),
        })?;
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
        fn row<B: WeightBlock>(blocks: &[B], cols: usize, r: usize, out: &mut [f32]) {
            let nb = cols / B::VALUES;
            B::dequant(&blocks[r * nb..(r + 1) * nb], out);
        }
        with_blocks!(self, b => row(b, self.cols(), r, out))
    }

    /// `out[t * rows + r] = W[r] · x[t]` for every token `t` of the quantised
    /// activations `xq` (`n_tok × cols/32` Q8_1 blocks, or for K-quants
    /// `n_tok × cols/256` Q8_K blocks), rows split over the pool.
    pub fn matmul(&self, pool: &ThreadPool, xq: Acts<'_>, n_tok: usize, out: &mut [f32]) {
        match self {
            QMatrix::F16 { blocks, .. } => return self.matmul_half(blocks, pool, xq, n_tok, out),
            QMatrix::Bf16 { blocks, .. } => return self.matmul_half(blocks, pool, xq, n_tok, out),
            _ => {}
        }
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
            // Several tokens of a 32-value format: all of them through the
            // tile at once (each weight block unpacked once for several
            // tokens), into `local` (token-major), then to `out`.
            let by_tokens = n_tok > 1 && Kernels::takes_tokens(self);
            let mut local: Vec<f32> = Vec::new();
            // Rows r0..r0 + n of token t's output.
            let dst = |t: usize, r0: usize, n: usize| -> &mut [f32] {
                // SAFETY: threads write disjoint row ranges of each token's
                // output row (`split_range` partitions `0..rows`), and `out`
                // outlives `pool.run`, which returns only after all parts
                // finish; the callers keep `t * rows + r0 + n <= out.len()`.
                unsafe { std::slice::from_raw_parts_mut(out_ptr.0.add(t * rows + r0), n) }
            };
            // Copies `part` (token-major, rows r0..r0 + n) to tokens t0.. of `out`.
            let put = |t0: usize, r0: usize, n: usize, part: &[f32]| {
                for (t, part) in part.chunks_exact(n).enumerate() {
                    dst(t0 + t, r0, n).copy_from_slice(part);
                }
            };
            while r0 < range.end {
                let r1 = (r0 + 64).min(range.end);
                let n = r1 - r0;
                if by_tokens {
                    if let QMatrix::Q5_0 { blocks, .. } = self {
                        expanded.clear();
                        expanded.extend(blocks[r0 * nb..r1 * nb].iter().map(q5_0::as_q8_0));
                    }
                    local.resize(n * n_tok, 0.0);
                    k.tokens(self, r0..r1, &expanded, xq.q8, n_tok, &mut local);
                    put(0, r0, n, &local);
                    r0 = r1;
                    continue;
                }
                let mut t = 0;
                while t < n_tok {
                    // A run of tiled tokens (a prompt step's K-quant
                    // products): all of them at once.
                    let run = (t..n_tok).take_while(|&u| tiled(u)).count();
                    if self.needs_q8k() && run > 1 {
                        local.resize(n * run, 0.0);
                        let ak = &xq.q8k[t * nb..(t + run) * nb];
                        k.tiled_tokens(self, r0..r1, ak, run, &mut local);
                        put(t, r0, n, &local);
                        t += run;
                        continue;
                    }
                    let (a, ak) = if self.needs_q8k() {
                        (&[][..], &xq.q8k[t * nb..(t + 1) * nb])
                    } else {
                        (&xq.q8[t * nb..(t + 1) * nb], &[][..])
                    };
                    k.tile(self, r0..r1, a, ak, tiled(t), dst(t, r0, n));
                    t += 1;
                }
                r0 = r1;
            }
        });
    }
}

impl QMatrix {
    /// [`QMatrix::matmul`] of an F16 or BF16 matrix (see `quant_f16`):
    /// every row dotted with each token's activations rounded to its type.
    fn matmul_half<B: crate::ggml::half::HalfBlock>(
        &self,
        blocks: &[B],
        pool: &ThreadPool,
        xq: Acts<'_>,
        n_tok: usize,
        out: &mut [f32],
    ) {
        let (rows, cols) = self.dims();
        assert_eq!(
            xq.x.len(),
            n_tok * cols,
            "F16 products need the activations"
        );
        assert_eq!(out.len(), n_tok * rows, "output length");
        let mut x16 = Vec::new();
        crate::quant::format::half::round_acts(xq.x, B::BF16, &mut x16);
        let gemm = |t: usize| xq.gemm.get(t).copied().unwrap_or(false);
        let nb = cols / QK;
        let out_ptr = SyncPtr(out.as_mut_ptr());
        pool.run(&|i, n| {
            let range = split_range(rows, i, n, 16);
            let out_ptr = &out_ptr;
            let x = |t: usize| &x16[t * cols..(t + 1) * cols];
            for r in range {
                let w = &blocks[r * nb..(r + 1) * nb];
                let mut t = 0;
                while t < n_tok {
                    // Four tinyBLAS tokens at once (independent fma chains).
                    let four = t + 4 <= n_tok && (t..t + 4).all(gemm);
                    let ds: &[f32] = if four {
                        &crate::ggml::half::dot_half_row_x4(
                            w,
                            [x(t), x(t + 1), x(t + 2), x(t + 3)],
                            xq.flavor,
                        )
                    } else {
                        &[crate::ggml::half::dot_half_row(w, x(t), gemm(t), xq.flavor)]
                    };
                    for (k, &d) in ds.iter().enumerate() {
                        // SAFETY: each thread writes only its own rows `r`
                        // of every token (`split_range` partitions
                        // `0..rows`), and `out` outlives `pool.run`;
                        // `(t + k) * rows + r < out.len()`.
                        unsafe { *out_ptr.0.add((t + k) * rows + r) = d };
                    }
                    t += ds.len();
                }
            }
        });
    }

    /// From raw GGUF BF16 bytes (2 bytes per value).
    pub fn from_bf16_bytes(rows: usize, cols: usize, raw: &[u8]) -> Option<Self> {
        if !whole_rows(rows, cols, QK, 2 * QK, raw) {
            return None;
        }
        Some(QMatrix::Bf16 {
            rows,
            cols,
            blocks: crate::quant::format::half::bf16_blocks_from_bytes(raw)?,
        })
    }

    /// From raw GGUF F16 bytes (2 bytes per value).
    pub fn from_f16_bytes(rows: usize, cols: usize, raw: &[u8]) -> Option<Self> {
        if !whole_rows(rows, cols, QK, 2 * QK, raw) {
            return None;
        }
        Some(QMatrix::F16 {
            rows,
            cols,
            blocks: crate::quant::format::half::blocks_from_bytes(raw)?,
        })
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
