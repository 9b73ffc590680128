//! The tests' source of random weights and activations.
//!
//! The tests' source of random weights and activations: a small
//! deterministic generator (Knuth's MMIX LCG), so no test depends on
//! `rand`'s stream stability. Shared by the unit tests and, through
//! `#[path]`, the integration tests.

/// Knuth's MMIX linear congruential generator.
pub struct Lcg(pub u64);

impl Lcg {
    /// The next state.
    pub fn step(&mut self) -> u64 {
        self.0 = self
            .0
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        self.0
    }
    /// The state's top 32 bits.
    pub fn u32(&mut self) -> u32 {
        (self.step() >> 32) as u32
    }
    pub fn byte(&mut self) -> u8 {
        self.u32() as u8
    }
    /// Uniform in [-1, 1), from the state's top 24 bits.
    pub fn f(&mut self) -> f32 {
        (self.u32() >> 8) as f32 / (1u32 << 23) as f32 - 1.0
    }
    /// Uniform in [-1, 1), from the state's top 31 bits.
    pub fn f31(&mut self) -> f32 {
        ((self.step() >> 33) as f32 / (1u64 << 31) as f32) * 2.0 - 1.0
    }
}
