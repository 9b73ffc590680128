//! The samplerd plugin SDK: the versioned C ABI ([`abi`], mirroring
//! `include/samplerd_plugin.h`) and a safe layer ([`Stage`], [`Tokens`],
//! [`export_plugin!`]) so that a sampler stage in Rust is a short file;
//! [`defaults`] holds the values the built-in stages and the host share.
//!
//! ```ignore
//! use samplerd_plugin_sdk::prelude::*;
//! struct Greedy;
//! impl Stage for Greedy { /* NAME, PARAMS, FLAGS, new, apply ... */ }
//! // (or `impl StatelessStage for Greedy`: no per-sequence state to declare)
//! samplerd_plugin_sdk::export_plugin!(name: c"mine", version: c"0.1.0", stages: [Greedy]);
//! ```
//!
//! Build the plugin as a `cdylib` with `panic = "unwind"` (the default):
//! with `panic = "abort"` a panic cannot be caught and kills the host.

pub mod abi;
pub mod defaults;
pub mod error;
pub mod export;
pub mod stage;
pub mod testing;

pub use error::input_error;
pub use stage::{
    HostRng, Params, Stage, StatelessStage, Tokens, ViewKind, Vocab, number_param, param_spec,
};

/// Everything a stage implementation usually needs.
pub mod prelude {
    pub use crate::abi::{
        SD_PARAM_NUMBER, SD_PARAM_STRING, SD_PARAM_STRING_LIST, SD_PARAM_TOKEN_MAP,
        SD_STAGE_DENSE_OK, SD_STAGE_NEEDS_VOCAB, SD_STAGE_OUTPUT_ONLY, SD_STAGE_SELECTS,
        SD_STAGE_SPARSE_LOWERS_ONLY, SD_TOKEN_CONTROL, SD_TOKEN_EOG, SdCandidate, SdParamSpec,
        SdTokenValue,
    };
    pub use crate::error::input_error;
    pub use crate::stage::{
        HostRng, Params, Stage, StatelessStage, Tokens, ViewKind, Vocab, number_param, param_spec,
    };
}
