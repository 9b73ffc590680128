//! F16 and BF16 weight blocks, kept as stored, and their activations' rounding.
//!
//! F16 and BF16 weight matrices kept as stored (GGUF types F16, BF16),
//! multiplied as llama.cpp multiplies them: the activations rounded to the
//! weights' type (its `vec_dot_type`, round to nearest even), then per
//! output either tinyBLAS's dot (`llamafile_sgemm`, which takes steps of 2+
//! tokens only) or `ggml_vec_dot_f16` / `ggml_vec_dot_bf16` (one-token
//! steps), in the lane order of the build `model.numerics` mirrors
//! (`ggml::half::dot_half_row`). Requantising F16 weights to Q8_0, as the
//! loader did before, moved log-probabilities by up to 0.24 against
//! llama.cpp on the same file.
//!
//! BF16 has three orders: llama.cpp's AVX2 build (`portable`), its AVX-512F
//! build, and an AVX-512 build on a CPU with AVX-512 BF16, which multiplies
//! pairs with `vdpbf16ps` (`ggml::half::dot_bf16_pairs`, scalar: only
//! `native` on such CPUs takes it).

#![forbid(unsafe_code)]

use half::slice::HalfFloatSliceExt;
use half::{bf16, f16};

use super::block::{QK, WeightBlock};
use crate::ggml::half::HalfBlock;

/// A block type of 32 half-precision weights (`$t`: f16 or bf16), its
/// dequantisation, its bits for the kernels, and its reading from GGUF bytes.
macro_rules! half_block {
    ($(#[$doc:meta])* $name:ident, $t:ty, $bf16:expr, $from_bytes:ident) => {
        $(#[$doc])*
        #[repr(C)]
        #[derive(Clone, Copy, Debug, Default)]
        pub struct $name {
            pub v: [$t; QK],
        }

        impl WeightBlock for $name {
            const VALUES: usize = QK;
            fn dequant(blocks: &[Self], out: &mut [f32]) {
                for (b, o) in blocks.iter().zip(out.chunks_exact_mut(QK)) {
                    b.v.convert_to_f32_slice(o);
                }
            }
        }

        impl HalfBlock for $name {
            const BF16: bool = $bf16;
            fn bits(&self) -> &[u16; 32] {
                self.v.reinterpret_cast().try_into().expect("32 values")
            }
        }

        /// Blocks from raw little-endian GGUF bytes (64 bytes per block).
        pub fn $from_bytes(raw: &[u8]) -> Option<Vec<$name>> {
            super::bytes::blocks_from_bytes(raw, |c: &[u8; 2 * QK]| $name {
                v: std::array::from_fn(|i| <$t>::from_le_bytes([c[2 * i], c[2 * i + 1]])),
            })
        }
    };
}

half_block!(
    /// 32 f16 weights (GGUF F16).
    BlockF16, f16, false, blocks_from_bytes
);
half_block!(
    /// 32 bf16 weights (GGUF BF16).
    BlockBf16, bf16, true, bf16_blocks_from_bytes
);

/// `x` rounded to f16 (`to_bf16`: bf16) and widened back (exact), as
/// llama.cpp converts the activations of an F16 (BF16) product.
pub fn round_acts(x: &[f32], to_bf16: bool, out: &mut Vec<f32>) {
    out.clear();
    if to_bf16 {
        out.extend(x.iter().map(|&v| bf16::from_f32(v).to_f32()));
    } else {
        out.extend(x.iter().map(|&v| f16::from_f32(v).to_f32()));
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ggml::Flavor;
    use crate::ggml::flavor::has_avx512_bf16;
    use crate::ggml::half::{dot_bf16_pairs, dot_half_row, dot_half_row_scalar, dot_half_row_x4};

    /// The two orders are each a plain dot product up to rounding, and
    /// differ from each other in the last bits (else the choice would not
    /// matter).
    #[test]
    fn both_orders_are_dot_products_and_differ_somewhere() {
        let mut seed = crate::test_rng::Lcg(3);
        let cols = 576;
        let mut differ = 0;
        for _ in 0..50 {
            let w: Vec<BlockF16> = (0..cols / QK)
                .map(|_| BlockF16 {
                    v: std::array::from_fn(|_| f16::from_f32(seed.f31())),
                })
                .collect();
            let x: Vec<f32> = (0..cols)
                .map(|_| f16::from_f32(seed.f31() * 4.0).to_f32())
                .collect();
            let mut wf = vec![0f32; cols];
            BlockF16::dequant(&w, &mut wf);
            let exact: f64 = wf.iter().zip(&x).map(|(a, b)| *a as f64 * *b as f64).sum();
            for fl in [Flavor::Avx2, Flavor::Avx512] {
                let (g, v) = (
                    dot_half_row_scalar(&w, &x, true, fl),
                    dot_half_row_scalar(&w, &x, false, fl),
                );
                for d in [g, v] {
                    assert!((d as f64 - exact).abs() < 1e-3, "{d} vs {exact}");
                }
                differ += (g.to_bits() != v.to_bits()) as usize;
            }
        }
        assert!(differ > 0, "tinyBLAS and vec_dot orders never differed");
    }

    /// The four-token row kernel gives each token the one-token kernel's bits.
    fn assert_x4_equals_one_at_a_time<B: HalfBlock>(w: &[B], x: &[f32], wf: &[f32], fl: Flavor) {
        let four = dot_half_row_x4(w, [x, wf, x, wf], fl);
        let one = [x, wf, x, wf].map(|v| dot_half_row(w, v, true, fl));
        let cols = x.len();
        assert_eq!(
            four.map(f32::to_bits),
            one.map(f32::to_bits),
            "x4, cols {cols}"
        );
    }

    /// The row kernel (intrinsics where the CPU has them) computes the
    /// scalar lane order's bits, tails included.
    #[test]
    fn row_kernel_equals_the_scalar_order_bit_for_bit() {
        let mut seed = crate::test_rng::Lcg(9);
        for cols in [32, 64, 96, 576, 1536] {
            let w: Vec<BlockF16> = (0..cols / QK)
                .map(|_| BlockF16 {
                    v: std::array::from_fn(|_| f16::from_f32(seed.f31())),
                })
                .collect();
            let x: Vec<f32> = (0..cols)
                .map(|_| f16::from_f32(seed.f31() * 3.0).to_f32())
                .collect();
            let mut wf = vec![0f32; cols];
            BlockF16::dequant(&w, &mut wf);
            for fl in [Flavor::Avx2, Flavor::Avx512] {
                for gemm in [false, true] {
                    let a = dot_half_row(&w, &x, gemm, fl);
                    let b = dot_half_row_scalar(&w, &x, gemm, fl);
                    assert_eq!(a.to_bits(), b.to_bits(), "cols {cols} {fl:?} gemm {gemm}");
                }
                assert_x4_equals_one_at_a_time(&w, &x, &wf, fl);
            }
        }
    }

    /// BF16 rows: the intrinsics equal the scalar lane order (both
    /// builds' vector-dot reductions, tinyBLAS, the four-token form).
    #[test]
    fn bf16_row_kernel_equals_the_scalar_order_bit_for_bit() {
        let mut seed = crate::test_rng::Lcg(11);
        for cols in [32, 64, 96, 576, 1536] {
            let w: Vec<BlockBf16> = (0..cols / QK)
                .map(|_| BlockBf16 {
                    v: std::array::from_fn(|_| bf16::from_f32(seed.f31())),
                })
                .collect();
            let x: Vec<f32> = (0..cols)
                .map(|_| bf16::from_f32(seed.f31() * 3.0).to_f32())
                .collect();
            let mut wf = vec![0f32; cols];
            BlockBf16::dequant(&w, &mut wf);
            let exact: f64 = wf.iter().zip(&x).map(|(a, b)| *a as f64 * *b as f64).sum();
            for fl in [Flavor::Avx2, Flavor::Avx512] {
                // AVX-512 on a CPU with AVX-512 BF16: the vdpbf16ps pairs.
                let pairs = fl == Flavor::Avx512 && has_avx512_bf16();
                for gemm in [false, true] {
                    let a = dot_half_row(&w, &x, gemm, fl);
                    let b = if pairs {
                        dot_bf16_pairs(&w, &x, gemm)
                    } else {
                        dot_half_row_scalar(&w, &x, gemm, fl)
                    };
                    assert_eq!(a.to_bits(), b.to_bits(), "cols {cols} {fl:?} gemm {gemm}");
                    assert!((a as f64 - exact).abs() < 1e-3, "{a} vs {exact}");
                    // The pair order is a different sum than the lanes'.
                    let lanes = dot_half_row_scalar(&w, &x, gemm, fl);
                    assert!((lanes as f64 - exact).abs() < 1e-3, "{lanes} vs {exact}");
                }
                assert_x4_equals_one_at_a_time(&w, &x, &wf, fl);
            }
        }
    }

    #[test]
    fn bytes_round_trip() {
        let vals: Vec<f16> = (0..64)
            .map(|i| f16::from_f32(i as f32 * 0.25 - 3.0))
            .collect();
        let raw: Vec<u8> = vals.iter().flat_map(|v| v.to_le_bytes()).collect();
        let blocks = blocks_from_bytes(&raw).unwrap();
        let mut out = vec![0f32; 64];
        BlockF16::dequant(&blocks, &mut out);
        assert_eq!(out[5], 5.0 * 0.25 - 3.0);
        assert!(blocks_from_bytes(&raw[..63]).is_none());
    }
}
