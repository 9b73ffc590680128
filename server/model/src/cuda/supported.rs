//! Which models the CUDA kernels can run, and why they refuse the others (without the feature too).

use crate::gguf::Config;

/// Why the CUDA backend cannot run a model of `config` yet, or `None`. Its
/// kernels take the query and attention-output width to be `n_embd` and
/// have no per-head q/k RMSNorm, so such models (qwen3; a
/// `attention.key_length` unlike `n_embd / n_head`) are refused with this
/// reason rather than computed wrongly; the CPU backend runs them. (Llama
/// 3.1+ frequency factors and linear RoPE scaling need nothing more: they
/// are in the host-computed RoPE table.) Independent of the `cuda`
/// feature so it is tested without a GPU.
pub fn unsupported(config: &Config) -> Option<String> {
    if config.qk_norm {
        return Some(format!(
            "cuda: the {} architecture's per-head q/k RMSNorm (attn_q_norm, attn_k_norm) \
             is not supported by the CUDA backend yet; use model.device = \"cpu\"",
            config.arch.name()
        ));
    }
    if config.q_dim() != config.n_embd {
        return Some(format!(
            "cuda: {} heads x head size {} (attention.key_length) = {} differs from the \
             embedding length {}; not supported by the CUDA backend yet; use model.device = \"cpu\"",
            config.n_head,
            config.head_dim,
            config.q_dim(),
            config.n_embd
        ));
    }
    None
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::gguf::Arch;

    #[test]
    fn models_the_kernels_cannot_run_are_refused_by_reason() {
        let llama = Config {
            arch: Arch::Llama,
            n_ctx_train: 64,
            n_embd: 64,
            n_layer: 1,
            n_head: 4,
            n_head_kv: 2,
            head_dim: 16,
            n_ff: 64,
            rope_freq_base: 10000.0,
            rope_dim: 16,
            rope_freq_scale: 0.25,
            rope_neox: false,
            rms_eps: 1e-5,
            qk_norm: false,
            n_vocab: 8,
        };
        assert_eq!(unsupported(&llama), None);
        let wide = Config {
            head_dim: 32,
            rope_dim: 32,
            ..llama.clone()
        };
        let why = unsupported(&wide).unwrap();
        assert!(
            why.contains("128 differs from the embedding length 64"),
            "{why}"
        );
        let qwen3 = Config {
            arch: Arch::Qwen3,
            qk_norm: true,
            rope_neox: true,
            ..llama
        };
        let why = unsupported(&qwen3).unwrap();
        assert!(
            why.contains("qwen3") && why.contains("attn_q_norm"),
            "{why}"
        );
    }
}
