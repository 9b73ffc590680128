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
//!
//! Separately, for a fatal-signal handler on the same thread (the server's
//! crash report): every plugin call records its [`CallSite`] (the stage and
//! library names, static and NUL-terminated) in a thread-local pointer for
//! the duration of the call — loading a library too, its path standing in
//! for the library and no stage ([`CallSite::loading`]) — and the server records the request a thread
//! is serving ([`set_request`]). Both are plain thread-local words (no
//! allocation, no lock, no lazy initialisation, no destructor), so
//! [`crash_context`] may be read from a signal handler: two stores per
//! call on the hot path.

use std::cell::RefCell;
use std::ffi::CStr;
use std::sync::atomic::{AtomicPtr, AtomicU64, Ordering};
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
    // Atomics only so that a signal handler on this thread reads whole
    // words; Relaxed is enough, no other thread ever looks.
    static IN_CALL: AtomicPtr<CallSite> = const { AtomicPtr::new(std::ptr::null_mut()) };
    static REQUEST: AtomicU64 = const { AtomicU64::new(0) };
}

/// A stage as a crash report names it: both strings live for the process
/// (the stage name is the plugin's static string — libraries are never
/// unloaded — and the file name is leaked once per library).
#[derive(Debug)]
pub struct CallSite {
    pub stage: &'static CStr,
    pub library: &'static CStr,
}

impl CallSite {
    /// A call site that lives for the process (one per registered stage).
    pub fn leak(stage: &'static CStr, library: &'static CStr) -> &'static CallSite {
        Box::leak(Box::new(CallSite { stage, library }))
    }

    /// The site of loading `library` (its path): its initialisers and
    /// entry point run before it has any stage, so the stage is empty.
    /// Each one is also kept in a process-wide list: after the load
    /// returns nothing else points at it, and memory that is leaked on
    /// purpose must stay reachable or LeakSanitizer (the fuzz targets run
    /// under it) reports it as a leak.
    pub fn loading(library: &'static CStr) -> &'static CallSite {
        static LOADED: Mutex<Vec<&'static CallSite>> = Mutex::new(Vec::new());
        let site = Self::leak(c"", library);
        LOADED
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .push(site);
        site
    }

    /// Whether this is a library being loaded rather than a stage's call.
    pub fn is_loading(&self) -> bool {
        self.stage.is_empty()
    }
}

/// Runs `f` (a call into plugin code) with `site` recorded as this
/// thread's current plugin call.
#[inline(always)]
pub(crate) fn in_plugin<R>(site: &'static CallSite, f: impl FnOnce() -> R) -> R {
    /// Clears the record even if `f` unwinds.
    struct Leave;
    impl Drop for Leave {
        #[inline(always)]
        fn drop(&mut self) {
            IN_CALL.with(|c| c.store(std::ptr::null_mut(), Ordering::Relaxed));
        }
    }
    IN_CALL.with(|c| c.store(std::ptr::from_ref(site).cast_mut(), Ordering::Relaxed));
    let _leave = Leave;
    f()
}

/// Records that this thread now serves request `id` (0: none), for the
/// crash report. The server sets it before each step it runs.
#[inline]
pub fn set_request(id: u64) {
    REQUEST.with(|r| r.store(id, Ordering::Relaxed));
}

/// [`set_request`] until the guard drops (then back to none).
#[inline]
pub fn serving(id: u64) -> Serving {
    set_request(id);
    Serving(())
}

/// Returned by [`serving`]: clears the request when dropped.
#[must_use = "the request is cleared when this guard drops"]
pub struct Serving(());

impl Drop for Serving {
    fn drop(&mut self) {
        set_request(0);
    }
}

/// The plugin call this thread is in (if any) and the request it serves
/// (0: none). Async-signal-safe: two thread-local loads of words this
/// crate's own (statically linked, const-initialised) thread-locals hold.
#[inline]
pub fn crash_context() -> (Option<&'static CallSite>, u64) {
    let site = IN_CALL.with(|c| c.load(Ordering::Relaxed));
    // SAFETY: the pointer is NULL or came from a `&'static CallSite`.
    let site = unsafe { site.as_ref() };
    (site, REQUEST.with(|r| r.load(Ordering::Relaxed)))
}

/// Makes every later plugin call on this thread record its stage in
/// `activity`.
pub fn watch_this_thread(activity: Arc<Activity>) {
    WATCHED.with(|w| *w.borrow_mut() = Some(activity));
}

/// Stops recording plugin calls on this thread (a runtime thread that ran
/// one step inline goes back to other work).
pub fn unwatch_this_thread() {
    WATCHED.with(|w| *w.borrow_mut() = None);
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
    fn a_plugin_call_and_the_request_are_recorded_for_the_crash_report() {
        let site = CallSite::leak(c"crash", c"libcrash.so");
        std::thread::spawn(move || {
            assert!(crash_context().0.is_none());
            let _serving = serving(17);
            let inside = in_plugin(site, crash_context);
            assert_eq!(inside.0.unwrap().stage, c"crash");
            assert_eq!(inside.0.unwrap().library, c"libcrash.so");
            assert_eq!(inside.1, 17);
            assert!(crash_context().0.is_none(), "cleared after the call");
            drop(_serving);
            assert_eq!(crash_context().1, 0);
        })
        .join()
        .unwrap();
    }

    #[test]
    fn an_unwatched_thread_records_nothing() {
        let activity = Activity::new();
        entering(&Arc::from("top_k"));
        assert_eq!(activity.current(), None);
    }
}
