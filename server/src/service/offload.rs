//! Running a sampling step without stalling the async reactor, and
//! without paying for thread hops when it need not.
//!
//! A step is CPU-bound (~50–100 µs for a 150k vocabulary with the default
//! chain, more with heavy custom chains). Three ways to run it, cheapest
//! first:
//!
//! 1. **Inline** on the worker that polled the request, while at least one
//!    other worker stays free: at most `workers − 1` steps run inline at
//!    once, so health checks and other requests always have a worker
//!    (idle workers steal queued tasks). No thread is woken at all.
//! 2. **`block_in_place`** when every other worker is already busy with
//!    an inline step: the worker's other tasks move to a fresh thread and
//!    the step runs right here. Each call wakes a thread and hands the
//!    worker over — measured on the RPC benchmark (2 cores) at ~100 µs
//!    of latency per request under load, which is why it is not the
//!    default path any more.
//! 3. **`spawn_blocking`** on runtimes that cannot do either (the
//!    current-thread runtime of `#[tokio::test]`): two cross-thread hops.
//!
//! A panic in the step is `INTERNAL` for that request only, on every path.

use std::panic::{AssertUnwindSafe, catch_unwind};
use std::sync::atomic::{AtomicUsize, Ordering};

use tokio::runtime::{Handle, RuntimeFlavor};
use tonic::Status;

/// Steps running inline on runtime workers right now (process-wide: with
/// several runtimes in one process it only errs towards `block_in_place`).
static INLINE: AtomicUsize = AtomicUsize::new(0);

/// A claimed inline slot; released on drop (also when the step panics).
struct InlineSlot;

impl InlineSlot {
    /// Claims a slot if fewer than `limit` steps run inline.
    fn try_claim(limit: usize) -> Option<InlineSlot> {
        INLINE
            .fetch_update(Ordering::AcqRel, Ordering::Relaxed, |n| {
                (n < limit).then_some(n + 1)
            })
            .ok()
            .map(|_| InlineSlot)
    }
}

impl Drop for InlineSlot {
    fn drop(&mut self) {
        INLINE.fetch_sub(1, Ordering::AcqRel);
    }
}

/// Runs the CPU-bound `f` (see the module docs for where).
pub async fn run<F, R>(f: F) -> Result<R, Status>
where
    F: FnOnce() -> R + Send + 'static,
    R: Send + 'static,
{
    let handle = Handle::current();
    if handle.runtime_flavor() == RuntimeFlavor::MultiThread {
        let spare = handle.metrics().num_workers().saturating_sub(1);
        let caught = match InlineSlot::try_claim(spare) {
            Some(_slot) => catch_unwind(AssertUnwindSafe(f)),
            None => tokio::task::block_in_place(|| catch_unwind(AssertUnwindSafe(f))),
        };
        caught.map_err(|panic| {
            Status::internal(format!("sampling task failed: {}", panic_text(&*panic)))
        })
    } else {
        tokio::task::spawn_blocking(f)
            .await
            .map_err(|e| Status::internal(format!("sampling task failed: {e}")))
    }
}

/// The message of a panic payload (`panic!` with a literal or a format).
fn panic_text(payload: &(dyn std::any::Any + Send)) -> &str {
    payload
        .downcast_ref::<&str>()
        .copied()
        .or_else(|| payload.downcast_ref::<String>().map(String::as_str))
        .unwrap_or("panicked")
}

#[cfg(test)]
mod tests {
    use super::*;

    async fn both_paths() {
        assert_eq!(run(|| 41 + 1).await.unwrap(), 42);
        let e = run(|| -> u32 { panic!("boom") }).await.unwrap_err();
        assert_eq!(e.code(), tonic::Code::Internal);
        assert!(e.message().contains("sampling task failed"), "{e:?}");
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn runs_in_place_on_the_multi_thread_runtime() {
        both_paths().await;
        // A panic released its slot: the next step still runs.
        assert_eq!(run(|| 7).await.unwrap(), 7);
    }

    /// With every spare worker busy inline, a step still runs (on the
    /// `block_in_place` path), panics included.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn falls_back_to_block_in_place_when_no_worker_is_spare() {
        let _all = InlineSlot::try_claim(usize::MAX);
        assert!(InlineSlot::try_claim(1).is_none());
        both_paths().await;
    }

    #[tokio::test(flavor = "current_thread")]
    async fn falls_back_to_spawn_blocking_on_current_thread() {
        both_paths().await;
    }
}
