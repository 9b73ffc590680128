//! The CUDA backend end to end on whatever `libcuda` cudarc loads: the
//! emulated driver (`src/cuda/emu`, scripts/ci/cuda-emulated.sh puts it on
//! the library path) in CI, the real one on a GPU (scripts/gpu-check.sh).
//! Tiny models (`support/tiny_formats.rs`) in every weight
//! format the device keeps natively: the logits of a prefill and of each
//! decode step (the captured CUDA graph replayed), and of steps of several
//! sequences at once, must equal the CPU backend's bit for bit; dropping the
//! sequences and the model gives the device memory back. Without a device
//! the tests skip with a notice, unless `SAMPLERD_EXPECT_CUDA=1` (set by both
//! scripts), which makes a missing device a failure.
#![cfg(feature = "cuda")]

use std::path::{Path, PathBuf};
use std::sync::{Mutex, MutexGuard};

use candle_core::quantized::GgmlDType;
use samplerd_model::cuda::{CudaBackend, CudaOptions};
use samplerd_model::{Backend, DeviceRequest, Model, ModelOptions, Placement};

#[path = "support/tiny_formats.rs"]
mod tiny_formats;
use tiny_formats::{CTX, FORMATS, N_VOCAB, write_model};

/// The tests take turns on the device: the allocation count is
/// process-wide, and the emulated driver runs one launch at a time anyway.
static EXCLUSIVE: Mutex<()> = Mutex::new(());

/// The device (held exclusively), or None (skip) — a panic when a script
/// expects one.
fn device() -> Option<(Placement, MutexGuard<'static, ()>)> {
    let expect = std::env::var("SAMPLERD_EXPECT_CUDA").as_deref() == Ok("1");
    let turn = EXCLUSIVE.lock().unwrap_or_else(|e| e.into_inner());
    match samplerd_model::cuda::resolve(DeviceRequest::Cuda) {
        Ok(r) => Some((r.placement, turn)),
        Err(e) => {
            assert!(!expect, "SAMPLERD_EXPECT_CUDA=1 but: {e}");
            eprintln!("NOTICE: no CUDA device ({e}); skipping");
            None
        }
    }
}

fn opts() -> ModelOptions {
    ModelOptions {
        n_threads: 1,
        n_ctx: CTX,
        ..Default::default()
    }
}

fn model_file(dir: &Path, arch: &str, dtype: GgmlDType) -> PathBuf {
    let p = dir.join(format!("tiny-{arch}-{dtype:?}.gguf"));
    write_model(&p, arch, dtype);
    p
}

fn bits(v: &[f32]) -> Vec<u32> {
    v.iter().map(|x| x.to_bits()).collect()
}

fn argmax(v: &[f32]) -> u32 {
    let mut best = 0;
    for (i, &x) in v.iter().enumerate() {
        if x > v[best] {
            best = i;
        }
    }
    best as u32
}

/// A prefill (6 tokens: the multi-token orders) then greedy decode steps
/// (one token: the captured graph from the second on): every step's logits
/// bit-identical on both backends.
fn assert_same_run(cpu: &Model, gpu: &Model, what: &str) {
    let prompt = [1u32, 40, 77, 123, 250, 260];
    let mut c = cpu.new_session().unwrap();
    let mut g = gpu.new_session().unwrap();
    let mut want = c.prefill(&prompt).unwrap().to_vec();
    let got = g.prefill(&prompt).unwrap().to_vec();
    assert_eq!(bits(&got), bits(&want), "{what}: prefill logits differ");
    for step in 0..4 {
        let t = argmax(&want);
        want = c.decode(t).unwrap().to_vec();
        let got = g.decode(t).unwrap().to_vec();
        assert_eq!(
            bits(&got),
            bits(&want),
            "{what}: decode step {step} logits differ"
        );
    }
}

#[test]
fn every_weight_format_matches_the_cpu_bit_for_bit() {
    let Some((placement, _turn)) = device() else {
        return;
    };
    let dir = tempfile::tempdir().unwrap();
    for dtype in FORMATS {
        let p = model_file(dir.path(), "llama", dtype);
        let cpu = Model::load(&p, &opts()).unwrap();
        let gpu = Model::load_on(&p, &opts(), &placement).unwrap();
        assert!(
            gpu.backend_name().starts_with("cuda:"),
            "{}",
            gpu.backend_name()
        );
        assert_same_run(&cpu, &gpu, &format!("llama {dtype:?}"));
    }
}

#[test]
fn qwen2_biases_and_neox_rope_match_the_cpu() {
    let Some((placement, _turn)) = device() else {
        return;
    };
    let dir = tempfile::tempdir().unwrap();
    let p = model_file(dir.path(), "qwen2", GgmlDType::Q8_0);
    let cpu = Model::load(&p, &opts()).unwrap();
    let gpu = Model::load_on(&p, &opts(), &placement).unwrap();
    assert_same_run(&cpu, &gpu, "qwen2 Q8_0");
}

/// Several sequences stepped together (`decode_batch`: each on its own
/// stream, enqueued before any logits are read) equal each stepped alone
/// on the CPU.
#[test]
fn batched_sequences_match_the_cpu() {
    let Some((placement, _turn)) = device() else {
        return;
    };
    let dir = tempfile::tempdir().unwrap();
    let p = model_file(dir.path(), "llama", GgmlDType::Q4K);
    let cpu = Model::load(&p, &opts()).unwrap();
    let gpu = Model::load_on(&p, &opts(), &placement).unwrap();
    let n = 3;
    let mut cs: Vec<_> = (0..n).map(|_| cpu.new_session().unwrap()).collect();
    let mut gs: Vec<_> = (0..n).map(|_| gpu.new_session().unwrap()).collect();
    let mut next = Vec::new();
    for (i, (c, g)) in cs.iter_mut().zip(gs.iter_mut()).enumerate() {
        let prompt = [1u32, 10 + i as u32, 20, 30 + 7 * i as u32];
        let want = c.prefill(&prompt).unwrap().to_vec();
        assert_eq!(bits(g.prefill(&prompt).unwrap()), bits(&want));
        next.push(argmax(&want));
    }
    for _ in 0..3 {
        let want: Vec<Vec<f32>> = cs
            .iter_mut()
            .zip(&next)
            .map(|(c, &t)| c.decode(t).unwrap().to_vec())
            .collect();
        let mut refs: Vec<&mut samplerd_model::Session> = gs.iter_mut().collect();
        gpu.decode_batch(&mut refs, &next).unwrap();
        for (w, g) in want.iter().zip(&gs) {
            assert_eq!(bits(g.logits()), bits(w), "batched step differs");
        }
        next = want.iter().map(|w| argmax(w)).collect();
    }
}

/// The emulated driver's count of live allocations (None on a real driver).
fn live_allocations() -> Option<u64> {
    // SAFETY: the emulator's `uint64_t samplerd_emu_live_allocations(void)`.
    emu().map(|e| unsafe { (e.live)() })
}

/// Sequences and the model give their device memory back when dropped.
#[test]
fn dropping_sequences_and_the_model_frees_device_memory() {
    let Some((placement, _turn)) = device() else {
        return;
    };
    let dir = tempfile::tempdir().unwrap();
    let p = model_file(dir.path(), "llama", GgmlDType::Q8_0);
    let Some(before) = live_allocations() else {
        eprintln!("NOTICE: a real driver: no allocation count to check");
        return;
    };
    let gpu = Model::load_on(&p, &opts(), &placement).unwrap();
    let with_model = live_allocations().unwrap();
    assert!(with_model > before, "the weights are on the device");
    {
        let mut s = gpu.new_session().unwrap();
        s.prefill(&[1, 2, 3]).unwrap();
        s.decode(4).unwrap();
        s.decode(5).unwrap();
        assert!(live_allocations().unwrap() > with_model);
    }
    assert_eq!(live_allocations().unwrap(), with_model, "a sequence leaked");
    drop(gpu);
    assert_eq!(live_allocations().unwrap(), before, "the model leaked");
}

/// The decode step's CUDA graph is captured and replayed (its logits are
/// checked above; here, that the graph path is the one taken).
#[test]
fn decode_steps_replay_a_captured_graph() {
    let Some((_placement, _turn)) = device() else {
        return;
    };
    let dir = tempfile::tempdir().unwrap();
    let p = model_file(dir.path(), "llama", GgmlDType::Q5_1);
    let mut g = samplerd_model::gguf::GgufFile::open(&p).unwrap();
    let config = g.config().unwrap();
    let weights = samplerd_model::gguf::Weights::load(&mut g, &config).unwrap();
    let opts = CudaOptions {
        graphs: true,
        ..CudaOptions::default()
    };
    let be = CudaBackend::new(config, &weights, opts).unwrap();
    let mut st = be.new_sequence(CTX).unwrap();
    let mut logits = vec![0f32; N_VOCAB];
    be.forward(&mut st, &[1, 2, 3], &mut logits).unwrap();
    assert!(!st.graph_active(), "a prefill is not captured");
    for t in [4, 5, 6] {
        be.forward(&mut st, &[t], &mut logits).unwrap();
        assert!(st.graph_active(), "decode step of token {t} runs eagerly");
    }
}

/// The emulated driver's symbols for tests, or None on a real driver.
struct Emu {
    live: unsafe extern "C" fn() -> u64,
    last_error: unsafe extern "C" fn() -> *const std::ffi::c_char,
}

fn emu() -> Option<Emu> {
    // SAFETY: looks up optional symbols of the driver library cudarc has
    // already loaded; the emulator defines them with these signatures.
    unsafe {
        let lib = cudarc::driver::sys::culib();
        Some(Emu {
            live: *lib.get(b"samplerd_emu_live_allocations").ok()?,
            last_error: *lib.get(b"samplerd_emu_last_error").ok()?,
        })
    }
}

impl Emu {
    fn last_error(&self) -> String {
        // SAFETY: the emulator returns a NUL-terminated string valid until
        // its next refusal (this test holds the device alone).
        unsafe { std::ffi::CStr::from_ptr((self.last_error)()) }
            .to_string_lossy()
            .into_owned()
    }
}

/// The emulated driver refuses what a device would, with CUDA's error and a
/// message naming the call and the values: copies outside an allocation,
/// parameter buffers that do not fit the kernel's signature, pointer
/// parameters outside every allocation, blocks over 1,024 threads, too much
/// shared memory, and kernels writing past the end of their buffer.
#[test]
fn the_emulated_driver_refuses_what_a_device_would() {
    use cudarc::driver::{CudaContext, CudaFunction, LaunchConfig, result};
    use samplerd_model::cuda::kernels::{self, Arg, Kernels, cfg};
    let Some((_placement, _turn)) = device() else {
        return;
    };
    let Some(emu) = emu() else {
        eprintln!("NOTICE: a real driver: the refusals are the emulator's");
        return;
    };
    let ctx = CudaContext::new(0).unwrap();
    let k = Kernels::load(&ctx).unwrap();
    let s = ctx.default_stream();
    let x = s.clone_htod(&[2.0f32; 64]).unwrap();
    let (xp, _) = cudarc::driver::DevicePtr::device_ptr(&x, &s);
    let expect_err = |r: Result<(), String>, code: &str, msg: &[&str]| {
        let e = r.expect_err("the emulated driver accepted it");
        assert!(e.contains(code), "{e}");
        let m = emu.last_error();
        for w in msg {
            assert!(m.contains(w), "{m:?} lacks {w:?}");
        }
    };
    let run = |f: &CudaFunction, c: LaunchConfig, args: &[Arg]| {
        // SAFETY: scale_temperature(x, n, t) over x's 64 floats, or a
        // deliberate mismatch the emulated driver refuses (the overrun
        // writes into the guard zone it keeps after each allocation).
        unsafe { kernels::launch(&s, f, c, args) }
    };
    let ok = run(
        &k.scale_temperature,
        kernels::per_item(64),
        &[Arg::Ptr(xp), Arg::I32(64), Arg::F32(4.0)],
    );
    ok.unwrap();
    assert_eq!(s.clone_dtoh(&x).unwrap(), vec![0.5f32; 64]);
    let missing_pointer = run(
        &k.top_k,
        cfg((1, 1), 1024, 0),
        &[Arg::Ptr(xp), Arg::I32(64), Arg::I32(1), Arg::Ptr(0)],
    );
    expect_err(
        missing_pointer,
        "CUDA_ERROR_INVALID_VALUE",
        &["top_k", "24 bytes", "pack to 32"],
    );
    let outside = run(
        &k.scale_temperature,
        kernels::per_item(64),
        &[Arg::Ptr(xp + 64 * 4 + 4096), Arg::I32(64), Arg::F32(4.0)],
    );
    expect_err(
        outside,
        "CUDA_ERROR_ILLEGAL_ADDRESS",
        &["scale_temperature", "pointer parameter 0"],
    );
    let wide = run(
        &k.scale_temperature,
        cfg((1, 1), 1025, 0),
        &[Arg::Ptr(xp), Arg::I32(64), Arg::F32(1.0)],
    );
    expect_err(wide, "CUDA_ERROR_INVALID_VALUE", &["1025 threads"]);
    let shared = run(
        &k.scale_temperature,
        cfg((1, 1), 64, 49 << 10),
        &[Arg::Ptr(xp), Arg::I32(64), Arg::F32(1.0)],
    );
    expect_err(
        shared,
        "CUDA_ERROR_INVALID_VALUE",
        &["50176 bytes of dynamic shared"],
    );
    // (t = 4 changes the guard bytes it reads and writes back)
    let overrun = run(
        &k.scale_temperature,
        kernels::per_item(72),
        &[Arg::Ptr(xp), Arg::I32(72), Arg::F32(4.0)],
    );
    expect_err(
        overrun,
        "CUDA_ERROR_ILLEGAL_ADDRESS",
        &["wrote past the end of the 256-byte allocation"],
    );
    // SAFETY: a copy of 16 bytes to 8 bytes before the end of x (refused).
    let copy = unsafe { result::memcpy_htod_sync(xp + 63 * 4, &[0u8; 16][..]) };
    let e = copy.expect_err("an out-of-bounds copy was accepted");
    assert!(format!("{e}").contains("CUDA_ERROR_INVALID_VALUE"), "{e}");
    assert!(
        emu.last_error().contains("cuMemcpyHtoD"),
        "{}",
        emu.last_error()
    );
    assert!(live_allocations().unwrap() > 0);
}
