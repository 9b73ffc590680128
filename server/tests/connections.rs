//! What a client can hold without sending requests: a connection that
//! never sends the HTTP/2 preface is closed at `limits.handshake_timeout_ms`,
//! one with no RPC in flight at `limits.idle_connection_timeout_secs` (but
//! not one whose stream is merely quiet; a tonic client's next call then
//! simply reconnects), and past `limits.max_connections`
//! new connections are refused while the others keep serving. Every wait is
//! bounded.

mod common;

use std::time::{Duration, Instant};

use common::*;
use samplerd_api::v1;
use samplerd_api::v1::sampler_client::SamplerClient;
use tokio::io::AsyncReadExt;
use tokio::net::TcpStream;
use tonic::transport::Channel;

/// Upper bound on any close the server owes us.
const CLOSE_BOUND: Duration = Duration::from_secs(10);

/// Whether the server closes `tcp` within `bound` (reads return EOF or an
/// error; nothing is expected to arrive on a connection that sent nothing).
async fn closed_within(tcp: &mut TcpStream, bound: Duration) -> bool {
    let mut buf = [0u8; 256];
    let deadline = tokio::time::Instant::now() + bound;
    loop {
        match tokio::time::timeout_at(deadline, tcp.read(&mut buf)).await {
            Err(_) => return false,
            Ok(Ok(0)) | Ok(Err(_)) => return true,
            Ok(Ok(_)) => continue, // e.g. the server's SETTINGS frame
        }
    }
}

/// An HTTP/2 connection (handshake done, no request): its driver's task,
/// which ends when the server closes the connection.
async fn h2_connection(addr: std::net::SocketAddr) -> tokio::task::JoinHandle<()> {
    let tcp = TcpStream::connect(addr).await.unwrap();
    let (client, conn) = h2::client::handshake(tcp).await.expect("h2 handshake");
    tokio::spawn(async move {
        let _client = client; // keeps the connection open until it is closed
        let _ = conn.await;
    })
}

/// Opens an HTTP/2 connection by hand (preface and empty SETTINGS, no
/// request) and returns the frames the server sends until it closes it
/// (type, payload), or `None` if it is still open after `bound`.
async fn frames_until_closed(
    addr: std::net::SocketAddr,
    bound: Duration,
) -> Option<Vec<(u8, Vec<u8>)>> {
    use tokio::io::AsyncWriteExt;
    let mut tcp = TcpStream::connect(addr).await.unwrap();
    tcp.write_all(b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n\0\0\0\x04\0\0\0\0\0")
        .await
        .unwrap();
    let mut bytes = Vec::new();
    // A reset after the close also ends the read.
    let _ = tokio::time::timeout(bound, tcp.read_to_end(&mut bytes))
        .await
        .ok()?;
    let mut frames = Vec::new();
    let mut rest = &bytes[..];
    while rest.len() >= 9 {
        let len = u32::from_be_bytes([0, rest[0], rest[1], rest[2]]) as usize;
        let end = (9 + len).min(rest.len());
        frames.push((rest[3], rest[9..end].to_vec()));
        rest = &rest[end..];
    }
    Some(frames)
}

async fn client_for(addr: std::net::SocketAddr) -> SamplerClient<Channel> {
    let ch = Channel::from_shared(format!("http://{addr}"))
        .unwrap()
        .connect()
        .await
        .expect("connect");
    SamplerClient::new(ch)
}

#[tokio::test]
async fn a_connection_that_sends_nothing_is_closed_at_the_handshake_deadline() {
    let s = start_tuned(|c| c.limits.handshake_timeout_ms = 300).await;
    let mut tcp = TcpStream::connect(s.addr()).await.unwrap();
    let t0 = Instant::now();
    assert!(closed_within(&mut tcp, CLOSE_BOUND).await, "never closed");
    assert!(
        t0.elapsed() >= Duration::from_millis(250),
        "{:?}",
        t0.elapsed()
    );
    s.assert_serving().await;
}

#[tokio::test]
async fn an_idle_connection_is_closed_but_a_quiet_stream_is_not() {
    let s = start_tuned(|c| c.limits.idle_connection_timeout_secs = 1).await;
    // No RPC at all: closed after about a second.
    let t0 = Instant::now();
    let frames = frames_until_closed(s.addr(), CLOSE_BOUND)
        .await
        .expect("the idle connection is closed");
    // With a GOAWAY(NO_ERROR) first, so a client opens a new connection
    // for its next call instead of finding this one broken.
    const GOAWAY: u8 = 0x7;
    let goaway = frames.iter().find(|(kind, _)| *kind == GOAWAY);
    assert!(
        goaway.is_some_and(|(_, p)| p.len() == 8 && p[4..] == [0, 0, 0, 0]),
        "closed without a GOAWAY(NO_ERROR): frames {frames:?}"
    );
    assert!(
        t0.elapsed() >= Duration::from_millis(900),
        "{:?}",
        t0.elapsed()
    );

    // A SampleStream whose client waits longer than the idle deadline
    // between steps keeps its connection: an RPC is in flight.
    let mut client = client_for(s.addr()).await;
    let (tx, rx) = tokio::sync::mpsc::channel(4);
    let step = || v1::SampleStreamRequest {
        logits: logits(64, 3),
        ..Default::default()
    };
    tx.send(step()).await.unwrap();
    let mut responses = client
        .sample_stream(tokio_stream::wrappers::ReceiverStream::new(rx))
        .await
        .expect("stream opens")
        .into_inner();
    next_message(&mut responses, HEALTH_TIMEOUT).await;
    // Waiting out the deadline is the point of this test.
    tokio::time::sleep(Duration::from_millis(2500)).await;
    tx.send(step()).await.unwrap();
    next_message(&mut responses, HEALTH_TIMEOUT).await;
    s.assert_serving().await;
}

/// A loopback TCP proxy to `upstream`: its address, and a receiver that
/// gets one message each time a proxied connection has closed both ways
/// (so a test can wait for the server's close instead of sleeping).
async fn close_watching_proxy(
    upstream: std::net::SocketAddr,
) -> (
    std::net::SocketAddr,
    tokio::sync::mpsc::UnboundedReceiver<()>,
) {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let (closed, rx) = tokio::sync::mpsc::unbounded_channel();
    tokio::spawn(async move {
        while let Ok((mut client, _)) = listener.accept().await {
            let closed = closed.clone();
            tokio::spawn(async move {
                let mut server = TcpStream::connect(upstream).await.unwrap();
                let _ = tokio::io::copy_bidirectional(&mut client, &mut server).await;
                let _ = closed.send(());
            });
        }
    });
    (addr, rx)
}

#[tokio::test]
async fn a_tonic_client_s_next_call_after_an_idle_close_succeeds() {
    let s = start_tuned(|c| c.limits.idle_connection_timeout_secs = 1).await;
    let (proxy, mut closed) = close_watching_proxy(s.addr()).await;
    let mut client = client_for(proxy).await;
    let request = || v1::SampleRequest {
        logits: logits(64, 3),
        ..Default::default()
    };
    client.sample(request()).await.expect("the first call");
    // The server closes the connection once it has been idle a second.
    tokio::time::timeout(CLOSE_BOUND, closed.recv())
        .await
        .expect("the idle connection is closed within the bound")
        .expect("the proxy runs");
    // The GOAWAY told the channel the connection is done: it connects
    // again for the next call instead of failing it.
    client
        .sample(request())
        .await
        .expect("the call after the idle close");
    s.assert_serving().await;
}

#[tokio::test]
async fn connections_past_the_cap_are_refused_and_the_rest_keep_serving() {
    // The test server's own channel holds one of the three.
    let s = start_tuned(|c| c.limits.max_connections = 3).await;
    s.assert_serving().await;
    let a = h2_connection(s.addr()).await;
    let b = h2_connection(s.addr()).await;
    // The fourth is closed at once.
    let mut extra = TcpStream::connect(s.addr()).await.unwrap();
    assert!(closed_within(&mut extra, CLOSE_BOUND).await, "not refused");
    s.assert_serving().await;
    // One leaves: a new connection is served again (its slot comes back
    // once the server has seen the close, hence the bounded retries).
    a.abort();
    let _ = a.await;
    let deadline = Instant::now() + CLOSE_BOUND;
    loop {
        let served = match Channel::from_shared(format!("http://{}", s.addr()))
            .unwrap()
            .connect()
            .await
        {
            Ok(ch) => tokio::time::timeout(
                HEALTH_TIMEOUT,
                SamplerClient::new(ch).sample(v1::SampleRequest {
                    logits: logits(64, 1),
                    ..Default::default()
                }),
            )
            .await
            .is_ok_and(|r| r.is_ok()),
            Err(_) => false,
        };
        if served {
            break;
        }
        assert!(Instant::now() < deadline, "no connection slot came back");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    drop(b);
}
