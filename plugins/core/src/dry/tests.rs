//! DRY against llama.cpp's own test cases (`tests/test-sampling.cpp`,
//! `test_dry`, expected values recomputed from their formulas), against a
//! quadratic reference implementation on random histories, and its breaker
//! processing on a tiny vocabulary.

use proptest::prelude::*;
use samplerd_plugin_sdk::abi::SD_TOKEN_BYTE;
use samplerd_plugin_sdk::prelude::*;
use samplerd_plugin_sdk::testing::{OwnedParams, OwnedTokens, TestRng, apply};

use super::*;

/// A DRY stage with breakers given as token sequences, as llama.cpp's
/// `llama_sampler_init_dry_testing` builds it.
fn dry(mult: f64, base: f64, allowed: i64, last_n: i64, seqs: &[Vec<u32>]) -> Dry {
    let mut d = OwnedParams::new()
        .number("multiplier", mult)
        .number("base", base)
        .number("allowed_length", allowed as f64)
        .number("penalty_last_n", last_n as f64)
        .strings("sequence_breakers", &[""])
        .build::<Dry>()
        .expect("valid parameters");
    d.breakers = Breakers::from_token_sequences(seqs);
    d
}

fn run(d: &Dry, history: &[u32], tokens: &mut OwnedTokens) {
    let mut st = d.new_state();
    for &t in history {
        d.accept(&mut st, t);
    }
    apply(d, &mut st, tokens, &mut TestRng::constant(0)).unwrap();
}

fn softmax(logits: &[f32]) -> Vec<f64> {
    let max = logits.iter().cloned().fold(f32::NEG_INFINITY, f32::max) as f64;
    let e: Vec<f64> = logits.iter().map(|&l| (l as f64 - max).exp()).collect();
    let z: f64 = e.iter().sum();
    e.iter().map(|v| v / z).collect()
}

/// llama.cpp's `test_dry`: logits ln(p), DRY, then the probabilities.
fn llama_case(
    probs: &[f32],
    history: &[u32],
    (mult, base, allowed, last_n): (f32, f32, i64, i64),
    seqs: &[Vec<u32>],
    penalised: &[(u32, usize)],
) {
    let logits: Vec<f32> = probs.iter().map(|p| p.ln()).collect();
    // The expectation from the formula: penalty = mult * base^(len - allowed)
    // for each token continuing a repeat of `len`.
    let mut want_logits = logits.clone();
    for &(id, len) in penalised {
        want_logits[id as usize] -= mult * base.powi((len as i64 - allowed) as i32);
    }
    let want = softmax(&want_logits);
    let d = dry(mult as f64, base as f64, allowed, last_n, seqs);
    for dense in [true, false] {
        let mut buf = if dense {
            OwnedTokens::dense(&logits)
        } else {
            OwnedTokens::dense_as_candidates(&logits)
        };
        run(&d, history, &mut buf);
        let got_logits: Vec<f32> = (0..probs.len() as u32)
            .map(|i| buf.logit(i).unwrap())
            .collect();
        let got = softmax(&got_logits);
        for (i, (g, w)) in got.iter().zip(&want).enumerate() {
            assert!(
                (g - w).abs() < 1e-5,
                "token {i}: {g} vs {w} (history {history:?}, dense {dense})"
            );
        }
    }
}

#[test]
fn llama_cpp_test_dry_cases() {
    let q = [0.25f32; 4];
    let f = [0.2f32; 5];
    // Two tokens only: no repeat longer than allowed_length.
    llama_case(&q, &[0, 1], (1.0, 1.1, 2, 4), &[], &[]);
    // "0 1" repeats, 2 followed it: 2 continues a repeat of length 2.
    llama_case(&q, &[0, 1, 2, 0, 1], (1.0, 1.1, 2, 5), &[], &[(2, 2)]);
    // Token 3 is a breaker: the repeat cannot reach back past it.
    llama_case(&f, &[0, 1, 3, 4, 0, 1], (1.0, 1.1, 2, 6), &[vec![3]], &[]);
    llama_case(&f, &[0, 1, 2, 0, 1], (2.0, 1.1, 2, 5), &[], &[(2, 2)]);
    // allowed_length 4: the repeat "0 1" is too short.
    llama_case(&f, &[0, 1, 2, 3, 4, 0, 1], (1.0, 1.1, 4, 7), &[], &[]);
}

/// The probabilities llama.cpp's test asserts, checked directly (1e-5).
#[test]
fn llama_cpp_expected_probabilities() {
    type Case<'a> = (&'a [f32], &'a [u32], f64, &'a [f32]);
    let cases: [Case; 2] = [
        (
            &[0.25; 4],
            &[0, 1, 2, 0, 1],
            1.0,
            &[0.296923, 0.296923, 0.109232, 0.296923],
        ),
        (
            &[0.2; 5],
            &[0, 1, 2, 0, 1],
            2.0,
            &[0.241818, 0.241818, 0.032727, 0.241818, 0.241818],
        ),
    ];
    for (probs, history, mult, want) in cases {
        let logits: Vec<f32> = probs.iter().map(|p| p.ln()).collect();
        let d = dry(mult, 1.1, 2, history.len() as i64, &[]);
        let mut buf = OwnedTokens::dense(&logits);
        run(&d, history, &mut buf);
        let got = softmax(buf.dense_logits());
        for (g, w) in got.iter().zip(want) {
            assert!((g - *w as f64).abs() < 1e-5, "{got:?} vs {want:?}");
        }
    }
}

/// A quadratic transcription of DRY's definition: for every position, the
/// longest suffix of the window that also ends there (not reaching back
/// past the most recent restart sequence), and the token after it.
fn reference(
    history: &[u32],
    window: usize,
    allowed: i64,
    seqs: &[Vec<u32>],
    n_vocab: usize,
) -> Vec<Option<usize>> {
    let n = history.len().min(window);
    let w = &history[history.len() - n..];
    let mut out = vec![None; n_vocab];
    if n == 0 || n as i64 <= allowed {
        return out;
    }
    // restart: the most recent end position of a whole restart sequence;
    // a repeat may not include its head or anything before.
    let mut limit = n;
    'scan: for i in 0..n {
        // head at w[n-1-i]; the longest sequence starting there that fits
        let head = n - 1 - i;
        let mut best: Option<usize> = None;
        for s in seqs.iter().filter(|s| !s.is_empty() && s[0] == w[head]) {
            let tail = s.len() - 1;
            if tail <= i && w[head + 1..head + 1 + tail] == s[1..] {
                best = Some(best.map_or(tail, |b: usize| b.max(tail)));
            }
        }
        if let Some(t) = best {
            limit = i - t;
            break 'scan;
        }
    }
    if (limit as i64) < allowed {
        return out;
    }
    for end in 0..n - 1 {
        // longest m with w[end+1-m..=end] == w[n-m..n], m <= end+1
        let mut m = 0;
        while m <= end && w[end - m] == w[n - 1 - m] {
            m += 1;
        }
        let m = m.min(limit);
        if m as i64 >= allowed {
            let next = w[end + 1] as usize;
            out[next] = Some(out[next].map_or(m, |o: usize| o.max(m)));
        }
    }
    out
}

proptest! {
    #[test]
    fn matches_the_quadratic_reference(
        history in prop::collection::vec(0u32..5, 0..60),
        window in 1usize..70,
        allowed in 0i64..4,
        seqs in prop::collection::vec(prop::collection::vec(0u32..5, 1..3), 0..3),
        mult in 0.5f32..3.0,
        base in 1.0f32..2.5,
        dense in any::<bool>(),
    ) {
        let n_vocab = 6;
        let single: Vec<u32> = seqs.iter().filter(|s| s.len() == 1).map(|s| s[0]).collect();
        let want = reference(&history, window, allowed, &seqs, n_vocab);
        let d = dry(mult as f64, base as f64, allowed, window as i64, &seqs);
        let logits: Vec<f32> = (0..n_vocab).map(|i| i as f32 * 0.5 - 1.0).collect();
        let mut buf = if dense {
            OwnedTokens::dense(&logits)
        } else {
            OwnedTokens::dense_as_candidates(&logits)
        };
        run(&d, &history, &mut buf);
        for id in 0..n_vocab as u32 {
            let l = logits[id as usize];
            let expect = match want[id as usize] {
                Some(len) if !single.contains(&id) => {
                    l - (mult as f64 * (base as f64).powf((len as i64 - allowed) as f64)) as f32
                }
                _ => l,
            };
            prop_assert_eq!(buf.logit(id).unwrap(), expect, "token {} of {:?}", id, history);
        }
    }
}

#[test]
fn the_window_is_the_last_penalty_last_n_tokens() {
    // (3 0 1 2) × 10, then 3 0 1: within the last 5 tokens (1 2 3 0 1)
    // "0 1" never repeats; within 6 (0 1 2 3 0 1) it does, followed by 2;
    // over the whole history the repeat is 39 tokens long.
    let mut history: Vec<u32> = (0..40).map(|i| i % 4).map(|i| (i + 3) % 4).collect();
    history.extend([3, 0, 1]);
    let logits = [0.0f32; 4];
    let after = |last_n: i64| {
        let d = dry(1.0, 1.5, 2, last_n, &[]);
        let mut buf = OwnedTokens::dense(&logits);
        run(&d, &history, &mut buf);
        buf.dense_logits()[2]
    };
    assert_eq!(after(5), 0.0);
    assert_eq!(after(6), -1.0);
    assert_eq!(after(-1), -((1.5f64).powf(37.0) as f32));
    assert_eq!(after(-1), after(history.len() as i64));
}

#[test]
fn off_values_change_nothing_and_keep_no_history() {
    for (mult, base, last_n) in [(0.0, 1.75, -1), (1.0, 0.99, -1), (1.0, 1.75, 0)] {
        let d = dry(mult, base, 2, last_n, &[]);
        let mut st = d.new_state();
        for t in [0, 1, 2, 0, 1] {
            d.accept(&mut st, t);
        }
        assert!(st.ring.is_empty());
        let mut buf = OwnedTokens::dense(&[0.0; 4]);
        apply(&d, &mut st, &mut buf, &mut TestRng::constant(0)).unwrap();
        assert_eq!(buf.dense_logits(), &[0.0; 4]);
    }
}

#[test]
fn the_exponent_is_clamped_so_the_penalty_stays_finite() {
    // A repeat of 300 at base 2: 2^298 overflows f32; llama.cpp clamps the
    // exponent to floor(88.72 / ln 2) = 128.
    let history = [0u32; 300];
    let d = dry(1e-30, 2.0, 2, -1, &[]);
    let mut buf = OwnedTokens::dense(&[0.0, 0.0]);
    run(&d, &history, &mut buf);
    let want = (1e-30f32 as f64 * 2f64.powi(128)) as f32;
    assert_eq!(buf.dense_logits()[0], -want);
    assert!(want.is_finite());
    // multiplier large: saturates instead of -inf
    let d = dry(1e30, 2.0, 2, -1, &[]);
    let mut buf = OwnedTokens::dense(&[0.0, 0.0]);
    run(&d, &history, &mut buf);
    assert_eq!(buf.dense_logits()[0], -f32::MAX);
}

#[test]
fn parameter_errors_name_the_parameter_and_value() {
    let err = |p: OwnedParams| p.build::<Dry>().err().unwrap();
    assert_eq!(
        err(OwnedParams::new().number("penalty_last_n", -2.0)),
        "dry: penalty_last_n must be in [-1, 65536], got -2"
    );
    assert_eq!(
        err(OwnedParams::new().number("multiplier", f64::INFINITY)),
        "dry: multiplier must be finite, got inf"
    );
    assert_eq!(
        err(OwnedParams::new().number("allowed_length", 1.5)),
        "dry: allowed_length must be an integer, got 1.5"
    );
    let many: Vec<String> = (0..65).map(|i| i.to_string()).collect();
    let many: Vec<&str> = many.iter().map(String::as_str).collect();
    assert_eq!(
        err(OwnedParams::new().strings("sequence_breakers", &many)),
        "dry: sequence_breakers must be at most 64 strings, got 65"
    );
}

#[test]
fn without_a_vocabulary_breakers_are_refused_only_when_they_matter() {
    let on = OwnedParams::new().number("multiplier", 0.8);
    let e = on.build::<Dry>().err().unwrap();
    assert!(
        e.starts_with("dry: sequence_breakers must be [\"\"] (none) without a vocabulary")
            && e.contains("[\"\\n\", \":\", \"\\\"\", \"*\"]")
            && e.contains("params.vocabulary"),
        "{e}"
    );
    // no breaker, or DRY off: nothing needs the vocabulary
    let none = OwnedParams::new()
        .number("multiplier", 0.8)
        .strings("sequence_breakers", &["", ""]);
    assert!(none.build::<Dry>().is_ok());
    assert!(OwnedParams::new().build::<Dry>().is_ok());
    assert!(
        OwnedParams::new()
            .number("multiplier", 0.8)
            .number("base", 0.5)
            .build::<Dry>()
            .is_ok()
    );
}

/// A vocabulary of plain byte strings.
struct Words(Vec<(&'static [u8], u32)>);

impl TokenText for Words {
    fn n_vocab(&self) -> usize {
        self.0.len()
    }
    fn bytes(&self, id: u32) -> &[u8] {
        self.0[id as usize].0
    }
    fn attr(&self, id: u32) -> u32 {
        self.0[id as usize].1
    }
}

#[test]
fn breaker_strings_become_llama_cpp_restart_sequences() {
    let v = Words(vec![
        (b"a", 0),                 // 0
        (b"b", 0),                 // 1
        (b"\n", 0),                // 2
        (b"x:", 0),                // 3 contains ":"
        (b"##", 0),                // 4
        (b" #", 0),                // 5 ends with "#" → tail of "##x"[1..] = "#x"
        (b"x", 0),                 // 6
        (b"<#", SD_TOKEN_CONTROL), // 7 control, never in a tail
        (b"#", 0),                 // 8
        (b"q##x", 0),              // 9 contains "##x"
        (b"\n", SD_TOKEN_BYTE),    // 10 byte token: loses to token 2 in tails
    ]);
    let b = Breakers::from_strings(&v, &["\n", ":", "##x", ""]);
    let single: Vec<u32> = (0..11).filter(|&i| b.is_single(i)).collect();
    assert_eq!(single, [2, 3, 9, 10]);
    // "##x": " #" ends with "#" → tail tokenize("#x") = ["#", "x"];
    // "##" ends with "##" → tail "x"; and with "#" (pos 1) → "#x".
    assert_eq!(b.tails(5), [vec![8, 6]]);
    assert_eq!(b.tails(4), [vec![6], vec![8, 6]]);
    assert_eq!(b.tails(8), [vec![8, 6]]);
    assert_eq!(b.tails(7), [vec![8, 6]], "a control token can be a head");
    assert!(b.tails(0).is_empty() && b.tails(6).is_empty());
}

#[test]
fn breakers_are_cut_to_40_bytes_and_tails_to_20_tokens() {
    let v = Words(vec![(b"a", 0), (b"z", 0)]);
    // 45 × "a" cut to 40: the head "a" ends with the prefix "a", its tail
    // is 39 × "a" → 20 tokens.
    let long = "a".repeat(45);
    let b = Breakers::from_strings(&v, &[&long]);
    assert_eq!(b.tails(0), [vec![0; MAX_TAIL_TOKENS]]);
    // a tail with a byte no token spells is never matched: left out
    let b = Breakers::from_strings(&v, &["aq"]);
    assert!(b.is_empty());
}

#[test]
fn a_restart_sequence_limits_the_repeat() {
    // 5 0 1 2 5 0 1: the suffix "5 0 1" repeats (length 3), followed by 2.
    let history = [5, 0, 1, 2, 5, 0, 1];
    let after = |seqs: &[Vec<u32>]| {
        let d = dry(1.0, 2.0, 2, -1, seqs);
        let mut buf = OwnedTokens::dense(&[0.0; 6]);
        run(&d, &history, &mut buf);
        buf.dense_logits()[2]
    };
    assert_eq!(after(&[]), -2.0); // 2^(3 - 2)
    // the single-token breaker 5 cuts the repeat to "0 1": 2^0
    assert_eq!(after(&[vec![5]]), -1.0);
    // "5 0" is complete in the suffix: the repeat is cut to "1", too short
    assert_eq!(after(&[vec![5, 0]]), 0.0);
    // "5 1" never occurs: no limit
    assert_eq!(after(&[vec![5, 1]]), -2.0);
}
