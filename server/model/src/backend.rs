//! The device seam: a [`Backend`] runs the forward pass for one sequence's
//! [`SequenceState`] (its KV cache and scratch), or one decode step for
//! several sequences at once ([`Backend::forward_batch`], so the weights are
//! read once per step rather than once per sequence). The CPU implementation
//! is [`crate::forward::CpuBackend`]; a CUDA backend implements the same two
//! traits with device-resident weights and cache.

#![forbid(unsafe_code)]

use crate::error::ModelError;
use std::any::Any;

/// Per-sequence state owned by a session: KV cache (allocated once, for the
/// session's whole context) plus the backend's scratch buffers.
pub trait SequenceState: Send + Any {
    /// Tokens already in the cache (the position of the next token).
    fn position(&self) -> usize;
    /// Most tokens the cache holds.
    fn capacity(&self) -> usize;
    /// Forgets every position at or after `position` (for prompt-cache reuse).
    fn truncate(&mut self, position: usize);
    fn as_any_mut(&mut self) -> &mut dyn Any;
}

/// A forward-pass implementation over shared, read-only weights.
pub trait Backend: Send + Sync + std::fmt::Debug {
    /// "cpu-avx2", "cpu-scalar", "cuda"…
    fn name(&self) -> String;
    /// A fresh sequence with room for `capacity` tokens. Fails when its
    /// cache cannot be allocated (the CUDA backend: device memory exhausted),
    /// so the caller learns it before the first forward pass.
    fn new_state(&self, capacity: usize) -> Result<Box<dyn SequenceState>, ModelError>;
    /// Runs `tokens` at positions `state.position()..`, appends them to the
    /// cache and writes the last token's logits into `logits` (`n_vocab`).
    fn forward(
        &self,
        state: &mut dyn SequenceState,
        tokens: &[u32],
        logits: &mut [f32],
    ) -> Result<(), ModelError>;

    /// One decode step for several sequences: runs `tokens[i]` on
    /// `states[i]` and writes its logits into `logits[i]`. Results must equal
    /// `forward` on each sequence alone (bit for bit). The default loops over
    /// [`Backend::forward`] (an error may leave the sequences before the
    /// failing one advanced); backends override it to share the weight reads
    /// between the sequences (the CPU backend checks every sequence first and
    /// runs nothing on error).
    fn forward_batch(
        &self,
        states: &mut [&mut dyn SequenceState],
        tokens: &[u32],
        logits: &mut [&mut [f32]],
    ) -> Result<(), ModelError> {
        check_batch_shape(states.len(), tokens.len(), logits.len())?;
        for ((st, &tok), l) in states.iter_mut().zip(tokens).zip(logits.iter_mut()) {
            self.forward(&mut **st, std::slice::from_ref(&tok), l)?;
        }
        Ok(())
    }
}

/// A batch needs one token and one logits buffer per sequence.
pub fn check_batch_shape(states: usize, tokens: usize, logits: usize) -> Result<(), ModelError> {
    if states == 0 {
        return Err(ModelError::EmptyInput);
    }
    if tokens != states || logits != states {
        return Err(ModelError::Backend(format!(
            "a batch of {states} sequences got {tokens} tokens and {logits} logits buffers"
        )));
    }
    Ok(())
}
