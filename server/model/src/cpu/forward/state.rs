//! One sequence on the CPU ([`CpuState`]): its f16 KV cache and its step scratch.

use std::any::Any;

use super::scratch::Scratch;
use crate::backend::SequenceState;

/// A sequence's KV cache and scratch on the CPU.
pub struct CpuState {
    pub(super) cache: KvCache,
    pub(super) s: Scratch,
}

/// One sequence's f16 K/V cache.
pub(super) struct KvCache {
    pub(super) capacity: usize,
    pub(super) pos: usize,
    /// `[layer][kv_head][position][head_dim]`.
    /// Stored as raw f16 bits so a new cache is a zeroed (lazily paged)
    /// allocation rather than a 100 MB write per session.
    pub(super) k: Vec<u16>,
    pub(super) v: Vec<u16>,
}

impl KvCache {
    /// Takes `from`'s positions (`from.pos` of each `[layer][kv_head]`
    /// block of `head_dim`-wide rows); the rest stays as it was.
    pub(super) fn copy_prefix(&mut self, from: &KvCache, head_dim: usize) {
        let n = from.pos.min(self.capacity) * head_dim;
        let blocks = from.k.len() / (from.capacity * head_dim).max(1);
        for b in 0..blocks {
            let (src, dst) = (b * from.capacity * head_dim, b * self.capacity * head_dim);
            self.k[dst..dst + n].copy_from_slice(&from.k[src..src + n]);
            self.v[dst..dst + n].copy_from_slice(&from.v[src..src + n]);
        }
        self.pos = from.pos.min(self.capacity);
    }
}

impl SequenceState for CpuState {
    fn position(&self) -> usize {
        self.cache.pos
    }
    fn capacity(&self) -> usize {
        self.cache.capacity
    }
    fn truncate(&mut self, position: usize) {
        self.cache.pos = self.cache.pos.min(position);
    }
    fn release_scratch(&mut self) {
        self.s = Scratch::default();
    }
    fn as_any_mut(&mut self) -> &mut dyn Any {
        self
    }
}
