//! The model on the device: the weights and the RoPE table, uploaded once.
//!
//! The model on the device: every weight matrix uploaded once in the CPU
//! loader's block format, whichever it is (Q8_0, Q4_1, Q5_0, Q5_1, Q4_K,
//! Q5_K, Q6_K, F16, BF16; dequantised inside the kernels, never converted),
//! the norms and biases as f32, and the RoPE table.

use std::sync::Arc;

use cudarc::driver::{CudaSlice, CudaStream};

use super::err::err;
use super::format::{ActKind, DevFormat};
use crate::error::ModelError;
use crate::gguf::Config;
use crate::gguf::weights::{Fused, Weights};
use crate::quant::QMatrix;

/// A weight matrix on the device, in the CPU loader's block format.
#[derive(Debug)]
pub(super) struct DevMatrix {
    pub(super) data: CudaSlice<u8>,
    pub(super) rows: usize,
    pub(super) cols: usize,
    pub(super) format: DevFormat,
}

#[derive(Debug)]
pub(super) enum DevFused {
    One(DevMatrix),
    Many(Vec<DevMatrix>),
}

/// Which activation forms the products of one input read (each is
/// computed only when some matrix takes it, as on the CPU).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub(super) struct Needs {
    pub(super) q8_1: bool,
    pub(super) q8k: bool,
    pub(super) f32: bool,
}

impl Needs {
    pub(super) fn of(parts: &[DevMatrix]) -> Needs {
        let has = |k: ActKind| parts.iter().any(|m| m.format.acts() == k);
        Needs {
            q8_1: has(ActKind::Q8_1),
            q8k: has(ActKind::Q8K),
            f32: has(ActKind::F32),
        }
    }
}

impl DevFused {
    pub(super) fn parts(&self) -> &[DevMatrix] {
        match self {
            DevFused::One(m) => std::slice::from_ref(m),
            DevFused::Many(v) => v,
        }
    }
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

    /// Whether any product takes Q8_K activations (the scratch then holds
    /// them).
    pub(super) fn needs_q8k(&self) -> bool {
        let mut all = self.layers.iter().flat_map(|l| {
            l.wqkv
                .parts()
                .iter()
                .chain(l.wgu.parts())
                .chain([&l.wo, &l.w_down])
        });
        all.any(|m| m.format.acts() == ActKind::Q8K) || self.output().format.acts() == ActKind::Q8K
    }
}

fn upload_matrix(
    stream: &Arc<CudaStream>,
    m: &QMatrix,
    what: &str,
) -> Result<DevMatrix, ModelError> {
    let (format, bytes) = DevFormat::of(m);
    let data = stream
        .clone_htod(bytes)
        .map_err(|e| err(&format!("uploading {what}"), e))?;
    Ok(DevMatrix {
        data,
        rows: m.rows(),
        cols: m.cols(),
        format,
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
/// [`rope_table`](crate::cpu::rope::rope_table) (iterative theta, Llama 3.1+ frequency
/// factors, linear scaling), so RoPE matches `crate::cpu::forward` bit for bit.
pub(super) fn rope_table(c: &Config, freq_factors: Option<&[f32]>, positions: usize) -> Vec<f32> {
    let pairs = c.rope_dim / 2;
    let mut row = vec![(0f32, 0f32); pairs];
    let mut t = Vec::with_capacity(positions * pairs * 2);
    for pos in 0..positions {
        crate::cpu::rope::rope_table(c, freq_factors, pos, &mut row);
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
