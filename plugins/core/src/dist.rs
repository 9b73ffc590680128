//! `dist`: draws the token (llama.cpp `dist`). Softmax over the live
//! candidates (normaliser in f64), then one uniform u from the host RNG and
//! a walk in the current candidate order until the running sum reaches
//! u · sum; only tokens with non-zero probability can be picked. A selecting
//! stage: it never modifies the logits. Dense view: a vectorised max pass, a
//! vectorised exp pass with per-64 chunk sums, and a walk that skips whole
//! chunks (also used for candidate lists longer than [`LARGE_LIST`]).
//! Fails when no candidate has a finite logit.

#![forbid(unsafe_code)]

use std::ffi::CStr;

use samplerd_plugin_sdk::prelude::*;

use crate::util::{self, CHUNK};

pub struct Dist;

/// Candidate lists longer than this take the vectorised, chunked path.
/// Shorter ones (e.g. the 40 after top_k) sum sequentially in f64.
pub const LARGE_LIST: usize = 1024;

#[derive(Clone, Default)]
pub struct DistState {
    probs: Vec<f32>,
    logits: Vec<f32>,
    chunk_sums: Vec<f64>,
}

/// Position in `weights` where the running f64 sum reaches `target`,
/// skipping zero weights; `run` is the sum before `weights[0]`.
fn walk(weights: &[f32], mut run: f64, target: f64) -> Option<usize> {
    let mut last = None;
    for (i, &w) in weights.iter().enumerate() {
        if w > 0.0 {
            run += w as f64;
            last = Some(i);
            if run >= target {
                return Some(i);
            }
        }
    }
    last
}

/// Draws a position from unnormalised weights in the dense layout with
/// per-chunk sums.
fn draw_chunked(weights: &[f32], chunk_sums: &[f64], total: f64, u: f64) -> Option<usize> {
    let target = total * u;
    let mut run = 0.0f64;
    let mut last_nonzero = None;
    for (ci, &cs) in chunk_sums.iter().enumerate() {
        if cs <= 0.0 {
            continue;
        }
        last_nonzero = Some(ci);
        if run + cs >= target {
            let start = ci * CHUNK;
            let end = (start + CHUNK).min(weights.len());
            return walk(&weights[start..end], run, target).map(|j| start + j);
        }
        run += cs;
    }
    // rounding: the dart fell past the last chunk; take its last token
    let ci = last_nonzero?;
    let start = ci * CHUNK;
    let end = (start + CHUNK).min(weights.len());
    walk(&weights[start..end], 0.0, f64::INFINITY).map(|j| start + j)
}

impl Stage for Dist {
    const NAME: &'static CStr = c"dist";
    const DESCRIPTION: &'static CStr =
        c"draws a token from the softmax of the candidates with the host RNG";
    const PARAMS: &'static [SdParamSpec] = &[];
    const FLAGS: u32 = SD_STAGE_SELECTS | SD_STAGE_DENSE_OK;
    type State = DistState;

    fn new(_: &Params<'_>, _: Option<&Vocab<'_>>) -> Result<Self, String> {
        Ok(Dist)
    }

    fn new_state(&self) -> DistState {
        DistState::default()
    }

    fn apply(
        &self,
        st: &mut DistState,
        tokens: &mut Tokens<'_>,
        rng: &mut HostRng<'_>,
    ) -> Result<(), String> {
        let max = util::max_logit(tokens);
        if max == f32::NEG_INFINITY {
            return Err("dist: no candidate with a finite logit is left".into());
        }
        let id = match tokens.view() {
            ViewKind::Dense => {
                let x = tokens.dense();
                st.probs.resize(x.len(), 0.0);
                let total = util::exp_shifted(x, max, &mut st.probs, Some(&mut st.chunk_sums));
                let u = rng.uniform_f64();
                draw_chunked(&st.probs, &st.chunk_sums, total, u).map(|i| i as u32)
            }
            ViewKind::Candidates if tokens.len() > LARGE_LIST => {
                // A long list (e.g. a whole-vocabulary nucleus, which top_p
                // leaves in list order): the dense path's vectorised exp
                // and chunked walk, reading the logits in place (AVX-512)
                // or from a copy.
                let cands = tokens.candidates();
                st.probs.resize(cands.len(), 0.0);
                let total = util::exp_shifted_candidates(
                    cands,
                    max,
                    &mut st.probs,
                    &mut st.logits,
                    Some(&mut st.chunk_sums),
                );
                let u = rng.uniform_f64();
                draw_chunked(&st.probs, &st.chunk_sums, total, u).map(|i| cands[i].id)
            }
            ViewKind::Candidates => {
                let cands = tokens.candidates();
                st.probs.clear();
                let mut sum = 0.0f64;
                for c in cands {
                    let e = util::exp_f32(c.logit - max);
                    st.probs.push(e);
                    sum += e as f64;
                }
                let u = rng.uniform_f64();
                walk(&st.probs, 0.0, sum * u).map(|i| cands[i].id)
            }
        };
        match id {
            Some(id) => {
                tokens.select(id);
                Ok(())
            }
            None => Err("dist: no candidate with a finite logit is left".into()),
        }
    }
}
