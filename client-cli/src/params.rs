//! Sampling flags → the proto's `SamplingParams`. Only what the user set is
//! sent (`optional` fields stay unset otherwise), so the server's configured
//! defaults apply to everything else.

use samplerd_api::v1::{Constraint, JsonWhitespace, SamplingParams, StringList, constraint};

use crate::cli::{ConstraintArgs, GrammarFile, JsonWhitespaceArg, SamplingArgs};

/// Builds the request's `SamplingParams` from the flags the user gave.
/// `--greedy` is `temperature = 0`; `--samplers` splits on `;` (and `,`).
pub fn sampling_params(a: &SamplingArgs) -> SamplingParams {
    let temperature = if a.greedy { Some(0.0) } else { a.temp };
    SamplingParams {
        temperature,
        top_k: a.top_k,
        top_p: a.top_p,
        min_p: a.min_p,
        typical_p: a.typical_p,
        repeat_penalty: a.repeat_penalty,
        frequency_penalty: a.frequency_penalty,
        presence_penalty: a.presence_penalty,
        repeat_last_n: a.repeat_last_n,
        penalty_exclude_tokens: a.penalty_exclude_tokens.clone(),
        seed: a.seed,
        logit_bias: a.logit_bias.iter().copied().collect(),
        chain: Vec::new(),
        top_n_sigma: a.top_n_sigma,
        xtc_probability: a.xtc_probability,
        xtc_threshold: a.xtc_threshold,
        adaptive_target: a.adaptive_target,
        adaptive_decay: a.adaptive_decay,
        dry_multiplier: a.dry_multiplier,
        dry_base: a.dry_base,
        dry_allowed_length: a.dry_allowed_length,
        dry_penalty_last_n: a.dry_penalty_last_n,
        dry_sequence_breakers: dry_sequence_breakers(&a.dry_sequence_breakers),
        samplers: a
            .samplers
            .as_deref()
            .map(split_samplers)
            .unwrap_or_default(),
        constraint: constraint(&a.constraint, a.json_whitespace),
        vocabulary: a.vocabulary.clone().unwrap_or_default(),
    }
}

/// The constraint flag given, if any (clap lets through at most one), with
/// `--json-whitespace` (the server refuses it on a kind that is not JSON).
fn constraint(c: &ConstraintArgs, whitespace: Option<JsonWhitespaceArg>) -> Option<Constraint> {
    use constraint::Kind;
    let kind = if let Some(s) = &c.json_schema {
        Kind::JsonSchema(s.clone())
    } else if let Some(r) = &c.regex {
        Kind::Regex(r.clone())
    } else if let Some(g) = &c.grammar {
        match g {
            GrammarFile::Gbnf(t) => Kind::Gbnf(t.clone()),
            GrammarFile::Lark(t) => Kind::Lark(t.clone()),
        }
    } else if c.json_object {
        Kind::JsonObject(true)
    } else {
        let values = c
            .choice
            .as_deref()?
            .split(';')
            .map(str::to_string)
            .collect();
        Kind::Choice(StringList { values })
    };
    let json_whitespace = match whitespace {
        None => JsonWhitespace::Unspecified,
        Some(JsonWhitespaceArg::Bounded) => JsonWhitespace::Bounded,
        Some(JsonWhitespaceArg::Compact) => JsonWhitespace::Compact,
        Some(JsonWhitespaceArg::Free) => JsonWhitespace::Free,
    };
    Some(Constraint {
        kind: Some(kind),
        json_whitespace: json_whitespace as i32,
        ..Default::default()
    })
}

/// llama.cpp's `--dry-sequence-breaker` flags → the request's list: `none`
/// clears the breakers, which the request spells `[""]` (an empty list
/// would mean "the server's default"); escapes are processed as llama.cpp
/// does for this flag.
fn dry_sequence_breakers(flags: &[String]) -> Vec<String> {
    if flags.iter().any(|f| f == "none") {
        return vec![String::new()];
    }
    flags.iter().map(|f| process_escapes(f)).collect()
}

/// `\n`, `\r`, `\t`, `\'`, `\"` and `\\`; any other backslash stays.
fn process_escapes(s: &str) -> String {
    let mut out = String::with_capacity(s.len());
    let mut chars = s.chars();
    while let Some(c) = chars.next() {
        if c != '\\' {
            out.push(c);
            continue;
        }
        match chars.next() {
            Some('n') => out.push('\n'),
            Some('r') => out.push('\r'),
            Some('t') => out.push('\t'),
            Some(q @ ('\'' | '"' | '\\')) => out.push(q),
            Some(other) => {
                out.push('\\');
                out.push(other);
            }
            None => out.push('\\'),
        }
    }
    out
}

/// `"penalties;top_k; top_p"` → `["penalties", "top_k", "top_p"]`.
fn split_samplers(s: &str) -> Vec<String> {
    s.split([';', ','])
        .map(str::trim)
        .filter(|n| !n.is_empty())
        .map(str::to_string)
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn each_constraint_flag_becomes_its_kind() {
        use samplerd_api::v1::constraint::Kind;
        let kind = |c: ConstraintArgs| constraint(&c, None).and_then(|c| c.kind);
        assert_eq!(kind(ConstraintArgs::default()), None);
        assert_eq!(
            kind(ConstraintArgs {
                regex: Some("a+".into()),
                ..Default::default()
            }),
            Some(Kind::Regex("a+".into()))
        );
        assert_eq!(
            kind(ConstraintArgs {
                grammar: Some(GrammarFile::Lark("start: \"x\"".into())),
                ..Default::default()
            }),
            Some(Kind::Lark("start: \"x\"".into()))
        );
        assert_eq!(
            kind(ConstraintArgs {
                choice: Some("yes;no".into()),
                ..Default::default()
            }),
            Some(Kind::Choice(StringList {
                values: vec!["yes".into(), "no".into()]
            }))
        );
    }

    #[test]
    fn json_whitespace_rides_on_the_constraint() {
        let a = SamplingArgs {
            constraint: ConstraintArgs {
                json_object: true,
                ..Default::default()
            },
            json_whitespace: Some(JsonWhitespaceArg::Compact),
            ..Default::default()
        };
        let c = sampling_params(&a).constraint.unwrap();
        assert_eq!(c.json_whitespace, JsonWhitespace::Compact as i32);
        // Without a constraint flag there is nothing to carry it.
        let alone = SamplingArgs {
            json_whitespace: Some(JsonWhitespaceArg::Free),
            ..Default::default()
        };
        assert_eq!(sampling_params(&alone).constraint, None);
    }

    #[test]
    fn unset_flags_stay_unset() {
        let p = sampling_params(&SamplingArgs::default());
        assert_eq!(p, SamplingParams::default());
    }

    #[test]
    fn dry_flags_llama_cpp_style() {
        let a = SamplingArgs {
            dry_multiplier: Some(0.8),
            dry_sequence_breakers: vec![r"\n".into(), "ab".into(), r"x\q".into()],
            ..Default::default()
        };
        let p = sampling_params(&a);
        assert_eq!(p.dry_multiplier, Some(0.8));
        assert_eq!(p.dry_sequence_breakers, ["\n", "ab", r"x\q"]);
        let none = SamplingArgs {
            dry_sequence_breakers: vec!["none".into()],
            ..Default::default()
        };
        assert_eq!(sampling_params(&none).dry_sequence_breakers, [""]);
    }

    #[test]
    fn greedy_and_samplers() {
        let a = SamplingArgs {
            greedy: true,
            top_k: Some(5),
            samplers: Some("penalties; top_k;;top_p,temperature".into()),
            ..Default::default()
        };
        let p = sampling_params(&a);
        assert_eq!(p.temperature, Some(0.0));
        assert_eq!(p.top_k, Some(5));
        assert_eq!(p.top_p, None);
        assert_eq!(p.samplers, ["penalties", "top_k", "top_p", "temperature"]);
    }
}
