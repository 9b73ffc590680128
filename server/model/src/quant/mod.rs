//! Quantised weight matrices and their products: block formats, kernels per CPU, the matmul.
//!
//! Weights stay in the block formats llama.cpp uses (`format`) — Q4_1 (4-bit
//! with scale and minimum) and Q8_0 (8-bit with scale), 32 values per block,
//! and the K-quants Q4_K, Q5_K and Q6_K (256 values per block) — with
//! their f16 scales widened to f32 at load (exact). Q4_0 and Q5_0 become
//! Q8_0 blocks without loss (`d·(q − 8)`, `d·(q − 16)` are Q8_0 values with the
//! same scale, and ggml's `ggml_vec_dot_q{4,5}_0_q8_0` do exactly what
//! `ggml_vec_dot_q8_0_q8_0` does on them: the same int8 products, one fma per
//! block, `hsum_float_8`). Every other GGUF type is dequantised at load and
//! requantised to Q8_0 (`convert`). Activations are quantised per 32-value
//! block to 8 bits exactly like llama.cpp's `quantize_row_q8_1` (scale
//! rounded to f16, plus the block sum for Q4_1's minimum term), and for
//! K-quant weights per 256 values like `quantize_row_q8_K_ref` ([`Acts`]
//! carries both), so the dot products are the ones ggml's `ggml_vec_dot_*`
//! compute, in the same order.
//!
//! Kernels (`kernels`): AVX2+FMA chosen at run time
//! (`samplerd_numerics::features`), with a portable scalar fallback (forced
//! with `SAMPLERD_MODEL_SCALAR=1`); [`QMatrix::matmul`] (`matmul`) splits
//! output rows over the [`ThreadPool`](crate::pool::ThreadPool).
//!
//! The block formats import nothing of the kernels; the kernels import the
//! formats they multiply and never this module.

mod acts;
mod convert;
pub mod format;
pub(crate) mod kernels;
mod matmul;
mod matrix;
#[cfg(test)]
mod tests;

pub use acts::{Acts, TILED_MIN_ROWS};
pub use convert::KQuant;
pub use format::block::{Block32, QK, WeightBlock};
pub use format::half::{BlockBf16, BlockF16};
pub use format::kquant::{BlockQ4K, BlockQ5K, BlockQ6K, BlockQ8K, QK_K, quantize_q8_k};
pub use format::q4_1::BlockQ4_1;
pub use format::q5_0::BlockQ5_0;
pub use format::q5_1::BlockQ5_1;
pub use format::q8::{BlockQ8_0, BlockQ8_1, quantize_q8_1};
pub use kernels::{kernel_name, scalar};
pub use matrix::QMatrix;
