//! Loopback benchmark of the discovery RPCs and of response compression
//! (a bench binary, not a timed test):
//! - `Tokenize` of 4 KB of English and code through the default model's
//!   GGUF tokenizer (loaded as a named vocabulary: the same tokenizer code
//!   Tokenize runs for the model, without loading the weights), and
//!   `GetServerInfo`;
//! - `Sample` of 151,936 raw-byte logits with `n_probs = 1024` from a
//!   client that sends uncompressed requests, once without and once with
//!   `grpc-accept-encoding: gzip` (what grpcio and grpc-js always send):
//!   what `compression.responses` decides.
//!
//! Calls of the series being compared alternate (a, b, b, a, …) so both
//! see the same load on a shared machine; each round prints p50/p99, and
//! the median of the rounds' p50s closes.
//!
//! Run: `SAMPLERD_MODEL=models/SmolLM2-135M-Instruct.Q4_1.gguf cargo bench
//! -p samplerd --bench discovery` (env DISCOVERY_BENCH_ITERS: timed calls
//! per series and round, DISCOVERY_BENCH_ROUNDS: rounds). Without
//! SAMPLERD_MODEL only the compression series run.

use std::path::PathBuf;
use std::time::{Duration, Instant};

use prost::bytes::Bytes;
use samplerd::app::config::Config;
use samplerd_api::v1;
use samplerd_api::v1::sampler_client::SamplerClient;
use tonic::codec::CompressionEncoding;
use tonic::transport::Channel;

const VOCAB: usize = 151_936;
const WARMUP: usize = 50;
const DEFAULT_ITERS: usize = 500;
const DEFAULT_ROUNDS: usize = 3;
const MAX_MESSAGE: usize = 64 << 20;
/// The text Tokenize is timed on: 4 KB, prose and code.
const TEXT_BYTES: usize = 4096;

fn env_usize(key: &str, default: usize) -> usize {
    std::env::var(key)
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
        .max(1)
}

fn profile_dir() -> PathBuf {
    let exe = std::env::current_exe().unwrap();
    exe.parent().unwrap().parent().unwrap().to_path_buf()
}

fn text_4k() -> String {
    let para = "The quick brown fox jumps over the lazy dog, while 42 developers debate \
                whether `fn main() { println!(\"hi\"); }` compiles on the first try. \
                Naïve café owners serve crème brûlée at 3:45 p.m. — prices rose 12.5%.\n";
    let mut t = String::new();
    while t.len() < TEXT_BYTES {
        t.push_str(para);
    }
    let mut end = TEXT_BYTES;
    while !t.is_char_boundary(end) {
        end -= 1;
    }
    t.truncate(end);
    t
}

fn random_logits_bytes(n: usize) -> Bytes {
    let mut x: u64 = 0x9E37_79B9_7F4A_7C15;
    let mut out = Vec::with_capacity(n * 4);
    for _ in 0..n {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        let u = (x >> 40) as f32 / (1u64 << 24) as f32;
        out.extend_from_slice(&((u * 2.0 - 1.0) * 6.0).to_le_bytes());
    }
    Bytes::from(out)
}

fn pct(sorted: &[Duration], q: f64) -> f64 {
    let i = ((sorted.len() - 1) as f64 * q).round() as usize;
    sorted[i].as_secs_f64() * 1e6
}

/// (p50, p99) in µs.
fn row(mut lat: Vec<Duration>) -> (f64, f64) {
    lat.sort();
    (pct(&lat, 0.5), pct(&lat, 0.99))
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

/// Times `a` and `b` alternately (order swapped every call).
async fn interleaved<A, B, FA, FB>(
    iters: usize,
    mut a: A,
    mut b: B,
) -> (Vec<Duration>, Vec<Duration>)
where
    A: FnMut() -> FA,
    B: FnMut() -> FB,
    FA: std::future::Future<Output = ()>,
    FB: std::future::Future<Output = ()>,
{
    for _ in 0..WARMUP {
        a().await;
        b().await;
    }
    let (mut la, mut lb) = (Vec::with_capacity(iters), Vec::with_capacity(iters));
    for i in 0..iters {
        for first in [i % 2 == 0, i % 2 != 0] {
            let t = Instant::now();
            if first {
                a().await;
                la.push(t.elapsed());
            } else {
                b().await;
                lb.push(t.elapsed());
            }
        }
    }
    (la, lb)
}

async fn channel(addr: std::net::SocketAddr) -> Channel {
    Channel::from_shared(format!("http://{addr}"))
        .unwrap()
        .initial_stream_window_size(8 << 20)
        .initial_connection_window_size(32 << 20)
        .tcp_nodelay(true)
        .connect()
        .await
        .unwrap()
}

#[tokio::main(flavor = "multi_thread")]
async fn main() {
    let iters = env_usize("DISCOVERY_BENCH_ITERS", DEFAULT_ITERS);
    let rounds = env_usize("DISCOVERY_BENCH_ROUNDS", DEFAULT_ROUNDS);
    let model = std::env::var_os("SAMPLERD_MODEL").map(PathBuf::from);
    let mut cfg = Config {
        listen: "127.0.0.1:0".parse().unwrap(),
        ..Default::default()
    };
    let lib = "libsamplerd_core_stages.so";
    let dir = profile_dir();
    let core = [dir.join("deps").join(lib), dir.join(lib)]
        .into_iter()
        .find(|p| p.is_file())
        .expect("core plugin built (cargo bench builds it as a dev-dependency)");
    cfg.plugins.files = vec![core];
    if let Some(m) = &model {
        cfg.vocabularies.insert("model".into(), m.clone());
    }
    let server = samplerd::app::server::spawn(cfg, None)
        .await
        .expect("samplerd starts");
    let ch = channel(server.addr).await;
    let plain = SamplerClient::new(ch.clone())
        .max_decoding_message_size(MAX_MESSAGE)
        .max_encoding_message_size(MAX_MESSAGE);
    // Uncompressed requests, gzip accepted: grpcio's and grpc-js's habit.
    let gzip = SamplerClient::new(channel(server.addr).await)
        .accept_compressed(CompressionEncoding::Gzip)
        .max_decoding_message_size(MAX_MESSAGE)
        .max_encoding_message_size(MAX_MESSAGE);

    let text = text_4k();
    let sample = v1::SampleRequest {
        logits_f32le: random_logits_bytes(VOCAB),
        n_probs: 1024,
        ..Default::default()
    };
    println!("samplerd discovery benchmark: {iters} calls per series, {rounds} rounds");
    let (mut tok, mut info, mut s_plain, mut s_gzip) = (vec![], vec![], vec![], vec![]);
    for round in 1..=rounds {
        println!("\nround {round}/{rounds}");
        if model.is_some() {
            let req = v1::TokenizeRequest {
                text: text.clone(),
                vocabulary: "model".into(),
                parse_special: true,
                ..Default::default()
            };
            let n = plain
                .clone()
                .tokenize(req.clone())
                .await
                .unwrap()
                .into_inner()
                .tokens
                .len();
            let (lt, li) = interleaved(
                iters,
                || {
                    let (mut c, r) = (plain.clone(), req.clone());
                    async move {
                        c.tokenize(r).await.unwrap();
                    }
                },
                || {
                    let mut c = plain.clone();
                    async move {
                        c.get_server_info(v1::GetServerInfoRequest {})
                            .await
                            .unwrap();
                    }
                },
            )
            .await;
            let (t, i) = (row(lt), row(li));
            println!(
                "  Tokenize {} B ({n} tokens)   p50 {:8.1} µs  p99 {:8.1} µs",
                text.len(),
                t.0,
                t.1
            );
            println!(
                "  GetServerInfo             p50 {:8.1} µs  p99 {:8.1} µs",
                i.0, i.1
            );
            tok.push(t.0);
            info.push(i.0);
        }
        let (lp, lg) = interleaved(
            iters,
            || {
                let (mut c, r) = (plain.clone(), sample.clone());
                async move {
                    c.sample(r).await.unwrap();
                }
            },
            || {
                let (mut c, r) = (gzip.clone(), sample.clone());
                async move {
                    c.sample(r).await.unwrap();
                }
            },
        )
        .await;
        let (p, g) = (row(lp), row(lg));
        println!(
            "  Sample n_probs=1024, no gzip accepted   p50 {:8.1} µs  p99 {:8.1} µs",
            p.0, p.1
        );
        println!(
            "  Sample n_probs=1024, gzip accepted      p50 {:8.1} µs  p99 {:8.1} µs",
            g.0, g.1
        );
        s_plain.push(p.0);
        s_gzip.push(g.0);
    }
    // The tokenizer alone, in process: what the RPC adds to it is the
    // rest of Tokenize's time.
    let mut direct = None;
    if let Some(m) = &model {
        use samplerd_model::TextCodec as _;
        let tk = samplerd_model::read_tokenizer(m).expect("tokenizer reads");
        let mut lat: Vec<Duration> = (0..iters + WARMUP)
            .map(|_| {
                let t = Instant::now();
                std::hint::black_box(tk.encode(&text, false, true).unwrap());
                t.elapsed()
            })
            .skip(WARMUP)
            .collect();
        lat.sort();
        direct = Some(pct(&lat, 0.5));
    }
    println!("\nmedian of the rounds' p50s");
    if let Some(d) = direct {
        println!("  the tokenizer alone      {d:8.1} µs (in process, no RPC)");
    }
    if model.is_some() {
        println!("  Tokenize 4 KB            {:8.1} µs", median(tok));
        println!("  GetServerInfo            {:8.1} µs", median(info));
    }
    println!("  Sample, no gzip accepted {:8.1} µs", median(s_plain));
    println!("  Sample, gzip accepted    {:8.1} µs", median(s_gzip));
    server.stop().await.unwrap();
}
