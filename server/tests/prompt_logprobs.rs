//! `GenerateRequest.prompt_logprobs` against the real model
//! (`SAMPLERD_MODEL`; skips without it): each prompt token's logprob is,
//! bit for bit, its raw logit minus the log-sum-exp of the logits a fresh
//! session's one-token decode steps give at the position before it; rank
//! and top N follow that row; sent once, before the first token, with the
//! output unchanged; N above the limit is refused naming the field.

mod common;

use std::sync::{Arc, OnceLock};

use common::*;
use samplerd::generate::generator::Generator;
use samplerd::generate::{GenerateConfig, ModelHost};
use samplerd_api::v1;
use samplerd_sampling::logits::log_sum_exp;
use tonic::Code;

fn shared_host() -> Option<Arc<ModelHost>> {
    static HOST: OnceLock<Option<Arc<ModelHost>>> = OnceLock::new();
    HOST.get_or_init(|| {
        Some(Arc::new(
            ModelHost::load(&model_path()?, GenerateConfig::default()).expect("model loads"),
        ))
    })
    .clone()
}

fn messages() -> Vec<v1::ChatMessage> {
    vec![v1::ChatMessage {
        role: "user".into(),
        // Long enough for two passes of 32 rows.
        content: "What is the capital of France? Answer in one sentence, then name two \
                  rivers that flow through it and one famous bridge over each of them."
            .into(),
    }]
}

fn request(prompt_logprobs: Option<u32>, n: u32) -> v1::GenerateRequest {
    v1::GenerateRequest {
        messages: messages(),
        max_tokens: Some(6),
        n,
        prompt_logprobs,
        params: Some(v1::SamplingParams {
            temperature: Some(0.0),
            ..Default::default()
        }),
        ..Default::default()
    }
}

#[tokio::test]
async fn prompt_logprobs_equal_decode_steps_log_softmax_bit_for_bit() {
    let Some(host) = shared_host() else {
        eprintln!("SAMPLERD_MODEL is not set: skipping the prompt_logprobs test");
        return;
    };
    let model = host.model().clone();
    let s = start_serving(test_config(), Some(host as Arc<dyn Generator>)).await;
    const N: usize = 5;
    // Twice: the second run's prompt comes from the prompt cache, and its
    // logprobs must not be skipped.
    let plain = generate(&s, request(None, 1)).await.unwrap();
    assert!(plain.prompt_logprobs.is_none(), "not asked for");
    for _ in 0..2 {
        let out = generate(&s, request(Some(N as u32), 1)).await.unwrap();
        assert_eq!(out.tokens, plain.tokens, "the output is unchanged");
        let got = out.prompt_logprobs.expect("PromptLogprobs sent").tokens;
        let msgs: Vec<samplerd_model::ChatMessage> = messages()
            .into_iter()
            .map(|m| samplerd_model::ChatMessage {
                role: m.role,
                content: m.content,
            })
            .collect();
        let prompt = model.chat_tokens(&msgs, false).unwrap();
        assert!(prompt.len() > 40, "two passes: {}", prompt.len());
        assert_eq!(got.len(), prompt.len() - 1);
        let mut session = model.new_session().unwrap();
        for (i, e) in got.iter().enumerate() {
            let row = session.decode(prompt[i]).unwrap().to_vec();
            let lse = log_sum_exp(&row);
            assert_eq!(e.token_id, prompt[i + 1], "position {i}");
            let want = row[prompt[i + 1] as usize] - lse;
            assert_eq!(e.logprob.to_bits(), want.to_bits(), "position {i}");
            let better = row.iter().filter(|&&l| l - lse > want).count();
            assert_eq!(e.rank as usize, better + 1, "position {i}");
            let mut order: Vec<u32> = (0..row.len() as u32).collect();
            order.sort_by(|&a, &b| row[b as usize].total_cmp(&row[a as usize]).then(a.cmp(&b)));
            let top: Vec<(u32, u32)> = e
                .top
                .iter()
                .map(|t| (t.token_id, t.logprob.to_bits()))
                .collect();
            let want_top: Vec<(u32, u32)> = order[..N]
                .iter()
                .map(|&t| (t, (row[t as usize] - lse).to_bits()))
                .collect();
            assert_eq!(top, want_top, "position {i}");
        }
    }
    // n = 2: one event for both choices (the test helper refuses a second).
    let outs = generate_choices(&s, request(Some(0), 2)).await.unwrap();
    let once = outs[0].prompt_logprobs.as_ref().expect("sent");
    assert!(
        once.tokens.iter().all(|t| t.top.is_empty()),
        "N = 0: no top"
    );
    s.stop().await;
}

#[tokio::test]
async fn prompt_logprobs_above_the_limit_are_refused_naming_the_field() {
    let Some(host) = shared_host() else {
        eprintln!("SAMPLERD_MODEL is not set: skipping the prompt_logprobs test");
        return;
    };
    let s = start_serving(test_config(), Some(host as Arc<dyn Generator>)).await;
    let err = generate(&s, request(Some(21), 1))
        .await
        .expect_err("over the limit");
    assert_status(
        &err,
        Code::InvalidArgument,
        &[
            "prompt_logprobs",
            "21 exceeds the limit of 20 (generate.max_prompt_logprobs)",
        ],
    );
    use tonic_types::StatusExt as _;
    let details = err.get_error_details();
    assert_eq!(
        details.bad_request().expect("BadRequest").field_violations[0].field,
        "prompt_logprobs"
    );
    s.stop().await;
}
