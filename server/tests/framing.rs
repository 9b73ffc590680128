//! However a client cuts its messages into HTTP/2 DATA frames — one message
//! per frame (decoded straight from the frame, `transport::one_frame`),
//! split over several (rows cut by a frame boundary), several in one, one
//! byte a frame — samplerd answers exactly as to tonic's own client. Raw
//! HTTP/2 (the `h2` crate) controls the framing.

mod common;

use common::raw::{framed, raw_outcome};
use common::*;
use prost::Message;
use samplerd_api::v1;

/// Sends `frames` as the DATA frames of one call to `path` (the last one
/// ends the stream) and returns the response messages; asserts grpc-status
/// 0.
async fn raw_call(
    addr: std::net::SocketAddr,
    path: &str,
    frames: Vec<Vec<u8>>,
) -> Vec<v1::SampleResponse> {
    raw_call_of(addr, path, frames).await
}

/// [`raw_call`] for any response message.
async fn raw_call_of<M: Message + Default>(
    addr: std::net::SocketAddr,
    path: &str,
    frames: Vec<Vec<u8>>,
) -> Vec<M> {
    let out = raw_outcome(addr, "POST", Some("application/grpc"), path, frames).await;
    assert_eq!(
        out.grpc_status.as_deref(),
        Some("0"),
        "{}",
        out.grpc_message
    );
    let mut messages = Vec::new();
    let mut rest = &out.body[..];
    while !rest.is_empty() {
        let len = u32::from_be_bytes(rest[1..5].try_into().unwrap()) as usize;
        messages.push(M::decode(&rest[5..5 + len]).expect("a response"));
        rest = &rest[5 + len..];
    }
    messages
}

fn params() -> Option<v1::SamplingParams> {
    Some(v1::SamplingParams {
        seed: Some(11),
        repeat_penalty: Some(1.3),
        top_k: Some(50),
        temperature: Some(0.9),
        ..Default::default()
    })
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sample_answers_the_same_however_the_message_is_framed() {
    let mut s = start().await;
    let addr = s.server.as_ref().unwrap().addr;
    let req = v1::SampleRequest {
        logits_f32le: to_bytes(&logits(4096, 5)).into(),
        previous_tokens: vec![3, 9, 27],
        params: params(),
        step: 4,
        n_probs: 3,
        ..Default::default()
    };
    let want = s.client.sample(req.clone()).await.unwrap().into_inner();
    let wire = framed(&req);
    let cuts: Vec<(&str, Vec<Vec<u8>>)> = vec![
        ("one frame", vec![wire.clone()]),
        ("one frame, empty end", vec![wire.clone(), vec![]]),
        (
            "split in the prefix",
            vec![wire[..3].to_vec(), wire[3..].to_vec()],
        ),
        (
            "split in three",
            vec![
                wire[..100].to_vec(),
                wire[100..9000].to_vec(),
                wire[9000..].to_vec(),
            ],
        ),
    ];
    for (name, frames) in cuts {
        let got = raw_call(addr, "/samplerd.v1.Sampler/Sample", frames).await;
        assert_eq!(got, vec![want.clone()], "{name}");
    }
    s.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sample_stream_answers_the_same_however_its_messages_are_framed() {
    let s = start().await;
    let addr = s.server.as_ref().unwrap().addr;
    let msgs: Vec<v1::SampleStreamRequest> = (0..6)
        .map(|i| v1::SampleStreamRequest {
            logits_f32le: to_bytes(&logits(2048, 40 + i)).into(),
            previous_tokens: if i == 0 { vec![1, 2] } else { vec![] },
            params: if i == 0 { params() } else { None },
            n_probs: 2,
            ..Default::default()
        })
        .collect();
    let want = s.stream_all(msgs.clone()).await;
    assert_eq!(want.len(), msgs.len());
    let w: Vec<Vec<u8>> = msgs.iter().map(framed).collect();
    // Whole; split; two glued; whole; split in the prefix.
    let frames = vec![
        w[0].clone(),
        w[1][..500].to_vec(),
        w[1][500..].to_vec(),
        [w[2].clone(), w[3].clone()].concat(),
        w[4].clone(),
        w[5][..2].to_vec(),
        w[5][2..].to_vec(),
    ];
    let got = raw_call(addr, "/samplerd.v1.Sampler/SampleStream", frames).await;
    assert_eq!(got, want);
    s.stop().await;
}

/// Batch messages whose rows frame boundaries cut, several messages in
/// one frame, and a message in one-byte frames (what the server must
/// gather without keeping a piece per byte): the same rows as tonic's own
/// client gets, for the stream and the unary batch.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn batches_answer_the_same_however_their_messages_are_framed() {
    let s = start().await;
    let addr = s.server.as_ref().unwrap().addr;
    let row = |id: u64, t: u64| v1::BatchStreamRow {
        sequence_id: id,
        logits: to_bytes(&logits(3000, 100 * id + t)).into(),
        params: (t == 0).then(params).flatten(),
        previous_tokens: if t == 0 { vec![1, 2] } else { vec![] },
        ..Default::default()
    };
    let msgs: Vec<v1::SampleBatchStreamRequest> = (0..5)
        .map(|t| v1::SampleBatchStreamRequest {
            rows: (1..=3).map(|id| row(id, t)).collect(),
            n_probs: 2,
            ..Default::default()
        })
        .collect();
    let mut want = Vec::new();
    let mut out = s
        .client
        .clone()
        .sample_batch_stream(tokio_stream::iter(msgs.clone()))
        .await
        .expect("the batch stream opens")
        .into_inner();
    while let Some(r) = out.message().await.expect("a batch step") {
        want.push(r);
    }
    assert_eq!(want.len(), msgs.len());
    let w: Vec<Vec<u8>> = msgs.iter().map(framed).collect();
    // Whole; cut inside its second row; two glued; one byte a frame
    // (12 KB of frames); cut in the prefix.
    let frames: Vec<Vec<u8>> = [
        vec![w[0].clone()],
        vec![w[1][..15_000].to_vec(), w[1][15_000..].to_vec()],
        vec![[w[2].clone(), w[3].clone()].concat()],
        w[4].iter().map(|b| vec![*b]).collect(),
    ]
    .concat();
    let got: Vec<v1::SampleBatchResponse> =
        raw_call_of(addr, "/samplerd.v1.Sampler/SampleBatchStream", frames).await;
    assert_eq!(got, want);

    let batch = v1::SampleBatchRequest {
        rows: (1..=3)
            .map(|id| v1::BatchRow {
                logits: to_bytes(&logits(3000, id)).into(),
                step: id,
                ..Default::default()
            })
            .collect(),
        params: params(),
        ..Default::default()
    };
    let want = s
        .client
        .clone()
        .sample_batch(batch.clone())
        .await
        .unwrap()
        .into_inner();
    let wire = framed(&batch);
    for (name, frames) in [
        ("whole", vec![wire.clone()]),
        (
            "cut in a row",
            vec![wire[..7_000].to_vec(), wire[7_000..].to_vec()],
        ),
        ("one byte a frame", wire.iter().map(|b| vec![*b]).collect()),
    ] {
        let got: Vec<v1::SampleBatchResponse> =
            raw_call_of(addr, "/samplerd.v1.Sampler/SampleBatch", frames).await;
        assert_eq!(got, vec![want.clone()], "{name}");
    }
    s.stop().await;
}

/// gRPC's cardinality rule: a unary call (or a server-streaming one such as
/// Generate) carries exactly one request message; more or none is
/// UNIMPLEMENTED, never served from the first or answered INTERNAL.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn unary_calls_carry_exactly_one_message() {
    let s = start().await;
    let addr = s.server.as_ref().unwrap().addr;
    let one = framed(&v1::SampleRequest {
        logits: logits(64, 1),
        ..Default::default()
    });
    let two_in_one_frame = [one.clone(), one.clone()].concat();
    let generate = framed(&v1::GenerateRequest {
        prompt: "hi".into(),
        ..Default::default()
    });
    let cases: Vec<(&str, &str, Vec<Vec<u8>>)> = vec![
        (
            "Sample, two messages in one frame",
            "Sample",
            vec![two_in_one_frame],
        ),
        (
            "Sample, two frames",
            "Sample",
            vec![one.clone(), one.clone()],
        ),
        ("Sample, no message", "Sample", vec![]),
        ("Sample, empty body frame", "Sample", vec![vec![]]),
        (
            "Generate, two messages",
            "Generate",
            vec![generate.clone(), generate],
        ),
        ("ListStages, no message", "ListStages", vec![]),
    ];
    for (name, method, frames) in cases {
        let path = format!("/samplerd.v1.Sampler/{method}");
        let out = raw_outcome(addr, "POST", Some("application/grpc"), &path, frames).await;
        assert_eq!(
            out.grpc_status.as_deref(),
            Some("12"),
            "{name}: {:?} {}",
            out.grpc_status,
            out.grpc_message
        );
        assert!(
            out.grpc_message.contains("request message"),
            "{name}: {}",
            out.grpc_message
        );
        assert_reason(
            out.status.as_ref().expect("a status"),
            Reason::WrongMessageCount,
        );
    }
    // One message is served.
    let out = raw_outcome(
        addr,
        "POST",
        Some("application/grpc+proto"),
        "/samplerd.v1.Sampler/Sample",
        vec![one],
    )
    .await;
    assert_eq!(
        out.grpc_status.as_deref(),
        Some("0"),
        "{}",
        out.grpc_message
    );
    s.assert_serving().await;
}

/// Only gRPC on the gRPC port: another content-type (or none) is HTTP 415,
/// another method HTTP 405, before any handler runs.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn requests_that_are_not_grpc_get_http_errors() {
    let s = start().await;
    let addr = s.server.as_ref().unwrap().addr;
    let one = framed(&v1::SampleRequest {
        logits: logits(64, 1),
        ..Default::default()
    });
    let path = "/samplerd.v1.Sampler/Sample";
    for ct in [Some("application/json"), Some("text/plain"), None] {
        let out = raw_outcome(addr, "POST", ct, path, vec![one.clone()]).await;
        assert_eq!(out.http, http::StatusCode::UNSUPPORTED_MEDIA_TYPE, "{ct:?}");
        assert_eq!(out.grpc_status, None, "{ct:?}");
    }
    let out = raw_outcome(addr, "GET", None, path, vec![]).await;
    assert_eq!(out.http, http::StatusCode::METHOD_NOT_ALLOWED);
    let out = raw_outcome(
        addr,
        "GET",
        Some("application/grpc"),
        "/grpc.health.v1.Health/Check",
        vec![],
    )
    .await;
    assert_eq!(out.http, http::StatusCode::METHOD_NOT_ALLOWED);
    s.assert_serving().await;
}
