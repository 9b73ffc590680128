//! Picking the device for a request before any model memory is touched.
//!
//! CUDA when usable; else the CPU (`auto`) or an error (`cuda`).

use super::device::{DeviceError, DeviceRequest, Placement};
#[cfg(feature = "cuda")]
use super::probe;

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

/// True when this build has the CUDA backend.
pub const fn built_with_cuda() -> bool {
    cfg!(feature = "cuda")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cpu_is_always_cpu() {
        let r = resolve(DeviceRequest::Cpu).unwrap();
        assert_eq!(r.placement, Placement::Cpu);
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
