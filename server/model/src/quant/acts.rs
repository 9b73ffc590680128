//! [`Acts`]: a step's activations in the forms its products take, and each row's order.

use crate::ggml::Flavor;
use crate::quant::format::kquant::BlockQ8K;
use crate::quant::format::q8::BlockQ8_1;

/// The smallest batch for which ggml takes its tiled K-quant matmul
/// (`ggml_tiled_min_batch`).
pub const TILED_MIN_ROWS: usize = 8;

/// One batch of quantised activations (`n_tok` rows): the Q8_1 blocks every
/// 32-value format uses, and the Q8_K blocks K-quant weights use (empty when
/// no consumer needs them; see
/// [`QMatrix::needs_q8k`](crate::quant::matrix::QMatrix::needs_q8k)).
/// `tiled[t]`: whether token `t`'s K-quant products mirror ggml's tiled
/// matmul (the rows of a sequence's step of 8+ tokens) rather than its vector
/// dot; empty means none (see the `kernels::scalar` module comment).
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
    pub flavor: Flavor,
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
            flavor: Flavor::Avx2,
        }
    }
}
