//! Device placement: which backend (CPU or CUDA) runs the forward pass, and,
//! with the `cuda` cargo feature, the CUDA backend itself.
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

use serde::{Deserialize, Serialize};

#[cfg(feature = "cuda")]
pub mod backend;
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
mod probe;
#[cfg(feature = "cuda")]
mod sampling;
#[cfg(feature = "cuda")]
mod state;
#[cfg(feature = "cuda")]
mod upload;
// The kernels checked against the CPU backend on the CPU (no GPU needed).
#[cfg(test)]
mod emulation;

/// The CUDA C source of every kernel: the files are one translation unit,
/// concatenated in this order (kernels.cu's header says what each holds).
/// NVRTC compiles it at start-up; the emulation test compiles it as C++.
#[cfg(any(test, feature = "cuda"))]
pub(crate) const KERNEL_SOURCE: &str = concat!(
    include_str!("kernels/forward.cu"),
    include_str!("kernels/q32.cu"),
    include_str!("kernels/kquant.cu"),
    include_str!("kernels/half.cu"),
    include_str!("kernels/sampling.cu"),
);

#[cfg(feature = "cuda")]
pub use backend::CudaBackend;

/// Why the CUDA backend cannot run a model of `config` yet, or `None`. Its
/// kernels take the query and attention-output width to be `n_embd` and
/// have no per-head q/k RMSNorm, so such models (qwen3; a
/// `attention.key_length` unlike `n_embd / n_head`) are refused with this
/// reason rather than computed wrongly; the CPU backend runs them. (Llama
/// 3.1+ frequency factors and linear RoPE scaling need nothing more: they
/// are in the host-computed RoPE table.) Independent of the `cuda`
/// feature so it is tested without a GPU.
pub fn unsupported(config: &crate::Config) -> Option<String> {
    if config.qk_norm {
        return Some(format!(
            "cuda: the {} architecture's per-head q/k RMSNorm (attn_q_norm, attn_k_norm) \
             is not supported by the CUDA backend yet; use model.device = \"cpu\"",
            config.arch.name()
        ));
    }
    if config.q_dim() != config.n_embd {
        return Some(format!(
            "cuda: {} heads x head size {} (attention.key_length) = {} differs from the \
             embedding length {}; not supported by the CUDA backend yet; use model.device = \"cpu\"",
            config.n_head,
            config.head_dim,
            config.q_dim(),
            config.n_embd
        ));
    }
    None
}

/// `model.device`: where the forward pass should run.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum DeviceRequest {
    /// CUDA device 0 when a driver, NVRTC and a device are present, else the CPU.
    #[default]
    Auto,
    /// CUDA device 0, or a start-up error.
    Cuda,
    /// The CPU backend.
    Cpu,
}

impl DeviceRequest {
    pub fn name(self) -> &'static str {
        match self {
            DeviceRequest::Auto => "auto",
            DeviceRequest::Cuda => "cuda",
            DeviceRequest::Cpu => "cpu",
        }
    }
}

impl std::fmt::Display for DeviceRequest {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

/// Where the forward pass runs.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Placement {
    Cpu,
    /// A CUDA device (ordinal, name and compute capability, for the logs).
    Cuda {
        ordinal: usize,
        name: String,
        compute_capability: (i32, i32),
    },
}

impl std::fmt::Display for Placement {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Placement::Cpu => f.write_str("cpu"),
            Placement::Cuda {
                ordinal,
                name,
                compute_capability: (major, minor),
            } => write!(f, "cuda:{ordinal} ({name}, sm_{major}{minor})"),
        }
    }
}

/// Why CUDA is unavailable.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum DeviceError {
    #[error(
        "model.device = \"cuda\": this samplerd was built without CUDA support \
         (rebuild with `cargo build --release --features cuda`, or set model.device = \"cpu\")"
    )]
    NotBuilt,
    #[error(
        "model.device = \"cuda\": no CUDA driver found (libcuda.so could not be loaded; \
         is the NVIDIA driver installed and visible to this process?)"
    )]
    NoDriver,
    #[error(
        "model.device = \"cuda\": the CUDA driver is present but NVRTC is not \
         (libnvrtc.so.13 / .12 could not be loaded; it compiles the kernels at start-up: \
         install the CUDA runtime compiler library)"
    )]
    NoNvrtc,
    #[error("model.device = \"cuda\": the CUDA driver reports no device ({detail})")]
    NoDevice { detail: String },
    #[error("model.device = \"cuda\": CUDA initialisation failed: {0}")]
    Driver(String),
}

/// The outcome of [`resolve`]: the placement and, for `auto`, why it was
/// chosen (for the start-up log).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Resolved {
    pub placement: Placement,
    pub reason: String,
}

/// Picks the device for `request`. Probes the CUDA libraries without
/// panicking; `cuda` without a usable device is an error, `auto` then
/// falls back to the CPU with the reason.
pub fn resolve(request: DeviceRequest) -> Result<Resolved, DeviceError> {
    match request {
        DeviceRequest::Cpu => Ok(Resolved {
            placement: Placement::Cpu,
            reason: "model.device = \"cpu\"".into(),
        }),
        DeviceRequest::Cuda => cuda_device().map(|placement| Resolved {
            placement,
            reason: "model.device = \"cuda\"".into(),
        }),
        DeviceRequest::Auto => Ok(match cuda_device() {
            Ok(placement) => Resolved {
                placement,
                reason: "model.device = \"auto\": a CUDA device is present".into(),
            },
            Err(e) => Resolved {
                placement: Placement::Cpu,
                reason: format!(
                    "model.device = \"auto\": using the CPU because {}",
                    auto_reason(&e)
                ),
            },
        }),
    }
}

/// The error without its `model.device = "cuda": ` prefix (for the `auto` log).
fn auto_reason(e: &DeviceError) -> String {
    let s = e.to_string();
    s.split_once(": ")
        .map(|(_, rest)| rest.to_string())
        .unwrap_or(s)
}

#[cfg(feature = "cuda")]
fn cuda_device() -> Result<Placement, DeviceError> {
    probe::first_device()
}

#[cfg(not(feature = "cuda"))]
fn cuda_device() -> Result<Placement, DeviceError> {
    Err(DeviceError::NotBuilt)
}

/// The backend for `placement` over freshly loaded `weights` (the CUDA
/// backend uploads them and lets the host copy go).
pub(crate) fn new_backend(
    placement: &Placement,
    config: &crate::gguf::Config,
    weights: std::sync::Arc<crate::gguf::weights::Weights>,
    n_threads: usize,
    flavor: crate::ggml::Flavor,
) -> Result<std::sync::Arc<dyn crate::backend::Backend>, crate::ModelError> {
    match placement {
        Placement::Cpu => Ok(std::sync::Arc::new(crate::cpu::forward::CpuBackend::new(
            config.clone(),
            weights,
            n_threads,
            flavor,
        ))),
        #[cfg(feature = "cuda")]
        Placement::Cuda { ordinal, .. } => Ok(std::sync::Arc::new(CudaBackend::new(
            config.clone(),
            &weights,
            backend::CudaOptions {
                ordinal: *ordinal,
                flavor,
                ..Default::default()
            },
        )?)),
        #[cfg(not(feature = "cuda"))]
        Placement::Cuda { .. } => Err(crate::ModelError::Backend(
            DeviceError::NotBuilt.to_string(),
        )),
    }
}

/// True when this build has the CUDA backend.
pub const fn built_with_cuda() -> bool {
    cfg!(feature = "cuda")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn models_the_kernels_cannot_run_are_refused_by_reason() {
        let llama = crate::Config {
            arch: crate::Arch::Llama,
            n_ctx_train: 64,
            n_embd: 64,
            n_layer: 1,
            n_head: 4,
            n_head_kv: 2,
            head_dim: 16,
            n_ff: 64,
            rope_freq_base: 10000.0,
            rope_dim: 16,
            rope_freq_scale: 0.25,
            rope_neox: false,
            rms_eps: 1e-5,
            qk_norm: false,
            n_vocab: 8,
        };
        assert_eq!(unsupported(&llama), None);
        let wide = crate::Config {
            head_dim: 32,
            rope_dim: 32,
            ..llama.clone()
        };
        let why = unsupported(&wide).unwrap();
        assert!(
            why.contains("128 differs from the embedding length 64"),
            "{why}"
        );
        let qwen3 = crate::Config {
            arch: crate::Arch::Qwen3,
            qk_norm: true,
            rope_neox: true,
            ..llama
        };
        let why = unsupported(&qwen3).unwrap();
        assert!(
            why.contains("qwen3") && why.contains("attn_q_norm"),
            "{why}"
        );
    }

    #[test]
    fn cpu_is_always_cpu() {
        let r = resolve(DeviceRequest::Cpu).unwrap();
        assert_eq!(r.placement, Placement::Cpu);
    }

    #[test]
    fn request_names_round_trip_through_serde() {
        for (text, want) in [
            ("\"auto\"", DeviceRequest::Auto),
            ("\"cuda\"", DeviceRequest::Cuda),
            ("\"cpu\"", DeviceRequest::Cpu),
        ] {
            let got: DeviceRequest = serde_json::from_str(text).unwrap();
            assert_eq!(got, want);
            assert_eq!(serde_json::to_string(&got).unwrap(), text);
        }
        let err = serde_json::from_str::<DeviceRequest>("\"gpu\"").unwrap_err();
        assert!(err.to_string().contains("unknown variant `gpu`"), "{err}");
    }

    /// Without a usable GPU (this machine, CI) `cuda` is one clear error and
    /// `auto` falls back to the CPU naming the reason. On a GPU machine
    /// (`SAMPLERD_EXPECT_GPU=1`, set by scripts/gpu-check.sh) both must pick CUDA.
    #[test]
    fn cuda_request_errors_cleanly_without_a_gpu_and_auto_falls_back() {
        let expect_gpu = std::env::var("SAMPLERD_EXPECT_GPU").as_deref() == Ok("1");
        let cuda = resolve(DeviceRequest::Cuda);
        let auto = resolve(DeviceRequest::Auto).unwrap();
        if expect_gpu {
            assert!(matches!(
                cuda,
                Ok(Resolved {
                    placement: Placement::Cuda { .. },
                    ..
                })
            ));
            assert!(matches!(auto.placement, Placement::Cuda { .. }));
            return;
        }
        match cuda {
            Err(e) => {
                let msg = e.to_string();
                assert!(msg.starts_with("model.device = \"cuda\": "), "{msg}");
                if !built_with_cuda() {
                    assert_eq!(e, DeviceError::NotBuilt);
                    assert!(msg.contains("built without CUDA support"), "{msg}");
                }
                assert_eq!(auto.placement, Placement::Cpu);
                assert!(
                    auto.reason
                        .starts_with("model.device = \"auto\": using the CPU because "),
                    "{}",
                    auto.reason
                );
                assert!(auto.reason.contains(&auto_reason(&e)), "{}", auto.reason);
            }
            // A machine with a GPU that did not set SAMPLERD_EXPECT_GPU.
            Ok(r) => assert!(matches!(r.placement, Placement::Cuda { .. })),
        }
    }
}
