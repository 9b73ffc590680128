//! `top_n_sigma`: keeps the tokens whose logit is >= max - n·σ, σ the
//! standard deviation of the finite logits (llama.cpp `top-n-sigma`).
//! n <= 0 (default -1): no-op. Mean and σ are computed in f64 (llama.cpp:
//! f32 sum). Removed tokens stay in the list at -inf, after the survivors
//! (as llama.cpp); the survivors are sorted descending when at most 1,024
//! (llama.cpp always sorts), else left in id/position order with
//! `sorted = 0`. Two vectorisable passes plus a
//! gather; the dense view is handled without conversion.

#![forbid(unsafe_code)]

use std::ffi::CStr;

use samplerd_plugin_sdk::defaults;
use samplerd_plugin_sdk::prelude::*;

use crate::util::{self, CHUNK, SORT_LIMIT, desc};

pub struct TopNSigma {
    n: f32,
}

/// (max, σ) of the finite values of the dense logits, chunked so the
/// passes vectorise (f32 lanes within 64-float chunks, f64 across chunks).
fn dense_stats(x: &[f32]) -> Option<(f32, f64)> {
    let max = util::max_scan(x);
    if max == f32::NEG_INFINITY {
        return None;
    }
    let live = |v: f32| v != f32::NEG_INFINITY;
    let mut sum = 0.0f64;
    let mut count = 0usize;
    let mut chunks = x.chunks_exact(CHUNK);
    for c in &mut chunks {
        let c: &[f32; CHUNK] = c.try_into().expect("chunk");
        let mut s = [0.0f32; CHUNK];
        let mut n = 0u32;
        for (d, &v) in s.iter_mut().zip(c) {
            *d = if live(v) { v } else { 0.0 };
            n += live(v) as u32;
        }
        sum += util::sum_chunk(&s) as f64;
        count += n as usize;
    }
    for &v in chunks.remainder() {
        if live(v) {
            sum += v as f64;
            count += 1;
        }
    }
    let mean64 = sum / count as f64;
    let mean = mean64 as f32;
    let mut acc = 0.0f64;
    let mut chunks = x.chunks_exact(CHUNK);
    for c in &mut chunks {
        let c: &[f32; CHUNK] = c.try_into().expect("chunk");
        let mut s = [0.0f32; CHUNK];
        for (d, &v) in s.iter_mut().zip(c) {
            let dv = v - mean;
            *d = if live(v) { dv * dv } else { 0.0 };
        }
        acc += util::sum_chunk(&s) as f64;
    }
    for &v in chunks.remainder() {
        if live(v) {
            let d = v as f64 - mean64;
            acc += d * d;
        }
    }
    Some((max, (acc / count as f64).sqrt()))
}

/// (max, σ) of the finite logits of a candidate list (f64 sums).
fn stats(values: impl Iterator<Item = f32> + Clone) -> Option<(f32, f64)> {
    let mut max = f32::NEG_INFINITY;
    let mut sum = 0.0f64;
    let mut count = 0usize;
    for v in values.clone() {
        if v != f32::NEG_INFINITY {
            max = max.max(v);
            sum += v as f64;
            count += 1;
        }
    }
    if count == 0 {
        return None;
    }
    let mean = sum / count as f64;
    let mut acc = 0.0f64;
    for v in values {
        if v != f32::NEG_INFINITY {
            let d = v as f64 - mean;
            acc += d * d;
        }
    }
    Some((max, (acc / count as f64).sqrt()))
}

impl StatelessStage for TopNSigma {
    const NAME: &'static CStr = c"top_n_sigma";
    const DESCRIPTION: &'static CStr =
        c"keeps logits within n standard deviations of the max (n <= 0: off)";
    const PARAMS: &'static [SdParamSpec] = &[number_param(
        c"n",
        c"number of standard deviations below the max to keep; <= 0 = off",
        defaults::TOP_N_SIGMA,
    )];
    const FLAGS: u32 = SD_STAGE_DENSE_OK;

    fn new(params: &Params<'_>, _vocab: Option<&Vocab<'_>>) -> Result<Self, String> {
        let n = util::number_in(params, "top_n_sigma", "n", "finite", f64::is_finite)?;
        Ok(TopNSigma { n: n as f32 })
    }

    fn apply(&self, tokens: &mut Tokens<'_>, _: &mut HostRng<'_>) -> Result<(), String> {
        if self.n <= 0.0 || tokens.len() <= 1 {
            return Ok(());
        }
        let was_sorted = tokens.is_sorted();
        let len = match tokens.view() {
            ViewKind::Dense => {
                let (dense, cand) = tokens.dense_and_buffer();
                let Some((max, std)) = dense_stats(dense) else {
                    return Ok(());
                };
                let bound = max - self.n * std as f32;
                // Extreme logits (±f32::MAX in one buffer) make the mean
                // inf − inf = NaN; llama.cpp masks only `logit < bound`,
                // which is never true for a NaN bound: nothing is masked.
                if bound.is_nan() {
                    return Ok(());
                }
                let mut len = 0;
                let mut chunks = dense.chunks_exact(CHUNK);
                for (ci, c) in (&mut chunks).enumerate() {
                    let mut m = util::ge_mask(c.try_into().expect("chunk"), bound);
                    while m != 0 {
                        let i = ci * CHUNK + m.trailing_zeros() as usize;
                        cand[len] = SdCandidate {
                            id: i as u32,
                            logit: dense[i],
                        };
                        len += 1;
                        m &= m - 1;
                    }
                }
                let tail = dense.len() - chunks.remainder().len();
                for (j, &l) in chunks.remainder().iter().enumerate() {
                    if l >= bound {
                        cand[len] = SdCandidate {
                            id: (tail + j) as u32,
                            logit: l,
                        };
                        len += 1;
                    }
                }
                // llama.cpp keeps the masked tokens in the list at -inf
                // (later stages see the same list size: top_k keeps -inf
                // entries when fewer finite remain, typical_p's entropy
                // becomes NaN): append them after the survivors.
                // Branch-free: write every id, advance only past masked
                // ones (the last write may land one past the end: guarded).
                let mut pos = len;
                let n = dense.len();
                for (i, &l) in dense.iter().enumerate() {
                    if pos < n {
                        cand[pos] = SdCandidate {
                            id: i as u32,
                            logit: f32::NEG_INFINITY,
                        };
                    }
                    pos += (l < bound) as usize;
                }
                debug_assert_eq!(pos, dense.len());
                len
            }
            ViewKind::Candidates => {
                let cands = tokens.candidates_mut();
                let Some((max, std)) = stats(cands.iter().map(|c| c.logit)) else {
                    return Ok(());
                };
                let bound = max - self.n * std as f32;
                if bound.is_nan() {
                    return Ok(()); // as in the dense case: nothing masked
                }
                // Survivors first (their order kept), the masked tokens
                // after them at -inf (llama.cpp keeps them in the list).
                let mut len = 0;
                for i in 0..cands.len() {
                    if cands[i].logit >= bound {
                        cands.swap(i, len);
                        len += 1;
                    }
                }
                for c in &mut cands[len..] {
                    c.logit = f32::NEG_INFINITY;
                }
                len
            }
        };
        let n = tokens.len();
        tokens.set_candidates(n, false);
        // sorted: the survivors are sorted and the tail is all -inf
        if was_sorted {
            tokens.set_sorted(true);
        } else if len <= SORT_LIMIT {
            tokens.candidates_mut()[..len].sort_unstable_by(desc);
            tokens.set_sorted(true);
        }
        Ok(())
    }
}
