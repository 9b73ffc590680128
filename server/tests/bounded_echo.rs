//! A client value the server echoes — in an error's message and details —
//! is bounded, however long the client made it: each echo site quotes at
//! most `echo::MAX_ECHO_BYTES` of the value and states its full length,
//! every detail field stays as short, and `grpc-message` with
//! `grpc-status-details-bin` stays under `status::MAX_TRAILER_BYTES`. One
//! case per echo site, through a real server and tonic's client (raw
//! HTTP/2 for the headers tonic's client will not send), then the attack
//! itself: a 60 MB name sent gzip-compressed to the real binary, whose
//! resident memory is watched.

mod common;
mod process;

use std::sync::Arc;

use common::raw::{framed, raw_outcome_with};
use common::*;
use samplerd::generate::generator::{GenerateJob, GenerateSink, Generator};
use samplerd::status::{MAX_TRAILER_BYTES, trailer_bytes};
use samplerd_api::v1;
use samplerd_api::v1::param_value::Kind;
use samplerd_sampling::echo::{MAX_ECHO_BYTES, MAX_FOREIGN_BYTES};
use tonic_types::StatusExt;

const VOCAB: usize = 64;
/// How long each echoed value is: far past every bound.
const LONG: usize = 1_000_000;

/// The value every case sends: `LONG` bytes of one letter no server text
/// holds in a row.
fn long() -> String {
    "q".repeat(LONG)
}

/// The longest run of `q` in `s`: how much of the value `s` echoes.
fn echoed(s: &str) -> usize {
    s.split(|c| c != 'q').map(str::len).max().unwrap_or(0)
}

/// Every text of `err` a client reads: the message and each detail's
/// strings.
fn texts(err: &tonic::Status) -> Vec<(String, String)> {
    let d = err.get_error_details();
    let mut out = vec![("message".to_string(), err.message().to_string())];
    if let Some(info) = d.error_info() {
        for (k, v) in &info.metadata {
            out.push((format!("ErrorInfo.metadata[{k}]"), v.clone()));
        }
    }
    if let Some(b) = d.bad_request() {
        for v in &b.field_violations {
            out.push(("BadRequest.field".into(), v.field.clone()));
            out.push(("BadRequest.description".into(), v.description.clone()));
        }
    }
    if let Some(r) = d.resource_info() {
        out.push(("ResourceInfo.resource_name".into(), r.resource_name.clone()));
    }
    out
}

/// What is wrong with `err` as the answer at site `what`, if anything: it
/// must have `reason`, quote at most `max` bytes of the value in every
/// text (and, when `states_length`, give its full length in the message),
/// and fit the trailer cap.
fn unbounded(
    what: &str,
    err: &tonic::Status,
    reason: Reason,
    max: usize,
    states_length: bool,
) -> Vec<String> {
    let mut wrong = Vec::new();
    let got = reason_of(err);
    if got != reason {
        wrong.push(format!("{what}: reason {got:?}, want {reason:?}"));
    }
    for (name, text) in texts(err) {
        if echoed(&text) > max {
            wrong.push(format!(
                "{what}: {name} echoes {} bytes of the value",
                echoed(&text)
            ));
        }
    }
    if states_length && !err.message().contains(&format!("({LONG} bytes)")) {
        let m = err.message();
        wrong.push(format!(
            "{what}: the message does not state the length: {}",
            &m[..m.len().min(300)]
        ));
    }
    let sent = trailer_bytes(err);
    if sent > MAX_TRAILER_BYTES {
        wrong.push(format!("{what}: {sent} bytes of status"));
    }
    wrong
}

/// A model host that is ready and never asked to generate (every request
/// here is refused by validation).
struct Ready;

impl Generator for Ready {
    fn ready(&self) -> bool {
        true
    }

    fn generate(&self, _job: GenerateJob, _sink: GenerateSink) {
        unreachable!("every Generate here is invalid")
    }
}

fn sample(params: v1::SamplingParams) -> v1::SampleRequest {
    v1::SampleRequest {
        logits: logits(VOCAB, 3),
        params: Some(params),
        ..Default::default()
    }
}

fn chain(stages: Vec<v1::StageSpec>) -> v1::SamplingParams {
    v1::SamplingParams {
        chain: stages,
        ..Default::default()
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_echo_site_quotes_a_bounded_value() {
    let dir = tempfile::tempdir().unwrap();
    let vocab_path = plain_tokenizer_json(dir.path(), VOCAB);
    let mut config = test_config();
    config.plugins.files.push(constraint_plugin());
    config.vocabularies.insert("plain".into(), vocab_path);
    let s = start_serving(config, Some(Arc::new(Ready))).await;
    let q = long();
    // Every site is checked, and every one that fails is reported.
    let mut wrong = Vec::new();
    let greedy = || number_stage("greedy", &[]);
    let text = |k: &str, v: &str| stage_spec("top_k", [(k, Kind::Text(v.into()))]);
    // (site, request, reason)
    let samples: Vec<(&str, v1::SampleRequest, Reason)> = vec![
        (
            "params.vocabulary",
            sample(v1::SamplingParams {
                vocabulary: q.clone(),
                ..Default::default()
            }),
            Reason::UnknownVocabulary,
        ),
        (
            "a stage name in params.chain",
            sample(chain(vec![number_stage(&q, &[]), greedy()])),
            Reason::UnknownStage,
        ),
        (
            "a params.samplers entry",
            sample(v1::SamplingParams {
                samplers: vec![q.clone()],
                ..Default::default()
            }),
            Reason::UnknownStage,
        ),
        (
            "a chain parameter name",
            sample(chain(vec![number_stage("top_k", &[(&q, 1.0)]), greedy()])),
            Reason::InvalidField,
        ),
        (
            "a chain parameter's text value",
            sample(chain(vec![text("k", &q), greedy()])),
            Reason::InvalidField,
        ),
        (
            "a chain parameter name in the field path (no value)",
            sample(chain(vec![
                v1::StageSpec {
                    name: "top_k".into(),
                    params: [(q.clone(), v1::ParamValue { kind: None })].into(),
                },
                greedy(),
            ])),
            Reason::InvalidField,
        ),
        (
            "a token map's parameter name in the field path",
            sample(chain(vec![
                stage_spec(
                    "logit_bias",
                    [(
                        q.as_str(),
                        Kind::TokenMap(v1::TokenValueList {
                            entries: vec![v1::TokenValue {
                                token_id: VOCAB as u32,
                                value: 1.0,
                            }],
                        }),
                    )],
                ),
                greedy(),
            ])),
            Reason::InvalidField,
        ),
    ];
    for (what, req, reason) in samples {
        let err = s.sample_err(req).await;
        wrong.extend(unbounded(what, &err, reason, MAX_ECHO_BYTES, true));
    }

    // A batch row: the same sites under `rows[i].`.
    let err = s
        .client
        .clone()
        .sample_batch(v1::SampleBatchRequest {
            rows: vec![v1::BatchRow {
                logits: to_bytes(&logits(VOCAB, 1)).into(),
                params: Some(v1::SamplingParams {
                    vocabulary: q.clone(),
                    ..Default::default()
                }),
                ..Default::default()
            }],
            ..Default::default()
        })
        .await
        .expect_err("unknown vocabulary");
    wrong.extend(unbounded(
        "a batch row",
        &err,
        Reason::UnknownVocabulary,
        MAX_ECHO_BYTES,
        true,
    ));

    // Generate's own fields.
    let generates: Vec<(&str, v1::GenerateRequest)> = vec![
        (
            "Generate's params.vocabulary",
            v1::GenerateRequest {
                prompt: "hi".into(),
                params: Some(v1::SamplingParams {
                    vocabulary: q.clone(),
                    ..Default::default()
                }),
                ..Default::default()
            },
        ),
        (
            "a chat role",
            v1::GenerateRequest {
                messages: vec![v1::ChatMessage {
                    role: q.clone(),
                    content: "hi".into(),
                }],
                ..Default::default()
            },
        ),
    ];
    for (what, req) in generates {
        let err = s.client.clone().generate(req).await.expect_err(what);
        wrong.extend(unbounded(
            what,
            &err,
            Reason::InvalidField,
            MAX_ECHO_BYTES,
            true,
        ));
    }

    // A stage's own message, passed through from the plugin ABI (the
    // grammar does not compile): the ABI's bound, not a whole grammar.
    let err = s
        .sample_err(sample(v1::SamplingParams {
            vocabulary: "plain".into(),
            constraint: Some(v1::Constraint {
                kind: Some(v1::constraint::Kind::Regex(format!("({}", &q[..100_000]))),
                ..Default::default()
            }),
            ..Default::default()
        }))
        .await;
    wrong.extend(unbounded(
        "a stage's message",
        &err,
        Reason::InvalidConstraint,
        MAX_FOREIGN_BYTES,
        false,
    ));
    assert!(wrong.is_empty(), "{}", wrong.join("\n"));
    s.assert_serving().await;
    s.stop().await;
}

/// The statuses tonic writes itself: an unknown method names the path it
/// was sent to, an unsupported encoding the encoding the client named —
/// both bounded as sent.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn transport_refusals_quote_a_bounded_value() {
    let s = start().await;
    let one = framed(&v1::SampleRequest {
        logits: logits(VOCAB, 1),
        ..Default::default()
    });
    // HTTP/2 header lists are bounded (16 KiB by default), so these are
    // 8,000 bytes rather than a megabyte.
    let q = "q".repeat(8_000);
    let path = format!("/samplerd.v1.Sampler/{q}");
    struct Case<'a> {
        what: &'a str,
        path: String,
        headers: Vec<(&'a str, &'a str)>,
        reason: Reason,
        /// The echoed value's length.
        len: usize,
    }
    let cases = [
        Case {
            what: "an unknown method",
            path: path.clone(),
            headers: vec![],
            reason: Reason::UnknownMethod,
            len: path.len(),
        },
        Case {
            what: "an unsupported encoding",
            path: "/samplerd.v1.Sampler/Sample".into(),
            headers: vec![("grpc-encoding", q.as_str())],
            reason: Reason::UnsupportedEncoding,
            len: q.len(),
        },
    ];
    for Case {
        what,
        path,
        headers,
        reason,
        len,
    } in cases
    {
        let out = raw_outcome_with(
            s.addr(),
            "POST",
            Some("application/grpc"),
            &path,
            &headers,
            vec![one.clone()],
        )
        .await;
        let status = out.status.unwrap_or_else(|| panic!("{what}: no status"));
        assert_reason(&status, reason);
        for (name, text) in texts(&status) {
            assert!(echoed(&text) <= MAX_ECHO_BYTES, "{what}: {name}: {text}");
        }
        assert!(
            status.message().contains(&format!("({len} bytes)")),
            "{what}: {}",
            status.message()
        );
        assert!(
            out.status_bytes <= MAX_TRAILER_BYTES,
            "{what}: {} bytes",
            out.status_bytes
        );
    }
    s.assert_serving().await;
    s.stop().await;
}

/// The attack as it was reported: a 60 MB `params.vocabulary` sent gzip
/// (58 KB on the wire) to the real binary. Before, the status echoed the
/// name about four times — 229 MB of trailers no client could read — and
/// the server grew by 750 MB to build them. Now the status is a few hundred
/// bytes and the server holds little more than the decoded request.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_60_mb_name_sent_gzip_gets_a_small_status_and_costs_little_memory() {
    const NAME: usize = 60_000_000;
    let p = process::start("");
    let channel = p.channel().await;
    let mut client = samplerd_api::v1::sampler_client::SamplerClient::new(channel)
        .send_compressed(tonic::codec::CompressionEncoding::Gzip)
        .max_encoding_message_size(CLIENT_MAX_MESSAGE);
    let before = peak_rss_bytes(p.child.id());
    let err = client
        .sample(v1::SampleRequest {
            logits: vec![1.0, 2.0],
            params: Some(v1::SamplingParams {
                vocabulary: "v".repeat(NAME),
                ..Default::default()
            }),
            ..Default::default()
        })
        .await
        .expect_err("no such vocabulary");
    let grown = peak_rss_bytes(p.child.id()).saturating_sub(before);
    assert_reason(&err, Reason::UnknownVocabulary);
    assert!(
        err.message().contains(&format!("({NAME} bytes)")),
        "{}",
        err.message()
    );
    let sent = trailer_bytes(&err);
    assert!(sent <= MAX_TRAILER_BYTES, "{sent} bytes of status");
    // The request itself, decompressed (60 MB) and decoded into its
    // string (60 MB more), is what any request this large costs; the error
    // adds next to nothing. Measured: about 130 MB in all.
    let limit = 3 * NAME as u64;
    assert!(
        grown <= limit,
        "the server's peak resident memory grew by {} MB (limit {} MB)",
        grown >> 20,
        limit >> 20
    );
    eprintln!(
        "status {sent} bytes; peak resident memory +{} MB",
        grown >> 20
    );
}

/// A process's peak resident set size (`VmHWM`), in bytes.
fn peak_rss_bytes(pid: u32) -> u64 {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).expect("/proc status");
    let kb: u64 = status
        .lines()
        .find_map(|l| l.strip_prefix("VmHWM:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
        .expect("VmHWM");
    kb * 1024
}
