//! Speculative verification (`samplerd_sampling::verify`), in process:
//! EXACT equals one-by-one sampling for random chains (penalties, DRY with
//! a vocabulary, a third-party C plugin, xtc, mirostat, every terminal),
//! REJECTION and COUPLED follow the target's distribution (χ² over 10⁵
//! draws, fixed seeds), COUPLED's tokens do not depend on the drafts, and
//! every mode answers sparse rows as it answers their dense rows.

mod common;

use std::sync::{Arc, OnceLock};

use common::*;
use proptest::prelude::*;
use samplerd_sampling::input::StepLogits;
use samplerd_sampling::sparse::{SparseRow, oracle};
use samplerd_sampling::step::{self, Logits, NoDeferral, ProbsRequest, StepOutput};
use samplerd_sampling::verify::{self, Draft, Mode, Verified, VerifyError};
use samplerd_sampling::vocab::token_attr;
use samplerd_sampling::{ChainSpec, Sequence, StageRegistry, StageSpec, TokenBuffer, Vocabulary};

const N_VOCAB: usize = 24;

fn registry() -> &'static StageRegistry {
    static REG: OnceLock<StageRegistry> = OnceLock::new();
    REG.get_or_init(|| {
        let dir = scratch("verify-plugins");
        let ban = build_c_plugin("ban_tokens.c", &dir, "ban_tokens", &[]);
        StageRegistry::load(&[], &[core_plugin(), ban]).unwrap()
    })
}

/// A vocabulary for DRY: words with a breaker (`\n`) among them.
fn vocab() -> Arc<Vocabulary> {
    static V: OnceLock<Arc<Vocabulary>> = OnceLock::new();
    V.get_or_init(|| {
        let words: Vec<Vec<u8>> = (0..N_VOCAB)
            .map(|i| {
                if i == 5 {
                    b"\n".to_vec()
                } else {
                    format!("w{i}").into_bytes()
                }
            })
            .collect();
        Arc::new(Vocabulary::new(words, vec![token_attr::NORMAL; N_VOCAB]))
    })
    .clone()
}

fn chain(stages: Vec<StageSpec>) -> Sequence {
    registry()
        .build_chain(&ChainSpec { stages }, Some(vocab()))
        .unwrap()
        .new_sequence()
        .unwrap()
}

/// The stages a random chain picks from (before its terminal).
fn filter_stage(i: u8, x: f64) -> StageSpec {
    match i % 8 {
        0 => StageSpec::new("penalties")
            .number("repeat_last_n", 8.0)
            .number("repeat_penalty", 1.0 + x)
            .number("frequency_penalty", x / 2.0)
            .number("presence_penalty", x / 3.0),
        1 => StageSpec::new("dry")
            .number("multiplier", 0.8 + x)
            .number("base", 1.75)
            .number("allowed_length", 1.0)
            .number("penalty_last_n", -1.0),
        2 => StageSpec::new("top_k").number("k", 2.0 + (x * 10.0).floor()),
        3 => StageSpec::new("top_p").number("p", 0.5 + x / 2.0),
        4 => StageSpec::new("min_p").number("p", x / 4.0),
        5 => StageSpec::new("xtc")
            .number("probability", 0.5)
            .number("threshold", 0.05 + x / 10.0),
        6 => StageSpec::new("temperature").number("t", 0.3 + 2.0 * x),
        _ => StageSpec::new("ban_tokens").with(
            "ids",
            samplerd_sampling::ParamValue::String(format!("{},{}", (x * 20.0) as u32, 7)),
        ),
    }
}

fn terminal(i: u8) -> StageSpec {
    match i % 4 {
        0 => StageSpec::new("dist"),
        1 => StageSpec::new("coupled"),
        2 => StageSpec::new("greedy"),
        _ => StageSpec::new("mirostat_v2")
            .number("tau", 3.0)
            .number("eta", 0.2),
    }
}

fn floats(rows: &[Vec<f32>]) -> Vec<StepLogits<'_>> {
    rows.iter()
        .map(|r| StepLogits::Dense(Logits::Floats(r)))
        .collect()
}

#[allow(clippy::too_many_arguments)]
fn verify_rows(
    seq: &mut Sequence,
    mode: Mode,
    drafts: &[u32],
    target: &[Vec<f32>],
    drafter: &[Vec<f32>],
    seed: u64,
    first_step: u64,
    probs: ProbsRequest,
) -> Result<Verified, VerifyError> {
    let (mut buf, mut scratch) = (TokenBuffer::new(), TokenBuffer::new());
    let (target, drafter) = (floats(target), floats(drafter));
    verify::verify(
        seq,
        &mut buf,
        &mut scratch,
        mode,
        Draft {
            tokens: drafts,
            target: &target,
            drafter: &drafter,
        },
        seed,
        first_step,
        probs,
    )
}

/// One step, as every RPC runs it.
fn try_step(
    seq: &mut Sequence,
    row: &[f32],
    seed: u64,
    step: u64,
    p: ProbsRequest,
) -> Result<StepOutput, samplerd_sampling::SampleError> {
    let mut buf = TokenBuffer::new();
    let l = Logits::Floats(row);
    let lse = step::load::<NoDeferral>(&mut buf, l, None)?;
    step::run(seq, &mut buf, l, lse, seed, step, p)
}

fn one_step(seq: &mut Sequence, row: &[f32], seed: u64, step: u64, p: ProbsRequest) -> StepOutput {
    try_step(seq, row, seed, step, p).unwrap()
}

/// Sample-and-match one step at a time: what EXACT must reproduce.
fn stepwise(
    seq: &mut Sequence,
    drafts: &[u32],
    target: &[Vec<f32>],
    seed: u64,
    first_step: u64,
    p: ProbsRequest,
) -> Result<Vec<StepOutput>, String> {
    let mut out = Vec::new();
    for (j, row) in target.iter().enumerate() {
        let o = try_step(seq, row, seed, first_step + j as u64, p)
            .map_err(|e| format!("target_rows[{j}]: {e}"))?;
        let tok = o.token_id;
        out.push(o);
        if drafts.get(j) != Some(&tok) {
            break;
        }
        seq.accept(tok).unwrap();
    }
    Ok(out)
}

fn row_strategy() -> impl Strategy<Value = Vec<f32>> {
    prop::collection::vec(-4.0f32..4.0, N_VOCAB)
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(160))]

    /// EXACT's tokens, probabilities and candidates are bit for bit those
    /// of sampling the rows one step at a time, and the sequence's state
    /// afterwards is the same (the step after agrees too).
    #[test]
    fn exact_equals_one_step_at_a_time(
        filters in prop::collection::vec((any::<u8>(), 0.0f64..1.0), 0..5),
        term in any::<u8>(),
        history in prop::collection::vec(0u32..N_VOCAB as u32, 0..12),
        rows in prop::collection::vec(row_strategy(), 1..7),
        guesses in prop::collection::vec((0u32..N_VOCAB as u32, any::<bool>()), 6),
        seed in any::<u64>(),
        first_step in 0u64..1000,
        n_probs in 0usize..4,
        post in any::<bool>(),
    ) {
        let mut stages: Vec<StageSpec> = filters.iter().map(|&(i, x)| filter_stage(i, x)).collect();
        stages.push(terminal(term));
        let probs = ProbsRequest { n: n_probs, post_sampling: post };
        let k = rows.len() - 1;
        let (target, next) = (&rows[..], row_strategy_fixed());
        // Drafts: the step-by-step token where `follow`, else a guess, so
        // runs accept anywhere from none to all K.
        let mut reference = chain(stages.clone());
        reference.accept_history(&history).unwrap();
        let mut probe = reference.try_clone().unwrap();
        let mut drafts = Vec::new();
        for (j, row) in target.iter().take(k).enumerate() {
            let (guess, follow) = guesses[j];
            // A chain can mask every token (ban_tokens after top_k):
            // verification must then fail where the step fails.
            let Ok(t) = try_step(&mut probe, row, seed, first_step + j as u64, probs) else { break };
            let t = t.token_id;
            let d = if follow { t } else { guess };
            drafts.push(d);
            if d != t { break; }
            probe.accept(d).unwrap();
        }
        while drafts.len() < k { drafts.push(guesses[drafts.len()].0); }

        let want = stepwise(&mut reference, &drafts, target, seed, first_step, probs);
        let mut seq = chain(stages);
        seq.accept_history(&history).unwrap();
        let got = verify_rows(&mut seq, Mode::Exact, &drafts, target, &[], seed, first_step, probs);
        let (got, want) = match (got, want) {
            (Ok(g), Ok(w)) => (g, w),
            (Err(g), Err(w)) => {
                prop_assert_eq!(g.to_string(), w);
                return Ok(());
            }
            (g, w) => panic!("verify {g:?}, one by one {w:?}"),
        };
        prop_assert_eq!(got.accepted, want.len() - 1);
        prop_assert_eq!(&got.tokens, &want);
        // The state after: accept the last token on both, one more step.
        let last = want.last().unwrap().token_id;
        reference.accept(last).unwrap();
        seq.accept(last).unwrap();
        let s = first_step + want.len() as u64;
        prop_assert_eq!(
            try_step(&mut seq, &next, seed, s, probs).map_err(|e| e.to_string()),
            try_step(&mut reference, &next, seed, s, probs).map_err(|e| e.to_string())
        );
    }
}

fn row_strategy_fixed() -> Vec<f32> {
    (0..N_VOCAB)
        .map(|i| ((i * 7919) % 13) as f32 * 0.3)
        .collect()
}

/// χ² statistic and p-value (upper tail) of `counts` against `probs`.
fn chi_square(counts: &[u64], probs: &[f64]) -> (f64, f64) {
    let n: u64 = counts.iter().sum();
    let mut stat = 0.0;
    let mut dof = 0usize;
    for (&c, &p) in counts.iter().zip(probs) {
        if p == 0.0 {
            assert_eq!(c, 0, "a token of probability 0 was drawn");
            continue;
        }
        let e = p * n as f64;
        stat += (c as f64 - e).powi(2) / e;
        dof += 1;
    }
    (stat, chi2_upper(stat, (dof - 1) as f64))
}

/// P(X ≥ x) for X ~ χ²(k), by the regularised upper incomplete gamma
/// function (series for x < a + 1, continued fraction otherwise; Numerical
/// Recipes §6.2).
fn chi2_upper(x: f64, k: f64) -> f64 {
    let (a, x) = (k / 2.0, x / 2.0);
    let ln_gamma_a = ln_gamma(a);
    if x < a + 1.0 {
        let (mut sum, mut term, mut ap) = (1.0 / a, 1.0 / a, a);
        for _ in 0..1000 {
            ap += 1.0;
            term *= x / ap;
            sum += term;
        }
        1.0 - sum * (-x + a * x.ln() - ln_gamma_a).exp()
    } else {
        let mut b = x + 1.0 - a;
        let mut c = 1e300;
        let mut d = 1.0 / b;
        let mut h = d;
        for i in 1..1000 {
            let an = -(i as f64) * (i as f64 - a);
            b += 2.0;
            d = 1.0 / (an * d + b);
            c = b + an / c;
            h *= d * c;
        }
        (-x + a * x.ln() - ln_gamma_a).exp() * h
    }
}

/// Lanczos approximation of ln Γ(x), x > 0.
fn ln_gamma(x: f64) -> f64 {
    const G: [f64; 6] = [
        76.180_091_729_471_46,
        -86.505_320_329_416_77,
        24.014_098_240_830_91,
        -1.231_739_572_450_155,
        0.001_208_650_973_866_179,
        -0.000_005_395_239_384_953,
    ];
    let mut y = x;
    let tmp = x + 5.5 - (x + 0.5) * (x + 5.5).ln();
    let mut ser = 1.000_000_000_190_015;
    for g in G {
        y += 1.0;
        ser += g / y;
    }
    -tmp + (2.506_628_274_631_000_5 * ser / x).ln()
}

#[test]
fn chi2_upper_matches_tables() {
    // χ²(3) ≥ 7.815 has probability 0.05; χ²(10) ≥ 23.209 0.01.
    assert!((chi2_upper(7.815, 3.0) - 0.05).abs() < 1e-3);
    assert!((chi2_upper(23.209, 10.0) - 0.01).abs() < 1e-3);
    assert!((chi2_upper(2.0, 4.0) - 0.7358).abs() < 1e-3);
}

fn softmax(l: &[f32]) -> Vec<f64> {
    let m = l.iter().cloned().fold(f32::NEG_INFINITY, f32::max) as f64;
    let e: Vec<f64> = l.iter().map(|&x| (x as f64 - m).exp()).collect();
    let s: f64 = e.iter().sum();
    e.iter().map(|x| x / s).collect()
}

/// Draws the drafter's token for step `step` the way a drafter sampling
/// through samplerd would: the chain on its row, same seed and step.
fn drafter_token(seq: &mut Sequence, row: &[f32], seed: u64, step: u64) -> u32 {
    one_step(seq, row, seed, step, ProbsRequest::default()).token_id
}

const DRAWS: u64 = 100_000;

/// REJECTION with one draft: the first reported token follows the target
/// row's distribution whatever the drafter's, both when the drafter is
/// close to it and when it is far (most drafts rejected).
#[test]
fn rejection_follows_the_target_distribution() {
    let target = vec![1.0f32, 0.2, -0.5, 2.0, 0.0, -1.5];
    let p = softmax(&target);
    for drafter in [
        vec![0.8f32, 0.4, -0.2, 1.5, 0.1, -1.0],
        vec![-1.0f32, 2.5, 1.0, -2.0, 0.5, 0.0],
    ] {
        let mut counts = vec![0u64; target.len()];
        let mut accepted = 0u64;
        let base = chain(vec![StageSpec::new("dist")]);
        for draw in 0..DRAWS {
            let (seed, step) = (0x5eed, draw);
            let mut dseq = base.try_clone().unwrap();
            let x = drafter_token(&mut dseq, &drafter, seed, step);
            let mut seq = base.try_clone().unwrap();
            let rows = [target.clone(), target.clone()];
            let v = verify_rows(
                &mut seq,
                Mode::Rejection,
                &[x],
                &rows,
                std::slice::from_ref(&drafter),
                seed,
                step,
                ProbsRequest::default(),
            )
            .unwrap();
            accepted += v.accepted as u64;
            counts[v.tokens[0].token_id as usize] += 1;
        }
        let (stat, pv) = chi_square(&counts, &p);
        println!("REJECTION χ² = {stat:.2}, p = {pv:.4}, acceptance {accepted}/{DRAWS}");
        assert!(pv > 0.001, "χ² {stat} p-value {pv}: {counts:?}");
        // Leviathan et al.: acceptance rate Σ min(p, q).
        let q = softmax(&drafter);
        let alpha: f64 = p.iter().zip(&q).map(|(a, b)| a.min(*b)).sum();
        let rate = accepted as f64 / DRAWS as f64;
        assert!((rate - alpha).abs() < 0.01, "acceptance {rate} vs {alpha}");
    }
}

/// COUPLED's first token follows the target distribution (the Gumbel
/// race is an exact draw), over seeds.
#[test]
fn coupled_draw_follows_the_target_distribution() {
    let target = vec![1.0f32, 0.2, -0.5, 2.0, 0.0, -1.5, f32::NEG_INFINITY];
    let p = softmax(&target);
    let base = chain(vec![StageSpec::new("coupled")]);
    let mut counts = vec![0u64; target.len()];
    for seed in 0..DRAWS {
        let mut seq = base.try_clone().unwrap();
        counts[drafter_token(&mut seq, &target, seed, 3) as usize] += 1;
    }
    let (stat, pv) = chi_square(&counts, &p);
    println!("COUPLED χ² = {stat:.2}, p = {pv:.4}");
    assert!(pv > 0.001, "χ² {stat} p-value {pv}: {counts:?}");
}

/// COUPLED: two different drafters, the same seed, the same tokens — those
/// of sampling one step at a time; and a drafter that draws with the same
/// keys from a close distribution is accepted more often than the
/// target's probability of its token would suggest.
#[test]
fn coupled_output_does_not_depend_on_the_drafter() {
    let stages = vec![
        StageSpec::new("penalties")
            .number("repeat_last_n", 8.0)
            .number("repeat_penalty", 1.3),
        StageSpec::new("top_k").number("k", 12.0),
        StageSpec::new("coupled"),
    ];
    let k = 4;
    let mut agree = 0usize;
    let mut total = 0usize;
    for seed in 0..300u64 {
        let target: Vec<Vec<f32>> = (0..=k)
            .map(|j| {
                (0..N_VOCAB)
                    .map(|i| (((i as u64 * 31 + j as u64 * 17 + seed * 7) % 23) as f32) * 0.25)
                    .collect()
            })
            .collect();
        let mut reference = chain(stages.clone());
        let mut one_by_one = Vec::new();
        for (j, row) in target.iter().enumerate() {
            let o = one_step(&mut reference, row, seed, j as u64, ProbsRequest::default());
            reference.accept(o.token_id).unwrap();
            one_by_one.push(o.token_id);
        }
        // Drafter A: the target's own tokens with a perturbed row (coupled
        // draws from a close distribution). Drafter B: arbitrary tokens.
        let mut dseq = chain(stages.clone());
        let mut drafts_a = Vec::new();
        for (j, row) in target.iter().take(k).enumerate() {
            let near: Vec<f32> = row
                .iter()
                .enumerate()
                .map(|(i, l)| l + 0.1 * ((i % 3) as f32 - 1.0))
                .collect();
            let t = drafter_token(&mut dseq, &near, seed, j as u64);
            dseq.accept(t).unwrap();
            drafts_a.push(t);
        }
        let drafts_b: Vec<u32> = (0..k as u32)
            .map(|j| (j * 5 + seed as u32) % N_VOCAB as u32)
            .collect();
        let mut outs = Vec::new();
        for drafts in [&drafts_a, &drafts_b] {
            // Verify until the K + 1 tokens are out, as a decoder would.
            let mut seq = chain(stages.clone());
            let mut got = Vec::new();
            while got.len() < one_by_one.len() {
                let j = got.len();
                let left = one_by_one.len() - j - 1;
                let d: Vec<u32> = drafts[j.min(k)..].iter().copied().take(left).collect();
                let rows = &target[j..j + d.len() + 1];
                let v = verify_rows(
                    &mut seq,
                    Mode::Coupled,
                    &d,
                    rows,
                    &[],
                    seed,
                    j as u64,
                    ProbsRequest::default(),
                )
                .unwrap();
                for t in &v.tokens {
                    got.push(t.token_id);
                }
                seq.accept(v.tokens.last().unwrap().token_id).unwrap();
            }
            outs.push(got);
        }
        assert_eq!(outs[0], one_by_one, "seed {seed}: drafter A");
        assert_eq!(outs[1], one_by_one, "seed {seed}: drafter B");
        agree += drafts_a
            .iter()
            .zip(&one_by_one)
            .take_while(|(a, b)| a == b)
            .count();
        total += k;
    }
    println!("COUPLED: drafter A's drafts accepted {agree}/{total}");
    assert!(
        agree * 2 > total,
        "a close drafter agrees most of the time: {agree}/{total}"
    );
}

/// The coupled draw is keyed by token id: the same row gives the same
/// token whether the stage sees it dense (ascending ids) or as a list
/// sorted by logit (after a top_k that keeps everything).
#[test]
fn coupled_draw_does_not_depend_on_the_candidate_order() {
    let row: Vec<f32> = (0..N_VOCAB).map(|i| ((i * 7) % 11) as f32 * 0.2).collect();
    let dense = chain(vec![StageSpec::new("coupled")]);
    let sorted = chain(vec![
        StageSpec::new("top_k").number("k", N_VOCAB as f64),
        StageSpec::new("coupled"),
    ]);
    let mut differ_by_step = 0;
    for seed in 0..500u64 {
        let a = drafter_token(&mut dense.try_clone().unwrap(), &row, seed, 9);
        let b = drafter_token(&mut sorted.try_clone().unwrap(), &row, seed, 9);
        assert_eq!(a, b, "seed {seed}");
        differ_by_step +=
            usize::from(a != drafter_token(&mut dense.try_clone().unwrap(), &row, seed, 10));
    }
    assert!(
        differ_by_step > 100,
        "the step changes the draw: {differ_by_step}/500"
    );
}

#[test]
fn modes_refuse_chains_that_do_not_end_as_they_need() {
    let rows = vec![vec![0.0f32; N_VOCAB]; 2];
    let mut seq = chain(vec![StageSpec::new("dist")]);
    let e = verify_rows(
        &mut seq,
        Mode::Coupled,
        &[1],
        &rows,
        &[],
        1,
        0,
        ProbsRequest::default(),
    )
    .unwrap_err();
    assert!(matches!(e, VerifyError::Terminal { .. }), "{e}");
    assert!(
        e.to_string().contains("ends with coupled") && e.to_string().contains("`dist`"),
        "{e}"
    );
    let mut seq = chain(vec![StageSpec::new("greedy")]);
    let e = verify_rows(
        &mut seq,
        Mode::Rejection,
        &[1],
        &rows,
        &rows[..1],
        1,
        0,
        ProbsRequest::default(),
    )
    .unwrap_err();
    assert!(e.to_string().contains("dist or coupled"), "{e}");
    let mut seq = chain(vec![StageSpec::new("dist")]);
    let e = verify_rows(
        &mut seq,
        Mode::Rejection,
        &[1],
        &rows,
        &[],
        1,
        0,
        ProbsRequest::default(),
    )
    .unwrap_err();
    assert!(e.to_string().contains("takes 1 drafter rows, got 0"), "{e}");
    let e = verify_rows(
        &mut seq,
        Mode::Exact,
        &[1, 2],
        &rows,
        &[],
        1,
        0,
        ProbsRequest::default(),
    )
    .unwrap_err();
    assert!(
        e.to_string()
            .contains("2 draft tokens need 3 target rows, got 2"),
        "{e}"
    );
}

/// A dense row's top `m` entries (ids ascending) and the log-sum-exp of
/// the rest, in f64: the sparse row an engine would send.
fn sparsify(row: &[f32], m: usize) -> (Vec<u32>, Vec<f32>, f64) {
    let mut order: Vec<u32> = (0..row.len() as u32).collect();
    order.sort_by(|&a, &b| row[b as usize].total_cmp(&row[a as usize]).then(a.cmp(&b)));
    let (sent, rest) = order.split_at(m.min(row.len()));
    let mut ids = sent.to_vec();
    ids.sort_unstable();
    let values = ids.iter().map(|&i| row[i as usize]).collect();
    let rest_lse = if rest.is_empty() {
        f64::NEG_INFINITY
    } else {
        let max = rest
            .iter()
            .map(|&i| row[i as usize] as f64)
            .fold(f64::NEG_INFINITY, f64::max);
        max + rest
            .iter()
            .map(|&i| (row[i as usize] as f64 - max).exp())
            .sum::<f64>()
            .ln()
    };
    (ids, values, rest_lse)
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(120))]

    /// Each mode over sparse rows (the top of each row and the log-sum-exp
    /// of the rest) answers what it answers over the dense rows: the same
    /// accepted count, tokens and post-chain probabilities bit for bit, the
    /// raw logprob within the sparse rows' rounding — with the drafts
    /// accepted anywhere from none to all, for a chain that cuts the row
    /// to the sent entries (top_k at most the entries sent).
    #[test]
    fn sparse_rows_verify_as_their_dense_rows(
        rows in prop::collection::vec(row_strategy(), 2..6),
        drafter in prop::collection::vec(row_strategy(), 5),
        k_top in 1usize..8,
        extra in 0usize..8,
        top_p in 0.5f64..1.0,
        temp in 0.3f64..2.0,
        mode in 0u8..3,
        guesses in prop::collection::vec((0u32..N_VOCAB as u32, any::<bool>()), 5),
        seed in any::<u64>(),
    ) {
        let mode = [Mode::Exact, Mode::Rejection, Mode::Coupled][mode as usize];
        let terminal = if mode == Mode::Coupled { "coupled" } else { "dist" };
        let stages = vec![
            StageSpec::new("top_k").number("k", k_top as f64),
            StageSpec::new("top_p").number("p", top_p),
            StageSpec::new("temperature").number("t", temp),
            StageSpec::new(terminal),
        ];
        let k = rows.len() - 1;
        let probs = ProbsRequest { n: 1, post_sampling: true };
        // Drafts that follow the one-by-one tokens where `guesses` says so.
        let mut probe = chain(stages.clone());
        let mut drafts = Vec::new();
        for (j, row) in rows.iter().take(k).enumerate() {
            let t = one_step(&mut probe, row, seed, j as u64, probs).token_id;
            let (guess, follow) = guesses[j];
            let d = if follow { t } else { guess };
            drafts.push(d);
            probe.accept(d).unwrap();
        }
        let drafter = if mode == Mode::Rejection { &drafter[..k] } else { &[][..] };
        let dense = verify_rows(&mut chain(stages.clone()), mode, &drafts, &rows, drafter, seed, 0, probs)
            .unwrap();

        // Few entries may not prove the cut (the rest's mass can hide a
        // better token): such a row is refused, which is the sparse rows'
        // promise too; those cases are discarded (proptest fails the test
        // should it have to discard most of them).
        let sent = k_top + 6 + extra;
        let parts: Vec<_> = rows.iter().chain(drafter).map(|r| sparsify(r, sent)).collect();
        let sparse: Vec<StepLogits<'_>> = parts
            .iter()
            .map(|(ids, values, rest)| {
                StepLogits::Sparse(SparseRow::new(ids, values, *rest, N_VOCAB).unwrap())
            })
            .collect();
        let (target, drafter_rows) = sparse.split_at(rows.len());
        let (mut buf, mut scratch) = (TokenBuffer::new(), TokenBuffer::new());
        let got = verify::verify(
            &mut chain(stages),
            &mut buf,
            &mut scratch,
            mode,
            Draft { tokens: &drafts, target, drafter: drafter_rows },
            seed,
            0,
            probs,
        );
        let got = match got {
            Err(VerifyError::Sample { source: samplerd_sampling::SampleError::Sparse(_), .. }) => {
                prop_assume!(false);
                unreachable!()
            }
            other => other.unwrap(),
        };
        prop_assert_eq!(got.accepted, dense.accepted);
        prop_assert_eq!(got.tokens.len(), dense.tokens.len());
        for (j, (g, d)) in got.tokens.iter().zip(&dense.tokens).enumerate() {
            prop_assert_eq!(g.token_id, d.token_id);
            prop_assert_eq!(g.probability.to_bits(), d.probability.to_bits());
            // The dense row's log-sum-exp: the token's logit minus its logprob.
            let lse = rows[j][d.token_id as usize] - d.logprob;
            let tol = oracle::logprob_tolerance(lse);
            let agree = |a: f32, b: f32| oracle::logprobs_agree(a, b, tol);
            prop_assert!(agree(d.logprob, g.logprob), "logprob {} vs dense {}", g.logprob, d.logprob);
            prop_assert_eq!(g.probs.len(), d.probs.len());
            for (gc, dc) in g.probs.iter().zip(&d.probs) {
                prop_assert_eq!(gc.token_id, dc.token_id);
                prop_assert_eq!(gc.probability.to_bits(), dc.probability.to_bits());
                prop_assert!(agree(dc.logprob, gc.logprob));
            }
        }
    }
}
