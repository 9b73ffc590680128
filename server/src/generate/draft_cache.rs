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

use std::sync::Arc;

use samplerd_model::{Model, Session};

use super::kept_sessions::KeptSessions;
use crate::request::memory::MemoryBudget;

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
    kept: KeptSessions,
}

impl DraftCache {
    /// At most `capacity` sessions of the draft model `model` (0: off).
    pub fn new(model: &Model, capacity: usize) -> Self {
        DraftCache {
            kept: KeptSessions::new(model, capacity, "the draft model's prompt cache"),
        }
    }

    /// Takes the session that shares the longest prefix (at least one
    /// token) with `history` among those with room for `capacity`
    /// positions, cut to that prefix.
    pub fn take(&self, history: &[u32], capacity: usize) -> Option<Session> {
        let (mut session, shared) = self.kept.take(|s| {
            if s.capacity() >= capacity {
                common_prefix(s.cached_tokens(), history)
            } else {
                0
            }
        })?;
        session.truncate(shared);
        metrics::counter!(REUSED_TOKENS_METRIC).increment(shared as u64);
        Some(session)
    }

    /// Keeps a finished generation's draft session (see
    /// [`KeptSessions::put`]: bounded in number and by `memory`).
    pub fn put(&self, session: Session, memory: &Arc<MemoryBudget>) {
        self.kept.put(session, memory);
    }
}

/// How many tokens `a` and `b` share from their start.
fn common_prefix(a: &[u32], b: &[u32]) -> usize {
    a.iter().zip(b).take_while(|(x, y)| x == y).count()
}
