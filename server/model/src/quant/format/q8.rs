//! 8-bit blocks: Q8_0 weights, Q8_1 activations, and the activations' quantisation.

use half::f16;

use super::block::{QK, block32};

/// A Q8_0 weight block: `x[i] = d * qs[i]`.
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct BlockQ8_0 {
    pub d: f32,
    pub qs: [i8; QK],
}

/// A quantised activation block (llama.cpp's `block_q8_1`, scales widened):
/// `x[i] ≈ d * qs[i]`, `s = d * Σ qs` (both rounded through f16).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default)]
pub struct BlockQ8_1 {
    pub d: f32,
    pub s: f32,
    pub qs: [i8; QK],
}

block32!(BlockQ8_0, min: false, values: |b: &BlockQ8_0| b.qs);

/// Quantises `x` (a multiple of 32 values) into Q8_1 activation blocks like
/// llama.cpp's `quantize_row_q8_1` (AVX2 path: `id = 127/amax`, round half to
/// even, `d` and `s` through f16).
pub fn quantize_q8_1(x: &[f32], out: &mut [BlockQ8_1]) {
    debug_assert_eq!(x.len(), out.len() * QK);
    for (b, x) in out.iter_mut().zip(x.chunks_exact(QK)) {
        let amax = x.iter().fold(0f32, |a, v| a.max(v.abs()));
        let d = amax / 127.0;
        let id = if amax != 0.0 { 127.0 / amax } else { 0.0 };
        let mut sum = 0i32;
        for (q, v) in b.qs.iter_mut().zip(x) {
            // Round half to even without a libm call (|v * id| <= 127).
            let r = (((v * id) + 12_582_912.0) - 12_582_912.0) as i32;
            *q = r as i8;
            sum += r;
        }
        b.d = f16::from_f32(d).to_f32();
        b.s = f16::from_f32(d * sum as f32).to_f32();
    }
}
