//! Running a forward pass on one sequence, and the CUDA backend's `Backend` implementation.
//!
//! The input checks (the CPU backend's errors), uploading tokens and
//! position, the decode step's CUDA graph (captured on first use, replayed
//! after), the layer-by-layer trace, and copying the logits back.

#![forbid(unsafe_code)]

use std::time::Instant;

use cudarc::driver::sys;

use super::backend::CudaBackend;
use super::err::err;
use super::launch::Pass;
use super::state::{CudaState, DecodeGraph};
use crate::backend::{
    Backend, PrefixRow, SequenceState, batch_rows, check_logits, check_tokens, downcast_state,
};
use crate::error::ModelError;

impl CudaBackend {
    /// Checks the input like the CPU backend does (same errors).
    pub(super) fn check_input(&self, st: &CudaState, tokens: &[u32]) -> Result<(), ModelError> {
        check_tokens(st.pos, st.capacity, tokens, self.config.n_vocab)?;
        let n = tokens.len();
        if st.pos + n > self.rope_positions {
            return Err(ModelError::Backend(format!(
                "cuda: position {} is beyond the model's training context {}",
                st.pos + n,
                self.rope_positions
            )));
        }
        Ok(())
    }

    /// Runs `tokens` on the device; the last position's logits stay in the
    /// state's device buffer (read them with [`Self::copy_logits`] or sample
    /// on the device with [`Self::sample_prefix`]).
    pub fn forward_device(&self, st: &mut CudaState, tokens: &[u32]) -> Result<(), ModelError> {
        self.check_input(st, tokens)?;
        let t0 = Instant::now();
        let n = tokens.len();
        self.stage_input(st, tokens)?;
        if n == 1 && self.opts.graphs && !st.graph_failed {
            if st.graph.is_none() {
                st.graph = self.capture_decode(st);
            }
            if let Some(g) = &st.graph {
                g.0.launch()
                    .map_err(|e| err("launching the decode graph", e))?;
            } else {
                self.enqueue_forward(st, 1)?;
            }
        } else {
            self.enqueue_forward(st, n)?;
        }
        st.pos += n;
        st.timing.forward_ns += t0.elapsed().as_nanos() as u64;
        Ok(())
    }

    /// Enqueues one decode step for every state (`tokens[i]` on
    /// `states[i]`); afterwards each state's device logits buffer holds its
    /// row, ready for [`Self::copy_logits`] or [`Self::sample_prefix`]
    /// (ordered on the state's stream). Two or more states run as one
    /// batched pass (`batch`: the weights read once for all of them), each
    /// row bit-identical to its step run alone; one state takes the
    /// single-sequence path (its captured graph).
    pub fn enqueue_decode_batch(
        &self,
        states: &mut [&mut CudaState],
        tokens: &[u32],
    ) -> Result<(), ModelError> {
        if states.len() != tokens.len() {
            return Err(ModelError::Backend(format!(
                "cuda: a batched step of {} sequences got {} tokens",
                states.len(),
                tokens.len()
            )));
        }
        match states {
            [] => Ok(()),
            [st] => self.forward_device(st, tokens),
            _ => self.enqueue_batched_step(states, tokens),
        }
    }

    /// Sizes the scratch for `tokens` and uploads them and the position.
    fn stage_input(&self, st: &mut CudaState, tokens: &[u32]) -> Result<(), ModelError> {
        let n = tokens.len();
        if st.scratch.n_tok < n {
            st.scratch = self.new_scratch(&st.stream, n)?;
            // The graph points into the old scratch.
            st.graph = None;
        }
        let pos = [st.pos as i32];
        st.stream
            .memcpy_htod(&pos[..], &mut st.pos_dev)
            .map_err(|e| err("uploading the position", e))?;
        let mut tok_view = st.scratch.tokens.slice_mut(0..n);
        st.stream
            .memcpy_htod(tokens, &mut tok_view)
            .map_err(|e| err("uploading the tokens", e))
    }

    /// Diagnostics: runs `tokens` like [`Self::forward_device`] but eagerly,
    /// layer by layer, and returns the residual stream after every layer
    /// (`tokens.len() × n_embd` values each) — the CPU's twin is
    /// `cpu::trace_layers`. The logits land as usual.
    pub fn forward_trace(
        &self,
        st: &mut CudaState,
        tokens: &[u32],
    ) -> Result<Vec<Vec<f32>>, ModelError> {
        self.check_input(st, tokens)?;
        let n = tokens.len();
        let nd = n * self.config.n_embd;
        self.stage_input(st, tokens)?;
        self.enqueue_embed(Pass::seq(st), n)?;
        let mut layers = Vec::with_capacity(self.weights.layers.len());
        for l in 0..self.weights.layers.len() {
            self.enqueue_layer(Pass::seq(st), n, l)?;
            let (mut x, mut proj) = (vec![0f32; nd], vec![0f32; nd]);
            st.stream
                .memcpy_dtoh(&st.scratch.x.slice(0..nd), &mut x)
                .map_err(|e| err("copying the residual stream", e))?;
            st.stream
                .memcpy_dtoh(&st.scratch.proj.slice(0..nd), &mut proj)
                .map_err(|e| err("copying the residual stream", e))?;
            st.stream
                .synchronize()
                .map_err(|e| err("forward pass", e))?;
            // The residual add the next kernel fuses (same f32 addition).
            for (a, b) in x.iter_mut().zip(&proj) {
                *a += b;
            }
            layers.push(x);
        }
        self.enqueue_output(st, n)?;
        st.pos += n;
        Ok(layers)
    }

    /// Captures one decode step; on failure records it and returns None
    /// (the step then runs eagerly, and capture is not retried).
    fn capture_decode(&self, st: &mut CudaState) -> Option<DecodeGraph> {
        let mode = sys::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL;
        if st.stream.begin_capture(mode).is_err() {
            st.graph_failed = true;
            return None;
        }
        let enqueued = self.enqueue_forward(st, 1);
        let graph = st.stream.end_capture(sys::CUgraphInstantiate_flags(0));
        match (enqueued, graph) {
            (Ok(()), Ok(Some(g))) => Some(DecodeGraph(g)),
            _ => {
                st.graph_failed = true;
                None
            }
        }
    }

    /// Waits for the state's stream and copies the logits to `out`.
    pub fn copy_logits(&self, st: &mut CudaState, out: &mut [f32]) -> Result<(), ModelError> {
        let n = self.config.n_vocab;
        if out.len() != n {
            return Err(ModelError::Backend(format!(
                "logits buffer has {} entries, vocabulary {n}",
                out.len()
            )));
        }
        let t0 = Instant::now();
        if st.logits.len() < n {
            return Err(ModelError::Backend(format!(
                "cuda: the sequence's logits buffer holds {} entries, vocabulary {n}",
                st.logits.len()
            )));
        }
        st.stream
            .memcpy_dtoh(&st.logits.slice(0..n), out)
            .map_err(|e| err("copying the logits", e))?;
        st.stream
            .synchronize()
            .map_err(|e| err("forward pass", e))?;
        st.d2h_bytes += (n * size_of::<f32>()) as u64;
        st.timing.copy_ns += t0.elapsed().as_nanos() as u64;
        Ok(())
    }
}

fn downcast(state: &mut dyn SequenceState) -> Result<&mut CudaState, ModelError> {
    downcast_state(state, "CUDA")
}

impl Backend for CudaBackend {
    fn name(&self) -> String {
        self.name.clone()
    }

    fn new_state(&self, capacity: usize) -> Result<Box<dyn SequenceState>, ModelError> {
        Ok(Box::new(self.new_cuda_state(capacity.max(1))?))
    }

    fn forward(
        &self,
        state: &mut dyn SequenceState,
        tokens: &[u32],
        logits: &mut [f32],
    ) -> Result<(), ModelError> {
        let st = downcast(state)?;
        check_logits(logits.len(), self.config.n_vocab)?;
        self.forward_device(st, tokens)?;
        self.copy_logits(st, logits)
    }

    /// Enqueues every sequence's step (one batched pass for two or more:
    /// [`CudaBackend::enqueue_decode_batch`]), then copies the logits back.
    fn forward_batch(
        &self,
        states: &mut [&mut dyn SequenceState],
        tokens: &[u32],
        logits: &mut [&mut [f32]],
    ) -> Result<(), ModelError> {
        for (st, tok, l) in batch_rows(states, tokens, logits)? {
            self.check_input(downcast(st)?, std::slice::from_ref(tok))?;
            check_logits(l.len(), self.config.n_vocab)?;
        }
        let mut cuda = states
            .iter_mut()
            .map(|st| downcast(&mut **st))
            .collect::<Result<Vec<_>, _>>()?;
        self.enqueue_decode_batch(&mut cuda, tokens)?;
        for (st, l) in states.iter_mut().zip(logits.iter_mut()) {
            self.copy_logits(downcast(&mut **st)?, l)?;
        }
        Ok(())
    }

    fn runs_device_prefix(&self) -> bool {
        true
    }

    /// The decode step, then the rows' sampling prefixes on the device
    /// (`cuda/sampling.rs`).
    fn forward_batch_prefixed(
        &self,
        states: &mut [&mut dyn SequenceState],
        tokens: &[u32],
        logits: &mut [&mut [f32]],
        rows: &mut [PrefixRow<'_>],
    ) -> Result<(), ModelError> {
        self.forward_batch_prefixed_cuda(states, tokens, logits, rows)
    }
}
