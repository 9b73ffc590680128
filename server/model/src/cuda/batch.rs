//! A batched decode step: the next token of several sequences in one pass.
//!
//! One embedding of B rows, each layer's weight products over the B rows
//! in one launch each (the weights streamed from device memory once per
//! step for every sequence, not once per sequence: each warp's weight row
//! is re-read from cache for the batch's other rows), RoPE, the K/V store and
//! attention of each row against its own sequence's cache (one launch each
//! for all rows, the rows described by a small device table), then the
//! output norm and head over the B rows and each row's logits copied into
//! its sequence's `logits` buffer. Every row uses the one-token step's
//! arithmetic orders, so each sequence's logits have the bits of its step
//! run alone (the product kernels compute each row independently; only the
//! order they are told changes the sums).
//!
//! The pass runs on a stream of the backend's own, with scratch sized for
//! the largest batch seen so far (kept for the backend's life; regrowing
//! frees the old buffers on the same stream, after the work that used
//! them). Events order it after each sequence's queued work and each
//! sequence's stream after it, so single-sequence steps, prefill,
//! `copy_logits` and `sample_prefix` on a state see finished data. Not
//! captured into a CUDA graph: the rows' composition changes from step to
//! step (sequences join and leave), and the step's ~10 launches per layer
//! are shared by all B sequences, so their overhead per token is already
//! 1/B of a single sequence's eager step.

use std::sync::{Arc, Mutex};
use std::time::Instant;

use cudarc::driver::CudaStream;

use super::backend::CudaBackend;
use super::batch_scratch::{BatchScratch, BatchStats, Batcher};
use super::err::err;
use super::launch::{Pass, Rows};
use super::state::{CudaState, alloc, dptr};
use crate::error::ModelError;

/// 64-bit words per row descriptor (`BatchRow` in forward.cu: the K cache,
/// V cache, scores and logits addresses, the position and the capacity).
const ROW_WORDS: usize = 6;

impl CudaBackend {
    /// Scratch for `rows` rows on `stream`.
    fn new_batch_scratch(
        &self,
        stream: Arc<CudaStream>,
        rows: usize,
    ) -> Result<BatchScratch, ModelError> {
        let event = || {
            self.ctx
                .new_event(None)
                .map_err(|e| err("creating an event", e))
        };
        Ok(BatchScratch {
            scratch: self.new_scratch(&stream, rows)?,
            desc: alloc(&stream, rows * ROW_WORDS, "batch rows")?,
            logits: alloc(&stream, rows * self.config.n_vocab, "batch logits")?,
            ready: (0..rows).map(|_| event()).collect::<Result<_, _>>()?,
            done: event()?,
            host_desc: Vec::with_capacity(rows * ROW_WORDS),
            rows,
            stream,
        })
    }

    /// What the batched steps have done since the backend was created.
    pub fn batch_stats(&self) -> BatchStats {
        lock(&self.batch).stats
    }

    /// One decode step of every state in batched passes (of at most
    /// `max_batch_rows` states each: a bounded scratch, and the rows stay
    /// within a grid dimension's limit; see the module's doc). Checks
    /// every row like a one-token step before anything is enqueued.
    pub(super) fn enqueue_batched_step(
        &self,
        states: &mut [&mut CudaState],
        tokens: &[u32],
    ) -> Result<(), ModelError> {
        let n_vocab = self.config.n_vocab;
        for (st, &tok) in states.iter().zip(tokens) {
            self.check_input(st, std::slice::from_ref(&tok))?;
            if st.logits.len() < n_vocab {
                return Err(ModelError::Backend(format!(
                    "cuda: the sequence's logits buffer holds {} entries, vocabulary {n_vocab}",
                    st.logits.len()
                )));
            }
        }
        let m = self.opts.max_batch_rows;
        for (st, tok) in states.chunks_mut(m).zip(tokens.chunks(m)) {
            self.enqueue_pass(st, tok)?;
        }
        Ok(())
    }

    /// One batched pass over `states` (at most `max_batch_rows`, checked).
    fn enqueue_pass(
        &self,
        states: &mut [&mut CudaState],
        tokens: &[u32],
    ) -> Result<(), ModelError> {
        let n = states.len();
        let t0 = Instant::now();
        let mut guard = lock(&self.batch);
        let batcher = &mut *guard;
        let b = match batcher.scratch.take() {
            Some(b) if b.rows >= n => batcher.scratch.insert(b),
            old => {
                // A smaller scratch's buffers are freed on its stream, after
                // the passes that used them, before the larger one is
                // allocated; the stream stays.
                let stream = match old {
                    Some(old) => Arc::clone(&old.stream),
                    None => self
                        .ctx
                        .new_stream()
                        .map_err(|e| err("creating a stream", e))?,
                };
                batcher.scratch.insert(self.new_batch_scratch(stream, n)?)
            }
        };
        let s = &b.stream;
        // After each sequence's queued work (its last step, prefill or
        // sampling still reads or writes its cache and logits).
        for (st, ev) in states.iter().zip(&b.ready) {
            ev.record(&st.stream)
                .map_err(|e| err("recording an event", e))?;
            s.wait(ev).map_err(|e| err("waiting for an event", e))?;
        }
        b.host_desc.clear();
        let mut max_pos = 0;
        for st in states.iter() {
            let ss = &st.stream;
            max_pos = max_pos.max(st.pos);
            b.host_desc.extend([
                dptr(&st.k, ss),
                dptr(&st.v, ss),
                dptr(&st.scores, ss),
                dptr(&st.logits, ss),
                st.pos as u64,
                st.capacity as u64,
            ]);
        }
        let mut desc_view = b.desc.slice_mut(0..n * ROW_WORDS);
        s.memcpy_htod(&b.host_desc[..], &mut desc_view)
            .map_err(|e| err("uploading the batch rows", e))?;
        let mut tok_view = b.scratch.tokens.slice_mut(0..n);
        s.memcpy_htod(tokens, &mut tok_view)
            .map_err(|e| err("uploading the tokens", e))?;
        let desc = dptr(&b.desc, s);
        let p = Pass {
            s,
            sc: &b.scratch,
            rows: Rows::Batch { desc, max_pos },
        };
        self.enqueue_embed(p, n)?;
        for l in 0..self.weights.layers.len() {
            self.enqueue_layer(p, n, l)?;
        }
        self.enqueue_output_batch(p, n, desc, dptr(&b.logits, s))?;
        // Each sequence's later work after the step.
        b.done.record(s).map_err(|e| err("recording an event", e))?;
        for st in states.iter_mut() {
            st.stream
                .wait(&b.done)
                .map_err(|e| err("waiting for an event", e))?;
            st.pos += 1;
        }
        let stats = &mut batcher.stats;
        stats.passes += 1;
        stats.rows += n as u64;
        stats.largest = stats.largest.max(n);
        // Each sequence's share of the time spent enqueueing.
        let share = t0.elapsed().as_nanos() as u64 / n as u64;
        for st in states.iter_mut() {
            st.timing.forward_ns += share;
        }
        Ok(())
    }
}

fn lock(m: &Mutex<Batcher>) -> std::sync::MutexGuard<'_, Batcher> {
    // Nothing in a Batcher is left half-updated by a panic that matters:
    // the scratch is only ever replaced whole.
    m.lock().unwrap_or_else(|e| e.into_inner())
}
