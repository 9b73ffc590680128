//! The process around the service: configuration, logging, assembly of
//! the server (health, reflection, limits, layers), `check-config` and
//! graceful shutdown.
//!
//! Every module here forbids unsafe code itself.

pub mod check;
pub mod config;
pub mod server;
pub mod shutdown;
pub mod telemetry;
