//! SIMD filters over 64-float chunks: compare and sign masks, the indices
//! and the sum of the values at or above a threshold.

use samplerd_numerics::fold::CHUNK;

use super::fold::sum_chunk;

/// Bit j of the result is set when `c[j] >= t` (hand-written SSE2 on
/// x86_64: compare + movemask, 4 lanes at a time).
#[cfg(target_arch = "x86_64")]
#[inline(always)]
pub fn ge_mask(c: &[f32; CHUNK], t: f32) -> u64 {
    use std::arch::x86_64::*;
    let p = c.as_ptr();
    let mut m = 0u64;
    // SAFETY: SSE2 is baseline; loads stay within the 64-float array.
    unsafe {
        let tv = _mm_set1_ps(t);
        for q in 0..CHUNK / 4 {
            let v = _mm_loadu_ps(p.add(q * 4));
            m |= (_mm_movemask_ps(_mm_cmpge_ps(v, tv)) as u64) << (q * 4);
        }
    }
    m
}

/// Bit j of the result is set when `c[j] >= t` (portable version).
#[cfg(not(target_arch = "x86_64"))]
#[inline(always)]
pub fn ge_mask(c: &[f32; CHUNK], t: f32) -> u64 {
    let mut m = 0u64;
    for (j, &v) in c.iter().enumerate() {
        m |= ((v >= t) as u64) << j;
    }
    m
}

/// Bit j of the result is the sign bit of `c[j]` (SSE2 movemask on
/// x86_64).
#[cfg(target_arch = "x86_64")]
#[inline(always)]
pub fn sign_mask(c: &[f32; CHUNK]) -> u64 {
    use std::arch::x86_64::*;
    let p = c.as_ptr();
    let mut m = 0u64;
    // SAFETY: SSE2 is baseline; loads stay within the 64-float array.
    unsafe {
        for q in 0..CHUNK / 4 {
            m |= (_mm_movemask_ps(_mm_loadu_ps(p.add(q * 4))) as u64) << (q * 4);
        }
    }
    m
}

/// Bit j of the result is the sign bit of `c[j]` (portable version).
#[cfg(not(target_arch = "x86_64"))]
#[inline(always)]
pub fn sign_mask(c: &[f32; CHUNK]) -> u64 {
    let mut m = 0u64;
    for (j, &v) in c.iter().enumerate() {
        m |= ((v.to_bits() >> 31) as u64) << j;
    }
    m
}

/// Replaces `out` with the indices i of `x` where `x[i] >= t`, ascending.
/// Cost: one vectorised compare pass plus O(hits).
pub fn indices_at_least(x: &[f32], t: f32, out: &mut Vec<u32>) {
    out.clear();
    let mut chunks = x.chunks_exact(CHUNK);
    for (ci, c) in (&mut chunks).enumerate() {
        let mut m = ge_mask(c.try_into().expect("chunk"), t);
        let base = (ci * CHUNK) as u32;
        while m != 0 {
            out.push(base + m.trailing_zeros());
            m &= m - 1;
        }
    }
    let tail = x.len() - chunks.remainder().len();
    for (j, &v) in chunks.remainder().iter().enumerate() {
        if v >= t {
            out.push((tail + j) as u32);
        }
    }
}

/// Sum of the values of `x` that are `>= t` (f32 lanes per chunk, f64
/// across chunks).
pub fn sum_at_least(x: &[f32], t: f32) -> f64 {
    let mut total = 0.0f64;
    let mut chunks = x.chunks_exact(CHUNK);
    for c in &mut chunks {
        let c: &[f32; CHUNK] = c.try_into().expect("chunk");
        let mut m = [0.0f32; CHUNK];
        for (d, &v) in m.iter_mut().zip(c) {
            *d = if v >= t { v } else { 0.0 };
        }
        total += sum_chunk(&m) as f64;
    }
    for &v in chunks.remainder() {
        if v >= t {
            total += v as f64;
        }
    }
    total
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn masks_and_masked_sums() {
        let x: Vec<f32> = (0..200).map(|i| ((i * 37) % 101) as f32).collect();
        let mut idx = Vec::new();
        indices_at_least(&x, 90.0, &mut idx);
        let want: Vec<u32> = (0..200u32).filter(|&i| x[i as usize] >= 90.0).collect();
        assert_eq!(idx, want);
        let s: f64 = x.iter().filter(|&&v| v >= 90.0).map(|&v| v as f64).sum();
        assert_eq!(sum_at_least(&x, 90.0), s);
    }
}
