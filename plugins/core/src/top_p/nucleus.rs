//! [`nucleus`], the large path's driver: estimate a floor from a sample,
//! run the normaliser pass (which gathers the tokens above the floor),
//! lower the floor until the gathered tokens hold clearly more than p of
//! the mass, then walk them for the cut (the AVX-512 ladder walk first,
//! where it runs, then the bucket walk). Also the per-sequence
//! [`Scratch`] that holds every pass's buffers.

use super::bucket_walk::{self, Buckets};
#[cfg(target_arch = "x86_64")]
use super::ladder::{self, Ladder};
use super::normaliser::softmax_sum_and_gather;
#[cfg(target_arch = "x86_64")]
use super::shared::has_avx512;
use super::shared::{Cut, Gathered, Sample, Target};
use crate::util::exp_f32;

/// Scratch of [`nucleus`], kept in per-sequence state.
#[derive(Clone, Default)]
pub(super) struct Scratch {
    pub(super) gathered: Gathered,
    pub(super) sample: Sample,
    pub(super) buckets: Buckets,
    #[cfg(target_arch = "x86_64")]
    pub(super) ladder: Ladder,
}

impl Scratch {
    /// The tokens [`nucleus`] gathered, in position order: a superset of
    /// the kept ones.
    pub(super) fn gathered(&self) -> &Gathered {
        &self.gathered
    }
}

/// Every SAMPLE_STRIDE-th logit estimates where the cut lands.
const SAMPLE_STRIDE: usize = 32;
/// Fraction of the tail mass `(1 - p)` the first floor leaves out: close
/// to 1 keeps the gathered set small; the gathered mass is checked, so a
/// miss only costs one more gather pass.
const TAIL_SHARE: f32 = 0.9;
/// Relative slack on the gathered mass before the walk trusts the floor
/// (the walk's f32 running sum may drift from the exact mass by rounding).
const MASS_SLACK: f32 = 4e-3;

/// llama.cpp's top-p over `x` (the logits in list order). The kept tokens
/// are those with `cut.keeps(x[i], i)`.
pub(super) fn nucleus(x: &[f32], max: f32, p: f32, min_keep: usize, s: &mut Scratch) -> Cut {
    let target = gather_nucleus(x, max, p, min_keep, s);
    if let Some(cut) = walk(target, s) {
        return cut;
    }
    // The running sum never reached p inside the gathered set (rounding
    // drift beyond the slack, or the sum never reaches p at all):
    // everything.
    if target.floor > f32::NEG_INFINITY {
        gather_at_least(x, max, f32::NEG_INFINITY, target.floor, &mut s.gathered);
        let everything = Target {
            floor: f32::NEG_INFINITY,
            ..target
        };
        if let Some(cut) = walk(everything, s) {
            return cut;
        }
    }
    Cut {
        kept: x.len(),
        last_key: u64::MAX,
    }
}

/// Walks the gathered tokens for the cut: the ladder walk where it runs
/// and decides, else the bucket walk (exact in every case).
pub(super) fn walk(t: Target, s: &mut Scratch) -> Option<Cut> {
    #[cfg(target_arch = "x86_64")]
    if has_avx512() {
        // SAFETY: the CPU supports AVX-512F and POPCNT (checked just above).
        let cut = unsafe { ladder::walk(t, &mut s.gathered, &s.sample, &mut s.ladder) };
        if cut.is_some() {
            return cut;
        }
    }
    bucket_walk::walk(t, &s.gathered, &mut s.buckets)
}

/// The normaliser and the gathered set (`s.gathered`): a floor low enough
/// that the gathered tokens hold clearly more than p of the mass.
pub(super) fn gather_nucleus(
    x: &[f32],
    max: f32,
    p: f32,
    min_keep: usize,
    s: &mut Scratch,
) -> Target {
    let mut floor = estimate_floor(x, max, p, s);
    let (z, mut mass) = softmax_sum_and_gather(x, max, floor, &mut s.gathered);
    // Lower the floor until the gathered tokens hold clearly more than p
    // of the mass (and at least min_keep of them): then the cut is among
    // them, and only they are bucketed.
    let need = p * z * (1.0 + MASS_SLACK);
    let mut step = 2.0f32;
    while floor > f32::NEG_INFINITY && (mass < need || s.gathered.len() < min_keep) {
        let lower = if max - floor > 64.0 {
            f32::NEG_INFINITY
        } else {
            floor - step
        };
        mass += gather_at_least(x, max, lower, floor, &mut s.gathered);
        floor = lower;
        step *= 2.0;
    }
    Target {
        max,
        z,
        p,
        min_keep,
        floor,
    }
}

/// Replaces `g` with the tokens `x[i] >= lo` (position order) and returns
/// `Σ exp(x[i] - max)` over the new ones, those below `hi` (a lower floor
/// after the first one proved too high).
fn gather_at_least(x: &[f32], max: f32, lo: f32, hi: f32, g: &mut Gathered) -> f32 {
    g.clear();
    let mut mass = 0.0f32;
    for (i, &v) in x.iter().enumerate() {
        if v >= lo {
            g.push(i as u32, v);
            if v < hi {
                mass += exp_f32(v - max);
            }
        }
    }
    mass
}

/// A logit floor under which the tokens should hold about
/// `TAIL_SHARE · (1 - p)` of the mass, estimated from every
/// SAMPLE_STRIDE-th token.
fn estimate_floor(x: &[f32], max: f32, p: f32, s: &mut Scratch) -> f32 {
    #[cfg(target_arch = "x86_64")]
    if has_avx512() {
        let share = (1.0 - p) * TAIL_SHARE;
        // SAFETY: the CPU supports AVX-512F and POPCNT (checked just above).
        return unsafe {
            ladder::estimate_floor(x, max, share, &mut s.sample, s.ladder.filtered_mut())
        };
    }
    let sample = &mut s.sample;
    sample.val.clear();
    sample.val.extend(x.iter().step_by(SAMPLE_STRIDE).copied());
    sample.e.clear();
    sample
        .e
        .extend(sample.val.iter().map(|&v| exp_f32(v - max)));
    let total = masked_sum(&sample.val, &sample.e, f32::INFINITY);
    let allowed = (1.0 - p) * total * TAIL_SHARE;
    // bisection on t in [max - 64, max]: the mass below t grows with t
    let (mut lo, mut hi) = (max - 64.0, max);
    if masked_sum(&sample.val, &sample.e, hi) <= allowed {
        return hi;
    }
    for _ in 0..10 {
        let mid = 0.5 * (lo + hi);
        if masked_sum(&sample.val, &sample.e, mid) <= allowed {
            lo = mid;
        } else {
            hi = mid;
        }
    }
    lo
}

/// Σ e[i] over v[i] < t (16 f32 lanes, so it vectorises).
fn masked_sum(v: &[f32], e: &[f32], t: f32) -> f32 {
    let mut acc = [0.0f32; 16];
    let mut vc = v.chunks_exact(16);
    let mut ec = e.chunks_exact(16);
    for (vv, ee) in (&mut vc).zip(&mut ec) {
        for l in 0..16 {
            // branch-free select, so the loop vectorises
            let keep = ((vv[l] < t) as u32).wrapping_neg();
            acc[l] += f32::from_bits(ee[l].to_bits() & keep);
        }
    }
    let mut sum: f32 = acc.iter().sum();
    for (&vv, &ee) in vc.remainder().iter().zip(ec.remainder()) {
        if vv < t {
            sum += ee;
        }
    }
    sum
}
