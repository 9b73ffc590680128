//! Compiling a request's constraint: off the sampling threads, within
//! limits, once per grammar.
//!
//! A `constraint` stage's config is a compiled grammar (llguidance, in the
//! constraint plugin). Compiling one is the only plugin call whose cost a
//! client sets at will: seconds for a large legal grammar, and — before
//! these limits — a stack overflow that took the process down for a deep
//! one. So before a request's chain is built on a sampling thread, the
//! handler calls [`Constraints::prepare`], which
//!
//! 1. finds the `constraint` stages the chain will have (typed
//!    `params.constraint`, or the stages of an explicit `params.chain`),
//!    exactly as validation will build them;
//! 2. refuses, before any compile, grammar text over
//!    `limits.max_constraint_bytes`, nesting deeper than
//!    `limits.max_constraint_depth` or with more rules than
//!    `limits.max_constraint_rules` ([`measure`]; INVALID_ARGUMENT naming
//!    the field, the measured value, the limit and its key);
//! 3. takes the compiled stage from the [`cache`], or waits for the same
//!    grammar's compile in flight, or compiles it on the [`pool`] — whose
//!    threads have a stack sized for those limits ([`stack_bytes`]) — and
//!    waits at most `limits.max_constraint_compile_ms` (past it:
//!    RESOURCE_EXHAUSTED `SAMPLERD_CONSTRAINT_TOO_COSTLY` if it was
//!    compiling, which is final for that grammar and cached as such;
//!    `SAMPLERD_OVERLOADED` with a retry hint if it never got a thread; a
//!    full queue is refused at once the same way).
//!
//! The chain is then built with the compiled stages ([`Prepared`], through
//! `samplerd_sampling::Prebuilt`, which refuses to compile a `constraint`
//! stage itself), so a sampling thread never compiles a grammar, and a
//! hostile compile holds at most the compile threads.
//!
//! Why in the host, around stage creation, and not in the plugin: the
//! plugin ABI stays as it is (one `config_new`, no threads or timers of
//! the plugin's own), and the host — which owns the sampling threads, the
//! memory budget and the configuration — decides where and under which
//! limits any plugin's config is built. The plugin keeps its own work
//! bounds (llguidance's fuel and sizes), which are what end a compile the
//! host has stopped waiting for.

pub mod cache;
pub mod measure;
pub mod pool;

use std::sync::Arc;
use std::time::{Duration, Instant};

use samplerd_api::v1;
use samplerd_sampling::params::CONSTRAINT_STAGE;
use samplerd_sampling::{ChainError, ParamValue, Prebuilt, StageRegistry, StageSpec, Vocabulary};

use crate::request::convert;
use crate::request::errors::RequestError;
use crate::request::memory::MemoryBudget;
use crate::status::Reason;
use cache::{Cache, Compiled, FlightSender, Key, Lookup, Outcome, Phase};
use pool::CompilePool;

/// The constraint stage's library (structured output): loaded beside the
/// core one by default when it is there (`app/config.rs`), and shipped
/// like it (a batch whose stages all come from these two runs no first
/// row alone: `service/batch.rs`).
pub const CONSTRAINT_PLUGIN_FILE: &str = "libsamplerd_constraint_stage.so";

/// Prometheus histogram of compile times in seconds (every compile run,
/// refused grammars included).
pub const COMPILE_SECONDS_METRIC: &str = "samplerd_constraint_compile_seconds";

/// The grammar parameters of the `constraint` stage, whose text is
/// measured.
const GRAMMAR_PARAMS: [&str; 5] = ["json_schema", "regex", "lark", "gbnf", "choice"];

/// The stage names a chain build may not compile itself.
const PREBUILT_ONLY: &[&str] = &[CONSTRAINT_STAGE];

/// Config: the constraint compiler's part of `[limits]`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ConstraintConfig {
    /// `limits.max_constraint_bytes`.
    pub max_bytes: usize,
    /// `limits.max_constraint_depth`.
    pub max_depth: usize,
    /// `limits.max_constraint_rules`.
    pub max_rules: usize,
    /// `limits.constraint_compile_threads`.
    pub threads: usize,
    /// `limits.constraint_compile_queue`.
    pub queue: usize,
    /// `limits.max_constraint_compile_ms`.
    pub max_compile: Duration,
    /// `limits.constraint_cache_entries`.
    pub cache_entries: usize,
    /// `limits.constraint_cache_bytes`.
    pub cache_bytes: usize,
}

/// The most stack a compile thread may be given (the configured limits
/// are refused at start-up past it): address space only until a grammar
/// uses it, and given back when the thread exits.
pub const MAX_STACK_BYTES: usize = 1 << 30;

/// Stack a compile thread needs for grammars at the depth and rule limits.
///
/// Measured with `examples/constraint_stack.rs` (release build; the least
/// stack that compiles each shape of `tests/hostile/mod.rs`, at two sizes;
/// docs/RELIABILITY.md, "Constraint compilation", has the table): a level
/// of [`measure`]'s depth costs at most ~4 KiB (a link of a JSON Schema
/// `$ref` chain; a Lark rule link ~3 KiB, a JSON nesting level ~2.7 KiB, a
/// Lark group ~1.9 KiB, a GBNF parenthesis ~0.7 KiB per its three levels),
/// a rule at most ~0.4 KiB (a property of one JSON object: the compiler
/// recurses along the property list). Both doubled here for margin, over
/// a fixed allowance for the rest (the compile's own frames, the first
/// mask; every shape needs under 0.2 MiB at size 0).
pub fn stack_bytes(max_depth: usize, max_rules: usize) -> usize {
    const BASE: usize = 8 << 20;
    const PER_DEPTH: usize = 8 << 10;
    const PER_RULE: usize = 1 << 10;
    BASE.saturating_add(max_depth.saturating_mul(PER_DEPTH))
        .saturating_add(max_rules.saturating_mul(PER_RULE))
}

/// What a compiled grammar is charged to the memory budget: the
/// llguidance grammar and lexer built for it, estimated from its text.
/// Measured (RSS after compiling and computing the first mask, per byte
/// of grammar text) in docs/RELIABILITY.md; the per-vocabulary token trie
/// is shared by every grammar and not counted here.
pub fn compiled_bytes(text_bytes: usize) -> usize {
    const BASE: usize = 256 << 10;
    const PER_BYTE: usize = 64;
    BASE.saturating_add(text_bytes.saturating_mul(PER_BYTE))
}

/// A request's compiled constraint stages, for its chain build; holds
/// their memory charge while the request lives.
pub struct Prepared {
    prebuilt: Prebuilt,
    _held: Vec<Arc<Compiled>>,
}

impl Default for Prepared {
    fn default() -> Self {
        Prepared {
            prebuilt: Prebuilt::requiring(PREBUILT_ONLY),
            _held: Vec::new(),
        }
    }
}

impl Prepared {
    /// What the chain build takes instead of compiling.
    pub fn prebuilt(&self) -> &Prebuilt {
        &self.prebuilt
    }

    /// Adds what `other` holds (a batch's rows, prepared separately).
    pub fn extend(&mut self, other: &Prepared) {
        for c in &other._held {
            self.hold(Arc::clone(c));
        }
    }

    fn hold(&mut self, c: Arc<Compiled>) {
        self.prebuilt.add(c.stage.clone());
        self._held.push(c);
    }
}

/// One `constraint` stage a request's chain will have.
struct Wanted {
    spec: StageSpec,
    /// `params.constraint` (typed) or `params.chain[i]`.
    place: Place,
}

#[derive(Clone, Copy)]
enum Place {
    Typed,
    Chain(usize),
}

impl Wanted {
    /// The request field of grammar parameter `param`.
    fn field(&self, param: &str) -> String {
        match self.place {
            Place::Typed => format!("params.constraint.{param}"),
            Place::Chain(i) => format!("params.chain[{i}].params[{param:?}]"),
        }
    }

    /// The stage's refusal, worded as validation words a chain error.
    fn refused(&self, e: ChainError) -> RequestError {
        match self.place {
            Place::Typed => {
                RequestError::from_chain(samplerd_sampling::params::name_typed_field(e), false)
            }
            Place::Chain(_) => RequestError::from_chain(e, true),
        }
    }

    /// The grammar parameter's name and value, if the stage has one.
    fn grammar(&self) -> Option<(&'static str, &ParamValue)> {
        GRAMMAR_PARAMS
            .iter()
            .find_map(|&p| self.spec.params.get(p).map(|v| (p, v)))
    }

    /// Bytes of grammar text (`choice`: the strings together).
    fn text_bytes(&self) -> usize {
        match self.grammar() {
            Some((_, ParamValue::String(s))) => s.len(),
            Some((_, ParamValue::StringList(l))) => l.iter().map(String::len).sum(),
            _ => 0,
        }
    }
}

/// The constraint compiler: limits, compile pool and cache.
pub struct Constraints {
    config: ConstraintConfig,
    registry: Arc<StageRegistry>,
    memory: Arc<MemoryBudget>,
    pool: CompilePool,
    cache: Arc<Cache>,
    /// Compiles run (for tests and diagnostics).
    compiles: Arc<std::sync::atomic::AtomicUsize>,
}

impl Constraints {
    pub fn new(
        config: ConstraintConfig,
        registry: Arc<StageRegistry>,
        memory: Arc<MemoryBudget>,
    ) -> Self {
        let stack = stack_bytes(config.max_depth, config.max_rules);
        Constraints {
            pool: CompilePool::new(config.threads, config.queue, stack),
            cache: Arc::new(Cache::new(config.cache_entries, config.cache_bytes)),
            compiles: Arc::default(),
            config,
            registry,
            memory,
        }
    }

    pub fn config(&self) -> &ConstraintConfig {
        &self.config
    }

    /// The compile pool (for diagnostics and tests).
    pub fn pool(&self) -> &CompilePool {
        &self.pool
    }

    /// The cache (for diagnostics and tests).
    pub fn cache(&self) -> &Cache {
        &self.cache
    }

    /// How many compiles have run (started on a compile thread).
    pub fn compiles(&self) -> usize {
        self.compiles.load(std::sync::atomic::Ordering::Relaxed)
    }

    /// The compiled `constraint` stages of parameters `p` against `vocab`
    /// (see the module docs), for the chain build.
    pub async fn prepare(
        &self,
        defaults: &crate::service::defaults::Defaults,
        p: Option<&v1::SamplingParams>,
        vocab: Option<&Arc<Vocabulary>>,
        request: u64,
    ) -> Result<Prepared, RequestError> {
        let wanted = wanted(defaults, p);
        let mut prepared = Prepared::default();
        if wanted.is_empty() {
            return Ok(prepared);
        }
        let deadline = tokio::time::Instant::now() + self.config.max_compile;
        let outcomes = futures::future::join_all(
            wanted
                .iter()
                .map(|w| self.resolve(w, vocab, deadline, request)),
        )
        .await;
        for (w, outcome) in wanted.iter().zip(outcomes) {
            match outcome? {
                Outcome::Compiled(c) => prepared.hold(c),
                other => return Err(self.failure(w, other)),
            }
        }
        Ok(prepared)
    }

    /// [`prepare`](Self::prepare) for callers without a runtime (the
    /// protobuf fuzz target): the same limits, cache and pool, waiting
    /// for the compile without a deadline (the plugin's own work bounds
    /// end it).
    pub fn prepare_blocking(
        &self,
        defaults: &crate::service::defaults::Defaults,
        p: Option<&v1::SamplingParams>,
        vocab: Option<&Arc<Vocabulary>>,
    ) -> Result<Prepared, RequestError> {
        let mut prepared = Prepared::default();
        for w in wanted(defaults, p) {
            self.check(&w)?;
            let flight = match self.start(&w, vocab, 0) {
                Start::Done(o) => o,
                Start::Wait(mut flight) => {
                    futures::executor::block_on(flight.wait_for(|p| matches!(p, Phase::Done(_))))
                        .map(|p| done_outcome(&p))
                        .map_err(|_| self.overloaded())?
                }
                Start::Full => return Err(self.overloaded()),
            };
            match flight {
                Outcome::Compiled(c) => prepared.hold(c),
                other => return Err(self.failure(&w, other)),
            }
        }
        Ok(prepared)
    }

    /// One wanted stage: checked, then from the cache, a compile in flight
    /// or a new compile, waited for until `deadline`.
    async fn resolve(
        &self,
        w: &Wanted,
        vocab: Option<&Arc<Vocabulary>>,
        deadline: tokio::time::Instant,
        request: u64,
    ) -> Result<Outcome, RequestError> {
        self.check(w)?;
        let mut flight = match self.start(w, vocab, request) {
            Start::Done(o) => return Ok(o),
            Start::Full => return Err(self.overloaded()),
            Start::Wait(flight) => flight,
        };
        let done =
            tokio::time::timeout_at(deadline, flight.wait_for(|p| matches!(p, Phase::Done(_))))
                .await
                .map(|r| r.map(|p| done_outcome(&p)));
        match done {
            Ok(Ok(o)) => Ok(o),
            // The compile was dropped unrun: its deadline passed in the queue.
            Ok(Err(_)) => Err(self.overloaded()),
            // It never got a thread: the pool is busy, not the grammar.
            Err(_) if matches!(*flight.borrow(), Phase::Queued) => Err(self.overloaded()),
            Err(_) => Ok(Outcome::TooCostly {
                ms: self.config.max_compile.as_millis() as u64,
            }),
        }
    }

    /// The byte, depth and rule limits.
    fn check(&self, w: &Wanted) -> Result<(), RequestError> {
        let Some((param, value)) = w.grammar() else {
            return Ok(());
        };
        let c = &self.config;
        let field = w.field(param);
        let bytes = w.text_bytes();
        if bytes > c.max_bytes {
            return Err(RequestError::limit(
                field,
                "limits.max_constraint_bytes",
                format!(
                    "{bytes} bytes exceed the limit of {} (limits.max_constraint_bytes)",
                    c.max_bytes
                ),
            ));
        }
        let shape = match value {
            ParamValue::String(text) => measure::measure(param, text),
            _ => measure::Shape { depth: 1, rules: 1 },
        };
        if shape.depth > c.max_depth {
            return Err(RequestError::limit(
                field,
                "limits.max_constraint_depth",
                format!(
                    "nests {} deep, over the limit of {} (limits.max_constraint_depth)",
                    shape.depth, c.max_depth
                ),
            ));
        }
        if shape.rules > c.max_rules {
            return Err(RequestError::limit(
                field,
                "limits.max_constraint_rules",
                format!(
                    "has {} rules, over the limit of {} (limits.max_constraint_rules)",
                    shape.rules, c.max_rules
                ),
            ));
        }
        Ok(())
    }

    /// Looks the stage up; on a miss, hands its compile to the pool.
    fn start(&self, w: &Wanted, vocab: Option<&Arc<Vocabulary>>, request: u64) -> Start {
        let key = Key::new(&w.spec, vocab.map_or(0, |v| Arc::as_ptr(v) as usize));
        let tx = match self.cache.lookup(key) {
            Lookup::Ready(o) => return Start::Done(o),
            Lookup::Pending(flight) => return Start::Wait(flight),
            Lookup::Miss(tx) => tx,
        };
        let flight = tx.subscribe();
        let job = CompileJob {
            key,
            spec: w.spec.clone(),
            text_bytes: w.text_bytes(),
            vocab: vocab.cloned(),
            registry: Arc::clone(&self.registry),
            memory: Arc::clone(&self.memory),
            cache: Arc::clone(&self.cache),
            budget: self.config.max_compile,
            request,
            tx: Some(tx),
            compiles: Arc::clone(&self.compiles),
        };
        let deadline = Instant::now() + self.config.max_compile;
        match self.pool.submit(deadline, move || job.run()) {
            Ok(()) => Start::Wait(flight),
            // The job was dropped: its guard forgot the pending entry.
            Err(pool::Full) => Start::Full,
        }
    }

    fn overloaded(&self) -> RequestError {
        let c = &self.config;
        RequestError::exhausted(
            Reason::Overloaded,
            "limits.constraint_compile_queue",
            format!(
                "every constraint compile thread ({}, limits.constraint_compile_threads) is busy \
                 and the queue ({}, limits.constraint_compile_queue) is full or did not move \
                 within limits.max_constraint_compile_ms = {}; try again later",
                c.threads,
                c.queue,
                c.max_compile.as_millis()
            ),
        )
    }

    fn failure(&self, w: &Wanted, outcome: Outcome) -> RequestError {
        let param = w.grammar().map_or("constraint", |g| g.0);
        match outcome {
            Outcome::Compiled(_) => unreachable!("not a failure"),
            Outcome::Refused(e) => w.refused(e),
            Outcome::TooCostly { ms } => RequestError::exhausted(
                Reason::ConstraintTooCostly,
                "limits.max_constraint_compile_ms",
                format!(
                    "{}: compiling the grammar took more than limits.max_constraint_compile_ms = {} \
                     ({ms} ms so far): make it smaller or simpler",
                    w.field(param),
                    self.config.max_compile.as_millis()
                ),
            ),
            Outcome::NoMemory(message) => RequestError::exhausted(
                Reason::BudgetExceeded,
                "limits.memory_budget_bytes",
                message,
            ),
        }
    }
}

/// The outcome of a [`Phase::Done`].
fn done_outcome(p: &Phase) -> Outcome {
    match p {
        Phase::Done(o) => o.clone(),
        Phase::Queued | Phase::Running => unreachable!("waited for Done"),
    }
}

enum Start {
    Done(Outcome),
    Wait(cache::Flight),
    Full,
}

/// One compile, run on a compile thread. Dropped unrun (its deadline
/// passed in the queue), it forgets its pending cache entry, and its
/// waiters see the flight end without an outcome.
struct CompileJob {
    key: Key,
    spec: StageSpec,
    text_bytes: usize,
    vocab: Option<Arc<Vocabulary>>,
    registry: Arc<StageRegistry>,
    memory: Arc<MemoryBudget>,
    cache: Arc<Cache>,
    budget: Duration,
    request: u64,
    tx: Option<FlightSender>,
    compiles: Arc<std::sync::atomic::AtomicUsize>,
}

impl CompileJob {
    fn run(mut self) {
        // For the crash report, should the plugin kill the process.
        let _serving = samplerd_sampling::activity::serving(self.request);
        if let Some(tx) = &self.tx {
            tx.send_replace(Phase::Running);
        }
        self.compiles
            .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let t = Instant::now();
        let outcome = self.compile();
        let took = t.elapsed();
        metrics::histogram!(COMPILE_SECONDS_METRIC).record(took.as_secs_f64());
        let outcome = match outcome {
            // Its callers stopped waiting at the budget: the same grammar
            // is refused at once from now on.
            Outcome::Compiled(_) if took > self.budget => {
                tracing::warn!(
                    ms = took.as_millis() as u64,
                    "a constraint compile overran limits.max_constraint_compile_ms"
                );
                Outcome::TooCostly {
                    ms: took.as_millis() as u64,
                }
            }
            other => other,
        };
        let tx = self.tx.take().expect("run once");
        self.cache.finish(self.key, &tx, outcome);
    }

    fn compile(&self) -> Outcome {
        let bytes = compiled_bytes(self.text_bytes);
        let charge = loop {
            match self
                .memory
                .charge(bytes, "this request's compiled constraint")
            {
                Ok(c) => break c,
                Err(e) if !self.cache.evict_compiled() => return Outcome::NoMemory(e.to_string()),
                Err(_) => {}
            }
        };
        match self.registry.build_stage(&self.spec, self.vocab.clone()) {
            Ok(stage) => Outcome::Compiled(Arc::new(Compiled::new(stage, charge))),
            Err(e) => Outcome::Refused(e),
        }
    }
}

impl Drop for CompileJob {
    fn drop(&mut self) {
        if self.tx.is_some() {
            self.cache.abandon(self.key);
        }
    }
}

/// The `constraint` stages the chain for parameters `p` will have — the
/// same resolution as `validate::sampling` (an explicit chain's
/// `constraint` stages, else those of the typed parameters' plan) — or
/// none where validation will refuse the parameters before building.
fn wanted(
    defaults: &crate::service::defaults::Defaults,
    p: Option<&v1::SamplingParams>,
) -> Vec<Wanted> {
    let Some(p) = p else {
        return Vec::new();
    };
    let constraint = p
        .constraint
        .as_ref()
        .and_then(convert::constraint_from_proto);
    if !p.chain.is_empty() {
        if constraint.is_some() || !p.chain.iter().any(|s| s.name == CONSTRAINT_STAGE) {
            return Vec::new();
        }
        let Ok(spec) = convert::chain_from_proto(&p.chain) else {
            return Vec::new();
        };
        return spec
            .stages
            .into_iter()
            .enumerate()
            .filter(|(_, s)| s.name == CONSTRAINT_STAGE)
            .map(|(i, spec)| Wanted {
                spec,
                place: Place::Chain(i),
            })
            .collect();
    }
    let named = p
        .samplers
        .iter()
        .any(|s| samplerd_sampling::params::canonical_stage_name(s) == CONSTRAINT_STAGE);
    if constraint.is_none() && !named {
        return Vec::new();
    }
    let Some(merged) = convert::typed_params(&defaults.params, p, constraint) else {
        return Vec::new();
    };
    let plan = merged.plan();
    plan.spec
        .stages
        .into_iter()
        .chain(plan.check_only)
        .filter(|s| s.name == CONSTRAINT_STAGE)
        .map(|spec| Wanted {
            spec,
            place: Place::Typed,
        })
        .collect()
}
