//! Tests of the weight formats and their kernels together.

mod kquant;
mod q32;
