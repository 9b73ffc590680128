//! Which stage a thread is running right now, readable from another thread:
//! the sampling pool's watchdog names the stage of a step that overran
//! `limits.max_step_ms` without stopping (or trusting) the stuck thread.
//!
//! A pool worker registers one [`Activity`] for itself
//! ([`watch_this_thread`]); every plugin call the chain makes on that thread
//! (`apply`, `accept`, state creation) first records the stage's name there.
//! Threads that registered nothing (benchmarks, tests, the fuzzer) pay one
//! thread-local read per call. On a watched thread a call costs an
//! uncontended lock and, when the stage changes, one reference-count bump:
//! ~30 ns against a step of 50–100 µs.

use std::cell::RefCell;
use std::sync::{Arc, Mutex, PoisonError};

/// The stage a watched thread is in (or was last in), shared with its
/// watchdog.
#[derive(Debug, Default)]
pub struct Activity {
    stage: Mutex<Option<Arc<str>>>,
}

impl Activity {
    pub fn new() -> Arc<Self> {
        Arc::new(Activity::default())
    }

    /// The stage the thread entered last since [`Activity::clear`].
    pub fn current(&self) -> Option<Arc<str>> {
        self.stage
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .clone()
    }

    /// Forgets the stage (the thread finished its step).
    pub fn clear(&self) {
        *self.stage.lock().unwrap_or_else(PoisonError::into_inner) = None;
    }

    fn enter(&self, stage: &Arc<str>) {
        let mut current = self.stage.lock().unwrap_or_else(PoisonError::into_inner);
        if !current.as_ref().is_some_and(|c| Arc::ptr_eq(c, stage)) {
            *current = Some(Arc::clone(stage));
        }
    }
}

thread_local! {
    static WATCHED: RefCell<Option<Arc<Activity>>> = const { RefCell::new(None) };
}

/// Makes every later plugin call on this thread record its stage in
/// `activity`.
pub fn watch_this_thread(activity: Arc<Activity>) {
    WATCHED.with(|w| *w.borrow_mut() = Some(activity));
}

/// Records that this thread is about to call into `stage` (the chain does
/// this before every plugin call; other work on a watched thread, such as
/// tokenizing a prompt, names itself the same way).
pub fn entering(stage: &Arc<str>) {
    WATCHED.with(|w| {
        if let Some(a) = w.borrow().as_ref() {
            a.enter(stage);
        }
    });
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_watched_thread_reports_its_stage_to_another_thread() {
        let activity = Activity::new();
        let seen = Arc::clone(&activity);
        let name: Arc<str> = Arc::from("sleepy");
        std::thread::spawn(move || {
            watch_this_thread(seen);
            entering(&name);
        })
        .join()
        .unwrap();
        assert_eq!(activity.current().as_deref(), Some("sleepy"));
        activity.clear();
        assert_eq!(activity.current(), None);
    }

    #[test]
    fn an_unwatched_thread_records_nothing() {
        let activity = Activity::new();
        entering(&Arc::from("top_k"));
        assert_eq!(activity.current(), None);
    }
}
