//! The device seam: a [`Backend`] runs the forward pass for one sequence's
//! [`SequenceState`] (its KV cache and scratch). The CPU implementation is
//! [`crate::forward::CpuBackend`]; a CUDA backend implements the same two
//! traits with device-resident weights and cache.

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
    /// A fresh sequence with room for `capacity` tokens.
    fn new_state(&self, capacity: usize) -> Box<dyn SequenceState>;
    /// Runs `tokens` at positions `state.position()..`, appends them to the
    /// cache and writes the last token's logits into `logits` (`n_vocab`).
    fn forward(
        &self,
        state: &mut dyn SequenceState,
        tokens: &[u32],
        logits: &mut [f32],
    ) -> Result<(), ModelError>;
}
