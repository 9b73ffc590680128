//! Per-stage and chain timings (criterion) on 151,936 N(0, 3) logits (the
//! Qwen vocabulary), against a vectorised max-scan over the same buffer.
//! Every timed iteration reloads the 608 KB of logits first (stages modify
//! them); `baseline/reload` measures that copy alone so it can be
//! subtracted. `benches/min_time.rs` prints contention-robust minima.

use std::hint::black_box;

use criterion::{Criterion, criterion_group, criterion_main};
use samplerd_core_stages::util;
use samplerd_plugin_sdk::testing::{OwnedTokens, TestRng};

mod common;

fn benches(c: &mut Criterion) {
    let logits = common::logits();
    c.bench_function("baseline/max_scan", |b| {
        b.iter(|| util::max_scan(black_box(&logits)))
    });
    let mut buf = OwnedTokens::dense(&logits);
    c.bench_function("baseline/reload", |b| {
        b.iter(|| {
            buf.reload(&logits);
            black_box(buf.len())
        })
    });
    for (name, mut chain) in common::cases(&logits) {
        let mut rng = TestRng::seeded(7);
        c.bench_function(name, |b| {
            b.iter(|| black_box(common::run_chain(&mut chain, &mut buf, &logits, &mut rng)))
        });
    }
}

criterion_group! {
    name = stages;
    config = Criterion::default()
        .warm_up_time(std::time::Duration::from_millis(300))
        .measurement_time(std::time::Duration::from_millis(1500))
        .sample_size(40);
    targets = benches
}
criterion_main!(stages);
