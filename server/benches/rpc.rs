//! Loopback round-trip benchmark (a bench binary, not a timed test):
//! 151,936 logits through the default chain — `Sample` with raw bytes,
//! `Sample` with repeated float, `SampleStream` steps/s — beside the
//! transport floor, the test-only `samplerd.testing.v1.Noop` service that
//! receives the same messages and does nothing. Floor and samplerd calls
//! alternate (floor, ours, ours, floor, …) so both see the same load on a
//! shared machine; the whole comparison is repeated in rounds and the
//! median printed. Both servers use the same HTTP/2 settings. Last, an
//! in-process breakdown of one step (no transport).
//!
//! Run: `cargo bench -p samplerd --bench rpc` (env RPC_BENCH_ITERS: timed
//! calls per series and round, RPC_BENCH_ROUNDS: rounds,
//! RPC_BENCH_PARALLEL_LOGPROB=0: no log-sum-exp helper thread).

use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, Instant};

use samplerd::app::config::Config;
use samplerd::service::sample;
use samplerd::service::state::AppState;
use samplerd::transport::identity::Caller;
use samplerd_api::testing::v1::noop_client::NoopClient;
use samplerd_api::testing::v1::noop_server::{Noop, NoopServer};
use samplerd_api::v1::sampler_client::SamplerClient;
use samplerd_api::v1::{SampleRequest, SampleResponse, SampleStreamRequest};
use samplerd_sampling::logits;
use tokio::sync::mpsc;
use tokio_stream::StreamExt;
use tokio_stream::wrappers::{ReceiverStream, TcpListenerStream};
use tonic::transport::Channel;
use tonic::{Request, Response, Status, Streaming};

const VOCAB: usize = 151_936;
const WARMUP: usize = 50;
const DEFAULT_ITERS: usize = 1000;
const DEFAULT_ROUNDS: usize = 3;
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

/// p50 / p99 of one series, µs.
#[derive(Clone, Copy)]
struct Row {
    p50: f64,
    p99: f64,
}

impl Row {
    fn of(mut lat: Vec<Duration>) -> Row {
        lat.sort();
        Row {
            p50: pct(&lat, 0.5),
            p99: pct(&lat, 0.99),
        }
    }
}

/// Times `floor` and `ours` alternately (order swapped every call), so
/// both see the same load on a shared machine; returns (floor, ours)
/// latencies.
async fn interleaved<A, B, FA, FB>(
    iters: usize,
    mut floor: A,
    mut ours: B,
) -> (Vec<Duration>, Vec<Duration>)
where
    A: FnMut() -> FA,
    B: FnMut() -> FB,
    FA: std::future::Future<Output = ()>,
    FB: std::future::Future<Output = ()>,
{
    for _ in 0..WARMUP {
        floor().await;
        ours().await;
    }
    let (mut lf, mut lo) = (Vec::with_capacity(iters), Vec::with_capacity(iters));
    for i in 0..iters {
        for first in [i % 2 == 0, i % 2 != 0] {
            let t = Instant::now();
            if first {
                floor().await;
                lf.push(t.elapsed());
            } else {
                ours().await;
                lo.push(t.elapsed());
            }
        }
    }
    (lf, lo)
}

/// One open stream driven one message at a time (send, await the reply).
struct Driver<S> {
    tx: mpsc::Sender<SampleStreamRequest>,
    out: S,
    msg: SampleStreamRequest,
}

impl<S> Driver<S>
where
    S: tokio_stream::Stream<Item = Result<SampleResponse, Status>> + Unpin,
{
    async fn step(&mut self) {
        self.tx.send(self.msg.clone()).await.unwrap();
        self.out.next().await.unwrap().unwrap();
    }
}

/// One round: [bytes floor, bytes, floats floor, floats, stream floor,
/// stream] rows, then the floor's and samplerd's stream rates.
type Round = ([Row; 6], f64, f64);

/// Steps/s of a stream driven one step at a time: steps / Σ step latency.
fn rate(lat: &[Duration]) -> f64 {
    lat.len() as f64 / lat.iter().sum::<Duration>().as_secs_f64()
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

#[tokio::main(flavor = "multi_thread")]
async fn main() {
    // `cargo bench` passes `--bench`; nothing else to parse.
    let iters = std::env::var("RPC_BENCH_ITERS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(DEFAULT_ITERS);
    let rounds_n: usize = std::env::var("RPC_BENCH_ROUNDS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(DEFAULT_ROUNDS)
        .max(1);
    let mut cfg = Config {
        listen: "127.0.0.1:0".parse().unwrap(),
        ..Default::default()
    };
    // RPC_BENCH_PARALLEL_LOGPROB=0: the single-thread path, for A/B runs.
    if std::env::var("RPC_BENCH_PARALLEL_LOGPROB").is_ok_and(|v| v == "0") {
        cfg.limits.parallel_logprob.enabled = false;
    }
    // cargo leaves a dev-dependency's cdylib in deps/.
    let lib = "libsamplerd_core_stages.so";
    let dir = profile_dir();
    let core = [dir.join("deps").join(lib), dir.join(lib)]
        .into_iter()
        .find(|p| p.is_file())
        .expect("core plugin built (cargo bench builds it as a dev-dependency)");
    cfg.plugins.files = vec![core];
    let server = samplerd::app::server::spawn(cfg, None)
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
            .max_frame_size(samplerd::app::server::HTTP2_MAX_FRAME_BYTES)
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
    println!(
        "log-sum-exp helper thread: {}",
        if server.state.lse.is_running() {
            "on"
        } else {
            "off"
        }
    );

    let (tx_n, rx_n) = mpsc::channel(2);
    let (tx_s, rx_s) = mpsc::channel(2);
    let msg = SampleStreamRequest {
        logits_f32le: bytes.clone().into(),
        ..Default::default()
    };
    let mut noop_stream = Driver {
        tx: tx_n,
        out: noop
            .clone()
            .sample_stream(ReceiverStream::new(rx_n))
            .await
            .unwrap()
            .into_inner(),
        msg: msg.clone(),
    };
    let mut our_stream = Driver {
        tx: tx_s,
        out: sampler
            .clone()
            .sample_stream(ReceiverStream::new(rx_s))
            .await
            .unwrap()
            .into_inner(),
        msg,
    };

    let mut rounds: Vec<Round> = Vec::new();
    for round in 1..=rounds_n {
        let unary = |req: SampleRequest| {
            let (n, s) = (noop.clone(), sampler.clone());
            let r2 = req.clone();
            interleaved(
                iters,
                move || {
                    let (mut c, r) = (n.clone(), req.clone());
                    async move {
                        c.sample(r).await.unwrap();
                    }
                },
                move || {
                    let (mut c, r) = (s.clone(), r2.clone());
                    async move {
                        c.sample(r).await.unwrap();
                    }
                },
            )
        };
        let (bf, bo) = unary(req_bytes.clone()).await;
        let (ff, fo) = unary(req_floats.clone()).await;
        for _ in 0..WARMUP {
            noop_stream.step().await;
            our_stream.step().await;
        }
        let (mut sf, mut so) = (Vec::with_capacity(iters), Vec::with_capacity(iters));
        for i in 0..iters {
            for first in [i % 2 == 0, i % 2 != 0] {
                let t = Instant::now();
                if first {
                    noop_stream.step().await;
                    sf.push(t.elapsed());
                } else {
                    our_stream.step().await;
                    so.push(t.elapsed());
                }
            }
        }
        let (rf, ro) = (rate(&sf), rate(&so));
        let rows = [bf, bo, ff, fo, sf, so].map(Row::of);
        println!("\nround {round}/{rounds_n}");
        print_tables(&rows, rf, ro);
        rounds.push((rows, rf, ro));
    }
    if rounds_n > 1 {
        let med = |f: &dyn Fn(&Round) -> f64| median(rounds.iter().map(f).collect());
        let rows: [Row; 6] = std::array::from_fn(|i| Row {
            p50: med(&|r| r.0[i].p50),
            p99: med(&|r| r.0[i].p99),
        });
        println!("\nmedian of {rounds_n} rounds (ratios: median of the per-round ratios)");
        print_tables(&rows, med(&|r| r.1), med(&|r| r.2));
        println!(
            "per-round p50 ratios, raw bytes: {:?}; stream rates (floor, ours): {:?}",
            rounds
                .iter()
                .map(|r| format!("{:.2}", r.0[1].p50 / r.0[0].p50))
                .collect::<Vec<_>>(),
            rounds
                .iter()
                .map(|r| (r.1.round(), r.2.round()))
                .collect::<Vec<_>>()
        );
        println!(
            "median ratio raw bytes {:.2}x, repeated float {:.2}x, stream rate {:.2}",
            med(&|r| r.0[1].p50 / r.0[0].p50),
            med(&|r| r.0[3].p50 / r.0[2].p50),
            med(&|r| r.2 / r.1)
        );
    }

    // Transport + layers + offload with no sampling: a request one byte
    // short, which samplerd rejects before touching the logits.
    let short = SampleRequest {
        logits_f32le: bytes[..bytes.len() - 1].to_vec().into(),
        ..Default::default()
    };
    let (n, s) = (noop.clone(), sampler.clone());
    let (ff, fo) = interleaved(
        iters,
        || {
            let (mut c, r) = (n.clone(), short.clone());
            async move {
                c.sample(r).await.unwrap();
            }
        },
        || {
            let (mut c, r) = (s.clone(), short.clone());
            async move {
                c.sample(r).await.unwrap_err();
            }
        },
    )
    .await;
    let (ff, fo) = (Row::of(ff), Row::of(fo));
    println!(
        "\nrejected at once (no sampling): noop p50 {:.1} µs, samplerd p50 {:.1} µs ({:.2}x)",
        ff.p50,
        fo.p50,
        fo.p50 / ff.p50
    );

    breakdown(&server.state, &bytes, iters).await;

    let _ = server.stop().await;
}

fn print_tables(rows: &[Row; 6], floor_rate: f64, rate: f64) {
    println!(
        "{:<30} {:>10} {:>10} {:>12}",
        "unary", "p50 µs", "p99 µs", "p50 / floor"
    );
    let names = [
        "noop raw bytes (floor)",
        "Sample raw bytes",
        "noop repeated float (floor)",
        "Sample repeated float",
    ];
    for (i, name) in names.iter().enumerate() {
        let floor = rows[i - i % 2].p50;
        let r = rows[i];
        println!(
            "{name:<30} {:>10.1} {:>10.1} {:>11.2}x",
            r.p50,
            r.p99,
            r.p50 / floor
        );
    }
    println!(
        "{:<30} {:>10} {:>10} {:>12}",
        "stream (raw bytes)", "steps/s", "p50 µs", "p99 µs"
    );
    for (name, rate, r) in [
        ("noop stream (floor)", floor_rate, rows[4]),
        ("SampleStream", rate, rows[5]),
    ] {
        println!("{name:<30} {rate:>10.0} {:>10.1} {:>12.1}", r.p50, r.p99);
    }
}

/// (min, median) of `iters` timings of `f` (after a warm-up), in µs. The
/// minimum is the better estimate of CPU-bound work on a busy machine.
fn median_us(iters: usize, mut f: impl FnMut() -> Duration) -> (f64, f64) {
    for _ in 0..WARMUP {
        f();
    }
    let mut t: Vec<Duration> = (0..iters).map(|_| f()).collect();
    t.sort();
    (pct(&t, 0.0), pct(&t, 0.5))
}

/// Where the server's time goes, in-process (no transport): each phase of
/// one raw-bytes `Sample` step timed on its own, plus the whole handler.
async fn breakdown(state: &Arc<AppState>, bytes: &[u8], iters: usize) {
    let chain = state.defaults.chain.clone();
    let mut buf = state.pool.take();
    let mut rows: Vec<(&str, (f64, f64))> = Vec::new();
    rows.push((
        "load: copy + validate",
        median_us(iters, || {
            let t = Instant::now();
            buf.load_f32le(bytes).unwrap();
            t.elapsed()
        }),
    ));
    rows.push((
        "fused load + log-sum-exp",
        median_us(iters, || {
            let t = Instant::now();
            std::hint::black_box(buf.load_f32le_scan(bytes).unwrap());
            t.elapsed()
        }),
    ));
    rows.push((
        "copy + validate + max (helper)",
        median_us(iters, || {
            let t = Instant::now();
            std::hint::black_box(buf.load_f32le_checked(bytes).unwrap());
            t.elapsed()
        }),
    ));
    rows.push((
        "log-sum-exp (raw logits)",
        median_us(iters, || {
            let t = Instant::now();
            std::hint::black_box(logits::log_sum_exp(buf.dense()));
            t.elapsed()
        }),
    ));
    rows.push((
        "new_sequence + drop",
        median_us(iters, || {
            let t = Instant::now();
            drop(chain.new_sequence().unwrap());
            t.elapsed()
        }),
    ));
    let mut seq = chain.new_sequence().unwrap();
    rows.push((
        "chain (Sequence::sample)",
        median_us(iters, || {
            buf.load_f32le(bytes).unwrap();
            let t = Instant::now();
            std::hint::black_box(seq.sample(&mut buf, 42, 0).unwrap());
            t.elapsed()
        }),
    ));
    let owned = prost::bytes::Bytes::copy_from_slice(bytes);
    rows.push((
        "step, fused scan (1 thread)",
        median_us(iters, || {
            let t = Instant::now();
            let s = buf.load_f32le_scan(&owned).unwrap();
            std::hint::black_box((seq.sample(&mut buf, 42, 0).unwrap(), s.log_sum_exp));
            t.elapsed()
        }),
    ));
    if state.lse.is_running() {
        rows.push((
            "step, log-sum-exp on helper",
            median_us(iters, || {
                // The helper takes one job at a time: wait (untimed, bounded
                // by time, not by a count of yields — on a loaded machine a
                // million yields ran out before the helper was scheduled)
                // until it is idle again.
                let deadline = Instant::now() + Duration::from_secs(30);
                while !state.lse.is_idle() && Instant::now() < deadline {
                    std::thread::yield_now();
                }
                let t = Instant::now();
                let job = state
                    .lse
                    .start(&owned)
                    .expect("the log-sum-exp helper stayed busy for 30 s");
                buf.load_f32le_checked(&owned).unwrap();
                std::hint::black_box((seq.sample(&mut buf, 42, 0).unwrap(), job.finish()));
                t.elapsed()
            }),
        ));
    }
    state.pool.put(buf);
    let mut hops = Vec::with_capacity(iters);
    for i in 0..iters + WARMUP {
        let t = Instant::now();
        tokio::task::spawn_blocking(|| ()).await.unwrap();
        if i >= WARMUP {
            hops.push(t.elapsed());
        }
    }
    hops.sort();
    rows.push((
        "spawn_blocking round trip",
        (pct(&hops, 0.0), pct(&hops, 0.5)),
    ));
    // What each step pays to leave the runtime: the sampling pool's
    // hand-off and reply with nothing to run.
    let mut hands = Vec::with_capacity(iters);
    for i in 0..iters + WARMUP {
        let t = Instant::now();
        state.steps.run(|| ()).await.unwrap();
        if i >= WARMUP {
            hands.push(t.elapsed());
        }
    }
    hands.sort();
    rows.push((
        "sampling pool round trip",
        (pct(&hands, 0.0), pct(&hands, 0.5)),
    ));
    let req = SampleRequest {
        logits_f32le: bytes.to_vec().into(),
        ..Default::default()
    };
    let mut whole = Vec::with_capacity(iters);
    for i in 0..iters + WARMUP {
        let t = Instant::now();
        sample::handle(state.clone(), req.clone(), Caller::Unknown)
            .await
            .unwrap();
        if i >= WARMUP {
            whole.push(t.elapsed());
        }
    }
    whole.sort();
    rows.push(("whole Sample handler", (pct(&whole, 0.0), pct(&whole, 0.5))));
    println!(
        "\n{:<30} {:>10} {:>10}",
        "in-process, one step", "min µs", "p50 µs"
    );
    for (name, (min, p50)) in rows {
        println!("{name:<30} {min:>10.1} {p50:>10.1}");
    }
}
