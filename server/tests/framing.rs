//! However a client cuts its messages into HTTP/2 DATA frames — one message
//! per frame (decoded straight from the frame, `service::one_frame`), split
//! over several, several in one — samplerd answers exactly as to tonic's
//! own client. Raw HTTP/2 (the `h2` crate) controls the framing.

mod common;

use common::*;
use prost::Message;
use prost::bytes::Bytes;
use samplerd_api::v1;

/// The gRPC length prefix + message.
fn framed(m: &impl Message) -> Vec<u8> {
    let body = m.encode_to_vec();
    let mut out = vec![0u8];
    out.extend((body.len() as u32).to_be_bytes());
    out.extend(body);
    out
}

/// Sends `frames` as the DATA frames of one call to `path` (the last one
/// ends the stream) and returns the response messages; asserts grpc-status
/// 0.
async fn raw_call(
    addr: std::net::SocketAddr,
    path: &str,
    frames: Vec<Vec<u8>>,
) -> Vec<v1::SampleResponse> {
    let tcp = tokio::net::TcpStream::connect(addr).await.unwrap();
    let (h2, conn) = h2::client::handshake(tcp).await.expect("h2 handshake");
    tokio::spawn(conn);
    let mut h2 = h2.ready().await.expect("h2 ready");
    let req = raw_grpc_request(addr, path);
    let (response, mut send) = h2.send_request(req, false).expect("send headers");
    let n = frames.len();
    for (i, f) in frames.into_iter().enumerate() {
        send.send_data(Bytes::from(f), i + 1 == n)
            .expect("send data");
    }
    let resp = tokio::time::timeout(HEALTH_TIMEOUT, response)
        .await
        .expect("response in time")
        .expect("response");
    let mut body = resp.into_body();
    let mut bytes = Vec::new();
    while let Some(chunk) = body.data().await {
        let chunk = chunk.expect("response body");
        let _ = body.flow_control().release_capacity(chunk.len());
        bytes.extend_from_slice(&chunk);
    }
    let trailers = body.trailers().await.expect("trailers").expect("trailers");
    assert_eq!(
        trailers.get("grpc-status").map(|v| v.to_str().unwrap()),
        Some("0"),
        "{trailers:?}"
    );
    let mut out = Vec::new();
    let mut rest = &bytes[..];
    while !rest.is_empty() {
        let len = u32::from_be_bytes(rest[1..5].try_into().unwrap()) as usize;
        out.push(v1::SampleResponse::decode(&rest[5..5 + len]).expect("a response"));
        rest = &rest[5 + len..];
    }
    out
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
