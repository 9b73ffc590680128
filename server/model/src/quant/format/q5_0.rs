//! Q5_0 weights: 5-bit values with a scale, kept natively.
//!
//! llama.cpp's fallback for Q4_K_M/Q4_K_S tensors whose rows are not a
//! multiple of 256 — most matrices of narrow models.
//!
//! `x = d·(q − 16)` with a 5-bit `q`: low nibbles in `qs` (value `j` in the
//! low nibble of `qs[j]`, value `j + 16` in the high one), fifth bits in `qh`
//! (bit `j` for value `j`). ggml's `ggml_vec_dot_q5_0_q8_0` (AVX2) expands a
//! block to 32 signed bytes (`bytes_from_nibbles_32 | andnot(bytes_from_bits_32(qh), 0xF0)`)
//! and then does exactly what `ggml_vec_dot_q8_0_q8_0` does, so its kernels
//! are the Q8_0 ones on the expanded values ([`values`]; the
//! [`Block32`](super::block::Block32) products), and they equal the Q8_0
//! kernels on the blocks [`as_q8_0`] expands them to (a Q5_0 matrix loaded
//! as Q8_0) bit for bit.
//! 24 bytes per block in memory (f16 scale widened) instead of 36 as Q8_0.

use super::block::{QK, block32};
use super::bytes::{blocks_from_bytes, bytes_at, f16_le};
use super::q8::BlockQ8_0;

/// A Q5_0 weight block.
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct BlockQ5_0 {
    pub d: f32,
    pub qh: u32,
    pub qs: [u8; QK / 2],
}

/// Bytes of one stored block (f16 d, u32 qh, 16 × u8).
pub const Q5_0_BYTES: usize = 22;

/// Blocks from raw GGUF bytes, or `None` for a partial block.
pub fn from_bytes(raw: &[u8]) -> Option<Vec<BlockQ5_0>> {
    blocks_from_bytes(raw, |c: &[u8; Q5_0_BYTES]| BlockQ5_0 {
        d: f16_le(c),
        qh: u32::from_le_bytes(bytes_at(c, 2)),
        qs: bytes_at(c, 6),
    })
}

/// The block as the exactly equal Q8_0 block (its [`values`], same scale).
pub fn as_q8_0(b: &BlockQ5_0) -> BlockQ8_0 {
    BlockQ8_0 {
        d: b.d,
        qs: values(b),
    }
}

/// The 32 signed values `q − 16` of a block (ggml's `dequantize_row_q5_0`
/// without the scale).
#[inline(always)]
pub fn values(b: &BlockQ5_0) -> [i8; QK] {
    let mut v = [0i8; QK];
    for j in 0..QK / 2 {
        let lo = (b.qs[j] & 0x0F) | ((((b.qh >> j) & 1) as u8) << 4);
        let hi = (b.qs[j] >> 4) | ((((b.qh >> (j + 16)) & 1) as u8) << 4);
        v[j] = lo as i8 - 16;
        v[j + 16] = hi as i8 - 16;
    }
    v
}

block32!(BlockQ5_0, min: false, values: values);
