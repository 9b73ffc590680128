//! `samplerctl bench`: a closed-loop load generator. `--concurrency` workers
//! share one HTTP/2 connection and send Sample (random logits of `--vocab`
//! entries, as raw f32), SampleStream messages (one stream per worker) or
//! Generate requests back to back, for
//! `--duration` seconds or `--requests` in total. A live progress bar runs
//! on a terminal; the report gives p50/p90/p99 latency, requests/s,
//! tokens/s and errors (`--json`: one object for scripts and the project's
//! benchmarks). Ctrl-C stops early and still reports.

use std::io::IsTerminal;
use std::process::ExitCode;
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use indicatif::{ProgressBar, ProgressDrawTarget, ProgressStyle};
use samplerd_api::v1::generate_response::Event;
use samplerd_api::v1::{
    GenerateRequest, SampleRequest, SampleResponse, SampleStreamRequest, SamplingParams,
};
use serde_json::json;

use super::bench_worker::{OpenStream, Shared, WorkerStats, random_logits, stream_step};
use crate::cli::{BenchArgs, BenchRpc, Compression, ConnArgs};
use crate::connect::{Sampler, connect};
use crate::output::{Style, emit, paint, warn};
use crate::params::sampling_params;

/// Duration when neither --duration nor --requests is given.
const DEFAULT_DURATION_S: f64 = 10.0;

/// The final numbers.
#[derive(Debug, Clone, PartialEq)]
pub struct Report {
    pub rpc: &'static str,
    pub concurrency: u32,
    pub requests: u64,
    pub errors: u64,
    pub duration_s: f64,
    pub rps: f64,
    pub tokens_per_s: f64,
    pub p50_ms: f64,
    pub p90_ms: f64,
    pub p99_ms: f64,
    pub mean_ms: f64,
    pub max_ms: f64,
}

impl Report {
    fn json(&self) -> serde_json::Value {
        json!({
            "rpc": self.rpc,
            "concurrency": self.concurrency,
            "requests": self.requests,
            "errors": self.errors,
            "duration_s": self.duration_s,
            "rps": self.rps,
            "tokens_per_s": self.tokens_per_s,
            "latency_ms": {
                "p50": self.p50_ms,
                "p90": self.p90_ms,
                "p99": self.p99_ms,
                "mean": self.mean_ms,
                "max": self.max_ms,
            },
        })
    }

    fn text(&self) -> String {
        format!(
            "{}\n  requests     {} ok, {} errors in {:.2}s\n  throughput   {:.1} requests/s, {:.1} tokens/s\n  latency ms   p50 {:.3}  p90 {:.3}  p99 {:.3}  mean {:.3}  max {:.3}\n",
            paint(
                Style::Bold,
                &format!("bench {} (concurrency {})", self.rpc, self.concurrency)
            ),
            self.requests,
            self.errors,
            self.duration_s,
            self.rps,
            self.tokens_per_s,
            self.p50_ms,
            self.p90_ms,
            self.p99_ms,
            self.mean_ms,
            self.max_ms,
        )
    }
}

/// Nearest-rank percentile of sorted values (`q` in [0, 1]).
pub fn percentile(sorted: &[u64], q: f64) -> u64 {
    if sorted.is_empty() {
        return 0;
    }
    let rank = (q * sorted.len() as f64).ceil() as usize;
    sorted[rank.clamp(1, sorted.len()) - 1]
}

async fn worker(
    id: u32,
    mut client: Sampler,
    rpc: BenchRpc,
    args: Arc<(BenchArgs, SamplingParams)>,
    shared: Arc<Shared>,
) -> WorkerStats {
    match rpc {
        BenchRpc::SampleStream => return stream_worker(id, client, args, shared).await,
        BenchRpc::SampleBatch | BenchRpc::SampleBatchStream => {
            return super::bench_batch::worker(id, client, args, shared).await;
        }
        BenchRpc::Sample | BenchRpc::Generate => {}
    }
    let (args, params) = &*args;
    let mut stats = WorkerStats::default();
    let logits = match rpc {
        BenchRpc::Generate => tonic::codegen::Bytes::new(),
        _ => tonic::codegen::Bytes::from(random_logits(args.vocab as usize, u64::from(id) + 1)),
    };
    while let Some(n) = shared.next() {
        let t0 = Instant::now();
        let result: Result<u64, tonic::Status> = match rpc {
            BenchRpc::Generate => generate_once(&mut client, args, params).await,
            _ => client
                .sample(SampleRequest {
                    logits: Vec::new(),
                    logits_f32le: logits.clone(),
                    previous_tokens: Vec::new(),
                    params: Some(params.clone()),
                    step: n,
                    n_probs: 0,
                    ..Default::default()
                })
                .await
                .map(|_| 1),
        };
        stats.record(t0.elapsed().as_micros() as u64, result);
        shared.done.fetch_add(1, Ordering::Relaxed);
    }
    stats
}

/// SampleStream: one long-lived stream per worker; a request is one message
/// and its response (one token). A stream that fails counts one error and
/// is reopened for the next request.
async fn stream_worker(
    id: u32,
    mut client: Sampler,
    args: Arc<(BenchArgs, SamplingParams)>,
    shared: Arc<Shared>,
) -> WorkerStats {
    let (args, params) = &*args;
    let mut stats = WorkerStats::default();
    let logits = tonic::codegen::Bytes::from(random_logits(args.vocab as usize, u64::from(id) + 1));
    let mut open: Option<OpenStream<SampleStreamRequest, SampleResponse>> = None;
    while shared.next().is_some() {
        let t0 = Instant::now();
        let msg = SampleStreamRequest {
            logits_f32le: logits.clone(),
            // The first message fixes the parameters; later ones may not.
            params: open.is_none().then(|| params.clone()),
            ..Default::default()
        };
        let result = stream_step(&mut open, msg, |rx| client.sample_stream(rx)).await;
        if !stats.record(t0.elapsed().as_micros() as u64, result.map(|_| 1)) {
            open = None;
        }
        shared.done.fetch_add(1, Ordering::Relaxed);
    }
    stats
}

/// One full Generate stream; returns the completion tokens.
async fn generate_once(
    client: &mut Sampler,
    args: &BenchArgs,
    params: &SamplingParams,
) -> Result<u64, tonic::Status> {
    let mut stream = client
        .generate(GenerateRequest {
            prompt: args.prompt.clone(),
            messages: Vec::new(),
            max_tokens: Some(args.max_tokens),
            params: Some(params.clone()),
            stop: Vec::new(),
            ignore_eos: true,
            n_probs: 0,
            post_sampling_probs: false,
            ..Default::default()
        })
        .await?
        .into_inner();
    let mut tokens = 0u64;
    while let Some(msg) = stream.message().await? {
        match msg.event {
            Some(Event::Token(_)) => tokens += 1,
            Some(Event::Finished(f)) => {
                if let Some(u) = f.usage {
                    tokens = u64::from(u.completion_tokens);
                }
            }
            Some(Event::PromptLogprobs(_)) | None => {}
        }
    }
    Ok(tokens)
}

/// Runs the benchmark.
pub async fn run(conn: &ConnArgs, args: BenchArgs) -> anyhow::Result<ExitCode> {
    let c = connect(conn).await?;
    let rpc = args.rpc;
    let concurrency = args.concurrency;
    let duration = match (args.duration, args.requests) {
        (Some(d), _) => Some(Duration::from_secs_f64(d)),
        (None, None) => Some(Duration::from_secs_f64(DEFAULT_DURATION_S)),
        (None, Some(_)) => None,
    };
    let params = sampling_params(&args.sampling);
    let json_out = args.json;
    let start = Instant::now();
    let shared = Arc::new(Shared::new(args.requests, duration.map(|d| start + d)));

    let bar = progress_bar(duration, args.requests);
    let shared_args = Arc::new((args, params));
    let mut handles = Vec::new();
    let encoding = match shared_args.0.compression {
        Compression::None => None,
        Compression::Gzip => Some(tonic::codec::CompressionEncoding::Gzip),
        Compression::Zstd => Some(tonic::codec::CompressionEncoding::Zstd),
    };
    for id in 0..concurrency {
        let mut client = c.sampler();
        if let Some(e) = encoding {
            client = client.send_compressed(e).accept_compressed(e);
        }
        handles.push(tokio::spawn(worker(
            id,
            client,
            rpc,
            shared_args.clone(),
            shared.clone(),
        )));
    }

    // Progress + Ctrl-C until every worker is done.
    let ctrl_c = tokio::signal::ctrl_c();
    tokio::pin!(ctrl_c);
    let mut interrupted = false;
    let mut tick = tokio::time::interval(Duration::from_millis(100));
    let all = futures_join(handles);
    tokio::pin!(all);
    let results = loop {
        tokio::select! {
            r = &mut all => break r,
            _ = tick.tick() => {
                let done = shared.done.load(Ordering::Relaxed);
                match duration {
                    Some(_) => bar.set_position(start.elapsed().as_millis() as u64),
                    None => bar.set_position(done),
                }
                let secs = start.elapsed().as_secs_f64().max(1e-9);
                bar.set_message(format!("{done} requests, {:.0}/s", done as f64 / secs));
            }
            _ = &mut ctrl_c, if !interrupted => {
                interrupted = true;
                shared.stop();
            }
        }
    };
    bar.finish_and_clear();
    let elapsed = start.elapsed().as_secs_f64();

    let mut latencies = Vec::new();
    let (mut tokens, mut errors, mut first_error) = (0u64, 0u64, None);
    for r in results {
        let s = r?;
        latencies.extend(s.latencies_us);
        tokens += s.tokens;
        errors += s.errors;
        if first_error.is_none() {
            first_error = s.first_error;
        }
    }
    latencies.sort_unstable();
    let ms = |us: u64| us as f64 / 1000.0;
    let requests = latencies.len() as u64;
    let report = Report {
        rpc: rpc.name(),
        concurrency,
        requests,
        errors,
        duration_s: elapsed,
        rps: requests as f64 / elapsed.max(1e-9),
        tokens_per_s: tokens as f64 / elapsed.max(1e-9),
        p50_ms: ms(percentile(&latencies, 0.50)),
        p90_ms: ms(percentile(&latencies, 0.90)),
        p99_ms: ms(percentile(&latencies, 0.99)),
        mean_ms: if latencies.is_empty() {
            0.0
        } else {
            ms(latencies.iter().sum::<u64>()) / latencies.len() as f64
        },
        max_ms: ms(latencies.last().copied().unwrap_or(0)),
    };
    if json_out {
        emit(&format!("{}\n", report.json()))?;
    } else {
        emit(&report.text())?;
    }
    if interrupted {
        warn("interrupted: partial results");
    }
    if let Some(e) = first_error {
        warn(&format!("{errors} requests failed; first error: {e}"));
    }
    Ok(if interrupted {
        ExitCode::from(super::EXIT_INTERRUPTED)
    } else if errors > 0 {
        ExitCode::FAILURE
    } else {
        ExitCode::SUCCESS
    })
}

/// Awaits every worker, in order.
async fn futures_join(
    handles: Vec<tokio::task::JoinHandle<WorkerStats>>,
) -> Vec<Result<WorkerStats, tokio::task::JoinError>> {
    let mut out = Vec::with_capacity(handles.len());
    for h in handles {
        out.push(h.await);
    }
    out
}

/// A bar over time (--duration) or requests (--requests); hidden when
/// stderr is not a terminal.
fn progress_bar(duration: Option<Duration>, requests: Option<u64>) -> ProgressBar {
    let (len, template) = match duration {
        Some(d) => (
            d.as_millis() as u64,
            "{spinner} [{elapsed_precise}] [{wide_bar}] {msg}",
        ),
        None => (
            requests.unwrap_or(0),
            "{spinner} [{elapsed_precise}] [{wide_bar}] {pos}/{len} {msg}",
        ),
    };
    let bar = ProgressBar::with_draw_target(Some(len), ProgressDrawTarget::hidden());
    if std::io::stderr().is_terminal() {
        bar.set_draw_target(ProgressDrawTarget::stderr());
    }
    if let Ok(style) = ProgressStyle::with_template(template) {
        bar.set_style(style.progress_chars("=> "));
    }
    bar
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn nearest_rank_percentiles() {
        let v: Vec<u64> = (1..=100).collect();
        assert_eq!(percentile(&v, 0.5), 50);
        assert_eq!(percentile(&v, 0.9), 90);
        assert_eq!(percentile(&v, 0.99), 99);
        assert_eq!(percentile(&[7], 0.99), 7);
        assert_eq!(percentile(&[], 0.5), 0);
    }
}
