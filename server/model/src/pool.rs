//! A small persistent thread pool for the forward pass.
//!
//! Decode runs ~150 parallel matrix×vector products per token, each a few
//! microseconds long, so waking threads through the OS for every product would
//! cost more than the product itself. Workers therefore spin on a generation
//! counter for a short while (~2 ms) after each job and only then park on a
//! condition variable. A job is a closure called once per thread with
//! `(thread_index, n_threads)`; the caller's thread is index 0 and takes part.
//!
//! The pool runs one job at a time. When another session is already using it
//! (concurrent sequences on different server threads), [`ThreadPool::run`] runs
//! every part of the job inline on the calling thread instead of waiting, so
//! concurrent sequences each get one core rather than serialising.

use std::cell::UnsafeCell;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Condvar, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

type Job = dyn Fn(usize, usize) + Sync;

const SPIN_FOR: Duration = Duration::from_millis(2);

struct Shared {
    generation: AtomicU64,
    /// The current job; written by the runner before bumping `generation`
    /// (Release) and read by workers after observing the bump (Acquire).
    job: UnsafeCell<*const Job>,
    remaining: AtomicUsize,
    shutdown: AtomicBool,
    sleepers: AtomicUsize,
    lock: Mutex<()>,
    cv: Condvar,
    n_threads: usize,
}

// SAFETY: `job` is only written by the thread holding `ThreadPool::busy`, while
// no worker is reading it (all workers finished the previous generation, which
// the runner waited for), and only read by workers between observing a new
// generation and decrementing `remaining`. All other fields are atomics or
// sync primitives.
unsafe impl Sync for Shared {}
// SAFETY: see above; the raw pointer is only dereferenced under that protocol.
unsafe impl Send for Shared {}

/// Persistent worker threads (see the module docs).
pub struct ThreadPool {
    shared: Arc<Shared>,
    busy: Mutex<()>,
    handles: Vec<JoinHandle<()>>,
}

impl std::fmt::Debug for ThreadPool {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ThreadPool")
            .field("n_threads", &self.shared.n_threads)
            .finish()
    }
}

fn noop(_: usize, _: usize) {}

impl ThreadPool {
    /// A pool with `n_threads` threads in all (the caller plus `n_threads - 1`
    /// workers); `0` means the number of available CPUs.
    pub fn new(n_threads: usize) -> Self {
        let n = if n_threads == 0 {
            std::thread::available_parallelism()
                .map(|n| n.get())
                .unwrap_or(1)
        } else {
            n_threads
        };
        let noop_ref: &Job = &noop;
        let shared = Arc::new(Shared {
            generation: AtomicU64::new(0),
            job: UnsafeCell::new(noop_ref as *const Job),
            remaining: AtomicUsize::new(0),
            shutdown: AtomicBool::new(false),
            sleepers: AtomicUsize::new(0),
            lock: Mutex::new(()),
            cv: Condvar::new(),
            n_threads: n,
        });
        let handles = (1..n)
            .map(|idx| {
                let shared = Arc::clone(&shared);
                std::thread::Builder::new()
                    .name(format!("samplerd-model-{idx}"))
                    .spawn(move || worker(shared, idx))
                    .expect("spawning a forward-pass worker thread")
            })
            .collect();
        ThreadPool {
            shared,
            busy: Mutex::new(()),
            handles,
        }
    }

    /// Threads a job is split over.
    pub fn n_threads(&self) -> usize {
        self.shared.n_threads
    }

    /// Calls `f(rows, part)` over `out` taken as rows of `row_len` values:
    /// split into one part per thread when there are at least `min_rows`
    /// rows (a prompt: the per-row work between the weight products would
    /// otherwise run on one thread while the others wait), else as one call
    /// here (a decode step's few rows are cheaper than the hand-off).
    pub fn for_rows<T: Send>(
        &self,
        out: &mut [T],
        row_len: usize,
        min_rows: usize,
        f: &(dyn Fn(std::ops::Range<usize>, &mut [T]) + Sync),
    ) {
        let n = out.len() / row_len;
        if n < min_rows.max(2) || self.n_threads() == 1 {
            f(0..n, out);
            return;
        }
        struct Parts<T>(*mut T);
        // SAFETY: each thread gets a disjoint part of `out` (below).
        unsafe impl<T: Send> Sync for Parts<T> {}
        let parts = Parts(out.as_mut_ptr());
        self.run(&|i, nt| {
            let parts = &parts;
            let r = split_range(n, i, nt, 1);
            // SAFETY: `split_range` partitions `0..n`, so the parts are
            // disjoint and inside `out`, which outlives `run`.
            let part = unsafe {
                std::slice::from_raw_parts_mut(parts.0.add(r.start * row_len), r.len() * row_len)
            };
            f(r, part);
        });
    }

    /// Calls `f(i, n)` for every `i in 0..n` (n = [`Self::n_threads`]), in
    /// parallel when the pool is free, and returns when all calls returned.
    pub fn run(&self, f: &(dyn Fn(usize, usize) + Sync)) {
        let n = self.shared.n_threads;
        if n == 1 {
            f(0, 1);
            return;
        }
        let Ok(_busy) = self.busy.try_lock() else {
            for i in 0..n {
                f(i, n);
            }
            return;
        };
        let s = &*self.shared;
        // SAFETY: we hold `busy`, and the previous job's workers all finished
        // (we waited for `remaining == 0`), so no one reads `job` now. The
        // lifetime is erased, but `f` outlives its use: we do not return until
        // every worker has finished calling it (`remaining == 0` below).
        unsafe {
            let erased: *const Job =
                std::mem::transmute::<*const (dyn Fn(usize, usize) + Sync + '_), *const Job>(f);
            *s.job.get() = erased;
        }
        s.remaining.store(n - 1, Ordering::SeqCst);
        s.generation.fetch_add(1, Ordering::SeqCst);
        if s.sleepers.load(Ordering::SeqCst) > 0 {
            let _g = s.lock.lock().unwrap_or_else(|e| e.into_inner());
            s.cv.notify_all();
        }
        // A panic in our part must not return while workers still use `f`.
        let res = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| f(0, n)));
        let mut spins = 0u32;
        while s.remaining.load(Ordering::Acquire) != 0 {
            spins = spins.wrapping_add(1);
            if spins.is_multiple_of(4096) {
                std::thread::yield_now();
            } else {
                std::hint::spin_loop();
            }
        }
        if let Err(p) = res {
            std::panic::resume_unwind(p);
        }
    }
}

fn worker(shared: Arc<Shared>, idx: usize) {
    let s = &*shared;
    let mut seen = 0u64;
    loop {
        let mut since = Instant::now();
        let mut spins = 0u32;
        loop {
            let g = s.generation.load(Ordering::Acquire);
            if g != seen {
                seen = g;
                break;
            }
            if s.shutdown.load(Ordering::Acquire) {
                return;
            }
            spins = spins.wrapping_add(1);
            if !spins.is_multiple_of(1024) || since.elapsed() < SPIN_FOR {
                std::hint::spin_loop();
                continue;
            }
            let mut g = s.lock.lock().unwrap_or_else(|e| e.into_inner());
            s.sleepers.fetch_add(1, Ordering::SeqCst);
            while s.generation.load(Ordering::SeqCst) == seen && !s.shutdown.load(Ordering::SeqCst)
            {
                g = s.cv.wait(g).unwrap_or_else(|e| e.into_inner());
            }
            s.sleepers.fetch_sub(1, Ordering::SeqCst);
            drop(g);
            since = Instant::now();
        }
        if s.shutdown.load(Ordering::Acquire) {
            return;
        }
        // SAFETY: we observed the new generation with Acquire, which the runner
        // published (Release/SeqCst) after writing `job`; the runner keeps the
        // closure alive until `remaining` reaches zero, which happens only after
        // this call returns.
        let f: &Job = unsafe { &**s.job.get() };
        // A panicking job part must still count as finished or the runner spins forever.
        let _ = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| f(idx, s.n_threads)));
        s.remaining.fetch_sub(1, Ordering::Release);
    }
}

impl Drop for ThreadPool {
    fn drop(&mut self) {
        self.shared.shutdown.store(true, Ordering::SeqCst);
        {
            let _g = self.shared.lock.lock().unwrap_or_else(|e| e.into_inner());
            self.shared.cv.notify_all();
        }
        for h in self.handles.drain(..) {
            let _ = h.join();
        }
    }
}

/// Splits `0..len` into `n` near-equal ranges aligned to `align`; part `i`.
pub fn split_range(len: usize, i: usize, n: usize, align: usize) -> std::ops::Range<usize> {
    let units = len.div_ceil(align);
    let start = (units * i / n * align).min(len);
    let end = (units * (i + 1) / n * align).min(len);
    start..end
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::AtomicUsize;

    #[test]
    fn runs_every_part_once() {
        let pool = ThreadPool::new(3);
        for _ in 0..1000 {
            let hits = AtomicUsize::new(0);
            let mask = AtomicUsize::new(0);
            pool.run(&|i, n| {
                assert_eq!(n, 3);
                hits.fetch_add(1, Ordering::Relaxed);
                mask.fetch_or(1 << i, Ordering::Relaxed);
            });
            assert_eq!(hits.load(Ordering::Relaxed), 3);
            assert_eq!(mask.load(Ordering::Relaxed), 0b111);
        }
    }

    #[test]
    fn split_covers_range() {
        for len in [0, 1, 5, 64, 577] {
            let mut next = 0;
            for i in 0..3 {
                let r = split_range(len, i, 3, 4);
                assert_eq!(r.start, next);
                next = r.end;
            }
            assert_eq!(next, len);
        }
    }
}
