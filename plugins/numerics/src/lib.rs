//! samplerd's shared numerics, used by the built-in stages
//! (`samplerd-core-stages`) and by the host's logit scans
//! (`samplerd-sampling`), so that both compute the same bits:
//!
//! - [`mod@features`]: the CPU features, detected once and cached, and the
//!   [`dispatch!`] macro that runs a body compiled for AVX-512, AVX2+FMA or
//!   the baseline;
//! - [`exp`]: the one vectorisable `exp` (Cephes `expf`, measured error in
//!   its docs) and its AVX-512 form, bit-identical;
//! - [`fold`]: max and sum folds over slices and 64-float chunks;
//! - [`lse`]: the log-sum-exp behind every reported `logprob`, in parts
//!   that merge in order ([`lse::PartialLse`]).
//!
//! Every result here is the same on every instruction set unless its
//! docs say otherwise (the log-sum-exp uses fused multiply-adds where the
//! CPU has them).

#![deny(unsafe_op_in_unsafe_fn)]

pub mod exp;
pub mod features;
pub mod fold;
pub mod lse;

pub use features::{Features, Isa, features};
