//! Which llama.cpp build's arithmetic order to mirror, and the CPU features its fast paths use.
//!
//! [`Numerics`] is the `model.numerics` setting, [`Flavor`] the build it
//! mirrors on this CPU; the feature checks go through
//! `samplerd_numerics::features`, detected once per process.

use std::sync::OnceLock;

use serde::{Deserialize, Serialize};

/// Which ggml build's arithmetic order to mirror.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Flavor {
    Avx512,
    Avx2,
}

impl Flavor {
    /// The name `check-config` and the `Finished` timings print.
    pub fn name(self) -> &'static str {
        match self {
            Flavor::Avx512 => "avx512",
            Flavor::Avx2 => "avx2",
        }
    }

    /// Vector width in f32 lanes.
    pub fn lanes(self) -> usize {
        match self {
            Flavor::Avx512 => 16,
            Flavor::Avx2 => 8,
        }
    }
}

/// `model.numerics`: whose arithmetic order the forward pass follows.
///
/// llama.cpp's AVX2 and AVX-512 builds round differently (vector width in
/// softmax, SiLU and attention), enough
/// to pick different greedy tokens after a few steps. `Portable` computes
/// the AVX2 build's order on every CPU (and the CUDA backend follows it), so
/// a fleet of mixed nodes answers a request with the same bytes; `Native`
/// mirrors the llama.cpp build native to this CPU (what a side-by-side
/// comparison with a local llama.cpp needs).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Numerics {
    #[default]
    Portable,
    Native,
}

impl Numerics {
    pub fn name(self) -> &'static str {
        match self {
            Numerics::Portable => "portable",
            Numerics::Native => "native",
        }
    }

    /// The ggml build this setting mirrors on this CPU.
    pub fn flavor(self) -> Flavor {
        match self {
            Numerics::Portable => Flavor::Avx2,
            Numerics::Native => native_flavor(),
        }
    }

    /// "portable (avx2 order)": the setting and the order it ran.
    pub fn describe(self) -> String {
        format!("{} ({} order)", self.name(), self.flavor().name())
    }
}

/// The flavour of the llama.cpp build native to this CPU: AVX-512 when the
/// CPU has AVX-512F/DQ (as a native ggml build then uses), else AVX2.
/// `SAMPLERD_GGML_FLAVOR=avx2|avx512` overrides the detection (to compare
/// with a llama.cpp built for the other one).
pub fn native_flavor() -> Flavor {
    static F: OnceLock<Flavor> = OnceLock::new();
    *F.get_or_init(|| match std::env::var("SAMPLERD_GGML_FLAVOR").as_deref() {
        Ok("avx2") => Flavor::Avx2,
        Ok("avx512") => Flavor::Avx512,
        _ => {
            #[cfg(target_arch = "x86_64")]
            {
                let f = samplerd_numerics::features();
                if f.avx512f() && f.avx512dq() {
                    return Flavor::Avx512;
                }
            }
            Flavor::Avx2
        }
    })
}

/// Whether this CPU has AVX2 and FMA (the vectorised SwiGLU, attention and
/// F16/BF16 products are compiled for them).
pub(crate) fn has_fma() -> bool {
    let f = samplerd_numerics::features();
    f.fma() && f.avx2()
}

/// Whether this CPU has F16C (f16 widened in registers by `vcvtph2ps`).
#[cfg(target_arch = "x86_64")]
pub(crate) fn has_f16c() -> bool {
    samplerd_numerics::features().f16c()
}

/// Whether this CPU has AVX-512 BF16 (a native llama.cpp build then
/// multiplies BF16 with `vdpbf16ps`).
pub(crate) fn has_avx512_bf16() -> bool {
    samplerd_numerics::features().avx512bf16()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn portable_numerics_is_the_avx2_order_on_every_cpu() {
        assert_eq!(Numerics::default(), Numerics::Portable);
        assert_eq!(Numerics::Portable.flavor(), Flavor::Avx2);
        assert_eq!(Numerics::Native.flavor(), native_flavor());
        assert_eq!(Numerics::Portable.describe(), "portable (avx2 order)");
        let parsed: Numerics = serde_json::from_str("\"native\"").unwrap();
        assert_eq!(parsed, Numerics::Native);
        assert!(serde_json::from_str::<Numerics>("\"fast\"").is_err());
    }
}
