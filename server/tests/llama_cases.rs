//! llama.cpp's sampler test cases (`tests/test-sampling.cpp`: `test_top_p`,
//! `test_min_p`, `test_dry`) through the Sample RPC: the logits are ln(p),
//! the chain is the one stage under test then the draw, and the post-chain
//! probabilities must be llama.cpp's within 1e-5. Where llama.cpp's test
//! gives the expectation as a formula, it is computed here the same way.

mod common;

use common::*;
use samplerd_api::v1;
use tonic::Code;

const PROBS: [f32; 4] = [0.1, 0.2, 0.3, 0.4];

fn ln(probs: &[f32]) -> Vec<f32> {
    probs.iter().map(|p| p.ln()).collect()
}

/// Every stage off except what `tune` sets (temperature 1 divides by one).
fn only(tune: impl FnOnce(&mut v1::SamplingParams)) -> v1::SamplingParams {
    let mut p = v1::SamplingParams {
        temperature: Some(1.0),
        top_k: Some(0),
        top_p: Some(1.0),
        min_p: Some(0.0),
        repeat_penalty: Some(1.0),
        ..Default::default()
    };
    tune(&mut p);
    p
}

/// The post-chain probabilities by token id (0 for a token cut).
async fn post_chain(
    s: &TestServer,
    logits: &[f32],
    history: &[u32],
    params: v1::SamplingParams,
) -> Vec<f32> {
    let r = s
        .sample_ok(v1::SampleRequest {
            logits: logits.to_vec(),
            previous_tokens: history.to_vec(),
            params: Some(params),
            n_probs: logits.len() as u32,
            post_sampling_probs: true,
            ..Default::default()
        })
        .await;
    let mut by_id = vec![0.0; logits.len()];
    for c in r.probs {
        by_id[c.token_id as usize] = c.probability;
    }
    by_id
}

fn assert_close(got: &[f32], want: &[f32], what: &str) {
    for (i, (g, w)) in got.iter().zip(want).enumerate() {
        assert!(
            (g - w).abs() < 1e-5,
            "{what}: token {i}: {got:?} vs {want:?}"
        );
    }
}

/// `probs` renormalised over the ids in `kept` (llama.cpp's `{0.3f/0.7f,
/// 0.4f/0.7f}` style expectations), by id.
fn renormalised(kept: &[usize]) -> Vec<f32> {
    let z: f32 = kept.iter().map(|&i| PROBS[i]).sum();
    (0..PROBS.len())
        .map(|i| if kept.contains(&i) { PROBS[i] / z } else { 0.0 })
        .collect()
}

#[tokio::test]
async fn top_p_cases_including_zero() {
    let s = start().await;
    // test_top_p: p = 0 keeps the most likely token (llama.cpp's walk
    // stops at its first candidate: cum_sum >= 0 always holds).
    for (p, kept) in [
        (0.0f32, &[3usize][..]),
        (0.7, &[2, 3]),
        (0.8, &[1, 2, 3]),
        (1.0, &[0, 1, 2, 3]),
        // the same walk for p < 0
        (-0.5, &[3]),
    ] {
        let got = post_chain(&s, &ln(&PROBS), &[], only(|x| x.top_p = Some(p))).await;
        assert_close(&got, &renormalised(kept), &format!("top_p {p}"));
    }
    s.stop().await;
}

#[tokio::test]
async fn min_p_cases_including_above_one() {
    let s = start().await;
    // test_min_p: keep p_i >= p × p_max; min_p >= 1 keeps only the top
    // (1.05: no token reaches the bound, llama.cpp's sorted fallback keeps
    // its first candidate).
    for (p, kept) in [
        (0.0f32, &[0usize, 1, 2, 3][..]),
        (0.24, &[0, 1, 2, 3]),
        (0.26, &[1, 2, 3]),
        (0.49, &[1, 2, 3]),
        (0.51, &[2, 3]),
        (0.74, &[2, 3]),
        (0.76, &[3]),
        (1.00, &[3]),
        (1.05, &[3]),
        // llama.cpp: p <= 0 returns at once
        (-0.2, &[0, 1, 2, 3]),
    ] {
        let got = post_chain(&s, &ln(&PROBS), &[], only(|x| x.min_p = Some(p))).await;
        assert_close(&got, &renormalised(kept), &format!("min_p {p}"));
    }
    // Greedy at the same values picks the most likely token too.
    for x in [only(|x| x.top_p = Some(0.0)), only(|x| x.min_p = Some(3.0))] {
        let r = s
            .sample_ok(v1::SampleRequest {
                logits: ln(&PROBS),
                params: Some(x),
                ..Default::default()
            })
            .await;
        assert_eq!(r.token_id, 3);
        assert!((r.probability - 1.0).abs() < 1e-6, "{r:?}");
    }
    s.stop().await;
}

/// test_dry: DRY alone, breakers `[""]` (llama.cpp's test gives none; Sample
/// has no vocabulary to find string breakers in).
#[tokio::test]
async fn dry_cases_without_breakers() {
    let s = start().await;
    let dry = |mult: f32, allowed: i32, last_n: i32| {
        only(|x| {
            x.dry_multiplier = Some(mult);
            x.dry_base = Some(1.1);
            x.dry_allowed_length = Some(allowed);
            x.dry_penalty_last_n = Some(last_n);
            x.dry_sequence_breakers = vec![String::new()];
        })
    };
    let q = [0.25f32; 4];
    let f = [0.2f32; 5];
    // (probs, history, multiplier, allowed_length, last_n, the probabilities
    // llama.cpp's test asserts)
    #[allow(clippy::type_complexity)]
    let cases: [(&[f32], &[u32], f32, i32, i32, &[f32]); 4] = [
        (&q, &[0, 1], 1.0, 2, 4, &[0.25, 0.25, 0.25, 0.25]),
        (
            &q,
            &[0, 1, 2, 0, 1],
            1.0,
            2,
            5,
            &[0.296923, 0.296923, 0.109232, 0.296923],
        ),
        (
            &f,
            &[0, 1, 2, 0, 1],
            2.0,
            2,
            5,
            &[0.241818, 0.241818, 0.032727, 0.241818, 0.241818],
        ),
        (&f, &[0, 1, 2, 3, 4, 0, 1], 1.0, 4, 7, &[0.2; 5]),
    ];
    for (probs, history, mult, allowed, last_n, want) in cases {
        let got = post_chain(&s, &ln(probs), history, dry(mult, allowed, last_n)).await;
        assert_close(&got, want, &format!("dry {history:?}"));
        // and from the formula: token 2 continues "0 1", a repeat of 2
        let penalised = history.len() == 5;
        let e = if penalised {
            (-(mult as f64) * 1.1f64.powi(2 - allowed)).exp()
        } else {
            1.0
        };
        let z = probs.len() as f64 - 1.0 + e;
        assert!(((got[2] as f64) - e / z).abs() < 1e-5, "{got:?}");
    }
    s.stop().await;
}

#[tokio::test]
async fn dry_breakers_without_a_model_are_refused_naming_the_reason() {
    let s = start().await;
    let p = v1::SamplingParams {
        dry_multiplier: Some(0.8),
        ..Default::default()
    };
    s.assert_sample_refused(
        v1::SampleRequest {
            logits: ln(&PROBS),
            params: Some(p),
            ..Default::default()
        },
        Code::InvalidArgument,
        &[
            "params.dry_sequence_breakers",
            "refused by stage `dry`",
            "without a vocabulary",
            "params.vocabulary",
        ],
    )
    .await;
    s.assert_sample_refused(
        v1::SampleRequest {
            logits: ln(&PROBS),
            params: Some(v1::SamplingParams {
                dry_multiplier: Some(0.8),
                dry_penalty_last_n: Some(-5),
                dry_sequence_breakers: vec![String::new()],
                ..Default::default()
            }),
            ..Default::default()
        },
        Code::InvalidArgument,
        &["params.dry_penalty_last_n", "got -5"],
    )
    .await;
    s.stop().await;
}
