//! The CUDA kernels compiled with NVRTC, loaded as a table of functions, and their launch helper.
//!
//! The `.cu` files beside this one are embedded at build time as one source
//! (`source`), compiled with NVRTC at start-up, once per process and GPU
//! architecture
//! (the PTX is kept in memory, so a second model or a reload does not
//! recompile), and loaded into a context as a table of functions. Also the
//! launch helper that turns a list of plain arguments into a kernel launch.

use std::collections::HashMap;
use std::sync::{Arc, Mutex, OnceLock};

use cudarc::driver::{CudaContext, CudaFunction, CudaStream, LaunchConfig};
use cudarc::nvrtc::{CompileOptions, Ptx, compile_ptx_with_opts};

use super::format::DevFormat;

/// The CUDA C source of every kernel.
pub const SOURCE: &str = super::source::KERNEL_SOURCE;

/// Threads per block of the `mm_*` weight-product kernels (8 lanes per row).
pub const MM_THREADS: u32 = 128;
/// Rows per block of the `mm_*` weight-product kernels.
pub const MM_ROWS_PER_BLOCK: u32 = MM_THREADS / 8;
/// Rows (one warp each) per block of the `mmw_*` kernels (`MMW_WARPS`).
pub const MMW_ROWS_PER_BLOCK: u32 = 4;
/// Threads of `add_norm_quant` (`NORM_THREADS` in the source; its shared
/// reduction assumes exactly this many).
pub const NORM_THREADS: u32 = 256;
/// Threads per block of `attn_scores` (`SCORE_THREADS` in the source).
pub const SCORE_THREADS: u32 = 128;
/// Most blocks per head of `attn_scores` (it grid-strides beyond).
pub const SCORE_MAX_BLOCKS: u32 = 64;
/// Threads of `attention` (`ATT_THREADS` in the source).
pub const ATT_THREADS: u32 = 256;
/// Largest head dimension `attention` supports (`MAX_HD` in the source:
/// its lane accumulators, 64 × head_dim floats, live in shared memory).
pub const MAX_HEAD_DIM: usize = 128;
/// Threads of the single-block `top_k` and `check_logits` kernels.
pub const TOPK_THREADS: u32 = 1024;
/// Largest k the device `top_k` handles (`TOPK_MAX` in the source).
pub const TOPK_MAX: usize = 1024;
/// Logits per block of the multi-block top-k's first step
/// (`top_k_partial`): 151,936 logits make 38 blocks, spread over the SMs
/// (the single-block kernel leaves all but one idle), and the merge of
/// 38 × k candidates stays small.
pub const TOPK_SLICE: usize = 4096;
/// Logits per block of `lse_blocks` (`LSE_BLOCK` in the source): the
/// host scan's block (`samplerd_numerics::lse::BLOCK`).
pub const LSE_BLOCK: usize = 1024;
/// Threads of `lse_blocks`: the host scan's f32 lanes (`LSE_LANES`).
pub const LSE_LANES: u32 = 16;
const _: () = assert!(
    LSE_BLOCK == samplerd_numerics::lse::BLOCK
        && LSE_LANES as usize == samplerd_numerics::lse::LANES
        && samplerd_numerics::lse::CHUNK == 8 * LSE_BLOCK
);
/// Threads of the element-wise kernels.
pub const ELEMENTWISE_THREADS: u32 = 256;

/// PTX text per `compute_XY` architecture.
type PtxCache = Mutex<HashMap<(i32, i32), Arc<String>>>;

/// PTX per `compute_XY` architecture, compiled once per process.
fn ptx_cache() -> &'static PtxCache {
    static CACHE: OnceLock<PtxCache> = OnceLock::new();
    CACHE.get_or_init(|| Mutex::new(HashMap::new()))
}

/// Compiles [`SOURCE`] for `compute_{major}{minor}` (cached per process).
pub fn ptx_for(arch: (i32, i32)) -> Result<Arc<String>, String> {
    let mut cache = ptx_cache().lock().unwrap_or_else(|e| e.into_inner());
    if let Some(p) = cache.get(&arch) {
        return Ok(Arc::clone(p));
    }
    let opts = CompileOptions {
        // Every fused multiply-add in the source is explicit (CPU parity).
        fmad: Some(false),
        prec_div: Some(true),
        prec_sqrt: Some(true),
        options: vec![format!("--gpu-architecture=compute_{}{}", arch.0, arch.1)],
        name: Some("samplerd_kernels.cu".into()),
        ..Default::default()
    };
    let ptx = compile_ptx_with_opts(SOURCE, opts).map_err(|e| {
        format!(
            "NVRTC could not compile the kernels for compute_{}{}: {e}",
            arch.0, arch.1
        )
    })?;
    let text = Arc::new(ptx.to_src());
    cache.insert(arch, Arc::clone(&text));
    Ok(text)
}

/// One weight format's kernels: the embedding lookup and the weight
/// product in its two layouts (same bits).
#[derive(Debug)]
pub struct FormatKernels {
    pub embed: CudaFunction,
    /// One warp per row.
    pub mmw: CudaFunction,
    /// Eight threads per row (`SAMPLERD_CUDA_MM=lanes`).
    pub mm: CudaFunction,
}

/// Every kernel of [`SOURCE`], loaded into one context.
#[derive(Debug)]
pub struct Kernels {
    /// Per weight format, in [`DevFormat::ALL`]'s order.
    formats: Vec<FormatKernels>,
    pub add_norm_quant: CudaFunction,
    pub quantize_q8_1: CudaFunction,
    pub quantize_q8_k: CudaFunction,
    pub qkv_rope_store: CudaFunction,
    pub attn_scores: CudaFunction,
    pub attention: CudaFunction,
    pub qkv_rope_store_batch: CudaFunction,
    pub attn_scores_batch: CudaFunction,
    pub attention_batch: CudaFunction,
    pub scatter_logits: CudaFunction,
    pub swiglu_quant: CudaFunction,
    pub check_logits: CudaFunction,
    pub logit_bias: CudaFunction,
    pub penalties: CudaFunction,
    pub scale_temperature: CudaFunction,
    pub top_k: CudaFunction,
    pub top_k_partial: CudaFunction,
    pub top_k_merge: CudaFunction,
    pub survivor_raw: CudaFunction,
    pub lse_blocks: CudaFunction,
}

impl Kernels {
    /// Compiles (or reuses) the PTX for the context's device and loads it.
    pub fn load(ctx: &Arc<CudaContext>) -> Result<Kernels, String> {
        let arch = ctx
            .compute_capability()
            .map_err(|e| format!("reading the compute capability: {e}"))?;
        let ptx = ptx_for(arch)?;
        let module = ctx
            .load_module(Ptx::from_src(ptx.as_str()))
            .map_err(|e| format!("loading the kernels' PTX: {e}"))?;
        let f = |name: &str| {
            module
                .load_function(name)
                .map_err(|e| format!("kernel {name}: {e}"))
        };
        let formats = DevFormat::ALL
            .iter()
            .map(|fmt| {
                let s = fmt.suffix();
                Ok(FormatKernels {
                    embed: f(&format!("embed_{s}"))?,
                    mmw: f(&format!("mmw_{s}"))?,
                    mm: f(&format!("mm_{s}"))?,
                })
            })
            .collect::<Result<_, String>>()?;
        Ok(Kernels {
            formats,
            add_norm_quant: f("add_norm_quant")?,
            quantize_q8_1: f("quantize_q8_1")?,
            quantize_q8_k: f("quantize_q8_k")?,
            qkv_rope_store: f("qkv_rope_store")?,
            attn_scores: f("attn_scores")?,
            attention: f("attention")?,
            qkv_rope_store_batch: f("qkv_rope_store_batch")?,
            attn_scores_batch: f("attn_scores_batch")?,
            attention_batch: f("attention_batch")?,
            scatter_logits: f("scatter_logits")?,
            swiglu_quant: f("swiglu_quant")?,
            check_logits: f("check_logits")?,
            logit_bias: f("logit_bias")?,
            penalties: f("penalties")?,
            scale_temperature: f("scale_temperature")?,
            top_k: f("top_k")?,
            top_k_partial: f("top_k_partial")?,
            top_k_merge: f("top_k_merge")?,
            survivor_raw: f("survivor_raw")?,
            lse_blocks: f("lse_blocks")?,
        })
    }

    /// The kernels of weight format `f`.
    pub(crate) fn format(&self, f: DevFormat) -> &FormatKernels {
        let i = DevFormat::ALL
            .iter()
            .position(|&g| g == f)
            .expect("every format is in ALL");
        &self.formats[i]
    }
}

/// One kernel argument: a device pointer, an `int` or a `float`.
#[derive(Clone, Copy, Debug)]
pub enum Arg {
    Ptr(u64),
    I32(i32),
    F32(f32),
}

/// Grid and block shape (no dynamic shared memory unless `shared` is set).
pub fn cfg(grid: (u32, u32), block: u32, shared: u32) -> LaunchConfig {
    LaunchConfig {
        grid_dim: (grid.0.max(1), grid.1.max(1), 1),
        block_dim: (block, 1, 1),
        shared_mem_bytes: shared,
    }
}

/// An element-wise kernel's shape: one thread per item (`n` items).
pub fn per_item(n: usize) -> LaunchConfig {
    cfg(
        ((n as u32).div_ceil(ELEMENTWISE_THREADS), 1),
        ELEMENTWISE_THREADS,
        0,
    )
}

/// An element-wise kernel's shape with one warp per item (a 32-value block).
pub fn per_warp(n: usize) -> LaunchConfig {
    cfg(
        ((n as u32).div_ceil(ELEMENTWISE_THREADS / 32), 1),
        ELEMENTWISE_THREADS,
        0,
    )
}

/// The kernel parameters packed as the C struct of the kernel's signature
/// (each at its natural alignment, the total rounded up to the largest):
/// the layout `cuLaunchKernel` takes through `CU_LAUNCH_PARAM_BUFFER_POINTER`.
pub fn pack_params(args: &[Arg]) -> Vec<u8> {
    let mut buf = Vec::with_capacity(args.len() * 8);
    let mut align = 1;
    for a in args {
        let (bytes, n): ([u8; 8], usize) = match *a {
            Arg::Ptr(v) => (v.to_ne_bytes(), 8),
            Arg::I32(v) => (u64::from(v as u32).to_ne_bytes(), 4),
            Arg::F32(v) => (u64::from(v.to_bits()).to_ne_bytes(), 4),
        };
        align = align.max(n);
        buf.resize(buf.len().next_multiple_of(n), 0);
        let at = if cfg!(target_endian = "little") {
            0
        } else {
            8 - n
        };
        buf.extend_from_slice(&bytes[at..at + n]);
    }
    buf.resize(buf.len().next_multiple_of(align), 0);
    buf
}

/// Launches `f` on `stream` with `args`.
///
/// The arguments go to the driver as one packed buffer with its size
/// (`extra`, not `kernelParams`), so the driver can refuse a buffer that
/// does not match the kernel's parameter list; the emulated driver
/// (`cuda/emu`) does, naming the kernel and both sizes.
///
/// # Safety
/// `args` must match the kernel's parameter list in number, order and type,
/// and every pointer must be valid for what the kernel reads and writes
/// (each call site documents the sizes).
pub unsafe fn launch(
    stream: &CudaStream,
    f: &CudaFunction,
    config: LaunchConfig,
    args: &[Arg],
) -> Result<(), String> {
    use cudarc::driver::sys;
    use std::ffi::c_void;
    stream
        .context()
        .bind_to_thread()
        .map_err(|e| format!("kernel launch: {e}"))?;
    let mut buf = pack_params(args);
    let mut size = buf.len();
    let mut extra = [
        sys::CU_LAUNCH_PARAM_BUFFER_POINTER_AS_INT as usize as *mut c_void,
        buf.as_mut_ptr().cast::<c_void>(),
        sys::CU_LAUNCH_PARAM_BUFFER_SIZE_AS_INT as usize as *mut c_void,
        (&raw mut size).cast::<c_void>(),
        sys::CU_LAUNCH_PARAM_END_AS_INT as usize as *mut c_void,
    ];
    let (g, b) = (config.grid_dim, config.block_dim);
    // SAFETY: the caller guarantees the argument list matches the kernel and
    // the pointers' extents; `buf`, `size` and `extra` outlive the call (the
    // driver copies the parameters when the launch is enqueued or captured).
    unsafe {
        sys::cuLaunchKernel(
            f.cu_function(),
            g.0,
            g.1,
            g.2,
            b.0,
            b.1,
            b.2,
            config.shared_mem_bytes,
            stream.cu_stream(),
            std::ptr::null_mut(),
            extra.as_mut_ptr(),
        )
    }
    .result()
    .map_err(|e| format!("kernel launch: {e}"))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The parameter buffer is the C struct of the signature: each value at
    /// its natural alignment, the size rounded up to the largest.
    #[test]
    fn parameters_pack_as_a_c_struct() {
        let b = pack_params(&[Arg::Ptr(0x1122), Arg::I32(-2), Arg::F32(1.5), Arg::Ptr(7)]);
        assert_eq!(b.len(), 24);
        assert_eq!(b[..8], 0x1122u64.to_ne_bytes());
        assert_eq!(b[8..12], (-2i32).to_ne_bytes());
        assert_eq!(b[12..16], 1.5f32.to_ne_bytes());
        assert_eq!(b[16..], 7u64.to_ne_bytes());
        // An int before a pointer is padded to the pointer's alignment, and
        // a trailing int to the struct's.
        let b = pack_params(&[Arg::I32(1), Arg::Ptr(2), Arg::I32(3)]);
        assert_eq!(b.len(), 24);
        assert_eq!(b[8..16], 2u64.to_ne_bytes());
        assert_eq!(b[16..20], 3i32.to_ne_bytes());
        assert!(pack_params(&[]).is_empty());
    }

    /// NVRTC needs no GPU: where its library is present (e.g. the
    /// `nvidia-cuda-nvrtc-cu12` wheel on LD_LIBRARY_PATH), the source must
    /// compile for Hopper and export every kernel the table loads.
    #[test]
    fn kernels_compile_with_nvrtc_when_it_is_present() {
        if !super::super::probe::nvrtc_present() {
            eprintln!("NOTICE: NVRTC not found; skipping the kernel compile check");
            return;
        }
        let ptx = ptx_for((9, 0)).expect("the kernels compile");
        if ptx.starts_with("// samplerd emulated NVRTC") {
            // The emulated NVRTC (cuda/emu) compiles nothing; the real
            // compile is checked where the real NVRTC is on the path.
            eprintln!("NOTICE: the emulated NVRTC; skipping the kernel compile check");
            return;
        }
        let per_format = DevFormat::ALL
            .iter()
            .flat_map(|f| ["embed", "mmw", "mm"].map(|k| format!("{k}_{}", f.suffix())));
        for name in per_format.chain(
            [
                "add_norm_quant",
                "quantize_q8_1",
                "quantize_q8_k",
                "qkv_rope_store",
                "attn_scores",
                "attention",
                "qkv_rope_store_batch",
                "attn_scores_batch",
                "attention_batch",
                "scatter_logits",
                "swiglu_quant",
                "check_logits",
                "logit_bias",
                "penalties",
                "scale_temperature",
                "top_k",
                "top_k_partial",
                "top_k_merge",
                "survivor_raw",
                "lse_blocks",
            ]
            .map(String::from),
        ) {
            assert!(
                ptx.contains(&format!(".entry {name}(")),
                "kernel {name} missing from the PTX"
            );
        }
        // Cached: the second call returns the same text without compiling.
        assert!(Arc::ptr_eq(&ptx, &ptx_for((9, 0)).unwrap()));
    }
}
