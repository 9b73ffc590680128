//! The CPU forward pass (llama / qwen2 / qwen3 decoder blocks) and the CPU [`Backend`].
//!
//! Per block: RMSNorm → fused q/k/v product (+ qwen2 biases) → per-head
//! RMSNorm of q and k (qwen3) → RoPE (adjacent pairs for llama GGUFs, NEOX
//! halves for qwen2/3; Llama 3.1+ frequency factors, see `rope`) → K/V
//! appended to the sequence's f16 cache → grouped-query attention over the
//! cache → output product + residual → RMSNorm → fused gate/up product →
//! SiLU·up → down product + residual. Then the final RMSNorm and the output (or tied
//! embedding) product for the last position only.
//!
//! Numerics follow llama.cpp's CPU path: activations quantised per block to
//! 8 bits before each weight product, f16 K/V cache, the query and the
//! attention probabilities rounded to f16 for the f16 products, f64 sums in
//! RMSNorm and softmax.
//!
//! The parts, one module each: `backend` (the [`CpuBackend`] type),
//! `state` (a sequence's KV cache), `scratch` (the per-step buffers),
//! `step` (a step's phases), `rows` (per-row work over the pool), `attend`
//! (the attention pass), `norm` (RMSNorm), `trace` (per-layer tracing);
//! this module implements [`Backend`] with them.

mod attend;
mod backend;
pub(crate) mod norm;
mod rows;
mod scratch;
mod state;
mod step;
mod trace;

pub use backend::CpuBackend;
pub use state::CpuState;
pub use trace::trace_layers;

use scratch::Scratch;
use state::KvCache;
use step::Segment;

use crate::backend::{Backend, SequenceState, batch_rows, check_batch_shape, downcast_state};
use crate::error::ModelError;
use crate::quant::QMatrix;

fn cpu_state(state: &mut dyn SequenceState) -> Result<&mut CpuState, ModelError> {
    downcast_state(state, "CPU")
}

impl Backend for CpuBackend {
    fn name(&self) -> String {
        format!("cpu-{}", crate::quant::kernel_name())
    }

    fn new_state(&self, capacity: usize) -> Result<Box<dyn SequenceState>, ModelError> {
        let c = &self.config;
        let len = c.n_layer * c.n_head_kv * capacity * c.head_dim;
        let mut st = CpuState {
            cache: KvCache {
                capacity,
                pos: 0,
                k: vec![0u16; len],
                v: vec![0u16; len],
            },
            s: Scratch::default(),
        };
        st.s.ensure(c, &self.weights, self.pool.n_threads(), 1, capacity);
        Ok(Box::new(st))
    }

    fn fork_state(
        &self,
        state: &mut dyn SequenceState,
    ) -> Option<Result<Box<dyn SequenceState>, ModelError>> {
        let mut fork = || {
            let from = cpu_state(state)?;
            let mut fresh = self.new_state(from.cache.capacity)?;
            cpu_state(fresh.as_mut())?
                .cache
                .copy_prefix(&from.cache, self.config.head_dim);
            Ok(fresh)
        };
        Some(fork())
    }

    fn forward(
        &self,
        state: &mut dyn SequenceState,
        tokens: &[u32],
        logits: &mut [f32],
    ) -> Result<(), ModelError> {
        let CpuState { cache, s } = cpu_state(state)?;
        self.check_segment(cache, tokens, logits, 1)?;
        self.forward_segments(
            &mut [Segment {
                cache,
                tokens,
                logits,
                decode_rows: false,
            }],
            s,
        );
        Ok(())
    }

    fn forward_batch(
        &self,
        states: &mut [&mut dyn SequenceState],
        tokens: &[u32],
        logits: &mut [&mut [f32]],
    ) -> Result<(), ModelError> {
        let mut segs = Vec::with_capacity(states.len());
        for (st, tok, l) in batch_rows(states, tokens, logits)? {
            let cache = &mut cpu_state(st)?.cache;
            let tokens = std::slice::from_ref(tok);
            self.check_segment(cache, tokens, l, 1)?;
            segs.push(Segment {
                cache,
                tokens,
                logits: l,
                decode_rows: false,
            });
        }
        let mut s = self.batch_scratch.lock().unwrap_or_else(|e| e.into_inner());
        self.forward_segments(&mut segs, &mut s);
        Ok(())
    }

    /// Every row of every sequence in one step (the weights read once),
    /// each row in a decode step's order (see `Segment::decode_rows`);
    /// every sequence is checked before anything runs.
    fn forward_rows(
        &self,
        states: &mut [&mut dyn SequenceState],
        tokens: &[&[u32]],
        logits: &mut [&mut [f32]],
    ) -> Result<(), ModelError> {
        check_batch_shape(states.len(), tokens.len(), logits.len())?;
        let mut segs = Vec::with_capacity(states.len());
        for ((st, &tokens), l) in states.iter_mut().zip(tokens).zip(logits.iter_mut()) {
            let cache = &mut cpu_state(&mut **st)?.cache;
            self.check_segment(cache, tokens, l, tokens.len())?;
            segs.push(Segment {
                cache,
                tokens,
                logits: l,
                decode_rows: true,
            });
        }
        let mut s = self.batch_scratch.lock().unwrap_or_else(|e| e.into_inner());
        self.forward_segments(&mut segs, &mut s);
        Ok(())
    }
}

#[allow(dead_code)]
fn _assert_send_sync(b: CpuBackend, m: QMatrix) -> (Box<dyn Send + Sync>, QMatrix) {
    (Box::new(b), m)
}
