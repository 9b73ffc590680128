//! What a client can hold without sending requests: a connection that
//! never sends the HTTP/2 preface is closed at `limits.handshake_timeout_ms`,
//! one with no RPC in flight at `limits.idle_connection_timeout_secs` (but
//! not one whose stream is merely quiet; a tonic client's next call then
//! simply reconnects), and past `limits.max_connections`
//! new connections are refused while the others keep serving. One peer is
//! held to `limits.max_connections_per_peer`, so it locks out neither
//! another peer nor a health check, and a loopback health check still
//! connects when every ordinary slot is taken
//! (`limits.reserved_loopback_connections`). Each peer is an address of
//! its own in 127.0.0.0/8 (all of it is the loopback interface on Linux).
//! Every wait is bounded.

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
    // The test server's own channel holds one of the three; every
    // connection here comes from 127.0.0.1, so neither the per-peer cap
    // nor the loopback reserve may get in the way.
    let s = start_tuned(|c| {
        c.limits.max_connections = 3;
        c.limits.max_connections_per_peer = 3;
        c.limits.reserved_loopback_connections = 0;
    })
    .await;
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

/// The client preface of HTTP/2: the magic and an empty SETTINGS frame.
const H2_PREFACE: &[u8] = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n\0\0\0\x04\0\0\0\0\0";

/// A TCP connection to `addr` from the loopback address `source`.
async fn tcp_from(source: &str, addr: std::net::SocketAddr) -> std::io::Result<TcpStream> {
    let socket = tokio::net::TcpSocket::new_v4()?;
    socket.bind(std::net::SocketAddr::new(source.parse().unwrap(), 0))?;
    socket.connect(addr).await
}

/// A connection from `source` that sent the HTTP/2 preface (so no
/// handshake deadline applies) and nothing else, and whether the server
/// kept it: `Some` once the server's own SETTINGS arrive, `None` when the
/// server closed it instead (a refusal). Bounded by CLOSE_BOUND.
async fn idle_from(source: &str, addr: std::net::SocketAddr) -> Option<TcpStream> {
    use tokio::io::AsyncWriteExt;
    let mut tcp = tcp_from(source, addr).await.expect("TCP connect");
    // A refused connection may be closed before the preface is written.
    if tcp.write_all(H2_PREFACE).await.is_err() {
        return None;
    }
    let mut first = [0u8; 9];
    match tokio::time::timeout(CLOSE_BOUND, tcp.read(&mut first)).await {
        Ok(Ok(n)) if n > 0 => Some(tcp),
        Ok(_) => None,
        Err(_) => panic!("the server neither served nor closed a connection from {source}"),
    }
}

/// A gRPC channel whose connection comes from the loopback address `source`.
async fn channel_from(source: &'static str, addr: std::net::SocketAddr) -> Channel {
    let connector = tower::service_fn(move |_: http::Uri| async move {
        tcp_from(source, addr)
            .await
            .map(hyper_util::rt::TokioIo::new)
    });
    tokio::time::timeout(
        CLOSE_BOUND,
        Channel::from_shared(format!("http://{addr}"))
            .unwrap()
            .connect_with_connector(connector),
    )
    .await
    .expect("connects in time")
    .unwrap_or_else(|e| panic!("connect from {source}: {e:?}"))
}

/// A health check on a fresh connection from `source`: whether it answered
/// SERVING (a refused connection fails the call).
async fn health_from(source: &'static str, addr: std::net::SocketAddr) -> bool {
    use tonic_health::pb::HealthCheckRequest;
    use tonic_health::pb::health_client::HealthClient;
    let connector = tower::service_fn(move |_: http::Uri| async move {
        tcp_from(source, addr)
            .await
            .map(hyper_util::rt::TokioIo::new)
    });
    let Ok(Ok(channel)) = tokio::time::timeout(
        CLOSE_BOUND,
        Channel::from_shared(format!("http://{addr}"))
            .unwrap()
            .connect_with_connector(connector),
    )
    .await
    else {
        return false;
    };
    let mut health = HealthClient::new(channel);
    let check = health.check(HealthCheckRequest {
        service: String::new(),
    });
    matches!(
        tokio::time::timeout(CLOSE_BOUND, check).await,
        Ok(Ok(r)) if r.get_ref().status == 1 // SERVING
    )
}

/// Opens `n` idle connections from `source` at once; returns those the
/// server kept (the others it closed).
async fn hold_from(source: &str, addr: std::net::SocketAddr, n: usize) -> Vec<TcpStream> {
    futures::future::join_all((0..n).map(|_| idle_from(source, addr)))
        .await
        .into_iter()
        .flatten()
        .collect()
}

#[tokio::test]
async fn one_peer_holding_its_cap_locks_out_neither_another_peer_nor_a_health_check() {
    // 60 connections, so 15 per peer (a quarter, the default). Every
    // 127.x address is loopback, which could also take the loopback
    // reserve: none here, so the cap alone is seen. The handshake deadline
    // is far out, so any close below is a refusal.
    let s = start_tuned(|c| {
        c.limits.max_connections = 60;
        c.limits.reserved_loopback_connections = 0;
        c.limits.handshake_timeout_ms = 600_000;
    })
    .await;
    // One client tries to hold twice the server's connections.
    let held = hold_from("127.0.0.3", s.addr(), 120).await;
    assert_eq!(
        held.len(),
        15,
        "one peer keeps exactly its cap; the rest are closed at once"
    );
    // Another client is served.
    let mut other = SamplerClient::new(channel_from("127.0.0.2", s.addr()).await);
    other
        .sample(v1::SampleRequest {
            logits: logits(64, 1),
            ..Default::default()
        })
        .await
        .expect("another peer is served");
    // And so is a health check on a connection of its own.
    assert!(
        health_from("127.0.0.1", s.addr()).await,
        "health check refused"
    );
    // The greedy peer's next connection is still refused.
    assert!(idle_from("127.0.0.3", s.addr()).await.is_none());
    drop(held);
    s.assert_serving().await;
}

#[tokio::test]
async fn a_loopback_health_check_connects_while_every_ordinary_slot_is_taken() {
    // Four ordinary slots, two per peer, one in reserve for loopback.
    let s = start_tuned(|c| {
        c.limits.max_connections = 4;
        c.limits.max_connections_per_peer = 2;
        c.limits.reserved_loopback_connections = 1;
        c.limits.handshake_timeout_ms = 600_000;
    })
    .await;
    // The test's own channel (127.0.0.1) holds one; two peers take the rest.
    let a = hold_from("127.0.0.3", s.addr(), 2).await;
    let b = hold_from("127.0.0.4", s.addr(), 1).await;
    assert_eq!((a.len(), b.len()), (2, 1));
    // A health check from inside the host still connects: the reserve.
    assert!(
        health_from("127.0.0.1", s.addr()).await,
        "health check refused"
    );
    // The reserve is one connection. Once the check's slot is back (the
    // server has seen its close; hence the bounded retries), another
    // loopback peer holds it: then nothing more gets in, health checks
    // included — the reserve was what let the check in.
    let deadline = Instant::now() + CLOSE_BOUND;
    let reserved = loop {
        if let Some(tcp) = idle_from("127.0.0.5", s.addr()).await {
            break tcp;
        }
        assert!(
            Instant::now() < deadline,
            "the reserve's slot never came back"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    };
    assert!(
        idle_from("127.0.0.6", s.addr()).await.is_none(),
        "the reserve is used up"
    );
    assert!(!health_from("127.0.0.1", s.addr()).await, "no slot is left");
    drop((a, b, reserved));
    s.assert_serving().await;
}
