//! The model host's settings (config `[generate]`): one struct, each
//! default in its `Default`.

#![forbid(unsafe_code)]

use serde::{Deserialize, Serialize};

/// Generate settings (config `[generate]`), defaults in one place.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct GenerateConfig {
    /// Forward-pass threads (0: all CPUs).
    pub n_threads: usize,
    /// KV-cache size of each sequence (clamped to the model's context).
    pub n_ctx: usize,
    /// `max_tokens` when a request leaves it unset.
    pub default_max_tokens: u32,
    /// Largest `max_tokens` a request may ask for.
    pub max_tokens_cap: u32,
    /// Most stop strings per request.
    pub max_stop_strings: usize,
    /// Longest stop string, in bytes.
    pub max_stop_bytes: usize,
    /// Most `stop_token_ids` per request.
    pub max_stop_token_ids: usize,
    /// Most `bad_words` per request (vLLM's bound: 128).
    pub max_bad_words: usize,
    /// Longest bad word, in bytes (it bounds the tokens masked per step).
    pub max_bad_word_bytes: usize,
    /// A thinking model's reasoning markers, `[open, close]` (text, special
    /// tokens parsed), for `reasoning_budget` when the vocabulary has no
    /// `<think>` / `</think>` tokens. Empty: those tokens only.
    pub reasoning_markers: Vec<String>,
    /// Longest `reasoning_budget_message`, in bytes.
    pub max_reasoning_message_bytes: usize,
    /// `generate.max_prompt_logprobs`: the most top tokens a request's
    /// `prompt_logprobs` may ask for per prompt position (vLLM's
    /// `max_logprobs` default).
    pub max_prompt_logprobs: u32,
    /// Generations running at once; more wait in the queue.
    pub max_concurrent_generations: usize,
    /// Generations waiting for a slot; more are refused (RESOURCE_EXHAUSTED).
    pub max_queued_generations: usize,
    /// Most prompt tokens (after the chat template) a request may send.
    pub max_prompt_tokens: usize,
    /// Longest prompt in bytes (`prompt`, or the messages' roles and
    /// contents together), checked before anything else: it bounds the
    /// tokenizer's time and memory (~0.5 s and ~40 MB per MB of text on
    /// one core).
    pub max_prompt_bytes: usize,
    /// Largest Generate request message in bytes (prompt, messages, stop
    /// strings and parameters together), refused from its length prefix
    /// before it is read: an oversized request costs neither memory nor
    /// decoding time.
    pub max_request_bytes: usize,
    /// Tokenize special-token text inside chat message content as special
    /// tokens (`<|im_end|>` in a user's message then ends the turn). Off by
    /// default: content is text, and only the chat template's own markup
    /// is special, so relayed user text cannot open a turn of its own.
    pub parse_special_in_content: bool,
    /// How long a decode step waits, in microseconds, for the generations
    /// served in the previous step to come back (they are sampling) so it
    /// can batch them; one held up longer (e.g. by a slow client) is stepped
    /// on its own later.
    pub batch_wait_us: u64,
    /// Finished generations' sessions kept for later prompts that share a
    /// prefix with them (0: no prompt cache). Each holds its K/V (~23 KiB
    /// a token for SmolLM2-135M), charged to `limits.memory_budget_bytes`.
    pub prompt_cache_entries: usize,
    /// Speculation: decode without drafts while rounds with drafts measure
    /// slower per token than plain steps, probing now and then
    /// (`draft_pacing`), and skip a draft model for a while after a
    /// generation where it lost (`draft_record`). false: always draft what
    /// the draft length rule says (to measure a drafter).
    pub pause_slow_drafting: bool,
}

impl Default for GenerateConfig {
    fn default() -> Self {
        GenerateConfig {
            n_threads: 0,
            n_ctx: 4096,
            default_max_tokens: 512,
            max_tokens_cap: 4096,
            max_stop_strings: 16,
            max_stop_bytes: 256,
            max_stop_token_ids: 64,
            max_bad_words: 128,
            max_bad_word_bytes: 256,
            reasoning_markers: Vec::new(),
            max_reasoning_message_bytes: 1024,
            max_prompt_logprobs: 20,
            max_concurrent_generations: 4,
            max_queued_generations: 64,
            max_prompt_tokens: 4096,
            max_prompt_bytes: 256 * 1024,
            max_request_bytes: 4 * 1024 * 1024,
            parse_special_in_content: false,
            batch_wait_us: 2000,
            prompt_cache_entries: 4,
            pause_slow_drafting: true,
        }
    }
}
