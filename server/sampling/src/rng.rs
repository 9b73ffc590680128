//! Host-owned, counter-based randomness. The draws of step `t` of a
//! sequence seeded with `s` come from ChaCha20 keyed by `s` (expanded with
//! rand_core's documented `seed_from_u64`) on stream `t`, so they depend
//! only on `(s, t)`: a stateless Sample call reproduces any step of a
//! stream, on any machine. ChaCha's output is specified, unlike `StdRng`'s.

use std::ffi::c_void;

use rand_chacha::ChaCha20Rng;
use rand_core::{Rng, SeedableRng};
use samplerd_plugin_sdk::abi::SdRng;

/// The random stream of one step.
pub struct StepRng {
    inner: ChaCha20Rng,
}

impl StepRng {
    pub fn new(seed: u64, step: u64) -> Self {
        let mut inner = ChaCha20Rng::seed_from_u64(seed);
        inner.set_stream(step);
        StepRng { inner }
    }

    pub fn next_u64(&mut self) -> u64 {
        self.inner.next_u64()
    }

    /// Uniform in [0, 1) with 53 random bits (the ABI's documented mapping).
    pub fn uniform_f64(&mut self) -> f64 {
        (self.next_u64() >> 11) as f64 * (1.0 / (1u64 << 53) as f64)
    }

    /// The ABI view handed to stages; valid while `self` is borrowed.
    pub fn as_abi(&mut self) -> SdRng {
        SdRng {
            struct_size: size_of::<SdRng>() as u32,
            ctx: (self as *mut StepRng).cast(),
            next_u64: Some(step_rng_next_u64),
        }
    }
}

unsafe extern "C" fn step_rng_next_u64(ctx: *mut c_void) -> u64 {
    // SAFETY: ctx is the `StepRng` that `as_abi` borrowed for this call.
    unsafe { &mut *ctx.cast::<StepRng>() }.next_u64()
}

/// A fresh random seed from the OS, for `seed = "random"` requests.
pub fn random_seed() -> u64 {
    let mut key = [0u8; 8];
    // The OS entropy source failing is not recoverable in any useful way; a
    // zeroed key would silently repeat seeds, so fail loudly instead.
    getrandom::fill(&mut key).expect("the OS random source is unavailable");
    u64::from_le_bytes(key)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn same_seed_and_step_same_draws() {
        let a: Vec<u64> = (0..4).map(|_| StepRng::new(42, 7).next_u64()).collect();
        assert!(a.windows(2).all(|w| w[0] == w[1]));
        let mut r1 = StepRng::new(42, 7);
        let mut r2 = StepRng::new(42, 7);
        for _ in 0..100 {
            assert_eq!(r1.next_u64(), r2.next_u64());
        }
    }

    #[test]
    fn steps_and_seeds_are_independent_streams() {
        let first = |s, t| StepRng::new(s, t).next_u64();
        assert_ne!(first(42, 0), first(42, 1));
        assert_ne!(first(42, 0), first(43, 0));
    }

    #[test]
    fn uniform_in_unit_interval() {
        let mut r = StepRng::new(1, 2);
        for _ in 0..10_000 {
            let u = r.uniform_f64();
            assert!((0.0..1.0).contains(&u));
        }
    }

    #[test]
    fn random_seeds_differ() {
        assert_ne!(random_seed(), random_seed());
    }
}
