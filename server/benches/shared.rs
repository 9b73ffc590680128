//! Shared-memory rows against inline rows (a bench binary, not a timed
//! test), 151,936 logits per row, default chain, one in-process server
//! listening on TCP loopback and on a Unix socket:
//!
//! 1. `SampleBatch` and `SampleBatchStream`, 32 rows per call/message:
//!    rows/s with inline f32 rows (TCP and Unix socket) and with shared
//!    rows (Unix socket), the series alternating call by call so all see
//!    the same load on a shared machine.
//! 2. `Sample` of one row over the Unix socket with a shared row, against
//!    the transport floor: the test-only `samplerd.testing.v1.Noop`
//!    service on a Unix socket of its own, sent the same message.
//! 3. The physical floor: the fused load pass alone (copy, check, max,
//!    log-sum-exp: what every row costs at least) over the shared mapping,
//!    rows/s on one core.
//!
//! Medians over rounds; the spread (min–max of the rounds) beside them.
//! Run: `cargo bench -p samplerd --bench shared` (env SHARED_BENCH_ITERS:
//! calls per series and round, SHARED_BENCH_ROUNDS: rounds,
//! SHARED_BENCH_PARALLEL_LOGPROB=0: no log-sum-exp helper core).

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use samplerd::app::config::Config;
use samplerd::transport::listen::{Listen, ListenAddr};
use samplerd_api::testing::v1::noop_client::NoopClient;
use samplerd_api::testing::v1::noop_server::{Noop, NoopServer};
use samplerd_api::v1::sampler_client::SamplerClient;
use samplerd_api::v1::{
    BatchRow, BatchStreamRow, LogitsDtype, RegisterSharedMemoryRequest, SampleBatchRequest,
    SampleBatchResponse, SampleBatchStreamRequest, SampleRequest, SampleResponse,
    SampleStreamRequest, SharedLogits,
};
use samplerd_sampling::TokenBuffer;
use samplerd_sampling::step::{Logits, NoDeferral, load};
use tokio::sync::mpsc;
use tokio_stream::StreamExt;
use tokio_stream::wrappers::{ReceiverStream, UnixListenerStream};
use tonic::transport::{Channel, Endpoint};
use tonic::{Request, Response, Status, Streaming};

const VOCAB: usize = 151_936;
const ROWS: usize = 32;
const WARMUP: usize = 5;
const DEFAULT_ITERS: usize = 40;
const DEFAULT_ROUNDS: usize = 3;
const MAX_MESSAGE: usize = 64 << 20;

struct NoopService;

#[tonic::async_trait]
impl Noop for NoopService {
    async fn sample(&self, r: Request<SampleRequest>) -> Result<Response<SampleResponse>, Status> {
        let r = r.into_inner();
        Ok(Response::new(SampleResponse {
            token_id: r.shared.map_or(0, |s| s.count % 7),
            ..Default::default()
        }))
    }

    type SampleStreamStream = ReceiverStream<Result<SampleResponse, Status>>;

    async fn sample_stream(
        &self,
        _: Request<Streaming<SampleStreamRequest>>,
    ) -> Result<Response<Self::SampleStreamStream>, Status> {
        Err(Status::unimplemented("not measured here"))
    }
}

fn profile_dir() -> PathBuf {
    let exe = std::env::current_exe().unwrap();
    exe.parent().unwrap().parent().unwrap().to_path_buf()
}

fn random_row(n: usize, seed: u64) -> Vec<u8> {
    let mut x: u64 = 0x9E37_79B9_7F4A_7C15 ^ seed.wrapping_mul(0x2545_F491_4F6C_DD1D);
    (0..n)
        .flat_map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            let u = (x >> 40) as f32 / (1u64 << 24) as f32;
            ((u * 2.0 - 1.0) * 6.0).to_le_bytes()
        })
        .collect()
}

async fn unix_channel(path: &Path) -> Channel {
    let path = path.to_path_buf();
    Endpoint::try_from("http://localhost")
        .unwrap()
        .initial_stream_window_size(8 << 20)
        .initial_connection_window_size(32 << 20)
        .connect_with_connector(tower::service_fn(move |_| {
            let p = path.clone();
            async move {
                Ok::<_, std::io::Error>(hyper_util::rt::TokioIo::new(
                    tokio::net::UnixStream::connect(p).await?,
                ))
            }
        }))
        .await
        .unwrap()
}

async fn tcp_channel(addr: std::net::SocketAddr) -> Channel {
    Channel::from_shared(format!("http://{addr}"))
        .unwrap()
        .initial_stream_window_size(8 << 20)
        .initial_connection_window_size(32 << 20)
        .tcp_nodelay(true)
        .connect()
        .await
        .unwrap()
}

fn client(ch: Channel) -> SamplerClient<Channel> {
    SamplerClient::new(ch)
        .max_encoding_message_size(MAX_MESSAGE)
        .max_decoding_message_size(MAX_MESSAGE)
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

fn spread(v: &[f64]) -> (f64, f64) {
    let lo = v.iter().copied().fold(f64::INFINITY, f64::min);
    let hi = v.iter().copied().fold(f64::NEG_INFINITY, f64::max);
    (lo, hi)
}

fn median_dur(mut v: Vec<Duration>) -> Duration {
    v.sort();
    v[v.len() / 2]
}

/// A boxed call of one series.
type Call = Box<dyn FnMut() -> std::pin::Pin<Box<dyn std::future::Future<Output = ()>>>>;

/// Runs the series call by call in turn (the order rotated every
/// iteration); returns each series' latencies.
async fn alternate(iters: usize, series: &mut [Call]) -> Vec<Vec<Duration>> {
    let n = series.len();
    for _ in 0..WARMUP {
        for s in series.iter_mut() {
            s().await;
        }
    }
    let mut out = vec![Vec::with_capacity(iters); n];
    for i in 0..iters {
        for k in 0..n {
            let j = (i + k) % n;
            let t = Instant::now();
            series[j]().await;
            out[j].push(t.elapsed());
        }
    }
    out
}

/// A SampleBatchStream driven one message at a time.
struct BatchDriver {
    tx: mpsc::Sender<SampleBatchStreamRequest>,
    out: Streaming<SampleBatchResponse>,
}

impl BatchDriver {
    async fn open(c: &SamplerClient<Channel>) -> Self {
        let (tx, rx) = mpsc::channel(2);
        let out = c
            .clone()
            .sample_batch_stream(ReceiverStream::new(rx))
            .await
            .unwrap()
            .into_inner();
        BatchDriver { tx, out }
    }

    async fn step(&mut self, msg: SampleBatchStreamRequest) {
        self.tx.send(msg).await.unwrap();
        self.out.next().await.unwrap().unwrap();
    }
}

#[tokio::main(flavor = "multi_thread")]
async fn main() {
    let env = |k: &str, d: usize| {
        std::env::var(k)
            .ok()
            .and_then(|v| v.parse().ok())
            .unwrap_or(d)
    };
    let iters = env("SHARED_BENCH_ITERS", DEFAULT_ITERS);
    let rounds = env("SHARED_BENCH_ROUNDS", DEFAULT_ROUNDS).max(1);

    let dir = PathBuf::from(format!("/dev/shm/samplerd-bench-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    let sock = dir.join("samplerd.sock");
    let noop_sock = dir.join("noop.sock");

    let mut cfg = Config {
        listen: Listen::new(vec![
            ListenAddr::Tcp("127.0.0.1:0".parse().unwrap()),
            ListenAddr::Unix(sock.clone()),
        ])
        .unwrap(),
        ..Default::default()
    };
    cfg.transport.shared_memory_dirs = vec![dir.clone()];
    // SHARED_BENCH_PARALLEL_LOGPROB=0: no log-sum-exp helper core (A/B).
    if std::env::var("SHARED_BENCH_PARALLEL_LOGPROB").is_ok_and(|v| v == "0") {
        cfg.limits.parallel_logprob.enabled = false;
    }
    let lib = "libsamplerd_core_stages.so";
    let pd = profile_dir();
    cfg.plugins.files = vec![
        [pd.join("deps").join(lib), pd.join(lib)]
            .into_iter()
            .find(|p| p.is_file())
            .expect("core plugin built"),
    ];
    let server = samplerd::app::server::spawn(cfg, None).await.unwrap();

    let noop_listener = tokio::net::UnixListener::bind(&noop_sock).unwrap();
    tokio::spawn(
        tonic::transport::Server::builder()
            .initial_stream_window_size(8 << 20)
            .initial_connection_window_size(32 << 20)
            .max_frame_size(samplerd::app::server::HTTP2_MAX_FRAME_BYTES)
            .add_service(NoopServer::new(NoopService))
            .serve_with_incoming(UnixListenerStream::new(noop_listener)),
    );

    let uds = client(unix_channel(&sock).await);
    let tcp = client(tcp_channel(server.addr).await);
    let noop = NoopClient::new(unix_channel(&noop_sock).await);

    // The region: ROWS rows of random logits.
    let rows: Vec<Vec<u8>> = (0..ROWS).map(|i| random_row(VOCAB, i as u64)).collect();
    let region = dir.join("rows");
    std::fs::write(&region, rows.concat()).unwrap();
    uds.clone()
        .register_shared_memory(RegisterSharedMemoryRequest {
            name: "rows".into(),
            path: region.display().to_string(),
            byte_size: (ROWS * VOCAB * 4) as u64,
        })
        .await
        .unwrap();
    let shared = |i: usize| SharedLogits {
        region: "rows".into(),
        offset: (i * VOCAB * 4) as u64,
        count: VOCAB as u32,
        dtype: LogitsDtype::F32le as i32,
    };

    let batch_inline = SampleBatchRequest {
        rows: rows
            .iter()
            .enumerate()
            .map(|(i, r)| BatchRow {
                logits: r.clone().into(),
                step: i as u64,
                ..Default::default()
            })
            .collect(),
        ..Default::default()
    };
    let batch_shared = SampleBatchRequest {
        rows: (0..ROWS)
            .map(|i| BatchRow {
                shared: Some(shared(i)),
                step: i as u64,
                ..Default::default()
            })
            .collect(),
        ..Default::default()
    };
    let stream_msg = |shared_rows: bool| SampleBatchStreamRequest {
        rows: (0..ROWS)
            .map(|i| BatchStreamRow {
                sequence_id: i as u64,
                logits: if shared_rows {
                    Default::default()
                } else {
                    rows[i].clone().into()
                },
                shared: shared_rows.then(|| shared(i)),
                ..Default::default()
            })
            .collect(),
        ..Default::default()
    };
    let one_shared = SampleRequest {
        shared: Some(shared(0)),
        ..Default::default()
    };
    let one_inline = SampleRequest {
        logits_f32le: rows[0].clone().into(),
        ..Default::default()
    };

    println!(
        "shared-memory rows vs inline rows: vocab {VOCAB}, {ROWS} rows per batch call, \
         {iters} calls per series, {rounds} rounds, default chain ({}), {} cores",
        server.state.defaults.chain.describe(),
        std::thread::available_parallelism().map_or(0, |n| n.get())
    );

    // Results per round.
    let mut batch_rps: Vec<[f64; 3]> = Vec::new();
    let mut stream_rps: Vec<[f64; 3]> = Vec::new();
    let mut unary_us: Vec<[f64; 3]> = Vec::new();
    let mut scan_rps: Vec<f64> = Vec::new();
    let mut warm_rps: Vec<f64> = Vec::new();
    for round in 1..=rounds {
        // 1a. SampleBatch: inline over TCP, inline over UDS, shared over UDS.
        let mut series: Vec<Call> = vec![
            {
                let (c, r) = (tcp.clone(), batch_inline.clone());
                Box::new(move || {
                    let (mut c, r) = (c.clone(), r.clone());
                    Box::pin(async move {
                        c.sample_batch(r).await.unwrap();
                    })
                })
            },
            {
                let (c, r) = (uds.clone(), batch_inline.clone());
                Box::new(move || {
                    let (mut c, r) = (c.clone(), r.clone());
                    Box::pin(async move {
                        c.sample_batch(r).await.unwrap();
                    })
                })
            },
            {
                let (c, r) = (uds.clone(), batch_shared.clone());
                Box::new(move || {
                    let (mut c, r) = (c.clone(), r.clone());
                    Box::pin(async move {
                        c.sample_batch(r).await.unwrap();
                    })
                })
            },
        ];
        let lat = alternate(iters, &mut series).await;
        let rps = |l: &Vec<Duration>| ROWS as f64 / median_dur(l.clone()).as_secs_f64();
        batch_rps.push([rps(&lat[0]), rps(&lat[1]), rps(&lat[2])]);

        // 1b. SampleBatchStream: the same three, one stream each.
        let drivers = [
            std::rc::Rc::new(tokio::sync::Mutex::new(BatchDriver::open(&tcp).await)),
            std::rc::Rc::new(tokio::sync::Mutex::new(BatchDriver::open(&uds).await)),
            std::rc::Rc::new(tokio::sync::Mutex::new(BatchDriver::open(&uds).await)),
        ];
        let mut series: Vec<Call> = drivers
            .iter()
            .enumerate()
            .map(|(k, d)| {
                let d = d.clone();
                let msg = stream_msg(k == 2);
                Box::new(move || {
                    let (d, msg) = (d.clone(), msg.clone());
                    Box::pin(async move {
                        d.lock().await.step(msg).await;
                    })
                        as std::pin::Pin<Box<dyn std::future::Future<Output = ()>>>
                }) as Call
            })
            .collect();
        let lat = alternate(iters, &mut series).await;
        stream_rps.push([rps(&lat[0]), rps(&lat[1]), rps(&lat[2])]);
        drop(series);
        drop(drivers);

        // 2. Sample over the Unix socket: noop floor, shared, inline.
        let mut series: Vec<Call> = vec![
            {
                let (c, r) = (noop.clone(), one_shared.clone());
                Box::new(move || {
                    let (mut c, r) = (c.clone(), r.clone());
                    Box::pin(async move {
                        c.sample(r).await.unwrap();
                    })
                })
            },
            {
                let (c, r) = (uds.clone(), one_shared.clone());
                Box::new(move || {
                    let (mut c, r) = (c.clone(), r.clone());
                    Box::pin(async move {
                        c.sample(r).await.unwrap();
                    })
                })
            },
            {
                let (c, r) = (uds.clone(), one_inline.clone());
                Box::new(move || {
                    let (mut c, r) = (c.clone(), r.clone());
                    Box::pin(async move {
                        c.sample(r).await.unwrap();
                    })
                })
            },
        ];
        let lat = alternate(iters * 10, &mut series).await;
        let us = |l: &Vec<Duration>| median_dur(l.clone()).as_secs_f64() * 1e6;
        unary_us.push([us(&lat[0]), us(&lat[1]), us(&lat[2])]);

        // 3. The fused load pass over the mapping, one core.
        let map = std::fs::read(&region).unwrap();
        let mut buf = TokenBuffer::new();
        let t = Instant::now();
        let n = iters * ROWS;
        for i in 0..n {
            let r = &map[(i % ROWS) * VOCAB * 4..(i % ROWS + 1) * VOCAB * 4];
            load::<NoDeferral>(&mut buf, Logits::F32le(r), None).unwrap();
        }
        scan_rps.push(n as f64 / t.elapsed().as_secs_f64());
        // The same row again and again (cache-warm, as Sample's row 0).
        let t = Instant::now();
        for _ in 0..n {
            load::<NoDeferral>(&mut buf, Logits::F32le(&map[..VOCAB * 4]), None).unwrap();
        }
        warm_rps.push(n as f64 / t.elapsed().as_secs_f64());
        println!("round {round}/{rounds} done");
    }

    let col = |v: &[[f64; 3]], k: usize| v.iter().map(|r| r[k]).collect::<Vec<f64>>();
    let show = |name: &str, v: Vec<f64>, unit: &str| {
        let (lo, hi) = spread(&v);
        println!(
            "  {name:<44} {:>10.0} {unit}   (rounds {lo:.0}–{hi:.0})",
            median(v)
        );
    };
    println!("\nSampleBatch, {ROWS} rows × {VOCAB} per call (rows/s, median call):");
    show(
        "inline f32 rows, TCP loopback",
        col(&batch_rps, 0),
        "rows/s",
    );
    show("inline f32 rows, Unix socket", col(&batch_rps, 1), "rows/s");
    show("shared rows, Unix socket", col(&batch_rps, 2), "rows/s");
    println!("SampleBatchStream, {ROWS} rows × {VOCAB} per message (rows/s, median message):");
    show(
        "inline f32 rows, TCP loopback",
        col(&stream_rps, 0),
        "rows/s",
    );
    show(
        "inline f32 rows, Unix socket",
        col(&stream_rps, 1),
        "rows/s",
    );
    show("shared rows, Unix socket", col(&stream_rps, 2), "rows/s");
    println!("Sample of one {VOCAB} row over a Unix socket (p50 µs):");
    show("no-op RPC, same message (floor)", col(&unary_us, 0), "µs");
    show("samplerd, shared row", col(&unary_us, 1), "µs");
    show("samplerd, inline logits_f32le", col(&unary_us, 2), "µs");
    println!("Physical floor:");
    show(
        "fused load pass alone, one core, 32 rows",
        scan_rps,
        "rows/s",
    );
    show(
        "the same, one row over and over (cached)",
        warm_rps,
        "rows/s",
    );
    let b = median(col(&batch_rps, 2)) / median(col(&batch_rps, 0));
    let s = median(col(&stream_rps, 2)) / median(col(&stream_rps, 0));
    let u = median(col(&unary_us, 1)) / median(col(&unary_us, 0));
    println!(
        "\nshared / inline (TCP): SampleBatch {b:.1}×, SampleBatchStream {s:.1}×; \
         Sample shared / no-op: {u:.2}×"
    );
    server.stop().await.unwrap();
    let _ = std::fs::remove_dir_all(&dir);
}
