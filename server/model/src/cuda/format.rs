//! The weight formats the CUDA kernels take, and the orders a launch picks.
//!
//! The weight formats the CUDA kernels take — every [`QMatrix`] variant, in
//! the CPU loader's in-memory block layout, uploaded as is — and the
//! choices the launches make for a product: which activations its weights
//! read and which of the CPU's arithmetic orders it follows. Shared by the
//! backend (`upload`, `launch`) and the emulation test, so both name the
//! same kernels and upload the same bytes.

use crate::quant::QK_K;
use crate::quant::QMatrix;

/// A weight matrix's block format on the device.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum DevFormat {
    Q8_0,
    Q4_1,
    Q5_0,
    Q5_1,
    Q4K,
    Q5K,
    Q6K,
    F16,
    Bf16,
}

/// The activations a format's products read.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum ActKind {
    /// Q8_1 blocks (32 values; `quantize_q8_1`).
    Q8_1,
    /// Q8_K blocks (256 values; `quantize_q8_k`).
    Q8K,
    /// The f32 values, rounded to f16 / bf16 inside the product.
    F32,
}

impl DevFormat {
    pub(crate) const ALL: [DevFormat; 9] = [
        DevFormat::Q8_0,
        DevFormat::Q4_1,
        DevFormat::Q5_0,
        DevFormat::Q5_1,
        DevFormat::Q4K,
        DevFormat::Q5K,
        DevFormat::Q6K,
        DevFormat::F16,
        DevFormat::Bf16,
    ];

    /// The format of `m` and its blocks' bytes, as uploaded.
    pub(crate) fn of(m: &QMatrix) -> (DevFormat, &[u8]) {
        match m {
            QMatrix::Q8_0 { blocks, .. } => (DevFormat::Q8_0, block_bytes(blocks)),
            QMatrix::Q4_1 { blocks, .. } => (DevFormat::Q4_1, block_bytes(blocks)),
            QMatrix::Q5_0 { blocks, .. } => (DevFormat::Q5_0, block_bytes(blocks)),
            QMatrix::Q5_1 { blocks, .. } => (DevFormat::Q5_1, block_bytes(blocks)),
            QMatrix::Q4K { blocks, .. } => (DevFormat::Q4K, block_bytes(blocks)),
            QMatrix::Q5K { blocks, .. } => (DevFormat::Q5K, block_bytes(blocks)),
            QMatrix::Q6K { blocks, .. } => (DevFormat::Q6K, block_bytes(blocks)),
            QMatrix::F16 { blocks, .. } => (DevFormat::F16, block_bytes(blocks)),
            QMatrix::Bf16 { blocks, .. } => (DevFormat::Bf16, block_bytes(blocks)),
        }
    }

    /// The suffix of its kernels' names (`embed_*`, `mmw_*`, `mm_*`).
    pub(crate) fn suffix(self) -> &'static str {
        match self {
            DevFormat::Q8_0 => "q8_0",
            DevFormat::Q4_1 => "q4_1",
            DevFormat::Q5_0 => "q5_0",
            DevFormat::Q5_1 => "q5_1",
            DevFormat::Q4K => "q4_k",
            DevFormat::Q5K => "q5_k",
            DevFormat::Q6K => "q6_k",
            DevFormat::F16 => "f16",
            DevFormat::Bf16 => "bf16",
        }
    }

    /// Bytes of one block in the uploaded layout (the CUDA structs' sizes;
    /// the tests check both sides against it).
    #[cfg(test)]
    pub(crate) fn block_bytes(self) -> usize {
        match self {
            DevFormat::Q8_0 => 36,
            DevFormat::Q4_1 | DevFormat::Q5_0 => 24,
            DevFormat::Q5_1 => 28,
            DevFormat::Q4K => 152,
            DevFormat::Q5K => 184,
            DevFormat::Q6K => 212,
            DevFormat::F16 | DevFormat::Bf16 => 64,
        }
    }

    pub(crate) fn acts(self) -> ActKind {
        match self {
            DevFormat::Q8_0 | DevFormat::Q4_1 | DevFormat::Q5_0 | DevFormat::Q5_1 => ActKind::Q8_1,
            DevFormat::Q4K | DevFormat::Q5K | DevFormat::Q6K => ActKind::Q8K,
            DevFormat::F16 | DevFormat::Bf16 => ActKind::F32,
        }
    }

    /// The `nb` argument of its product kernels for rows of `cols` values:
    /// 256-value super-blocks for the K-quants, 32-value blocks otherwise.
    pub(crate) fn kernel_blocks(self, cols: usize) -> usize {
        match self.acts() {
            ActKind::Q8K => cols / QK_K,
            _ => cols / crate::quant::QK,
        }
    }
}

/// Bytes of a Q8_K activation block (`bq8_K`: f32 d, 256 × i8, 16 × i16).
pub(crate) const Q8K_BYTES: usize = 292;

/// The raw bytes of a slice of `#[repr(C)]` weight blocks.
fn block_bytes<T>(blocks: &[T]) -> &[u8] {
    // SAFETY: only called (in `DevFormat::of`) on the block types of
    // `QMatrix`, all #[repr(C)] with f32 / integer / f16 fields and no
    // padding (their sizes are checked against the CUDA structs' in the
    // tests), so every byte is initialised; the slice borrows `blocks`.
    unsafe {
        std::slice::from_raw_parts(blocks.as_ptr().cast::<u8>(), std::mem::size_of_val(blocks))
    }
}

/// Which of the CPU backend's arithmetic orders a product follows
/// (`crate::cpu::forward`): the K-quants' tiled order for the rows of a step of
/// 8+ tokens (`quant::TILED_MIN_ROWS`), tinyBLAS's for F16/BF16 in steps
/// of 2+ tokens, the vector-dot orders otherwise. Q8_0 / Q4_1 / Q5_0 /
/// Q5_1 have one order.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Order {
    pub(crate) tiled: bool,
    pub(crate) gemm: bool,
}

impl Order {
    /// The order of a product in a step of `n` tokens. `one_row`: the last
    /// layer's feed-forward and the output head, which llama.cpp (and so
    /// the CPU backend) computes for the output rows only, always in the
    /// one-row orders.
    pub(crate) fn of_step(n: usize, one_row: bool) -> Order {
        Order {
            tiled: !one_row && n >= crate::quant::TILED_MIN_ROWS,
            gemm: !one_row && n >= 2,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::quant::BlockQ5_0;
    use crate::quant::BlockQ5_1;
    use crate::quant::{BlockBf16, BlockF16};
    use crate::quant::{BlockQ4_1, BlockQ8_0};
    use crate::quant::{BlockQ4K, BlockQ5K, BlockQ6K, BlockQ8K};

    /// The CPU loader's blocks have no padding and the sizes of the CUDA
    /// structs they are uploaded into (the emulation harness checks the
    /// structs' sizes against the same numbers).
    #[test]
    fn host_blocks_have_the_device_layouts() {
        use std::mem::size_of;
        let host = [
            size_of::<BlockQ8_0>(),
            size_of::<BlockQ4_1>(),
            size_of::<BlockQ5_0>(),
            size_of::<BlockQ5_1>(),
            size_of::<BlockQ4K>(),
            size_of::<BlockQ5K>(),
            size_of::<BlockQ6K>(),
            size_of::<BlockF16>(),
            size_of::<BlockBf16>(),
        ];
        for (f, h) in DevFormat::ALL.iter().zip(host) {
            assert_eq!(f.block_bytes(), h, "{f:?}");
        }
        assert_eq!(size_of::<BlockQ8K>(), Q8K_BYTES);
    }

    #[test]
    fn orders_follow_the_step_size() {
        let vec_dot = Order {
            tiled: false,
            gemm: false,
        };
        assert_eq!(Order::of_step(1, false), vec_dot);
        assert_eq!(
            Order::of_step(2, false),
            Order {
                tiled: false,
                gemm: true
            }
        );
        assert!(!Order::of_step(7, false).tiled);
        assert_eq!(
            Order::of_step(8, false),
            Order {
                tiled: true,
                gemm: true
            }
        );
        assert_eq!(Order::of_step(40, true), vec_dot);
    }
}
