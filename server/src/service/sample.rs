//! `Sample`: one stateless step. Also home of [`run_step`], the response
//! side of the one step ([`samplerd_sampling::step`]) that `Sample` and
//! `SampleStream` run (and `Generate` runs too), so a stream step returns
//! exactly what `Sample` returns for the same inputs; and of
//! [`run_verify`], the streams' speculative verification, a loop of that
//! step.

#![forbid(unsafe_code)]

use std::sync::Arc;
use std::time::Instant;

use prost::bytes::Bytes;
use samplerd_api::v1;
use samplerd_sampling::{Sequence, TokenBuffer, sparse, step, verify};
use tonic::Status;
use tracing::Instrument;

use super::constraint::Prepared;
use super::lse_helper::LseJob;
use super::shared_memory::SharedRow;
use super::state::AppState;
use super::validate::verify::ValidVerify;
use super::validate::{self, ValidStep};
use crate::request::convert::{self, FIELD_LOGITS, FIELD_LOGITS_F32LE, FIELD_SPARSE, StepLogits};
use crate::request::errors::RequestError;
use crate::transport::identity::Caller;

impl step::DeferredLse for LseJob {
    fn finish(self) -> f32 {
        LseJob::finish(self)
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

/// Loads and samples one step ([`samplerd_sampling::step`], the step every
/// RPC runs) and builds the response. Does not accept the chosen token.
pub fn run_step(
    seq: &mut Sequence,
    buf: &mut TokenBuffer,
    input: ValidStep<'_>,
    seed: u64,
    helper: Option<LseJob>,
) -> Result<v1::SampleResponse, RequestError> {
    let field = input.logits.field();
    let out = match input.logits.as_step() {
        StepLogits::Dense(logits) => {
            let lse = step::load(buf, logits, helper).map_err(|source| RequestError::Logits {
                field: field.into(),
                source,
            })?;
            step::run(seq, buf, logits, lse, seed, input.step, input.probs)
        }
        StepLogits::Sparse(row) => sparse::run(seq, buf, row, seed, input.step, input.probs),
    }
    .map_err(|e| RequestError::from_sample(e, field))?;
    Ok(v1::SampleResponse {
        token_id: out.token_id,
        probability: out.probability,
        logprob: out.logprob,
        seed,
        probs: convert::token_probabilities(&out.probs),
        step: input.step,
        verify: None,
    })
}

/// Verifies a stream's drafts ([`samplerd_sampling::verify`]: the loop of
/// the same step) on `seq` at step `step` and builds the response: the
/// accepted drafts and the token after them in `verify`, that last token
/// in the top-level fields. Accepts the accepted drafts, not the last
/// token (as [`run_step`] leaves its token to the caller).
pub fn run_verify(
    seq: &mut Sequence,
    buf: &mut TokenBuffer,
    pool: &crate::request::buffer_pool::BufferPool,
    valid: &ValidVerify<'_>,
    seed: u64,
    step: u64,
) -> Result<v1::SampleResponse, RequestError> {
    let (target, drafter) = valid.rows();
    // The drafter's rows need a buffer of their own (REJECTION only).
    let mut scratch = if drafter.is_empty() {
        TokenBuffer::new()
    } else {
        pool.take()
    };
    let out = verify::verify(
        seq,
        buf,
        &mut scratch,
        valid.mode,
        verify::Draft {
            tokens: valid.drafts,
            target: &target,
            drafter: &drafter,
        },
        seed,
        step,
        valid.probs,
    );
    if !drafter.is_empty() {
        pool.put(scratch);
    }
    let out = out.map_err(|e| match e {
        verify::VerifyError::Logits { row, source }
        | verify::VerifyError::Sample {
            row,
            source: samplerd_sampling::SampleError::Logits(source),
        } => RequestError::Logits {
            field: format!("verify.{row}.logits"),
            source,
        },
        // A sparse row that cannot prove its step: the refusal names the row.
        verify::VerifyError::Sample {
            row,
            source: samplerd_sampling::SampleError::Sparse(mut r),
        } => {
            r.message = format!("verify.{row}.sparse: {}", r.message);
            RequestError::Sparse(r)
        }
        verify::VerifyError::Sample { source, .. } => RequestError::from_sample(source, "verify"),
        e @ verify::VerifyError::Terminal { .. } => RequestError::invalid("params", e.to_string()),
        e @ verify::VerifyError::Shape(_) => RequestError::invalid("verify", e.to_string()),
    })?;
    let tokens: Vec<v1::SampleResponse> = out
        .tokens
        .iter()
        .zip(step..)
        .map(|(t, step)| v1::SampleResponse {
            token_id: t.token_id,
            probability: t.probability,
            logprob: t.logprob,
            seed,
            probs: convert::token_probabilities(&t.probs),
            step,
            verify: None,
        })
        .collect();
    let last = tokens
        .last()
        .cloned()
        .expect("verify reports at least one token");
    Ok(v1::SampleResponse {
        verify: Some(v1::VerifyResult {
            accepted: out.accepted as u32,
            tokens,
        }),
        ..last
    })
}

/// The whole stateless step, on a sampling thread, its constraint
/// compiled beforehand (`prepared`; public for the protobuf fuzz target,
/// `fuzz/fuzz_targets/proto_request.rs`).
pub fn sample_blocking(
    state: &AppState,
    req: &v1::SampleRequest,
    prepared: &Prepared,
    caller: &Caller,
) -> Result<v1::SampleResponse, RequestError> {
    let shared = state.shared.resolve_in(
        req.shared.as_ref(),
        &[
            (!req.logits.is_empty(), FIELD_LOGITS),
            (!req.logits_f32le.is_empty(), FIELD_LOGITS_F32LE),
            (req.sparse.is_some(), FIELD_SPARSE),
        ],
        caller,
        state.limits.max_vocab,
    )?;
    let shared_logits = shared.as_ref().map(SharedRow::logits);
    let helper = start_lse(state, &req.logits_f32le);
    let valid = validate::sample(state, req, prepared.prebuilt(), shared_logits.as_ref())?;
    let span = tracing::Span::current();
    span.record("seed", valid.seed);
    if tracing::enabled!(tracing::Level::DEBUG) {
        span.record("chain", super::state::chain_for_log(&valid.chain));
    }
    let mut seq = valid.open_sequence()?;
    let mut buf = state.pool.take();
    let result = run_step(&mut seq, &mut buf, valid.step, valid.seed, helper);
    state.pool.put(buf);
    if let Some(row) = &shared {
        state.shared.check_read(row)?;
    }
    result
}

/// The `Sample` RPC.
pub async fn handle(
    state: Arc<AppState>,
    req: v1::SampleRequest,
    caller: Caller,
) -> Result<v1::SampleResponse, Status> {
    let request_id = state.request_id();
    let span = tracing::debug_span!(
        "sample",
        seq = request_id,
        chain = tracing::field::Empty,
        seed = tracing::field::Empty,
        step = req.step,
        us = tracing::field::Empty,
    );
    let inner = span.clone();
    let start = Instant::now();
    let _charge = state
        .memory
        .charge(
            crate::request::memory::request_bytes(
                req.logits.len() + crate::request::memory::sparse_floats(req.sparse.as_ref()),
                req.logits_f32le.len(),
                req.previous_tokens.len(),
                req.params.as_ref(),
            ),
            "this Sample request",
        )
        .map_err(Status::from)?;
    // Compiled off the sampling threads (nothing to do without one).
    let prepared = state
        .prepare_constraints(req.params.as_ref(), None, request_id)
        .instrument(span.clone())
        .await
        .inspect_err(|e| span.in_scope(|| tracing::debug!(error = %e, "sample failed")))?;
    let steps = state.steps.clone();
    let result = steps
        .run(move || {
            // For the crash report, should a plugin kill the process.
            let _serving = samplerd_sampling::activity::serving(request_id);
            inner.in_scope(|| sample_blocking(&state, &req, &prepared, &caller))
        })
        .instrument(span.clone())
        .await
        .inspect_err(|e| span.in_scope(|| tracing::warn!(error = %e, "sample failed")))?;
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
