//! GPU tests of the CUDA backend (feature `cuda`). Without a usable GPU they
//! skip with a notice, unless `SAMPLERD_EXPECT_GPU=1` (set by
//! scripts/gpu-check.sh), which turns a missing GPU into a failure. They
//! need the model: `SAMPLERD_MODEL=models/SmolLM2-135M-Instruct.Q4_1.gguf`.
//!
//! - GPU vs CPU logits, relative error ≤ 1e-2 at every position (decode
//!   step by step, and a prefill's last position); the kernels follow the
//!   CPU's arithmetic, so the logits are expected bit-identical, and the
//!   test prints (`GPU-CHECK` lines) the error and a per-layer comparison of
//!   the residual stream for every position of the first prompt;
//! - greedy tokens identical to the CPU path for 32 tokens of three prompts;
//! - the device sampling prefix: survivors equal to the CPU twin
//!   (`device_prefix::reference`) bit for bit, and the chosen token equal to
//!   the whole CPU chain's, on 1,000 random logit vectors of 151,936.
#![cfg(feature = "cuda")]

mod common;

use std::path::PathBuf;
use std::sync::OnceLock;

use common::*;
use samplerd_model::cuda::{CudaBackend, CudaOptions, DeviceStatus};
use samplerd_model::{Backend, ChatMessage, DeviceRequest, Model, ModelOptions, Placement};
use samplerd_sampling::device_prefix::{self, SdCandidate, Survivors};
use samplerd_sampling::{SamplingParams, StageRegistry, TokenBuffer};

const MAX_REL_ERR: f32 = 1e-2;

/// The model path and a GPU, or None (skip) — a panic when the GPU check
/// script expects one.
fn setup() -> Option<PathBuf> {
    let expect = std::env::var("SAMPLERD_EXPECT_GPU").as_deref() == Ok("1");
    let gpu = samplerd_model::cuda::resolve(DeviceRequest::Cuda);
    if let Err(e) = &gpu {
        assert!(!expect, "SAMPLERD_EXPECT_GPU=1 but: {e}");
        eprintln!("NOTICE: no usable GPU ({e}); skipping the GPU test");
        return None;
    }
    let Some(p) = std::env::var_os("SAMPLERD_MODEL").map(PathBuf::from) else {
        assert!(!expect, "SAMPLERD_EXPECT_GPU=1 needs SAMPLERD_MODEL");
        eprintln!("NOTICE: SAMPLERD_MODEL unset; skipping the GPU test");
        return None;
    };
    assert!(p.is_file(), "SAMPLERD_MODEL={} is not a file", p.display());
    Some(p)
}

struct Both {
    cpu: std::sync::Arc<Model>,
    gpu: CudaBackend,
}

fn both(path: &std::path::Path) -> Both {
    let opts = ModelOptions {
        n_threads: 0,
        n_ctx: 1024,
        ..Default::default()
    };
    let cpu = Model::load(path, &opts).expect("CPU model loads");
    let mut g = samplerd_model::gguf::GgufFile::open(path).unwrap();
    let config = g.config().unwrap();
    let weights = samplerd_model::gguf::Weights::load(&mut g, &config).unwrap();
    let gpu = CudaBackend::new(config, &weights, CudaOptions::default()).expect("CUDA backend");
    Both { cpu, gpu }
}

fn prompts(m: &Model) -> Vec<Vec<u32>> {
    [
        "What is the capital of France?",
        "Write a haiku about the sea.",
        "List three prime numbers and explain why they are prime.",
    ]
    .iter()
    .map(|q| {
        let text = m.render_chat(&[ChatMessage::new("user", *q)]).unwrap();
        m.tokenizer().encode(&text, true, true).unwrap()
    })
    .collect()
}

fn rel_err(gpu: &[f32], cpu: &[f32]) -> f32 {
    let scale = cpu.iter().fold(0f32, |m, v| m.max(v.abs())).max(1e-6);
    let diff = gpu
        .iter()
        .zip(cpu)
        .fold(0f32, |m, (a, b)| m.max((a - b).abs()));
    diff / scale
}

#[test]
fn placement_is_cuda_when_a_gpu_is_present() {
    if setup().is_none() {
        return;
    }
    let r = samplerd_model::cuda::resolve(DeviceRequest::Auto).unwrap();
    assert!(matches!(r.placement, Placement::Cuda { .. }), "{r:?}");
}

/// Relative error per layer of two residual-stream traces (one step each).
fn layer_errors(gpu: &[Vec<f32>], cpu: &[Vec<f32>]) -> Vec<f32> {
    assert_eq!(gpu.len(), cpu.len(), "layers traced");
    gpu.iter().zip(cpu).map(|(g, c)| rel_err(g, c)).collect()
}

#[test]
fn gpu_logits_match_the_cpu_at_every_position() {
    let Some(path) = setup() else { return };
    let b = both(&path);
    let n_vocab = b.cpu.n_vocab();
    eprintln!(
        "GPU-CHECK numerics={} backend={}",
        samplerd_model::Numerics::default().describe(),
        b.gpu.name()
    );
    let mut worst = 0f32;
    let (mut identical, mut total) = (0, 0);
    let mut failures = Vec::new();
    for (i, toks) in prompts(&b.cpu).into_iter().enumerate() {
        let mut cs = b.cpu.new_session().unwrap();
        let mut gs = b.gpu.new_sequence(1024).unwrap();
        let mut gl = vec![0f32; n_vocab];
        for (p, &t) in toks.iter().enumerate() {
            // The first prompt runs eagerly with a per-layer comparison; the
            // others through the decode graph.
            let (cl, layers) = if i == 0 {
                let (cl, cpu_layers) =
                    samplerd_model::cpu::trace_layers(|| cs.decode(t).unwrap().to_vec());
                let gpu_layers = b.gpu.forward_trace(&mut gs, &[t]).unwrap();
                (cl, Some(layer_errors(&gpu_layers, &cpu_layers)))
            } else {
                let cl = cs.decode(t).unwrap().to_vec();
                b.gpu.forward_device(&mut gs, &[t]).unwrap();
                (cl, None)
            };
            b.gpu.copy_logits(&mut gs, &mut gl).unwrap();
            let e = rel_err(&gl, &cl);
            let same = gl.iter().zip(&cl).all(|(a, b)| a.to_bits() == b.to_bits());
            identical += same as usize;
            total += 1;
            worst = worst.max(e);
            if let Some(le) = layers {
                let first = le.iter().position(|&x| x > 0.0);
                eprintln!(
                    "GPU-CHECK logits prompt=0 pos={p} rel_err={e:e} bit_identical={same} \
                     first_layer_differing={first:?} last_layer_rel_err={:e}",
                    le.last().copied().unwrap_or(0.0)
                );
            }
            if e > MAX_REL_ERR {
                failures.push(format!("prompt {i} position {p}: relative error {e}"));
            }
        }
        // A prefill of the whole prompt ends at the same logits.
        let mut gp = b.gpu.new_sequence(1024).unwrap();
        b.gpu.forward_device(&mut gp, &toks).unwrap();
        b.gpu.copy_logits(&mut gp, &mut gl).unwrap();
        let mut cp = b.cpu.new_session().unwrap();
        let cl = cp.prefill(&toks).unwrap().to_vec();
        let e = rel_err(&gl, &cl);
        let same = gl.iter().zip(&cl).all(|(a, b)| a.to_bits() == b.to_bits());
        eprintln!("GPU-CHECK prefill prompt={i} rel_err={e:e} bit_identical={same}");
        worst = worst.max(e);
        if e > MAX_REL_ERR {
            failures.push(format!("prompt {i} prefill: relative error {e}"));
        }
    }
    eprintln!("GPU-CHECK logits_max_rel_err={worst:e} bit_identical_positions={identical}/{total}");
    assert!(failures.is_empty(), "{}", failures.join("; "));
}

#[test]
fn greedy_tokens_match_the_cpu_for_32_tokens_of_three_prompts() {
    let Some(path) = setup() else { return };
    let b = both(&path);
    let n_vocab = b.cpu.n_vocab();
    let mut failures = Vec::new();
    for (i, toks) in prompts(&b.cpu).into_iter().enumerate() {
        let mut cs = b.cpu.new_session().unwrap();
        let mut gs = b.gpu.new_sequence(1024).unwrap();
        let mut gl = vec![0f32; n_vocab];
        let mut cl = cs.prefill(&toks).unwrap().to_vec();
        let mut c_next = argmax(&cl);
        b.gpu.forward_device(&mut gs, &toks).unwrap();
        b.gpu.copy_logits(&mut gs, &mut gl).unwrap();
        let mut g_next = argmax(&gl);
        let (mut cpu_out, mut gpu_out) = (Vec::new(), Vec::new());
        let mut worst = 0f32;
        for _ in 0..32 {
            if g_next != c_next && gpu_out == cpu_out {
                // The first divergence: how close the CPU's top two were.
                let mut sorted = cl.clone();
                sorted.sort_by(|a, b| b.total_cmp(a));
                eprintln!(
                    "GPU-CHECK greedy prompt={i} diverges at token {}: cpu {c_next} gpu {g_next}, \
                     cpu top-2 margin {:e}, logits rel_err {:e}",
                    cpu_out.len(),
                    sorted[0] - sorted[1],
                    rel_err(&gl, &cl)
                );
            }
            worst = worst.max(rel_err(&gl, &cl));
            cpu_out.push(c_next);
            gpu_out.push(g_next);
            cl = cs.decode(c_next).unwrap().to_vec();
            c_next = argmax(&cl);
            b.gpu.forward_device(&mut gs, &[g_next]).unwrap();
            b.gpu.copy_logits(&mut gs, &mut gl).unwrap();
            g_next = argmax(&gl);
        }
        let same = gpu_out
            .iter()
            .zip(&cpu_out)
            .take_while(|(a, b)| a == b)
            .count();
        eprintln!("GPU-CHECK greedy prompt={i} matching_prefix={same}/32 max_rel_err={worst:e}");
        if gpu_out != cpu_out {
            failures.push(format!(
                "prompt {i}: greedy tokens differ\n  gpu: {gpu_out:?}\n  cpu: {cpu_out:?}"
            ));
        }
    }
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}

fn registry() -> &'static StageRegistry {
    static REG: OnceLock<StageRegistry> = OnceLock::new();
    REG.get_or_init(|| StageRegistry::load(&[], &[core_plugin()]).unwrap())
}

#[test]
fn device_prefix_equals_the_cpu_chain_on_1000_random_vectors() {
    let Some(path) = setup() else { return };
    let b = both(&path);
    const N: usize = 151_936;
    let mut st = b.gpu.new_sequence(16).unwrap();
    let param_sets = [
        SamplingParams::default(),
        SamplingParams {
            temperature: 0.0,
            logit_bias: vec![(5, 3.0), (17, f32::NEG_INFINITY), (5, -0.5)],
            ..Default::default()
        },
        SamplingParams {
            top_k: 256,
            temperature: 0.7,
            frequency_penalty: 0.3,
            presence_penalty: 0.2,
            order: vec!["temperature".into(), "penalties".into(), "top_k".into()],
            ..Default::default()
        },
        SamplingParams {
            top_k: 1,
            ..Default::default()
        },
    ];
    let mut buf = TokenBuffer::new();
    let (mut survivors, mut reference) = (Vec::<(u32, f32)>::new(), Vec::<SdCandidate>::new());
    let (mut ids, mut counts) = (Vec::new(), Vec::new());
    let mut bytes = 0u64;
    for i in 0..1000u64 {
        let p = &param_sets[i as usize % param_sets.len()];
        let chain = registry().build_chain(&p.chain_spec(), None).unwrap();
        let mut split = device_prefix::SplitSequence::new(registry(), &chain, N).unwrap();
        let mut full = chain.new_sequence().unwrap();
        let window: Vec<u32> = (0..64)
            .map(|j| ((i * 7919 + j * 104_729) % N as u64) as u32)
            .collect();
        for &t in &window {
            split.accept(t).unwrap();
            full.accept(t).unwrap();
        }
        let mut l = samplerd_sampling::bench::random_logits(N, 3.0, i);
        if i % 10 == 0 {
            // Coarse values: many ties at the cut.
            for v in &mut l {
                *v = (*v * 2.0).round() / 2.0;
            }
        }
        let plan = split.plan().clone();
        assert!(!plan.device.is_empty(), "{}", chain.describe());
        split.window().distinct(&mut ids, &mut counts);
        b.gpu.set_logits(&mut st, &l).unwrap();
        let before = st.d2h_bytes;
        let status = b
            .gpu
            .sample_prefix(
                &mut st,
                &device_ops(&plan.device, &ids, &counts),
                &mut survivors,
            )
            .unwrap();
        bytes += st.d2h_bytes - before;
        let fallback =
            device_prefix::reference::run(&plan.device, split.window(), &l, &mut reference);
        assert_eq!(status == DeviceStatus::Ok, !fallback, "vector {i}");
        let got: Vec<(u32, u32)> = survivors.iter().map(|&(id, v)| (id, v.to_bits())).collect();
        let want: Vec<(u32, u32)> = reference
            .iter()
            .map(|c| (c.id, c.logit.to_bits()))
            .collect();
        assert_eq!(
            got, want,
            "vector {i}: device survivors differ from the CPU twin"
        );
        let cands: Vec<SdCandidate> = survivors
            .iter()
            .map(|&(id, logit)| SdCandidate { id, logit })
            .collect();
        let seed = i * 31 + 7;
        let token = split
            .finish(Survivors::Candidates(&cands), || &l, seed, i)
            .unwrap();
        buf.load(&l).unwrap();
        let cpu = full.sample(&mut buf, seed, i).unwrap();
        assert_eq!(token, cpu, "vector {i}: {}", chain.describe());
    }
    eprintln!(
        "GPU-CHECK device_prefix_d2h_bytes_per_step={}",
        bytes / 1000
    );
}
