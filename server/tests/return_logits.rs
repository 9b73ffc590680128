//! Generate's `return_logits`: each Token carries its step's raw logits —
//! the ones the token was sampled from (greedy picks their argmax, and the
//! token's logprob is their log-softmax) — as the full row in f32, f16 or
//! bf16, or as the top n and the log-sum-exp of the rest; bad values are
//! refused naming the field. Needs SAMPLERD_MODEL (skips without it).

mod common;

use std::sync::Arc;

use common::*;
use half::{bf16, f16};
use samplerd::generate::generator::Generator;
use samplerd::generate::{GenerateConfig, ModelHost};
use samplerd_api::v1;
use samplerd_api::v1::generate_response::Event;
use tonic::Code;

async fn server() -> Option<TestServer> {
    let Some(path) = model_path() else {
        eprintln!("SAMPLERD_MODEL is not set: skipping the return_logits test");
        return None;
    };
    let host = Arc::new(ModelHost::load(&path, GenerateConfig::default()).expect("model loads"));
    Some(start_serving(test_config(), Some(host as Arc<dyn Generator>)).await)
}

fn request(return_logits: v1::ReturnLogits) -> v1::GenerateRequest {
    v1::GenerateRequest {
        prompt: "The capital of France is".into(),
        max_tokens: Some(6),
        params: Some(v1::SamplingParams {
            temperature: Some(0.0),
            repeat_penalty: Some(1.0),
            ..Default::default()
        }),
        return_logits: Some(return_logits),
        ..Default::default()
    }
}

async fn tokens(s: &TestServer, req: v1::GenerateRequest) -> Vec<v1::Token> {
    let mut client = s.client.clone();
    let mut stream = client.generate(req).await.unwrap().into_inner();
    let mut out = Vec::new();
    while let Some(m) = tokio::time::timeout(DEADLINE, stream.message())
        .await
        .expect("within the deadline")
        .unwrap()
    {
        if let Some(Event::Token(t)) = m.event {
            out.push(t);
        }
    }
    out
}

fn log_sum_exp(l: &[f32]) -> f64 {
    let max = l.iter().copied().fold(f32::NEG_INFINITY, f32::max) as f64;
    max + l.iter().map(|&x| (x as f64 - max).exp()).sum::<f64>().ln()
}

#[tokio::test]
async fn each_token_carries_the_logits_it_was_sampled_from() {
    let Some(s) = server().await else {
        return;
    };
    let full = |dtype: v1::LogitsDtype| v1::ReturnLogits {
        dtype: dtype as i32,
        top_n: 0,
    };
    let f32_tokens = tokens(&s, request(full(v1::LogitsDtype::F32le))).await;
    assert_eq!(f32_tokens.len(), 6);
    let rows: Vec<Vec<f32>> = f32_tokens
        .iter()
        .map(|t| {
            t.logits
                .chunks_exact(4)
                .map(|c| f32::from_le_bytes(c.try_into().unwrap()))
                .collect()
        })
        .collect();
    for (t, row) in f32_tokens.iter().zip(&rows) {
        assert_eq!(row.len(), 49152, "one logit per vocabulary entry");
        let argmax = (0..row.len())
            .max_by(|&a, &b| row[a].total_cmp(&row[b]).then(b.cmp(&a)))
            .unwrap();
        assert_eq!(argmax as u32, t.token_id, "greedy picks the argmax");
        let logprob = row[t.token_id as usize] as f64 - log_sum_exp(row);
        assert!(
            (logprob - t.logprob as f64).abs() < 1e-4,
            "token {}: logprob {} against the row's {logprob}",
            t.token_id,
            t.logprob
        );
    }
    // The same steps in f16 and bf16: the f32 row, rounded.
    for (dtype, round) in [
        (
            v1::LogitsDtype::F16le,
            (|x: f32| f16::from_f32(x).to_le_bytes()) as fn(f32) -> [u8; 2],
        ),
        (v1::LogitsDtype::Bf16le, |x: f32| {
            bf16::from_f32(x).to_le_bytes()
        }),
    ] {
        let half_tokens = tokens(&s, request(full(dtype))).await;
        for (t, row) in half_tokens.iter().zip(&rows) {
            let want: Vec<u8> = row.iter().flat_map(|&x| round(x)).collect();
            assert!(
                t.logits == want,
                "{dtype:?} differs from the f32 row rounded"
            );
            assert!(t.sparse_logits.is_none());
        }
    }
    // Top 50: the row's 50 largest, ascending ids, the rest's log-sum-exp.
    let top = tokens(
        &s,
        request(v1::ReturnLogits {
            dtype: 0,
            top_n: 50,
        }),
    )
    .await;
    for (t, row) in top.iter().zip(&rows) {
        assert!(t.logits.is_empty());
        let sp = t.sparse_logits.as_ref().expect("sparse_logits");
        assert_eq!(sp.vocab_size as usize, row.len());
        assert_eq!(sp.ids.len(), 50);
        assert!(sp.ids.windows(2).all(|w| w[0] < w[1]), "ids ascending");
        let least = sp.values.iter().copied().fold(f32::INFINITY, f32::min);
        let above = row.iter().filter(|&&x| x > least).count();
        assert!(above < 50, "a logit above the sent ones was left out");
        for (&id, &v) in sp.ids.iter().zip(&sp.values) {
            assert_eq!(row[id as usize].to_bits(), v.to_bits());
        }
        let rest: Vec<f32> = (0..row.len())
            .filter(|i| sp.ids.binary_search(&(*i as u32)).is_err())
            .map(|i| row[i])
            .collect();
        assert!((sp.rest_logsumexp - log_sum_exp(&rest)).abs() < 1e-9);
    }
}

#[tokio::test]
async fn bad_return_logits_name_the_field() {
    let Some(s) = server().await else {
        return;
    };
    for (r, field) in [
        (
            v1::ReturnLogits { dtype: 9, top_n: 0 },
            "return_logits.dtype",
        ),
        (
            v1::ReturnLogits {
                dtype: 0,
                top_n: 49153,
            },
            "return_logits.top_n",
        ),
        (
            v1::ReturnLogits {
                dtype: v1::LogitsDtype::F16le as i32,
                top_n: 5,
            },
            "return_logits.dtype",
        ),
    ] {
        let err = generate(&s, request(r)).await.unwrap_err();
        assert_status(&err, Code::InvalidArgument, &[field]);
    }
}
