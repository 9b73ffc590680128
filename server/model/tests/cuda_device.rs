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
use samplerd_model::cuda::{CudaBackend, CudaOptions, MmKernel};
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

/// Several sequences stepped together through the model (`decode_batch`:
/// one batched pass on the device) equal each stepped alone on the CPU.
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

/// The CUDA backend of the tiny model at `p`, with `opts`.
fn cuda_backend(p: &Path, opts: CudaOptions) -> CudaBackend {
    let mut g = samplerd_model::gguf::GgufFile::open(p).unwrap();
    let config = g.config().unwrap();
    let weights = samplerd_model::gguf::Weights::load(&mut g, &config).unwrap();
    CudaBackend::new(config, &weights, opts).unwrap()
}

/// Which of 8 sequences step together, step by step: batches of 2, 3 and
/// 8 and single steps (the one-sequence path), sequences joining (their
/// prefill comes just before their first step) and leaving, so the rows
/// of a batch sit at different positions.
const SCHEDULE: [&[usize]; 8] = [
    &[0, 1],
    &[0, 1, 2],
    &[0, 1, 2, 3, 4, 5, 6, 7],
    &[3],
    &[6, 1, 4],
    &[0, 1, 2, 3, 4, 5, 6, 7],
    &[7, 2],
    &[5],
];

/// Runs [`SCHEDULE`] on `gpu` through `Backend::forward_batch` and on the
/// CPU one sequence at a time: every row's logits must equal the CPU's
/// (so each sequence's step alone) bit for bit. Sequence i's prompt has
/// i + 1 tokens.
fn assert_batches_match(cpu: &Model, gpu: &CudaBackend, what: &str) {
    use samplerd_model::SequenceState;
    let n = 8;
    let mut cs: Vec<Option<samplerd_model::Session>> = (0..n).map(|_| None).collect();
    let mut gs: Vec<Box<dyn SequenceState>> = (0..n).map(|_| gpu.new_state(CTX).unwrap()).collect();
    let mut next = vec![0u32; n];
    let mut scratch = vec![0f32; N_VOCAB];
    for (step, rows) in SCHEDULE.iter().enumerate() {
        for &i in rows.iter() {
            if cs[i].is_none() {
                let prompt: Vec<u32> = (0..=i as u32)
                    .map(|j| 1 + (37 * j + 11 * i as u32) % 250)
                    .collect();
                let mut c = cpu.new_session().unwrap();
                let want = c.prefill(&prompt).unwrap().to_vec();
                gpu.forward(gs[i].as_mut(), &prompt, &mut scratch).unwrap();
                assert_eq!(bits(&scratch), bits(&want), "{what}: prefill of {i}");
                next[i] = argmax(&want);
                cs[i] = Some(c);
            }
        }
        let tokens: Vec<u32> = rows.iter().map(|&i| next[i]).collect();
        let want: Vec<Vec<f32>> = rows
            .iter()
            .map(|&i| cs[i].as_mut().unwrap().decode(next[i]).unwrap().to_vec())
            .collect();
        let mut got = vec![vec![0f32; N_VOCAB]; rows.len()];
        {
            // The rows' states in the schedule's order (not the sequences').
            let mut by_seq: Vec<Option<&mut Box<dyn SequenceState>>> =
                gs.iter_mut().map(Some).collect();
            let mut states: Vec<&mut dyn SequenceState> = rows
                .iter()
                .map(|&i| by_seq[i].take().unwrap().as_mut())
                .collect();
            let mut logits: Vec<&mut [f32]> = got.iter_mut().map(|l| l.as_mut_slice()).collect();
            gpu.forward_batch(&mut states, &tokens, &mut logits)
                .unwrap();
        }
        for ((&i, g), w) in rows.iter().zip(&got).zip(&want) {
            assert_eq!(
                bits(g),
                bits(w),
                "{what}: step {step}, sequence {i} (batch of {})",
                rows.len()
            );
            assert_eq!(
                gs[i].position(),
                cs[i].as_ref().unwrap().position(),
                "{what}: position of {i}"
            );
            next[i] = argmax(w);
        }
    }
    let batched: Vec<usize> = SCHEDULE
        .iter()
        .map(|r| r.len())
        .filter(|&b| b > 1)
        .collect();
    let stats = gpu.batch_stats();
    assert_eq!(stats.passes, batched.len() as u64, "{what}: batched passes");
    assert_eq!(
        stats.rows,
        batched.iter().sum::<usize>() as u64,
        "{what}: batched rows"
    );
    assert_eq!(stats.largest, 8, "{what}: largest batch");
}

/// A decode step of several sequences runs as one batched pass (the weights
/// read once for all rows) whose every row has the bits of its sequence
/// stepped alone: every weight format, batches of 1, 2, 3 and 8 at
/// different positions, sequences joining and leaving between steps; the
/// qwen2 model (biases, NeoX RoPE); and the other kernel layouts (the
/// eight-lane products, attention scores inside the attention kernel).
#[test]
fn batched_steps_equal_each_sequence_alone() {
    let Some((_placement, _turn)) = device() else {
        return;
    };
    let dir = tempfile::tempdir().unwrap();
    for dtype in FORMATS {
        let p = model_file(dir.path(), "llama", dtype);
        let cpu = Model::load(&p, &opts()).unwrap();
        let gpu = cuda_backend(&p, CudaOptions::default());
        assert_batches_match(&cpu, &gpu, &format!("llama {dtype:?}"));
    }
    let p = model_file(dir.path(), "qwen2", GgmlDType::Q8_0);
    let cpu = Model::load(&p, &opts()).unwrap();
    assert_batches_match(
        &cpu,
        &cuda_backend(&p, CudaOptions::default()),
        "qwen2 Q8_0",
    );
    for dtype in [GgmlDType::Q4K, GgmlDType::F16] {
        let p = model_file(dir.path(), "llama", dtype);
        let cpu = Model::load(&p, &opts()).unwrap();
        let variant = CudaOptions {
            mm: MmKernel::Lanes,
            split_scores: false,
            ..CudaOptions::default()
        };
        assert_batches_match(
            &cpu,
            &cuda_backend(&p, variant),
            &format!("llama {dtype:?}, lanes, fused scores"),
        );
    }
}

/// A batched step with a bad row is refused before anything runs: no
/// sequence moves, and the same sequences then step normally.
#[test]
fn a_bad_row_refuses_the_whole_batched_step() {
    let Some((_placement, _turn)) = device() else {
        return;
    };
    let dir = tempfile::tempdir().unwrap();
    let p = model_file(dir.path(), "llama", GgmlDType::Q8_0);
    let gpu = cuda_backend(&p, CudaOptions::default());
    let mut a = gpu.new_sequence(CTX).unwrap();
    let mut b = gpu.new_sequence(2).unwrap();
    let mut l = vec![0f32; N_VOCAB];
    gpu.forward(&mut a, &[1, 2], &mut l).unwrap();
    gpu.forward(&mut b, &[1, 2], &mut l).unwrap();
    // b is full: its row would write past its cache.
    let e = gpu
        .enqueue_decode_batch(&mut [&mut a, &mut b], &[3, 4])
        .unwrap_err();
    assert!(e.to_string().contains("context full"), "{e}");
    let e = gpu
        .enqueue_decode_batch(&mut [&mut a, &mut b], &[3])
        .unwrap_err();
    assert!(e.to_string().contains("2 sequences got 1 tokens"), "{e}");
    let e = gpu
        .enqueue_decode_batch(&mut [&mut a], &[N_VOCAB as u32])
        .unwrap_err();
    assert!(e.to_string().contains(&N_VOCAB.to_string()), "{e}");
    use samplerd_model::SequenceState;
    assert_eq!((a.position(), b.position()), (2, 2));
    assert_eq!(gpu.batch_stats().passes, 0);
    let mut c = gpu.new_sequence(CTX).unwrap();
    gpu.forward(&mut c, &[1, 2], &mut l).unwrap();
    gpu.enqueue_decode_batch(&mut [&mut a, &mut c], &[3, 3])
        .unwrap();
    let (mut la, mut lc) = (vec![0f32; N_VOCAB], vec![0f32; N_VOCAB]);
    gpu.copy_logits(&mut a, &mut la).unwrap();
    gpu.copy_logits(&mut c, &mut lc).unwrap();
    assert_eq!(bits(&la), bits(&lc), "same tokens, same logits");
    assert_eq!((a.position(), c.position()), (3, 3));
}

/// More sequences than one pass takes (`max_batch_rows`, here 3) step as
/// several passes (3 + 3 + 1 rows), each row still its own sequence's
/// step; an impossible limit is refused.
#[test]
fn a_batch_larger_than_one_pass_runs_as_several() {
    let Some((_placement, _turn)) = device() else {
        return;
    };
    let dir = tempfile::tempdir().unwrap();
    let p = model_file(dir.path(), "llama", GgmlDType::Q4_1);
    let opts = |max_batch_rows| CudaOptions {
        max_batch_rows,
        ..CudaOptions::default()
    };
    let gpu = cuda_backend(&p, opts(3));
    let prompt = |i: usize| [1 + (i % 5) as u32, 7];
    // Each distinct prompt's next logits, one sequence at a time.
    let want: Vec<Vec<f32>> = (0..5)
        .map(|i| {
            let mut st = gpu.new_sequence(4).unwrap();
            let mut l = vec![0f32; N_VOCAB];
            gpu.forward(&mut st, &prompt(i), &mut l).unwrap();
            gpu.forward(&mut st, &[9 + i as u32], &mut l).unwrap();
            l
        })
        .collect();
    let n = 7;
    let mut states: Vec<_> = (0..n).map(|_| gpu.new_sequence(4).unwrap()).collect();
    let mut l = vec![0f32; N_VOCAB];
    for (i, st) in states.iter_mut().enumerate() {
        gpu.forward(st, &prompt(i), &mut l).unwrap();
    }
    let tokens: Vec<u32> = (0..n).map(|i| 9 + (i % 5) as u32).collect();
    let mut refs: Vec<_> = states.iter_mut().collect();
    gpu.enqueue_decode_batch(&mut refs, &tokens).unwrap();
    for (i, st) in states.iter_mut().enumerate() {
        gpu.copy_logits(st, &mut l).unwrap();
        assert_eq!(bits(&l), bits(&want[i % 5]), "row {i}");
    }
    let stats = gpu.batch_stats();
    assert_eq!((stats.passes, stats.rows, stats.largest), (3, 7, 3));
    let mut g = samplerd_model::gguf::GgufFile::open(&p).unwrap();
    let config = g.config().unwrap();
    let weights = samplerd_model::gguf::Weights::load(&mut g, &config).unwrap();
    for bad in [0, 65_536] {
        let e = CudaBackend::new(config.clone(), &weights, opts(bad)).unwrap_err();
        assert!(
            e.to_string().contains(&format!("max_batch_rows {bad}")),
            "{e}"
        );
    }
}

/// The emulated driver's count of live allocations (None on a real driver).
fn live_allocations() -> Option<u64> {
    // SAFETY: the emulator's `uint64_t samplerd_emu_live_allocations(void)`.
    emu().map(|e| unsafe { (e.live)() })
}

/// Sequences and the model (with its batched step's scratch) give their
/// device memory back when dropped.
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
    // A batched step's stream and scratch stay with the model (sized for
    // the largest batch) and go with it.
    {
        let mut a = gpu.new_session().unwrap();
        let mut b = gpu.new_session().unwrap();
        a.prefill(&[1, 2]).unwrap();
        b.prefill(&[3]).unwrap();
        gpu.decode_batch(&mut [&mut a, &mut b], &[4, 5]).unwrap();
    }
    assert!(live_allocations().unwrap() > with_model);
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

/// Order-preserving key of a logit (-0 and +0 equal), as the device's.
fn key(v: f32) -> u32 {
    let u = (v + 0.0).to_bits();
    if u & 0x8000_0000 != 0 {
        !u
    } else {
        u | 0x8000_0000
    }
}

/// The k best of `x` — logit descending, ties by lower id — as (id, bits).
fn reference_top_k(x: &[f32], k: usize) -> Vec<(u32, u32)> {
    let mut idx: Vec<u32> = (0..x.len() as u32).collect();
    idx.sort_by(|&a, &b| key(x[b as usize]).cmp(&key(x[a as usize])).then(a.cmp(&b)));
    idx.truncate(k.min(x.len()));
    idx.iter().map(|&i| (i, x[i as usize].to_bits())).collect()
}

/// Deterministic logits with many exact ties at coarse `step`s and a few
/// −∞ (a splitmix64 stream).
fn tied_logits(n: usize, seed: u64, step: f32) -> Vec<f32> {
    let mut s = seed;
    (0..n)
        .map(|_| {
            s = s.wrapping_add(0x9E37_79B9_7F4A_7C15);
            let mut z = s;
            z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
            z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
            z ^= z >> 31;
            if z.is_multiple_of(97) {
                return f32::NEG_INFINITY;
            }
            let u = (z >> 40) as f32 / (1u64 << 24) as f32;
            ((u * 12.0 - 8.0) / step).round() * step
        })
        .collect()
}

/// The multi-block top-k equals the single-block kernel and a sort, at the
/// tiny models' vocabulary and at 151,936 (Qwen's); the survivors come
/// with their raw logits, and the raw row's log-sum-exp the device's
/// blocks give equals the host scan's bit for bit.
#[test]
fn device_top_k_and_log_sum_exp_match_their_references() {
    use samplerd_model::PrefixOutput;
    use samplerd_model::cuda::{DeviceOp, DeviceStatus, TopK};
    let Some((_placement, _turn)) = device() else {
        return;
    };
    let dir = tempfile::tempdir().unwrap();
    let p = model_file(dir.path(), "llama", GgmlDType::Q8_0);
    let mut g = samplerd_model::gguf::GgufFile::open(&p).unwrap();
    let config = g.config().unwrap();
    let weights = samplerd_model::gguf::Weights::load(&mut g, &config).unwrap();
    let be = CudaBackend::new(config, &weights, CudaOptions::default()).unwrap();
    let mut st = be.new_sequence(CTX).unwrap();
    let cases: &[(usize, &[usize], f32)] = &[
        (N_VOCAB, &[1, 7, 40, 256], 0.25),
        (N_VOCAB, &[3, 261], 1e-3),
        (151_936, &[40, 256], 0.5),
    ];
    let (mut single, mut multi) = (Vec::new(), Vec::new());
    let mut row = PrefixOutput::default();
    for (case, &(n, ks, step)) in cases.iter().enumerate() {
        let logits = tied_logits(n, 17 + case as u64, step);
        be.set_logits(&mut st, &logits).unwrap();
        let t = 0.7f32;
        let scaled: Vec<f32> = logits
            .iter()
            .map(|&v| {
                if v == f32::NEG_INFINITY {
                    v
                } else {
                    (v / t).clamp(-f32::MAX, f32::MAX)
                }
            })
            .collect();
        for &k in ks {
            let ops = [DeviceOp::Temperature(t), DeviceOp::TopK(k)];
            let s = be
                .sample_prefix_with(&mut st, &ops, TopK::SingleBlock, &mut single)
                .unwrap();
            let m = be
                .sample_prefix_with(&mut st, &ops, TopK::MultiBlock, &mut multi)
                .unwrap();
            assert_eq!((s, m), (DeviceStatus::Ok, DeviceStatus::Ok), "n={n} k={k}");
            let as_bits = |v: &[(u32, f32)]| -> Vec<(u32, u32)> {
                v.iter().map(|&(i, l)| (i, l.to_bits())).collect()
            };
            let want = reference_top_k(&scaled, k);
            assert_eq!(as_bits(&single), want, "single-block top_k, n={n} k={k}");
            assert_eq!(as_bits(&multi), want, "multi-block top_k, n={n} k={k}");
            be.sample_prefix_row(&mut st, &ops, &mut row).unwrap();
            assert_eq!(row.outcome, samplerd_model::RowOutcome::Survivors);
            let got: Vec<(u32, u32, u32)> = row
                .survivors
                .iter()
                .map(|c| (c.id, c.logit.to_bits(), c.raw.to_bits()))
                .collect();
            let want: Vec<(u32, u32, u32)> = want
                .iter()
                .map(|&(i, l)| (i, l, logits[i as usize].to_bits()))
                .collect();
            assert_eq!(got, want, "prefixed row, n={n} k={k}");
            assert_eq!(
                row.raw_lse.to_bits(),
                samplerd_numerics::lse::log_sum_exp(&logits).to_bits(),
                "log-sum-exp, n={n}: {} vs the host's {}",
                row.raw_lse,
                samplerd_numerics::lse::log_sum_exp(&logits)
            );
            // 12 bytes a survivor, 12 per 1024 logits, 8 of header.
            assert_eq!(row.d2h_bytes, 8 + 12 * k + 12 * n.div_ceil(1024));
        }
    }
    // Block maxima that rise and fall inside each 8,192-logit chunk: a
    // block's terms are taken against the chunk's running max, not its own.
    for (case, n) in [(0u64, 151_936usize), (1, 20_000), (2, 1_025)] {
        let mut logits = tied_logits(n, 40 + case, 1e-3);
        for (i, v) in logits.iter_mut().enumerate() {
            *v += [0.0, 6.0, -3.0, 2.5, 9.0, -7.0][(i / 1024) % 6];
        }
        be.set_logits(&mut st, &logits).unwrap();
        be.sample_prefix_row(&mut st, &[DeviceOp::TopK(1)], &mut row)
            .unwrap();
        assert_eq!(
            row.raw_lse.to_bits(),
            samplerd_numerics::lse::log_sum_exp(&logits).to_bits(),
            "log-sum-exp over uneven blocks, n={n}"
        );
    }
    // Logits the CPU rejects come back as a fallback.
    let mut bad = tied_logits(N_VOCAB, 3, 0.25);
    bad[100] = f32::NAN;
    be.set_logits(&mut st, &bad).unwrap();
    be.sample_prefix_row(&mut st, &[DeviceOp::TopK(5)], &mut row)
        .unwrap();
    assert_eq!(row.outcome, samplerd_model::RowOutcome::Fallback);
    be.set_logits(&mut st, &vec![f32::NEG_INFINITY; N_VOCAB])
        .unwrap();
    be.sample_prefix_row(&mut st, &[DeviceOp::TopK(5)], &mut row)
        .unwrap();
    assert_eq!(row.outcome, samplerd_model::RowOutcome::Fallback);
}
