//! Shared harness of the samplerctl tests: where cargo put the binaries,
//! a `samplerctl` with the client's environment cleared, and a
//! `samplerd serve` started without any inherited configuration.
#![allow(dead_code)]

#[path = "../../../server/tests/common/logits.rs"]
mod logits;
// Not every test binary uses them (as with the rest of this module).
#[allow(unused_imports)]
pub use logits::{argmax, logits, to_bytes};

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Output, Stdio};
use std::time::{Duration, Instant};

/// Env vars of the client that must not leak into a test's commands.
const CLIENT_ENV: [&str; 4] = [
    "SAMPLERD_ADDR",
    "SAMPLERD_TOKEN",
    "SAMPLERD_TLS",
    "SAMPLERD_CA_CERT",
];

/// `target/<profile>/`, where cargo put samplerctl (and, when built,
/// samplerd).
pub fn profile_dir() -> PathBuf {
    let samplerctl = Path::new(env!("CARGO_BIN_EXE_samplerctl"));
    samplerctl
        .parent()
        .expect("target/<profile>/")
        .to_path_buf()
}

pub fn samplerd_bin() -> PathBuf {
    let p = profile_dir().join(format!("samplerd{}", std::env::consts::EXE_SUFFIX));
    assert!(
        p.is_file(),
        "samplerd is not built at {}: run `cargo build -p samplerd` (or `cargo test --workspace`, \
         which builds every binary) first",
        p.display()
    );
    p
}

/// A `samplerctl` command with the client env cleared and no colours.
pub fn samplerctl() -> Command {
    let mut c = Command::new(env!("CARGO_BIN_EXE_samplerctl"));
    for v in CLIENT_ENV {
        c.env_remove(v);
    }
    c.env("NO_COLOR", "1");
    c
}

/// `samplerd` run in `dir` (no stray samplerd.toml) without any SAMPLERD_*
/// variable (the server reads its config from them), its output in
/// `dir/samplerd.log`; the caller adds the arguments.
pub fn samplerd_in(dir: &Path) -> Command {
    let mut cmd = Command::new(samplerd_bin());
    for (k, _) in std::env::vars_os() {
        if k.to_string_lossy().starts_with("SAMPLERD_") {
            cmd.env_remove(&k);
        }
    }
    let log = std::fs::File::create(dir.join("samplerd.log")).unwrap();
    cmd.current_dir(dir)
        .stdin(Stdio::null())
        .stdout(log.try_clone().unwrap())
        .stderr(log);
    cmd
}

/// What a server started by [`samplerd_in`] logged so far.
pub fn samplerd_log(dir: &Path) -> String {
    std::fs::read_to_string(dir.join("samplerd.log")).unwrap_or_default()
}

/// Runs `health` (a `samplerctl … health` each time) until it exits 0,
/// `server` exits, or `limit` passes; backs off between polls.
pub fn wait_serving(
    server: &mut Child,
    dir: &Path,
    limit: Duration,
    mut health: impl FnMut() -> Output,
) -> Result<(), String> {
    let deadline = Instant::now() + limit;
    let mut pause = Duration::from_millis(10);
    loop {
        let out = health();
        if out.status.success() {
            return Ok(());
        }
        if let Some(status) = server.try_wait().unwrap() {
            return Err(format!(
                "samplerd exited early ({status}): {}",
                samplerd_log(dir)
            ));
        }
        if Instant::now() >= deadline {
            return Err(format!(
                "not SERVING after {limit:?}: {}\n{}",
                stderr(&out),
                samplerd_log(dir)
            ));
        }
        // Back off between polls (bounded by the deadline above).
        std::thread::sleep(pause);
        pause = (pause * 2).min(Duration::from_millis(200));
    }
}

pub fn stdout(o: &Output) -> String {
    String::from_utf8_lossy(&o.stdout).into_owned()
}

pub fn stderr(o: &Output) -> String {
    String::from_utf8_lossy(&o.stderr).into_owned()
}
