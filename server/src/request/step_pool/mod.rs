//! The step runner: every sampling step (and every other call into plugin
//! code, and prompt tokenization) runs off the async runtime's workers,
//! on this module's pool of threads, under a per-step watchdog.
//!
//! Why: a stage is third-party code. Run on a runtime worker, one that
//! never returned froze the whole process (health, liveness, /metrics,
//! every RPC, SIGTERM), and even a legal 0.9 s step of core stages held
//! health probes up for as long. Here the runtime only waits on a reply.
//!
//! Where a step runs: on a pool thread, always ([`StepPool::run`] for
//! async callers, [`StepPool::run_blocking`], [`StepPool::run_many`]).
//! Running it on the runtime thread that decoded the request, after
//! `tokio::task::block_in_place` had handed that thread's other work to
//! another runtime thread, was tried and measured: it keeps the logits in
//! that thread's cache, but wakes a thread per step, and the hand-off
//! alone cost 30–50 µs where the pool's costs 1–3 µs; over loopback the
//! two were equal within the noise for raw-bytes `Sample` and
//! `SampleStream`, and the pool was faster for repeated-float `Sample`
//! (docs/PERFORMANCE.md, "gRPC round trips"). Running it on the worker
//! itself wakes no thread, but a worker that never comes back strands
//! what only it can run (the task in its LIFO slot and every waker tokio's
//! cooperative budget deferred onto it), so connections froze behind a
//! stuck stage.
//!
//! The watchdog: a step still running after `limits.max_step_ms` fails its
//! request with `DEADLINE_EXCEEDED` naming the stage it is in (from
//! [`samplerd_sampling::activity`]); its caller then releases the
//! request's slot and permits. The stuck thread cannot be stopped (a
//! plugin is native code), so it is written off as lost —
//! `samplerd_stuck_steps_total{stage}` counts it, the log names it — and a
//! fresh thread takes its place, up to `limits.max_stuck_workers` lost
//! threads at once. Past that the pool stops replacing them and reports
//! itself unhealthy ([`StepPool::healthy`]: readiness turns NOT_SERVING so
//! an orchestrator replaces the pod, while liveness stays honest). A lost
//! thread that does come back rejoins the pool if it is short of threads,
//! else it exits.
//!
//! A step waiting in the queue counts against the same budget: when no
//! worker becomes free within `limits.max_step_ms` the request fails with
//! `UNAVAILABLE` and never runs.
//!
//! Hand-off cost on the pool: one idle worker at a time spins for up to [`SPIN`]
//! before it sleeps, so under load (and for a client that sends its next
//! step right away) no thread is woken per step, and waiting costs at most
//! one core for that long.

#![forbid(unsafe_code)]

use std::collections::VecDeque;
use std::panic::{AssertUnwindSafe, catch_unwind};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard, PoisonError, mpsc};
use std::time::{Duration, Instant};

use samplerd_sampling::activity::{self, Activity};
use tonic::Status;

/// Prometheus counter of steps that overran `limits.max_step_ms` while
/// running, label `stage` (the stage they were in).
pub const STUCK_STEPS_METRIC: &str = "samplerd_stuck_steps_total";
/// Prometheus gauge of pool threads lost to steps that have not returned.
pub const LOST_WORKERS_METRIC: &str = "samplerd_sampling_workers_lost";

/// How long an idle worker spins (yielding to any runnable thread) for the
/// next step before it sleeps: about one loopback round trip of a client
/// that sends its next step at once.
pub const SPIN: Duration = Duration::from_micros(250);
/// How long an async caller waits for its step on the runtime worker
/// before it parks: the default chain's step at 151,936 logits takes
/// ~40–50 µs.
pub const REPLY_SPIN: Duration = Duration::from_micros(100);

/// Config: the pool's part of `[limits]`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct StepPoolConfig {
    /// Threads (0: one per CPU).
    pub threads: usize,
    /// A step's budget, queueing included.
    pub max_step: Duration,
    /// Lost threads replaced at once before the pool reports unhealthy.
    pub max_stuck: usize,
}

impl StepPoolConfig {
    /// `threads`, with 0 resolved to the number of CPUs.
    pub fn resolved_threads(&self) -> usize {
        match self.threads {
            0 => std::thread::available_parallelism().map_or(1, |n| n.get()),
            n => n,
        }
    }
}

type Job = Box<dyn FnOnce() + Send>;

/// A submitted step and where its result will come.
type Pending<R> = (
    Arc<Ticket>,
    tokio::sync::oneshot::Receiver<Result<R, StepFailure>>,
);

/// Where a submitted step is.
enum Phase {
    Queued,
    Running(Arc<Worker>),
    Done,
    /// Given up while queued: the worker that pops it skips it.
    Abandoned,
}

/// A step's place in the pool, shared by the submitter and the worker.
struct Ticket {
    phase: Mutex<Phase>,
}

/// One pool thread's state, seen by the watchdog.
struct Worker {
    activity: Arc<Activity>,
    /// Written off by the watchdog: a replacement has been started (or
    /// refused), so this thread leaves or rejoins when its step returns.
    lost: Mutex<bool>,
}

struct Queue {
    jobs: VecDeque<(Job, Arc<Ticket>)>,
    /// No handle is left: idle workers exit.
    closed: bool,
}

struct Shared {
    config: StepPoolConfig,
    threads: usize,
    queue: Mutex<Queue>,
    queued: AtomicUsize,
    /// An idle worker is spinning for the next job (at most one).
    spinning: AtomicBool,
    wake: Condvar,
    /// Threads serving the queue (configured, less lost and not replaced).
    live: AtomicUsize,
    /// Lost threads whose step has not returned.
    stuck: AtomicUsize,
    /// Steps running now (stuck ones included).
    running: AtomicUsize,
}

/// The pool (cheap to clone). When the last clone drops, idle threads
/// exit; a thread still in a step exits when the step returns.
#[derive(Clone)]
pub struct StepPool {
    shared: Arc<Shared>,
    _owner: Arc<Owner>,
}

/// Closes the pool when the last [`StepPool`] drops (the workers hold
/// [`Shared`] themselves, so its count never reaches zero while they run).
struct Owner(Arc<Shared>);

impl Drop for Owner {
    fn drop(&mut self) {
        lock(&self.0.queue).closed = true;
        self.0.wake.notify_all();
    }
}

/// Why a step produced no result.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum StepFailure {
    /// It ran past the budget (`stage`: where it was).
    #[error(
        "the sampling step exceeded limits.max_step_ms = {budget_ms} in stage `{stage}` \
         (it keeps running on a thread the server has written off)"
    )]
    Stuck { stage: String, budget_ms: u128 },
    /// No worker became free within the budget.
    #[error(
        "no sampling worker became free within limits.max_step_ms = {budget_ms} \
         (all {threads} are busy): try again later"
    )]
    NoWorker { budget_ms: u128, threads: usize },
    /// It panicked.
    #[error("sampling task failed: {0}")]
    Panicked(String),
}

impl StepFailure {
    /// The failure with its reason (and the stage, when known).
    pub fn failure(&self) -> crate::status::Failure {
        use crate::status::{Failure, Reason};
        match self {
            StepFailure::Stuck { stage, .. } => {
                Failure::new(Reason::StepStuck, self.to_string()).stage(stage)
            }
            StepFailure::NoWorker { .. } => {
                Failure::new(Reason::NoSamplingThread, self.to_string())
            }
            StepFailure::Panicked(_) => Failure::new(Reason::StepPanicked, self.to_string()),
        }
    }
}

impl From<StepFailure> for Status {
    fn from(f: StepFailure) -> Status {
        f.failure().into_status()
    }
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(PoisonError::into_inner)
}

impl StepPool {
    /// Starts the pool's threads.
    pub fn start(config: StepPoolConfig) -> std::io::Result<Self> {
        let threads = config.resolved_threads().max(1);
        let shared = Arc::new(Shared {
            config,
            threads,
            queue: Mutex::new(Queue {
                jobs: VecDeque::new(),
                closed: false,
            }),
            queued: AtomicUsize::new(0),
            spinning: AtomicBool::new(false),
            wake: Condvar::new(),
            live: AtomicUsize::new(0),
            stuck: AtomicUsize::new(0),
            running: AtomicUsize::new(0),
        });
        for _ in 0..threads {
            spawn_worker(&shared)?;
        }
        metrics::gauge!(LOST_WORKERS_METRIC).set(0.0);
        Ok(StepPool {
            _owner: Arc::new(Owner(Arc::clone(&shared))),
            shared,
        })
    }

    /// Whether every configured thread serves the queue (false once more
    /// than `max_stuck` threads are lost at once).
    pub fn healthy(&self) -> bool {
        self.shared.live.load(Ordering::Acquire) >= self.shared.threads
            && self.shared.stuck.load(Ordering::Acquire) <= self.shared.config.max_stuck
    }

    /// Threads lost to steps that have not returned.
    pub fn stuck(&self) -> usize {
        self.shared.stuck.load(Ordering::Acquire)
    }

    /// Steps running now, stuck ones included.
    pub fn running(&self) -> usize {
        self.shared.running.load(Ordering::Acquire)
    }

    /// Runs `f` on a pool thread and waits for it (async callers).
    pub async fn run<F, R>(&self, f: F) -> Result<R, StepFailure>
    where
        F: FnOnce() -> R + Send + 'static,
        R: Send + 'static,
    {
        let (tx, mut rx) = tokio::sync::oneshot::channel();
        let ticket = self.submit(f, move |r| {
            let _ = tx.send(r);
        });
        // Most steps take tens of microseconds: waiting for them right here
        // (the runtime worker is held no longer than `REPLY_SPIN`) saves parking the worker and waking it again,
        // which costs more than the step on a loaded machine. Only when a
        // thread was free for it: behind other steps the wait is longer
        // than the spin, and the runtime worker has other connections to
        // serve.
        let free = self.shared.running.load(Ordering::Acquire) < self.shared.threads
            && self.shared.queued.load(Ordering::Acquire) <= 1;
        let spin_until = Instant::now() + if free { REPLY_SPIN } else { Duration::ZERO };
        loop {
            match rx.try_recv() {
                Ok(r) => return r,
                Err(tokio::sync::oneshot::error::TryRecvError::Empty)
                    if Instant::now() < spin_until =>
                {
                    // Yield, not spin: on a machine with few cores the
                    // worker running the step may need this one.
                    std::thread::yield_now()
                }
                Err(_) => break,
            }
        }
        let budget = self.shared.config.max_step.saturating_sub(REPLY_SPIN);
        match tokio::time::timeout(budget, &mut rx).await {
            Ok(Ok(r)) => r,
            Ok(Err(_)) => Err(StepFailure::Panicked("the worker dropped the step".into())),
            Err(_) => self.overran(&ticket, || rx.try_recv().ok()),
        }
    }

    /// Runs every job of `jobs` on the pool, in parallel across its
    /// threads, and waits for them all: the results in the jobs' order.
    /// Each job has its own `limits.max_step_ms` budget, counted from when
    /// its result is awaited (all are submitted first, so a later job's
    /// wait overlaps the earlier ones').
    pub async fn run_many<F, R>(&self, jobs: Vec<F>) -> Vec<Result<R, StepFailure>>
    where
        F: FnOnce() -> R + Send + 'static,
        R: Send + 'static,
    {
        let pending: Vec<_> = jobs
            .into_iter()
            .map(|f| {
                let (tx, rx) = tokio::sync::oneshot::channel();
                let ticket = self.submit(f, move |r| {
                    let _ = tx.send(r);
                });
                (ticket, rx)
            })
            .collect();
        let mut out = Vec::with_capacity(pending.len());
        for (ticket, mut rx) in pending {
            let r = match tokio::time::timeout(self.shared.config.max_step, &mut rx).await {
                Ok(Ok(r)) => r,
                Ok(Err(_)) => Err(StepFailure::Panicked("the worker dropped the step".into())),
                Err(_) => self.overran(&ticket, || rx.try_recv().ok()),
            };
            out.push(r);
        }
        out
    }

    /// Runs a batch's rows, stopping at the first row that fails in the
    /// pool (overran its budget, found no worker, panicked): `Err` with
    /// that row's index and failure, and no later row runs — queued ones
    /// are dropped unrun; one already running on another thread is left
    /// to finish, and written off only if it overruns a budget of its own
    /// from then on. Otherwise every result, in order. Each row has its own
    /// `limits.max_step_ms`, counted from when its result is awaited.
    ///
    /// With `canary`, the first row runs alone before the others are
    /// submitted: a chain that hangs (rows sharing one chain, a stage that
    /// never returns) then costs the pool one written-off thread, not one
    /// per row. Without a write-off in the batch, no thread is lost.
    pub async fn run_batch<F, R>(
        &self,
        jobs: Vec<F>,
        canary: bool,
    ) -> Result<Vec<R>, (usize, StepFailure)>
    where
        F: FnOnce() -> R + Send + 'static,
        R: Send + 'static,
    {
        let mut out = Vec::with_capacity(jobs.len());
        let mut jobs = jobs.into_iter();
        if canary && jobs.len() > 1 {
            let first = jobs.next().expect("more than one job");
            out.push(self.run(first).await.map_err(|f| (0, f))?);
        }
        let offset = out.len();
        let mut pending = jobs
            .map(|f| {
                let (tx, rx) = tokio::sync::oneshot::channel();
                let ticket = self.submit(f, move |r| {
                    let _ = tx.send(r);
                });
                (ticket, rx)
            })
            .collect::<Vec<_>>()
            .into_iter()
            .enumerate();
        while let Some((k, (ticket, mut rx))) = pending.next() {
            let r = match tokio::time::timeout(self.shared.config.max_step, &mut rx).await {
                Ok(Ok(r)) => r,
                Ok(Err(_)) => Err(StepFailure::Panicked("the worker dropped the step".into())),
                Err(_) => self.overran(&ticket, || rx.try_recv().ok()),
            };
            match r {
                Ok(r) => out.push(r),
                Err(f) => {
                    self.give_up(pending.map(|(_, p)| p).collect());
                    return Err((offset + k, f));
                }
            }
        }
        Ok(out)
    }

    /// The rest of a failed batch: queued rows never run; running ones are
    /// watched (off the caller's path) and written off if they overrun a
    /// budget from now.
    fn give_up<R: Send + 'static>(&self, rest: Vec<Pending<R>>) {
        let mut running = Vec::new();
        for (ticket, rx) in rest {
            let mut phase = lock(&ticket.phase);
            match &*phase {
                Phase::Queued => *phase = Phase::Abandoned,
                Phase::Running(_) => {
                    drop(phase);
                    running.push((ticket, rx));
                }
                Phase::Done | Phase::Abandoned => {}
            }
        }
        if running.is_empty() {
            return;
        }
        let pool = self.clone();
        let deadline = tokio::time::Instant::now() + self.shared.config.max_step;
        tokio::spawn(async move {
            for (ticket, mut rx) in running {
                if tokio::time::timeout_at(deadline, &mut rx).await.is_err() {
                    let _ = pool.overran(&ticket, || rx.try_recv().ok());
                }
            }
        });
    }

    /// Runs `f` on the pool and waits for it (blocking callers: the
    /// Generate thread).
    pub fn run_blocking<F, R>(&self, f: F) -> Result<R, StepFailure>
    where
        F: FnOnce() -> R + Send + 'static,
        R: Send + 'static,
    {
        let (tx, rx) = mpsc::sync_channel(1);
        let ticket = self.submit(f, move |r| {
            let _ = tx.send(r);
        });
        match rx.recv_timeout(self.shared.config.max_step) {
            Ok(r) => r,
            Err(mpsc::RecvTimeoutError::Disconnected) => {
                Err(StepFailure::Panicked("the worker dropped the step".into()))
            }
            Err(mpsc::RecvTimeoutError::Timeout) => self.overran(&ticket, || rx.try_recv().ok()),
        }
    }

    fn submit<F, R>(
        &self,
        f: F,
        reply: impl FnOnce(Result<R, StepFailure>) + Send + 'static,
    ) -> Arc<Ticket>
    where
        F: FnOnce() -> R + Send + 'static,
        R: Send + 'static,
    {
        let ticket = Arc::new(Ticket {
            phase: Mutex::new(Phase::Queued),
        });
        let job: Job = Box::new(move || {
            let r = catch_unwind(AssertUnwindSafe(f))
                .map_err(|p| StepFailure::Panicked(panic_text(&*p).to_string()));
            reply(r);
        });
        {
            let mut q = lock(&self.shared.queue);
            q.jobs.push_back((job, Arc::clone(&ticket)));
            self.shared.queued.fetch_add(1, Ordering::SeqCst);
        }
        // A spinning worker sees the count (it takes the queue's lock
        // after its spin, so it cannot miss the job): no wake needed.
        if !self.shared.spinning.load(Ordering::SeqCst) {
            self.shared.wake.notify_one();
        }
        ticket
    }

    /// The budget ran out: give the step up (queued) or write its thread
    /// off (running). `late` collects a result that raced the timeout.
    fn overran<R>(
        &self,
        ticket: &Ticket,
        late: impl FnOnce() -> Option<Result<R, StepFailure>>,
    ) -> Result<R, StepFailure> {
        let budget_ms = self.shared.config.max_step.as_millis();
        let mut phase = lock(&ticket.phase);
        match &*phase {
            Phase::Queued => {
                *phase = Phase::Abandoned;
                Err(StepFailure::NoWorker {
                    budget_ms,
                    threads: self.shared.threads,
                })
            }
            Phase::Running(worker) => {
                let worker = Arc::clone(worker);
                drop(phase);
                let stage = stage_of(&worker.activity);
                self.write_off(&worker, &stage);
                Err(StepFailure::Stuck { stage, budget_ms })
            }
            Phase::Done | Phase::Abandoned => {
                drop(phase);
                late().unwrap_or_else(|| {
                    Err(StepFailure::Panicked("the step's result was lost".into()))
                })
            }
        }
    }

    /// Marks `worker` lost and starts a replacement while the bound allows.
    fn write_off(&self, worker: &Arc<Worker>, stage: &str) {
        let shared = &self.shared;
        {
            let mut lost = lock(&worker.lost);
            if *lost {
                return;
            }
            *lost = true;
        }
        let stuck = self.count_lost(stage);
        shared.live.fetch_sub(1, Ordering::AcqRel);
        let replaced = stuck <= shared.config.max_stuck && spawn_worker(shared).is_ok();
        self.report_lost(stage, stuck, replaced);
    }

    /// Counts one more lost thread (in `stage`): the lost-thread count now.
    fn count_lost(&self, stage: &str) -> usize {
        let stuck = self.shared.stuck.fetch_add(1, Ordering::AcqRel) + 1;
        metrics::counter!(STUCK_STEPS_METRIC, "stage" => stage.to_string()).increment(1);
        metrics::gauge!(LOST_WORKERS_METRIC).set(stuck as f64);
        stuck
    }

    /// Logs a write-off, and the pool turning unhealthy when `replaced`
    /// is false.
    fn report_lost(&self, stage: &str, stuck: usize, replaced: bool) {
        let config = &self.shared.config;
        tracing::error!(
            stage,
            budget_ms = config.max_step.as_millis() as u64,
            lost_threads = stuck,
            replaced,
            "a sampling step overran limits.max_step_ms: its thread is written off"
        );
        if !replaced {
            tracing::error!(
                lost_threads = stuck,
                max = config.max_stuck,
                "more sampling threads lost than limits.max_stuck_workers: readiness is NOT_SERVING"
            );
        }
    }
}

fn spawn_worker(shared: &Arc<Shared>) -> std::io::Result<()> {
    let worker = Arc::new(Worker {
        activity: Activity::new(),
        lost: Mutex::new(false),
    });
    let s = Arc::clone(shared);
    shared.live.fetch_add(1, Ordering::AcqRel);
    std::thread::Builder::new()
        .name("samplerd-step".into())
        .spawn(move || work(&s, worker))
        .map(drop)
        .inspect_err(|_| {
            shared.live.fetch_sub(1, Ordering::AcqRel);
        })
}

/// A worker's loop: take a step, run it, repeat; leaves when written off
/// and not needed any more.
fn work(shared: &Shared, worker: Arc<Worker>) {
    activity::watch_this_thread(Arc::clone(&worker.activity));
    // Plugins run here: a stack overflow in one is reported too.
    crate::crash::prepare_this_thread();
    loop {
        let Some((job, ticket)) = next_job(shared) else {
            return;
        };
        {
            let mut phase = lock(&ticket.phase);
            if matches!(*phase, Phase::Abandoned) {
                continue;
            }
            *phase = Phase::Running(Arc::clone(&worker));
        }
        shared.running.fetch_add(1, Ordering::AcqRel);
        job();
        shared.running.fetch_sub(1, Ordering::AcqRel);
        worker.activity.clear();
        *lock(&ticket.phase) = Phase::Done;
        let mut lost = lock(&worker.lost);
        if *lost {
            // Back from a step the watchdog gave up on.
            shared.count_returned();
            let short = shared
                .live
                .fetch_update(Ordering::AcqRel, Ordering::Acquire, |n| {
                    (n < shared.threads).then_some(n + 1)
                })
                .is_ok();
            tracing::warn!(rejoined = short, "a written-off sampling step returned");
            if !short {
                return;
            }
            *lost = false;
        }
    }
}

/// The next job (`None` once the pool is closed and nothing is queued).
/// One idle worker at a time spins briefly for it (so a step that follows
/// soon wakes no thread, and at most one core is spent waiting); the
/// others, and the spinner after [`SPIN`], sleep until one is queued.
fn next_job(shared: &Shared) -> Option<(Job, Arc<Ticket>)> {
    if shared
        .spinning
        .compare_exchange(false, true, Ordering::SeqCst, Ordering::SeqCst)
        .is_ok()
    {
        let spin_until = Instant::now() + SPIN;
        while shared.queued.load(Ordering::SeqCst) == 0 && Instant::now() < spin_until {
            std::thread::yield_now();
        }
        shared.spinning.store(false, Ordering::SeqCst);
    }
    let mut q = lock(&shared.queue);
    loop {
        if let Some(entry) = q.jobs.pop_front() {
            shared.queued.fetch_sub(1, Ordering::SeqCst);
            // A submitter that saw the spinner did not wake anyone: pass
            // what is left on.
            if !q.jobs.is_empty() {
                shared.wake.notify_one();
            }
            return Some(entry);
        }
        if q.closed {
            return None;
        }
        q = shared.wake.wait(q).unwrap_or_else(PoisonError::into_inner);
    }
}

/// The stage a step is in, for the watchdog's error and metric.
fn stage_of(activity: &Activity) -> String {
    activity
        .current()
        .map_or_else(|| "(between stages)".to_string(), |s| s.to_string())
}

impl Shared {
    /// A written-off step returned: one lost thread fewer.
    fn count_returned(&self) {
        let stuck = self.stuck.fetch_sub(1, Ordering::AcqRel) - 1;
        metrics::gauge!(LOST_WORKERS_METRIC).set(stuck as f64);
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
mod tests;
