//! samplerd's sampling core: loads sampler-stage plugins over the C ABI
//! (`library`, `registry`), builds validated chains from stage specs
//! (`chain`, `params`), runs them over a reusable token buffer (`buffer`)
//! with host-owned, counter-based randomness (`rng`), and provides the
//! byte-level stop-string matcher the Generate loop uses (`stop`); `trust`
//! refuses plugin files other users could have written, or whose pinned
//! digest does not match.

pub mod activity;
pub mod bench;
pub mod buffer;
pub mod chain;
pub mod device_prefix;
pub mod error;
pub mod library;
pub mod logits;
pub mod params;
pub mod registry;
pub mod rng;
pub mod scan;
pub mod stop;
pub mod trust;
pub mod vocab;

pub use buffer::TokenBuffer;
pub use chain::{Chain, ChainSpec, ParamValue, Sampled, Sequence, StageSpec};
pub use error::{ChainError, LoadError, LogitsError, SampleError};
pub use params::{DEFAULT_ORDER, SamplingParams};
pub use registry::{ParamInfo, ParamKind, StageInfo, StageRegistry};
pub use rng::StepRng;
pub use stop::{StopFilter, match_stop_suffix};
pub use trust::{TrustError, TrustPolicy};
pub use vocab::Vocabulary;
