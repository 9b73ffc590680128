//! Tests on the real default model (`models/SmolLM2-135M-Instruct.Q4_1.gguf`,
//! fetched by `scripts/fetch-model.sh`). Skipped with a notice when the file
//! is absent. Token-id parity with llama.cpp is checked by
//! `tests/tokenizer_parity.py` and `tests/greedy_parity.py` (they need the
//! llama-cpp-python venv); here: loading, template, round trips, EOG ids and
//! cache consistency.

use samplerd_model::ggml::{Flavor, native_flavor};
use samplerd_model::{ChatMessage, Model, ModelOptions, Numerics, Utf8Streamer, attr};
use std::path::PathBuf;
use std::sync::Arc;

fn model() -> Option<Arc<Model>> {
    model_with(Numerics::default())
}

fn model_with(numerics: Numerics) -> Option<Arc<Model>> {
    let p = PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("../../models/SmolLM2-135M-Instruct.Q4_1.gguf");
    if !p.exists() {
        eprintln!(
            "NOTICE: {} absent (run scripts/fetch-model.sh); skipping real-model test",
            p.display()
        );
        return None;
    }
    Some(
        Model::load(
            &p,
            &ModelOptions {
                n_threads: 2,
                n_ctx: 512,
                numerics,
            },
        )
        .expect("loading the real model"),
    )
}

#[test]
fn smollm2_config_template_and_vocab() {
    let Some(m) = model() else { return };
    let c = m.config();
    assert_eq!(
        (c.n_layer, c.n_embd, c.n_head, c.n_head_kv, c.n_vocab),
        (30, 576, 9, 3, 49152)
    );
    assert!(!c.rope_neox);
    assert!(m.chat_template().is_model_template());
    let p = m
        .render_chat(&[ChatMessage::new("user", "What is 2+2?")])
        .unwrap();
    assert!(p.starts_with("<|im_start|>system\n"), "{p}");
    assert!(
        p.ends_with("<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n"),
        "{p}"
    );
    let tk = m.tokenizer();
    let im_end = tk.token_id("<|im_end|>").unwrap();
    assert!(tk.is_eog(im_end) && tk.is_eog(tk.token_id("<|endoftext|>").unwrap()));
    assert!(m.vocabulary()[im_end as usize].attrs & attr::END_OF_GENERATION != 0);
    // Special tokens in a raw prompt are single ids.
    let ids = tk.encode("<|im_start|>user", false, true).unwrap();
    assert_eq!(ids[0], tk.token_id("<|im_start|>").unwrap());
}

#[test]
fn smollm2_byte_level_round_trip() {
    let Some(m) = model() else { return };
    let tk = m.tokenizer();
    for text in [
        "Hello world",
        "  many   spaces\n\n\ttabs",
        "数字 12345 and 日本語",
        "emoji 😀👍🏽",
        "naïve café",
    ] {
        let ids = tk.encode(text, false, false).unwrap();
        assert_eq!(tk.decode(&ids, false), text);
        let mut s = Utf8Streamer::new();
        let mut out = String::new();
        for &i in &ids {
            out += &s.push(tk.token_bytes(i));
        }
        out += &s.finish();
        assert_eq!(out, text);
    }
}

#[test]
fn smollm2_decode_matches_prefill() {
    let Some(m) = model() else { return };
    let prompt = m
        .render_chat(&[ChatMessage::new("user", "Name three colours.")])
        .unwrap();
    let ids = m.tokenizer().encode(&prompt, true, true).unwrap();
    let mut s = m.new_session().unwrap();
    let mut logits = s.prefill(&ids).unwrap().to_vec();
    let mut seq = ids.clone();
    for _ in 0..2 {
        let next = logits
            .iter()
            .enumerate()
            .fold(0, |b, (i, &x)| if x > logits[b] { i } else { b }) as u32;
        seq.push(next);
        logits = s.decode(next).unwrap().to_vec();
    }
    let full = m.new_session().unwrap().prefill(&seq).unwrap().to_vec();
    // Decode and prefill sum attention in different orders (exactly as
    // llama.cpp does; its own decode and prefill logits differ as much), and
    // 8-bit activation rounding amplifies that, so compare shapes, not bits.
    let dot: f64 = logits
        .iter()
        .zip(&full)
        .map(|(a, b)| (*a as f64) * (*b as f64))
        .sum();
    let na: f64 = logits
        .iter()
        .map(|a| (*a as f64).powi(2))
        .sum::<f64>()
        .sqrt();
    let nb: f64 = full.iter().map(|a| (*a as f64).powi(2)).sum::<f64>().sqrt();
    let cos = dot / (na * nb);
    let d = logits
        .iter()
        .zip(&full)
        .map(|(a, b)| (a - b).abs())
        .fold(0f32, f32::max);
    assert!(
        cos > 0.999 && d < 2.0,
        "decode vs prefill: cosine {cos}, max diff {d}"
    );
}

/// The verify pass of speculative decoding on the default model (Q4_1,
/// tied Q8_0 output): a token and K = 1…8 drafts scored in one pass give
/// every row the bits of that token's decode step, and a rollback to an
/// accepted prefix decodes on as the sequential run does.
#[test]
fn smollm2_verify_rows_equal_decode_steps_bit_for_bit() {
    let Some(m) = model() else { return };
    let prompt = m
        .render_chat(&[ChatMessage::new("user", "Copy: the quick brown fox.")])
        .unwrap();
    let ids = m.tokenizer().encode(&prompt, true, true).unwrap();
    let drafts = m
        .tokenizer()
        .encode(" the quick brown fox jumps over", false, false)
        .unwrap();
    assert!(drafts.len() >= 6, "{drafts:?}");
    for k in 1..=8.min(drafts.len() - 1) {
        let toks = &drafts[..=k];
        let mut seq = m.new_session().unwrap();
        seq.prefill(&ids).unwrap();
        let want: Vec<_> = toks.iter().map(|&t| bits(seq.decode(t).unwrap())).collect();
        let mut s = m.new_session().unwrap();
        s.prefill(&ids).unwrap();
        m.decode_rows(&mut [&mut s], &[toks]).unwrap();
        let got: Vec<_> = s.logits_rows().map(bits).collect();
        assert!(got == want, "K = {k}: rows differ from decode steps");
        s.truncate(ids.len() + 1);
        let mut r = m.new_session().unwrap();
        r.prefill(&ids).unwrap();
        r.decode(toks[0]).unwrap();
        assert_eq!(
            bits(s.decode(13).unwrap()),
            bits(r.decode(13).unwrap()),
            "K = {k}"
        );
    }
}

/// Bits of a logits vector, for exact comparison.
fn bits(l: &[f32]) -> Vec<u32> {
    l.iter().map(|x| x.to_bits()).collect()
}

/// The greedy next token.
fn argmax(l: &[f32]) -> u32 {
    l.iter()
        .enumerate()
        .fold(0, |b, (i, &x)| if x > l[b] { i } else { b }) as u32
}

/// A session that ran one prompt and generated from it, reused for a
/// longer prompt sharing it (a chat's next turn), gives a fresh prefill's
/// logits bit for bit — and so does every decode step after it — whatever
/// the remainder's length (a short one is lengthened into the fresh
/// prefill's order).
#[test]
fn smollm2_reused_prefix_equals_a_fresh_prefill_bit_for_bit() {
    let Some(m) = model() else { return };
    let tk = m.tokenizer();
    let first = m
        .render_chat(&[
            ChatMessage::new("system", "You are a terse assistant."),
            ChatMessage::new("user", "Name three colours."),
        ])
        .unwrap();
    let first = tk.encode(&first, true, true).unwrap();
    // The first request: its prompt, then three tokens decoded one by one.
    let first_request = || {
        let mut s = m.new_session().unwrap();
        let mut l = s.prefill(&first).unwrap().to_vec();
        for _ in 0..3 {
            l = s.decode(argmax(&l)).unwrap().to_vec();
        }
        s
    };
    let generated = first_request().cached_tokens()[first.len()..].to_vec();
    for (extra, reused_all) in [
        ("", false),
        (" Three?", false),
        (" And three animals, three trees and a fruit?", true),
    ] {
        let mut prompt = first.clone();
        prompt.extend(&generated);
        prompt.extend(tk.encode(extra, false, false).unwrap());
        let mut reused = first_request();
        let n = reused.reuse_prefix(&prompt);
        // Never a decoded position; the whole first prompt when the rest
        // is long enough to run tiled.
        assert!(n <= first.len(), "reused {n} of {}", prompt.len());
        assert_eq!(
            n == first.len(),
            reused_all,
            "reused {n} of {}",
            prompt.len()
        );
        assert!(n > 0);
        let mut fresh = m.new_session().unwrap();
        let (mut a, mut b) = (
            reused.prefill(&prompt[n..]).unwrap().to_vec(),
            fresh.prefill(&prompt).unwrap().to_vec(),
        );
        for step in 0..4 {
            assert_eq!(
                bits(&a),
                bits(&b),
                "extra {extra:?}, step {step}: logits differ"
            );
            let t = argmax(&a);
            a = reused.decode(t).unwrap().to_vec();
            b = fresh.decode(t).unwrap().to_vec();
        }
        assert_eq!(reused.cached_tokens(), fresh.cached_tokens());
    }
}

/// log softmax(logits)[i] in f64 (as the parity scripts compute it).
fn log_softmax_at(l: &[f32], i: u32) -> f64 {
    let m = l.iter().fold(f64::NEG_INFINITY, |m, &x| m.max(x as f64));
    let z: f64 = l.iter().map(|&x| (x as f64 - m).exp()).sum();
    l[i as usize] as f64 - m - z.ln()
}

/// `model.numerics = "portable"` computes llama.cpp's AVX2 build's order on
/// every CPU: greedy tokens equal a stored reference of that build
/// (`fixtures/portable_reference.json`, 5 prompts × 48 tokens, written by
/// `write_portable_reference.py`) on any machine, whatever its own
/// llama.cpp build would answer (`greedy_parity.py` compares `native` with
/// the live one).
#[test]
fn smollm2_portable_numerics_equals_the_stored_llama_cpp_avx2_reference() {
    let Some(m) = model_with(Numerics::Portable) else {
        return;
    };
    let path =
        PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/portable_reference.json");
    let r: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&path).expect("the stored reference"))
            .expect("reference JSON");
    let ids = |v: &serde_json::Value| -> Vec<u32> {
        v.as_array()
            .expect("an id array")
            .iter()
            .map(|x| x.as_u64().expect("an id") as u32)
            .collect()
    };
    let cases = r["cases"].as_array().expect("cases");
    assert!(cases.len() >= 4, "the reference has its prompts");
    let mut worst = 0f64;
    for (k, case) in cases.iter().enumerate() {
        let prompt = ids(&case["prompt_ids"]);
        let want = ids(&case["tokens"]);
        let want_lp: Vec<f64> = case["logprobs"]
            .as_array()
            .unwrap()
            .iter()
            .map(|x| x.as_f64().unwrap())
            .collect();
        let mut s = m.new_session().unwrap();
        let mut logits = s.prefill(&prompt).unwrap().to_vec();
        for (i, &w) in want.iter().enumerate() {
            let got = argmax(&logits);
            assert_eq!(
                got, w,
                "prompt {k}: token {i} differs from llama.cpp's AVX2 build"
            );
            let d = (log_softmax_at(&logits, got) - want_lp[i]).abs();
            assert!(
                d <= 1e-3,
                "prompt {k}: token {i} log-probability off by {d}"
            );
            worst = worst.max(d);
            if i + 1 < want.len() {
                logits = s.decode(got).unwrap().to_vec();
            }
        }
    }
    eprintln!(
        "portable = llama.cpp AVX2 on {} prompts, max |Δlogprob| {worst:.1e}",
        cases.len()
    );
}

/// `native` follows this CPU's llama.cpp build: the same bits as `portable`
/// where that build is the AVX2 one, other bits where it is AVX-512's.
#[test]
fn smollm2_native_numerics_follow_this_cpus_llama_cpp_build() {
    let (Some(portable), Some(native)) =
        (model_with(Numerics::Portable), model_with(Numerics::Native))
    else {
        return;
    };
    assert_eq!(native.numerics(), Numerics::Native);
    let text = portable
        .render_chat(&[ChatMessage::new("user", "What is the capital of France?")])
        .unwrap();
    let prompt = portable.tokenizer().encode(&text, true, true).unwrap();
    let a = bits(portable.new_session().unwrap().prefill(&prompt).unwrap());
    let b = bits(native.new_session().unwrap().prefill(&prompt).unwrap());
    match native_flavor() {
        Flavor::Avx2 => assert_eq!(a, b, "native is the AVX2 order on this CPU"),
        Flavor::Avx512 => assert_ne!(a, b, "native is the AVX-512 order on this CPU"),
    }
}
