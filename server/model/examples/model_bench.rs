//! One-stream throughput: prefill tok/s and greedy decode tok/s (128 new
//! tokens), median of several runs.
//!
//! ```text
//! cargo run --release -p samplerd-model --example model_bench -- [MODEL] [--threads N] [--runs N] [--new N]
//! ```
//! Prints one JSON object; `scripts/bench_llamacpp.py` measures llama.cpp on
//! the same prompt.

use samplerd_model::{ChatMessage, Model, ModelOptions};
use std::time::Instant;

/// The benchmark prompt (shared with scripts/bench_llamacpp.py).
const PROMPT: &str = "Write a short story about a lighthouse keeper who finds a message in a bottle. Describe the sea, the weather and the keeper's daily routine in detail.";

fn median(v: &mut [f64]) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let mut args = std::env::args().skip(1);
    let mut path = String::from("models/SmolLM2-135M-Instruct.Q4_1.gguf");
    let (mut threads, mut runs, mut new) = (2usize, 5usize, 128usize);
    while let Some(a) = args.next() {
        match a.as_str() {
            "--threads" => threads = args.next().ok_or("--threads N")?.parse()?,
            "--runs" => runs = args.next().ok_or("--runs N")?.parse()?,
            "--new" => new = args.next().ok_or("--new N")?.parse()?,
            p => path = p.to_string(),
        }
    }
    let model = Model::load(
        path.as_ref(),
        &ModelOptions {
            n_threads: threads,
            n_ctx: 1024,
        },
    )?;
    let prompt = model.render_chat(&[ChatMessage::new("user", PROMPT)])?;
    let ids = model.tokenizer().encode(&prompt, true, true)?;
    let (mut pre, mut dec) = (Vec::new(), Vec::new());
    let mut generated = 0;
    for _ in 0..runs {
        let mut s = model.new_session();
        let t0 = Instant::now();
        let mut logits = s.prefill(&ids)?;
        pre.push(ids.len() as f64 / t0.elapsed().as_secs_f64());
        let t1 = Instant::now();
        let mut n = 0;
        while n < new {
            let next = logits
                .iter()
                .enumerate()
                .fold(0, |b, (i, &x)| if x > logits[b] { i } else { b })
                as u32;
            logits = s.decode(next)?; // no EOG stop: fixed work per run
            n += 1;
        }
        dec.push(n as f64 / t1.elapsed().as_secs_f64());
        generated = n;
    }
    println!(
        "{}",
        serde_json::json!({
            "engine": "samplerd-model", "backend": model.backend_name(), "threads": threads,
            "prompt_tokens": ids.len(), "new_tokens": generated, "runs": runs,
            "prefill_tok_s": median(&mut pre), "decode_tok_s": median(&mut dec),
            "prefill_all": pre, "decode_all": dec,
        })
    );
    Ok(())
}
