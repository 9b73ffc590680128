//! The GGUF file: header, metadata and tensors, hyper-parameters, and the weights loaded from it.

mod file;
mod hparams;
mod matrix;
pub mod weights;

pub use file::GgufFile;
pub use hparams::{Arch, Config, MAX_HEAD_DIM};
pub use weights::{Fused, LayerWeights, Weights};
