//! Graceful shutdown of the real `samplerd serve` process: after SIGTERM
//! the health check turns NOT_SERVING, new RPCs are refused with
//! UNAVAILABLE, a stream already running completes intact, and the process
//! exits 0; a stream that outlives `shutdown.grace_period_secs` is cut and
//! the process still exits 0. With `SAMPLERD_MODEL` set, a Generate stream
//! in flight is also finished intact.

mod common;
mod process;

use std::time::Duration;

use common::{
    Reason, argmax, assert_clean_end, assert_health, assert_reason, exact_generate, health_watch,
    logits, next_message, open_stream, wait_health,
};
use samplerd::app::server::LIVENESS_SERVICE;
use samplerd_api::v1;
use samplerd_api::v1::sampler_client::SamplerClient;
use tonic::Code;
use tonic::transport::Channel;
use tonic_health::pb::health_check_response::ServingStatus;

/// Bound on any single RPC step in these tests.
const STEP_TIMEOUT: Duration = Duration::from_secs(20);
/// Bound on the exit after the last stream ended (drain + close timeout).
const EXIT_TIMEOUT: Duration = Duration::from_secs(15);
/// Vocabulary of the test logits.
const VOCAB: usize = 4096;

fn greedy() -> Option<v1::SamplingParams> {
    Some(v1::SamplingParams {
        temperature: Some(0.0),
        ..Default::default()
    })
}

fn stream_msg(i: u64, first: bool) -> v1::SampleStreamRequest {
    v1::SampleStreamRequest {
        logits: logits(VOCAB, i),
        params: if first { greedy() } else { None },
        ..Default::default()
    }
}

/// A new RPC during the drain gets UNAVAILABLE (or, once the listener has
/// closed, a connection error, which clients also see as UNAVAILABLE).
async fn assert_refused(client: &mut SamplerClient<Channel>) {
    let err = tokio::time::timeout(
        STEP_TIMEOUT,
        client.sample(v1::SampleRequest {
            logits: logits(VOCAB, 99),
            ..Default::default()
        }),
    )
    .await
    .expect("refusal in time")
    .expect_err("new request refused while draining");
    assert_eq!(err.code(), Code::Unavailable, "{err:?}");
    assert!(err.message().contains("shutting down"), "{err:?}");
    assert_reason(&err, Reason::ShuttingDown);
}

#[tokio::test]
async fn stream_in_flight_at_sigterm_completes_and_process_exits_0() {
    let mut p = process::start("[shutdown]\ngrace_period_secs = 20\n");
    let ch = p.channel().await;
    let mut client = SamplerClient::new(ch.clone());
    let mut health = health_watch(&ch).await;

    // A stream in flight: one step answered, more to come.
    const STEPS: u64 = 6;
    let (tx, mut responses, first) = open_stream(&mut client, stream_msg(0, true)).await;
    assert_eq!(first.token_id, argmax(&logits(VOCAB, 0)));

    p.terminate();
    wait_health(&mut health, ServingStatus::NotServing, STEP_TIMEOUT).await;
    // Liveness stays SERVING while draining (the pod is not restarted).
    assert_health(&ch, LIVENESS_SERVICE, ServingStatus::Serving).await;
    assert_refused(&mut client).await;
    let err = client
        .list_stages(v1::ListStagesRequest {})
        .await
        .expect_err("ListStages refused too");
    assert_eq!(err.code(), Code::Unavailable, "{err:?}");

    // The running stream goes on: every step answered, in order, greedy.
    for i in 1..STEPS {
        tx.send(stream_msg(i, false)).await.unwrap();
        let r = tokio::time::timeout(STEP_TIMEOUT, responses.message())
            .await
            .expect("step in time")
            .unwrap_or_else(|e| panic!("step {i} failed during the drain: {e:?}"))
            .expect("a response");
        assert_eq!(r.step, i, "steps stay in order");
        assert_eq!(r.token_id, argmax(&logits(VOCAB, i)));
    }
    drop(tx);
    assert_clean_end(&mut responses, STEP_TIMEOUT).await;
    drop(health);

    let status = p.wait_exit(EXIT_TIMEOUT);
    assert_eq!(status.code(), Some(0), "{status:?}");
    let stopped = p.wait_log("samplerd stopped", Duration::from_secs(5));
    assert!(stopped.contains("INFO"), "{stopped}");
}

/// The signals that must not stop a serving process (logrotate's
/// `kill -HUP`, stray user signals, an alarm) are each logged as one line
/// and otherwise ignored, streams and health untouched; SIGQUIT drains like
/// SIGTERM and the process exits 0.
#[tokio::test]
async fn hup_usr1_usr2_and_alrm_are_logged_and_ignored_and_sigquit_drains() {
    let mut p = process::start("[shutdown]\ngrace_period_secs = 5\n");
    let ch = p.channel().await;
    let mut client = SamplerClient::new(ch.clone());
    let (tx, mut responses, _) = open_stream(&mut client, stream_msg(0, true)).await;
    for name in ["HUP", "USR1", "USR2", "ALRM"] {
        p.signal(name);
        let line = p.wait_log_starting(&format!("SIG{name} received: ignored ("), STEP_TIMEOUT);
        assert!(line.contains("WARN"), "{line}");
    }
    // Nothing else happened: still SERVING, the stream goes on.
    assert_health(&ch, "", ServingStatus::Serving).await;
    tx.send(stream_msg(1, false)).await.unwrap();
    let r = next_message(&mut responses, STEP_TIMEOUT).await;
    assert_eq!(r.token_id, argmax(&logits(VOCAB, 1)));
    drop(tx);
    assert_clean_end(&mut responses, STEP_TIMEOUT).await;

    p.signal("QUIT");
    p.wait_log("SIGQUIT received", STEP_TIMEOUT);
    p.wait_log(
        "shutting down: NOT_SERVING, refusing new requests, draining",
        STEP_TIMEOUT,
    );
    let status = p.wait_exit(EXIT_TIMEOUT);
    assert_eq!(status.code(), Some(0), "{status:?}");
    p.wait_log("samplerd stopped", Duration::from_secs(5));
}

/// SIGTERM the moment the server says it serves: the handler is already
/// installed (a signal before the first poll of the shutdown future must not
/// take the default action and kill the process undrained).
#[test]
fn sigterm_as_soon_as_it_serves_drains_and_exits_0() {
    let mut p = process::start("[shutdown]\ngrace_period_secs = 5\n");
    p.terminate();
    let status = p.wait_exit(EXIT_TIMEOUT);
    assert_eq!(status.code(), Some(0), "{status:?}");
    p.wait_log("samplerd stopped", Duration::from_secs(5));
}

#[tokio::test]
async fn stream_past_the_grace_period_is_cut_and_process_still_exits_0() {
    let mut p = process::start("[shutdown]\ngrace_period_secs = 1\n");
    let ch = p.channel().await;
    let mut client = SamplerClient::new(ch);
    let (tx, mut responses, _) = open_stream(&mut client, stream_msg(0, true)).await;

    // The client keeps the stream open (sends nothing): the server must not
    // wait for it beyond the grace period.
    p.terminate();
    p.wait_log(
        "grace period over: cutting the requests still running",
        STEP_TIMEOUT,
    );
    let status = p.wait_exit(EXIT_TIMEOUT);
    assert_eq!(status.code(), Some(0), "{status:?}");
    let end = tokio::time::timeout(STEP_TIMEOUT, responses.message())
        .await
        .expect("the cut reaches the client in time");
    assert!(end.is_err(), "a cut stream ends with an error: {end:?}");
    drop(tx);
}

#[tokio::test]
async fn generate_in_flight_at_sigterm_completes_intact() {
    let Some(model) = process::model_path() else {
        eprintln!("SAMPLERD_MODEL is not set: skipping the Generate shutdown test");
        return;
    };
    let mut p = process::start(&format!(
        "[model]\npath = {}\n[shutdown]\ngrace_period_secs = 60\n",
        process::toml_path(&model)
    ));
    let ch = p.channel().await;
    let mut client = SamplerClient::new(ch.clone());
    let mut health = health_watch(&ch).await;
    const MAX_TOKENS: u32 = 48;
    let mut events = client
        .generate(v1::GenerateRequest {
            params: greedy(),
            ..exact_generate("Once upon a time", MAX_TOKENS)
        })
        .await
        .expect("generate starts")
        .into_inner();
    let first = next_message(&mut events, STEP_TIMEOUT).await;
    assert!(matches!(
        first.event,
        Some(v1::generate_response::Event::Token(_))
    ));

    p.terminate();
    wait_health(&mut health, ServingStatus::NotServing, STEP_TIMEOUT).await;
    assert_refused(&mut client).await;

    let mut tokens = 1;
    let finished = loop {
        let ev = tokio::time::timeout(STEP_TIMEOUT, events.message())
            .await
            .expect("token in time")
            .unwrap_or_else(|e| panic!("generation failed during the drain: {e:?}"))
            .expect("the stream ends with Finished");
        match ev.event {
            Some(v1::generate_response::Event::Token(_)) => tokens += 1,
            Some(v1::generate_response::Event::Finished(f)) => break f,
            Some(v1::generate_response::Event::PromptLogprobs(_)) => panic!("not asked for"),
            None => panic!("empty event"),
        }
    };
    assert_eq!(tokens, MAX_TOKENS);
    assert_eq!(finished.finish_reason, v1::FinishReason::MaxTokens as i32);
    assert_eq!(finished.usage.unwrap().completion_tokens, MAX_TOKENS);
    drop(health);
    let status = p.wait_exit(EXIT_TIMEOUT);
    assert_eq!(status.code(), Some(0), "{status:?}");
}

/// A model stand-in that turns ready when told.
struct Loading(std::sync::atomic::AtomicBool);

impl samplerd::generate::generator::Generator for Loading {
    fn ready(&self) -> bool {
        self.0.load(std::sync::atomic::Ordering::SeqCst)
    }

    fn generate(
        &self,
        _: samplerd::generate::generator::GenerateJob,
        _: samplerd::generate::generator::GenerateSink,
    ) {
    }
}

#[tokio::test]
async fn health_is_serving_only_once_the_model_is_ready() {
    let model = std::sync::Arc::new(Loading(Default::default()));
    let server = samplerd::app::server::spawn(common::test_config(), Some(model.clone()))
        .await
        .expect("server starts");
    let ch = common::connect(server.addr).await;
    let mut health = health_watch(&ch).await;
    let first = next_message(&mut health, STEP_TIMEOUT).await;
    assert_eq!(
        first.status,
        ServingStatus::NotServing as i32,
        "NOT_SERVING while the model loads"
    );
    // Liveness answers SERVING even while loading (no restart loop).
    assert_health(&ch, LIVENESS_SERVICE, ServingStatus::Serving).await;
    model.0.store(true, std::sync::atomic::Ordering::SeqCst);
    common::wait_serving(ch).await;
    drop(health);
    server.stop().await.expect("clean stop");
}
