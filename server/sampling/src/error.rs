//! Error types of the sampling core. Every message names the file, stage,
//! parameter or index that was wrong and the offending value.

use std::path::PathBuf;

use crate::echo::Echo;

/// An error and its sources on one line, `outer: cause: root`: libloading
/// puts dlerror's text in the source, rustls the reason a key was refused.
pub fn error_chain(e: &dyn std::error::Error) -> String {
    let mut msg = e.to_string();
    let mut src = e.source();
    while let Some(s) = src {
        msg.push_str(": ");
        msg.push_str(&s.to_string());
        src = s.source();
    }
    msg
}

/// A plugin library could not be loaded.
#[derive(Debug, thiserror::Error)]
pub enum LoadError {
    #[error("plugin directory {path}: {reason}")]
    Directory { path: PathBuf, reason: String },
    #[error("plugin {path}: cannot load library: {reason}")]
    Open { path: PathBuf, reason: String },
    #[error(
        "plugin {path}: no `samplerd_plugin_entry_v1` symbol (not a samplerd plugin, or built for another major ABI version)"
    )]
    NoEntry { path: PathBuf },
    #[error("plugin {path}: incompatible ABI: {reason}")]
    Abi { path: PathBuf, reason: String },
    #[error("plugin {path}: stage #{index}: {reason}")]
    Stage {
        path: PathBuf,
        index: usize,
        reason: String,
    },
    #[error("plugin {path}: stage `{name}` is already provided by {other}")]
    Duplicate {
        path: PathBuf,
        name: String,
        other: PathBuf,
    },
    #[error("no sampler stages were loaded (searched: {searched})")]
    Empty { searched: String },
    #[error("{0}")]
    Trust(#[from] crate::trust::TrustError),
}

/// A chain spec was rejected while building the chain.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum ChainError {
    #[error("chain is empty: it needs at least a selecting stage (e.g. dist or greedy)")]
    Empty,
    /// `name` is the client's: kept bounded ([`Echo`]).
    #[error("unknown stage {name} (loaded stages: {known})")]
    UnknownStage { name: Echo, known: String },
    /// `param` is the client's: kept bounded ([`Echo`]).
    #[error("stage `{stage}`: unknown parameter {param} (accepted: {accepted})")]
    UnknownParam {
        stage: String,
        param: Echo,
        accepted: String,
    },
    #[error("stage `{stage}`: parameter `{param}` must be {expected}, got {got}")]
    ParamKind {
        stage: String,
        param: String,
        expected: &'static str,
        got: String,
    },
    #[error("stage `{stage}`: {message}")]
    Invalid { stage: String, message: String },
    #[error(
        "the last stage `{stage}` does not select a token; end the chain with dist, greedy or another selecting stage"
    )]
    NoSelectingStage { stage: String },
    #[error(
        "stage `{stage}` selects a token, so it must be the last stage (position {position} of {len})"
    )]
    SelectingNotLast {
        stage: String,
        position: usize,
        len: usize,
    },
    /// A stage that had to be built beforehand (`Prebuilt::require`) was
    /// not: a caller's bug, never the request's.
    #[error("stage `{stage}` was not built beforehand")]
    NotPrebuilt { stage: String },
    #[error("{field} {message}")]
    Param {
        field: &'static str,
        message: String,
    },
}

/// Logits that cannot be sampled from.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum LogitsError {
    #[error("logits are empty")]
    Empty,
    #[error("logits[{index}] is {value}: logits must be finite or -inf")]
    NotFinite { index: usize, value: f32 },
    #[error("raw logits are {len} bytes, not a multiple of 4 (little-endian f32)")]
    ByteLength { len: usize },
    #[error("vocabulary of {len} logits exceeds the limit of {limit}")]
    TooLarge { len: usize, limit: usize },
    #[error("all logits are -inf: nothing can be sampled")]
    AllMasked,
}

/// A chain failed while running.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum SampleError {
    #[error(transparent)]
    Logits(#[from] LogitsError),
    #[error("stage `{stage}` failed: {message}")]
    Plugin { stage: String, message: String },
    /// The stage failed because of the request's input (`SD_ERR_INPUT`):
    /// a grammar that outgrew its parser's limits, a token it refuses.
    #[error("stage `{stage}` refused the request: {message}")]
    Refused { stage: String, message: String },
    #[error("stage `{stage}` misbehaved: {what}")]
    Misbehaved { stage: String, what: String },
    #[error("the chain ended without selecting a token (last stage `{stage}`)")]
    NoSelection { stage: String },
    #[error(
        "every token is masked (-inf) by the time stage `{stage}` selects (for example a logit_bias of -inf on every token): nothing can be sampled"
    )]
    AllMasked { stage: String },
    #[error("no logits loaded into the token buffer")]
    NotLoaded,
    /// A sparse row's proof could not show that the outcome is the dense
    /// row's ([`crate::sparse`]): the client's row is too short for this
    /// chain, not a failure of the server.
    #[error(transparent)]
    Sparse(#[from] SparseRefusal),
}

/// Why a sparse row cannot stand for its dense row in this chain: the
/// stage (or request field) whose outcome could depend on the entries that
/// were not sent, and, where the proof can tell, how many entries would
/// have been enough.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
#[error("{message}")]
pub struct SparseRefusal {
    /// The stage at fault, when a stage is.
    pub stage: Option<String>,
    /// The request field at fault (`n_probs`), when not a stage.
    pub field: Option<&'static str>,
    /// The whole explanation, naming the stage or field and the values.
    pub message: String,
    /// Entries sent.
    pub sent: usize,
    /// At least this many would be needed (when the proof can say).
    pub entries_needed: Option<usize>,
}
