//! Chain specs as configuration and requests spell them: an ordered list of
//! stage names with their parameters. Nothing here touches a plugin; the
//! chain builder validates a spec against the registry.

use std::collections::BTreeMap;
use std::fmt;

use serde::{Deserialize, Serialize};

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

impl fmt::Display for ParamValue {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            // Request values are f32; print them as the f32 they were.
            Self::Number(n) if (*n as f32) as f64 == *n => write!(f, "{}", *n as f32),
            Self::Number(n) => write!(f, "{n}"),
            Self::String(s) => write!(f, "{s:?}"),
            Self::TokenMap(m) => write!(f, "{{{} entries}}", m.len()),
            Self::StringList(l) => write!(f, "{l:?}"),
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
        for (i, s) in self.stages.iter().enumerate() {
            if i > 0 {
                f.write_str(" → ")?;
            }
            f.write_str(&s.name)?;
            if !s.params.is_empty() {
                let ps: Vec<String> = s.params.iter().map(|(k, v)| format!("{k}={v}")).collect();
                write!(f, "({})", ps.join(", "))?;
            }
        }
        Ok(())
    }
}
