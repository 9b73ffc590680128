//! Model weights in the CPU kernels' formats, loaded once and shared
//! read-only (`Arc`) by every session.
//!
//! Per layer, q/k/v are concatenated into one matrix and gate/up into another
//! (when their formats agree) so decode needs fewer parallel sections.

#![forbid(unsafe_code)]

use crate::error::ModelError;
use crate::gguf::{Config, GgufFile};
use crate::quant::QMatrix;

/// One transformer block.
#[derive(Debug)]
pub struct LayerWeights {
    pub attn_norm: Vec<f32>,
    /// Rows: q (`n_embd`), then k and v (`n_head_kv * head_dim` each).
    pub wqkv: Fused,
    /// q/k/v biases in the same order (qwen2), or `None`.
    pub bqkv: Option<Vec<f32>>,
    pub wo: QMatrix,
    pub ffn_norm: Vec<f32>,
    /// Rows: gate (`n_ff`), then up (`n_ff`).
    pub wgu: Fused,
    pub w_down: QMatrix,
}

/// Matrices applied to the same input: one concatenated matrix, or separate
/// ones when their formats differ.
#[derive(Debug)]
pub enum Fused {
    One(QMatrix),
    Many(Vec<QMatrix>),
}

impl Fused {
    fn new(parts: Vec<QMatrix>) -> Self {
        match QMatrix::concat(parts) {
            Ok(m) => Fused::One(m),
            Err(parts) => Fused::Many(parts),
        }
    }

    /// Whether any part needs Q8_K activations.
    pub fn needs_q8k(&self) -> bool {
        match self {
            Fused::One(m) => m.needs_q8k(),
            Fused::Many(v) => v.iter().any(|m| m.needs_q8k()),
        }
    }

    /// Bytes the weights take in memory.
    pub fn nbytes(&self) -> usize {
        match self {
            Fused::One(m) => m.nbytes(),
            Fused::Many(v) => v.iter().map(|m| m.nbytes()).sum(),
        }
    }

    pub fn rows(&self) -> usize {
        match self {
            Fused::One(m) => m.rows(),
            Fused::Many(v) => v.iter().map(|m| m.rows()).sum(),
        }
    }
}

/// All weights.
#[derive(Debug)]
pub struct Weights {
    pub tok_embd: QMatrix,
    pub layers: Vec<LayerWeights>,
    pub output_norm: Vec<f32>,
    /// `output.weight`, or `None` when tied to `tok_embd`.
    pub output: Option<QMatrix>,
}

impl Weights {
    pub fn output(&self) -> &QMatrix {
        self.output.as_ref().unwrap_or(&self.tok_embd)
    }

    /// Bytes the weight matrices take in memory (norms and biases left out).
    pub fn nbytes(&self) -> usize {
        self.tok_embd.nbytes()
            + self.output.as_ref().map_or(0, |m| m.nbytes())
            + self
                .layers
                .iter()
                .map(|l| l.wqkv.nbytes() + l.wo.nbytes() + l.wgu.nbytes() + l.w_down.nbytes())
                .sum::<usize>()
    }

    /// Every matrix's name and format, e.g. for a load log.
    pub fn formats(&self) -> std::collections::BTreeMap<&'static str, usize> {
        let mut m = std::collections::BTreeMap::new();
        let mut add = |q: &QMatrix| *m.entry(q.format()).or_insert(0) += 1;
        add(&self.tok_embd);
        if let Some(o) = &self.output {
            add(o);
        }
        for l in &self.layers {
            for f in [&l.wqkv, &l.wgu] {
                match f {
                    Fused::One(q) => add(q),
                    Fused::Many(v) => v.iter().for_each(&mut add),
                }
            }
            add(&l.wo);
            add(&l.w_down);
        }
        m
    }

    /// Loads every tensor the config needs; missing or misshapen tensors are
    /// errors naming the file and tensor.
    pub fn load(g: &mut GgufFile, c: &Config) -> Result<Self, ModelError> {
        let d = c.n_embd;
        let dkv = c.n_head_kv * c.head_dim;
        let tok_embd = g.matrix("token_embd.weight", c.n_vocab, d)?;
        let mut layers = Vec::with_capacity(c.n_layer);
        for l in 0..c.n_layer {
            let n = |s: &str| format!("blk.{l}.{s}");
            let wq = g.matrix(&n("attn_q.weight"), d, d)?;
            let wk = g.matrix(&n("attn_k.weight"), dkv, d)?;
            let wv = g.matrix(&n("attn_v.weight"), dkv, d)?;
            let bqkv = if g.has_tensor(&n("attn_q.bias")) {
                let mut b = g.vector(&n("attn_q.bias"), d)?;
                b.extend(g.vector(&n("attn_k.bias"), dkv)?);
                b.extend(g.vector(&n("attn_v.bias"), dkv)?);
                Some(b)
            } else {
                None
            };
            layers.push(LayerWeights {
                attn_norm: g.vector(&n("attn_norm.weight"), d)?,
                wqkv: Fused::new(vec![wq, wk, wv]),
                bqkv,
                wo: g.matrix(&n("attn_output.weight"), d, d)?,
                ffn_norm: g.vector(&n("ffn_norm.weight"), d)?,
                wgu: Fused::new(vec![
                    g.matrix(&n("ffn_gate.weight"), c.n_ff, d)?,
                    g.matrix(&n("ffn_up.weight"), c.n_ff, d)?,
                ]),
                w_down: g.matrix(&n("ffn_down.weight"), d, c.n_ff)?,
            });
        }
        let output_norm = g.vector("output_norm.weight", d)?;
        let output = if g.has_tensor("output.weight") {
            Some(g.matrix("output.weight", c.n_vocab, d)?)
        } else {
            None
        };
        Ok(Weights {
            tok_embd,
            layers,
            output_norm,
            output,
        })
    }
}
