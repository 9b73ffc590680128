//! Q5_1 weights: 5-bit values with a scale and a minimum, kept natively.
//!
//! llama.cpp's fallback for Q5_K_M/Q5_K_S tensors whose rows are not a
//! multiple of 256.
//!
//! `x = d·q + m` with a 5-bit `q` laid out like Q5_0's. ggml's
//! `ggml_vec_dot_q5_1_q8_1` (AVX2) multiplies the unsigned values with the
//! Q8_1 activations (`mul_sum_us8_pairs_float`), one `fma(q, d·d8, acc)` per
//! block, `hsum_float_8`, plus `Σ m·s` (an fma chain; `m·s` is exact, both
//! being f16 values, so fused or not gives the same bits): the
//! [`Block32`](super::block::Block32) products. 28 bytes per block in memory (f16
//! scale and minimum widened).

use super::block::{QK, block32};
use super::bytes::{blocks_from_bytes, bytes_at, f16_le};

/// A Q5_1 weight block.
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct BlockQ5_1 {
    pub d: f32,
    pub m: f32,
    pub qh: u32,
    pub qs: [u8; QK / 2],
}

/// Bytes of one stored block (f16 d, f16 m, u32 qh, 16 × u8).
pub const Q5_1_BYTES: usize = 24;

/// Blocks from raw GGUF bytes, or `None` for a partial block.
pub fn from_bytes(raw: &[u8]) -> Option<Vec<BlockQ5_1>> {
    blocks_from_bytes(raw, |c: &[u8; Q5_1_BYTES]| BlockQ5_1 {
        d: f16_le(c),
        m: f16_le(&c[2..]),
        qh: u32::from_le_bytes(bytes_at(c, 4)),
        qs: bytes_at(c, 8),
    })
}

/// The 32 unsigned 5-bit values of a block.
#[inline(always)]
pub fn values(b: &BlockQ5_1) -> [u8; QK] {
    let mut v = [0u8; QK];
    for j in 0..QK / 2 {
        v[j] = (b.qs[j] & 0x0F) | ((((b.qh >> j) & 1) as u8) << 4);
        v[j + 16] = (b.qs[j] >> 4) | ((((b.qh >> (j + 16)) & 1) as u8) << 4);
    }
    v
}

block32!(BlockQ5_1, min: true, values: |b| values(b).map(|q| q as i8));
