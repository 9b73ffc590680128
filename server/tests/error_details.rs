//! Rich error details: every refusal a request can provoke in-process
//! carries its `ErrorInfo` reason (domain `samplerd.v1`) and the details
//! that go with it — a `BadRequest` naming the field path, the limit's
//! config key, a `ResourceInfo` for what was not found, a `RetryInfo` on
//! refusals that free up by themselves — while the human message stays
//! as it was. (Reasons that need a stuck stage, a drain or a token file
//! are asserted where those are set up: stuck_stage.rs, shutdown.rs,
//! security.rs, framing.rs, budgets.rs.)

mod common;

use std::sync::Arc;
use std::time::Duration;

use common::*;
use samplerd::generate::generator::{GenerateJob, GenerateSink, Generator};
use samplerd::status::RETRY_AFTER;
use samplerd_api::v1;
use tonic::Code;

const VOCAB: usize = 64;

fn req(params: Option<v1::SamplingParams>) -> v1::SampleRequest {
    v1::SampleRequest {
        logits: logits(VOCAB, 3),
        params,
        ..Default::default()
    }
}

fn params(p: v1::SamplingParams) -> Option<v1::SamplingParams> {
    Some(p)
}

/// The one field violation of `d`, as (field, description).
fn violation(d: &tonic_types::ErrorDetails) -> (String, String) {
    let v = &d.bad_request().expect("BadRequest").field_violations;
    assert_eq!(v.len(), 1, "{v:?}");
    (v[0].field.clone(), v[0].description.clone())
}

fn limit(d: &tonic_types::ErrorDetails) -> Option<String> {
    d.error_info()?.metadata.get("limit").cloned()
}

#[tokio::test]
async fn invalid_requests_name_their_field_and_reason() {
    let dir = tempfile::tempdir().unwrap();
    let vocab_path = plain_tokenizer_json(dir.path(), VOCAB);
    let mut s = start_tuned(|c| {
        c.plugins.files.push(constraint_plugin());
        c.vocabularies.insert("plain".into(), vocab_path.clone());
    })
    .await;
    // (request, reason, field path, limit key, text the message keeps)
    let cases: Vec<(v1::SampleRequest, Reason, &str, Option<&str>, &str)> = vec![
        (
            v1::SampleRequest {
                logits: vec![0.5; 4],
                logits_f32le: vec![0; 16].into(),
                ..Default::default()
            },
            Reason::InvalidField,
            "logits/logits_f32le",
            None,
            "set exactly one",
        ),
        (
            req(params(v1::SamplingParams {
                top_p: Some(1.5),
                ..Default::default()
            })),
            Reason::ParamOutOfRange,
            "params.top_p",
            None,
            "1.5",
        ),
        (
            v1::SampleRequest {
                n_probs: 100_000,
                ..req(None)
            },
            Reason::LimitExceeded,
            "n_probs",
            Some("limits.max_n_probs"),
            "100000",
        ),
        (
            v1::SampleRequest {
                logits_f32le: vec![0; 5].into(),
                ..Default::default()
            },
            Reason::InvalidLogits,
            "logits_f32le",
            None,
            "multiple of 4",
        ),
        (
            v1::SampleRequest {
                logits: vec![0.0, f32::NAN, 1.0],
                ..Default::default()
            },
            Reason::InvalidLogits,
            "logits",
            None,
            "logits[1] is NaN",
        ),
        (
            v1::SampleRequest {
                logits: vec![f32::NEG_INFINITY; 8],
                ..Default::default()
            },
            Reason::AllTokensMasked,
            "logits",
            None,
            "all logits are -inf",
        ),
        (
            req(params(v1::SamplingParams {
                logit_bias: (0..VOCAB as u32).map(|t| (t, f32::NEG_INFINITY)).collect(),
                ..Default::default()
            })),
            Reason::AllTokensMasked,
            "params",
            None,
            "every token is masked",
        ),
        (
            req(params(v1::SamplingParams {
                chain: vec![
                    number_stage("no_such_stage", &[]),
                    number_stage("greedy", &[]),
                ],
                ..Default::default()
            })),
            Reason::UnknownStage,
            "params.chain",
            None,
            "no_such_stage",
        ),
        (
            req(params(v1::SamplingParams {
                vocabulary: "no_such_vocabulary".into(),
                ..Default::default()
            })),
            Reason::UnknownVocabulary,
            "params.vocabulary",
            None,
            "no_such_vocabulary",
        ),
        (
            req(params(v1::SamplingParams {
                constraint: Some(v1::Constraint {
                    kind: Some(v1::constraint::Kind::Regex("(unclosed".into())),
                    ..Default::default()
                }),
                vocabulary: "plain".into(),
                ..Default::default()
            })),
            Reason::InvalidConstraint,
            "params.constraint",
            None,
            "regex",
        ),
        (
            // A Constraint with no kind set in its oneof.
            req(params(v1::SamplingParams {
                constraint: Some(v1::Constraint {
                    kind: None,
                    ..Default::default()
                }),
                ..Default::default()
            })),
            Reason::InvalidField,
            "params.constraint",
            None,
            "has no kind",
        ),
    ];
    for (request, reason, field, key, keeps) in cases {
        let err = s.client.sample(request).await.expect_err(field);
        let d = assert_reason(&err, reason);
        assert!(err.message().contains(keeps), "{err:?} lost {keeps:?}");
        let (got_field, description) = violation(&d);
        assert!(
            got_field.starts_with(field),
            "{reason:?}: field {got_field:?}, want {field:?}"
        );
        // The description is the message without its field prefix.
        assert_eq!(
            err.message(),
            format!("{got_field}: {description}"),
            "{reason:?}"
        );
        assert_eq!(limit(&d).as_deref(), key, "{reason:?}");
        assert!(d.retry_info().is_none(), "{reason:?} is not retryable");
        match reason {
            Reason::UnknownStage | Reason::UnknownVocabulary => {
                let r = d.resource_info().expect("ResourceInfo");
                assert!(err.message().contains(&r.resource_name), "{r:?}");
                assert!(r.resource_type.starts_with("samplerd.v1."), "{r:?}");
            }
            _ => assert!(d.resource_info().is_none(), "{reason:?}"),
        }
    }
    s.assert_serving().await;
    s.stop().await;
}

#[tokio::test]
async fn a_failing_stage_is_named_in_the_details() {
    let mut s = start_tuned(|c| c.plugins.files.push(test_plugin())).await;
    let err = s
        .client
        .sample(req(params(v1::SamplingParams {
            chain: vec![number_stage("test_nan", &[]), number_stage("greedy", &[])],
            ..Default::default()
        })))
        .await
        .expect_err("a stage that writes NaN fails the step");
    let d = assert_reason(&err, Reason::StageFailed);
    assert_eq!(d.error_info().unwrap().metadata["stage"], "test_nan");
    assert!(d.bad_request().is_none(), "not the request's fault");
    s.stop().await;
}

#[tokio::test]
async fn admission_refusals_are_retryable_and_name_their_limit() {
    let s = start_tuned(|c| c.limits.max_concurrent_streams = 1).await;
    let first = || v1::SampleStreamRequest {
        logits: logits(VOCAB, 1),
        ..Default::default()
    };
    let mut client = s.client.clone();
    let held = open_stream(&mut client, first()).await;
    let (_tx, requests) = held_requests(first()).await;
    let err = match client.sample_stream(requests).await {
        Err(e) => e,
        Ok(resp) => resp
            .into_inner()
            .message()
            .await
            .expect_err("the second stream is refused"),
    };
    let d = assert_reason(&err, Reason::Overloaded);
    assert_eq!(limit(&d).as_deref(), Some("limits.max_concurrent_streams"));
    assert_eq!(
        d.retry_info().and_then(|r| r.retry_delay),
        Some(RETRY_AFTER)
    );
    drop(held);
    wait_sessions_closed(&s).await;

    // Over the message size limit.
    s.stop().await;
    let mut s = start_tuned(|c| c.limits.max_message_bytes = 4 * 1024).await;
    let err = s
        .client
        .sample(v1::SampleRequest {
            logits_f32le: to_bytes(&logits(4_000, 2)).into(),
            ..Default::default()
        })
        .await
        .expect_err("over limits.max_message_bytes");
    let d = assert_reason(&err, Reason::MessageTooLarge);
    assert_eq!(limit(&d).as_deref(), Some("limits.max_message_bytes"));
    assert!(d.retry_info().is_none(), "the same message never fits");
    s.stop().await;
}

/// A model host that never finishes loading.
struct Loading;

impl Generator for Loading {
    fn ready(&self) -> bool {
        false
    }

    fn generate(&self, _job: GenerateJob, _sink: GenerateSink) {
        unreachable!("Generate is refused before the model is ready")
    }
}

#[tokio::test]
async fn generate_without_a_ready_model() {
    let generate = || v1::GenerateRequest {
        prompt: "hi".into(),
        ..Default::default()
    };
    let s = start().await;
    let err = s
        .client
        .clone()
        .generate(generate())
        .await
        .expect_err("no model");
    assert_reason(&err, Reason::NoModel);
    s.stop().await;

    let server = samplerd::app::server::spawn(test_config(), Some(Arc::new(Loading)))
        .await
        .expect("server starts");
    let mut client =
        samplerd_api::v1::sampler_client::SamplerClient::new(connect(server.addr).await);
    let err = client
        .generate(generate())
        .await
        .expect_err("still loading");
    let d = assert_reason(&err, Reason::ModelLoading);
    assert_eq!(
        d.retry_info().and_then(|r| r.retry_delay),
        Some(RETRY_AFTER)
    );
    server.stop().await.expect("clean stop");
}

#[tokio::test]
async fn the_deadline_the_client_sets_is_the_servers_to_enforce() {
    let mut s = start().await;
    // A stream whose first message never comes, under a 200 ms
    // grpc-timeout the server enforces (tonic's client leaves it to the
    // server unless told otherwise).
    let (_tx, rx) = tokio::sync::mpsc::channel::<v1::SampleStreamRequest>(1);
    let requests = tokio_stream::wrappers::ReceiverStream::new(rx);
    let mut request = tonic::Request::new(requests);
    request
        .metadata_mut()
        .insert("grpc-timeout", "200m".parse().unwrap());
    let outcome = tokio::time::timeout(Duration::from_secs(10), async {
        match s.client.sample_stream(request).await {
            Err(e) => e,
            Ok(resp) => resp.into_inner().message().await.expect_err("deadline"),
        }
    })
    .await
    .expect("the server ends the call");
    assert_eq!(outcome.code(), Code::DeadlineExceeded, "{outcome:?}");
    assert_reason(&outcome, Reason::DeadlineExceeded);
    s.stop().await;
}

/// A gRPC message of `payload` with the compressed flag `flag`.
fn message_bytes(flag: u8, payload: &[u8]) -> Vec<u8> {
    let mut out = vec![flag];
    out.extend((payload.len() as u32).to_be_bytes());
    out.extend(payload);
    out
}

/// The refusals tonic writes itself — a message that does not decode, a
/// corrupt or unsupported compression, a message over the limit once
/// decompressed, a method nobody serves — carry samplerd's details like
/// every other error, whether the call is unary (a trailers-only answer)
/// or a stream (the status in the trailers after responses).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tonics_own_refusals_carry_details() {
    use common::raw::{framed, raw_outcome_with};
    let s = start_tuned(|c| c.limits.max_message_bytes = 64 * 1024).await;
    let sample = "/samplerd.v1.Sampler/Sample";
    let gzip = [("grpc-encoding", "gzip")];
    struct Case<'a> {
        what: &'a str,
        path: &'a str,
        headers: &'a [(&'a str, &'a str)],
        body: Vec<Vec<u8>>,
        reason: Reason,
    }
    let cases = [
        Case {
            what: "not protobuf",
            path: sample,
            headers: &[],
            body: vec![message_bytes(0, b"\x28\xff")],
            reason: Reason::MalformedMessage,
        },
        Case {
            what: "corrupt gzip",
            path: sample,
            headers: &gzip,
            body: vec![message_bytes(1, b"not gzip at all")],
            reason: Reason::MalformedMessage,
        },
        Case {
            what: "compressed flag without an encoding",
            path: sample,
            headers: &[],
            body: vec![message_bytes(1, b"\x08\x01")],
            reason: Reason::MalformedMessage,
        },
        Case {
            what: "a message cut short",
            path: "/samplerd.v1.Sampler/SampleStream",
            headers: &[],
            body: vec![message_bytes(0, &[0; 100])[..50].to_vec()],
            reason: Reason::MalformedMessage,
        },
        Case {
            what: "an unsupported encoding",
            path: sample,
            headers: &[("grpc-encoding", "br")],
            body: vec![message_bytes(1, b"\x08\x01")],
            reason: Reason::UnsupportedEncoding,
        },
        Case {
            what: "an unknown method",
            path: "/samplerd.v1.Sampler/Nope",
            headers: &[],
            body: vec![message_bytes(0, b"")],
            reason: Reason::UnknownMethod,
        },
        Case {
            what: "an unknown service",
            path: "/no.such.Service/Method",
            headers: &[],
            body: vec![message_bytes(0, b"")],
            reason: Reason::UnknownMethod,
        },
    ];
    for Case {
        what,
        path,
        headers,
        body,
        reason,
    } in cases
    {
        let out = raw_outcome_with(
            s.addr(),
            "POST",
            Some("application/grpc"),
            path,
            headers,
            body,
        )
        .await;
        let status = out.status.unwrap_or_else(|| panic!("{what}: no status"));
        assert_reason(&status, reason);
        if reason == Reason::UnsupportedEncoding {
            // What it accepts, as gRPC asks.
            let accepted = out.accept_encoding.expect("grpc-accept-encoding");
            assert!(accepted.contains("gzip"), "{accepted}");
        }
    }

    // A stream whose second message does not decode: the status comes in
    // the trailers, after the first answer.
    let first = framed(&v1::SampleStreamRequest {
        logits: logits(VOCAB, 1),
        ..Default::default()
    });
    let out = raw_outcome_with(
        s.addr(),
        "POST",
        Some("application/grpc"),
        "/samplerd.v1.Sampler/SampleStream",
        &[],
        vec![first, message_bytes(0, b"\x28\xff")],
    )
    .await;
    assert!(!out.body.is_empty(), "the first message is answered");
    assert_reason(&out.status.expect("a status"), Reason::MalformedMessage);

    // Over limits.max_message_bytes once decompressed: 256 KiB of zeros
    // are a few hundred bytes of gzip.
    let err = s
        .client
        .clone()
        .send_compressed(tonic::codec::CompressionEncoding::Gzip)
        .sample(v1::SampleRequest {
            logits_f32le: vec![0; 256 * 1024].into(),
            ..Default::default()
        })
        .await
        .expect_err("too large once decompressed");
    let d = assert_reason(&err, Reason::MessageTooLarge);
    assert_eq!(limit(&d).as_deref(), Some("limits.max_message_bytes"));
    s.assert_serving().await;
    s.stop().await;
}

/// A stage that needs a vocabulary, asked for in a Sample that names none
/// (on a server that has vocabularies, and may have a model): the message
/// says the fix — `params.vocabulary` — not that no model is loaded.
#[tokio::test]
async fn a_stage_without_its_vocabulary_names_params_vocabulary() {
    let dir = tempfile::tempdir().unwrap();
    let vocab_path = plain_tokenizer_json(dir.path(), VOCAB);
    let s = start_tuned(|c| {
        c.plugins.files.push(constraint_plugin());
        c.vocabularies.insert("plain".into(), vocab_path.clone());
    })
    .await;
    let regex = || {
        Some(v1::Constraint {
            kind: Some(v1::constraint::Kind::Regex("t1".into())),
            ..Default::default()
        })
    };
    // (case, params, field, reason)
    let cases: Vec<(&str, v1::SamplingParams, &str, Reason)> = vec![
        (
            "params.constraint",
            v1::SamplingParams {
                constraint: regex(),
                ..Default::default()
            },
            "params.vocabulary",
            Reason::InvalidField,
        ),
        (
            "the constraint stage in params.chain",
            v1::SamplingParams {
                chain: vec![
                    text_stage("constraint", &[("regex", "t1")]),
                    number_stage("greedy", &[]),
                ],
                ..Default::default()
            },
            "params.vocabulary",
            Reason::InvalidField,
        ),
        (
            "DRY with its breakers",
            v1::SamplingParams {
                dry_multiplier: Some(0.8),
                ..Default::default()
            },
            "params.dry_sequence_breakers",
            Reason::ParamOutOfRange,
        ),
    ];
    for (what, p, field, reason) in cases {
        let err = s.sample_err(req(params(p))).await;
        let d = assert_reason(&err, reason);
        assert!(
            err.message().contains("params.vocabulary"),
            "{what}: {err:?}"
        );
        assert!(!err.message().contains("no model"), "{what}: {err:?}");
        assert_eq!(violation(&d).0, field, "{what}");
    }
    // And named, it works.
    s.sample_ok(req(params(v1::SamplingParams {
        constraint: regex(),
        vocabulary: "plain".into(),
        ..Default::default()
    })))
    .await;
    s.stop().await;
}

/// An integer field is echoed as the integer it was, not through an f32
/// (`i32::MIN` is exactly an f32, which prints as -2147483600).
#[tokio::test]
async fn integer_fields_are_echoed_as_integers() {
    let s = start().await;
    let cases = [
        (
            v1::SamplingParams {
                top_k: Some(i32::MIN),
                ..Default::default()
            },
            "params.top_k",
        ),
        (
            v1::SamplingParams {
                repeat_last_n: Some(i32::MIN),
                ..Default::default()
            },
            "params.repeat_last_n",
        ),
        (
            v1::SamplingParams {
                dry_multiplier: Some(0.5),
                dry_sequence_breakers: vec![String::new()],
                dry_penalty_last_n: Some(i32::MIN),
                ..Default::default()
            },
            "params.dry_penalty_last_n",
        ),
    ];
    for (p, field) in cases {
        let err = s.sample_err(req(params(p))).await;
        let d = assert_reason(&err, Reason::ParamOutOfRange);
        assert_eq!(violation(&d).0, field);
        assert!(
            err.message().ends_with("got -2147483648"),
            "{field}: {}",
            err.message()
        );
    }
    s.stop().await;
}
