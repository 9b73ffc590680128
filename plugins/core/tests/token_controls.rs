//! `token_controls` against a transcription of vLLM's semantics: its
//! `MinTokensLogitsProcessor` (end tokens at -inf while fewer than
//! `min_tokens` tokens were generated) and `_apply_bad_words_single_batch`
//! (vllm/v1/sample/ops/bad_words.py), over random outputs, in both views
//! and through `try_accept` (a masked token cannot be accepted).

mod common;

use common::*;
use proptest::prelude::*;
use samplerd_core_stages::token_controls::TokenControls;
use samplerd_plugin_sdk::Stage;

/// vLLM's rule, written as vLLM writes it: the ids masked after `past`.
fn reference_masked(
    min_tokens: usize,
    end_tokens: &[u32],
    bad_words: &[Vec<u32>],
    past: &[u32],
) -> Vec<u32> {
    let mut out = Vec::new();
    if past.len() < min_tokens {
        out.extend_from_slice(end_tokens);
    }
    for word in bad_words {
        if word.len() > past.len() + 1 {
            continue;
        }
        let prefix_length = word.len() - 1;
        let actual = &past[past.len() - prefix_length..];
        if actual == &word[..prefix_length] {
            out.push(word[prefix_length]);
        }
    }
    out.sort_unstable();
    out.dedup();
    out
}

fn build(min_tokens: usize, end_tokens: &[u32], bad_words: &[Vec<u32>]) -> TokenControls {
    let end: Vec<String> = end_tokens.iter().map(u32::to_string).collect();
    let words: Vec<String> = bad_words
        .iter()
        .map(|w| w.iter().map(u32::to_string).collect::<Vec<_>>().join(" "))
        .collect();
    OwnedParams::new()
        .number("min_tokens", min_tokens as f64)
        .strings(
            "end_tokens",
            &end.iter().map(String::as_str).collect::<Vec<_>>(),
        )
        .strings(
            "bad_words",
            &words.iter().map(String::as_str).collect::<Vec<_>>(),
        )
        .build::<TokenControls>()
        .unwrap()
}

/// The ids the stage masks (set to -inf) out of all-zero logits.
fn masked(stage: &TokenControls, st: &mut <TokenControls as Stage>::State, n: usize) -> Vec<u32> {
    let mut out = Vec::new();
    for mut t in both_views(&vec![0.0; n]) {
        apply(stage, st, &mut t, &mut TestRng::constant(0)).unwrap();
        let mut ids: Vec<u32> = t
            .entries()
            .into_iter()
            .filter(|&(_, l)| l == f32::NEG_INFINITY)
            .map(|(id, _)| id)
            .collect();
        ids.sort_unstable();
        if t.is_dense() {
            out = ids;
        } else {
            assert_eq!(
                ids, out,
                "the candidate view masks what the dense view masks"
            );
        }
    }
    out
}

const N: usize = 8;

proptest! {
    #![proptest_config(ProptestConfig::with_cases(256))]

    /// Over a random output (of a small vocabulary, so that bad-word
    /// prefixes occur), each step masks exactly what vLLM masks, and a
    /// masked token is refused by `try_accept` without changing the state.
    #[test]
    fn masks_what_vllm_masks(
        min_tokens in 0usize..6,
        end_tokens in proptest::collection::vec(0u32..N as u32, 0..3),
        bad_words in proptest::collection::vec(proptest::collection::vec(0u32..N as u32, 1..4), 0..4),
        output in proptest::collection::vec(0u32..N as u32, 0..12),
    ) {
        let stage = build(min_tokens, &end_tokens, &bad_words);
        let mut st = stage.new_state();
        let mut past = Vec::new();
        for &t in &output {
            let want = reference_masked(min_tokens, &end_tokens, &bad_words, &past);
            prop_assert_eq!(masked(&stage, &mut st, N), want.clone(), "after {:?}", past);
            if want.contains(&t) {
                prop_assert!(stage.try_accept(&mut st, t).is_err());
            } else {
                stage.try_accept(&mut st, t).unwrap();
                past.push(t);
            }
        }
    }
}

#[test]
fn end_tokens_are_masked_until_min_tokens_then_free() {
    let stage = build(2, &[7], &[]);
    let mut st = stage.new_state();
    assert_eq!(masked(&stage, &mut st, N), vec![7]);
    stage.try_accept(&mut st, 1).unwrap();
    assert_eq!(masked(&stage, &mut st, N), vec![7]);
    assert!(stage.try_accept(&mut st, 7).is_err());
    stage.try_accept(&mut st, 1).unwrap();
    assert_eq!(masked(&stage, &mut st, N), Vec::<u32>::new());
    stage.try_accept(&mut st, 7).unwrap();
}

#[test]
fn a_bad_word_is_masked_only_after_its_prefix() {
    let stage = build(0, &[], &[vec![3, 4, 5], vec![6]]);
    let mut st = stage.new_state();
    assert_eq!(masked(&stage, &mut st, N), vec![6]);
    stage.try_accept(&mut st, 3).unwrap();
    assert_eq!(masked(&stage, &mut st, N), vec![6]);
    stage.try_accept(&mut st, 4).unwrap();
    assert_eq!(masked(&stage, &mut st, N), vec![5, 6]);
    stage.try_accept(&mut st, 2).unwrap();
    assert_eq!(masked(&stage, &mut st, N), vec![6]);
}

#[test]
fn ids_outside_the_vocabulary_are_skipped() {
    let stage = build(1, &[100], &[vec![200]]);
    let mut st = stage.new_state();
    assert_eq!(masked(&stage, &mut st, N), Vec::<u32>::new());
}

#[test]
fn bad_parameters_name_the_parameter_and_value() {
    let err = |p: OwnedParams| p.build::<TokenControls>().err().unwrap();
    assert_eq!(
        err(OwnedParams::new().number("min_tokens", -1.0)),
        "token_controls: min_tokens must be in [0, 4294967295], got -1"
    );
    assert_eq!(
        err(OwnedParams::new().strings("end_tokens", &["7", "x1"])),
        "token_controls: end_tokens holds \"x1\", which is not a token id (a decimal u32)"
    );
    assert_eq!(
        err(OwnedParams::new().strings("bad_words", &["1 2", "  "])),
        "token_controls: bad_words[1] holds no token id"
    );
    let long = vec!["1"; 257].join(" ");
    assert_eq!(
        err(OwnedParams::new().strings("bad_words", &[&long])),
        "token_controls: bad_words[0] must be at most 256 ids"
    );
}
