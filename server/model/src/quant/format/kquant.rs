//! K-quant blocks (Q4_K, Q5_K, Q6_K: 256-value super-blocks) and their activation format Q8_K.
//!
//! Kept natively so a Q4_K_M file costs what it costs on disk and its
//! products are the ones llama.cpp's CPU backend computes. For these weight
//! types ggml quantises the activations to Q8_K (`quantize_row_q8_K_ref`:
//! one f32 scale per 256 values, `-127/max`, and per-16 sums for the minimum
//! terms: [`quantize_q8_k`]); the products' arithmetic is described with the
//! scalar kernels, their reference (`quant::kernels::scalar`).
//!
//! The f16 scales are widened to f32 at load (exact) and the 6-bit packed
//! sub-block scales/minimums of Q4_K/Q5_K unpacked (`get_scale_min_k4`), so a
//! Q4_K/Q5_K block is 8 bytes larger than ggml's and a Q6_K block 2; the
//! quants stay as stored.

use super::block::WeightBlock;
use super::bytes::{blocks_from_bytes, bytes_at, f16_le};

/// Values per super-block.
pub const QK_K: usize = 256;

/// Q4_K: `x = d * sc[s] * q - dmin * m[s]` for sub-block `s` (32 values);
/// `qs[32j + l]` holds value `64j + l` (low nibble) and `64j + 32 + l` (high).
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct BlockQ4K {
    pub d: f32,
    pub dmin: f32,
    pub sc: [u8; 8],
    pub m: [u8; 8],
    pub qs: [u8; QK_K / 2],
}

/// Q5_K: Q4_K's layout plus a fifth bit per value: bit `2j` of `qh[l]` for
/// value `64j + l`, bit `2j + 1` for value `64j + 32 + l`.
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct BlockQ5K {
    pub d: f32,
    pub dmin: f32,
    pub sc: [u8; 8],
    pub m: [u8; 8],
    pub qh: [u8; QK_K / 8],
    pub qs: [u8; QK_K / 2],
}

/// Q6_K: `x = d * scales[v / 16] * (q - 32)`; the 6-bit `q` is split into
/// `ql` (4 bits) and `qh` (2 bits) as in ggml's `dequantize_row_q6_K`.
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct BlockQ6K {
    pub d: f32,
    pub ql: [u8; QK_K / 2],
    pub qh: [u8; QK_K / 4],
    pub scales: [i8; QK_K / 16],
}

/// Activations for K-quant products (ggml's `block_q8_K`):
/// `x[i] ≈ d * qs[i]`, `bsums[k] = Σ qs[16k..16k + 16]`.
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct BlockQ8K {
    pub d: f32,
    pub qs: [i8; QK_K],
    pub bsums: [i16; QK_K / 16],
}

impl Default for BlockQ8K {
    fn default() -> Self {
        BlockQ8K {
            d: 0.0,
            qs: [0; QK_K],
            bsums: [0; QK_K / 16],
        }
    }
}

/// ggml's `get_scale_min_k4` for all eight sub-blocks.
fn scale_min_k4(q: &[u8]) -> ([u8; 8], [u8; 8]) {
    let (mut sc, mut m) = ([0u8; 8], [0u8; 8]);
    for j in 0..8 {
        if j < 4 {
            sc[j] = q[j] & 63;
            m[j] = q[j + 4] & 63;
        } else {
            sc[j] = (q[j + 4] & 0xF) | ((q[j - 4] >> 6) << 4);
            m[j] = (q[j + 4] >> 4) | ((q[j] >> 6) << 4);
        }
    }
    (sc, m)
}

/// The 16 bytes that open a stored Q4_K / Q5_K block: `d`, `dmin` and the
/// packed sub-block scales and minimums, unpacked.
fn k4_head(c: &[u8]) -> (f32, f32, [u8; 8], [u8; 8]) {
    let (sc, m) = scale_min_k4(&c[4..16]);
    (f16_le(c), f16_le(&c[2..]), sc, m)
}

/// Byte sizes of one stored block (ggml's `block_q4_K` etc.).
pub const Q4K_BYTES: usize = 144;
pub const Q5K_BYTES: usize = 176;
pub const Q6K_BYTES: usize = 210;

/// Q4_K blocks from raw GGUF bytes, or `None` when the length is not a
/// whole number of blocks.
pub fn q4k_from_bytes(raw: &[u8]) -> Option<Vec<BlockQ4K>> {
    blocks_from_bytes(raw, |c: &[u8; Q4K_BYTES]| {
        let (d, dmin, sc, m) = k4_head(c);
        BlockQ4K {
            d,
            dmin,
            sc,
            m,
            qs: bytes_at(c, 16),
        }
    })
}

/// Q5_K blocks from raw GGUF bytes (`d`, `dmin`, `scales[12]`, `qh[32]`, `qs[128]`).
pub fn q5k_from_bytes(raw: &[u8]) -> Option<Vec<BlockQ5K>> {
    blocks_from_bytes(raw, |c: &[u8; Q5K_BYTES]| {
        let (d, dmin, sc, m) = k4_head(c);
        BlockQ5K {
            d,
            dmin,
            sc,
            m,
            qh: bytes_at(c, 16),
            qs: bytes_at(c, 48),
        }
    })
}

/// Q6_K blocks from raw GGUF bytes (`ql[128]`, `qh[64]`, `scales[16]`, `d`).
pub fn q6k_from_bytes(raw: &[u8]) -> Option<Vec<BlockQ6K>> {
    blocks_from_bytes(raw, |c: &[u8; Q6K_BYTES]| BlockQ6K {
        d: f16_le(&c[208..]),
        ql: bytes_at(c, 0),
        qh: bytes_at(c, 128),
        scales: bytes_at::<16>(c, 192).map(|b| b as i8),
    })
}

/// The 5-bit value `v` (0..256) of a Q5_K block.
#[inline(always)]
pub(crate) fn q5(b: &BlockQ5K, v: usize) -> u8 {
    let (j, h, l) = (v / 64, (v / 32) % 2, v % 32);
    let lo = if h == 0 {
        b.qs[32 * j + l] & 0xF
    } else {
        b.qs[32 * j + l] >> 4
    };
    lo | (((b.qh[l] >> (2 * j + h)) & 1) << 4)
}

/// The 6-bit value `v` (0..256) of a Q6_K block, before the `- 32`.
#[inline(always)]
pub(crate) fn q6(b: &BlockQ6K, v: usize) -> u8 {
    let (n, c, l) = (v / 128, (v / 32) % 4, v % 32);
    let (ql, qh) = (&b.ql[64 * n..], b.qh[32 * n + l]);
    let lo = match c {
        0 => ql[l] & 0xF,
        1 => ql[32 + l] & 0xF,
        2 => ql[l] >> 4,
        _ => ql[32 + l] >> 4,
    };
    lo | (((qh >> (2 * c)) & 3) << 4)
}

/// ggml's `dequantize_row_q4_K` (the embedding lookup).
impl WeightBlock for BlockQ4K {
    const VALUES: usize = QK_K;
    fn dequant(blocks: &[Self], out: &mut [f32]) {
        for (b, o) in blocks.iter().zip(out.chunks_exact_mut(QK_K)) {
            for s in 0..8 {
                let (d, m) = (b.d * b.sc[s] as f32, b.dmin * b.m[s] as f32);
                let (j, h) = (s / 2, s % 2);
                for l in 0..32 {
                    let q = if h == 0 {
                        b.qs[32 * j + l] & 0xF
                    } else {
                        b.qs[32 * j + l] >> 4
                    };
                    o[32 * s + l] = d * q as f32 - m;
                }
            }
        }
    }
}

/// ggml's `dequantize_row_q5_K`.
impl WeightBlock for BlockQ5K {
    const VALUES: usize = QK_K;
    fn dequant(blocks: &[Self], out: &mut [f32]) {
        for (b, o) in blocks.iter().zip(out.chunks_exact_mut(QK_K)) {
            for s in 0..8 {
                let (d, m) = (b.d * b.sc[s] as f32, b.dmin * b.m[s] as f32);
                for l in 0..32 {
                    o[32 * s + l] = d * q5(b, 32 * s + l) as f32 - m;
                }
            }
        }
    }
}

/// ggml's `dequantize_row_q6_K` (`d * sc * q`, left to right).
impl WeightBlock for BlockQ6K {
    const VALUES: usize = QK_K;
    fn dequant(blocks: &[Self], out: &mut [f32]) {
        for (b, o) in blocks.iter().zip(out.chunks_exact_mut(QK_K)) {
            for (v, x) in o.iter_mut().enumerate() {
                *x = b.d * b.scales[v / 16] as f32 * (q6(b, v) as i32 - 32) as f32;
            }
        }
    }
}

/// ggml's `nearest_int`: round half to even through the 1.5·2^23 trick.
#[inline(always)]
fn nearest_int(f: f32) -> i32 {
    let v = f + 12_582_912.0;
    (v.to_bits() & 0x007f_ffff) as i32 - 0x0040_0000
}

/// Quantises `x` (a multiple of 256 values) to Q8_K exactly like ggml's
/// `quantize_row_q8_K_ref` (which the x86 build uses): the scale comes from
/// the first value of largest magnitude, `iscale = -127 / max`,
/// `d = 1 / iscale`. An all-zero block gets zero sums too (ggml leaves its
/// `bsums` unwritten; they are multiplied by `d = 0` there).
pub fn quantize_q8_k(x: &[f32], out: &mut [BlockQ8K]) {
    debug_assert_eq!(x.len(), out.len() * QK_K);
    for (b, x) in out.iter_mut().zip(x.chunks_exact(QK_K)) {
        let (mut max, mut amax) = (0f32, 0f32);
        for &v in x {
            if v.abs() > amax {
                amax = v.abs();
                max = v;
            }
        }
        if amax == 0.0 {
            *b = BlockQ8K::default();
            continue;
        }
        let iscale = -127.0 / max;
        for (q, &v) in b.qs.iter_mut().zip(x) {
            *q = nearest_int(iscale * v).min(127) as i8;
        }
        for (s, q) in b.bsums.iter_mut().zip(b.qs.chunks_exact(16)) {
            *s = q.iter().map(|&v| v as i16).sum();
        }
        b.d = 1.0 / iscale;
    }
}
