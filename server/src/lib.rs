//! samplerd: the gRPC server that turns LLM logits into the next token
//! through a chain of sampler stages loaded as plugins.
//!
//! Modules: [`config`] (figment layers), [`telemetry`] (tracing),
//! [`convert`] (proto ↔ sampling types), [`errors`] (→ gRPC status),
//! [`service`] (the RPCs), [`pool`] (token buffer reuse), [`model`] (the
//! Generate seam), [`generation`] (the model host's decode loop), [`server`] (assembly: health, reflection, limits) and
//! [`check`] (`check-config`).

pub mod check;
pub mod config;
pub mod convert;
pub mod errors;
pub mod generation;
pub mod model;
pub mod pool;
pub mod server;
pub mod service;
pub mod telemetry;
