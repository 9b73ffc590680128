//! SampleBatch and SampleBatchStream: a row's result equals `Sample` (a
//! sequence's step equals `SampleStream`) on the same inputs bit for bit,
//! in every wire dtype (half-width rows against `Sample` on their exactly
//! widened values); sequences join and leave by id; and bad input is
//! INVALID_ARGUMENT naming the row and the field.

mod common;

use std::time::Duration;

use common::*;
use half::{bf16, f16};
use samplerd_api::v1;
use tonic::Code;

const VOCAB: usize = 512;
const WAIT: Duration = Duration::from_secs(20);

fn f32le(l: &[f32]) -> Vec<u8> {
    to_bytes(l)
}

fn f16le(l: &[f32]) -> (Vec<u8>, Vec<f32>) {
    let h: Vec<f16> = l.iter().map(|&x| f16::from_f32(x)).collect();
    let bytes = h.iter().flat_map(|x| x.to_le_bytes()).collect();
    (bytes, h.iter().map(|x| x.to_f32()).collect())
}

fn bf16le(l: &[f32]) -> (Vec<u8>, Vec<f32>) {
    let h: Vec<bf16> = l.iter().map(|&x| bf16::from_f32(x)).collect();
    let bytes = h.iter().flat_map(|x| x.to_le_bytes()).collect();
    (bytes, h.iter().map(|x| x.to_f32()).collect())
}

/// Parameters that exercise the default chain's stages with a seed.
fn params(seed: u64, top_k: i32, temperature: f32) -> v1::SamplingParams {
    v1::SamplingParams {
        seed: Some(seed),
        top_k: Some(top_k),
        top_p: Some(0.9),
        temperature: Some(temperature),
        repeat_penalty: Some(1.3),
        ..Default::default()
    }
}

/// The `Sample` request a batch row stands for.
fn as_sample(
    req: &v1::SampleBatchRequest,
    row: &v1::BatchRow,
    values: &[f32],
) -> v1::SampleRequest {
    v1::SampleRequest {
        logits_f32le: to_bytes(values).into(),
        previous_tokens: row.previous_tokens.clone(),
        params: row.params.clone().or(req.params.clone()),
        step: row.step,
        n_probs: req.n_probs,
        post_sampling_probs: req.post_sampling_probs,
        constraint_tokens: row.constraint_tokens.clone(),
        ..Default::default()
    }
}

fn assert_same(a: &v1::SampleResponse, b: &v1::SampleResponse, what: &str) {
    assert_eq!(a.token_id, b.token_id, "{what}: token");
    assert_eq!(
        a.probability.to_bits(),
        b.probability.to_bits(),
        "{what}: p"
    );
    assert_eq!(a.logprob.to_bits(), b.logprob.to_bits(), "{what}: logprob");
    assert_eq!((a.seed, a.step), (b.seed, b.step), "{what}: seed/step");
    assert_eq!(a.probs.len(), b.probs.len(), "{what}: probs");
    for (x, y) in a.probs.iter().zip(&b.probs) {
        assert_eq!(x.token_id, y.token_id, "{what}: probs id");
        assert_eq!(x.probability.to_bits(), y.probability.to_bits(), "{what}");
        assert_eq!(x.logprob.to_bits(), y.logprob.to_bits(), "{what}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn each_row_is_exactly_sample_in_every_dtype() {
    let mut s = start().await;
    for (dtype, encode) in [
        (
            v1::LogitsDtype::Unspecified,
            (|l: &[f32]| (f32le(l), l.to_vec())) as fn(&[f32]) -> (Vec<u8>, Vec<f32>),
        ),
        (v1::LogitsDtype::F32le, |l| (f32le(l), l.to_vec())),
        (v1::LogitsDtype::F16le, f16le),
        (v1::LogitsDtype::Bf16le, bf16le),
    ] {
        for post_sampling_probs in [false, true] {
            let mut values = Vec::new();
            let rows: Vec<v1::BatchRow> = (0..12u64)
                .map(|i| {
                    let (bytes, widened) = encode(&logits(VOCAB, 100 + i));
                    values.push(widened);
                    v1::BatchRow {
                        logits: bytes.into(),
                        // Every third row keeps the shared parameters.
                        params: (i % 3 != 0).then(|| params(i, 20 + i as i32, 0.7)),
                        step: i * 7,
                        previous_tokens: (0..i as u32 * 5).collect(),
                        constraint_tokens: vec![],
                        sparse: None,
                        shared: None,
                    }
                })
                .collect();
            let req = v1::SampleBatchRequest {
                rows,
                dtype: dtype as i32,
                params: Some(params(99, 40, 1.1)),
                n_probs: 5,
                post_sampling_probs,
            };
            let got = s.client.sample_batch(req.clone()).await.expect("batch");
            let got = got.into_inner();
            assert_eq!(got.rows.len(), req.rows.len());
            assert!(got.sequence_ids.is_empty());
            for (i, (row, resp)) in req.rows.iter().zip(&got.rows).enumerate() {
                let want = s.sample_ok(as_sample(&req, row, &values[i])).await;
                assert_same(resp, &want, &format!("{dtype:?} row {i}"));
            }
        }
    }
    s.stop().await;
}

#[tokio::test]
async fn bad_batches_name_the_row_and_the_field() {
    let dir = tempfile::tempdir().unwrap();
    let vocab_path = plain_tokenizer_json(dir.path(), VOCAB);
    let mut s = start_tuned(|c| {
        c.limits.max_batch_rows = 4;
        c.vocabularies.insert("plain".into(), vocab_path.clone());
    })
    .await;
    let row = |n: usize| v1::BatchRow {
        logits: f32le(&logits(n, 1)).into(),
        ..Default::default()
    };
    let batch = |rows: Vec<v1::BatchRow>| v1::SampleBatchRequest {
        rows,
        ..Default::default()
    };
    let cases: Vec<(&str, v1::SampleBatchRequest, &str, Reason)> = vec![
        (
            "no rows",
            batch(vec![]),
            "rows: is empty",
            Reason::InvalidField,
        ),
        (
            "above limits.max_batch_rows",
            batch(vec![row(8); 5]),
            "rows: 5 rows exceed the limit of 4 (limits.max_batch_rows)",
            Reason::LimitExceeded,
        ),
        (
            "rows of different length under one vocabulary",
            v1::SampleBatchRequest {
                params: Some(v1::SamplingParams {
                    vocabulary: "plain".into(),
                    ..Default::default()
                }),
                ..batch(vec![row(VOCAB), row(VOCAB - 1)])
            },
            "rows[1].logits: 511 logits, but vocabulary \"plain\" has 512 tokens",
            Reason::InvalidField,
        ),
        (
            "an f16 row of an odd byte length",
            v1::SampleBatchRequest {
                dtype: v1::LogitsDtype::F16le as i32,
                ..batch(vec![
                    row(8),
                    v1::BatchRow {
                        logits: vec![0u8; 7].into(),
                        ..Default::default()
                    },
                ])
            },
            "rows[1].logits: length 7 bytes is not a multiple of 2 (dtype f16le)",
            Reason::InvalidLogits,
        ),
        (
            "an f32 row of a byte length not a multiple of 4",
            batch(vec![v1::BatchRow {
                logits: vec![0u8; 6].into(),
                ..Default::default()
            }]),
            "rows[0].logits: length 6 bytes is not a multiple of 4 (dtype f32le)",
            Reason::InvalidLogits,
        ),
        (
            "a row's own parameter out of range",
            batch(vec![
                row(8),
                row(8),
                v1::BatchRow {
                    params: Some(v1::SamplingParams {
                        top_p: Some(1.5),
                        ..Default::default()
                    }),
                    ..row(8)
                },
            ]),
            "rows[2].params.top_p",
            Reason::ParamOutOfRange,
        ),
        (
            "an empty row",
            batch(vec![row(8), v1::BatchRow::default()]),
            "rows[1].logits: logits are empty",
            Reason::InvalidLogits,
        ),
        (
            "an unknown dtype",
            v1::SampleBatchRequest {
                dtype: 9,
                ..batch(vec![row(8)])
            },
            "dtype: unknown LogitsDtype 9",
            Reason::InvalidField,
        ),
    ];
    for (what, req, message, reason) in cases {
        let err = s.client.sample_batch(req).await.expect_err(what);
        assert_status(&err, Code::InvalidArgument, &[message]);
        assert_eq!(reason_of(&err), reason, "{what}: {err:?}");
    }
    s.assert_serving().await;
    s.stop().await;
}

/// A SampleBatchStream message.
fn message(
    rows: Vec<v1::BatchStreamRow>,
    leave: Vec<u64>,
    dtype: v1::LogitsDtype,
) -> v1::SampleBatchStreamRequest {
    v1::SampleBatchStreamRequest {
        rows,
        dtype: dtype as i32,
        params: Some(params(5, 30, 0.8)),
        n_probs: 3,
        leave,
        ..Default::default()
    }
}

/// Opens a SampleBatchStream with `msgs` already queued; the request
/// stream stays open until the returned sender is dropped.
async fn open_batch_stream(
    s: &TestServer,
    msgs: Vec<v1::SampleBatchStreamRequest>,
) -> (
    tokio::sync::mpsc::Sender<v1::SampleBatchStreamRequest>,
    tonic::Streaming<v1::SampleBatchResponse>,
) {
    let (tx, rx) = tokio::sync::mpsc::channel(msgs.len().max(1));
    for m in msgs {
        tx.send(m).await.unwrap();
    }
    let responses = s
        .client
        .clone()
        .sample_batch_stream(tokio_stream::wrappers::ReceiverStream::new(rx))
        .await
        .expect("opens")
        .into_inner();
    (tx, responses)
}

/// The logits of sequence `id` at its step `t`.
fn seq_logits(id: u64, t: u64) -> Vec<f32> {
    logits(VOCAB, id * 1_000 + t)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn batch_stream_sequences_are_their_own_sample_streams() {
    let s = start().await;
    let dtype = v1::LogitsDtype::Bf16le;
    // Sequences 10 and 11 join at message 0 (11 with its own parameters
    // and window), 12 joins at message 2; 10 leaves before message 3.
    let joins = |id: u64, t: u64| v1::BatchStreamRow {
        sequence_id: id,
        logits: bf16le(&seq_logits(id, t)).0.into(),
        params: (id == 11).then(|| params(11, 10, 1.5)),
        previous_tokens: if id == 11 { vec![1, 2, 3] } else { vec![] },
        first_step: if id == 12 { 40 } else { 0 },
        ..Default::default()
    };
    let step = |id: u64, t: u64| v1::BatchStreamRow {
        sequence_id: id,
        logits: bf16le(&seq_logits(id, t)).0.into(),
        ..Default::default()
    };
    let plan = vec![
        message(vec![joins(10, 0), joins(11, 0)], vec![], dtype),
        message(vec![step(11, 1), step(10, 1)], vec![], dtype),
        message(vec![step(10, 2), joins(12, 0), step(11, 2)], vec![], dtype),
        message(vec![step(12, 1), step(11, 3)], vec![10], dtype),
        message(vec![], vec![11, 12], dtype),
    ];
    let (tx, mut responses) = open_batch_stream(&s, plan.clone()).await;
    drop(tx);
    let mut by_seq: std::collections::BTreeMap<u64, Vec<v1::SampleResponse>> = Default::default();
    for (k, m) in plan.iter().enumerate() {
        let r = next_message(&mut responses, WAIT).await;
        let ids: Vec<u64> = m.rows.iter().map(|r| r.sequence_id).collect();
        assert_eq!(r.sequence_ids, ids, "message {k}");
        for (id, row) in ids.iter().zip(r.rows) {
            by_seq.entry(*id).or_default().push(row);
        }
    }
    assert_clean_end(&mut responses, WAIT).await;
    // Each sequence, replayed as its own SampleStream on the widened values.
    for (id, got) in by_seq {
        let first = joins(id, 0);
        let msgs: Vec<v1::SampleStreamRequest> = (0..got.len() as u64)
            .map(|t| v1::SampleStreamRequest {
                logits_f32le: to_bytes(&bf16le(&seq_logits(id, t)).1).into(),
                previous_tokens: if t == 0 {
                    first.previous_tokens.clone()
                } else {
                    vec![]
                },
                params: (t == 0).then(|| first.params.clone().unwrap_or(params(5, 30, 0.8))),
                first_step: if t == 0 { first.first_step } else { 0 },
                n_probs: 3,
                ..Default::default()
            })
            .collect();
        let want = s.stream_all(msgs).await;
        assert_eq!(want.len(), got.len());
        for (t, (a, b)) in got.iter().zip(&want).enumerate() {
            assert_same(a, b, &format!("sequence {id} step {t}"));
        }
    }
    wait_sessions_closed(&s).await;
    s.stop().await;
}

/// `leave` runs before the message's rows (as the proto says), so a row
/// for an id that leaves in the same message joins afresh — with its own
/// parameters, window and first step — exactly as a new id would.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_sequence_that_leaves_joins_again_in_the_same_message() {
    let s = start().await;
    let dt = v1::LogitsDtype::F32le;
    let row = |t: u64| v1::BatchStreamRow {
        sequence_id: 1,
        logits: f32le(&seq_logits(1, t)).into(),
        ..Default::default()
    };
    let rejoin = v1::BatchStreamRow {
        params: Some(params(77, 5, 1.2)),
        previous_tokens: vec![4, 5],
        first_step: 9,
        ..row(2)
    };
    let plan = vec![
        message(vec![row(0)], vec![], dt),
        message(vec![row(1)], vec![], dt),
        message(vec![rejoin.clone()], vec![1], dt),
        message(vec![row(3)], vec![], dt),
    ];
    let (tx, mut responses) = open_batch_stream(&s, plan.clone()).await;
    drop(tx);
    let mut got = Vec::new();
    for _ in &plan {
        got.push(next_message(&mut responses, WAIT).await.rows.remove(0));
    }
    assert_clean_end(&mut responses, WAIT).await;
    // The rejoined sequence is a new stream from message 2 on.
    let want = s
        .stream_all(vec![
            v1::SampleStreamRequest {
                logits_f32le: f32le(&seq_logits(1, 2)).into(),
                previous_tokens: rejoin.previous_tokens.clone(),
                params: rejoin.params.clone(),
                first_step: 9,
                n_probs: 3,
                ..Default::default()
            },
            v1::SampleStreamRequest {
                logits_f32le: f32le(&seq_logits(1, 3)).into(),
                n_probs: 3,
                ..Default::default()
            },
        ])
        .await;
    assert_same(&got[2], &want[0], "rejoined, its first step");
    assert_same(&got[3], &want[1], "rejoined, its second step");
    assert_eq!(got[2].step, 9);
    wait_sessions_closed(&s).await;
    s.stop().await;
}

#[tokio::test]
async fn bad_batch_stream_messages_end_the_stream_naming_the_row() {
    let s = start_tuned(|c| c.limits.max_batch_rows = 3).await;
    let row = |id: u64| v1::BatchStreamRow {
        sequence_id: id,
        logits: f32le(&logits(16, id)).into(),
        ..Default::default()
    };
    let dt = v1::LogitsDtype::F32le;
    // (messages before the bad one, the bad one, expected text, reason)
    let cases: Vec<(
        Vec<v1::SampleBatchStreamRequest>,
        v1::SampleBatchStreamRequest,
        &str,
        Reason,
    )> = vec![
        (
            vec![],
            message(vec![row(1), row(2), row(1)], vec![], dt),
            "rows[2].sequence_id: sequence 1 already has a row in this message (rows[0])",
            Reason::InvalidField,
        ),
        (
            vec![],
            message(vec![], vec![], dt),
            "rows: is empty and nothing leaves",
            Reason::InvalidField,
        ),
        (
            vec![message(vec![row(1)], vec![], dt)],
            message(vec![row(1)], vec![7], dt),
            "leave[0]: sequence 7 is not open in this stream",
            Reason::InvalidField,
        ),
        (
            vec![message(vec![row(1)], vec![], dt)],
            message(
                vec![v1::BatchStreamRow {
                    previous_tokens: vec![4],
                    ..row(1)
                }],
                vec![],
                dt,
            ),
            "rows[0].previous_tokens: is set, but sequence 1 is already open",
            Reason::InvalidField,
        ),
        (
            vec![message(vec![row(1)], vec![], dt)],
            message(
                vec![v1::BatchStreamRow {
                    constraint_tokens: vec![4],
                    ..row(1)
                }],
                vec![],
                dt,
            ),
            "rows[0].constraint_tokens: is set, but sequence 1 is already open",
            Reason::InvalidField,
        ),
        (
            vec![message(vec![row(1), row(2)], vec![], dt)],
            message(vec![row(3), row(4)], vec![], dt),
            "rows: 4 open sequences after this message exceed the limit of 3",
            Reason::LimitExceeded,
        ),
        (
            vec![message(vec![row(1)], vec![], dt)],
            message(
                vec![
                    row(2),
                    v1::BatchStreamRow {
                        logits: f32le(&logits(15, 1)).into(),
                        ..row(1)
                    },
                ],
                vec![],
                dt,
            ),
            "rows[1].logits: vocabulary changed within the sequence: 15 logits, its first row had 16",
            Reason::InvalidField,
        ),
    ];
    for (before, bad, text, reason) in cases {
        let n_before = before.len();
        let (tx, mut responses) =
            open_batch_stream(&s, before.into_iter().chain([bad]).collect()).await;
        for _ in 0..n_before {
            next_message(&mut responses, WAIT).await;
        }
        let err = tokio::time::timeout(WAIT, responses.message())
            .await
            .expect("answered in time")
            .expect_err(text);
        assert_status(&err, Code::InvalidArgument, &[text]);
        assert_eq!(reason_of(&err), reason, "{text}: {err:?}");
        drop(tx);
    }
    wait_sessions_closed(&s).await;
    s.assert_serving().await;
    s.stop().await;
}
