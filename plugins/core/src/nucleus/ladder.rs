//! The walk's fast path on AVX-512: llama.cpp's cut from two vectorised
//! passes over the gathered tokens, without the bucket walk's counting
//! sort.
//!
//! In llama.cpp's order the running sum first climbs to `base`, the power
//! of two at or below p, and from there to the cut it stays in the binade
//! `[base, 2·base)`, where every addition is an integer addition on one
//! grid (see the parent module), in any order. So only two small sets need
//! the order: the top tokens that carry the sum past `base` (sorted and
//! replayed exactly) and a thin band of logits around the cut (sorted and
//! replayed until the cut). Everything between, the middle, is one integer
//! sum. A ladder of logit thresholds with approximate masses places the
//! sets; a split pass compresses the top and the band out and sums the
//! middle; a band still too wide is narrowed with a ladder of its own.
//!
//! The approximate masses only place the sets. Every assumption is then
//! checked exactly: the top set ends in the binade, the middle holds no
//! tie, stays in the binade and does not reach p, and the cut lies in the
//! band. When one fails, [`walk`] returns None and the caller runs the
//! bucket walk, which is exact in every case.

use std::arch::x86_64::*;

use super::{
    Cut, EXP_REL_ERR, F32Sum, Gathered, LIMIT, MAGIC, MAGIC_BITS, Scratch, Target, avx512,
    exact_units, libm_exp, replay_sorted, sort_key,
};

/// Thresholds of the ladder over all gathered tokens (when the sample's
/// placement fails; each costs a compare and an add per token), and of the
/// other ladders (a band's, the top set's, the sample's).
const FIRST_RUNGS: usize = 16;
const RUNGS: usize = 16;
/// The band is narrowed until it holds at most this many tokens.
const BAND_MAX: usize = 128;
/// Narrowing rounds before giving up on a band (equal logits cannot be
/// split).
const NARROW_ROUNDS: usize = 4;
/// A closed top set larger than this is narrowed.
const TOP_TARGET: usize = 256;
/// Larger top sets or bands go to the bucket walk (sorting them would cost
/// more than it saves).
const SORTED_MAX: usize = 8192;
/// Below this many gathered tokens the bucket walk is as fast.
const MIN_GATHERED: usize = 2048;
/// Absolute slack on the approximate masses (all in [0, 1]; their f32
/// lane sums drift by far less) when placing the sets.
const MASS_MARGIN: f32 = 1e-4;

/// Tokens of one set of the split: positions, logits and approximate
/// probabilities.
#[derive(Clone, Default)]
pub(super) struct Part {
    idx: Vec<u32>,
    val: Vec<f32>,
    v: Vec<f32>,
}

impl Part {
    fn clear(&mut self) {
        self.idx.clear();
        self.val.clear();
        self.v.clear();
    }

    fn len(&self) -> usize {
        self.idx.len()
    }

    fn view(&self) -> PartRef<'_> {
        PartRef {
            idx: &self.idx,
            val: &self.val,
            v: &self.v,
        }
    }
}

/// The grid of the middle's binade and the probabilities' error bound.
#[derive(Clone, Copy)]
struct Grid {
    /// 1 / the grid unit.
    inv: f32,
    /// Relative error of the approximate probabilities.
    rel_err: f32,
}

/// The middle: summed units on the binade's grid, its size, and the lanes
/// whose rounding the approximation could not decide (logit and
/// approximate probability).
#[derive(Default)]
struct Middle {
    units: u64,
    count: usize,
}

/// Scratch of the ladder walk, kept in [`Scratch`].
#[derive(Clone, Default)]
pub(super) struct Ladder {
    top: Part,
    top_next: Part,
    band: Part,
    band_next: Part,
    uncertain: Part,
    /// The sample's logits at or above the floor, and their exp.
    filtered: (Vec<f32>, Vec<f32>),
    /// Corrections of the uncertain middle lanes: (key, units), and the
    /// exact ties (key, units rounded down, approximate units).
    fixes: Vec<(u64, i64)>,
    ties: Vec<(u64, i64, i64)>,
    keys: Vec<u64>,
}

impl Ladder {
    /// Scratch for sampled tokens in a logit range.
    pub(super) fn filtered_mut(&mut self) -> &mut (Vec<f32>, Vec<f32>) {
        &mut self.filtered
    }
}

/// Which set a token falls in, by logit: top `l >= a`, middle
/// `b_hi <= l < a`, band `b_lo <= l < b_hi`, dropped below `b_lo`.
#[derive(Clone, Copy, Debug)]
struct Bounds {
    a: f32,
    b_hi: f32,
    b_lo: f32,
}

/// llama.cpp's cut among the gathered tokens, or None when a fast-path
/// assumption fails (the caller then runs the bucket walk).
///
/// # Safety
/// The CPU must support AVX-512F and POPCNT.
#[target_feature(enable = "avx512f,popcnt")]
pub(super) unsafe fn walk(t: Target, s: &mut Scratch) -> Option<Cut> {
    let Target {
        max,
        z,
        p,
        min_keep,
        floor,
    } = t;
    let n = s.gathered.len();
    // p's binade: [base, 2·base) with grid unit base·2^-23
    let usable = n >= MIN_GATHERED && floor.is_finite() && (1e-6..1.0).contains(&p) && z >= 1.0;
    if !usable {
        return None;
    }
    let base = f32::from_bits(p.to_bits() & 0xFF80_0000);
    let base_exp = ((base.to_bits() >> 23) as i32) - 127;
    let inv = f32::from_bits(((127 + 23 - base_exp) as u32) << 23);
    // the exp's error (at most half of EXP_REL_ERR) and the divisions'
    // roundings (ours and llama.cpp's, half an ulp each), with room to spare
    let rel_err = EXP_REL_ERR + f32::EPSILON / 2.0;
    let grid = Grid { inv, rel_err };
    // The probabilities (kept from the normaliser pass when it made them).
    if s.gathered.prob.len() != n {
        let g = &mut s.gathered;
        // SAFETY: AVX-512F and POPCNT are enabled in this function.
        unsafe { exp_div(&g.val, max, z, &mut g.prob) };
    }
    let g = &s.gathered;
    let l = &mut s.ladder;
    let src = PartRef {
        idx: &g.idx,
        val: &g.val,
        v: &g.prob,
    };
    let fresh = |l: &mut Ladder| {
        l.top.clear();
        l.band.clear();
        l.uncertain.clear();
    };
    fresh(l);
    let mut mid = Middle::default();
    // First try: the sets placed from the floor estimate's sample, checked
    // by the masses the split measures on its way.
    // SAFETY: as above (for both calls).
    let predicted = unsafe {
        let sample = (
            &s.sample[..],
            &s.sample_e[..],
            s.sample_rate,
            s.sample_total,
        );
        predict(sample, floor, max, z, p, base, &mut l.filtered)
    };
    let mut placed = None;
    if let Some(b) = predicted {
        // SAFETY: as above.
        let [m_a, m_hi, m_lo] = unsafe {
            split::<true>(
                src,
                b,
                grid,
                &mut l.top,
                &mut mid,
                &mut l.uncertain,
                &mut l.band,
            )
        };
        if m_a >= base + MASS_MARGIN
            && m_hi < p - MASS_MARGIN
            && (m_lo >= p + MASS_MARGIN || b.b_lo <= floor)
            && m_hi - m_a <= 2.0 * base
        {
            placed = Some((b, m_hi));
        } else {
            fresh(l);
            mid = Middle::default();
        }
    }
    // Otherwise: a ladder of thresholds over [floor, max] and its masses,
    // then the split.
    let (mut bounds, mut before, mut top_closed) = match placed {
        Some((b, m_hi)) => (b, m_hi, true),
        None => {
            let rungs = floor_ladder(floor, max);
            // SAFETY: as above.
            let mass = unsafe { masses(&g.val, &g.prob, &rungs) };
            let place = Placement::new(&rungs, &mass, 0.0, p, base, None);
            // the middle's probabilities must sum to clearly less than
            // the binade (the lane sums of the grid units then cannot
            // wrap)
            if place.middle_mass > 2.0 * base {
                return None;
            }
            // SAFETY: as above.
            unsafe {
                split::<false>(
                    src,
                    place.bounds,
                    grid,
                    &mut l.top,
                    &mut mid,
                    &mut l.uncertain,
                    &mut l.band,
                )
            };
            (place.bounds, place.mass_above_band, place.top_closed)
        }
    };

    // Narrow a wide band with ladders of its own.
    let mut rounds = 0;
    while l.band.len() > BAND_MAX && rounds < NARROW_ROUNDS {
        rounds += 1;
        let upper = if bounds.b_hi.is_finite() {
            bounds.b_hi
        } else {
            max
        };
        if !bounds.b_lo.is_finite() || upper <= bounds.b_lo {
            break;
        }
        let rungs = ladder::<RUNGS>(bounds.b_lo, upper);
        // SAFETY: as above.
        let mass = unsafe { masses(&l.band.val, &l.band.v, &rungs) };
        // while the top set is still open (it ends where the band
        // starts), the band's upper part may close it
        let top_open = !top_closed;
        let place = Placement::new(
            &rungs,
            &mass,
            before,
            p,
            base,
            (!top_open).then_some(bounds.b_hi),
        );
        if place.middle_mass > 2.0 * base {
            return None;
        }
        let inner = Bounds {
            // above the band's own ladder: nothing (all were below b_hi)
            a: if top_open {
                place.bounds.a
            } else {
                f32::INFINITY
            },
            ..place.bounds
        };
        l.band_next.clear();
        // SAFETY: as above.
        unsafe {
            split::<false>(
                l.band.view(),
                inner,
                grid,
                &mut l.top,
                &mut mid,
                &mut l.uncertain,
                &mut l.band_next,
            )
        };
        std::mem::swap(&mut l.band, &mut l.band_next);
        // a band ladder with no rung short of p keeps the band's top where
        // it was (its +inf only meant "from the top of this band")
        let b_hi = if place.bounds.b_hi.is_finite() {
            place.bounds.b_hi
        } else {
            bounds.b_hi
        };
        bounds = Bounds {
            // the top set grew into the band while it was open, and ends
            // where the band starts while it stays open
            a: match (top_open, place.top_closed) {
                (false, _) => bounds.a,
                (true, true) => place.bounds.a,
                (true, false) => b_hi,
            },
            b_hi,
            b_lo: place.bounds.b_lo,
        };
        before = place.mass_above_band;
        top_closed = place.top_closed;
    }
    // Narrow a large closed top set the same way: its lower part joins
    // the middle.
    if top_closed && l.top.len() > TOP_TARGET {
        let rungs = ladder::<RUNGS>(bounds.a, max);
        // SAFETY: as above.
        let mass = unsafe { masses(&l.top.val, &l.top.v, &rungs) };
        if let Some(j) = (0..RUNGS).find(|&j| mass[j] >= base + MASS_MARGIN)
            && rungs[j] > bounds.a
        {
            let a = rungs[j];
            std::mem::swap(&mut l.top, &mut l.top_next);
            l.top.clear();
            l.band_next.clear();
            // below `a`: middle (the band bounds are empty here)
            let inner = Bounds {
                a,
                b_hi: bounds.a,
                b_lo: bounds.a,
            };
            // SAFETY: as above.
            unsafe {
                split::<false>(
                    l.top_next.view(),
                    inner,
                    grid,
                    &mut l.top,
                    &mut mid,
                    &mut l.uncertain,
                    &mut l.band_next,
                )
            };
            bounds.a = a;
        }
    }
    if l.top.len() > SORTED_MAX || l.band.len() > SORTED_MAX {
        return None;
    }
    if min_keep > l.top.len() + mid.count {
        return None;
    }

    // Exact: the top set in order.
    let mut sum = F32Sum::new();
    fill_keys(&l.top, &mut l.keys);
    l.keys.sort_unstable();
    if let Some(cut) = replay_sorted(&mut sum, &l.keys, 0, t) {
        return Some(cut);
    }
    // The middle as one integer addition on the binade's grid.
    if mid.count > 0 {
        if !(sum.on_grid && sum.exp == base_exp) {
            return None;
        }
        // lanes the approximation could not round: libm's value decides;
        // an exact tie rounds to even, which depends on the sum before it
        let mut units = sum.units as i64 + mid.units as i64;
        l.fixes.clear();
        l.ties.clear();
        let u = &l.uncertain;
        for ((&lv, &v), &i) in u.val.iter().zip(&u.v).zip(&u.idx) {
            let approx = grid_units_below(v * inv, rel_err) as i64;
            let q = libm_exp(lv - max) / z * inv;
            if q >= MAGIC {
                return None;
            }
            let key = sort_key(lv, i);
            match exact_units(q) {
                Some(r) => {
                    let fix = r as i64 - approx;
                    units += fix;
                    l.fixes.push((key, fix));
                }
                None => l.ties.push((key, q.floor() as i64, approx)),
            }
        }
        if !l.ties.is_empty() {
            l.ties.sort_unstable();
            let mut tie_fixes = 0i64;
            for group in l.ties.chunks(TIES_PER_PASS) {
                let middle = (bounds.b_hi, bounds.a);
                let mut before = [0u64; TIES_PER_PASS];
                // one compare per tie and token: as few slots as ties
                // SAFETY: AVX-512F and POPCNT are enabled in this function.
                unsafe {
                    match group.len() {
                        1 => units_before::<1>(g, middle, group, grid, &mut before),
                        2 => units_before::<2>(g, middle, group, grid, &mut before),
                        3 | 4 => units_before::<4>(g, middle, group, grid, &mut before),
                        _ => units_before::<8>(g, middle, group, grid, &mut before),
                    }
                }
                for (&(key, r_floor, approx), &b) in group.iter().zip(&before) {
                    // the units just before this tie, in llama.cpp's order
                    let pre = sum.units as i64
                        + b as i64
                        + l.fixes
                            .iter()
                            .filter(|f| f.0 < key)
                            .map(|f| f.1)
                            .sum::<i64>()
                        + tie_fixes;
                    let exact = r_floor + ((pre + r_floor) & 1);
                    tie_fixes += exact - approx;
                }
            }
            units += tie_fixes;
        }
        if units >= LIMIT as i64 {
            return None;
        }
        sum.units = units as u32;
        if sum.value() >= p {
            return None; // the cut lies in the middle
        }
    }
    // Exact: the band in order, until the cut.
    fill_keys(&l.band, &mut l.keys);
    l.keys.sort_unstable();
    replay_sorted(&mut sum, &l.keys, l.top.len() + mid.count, t)
}

/// The approximate units [`split`] adds for a probability `q` (in units)
/// known within a relative `rel_err`: `round(q·(1 - rel_err))`, the lower
/// end of its bracket, rounded once by a fused multiply-add.
#[inline(always)]
fn grid_units_below(q: f32, rel_err: f32) -> u32 {
    q.min(MAGIC).mul_add(1.0 - rel_err, MAGIC).to_bits() - MAGIC_BITS
}

/// Sort keys `(desc_key(l) << 32) | position` of a part.
fn fill_keys(part: &Part, keys: &mut Vec<u64>) {
    keys.clear();
    keys.extend(
        part.idx
            .iter()
            .zip(&part.val)
            .map(|(&i, &l)| sort_key(l, i)),
    );
}

/// R thresholds descending from just below `hi` to `lo` (the last is `lo`
/// itself).
fn ladder<const R: usize>(lo: f32, hi: f32) -> [f32; R] {
    let step = (hi - lo) / R as f32;
    let mut r: [f32; R] = std::array::from_fn(|j| hi - (j + 1) as f32 * step);
    r[R - 1] = lo;
    r
}

/// The first ladder's thresholds, as fractions of the way from `lo` (the
/// floor) to `hi` (the max): sixteenths over the upper part, where the
/// running sum passes `base` (they keep the top set small), then halving
/// towards the floor. The floor was placed a little below the cut (it
/// leaves out most of the mass 1 - p), so the cut usually lies within a
/// few percent of the span above it: fine rungs there keep the band small.
const FIRST_LADDER: [f32; FIRST_RUNGS] = [
    0.875,
    0.75,
    0.6875,
    0.625,
    0.5625,
    0.5,
    0.4375,
    0.375,
    0.25,
    0.125,
    0.0625,
    0.031_25,
    0.015_625,
    0.007_812_5,
    0.003_906_25,
    0.0,
];

/// [`FIRST_LADDER`] over `[lo, hi]` (the last rung is `lo` itself).
fn floor_ladder(lo: f32, hi: f32) -> [f32; FIRST_RUNGS] {
    let span = hi - lo;
    let mut r = FIRST_LADDER.map(|f| lo + span * f);
    r[FIRST_RUNGS - 1] = lo;
    r
}

/// Where the sets go, from a ladder's masses (mass above rung j, plus
/// `before`, the mass of the tokens above the ladder).
struct Placement {
    bounds: Bounds,
    /// Approximate mass of everything above the band.
    mass_above_band: f32,
    /// Approximate mass of this ladder's middle.
    middle_mass: f32,
    /// Whether the top set surely carries the sum past `base`.
    top_closed: bool,
}

impl Placement {
    /// `top_end`: where an already closed top set ends (None while it is
    /// open).
    fn new<const R: usize>(
        rungs: &[f32; R],
        mass: &[f32; R],
        before: f32,
        p: f32,
        base: f32,
        top_end: Option<f32>,
    ) -> Self {
        let at = |j: usize| before + mass[j];
        // the band: from the last rung clearly short of p to the first
        // clearly past it
        let j_hi = (0..R).rev().find(|&j| at(j) < p - MASS_MARGIN);
        let j_lo = (0..R).find(|&j| at(j) >= p + MASS_MARGIN && j_hi.is_none_or(|h| j > h));
        let b_hi = j_hi.map_or(f32::INFINITY, |j| rungs[j]);
        let b_lo = j_lo.map_or(f32::NEG_INFINITY, |j| rungs[j]);
        let mass_above_band = j_hi.map_or(before, at);
        if let Some(end) = top_end {
            // the top set is closed: everything above the band is middle
            let middle_mass = mass_above_band - before;
            return Placement {
                bounds: Bounds { a: end, b_hi, b_lo },
                mass_above_band,
                middle_mass,
                top_closed: true,
            };
        }
        // the top set: up to the first rung clearly past `base`, and never
        // into the band
        let j_top = (0..R).find(|&j| at(j) >= base + MASS_MARGIN);
        match (j_top, j_hi) {
            (Some(t), Some(h)) if t <= h => Placement {
                bounds: Bounds {
                    a: rungs[t],
                    b_hi,
                    b_lo,
                },
                mass_above_band,
                middle_mass: at(h) - at(t),
                top_closed: true,
            },
            _ => Placement {
                bounds: Bounds {
                    a: b_hi,
                    b_hi,
                    b_lo,
                },
                mass_above_band,
                middle_mass: 0.0,
                top_closed: false,
            },
        }
    }
}

/// Borrowed columns of the tokens a split reads.
#[derive(Clone, Copy)]
struct PartRef<'a> {
    idx: &'a [u32],
    val: &'a [f32],
    v: &'a [f32],
}

/// `out[i] = exp(val[i] - max) / z` (the FMA exp of the normaliser pass);
/// returns their sum (f32 lanes).
///
/// # Safety
/// The CPU must support AVX-512F and POPCNT.
#[target_feature(enable = "avx512f,popcnt")]
pub(super) unsafe fn exp_div(val: &[f32], max: f32, z: f32, out: &mut Vec<f32>) -> f32 {
    let n = val.len();
    out.clear();
    out.reserve(n + 64);
    let vmax = _mm512_set1_ps(max);
    let vz = _mm512_set1_ps(z);
    let src = val.as_ptr();
    let dst = out.as_mut_ptr();
    let mut sum = [_mm512_setzero_ps(); 4];
    let mut i = 0;
    while i < n {
        // SAFETY: lanes at or past n are masked off the loads (they read
        // -inf, whose exp is 0); the stores write 64 lanes at i < n, inside
        // the reserved n + 64.
        unsafe {
            let x: [__m512; 4] = std::array::from_fn(|k| {
                let at = i + 16 * k;
                let live = lanes_below(n, at);
                _mm512_mask_loadu_ps(_mm512_set1_ps(f32::NEG_INFINITY), live, src.add(at.min(n)))
            });
            let e = avx512::exp16x4(x.map(|x| _mm512_sub_ps(x, vmax)));
            for (k, ek) in e.iter().enumerate() {
                let p = _mm512_div_ps(*ek, vz);
                _mm512_storeu_ps(dst.add(i + 16 * k), p);
                sum[k] = _mm512_add_ps(sum[k], p);
            }
        }
        i += 64;
    }
    // SAFETY: n values were written.
    unsafe { out.set_len(n) };
    let sum = _mm512_add_ps(_mm512_add_ps(sum[0], sum[1]), _mm512_add_ps(sum[2], sum[3]));
    _mm512_reduce_add_ps(sum)
}

/// The mask of lanes `at + j < n`.
#[inline(always)]
fn lanes_below(n: usize, at: usize) -> __mmask16 {
    let live = n.saturating_sub(at).min(16);
    ((1u32 << live) - 1) as __mmask16
}

/// `Σ v[i]` over `val[i] >= rung` for each rung (f32 lanes).
///
/// # Safety
/// The CPU must support AVX-512F and POPCNT.
#[target_feature(enable = "avx512f,popcnt")]
unsafe fn masses<const R: usize>(val: &[f32], v: &[f32], rungs: &[f32; R]) -> [f32; R] {
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
    acc.map(|a| _mm512_reduce_add_ps(a))
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
/// `uncertain`); tokens below the band are dropped.
///
/// # Safety
/// The CPU must support AVX-512F and POPCNT.
///
/// With `MEASURE`, also returns the probability mass at or above `b.a`,
/// `b.b_hi` and `b.b_lo` (f32 lane sums); zeros otherwise.
#[allow(clippy::too_many_arguments)]
#[target_feature(enable = "avx512f,popcnt")]
unsafe fn split<const MEASURE: bool>(
    src: PartRef<'_>,
    b: Bounds,
    grid: Grid,
    top: &mut Part,
    mid: &mut Middle,
    uncertain: &mut Part,
    band: &mut Part,
) -> [f32; 3] {
    let mut measured = [_mm512_setzero_ps(); 3];
    let n = src.idx.len();
    let mut top_at = PartCursor::new(top, n);
    let mut band_at = PartCursor::new(band, n);
    let mut unc_at = PartCursor::new(uncertain, n);
    let (va, vhi, vlo) = (
        _mm512_set1_ps(b.a),
        _mm512_set1_ps(b.b_hi),
        _mm512_set1_ps(b.b_lo),
    );
    let Grid { inv, rel_err } = grid;
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
        unc_at.finish(uncertain);
    }
    let mut lanes = [0u32; 16];
    // SAFETY: 16 u32 into a 16-u32 array.
    unsafe { _mm512_storeu_si512(lanes.as_mut_ptr().cast(), units) };
    mid.units += lanes.iter().map(|&u| u as u64).sum::<u64>();
    mid.count += count;
    measured.map(|m| _mm512_reduce_add_ps(m))
}

/// Ties settled by one pass of [`units_before`].
const TIES_PER_PASS: usize = 8;

/// For each tie of `ties` (at most N), into `out`: `Σ` grid units
/// (approximate, as [`split`] sums them) of the middle tokens `middle.0 <=
/// l < middle.1` of `g` ordered before it (a larger logit, or the same
/// logit at a smaller position).
///
/// # Safety
/// The CPU must support AVX-512F and POPCNT.
#[target_feature(enable = "avx512f,popcnt")]
unsafe fn units_before<const N: usize>(
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
        .map(|t| super::key_logit((t.0 >> 32) as u32))
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

/// Lines of 16 logits sampled by [`estimate_floor`]: about this many.
const SAMPLE_LINES: usize = 256;
/// The floor is searched in `[max - FLOOR_SPAN, max]` (below, a token
/// weighs under e^-64 of the max: never part of a floor's mass).
const FLOOR_SPAN: f32 = 64.0;

/// A logit floor under which the tokens should hold about `allowed_share`
/// of the mass, estimated from a sample of whole 64-byte lines (one per
/// `n / SAMPLE_LINES` logits: few cache lines touched): a ladder of 16
/// rungs over the whole sample, then two more over the few sampled tokens
/// between the two rungs it picked (a resolution of 1/60 logit). Only
/// speed depends on it: the caller checks the gathered mass. Also leaves
/// the sample, its `exp(l - max)`, the sampling rate and the sample's total
/// for [`predict`].
///
/// # Safety
/// The CPU must support AVX-512F and POPCNT.
#[allow(clippy::too_many_arguments)]
#[target_feature(enable = "avx512f,popcnt")]
pub(super) unsafe fn estimate_floor(
    x: &[f32],
    max: f32,
    allowed_share: f32,
    sample: &mut Vec<f32>,
    sample_e: &mut Vec<f32>,
    sample_rate: &mut f32,
    sample_total: &mut f32,
    filtered: &mut (Vec<f32>, Vec<f32>),
) -> f32 {
    let n = x.len();
    let stride = (n / SAMPLE_LINES / 16 * 16).max(32);
    *sample_rate = 16.0 / stride as f32;
    sample.clear();
    let mut at = 0;
    while at + 16 <= n {
        sample.extend_from_slice(&x[at..at + 16]);
        at += stride;
    }
    // SAFETY: AVX-512F and POPCNT are enabled in this function.
    let total = unsafe { exp_div(sample, max, 1.0, sample_e) };
    *sample_total = total;
    // the mass at or above the floor must reach `total - allowed`
    let need = total - allowed_share * total;
    // rungs from max itself down to max - FLOOR_SPAN
    let rungs: [f32; RUNGS] =
        std::array::from_fn(|j| max - FLOOR_SPAN * j as f32 / (RUNGS - 1) as f32);
    // SAFETY: as above.
    let m = unsafe { masses(sample, sample_e, &rungs) };
    let j = match (0..RUNGS).find(|&j| m[j] >= need) {
        None => return rungs[RUNGS - 1],
        Some(0) => return max,
        Some(j) => j,
    };
    let (mut lo, mut hi, mut above) = (rungs[j], rungs[j - 1], m[j - 1]);
    // SAFETY: as above.
    unsafe { filter_range(sample, sample_e, lo, hi, filtered) };
    let (fv, fe) = filtered;
    for _ in 0..2 {
        let rungs = ladder::<RUNGS>(lo, hi);
        // SAFETY: as above.
        let m = unsafe { masses(fv, fe, &rungs) };
        // lo itself (the last rung) always passes
        let j = (0..RUNGS)
            .find(|&j| above + m[j] >= need)
            .unwrap_or(RUNGS - 1);
        lo = rungs[j];
        if j > 0 {
            hi = rungs[j - 1];
            above += m[j - 1];
        }
    }
    lo
}

/// The values `lo <= val[i] < hi` and their `e[i]`, into `out`
/// (compressed 16 at a time).
///
/// # Safety
/// The CPU must support AVX-512F and POPCNT.
#[target_feature(enable = "avx512f,popcnt")]
unsafe fn filter_range(val: &[f32], e: &[f32], lo: f32, hi: f32, out: &mut (Vec<f32>, Vec<f32>)) {
    let (fv, fe) = out;
    let n = val.len().min(e.len());
    fv.clear();
    fe.clear();
    fv.reserve(n + 16);
    fe.reserve(n + 16);
    let (vlo, vhi) = (_mm512_set1_ps(lo), _mm512_set1_ps(hi));
    let mut got = 0;
    let mut i = 0;
    while i < n {
        let live = lanes_below(n, i);
        // SAFETY: the loads are masked to lanes below n; the compressed
        // stores write 16 lanes at got <= i, inside the reserved n + 16.
        unsafe {
            let x = _mm512_maskz_loadu_ps(live, val.as_ptr().add(i));
            let w = _mm512_maskz_loadu_ps(live, e.as_ptr().add(i));
            let m = _mm512_cmp_ps_mask::<_CMP_GE_OQ>(x, vlo)
                & _mm512_cmp_ps_mask::<_CMP_LT_OQ>(x, vhi)
                & live;
            _mm512_storeu_ps(fv.as_mut_ptr().add(got), _mm512_maskz_compress_ps(m, x));
            _mm512_storeu_ps(fe.as_mut_ptr().add(got), _mm512_maskz_compress_ps(m, w));
            got += m.count_ones() as usize;
        }
        i += 16;
    }
    // SAFETY: `got` values were written to each.
    unsafe {
        fv.set_len(got);
        fe.set_len(got);
    }
}

/// Slack, in probability mass, between where the sample places p (or
/// `base`) and the bounds [`predict`] sets around it: the sample's mass
/// estimate errs by a few thousandths near the cut (the tail is many small
/// terms), by a few hundredths near `base` (the head is few large ones).
const CUT_SLACK: f32 = 0.005;
const BASE_SLACK: f32 = 0.05;
/// Ladder levels (16 rungs each) of a [`predict`] search: a resolution of
/// 1/256 of the span above the floor.
const PREDICT_LEVELS: usize = 2;

/// The sets placed from the sample of [`estimate_floor`] (its logits, their
/// `exp(l - max)`, the sampling rate and their total): the top set where
/// the mass above
/// passes `base` clearly, a band from where it is clearly short of p to
/// where it clearly passes it. The mass above t is estimated as z minus
/// the sampled mass below t (many small terms: a steady estimate; the
/// sampled mass above t would hinge on a few large ones). None when the
/// sample does not separate the sets (the caller then uses its own
/// ladder).
///
/// # Safety
/// The CPU must support AVX-512F and POPCNT.
#[target_feature(enable = "avx512f,popcnt")]
unsafe fn predict(
    sample: (&[f32], &[f32], f32, f32),
    floor: f32,
    max: f32,
    z: f32,
    p: f32,
    base: f32,
    filtered: &mut (Vec<f32>, Vec<f32>),
) -> Option<Bounds> {
    let (val, e, rate, total) = sample;
    let usable = rate > 0.0 && val.len() == e.len() && max > floor;
    if !usable {
        return None;
    }
    // only the sample's tokens at or above the floor matter (and are few)
    // SAFETY: AVX-512F and POPCNT are enabled in this function.
    unsafe { filter_range(val, e, floor, f32::INFINITY, filtered) };
    let (fv, fe) = filtered;
    // sample mass per unit of probability
    let scale = rate * z;
    // the threshold where the estimated mass above crosses `share` (the
    // sampled mass below it falls under (1 - share)·z): the last rung short
    // of it and the first past it
    let cross = |share: f32| -> (f32, f32) {
        let need = total - (1.0 - share) * scale;
        let (mut lo, mut hi) = (floor, max);
        for _ in 0..PREDICT_LEVELS {
            let rungs = ladder::<RUNGS>(lo, hi);
            // SAFETY: AVX-512F and POPCNT are enabled in this function.
            let m = unsafe { masses(fv, fe, &rungs) };
            match (0..RUNGS).find(|&j| m[j] >= need) {
                Some(j) => {
                    lo = rungs[j];
                    if j > 0 {
                        hi = rungs[j - 1];
                    }
                }
                None => return (floor, floor),
            }
        }
        (hi, lo)
    };
    let (b_hi, _) = cross(p - CUT_SLACK);
    let (_, b_lo) = cross(p + CUT_SLACK);
    let (_, a) = cross(base + BASE_SLACK);
    (a > b_hi && b_hi > b_lo).then_some(Bounds { a, b_hi, b_lo })
}
