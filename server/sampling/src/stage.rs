//! What the host knows about one loaded stage: its parameters, flags and
//! vtable. Both the registry (which fills these in at load) and the chain
//! (which calls through them) use these types, so they live apart from
//! either.

use std::path::PathBuf;

use samplerd_plugin_sdk::abi::*;
use serde::Serialize;

/// The value kind of a stage parameter.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum ParamKind {
    Number,
    String,
    TokenMap,
    StringList,
}

impl ParamKind {
    pub(crate) fn from_abi(kind: u32) -> Option<Self> {
        match kind {
            SD_PARAM_NUMBER => Some(Self::Number),
            SD_PARAM_STRING => Some(Self::String),
            SD_PARAM_TOKEN_MAP => Some(Self::TokenMap),
            SD_PARAM_STRING_LIST => Some(Self::StringList),
            _ => None,
        }
    }

    pub fn describe(self) -> &'static str {
        match self {
            Self::Number => "a number",
            Self::String => "a string",
            Self::TokenMap => "a map of token id to value",
            Self::StringList => "a list of strings",
        }
    }
}

/// One parameter a stage accepts.
#[derive(Clone, Debug, Serialize)]
pub struct ParamInfo {
    pub name: String,
    pub kind: ParamKind,
    pub default: f64,
    pub description: String,
}

/// A registered stage, as ListStages shows it.
#[derive(Clone, Debug, Serialize)]
pub struct StageInfo {
    pub name: String,
    pub library: String,
    pub library_version: String,
    pub path: PathBuf,
    pub description: String,
    pub params: Vec<ParamInfo>,
    /// Writes the chosen token (may only end a chain).
    pub selects: bool,
    /// Works on the dense view (else the host converts to candidates first).
    pub dense_ok: bool,
    /// Refuses to build without a vocabulary (`SD_STAGE_NEEDS_VOCAB`).
    pub needs_vocab: bool,
    /// Only lowers or removes tokens, one at a time
    /// (`SD_STAGE_SPARSE_LOWERS_ONLY`, from an ABI 1.2+ library): a sparse
    /// row's proof may run it over the sent entries alone.
    pub sparse_lowers_only: bool,
}

/// A stage as the host calls it: its description and the library's
/// validated, static vtable.
pub(crate) struct RegisteredStage {
    pub info: StageInfo,
    pub vtable: &'static SdStage,
    /// What a crash report names while this stage's code runs.
    pub site: &'static crate::activity::CallSite,
}
