//! Keeps the runtime's sockets and timers driven while a step runs on a
//! runtime worker itself (no `block_in_place`).
//!
//! Why: tokio polls sockets and timers from whichever worker parks on its
//! driver. A worker woken from the driver by one request, which then runs
//! that request's step itself, leaves nobody parked there when the other
//! workers sleep on their condition variable — tokio wakes another worker
//! only when one has more than one task queued. A step that did not return
//! then froze every connection and every timer, the step's own watchdog
//! included: a stage stuck for 60 s was answered after 60 s, not after
//! `limits.max_step_ms` = 1 s (`tests/stuck_stage.rs`, the SIGTERM test,
//! 2 of 3 runs on a 2-core machine).
//!
//! The nudger is one thread that, while steps run on workers, looks every
//! [`TICK`]: when the same steps are still running a tick later, it spawns
//! an empty task from outside the runtime. For a task from outside, tokio
//! wakes a sleeping worker, which finds nothing else to do and parks on the
//! driver. Steps shorter than a tick (nearly all: ~0.1 ms at 151,936
//! logits) cost nothing, and the nudge's wake-up is paid on the nudger's
//! thread, not the step's. After [`IDLE`] without such steps it sleeps
//! until the next one.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex, OnceLock, Weak};
use std::time::Duration;

use super::{Shared, lock};

/// How often the nudger looks while steps run on workers: a stuck step
/// delays other connections by at most two ticks (the health probe allows
/// 100 ms in the tests), and the ticks cost ~200 wake-ups a second only
/// while steps are running on workers.
const TICK: Duration = Duration::from_millis(5);
/// The nudger sleeps after this long without a step on a worker.
const IDLE: Duration = Duration::from_secs(1);

#[derive(Default)]
pub(super) struct Nudger {
    /// Steps started on workers, ever (tells the nudger whether the ones
    /// running now are the ones it saw a tick ago).
    started: AtomicU64,
    /// The nudger waits on `wake` (and must be woken for the next step).
    sleeping: AtomicBool,
    sleep: Mutex<()>,
    wake: Condvar,
    /// The runtime the steps run on, and the nudger's thread, from the
    /// first step on a worker.
    runtime: OnceLock<tokio::runtime::Handle>,
}

impl Nudger {
    /// A step is about to run on a runtime worker of `runtime`.
    pub(super) fn step_starts(shared: &Arc<Shared>, runtime: &tokio::runtime::Handle) {
        let n = &shared.nudger;
        if n.runtime.get().is_none() && n.runtime.set(runtime.clone()).is_ok() {
            let weak = Arc::downgrade(shared);
            // Without the thread steps still run (and block_in_place is
            // the fallback of a lost step); log it and go on.
            if let Err(e) = std::thread::Builder::new()
                .name("samplerd-nudge".into())
                .spawn(move || run(weak))
            {
                tracing::error!(error = %e, "could not start the runtime nudger thread");
            }
        }
        // SeqCst on both sides: this increment and the nudger's `sleeping`
        // store are each seen by the other's load (no missed wake-up).
        n.started.fetch_add(1, Ordering::SeqCst);
        if n.sleeping.load(Ordering::SeqCst) {
            let _g = lock(&n.sleep);
            n.wake.notify_one();
        }
    }

    /// The pool is closing: the nudger leaves.
    pub(super) fn close(&self) {
        let _g = lock(&self.sleep);
        self.wake.notify_all();
    }
}

fn run(weak: Weak<Shared>) {
    let mut seen = u64::MAX;
    let mut nudged = u64::MAX;
    let mut idle = Duration::ZERO;
    loop {
        std::thread::sleep(TICK);
        let Some(shared) = weak.upgrade() else { return };
        if lock(&shared.queue).closed {
            return;
        }
        let n = &shared.nudger;
        let started = n.started.load(Ordering::SeqCst);
        if shared.direct.load(Ordering::Acquire) > 0 {
            idle = Duration::ZERO;
            // No step has started on a worker for a whole tick while one
            // runs: nobody may be driving the runtime. One nudge is
            // enough (the woken worker parks on the driver and stays
            // there while the runtime is idle).
            if started == seen && nudged != started {
                if let Some(rt) = n.runtime.get() {
                    rt.spawn(async {});
                }
                nudged = started;
            }
        } else {
            idle += TICK;
            if idle >= IDLE {
                let g = lock(&n.sleep);
                n.sleeping.store(true, Ordering::SeqCst);
                if n.started.load(Ordering::SeqCst) == started && !lock(&shared.queue).closed {
                    // Woken by the next step on a worker, or by close.
                    drop(n.wake.wait(g).unwrap_or_else(|p| p.into_inner()));
                }
                n.sleeping.store(false, Ordering::SeqCst);
                idle = Duration::ZERO;
            }
        }
        seen = started;
    }
}
