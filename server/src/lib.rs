//! samplerd: the gRPC server that turns LLM logits into the next token
//! through a chain of sampler stages loaded as plugins.
//!
//! Modules: [`config`] (figment layers), [`telemetry`] (tracing),
//! [`convert`] (proto ↔ sampling types), [`errors`] (→ gRPC status),
//! [`service`] (the RPCs), [`pool`] (token buffer reuse), [`model`] (the
//! Generate seam), [`generation`] (the model host's decode loop), [`server`] (assembly: health, reflection, limits) and
//! [`check`] (`check-config`), [`metrics`] (Prometheus, request layer) and
//! [`shutdown`] (draining on SIGTERM); security: [`tls`] (rustls, mutual
//! TLS, the plaintext rule), [`auth`] (bearer tokens) and [`deadline`]
//! (per-request deadlines).

pub mod auth;
pub mod check;
pub mod config;
pub mod convert;
pub mod deadline;
pub mod errors;
pub mod generation;
pub mod metrics;
pub mod model;
pub mod pool;
pub mod server;
pub mod service;
pub mod shutdown;
pub mod step_pool;
pub mod telemetry;
pub mod tls;
