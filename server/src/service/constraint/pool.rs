//! The compile pool: where grammars compile, never on a sampling thread.
//!
//! At most `limits.constraint_compile_threads` compiles run at once, each
//! on a thread of its own started for it (or for the queue behind it) with
//! a stack sized for the configured grammar limits ([`super::stack_bytes`]):
//! a thread that finds the queue empty exits, so the large stack a deep
//! grammar touched goes back to the system instead of staying resident in
//! an idle pool thread. Behind the running compiles wait at most
//! `limits.constraint_compile_queue` more; one more is refused at once
//! ([`Full`]), so a burst of hostile grammars costs the queue, not the
//! callers' threads. A queued compile whose deadline passed before a thread
//! took it is dropped unrun.
//!
//! A compile cannot be stopped from outside (it is plugin code): one that
//! overran its budget keeps its thread until it returns — the thread count
//! is the bound on the CPU compiles can take — while its caller has long
//! had its answer. llguidance's own work limits (the stage's `max_fuel`,
//! grammar size, lexer states) are what end it.

#![forbid(unsafe_code)]

use std::collections::VecDeque;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};
use std::time::Instant;

/// Prometheus gauge: compiles running now.
pub const RUNNING_METRIC: &str = "samplerd_constraint_compiles_running";
/// Prometheus gauge: compiles waiting for a thread.
pub const QUEUED_METRIC: &str = "samplerd_constraint_compiles_queued";

type Job = Box<dyn FnOnce() + Send>;

/// The queue was full: the job was not taken.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Full;

struct Queued {
    job: Job,
    /// Dropped unrun when a thread reaches it after this.
    deadline: Instant,
}

struct State {
    running: usize,
    queue: VecDeque<Queued>,
}

struct Inner {
    threads: usize,
    queue_cap: usize,
    stack: usize,
    state: Mutex<State>,
    /// Jobs dropped unrun (deadline passed in the queue), for tests.
    expired: AtomicUsize,
}

/// The pool (cheap to clone).
#[derive(Clone)]
pub struct CompilePool {
    inner: Arc<Inner>,
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(PoisonError::into_inner)
}

impl CompilePool {
    /// `threads` compiles at once (at least one), `queue` more waiting,
    /// each thread with `stack` bytes of stack.
    pub fn new(threads: usize, queue: usize, stack: usize) -> Self {
        metrics::gauge!(RUNNING_METRIC).set(0.0);
        metrics::gauge!(QUEUED_METRIC).set(0.0);
        CompilePool {
            inner: Arc::new(Inner {
                threads: threads.max(1),
                queue_cap: queue,
                stack,
                state: Mutex::new(State {
                    running: 0,
                    queue: VecDeque::new(),
                }),
                expired: AtomicUsize::new(0),
            }),
        }
    }

    /// The stack each compile thread gets, in bytes.
    pub fn stack_bytes(&self) -> usize {
        self.inner.stack
    }

    /// Compiles running now.
    pub fn running(&self) -> usize {
        lock(&self.inner.state).running
    }

    /// Queued jobs dropped unrun because their deadline passed.
    pub fn expired(&self) -> usize {
        self.inner.expired.load(Ordering::Relaxed)
    }

    /// Runs `job` on a compile thread: at once when one is free, else
    /// after the jobs queued before it if a thread reaches it before
    /// `deadline` (else never). [`Full`] when the queue is full.
    pub fn submit(
        &self,
        deadline: Instant,
        job: impl FnOnce() + Send + 'static,
    ) -> Result<(), Full> {
        let inner = &self.inner;
        let job: Job = Box::new(job);
        let mut st = lock(&inner.state);
        if st.running < inner.threads {
            st.running += 1;
            metrics::gauge!(RUNNING_METRIC).set(st.running as f64);
            drop(st);
            let pool = Arc::clone(inner);
            let spawned = std::thread::Builder::new()
                .name("samplerd-compile".into())
                .stack_size(inner.stack)
                .spawn(move || work(&pool, job));
            if let Err(e) = spawned {
                // Out of threads or memory: the job is refused like a full
                // queue (it is dropped with the closure).
                tracing::error!(error = %e, "cannot start a constraint compile thread");
                let mut st = lock(&inner.state);
                st.running -= 1;
                metrics::gauge!(RUNNING_METRIC).set(st.running as f64);
                return Err(Full);
            }
            return Ok(());
        }
        if st.queue.len() >= inner.queue_cap {
            return Err(Full);
        }
        st.queue.push_back(Queued { job, deadline });
        metrics::gauge!(QUEUED_METRIC).set(st.queue.len() as f64);
        Ok(())
    }
}

/// A compile thread: its first job, then the queue's until it is empty.
fn work(inner: &Inner, first: Job) {
    // A plugin crash here is reported like one on a sampling thread.
    crate::crash::prepare_this_thread();
    let mut job = first;
    loop {
        job();
        let mut st = lock(&inner.state);
        let next = loop {
            match st.queue.pop_front() {
                Some(q) if q.deadline <= Instant::now() => {
                    inner.expired.fetch_add(1, Ordering::Relaxed);
                    // Dropped unrun: its reply channel closes, and its
                    // caller has already answered.
                    drop(q);
                }
                other => break other,
            }
        };
        metrics::gauge!(QUEUED_METRIC).set(st.queue.len() as f64);
        match next {
            Some(q) => job = q.job,
            None => {
                st.running -= 1;
                metrics::gauge!(RUNNING_METRIC).set(st.running as f64);
                return;
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::mpsc;
    use std::time::Duration;

    const WAIT: Duration = Duration::from_secs(10);

    #[test]
    fn runs_at_most_threads_at_once_queues_then_refuses() {
        let pool = CompilePool::new(1, 1, 1 << 20);
        let far = Instant::now() + WAIT;
        let (hold_tx, hold_rx) = mpsc::channel::<()>();
        let (done_tx, done_rx) = mpsc::channel();
        let d = done_tx.clone();
        pool.submit(far, move || {
            hold_rx.recv_timeout(WAIT).unwrap();
            d.send(1).unwrap();
        })
        .unwrap();
        let d = done_tx.clone();
        pool.submit(far, move || d.send(2).unwrap()).unwrap();
        assert_eq!(pool.submit(far, || {}), Err(Full));
        assert_eq!(pool.running(), 1);
        hold_tx.send(()).unwrap();
        assert_eq!(done_rx.recv_timeout(WAIT).unwrap(), 1);
        assert_eq!(done_rx.recv_timeout(WAIT).unwrap(), 2);
    }

    #[test]
    fn a_queued_job_past_its_deadline_is_dropped_unrun() {
        let pool = CompilePool::new(1, 4, 1 << 20);
        let (hold_tx, hold_rx) = mpsc::channel::<()>();
        let (done_tx, done_rx) = mpsc::channel();
        pool.submit(Instant::now() + WAIT, move || {
            hold_rx.recv_timeout(WAIT).unwrap();
        })
        .unwrap();
        let d = done_tx.clone();
        pool.submit(Instant::now(), move || d.send("expired").unwrap())
            .unwrap();
        let d = done_tx.clone();
        pool.submit(Instant::now() + WAIT, move || d.send("ran").unwrap())
            .unwrap();
        hold_tx.send(()).unwrap();
        assert_eq!(done_rx.recv_timeout(WAIT).unwrap(), "ran");
        assert_eq!(pool.expired(), 1);
    }

    #[test]
    fn compile_threads_have_the_configured_stack() {
        // 64 MiB: a recursion that needs ~32 MiB would overflow 2 MiB.
        let pool = CompilePool::new(1, 0, 64 << 20);
        fn deep(n: usize) -> usize {
            let pad = std::hint::black_box([n as u8; 1024]);
            if n == 0 {
                0
            } else {
                deep(n - 1) + pad[0] as usize % 2
            }
        }
        let (tx, rx) = mpsc::channel();
        pool.submit(Instant::now() + WAIT, move || {
            tx.send(deep(32 * 1024)).unwrap()
        })
        .unwrap();
        rx.recv_timeout(WAIT).unwrap();
    }
}
