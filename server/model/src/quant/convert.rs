//! [`QMatrix`] constructors beyond Q8_0/Q4_1, fusing matrices, and Q5_0 as Q8_0.
//!
//! [`QMatrix`] constructors from the GGUF block formats beyond Q8_0/Q4_1
//! (K-quants, Q5_0, Q4_0), fusing same-format matrices, and Q5_0's exact
//! expansion to Q8_0.

use crate::quant::format::block::QK;
use crate::quant::format::bytes::{blocks_from_bytes, f16_le, whole_rows};
use crate::quant::format::kquant::{self, QK_K};
use crate::quant::format::q5_0;
use crate::quant::format::q8::BlockQ8_0;
use crate::quant::matrix::QMatrix;

/// The K-quant types kept natively.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum KQuant {
    Q4K,
    Q5K,
    Q6K,
}

impl KQuant {
    /// Bytes of one stored 256-value block.
    pub fn block_bytes(self) -> usize {
        match self {
            KQuant::Q4K => kquant::Q4K_BYTES,
            KQuant::Q5K => kquant::Q5K_BYTES,
            KQuant::Q6K => kquant::Q6K_BYTES,
        }
    }
}

impl QMatrix {
    /// A Q5_0 matrix as the exactly equal Q8_0 blocks (`format::q5_0`);
    /// `None` for any other format.
    pub fn q5_0_as_q8_0(&self) -> Option<QMatrix> {
        let QMatrix::Q5_0 { rows, cols, blocks } = self else {
            return None;
        };
        let blocks = blocks.iter().map(q5_0::as_q8_0).collect();
        Some(QMatrix::Q8_0 {
            rows: *rows,
            cols: *cols,
            blocks,
        })
    }

    /// From raw GGUF K-quant bytes (`ggml_type` Q4_K / Q5_K / Q6_K, by the
    /// block size in bytes); `None` when the row length is not a multiple of
    /// 256 or the data is not `rows × cols` values.
    pub fn from_k_bytes(kind: KQuant, rows: usize, cols: usize, raw: &[u8]) -> Option<Self> {
        if !whole_rows(rows, cols, QK_K, kind.block_bytes(), raw) {
            return None;
        }
        Some(match kind {
            KQuant::Q4K => QMatrix::Q4K {
                rows,
                cols,
                blocks: kquant::q4k_from_bytes(raw)?,
            },
            KQuant::Q5K => QMatrix::Q5K {
                rows,
                cols,
                blocks: kquant::q5k_from_bytes(raw)?,
            },
            KQuant::Q6K => QMatrix::Q6K {
                rows,
                cols,
                blocks: kquant::q6k_from_bytes(raw)?,
            },
        })
    }

    /// From raw GGUF Q5_0 bytes (22 bytes per block), kept natively.
    pub fn from_q5_0_bytes(rows: usize, cols: usize, raw: &[u8]) -> Option<Self> {
        if !whole_rows(rows, cols, QK, q5_0::Q5_0_BYTES, raw) {
            return None;
        }
        Some(QMatrix::Q5_0 {
            rows,
            cols,
            blocks: q5_0::from_bytes(raw)?,
        })
    }

    /// From raw GGUF Q5_1 bytes (24 bytes per block), kept natively.
    pub fn from_q5_1_bytes(rows: usize, cols: usize, raw: &[u8]) -> Option<Self> {
        if !whole_rows(rows, cols, QK, crate::quant::format::q5_1::Q5_1_BYTES, raw) {
            return None;
        }
        Some(QMatrix::Q5_1 {
            rows,
            cols,
            blocks: crate::quant::format::q5_1::from_bytes(raw)?,
        })
    }

    /// Concatenates the rows of matrices of one format and row length
    /// (fused q/k/v, gate/up); the parts back when they differ.
    pub fn concat(parts: Vec<QMatrix>) -> Result<QMatrix, Vec<QMatrix>> {
        let same = parts.windows(2).all(|w| {
            std::mem::discriminant(&w[0]) == std::mem::discriminant(&w[1])
                && w[0].cols() == w[1].cols()
        });
        if parts.is_empty() || !same {
            return Err(parts);
        }
        let rows = parts.iter().map(|m| m.rows()).sum();
        let cols = parts[0].cols();
        macro_rules! cat {
            ($v:ident) => {{
                let mut all = Vec::new();
                for m in parts {
                    if let QMatrix::$v { blocks, .. } = m {
                        all.extend(blocks);
                    }
                }
                QMatrix::$v {
                    rows,
                    cols,
                    blocks: all,
                }
            }};
        }
        Ok(match &parts[0] {
            QMatrix::Q8_0 { .. } => cat!(Q8_0),
            QMatrix::Q4_1 { .. } => cat!(Q4_1),
            QMatrix::Q5_0 { .. } => cat!(Q5_0),
            QMatrix::Q5_1 { .. } => cat!(Q5_1),
            QMatrix::Q4K { .. } => cat!(Q4K),
            QMatrix::Q5K { .. } => cat!(Q5K),
            QMatrix::Q6K { .. } => cat!(Q6K),
            QMatrix::F16 { .. } => cat!(F16),
            QMatrix::Bf16 { .. } => cat!(Bf16),
        })
    }

    /// From raw GGUF Q4_0 (18 bytes per block: f16 d, 16 × u8; `x = d·(q − 8)`)
    /// or Q5_0 (22 bytes: f16 d, u32 qh, 16 × u8; `x = d·(q − 16)`) bytes, as
    /// the exactly equal Q8_0 blocks (see the module comment).
    pub fn q8_0_from_q4_0_or_q5_0(
        five: bool,
        rows: usize,
        cols: usize,
        raw: &[u8],
    ) -> Option<Self> {
        if five {
            // ggml's dequantize_row_q5_0 values (`q5_0::values`).
            return Self::from_q5_0_bytes(rows, cols, raw).and_then(|m| m.q5_0_as_q8_0());
        }
        if !whole_rows(rows, cols, QK, 18, raw) {
            return None;
        }
        let blocks = blocks_from_bytes(raw, |c: &[u8; 18]| BlockQ8_0 {
            d: f16_le(c),
            qs: std::array::from_fn(|j| {
                let b = c[2 + j % (QK / 2)];
                let q = if j < QK / 2 { b & 0x0F } else { b >> 4 };
                q as i8 - 8
            }),
        })?;
        Some(QMatrix::Q8_0 { rows, cols, blocks })
    }
}
