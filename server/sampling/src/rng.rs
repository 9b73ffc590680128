//! Host-owned, counter-based randomness. The draws of step `t` of a
//! sequence seeded with `s` come from ChaCha20 keyed by `s` (expanded with
//! rand_core's documented `seed_from_u64`) on stream `t`, so they depend
//! only on `(s, t)`: a stateless Sample call reproduces any step of a
//! stream, on any machine. ChaCha's output is specified, unlike `StdRng`'s.
//!
//! One stream `(s, t)` holds three disjoint ranges, by 32-bit word
//! position (ChaCha's positions are 68-bit; a chain draws a few words):
//! - from 0: the stages' sequential draws (`sd_rng.next_u64`);
//! - from [`VERIFY_WORD_POS`] (2⁶⁶): speculative verification's own draws
//!   (REJECTION's acceptance uniform, then its correction's uniform), so
//!   they are independent of the draws a drafter sampling with the same
//!   seed and step made;
//! - from [`KEYED_WORD_POS`] (2⁶⁷): the keyed draws (`sd_rng.keyed_u64`),
//!   key `k` being the 64-bit word pair at `2⁶⁷ + 2k` — a value fixed by
//!   `(s, t, k)` whatever was drawn before.

use std::ffi::c_void;

use rand_chacha::ChaCha20Rng;
use rand_core::{Rng, SeedableRng};
use samplerd_plugin_sdk::abi::SdRng;

/// Where a step's verification draws start (see the module doc).
pub const VERIFY_WORD_POS: u128 = 1 << 66;
/// Where a step's keyed draws start (see the module doc).
pub const KEYED_WORD_POS: u128 = 1 << 67;

/// The random stream of one step.
pub struct StepRng {
    inner: ChaCha20Rng,
    /// The keyed draws' generator, positioned on first use; `next_key` is
    /// the key its next sequential word pair belongs to, so ascending keys
    /// (a dense row's ids) read the keystream in order instead of seeking.
    keyed: Option<(ChaCha20Rng, u64)>,
}

impl StepRng {
    pub fn new(seed: u64, step: u64) -> Self {
        let mut inner = ChaCha20Rng::seed_from_u64(seed);
        inner.set_stream(step);
        StepRng { inner, keyed: None }
    }

    /// The verification draws of `(seed, step)` (from [`VERIFY_WORD_POS`]).
    pub fn verification(seed: u64, step: u64) -> Self {
        let mut r = Self::new(seed, step);
        r.inner.set_word_pos(VERIFY_WORD_POS);
        r
    }

    pub fn next_u64(&mut self) -> u64 {
        self.inner.next_u64()
    }

    /// Uniform in [0, 1) with 53 random bits (the ABI's documented mapping).
    pub fn uniform_f64(&mut self) -> f64 {
        (self.next_u64() >> 11) as f64 * (1.0 / (1u64 << 53) as f64)
    }

    /// The draw of key `key` (see the module doc): the same value whatever
    /// else this stream drew.
    pub fn keyed_u64(&mut self, key: u64) -> u64 {
        let (rng, next) = self.keyed.get_or_insert_with(|| {
            let mut k = self.inner.clone();
            k.set_word_pos(KEYED_WORD_POS);
            (k, 0)
        });
        if *next != key {
            rng.set_word_pos(KEYED_WORD_POS + 2 * key as u128);
        }
        *next = key.wrapping_add(1);
        rng.next_u64()
    }

    /// The ABI view handed to stages; valid while `self` is borrowed.
    pub fn as_abi(&mut self) -> SdRng {
        SdRng {
            struct_size: size_of::<SdRng>() as u32,
            ctx: (self as *mut StepRng).cast(),
            next_u64: Some(step_rng_next_u64),
            keyed_u64: Some(step_rng_keyed_u64),
        }
    }
}

unsafe extern "C" fn step_rng_next_u64(ctx: *mut c_void) -> u64 {
    // SAFETY: ctx is the `StepRng` that `as_abi` borrowed for this call.
    unsafe { &mut *ctx.cast::<StepRng>() }.next_u64()
}

unsafe extern "C" fn step_rng_keyed_u64(ctx: *mut c_void, key: u64) -> u64 {
    // SAFETY: as in step_rng_next_u64.
    unsafe { &mut *ctx.cast::<StepRng>() }.keyed_u64(key)
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
    fn keyed_draws_depend_on_seed_step_and_key_alone() {
        let mut a = StepRng::new(42, 7);
        let fwd: Vec<u64> = (0..300).map(|k| a.keyed_u64(k)).collect();
        let mut b = StepRng::new(42, 7);
        for _ in 0..5 {
            b.next_u64();
        }
        // Out of order, after sequential draws: the same values.
        for k in (0..300).rev().step_by(7) {
            assert_eq!(b.keyed_u64(k), fwd[k as usize], "key {k}");
        }
        // The word pair at 2^67 + 2k, read from a plain ChaCha stream.
        let mut c = ChaCha20Rng::seed_from_u64(42);
        c.set_stream(7);
        c.set_word_pos(KEYED_WORD_POS + 2 * 123);
        assert_eq!(c.next_u64(), fwd[123]);
        assert_ne!(StepRng::new(42, 8).keyed_u64(3), fwd[3]);
        assert_ne!(StepRng::new(43, 7).keyed_u64(3), fwd[3]);
        // Sequential draws are unaffected by keyed ones.
        let mut d = StepRng::new(42, 7);
        d.keyed_u64(9);
        assert_eq!(d.next_u64(), StepRng::new(42, 7).next_u64());
    }

    #[test]
    fn verification_draws_are_their_own_range() {
        let mut v = StepRng::verification(42, 7);
        let mut c = ChaCha20Rng::seed_from_u64(42);
        c.set_stream(7);
        c.set_word_pos(VERIFY_WORD_POS);
        assert_eq!(v.next_u64(), c.next_u64());
        assert_ne!(
            StepRng::verification(42, 7).next_u64(),
            StepRng::new(42, 7).next_u64()
        );
    }

    #[test]
    fn random_seeds_differ() {
        assert_ne!(random_seed(), random_seed());
    }
}
