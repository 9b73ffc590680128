//! The test logits of the server's and samplerctl's tests. samplerctl's
//! tests include this file by path: the two packages share no test crate,
//! and a dev-dependency on the server for three functions would build it.

/// Deterministic pseudo-random logits (a fixed LCG; no RNG dependency).
pub fn logits(n: usize, seed: u64) -> Vec<f32> {
    let mut x = seed
        .wrapping_mul(6364136223846793005)
        .wrapping_add(1442695040888963407);
    (0..n)
        .map(|_| {
            x = x
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            ((x >> 40) as f32 / (1u64 << 24) as f32) * 8.0 - 4.0
        })
        .collect()
}

/// `l` in the `logits_f32le` encoding (little-endian f32 bytes).
pub fn to_bytes(l: &[f32]) -> Vec<u8> {
    l.iter().flat_map(|f| f.to_le_bytes()).collect()
}

pub fn argmax(l: &[f32]) -> u32 {
    let mut best = 0;
    for (i, &v) in l.iter().enumerate() {
        if v > l[best] {
            best = i;
        }
    }
    best as u32
}
