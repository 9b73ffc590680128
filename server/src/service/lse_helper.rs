//! The raw logits' log-sum-exp (behind the response's `logprob`) on a
//! second core, while the request's own thread copies, checks and samples.
//!
//! The sum does not feed the chain: only the response needs it. So for a
//! large `logits_f32le` request the handler posts the request bytes to one
//! persistent helper thread at its very start; the helper sums the exps
//! chunk by chunk ([`scan::chunk_lse_f32le`]) straight from the request
//! bytes, while the request thread copies + checks ([`TokenBuffer::
//! load_f32le_checked`]) and runs the chain. When the response needs the
//! sum, the request thread claims whatever chunks are left and computes
//! itself any chunk the helper has claimed but not finished — it never
//! waits for the helper. Chunks merge in order, so the result is bit for
//! bit the single-threaded fused scan's, whoever computed what.
//!
//! The helper takes one job at a time: when it is still busy (another
//! request, or it has not been scheduled since the last job because the
//! machine is loaded) the request falls back to the fused single-thread
//! scan. No helper is started on a one-CPU machine or when disabled.
//!
//! [`TokenBuffer::load_f32le_checked`]: samplerd_sampling::TokenBuffer::load_f32le_checked

use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, PoisonError};
use std::thread::{self, Thread};

use prost::bytes::Bytes;
use samplerd_sampling::scan::{self, PartialLse};
use serde::{Deserialize, Serialize};

/// Config `[limits.parallel_logprob]`.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct ParallelLogprobConfig {
    /// Sum the raw log-sum-exp of `logits_f32le` requests on a helper
    /// thread (ignored on a one-CPU machine).
    pub enabled: bool,
    /// Smallest vocabulary for which the helper is used: below it, waking
    /// it costs about as much as the exps it would take over.
    pub min_vocab: usize,
}

impl Default for ParallelLogprobConfig {
    fn default() -> Self {
        ParallelLogprobConfig {
            enabled: true,
            min_vocab: 32_768,
        }
    }
}

/// One chunk's result slot.
struct Part {
    done: AtomicBool,
    max: AtomicU32,
    sum: AtomicU64,
}

/// One request's sum: the bytes (kept alive by the helper's reference),
/// the next unclaimed chunk, and the finished parts.
struct Job {
    bytes: Bytes,
    next: AtomicUsize,
    parts: Box<[Part]>,
}

impl Job {
    /// Claims the next chunk, if any is left.
    fn claim(&self) -> Option<usize> {
        let c = self.next.fetch_add(1, Ordering::Relaxed);
        (c < self.parts.len()).then_some(c)
    }

    fn compute(&self, c: usize) -> PartialLse {
        scan::chunk_lse_f32le(&self.bytes, c)
    }

    fn publish(&self, c: usize, p: PartialLse) {
        let slot = &self.parts[c];
        slot.max.store(p.max.to_bits(), Ordering::Relaxed);
        slot.sum.store(p.sum.to_bits(), Ordering::Relaxed);
        slot.done.store(true, Ordering::Release);
    }

    /// Chunk `c`'s part if the helper has published it.
    fn published(&self, c: usize) -> Option<PartialLse> {
        let slot = &self.parts[c];
        slot.done.load(Ordering::Acquire).then(|| PartialLse {
            max: f32::from_bits(slot.max.load(Ordering::Relaxed)),
            sum: f64::from_bits(slot.sum.load(Ordering::Relaxed)),
        })
    }
}

/// What the request threads and the helper share.
struct Shared {
    /// No job outstanding (the helper has finished the last one).
    idle: AtomicBool,
    /// The posted job, taken by the helper.
    slot: Mutex<Option<Arc<Job>>>,
    /// Set when the owning [`LseHelper`] is dropped: the thread exits.
    stop: AtomicBool,
}

/// The helper thread and its shared state (one per server).
pub struct LseHelper {
    worker: Option<(Arc<Shared>, Thread)>,
    min_vocab: usize,
}

impl LseHelper {
    /// Starts the helper thread, unless disabled or on a one-CPU machine
    /// (or the thread cannot be started: then every request takes the
    /// single-thread path, and a warning says why).
    pub fn new(cfg: &ParallelLogprobConfig) -> Self {
        let cpus = thread::available_parallelism().map_or(1, |n| n.get());
        let worker = (cfg.enabled && cpus > 1)
            .then(|| {
                let shared = Arc::new(Shared {
                    idle: AtomicBool::new(true),
                    slot: Mutex::new(None),
                    stop: AtomicBool::new(false),
                });
                let s = shared.clone();
                thread::Builder::new()
                    .name("samplerd-lse".into())
                    .spawn(move || run(&s))
                    .map(|h| (shared, h.thread().clone()))
                    .map_err(|e| {
                        tracing::warn!(error = %e, "no log-sum-exp helper thread; sampling single-threaded");
                    })
                    .ok()
            })
            .flatten();
        LseHelper {
            worker,
            min_vocab: cfg.min_vocab,
        }
    }

    /// Whether a helper thread is running.
    pub fn is_running(&self) -> bool {
        self.worker.is_some()
    }

    /// Whether a running helper is free to take a job now.
    pub fn is_idle(&self) -> bool {
        self.worker
            .as_ref()
            .is_some_and(|(shared, _)| shared.idle.load(Ordering::Acquire))
    }

    /// Hands the log-sum-exp of raw logits `bytes` to the helper, if it is
    /// running and idle and the vocabulary is large enough; else `None`
    /// (the caller uses the fused single-thread scan).
    pub fn start(&self, bytes: &Bytes) -> Option<LseJob> {
        let (shared, thread) = self.worker.as_ref()?;
        let n = bytes.len() / 4;
        if n < self.min_vocab.max(1) || !bytes.len().is_multiple_of(4) {
            return None;
        }
        shared
            .idle
            .compare_exchange(true, false, Ordering::Acquire, Ordering::Relaxed)
            .ok()?;
        let job = Arc::new(Job {
            bytes: bytes.clone(),
            next: AtomicUsize::new(0),
            parts: (0..scan::chunks(n))
                .map(|_| Part {
                    done: AtomicBool::new(false),
                    max: AtomicU32::new(0),
                    sum: AtomicU64::new(0),
                })
                .collect(),
        });
        // Nothing panics while holding the lock; a poisoned one is still
        // a plain slot.
        *shared.slot.lock().unwrap_or_else(PoisonError::into_inner) = Some(job.clone());
        thread.unpark();
        Some(LseJob { job })
    }
}

impl Drop for LseHelper {
    fn drop(&mut self) {
        if let Some((shared, thread)) = &self.worker {
            shared.stop.store(true, Ordering::Release);
            thread.unpark();
        }
    }
}

/// The helper thread: waits for a job, sums chunks until none is left,
/// marks itself idle.
fn run(shared: &Shared) {
    lower_priority();
    while !shared.stop.load(Ordering::Acquire) {
        let job = shared
            .slot
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .take();
        let Some(job) = job else {
            // A job posted before this park makes it return at once
            // (`unpark` leaves a token), so none is missed.
            thread::park();
            continue;
        };
        while let Some(c) = job.claim() {
            job.publish(c, job.compute(c));
        }
        // Drop the bytes before taking new work.
        drop(job);
        shared.idle.store(true, Ordering::Release);
    }
}

/// Makes the calling (helper) thread `SCHED_IDLE`: it runs only on a CPU
/// that has nothing else to do. Woken at normal priority, the kernel may
/// put it on the request thread's own CPU and let it preempt that thread
/// for its whole job — the request then waits for work it would have done
/// itself. At idle priority it never preempts anything: it uses a free
/// core or, on a busy machine, barely runs (the request thread then does
/// every chunk, and the next requests find the helper busy and take the
/// fused path).
fn lower_priority() {
    #[cfg(target_os = "linux")]
    {
        let param = libc::sched_param { sched_priority: 0 };
        // SAFETY: plain syscall on the calling thread (pid 0) with a valid
        // parameter struct; failure only leaves the priority unchanged.
        let rc = unsafe { libc::sched_setscheduler(0, libc::SCHED_IDLE, &param) };
        if rc != 0 {
            tracing::debug!(
                error = %std::io::Error::last_os_error(),
                "log-sum-exp helper keeps normal priority"
            );
        }
    }
}

/// A log-sum-exp being computed with the helper's help.
pub struct LseJob {
    job: Arc<Job>,
}

impl LseJob {
    /// The log-sum-exp of the job's logits: claims the chunks still left,
    /// takes the helper's finished ones, recomputes any it is still on.
    /// Meaningful only for logits that passed validation.
    pub fn finish(self) -> f32 {
        let job = &self.job;
        let mut mine: Vec<Option<PartialLse>> = vec![None; job.parts.len()];
        while let Some(c) = job.claim() {
            mine[c] = Some(job.compute(c));
        }
        mine.iter()
            .enumerate()
            .map(|(c, p)| {
                p.or_else(|| job.published(c))
                    .unwrap_or_else(|| job.compute(c))
            })
            .fold(PartialLse::EMPTY, PartialLse::merge)
            .log_sum_exp()
    }
}

impl Drop for LseJob {
    fn drop(&mut self) {
        // Nothing more to claim: an abandoned job (bad input, an error
        // before the response) stops the helper after its current chunk.
        self.job.next.store(usize::MAX / 2, Ordering::Relaxed);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use samplerd_sampling::TokenBuffer;

    fn bytes_of(v: &[f32]) -> Bytes {
        v.iter()
            .flat_map(|f| f.to_le_bytes())
            .collect::<Vec<u8>>()
            .into()
    }

    fn logits(n: usize) -> Vec<f32> {
        (0..n)
            .map(|i| ((i * 7919) % 1000) as f32 / 83.0 - 5.0 + (i % 3) as f32)
            .collect()
    }

    /// The helper path gives the fused scan's bits, job after job (the
    /// helper goes idle again each time), and agrees with an f64 reference
    /// to 1e-5.
    #[test]
    fn helper_matches_fused_scan_bit_for_bit() {
        let helper = LseHelper::new(&ParallelLogprobConfig {
            enabled: true,
            min_vocab: 1,
        });
        if !helper.is_running() {
            eprintln!("one CPU: no helper thread, nothing to test");
            return;
        }
        for n in [1, 5000, 151_936, 151_936 + 3] {
            let v = logits(n);
            let bytes = bytes_of(&v);
            let fused = TokenBuffer::new().load_f32le_scan(&bytes).unwrap();
            let r = {
                let m = v.iter().fold(f64::NEG_INFINITY, |a, &b| a.max(b as f64));
                m + v.iter().map(|&x| (x as f64 - m).exp()).sum::<f64>().ln()
            };
            let mut started = 0;
            for _ in 0..20 {
                // Idle again shortly after the last job: bounded retries.
                let Some(job) = (0..10_000).find_map(|_| {
                    helper.start(&bytes).or_else(|| {
                        thread::yield_now();
                        None
                    })
                }) else {
                    continue;
                };
                started += 1;
                let mut buf = TokenBuffer::new();
                assert_eq!(buf.load_f32le_checked(&bytes).unwrap(), fused.max);
                let lse = job.finish();
                assert_eq!(lse.to_bits(), fused.log_sum_exp.to_bits(), "n={n}");
                assert!((lse as f64 - r).abs() < 1e-5 * r.abs().max(1.0));
            }
            assert!(started > 0, "the helper never went idle");
        }
    }

    #[test]
    fn declines_small_odd_or_busy_and_can_be_disabled() {
        let off = LseHelper::new(&ParallelLogprobConfig {
            enabled: false,
            ..Default::default()
        });
        assert!(!off.is_running());
        assert!(off.start(&bytes_of(&logits(100_000))).is_none());
        // A "helper" that never runs (this thread's handle, no loop): the
        // machine-is-busy case, made deterministic.
        let stalled = LseHelper {
            worker: Some((
                Arc::new(Shared {
                    idle: AtomicBool::new(true),
                    slot: Mutex::new(None),
                    stop: AtomicBool::new(false),
                }),
                thread::current(),
            )),
            min_vocab: ParallelLogprobConfig::default().min_vocab,
        };
        assert!(
            stalled.start(&bytes_of(&logits(1000))).is_none(),
            "below min_vocab"
        );
        assert!(
            stalled
                .start(&Bytes::from(vec![0u8; 4 * 40_000 + 1]))
                .is_none()
        );
        let v = logits(100_000);
        let big = bytes_of(&v);
        let job = stalled.start(&big).expect("idle helper takes the job");
        // One job at a time: the next request goes single-threaded.
        assert!(stalled.start(&big).is_none());
        // The helper never shows up: the request thread does every chunk,
        // with the same bits.
        let fused = TokenBuffer::new().load_f32le_scan(&big).unwrap();
        assert_eq!(job.finish().to_bits(), fused.log_sum_exp.to_bits());
    }
}
