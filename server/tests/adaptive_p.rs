//! `adaptive_target` / `adaptive_decay` end to end: the typed fields make
//! `adaptive_p` the draw of a SampleStream (its average carried from step
//! to step in the sequence's state), and a bad value is refused naming the
//! field. The stage's arithmetic against llama.cpp's is
//! plugins/core/tests/adaptive_p.rs.

mod common;

use common::*;
use samplerd_api::v1;
use tonic::Code;

/// Two tokens with probabilities 0.9 and 0.1.
fn row() -> Vec<f32> {
    vec![0.9f32.ln(), 0.1f32.ln()]
}

async fn picks_of_the_rare_token(s: &TestServer, params: v1::SamplingParams) -> usize {
    let msgs: Vec<v1::SampleStreamRequest> = (0..60)
        .map(|i| v1::SampleStreamRequest {
            logits: row(),
            params: (i == 0).then(|| params.clone()),
            ..Default::default()
        })
        .collect();
    s.stream_all(msgs)
        .await
        .iter()
        .filter(|r| r.token_id == 1)
        .count()
}

/// With a target of 0.1 the 0.1-probability token is the one near it:
/// adaptive-p picks it nearly always, where `dist` picks it about one
/// time in ten.
#[tokio::test]
async fn adaptive_target_steers_the_draw() {
    let s = start().await;
    let seeded = v1::SamplingParams {
        seed: Some(3),
        top_k: Some(0),
        top_p: Some(1.0),
        temperature: Some(1.0),
        repeat_penalty: Some(1.0),
        ..Default::default()
    };
    let plain = picks_of_the_rare_token(&s, seeded.clone()).await;
    let adaptive = picks_of_the_rare_token(
        &s,
        v1::SamplingParams {
            adaptive_target: Some(0.1),
            ..seeded
        },
    )
    .await;
    assert!(
        plain <= 15,
        "dist picked the rare token {plain} times of 60"
    );
    assert!(
        adaptive >= 50,
        "adaptive-p picked the rare token {adaptive} times of 60"
    );
    s.stop().await;
}

#[tokio::test]
async fn bad_adaptive_values_name_the_field() {
    let s = start().await;
    for (params, field) in [
        (
            v1::SamplingParams {
                adaptive_target: Some(1.5),
                ..Default::default()
            },
            "params.adaptive_target",
        ),
        (
            v1::SamplingParams {
                adaptive_target: Some(0.5),
                adaptive_decay: Some(f32::NAN),
                ..Default::default()
            },
            "params.adaptive_decay",
        ),
    ] {
        s.assert_sample_refused(
            v1::SampleRequest {
                logits: row(),
                params: Some(params),
                ..Default::default()
            },
            Code::InvalidArgument,
            &[field, "adaptive_p"],
        )
        .await;
    }
    s.stop().await;
}

/// A target of 0 beside a huge logit: every other token's own probability
/// underflows to 0 in f32, so each is at the target and one of them is
/// drawn (llama.cpp's reshaping draw does the same), and the response
/// reports the chain's probability before the draw, 0 (its `logprob`, the
/// raw log-softmax, is the logit minus 1e30).
/// A plain draw on the same row takes the huge logit with probability 1.
#[tokio::test]
async fn a_target_of_zero_draws_a_token_whose_own_probability_underflows() {
    let s = start().await;
    let logits = vec![1e30f32, 0.0, 0.5, -0.5];
    let params = v1::SamplingParams {
        seed: Some(11),
        top_k: Some(0),
        top_p: Some(1.0),
        temperature: Some(1.0),
        repeat_penalty: Some(1.0),
        ..Default::default()
    };
    let request = |params: v1::SamplingParams| v1::SampleRequest {
        logits: logits.clone(),
        params: Some(params),
        ..Default::default()
    };
    let plain = s.sample_ok(request(params.clone())).await;
    assert_eq!((plain.token_id, plain.probability), (0, 1.0));
    let adaptive = s
        .sample_ok(request(v1::SamplingParams {
            adaptive_target: Some(0.0),
            ..params
        }))
        .await;
    assert_ne!(adaptive.token_id, 0, "adaptive-p took the huge logit");
    assert_eq!(adaptive.probability, 0.0);
    assert_eq!(adaptive.logprob, -1e30);
    s.assert_serving().await;
    s.stop().await;
}
