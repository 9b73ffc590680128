//! The drain: the admission gate and in-flight counter that the request
//! layer (`metrics::ObserveRpc`) consults for every Sampler RPC. Once
//! draining starts, new RPCs are refused with UNAVAILABLE
//! ([`SHUTTING_DOWN_MESSAGE`]) and [`Drain::wait_idle`] resolves when the
//! last admitted one ends; connections then get [`CLOSE_TIMEOUT`] to close.

#![forbid(unsafe_code)]

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::time::Duration;

use tokio::sync::Notify;

/// After the drain, how long connections get to close (GOAWAY handshake,
/// health Watch streams that never end on their own) before they are cut.
pub const CLOSE_TIMEOUT: Duration = Duration::from_secs(1);
/// Message of the UNAVAILABLE status refused requests get.
pub const SHUTTING_DOWN_MESSAGE: &str = "samplerd is shutting down: retry on another replica";

/// Admission gate and in-flight counter for the RPCs that drain.
#[derive(Debug, Default)]
pub struct Drain {
    draining: AtomicBool,
    in_flight: AtomicUsize,
    idle: Notify,
}

/// One admitted request; counted in flight until dropped (the end of its
/// response body, or the client going away).
#[derive(Debug)]
pub struct InFlight(Arc<Drain>);

impl Drop for InFlight {
    fn drop(&mut self) {
        if self.0.in_flight.fetch_sub(1, Ordering::SeqCst) == 1 {
            self.0.idle.notify_waiters();
        }
    }
}

impl Drain {
    pub fn new() -> Arc<Self> {
        Arc::new(Drain::default())
    }

    /// Admits a request, or `None` once draining has started.
    pub fn admit(self: &Arc<Self>) -> Option<InFlight> {
        // Count first, then check: with `start` storing the flag before it
        // reads the count (both SeqCst), a request is either refused here or
        // seen by `wait_idle`.
        self.in_flight.fetch_add(1, Ordering::SeqCst);
        let guard = InFlight(self.clone());
        if self.draining.load(Ordering::SeqCst) {
            return None; // dropping `guard` uncounts it
        }
        Some(guard)
    }

    /// Starts draining: every later `admit` is refused.
    pub fn start(&self) {
        self.draining.store(true, Ordering::SeqCst);
    }

    pub fn is_draining(&self) -> bool {
        self.draining.load(Ordering::SeqCst)
    }

    /// Requests admitted and not yet finished.
    pub fn in_flight(&self) -> usize {
        self.in_flight.load(Ordering::SeqCst)
    }

    /// Resolves once nothing is in flight.
    pub async fn wait_idle(&self) {
        loop {
            let notified = self.idle.notified();
            tokio::pin!(notified);
            // Registered before the check, so a release in between wakes us.
            notified.as_mut().enable();
            if self.in_flight() == 0 {
                return;
            }
            notified.await;
        }
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::*;

    #[tokio::test]
    async fn admit_is_refused_after_start_and_idle_waits_for_guards() {
        let d = Drain::new();
        let a = d.admit().expect("admitted before draining");
        assert_eq!(d.in_flight(), 1);
        d.start();
        assert!(d.admit().is_none());
        assert_eq!(d.in_flight(), 1, "a refused request is not counted");
        let waiter = {
            let d = d.clone();
            tokio::spawn(async move { d.wait_idle().await })
        };
        tokio::task::yield_now().await;
        assert!(!waiter.is_finished());
        drop(a);
        tokio::time::timeout(Duration::from_secs(5), waiter)
            .await
            .expect("idle once the last request ends")
            .unwrap();
    }
}
