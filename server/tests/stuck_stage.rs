//! A stage that never returns (the `stuck_stage.c` fixture: `test_sleep`
//! sleeps, `test_spin` burns its core) and a legal but heavy step: the
//! request in it fails with DEADLINE_EXCEEDED naming the stage after
//! `limits.max_step_ms`, its stream slot and generation slot come back at
//! once, and meanwhile health, ListStages and other Sample/Generate
//! requests keep answering; past `limits.max_stuck_workers` readiness turns
//! NOT_SERVING while liveness stays SERVING; SIGTERM still exits within
//! the grace period. Every wait is bounded.
//!
//! The Generate part needs `SAMPLERD_MODEL` (scripts/test.sh sets it);
//! without it, it prints a notice and checks the rest.

mod common;
mod process;

use std::sync::Arc;
use std::time::{Duration, Instant};

use common::*;
use samplerd::app::config::Config;
use samplerd::generate::generator::Generator;
use samplerd::generate::{GenerateConfig, ModelHost};
use samplerd_api::v1;
use samplerd_api::v1::sampler_client::SamplerClient;
use tonic::Code;
use tonic::transport::Channel;
use tonic_health::pb::health_client::HealthClient;
use tonic_health::pb::{HealthCheckRequest, health_check_response::ServingStatus};

/// Bound on any single wait.
const WAIT: Duration = Duration::from_secs(30);
/// The step budget these tests configure.
const MAX_STEP: Duration = Duration::from_millis(1_000);
/// How fast health must answer while a step is stuck or heavy. Before the
/// sampling pool it waited for the whole step (the stage's 30 s, or the
/// heavy step's ~0.9 s); with it, a check is a few hundred microseconds of
/// runtime work. The bound leaves room for a loaded 2-core CI machine.
const HEALTH_BOUND: Duration = Duration::from_millis(250);
const VOCAB: usize = 1_000;

use common::number_stage as stage;

/// A chain that runs `stuck` (`test_sleep` or `test_spin`) for `ms`, then
/// picks the top token.
fn stuck_chain(stuck: &str, ms: f64) -> Option<v1::SamplingParams> {
    Some(v1::SamplingParams {
        chain: vec![stage(stuck, &[("ms", ms)]), stage("greedy", &[])],
        ..Default::default()
    })
}

fn greedy() -> Option<v1::SamplingParams> {
    Some(v1::SamplingParams {
        temperature: Some(0.0),
        ..Default::default()
    })
}

fn sample(params: Option<v1::SamplingParams>, seed: u64) -> v1::SampleRequest {
    v1::SampleRequest {
        logits: logits(VOCAB, seed),
        params,
        ..Default::default()
    }
}

/// A config with the core plugin and the fixture, a 1 s step budget and
/// two sampling threads.
fn config(dir: &std::path::Path) -> Config {
    let mut c = test_config();
    c.plugins
        .files
        .push(build_fixture_plugin("stuck_stage.c", dir));
    c.limits.max_step_ms = MAX_STEP.as_millis() as u64;
    c.limits.sampling_threads = 2;
    c
}

async fn health_status(s: &TestServer, service: &str) -> i32 {
    let mut h = HealthClient::new(s.channel.clone());
    tokio::time::timeout(
        WAIT,
        h.check(HealthCheckRequest {
            service: service.into(),
        }),
    )
    .await
    .expect("health answers")
    .expect("health check")
    .into_inner()
    .status
}

/// Asserts that health answers SERVING within [`HEALTH_BOUND`], a few times.
async fn assert_health_is_prompt(s: &TestServer) {
    let mut h = HealthClient::new(s.channel.clone());
    for _ in 0..5 {
        let t0 = Instant::now();
        let r = tokio::time::timeout(
            HEALTH_BOUND,
            h.check(HealthCheckRequest {
                service: String::new(),
            }),
        )
        .await
        .unwrap_or_else(|_| panic!("health took longer than {HEALTH_BOUND:?}"))
        .expect("health check")
        .into_inner();
        assert_eq!(r.status, ServingStatus::Serving as i32);
        assert!(t0.elapsed() < HEALTH_BOUND);
    }
}

/// Waits (bounded) until `n` steps are running on the pool.
async fn wait_running(s: &TestServer, n: usize) {
    let steps = &s.state().steps;
    tokio::time::timeout(WAIT, async {
        while steps.running() < n {
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
    })
    .await
    .unwrap_or_else(|_| panic!("{n} steps never started ({} running)", steps.running()));
}

/// A Sample in flight in the background.
type PendingSample =
    tokio::task::JoinHandle<Result<tonic::Response<v1::SampleResponse>, tonic::Status>>;

/// Sends `req` on a clone of `client` in the background.
fn spawn_sample(client: &SamplerClient<Channel>, req: v1::SampleRequest) -> PendingSample {
    let mut client = client.clone();
    tokio::spawn(async move { client.sample(req).await })
}

/// The answer to a background Sample, which must come within WAIT.
async fn answer(h: PendingSample) -> Result<tonic::Response<v1::SampleResponse>, tonic::Status> {
    tokio::time::timeout(WAIT, h)
        .await
        .expect("the request ends in time")
        .expect("the request task does not panic")
}

/// Waits (bounded) until `f` holds, polling every 10 ms.
async fn wait_until(what: &str, f: impl Fn() -> bool) {
    tokio::time::timeout(WAIT, async {
        while !f() {
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    })
    .await
    .unwrap_or_else(|_| panic!("{what}: not within {WAIT:?}"));
}

fn assert_names_stage(e: &tonic::Status, stage: &str) {
    assert_eq!(e.code(), Code::DeadlineExceeded, "{e:?}");
    let d = assert_reason(e, Reason::StepStuck);
    assert_eq!(d.error_info().unwrap().metadata["stage"], stage, "{e:?}");
    assert!(
        e.message().contains(&format!("stage `{stage}`"))
            && e.message().contains("limits.max_step_ms = 1000"),
        "{e:?}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_sleeping_stage_fails_its_request_and_nothing_else_waits() {
    let dir = tempfile::tempdir().unwrap();
    let s = start_with(config(dir.path())).await;
    let t0 = Instant::now();
    let stuck = spawn_sample(&s.client, sample(stuck_chain("test_sleep", 30e3), 1));
    wait_running(&s, 1).await;

    assert_health_is_prompt(&s).await;
    let ok = s
        .client
        .clone()
        .sample(sample(greedy(), 2))
        .await
        .expect("another Sample completes")
        .into_inner();
    assert_eq!(ok.token_id, argmax(&logits(VOCAB, 2)));
    let stages = s
        .client
        .clone()
        .list_stages(v1::ListStagesRequest {})
        .await
        .expect("ListStages answers")
        .into_inner();
    assert!(stages.stages.iter().any(|st| st.name == "test_sleep"));

    let e = answer(stuck).await.expect_err("the stuck request fails");
    assert_names_stage(&e, "test_sleep");
    assert!(t0.elapsed() >= MAX_STEP, "failed after {:?}", t0.elapsed());
    // Its thread is written off and replaced: the pool is whole.
    assert_eq!(s.state().steps.stuck(), 1);
    assert!(s.state().steps.healthy());
    let again = s.client.clone().sample(sample(greedy(), 3)).await;
    assert_eq!(
        again.unwrap().into_inner().token_id,
        argmax(&logits(VOCAB, 3))
    );
    s.stop().await;
}

/// A batch whose rows all run a stage that never returns once took one
/// step budget and one written-off thread per row, one after the other (8
/// rows: 16 s, and every thread of a 6-thread pool). Now its first row
/// runs alone (the chain names a stage from outside the shipped
/// libraries) and the batch stops there: one budget, one thread, every
/// row failed with the first one's error.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_batch_stops_at_its_first_stuck_row() {
    let dir = tempfile::tempdir().unwrap();
    let mut c = config(dir.path());
    c.limits.max_stuck_workers = 8;
    let s = start_with(c).await;
    let row = v1::BatchRow {
        logits: to_bytes(&logits(VOCAB, 1)).into(),
        ..Default::default()
    };
    let batch = v1::SampleBatchRequest {
        rows: vec![row; 8],
        params: stuck_chain("test_sleep", 30e3),
        ..Default::default()
    };
    let e = tokio::time::timeout(WAIT, s.client.clone().sample_batch(batch))
        .await
        .expect("the batch is answered in time")
        .expect_err("the batch fails");
    assert_names_stage(&e, "test_sleep");
    assert!(e.message().starts_with("rows[0]: "), "{e:?}");
    assert_eq!(s.state().steps.stuck(), 1);
    // No other row ever ran: had one started beside the first, it would be
    // written off one budget after the batch failed.
    tokio::time::sleep(2 * MAX_STEP).await;
    assert_eq!(s.state().steps.stuck(), 1, "only the first row ran");
    assert!(s.state().steps.healthy());
    assert_eq!(
        s.client
            .clone()
            .sample(sample(greedy(), 2))
            .await
            .expect("the pool serves the next request")
            .into_inner()
            .token_id,
        argmax(&logits(VOCAB, 2))
    );
}

/// A stream whose step spins: DEADLINE_EXCEEDED on the stream, its
/// session and permit released at once (the thread is still spinning),
/// and the thread rejoins or leaves when the stage returns.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_spinning_stage_in_a_stream_releases_the_streams_slot() {
    let dir = tempfile::tempdir().unwrap();
    let s = start_with(config(dir.path())).await;
    let first = v1::SampleStreamRequest {
        logits: logits(VOCAB, 1),
        params: stuck_chain("test_spin", 3e3),
        ..Default::default()
    };
    let mut responses = s
        .client
        .clone()
        .sample_stream(tokio_stream::iter(vec![first]))
        .await
        .expect("stream opens")
        .into_inner();
    let e = tokio::time::timeout(WAIT, responses.message())
        .await
        .expect("the stream answers")
        .expect_err("the step fails");
    assert_names_stage(&e, "test_spin");
    let state = s.state();
    let max = state.limits.max_concurrent_streams;
    wait_until("stream slot released", || {
        state.open_sessions() == 0 && state.streams.available_permits() == max
    })
    .await;
    assert!(state.steps.running() >= 1, "the stage is still spinning");
    wait_until("the spinning thread returned", || state.steps.stuck() == 0).await;
    assert!(state.steps.healthy());
    s.assert_serving().await;
    s.stop().await;
}

/// More stuck threads than `limits.max_stuck_workers`: readiness turns
/// NOT_SERVING, liveness stays SERVING; once the stages return, the
/// threads rejoin and readiness is SERVING again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn past_max_stuck_workers_readiness_fails_and_liveness_does_not() {
    let dir = tempfile::tempdir().unwrap();
    let mut c = config(dir.path());
    c.limits.max_stuck_workers = 1;
    let s = start_with(c).await;
    let stuck: Vec<_> = (0..2)
        .map(|i| spawn_sample(&s.client, sample(stuck_chain("test_sleep", 4e3), i)))
        .collect();
    for h in stuck {
        let e = answer(h).await.expect_err("fails");
        assert_names_stage(&e, "test_sleep");
    }
    let state = s.state();
    assert_eq!(state.steps.stuck(), 2);
    assert!(!state.steps.healthy());
    let mut watch = HealthClient::new(s.channel.clone())
        .watch(HealthCheckRequest {
            service: String::new(),
        })
        .await
        .expect("health watch")
        .into_inner();
    let mut seen = Vec::new();
    tokio::time::timeout(WAIT, async {
        while let Some(m) = watch.message().await.expect("health stream") {
            seen.push(m.status);
            if seen.contains(&(ServingStatus::NotServing as i32))
                && m.status == ServingStatus::Serving as i32
            {
                return;
            }
            if m.status == ServingStatus::NotServing as i32 {
                let live = health_status(&s, samplerd::app::server::LIVENESS_SERVICE).await;
                assert_eq!(live, ServingStatus::Serving as i32, "liveness stays honest");
            }
        }
    })
    .await
    .unwrap_or_else(|_| panic!("readiness went {seen:?}, not NOT_SERVING then SERVING"));
    assert_eq!(state.steps.stuck(), 0);
    assert!(state.steps.healthy());
    s.stop().await;
}

/// A legal heavy step (the core stages alone: 60 top_p stages over the
/// largest vocabulary, ~1 s on 2 cores) holds up nothing else.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_heavy_legal_step_does_not_delay_health() {
    let mut c = test_config();
    c.limits.max_step_ms = 30_000;
    let s = start_with(c).await;
    let n = samplerd::service::limits::LimitsConfig::default().max_vocab;
    let mut chain: Vec<_> = (0..60)
        .map(|i| stage("top_p", &[("p", 0.999 - i as f64 * 1e-4)]))
        .collect();
    chain.push(stage("dist", &[]));
    let heavy = v1::SampleRequest {
        logits_f32le: to_bytes(&logits(n, 9)).into(),
        params: Some(v1::SamplingParams {
            chain,
            ..Default::default()
        }),
        ..Default::default()
    };
    let mut overlapped = 0;
    for _ in 0..5 {
        let h = spawn_sample(&s.client, heavy.clone());
        wait_running(&s, 1).await;
        assert_health_is_prompt(&s).await;
        // Only a check made while the step still ran says anything.
        overlapped += usize::from(s.state().steps.running() >= 1);
        answer(h).await.expect("heavy step succeeds");
        if overlapped > 0 {
            break;
        }
    }
    assert!(
        overlapped > 0,
        "the heavy step never outlasted the health checks"
    );
    s.stop().await;
}

/// Generate: a stuck stage ends the generation with DEADLINE_EXCEEDED and
/// gives its generation slot and stream permit back at once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stuck_stage_in_generate_frees_its_generation_slot() {
    let Some(path) = process::model_path() else {
        eprintln!("SAMPLERD_MODEL not set: skipping the Generate part");
        return;
    };
    let dir = tempfile::tempdir().unwrap();
    let host = ModelHost::load(
        &path,
        GenerateConfig {
            n_ctx: 256,
            max_concurrent_generations: 1,
            max_queued_generations: 0,
            ..Default::default()
        },
    )
    .expect("model loads");
    let mut cfg = config(dir.path());
    // Room for a prompt that outlasts the step budget in the tokenizer
    // (the default limits refuse it before any tokenizing).
    cfg.generate.max_request_bytes = 16 << 20;
    cfg.generate.max_prompt_bytes = 8 << 20;
    let s = start_serving(cfg, Some(Arc::new(host) as Arc<dyn Generator>)).await;
    let mut client = s.client.clone();
    let request = |params| v1::GenerateRequest {
        prompt: "The capital of France is".into(),
        max_tokens: Some(4),
        params,
        ..Default::default()
    };
    let mut stuck = client
        .generate(request(stuck_chain("test_sleep", 5e3)))
        .await
        .expect("Generate opens")
        .into_inner();
    let e = tokio::time::timeout(WAIT, async {
        loop {
            match stuck.message().await {
                Ok(Some(_)) => continue,
                Ok(None) => panic!("the stuck generation ended without an error"),
                Err(e) => return e,
            }
        }
    })
    .await
    .expect("the stuck generation ends");
    assert_names_stage(&e, "test_sleep");
    // The only slot is free again although the stage still sleeps.
    assert!(s.state().steps.running() >= 1);
    let mut next = client
        .generate(request(greedy()))
        .await
        .expect("Generate opens")
        .into_inner();
    let mut finished = false;
    while let Some(m) = tokio::time::timeout(WAIT, next.message())
        .await
        .expect("tokens in time")
        .expect("the next generation succeeds")
    {
        finished |= matches!(m.event, Some(v1::generate_response::Event::Finished(_)));
    }
    assert!(finished);
    let state = s.state();
    let max = state.limits.max_concurrent_streams;
    wait_until("stream permits back", || {
        state.streams.available_permits() == max
    })
    .await;

    // Tokenizing runs on the pool under the same budget, and names itself.
    // A prompt holding a special token's text goes through `tokenizers`'
    // whole pipeline (plain text takes the fast splitter, ~0.03 s per MB):
    // 6 MB of it take seconds (~0.5 s per MB on 2 cores).
    let huge = v1::GenerateRequest {
        prompt: format!("{}<|im_end|>", "word ".repeat(1_200_000)),
        ..request(greedy())
    };
    let e = match tokio::time::timeout(WAIT, client.generate(huge)).await {
        Ok(Err(e)) => e,
        Ok(Ok(r)) => tokio::time::timeout(WAIT, r.into_inner().message())
            .await
            .expect("the stream answers")
            .expect_err("a prompt over the budget fails"),
        Err(_) => panic!("no answer within {WAIT:?}"),
    };
    assert_names_stage(&e, "(prompt tokenization)");
    s.stop().await;
}

/// The real process: a stuck stage is logged and counted by name, and
/// SIGTERM still drains and exits 0 within the grace period although the
/// stuck thread never returns.
#[tokio::test]
async fn sigterm_exits_within_the_grace_period_with_a_stuck_stage() {
    let dir = tempfile::tempdir().unwrap();
    let fixture = build_fixture_plugin("stuck_stage.c", dir.path());
    let p = process::start(&format!(
        "[limits]\nmax_step_ms = 1000\n\
         [shutdown]\ngrace_period_secs = 5\n\
         [plugins]\nfiles = [{}, {}]\n",
        process::toml_path(&core_plugin()),
        process::toml_path(&fixture),
    ));
    let mut p = p;
    let ch = p.channel().await;
    let mut client = SamplerClient::new(ch.clone());
    let e = client
        .sample(sample(stuck_chain("test_spin", 60e3), 1))
        .await
        .expect_err("the stuck request fails");
    assert_names_stage(&e, "test_spin");
    let line = p.wait_log(
        "a sampling step overran limits.max_step_ms: its thread is written off",
        WAIT,
    );
    assert!(line.contains("test_spin"), "{line}");
    let metrics = p.scrape();
    assert!(
        metrics.contains("samplerd_stuck_steps_total{stage=\"test_spin\"} 1"),
        "{metrics}"
    );
    // A second stuck request in flight at SIGTERM.
    let in_flight = spawn_sample(&client, sample(stuck_chain("test_sleep", 60e3), 2));
    let t0 = Instant::now();
    p.terminate();
    let status = p.wait_exit(Duration::from_secs(5 + 10));
    assert_eq!(status.code(), Some(0), "{status:?}");
    assert!(t0.elapsed() < Duration::from_secs(5 + 10));
    let code = answer(in_flight)
        .await
        .expect_err("no answer from a stuck stage")
        .code();
    assert!(
        matches!(
            code,
            Code::DeadlineExceeded | Code::Unavailable | Code::Unknown
        ),
        "{code:?}"
    );
}
