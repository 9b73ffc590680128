//! `GenerateRequest.prompt_logprobs` (vLLM's `prompt_logprobs`): each
//! prompt token after the first under the raw logits of the position
//! before it — its log-probability, its rank and the row's top N.
//!
//! Computed in one extra pass over the prompt, on a session of its own,
//! with [`Model::decode_rows`]: every row is bit for bit the logits of a
//! one-token decode step at that position (what `Token.logprob` is taken
//! from), which a batched prefill's last row is not guaranteed to be. The
//! generation's own prefill (and the prompt cache, which may skip most of
//! it) is untouched, so the output is the same with and without
//! `prompt_logprobs`, and a cached prefix costs nothing extra here: the
//! pass always runs the whole prompt, bypassing the cache. Cost: about a
//! second prefill of the prompt (in passes of [`ROWS_PER_PASS`] rows, each
//! as costly per token as a speculative verify pass) and a KV cache of
//! the prompt's length while it runs. Memory: one pass's rows at a time
//! (32 × 49,152 f32 = 6 MiB for SmolLM2), each reduced to its token, rank
//! and top N before the next pass. The pass's session lives and is dropped
//! before the generation prefills its own (`ModelHost::run`), so its KV
//! cache, at most the prompt's length, stays inside what the request is
//! charged against `limits.memory_budget_bytes` for its generation (a
//! whole context per choice).

use samplerd_api::v1;
use samplerd_model::{Model, ModelError};
use samplerd_sampling::logits::{log_sum_exp, top_n};

/// Prompt positions scored per forward pass: bounds the logits held at
/// once (rows × vocabulary f32).
pub const ROWS_PER_PASS: usize = 32;

/// The log-probabilities of `prompt[1..]`, each with the top `n` of its row.
pub fn compute(model: &Model, prompt: &[u32], n: u32) -> Result<v1::PromptLogprobs, ModelError> {
    let mut tokens = Vec::with_capacity(prompt.len().saturating_sub(1));
    if prompt.len() >= 2 {
        let inputs = &prompt[..prompt.len() - 1];
        let mut session = model.new_session_with_capacity(inputs.len())?;
        for (pass, chunk) in inputs.chunks(ROWS_PER_PASS).enumerate() {
            model.decode_rows(&mut [&mut session], &[chunk])?;
            for (j, row) in session.logits_rows().take(chunk.len()).enumerate() {
                let next = prompt[pass * ROWS_PER_PASS + j + 1];
                tokens.push(entry(row, next, n as usize));
            }
        }
    }
    Ok(v1::PromptLogprobs { tokens })
}

/// `token` under the raw logits `row`: log-probability `row[token] − lse`,
/// rank 1 + the number of tokens with a higher log-probability (vLLM's
/// `batched_count_greater_than` + 1), and the top `n`.
pub fn entry(row: &[f32], token: u32, n: usize) -> v1::PromptTokenLogprob {
    let lse = log_sum_exp(row);
    let logprob = row[token as usize] - lse;
    let rank = 1 + row.iter().filter(|&&l| l - lse > logprob).count() as u32;
    let top = top_n(row, n)
        .into_iter()
        .map(|(token_id, l)| v1::TokenProbability {
            token_id,
            probability: (l - lse).exp(),
            logprob: l - lse,
        })
        .collect();
    v1::PromptTokenLogprob {
        token_id: token,
        logprob,
        rank,
        top,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rank_counts_the_strictly_better_and_top_is_descending() {
        let row = [1.0f32, 3.0, 2.0, 3.0];
        let e = entry(&row, 2, 3);
        assert_eq!(e.rank, 3);
        let ids: Vec<u32> = e.top.iter().map(|t| t.token_id).collect();
        assert_eq!(ids, vec![1, 3, 2]);
        assert_eq!(entry(&row, 3, 0).rank, 1);
        assert!(entry(&row, 3, 0).top.is_empty());
        let sum: f32 = row.iter().map(|l| (l - log_sum_exp(&row)).exp()).sum();
        assert!((sum - 1.0).abs() < 1e-6);
    }
}
