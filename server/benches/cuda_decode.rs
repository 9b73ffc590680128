//! Decode throughput of the CUDA backend with the default sampler chain
//! split between device and host (scripts/gpu-check.sh runs it): tokens/s
//! for 1 and 8 concurrent streams (8: one batched decode pass per step,
//! as Generate's engine runs them; also a pass per stream, for
//! comparison), time per step split into forward /
//! device sampling / device→host copy / host remainder, and bytes copied to
//! the host per token; plus the same loop copying the whole logits to the
//! host and running the whole chain there, for comparison. Medians of
//! `SAMPLERD_BENCH_ROUNDS` (default 5) rounds of `SAMPLERD_BENCH_STEPS`
//! (default 256) steps. Needs `SAMPLERD_MODEL` and a GPU; prints a notice
//! and exits 0 without them (exit 1 when `SAMPLERD_EXPECT_GPU=1`).

#[path = "../tests/common/mod.rs"]
mod common;

use std::path::PathBuf;
use std::time::{Duration, Instant};

use common::{core_plugin, device_ops};

use samplerd_model::cuda::{CudaBackend, CudaOptions, CudaState, MmKernel};
use samplerd_model::{Backend, ChatMessage, DeviceRequest, Model, ModelOptions};
use samplerd_sampling::device_prefix::{SdCandidate, SplitSequence, Survivors};
use samplerd_sampling::{SamplingParams, StageRegistry, TokenBuffer};

fn env_usize(name: &str, default: usize) -> usize {
    std::env::var(name)
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

/// One stream's decode state.
struct Stream {
    st: CudaState,
    split: SplitSequence,
    full: samplerd_sampling::Sequence,
    next: u32,
    step: u64,
}

#[derive(Default, Clone, Copy)]
struct Round {
    tokens: usize,
    wall: Duration,
    forward: Duration,
    sampling: Duration,
    copy: Duration,
    host: Duration,
    d2h: u64,
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

/// `steps` decode steps over all `streams` at once; `device_sampling`
/// false copies the whole logits and samples on the host instead;
/// `batched` false runs each stream's step on its own (graph-replayed)
/// instead of one batched pass, for comparison.
fn round(
    gpu: &CudaBackend,
    streams: &mut [Stream],
    steps: usize,
    device_sampling: bool,
    batched: bool,
    n_vocab: usize,
) -> Round {
    let mut r = Round::default();
    let (mut ids, mut counts) = (Vec::new(), Vec::new());
    let mut row = samplerd_model::PrefixOutput::default();
    let mut cands: Vec<SdCandidate> = Vec::new();
    let mut logits = vec![0f32; n_vocab];
    let mut buf = TokenBuffer::new();
    for s in streams.iter_mut() {
        s.st.timing = Default::default();
    }
    let d2h0: u64 = streams.iter().map(|s| s.st.d2h_bytes).sum();
    let t0 = Instant::now();
    for _ in 0..steps {
        let tf = Instant::now();
        if batched {
            // Every stream's next token in one step: one batched pass for
            // 8 streams (the engine's path), the captured graph for one.
            let tokens: Vec<u32> = streams.iter().map(|s| s.next).collect();
            let mut states: Vec<&mut CudaState> = streams.iter_mut().map(|s| &mut s.st).collect();
            gpu.enqueue_decode_batch(&mut states, &tokens)
                .expect("forward");
        } else {
            for s in streams.iter_mut() {
                gpu.forward_device(&mut s.st, &[s.next]).expect("forward");
            }
        }
        for s in streams.iter() {
            gpu.synchronize(&s.st).expect("sync");
        }
        r.forward += tf.elapsed();
        for s in streams.iter_mut() {
            let token = if device_sampling {
                let plan = s.split.plan().clone();
                s.split.window().distinct(&mut ids, &mut counts);
                // What a Generate step copies: the survivors, their raw
                // logits and the raw row's log-sum-exp blocks.
                gpu.sample_prefix_row(
                    &mut s.st,
                    &device_ops(&plan.device, &ids, &counts),
                    &mut row,
                )
                .expect("device sampling");
                let th = Instant::now();
                cands.clear();
                cands.extend(row.survivors.iter().map(|c| SdCandidate {
                    id: c.id,
                    logit: c.logit,
                }));
                let t = s
                    .split
                    .finish(Survivors::Candidates(&cands), || &[], 42, s.step)
                    .expect("host remainder")
                    .token_id;
                s.split.accept(t).expect("accept");
                r.host += th.elapsed();
                t
            } else {
                gpu.copy_logits(&mut s.st, &mut logits).expect("copy");
                let th = Instant::now();
                buf.load(&logits).expect("logits");
                let t = s.full.sample(&mut buf, 42, s.step).expect("chain").token_id;
                s.full.accept(t).expect("accept");
                r.host += th.elapsed();
                t
            };
            s.next = token;
            s.step += 1;
        }
    }
    r.wall = t0.elapsed();
    r.tokens = steps * streams.len();
    for s in streams.iter() {
        r.sampling += Duration::from_nanos(s.st.timing.sampling_ns);
        r.copy += Duration::from_nanos(s.st.timing.copy_ns);
    }
    r.d2h = streams.iter().map(|s| s.st.d2h_bytes).sum::<u64>() - d2h0;
    r
}

fn main() {
    let expect = std::env::var("SAMPLERD_EXPECT_GPU").as_deref() == Ok("1");
    if let Err(e) = samplerd_model::cuda::resolve(DeviceRequest::Cuda) {
        eprintln!("NOTICE: no usable GPU ({e}); skipping the CUDA decode benchmark");
        std::process::exit(if expect { 1 } else { 0 });
    }
    let Some(path) = std::env::var_os("SAMPLERD_MODEL").map(PathBuf::from) else {
        eprintln!("NOTICE: SAMPLERD_MODEL unset; skipping the CUDA decode benchmark");
        std::process::exit(if expect { 1 } else { 0 });
    };
    let steps = env_usize("SAMPLERD_BENCH_STEPS", 256);
    let rounds = env_usize("SAMPLERD_BENCH_ROUNDS", 5);
    let cpu = Model::load(
        &path,
        &ModelOptions {
            n_threads: 1,
            n_ctx: 2048,
            ..Default::default()
        },
    )
    .expect("model");
    let mut g = samplerd_model::gguf::GgufFile::open(&path).unwrap();
    let config = g.config().unwrap();
    let weights = samplerd_model::gguf::Weights::load(&mut g, &config).unwrap();
    let gpu = CudaBackend::new(config, &weights, CudaOptions::default()).expect("CUDA backend");
    let registry = StageRegistry::load(&[], &[core_plugin()]).expect("core stages");
    let chain = registry
        .build_chain(&SamplingParams::default().chain_spec(), None)
        .unwrap();
    let n_vocab = cpu.n_vocab();
    let prompt = cpu
        .tokenizer()
        .encode(
            &cpu.render_chat(&[ChatMessage::new(
                "user",
                "Tell me a long story about a lighthouse keeper.",
            )])
            .unwrap(),
            true,
            true,
        )
        .unwrap();
    println!(
        "CUDA decode benchmark: {} | {} | chain {} | {rounds} rounds x {steps} steps, medians",
        gpu.name(),
        path.display(),
        chain.describe()
    );
    println!(
        "{:<34} {:>10} {:>10} {:>10} {:>10} {:>10} {:>12}",
        "mode", "tok/s", "fwd us", "samp us", "copy us", "host us", "D2H B/tok"
    );
    for (n_streams, device_sampling, batched) in [
        (1, true, true),
        (8, true, true),
        (8, true, false),
        (1, false, true),
        (8, false, true),
    ] {
        let mut rows: Vec<Round> = Vec::new();
        for _ in 0..rounds {
            let mut streams: Vec<Stream> = (0..n_streams)
                .map(|_| {
                    let mut st = gpu
                        .new_sequence(prompt.len() + steps + 1)
                        .expect("sequence");
                    gpu.forward_device(&mut st, &prompt).expect("prefill");
                    let mut l = vec![0f32; n_vocab];
                    gpu.copy_logits(&mut st, &mut l).expect("copy");
                    let next = l
                        .iter()
                        .enumerate()
                        .fold(0, |b, (i, &v)| if v > l[b] { i } else { b })
                        as u32;
                    Stream {
                        st,
                        split: SplitSequence::new(&registry, &chain, n_vocab).expect("split"),
                        full: chain.new_sequence().expect("sequence"),
                        next,
                        step: 0,
                    }
                })
                .collect();
            rows.push(round(
                &gpu,
                &mut streams,
                steps,
                device_sampling,
                batched,
                n_vocab,
            ));
        }
        let per_step = |f: fn(&Round) -> Duration| {
            median(
                rows.iter()
                    .map(|r| f(r).as_secs_f64() * 1e6 / steps as f64)
                    .collect(),
            )
        };
        let toks = median(
            rows.iter()
                .map(|r| r.tokens as f64 / r.wall.as_secs_f64())
                .collect(),
        );
        let d2h = median(
            rows.iter()
                .map(|r| r.d2h as f64 / r.tokens as f64)
                .collect(),
        );
        let mode = format!(
            "{n_streams} stream{} {}{}",
            if n_streams > 1 { "s" } else { "" },
            if device_sampling {
                "device prefix"
            } else {
                "full logits to host"
            },
            if batched { "" } else { ", unbatched" }
        );
        println!(
            "{mode:<34} {toks:>10.0} {:>10.1} {:>10.1} {:>10.1} {:>10.1} {d2h:>12.0}",
            per_step(|r| r.forward),
            per_step(|r| r.sampling),
            per_step(|r| r.copy),
            per_step(|r| r.host),
        );
        // Device sampling's target: at most 4 KB a token with the default
        // chain (the logits themselves are 4 bytes × n_vocab).
        println!(
            "GPU-CHECK bench streams={n_streams} device_sampling={device_sampling} batched={batched} tok_per_s={toks:.0} d2h_bytes_per_token={d2h:.0}{}",
            if device_sampling {
                if d2h <= 4096.0 {
                    " (<= 4 KB target: met)"
                } else {
                    " (<= 4 KB target: MISSED)"
                }
            } else {
                ""
            }
        );
    }
    forward_matrix(&gpu, &weights, &prompt);
}

/// Median forward time of one decode step (forward + synchronise, no
/// sampling) at several cache positions, for the default backend and for
/// variants: CUDA graphs off (launch overhead), the first weight-product
/// layout, attention scores computed inside the attention kernel. Separates
/// per-launch cost, weight products and attention's growth with the
/// position.
fn forward_matrix(gpu: &CudaBackend, weights: &samplerd_model::gguf::Weights, prompt: &[u32]) {
    let steps = env_usize("SAMPLERD_BENCH_FWD_STEPS", 64);
    let variants = [
        ("graphs, mm=warp", None),
        (
            "no graphs, mm=warp",
            Some(CudaOptions {
                graphs: false,
                ..CudaOptions::default()
            }),
        ),
        (
            "graphs, mm=lanes",
            Some(CudaOptions {
                mm: MmKernel::Lanes,
                ..CudaOptions::default()
            }),
        ),
        (
            "graphs, attn=fused",
            Some(CudaOptions {
                split_scores: false,
                ..CudaOptions::default()
            }),
        ),
    ];
    println!(
        "{:<22} {:>8} {:>10} {:>8}",
        "forward variant", "position", "fwd us", "graph"
    );
    for (name, opts) in variants {
        let owned;
        let b = match opts {
            None => gpu,
            Some(o) => {
                owned = CudaBackend::new(gpu.config().clone(), weights, o).expect("CUDA backend");
                &owned
            }
        };
        for pos in [32usize, 256, 1024] {
            let mut st = b.new_sequence(pos + steps + 1).expect("sequence");
            let fill: Vec<u32> = prompt.iter().copied().cycle().take(pos).collect();
            b.forward_device(&mut st, &fill).expect("prefill");
            b.synchronize(&st).expect("sync");
            let mut times = Vec::with_capacity(steps);
            for i in 0..steps {
                let t = Instant::now();
                b.forward_device(&mut st, &[fill[i % fill.len()]])
                    .expect("forward");
                b.synchronize(&st).expect("sync");
                times.push(t.elapsed().as_secs_f64() * 1e6);
            }
            let us = median(times);
            println!("{name:<22} {pos:>8} {us:>10.1} {:>8}", st.graph_active());
            println!(
                "GPU-CHECK fwd variant=\"{name}\" position={pos} fwd_us={us:.1} graph={}",
                st.graph_active()
            );
        }
    }
}
