//! A sequence's grammar state, with the next mask computed ahead: after a
//! decode step accepts its token, the mask for the following step is
//! computed on the constraint's worker threads while the caller runs its
//! forward pass, and the next `apply` only collects it.
//!
//! Why: llguidance's mask is most of the stage's cost (~57 µs of ~73 µs a
//! token over Qwen's 151,936-token vocabulary on the 2-core machine of
//! docs/PERFORMANCE.md; the −inf writes are the rest) and it depends only
//! on the tokens so far, so it need not wait for the logits. The caller
//! (Generate's decode loop, or a SampleStream client computing its next
//! logits) spends at least a forward pass between one step's `accept` and
//! the next step's `apply`.
//!
//! Only an `accept` that follows an `apply` starts the work ahead: that is a
//! decode loop. A run of accepts without applies is a replay (Sample's
//! `constraint_tokens`, a reset state seeded with tokens), where a mask per
//! token would be computed and thrown away. And only when the sequence's
//! masks have lately cost at least `ahead_min_us` (a moving average over
//! about the last four): handing the parser to another thread costs
//! ~22 µs on that machine (~18 µs to wake a sleeping worker — a VM's
//! cross-CPU interrupt — and ~4 µs of cache misses when the parser's state
//! comes back), more than a cheap mask saves. An average, not the last
//! mask: JSON alternates cheap forced positions (a `":"`) with costly ones
//! (a string's first token), and going by the last mask alone inlined the
//! costly ones (at 151,936: 53 µs a step against 47 µs always ahead).

use std::panic::{AssertUnwindSafe, catch_unwind};
use std::sync::{Arc, Condvar, Mutex, OnceLock};
use std::time::{Duration, Instant};

use llguidance::Matcher;
use samplerd_plugin_sdk::input_error;
use toktrie::SimpleVob;

use crate::tokenv::TokenEnv;

/// What a mask computation gives back: the matcher it borrowed, the mask
/// or the grammar's error, and how long it took.
type Done = (Box<Matcher>, Result<SimpleVob, String>, Duration);

/// Per sequence: llguidance's matcher (its Earley parser state), where it
/// is now.
pub struct SeqState {
    now: Now,
    /// What this sequence's masks have cost lately: a moving average with
    /// weight 1/4 on the newest.
    mask_cost: Duration,
}

enum Now {
    /// The matcher is here; `applied`: the last call was an `apply` (so an
    /// `accept` now is a decode step's, and worth computing ahead after).
    Here {
        matcher: Box<Matcher>,
        applied: bool,
    },
    /// The matcher is on a worker, computing the mask for its position.
    Ahead(Arc<Pending>),
    /// The work ahead came back (a fork waited for it): matcher and mask.
    Ready(Done),
    /// Only while a method moves the matcher between the other states; a
    /// panic there (caught by the SDK) can leave it, and the next call
    /// reports it instead of crashing.
    Moved,
}

/// One mask computed ahead: filled once by the worker.
struct Pending {
    done: Mutex<Option<Done>>,
    filled: Condvar,
}

impl Pending {
    /// Blocks until the worker has filled it, then runs `f` on the result.
    /// The worker never holds the lock while it computes, and always fills
    /// it (a panic in llguidance is caught there), so this cannot wait on a
    /// dead worker; a mask that never finishes is the host's stuck-stage
    /// watchdog's to handle, as it would be inline.
    fn wait<R>(&self, f: impl FnOnce(&mut Option<Done>) -> R) -> R {
        let mut done = self.done.lock().unwrap_or_else(|p| p.into_inner());
        while done.is_none() {
            done = self.filled.wait(done).unwrap_or_else(|p| p.into_inner());
        }
        f(&mut done)
    }
}

/// The worker threads that compute masks ahead, one per core (the work is
/// one llguidance call per sequence and step; more threads than cores
/// would only queue it behind the caller's forward pass). Named so that
/// `top -H` and a profile say what they are.
fn workers() -> &'static rayon_core::ThreadPool {
    static POOL: OnceLock<rayon_core::ThreadPool> = OnceLock::new();
    POOL.get_or_init(|| {
        rayon_core::ThreadPoolBuilder::new()
            .num_threads(std::thread::available_parallelism().map_or(2, |n| n.get()))
            .thread_name(|i| format!("constraint-mask-{i}"))
            .build()
            .expect("the constraint stage's mask threads start")
    })
}

/// The tokens allowed next: the grammar's mask, with every
/// end-of-generation token where the grammar may stop (llguidance adds
/// them when it is accepting) and only those once it must stop.
pub fn allowed(env: &TokenEnv, matcher: &mut Matcher) -> Result<SimpleVob, String> {
    if matcher.is_stopped() {
        return eog_only(env, matcher);
    }
    matcher
        .compute_mask()
        .map_err(|e| grammar_failed(&e.to_string()))
}

/// llguidance's error while following the grammar, as the request's fault
/// (it is the grammar that outgrew the parser's limits): its first line,
/// without the marker lines llguidance appends.
pub fn grammar_failed(why: &str) -> String {
    let first = why.lines().next().unwrap_or_default();
    input_error(format!("constraint: the grammar failed: {first}"))
}

fn eog_only(env: &TokenEnv, matcher: &Matcher) -> Result<SimpleVob, String> {
    let reason = matcher.stop_reason();
    if !reason.is_ok() {
        let why = matcher.get_error().unwrap_or_else(|| reason.to_string());
        return Err(grammar_failed(&why));
    }
    let mut v = SimpleVob::alloc(env.n_vocab);
    for &t in &env.eog {
        v.allow_token(t);
    }
    Ok(v)
}

fn timed_mask(env: &TokenEnv, mut matcher: Box<Matcher>) -> Done {
    let started = Instant::now();
    let mask = allowed(env, &mut matcher);
    (matcher, mask, started.elapsed())
}

const MOVED: &str = "constraint: the sequence's grammar state was lost to an earlier failure";

impl SeqState {
    pub fn new(matcher: Matcher) -> Self {
        SeqState {
            now: Now::Here {
                matcher: Box::new(matcher),
                applied: false,
            },
            mask_cost: Duration::ZERO,
        }
    }

    /// The mask for this step: the one computed ahead if there is one
    /// (waiting for it if it is still being computed), else computed now.
    pub fn mask(&mut self, env: &TokenEnv) -> Result<SimpleVob, String> {
        let (matcher, mask, took) = match std::mem::replace(&mut self.now, Now::Moved) {
            Now::Here { matcher, .. } => timed_mask(env, matcher),
            Now::Ahead(p) => p.wait(|d| d.take()).expect("filled"),
            Now::Ready(done) => done,
            Now::Moved => return Err(MOVED.into()),
        };
        // (3·old + new) / 4 in nanoseconds; a mask over u64::MAX/4 ns
        // (146 years) saturates.
        let ns = |d: Duration| u64::try_from(d.as_nanos()).unwrap_or(u64::MAX / 4);
        self.mask_cost = Duration::from_nanos(
            (ns(self.mask_cost).min(u64::MAX / 4) * 3 + ns(took).min(u64::MAX / 4)) / 4,
        );
        self.now = Now::Here {
            matcher,
            applied: true,
        };
        mask
    }

    /// Runs `f` on the matcher (after any work ahead has come back; its
    /// mask is dropped, since `f` may move the matcher on). When `f` moved
    /// it on by a decode step's token (`Ok(true)`) and the sequence's masks
    /// have lately cost at least `ahead_min`, starts computing the next
    /// mask ahead.
    pub fn advance(
        &mut self,
        env: &Arc<TokenEnv>,
        ahead_min: Duration,
        f: impl FnOnce(&mut Matcher) -> Result<bool, String>,
    ) -> Result<(), String> {
        let (mut matcher, applied) = match std::mem::replace(&mut self.now, Now::Moved) {
            Now::Here { matcher, applied } => (matcher, applied),
            Now::Ahead(p) => (p.wait(|d| d.take()).expect("filled").0, false),
            Now::Ready(done) => (done.0, false),
            Now::Moved => return Err(MOVED.into()),
        };
        let moved = f(&mut matcher);
        self.now = match moved {
            Ok(true) if applied && self.mask_cost >= ahead_min => {
                Now::Ahead(compute_ahead(Arc::clone(env), matcher))
            }
            _ => Now::Here {
                matcher,
                applied: false,
            },
        };
        moved.map(|_| ())
    }
}

impl Clone for SeqState {
    /// llguidance's `Matcher::clone`: the parser state (Earley rows,
    /// consumed bytes, stop state) is copied, so the clone is an
    /// independent sequence; only the lazily built lexer automaton, a cache
    /// that every state of one grammar fills alike, stays shared behind
    /// llguidance's mutex. (`deep_clone` would copy that cache too,
    /// megabytes for a large schema, on every fork for no change in
    /// behaviour.) A fork while the mask is computed ahead waits for it and
    /// copies both.
    fn clone(&self) -> Self {
        let now = match &self.now {
            Now::Here { matcher, applied } => Now::Here {
                matcher: matcher.clone(),
                applied: *applied,
            },
            Now::Ahead(p) => Now::Ready(p.wait(|d| d.clone().expect("filled"))),
            Now::Ready(done) => Now::Ready(done.clone()),
            Now::Moved => Now::Moved,
        };
        SeqState {
            now,
            mask_cost: self.mask_cost,
        }
    }
}

fn compute_ahead(env: Arc<TokenEnv>, mut matcher: Box<Matcher>) -> Arc<Pending> {
    let pending = Arc::new(Pending {
        done: Mutex::new(None),
        filled: Condvar::new(),
    });
    let fill = Arc::clone(&pending);
    workers().spawn(move || {
        // A panic in llguidance would abort the process from a pool
        // thread (rayon's default); inline, the SDK turns it into an
        // error from `apply`, and so does this.
        let started = Instant::now();
        let mask =
            catch_unwind(AssertUnwindSafe(|| allowed(&env, &mut matcher))).unwrap_or_else(|_| {
                Err("constraint: the grammar failed: llguidance panicked computing the mask".into())
            });
        let done = (matcher, mask, started.elapsed());
        *fill.done.lock().unwrap_or_else(|p| p.into_inner()) = Some(done);
        fill.filled.notify_all();
    });
    pending
}
