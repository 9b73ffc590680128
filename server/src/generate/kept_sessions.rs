//! Finished sessions kept for later requests, at most a configured number
//! (the least recently kept leave first) and each charged to the memory
//! budget for the K/V it holds: the store under the model's prompt cache
//! (`super::prompt_cache`) and the draft model's (`super::draft_cache`),
//! which differ only in which kept session a request may take.

#![forbid(unsafe_code)]

use std::sync::{Arc, Mutex, MutexGuard, PoisonError};

use samplerd_model::{Model, Session};

use crate::request::memory::{Charge, MemoryBudget};

/// What a kept session of one model is charged to the memory budget.
#[derive(Clone, Copy, Debug)]
struct SessionBytes {
    /// K/V bytes one cached position holds.
    per_token: usize,
    /// Fixed bytes of a session (its page-rounded K/V regions).
    per_session: usize,
}

/// The K/V bytes one position of a `model` session holds: f16 K and V of
/// every layer's KV heads.
pub(super) fn kv_bytes_per_token(model: &Model) -> usize {
    let c = model.config();
    c.n_layer * 2 * c.n_head_kv * c.head_dim * 2
}

impl SessionBytes {
    fn of(model: &Model) -> Self {
        let c = model.config();
        SessionBytes {
            per_token: kv_bytes_per_token(model),
            per_session: c.n_layer * 2 * c.n_head_kv * 4096,
        }
    }

    fn of_session(self, session: &Session) -> usize {
        self.per_session + session.cached_tokens().len() * self.per_token
    }
}

/// The store (see the module doc).
pub(super) struct KeptSessions {
    /// The least recently kept first.
    entries: Mutex<Vec<(Session, Charge)>>,
    capacity: usize,
    bytes: SessionBytes,
    /// What the memory budget's refusals name.
    what: &'static str,
}

impl KeptSessions {
    /// At most `capacity` sessions of `model` (0: none), charged as `what`.
    pub(super) fn new(model: &Model, capacity: usize, what: &'static str) -> Self {
        KeptSessions {
            entries: Mutex::new(Vec::new()),
            capacity,
            bytes: SessionBytes::of(model),
            what,
        }
    }

    fn entries(&self) -> MutexGuard<'_, Vec<(Session, Charge)>> {
        self.entries.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Takes the session `best` scores highest (a score of 0: not
    /// takeable), with its score; none when no session scores above 0.
    pub(super) fn take(&self, best: impl Fn(&Session) -> usize) -> Option<(Session, usize)> {
        let mut entries = self.entries();
        let (score, i) = entries
            .iter()
            .enumerate()
            .map(|(i, (s, _))| (best(s), i))
            .max()?;
        (score > 0).then(|| (entries.remove(i).0, score))
    }

    /// Keeps a finished session: it replaces the sessions whose tokens it
    /// extends, then the least recently kept leave while the store is full
    /// or the memory budget cannot take it; when even an empty store
    /// cannot, it is dropped.
    pub(super) fn put(&self, mut session: Session, memory: &Arc<MemoryBudget>) {
        if self.capacity == 0 || session.cached_tokens().is_empty() {
            return;
        }
        // Only the K/V is kept: scratch is sized by the step that ran.
        session.release_scratch();
        let bytes = self.bytes.of_session(&session);
        let mut entries = self.entries();
        entries.retain(|(e, _)| !session.cached_tokens().starts_with(e.cached_tokens()));
        loop {
            if entries.len() < self.capacity
                && let Ok(charge) = memory.charge(bytes, self.what)
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

    /// Sessions kept and the bytes they are charged.
    pub(super) fn size(&self) -> (usize, usize) {
        let entries = self.entries();
        let bytes = entries.iter().map(|(_, c)| c.bytes()).sum();
        (entries.len(), bytes)
    }
}
