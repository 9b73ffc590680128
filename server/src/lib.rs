//! samplerd: the gRPC server that turns LLM logits into the next token
//! through a chain of sampler stages loaded as plugins.
//!
//! The layers, top down; each imports only those below it
//! (`scripts/ci/layers.sh` keeps the rules):
//! - `main.rs` — the binary: `serve`, `check-config`, `bench-chain`. The
//!   only importer of [`app`].
//! - [`app`] — the process: configuration ([`app::config`], figment
//!   layers; each layer below gets its part as values), logging
//!   ([`app::telemetry`]), assembly of the server with health and
//!   reflection ([`app::server`]), `check-config` ([`app::check`]) and
//!   the signals that start the drain ([`app::shutdown`]).
//! - [`service`] — the `samplerd.v1.Sampler` RPCs: the dispatch
//!   (`service/mod.rs`), the handlers' shared state ([`service::state`]),
//!   the configured defaults ([`service::defaults`]) and limits
//!   ([`service::limits`]), validation into typed values
//!   ([`service::validate`]), one module per RPC. Imports [`generate`]
//!   (the [`generate::generator::Generator`] seam it delegates `Generate`
//!   to), never the other way round.
//! - [`generate`] — the model host behind `Generate`: the decode loop, the
//!   batching decode engine, the prompt cache and the
//!   [`generate::generator::Generator`] seam with the validated request it
//!   takes.
//! - [`request`] — what `service` and `generate` both stand on: request
//!   errors ([`request::errors`]), protobuf conversions, the memory
//!   budget, the buffer pool and the sampling pool every step runs on
//!   ([`request::step_pool`]), named vocabularies.
//! - [`transport`] — plumbing every RPC passes before a handler: TLS and
//!   the plaintext rule ([`transport::tls`]), bearer tokens
//!   ([`transport::auth`]), deadlines ([`transport::deadline`]), request
//!   metrics and `/metrics` ([`transport::metrics`]), the drain on
//!   shutdown ([`transport::drain`]) and decoding single-frame messages
//!   without a copy ([`transport::one_frame`]). It takes its settings as
//!   values and has its own errors.
//! - The ground: [`status`] (the statuses samplerd sends and their
//!   details) and [`crash`] (the fatal-signal report the sampling threads
//!   prepare for).

pub mod app;
pub mod crash;
pub mod generate;
pub mod request;
pub mod service;
pub mod status;
pub mod transport;
