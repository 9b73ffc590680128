//! Typed sampling parameters (what a request sets) and their translation
//! into a chain spec in llama.cpp's order: logit_bias → penalties →
//! top_n_sigma → top_k → typical_p → top_p → min_p → xtc → temperature →
//! dist. Stages at their neutral value are left out (llama.cpp runs them as
//! no-ops), so the default parameters give exactly penalties → top_k
//! → top_p → temperature → dist. Validation names the request field.

use serde::{Deserialize, Serialize};

use crate::chain::{ChainSpec, ParamValue, StageSpec};
use crate::error::ChainError;

/// llama.cpp's default stage order (common/common.h), without the final
/// draw, which is always `dist` (or `greedy` at temperature 0).
pub const DEFAULT_ORDER: &[&str] = &[
    "logit_bias",
    "penalties",
    "top_n_sigma",
    "top_k",
    "typical_p",
    "top_p",
    "min_p",
    "xtc",
    "temperature",
];

/// Largest accepted `repeat_last_n` (a window, not a history dump).
pub const MAX_REPEAT_LAST_N: i32 = 65_536;

/// Sampling parameters. Defaults follow llama.cpp's `common_params_sampling`
/// (`common/common.h`: temperature 0.8, top_k 40, top_p 0.95, window 64)
/// except `repeat_penalty` 1.1 (llama.cpp: 1.0, off) and `min_p` 0
/// (llama.cpp: 0.05).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct SamplingParams {
    pub temperature: f32,
    pub top_k: i32,
    pub top_p: f32,
    pub min_p: f32,
    pub typical_p: f32,
    pub repeat_penalty: f32,
    pub frequency_penalty: f32,
    pub presence_penalty: f32,
    pub repeat_last_n: i32,
    pub top_n_sigma: f32,
    pub xtc_probability: f32,
    pub xtc_threshold: f32,
    /// Token id → bias added to its logit.
    pub logit_bias: Vec<(u32, f32)>,
    /// Stage order by name (llama.cpp `--samplers`); empty = `DEFAULT_ORDER`.
    /// May name any loaded non-selecting stage, e.g. a third-party plugin.
    pub order: Vec<String>,
}

impl Default for SamplingParams {
    fn default() -> Self {
        SamplingParams {
            temperature: 0.8,
            top_k: 40,
            top_p: 0.95,
            min_p: 0.0,
            typical_p: 1.0,
            repeat_penalty: 1.1,
            frequency_penalty: 0.0,
            presence_penalty: 0.0,
            repeat_last_n: 64,
            top_n_sigma: -1.0,
            xtc_probability: 0.0,
            xtc_threshold: 0.1,
            logit_bias: Vec::new(),
            order: Vec::new(),
        }
    }
}

fn invalid(field: &'static str, message: String) -> ChainError {
    ChainError::Param { field, message }
}

/// Maps llama.cpp's `--samplers` aliases to our stage names.
pub fn canonical_stage_name(name: &str) -> &str {
    match name {
        "temp" => "temperature",
        "typ_p" | "typical" => "typical_p",
        "penalty" | "repetition" => "penalties",
        "top-k" => "top_k",
        "top-p" | "nucleus" => "top_p",
        "min-p" => "min_p",
        other => other,
    }
}

impl SamplingParams {
    /// Range checks, each error naming the field and the value.
    pub fn validate(&self) -> Result<(), ChainError> {
        let finite = |field: &'static str, v: f32| {
            if v.is_finite() {
                Ok(())
            } else {
                Err(invalid(field, format!("must be a finite number, got {v}")))
            }
        };
        for (field, v) in [
            ("temperature", self.temperature),
            ("top_p", self.top_p),
            ("min_p", self.min_p),
            ("typical_p", self.typical_p),
            ("repeat_penalty", self.repeat_penalty),
            ("frequency_penalty", self.frequency_penalty),
            ("presence_penalty", self.presence_penalty),
            ("top_n_sigma", self.top_n_sigma),
            ("xtc_probability", self.xtc_probability),
            ("xtc_threshold", self.xtc_threshold),
        ] {
            finite(field, v)?;
        }
        if self.temperature < 0.0 {
            return Err(invalid(
                "temperature",
                format!("must be >= 0, got {}", self.temperature),
            ));
        }
        if self.top_k < 0 {
            return Err(invalid(
                "top_k",
                format!("must be >= 0 (0 = off), got {}", self.top_k),
            ));
        }
        if !(self.top_p > 0.0 && self.top_p <= 1.0) {
            return Err(invalid(
                "top_p",
                format!("must be in (0, 1], got {}", self.top_p),
            ));
        }
        if !(0.0..=1.0).contains(&self.min_p) {
            return Err(invalid(
                "min_p",
                format!("must be in [0, 1], got {}", self.min_p),
            ));
        }
        if !(self.typical_p > 0.0 && self.typical_p <= 1.0) {
            return Err(invalid(
                "typical_p",
                format!("must be in (0, 1], got {}", self.typical_p),
            ));
        }
        if self.repeat_penalty <= 0.0 {
            return Err(invalid(
                "repeat_penalty",
                format!("must be > 0 (1 = off), got {}", self.repeat_penalty),
            ));
        }
        if self.frequency_penalty < 0.0 {
            return Err(invalid(
                "frequency_penalty",
                format!("must be >= 0, got {}", self.frequency_penalty),
            ));
        }
        if self.presence_penalty < 0.0 {
            return Err(invalid(
                "presence_penalty",
                format!("must be >= 0, got {}", self.presence_penalty),
            ));
        }
        if self.repeat_last_n < -1 || self.repeat_last_n > MAX_REPEAT_LAST_N {
            return Err(invalid(
                "repeat_last_n",
                format!(
                    "must be in [-1, {MAX_REPEAT_LAST_N}] (-1 = whole history), got {}",
                    self.repeat_last_n
                ),
            ));
        }
        if !(0.0..=1.0).contains(&self.xtc_probability) {
            return Err(invalid(
                "xtc_probability",
                format!("must be in [0, 1], got {}", self.xtc_probability),
            ));
        }
        if !(0.0..=1.0).contains(&self.xtc_threshold) {
            return Err(invalid(
                "xtc_threshold",
                format!("must be in [0, 1], got {}", self.xtc_threshold),
            ));
        }
        if let Some((id, b)) = self
            .logit_bias
            .iter()
            .find(|(_, b)| b.is_nan() || *b == f32::INFINITY)
        {
            return Err(invalid(
                "logit_bias",
                format!("bias of token {id} must be finite or -inf, got {b}"),
            ));
        }
        Ok(())
    }

    fn penalties_active(&self) -> bool {
        self.repeat_last_n != 0
            && (self.repeat_penalty != 1.0
                || self.frequency_penalty != 0.0
                || self.presence_penalty != 0.0)
    }

    /// The stage (with parameters) for one name of the order, or None when
    /// that built-in stage is at its neutral value.
    fn stage_for(&self, name: &str) -> Option<StageSpec> {
        let n = |v: f32| v as f64;
        match name {
            "logit_bias" => (!self.logit_bias.is_empty()).then(|| {
                StageSpec::new("logit_bias")
                    .with("bias", ParamValue::TokenMap(self.logit_bias.clone()))
            }),
            "penalties" => self.penalties_active().then(|| {
                StageSpec::new("penalties")
                    .number("repeat_last_n", self.repeat_last_n as f64)
                    .number("repeat_penalty", n(self.repeat_penalty))
                    .number("frequency_penalty", n(self.frequency_penalty))
                    .number("presence_penalty", n(self.presence_penalty))
            }),
            "top_n_sigma" => (self.top_n_sigma > 0.0)
                .then(|| StageSpec::new("top_n_sigma").number("n", n(self.top_n_sigma))),
            "top_k" => {
                (self.top_k > 0).then(|| StageSpec::new("top_k").number("k", self.top_k as f64))
            }
            "typical_p" => (self.typical_p < 1.0)
                .then(|| StageSpec::new("typical_p").number("p", n(self.typical_p))),
            "top_p" => {
                (self.top_p < 1.0).then(|| StageSpec::new("top_p").number("p", n(self.top_p)))
            }
            "min_p" => {
                (self.min_p > 0.0).then(|| StageSpec::new("min_p").number("p", n(self.min_p)))
            }
            "xtc" => (self.xtc_probability > 0.0).then(|| {
                StageSpec::new("xtc")
                    .number("probability", n(self.xtc_probability))
                    .number("threshold", n(self.xtc_threshold))
            }),
            "temperature" => Some(StageSpec::new("temperature").number("t", n(self.temperature))),
            other => Some(StageSpec::new(other)),
        }
    }

    /// The chain for these parameters. At temperature 0 with the default
    /// order (and no stage that can drop the most likely token: typical_p,
    /// xtc) the tail collapses to `greedy`, which picks exactly the token
    /// llama.cpp's temperature-0 chain picks, without truncating first.
    pub fn chain_spec(&self) -> Result<ChainSpec, ChainError> {
        self.validate()?;
        let custom = !self.order.is_empty();
        let order: Vec<&str> = if custom {
            self.order.iter().map(|s| canonical_stage_name(s)).collect()
        } else {
            DEFAULT_ORDER.to_vec()
        };
        let greedy = !custom
            && self.temperature == 0.0
            && self.typical_p >= 1.0
            && self.xtc_probability <= 0.0;
        let mut stages = Vec::new();
        for name in order {
            if greedy && !matches!(name, "logit_bias" | "penalties") {
                continue;
            }
            if let Some(s) = self.stage_for(name) {
                stages.push(s);
            }
        }
        stages.push(StageSpec::new(if greedy { "greedy" } else { "dist" }));
        Ok(ChainSpec { stages })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn names(spec: &ChainSpec) -> Vec<&str> {
        spec.stages.iter().map(|s| s.name.as_str()).collect()
    }

    #[test]
    fn defaults_give_the_seed_documents_chain() {
        let spec = SamplingParams::default().chain_spec().unwrap();
        assert_eq!(
            names(&spec),
            ["penalties", "top_k", "top_p", "temperature", "dist"]
        );
    }

    #[test]
    fn min_p_lands_at_llama_cpp_position() {
        let p = SamplingParams {
            min_p: 0.05,
            ..Default::default()
        };
        assert_eq!(
            names(&p.chain_spec().unwrap()),
            [
                "penalties",
                "top_k",
                "top_p",
                "min_p",
                "temperature",
                "dist"
            ]
        );
    }

    #[test]
    fn temperature_zero_is_penalties_then_greedy() {
        let p = SamplingParams {
            temperature: 0.0,
            logit_bias: vec![(3, 1.0)],
            ..Default::default()
        };
        assert_eq!(
            names(&p.chain_spec().unwrap()),
            ["logit_bias", "penalties", "greedy"]
        );
    }

    #[test]
    fn custom_order_keeps_the_order_and_aliases() {
        let p = SamplingParams {
            order: vec!["top_k".into(), "penalties".into(), "temp".into()],
            ..Default::default()
        };
        assert_eq!(
            names(&p.chain_spec().unwrap()),
            ["top_k", "penalties", "temperature", "dist"]
        );
    }

    #[test]
    fn invalid_values_name_the_field() {
        let cases: [(SamplingParams, &str); 6] = [
            (
                SamplingParams {
                    top_p: 1.5,
                    ..Default::default()
                },
                "top_p must be in (0, 1], got 1.5",
            ),
            (
                SamplingParams {
                    temperature: -1.0,
                    ..Default::default()
                },
                "temperature must be >= 0, got -1",
            ),
            (
                SamplingParams {
                    top_k: -3,
                    ..Default::default()
                },
                "top_k must be >= 0 (0 = off), got -3",
            ),
            (
                SamplingParams {
                    temperature: f32::NAN,
                    ..Default::default()
                },
                "temperature must be a finite number, got NaN",
            ),
            (
                SamplingParams {
                    presence_penalty: -0.5,
                    ..Default::default()
                },
                "presence_penalty must be >= 0, got -0.5",
            ),
            (
                SamplingParams {
                    repeat_last_n: -2,
                    ..Default::default()
                },
                "repeat_last_n must be in",
            ),
        ];
        for (p, want) in cases {
            let msg = p.chain_spec().unwrap_err().to_string();
            assert!(msg.starts_with(want), "{msg:?} should start with {want:?}");
        }
    }
}
