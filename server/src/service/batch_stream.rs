//! `SampleBatchStream`: B sequences, many steps, one stream — the batch
//! form of `SampleStream`. The server keeps each sequence's plugin states
//! (penalty window), seed and step counter by the client's sequence id; a
//! row with a new id joins, `leave` releases ids between messages. A
//! sequence's step t returns exactly what `SampleStream` (and so `Sample`)
//! returns for it. Each message's rows run in parallel, one sampling-pool
//! job each, and the response keeps the message's row order. Any failing
//! row ends the stream with its error (naming `rows[i]`), as a failing
//! step ends a `SampleStream`. A continuing row may carry a `Verify`
//! instead of logits, as a `SampleStream` message may.

#![forbid(unsafe_code)]

use std::collections::{HashMap, HashSet};
use std::sync::Arc;
use std::sync::atomic::Ordering;

use samplerd_api::v1;
use samplerd_sampling::Sequence;
use tokio::sync::OwnedSemaphorePermit;
use tonic::{Status, Streaming};
use tracing::Instrument;

use super::constraint::Prepared;
use super::sample::{run_step, run_verify};
use super::shared_memory::verify_rows::VerifyShared;
use super::state::{AppState, BoxStream};
use super::validate::batch as valid;
use super::validate::row_logits::{Dtype, RowLogits};
use super::validate::verify;
use crate::request::convert::{FIELD_LOGITS, FIELD_SPARSE};
use crate::request::errors::RequestError;
use crate::request::memory::{self, Charge};
use crate::transport::identity::Caller;
use crate::transport::status_fixup::completed;

/// One open sequence.
struct SeqState {
    seq: Sequence,
    seed: u64,
    /// The next step's index.
    step: u64,
    n_vocab: usize,
}

/// What a sequence is charged to the memory budget for its life: its
/// joining row as a request plus the per-logit cost of a session's stage
/// states (the token buffers are the pool's, lent per step).
fn sequence_bytes(
    row: &v1::BatchStreamRow,
    params: Option<&v1::SamplingParams>,
    dtype: Dtype,
) -> usize {
    let n_vocab = row.logits.len() / dtype.width();
    let n_vocab = n_vocab
        .max(row.sparse.as_ref().map_or(0, |s| s.vocab_size as usize))
        .max(row.shared.as_ref().map_or(0, |s| s.count as usize));
    memory::request_bytes(
        memory::sparse_floats(row.sparse.as_ref()),
        row.logits.len() / dtype.width() * 4,
        row.previous_tokens.len(),
        params,
    ) + n_vocab * memory::SESSION_BYTES_PER_LOGIT
}

/// One row's job: join (no state yet) or continue `state`.
fn row_blocking(
    state: &AppState,
    msg: &v1::SampleBatchStreamRequest,
    dtype: Dtype,
    i: usize,
    open: Option<SeqState>,
    prepared: &Prepared,
    caller: &Caller,
) -> (Option<SeqState>, Result<v1::SampleResponse, RequestError>) {
    let r = &msg.rows[i];
    let open = match (r.verify.as_ref(), open) {
        (Some(v), Some(mut s)) => {
            let result = verify_row(state, msg, i, v, &mut s, caller);
            return (Some(s), result.map_err(|e| e.in_row(i)));
        }
        (_, open) => open,
    };
    let shared = match state.shared.resolve_in(
        r.shared.as_ref(),
        &[
            (!r.logits.is_empty(), FIELD_LOGITS),
            (r.sparse.is_some(), FIELD_SPARSE),
        ],
        caller,
        state.limits.max_vocab,
    ) {
        Ok(s) => s,
        Err(e) => return (open, Err(e.in_row(i))),
    };
    let decoded = match &shared {
        Some(row) => Ok(row.logits()),
        None => RowLogits::decode(dtype, &r.logits, r.sparse.as_ref(), state.limits.max_vocab),
    };
    let logits = match decoded {
        Ok(l) => l,
        Err(e) => return (open, Err(e.in_row(i))),
    };
    let (mut seq_state, input) = match open {
        Some(s) => match valid::stream_step(state, msg, i, &logits, s.n_vocab, s.step) {
            Ok(input) => (s, input),
            Err(e) => return (Some(s), Err(e)),
        },
        None => {
            let start = match valid::stream_join(state, msg, i, &logits, prepared.prebuilt()) {
                Ok(v) => v,
                Err(e) => return (None, Err(e)),
            };
            let seq = match start.open_sequence() {
                Ok(s) => s,
                Err(e) => return (None, Err(e.in_row(i))),
            };
            let s = SeqState {
                seq,
                seed: start.seed,
                step: start.step.step,
                n_vocab: start.step.logits.len(),
            };
            (s, start.step)
        }
    };
    let mut buf = state.pool.take();
    let result = run_step(&mut seq_state.seq, &mut buf, input, seq_state.seed, None);
    state.pool.put(buf);
    // A row lost to a truncation: its token is not accepted.
    let lost = shared.as_ref().map(|row| state.shared.check_read(row));
    let result = result.and_then(|resp| {
        if let Some(Err(e)) = lost {
            return Err(e);
        }
        seq_state
            .seq
            .accept(resp.token_id)
            .map_err(|e| RequestError::from_sample(e, input.logits.field()))?;
        seq_state.step += 1;
        Ok(resp)
    });
    (Some(seq_state), result.map_err(|e| e.in_row(i)))
}

/// Continuing row `i`'s `Verify` on its sequence `s` (joining rows with
/// one are refused by the message's validation).
fn verify_row(
    state: &AppState,
    msg: &v1::SampleBatchStreamRequest,
    i: usize,
    v: &v1::Verify,
    s: &mut SeqState,
    caller: &Caller,
) -> Result<v1::SampleResponse, RequestError> {
    let l = &state.limits;
    let shared = VerifyShared::resolve(&state.shared, v, caller, l.max_draft_tokens, l.max_vocab)?;
    let valid = verify::batch_row(state, msg, i, v, s.n_vocab, &s.seq, shared.logits())?;
    let mut buf = state.pool.take();
    let result = run_verify(&mut s.seq, &mut buf, &state.pool, &valid, s.seed, s.step);
    state.pool.put(buf);
    // Before the tokens are accepted, as for a step's shared row.
    shared.check_read(&state.shared)?;
    let resp = result?;
    s.seq
        .accept(resp.token_id)
        .map_err(|e| RequestError::from_sample(e, "verify"))?;
    s.step += resp.verify.as_ref().map_or(1, |v| v.tokens.len()) as u64;
    Ok(resp)
}

/// The joining rows' constraints, compiled off the sampling threads
/// (each distinct `params` once), an error naming the first row that uses
/// the failing one.
async fn prepare(
    state: &AppState,
    msg: &v1::SampleBatchStreamRequest,
    joins: &[bool],
    request_id: u64,
) -> Result<Prepared, RequestError> {
    let mut prepared = Prepared::default();
    // Addresses of the params already prepared.
    let mut seen: Vec<usize> = Vec::new();
    for (i, r) in msg.rows.iter().enumerate().filter(|(i, _)| joins[*i]) {
        let Some(p) = r.params.as_ref().or(msg.params.as_ref()) else {
            continue;
        };
        let at = std::ptr::from_ref(p) as usize;
        if seen.contains(&at) {
            continue;
        }
        seen.push(at);
        let one = state
            .prepare_constraints(Some(p), None, request_id)
            .await
            .map_err(|e| e.in_row(i))?;
        prepared.extend(&one);
    }
    Ok(prepared)
}

/// The stream's state between messages.
struct Batch {
    state: Arc<AppState>,
    span: tracing::Span,
    request_id: u64,
    sequences: HashMap<u64, SeqState>,
    charges: HashMap<u64, Charge>,
    /// The compiled constraints each open sequence joined with.
    constraints: HashMap<u64, Arc<Prepared>>,
    inbound: Streaming<v1::SampleBatchStreamRequest>,
    _permit: OwnedSemaphorePermit,
    /// Whose shared-memory regions the rows may name.
    caller: Caller,
}

impl Drop for Batch {
    fn drop(&mut self) {
        self.state.open_sessions.fetch_sub(1, Ordering::Relaxed);
    }
}

impl Batch {
    /// One message → one response.
    async fn message(
        &mut self,
        msg: v1::SampleBatchStreamRequest,
    ) -> Result<v1::SampleBatchResponse, Status> {
        let open: HashSet<u64> = self.sequences.keys().copied().collect();
        let plan = valid::stream_message(&self.state, &msg, &open)?;
        for id in &msg.leave {
            self.sequences.remove(id);
            self.charges.remove(id);
            self.constraints.remove(id);
        }
        let params = msg.params.as_ref();
        for (r, _) in msg.rows.iter().zip(&plan.joins).filter(|(_, j)| **j) {
            let bytes = sequence_bytes(r, r.params.as_ref().or(params), plan.dtype);
            let charge = self
                .state
                .memory
                .charge(bytes, "this SampleBatchStream sequence")?;
            self.charges.insert(r.sequence_id, charge);
        }
        let prepared = prepare(&self.state, &msg, &plan.joins, self.request_id)
            .instrument(self.span.clone())
            .await?;
        let prepared = Arc::new(prepared);
        for (r, _) in msg.rows.iter().zip(&plan.joins).filter(|(_, j)| **j) {
            self.constraints
                .insert(r.sequence_id, Arc::clone(&prepared));
        }
        let ids: Vec<u64> = msg.rows.iter().map(|r| r.sequence_id).collect();
        let msg = Arc::new(msg);
        let request_id = self.request_id;
        let jobs: Vec<_> = ids
            .iter()
            .enumerate()
            .map(|(i, id)| {
                let open = self.sequences.remove(id);
                let (state, msg, dtype) = (Arc::clone(&self.state), Arc::clone(&msg), plan.dtype);
                let prepared = Arc::clone(&prepared);
                let caller = self.caller;
                move || {
                    // For the crash report, should a plugin kill the process.
                    let _serving = samplerd_sampling::activity::serving(request_id);
                    row_blocking(&state, &msg, dtype, i, open, &prepared, &caller)
                }
            })
            .collect();
        let results = self
            .state
            .steps
            .run_many(jobs)
            .instrument(self.span.clone())
            .await;
        let mut rows = Vec::with_capacity(ids.len());
        let mut first_error = None;
        for (i, (id, r)) in ids.iter().zip(results).enumerate() {
            match r {
                Ok((seq, result)) => {
                    if let Some(seq) = seq {
                        self.sequences.insert(*id, seq);
                    }
                    match result {
                        Ok(resp) => rows.push(resp),
                        Err(e) => {
                            first_error.get_or_insert(e);
                        }
                    }
                }
                // The state went with the job (a panic dropped it, a stuck
                // thread keeps it).
                Err(failure) => {
                    self.charges.remove(id);
                    self.constraints.remove(id);
                    first_error.get_or_insert(RequestError::from(failure).in_row(i));
                }
            }
        }
        match first_error {
            Some(e) => Err(e.into()),
            None => Ok(v1::SampleBatchResponse {
                rows,
                sequence_ids: ids,
            }),
        }
    }
}

/// The `SampleBatchStream` RPC: like `SampleStream`, the response stream
/// drives the session (each poll reads the next message, runs its rows on
/// the sampling pool and yields the response); a client that cancels or
/// disconnects drops it, and with it every sequence.
pub fn handle(
    state: Arc<AppState>,
    inbound: Streaming<v1::SampleBatchStreamRequest>,
    caller: Caller,
) -> Result<BoxStream<v1::SampleBatchResponse>, Status> {
    let permit = state.stream_permit()?;
    state.open_sessions.fetch_add(1, Ordering::Relaxed);
    let request_id = state.request_id();
    let span = tracing::info_span!("sample_batch_stream", seq = request_id);
    let batch = Batch {
        state,
        span,
        request_id,
        sequences: HashMap::new(),
        charges: HashMap::new(),
        constraints: HashMap::new(),
        inbound,
        _permit: permit,
        caller,
    };
    Ok(Box::pin(futures::stream::unfold(
        Some(batch),
        |batch| async move {
            let mut batch = batch?;
            let msg = match batch.inbound.message().await {
                Ok(Some(m)) => m,
                Ok(None) => return None,
                Err(status) => return Some((Err(completed(status)), None)),
            };
            match batch.message(msg).await {
                Ok(resp) => Some((Ok(resp), Some(batch))),
                Err(status) => {
                    // The message quotes the client's values: DEBUG only.
                    batch.span.in_scope(|| {
                        tracing::info!(code = ?status.code(), "sample batch stream failed");
                        tracing::debug!(%status, "sample batch stream failed");
                    });
                    Some((Err(status), None))
                }
            }
        },
    )))
}
