//! What `model.device` asks for, where the forward pass runs, and why CUDA is unavailable.

use serde::{Deserialize, Serialize};

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

#[cfg(test)]
mod tests {
    use super::*;

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
}
