//! Compiled grammars by key — a SHA-256 of the stage's parameters (the
//! grammar text and its kind among them) and the vocabulary's identity —
//! so that a repeated schema, and every row of a batch that shares one,
//! compiles once. Refusals are kept too (a grammar that does not compile,
//! or that ran past the compile budget, is refused again without running).
//!
//! Bounded by `limits.constraint_cache_entries` and
//! `limits.constraint_cache_bytes`, least recently used out first. Each
//! compiled grammar's estimated size ([`super::compiled_bytes`]) is
//! charged to the memory budget for as long as the cache or a request
//! holds it ([`Compiled`] owns its charge).
//!
//! A compile in flight has a [`Slot::Pending`] entry: a request for the
//! same key waits for that compile instead of starting another.

#![forbid(unsafe_code)]

use std::collections::HashMap;
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};

use samplerd_sampling::{BuiltStage, ChainError};
use sha2::{Digest, Sha256};
use tokio::sync::watch;

use crate::request::memory::Charge;

/// Prometheus counter: lookups, label `result` (`hit`: a compiled grammar
/// or a refusal was there, or a compile of it was in flight; `miss`: this
/// request compiles it).
pub const LOOKUPS_METRIC: &str = "samplerd_constraint_cache_lookups_total";
/// Prometheus gauge: entries held.
pub const ENTRIES_METRIC: &str = "samplerd_constraint_cache_entries";
/// Prometheus gauge: bytes the entries are charged.
pub const BYTES_METRIC: &str = "samplerd_constraint_cache_bytes";

/// What a cached refusal costs in the byte bound besides its message.
const REFUSAL_BYTES: usize = 256;

/// A cache key: SHA-256 of what the compiled config depends on.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct Key([u8; 32]);

impl Key {
    /// The key of `spec` built against the vocabulary whose identity is
    /// `vocab` (its address: a cached stage holds its vocabulary, so no
    /// other can take that address while the entry lives).
    pub fn new(spec: &samplerd_sampling::StageSpec, vocab: usize) -> Self {
        use samplerd_sampling::ParamValue;
        let mut h = Sha256::new();
        let bytes = |h: &mut Sha256, b: &[u8]| {
            h.update((b.len() as u64).to_le_bytes());
            h.update(b);
        };
        h.update((vocab as u64).to_le_bytes());
        bytes(&mut h, spec.name.as_bytes());
        for (name, value) in &spec.params {
            bytes(&mut h, name.as_bytes());
            match value {
                ParamValue::Number(n) => {
                    h.update([0]);
                    h.update(n.to_bits().to_le_bytes());
                }
                ParamValue::String(s) => {
                    h.update([1]);
                    bytes(&mut h, s.as_bytes());
                }
                ParamValue::TokenMap(m) => {
                    h.update([2]);
                    h.update((m.len() as u64).to_le_bytes());
                    for (id, v) in m {
                        h.update(id.to_le_bytes());
                        h.update(v.to_bits().to_le_bytes());
                    }
                }
                ParamValue::StringList(l) => {
                    h.update([3]);
                    h.update((l.len() as u64).to_le_bytes());
                    for s in l {
                        bytes(&mut h, s.as_bytes());
                    }
                }
            }
        }
        Key(h.finalize().into())
    }
}

/// A compiled grammar and its share of the memory budget.
pub struct Compiled {
    pub stage: BuiltStage,
    /// The estimate charged.
    pub bytes: usize,
    _charge: Charge,
}

impl Compiled {
    pub fn new(stage: BuiltStage, charge: Charge) -> Self {
        Compiled {
            stage,
            bytes: charge.bytes(),
            _charge: charge,
        }
    }
}

/// How a compile ended.
#[derive(Clone)]
pub enum Outcome {
    Compiled(Arc<Compiled>),
    /// The stage refused the grammar.
    Refused(ChainError),
    /// It ran past `limits.max_constraint_compile_ms` (milliseconds it took).
    TooCostly {
        ms: u64,
    },
    /// The memory budget could not take it (not cached).
    NoMemory(String),
}

impl Outcome {
    fn bytes(&self) -> usize {
        match self {
            Outcome::Compiled(c) => c.bytes,
            Outcome::Refused(e) => REFUSAL_BYTES + e.to_string().len(),
            Outcome::TooCostly { .. } | Outcome::NoMemory(_) => REFUSAL_BYTES,
        }
    }
}

/// Where a compile is, as its waiters see it.
#[derive(Clone)]
pub enum Phase {
    /// Waiting for a compile thread.
    Queued,
    /// On a compile thread.
    Running,
    Done(Outcome),
}

/// A compile in flight, as its waiters see it. Its sender dropped without
/// [`Phase::Done`]: the compile was dropped unrun.
pub type Flight = watch::Receiver<Phase>;
/// The compile's end of a [`Flight`].
pub type FlightSender = watch::Sender<Phase>;

enum Slot {
    Pending(Flight),
    Ready {
        outcome: Outcome,
        bytes: usize,
        used: u64,
    },
}

struct Entries {
    map: HashMap<Key, Slot>,
    bytes: usize,
    clock: u64,
}

/// The bounded cache.
pub struct Cache {
    max_entries: usize,
    max_bytes: usize,
    entries: Mutex<Entries>,
}

/// What a lookup found.
pub enum Lookup {
    /// Done before: its outcome.
    Ready(Outcome),
    /// Being compiled: wait on it.
    Pending(Flight),
    /// Nothing: the caller compiles it and reports through the sender
    /// (then [`Cache::finish`]).
    Miss(FlightSender),
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(PoisonError::into_inner)
}

impl Cache {
    pub fn new(max_entries: usize, max_bytes: usize) -> Self {
        metrics::gauge!(ENTRIES_METRIC).set(0.0);
        metrics::gauge!(BYTES_METRIC).set(0.0);
        Cache {
            max_entries,
            max_bytes,
            entries: Mutex::new(Entries {
                map: HashMap::new(),
                bytes: 0,
                clock: 0,
            }),
        }
    }

    /// Looks `key` up; on a miss, marks it pending (the caller compiles).
    pub fn lookup(&self, key: Key) -> Lookup {
        let mut e = lock(&self.entries);
        e.clock += 1;
        let now = e.clock;
        let found = match e.map.get_mut(&key) {
            Some(Slot::Ready { outcome, used, .. }) => {
                *used = now;
                Some(Lookup::Ready(outcome.clone()))
            }
            Some(Slot::Pending(flight)) => Some(Lookup::Pending(flight.clone())),
            None => None,
        };
        let result = if found.is_some() { "hit" } else { "miss" };
        metrics::counter!(LOOKUPS_METRIC, "result" => result).increment(1);
        found.unwrap_or_else(|| {
            let (tx, rx) = watch::channel(Phase::Queued);
            e.map.insert(key, Slot::Pending(rx));
            Lookup::Miss(tx)
        })
    }

    /// Records how the compile of `key` ended (and tells its waiters):
    /// kept unless it is a [`Outcome::NoMemory`] or larger than the whole
    /// byte bound, after evicting the least recently used entries it needs
    /// room for.
    pub fn finish(&self, key: Key, tx: &FlightSender, outcome: Outcome) {
        {
            let mut e = lock(&self.entries);
            e.map.remove(&key);
            let bytes = outcome.bytes();
            let keep = !matches!(outcome, Outcome::NoMemory(_))
                && bytes <= self.max_bytes
                && self.max_entries > 0;
            if keep {
                while e.map.len() >= self.max_entries || e.bytes + bytes > self.max_bytes {
                    if !evict_one(&mut e) {
                        break;
                    }
                }
                e.clock += 1;
                let used = e.clock;
                e.bytes += bytes;
                e.map.insert(
                    key,
                    Slot::Ready {
                        outcome: outcome.clone(),
                        bytes,
                        used,
                    },
                );
            }
            publish(&e);
        }
        tx.send_replace(Phase::Done(outcome));
    }

    /// Forgets a pending `key` whose compile never ran (its sender is
    /// dropped with it, which its waiters see).
    pub fn abandon(&self, key: Key) {
        let mut e = lock(&self.entries);
        if matches!(e.map.get(&key), Some(Slot::Pending(_))) {
            e.map.remove(&key);
        }
    }

    /// Evicts the least recently used compiled grammar (for the memory
    /// budget): false when there is none.
    pub fn evict_compiled(&self) -> bool {
        let mut e = lock(&self.entries);
        let victim = e
            .map
            .iter()
            .filter_map(|(k, s)| match s {
                Slot::Ready {
                    outcome: Outcome::Compiled(_),
                    used,
                    ..
                } => Some((*used, *k)),
                _ => None,
            })
            .min();
        let Some((_, key)) = victim else {
            return false;
        };
        remove(&mut e, key);
        publish(&e);
        true
    }

    /// Entries held (pending ones included) and the bytes of the ready ones.
    pub fn size(&self) -> (usize, usize) {
        let e = lock(&self.entries);
        (e.map.len(), e.bytes)
    }
}

/// Removes the least recently used ready entry: false when there is none.
fn evict_one(e: &mut Entries) -> bool {
    let victim = e
        .map
        .iter()
        .filter_map(|(k, s)| match s {
            Slot::Ready { used, .. } => Some((*used, *k)),
            Slot::Pending(_) => None,
        })
        .min();
    match victim {
        Some((_, key)) => {
            remove(e, key);
            true
        }
        None => false,
    }
}

fn remove(e: &mut Entries, key: Key) {
    if let Some(Slot::Ready { bytes, .. }) = e.map.remove(&key) {
        e.bytes -= bytes;
    }
}

fn publish(e: &Entries) {
    metrics::gauge!(ENTRIES_METRIC).set(e.map.len() as f64);
    metrics::gauge!(BYTES_METRIC).set(e.bytes as f64);
}

#[cfg(test)]
mod tests {
    use super::*;
    use samplerd_sampling::StageSpec;

    fn key(text: &str) -> Key {
        Key::new(
            &StageSpec::new("constraint")
                .with("regex", samplerd_sampling::ParamValue::String(text.into())),
            1,
        )
    }

    fn refused(msg: &str) -> Outcome {
        Outcome::Refused(ChainError::Invalid {
            stage: "constraint".into(),
            message: msg.into(),
        })
    }

    fn miss(c: &Cache, k: Key) -> FlightSender {
        match c.lookup(k) {
            Lookup::Miss(tx) => tx,
            _ => panic!("expected a miss"),
        }
    }

    #[test]
    fn keys_differ_by_text_kind_and_vocabulary() {
        let spec = |kind: &str, text: &str| {
            StageSpec::new("constraint")
                .with(kind, samplerd_sampling::ParamValue::String(text.into()))
        };
        let a = Key::new(&spec("regex", "a"), 1);
        assert_eq!(a, Key::new(&spec("regex", "a"), 1));
        assert_ne!(a, Key::new(&spec("regex", "b"), 1));
        assert_ne!(a, Key::new(&spec("lark", "a"), 1));
        assert_ne!(a, Key::new(&spec("regex", "a"), 2));
    }

    #[test]
    fn a_pending_key_is_joined_and_a_finished_one_is_a_hit() {
        let c = Cache::new(8, 1 << 20);
        let tx = miss(&c, key("a"));
        let Lookup::Pending(mut flight) = c.lookup(key("a")) else {
            panic!("expected pending");
        };
        assert!(matches!(&*flight.borrow_and_update(), Phase::Queued));
        c.finish(key("a"), &tx, refused("no"));
        assert!(matches!(
            &*flight.borrow(),
            Phase::Done(Outcome::Refused(_))
        ));
        assert!(matches!(
            c.lookup(key("a")),
            Lookup::Ready(Outcome::Refused(_))
        ));
    }

    #[test]
    fn the_least_recently_used_entry_goes_first() {
        let c = Cache::new(2, 1 << 20);
        for k in ["a", "b"] {
            let tx = miss(&c, key(k));
            c.finish(key(k), &tx, refused(k));
        }
        assert!(matches!(c.lookup(key("a")), Lookup::Ready(_)));
        let tx = miss(&c, key("c"));
        c.finish(key("c"), &tx, refused("c"));
        assert!(matches!(c.lookup(key("a")), Lookup::Ready(_)));
        assert!(matches!(c.lookup(key("b")), Lookup::Miss(_)));
    }

    #[test]
    fn the_byte_bound_evicts_and_an_outsize_entry_is_not_kept() {
        let one = refused("a").bytes();
        let c = Cache::new(100, 2 * one - 1);
        for k in ["a", "b"] {
            let tx = miss(&c, key(k));
            c.finish(key(k), &tx, refused(k));
        }
        assert_eq!(c.size(), (1, one));
        assert!(matches!(c.lookup(key("b")), Lookup::Ready(_)));
        let tx = miss(&c, key("big"));
        c.finish(key("big"), &tx, refused(&"x".repeat(1000)));
        assert!(matches!(c.lookup(key("big")), Lookup::Miss(_)));
    }
}
