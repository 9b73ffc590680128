//! The worked examples of docs/SAMPLING.md, pinned to llama.cpp's semantics
//! (`src/llama-sampling.cpp`, `llama_sampler_penalties_apply`) where a naive
//! subtract-first reading of the penalties would differ.

mod common;

use common::*;
use samplerd_core_stages::{greedy::Greedy, temperature::Temperature, top_p::TopP};

const THE: u32 = 0;
const CAT: u32 = 1;
const A: u32 = 2;
const DOG: u32 = 3;
const SAID: u32 = 4;

fn the_cat_logits() -> Vec<f32> {
    // the, cat, a, dog, said
    vec![8.5, 7.9, 4.0, -2.0, 1.5]
}

/// Window: "the" three times, "a" once.
fn penalised(nums: &[(&str, f64)], window: &[u32], dense: bool) -> OwnedTokens {
    let (pen, mut st) = penalties_after(nums, window);
    let mut buf = tokens(&the_cat_logits(), dense);
    penalise(&pen, &mut st, &mut buf);
    buf
}

#[test]
fn the_cat_penalty_table() {
    for dense in [true, false] {
        let buf = penalised(&[("repeat_penalty", 1.1)], &[THE, A, THE, THE], dense);
        let l = |id| buf.logit(id).unwrap();
        assert!((l(THE) - 7.727_273).abs() < 1e-5, "the: {}", l(THE));
        assert_eq!(l(CAT), 7.9, "cat is not in the window");
        assert!((l(A) - 3.636_364).abs() < 1e-5, "a: {}", l(A));
        assert_eq!(l(DOG), -2.0);
        assert_eq!(l(SAID), 1.5);
        // cat now wins
        assert!(l(CAT) > l(THE));
    }
}

#[test]
fn negative_logit_in_window_is_multiplied() {
    let buf = penalised(&[("repeat_penalty", 1.1)], &[DOG], true);
    assert!((buf.logit(DOG).unwrap() - -2.2).abs() < 1e-6);
}

#[test]
fn frequency_presence_repeat_use_llama_cpp_order() {
    // the (count 3, 8.5) with frequency 0.5, presence 0.3, repeat 1.1:
    //   llama.cpp (÷ first):  8.5 / 1.1 - (3*0.5 + 0.3) = 5.92727
    //   subtract first:      (8.5 - 1.5 - 0.3) / 1.1   = 6.09091
    // a (count 1, 4.0):
    //   llama.cpp:            4.0 / 1.1 - (0.5 + 0.3)   = 2.83636
    //   subtract first:      (4.0 - 0 - 0.3) / 1.1      = 3.36364 (this also
    //                         drops a's frequency term; with it: 2.90909)
    let nums = [
        ("repeat_penalty", 1.1),
        ("frequency_penalty", 0.5),
        ("presence_penalty", 0.3),
    ];
    for dense in [true, false] {
        let buf = penalised(&nums, &[THE, A, THE, THE], dense);
        let the = buf.logit(THE).unwrap();
        let a = buf.logit(A).unwrap();
        assert!((the - 5.927_273).abs() < 1e-5, "the: {the}");
        assert!(
            (the - 6.090_909).abs() > 0.1,
            "must differ from the seed's order"
        );
        assert!((a - 2.836_364).abs() < 1e-5, "a: {a}");
        assert!((a - 3.363_636).abs() > 0.1);
        assert_eq!(buf.logit(CAT).unwrap(), 7.9);
    }
}

#[test]
fn seed_unit_case_freq_presence_then_repeat_differs() {
    // logit 4, count 1, frequency 1, presence 1, repeat 2:
    //   subtract first:              (4 - 1 - 1) / 2 = 1.0
    //   llama.cpp (÷ first):         4 / 2 - 1 - 1  = 0.0
    let nums = [
        ("repeat_penalty", 2.0),
        ("frequency_penalty", 1.0),
        ("presence_penalty", 1.0),
    ];
    let (pen, mut st) = penalties_after(&nums, &[0]);
    let mut buf = OwnedTokens::dense(&[4.0, 1.0]);
    penalise(&pen, &mut st, &mut buf);
    assert_eq!(buf.logit(0).unwrap(), 0.0);
    assert_ne!(buf.logit(0).unwrap(), 1.0);
}

#[test]
fn greedy_with_penalty_breaks_the_loop() {
    // Without the penalty greedy picks "the"; with it, "cat".
    let mut plain = OwnedTokens::dense(&the_cat_logits());
    run::<Greedy>(&[], &mut plain);
    assert_eq!(plain.selected(), Some(THE));

    let mut buf = penalised(&[("repeat_penalty", 1.1)], &[THE, A, THE, THE], true);
    run::<Greedy>(&[], &mut buf);
    assert_eq!(buf.selected(), Some(CAT));
}

fn nucleus_logits() -> Vec<f32> {
    [0.40f32, 0.30, 0.15, 0.10, 0.05]
        .iter()
        .map(|p| p.ln())
        .collect()
}

#[test]
fn nucleus_example_keeps_three_with_raw_logits() {
    let logits = nucleus_logits();
    // sorted candidates, shuffled candidates, dense
    let shuffled: Vec<(u32, f32)> = [3u32, 0, 4, 2, 1]
        .iter()
        .map(|&i| (i, logits[i as usize]))
        .collect();
    let sorted: Vec<(u32, f32)> = (0..5u32).map(|i| (i, logits[i as usize])).collect();
    let cases = [
        OwnedTokens::candidates(5, &sorted, true),
        OwnedTokens::candidates(5, &shuffled, false),
        OwnedTokens::dense(&logits),
    ];
    for mut buf in cases {
        run::<TopP>(&[("p", 0.8)], &mut buf);
        assert_eq!(buf.survivor_ids(), vec![0, 1, 2]);
        assert_eq!(buf.len(), 3);
        // raw logits untouched, not probabilities
        for (id, l) in buf.survivors() {
            assert_eq!(l, logits[id as usize]);
        }
    }
}

#[test]
fn nucleus_threshold_token_is_kept() {
    // p exactly reachable only by including the crossing token
    let kept = |p| run_dense::<TopP>(&[("p", p)], &nucleus_logits()).survivor_ids();
    assert_eq!(kept(0.71), vec![0, 1, 2]);
    assert_eq!(kept(0.69), vec![0, 1]);
}

#[test]
fn temperature_table() {
    let table: [(f64, [f64; 3]); 4] = [
        (0.5, [0.867, 0.117, 0.016]),
        (0.8, [0.731, 0.209, 0.060]),
        (1.0, [0.665, 0.245, 0.090]),
        (2.0, [0.507, 0.307, 0.186]),
    ];
    for (t, want) in table {
        for dense in [true, false] {
            let logits = [4.0f32, 3.0, 2.0];
            let mut buf = tokens(&logits, dense);
            run::<Temperature>(&[("t", t)], &mut buf);
            let scaled: Vec<f32> = (0..3).map(|i| buf.logit(i).unwrap()).collect();
            for (s, l) in scaled.iter().zip(logits) {
                assert!((s - l / t as f32).abs() < 1e-6);
            }
            let probs = softmax(&scaled);
            for (p, w) in probs.iter().zip(want) {
                assert!((p - w).abs() < 1e-3, "t={t}: {probs:?} vs {want:?}");
            }
        }
    }
}

#[test]
fn temperature_zero_is_greedy() {
    let mut buf = OwnedTokens::dense(&[4.0, 3.0, 2.0]);
    run::<Temperature>(&[("t", 0.0)], &mut buf);
    assert_eq!(buf.survivors(), vec![(0, 4.0)]);
}
