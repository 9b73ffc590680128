//! The AVX2+FMA weight-product kernels.

pub(crate) mod kquant;
pub(crate) mod rows;
pub(crate) mod tokens;
