//! Chain specs as configuration and requests spell them: an ordered list of
//! stage names with their parameters. Nothing here touches a plugin; the
//! chain builder validates a spec against the registry.

use std::collections::BTreeMap;
use std::fmt;

use serde::{Deserialize, Serialize};

use crate::echo;
use crate::stage::ParamKind;

/// A parameter value in a chain spec.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(untagged)]
pub enum ParamValue {
    Number(f64),
    String(String),
    TokenMap(Vec<(u32, f32)>),
    StringList(Vec<String>),
}

impl ParamValue {
    pub(crate) fn kind(&self) -> ParamKind {
        match self {
            Self::Number(_) => ParamKind::Number,
            Self::String(_) => ParamKind::String,
            Self::TokenMap(_) => ParamKind::TokenMap,
            Self::StringList(_) => ParamKind::StringList,
        }
    }
}

/// A number as the client most likely wrote it: a whole number as an
/// integer (an i32 field such as `top_k = -2147483648` is exactly an f32
/// too, which would print as -2147483600), else a request's f32 value as
/// that f32 (1.1, not 1.100000023841858).
pub fn show_number(n: f64) -> String {
    // Every integer up to 2^53 is exact in an f64, and so in an i64.
    const EXACT: f64 = (1u64 << 53) as f64;
    if n.fract() == 0.0 && n.abs() <= EXACT {
        format!("{}", n as i64)
    } else if n.is_finite() && n.abs() > EXACT {
        // `{}` would write all 300 digits of 1e300.
        format!("{n:e}")
    } else if (n as f32) as f64 == n {
        format!("{}", n as f32)
    } else {
        format!("{n}")
    }
}

/// Bounded: text and lists are quoted by [`crate::echo`] (a value can be
/// as long as a request message), a token map shows its size.
impl fmt::Display for ParamValue {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::Number(n) => f.write_str(&show_number(*n)),
            Self::String(s) => write!(f, "{}", echo::quote(s)),
            Self::TokenMap(m) => write!(f, "{{{} entries}}", m.len()),
            Self::StringList(l) => write!(f, "{}", echo::quote_list(l)),
        }
    }
}

/// One stage of a chain spec: a registered stage name and its parameters.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct StageSpec {
    pub name: String,
    #[serde(default)]
    pub params: BTreeMap<String, ParamValue>,
}

impl StageSpec {
    pub fn new(name: &str) -> Self {
        StageSpec {
            name: name.to_string(),
            params: BTreeMap::new(),
        }
    }

    pub fn number(mut self, param: &str, value: f64) -> Self {
        self.params
            .insert(param.to_string(), ParamValue::Number(value));
        self
    }

    pub fn with(mut self, param: &str, value: ParamValue) -> Self {
        self.params.insert(param.to_string(), value);
        self
    }
}

/// An ordered list of stages; the last one must select a token.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct ChainSpec {
    pub stages: Vec<StageSpec>,
}

impl fmt::Display for ChainSpec {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        self.for_log(LogDetail::Excerpt).fmt(f)
    }
}

/// How much of a chain's text a log line carries. Text and lists in a
/// request's chain are the client's content (a grammar, stop-like
/// breakers, a choice list): never logged whole.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum LogDetail {
    /// Each text or list as its length and a short hash ([`echo::digest`]):
    /// what INFO logs.
    Digest,
    /// Each text or list quoted as an error message quotes it, the first
    /// [`echo::MAX_ECHO_BYTES`] and its length: what DEBUG logs (and the
    /// chain's `Display`).
    Excerpt,
}

impl ChainSpec {
    /// The chain as a log line shows it: stage names and numbers as they
    /// are, text and lists as `detail` says.
    pub fn for_log(&self, detail: LogDetail) -> ForLog<'_> {
        ForLog { spec: self, detail }
    }
}

/// See [`ChainSpec::for_log`].
#[derive(Clone, Copy, Debug)]
pub struct ForLog<'a> {
    spec: &'a ChainSpec,
    detail: LogDetail,
}

impl fmt::Display for ForLog<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        for (i, s) in self.spec.stages.iter().enumerate() {
            if i > 0 {
                f.write_str(" → ")?;
            }
            f.write_str(&s.name)?;
            if s.params.is_empty() {
                continue;
            }
            f.write_str("(")?;
            for (j, (k, v)) in s.params.iter().enumerate() {
                if j > 0 {
                    f.write_str(", ")?;
                }
                match (self.detail, v) {
                    (LogDetail::Digest, ParamValue::String(t)) => {
                        write!(f, "{k}={}", echo::digest(t.as_bytes()))?
                    }
                    (LogDetail::Digest, ParamValue::StringList(l)) => {
                        // The items' bytes, each followed by a NUL (which
                        // no item holds), so that ["ab"] and ["a", "b"]
                        // differ.
                        let joined: Vec<u8> = l.iter().flat_map(|s| s.bytes().chain([0])).collect();
                        write!(f, "{k}={} strings {}", l.len(), echo::digest(&joined))?
                    }
                    _ => write!(f, "{k}={v}")?,
                }
            }
            f.write_str(")")?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn grammar_chain(grammar: &str) -> ChainSpec {
        ChainSpec {
            stages: vec![
                StageSpec::new("constraint")
                    .with("json_schema", ParamValue::String(grammar.into())),
                StageSpec::new("dry").with(
                    "sequence_breakers",
                    ParamValue::StringList(vec!["secret".into(), "\n".into()]),
                ),
                StageSpec::new("top_k").number("k", 40.0),
                StageSpec::new("dist"),
            ],
        }
    }

    #[test]
    fn a_digest_log_line_never_holds_the_text() {
        let grammar = format!("{{\"description\": \"{}\"}}", "x".repeat(1 << 20));
        let line = grammar_chain(&grammar)
            .for_log(LogDetail::Digest)
            .to_string();
        assert!(!line.contains("xxxx") && !line.contains("secret"), "{line}");
        assert!(
            line.contains(&format!("json_schema=<{} bytes #", grammar.len())),
            "{line}"
        );
        assert!(
            line.contains("sequence_breakers=2 strings <9 bytes #"),
            "{line}"
        );
        assert!(line.contains("top_k(k=40) → dist"), "{line}");
        assert!(line.len() < 200, "{}", line.len());
    }

    #[test]
    fn an_excerpt_log_line_is_bounded() {
        let grammar = "y".repeat(1 << 20);
        let line = grammar_chain(&grammar).to_string();
        assert_eq!(
            line,
            grammar_chain(&grammar)
                .for_log(LogDetail::Excerpt)
                .to_string()
        );
        assert!(line.contains("(1048576 bytes)"), "{line}");
        assert!(
            line.contains(r#"sequence_breakers=["secret", "\n"]"#),
            "{line}"
        );
        assert!(line.len() < 2 * echo::MAX_ECHO_BYTES, "{}", line.len());
    }

    #[test]
    fn whole_numbers_print_as_integers() {
        assert_eq!(show_number(-2147483648.0), "-2147483648");
        assert_eq!(show_number(4294967296.0), "4294967296");
        assert_eq!(show_number(1.1f32 as f64), "1.1");
        assert_eq!(show_number(0.1), "0.1");
        assert_eq!(show_number(f64::NAN), "NaN");
        assert_eq!(show_number(f64::INFINITY), "inf");
        assert_eq!(show_number(1e300), "1e300");
    }
}
