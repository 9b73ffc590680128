//! Speculative verification against one step, at 151,936 random N(0, 3)
//! logits per row with the default chain (and its `coupled` form), the
//! variants alternated round by round in one run so that a noisy machine
//! weighs on all alike:
//!   - `step`: load one row + the step ([`step::load`] + [`step::run`]);
//!   - `exact_k4_all`: EXACT, 4 drafts all accepted (5 rows: the most
//!     work a K = 4 verification does);
//!   - `exact_k4_none`: EXACT, the first draft rejected (1 row);
//!   - `coupled_k4_all`: COUPLED (default chain ending in `coupled`), all
//!     accepted;
//!   - `rejection_k4_all`: REJECTION, drafter rows = target rows (p = q:
//!     all accepted; 4 drafter rows through the chain too);
//!   - `sparse_step`, `sparse_exact_k4_all`, `sparse_rejection_k4_all`:
//!     the same over sparse rows — each row's top 256 entries and the
//!     log-sum-exp of the rest, what an engine sends instead of the dense
//!     row (`crate::sparse`): the rows a verification over the wire reads.
//!
//! Each timing starts from a copy of the same sequence (the copy is not
//! timed). Reports the median and the 10th–90th percentiles per variant,
//! and each median over `step`'s.
//! Run: cargo bench -p samplerd-sampling --bench verify

use std::hint::black_box;
use std::path::PathBuf;
use std::time::Instant;

use samplerd_sampling::bench::random_logits;
use samplerd_sampling::input::StepLogits;
use samplerd_sampling::sparse::SparseRow;
use samplerd_sampling::step::{self, Logits, NoDeferral, ProbsRequest};
use samplerd_sampling::verify::{self, Draft, Mode};
use samplerd_sampling::{
    ChainSpec, SamplingParams, Sequence, StageRegistry, StageSpec, TokenBuffer,
};

const VOCAB: usize = 151_936;
const K: usize = 4;
const ROUNDS: usize = 60;
/// Entries a sparse row sends (the default chain's top_k = 40 cuts there).
const SPARSE_TOP: usize = 256;

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

fn sequence(reg: &StageRegistry, spec: &ChainSpec) -> Sequence {
    let mut seq = reg
        .build_chain(spec, None)
        .expect("chain builds")
        .new_sequence()
        .unwrap();
    let window: Vec<u32> = (0..64u32)
        .map(|i| i.wrapping_mul(2_654_435_761) % VOCAB as u32)
        .collect();
    seq.accept_history(&window).unwrap();
    seq
}

/// The one-by-one tokens of the rows (the drafts every variant accepts).
fn tokens(seq: &Sequence, rows: &[StepLogits<'_>], seed: u64) -> Vec<u32> {
    let mut seq = seq.try_clone().unwrap();
    let mut buf = TokenBuffer::new();
    rows.iter()
        .enumerate()
        .map(|(j, &l)| {
            let t = one_step(&mut seq, &mut buf, l, seed, j as u64);
            seq.accept(t).unwrap();
            t
        })
        .collect()
}

/// One step over `row` (dense: load + step; sparse: the sparse step).
fn one_step(
    seq: &mut Sequence,
    buf: &mut TokenBuffer,
    row: StepLogits<'_>,
    seed: u64,
    step: u64,
) -> u32 {
    let p = ProbsRequest::default();
    match row {
        StepLogits::Dense(l) => {
            let lse = step::load::<NoDeferral>(buf, l, None).unwrap();
            step::run(seq, buf, l, lse, seed, step, p).unwrap().token_id
        }
        StepLogits::Sparse(r) => {
            samplerd_sampling::sparse::run(seq, buf, r, seed, step, p)
                .unwrap()
                .token_id
        }
    }
}

/// A row's top `m` entries and the log-sum-exp of the rest (f64).
fn sparsify(row: &[f32], m: usize) -> (Vec<u32>, Vec<f32>, f64) {
    let mut order: Vec<u32> = (0..row.len() as u32).collect();
    order.select_nth_unstable_by(m, |&a, &b| row[b as usize].total_cmp(&row[a as usize]));
    let (sent, rest) = order.split_at(m);
    let mut ids = sent.to_vec();
    ids.sort_unstable();
    let values = ids.iter().map(|&i| row[i as usize]).collect();
    let max = rest
        .iter()
        .map(|&i| row[i as usize] as f64)
        .fold(f64::NEG_INFINITY, f64::max);
    let sum: f64 = rest
        .iter()
        .map(|&i| (row[i as usize] as f64 - max).exp())
        .sum();
    (ids, values, max + sum.ln())
}

struct Variant<'a> {
    name: &'static str,
    seq: Sequence,
    mode: Option<Mode>,
    drafts: Vec<u32>,
    rows: &'a [StepLogits<'a>],
    drafter: &'a [StepLogits<'a>],
    us: Vec<f64>,
}

fn percentile(sorted: &[f64], q: f64) -> f64 {
    sorted[((sorted.len() - 1) as f64 * q).round() as usize]
}

fn main() {
    // `cargo bench` passes `--bench`; nothing to parse.
    let reg = StageRegistry::load(&[], &[core_plugin()]).unwrap();
    let seed = 42;
    let data: Vec<Vec<f32>> = (0..=K as u64)
        .map(|j| random_logits(VOCAB, 3.0, 100 + j))
        .collect();
    let rows: Vec<StepLogits<'_>> = data
        .iter()
        .map(|r| StepLogits::Dense(Logits::Floats(r)))
        .collect();
    let parts: Vec<_> = data.iter().map(|r| sparsify(r, SPARSE_TOP)).collect();
    let sparse: Vec<StepLogits<'_>> = parts
        .iter()
        .map(|(ids, values, rest)| {
            StepLogits::Sparse(SparseRow::new(ids, values, *rest, VOCAB).unwrap())
        })
        .collect();
    let default = SamplingParams::default().chain_spec();
    let mut coupled = default.clone();
    coupled.stages.pop();
    coupled.stages.push(StageSpec::new("coupled"));
    let base = sequence(&reg, &default);
    let base_coupled = sequence(&reg, &coupled);
    let all = tokens(&base, &rows, seed);
    let all_coupled = tokens(&base_coupled, &rows, seed);
    let none: Vec<u32> = all[..K].iter().map(|&t| (t + 1) % VOCAB as u32).collect();
    // The sparse rows answer as the dense ones: the same drafts hold.
    assert_eq!(tokens(&base, &sparse, seed), all);
    let v = |name, seq: &Sequence, mode, drafts: &[u32], rows, drafter| Variant {
        name,
        seq: seq.try_clone().unwrap(),
        mode,
        drafts: drafts.to_vec(),
        rows,
        drafter,
        us: Vec::with_capacity(ROUNDS),
    };
    let mut variants = [
        v("step", &base, None, &[], &rows, &[]),
        v(
            "exact_k4_all",
            &base,
            Some(Mode::Exact),
            &all[..K],
            &rows,
            &[],
        ),
        v("exact_k4_none", &base, Some(Mode::Exact), &none, &rows, &[]),
        v(
            "coupled_k4_all",
            &base_coupled,
            Some(Mode::Coupled),
            &all_coupled[..K],
            &rows,
            &[],
        ),
        v(
            "rejection_k4_all",
            &base,
            Some(Mode::Rejection),
            &all[..K],
            &rows,
            &rows[..K],
        ),
        v("sparse_step", &base, None, &[], &sparse, &[]),
        v(
            "sparse_exact_k4_all",
            &base,
            Some(Mode::Exact),
            &all[..K],
            &sparse,
            &[],
        ),
        v(
            "sparse_rejection_k4_all",
            &base,
            Some(Mode::Rejection),
            &all[..K],
            &sparse,
            &sparse[..K],
        ),
    ];
    let (mut buf, mut scratch) = (TokenBuffer::new(), TokenBuffer::new());
    // Round 0 warms the buffers and caches; it is not counted.
    for round in 0..=ROUNDS {
        for var in &mut variants {
            let mut seq = var.seq.try_clone().unwrap();
            let t0 = Instant::now();
            match var.mode {
                None => {
                    black_box(one_step(&mut seq, &mut buf, var.rows[0], seed, 0));
                }
                Some(mode) => {
                    let out = verify::verify(
                        &mut seq,
                        &mut buf,
                        &mut scratch,
                        mode,
                        Draft {
                            tokens: &var.drafts,
                            target: var.rows,
                            drafter: var.drafter,
                        },
                        seed,
                        0,
                        ProbsRequest::default(),
                    )
                    .unwrap();
                    black_box(out);
                }
            }
            let took = t0.elapsed().as_secs_f64() * 1e6;
            if round > 0 {
                var.us.push(took);
            }
        }
    }
    let median_of = |name: &str| {
        let mut s = variants.iter().find(|v| v.name == name).unwrap().us.clone();
        s.sort_by(f64::total_cmp);
        percentile(&s, 0.5)
    };
    // Each variant against the step over the same kind of row.
    let (dense_step, sparse_step) = (median_of("step"), median_of("sparse_step"));
    println!(
        "verify at {VOCAB} logits, default chain, K = {K}, {ROUNDS} alternated rounds \
         (sparse rows: top {SPARSE_TOP} + the rest's log-sum-exp)"
    );
    println!(
        "{:<24} {:>10} {:>10} {:>10} {:>8}",
        "variant", "p50 µs", "p10 µs", "p90 µs", "×step"
    );
    for var in &mut variants {
        var.us.sort_by(f64::total_cmp);
        let p50 = percentile(&var.us, 0.5);
        let step = if var.name.starts_with("sparse_") {
            sparse_step
        } else {
            dense_step
        };
        println!(
            "{:<24} {:>10.1} {:>10.1} {:>10.1} {:>8.2}",
            var.name,
            p50,
            percentile(&var.us, 0.1),
            percentile(&var.us, 0.9),
            p50 / step
        );
    }
}
