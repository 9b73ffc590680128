//! The ladder walk's middle added to the running sum as one integer
//! addition on p's binade's grid: the lanes whose rounding the
//! approximation could not decide are settled by libm's value, and an
//! exact tie is rounded to even by the units ordered before it, as
//! llama.cpp's in-order additions round them.

use super::passes::{Grid, Middle, TIES_PER_PASS, units_before};
use super::placement::Bounds;
use crate::top_p::exp::libm_exp;
use crate::top_p::grid_sum::{F32Sum, LIMIT, MAGIC, MAGIC_BITS, exact_units};
use crate::top_p::shared::{Gathered, Target, sort_key};

/// Scratch of [`add`]: the corrections of the settled lanes (key, units)
/// and the exact ties (key, units rounded down, approximate units).
#[derive(Clone, Default)]
pub(super) struct Fixes {
    lanes: Vec<(u64, i64)>,
    ties: Vec<(u64, i64, i64)>,
}

/// Adds the middle `mid` (the gathered tokens of `g` with `b.b_hi <= l <
/// b.a`) to `sum`, exactly as adding its tokens one by one in llama.cpp's
/// order would. None when that cannot be shown (the sum is not on the
/// grid of p's binade, a lane is off the grid, the sum would leave the
/// binade) or when the cut lies in the middle.
#[target_feature(enable = "avx512f,popcnt")]
pub(super) fn add(
    sum: &mut F32Sum,
    mid: &Middle,
    b: Bounds,
    g: &Gathered,
    t: &Target,
    grid: Grid,
    f: &mut Fixes,
) -> Option<()> {
    if !(sum.on_grid && sum.exp == grid.exp) {
        return None;
    }
    let mut units = sum.units as i64 + mid.units as i64;
    units += settle_lanes(mid, t, grid, f)?;
    if !f.ties.is_empty() {
        units += round_ties(sum.units, (b.b_hi, b.a), g, grid, f);
    }
    if units >= LIMIT as i64 {
        return None;
    }
    sum.units = units as u32;
    // the cut lies in the middle: this walk cannot place it
    (sum.value() < t.p).then_some(())
}

/// The correction, in grid units, of the middle's uncertain lanes whose
/// exact value (libm's) is no tie; the ties go to `f.ties`. None if a lane
/// is off the grid.
#[target_feature(enable = "avx512f,popcnt")]
fn settle_lanes(mid: &Middle, t: &Target, grid: Grid, f: &mut Fixes) -> Option<i64> {
    f.lanes.clear();
    f.ties.clear();
    let mut fixes = 0i64;
    let u = &mid.uncertain;
    for ((&lv, &v), &i) in u.val.iter().zip(&u.v).zip(&u.idx) {
        let approx = grid_units_below(v * grid.inv, grid.rel_err) as i64;
        let q = libm_exp(lv - t.max) / t.z * grid.inv;
        if q >= MAGIC {
            return None;
        }
        let key = sort_key(lv, i);
        match exact_units(q) {
            Some(r) => {
                let fix = r as i64 - approx;
                fixes += fix;
                f.lanes.push((key, fix));
            }
            None => f.ties.push((key, q.floor() as i64, approx)),
        }
    }
    Some(fixes)
}

/// The correction, in grid units, of the exact ties in `f.ties`: each
/// rounds to even, which depends on the units before it in llama.cpp's
/// order (`sum_units` before the middle, the middle tokens `middle.0 <= l <
/// middle.1` ordered before it, the settled lanes and the earlier ties).
#[target_feature(enable = "avx512f,popcnt")]
fn round_ties(sum_units: u32, middle: (f32, f32), g: &Gathered, grid: Grid, f: &mut Fixes) -> i64 {
    f.ties.sort_unstable();
    let mut tie_fixes = 0i64;
    for group in f.ties.chunks(TIES_PER_PASS) {
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
            let pre = sum_units as i64
                + b as i64
                + f.lanes
                    .iter()
                    .filter(|l| l.0 < key)
                    .map(|l| l.1)
                    .sum::<i64>()
                + tie_fixes;
            let exact = r_floor + ((pre + r_floor) & 1);
            tie_fixes += exact - approx;
        }
    }
    tie_fixes
}

/// The approximate units the split adds for a probability `q` (in units)
/// known within a relative `rel_err`: `round(q·(1 - rel_err))`, the lower
/// end of its bracket, rounded once by a fused multiply-add.
#[inline(always)]
fn grid_units_below(q: f32, rel_err: f32) -> u32 {
    q.min(MAGIC).mul_add(1.0 - rel_err, MAGIC).to_bits() - MAGIC_BITS
}
