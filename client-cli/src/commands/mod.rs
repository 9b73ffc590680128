//! One module per subcommand. Each returns the process exit code on
//! success; errors (gRPC status, unreachable server, bad input) are
//! reported by `main` as one `error: …` line with exit code 1.

pub mod bench;
pub mod bench_batch;
mod bench_worker;
pub mod generate;
pub mod health;
pub mod sample;
pub mod stages;
pub mod text;

/// The user pressed Ctrl-C; `main` exits with 130 without an error line.
#[derive(Debug, thiserror::Error)]
#[error("interrupted")]
pub struct Interrupted;

/// Exit code for Ctrl-C (128 + SIGINT).
pub const EXIT_INTERRUPTED: u8 = 130;
