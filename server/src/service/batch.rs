//! `SampleBatch`: B stateless steps in one call. Each row is one `Sample`
//! — validated by the same checks, run by the same step
//! ([`super::sample::run_step`]) — so row i's result is bit for bit what
//! `Sample` returns for row i. The rows' constraints are compiled first,
//! off the sampling threads, once per distinct `params` (the batch's
//! shared `params` once for every row that has none of its own). The rows
//! then run in parallel, one sampling-pool job each (each with its own
//! `limits.max_step_ms` budget); the response keeps the request's order,
//! and the first failing row (by index) fails the call, naming `rows[i]`.
//!
//! A row the watchdog writes off ends the batch at once: the rows behind
//! it never run, and the call fails with that row's error
//! (`StepPool::run_batch`). When a chain names a stage from outside the
//! libraries samplerd ships (the core and constraint stages, whose steps
//! are bounded), the first row runs alone before the others, so a stage
//! that never returns costs one sampling thread per batch, not one per
//! row (before: 8 such rows took 16 s and every thread of a 6-thread
//! pool).

#![forbid(unsafe_code)]

use std::sync::Arc;
use std::time::Instant;

use samplerd_api::v1;
use tonic::Status;

use samplerd_sampling::params::CONSTRAINT_STAGE;

use super::constraint::{CONSTRAINT_PLUGIN_FILE, Prepared};
use super::sample::run_step;
use super::state::AppState;
use super::validate::batch as valid;
use super::validate::row_logits::{Dtype, RowLogits};
use crate::request::convert::{FIELD_LOGITS, FIELD_SPARSE};
use crate::request::errors::RequestError;
use crate::request::memory;
use crate::transport::identity::Caller;

/// The memory a batch holds while it is served: each row as a `Sample`
/// request, plus the f32 copy a half-width row is widened into.
pub fn batch_bytes(req: &v1::SampleBatchRequest, dtype: Dtype) -> usize {
    let widened = |bytes: usize| match dtype {
        Dtype::F32le => 0,
        Dtype::F16le | Dtype::Bf16le => bytes * 2,
    };
    // A shared row is read in place: only its widened copy is held.
    let shared = |r: &v1::BatchRow| {
        r.shared
            .as_ref()
            .map_or(0, |s| match Dtype::from_proto(s.dtype) {
                Ok(Dtype::F16le | Dtype::Bf16le) => s.count as usize * 4,
                _ => 0,
            })
    };
    req.rows
        .iter()
        .map(|r| {
            shared(r)
                + memory::request_bytes(
                    memory::sparse_floats(r.sparse.as_ref()),
                    r.logits.len(),
                    r.previous_tokens.len() + r.constraint_tokens.len(),
                    r.params.as_ref(),
                )
                + widened(r.logits.len())
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
    prepared: &Prepared,
    caller: &Caller,
) -> Result<v1::SampleResponse, RequestError> {
    let r = &req.rows[i];
    let shared = state
        .shared
        .resolve_in(
            r.shared.as_ref(),
            &[
                (!r.logits.is_empty(), FIELD_LOGITS),
                (r.sparse.is_some(), FIELD_SPARSE),
            ],
            caller,
            state.limits.max_vocab,
        )
        .map_err(|e| e.in_row(i))?;
    let logits = match &shared {
        Some(row) => row.logits(),
        None => RowLogits::decode(dtype, &r.logits, r.sparse.as_ref(), state.limits.max_vocab)
            .map_err(|e| e.in_row(i))?,
    };
    let start = valid::row(state, req, i, &logits, prepared.prebuilt())?;
    let mut seq = start.open_sequence().map_err(|e| e.in_row(i))?;
    let mut buf = state.pool.take();
    let result = run_step(&mut seq, &mut buf, start.step, start.seed, None);
    state.pool.put(buf);
    if let Some(row) = &shared {
        state.shared.check_read(row).map_err(|e| e.in_row(i))?;
    }
    result.map_err(|e| e.in_row(i))
}

/// The whole batch on this thread, row after row: [`handle`]'s checks
/// and steps without the pools (public for the protobuf fuzz target,
/// `fuzz/fuzz_targets/proto_request.rs`).
pub fn sample_batch_blocking(
    state: &AppState,
    req: &v1::SampleBatchRequest,
    caller: &Caller,
) -> Result<Vec<v1::SampleResponse>, RequestError> {
    let dtype = valid::batch(state, req)?;
    let mut prepared = Prepared::default();
    for (i, params) in distinct_params(req) {
        let p = state
            .prepare_constraints_blocking(params, None)
            .map_err(|e| e.in_row(i))?;
        prepared.extend(&p);
    }
    (0..req.rows.len())
        .map(|i| row_blocking(state, req, dtype, i, &prepared, caller))
        .collect()
}

/// Each distinct `params` the rows use (a row's own, else the batch's),
/// with the first row that uses it.
fn distinct_params(req: &v1::SampleBatchRequest) -> Vec<(usize, Option<&v1::SamplingParams>)> {
    let mut out: Vec<(usize, Option<&v1::SamplingParams>)> = Vec::new();
    for (i, r) in req.rows.iter().enumerate() {
        let p = r.params.as_ref().or(req.params.as_ref());
        let same = |q: &Option<&v1::SamplingParams>| match (q, p) {
            (Some(a), Some(b)) => std::ptr::eq(*a, b),
            (None, None) => true,
            _ => false,
        };
        if !out.iter().any(|(_, q)| same(q)) {
            out.push((i, p));
        }
    }
    out
}

/// Whether a row's chain may name a stage from a library samplerd does
/// not ship (`params.chain`, `params.samplers`): its step is not known to
/// end, so the batch runs a first row alone before the rest.
fn needs_canary(state: &AppState, req: &v1::SampleBatchRequest) -> bool {
    let shipped = |name: &str| {
        let name = samplerd_sampling::params::canonical_stage_name(name);
        state.registry.get(name).is_none_or(|info| {
            let file = info.path.file_name().and_then(|f| f.to_str());
            let (core, core_file) = samplerd_sampling::chain::CORE_LIBRARY;
            (info.library == core && file == Some(core_file))
                || (name == CONSTRAINT_STAGE && file == Some(CONSTRAINT_PLUGIN_FILE))
        })
    };
    req.rows
        .iter()
        .filter_map(|r| r.params.as_ref())
        .chain(req.params.as_ref())
        .any(|p| {
            p.chain.iter().any(|s| !shipped(&s.name)) || p.samplers.iter().any(|s| !shipped(s))
        })
}

/// The rows' constraints, compiled off the sampling threads (concurrently,
/// each distinct `params` once), an error naming the first row that uses
/// the failing one.
async fn prepare(
    state: &AppState,
    req: &v1::SampleBatchRequest,
    request_id: u64,
) -> Result<Prepared, RequestError> {
    let groups = distinct_params(req);
    let results = futures::future::join_all(
        groups
            .iter()
            .map(|&(_, p)| state.prepare_constraints(p, None, request_id)),
    )
    .await;
    let mut prepared = Prepared::default();
    for ((i, _), r) in groups.into_iter().zip(results) {
        prepared.extend(&r.map_err(|e| e.in_row(i))?);
    }
    Ok(prepared)
}

/// The `SampleBatch` RPC.
pub async fn handle(
    state: Arc<AppState>,
    req: v1::SampleBatchRequest,
    caller: Caller,
) -> Result<v1::SampleBatchResponse, Status> {
    let request_id = state.request_id();
    let span = tracing::debug_span!("sample_batch", seq = request_id, rows = req.rows.len());
    let t0 = Instant::now();
    let dtype = valid::batch(&state, &req)?;
    let _charge = state
        .memory
        .charge(batch_bytes(&req, dtype), "this SampleBatch request")?;
    let prepared = Arc::new(prepare(&state, &req, request_id).await?);
    let canary = needs_canary(&state, &req);
    let n = req.rows.len();
    let req = Arc::new(req);
    let jobs: Vec<_> = (0..n)
        .map(|i| {
            let (state, req, prepared) =
                (Arc::clone(&state), Arc::clone(&req), Arc::clone(&prepared));
            move || {
                // For the crash report, should a plugin kill the process.
                let _serving = samplerd_sampling::activity::serving(request_id);
                row_blocking(&state, &req, dtype, i, &prepared, &caller)
            }
        })
        .collect();
    let results = state
        .steps
        .run_batch(jobs, canary)
        .await
        // Row errors name their row already; a step failure gets it here.
        .map_err(|(i, failure)| RequestError::from(failure).in_row(i));
    let rows = results.and_then(|results| results.into_iter().collect::<Result<Vec<_>, _>>());
    let rows = match rows {
        Ok(rows) => rows,
        Err(e) => {
            span.in_scope(|| tracing::debug!(error = %e, "sample batch failed"));
            return Err(e.into());
        }
    };
    span.in_scope(|| tracing::debug!(us = t0.elapsed().as_micros() as u64, "sampled batch"));
    Ok(v1::SampleBatchResponse {
        rows,
        sequence_ids: Vec::new(),
    })
}
