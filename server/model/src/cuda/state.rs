//! One sequence on the device ([`CudaState`]) and its allocation.
//!
//! One sequence on the device ([`CudaState`]): its stream, f16 KV cache,
//! per-token scratch, sampling buffers and captured decode graph, and their
//! allocation.

use std::any::Any;
use std::sync::Arc;

use cudarc::driver::{
    CudaContext, CudaGraph, CudaSlice, CudaStream, DevicePtr, DeviceRepr, ValidAsZeroBits,
};

use super::err::err;
use super::format::Q8K_BYTES;
use super::kernels;
use crate::backend::SequenceState;
use crate::error::ModelError;
use crate::gguf::Config;
use crate::quant::QK_K;
use crate::quant::{BlockQ8_1, QK};

/// A decode-step graph. `CudaGraph` holds raw driver handles and is not
/// `Send`; it is only ever launched through `&mut CudaState`, one thread at
/// a time, and the driver allows graph launches from any thread.
pub(super) struct DecodeGraph(pub(super) CudaGraph);
// SAFETY: see the type's doc: exclusive access through &mut CudaState, and
// CUDA graph handles are not tied to the creating thread.
unsafe impl Send for DecodeGraph {}

/// Per-token scratch, sized for `n_tok` tokens.
pub(super) struct Scratch {
    pub(super) n_tok: usize,
    pub(super) tokens: CudaSlice<u32>,
    /// The residual stream; the last down product (`proj`) is added by the
    /// next layer's `add_norm_quant`.
    pub(super) x: CudaSlice<f32>,
    /// Q8_1 blocks of the widest activation (`n_tok * n_ff / 32` × 40 bytes).
    pub(super) xq: CudaSlice<u8>,
    /// Q8_K blocks of the widest activation (K-quant products; one byte
    /// when the model has none).
    pub(super) xqk: CudaSlice<u8>,
    /// The normed or SwiGLU activations as f32, for the products that do
    /// not take Q8_1 (F16 / BF16, and `quantize_q8_k`'s input).
    pub(super) xa: CudaSlice<f32>,
    pub(super) qkv: CudaSlice<f32>,
    pub(super) attn: CudaSlice<f32>,
    pub(super) proj: CudaSlice<f32>,
    pub(super) gu: CudaSlice<f32>,
}

/// Sampling buffers: a working copy of the logits, the uploaded stage
/// parameters, the status word and the candidates read back.
pub(super) struct SampleBuffers {
    pub(super) work: CudaSlice<f32>,
    pub(super) status: CudaSlice<i32>,
    pub(super) out: CudaSlice<u32>,
    /// The multi-block top-k's per-block candidates (sized on first use).
    pub(super) part: CudaSlice<u64>,
    pub(super) ids: CudaSlice<u32>,
    pub(super) vals: CudaSlice<u32>,
    pub(super) starts: CudaSlice<i32>,
    pub(super) host_out: Vec<u32>,
}

/// One sequence on the device: its stream, KV cache (f16 bits,
/// `[layer][kv_head][position][head_dim]`), scratch and decode graph.
pub struct CudaState {
    pub(super) stream: Arc<CudaStream>,
    pub(super) capacity: usize,
    pub(super) pos: usize,
    pub(super) k: CudaSlice<u16>,
    pub(super) v: CudaSlice<u16>,
    pub(super) pos_dev: CudaSlice<i32>,
    /// Attention scores of a one-token step, `[n_head][capacity]`.
    pub(super) scores: CudaSlice<f32>,
    pub(super) logits: CudaSlice<f32>,
    pub(super) scratch: Scratch,
    pub(super) sample: SampleBuffers,
    pub(super) graph: Option<DecodeGraph>,
    pub(super) graph_failed: bool,
    /// Bytes copied device → host since creation (logits and candidates).
    pub d2h_bytes: u64,
    /// Time spent in each part of the last steps (for the benchmark).
    pub timing: StepTiming,
}

/// Accumulated wall time per part of the step (nanoseconds).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct StepTiming {
    pub forward_ns: u64,
    pub sampling_ns: u64,
    pub copy_ns: u64,
}

impl CudaState {
    /// Whether decode steps replay a captured CUDA graph (false before the
    /// first decode step, with graphs off, or after a failed capture).
    pub fn graph_active(&self) -> bool {
        self.graph.is_some()
    }
}

impl SequenceState for CudaState {
    fn position(&self) -> usize {
        self.pos
    }
    fn capacity(&self) -> usize {
        self.capacity
    }
    fn truncate(&mut self, position: usize) {
        self.pos = self.pos.min(position);
    }
    fn as_any_mut(&mut self) -> &mut dyn Any {
        self
    }
}

pub(super) fn alloc<T: DeviceRepr + ValidAsZeroBits>(
    stream: &Arc<CudaStream>,
    n: usize,
    what: &str,
) -> Result<CudaSlice<T>, ModelError> {
    stream.alloc_zeros::<T>(n.max(1)).map_err(|e| {
        let what = format!("allocating {what} ({n} elements)");
        if e.0 == cudarc::driver::sys::cudaError_enum::CUDA_ERROR_OUT_OF_MEMORY {
            ModelError::DeviceMemory(format!("cuda: {what}: {e}"))
        } else {
            err(&what, e)
        }
    })
}

/// The device address of a buffer (event tracking is off: no sync guard).
pub(super) fn dptr<T>(s: &CudaSlice<T>, stream: &CudaStream) -> u64 {
    s.device_ptr(stream).0
}

impl Scratch {
    /// Scratch for a step of `n` tokens of a model of `c` on `stream`
    /// (`needs_q8k`: some weight matrix takes Q8_K activations).
    pub(super) fn new(
        stream: &Arc<CudaStream>,
        c: &Config,
        needs_q8k: bool,
        n: usize,
    ) -> Result<Scratch, ModelError> {
        let d = c.n_embd;
        let qkv = d + 2 * c.n_head_kv * c.head_dim;
        let widest = d.max(c.n_ff);
        let q8k = if needs_q8k {
            n * widest.div_ceil(QK_K) * Q8K_BYTES
        } else {
            1
        };
        Ok(Scratch {
            n_tok: n,
            tokens: alloc(stream, n, "token ids")?,
            x: alloc(stream, n * d, "x")?,
            xq: alloc(stream, n * widest / QK * size_of::<BlockQ8_1>(), "xq")?,
            xqk: alloc(stream, q8k, "xqk")?,
            xa: alloc(stream, n * widest, "xa")?,
            qkv: alloc(stream, n * qkv, "qkv")?,
            attn: alloc(stream, n * d, "attn")?,
            proj: alloc(stream, n * d, "proj")?,
            gu: alloc(stream, n * 2 * c.n_ff, "gate/up")?,
        })
    }
}

impl CudaState {
    /// A sequence of a model of `c` with room for `capacity` tokens, on a
    /// new stream of `ctx`, with scratch for one token.
    pub(super) fn new(
        ctx: &Arc<CudaContext>,
        c: &Config,
        needs_q8k: bool,
        capacity: usize,
    ) -> Result<CudaState, ModelError> {
        let stream = ctx.new_stream().map_err(|e| err("creating a stream", e))?;
        let cache = c.n_layer * c.n_head_kv * capacity * c.head_dim;
        let st = CudaState {
            capacity,
            pos: 0,
            k: alloc(&stream, cache, "K cache")?,
            v: alloc(&stream, cache, "V cache")?,
            pos_dev: alloc(&stream, 1, "position")?,
            scores: alloc(&stream, c.n_head * capacity, "attention scores")?,
            logits: alloc(&stream, c.n_vocab, "logits")?,
            scratch: Scratch::new(&stream, c, needs_q8k, 1)?,
            sample: SampleBuffers {
                work: alloc(&stream, c.n_vocab, "sampling logits")?,
                status: alloc(&stream, 1, "sampling status")?,
                out: alloc(&stream, 2 + 2 * kernels::TOPK_MAX, "candidates")?,
                part: alloc(&stream, 1, "top-k candidates")?,
                ids: alloc(&stream, 64, "stage ids")?,
                vals: alloc(&stream, 64, "stage values")?,
                starts: alloc(&stream, 65, "stage runs")?,
                host_out: vec![0; 2 + 2 * kernels::TOPK_MAX],
            },
            graph: None,
            graph_failed: false,
            d2h_bytes: 0,
            timing: StepTiming::default(),
            stream,
        };
        st.stream
            .synchronize()
            .map_err(|e| err("allocating a sequence", e))?;
        Ok(st)
    }
}
