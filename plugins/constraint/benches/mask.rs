//! The `constraint` stage through the C ABI: config_new once, then per
//! token one `apply` on a dense view plus one `accept`, for a JSON-schema
//! constraint over SmolLM2's real 49,152-token vocabulary, over Qwen's real
//! vocabulary at Qwen2's 151,936 logits (`qwen_vocab`), and over SmolLM2's
//! extended to 151,936 with pair merges (`gguf_vocab::extend`: needs no
//! second download). Also: the same walk with a forward pass between steps,
//! timing the step's critical path while the stage computes the next mask
//! ahead; and what the token-environment cache saves per config_new.
//!
//! SmolLM2's vocabulary is read from `SAMPLERD_MODEL` or else
//! `models/SmolLM2-135M-Instruct.Q4_1.gguf` (`scripts/fetch-model.sh`
//! fetches it); without it the benchmark prints why and measures nothing.
//! Qwen's is read from `SAMPLERD_QWEN_VOCAB` or else `models/qwen.tiktoken`
//! (`scripts/fetch-model.sh qwen-vocab`); without it that group is skipped.
//!
//! cargo bench -p samplerd-constraint-stage --bench mask

#[path = "../tests/common/mod.rs"]
mod common;
mod gguf_vocab;
mod qwen_vocab;

use std::collections::HashMap;
use std::hint::black_box;
use std::path::PathBuf;
use std::time::{Duration, Instant};

use common::{Buffer, P, TestVocab, config};
use criterion::{Criterion, criterion_group, criterion_main};
use samplerd_constraint_stage::tokenv;
use samplerd_plugin_sdk::Vocab;

const SCHEMA: &str = r#"{"type":"object","properties":{
  "name":{"type":"string","maxLength":64},
  "age":{"type":"integer","minimum":0,"maximum":150},
  "email":{"type":"string","format":"email"},
  "tags":{"type":"array","items":{"type":"string"},"maxItems":8},
  "address":{"type":"object","properties":{"city":{"type":"string"},"zip":{"type":"string","pattern":"^[A-Z0-9 ]{2,8}$"}},"required":["city"]}},
  "required":["name","age","tags","address"],"additionalProperties":false}"#;

/// The forward pass the overlapped benchmark waits out between steps: a
/// small model's decode step on a fast GPU (1,000 tokens/s is 1 ms).
const FORWARD_PASS: Duration = Duration::from_micros(500);

const TEXT: &str = r#"{"name":"Ada Lovelace","age":36,"email":"ada@example.org","tags":["mathematics","poetry","engines"],"address":{"city":"London","zip":"W1 4AB"}}"#;

fn model_path() -> PathBuf {
    std::env::var_os("SAMPLERD_MODEL")
        .map(PathBuf::from)
        .unwrap_or_else(|| {
            PathBuf::from(env!("CARGO_MANIFEST_DIR"))
                .join("../../models/SmolLM2-135M-Instruct.Q4_1.gguf")
        })
}

/// Greedy longest-match tokenization of `text` (ids of normal tokens).
fn tokenize(v: &TestVocab, text: &[u8]) -> Vec<u32> {
    let mut by_bytes: HashMap<&[u8], u32> = HashMap::new();
    for id in 0..v.len() as u32 {
        if v.attr(id) == 0 && !v.bytes(id).is_empty() {
            by_bytes.entry(v.bytes(id)).or_insert(id);
        }
    }
    let mut out = Vec::new();
    let mut i = 0;
    while i < text.len() {
        let n = (1..=(text.len() - i).min(24))
            .rev()
            .find(|&n| by_bytes.contains_key(&text[i..i + n]))
            .expect("every byte is a token");
        out.push(by_bytes[&text[i..i + n]]);
        i += n;
    }
    out
}

/// `iters` steps of the walk over `toks` (restarting at its end), each one
/// apply on a dense view of `logits` and one accept, after a busy wait of
/// `forward`; returns the time in apply + accept only (the reload, the wait
/// and the restarts are not timed: the host's buffer is already loaded).
fn walk_timed(
    cfg: &common::Config,
    toks: &[u32],
    logits: &[f32],
    buf: &mut Buffer,
    iters: u64,
    forward: Duration,
) -> Duration {
    let mut st = cfg.state();
    let mut pos = 0;
    let mut spent = Duration::ZERO;
    for _ in 0..iters {
        if pos == toks.len() {
            st.reset();
            pos = 0;
        }
        buf.load_dense(logits);
        let waited = Instant::now();
        while waited.elapsed() < forward {
            std::hint::spin_loop();
        }
        let t = Instant::now();
        st.apply(buf).unwrap();
        st.accept(toks[pos]).unwrap();
        spent += t.elapsed();
        pos += 1;
    }
    black_box(&buf.dense);
    spent
}

fn bench_vocab(c: &mut Criterion, label: &str, v: &TestVocab) {
    let toks = tokenize(v, TEXT.as_bytes());
    let cfg = config(&[P::Str("json_schema", SCHEMA)], Some(v)).unwrap();
    // One full pass first: the text is valid and ends where EOG is allowed.
    let mut st = cfg.state();
    for &t in &toks {
        st.accept(t).unwrap();
    }
    assert!(st.allowed(v.len()).unwrap().contains(&v.eog_ids()[0]));
    drop(st);

    let logits: Vec<f32> = (0..v.len())
        .map(|i| ((i * 7919) % 1000) as f32 / 100.0)
        .collect();
    let mut buf = Buffer::new(v.len());
    let mut group = c.benchmark_group(format!("constraint/{label}"));
    group
        .sample_size(30)
        .measurement_time(Duration::from_secs(8));
    group.bench_function("apply_dense+accept per token", |b| {
        b.iter_custom(|iters| walk_timed(&cfg, &toks, &logits, &mut buf, iters, Duration::ZERO))
    });
    // Generate's decode loop (or a SampleStream client) runs a forward
    // pass between one step's accept and the next step's apply; the stage
    // computes the next mask during it. Timed: the step's critical path
    // (apply + accept), not the forward pass, a busy wait here.
    group.bench_function(
        "apply_dense+accept per token, 0.5 ms forward between",
        |b| b.iter_custom(|iters| walk_timed(&cfg, &toks, &logits, &mut buf, iters, FORWARD_PASS)),
    );
    group.bench_function("config_new (token env cached)", |b| {
        b.iter(|| config(&[P::Str("json_schema", SCHEMA)], Some(v)).unwrap())
    });
    group
        .sample_size(10)
        .measurement_time(Duration::from_secs(10));
    group.bench_function("token env build (what the cache saves)", |b| {
        // SAFETY: `v` owns the arrays its `sd_vocab` points to, alive here.
        let vocab = unsafe { Vocab::from_raw(&*v.raw()) };
        b.iter(|| tokenv::token_env_uncached(&vocab).unwrap())
    });
    group.finish();
}

fn benches(c: &mut Criterion) {
    let path = model_path();
    let real = match gguf_vocab::read(&path) {
        Ok(v) => v,
        Err(e) => {
            eprintln!(
                "constraint bench skipped: no vocabulary at {} ({e}); run scripts/fetch-model.sh \
                 or set SAMPLERD_MODEL=/path/to/model.gguf",
                path.display()
            );
            return;
        }
    };
    assert_eq!(real.len(), 49_152, "SmolLM2's vocabulary");
    let v49 = TestVocab::new(real.clone());
    bench_vocab(c, "49152", &v49);
    drop(v49);
    let qwen_path = std::env::var_os("SAMPLERD_QWEN_VOCAB")
        .map(PathBuf::from)
        .unwrap_or_else(|| {
            PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../models/qwen.tiktoken")
        });
    match qwen_vocab::read(&qwen_path) {
        Ok(qwen) => {
            let v = TestVocab::new(qwen);
            bench_vocab(c, "151936-qwen", &v);
        }
        Err(e) => eprintln!(
            "constraint bench: Qwen group skipped: no vocabulary at {} ({e}); run \
             scripts/fetch-model.sh qwen-vocab or set SAMPLERD_QWEN_VOCAB",
            qwen_path.display()
        ),
    }
    let v152 = TestVocab::new(gguf_vocab::extend(real, 151_936));
    bench_vocab(c, "151936-pairs", &v152);
}

criterion_group!(mask, benches);
criterion_main!(mask);
