//! `temperature`: divides the logits by t (llama.cpp `temp` / `temp-ext`).
//! t <= 0 keeps only the first maximum (the others are dropped from the
//! candidate list; llama.cpp sets them to -inf, which is equivalent).
//! Optional dynamic temperature (`dynatemp_range` > 0): the temperature is
//! interpolated in [t - range, t + range] by the normalised entropy of the
//! candidates raised to `dynatemp_exponent` (sorts the candidates, as
//! llama.cpp does). Dense view: one vectorised pass.

use std::ffi::CStr;

use samplerd_plugin_sdk::defaults;
use samplerd_plugin_sdk::prelude::*;

use crate::greedy;
use crate::util;

pub struct Temperature {
    t: f32,
    range: f32,
    exponent: f32,
}

#[derive(Clone, Default)]
pub struct TempState {
    probs: Vec<f32>,
}

/// llama.cpp's `temp_impl`.
fn scale(tokens: &mut Tokens<'_>, t: f32) {
    if t <= 0.0 {
        match tokens.view() {
            ViewKind::Dense => {
                if let Some(i) = greedy::argmax_dense(tokens.dense()) {
                    let (dense, cand) = tokens.dense_and_buffer();
                    cand[0] = SdCandidate {
                        id: i as u32,
                        logit: dense[i],
                    };
                    tokens.set_candidates(1, true);
                }
            }
            ViewKind::Candidates => {
                if let Some(i) = greedy::argmax_candidates(tokens.candidates()) {
                    let cands = tokens.candidates_mut();
                    cands[0] = cands[i];
                    tokens.set_candidates(1, true);
                }
            }
        }
        return;
    }
    // Saturated: a huge logit over a tiny t must stay finite (see
    // `util::saturate`).
    match tokens.view() {
        ViewKind::Dense => divide_all(tokens.dense_mut(), t),
        ViewKind::Candidates => divide_all(tokens.candidates_mut(), t),
    }
}

/// A logit slot: a dense entry or a candidate's logit.
trait Logit {
    fn logit(&mut self) -> &mut f32;
}

impl Logit for f32 {
    #[inline(always)]
    fn logit(&mut self) -> &mut f32 {
        self
    }
}

impl Logit for SdCandidate {
    #[inline(always)]
    fn logit(&mut self) -> &mut f32 {
        &mut self.logit
    }
}

/// `logit / t` (saturated) over a whole vocabulary or candidate list,
/// compiled for AVX-512 or AVX2 where present so the loop vectorises;
/// IEEE division either way, so the results are the same.
fn divide_all<L: Logit>(xs: &mut [L], t: f32) {
    #[cfg(target_arch = "x86_64")]
    let cpu = samplerd_numerics::features();
    #[cfg(target_arch = "x86_64")]
    if cpu.avx512f() {
        // SAFETY: the CPU supports AVX-512F (checked just above).
        return unsafe { divide_all_avx512(xs, t) };
    }
    #[cfg(target_arch = "x86_64")]
    if cpu.avx2() {
        // SAFETY: the CPU supports AVX2 (checked just above).
        return unsafe { divide_all_avx2(xs, t) };
    }
    divide_all_impl(xs, t)
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
unsafe fn divide_all_avx512<L: Logit>(xs: &mut [L], t: f32) {
    divide_all_impl(xs, t)
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
unsafe fn divide_all_avx2<L: Logit>(xs: &mut [L], t: f32) {
    divide_all_impl(xs, t)
}

#[inline(always)]
fn divide_all_impl<L: Logit>(xs: &mut [L], t: f32) {
    for x in xs {
        let v = x.logit();
        *v = util::saturate(*v, *v / t);
    }
}

impl Stage for Temperature {
    const NAME: &'static CStr = c"temperature";
    const DESCRIPTION: &'static CStr =
        c"divides logits by t; t <= 0 keeps only the argmax; optional dynamic temperature";
    const PARAMS: &'static [SdParamSpec] = &[
        number_param(
            c"t",
            c"temperature, >= 0; 0 = greedy",
            defaults::TEMPERATURE,
        ),
        number_param(
            c"dynatemp_range",
            c"dynamic temperature range (t +- range), >= 0; 0 = off",
            0.0,
        ),
        number_param(
            c"dynatemp_exponent",
            c"exponent applied to the normalised entropy",
            1.0,
        ),
    ];
    const FLAGS: u32 = SD_STAGE_DENSE_OK;
    type State = TempState;

    fn new(params: &Params<'_>, _vocab: Option<&Vocab<'_>>) -> Result<Self, String> {
        const S: &str = "temperature";
        let t = util::non_negative(params, S, "t")?;
        let range = util::non_negative(params, S, "dynatemp_range")?;
        let exponent = util::non_negative(params, S, "dynatemp_exponent")?;
        Ok(Temperature {
            t: t as f32,
            range: range as f32,
            exponent: exponent as f32,
        })
    }

    fn new_state(&self) -> TempState {
        TempState::default()
    }

    fn apply(
        &self,
        st: &mut TempState,
        tokens: &mut Tokens<'_>,
        _rng: &mut HostRng<'_>,
    ) -> Result<(), String> {
        if tokens.is_empty() {
            return Ok(());
        }
        if self.range > 0.0 {
            let min_t = (self.t - self.range).max(0.0);
            let max_t = self.t + self.range;
            if tokens.len() <= 1 {
                return Ok(());
            }
            util::to_candidates(tokens);
            let max_entropy = -(1.0f32 / tokens.len() as f32).ln();
            util::sort_candidates(tokens);
            util::softmax_into(tokens.candidates(), &mut st.probs);
            let entropy: f32 = st
                .probs
                .iter()
                .filter(|&&p| p > 0.0)
                .map(|&p| -p * p.ln())
                .sum();
            let norm = entropy / max_entropy;
            let dyn_t = min_t + (max_t - min_t) * norm.powf(self.exponent);
            scale(tokens, dyn_t);
        } else if self.t != 1.0 {
            scale(tokens, self.t);
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use samplerd_plugin_sdk::testing::{OwnedParams, OwnedTokens, TestRng, apply_once};

    /// Fuzz find (fuzz/fuzz_targets/chain.rs): 3e38 / 0.8 overflowed to
    /// +inf and the default chain's `dist` then failed (INTERNAL).
    #[test]
    fn huge_logits_saturate_instead_of_overflowing() {
        let params = OwnedParams::new().number("t", 0.8);
        for mut tokens in [
            OwnedTokens::dense(&[3e38, 1.0, f32::NEG_INFINITY]),
            OwnedTokens::dense_as_candidates(&[3e38, 1.0, f32::NEG_INFINITY]),
        ] {
            apply_once::<Temperature>(&params, &mut tokens, &mut TestRng::constant(0)).unwrap();
            assert_eq!(tokens.logit(0), Some(f32::MAX));
            assert_eq!(tokens.logit(1), Some(1.25));
            assert!(tokens.logit(2).is_none_or(|l| l == f32::NEG_INFINITY));
        }
        // A tiny t: finite logits stay finite (not masked), -inf stays -inf.
        let params = OwnedParams::new().number("t", 1e-30);
        let mut tokens = OwnedTokens::dense(&[-5e30, 3e30, f32::NEG_INFINITY]);
        apply_once::<Temperature>(&params, &mut tokens, &mut TestRng::constant(0)).unwrap();
        assert_eq!(
            tokens.dense_logits(),
            [-f32::MAX, f32::MAX, f32::NEG_INFINITY]
        );
    }
}
