//! The maximum connection age (gRFC A9, `limits.max_connection_age_secs`
//! and `limits.max_connection_age_grace_secs`), watched on the wire: a
//! proxy between client and server parses every HTTP/2 frame the server
//! sends and reports connections opening and closing. A connection past
//! its age gets a GOAWAY; a unary call already in flight completes on it;
//! the client's next call goes on a new connection; a stream still open
//! when the grace runs out ends with UNAVAILABLE `SAMPLERD_CONNECTION_AGED`
//! after whole messages, and can be resumed elsewhere; a connection whose
//! call never answers is closed anyway. Every wait is bounded.

mod common;

use std::net::SocketAddr;
use std::time::Duration;

use common::*;
use prost::Message;
use samplerd_api::v1;
use samplerd_api::v1::sampler_client::SamplerClient;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::mpsc;
use tonic::Code;
use tonic::transport::Channel;

/// Upper bound on anything the server owes us (ages here are 1 s).
const BOUND: Duration = Duration::from_secs(20);
const GOAWAY: u8 = 0x7;

/// What the proxy saw.
#[derive(Debug, PartialEq)]
enum Wire {
    Opened(usize),
    /// A frame from the server on connection `.0`: type and payload.
    Frame(usize, u8, Vec<u8>),
    /// Connection `.0` closed (the server's side ended).
    Closed(usize),
}

/// A TCP proxy to `upstream` that reports each connection and every frame
/// the server sends on it (numbered in accept order).
async fn frame_proxy(upstream: SocketAddr) -> (SocketAddr, mpsc::UnboundedReceiver<Wire>) {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let (tx, rx) = mpsc::unbounded_channel();
    tokio::spawn(async move {
        let mut n = 0;
        while let Ok((client, _)) = listener.accept().await {
            let id = n;
            n += 1;
            let tx = tx.clone();
            let _ = tx.send(Wire::Opened(id));
            tokio::spawn(async move {
                let server = TcpStream::connect(upstream).await.unwrap();
                let (mut cr, mut cw) = client.into_split();
                let (mut sr, mut sw) = server.into_split();
                let up = tokio::spawn(async move {
                    let _ = tokio::io::copy(&mut cr, &mut sw).await;
                    let _ = sw.shutdown().await;
                });
                let mut pending = Vec::new();
                let mut buf = vec![0u8; 64 << 10];
                loop {
                    let n = match sr.read(&mut buf).await {
                        Ok(0) | Err(_) => break,
                        Ok(n) => n,
                    };
                    pending.extend_from_slice(&buf[..n]);
                    while pending.len() >= 9 {
                        let len = u32::from_be_bytes([0, pending[0], pending[1], pending[2]]);
                        let end = 9 + len as usize;
                        if pending.len() < end {
                            break;
                        }
                        let _ = tx.send(Wire::Frame(id, pending[3], pending[9..end].to_vec()));
                        pending.drain(..end);
                    }
                    if cw.write_all(&buf[..n]).await.is_err() {
                        break;
                    }
                }
                let _ = cw.shutdown().await;
                up.abort();
                let _ = tx.send(Wire::Closed(id));
            });
        }
    });
    (addr, rx)
}

/// Waits (bounded) for the first event `want` accepts.
async fn wait_for(
    rx: &mut mpsc::UnboundedReceiver<Wire>,
    what: &str,
    want: impl Fn(&Wire) -> bool,
) {
    tokio::time::timeout(BOUND, async {
        loop {
            let ev = rx.recv().await.expect("the proxy runs");
            if want(&ev) {
                return;
            }
        }
    })
    .await
    .unwrap_or_else(|_| panic!("no {what} within {BOUND:?}"));
}

/// The last-stream-id a GOAWAY payload carries.
fn last_stream_id(payload: &[u8]) -> u32 {
    u32::from_be_bytes([payload[0], payload[1], payload[2], payload[3]]) & 0x7fff_ffff
}

fn aged(age: u64, grace: u64) -> impl FnOnce(&mut samplerd::app::config::Config) {
    move |c| {
        c.limits.max_connection_age_secs = age;
        c.limits.max_connection_age_grace_secs = grace;
    }
}

async fn client_for(addr: SocketAddr) -> SamplerClient<Channel> {
    SamplerClient::new(
        Channel::from_shared(format!("http://{addr}"))
            .unwrap()
            .connect()
            .await
            .expect("connect"),
    )
}

/// A gRPC message: the 5-byte prefix, then the encoding.
fn grpc_frame(msg: &impl Message) -> tonic::codegen::Bytes {
    let body = msg.encode_to_vec();
    let mut out = vec![0u8];
    out.extend_from_slice(&(body.len() as u32).to_be_bytes());
    out.extend_from_slice(&body);
    out.into()
}

fn grpc_request(addr: SocketAddr, method: &str) -> http::Request<()> {
    http::Request::builder()
        .method("POST")
        .uri(format!("http://{addr}/samplerd.v1.Sampler/{method}"))
        .header("content-type", "application/grpc")
        .header("te", "trailers")
        .body(())
        .unwrap()
}

fn sample_request() -> v1::SampleRequest {
    v1::SampleRequest {
        logits: logits(64, 9),
        params: Some(v1::SamplingParams {
            temperature: Some(0.0),
            ..Default::default()
        }),
        ..Default::default()
    }
}

/// A unary call in flight when its connection ages (its headers sent, its
/// message not yet) completes on that connection after the GOAWAY; the
/// connection then closes; a new connection serves the next call.
#[tokio::test]
async fn an_aged_connection_gets_goaway_and_its_in_flight_unary_call_completes() {
    let s = start_tuned(aged(1, 30)).await;
    let (proxy, mut wire) = frame_proxy(s.addr()).await;
    let tcp = TcpStream::connect(proxy).await.unwrap();
    let (client, conn) = h2::client::handshake(tcp).await.expect("h2 handshake");
    tokio::spawn(conn);
    let mut client = client.ready().await.unwrap();
    let (response, mut body) = client
        .send_request(grpc_request(proxy, "Sample"), false)
        .expect("request headers sent");
    // The age passes while the call is open: GOAWAY(2^31-1), then, after
    // the PING, GOAWAY naming stream 1 as the last one taken.
    wait_for(
        &mut wire,
        "GOAWAY naming the open call",
        |w| matches!(w, Wire::Frame(0, GOAWAY, p) if last_stream_id(p) == 1),
    )
    .await;
    body.send_data(grpc_frame(&sample_request()), true)
        .expect("the message goes out after the GOAWAY");
    let response = tokio::time::timeout(BOUND, response)
        .await
        .expect("answered in time")
        .expect("answered");
    assert_eq!(response.status(), 200);
    let mut body = response.into_body();
    let mut bytes = Vec::new();
    while let Some(chunk) = tokio::time::timeout(BOUND, body.data()).await.unwrap() {
        let chunk = chunk.unwrap();
        let _ = body.flow_control().release_capacity(chunk.len());
        bytes.extend_from_slice(&chunk);
    }
    let trailers = tokio::time::timeout(BOUND, body.trailers())
        .await
        .unwrap()
        .unwrap()
        .expect("trailers");
    assert_eq!(trailers["grpc-status"], "0", "{trailers:?}");
    let answer = v1::SampleResponse::decode(&bytes[5..]).expect("one SampleResponse");
    assert_eq!(answer.token_id, argmax(&logits(64, 9)));
    // Nothing left on it: the server closes the connection.
    wait_for(&mut wire, "the close", |w| *w == Wire::Closed(0)).await;
    // The next call, on a new connection, is served.
    let mut fresh = client_for(proxy).await;
    fresh
        .sample(sample_request())
        .await
        .expect("a call on a new connection");
    s.assert_serving().await;
}

/// A tonic channel's next call after its connection aged goes on a new
/// connection, and succeeds.
#[tokio::test]
async fn the_next_call_after_the_age_goes_on_a_new_connection() {
    let s = start_tuned(aged(1, 30)).await;
    let (proxy, mut wire) = frame_proxy(s.addr()).await;
    let mut client = client_for(proxy).await;
    client.sample(sample_request()).await.expect("first call");
    wait_for(&mut wire, "GOAWAY", |w| {
        matches!(w, Wire::Frame(0, GOAWAY, _))
    })
    .await;
    wait_for(&mut wire, "the close", |w| *w == Wire::Closed(0)).await;
    client
        .sample(sample_request())
        .await
        .expect("the call after the age");
    // It went on connection 1 (the proxy numbers them in order; 0 closed).
    let mut opened = Vec::new();
    while let Ok(ev) = wire.try_recv() {
        if let Wire::Opened(n) = ev {
            opened.push(n);
        }
    }
    assert_eq!(opened, [1], "connections opened after the age");
    s.assert_serving().await;
}

/// A SampleStream runs on through the grace (its steps answered after the
/// GOAWAY), then ends with UNAVAILABLE `SAMPLERD_CONNECTION_AGED` (the
/// responses before it whole), and the connection closes. Resumed on a new
/// connection from its window, step and seed, it goes on with exactly the
/// tokens the uninterrupted stream gives.
#[tokio::test]
async fn a_stream_past_the_grace_ends_unavailable_and_resumes_bit_identically() {
    let s = start_tuned(aged(1, 3)).await;
    let (proxy, mut wire) = frame_proxy(s.addr()).await;
    let mut client = client_for(proxy).await;
    let params = v1::SamplingParams {
        seed: Some(77),
        repeat_penalty: Some(1.5),
        ..Default::default()
    };
    let window = vec![3u32, 5, 7];
    let step_logits = |i: u64| logits(64, 100 + i);
    let (tx, rx) = mpsc::channel(4);
    let first = v1::SampleStreamRequest {
        logits: step_logits(0),
        previous_tokens: window.clone(),
        params: Some(params.clone()),
        first_step: 10,
        ..Default::default()
    };
    tx.send(first).await.unwrap();
    let mut responses = client
        .sample_stream(tokio_stream::wrappers::ReceiverStream::new(rx))
        .await
        .expect("stream opens")
        .into_inner();
    let mut got = vec![next_message(&mut responses, BOUND).await];
    wait_for(&mut wire, "GOAWAY", |w| {
        matches!(w, Wire::Frame(0, GOAWAY, _))
    })
    .await;
    // Inside the grace: the stream still answers.
    let mut i = 1;
    tx.send(v1::SampleStreamRequest {
        logits: step_logits(i),
        ..Default::default()
    })
    .await
    .unwrap();
    got.push(next_message(&mut responses, BOUND).await);
    // Then the grace runs out: the stream ends with the documented status.
    let err = tokio::time::timeout(BOUND, async {
        loop {
            i += 1;
            let _ = tx
                .send(v1::SampleStreamRequest {
                    logits: step_logits(i),
                    ..Default::default()
                })
                .await;
            match responses.message().await {
                Ok(Some(r)) => got.push(r),
                Ok(None) => panic!("the stream ended without a status"),
                Err(e) => return e,
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    })
    .await
    .expect("cut within the bound");
    let details = assert_reason(&err, Reason::ConnectionAged);
    assert_eq!(err.code(), Code::Unavailable);
    assert_eq!(
        details.error_info().unwrap().metadata["limit"],
        "limits.max_connection_age_grace_secs"
    );
    assert!(err.message().contains("resume"), "{err:?}");
    wait_for(&mut wire, "the close", |w| *w == Wire::Closed(0)).await;
    for (k, r) in got.iter().enumerate() {
        assert_eq!(r.step, 10 + k as u64);
    }

    // Resume: the window so far, the next step, the same seed.
    let received: Vec<u32> = got.iter().map(|r| r.token_id).collect();
    let next = got.len() as u64;
    let more = 3;
    let resumed = s
        .stream_all(
            (0..more)
                .map(|k| v1::SampleStreamRequest {
                    logits: step_logits(next + k),
                    previous_tokens: if k == 0 {
                        [window.clone(), received.clone()].concat()
                    } else {
                        vec![]
                    },
                    params: (k == 0).then(|| params.clone()),
                    first_step: if k == 0 { 10 + next } else { 0 },
                    ..Default::default()
                })
                .collect(),
        )
        .await;
    // The uninterrupted stream, on the test's own connection.
    let whole = s
        .stream_all(
            (0..next + more)
                .map(|k| v1::SampleStreamRequest {
                    logits: step_logits(k),
                    previous_tokens: if k == 0 { window.clone() } else { vec![] },
                    params: (k == 0).then(|| params.clone()),
                    first_step: if k == 0 { 10 } else { 0 },
                    ..Default::default()
                })
                .collect(),
        )
        .await;
    assert_eq!(&whole[..got.len()], &got[..]);
    assert_eq!(&whole[got.len()..], &resumed[..]);
    s.assert_serving().await;
}

/// A call that never answers (its message never sent) holds no connection
/// past the grace: the connection is closed a moment after.
#[tokio::test]
async fn a_connection_whose_call_never_answers_is_closed_after_the_grace() {
    let s = start_tuned(aged(1, 1)).await;
    let (proxy, mut wire) = frame_proxy(s.addr()).await;
    let tcp = TcpStream::connect(proxy).await.unwrap();
    let (client, conn) = h2::client::handshake(tcp).await.expect("h2 handshake");
    tokio::spawn(conn);
    let mut client = client.ready().await.unwrap();
    let (_response, _body) = client
        .send_request(grpc_request(proxy, "Sample"), false)
        .expect("request headers sent");
    wait_for(&mut wire, "GOAWAY", |w| {
        matches!(w, Wire::Frame(0, GOAWAY, _))
    })
    .await;
    wait_for(&mut wire, "the close", |w| *w == Wire::Closed(0)).await;
    s.assert_serving().await;
}

/// `max_connection_age_secs = 0`: no GOAWAY, however old the connection.
#[tokio::test]
async fn age_zero_means_connections_never_age() {
    let s = start_tuned(aged(0, 1)).await;
    let (proxy, mut wire) = frame_proxy(s.addr()).await;
    let mut client = client_for(proxy).await;
    client.sample(sample_request()).await.expect("first call");
    // Three seconds is past any age the other tests use.
    let seen = tokio::time::timeout(Duration::from_secs(3), async {
        loop {
            match wire.recv().await {
                Some(Wire::Frame(_, GOAWAY, _)) | Some(Wire::Closed(_)) | None => return,
                Some(_) => {}
            }
        }
    })
    .await;
    assert!(
        seen.is_err(),
        "a connection aged with max_connection_age_secs = 0"
    );
    client.sample(sample_request()).await.expect("later call");
}
