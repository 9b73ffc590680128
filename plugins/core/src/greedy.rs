//! `greedy`: selects the highest logit (llama.cpp `greedy`); the first
//! maximum in candidate order (dense: lowest id) wins ties. A selecting
//! stage: it never modifies the logits. Dense view: one vectorised chunk-max
//! pass plus a scan of the winning 64-float chunk.

#![forbid(unsafe_code)]

use std::ffi::CStr;

use samplerd_plugin_sdk::prelude::*;

use crate::util::{self, CHUNK};

pub struct Greedy;

/// Index of the first maximum of `x` (None when empty or all -inf).
pub fn argmax_dense(x: &[f32]) -> Option<usize> {
    let mut best = f32::NEG_INFINITY;
    let mut start = None;
    let mut chunks = x.chunks_exact(CHUNK);
    for (ci, c) in (&mut chunks).enumerate() {
        let m = util::chunk_max(c.try_into().expect("chunk"));
        if m > best {
            best = m;
            start = Some(ci * CHUNK);
        }
    }
    let rem = chunks.remainder();
    let rem_max = util::max_scan(rem);
    if rem_max > best {
        best = rem_max;
        start = Some(x.len() - rem.len());
    }
    let start = start?;
    x[start..]
        .iter()
        .position(|&v| v == best)
        .map(|j| start + j)
}

/// Position of the first maximum among candidates (None when empty/all -inf).
pub fn argmax_candidates(c: &[SdCandidate]) -> Option<usize> {
    let mut best = f32::NEG_INFINITY;
    let mut pos = None;
    for (i, cand) in c.iter().enumerate() {
        if cand.logit > best {
            best = cand.logit;
            pos = Some(i);
        }
    }
    pos
}

impl StatelessStage for Greedy {
    const NAME: &'static CStr = c"greedy";
    const DESCRIPTION: &'static CStr = c"selects the token with the highest logit";
    const PARAMS: &'static [SdParamSpec] = &[];
    const FLAGS: u32 = SD_STAGE_SELECTS | SD_STAGE_DENSE_OK;

    fn new(_: &Params<'_>, _: Option<&Vocab<'_>>) -> Result<Self, String> {
        Ok(Greedy)
    }

    fn apply(&self, tokens: &mut Tokens<'_>, _: &mut HostRng<'_>) -> Result<(), String> {
        // llama.cpp's temperature 0 leaves only the maximum (the others at
        // -inf, post-chain probability 1): switch to the candidate view
        // holding just the winner.
        let winner = match tokens.view() {
            ViewKind::Dense => argmax_dense(tokens.dense()).map(|i| SdCandidate {
                id: i as u32,
                logit: tokens.dense()[i],
            }),
            ViewKind::Candidates => {
                argmax_candidates(tokens.candidates()).map(|i| tokens.candidates()[i])
            }
        };
        match winner {
            Some(w) => {
                let (_, cand) = tokens.dense_and_buffer();
                cand[0] = w;
                tokens.set_candidates(1, true);
                tokens.select(w.id);
                Ok(())
            }
            None => Err("greedy: no candidate with a finite logit is left".into()),
        }
    }
}
