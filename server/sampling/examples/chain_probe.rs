//! Runs our chain on cases described as JSON lines and prints, for each, the
//! surviving candidates with their post-chain probabilities — the other half
//! of the llama.cpp parity script (`tests/parity/test_sampler_parity.py`).
//!
//! Usage: chain_probe PLUGIN.so LOGITS.f32 < cases.jsonl > results.jsonl
//! Each case: {"offset": <index into LOGITS.f32>, "vocab": N,
//!             "params": {<SamplingParams fields>}, "window": [ids]}

use std::io::{BufRead, Write};

use samplerd_sampling::{SamplingParams, StageRegistry, TokenBuffer};
use serde::Deserialize;

#[derive(Deserialize)]
struct Case {
    offset: usize,
    vocab: usize,
    params: SamplingParams,
    #[serde(default)]
    window: Vec<u32>,
    #[serde(default)]
    seed: u64,
}

fn main() {
    let args: Vec<String> = std::env::args().collect();
    if args.len() != 3 {
        eprintln!("usage: chain_probe PLUGIN.so LOGITS.f32 < cases.jsonl");
        std::process::exit(2);
    }
    let reg = StageRegistry::load(&[], &[args[1].clone().into()]).expect("load plugin");
    let bytes = std::fs::read(&args[2]).expect("read logits");
    let all: Vec<f32> = bytes
        .chunks_exact(4)
        .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
        .collect();
    let mut buf = TokenBuffer::new();
    let stdout = std::io::stdout();
    let mut out = stdout.lock();
    for line in std::io::stdin().lock().lines() {
        let line = line.expect("read stdin");
        if line.trim().is_empty() {
            continue;
        }
        let case: Case = serde_json::from_str(&line).expect("parse case");
        let result = (|| -> Result<serde_json::Value, String> {
            let chain = reg
                .build_typed(&case.params, None)
                .map_err(|e| e.to_string())?;
            let mut seq = chain.new_sequence().map_err(|e| e.to_string())?;
            seq.accept_history(&case.window)
                .map_err(|e| e.to_string())?;
            buf.load(&all[case.offset..case.offset + case.vocab])
                .map_err(|e| e.to_string())?;
            let tok = seq
                .sample(&mut buf, case.seed, 0)
                .map_err(|e| e.to_string())?;
            let (mut dist, _) = buf.distribution(usize::MAX, tok.token_id);
            dist.sort_by_key(|&(id, _)| id);
            Ok(serde_json::json!({
                "chain": chain.describe(),
                "token": tok.token_id,
                "survivors": dist,
            }))
        })();
        let v = match result {
            Ok(v) => v,
            Err(e) => serde_json::json!({ "error": e }),
        };
        writeln!(out, "{v}").unwrap();
    }
}
