//! Q4_1 weights: 4-bit values with a scale and a minimum.

use super::block::{QK, block32};

/// A Q4_1 weight block: `x[i] = d * q[i] + m`; `q[j]` is the low nibble of
/// `qs[j]` for `j < 16` and the high nibble of `qs[j - 16]` otherwise.
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct BlockQ4_1 {
    pub d: f32,
    pub m: f32,
    pub qs: [u8; QK / 2],
}

block32!(BlockQ4_1, min: true, values: |b: &BlockQ4_1| {
    let mut v = [0i8; QK];
    for j in 0..QK / 2 {
        v[j] = (b.qs[j] & 0x0F) as i8;
        v[j + QK / 2] = (b.qs[j] >> 4) as i8;
    }
    v
});
