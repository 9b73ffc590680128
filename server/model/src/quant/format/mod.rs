//! The block formats: weight blocks as the loader keeps them, activation blocks, and their bytes.

pub mod block;
pub(crate) mod bytes;
pub mod half;
pub mod kquant;
pub mod q4_1;
pub mod q5_0;
pub mod q5_1;
pub mod q8;
