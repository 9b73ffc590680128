//! In-process server + tonic client tests for every RPC and every bad
//! input of the samplerd.v1 API, plus `check-config` through the binary.

mod common;

use std::collections::HashMap;
use std::time::Duration;

use common::*;
use samplerd_api::v1;
use tonic::Code;

fn greedy() -> Option<v1::SamplingParams> {
    Some(v1::SamplingParams {
        temperature: Some(0.0),
        ..Default::default()
    })
}

fn req_floats(l: &[f32]) -> v1::SampleRequest {
    v1::SampleRequest {
        logits: l.to_vec(),
        ..Default::default()
    }
}

fn req_params(l: &[f32], params: v1::SamplingParams) -> v1::SampleRequest {
    v1::SampleRequest {
        params: Some(params),
        ..req_floats(l)
    }
}

fn req_bytes(l: &[f32]) -> v1::SampleRequest {
    v1::SampleRequest {
        logits_f32le: to_bytes(l).into(),
        ..Default::default()
    }
}

fn stream_msg(l: &[f32]) -> v1::SampleStreamRequest {
    v1::SampleStreamRequest {
        logits: l.to_vec(),
        ..Default::default()
    }
}

fn log_softmax(l: &[f32], i: usize) -> f32 {
    let m = l.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    let s: f64 = l.iter().map(|&x| ((x - m) as f64).exp()).sum();
    l[i] - m - s.ln() as f32
}

#[tokio::test]
async fn sample_greedy_returns_argmax_with_logprob() {
    let s = start().await;
    let l = logits(1000, 1);
    let want = argmax(&l);
    let r = s
        .sample_ok(v1::SampleRequest {
            params: greedy(),
            ..req_floats(&l)
        })
        .await;
    assert_eq!(r.token_id, want);
    assert_eq!(r.seed, 42, "default seed");
    assert!(
        (r.logprob - log_softmax(&l, want as usize)).abs() < 1e-3,
        "{r:?}"
    );
    assert!(r.probability > 0.0 && r.probability <= 1.0);
    s.stop().await;
}

#[tokio::test]
async fn raw_bytes_and_floats_agree_and_are_deterministic() {
    let mut s = start().await;
    let l = logits(5000, 2);
    for step in 0..5 {
        let mut at_step = async |req: v1::SampleRequest| {
            let req = v1::SampleRequest { step, ..req };
            s.client.sample(req).await.unwrap().into_inner()
        };
        let a = at_step(req_floats(&l)).await;
        let b = at_step(req_bytes(&l)).await;
        let c = at_step(req_bytes(&l)).await;
        assert_eq!(a, b);
        assert_eq!(b, c);
        assert_eq!(a.step, step);
    }
    s.stop().await;
}

#[tokio::test]
async fn n_probs_raw_and_post_sampling() {
    let s = start().await;
    let l = logits(2000, 3);
    let raw = s
        .sample_ok(v1::SampleRequest {
            n_probs: 5,
            ..req_floats(&l)
        })
        .await;
    assert_eq!(raw.probs.len(), 5);
    assert_eq!(raw.probs[0].token_id, argmax(&l));
    assert!((raw.probs[0].logprob - log_softmax(&l, argmax(&l) as usize)).abs() < 1e-3);
    assert!(
        raw.probs
            .windows(2)
            .all(|w| w[0].probability >= w[1].probability)
    );
    let post = s
        .sample_ok(v1::SampleRequest {
            n_probs: 100,
            post_sampling_probs: true,
            params: Some(v1::SamplingParams {
                top_k: Some(10),
                ..Default::default()
            }),
            ..req_floats(&l)
        })
        .await;
    assert!(
        post.probs.len() <= 10,
        "top_k=10 leaves at most 10: {}",
        post.probs.len()
    );
    let sum: f32 = post.probs.iter().map(|p| p.probability).sum();
    assert!(
        (sum - 1.0).abs() < 1e-3,
        "post-chain probabilities sum to 1: {sum}"
    );
    s.stop().await;
}

#[tokio::test]
async fn explicit_chain_and_samplers_order() {
    let s = start().await;
    let l = logits(1000, 4);
    let chain = vec![
        number_stage("top_k", &[("k", 1.0)]),
        number_stage("dist", &[]),
    ];
    let r = s
        .sample_ok(req_params(
            &l,
            v1::SamplingParams {
                chain,
                ..Default::default()
            },
        ))
        .await;
    assert_eq!(r.token_id, argmax(&l), "top_k(1) → dist picks the argmax");
    let r = s
        .sample_ok(req_params(
            &l,
            v1::SamplingParams {
                samplers: vec!["top_k".into(), "temperature".into()],
                top_k: Some(1),
                ..Default::default()
            },
        ))
        .await;
    assert_eq!(r.token_id, argmax(&l));
    s.stop().await;
}

#[tokio::test]
async fn logit_bias_changes_the_greedy_choice() {
    let s = start().await;
    let l = logits(100, 5);
    let target = (argmax(&l) + 1) % 100;
    let r = s
        .sample_ok(req_params(
            &l,
            v1::SamplingParams {
                temperature: Some(0.0),
                logit_bias: HashMap::from([(target, 100.0)]),
                ..Default::default()
            },
        ))
        .await;
    assert_eq!(r.token_id, target);
    s.stop().await;
}

/// Token maps are bounded by the vocabulary the request brings: no more
/// entries than tokens, no id outside it (llama-server drops such ids
/// silently; samplerd says which one).
#[tokio::test]
async fn token_maps_are_bounded_by_the_vocabulary() {
    let s = start().await;
    let l = logits(100, 5);
    let inv = Code::InvalidArgument;
    let bias = |entries: HashMap<u32, f32>| v1::SamplingParams {
        logit_bias: entries,
        ..Default::default()
    };
    s.assert_sample_refused(
        req_params(&l, bias(HashMap::from([(3, 1.0), (100, 1.0)]))),
        inv,
        &["params.logit_bias", "token id 100", "vocabulary of 100"],
    )
    .await;
    s.assert_sample_refused(
        req_params(&l, bias((0..101).map(|i| (i, 1.0)).collect())),
        inv,
        &[
            "params.logit_bias",
            "101 entries exceed the vocabulary of 100",
        ],
    )
    .await;
    let map = |ids: &[u32]| {
        v1::param_value::Kind::TokenMap(v1::TokenValueList {
            entries: ids
                .iter()
                .map(|&token_id| v1::TokenValue {
                    token_id,
                    value: 1.0,
                })
                .collect(),
        })
    };
    let chain = v1::SamplingParams {
        chain: vec![
            stage_spec("logit_bias", [("bias", map(&[1, 250]))]),
            number_stage("dist", &[]),
        ],
        ..Default::default()
    };
    s.assert_sample_refused(
        req_params(&l, chain),
        inv,
        &["params.chain[0].params[\"bias\"]", "token id 250"],
    )
    .await;
    // A bias that bans every token leaves nothing to sample: the
    // request's doing, as all -inf logits are (INVALID_ARGUMENT, not
    // INTERNAL).
    s.assert_sample_refused(
        req_params(&l, bias((0..100).map(|i| (i, f32::NEG_INFINITY)).collect())),
        inv,
        &["params", "every token is masked"],
    )
    .await;
    // Inside the vocabulary: served.
    s.sample_ok(req_params(&l, bias(HashMap::from([(99, 1.0)]))))
        .await;
    s.stop().await;
}

/// Stream of N steps == N stateless Sample calls with the same seed and
/// steps, previous_tokens = initial window + chosen so far.
#[tokio::test]
async fn stream_equals_stateless_samples() {
    let s = start().await;
    const N: usize = 24;
    let vocab = 64;
    let params = Some(v1::SamplingParams {
        seed: Some(7),
        repeat_penalty: Some(1.5),
        frequency_penalty: Some(0.3),
        presence_penalty: Some(0.2),
        top_k: Some(20),
        temperature: Some(1.0),
        ..Default::default()
    });
    let window: Vec<u32> = vec![1, 2, 3, 3, 5];
    let steps: Vec<Vec<f32>> = (0..N).map(|i| logits(vocab, 100 + i as u64)).collect();

    let msgs: Vec<v1::SampleStreamRequest> = steps
        .iter()
        .enumerate()
        .map(|(i, l)| v1::SampleStreamRequest {
            logits_f32le: to_bytes(l).into(),
            previous_tokens: if i == 0 { window.clone() } else { vec![] },
            params: if i == 0 { params.clone() } else { None },
            n_probs: 3,
            ..Default::default()
        })
        .collect();
    let streamed = s.stream_all(msgs).await;
    assert_eq!(streamed.len(), N);

    let mut prev = window.clone();
    for (t, l) in steps.iter().enumerate() {
        let r = s
            .sample_ok(v1::SampleRequest {
                logits: l.clone(),
                previous_tokens: prev.clone(),
                params: params.clone(),
                step: t as u64,
                n_probs: 3,
                ..Default::default()
            })
            .await;
        assert_eq!(r, streamed[t], "step {t}");
        prev.push(r.token_id);
    }
    s.stop().await;
}

#[tokio::test]
async fn list_stages_reports_core_stages_and_default_chain() {
    let mut s = start().await;
    let r = s
        .client
        .list_stages(v1::ListStagesRequest {})
        .await
        .unwrap()
        .into_inner();
    let names: Vec<&str> = r.stages.iter().map(|s| s.name.as_str()).collect();
    for want in [
        "top_k",
        "top_p",
        "temperature",
        "dist",
        "greedy",
        "penalties",
        "token_controls",
    ] {
        assert!(names.contains(&want), "{want} missing from {names:?}");
    }
    let top_k = r.stages.iter().find(|s| s.name == "top_k").unwrap();
    assert!(
        top_k
            .params
            .iter()
            .any(|p| p.name == "k" && p.kind == "number")
    );
    assert!(!r.default_chain.is_empty());
    assert_eq!(r.default_chain.last().unwrap().name, "dist");
    assert!(r.default_chain_description.contains("top_k"));
    // The configured top_p (an f32 0.95) shows as written, not as
    // 0.949999988079071.
    let top_p = r.default_chain.iter().find(|s| s.name == "top_p").unwrap();
    assert_eq!(
        top_p.params["p"].kind,
        Some(v1::param_value::Kind::Number(0.95))
    );
    s.stop().await;
}

#[tokio::test]
async fn generate_without_model_is_failed_precondition() {
    let mut s = start().await;
    let err = s
        .client
        .generate(v1::GenerateRequest {
            prompt: "hi".into(),
            ..Default::default()
        })
        .await
        .unwrap_err();
    assert_status(
        &err,
        Code::FailedPrecondition,
        &["--model PATH", "model.path"],
    );
    s.stop().await;
}

#[tokio::test]
async fn bad_inputs_name_field_and_value() {
    let mut s = start().await;
    let l = logits(100, 6);
    let inv = Code::InvalidArgument;
    // Both and neither encodings.
    let both = v1::SampleRequest {
        logits: l.clone(),
        logits_f32le: to_bytes(&l).into(),
        ..Default::default()
    };
    s.assert_sample_refused(both, inv, &["logits", "both"])
        .await;
    s.assert_sample_refused(v1::SampleRequest::default(), inv, &["logits", "got none"])
        .await;
    // Bytes not a multiple of 4.
    let odd = v1::SampleRequest {
        logits_f32le: vec![0u8; 10].into(),
        ..Default::default()
    };
    s.assert_sample_refused(odd, inv, &["logits_f32le", "10"])
        .await;
    // NaN and +inf, naming the index.
    let mut bad = l.clone();
    bad[17] = f32::NAN;
    s.assert_sample_refused(req_floats(&bad), inv, &["logits", "[17]", "NaN"])
        .await;
    let mut bad = l.clone();
    bad[42] = f32::INFINITY;
    s.assert_sample_refused(req_bytes(&bad), inv, &["logits_f32le", "[42]", "inf"])
        .await;
    // Parameter ranges.
    for (p, field, value) in [
        (
            v1::SamplingParams {
                top_p: Some(1.5),
                ..Default::default()
            },
            "top_p",
            "1.5",
        ),
        (
            v1::SamplingParams {
                temperature: Some(-1.0),
                ..Default::default()
            },
            "temperature",
            "-1",
        ),
        (
            v1::SamplingParams {
                top_k: Some(-3),
                ..Default::default()
            },
            "top_k",
            "-3",
        ),
        // Values at which the stage would be a no-op are still the stage's
        // to judge: under the greedy shortcut, and with xtc switched off.
        (
            v1::SamplingParams {
                temperature: Some(0.0),
                top_p: Some(1.5),
                ..Default::default()
            },
            "params.top_p: refused by stage `top_p`",
            "got 1.5",
        ),
        (
            v1::SamplingParams {
                xtc_threshold: Some(7.0),
                ..Default::default()
            },
            "params.xtc_threshold: refused by stage `xtc`",
            "got 7",
        ),
        (
            v1::SamplingParams {
                top_p: Some(1.1),
                ..Default::default()
            },
            "params.top_p",
            // The value as sent, not its f64 widening.
            "got 1.1",
        ),
    ] {
        s.assert_sample_refused(req_params(&l, p), inv, &[field, value])
            .await;
    }
    // No-op values llama.cpp accepts are accepted.
    let off = v1::SamplingParams {
        top_n_sigma: Some(-0.5),
        top_k: Some(0),
        ..Default::default()
    };
    let ok = s.client.sample(req_params(&l, off)).await;
    assert!(ok.is_ok(), "{ok:?}");
    // Unknown stage in chain, and a bad stage parameter.
    for (chain, needles) in [
        (
            vec![
                number_stage("no_such_stage", &[]),
                number_stage("dist", &[]),
            ],
            &["params.chain", "no_such_stage"][..],
        ),
        (
            vec![number_stage("top_k", &[("kk", 3.0)])],
            &["params.chain"],
        ),
    ] {
        let p = v1::SamplingParams {
            chain,
            ..Default::default()
        };
        s.assert_sample_refused(req_params(&l, p), inv, needles)
            .await;
    }
    // Still serving real requests.
    let ok = s.sample_ok(req_floats(&l)).await;
    assert!((ok.token_id as usize) < l.len());
    s.stop().await;
}

#[tokio::test]
async fn previous_tokens_out_of_vocabulary_are_skipped() {
    let s = start().await;
    let l = logits(50, 8);
    let params = Some(v1::SamplingParams {
        repeat_penalty: Some(2.0),
        temperature: Some(0.0),
        ..Default::default()
    });
    let with_previous = async |previous_tokens| {
        s.sample_ok(v1::SampleRequest {
            previous_tokens,
            params: params.clone(),
            ..req_floats(&l)
        })
        .await
    };
    let with_bad = with_previous(vec![argmax(&l), 50, 1_000_000, u32::MAX]).await;
    let without = with_previous(vec![argmax(&l)]).await;
    assert_eq!(with_bad, without);
    s.stop().await;
}

#[tokio::test]
async fn vocabulary_and_message_limits() {
    let mut s = start_tuned(|c| {
        c.limits.max_vocab = 1000;
        c.limits.max_message_bytes = 16 * 1024;
    })
    .await;
    // Over the vocabulary limit (but under the message limit).
    let err = s.sample_err(req_bytes(&logits(1001, 9))).await;
    assert_status(&err, Code::InvalidArgument, &["1001", "max_vocab"]);
    // Over the message limit: RESOURCE_EXHAUSTED.
    let err = s.sample_err(req_bytes(&logits(8000, 9))).await;
    assert_eq!(err.code(), Code::ResourceExhausted, "{err:?}");
    // Same on a stream.
    let msg = v1::SampleStreamRequest {
        logits_f32le: to_bytes(&logits(8000, 9)).into(),
        ..Default::default()
    };
    let mut st = s
        .client
        .sample_stream(tokio_stream::iter(vec![msg]))
        .await
        .unwrap()
        .into_inner();
    let err = st.message().await.unwrap_err();
    assert_eq!(err.code(), Code::ResourceExhausted, "{err:?}");
    s.assert_serving().await;
    let ok = s.sample_ok(req_bytes(&logits(500, 9))).await;
    assert!(ok.token_id < 500);
    s.stop().await;
}

#[tokio::test]
async fn plugin_failure_is_internal_naming_the_stage() {
    let s = start_tuned(|c| c.plugins.files.push(test_plugin())).await;
    let l = logits(100, 10);
    let p = v1::SamplingParams {
        chain: vec![number_stage("test_panic", &[]), number_stage("greedy", &[])],
        ..Default::default()
    };
    s.assert_sample_refused(req_params(&l, p), Code::Internal, &["test_panic"])
        .await;
    let ok = s.sample_ok(req_floats(&l)).await;
    assert!(ok.token_id < 100);
    s.stop().await;
}

#[tokio::test]
async fn stream_error_mid_stream_and_cancel_free_the_session() {
    let mut s = start().await;
    let l = logits(100, 11);
    // A bad second message ends the stream with an error naming the field.
    let mut bad = l.clone();
    bad[3] = f32::NAN;
    let msgs = vec![stream_msg(&l), stream_msg(&bad)];
    let mut st = s
        .client
        .sample_stream(tokio_stream::iter(msgs))
        .await
        .unwrap()
        .into_inner();
    assert!(st.message().await.unwrap().is_some());
    let err = st.message().await.unwrap_err();
    assert_status(&err, Code::InvalidArgument, &["[3]"]);

    // A client that disconnects mid-stream: the session is freed.
    let (tx, st, _) = open_stream(&mut s.client, stream_msg(&l)).await;
    assert_eq!(s.state().open_sessions(), 1);
    drop(st);
    drop(tx);
    wait_sessions_closed(&s).await;
    s.assert_serving().await;
    s.stop().await;
}

#[tokio::test]
async fn random_seed_setting_reports_fresh_seeds() {
    let s =
        start_tuned(|c| c.sampling.seed = samplerd::service::defaults::SeedSetting::Random).await;
    let l = logits(100, 12);
    let a = s.sample_ok(req_floats(&l)).await;
    let b = s.sample_ok(req_floats(&l)).await;
    assert_ne!(a.seed, b.seed);
    // A request seed still wins.
    let c = s
        .sample_ok(req_params(
            &l,
            v1::SamplingParams {
                seed: Some(5),
                ..Default::default()
            },
        ))
        .await;
    assert_eq!(c.seed, 5);
    s.stop().await;
}

/// A burst of large requests does not stall the health check.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn health_answers_during_a_burst() {
    let s = start().await;
    let l = logits(151_936, 13);
    let mut tasks = Vec::new();
    for _ in 0..16 {
        let mut c = s.client.clone();
        let r = req_bytes(&l);
        tasks.push(tokio::spawn(async move { c.sample(r).await.map(|_| ()) }));
    }
    tokio::time::timeout(Duration::from_secs(5), s.assert_serving())
        .await
        .expect("health answered during the burst");
    for t in tasks {
        t.await.unwrap().unwrap();
    }
    s.stop().await;
}

fn samplerd_bin() -> std::process::Command {
    let mut c = std::process::Command::new(env!("CARGO_BIN_EXE_samplerd"));
    c.env_remove("SAMPLERD_CONFIG").env_remove("RUST_LOG");
    c
}

#[test]
fn check_config_prints_effective_config_and_chain() {
    let out = samplerd_bin()
        .args(["check-config", "--plugin-dir"])
        .arg(tempdir_with_core())
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{stdout}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(stdout.contains("listen = \"127.0.0.1:50051\""), "{stdout}");
    assert!(stdout.contains("top_k"), "{stdout}");
}

/// `model.numerics`: check-config says which arithmetic order the model
/// will follow, and names the key for a value that is neither order.
#[test]
fn check_config_reports_the_model_numerics() {
    let dir = tempdir_with_core();
    assert_check_config_fails(
        &dir,
        Some("[model]\nnumerics = \"fast\"\n"),
        &[],
        &["model.numerics", "fast"],
    );
    let Some(model) = model_path() else {
        eprintln!("SAMPLERD_MODEL is not set: skipping the check-config model report");
        return;
    };
    for (numerics, want) in [
        (None, "#   portable (avx2 order)"),
        (Some("native"), "#   native ("),
    ] {
        let mut cmd = samplerd_bin();
        cmd.args(["check-config", "--model"])
            .arg(&model)
            .arg("--plugin-dir")
            .arg(&dir);
        if let Some(n) = numerics {
            cmd.env("SAMPLERD_MODEL__NUMERICS", n);
        }
        let out = cmd.output().unwrap();
        let stdout = String::from_utf8_lossy(&out.stdout);
        assert!(
            out.status.success(),
            "{stdout}\n{}",
            String::from_utf8_lossy(&out.stderr)
        );
        assert!(
            stdout.contains("# model arithmetic (model.numerics)"),
            "{stdout}"
        );
        assert!(stdout.contains(want), "{want:?} in {stdout}");
    }
}

/// A directory holding only the core plugin (the profile dir also has
/// the misbehaving test plugins), fresh per call: tests run in parallel, and copying the
/// library over one that another test's `check-config` is loading would
/// hand it a half-written file.
fn tempdir_with_core() -> std::path::PathBuf {
    static N: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);
    let n = N.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    let dir =
        std::env::temp_dir().join(format!("samplerd-test-plugins-{}-{n}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    std::fs::copy(core_plugin(), dir.join("libsamplerd_core_stages.so")).unwrap();
    dir
}

/// Runs `samplerd check-config --plugin-dir DIR` with `toml` as the config
/// file (none when `None`) and `env`; asserts it fails and that stderr
/// names every one of `needles`.
fn assert_check_config_fails(
    dir: &std::path::Path,
    toml: Option<&str>,
    env: &[(&str, &str)],
    needles: &[&str],
) {
    let mut cmd = samplerd_bin();
    cmd.arg("check-config");
    if let Some(toml) = toml {
        let file = dir.join("bad.toml");
        std::fs::write(&file, toml).unwrap();
        cmd.arg("--config").arg(&file);
    }
    cmd.arg("--plugin-dir").arg(dir).envs(env.iter().copied());
    let out = cmd.output().unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        !out.status.success(),
        "check-config accepted {toml:?} {env:?}"
    );
    for n in needles {
        assert!(stderr.contains(n), "missing {n:?} in: {stderr}");
    }
}

#[test]
fn check_config_names_key_and_source() {
    let dir = tempdir_with_core();
    // From the file.
    assert_check_config_fails(
        &dir,
        Some("[sampling]\ntop_p = 1.5\n"),
        &[],
        &["sampling.top_p", "bad.toml"],
    );
    // From the environment.
    assert_check_config_fails(
        &dir,
        None,
        &[("SAMPLERD_SAMPLING__TOP_K", "-3")],
        &["sampling.top_k", "SAMPLERD_SAMPLING__TOP_K"],
    );
    // A chain that does not build: unknown stage in chain.order.
    assert_check_config_fails(
        &dir,
        Some("[chain]\norder = [\"top_k\", \"nope\"]\n"),
        &[],
        &["chain.order", "nope"],
    );
    // Unknown key.
    assert_check_config_fails(
        &dir,
        Some("[limits]\nmax_vocabb = 3\n"),
        &[],
        &["max_vocabb", "bad.toml"],
    );
}

/// check-config opens every file `serve` would, so a configuration it
/// passes does not fail at start-up: each bad one is named with its key.
#[test]
fn check_config_opens_every_file_serve_needs() {
    let dir = tempdir_with_core();
    let missing = dir.join("missing.pem");
    let not_gguf = dir.join("not-a-model.gguf");
    std::fs::write(&not_gguf, b"this is not a GGUF file").unwrap();
    let m = missing.display().to_string();
    let cases: [(String, &[&str]); 4] = [
        (
            format!("[tls]\ncert_file = {m:?}\nkey_file = {m:?}\n"),
            &["tls.cert_file", "missing.pem", "bad.toml"],
        ),
        (
            format!("[auth]\ntokens_file = {m:?}\n"),
            &["auth.tokens_file", "missing.pem", "bad.toml"],
        ),
        (
            format!("[model]\npath = {:?}\n", not_gguf.display().to_string()),
            &["model.path", "not-a-model.gguf"],
        ),
        (
            format!("[model]\npath = {m:?}\n"),
            &["model.path", "missing.pem"],
        ),
    ];
    for (toml, needles) in cases {
        assert_check_config_fails(&dir, Some(&toml), &[], needles);
    }
}

/// A start-up error is printed once (not once per layer of its cause
/// chain), and text logs carry no colour codes when stderr is not a
/// terminal.
#[test]
fn start_up_errors_are_printed_once_without_colour_codes() {
    let dir = tempdir_with_core();
    let model = dir.join("no-such-model.gguf");
    let out = samplerd_bin()
        .args(["serve", "--listen", "127.0.0.1:0", "--plugin-dir"])
        .arg(&dir)
        .arg("--model")
        .arg(&model)
        .env("SAMPLERD_METRICS__ENABLED", "false")
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "{stderr}");
    let error_lines: Vec<&str> = stderr
        .lines()
        .filter(|l| l.starts_with("samplerd: "))
        .collect();
    assert_eq!(error_lines.len(), 1, "{stderr}");
    assert_eq!(
        error_lines[0].matches("no-such-model.gguf").count(),
        1,
        "the cause is repeated: {stderr}"
    );
    assert!(
        !stderr.contains('\u{1b}'),
        "ANSI escape codes in: {stderr:?}"
    );
}

/// Reflection answers on both v1 and v1alpha (grpcurl 1.8.x speaks v1alpha).
#[tokio::test]
async fn reflection_v1_and_v1alpha_list_the_services() {
    let s = start().await;
    let names = list_services_v1(s.channel.clone()).await.unwrap();
    assert!(
        names.iter().any(|n| n == "samplerd.v1.Sampler"),
        "{names:?}"
    );
    assert!(
        names.iter().any(|n| n == "grpc.health.v1.Health"),
        "{names:?}"
    );
    assert!(
        !names.iter().any(|n| n.contains("testing")),
        "test-only services are not listed: {names:?}"
    );
    let names = list_services_v1alpha(s.channel.clone()).await.unwrap();
    assert!(names.iter().any(|n| n == "samplerd.v1.Sampler"));
    s.stop().await;
}

#[tokio::test]
async fn stream_limit_is_resource_exhausted() {
    let mut s = start_tuned(|c| c.limits.max_concurrent_streams = 1).await;
    let l = logits(10, 14);
    let (tx, mut first, _) = open_stream(&mut s.client, stream_msg(&l)).await;
    let err = s
        .client
        .sample_stream(tokio_stream::iter(vec![stream_msg(&l)]))
        .await
        .unwrap_err();
    assert_status(&err, Code::ResourceExhausted, &["max_concurrent_streams"]);
    drop(tx);
    assert!(first.message().await.unwrap().is_none());
    s.stop().await;
}

/// Compressed messages both ways: a gzip or zstd request is served (Sample
/// over floats and raw bytes, a SampleStream, the health check), the answer
/// comes compressed when asked for, and it equals the uncompressed one.
#[tokio::test]
async fn gzip_and_zstd_requests_are_served_and_answered_compressed() {
    use tonic::codec::CompressionEncoding::{Gzip, Zstd};
    let s = start().await;
    let l = logits(2000, 9);
    let plain_bytes = s.sample_ok(req_bytes(&l)).await;
    let plain_floats = s.sample_ok(req_floats(&l)).await;
    let plain_stream = s.stream_all(vec![stream_msg(&l), stream_msg(&l)]).await;
    for enc in [Gzip, Zstd] {
        let mut c = s.client.clone().send_compressed(enc).accept_compressed(enc);
        let resp = c
            .sample(req_bytes(&l))
            .await
            .unwrap_or_else(|e| panic!("{enc}: {e}"));
        assert_eq!(
            resp.metadata()
                .get("grpc-encoding")
                .map(|v| v.to_str().unwrap()),
            Some(enc.to_string().as_str()),
            "{enc}: the response is compressed as asked"
        );
        assert_eq!(resp.into_inner(), plain_bytes, "{enc}: raw bytes");
        let resp = c.sample(req_floats(&l)).await.unwrap().into_inner();
        assert_eq!(resp, plain_floats, "{enc}: floats");
        let msgs = vec![stream_msg(&l), stream_msg(&l)];
        let mut st = c
            .sample_stream(tokio_stream::iter(msgs))
            .await
            .unwrap()
            .into_inner();
        let mut got = Vec::new();
        while let Some(m) = st.message().await.unwrap() {
            got.push(m);
        }
        assert_eq!(got, plain_stream, "{enc}: SampleStream");
        let health = tonic_health::pb::health_client::HealthClient::new(s.channel.clone())
            .send_compressed(enc)
            .accept_compressed(enc)
            .check(tonic_health::pb::HealthCheckRequest::default())
            .await
            .unwrap_or_else(|e| panic!("{enc}: health: {e}"));
        assert_eq!(health.into_inner().status, 1, "{enc}: SERVING");
    }
}
