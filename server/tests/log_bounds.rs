//! The real binary's log never carries a client's content whole: a
//! request's chain text (here 1 MiB of DRY breakers; a grammar travels the
//! same way) is its length and a short hash at INFO and a bounded quote at
//! DEBUG, and an error naming a 1 MiB value is logged bounded. Every line
//! the server writes meanwhile is read back and measured.

mod common;
mod process;

use std::time::{Duration, Instant};

use common::{assert_clean_end, logits, next_message, number_stage, open_stream, stage_spec};
use samplerd_api::v1;
use samplerd_api::v1::param_value::Kind;
use samplerd_api::v1::sampler_client::SamplerClient;
use samplerd_sampling::echo::MAX_ECHO_BYTES;

const WAIT: Duration = Duration::from_secs(30);
const TEXT: usize = 1 << 20;
/// Longest log line accepted: a request's line holds a few bounded quotes
/// at most.
const MAX_LINE: usize = 4096;

/// The longest run of `q` in `s`: how much of the client's text it holds.
fn echoed(s: &str) -> usize {
    s.split(|c| c != 'q').map(str::len).max().unwrap_or(0)
}

/// Runs a Sample refused for a 1 MiB vocabulary name and a two-step
/// SampleStream whose chain holds 1 MiB of text against a server logging
/// at `filter`; returns every log line up to the stream's close.
async fn lines_at(filter: &str) -> Vec<String> {
    let p = process::start_logging(filter, "");
    let mut client = SamplerClient::new(p.channel().await)
        .max_encoding_message_size(16 << 20)
        .max_decoding_message_size(16 << 20);
    let q = "q".repeat(TEXT);
    client
        .sample(v1::SampleRequest {
            logits: logits(64, 1),
            params: Some(v1::SamplingParams {
                vocabulary: q.clone(),
                ..Default::default()
            }),
            ..Default::default()
        })
        .await
        .expect_err("no such vocabulary");
    // DRY off: its breakers are only stored, no vocabulary needed.
    let dry = stage_spec(
        "dry",
        [
            ("multiplier", Kind::Number(0.0)),
            (
                "sequence_breakers",
                Kind::Strings(v1::StringList { values: vec![q] }),
            ),
        ],
    );
    let first = v1::SampleStreamRequest {
        logits: logits(64, 2),
        params: Some(v1::SamplingParams {
            chain: vec![dry, number_stage("greedy", &[])],
            ..Default::default()
        }),
        ..Default::default()
    };
    let (tx, mut responses, _) = open_stream(&mut client, first).await;
    tx.send(v1::SampleStreamRequest {
        logits: logits(64, 3),
        ..Default::default()
    })
    .await
    .unwrap();
    next_message(&mut responses, WAIT).await;
    drop(tx);
    assert_clean_end(&mut responses, WAIT).await;
    let deadline = Instant::now() + WAIT;
    let mut lines = Vec::new();
    loop {
        let line = p
            .next_log(deadline)
            .unwrap_or_else(|| panic!("no \"stream closed\" line in time; read: {lines:?}"));
        let done = process::log_message(&line).as_deref() == Some("stream closed");
        lines.push(line);
        if done {
            return lines;
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn client_text_is_logged_bounded() {
    let info = lines_at("info").await;
    for line in &info {
        assert!(line.len() <= MAX_LINE, "INFO line of {} bytes", line.len());
        assert!(
            echoed(line) < 8,
            "INFO line holds the client's text: {}…",
            &line[..line.len().min(300)]
        );
    }
    let closed = info.last().unwrap();
    assert!(
        closed.contains(&format!(
            "sequence_breakers=1 strings <{} bytes #",
            TEXT + 1
        )),
        "{closed}"
    );

    let debug = lines_at("debug").await;
    for line in &debug {
        assert!(line.len() <= MAX_LINE, "DEBUG line of {} bytes", line.len());
        assert!(
            echoed(line) <= MAX_ECHO_BYTES,
            "DEBUG line quotes {} bytes of the client's text",
            echoed(line)
        );
    }
    let refused = debug
        .iter()
        .find(|l| process::log_message(l).as_deref() == Some("sample failed"))
        .expect("the refused Sample is logged at DEBUG");
    assert!(refused.contains(&format!("({TEXT} bytes)")), "{refused}");
    let closed = debug.last().unwrap();
    assert!(
        closed.contains(&format!("(1 string, {TEXT} bytes)")),
        "{closed}"
    );
}
