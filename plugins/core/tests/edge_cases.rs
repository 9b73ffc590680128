//! Edge cases and parameter validation of every stage.

mod common;

use common::*;
use samplerd_core_stages::{
    dist::Dist, greedy::Greedy, logit_bias::LogitBias, min_p::MinP, mirostat::Mirostat,
    mirostat::MirostatV2, penalties::Penalties, temperature::Temperature, top_k::TopK,
    top_n_sigma::TopNSigma, top_p::TopP, typical_p::TypicalP, xtc::Xtc,
};
use samplerd_plugin_sdk::Stage;

const NEG: f32 = f32::NEG_INFINITY;

// ----------------------------------------------------------------- validation

/// Asserts that `S` refuses each `(parameter, value)` with exactly the
/// message given.
fn assert_refuses<S: Stage>(cases: &[(&str, f64, &str)]) {
    for &(name, value, want) in cases {
        assert_eq!(build_err::<S>(&[(name, value)]), want);
    }
}

#[test]
fn invalid_parameters_name_the_parameter_and_value() {
    // Per stage: (parameter, value, the whole message it must give).
    assert_refuses::<TopP>(&[
        ("p", 1.5, "top_p: p must be <= 1, got 1.5"),
        ("p", f64::NAN, "top_p: p must be a number, got NaN"),
    ]);
    assert_refuses::<TopK>(&[
        ("k", -1.0, "top_k: k must be in [0, 4294967295], got -1"),
        ("k", 2.5, "top_k: k must be an integer, got 2.5"),
    ]);
    assert_refuses::<Penalties>(&[
        (
            "repeat_penalty",
            0.0,
            "penalties: repeat_penalty must be finite and > 0, got 0",
        ),
        (
            "frequency_penalty",
            -0.5,
            "penalties: frequency_penalty must be finite and >= 0, got -0.5",
        ),
        (
            "presence_penalty",
            -1.0,
            "penalties: presence_penalty must be finite and >= 0, got -1",
        ),
        (
            "repeat_last_n",
            -2.0,
            "penalties: repeat_last_n must be in [-1, 65536], got -2",
        ),
    ]);
    assert_refuses::<Temperature>(&[(
        "t",
        -0.1,
        "temperature: t must be finite and >= 0, got -0.1",
    )]);
    assert_refuses::<MinP>(&[
        ("p", f64::NAN, "min_p: p must be a number, got NaN"),
        (
            "min_keep",
            -1.0,
            "min_p: min_keep must be in [0, 4294967295], got -1",
        ),
    ]);
    assert_refuses::<TypicalP>(&[("p", -0.1, "typical_p: p must be in [0, 1], got -0.1")]);
    assert_refuses::<Xtc>(&[(
        "probability",
        2.0,
        "xtc: probability must be in [0, 1], got 2",
    )]);
    assert_refuses::<Mirostat>(&[("m", 0.0, "mirostat: m must be in [1, 4294967295], got 0")]);
    assert_eq!(
        OwnedParams::new()
            .token_map("bias", &[(3, f32::NAN)])
            .build::<LogitBias>()
            .err()
            .unwrap(),
        "logit_bias: bias for token 3 must be finite or -inf, got NaN"
    );
    // (the error, a part it must contain)
    let partial = [
        (
            build_err::<Penalties>(&[("repeat_penalty", f64::NAN)]),
            "NaN",
        ),
        (
            build_err::<Temperature>(&[("t", f64::NAN)]),
            "t must be a number, got NaN",
        ),
    ];
    for (got, part) in partial {
        assert!(got.contains(part), "{got:?} should contain {part:?}");
    }
    // (the error, how it must start)
    let prefixed = [
        (
            build_err::<TopNSigma>(&[("n", f64::INFINITY)]),
            "top_n_sigma: n must be finite",
        ),
        (
            build_err::<MirostatV2>(&[("tau", -1.0)]),
            "mirostat_v2: tau",
        ),
    ];
    for (got, start) in prefixed {
        assert!(
            got.starts_with(start),
            "{got:?} should start with {start:?}"
        );
    }
    assert!(OwnedParams::new().number("q", 1.0).build::<TopK>().is_err());
    assert!(
        OwnedParams::new()
            .token_map("bias", &[(3, f32::INFINITY)])
            .build::<LogitBias>()
            .is_err()
    );
}

#[test]
fn defaults_build() {
    let _: TopK = stage(&[]);
    let _: TopP = stage(&[]);
    let _: MinP = stage(&[]);
    let _: TypicalP = stage(&[]);
    let _: Temperature = stage(&[]);
    let _: TopNSigma = stage(&[]);
    let _: Xtc = stage(&[]);
    let _: Penalties = stage(&[]);
    let _: Mirostat = stage(&[]);
    let _: MirostatV2 = stage(&[]);
    let _: LogitBias = stage(&[]);
}

// ---------------------------------------------------------------------- top_k

#[test]
fn top_k_zero_is_off() {
    let mut buf = OwnedTokens::dense(&[1.0, 3.0, 2.0]);
    run::<TopK>(&[("k", 0.0)], &mut buf);
    assert!(buf.is_dense());
    assert_eq!(buf.dense_logits(), &[1.0, 3.0, 2.0]);
}

#[test]
fn top_k_keeps_exactly_k_sorted() {
    let logits = normal_logits(5000, 3.0, 1);
    let mut want = id_pairs(&logits);
    sort_desc(&mut want);
    for k in [1usize, 2, 40, 64, 65, 256, 257, 1000] {
        for dense in [true, false] {
            let mut buf = tokens(&logits, dense);
            run::<TopK>(&[("k", k as f64)], &mut buf);
            assert_eq!(buf.entries(), want[..k].to_vec(), "k={k} dense={dense}");
            assert!(buf.is_sorted());
        }
    }
}

#[test]
fn top_k_at_least_size_keeps_all_sorted() {
    for k in [3.0, 4.0, 100.0] {
        let mut buf = OwnedTokens::dense(&[1.0, 3.0, 2.0]);
        run::<TopK>(&[("k", k)], &mut buf);
        assert_eq!(buf.entries(), vec![(1, 3.0), (2, 2.0), (0, 1.0)]);
        assert!(buf.is_sorted());
    }
}

#[test]
fn top_k_ties_keep_lower_ids_exactly_k() {
    let mut buf = OwnedTokens::dense(&[1.0, 2.0, 2.0, 2.0, 0.0]);
    run::<TopK>(&[("k", 2.0)], &mut buf);
    assert_eq!(buf.entries(), vec![(1, 2.0), (2, 2.0)]);
    // ties across chunk boundaries: all equal
    let flat = vec![0.5f32; 1000];
    let mut buf = OwnedTokens::dense(&flat);
    run::<TopK>(&[("k", 5.0)], &mut buf);
    assert_eq!(
        buf.entries().iter().map(|e| e.0).collect::<Vec<_>>(),
        vec![0, 1, 2, 3, 4]
    );
}

#[test]
fn top_k_with_neg_inf_keeps_exactly_k() {
    let mut buf = OwnedTokens::dense(&[NEG, 1.0, NEG, 2.0]);
    run::<TopK>(&[("k", 3.0)], &mut buf);
    assert_eq!(buf.entries(), vec![(3, 2.0), (1, 1.0), (0, NEG)]);
}

#[test]
fn top_k_on_sorted_candidates_truncates() {
    let mut buf = OwnedTokens::candidates(10, &[(7, 5.0), (2, 4.0), (9, 1.0)], true);
    run::<TopK>(&[("k", 2.0)], &mut buf);
    assert_eq!(buf.entries(), vec![(7, 5.0), (2, 4.0)]);
}

#[test]
fn tiny_vocabularies() {
    for logits in [vec![0.3f32], vec![0.3, -1.0]] {
        for survivors in [
            run_dense::<TopK>(&[("k", 1.0)], &logits),
            run_dense::<TopP>(&[("p", 0.5)], &logits),
            run_dense::<MinP>(&[("p", 0.5)], &logits),
        ] {
            assert_eq!(survivors.survivor_ids(), vec![0]);
        }
        assert!(run_dense::<Dist>(&[], &logits).selected().is_some());
        assert_eq!(run_dense::<Greedy>(&[], &logits).selected(), Some(0));
        assert!(!run_dense::<TypicalP>(&[("p", 0.5)], &logits).is_empty());
        assert_eq!(
            run_dense::<TopNSigma>(&[("n", 0.5)], &logits).survivor_ids()[0],
            0
        );
    }
}

// ---------------------------------------------------------------------- top_p

#[test]
fn top_p_one_is_off() {
    let mut buf = OwnedTokens::dense(&[1.0, 2.0]);
    run::<TopP>(&[("p", 1.0)], &mut buf);
    assert!(buf.is_dense());
    let mut buf = OwnedTokens::candidates(3, &[(2, 1.0), (0, 2.0)], false);
    run::<TopP>(&[("p", 1.0)], &mut buf);
    assert_eq!(buf.entries(), vec![(2, 1.0), (0, 2.0)]);
}

#[test]
fn top_p_min_keep() {
    let logits = [5.0f32, 1.0, 0.0, -1.0];
    for dense in [true, false] {
        let mut buf = tokens(&logits, dense);
        run::<TopP>(&[("p", 0.01), ("min_keep", 3.0)], &mut buf);
        assert_eq!(buf.survivor_ids(), vec![0, 1, 2], "dense={dense}");
        let mut buf = tokens(&logits, dense);
        run::<TopP>(&[("p", 0.01)], &mut buf);
        assert_eq!(buf.survivor_ids(), vec![0]);
    }
}

#[test]
fn top_p_drops_neg_inf() {
    let logits = [NEG, 0.0, NEG, 0.0];
    for dense in [true, false] {
        let mut buf = tokens(&logits, dense);
        run::<TopP>(&[("p", 0.99)], &mut buf);
        assert_eq!(buf.survivor_ids(), vec![1, 3]);
        assert_eq!(buf.len(), 2);
    }
}

#[test]
fn top_p_ties_at_the_cut_keep_lower_ids() {
    // four equal tokens, p = 0.5 -> two of them
    let logits = [1.0f32, 1.0, 1.0, 1.0];
    for dense in [true, false] {
        let mut buf = tokens(&logits, dense);
        run::<TopP>(&[("p", 0.45)], &mut buf);
        assert_eq!(buf.survivor_ids(), vec![0, 1], "dense={dense}");
    }
}

#[test]
fn top_p_large_paths_match_sort_then_cut() {
    for seed in 0..6u64 {
        let logits = normal_logits(20_000, 3.0, seed);
        let pairs = id_pairs(&logits);
        for p in [0.5f32, 0.9, 0.95, 0.99] {
            let (want, margin) = reference_top_p(&pairs, p, 1);
            if margin < 1e-5 {
                continue; // within float rounding of p: documented
            }
            for dense in [true, false] {
                let mut buf = tokens(&logits, dense);
                run::<TopP>(&[("p", p as f64)], &mut buf);
                assert_eq!(buf.survivor_ids(), want, "seed {seed} p {p} dense {dense}");
                assert_eq!(buf.len(), want.len());
                for (id, l) in buf.survivors() {
                    assert_eq!(l, logits[id as usize], "raw logits kept");
                }
            }
        }
    }
}

#[test]
fn top_p_small_output_is_sorted() {
    let logits = normal_logits(3000, 3.0, 9);
    let mut buf = OwnedTokens::dense(&logits);
    run::<TopP>(&[("p", 0.3)], &mut buf);
    assert!(buf.len() <= 1024);
    assert!(buf.is_sorted());
    let e = buf.entries();
    assert!(e.windows(2).all(|w| w[0].1 >= w[1].1));
}

// ---------------------------------------------------------------------- min_p

#[test]
fn min_p_basics() {
    // ln 0.05 = -2.9957: keeps logits >= max - 2.9957
    let logits = [0.0f32, -1.0, -3.5, -2.9, NEG];
    let sorted: Vec<(u32, f32)> = vec![(0, 0.0), (1, -1.0), (3, -2.9), (2, -3.5), (4, NEG)];
    let cases = [
        OwnedTokens::dense(&logits),
        OwnedTokens::dense_as_candidates(&logits),
        OwnedTokens::candidates(5, &sorted, true),
    ];
    for mut buf in cases {
        run::<MinP>(&[("p", 0.05)], &mut buf);
        assert_eq!(buf.survivor_ids(), vec![0, 1, 3]);
        assert_eq!(buf.len(), 3);
    }
    // p = 0 off
    let mut buf = OwnedTokens::dense(&logits);
    run::<MinP>(&[("p", 0.0)], &mut buf);
    assert!(buf.is_dense());
    // min_keep
    for mut buf in both_views(&logits) {
        run::<MinP>(&[("p", 0.9), ("min_keep", 3.0)], &mut buf);
        assert_eq!(buf.survivor_ids(), vec![0, 1, 3]);
    }
}

#[test]
fn min_p_unsorted_keeps_order() {
    let mut buf = OwnedTokens::candidates(5, &[(4, -0.5), (0, 0.0), (2, -9.0), (1, -1.0)], false);
    run::<MinP>(&[("p", 0.1)], &mut buf);
    assert_eq!(buf.entries(), vec![(4, -0.5), (0, 0.0), (1, -1.0)]);
    assert!(!buf.is_sorted());
}

// ------------------------------------------------------------------ typical_p

/// llama.cpp's typical sampling in f64, returns the kept ids in order.
fn reference_typical(logits: &[f32], p: f64, min_keep: usize) -> Vec<u32> {
    let mut v = id_pairs(logits);
    sort_desc(&mut v);
    let probs = softmax(&v.iter().map(|x| x.1).collect::<Vec<_>>());
    let h: f64 = probs
        .iter()
        .filter(|&&p| p > 0.0)
        .map(|&p| -p * p.ln())
        .sum();
    let mut idx: Vec<usize> = (0..v.len()).collect();
    idx.sort_by(|&a, &b| {
        ((-probs[a].ln() - h).abs())
            .total_cmp(&(-probs[b].ln() - h).abs())
            .then(a.cmp(&b))
    });
    let mut cum = 0.0;
    let mut last = idx.len();
    for (i, &j) in idx.iter().enumerate() {
        cum += probs[j];
        if cum > p && (min_keep == 0 || i + 1 >= min_keep) {
            last = i + 1;
            break;
        }
    }
    idx[..last].iter().map(|&j| v[j].0).collect()
}

#[test]
fn typical_p_matches_reference() {
    let mut buf = OwnedTokens::dense(&[1.0, 2.0]);
    run::<TypicalP>(&[("p", 1.0)], &mut buf);
    assert!(buf.is_dense(), "p = 1 is off");
    for seed in 0..5 {
        let logits = normal_logits(50, 2.0, seed);
        for p in [0.2, 0.5, 0.9] {
            let want = reference_typical(&logits, p, 1);
            let mut buf = OwnedTokens::dense(&logits);
            run::<TypicalP>(&[("p", p)], &mut buf);
            let got: Vec<u32> = buf.entries().iter().map(|e| e.0).collect();
            assert_eq!(got, want, "seed {seed} p {p}");
        }
    }
    let logits = normal_logits(50, 2.0, 3);
    let mut buf = OwnedTokens::dense(&logits);
    run::<TypicalP>(&[("p", 0.0), ("min_keep", 7.0)], &mut buf);
    assert_eq!(buf.len(), 7);
}

// ---------------------------------------------------------------- temperature

#[test]
fn temperature_zero_keeps_first_max() {
    for mut buf in both_views(&[1.0, 3.0, 3.0, NEG]) {
        run::<Temperature>(&[("t", 0.0)], &mut buf);
        assert_eq!(buf.survivors(), vec![(1, 3.0)]);
    }
}

#[test]
fn temperature_leaves_neg_inf() {
    let mut buf = OwnedTokens::dense(&[1.0, NEG]);
    run::<Temperature>(&[("t", 0.5)], &mut buf);
    assert_eq!(buf.dense_logits(), &[2.0, NEG]);
}

#[test]
fn dynatemp_uses_entropy() {
    // uniform distribution: normalised entropy 1 -> t + range
    let mut buf = OwnedTokens::dense(&[1.0, 1.0, 1.0, 1.0]);
    run::<Temperature>(&[("t", 1.0), ("dynatemp_range", 0.5)], &mut buf);
    for (_, l) in buf.survivors() {
        assert!((l - 1.0 / 1.5).abs() < 1e-5, "{l}");
    }
    // peaked distribution: low entropy -> close to t - range
    let buf = run_dense::<Temperature>(&[("t", 1.0), ("dynatemp_range", 0.5)], &[30.0, 0.0, 0.0]);
    assert!((buf.logit(0).unwrap() - 60.0).abs() < 0.1);
    assert!(buf.is_sorted());
}

// ---------------------------------------------------------------- top_n_sigma

#[test]
fn top_n_sigma_basics() {
    // mean 2, σ = sqrt(2) = 1.414: bound 4 - 1.414 = 2.586 -> keeps 3 and 4
    let logits = [0.0f32, 1.0, 2.0, 3.0, 4.0, NEG];
    for mut buf in both_views(&logits) {
        run::<TopNSigma>(&[("n", 1.0)], &mut buf);
        assert_eq!(buf.survivors(), vec![(4, 4.0), (3, 3.0)]);
        assert!(buf.is_sorted());
    }
    let mut buf = OwnedTokens::dense(&logits);
    run::<TopNSigma>(&[("n", -1.0)], &mut buf);
    assert!(buf.is_dense(), "n <= 0 is off");
    let mut buf = OwnedTokens::dense(&[NEG, NEG]);
    run::<TopNSigma>(&[("n", 1.0)], &mut buf);
    assert!(buf.is_dense(), "nothing finite: unchanged");
}

/// Found by the chain fuzzer: ±f32::MAX logits in different 64-wide chunks
/// overflow the dense mean to inf − inf = NaN, and a NaN bound used to mask
/// every token (so `dist` had nothing left). llama.cpp masks only
/// `logit < bound`, never true for NaN: nothing is masked. (The candidate
/// view sums in f64 without overflow and keeps the maxima.)
#[test]
fn top_n_sigma_with_a_nan_bound_masks_nothing() {
    let mut logits = vec![-1.0f32; 192];
    logits[..8].fill(f32::MAX);
    logits[64..72].fill(f32::MIN);
    logits[150] = NEG;
    let mut buf = OwnedTokens::dense(&logits);
    run::<TopNSigma>(&[("n", 0.25)], &mut buf);
    let mut finite: Vec<(u32, f32)> = buf
        .survivors()
        .into_iter()
        .filter(|(_, l)| l.is_finite())
        .collect();
    finite.sort_by_key(|&(id, _)| id);
    let expected: Vec<(u32, f32)> = (0u32..)
        .zip(logits.iter().copied())
        .filter(|(_, l)| l.is_finite())
        .collect();
    assert_eq!(finite, expected, "every finite logit survives, unchanged");
    let mut buf = OwnedTokens::dense_as_candidates(&logits);
    run::<TopNSigma>(&[("n", 0.25)], &mut buf);
    let kept = buf.survivors();
    assert!(
        (0..8).all(|id| kept.contains(&(id, f32::MAX))),
        "the maxima survive: {kept:?}"
    );
}

// ------------------------------------------------------------------------ xtc

#[test]
fn xtc_removes_top_choices() {
    let logits: Vec<f32> = [0.5f32, 0.3, 0.15, 0.05].iter().map(|p| p.ln()).collect();
    // XTC with `nums` and its dart at `u`, on `logits`.
    let xtc = |nums: &[(&str, f64)], u: f64| {
        let mut buf = OwnedTokens::dense(&logits);
        apply_once::<Xtc>(&params(nums), &mut buf, &mut TestRng::uniform(u)).unwrap();
        buf
    };
    let nums = [("probability", 0.5), ("threshold", 0.1)];
    // dart 0.1 <= 0.5: triggers; tokens >= 0.1: 0, 1, 2 -> drop 0 and 1
    assert_eq!(xtc(&nums, 0.1).survivor_ids(), vec![2, 3]);
    // dart 0.9 > 0.5: no-op
    assert!(xtc(&nums, 0.9).is_dense());
    // min_keep 3 prevents it
    let p3 = [("probability", 1.0), ("threshold", 0.1), ("min_keep", 3.0)];
    assert_eq!(xtc(&p3, 0.0).survivor_ids(), vec![0, 1, 2, 3]);
    // threshold > 0.5: off
    let off = [("probability", 1.0), ("threshold", 0.6)];
    assert!(xtc(&off, 0.0).is_dense());
}

// ----------------------------------------------------------------- selection

/// Runs `dist` on `tokens` with its dart at `u`.
fn dist_at(u: f64, tokens: &mut OwnedTokens) -> Result<(), String> {
    apply_once::<Dist>(&OwnedParams::new(), tokens, &mut TestRng::uniform(u))
}

#[test]
fn dist_walks_in_candidate_order() {
    // probabilities 0.5, 0.25, 0.25 in candidate order 2, 0, 1
    let l = [0.25f32.ln(), 0.25f32.ln(), 0.5f32.ln()];
    let cands = [(2u32, l[2]), (0, l[0]), (1, l[1])];
    for (u, want) in [
        (0.0, 2),
        (0.49, 2),
        (0.51, 0),
        (0.74, 0),
        (0.76, 1),
        (0.999, 1),
    ] {
        let mut buf = OwnedTokens::candidates(3, &cands, false);
        dist_at(u, &mut buf).unwrap();
        assert_eq!(buf.selected(), Some(want), "u = {u}");
        assert_eq!(
            buf.entries(),
            cands.to_vec(),
            "dist must not modify the candidates"
        );
    }
    // dense view walks in id order: 0 (0.25), 1 (0.25), 2 (0.5)
    for (u, want) in [(0.0, 0), (0.3, 1), (0.6, 2)] {
        let mut buf = OwnedTokens::dense(&l);
        dist_at(u, &mut buf).unwrap();
        assert_eq!(buf.selected(), Some(want));
        assert_eq!(buf.dense_logits(), &l);
    }
}

#[test]
fn dist_never_picks_neg_inf() {
    let cands = [(0u32, NEG), (1, 0.0), (2, NEG)];
    for u in [0.0, 0.5, 0.999_999] {
        let mut buf = OwnedTokens::candidates(3, &cands, false);
        dist_at(u, &mut buf).unwrap();
        assert_eq!(buf.selected(), Some(1));
        let mut buf = OwnedTokens::dense(&[NEG, 0.0, NEG]);
        dist_at(u, &mut buf).unwrap();
        assert_eq!(buf.selected(), Some(1));
    }
    let mut buf = OwnedTokens::dense(&[NEG, NEG]);
    let err = dist_at(0.5, &mut buf).unwrap_err();
    assert!(err.contains("no candidate"), "{err}");
    let mut buf = OwnedTokens::candidates(3, &[], false);
    assert!(dist_at(0.5, &mut buf).is_err());
}

#[test]
fn dist_dense_large_matches_candidate_view() {
    let logits = normal_logits(10_000, 1.0, 4);
    for u in [0.0, 0.1, 0.37, 0.5, 0.93, 0.999] {
        let mut a = OwnedTokens::dense(&logits);
        dist_at(u, &mut a).unwrap();
        let mut b = OwnedTokens::dense_as_candidates(&logits);
        dist_at(u, &mut b).unwrap();
        let (sa, sb) = (a.selected().unwrap(), b.selected().unwrap());
        // chunked vs sequential sums may move the dart by rounding only
        assert!(sa.abs_diff(sb) <= 1, "u {u}: {sa} vs {sb}");
    }
}

#[test]
fn greedy_picks_first_max_everywhere() {
    let mut logits = normal_logits(1000, 1.0, 2);
    logits[700] = 50.0;
    logits[999] = 50.0;
    assert_eq!(run_dense::<Greedy>(&[], &logits).selected(), Some(700));
    logits[999] = 51.0; // in the tail after the last full chunk
    assert_eq!(run_dense::<Greedy>(&[], &logits).selected(), Some(999));
    let mut buf = OwnedTokens::candidates(5, &[(3, 1.0), (1, 2.0), (4, 2.0)], false);
    run::<Greedy>(&[], &mut buf);
    assert_eq!(buf.selected(), Some(1));
    assert_eq!(buf.entries(), vec![(1, 2.0)]);
    let mut buf = OwnedTokens::dense(&[NEG, NEG]);
    assert!(
        apply_once::<Greedy>(&OwnedParams::new(), &mut buf, &mut TestRng::constant(0)).is_err()
    );
}

#[test]
fn mirostat_selects_and_adapts_mu() {
    let logits = normal_logits(500, 2.0, 5);
    for v2 in [false, true] {
        let mut rng = TestRng::seeded(3);
        let mut buf = OwnedTokens::dense(&logits);
        if v2 {
            let s: MirostatV2 = stage(&[("tau", 3.0), ("eta", 0.1)]);
            let mut st = s.new_state();
            assert_eq!(st.mu(), 6.0);
            apply(&s, &mut st, &mut buf, &mut rng).unwrap();
            assert_ne!(st.mu(), 6.0);
        } else {
            let s: Mirostat = stage(&[("tau", 3.0), ("eta", 0.1)]);
            let mut st = s.new_state();
            apply(&s, &mut st, &mut buf, &mut rng).unwrap();
            assert_ne!(st.mu(), 6.0);
        }
        assert!(buf.selected().is_some());
        assert!(buf.is_dense());
        assert_eq!(
            buf.dense_logits(),
            &logits[..],
            "mirostat must not modify logits"
        );
    }
}

// ------------------------------------------------------------------ penalties

#[test]
fn penalties_empty_window_and_noop_settings() {
    for (nums, window) in [
        (vec![], &[][..]),
        (vec![("repeat_last_n", 0.0), ("repeat_penalty", 2.0)], &[0]),
        (vec![("repeat_penalty", 1.0)], &[0]),
    ] {
        let (pen, mut st) = penalties_after(&nums, window);
        let mut buf = OwnedTokens::dense(&[1.0, 2.0]);
        penalise(&pen, &mut st, &mut buf);
        assert_eq!(buf.dense_logits(), &[1.0, 2.0], "{nums:?}");
    }
}

#[test]
fn penalties_out_of_range_ids_are_skipped() {
    let (pen, mut st) = penalties_after(&[("repeat_penalty", 2.0)], &[1, 99, 1_000_000]);
    let mut buf = OwnedTokens::dense(&[1.0, 2.0]);
    penalise(&pen, &mut st, &mut buf);
    assert_eq!(buf.dense_logits(), &[1.0, 1.0]);
}

#[test]
fn penalties_window_slides() {
    let nums = [
        ("repeat_last_n", 2.0),
        ("repeat_penalty", 2.0),
        ("frequency_penalty", 0.0),
    ];
    let (pen, mut st) = penalties_after(&nums, &[0, 1, 2, 2]);
    // window = [2, 2]
    assert_eq!(st.count(0), 0);
    assert_eq!(st.count(1), 0);
    assert_eq!(st.count(2), 2);
    let mut buf = OwnedTokens::dense(&[4.0, 4.0, 4.0]);
    penalise(&pen, &mut st, &mut buf);
    assert_eq!(buf.dense_logits(), &[4.0, 4.0, 2.0]);
}

#[test]
fn penalties_whole_history() {
    let nums = [
        ("repeat_last_n", -1.0),
        ("frequency_penalty", 1.0),
        ("repeat_penalty", 1.0),
    ];
    let (pen, mut st) = penalties_after(&nums, &[0; 1000]);
    assert_eq!(st.count(0), 1000);
    let mut buf = OwnedTokens::dense(&[0.0]);
    penalise(&pen, &mut st, &mut buf);
    assert_eq!(buf.dense_logits(), &[-1000.0]);
}

#[test]
fn repeat_penalty_below_one_is_applied_like_llama_cpp() {
    let (pen, mut st) = penalties_after(&[("repeat_penalty", 0.5)], &[0, 1]);
    let mut buf = OwnedTokens::dense(&[2.0, -2.0, 2.0]);
    penalise(&pen, &mut st, &mut buf);
    assert_eq!(buf.dense_logits(), &[4.0, -1.0, 2.0]);
}

#[test]
fn penalties_neg_inf_stays_removed_and_clears_sorted() {
    let (pen, mut st) = penalties_after(&[("presence_penalty", 1.0)], &[0, 2]);
    let mut buf = OwnedTokens::candidates(3, &[(0, 5.0), (1, 4.5), (2, NEG)], true);
    penalise(&pen, &mut st, &mut buf);
    let l = buf.entries();
    assert!((l[0].1 - (5.0 / 1.1 - 1.0)).abs() < 1e-6);
    assert_eq!(l[2].1, NEG);
    assert!(!buf.is_sorted());
}

#[test]
fn penalties_state_clone_is_independent() {
    let (pen, a) = penalties_after(&[], &[1]);
    let mut b = a.clone();
    pen.accept(&mut b, 1);
    assert_eq!(a.count(1), 1);
    assert_eq!(b.count(1), 2);
}

// ----------------------------------------------------------------- logit_bias

#[test]
fn logit_bias_dense_and_candidates() {
    let map = [(1u32, 2.0f32), (5, 1.0), (1, 0.5), (2, f32::NEG_INFINITY)];
    let lb = OwnedParams::new()
        .token_map("bias", &map)
        .build::<LogitBias>()
        .unwrap();
    let mut buf = OwnedTokens::dense(&[0.0, 0.0, 0.0]);
    apply(&lb, &mut (), &mut buf, &mut TestRng::constant(0)).unwrap();
    assert_eq!(
        buf.dense_logits(),
        &[0.0, 2.5, NEG],
        "id 5 >= n_vocab skipped, duplicates add"
    );
    let mut buf = OwnedTokens::candidates(3, &[(2, 1.0), (1, 0.0)], true);
    apply(&lb, &mut (), &mut buf, &mut TestRng::constant(0)).unwrap();
    assert_eq!(buf.entries(), vec![(2, NEG), (1, 2.5)]);
    assert!(!buf.is_sorted());
}

// ------------------------------------------------------ llama.cpp parity fixes

#[test]
fn greedy_leaves_only_the_winner() {
    // llama.cpp's temperature 0 keeps only the max (probability 1 after
    // the chain): greedy switches to a one-candidate view.
    let mut logits = normal_logits(1000, 1.0, 7);
    logits[321] = 40.0;
    let buf = run_dense::<Greedy>(&[], &logits);
    assert_eq!(buf.selected(), Some(321));
    assert_eq!(buf.entries(), vec![(321, 40.0)]);
    assert!(buf.is_sorted());
}

#[test]
fn top_n_sigma_keeps_masked_tokens_at_neg_inf() {
    // llama.cpp sets the masked tokens to -inf and keeps them in the list,
    // so a following top_k keeps -inf entries when fewer finite remain.
    let logits = [0.0f32, 1.0, 2.0, 3.0, 4.0, NEG];
    for mut buf in both_views(&logits) {
        run::<TopNSigma>(&[("n", 1.0)], &mut buf);
        assert_eq!(buf.len(), 6);
        let e = buf.entries();
        assert_eq!(&e[..2], &[(4, 4.0), (3, 3.0)]);
        assert!(e[2..].iter().all(|&(_, l)| l == NEG));
        let mut ids: Vec<u32> = e.iter().map(|&(i, _)| i).collect();
        ids.sort_unstable();
        assert_eq!(ids, vec![0, 1, 2, 3, 4, 5]);
    }
}

#[test]
fn typical_p_follows_llama_cpp_when_the_entropy_is_nan() {
    // A -inf candidate has p = 0, so llama.cpp's entropy (-p·ln p summed in
    // f32) is NaN, every typicality score is NaN and std::sort sees all 17
    // positions as equal: libstdc++ yields positions 8, 16, 15, .., 9, 0, ..
    // The walk adds p(8), p(16) = 0, p(15) .. p(9) (all tiny), then p(0)
    // (0.63) crosses 0.5.
    let mut logits: Vec<f32> = (0..16).map(|i| -(i as f32)).collect();
    logits.push(NEG);
    for mut buf in both_views(&logits) {
        run::<TypicalP>(&[("p", 0.5)], &mut buf);
        assert_eq!(buf.survivor_ids(), vec![0, 8, 9, 10, 11, 12, 13, 14, 15]);
    }
}

/// llama.cpp's top-p: softmax in list order (expf, f32 running sum), sort
/// descending, f32 running sum of the f32 probabilities, cut at >= p.
fn llama_top_p(logits: &[f32], p: f32) -> Vec<u32> {
    let max = logits.iter().copied().fold(NEG, f32::max);
    let mut z = 0.0f32;
    for &l in logits {
        z += (l - max).exp();
    }
    let mut order: Vec<u32> = (0..logits.len() as u32).collect();
    order.sort_by(|&a, &b| {
        logits[b as usize]
            .total_cmp(&logits[a as usize])
            .then(a.cmp(&b))
    });
    let mut cum = 0.0f32;
    let mut last = order.len();
    for (i, &id) in order.iter().enumerate() {
        cum += (logits[id as usize] - max).exp() / z;
        if cum >= p {
            last = i + 1;
            break;
        }
    }
    let mut kept = order[..last].to_vec();
    kept.sort_unstable();
    kept
}

#[test]
fn top_p_large_nuclei_match_llama_cpp_bit_for_bit() {
    // Whole-vocabulary nuclei of 1,000-60,000 tokens, several spreads, ties
    // inside the nucleus, -inf entries and leading tiny values (the f32 sum
    // starts far below its final binade): the vectorised exact sums must cut
    // exactly where llama.cpp's sequential f32 sums do.
    let mut seed = 100u64;
    for (n, sd) in [
        (151_936usize, 1.0f32),
        (151_936, 6.0),
        (49_152, 3.0),
        (8_000, 0.5),
    ] {
        for p in [0.3f32, 0.9, 0.95, 0.99] {
            seed += 1;
            let mut logits = normal_logits(n, sd, seed);
            if seed.is_multiple_of(2) {
                for v in logits.iter_mut().filter(|v| **v > 2.0 * sd) {
                    *v = (*v * 4.0).round() / 4.0;
                }
            }
            if seed.is_multiple_of(3) {
                logits[0] = -60.0;
                logits[1] = f32::NEG_INFINITY;
            }
            let want = llama_top_p(&logits, p);
            for dense in [true, false] {
                let mut buf = tokens(&logits, dense);
                run::<TopP>(&[("p", p as f64)], &mut buf);
                assert_eq!(
                    buf.survivor_ids(),
                    want,
                    "n {n} sd {sd} p {p} dense {dense}"
                );
                assert_top_p_order(&buf);
            }
        }
    }
}

/// top_p's output order: sorted (descending, `sorted = 1`) when at most
/// SORT_LIMIT tokens are kept; otherwise in list order (here: ids
/// ascending) with `sorted = 0`.
fn assert_top_p_order(buf: &OwnedTokens) {
    let e = buf.entries();
    if e.len() <= samplerd_core_stages::util::SORT_LIMIT {
        assert!(buf.is_sorted());
        assert!(e.windows(2).all(|w| w[0].1 >= w[1].1));
    } else {
        assert!(!buf.is_sorted());
        assert!(e.windows(2).all(|w| w[0].0 < w[1].0), "list order kept");
    }
}

#[test]
fn top_p_uses_llama_cpp_f32_sums() {
    // With ~10k tokens in the nucleus the f32 rounding of llama.cpp's sums
    // moves the cut by dozens of tokens against an exact (f64) sum.
    for (n, seed) in [(151_936usize, 11u64), (3000, 12)] {
        let logits = normal_logits(n, 3.0, seed);
        let want = llama_top_p(&logits, 0.95);
        let mut buf = OwnedTokens::dense(&logits);
        run::<TopP>(&[("p", 0.95)], &mut buf);
        assert_eq!(buf.survivor_ids(), want, "dense, n = {n}");
        let mut buf = OwnedTokens::dense_as_candidates(&logits);
        run::<TopP>(&[("p", 0.95)], &mut buf);
        assert_eq!(buf.survivor_ids(), want, "candidates, n = {n}");
        assert_top_p_order(&buf);
    }
}

// ------------------------------------------------ llama.cpp's value domains

/// llama.cpp's `test_top_p(…, {1.0f}, 0)` and `test_min_p(…, {0.4f/0.4f},
/// 1.00f / 1.05f)` (`tests/test-sampling.cpp`), and the values their
/// samplers take the same way (`llama_sampler_top_p_apply`: `cum_sum >= p`
/// holds at the first candidate when p <= 0; `llama_sampler_min_p_apply`:
/// the sorted fallback keeps its first candidate when no logit reaches
/// max + ln p): the most likely token alone, or `min_keep` of them.
#[test]
fn top_p_at_most_zero_and_min_p_above_one_keep_the_most_likely_token() {
    let logits: Vec<f32> = [0.1f32, 0.2, 0.3, 0.4].iter().map(|p| p.ln()).collect();
    let kept = |buf: &OwnedTokens| buf.survivor_ids();
    for mut buf in both_views(&logits) {
        run::<TopP>(&[("p", 0.0), ("min_keep", 0.0)], &mut buf);
        assert_eq!(kept(&buf), [3]);
    }
    for p in [-0.5, 0.0] {
        for min_keep in [0.0, 1.0, 2.0, 9.0] {
            for mut buf in both_views(&logits) {
                run::<TopP>(&[("p", p), ("min_keep", min_keep)], &mut buf);
                let want: Vec<u32> = (0..4).rev().take((min_keep as usize).max(1)).collect();
                let got: Vec<u32> = buf.entries().iter().map(|e| e.0).collect();
                assert_eq!(
                    got, want,
                    "top_p {p}, min_keep {min_keep}: sorted, the best"
                );
                assert!(buf.is_sorted());
            }
        }
    }
    for p in [1.0, 1.05, 7.0, f64::INFINITY] {
        for min_keep in [0.0, 1.0, 3.0] {
            for mut buf in both_views(&logits) {
                run::<MinP>(&[("p", p), ("min_keep", min_keep)], &mut buf);
                let want: Vec<u32> = (0..4).rev().take((min_keep as usize).max(1)).collect();
                let mut want = want;
                want.sort_unstable();
                assert_eq!(kept(&buf), want, "min_p {p}, min_keep {min_keep}");
            }
            // sorted input: the cut at the first candidate
            let mut sorted = OwnedTokens::candidates(
                4,
                &[
                    (3, logits[3]),
                    (2, logits[2]),
                    (1, logits[1]),
                    (0, logits[0]),
                ],
                true,
            );
            run::<MinP>(&[("p", p), ("min_keep", min_keep)], &mut sorted);
            assert_eq!(sorted.len(), (min_keep as usize).max(1));
        }
    }
    // min_p < 0: off, like 0 (llama.cpp: `p <= 0` returns at once)
    for mut buf in both_views(&logits) {
        run::<MinP>(&[("p", -0.3)], &mut buf);
        assert_eq!(kept(&buf), [0, 1, 2, 3]);
    }
}
