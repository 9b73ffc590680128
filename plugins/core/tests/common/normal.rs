//! The pseudo-normal logits of the tests and the benchmarks (one
//! generator, so both draw from the same distribution).

/// `n` pseudo-normal values (a sum of 12 xorshift uniforms, centred),
/// scaled by `sd`, from the xorshift state `state` (non-zero).
pub fn from_state(n: usize, sd: f32, mut state: u64) -> Vec<f32> {
    let mut next = || {
        state ^= state << 13;
        state ^= state >> 7;
        state ^= state << 17;
        (state >> 11) as f64 / (1u64 << 53) as f64
    };
    (0..n)
        .map(|_| {
            let z: f64 = (0..12).map(|_| next()).sum::<f64>() - 6.0;
            (z as f32) * sd
        })
        .collect()
}
