//! Probe binary for the parity scripts (`tests/*.py`) and quick checks.
//!
//! ```text
//! model_probe tokenize MODEL            stdin: JSON array of strings
//!     → {"ids": [[…], …]}               (add_bos=false, parse_special=true)
//! model_probe detokenize MODEL          stdin: JSON array of id arrays → {"bytes": [[…]…]}
//! model_probe greedy MODEL N            stdin: {"messages": [{role, content}…]} or {"prompt": "…"}
//!     → {"prompt", "prompt_ids", "tokens", "text", "top": [[id, logit]…] (first step),
//!        "logprobs": [log-softmax of each chosen token (f64)]}
//! model_probe logits MODEL             stdin: JSON id array → {"logits": […]} (last position)
//! model_probe info MODEL                → config and backend
//! model_probe kdot                      stdin: {"kind": "q4_K"|"q5_K"|"q6_K"|"q5_0"|"q5_1", "cols": N,
//!     "rows": [{"raw": hex of one GGUF row, "x": [f32 × N]}…]} → {"dot": [f32 bits…]}
//!     (one weight row times `x`, quantised as the forward pass does; no model)
//! ```
//! Options via env: SAMPLERD_THREADS (default 2), SAMPLERD_NUMERICS
//! (`native`, the default: the order of this machine's llama.cpp build; or
//! `portable`).

use samplerd_model::{ChatMessage, Model, ModelOptions, Utf8Streamer};
use serde_json::{Value, json};
use std::io::Read;
use std::path::Path;

fn main() {
    if let Err(e) = run() {
        eprintln!("model_probe: {e}");
        std::process::exit(1);
    }
}

fn stdin_json() -> Result<Value, Box<dyn std::error::Error>> {
    let mut s = String::new();
    std::io::stdin().read_to_string(&mut s)?;
    Ok(serde_json::from_str(&s)?)
}

fn run() -> Result<(), Box<dyn std::error::Error>> {
    if std::env::args().nth(1).as_deref() == Some("kdot") {
        println!("{}", kdot(&stdin_json()?)?);
        return Ok(());
    }
    if std::env::args().nth(1).as_deref() == Some("ktiled") {
        println!("{}", ktiled(&stdin_json()?)?);
        return Ok(());
    }
    let args: Vec<String> = std::env::args().skip(1).collect();
    let (cmd, path) = match args.as_slice() {
        [c, p, ..] => (c.as_str(), Path::new(p)),
        _ => return Err("usage: model_probe tokenize|detokenize|greedy|info MODEL [N]".into()),
    };
    let threads = std::env::var("SAMPLERD_THREADS")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(2);
    // The parity scripts compare with the llama.cpp build on this machine:
    // its native order unless SAMPLERD_NUMERICS=portable.
    let numerics = match std::env::var("SAMPLERD_NUMERICS").as_deref() {
        Ok("portable") => samplerd_model::Numerics::Portable,
        Ok("native") | Err(_) => samplerd_model::Numerics::Native,
        Ok(other) => return Err(format!("SAMPLERD_NUMERICS={other:?}: portable or native").into()),
    };
    let model = Model::load(
        path,
        &ModelOptions {
            n_threads: threads,
            n_ctx: 2048,
            numerics,
        },
    )?;
    let out = match cmd {
        "tokenize" => {
            let texts: Vec<String> = serde_json::from_value(stdin_json()?)?;
            let ids = texts
                .iter()
                .map(|t| model.tokenizer().encode(t, false, true))
                .collect::<Result<Vec<_>, _>>()?;
            json!({ "ids": ids })
        }
        "detokenize" => {
            let ids: Vec<Vec<u32>> = serde_json::from_value(stdin_json()?)?;
            let bytes: Vec<Vec<u8>> = ids
                .iter()
                .map(|v| {
                    v.iter()
                        .flat_map(|&i| model.tokenizer().token_bytes(i).to_vec())
                        .collect()
                })
                .collect();
            json!({ "bytes": bytes })
        }
        "logits" => {
            // stdin: an id array (one prefill), or {"prefill": [...], "decode": [...]}
            // (prefill, then one decode call per id).
            let v = stdin_json()?;
            let (pre, dec): (Vec<u32>, Vec<u32>) = match v.get("prefill") {
                Some(p) => (
                    serde_json::from_value(p.clone())?,
                    serde_json::from_value(v.get("decode").cloned().unwrap_or(json!([])))?,
                ),
                None => (serde_json::from_value(v)?, Vec::new()),
            };
            let mut session = model.new_session()?;
            session.prefill(&pre)?;
            for t in dec {
                session.decode(t)?;
            }
            json!({ "logits": session.logits() })
        }
        "info" => json!({
            "config": format!("{:?}", model.config()),
            "backend": model.backend_name(),
            "eog": model.tokenizer().eog_ids(),
            "n_ctx": model.n_ctx(),
            "numerics": model.numerics().describe(),
        }),
        "greedy" => {
            let n: usize = args.get(2).map(|s| s.parse()).transpose()?.unwrap_or(32);
            let req = stdin_json()?;
            let prompt = match (req.get("messages"), req.get("prompt")) {
                (Some(m), _) => {
                    model.render_chat(&serde_json::from_value::<Vec<ChatMessage>>(m.clone())?)?
                }
                (None, Some(Value::String(p))) => p.clone(),
                _ => return Err("stdin needs \"messages\" or \"prompt\"".into()),
            };
            let prompt_ids = model.tokenizer().encode(&prompt, true, true)?;
            let mut session = model.new_session()?;
            let t0 = std::time::Instant::now();
            let mut logits = session.prefill(&prompt_ids)?.to_vec();
            let prefill_s = t0.elapsed().as_secs_f64();
            let mut top: Vec<(usize, f32)> = logits.iter().copied().enumerate().collect();
            top.sort_by(|a, b| b.1.total_cmp(&a.1));
            top.truncate(10);
            let mut tokens = Vec::new();
            let mut logprobs = Vec::new();
            let mut text = String::new();
            let mut st = Utf8Streamer::new();
            let t1 = std::time::Instant::now();
            for _ in 0..n {
                let next = argmax(&logits);
                tokens.push(next);
                logprobs.push(log_softmax_at(&logits, next as usize));
                if model.tokenizer().is_eog(next) {
                    break;
                }
                text += &st.push(model.tokenizer().token_bytes(next));
                if tokens.len() == n {
                    break;
                }
                logits = session.decode(next)?.to_vec();
            }
            let decode_s = t1.elapsed().as_secs_f64();
            text += &st.finish();
            json!({ "prompt": prompt, "prompt_ids": prompt_ids, "tokens": tokens, "text": text, "top": top,
                    "logprobs": logprobs,
                    "prefill_s": prefill_s, "decode_s": decode_s, "backend": model.backend_name() })
        }
        other => return Err(format!("unknown command {other:?}").into()),
    };
    println!("{out}");
    Ok(())
}

/// The bytes of a hex string (the parity scripts' weight rows).
fn hex_bytes(hex: &str) -> Result<Vec<u8>, std::num::ParseIntError> {
    (0..hex.len() / 2)
        .map(|i| u8::from_str_radix(&hex[2 * i..2 * i + 2], 16))
        .collect()
}

/// Single-row products for `tests/kquant_parity.py`, which compares them
/// with llama.cpp's own `ggml_vec_dot_*` on the same bytes.
fn kdot(req: &Value) -> Result<Value, Box<dyn std::error::Error>> {
    use samplerd_model::quant::{Acts, BlockQ8_1, KQuant, QMatrix, quantize_q8_1};
    use samplerd_model::quant::{BlockQ8K, quantize_q8_k};
    let kind = req["kind"].as_str().ok_or("kind")?;
    let cols = req["cols"].as_u64().ok_or("cols")? as usize;
    let pool = samplerd_model::pool::ThreadPool::new(1);
    let mut dots = Vec::new();
    for row in req["rows"].as_array().ok_or("rows")? {
        let raw = hex_bytes(row["raw"].as_str().ok_or("raw")?)?;
        let x: Vec<f32> = serde_json::from_value(row["x"].clone())?;
        let m = match kind {
            "q4_K" => QMatrix::from_k_bytes(KQuant::Q4K, 1, cols, &raw),
            "q5_K" => QMatrix::from_k_bytes(KQuant::Q5K, 1, cols, &raw),
            "q6_K" => QMatrix::from_k_bytes(KQuant::Q6K, 1, cols, &raw),
            "q5_0" => QMatrix::from_q5_0_bytes(1, cols, &raw),
            "q5_1" => QMatrix::from_q5_1_bytes(1, cols, &raw),
            _ => None,
        }
        .ok_or("bad kind or row size")?;
        let mut q8 = vec![BlockQ8_1::default(); cols / 32];
        quantize_q8_1(&x, &mut q8);
        let mut q8k = vec![BlockQ8K::default(); if m.needs_q8k() { cols / 256 } else { 0 }];
        if m.needs_q8k() {
            quantize_q8_k(&x, &mut q8k);
        }
        let mut out = [0f32];
        let acts = Acts {
            q8k: &q8k,
            ..Acts::q8(&q8)
        };
        m.matmul(&pool, acts, 1, &mut out);
        dots.push(out[0].to_bits());
    }
    Ok(json!({ "dot": dots }))
}

/// A K-quant matrix (`rows`, hex) times `xs` (one activation row per
/// token) in ggml's tiled order. The product's bits, token-major
/// (`kquant_parity.py` compares them with llama.cpp's graph).
fn ktiled(req: &Value) -> Result<Value, Box<dyn std::error::Error>> {
    use samplerd_model::quant::{Acts, KQuant, QMatrix};
    use samplerd_model::quant::{BlockQ8K, quantize_q8_k};
    let kind = match req["kind"].as_str().ok_or("kind")? {
        "q4_K" => KQuant::Q4K,
        "q5_K" => KQuant::Q5K,
        "q6_K" => KQuant::Q6K,
        _ => return Err("kind".into()),
    };
    let cols = req["cols"].as_u64().ok_or("cols")? as usize;
    let mut raw = Vec::new();
    let rows = req["rows"].as_array().ok_or("rows")?;
    for row in rows {
        raw.extend(hex_bytes(row.as_str().ok_or("row")?)?);
    }
    let m = QMatrix::from_k_bytes(kind, rows.len(), cols, &raw).ok_or("row size")?;
    let xs: Vec<Vec<f32>> = serde_json::from_value(req["xs"].clone())?;
    let nb = cols / 256;
    let mut q8k = vec![BlockQ8K::default(); xs.len() * nb];
    for (t, x) in xs.iter().enumerate() {
        quantize_q8_k(x, &mut q8k[t * nb..(t + 1) * nb]);
    }
    let tiled = vec![true; xs.len()];
    let acts = Acts {
        q8k: &q8k,
        tiled: &tiled,
        ..Acts::q8(&[])
    };
    let mut out = vec![0f32; xs.len() * rows.len()];
    let pool = samplerd_model::pool::ThreadPool::new(1);
    m.matmul(&pool, acts, xs.len(), &mut out);
    Ok(json!({ "out": out.iter().map(|v| v.to_bits()).collect::<Vec<_>>() }))
}

/// `log softmax(v)[i]` in f64 (the parity scripts compute the same from
/// llama.cpp's logits).
fn log_softmax_at(v: &[f32], i: usize) -> f64 {
    let m = v.iter().fold(f32::NEG_INFINITY, |a, &b| a.max(b)) as f64;
    let z: f64 = v.iter().map(|&x| (x as f64 - m).exp()).sum();
    v[i] as f64 - m - z.ln()
}

/// First index of the maximum (llama.cpp's greedy picks the first on ties).
fn argmax(v: &[f32]) -> u32 {
    let mut best = 0;
    for (i, &x) in v.iter().enumerate() {
        if x > v[best] {
            best = i;
        }
    }
    best as u32
}
