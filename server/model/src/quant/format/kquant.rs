//! K-quant weights (Q4_K, Q5_K, Q6_K: 256-value super-blocks) and their
//! activation format Q8_K, kept natively so a Q4_K_M file costs what it
//! costs on disk and its products are the ones llama.cpp's CPU backend
//! computes.
//!
//! For these weight types ggml quantises the activations to Q8_K
//! (`quantize_row_q8_K_ref`: one f32 scale per 256 values, `-127/max`, and
//! per-16 sums for the minimum terms), then `ggml_vec_dot_q{4,5,6}_K_q8_K`
//! (AVX2) sums integer products per sub-block scale in eight int32 lanes, one
//! `fma(d, lanes, acc)` per super-block, `hsum_float_8` at the end, plus the
//! minimum term (Q4_K: four f32 lanes of `fma(dmin, ...)`; Q5_K: one scalar
//! fma chain, as GCC contracts `summs += dmin * s`). Integer sums are exact
//! in any order, but how they are split over the eight lanes is not free
//! (each lane is converted and accumulated on its own): Q6_K's lanes carry
//! ggml's `32·madd(bsums, scales)` correction, see `scalar::q6k_lanes`.
//! The scalar reference below computes the same lanes and repeats ggml's
//! float operations one by one; it equals the AVX2 kernels
//! (`quant_k_avx2.rs`) bit for bit, and `tests/kquant_parity.py` checks
//! both against llama.cpp's own kernels. ggml has no AVX-512 variant of
//! these three products, so [`crate::ggml::flavor`] plays no part in them.
//!
//! For batches of 8 or more rows ggml takes another path, its tiled matmul
//! (`ggml-cpu/tiled`): whole-super-block int32 sums and
//! `acc += (d·s1 − dmin·s2)·d8` per block (`scalar::tiled_step`). Which one
//! ran changes the last bits, so [`crate::quant::Acts::tiled`] says per row
//! which to mirror: the tiled one for the rows of a sequence's step of 8+
//! tokens (a prompt), the vector dot otherwise — each row's arithmetic
//! still depends only on its own sequence's step, never on what else is
//! batched with it. The tiled float epilogue is one fma in both of ggml's
//! microkernels as built (`scalar::tiled_step` says why), so the build
//! (`model.numerics`) plays no part in it either.
//!
//! The f16 scales are widened to f32 at load (exact) and the 6-bit packed
//! sub-block scales/minimums of Q4_K/Q5_K unpacked (`get_scale_min_k4`), so a
//! Q4_K/Q5_K block is 8 bytes larger than ggml's and a Q6_K block 2; the
//! quants stay as stored.

use crate::quant::{WeightBlock, blocks_from_bytes, bytes_at, f16_le};

/// Values per super-block.
pub const QK_K: usize = 256;

/// The smallest batch for which ggml takes its tiled K-quant matmul
/// (`ggml_tiled_min_batch`).
pub const TILED_MIN_ROWS: usize = 8;

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
fn q5(b: &BlockQ5K, v: usize) -> u8 {
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
fn q6(b: &BlockQ6K, v: usize) -> u8 {
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

/// Portable K-quant products, the reference the AVX2 kernels are tested
/// against: the same eight int32 lanes (lane `l` sums the values whose index
/// within their 32-value chunk is in `4l..4l + 4`) and the same float
/// operations in the same order.
pub mod scalar {
    use super::*;
    use crate::ggml::reduce::hsum8;

    /// `madd(mins, hadd(bsums))`: per pair of sub-blocks,
    /// `m[2k]·Σ32 + m[2k+1]·Σ32` (ggml adds the 16-value sums in i16; they
    /// cannot overflow).
    #[inline(always)]
    pub(crate) fn min_prods(m: &[u8; 8], a: &BlockQ8K) -> [i32; 4] {
        let s = |i: usize| (a.bsums[2 * i] + a.bsums[2 * i + 1]) as i32;
        std::array::from_fn(|k| m[2 * k] as i32 * s(2 * k) + m[2 * k + 1] as i32 * s(2 * k + 1))
    }

    /// The eight int32 lanes of one Q4_K block times one Q8_K block.
    #[inline(always)]
    pub(crate) fn q4k_lanes(w: &BlockQ4K, a: &BlockQ8K) -> [i32; 8] {
        let mut lanes = [0i32; 8];
        for j in 0..4 {
            let (sl, sh) = (w.sc[2 * j] as i32, w.sc[2 * j + 1] as i32);
            let (q, y) = (&w.qs[32 * j..32 * j + 32], &a.qs[64 * j..64 * j + 64]);
            for (l, lane) in lanes.iter_mut().enumerate() {
                let (mut lo, mut hi) = (0i32, 0i32);
                for e in 4 * l..4 * l + 4 {
                    lo += (q[e] & 0xF) as i32 * y[e] as i32;
                    hi += (q[e] >> 4) as i32 * y[32 + e] as i32;
                }
                *lane += sl * lo + sh * hi;
            }
        }
        lanes
    }

    #[inline(always)]
    pub(crate) fn q5k_lanes(w: &BlockQ5K, a: &BlockQ8K) -> [i32; 8] {
        let mut lanes = [0i32; 8];
        for c in 0..8 {
            let s = w.sc[c] as i32;
            for (l, lane) in lanes.iter_mut().enumerate() {
                let mut t = 0i32;
                for e in 4 * l..4 * l + 4 {
                    t += q5(w, 32 * c + e) as i32 * a.qs[32 * c + e] as i32;
                }
                *lane += s * t;
            }
        }
        lanes
    }

    /// Q6_K's lanes as ggml's AVX2 kernel forms them: the products of the
    /// unsigned 6-bit values, minus the `32·Σ scale·bsum` correction, which
    /// `madd(bsums, scales)` spreads over the lanes differently (lane `l`
    /// takes sub-blocks `2l` and `2l + 1`), so the lanes differ from those of
    /// `(q − 32)` products even though their sum does not.
    #[inline(always)]
    pub(crate) fn q6k_lanes(w: &BlockQ6K, a: &BlockQ8K) -> [i32; 8] {
        let mut lanes = [0i32; 8];
        for c in 0..8 {
            for (l, lane) in lanes.iter_mut().enumerate() {
                for e in 4 * l..4 * l + 4 {
                    let v = 32 * c + e;
                    *lane += w.scales[v / 16] as i32 * q6(w, v) as i32 * a.qs[v] as i32;
                }
            }
        }
        for (l, lane) in lanes.iter_mut().enumerate() {
            let corr = w.scales[2 * l] as i32 * a.bsums[2 * l] as i32
                + w.scales[2 * l + 1] as i32 * a.bsums[2 * l + 1] as i32;
            *lane -= corr << 5;
        }
        lanes
    }

    /// `ggml_vec_dot_q4_K_q8_K` (AVX2 order).
    pub fn dot_q4k(w: &[BlockQ4K], a: &[BlockQ8K]) -> f32 {
        let mut acc = [0f32; 8];
        let mut acc_m = [0f32; 4];
        for (w, a) in w.iter().zip(a) {
            let d = a.d * w.d;
            let dmin = -a.d * w.dmin;
            let p = min_prods(&w.m, a);
            for k in 0..4 {
                acc_m[k] = dmin.mul_add(p[k] as f32, acc_m[k]);
            }
            let lanes = q4k_lanes(w, a);
            for l in 0..8 {
                acc[l] = d.mul_add(lanes[l] as f32, acc[l]);
            }
        }
        hsum8(&acc) + ((acc_m[0] + acc_m[2]) + (acc_m[1] + acc_m[3]))
    }

    /// `ggml_vec_dot_q5_K_q8_K` (AVX2 order: the minimum term is one scalar
    /// sum, `summs = fma(dmin, Σ prods, summs)`).
    pub fn dot_q5k(w: &[BlockQ5K], a: &[BlockQ8K]) -> f32 {
        let mut acc = [0f32; 8];
        let mut summs = 0f32;
        for (w, a) in w.iter().zip(a) {
            let d = a.d * w.d;
            let dmin = -a.d * w.dmin;
            let p = min_prods(&w.m, a);
            // GCC contracts ggml's `summs += dmin * s` into one fma.
            summs = dmin.mul_add((p[0] + p[1] + p[2] + p[3]) as f32, summs);
            let lanes = q5k_lanes(w, a);
            for l in 0..8 {
                acc[l] = d.mul_add(lanes[l] as f32, acc[l]);
            }
        }
        hsum8(&acc) + summs
    }

    /// `ggml_vec_dot_q6_K_q8_K` (AVX2 order; the `- 32` is folded into the
    /// integer lanes, see `q6k_lanes`, so there is no minimum term).
    pub fn dot_q6k(w: &[BlockQ6K], a: &[BlockQ8K]) -> f32 {
        let mut acc = [0f32; 8];
        for (w, a) in w.iter().zip(a) {
            let d = a.d * w.d;
            let lanes = q6k_lanes(w, a);
            for l in 0..8 {
                acc[l] = d.mul_add(lanes[l] as f32, acc[l]);
            }
        }
        hsum8(&acc)
    }

    /// One super-block's step of ggml's tiled K-quant matmul
    /// (`tiled_run_microtile`, the path ggml takes for batches of 8 or more
    /// rows): whole-block integer sums `s1` (scaled quants) and `s2`
    /// (scaled minimums), then `res = d·s1 − dmin·s2` (fnmadd) and
    /// `acc += res·d8` as one fma. One fma in both of ggml's microkernels:
    /// the AVX2 one writes `_mm256_fmadd_ps`; the AVX-512 VNNI one writes a
    /// multiply and an add, which GCC (llama.cpp's compiler, whose GNU mode
    /// contracts by default) turns into the same fma — measured: every
    /// product of 8 to 40 tokens by 64 Q4_K, Q5_K and Q6_K rows equal to
    /// an AVX-512 VNNI build's bit for bit with the fma, half of them off by
    /// an ulp or more without it.
    #[inline(always)]
    pub(crate) fn tiled_step(s1: i32, s2: i32, d: f32, dmin: f32, d8: f32, acc: f32) -> f32 {
        let res = (-dmin).mul_add(s2 as f32, d * s1 as f32);
        res.mul_add(d8, acc)
    }

    pub fn tiled_q4k(w: &[BlockQ4K], a: &[BlockQ8K]) -> f32 {
        w.iter().zip(a).fold(0f32, |acc, (w, a)| {
            let s1 = q4k_lanes(w, a).iter().sum();
            let s2 = min_prods(&w.m, a).iter().sum();
            tiled_step(s1, s2, w.d, w.dmin, a.d, acc)
        })
    }

    pub fn tiled_q5k(w: &[BlockQ5K], a: &[BlockQ8K]) -> f32 {
        w.iter().zip(a).fold(0f32, |acc, (w, a)| {
            let s1 = q5k_lanes(w, a).iter().sum();
            let s2 = min_prods(&w.m, a).iter().sum();
            tiled_step(s1, s2, w.d, w.dmin, a.d, acc)
        })
    }

    pub fn tiled_q6k(w: &[BlockQ6K], a: &[BlockQ8K]) -> f32 {
        w.iter().zip(a).fold(0f32, |acc, (w, a)| {
            let s1 = q6k_lanes(w, a).iter().sum();
            tiled_step(s1, 0, w.d, 0.0, a.d, acc)
        })
    }
}
