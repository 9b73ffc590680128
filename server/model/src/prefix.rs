//! What a session's KV cache holds, position by position, and which prefix a prompt can reuse.
//!
//! What a session's KV cache holds, position by position: the token and the
//! arithmetic order its forward step used — so a later prompt can reuse the
//! cached prefix it shares **and get the same bits** as a fresh prefill.
//!
//! Why the order matters: a forward step's arithmetic depends on how many
//! tokens it runs, in llama.cpp as here. One token is a decode step
//! (attention summed in decode order: four vectors a lane, see
//! `ggml::attention`); two or more are a prefill (tinyBLAS's order); from
//! [`TILED_MIN_ROWS`] on, K-quant products also follow ggml's tiled matmul
//! (`quant::kernels::scalar`). A position's K/V therefore carries the order of the step
//! that computed it, and a fresh prefill of an `n`-token prompt computes
//! every position in [`StepOrder::of`]`(n)`. Reuse keeps to positions of
//! that order and leaves a remainder that runs in it too; generated tokens
//! (decode order) are never reused for a prompt, they are recomputed.
//! llama-server's `cache_prompt` reuses whatever matches and its answers
//! then drift from an uncached run's; here cached and uncached are equal
//! bit for bit (`server/model/tests/real_model.rs`).

#![forbid(unsafe_code)]

use crate::quant::TILED_MIN_ROWS;

/// The arithmetic order of the forward step that computed a position.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum StepOrder {
    /// A step of one token.
    Decode,
    /// A step of 2 to `TILED_MIN_ROWS - 1` tokens.
    Prefill,
    /// A step of `TILED_MIN_ROWS` or more tokens.
    PrefillTiled,
}

impl StepOrder {
    /// The order of a step of `n` tokens.
    pub fn of(n: usize) -> StepOrder {
        match n {
            0 | 1 => StepOrder::Decode,
            n if n < TILED_MIN_ROWS => StepOrder::Prefill,
            _ => StepOrder::PrefillTiled,
        }
    }
}

/// The tokens in a session's cache, each with its [`StepOrder`].
#[derive(Clone, Debug, Default)]
pub struct CachedTokens {
    tokens: Vec<u32>,
    orders: Vec<StepOrder>,
}

impl CachedTokens {
    /// One forward step of `tokens` ran.
    pub fn ran(&mut self, tokens: &[u32]) {
        let order = StepOrder::of(tokens.len());
        self.tokens.extend_from_slice(tokens);
        self.orders.resize(self.tokens.len(), order);
    }

    /// Keeps the first `position` tokens.
    pub fn truncate(&mut self, position: usize) {
        self.tokens.truncate(position);
        self.orders.truncate(position);
    }

    pub fn tokens(&self) -> &[u32] {
        &self.tokens
    }

    /// How many leading positions a prefill of `prompt` may take from this
    /// cache and still give a fresh prefill's bits: the shared prefix, cut
    /// where a position's order differs from the fresh prefill's, and short
    /// enough that the rest of the prompt runs in that same order (at least
    /// two tokens; `TILED_MIN_ROWS` when the fresh prefill is tiled). 0
    /// when nothing can be reused.
    pub fn reusable(&self, prompt: &[u32]) -> usize {
        let fresh = StepOrder::of(prompt.len());
        let min_rest = match fresh {
            StepOrder::Decode => return 0,
            StepOrder::Prefill => 2,
            StepOrder::PrefillTiled => TILED_MIN_ROWS,
        };
        let shared = self
            .tokens
            .iter()
            .zip(&self.orders)
            .zip(prompt)
            .take_while(|((t, o), p)| t == p && **o == fresh)
            .count();
        shared.min(prompt.len().saturating_sub(min_rest))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cached(steps: &[&[u32]]) -> CachedTokens {
        let mut c = CachedTokens::default();
        for s in steps {
            c.ran(s);
        }
        c
    }

    #[test]
    fn a_tiled_prompt_reuses_its_shared_prefix_and_leaves_a_tiled_rest() {
        let c = cached(&[&(0..20).collect::<Vec<_>>()]);
        let prompt: Vec<u32> = (0..40).collect();
        assert_eq!(c.reusable(&prompt), 20);
        // A rest shorter than a tiled step would run in another order.
        let prompt: Vec<u32> = (0..24).collect();
        assert_eq!(c.reusable(&prompt), 24 - TILED_MIN_ROWS);
        // A prompt that differs at 5.
        let mut prompt: Vec<u32> = (0..40).collect();
        prompt[5] = 999;
        assert_eq!(c.reusable(&prompt), 5);
    }

    #[test]
    fn decoded_positions_and_other_orders_are_not_reused() {
        // 20 prompt tokens, then 3 generated one at a time.
        let c = cached(&[&(0..20).collect::<Vec<_>>(), &[20], &[21], &[22]]);
        let prompt: Vec<u32> = (0..60).collect();
        assert_eq!(c.reusable(&prompt), 20);
        // A 4-token prefill's positions are not a tiled prompt's.
        let c = cached(&[&[0, 1, 2, 3]]);
        assert_eq!(c.reusable(&(0..30).collect::<Vec<_>>()), 0);
        // ...but serve a short prompt, leaving at least two tokens to run.
        assert_eq!(c.reusable(&[0, 1, 2, 3, 4, 5]), 4);
        assert_eq!(c.reusable(&[0, 1, 2, 3, 4]), 3);
        // One token is a decode step: nothing to share.
        assert_eq!(c.reusable(&[0]), 0);
    }

    #[test]
    fn truncate_forgets_positions() {
        let mut c = cached(&[&(0..20).collect::<Vec<_>>()]);
        c.truncate(10);
        assert_eq!(c.tokens().len(), 10);
        assert_eq!(c.reusable(&(0..40).collect::<Vec<_>>()), 10);
    }
}
