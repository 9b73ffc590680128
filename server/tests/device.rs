//! `model.device` at start-up, through the real binary: `cuda` without a
//! usable GPU (this machine, CI) or in a build without the `cuda` feature
//! is one clear error and a clean exit, never a panic; `auto` falls back to
//! the CPU and logs why; an unknown value names the key. On a GPU machine
//! the no-GPU cases are skipped with a notice (scripts/gpu-check.sh covers
//! that side).

mod common;

use std::io::Read;
use std::process::{Child, Command, ExitStatus, Stdio};
use std::time::{Duration, Instant};

use common::*;
use samplerd_model::{DeviceRequest, Placement};

/// Bound on every wait for the binary.
const TIMEOUT: Duration = Duration::from_secs(60);

fn gpu_present() -> bool {
    matches!(
        samplerd_model::cuda::resolve(DeviceRequest::Cuda),
        Ok(r) if matches!(r.placement, Placement::Cuda { .. })
    )
}

fn plugin_dir() -> tempfile::TempDir {
    let dir = tempfile::tempdir().unwrap();
    std::fs::copy(core_plugin(), dir.path().join("libsamplerd_core_stages.so")).unwrap();
    dir
}

fn serve(device: &str, model: &std::path::Path, plugins: &std::path::Path) -> Child {
    Command::new(env!("CARGO_BIN_EXE_samplerd"))
        .env_clear()
        .env("PATH", std::env::var_os("PATH").unwrap_or_default())
        .env("SAMPLERD_MODEL__DEVICE", device)
        .env("SAMPLERD_LOGGING__FORMAT", "json")
        .env("RUST_LOG", "info")
        .args(["serve", "--listen", "127.0.0.1:0", "--plugin-dir"])
        .arg(plugins)
        .arg("--model")
        .arg(model)
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .expect("samplerd starts")
}

/// Waits (bounded) for the process to exit; returns its status and stderr.
fn wait_exit(mut child: Child) -> (ExitStatus, String) {
    let end = Instant::now() + TIMEOUT;
    loop {
        if let Some(status) = child.try_wait().unwrap() {
            let mut err = String::new();
            child
                .stderr
                .take()
                .unwrap()
                .read_to_string(&mut err)
                .unwrap();
            return (status, err);
        }
        if Instant::now() > end {
            let _ = child.kill();
            let _ = child.wait();
            panic!("samplerd did not exit within {TIMEOUT:?}");
        }
        std::thread::sleep(Duration::from_millis(20));
    }
}

#[test]
fn cuda_without_a_gpu_is_one_clear_startup_error() {
    if gpu_present() {
        eprintln!(
            "NOTICE: a CUDA device is present; the no-GPU start-up error is not testable here"
        );
        return;
    }
    let plugins = plugin_dir();
    // The device is resolved before the model is read, so any path will do.
    let model = plugins.path().join("model.gguf");
    let (status, err) = wait_exit(serve("cuda", &model, plugins.path()));
    assert!(!status.success(), "samplerd must refuse to start: {err}");
    assert_eq!(
        status.code(),
        Some(1),
        "a clean error exit, not a signal: {err}"
    );
    assert!(!err.contains("panicked"), "{err}");
    let want = if samplerd_model::cuda::built_with_cuda() {
        "samplerd: model.device = \"cuda\": no CUDA driver found"
    } else {
        "samplerd: model.device = \"cuda\": this samplerd was built without CUDA support"
    };
    assert!(err.contains(want), "stderr should contain {want:?}: {err}");
}

#[test]
fn auto_falls_back_to_the_cpu_and_logs_why() {
    if gpu_present() {
        eprintln!("NOTICE: a CUDA device is present; auto picks it (checked by gpu-check.sh)");
        return;
    }
    let placement = samplerd::generate::generator::resolve_device(DeviceRequest::Auto).unwrap();
    assert_eq!(placement, Placement::Cpu);
    // Through the binary: the choice is logged before the model loads (a
    // missing model file then ends the process with its own error).
    let plugins = plugin_dir();
    let model = plugins.path().join("absent.gguf");
    let (status, err) = wait_exit(serve("auto", &model, plugins.path()));
    let line = err
        .lines()
        .find(|l| l.contains("model device chosen"))
        .unwrap_or_else(|| panic!("no device log line in: {err}"));
    let v: serde_json::Value = serde_json::from_str(line).unwrap();
    let fields = &v["fields"];
    assert_eq!(fields["device"], "cpu", "{line}");
    let reason = fields["reason"].as_str().unwrap();
    assert!(
        reason.starts_with("model.device = \"auto\": using the CPU because "),
        "{reason}"
    );
    assert!(!status.success() && err.contains("absent.gguf"), "{err}");
}

#[test]
fn unknown_device_value_names_the_key() {
    let plugins = plugin_dir();
    let model = plugins.path().join("model.gguf");
    let (status, err) = wait_exit(serve("gpu", &model, plugins.path()));
    assert_eq!(status.code(), Some(1), "{err}");
    assert!(err.contains("gpu") && err.contains("device"), "{err}");
    assert!(!err.contains("panicked"), "{err}");
}
