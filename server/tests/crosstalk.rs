//! No cross-talk under concurrency: 32 mixed requests (Sample with different
//! parameters, chains, windows and seeds; SampleStream sessions; Generate
//! when `SAMPLERD_MODEL` names a model) are each run alone first, then all
//! at once on the same server; every response must equal its solo run.
//! Shared state that could leak between requests — the pooled token
//! buffers, the shared default chain, plugin states, the blocking pool, the
//! model's thread pool and KV caches — would show up as a difference.

mod common;

use std::sync::Arc;
use std::time::Duration;

use common::*;
use prost::Message;
use samplerd::generate::generator::Generator;
use samplerd::generate::{GenerateConfig, ModelHost};
use samplerd_api::v1;
use samplerd_api::v1::generate_response::Event;
use tokio::sync::Barrier;

/// Requests in the concurrent burst.
const N_REQUESTS: usize = 32;
/// Of which Generate (when a model is available).
const N_GENERATE: usize = 4;
/// Of which SampleStream sessions.
const N_STREAMS: usize = 8;
/// Messages per SampleStream session.
const STREAM_STEPS: usize = 6;
/// Tokens per Generate request (short: the model runs on 2 shared cores).
const GENERATE_TOKENS: u32 = 12;
/// Upper bound on the whole burst.
const BURST_TIMEOUT: Duration = Duration::from_secs(300);

/// One request of the mix.
#[derive(Clone, Debug)]
enum Req {
    Sample(v1::SampleRequest),
    Stream(Vec<v1::SampleStreamRequest>),
    Generate(v1::GenerateRequest),
}

/// Varied sampling parameters for request `i` (every one sets its seed).
fn params(i: usize) -> v1::SamplingParams {
    let varied = match i % 6 {
        0 => v1::SamplingParams::default(),
        1 => v1::SamplingParams {
            temperature: Some(0.0),
            ..Default::default()
        },
        2 => v1::SamplingParams {
            temperature: Some(1.3),
            top_k: Some(0),
            top_p: Some(0.8),
            min_p: Some(0.02),
            ..Default::default()
        },
        3 => v1::SamplingParams {
            repeat_penalty: Some(1.5),
            frequency_penalty: Some(0.3),
            presence_penalty: Some(0.2),
            repeat_last_n: Some(16),
            logit_bias: [(3, 4.0), (7, -2.0)].into_iter().collect(),
            ..Default::default()
        },
        4 => v1::SamplingParams {
            typical_p: Some(0.9),
            samplers: vec!["top_k".into(), "typical_p".into(), "temperature".into()],
            ..Default::default()
        },
        _ => v1::SamplingParams {
            chain: vec![
                number_stage("top_k", &[("k", 20.0)]),
                number_stage("dist", &[]),
            ],
            ..Default::default()
        },
    };
    v1::SamplingParams {
        seed: Some(1000 + i as u64),
        ..varied
    }
}

/// The mix: Generate first (when available), then streams, then Sample.
fn mix(with_model: bool) -> Vec<Req> {
    let n_generate = if with_model { N_GENERATE } else { 0 };
    let prompts = [
        "Tell me about the sea.",
        "List three colours.",
        "What is 2 + 2?",
        "Write a haiku about rain.",
    ];
    (0..N_REQUESTS)
        .map(|i| {
            if i < n_generate {
                Req::Generate(v1::GenerateRequest {
                    messages: vec![v1::ChatMessage {
                        role: "user".into(),
                        content: prompts[i % prompts.len()].into(),
                    }],
                    max_tokens: Some(GENERATE_TOKENS),
                    params: Some(params(i)),
                    ignore_eos: true,
                    n_probs: (i % 3) as u32,
                    ..Default::default()
                })
            } else if i < n_generate + N_STREAMS {
                let vocab = 500 + 137 * i;
                Req::Stream(
                    (0..STREAM_STEPS)
                        .map(|step| v1::SampleStreamRequest {
                            logits: logits(vocab, (i * 100 + step) as u64),
                            previous_tokens: if step == 0 { vec![1, 2, 3, 2] } else { vec![] },
                            params: (step == 0).then(|| params(i)),
                            n_probs: (i % 4) as u32,
                            post_sampling_probs: i % 2 == 0,
                            ..Default::default()
                        })
                        .collect(),
                )
            } else {
                let vocab = 1000 + 1531 * i;
                let l = logits(vocab, i as u64);
                let (floats, bytes) = if i % 2 == 0 {
                    (l, Vec::new())
                } else {
                    (Vec::new(), to_bytes(&l))
                };
                Req::Sample(v1::SampleRequest {
                    logits: floats,
                    logits_f32le: bytes.into(),
                    previous_tokens: (0..(i as u32 % 40)).collect(),
                    params: Some(params(i)),
                    step: i as u64 * 3,
                    n_probs: (i % 5) as u32,
                    post_sampling_probs: i % 3 == 0,
                    constraint_tokens: Vec::new(),
                    sparse: None,
                    shared: None,
                })
            }
        })
        .collect()
}

/// Runs one request; the responses, encoded (Generate's wall-clock timings
/// removed, everything else kept).
async fn run(s: &TestServer, req: Req) -> Vec<Vec<u8>> {
    let mut client = s.client.clone();
    match req {
        Req::Sample(r) => vec![s.sample_ok(r).await.encode_to_vec()],
        Req::Stream(msgs) => {
            let n = msgs.len();
            let out: Vec<_> = s
                .stream_all(msgs)
                .await
                .iter()
                .map(|r| r.encode_to_vec())
                .collect();
            assert_eq!(out.len(), n, "one response per message");
            out
        }
        Req::Generate(r) => {
            let mut st = client
                .generate(r)
                .await
                .expect("Generate starts")
                .into_inner();
            let mut out = Vec::new();
            while let Some(mut m) = st.message().await.expect("Generate succeeds") {
                if let Some(Event::Finished(f)) = &mut m.event {
                    assert!(f.timings.is_some());
                    without_run_details(f);
                }
                out.push(m.encode_to_vec());
            }
            assert!(out.len() as u32 > GENERATE_TOKENS, "tokens and Finished");
            out
        }
    }
}

fn model_host() -> Option<Arc<dyn Generator>> {
    let cfg = GenerateConfig {
        n_ctx: 512,
        ..Default::default()
    };
    Some(Arc::new(
        ModelHost::load(&model_path()?, cfg).expect("model loads"),
    ))
}

async fn server(generator: Option<Arc<dyn Generator>>) -> TestServer {
    start_serving(test_config(), generator).await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn concurrent_mixed_requests_equal_their_solo_runs() {
    let generator = model_host();
    if generator.is_none() {
        eprintln!("SAMPLERD_MODEL is not set: the mix has no Generate requests");
    }
    let reqs = mix(generator.is_some());
    let s = Arc::new(server(generator).await);

    let mut solo = Vec::with_capacity(reqs.len());
    for r in &reqs {
        solo.push(run(&s, r.clone()).await);
    }

    // All at once: every task waits at the barrier, then sends.
    let barrier = Arc::new(Barrier::new(reqs.len()));
    let tasks: Vec<_> = reqs
        .iter()
        .cloned()
        .map(|r| {
            let (s, barrier) = (s.clone(), barrier.clone());
            tokio::spawn(async move {
                barrier.wait().await;
                run(&s, r).await
            })
        })
        .collect();
    let together = tokio::time::timeout(BURST_TIMEOUT, futures::future::join_all(tasks))
        .await
        .expect("the concurrent burst finished in time");

    let mut kinds = [0usize; 3];
    for (i, (alone, t)) in solo.iter().zip(together).enumerate() {
        let t = t.expect("request task");
        let kind = match &reqs[i] {
            Req::Sample(_) => 0,
            Req::Stream(_) => 1,
            Req::Generate(_) => 2,
        };
        kinds[kind] += 1;
        assert_eq!(
            alone, &t,
            "request {i} ({kind:?}: 0 Sample, 1 SampleStream, 2 Generate) differs under concurrency"
        );
    }
    assert_eq!(kinds.iter().sum::<usize>(), N_REQUESTS);
    eprintln!(
        "no cross-talk: {} Sample, {} SampleStream, {} Generate requests equal their solo runs",
        kinds[0], kinds[1], kinds[2]
    );
    s.assert_serving().await;
    Arc::try_unwrap(s).ok().expect("sole owner").stop().await;
}
