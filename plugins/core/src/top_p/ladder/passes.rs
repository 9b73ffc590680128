//! The sets of the ladder walk and the AVX-512 passes that fill them: the
//! top set and band ([`Part`]), the middle ([`Middle`]), the masses above
//! each rung of a ladder, the split into the sets, and the units ordered
//! before each tie.

use std::arch::x86_64::*;

use super::placement::Bounds;
use crate::top_p::exp::{EXP_REL_ERR, lanes_below};
use crate::top_p::grid_sum::{MAGIC, MAGIC_BITS};
use crate::top_p::shared::{Gathered, key_logit};

/// Tokens of one set of the split: positions, logits and approximate
/// probabilities.
#[derive(Clone, Default)]
pub(super) struct Part {
    pub(super) idx: Vec<u32>,
    pub(super) val: Vec<f32>,
    pub(super) v: Vec<f32>,
}

impl Part {
    pub(super) fn clear(&mut self) {
        self.idx.clear();
        self.val.clear();
        self.v.clear();
    }

    pub(super) fn len(&self) -> usize {
        self.idx.len()
    }

    pub(super) fn view(&self) -> PartRef<'_> {
        PartRef {
            idx: &self.idx,
            val: &self.val,
            v: &self.v,
        }
    }
}

/// Borrowed columns of the tokens a split reads.
#[derive(Clone, Copy)]
pub(super) struct PartRef<'a> {
    idx: &'a [u32],
    val: &'a [f32],
    v: &'a [f32],
}

impl<'a> PartRef<'a> {
    /// The gathered tokens with their probabilities (`g.prob` must be
    /// filled).
    pub(super) fn gathered(g: &'a Gathered) -> Self {
        PartRef {
            idx: &g.idx,
            val: &g.val,
            v: &g.prob,
        }
    }
}

/// p's binade `[base, 2·base)`, where the running sum stays from the end
/// of the top set to the cut, its grid and the probabilities' error bound.
#[derive(Clone, Copy)]
pub(super) struct Grid {
    pub(super) base: f32,
    /// Exponent of `base`.
    pub(super) exp: i32,
    /// 1 / the grid unit (`base·2^-23`).
    pub(super) inv: f32,
    /// Relative error of the approximate probabilities.
    pub(super) rel_err: f32,
}

impl Grid {
    /// The binade of `p` (positive and normal).
    pub(super) fn of(p: f32) -> Self {
        let base = f32::from_bits(p.to_bits() & 0xFF80_0000);
        let exp = ((base.to_bits() >> 23) as i32) - 127;
        Grid {
            base,
            exp,
            inv: f32::from_bits(((127 + 23 - exp) as u32) << 23),
            // the exp's error (at most half of EXP_REL_ERR) and the
            // divisions' roundings (ours and llama.cpp's, half an ulp
            // each), with room to spare
            rel_err: EXP_REL_ERR + f32::EPSILON / 2.0,
        }
    }
}

/// The middle: summed units on the binade's grid, its size, and the lanes
/// whose rounding the approximation could not decide (positions, logits
/// and approximate probabilities).
#[derive(Clone, Default)]
pub(super) struct Middle {
    pub(super) units: u64,
    pub(super) count: usize,
    pub(super) uncertain: Part,
}

impl Middle {
    pub(super) fn clear(&mut self) {
        self.units = 0;
        self.count = 0;
        self.uncertain.clear();
    }
}

/// `Σ v[i]` over `val[i] >= rung` for each rung (f32 lanes).
///
/// # Safety
/// The CPU must support AVX-512F and POPCNT.
#[target_feature(enable = "avx512f,popcnt")]
pub(super) unsafe fn masses<const R: usize>(val: &[f32], v: &[f32], rungs: &[f32; R]) -> [f32; R] {
    let n = val.len().min(v.len());
    let mut acc = [_mm512_setzero_ps(); R];
    let mut i = 0;
    while i < n {
        let live = lanes_below(n, i);
        // SAFETY: the loads are masked to lanes below n (the others read
        // 0 and add nothing, whatever they compare to).
        let (x, e) = unsafe {
            (
                _mm512_maskz_loadu_ps(live, val.as_ptr().add(i)),
                _mm512_maskz_loadu_ps(live, v.as_ptr().add(i)),
            )
        };
        for (a, &r) in acc.iter_mut().zip(rungs) {
            let m = _mm512_cmp_ps_mask::<_CMP_GE_OQ>(x, _mm512_set1_ps(r));
            *a = _mm512_mask_add_ps(*a, m, *a, e);
        }
        i += 16;
    }
    reduce_each(acc)
}

/// The horizontal sum of each register. A loop rather than `array::map`:
/// a closure there is a function of its own that LLVM may leave out of
/// line (with the register passed through memory) once `masses` or
/// `split` is inlined into a caller.
#[inline]
#[target_feature(enable = "avx512f,popcnt")]
fn reduce_each<const R: usize>(regs: [__m512; R]) -> [f32; R] {
    let mut out = [0.0f32; R];
    for (o, r) in out.iter_mut().zip(regs) {
        *o = _mm512_reduce_add_ps(r);
    }
    out
}

/// Write positions in the spare capacity of a [`Part`]'s three columns,
/// kept in registers by the split loop (pushing through the `Vec`s would
/// reload their fields after every store), with one length for all three.
struct PartCursor {
    idx: *mut u32,
    val: *mut f32,
    v: *mut f32,
    len: usize,
}

impl PartCursor {
    /// Reserves room for `n` more tokens plus 16 of slack (a compressed
    /// store writes all 16 lanes).
    fn new(p: &mut Part, n: usize) -> Self {
        p.idx.reserve(n + 16);
        p.val.reserve(n + 16);
        p.v.reserve(n + 16);
        debug_assert!(p.idx.len() == p.val.len() && p.val.len() == p.v.len());
        PartCursor {
            idx: p.idx.as_mut_ptr(),
            val: p.val.as_mut_ptr(),
            v: p.v.as_mut_ptr(),
            len: p.idx.len(),
        }
    }

    /// Appends lanes `m` of the three columns.
    ///
    /// # Safety
    /// AVX-512F and POPCNT; at most the `n` tokens reserved are pushed in
    /// all.
    #[inline(always)]
    unsafe fn push(&mut self, m: __mmask16, ids: __m512i, x: __m512, e: __m512) {
        // SAFETY: len + 16 is within each column's reserved capacity.
        unsafe {
            _mm512_storeu_si512(
                self.idx.add(self.len).cast(),
                _mm512_maskz_compress_epi32(m, ids),
            );
            _mm512_storeu_ps(self.val.add(self.len), _mm512_maskz_compress_ps(m, x));
            _mm512_storeu_ps(self.v.add(self.len), _mm512_maskz_compress_ps(m, e));
        }
        self.len += m.count_ones() as usize;
    }

    /// Sets the part's length to what was pushed.
    ///
    /// # Safety
    /// `p` is the part the cursor was made from, unchanged since.
    unsafe fn finish(self, p: &mut Part) {
        // SAFETY: every token below `len` was written into the reserved
        // capacity (the caller's contract).
        unsafe {
            p.idx.set_len(self.len);
            p.val.set_len(self.len);
            p.v.set_len(self.len);
        }
    }
}

/// Splits `src` by `b`: the top set appended to `top` (positions and
/// logits), the band to `band`, the middle summed into `mid` (grid units
/// at `inv`, lanes too close to a rounding boundary appended to
/// `mid.uncertain`); tokens below the band are dropped.
///
/// # Safety
/// The CPU must support AVX-512F and POPCNT.
///
/// With `MEASURE`, also returns the probability mass at or above `b.a`,
/// `b.b_hi` and `b.b_lo` (f32 lane sums); zeros otherwise.
#[target_feature(enable = "avx512f,popcnt")]
pub(super) unsafe fn split<const MEASURE: bool>(
    src: PartRef<'_>,
    b: Bounds,
    grid: Grid,
    top: &mut Part,
    mid: &mut Middle,
    band: &mut Part,
) -> [f32; 3] {
    let mut measured = [_mm512_setzero_ps(); 3];
    let n = src.idx.len();
    let mut top_at = PartCursor::new(top, n);
    let mut band_at = PartCursor::new(band, n);
    let mut unc_at = PartCursor::new(&mut mid.uncertain, n);
    let (va, vhi, vlo) = (
        _mm512_set1_ps(b.a),
        _mm512_set1_ps(b.b_hi),
        _mm512_set1_ps(b.b_lo),
    );
    let Grid { inv, rel_err, .. } = grid;
    let vinv = _mm512_set1_ps(inv);
    let magic = _mm512_set1_ps(MAGIC);
    let magic_bits = _mm512_set1_epi32(MAGIC_BITS as i32);
    let below = _mm512_set1_ps(1.0 - rel_err);
    let above = _mm512_set1_ps(1.0 + rel_err);
    let mut units = _mm512_setzero_si512();
    let mut count = 0usize;
    let mut i = 0;
    while i < n {
        let live = lanes_below(n, i);
        // SAFETY: the loads are masked to lanes below n; each part is
        // pushed at most n values, which its cursor reserved.
        unsafe {
            let ids = _mm512_maskz_loadu_epi32(live, src.idx.as_ptr().add(i).cast());
            let x = _mm512_maskz_loadu_ps(live, src.val.as_ptr().add(i));
            let e = _mm512_maskz_loadu_ps(live, src.v.as_ptr().add(i));
            let ge_a = _mm512_cmp_ps_mask::<_CMP_GE_OQ>(x, va) & live;
            let ge_hi = _mm512_cmp_ps_mask::<_CMP_GE_OQ>(x, vhi) & live;
            let ge_lo = _mm512_cmp_ps_mask::<_CMP_GE_OQ>(x, vlo) & live;
            let m_mid = ge_hi & !ge_a;
            let m_band = ge_lo & !ge_hi;
            if MEASURE {
                for (acc, m) in measured.iter_mut().zip([ge_a, ge_hi, ge_lo]) {
                    *acc = _mm512_mask_add_ps(*acc, m, *acc, e);
                }
            }
            if ge_a != 0 {
                top_at.push(ge_a, ids, x, e);
            }
            band_at.push(m_band, ids, x, e);
            // the grid rounding of the normaliser pass: the exact value
            // is inside q·(1 ± rel_err); both ends rounding alike prove
            // its rounding (and that it is no tie)
            let q = _mm512_min_ps(_mm512_mul_ps(e, vinv), magic);
            let t = _mm512_fmadd_ps(q, below, magic);
            let t_hi = _mm512_fmadd_ps(q, above, magic);
            let r = _mm512_sub_epi32(_mm512_castps_si512(t), magic_bits);
            let bad = _mm512_cmp_ps_mask::<_CMP_NEQ_UQ>(t, t_hi) & m_mid;
            units = _mm512_mask_add_epi32(units, m_mid, units, r);
            count += m_mid.count_ones() as usize;
            if bad != 0 {
                unc_at.push(bad, ids, x, e);
            }
        }
        i += 16;
    }
    // SAFETY: each cursor was made from its part just above.
    unsafe {
        top_at.finish(top);
        band_at.finish(band);
        unc_at.finish(&mut mid.uncertain);
    }
    let mut lanes = [0u32; 16];
    // SAFETY: 16 u32 into a 16-u32 array.
    unsafe { _mm512_storeu_si512(lanes.as_mut_ptr().cast(), units) };
    mid.units += lanes.iter().map(|&u| u as u64).sum::<u64>();
    mid.count += count;
    reduce_each(measured)
}

/// Ties settled by one pass of [`units_before`].
pub(super) const TIES_PER_PASS: usize = 8;

/// For each tie of `ties` (at most N), into `out`: `Σ` grid units
/// (approximate, as [`split`] sums them) of the middle tokens `middle.0 <=
/// l < middle.1` of `g` ordered before it (a larger logit, or the same
/// logit at a smaller position).
///
/// # Safety
/// The CPU must support AVX-512F and POPCNT.
#[target_feature(enable = "avx512f,popcnt")]
pub(super) unsafe fn units_before<const N: usize>(
    g: &Gathered,
    middle: (f32, f32),
    ties: &[(u64, i64, i64)],
    grid: Grid,
    out: &mut [u64; TIES_PER_PASS],
) {
    debug_assert!(ties.len() <= N && N <= TIES_PER_PASS);
    let (idx, val, v) = (&g.idx, &g.val, &g.prob);
    let below = _mm512_set1_ps(1.0 - grid.rel_err);
    let n = idx.len();
    let va = _mm512_set1_ps(middle.1);
    // unused slots get the last key: nothing orders after it
    let key = |t: usize| ties.get(t).map_or(u64::MAX, |t| t.0);
    let kord: [__m512i; N] =
        std::array::from_fn(|t| _mm512_set1_epi32(!((key(t) >> 32) as u32) as i32));
    let kpos: [__m512i; N] = std::array::from_fn(|t| _mm512_set1_epi32(key(t) as u32 as i32));
    let sign = _mm512_set1_epi32(i32::MIN);
    let vinv = _mm512_set1_ps(grid.inv);
    let magic = _mm512_set1_ps(MAGIC);
    let magic_bits = _mm512_set1_epi32(MAGIC_BITS as i32);
    // only tokens at or above the lowest tie's logit can order before a
    // tie (ties mostly sit high in the middle, so most blocks skip)
    let lowest = ties
        .iter()
        .map(|t| key_logit((t.0 >> 32) as u32))
        .fold(f32::INFINITY, f32::min);
    let vlow = _mm512_set1_ps(lowest.max(middle.0));
    let mut units = [_mm512_setzero_si512(); N];
    let mut i = 0;
    while i < n {
        let live = lanes_below(n, i);
        // SAFETY: the loads are masked to lanes below n.
        unsafe {
            let x = _mm512_maskz_loadu_ps(live, val.as_ptr().add(i));
            let m = _mm512_cmp_ps_mask::<_CMP_GE_OQ>(x, vlow)
                & !_mm512_cmp_ps_mask::<_CMP_GE_OQ>(x, va)
                & live;
            if m != 0 {
                let ids = _mm512_maskz_loadu_epi32(live, idx.as_ptr().add(i).cast());
                let e = _mm512_maskz_loadu_ps(live, v.as_ptr().add(i));
                let bits = _mm512_castps_si512(x);
                // the order-preserving integer of the logit (as `ord_key`)
                let ord =
                    _mm512_xor_si512(bits, _mm512_or_si512(_mm512_srai_epi32::<31>(bits), sign));
                // the units `split` added for these lanes
                let q = _mm512_min_ps(_mm512_mul_ps(e, vinv), magic);
                let r = _mm512_sub_epi32(
                    _mm512_castps_si512(_mm512_fmadd_ps(q, below, magic)),
                    magic_bits,
                );
                for t in 0..N {
                    let before = _mm512_cmpgt_epu32_mask(ord, kord[t])
                        | (_mm512_cmpeq_epi32_mask(ord, kord[t])
                            & _mm512_cmplt_epu32_mask(ids, kpos[t]));
                    units[t] = _mm512_mask_add_epi32(units[t], m & before, units[t], r);
                }
            }
        }
        i += 16;
    }
    for (o, u) in out.iter_mut().zip(units) {
        let mut lanes = [0u32; 16];
        // SAFETY: 16 u32 into a 16-u32 array.
        unsafe { _mm512_storeu_si512(lanes.as_mut_ptr().cast(), u) };
        *o = lanes.iter().map(|&u| u as u64).sum();
    }
}
