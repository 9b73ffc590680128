//! The pool's own tests: steps, the watchdog's write-off
//! and replacement, the health bound, shutdown.

use super::*;

fn pool(threads: usize, max_step_ms: u64, max_stuck: usize) -> StepPool {
    StepPool::start(StepPoolConfig {
        threads,
        max_step: Duration::from_millis(max_step_ms),
        max_stuck,
    })
    .unwrap()
}

/// A step that blocks until `release` is sent to (or dropped).
fn blocker() -> (mpsc::Sender<()>, impl FnOnce() -> u32 + Send + 'static) {
    let (release, wait) = mpsc::channel::<()>();
    (release, move || {
        let _ = wait.recv();
        1
    })
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn runs_steps_and_turns_panics_into_internal() {
    let p = pool(2, 2_000, 1);
    assert_eq!(p.run(|| 41 + 1).await.unwrap(), 42);
    let e = p.run(|| -> u32 { panic!("boom") }).await.unwrap_err();
    assert_eq!(e, StepFailure::Panicked("boom".into()));
    assert_eq!(e.failure().reason(), crate::status::Reason::StepPanicked);
    assert_eq!(Status::from(e).code(), tonic::Code::Internal);
    // The panic cost no thread.
    assert_eq!(p.run_blocking(|| 7).unwrap(), 7);
    assert!(p.healthy());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stuck_step_is_written_off_and_replaced() {
    let p = pool(1, 100, 1);
    let (release, stuck) = blocker();
    let e = p.run(stuck).await.unwrap_err();
    assert!(matches!(e, StepFailure::Stuck { .. }), "{e:?}");
    assert_eq!(Status::from(e).code(), tonic::Code::DeadlineExceeded);
    assert_eq!(p.stuck(), 1);
    // The replacement serves the next step although the first thread
    // is still blocked.
    assert_eq!(p.run(|| 5).await.unwrap(), 5);
    assert!(p.healthy(), "one lost thread is within max_stuck = 1");
    // A second one is past the bound.
    let (release_too, stuck_too) = blocker();
    assert!(matches!(
        p.run(stuck_too).await,
        Err(StepFailure::Stuck { .. })
    ));
    assert_eq!(p.stuck(), 2);
    assert!(!p.healthy(), "two lost threads are past max_stuck = 1");
    // Not replaced: nothing is left to run a step, so the next one gives
    // up.
    let none = p.run(|| 6).await.unwrap_err();
    assert!(matches!(none, StepFailure::NoWorker { .. }), "{none:?}");
    drop((release, release_too));
    // The lost threads come back and the pool is whole again.
    wait_for("the lost threads never returned", || {
        p.stuck() == 0 && p.healthy()
    });
    assert_eq!(p.run(|| 7).await.unwrap(), 7);
    let on_pool = p.run_blocking(thread_name).unwrap();
    assert_eq!(
        on_pool.as_deref(),
        Some("samplerd-step"),
        "a pool thread again"
    );
}

/// Waits (bounded: 5 s, then fails with `what`) until `done` holds. Not
/// for a condition that needs this runtime thread's own tasks to run.
fn wait_for(what: &str, mut done: impl FnMut() -> bool) {
    let deadline = Instant::now() + Duration::from_secs(5);
    while !done() {
        assert!(Instant::now() < deadline, "{what}");
        std::thread::yield_now();
    }
}

fn thread_name() -> Option<String> {
    std::thread::current().name().map(str::to_string)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_step_runs_on_a_pool_thread() {
    let p = pool(1, 2_000, 1);
    let name = p.run(thread_name).await.unwrap();
    assert_eq!(name.as_deref(), Some("samplerd-step"));
    let name = p.run_blocking(thread_name).unwrap();
    assert_eq!(name.as_deref(), Some("samplerd-step"));
}

#[tokio::test]
async fn a_single_threaded_runtime_uses_the_pool() {
    let p = pool(1, 2_000, 1);
    let name = p.run(thread_name).await.unwrap();
    assert_eq!(name.as_deref(), Some("samplerd-step"));
}

#[test]
fn dropping_the_pool_ends_its_threads() {
    let p = pool(2, 1_000, 1);
    assert_eq!(p.clone().run_blocking(|| 1).unwrap(), 1);
    let shared = Arc::downgrade(&p.shared);
    drop(p);
    // Each worker holds the shared state until it exits.
    wait_for("the pool's threads did not exit", || {
        shared.upgrade().is_none()
    });
}

#[test]
fn past_the_bound_the_pool_is_unhealthy_until_a_thread_returns() {
    let p = pool(1, 50, 0);
    let (release, stuck) = blocker();
    assert!(matches!(
        p.run_blocking(stuck),
        Err(StepFailure::Stuck { .. })
    ));
    assert!(!p.healthy(), "no replacement past max_stuck");
    // Nothing serves the queue: the next step gives up while queued.
    let none = p.run_blocking(|| 1).unwrap_err();
    assert!(matches!(none, StepFailure::NoWorker { .. }), "{none:?}");
    let status = Status::from(none);
    assert_eq!(status.code(), tonic::Code::Unavailable);
    let reason = {
        use tonic_types::StatusExt as _;
        status.get_details_error_info().map(|i| i.reason)
    };
    assert_eq!(reason.as_deref(), Some("SAMPLERD_NO_SAMPLING_THREAD"));
    drop(release);
    // The lost thread rejoins (the pool is short of one) and serves.
    wait_for("the lost thread never rejoined", || p.healthy());
    assert_eq!(p.run_blocking(|| 3).unwrap(), 3);
}
