//! Prometheus metrics of the real `samplerd serve` process: after a known
//! mix of RPCs, `/metrics` has the request counters by RPC and status code,
//! the latency histograms, open streams, per-stage times, plugin errors by
//! stage — and, with `SAMPLERD_MODEL` set, tokens generated and the model
//! load time — with the right counts. Plus `metrics.enabled = false`.

mod common;
mod process;

use std::collections::{BTreeMap, HashMap};
use std::time::Duration;

use common::{
    assert_clean_end, core_plugin, exact_generate, logits, next_message, open_stream, test_plugin,
};
use samplerd_api::v1;
use samplerd_api::v1::sampler_client::SamplerClient;
use tonic::Code;

const VOCAB: usize = 1000;
const RPC_TIMEOUT: Duration = Duration::from_secs(20);

/// One sample: its labels (sorted) and value.
type Sample = (BTreeMap<String, String>, f64);

/// Parsed samples by metric name.
struct Scrape(HashMap<String, Vec<Sample>>);

impl Scrape {
    fn parse(text: &str) -> Scrape {
        let mut m: HashMap<String, Vec<_>> = HashMap::new();
        for line in text
            .lines()
            .filter(|l| !l.starts_with('#') && !l.is_empty())
        {
            let (series, value) = line.rsplit_once(' ').expect("sample line");
            let value: f64 = value.parse().unwrap_or_else(|_| panic!("value in {line}"));
            let (name, labels) = match series.split_once('{') {
                Some((n, rest)) => (n, rest.trim_end_matches('}')),
                None => (series, ""),
            };
            let labels = labels
                .split(',')
                .filter(|l| !l.is_empty())
                .map(|kv| {
                    let (k, v) = kv.split_once('=').expect("label");
                    (k.to_string(), v.trim_matches('"').to_string())
                })
                .collect();
            m.entry(name.to_string()).or_default().push((labels, value));
        }
        Scrape(m)
    }

    /// The value of `name` with exactly these labels (panics naming what
    /// is there otherwise).
    fn get(&self, name: &str, labels: &[(&str, &str)]) -> f64 {
        let want: BTreeMap<String, String> = labels
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect();
        let series = self
            .0
            .get(name)
            .unwrap_or_else(|| panic!("no metric {name}"));
        series
            .iter()
            .find(|(l, _)| *l == want)
            .map(|(_, v)| *v)
            .unwrap_or_else(|| panic!("no {name}{want:?}; have {series:?}"))
    }

    fn has(&self, name: &str) -> bool {
        self.0.contains_key(name)
    }
}

use common::number_stage as stage;

fn sample(chain: Vec<v1::StageSpec>, seed: u64) -> v1::SampleRequest {
    v1::SampleRequest {
        logits: logits(VOCAB, seed),
        params: Some(v1::SamplingParams {
            chain,
            ..Default::default()
        }),
        ..Default::default()
    }
}

const SAMPLE: &str = "samplerd.v1.Sampler/Sample";
const STREAM: &str = "samplerd.v1.Sampler/SampleStream";

#[tokio::test]
async fn scrape_counts_requests_streams_stages_and_plugin_errors() {
    let model = process::model_path();
    let model_toml = model
        .as_ref()
        .map(|m| format!("[model]\npath = {}\n", process::toml_path(m)))
        .unwrap_or_default();
    let p = process::start(&format!(
        "[plugins]\nfiles = [{}, {}]\n{model_toml}",
        process::toml_path(&core_plugin()),
        process::toml_path(&test_plugin())
    ));
    let ch = p.channel().await;
    let mut client = SamplerClient::new(ch.clone());
    let top_k_dist = || vec![stage("top_k", &[("k", 5.0)]), stage("dist", &[])];

    // 3 good Sample calls (top_k → dist), 1 invalid (empty logits), 1 that
    // fails in a plugin (test_nan writes NaN), 1 ListStages.
    for i in 0..3 {
        client
            .sample(sample(top_k_dist(), i))
            .await
            .expect("sample");
    }
    let bad = client
        .sample(v1::SampleRequest::default())
        .await
        .expect_err("empty logits");
    assert_eq!(bad.code(), Code::InvalidArgument);
    let nan = client
        .sample(sample(vec![stage("test_nan", &[]), stage("dist", &[])], 9))
        .await
        .expect_err("plugin writes NaN");
    assert_eq!(nan.code(), Code::Internal, "{nan:?}");
    client
        .list_stages(v1::ListStagesRequest {})
        .await
        .expect("list stages");

    // A SampleStream of 2 steps over the same chain, scraped while open.
    let step = |i: u64| v1::SampleStreamRequest {
        logits: logits(VOCAB, 100 + i),
        params: (i == 0).then(|| v1::SamplingParams {
            chain: top_k_dist(),
            ..Default::default()
        }),
        ..Default::default()
    };
    let (tx, mut responses, _) = open_stream(&mut client, step(0)).await;
    tx.send(step(1)).await.unwrap();
    next_message(&mut responses, RPC_TIMEOUT).await;
    let open = Scrape::parse(&p.scrape());
    assert_eq!(open.get("samplerd_active_streams", &[("rpc", STREAM)]), 1.0);
    drop(tx);
    assert_clean_end(&mut responses, RPC_TIMEOUT).await;

    let s = Scrape::parse(&p.scrape());
    let req = "samplerd_requests_total";
    assert_eq!(s.get(req, &[("rpc", SAMPLE), ("code", "OK")]), 3.0);
    assert_eq!(
        s.get(req, &[("rpc", SAMPLE), ("code", "INVALID_ARGUMENT")]),
        1.0
    );
    assert_eq!(s.get(req, &[("rpc", SAMPLE), ("code", "INTERNAL")]), 1.0);
    assert_eq!(s.get(req, &[("rpc", STREAM), ("code", "OK")]), 1.0);
    assert_eq!(
        s.get(
            req,
            &[("rpc", "samplerd.v1.Sampler/ListStages"), ("code", "OK")]
        ),
        1.0
    );
    let dur = "samplerd_request_duration_seconds";
    assert_eq!(s.get(&format!("{dur}_count"), &[("rpc", SAMPLE)]), 5.0);
    assert_eq!(s.get(&format!("{dur}_count"), &[("rpc", STREAM)]), 1.0);
    assert_eq!(
        s.get(&format!("{dur}_bucket"), &[("rpc", SAMPLE), ("le", "+Inf")]),
        5.0
    );
    assert!(s.get(&format!("{dur}_sum"), &[("rpc", SAMPLE)]) > 0.0);
    assert_eq!(s.get("samplerd_active_streams", &[("rpc", STREAM)]), 0.0);

    // Stage times: top_k and dist ran 3 (Sample) + 2 (stream steps) times
    // each; test_nan once, dist never after it.
    let stage_count = "samplerd_stage_duration_seconds_count";
    assert_eq!(s.get(stage_count, &[("stage", "top_k")]), 5.0);
    assert_eq!(s.get(stage_count, &[("stage", "test_nan")]), 1.0);
    assert_eq!(
        s.get("samplerd_plugin_errors_total", &[("stage", "test_nan")]),
        1.0
    );
    assert_eq!(s.get("samplerd_draining", &[]), 0.0);
    assert_eq!(s.get("samplerd_generate_queue_depth", &[]), 0.0);

    if model.is_some() {
        const MAX_TOKENS: u32 = 5;
        let mut events = client
            .generate(exact_generate("Hello", MAX_TOKENS))
            .await
            .expect("generate")
            .into_inner();
        tokio::time::timeout(RPC_TIMEOUT, async {
            while events.message().await.expect("event").is_some() {}
        })
        .await
        .expect("generation in time");
        let s = Scrape::parse(&p.scrape());
        assert_eq!(
            s.get("samplerd_generated_tokens_total", &[]),
            MAX_TOKENS as f64
        );
        assert!(s.get("samplerd_model_load_seconds", &[]) > 0.0);
        assert_eq!(
            s.get(
                req,
                &[("rpc", "samplerd.v1.Sampler/Generate"), ("code", "OK")]
            ),
            1.0
        );
        // A speculating Generate counts its drafts as its Usage does.
        let mut events = client
            .generate(samplerd_api::v1::GenerateRequest {
                speculation: Some(samplerd_api::v1::Speculation {
                    source: samplerd_api::v1::DraftSource::PromptLookup as i32,
                    max_draft_tokens: 4,
                }),
                ..exact_generate("a b c d e a b c d e a b c d e a b c d e a b", 12)
            })
            .await
            .expect("generate")
            .into_inner();
        let usage = tokio::time::timeout(RPC_TIMEOUT, async {
            let mut usage = None;
            while let Some(m) = events.message().await.expect("event") {
                if let Some(samplerd_api::v1::generate_response::Event::Finished(f)) = m.event {
                    usage = f.usage;
                }
            }
            usage.expect("a Finished with usage")
        })
        .await
        .expect("generation in time");
        assert!(usage.draft_tokens > 0, "{usage:?}");
        let s = Scrape::parse(&p.scrape());
        assert_eq!(
            s.get("samplerd_generate_draft_tokens_total", &[]),
            f64::from(usage.draft_tokens)
        );
        assert_eq!(
            s.get("samplerd_generate_accepted_draft_tokens_total", &[]),
            f64::from(usage.accepted_draft_tokens)
        );
        // Rounds held back by pacing: counted (how many depends on this
        // machine's timings).
        assert!(s.has("samplerd_generate_speculation_paused_rounds_total"));
        // Choices that skipped a losing draft model: counted likewise.
        assert!(s.has("samplerd_generate_speculation_skipped_total"));
    } else {
        eprintln!("SAMPLERD_MODEL is not set: Generate metrics not checked");
        assert!(!s.has("samplerd_model_load_seconds"));
    }
}

/// A request that retries a failed attempt (gRPC's retry sends
/// `grpc-previous-rpc-attempts`, gRFC A6) is counted as one, by RPC; a
/// first attempt is not.
#[tokio::test]
async fn retried_attempts_are_counted() {
    let p = process::start(&format!(
        "[plugins]\nfiles = [{}]\n",
        process::toml_path(&core_plugin())
    ));
    let mut client = SamplerClient::new(p.channel().await);
    let greedy = || sample(vec![stage("greedy", &[])], 1);
    client.sample(greedy()).await.expect("a first attempt");
    let mut retry = tonic::Request::new(greedy());
    retry
        .metadata_mut()
        .insert("grpc-previous-rpc-attempts", "1".parse().unwrap());
    client.sample(retry).await.expect("a retry");
    let s = Scrape::parse(&p.scrape());
    assert_eq!(
        s.get(
            "samplerd_retried_requests_total",
            &[("rpc", "samplerd.v1.Sampler/Sample")]
        ),
        1.0
    );
    assert_eq!(
        s.get(
            "samplerd_requests_total",
            &[("rpc", "samplerd.v1.Sampler/Sample"), ("code", "OK")]
        ),
        2.0
    );
}

#[tokio::test]
async fn metrics_can_be_disabled() {
    let p = process::start("[metrics]\nenabled = false\n");
    assert!(p.metrics.is_none());
    // Serving works without the endpoint.
    let ch = p.channel().await;
    SamplerClient::new(ch)
        .sample(sample(vec![stage("dist", &[])], 1))
        .await
        .expect("sample");
}

/// A client that resets its stream after the headers and part of a message
/// (grpc-js does when it fails to serialise one) is counted as CANCELLED
/// and as a client reset, never as a server INTERNAL.
#[tokio::test]
async fn a_client_reset_mid_request_is_cancelled_not_internal() {
    let p = process::start("");
    let addr = p.grpc;
    let tcp = tokio::net::TcpStream::connect(addr).await.unwrap();
    let (h2, conn) = h2::client::handshake(tcp).await.expect("h2 handshake");
    tokio::spawn(conn);
    let mut h2 = h2.ready().await.expect("h2 ready");
    let req = common::raw_grpc_request(addr, "/samplerd.v1.Sampler/Sample");
    let (_response, mut send) = h2.send_request(req, false).expect("send headers");
    // A 5-byte prefix announcing 1,000 bytes, then 10 of them.
    let mut part = vec![0u8];
    part.extend_from_slice(&1_000u32.to_be_bytes());
    part.extend_from_slice(&[0u8; 10]);
    send.send_data(part.into(), false).expect("send part");
    send.send_reset(h2::Reason::INTERNAL_ERROR);

    let req = "samplerd_requests_total";
    let resets = "samplerd_client_resets_total";
    let s = tokio::time::timeout(RPC_TIMEOUT, async {
        loop {
            let s = Scrape::parse(&p.scrape());
            if s.has(resets) {
                return s;
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    })
    .await
    .expect("the reset is counted");
    assert_eq!(s.get(resets, &[("rpc", SAMPLE)]), 1.0);
    assert_eq!(s.get(req, &[("rpc", SAMPLE), ("code", "CANCELLED")]), 1.0);
    let internal =
        s.0.get(req)
            .into_iter()
            .flatten()
            .filter(|(l, _)| l.get("code").is_some_and(|c| c == "INTERNAL"))
            .count();
    assert_eq!(internal, 0, "a client reset counted as INTERNAL");
    // The server still serves.
    SamplerClient::new(p.channel().await)
        .sample(sample(vec![stage("dist", &[])], 1))
        .await
        .expect("sample");
}

/// A request that does not decode is the client's fault: counted under the
/// INVALID_ARGUMENT it gets, never as a server INTERNAL.
#[tokio::test]
async fn a_malformed_request_counts_as_the_clients_error() {
    let p = process::start("");
    let path = "/samplerd.v1.Sampler/Sample";
    // Not protobuf; corrupt gzip.
    let bodies: [(&[u8], Option<&str>); 2] = [
        (b"\x00\x00\x00\x00\x02\x28\xff", None),
        (b"\x01\x00\x00\x00\x03abc", Some("gzip")),
    ];
    for (body, encoding) in bodies {
        let tcp = tokio::net::TcpStream::connect(p.grpc).await.unwrap();
        let (h2, conn) = h2::client::handshake(tcp).await.expect("h2 handshake");
        tokio::spawn(conn);
        let mut h2 = h2.ready().await.expect("h2 ready");
        let mut req = common::raw_grpc_request(p.grpc, path);
        if let Some(e) = encoding {
            req.headers_mut()
                .insert("grpc-encoding", e.parse().unwrap());
        }
        let (response, mut send) = h2.send_request(req, false).expect("send headers");
        send.send_data(body.to_vec().into(), true)
            .expect("send body");
        let resp = tokio::time::timeout(RPC_TIMEOUT, response)
            .await
            .expect("answered in time")
            .expect("a response");
        assert_eq!(
            resp.headers().get("grpc-status").map(|v| v.as_bytes()),
            Some(&b"3"[..]),
            "{resp:?}"
        );
    }
    let s = Scrape::parse(&p.scrape());
    let req = "samplerd_requests_total";
    assert_eq!(
        s.get(req, &[("rpc", SAMPLE), ("code", "INVALID_ARGUMENT")]),
        2.0
    );
    let internal =
        s.0.get(req)
            .into_iter()
            .flatten()
            .filter(|(l, _)| l.get("code").is_some_and(|c| c == "INTERNAL"))
            .count();
    assert_eq!(internal, 0, "a malformed request counted as INTERNAL");
}
