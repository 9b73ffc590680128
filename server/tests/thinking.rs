//! A thinking model's reasoning budget and a lazy constraint triggered by
//! its close marker, on a tiny Qwen3-style model whose vocabulary has
//! `<think>` and `</think>` as special tokens (written by
//! `server/model/tests/support/tiny_formats.rs`): the server finds the
//! markers in the vocabulary with no `generate.reasoning_markers`
//! configured. The model's weights are random, so the generation is put
//! inside a reasoning block with `resume` (a client continuing a stream
//! that had already opened `<think>`): the budget counts the resumed
//! tokens, as it counts sampled ones.

mod common;

use std::sync::Arc;

use common::*;
use samplerd::generate::generator::Generator;
use samplerd::generate::{GenerateConfig, ModelHost};
use samplerd_api::v1;
use tonic::Code;

#[path = "../model/tests/support/tiny_formats.rs"]
mod tiny_formats;

use tiny_formats::{END_THINK, THINK};

async fn server(dir: &tempfile::TempDir) -> TestServer {
    let path = dir.path().join("tiny-qwen3-think.gguf");
    tiny_formats::write_thinking_model(&path);
    let host = Arc::new(ModelHost::load(&path, GenerateConfig::default()).expect("model loads"));
    let mut c = test_config();
    c.plugins.files = vec![core_plugin(), constraint_plugin()];
    assert!(
        c.generate.reasoning_markers.is_empty(),
        "no configured markers"
    );
    start_serving(c, Some(host as Arc<dyn Generator>)).await
}

/// A greedy request continuing a generation that produced `resumed`, for
/// `new` more tokens (`max_tokens` counts the resumed ones).
fn request(resumed: &[u32], budget: Option<u32>, new: u32) -> v1::GenerateRequest {
    v1::GenerateRequest {
        prompt: "the question".into(),
        max_tokens: Some(resumed.len() as u32 + new),
        ignore_eos: true,
        reasoning_budget: budget,
        resume: Some(v1::GenerateResume {
            token_ids: resumed.to_vec(),
        }),
        params: Some(v1::SamplingParams {
            temperature: Some(0.0),
            // The close marker stays out of reach unless forced.
            logit_bias: [(END_THINK, -100.0), (THINK, -100.0)].into(),
            ..Default::default()
        }),
        ..Default::default()
    }
}

#[tokio::test]
async fn the_budget_forces_the_close_marker_found_in_the_vocabulary() {
    let dir = tempfile::tempdir().unwrap();
    let s = server(&dir).await;
    // Opened `<think>` and thought two tokens: a budget of 5 leaves three.
    let resumed = [THINK, 104, 105];
    let free = generate(&s, request(&resumed, None, 8)).await.unwrap();
    assert!(!free.tokens.contains(&END_THINK), "{:?}", free.tokens);
    let out = generate(&s, request(&resumed, Some(5), 8)).await.unwrap();
    // Three more reasoning tokens (the free run's), then `</think>`, then
    // free text again: a closed block is never forced twice.
    assert_eq!(out.tokens[..3], free.tokens[..3]);
    assert_eq!(out.tokens[3], END_THINK, "{:?}", out.tokens);
    assert!(!out.tokens[4..].contains(&END_THINK), "{:?}", out.tokens);
    assert_eq!(out.tokens.len(), 8);

    // With a message: its tokens, then the marker.
    let mut req = request(&resumed, Some(5), 10);
    req.reasoning_budget_message = "ok".into();
    let out = generate(&s, req).await.unwrap();
    // The vocabulary's byte tokens: byte b is id 3 + b.
    let byte = |b: u8| 3 + u32::from(b);
    assert_eq!(
        out.tokens[3..6],
        [byte(b'o'), byte(b'k'), END_THINK],
        "{:?}",
        out.tokens
    );

    // A budget the resumed tokens spent forces at once.
    let out = generate(&s, request(&resumed, Some(2), 3)).await.unwrap();
    assert_eq!(out.tokens[0], END_THINK, "{:?}", out.tokens);
    s.stop().await;
}

#[tokio::test]
async fn the_forced_close_triggers_a_lazy_constraint() {
    let dir = tempfile::tempdir().unwrap();
    let s = server(&dir).await;
    let resumed = [THINK, 104, 105];
    for trigger in [
        // By token id, and by the marker's text.
        (vec![], vec![END_THINK]),
        (vec!["</think>".to_string()], vec![]),
    ] {
        let mut req = request(&resumed, Some(4), 12);
        req.ignore_eos = false;
        let p = req.params.as_mut().unwrap();
        // End-of-generation only where the grammar leaves nothing else.
        p.logit_bias.insert(0, -100.0);
        p.logit_bias.insert(2, -100.0);
        p.constraint = Some(v1::Constraint {
            kind: Some(v1::constraint::Kind::Regex("[0-9]{3}".into())),
            trigger_strings: trigger.0.clone(),
            trigger_tokens: trigger.1.clone(),
            ..Default::default()
        });
        let out = generate(&s, req).await.unwrap();
        let at = out
            .tokens
            .iter()
            .position(|&t| t == END_THINK)
            .unwrap_or_else(|| panic!("no forced close in {:?}", out.tokens));
        assert_eq!(at, 2, "{trigger:?}: {:?}", out.tokens);
        // Free before the marker (the unconstrained run's tokens), three
        // digits after it, then the end.
        let free = generate(&s, request(&resumed, None, 2)).await.unwrap();
        assert_eq!(out.tokens[..2], free.tokens[..2], "{trigger:?}");
        let after = out.texts[at + 1..].concat();
        assert!(
            after.len() == 3 && after.bytes().all(|b| b.is_ascii_digit()),
            "{trigger:?}: {after:?} after </think>"
        );
        assert_eq!(out.reason(), v1::FinishReason::StopToken, "{trigger:?}");
    }
    s.stop().await;
}

#[tokio::test]
async fn a_budget_on_a_model_without_markers_is_refused_naming_the_field() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("tiny-llama.gguf");
    tiny_formats::write_model(&path, "llama", candle_core::quantized::GgmlDType::Q8_0);
    let host = Arc::new(ModelHost::load(&path, GenerateConfig::default()).expect("model loads"));
    let mut c = test_config();
    c.plugins.files = vec![core_plugin(), constraint_plugin()];
    let s = start_serving(c, Some(host as Arc<dyn Generator>)).await;
    let e = generate(&s, request(&[], Some(4), 4)).await.unwrap_err();
    assert_eq!(e.code(), Code::InvalidArgument, "{e:?}");
    assert!(e.message().contains("reasoning_budget"), "{e:?}");
    assert!(e.message().contains("no reasoning markers"), "{e:?}");
    s.stop().await;
}
