//! Generate served from the CUDA backend (`model.device = "cuda"`) against
//! the same server on the CPU: every weight format's tiny model
//! (server/model/tests/support/tiny_formats.rs), greedy and seeded, several
//! prompts, must stream the same messages byte for byte; so must 8
//! concurrent streams (run as batched device passes); a cancelled stream gives its device memory back; a
//! generation whose KV cache does not fit the device's free memory is
//! RESOURCE_EXHAUSTED, and the server keeps serving. Runs on whatever
//! `libcuda` cudarc loads: the emulated driver in CI
//! (scripts/ci/cuda-emulated.sh), a GPU in scripts/gpu-check.sh. Without a
//! device it skips with a notice, unless `SAMPLERD_EXPECT_CUDA=1`.
#![cfg(feature = "cuda")]

mod common;

use std::sync::Arc;
use std::time::{Duration, Instant};

use candle_core::quantized::GgmlDType;
use common::*;
use samplerd::generate::generator::Generator;
use samplerd::generate::{GenerateConfig, ModelHost};
use samplerd_api::v1;
use samplerd_api::v1::generate_response::Event;
use samplerd_model::{DeviceRequest, Numerics, Placement};
use tokio::sync::{Mutex, MutexGuard};

#[path = "../model/tests/support/tiny_formats.rs"]
mod tiny_formats;
use tiny_formats::{CTX, FORMATS, write_model};

/// The tests take turns: the device's allocation count is process-wide.
static EXCLUSIVE: Mutex<()> = Mutex::const_new(());

/// The device, held until the guard drops (async tests).
async fn device() -> Option<(Placement, MutexGuard<'static, ()>)> {
    let turn = EXCLUSIVE.lock().await;
    placement().map(|p| (p, turn))
}

/// The device, or None (skip) — a panic when a script expects one.
fn placement() -> Option<Placement> {
    let expect = std::env::var("SAMPLERD_EXPECT_CUDA").as_deref() == Ok("1");
    match samplerd_model::cuda::resolve(DeviceRequest::Cuda) {
        Ok(r) => Some(r.placement),
        Err(e) => {
            assert!(!expect, "SAMPLERD_EXPECT_CUDA=1 but: {e}");
            eprintln!("NOTICE: no CUDA device ({e}); skipping");
            None
        }
    }
}

fn gen_config() -> GenerateConfig {
    GenerateConfig {
        n_threads: 1,
        n_ctx: CTX,
        // Sessions kept for later prompts would hold device memory.
        prompt_cache_entries: 0,
        max_concurrent_generations: 8,
        ..GenerateConfig::default()
    }
}

async fn server(path: &std::path::Path, placement: &Placement) -> (TestServer, Arc<ModelHost>) {
    let host = Arc::new(
        ModelHost::load_on(path, gen_config(), placement, Numerics::default())
            .expect("model loads"),
    );
    let s = start_serving(test_config(), Some(Arc::clone(&host) as Arc<dyn Generator>)).await;
    (s, host)
}

fn request(prompt: &str, max_tokens: u32, seed: Option<u64>) -> v1::GenerateRequest {
    v1::GenerateRequest {
        prompt: prompt.into(),
        max_tokens: Some(max_tokens),
        ignore_eos: true,
        params: Some(match seed {
            None => v1::SamplingParams {
                temperature: Some(0.0),
                ..Default::default()
            },
            Some(seed) => v1::SamplingParams {
                seed: Some(seed),
                temperature: Some(1.5),
                ..Default::default()
            },
        }),
        ..Default::default()
    }
}

/// The whole stream, with the run's timings left out.
async fn run(s: &TestServer, req: v1::GenerateRequest) -> Output {
    let mut out = generate(s, req).await.expect("Generate succeeds");
    if let Some(f) = &mut out.finished {
        without_run_details(f);
    }
    out
}

const PROMPTS: [&str; 3] = ["the cat", "Hello, world! ", "0123 héllo"];

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_format_streams_what_the_cpu_streams() {
    let Some((placement, _turn)) = device().await else {
        return;
    };
    let dir = tempfile::tempdir().unwrap();
    for dtype in FORMATS {
        let p = dir.path().join(format!("tiny-{dtype:?}.gguf"));
        write_model(&p, "llama", dtype);
        let (cpu, _) = server(&p, &Placement::Cpu).await;
        let (gpu, host) = server(&p, &placement).await;
        assert!(host.model().backend_name().starts_with("cuda:"));
        // Greedy and seeded across the prompts (the emulated device is
        // slow: each format's model gets three requests).
        for (i, prompt) in PROMPTS.iter().enumerate() {
            let seed = (i % 2 == 1).then_some(11 + i as u64);
            let want = run(&cpu, request(prompt, 6, seed)).await;
            let got = run(&gpu, request(prompt, 6, seed)).await;
            assert_eq!(got.tokens.len(), 6);
            assert_eq!(got, want, "{dtype:?} {prompt:?} seed {seed:?}");
        }
        cpu.stop().await;
        gpu.stop().await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn eight_concurrent_streams_match_the_cpu() {
    let Some((placement, _turn)) = device().await else {
        return;
    };
    let dir = tempfile::tempdir().unwrap();
    let p = dir.path().join("tiny.gguf");
    write_model(&p, "llama", GgmlDType::Q4K);
    let (cpu, _) = server(&p, &Placement::Cpu).await;
    let (gpu, host) = server(&p, &placement).await;
    let reqs: Vec<_> = (0..8u64)
        .map(|i| request(PROMPTS[i as usize % 3], 8, (i > 0).then_some(100 + i)))
        .collect();
    let mut want = Vec::new();
    for r in &reqs {
        want.push(run(&cpu, r.clone()).await);
    }
    let batched_before = emu_launches(c"attention_batch");
    let got = futures::future::join_all(reqs.iter().map(|r| run(&gpu, r.clone()))).await;
    for (i, (g, w)) in got.iter().zip(&want).enumerate() {
        assert_eq!(g, w, "stream {i}");
    }
    assert!(
        host.largest_decode_batch() > 1,
        "the streams were never batched"
    );
    // The engine's batches ran as batched device passes (the emulated
    // driver counts launches; a real one cannot say).
    if let (Some(before), Some(after)) = (batched_before, emu_launches(c"attention_batch")) {
        assert!(after > before, "no batched decode pass ran on the device");
    }
    cpu.stop().await;
    gpu.stop().await;
}

/// The emulated driver's test symbols (None on a real driver). cudarc
/// loaded the library under this name; dlopen returns that same handle.
fn emu_symbol<T: Copy>(name: &std::ffi::CStr) -> Option<T> {
    // SAFETY: dlopen / dlsym of the already loaded driver library; the
    // caller names a symbol the emulator defines with type T (a fn pointer).
    unsafe {
        let h = libc::dlopen(c"libcuda.so".as_ptr(), libc::RTLD_NOW);
        if h.is_null() {
            return None;
        }
        let f = libc::dlsym(h, name.as_ptr());
        (!f.is_null()).then(|| std::mem::transmute_copy::<*mut libc::c_void, T>(&f))
    }
}

/// How often kernel `name` has run (the emulated driver; None on a real one).
fn emu_launches(name: &std::ffi::CStr) -> Option<u64> {
    let f: unsafe extern "C" fn(*const std::ffi::c_char) -> u64 =
        emu_symbol(c"samplerd_emu_launches")?;
    // SAFETY: the emulator's `uint64_t samplerd_emu_launches(const char*)`,
    // given a NUL-terminated name.
    Some(unsafe { f(name.as_ptr()) })
}

fn live_allocations() -> Option<u64> {
    let f: unsafe extern "C" fn() -> u64 = emu_symbol(c"samplerd_emu_live_allocations")?;
    // SAFETY: the emulator's `uint64_t samplerd_emu_live_allocations(void)`.
    Some(unsafe { f() })
}

/// Waits (bounded) until `f` holds.
async fn eventually(what: &str, mut f: impl FnMut() -> bool) {
    let end = Instant::now() + Duration::from_secs(30);
    while !f() {
        assert!(Instant::now() < end, "timed out waiting until {what}");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_cancelled_stream_gives_its_device_memory_back() {
    let Some((placement, _turn)) = device().await else {
        return;
    };
    let dir = tempfile::tempdir().unwrap();
    let p = dir.path().join("tiny.gguf");
    write_model(&p, "llama", GgmlDType::Q8_0);
    let (gpu, _host) = server(&p, &placement).await;
    let Some(idle) = live_allocations() else {
        eprintln!("NOTICE: a real driver: no allocation count to check");
        return;
    };
    let mut client = gpu.client.clone();
    let mut stream = client
        .generate(request("the cat", 50, Some(3)))
        .await
        .unwrap()
        .into_inner();
    let first = stream.message().await.unwrap().unwrap();
    assert!(matches!(first.event, Some(Event::Token(_))));
    assert!(
        live_allocations().unwrap() > idle,
        "the sequence is on the device"
    );
    drop(stream);
    eventually("the cancelled sequence is freed", || {
        live_allocations().unwrap() == idle
    })
    .await;
    gpu.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_kv_cache_the_device_cannot_hold_is_resource_exhausted() {
    let Some((placement, _turn)) = device().await else {
        return;
    };
    let dir = tempfile::tempdir().unwrap();
    let p = dir.path().join("tiny.gguf");
    write_model(&p, "llama", GgmlDType::Q8_0);
    let (gpu, _host) = server(&p, &placement).await;
    let (Some(set), Some(live)) = (
        emu_symbol::<unsafe extern "C" fn(u64) -> u64>(c"samplerd_emu_set_memory"),
        emu_symbol::<unsafe extern "C" fn() -> u64>(c"samplerd_emu_live_bytes"),
    ) else {
        eprintln!("NOTICE: a real driver: its memory size is what it is");
        return;
    };
    // SAFETY: the emulator's setters / getters (u64 in, u64 out); only this
    // test, holding the device alone, changes the size.
    let full = unsafe { set(live() + 4096) };
    let err = generate(&gpu, request("the cat", 4, None))
        .await
        .expect_err("a sequence fit in 4 KiB of device memory");
    // SAFETY: as above.
    unsafe { set(full) };
    assert_status(&err, tonic::Code::ResourceExhausted, &["device memory"]);
    assert_reason(&err, Reason::BudgetExceeded);
    gpu.assert_serving().await;
    // With the memory back, the same request runs.
    assert_eq!(run(&gpu, request("the cat", 4, None)).await.tokens.len(), 4);
    gpu.stop().await;
}

/// `samplerd check-config` names the device `model.device` resolves to.
#[test]
fn check_config_reports_the_device() {
    let _turn = EXCLUSIVE.blocking_lock();
    let Some(placement) = placement() else {
        return;
    };
    let dir = tempfile::tempdir().unwrap();
    let p = dir.path().join("tiny.gguf");
    write_model(&p, "llama", GgmlDType::Q8_0);
    let plugins = tempfile::tempdir().unwrap();
    std::fs::copy(
        core_plugin(),
        plugins.path().join("libsamplerd_core_stages.so"),
    )
    .unwrap();
    // The binary cargo built, or SAMPLERD_BIN where the tests run from a
    // bundle (scripts/gpu-check.sh prepare).
    let bin = std::env::var_os("SAMPLERD_BIN")
        .map(std::path::PathBuf::from)
        .unwrap_or_else(|| env!("CARGO_BIN_EXE_samplerd").into());
    if !bin.is_file() {
        eprintln!("NOTICE: no samplerd binary at {}; skipping", bin.display());
        return;
    }
    let out = std::process::Command::new(&bin)
        .env("SAMPLERD_MODEL__DEVICE", "cuda")
        .args(["check-config", "--plugin-dir"])
        .arg(plugins.path())
        .arg("--model")
        .arg(&p)
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{text}{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(text.contains("# model device (model.device)"), "{text}");
    assert!(text.contains(&placement.to_string()), "{text}");
}

/// The process's Prometheus recorder, installed once (the tests here run
/// one at a time, so a test's counter deltas are its own).
fn recorder() -> &'static metrics_exporter_prometheus::PrometheusHandle {
    static HANDLE: std::sync::OnceLock<metrics_exporter_prometheus::PrometheusHandle> =
        std::sync::OnceLock::new();
    HANDLE.get_or_init(|| samplerd::transport::metrics::install().expect("recorder"))
}

/// `samplerd_device_sampling_steps_total` by path: [device, dense, fallback].
fn device_steps() -> [u64; 3] {
    let text = recorder().render();
    let mut out = [0u64; 3];
    for (i, path) in ["device", "dense", "fallback"].iter().enumerate() {
        let series = format!("samplerd_device_sampling_steps_total{{path=\"{path}\"}} ");
        if let Some(line) = text.lines().find(|l| l.starts_with(&series)) {
            out[i] = line[series.len()..].trim().parse().expect("a count");
        }
    }
    out
}

/// Every message of a Generate stream, the run's timings left out: equal
/// means byte for byte (token, text, probability, logprob, probs, usage).
async fn messages(s: &TestServer, req: v1::GenerateRequest) -> Vec<v1::GenerateResponse> {
    let mut client = s.client.clone();
    tokio::time::timeout(Duration::from_secs(300), async move {
        let mut stream = client.generate(req).await.expect("Generate").into_inner();
        let mut all = Vec::new();
        while let Some(mut msg) = stream.message().await.expect("a message") {
            if let Some(Event::Finished(f)) = &mut msg.event {
                without_run_details(f);
            }
            all.push(msg);
        }
        all
    })
    .await
    .expect("Generate finished in time")
}

/// A seeded request with these sampling parameters (the seed set here).
fn with_params(
    prompt: &str,
    max_tokens: u32,
    seed: u64,
    params: v1::SamplingParams,
) -> v1::GenerateRequest {
    v1::GenerateRequest {
        prompt: prompt.into(),
        max_tokens: Some(max_tokens),
        ignore_eos: true,
        params: Some(v1::SamplingParams {
            seed: Some(seed),
            ..params
        }),
        ..Default::default()
    }
}

fn order(names: &[&str]) -> Vec<String> {
    names.iter().map(|s| s.to_string()).collect()
}

/// Chains that split between the device and the host at different
/// points, and whether their steps take the device path.
fn split_cases() -> Vec<(&'static str, v1::GenerateRequest, bool)> {
    let p = |t: f32| v1::SamplingParams {
        temperature: Some(t),
        ..Default::default()
    };
    vec![
        // penalties + top_k on the device; top_p, temperature, dist here.
        (
            "default chain",
            with_params("the cat", 6, 5, v1::SamplingParams::default()),
            true,
        ),
        // Every survivor reaches the draw: `probability` and the token
        // depend on each of them.
        (
            "top_k, then temperature and the draw",
            with_params(
                "0123 héllo",
                6,
                21,
                v1::SamplingParams {
                    top_k: Some(8),
                    temperature: Some(3.0),
                    samplers: order(&["top_k", "temperature"]),
                    ..Default::default()
                },
            ),
            true,
        ),
        // temperature 0: the first maximum kept on the device.
        ("greedy", with_params("Hello, world! ", 6, 1, p(0.0)), true),
        (
            "penalties + top_k + top_p + temperature",
            with_params(
                "0123 héllo",
                6,
                7,
                v1::SamplingParams {
                    top_k: Some(12),
                    top_p: Some(0.8),
                    temperature: Some(1.7),
                    frequency_penalty: Some(0.4),
                    presence_penalty: Some(0.3),
                    repeat_last_n: Some(4),
                    logit_bias: [(3, 2.5), (9, -1.0)].into_iter().collect(),
                    samplers: order(&["penalties", "temperature", "top_k", "top_p"]),
                    ..Default::default()
                },
            ),
            true,
        ),
        (
            "min_p and DRY after top_k",
            with_params(
                "the cat",
                6,
                9,
                v1::SamplingParams {
                    top_k: Some(30),
                    min_p: Some(0.05),
                    dry_multiplier: Some(0.8),
                    dry_allowed_length: Some(1),
                    temperature: Some(2.0),
                    samplers: order(&["top_k", "dry", "min_p", "temperature"]),
                    ..Default::default()
                },
            ),
            true,
        ),
        (
            "post-chain probs",
            v1::GenerateRequest {
                n_probs: 3,
                post_sampling_probs: true,
                ..with_params("Hello, world! ", 6, 13, v1::SamplingParams::default())
            },
            true,
        ),
        // top_p first: nothing truncates before a host stage.
        (
            "top_p before top_k (dense)",
            with_params(
                "the cat",
                6,
                3,
                v1::SamplingParams {
                    samplers: order(&["top_p", "top_k", "temperature"]),
                    top_p: Some(0.9),
                    ..Default::default()
                },
            ),
            false,
        ),
        // The whole row is returned each step, and raw probs rank it.
        (
            "return_logits (dense)",
            v1::GenerateRequest {
                return_logits: Some(v1::ReturnLogits {
                    top_n: 4,
                    ..Default::default()
                }),
                ..with_params("the cat", 6, 4, v1::SamplingParams::default())
            },
            false,
        ),
        (
            "raw n_probs (dense)",
            v1::GenerateRequest {
                n_probs: 2,
                ..with_params("0123 héllo", 6, 8, v1::SamplingParams::default())
            },
            false,
        ),
    ]
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn device_sampling_streams_what_the_cpu_streams() {
    let Some((placement, _turn)) = device().await else {
        return;
    };
    recorder();
    let dir = tempfile::tempdir().unwrap();
    let p = dir.path().join("tiny.gguf");
    write_model(&p, "llama", GgmlDType::Q8_0);
    let (cpu, _) = server(&p, &Placement::Cpu).await;
    let (gpu, _host) = server(&p, &placement).await;
    // Every case is checked; the failures are reported together.
    let mut failed = Vec::new();
    for (name, req, on_device) in split_cases() {
        let want = messages(&cpu, req.clone()).await;
        let before = device_steps();
        let got = messages(&gpu, req).await;
        let after = device_steps();
        if got != want {
            failed.push(format!(
                "{name}: the device path changed the stream:\n  got  {got:?}\n  want {want:?}"
            ));
        }
        let tokens = want
            .iter()
            .filter(|m| matches!(m.event, Some(Event::Token(_))))
            .count() as u64;
        assert_eq!(tokens, 6, "{name}");
        let delta = [0, 1, 2].map(|i| after[i] - before[i]);
        let want_delta = if on_device {
            // The step after the prompt samples the prefill's dense row.
            [tokens - 1, 1, 0]
        } else {
            [0, tokens, 0]
        };
        if delta != want_delta {
            failed.push(format!(
                "{name}: steps by path [device, dense, fallback] {delta:?}, want {want_delta:?}"
            ));
        }
    }
    assert!(failed.is_empty(), "{}", failed.join("\n"));
    cpu.stop().await;
    gpu.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn concurrent_device_sampled_streams_match_the_cpu() {
    let Some((placement, _turn)) = device().await else {
        return;
    };
    recorder();
    let dir = tempfile::tempdir().unwrap();
    let p = dir.path().join("tiny.gguf");
    write_model(&p, "llama", GgmlDType::Q4K);
    let (cpu, _) = server(&p, &Placement::Cpu).await;
    let (gpu, host) = server(&p, &placement).await;
    // Device-sampled and dense requests in the same batches.
    let reqs: Vec<_> = split_cases().into_iter().map(|(_, r, _)| r).collect();
    let mut want = Vec::new();
    for r in &reqs {
        want.push(messages(&cpu, r.clone()).await);
    }
    let before = device_steps();
    let got = futures::future::join_all(reqs.iter().map(|r| messages(&gpu, r.clone()))).await;
    let after = device_steps();
    for (i, (g, w)) in got.iter().zip(&want).enumerate() {
        assert_eq!(g, w, "stream {i}");
    }
    assert!(
        host.largest_decode_batch() > 1,
        "the streams were never batched"
    );
    let on_device = split_cases().iter().filter(|c| c.2).count() as u64;
    assert_eq!(after[0] - before[0], on_device * 5, "device steps");
    assert_eq!(after[2], before[2], "no fallback");
    cpu.stop().await;
    gpu.stop().await;
}
