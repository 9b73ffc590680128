//! Prometheus metrics: the recorder (`metrics` facade +
//! `metrics-exporter-prometheus`), the `/metrics` HTTP endpoint on its own
//! port (config `[metrics]`), and [`ObserveRpc`], the one middleware that
//! counts every gRPC request by RPC and status code, times it to the end of
//! its response stream, tracks open streams, and refuses new Sampler RPCs
//! while the server drains (see [`super::drain`]).
//!
//! Metric names are the `pub const`s below (for per-stage series, in
//! `samplerd_sampling::chain`; for the model host's, in `generate`); without an installed recorder every call is a
//! no-op, so in-process tests and benchmarks pay nothing.

#![forbid(unsafe_code)]

use std::net::SocketAddr;
use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::task::{Context, Poll};
use std::time::{Duration, Instant};

use metrics_exporter_prometheus::{Matcher, PrometheusBuilder, PrometheusHandle};
use samplerd_api::code_name;
use serde::{Deserialize, Serialize};
use tokio::net::TcpListener;
use tonic::codegen::Bytes;
use tonic::{Code, Status};

pub use samplerd_sampling::chain::{PLUGIN_ERRORS_METRIC, STAGE_DURATION_METRIC};

use super::drain::{Drain, InFlight, SHUTTING_DOWN_MESSAGE};
use super::middleware::{HttpResponse, Middleware, ResponseFuture};

/// Counter: finished gRPC requests, labels `rpc` and `code`.
pub const REQUESTS_METRIC: &str = "samplerd_requests_total";
/// Histogram (seconds): request start to the end of its response (whole
/// stream for SampleStream/Generate), label `rpc`.
pub const REQUEST_DURATION_METRIC: &str = "samplerd_request_duration_seconds";
/// Gauge: open SampleStream/Generate streams, label `rpc`.
pub const ACTIVE_STREAMS_METRIC: &str = "samplerd_active_streams";
/// Gauge: 1 while the server drains for shutdown, else 0.
pub const DRAINING_METRIC: &str = "samplerd_draining";
/// Counter: requests the client reset (HTTP/2 RST_STREAM) before their
/// status; also counted in [`REQUESTS_METRIC`] as CANCELLED, whatever
/// status the server then computed for a response nobody reads.
pub const CLIENT_RESETS_METRIC: &str = "samplerd_client_resets_total";
/// Counter: requests that are a gRPC client's retry of a failed attempt
/// (they carry `grpc-previous-rpc-attempts`, gRFC A6), label `rpc`; also
/// counted in [`REQUESTS_METRIC`]. In a fleet, the calls other replicas
/// failed (died, drained, refused) that came here.
pub const RETRIED_REQUESTS_METRIC: &str = "samplerd_retried_requests_total";
/// The request header of a retried attempt.
const PREVIOUS_ATTEMPTS_HEADER: &str = "grpc-previous-rpc-attempts";

/// Default `metrics.listen` (loopback: exposing metrics is an operator's
/// choice; the Kubernetes ConfigMap sets 0.0.0.0:9090).
pub const DEFAULT_METRICS_LISTEN: &str = "127.0.0.1:9090";
/// The scrape path.
pub const METRICS_PATH: &str = "/metrics";
/// Prometheus text exposition format.
const CONTENT_TYPE: &str = "text/plain; version=0.0.4; charset=utf-8";
/// How often histogram samples are folded into the exporter's buckets when
/// nobody scrapes (bounds their memory).
const UPKEEP_INTERVAL: Duration = Duration::from_secs(5);

/// Request latency buckets (seconds): sub-millisecond Sample calls up to
/// minutes-long Generate streams.
const REQUEST_BUCKETS: &[f64] = &[
    0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5,
    5.0, 10.0, 30.0, 60.0, 120.0, 300.0,
];
/// Stage time buckets (seconds): 1 µs to 100 ms.
const STAGE_BUCKETS: &[f64] = &[
    1e-6, 2.5e-6, 5e-6, 1e-5, 2.5e-5, 5e-5, 1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3, 5e-3, 1e-2, 2.5e-2,
    0.1,
];

/// Metrics settings (config `[metrics]`).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct MetricsConfig {
    /// Serve Prometheus metrics at all.
    pub enabled: bool,
    /// HTTP listen address of `/metrics`.
    pub listen: SocketAddr,
}

impl Default for MetricsConfig {
    fn default() -> Self {
        MetricsConfig {
            enabled: true,
            listen: DEFAULT_METRICS_LISTEN
                .parse()
                .expect("valid default metrics address"),
        }
    }
}

/// Why metrics could not be set up.
#[derive(Debug, thiserror::Error)]
pub enum MetricsError {
    #[error("metrics recorder: {0}")]
    Recorder(#[from] metrics_exporter_prometheus::BuildError),
    #[error("metrics.listen = {addr}: cannot listen: {source}")]
    Bind {
        addr: SocketAddr,
        #[source]
        source: std::io::Error,
    },
}

/// Installs the process-wide Prometheus recorder (once, before plugins and
/// the model load, so their series exist) and describes the request
/// metrics; the model host describes its own
/// (`samplerd::generate::describe_metrics`).
pub fn install() -> Result<PrometheusHandle, MetricsError> {
    let handle = PrometheusBuilder::new()
        .set_buckets_for_metric(
            Matcher::Full(REQUEST_DURATION_METRIC.into()),
            REQUEST_BUCKETS,
        )?
        .set_buckets_for_metric(Matcher::Full(STAGE_DURATION_METRIC.into()), STAGE_BUCKETS)?
        .install_recorder()?;
    describe();
    // Gauges that exist from the start (a scrape shows 0, not nothing).
    metrics::gauge!(DRAINING_METRIC).set(0.0);
    Ok(handle)
}

fn describe() {
    use metrics::{Unit, describe_counter, describe_gauge, describe_histogram};
    describe_counter!(
        REQUESTS_METRIC,
        "gRPC requests finished, by RPC and status code"
    );
    describe_histogram!(
        REQUEST_DURATION_METRIC,
        Unit::Seconds,
        "gRPC request time to the end of the response (whole stream for streaming RPCs)"
    );
    describe_gauge!(ACTIVE_STREAMS_METRIC, "open SampleStream/Generate streams");
    describe_counter!(
        RETRIED_REQUESTS_METRIC,
        "gRPC requests that retry an attempt that failed (grpc-previous-rpc-attempts), by RPC"
    );
    describe_histogram!(
        STAGE_DURATION_METRIC,
        Unit::Seconds,
        "time in each sampler stage's apply, by stage"
    );
    describe_counter!(
        PLUGIN_ERRORS_METRIC,
        "sampler plugin failures (error codes and post-check violations), by stage"
    );
    describe_gauge!(DRAINING_METRIC, "1 while draining for shutdown");
}

/// Binds `metrics.listen`.
pub async fn bind(cfg: &MetricsConfig) -> Result<TcpListener, MetricsError> {
    TcpListener::bind(cfg.listen)
        .await
        .map_err(|source| MetricsError::Bind {
            addr: cfg.listen,
            source,
        })
}

/// Serves `GET /metrics` on `listener` until the process ends (it keeps
/// answering while the gRPC server drains), with periodic exporter upkeep.
pub async fn serve(listener: TcpListener, handle: PrometheusHandle) -> std::io::Result<()> {
    let upkeep = handle.clone();
    tokio::spawn(async move {
        let mut tick = tokio::time::interval(UPKEEP_INTERVAL);
        loop {
            tick.tick().await;
            upkeep.run_upkeep();
        }
    });
    if let Ok(addr) = listener.local_addr() {
        tracing::info!(addr = %addr, path = METRICS_PATH, "metrics listening");
    }
    let app = axum::Router::new().route(
        METRICS_PATH,
        axum::routing::get(move || {
            let handle = handle.clone();
            async move {
                (
                    [(http::header::CONTENT_TYPE, CONTENT_TYPE)],
                    handle.render(),
                )
            }
        }),
    );
    axum::serve(listener, app).await
}

/// What the request layer knows about an RPC from its path.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct Rpc {
    /// Label value: `package.Service/Method`, or `unknown` (so clients cannot
    /// create series with made-up paths).
    name: &'static str,
    /// A SampleStream/SampleBatchStream/Generate stream (counted in
    /// `samplerd_active_streams`).
    stream: bool,
    /// Refused while draining (the Sampler RPCs; health and reflection keep
    /// answering so probes see NOT_SERVING).
    drains: bool,
}

/// Every RPC samplerd serves.
const RPCS: &[(&str, Rpc)] = &[
    (
        "/samplerd.v1.Sampler/Sample",
        Rpc {
            name: "samplerd.v1.Sampler/Sample",
            stream: false,
            drains: true,
        },
    ),
    (
        "/samplerd.v1.Sampler/SampleStream",
        Rpc {
            name: "samplerd.v1.Sampler/SampleStream",
            stream: true,
            drains: true,
        },
    ),
    (
        "/samplerd.v1.Sampler/Generate",
        Rpc {
            name: "samplerd.v1.Sampler/Generate",
            stream: true,
            drains: true,
        },
    ),
    (
        "/samplerd.v1.Sampler/SampleBatch",
        Rpc {
            name: "samplerd.v1.Sampler/SampleBatch",
            stream: false,
            drains: true,
        },
    ),
    (
        "/samplerd.v1.Sampler/SampleBatchStream",
        Rpc {
            name: "samplerd.v1.Sampler/SampleBatchStream",
            stream: true,
            drains: true,
        },
    ),
    (
        "/samplerd.v1.Sampler/ListStages",
        Rpc {
            name: "samplerd.v1.Sampler/ListStages",
            stream: false,
            drains: true,
        },
    ),
    (
        "/samplerd.v1.Sampler/Tokenize",
        Rpc {
            name: "samplerd.v1.Sampler/Tokenize",
            stream: false,
            drains: true,
        },
    ),
    (
        "/samplerd.v1.Sampler/Detokenize",
        Rpc {
            name: "samplerd.v1.Sampler/Detokenize",
            stream: false,
            drains: true,
        },
    ),
    (
        "/samplerd.v1.Sampler/GetServerInfo",
        Rpc {
            name: "samplerd.v1.Sampler/GetServerInfo",
            stream: false,
            drains: true,
        },
    ),
    (
        "/samplerd.v1.Sampler/RegisterSharedMemory",
        Rpc {
            name: "samplerd.v1.Sampler/RegisterSharedMemory",
            stream: false,
            drains: true,
        },
    ),
    (
        "/samplerd.v1.Sampler/UnregisterSharedMemory",
        Rpc {
            name: "samplerd.v1.Sampler/UnregisterSharedMemory",
            stream: false,
            drains: true,
        },
    ),
    (
        "/grpc.health.v1.Health/Check",
        Rpc {
            name: "grpc.health.v1.Health/Check",
            stream: false,
            drains: false,
        },
    ),
    (
        "/grpc.health.v1.Health/Watch",
        Rpc {
            name: "grpc.health.v1.Health/Watch",
            stream: false,
            drains: false,
        },
    ),
    (
        "/grpc.reflection.v1.ServerReflection/ServerReflectionInfo",
        Rpc {
            name: "grpc.reflection.v1.ServerReflection/ServerReflectionInfo",
            stream: false,
            drains: false,
        },
    ),
    (
        "/grpc.reflection.v1alpha.ServerReflection/ServerReflectionInfo",
        Rpc {
            name: "grpc.reflection.v1alpha.ServerReflection/ServerReflectionInfo",
            stream: false,
            drains: false,
        },
    ),
];

const UNKNOWN_RPC: Rpc = Rpc {
    name: "unknown",
    stream: false,
    drains: false,
};

impl Rpc {
    fn classify(path: &str) -> Rpc {
        RPCS.iter()
            .find(|(p, _)| *p == path)
            .map_or(UNKNOWN_RPC, |(_, r)| *r)
    }
}

/// The grpc-status in a header map (trailers, or a trailers-only response).
fn grpc_code(headers: &http::HeaderMap) -> Option<Code> {
    headers
        .get("grpc-status")
        .map(|v| Code::from_bytes(v.as_bytes()))
}

/// One request being observed: records its code and duration exactly once
/// (at its status, or as CANCELLED when the response is dropped unfinished)
/// and releases its in-flight and open-stream counts.
struct Observation {
    rpc: Rpc,
    start: Instant,
    done: bool,
    in_flight: Option<InFlight>,
    /// Set when the request body reported the client's reset.
    reset: Arc<AtomicBool>,
}

impl Observation {
    fn new(rpc: Rpc, in_flight: Option<InFlight>) -> Self {
        if rpc.stream {
            metrics::gauge!(ACTIVE_STREAMS_METRIC, "rpc" => rpc.name).increment(1.0);
        }
        Observation {
            rpc,
            start: Instant::now(),
            done: false,
            in_flight,
            reset: Arc::default(),
        }
    }

    fn finish(&mut self, code: Code) {
        if std::mem::replace(&mut self.done, true) {
            return;
        }
        let rpc = self.rpc.name;
        // A client that resets its stream mid-request (grpc-js does when it
        // fails to serialise a message after sending the headers) makes
        // the handler fail on a truncated body: that is the client's
        // cancel, not a server INTERNAL.
        let code = if self.reset.load(Ordering::Acquire) {
            metrics::counter!(CLIENT_RESETS_METRIC, "rpc" => rpc).increment(1);
            Code::Cancelled
        } else {
            code
        };
        metrics::counter!(REQUESTS_METRIC, "rpc" => rpc, "code" => code_name(code)).increment(1);
        metrics::histogram!(REQUEST_DURATION_METRIC, "rpc" => rpc)
            .record(self.start.elapsed().as_secs_f64());
        if self.rpc.stream {
            metrics::gauge!(ACTIVE_STREAMS_METRIC, "rpc" => rpc).decrement(1.0);
        }
        self.in_flight = None;
    }
}

impl Drop for Observation {
    fn drop(&mut self) {
        self.finish(Code::Cancelled);
    }
}

/// What a [`Watched`] body does with each poll of the body it wraps.
trait FrameWatch: Unpin + Send + 'static {
    fn saw(&mut self, polled: &Poll<Option<Result<http_body::Frame<Bytes>, Status>>>);
}

/// A tonic body passed through unchanged, each poll shown to `watch`.
struct Watched<W> {
    inner: tonic::body::Body,
    watch: W,
}

impl<W: FrameWatch> http_body::Body for Watched<W> {
    type Data = Bytes;
    type Error = Status;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<http_body::Frame<Bytes>, Status>>> {
        let this = &mut *self; // both fields are Unpin
        let polled = Pin::new(&mut this.inner).poll_frame(cx);
        this.watch.saw(&polled);
        polled
    }

    fn is_end_stream(&self) -> bool {
        self.inner.is_end_stream()
    }

    fn size_hint(&self) -> http_body::SizeHint {
        self.inner.size_hint()
    }
}

/// A response body reports its grpc-status trailer (or its premature drop)
/// to the request's [`Observation`].
impl FrameWatch for Observation {
    fn saw(&mut self, polled: &Poll<Option<Result<http_body::Frame<Bytes>, Status>>>) {
        match polled {
            Poll::Ready(Some(Ok(frame))) => {
                if let Some(code) = frame.trailers_ref().and_then(grpc_code) {
                    self.finish(code);
                }
            }
            Poll::Ready(Some(Err(_))) => self.finish(Code::Internal),
            // A body that ends without a status trailer was a trailers-only
            // response (already recorded) — or is dropped as CANCELLED.
            Poll::Ready(None) | Poll::Pending => {}
        }
    }
}

/// A request body flags the client's HTTP/2 reset of the stream (the error
/// tonic's body carries then has the remote `h2::Error` as its source).
struct ResetFlag(Arc<AtomicBool>);

impl FrameWatch for ResetFlag {
    fn saw(&mut self, polled: &Poll<Option<Result<http_body::Frame<Bytes>, Status>>>) {
        if let Poll::Ready(Some(Err(e))) = polled
            && is_remote_reset(e)
        {
            self.0.store(true, Ordering::Release);
        }
    }
}

/// Whether an error (or one of its sources) is the peer's reset of the
/// stream.
fn is_remote_reset(err: &(dyn std::error::Error + 'static)) -> bool {
    let mut cur = Some(err);
    while let Some(e) = cur {
        if let Some(h2) = e.downcast_ref::<h2::Error>()
            && h2.is_reset()
            && h2.is_remote()
        {
            return true;
        }
        cur = e.source();
    }
    false
}

/// The middleware over the whole gRPC router: request metrics plus the
/// shutdown admission gate (a layer: `WrapLayer(ObserveRpc::new(drain))`).
#[derive(Clone)]
pub struct ObserveRpc {
    drain: Arc<Drain>,
}

impl ObserveRpc {
    pub fn new(drain: Arc<Drain>) -> Self {
        ObserveRpc { drain }
    }
}

impl<S> Middleware<S, tonic::body::Body> for ObserveRpc
where
    S: tower::Service<http::Request<tonic::body::Body>, Response = HttpResponse> + Send + 'static,
    S::Future: Send + 'static,
    S::Error: Send + 'static,
{
    fn call(
        &self,
        mut inner: S,
        req: http::Request<tonic::body::Body>,
    ) -> ResponseFuture<S::Error> {
        let rpc = Rpc::classify(req.uri().path());
        if req.headers().contains_key(PREVIOUS_ATTEMPTS_HEADER) {
            metrics::counter!(RETRIED_REQUESTS_METRIC, "rpc" => rpc.name).increment(1);
        }
        let in_flight = if rpc.drains {
            match self.drain.admit() {
                Some(g) => Some(g),
                None => {
                    Observation::new(rpc, None).finish(Code::Unavailable);
                    let refused = crate::status::status(
                        crate::status::Reason::ShuttingDown,
                        SHUTTING_DOWN_MESSAGE,
                    )
                    .into_http();
                    return Box::pin(std::future::ready(Ok(refused)));
                }
            }
        } else {
            None
        };
        let mut obs = Observation::new(rpc, in_flight);
        let reset = Arc::clone(&obs.reset);
        let req = req.map(|body| {
            tonic::body::Body::new(Watched {
                inner: body,
                watch: ResetFlag(reset),
            })
        });
        Box::pin(async move {
            let resp = inner.call(req).await?;
            if let Some(code) = grpc_code(resp.headers()) {
                obs.finish(code);
            }
            let (parts, inner) = resp.into_parts();
            let body = tonic::body::Body::new(Watched { inner, watch: obs });
            Ok(http::Response::from_parts(parts, body))
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_served_rpc_is_classified_and_others_are_unknown() {
        assert_eq!(
            Rpc::classify("/samplerd.v1.Sampler/Generate").name,
            "samplerd.v1.Sampler/Generate"
        );
        assert!(Rpc::classify("/samplerd.v1.Sampler/SampleStream").stream);
        assert!(!Rpc::classify("/grpc.health.v1.Health/Check").drains);
        assert_eq!(Rpc::classify("/samplerd.v1.Sampler/Nope"), UNKNOWN_RPC);
        assert_eq!(Rpc::classify("/x"), UNKNOWN_RPC);
    }

    /// Every method of `samplerd.v1.Sampler` in the proto is classified
    /// (its own series in the metrics, refused while draining), and is
    /// counted as a stream exactly when either side streams — so a new RPC
    /// cannot land as `unknown`.
    #[test]
    fn every_sampler_method_in_the_proto_is_classified() {
        use prost::Message;
        let set = prost_types::FileDescriptorSet::decode(samplerd_api::FILE_DESCRIPTOR_SET)
            .expect("the API's descriptor set decodes");
        let mut seen = 0;
        for file in set.file.iter().filter(|f| f.package() == "samplerd.v1") {
            for service in &file.service {
                for method in &service.method {
                    let path = format!("/samplerd.v1.{}/{}", service.name(), method.name());
                    let rpc = Rpc::classify(&path);
                    assert_eq!(rpc.name, &path[1..], "{path} is not in RPCS");
                    assert!(rpc.drains, "{path} must be refused while draining");
                    assert_eq!(
                        rpc.stream,
                        method.client_streaming() || method.server_streaming(),
                        "{path}: stream flag"
                    );
                    seen += 1;
                }
            }
        }
        assert!(
            seen >= 11,
            "only {seen} methods found in the descriptor set"
        );
    }

    #[test]
    fn code_names_are_canonical() {
        assert_eq!(code_name(Code::Ok), "OK");
        assert_eq!(code_name(Code::ResourceExhausted), "RESOURCE_EXHAUSTED");
        assert_eq!(code_name(Code::from_i32(14)), "UNAVAILABLE");
    }
}
