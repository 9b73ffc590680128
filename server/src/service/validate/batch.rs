//! Validation of `SampleBatch` and `SampleBatchStream` messages: the
//! batch's own shape (at least one row, at most `limits.max_batch_rows`
//! rows or open sequences, one row per sequence, joining rows told apart
//! from continuing ones), each row's logits decoded from the wire dtype,
//! and each row's fields through the very checks `Sample` runs — every
//! error naming its row (`rows[3].params.top_p: …`).

#![forbid(unsafe_code)]

use std::collections::{HashMap, HashSet};

use samplerd_api::v1;
use samplerd_sampling::Prebuilt;

use super::row_logits::{Dtype, RowLogits};
use super::{Fields, ValidStart, ValidStep, probs, start};
use crate::request::convert::LogitsInput;
use crate::request::errors::RequestError;
use crate::service::state::AppState;

/// The number of rows (or open sequences) `n`, under
/// `limits.max_batch_rows`, for `field`.
fn rows_within(state: &AppState, field: &str, n: usize) -> Result<(), RequestError> {
    let max = state.limits.max_batch_rows;
    if n > max {
        return Err(RequestError::limit(
            field,
            "limits.max_batch_rows",
            format!("{n} rows exceed the limit of {max} (limits.max_batch_rows)"),
        ));
    }
    Ok(())
}

/// A `SampleBatch` request's shape: at least one row, at most
/// `limits.max_batch_rows`, a known dtype, `n_probs` under its limit.
/// Cheap (no plugin is called): the rows are checked one by one by [`row`]
/// on the sampling threads.
pub fn batch(state: &AppState, req: &v1::SampleBatchRequest) -> Result<Dtype, RequestError> {
    if req.rows.is_empty() {
        return Err(RequestError::invalid(
            "rows",
            "is empty: send at least one row",
        ));
    }
    rows_within(state, "rows", req.rows.len())?;
    probs(state, req.n_probs, req.post_sampling_probs)?;
    Dtype::from_proto(req.dtype)
}

/// Row `i` of a `SampleBatch` whose logits `logits` were decoded: the
/// checks of `Sample` over the row's fields (its own `params`, else the
/// request's), errors naming the row.
pub fn row<'a>(
    state: &AppState,
    req: &'a v1::SampleBatchRequest,
    i: usize,
    logits: &'a RowLogits<'_>,
    prebuilt: &'a Prebuilt,
) -> Result<ValidStart<'a>, RequestError> {
    let r = &req.rows[i];
    start_row(state, i, logits, |logits| Fields {
        logits,
        previous_tokens: &r.previous_tokens,
        params: r.params.as_ref().or(req.params.as_ref()),
        step: r.step,
        n_probs: req.n_probs,
        post_sampling_probs: req.post_sampling_probs,
        constraint_tokens: &r.constraint_tokens,
        prebuilt,
    })
}

/// `Sample`'s checks over row `i`'s fields (`fields` given its logits),
/// every error naming the row.
fn start_row<'a>(
    state: &AppState,
    i: usize,
    logits: &'a RowLogits<'_>,
    fields: impl FnOnce(LogitsInput<'a>) -> Fields<'a>,
) -> Result<ValidStart<'a>, RequestError> {
    let input = logits
        .input(state.limits.max_vocab)
        .map_err(|e| e.in_row(i))?;
    start(state, fields(input)).map_err(|e| e.in_row(i))
}

/// What a `SampleBatchStream` message asks, checked against the open
/// sequences: which rows join (new ids, and ids that leave first) and
/// which continue (the ids in its `leave` are checked open and leave
/// first).
pub struct ValidBatchMessage {
    pub dtype: Dtype,
    /// For each row, whether it joins (its id is not open).
    pub joins: Vec<bool>,
}

/// A `SampleBatchStream` message given the open sequence ids: its dtype,
/// `leave` (each open, none twice), its rows (at most one per id; a row
/// for an id that leaves joins again; a continuing row sets no joining
/// field), and the open sequences after it under `limits.max_batch_rows`.
pub fn stream_message<S: std::hash::BuildHasher>(
    state: &AppState,
    msg: &v1::SampleBatchStreamRequest,
    open: &HashSet<u64, S>,
) -> Result<ValidBatchMessage, RequestError> {
    let dtype = Dtype::from_proto(msg.dtype)?;
    if msg.rows.is_empty() && msg.leave.is_empty() {
        return Err(RequestError::invalid(
            "rows",
            "is empty and nothing leaves: send at least one row or one id in leave",
        ));
    }
    rows_within(state, "rows", msg.rows.len())?;
    probs(state, msg.n_probs, msg.post_sampling_probs)?;
    let mut leaving = HashSet::with_capacity(msg.leave.len());
    for (j, &id) in msg.leave.iter().enumerate() {
        if !open.contains(&id) {
            return Err(RequestError::invalid(
                format!("leave[{j}]"),
                format!("sequence {id} is not open in this stream"),
            ));
        }
        if !leaving.insert(id) {
            return Err(RequestError::invalid(
                format!("leave[{j}]"),
                format!("sequence {id} is listed twice"),
            ));
        }
    }
    let mut seen: HashMap<u64, usize> = HashMap::with_capacity(msg.rows.len());
    let mut joins = Vec::with_capacity(msg.rows.len());
    for (i, r) in msg.rows.iter().enumerate() {
        let id = r.sequence_id;
        if let Some(first) = seen.insert(id, i) {
            return Err(RequestError::invalid(
                format!("rows[{i}].sequence_id"),
                format!("sequence {id} already has a row in this message (rows[{first}])"),
            ));
        }
        // `leave` runs before the rows: a row for an id that leaves joins
        // afresh, as any id not open does.
        let joining = !open.contains(&id) || leaving.contains(&id);
        if !joining {
            let set = [
                (r.params.is_some(), "params"),
                (!r.previous_tokens.is_empty(), "previous_tokens"),
                (r.first_step != 0, "first_step"),
                (!r.constraint_tokens.is_empty(), "constraint_tokens"),
            ];
            if let Some((_, field)) = set.iter().find(|(s, _)| *s) {
                return Err(RequestError::invalid(
                    format!("rows[{i}].{field}"),
                    format!(
                        "is set, but sequence {id} is already open: only its joining row sets it"
                    ),
                ));
            }
        }
        if joining && let Some(v) = &r.verify {
            return Err(RequestError::invalid(
                format!("rows[{i}].verify"),
                format!(
                    "is set on sequence {id}'s joining row ({} draft tokens): a joining row \
                     opens the sequence with one step; send verify on its later rows",
                    v.draft_tokens.len()
                ),
            ));
        }
        joins.push(joining);
    }
    let after = open.len() - leaving.len() + joins.iter().filter(|&&j| j).count();
    let max = state.limits.max_batch_rows;
    if after > max {
        return Err(RequestError::limit(
            "rows",
            "limits.max_batch_rows",
            format!(
                "{after} open sequences after this message exceed the limit of {max} \
                 (limits.max_batch_rows)"
            ),
        ));
    }
    Ok(ValidBatchMessage { dtype, joins })
}

/// Joining row `i` of a stream message: `Sample`'s checks over the row
/// (its own `params`, else the message's).
pub fn stream_join<'a>(
    state: &AppState,
    msg: &'a v1::SampleBatchStreamRequest,
    i: usize,
    logits: &'a RowLogits<'_>,
    prebuilt: &'a Prebuilt,
) -> Result<ValidStart<'a>, RequestError> {
    let r = &msg.rows[i];
    start_row(state, i, logits, |logits| Fields {
        logits,
        previous_tokens: &r.previous_tokens,
        params: r.params.as_ref().or(msg.params.as_ref()),
        step: r.first_step,
        n_probs: msg.n_probs,
        post_sampling_probs: msg.post_sampling_probs,
        constraint_tokens: &r.constraint_tokens,
        prebuilt,
    })
}

/// Continuing row `i` of a stream message for a sequence of `n_vocab`
/// logits at `step`.
pub fn stream_step<'a>(
    state: &AppState,
    msg: &v1::SampleBatchStreamRequest,
    i: usize,
    logits: &'a RowLogits<'_>,
    n_vocab: usize,
    step: u64,
) -> Result<ValidStep<'a>, RequestError> {
    let input = logits
        .input(state.limits.max_vocab)
        .map_err(|e| e.in_row(i))?;
    if input.len() != n_vocab {
        return Err(RequestError::invalid(
            input.len_field(),
            format!(
                "vocabulary changed within the sequence: {} logits, its first row had {n_vocab}",
                input.len()
            ),
        )
        .in_row(i));
    }
    Ok(ValidStep {
        logits: input,
        step,
        probs: probs(state, msg.n_probs, msg.post_sampling_probs)?,
    })
}
