//! Running a sampling step off the async reactor without paying two
//! thread hops for it.
//!
//! `spawn_blocking` hands the step to a pool thread and the result back to
//! a worker: two cross-thread wake-ups per request (tens of µs on a busy
//! machine — a large share of a ~300 µs loopback round trip). On the
//! multi-threaded runtime the server runs on, `block_in_place` instead
//! moves the *other* tasks of this worker to another thread and runs the
//! step right here, so health checks and other requests still never wait
//! behind a large request, and the request itself never changes thread.
//! Runtimes that cannot do that (the current-thread runtime of
//! `#[tokio::test]`) fall back to `spawn_blocking`.

use std::panic::{AssertUnwindSafe, catch_unwind};

use tokio::runtime::{Handle, RuntimeFlavor};
use tonic::Status;

/// Runs the CPU-bound `f` off the reactor (see the module docs). A panic
/// in `f` becomes `INTERNAL` for this request only, as with a failed
/// `spawn_blocking` task.
pub async fn run<F, R>(f: F) -> Result<R, Status>
where
    F: FnOnce() -> R + Send + 'static,
    R: Send + 'static,
{
    if Handle::current().runtime_flavor() == RuntimeFlavor::MultiThread {
        tokio::task::block_in_place(|| catch_unwind(AssertUnwindSafe(f))).map_err(|panic| {
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
    }

    #[tokio::test(flavor = "current_thread")]
    async fn falls_back_to_spawn_blocking_on_current_thread() {
        both_paths().await;
    }
}
