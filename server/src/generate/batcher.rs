//! Continuous batching of the decode steps of concurrent generations.
//!
//! One engine thread owns every forward pass. Each generation (on its own
//! blocking thread) hands its session and the tokens to run to the engine
//! and waits for the logits; meanwhile the engine gathers the next step of
//! every other active generation, so one `Model::decode_batch` call reads
//! each weight once for all of them instead of once per generation (decode
//! is memory-bound, and separate passes would also fight over the cores).
//! A speculating generation's verify pass (its token and drafts, every row
//! a decode step's, `Model::decode_rows`) joins the same step as the
//! others' single tokens. Prompts (prefill) run as their own step. Sequences join and leave
//! between steps; the engine waits for the generations it just served to
//! come back (they are sampling) at most `batch_wait`, so a generation held
//! up by a slow client is stepped later on its own rather than stalling the
//! others. Results are bit-identical to running each generation alone.

#![forbid(unsafe_code)]

use std::collections::HashSet;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::mpsc;
use std::time::{Duration, Instant};

use samplerd_model::{Model, Session};

/// What a generation asks the engine to run.
struct Job {
    seq: u64,
    session: Session,
    tokens: Vec<u32>,
    /// Decode rows (a verify pass): every token's logits, each token in a
    /// decode step's order; otherwise one step of all the tokens.
    rows: bool,
    reply: mpsc::Sender<Done>,
}

/// The session back, with its logits computed (or why not).
struct Done {
    session: Session,
    result: Result<(), String>,
}

enum Msg {
    Step(Job),
    /// The generation ended (its session is dropped by its thread).
    Leave(u64),
}

/// The engine's inbox (shared by every generation).
pub struct Batcher {
    // std's Sender is Sync (since 1.72): shared by every generation as is.
    tx: mpsc::Sender<Msg>,
    next_seq: AtomicU64,
    largest_batch: Arc<AtomicUsize>,
}

impl Batcher {
    /// Starts the engine thread for `model`; it ends when the `Batcher` drops.
    pub fn start(model: Arc<Model>, batch_wait: Duration) -> std::io::Result<Self> {
        let (tx, rx) = mpsc::channel();
        let largest_batch = Arc::new(AtomicUsize::new(0));
        let engine = Engine::new(model, batch_wait, Arc::clone(&largest_batch));
        std::thread::Builder::new()
            .name("samplerd-decode".into())
            .spawn(move || engine.run(rx))?;
        Ok(Batcher {
            tx,
            next_seq: AtomicU64::new(0),
            largest_batch,
        })
    }

    /// The most sequences one decode step has run together so far.
    pub fn largest_batch(&self) -> usize {
        self.largest_batch.load(Ordering::Relaxed)
    }

    /// A new sequence's handle for submitting its steps.
    pub fn join(&self) -> SeqHandle<'_> {
        let (reply, done) = mpsc::channel();
        SeqHandle {
            batcher: self,
            seq: self.next_seq.fetch_add(1, Ordering::Relaxed),
            reply,
            done,
        }
    }

    fn send(&self, msg: Msg) -> bool {
        self.tx.send(msg).is_ok()
    }
}

/// One generation's link to the engine; tells the engine it left on drop.
pub struct SeqHandle<'a> {
    batcher: &'a Batcher,
    seq: u64,
    reply: mpsc::Sender<Done>,
    done: mpsc::Receiver<Done>,
}

/// Why a step did not run.
#[derive(Debug, thiserror::Error)]
pub enum StepError {
    #[error("forward pass failed: {0}")]
    Forward(String),
    #[error("the decode engine stopped")]
    EngineGone,
}

impl SeqHandle<'_> {
    /// Runs `tokens` on `session` (in a batch with other sequences' steps
    /// when there are some) and returns it with its logits updated. On a
    /// forward error the session is returned too, unchanged.
    pub fn step(
        &self,
        session: Session,
        tokens: Vec<u32>,
    ) -> Result<Session, (Option<Session>, StepError)> {
        self.submit(session, tokens, false)
    }

    /// The verify pass of speculative decoding: `tokens` (the last token
    /// and its drafts) run on `session` as consecutive decode steps, batched
    /// with the other sequences' decode steps; the session comes back with
    /// every token's logits (`Session::logits_rows`), bit for bit those of
    /// one `step` per token.
    pub fn verify(
        &self,
        session: Session,
        tokens: Vec<u32>,
    ) -> Result<Session, (Option<Session>, StepError)> {
        self.submit(session, tokens, true)
    }

    fn submit(
        &self,
        session: Session,
        tokens: Vec<u32>,
        rows: bool,
    ) -> Result<Session, (Option<Session>, StepError)> {
        let job = Job {
            seq: self.seq,
            session,
            tokens,
            rows,
            reply: self.reply.clone(),
        };
        if !self.batcher.send(Msg::Step(job)) {
            return Err((None, StepError::EngineGone));
        }
        match self.done.recv() {
            Ok(Done {
                session,
                result: Ok(()),
            }) => Ok(session),
            Ok(Done {
                session,
                result: Err(e),
            }) => Err((Some(session), StepError::Forward(e))),
            Err(_) => Err((None, StepError::EngineGone)),
        }
    }
}

impl Drop for SeqHandle<'_> {
    fn drop(&mut self) {
        self.batcher.send(Msg::Leave(self.seq));
    }
}

struct Engine {
    model: Arc<Model>,
    batch_wait: Duration,
    /// Sequences served in the last step and not back yet (sampling); the
    /// next step waits for them, up to `batch_wait`.
    expected: HashSet<u64>,
    decode: Vec<Job>,
    prefill: Vec<Job>,
    largest_batch: Arc<AtomicUsize>,
}

impl Engine {
    fn new(model: Arc<Model>, batch_wait: Duration, largest_batch: Arc<AtomicUsize>) -> Self {
        Engine {
            model,
            batch_wait,
            expected: HashSet::new(),
            decode: Vec::new(),
            prefill: Vec::new(),
            largest_batch,
        }
    }

    fn accept(&mut self, msg: Msg) {
        match msg {
            Msg::Step(job) => {
                self.expected.remove(&job.seq);
                if job.tokens.len() == 1 || job.rows {
                    self.decode.push(job);
                } else {
                    self.prefill.push(job);
                }
            }
            Msg::Leave(seq) => {
                self.expected.remove(&seq);
            }
        }
    }

    fn run(mut self, rx: mpsc::Receiver<Msg>) {
        loop {
            if self.decode.is_empty() && self.prefill.is_empty() {
                let Ok(msg) = rx.recv() else { return };
                self.accept(msg);
            }
            // Gather: everything already queued, then whoever we just served,
            // for at most `batch_wait`.
            let deadline = Instant::now() + self.batch_wait;
            loop {
                while let Ok(msg) = rx.try_recv() {
                    self.accept(msg);
                }
                if self.expected.is_empty() {
                    break;
                }
                let left = deadline.saturating_duration_since(Instant::now());
                match rx.recv_timeout(left) {
                    Ok(msg) => self.accept(msg),
                    Err(mpsc::RecvTimeoutError::Timeout) => {
                        // Late ones (e.g. blocked on a slow client) are
                        // stepped whenever they come back.
                        self.expected.clear();
                        break;
                    }
                    Err(mpsc::RecvTimeoutError::Disconnected) => break,
                }
            }
            if !self.decode.is_empty() {
                let mut jobs = std::mem::take(&mut self.decode);
                self.largest_batch.fetch_max(jobs.len(), Ordering::Relaxed);
                let verifying = jobs.iter().any(|j| j.rows);
                let (mut sessions, tokens): (Vec<&mut Session>, Vec<&[u32]>) = jobs
                    .iter_mut()
                    .map(|j| (&mut j.session, j.tokens.as_slice()))
                    .unzip();
                let result = guarded(|| {
                    if verifying {
                        // A single token is a verify pass of one row.
                        self.model.decode_rows(&mut sessions, &tokens)
                    } else {
                        let tokens: Vec<u32> = tokens.iter().map(|t| t[0]).collect();
                        self.model.decode_batch(&mut sessions, &tokens)
                    }
                });
                for job in jobs {
                    self.finish(job, result.clone());
                }
            }
            for mut job in std::mem::take(&mut self.prefill) {
                let result = guarded(|| job.session.prefill(&job.tokens).map(|_| ()));
                self.finish(job, result);
            }
        }
    }

    fn finish(&mut self, job: Job, result: Result<(), String>) {
        let Job {
            seq,
            session,
            reply,
            ..
        } = job;
        if reply.send(Done { session, result }).is_ok() {
            self.expected.insert(seq);
        }
    }
}

/// Runs a forward pass; an error or a panic (a bug) fails only the step's
/// sequences, and the engine keeps serving the others.
fn guarded(f: impl FnOnce() -> Result<(), samplerd_model::ModelError>) -> Result<(), String> {
    match std::panic::catch_unwind(std::panic::AssertUnwindSafe(f)) {
        Ok(r) => r.map_err(|e| e.to_string()),
        Err(_) => Err("the forward pass panicked".into()),
    }
}
