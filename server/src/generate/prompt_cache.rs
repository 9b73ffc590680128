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

use std::sync::{Arc, Mutex, MutexGuard, PoisonError};

use samplerd_model::{Model, Session};

use crate::request::memory::{Charge, MemoryBudget};

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

struct Entry {
    session: Session,
    charge: Charge,
    /// When it was last put back (a counter: larger is more recent).
    used: u64,
}

/// What a kept session of one model is charged to the memory budget.
#[derive(Clone, Copy, Debug)]
pub(super) struct SessionBytes {
    /// K/V bytes one cached position holds.
    per_token: usize,
    /// Fixed bytes of a session (its page-rounded K/V regions).
    per_session: usize,
}

impl SessionBytes {
    pub(super) fn of(model: &Model) -> Self {
        let c = model.config();
        let regions = c.n_layer * 2 * c.n_head_kv;
        SessionBytes {
            // f16 K and V of every layer's KV heads.
            per_token: regions * c.head_dim * 2,
            per_session: regions * 4096,
        }
    }

    /// A session holding `session.cached_tokens()`.
    pub(super) fn of_session(self, session: &Session) -> usize {
        self.per_session + session.cached_tokens().len() * self.per_token
    }
}

/// The cache (shared by every generation of one model).
pub struct PromptCache {
    entries: Mutex<Vec<Entry>>,
    capacity: usize,
    bytes: SessionBytes,
    clock: std::sync::atomic::AtomicU64,
}

impl PromptCache {
    /// A cache of at most `capacity` sessions of `model` (0: off).
    pub fn new(model: &Model, capacity: usize) -> Self {
        metrics::gauge!(ENTRIES_METRIC).set(0.0);
        metrics::gauge!(BYTES_METRIC).set(0.0);
        PromptCache {
            entries: Mutex::new(Vec::new()),
            capacity,
            bytes: SessionBytes::of(model),
            clock: Default::default(),
        }
    }

    fn entries(&self) -> MutexGuard<'_, Vec<Entry>> {
        self.entries.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Takes the cached session that can stand for the longest prefix of
    /// `prompt` followed by the `decoded` tokens of a resumed generation
    /// (each a decode step of its own; [`Session::reusable_replay`]), cut
    /// to that prefix, and the prefix's length; none when no session
    /// shares any.
    pub fn take(&self, prompt: &[u32], decoded: &[u32]) -> Option<(Session, usize)> {
        let mut entries = self.entries();
        let best = entries
            .iter()
            .enumerate()
            .map(|(i, e)| (e.session.reusable_replay(prompt, decoded), i))
            .max();
        let found = match best {
            Some((reused, i)) if reused > 0 => {
                let Entry { mut session, .. } = entries.swap_remove(i);
                session.reuse_replay(prompt, decoded);
                Some((session, reused))
            }
            _ => None,
        };
        self.gauges(&entries);
        drop(entries);
        let result = if found.is_some() { "hit" } else { "miss" };
        metrics::counter!(LOOKUPS_METRIC, "result" => result).increment(1);
        if let Some((_, reused)) = &found {
            metrics::counter!(REUSED_TOKENS_METRIC).increment(*reused as u64);
        }
        found
    }

    /// Keeps a finished generation's session for later prompts: it
    /// replaces the sessions whose tokens it extends, then the least
    /// recently used ones while the cache is full or the memory budget
    /// cannot take it (`memory`); when even an empty cache cannot, it is
    /// dropped.
    pub fn put(&self, mut session: Session, memory: &Arc<MemoryBudget>) {
        if self.capacity == 0 || session.cached_tokens().is_empty() {
            return;
        }
        // Only the K/V is kept: scratch is sized by the step that ran.
        session.release_scratch();
        let bytes = self.bytes.of_session(&session);
        let mut entries = self.entries();
        entries.retain(|e| {
            !session
                .cached_tokens()
                .starts_with(e.session.cached_tokens())
        });
        let charge = loop {
            if entries.len() < self.capacity
                && let Ok(charge) = memory.charge(bytes, "the prompt cache")
            {
                break Some(charge);
            }
            let Some(oldest) = (0..entries.len()).min_by_key(|&i| entries[i].used) else {
                break None;
            };
            entries.swap_remove(oldest);
        };
        if let Some(charge) = charge {
            let used = self
                .clock
                .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
            entries.push(Entry {
                session,
                charge,
                used,
            });
        }
        self.gauges(&entries);
    }

    fn gauges(&self, entries: &[Entry]) {
        metrics::gauge!(ENTRIES_METRIC).set(entries.len() as f64);
        let bytes: usize = entries.iter().map(|e| e.charge.bytes()).sum();
        metrics::gauge!(BYTES_METRIC).set(bytes as f64);
    }
}
