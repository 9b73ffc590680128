//! The weight and activation block formats beyond Q8_0 / Q4_1 / Q8_1.

pub mod half;
pub mod kquant;
pub mod q5_0;
pub mod q5_1;
