//! `top_p` (nucleus): keeps the shortest prefix of the candidates sorted by
//! descending probability whose cumulative probability is >= p, and at
//! least `min_keep` (llama.cpp `top-p`). Survivors keep their raw logits;
//! probabilities are only computed internally. p >= 1: no-op.
//!
//! The arithmetic is llama.cpp's, since the f32 rounding of its sums
//! decides the cut: softmax in the list's current order (libm `expf`, f32
//! running sum Z), then in descending order an f32 running sum of `e / Z`,
//! cut at the first `cum >= p` with at least `min_keep` kept. Output sorted.
//!
//! Small candidate lists (<= 4096, e.g. after top_k) or sorted ones: Z,
//! sort if needed, walk.
//!
//! Dense view or large lists (top_k off): `nucleus` computes the same f32
//! sums bit for bit with vectorised block sums, gathers the tokens above an
//! estimated floor and sorts them in logit buckets as the walk reaches
//! them; if the cut is not among them, every token is walked.

use std::ffi::CStr;

use samplerd_plugin_sdk::prelude::*;

use crate::{nucleus, util};

/// Candidate lists up to this size use the sort-then-cut path.
pub const SMALL_PATH: usize = 4096;

pub struct TopP {
    p: f32,
    min_keep: usize,
}

#[derive(Clone, Default)]
pub struct TopPState {
    probs: Vec<f32>,
    vals: Vec<f32>,
    nucleus: nucleus::Scratch,
    out: Vec<SdCandidate>,
}

impl TopP {
    fn small(&self, st: &mut TopPState, tokens: &mut Tokens<'_>) {
        // llama.cpp: softmax in the list's current order (max, libm expf,
        // f32 running sum), then sort, then an f32 running sum of the f32
        // probabilities.
        let max = util::max_logit(tokens);
        if max == f32::NEG_INFINITY {
            return; // nothing finite left
        }
        let mut z = 0.0f32;
        for c in tokens.candidates() {
            z += (c.logit - max).exp();
        }
        util::sort_candidates(tokens);
        let mut cum = 0.0f32;
        let mut last = tokens.len();
        for (i, c) in tokens.candidates().iter().enumerate() {
            cum += (c.logit - max).exp() / z;
            if cum >= self.p && i + 1 >= self.min_keep {
                last = i + 1;
                break;
            }
        }
        st.probs.clear();
        tokens.truncate(last);
    }

    fn large(&self, st: &mut TopPState, tokens: &mut Tokens<'_>) {
        let dense = tokens.view() == ViewKind::Dense;
        let mut vals = std::mem::take(&mut st.vals);
        if !dense {
            vals.clear();
            vals.extend(tokens.candidates().iter().map(|c| c.logit));
        }
        let x: &[f32] = if dense { tokens.dense() } else { &vals };
        let max = util::max_scan(x);
        if max == f32::NEG_INFINITY {
            st.vals = vals;
            return;
        }
        let last = nucleus::nucleus(x, max, self.p, self.min_keep, &mut st.nucleus);
        if st.out.len() < last {
            st.out.resize(last, SdCandidate { id: 0, logit: 0.0 });
        }
        let cands = (!dense).then(|| tokens.candidates());
        let out = &mut st.out[..last];
        for (o, &k) in out.iter_mut().zip(&st.nucleus.keys[..last]) {
            let i = k as u32 as usize;
            *o = match cands {
                Some(c) => c[i],
                None => SdCandidate {
                    id: i as u32,
                    logit: nucleus::key_logit((k >> 32) as u32),
                },
            };
        }
        st.vals = vals;
        let (_, cand) = tokens.dense_and_buffer();
        cand[..last].copy_from_slice(out);
        tokens.set_candidates(last, true);
    }
}

impl Stage for TopP {
    const NAME: &'static CStr = c"top_p";
    const DESCRIPTION: &'static CStr =
        c"nucleus: keeps the smallest top set whose probability sums to >= p (p = 1: off)";
    const PARAMS: &'static [SdParamSpec] = &[
        number_param(
            c"p",
            c"cumulative probability to keep, in (0, 1]; 1 = off",
            0.95,
        ),
        number_param(c"min_keep", c"keep at least this many candidates", 1.0),
    ];
    const FLAGS: u32 = SD_STAGE_DENSE_OK;
    type State = TopPState;

    fn new(params: &Params<'_>, _vocab: Option<&Vocab<'_>>) -> Result<Self, String> {
        let p = util::number_in(params, "top_p", "p", "in (0, 1]", |v| v > 0.0 && v <= 1.0)?;
        let min_keep = util::min_keep(params, "top_p")?;
        Ok(TopP {
            p: p as f32,
            min_keep,
        })
    }

    fn new_state(&self) -> TopPState {
        TopPState::default()
    }

    fn apply(
        &self,
        st: &mut TopPState,
        tokens: &mut Tokens<'_>,
        _rng: &mut HostRng<'_>,
    ) -> Result<(), String> {
        if self.p >= 1.0 || tokens.is_empty() {
            return Ok(());
        }
        if tokens.view() == ViewKind::Candidates
            && (tokens.len() <= SMALL_PATH || tokens.is_sorted())
        {
            self.small(st, tokens);
        } else {
            self.large(st, tokens);
        }
        Ok(())
    }
}
