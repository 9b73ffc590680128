//! Requests that are hostile by size rather than by shape, against the real
//! `samplerd serve` process (its RSS read from /proc): an oversized
//! Generate request is refused from its length prefix, before its bytes
//! are read or decoded, a compressed one by its inflated size, and the
//! server keeps serving.

mod common;
mod process;

use std::time::{Duration, Instant};

use samplerd_api::v1;
use samplerd_api::v1::sampler_client::SamplerClient;
use tonic::Code;

/// A generous bound on the refusal (the refusal itself takes well under
/// 100 ms on loopback; this leaves room for a loaded CI machine).
const REFUSAL_BOUND: Duration = Duration::from_secs(2);
/// Bound on a call that also compresses 16 MiB on the client side.
const CALL_BOUND: Duration = Duration::from_secs(30);

/// The server's resident set in bytes (`VmRSS` of /proc/PID/status).
fn rss_bytes(pid: u32) -> u64 {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).expect("read status");
    let kb: u64 = status
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
        .expect("VmRSS in /proc/PID/status");
    kb * 1024
}

#[tokio::test]
async fn an_oversized_generate_request_is_refused_before_it_is_read() {
    let p = process::start("");
    let ch = p.channel().await;
    let mut client = SamplerClient::new(ch)
        .max_encoding_message_size(usize::MAX)
        .max_decoding_message_size(usize::MAX);
    let pid = p.child.id();
    let before = rss_bytes(pid);
    let req = v1::GenerateRequest {
        prompt: "x".repeat(16 << 20),
        ..Default::default()
    };
    let t0 = Instant::now();
    let err = tokio::time::timeout(REFUSAL_BOUND, client.generate(req))
        .await
        .expect("refused within the bound")
        .expect_err("a 16 MB Generate request is refused");
    let took = t0.elapsed();
    common::assert_status(
        &err,
        Code::ResourceExhausted,
        &["Generate request of", "generate.max_request_bytes"],
    );
    let grown = rss_bytes(pid).saturating_sub(before);
    assert!(
        grown < 20 << 20,
        "RSS grew by {grown} bytes refusing a 16 MB request (took {took:?})"
    );
    // The same connection still serves.
    let ok = client
        .sample(v1::SampleRequest {
            logits: common::logits(100, 1),
            ..Default::default()
        })
        .await;
    assert!(ok.is_ok(), "{ok:?}");
}

/// A compressed message's length prefix is its compressed length: a 16 MiB
/// prompt is ~16 KB of gzip. It is refused by what it inflates to — tonic
/// stops inflating at the limit — with the same status naming the same
/// key, in both encodings the server accepts, and a small compressed
/// Generate still gets past the size gate (to the missing model).
#[tokio::test]
async fn a_compressed_generate_request_is_held_to_the_limit_by_its_inflated_size() {
    use tonic::codec::CompressionEncoding;
    let p = process::start("");
    let ch = p.channel().await;
    for encoding in [CompressionEncoding::Gzip, CompressionEncoding::Zstd] {
        let mut client = SamplerClient::new(ch.clone())
            .send_compressed(encoding)
            .max_encoding_message_size(usize::MAX);
        let req = v1::GenerateRequest {
            prompt: "x".repeat(16 << 20),
            ..Default::default()
        };
        let err = tokio::time::timeout(CALL_BOUND, client.generate(req))
            .await
            .expect("answered within the bound")
            .expect_err("16 MiB of prompt is refused however it is compressed");
        common::assert_status(
            &err,
            Code::ResourceExhausted,
            &[
                "Generate request decompresses to more than the limit of 4194304 bytes",
                "generate.max_request_bytes",
            ],
        );
        let small = v1::GenerateRequest {
            prompt: "x".repeat(1 << 20),
            ..Default::default()
        };
        let err = tokio::time::timeout(CALL_BOUND, client.generate(small))
            .await
            .expect("answered within the bound")
            .expect_err("no model is configured");
        assert_eq!(
            err.code(),
            Code::FailedPrecondition,
            "{encoding:?}: {err:?}"
        );
    }
}

/// SampleStream sessions are charged to `limits.memory_budget_bytes` for
/// their life: at 262,144 logits each holds ~7 MiB, so a 16 MiB budget
/// admits two; the third is refused naming the budget, and once one closes
/// a new one opens. Every charge is returned.
#[tokio::test]
async fn sample_stream_sessions_are_held_to_the_memory_budget() {
    let s = common::start_tuned(|c| c.limits.memory_budget_bytes = 16 << 20).await;
    let first = || v1::SampleStreamRequest {
        logits_f32le: common::to_bytes(&common::logits(262_144, 2)).into(),
        ..Default::default()
    };
    let mut client = s.client.clone();
    let a = common::open_stream(&mut client, first()).await;
    let b = common::open_stream(&mut client, first()).await;
    let budget = &s.state().memory;
    assert!(budget.charged() > 12 << 20, "{} charged", budget.charged());
    // The third is refused at its first message.
    let (_tx, requests) = common::held_requests(first()).await;
    let mut third = client
        .sample_stream(requests)
        .await
        .expect("the stream opens")
        .into_inner();
    let err = tokio::time::timeout(REFUSAL_BOUND, third.message())
        .await
        .expect("answered in time")
        .expect_err("over the budget");
    common::assert_status(
        &err,
        Code::ResourceExhausted,
        &[
            "memory budget",
            "this SampleStream session",
            "limits.memory_budget_bytes",
        ],
    );
    // One closes: room again.
    drop(a);
    common::wait_sessions_closed_to(&s, 1).await;
    let c = common::open_stream(&mut client, first()).await;
    drop((b, c));
    common::wait_sessions_closed(&s).await;
    assert_eq!(budget.charged(), 0, "every charge is returned");
    s.assert_serving().await;
}
