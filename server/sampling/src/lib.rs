//! samplerd's sampling core: loads sampler-stage plugins over the C ABI
//! (`library`, `registry`, `stage`), builds validated chains from stage
//! specs (`spec`, `params`, `chain`), runs them over a reusable token buffer
//! (`sequence`, `buffer`) with host-owned, counter-based randomness (`rng`),
//! over dense rows (`step`) or sparse ones (`sparse`: the top of a row and
//! the log-sum-exp of the rest, with a proof that the outcome is exact);
//! `verify` checks a speculative decoder's draft tokens as a loop of that
//! step; `trust` refuses plugin files other users could have written,
//! or whose pinned digest does not match.

pub mod activity;
pub mod bench;
pub mod buffer;
mod builder;
pub mod chain;
mod check;
pub mod device_prefix;
pub mod echo;
pub mod error;
mod ffi;
pub mod input;
pub mod library;
pub mod logits;
pub mod params;
pub mod registry;
pub mod rng;
pub mod scan;
pub mod sequence;
pub mod sparse;
pub mod spec;
pub mod stage;
pub mod step;
pub mod trust;
pub mod verify;
pub mod vocab;

pub use buffer::TokenBuffer;
pub use builder::Prebuilt;
pub use chain::{BuiltStage, Chain};
pub use error::{ChainError, LoadError, LogitsError, SampleError, SparseRefusal};
pub use params::{Constraint, ConstraintTriggers, DEFAULT_ORDER, JsonWhitespace, SamplingParams};
pub use registry::StageRegistry;
pub use rng::StepRng;
/// The longest window a built-in windowed stage keeps (defined in the
/// plugin SDK, which the stages share with the host).
pub use samplerd_plugin_sdk::defaults::MAX_PENALTY_WINDOW;
pub use sequence::{Sampled, Sequence};
pub use spec::{ChainSpec, ParamValue, StageSpec};
pub use stage::{ParamInfo, ParamKind, StageInfo};
pub use trust::{TrustError, TrustPolicy};
pub use vocab::Vocabulary;
