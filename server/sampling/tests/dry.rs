//! The `dry` stage through the plugin ABI with a vocabulary: llama.cpp's
//! `test_dry` cases (`tests/test-sampling.cpp`) with the breakers given as
//! strings and found in a tiny vocabulary, multi-token restart sequences,
//! and the refusal without a vocabulary.

mod common;

use std::sync::{Arc, OnceLock};

use common::*;
use samplerd_sampling::vocab::token_attr;
use samplerd_sampling::{ChainError, SamplingParams, StageRegistry, TokenBuffer, Vocabulary};

fn registry() -> &'static StageRegistry {
    static REG: OnceLock<StageRegistry> = OnceLock::new();
    REG.get_or_init(|| StageRegistry::load(&[], &[core_plugin()]).unwrap())
}

fn vocab(words: &[&str]) -> Arc<Vocabulary> {
    Arc::new(Vocabulary::new(
        words.iter().map(|w| w.as_bytes().to_vec()).collect(),
        vec![token_attr::NORMAL; words.len()],
    ))
}

/// DRY alone before the draw: every other stage at its off value.
fn dry_params(
    mult: f32,
    base: f32,
    allowed: i32,
    last_n: i32,
    breakers: &[&str],
) -> SamplingParams {
    SamplingParams {
        temperature: 1.0,
        top_k: 0,
        top_p: 1.0,
        repeat_penalty: 1.0,
        dry_multiplier: mult,
        dry_base: base,
        dry_allowed_length: allowed,
        dry_penalty_last_n: last_n,
        dry_sequence_breakers: breakers.iter().map(|s| s.to_string()).collect(),
        ..Default::default()
    }
}

/// The post-chain probabilities by token id after `history`.
fn probs_after(
    p: &SamplingParams,
    v: &Arc<Vocabulary>,
    logits: &[f32],
    history: &[u32],
) -> Vec<f64> {
    let chain = registry().build_typed(p, Some(Arc::clone(v))).unwrap();
    assert_eq!(chain.stage_names(), ["dry", "temperature", "dist"]);
    let mut seq = chain.new_sequence().unwrap();
    seq.accept_history(history).unwrap();
    let mut buf = TokenBuffer::new();
    buf.load(logits).unwrap();
    let tok = seq.sample(&mut buf, 1, 0).unwrap().token_id;
    let (dist, _) = buf.distribution(usize::MAX, tok);
    let mut by_id = vec![0.0; logits.len()];
    for (id, p) in dist {
        by_id[id as usize] = p as f64;
    }
    by_id
}

/// llama.cpp's expectation: softmax of ln(p), each penalised token losing
/// multiplier × base^(length − allowed_length).
fn expected(
    probs: &[f32],
    mult: f32,
    base: f32,
    allowed: i32,
    penalised: &[(usize, i32)],
) -> Vec<f64> {
    let mut l: Vec<f64> = probs.iter().map(|&p| (p as f64).ln()).collect();
    for &(id, len) in penalised {
        l[id] -= mult as f64 * (base as f64).powi(len - allowed);
    }
    let z: f64 = l.iter().map(|x| x.exp()).sum();
    l.iter().map(|x| x.exp() / z).collect()
}

fn assert_close(got: &[f64], want: &[f64]) {
    assert_eq!(got.len(), want.len());
    for (i, (g, w)) in got.iter().zip(want).enumerate() {
        assert!((g - w).abs() < 1e-5, "token {i}: {got:?} vs {want:?}");
    }
}

#[test]
fn llama_cpp_test_dry_cases_with_string_breakers() {
    // Token 3 is "\n", one of llama.cpp's default breakers: llama.cpp's
    // third case (breaker {3}) is the default list here.
    let v = vocab(&["a", "b", "c", "\n", "d"]);
    let q = [0.25f32; 4];
    let f = [0.2f32; 5];
    let ln = |p: &[f32]| p.iter().map(|x| x.ln()).collect::<Vec<f32>>();
    let defaults = ["\n", ":", "\"", "*"];
    #[allow(clippy::type_complexity)]
    let cases: [(&[f32], &[u32], f32, i32, i32, &[&str], &[(usize, i32)]); 5] = [
        (&q, &[0, 1], 1.0, 2, 4, &[""], &[]),
        (&q, &[0, 1, 2, 0, 1], 1.0, 2, 5, &[""], &[(2, 2)]),
        (&f, &[0, 1, 3, 4, 0, 1], 1.0, 2, 6, &defaults, &[]),
        (&f, &[0, 1, 2, 0, 1], 2.0, 2, 5, &[""], &[(2, 2)]),
        (&f, &[0, 1, 2, 3, 4, 0, 1], 1.0, 4, 7, &[""], &[]),
    ];
    for (probs, history, mult, allowed, last_n, breakers, penalised) in cases {
        let v4 = if probs.len() == 4 {
            vocab(&["a", "b", "c", "d"])
        } else {
            Arc::clone(&v)
        };
        let p = dry_params(mult, 1.1, allowed, last_n, breakers);
        let got = probs_after(&p, &v4, &ln(probs), history);
        assert_close(&got, &expected(probs, mult, 1.1, allowed, penalised));
    }
    // The numbers llama.cpp's test asserts.
    let got = probs_after(
        &dry_params(1.0, 1.1, 2, 5, &[""]),
        &vocab(&["a", "b", "c", "d"]),
        &ln(&q),
        &[0, 1, 2, 0, 1],
    );
    assert_close(&got, &[0.296923, 0.296923, 0.109232, 0.296923]);
    let got = probs_after(
        &dry_params(2.0, 1.1, 2, 5, &[""]),
        &v,
        &ln(&f),
        &[0, 1, 2, 0, 1],
    );
    assert_close(&got, &[0.241818, 0.241818, 0.032727, 0.241818, 0.241818]);
    // With no breaker the third case penalises token 3 (it follows the
    // repeated "0 1"): being a breaker is what spares it.
    let got = probs_after(
        &dry_params(1.0, 1.1, 2, 6, &[""]),
        &v,
        &ln(&f),
        &[0, 1, 3, 4, 0, 1],
    );
    assert_close(&got, &expected(&f, 1.0, 1.1, 2, &[(3, 2)]));
}

#[test]
fn a_multi_token_breaker_is_a_restart_sequence() {
    // "ab" spans the tokens "a" and "b": the head "a" ends with its first
    // byte and its tail is "b". History a b x y z a b x y: the suffix
    // "a b x y" repeats (4 tokens, followed by z) unless "a b" restarts it.
    let v = vocab(&["x", "y", "z", "a", "b"]);
    let logits = [0.0f32; 5];
    let history = [3, 4, 0, 1, 2, 3, 4, 0, 1];
    let z_prob = |breakers: &[&str]| {
        probs_after(
            &dry_params(1.0, 2.0, 2, -1, breakers),
            &v,
            &logits,
            &history,
        )[2]
    };
    let uniform_but_z = |penalty: f64| {
        let e = (-penalty).exp();
        e / (4.0 + e)
    };
    // no breaker, or breakers no token spells: 2^(4 - 2)
    assert!((z_prob(&[""]) - uniform_but_z(4.0)).abs() < 1e-5);
    assert!((z_prob(&["\n", ":"]) - uniform_but_z(4.0)).abs() < 1e-5);
    // "ab": the repeat is cut to "x y", 2^0
    assert!((z_prob(&["ab"]) - uniform_but_z(1.0)).abs() < 1e-5);
    // "b" alone: a single-token breaker, the same cut
    assert!((z_prob(&["b"]) - uniform_but_z(1.0)).abs() < 1e-5);
    // "xb" never occurs in the history: no cut
    assert!((z_prob(&["xb"]) - uniform_but_z(4.0)).abs() < 1e-5);
}

#[test]
fn without_a_vocabulary_the_breakers_are_refused_naming_the_field() {
    let p = dry_params(0.8, 1.75, 2, -1, &["\n", ":", "\"", "*"]);
    let err = registry().build_typed(&p, None).err().expect("refused");
    match &err {
        ChainError::Param { field, message } => {
            assert_eq!(*field, "dry_sequence_breakers");
            assert!(
                message.starts_with("refused by stage `dry`: sequence_breakers must be [\"\"] (none) without a vocabulary, and this request has none (Sample: name one in params.vocabulary"),
                "{message}"
            );
        }
        other => panic!("not a field error: {other:?}"),
    }
    // no breaker, or DRY off: no vocabulary needed
    assert!(
        registry()
            .build_typed(&dry_params(0.8, 1.75, 2, -1, &[""]), None)
            .is_ok()
    );
    assert!(
        registry()
            .build_typed(&dry_params(0.0, 1.75, 2, -1, &["\n"]), None)
            .is_ok()
    );
    // out of range: the field and value
    let err = registry()
        .build_typed(&dry_params(0.8, 1.75, 2, -2, &[""]), None)
        .err()
        .unwrap()
        .to_string();
    assert_eq!(
        err,
        "dry_penalty_last_n refused by stage `dry`: penalty_last_n must be in [-1, 65536], got -2"
    );
}
