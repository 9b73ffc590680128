//! `SampleStream`: one sequence, many steps. The first message fixes the
//! parameters, the seed and the initial window; the session keeps the
//! plugin states (penalty window) and the step counter, accepting each
//! chosen token. Step t returns exactly what `Sample` returns with
//! `step = t` and `previous_tokens` = initial window + tokens chosen so far.
//!
//! A later message may carry a `Verify` instead of logits: the session's
//! sequence verifies the drafts (`run_verify`, a loop of the same step)
//! and moves on by the accepted drafts and the token after them.
//!
//! A client that cancels or disconnects ends the session: the server drops
//! the response stream, and with it the sequence states and token buffer.

#![forbid(unsafe_code)]

use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use samplerd_api::v1;
use samplerd_sampling::{Sequence, TokenBuffer};
use tokio::sync::OwnedSemaphorePermit;
use tonic::{Status, Streaming};
use tracing::Instrument;

use super::constraint::Prepared;
use super::sample::{run_step, run_verify, start_lse};
use super::state::{AppState, BoxStream};
use super::validate;
use crate::request::convert::{FIELD_LOGITS, FIELD_LOGITS_F32LE, FIELD_SPARSE};
use crate::request::errors::RequestError;
use crate::service::shared_memory::SharedRow;
use crate::service::shared_memory::verify_rows::VerifyShared;
use crate::transport::identity::Caller;
use crate::transport::one_frame::PredecodedStream;
use crate::transport::status_fixup::completed;

/// What a stream holds on the server's books: its slot under
/// `limits.max_concurrent_streams` and its count in the open sessions.
/// Kept by the response stream, not by the [`Session`] that moves to a
/// sampling thread each step, so a step the watchdog gives up on releases
/// them at once.
struct Slot {
    state: Arc<AppState>,
    _permit: OwnedSemaphorePermit,
    /// The session's memory, charged at its first message.
    charge: Option<crate::request::memory::Charge>,
}

impl Slot {
    fn new(state: Arc<AppState>, permit: OwnedSemaphorePermit) -> Self {
        state.open_sessions.fetch_add(1, Ordering::Relaxed);
        Slot {
            state,
            _permit: permit,
            charge: None,
        }
    }
}

impl Drop for Slot {
    fn drop(&mut self) {
        self.state.open_sessions.fetch_sub(1, Ordering::Relaxed);
    }
}

/// The state of one stream.
struct Session {
    state: Arc<AppState>,
    span: tracing::Span,
    opened: Instant,
    /// Why the stream ended, for the closing log line.
    end: &'static str,
    seq: Option<Sequence>,
    buf: Option<TokenBuffer>,
    seed: u64,
    step: u64,
    n_vocab: usize,
    steps: u64,
    sampling: Duration,
    /// The first message's compiled constraint (held for the stream).
    prepared: Prepared,
    /// Whose shared-memory regions the messages may name.
    caller: Caller,
}

impl Session {
    fn new(state: Arc<AppState>, span: tracing::Span, caller: Caller) -> Self {
        Session {
            state,
            span,
            opened: Instant::now(),
            // Until the stream ends any other way: dropped by the server
            // because the client cancelled or went away.
            end: "client went away",
            seq: None,
            buf: None,
            seed: 0,
            step: 0,
            n_vocab: 0,
            steps: 0,
            sampling: Duration::ZERO,
            prepared: Prepared::default(),
            caller,
        }
    }

    /// One message → one response (runs on a sampling thread).
    fn step(&mut self, msg: &v1::SampleStreamRequest) -> Result<v1::SampleResponse, RequestError> {
        let start = Instant::now();
        if let (Some(v), Some(seq), Some(buf)) =
            (msg.verify.as_ref(), self.seq.as_mut(), self.buf.as_mut())
        {
            let shared = VerifyShared::resolve(
                &self.state.shared,
                v,
                &self.caller,
                self.state.limits.max_draft_tokens,
                self.state.limits.max_vocab,
            )?;
            let valid =
                validate::stream_verify(&self.state, msg, v, self.n_vocab, seq, shared.logits())?;
            let resp = run_verify(seq, buf, &self.state.pool, &valid, self.seed, self.step);
            // Before the tokens are accepted, as for a step's shared row.
            shared.check_read(&self.state.shared)?;
            let resp = resp?;
            seq.accept(resp.token_id)
                .map_err(|e| RequestError::from_sample(e, "verify"))?;
            let n = resp.verify.as_ref().map_or(1, |v| v.tokens.len()) as u64;
            self.step += n;
            self.steps += n;
            self.sampling += start.elapsed();
            return Ok(resp);
        }
        let shared = self.state.shared.resolve_in(
            msg.shared.as_ref(),
            &[
                (!msg.logits.is_empty(), FIELD_LOGITS),
                (!msg.logits_f32le.is_empty(), FIELD_LOGITS_F32LE),
                (msg.sparse.is_some(), FIELD_SPARSE),
            ],
            &self.caller,
            self.state.limits.max_vocab,
        )?;
        let shared_logits = shared.as_ref().map(SharedRow::logits);
        let shared_logits = shared_logits.as_ref();
        let helper = start_lse(&self.state, &msg.logits_f32le);
        let input = match (self.seq.as_ref(), self.buf.as_ref()) {
            (Some(_), Some(_)) => {
                validate::stream_step(&self.state, msg, self.n_vocab, self.step, shared_logits)?
            }
            _ => {
                let valid = validate::stream_start(
                    &self.state,
                    msg,
                    self.prepared.prebuilt(),
                    shared_logits,
                )?;
                let seq = valid.open_sequence()?;
                let span = tracing::Span::current();
                span.record("seed", valid.seed);
                span.record("chain", super::state::chain_for_log(&valid.chain));
                self.seed = valid.seed;
                self.step = valid.step.step;
                self.n_vocab = valid.step.logits.len();
                self.seq = Some(seq);
                self.buf = Some(self.state.pool.take());
                valid.step
            }
        };
        let (Some(seq), Some(buf)) = (self.seq.as_mut(), self.buf.as_mut()) else {
            return Err(RequestError::Internal(
                "stream session not initialised".into(),
            ));
        };
        let resp = run_step(seq, buf, input, self.seed, helper);
        if let Some(row) = &shared {
            // Before the token is accepted, and before the step's own
            // error (zeros after a fault, or torn values): a lost row
            // leaves no trace and its region goes.
            self.state.shared.check_read(row)?;
        }
        let resp = resp?;
        seq.accept(resp.token_id)
            .map_err(|e| RequestError::from_sample(e, input.logits.field()))?;
        self.step += 1;
        self.steps += 1;
        self.sampling += start.elapsed();
        Ok(resp)
    }
}

impl Drop for Session {
    fn drop(&mut self) {
        if let Some(buf) = self.buf.take() {
            self.state.pool.put(buf);
        }
        let _e = self.span.enter();
        tracing::info!(
            steps = self.steps,
            elapsed_ms = self.opened.elapsed().as_secs_f64() * 1e3,
            sampling_us_per_step = if self.steps > 0 {
                self.sampling.as_secs_f64() * 1e6 / self.steps as f64
            } else {
                0.0
            },
            end = self.end,
            "stream closed"
        );
    }
}

/// What one poll of the response stream carries over to the next.
struct Pull {
    _slot: Slot,
    session: Session,
    inbound: Streaming<v1::SampleStreamRequest>,
    predecoded: PredecodedStream,
}

/// The `SampleStream` RPC. The response stream drives the session itself:
/// each poll reads the next message, runs its step on a sampling thread
/// ([`crate::request::step_pool`], under its watchdog) and yields the response — no task and no channel
/// between the request and the response, and the next message is read
/// only once the client has room for the next response. A client that
/// cancels or disconnects drops the stream, and with it the session.
/// `predecoded` holds the messages decoded from their frames
/// ([`crate::transport::one_frame`]), in whose place tonic yields empty ones; it stays
/// empty for a stream that path leaves to tonic (a compressed one).
pub fn handle(
    state: Arc<AppState>,
    inbound: Streaming<v1::SampleStreamRequest>,
    predecoded: PredecodedStream,
    caller: Caller,
) -> Result<BoxStream<v1::SampleResponse>, Status> {
    let permit = state.stream_permit()?;
    let request_id = state.request_id();
    let span = tracing::info_span!(
        "sample_stream",
        seq = request_id,
        chain = tracing::field::Empty,
        seed = tracing::field::Empty,
    );
    let first = Pull {
        _slot: Slot::new(state.clone(), permit),
        session: Session::new(state, span, caller),
        inbound,
        predecoded,
    };
    Ok(Box::pin(futures::stream::unfold(
        Some(first),
        move |pull| async move {
            let Pull {
                mut _slot,
                mut session,
                mut inbound,
                predecoded,
            } = pull?;
            let span = session.span.clone();
            let msg = match inbound.message().instrument(span.clone()).await {
                Ok(Some(m)) => predecoded.take(m),
                Ok(None) => {
                    session.end = "client closed the stream";
                    return None;
                }
                Err(status) => {
                    session.end = "receive error";
                    let status = completed(status);
                    span.in_scope(|| tracing::debug!(%status, "stream receive failed"));
                    return Some((Err(status), None));
                }
            };
            if _slot.charge.is_none() {
                let bytes = crate::request::memory::session_bytes(&msg);
                match session
                    .state
                    .memory
                    .charge(bytes, "this SampleStream session")
                {
                    Ok(c) => _slot.charge = Some(c),
                    Err(e) => {
                        session.end = "memory budget";
                        return Some((Err(e.into()), None));
                    }
                }
                // Compiled off the sampling threads, before the first step.
                match session
                    .state
                    .prepare_constraints(msg.params.as_ref(), None, request_id)
                    .instrument(span.clone())
                    .await
                {
                    Ok(p) => session.prepared = p,
                    Err(e) => {
                        session.end = "error";
                        span.in_scope(|| tracing::info!(error = %e, "stream step failed"));
                        return Some((Err(e.into()), None));
                    }
                }
            }
            let step_span = span.clone();
            let steps = session.state.steps.clone();
            let joined = steps
                .run(move || {
                    // For the crash report, should a plugin kill the process.
                    let _serving = samplerd_sampling::activity::serving(request_id);
                    let r = step_span.in_scope(|| session.step(&msg));
                    (session, r)
                })
                .await;
            // A panic dropped the session on its way up; a step the
            // watchdog gave up on keeps it on the written-off thread. The
            // slot is released here either way.
            let (mut session, result) = match joined {
                Ok(v) => v,
                Err(e) => {
                    span.in_scope(|| tracing::warn!(error = %e, "stream step failed"));
                    return Some((Err(e.into()), None));
                }
            };
            match result {
                Ok(resp) => {
                    let next = Pull {
                        _slot,
                        session,
                        inbound,
                        predecoded,
                    };
                    Some((Ok(resp), Some(next)))
                }
                Err(e) => {
                    // The message quotes the client's values: DEBUG only.
                    span.in_scope(|| {
                        tracing::info!(
                            reason = e.failure().reason().as_str(),
                            "stream step failed"
                        );
                        tracing::debug!(error = %e, "stream step failed");
                    });
                    session.end = "error";
                    Some((Err(Status::from(e)), None))
                }
            }
        },
    )))
}
