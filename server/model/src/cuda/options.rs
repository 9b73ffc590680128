//! The CUDA backend's options: which device, and which of the kernels'
//! equivalent layouts run (for comparisons; every choice gives the same bits).

use crate::ggml::{Flavor, Numerics};

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
    /// Whose lane order the kernels follow (`model.numerics`).
    pub flavor: Flavor,
    /// The most sequences one batched decode pass runs (1..=65,535: the
    /// rows are a grid dimension); a larger step runs as several passes.
    /// Its scratch grows to the largest pass run.
    pub max_batch_rows: usize,
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
            flavor: Numerics::default().flavor(),
            max_batch_rows: 256,
        }
    }
}
