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
//!
//! This file holds [`walk`] and its phases (place the sets, narrow the
//! band, narrow the top set, then the exact replays); `placement.rs` the
//! bounds between the sets and the ladders that place them, `passes.rs`
//! the sets and the vectorised passes that fill them, `sample.rs` the
//! floor estimate and the sets placed from its sample, `middle.rs` the
//! middle's exact integer addition.

use super::bucket_walk::replay_sorted;
use super::exp::exp_div;
use super::grid_sum::F32Sum;
use super::shared::{Cut, Gathered, Sample, Target, sort_key};

mod middle;
mod passes;
mod placement;
mod sample;

use middle::Fixes;
use passes::{Grid, Middle, Part, PartRef, masses, split};
use placement::{Bounds, MASS_MARGIN, Placement, RUNGS, floor_ladder, ladder};
pub(super) use sample::estimate_floor;
use sample::predict;

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

/// Scratch of the ladder walk, kept in the large path's per-sequence
/// scratch.
#[derive(Clone, Default)]
pub(super) struct Ladder {
    top: Part,
    top_next: Part,
    band: Part,
    band_next: Part,
    mid: Middle,
    /// The sample's logits at or above the floor, and their exp.
    filtered: (Vec<f32>, Vec<f32>),
    fixes: Fixes,
    keys: Vec<u64>,
}

impl Ladder {
    /// Scratch for sampled tokens in a logit range.
    pub(super) fn filtered_mut(&mut self) -> &mut (Vec<f32>, Vec<f32>) {
        &mut self.filtered
    }

    /// Empties the top set, the middle and the band.
    fn clear_sets(&mut self) {
        self.top.clear();
        self.band.clear();
        self.mid.clear();
    }
}

/// Where the sets are split so far.
#[derive(Clone, Copy)]
struct Sets {
    bounds: Bounds,
    /// Approximate mass of everything above the band.
    before: f32,
    /// Whether the top set surely carries the sum past `base`.
    top_closed: bool,
}

/// llama.cpp's cut among the gathered tokens `g` (all `>= t.floor`), or
/// None when a fast-path assumption fails (the caller then runs the bucket
/// walk). Fills `g.prob` if no pass did.
///
/// # Safety
/// The CPU must support AVX-512F and POPCNT.
#[target_feature(enable = "avx512f,popcnt")]
pub(super) unsafe fn walk(
    t: Target,
    g: &mut Gathered,
    sample: &Sample,
    l: &mut Ladder,
) -> Option<Cut> {
    let usable =
        g.len() >= MIN_GATHERED && t.floor.is_finite() && (1e-6..1.0).contains(&t.p) && t.z >= 1.0;
    if !usable {
        return None;
    }
    let grid = Grid::of(t.p);
    // The probabilities (kept from the normaliser pass when it made them).
    if g.prob.len() != g.len() {
        // SAFETY: AVX-512F and POPCNT are enabled in this function.
        unsafe { exp_div(&g.val, t.max, t.z, &mut g.prob) };
    }
    let g = &*g;
    let mut sets = place(t, grid, g, sample, l)?;
    narrow_band(t, grid, &mut sets, l)?;
    if sets.top_closed && l.top.len() > TOP_TARGET {
        narrow_top(t, grid, &mut sets.bounds, l);
    }
    let mid_count = l.mid.count;
    if l.top.len() > SORTED_MAX || l.band.len() > SORTED_MAX || t.min_keep > l.top.len() + mid_count
    {
        return None;
    }
    // Exact: the top set in order, the middle as one integer addition,
    // the band in order until the cut.
    let mut sum = F32Sum::new();
    if let Some(cut) = replay(&l.top, &mut l.keys, &mut sum, 0, t) {
        return Some(cut);
    }
    if mid_count > 0 {
        middle::add(&mut sum, &l.mid, sets.bounds, g, &t, grid, &mut l.fixes)?;
    }
    replay(&l.band, &mut l.keys, &mut sum, l.top.len() + mid_count, t)
}

/// Places the sets and splits the gathered tokens into them: where the
/// floor estimate's sample puts them if the masses the split measures on
/// its way confirm it, else by a ladder over `[floor, max]`. None when
/// the middle would be too heavy for its grid.
#[target_feature(enable = "avx512f,popcnt")]
fn place(t: Target, grid: Grid, g: &Gathered, sample: &Sample, l: &mut Ladder) -> Option<Sets> {
    l.clear_sets();
    if let Some(sets) = place_by_sample(t, grid, g, sample, l) {
        return Some(sets);
    }
    l.clear_sets();
    place_by_ladder(t, grid, g, l)
}

/// The sets where the sample places them, split; None (the sets left
/// partly filled) unless the masses measured by the split confirm them.
#[target_feature(enable = "avx512f,popcnt")]
fn place_by_sample(
    t: Target,
    grid: Grid,
    g: &Gathered,
    sample: &Sample,
    l: &mut Ladder,
) -> Option<Sets> {
    let base = grid.base;
    // SAFETY: AVX-512F and POPCNT are enabled in this function.
    let b = unsafe { predict(sample, t.floor, t.max, t.z, t.p, base, &mut l.filtered) }?;
    let src = PartRef::gathered(g);
    // SAFETY: as above.
    let [m_a, m_hi, m_lo] =
        unsafe { split::<true>(src, b, grid, &mut l.top, &mut l.mid, &mut l.band) };
    let confirmed = m_a >= base + MASS_MARGIN
        && m_hi < t.p - MASS_MARGIN
        && (m_lo >= t.p + MASS_MARGIN || b.b_lo <= t.floor)
        && m_hi - m_a <= 2.0 * base;
    confirmed.then_some(Sets {
        bounds: b,
        before: m_hi,
        top_closed: true,
    })
}

/// The sets placed by a ladder of thresholds over `[floor, max]` and its
/// masses, split; None when the middle would be too heavy for its grid.
#[target_feature(enable = "avx512f,popcnt")]
fn place_by_ladder(t: Target, grid: Grid, g: &Gathered, l: &mut Ladder) -> Option<Sets> {
    let rungs = floor_ladder(t.floor, t.max);
    // SAFETY: AVX-512F and POPCNT are enabled in this function.
    let mass = unsafe { masses(&g.val, &g.prob, &rungs) };
    let place = Placement::new(&rungs, &mass, 0.0, t.p, grid.base, None);
    // the middle's probabilities must sum to clearly less than the binade
    // (the lane sums of the grid units then cannot wrap)
    if place.middle_mass > 2.0 * grid.base {
        return None;
    }
    let src = PartRef::gathered(g);
    // SAFETY: as above.
    unsafe { split::<false>(src, place.bounds, grid, &mut l.top, &mut l.mid, &mut l.band) };
    Some(Sets {
        bounds: place.bounds,
        before: place.mass_above_band,
        top_closed: place.top_closed,
    })
}

/// Narrows a band wider than `BAND_MAX`, a ladder of its own at a time
/// (at most `NARROW_ROUNDS`: equal logits cannot be split). None when a
/// middle would be too heavy for its grid.
#[target_feature(enable = "avx512f,popcnt")]
fn narrow_band(t: Target, grid: Grid, sets: &mut Sets, l: &mut Ladder) -> Option<()> {
    for _ in 0..NARROW_ROUNDS {
        if l.band.len() <= BAND_MAX {
            break;
        }
        let b = sets.bounds;
        let upper = if b.b_hi.is_finite() { b.b_hi } else { t.max };
        if !b.b_lo.is_finite() || upper <= b.b_lo {
            break;
        }
        *sets = split_band(t, grid, *sets, upper, l)?;
    }
    Some(())
}

/// One round of [`narrow_band`]: a ladder over the band `[b_lo, upper)`
/// places a narrower band in it, and the band is split by it (its upper
/// part joins the middle, or the top set while that is open). The new
/// sets, or None when the middle would be too heavy for its grid.
#[target_feature(enable = "avx512f,popcnt")]
fn split_band(t: Target, grid: Grid, sets: Sets, upper: f32, l: &mut Ladder) -> Option<Sets> {
    let Sets {
        bounds,
        before,
        top_closed,
    } = sets;
    let rungs = ladder::<RUNGS>(bounds.b_lo, upper);
    // SAFETY: AVX-512F and POPCNT are enabled in this function.
    let mass = unsafe { masses(&l.band.val, &l.band.v, &rungs) };
    // while the top set is still open (it ends where the band starts), the
    // band's upper part may close it
    let top_open = !top_closed;
    let top_end = (!top_open).then_some(bounds.b_hi);
    let place = Placement::new(&rungs, &mass, before, t.p, grid.base, top_end);
    if place.middle_mass > 2.0 * grid.base {
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
            &mut l.mid,
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
    Some(Sets {
        bounds: Bounds {
            // the top set grew into the band while it was open, and ends
            // where the band starts while it stays open
            a: match (top_open, place.top_closed) {
                (false, _) => bounds.a,
                (true, true) => place.bounds.a,
                (true, false) => b_hi,
            },
            b_hi,
            b_lo: place.bounds.b_lo,
        },
        before: place.mass_above_band,
        top_closed: place.top_closed,
    })
}

/// Narrows a closed top set: its part below the first rung (of a ladder
/// over `[a, max]`) whose mass clearly passes `base` joins the middle.
#[target_feature(enable = "avx512f,popcnt")]
fn narrow_top(t: Target, grid: Grid, bounds: &mut Bounds, l: &mut Ladder) {
    let rungs = ladder::<RUNGS>(bounds.a, t.max);
    // SAFETY: AVX-512F and POPCNT are enabled in this function.
    let mass = unsafe { masses(&l.top.val, &l.top.v, &rungs) };
    let Some(j) = (0..RUNGS).find(|&j| mass[j] >= grid.base + MASS_MARGIN) else {
        return;
    };
    let a = rungs[j];
    if a <= bounds.a {
        return;
    }
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
            &mut l.mid,
            &mut l.band_next,
        )
    };
    bounds.a = a;
}

/// Adds the tokens of `part` to `sum` in llama.cpp's order (the
/// `offset`-th onwards), exactly; the cut if it falls among them.
#[target_feature(enable = "avx512f,popcnt")]
fn replay(
    part: &Part,
    keys: &mut Vec<u64>,
    sum: &mut F32Sum,
    offset: usize,
    t: Target,
) -> Option<Cut> {
    keys.clear();
    keys.extend(
        part.idx
            .iter()
            .zip(&part.val)
            .map(|(&i, &l)| sort_key(l, i)),
    );
    keys.sort_unstable();
    replay_sorted(sum, keys, offset, t)
}
