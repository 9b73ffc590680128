//! Start-up against a hostile environment, through the real binary: a
//! corrupt model header fails with one clear line (no backtrace, even with
//! `RUST_BACKTRACE=1`); a FIFO as the model or a plugin is refused at once
//! instead of blocking start-up forever; a dangling plugin symlink is
//! refused naming the link and its target; a world-writable plugin loaded
//! under `plugins.allow_untrusted_permissions` is named in a warning with
//! its mode; a key that is not the certificate's is refused by
//! `check-config` naming both files, and an expired certificate is served
//! with a warning naming the file and its notAfter date; a draft model over
//! another vocabulary than the model's is refused naming both files. Every
//! run is bounded.

mod common;
mod process;

use std::os::unix::fs::PermissionsExt as _;
use std::path::{Path, PathBuf};
use std::time::Duration;

use common::core_plugin;
use process::{run_to_exit, toml_path};

#[path = "../model/tests/support/tiny_formats.rs"]
mod tiny_formats;

/// Bound on a start-up that must end by itself (a refusal takes well under
/// a second; a hang is what the bound catches).
const EXIT_BOUND: Duration = Duration::from_secs(30);

/// The stderr lines that are not JSON log records: what `main` printed.
fn printed(lines: &[String]) -> Vec<&String> {
    lines.iter().filter(|l| !l.starts_with('{')).collect()
}

/// Asserts that the run failed with exit status 1 and printed exactly one
/// line, `samplerd: …` containing every one of `needles`; returns it.
fn assert_one_line_failure(run: &process::Exited, needles: &[&str]) -> String {
    assert_eq!(run.status.code(), Some(1), "{run:?}");
    let lines = printed(&run.stderr);
    assert_eq!(lines.len(), 1, "one line, no backtrace: {lines:#?}");
    let line = lines[0].clone();
    assert!(line.starts_with("samplerd: "), "{line}");
    for n in needles {
        assert!(line.contains(n), "{line:?} should name {n:?}");
    }
    line
}

/// A GGUF v3 header whose metadata count is 2^62 (and nothing after it).
fn corrupt_gguf(dir: &Path) -> PathBuf {
    let mut bytes = b"GGUF".to_vec();
    bytes.extend_from_slice(&3u32.to_le_bytes());
    bytes.extend_from_slice(&0u64.to_le_bytes()); // tensor count
    bytes.extend_from_slice(&(1u64 << 62).to_le_bytes()); // metadata entries
    let path = dir.join("corrupt.gguf");
    std::fs::write(&path, bytes).unwrap();
    path
}

fn mkfifo(path: &Path) {
    let ok = std::process::Command::new("mkfifo")
        .arg(path)
        .status()
        .expect("run mkfifo");
    assert!(ok.success(), "mkfifo {}", path.display());
}

fn model_toml(path: &Path) -> String {
    format!("[model]\npath = {}\ndevice = \"cpu\"\n", toml_path(path))
}

#[test]
fn a_corrupt_model_header_fails_with_one_line_and_no_backtrace() {
    let dir = tempfile::tempdir().unwrap();
    let model = corrupt_gguf(dir.path());
    // The backtrace came with RUST_BACKTRACE=1, a common container setting.
    let env = [("RUST_BACKTRACE", "1")];
    for command in ["serve", "check-config"] {
        let run = run_to_exit(command, &model_toml(&model), &env, EXIT_BOUND);
        let line = assert_one_line_failure(
            &run,
            &[
                "model.path",
                "corrupt.gguf",
                "metadata_kv_count 4611686018427387904",
            ],
        );
        assert!(!line.contains(".rs:"), "{command}: no source paths: {line}");
    }
}

#[test]
fn a_fifo_as_the_model_is_refused_at_once() {
    let dir = tempfile::tempdir().unwrap();
    let fifo = dir.path().join("model.gguf");
    mkfifo(&fifo);
    for command in ["serve", "check-config"] {
        let run = run_to_exit(command, &model_toml(&fifo), &[], EXIT_BOUND);
        assert_one_line_failure(
            &run,
            &[
                "model.path",
                "model.gguf",
                "is a FIFO (named pipe), not a regular file",
            ],
        );
    }
}

#[test]
fn a_fifo_as_a_plugin_is_refused_at_once() {
    let dir = tempfile::tempdir().unwrap();
    let fifo = dir.path().join("libfifo.so");
    mkfifo(&fifo);
    let toml = format!(
        "[plugins]\nfiles = [{}, {}]\n",
        toml_path(&core_plugin()),
        toml_path(&fifo)
    );
    let run = run_to_exit("serve", &toml, &[], EXIT_BOUND);
    assert_one_line_failure(&run, &["libfifo.so", "not a regular file"]);
}

#[test]
fn a_dangling_plugin_symlink_is_refused_naming_link_and_target() {
    let dir = tempfile::tempdir().unwrap();
    let plugins = dir.path().join("plugins");
    std::fs::create_dir(&plugins).unwrap();
    std::fs::copy(core_plugin(), plugins.join("libsamplerd_core_stages.so")).unwrap();
    let target = dir.path().join("removed/libgone.so");
    std::os::unix::fs::symlink(&target, plugins.join("libgone.so")).unwrap();
    let toml = format!("[plugins]\ndirs = [{}]\n", toml_path(&plugins));
    let run = run_to_exit("serve", &toml, &[], EXIT_BOUND);
    assert_one_line_failure(
        &run,
        &[
            "libgone.so: cannot load library: a symbolic link to",
            &target.display().to_string(),
        ],
    );
}

#[test]
fn a_world_writable_plugin_loaded_under_the_escape_hatch_is_named_in_a_warning() {
    let dir = tempfile::tempdir().unwrap();
    let plugin = dir.path().join("libcore_copy.so");
    std::fs::copy(core_plugin(), &plugin).unwrap();
    std::fs::set_permissions(&plugin, std::fs::Permissions::from_mode(0o666)).unwrap();
    let plugin = std::fs::canonicalize(&plugin).unwrap();
    let p = process::start(&format!(
        "[plugins]\nfiles = [{}]\nallow_untrusted_permissions = true\n",
        toml_path(&plugin)
    ));
    let name = plugin.display().to_string();
    let warning = p
        .startup_logs
        .iter()
        .find(|l| l.contains("WARN") && l.contains(&name))
        .unwrap_or_else(|| panic!("no warning names {name}: {:#?}", p.startup_logs));
    assert!(warning.contains("world-writable (mode 0666"), "{warning}");
    assert!(
        warning.contains("plugins.allow_untrusted_permissions = true"),
        "{warning}"
    );
}

/// A self-signed certificate for localhost valid from `from` to `to`
/// (year, month, day), and its key: (certificate PEM, key PEM).
fn certificate(from: (i32, u8, u8), to: (i32, u8, u8)) -> (String, String) {
    let key = rcgen::KeyPair::generate().unwrap();
    let mut params = rcgen::CertificateParams::new(vec!["localhost".into()]).unwrap();
    params.not_before = rcgen::date_time_ymd(from.0, from.1, from.2);
    params.not_after = rcgen::date_time_ymd(to.0, to.1, to.2);
    let cert = params.self_signed(&key).unwrap();
    (cert.pem(), key.serialize_pem())
}

fn tls_toml(cert: &Path, key: &Path) -> String {
    format!(
        "[tls]\ncert_file = {}\nkey_file = {}\n",
        toml_path(cert),
        toml_path(key)
    )
}

#[test]
fn check_config_refuses_a_key_that_is_not_the_certificate_s_naming_both_files() {
    let dir = tempfile::tempdir().unwrap();
    let (cert, _) = certificate((2020, 1, 1), (2100, 1, 1));
    let (_, other_key) = certificate((2020, 1, 1), (2100, 1, 1));
    let cert_file = dir.path().join("server.crt");
    let key_file = dir.path().join("other.key");
    std::fs::write(&cert_file, cert).unwrap();
    std::fs::write(&key_file, other_key).unwrap();
    let toml = tls_toml(&cert_file, &key_file);
    for command in ["check-config", "serve"] {
        let run = run_to_exit(command, &toml, &[], EXIT_BOUND);
        assert_one_line_failure(
            &run,
            &[
                &format!("tls.key_file = {}", key_file.display()),
                &format!("tls.cert_file = {}", cert_file.display()),
                "is not the private key of",
            ],
        );
    }
}

#[test]
fn an_expired_certificate_is_served_with_a_warning_naming_file_and_date() {
    let dir = tempfile::tempdir().unwrap();
    let (cert, key) = certificate((2019, 1, 1), (2020, 1, 2));
    let cert_file = dir.path().join("expired.crt");
    let key_file = dir.path().join("expired.key");
    std::fs::write(&cert_file, cert).unwrap();
    std::fs::write(&key_file, key).unwrap();
    let toml = tls_toml(&cert_file, &key_file);
    let expected = format!(
        "tls.cert_file = {}: the certificate expired on Thu, 02 Jan 2020",
        cert_file.display()
    );

    let p = process::start(&toml);
    let warnings: Vec<&String> = p
        .startup_logs
        .iter()
        .filter(|l| l.contains(&expected))
        .collect();
    assert_eq!(warnings.len(), 1, "{:#?}", p.startup_logs);
    assert!(warnings[0].contains("WARN"), "{}", warnings[0]);
    drop(p);

    let run = run_to_exit("check-config", &toml, &[], EXIT_BOUND);
    assert_eq!(run.status.code(), Some(0), "{run:?}");
    let lines = printed(&run.stderr);
    assert_eq!(lines.len(), 1, "{lines:#?}");
    assert!(
        lines[0].starts_with("samplerd: warning: ") && lines[0].contains(&expected),
        "{}",
        lines[0]
    );
}

#[test]
fn reasoning_markers_of_other_than_two_strings_are_refused_naming_the_key() {
    for command in ["serve", "check-config"] {
        let run = run_to_exit(
            command,
            "[generate]\nreasoning_markers = [\"<think>\"]\n",
            &[],
            EXIT_BOUND,
        );
        assert_one_line_failure(
            &run,
            &[
                "generate.reasoning_markers",
                "[\"<think>\"]",
                "exactly two strings [open, close]; got 1",
            ],
        );
    }
}

#[test]
fn a_draft_model_over_another_vocabulary_is_refused_naming_both_files() {
    let dir = tempfile::tempdir().unwrap();
    let (target, draft) = (
        dir.path().join("target.gguf"),
        dir.path().join("think.gguf"),
    );
    tiny_formats::write_model(&target, "llama", candle_core::quantized::GgmlDType::Q8_0);
    tiny_formats::write_thinking_model(&draft);
    let toml = format!(
        "{}draft_path = {}\n",
        model_toml(&target),
        toml_path(&draft)
    );
    for command in ["check-config", "serve"] {
        let run = run_to_exit(command, &toml, &[], EXIT_BOUND);
        assert_one_line_failure(
            &run,
            &[
                "model.draft_path",
                "does not share the vocabulary",
                "think.gguf has 263 tokens",
                "target.gguf has 261",
            ],
        );
    }
    // Without model.path a draft model has nothing to draft for.
    let toml = format!("[model]\ndraft_path = {}\n", toml_path(&draft));
    for command in ["check-config", "serve"] {
        let run = run_to_exit(command, &toml, &[], EXIT_BOUND);
        assert_one_line_failure(
            &run,
            &["model.draft_path", "think.gguf", "model.path is not"],
        );
    }
}
