//! The weight-product kernels per instruction set and the dispatch from a [`QMatrix`] to them.
//!
//! Two families: AVX2+FMA (`avx2`, chosen at run time by
//! `samplerd_numerics::features`) and the portable scalar ones (`scalar`,
//! forced with `SAMPLERD_MODEL_SCALAR=1`); [`Kernels`] maps a matrix's
//! format to its row kernel, which the pool-split matmul and the tests share.

#[cfg(target_arch = "x86_64")]
pub(crate) mod avx2;
pub mod scalar;

use crate::quant::format::block::{QK, WeightBlock};
use crate::quant::format::kquant::{BlockQ4K, BlockQ5K, BlockQ6K, BlockQ8K, QK_K};
use crate::quant::format::q4_1::BlockQ4_1;
use crate::quant::format::q5_0::BlockQ5_0;
use crate::quant::format::q5_1::BlockQ5_1;
use crate::quant::format::q8::{BlockQ8_0, BlockQ8_1};
use crate::quant::matrix::QMatrix;

/// One kernel family: a row-product function per format (`_t`: the
/// K-quants in ggml's tiled order).
pub(crate) struct Kernels {
    name: &'static str,
    /// (A prompt's expanded Q5_0 tiles take `q8_0_x`.)
    pub(crate) q8_0: fn(&[BlockQ8_0], &[BlockQ8_1], &mut [f32]),
    q4_1: fn(&[BlockQ4_1], &[BlockQ8_1], &mut [f32]),
    q5_0: fn(&[BlockQ5_0], &[BlockQ8_1], &mut [f32]),
    q5_1: fn(&[BlockQ5_1], &[BlockQ8_1], &mut [f32]),
    q4k: fn(&[BlockQ4K], &[BlockQ8K], &mut [f32]),
    q5k: fn(&[BlockQ5K], &[BlockQ8K], &mut [f32]),
    q6k: fn(&[BlockQ6K], &[BlockQ8K], &mut [f32]),
    q4k_t: TiledFn<BlockQ4K>,
    q5k_t: TiledFn<BlockQ5K>,
    q6k_t: TiledFn<BlockQ6K>,
    /// Several tokens at once (`a`: their blocks one after another; `out`:
    /// token-major), for a prompt's products.
    q8_0_x: TokensFn<BlockQ8_0>,
    q4_1_x: TokensFn<BlockQ4_1>,
    q5_1_x: TokensFn<BlockQ5_1>,
    /// The K-quants in the tiled order, several tokens at once.
    q4k_tx: TiledTokensFn<BlockQ4K>,
    q5k_tx: TiledTokensFn<BlockQ5K>,
    q6k_tx: TiledTokensFn<BlockQ6K>,
}

/// A several-token tiled K-quant kernel: `(w, a, n_tok, out)`.
type TiledTokensFn<B> = fn(&[B], &[BlockQ8K], usize, &mut [f32]);

/// A several-token kernel: `(w, a, n_tok, out)`.
type TokensFn<B> = fn(&[B], &[BlockQ8_1], usize, &mut [f32]);

/// A tiled-order K-quant kernel.
type TiledFn<B> = fn(&[B], &[BlockQ8K], &mut [f32]);

impl Kernels {
    /// The portable kernels (also the reference the AVX2 ones are tested
    /// against).
    pub(crate) fn scalar() -> Kernels {
        Kernels {
            name: "scalar",
            q8_0: scalar::rows,
            q4_1: scalar::rows,
            q5_0: scalar::rows,
            q5_1: scalar::rows,
            q4k: |w, a, out| scalar::each_row(w, a, out, scalar::dot_q4k),
            q5k: |w, a, out| scalar::each_row(w, a, out, scalar::dot_q5k),
            q6k: |w, a, out| scalar::each_row(w, a, out, scalar::dot_q6k),
            q4k_t: |w, a, out| scalar::each_row(w, a, out, scalar::tiled_q4k),
            q5k_t: |w, a, out| scalar::each_row(w, a, out, scalar::tiled_q5k),
            q6k_t: |w, a, out| scalar::each_row(w, a, out, scalar::tiled_q6k),
            q8_0_x: scalar::rows_tokens,
            q4_1_x: scalar::rows_tokens,
            q5_1_x: scalar::rows_tokens,
            q4k_tx: |w, a, n, out| scalar::each_token(w, a, n, out, scalar::tiled_q4k),
            q5k_tx: |w, a, n, out| scalar::each_token(w, a, n, out, scalar::tiled_q5k),
            q6k_tx: |w, a, n, out| scalar::each_token(w, a, n, out, scalar::tiled_q6k),
        }
    }

    /// The AVX2+FMA kernels, when this CPU has both. They keep llama.cpp's
    /// per-row order exactly and run several rows at once so their fma
    /// chains overlap: four for Q8_0 / Q4_1, two for the others.
    #[cfg(target_arch = "x86_64")]
    pub(crate) fn avx2() -> Option<Kernels> {
        use avx2::kquant::tiled_safe as tiled;
        use avx2::kquant::tiled_tokens_safe as tiled_tokens;
        use avx2::rows::rows_safe as rows;
        use avx2::tokens::tokens_safe as tokens;
        let f = samplerd_numerics::features();
        let vnni = crate::quant::kernels::avx2::tokens::has_vnni();
        (f.avx2() && f.fma()).then_some(Kernels {
            name: "avx2",
            q8_0: rows::<BlockQ8_0, 4>,
            q4_1: rows::<BlockQ4_1, 4>,
            q5_0: rows::<BlockQ5_0, 2>,
            q5_1: rows::<BlockQ5_1, 2>,
            q4k: rows::<BlockQ4K, 2>,
            q5k: rows::<BlockQ5K, 2>,
            q6k: rows::<BlockQ6K, 2>,
            q4k_t: tiled::<BlockQ4K>,
            q5k_t: tiled::<BlockQ5K>,
            q6k_t: tiled::<BlockQ6K>,
            // 4 rows × 4 tokens where VNNI brings AVX-512's 32 registers
            // (16 accumulators fit), 4 × 2 in AVX2's 16; measured in
            // docs/PERFORMANCE.md ("Model host and Generate").
            q8_0_x: if vnni {
                tokens::<BlockQ8_0, 4, 4>
            } else {
                tokens::<BlockQ8_0, 4, 2>
            },
            q4_1_x: if vnni {
                tokens::<BlockQ4_1, 4, 4>
            } else {
                tokens::<BlockQ4_1, 4, 2>
            },
            q5_1_x: if vnni {
                tokens::<BlockQ5_1, 4, 4>
            } else {
                tokens::<BlockQ5_1, 4, 2>
            },
            q4k_tx: tiled_tokens::<BlockQ4K, 4>,
            q5k_tx: tiled_tokens::<BlockQ5K, 4>,
            q6k_tx: tiled_tokens::<BlockQ6K, 4>,
        })
    }

    #[cfg(not(target_arch = "x86_64"))]
    pub(crate) fn avx2() -> Option<Kernels> {
        None
    }

    /// Rows `r` of `m` times one token's activations (`a`: Q8_1 blocks,
    /// `ak`: Q8_K blocks, whichever the format takes) into `dst`;
    /// `tiled`: the K-quants' tiled order.
    pub(crate) fn tile(
        &self,
        m: &QMatrix,
        r: std::ops::Range<usize>,
        a: &[BlockQ8_1],
        ak: &[BlockQ8K],
        tiled: bool,
        dst: &mut [f32],
    ) {
        fn part<B: WeightBlock>(b: &[B], cols: usize, r: std::ops::Range<usize>) -> &[B] {
            let nb = cols / B::VALUES;
            &b[r.start * nb..r.end * nb]
        }
        let c = m.cols();
        match (m, tiled) {
            (QMatrix::Q8_0 { blocks, .. }, _) => (self.q8_0)(part(blocks, c, r), a, dst),
            (QMatrix::Q4_1 { blocks, .. }, _) => (self.q4_1)(part(blocks, c, r), a, dst),
            (QMatrix::Q5_0 { blocks, .. }, _) => (self.q5_0)(part(blocks, c, r), a, dst),
            (QMatrix::Q5_1 { blocks, .. }, _) => (self.q5_1)(part(blocks, c, r), a, dst),
            (QMatrix::Q4K { blocks, .. }, false) => (self.q4k)(part(blocks, c, r), ak, dst),
            (QMatrix::Q5K { blocks, .. }, false) => (self.q5k)(part(blocks, c, r), ak, dst),
            (QMatrix::Q6K { blocks, .. }, false) => (self.q6k)(part(blocks, c, r), ak, dst),
            (QMatrix::Q4K { blocks, .. }, true) => (self.q4k_t)(part(blocks, c, r), ak, dst),
            (QMatrix::Q5K { blocks, .. }, true) => (self.q5k_t)(part(blocks, c, r), ak, dst),
            (QMatrix::Q6K { blocks, .. }, true) => (self.q6k_t)(part(blocks, c, r), ak, dst),
            (QMatrix::F16 { .. } | QMatrix::Bf16 { .. }, _) => {
                unreachable!("F16/BF16 products run in QMatrix::matmul_half")
            }
        }
    }
}

impl Kernels {
    /// Rows `r` of `m` (whose format [`Kernels::takes_tokens`]) times the
    /// `n_tok` tokens of `a` into `dst` (token-major, `r.len()` a token).
    /// `expanded`: `m`'s rows `r` as Q8_0 when `m` is Q5_0.
    pub(crate) fn tokens(
        &self,
        m: &QMatrix,
        r: std::ops::Range<usize>,
        expanded: &[BlockQ8_0],
        a: &[BlockQ8_1],
        n_tok: usize,
        dst: &mut [f32],
    ) {
        let nb = m.cols() / QK;
        let part = r.start * nb..r.end * nb;
        match m {
            QMatrix::Q8_0 { blocks, .. } => (self.q8_0_x)(&blocks[part], a, n_tok, dst),
            QMatrix::Q4_1 { blocks, .. } => (self.q4_1_x)(&blocks[part], a, n_tok, dst),
            QMatrix::Q5_0 { .. } => (self.q8_0_x)(expanded, a, n_tok, dst),
            QMatrix::Q5_1 { blocks, .. } => (self.q5_1_x)(&blocks[part], a, n_tok, dst),
            _ => unreachable!("Kernels::takes_tokens is false for {}", m.format()),
        }
    }

    /// Rows `r` of the K-quant matrix `m` times the `n_tok` tokens of `ak`
    /// (Q8_K), all in the tiled order, into `dst` (token-major).
    pub(crate) fn tiled_tokens(
        &self,
        m: &QMatrix,
        r: std::ops::Range<usize>,
        ak: &[BlockQ8K],
        n_tok: usize,
        dst: &mut [f32],
    ) {
        let nb = m.cols() / QK_K;
        let part = r.start * nb..r.end * nb;
        match m {
            QMatrix::Q4K { blocks, .. } => (self.q4k_tx)(&blocks[part], ak, n_tok, dst),
            QMatrix::Q5K { blocks, .. } => (self.q5k_tx)(&blocks[part], ak, n_tok, dst),
            QMatrix::Q6K { blocks, .. } => (self.q6k_tx)(&blocks[part], ak, n_tok, dst),
            _ => unreachable!("{} is no K-quant", m.format()),
        }
    }

    /// Whether [`Kernels::tokens`] multiplies `m` (the 32-value formats).
    pub(crate) fn takes_tokens(m: &QMatrix) -> bool {
        matches!(
            m,
            QMatrix::Q8_0 { .. }
                | QMatrix::Q4_1 { .. }
                | QMatrix::Q5_0 { .. }
                | QMatrix::Q5_1 { .. }
        )
    }
}

/// The kernels in use: AVX2+FMA when the CPU has both, else the scalar
/// ones (forced with `SAMPLERD_MODEL_SCALAR=1`).
pub(crate) fn kernels() -> &'static Kernels {
    static K: std::sync::OnceLock<Kernels> = std::sync::OnceLock::new();
    K.get_or_init(|| {
        std::env::var_os("SAMPLERD_MODEL_SCALAR")
            .is_none()
            .then(Kernels::avx2)
            .flatten()
            .unwrap_or_else(Kernels::scalar)
    })
}

/// Which kernel family is in use ("avx2" or "scalar").
pub fn kernel_name() -> &'static str {
    kernels().name
}
