//! The process's memory budget: every allocation a request owns that
//! scales with its input is charged here before it is made, and a request
//! that would take the total over `limits.memory_budget_bytes` is refused
//! up front with RESOURCE_EXHAUSTED naming the budget and what it asked
//! for — instead of the kernel killing the pod for everyone.
//!
//! What is charged, and for how long (estimates from the structures'
//! sizes, measured against RSS in `server/tests/budgets.rs`):
//!
//! - a `Sample` request: its logits, window and token maps
//!   ([`request_bytes`]), for the call;
//! - a `SampleStream` session: its first message plus the session's own
//!   token buffer and stage states ([`SESSION_BYTES_PER_LOGIT`] per logit,
//!   ~6.2 MiB at 262,144 logits and a 65,536-token window), for the stream;
//! - a `Generate` request: the tokenizer's peak for its prompt
//!   ([`TOKENIZER_BYTES_PER_PROMPT_BYTE`]) and its KV cache, from admission
//!   to the end of the generation.
//!
//! Fixed costs (the model's weights, the buffer pool, threads) are not
//! charged: the budget is what requests may hold on top of them.

#![forbid(unsafe_code)]

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};

use samplerd_api::v1;

use crate::request::errors::RequestError;
use crate::status::Reason;

/// Prometheus gauge: the budget in bytes.
pub const BUDGET_METRIC: &str = "samplerd_memory_budget_bytes";
/// Prometheus gauge: bytes charged by requests now.
pub const CHARGED_METRIC: &str = "samplerd_memory_charged_bytes";

/// Bytes a SampleStream session holds per logit of its vocabulary: the
/// token buffer's dense logits (4) and candidates (8), the core stages'
/// per-token state (penalty counts, top_p's scratch: ~8), and allocator
/// slack.
pub const SESSION_BYTES_PER_LOGIT: usize = 24;
/// Bytes the tokenizer holds at its peak per byte of prompt (its pre-
/// tokenized pieces, offsets and ids: ~40 MB per MB of text).
pub const TOKENIZER_BYTES_PER_PROMPT_BYTE: usize = 40;
/// Bytes of one token-map entry once decoded (hash map slot and copy).
const MAP_ENTRY_BYTES: usize = 16;
/// The budget without a configured value or a cgroup limit.
pub const FIXED_DEFAULT_BUDGET: usize = 4 << 30;
/// Share of a cgroup's memory limit given to requests by default (the
/// rest for weights, pools and the allocator).
const CGROUP_SHARE: (usize, usize) = (3, 4);

/// The budget (`limits.memory_budget_bytes`; 0: derived, see
/// [`default_budget`]) and what requests hold of it.
#[derive(Debug)]
pub struct MemoryBudget {
    limit: usize,
    charged: AtomicUsize,
}

/// A request's charge; released when dropped.
#[derive(Debug)]
pub struct Charge {
    budget: Arc<MemoryBudget>,
    bytes: usize,
}

impl Drop for Charge {
    fn drop(&mut self) {
        let now = self.budget.charged.fetch_sub(self.bytes, Ordering::AcqRel) - self.bytes;
        metrics::gauge!(CHARGED_METRIC).set(now as f64);
    }
}

impl Charge {
    /// The bytes charged.
    pub fn bytes(&self) -> usize {
        self.bytes
    }
}

impl MemoryBudget {
    /// A budget of `configured` bytes, or the derived default for 0.
    pub fn new(configured: usize) -> Arc<Self> {
        let limit = if configured == 0 {
            default_budget()
        } else {
            configured
        };
        metrics::gauge!(BUDGET_METRIC).set(limit as f64);
        metrics::gauge!(CHARGED_METRIC).set(0.0);
        Arc::new(MemoryBudget {
            limit,
            charged: AtomicUsize::new(0),
        })
    }

    /// The budget in bytes.
    pub fn limit(&self) -> usize {
        self.limit
    }

    /// Bytes charged now.
    pub fn charged(&self) -> usize {
        self.charged.load(Ordering::Acquire)
    }

    /// Charges `bytes` for `what` (named in the refusal), or refuses.
    pub fn charge(self: &Arc<Self>, bytes: usize, what: &str) -> Result<Charge, RequestError> {
        let mut now = self.charged.load(Ordering::Acquire);
        loop {
            let after = now.saturating_add(bytes);
            if after > self.limit {
                return Err(RequestError::exhausted(
                    Reason::BudgetExceeded,
                    "limits.memory_budget_bytes",
                    format!(
                        "memory budget: {what} needs {} and {} of the {} budget are held by \
                         other requests (limits.memory_budget_bytes); try again later",
                        mib(bytes),
                        mib(now),
                        mib(self.limit)
                    ),
                ));
            }
            match self.charged.compare_exchange_weak(
                now,
                after,
                Ordering::AcqRel,
                Ordering::Acquire,
            ) {
                Ok(_) => {
                    metrics::gauge!(CHARGED_METRIC).set(after as f64);
                    return Ok(Charge {
                        budget: Arc::clone(self),
                        bytes,
                    });
                }
                Err(actual) => now = actual,
            }
        }
    }
}

fn mib(bytes: usize) -> String {
    format!("{:.1} MiB", bytes as f64 / (1 << 20) as f64)
}

/// The default budget: three quarters of the cgroup's memory limit when
/// there is one (cgroup v2 `memory.max`, else v1
/// `memory.limit_in_bytes`), else [`FIXED_DEFAULT_BUDGET`].
pub fn default_budget() -> usize {
    cgroup_limit()
        .map(|l| l / CGROUP_SHARE.1 * CGROUP_SHARE.0)
        .unwrap_or(FIXED_DEFAULT_BUDGET)
}

fn cgroup_limit() -> Option<usize> {
    let read = |p: &str| std::fs::read_to_string(p).ok();
    let parse = |s: String| s.trim().parse::<u64>().ok();
    // v2: a number, or "max" (none). v1: a huge number means none.
    let limit = read("/sys/fs/cgroup/memory.max")
        .and_then(parse)
        .or_else(|| read("/sys/fs/cgroup/memory/memory.limit_in_bytes").and_then(parse))?;
    (limit < 1 << 60)
        .then(|| usize::try_from(limit).ok())
        .flatten()
}

/// What a `Sample` request (or a stream's message) holds while it is
/// served: its logits, window and token maps.
pub fn request_bytes(
    logits: usize,
    logits_f32le: usize,
    window: usize,
    params: Option<&v1::SamplingParams>,
) -> usize {
    let maps = params.map_or(0, |p| {
        p.logit_bias.len()
            + p.chain
                .iter()
                .flat_map(|s| s.params.values())
                .map(|v| match &v.kind {
                    Some(v1::param_value::Kind::TokenMap(m)) => m.entries.len(),
                    _ => 0,
                })
                .sum::<usize>()
    });
    logits * 4 + logits_f32le + window * 4 + maps * MAP_ENTRY_BYTES
}

/// A sparse row's ids and values in f32-sized units (what `request_bytes`
/// takes as `logits`): two per entry.
pub fn sparse_floats(sparse: Option<&v1::SparseLogits>) -> usize {
    sparse.map_or(0, |s| s.ids.len() + s.values.len())
}

/// What a SampleStream session holds for its life, from its first message.
pub fn session_bytes(first: &v1::SampleStreamRequest) -> usize {
    let n_vocab = first
        .logits
        .len()
        .max(first.logits_f32le.len() / 4)
        .max(first.sparse.as_ref().map_or(0, |s| s.vocab_size as usize));
    request_bytes(
        first.logits.len() + sparse_floats(first.sparse.as_ref()),
        first.logits_f32le.len(),
        first.previous_tokens.len(),
        first.params.as_ref(),
    ) + n_vocab * SESSION_BYTES_PER_LOGIT
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn charges_add_up_refuse_past_the_limit_and_come_back() {
        let b = MemoryBudget::new(1000);
        let a = b.charge(600, "a").unwrap();
        let e = b
            .charge(500, "this Sample request")
            .unwrap_err()
            .to_string();
        assert!(e.contains("limits.memory_budget_bytes"), "{e}");
        assert!(e.contains("this Sample request"), "{e}");
        let c = b.charge(400, "c").unwrap();
        assert_eq!(b.charged(), 1000);
        drop(a);
        drop(c);
        assert_eq!(b.charged(), 0);
        assert!(b.charge(1000, "all of it").is_ok());
    }

    #[test]
    fn a_session_at_the_largest_vocabulary_and_window_is_about_6_mib() {
        let first = v1::SampleStreamRequest {
            logits_f32le: vec![0u8; 262_144 * 4].into(),
            previous_tokens: vec![0; 65_536],
            ..Default::default()
        };
        let mib = session_bytes(&first) as f64 / (1 << 20) as f64;
        assert!((6.0..8.0).contains(&mib), "{mib} MiB");
    }
}
