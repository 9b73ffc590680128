//! What compiling each hostile grammar shape costs: the stack it needs
//! (found by compiling it in a child process on threads of decreasing
//! stack size: an overflow kills only the child) and the time it takes.
//! The figures in docs/RELIABILITY.md ("Constraint compilation") come
//! from this.
//!
//! cargo run --release -p samplerd --example constraint_stack -- stack [SHAPE N]…
//! cargo run --release -p samplerd --example constraint_stack -- time SHAPE N…
//! cargo run --release -p samplerd --example constraint_stack -- measure KIND FILE…
//!
//! `stack` with no arguments measures every shape of
//! `tests/hostile/mod.rs` at two sizes and prints the stack per level.
//! The constraint plugin is the one cargo built beside this example.

#[path = "../tests/hostile/mod.rs"]
mod hostile;

use std::path::PathBuf;
use std::process::Command;
use std::sync::Arc;
use std::time::Instant;

use samplerd_sampling::vocab::token_attr;
use samplerd_sampling::{ParamValue, StageRegistry, StageSpec, Vocabulary};

fn plugin() -> PathBuf {
    let exe = std::env::current_exe().expect("exe path");
    let profile = exe.parent().and_then(|p| p.parent()).expect("profile dir");
    [
        profile.join("libsamplerd_constraint_stage.so"),
        profile.join("deps/libsamplerd_constraint_stage.so"),
    ]
    .into_iter()
    .find(|p| p.is_file())
    .expect("the constraint plugin is built (cargo build --release -p samplerd-constraint-stage)")
}

/// 256 byte tokens and an end-of-generation token.
fn vocab() -> Arc<Vocabulary> {
    let mut tokens: Vec<Vec<u8>> = (0u8..=255).map(|b| vec![b]).collect();
    let mut attrs = vec![token_attr::NORMAL; 256];
    tokens.push(b"<eos>".to_vec());
    attrs.push(token_attr::EOG | token_attr::CONTROL);
    Arc::new(Vocabulary::new(tokens, attrs))
}

/// Compiles `shape` at `n`: the outcome and the seconds it took.
fn compile(
    registry: &StageRegistry,
    vocab: &Arc<Vocabulary>,
    shape: &str,
    n: usize,
) -> (String, f64) {
    let shape = hostile::SHAPES
        .iter()
        .find(|s| **s == shape)
        .expect("a known shape");
    let case = hostile::generate(shape, n);
    let mut spec = StageSpec::new("constraint").with(case.kind, ParamValue::String(case.text));
    // `PROBE_FUEL`: the stage's `max_fuel` (llguidance's lexer budget).
    if let Some(fuel) = std::env::var("PROBE_FUEL")
        .ok()
        .and_then(|f| f.parse().ok())
    {
        spec = spec.number("max_fuel", fuel);
    }
    let t = Instant::now();
    let r = registry.build_stage(&spec, Some(Arc::clone(vocab)));
    let secs = t.elapsed().as_secs_f64();
    let outcome = match r {
        Ok(_) => "compiled".to_string(),
        Err(e) => {
            let e = e.to_string();
            format!("refused: {}", e.chars().take(100).collect::<String>())
        }
    };
    (outcome, secs)
}

/// Child: compile on a thread of `kib` KiB of stack; exit 0 when it returns.
fn child(shape: &str, n: usize, kib: usize) {
    let registry = StageRegistry::load(&[], &[plugin()]).expect("plugin loads");
    let vocab = vocab();
    let shape = shape.to_string();
    let out = std::thread::Builder::new()
        .stack_size(kib << 10)
        .spawn(move || compile(&registry, &vocab, &shape, n))
        .expect("spawn")
        .join()
        .expect("no panic");
    println!("{}", out.0);
}

/// Whether `shape` at `n` compiles (or is refused) on `kib` KiB of stack.
fn fits(shape: &str, n: usize, kib: usize) -> bool {
    Command::new(std::env::current_exe().unwrap())
        .args(["child", shape, &n.to_string(), &kib.to_string()])
        .output()
        .expect("run child")
        .status
        .success()
}

/// The least stack (KiB, to 16 KiB) `shape` at `n` needs, up to 1 GiB.
fn least_stack(shape: &str, n: usize) -> Option<usize> {
    let (mut lo, mut hi) = (16usize, 1 << 20);
    if !fits(shape, n, hi) {
        return None;
    }
    while hi - lo > 16 {
        let mid = (lo + hi) / 2;
        if fits(shape, n, mid) {
            hi = mid;
        } else {
            lo = mid;
        }
    }
    Some(hi)
}

fn main() {
    let args: Vec<String> = std::env::args().skip(1).collect();
    match args.first().map(String::as_str) {
        Some("child") => child(&args[1], args[2].parse().unwrap(), args[3].parse().unwrap()),
        Some("time") => {
            let registry = StageRegistry::load(&[], &[plugin()]).expect("plugin loads");
            let vocab = vocab();
            let shape = &args[1];
            for n in &args[2..] {
                let n: usize = n.parse().unwrap();
                // A fresh thread with room for any shape: this measures time.
                let (r, v, s) = (&registry, &vocab, shape.as_str());
                let (outcome, secs) = std::thread::scope(|sc| {
                    std::thread::Builder::new()
                        .stack_size(1 << 30)
                        .spawn_scoped(sc, move || compile(r, v, s, n))
                        .unwrap()
                        .join()
                        .unwrap()
                });
                println!("{shape} n={n}: {secs:.3} s, {outcome}");
            }
        }
        Some("stack") => {
            let pairs: Vec<(String, usize)> = if args.len() > 1 {
                args[1..]
                    .chunks(2)
                    .map(|c| (c[0].clone(), c[1].parse().unwrap()))
                    .collect()
            } else {
                hostile::SHAPES
                    .iter()
                    .flat_map(|s| [(s.to_string(), 200), (s.to_string(), 400)])
                    .collect()
            };
            for (shape, n) in pairs {
                match least_stack(&shape, n) {
                    Some(kib) => println!("{shape} n={n}: {kib} KiB ({} B/level)", (kib << 10) / n),
                    None => println!("{shape} n={n}: more than 1 GiB"),
                }
            }
        }
        Some("measure") => {
            // The server's measure of grammar files: KIND FILE…
            for f in &args[2..] {
                let text = std::fs::read_to_string(f).expect("readable");
                let s = samplerd::service::constraint::measure::measure(&args[1], &text);
                println!("{f}: depth {}, rules {}", s.depth, s.rules);
            }
        }
        _ => eprintln!(
            "usage: constraint_stack stack [SHAPE N]… | time SHAPE N… | measure KIND FILE…"
        ),
    }
}
