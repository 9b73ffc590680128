//! The weight-product kernel families (AVX2+FMA, chosen at run time by
//! `samplerd_numerics::features`, and the portable scalar ones, forced with
//! `SAMPLERD_MODEL_SCALAR=1`) and the dispatch from a [`QMatrix`] to a
//! format's row kernel, which [`QMatrix::matmul`] and the tests share.

use crate::quant::{Block32, BlockQ4_1, BlockQ8_0, BlockQ8_1, QMatrix, WeightBlock};
use crate::quant_k::{self, BlockQ4K, BlockQ5K, BlockQ6K, BlockQ8K};
use crate::quant_q5_0::BlockQ5_0;
use crate::quant_q5_1::BlockQ5_1;

/// One kernel family: a row-product function per format (`_t`: the
/// K-quants in ggml's tiled order).
pub(crate) struct Kernels {
    name: &'static str,
    /// (Also the expanded Q5_0 tiles' kernel, `QMatrix::matmul`.)
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
}

/// A tiled-order K-quant kernel.
type TiledFn<B> = fn(&[B], &[BlockQ8K], &mut [f32]);

impl Kernels {
    /// The portable kernels (also the reference the AVX2 ones are tested
    /// against).
    pub(crate) fn scalar() -> Kernels {
        use quant_k::scalar as k;
        Kernels {
            name: "scalar",
            q8_0: scalar::rows,
            q4_1: scalar::rows,
            q5_0: scalar::rows,
            q5_1: scalar::rows,
            q4k: |w, a, out| scalar::each_row(w, a, out, k::dot_q4k),
            q5k: |w, a, out| scalar::each_row(w, a, out, k::dot_q5k),
            q6k: |w, a, out| scalar::each_row(w, a, out, k::dot_q6k),
            q4k_t: |w, a, out| scalar::each_row(w, a, out, k::tiled_q4k),
            q5k_t: |w, a, out| scalar::each_row(w, a, out, k::tiled_q5k),
            q6k_t: |w, a, out| scalar::each_row(w, a, out, k::tiled_q6k),
        }
    }

    /// The AVX2+FMA kernels, when this CPU has both. They keep llama.cpp's
    /// per-row order exactly and run several rows at once so their fma
    /// chains overlap: four for Q8_0 / Q4_1, two for the others.
    #[cfg(target_arch = "x86_64")]
    pub(crate) fn avx2() -> Option<Kernels> {
        use crate::quant_avx2::rows_safe as rows;
        use crate::quant_k_avx2::tiled_safe as tiled;
        let f = samplerd_numerics::features();
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

/// Portable kernels: the same arithmetic as the AVX2 ones, lane by lane.
pub mod scalar {
    use super::*;

    /// `out[r] = dot(W[r], a)` for every row of `w` (`a.len()` blocks a row).
    #[inline(always)]
    pub fn each_row<W, A>(w: &[W], a: &[A], out: &mut [f32], dot: impl Fn(&[W], &[A]) -> f32) {
        for (o, row) in out.iter_mut().zip(w.chunks_exact(a.len())) {
            *o = dot(row, a);
        }
    }

    /// A 32-value format's product ([`Block32`]): eight int32 lanes of
    /// four products each, one fma per lane and block, `hsum_float_8`, then
    /// the minimum term.
    pub fn dot<B: Block32>(w: &[B], a: &[BlockQ8_1]) -> f32 {
        let mut acc = [0f32; 8];
        let mut summs = 0f32;
        for (w, a) in w.iter().zip(a) {
            if B::MIN {
                summs += w.m() * a.s;
            }
            let d = w.d() * a.d;
            let q = w.values();
            for (l, acc) in acc.iter_mut().enumerate() {
                let s: i32 = (4 * l..4 * l + 4)
                    .map(|j| q[j] as i32 * a.qs[j] as i32)
                    .sum();
                *acc = d.mul_add(s as f32, *acc);
            }
        }
        let v = crate::ggml::hsum8(&acc);
        if B::MIN { v + summs } else { v }
    }

    pub fn rows<B: Block32>(w: &[B], a: &[BlockQ8_1], out: &mut [f32]) {
        each_row(w, a, out, dot)
    }
}
