//! A plugin that crashes the process (the `crash_stage.c` fixture: a NULL
//! write, abort(3), a stack overflow, a trap) takes the real `samplerd
//! serve` down with it — but first the fatal-signal handler writes one
//! line on stderr naming the signal, the stage, the library and the
//! request, and the process then dies by that very signal. A library that
//! crashes in its initialiser, while it is loaded, is named by its path.
//! Every wait is bounded.

mod common;
mod process;

use std::os::unix::process::ExitStatusExt as _;
use std::time::{Duration, Instant};

use common::*;
use samplerd_api::v1;
use samplerd_api::v1::sampler_client::SamplerClient;

/// Bound on the request's answer and on the process's exit.
const WAIT: Duration = Duration::from_secs(30);

/// Runs a Sample through `test_crash(how)` on a fresh server and returns
/// the signal that ended it and its stderr line about it.
async fn crash(how: &str) -> (i32, String) {
    let dir = tempfile::tempdir().unwrap();
    let fixture = build_fixture_plugin("crash_stage.c", dir.path());
    let mut p = process::start(&format!(
        "[plugins]\nfiles = [{}, {}]\n",
        process::toml_path(&core_plugin()),
        process::toml_path(&fixture),
    ));
    let mut client = SamplerClient::new(p.channel().await);
    let req = v1::SampleRequest {
        logits: logits(100, 1),
        params: Some(v1::SamplingParams {
            chain: vec![
                text_stage("test_crash", &[("how", how)]),
                number_stage("greedy", &[]),
            ],
            ..Default::default()
        }),
        ..Default::default()
    };
    let answer = tokio::time::timeout(WAIT, client.sample(req))
        .await
        .expect("the connection ends in time");
    assert!(answer.is_err(), "{how}: a crashed server cannot answer");
    let status = p.wait_exit(WAIT);
    let signal = status
        .signal()
        .unwrap_or_else(|| panic!("{how}: exited with {status:?}, not by a signal"));
    // stderr ends when the process does: read to its end, within the bound.
    let deadline = Instant::now() + WAIT;
    let mut report = None;
    while let Some(line) = p.next_log(deadline) {
        if line.starts_with("samplerd: fatal signal") {
            report = Some(line);
        }
    }
    (
        signal,
        report.unwrap_or_else(|| panic!("{how}: no report line on stderr")),
    )
}

/// Crashes a server through `test_crash(how)` and asserts that it died by
/// `signal` after reporting it by `name` on stderr, as a crash in
/// `test_crash` while serving the first request (the server numbers
/// requests from 1).
async fn assert_crash_reported(how: &str, signal: i32, name: &str) {
    let (got, line) = crash(how).await;
    assert_eq!(got, signal, "{how}");
    assert_eq!(
        line,
        format!(
            "samplerd: fatal signal {name} in plugin stage `test_crash` (library libcrash_stage.so) while serving request 1"
        )
    );
}

#[tokio::test]
async fn a_null_write_is_reported_and_the_process_dies_by_sigsegv() {
    assert_crash_reported("segv", libc::SIGSEGV, "SIGSEGV").await;
}

#[tokio::test]
async fn abort_is_reported_and_the_process_dies_by_sigabrt() {
    assert_crash_reported("abort", libc::SIGABRT, "SIGABRT").await;
}

#[tokio::test]
async fn a_stack_overflow_is_reported_from_the_alternate_stack() {
    assert_crash_reported("stack", libc::SIGSEGV, "SIGSEGV").await;
}

#[tokio::test]
async fn a_trap_is_reported_and_the_process_dies_by_sigill() {
    assert_crash_reported("ill", libc::SIGILL, "SIGILL").await;
}

#[test]
fn a_crash_in_a_plugin_s_initialiser_names_the_library_being_loaded() {
    let dir = tempfile::tempdir().unwrap();
    let fixture = build_fixture_plugin_with(
        "crash_stage.c",
        dir.path(),
        "crash_on_load",
        &["CRASH_WHILE_LOADING"],
    );
    let fixture = std::fs::canonicalize(fixture).unwrap();
    let run = process::run_to_exit(
        "serve",
        &format!(
            "[plugins]\nfiles = [{}, {}]\n",
            process::toml_path(&core_plugin()),
            process::toml_path(&fixture),
        ),
        &[],
        WAIT,
    );
    assert_eq!(run.status.signal(), Some(libc::SIGSEGV), "{run:?}");
    let report: Vec<&String> = run
        .stderr
        .iter()
        .filter(|l| l.starts_with("samplerd: fatal signal"))
        .collect();
    assert_eq!(
        report,
        [&format!(
            "samplerd: fatal signal SIGSEGV while loading plugin library {}",
            fixture.display()
        )]
    );
}
