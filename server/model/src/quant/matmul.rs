//! The weight products over the thread pool: rows split over it, each tile through its kernel.

use crate::ggml::half::{HalfBlock, dot_half_row, dot_half_row_x4};
use crate::pool::{ThreadPool, split_range};
use crate::quant::acts::Acts;
use crate::quant::format::block::QK;
use crate::quant::format::half::round_acts;
use crate::quant::format::kquant::QK_K;
use crate::quant::format::q5_0;
use crate::quant::format::q8::BlockQ8_0;
use crate::quant::kernels::{Kernels, kernels};
use crate::quant::matrix::QMatrix;

impl QMatrix {
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
            // blocks (same products, same order: see `format::q5_0`) instead of
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
    /// [`QMatrix::matmul`] of an F16 or BF16 matrix (see `format::half`):
    /// every row dotted with each token's activations rounded to its type.
    fn matmul_half<B: HalfBlock>(
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
        round_acts(xq.x, B::BF16, &mut x16);
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
                        &dot_half_row_x4(w, [x(t), x(t + 1), x(t + 2), x(t + 3)], xq.flavor)
                    } else {
                        &[dot_half_row(w, x(t), gemm(t), xq.flavor)]
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
}

struct SyncPtr(*mut f32);
// SAFETY: used only to hand disjoint output ranges to pool threads (see matmul).
unsafe impl Sync for SyncPtr {}
