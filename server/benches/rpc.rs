//! Loopback round-trip benchmark (a bench binary, not a timed test):
//! 151,936 logits through the default chain — `Sample` with raw bytes,
//! `Sample` with repeated float, `SampleStream` steps/s — beside the
//! transport floor, the test-only `samplerd.testing.v1.Noop` service that
//! receives the same messages and does nothing.
//!
//! Run: `cargo bench -p samplerd --bench rpc` (env RPC_BENCH_ITERS to
//! change the number of timed calls).

use std::path::PathBuf;
use std::time::{Duration, Instant};

use samplerd::config::Config;
use samplerd_api::testing::v1::noop_client::NoopClient;
use samplerd_api::testing::v1::noop_server::{Noop, NoopServer};
use samplerd_api::v1::sampler_client::SamplerClient;
use samplerd_api::v1::{SampleRequest, SampleResponse, SampleStreamRequest};
use tokio::sync::mpsc;
use tokio_stream::StreamExt;
use tokio_stream::wrappers::{ReceiverStream, TcpListenerStream};
use tonic::transport::Channel;
use tonic::{Request, Response, Status, Streaming};

const VOCAB: usize = 151_936;
const WARMUP: usize = 50;
const DEFAULT_ITERS: usize = 1000;
const MAX_MESSAGE: usize = 64 << 20;
const STREAM_WINDOW: u32 = 8 << 20;
const CONNECTION_WINDOW: u32 = 32 << 20;

struct NoopService;

#[tonic::async_trait]
impl Noop for NoopService {
    async fn sample(&self, r: Request<SampleRequest>) -> Result<Response<SampleResponse>, Status> {
        let r = r.into_inner();
        Ok(Response::new(SampleResponse {
            token_id: (r.logits.len() + r.logits_f32le.len()) as u32 % 7,
            ..Default::default()
        }))
    }

    type SampleStreamStream = ReceiverStream<Result<SampleResponse, Status>>;

    async fn sample_stream(
        &self,
        r: Request<Streaming<SampleStreamRequest>>,
    ) -> Result<Response<Self::SampleStreamStream>, Status> {
        let mut inbound = r.into_inner();
        let (tx, rx) = mpsc::channel(4);
        tokio::spawn(async move {
            while let Ok(Some(m)) = inbound.message().await {
                let resp = SampleResponse {
                    token_id: m.logits_f32le.len() as u32 % 7,
                    ..Default::default()
                };
                if tx.send(Ok(resp)).await.is_err() {
                    break;
                }
            }
        });
        Ok(Response::new(ReceiverStream::new(rx)))
    }
}

fn profile_dir() -> PathBuf {
    let exe = std::env::current_exe().unwrap();
    exe.parent().unwrap().parent().unwrap().to_path_buf()
}

fn random_logits(n: usize) -> Vec<f32> {
    let mut x: u64 = 0x9E37_79B9_7F4A_7C15;
    (0..n)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            // Roughly logit-like: mostly small, a few large.
            let u = (x >> 40) as f32 / (1u64 << 24) as f32;
            (u * 2.0 - 1.0) * 6.0
        })
        .collect()
}

async fn channel(addr: std::net::SocketAddr) -> Channel {
    Channel::from_shared(format!("http://{addr}"))
        .unwrap()
        .initial_stream_window_size(STREAM_WINDOW)
        .initial_connection_window_size(CONNECTION_WINDOW)
        .tcp_nodelay(true)
        .connect()
        .await
        .unwrap()
}

fn pct(sorted: &[Duration], q: f64) -> f64 {
    let i = ((sorted.len() - 1) as f64 * q).round() as usize;
    sorted[i].as_secs_f64() * 1e6
}

struct Row {
    name: &'static str,
    p50: f64,
    p99: f64,
}

async fn time_unary<F, Fut>(name: &'static str, iters: usize, mut call: F) -> Row
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = ()>,
{
    for _ in 0..WARMUP {
        call().await;
    }
    let mut lat = Vec::with_capacity(iters);
    for _ in 0..iters {
        let t = Instant::now();
        call().await;
        lat.push(t.elapsed());
    }
    lat.sort();
    Row {
        name,
        p50: pct(&lat, 0.5),
        p99: pct(&lat, 0.99),
    }
}

/// Steps/s of a stream driven one message at a time (send, await reply).
async fn stream_rate<S, Fut>(
    iters: usize,
    logits: &[u8],
    open: impl FnOnce(ReceiverStream<SampleStreamRequest>) -> Fut,
) -> (f64, Row)
where
    Fut: std::future::Future<Output = S>,
    S: tokio_stream::Stream<Item = Result<SampleResponse, Status>> + Unpin,
{
    let (tx, rx) = mpsc::channel(2);
    let mut out = open(ReceiverStream::new(rx)).await;
    let msg = SampleStreamRequest {
        logits_f32le: logits.to_vec().into(),
        ..Default::default()
    };
    for _ in 0..WARMUP {
        tx.send(msg.clone()).await.unwrap();
        out.next().await.unwrap().unwrap();
    }
    let mut lat = Vec::with_capacity(iters);
    let start = Instant::now();
    for _ in 0..iters {
        let t = Instant::now();
        tx.send(msg.clone()).await.unwrap();
        out.next().await.unwrap().unwrap();
        lat.push(t.elapsed());
    }
    let rate = iters as f64 / start.elapsed().as_secs_f64();
    lat.sort();
    (
        rate,
        Row {
            name: "",
            p50: pct(&lat, 0.5),
            p99: pct(&lat, 0.99),
        },
    )
}

#[tokio::main(flavor = "multi_thread")]
async fn main() {
    // `cargo bench` passes `--bench`; nothing else to parse.
    let iters = std::env::var("RPC_BENCH_ITERS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(DEFAULT_ITERS);
    let mut cfg = Config {
        listen: "127.0.0.1:0".parse().unwrap(),
        ..Default::default()
    };
    // cargo leaves a dev-dependency's cdylib in deps/.
    let lib = "libsamplerd_core_stages.so";
    let dir = profile_dir();
    let core = [dir.join("deps").join(lib), dir.join(lib)]
        .into_iter()
        .find(|p| p.is_file())
        .expect("core plugin built (cargo bench builds it as a dev-dependency)");
    cfg.plugins.files = vec![core];
    let server = samplerd::server::spawn(cfg, None)
        .await
        .expect("samplerd starts");

    let noop_listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let noop_addr = noop_listener.local_addr().unwrap();
    let incoming = TcpListenerStream::new(noop_listener).map(|s| {
        if let Ok(s) = &s {
            let _ = s.set_nodelay(true);
        }
        s
    });
    tokio::spawn(
        tonic::transport::Server::builder()
            .initial_stream_window_size(STREAM_WINDOW)
            .initial_connection_window_size(CONNECTION_WINDOW)
            .add_service(
                NoopServer::new(NoopService)
                    .max_decoding_message_size(MAX_MESSAGE)
                    .max_encoding_message_size(MAX_MESSAGE),
            )
            .serve_with_incoming(incoming),
    );

    let sampler = SamplerClient::new(channel(server.addr).await)
        .max_encoding_message_size(MAX_MESSAGE)
        .max_decoding_message_size(MAX_MESSAGE);
    let noop = NoopClient::new(channel(noop_addr).await)
        .max_encoding_message_size(MAX_MESSAGE)
        .max_decoding_message_size(MAX_MESSAGE);

    let logits = random_logits(VOCAB);
    let bytes: Vec<u8> = logits.iter().flat_map(|f| f.to_le_bytes()).collect();
    let req_bytes = SampleRequest {
        logits_f32le: bytes.clone().into(),
        ..Default::default()
    };
    let req_floats = SampleRequest {
        logits: logits.clone(),
        ..Default::default()
    };

    println!("samplerd RPC benchmark: vocab {VOCAB}, {iters} calls each, default chain");
    println!("chain: {}", server.state.defaults.chain.describe());

    let mut rows = Vec::new();
    {
        let c = noop.clone();
        let r = req_bytes.clone();
        rows.push(
            time_unary("noop raw bytes (floor)", iters, || {
                let mut c = c.clone();
                let r = r.clone();
                async move {
                    c.sample(r).await.unwrap();
                }
            })
            .await,
        );
    }
    {
        let c = sampler.clone();
        let r = req_bytes.clone();
        rows.push(
            time_unary("Sample raw bytes", iters, || {
                let mut c = c.clone();
                let r = r.clone();
                async move {
                    c.sample(r).await.unwrap();
                }
            })
            .await,
        );
    }
    {
        let c = noop.clone();
        let r = req_floats.clone();
        rows.push(
            time_unary("noop repeated float (floor)", iters, || {
                let mut c = c.clone();
                let r = r.clone();
                async move {
                    c.sample(r).await.unwrap();
                }
            })
            .await,
        );
    }
    {
        let c = sampler.clone();
        let r = req_floats.clone();
        rows.push(
            time_unary("Sample repeated float", iters, || {
                let mut c = c.clone();
                let r = r.clone();
                async move {
                    c.sample(r).await.unwrap();
                }
            })
            .await,
        );
    }
    println!(
        "\n{:<30} {:>10} {:>10} {:>12}",
        "unary", "p50 µs", "p99 µs", "p50 / floor"
    );
    for (i, r) in rows.iter().enumerate() {
        let floor = rows[i - i % 2].p50;
        println!(
            "{:<30} {:>10.1} {:>10.1} {:>11.2}x",
            r.name,
            r.p50,
            r.p99,
            r.p50 / floor
        );
    }

    let mut nc = noop.clone();
    let (noop_rate, noop_row) = stream_rate(iters, &bytes, |rx| async move {
        nc.sample_stream(rx).await.unwrap().into_inner()
    })
    .await;
    let mut sc = sampler.clone();
    let (rate, row) = stream_rate(iters, &bytes, |rx| async move {
        sc.sample_stream(rx).await.unwrap().into_inner()
    })
    .await;
    println!(
        "\n{:<30} {:>10} {:>10} {:>12}",
        "stream (raw bytes)", "steps/s", "p50 µs", "p99 µs"
    );
    println!(
        "{:<30} {:>10.0} {:>10.1} {:>12.1}",
        "noop stream (floor)", noop_rate, noop_row.p50, noop_row.p99
    );
    println!(
        "{:<30} {:>10.0} {:>10.1} {:>12.1}",
        "SampleStream", rate, row.p50, row.p99
    );
    println!("\nSampleStream / floor rate: {:.2}", rate / noop_rate);

    let _ = server.stop().await;
}
