//! The CPU backend: the forward pass, attention over the f16 cache, and RoPE.

pub mod attention;
pub mod forward;
pub mod rope;

pub use forward::{CpuBackend, trace_layers};
