//! The stage's grammar parameters → one llguidance `TopLevelGrammar`.
//! Exactly one grammar parameter must be given; its name travels with the
//! grammar so every later error names it.

use llguidance::api::TopLevelGrammar;
use samplerd_plugin_sdk::Params;
use serde_json::{Value, json};

use crate::gbnf;

/// A grammar parameter's source text is refused above this size, before
/// llguidance parses it: real schemas and grammars are kilobytes (a large
/// tool-calling schema ~100 KB), and a 10 MB one would cost ~50 MB of
/// `serde_json::Value` before llguidance's own size limits apply.
pub const MAX_SOURCE_BYTES: usize = 1 << 20;

/// The grammar parameters, in the order errors list them.
pub const GRAMMAR_PARAMS: [&str; 6] = [
    "json_schema",
    "regex",
    "lark",
    "gbnf",
    "json_object",
    "choice",
];

/// `json_whitespace = bounded`: what may separate two JSON tokens — one
/// space, or one or two newlines then at most 20 spaces or tabs. This is
/// llama.cpp's `SPACE_RULE` (common/json-schema-to-grammar.cpp,
/// `| " " | "\n"{1,2} [ \t]{0,20}`) as an llguidance skip regex, which
/// matches at most once between two lexemes. llguidance's own default,
/// `[\x20\x0A\x0D\x09]+` (`free`), lets a small model spend its whole
/// `max_tokens` on newlines between two keys: with SmolLM2-135M, 6 of 59
/// real-world schemas did.
const BOUNDED_WHITESPACE: &str = r"(?: |\n{1,2}[ \t]{0,20})";

/// Why the parameters do not make a grammar. The `Display` text follows
/// `constraint: ` in the stage's error.
#[derive(Debug, thiserror::Error)]
pub enum GrammarError {
    #[error("needs exactly one of {}, got none", GRAMMAR_PARAMS.join(", "))]
    None,
    #[error("needs exactly one of {}, got {}", GRAMMAR_PARAMS.join(", "), .0.join(" and "))]
    Several(Vec<&'static str>),
    #[error("{param}: {len} bytes is over the limit of {MAX_SOURCE_BYTES} bytes")]
    TooLarge { param: &'static str, len: usize },
    #[error("json_object: must be 0 (off) or 1 (on), got {0}")]
    JsonObjectValue(f64),
    #[error("choice: needs at least one string, got an empty list")]
    EmptyChoice,
    #[error("json_schema: not valid JSON: {0}")]
    SchemaJson(serde_json::Error),
    #[error("json_whitespace: must be one of bounded, compact, free, got {0:?}")]
    JsonWhitespace(String),
    #[error("json_whitespace: applies to json_schema and json_object only, not to {0}")]
    JsonWhitespaceNotJson(&'static str),
    #[error("gbnf: {0}")]
    Gbnf(#[from] gbnf::GbnfError),
}

/// A grammar and the parameter it came from.
pub struct Source {
    pub param: &'static str,
    pub grammar: TopLevelGrammar,
}

fn check_size(param: &'static str, s: &str) -> Result<(), GrammarError> {
    if s.len() > MAX_SOURCE_BYTES {
        return Err(GrammarError::TooLarge {
            param,
            len: s.len(),
        });
    }
    Ok(())
}

/// Reads the one grammar parameter of `params`.
pub fn from_params(params: &Params<'_>) -> Result<Source, GrammarError> {
    let json_object = params.number("json_object");
    if params.is_set("json_object") && json_object != 0.0 && json_object != 1.0 {
        return Err(GrammarError::JsonObjectValue(json_object));
    }
    let given: Vec<&'static str> = GRAMMAR_PARAMS
        .into_iter()
        .filter(|&p| match p {
            "json_object" => json_object == 1.0,
            _ => params.is_set(p),
        })
        .collect();
    let param = match given.as_slice() {
        [] => return Err(GrammarError::None),
        [one] => *one,
        _ => return Err(GrammarError::Several(given)),
    };
    let text = |p| {
        let s = params.string(p).unwrap_or("");
        check_size(p, s).map(|()| s)
    };
    let whitespace = json_whitespace(params, param)?;
    let grammar = match param {
        "json_schema" => {
            let schema = serde_json::from_str(text(param)?).map_err(GrammarError::SchemaJson)?;
            TopLevelGrammar::from_json_schema(with_whitespace(schema, whitespace))
        }
        "regex" => TopLevelGrammar::from_regex(text(param)?),
        "lark" => TopLevelGrammar::from_lark(text(param)?.to_string()),
        "gbnf" => TopLevelGrammar::from_lark(gbnf::to_lark(text(param)?)?),
        "json_object" => TopLevelGrammar::from_json_schema(with_whitespace(
            json!({"type": "object"}),
            whitespace,
        )),
        "choice" => {
            let list = params.strings(param).unwrap_or_default();
            if list.is_empty() {
                return Err(GrammarError::EmptyChoice);
            }
            check_size(param, &list.concat())?;
            TopLevelGrammar::from_lark(choice_lark(&list))
        }
        _ => unreachable!("GRAMMAR_PARAMS lists {param}"),
    };
    Ok(Source { param, grammar })
}

/// The `json_whitespace` parameter as llguidance's JSON compile options
/// (`x-guidance`), checked against the grammar parameter `param`.
fn json_whitespace(params: &Params<'_>, param: &'static str) -> Result<Value, GrammarError> {
    let Some(value) = params.string("json_whitespace") else {
        return Ok(json!({ "whitespace_pattern": BOUNDED_WHITESPACE }));
    };
    if !matches!(param, "json_schema" | "json_object") {
        return Err(GrammarError::JsonWhitespaceNotJson(param));
    }
    Ok(match value {
        "bounded" => json!({ "whitespace_pattern": BOUNDED_WHITESPACE }),
        "compact" => json!({ "whitespace_flexible": false }),
        // llguidance's defaults.
        "free" => json!({}),
        other => {
            let shown: String = other.chars().take(40).collect();
            return Err(GrammarError::JsonWhitespace(shown));
        }
    })
}

/// `schema` with the whitespace options, unless it sets its own
/// `x-guidance` (llguidance's documented per-schema options, which win).
/// `true` is the empty schema: it gets the options as `{}` would.
fn with_whitespace(schema: Value, options: Value) -> Value {
    let mut schema = match schema {
        Value::Bool(true) => json!({}),
        other => other,
    };
    if let Some(o) = schema.as_object_mut() {
        o.entry("x-guidance").or_insert(options);
    }
    schema
}

/// `start: "a" | "b"`: Lark string literals use JSON string syntax, so
/// `serde_json` escapes each choice exactly.
fn choice_lark(list: &[&str]) -> String {
    let alts: Vec<String> = list
        .iter()
        .map(|s| serde_json::to_string(s).expect("a string serialises"))
        .collect();
    format!("start: {}", alts.join(" | "))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn choices_are_json_escaped_lark_literals() {
        assert_eq!(
            choice_lark(&["a\"b", "c\\d\n", ""]),
            r#"start: "a\"b" | "c\\d\n" | """#
        );
    }
}
