//! A prompt's weight products for the 32-value formats, `N` rows by `T` tokens per step.
//!
//! Q8_0 — and so the Q5_0 matrices, which a prompt's product expands to
//! Q8_0 once per tile — Q4_1 and Q5_1, blocked the way tinyBLAS
//! (llama.cpp's `llamafile/sgemm.cpp`) blocks its registers, so each weight
//! block is loaded and unpacked once for `T` tokens and each activation
//! block once for `N` rows, and the block scales are multiplied as vectors.
//!
//! Every output keeps the one-token kernel's exact arithmetic
//! (`rows`): the same eight int32 lanes of four byte products per
//! block (exact integers however they are summed, so AVX-512 VNNI's
//! `vpdpbusd` gives the same lanes as `vpmaddubsw` + `vpmaddwd`: a pair of
//! byte products lies in [-32768, 32512] for Q8_0's |w| and within
//! ±2·31·128 for the unsigned formats, inside the int16 at which
//! `vpmaddubsw` would saturate), one fma per block with the f32 product of
//! the two scales, blocks in order, `hsum_float_8`, then the minimum term
//! in its own scalar chain.
//! Measured on the Q4_K_M requantisation of SmolLM2-135M (most of its
//! matrices are Q5_0): see docs/PERFORMANCE.md, "Model host and Generate".

use std::arch::x86_64::*;

use crate::ggml::reduce::hsum;
use crate::quant::format::block::Block32;
use crate::quant::format::q4_1::BlockQ4_1;
use crate::quant::format::q5_1::BlockQ5_1;
use crate::quant::format::q8::{BlockQ8_0, BlockQ8_1};
use crate::quant::kernels::avx2::rows::{
    bytes_from_bits_32, nibbles_32, prefetch_ahead, token_major,
};

/// A 32-value block as `vpmaddubsw` / `vpdpbusd` take it: unsigned bytes,
/// with the signs (Q8_0) moved to the activations.
pub(crate) trait Unsigned32: Block32 {
    /// Signed values (Q8_0): with VNNI the tile multiplies them as they are
    /// by the activations offset by 128 (`vpdpbusd` takes unsigned times
    /// signed) and starts each lane at `−128·Σw` — the same integer, one
    /// `vpsignb` less per product.
    const SIGNED: bool = false;
    /// The values as stored (the signed formats).
    unsafe fn raw(&self) -> __m256i {
        unreachable!("only the signed formats are read raw")
    }
    /// The unsigned bytes.
    unsafe fn unsigned(&self) -> __m256i;
    /// The activation quants `qy` with this block's signs applied (ggml's
    /// `mul_sum_i8_pairs`), or as they are (the unsigned formats).
    unsafe fn signed(&self, qy: __m256i) -> __m256i;
}

impl Unsigned32 for BlockQ8_0 {
    const SIGNED: bool = true;
    #[inline(always)]
    unsafe fn raw(&self) -> __m256i {
        // SAFETY: avx2 enabled by the callers; the 32-byte load is `self.qs`.
        unsafe { _mm256_loadu_si256(self.qs.as_ptr() as *const __m256i) }
    }
    #[inline(always)]
    unsafe fn unsigned(&self) -> __m256i {
        // SAFETY: avx2 enabled by the callers; the 32-byte load is `self.qs`.
        unsafe {
            let q = _mm256_loadu_si256(self.qs.as_ptr() as *const __m256i);
            _mm256_sign_epi8(q, q)
        }
    }
    #[inline(always)]
    unsafe fn signed(&self, qy: __m256i) -> __m256i {
        // SAFETY: as above.
        unsafe { _mm256_sign_epi8(qy, _mm256_loadu_si256(self.qs.as_ptr() as *const __m256i)) }
    }
}

impl Unsigned32 for BlockQ4_1 {
    #[inline(always)]
    unsafe fn unsigned(&self) -> __m256i {
        // SAFETY: avx2 enabled by the callers.
        unsafe { nibbles_32(&self.qs) }
    }
    #[inline(always)]
    unsafe fn signed(&self, qy: __m256i) -> __m256i {
        qy
    }
}

impl Unsigned32 for BlockQ5_1 {
    #[inline(always)]
    unsafe fn unsigned(&self) -> __m256i {
        // SAFETY: avx2 enabled by the callers.
        unsafe {
            let hi = _mm256_and_si256(bytes_from_bits_32(self.qh), _mm256_set1_epi8(0x10));
            _mm256_or_si256(nibbles_32(&self.qs), hi)
        }
    }
    #[inline(always)]
    unsafe fn signed(&self, qy: __m256i) -> __m256i {
        qy
    }
}

/// The eight int32 lanes of `u · s` (four byte products each), as floats.
#[inline(always)]
unsafe fn lanes<const VNNI: bool>(u: __m256i, s: __m256i) -> __m256 {
    // SAFETY: avx2 (and, for VNNI, avx512vnni + avx512vl) enabled by the
    // callers.
    unsafe {
        let i = if VNNI {
            _mm256_dpbusd_epi32(_mm256_setzero_si256(), u, s)
        } else {
            _mm256_madd_epi16(_mm256_maddubs_epi16(u, s), _mm256_set1_epi16(1))
        };
        _mm256_cvtepi32_ps(i)
    }
}

/// Whether this CPU has AVX-512 VNNI with VL (the `vpdpbusd` build).
pub(crate) fn has_vnni() -> bool {
    let f = samplerd_numerics::features();
    f.avx512vnni() && f.avx512vl()
}

/// `out[t·R + r] = W[r] · a_t` for the `R = out.len() / n_tok` rows of `w`
/// and the `n_tok` tokens whose blocks follow one another in `a`.
pub(crate) fn tokens_safe<B: Unsigned32, const N: usize, const T: usize>(
    w: &[B],
    a: &[BlockQ8_1],
    n_tok: usize,
    out: &mut [f32],
) {
    // SAFETY: installed in `quant::kernels()` (and called by the tests) only
    // after `samplerd_numerics::features()` reported AVX2 and FMA; the VNNI
    // build only where `has_vnni()`.
    unsafe {
        if has_vnni() {
            tokens_vnni::<B, N, T>(w, a, n_tok, out)
        } else {
            tokens_avx2::<B, N, T, false>(w, a, n_tok, out)
        }
    }
}

/// [`tokens_safe`] without VNNI on every CPU (the tests check both builds).
#[cfg(test)]
pub(crate) fn tokens_no_vnni<B: Unsigned32, const N: usize, const T: usize>(
    w: &[B],
    a: &[BlockQ8_1],
    n_tok: usize,
    out: &mut [f32],
) {
    // SAFETY: the tests call this only where the AVX2 kernels are installed.
    unsafe { tokens_avx2::<B, N, T, false>(w, a, n_tok, out) }
}

#[target_feature(enable = "avx2,fma")]
unsafe fn tokens_avx2<B: Unsigned32, const N: usize, const T: usize, const VNNI: bool>(
    w: &[B],
    a: &[BlockQ8_1],
    n_tok: usize,
    out: &mut [f32],
) {
    // SAFETY: avx2 and fma are enabled here; `VNNI` is false.
    unsafe { tokens::<B, N, T, VNNI>(w, a, n_tok, out) }
}

/// The VNNI build: also 32 vector registers, so `N × T` accumulators fit.
#[target_feature(enable = "avx2,fma,avx512f,avx512vl,avx512vnni")]
unsafe fn tokens_vnni<B: Unsigned32, const N: usize, const T: usize>(
    w: &[B],
    a: &[BlockQ8_1],
    n_tok: usize,
    out: &mut [f32],
) {
    // SAFETY: every feature the VNNI path needs is enabled here.
    unsafe { tokens::<B, N, T, true>(w, a, n_tok, out) }
}

#[inline(always)]
unsafe fn tokens<B: Unsigned32, const N: usize, const T: usize, const VNNI: bool>(
    w: &[B],
    a: &[BlockQ8_1],
    n_tok: usize,
    out: &mut [f32],
) {
    let (nb, n_rows) = token_major(n_tok, a.len(), out.len(), w.len());
    let mut t = 0;
    while t < n_tok {
        let nt = (n_tok - t).min(T);
        let mut r = 0;
        while r < n_rows {
            let nr = (n_rows - r).min(N);
            let w = &w[r * nb..(r + nr) * nb];
            let a = &a[t * nb..(t + nt) * nb];
            // SAFETY: the features `VNNI` needs are enabled by the callers;
            // `w` holds `nr` rows and `a` `nt` tokens of `nb` blocks.
            let o = unsafe {
                match (nr == N, nt == T) {
                    (true, true) => tile::<B, N, T, VNNI>(w, a, nb),
                    _ => tile_dyn::<B, N, T, VNNI>(w, a, nb, nr, nt),
                }
            };
            for (i, oi) in o.iter().enumerate().take(nt) {
                let at = (t + i) * n_rows + r;
                out[at..at + nr].copy_from_slice(&oi[..nr]);
            }
            r += nr;
        }
        t += nt;
    }
}

/// A partial tile (fewer rows or tokens than `N × T`), one row by one
/// token at a time, same arithmetic.
#[inline(always)]
unsafe fn tile_dyn<B: Unsigned32, const N: usize, const T: usize, const VNNI: bool>(
    w: &[B],
    a: &[BlockQ8_1],
    nb: usize,
    nr: usize,
    nt: usize,
) -> [[f32; N]; T] {
    let mut o = [[0f32; N]; T];
    for (i, oi) in o.iter_mut().enumerate().take(nt) {
        for (q, oq) in oi.iter_mut().enumerate().take(nr) {
            // SAFETY: as in `tokens`.
            let [[v]] = unsafe {
                tile::<B, 1, 1, VNNI>(&w[q * nb..(q + 1) * nb], &a[i * nb..(i + 1) * nb], nb)
            };
            *oq = v;
        }
    }
    o
}

/// `N` rows (`w`, `nb` blocks each) times `T` tokens (`a`), `o[t][q]`.
#[inline(always)]
unsafe fn tile<B: Unsigned32, const N: usize, const T: usize, const VNNI: bool>(
    w: &[B],
    a: &[BlockQ8_1],
    nb: usize,
) -> [[f32; N]; T] {
    // SAFETY: (the whole body) the callers enable avx2 and fma (and the VNNI
    // features when `VNNI`); `w` holds `N × nb` blocks and `a` `T × nb`.
    unsafe {
        let mut acc = [[_mm256_setzero_ps(); N]; T];
        let mut summs = [[0f32; N]; T];
        // The tile's rows are contiguous; each step consumes `step` of them.
        let step = N * std::mem::size_of::<B>();
        for i in 0..nb {
            prefetch_ahead(w.as_ptr().cast(), i * step, step);
            let wb: [&B; N] = std::array::from_fn(|q| w.get_unchecked(q * nb + i));
            let ab: [&BlockQ8_1; T] = std::array::from_fn(|t| a.get_unchecked(t * nb + i));
            let wd: [__m256; N] = std::array::from_fn(|q| _mm256_set1_ps(wb[q].d()));
            if VNNI && B::SIGNED {
                // Σ qy·w = Σ (qy + 128)·w − 128·Σw, all exact in int32.
                let x80 = _mm256_set1_epi8(0x80u8 as i8);
                let raw: [__m256i; N] = std::array::from_fn(|q| wb[q].raw());
                let start: [__m256i; N] = std::array::from_fn(|q| {
                    let c = _mm256_dpbusd_epi32(_mm256_setzero_si256(), x80, raw[q]);
                    _mm256_sub_epi32(_mm256_setzero_si256(), c)
                });
                for t in 0..T {
                    let qy = _mm256_loadu_si256(ab[t].qs.as_ptr() as *const __m256i);
                    let ux = _mm256_xor_si256(qy, x80);
                    let ad = _mm256_set1_ps(ab[t].d);
                    for q in 0..N {
                        let l = _mm256_cvtepi32_ps(_mm256_dpbusd_epi32(start[q], ux, raw[q]));
                        acc[t][q] = _mm256_fmadd_ps(_mm256_mul_ps(wd[q], ad), l, acc[t][q]);
                    }
                }
                continue;
            }
            let u: [__m256i; N] = std::array::from_fn(|q| wb[q].unsigned());
            for t in 0..T {
                let qy = _mm256_loadu_si256(ab[t].qs.as_ptr() as *const __m256i);
                let ad = _mm256_set1_ps(ab[t].d);
                for q in 0..N {
                    if B::MIN {
                        summs[t][q] += wb[q].m() * ab[t].s;
                    }
                    let l = lanes::<VNNI>(u[q], wb[q].signed(qy));
                    acc[t][q] = _mm256_fmadd_ps(_mm256_mul_ps(wd[q], ad), l, acc[t][q]);
                }
            }
        }
        let mut o = [[0f32; N]; T];
        for t in 0..T {
            for q in 0..N {
                let v = hsum(acc[t][q]);
                o[t][q] = if B::MIN { v + summs[t][q] } else { v };
            }
        }
        o
    }
}
