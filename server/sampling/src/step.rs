//! One sampling step, the same for every RPC: `Sample`, each message of a
//! `SampleStream` and each token of `Generate` call [`load`] then [`run`],
//! so for the same logits, parameters, seed and step they report the same
//! token and the same `probability`, `logprob` and `probs`, bit for bit.
//!
//! 1. [`load`] copies the logits into a (pooled) [`TokenBuffer`] in one
//!    fused pass per 4 KiB block: copy, reject NaN/+inf naming the index,
//!    track the max and sum the raw log-sum-exp (`crate::scan`). A caller
//!    that has the sum computed elsewhere (the server's helper core) passes
//!    it as a [`DeferredLse`], and the pass only copies and checks.
//! 2. [`run`] runs the chain (`Sequence::sample`) with the randomness of
//!    `(seed, step)`, then reads the chosen token's post-chain probability
//!    and, with `n_probs`, the top candidates: raw (before any stage,
//!    llama.cpp's `n_probs`) or post-chain (`post_sampling_probs`, as
//!    llama-server's option of that name). `logprob` is always the raw
//!    logit's log-softmax, `logit − log Σ exp(logits)`.
//!
//! The step does not `accept` the chosen token: a stateful caller does,
//! after deciding whether the token ends the sequence.

use crate::buffer::TokenBuffer;
use crate::error::{LogitsError, SampleError};
use crate::logits;
use crate::sequence::Sequence;

/// The logits of one step, as the caller has them.
#[derive(Clone, Copy, Debug)]
pub enum Logits<'a> {
    /// Floats (a model's output, or the repeated-float request field).
    Floats(&'a [f32]),
    /// Little-endian f32 bytes (the raw-bytes request field); the length is
    /// a multiple of 4 (checked by [`load`]).
    F32le(&'a [u8]),
}

impl Logits<'_> {
    /// Number of logits.
    pub fn len(&self) -> usize {
        match self {
            Logits::Floats(f) => f.len(),
            Logits::F32le(b) => b.len() / 4,
        }
    }

    /// Whether there are none.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The raw logit of `token` (as given, before any stage).
    pub fn get(&self, token: u32) -> f32 {
        let i = token as usize;
        match self {
            Logits::Floats(f) => f[i],
            Logits::F32le(b) => {
                f32::from_le_bytes([b[4 * i], b[4 * i + 1], b[4 * i + 2], b[4 * i + 3]])
            }
        }
    }
}

/// A raw log-sum-exp computed somewhere else while the step runs (the
/// server's helper core); [`finish`](DeferredLse::finish) is called only
/// once the chain is done, so the other side has had that long.
pub trait DeferredLse {
    /// The value, bit for bit the fused pass's.
    fn finish(self) -> f32;
}

/// No deferred sum (the fused pass computes it).
pub enum NoDeferral {}

impl DeferredLse for NoDeferral {
    fn finish(self) -> f32 {
        match self {}
    }
}

/// The raw logits' log-sum-exp: known after the fused pass, or deferred.
pub enum RawLse<D> {
    Known(f32),
    Deferred(D),
}

impl<D: DeferredLse> RawLse<D> {
    fn get(self) -> f32 {
        match self {
            RawLse::Known(v) => v,
            RawLse::Deferred(d) => d.finish(),
        }
    }
}

/// Loads `logits` into `buf` in one fused pass (copy, check, max and —
/// unless `deferred` has it — the raw log-sum-exp).
pub fn load<D: DeferredLse>(
    buf: &mut TokenBuffer,
    logits: Logits<'_>,
    deferred: Option<D>,
) -> Result<RawLse<D>, LogitsError> {
    match (logits, deferred) {
        (Logits::F32le(b), Some(d)) => buf.load_f32le_checked(b).map(|_| RawLse::Deferred(d)),
        (Logits::F32le(b), None) => buf.load_f32le_scan(b).map(|s| RawLse::Known(s.log_sum_exp)),
        // The float path has no helper: its sum is always fused.
        (Logits::Floats(f), _) => buf.load_scan(f).map(|s| RawLse::Known(s.log_sum_exp)),
    }
}

/// Which candidate probabilities a step reports.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct ProbsRequest {
    /// How many (0: none).
    pub n: usize,
    /// Post-chain probabilities of the survivors instead of the raw
    /// softmax over the whole vocabulary.
    pub post_sampling: bool,
}

/// One reported candidate.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Candidate {
    pub token_id: u32,
    /// Raw softmax (default) or post-chain probability (`post_sampling`).
    pub probability: f32,
    /// Raw log-softmax of the token's logit.
    pub logprob: f32,
}

/// What one step produced.
#[derive(Clone, Debug, PartialEq)]
pub struct StepOutput {
    pub token_id: u32,
    /// The chosen token's probability after the chain.
    pub probability: f32,
    /// The chosen token's raw log-softmax.
    pub logprob: f32,
    /// The requested candidates, most probable first (ties by id).
    pub probs: Vec<Candidate>,
}

/// Runs the chain over the logits [`load`] put in `buf` (`lse` is what it
/// returned) and reads the probabilities. Does not accept the token.
pub fn run<D: DeferredLse>(
    seq: &mut Sequence,
    buf: &mut TokenBuffer,
    logits: Logits<'_>,
    lse: RawLse<D>,
    seed: u64,
    step: u64,
    probs: ProbsRequest,
) -> Result<StepOutput, SampleError> {
    run_choosing(seq, buf, logits, lse, seed, step, probs, |_, chosen| {
        Ok(chosen)
    })
}

/// [`run`], with `choose` deciding the token reported from the buffer as
/// the chain left it and the token the chain chose — what speculative
/// verification ([`crate::verify`]) needs where its rule, not the chain's
/// draw, picks the token (REJECTION). Everything else is [`run`]'s.
#[allow(clippy::too_many_arguments)]
pub fn run_choosing<D: DeferredLse>(
    seq: &mut Sequence,
    buf: &mut TokenBuffer,
    logits: Logits<'_>,
    lse: RawLse<D>,
    seed: u64,
    step: u64,
    probs: ProbsRequest,
    choose: impl FnOnce(&TokenBuffer, u32) -> Result<u32, SampleError>,
) -> Result<StepOutput, SampleError> {
    let n = probs.n;
    // The raw top has to be read before the chain edits the buffer.
    let raw_top = (n > 0 && !probs.post_sampling).then(|| logits::top_n(buf.dense(), n));
    let chosen = seq.sample(buf, seed, step)?.token_id;
    let token_id = choose(buf, chosen)?;
    // Needed only after the chain: a deferred sum has had the copy and the
    // chain's time.
    Ok(report(
        buf,
        token_id,
        raw_top,
        probs,
        || lse.get(),
        |id| logits.get(id),
    ))
}

/// The step's output once the chain chose `token_id` in `buf`: its
/// post-chain probability and the requested candidates (`raw_top`, the
/// raw top n as (id, logit), or the survivors' post-chain top), every
/// log-probability `raw(id) − lse` with `lse` the raw logits'
/// log-sum-exp (asked for only after the post-chain distribution).
pub(crate) fn report(
    buf: &TokenBuffer,
    token_id: u32,
    raw_top: Option<Vec<(u32, f32)>>,
    probs: ProbsRequest,
    lse: impl FnOnce() -> f32,
    raw: impl Fn(u32) -> f32,
) -> StepOutput {
    let post_n = if probs.post_sampling { probs.n } else { 0 };
    let (post_top, probability) = buf.distribution(post_n, token_id);
    let lse = lse();
    let probs = match raw_top {
        Some(top) => top
            .into_iter()
            .map(|(token_id, l)| Candidate {
                token_id,
                probability: (l - lse).exp(),
                logprob: l - lse,
            })
            .collect(),
        None => post_top
            .into_iter()
            .map(|(token_id, probability)| Candidate {
                token_id,
                probability,
                logprob: raw(token_id) - lse,
            })
            .collect(),
    };
    StepOutput {
        token_id,
        probability,
        logprob: raw(token_id) - lse,
        probs,
    }
}

/// Ids of `tokens` inside a vocabulary of `n_vocab` (ids at or above it
/// are skipped, as llama.cpp does).
pub fn in_vocab(tokens: &[u32], n_vocab: usize) -> impl Iterator<Item = u32> + '_ {
    tokens
        .iter()
        .copied()
        .filter(move |&t| (t as usize) < n_vocab)
}
