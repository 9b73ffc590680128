//! A weight tensor of the file as a [`QMatrix`] in one of the kernel formats.

#![forbid(unsafe_code)]

use candle_core::quantized::GgmlDType;

use super::file::GgufFile;
use crate::error::ModelError;
use crate::quant::{KQuant, QK, QK_K, QMatrix};

impl GgufFile {
    /// A `rows × cols` weight matrix in a kernel format: Q4_1, Q5_0, Q5_1, Q8_0,
    /// Q4_K, Q5_K, Q6_K, F16 and BF16 kept as they are, Q4_0 as the equal Q8_0 blocks,
    /// everything else requantised to Q8_0. A tensor cut short by
    /// the end of the file is a [`ModelError::Truncated`] naming it and the
    /// byte range it needs (see [`Self::raw`]).
    pub fn matrix(&mut self, name: &str, rows: usize, cols: usize) -> Result<QMatrix, ModelError> {
        let dims = self.dims(name)?;
        if dims != [rows, cols] {
            return Err(self.tensor_err(
                name,
                format!("expected shape [{rows}, {cols}], found {dims:?}"),
            ));
        }
        if !cols.is_multiple_of(QK) {
            return Err(self.tensor_err(name, format!("row length {cols} is not a multiple of 32")));
        }
        let dtype = self.info(name)?.ggml_dtype;
        // The formats read from their stored blocks, by constructor; the
        // others through f32.
        type FromBytes = fn(usize, usize, &[u8]) -> Option<QMatrix>;
        let from_bytes: Option<FromBytes> = match dtype {
            GgmlDType::Q8_0 => Some(QMatrix::from_q8_0_bytes),
            GgmlDType::Q4_1 => Some(QMatrix::from_q4_1_bytes),
            GgmlDType::F16 => Some(QMatrix::from_f16_bytes),
            GgmlDType::BF16 => Some(QMatrix::from_bf16_bytes),
            GgmlDType::Q5_0 => Some(QMatrix::from_q5_0_bytes),
            GgmlDType::Q5_1 => Some(QMatrix::from_q5_1_bytes),
            GgmlDType::Q4_0 => Some(|r, c, raw| QMatrix::q8_0_from_q4_0_or_q5_0(false, r, c, raw)),
            GgmlDType::Q4K | GgmlDType::Q5K | GgmlDType::Q6K => {
                if !cols.is_multiple_of(QK_K) {
                    return Err(self.tensor_err(
                        name,
                        format!("{dtype:?} row length {cols} is not a multiple of 256"),
                    ));
                }
                Some(match dtype {
                    GgmlDType::Q4K => |r, c, raw| QMatrix::from_k_bytes(KQuant::Q4K, r, c, raw),
                    GgmlDType::Q5K => |r, c, raw| QMatrix::from_k_bytes(KQuant::Q5K, r, c, raw),
                    _ => |r, c, raw| QMatrix::from_k_bytes(KQuant::Q6K, r, c, raw),
                })
            }
            _ => None,
        };
        let m = match from_bytes {
            Some(from_bytes) => {
                let (_, _, raw) = self.raw(name)?;
                from_bytes(rows, cols, &raw)
            }
            None => {
                let v = self.f32_values(name)?;
                QMatrix::q8_0_from_f32(rows, cols, &v)
            }
        };
        m.ok_or_else(|| self.tensor_err(name, format!("{dtype:?} data has the wrong size")))
    }
}
