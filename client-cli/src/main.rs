//! `samplerctl`: the command-line client for samplerd. This file only
//! parses the command line and dispatches; see `commands/` for behaviour.

#![forbid(unsafe_code)]

mod cli;
mod commands;
mod connect;
mod logits_file;
mod output;
mod params;

use std::process::ExitCode;

use clap::Parser;

use crate::cli::{Cli, Command};
use crate::commands::{EXIT_INTERRUPTED, Interrupted};

fn main() -> ExitCode {
    let cli = Cli::parse();
    let runtime = match tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
    {
        Ok(rt) => rt,
        Err(e) => {
            output::print_error(&anyhow::Error::new(e).context("cannot start the async runtime"));
            return ExitCode::FAILURE;
        }
    };
    let conn = cli.conn;
    let result = runtime.block_on(async move {
        match cli.command {
            Command::Generate(args) => commands::generate::run(&conn, args).await,
            Command::Sample(args) => commands::sample::run(&conn, args).await,
            Command::Stages(args) => commands::stages::run(&conn, args).await,
            Command::Health(args) => commands::health::run(&conn, args).await,
            Command::Bench(args) => commands::bench::run(&conn, args).await,
            Command::Tokenize(args) => commands::text::tokenize(&conn, args).await,
            Command::Detokenize(args) => commands::text::detokenize(&conn, args).await,
            Command::Info(args) => commands::text::info(&conn, args).await,
        }
    });
    // Don't wait for in-flight background tasks (e.g. a cancelled stream).
    runtime.shutdown_background();
    match result {
        Ok(code) => code,
        Err(e) if e.downcast_ref::<Interrupted>().is_some() => ExitCode::from(EXIT_INTERRUPTED),
        // The reader closed stdout (`samplerctl stages | head`): not an error.
        Err(e) if output::is_broken_pipe(&e) => ExitCode::SUCCESS,
        Err(e) => {
            output::print_error(&e);
            ExitCode::FAILURE
        }
    }
}
