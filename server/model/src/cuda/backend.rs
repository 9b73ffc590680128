//! The CUDA [`Backend`]: weights uploaded once in their quantised block
//! formats, one CUDA stream, KV cache and scratch per sequence, the forward
//! pass as a fixed sequence of NVRTC-compiled kernels (see `kernels.cu`),
//! the decode step (one token) captured into a CUDA graph on first use and
//! replayed afterwards, and the device sampling prefix ([`DeviceOp`]) that
//! leaves at most k candidates to copy to the host.
//!
//! Position and token live in device memory and the kernels read them there,
//! so one captured graph serves every decode step of its sequence; the graph
//! is dropped whenever the scratch it points into is reallocated.

use std::any::Any;
use std::sync::Arc;
use std::time::Instant;

use cudarc::driver::{
    CudaContext, CudaGraph, CudaSlice, CudaStream, DevicePtr, DeviceRepr, ValidAsZeroBits, sys,
};

use super::kernels::{self, Arg, Kernels, cfg};
use crate::backend::{Backend, SequenceState};
use crate::error::ModelError;
use crate::gguf::Config;
use crate::quant::{BlockQ4_1, BlockQ8_0, BlockQ8_1, QK, QMatrix};
use crate::weights::{Fused, Weights};

/// Options of the CUDA backend.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct CudaOptions {
    /// CUDA device ordinal.
    pub ordinal: usize,
    /// Capture the decode step into a CUDA graph (`SAMPLERD_CUDA_GRAPHS=0`
    /// turns it off, for comparisons).
    pub graphs: bool,
    /// Which weight-product kernels run (`SAMPLERD_CUDA_MM=lanes` picks the
    /// first layout, for comparisons; both give identical results).
    pub mm: MmKernel,
    /// One-token steps compute attention scores in a separate, wide kernel
    /// (`attn_scores`) instead of inside the one-block-per-head attention
    /// kernel (`SAMPLERD_CUDA_ATTN=fused` turns it off; same results).
    pub split_scores: bool,
}

/// The layout of the weight-product kernels; same arithmetic, same bits.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum MmKernel {
    /// One warp per row: blocks loaded in parallel, short fma chains
    /// (`mmw_*`).
    #[default]
    Warp,
    /// Eight threads per row, each running its lane's chain over every
    /// block (`mm_*`).
    Lanes,
}

impl Default for CudaOptions {
    fn default() -> Self {
        CudaOptions {
            ordinal: 0,
            graphs: std::env::var("SAMPLERD_CUDA_GRAPHS").as_deref() != Ok("0"),
            mm: match std::env::var("SAMPLERD_CUDA_MM").as_deref() {
                Ok("lanes") => MmKernel::Lanes,
                _ => MmKernel::Warp,
            },
            split_scores: std::env::var("SAMPLERD_CUDA_ATTN").as_deref() != Ok("fused"),
        }
    }
}

fn err(what: &str, e: impl std::fmt::Display) -> ModelError {
    ModelError::Backend(format!("cuda: {what}: {e}"))
}

/// A weight matrix on the device, in the CPU loader's block format.
#[derive(Debug)]
struct DevMatrix {
    data: CudaSlice<u8>,
    rows: usize,
    cols: usize,
    q4_1: bool,
}

#[derive(Debug)]
enum DevFused {
    One(DevMatrix),
    Many(Vec<DevMatrix>),
}

#[derive(Debug)]
struct DevLayer {
    attn_norm: CudaSlice<f32>,
    wqkv: DevFused,
    bqkv: Option<CudaSlice<f32>>,
    wo: DevMatrix,
    ffn_norm: CudaSlice<f32>,
    wgu: DevFused,
    w_down: DevMatrix,
}

#[derive(Debug)]
struct DevWeights {
    tok_embd: DevMatrix,
    layers: Vec<DevLayer>,
    output_norm: CudaSlice<f32>,
    output: Option<DevMatrix>,
}

impl DevWeights {
    fn output(&self) -> &DevMatrix {
        self.output.as_ref().unwrap_or(&self.tok_embd)
    }
}

/// The raw bytes of a slice of `#[repr(C)]` blocks.
fn block_bytes<T>(blocks: &[T]) -> &[u8] {
    // SAFETY: BlockQ8_0 / BlockQ4_1 are #[repr(C)] with only f32 and byte
    // fields and no padding (36 and 24 bytes), so every byte is initialised;
    // the returned slice borrows `blocks`.
    unsafe {
        std::slice::from_raw_parts(blocks.as_ptr().cast::<u8>(), std::mem::size_of_val(blocks))
    }
}

/// The device address of a buffer (event tracking is off: no sync guard).
fn dptr<T>(s: &CudaSlice<T>, stream: &CudaStream) -> u64 {
    s.device_ptr(stream).0
}

/// A decode-step graph. `CudaGraph` holds raw driver handles and is not
/// `Send`; it is only ever launched through `&mut CudaState`, one thread at
/// a time, and the driver allows graph launches from any thread.
struct DecodeGraph(CudaGraph);
// SAFETY: see the type's doc: exclusive access through &mut CudaState, and
// CUDA graph handles are not tied to the creating thread.
unsafe impl Send for DecodeGraph {}

/// Per-token scratch, sized for `n_tok` tokens.
struct Scratch {
    n_tok: usize,
    tokens: CudaSlice<u32>,
    /// The residual stream; the last down product (`proj`) is added by the
    /// next layer's `add_norm_quant`.
    x: CudaSlice<f32>,
    /// Q8_1 blocks of the widest activation (`n_tok * n_ff / 32` × 40 bytes).
    xq: CudaSlice<u8>,
    qkv: CudaSlice<f32>,
    attn: CudaSlice<f32>,
    proj: CudaSlice<f32>,
    gu: CudaSlice<f32>,
}

/// Sampling buffers: a working copy of the logits, the uploaded stage
/// parameters, the status word and the candidates read back.
struct SampleBuffers {
    work: CudaSlice<f32>,
    status: CudaSlice<i32>,
    out: CudaSlice<u32>,
    ids: CudaSlice<u32>,
    vals: CudaSlice<u32>,
    starts: CudaSlice<i32>,
    host_out: Vec<u32>,
}

/// One sequence on the device: its stream, KV cache (f16 bits,
/// `[layer][kv_head][position][head_dim]`), scratch and decode graph.
pub struct CudaState {
    stream: Arc<CudaStream>,
    capacity: usize,
    pos: usize,
    k: CudaSlice<u16>,
    v: CudaSlice<u16>,
    pos_dev: CudaSlice<i32>,
    /// Attention scores of a one-token step, `[n_head][capacity]`.
    scores: CudaSlice<f32>,
    logits: CudaSlice<f32>,
    scratch: Scratch,
    sample: SampleBuffers,
    graph: Option<DecodeGraph>,
    graph_failed: bool,
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

/// One stage of the device sampling prefix, with its per-step data.
#[derive(Clone, Copy, Debug)]
pub enum DeviceOp<'a> {
    /// Adds `bias[e]` to `logits[ids[e]]`; entries `starts[r]..starts[r+1]`
    /// share one id and are added in that order.
    LogitBias {
        ids: &'a [u32],
        bias: &'a [f32],
        starts: &'a [i32],
    },
    /// Repetition penalties over the window's distinct ids and counts.
    Penalties {
        ids: &'a [u32],
        counts: &'a [u32],
        repeat: f32,
        frequency: f32,
        presence: f32,
    },
    /// Divides every logit by `t` (> 0).
    Temperature(f32),
    /// Keeps the k (1..=[`kernels::TOPK_MAX`]) best, sorted descending, ties
    /// by lower id; ends the prefix.
    TopK(usize),
}

/// What the device prefix left.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum DeviceStatus {
    /// `candidates` holds the survivors.
    Ok,
    /// A NaN or +inf logit: the caller reruns on the CPU for the exact error.
    BadLogit,
    /// No finite logit: the caller reruns on the CPU for the exact outcome.
    NoFinite,
}

/// The CUDA backend.
pub struct CudaBackend {
    config: Config,
    ctx: Arc<CudaContext>,
    kernels: Kernels,
    weights: DevWeights,
    rope: CudaSlice<f32>,
    rope_positions: usize,
    opts: CudaOptions,
    /// Vector width (8 or 16) of the ggml build the CPU backend mirrors
    /// (`crate::ggml::flavor`): attention and SiLU follow its lane order.
    lanes: i32,
    name: String,
}

impl std::fmt::Debug for CudaBackend {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CudaBackend")
            .field("name", &self.name)
            .finish()
    }
}

fn alloc<T: DeviceRepr + ValidAsZeroBits>(
    stream: &Arc<CudaStream>,
    n: usize,
    what: &str,
) -> Result<CudaSlice<T>, ModelError> {
    stream
        .alloc_zeros::<T>(n.max(1))
        .map_err(|e| err(&format!("allocating {what} ({n} elements)"), e))
}

fn upload_matrix(
    stream: &Arc<CudaStream>,
    m: &QMatrix,
    what: &str,
) -> Result<DevMatrix, ModelError> {
    let (bytes, q4_1) = match m {
        QMatrix::Q8_0 { blocks, .. } => (block_bytes::<BlockQ8_0>(blocks), false),
        QMatrix::Q4_1 { blocks, .. } => (block_bytes::<BlockQ4_1>(blocks), true),
    };
    let data = stream
        .clone_htod(bytes)
        .map_err(|e| err(&format!("uploading {what}"), e))?;
    Ok(DevMatrix {
        data,
        rows: m.rows(),
        cols: m.cols(),
        q4_1,
    })
}

fn upload_fused(stream: &Arc<CudaStream>, f: &Fused, what: &str) -> Result<DevFused, ModelError> {
    Ok(match f {
        Fused::One(m) => DevFused::One(upload_matrix(stream, m, what)?),
        Fused::Many(v) => DevFused::Many(
            v.iter()
                .map(|m| upload_matrix(stream, m, what))
                .collect::<Result<_, _>>()?,
        ),
    })
}

fn upload_f32(
    stream: &Arc<CudaStream>,
    v: &[f32],
    what: &str,
) -> Result<CudaSlice<f32>, ModelError> {
    stream
        .clone_htod(v)
        .map_err(|e| err(&format!("uploading {what}"), e))
}

/// cos/sin per rotated pair for every position, with the CPU path's
/// iterative theta (so RoPE matches `forward.rs` bit for bit).
fn rope_table(c: &Config, positions: usize) -> Vec<f32> {
    let pairs = c.rope_dim / 2;
    let theta_scale = c.rope_freq_base.powf(-2.0 / c.rope_dim as f32);
    let mut t = Vec::with_capacity(positions * pairs * 2);
    for pos in 0..positions {
        let mut theta = pos as f32;
        for _ in 0..pairs {
            t.push(theta.cos());
            t.push(theta.sin());
            theta *= theta_scale;
        }
    }
    t
}

impl CudaBackend {
    /// Uploads `weights` to device `opts.ordinal` and compiles the kernels.
    /// Call after [`super::resolve`] found a device (cudarc panics when the
    /// driver library is missing; `resolve` checks for it).
    pub fn new(config: Config, weights: &Weights, opts: CudaOptions) -> Result<Self, ModelError> {
        if config.head_dim > kernels::MAX_HEAD_DIM {
            return Err(ModelError::Backend(format!(
                "cuda: head_dim {} exceeds the attention kernel's limit of {}",
                config.head_dim,
                kernels::MAX_HEAD_DIM
            )));
        }
        if !config.n_head.is_multiple_of(config.n_head_kv) {
            return Err(ModelError::Backend(format!(
                "cuda: n_head {} is not a multiple of n_head_kv {}",
                config.n_head, config.n_head_kv
            )));
        }
        let ctx = CudaContext::new(opts.ordinal).map_err(|e| err("creating the context", e))?;
        // SAFETY: every buffer is used by one stream at a time (weights are
        // uploaded and synchronised before any sequence reads them; each
        // sequence's buffers are used only on its own stream), which is what
        // cudarc's event tracking would otherwise enforce at a cost per launch
        // and at the price of breaking graph capture.
        unsafe { ctx.disable_event_tracking() };
        let kernels = Kernels::load(&ctx).map_err(ModelError::Backend)?;
        let stream = ctx.default_stream();
        let layers = weights
            .layers
            .iter()
            .enumerate()
            .map(|(l, lw)| {
                let n = |s: &str| format!("blk.{l}.{s}");
                Ok(DevLayer {
                    attn_norm: upload_f32(&stream, &lw.attn_norm, &n("attn_norm"))?,
                    wqkv: upload_fused(&stream, &lw.wqkv, &n("attn_qkv"))?,
                    bqkv: lw
                        .bqkv
                        .as_ref()
                        .map(|b| upload_f32(&stream, b, &n("attn_qkv.bias")))
                        .transpose()?,
                    wo: upload_matrix(&stream, &lw.wo, &n("attn_output"))?,
                    ffn_norm: upload_f32(&stream, &lw.ffn_norm, &n("ffn_norm"))?,
                    wgu: upload_fused(&stream, &lw.wgu, &n("ffn_gate_up"))?,
                    w_down: upload_matrix(&stream, &lw.w_down, &n("ffn_down"))?,
                })
            })
            .collect::<Result<Vec<_>, ModelError>>()?;
        let dw = DevWeights {
            tok_embd: upload_matrix(&stream, &weights.tok_embd, "token_embd")?,
            layers,
            output_norm: upload_f32(&stream, &weights.output_norm, "output_norm")?,
            output: weights
                .output
                .as_ref()
                .map(|m| upload_matrix(&stream, m, "output"))
                .transpose()?,
        };
        let rope_positions = config.n_ctx_train.max(1);
        let rope = upload_f32(&stream, &rope_table(&config, rope_positions), "rope table")?;
        stream
            .synchronize()
            .map_err(|e| err("waiting for the weight upload", e))?;
        let (major, minor) = ctx
            .compute_capability()
            .map_err(|e| err("compute capability", e))?;
        let dev_name = ctx.name().unwrap_or_else(|_| "unknown".into());
        Ok(CudaBackend {
            name: format!("cuda:{} ({dev_name}, sm_{major}{minor})", opts.ordinal),
            config,
            ctx,
            kernels,
            weights: dw,
            rope,
            rope_positions,
            opts,
            lanes: match crate::ggml::flavor() {
                crate::ggml::Flavor::Avx512 => 16,
                crate::ggml::Flavor::Avx2 => 8,
            },
        })
    }

    fn new_scratch(&self, stream: &Arc<CudaStream>, n: usize) -> Result<Scratch, ModelError> {
        let c = &self.config;
        let d = c.n_embd;
        let qkv = d + 2 * c.n_head_kv * c.head_dim;
        let widest = d.max(c.n_ff);
        Ok(Scratch {
            n_tok: n,
            tokens: alloc(stream, n, "token ids")?,
            x: alloc(stream, n * d, "x")?,
            xq: alloc(stream, n * widest / QK * size_of::<BlockQ8_1>(), "xq")?,
            qkv: alloc(stream, n * qkv, "qkv")?,
            attn: alloc(stream, n * d, "attn")?,
            proj: alloc(stream, n * d, "proj")?,
            gu: alloc(stream, n * 2 * c.n_ff, "gate/up")?,
        })
    }

    fn new_cuda_state(&self, capacity: usize) -> Result<CudaState, ModelError> {
        let c = &self.config;
        let stream = self
            .ctx
            .new_stream()
            .map_err(|e| err("creating a stream", e))?;
        let cache = c.n_layer * c.n_head_kv * capacity * c.head_dim;
        let st = CudaState {
            capacity,
            pos: 0,
            k: alloc(&stream, cache, "K cache")?,
            v: alloc(&stream, cache, "V cache")?,
            pos_dev: alloc(&stream, 1, "position")?,
            scores: alloc(&stream, c.n_head * capacity, "attention scores")?,
            logits: alloc(&stream, c.n_vocab, "logits")?,
            scratch: self.new_scratch(&stream, 1)?,
            sample: SampleBuffers {
                work: alloc(&stream, c.n_vocab, "sampling logits")?,
                status: alloc(&stream, 1, "sampling status")?,
                out: alloc(&stream, 2 + 2 * kernels::TOPK_MAX, "candidates")?,
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

    /// Checks the input like the CPU backend does (same errors).
    fn check_input(&self, st: &CudaState, tokens: &[u32]) -> Result<(), ModelError> {
        let c = &self.config;
        let n = tokens.len();
        if n == 0 {
            return Err(ModelError::EmptyInput);
        }
        if st.pos + n > st.capacity {
            return Err(ModelError::ContextFull {
                position: st.pos,
                n_tokens: n,
                capacity: st.capacity,
            });
        }
        if st.pos + n > self.rope_positions {
            return Err(ModelError::Backend(format!(
                "cuda: position {} is beyond the model's training context {}",
                st.pos + n,
                self.rope_positions
            )));
        }
        if let Some(&t) = tokens.iter().find(|&&t| t as usize >= c.n_vocab) {
            return Err(ModelError::TokenOutOfRange {
                id: t,
                n_vocab: c.n_vocab,
            });
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
    /// `crate::forward::trace_layers`. The logits land as usual.
    pub fn forward_trace(
        &self,
        st: &mut CudaState,
        tokens: &[u32],
    ) -> Result<Vec<Vec<f32>>, ModelError> {
        self.check_input(st, tokens)?;
        let n = tokens.len();
        let nd = n * self.config.n_embd;
        self.stage_input(st, tokens)?;
        self.enqueue_embed(st, n)?;
        let mut layers = Vec::with_capacity(self.weights.layers.len());
        for l in 0..self.weights.layers.len() {
            self.enqueue_layer(st, n, l)?;
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

    #[allow(clippy::too_many_arguments)]
    fn mm(
        &self,
        st: &CudaState,
        m: &DevMatrix,
        x: u64,
        out: u64,
        n: usize,
        stride: usize,
        off: usize,
    ) -> Result<(), ModelError> {
        let s = &st.stream;
        let k = &self.kernels;
        let (f, grid, threads) = match (self.opts.mm, m.q4_1) {
            (MmKernel::Warp, q4_1) => (
                if q4_1 { &k.mmw_q4_1 } else { &k.mmw_q8_0 },
                (m.rows as u32).div_ceil(kernels::MMW_ROWS_PER_BLOCK),
                kernels::MMW_ROWS_PER_BLOCK * 32,
            ),
            (MmKernel::Lanes, q4_1) => (
                if q4_1 { &k.mm_q4_1 } else { &k.mm_q8_0 },
                (m.rows as u32).div_ceil(kernels::MM_ROWS_PER_BLOCK),
                kernels::MM_THREADS,
            ),
        };
        // SAFETY: mm*_*(w, x, out, rows, nb, n_tok, out_stride, out_off):
        // `w` holds rows × cols/32 blocks, `x` n × cols/32 Q8_1 blocks
        // (scratch sized for n tokens of the widest activation) and `out`
        // n × stride floats with off + rows <= stride.
        unsafe {
            kernels::launch(
                s,
                f,
                cfg((grid, 1), threads, 0),
                &[
                    Arg::Ptr(dptr(&m.data, s)),
                    Arg::Ptr(x),
                    Arg::Ptr(out),
                    Arg::I32(m.rows as i32),
                    Arg::I32((m.cols / QK) as i32),
                    Arg::I32(n as i32),
                    Arg::I32(stride as i32),
                    Arg::I32(off as i32),
                ],
            )
        }
        .map_err(ModelError::Backend)
    }

    fn fused(
        &self,
        st: &CudaState,
        f: &DevFused,
        x: u64,
        out: u64,
        n: usize,
        stride: usize,
    ) -> Result<(), ModelError> {
        match f {
            DevFused::One(m) => self.mm(st, m, x, out, n, stride, 0),
            DevFused::Many(parts) => {
                let mut off = 0;
                for m in parts {
                    self.mm(st, m, x, out, n, stride, off)?;
                    off += m.rows;
                }
                Ok(())
            }
        }
    }

    /// `x += add` (when `add` is not null), then RMSNorm with `w`, quantised
    /// into the xq scratch; `rows` rows of n_embd from `x`.
    fn add_norm_quant(
        &self,
        st: &CudaState,
        x: u64,
        add: u64,
        w: &CudaSlice<f32>,
        rows: usize,
    ) -> Result<(), ModelError> {
        let s = &st.stream;
        // SAFETY: add_norm_quant(x, add, w, out, d, eps): x (and add, unless
        // null) hold rows × d floats, w d floats, the xq scratch n_tok × widest
        // / 32 >= rows × d / 32 blocks; one NORM_THREADS block per row.
        unsafe {
            kernels::launch(
                s,
                &self.kernels.add_norm_quant,
                cfg((rows as u32, 1), kernels::NORM_THREADS, 0),
                &[
                    Arg::Ptr(x),
                    Arg::Ptr(add),
                    Arg::Ptr(dptr(w, s)),
                    Arg::Ptr(dptr(&st.scratch.xq, s)),
                    Arg::I32(self.config.n_embd as i32),
                    Arg::F32(self.config.rms_eps),
                ],
            )
        }
        .map_err(ModelError::Backend)
    }

    fn quantize(&self, st: &CudaState, x: u64, n_values: usize) -> Result<(), ModelError> {
        let s = &st.stream;
        let blocks = n_values / QK;
        let warps_per_block = kernels::ELEMENTWISE_THREADS / 32;
        // SAFETY: quantize_q8_1(x, out, n_blocks): x holds n_values floats,
        // the xq scratch n_tok × widest/32 blocks >= n_values/32.
        unsafe {
            kernels::launch(
                s,
                &self.kernels.quantize_q8_1,
                cfg(
                    ((blocks as u32).div_ceil(warps_per_block), 1),
                    kernels::ELEMENTWISE_THREADS,
                    0,
                ),
                &[
                    Arg::Ptr(x),
                    Arg::Ptr(dptr(&st.scratch.xq, s)),
                    Arg::I32(blocks as i32),
                ],
            )
        }
        .map_err(ModelError::Backend)
    }

    /// Enqueues the forward pass of `n` tokens (already uploaded, position
    /// in `pos_dev`) on the state's stream; the last token's logits land in
    /// `st.logits`. Nine launches per layer (ten for one-token steps, whose
    /// attention scores have their own kernel): add + norm + quantise,
    /// q/k/v, RoPE + cache store, attention + quantise, output product,
    /// add + norm + quantise, gate/up, SiLU·up + quantise, down.
    fn enqueue_forward(&self, st: &CudaState, n: usize) -> Result<(), ModelError> {
        self.enqueue_embed(st, n)?;
        for l in 0..self.weights.layers.len() {
            self.enqueue_layer(st, n, l)?;
        }
        self.enqueue_output(st, n)
    }

    fn enqueue_embed(&self, st: &CudaState, n: usize) -> Result<(), ModelError> {
        let s = &st.stream;
        let w = &self.weights;
        let embed = if w.tok_embd.q4_1 {
            &self.kernels.embed_q4_1
        } else {
            &self.kernels.embed_q8_0
        };
        // SAFETY: embed(w, tok, cols, out): n token ids (checked < n_vocab)
        // index rows of the n_vocab × d embedding; out holds n × d floats.
        unsafe {
            kernels::launch(
                s,
                embed,
                cfg((n as u32, 1), kernels::ELEMENTWISE_THREADS, 0),
                &[
                    Arg::Ptr(dptr(&w.tok_embd.data, s)),
                    Arg::Ptr(dptr(&st.scratch.tokens, s)),
                    Arg::I32(self.config.n_embd as i32),
                    Arg::Ptr(dptr(&st.scratch.x, s)),
                ],
            )
        }
        .map_err(ModelError::Backend)
    }

    /// Layer `l`; starts by adding the previous layer's down product.
    fn enqueue_layer(&self, st: &CudaState, n: usize, l: usize) -> Result<(), ModelError> {
        let c = &self.config;
        let s = &st.stream;
        let lw = &self.weights.layers[l];
        let (d, hd) = (c.n_embd, c.head_dim);
        let qkv_rows = d + 2 * c.n_head_kv * hd;
        let sc = &st.scratch;
        let (x, xq) = (dptr(&sc.x, s), dptr(&sc.xq, s));
        let (qkv, attn, proj, gu) = (
            dptr(&sc.qkv, s),
            dptr(&sc.attn, s),
            dptr(&sc.proj, s),
            dptr(&sc.gu, s),
        );
        let (kc, vc, pos) = (dptr(&st.k, s), dptr(&st.v, s), dptr(&st.pos_dev, s));
        let scale = 1.0 / (hd as f32).sqrt();
        self.add_norm_quant(st, x, if l == 0 { 0 } else { proj }, &lw.attn_norm, n)?;
        self.fused(st, &lw.wqkv, xq, qkv, n, qkv_rows)?;
        let bias = lw.bqkv.as_ref().map_or(0, |b| dptr(b, s));
        // SAFETY: qkv_rope_store(qkv, bias, rope, pos, n_head, n_kv, hd,
        // n_pairs, neox, k, v, layer, cap): qkv holds n rows of qkv_rows,
        // bias qkv_rows floats or null, the rope table covers positions
        // < rope_positions (checked), the cache n_layer × n_kv × cap × hd
        // halves with pos + n <= cap (checked); hd <= MAX_HD (checked).
        unsafe {
            kernels::launch(
                s,
                &self.kernels.qkv_rope_store,
                cfg((n as u32, (c.n_head + c.n_head_kv) as u32), 64, 0),
                &[
                    Arg::Ptr(qkv),
                    Arg::Ptr(bias),
                    Arg::Ptr(dptr(&self.rope, s)),
                    Arg::Ptr(pos),
                    Arg::I32(c.n_head as i32),
                    Arg::I32(c.n_head_kv as i32),
                    Arg::I32(hd as i32),
                    Arg::I32((c.rope_dim / 2) as i32),
                    Arg::I32(c.rope_neox as i32),
                    Arg::Ptr(kc),
                    Arg::Ptr(vc),
                    Arg::I32(l as i32),
                    Arg::I32(st.capacity as i32),
                ],
            )
        }
        .map_err(ModelError::Backend)?;
        // hd % 32 == 0: each head's output is whole Q8_1 blocks, quantised
        // by the attention kernel itself.
        let fused_quant = hd.is_multiple_of(QK);
        let split = n == 1 && self.opts.split_scores;
        if split {
            let blocks = (st.capacity as u32)
                .div_ceil(kernels::SCORE_THREADS)
                .min(kernels::SCORE_MAX_BLOCKS);
            // SAFETY: attn_scores(qkv, k, scores, pos, layer, cap, n_head,
            // n_kv, hd, scale, w): one token's qkv row, the cache as above,
            // scores n_head × cap floats (allocated with the state), written
            // for positions <= pos < cap; hd <= MAX_HD.
            unsafe {
                kernels::launch(
                    s,
                    &self.kernels.attn_scores,
                    cfg((blocks, c.n_head as u32), kernels::SCORE_THREADS, 0),
                    &[
                        Arg::Ptr(qkv),
                        Arg::Ptr(kc),
                        Arg::Ptr(dptr(&st.scores, s)),
                        Arg::Ptr(pos),
                        Arg::I32(l as i32),
                        Arg::I32(st.capacity as i32),
                        Arg::I32(c.n_head as i32),
                        Arg::I32(c.n_head_kv as i32),
                        Arg::I32(hd as i32),
                        Arg::F32(scale),
                        Arg::I32(self.lanes),
                    ],
                )
            }
            .map_err(ModelError::Backend)?;
        }
        // SAFETY: attention(qkv, k, v, scores, out, outq, pos, layer, cap,
        // n_head, n_kv, hd, scale, w, decode): as above; scores null or
        // attn_scores' output (n == 1); out holds n × d floats, outq (the
        // xq scratch, or null) n × d / 32 blocks; hd <= MAX_HD (checked at
        // load), w is 8 or 16.
        unsafe {
            kernels::launch(
                s,
                &self.kernels.attention,
                cfg((n as u32, c.n_head as u32), kernels::ATT_THREADS, 0),
                &[
                    Arg::Ptr(qkv),
                    Arg::Ptr(kc),
                    Arg::Ptr(vc),
                    Arg::Ptr(if split { dptr(&st.scores, s) } else { 0 }),
                    Arg::Ptr(attn),
                    Arg::Ptr(if fused_quant { xq } else { 0 }),
                    Arg::Ptr(pos),
                    Arg::I32(l as i32),
                    Arg::I32(st.capacity as i32),
                    Arg::I32(c.n_head as i32),
                    Arg::I32(c.n_head_kv as i32),
                    Arg::I32(hd as i32),
                    Arg::F32(scale),
                    Arg::I32(self.lanes),
                    // The CPU's one-token steps sum in ggml_vec_dot_f16's
                    // order, longer ones in tinyBLAS's.
                    Arg::I32((n == 1) as i32),
                ],
            )
        }
        .map_err(ModelError::Backend)?;
        if !fused_quant {
            self.quantize(st, attn, n * d)?;
        }
        self.mm(st, &lw.wo, xq, proj, n, d, 0)?;
        self.add_norm_quant(st, x, proj, &lw.ffn_norm, n)?;
        self.fused(st, &lw.wgu, xq, gu, n, 2 * c.n_ff)?;
        let warps = (n * c.n_ff / QK) as u32;
        // SAFETY: swiglu_quant(gu, out, n, n_ff, w): gu holds n × 2·n_ff
        // floats, the xq scratch n × n_ff / 32 blocks; n_ff % 32 == 0
        // (the down matrix's columns).
        unsafe {
            kernels::launch(
                s,
                &self.kernels.swiglu_quant,
                cfg(
                    (warps.div_ceil(kernels::ELEMENTWISE_THREADS / 32), 1),
                    kernels::ELEMENTWISE_THREADS,
                    0,
                ),
                &[
                    Arg::Ptr(gu),
                    Arg::Ptr(xq),
                    Arg::I32(n as i32),
                    Arg::I32(c.n_ff as i32),
                    Arg::I32(self.lanes),
                ],
            )
        }
        .map_err(ModelError::Backend)?;
        self.mm(st, &lw.w_down, xq, proj, n, d, 0)
    }

    /// The last layer's residual add, the final norm and the output product,
    /// for the last token only.
    fn enqueue_output(&self, st: &CudaState, n: usize) -> Result<(), ModelError> {
        let s = &st.stream;
        let d = self.config.n_embd;
        let w = &self.weights;
        let last = ((n - 1) * d * size_of::<f32>()) as u64;
        let (x, proj) = (dptr(&st.scratch.x, s), dptr(&st.scratch.proj, s));
        let add = if w.layers.is_empty() { 0 } else { proj + last };
        self.add_norm_quant(st, x + last, add, &w.output_norm, 1)?;
        let out = w.output();
        let xq = dptr(&st.scratch.xq, s);
        self.mm(st, out, xq, dptr(&st.logits, s), 1, out.rows, 0)
    }

    /// Runs the device sampling prefix `ops` (ending with [`DeviceOp::TopK`])
    /// over a working copy of the state's logits and copies only the
    /// survivors — `(id, logit)`, sorted descending, ties by lower id — into
    /// `out`. The raw logits stay untouched on the device.
    pub fn sample_prefix(
        &self,
        st: &mut CudaState,
        ops: &[DeviceOp<'_>],
        out: &mut Vec<(u32, f32)>,
    ) -> Result<DeviceStatus, ModelError> {
        let Some(DeviceOp::TopK(k)) = ops.last() else {
            return Err(ModelError::Backend(
                "cuda: a device sampling prefix must end with top_k".into(),
            ));
        };
        let k = *k;
        if !(1..=kernels::TOPK_MAX).contains(&k) {
            return Err(ModelError::Backend(format!(
                "cuda: device top_k needs 1 <= k <= {}, got {k}",
                kernels::TOPK_MAX
            )));
        }
        let t0 = Instant::now();
        let n = st.logits.len();
        let stream = Arc::clone(&st.stream);
        let s = &stream;
        let sb = &mut st.sample;
        s.memcpy_dtod(&st.logits, &mut sb.work)
            .map_err(|e| err("copying the logits for sampling", e))?;
        let work = dptr(&sb.work, s);
        let status = dptr(&sb.status, s);
        let single = |threads| cfg((1, 1), threads, 0);
        // SAFETY: check_logits(x, n, status): work holds n floats.
        unsafe {
            kernels::launch(
                s,
                &self.kernels.check_logits,
                single(kernels::TOPK_THREADS),
                &[Arg::Ptr(work), Arg::I32(n as i32), Arg::Ptr(status)],
            )
        }
        .map_err(ModelError::Backend)?;
        for op in &ops[..ops.len() - 1] {
            match *op {
                DeviceOp::LogitBias { ids, bias, starts } => {
                    let runs = starts.len().saturating_sub(1);
                    if runs == 0 {
                        continue;
                    }
                    if ids.len() != bias.len() || starts[runs] as usize != ids.len() {
                        return Err(ModelError::Backend(format!(
                            "cuda: logit_bias op has {} ids, {} biases and runs ending at {}",
                            ids.len(),
                            bias.len(),
                            starts[runs]
                        )));
                    }
                    upload_into(s, &mut sb.ids, ids, "bias ids")?;
                    let bits: Vec<u32> = bias.iter().map(|b| b.to_bits()).collect();
                    upload_into(s, &mut sb.vals, &bits, "bias values")?;
                    upload_into(s, &mut sb.starts, starts, "bias runs")?;
                    // SAFETY: logit_bias(x, n, ids, bias, starts, n_runs):
                    // ids/bias hold starts[n_runs] entries (checked above),
                    // starts n_runs + 1; ids >= n are skipped by the kernel.
                    unsafe {
                        kernels::launch(
                            s,
                            &self.kernels.logit_bias,
                            cfg(
                                ((runs as u32).div_ceil(kernels::ELEMENTWISE_THREADS), 1),
                                kernels::ELEMENTWISE_THREADS,
                                0,
                            ),
                            &[
                                Arg::Ptr(work),
                                Arg::I32(n as i32),
                                Arg::Ptr(dptr(&sb.ids, s)),
                                Arg::Ptr(dptr(&sb.vals, s)),
                                Arg::Ptr(dptr(&sb.starts, s)),
                                Arg::I32(runs as i32),
                            ],
                        )
                    }
                    .map_err(ModelError::Backend)?;
                }
                DeviceOp::Penalties {
                    ids,
                    counts,
                    repeat,
                    frequency,
                    presence,
                } => {
                    if ids.is_empty() {
                        continue;
                    }
                    if ids.len() != counts.len() {
                        return Err(ModelError::Backend(format!(
                            "cuda: penalties op has {} ids and {} counts",
                            ids.len(),
                            counts.len()
                        )));
                    }
                    upload_into(s, &mut sb.ids, ids, "penalty ids")?;
                    upload_into(s, &mut sb.vals, counts, "penalty counts")?;
                    // SAFETY: penalties(x, n, ids, counts, n_ids, repeat,
                    // frequency, presence): ids/counts hold n_ids entries
                    // (distinct ids, so no two threads write one logit).
                    unsafe {
                        kernels::launch(
                            s,
                            &self.kernels.penalties,
                            cfg(
                                ((ids.len() as u32).div_ceil(kernels::ELEMENTWISE_THREADS), 1),
                                kernels::ELEMENTWISE_THREADS,
                                0,
                            ),
                            &[
                                Arg::Ptr(work),
                                Arg::I32(n as i32),
                                Arg::Ptr(dptr(&sb.ids, s)),
                                Arg::Ptr(dptr(&sb.vals, s)),
                                Arg::I32(ids.len() as i32),
                                Arg::F32(repeat),
                                Arg::F32(frequency),
                                Arg::F32(presence),
                            ],
                        )
                    }
                    .map_err(ModelError::Backend)?;
                }
                DeviceOp::Temperature(t) => {
                    // SAFETY: scale_temperature(x, n, t): work holds n floats.
                    unsafe {
                        kernels::launch(
                            s,
                            &self.kernels.scale_temperature,
                            cfg(
                                ((n as u32).div_ceil(kernels::ELEMENTWISE_THREADS), 1),
                                kernels::ELEMENTWISE_THREADS,
                                0,
                            ),
                            &[Arg::Ptr(work), Arg::I32(n as i32), Arg::F32(t)],
                        )
                    }
                    .map_err(ModelError::Backend)?;
                }
                DeviceOp::TopK(_) => {
                    return Err(ModelError::Backend(
                        "cuda: top_k must be the last op of a device sampling prefix".into(),
                    ));
                }
            }
        }
        // SAFETY: top_k(x, n, k, status, out): work holds n floats, out
        // 2 + 2·TOPK_MAX words, 1 <= k <= TOPK_MAX (checked above).
        unsafe {
            kernels::launch(
                s,
                &self.kernels.top_k,
                single(kernels::TOPK_THREADS),
                &[
                    Arg::Ptr(work),
                    Arg::I32(n as i32),
                    Arg::I32(k as i32),
                    Arg::Ptr(status),
                    Arg::Ptr(dptr(&sb.out, s)),
                ],
            )
        }
        .map_err(ModelError::Backend)?;
        let t1 = Instant::now();
        let words = 2 + 2 * k.min(n);
        let view = sb.out.slice(0..words);
        s.memcpy_dtoh(&view, &mut sb.host_out[..words])
            .map_err(|e| err("copying the candidates", e))?;
        s.synchronize().map_err(|e| err("device sampling", e))?;
        st.d2h_bytes += (words * size_of::<u32>()) as u64;
        let h = &sb.host_out;
        let status = match h[0] {
            0 => DeviceStatus::Ok,
            1 => DeviceStatus::BadLogit,
            _ => DeviceStatus::NoFinite,
        };
        out.clear();
        if status == DeviceStatus::Ok {
            let count = (h[1] as usize).min(k);
            out.extend((0..count).map(|i| (h[2 + 2 * i], f32::from_bits(h[3 + 2 * i]))));
        }
        let t2 = Instant::now();
        st.timing.sampling_ns += (t1 - t0).as_nanos() as u64;
        st.timing.copy_ns += (t2 - t1).as_nanos() as u64;
        Ok(status)
    }

    /// Replaces the state's device logits with `logits` (any length: the
    /// device sampling tests use other vocabularies than the model's). A
    /// later forward pass writes the model's `n_vocab` logits at the front.
    pub fn set_logits(&self, st: &mut CudaState, logits: &[f32]) -> Result<(), ModelError> {
        let n = logits.len().max(self.config.n_vocab);
        if st.logits.len() != n {
            st.logits = alloc(&st.stream, n, "logits")?;
            st.sample.work = alloc(&st.stream, n, "sampling logits")?;
            // The decode graph wrote into the old buffer.
            st.graph = None;
        }
        let mut view = st.logits.slice_mut(0..logits.len());
        st.stream
            .memcpy_htod(logits, &mut view)
            .map_err(|e| err("uploading logits", e))?;
        if logits.len() < n {
            // Entries past `logits` would be sampled too: mask them.
            let pad = vec![f32::NEG_INFINITY; n - logits.len()];
            let mut rest = st.logits.slice_mut(logits.len()..n);
            st.stream
                .memcpy_htod(&pad[..], &mut rest)
                .map_err(|e| err("uploading logits", e))?;
        }
        Ok(())
    }

    /// Waits until the state's queued work is done (benchmarks use it to
    /// time the forward pass apart from sampling).
    pub fn synchronize(&self, st: &CudaState) -> Result<(), ModelError> {
        st.stream.synchronize().map_err(|e| err("synchronising", e))
    }

    /// The configuration the backend was built for.
    pub fn config(&self) -> &Config {
        &self.config
    }

    /// A fresh sequence with its concrete type (tests and the benchmark).
    pub fn new_sequence(&self, capacity: usize) -> Result<CudaState, ModelError> {
        self.new_cuda_state(capacity.max(1))
    }
}

/// Copies `src` into the front of `dst`, growing it (doubling) when short.
fn upload_into<T: DeviceRepr + ValidAsZeroBits + Copy>(
    s: &Arc<CudaStream>,
    dst: &mut CudaSlice<T>,
    src: &[T],
    what: &str,
) -> Result<(), ModelError> {
    if dst.len() < src.len() {
        *dst = alloc(s, src.len().next_power_of_two(), what)?;
    }
    let mut view = dst.slice_mut(0..src.len());
    s.memcpy_htod(src, &mut view)
        .map_err(|e| err(&format!("uploading {what}"), e))
}

fn downcast(state: &mut dyn SequenceState) -> Result<&mut CudaState, ModelError> {
    state
        .as_any_mut()
        .downcast_mut::<CudaState>()
        .ok_or_else(|| {
            ModelError::Backend("sequence state was not created by the CUDA backend".into())
        })
}

impl Backend for CudaBackend {
    fn name(&self) -> String {
        self.name.clone()
    }

    fn new_state(&self, capacity: usize) -> Box<dyn SequenceState> {
        // The trait cannot fail here; an allocation failure (device memory
        // exhausted) surfaces as an error on the first forward call instead.
        match self.new_cuda_state(capacity.max(1)) {
            Ok(st) => Box::new(st),
            Err(e) => Box::new(FailedState {
                capacity,
                error: e.to_string(),
            }),
        }
    }

    fn forward(
        &self,
        state: &mut dyn SequenceState,
        tokens: &[u32],
        logits: &mut [f32],
    ) -> Result<(), ModelError> {
        if let Some(f) = state.as_any_mut().downcast_mut::<FailedState>() {
            return Err(ModelError::Backend(f.error.clone()));
        }
        let st = downcast(state)?;
        if logits.len() != self.config.n_vocab {
            return Err(ModelError::Backend(format!(
                "logits buffer has {} entries, vocabulary {}",
                logits.len(),
                self.config.n_vocab
            )));
        }
        self.forward_device(st, tokens)?;
        self.copy_logits(st, logits)
    }

    /// Enqueues every sequence's step on its own stream first, then copies
    /// the logits back, so the sequences' kernels overlap on the device.
    fn forward_batch(
        &self,
        states: &mut [&mut dyn SequenceState],
        tokens: &[u32],
        logits: &mut [&mut [f32]],
    ) -> Result<(), ModelError> {
        crate::backend::check_batch_shape(states.len(), tokens.len(), logits.len())?;
        for (st, &tok) in states.iter_mut().zip(tokens) {
            if st.as_any_mut().is::<FailedState>() {
                return self.forward(&mut **st, &[tok], &mut []);
            }
            let st = downcast(&mut **st)?;
            self.check_input(st, &[tok])?;
        }
        if let Some(l) = logits.iter().find(|l| l.len() != self.config.n_vocab) {
            return Err(ModelError::Backend(format!(
                "logits buffer has {} entries, vocabulary {}",
                l.len(),
                self.config.n_vocab
            )));
        }
        for (st, &tok) in states.iter_mut().zip(tokens) {
            self.forward_device(downcast(&mut **st)?, &[tok])?;
        }
        for (st, l) in states.iter_mut().zip(logits.iter_mut()) {
            self.copy_logits(downcast(&mut **st)?, l)?;
        }
        Ok(())
    }
}

/// A sequence whose device allocation failed; every forward call reports it.
struct FailedState {
    capacity: usize,
    error: String,
}

impl SequenceState for FailedState {
    fn position(&self) -> usize {
        0
    }
    fn capacity(&self) -> usize {
        self.capacity
    }
    fn truncate(&mut self, _position: usize) {}
    fn as_any_mut(&mut self) -> &mut dyn Any {
        self
    }
}
