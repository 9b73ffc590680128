//! Speculative decoding for Generate (`GenerateRequest.speculation`): the
//! decode loop drafts tokens, the model scores the last token and its
//! drafts in one pass, and the request's own chain accepts them.
//!
//! Each round, with `last` the token sampled last (not yet in the cache):
//! 1. **Draft**: up to `k` tokens. `DRAFT_SOURCE_PROMPT_LOOKUP`
//!    ([`prompt_lookup`]): the tokens that followed the latest earlier
//!    occurrence of the text's last 3 (then 2) tokens, in the prompt and
//!    the tokens generated so far — prompt-lookup decoding (Saxena 2023;
//!    llama.cpp's `common/ngram-cache.cpp` keeps n-gram statistics for the
//!    same purpose). `DRAFT_SOURCE_MODEL` (`super::draft_model`): the
//!    draft model's tokens, drawn by the request's chain with the target's
//!    seed and steps (llama.cpp's `examples/speculative-simple` drafts
//!    with a second model the same way, greedily). Drafts stop before a token
//!    that ends the generation (the end-of-generation token unless
//!    `ignore_eos`, a `stop_token_ids` entry), so no accepted draft ends
//!    the run.
//! 2. **Verify pass**: `[last, drafts…]` run as consecutive decode steps in
//!    one forward pass, batched with the other generations' steps
//!    (`batcher::SeqHandle::verify`, `samplerd_model::Model::decode_rows`):
//!    row `j` has the bits the `j`-th one-token step would have given.
//! 3. **Accept** (`samplerd_sampling::verify`, EXACT: sample-and-match, as
//!    llama.cpp's `common_sampler_sample_and_accept_n` in
//!    `common/sampling.cpp` that `examples/speculative-simple` uses): the
//!    chain runs on row `j` at step `generated + j` and a draft is kept
//!    while the chain's draw equals it; the first draw that differs (or the
//!    draw after the last draft) is the next `last`. Every token is the one
//!    step-by-step decoding samples, whatever the chain (seeded `dist`,
//!    penalties, DRY, constraints).
//! 4. **Commit**: each token goes through the same gates as without
//!    speculation (end of generation, stop strings, `max_tokens`, the
//!    context) and is streamed as its own `Token`; the run is cut at the
//!    token where step-by-step decoding stops, and the cache is truncated
//!    to the positions step-by-step decoding would hold
//!    (`Session::truncate`), so the prompt cache and `resume` see exactly
//!    the committed tokens.
//!
//! The draft length adapts, by a rule of the draft source
//! ([`super::draft_length`]): prompt lookup follows the acceptance, a draft
//! model the measured cost of its drafts against the target's rows. And
//! while rounds with drafts measure slower per token than plain steps,
//! drafting pauses, with a probe now and then ([`super::draft_pacing`]);
//! a draft model that lost on recent generations sits out the next few
//! choices altogether ([`super::draft_record`]).

#![forbid(unsafe_code)]

use std::sync::Arc;
use std::time::Instant;

use samplerd_api::v1;
use samplerd_model::Session;
use samplerd_sampling::input::StepLogits;
use samplerd_sampling::step::Logits;
use samplerd_sampling::verify::{self, Draft, Mode, VerifyError};
use samplerd_sampling::{SampleError, Sequence, TokenBuffer};

use super::draft_length::{DraftLength, DraftRule, MeasuredLength};
use super::draft_model::DraftInput;
use super::draft_pacing::Pacer;
use super::draft_record::{DraftRecord, Recorded};
use super::generator::{DraftSource, GenerateJob, GenerateSink, Speculation};
use super::{Decoded, ModelHost, resume};
use crate::request::errors::{InvalidKind, RequestError};
use crate::status::Reason;

/// Counter: draft tokens a speculating Generate's verify passes scored.
pub const DRAFT_TOKENS_METRIC: &str = "samplerd_generate_draft_tokens_total";
/// Counter: of those, the drafts accepted.
pub const ACCEPTED_DRAFT_TOKENS_METRIC: &str = "samplerd_generate_accepted_draft_tokens_total";
/// Counter: rounds of speculating Generate requests decoded without drafts
/// because drafting had measured slower than plain steps
/// (`super::draft_pacing`).
pub const PAUSED_ROUNDS_METRIC: &str = "samplerd_generate_speculation_paused_rounds_total";
/// Counter: choices of Generate requests asking for the draft model that
/// decoded without it, because it had lost on recent generations
/// (`super::draft_record`).
pub const SKIPPED_METRIC: &str = "samplerd_generate_speculation_skipped_total";

pub(super) fn describe() {
    use metrics::describe_counter;
    describe_counter!(
        DRAFT_TOKENS_METRIC,
        "draft tokens scored by speculating Generate requests"
    );
    describe_counter!(
        ACCEPTED_DRAFT_TOKENS_METRIC,
        "draft tokens accepted by speculating Generate requests"
    );
    describe_counter!(
        PAUSED_ROUNDS_METRIC,
        "speculating Generate rounds decoded without drafts because drafting measured slower than plain steps"
    );
    describe_counter!(
        SKIPPED_METRIC,
        "choices of speculating Generate requests decoded without the draft model because it lost on recent generations"
    );
    // Present from the start (a scrape shows 0, not nothing).
    metrics::counter!(DRAFT_TOKENS_METRIC).increment(0);
    metrics::counter!(ACCEPTED_DRAFT_TOKENS_METRIC).increment(0);
    metrics::counter!(PAUSED_ROUNDS_METRIC).increment(0);
    metrics::counter!(SKIPPED_METRIC).increment(0);
}

/// The longest suffix n-gram prompt lookup tries (then shorter ones down
/// to [`MIN_NGRAM`]).
const MAX_NGRAM: usize = 3;
/// The shortest: a lone recurring token predicts its successor too rarely
/// to pay for the rows (see `prompt_lookup`).
const MIN_NGRAM: usize = 2;

/// Up to `max` tokens that followed the latest earlier occurrence of the
/// longest suffix of `history` (3 tokens, else 2) inside it; empty when
/// none recurs. Cost: O(len × 2) comparisons, ~8k for a 4096-token
/// context — microseconds against a forward pass of milliseconds.
///
/// Not 1-token suffixes: on the benchmark's input-grounded prompts they
/// raised the drafts 60 % and cut the acceptance from 48 % to 33 %, and a
/// rejected draft costs a quarter of a decode step or more (the verify
/// pass's rows are not free on a CPU, docs/PERFORMANCE.md).
pub fn prompt_lookup(history: &[u32], max: usize) -> &[u32] {
    let len = history.len();
    if max == 0 {
        return &[];
    }
    for n in (MIN_NGRAM..=MAX_NGRAM.min(len.saturating_sub(1))).rev() {
        let suffix = &history[len - n..];
        // A start before `len - n`: something follows the match.
        if let Some(i) = (0..len - n).rev().find(|&i| history[i..i + n] == *suffix) {
            return &history[i + n..(i + n + max).min(len)];
        }
    }
    &[]
}

/// A verify round's outcome, as the sampling thread hands it back.
struct Round {
    tokens: Vec<samplerd_sampling::step::StepOutput>,
    /// Whether the last token ends the generation (it was not accepted).
    ends: bool,
}

impl ModelHost {
    /// FAILED_PRECONDITION for `DRAFT_SOURCE_MODEL` on a server without a
    /// draft model (`model.draft_path`).
    pub(super) fn check_speculation(&self, spec: &Speculation) -> Result<(), RequestError> {
        match spec.source {
            DraftSource::PromptLookup => Ok(()),
            DraftSource::Model if self.draft.is_some() => Ok(()),
            DraftSource::Model => Err(RequestError::refused(
                Reason::NoModel,
                "speculation.source",
                "DRAFT_SOURCE_MODEL needs a draft model, and this server has none configured \
                 (model.draft_path, env SAMPLERD_MODEL__DRAFT_PATH): \
                 use DRAFT_SOURCE_PROMPT_LOOKUP",
            )),
        }
    }

    /// The draft model's record that a choice asking for `spec` answers to
    /// (`super::draft_record`): none for prompt lookup or without pacing.
    fn draft_record(&self, spec: Speculation) -> Option<&DraftRecord> {
        match (spec.source, &self.draft) {
            (DraftSource::Model, Some(draft)) if self.config.pause_slow_drafting => {
                Some(draft.record())
            }
            _ => None,
        }
    }

    /// Whether a choice that asks for `spec` drafts: not while the draft
    /// model's record skips it (it then decodes plainly, to the same text).
    pub(super) fn takes_turn(&self, spec: Speculation) -> bool {
        let turn = self.draft_record(spec).is_none_or(DraftRecord::take_turn);
        if !turn {
            metrics::counter!(SKIPPED_METRIC).increment(1);
        }
        turn
    }

    /// The decode loop with speculation (see the module doc): the same
    /// tokens, messages and end as [`ModelHost::decode`]; `usage` gets
    /// the draft counts.
    #[allow(clippy::too_many_arguments)]
    pub(super) fn decode_speculative(
        &self,
        job: &GenerateJob,
        (choice, seed): (u32, u64),
        spec: Speculation,
        mut seq: Sequence,
        mut session: Session,
        forward: &impl Fn(Session, Vec<u32>) -> Result<Session, RequestError>,
        verify_pass: &impl Fn(Session, Vec<u32>) -> Result<Session, RequestError>,
        sink: &GenerateSink,
        decoded: &mut Decoded,
        usage: &mut v1::Usage,
    ) -> Result<Option<(v1::FinishReason, Session)>, RequestError> {
        let req = &job.request;
        let request_id = job.request_id;
        let tok = self.model.tokenizer();
        let mut buf = job.buffers.lease(self.model.n_vocab());
        let probs = req.probs;
        // What ends the generation: the end-of-generation token (unless
        // `ignore_eos`) and `stop_token_ids`. A draft that would end it is
        // never proposed, so only a round's last token can.
        let end = req.end_rule();
        let mut length = match spec.source {
            DraftSource::PromptLookup => DraftRule::Lookup(DraftLength::new(spec.max_draft_tokens)),
            DraftSource::Model => DraftRule::Measured(MeasuredLength::new(spec.max_draft_tokens)),
        };
        // A draft model's verdict goes to its record when the choice ends.
        let mut paced = Recorded::new(
            Pacer::new(self.config.pause_slow_drafting),
            self.draft_record(spec),
        );
        // When the round being verified started drafting (none after the
        // prefill): rounds are timed from their drafting to the end of
        // their verification.
        let mut round_start: Option<Instant> = None;
        let mut drafter = match spec.source {
            DraftSource::PromptLookup => None,
            DraftSource::Model => self
                .draft
                .as_ref()
                .map(|d| d.drafter(session.capacity(), &job.memory)),
        };
        // The drafts whose rows the session's last pass holds (after the
        // row of the token before them); none after the prefill.
        let mut drafts: Vec<u32> = Vec::new();
        loop {
            // Positions before the drafts' are committed: the token that
            // produced row 0, and everything before it.
            let base = session.position() - drafts.len();
            if sink.is_closed() {
                tracing::debug!(
                    generated = decoded.generated,
                    "client went away; generation stopped"
                );
                session.truncate(base);
                self.prompt_cache.put(session, &job.memory);
                return Ok(None);
            }
            let t0 = Instant::now();
            let first_step = u64::from(decoded.generated);
            let (model, round_end) = (Arc::clone(&self.model), end.clone());
            let mut moved = (seq, buf, session, std::mem::take(&mut drafts));
            let (back, out) = job.steps.run_blocking(move || {
                let _serving = samplerd_sampling::activity::serving(request_id);
                let (seq, buf, session, drafts) = &mut moved;
                let rows: Vec<StepLogits<'_>> = session
                    .logits_rows()
                    .map(|r| StepLogits::Dense(Logits::Floats(r)))
                    .collect();
                let draft = Draft {
                    tokens: drafts,
                    target: &rows,
                    drafter: &[],
                };
                let out = verify::verify(
                    seq,
                    buf,
                    &mut TokenBuffer::new(),
                    Mode::Exact,
                    draft,
                    seed,
                    first_step,
                    probs,
                )
                .map_err(verify_error)
                .and_then(|v| {
                    let last = v.tokens.last().map_or(0, |t| t.token_id);
                    let ends = round_end.ends(last, |t| model.tokenizer().is_eog(t));
                    if !ends {
                        seq.accept(last).map_err(RequestError::Plugin)?;
                    }
                    Ok(Round {
                        tokens: v.tokens,
                        ends,
                    })
                });
                (moved, out)
            })?;
            let drafted;
            (seq, buf, session, drafted) = back;
            let round = out?;
            decoded.sampling_ns += t0.elapsed().as_nanos();
            if let Some(start) = round_start.take() {
                paced.pacer.round(
                    drafted.len(),
                    round.tokens.len(),
                    start.elapsed().as_nanos(),
                );
            }
            let accepted = round.tokens.len() - 1;
            if !drafted.is_empty() {
                usage.draft_tokens += drafted.len() as u32;
                metrics::counter!(DRAFT_TOKENS_METRIC).increment(drafted.len() as u64);
                length.update(drafted.len(), accepted);
            }
            for (j, out) in round.tokens.iter().enumerate() {
                // What step-by-step decoding holds before this token runs.
                let position = base + j;
                if j == accepted && round.ends {
                    session.truncate(position);
                    return Ok(Some((v1::FinishReason::StopToken, session)));
                }
                if j < accepted {
                    // Counted once committed: drafts after a stop are not.
                    usage.accepted_draft_tokens += 1;
                    metrics::counter!(ACCEPTED_DRAFT_TOKENS_METRIC).increment(1);
                }
                // The row this token was sampled from: its step's.
                let row = session.logits_rows().nth(j).unwrap_or_default();
                let (event, stopped) = decoded.emit(tok, out, choice, req.return_logits, row);
                if sink
                    .blocking_send(Ok(v1::GenerateResponse { event: Some(event) }))
                    .is_err()
                {
                    tracing::debug!(
                        generated = decoded.generated,
                        "client went away; generation stopped"
                    );
                    session.truncate(position);
                    self.prompt_cache.put(session, &job.memory);
                    return Ok(None);
                }
                if let Some(reason) = resume::ends_after(
                    stopped,
                    decoded.generated,
                    req.max_tokens,
                    position,
                    session.capacity(),
                ) {
                    session.truncate(position);
                    return Ok(Some((reason, session)));
                }
            }
            // Keep the token before the drafts and the accepted drafts.
            let position = base + accepted;
            session.truncate(position);
            let last = round.tokens[accepted].token_id;
            // No more drafts than tokens may still come after `last`, nor
            // than the cache holds after it.
            let room = (req.max_tokens - decoded.generated) as usize;
            let wanted = length
                .get()
                .min(room.saturating_sub(1))
                .min(session.capacity() - position - 1);
            let k = paced.pacer.limit(wanted);
            if wanted > 0 && k == 0 {
                metrics::counter!(PAUSED_ROUNDS_METRIC).increment(1);
            }
            round_start = Some(Instant::now());
            drafts = if k == 0 {
                // A plain step (paused, or nothing may follow): no text
                // to search or bring the draft model up to.
                Vec::new()
            } else {
                let mut history = session.cached_tokens().to_vec();
                history.push(last);
                match &mut drafter {
                    None => prompt_lookup(&history, k)
                        .iter()
                        .copied()
                        .take_while(|&t| !end.ends(t, |t| tok.is_eog(t)))
                        .collect(),
                    Some(drafter) => {
                        let input = DraftInput {
                            history: &history,
                            seq: &seq,
                            step: u64::from(decoded.generated),
                            seed,
                            end: &end,
                        };
                        let t0 = Instant::now();
                        let drafts = drafter.draft(job, input, k)?;
                        length.drafted(drafts.len(), t0.elapsed().as_nanos());
                        drafts
                    }
                }
            };
            let mut tokens = Vec::with_capacity(drafts.len() + 1);
            tokens.push(last);
            tokens.extend_from_slice(&drafts);
            let (rows, t0) = (tokens.len(), Instant::now());
            session = if drafts.is_empty() {
                forward(session, tokens)?
            } else {
                verify_pass(session, tokens)?
            };
            length.passed(rows, t0.elapsed().as_nanos());
        }
    }
}

/// A verify round's error as the step's would be: bad logits are the
/// model's fault, a chain that masks everything the request's.
fn verify_error(e: VerifyError) -> RequestError {
    match e {
        VerifyError::Logits { source, .. } => {
            RequestError::Internal(format!("the model produced bad logits: {source}"))
        }
        VerifyError::Sample {
            source: e @ SampleError::AllMasked { .. },
            ..
        } => RequestError::invalid_as(InvalidKind::AllMasked, "params", e.to_string()),
        VerifyError::Sample { source, .. } => RequestError::Plugin(source),
        other => RequestError::Internal(other.to_string()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn lookup_takes_the_longest_recurring_suffix_and_its_latest_match() {
        // "a b c d | x b c" → the 2-gram "b c" recurs; "d" followed it.
        let h = [1, 2, 3, 4, 9, 2, 3];
        assert_eq!(prompt_lookup(&h, 5), &[4, 9, 2, 3]);
        assert_eq!(prompt_lookup(&h, 2), &[4, 9]);
        // The 3-gram wins over a later 1-gram match.
        let h = [5, 6, 7, 8, 7, 1, 5, 6, 7];
        assert_eq!(prompt_lookup(&h, 3), &[8, 7, 1]);
        // The latest of two matches.
        let h = [7, 8, 1, 7, 8, 2, 7, 8];
        assert_eq!(prompt_lookup(&h, 4), &[2, 7, 8]);
        // Nothing recurs, only one token does, or nothing to draft.
        assert!(prompt_lookup(&[1, 2, 3], 4).is_empty());
        assert!(prompt_lookup(&[1, 2, 3, 1], 4).is_empty());
        assert!(prompt_lookup(&[1, 2, 1], 0).is_empty());
        assert!(prompt_lookup(&[], 4).is_empty());
    }
}
