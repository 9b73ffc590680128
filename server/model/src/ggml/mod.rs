//! llama.cpp's ggml CPU arithmetic wherever its rounding shows in greedy decoding.
//!
//! Bit-faithful emulation of the few ggml reductions whose rounding is
//! visible: the vectorised `expf` used by softmax and SiLU (`expf`), the
//! lane layout of the f16 dot products in attention (K·q and V·softmax;
//! `attention`, the reference head) and of the F16/BF16 weight products
//! (`half`), and the lane reductions (`reduce`).
//!
//! A 135M-parameter model at 4 bits has many near-ties between its top two
//! logits, so "the same maths in a different order" is not enough for greedy
//! parity with llama.cpp over 32+ tokens. The weight products already match
//! bit for bit (same block formats, one accumulator, same horizontal sum);
//! these modules do the same for attention, the feed-forward activation
//! and the half-precision weights. `flavor` says whose order to follow.
//!
//! Two flavours follow the two x86 builds of ggml: [`Flavor::Avx512`]
//! (16-lane vectors; chosen when the CPU has AVX-512F/DQ, as a native
//! llama.cpp build then does) and [`Flavor::Avx2`] (8 lanes). The code is
//! scalar over explicit lanes (the compiler vectorises it) with fused
//! multiply-adds, compiled with FMA enabled when the CPU has it.

pub mod attention;
pub mod expf;
pub(crate) mod flavor;
pub mod half;
pub(crate) mod reduce;

pub use flavor::{Flavor, Numerics, native_flavor};
