//! `SampleBatch`: B stateless steps in one call. Each row is one `Sample`
//! — validated by the same checks, run by the same step
//! ([`super::sample::run_step`]) — so row i's result is bit for bit what
//! `Sample` returns for row i. The rows run in parallel, one sampling-pool
//! job each (each with its own `limits.max_step_ms` budget); the response
//! keeps the request's order, and the first failing row (by index) fails
//! the call, naming `rows[i]`.

#![forbid(unsafe_code)]

use std::sync::Arc;
use std::time::Instant;

use samplerd_api::v1;
use tonic::Status;

use super::AppState;
use super::memory;
use super::sample::run_step;
use super::validate::batch::{self as valid, Dtype, RowLogits};
use crate::service::errors::RequestError;

/// The memory a batch holds while it is served: each row as a `Sample`
/// request, plus the f32 copy a half-width row is widened into.
pub fn batch_bytes(req: &v1::SampleBatchRequest, dtype: Dtype) -> usize {
    let widened = |bytes: usize| match dtype {
        Dtype::F32le => 0,
        Dtype::F16le | Dtype::Bf16le => bytes * 2,
    };
    req.rows
        .iter()
        .map(|r| {
            memory::request_bytes(
                0,
                r.logits.len(),
                r.previous_tokens.len() + r.constraint_tokens.len(),
                r.params.as_ref(),
            ) + widened(r.logits.len())
        })
        .sum::<usize>()
        + memory::request_bytes(0, 0, 0, req.params.as_ref())
}

/// Row `i`, whole, on a sampling thread.
fn row_blocking(
    state: &AppState,
    req: &v1::SampleBatchRequest,
    dtype: Dtype,
    i: usize,
) -> Result<v1::SampleResponse, RequestError> {
    let logits = RowLogits::decode(dtype, &req.rows[i].logits, state.limits.max_vocab)
        .map_err(|e| e.in_row(i))?;
    let start = valid::row(state, req, i, &logits)?;
    let mut seq = start.open_sequence().map_err(|e| e.in_row(i))?;
    let mut buf = state.pool.take();
    let result = run_step(&mut seq, &mut buf, start.step, start.seed, None);
    state.pool.put(buf);
    result.map_err(|e| e.in_row(i))
}

/// The whole batch on this thread, row after row: [`handle`]'s checks
/// and steps without the pool (public for the protobuf fuzz target,
/// `fuzz/fuzz_targets/proto_request.rs`).
pub fn sample_batch_blocking(
    state: &AppState,
    req: &v1::SampleBatchRequest,
) -> Result<Vec<v1::SampleResponse>, RequestError> {
    let dtype = valid::batch(state, req)?;
    (0..req.rows.len())
        .map(|i| row_blocking(state, req, dtype, i))
        .collect()
}

/// The `SampleBatch` RPC.
pub async fn handle(
    state: Arc<AppState>,
    req: v1::SampleBatchRequest,
) -> Result<v1::SampleBatchResponse, Status> {
    let request_id = state.request_id();
    let span = tracing::debug_span!("sample_batch", request_id, rows = req.rows.len());
    let t0 = Instant::now();
    let dtype = valid::batch(&state, &req)?;
    let _charge = state
        .memory
        .charge(batch_bytes(&req, dtype), "this SampleBatch request")?;
    let n = req.rows.len();
    let req = Arc::new(req);
    let jobs: Vec<_> = (0..n)
        .map(|i| {
            let (state, req) = (Arc::clone(&state), Arc::clone(&req));
            move || {
                // For the crash report, should a plugin kill the process.
                let _serving = samplerd_sampling::activity::serving(request_id);
                row_blocking(&state, &req, dtype, i)
            }
        })
        .collect();
    let results = state.steps.run_many(jobs).await;
    let mut rows = Vec::with_capacity(n);
    for (i, r) in results.into_iter().enumerate() {
        // Row errors name their row already; a step failure gets it here.
        let e = match r {
            Ok(Ok(resp)) => {
                rows.push(resp);
                continue;
            }
            Ok(Err(e)) => e,
            Err(failure) => RequestError::from(failure).in_row(i),
        };
        span.in_scope(|| tracing::debug!(error = %e, "sample batch failed"));
        return Err(e.into());
    }
    span.in_scope(|| tracing::debug!(us = t0.elapsed().as_micros() as u64, "sampled batch"));
    Ok(v1::SampleBatchResponse {
        rows,
        sequence_ids: Vec::new(),
    })
}
