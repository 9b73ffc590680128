//! `xtc` (exclude top choices, llama.cpp `xtc`): with chance `probability`
//! (one uniform draw from the host RNG per step, only when the stage is
//! active and there are >= 2 candidates), removes every top candidate whose
//! probability is >= `threshold` except the least likely of them, provided
//! at least `min_keep` remain. threshold > 0.5 or probability <= 0: no-op.
//! When it triggers it sorts the candidates (converting a dense buffer).

#![forbid(unsafe_code)]

use std::ffi::CStr;

use samplerd_plugin_sdk::defaults;
use samplerd_plugin_sdk::prelude::*;

use crate::util;

pub struct Xtc {
    probability: f32,
    threshold: f32,
    min_keep: usize,
}

#[derive(Clone, Default)]
pub struct XtcState {
    probs: Vec<f32>,
}

impl Stage for Xtc {
    const NAME: &'static CStr = c"xtc";
    const DESCRIPTION: &'static CStr =
        c"exclude top choices: with some chance drops all but the least likely token above threshold";
    const PARAMS: &'static [SdParamSpec] = &[
        number_param(
            c"probability",
            c"chance per step that XTC triggers, in [0, 1]; 0 = off",
            defaults::XTC_PROBABILITY,
        ),
        number_param(
            c"threshold",
            c"probability a top token needs to be excluded, in [0, 1]; > 0.5 = off",
            defaults::XTC_THRESHOLD,
        ),
        number_param(c"min_keep", c"keep at least this many candidates", 1.0),
    ];
    const FLAGS: u32 = SD_STAGE_DENSE_OK;
    type State = XtcState;

    fn new(params: &Params<'_>, _vocab: Option<&Vocab<'_>>) -> Result<Self, String> {
        let probability = util::unit_interval(params, "xtc", "probability")?;
        let threshold = util::unit_interval(params, "xtc", "threshold")?;
        let min_keep = util::min_keep(params, "xtc")?;
        Ok(Xtc {
            probability: probability as f32,
            threshold: threshold as f32,
            min_keep,
        })
    }

    fn new_state(&self) -> XtcState {
        XtcState::default()
    }

    fn apply(
        &self,
        st: &mut XtcState,
        tokens: &mut Tokens<'_>,
        rng: &mut HostRng<'_>,
    ) -> Result<(), String> {
        if self.probability <= 0.0 || self.threshold > 0.5 || tokens.len() < 2 {
            return Ok(());
        }
        let chance = rng.uniform_f64();
        if chance > self.probability as f64 {
            return Ok(());
        }
        util::to_candidates(tokens);
        util::sort_candidates(tokens);
        util::softmax_into(tokens.candidates(), &mut st.probs);
        let mut pos_last = 0;
        for (i, &p) in st.probs.iter().enumerate() {
            // A masked candidate (p = 0) is never "above the threshold",
            // even at threshold 0: counting it removed every finite one
            // (found by fuzzing).
            if p > 0.0 && p >= self.threshold {
                pos_last = i;
            } else {
                break;
            }
        }
        let size = tokens.len();
        if size - pos_last >= self.min_keep && pos_last > 0 {
            tokens.candidates_mut().copy_within(pos_last..size, 0);
            tokens.set_candidates(size - pos_last, true);
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use samplerd_plugin_sdk::testing::{OwnedParams, OwnedTokens, TestRng, apply_once};

    /// Fuzz find: threshold 0 treated masked (-inf) candidates as above the
    /// threshold and kept only a masked one, so `dist` had nothing to draw.
    #[test]
    fn threshold_zero_never_keeps_only_masked_candidates() {
        let params = OwnedParams::new()
            .number("probability", 1.0)
            .number("threshold", 0.0);
        let mut tokens = OwnedTokens::dense(&[1.0, 0.5, f32::NEG_INFINITY, f32::NEG_INFINITY]);
        apply_once::<Xtc>(&params, &mut tokens, &mut TestRng::constant(0)).unwrap();
        assert_eq!(tokens.survivor_ids(), [1]);
    }
}
