//! The draft model's prompt cache: finished generations' draft KV caches,
//! kept so that a later request whose text shares a prefix with one — a
//! chat's earlier turns, a shared system prompt, the same prompt again —
//! does not prefill the draft model from its start. Without it every
//! speculating request prefilled its whole prompt in the draft model
//! before its first draft: ~0.3 s of a 2.6 s generation on the project's
//! 2-core CPU (a 165-token prompt, docs/PERFORMANCE.md).
//!
//! Unlike the model's prompt cache (`super::prompt_cache`), any common
//! prefix of tokens counts, whatever order its positions were computed
//! in: a draft only proposes, and EXACT verification gives the same text
//! whatever the drafts, so the draft's cache owes nothing bit for bit.
//! The same bounds: at most `generate.prompt_cache_entries` sessions (the
//! least recently put back leave first), each charged to the memory
//! budget for the K/V it holds; one the budget cannot take is dropped.

#![forbid(unsafe_code)]

use std::sync::{Arc, Mutex, MutexGuard, PoisonError};

use samplerd_model::{Model, Session};

use super::prompt_cache::SessionBytes;
use crate::request::memory::{Charge, MemoryBudget};

/// Tokens a draft model's first drafting took from the cache instead of
/// prefilling.
pub const REUSED_TOKENS_METRIC: &str = "samplerd_draft_cache_reused_tokens_total";

pub fn describe() {
    metrics::describe_counter!(
        REUSED_TOKENS_METRIC,
        "tokens a speculating Generate's draft model took from the draft cache instead of prefilling"
    );
    metrics::counter!(REUSED_TOKENS_METRIC).increment(0);
}

/// The cache (shared by the generations that draft with one draft model).
pub struct DraftCache {
    /// Least recently put back first.
    entries: Mutex<Vec<(Session, Charge)>>,
    capacity: usize,
    bytes: SessionBytes,
}

impl DraftCache {
    /// At most `capacity` sessions of the draft model `model` (0: off).
    pub fn new(model: &Model, capacity: usize) -> Self {
        DraftCache {
            entries: Mutex::new(Vec::new()),
            capacity,
            bytes: SessionBytes::of(model),
        }
    }

    fn entries(&self) -> MutexGuard<'_, Vec<(Session, Charge)>> {
        self.entries.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Takes the session that shares the longest prefix (at least one
    /// token) with `history` among those with room for `capacity`
    /// positions, cut to that prefix.
    pub fn take(&self, history: &[u32], capacity: usize) -> Option<Session> {
        let mut entries = self.entries();
        let (shared, i) = entries
            .iter()
            .enumerate()
            .filter(|(_, (s, _))| s.capacity() >= capacity)
            .map(|(i, (s, _))| (common_prefix(s.cached_tokens(), history), i))
            .max()?;
        if shared == 0 {
            return None;
        }
        let (mut session, _charge) = entries.remove(i);
        drop(entries);
        session.truncate(shared);
        metrics::counter!(REUSED_TOKENS_METRIC).increment(shared as u64);
        Some(session)
    }

    /// Keeps a finished generation's draft session: it replaces the
    /// sessions whose tokens it extends, then the least recently put back
    /// while the cache is full or the memory budget cannot take it.
    pub fn put(&self, mut session: Session, memory: &Arc<MemoryBudget>) {
        if self.capacity == 0 || session.cached_tokens().is_empty() {
            return;
        }
        session.release_scratch();
        let bytes = self.bytes.of_session(&session);
        let mut entries = self.entries();
        entries.retain(|(e, _)| !session.cached_tokens().starts_with(e.cached_tokens()));
        loop {
            if entries.len() < self.capacity
                && let Ok(charge) = memory.charge(bytes, "the draft model's prompt cache")
            {
                entries.push((session, charge));
                return;
            }
            if entries.is_empty() {
                return;
            }
            entries.remove(0);
        }
    }
}

/// How many tokens `a` and `b` share from their start.
fn common_prefix(a: &[u32], b: &[u32]) -> usize {
    a.iter().zip(b).take_while(|(x, y)| x == y).count()
}
