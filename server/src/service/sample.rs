//! `Sample`: one stateless step. Also home of [`run_step`], the step both
//! `Sample` and `SampleStream` run, so a stream step returns exactly what
//! `Sample` returns for the same inputs.

use std::sync::Arc;
use std::time::Instant;

use prost::bytes::Bytes;
use samplerd_api::v1;
use samplerd_sampling::{Sequence, TokenBuffer, logits};
use tonic::Status;
use tracing::Instrument;

use super::lse_helper::LseJob;
use super::{AppState, offload};
use crate::convert::LogitsInput;
use crate::errors::RequestError;

/// What one step needs besides the chain state.
#[derive(Clone, Copy, Debug)]
pub struct StepInput<'a> {
    pub logits: LogitsInput<'a>,
    pub seed: u64,
    pub step: u64,
    pub n_probs: u32,
    pub post_sampling_probs: bool,
}

/// Checks `n_probs` against the limit.
pub fn check_n_probs(n_probs: u32, state: &AppState) -> Result<(), RequestError> {
    if n_probs > state.limits.max_n_probs {
        return Err(RequestError::invalid(
            "n_probs",
            format!(
                "{n_probs} exceeds the limit of {} (limits.max_n_probs)",
                state.limits.max_n_probs
            ),
        ));
    }
    Ok(())
}

/// The raw logits' log-sum-exp (for `logprob`): known after a fused load,
/// or being summed with the helper core (`lse_helper`).
pub enum RawLse {
    Known(f32),
    Helper(LseJob),
}

impl RawLse {
    /// The value (with the helper: once the chunks left are done here).
    pub fn get(self) -> f32 {
        match self {
            RawLse::Known(v) => v,
            RawLse::Helper(job) => job.finish(),
        }
    }
}

/// Hands the log-sum-exp of raw-byte logits to the helper core when it is
/// free (call first thing, so it starts while the request is checked).
pub fn start_lse(state: &AppState, bytes: &Bytes) -> Option<LseJob> {
    if bytes.is_empty() {
        return None;
    }
    state.lse.start(bytes)
}

/// Loads the logits into `buf`, validating them (NaN / +inf name the
/// index) and computing their log-sum-exp (for `logprob`) in the same
/// pass — or, when `helper` has it, only copying and checking them.
pub fn load(
    buf: &mut TokenBuffer,
    input: LogitsInput<'_>,
    helper: Option<LseJob>,
) -> Result<RawLse, RequestError> {
    let r = match (input, helper) {
        (LogitsInput::Bytes(b), Some(job)) => {
            buf.load_f32le_checked(b).map(|_| RawLse::Helper(job))
        }
        (LogitsInput::Bytes(b), None) => {
            buf.load_f32le_scan(b).map(|s| RawLse::Known(s.log_sum_exp))
        }
        (LogitsInput::Floats(f), _) => buf.load_scan(f).map(|s| RawLse::Known(s.log_sum_exp)),
    };
    r.map_err(|source| RequestError::Logits {
        field: input.field(),
        source,
    })
}

/// Ids of `tokens` inside the vocabulary (ids >= `n_vocab` are skipped,
/// as llama.cpp does).
pub fn in_vocab(tokens: &[u32], n_vocab: usize) -> impl Iterator<Item = u32> + '_ {
    tokens
        .iter()
        .copied()
        .filter(move |&t| (t as usize) < n_vocab)
}

/// Runs the chain on logits already loaded into `buf` (`lse` is what
/// [`load`] returned) and builds the response. Does not accept the chosen
/// token.
pub fn run_step(
    seq: &mut Sequence,
    buf: &mut TokenBuffer,
    input: StepInput<'_>,
    lse: RawLse,
) -> Result<v1::SampleResponse, RequestError> {
    let n = input.n_probs as usize;
    let raw_top = (n > 0 && !input.post_sampling_probs).then(|| logits::top_n(buf.dense(), n));
    let sampled = seq
        .sample(buf, input.seed, input.step)
        .map_err(|e| RequestError::from_sample(e, input.logits.field()))?;
    let token = sampled.token_id;
    let post_n = if input.post_sampling_probs { n } else { 0 };
    let (post_top, probability) = buf.distribution(post_n, token);
    // Needed only now: the helper has had the copy and the chain's time.
    let lse = lse.get();
    let logprob_of = |id: u32| input.logits.get(id) - lse;
    let probs = match raw_top {
        Some(top) => top
            .into_iter()
            .map(|(token_id, l)| v1::TokenProbability {
                token_id,
                probability: (l - lse).exp(),
                logprob: l - lse,
            })
            .collect(),
        None => post_top
            .into_iter()
            .map(|(token_id, probability)| v1::TokenProbability {
                token_id,
                probability,
                logprob: logprob_of(token_id),
            })
            .collect(),
    };
    Ok(v1::SampleResponse {
        token_id: token,
        probability,
        logprob: logprob_of(token),
        seed: input.seed,
        probs,
        step: input.step,
    })
}

/// The whole stateless step, on a blocking thread (public for the
/// protobuf fuzz target, `fuzz/fuzz_targets/proto_request.rs`).
pub fn sample_blocking(
    state: &AppState,
    req: &v1::SampleRequest,
) -> Result<v1::SampleResponse, RequestError> {
    let helper = start_lse(state, &req.logits_f32le);
    let input = LogitsInput::from_request(&req.logits, &req.logits_f32le, state.limits.max_vocab)?;
    if req.previous_tokens.len() > state.limits.max_window_tokens {
        return Err(RequestError::invalid(
            "previous_tokens",
            format!(
                "{} tokens exceed the limit of {} (limits.max_window_tokens)",
                req.previous_tokens.len(),
                state.limits.max_window_tokens
            ),
        ));
    }
    check_n_probs(req.n_probs, state)?;
    let (chain, seed) = state
        .defaults
        .resolve(&state.registry, req.params.as_ref())?;
    let span = tracing::Span::current();
    span.record("seed", seed);
    if tracing::enabled!(tracing::Level::DEBUG) {
        span.record("chain", chain.describe());
    }
    let mut seq = chain
        .new_sequence()
        .map_err(|e| RequestError::from_sample(e, input.field()))?;
    seq.accept_all(&in_vocab(&req.previous_tokens, input.len()).collect::<Vec<_>>())
        .map_err(|e| RequestError::from_sample(e, input.field()))?;
    let mut buf = state.pool.take();
    let result = load(&mut buf, input, helper).and_then(|lse| {
        run_step(
            &mut seq,
            &mut buf,
            StepInput {
                logits: input,
                seed,
                step: req.step,
                n_probs: req.n_probs,
                post_sampling_probs: req.post_sampling_probs,
            },
            lse,
        )
    });
    state.pool.put(buf);
    result
}

/// The `Sample` RPC.
pub async fn handle(
    state: Arc<AppState>,
    req: v1::SampleRequest,
) -> Result<v1::SampleResponse, Status> {
    let span = tracing::debug_span!(
        "sample",
        request_id = state.request_id(),
        chain = tracing::field::Empty,
        seed = tracing::field::Empty,
        step = req.step,
        us = tracing::field::Empty,
    );
    let inner = span.clone();
    let start = Instant::now();
    let result = offload::run(move || inner.in_scope(|| sample_blocking(&state, &req)))
        .instrument(span.clone())
        .await?;
    span.record("us", start.elapsed().as_micros() as u64);
    let _e = span.enter();
    match result {
        Ok(r) => {
            tracing::debug!(token = r.token_id, "sampled");
            Ok(r)
        }
        Err(e) => {
            tracing::debug!(error = %e, "sample failed");
            Err(e.into())
        }
    }
}
