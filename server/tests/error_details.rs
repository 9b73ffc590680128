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
                }),
                vocabulary: "plain".into(),
                ..Default::default()
            })),
            Reason::InvalidConstraint,
            "params.constraint",
            None,
            "regex",
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
