//! Generate with `n` choices: one prefill, choice i byte for byte the
//! `n = 1` generation with seed `seed + i` (tokens, texts, log-probabilities,
//! the Finished), with stop strings, a constraint and `n_probs`; the limit and
//! `resume` refused naming the field; a cancelled request stops every
//! choice and frees its slot. Needs SAMPLERD_MODEL (skips without it).

mod common;

use std::sync::Arc;
use std::time::{Duration, Instant};

use common::*;
use samplerd::generate::generator::Generator;
use samplerd::generate::{GenerateConfig, ModelHost};
use samplerd_api::v1;
use samplerd_api::v1::generate_response::Event;
use tonic::Code;

fn host(cfg: GenerateConfig) -> Option<Arc<ModelHost>> {
    let path = model_path()?;
    Some(Arc::new(ModelHost::load(&path, cfg).expect("model loads")))
}

async fn server(cfg: GenerateConfig) -> Option<TestServer> {
    let Some(h) = host(cfg) else {
        eprintln!("SAMPLERD_MODEL is not set: skipping the n-choices test");
        return None;
    };
    // The core and constraint stage libraries.
    let mut c = test_config();
    c.plugins.files = vec![core_plugin(), constraint_plugin()];
    Some(start_serving(c, Some(h as Arc<dyn Generator>)).await)
}

fn chat(q: &str, max_tokens: u32, n: u32, params: v1::SamplingParams) -> v1::GenerateRequest {
    v1::GenerateRequest {
        messages: vec![v1::ChatMessage {
            role: "user".into(),
            content: q.into(),
        }],
        max_tokens: Some(max_tokens),
        params: Some(params),
        n,
        ..Default::default()
    }
}

fn seeded(seed: u64) -> v1::SamplingParams {
    v1::SamplingParams {
        seed: Some(seed),
        ..Default::default()
    }
}

/// The parts of an output that must match byte for byte (timings and the
/// prompt cache's counts are the run's own).
fn comparable(out: &Output) -> Output {
    let mut f = out.finished.clone().expect("finished");
    without_run_details(&mut f);
    f.choice = 0;
    Output {
        tokens: out.tokens.clone(),
        logprob_bits: out.logprob_bits.clone(),
        texts: out.texts.clone(),
        finished: Some(f),
        prompt_logprobs: None,
    }
}

#[tokio::test]
async fn choice_i_equals_one_choice_with_seed_plus_i() {
    let Some(s) = server(GenerateConfig::default()).await else {
        return;
    };
    let person = r#"{"type":"object","properties":{"name":{"type":"string","maxLength":12},"age":{"type":"integer"}},"required":["name","age"]}"#;
    let cases = [
        (
            3,
            chat("Write a short poem about the sea.", 24, 3, seeded(11)),
        ),
        (4, {
            let mut r = chat("List three fruits, one per line.", 32, 4, seeded(5));
            r.stop = vec!["\n\n".into(), "4.".into()];
            r.n_probs = 2;
            r
        }),
        (2, {
            let mut p = seeded(2);
            p.constraint = Some(v1::Constraint {
                kind: Some(v1::constraint::Kind::JsonSchema(person.into())),
                ..Default::default()
            });
            chat("Describe a person as JSON.", 48, 2, p)
        }),
    ];
    for (n, req) in cases {
        let seed = req.params.as_ref().unwrap().seed.unwrap();
        let all = generate_choices(&s, req.clone()).await.expect("generate n");
        assert_eq!(all.len(), n);
        for (i, out) in all.iter().enumerate() {
            let f = out.finished.as_ref().unwrap();
            assert_eq!(f.choice as usize, i);
            assert_eq!(f.seed, seed + i as u64, "choice {i}'s seed");
            let mut one = req.clone();
            one.n = 1;
            one.params.as_mut().unwrap().seed = Some(seed + i as u64);
            let alone = generate(&s, one).await.expect("generate n = 1");
            assert_eq!(
                comparable(out),
                comparable(&alone),
                "n = {n}, choice {i} differs from n = 1 with seed {}",
                seed + i as u64
            );
        }
        // Each choice its own seed: not n copies of one completion.
        assert!(
            all.iter().any(|o| o.tokens != all[0].tokens),
            "n = {n}: every choice is the same"
        );
    }
    s.assert_serving().await;
}

#[tokio::test]
async fn bad_choices_name_the_field() {
    let Some(s) = server(GenerateConfig::default()).await else {
        return;
    };
    let err = generate(&s, chat("Hi", 4, 17, seeded(1)))
        .await
        .unwrap_err();
    assert_status(
        &err,
        Code::InvalidArgument,
        &["n", "17", "limits.max_choices"],
    );
    let mut resumed = chat("Hi", 4, 2, seeded(1));
    resumed.resume = Some(v1::GenerateResume { token_ids: vec![1] });
    let err = generate(&s, resumed).await.unwrap_err();
    assert_status(&err, Code::InvalidArgument, &["resume", "n is 2"]);
    // n = 0 (unset) is one choice.
    let one = generate_choices(&s, chat("Hi", 4, 0, seeded(1)))
        .await
        .unwrap();
    assert_eq!(one.len(), 1);
}

#[tokio::test]
async fn cancelling_stops_every_choice_and_frees_the_slot() {
    let Some(s) = server(GenerateConfig {
        max_concurrent_generations: 1,
        max_queued_generations: 0,
        ..Default::default()
    })
    .await
    else {
        return;
    };
    let mut long = chat(
        "Tell me a very long story about dragons.",
        400,
        4,
        seeded(3),
    );
    long.ignore_eos = true;
    let mut client = s.client.clone();
    let mut stream = client.generate(long).await.unwrap().into_inner();
    let mut seen = std::collections::BTreeSet::new();
    while seen.len() < 4 {
        let msg = tokio::time::timeout(DEADLINE, stream.message())
            .await
            .expect("tokens within the deadline")
            .unwrap()
            .expect("a token");
        let Some(Event::Token(t)) = msg.event else {
            panic!("a token, not {msg:?}")
        };
        seen.insert(t.choice);
    }
    drop(stream);
    // Every choice stops within a step: the one slot frees.
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        match generate(&s, chat("Hi", 4, 1, seeded(1))).await {
            Ok(_) => break,
            Err(e) if e.code() == Code::ResourceExhausted && Instant::now() < deadline => {
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
            Err(e) => panic!("slot not freed after cancellation: {e:?}"),
        }
    }
    s.assert_serving().await;
}

#[tokio::test]
async fn each_choice_is_charged_its_own_kv_cache() {
    let Some(h) = host(GenerateConfig::default()) else {
        return;
    };
    // SmolLM2's f16 K/V at the default 4,096 context is ~94 MB a
    // sequence: room for one choice, not for four.
    let mut config = test_config();
    config.limits.memory_budget_bytes = 200 << 20;
    let s = start_serving(config, Some(h as Arc<dyn Generator>)).await;
    let err = generate(&s, chat("Hi", 4, 4, seeded(1))).await.unwrap_err();
    assert_status(
        &err,
        Code::ResourceExhausted,
        &["this Generate request", "limits.memory_budget_bytes"],
    );
    generate(&s, chat("Hi", 4, 1, seeded(1)))
        .await
        .expect("one choice fits");
    s.assert_serving().await;
}
