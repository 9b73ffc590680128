//! `typical_p` (locally typical sampling, llama.cpp `typical`): sorts the
//! candidates by |-ln p - H| (H the entropy), keeps the shortest prefix of
//! that order whose probability sum is > p, and at least `min_keep`.
//! p >= 1: no-op. Output is in typicality order (`sorted = 0`). Softmax of
//! the whole candidate list plus two sorts: O(n log n); the dense view is
//! converted to candidates first. Zero probabilities are skipped in the
//! entropy (llama.cpp would produce NaN there).

use std::ffi::CStr;

use samplerd_plugin_sdk::prelude::*;

use crate::util;

pub struct TypicalP {
    p: f32,
    min_keep: usize,
}

#[derive(Clone, Default)]
pub struct TypicalState {
    probs: Vec<f32>,
    scores: Vec<f32>,
    order: Vec<u32>,
    out: Vec<SdCandidate>,
}

impl Stage for TypicalP {
    const NAME: &'static CStr = c"typical_p";
    const DESCRIPTION: &'static CStr =
        c"locally typical sampling: keeps the most typical tokens up to mass p (p = 1: off)";
    const PARAMS: &'static [SdParamSpec] = &[
        number_param(c"p", c"typical mass to keep, in [0, 1]; 1 = off", 1.0),
        number_param(c"min_keep", c"keep at least this many candidates", 1.0),
    ];
    const FLAGS: u32 = SD_STAGE_DENSE_OK;
    type State = TypicalState;

    fn new(params: &Params<'_>, _vocab: Option<&Vocab<'_>>) -> Result<Self, String> {
        let p = util::number_in(params, "typical_p", "p", "in [0, 1]", |v| {
            (0.0..=1.0).contains(&v)
        })?;
        let min_keep = util::min_keep(params, "typical_p")?;
        Ok(TypicalP {
            p: p as f32,
            min_keep,
        })
    }

    fn new_state(&self) -> TypicalState {
        TypicalState::default()
    }

    fn apply(
        &self,
        st: &mut TypicalState,
        tokens: &mut Tokens<'_>,
        _rng: &mut HostRng<'_>,
    ) -> Result<(), String> {
        if self.p >= 1.0 || tokens.is_empty() {
            return Ok(());
        }
        util::to_candidates(tokens);
        util::sort_candidates(tokens);
        if util::softmax_into(tokens.candidates(), &mut st.probs) <= 0.0 {
            return Ok(());
        }
        let entropy: f32 = st
            .probs
            .iter()
            .filter(|&&p| p > 0.0)
            .map(|&p| -p * p.ln())
            .sum();
        st.scores.clear();
        st.scores
            .extend(st.probs.iter().map(|&p| (-p.ln() - entropy).abs()));
        st.order.clear();
        st.order.extend(0..st.probs.len() as u32);
        let scores = &st.scores;
        st.order.sort_unstable_by(|&a, &b| {
            scores[a as usize]
                .total_cmp(&scores[b as usize])
                .then(a.cmp(&b))
        });
        let mut cum = 0.0f32;
        let mut last = st.order.len();
        for (i, &idx) in st.order.iter().enumerate() {
            cum += st.probs[idx as usize];
            if cum > self.p && (self.min_keep == 0 || i + 1 >= self.min_keep) {
                last = i + 1;
                break;
            }
        }
        let cands = tokens.candidates_mut();
        st.out.clear();
        st.out
            .extend(st.order[..last].iter().map(|&i| cands[i as usize]));
        cands[..last].copy_from_slice(&st.out);
        tokens.set_candidates(last, false);
        Ok(())
    }
}
