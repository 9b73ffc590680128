//! Mapping between the `samplerd.v1` proto messages and the sampling
//! core's types: request parameters → chain spec (unset fields take the
//! configured defaults), stage specs and parameter values both ways, and
//! the logits encodings (inline floats, raw f32 bytes, a sparse row).

#![forbid(unsafe_code)]

use std::collections::BTreeMap;

use samplerd_api::v1;
use samplerd_sampling::echo::quote;
use samplerd_sampling::sparse::SparseRow;
use samplerd_sampling::step::Logits;
use samplerd_sampling::{
    ChainSpec, Constraint, ConstraintTriggers, JsonWhitespace, ParamKind, ParamValue,
    SamplingParams, StageInfo, StageSpec,
};

use crate::request::errors::{InvalidKind, RequestError};

/// Field names as clients see them (error messages name these).
pub const FIELD_LOGITS: &str = "logits";
pub const FIELD_LOGITS_F32LE: &str = "logits_f32le";
pub const FIELD_SPARSE: &str = "sparse";
pub const FIELD_SHARED: &str = "shared";

pub use samplerd_sampling::input::StepLogits;

/// The logits of one step, in whichever encoding the request used, plus
/// the request field they came from.
#[derive(Clone, Copy, Debug)]
pub struct LogitsInput<'a> {
    logits: StepLogits<'a>,
    field: &'static str,
}

impl<'a> LogitsInput<'a> {
    /// Picks the one set dense encoding: both or neither is
    /// INVALID_ARGUMENT; so are raw bytes whose length is not a multiple
    /// of 4 and a vocabulary over `max_vocab`. (A sparse row is checked by
    /// `validate::sparse`, which calls this when none is set.)
    pub fn from_request(
        floats: &'a [f32],
        bytes: &'a [u8],
        max_vocab: usize,
    ) -> Result<Self, RequestError> {
        let input = match (floats.is_empty(), bytes.is_empty()) {
            (false, false) => {
                return Err(RequestError::invalid(
                    "logits/logits_f32le",
                    format!(
                        "set exactly one of `logits` and `logits_f32le`, got both ({} floats and {} bytes)",
                        floats.len(),
                        bytes.len()
                    ),
                ));
            }
            (true, true) => {
                return Err(RequestError::invalid(
                    "logits/logits_f32le",
                    "set exactly one of `logits`, `logits_f32le`, `sparse` and `shared`, got none",
                ));
            }
            (false, true) => LogitsInput {
                logits: StepLogits::Dense(Logits::Floats(floats)),
                field: FIELD_LOGITS,
            },
            (true, false) => {
                if !bytes.len().is_multiple_of(4) {
                    return Err(RequestError::invalid_as(
                        InvalidKind::Logits,
                        FIELD_LOGITS_F32LE,
                        format!(
                            "length {} bytes is not a multiple of 4 (little-endian f32)",
                            bytes.len()
                        ),
                    ));
                }
                LogitsInput {
                    logits: StepLogits::Dense(Logits::F32le(bytes)),
                    field: FIELD_LOGITS_F32LE,
                }
            }
        };
        input.within(max_vocab)
    }

    /// Logits from `field` (a batch row's, already decoded from its wire
    /// type), under `max_vocab`.
    pub fn from_field(
        logits: Logits<'a>,
        field: &'static str,
        max_vocab: usize,
    ) -> Result<Self, RequestError> {
        LogitsInput {
            logits: StepLogits::Dense(logits),
            field,
        }
        .within(max_vocab)
    }

    /// A sparse row (already checked, `vocab_size` under the limit).
    pub fn sparse(row: SparseRow<'a>) -> Self {
        LogitsInput {
            logits: StepLogits::Sparse(row),
            field: FIELD_SPARSE,
        }
    }

    fn within(self, max_vocab: usize) -> Result<Self, RequestError> {
        if self.len() > max_vocab {
            return Err(RequestError::limit(
                self.field(),
                "limits.max_vocab",
                format!(
                    "vocabulary of {} logits exceeds the limit of {max_vocab} (limits.max_vocab)",
                    self.len()
                ),
            ));
        }
        Ok(self)
    }

    /// Number of logits (a sparse row's `vocab_size`).
    pub fn len(&self) -> usize {
        match self.logits {
            StepLogits::Dense(l) => l.len(),
            StepLogits::Sparse(r) => r.n_vocab(),
        }
    }

    /// Whether there are no logits.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The request field these came from.
    pub fn field(&self) -> &'static str {
        self.field
    }

    /// The field that says the row's length: the logits themselves, or a
    /// sparse row's `vocab_size`.
    pub fn len_field(&self) -> &'static str {
        match self.logits {
            StepLogits::Dense(_) if self.field == FIELD_SHARED => "shared.count",
            StepLogits::Dense(_) => self.field,
            StepLogits::Sparse(_) => "sparse.vocab_size",
        }
    }

    /// The logits as the sampling step takes them.
    pub fn as_step(&self) -> StepLogits<'a> {
        self.logits
    }
}

/// A step's reported candidates as the API's messages.
pub fn token_probabilities(
    probs: &[samplerd_sampling::step::Candidate],
) -> Vec<v1::TokenProbability> {
    probs
        .iter()
        .map(|c| v1::TokenProbability {
            token_id: c.token_id,
            probability: c.probability,
            logprob: c.logprob,
        })
        .collect()
}

/// A proto parameter value → the core's.
pub fn param_value_from_proto(v: &v1::ParamValue, field: &str) -> Result<ParamValue, RequestError> {
    use v1::param_value::Kind;
    match &v.kind {
        Some(Kind::Number(n)) => Ok(ParamValue::Number(*n)),
        Some(Kind::Text(s)) => Ok(ParamValue::String(s.clone())),
        Some(Kind::TokenMap(m)) => Ok(ParamValue::TokenMap(
            m.entries.iter().map(|e| (e.token_id, e.value)).collect(),
        )),
        Some(Kind::Strings(l)) => Ok(ParamValue::StringList(l.values.clone())),
        None => Err(RequestError::invalid(
            field,
            "no value set (number, text, token_map or strings)",
        )),
    }
}

/// The core's parameter value → proto.
pub fn param_value_to_proto(v: &ParamValue) -> v1::ParamValue {
    use v1::param_value::Kind;
    let kind = match v {
        ParamValue::Number(n) => Kind::Number(*n),
        ParamValue::String(s) => Kind::Text(s.clone()),
        ParamValue::TokenMap(m) => Kind::TokenMap(v1::TokenValueList {
            entries: m
                .iter()
                .map(|&(token_id, value)| v1::TokenValue { token_id, value })
                .collect(),
        }),
        ParamValue::StringList(l) => Kind::Strings(v1::StringList { values: l.clone() }),
    };
    v1::ParamValue { kind: Some(kind) }
}

/// `params.chain` → a chain spec (names are checked when it is built).
pub fn chain_from_proto(chain: &[v1::StageSpec]) -> Result<ChainSpec, RequestError> {
    let mut stages = Vec::with_capacity(chain.len());
    for (i, s) in chain.iter().enumerate() {
        if s.name.is_empty() {
            return Err(RequestError::invalid(
                format!("params.chain[{i}].name"),
                "is empty",
            ));
        }
        let mut params = BTreeMap::new();
        for (k, v) in &s.params {
            let field = format!("params.chain[{i}].params[{}]", quote(k));
            params.insert(k.clone(), param_value_from_proto(v, &field)?);
        }
        stages.push(StageSpec {
            name: s.name.clone(),
            params,
        });
    }
    Ok(ChainSpec { stages })
}

/// A chain spec → proto stage specs.
pub fn chain_to_proto(spec: &ChainSpec) -> Vec<v1::StageSpec> {
    spec.stages
        .iter()
        .map(|s| v1::StageSpec {
            name: s.name.clone(),
            params: s
                .params
                .iter()
                .map(|(k, v)| (k.clone(), param_value_to_proto(v)))
                .collect(),
        })
        .collect()
}

/// The request's typed fields over `base` (the configured defaults), or
/// `None` when it sets none (the default chain then serves it). The one
/// list of typed fields: a field missing here would be silently ignored,
/// so "was any set" and "merge" are the same walk over it.
/// `constraint` is `p.constraint` already converted ([`constraint_from_proto`],
/// done once by validation, which bounds its size first).
pub fn typed_params(
    base: &SamplingParams,
    p: &v1::SamplingParams,
    constraint: Option<Constraint>,
) -> Option<SamplingParams> {
    let mut out = base.clone();
    let mut set = false;
    macro_rules! take {
        ($($f:ident),*) => { $( if let Some(v) = p.$f { out.$f = v; set = true; } )* };
    }
    take!(
        temperature,
        top_k,
        top_p,
        min_p,
        typical_p,
        repeat_penalty,
        frequency_penalty,
        presence_penalty,
        repeat_last_n,
        top_n_sigma,
        xtc_probability,
        xtc_threshold,
        adaptive_target,
        adaptive_decay,
        dry_multiplier,
        dry_base,
        dry_allowed_length,
        dry_penalty_last_n
    );
    // A repeated field has no presence: empty = the configured breakers
    // (`[""]` asks for none).
    if !p.dry_sequence_breakers.is_empty() {
        out.dry_sequence_breakers = p.dry_sequence_breakers.clone();
        set = true;
    }
    if !p.penalty_exclude_tokens.is_empty() {
        let mut ids = p.penalty_exclude_tokens.clone();
        ids.sort_unstable();
        ids.dedup();
        out.penalty_exclude_tokens = ids;
        set = true;
    }
    if !p.logit_bias.is_empty() {
        let mut bias: Vec<(u32, f32)> = p.logit_bias.iter().map(|(&k, &v)| (k, v)).collect();
        bias.sort_by_key(|&(k, _)| k);
        out.logit_bias = bias;
        set = true;
    }
    if !p.samplers.is_empty() {
        out.order = p.samplers.clone();
        set = true;
    }
    if let Some(c) = constraint {
        out.constraint = Some(c);
        if let Some(pc) = &p.constraint {
            out.constraint_triggers = constraint_triggers(pc);
        }
        set = true;
    }
    set.then_some(out)
}

/// Whether `params.constraint` asks for one: a kind set, other than
/// `json_object: false` (no copy of the grammar).
pub fn constraint_is_set(c: &v1::Constraint) -> bool {
    !matches!(c.kind, None | Some(v1::constraint::Kind::JsonObject(false)))
}

/// `params.constraint` → the core's (`None`: not set, see
/// [`constraint_is_set`]).
pub fn constraint_from_proto(c: &v1::Constraint) -> Option<Constraint> {
    use v1::constraint::Kind;
    let whitespace = json_whitespace_from_proto(c.json_whitespace).unwrap_or_default();
    Some(match c.kind.as_ref()? {
        Kind::JsonSchema(s) => Constraint::JsonSchema(s.clone(), whitespace),
        Kind::Regex(s) => Constraint::Regex(s.clone()),
        Kind::Lark(s) => Constraint::Lark(s.clone()),
        Kind::Gbnf(s) => Constraint::Gbnf(s.clone()),
        Kind::JsonObject(true) => Constraint::JsonObject(whitespace),
        Kind::JsonObject(false) => return None,
        Kind::Choice(l) => Constraint::Choice(l.values.clone()),
    })
}

/// `params.constraint`'s triggers → the core's (empty: not lazy).
pub fn constraint_triggers(c: &v1::Constraint) -> ConstraintTriggers {
    ConstraintTriggers {
        strings: c.trigger_strings.clone(),
        tokens: c.trigger_tokens.clone(),
    }
}

/// `params.constraint.json_whitespace` → the core's (`None`: a value the
/// proto does not list).
pub fn json_whitespace_from_proto(value: i32) -> Option<JsonWhitespace> {
    use v1::JsonWhitespace as W;
    Some(match W::try_from(value).ok()? {
        W::Unspecified | W::Bounded => JsonWhitespace::Bounded,
        W::Compact => JsonWhitespace::Compact,
        W::Free => JsonWhitespace::Free,
    })
}

/// A registered stage → proto.
pub fn stage_info_to_proto(s: &StageInfo) -> v1::StageInfo {
    v1::StageInfo {
        name: s.name.clone(),
        library: s.library.clone(),
        path: s.path.display().to_string(),
        description: s.description.clone(),
        params: s
            .params
            .iter()
            .map(|p| v1::ParamInfo {
                name: p.name.clone(),
                kind: param_kind_name(p.kind).to_string(),
                default_value: (p.kind == ParamKind::Number && p.default.is_finite())
                    .then(|| param_value_to_proto(&ParamValue::Number(p.default))),
                description: p.description.clone(),
            })
            .collect(),
    }
}

/// The proto spelling of a parameter kind.
pub fn param_kind_name(k: ParamKind) -> &'static str {
    match k {
        ParamKind::Number => "number",
        ParamKind::String => "string",
        ParamKind::TokenMap => "token_map",
        ParamKind::StringList => "string_list",
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bytes_decode_little_endian() {
        let bytes: Vec<u8> = [1.5f32, -2.0]
            .iter()
            .flat_map(|f| f.to_le_bytes())
            .collect();
        let l = LogitsInput::from_request(&[], &bytes, 10).unwrap();
        assert_eq!(l.len(), 2);
        let StepLogits::Dense(dense) = l.as_step() else {
            panic!("raw bytes are a dense row");
        };
        assert_eq!(dense.get(1), -2.0);
    }

    #[test]
    fn both_or_neither_is_refused() {
        assert!(LogitsInput::from_request(&[], &[], 10).is_err());
        assert!(LogitsInput::from_request(&[1.0], &[0, 0, 0, 0], 10).is_err());
        let e = LogitsInput::from_request(&[], &[0, 0, 0], 10).unwrap_err();
        assert!(e.to_string().contains("logits_f32le"), "{e}");
    }

    #[test]
    fn typed_fields_override_defaults() {
        let p = v1::SamplingParams {
            top_k: Some(5),
            ..Default::default()
        };
        let m = typed_params(&SamplingParams::default(), &p, None).expect("a typed field is set");
        assert_eq!(m.top_k, 5);
        assert_eq!(m.top_p, SamplingParams::default().top_p);
    }

    #[test]
    fn dry_fields_override_defaults_and_empty_breakers_keep_them() {
        let p = v1::SamplingParams {
            dry_multiplier: Some(0.8),
            dry_penalty_last_n: Some(128),
            ..Default::default()
        };
        let m = typed_params(&SamplingParams::default(), &p, None).expect("a typed field is set");
        assert_eq!((m.dry_multiplier, m.dry_penalty_last_n), (0.8, 128));
        assert_eq!(
            m.dry_sequence_breakers,
            SamplingParams::default().dry_sequence_breakers
        );
        let p = v1::SamplingParams {
            dry_sequence_breakers: vec![String::new()],
            ..Default::default()
        };
        let m =
            typed_params(&SamplingParams::default(), &p, None).expect("breakers are a typed field");
        assert_eq!(m.dry_sequence_breakers, [""]);
    }

    /// Only the seed or a chain set: no typed parameter, the default chain.
    #[test]
    fn no_typed_field_means_none() {
        let p = v1::SamplingParams {
            seed: Some(3),
            ..Default::default()
        };
        assert_eq!(typed_params(&SamplingParams::default(), &p, None), None);
    }
}
