//! Admission to the model host: at most `generate.max_concurrent_generations`
//! generations run, at most `generate.max_queued_generations` wait (their
//! number in a gauge), and a waiting request whose client goes away leaves
//! the queue within [`QUEUE_POLL`].

#![forbid(unsafe_code)]

use std::sync::{Condvar, Mutex};
use std::time::Duration;

use crate::request::errors::RequestError;
use crate::status::Reason;

/// Gauge: Generate requests waiting for a generation slot.
pub const GENERATE_QUEUE_DEPTH_METRIC: &str = "samplerd_generate_queue_depth";
/// How often a queued request checks whether its client went away.
const QUEUE_POLL: Duration = Duration::from_millis(50);

/// Counting semaphore with a bounded wait queue, for blocking threads.
pub(super) struct Slots {
    state: Mutex<(usize, usize)>, // (running, waiting)
    freed: Condvar,
    max_running: usize,
    max_waiting: usize,
}

/// A held generation slot; released on drop.
pub(super) struct Slot<'a>(&'a Slots);

impl Drop for Slot<'_> {
    fn drop(&mut self) {
        let mut s = self.0.state.lock().unwrap_or_else(|e| e.into_inner());
        s.0 -= 1;
        self.0.freed.notify_one();
    }
}

impl Slots {
    pub(super) fn new(max_running: usize, max_waiting: usize) -> Self {
        Slots {
            state: Mutex::new((0, 0)),
            freed: Condvar::new(),
            max_running: max_running.max(1),
            max_waiting,
        }
    }

    /// Waits for a slot; `None` if the queue is full or `gone()` turns true.
    pub(super) fn acquire(
        &self,
        gone: impl Fn() -> bool,
    ) -> Result<Option<Slot<'_>>, RequestError> {
        let mut s = self.state.lock().unwrap_or_else(|e| e.into_inner());
        if s.0 < self.max_running {
            s.0 += 1;
            return Ok(Some(Slot(self)));
        }
        if s.1 >= self.max_waiting {
            return Err(RequestError::exhausted(
                Reason::Overloaded,
                "generate.max_queued_generations",
                format!(
                    "{} generations running and {} queued (generate.max_concurrent_generations, \
                     generate.max_queued_generations): try again later",
                    s.0, s.1
                ),
            ));
        }
        s.1 += 1;
        metrics::gauge!(GENERATE_QUEUE_DEPTH_METRIC).set(s.1 as f64);
        loop {
            let (guard, _) = self
                .freed
                .wait_timeout(s, QUEUE_POLL)
                .unwrap_or_else(|e| e.into_inner());
            s = guard;
            if s.0 < self.max_running {
                s.1 -= 1;
                metrics::gauge!(GENERATE_QUEUE_DEPTH_METRIC).set(s.1 as f64);
                s.0 += 1;
                return Ok(Some(Slot(self)));
            }
            if gone() {
                s.1 -= 1;
                metrics::gauge!(GENERATE_QUEUE_DEPTH_METRIC).set(s.1 as f64);
                return Ok(None);
            }
        }
    }
}
