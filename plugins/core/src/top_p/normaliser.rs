//! The normaliser pass: llama.cpp's `Z = Σ expf(l - max)`, bit-exact, in
//! one vectorised pass that also gathers the tokens above the floor (the
//! only ones the walk looks at). Portable, AVX2 and AVX-512 builds.

use super::exp::{EXP_REL_ERR, libm_exp};
use super::grid_sum::{BLOCK, Block, F32Sum};
use super::shared::Gathered;
#[cfg(target_arch = "x86_64")]
use super::shared::has_avx512;
use crate::util::exp_f32;

/// llama.cpp's normaliser `Σ expf(x[i] - max)`, summed in f32 in index
/// order, bit-exact. Also replaces `g` with the tokens whose logit is
/// `>= floor` (ascending positions) and returns, second, an estimate of
/// their share of the sum (`Σ exp(x[i] - max)` over them, within a few
/// ulp: it only decides whether the floor is low enough).
pub(super) fn softmax_sum_and_gather(
    x: &[f32],
    max: f32,
    floor: f32,
    g: &mut Gathered,
) -> (f32, f32) {
    g.clear();
    #[cfg(target_arch = "x86_64")]
    if has_avx512() {
        // SAFETY: the CPU supports AVX-512F and POPCNT (checked just above).
        return unsafe { avx512::softmax_sum(x, max, floor, g) };
    }
    #[cfg(target_arch = "x86_64")]
    if samplerd_numerics::features().avx2() {
        // SAFETY: the CPU supports AVX2 (checked just above).
        return unsafe { softmax_sum_avx2(x, max, floor, g) };
    }
    softmax_sum_impl(x, max, floor, g)
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
unsafe fn softmax_sum_avx2(x: &[f32], max: f32, floor: f32, g: &mut Gathered) -> (f32, f32) {
    softmax_sum_impl(x, max, floor, g)
}

/// The portable normaliser pass (LLVM vectorises the exp and rounding;
/// the gather is scalar).
#[inline(always)]
pub(super) fn softmax_sum_impl(x: &[f32], max: f32, floor: f32, g: &mut Gathered) -> (f32, f32) {
    let mut s = F32Sum::new();
    let mut b = Block::default();
    let mut a = [0.0f32; BLOCK];
    let mut mass = 0.0f32;
    for (ci, c) in x.chunks(BLOCK).enumerate() {
        let n = c.len();
        let base = ci * BLOCK;
        s.add_block_portable(c, base, max, floor, &mut a, &mut b, g, &mut mass);
        let _ = n;
    }
    (s.value(), mass)
}

impl F32Sum {
    /// One block of the normaliser pass, any length up to BLOCK, portable.
    #[allow(clippy::too_many_arguments)]
    #[inline(always)]
    pub(super) fn add_block_portable(
        &mut self,
        c: &[f32],
        base: usize,
        max: f32,
        floor: f32,
        a: &mut [f32; BLOCK],
        b: &mut Block,
        g: &mut Gathered,
        mass: &mut f32,
    ) {
        let n = c.len();
        if let Ok(full) = <&[f32; BLOCK]>::try_from(c) {
            for j in 0..BLOCK {
                a[j] = exp_f32(full[j] - max);
            }
            let mut m = crate::util::ge_mask(full, floor);
            while m != 0 {
                let j = m.trailing_zeros() as usize;
                g.push((base + j) as u32, full[j]);
                *mass += a[j];
                m &= m - 1;
            }
        } else {
            *a = [0.0; BLOCK];
            for j in 0..n {
                a[j] = exp_f32(c[j] - max);
                if c[j] >= floor {
                    g.push((base + j) as u32, c[j]);
                    *mass += a[j];
                }
            }
        }
        self.add_block(a, n, EXP_REL_ERR, b, |j| libm_exp(c[j] - max));
    }
}

/// The normaliser pass with AVX-512 intrinsics: the same `exp_f32`
/// operations in the same order (bit-identical lanes), the grid rounding of
/// [`F32Sum::add_block`] on four registers at a time, and the gather as
/// compress-stores. Blocks that leave the fast path (a lane near a rounding
/// boundary, a binade crossing, a sum off the grid) go through
/// `add_block` with the lanes already computed.
#[cfg(target_arch = "x86_64")]
mod avx512 {
    use std::arch::x86_64::*;

    use crate::top_p::exp::{EXP_REL_ERR, exp_div, exp16x4, libm_exp};
    use crate::top_p::grid_sum::{BLOCK, Block, F32Sum, LIMIT, MAGIC, MAGIC_BITS, exact_units};
    use crate::top_p::shared::Gathered;

    /// A block off the fast path (kept out of line, so that the hot loop
    /// keeps its registers: the libm calls would clobber them all).
    #[cold]
    #[inline(never)]
    fn add_block_slow(s: &mut F32Sum, a: &[f32; BLOCK], c: &[f32], max: f32, b: &mut Block) {
        s.add_block(a, BLOCK, EXP_REL_ERR, b, |j| libm_exp(c[j] - max));
    }

    /// A block sum `sum` of grid units with the `bad` lanes settled by
    /// libm's exact value (`t_bits[j]` holds `MAGIC_BITS + ` lane j's
    /// approximate units), as [`F32Sum::resolve`] does; None if one is a
    /// tie (which needs the order).
    #[cold]
    #[inline(never)]
    fn resolve_lanes(
        inv: f32,
        t_bits: &[u32; BLOCK],
        mut bad: u64,
        c: &[f32],
        max: f32,
        mut sum: u32,
    ) -> Option<u32> {
        while bad != 0 {
            let j = bad.trailing_zeros() as usize;
            bad &= bad - 1;
            let r = exact_units(libm_exp(c[j] - max) * inv)?;
            sum = sum - (t_bits[j] - MAGIC_BITS) + r;
        }
        Some(sum)
    }

    #[target_feature(enable = "avx512f,popcnt")]
    pub(super) unsafe fn softmax_sum(
        x: &[f32],
        max: f32,
        floor: f32,
        g: &mut Gathered,
    ) -> (f32, f32) {
        let n = x.len();
        g.idx.reserve(n + 16);
        g.val.reserve(n + 16);
        let idx_out = g.idx.as_mut_ptr();
        let val_out = g.val.as_mut_ptr();
        let mut got = 0usize;
        let mut s = F32Sum::new();
        let mut b = Block::default();
        let mut a = [0.0f32; BLOCK];
        let full = n / BLOCK;
        let vmax = _mm512_set1_ps(max);
        let vfloor = _mm512_set1_ps(floor);
        let magic = _mm512_set1_ps(MAGIC);
        // 1 ∓ EXP_REL_ERR (exact in f32)
        let below = _mm512_set1_ps(1.0 - EXP_REL_ERR);
        let above = _mm512_set1_ps(1.0 + EXP_REL_ERR);
        // positions of the next 16 lanes
        let mut ids = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
        let sixteen = _mm512_set1_epi32(16);
        for blk in 0..full {
            let base = blk * BLOCK;
            // SAFETY: base + BLOCK <= full * BLOCK <= n: the loads are in
            // bounds; the gather writes 16 lanes at `got`, and `got` stays
            // below the number of positions seen (<= n), inside the
            // reserved n + 16.
            let e = unsafe {
                let v: [__m512; 4] =
                    std::array::from_fn(|k| _mm512_loadu_ps(x.as_ptr().add(base + 16 * k)));
                let e = exp16x4(v.map(|v| _mm512_sub_ps(v, vmax)));
                for &vk in &v {
                    let m = _mm512_cmp_ps_mask::<_CMP_GE_OQ>(vk, vfloor);
                    // compress in a register and store all 16 lanes (the
                    // memory form of the compress is several times slower);
                    // the capacity has 16 entries of slack
                    _mm512_storeu_si512(
                        idx_out.add(got).cast(),
                        _mm512_maskz_compress_epi32(m, ids),
                    );
                    _mm512_storeu_ps(val_out.add(got).cast(), _mm512_maskz_compress_ps(m, vk));
                    got += m.count_ones() as usize;
                    ids = _mm512_add_epi32(ids, sixteen);
                }
                e
            };
            if s.on_grid {
                let inv = _mm512_set1_ps(s.inv);
                // the bits of `q + MAGIC` are `MAGIC_BITS + round(q)`: sum
                // them, subtract the 64 offsets once
                let mut tsum = _mm512_setzero_si512();
                let mut ts = [_mm512_setzero_ps(); 4];
                let mut bad = [0u16; 4];
                // from the binade [2, 4) on, q = e·inv < 2^23 as e <= 1
                // (plus a few ulp): the clamp is only needed below
                let clamp = s.exp < 1;
                for k in 0..4 {
                    let q = _mm512_mul_ps(e[k], inv);
                    let q = if clamp { _mm512_min_ps(q, magic) } else { q };
                    // The exact value lies within q·(1 ± err), err =
                    // EXP_REL_ERR (the exp; the scaling is exact): if both
                    // ends of that round to the same integer, so does it,
                    // and it is no tie (a tie inside would send the ends
                    // apart). Each fused add rounds the exact product once:
                    // `MAGIC + round(q·c)`.
                    let t = _mm512_fmadd_ps(q, below, magic);
                    let t_hi = _mm512_fmadd_ps(q, above, magic);
                    bad[k] = _mm512_cmp_ps_mask::<_CMP_NEQ_UQ>(t, t_hi);
                    tsum = _mm512_add_epi32(tsum, _mm512_castps_si512(t));
                    ts[k] = t;
                }
                let mut sum = Some(
                    (_mm512_reduce_add_epi32(tsum) as u32)
                        .wrapping_sub((BLOCK as u32).wrapping_mul(MAGIC_BITS)),
                );
                if bad != [0; 4] {
                    // a few lanes near a rounding boundary: libm decides
                    let mut tb = [0u32; BLOCK];
                    for (k, t) in ts.iter().enumerate() {
                        // SAFETY: 16 u32 into tb[16k..16k + 16].
                        unsafe { _mm512_storeu_ps(tb.as_mut_ptr().add(16 * k).cast(), *t) };
                    }
                    let bad64 = bad
                        .iter()
                        .enumerate()
                        .fold(0u64, |m, (k, &b)| m | (b as u64) << (16 * k));
                    let c = &x[base..base + BLOCK];
                    sum = sum.and_then(|sum| resolve_lanes(s.inv, &tb, bad64, c, max, sum));
                }
                if let Some(sum) = sum
                    && s.units + sum < LIMIT
                {
                    s.units += sum;
                    continue;
                }
            }
            for (k, &ek) in e.iter().enumerate() {
                // SAFETY: 16 floats into a[16k..16k + 16], k < BLOCK / 16.
                unsafe { _mm512_storeu_ps(a.as_mut_ptr().add(16 * k), ek) };
            }
            add_block_slow(&mut s, &a, &x[base..base + BLOCK], max, &mut b);
        }
        // SAFETY: `got` entries were written into the reserved capacity.
        unsafe {
            g.idx.set_len(got);
            g.val.set_len(got);
        }
        let base = full * BLOCK;
        if base < n {
            let mut unused = 0.0;
            s.add_block_portable(&x[base..], base, max, floor, &mut a, &mut b, g, &mut unused);
        }
        // The gathered share: from the probabilities of the gathered
        // tokens, which the walk needs anyway (cheaper than a masked sum
        // over every block).
        let z = s.value();
        // SAFETY: AVX-512F is enabled in this function.
        let share = unsafe { exp_div(&g.val, max, z, &mut g.prob) };
        (z, share * z)
    }
}
