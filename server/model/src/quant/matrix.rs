//! [`QMatrix`]: a weight matrix in one of the kernel formats, its shape and bytes, and its rows.

use half::f16;

use crate::quant::format::block::{QK, WeightBlock};
use crate::quant::format::bytes::{blocks_from_bytes, bytes_at, f16_le, whole_rows};
use crate::quant::format::half::{BlockBf16, BlockF16};
use crate::quant::format::kquant::{BlockQ4K, BlockQ5K, BlockQ6K};
use crate::quant::format::q4_1::BlockQ4_1;
use crate::quant::format::q5_0::BlockQ5_0;
use crate::quant::format::q5_1::BlockQ5_1;
use crate::quant::format::q8::BlockQ8_0;

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
        blocks: Vec<BlockF16>,
    },
    Bf16 {
        rows: usize,
        cols: usize,
        blocks: Vec<BlockBf16>,
    },
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
