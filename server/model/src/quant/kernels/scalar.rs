//! The portable kernels: the AVX2 ones' arithmetic lane by lane, and the reference for them.
//!
//! The 32-value formats ([`dot`]): eight int32 lanes of four products each,
//! one fma per lane and block, `hsum_float_8`, then the minimum term.
//!
//! The K-quants: `ggml_vec_dot_q{4,5,6}_K_q8_K` (AVX2) sums integer products
//! per sub-block scale in eight int32 lanes, one `fma(d, lanes, acc)` per
//! super-block, `hsum_float_8` at the end, plus the minimum term (Q4_K: four
//! f32 lanes of `fma(dmin, ...)`; Q5_K: one scalar fma chain, as GCC
//! contracts `summs += dmin * s`). Integer sums are exact in any order, but
//! how they are split over the eight lanes is not free (each lane is
//! converted and accumulated on its own): Q6_K's lanes carry ggml's
//! `32·madd(bsums, scales)` correction, see `q6k_lanes`. The functions
//! below compute the same lanes and repeat ggml's float operations one by
//! one; they equal the AVX2 kernels (`avx2::kquant`) bit for bit, and
//! `tests/kquant_parity.py` checks both against llama.cpp's own kernels.
//! ggml has no AVX-512 variant of these three products, so the flavour
//! (`model.numerics`) plays no part in them.
//!
//! For batches of 8 or more rows ggml takes another path, its tiled matmul
//! (`ggml-cpu/tiled`): whole-super-block int32 sums and
//! `acc += (d·s1 − dmin·s2)·d8` per block (`tiled_step`). Which one ran
//! changes the last bits, so `Acts::tiled` says per row which to mirror:
//! the tiled one for the rows of a sequence's step of 8+ tokens (a prompt),
//! the vector dot otherwise — each row's arithmetic still depends only on
//! its own sequence's step, never on what else is batched with it. The
//! tiled float epilogue is one fma in both of ggml's microkernels as built
//! (`tiled_step` says why), so the build plays no part in it either.

use crate::ggml::reduce::hsum8;
use crate::quant::format::block::Block32;
use crate::quant::format::kquant::{BlockQ4K, BlockQ5K, BlockQ6K, BlockQ8K, q5, q6};
use crate::quant::format::q8::BlockQ8_1;

/// `out[r] = dot(W[r], a)` for every row of `w` (`a.len()` blocks a row).
#[inline(always)]
pub fn each_row<W, A>(w: &[W], a: &[A], out: &mut [f32], dot: impl Fn(&[W], &[A]) -> f32) {
    for (o, row) in out.iter_mut().zip(w.chunks_exact(a.len())) {
        *o = dot(row, a);
    }
}

/// A 32-value format's product ([`Block32`]): eight int32 lanes of
/// four products each, one fma per lane and block, `hsum_float_8`, then
/// the minimum term.
pub fn dot<B: Block32>(w: &[B], a: &[BlockQ8_1]) -> f32 {
    let mut acc = [0f32; 8];
    let mut summs = 0f32;
    for (w, a) in w.iter().zip(a) {
        if B::MIN {
            summs += w.m() * a.s;
        }
        let d = w.d() * a.d;
        let q = w.values();
        for (l, acc) in acc.iter_mut().enumerate() {
            let s: i32 = (4 * l..4 * l + 4)
                .map(|j| q[j] as i32 * a.qs[j] as i32)
                .sum();
            *acc = d.mul_add(s as f32, *acc);
        }
    }
    let v = hsum8(&acc);
    if B::MIN { v + summs } else { v }
}

pub fn rows<B: Block32>(w: &[B], a: &[BlockQ8_1], out: &mut [f32]) {
    each_row(w, a, out, dot)
}

/// [`each_row`] for each of `n_tok` tokens (`a` and `out` token-major).
pub fn each_token<W, A>(
    w: &[W],
    a: &[A],
    n_tok: usize,
    out: &mut [f32],
    dot: impl Fn(&[W], &[A]) -> f32 + Copy,
) {
    let (nb, n_rows) = (a.len() / n_tok, out.len() / n_tok);
    for (a, out) in a.chunks_exact(nb).zip(out.chunks_exact_mut(n_rows)) {
        each_row(w, a, out, dot);
    }
}

/// [`rows`] for each of `n_tok` tokens (`a` and `out` token-major).
pub fn rows_tokens<B: Block32>(w: &[B], a: &[BlockQ8_1], n_tok: usize, out: &mut [f32]) {
    let (nb, n_rows) = (a.len() / n_tok, out.len() / n_tok);
    for (a, out) in a.chunks_exact(nb).zip(out.chunks_exact_mut(n_rows)) {
        rows(w, a, out);
    }
}

// The K-quant products (Q4_K, Q5_K, Q6_K against Q8_K): the same eight
// int32 lanes as the AVX2 kernels (lane `l` sums the values whose index
// within their 32-value chunk is in `4l..4l + 4`) and the same float
// operations in the same order.

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
