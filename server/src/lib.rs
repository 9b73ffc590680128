//! samplerd: the gRPC server that turns LLM logits into the next token
//! through a chain of sampler stages loaded as plugins.
//!
//! The layers, outside in:
//! - [`app`] — the process: configuration ([`app::config`], figment
//!   layers), logging ([`app::telemetry`]), assembly of the server with
//!   health and reflection ([`app::server`]), `check-config`
//!   ([`app::check`]) and draining on SIGTERM ([`app::shutdown`]).
//! - [`transport`] — what every RPC passes before a handler: TLS and the
//!   plaintext rule ([`transport::tls`]), bearer tokens
//!   ([`transport::auth`]), deadlines ([`transport::deadline`]), request
//!   metrics and `/metrics` ([`transport::metrics`]) and decoding
//!   single-frame messages without a copy ([`transport::one_frame`]).
//! - [`service`] — the `samplerd.v1.Sampler` RPCs: validation
//!   ([`service::validate`]), the sampling pool every step runs on
//!   ([`service::step_pool`]), one module per RPC.
//! - [`generate`] — the model host behind `Generate`: the decode loop, the
//!   batching decode engine and the [`generate::generator::Generator`] seam.

pub mod app;
pub mod crash;
pub mod generate;
pub mod request;
pub mod service;
pub mod status;
pub mod transport;
