//! Plugins that break the contract without crashing: stages that lie in
//! the token buffer (the `lying_stage.c` fixture) fail their request with
//! INTERNAL naming the stage and what it did, and the server keeps
//! serving; libraries with malformed descriptors (`bad_descriptor.c`) are
//! refused at load with an error naming the file, never read. Every wait
//! is bounded.

mod common;

use std::time::Duration;

use common::*;
use samplerd_api::v1;
use samplerd_sampling::{LoadError, StageRegistry};
use tonic::Code;

/// Bound on each request.
const WAIT: Duration = Duration::from_secs(30);
const VOCAB: usize = 500;

fn lie(how: &str) -> v1::StageSpec {
    text_stage("test_lie", &[("lie", how)])
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn lying_stages_fail_their_request_naming_the_stage() {
    let dir = tempfile::tempdir().unwrap();
    let fixture = build_fixture_plugin("lying_stage.c", dir.path());
    let s = start_tuned(|c| c.plugins.files.push(fixture)).await;
    let top_k = || number_stage("top_k", &[("k", 20.0)]);
    // (chain, what the message must say): dense lies run on the dense
    // view, candidate lies after top_k.
    let last = format!("left logit inf for token {} in the dense view", VOCAB - 1);
    let cases: Vec<(Vec<v1::StageSpec>, &str)> = vec![
        (
            vec![lie("dense_nan")],
            "left logit NaN for token 0 in the dense view",
        ),
        (vec![lie("dense_inf")], &last),
        (vec![top_k(), lie("cand_inf")], "with logit inf"),
        (vec![top_k(), lie("duplicate")], "twice in the candidates"),
        (
            vec![top_k(), lie("unsorted")],
            "set sorted = 1, but candidate #1",
        ),
        (
            vec![lie("dense_pointer")],
            "overwrote the host's sd_tokens.dense",
        ),
        (
            vec![top_k(), lie("cand_pointer")],
            "overwrote the host's sd_tokens.cand",
        ),
        (
            vec![lie("n_vocab")],
            "overwrote the host's sd_tokens.n_vocab",
        ),
    ];
    for (mut chain, want) in cases {
        chain.push(number_stage("dist", &[]));
        let req = v1::SampleRequest {
            logits: logits(VOCAB, 3),
            params: Some(v1::SamplingParams {
                chain,
                ..Default::default()
            }),
            ..Default::default()
        };
        let e = tokio::time::timeout(WAIT, s.client.clone().sample(req))
            .await
            .expect("answers in time")
            .expect_err("a lying stage fails the request");
        assert_status(&e, Code::Internal, &["stage `test_lie` misbehaved", want]);
    }
    // A truthful run of the same stage, and the server, are fine.
    let ok = s
        .sample_ok(v1::SampleRequest {
            logits: logits(VOCAB, 3),
            params: Some(v1::SamplingParams {
                chain: vec![lie("none"), number_stage("greedy", &[])],
                ..Default::default()
            }),
            ..Default::default()
        })
        .await;
    assert_eq!(ok.token_id, argmax(&logits(VOCAB, 3)));
    s.assert_serving().await;
    s.stop().await;
}

#[test]
fn malformed_descriptors_are_refused_naming_the_file() {
    let dir = tempfile::tempdir().unwrap();
    let good = build_fixture_plugin_with("bad_descriptor.c", dir.path(), "good_descriptor", &[]);
    let reg = StageRegistry::load(&[], &[good]).expect("the valid variant loads");
    assert!(reg.get("test_descriptor").is_some());
    for (define, want) in [
        (
            "BAD_HUGE_N_STAGES",
            "n_stages is 1099511627776, more than the 4096",
        ),
        ("BAD_NULL_STAGES", "n_stages is 1 but stages is 0x0"),
        ("BAD_NULL_STAGE", "stage #1: stage pointer 0x0 is NULL"),
        (
            "BAD_HUGE_PARAMS",
            "n_params_spec is 1099511627776, more than 4096",
        ),
        (
            "BAD_NULL_PARAMS",
            "n_params_spec is 1 but params_spec is 0x0",
        ),
    ] {
        let lib = define.to_ascii_lowercase();
        let path = build_fixture_plugin_with("bad_descriptor.c", dir.path(), &lib, &[define]);
        let err = StageRegistry::load(&[], std::slice::from_ref(&path))
            .err()
            .unwrap_or_else(|| panic!("{define}: must be refused"));
        assert!(
            matches!(err, LoadError::Abi { .. } | LoadError::Stage { .. }),
            "{define}: {err:?}"
        );
        let msg = err.to_string();
        assert!(msg.contains(&path.display().to_string()), "{define}: {msg}");
        assert!(msg.contains(want), "{define}: {msg}");
    }
}
