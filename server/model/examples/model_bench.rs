//! One-stream throughput: prefill tok/s and greedy decode tok/s (128 new
//! tokens), median of several runs; with `--batch B` (B > 1) each run also
//! decodes B sequences together (`Model::decode_batch`) and reports their
//! aggregate tok/s, measured right after the one-stream run of the same
//! iteration so the ratio is side by side.
//!
//! ```text
//! cargo run --release -p samplerd-model --example model_bench -- [MODEL] [--threads N] [--runs N] [--new N] [--batch B] [--repeat R]
//! ```
//! `--repeat R` writes the user message R times (R = 17: a 557-token
//! prompt, for prefill).
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
    let (mut threads, mut runs, mut new, mut batch, mut repeat) =
        (2usize, 5usize, 128usize, 1usize, 1usize);
    while let Some(a) = args.next() {
        match a.as_str() {
            "--threads" => threads = args.next().ok_or("--threads N")?.parse()?,
            "--runs" => runs = args.next().ok_or("--runs N")?.parse()?,
            "--new" => new = args.next().ok_or("--new N")?.parse()?,
            "--batch" => batch = args.next().ok_or("--batch B")?.parse()?,
            "--repeat" => repeat = args.next().ok_or("--repeat R")?.parse()?,
            p => path = p.to_string(),
        }
    }
    let model = Model::load(
        path.as_ref(),
        &ModelOptions {
            n_threads: threads,
            n_ctx: 1024,
            ..Default::default()
        },
    )?;
    let user = vec![PROMPT; repeat].join(" ");
    let prompt = model.render_chat(&[ChatMessage::new("user", user)])?;
    let ids = model.tokenizer().encode(&prompt, true, true)?;
    let (mut pre, mut dec, mut agg) = (Vec::new(), Vec::new(), Vec::new());
    let mut generated = 0;
    for _ in 0..runs {
        let mut s = model.new_session()?;
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
        if batch > 1 {
            agg.push(batched_decode(&model, &ids, batch, new)?);
        }
    }
    println!(
        "{}",
        serde_json::json!({
            "engine": "samplerd-model", "backend": model.backend_name(), "threads": threads,
            "weight_bytes": model.weight_bytes(), "weight_formats": model.weight_formats(),
            "prompt_tokens": ids.len(), "new_tokens": generated, "runs": runs,
            "prefill_tok_s": median(&mut pre), "decode_tok_s": median(&mut dec),
            "prefill_all": pre, "decode_all": dec,
            "batch": batch,
            "batch_decode_tok_s": (!agg.is_empty()).then(|| median(&mut agg.clone())),
            "batch_over_single": (!agg.is_empty()).then(|| {
                let mut r: Vec<f64> = agg.iter().zip(&dec).map(|(b, s)| b / s).collect();
                median(&mut r)
            }),
            "batch_all": agg,
        })
    );
    Ok(())
}

/// Aggregate greedy decode tok/s of `batch` sequences stepped together.
fn batched_decode(
    model: &Model,
    ids: &[u32],
    batch: usize,
    new: usize,
) -> Result<f64, Box<dyn std::error::Error>> {
    let mut sessions = Vec::with_capacity(batch);
    for _ in 0..batch {
        let mut s = model.new_session()?;
        s.prefill(ids)?;
        sessions.push(s);
    }
    let argmax = |l: &[f32]| {
        l.iter()
            .enumerate()
            .fold(0, |b, (i, &x)| if x > l[b] { i } else { b }) as u32
    };
    let t = Instant::now();
    for _ in 0..new {
        let toks: Vec<u32> = sessions.iter().map(|s| argmax(s.logits())).collect();
        let mut refs: Vec<&mut _> = sessions.iter_mut().collect();
        model.decode_batch(&mut refs, &toks)?;
    }
    Ok((batch * new) as f64 / t.elapsed().as_secs_f64())
}
