//! Where the ladder walk's sets go, importing no sibling: the [`Bounds`]
//! between them, ladders of logit thresholds and the placement of the top
//! set, the middle and the band from their masses.

#![forbid(unsafe_code)]

/// Thresholds of the ladder over all gathered tokens (when the sample's
/// placement fails; each costs a compare and an add per token), and of the
/// other ladders (a band's, the top set's, the sample's).
pub(super) const FIRST_RUNGS: usize = 16;
pub(super) const RUNGS: usize = 16;
/// Absolute slack on the approximate masses (all in [0, 1]; their f32
/// lane sums drift by far less) when placing the sets.
pub(super) const MASS_MARGIN: f32 = 1e-4;

/// Which set a token falls in, by logit: top `l >= a`, middle
/// `b_hi <= l < a`, band `b_lo <= l < b_hi`, dropped below `b_lo`.
#[derive(Clone, Copy, Debug)]
pub(super) struct Bounds {
    pub(super) a: f32,
    pub(super) b_hi: f32,
    pub(super) b_lo: f32,
}

/// R thresholds descending from just below `hi` to `lo` (the last is `lo`
/// itself).
pub(super) fn ladder<const R: usize>(lo: f32, hi: f32) -> [f32; R] {
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
pub(super) fn floor_ladder(lo: f32, hi: f32) -> [f32; FIRST_RUNGS] {
    let span = hi - lo;
    let mut r = FIRST_LADDER.map(|f| lo + span * f);
    r[FIRST_RUNGS - 1] = lo;
    r
}

/// Where the sets go, from a ladder's masses (mass above rung j, plus
/// `before`, the mass of the tokens above the ladder).
pub(super) struct Placement {
    pub(super) bounds: Bounds,
    /// Approximate mass of everything above the band.
    pub(super) mass_above_band: f32,
    /// Approximate mass of this ladder's middle.
    pub(super) middle_mass: f32,
    /// Whether the top set surely carries the sum past `base`.
    pub(super) top_closed: bool,
}

impl Placement {
    /// `top_end`: where an already closed top set ends (None while it is
    /// open).
    pub(super) fn new<const R: usize>(
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
