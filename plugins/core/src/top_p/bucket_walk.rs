//! The bucket walk: llama.cpp's running sum over the gathered tokens in
//! descending logit order, one logit bucket at a time, exact in every case
//! (on AVX-512 the ladder walk tries first and hands over to it), its
//! scratch ([`Buckets`]), and the exact replay of sorted tokens
//! ([`replay_sorted`]) that both walks end with.

use super::exp::{EXP_REL_ERR, libm_exp};
use super::grid_sum::{BLOCK, Block, F32Sum, LIMIT};
#[cfg(target_arch = "x86_64")]
use super::shared::has_avx512;
use super::shared::{Cut, Gathered, Target, key_logit, sort_key};
use crate::util::exp_f32;

/// Scratch of the bucket walk, kept in per-sequence state.
#[derive(Clone, Default)]
pub(super) struct Buckets {
    /// Gathered keys `(desc_key(l) << 32) | position`, in bucket order.
    keys: Vec<u64>,
    bucket: Vec<u32>,
    counts: Vec<u32>,
    next: Vec<u32>,
}

/// The walk's buckets hold about this many gathered tokens on average.
const PER_BUCKET: usize = 64;
/// Interleaved histograms of the bucketing (see `walk_impl`).
const LANES: usize = 4;
/// Bounds on the number of buckets.
const MIN_BUCKETS: usize = 16;
const MAX_BUCKETS: usize = 4096;

/// `a[j] = exp_f32(key_logit(k[j]) - max) / z` for `k.len() <= BLOCK`
/// lanes (the rest 0).
#[inline(always)]
fn exp_div_keys_impl(k: &[u64], max: f32, z: f32, a: &mut [f32; BLOCK]) {
    let mut v = [f32::NEG_INFINITY; BLOCK];
    for (v, &k) in v.iter_mut().zip(k) {
        *v = key_logit((k >> 32) as u32) - max;
    }
    for (o, &x) in a.iter_mut().zip(&v) {
        *o = exp_f32(x) / z;
    }
}

/// Walks the gathered tokens (all `>= floor`) in descending logit order
/// with llama.cpp's f32 running sum of `expf(l - max) / z`, a bucket of
/// logits at a time: a bucket whose additions stay in one binade, hold no
/// tie or uncertain lane and do not reach the cut is one integer addition
/// of rounded values, in any order; only the other buckets are sorted and
/// replayed in order. None if the cut is not inside the gathered set `g`.
pub(super) fn walk(t: Target, g: &Gathered, s: &mut Buckets) -> Option<Cut> {
    #[cfg(target_arch = "x86_64")]
    if has_avx512() {
        // SAFETY: the CPU supports AVX-512F and POPCNT (checked just above).
        return unsafe { walk_avx512(t, g, s) };
    }
    #[cfg(target_arch = "x86_64")]
    if samplerd_numerics::features().avx2() {
        // SAFETY: the CPU supports AVX2 (checked just above).
        return unsafe { walk_avx2(t, g, s) };
    }
    walk_impl(t, g, s)
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,popcnt")]
unsafe fn walk_avx512(t: Target, g: &Gathered, s: &mut Buckets) -> Option<Cut> {
    walk_impl(t, g, s)
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
unsafe fn walk_avx2(t: Target, g: &Gathered, s: &mut Buckets) -> Option<Cut> {
    walk_impl(t, g, s)
}

/// The walk, compiled once per instruction set (the exp, the grid
/// rounding and the bucketing all vectorise). Rust never contracts a
/// multiply and an add into a fused multiply-add, so every version
/// computes the same values.
#[inline(always)]
pub(super) fn walk_impl(t: Target, g: &Gathered, s: &mut Buckets) -> Option<Cut> {
    let Target {
        max,
        z,
        p,
        min_keep,
        floor,
    } = t;
    let n = g.len();
    if n == 0 {
        return None;
    }
    // Counting sort into buckets of equal logit width (stable: positions
    // ascend inside a bucket).
    let lo = if floor == f32::NEG_INFINITY {
        g.val
            .iter()
            .copied()
            .filter(|v| v.is_finite())
            .fold(max, f32::min)
    } else {
        floor
    };
    let nb = (n / PER_BUCKET).clamp(MIN_BUCKETS, MAX_BUCKETS);
    let span = max - lo;
    let scale = if span > 0.0 {
        (nb - 1) as f32 / span
    } else {
        0.0
    };
    let top = (nb - 1) as u32;
    s.bucket.clear();
    s.bucket.resize(n, 0);
    // clamped in f32 so the loop vectorises: -inf logits land in the last
    // bucket (a NaN from inf * 0, when the span is 0, becomes 0 first)
    let top_f = top as f32;
    for (b, &v) in s.bucket.iter_mut().zip(&g.val) {
        let t = ((max - v) * scale).max(0.0).min(top_f);
        // SAFETY: t is finite and in [0, top] (max/min drop NaN).
        *b = unsafe { t.to_int_unchecked::<u32>() };
    }
    // Four interleaved histograms and cursor sets: consecutive tokens
    // often fall in the same (dense) bucket, and one counter would chain
    // every increment through memory.
    s.counts.clear();
    s.counts.resize(LANES * nb + 1, 0);
    {
        let (c, rest) = s.counts.split_at_mut(1);
        let _ = c;
        for (j, &b) in s.bucket.iter().enumerate() {
            rest[b as usize * LANES + j % LANES] += 1;
        }
    }
    // exclusive prefix: counts[b * LANES + l] = start of (bucket b, lane l)
    for t in 1..=LANES * nb {
        s.counts[t] += s.counts[t - 1];
    }
    s.keys.clear();
    s.keys.resize(n, 0);
    s.next.clear();
    s.next.extend_from_slice(&s.counts[..LANES * nb]);
    for (j, ((&b, &v), &i)) in s.bucket.iter().zip(&g.val).zip(&g.idx).enumerate() {
        let at = &mut s.next[b as usize * LANES + j % LANES];
        s.keys[*at as usize] = sort_key(v, i);
        *at += 1;
    }

    let mut sum = F32Sum::new();
    let mut blk = Block::default();
    let mut a = [0.0f32; BLOCK];
    let rel_err = 2.0 * EXP_REL_ERR; // the division adds one rounding
    for b in 0..nb {
        let (b0, b1) = (
            s.counts[b * LANES] as usize,
            s.counts[(b + 1) * LANES] as usize,
        );
        if b0 == b1 {
            continue;
        }
        // Fast path: the whole bucket as one integer addition.
        if let Some(total) = bucket_units(&sum, &s.keys[b0..b1], max, z, rel_err, &mut a, &mut blk)
        {
            let end = (sum.units + total) as f32 * sum.unit;
            if !(end >= p && b1 >= min_keep) {
                sum.units += total;
                continue;
            }
        }
        // Slow path: sort the bucket, replay it in order.
        let keys = &mut s.keys[b0..b1];
        keys.sort_unstable();
        if let Some(cut) = replay_sorted(&mut sum, keys, b0, t) {
            return Some(cut);
        }
    }
    None
}

/// Adds the tokens of `keys` (sorted, the `offset`-th onwards in
/// llama.cpp's order) to the running sum in order, exactly, and returns
/// the cut if it falls among them.
#[inline(always)]
pub(super) fn replay_sorted(
    sum: &mut F32Sum,
    keys: &[u64],
    offset: usize,
    t: Target,
) -> Option<Cut> {
    let Target {
        max,
        z,
        p,
        min_keep,
        ..
    } = t;
    let rel_err = 2.0 * EXP_REL_ERR; // the division adds one rounding
    let mut blk = Block::default();
    let mut a = [0.0f32; BLOCK];
    for (c, chunk) in keys.chunks(BLOCK).enumerate() {
        let m = chunk.len();
        let first = offset + c * BLOCK;
        exp_div_keys_impl(chunk, max, z, &mut a);
        let mut stop = |j: usize, cum: f32| cum >= p && first + j + 1 >= min_keep;
        let exact = |j: usize| libm_exp(key_logit((chunk[j] >> 32) as u32) - max) / z;
        if let Some(j) = sum.add_block_until(&a, m, rel_err, &mut blk, exact, &mut stop) {
            return Some(Cut {
                kept: first + j + 1,
                last_key: chunk[j],
            });
        }
    }
    None
}

/// `Σ round_u(e/z)` over a bucket's keys on the running sum's grid, when
/// no lane is a tie or within the error bound of a rounding boundary and
/// the sum stays in the binade; None otherwise (or off the grid).
#[inline(always)]
fn bucket_units(
    sum: &F32Sum,
    keys: &[u64],
    max: f32,
    z: f32,
    rel_err: f32,
    a: &mut [f32; BLOCK],
    blk: &mut Block,
) -> Option<u32> {
    if !sum.on_grid {
        return None;
    }
    let mut total = 0u32;
    for chunk in keys.chunks(BLOCK) {
        exp_div_keys_impl(chunk, max, z, a);
        let (mut part, bad) = sum.round_block(a, rel_err, blk);
        if bad != 0 {
            // the few lanes near a rounding boundary: libm's exact value
            // decides, unless one is a tie (which needs the order)
            let mut exact = |j: usize| libm_exp(key_logit((chunk[j] >> 32) as u32) - max) / z;
            part = sum.resolve(bad, rel_err, blk, &mut exact, part)?;
        }
        total += part;
        if sum.units + total >= LIMIT {
            return None;
        }
    }
    Some(total)
}
