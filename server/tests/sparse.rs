//! Sparse rows through the real server: for Sample, SampleStream,
//! SampleBatch and SampleBatchStream, a row sent as its top entries plus
//! the log-sum-exp of the rest answers what the dense row answers — the
//! token, the post-chain probability and post-chain candidates bit for
//! bit, the raw log-probabilities within 1e-6 — over the default chain
//! and others; a row too short for its chain is FAILED_PRECONDITION
//! (SAMPLERD_SPARSE_INSUFFICIENT) naming the stage or field; a malformed
//! one is INVALID_ARGUMENT naming the field.

mod common;

use common::*;
use samplerd_api::v1;
use tonic::Code;

const VOCAB: usize = 512;

/// The top `n` of `dense` (ties by lower id), sent in descending order of
/// id, and the log-sum-exp of the rest in f64 (-inf when none).
fn sparse_of(dense: &[f32], n: usize) -> v1::SparseLogits {
    let mut order: Vec<u32> = (0..dense.len() as u32).collect();
    order.sort_by(|&a, &b| {
        dense[b as usize]
            .total_cmp(&dense[a as usize])
            .then(a.cmp(&b))
    });
    let mut ids = order[..n].to_vec();
    ids.reverse();
    let rest: Vec<f64> = order[n..]
        .iter()
        .map(|&i| dense[i as usize] as f64)
        .collect();
    let max = rest.iter().copied().fold(f64::NEG_INFINITY, f64::max);
    let rest_logsumexp = if max == f64::NEG_INFINITY {
        max
    } else {
        max + rest.iter().map(|x| (x - max).exp()).sum::<f64>().ln()
    };
    v1::SparseLogits {
        values: ids.iter().map(|&i| dense[i as usize]).collect(),
        ids,
        rest_logsumexp,
        vocab_size: dense.len() as u32,
    }
}

/// A dense answer and the sparse one for the same row: the same token,
/// probability and post-chain candidates bit for bit; raw ones the same
/// ids with log-probabilities and probabilities within 1e-6.
fn assert_same(dense: &v1::SampleResponse, sparse: &v1::SampleResponse, post: bool, what: &str) {
    let close = |a: f32, b: f32| (a - b).abs() <= 1e-6 * a.abs().max(1.0);
    assert_eq!(dense.token_id, sparse.token_id, "{what}: token");
    assert_eq!(
        dense.probability.to_bits(),
        sparse.probability.to_bits(),
        "{what}: probability {} vs {}",
        dense.probability,
        sparse.probability
    );
    assert!(
        close(dense.logprob, sparse.logprob),
        "{what}: logprob {} vs {}",
        dense.logprob,
        sparse.logprob
    );
    assert_eq!(
        (dense.seed, dense.step),
        (sparse.seed, sparse.step),
        "{what}"
    );
    assert_eq!(dense.probs.len(), sparse.probs.len(), "{what}: probs");
    for (d, s) in dense.probs.iter().zip(&sparse.probs) {
        assert_eq!(d.token_id, s.token_id, "{what}: probs ids");
        if post {
            assert_eq!(d.probability.to_bits(), s.probability.to_bits(), "{what}");
        } else {
            assert!(close(d.probability, s.probability), "{what}: {d:?} {s:?}");
        }
        assert!(close(d.logprob, s.logprob), "{what}: {d:?} {s:?}");
    }
}

fn typed(f: impl FnOnce(&mut v1::SamplingParams)) -> Option<v1::SamplingParams> {
    let mut p = v1::SamplingParams {
        seed: Some(7),
        ..Default::default()
    };
    f(&mut p);
    Some(p)
}

fn chain(stages: Vec<v1::StageSpec>) -> Option<v1::SamplingParams> {
    typed(|p| p.chain = stages)
}

/// The chains the server tests run sparse rows through (all accepted on a
/// row of 200 of 512 entries).
fn chains() -> Vec<(&'static str, Option<v1::SamplingParams>)> {
    vec![
        ("default", None),
        ("default seeded", typed(|_| {})),
        ("greedy", typed(|p| p.temperature = Some(0.0))),
        (
            "top_k only",
            chain(vec![
                number_stage("top_k", &[("k", 20.0)]),
                number_stage("dist", &[]),
            ]),
        ),
        (
            "min_p",
            typed(|p| {
                p.top_k = Some(0);
                p.top_p = Some(1.0);
                p.min_p = Some(0.2);
            }),
        ),
        (
            "top_p then top_k",
            typed(|p| {
                p.samplers = vec!["top_p".into(), "top_k".into(), "temperature".into()];
                p.top_p = Some(0.9);
                p.top_k = Some(30);
            }),
        ),
        (
            "penalties and negative logit bias",
            typed(|p| {
                p.repeat_penalty = Some(1.4);
                p.frequency_penalty = Some(0.3);
                p.presence_penalty = Some(0.2);
                p.logit_bias = [(3, -2.0), (9, f32::NEG_INFINITY), (400, -0.5)].into();
            }),
        ),
    ]
}

fn window() -> Vec<u32> {
    (0..60u32).map(|i| i * 37 % VOCAB as u32).collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sample_and_sample_stream_answer_as_the_dense_row() {
    let s = start().await;
    for (name, params) in chains() {
        for (case, (n_probs, post)) in [(0, false), (8, false), (8, true)].into_iter().enumerate() {
            let dense = logits(VOCAB, 10 + case as u64);
            let req = |sparse: bool| v1::SampleRequest {
                logits_f32le: if sparse { vec![] } else { to_bytes(&dense) }.into(),
                sparse: sparse.then(|| sparse_of(&dense, 200)),
                previous_tokens: window(),
                params: params.clone(),
                step: 3,
                n_probs,
                post_sampling_probs: post,
                ..Default::default()
            };
            let want = s.sample_ok(req(false)).await;
            let got = s.sample_ok(req(true)).await;
            assert_same(
                &want,
                &got,
                post,
                &format!("Sample, {name}, n_probs {n_probs}"),
            );
        }
        // A stream of five steps; its sparse messages change the row each
        // step, as the dense ones do, and the server keeps the window.
        let rows: Vec<Vec<f32>> = (0..5).map(|i| logits(VOCAB, 50 + i)).collect();
        let msgs = |sparse: bool| -> Vec<v1::SampleStreamRequest> {
            rows.iter()
                .enumerate()
                .map(|(i, row)| v1::SampleStreamRequest {
                    logits: if sparse { vec![] } else { row.clone() },
                    sparse: sparse.then(|| sparse_of(row, 300)),
                    previous_tokens: if i == 0 { window() } else { vec![] },
                    params: params.clone(),
                    first_step: 11,
                    n_probs: 4,
                    post_sampling_probs: true,
                    ..Default::default()
                })
                .collect()
        };
        let want = s.stream_all(msgs(false)).await;
        let got = s.stream_all(msgs(true)).await;
        assert_eq!(want.len(), 5);
        for (i, (w, g)) in want.iter().zip(&got).enumerate() {
            assert_same(w, g, true, &format!("SampleStream, {name}, step {i}"));
        }
    }
    s.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn batches_answer_as_the_dense_rows_and_mix_both_kinds() {
    let s = start().await;
    let mut client = s.client.clone();
    let all = chains();
    let rows: Vec<Vec<f32>> = (0..all.len() as u64)
        .map(|i| logits(VOCAB, 200 + i))
        .collect();
    let batch = |sparse: &dyn Fn(usize) -> bool| v1::SampleBatchRequest {
        rows: all
            .iter()
            .enumerate()
            .map(|(i, (_, params))| v1::BatchRow {
                logits: if sparse(i) {
                    vec![]
                } else {
                    to_bytes(&rows[i])
                }
                .into(),
                sparse: sparse(i).then(|| sparse_of(&rows[i], 300)),
                params: params.clone(),
                step: i as u64,
                previous_tokens: window(),
                ..Default::default()
            })
            .collect(),
        n_probs: 6,
        post_sampling_probs: true,
        ..Default::default()
    };
    let want = client
        .sample_batch(batch(&|_| false))
        .await
        .unwrap()
        .into_inner();
    let every = |_: usize| true;
    let alternate = |i: usize| i.is_multiple_of(2);
    for mixed in [&every as &dyn Fn(usize) -> bool, &alternate] {
        let got = client
            .sample_batch(batch(mixed))
            .await
            .unwrap()
            .into_inner();
        for (i, (w, g)) in want.rows.iter().zip(&got.rows).enumerate() {
            assert_same(w, g, true, &format!("SampleBatch row {i} ({})", all[i].0));
        }
    }

    // SampleBatchStream: every chain one sequence, three steps, the sparse
    // stream switching a sequence between encodings from step to step.
    let steps = |sparse: bool| -> Vec<v1::SampleBatchStreamRequest> {
        (0..3u64)
            .map(|t| v1::SampleBatchStreamRequest {
                rows: all
                    .iter()
                    .enumerate()
                    .map(|(i, (_, params))| {
                        let row = logits(VOCAB, 300 + 10 * i as u64 + t);
                        let as_sparse = sparse && (t + i as u64) % 3 != 2;
                        v1::BatchStreamRow {
                            sequence_id: i as u64,
                            logits: if as_sparse { vec![] } else { to_bytes(&row) }.into(),
                            sparse: as_sparse.then(|| sparse_of(&row, 300)),
                            params: if t == 0 { params.clone() } else { None },
                            previous_tokens: if t == 0 { window() } else { vec![] },
                            ..Default::default()
                        }
                    })
                    .collect(),
                n_probs: 3,
                post_sampling_probs: false,
                ..Default::default()
            })
            .collect()
    };
    let run = |msgs: Vec<v1::SampleBatchStreamRequest>| {
        let mut client = s.client.clone();
        async move {
            let mut st = client
                .sample_batch_stream(tokio_stream::iter(msgs))
                .await
                .unwrap()
                .into_inner();
            let mut out = Vec::new();
            while let Some(r) = st.message().await.unwrap() {
                out.push(r);
            }
            out
        }
    };
    let want = run(steps(false)).await;
    let got = run(steps(true)).await;
    assert_eq!(want.len(), 3);
    for (t, (w, g)) in want.iter().zip(&got).enumerate() {
        assert_eq!(w.sequence_ids, g.sequence_ids);
        for (i, (a, b)) in w.rows.iter().zip(&g.rows).enumerate() {
            assert_same(a, b, false, &format!("SampleBatchStream step {t} row {i}"));
        }
    }
    s.stop().await;
}

/// A constraint (a lowers-only stage from its own library) before the
/// default order: the same answer as the dense row while the grammar
/// leaves enough sent tokens above the rest; refused when the mask removes
/// every sent token.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_constraint_with_a_vocabulary_answers_as_dense_or_refuses() {
    let dir = tempfile::tempdir().unwrap();
    let vocab_path = plain_tokenizer_json(dir.path(), VOCAB);
    let s = start_tuned(|c| {
        c.plugins.files.push(constraint_plugin());
        c.vocabularies.insert("plain".into(), vocab_path.clone());
    })
    .await;
    let params = |regex: &str| {
        typed(|p| {
            p.vocabulary = "plain".into();
            p.top_k = Some(5);
            p.constraint = Some(v1::Constraint {
                kind: Some(v1::constraint::Kind::Regex(regex.into())),
                ..Default::default()
            });
        })
    };
    let dense = logits(VOCAB, 77);
    let req = |sparse: Option<v1::SparseLogits>, regex: &str| v1::SampleRequest {
        logits: if sparse.is_some() {
            vec![]
        } else {
            dense.clone()
        },
        sparse,
        params: params(regex),
        n_probs: 5,
        post_sampling_probs: true,
        ..Default::default()
    };
    // Tokens t1, t10..t19, t100..t199: about a fifth of the row.
    let want = s.sample_ok(req(None, "t1[0-9]*")).await;
    let got = s
        .sample_ok(req(Some(sparse_of(&dense, 256)), "t1[0-9]*"))
        .await;
    assert_same(&want, &got, true, "constraint");

    // Only t5, which is not sent: the mask leaves no sent entry.
    let mut low5 = dense.clone();
    low5[5] = -10.0;
    let row = sparse_of(&low5, 20);
    assert!(!row.ids.contains(&5));
    let e = s.sample_err(req(Some(row), "t5")).await;
    let d = assert_reason(&e, Reason::SparseInsufficient);
    assert_eq!(
        d.error_info()
            .unwrap()
            .metadata
            .get("stage")
            .map(String::as_str),
        Some("top_k"),
        "{e:?}"
    );
    assert_status(
        &e,
        Code::FailedPrecondition,
        &[
            "stage `top_k` (k = 5): only 0 of the 20 sent entries lie above",
            "send more entries",
        ],
    );
    s.stop().await;
}

/// Each kind of refusal through the server: FAILED_PRECONDITION with the
/// reason, the stage (or field) and the entries sent in the details.
#[tokio::test]
async fn refusals_name_the_stage_or_field() {
    let s = start().await;
    let flat = logits(VOCAB, 5);
    let row = sparse_of(&flat, 64);
    let unsent = (0..VOCAB as u32).find(|i| !row.ids.contains(i)).unwrap();
    let bias_text =
        format!("stage `logit_bias`: a bias of +2 on token {unsent}, which was not sent");
    let cases: Vec<(Option<v1::SamplingParams>, u32, &str, &str)> = vec![
        (
            chain(vec![
                number_stage("top_p", &[("p", 0.95)]),
                number_stage("dist", &[]),
            ]),
            0,
            "top_p",
            "stage `top_p` (p = 0.95): the nucleus does not close inside the 63 sent entries",
        ),
        (
            chain(vec![number_stage("dist", &[])]),
            0,
            "dist",
            "stage `dist` draws from every live token, and the chain never cuts the row down \
             to the sent entries",
        ),
        (
            typed(|p| p.top_k = Some(100)),
            0,
            "top_k",
            "stage `top_k` (k = 100): only 63 of the 64 sent entries lie above",
        ),
        (
            typed(|p| p.logit_bias = [(unsent, 2.0)].into()),
            0,
            "logit_bias",
            &bias_text,
        ),
        (
            typed(|p| {
                p.top_k = Some(5);
                p.repeat_penalty = Some(0.5);
            }),
            0,
            "penalties",
            "a repeat_penalty below 1 raises",
        ),
        (
            typed(|p| {
                p.top_k = Some(0);
                p.top_p = Some(1.0);
                p.typical_p = Some(0.5);
                p.samplers = vec!["typical_p".into(), "top_k".into()];
            }),
            0,
            "typical_p",
            "stage `typical_p` (p = 0.5) needs every logit of the row",
        ),
        (
            None,
            65,
            "n_probs",
            "n_probs = 65: more raw candidates than the 64 entries sent",
        ),
    ];
    for (params, n_probs, who, text) in cases {
        let e = s
            .sample_err(v1::SampleRequest {
                sparse: Some(row.clone()),
                previous_tokens: vec![1, 2, 3],
                params,
                n_probs,
                ..Default::default()
            })
            .await;
        let d = assert_reason(&e, Reason::SparseInsufficient);
        assert_status(&e, Code::FailedPrecondition, &[text]);
        let meta = &d.error_info().unwrap().metadata;
        assert_eq!(
            meta.get("entries_sent").map(String::as_str),
            Some("64"),
            "{e:?}"
        );
        if who == "n_probs" {
            assert_eq!(
                d.bad_request().unwrap().field_violations[0].field,
                "n_probs"
            );
            assert_eq!(meta.get("entries_needed").map(String::as_str), Some("66"));
        } else {
            assert_eq!(meta.get("stage").map(String::as_str), Some(who), "{e:?}");
        }
    }
    // The same refusal in a batch names its row.
    let mut client = s.client.clone();
    let e = client
        .sample_batch(v1::SampleBatchRequest {
            rows: vec![
                v1::BatchRow {
                    sparse: Some(sparse_of(&flat, 300)),
                    ..Default::default()
                },
                v1::BatchRow {
                    sparse: Some(row.clone()),
                    ..Default::default()
                },
            ],
            params: chain(vec![
                number_stage("top_p", &[("p", 0.95)]),
                number_stage("dist", &[]),
            ]),
            ..Default::default()
        })
        .await
        .unwrap_err();
    assert_reason(&e, Reason::SparseInsufficient);
    assert_status(
        &e,
        Code::FailedPrecondition,
        &["rows[1]: stage `top_p` (p = 0.95)"],
    );
    s.stop().await;
}

/// Malformed sparse rows are INVALID_ARGUMENT naming the field and the
/// value; so is a second encoding beside `sparse`, and a vocabulary size
/// that does not fit.
#[tokio::test]
async fn malformed_sparse_rows_name_the_field() {
    let dir = tempfile::tempdir().unwrap();
    let vocab_path = plain_tokenizer_json(dir.path(), VOCAB);
    let s = start_tuned(|c| {
        c.limits.max_vocab = 1000;
        c.vocabularies.insert("plain".into(), vocab_path.clone());
    })
    .await;
    let sp = |ids: &[u32], values: &[f32], rest: f64, vocab: u32| v1::SparseLogits {
        ids: ids.to_vec(),
        values: values.to_vec(),
        rest_logsumexp: rest,
        vocab_size: vocab,
    };
    let req = |sparse| v1::SampleRequest {
        sparse: Some(sparse),
        ..Default::default()
    };
    let cases: Vec<(v1::SampleRequest, Reason, &str, &str)> = vec![
        (
            req(sp(&[1, 2], &[1.0], -1.0, 10)),
            Reason::InvalidField,
            "sparse.ids",
            "has 2 ids but 1 values",
        ),
        (
            req(sp(&[1, 7, 1], &[1.0; 3], -1.0, 10)),
            Reason::InvalidField,
            "sparse.ids[2]",
            "token id 1 is sent twice (also ids[0])",
        ),
        (
            req(sp(&[12], &[1.0], -1.0, 10)),
            Reason::InvalidField,
            "sparse.ids[0]",
            "token id 12 is outside the vocabulary of 10 tokens",
        ),
        (
            req(sp(&[1, 2], &[1.0, f32::NAN], -1.0, 10)),
            Reason::InvalidLogits,
            "sparse.values[1]",
            "is NaN",
        ),
        (
            req(sp(&[1], &[f32::INFINITY], -1.0, 10)),
            Reason::InvalidLogits,
            "sparse.values[0]",
            "is inf",
        ),
        (
            req(sp(&[1], &[1.0], f64::NAN, 10)),
            Reason::InvalidLogits,
            "sparse.rest_logsumexp",
            "is NaN",
        ),
        (
            req(sp(&[1], &[1.0], f64::INFINITY, 10)),
            Reason::InvalidLogits,
            "sparse.rest_logsumexp",
            "is inf",
        ),
        (
            req(sp(&[1], &[1.0], 5.0, 10)),
            Reason::InvalidLogits,
            "sparse.rest_logsumexp",
            "is 5, but 9 unsent logits each at most min(values) = 1",
        ),
        (
            req(sp(&[1], &[1.0], -1.0, 5000)),
            Reason::LimitExceeded,
            "sparse.vocab_size",
            "5000 exceeds the limit of 1000 (limits.max_vocab)",
        ),
        (
            v1::SampleRequest {
                logits: vec![1.0; 10],
                ..req(sp(&[1], &[1.0], -1.0, 10))
            },
            Reason::InvalidField,
            "sparse",
            "set exactly one of `logits`, `logits_f32le` and `sparse`, got `sparse` and `logits` (10 floats)",
        ),
        (
            v1::SampleRequest {
                params: typed(|p| p.vocabulary = "plain".into()),
                ..req(sp(&[1], &[1.0], -1.0, 10))
            },
            Reason::InvalidField,
            "sparse.vocab_size",
            "10 logits, but vocabulary \"plain\" has 512 tokens",
        ),
        (
            v1::SampleRequest::default(),
            Reason::InvalidField,
            "logits/logits_f32le",
            "set exactly one of `logits`, `logits_f32le`, `sparse` and `shared`, got none",
        ),
    ];
    for (r, reason, field, text) in cases {
        let e = s.sample_err(r).await;
        let d = assert_reason(&e, reason);
        assert_eq!(
            d.bad_request().unwrap().field_violations[0].field,
            field,
            "{e:?}"
        );
        assert_status(&e, reason.code(), &[&format!("{field}: {text}")]);
    }
    // A batch row with both encodings names the row.
    let mut client = s.client.clone();
    let e = client
        .sample_batch(v1::SampleBatchRequest {
            rows: vec![v1::BatchRow {
                logits: to_bytes(&[1.0; 10]).into(),
                sparse: Some(sp(&[1], &[1.0], -1.0, 10)),
                ..Default::default()
            }],
            ..Default::default()
        })
        .await
        .unwrap_err();
    assert_status(
        &e,
        Code::InvalidArgument,
        &["rows[0].sparse: set exactly one of `logits` and `sparse`"],
    );
    s.stop().await;
}
