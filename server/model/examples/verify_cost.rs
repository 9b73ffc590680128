//! What a speculative verify pass costs: one `Model::decode_rows` pass of
//! K + 1 tokens against K + 1 one-token decode steps, and against one
//! decode step, for K = 0, 1, 2, 4, 8, 16 drafts, at the end of a chat
//! prompt (docs/PERFORMANCE.md, "Speculative decoding"). The two ways
//! alternate in every repetition; medians in ms per pass.
//!
//! ```text
//! cargo run --release -p samplerd-model --example verify_cost -- [MODEL] [--threads N] [--reps N]
//! ```

use samplerd_model::{ChatMessage, Model, ModelOptions};
use std::time::Instant;

fn median(v: &mut [f64]) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let mut args = std::env::args().skip(1);
    let mut path = String::from("models/SmolLM2-135M-Instruct.Q4_1.gguf");
    let (mut threads, mut reps) = (2usize, 15usize);
    while let Some(a) = args.next() {
        match a.as_str() {
            "--threads" => threads = args.next().ok_or("--threads N")?.parse()?,
            "--reps" => reps = args.next().ok_or("--reps N")?.parse()?,
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
    let prompt = model.render_chat(&[ChatMessage::new(
        "user",
        "Copy this text exactly: the lighthouse at Point Reyes was built in 1870 and stands on a \
         rocky headland three hundred feet above the Pacific Ocean.",
    )])?;
    let ids = model.tokenizer().encode(&prompt, true, true)?;
    let drafts: Vec<u32> = model.tokenizer().encode(
        " the lighthouse at Point Reyes was built in 1870 and stands on a rocky headland three",
        false,
        false,
    )?;
    let mut s = model.new_session()?;
    s.prefill(&ids)?;
    let p = s.position();
    println!("| K | one pass of K+1 rows (ms) | K+1 decode steps (ms) | pass / one step |");
    println!("|---:|---:|---:|---:|");
    for k in [0usize, 1, 2, 4, 8, 16] {
        let toks = &drafts[..=k.min(drafts.len() - 1)];
        let (mut rows, mut steps) = (Vec::new(), Vec::new());
        for _ in 0..reps {
            s.truncate(p);
            let t = Instant::now();
            model.decode_rows(&mut [&mut s], &[toks])?;
            rows.push(t.elapsed().as_secs_f64() * 1e3);
            s.truncate(p);
            let t = Instant::now();
            for &tok in toks {
                s.decode(tok)?;
            }
            steps.push(t.elapsed().as_secs_f64() * 1e3);
        }
        let (r, st) = (median(&mut rows), median(&mut steps));
        println!(
            "| {} | {r:.2} | {st:.2} | {:.2} |",
            toks.len() - 1,
            r / (st / toks.len() as f64)
        );
    }
    Ok(())
}
