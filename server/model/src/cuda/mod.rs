//! Device placement (which backend runs the forward pass), and the CUDA backend (feature `cuda`).
//!
//! [`resolve`] turns the configured [`DeviceRequest`] (`model.device`) into a
//! [`Placement`] before any model memory is touched: `cuda` without a usable
//! GPU is one clear error (no driver, no NVRTC, no device, or a build without
//! the feature), never a panic — cudarc's dynamically loaded symbols panic
//! when the library is missing, so the libraries are probed first. `auto`
//! falls back to the CPU and says why.
//!
//! The CUDA backend (`backend` and the files it names, `kernels`) compiles
//! its kernels from CUDA C with NVRTC at start-up, keeps every weight matrix
//! on the device in the CPU loader's block format — Q8_0, Q4_1, Q5_0, Q5_1,
//! Q4_K, Q5_K, Q6_K, F16 or BF16, none converted (`format`) — and
//! dequantises inside the product kernels (at batch 1 decode reads every
//! weight once, so fewer bytes is the speed), and reproduces
//! `crate::cpu::forward` bit for bit: each product's activations in the form the
//! CPU gives its format (Q8_1 or Q8_K blocks, or f32 rounded to f16 / bf16),
//! the CPU kernels' lane orders in whichever order the step's size picks
//! (the K-quants' tiled one for 8+ tokens, tinyBLAS's for F16 / BF16 in
//! steps of 2+), ggml's expf, f16 KV cache, the same RoPE table.
//!
//! `emu/` (C++, not a Rust module) is an emulated CUDA driver and NVRTC for
//! running this backend end to end without a GPU: the driver API on host
//! memory with a device's checks, the kernels compiled into it as C++
//! (scripts/ci/cuda-emulated.sh; docs/ARCHITECTURE.md, "The emulated CUDA
//! driver").

#[cfg(feature = "cuda")]
pub mod backend;
#[cfg(feature = "cuda")]
mod batch;
#[cfg(feature = "cuda")]
mod batch_scratch;
mod device;
#[cfg(feature = "cuda")]
mod err;
#[cfg(any(test, feature = "cuda"))]
// Without the feature only the emulation test uses it (not every item).
#[cfg_attr(not(feature = "cuda"), allow(dead_code))]
mod format;
#[cfg(feature = "cuda")]
mod forward;
#[cfg(feature = "cuda")]
pub mod kernels;
#[cfg(feature = "cuda")]
mod launch;
#[cfg(feature = "cuda")]
mod options;
#[cfg(feature = "cuda")]
mod probe;
mod resolve;
#[cfg(feature = "cuda")]
mod sampling;
#[cfg(any(test, feature = "cuda"))]
mod source;
#[cfg(feature = "cuda")]
mod state;
mod supported;
#[cfg(feature = "cuda")]
mod upload;
// The kernels checked against the CPU backend on the CPU (no GPU needed).
#[cfg(test)]
mod emulation;

#[cfg(feature = "cuda")]
pub use backend::CudaBackend;
#[cfg(feature = "cuda")]
pub use batch_scratch::BatchStats;
pub use device::{DeviceError, DeviceRequest, Placement};
#[cfg(feature = "cuda")]
pub use options::{CudaOptions, MmKernel};
pub use resolve::{Resolved, built_with_cuda, resolve};
#[cfg(feature = "cuda")]
pub use sampling::{DeviceOp, DeviceStatus, TopK};
#[cfg(feature = "cuda")]
pub use state::{CudaState, StepTiming};
pub use supported::unsupported;
