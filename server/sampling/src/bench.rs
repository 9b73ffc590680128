//! The chain benchmark operators run (`samplerd bench-chain`): the
//! configured chain, loaded exactly as `serve` loads it, over random
//! N(0, 3) logits in-process, reporting median and p99 per stage and in
//! total, beside a single max-scan of the same buffer (the memory floor).

use std::fmt;
use std::time::Instant;

use serde::Serialize;

use crate::buffer::TokenBuffer;
use crate::error::{ChainError, SampleError};
use crate::logits;
use crate::registry::StageRegistry;
use crate::rng::StepRng;
use crate::spec::ChainSpec;

/// Timing of one stage (µs).
#[derive(Clone, Debug, Serialize)]
pub struct StageTiming {
    pub name: String,
    pub us_p50: f64,
    pub us_p99: f64,
}

/// What `run` measured.
#[derive(Clone, Debug, Serialize)]
pub struct BenchReport {
    pub chain: String,
    pub vocab: usize,
    pub iterations: usize,
    pub total_us_p50: f64,
    pub total_us_p99: f64,
    pub max_scan_us_p50: f64,
    pub ratio_to_max_scan: f64,
    pub stages: Vec<StageTiming>,
}

impl fmt::Display for BenchReport {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        writeln!(f, "chain: {}", self.chain)?;
        writeln!(f, "vocab: {}  iterations: {}", self.vocab, self.iterations)?;
        writeln!(f, "{:<16} {:>10} {:>10}", "stage", "p50 µs", "p99 µs")?;
        for s in &self.stages {
            writeln!(f, "{:<16} {:>10.2} {:>10.2}", s.name, s.us_p50, s.us_p99)?;
        }
        writeln!(
            f,
            "{:<16} {:>10.2} {:>10.2}",
            "total", self.total_us_p50, self.total_us_p99
        )?;
        write!(
            f,
            "max-scan floor   {:>10.2}   (total / floor = {:.2}x)",
            self.max_scan_us_p50, self.ratio_to_max_scan
        )
    }
}

/// Why the benchmark could not run.
#[derive(Debug, thiserror::Error)]
pub enum BenchError {
    #[error(transparent)]
    Chain(#[from] ChainError),
    #[error(transparent)]
    Sample(#[from] SampleError),
}

/// `n` logits drawn from N(0, std²) (Box–Muller over the seeded stream).
pub fn random_logits(n: usize, std: f32, seed: u64) -> Vec<f32> {
    let mut rng = StepRng::new(seed, 0);
    let mut out = Vec::with_capacity(n + 1);
    while out.len() < n {
        let u1 = rng.uniform_f64().max(f64::MIN_POSITIVE);
        let u2 = rng.uniform_f64();
        let r = (-2.0 * u1.ln()).sqrt();
        let t = std::f64::consts::TAU * u2;
        out.push((r * t.cos()) as f32 * std);
        out.push((r * t.sin()) as f32 * std);
    }
    out.truncate(n);
    out
}

fn percentile(sorted: &[f64], q: f64) -> f64 {
    if sorted.is_empty() {
        return 0.0;
    }
    let i = ((sorted.len() - 1) as f64 * q).round() as usize;
    sorted[i]
}

/// Runs `spec` `iterations` times over fresh random logits of `vocab`
/// entries (a sequence with a 64-token window of recent ids, as in decode).
pub fn run(
    registry: &StageRegistry,
    spec: &ChainSpec,
    vocab: usize,
    iterations: usize,
) -> Result<BenchReport, BenchError> {
    let chain = registry.build_chain(spec, None)?;
    let mut seq = chain.new_sequence()?;
    let window: Vec<u32> = (0..64u32)
        .map(|i| i.wrapping_mul(2_654_435_761) % vocab as u32)
        .collect();
    seq.accept_history(&window)?;
    let inputs: Vec<Vec<f32>> = (0..8)
        .map(|i| random_logits(vocab, 3.0, 1000 + i))
        .collect();
    let n_stages = chain.stage_names().len();
    let iterations = iterations.max(1);
    let mut buf = TokenBuffer::new();
    let mut totals = Vec::with_capacity(iterations);
    let mut per_stage: Vec<Vec<f64>> = vec![Vec::with_capacity(iterations); n_stages];
    let mut scans = Vec::with_capacity(iterations);
    let mut ns = vec![0u64; n_stages];
    let mut sink = 0.0f32;
    for it in 0..iterations {
        let input = &inputs[it % inputs.len()];
        buf.load(input).map_err(SampleError::from)?;
        let t = Instant::now();
        sink += logits::max(buf.dense());
        scans.push(t.elapsed().as_secs_f64() * 1e6);
        ns.iter_mut().for_each(|v| *v = 0);
        let t = Instant::now();
        let tok = seq.sample_timed(&mut buf, 42, it as u64, &mut ns)?;
        totals.push(t.elapsed().as_secs_f64() * 1e6);
        sink += tok.token_id as f32;
        for (v, &n) in per_stage.iter_mut().zip(&ns) {
            v.push(n as f64 / 1e3);
        }
    }
    std::hint::black_box(sink);
    let sorted = |mut v: Vec<f64>| {
        v.sort_by(f64::total_cmp);
        v
    };
    let totals = sorted(totals);
    let scans = sorted(scans);
    let stages = chain
        .stage_names()
        .iter()
        .zip(per_stage)
        .map(|(name, v)| {
            let v = sorted(v);
            StageTiming {
                name: name.to_string(),
                us_p50: percentile(&v, 0.5),
                us_p99: percentile(&v, 0.99),
            }
        })
        .collect();
    let total_p50 = percentile(&totals, 0.5);
    let scan_p50 = percentile(&scans, 0.5);
    Ok(BenchReport {
        chain: chain.describe(),
        vocab,
        iterations,
        total_us_p50: total_p50,
        total_us_p99: percentile(&totals, 0.99),
        max_scan_us_p50: scan_p50,
        ratio_to_max_scan: if scan_p50 > 0.0 {
            total_p50 / scan_p50
        } else {
            0.0
        },
        stages,
    })
}
