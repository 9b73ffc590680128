//! [`CudaBackend`]: its options, the kernels and weights it holds on a device, its construction.
//!
//! Weights are uploaded once in the CPU loader's block formats (every one
//! it keeps: Q8_0, Q4_1, Q5_0, Q5_1, Q4_K, Q5_K, Q6_K, F16, BF16); one CUDA
//! stream, KV cache and scratch per sequence; the forward pass as a fixed
//! sequence of NVRTC-compiled kernels (the `.cu` files of `kernels/`), the
//! decode step (one token) captured into a CUDA graph on first use and
//! replayed afterwards; and the device sampling prefix (`sampling`) that
//! leaves at most k candidates to copy to the host.
//!
//! Position and token live in device memory and the kernels read them there,
//! so one captured graph serves every decode step of its sequence; the graph
//! is dropped whenever the scratch it points into is reallocated.
//!
//! The parts, one file each: `upload` (the weights on the device), `state`
//! (one sequence's device memory), `forward` (running a pass on a sequence,
//! and the `Backend` implementation), `batch` (one decode step of several
//! sequences in one pass), `launch` (the kernels of a pass),
//! `sampling` (the device sampling prefix); this file holds the options and
//! construction.

use std::sync::{Arc, Mutex};

use cudarc::driver::{CudaContext, CudaSlice, CudaStream};

use super::batch_scratch::Batcher;
use super::err::err;
use super::kernels::{self, Kernels};
use super::options::CudaOptions;
use super::state::{CudaState, Scratch};
use super::supported::unsupported;
use super::upload::{DevWeights, rope_table, upload_f32, upload_weights};
use crate::error::ModelError;
use crate::ggml::Flavor;
use crate::gguf::{Config, Weights};

/// The CUDA backend.
pub struct CudaBackend {
    pub(super) config: Config,
    pub(super) ctx: Arc<CudaContext>,
    pub(super) kernels: Kernels,
    pub(super) weights: DevWeights,
    pub(super) rope: CudaSlice<f32>,
    pub(super) rope_positions: usize,
    pub(super) opts: CudaOptions,
    /// Vector width (8 or 16) of the ggml build the CPU backend mirrors
    /// (`ggml::flavor`): attention, SiLU and the F16/BF16 products
    /// follow its lane order.
    pub(super) lanes: i32,
    /// BF16 products in the `vdpbf16ps` pair order: the CPU backend's
    /// choice for the AVX-512 flavour on a CPU with AVX-512 BF16
    /// (`ggml::half::dot_half_row`), so the device follows the host it
    /// runs on there; never for `portable`.
    pub(super) bf16_pairs: bool,
    pub(super) name: String,
    /// The batched decode step's stream and scratch (`batch`), one pass
    /// at a time.
    pub(super) batch: Mutex<Batcher>,
}

impl std::fmt::Debug for CudaBackend {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CudaBackend")
            .field("name", &self.name)
            .finish()
    }
}

impl CudaBackend {
    /// Uploads `weights` to device `opts.ordinal` and compiles the kernels.
    /// Call after `cuda::resolve` found a device (cudarc panics when the
    /// driver library is missing; `resolve` checks for it).
    pub fn new(config: Config, weights: &Weights, opts: CudaOptions) -> Result<Self, ModelError> {
        if config.head_dim > kernels::MAX_HEAD_DIM {
            return Err(ModelError::Backend(format!(
                "cuda: head_dim {} exceeds the attention kernel's limit of {}",
                config.head_dim,
                kernels::MAX_HEAD_DIM
            )));
        }
        if !(1..=65_535).contains(&opts.max_batch_rows) {
            return Err(ModelError::Backend(format!(
                "cuda: max_batch_rows {} is outside 1..=65535",
                opts.max_batch_rows
            )));
        }
        if let Some(why) = unsupported(&config) {
            return Err(ModelError::Backend(why));
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
        let dw = upload_weights(&stream, weights)?;
        let rope_positions = config.n_ctx_train.max(1);
        let rope = upload_f32(
            &stream,
            &rope_table(&config, weights.rope_freqs.as_deref(), rope_positions),
            "rope table",
        )?;
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
            lanes: opts.flavor.lanes() as i32,
            bf16_pairs: opts.flavor == Flavor::Avx512 && crate::ggml::flavor::has_avx512_bf16(),
            batch: Mutex::default(),
        })
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

    /// A sequence with room for `capacity` tokens and scratch for one.
    pub(super) fn new_cuda_state(&self, capacity: usize) -> Result<CudaState, ModelError> {
        CudaState::new(&self.ctx, &self.config, self.weights.needs_q8k(), capacity)
    }

    /// Scratch for a step of `n` tokens on `stream`.
    pub(super) fn new_scratch(
        &self,
        stream: &Arc<CudaStream>,
        n: usize,
    ) -> Result<Scratch, ModelError> {
        Scratch::new(stream, &self.config, self.weights.needs_q8k(), n)
    }
}
