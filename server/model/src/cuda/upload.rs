//! The model on the device: every weight matrix uploaded once in the CPU
//! loader's block format (Q8_0 or Q4_1, dequantised inside the kernels), the
//! norms and biases as f32, and the RoPE table.

use std::sync::Arc;

use cudarc::driver::{CudaSlice, CudaStream};

use super::backend::err;
use crate::error::ModelError;
use crate::gguf::Config;
use crate::quant::{BlockQ4_1, BlockQ8_0, QMatrix};
use crate::weights::{Fused, Weights};

/// A weight matrix on the device, in the CPU loader's block format.
#[derive(Debug)]
pub(super) struct DevMatrix {
    pub(super) data: CudaSlice<u8>,
    pub(super) rows: usize,
    pub(super) cols: usize,
    pub(super) q4_1: bool,
}

#[derive(Debug)]
pub(super) enum DevFused {
    One(DevMatrix),
    Many(Vec<DevMatrix>),
}

#[derive(Debug)]
pub(super) struct DevLayer {
    pub(super) attn_norm: CudaSlice<f32>,
    pub(super) wqkv: DevFused,
    pub(super) bqkv: Option<CudaSlice<f32>>,
    pub(super) wo: DevMatrix,
    pub(super) ffn_norm: CudaSlice<f32>,
    pub(super) wgu: DevFused,
    pub(super) w_down: DevMatrix,
}

#[derive(Debug)]
pub(super) struct DevWeights {
    pub(super) tok_embd: DevMatrix,
    pub(super) layers: Vec<DevLayer>,
    pub(super) output_norm: CudaSlice<f32>,
    pub(super) output: Option<DevMatrix>,
}

impl DevWeights {
    pub(super) fn output(&self) -> &DevMatrix {
        self.output.as_ref().unwrap_or(&self.tok_embd)
    }
}

/// The raw bytes of a slice of `#[repr(C)]` blocks.
fn block_bytes<T>(blocks: &[T]) -> &[u8] {
    // SAFETY: BlockQ8_0 / BlockQ4_1 are #[repr(C)] with only f32 and byte
    // fields and no padding (36 and 24 bytes), so every byte is initialised;
    // the returned slice borrows `blocks`.
    unsafe {
        std::slice::from_raw_parts(blocks.as_ptr().cast::<u8>(), std::mem::size_of_val(blocks))
    }
}

fn upload_matrix(
    stream: &Arc<CudaStream>,
    m: &QMatrix,
    what: &str,
) -> Result<DevMatrix, ModelError> {
    // The device kernels know Q8_0 and Q4_1 only: K-quant matrices go up
    // requantised to Q8_0 (as the CPU loader did before it kept them).
    let m = &*m.to_q8_0_if_k();
    let (bytes, q4_1) = match m {
        QMatrix::Q8_0 { blocks, .. } => (block_bytes::<BlockQ8_0>(blocks), false),
        QMatrix::Q4_1 { blocks, .. } => (block_bytes::<BlockQ4_1>(blocks), true),
        _ => unreachable!("to_q8_0_if_k leaves no K-quant"),
    };
    let data = stream
        .clone_htod(bytes)
        .map_err(|e| err(&format!("uploading {what}"), e))?;
    Ok(DevMatrix {
        data,
        rows: m.rows(),
        cols: m.cols(),
        q4_1,
    })
}

fn upload_fused(stream: &Arc<CudaStream>, f: &Fused, what: &str) -> Result<DevFused, ModelError> {
    Ok(match f {
        Fused::One(m) => DevFused::One(upload_matrix(stream, m, what)?),
        Fused::Many(v) => DevFused::Many(
            v.iter()
                .map(|m| upload_matrix(stream, m, what))
                .collect::<Result<_, _>>()?,
        ),
    })
}

pub(super) fn upload_f32(
    stream: &Arc<CudaStream>,
    v: &[f32],
    what: &str,
) -> Result<CudaSlice<f32>, ModelError> {
    stream
        .clone_htod(v)
        .map_err(|e| err(&format!("uploading {what}"), e))
}

/// cos/sin per rotated pair for every position, from the CPU path's
/// [`crate::rope::rope_table`] (iterative theta, Llama 3.1+ frequency
/// factors, linear scaling), so RoPE matches `forward.rs` bit for bit.
pub(super) fn rope_table(c: &Config, freq_factors: Option<&[f32]>, positions: usize) -> Vec<f32> {
    let pairs = c.rope_dim / 2;
    let mut row = vec![(0f32, 0f32); pairs];
    let mut t = Vec::with_capacity(positions * pairs * 2);
    for pos in 0..positions {
        crate::rope::rope_table(c, freq_factors, pos, &mut row);
        for &(cos, sin) in &row {
            t.push(cos);
            t.push(sin);
        }
    }
    t
}

/// Uploads every weight of `weights` on `stream` (the caller synchronises).
pub(super) fn upload_weights(
    stream: &Arc<CudaStream>,
    weights: &Weights,
) -> Result<DevWeights, ModelError> {
    let layers = weights
        .layers
        .iter()
        .enumerate()
        .map(|(l, lw)| {
            let n = |s: &str| format!("blk.{l}.{s}");
            Ok(DevLayer {
                attn_norm: upload_f32(stream, &lw.attn_norm, &n("attn_norm"))?,
                wqkv: upload_fused(stream, &lw.wqkv, &n("attn_qkv"))?,
                bqkv: lw
                    .bqkv
                    .as_ref()
                    .map(|b| upload_f32(stream, b, &n("attn_qkv.bias")))
                    .transpose()?,
                wo: upload_matrix(stream, &lw.wo, &n("attn_output"))?,
                ffn_norm: upload_f32(stream, &lw.ffn_norm, &n("ffn_norm"))?,
                wgu: upload_fused(stream, &lw.wgu, &n("ffn_gate_up"))?,
                w_down: upload_matrix(stream, &lw.w_down, &n("ffn_down"))?,
            })
        })
        .collect::<Result<Vec<_>, ModelError>>()?;
    Ok(DevWeights {
        tok_embd: upload_matrix(stream, &weights.tok_embd, "token_embd")?,
        layers,
        output_norm: upload_f32(stream, &weights.output_norm, "output_norm")?,
        output: weights
            .output
            .as_ref()
            .map(|m| upload_matrix(stream, m, "output"))
            .transpose()?,
    })
}
