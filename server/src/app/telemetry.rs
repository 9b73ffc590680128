//! Logging setup with `tracing-subscriber`: a `RUST_LOG`-style filter
//! (`RUST_LOG` wins over `logging.filter`) and text (coloured only on a
//! terminal) or JSON (`logging.format = "json"`) output on stderr. Requests get one span each (see `service`); nothing is logged
//! per token at info level.

#![forbid(unsafe_code)]

use std::io::IsTerminal as _;

use tracing_subscriber::EnvFilter;

use crate::app::config::{LogFormat, LoggingConfig};

/// Installs the global subscriber. Safe to call more than once (later
/// calls are no-ops), so tests can call it freely.
pub fn init(cfg: &LoggingConfig) {
    let filter = std::env::var("RUST_LOG")
        .ok()
        .and_then(|f| EnvFilter::try_new(f).ok())
        .unwrap_or_else(|| {
            EnvFilter::try_new(&cfg.filter).unwrap_or_else(|_| EnvFilter::new("info"))
        });
    // Colours only for a person at a terminal: a log collector or a file
    // would get the escape codes as text.
    let ansi = std::io::stderr().is_terminal();
    let builder = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr)
        .with_ansi(ansi)
        .with_target(true);
    let _ = match cfg.format {
        LogFormat::Text => builder.try_init(),
        LogFormat::Json => builder.json().with_current_span(true).try_init(),
    };
}
