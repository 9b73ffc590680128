//! `adaptive_p`: llama.cpp's adaptive-p sampler (`llama_sampler_init_adaptive_p`
//! and `llama_sampler_adaptive_p_apply` / `_accept`, src/llama-sampling.cpp;
//! llama.cpp PR 17927), a selecting stage that prefers tokens whose
//! probability is near a target, steering the running average of the
//! chosen tokens' original probabilities towards `target`.
//!
//! Per step: the softmax of the live candidates (the *original*
//! probabilities); the adapted target `clamp(2·target − ema, 0, 1)`, where
//! `ema = weighted_sum / total_weight`; each finite candidate's logit
//! becomes `5 − 10·d²/(1 + d)` with `d = |p − adapted| / 0.3` (llama.cpp's
//! PEAK_LOGIT_VALUE, SHARPNESS and DISTRIBUTION_WIDTH), −inf stays −inf;
//! then a draw from the softmax of those logits. When the sequence accepts
//! the drawn token: `weighted_sum = p + decay·weighted_sum`,
//! `total_weight = 1 + decay·total_weight` with `p` its original
//! probability (another token — history, a forced one — leaves the average
//! alone, as llama.cpp's pending-token check does). The state starts as if
//! the target had been met: `weighted_sum = target/(1 − decay)`,
//! `total_weight = 1/(1 − decay)`. A negative target is llama.cpp's "off":
//! a plain draw from the candidates' softmax.
//!
//! Works on a private copy (O(n) per step, n live entries) and leaves the
//! token buffer untouched except `selected`, as `mirostat` does (llama.cpp
//! writes the transformed logits into the shared list).

#![forbid(unsafe_code)]

use std::ffi::CStr;

use samplerd_plugin_sdk::defaults;
use samplerd_plugin_sdk::prelude::*;

use crate::util;

/// llama.cpp's `PEAK_LOGIT_VALUE`: the logit of a token at the target.
pub const PEAK_LOGIT_VALUE: f32 = 5.0;
/// llama.cpp's `SHARPNESS`: how fast logits fall off with distance.
pub const SHARPNESS: f32 = 10.0;
/// llama.cpp's `DISTRIBUTION_WIDTH`: the favoured band around the target.
pub const DISTRIBUTION_WIDTH: f32 = 0.3;
const INV_WIDTH: f32 = 1.0 / DISTRIBUTION_WIDTH;
/// llama.cpp clamps `decay` to [0, 0.99].
pub const MAX_DECAY: f32 = 0.99;

pub struct AdaptiveP {
    target: f32,
    decay: f32,
}

#[derive(Clone, Default)]
pub struct AdaptiveState {
    weighted_sum: f32,
    total_weight: f32,
    /// The token drawn last and its original probability, until accepted.
    pending: Option<(u32, f32)>,
    cands: Vec<SdCandidate>,
    probs: Vec<f32>,
    shaped: Vec<SdCandidate>,
    shaped_probs: Vec<f32>,
}

impl AdaptiveState {
    /// The running average of the chosen tokens' original probabilities.
    pub fn average(&self) -> f32 {
        self.weighted_sum / self.total_weight
    }
}

impl AdaptiveP {
    /// llama.cpp's transform of one original probability.
    pub fn shape(p: f32, adapted: f32) -> f32 {
        let dist = ((p - adapted) * INV_WIDTH).abs();
        PEAK_LOGIT_VALUE - SHARPNESS * dist * dist / (1.0 + dist)
    }

    /// The target the next draw aims at, given the average so far.
    pub fn adapted_target(&self, st: &AdaptiveState) -> f32 {
        let target = self.target.clamp(0.0, 1.0);
        let raw = if st.total_weight == 0.0 {
            target
        } else {
            2.0 * target - st.weighted_sum / st.total_weight
        };
        raw.clamp(0.0, 1.0)
    }
}

/// A draw over `cands` with weights `probs` (candidate order): the first
/// whose running sum reaches u · Σ, skipping zero weights.
fn draw(probs: &[f32], u: f64) -> Option<usize> {
    let total: f64 = probs.iter().map(|&p| p as f64).sum();
    let target = total * u;
    let (mut run, mut last) = (0.0f64, None);
    for (i, &p) in probs.iter().enumerate() {
        if p > 0.0 {
            run += p as f64;
            last = Some(i);
            if run >= target {
                return Some(i);
            }
        }
    }
    last
}

impl Stage for AdaptiveP {
    const NAME: &'static CStr = c"adaptive_p";
    const DESCRIPTION: &'static CStr = c"llama.cpp adaptive-p: prefers tokens near a target probability, adapting to the average of those chosen, then draws";
    const PARAMS: &'static [SdParamSpec] = &[
        number_param(
            c"target",
            c"probability to aim at, in [0, 1]; negative = off (a plain draw)",
            defaults::ADAPTIVE_TARGET,
        ),
        number_param(
            c"decay",
            c"decay of the average of chosen probabilities (history ~ 1/(1 - decay)); clamped to [0, 0.99]",
            defaults::ADAPTIVE_DECAY,
        ),
    ];
    const FLAGS: u32 = SD_STAGE_SELECTS | SD_STAGE_DENSE_OK;
    type State = AdaptiveState;

    fn new(params: &Params<'_>, _vocab: Option<&Vocab<'_>>) -> Result<Self, String> {
        const S: &str = "adaptive_p";
        let target = util::number_in(params, S, "target", "finite and <= 1", |v| {
            v.is_finite() && v <= 1.0
        })?;
        let decay = util::number_in(params, S, "decay", "finite", f64::is_finite)?;
        Ok(AdaptiveP {
            target: target as f32,
            decay: (decay as f32).clamp(0.0, MAX_DECAY),
        })
    }

    fn new_state(&self) -> AdaptiveState {
        AdaptiveState {
            weighted_sum: self.target / (1.0 - self.decay),
            total_weight: 1.0 / (1.0 - self.decay),
            ..Default::default()
        }
    }

    fn accept(&self, st: &mut AdaptiveState, token: u32) {
        if let Some((id, p)) = st.pending.take()
            && id == token
        {
            st.weighted_sum = p + self.decay * st.weighted_sum;
            st.total_weight = 1.0 + self.decay * st.total_weight;
        }
    }

    fn apply(
        &self,
        st: &mut AdaptiveState,
        tokens: &mut Tokens<'_>,
        rng: &mut HostRng<'_>,
    ) -> Result<(), String> {
        st.pending = None;
        st.cands.clear();
        match tokens.view() {
            ViewKind::Dense => {
                st.cands.extend(
                    tokens
                        .dense()
                        .iter()
                        .enumerate()
                        .map(|(i, &l)| SdCandidate {
                            id: i as u32,
                            logit: l,
                        }),
                )
            }
            ViewKind::Candidates => st.cands.extend_from_slice(tokens.candidates()),
        }
        if util::softmax_into(&st.cands, &mut st.probs) <= 0.0 {
            return Err("adaptive_p: no candidate with a finite logit is left".into());
        }
        let u = rng.uniform_f64();
        let idx = if self.target < 0.0 {
            draw(&st.probs, u)
        } else {
            let adapted = self.adapted_target(st);
            st.shaped.clear();
            st.shaped
                .extend(st.cands.iter().zip(&st.probs).map(|(c, &p)| SdCandidate {
                    id: c.id,
                    logit: if c.logit == f32::NEG_INFINITY {
                        f32::NEG_INFINITY
                    } else {
                        Self::shape(p, adapted)
                    },
                }));
            util::softmax_into(&st.shaped, &mut st.shaped_probs);
            draw(&st.shaped_probs, u)
        }
        .ok_or("adaptive_p: no candidate with a non-zero probability is left")?;
        let id = st.cands[idx].id;
        // Off (target < 0), llama.cpp draws and returns before it records
        // the token: the average never moves.
        if self.target >= 0.0 {
            st.pending = Some((id, st.probs[idx]));
        }
        tokens.select(id);
        Ok(())
    }
}
