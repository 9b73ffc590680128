//! Generate's token controls against the real default model
//! (SmolLM2-135M-Instruct Q4_1), greedy so that each control's effect is
//! exact: `min_tokens` (end tokens masked, stop strings not looked for
//! until then), `stop_token_ids` (end like the end-of-generation token),
//! `bad_words` (never generated), each kept by a resume, and every bad
//! input refused naming its field.
//!
//! The model path comes from `SAMPLERD_MODEL`; without it these tests
//! print a notice and pass.

mod common;

use std::sync::{Arc, OnceLock};

use common::*;
use samplerd::generate::generator::Generator;
use samplerd::generate::{GenerateConfig, ModelHost};
use samplerd_api::v1;
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

macro_rules! require_model {
    () => {
        match shared_host() {
            Some(h) => h,
            None => {
                eprintln!("SAMPLERD_MODEL is not set: skipping the real-model Generate test");
                return;
            }
        }
    };
}

async fn server(host: Arc<ModelHost>) -> TestServer {
    start_serving(test_config(), Some(host as Arc<dyn Generator>)).await
}

const Q: &str = "What is the capital of France? Answer in one sentence.";

fn greedy_chat(max_tokens: u32) -> v1::GenerateRequest {
    v1::GenerateRequest {
        messages: vec![v1::ChatMessage {
            role: "user".into(),
            content: Q.into(),
        }],
        max_tokens: Some(max_tokens),
        params: Some(v1::SamplingParams {
            temperature: Some(0.0),
            repeat_penalty: Some(1.0),
            ..Default::default()
        }),
        ..Default::default()
    }
}

/// The greedy answer ("The capital of France is Paris."), which ends
/// with the end-of-generation token.
async fn answer(s: &TestServer) -> Output {
    let full = generate(s, greedy_chat(64)).await.unwrap();
    assert_eq!(full.reason(), v1::FinishReason::StopToken, "{full:?}");
    assert!(full.tokens.len() >= 4, "{full:?}");
    full
}

fn contains_run(hay: &[u32], needle: &[u32]) -> bool {
    hay.windows(needle.len()).any(|w| w == needle)
}

/// With min_tokens past the answer's end, the end-of-generation token
/// is masked where greedy chose it: the first tokens are the answer's,
/// then it goes on for at least min_tokens.
#[tokio::test]
async fn min_tokens_masks_the_end_until_reached() {
    let host = require_model!();
    let s = server(host).await;
    let full = answer(&s).await;
    let k = full.tokens.len();
    let mut req = greedy_chat(k as u32 + 8);
    req.min_tokens = k as u32 + 3;
    let out = generate(&s, req).await.unwrap();
    assert!(out.tokens.len() >= k + 3, "{out:?}");
    assert_eq!(out.tokens[..k], full.tokens[..], "{out:?}");
    s.stop().await;
}

/// A stop token id ends the generation as the end-of-generation token
/// does (not sent, STOP_TOKEN), even with ignore_eos; min_tokens holds it
/// back.
#[tokio::test]
async fn stop_token_ids_end_like_the_end_token() {
    let host = require_model!();
    let s = server(host).await;
    let full = answer(&s).await;
    let i = (1..full.tokens.len())
        .find(|&i| !full.tokens[..i].contains(&full.tokens[i]))
        .expect("a token not seen before it");
    for ignore_eos in [false, true] {
        let mut req = greedy_chat(64);
        req.stop_token_ids = vec![full.tokens[i]];
        req.ignore_eos = ignore_eos;
        let out = generate(&s, req).await.unwrap();
        assert_eq!(out.tokens, full.tokens[..i], "ignore_eos {ignore_eos}");
        assert_eq!(out.reason(), v1::FinishReason::StopToken);
    }
    let mut req = greedy_chat(64);
    req.stop_token_ids = vec![full.tokens[i]];
    req.min_tokens = i as u32 + 1;
    let out = generate(&s, req).await.unwrap();
    assert_eq!(out.tokens[..i], full.tokens[..i]);
    assert_ne!(out.tokens[i], full.tokens[i], "masked until min_tokens");
    s.stop().await;
}

/// A stop string the first token completes stops at once, but not
/// before min_tokens tokens (vLLM's rule).
#[tokio::test]
async fn stop_strings_wait_for_min_tokens() {
    let host = require_model!();
    let s = server(host).await;
    let full = answer(&s).await;
    let stop = full.text()[..1].to_string();
    let mut req = greedy_chat(64);
    req.stop = vec![stop.clone()];
    let early = generate(&s, req.clone()).await.unwrap();
    assert_eq!(early.reason(), v1::FinishReason::StopString);
    assert!(early.tokens.len() <= 1, "{early:?}");
    req.min_tokens = 3;
    let out = generate(&s, req).await.unwrap();
    assert!(out.tokens.len() >= 3, "{out:?}");
    assert_eq!(out.tokens[..3], full.tokens[..3]);
    s.stop().await;
}

/// A bad word's tokens (as written, and with a leading space) never
/// appear in the output; up to where the answer had it, nothing changes.
#[tokio::test]
async fn bad_words_are_never_generated() {
    let host = require_model!();
    let tok = host.model().tokenizer();
    let s = server(Arc::clone(&host)).await;
    let full = answer(&s).await;
    let text = full.text();
    assert!(text.contains("Paris"), "{text:?}");
    let seqs: Vec<Vec<u32>> = ["Paris", " Paris"]
        .iter()
        .map(|w| tok.encode(w, false, false).unwrap())
        .collect();
    let first = (0..full.tokens.len())
        .find(|&p| seqs.iter().any(|q| full.tokens[p..].starts_with(q)))
        .expect("the answer holds the word's tokens");
    let mut req = greedy_chat(64);
    req.bad_words = vec!["Paris".into()];
    let out = generate(&s, req).await.unwrap();
    for q in &seqs {
        assert!(!contains_run(&out.tokens, q), "{q:?} in {out:?}");
    }
    assert_eq!(out.tokens[..first], full.tokens[..first]);
    s.stop().await;
}

/// A resumed run with the controls streams the rest of the uninterrupted
/// one; a resumed token the controls would have masked is refused.
#[tokio::test]
async fn controls_survive_a_resume() {
    let host = require_model!();
    let s = server(host).await;
    let full = answer(&s).await;
    let mut req = greedy_chat(24);
    req.min_tokens = full.tokens.len() as u32 + 2;
    req.bad_words = vec!["Paris".into()];
    let whole = generate(&s, req.clone()).await.unwrap();
    for k in [1, whole.tokens.len() / 2, whole.tokens.len() - 1] {
        let mut r = req.clone();
        r.resume = Some(v1::GenerateResume {
            token_ids: whole.tokens[..k].to_vec(),
        });
        let rest = generate(&s, r).await.unwrap();
        assert_eq!(rest.tokens, whole.tokens[k..], "resumed after {k}");
    }
    // The answer itself has the bad word: resuming with it is refused.
    let mut r = req.clone();
    r.resume = Some(v1::GenerateResume {
        token_ids: full.tokens.clone(),
    });
    let err = generate(&s, r).await.expect_err("a masked token");
    assert_status(
        &err,
        Code::InvalidArgument,
        &["resume.token_ids[", "masked"],
    );
    s.stop().await;
}

#[tokio::test]
async fn bad_controls_are_refused_naming_the_field() {
    let host = require_model!();
    let n_vocab = host.model().n_vocab() as u32;
    let s = server(host).await;
    let with = |f: &dyn Fn(&mut v1::GenerateRequest)| {
        let mut r = greedy_chat(8);
        f(&mut r);
        r
    };
    let cases: Vec<(v1::GenerateRequest, &str, &str)> = vec![
        (
            with(&|r| r.min_tokens = 9),
            "min_tokens",
            "9 exceeds max_tokens (8)",
        ),
        (
            with(&|r| r.stop_token_ids = vec![1, n_vocab]),
            "stop_token_ids[1]",
            "outside the model's vocabulary",
        ),
        (
            with(&|r| r.stop_token_ids = vec![1; 65]),
            "stop_token_ids",
            "generate.max_stop_token_ids",
        ),
        (
            with(&|r| r.bad_words = vec!["x".into(); 129]),
            "bad_words",
            "generate.max_bad_words",
        ),
        (
            with(&|r| r.bad_words = vec!["ok".into(), " \t".into()]),
            "bad_words[1]",
            "non-blank",
        ),
        (
            with(&|r| r.bad_words = vec!["y".repeat(257)]),
            "bad_words[0]",
            "generate.max_bad_word_bytes",
        ),
    ];
    for (request, field, needle) in cases {
        let err = generate(&s, request).await.expect_err(field);
        assert_status(&err, Code::InvalidArgument, &[field, needle]);
        use tonic_types::StatusExt as _;
        let details = err.get_error_details();
        let violations = &details.bad_request().expect("BadRequest").field_violations;
        assert_eq!(violations[0].field, field, "{err:?}");
    }
    s.stop().await;
}

fn penalised(rp: f32) -> v1::GenerateRequest {
    let mut r = greedy_chat(16);
    let p = r.params.as_mut().unwrap();
    p.repeat_penalty = Some(rp);
    p.repeat_last_n = Some(-1);
    r
}

/// `penalize_prompt` unset is today's behaviour (the prompt is history);
/// false starts the window empty: the first token is then the unpenalised
/// one, and the run differs from the prompt-penalised one.
#[tokio::test]
async fn penalize_prompt_false_leaves_the_prompt_out_of_the_window() {
    let host = require_model!();
    let s = server(host).await;
    let plain = answer(&s).await;
    let default = generate(&s, penalised(3.0)).await.unwrap();
    let mut with = penalised(3.0);
    with.penalize_prompt = Some(true);
    assert_eq!(generate(&s, with).await.unwrap().tokens, default.tokens);
    let mut without = penalised(3.0);
    without.penalize_prompt = Some(false);
    let without = generate(&s, without).await.unwrap();
    assert_eq!(without.tokens[0], plain.tokens[0]);
    assert_ne!(without.tokens, default.tokens);
    s.stop().await;
}

/// Excluding every id makes the penalties a no-op: the unpenalised answer.
#[tokio::test]
async fn penalty_exclude_tokens_spares_them() {
    let host = require_model!();
    let n_vocab = host.model().n_vocab() as u32;
    let s = server(host).await;
    let plain = answer(&s).await;
    let penalised_run = generate(&s, penalised(3.0)).await.unwrap();
    assert_ne!(penalised_run.tokens, plain.tokens);
    let mut spared = penalised(3.0);
    spared.params.as_mut().unwrap().penalty_exclude_tokens = (0..n_vocab).collect();
    let out = generate(&s, spared).await.unwrap();
    assert_eq!(out.tokens, plain.tokens);
    let mut bad = penalised(3.0);
    bad.params.as_mut().unwrap().penalty_exclude_tokens = vec![5, n_vocab];
    let err = generate(&s, bad).await.expect_err("outside the vocabulary");
    assert_status(
        &err,
        Code::InvalidArgument,
        &["params.penalty_exclude_tokens", "outside the vocabulary"],
    );
    s.stop().await;
}

/// A reasoning budget with plain-text markers from the configuration
/// (SmolLM2 has no `<think>` token): "The" opens, "." closes. With a budget
/// of 2 the answer's third token after "The" is the message, then ".";
/// a budget the answer stays inside changes nothing; a resume replays the
/// forcing.
#[tokio::test]
async fn reasoning_budget_forces_the_message_and_close() {
    let host = require_model!();
    let tok = host.model().tokenizer();
    let mut config = test_config();
    config.generate.reasoning_markers = vec!["The".into(), ".".into()];
    let s = start_serving(config, Some(host.clone() as Arc<dyn Generator>)).await;
    let plain = answer(&s).await;
    assert_eq!(plain.texts[0], "The", "{plain:?}");
    let mut req = greedy_chat(16);
    req.reasoning_budget = Some(2);
    req.reasoning_budget_message = " Enough".into();
    let out = generate(&s, req.clone()).await.unwrap();
    let mut want = plain.tokens[..3].to_vec();
    want.extend(tok.encode(" Enough", false, false).unwrap());
    want.extend(tok.encode(".", false, true).unwrap());
    assert_eq!(out.tokens[..want.len()], want[..], "{:?}", out.text());
    let k = want.len() - 1;
    let mut r = req.clone();
    r.resume = Some(v1::GenerateResume {
        token_ids: out.tokens[..k].to_vec(),
    });
    assert_eq!(generate(&s, r).await.unwrap().tokens, out.tokens[k..]);
    let mut roomy = greedy_chat(64);
    roomy.reasoning_budget = Some(20);
    assert_eq!(generate(&s, roomy).await.unwrap().tokens, plain.tokens);
    s.stop().await;
}

/// Without markers (no `<think>` token, none configured) a budget is
/// refused naming it; a message without a budget names the message.
#[tokio::test]
async fn reasoning_budget_needs_markers() {
    let host = require_model!();
    let s = server(host).await;
    let mut req = greedy_chat(8);
    req.reasoning_budget = Some(4);
    let err = generate(&s, req).await.expect_err("no markers");
    assert_status(
        &err,
        Code::InvalidArgument,
        &["reasoning_budget", "no reasoning markers"],
    );
    let mut req = greedy_chat(8);
    req.reasoning_budget_message = "stop".into();
    let err = generate(&s, req).await.expect_err("no budget");
    assert_status(
        &err,
        Code::InvalidArgument,
        &["reasoning_budget_message", "without reasoning_budget"],
    );
    s.stop().await;
}
