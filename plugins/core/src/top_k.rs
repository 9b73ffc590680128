//! `top_k`: keeps the k highest-logit candidates, sorted descending
//! (llama.cpp `top-k`). In the dense view it selects straight from the
//! 151,936 logits in one pass at about the cost of one max-scan: a SIMD
//! threshold filter (16 lanes with AVX-512, 8 with AVX2, 4 with SSE2)
//! compares 64 logits at a time against a lower bound of the k-th best
//! value and only the lanes that reach it (movemask) are appended to a
//! small buffer. The bound starts from a guess read off a small sample (a
//! wrong guess costs a second pass, never a different result); when the
//! buffer fills, a selection keeps its k best and raises the bound.
//!
//! Ties: exactly k survive; among equal logits (-0.0 == 0.0) the lower
//! token id (dense view) or the earlier position (candidate view) wins. For
//! k > 256 a select-then-sort path is used whose tie order is lower id
//! first.

use std::cmp::Ordering;
use std::ffi::CStr;

use samplerd_plugin_sdk::defaults;
use samplerd_plugin_sdk::prelude::*;

use crate::util::{self, CHUNK, desc};

/// Above this k the threshold filter's buffer stops being small.
const SMALL_K: usize = 256;

/// Smallest capacity of the filter buffer before it is cut back to k: big
/// enough that on random logits the bound is raised about once per call,
/// small enough to stay in L1.
const MIN_FILTER_CAP: usize = 512;

/// Chunks sampled (evenly spaced) to guess the filter's starting bound.
const SAMPLE_CHUNKS: usize = 16;

/// The guess aims at about this many survivors per k: on random logits the
/// true k-th best falls below it with probability ~0.3 % (then the pass is
/// redone from -inf), and the survivors still fit the buffer.
const SURVIVORS_PER_K: usize = 8;

/// Highest sample rank the guess reads; larger ranks mean a vocabulary too
/// small for the sample to pay off.
const MAX_SAMPLE_RANK: usize = 16;

pub struct TopK {
    k: usize,
}

/// Reusable scratch of the selection (kept in a stage's state).
#[derive(Clone, Default)]
pub struct Selector {
    best: Vec<SdCandidate>,
    vals: Vec<f32>,
}

/// The output order: descending logit, equal logits (`==`, so -0.0 and 0.0
/// tie) by lower id. Total on the non-NaN entries the filter collects.
#[inline]
fn rank(a: &SdCandidate, b: &SdCandidate) -> Ordering {
    b.logit
        .partial_cmp(&a.logit)
        .unwrap_or(Ordering::Equal)
        .then(a.id.cmp(&b.id))
}

/// Cuts `buf` back to its k best and returns the new filter bound. Every
/// later element has a higher id than all kept ones, so one equal to the
/// k-th best loses the tie to all of them: only strictly greater values
/// can still get in, i.e. values `>= next_up(k-th)`.
#[cold]
fn compact(buf: &mut Vec<SdCandidate>, k: usize) -> f32 {
    buf.select_nth_unstable_by(k - 1, rank);
    buf.truncate(k);
    buf[k - 1].logit.next_up()
}

/// Appends to `buf` (capacity >= cap + CHUNK) every element of `x` that can
/// be among the k best, in one pass from a guessed bound (two passes when
/// the guess was too high).
/// `any(c, t)` says whether some element of the chunk is `>= t`; `mask(c,
/// t)` has bit j set when `c[j] >= t` (NaN never is).
#[inline(always)]
fn filter_impl(
    x: &[f32],
    k: usize,
    cap: usize,
    buf: &mut Vec<SdCandidate>,
    any: impl Fn(&[f32; CHUNK], f32) -> bool + Copy,
    mask: impl Fn(&[f32; CHUNK], f32) -> u64 + Copy,
) {
    let guess = guess_bound(x, k, any, mask);
    filter_from(x, k, cap, buf, guess, any, mask);
    // Fewer than k reached the guess: it was above the k-th best, so
    // elements it skipped may belong to the result. Redo without it.
    if buf.len() < k && guess > f32::NEG_INFINITY {
        buf.clear();
        filter_from(x, k, cap, buf, f32::NEG_INFINITY, any, mask);
    }
}

/// A guess at a bound just below the k-th best of `x`, read off an evenly
/// spaced sample of SAMPLE_CHUNKS chunks: the sample value whose rank there
/// matches SURVIVORS_PER_K * k survivors in `x` (-inf when `x` is too small
/// for a sample). Only the speed depends on it, never the result.
#[inline(always)]
fn guess_bound(
    x: &[f32],
    k: usize,
    any: impl Fn(&[f32; CHUNK], f32) -> bool,
    mask: impl Fn(&[f32; CHUNK], f32) -> u64,
) -> f32 {
    let n_chunks = x.len() / CHUNK;
    let sampled = SAMPLE_CHUNKS * CHUNK;
    let rank = (SURVIVORS_PER_K * k * sampled).div_ceil(x.len().max(1));
    if n_chunks < 4 * SAMPLE_CHUNKS || rank > MAX_SAMPLE_RANK {
        return f32::NEG_INFINITY;
    }
    // The `rank` largest sample values, descending (-inf padded).
    let mut top = [f32::NEG_INFINITY; MAX_SAMPLE_RANK];
    for s in 0..SAMPLE_CHUNKS {
        let ci = s * n_chunks / SAMPLE_CHUNKS;
        let c: &[f32; CHUNK] = x[ci * CHUNK..(ci + 1) * CHUNK].try_into().expect("chunk");
        let t = top[rank - 1].next_up();
        if !any(c, t) {
            continue;
        }
        let mut m = mask(c, t);
        while m != 0 {
            let v = c[m.trailing_zeros() as usize];
            m &= m - 1;
            if v > top[rank - 1] {
                let pos = top[..rank].partition_point(|&b| b >= v);
                top.copy_within(pos..rank - 1, pos + 1);
                top[pos] = v;
            }
        }
    }
    top[rank - 1]
}

/// The filter pass proper, starting from bound `t`.
#[inline(always)]
fn filter_from(
    x: &[f32],
    k: usize,
    cap: usize,
    buf: &mut Vec<SdCandidate>,
    mut t: f32,
    any: impl Fn(&[f32; CHUNK], f32) -> bool,
    mask: impl Fn(&[f32; CHUNK], f32) -> u64,
) {
    let mut chunks = x.chunks_exact(CHUNK);
    for (ci, c) in (&mut chunks).enumerate() {
        let c: &[f32; CHUNK] = c.try_into().expect("chunk");
        if !any(c, t) {
            continue;
        }
        let mut m = mask(c, t);
        let base = ci * CHUNK;
        while m != 0 {
            let j = m.trailing_zeros() as usize;
            m &= m - 1;
            buf.push(SdCandidate {
                id: (base + j) as u32,
                logit: c[j],
            });
        }
        if buf.len() >= cap {
            t = compact(buf, k);
        }
    }
    // Fewer than CHUNK more pushes: still within the reserved capacity.
    let tail = x.len() - chunks.remainder().len();
    for (j, &v) in chunks.remainder().iter().enumerate() {
        if v >= t {
            buf.push(SdCandidate {
                id: (tail + j) as u32,
                logit: v,
            });
        }
    }
}

/// [`filter_impl`] with the SSE2 compare masks (x86_64 baseline) or the
/// portable ones.
fn filter_base(x: &[f32], k: usize, cap: usize, buf: &mut Vec<SdCandidate>) {
    filter_impl(
        x,
        k,
        cap,
        buf,
        |c, t| util::ge_mask(c, t) != 0,
        util::ge_mask,
    );
}

/// [`filter_impl`] with 8-lane compares.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
fn filter_avx2(x: &[f32], k: usize, cap: usize, buf: &mut Vec<SdCandidate>) {
    use std::arch::x86_64::*;
    filter_impl(
        x,
        k,
        cap,
        buf,
        |c, t| {
            let p = c.as_ptr();
            // SAFETY: AVX2 is enabled on this function (the caller checked
            // the CPU); the loads read floats 0..64 of a 64-float array.
            unsafe {
                let tv = _mm256_set1_ps(t);
                let mut acc = _mm256_cmp_ps::<_CMP_GE_OQ>(_mm256_loadu_ps(p), tv);
                for q in 1..CHUNK / 8 {
                    let v = _mm256_loadu_ps(p.add(q * 8));
                    acc = _mm256_or_ps(acc, _mm256_cmp_ps::<_CMP_GE_OQ>(v, tv));
                }
                _mm256_testz_ps(acc, acc) == 0
            }
        },
        |c, t| {
            let p = c.as_ptr();
            let mut m = 0u64;
            // SAFETY: as above.
            unsafe {
                let tv = _mm256_set1_ps(t);
                for q in 0..CHUNK / 8 {
                    let v = _mm256_loadu_ps(p.add(q * 8));
                    let b = _mm256_movemask_ps(_mm256_cmp_ps::<_CMP_GE_OQ>(v, tv));
                    m |= (b as u32 as u64) << (q * 8);
                }
            }
            m
        },
    );
}

/// [`filter_impl`] with 16-lane compares into mask registers.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
fn filter_avx512(x: &[f32], k: usize, cap: usize, buf: &mut Vec<SdCandidate>) {
    use std::arch::x86_64::*;
    filter_impl(
        x,
        k,
        cap,
        buf,
        |c, t| {
            let p = c.as_ptr();
            // SAFETY: AVX-512F is enabled on this function (the caller
            // checked the CPU); the loads read floats 0..64 of a 64-float
            // array.
            unsafe {
                let tv = _mm512_set1_ps(t);
                let m0 = _mm512_cmp_ps_mask::<_CMP_GE_OQ>(_mm512_loadu_ps(p), tv);
                let m1 = _mm512_cmp_ps_mask::<_CMP_GE_OQ>(_mm512_loadu_ps(p.add(16)), tv);
                let m2 = _mm512_cmp_ps_mask::<_CMP_GE_OQ>(_mm512_loadu_ps(p.add(32)), tv);
                let m3 = _mm512_cmp_ps_mask::<_CMP_GE_OQ>(_mm512_loadu_ps(p.add(48)), tv);
                (m0 | m1 | m2 | m3) != 0
            }
        },
        |c, t| {
            let p = c.as_ptr();
            let mut m = 0u64;
            // SAFETY: as above.
            unsafe {
                let tv = _mm512_set1_ps(t);
                for q in 0..CHUNK / 16 {
                    let v = _mm512_loadu_ps(p.add(q * 16));
                    m |= (_mm512_cmp_ps_mask::<_CMP_GE_OQ>(v, tv) as u64) << (q * 16);
                }
            }
            m
        },
    );
}

impl Selector {
    /// The `k` (1 <= k <= min(SMALL_K, x.len())) largest of `x`, as
    /// (index, value) in `self.best`, sorted descending, ties by lower
    /// index. NaN (which the host refuses) is ranked last.
    fn select_small(&mut self, x: &[f32], k: usize) {
        let cap = (4 * k).max(MIN_FILTER_CAP);
        let best = &mut self.best;
        best.clear();
        best.reserve(cap + CHUNK);
        #[cfg(target_arch = "x86_64")]
        {
            let cpu = samplerd_numerics::features();
            if cpu.avx512f() {
                // SAFETY: the CPU supports AVX-512F (checked just above).
                unsafe { filter_avx512(x, k, cap, best) };
            } else if cpu.avx2() {
                // SAFETY: the CPU supports AVX2 (checked just above).
                unsafe { filter_avx2(x, k, cap, best) };
            } else {
                filter_base(x, k, cap, best);
            }
        }
        #[cfg(not(target_arch = "x86_64"))]
        filter_base(x, k, cap, best);
        if best.len() > k {
            best.select_nth_unstable_by(k - 1, rank);
            best.truncate(k);
        }
        best.sort_unstable_by(rank);
        // Only NaN escapes the filter; fill up with it so exactly k survive
        // (after the sort: NaN has no rank).
        if best.len() < k {
            for (i, &v) in x.iter().enumerate() {
                if v.is_nan() {
                    best.push(SdCandidate {
                        id: i as u32,
                        logit: v,
                    });
                    if best.len() == k {
                        break;
                    }
                }
            }
        }
    }
}

/// Keeps the `k` best live entries, sorted descending, in the candidate
/// view (k is clamped to the live length; k == 0 keeps everything but
/// still leaves the buffer as candidates).
pub fn keep_top(tokens: &mut Tokens<'_>, k: usize, sel: &mut Selector) {
    let n = tokens.len();
    let k = k.min(n);
    if tokens.view() == ViewKind::Candidates && tokens.is_sorted() {
        tokens.truncate(k);
        return;
    }
    if k == 0 {
        util::to_candidates(tokens);
        tokens.set_candidates(0, true);
        return;
    }
    if k <= SMALL_K {
        match tokens.view() {
            ViewKind::Dense => {
                sel.select_small(tokens.dense(), k);
                let (_, cand) = tokens.dense_and_buffer();
                cand[..k].copy_from_slice(&sel.best);
            }
            ViewKind::Candidates => {
                let mut vals = std::mem::take(&mut sel.vals);
                vals.clear();
                vals.extend(tokens.candidates().iter().map(|c| c.logit));
                sel.select_small(&vals, k);
                sel.vals = vals;
                let cands = tokens.candidates_mut();
                for b in sel.best.iter_mut() {
                    *b = cands[b.id as usize];
                }
                cands[..k].copy_from_slice(&sel.best);
            }
        }
    } else {
        util::to_candidates(tokens);
        let cands = tokens.candidates_mut();
        if k < cands.len() {
            cands.select_nth_unstable_by(k - 1, desc);
        }
        cands[..k].sort_unstable_by(desc);
    }
    tokens.set_candidates(k, true);
}

impl Stage for TopK {
    const NAME: &'static CStr = c"top_k";
    const DESCRIPTION: &'static CStr =
        c"keeps the k highest logits, sorted descending (k <= 0: off)";
    const PARAMS: &'static [SdParamSpec] = &[number_param(
        c"k",
        c"number of candidates to keep; 0 = off",
        defaults::TOP_K as f64,
    )];
    const FLAGS: u32 = SD_STAGE_DENSE_OK;
    type State = Selector;

    fn new(params: &Params<'_>, _vocab: Option<&Vocab<'_>>) -> Result<Self, String> {
        let k = util::integer(params, "top_k", "k", 0, u32::MAX as i64)? as usize;
        Ok(TopK { k })
    }

    fn new_state(&self) -> Selector {
        Selector::default()
    }

    fn apply(
        &self,
        sel: &mut Selector,
        tokens: &mut Tokens<'_>,
        _rng: &mut HostRng<'_>,
    ) -> Result<(), String> {
        if self.k == 0 {
            return Ok(());
        }
        keep_top(tokens, self.k, sel);
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Reference: stable sort by descending logit (`==` ties keep id order).
    fn reference(x: &[f32], k: usize) -> Vec<(u32, f32)> {
        let mut all: Vec<(u32, f32)> = x.iter().enumerate().map(|(i, &v)| (i as u32, v)).collect();
        all.sort_by(|a, b| b.1.partial_cmp(&a.1).unwrap());
        all.truncate(k);
        all
    }

    fn inputs() -> Vec<Vec<f32>> {
        let mut s = 0x9e37_79b9_7f4a_7c15u64;
        let mut rnd = move || {
            s ^= s << 13;
            s ^= s >> 7;
            s ^= s << 17;
            s
        };
        let mut out = vec![
            vec![1.0],
            vec![f32::NEG_INFINITY; 5],
            vec![0.0, -0.0, 0.0, -0.0],
        ];
        for n in [63usize, 64, 65, 700, 5_000, 151_936] {
            out.push(
                (0..n)
                    .map(|_| (rnd() % 1_000_000) as f32 * 1e-4 - 50.0)
                    .collect(),
            );
            // heavy ties, signed zeros and masked entries
            out.push(
                (0..n)
                    .map(|_| match rnd() % 5 {
                        0 => f32::NEG_INFINITY,
                        1 => -0.0,
                        2 => 0.0,
                        _ => (rnd() % 7) as f32,
                    })
                    .collect(),
            );
            // ascending: every element raises the bound (worst case)
            out.push((0..n).map(|i| i as f32 * 0.5).collect());
            out.push(vec![2.5; n]);
            // spikes in the first (sampled) chunk: the guessed bound is
            // above the k-th best and the pass must be redone
            let mut spiky: Vec<f32> = (0..n).map(|_| (rnd() % 1000) as f32).collect();
            spiky[..5].fill(5000.0);
            out.push(spiky);
        }
        out
    }

    type Filter = fn(&[f32], usize, usize, &mut Vec<SdCandidate>);

    fn filters() -> Vec<(&'static str, Filter)> {
        let mut f: Vec<(&'static str, Filter)> = vec![("base", filter_base)];
        #[cfg(target_arch = "x86_64")]
        {
            let cpu = samplerd_numerics::features();
            if cpu.avx2() {
                // SAFETY: AVX2 is supported (checked just above).
                f.push(("avx2", |x, k, c, b| unsafe { filter_avx2(x, k, c, b) }));
            }
            if cpu.avx512f() {
                // SAFETY: AVX-512F is supported (checked just above).
                f.push(("avx512", |x, k, c, b| unsafe { filter_avx512(x, k, c, b) }));
            }
        }
        f
    }

    #[test]
    fn every_filter_keeps_the_same_k_in_the_same_order_as_a_stable_sort() {
        for x in inputs() {
            for k in [1usize, 2, 40, 256] {
                let k = k.min(x.len());
                let want = reference(&x, k);
                let mut sel = Selector::default();
                sel.select_small(&x, k);
                let got: Vec<(u32, f32)> = sel.best.iter().map(|c| (c.id, c.logit)).collect();
                assert_eq!(got, want, "select_small n={} k={k}", x.len());
                for (name, filter) in filters() {
                    // a small buffer forces many bound raises
                    let cap = k + 8;
                    let mut buf = Vec::with_capacity(cap + CHUNK);
                    filter(&x, k, cap, &mut buf);
                    buf.sort_unstable_by(rank);
                    buf.truncate(k);
                    let got: Vec<(u32, f32)> = buf.iter().map(|c| (c.id, c.logit)).collect();
                    assert_eq!(got, want, "{name} n={} k={k}", x.len());
                }
            }
        }
    }

    #[test]
    fn nan_never_panics_and_exactly_k_survive() {
        let x = [f32::NAN, 1.0, f32::NAN, 3.0];
        let mut sel = Selector::default();
        sel.select_small(&x, 3);
        let ids: Vec<u32> = sel.best.iter().map(|c| c.id).collect();
        assert_eq!(ids, [3, 1, 0]);
    }
}
