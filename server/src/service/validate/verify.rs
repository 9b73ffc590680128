//! A `Verify` (speculative verification, `samplerd_sampling::verify`) of
//! a `SampleStream` message or a `SampleBatchStream` row → [`ValidVerify`]:
//! a known mode; at most `limits.max_draft_tokens` drafts, each inside the
//! sequence's vocabulary; K + 1 target rows and — under REJECTION only — K
//! drafter rows, each exactly one of inline logits (the stream's
//! encoding), a sparse row or a shared-memory row (resolved by the caller,
//! `shared_memory::verify_rows`), of the sequence's length; a chain whose
//! terminal stage the mode needs (`params`); and the message's own logits
//! left empty. Errors name the field under `verify.` (a batch row's under
//! `rows[i].`).

#![forbid(unsafe_code)]

use samplerd_api::v1;
use samplerd_sampling::Sequence;
use samplerd_sampling::input::StepLogits;
use samplerd_sampling::step::{Logits, ProbsRequest};
use samplerd_sampling::verify::{Mode, check_chain};

use super::row_logits::{Dtype, RowLogits};
use crate::request::errors::RequestError;
use crate::service::state::AppState;

/// A checked `Verify`, its rows decoded.
pub struct ValidVerify<'a> {
    pub mode: Mode,
    pub drafts: &'a [u32],
    pub target: Vec<RowLogits<'a>>,
    pub drafter: Vec<RowLogits<'a>>,
    pub probs: ProbsRequest,
}

impl ValidVerify<'_> {
    /// The rows as the sampling core takes them.
    pub fn rows(&self) -> (Vec<StepLogits<'_>>, Vec<StepLogits<'_>>) {
        (
            self.target.iter().map(row_logits).collect(),
            self.drafter.iter().map(row_logits).collect(),
        )
    }
}

fn row_logits<'b>(r: &'b RowLogits<'_>) -> StepLogits<'b> {
    match r {
        RowLogits::F32le(b) => StepLogits::Dense(Logits::F32le(b)),
        RowLogits::Widened(f) => StepLogits::Dense(Logits::Floats(f)),
        RowLogits::Sparse(r) => StepLogits::Sparse(*r),
        RowLogits::Shared(inner) => row_logits(inner),
    }
}

/// A Verify's shared rows as resolved by the caller, by position: target,
/// drafter (`None`: not shared; empty: none resolved).
pub type SharedRows<'a> = (Vec<Option<RowLogits<'a>>>, Vec<Option<RowLogits<'a>>>);

/// The mode of `verify.mode` (unset: EXACT).
fn mode(value: i32) -> Result<Mode, RequestError> {
    use v1::VerifyMode as M;
    match M::try_from(value) {
        Ok(M::Unspecified | M::Exact) => Ok(Mode::Exact),
        Ok(M::Rejection) => Ok(Mode::Rejection),
        Ok(M::Coupled) => Ok(Mode::Coupled),
        Err(_) => Err(RequestError::invalid(
            "verify.mode",
            format!(
                "unknown VerifyMode {value} (VERIFY_MODE_EXACT, VERIFY_MODE_REJECTION or VERIFY_MODE_COUPLED)"
            ),
        )),
    }
}

/// With a Verify, the message's own logits fields (`set`: whether each
/// is) must be empty: the Verify's rows carry the logits.
pub fn no_step_logits(set: &[(bool, &str)]) -> Result<(), RequestError> {
    match set.iter().find(|(s, _)| *s) {
        Some((_, field)) => Err(RequestError::invalid(
            *field,
            "is set together with verify: a message verifies drafts (its logits in \
             verify.target_rows) or samples one step, not both",
        )),
        None => Ok(()),
    }
}

/// Checks `v` for a sequence of `n_vocab` logits running `seq`'s chain,
/// its inline rows in `dtype` (f32 in a SampleStream), its shared rows
/// `shared`.
pub fn verify<'a>(
    state: &AppState,
    v: &'a v1::Verify,
    dtype: Dtype,
    n_vocab: usize,
    seq: &Sequence,
    probs: ProbsRequest,
    shared: SharedRows<'a>,
) -> Result<ValidVerify<'a>, RequestError> {
    let mode = mode(v.mode)?;
    let k = v.draft_tokens.len();
    let max = state.limits.max_draft_tokens;
    if k > max {
        return Err(RequestError::limit(
            "verify.draft_tokens",
            "limits.max_draft_tokens",
            format!("{k} draft tokens exceed the limit of {max} (limits.max_draft_tokens)"),
        ));
    }
    if let Some((i, id)) = v
        .draft_tokens
        .iter()
        .enumerate()
        .find(|&(_, &id)| id as usize >= n_vocab)
    {
        return Err(RequestError::invalid(
            format!("verify.draft_tokens[{i}]"),
            format!("token id {id} is outside the sequence's vocabulary of {n_vocab} tokens"),
        ));
    }
    if v.target_rows.len() != k + 1 {
        return Err(RequestError::invalid(
            "verify.target_rows",
            format!(
                "{k} draft tokens need {} target rows (one per draft, one more for the token \
                 after them), got {}",
                k + 1,
                v.target_rows.len()
            ),
        ));
    }
    let want_drafter = if mode == Mode::Rejection { k } else { 0 };
    if v.drafter_rows.len() != want_drafter {
        let msg = if mode == Mode::Rejection {
            format!(
                "VERIFY_MODE_REJECTION needs the drafter's row of each draft token: {k} drafts, \
                 got {} rows",
                v.drafter_rows.len()
            )
        } else {
            format!(
                "is read only under VERIFY_MODE_REJECTION: leave it empty under {} (got {} rows)",
                mode.name(),
                v.drafter_rows.len()
            )
        };
        return Err(RequestError::invalid("verify.drafter_rows", msg));
    }
    check_chain(seq, mode).map_err(|e| {
        RequestError::invalid(
            "params",
            format!(
                "{e} (the stream's chain, fixed by its first message; e.g. params.chain ending \
                 with {{\"name\": \"{}\"}})",
                mode.terminals().and_then(|t| t.last()).unwrap_or(&"dist")
            ),
        )
    })?;
    let decode = |rows: &'a [v1::VerifyRow], shared: Vec<Option<RowLogits<'a>>>, name: &str| {
        let mut shared = shared.into_iter();
        rows.iter()
            .enumerate()
            .map(|(j, r)| {
                let path = format!("verify.{name}[{j}]");
                let (row, field) = match shared.next().flatten() {
                    Some(row) => (row, "shared.count"),
                    None if r.logits.is_empty() && r.sparse.is_none() => {
                        return Err(RequestError::invalid(
                            path,
                            "set exactly one of `logits`, `sparse` and `shared`, got none",
                        ));
                    }
                    None => {
                        let row = RowLogits::decode(
                            dtype,
                            &r.logits,
                            r.sparse.as_ref(),
                            state.limits.max_vocab,
                        )
                        .map_err(|e| e.under(&path))?;
                        let field = if r.sparse.is_some() {
                            "sparse.vocab_size"
                        } else {
                            "logits"
                        };
                        (row, field)
                    }
                };
                if row.len() != n_vocab {
                    return Err(RequestError::invalid(
                        format!("{path}.{field}"),
                        format!(
                            "has {} logits, the sequence's vocabulary has {n_vocab}",
                            row.len()
                        ),
                    ));
                }
                Ok(row)
            })
            .collect::<Result<Vec<_>, _>>()
    };
    let (shared_target, shared_drafter) = shared;
    Ok(ValidVerify {
        mode,
        drafts: &v.draft_tokens,
        target: decode(&v.target_rows, shared_target, "target_rows")?,
        drafter: decode(&v.drafter_rows, shared_drafter, "drafter_rows")?,
        probs,
    })
}

/// Continuing row `i` of a stream message that carries a `Verify`, for a
/// sequence of `n_vocab` logits running `seq` (errors name the row's
/// fields; the caller puts them under `rows[i]`).
pub fn batch_row<'a>(
    state: &AppState,
    msg: &'a v1::SampleBatchStreamRequest,
    i: usize,
    v: &'a v1::Verify,
    n_vocab: usize,
    seq: &Sequence,
    shared: SharedRows<'a>,
) -> Result<ValidVerify<'a>, RequestError> {
    let r = &msg.rows[i];
    let dtype = Dtype::from_proto(msg.dtype)?;
    no_step_logits(&[
        (!r.logits.is_empty(), "logits"),
        (r.sparse.is_some(), "sparse"),
        (r.shared.is_some(), "shared"),
    ])?;
    let probs = super::probs(state, msg.n_probs, msg.post_sampling_probs)?;
    verify(state, v, dtype, n_vocab, seq, probs, shared)
}
