//! Contention-robust timings: runs every case many times and prints the
//! minimum and the median per iteration (µs), with the reload cost
//! subtracted, next to the max-scan baseline of the same run. Run with
//! `cargo bench -p samplerd-core-stages --bench min_time`.

use std::hint::black_box;
use std::time::Instant;

use samplerd_core_stages::util;
use samplerd_plugin_sdk::testing::{OwnedTokens, TestRng};

mod common;

fn stats(mut f: impl FnMut(), iters: usize) -> (f64, f64) {
    let mut t: Vec<f64> = (0..iters)
        .map(|_| {
            let s = Instant::now();
            f();
            s.elapsed().as_secs_f64() * 1e6
        })
        .collect();
    t.sort_by(f64::total_cmp);
    (t[0], t[t.len() / 2])
}

fn main() {
    if std::env::args().any(|a| a == "--list") {
        return;
    }
    // optional: a substring filter on the case names (after `--`)
    let filter = std::env::args().skip(1).find(|a| !a.starts_with('-'));
    let iters = 300;
    let logits = common::logits();
    // `MT_CYCLES=<case>`: run only that case 2,000 times (for `perf stat`).
    if let Ok(only) = std::env::var("MT_CYCLES") {
        let mut buf = OwnedTokens::dense(&logits);
        let mut rng = TestRng::seeded(7);
        if only == "max_scan" {
            for _ in 0..2000 {
                black_box(util::max_scan(black_box(&logits)));
            }
            return;
        }
        if only == "reload" {
            for _ in 0..2000 {
                buf.reload(&logits);
                black_box(buf.len());
            }
            return;
        }
        for (name, mut chain) in common::cases(&logits) {
            if name == only {
                for _ in 0..2000 {
                    black_box(common::run_chain(&mut chain, &mut buf, &logits, &mut rng));
                }
            }
        }
        return;
    }
    let (scan_min, scan_med) = stats(
        || {
            black_box(util::max_scan(black_box(&logits)));
        },
        iters * 3,
    );
    let plain = stats(
        || {
            black_box(
                black_box(&logits)
                    .iter()
                    .fold(f32::NEG_INFINITY, |a, &b| a.max(b)),
            );
        },
        iters,
    );
    let mut buf = OwnedTokens::dense(&logits);
    let (reload_min, reload_med) = stats(
        || {
            buf.reload(&logits);
            black_box(buf.len());
        },
        iters * 3,
    );
    println!(
        "{:<34} {:>10} {:>10} {:>9}",
        "case", "min µs", "median µs", "× scan"
    );
    println!(
        "{:<34} {:>10.1} {:>10.1} {:>9}",
        "baseline/max_scan (32 lanes)", scan_min, scan_med, "1.00"
    );
    println!(
        "{:<34} {:>10.1} {:>10.1} {:>9.2}",
        "baseline/plain fold f32::max",
        plain.0,
        plain.1,
        plain.0 / scan_min
    );
    println!(
        "{:<34} {:>10.1} {:>10.1} {:>9}",
        "baseline/reload (subtracted)", reload_min, reload_med, "-"
    );
    let (mn, md) = stats(
        || {
            black_box(samplerd_core_stages::greedy::argmax_dense(black_box(
                &logits,
            )));
        },
        iters,
    );
    println!(
        "{:<34} {:>10.1} {:>10.1} {:>9.2}",
        "no-reload/argmax_dense",
        mn,
        md,
        mn / scan_min
    );
    let mut cm = Vec::with_capacity(logits.len() / 64 + 1);
    let (mn, md) = stats(
        || {
            black_box(util::chunk_maxima(black_box(&logits), &mut cm));
        },
        iters,
    );
    println!(
        "{:<34} {:>10.1} {:>10.1} {:>9.2}",
        "no-reload/chunk_maxima",
        mn,
        md,
        mn / scan_min
    );
    for (name, mut chain) in common::cases(&logits) {
        if filter.as_deref().is_some_and(|f| !name.contains(f)) {
            continue;
        }
        let mut rng = TestRng::seeded(7);
        let (mn, md) = stats(
            || {
                black_box(common::run_chain(&mut chain, &mut buf, &logits, &mut rng));
            },
            iters,
        );
        let (mn, md) = ((mn - reload_min).max(0.0), (md - reload_med).max(0.0));
        println!(
            "{:<34} {:>10.1} {:>10.1} {:>9.2}",
            name,
            mn,
            md,
            mn / scan_min
        );
    }
}
