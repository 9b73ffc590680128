//! A step run inline ([`StepPool::run`]): on the runtime thread that
//! decoded the request, after that thread has handed its other work to
//! another runtime thread (`tokio::task::block_in_place`), under the
//! pool's watchdog.
//!
//! Why not on the worker itself, which would wake no thread: a worker that
//! never comes back strands what only it can run — the task in its LIFO
//! slot and every waker tokio's cooperative budget deferred onto it (a busy
//! h2 connection's, typically), so connections froze behind a stuck stage.
//! `block_in_place` wakes those and frees the slot before it hands the
//! worker's core to another thread (docs/PERFORMANCE.md, "gRPC round
//! trips").

use std::panic::{AssertUnwindSafe, catch_unwind};
use std::sync::atomic::Ordering;
use std::sync::{Arc, Mutex};

use samplerd_sampling::activity::{self, Activity};

use super::{Shared, StepFailure, StepPool, lock, panic_text, stage_of};

/// Where an inline step is, shared by its task and the watchdog.
#[derive(Clone, Copy, PartialEq, Eq)]
enum InlinePhase {
    Running,
    Returned,
    /// Written off: its slot was released and `stuck` counts it.
    Lost,
}

/// An inline step's state, seen by the watchdog.
struct InlineStep {
    activity: Arc<Activity>,
    phase: Mutex<InlinePhase>,
}

impl StepPool {
    /// Whether this step may run inline: on a multi-threaded runtime, with
    /// fewer steps already inline than the pool has live threads (so inline
    /// steps use no more cores than the pool would, and none once every
    /// thread is lost), and the slot taken if so.
    pub(super) fn take_inline_slot(&self) -> bool {
        let multi_thread = tokio::runtime::Handle::try_current()
            .is_ok_and(|h| h.runtime_flavor() == tokio::runtime::RuntimeFlavor::MultiThread);
        multi_thread
            && self
                .shared
                .inline
                .fetch_update(Ordering::AcqRel, Ordering::Acquire, |n| {
                    (n < self.shared.live.load(Ordering::Acquire)).then_some(n + 1)
                })
                .is_ok()
    }

    /// Runs `f` on this runtime thread, which first hands its other work to
    /// another runtime thread (`tokio::task::block_in_place`), under the
    /// same watchdog as a pool step. Holds an inline slot (taken by
    /// [`StepPool::take_inline_slot`]) until the step returns or is written
    /// off.
    ///
    /// Why: the request's logits were just read into this thread's cache,
    /// and no other thread has to be woken or spun for the step. The pool's
    /// hand-off (a second thread reading the cold 600 KB; two spinners on a
    /// 2-core machine) cost ~0.07× the transport floor per 151,936-logit
    /// `Sample` and ~6 % of the `SampleStream` rate more than this path
    /// (docs/PERFORMANCE.md, "gRPC round trips"). The step runs in its
    /// own task, so the caller keeps its timer: a step that never returns
    /// holds one written-off thread, never the runtime.
    pub(super) async fn run_inline<F, R>(&self, f: F) -> Result<R, StepFailure>
    where
        F: FnOnce() -> R + Send + 'static,
        R: Send + 'static,
    {
        let step_state = Arc::new(InlineStep {
            activity: Activity::new(),
            phase: Mutex::new(InlinePhase::Running),
        });
        let watched = Arc::clone(&step_state);
        let shared = Arc::clone(&self.shared);
        let mut step = tokio::spawn(async move {
            tokio::task::block_in_place(move || {
                crate::app::crash::prepare_this_thread();
                activity::watch_this_thread(Arc::clone(&watched.activity));
                shared.running.fetch_add(1, Ordering::AcqRel);
                let r = catch_unwind(AssertUnwindSafe(f))
                    .map_err(|p| StepFailure::Panicked(panic_text(&*p).to_string()));
                shared.running.fetch_sub(1, Ordering::AcqRel);
                activity::unwatch_this_thread();
                let mut phase = lock(&watched.phase);
                if *phase == InlinePhase::Lost {
                    shared.count_returned();
                    let rejoined = rejoin(&shared);
                    tracing::warn!(rejoined, "a written-off sampling step returned");
                } else {
                    *phase = InlinePhase::Returned;
                    shared.inline.fetch_sub(1, Ordering::AcqRel);
                }
                r
            })
        });
        match tokio::time::timeout(self.shared.config.max_step, &mut step).await {
            Ok(Ok(r)) => r,
            Ok(Err(e)) => Err(StepFailure::Panicked(e.to_string())),
            Err(_) => {
                let stage = stage_of(&step_state.activity);
                let returned = {
                    let mut phase = lock(&step_state.phase);
                    let returned = *phase == InlinePhase::Returned;
                    if !returned {
                        *phase = InlinePhase::Lost;
                    }
                    returned
                };
                if returned {
                    // It returned as the budget ran out.
                    return step
                        .await
                        .unwrap_or_else(|e| Err(StepFailure::Panicked(e.to_string())));
                }
                self.write_off_inline(&stage);
                Err(StepFailure::Stuck {
                    stage,
                    budget_ms: self.shared.config.max_step.as_millis(),
                })
            }
        }
    }

    /// An inline step overran: its thread is written off (the runtime
    /// already works on without it) and its slot goes to the next step —
    /// while at most `max_stuck` threads are lost. Past that it counts as
    /// a lost pool thread that is not replaced: one pool thread retires,
    /// so the pool (and the inline slots, which follow its live threads)
    /// shrink exactly as they would had the step run on the pool.
    fn write_off_inline(&self, stage: &str) {
        let shared = &self.shared;
        let stuck = self.count_lost(stage);
        shared.inline.fetch_sub(1, Ordering::AcqRel);
        let replaced = stuck <= shared.config.max_stuck;
        if !replaced
            && shared
                .live
                .fetch_update(Ordering::AcqRel, Ordering::Acquire, |n| n.checked_sub(1))
                .is_ok()
        {
            shared.retire.fetch_add(1, Ordering::AcqRel);
            let _queue = lock(&shared.queue);
            shared.wake.notify_all();
        }
        self.report_lost(stage, stuck, replaced);
    }
}

/// A written-off inline step came back: the pool gets a thread back if it
/// is short of one (a retirement not yet taken is called off, else a new
/// thread starts), as a returning pool thread rejoins. Whether it did.
fn rejoin(shared: &Arc<Shared>) -> bool {
    let short = shared
        .live
        .fetch_update(Ordering::AcqRel, Ordering::Acquire, |n| {
            (n < shared.threads).then_some(n + 1)
        })
        .is_ok();
    if short && !shared.take_retirement() {
        // `spawn_worker` counts the thread itself.
        shared.live.fetch_sub(1, Ordering::AcqRel);
        return super::spawn_worker(shared).is_ok();
    }
    short
}
