//! The ladder walk's use of a sample of the logits: the floor estimate
//! (shared with the bucket walk's gather) and the sets placed from it.

use std::arch::x86_64::*;

use super::passes::masses;
use super::placement::{Bounds, RUNGS, ladder};
use crate::top_p::exp::{exp_div, lanes_below};
use crate::top_p::shared::Sample;

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
/// in `s` for [`predict`].
///
/// # Safety
/// The CPU must support AVX-512F and POPCNT.
#[target_feature(enable = "avx512f,popcnt")]
pub(in crate::top_p) unsafe fn estimate_floor(
    x: &[f32],
    max: f32,
    allowed_share: f32,
    s: &mut Sample,
    filtered: &mut (Vec<f32>, Vec<f32>),
) -> f32 {
    let n = x.len();
    let stride = (n / SAMPLE_LINES / 16 * 16).max(32);
    s.rate = 16.0 / stride as f32;
    let (sample, sample_e) = (&mut s.val, &mut s.e);
    sample.clear();
    let mut at = 0;
    while at + 16 <= n {
        sample.extend_from_slice(&x[at..at + 16]);
        at += stride;
    }
    // SAFETY: AVX-512F and POPCNT are enabled in this function.
    let total = unsafe { exp_div(sample, max, 1.0, sample_e) };
    s.total = total;
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

/// The sets placed from the sample of [`estimate_floor`]: the top set where
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
pub(super) unsafe fn predict(
    sample: &Sample,
    floor: f32,
    max: f32,
    z: f32,
    p: f32,
    base: f32,
    filtered: &mut (Vec<f32>, Vec<f32>),
) -> Option<Bounds> {
    let (val, e, rate, total) = (&sample.val[..], &sample.e[..], sample.rate, sample.total);
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
