//! Lazy constraints (`params.constraint.trigger_strings` /
//! `trigger_tokens`): the output is the unconstrained output byte for byte
//! up to and including the trigger, and the grammar holds from right after
//! it — in Generate over the real model (`SAMPLERD_MODEL`; greedy and
//! seeded, a string spanning tokens and one ending inside a token, a token
//! id, the reasoning budget forcing the trigger), in SampleStream over a
//! named vocabulary, and the refusals.

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

fn config() -> samplerd::app::config::Config {
    let mut c = test_config();
    c.plugins.files = vec![core_plugin(), constraint_plugin()];
    if let Some(m) = model_path() {
        c.vocabularies.insert("smollm2".into(), m);
    }
    // SmolLM2 has no `<think>` token: "The" opens, "." closes.
    c.generate.reasoning_markers = vec!["The".into(), ".".into()];
    c
}

async fn model_server() -> Option<(Arc<ModelHost>, TestServer)> {
    let Some(host) = shared_host() else {
        eprintln!("skipped: no model (scripts/fetch-model.sh, SAMPLERD_MODEL)");
        return None;
    };
    let s = start_serving(config(), Some(host.clone() as Arc<dyn Generator>)).await;
    Some((host, s))
}

const Q: &str = "What is the capital of France? Answer in one sentence.";
const FLAG: &str = r#"{"type":"object","properties":{"ok":{"type":"boolean"}},"required":["ok"],"additionalProperties":false}"#;

/// A chat request; `seed` None is greedy.
fn chat(seed: Option<u64>, constraint: Option<v1::Constraint>) -> v1::GenerateRequest {
    v1::GenerateRequest {
        messages: vec![v1::ChatMessage {
            role: "user".into(),
            content: Q.into(),
        }],
        max_tokens: Some(48),
        params: Some(v1::SamplingParams {
            temperature: Some(if seed.is_some() { 0.9 } else { 0.0 }),
            seed,
            repeat_penalty: Some(1.0),
            constraint,
            ..Default::default()
        }),
        ..Default::default()
    }
}

fn lazy(kind: v1::constraint::Kind, strings: &[&str], tokens: &[u32]) -> Option<v1::Constraint> {
    Some(v1::Constraint {
        kind: Some(kind),
        trigger_strings: strings.iter().map(|s| s.to_string()).collect(),
        trigger_tokens: tokens.to_vec(),
        ..Default::default()
    })
}

fn schema() -> v1::constraint::Kind {
    v1::constraint::Kind::JsonSchema(FLAG.into())
}

/// `text` after the first `trigger`, which must be a JSON object of
/// [`FLAG`].
fn assert_flag_after(text: &str, trigger: &str) {
    let at = text
        .find(trigger)
        .unwrap_or_else(|| panic!("no {trigger:?} in {text:?}"));
    let rest = &text[at + trigger.len()..];
    let v: serde_json::Value =
        serde_json::from_str(rest).unwrap_or_else(|e| panic!("not JSON ({e}): {rest:?}"));
    let o = v.as_object().expect("an object");
    assert_eq!(o.len(), 1, "{v}");
    assert!(o["ok"].is_boolean(), "{v}");
}

/// The number of leading tokens of `out` whose text reaches the end of
/// the first `trigger`.
fn tokens_through(out: &Output, trigger: &str) -> usize {
    let end = out.text().find(trigger).expect("trigger in the output") + trigger.len();
    let mut len = 0;
    for (i, t) in out.texts.iter().enumerate() {
        len += t.len();
        if len >= end {
            return i + 1;
        }
    }
    panic!("the trigger ends past the tokens")
}

/// A trigger string spanning two tokens (" capital", " of"), greedy and
/// seeded: the tokens through the trigger are the unconstrained run's,
/// and the rest is a JSON object of the schema, ended by the grammar; the
/// same with speculation.
#[tokio::test]
async fn before_the_trigger_the_output_is_unconstrained_and_after_it_the_schema_holds() {
    let Some((_, s)) = model_server().await else {
        return;
    };
    const TRIGGER: &str = "capital of";
    for seed in [None, Some(7), Some(11)] {
        let plain = generate(&s, chat(seed, None)).await.unwrap();
        if !plain.text().contains(TRIGGER) {
            eprintln!("seed {seed:?}: no trigger in {:?}", plain.text());
            assert!(seed.is_some(), "the greedy answer names the capital");
            continue;
        }
        let k = tokens_through(&plain, TRIGGER);
        let out = generate(&s, chat(seed, lazy(schema(), &[TRIGGER], &[])))
            .await
            .unwrap();
        assert_eq!(out.tokens[..k], plain.tokens[..k], "seed {seed:?}");
        assert_eq!(
            out.reason(),
            v1::FinishReason::StopToken,
            "{:?}",
            out.text()
        );
        assert_flag_after(&out.text(), TRIGGER);
        // Speculation (prompt lookup) verifies drafts against the same
        // per-sequence state: the same tokens.
        let mut spec = chat(seed, lazy(schema(), &[TRIGGER], &[]));
        spec.speculation = Some(v1::Speculation {
            source: v1::DraftSource::PromptLookup as i32,
            max_draft_tokens: 4,
        });
        assert_eq!(
            generate(&s, spec).await.unwrap().tokens,
            out.tokens,
            "seed {seed:?}"
        );
    }
    s.stop().await;
}

/// A trigger string ending inside a token (" of" completes "capital o"):
/// the token's rest ("f") is held to the grammar, so the text after the
/// trigger matches the regex as a whole.
#[tokio::test]
async fn a_trigger_ending_inside_a_token_holds_the_rest_of_it_to_the_grammar() {
    let Some((_, s)) = model_server().await else {
        return;
    };
    let plain = generate(&s, chat(None, None)).await.unwrap();
    let regex = v1::constraint::Kind::Regex("f [A-Z][a-z]+ (is|was) [A-Z][a-z]+\\.".into());
    let out = generate(&s, chat(None, lazy(regex, &["capital o"], &[])))
        .await
        .unwrap();
    let k = tokens_through(&plain, "capital of");
    assert_eq!(out.tokens[..k], plain.tokens[..k]);
    let text = out.text();
    let rest = &text[text.find("capital o").unwrap() + "capital o".len()..];
    let re = regex_lite(rest);
    assert!(re, "{rest:?} after the trigger does not match the regex");
    s.stop().await;
}

/// `f [A-Z][a-z]+ (is|was) [A-Z][a-z]+\.` without a regex crate.
fn regex_lite(s: &str) -> bool {
    let Some(s) = s.strip_prefix("f ") else {
        return false;
    };
    let word = |w: &str| {
        let mut c = w.chars();
        c.next().is_some_and(|f| f.is_ascii_uppercase()) && c.all(|x| x.is_ascii_lowercase())
    };
    let Some(s) = s.strip_suffix('.') else {
        return false;
    };
    let parts: Vec<&str> = s.split(' ').collect();
    parts.len() == 3 && word(parts[0]) && matches!(parts[1], "is" | "was") && word(parts[2])
}

/// A trigger token: the grammar starts at the token after it.
#[tokio::test]
async fn a_trigger_token_starts_the_grammar_after_it() {
    let Some((_, s)) = model_server().await else {
        return;
    };
    let plain = generate(&s, chat(None, None)).await.unwrap();
    let k = 3;
    let trigger = plain.tokens[k - 1];
    assert!(!plain.tokens[..k - 1].contains(&trigger));
    let out = generate(&s, chat(None, lazy(schema(), &[], &[trigger])))
        .await
        .unwrap();
    assert_eq!(out.tokens[..k], plain.tokens[..k]);
    let prefix: String = plain.texts[..k].concat();
    assert_flag_after(&out.text(), &prefix);
    s.stop().await;
}

/// The reasoning budget forces its message and the close marker "."; with
/// "." as the trigger the grammar holds right after the forced close
/// (llama.cpp's forced close bypassed its lazy grammar; here the forced
/// token is accepted by every stage like a sampled one).
#[tokio::test]
async fn a_close_marker_forced_by_the_reasoning_budget_triggers_the_grammar() {
    let Some((host, s)) = model_server().await else {
        return;
    };
    let tok = host.model().tokenizer();
    let plain = generate(&s, chat(None, None)).await.unwrap();
    let mut req = chat(None, lazy(schema(), &["."], &[]));
    req.reasoning_budget = Some(2);
    req.reasoning_budget_message = " Enough".into();
    let out = generate(&s, req.clone()).await.unwrap();
    let mut want = plain.tokens[..3].to_vec();
    want.extend(tok.encode(" Enough", false, false).unwrap());
    want.extend(tok.encode(".", false, true).unwrap());
    assert_eq!(out.tokens[..want.len()], want[..], "{:?}", out.text());
    assert_eq!(
        out.reason(),
        v1::FinishReason::StopToken,
        "{:?}",
        out.text()
    );
    assert_flag_after(&out.text(), ".");
    // A resume just before the forced close replays the wait and fires.
    let cut = want.len() - 1;
    let mut r = req.clone();
    r.resume = Some(v1::GenerateResume {
        token_ids: out.tokens[..cut].to_vec(),
    });
    assert_eq!(generate(&s, r).await.unwrap().tokens, out.tokens[cut..]);
    // n = 2 choices: each waits and fires on its own.
    let mut two = req;
    two.n = 2;
    let outs = generate_choices(&s, two).await.unwrap();
    for o in outs {
        assert_flag_after(&o.text(), ".");
    }
    s.stop().await;
}

/// SampleStream over a named vocabulary: tokens before the trigger token
/// are the unconstrained stream's; after it the regex holds.
#[tokio::test]
async fn sample_stream_waits_for_the_trigger_then_holds_the_grammar() {
    let Some(model) = model_path() else {
        eprintln!("skipped: no model file for the vocabulary (scripts/fetch-model.sh)");
        return;
    };
    let vocab = samplerd_model::read_vocabulary(&model).expect("vocabulary");
    let n = vocab.len();
    let s = start_serving(config(), None).await;
    let params = |c: Option<v1::Constraint>| v1::SamplingParams {
        vocabulary: "smollm2".into(),
        seed: Some(5),
        constraint: c,
        ..Default::default()
    };
    let run = |p: v1::SamplingParams, steps: u64| {
        (0..steps)
            .map(|step| v1::SampleStreamRequest {
                logits_f32le: to_bytes(&logits(n, 300 + step)).into(),
                params: (step == 0).then(|| p.clone()),
                ..Default::default()
            })
            .collect::<Vec<_>>()
    };
    let free: Vec<u32> = s
        .stream_all(run(params(None), 8))
        .await
        .iter()
        .map(|r| r.token_id)
        .collect();
    let k = (1..free.len())
        .find(|&i| !free[..i].contains(&free[i]))
        .expect("a fresh token");
    let regex = v1::constraint::Kind::Regex("(cat|dog)s?".into());
    let lazy_params = params(lazy(regex, &[], &[free[k]]));
    let out: Vec<u32> = s
        .stream_all(run(lazy_params, 12))
        .await
        .iter()
        .map(|r| r.token_id)
        .collect();
    assert_eq!(out[..=k], free[..=k], "unconstrained through the trigger");
    let mut text = Vec::new();
    for &t in &out[k + 1..] {
        if vocab[t as usize].attrs & samplerd_model::attr::END_OF_GENERATION != 0 {
            break;
        }
        text.extend_from_slice(&vocab[t as usize].bytes);
    }
    let text = String::from_utf8(text).unwrap();
    assert!(
        ["cat", "cats", "dog", "dogs"].contains(&text.as_str()),
        "{text:?} after the trigger"
    );
    s.stop().await;
}

#[tokio::test]
async fn bad_triggers_are_refused_naming_the_field_and_value() {
    let Some((host, s)) = model_server().await else {
        return;
    };
    let n_vocab = host.model().n_vocab() as u32;
    let kind = schema;
    let long = "z".repeat(129);
    let cases: Vec<(Option<v1::Constraint>, &str, &str)> = vec![
        (
            lazy(kind(), &["ok", ""], &[]),
            "params.constraint.trigger_strings[1]",
            "is empty",
        ),
        (
            lazy(kind(), &[long.as_str()], &[]),
            "params.constraint.trigger_strings[0]",
            "limits.max_constraint_trigger_bytes",
        ),
        (
            lazy(kind(), &["a"; 17], &[]),
            "params.constraint.trigger_strings",
            "17 triggers",
        ),
        (
            lazy(kind(), &[], &[3, n_vocab]),
            "params.constraint.trigger_tokens[1]",
            "outside the vocabulary",
        ),
        (
            lazy(v1::constraint::Kind::JsonObject(false), &[], &[3]),
            "params.constraint.trigger_tokens",
            "without a constraint kind",
        ),
    ];
    for (c, field, needle) in cases {
        let err = generate(&s, chat(None, c)).await.expect_err(field);
        assert_status(&err, Code::InvalidArgument, &[field, needle]);
        use tonic_types::StatusExt as _;
        let details = err.get_error_details();
        let violations = &details.bad_request().expect("BadRequest").field_violations;
        assert_eq!(violations[0].field, field, "{err:?}");
    }
    // Sample with a vocabulary names them alike.
    let err = s
        .sample_err(v1::SampleRequest {
            logits_f32le: to_bytes(&logits(n_vocab as usize, 1)).into(),
            params: Some(v1::SamplingParams {
                vocabulary: "smollm2".into(),
                constraint: lazy(kind(), &[], &[n_vocab + 5]),
                ..Default::default()
            }),
            ..Default::default()
        })
        .await;
    assert_status(
        &err,
        Code::InvalidArgument,
        &[
            "params.constraint.trigger_tokens[0]",
            "outside the vocabulary",
        ],
    );
    s.stop().await;
}
