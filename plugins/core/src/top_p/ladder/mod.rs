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

use super::bucket_walk::replay_sorted;
use super::cut::{Cut, sort_key};
use super::exp::{EXP_REL_ERR, libm_exp};
use super::grid_sum::{F32Sum, LIMIT, MAGIC, MAGIC_BITS, exact_units};
use super::nucleus::{Scratch, Target};

mod passes;
mod placement;
mod sample;

pub(super) use passes::exp_div;
use passes::{PartRef, TIES_PER_PASS, masses, split, units_before};
use placement::{Placement, floor_ladder, ladder};
pub(super) use sample::estimate_floor;
use sample::predict;

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
