//! Structured output through the service: `params.constraint` in Generate
//! (the model's vocabulary), SampleStream and Sample (a vocabulary named
//! from `[vocabularies]`, Sample replaying `constraint_tokens`), and the
//! refusals. The `constraint` stage comes from its own plugin library,
//! loaded like any third-party one. Generate cases need the model
//! (`SAMPLERD_MODEL`); the rest use the model file as a vocabulary when it
//! is there.

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

/// The core and constraint libraries, and the model's vocabulary as
/// `smollm2` when the model is there.
fn config() -> samplerd::app::config::Config {
    let mut c = test_config();
    c.plugins.files = vec![core_plugin(), constraint_plugin()];
    if let Some(m) = model_path() {
        c.vocabularies.insert("smollm2".into(), m);
    }
    c
}

/// A server without a model host (Sample and SampleStream only).
async fn server() -> TestServer {
    start_serving(config(), None).await
}

/// A server with the shared model host for Generate, or None (saying the
/// test is skipped) when there is no model.
async fn model_server() -> Option<TestServer> {
    let Some(host) = shared_host() else {
        eprintln!("skipped: no model (scripts/fetch-model.sh, SAMPLERD_MODEL)");
        return None;
    };
    Some(start_serving(config(), Some(host as Arc<dyn Generator>)).await)
}

fn constrained(kind: v1::constraint::Kind, seed: u64) -> v1::SamplingParams {
    v1::SamplingParams {
        seed: Some(seed),
        constraint: Some(v1::Constraint {
            kind: Some(kind),
            ..Default::default()
        }),
        ..Default::default()
    }
}

fn chat(q: &str, params: v1::SamplingParams) -> v1::GenerateRequest {
    v1::GenerateRequest {
        messages: vec![v1::ChatMessage {
            role: "user".into(),
            content: q.into(),
        }],
        max_tokens: Some(256),
        params: Some(params),
        ..Default::default()
    }
}

const PERSON: &str = r#"{"type":"object","properties":{"name":{"type":"string","maxLength":20},"age":{"type":"integer","minimum":0,"maximum":120}},"required":["name","age"],"additionalProperties":false}"#;

/// Generate under a JSON Schema ends with the stop token, and the text is
/// a JSON object of that schema; the same seed gives the same bytes.
#[tokio::test]
async fn generate_holds_the_output_to_a_json_schema() {
    let Some(s) = model_server().await else {
        return;
    };
    let req = || {
        chat(
            "Describe a person as JSON.",
            constrained(v1::constraint::Kind::JsonSchema(PERSON.into()), 7),
        )
    };
    let out = generate(&s, req()).await.expect("generate");
    assert_eq!(out.reason(), v1::FinishReason::StopToken, "{}", out.text());
    let v: serde_json::Value = serde_json::from_str(&out.text())
        .unwrap_or_else(|e| panic!("not JSON ({e}): {:?}", out.text()));
    let obj = v.as_object().expect("an object");
    assert_eq!(obj.len(), 2, "only the schema's properties: {v}");
    assert!(
        obj["name"]
            .as_str()
            .is_some_and(|n| n.chars().count() <= 20)
    );
    let age = obj["age"].as_i64().expect("integer age");
    assert!((0..=120).contains(&age), "age {age}");
    let again = generate(&s, req()).await.expect("generate");
    assert_eq!(again.tokens, out.tokens, "same request and seed");
}

/// The JSON text outside its string literals, each literal as one `"`.
fn outside_strings(json: &str) -> String {
    let (mut out, mut in_str, mut escaped) = (String::new(), false, false);
    for c in json.chars() {
        match (in_str, escaped, c) {
            (true, true, _) => escaped = false,
            (true, false, '\\') => escaped = true,
            (true, false, '"') => in_str = false,
            (true, false, _) => {}
            (false, _, '"') => {
                in_str = true;
                out.push('"');
            }
            (false, _, c) => out.push(c),
        }
    }
    out
}

/// `json_whitespace`: compact output has no whitespace between JSON
/// tokens; bounded output never has a space run, three newlines in a row
/// or more than 20 spaces after a newline, on the schema a small model
/// likes to pad.
#[tokio::test]
async fn generate_bounds_the_whitespace_between_json_tokens() {
    let Some(s) = model_server().await else {
        return;
    };
    for seed in [1, 2, 3] {
        for ws in [v1::JsonWhitespace::Compact, v1::JsonWhitespace::Unspecified] {
            let mut params = constrained(v1::constraint::Kind::JsonSchema(PERSON.into()), seed);
            params.temperature = Some(1.5);
            params.constraint.as_mut().unwrap().json_whitespace = ws as i32;
            let req = v1::GenerateRequest {
                max_tokens: Some(96),
                ..chat("Describe a person as pretty-printed JSON.", params)
            };
            let out = generate(&s, req).await.expect("generate");
            let text = out.text();
            let between = outside_strings(&text);
            // Every run of whitespace between two JSON tokens.
            let runs: Vec<&str> = between
                .split(|c: char| !c.is_whitespace())
                .filter(|r| !r.is_empty())
                .collect();
            for run in runs {
                let newlines = run.chars().take_while(|&c| c == '\n').count();
                let indent = &run[newlines..];
                let bounded = run == " "
                    || ((1..=2).contains(&newlines)
                        && indent.len() <= 20
                        && indent.chars().all(|c| c == ' ' || c == '\t'));
                assert!(
                    ws != v1::JsonWhitespace::Compact && bounded,
                    "{ws:?} seed {seed} has {run:?}: {text:?}"
                );
            }
        }
    }
}

/// Regex, choice, GBNF and Lark: each output matches its grammar in full,
/// with stop strings and n_probs alongside.
#[tokio::test]
async fn generate_holds_the_output_to_regexes_choices_and_grammars() {
    use v1::constraint::Kind;
    let Some(s) = model_server().await else {
        return;
    };
    type Matches = Box<dyn Fn(&str) -> bool>;
    let cases: Vec<(Kind, Matches)> = vec![
        (
            Kind::Regex("[0-9]{3}-[0-9]{4}".into()),
            Box::new(|t: &str| {
                t.len() == 8
                    && t.as_bytes()[3] == b'-'
                    && t.replace('-', "").bytes().all(|b| b.is_ascii_digit())
            }),
        ),
        (
            Kind::Choice(v1::StringList {
                values: vec!["red".into(), "green".into(), "blue".into()],
            }),
            Box::new(|t: &str| ["red", "green", "blue"].contains(&t)),
        ),
        (
            Kind::Gbnf(r#"root ::= "yes" | "no""#.into()),
            Box::new(|t: &str| t == "yes" || t == "no"),
        ),
        (
            // Bounded, so the grammar (not the model's taste for "B") ends
            // the output: an unbounded `"B"+` left stopping to the model's
            // logits, which differ between CPU kernel builds.
            Kind::Lark("start: \"A\" \"B\" \"B\"? \"B\"?".into()),
            Box::new(|t: &str| {
                t.starts_with('A')
                    && (2..=4).contains(&t.len())
                    && t[1..].bytes().all(|b| b == b'B')
            }),
        ),
    ];
    for (seed, (kind, ok)) in cases.into_iter().enumerate() {
        let mut req = chat("Answer.", constrained(kind.clone(), seed as u64));
        req.n_probs = 3;
        req.stop = vec!["\n\n".into()];
        let out = generate(&s, req).await.expect("generate");
        let text = out.text();
        assert!(ok(&text), "{kind:?}: output {text:?} does not match");
        assert_eq!(
            out.reason(),
            v1::FinishReason::StopToken,
            "{kind:?}: {text:?}"
        );
    }
}

/// SampleStream keeps the grammar's state between steps; Sample rebuilds
/// it from `constraint_tokens` and gives the same token at each step.
#[tokio::test]
async fn sample_and_sample_stream_follow_the_grammar_over_a_named_vocabulary() {
    let Some(model) = model_path() else {
        eprintln!("skipped: no model file for the vocabulary (scripts/fetch-model.sh)");
        return;
    };
    let vocab = samplerd_model::read_vocabulary(&model).expect("vocabulary");
    let n = vocab.len();
    let s = server().await;
    let params = v1::SamplingParams {
        vocabulary: "smollm2".into(),
        ..constrained(v1::constraint::Kind::Regex("(cat|dog)s?".into()), 3)
    };
    let mut chosen = Vec::new();
    let mut text = Vec::new();
    for step in 0..6u64 {
        let resp = s
            .sample_ok(v1::SampleRequest {
                logits_f32le: to_bytes(&logits(n, 100 + step)).into(),
                params: Some(params.clone()),
                step,
                constraint_tokens: chosen.clone(),
                ..Default::default()
            })
            .await;
        let t = resp.token_id;
        if vocab[t as usize].attrs & samplerd_model::attr::END_OF_GENERATION != 0 {
            break;
        }
        text.extend_from_slice(&vocab[t as usize].bytes);
        chosen.push(t);
    }
    let text = String::from_utf8(text).expect("utf-8");
    assert!(
        ["cat", "cats", "dog", "dogs"].contains(&text.as_str()),
        "Sample's output {text:?} does not match (cat|dog)s?"
    );

    // The same steps through one SampleStream: the same tokens.
    let msgs: Vec<v1::SampleStreamRequest> = (0..chosen.len() as u64)
        .map(|step| v1::SampleStreamRequest {
            logits_f32le: to_bytes(&logits(n, 100 + step)).into(),
            params: (step == 0).then(|| params.clone()),
            ..Default::default()
        })
        .collect();
    let streamed: Vec<u32> = s
        .stream_all(msgs)
        .await
        .iter()
        .map(|r| r.token_id)
        .collect();
    assert_eq!(streamed, chosen, "SampleStream and Sample agree");

    // A replayed token the grammar does not allow names the field.
    let bad = vocab
        .iter()
        .position(|t| t.bytes == b"x")
        .expect("a token for x") as u32;
    s.assert_sample_refused(
        v1::SampleRequest {
            logits_f32le: to_bytes(&logits(n, 1)).into(),
            params: Some(params.clone()),
            constraint_tokens: vec![bad],
            ..Default::default()
        },
        Code::InvalidArgument,
        &["constraint_tokens", "not allowed"],
    )
    .await;
}

/// A constrained SampleStream cut after k steps and resumed as a new
/// stream — its window, next step and seed, and `constraint_tokens` = the
/// output so far — answers the remaining steps exactly as the
/// uninterrupted stream; without the constraint's output the grammar
/// starts over and the answers differ. Later messages may not carry it,
/// nor may a batch stream's continuing rows.
#[tokio::test]
async fn a_constrained_stream_resumes_from_its_constraint_tokens() {
    let Some(model) = model_path() else {
        eprintln!("skipped: no model file for the vocabulary (scripts/fetch-model.sh)");
        return;
    };
    let n = samplerd_model::read_vocabulary(&model)
        .expect("vocabulary")
        .len();
    let s = server().await;
    // JSON, whose grammar state after a few tokens differs from its start.
    let params = v1::SamplingParams {
        vocabulary: "smollm2".into(),
        repeat_penalty: Some(1.3),
        ..constrained(
            v1::constraint::Kind::JsonSchema(
                r#"{"type":"object","properties":{"a":{"type":"integer"},"b":{"type":"string"}},"required":["a","b"]}"#
                    .into(),
            ),
            5,
        )
    };
    let step_msg = |t: u64| v1::SampleStreamRequest {
        logits_f32le: to_bytes(&logits(n, 300 + t)).into(),
        ..Default::default()
    };
    let steps = 8u64;
    let whole: Vec<v1::SampleResponse> = s
        .stream_all(
            (0..steps)
                .map(|t| v1::SampleStreamRequest {
                    params: (t == 0).then(|| params.clone()),
                    previous_tokens: if t == 0 { vec![1, 2] } else { vec![] },
                    ..step_msg(t)
                })
                .collect(),
        )
        .await;
    let tokens: Vec<u32> = whole.iter().map(|r| r.token_id).collect();
    let resume = |k: usize, constraint_tokens: Vec<u32>| {
        (k as u64..steps)
            .map(|t| {
                let first = t == k as u64;
                v1::SampleStreamRequest {
                    params: first.then(|| params.clone()),
                    previous_tokens: if first {
                        [vec![1, 2], tokens[..k].to_vec()].concat()
                    } else {
                        vec![]
                    },
                    first_step: if first { t } else { 0 },
                    constraint_tokens: if first {
                        constraint_tokens.clone()
                    } else {
                        vec![]
                    },
                    ..step_msg(t)
                }
            })
            .collect::<Vec<_>>()
    };
    for k in [1, 3, 5] {
        let resumed = s.stream_all(resume(k, tokens[..k].to_vec())).await;
        assert_eq!(resumed, whole[k..], "resumed after {k} steps");
    }
    // Without the constraint's output, the grammar starts over.
    let forgot = s.stream_all(resume(3, vec![])).await;
    assert_ne!(
        forgot,
        whole[3..],
        "a resume that forgets the constraint's output"
    );

    // A SampleBatchStream sequence resumes the same way: its joining row
    // carries the window, the next step and the constraint's output.
    let k = 4usize;
    let batch: Vec<v1::SampleBatchStreamRequest> = (k as u64..steps)
        .map(|t| {
            let first = t == k as u64;
            v1::SampleBatchStreamRequest {
                params: first.then(|| params.clone()),
                rows: vec![v1::BatchStreamRow {
                    sequence_id: 9,
                    logits: to_bytes(&logits(n, 300 + t)).into(),
                    previous_tokens: if first {
                        [vec![1, 2], tokens[..k].to_vec()].concat()
                    } else {
                        vec![]
                    },
                    first_step: if first { t } else { 0 },
                    constraint_tokens: if first { tokens[..k].to_vec() } else { vec![] },
                    ..Default::default()
                }],
                ..Default::default()
            }
        })
        .collect();
    let mut rows = s
        .client
        .clone()
        .sample_batch_stream(tokio_stream::iter(batch))
        .await
        .expect("the batch stream opens")
        .into_inner();
    let mut resumed = Vec::new();
    while let Some(mut r) = rows.message().await.expect("a batch stream step") {
        assert_eq!(r.sequence_ids, [9]);
        resumed.append(&mut r.rows);
    }
    assert_eq!(
        resumed,
        whole[k..],
        "a batch stream sequence resumed after {k} steps"
    );

    // Only a stream's first message carries it.
    let mut stream = s
        .client
        .clone()
        .sample_stream(tokio_stream::iter(vec![
            v1::SampleStreamRequest {
                params: Some(params.clone()),
                ..step_msg(0)
            },
            v1::SampleStreamRequest {
                constraint_tokens: vec![tokens[0]],
                ..step_msg(1)
            },
        ]))
        .await
        .expect("the stream opens")
        .into_inner();
    stream
        .message()
        .await
        .expect("the first step")
        .expect("a response");
    let err = stream
        .message()
        .await
        .expect_err("constraint_tokens on step 1");
    assert_eq!(err.code(), Code::InvalidArgument, "{err:?}");
    assert!(err.message().starts_with("constraint_tokens:"), "{err:?}");
}

/// Bad constraints are INVALID_ARGUMENT naming the field, the value's
/// problem and, for limits, the configuration key.
#[tokio::test]
async fn bad_constraints_are_refused_naming_the_field() {
    use v1::constraint::Kind;
    let have_vocab = model_path().is_some();
    let s = server().await;
    let n = if have_vocab {
        samplerd_model::read_vocabulary(&model_path().unwrap())
            .unwrap()
            .len()
    } else {
        16
    };
    let call = |params: v1::SamplingParams, tokens: Vec<u32>| {
        s.sample_err(v1::SampleRequest {
            logits: logits(n, 5),
            params: Some(params),
            constraint_tokens: tokens,
            ..Default::default()
        })
    };
    let named = |kind: Kind| v1::SamplingParams {
        vocabulary: "smollm2".into(),
        ..constrained(kind, 1)
    };
    // No vocabulary at all.
    let e = call(constrained(Kind::Regex("a+".into()), 1), vec![]).await;
    assert_status(&e, Code::InvalidArgument, &["constraint", "vocabulary"]);
    // An unknown one lists what is loaded.
    let e = call(
        v1::SamplingParams {
            vocabulary: "nope".into(),
            ..constrained(Kind::Regex("a+".into()), 1)
        },
        vec![],
    )
    .await;
    assert_status(
        &e,
        Code::InvalidArgument,
        &["params.vocabulary", "\"nope\""],
    );
    // constraint_tokens without a constraint.
    let e = call(v1::SamplingParams::default(), vec![1]).await;
    assert_status(
        &e,
        Code::InvalidArgument,
        &["constraint_tokens", "without a constraint"],
    );
    // json_whitespace: only a listed value, only on a JSON kind.
    let with_whitespace = |kind: Kind, value: i32| v1::SamplingParams {
        constraint: Some(v1::Constraint {
            kind: Some(kind),
            json_whitespace: value,
            ..Default::default()
        }),
        ..constrained(Kind::JsonObject(true), 1)
    };
    let e = call(with_whitespace(Kind::JsonObject(true), 9), vec![]).await;
    assert_status(
        &e,
        Code::InvalidArgument,
        &["params.constraint.json_whitespace", "is 9"],
    );
    let compact = v1::JsonWhitespace::Compact as i32;
    let e = call(with_whitespace(Kind::Regex("a".into()), compact), vec![]).await;
    assert_status(
        &e,
        Code::InvalidArgument,
        &[
            "params.constraint.json_whitespace",
            "json_schema or json_object",
        ],
    );
    // The rest names a loaded vocabulary (the model file as `smollm2`).
    if !have_vocab {
        return;
    }
    // Over limits.max_constraint_bytes, before any compiling.
    let e = call(named(Kind::JsonSchema(" ".repeat(2 << 20))), vec![]).await;
    assert_status(
        &e,
        Code::InvalidArgument,
        &[
            "params.constraint.json_schema",
            "limits.max_constraint_bytes",
        ],
    );
    // With an explicit chain.
    let e = call(
        v1::SamplingParams {
            chain: vec![number_stage("top_k", &[("k", 5.0)])],
            ..named(Kind::Regex("a".into()))
        },
        vec![],
    )
    .await;
    assert_status(
        &e,
        Code::InvalidArgument,
        &["params.constraint", "params.chain"],
    );
    // The grammar's own errors, each under its field.
    for (kind, field) in [
        (
            Kind::JsonSchema("{\"type\": 7}".into()),
            "params.constraint.json_schema",
        ),
        (
            Kind::JsonSchema("not json".into()),
            "params.constraint.json_schema",
        ),
        (Kind::Regex("(unclosed".into()), "params.constraint.regex"),
        (Kind::Gbnf("root ::= (".into()), "params.constraint.gbnf"),
        (Kind::Lark("start: ???".into()), "params.constraint.lark"),
        (
            Kind::Choice(v1::StringList { values: vec![] }),
            "params.constraint.choice",
        ),
        (
            Kind::JsonSchema(r#"{"type":"array","uniqueItems":true}"#.into()),
            "params.constraint.json_schema",
        ),
    ] {
        let e = call(named(kind.clone()), vec![]).await;
        assert_status(&e, Code::InvalidArgument, &[field]);
    }
}
