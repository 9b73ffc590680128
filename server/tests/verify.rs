//! Speculative verification through a real server: a `Verify` in a
//! SampleStream message and in a SampleBatchStream row gives, under EXACT
//! and COUPLED, the responses of sampling the same rows one message at a
//! time, and leaves the sequence where those steps leave it; REJECTION
//! answers in shape; and every bad Verify is INVALID_ARGUMENT naming the
//! field and the value.

mod common;

use std::time::Duration;

use common::*;
use samplerd_api::v1;
use tonic::Code;

const WAIT: Duration = Duration::from_secs(20);
const VOCAB: usize = 2000;

fn row(t: u64) -> Vec<f32> {
    logits(VOCAB, 700 + t)
}

fn verify_row(t: u64) -> v1::VerifyRow {
    v1::VerifyRow {
        logits: to_bytes(&row(t)).into(),
        ..Default::default()
    }
}

/// Penalties, DRY (no breakers: no vocabulary on this server), top_k and
/// a temperature over the default `dist`.
fn params() -> v1::SamplingParams {
    v1::SamplingParams {
        seed: Some(11),
        temperature: Some(1.3),
        top_k: Some(50),
        repeat_penalty: Some(1.4),
        frequency_penalty: Some(0.2),
        dry_multiplier: Some(0.8),
        dry_sequence_breakers: vec![String::new()],
        ..Default::default()
    }
}

fn coupled_params() -> v1::SamplingParams {
    v1::SamplingParams {
        seed: Some(5),
        chain: vec![
            number_stage("penalties", &[("repeat_penalty", 1.3)]),
            number_stage("top_k", &[("k", 40.0)]),
            number_stage("temperature", &[("t", 1.5)]),
            number_stage("coupled", &[]),
        ],
        ..Default::default()
    }
}

fn first(params: v1::SamplingParams) -> v1::SampleStreamRequest {
    v1::SampleStreamRequest {
        logits_f32le: to_bytes(&row(0)).into(),
        params: Some(params),
        previous_tokens: vec![3, 4, 5],
        n_probs: 3,
        ..Default::default()
    }
}

fn plain(t: u64) -> v1::SampleStreamRequest {
    v1::SampleStreamRequest {
        logits_f32le: to_bytes(&row(t)).into(),
        n_probs: 3,
        ..Default::default()
    }
}

fn verifying(v: v1::Verify) -> v1::SampleStreamRequest {
    v1::SampleStreamRequest {
        verify: Some(v),
        n_probs: 3,
        ..Default::default()
    }
}

/// K drafts for the rows `from..=from + K`: the one-by-one tokens where
/// `follow[j]`, else a token that differs from it.
fn drafts(reference: &[v1::SampleResponse], from: usize, follow: &[bool]) -> Vec<u32> {
    follow
        .iter()
        .enumerate()
        .map(|(j, &f)| {
            let t = reference[from + j].token_id;
            if f { t } else { (t + 1) % VOCAB as u32 }
        })
        .collect()
}

fn verify_msg(mode: v1::VerifyMode, draft_tokens: Vec<u32>, from: u64) -> v1::Verify {
    let k = draft_tokens.len() as u64;
    v1::Verify {
        draft_tokens,
        target_rows: (from..=from + k).map(verify_row).collect(),
        drafter_rows: vec![],
        mode: mode as i32,
    }
}

/// One message per row: the reference.
async fn one_by_one(s: &TestServer, params: v1::SamplingParams, n: u64) -> Vec<v1::SampleResponse> {
    let mut msgs = vec![first(params)];
    msgs.extend((1..n).map(plain));
    s.stream_all(msgs).await
}

/// The responses of a verifying stream, flattened to one per token.
fn flatten(responses: Vec<v1::SampleResponse>) -> Vec<v1::SampleResponse> {
    responses
        .into_iter()
        .flat_map(|r| match r.verify {
            Some(v) => v.tokens,
            None => vec![r],
        })
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sample_stream_verify_equals_one_message_per_row() {
    let s = start().await;
    for (mode, params) in [
        (v1::VerifyMode::Exact, params()),
        (v1::VerifyMode::Coupled, coupled_params()),
    ] {
        let reference = one_by_one(&s, params.clone(), 12).await;
        // Step 0 plain; rows 1-4 verified with two right drafts then a
        // wrong one (accepts 2, the third token is the correction);
        // rows 4-8 with four right drafts (all accepted, plus the bonus);
        // rows 9-10 with no draft (a plain step); row 11 plain again.
        let msgs = vec![
            first(params.clone()),
            verifying(verify_msg(
                mode,
                drafts(&reference, 1, &[true, true, false]),
                1,
            )),
            verifying(verify_msg(mode, drafts(&reference, 4, &[true; 4]), 4)),
            verifying(verify_msg(mode, vec![], 9)),
            verifying(verify_msg(mode, drafts(&reference, 10, &[false]), 10)),
            plain(11),
        ];
        let got = s.stream_all(msgs).await;
        let accepted: Vec<Option<u32>> = got
            .iter()
            .map(|r| r.verify.as_ref().map(|v| v.accepted))
            .collect();
        assert_eq!(
            accepted,
            [None, Some(2), Some(4), Some(0), Some(0), None],
            "{mode:?}"
        );
        // The top-level fields are the last verified token's.
        for r in &got {
            if let Some(v) = &r.verify {
                let last = v.tokens.last().unwrap();
                assert_eq!((r.token_id, r.step), (last.token_id, last.step));
            }
        }
        let got = flatten(got);
        assert_eq!(got, reference, "{mode:?}");
    }
    s.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sample_stream_rejection_answers_in_shape() {
    let s = start().await;
    let reference = one_by_one(&s, params(), 4).await;
    let d = drafts(&reference, 1, &[true, true]);
    let v = v1::Verify {
        drafter_rows: (1..=2).map(verify_row).collect(),
        ..verify_msg(v1::VerifyMode::Rejection, d.clone(), 1)
    };
    let got = s
        .stream_all(vec![first(params()), verifying(v), plain(4)])
        .await;
    // The drafter's rows are the target's: p = q, every draft accepted.
    let v = got[1].verify.as_ref().unwrap();
    assert_eq!(v.accepted, 2);
    assert_eq!(v.tokens.len(), 3);
    assert_eq!(
        v.tokens[..2].iter().map(|t| t.token_id).collect::<Vec<_>>(),
        d
    );
    assert_eq!(
        v.tokens.iter().map(|t| t.step).collect::<Vec<_>>(),
        [1, 2, 3]
    );
    // The bonus token is the chain's draw at row 3: one-by-one's token.
    assert_eq!(v.tokens[2], reference[3]);
    assert_eq!(got[2].step, 4);
    s.stop().await;
}

fn batch_msg(rows: Vec<v1::BatchStreamRow>) -> v1::SampleBatchStreamRequest {
    v1::SampleBatchStreamRequest {
        rows,
        params: Some(params()),
        n_probs: 3,
        ..Default::default()
    }
}

async fn batch_stream(
    s: &TestServer,
    msgs: Vec<v1::SampleBatchStreamRequest>,
) -> Result<Vec<v1::SampleBatchResponse>, tonic::Status> {
    let mut st = tokio::time::timeout(
        WAIT,
        s.client
            .clone()
            .sample_batch_stream(tokio_stream::iter(msgs)),
    )
    .await
    .expect("opens in time")?
    .into_inner();
    let mut out = Vec::new();
    while let Some(r) = tokio::time::timeout(WAIT, st.message())
        .await
        .expect("answers in time")?
    {
        out.push(r);
    }
    Ok(out)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn batch_stream_verify_equals_one_message_per_row() {
    let s = start().await;
    let reference = one_by_one(&s, params(), 7).await;
    let joining = |id: u64| v1::BatchStreamRow {
        sequence_id: id,
        logits: to_bytes(&row(0)).into(),
        previous_tokens: vec![3, 4, 5],
        ..Default::default()
    };
    let stepping = |id: u64, t: u64| v1::BatchStreamRow {
        sequence_id: id,
        logits: to_bytes(&row(t)).into(),
        ..Default::default()
    };
    let verifying = |id: u64, v: v1::Verify| v1::BatchStreamRow {
        sequence_id: id,
        verify: Some(v),
        ..Default::default()
    };
    // Sequence 1 verifies, sequence 2 steps one row per message.
    let d = drafts(&reference, 1, &[true, true, true, false]);
    let msgs = vec![
        batch_msg(vec![joining(1), joining(2)]),
        batch_msg(vec![
            verifying(1, verify_msg(v1::VerifyMode::Exact, d, 1)),
            stepping(2, 1),
        ]),
        batch_msg(vec![stepping(2, 2), stepping(1, 5)]),
        batch_msg(vec![stepping(1, 6), stepping(2, 3)]),
    ];
    let got = batch_stream(&s, msgs)
        .await
        .expect("the batch stream succeeds");
    let mut by_seq: std::collections::BTreeMap<u64, Vec<v1::SampleResponse>> = Default::default();
    for m in got {
        for (id, r) in m.sequence_ids.into_iter().zip(m.rows) {
            by_seq.entry(id).or_default().push(r);
        }
    }
    let one = flatten(by_seq.remove(&1).unwrap());
    assert_eq!(one, reference, "the verifying sequence");
    assert_eq!(by_seq[&2][..], reference[..4], "the stepping sequence");
    s.stop().await;
}

/// The status of a SampleStream whose valid first message is followed by
/// `bad`.
async fn stream_error(s: &TestServer, msgs: Vec<v1::SampleStreamRequest>) -> tonic::Status {
    let mut st = tokio::time::timeout(
        WAIT,
        s.client.clone().sample_stream(tokio_stream::iter(msgs)),
    )
    .await
    .expect("opens in time")
    .expect("opens")
    .into_inner();
    loop {
        match tokio::time::timeout(WAIT, st.message())
            .await
            .expect("answers in time")
        {
            Ok(Some(_)) => continue,
            Ok(None) => panic!("the stream ended without an error"),
            Err(status) => return status,
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_verify_is_invalid_argument_naming_the_field() {
    let s = start().await;
    let ok = || verify_msg(v1::VerifyMode::Exact, vec![1, 2], 1);
    let mut nan = row(1);
    nan[17] = f32::NAN;
    let cases: Vec<(v1::Verify, &[&str])> = vec![
        (
            verify_msg(v1::VerifyMode::Exact, vec![1; 17], 1),
            &[
                "verify.draft_tokens",
                "17 draft tokens",
                "limit of 16",
                "limits.max_draft_tokens",
            ],
        ),
        (
            verify_msg(v1::VerifyMode::Exact, vec![1, 5000], 1),
            &[
                "verify.draft_tokens[1]",
                "token id 5000",
                "vocabulary of 2000",
            ],
        ),
        (
            v1::Verify {
                target_rows: (1..=2).map(verify_row).collect(),
                ..ok()
            },
            &["verify.target_rows", "need 3 target rows", "got 2"],
        ),
        (
            v1::Verify {
                target_rows: vec![
                    verify_row(1),
                    v1::VerifyRow {
                        logits: to_bytes(&[0.0; 4]).into(),
                        ..Default::default()
                    },
                    verify_row(3),
                ],
                ..ok()
            },
            &[
                "verify.target_rows[1].logits",
                "has 4 logits",
                "vocabulary has 2000",
            ],
        ),
        (
            v1::Verify {
                target_rows: vec![
                    verify_row(1),
                    v1::VerifyRow {
                        logits: vec![0u8; 7].into(),
                        ..Default::default()
                    },
                    verify_row(3),
                ],
                ..ok()
            },
            &["verify.target_rows[1].logits", "not a multiple of 4"],
        ),
        (
            v1::Verify {
                target_rows: vec![
                    v1::VerifyRow {
                        logits: to_bytes(&nan).into(),
                        ..Default::default()
                    },
                    verify_row(2),
                    verify_row(3),
                ],
                ..ok()
            },
            &["verify.target_rows[0].logits", "17", "NaN"],
        ),
        (
            v1::Verify {
                mode: v1::VerifyMode::Rejection as i32,
                ..ok()
            },
            &[
                "verify.drafter_rows",
                "VERIFY_MODE_REJECTION",
                "2 drafts, got 0 rows",
            ],
        ),
        (
            v1::Verify {
                drafter_rows: vec![verify_row(1)],
                ..ok()
            },
            &[
                "verify.drafter_rows",
                "only under VERIFY_MODE_REJECTION",
                "got 1 rows",
            ],
        ),
        (
            v1::Verify { mode: 9, ..ok() },
            &["verify.mode", "unknown VerifyMode 9"],
        ),
        (
            v1::Verify {
                mode: v1::VerifyMode::Coupled as i32,
                ..ok()
            },
            &[
                "params",
                "VERIFY_MODE_COUPLED",
                "ends with coupled",
                "`dist`",
            ],
        ),
    ];
    for (v, needles) in cases {
        let err = stream_error(&s, vec![first(params()), verifying(v)]).await;
        assert_status(&err, Code::InvalidArgument, needles);
    }
    // Greedy under REJECTION: refused naming params.
    let greedy = v1::SamplingParams {
        temperature: Some(0.0),
        ..params()
    };
    let v = v1::Verify {
        mode: v1::VerifyMode::Rejection as i32,
        drafter_rows: (1..=2).map(verify_row).collect(),
        ..ok()
    };
    let err = stream_error(&s, vec![first(greedy), verifying(v)]).await;
    assert_status(
        &err,
        Code::InvalidArgument,
        &["params", "dist or coupled", "`greedy`"],
    );
    // Logits beside a Verify.
    let both = v1::SampleStreamRequest {
        logits_f32le: to_bytes(&row(1)).into(),
        ..verifying(ok())
    };
    let err = stream_error(&s, vec![first(params()), both]).await;
    assert_status(
        &err,
        Code::InvalidArgument,
        &["logits_f32le", "together with verify"],
    );
    // On the first message.
    let on_first = v1::SampleStreamRequest {
        verify: Some(ok()),
        ..first(params())
    };
    let err = stream_error(&s, vec![on_first]).await;
    assert_status(
        &err,
        Code::InvalidArgument,
        &["verify", "first message", "2 draft tokens"],
    );
    // A joining batch row with one, and a continuing row's error under rows[i].
    let join = v1::BatchStreamRow {
        sequence_id: 8,
        logits: to_bytes(&row(0)).into(),
        verify: Some(ok()),
        ..Default::default()
    };
    let err = batch_stream(&s, vec![batch_msg(vec![join])])
        .await
        .unwrap_err();
    assert_status(
        &err,
        Code::InvalidArgument,
        &["rows[0].verify", "joining row", "sequence 8"],
    );
    let join = v1::BatchStreamRow {
        sequence_id: 8,
        logits: to_bytes(&row(0)).into(),
        ..Default::default()
    };
    let later = v1::BatchStreamRow {
        sequence_id: 8,
        verify: Some(verify_msg(v1::VerifyMode::Exact, vec![1, 5000], 1)),
        ..Default::default()
    };
    let err = batch_stream(&s, vec![batch_msg(vec![join]), batch_msg(vec![later])])
        .await
        .unwrap_err();
    assert_status(
        &err,
        Code::InvalidArgument,
        &["rows[0].verify.draft_tokens[1]", "5000"],
    );
    s.stop().await;
}

/// EXACT through a constraint over a named vocabulary (the `constraint`
/// stage's grammar state advanced by the accepted drafts): the responses
/// of one message per row. Needs the model file for the vocabulary
/// (`SAMPLERD_MODEL`), skipped without it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn constrained_stream_verify_equals_one_message_per_row() {
    let Some(model) = model_path() else {
        eprintln!("skipped: no model file for the vocabulary (scripts/fetch-model.sh)");
        return;
    };
    let n = samplerd_model::read_vocabulary(&model)
        .expect("vocabulary")
        .len();
    let mut config = test_config();
    config.plugins.files = vec![core_plugin(), constraint_plugin()];
    config.vocabularies.insert("smollm2".into(), model);
    let s = start_serving(config, None).await;
    let params = v1::SamplingParams {
        seed: Some(9),
        vocabulary: "smollm2".into(),
        repeat_penalty: Some(1.3),
        constraint: Some(v1::Constraint {
            kind: Some(v1::constraint::Kind::Regex(
                "(cat|dog)( (cat|dog)){1,40}".into(),
            )),
            ..Default::default()
        }),
        ..Default::default()
    };
    let row = |t: u64| logits(n, 900 + t);
    let msg = |t: u64| v1::SampleStreamRequest {
        logits_f32le: to_bytes(&row(t)).into(),
        params: (t == 0).then(|| params.clone()),
        n_probs: 2,
        ..Default::default()
    };
    let reference = s.stream_all((0..10).map(msg).collect()).await;
    let verify = |from: u64, follow: &[bool]| {
        let draft_tokens: Vec<u32> = follow
            .iter()
            .enumerate()
            .map(|(j, &f)| {
                let t = reference[from as usize + j].token_id;
                if f { t } else { (t + 1) % n as u32 }
            })
            .collect();
        let k = draft_tokens.len() as u64;
        v1::SampleStreamRequest {
            verify: Some(v1::Verify {
                draft_tokens,
                target_rows: (from..=from + k)
                    .map(|t| v1::VerifyRow {
                        logits: to_bytes(&row(t)).into(),
                        ..Default::default()
                    })
                    .collect(),
                ..Default::default()
            }),
            n_probs: 2,
            ..Default::default()
        }
    };
    let got = s
        .stream_all(vec![
            msg(0),
            verify(1, &[true, true, false]),
            verify(4, &[true, true, true, true]),
            msg(9),
        ])
        .await;
    assert_eq!(flatten(got), reference);
    s.stop().await;
}

/// Row `t`'s top `m` entries and the log-sum-exp of the rest (f64), for a
/// sequence of `VOCAB` logits.
fn sparse_row(t: u64, m: usize) -> v1::SparseLogits {
    let r = row(t);
    let mut order: Vec<usize> = (0..r.len()).collect();
    order.sort_by(|&a, &b| r[b].total_cmp(&r[a]).then(a.cmp(&b)));
    let (sent, rest) = order.split_at(m);
    let max = rest
        .iter()
        .map(|&i| r[i] as f64)
        .fold(f64::NEG_INFINITY, f64::max);
    let sum: f64 = rest.iter().map(|&i| (r[i] as f64 - max).exp()).sum();
    v1::SparseLogits {
        ids: sent.iter().map(|&i| i as u32).collect(),
        values: sent.iter().map(|&i| r[i]).collect(),
        rest_logsumexp: max + sum.ln(),
        vocab_size: VOCAB as u32,
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn verify_over_sparse_rows_answers_as_over_dense_rows() {
    let s = start().await;
    for (mode, params) in [
        (v1::VerifyMode::Exact, params()),
        (v1::VerifyMode::Coupled, coupled_params()),
    ] {
        let reference = one_by_one(&s, params.clone(), 10).await;
        let sparse = |mut v: v1::Verify, from: u64| {
            for (j, r) in v.target_rows.iter_mut().enumerate() {
                *r = v1::VerifyRow {
                    sparse: Some(sparse_row(from + j as u64, 200)),
                    ..Default::default()
                };
            }
            v
        };
        // Two right drafts then a wrong one; then four right ones.
        let dense = [
            verify_msg(mode, drafts(&reference, 1, &[true, true, false]), 1),
            verify_msg(mode, drafts(&reference, 4, &[true; 4]), 4),
        ];
        let run = |vs: Vec<v1::Verify>| {
            let mut msgs = vec![first(params.clone())];
            msgs.extend(vs.into_iter().map(verifying));
            s.stream_all(msgs)
        };
        let want = run(dense.to_vec()).await;
        let got = run(vec![
            sparse(dense[0].clone(), 1),
            sparse(dense[1].clone(), 4),
        ])
        .await;
        assert_eq!(got.len(), want.len());
        let (got, want) = (flatten(got), flatten(want));
        assert_eq!(got.len(), 1 + 3 + 5, "{mode:?}");
        for (g, w) in got.iter().zip(&want) {
            assert_eq!((g.token_id, g.step), (w.token_id, w.step), "{mode:?}");
            assert_eq!(g.probability.to_bits(), w.probability.to_bits(), "{mode:?}");
            // The raw log-softmax: the sparse rows' f64 sum against the
            // dense row's f32 one.
            assert!((g.logprob - w.logprob).abs() < 1e-4, "{g:?} vs {w:?}");
            let ids =
                |r: &v1::SampleResponse| r.probs.iter().map(|p| p.token_id).collect::<Vec<_>>();
            assert_eq!(ids(g), ids(w), "{mode:?}");
        }
        let ids = |v: &[v1::SampleResponse]| v.iter().map(|r| r.token_id).collect::<Vec<_>>();
        assert_eq!(ids(&got), ids(&reference[..got.len()]), "{mode:?}");
    }

    // A sparse row too short to prove its step (top_k = 50 of 10 sent)
    // names the row; a sparse row of another vocabulary names its size.
    let mut short = verify_msg(v1::VerifyMode::Exact, vec![1, 2], 1);
    short.target_rows[0] = v1::VerifyRow {
        sparse: Some(sparse_row(1, 10)),
        ..Default::default()
    };
    let e = stream_error(&s, vec![first(params()), verifying(short)]).await;
    assert_eq!(e.code(), Code::FailedPrecondition, "{e:?}");
    assert!(
        e.message().contains("verify.target_rows[0].sparse"),
        "{e:?}"
    );
    let mut other = verify_msg(v1::VerifyMode::Exact, vec![1], 1);
    let mut wrong = sparse_row(1, 200);
    wrong.vocab_size = VOCAB as u32 + 1;
    other.target_rows[0] = v1::VerifyRow {
        sparse: Some(wrong),
        ..Default::default()
    };
    let e = stream_error(&s, vec![first(params()), verifying(other)]).await;
    assert_eq!(e.code(), Code::InvalidArgument, "{e:?}");
    assert!(
        e.message()
            .contains("verify.target_rows[0].sparse.vocab_size"),
        "{e:?}"
    );
    s.stop().await;
}
