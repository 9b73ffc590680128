//! A step's per-row work over the pool: norms, residual adds, activation quantisation, products.

use super::backend::{CpuBackend, PAR_MIN_ROWS};
use super::norm::rms_norm;
use crate::gguf::Fused;
use crate::quant::{Acts, BlockQ8_1, BlockQ8K, QK, QK_K, QMatrix, quantize_q8_1, quantize_q8_k};

/// Per row of a step, which of ggml's arithmetic orders its products
/// follow ([`Acts::tiled`], [`Acts::gemm`]).
#[derive(Clone, Copy)]
pub(super) struct Orders<'a> {
    pub(super) tiled: &'a [bool],
    pub(super) gemm: &'a [bool],
}

/// Which quantised activations a product's weights take.
#[derive(Clone, Copy)]
pub(super) struct ActNeeds {
    q8_1: bool,
    q8k: bool,
}

impl ActNeeds {
    pub(super) fn of(m: &QMatrix) -> Self {
        ActNeeds {
            q8_1: m.needs_q8_1(),
            q8k: m.needs_q8k(),
        }
    }

    pub(super) fn of_fused(f: &Fused) -> Self {
        ActNeeds {
            q8_1: f.needs_q8_1(),
            q8k: f.needs_q8k(),
        }
    }
}

impl CpuBackend {
    /// [`rms_norm`] of every row of `x` into `out`, over the pool for a prompt.
    pub(super) fn norm_rows(&self, x: &[f32], w: &[f32], out: &mut [f32]) {
        let (d, eps) = (w.len(), self.config.rms_eps);
        self.pool.for_rows(out, d, PAR_MIN_ROWS, &|r, o| {
            rms_norm(&x[r.start * d..r.end * d], w, eps, o)
        });
    }

    /// `x += y` (the residual), over the pool for a prompt.
    pub(super) fn add_rows(&self, x: &mut [f32], y: &[f32]) {
        let d = self.config.n_embd;
        self.pool.for_rows(x, d, PAR_MIN_ROWS, &|r, x| {
            for (a, b) in x.iter_mut().zip(&y[r.start * d..r.end * d]) {
                *a += b;
            }
        });
    }

    /// Quantises `x` (`n` rows) for the weight products that consume it, as
    /// `needs` says: to Q8_1 into `q8` (its first `x.len()/32` blocks), to Q8_K
    /// into `q8k` (for K-quant matrices, whose rows are a multiple of 256
    /// values; the loader checks this). F16 and BF16 products take `x` itself.
    /// `orders`: per row, which of ggml's arithmetic orders its products follow.
    pub(super) fn quantize_acts<'a>(
        &self,
        n: usize,
        x: &'a [f32],
        q8: &'a mut [BlockQ8_1],
        q8k: &'a mut Vec<BlockQ8K>,
        needs: ActNeeds,
        orders: Orders<'a>,
    ) -> Acts<'a> {
        let pool = &self.pool;
        let cols = x.len() / n.max(1);
        let q8: &[BlockQ8_1] = if needs.q8_1 {
            let q8 = &mut q8[..x.len() / QK];
            pool.for_rows(q8, cols / QK, PAR_MIN_ROWS, &|r, q| {
                quantize_q8_1(&x[r.start * cols..r.end * cols], q)
            });
            q8
        } else {
            &[]
        };
        let q8k: &[BlockQ8K] = if needs.q8k {
            q8k.resize(x.len() / QK_K, BlockQ8K::default());
            pool.for_rows(q8k, cols / QK_K, PAR_MIN_ROWS, &|r, q| {
                quantize_q8_k(&x[r.start * cols..r.end * cols], q)
            });
            q8k
        } else {
            &[]
        };
        Acts {
            q8,
            q8k,
            tiled: orders.tiled,
            x,
            gemm: orders.gemm,
            flavor: self.flavor,
        }
    }

    pub(super) fn fused(&self, f: &Fused, xq: Acts<'_>, n: usize, out: &mut [f32]) {
        match f {
            Fused::One(m) => m.matmul(&self.pool, xq, n, out),
            Fused::Many(parts) => {
                let total = f.rows();
                let mut col = 0;
                for m in parts {
                    let mut tmp = vec![0f32; n * m.rows()];
                    m.matmul(&self.pool, xq, n, &mut tmp);
                    for t in 0..n {
                        out[t * total + col..t * total + col + m.rows()]
                            .copy_from_slice(&tmp[t * m.rows()..(t + 1) * m.rows()]);
                    }
                    col += m.rows();
                }
            }
        }
    }
}
