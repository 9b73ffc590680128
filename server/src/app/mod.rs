//! The process around the service: configuration, logging, assembly of
//! the server (health, reflection, limits, layers), `check-config`,
//! graceful shutdown and the fatal-signal report.
//!
//! Every module here but `crash` (which installs signal handlers) forbids
//! unsafe code itself.

pub mod check;
pub mod config;
pub mod crash;
pub mod server;
pub mod shutdown;
pub mod telemetry;
