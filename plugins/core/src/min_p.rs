//! `min_p`: keeps the candidates whose probability is at least p times the
//! top probability, i.e. logit >= max + ln(p), and at least `min_keep`
//! (llama.cpp `min-p`). p <= 0: no-op. p > 1: no logit reaches the
//! bound, so the `max(1, min_keep)` best are kept, as llama.cpp's sorted
//! fallback keeps its first candidate. Unsorted input keeps its order
//! (dense view: survivors in id order, `sorted = 0`); when fewer than
//! `min_keep` pass, the `min_keep` best are kept, sorted. Sorted input is
//! cut at the first candidate below the bound. Dense view: one vectorised
//! chunk-max pass, then only chunks reaching the bound are scanned.

#![forbid(unsafe_code)]

use std::ffi::CStr;

use samplerd_plugin_sdk::prelude::*;

use crate::top_k::{self, Selector};
use crate::util::{self, CHUNK};

pub struct MinP {
    p: f32,
    min_keep: usize,
}

#[derive(Clone, Default)]
pub struct MinPState {
    chunk_max: Vec<f32>,
    sel: Selector,
}

impl Stage for MinP {
    const NAME: &'static CStr = c"min_p";
    const DESCRIPTION: &'static CStr =
        c"keeps tokens whose probability is >= p x the top probability (p = 0: off)";
    const PARAMS: &'static [SdParamSpec] = &[
        number_param(
            c"p",
            c"minimum probability relative to the top token; <= 0 = off; > 1 keeps the most likely token",
            0.05,
        ),
        number_param(c"min_keep", c"keep at least this many candidates", 1.0),
    ];
    const FLAGS: u32 = SD_STAGE_DENSE_OK;
    type State = MinPState;

    fn new(params: &Params<'_>, _vocab: Option<&Vocab<'_>>) -> Result<Self, String> {
        // Any number, as llama.cpp takes it (NaN is refused by `number`).
        let p = util::number(params, "min_p", "p")?;
        let min_keep = util::min_keep(params, "min_p")?;
        Ok(MinP {
            p: p as f32,
            min_keep,
        })
    }

    fn new_state(&self) -> MinPState {
        MinPState::default()
    }

    fn apply(
        &self,
        st: &mut MinPState,
        tokens: &mut Tokens<'_>,
        _rng: &mut HostRng<'_>,
    ) -> Result<(), String> {
        if self.p <= 0.0 || tokens.is_empty() {
            return Ok(());
        }
        let ln_p = self.p.ln();
        match tokens.view() {
            ViewKind::Dense => {
                let (dense, cand) = tokens.dense_and_buffer();
                let max = util::chunk_maxima(dense, &mut st.chunk_max);
                if max == f32::NEG_INFINITY {
                    return Ok(());
                }
                let bound = max + ln_p;
                let mut len = 0usize;
                for (ci, &cm) in st.chunk_max.iter().enumerate() {
                    if cm < bound {
                        continue;
                    }
                    let start = ci * CHUNK;
                    let end = (start + CHUNK).min(dense.len());
                    for (i, &l) in dense[start..end].iter().enumerate() {
                        if l >= bound {
                            cand[len] = SdCandidate {
                                id: (start + i) as u32,
                                logit: l,
                            };
                            len += 1;
                        }
                    }
                }
                if len >= self.min_keep.max(1) {
                    tokens.set_candidates(len, false);
                } else {
                    top_k::keep_top(tokens, self.min_keep.max(1), &mut st.sel);
                }
            }
            ViewKind::Candidates if tokens.is_sorted() => {
                let cands = tokens.candidates();
                let bound = cands[0].logit + ln_p;
                let mut i = 1;
                while i < cands.len() && (cands[i].logit >= bound || i < self.min_keep) {
                    i += 1;
                }
                tokens.truncate(i);
            }
            ViewKind::Candidates => {
                let bound = util::max_logit(tokens) + ln_p;
                let passing = tokens
                    .candidates()
                    .iter()
                    .filter(|c| c.logit >= bound)
                    .count();
                if passing >= self.min_keep.max(1) {
                    let cands = tokens.candidates_mut();
                    let mut len = 0;
                    for i in 0..cands.len() {
                        if cands[i].logit >= bound {
                            cands[len] = cands[i];
                            len += 1;
                        }
                    }
                    tokens.set_candidates(len, false);
                } else {
                    top_k::keep_top(tokens, self.min_keep.max(1), &mut st.sel);
                }
            }
        }
        Ok(())
    }
}
