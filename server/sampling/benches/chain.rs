//! Criterion benchmark of the sampler chain, side by side in one run, on
//! 151,936 and 49,152 random N(0, 3) logits:
//!   (a) `max_scan`: one max over the buffer — the memory floor;
//!   (b) `seed_port`: a straightforward, naive sampling pipeline
//!       (HashMap penalties, copy + select_nth top-k, survivor top-p,
//!       full-vocabulary temperature softmax and draw) — the baseline;
//!   (c) `default_chain`: our default chain through the plugin ABI, as the
//!       server runs it (and `load+default_chain` with the logits copy);
//!   (d) `greedy` (penalties + greedy) and `top_p_only` (top-k off, top-p
//!       0.95 over the whole vocabulary), plus each stage alone;
//!   (e) `sparse_1024/default_chain` and `sparse_1024/greedy`: the same
//!       steps from a sparse row of the top 1,024 (proof, fill, chain).
//! Run: cargo bench -p samplerd-sampling --bench chain

use std::collections::HashMap;
use std::hint::black_box;
use std::path::PathBuf;

use criterion::{BenchmarkId, Criterion, criterion_group, criterion_main};
use samplerd_sampling::bench::random_logits;
use samplerd_sampling::sparse;
use samplerd_sampling::step::ProbsRequest;
use samplerd_sampling::{ChainSpec, SamplingParams, StageRegistry, StageSpec, TokenBuffer, logits};

fn core_plugin() -> PathBuf {
    let exe = std::env::current_exe().unwrap();
    let dir = exe.parent().unwrap().parent().unwrap();
    let name = format!(
        "libsamplerd_core_stages.{}",
        std::env::consts::DLL_EXTENSION
    );
    [dir.join("deps").join(&name), dir.join(&name)]
        .into_iter()
        .find(|p| p.exists())
        .expect("core plugin built (cargo bench builds dev-dependencies)")
}

fn window(vocab: usize) -> Vec<u32> {
    (0..64u32)
        .map(|i| (i.wrapping_mul(2_654_435_761)) % vocab as u32)
        .collect()
}

/// A naive pipeline, the benchmark's baseline: penalties through a HashMap
/// rebuilt every step, top-k by copy + select_nth (ties kept), top-p over the
/// survivors with an f64 sum cut at `> p`, softmax and draw over the whole
/// vocabulary.
mod seed_port {
    use super::*;

    pub fn apply_penalties(logits: &mut [f32], prev: &[u32], repeat: f32) {
        let mut counts: HashMap<u32, u32> = HashMap::new();
        for &t in prev {
            *counts.entry(t).or_insert(0) += 1;
        }
        for &t in counts.keys() {
            let idx = t as usize;
            if idx >= logits.len() {
                continue;
            }
            let v = logits[idx];
            logits[idx] = if v <= 0.0 { v * repeat } else { v / repeat };
        }
    }

    pub fn apply_top_k(logits: &mut [f32], k: usize) {
        if k == 0 || k >= logits.len() {
            return;
        }
        let mut sorted = logits.to_vec();
        sorted.select_nth_unstable_by(k - 1, |a, b| b.total_cmp(a));
        let threshold = sorted[k - 1];
        for v in logits.iter_mut() {
            if *v < threshold {
                *v = f32::NEG_INFINITY;
            }
        }
    }

    pub fn apply_top_p(logits: &mut [f32], p: f32) {
        let survivors: Vec<(usize, f32)> = logits
            .iter()
            .enumerate()
            .filter(|(_, v)| **v > f32::NEG_INFINITY)
            .map(|(i, &v)| (i, v))
            .collect();
        let max_val = survivors
            .iter()
            .fold(f32::NEG_INFINITY, |a, &(_, v)| a.max(v));
        let sum: f64 = survivors
            .iter()
            .map(|&(_, v)| ((v - max_val) as f64).exp())
            .sum();
        let mut cand: Vec<(usize, f32)> = survivors
            .iter()
            .map(|&(i, v)| (i, (v - max_val).exp() / sum as f32))
            .collect();
        cand.sort_by(|a, b| b.1.partial_cmp(&a.1).unwrap_or(std::cmp::Ordering::Equal));
        let mut cumulative = 0.0f32;
        let mut keep = cand.len();
        for (i, &(_, prob)) in cand.iter().enumerate() {
            cumulative += prob;
            if cumulative > p {
                keep = i + 1;
                break;
            }
        }
        for &(idx, _) in &cand[keep..] {
            logits[idx] = f32::NEG_INFINITY;
        }
    }

    pub fn sample_temperature(logits: &mut [f32], temp: f32, r: f32) -> u32 {
        let inv = 1.0 / temp;
        for v in logits.iter_mut() {
            *v *= inv;
        }
        let max_val = logits.iter().fold(f32::NEG_INFINITY, |a, &b| a.max(b));
        let mut sum = 0.0f64;
        for v in logits.iter_mut() {
            *v = if *v > f32::NEG_INFINITY {
                (*v - max_val).exp()
            } else {
                0.0
            };
            sum += *v as f64;
        }
        for v in logits.iter_mut() {
            *v /= sum as f32;
        }
        let mut cumulative = 0.0f32;
        for (i, &v) in logits.iter().enumerate() {
            if v <= 0.0 {
                continue;
            }
            cumulative += v;
            if r <= cumulative {
                return i as u32;
            }
        }
        (logits.len() - 1) as u32
    }

    pub fn pipeline(logits: &mut [f32], prev: &[u32]) -> u32 {
        apply_penalties(logits, prev, 1.1);
        apply_top_k(logits, 40);
        apply_top_p(logits, 0.95);
        sample_temperature(logits, 0.8, 0.5)
    }
}

/// The top `n` of `x` (ids ascending, as a client sends them) and the
/// log-sum-exp of the rest in f64.
fn top_of(x: &[f32], n: usize) -> (Vec<u32>, Vec<f32>, f64) {
    let mut order: Vec<u32> = (0..x.len() as u32).collect();
    order.select_nth_unstable_by(n - 1, |&a, &b| x[b as usize].total_cmp(&x[a as usize]));
    let mut ids = order[..n].to_vec();
    ids.sort_unstable();
    let rest: Vec<f64> = order[n..]
        .iter()
        .map(|&i| f64::from(x[i as usize]))
        .collect();
    let max = rest.iter().copied().fold(f64::NEG_INFINITY, f64::max);
    let lse = max + rest.iter().map(|r| (r - max).exp()).sum::<f64>().ln();
    let values = ids.iter().map(|&i| x[i as usize]).collect();
    (ids, values, lse)
}

fn chain_of(reg: &StageRegistry, spec: &ChainSpec) -> samplerd_sampling::Chain {
    reg.build_chain(spec, None).expect("chain builds")
}

fn bench_chain(c: &mut Criterion) {
    let reg = StageRegistry::load(&[], &[core_plugin()]).unwrap();
    let defaults = SamplingParams::default();
    let greedy = SamplingParams {
        temperature: 0.0,
        ..Default::default()
    };
    let top_p_only = SamplingParams {
        top_k: 0,
        ..Default::default()
    };
    let configs: Vec<(&str, ChainSpec)> = vec![
        ("default_chain", defaults.chain_spec()),
        ("greedy", greedy.chain_spec()),
        ("top_p_only", top_p_only.chain_spec()),
        (
            "stage/penalties",
            ChainSpec {
                stages: vec![
                    StageSpec::new("penalties").number("repeat_penalty", 1.1),
                    StageSpec::new("greedy"),
                ],
            },
        ),
        (
            "stage/top_k",
            ChainSpec {
                stages: vec![
                    StageSpec::new("top_k").number("k", 40.0),
                    StageSpec::new("greedy"),
                ],
            },
        ),
        (
            "stage/temperature",
            ChainSpec {
                stages: vec![
                    StageSpec::new("temperature").number("t", 0.8),
                    StageSpec::new("greedy"),
                ],
            },
        ),
        (
            "stage/greedy",
            ChainSpec {
                stages: vec![StageSpec::new("greedy")],
            },
        ),
        (
            "stage/dist",
            ChainSpec {
                stages: vec![StageSpec::new("dist")],
            },
        ),
    ];
    for vocab in [151_936usize, 49_152] {
        let mut group = c.benchmark_group(format!("vocab_{vocab}"));
        let input = random_logits(vocab, 3.0, 7);
        let prev = window(vocab);

        group.bench_function("max_scan", |b| {
            b.iter(|| black_box(logits::max(black_box(&input))))
        });

        let mut scratch = input.clone();
        group.bench_function("seed_port", |b| {
            b.iter(|| {
                scratch.copy_from_slice(&input);
                black_box(seed_port::pipeline(&mut scratch, &prev))
            })
        });

        let mut buf = TokenBuffer::new();
        for (name, spec) in &configs {
            let chain = chain_of(&reg, spec);
            let mut seq = chain.new_sequence().unwrap();
            seq.accept_history(&prev).unwrap();
            buf.load(&input).unwrap();
            let mut step = 0u64;
            group.bench_function(BenchmarkId::from_parameter(name), |b| {
                b.iter(|| {
                    step += 1;
                    black_box(seq.sample(&mut buf, 42, step).unwrap())
                })
            });
        }
        let chain = chain_of(&reg, &configs[0].1);
        let mut seq = chain.new_sequence().unwrap();
        seq.accept_history(&prev).unwrap();
        let mut step = 0u64;
        group.bench_function("load+default_chain", |b| {
            b.iter(|| {
                step += 1;
                buf.load(&input).unwrap();
                black_box(seq.sample(&mut buf, 42, step).unwrap())
            })
        });
        // The same step from a sparse row (the top 1,024 and the rest's
        // log-sum-exp): the proof, the candidate fill and the chain over
        // the sent entries — what a sparse row costs the server per row.
        let (ids, values, rest) = top_of(&input, 1024);
        let row = sparse::SparseRow::new(&ids, &values, rest, vocab).unwrap();
        for (name, spec) in [&configs[0], &configs[1]] {
            let chain = chain_of(&reg, spec);
            let mut seq = chain.new_sequence().unwrap();
            seq.accept_history(&prev).unwrap();
            group.bench_function(format!("sparse_1024/{name}"), |b| {
                b.iter(|| {
                    step += 1;
                    black_box(
                        sparse::run(&mut seq, &mut buf, row, 42, step, ProbsRequest::default())
                            .unwrap(),
                    )
                })
            });
        }
        group.finish();
    }
}

criterion_group! {
    name = benches;
    config = Criterion::default().sample_size(60).measurement_time(std::time::Duration::from_secs(2)).warm_up_time(std::time::Duration::from_millis(500));
    targets = bench_chain
}
criterion_main!(benches);
