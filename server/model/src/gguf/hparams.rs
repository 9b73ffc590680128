//! Hyper-parameters: the supported architectures and their [`Config`].
//!
//! Hyper-parameters: the supported architectures and their [`Config`],
//! read from `<arch>.*` metadata with llama.cpp's keys and defaults, and the
//! ones refused because this host does not implement them.

#![forbid(unsafe_code)]

use super::file::GgufFile;
use crate::error::ModelError;

/// Supported model architectures (`general.architecture`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Arch {
    /// Llama 1–3.x, and Mistral / Mistral Nemo (their GGUFs say `llama`).
    Llama,
    Qwen2,
    /// Qwen2's block without q/k/v biases, with a per-head RMSNorm of q and
    /// k before RoPE (llama.cpp `src/models/qwen3.cpp`).
    Qwen3,
}

impl Arch {
    /// Every supported architecture, as `general.architecture` names it.
    pub const SUPPORTED: &'static str = "llama (also Mistral), qwen2, qwen3";

    pub fn name(self) -> &'static str {
        match self {
            Arch::Llama => "llama",
            Arch::Qwen2 => "qwen2",
            Arch::Qwen3 => "qwen3",
        }
    }
}

/// Model hyper-parameters read from `<arch>.*` metadata.
#[derive(Debug, Clone, PartialEq)]
pub struct Config {
    pub arch: Arch,
    /// `<arch>.context_length`: the training context.
    pub n_ctx_train: usize,
    /// `<arch>.embedding_length`.
    pub n_embd: usize,
    /// `<arch>.block_count`.
    pub n_layer: usize,
    /// `<arch>.attention.head_count`.
    pub n_head: usize,
    /// `<arch>.attention.head_count_kv` (defaults to `n_head`).
    pub n_head_kv: usize,
    /// `<arch>.attention.key_length` (default `n_embd / n_head`); it may
    /// differ from `n_embd / n_head` (Qwen3 0.6B/4B, Mistral Nemo), so the
    /// query and attention-output width is `n_head * head_dim`
    /// ([`Self::q_dim`]), not `n_embd`.
    pub head_dim: usize,
    /// `<arch>.feed_forward_length`.
    pub n_ff: usize,
    /// `<arch>.rope.freq_base` (default 10000).
    pub rope_freq_base: f32,
    /// `<arch>.rope.dimension_count` (default `head_dim`).
    pub rope_dim: usize,
    /// Linear RoPE scaling: `1 / <arch>.rope.scaling.factor` (1 without
    /// one, or with scaling type `none`); llama.cpp's `freq_scale`.
    pub rope_freq_scale: f32,
    /// NEOX-style rotation (pairs `i`, `i + rope_dim/2`; qwen2/3) instead of
    /// adjacent pairs (llama, whose GGUF q/k weights are permuted for it).
    pub rope_neox: bool,
    /// `<arch>.attention.layer_norm_rms_epsilon`.
    pub rms_eps: f32,
    /// Per-head RMSNorm of q and k before RoPE (qwen3's
    /// `blk.N.attn_q_norm.weight` / `attn_k_norm.weight`).
    pub qk_norm: bool,
    /// Rows of `token_embd.weight`.
    pub n_vocab: usize,
}

impl Config {
    /// Width of the queries and of the attention output: `n_head * head_dim`.
    pub fn q_dim(&self) -> usize {
        self.n_head * self.head_dim
    }

    /// Width of the keys (and values): `n_head_kv * head_dim`.
    pub fn kv_dim(&self) -> usize {
        self.n_head_kv * self.head_dim
    }
}

/// The largest head size the attention pass handles (its per-head query
/// buffer; llama.cpp's largest common head size is 256 too).
pub const MAX_HEAD_DIM: usize = 256;

impl GgufFile {
    /// The architecture, checked against the supported ones.
    pub fn arch(&self) -> Result<Arch, ModelError> {
        let a = self
            .get_str("general.architecture")?
            .ok_or_else(|| self.meta_err("general.architecture", "missing"))?;
        match a {
            "llama" => Ok(Arch::Llama),
            "qwen2" => Ok(Arch::Qwen2),
            "qwen3" => Ok(Arch::Qwen3),
            other => Err(ModelError::UnsupportedArchitecture {
                path: self.path().to_path_buf(),
                arch: other.to_string(),
                supported: Arch::SUPPORTED,
            }),
        }
    }

    /// Reads and validates the hyper-parameters. Keys and defaults follow
    /// llama.cpp's `llama_model::load_hparams` (`src/llama-model.cpp`);
    /// hyper-parameters that would change the computation in ways this host
    /// does not implement (mixture of experts, YaRN / LongRoPE scaling,
    /// a custom attention scale, different K and V head sizes) are
    /// [`ModelError::Metadata`] errors naming the key, never ignored.
    pub fn config(&self) -> Result<Config, ModelError> {
        let arch = self.arch()?;
        let p = arch.name();
        let k = |s: &str| format!("{p}.{s}");
        let n_embd = self.require_usize(&k("embedding_length"))?;
        let n_head = self.require_usize(&k("attention.head_count"))?;
        let n_head_kv = self
            .get_usize(&k("attention.head_count_kv"))?
            .unwrap_or(n_head);
        if n_head == 0 {
            return Err(self.meta_err(&k("attention.head_count"), "0 heads"));
        }
        if n_head_kv == 0 || n_head % n_head_kv != 0 {
            return Err(self.meta_err(
                &k("attention.head_count_kv"),
                format!("{n_head_kv} KV heads do not divide {n_head} heads"),
            ));
        }
        let head_dim = match self.get_usize(&k("attention.key_length"))? {
            Some(hd) => hd,
            None if n_embd % n_head == 0 => n_embd / n_head,
            None => {
                return Err(self.meta_err(
                    &k("attention.head_count"),
                    format!(
                        "{n_head} heads do not divide embedding length {n_embd} \
                         (and there is no attention.key_length)"
                    ),
                ));
            }
        };
        if head_dim == 0 || head_dim > MAX_HEAD_DIM || head_dim % 2 != 0 {
            return Err(self.meta_err(
                &k("attention.key_length"),
                format!(
                    "head size {head_dim} unsupported (expected an even size up to {MAX_HEAD_DIM})"
                ),
            ));
        }
        if let Some(hv) = self.get_usize(&k("attention.value_length"))?
            && hv != head_dim
        {
            return Err(self.meta_err(
                &k("attention.value_length"),
                format!(
                    "value head size {hv} differs from the key head size {head_dim}; not supported"
                ),
            ));
        }
        let rope_dim = self
            .get_usize(&k("rope.dimension_count"))?
            .unwrap_or(head_dim);
        if rope_dim > head_dim || rope_dim % 2 != 0 {
            return Err(self.meta_err(
                &k("rope.dimension_count"),
                format!("{rope_dim} invalid for head size {head_dim}"),
            ));
        }
        self.check_unsupported(p)?;
        let n_vocab = self.info("token_embd.weight")?.shape.dims()[0];
        Ok(Config {
            arch,
            n_ctx_train: self.get_usize(&k("context_length"))?.unwrap_or(2048),
            n_embd,
            n_layer: self.require_usize(&k("block_count"))?,
            n_head,
            n_head_kv,
            head_dim,
            n_ff: self.require_usize(&k("feed_forward_length"))?,
            rope_freq_base: self.get_f32(&k("rope.freq_base"))?.unwrap_or(10000.0),
            rope_dim,
            rope_freq_scale: self.rope_freq_scale(p)?,
            rope_neox: matches!(arch, Arch::Qwen2 | Arch::Qwen3),
            rms_eps: self
                .get_f32(&k("attention.layer_norm_rms_epsilon"))?
                .unwrap_or(1e-5),
            qk_norm: arch == Arch::Qwen3,
            n_vocab,
        })
    }

    /// llama.cpp's `freq_scale`: `rope.scaling.type` defaults to `linear`,
    /// whose `1 / rope.scaling.factor` (or the older `rope.scale_linear`)
    /// scales every angle; `none` means 1 (`llama_context` constructor,
    /// "never scale if scaling type is none"). YaRN and LongRoPE change the
    /// angles per dimension in ways not implemented here: refused.
    fn rope_freq_scale(&self, p: &str) -> Result<f32, ModelError> {
        let type_key = format!("{p}.rope.scaling.type");
        let factor = match self.get_f32(&format!("{p}.rope.scaling.factor"))? {
            Some(f) => Some(f),
            None => self.get_f32(&format!("{p}.rope.scale_linear"))?,
        };
        match self.get_str(&type_key)?.unwrap_or("linear") {
            "none" => Ok(1.0),
            "linear" => match factor {
                // llama.cpp: `ropescale == 0.0f ? 1.0f : 1.0f/ropescale`.
                None | Some(0.0) => Ok(1.0),
                Some(f) if f.is_finite() && f > 0.0 => Ok(1.0 / f),
                Some(f) => Err(self.meta_err(
                    &format!("{p}.rope.scaling.factor"),
                    format!("{f} is not a positive scale factor"),
                )),
            },
            other => Err(self.meta_err(
                &type_key,
                format!("RoPE scaling {other:?} is not supported (supported: none, linear)"),
            )),
        }
    }

    /// Hyper-parameters whose presence changes the model in ways this host
    /// does not implement; each is refused by name.
    fn check_unsupported(&self, p: &str) -> Result<(), ModelError> {
        // Mixtral-style mixture of experts (llama.cpp reads it for `llama`).
        let experts = format!("{p}.expert_count");
        if let Some(n) = self.get_usize(&experts)?
            && n > 0
        {
            return Err(self.meta_err(
                &experts,
                format!("{n} experts: mixture-of-experts models are not supported"),
            ));
        }
        // A custom attention scale instead of 1/sqrt(head size) (granite).
        let scale = format!("{p}.attention.scale");
        if let Some(s) = self.get_f32(&scale)?
            && s != 0.0
        {
            return Err(self.meta_err(
                &scale,
                format!("attention scale {s} is not supported (only 1/sqrt(head size))"),
            ));
        }
        // llama.cpp multiplies every RoPE cos/sin by it (`rope_yarn`'s mscale).
        let attn_factor = format!("{p}.rope.scaling.attn_factor");
        if let Some(f) = self.get_f32(&attn_factor)?
            && f != 1.0
        {
            return Err(self.meta_err(
                &attn_factor,
                format!("RoPE attention factor {f} is not supported (only 1)"),
            ));
        }
        // `<arch>.attention.sliding_window` (some Mistral 7B v0.1
        // conversions) is deliberately not refused: llama.cpp's `llama`
        // architecture does not read it either and attends over the whole
        // context (`src/models/llama.cpp`), and parity with it is the goal.
        Ok(())
    }
}
