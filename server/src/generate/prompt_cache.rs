//! The prompt cache: finished generations' sessions (their KV caches),
//! kept so that a request whose prompt shares a prefix with one — a system
//! prompt, a chat's earlier turns — prefills only the rest. llama-server's
//! `cache_prompt`, with one difference: a session gives only the positions
//! a fresh prefill of the new prompt would compute in the same arithmetic
//! order ([`samplerd_model::prefix`]), so a cached answer equals an
//! uncached one bit for bit.
//!
//! Bounds: at most `generate.prompt_cache_entries` sessions (least recently
//! used leave first), each charged to the memory budget for the K/V it
//! holds (`limits.memory_budget_bytes`); a session the budget cannot take is
//! not kept. A request takes its session out of the cache (a session serves
//! one generation at a time) and, when it finishes — or its client leaves,
//! so that a resumed generation finds the positions it computed —, puts it
//! back.

#![forbid(unsafe_code)]

use std::sync::Arc;

use samplerd_model::{Model, Session};

use super::kept_sessions::KeptSessions;
use crate::request::memory::MemoryBudget;

/// Lookups, label `result` = `hit` (some prefix reused) or `miss`.
pub const LOOKUPS_METRIC: &str = "samplerd_prompt_cache_lookups_total";
/// Prompt tokens taken from the cache instead of prefilled.
pub const REUSED_TOKENS_METRIC: &str = "samplerd_prompt_cache_reused_tokens_total";
/// Sessions in the cache.
pub const ENTRIES_METRIC: &str = "samplerd_prompt_cache_entries";
/// Bytes the cached sessions are charged.
pub const BYTES_METRIC: &str = "samplerd_prompt_cache_bytes";

/// Metric descriptions, registered with the exporter.
pub fn describe() {
    use metrics::{Unit, describe_counter, describe_gauge};
    describe_counter!(
        LOOKUPS_METRIC,
        "Generate prompts looked up in the prompt cache, by result (hit: a prefix was reused)"
    );
    describe_counter!(
        REUSED_TOKENS_METRIC,
        "prompt tokens taken from the prompt cache instead of prefilled"
    );
    describe_gauge!(ENTRIES_METRIC, "sessions kept in the prompt cache");
    describe_gauge!(
        BYTES_METRIC,
        Unit::Bytes,
        "memory the prompt cache's sessions are charged"
    );
}

/// The cache (shared by every generation of one model).
pub struct PromptCache {
    kept: KeptSessions,
}

impl PromptCache {
    /// A cache of at most `capacity` sessions of `model` (0: off).
    pub fn new(model: &Model, capacity: usize) -> Self {
        metrics::gauge!(ENTRIES_METRIC).set(0.0);
        metrics::gauge!(BYTES_METRIC).set(0.0);
        PromptCache {
            kept: KeptSessions::new(model, capacity, "the prompt cache"),
        }
    }

    /// Takes the cached session that can stand for the longest prefix of
    /// `prompt` followed by the `decoded` tokens of a resumed generation
    /// (each a decode step of its own; [`Session::reusable_replay`]), cut
    /// to that prefix, and the prefix's length; none when no session
    /// shares any.
    pub fn take(&self, prompt: &[u32], decoded: &[u32]) -> Option<(Session, usize)> {
        let found =
            self.kept
                .take(|s| s.reusable_replay(prompt, decoded))
                .map(|(mut session, reused)| {
                    session.reuse_replay(prompt, decoded);
                    (session, reused)
                });
        self.gauges();
        let result = if found.is_some() { "hit" } else { "miss" };
        metrics::counter!(LOOKUPS_METRIC, "result" => result).increment(1);
        if let Some((_, reused)) = &found {
            metrics::counter!(REUSED_TOKENS_METRIC).increment(*reused as u64);
        }
        found
    }

    /// Keeps a finished generation's session for later prompts (see
    /// [`KeptSessions::put`]: bounded in number and by `memory`).
    pub fn put(&self, session: Session, memory: &Arc<MemoryBudget>) {
        self.kept.put(session, memory);
        self.gauges();
    }

    fn gauges(&self) {
        let (entries, bytes) = self.kept.size();
        metrics::gauge!(ENTRIES_METRIC).set(entries as f64);
        metrics::gauge!(BYTES_METRIC).set(bytes as f64);
    }
}
