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

    /// How many leading positions a replay of `prompt` then `decoded` may
    /// take from this cache: the prompt as one prefill, then each decoded
    /// token as a step of its own — how a generation computed them, so
    /// that a resumed generation gets the bits the interrupted one had.
    /// Decoded positions count only after the whole prompt (in its fresh
    /// prefill's order), and only in decode order; at least the last
    /// position is left to run, for its logits. Without `decoded`,
    /// [`reusable`](Self::reusable).
    pub fn reusable_replay(&self, prompt: &[u32], decoded: &[u32]) -> usize {
        let fresh = StepOrder::of(prompt.len());
        let whole_prompt = self.tokens.len() >= prompt.len()
            && self.tokens[..prompt.len()] == *prompt
            && self.orders[..prompt.len()].iter().all(|&o| o == fresh);
        if decoded.is_empty() || !whole_prompt {
            return self.reusable(prompt);
        }
        let steps = self.tokens[prompt.len()..]
            .iter()
            .zip(&self.orders[prompt.len()..])
            .zip(decoded)
            .take_while(|((t, o), d)| t == d && **o == StepOrder::Decode)
            .count();
        prompt.len() + steps.min(decoded.len() - 1)
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
    fn a_replay_reuses_decoded_positions_only_after_the_whole_prompt() {
        // 20 prompt tokens, then 3 generated one at a time.
        let c = cached(&[&(0..20).collect::<Vec<_>>(), &[20], &[21], &[22]]);
        let prompt: Vec<u32> = (0..20).collect();
        // All three decoded positions, leaving the fourth token to run.
        assert_eq!(c.reusable_replay(&prompt, &[20, 21, 22, 23]), 23);
        // The last replayed token always runs (its logits are needed).
        assert_eq!(c.reusable_replay(&prompt, &[20, 21, 22]), 22);
        // A different token stops the reuse there.
        assert_eq!(c.reusable_replay(&prompt, &[20, 99, 22, 23]), 21);
        // Nothing to replay: a prompt's reuse.
        assert_eq!(c.reusable_replay(&prompt, &[]), c.reusable(&prompt));
        // A longer prompt is not wholly cached: only its prompt reuse.
        let longer: Vec<u32> = (0..40).collect();
        assert_eq!(c.reusable_replay(&longer, &[40]), c.reusable(&longer));
        // Tokens that were part of a prefill are not decode steps; the
        // prompt's positions, in its fresh order, are all reused (no
        // prefill remains to run: the first decode step follows).
        let c = cached(&[&(0..24).collect::<Vec<_>>()]);
        assert_eq!(c.reusable_replay(&prompt, &[20, 21, 22]), 20);
        // A prompt computed in another order (here 4 tokens, not 20) is
        // not this prompt's prefill.
        let c = cached(&[&[0, 1, 2, 3], &[4], &[5]]);
        assert_eq!(c.reusable_replay(&[0, 1, 2, 3, 4], &[5, 6]), 3);
        assert_eq!(c.reusable_replay(&[0, 1, 2, 3], &[4, 5, 6]), 6);
    }

    #[test]
    fn truncate_forgets_positions() {
        let mut c = cached(&[&(0..20).collect::<Vec<_>>()]);
        c.truncate(10);
        assert_eq!(c.tokens().len(), 10);
        assert_eq!(c.reusable(&(0..40).collect::<Vec<_>>()), 10);
    }
}
