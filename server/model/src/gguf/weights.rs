//! Model weights in the CPU kernels' formats, loaded once and shared read-only.
//!
//! Model weights in the CPU kernels' formats, loaded once and shared
//! read-only (`Arc`) by every session.
//!
//! Per layer, q/k/v are concatenated into one matrix and gate/up into another
//! (when their formats agree) so decode needs fewer parallel sections.

#![forbid(unsafe_code)]

use super::file::GgufFile;
use super::hparams::{Arch, Config};
use crate::error::ModelError;
use crate::quant::QMatrix;

/// One transformer block.
#[derive(Debug)]
pub struct LayerWeights {
    pub attn_norm: Vec<f32>,
    /// Rows: q (`n_head * head_dim`), then k and v (`n_head_kv * head_dim`
    /// each).
    pub wqkv: Fused,
    /// q/k/v biases in the same order (qwen2), or `None`.
    pub bqkv: Option<Vec<f32>>,
    /// Per-head RMSNorm weights (`head_dim` values) of q and k (qwen3).
    pub q_norm: Option<Vec<f32>>,
    pub k_norm: Option<Vec<f32>>,
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
        self.parts().iter().any(QMatrix::needs_q8k)
    }

    /// Whether any part needs Q8_1 activations.
    pub fn needs_q8_1(&self) -> bool {
        self.parts().iter().any(QMatrix::needs_q8_1)
    }

    fn parts(&self) -> &[QMatrix] {
        match self {
            Fused::One(m) => std::slice::from_ref(m),
            Fused::Many(v) => v,
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
    /// `rope_freqs.weight` (Llama 3.1+): one factor per rotated pair that
    /// divides its RoPE angle, or `None`.
    pub rope_freqs: Option<Vec<f32>>,
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
    /// errors naming the file and tensor, and so is a tensor the forward
    /// pass would not use (an output bias, expert weights, …): computing
    /// without it would give wrong numbers, and llama.cpp refuses such files
    /// too (`llama_model_loader::done_getting_tensors`).
    pub fn load(g: &mut GgufFile, c: &Config) -> Result<Self, ModelError> {
        let mut used = std::collections::HashSet::new();
        let w = Self::load_used(g, c, &mut used)?;
        let mut unused: Vec<&str> = g.tensor_names().filter(|n| !used.contains(*n)).collect();
        unused.sort_unstable();
        if let Some(first) = unused.first() {
            return Err(g.tensor_err(
                first,
                format!(
                    "not used by the {} forward pass ({} unused tensor(s)); refusing \
                     rather than computing without it",
                    c.arch.name(),
                    unused.len()
                ),
            ));
        }
        Ok(w)
    }

    fn load_used(
        g: &mut GgufFile,
        c: &Config,
        used: &mut std::collections::HashSet<String>,
    ) -> Result<Self, ModelError> {
        let (d, dq, dkv, hd) = (c.n_embd, c.q_dim(), c.kv_dim(), c.head_dim);
        let mut mat = |g: &mut GgufFile, name: &str, rows: usize, cols: usize| {
            used.insert(name.to_string());
            g.matrix(name, rows, cols)
        };
        let tok_embd = mat(g, "token_embd.weight", c.n_vocab, d)?;
        let mut layers = Vec::with_capacity(c.n_layer);
        let mut vectors = Vec::new();
        for l in 0..c.n_layer {
            let n = |s: &str| format!("blk.{l}.{s}");
            let wq = mat(g, &n("attn_q.weight"), dq, d)?;
            let wk = mat(g, &n("attn_k.weight"), dkv, d)?;
            let wv = mat(g, &n("attn_v.weight"), dkv, d)?;
            let wo = mat(g, &n("attn_output.weight"), d, dq)?;
            let wgu = Fused::new(vec![
                mat(g, &n("ffn_gate.weight"), c.n_ff, d)?,
                mat(g, &n("ffn_up.weight"), c.n_ff, d)?,
            ]);
            let w_down = mat(g, &n("ffn_down.weight"), d, c.n_ff)?;
            // Biases are optional for llama and qwen2 (llama.cpp creates
            // them TENSOR_NOT_REQUIRED); qwen3 has none, so there a bias is
            // left unused and refused by `load`.
            let bqkv = if c.arch != Arch::Qwen3 && g.has_tensor(&n("attn_q.bias")) {
                let mut b = g.vector(&n("attn_q.bias"), dq)?;
                b.extend(g.vector(&n("attn_k.bias"), dkv)?);
                b.extend(g.vector(&n("attn_v.bias"), dkv)?);
                vectors.extend(["attn_q.bias", "attn_k.bias", "attn_v.bias"].map(n));
                Some(b)
            } else {
                None
            };
            // qwen3: RMSNorm over each head of q and k, before RoPE
            // (llama.cpp `src/models/qwen3.cpp`, shape {n_embd_head_k}).
            let (q_norm, k_norm) = if c.qk_norm {
                vectors.extend(["attn_q_norm.weight", "attn_k_norm.weight"].map(n));
                (
                    Some(g.vector(&n("attn_q_norm.weight"), hd)?),
                    Some(g.vector(&n("attn_k_norm.weight"), hd)?),
                )
            } else {
                (None, None)
            };
            vectors.extend(["attn_norm.weight", "ffn_norm.weight"].map(n));
            layers.push(LayerWeights {
                attn_norm: g.vector(&n("attn_norm.weight"), d)?,
                wqkv: Fused::new(vec![wq, wk, wv]),
                bqkv,
                q_norm,
                k_norm,
                wo,
                ffn_norm: g.vector(&n("ffn_norm.weight"), d)?,
                wgu,
                w_down,
            });
        }
        let output = if g.has_tensor("output.weight") {
            Some(mat(g, "output.weight", c.n_vocab, d)?)
        } else {
            None
        };
        let output_norm = g.vector("output_norm.weight", d)?;
        vectors.push("output_norm.weight".into());
        // Llama 3.1+ frequency factors: llama.cpp loads `rope_freqs.weight`
        // for the llama architecture only, shape {n_rot/2}
        // (`src/models/llama.cpp`, LLM_TENSOR_ROPE_FREQS), and passes it to
        // `ggml_rope_ext` as `freq_factors`.
        let rope_freqs = if c.arch == Arch::Llama && g.has_tensor("rope_freqs.weight") {
            vectors.push("rope_freqs.weight".into());
            let v = g.f32_values("rope_freqs.weight")?;
            if v.len() != c.rope_dim / 2 {
                return Err(g.tensor_err(
                    "rope_freqs.weight",
                    format!(
                        "expected shape [{}] (one factor per rotated pair, rope dimension {} / 2), \
                         found {} values",
                        c.rope_dim / 2,
                        c.rope_dim,
                        v.len()
                    ),
                ));
            }
            if let Some(bad) = v.iter().find(|f| !(f.is_finite() && **f > 0.0)) {
                return Err(g.tensor_err(
                    "rope_freqs.weight",
                    format!("factor {bad} is not a positive number"),
                ));
            }
            Some(v)
        } else {
            None
        };
        used.extend(vectors);
        Ok(Weights {
            tok_embd,
            layers,
            output_norm,
            output,
            rope_freqs,
        })
    }
}
