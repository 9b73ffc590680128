//! Typed sampling parameters (what a request sets) and their translation
//! into a chain spec in llama.cpp's order: logit_bias → penalties → dry →
//! top_n_sigma → top_k → typical_p → top_p → min_p → xtc → temperature →
//! dist. Stages at their neutral value are left out (llama.cpp runs them as
//! no-ops), so the default parameters give exactly penalties → top_k
//! → top_p → temperature → dist.
//!
//! Ranges are the stages' to check, not this module's: a field outside its
//! stage's neutral value keeps the stage in the plan (in the chain, or as
//! a stage that is built only to be checked), so the stage's own message
//! reaches the client, renamed to the request field by [`TYPED_FIELDS`].

use samplerd_plugin_sdk::defaults;
use serde::{Deserialize, Serialize};

use crate::error::ChainError;
use crate::spec::{ChainSpec, ParamValue, StageSpec};

/// A typed field and the stage parameter it sets.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct TypedField {
    pub field: &'static str,
    pub stage: &'static str,
    pub param: &'static str,
}

const fn typed(field: &'static str, stage: &'static str, param: &'static str) -> TypedField {
    TypedField {
        field,
        stage,
        param,
    }
}

/// Which stage parameter each typed field becomes: the table that turns a
/// stage's complaint about its parameter into one about the request field.
pub const TYPED_FIELDS: &[TypedField] = &[
    typed("logit_bias", "logit_bias", "bias"),
    typed("repeat_last_n", "penalties", "repeat_last_n"),
    typed("repeat_penalty", "penalties", "repeat_penalty"),
    typed("frequency_penalty", "penalties", "frequency_penalty"),
    typed("presence_penalty", "penalties", "presence_penalty"),
    typed("penalty_exclude_tokens", "penalties", "exclude_tokens"),
    typed("dry_multiplier", "dry", "multiplier"),
    typed("dry_base", "dry", "base"),
    typed("dry_allowed_length", "dry", "allowed_length"),
    typed("dry_penalty_last_n", "dry", "penalty_last_n"),
    typed("dry_sequence_breakers", "dry", "sequence_breakers"),
    typed("top_n_sigma", "top_n_sigma", "n"),
    typed("top_k", "top_k", "k"),
    typed("typical_p", "typical_p", "p"),
    typed("top_p", "top_p", "p"),
    typed("min_p", "min_p", "p"),
    typed("xtc_probability", "xtc", "probability"),
    typed("xtc_threshold", "xtc", "threshold"),
    typed("temperature", "temperature", "t"),
    typed("adaptive_target", "adaptive_p", "target"),
    typed("adaptive_decay", "adaptive_p", "decay"),
    typed("constraint.json_schema", "constraint", "json_schema"),
    typed("constraint.regex", "constraint", "regex"),
    typed("constraint.lark", "constraint", "lark"),
    typed("constraint.gbnf", "constraint", "gbnf"),
    typed("constraint.json_object", "constraint", "json_object"),
    typed("constraint.choice", "constraint", "choice"),
    typed(
        "constraint.json_whitespace",
        "constraint",
        "json_whitespace",
    ),
    typed(
        "constraint.trigger_strings",
        "constraint",
        "trigger_strings",
    ),
    typed("constraint.trigger_tokens", "constraint", "trigger_tokens"),
];

/// What a request's output must match: the grammar of the `constraint`
/// stage (its own plugin library), one parameter named by its kind.
#[derive(Clone, Debug, PartialEq)]
pub enum Constraint {
    JsonSchema(String, JsonWhitespace),
    Regex(String),
    Lark(String),
    Gbnf(String),
    JsonObject(JsonWhitespace),
    Choice(Vec<String>),
}

/// What a JSON constraint allows between two JSON tokens (the stage's
/// `json_whitespace`). `Bounded` is llama.cpp's rule and the stage's own
/// default, so it is not passed on.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum JsonWhitespace {
    #[default]
    Bounded,
    Compact,
    Free,
}

impl JsonWhitespace {
    /// The stage parameter's value.
    pub fn name(self) -> &'static str {
        match self {
            JsonWhitespace::Bounded => "bounded",
            JsonWhitespace::Compact => "compact",
            JsonWhitespace::Free => "free",
        }
    }
}

/// A lazy constraint's triggers (the stage's `trigger_strings` and
/// `trigger_tokens`): free text until one appears. Empty: not lazy.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct ConstraintTriggers {
    pub strings: Vec<String>,
    pub tokens: Vec<u32>,
}

impl ConstraintTriggers {
    /// `spec` with the trigger parameters (unchanged when there are none).
    pub fn add_to(&self, mut spec: StageSpec) -> StageSpec {
        if !self.strings.is_empty() {
            spec = spec.with(
                "trigger_strings",
                ParamValue::StringList(self.strings.clone()),
            );
        }
        if !self.tokens.is_empty() {
            let ids = self.tokens.iter().map(u32::to_string).collect();
            spec = spec.with("trigger_tokens", ParamValue::StringList(ids));
        }
        spec
    }
}

/// The stage that holds the output to a [`Constraint`].
pub const CONSTRAINT_STAGE: &str = "constraint";

impl Constraint {
    /// The stage with its grammar parameter.
    pub fn stage(&self) -> StageSpec {
        let (value, whitespace) = match self {
            Constraint::JsonSchema(s, w) => (ParamValue::String(s.clone()), *w),
            Constraint::Regex(s) | Constraint::Lark(s) | Constraint::Gbnf(s) => {
                (ParamValue::String(s.clone()), JsonWhitespace::default())
            }
            Constraint::JsonObject(w) => (ParamValue::Number(1.0), *w),
            Constraint::Choice(v) => (ParamValue::StringList(v.clone()), JsonWhitespace::default()),
        };
        let spec = StageSpec::new(CONSTRAINT_STAGE).with(self.kind(), value);
        match whitespace {
            JsonWhitespace::Bounded => spec,
            w => spec.with("json_whitespace", ParamValue::String(w.name().into())),
        }
    }

    /// Its kind as the request field names it (`json_schema`, …).
    pub fn kind(&self) -> &'static str {
        match self {
            Constraint::JsonSchema(..) => "json_schema",
            Constraint::Regex(_) => "regex",
            Constraint::Lark(_) => "lark",
            Constraint::Gbnf(_) => "gbnf",
            Constraint::JsonObject(_) => "json_object",
            Constraint::Choice(_) => "choice",
        }
    }

    /// Bytes of grammar text it carries (what `limits.max_constraint_bytes`
    /// bounds).
    pub fn text_bytes(&self) -> usize {
        match self {
            Constraint::JsonSchema(s, _)
            | Constraint::Regex(s)
            | Constraint::Lark(s)
            | Constraint::Gbnf(s) => s.len(),
            Constraint::JsonObject(_) => 0,
            Constraint::Choice(v) => v.iter().map(String::len).sum(),
        }
    }
}

/// A stage's refusal of a parameter built from typed fields, renamed to
/// the typed field ([`ChainError::Param`]); other errors pass through.
/// Stages word their messages `"<stage>: <param> must be …"` (the core
/// stages and the host's own kind checks do); a stage with one typed field
/// is named even when its message does not start with the parameter.
pub fn name_typed_field(err: ChainError) -> ChainError {
    let ChainError::Invalid { stage, message } = &err else {
        return err;
    };
    let rest = message
        .strip_prefix(stage.as_str())
        .and_then(|m| m.strip_prefix(": "))
        .unwrap_or(message);
    let word = rest
        .split([' ', ':', ',', '['])
        .next()
        .unwrap_or("")
        .trim_matches('`');
    let mut of_stage = TYPED_FIELDS.iter().filter(|f| f.stage == stage);
    let only = {
        let mut all = of_stage.clone();
        match (all.next(), all.next()) {
            (Some(f), None) => Some(f),
            _ => None,
        }
    };
    match of_stage.find(|f| f.param == word).or(only) {
        Some(f) => ChainError::Param {
            field: f.field,
            message: format!("refused by stage `{stage}`: {rest}"),
        },
        None => err,
    }
}

/// The stages typed parameters give: the chain itself, and the stages left
/// out at a no-op value that is not their plain "off" (for example
/// `top_p = 1.5`, or `top_k` under the greedy shortcut), which are built
/// only so that the stage checks the value.
#[derive(Clone, Debug, PartialEq)]
pub struct ChainPlan {
    pub spec: ChainSpec,
    pub check_only: Vec<StageSpec>,
}

/// What one name of the order becomes.
enum Planned {
    /// The stage runs.
    Run(StageSpec),
    /// The stage is a no-op here, but the value is not its plain "off":
    /// only the stage can say whether it is valid.
    Check(StageSpec),
    /// At its plain "off" value: left out.
    Off,
}

/// llama.cpp's default stage order (common/common.h), without the final
/// draw, which is always `dist` (or `greedy` at temperature 0).
pub const DEFAULT_ORDER: &[&str] = &[
    "logit_bias",
    "penalties",
    "dry",
    "top_n_sigma",
    "top_k",
    "typical_p",
    "top_p",
    "min_p",
    "xtc",
    "temperature",
];

/// Sampling parameters. Defaults are the core stages' own
/// (`samplerd_plugin_sdk::defaults`: llama.cpp's `common_params_sampling`
/// — temperature 0.8, top_k 40, top_p 0.95, window 64, DRY off with base
/// 1.75, allowed length 2, the whole history — except `repeat_penalty`
/// 1.1, llama.cpp: 1.0, off) but `min_p` 0, off (llama.cpp and the stage:
/// 0.05).
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
    /// Token ids the penalties never penalise (they still count in the
    /// window); empty = none.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub penalty_exclude_tokens: Vec<u32>,
    pub top_n_sigma: f32,
    pub xtc_probability: f32,
    pub xtc_threshold: f32,
    /// adaptive-p's target probability; >= 0 makes `adaptive_p` the draw
    /// instead of `dist` (llama.cpp), negative = off.
    pub adaptive_target: f32,
    /// adaptive-p's decay (clamped to [0, 0.99] by the stage).
    pub adaptive_decay: f32,
    /// DRY penalty scale; 0 = off.
    pub dry_multiplier: f32,
    pub dry_base: f32,
    pub dry_allowed_length: i32,
    /// 0 = off, -1 = the whole history.
    pub dry_penalty_last_n: i32,
    /// Strings that end a repeat; `[""]` = none.
    pub dry_sequence_breakers: Vec<String>,
    /// Token id → bias added to its logit.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub logit_bias: Vec<(u32, f32)>,
    /// Stage order by name (llama.cpp `--samplers`); empty = `DEFAULT_ORDER`.
    /// May name any loaded non-selecting stage, e.g. a third-party plugin.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub order: Vec<String>,
    /// Structured output (requests only: a configured default grammar
    /// would hold every request to it). First in the chain, before any
    /// order: every later stage sees only tokens the grammar allows.
    #[serde(skip)]
    pub constraint: Option<Constraint>,
    /// What makes the constraint lazy (requests only, like it).
    #[serde(skip)]
    pub constraint_triggers: ConstraintTriggers,
}

impl Default for SamplingParams {
    fn default() -> Self {
        SamplingParams {
            temperature: defaults::TEMPERATURE as f32,
            top_k: defaults::TOP_K,
            top_p: defaults::TOP_P as f32,
            min_p: 0.0,
            typical_p: defaults::TYPICAL_P as f32,
            repeat_penalty: defaults::REPEAT_PENALTY as f32,
            frequency_penalty: defaults::FREQUENCY_PENALTY as f32,
            presence_penalty: defaults::PRESENCE_PENALTY as f32,
            repeat_last_n: defaults::REPEAT_LAST_N,
            penalty_exclude_tokens: Vec::new(),
            top_n_sigma: defaults::TOP_N_SIGMA as f32,
            xtc_probability: defaults::XTC_PROBABILITY as f32,
            xtc_threshold: defaults::XTC_THRESHOLD as f32,
            adaptive_target: defaults::ADAPTIVE_TARGET as f32,
            adaptive_decay: defaults::ADAPTIVE_DECAY as f32,
            dry_multiplier: defaults::DRY_MULTIPLIER as f32,
            dry_base: defaults::DRY_BASE as f32,
            dry_allowed_length: defaults::DRY_ALLOWED_LENGTH,
            dry_penalty_last_n: defaults::DRY_PENALTY_LAST_N,
            dry_sequence_breakers: defaults::DRY_SEQUENCE_BREAKERS
                .iter()
                .map(|s| s.to_string())
                .collect(),
            logit_bias: Vec::new(),
            order: Vec::new(),
            constraint: None,
            constraint_triggers: ConstraintTriggers::default(),
        }
    }
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
    fn penalties_active(&self) -> bool {
        self.repeat_last_n != 0
            && (self.repeat_penalty != 1.0
                || self.frequency_penalty != 0.0
                || self.presence_penalty != 0.0)
    }

    /// llama.cpp's condition for DRY to do anything
    /// (`llama_sampler_dry_apply`).
    fn dry_active(&self) -> bool {
        self.dry_multiplier != 0.0 && self.dry_base >= 1.0 && self.dry_penalty_last_n != 0
    }

    /// The stage (with parameters) for one name of the order. A stage at
    /// its no-op value is left out only when the value is the plain "off"
    /// (`!=` is true for NaN, so NaN always reaches the stage's check).
    fn stage_for(&self, name: &str) -> Planned {
        let n = |v: f32| v as f64;
        let plan = |run: bool, off: bool, spec: StageSpec| {
            if run {
                Planned::Run(spec)
            } else if off {
                Planned::Off
            } else {
                Planned::Check(spec)
            }
        };
        match name {
            "logit_bias" => plan(
                !self.logit_bias.is_empty(),
                true,
                StageSpec::new("logit_bias")
                    .with("bias", ParamValue::TokenMap(self.logit_bias.clone())),
            ),
            "penalties" => {
                let mut spec = StageSpec::new("penalties")
                    .number("repeat_last_n", self.repeat_last_n as f64)
                    .number("repeat_penalty", n(self.repeat_penalty))
                    .number("frequency_penalty", n(self.frequency_penalty))
                    .number("presence_penalty", n(self.presence_penalty));
                if !self.penalty_exclude_tokens.is_empty() {
                    let ids = self.penalty_exclude_tokens.iter().map(u32::to_string);
                    spec = spec.with("exclude_tokens", ParamValue::StringList(ids.collect()));
                }
                plan(
                    self.penalties_active(),
                    self.repeat_penalty == 1.0
                        && self.frequency_penalty == 0.0
                        && self.presence_penalty == 0.0
                        && self.repeat_last_n == SamplingParams::default().repeat_last_n,
                    spec,
                )
            }
            "dry" => {
                let d = SamplingParams::default();
                plan(
                    self.dry_active(),
                    self.dry_multiplier == 0.0
                        && self.dry_base == d.dry_base
                        && self.dry_allowed_length == d.dry_allowed_length
                        && self.dry_penalty_last_n == d.dry_penalty_last_n
                        && self.dry_sequence_breakers == d.dry_sequence_breakers,
                    StageSpec::new("dry")
                        .number("multiplier", n(self.dry_multiplier))
                        .number("base", n(self.dry_base))
                        .number("allowed_length", self.dry_allowed_length as f64)
                        .number("penalty_last_n", self.dry_penalty_last_n as f64)
                        .with(
                            "sequence_breakers",
                            ParamValue::StringList(self.dry_sequence_breakers.clone()),
                        ),
                )
            }
            // llama.cpp: n <= 0 is off.
            "top_n_sigma" => plan(
                self.top_n_sigma > 0.0,
                self.top_n_sigma == -1.0,
                StageSpec::new("top_n_sigma").number("n", n(self.top_n_sigma)),
            ),
            "top_k" => plan(
                self.top_k > 0,
                self.top_k == 0,
                StageSpec::new("top_k").number("k", self.top_k as f64),
            ),
            "typical_p" => plan(
                self.typical_p < 1.0,
                self.typical_p == 1.0,
                StageSpec::new("typical_p").number("p", n(self.typical_p)),
            ),
            // llama.cpp: p <= 0 keeps the most likely token.
            "top_p" => plan(
                self.top_p < 1.0,
                self.top_p == 1.0,
                StageSpec::new("top_p").number("p", n(self.top_p)),
            ),
            // llama.cpp: p <= 0 is off; p > 1 keeps the most likely token.
            "min_p" => plan(
                self.min_p > 0.0,
                self.min_p == 0.0,
                StageSpec::new("min_p").number("p", n(self.min_p)),
            ),
            "xtc" => plan(
                self.xtc_probability > 0.0,
                self.xtc_probability == 0.0
                    && self.xtc_threshold == SamplingParams::default().xtc_threshold,
                StageSpec::new("xtc")
                    .number("probability", n(self.xtc_probability))
                    .number("threshold", n(self.xtc_threshold)),
            ),
            "temperature" => {
                Planned::Run(StageSpec::new("temperature").number("t", n(self.temperature)))
            }
            // Named in `samplers`: where the order puts it (without a
            // constraint the stage refuses to build, naming what is missing).
            CONSTRAINT_STAGE => Planned::Run(self.constraint.as_ref().map_or_else(
                || StageSpec::new(CONSTRAINT_STAGE),
                |c| self.constraint_stage(c),
            )),
            other => Planned::Run(StageSpec::new(other)),
        }
    }

    /// The `constraint` stage of `c` with this request's triggers.
    fn constraint_stage(&self, c: &Constraint) -> StageSpec {
        self.constraint_triggers.add_to(c.stage())
    }

    /// The chain for these parameters (see [`Self::plan`]).
    pub fn chain_spec(&self) -> ChainSpec {
        self.plan().spec
    }

    /// The chain for these parameters, and the stages to build only to
    /// check their values. At temperature 0 with the default order (and no
    /// stage that can drop the most likely token: typical_p, xtc) the tail
    /// collapses to `greedy`, which picks exactly the token llama.cpp's
    /// temperature-0 chain picks, without truncating first.
    pub fn plan(&self) -> ChainPlan {
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
        let mut check_only = Vec::new();
        if let Some(c) = &self.constraint
            && !order.contains(&CONSTRAINT_STAGE)
        {
            stages.push(self.constraint_stage(c));
        }
        for name in order {
            // the stages that move logits rather than cut the list change
            // which token is the most likely (and the grammar decides which
            // are allowed at all): they stay before greedy
            let skipped =
                greedy && !matches!(name, "logit_bias" | "penalties" | "dry" | CONSTRAINT_STAGE);
            match self.stage_for(name) {
                Planned::Run(s) if skipped => check_only.push(s),
                Planned::Run(s) => stages.push(s),
                Planned::Check(s) => check_only.push(s),
                Planned::Off => {}
            }
        }
        // The draw: adaptive-p replaces dist when its target is >= 0, as
        // llama.cpp's `common_sampler_init` (common/sampling.cpp) appends it
        // instead of `dist`; greedy (temperature 0) still wins. Values
        // other than the defaults are built anyway, to be checked.
        let adaptive = StageSpec::new("adaptive_p")
            .number("target", self.adaptive_target as f64)
            .number("decay", self.adaptive_decay as f64);
        let adaptive_on = self.adaptive_target >= 0.0;
        if adaptive_on && !greedy {
            stages.push(adaptive);
        } else {
            if self.adaptive_target != defaults::ADAPTIVE_TARGET as f32
                || self.adaptive_decay != defaults::ADAPTIVE_DECAY as f32
            {
                check_only.push(adaptive);
            }
            stages.push(StageSpec::new(if greedy { "greedy" } else { "dist" }));
        }
        ChainPlan {
            spec: ChainSpec { stages },
            check_only,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn names(spec: &ChainSpec) -> Vec<&str> {
        spec.stages.iter().map(|s| s.name.as_str()).collect()
    }

    /// adaptive-p is the draw when its target is >= 0 (llama.cpp's
    /// `common_sampler_init`), not at temperature 0; an off value other
    /// than the default is still checked by the stage.
    #[test]
    fn adaptive_target_replaces_dist() {
        let on = SamplingParams {
            adaptive_target: 0.4,
            ..Default::default()
        };
        let spec = on.chain_spec();
        assert_eq!(
            names(&spec),
            ["penalties", "top_k", "top_p", "temperature", "adaptive_p"]
        );
        assert_eq!(
            spec.stages[4].params["target"],
            ParamValue::Number(0.4f32 as f64)
        );
        let greedy = SamplingParams {
            temperature: 0.0,
            ..on.clone()
        };
        assert_eq!(names(&greedy.chain_spec()), ["penalties", "greedy"]);
        let nan = SamplingParams {
            adaptive_target: f32::NAN,
            ..Default::default()
        };
        let plan = nan.plan();
        assert_eq!(names(&plan.spec).last(), Some(&"dist"));
        assert!(plan.check_only.iter().any(|s| s.name == "adaptive_p"));
        assert!(
            !SamplingParams::default()
                .plan()
                .check_only
                .iter()
                .any(|s| s.name == "adaptive_p")
        );
    }

    #[test]
    fn defaults_give_the_seed_documents_chain() {
        let spec = SamplingParams::default().chain_spec();
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
            names(&p.chain_spec()),
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

    /// llama.cpp's order (`common/common.h`): DRY right after the
    /// penalties; it moves logits, so it also stays before greedy.
    #[test]
    fn dry_lands_after_penalties_and_stays_before_greedy() {
        let p = SamplingParams {
            dry_multiplier: 0.8,
            ..Default::default()
        };
        assert_eq!(
            names(&p.chain_spec()),
            ["penalties", "dry", "top_k", "top_p", "temperature", "dist"]
        );
        let dry = &p.chain_spec().stages[1];
        assert_eq!(
            dry.params["sequence_breakers"],
            ParamValue::StringList(vec!["\n".into(), ":".into(), "\"".into(), "*".into()])
        );
        assert_eq!(dry.params["penalty_last_n"], ParamValue::Number(-1.0));
        let greedy = SamplingParams {
            temperature: 0.0,
            ..p
        };
        assert_eq!(names(&greedy.chain_spec()), ["penalties", "dry", "greedy"]);
        // off (llama.cpp: multiplier 0, base < 1 or last_n 0): not in the
        // chain; a non-default value is still the stage's to check
        for off in [
            SamplingParams::default(),
            SamplingParams {
                dry_multiplier: 0.8,
                dry_base: 0.5,
                ..Default::default()
            },
            SamplingParams {
                dry_multiplier: 0.8,
                dry_penalty_last_n: 0,
                ..Default::default()
            },
        ] {
            assert!(!names(&off.chain_spec()).contains(&"dry"), "{off:?}");
        }
        let checked = SamplingParams {
            dry_penalty_last_n: -7,
            ..Default::default()
        };
        assert_eq!(checked.plan().check_only[0].name, "dry");
        assert!(SamplingParams::default().plan().check_only.is_empty());
    }

    #[test]
    fn temperature_zero_is_penalties_then_greedy() {
        let p = SamplingParams {
            temperature: 0.0,
            logit_bias: vec![(3, 1.0)],
            ..Default::default()
        };
        assert_eq!(
            names(&p.chain_spec()),
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
            names(&p.chain_spec()),
            ["top_k", "penalties", "temperature", "dist"]
        );
    }

    /// Out-of-range and non-plain no-op values keep their stage in the
    /// plan (for the stage to judge); plain "off" values leave it out.
    #[test]
    fn no_op_values_other_than_off_are_checked_by_the_stage() {
        let checked = |p: SamplingParams| -> Vec<String> {
            p.plan().check_only.into_iter().map(|s| s.name).collect()
        };
        assert!(checked(SamplingParams::default()).is_empty());
        let cases: [(SamplingParams, &str); 5] = [
            (
                SamplingParams {
                    top_p: 1.5,
                    ..Default::default()
                },
                "top_p",
            ),
            (
                SamplingParams {
                    top_k: -3,
                    ..Default::default()
                },
                "top_k",
            ),
            (
                SamplingParams {
                    min_p: f32::NAN,
                    ..Default::default()
                },
                "min_p",
            ),
            (
                SamplingParams {
                    repeat_last_n: -2,
                    repeat_penalty: 1.0,
                    ..Default::default()
                },
                "penalties",
            ),
            (
                SamplingParams {
                    xtc_threshold: 7.0,
                    ..Default::default()
                },
                "xtc",
            ),
        ];
        for (p, stage) in cases {
            assert_eq!(checked(p.clone()), [stage], "{p:?}");
        }
        // The greedy shortcut drops the truncating stages from the chain,
        // but their values are still the stages' to check.
        let greedy = SamplingParams {
            temperature: 0.0,
            top_p: 1.5,
            ..Default::default()
        };
        assert_eq!(names(&greedy.chain_spec()), ["penalties", "greedy"]);
        assert!(checked(greedy).contains(&"top_p".to_string()));
    }

    #[test]
    fn a_stage_refusal_names_the_typed_field() {
        let refusal = |stage: &str, message: &str| {
            name_typed_field(ChainError::Invalid {
                stage: stage.into(),
                message: message.into(),
            })
            .to_string()
        };
        assert_eq!(
            refusal("top_p", "top_p: p must be <= 1, got 1.5"),
            "top_p refused by stage `top_p`: p must be <= 1, got 1.5"
        );
        assert_eq!(
            refusal(
                "penalties",
                "penalties: presence_penalty must be finite and >= 0, got -0.5"
            ),
            "presence_penalty refused by stage `penalties`: presence_penalty must be finite and >= 0, got -0.5"
        );
        // One typed field: named whatever the wording.
        assert!(refusal("logit_bias", "some other words").starts_with("logit_bias refused"));
        // Several, and no parameter named: left as the stage said it.
        assert_eq!(
            refusal("xtc", "something odd"),
            "stage `xtc`: something odd"
        );
        assert_eq!(
            refusal(
                "dry",
                "dry: sequence_breakers must be [\"\"] (none) without a model vocabulary, got [\":\"]"
            ),
            "dry_sequence_breakers refused by stage `dry`: sequence_breakers must be [\"\"] (none) without a model vocabulary, got [\":\"]"
        );
        assert!(
            refusal("dry", "dry: penalty_last_n must be in [-1, 65536], got -2")
                .starts_with("dry_penalty_last_n refused by stage `dry`")
        );
        // Not a typed stage at all.
        assert_eq!(refusal("mine", "mine: x bad"), "stage `mine`: mine: x bad");
    }
}
