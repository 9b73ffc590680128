//! `mirostat` (v1) and `mirostat_v2`: selecting stages that steer the
//! surprise (-log2 p of the chosen token) towards `tau` by adapting a
//! per-sequence μ (initially 2·tau) with learning rate `eta` (llama.cpp
//! `mirostat` / `mirostat-v2`). v1 estimates the Zipf exponent from the top
//! `m` tokens and keeps the top k it implies; v2 keeps the tokens whose
//! surprise is <= μ. The draw walks the renormalised probabilities with one
//! uniform from the host RNG. Both work on a private sorted copy of the
//! candidates and never modify the token buffer except `selected`.

#![forbid(unsafe_code)]

use std::ffi::CStr;

use samplerd_plugin_sdk::prelude::*;

use crate::util::{self, desc};

#[derive(Clone, Default)]
pub struct MirostatState {
    mu: f32,
    cands: Vec<SdCandidate>,
    probs: Vec<f32>,
}

impl MirostatState {
    /// μ, for tests.
    pub fn mu(&self) -> f32 {
        self.mu
    }
}

/// Copies the live entries, sorted descending, and their softmax.
fn sorted_softmax(tokens: &Tokens<'_>, st: &mut MirostatState) -> Result<(), String> {
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
    st.cands.sort_unstable_by(desc);
    if util::softmax_into(&st.cands, &mut st.probs) <= 0.0 {
        return Err("no candidate with a finite logit is left".into());
    }
    Ok(())
}

/// Draws among the first `n` sorted candidates (renormalised), updates μ and
/// selects the token.
fn draw_and_update(
    st: &mut MirostatState,
    n: usize,
    tau: f32,
    eta: f32,
    tokens: &mut Tokens<'_>,
    rng: &mut HostRng<'_>,
) {
    st.cands.truncate(n);
    util::softmax_into(&st.cands, &mut st.probs);
    let target = rng.uniform_f64();
    let mut run = 0.0f64;
    let mut idx = 0;
    for (i, &p) in st.probs.iter().enumerate() {
        if p > 0.0 {
            idx = i;
            run += p as f64;
            if run >= target {
                break;
            }
        }
    }
    let surprise = -st.probs[idx].log2();
    st.mu -= eta * (surprise - tau);
    tokens.select(st.cands[idx].id);
}

/// What tells the two versions apart: their name and extra parameters, and
/// how many of the sorted candidates the draw keeps. The target `tau`, the
/// learning rate `eta`, μ and the draw are [`MirostatStage`]'s, written once.
pub trait Version: Sized + Send + Sync + 'static {
    const NAME: &'static CStr;
    /// The stage name, for error messages.
    const STAGE: &'static str;
    const DESCRIPTION: &'static CStr;
    const PARAMS: &'static [SdParamSpec];

    fn new(params: &Params<'_>) -> Result<Self, String>;

    /// How many of the sorted candidates (their probabilities in `st.probs`,
    /// at least one) the draw keeps, given μ.
    fn keep(&self, st: &MirostatState, n_vocab: usize) -> usize;
}

const TAU: SdParamSpec = number_param(c"tau", c"target surprise (bits)", 5.0);
const ETA: SdParamSpec = number_param(c"eta", c"learning rate of mu", 0.1);

/// A mirostat stage of version `V`; see [`Mirostat`] and [`MirostatV2`].
pub struct MirostatStage<V> {
    tau: f32,
    eta: f32,
    version: V,
}

/// Mirostat 1.0.
pub type Mirostat = MirostatStage<V1>;
/// Mirostat 2.0.
pub type MirostatV2 = MirostatStage<V2>;

impl<V: Version> Stage for MirostatStage<V> {
    const NAME: &'static CStr = V::NAME;
    const DESCRIPTION: &'static CStr = V::DESCRIPTION;
    const PARAMS: &'static [SdParamSpec] = V::PARAMS;
    const FLAGS: u32 = SD_STAGE_SELECTS | SD_STAGE_DENSE_OK;
    type State = MirostatState;

    fn new(params: &Params<'_>, _vocab: Option<&Vocab<'_>>) -> Result<Self, String> {
        let tau = util::non_negative(params, V::STAGE, "tau")?;
        let eta = util::non_negative(params, V::STAGE, "eta")?;
        Ok(MirostatStage {
            tau: tau as f32,
            eta: eta as f32,
            version: V::new(params)?,
        })
    }

    fn new_state(&self) -> MirostatState {
        MirostatState {
            mu: 2.0 * self.tau,
            ..Default::default()
        }
    }

    fn apply(
        &self,
        st: &mut MirostatState,
        tokens: &mut Tokens<'_>,
        rng: &mut HostRng<'_>,
    ) -> Result<(), String> {
        sorted_softmax(tokens, st).map_err(|e| format!("{}: {e}", V::STAGE))?;
        let n = self.version.keep(st, tokens.n_vocab());
        draw_and_update(st, n, self.tau, self.eta, tokens, rng);
        Ok(())
    }
}

/// Version 1: estimates the Zipf exponent from the top `m` tokens and keeps
/// the top k it implies.
pub struct V1 {
    m: usize,
}

impl Version for V1 {
    const NAME: &'static CStr = c"mirostat";
    const STAGE: &'static str = "mirostat";
    const DESCRIPTION: &'static CStr =
        c"Mirostat 1.0: adaptive top-k targeting surprise tau, then draws";
    const PARAMS: &'static [SdParamSpec] = &[
        TAU,
        ETA,
        number_param(c"m", c"tokens used to estimate the Zipf exponent", 100.0),
    ];

    fn new(params: &Params<'_>) -> Result<Self, String> {
        let m = util::integer(params, Self::STAGE, "m", 1, u32::MAX as i64)? as usize;
        Ok(V1 { m })
    }

    fn keep(&self, st: &MirostatState, n_vocab: usize) -> usize {
        let size = st.cands.len();
        let p = &st.probs;
        let (mut sum_ti_bi, mut sum_ti_sq) = (0.0f32, 0.0f32);
        for i in 0..(self.m - 1).min(size - 1) {
            let t_i = ((i + 2) as f32 / (i + 1) as f32).ln();
            let b_i = (p[i] / p[i + 1]).ln();
            sum_ti_bi += t_i * b_i;
            sum_ti_sq += t_i * t_i;
        }
        let s_hat = sum_ti_bi / sum_ti_sq;
        let eps = s_hat - 1.0;
        let n_vocab = n_vocab as f32;
        let k = ((eps * 2f32.powf(st.mu)) / (1.0 - n_vocab.powf(-eps))).powf(1.0 / s_hat);
        // `as` saturates (NaN -> 0), then at least 1, at most the list
        (k as i64).max(1).min(size as i64) as usize
    }
}

/// Version 2: keeps the tokens whose surprise is <= μ (at least one).
pub struct V2;

impl Version for V2 {
    const NAME: &'static CStr = c"mirostat_v2";
    const STAGE: &'static str = "mirostat_v2";
    const DESCRIPTION: &'static CStr =
        c"Mirostat 2.0: keeps tokens with surprise <= mu, draws, adapts mu towards tau";
    const PARAMS: &'static [SdParamSpec] = &[TAU, ETA];

    fn new(_params: &Params<'_>) -> Result<Self, String> {
        Ok(V2)
    }

    fn keep(&self, st: &MirostatState, _n_vocab: usize) -> usize {
        let mu = st.mu;
        st.probs
            .iter()
            .position(|&p| -p.log2() > mu)
            .unwrap_or(st.probs.len())
            .max(1)
    }
}
