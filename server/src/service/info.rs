//! `GetServerInfo`: the version and build, the model, the vocabularies and
//! the limits a client must respect, read from the running configuration.

#![forbid(unsafe_code)]

use samplerd_api::v1;

use super::state::AppState;
use crate::transport::request_id::REQUEST_ID_HEADER;

/// The CPU features this binary was compiled for, of those the sampling
/// and model kernels branch on.
fn target_features() -> Vec<String> {
    let mut out = Vec::new();
    macro_rules! feature {
        ($($name:tt),*) => {
            $(if cfg!(target_feature = $name) {
                out.push($name.to_string());
            })*
        };
    }
    feature!(
        "sse4.2", "avx", "avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512vl", "neon"
    );
    out
}

/// Builds the GetServerInfo response.
pub fn get(state: &AppState) -> v1::GetServerInfoResponse {
    let model = state
        .generator
        .as_ref()
        .filter(|g| g.ready())
        .and_then(|g| g.describe());
    let l = &state.limits;
    let g = &state.generate;
    let u32_of = |n: usize| u32::try_from(n).unwrap_or(u32::MAX);
    v1::GetServerInfoResponse {
        version: env!("CARGO_PKG_VERSION").to_string(),
        build: Some(v1::BuildInfo {
            git_describe: option_env!("SAMPLERD_GIT_DESCRIBE")
                .unwrap_or_default()
                .to_string(),
            profile: if cfg!(debug_assertions) {
                "debug"
            } else {
                "release"
            }
            .to_string(),
            target_features: target_features(),
        }),
        numerics: model
            .as_ref()
            .map(|m| m.numerics.clone())
            .unwrap_or_default(),
        device: model
            .as_ref()
            .map(|m| m.device.clone())
            .unwrap_or_else(|| "cpu".to_string()),
        model: model.map(|m| v1::ModelInfo {
            file_name: m.file_name,
            architecture: m.architecture,
            weight_types: m.weight_types.into_iter().collect(),
            n_vocab: u32_of(m.n_vocab),
            n_ctx: u32_of(m.n_ctx),
        }),
        vocabularies: state.vocabularies.to_proto(),
        limits: Some(v1::ServerLimits {
            max_message_bytes: l.max_message_bytes as u64,
            max_vocab: u32_of(l.max_vocab),
            max_n_probs: l.max_n_probs,
            max_batch_rows: u32_of(l.max_batch_rows),
            max_draft_tokens: u32_of(l.max_draft_tokens),
            max_window_tokens: u32_of(l.max_window_tokens),
            max_chain_stages: u32_of(l.max_chain_stages),
            max_concurrent_streams: u32_of(l.max_concurrent_streams),
            max_constraint_bytes: l.max_constraint_bytes as u64,
            max_request_duration_secs: l.max_request_duration_secs,
            max_tokens: g.max_tokens_cap,
            default_max_tokens: g.default_max_tokens,
            max_prompt_bytes: g.max_prompt_bytes as u64,
            max_prompt_tokens: u32_of(g.max_prompt_tokens),
            max_generate_request_bytes: g.max_request_bytes as u64,
            max_stop_strings: u32_of(g.max_stop_strings),
            max_stop_bytes: u32_of(g.max_stop_bytes),
            max_choices: u32_of(l.max_choices),
            max_stop_token_ids: u32_of(g.max_stop_token_ids),
            max_bad_words: u32_of(g.max_bad_words),
            max_bad_word_bytes: u32_of(g.max_bad_word_bytes),
            max_reasoning_message_bytes: u32_of(g.max_reasoning_message_bytes),
            max_constraint_triggers: u32_of(l.max_constraint_triggers),
            max_constraint_trigger_bytes: u32_of(l.max_constraint_trigger_bytes),
            max_prompt_logprobs: g.max_prompt_logprobs,
        }),
        request_id_header: REQUEST_ID_HEADER.to_string(),
    }
}
