//! What a block format is: values per block, dequantisation, the 32-value formats' integers.

/// Values per quantisation block.
pub const QK: usize = 32;

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
/// lanes' SIMD form (`kernels::avx2::rows`); `kernels::scalar::dot` is the
/// portable reference. Dequantised (ggml's `dequantize_row_*`) as `d·q (+ m)`.
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
        impl $crate::quant::format::block::Block32 for $t {
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
            fn values(&self) -> [i8; $crate::quant::format::block::QK] {
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
pub(super) use block32;
