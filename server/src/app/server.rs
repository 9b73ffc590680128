//! Assembling and running the gRPC server: plugin loading, the default
//! chain, the Sampler service with its message-size limits, health
//! (SERVING once plugins are loaded and, when configured, the model is
//! ready) and reflection (v1 and v1alpha, for grpcurl 1.8.x; with the
//! `google.rpc` error-detail types), request metrics, and draining on
//! shutdown (`crate::app::shutdown`).

#![forbid(unsafe_code)]

use std::future::Future;
use std::net::SocketAddr;
use std::pin::Pin;
use std::sync::Arc;
use std::time::Duration;

use samplerd_api::v1::sampler_server::SamplerServer;
use samplerd_sampling::{LoadError, StageRegistry};
use tokio::sync::oneshot;
use tokio::task::JoinHandle;
use tonic::codec::CompressionEncoding;
use tonic::service::RoutesBuilder;
use tonic_health::ServingStatus;
use tonic_health::server::HealthReporter;

use crate::app::config::Config;
use crate::generate::generator::Generator;
use crate::service::SamplerService;
use crate::service::defaults::{DefaultChainError, Defaults};
use crate::service::shared_memory::{SharedMemoryConfig, SharedRegions};
use crate::service::state::AppState;
use crate::transport::compression::ResponseCompression;
use crate::transport::connections::CountActive;
use crate::transport::content_type::GrpcOnly;
use crate::transport::deadline::Deadline;
use crate::transport::drain::{CLOSE_TIMEOUT, Drain};
use crate::transport::listen::{Bound, Listen};
use crate::transport::metrics::{DRAINING_METRIC, ObserveRpc};
use crate::transport::middleware::{Wrap, WrapLayer};
use crate::transport::one_frame::OneFrameDecode;
use crate::transport::request_id::AssignRequestId;
use crate::transport::status_fixup::CompleteStatus;
use crate::transport::tls::SecurityError;
use crate::transport::unary::{SplitMethod, UnaryGuard, UnaryMethod};

/// HTTP/2 SETTINGS_MAX_FRAME_SIZE the server accepts: a 0.6 MB logits
/// message arrives in one DATA frame instead of 37 of the default 16 KiB
/// (fewer wake-ups of the request task per message).
pub const HTTP2_MAX_FRAME_BYTES: u32 = 1 << 20;

/// The one Sampler method with a request limit of its own.
const GENERATE_PATH: &str = "/samplerd.v1.Sampler/Generate";
/// How often health re-checks a model that is still loading.
const MODEL_READY_POLL: Duration = Duration::from_millis(100);
/// How often readiness re-checks the sampling pool's health.
const STEP_POOL_POLL: Duration = Duration::from_millis(100);
/// Health service name for liveness probes: SERVING while the process
/// answers, including while it drains (readiness uses "", which turns
/// NOT_SERVING on shutdown; a liveness failure would restart the pod).
pub const LIVENESS_SERVICE: &str = "samplerd.liveness";

/// Why the server could not start.
#[derive(Debug, thiserror::Error)]
pub enum StartError {
    #[error("loading plugins: {0}")]
    Plugins(#[from] LoadError),
    #[error("default chain: {0}")]
    Chain(#[from] DefaultChainError),
    #[error("{0}")]
    Bind(#[from] crate::transport::listen::BindError),
    #[error("server task: {0}")]
    Task(String),
    #[error("reflection: {0}")]
    Reflection(#[from] tonic_reflection::server::Error),
    #[error("server: {0}")]
    Transport(#[from] tonic::transport::Error),
    #[error("{0}")]
    Tls(#[from] crate::transport::tls::TlsError),
    #[error("{0}")]
    Auth(#[from] crate::transport::auth::AuthError),
    #[error("cannot start the sampling threads (limits.sampling_threads): {0}")]
    StepPool(#[source] std::io::Error),
    #[error("{0}")]
    Vocabulary(#[from] Box<crate::request::vocabularies::VocabularyError>),
}

impl From<SecurityError> for StartError {
    fn from(e: SecurityError) -> Self {
        match e {
            SecurityError::Tls(e) => StartError::Tls(e),
            SecurityError::Auth(e) => StartError::Auth(e),
        }
    }
}

/// Loads the configured plugins (or the core library next to the
/// executable when none are configured).
pub fn load_registry(config: &Config) -> Result<StageRegistry, LoadError> {
    let (dirs, files) = config.plugins.resolve();
    StageRegistry::load_trusted(&dirs, &files, &config.plugins.trust_policy())
}

/// Builds the shared state from a loaded registry.
pub fn build_state(
    config: &Config,
    registry: StageRegistry,
    generator: Option<Arc<dyn Generator>>,
) -> Result<Arc<AppState>, StartError> {
    let defaults = Defaults::build(
        &config.chain,
        &config.sampling,
        config.limits.max_chain_stages,
        &registry,
    )?;
    let mut state = AppState::new(
        Arc::new(registry),
        defaults,
        config.limits.clone(),
        config.generate.clone(),
        generator,
    )
    .map_err(StartError::StepPool)?;
    state.vocabularies = crate::request::vocabularies::Vocabularies::load(&config.vocabularies)?;
    state.shared = SharedRegions::new(SharedMemoryConfig::new(&config.transport, &config.limits));
    Ok(Arc::new(state))
}

/// A generated service with gzip and zstd both ways: a request compressed
/// with either is accepted, and a response is compressed when the client
/// asks for it in `grpc-accept-encoding` (tonic negotiates) and
/// `[compression]` lets it (`transport/compression.rs`). A common client
/// setting (grpc-js, grpcio and grpc-go channel options); without it such a
/// client got UNIMPLEMENTED from every service, reflection and health too.
/// The one-frame fast path serves uncompressed messages only.
macro_rules! compressed {
    ($service:expr) => {
        $service
            .accept_compressed(CompressionEncoding::Gzip)
            .accept_compressed(CompressionEncoding::Zstd)
            .send_compressed(CompressionEncoding::Gzip)
            .send_compressed(CompressionEncoding::Zstd)
    };
}

/// Serves on `listener` until `shutdown` resolves, then drains: health
/// NOT_SERVING, new Sampler RPCs refused (UNAVAILABLE), running ones given
/// up to `shutdown.grace_period_secs`, connections closed (see
/// `crate::app::shutdown`).
pub async fn serve(
    state: Arc<AppState>,
    config: &Config,
    bound: Bound,
    shutdown: impl Future<Output = ()> + Send,
) -> Result<(), StartError> {
    // Removed when serving ends, however it ends.
    let Bound {
        listeners,
        addrs,
        socket_files: _socket_files,
    } = bound;
    let limits = &config.limits;
    let unary = unary_guard(config);
    // Generate has an instance of its own whose decoding limit is its
    // request limit: tonic then stops inflating a compressed prompt there
    // (`transport/unary.rs`).
    let generate = compressed!(SamplerServer::new(SamplerService {
        state: state.clone(),
    }))
    .max_decoding_message_size(config.generate.max_request_bytes)
    .max_encoding_message_size(limits.max_message_bytes);
    let sampler = Wrap::new(
        unary,
        SplitMethod::new(
            GENERATE_PATH,
            generate,
            Wrap::new(
                OneFrameDecode::new(limits.max_message_bytes),
                compressed!(SamplerServer::new(SamplerService {
                    state: state.clone(),
                }))
                .max_decoding_message_size(limits.max_message_bytes)
                .max_encoding_message_size(limits.max_message_bytes),
            ),
        ),
    );

    let (reporter, health) = tonic_health::server::health_reporter();
    let health = compressed!(health);
    reporter
        .set_service_status("", ServingStatus::NotServing)
        .await;
    reporter
        .set_not_serving::<SamplerServer<SamplerService>>()
        .await;
    reporter
        .set_service_status(LIVENESS_SERVICE, ServingStatus::Serving)
        .await;

    let reflection = || {
        tonic_reflection::server::Builder::configure()
            .register_encoded_file_descriptor_set(samplerd_api::FILE_DESCRIPTOR_SET)
            .register_encoded_file_descriptor_set(tonic_health::pb::FILE_DESCRIPTOR_SET)
            // google.rpc's error details, so that grpcurl (and any
            // reflection client) can decode a status's details.
            .register_encoded_file_descriptor_set(tonic_types::pb::FILE_DESCRIPTOR_SET)
    };
    let reflection_v1 = compressed!(reflection().build_v1()?);
    let reflection_v1alpha = compressed!(reflection().build_v1alpha()?);

    let readiness = follow_readiness(&state, reporter.clone());

    let local = Listen::new(addrs)
        .map(|l| l.to_string())
        .unwrap_or_default();
    let incoming = crate::transport::connections::incoming(listeners, limits.connections());
    let drain = Drain::new();
    let (close_tx, close_rx) = oneshot::channel::<()>();
    let (builder, auth) = crate::transport::tls::secured_builder(
        &config.tls,
        &config.auth,
        &config.listen,
        Duration::from_millis(limits.handshake_timeout_ms),
    )?;
    let server = builder
        .initial_stream_window_size(limits.http2_stream_window_bytes)
        .initial_connection_window_size(limits.http2_connection_window_bytes)
        .max_frame_size(HTTP2_MAX_FRAME_BYTES)
        .max_concurrent_streams(limits.max_streams_per_connection)
        .http2_keepalive_interval(Some(Duration::from_secs(limits.keepalive_interval_secs)))
        .http2_keepalive_timeout(Some(Duration::from_secs(limits.keepalive_timeout_secs)))
        // Outermost: every response gets its id, and every log line of
        // the layers below (and of the handler) its `rpc` span.
        .layer(WrapLayer(AssignRequestId))
        // Next, so it sees the final status of every response.
        .layer(WrapLayer(ObserveRpc::new(drain.clone())))
        .layer(WrapLayer(CountActive))
        .layer(WrapLayer(GrpcOnly))
        .layer(auth)
        .layer(WrapLayer(Deadline::new(Duration::from_secs(
            limits.max_request_duration_secs,
        ))))
        // Whether tonic may compress the response (`[compression]`).
        .layer(WrapLayer(ResponseCompression::new(&config.compression)))
        // Innermost: tonic's own statuses get their details (and the
        // metrics above count the code they end with).
        .layer(WrapLayer(CompleteStatus));
    let mut routes = RoutesBuilder::default();
    routes.add_service(health).add_service(sampler);
    if config.reflection {
        routes
            .add_service(reflection_v1)
            .add_service(reflection_v1alpha);
    }
    // Each connection is served on its own, so that it can age on its own
    // (`transport/max_age.rs`).
    let server = crate::transport::max_age::serve(
        server,
        routes.routes(),
        incoming,
        limits.connection_age(),
        async {
            let _ = close_rx.await;
        },
    );
    // Only now: TLS and token files are loaded and the listener is bound
    // (connections wait in its backlog until the server polls it), so a
    // start-up error can no longer follow this line.
    tracing::info!(
        addr = %local,
        chain = %state.defaults.chain.describe(),
        stages = state.registry.stages().len(),
        "samplerd serving"
    );
    tokio::pin!(server);
    tokio::select! {
        () = &mut server => return Ok(()),
        () = shutdown => {}
    }
    let grace = config.shutdown.grace_period();
    drain_then_close(server, &drain, readiness, &reporter, grace, close_tx).await;
    // No request is left to read them.
    state.shared.clear();
    Ok(())
}

/// The drain after the shutdown signal: readiness fails at once, running
/// requests may finish within `grace`, then every connection gets a GOAWAY
/// and [`CLOSE_TIMEOUT`] to close.
async fn drain_then_close(
    mut server: Pin<&mut impl Future<Output = ()>>,
    drain: &Drain,
    readiness: JoinHandle<()>,
    reporter: &HealthReporter,
    grace: Duration,
    close_tx: oneshot::Sender<()>,
) {
    let deadline = tokio::time::Instant::now() + grace;
    drain.start();
    readiness.abort();
    reporter
        .set_not_serving::<SamplerServer<SamplerService>>()
        .await;
    reporter
        .set_service_status("", ServingStatus::NotServing)
        .await;
    metrics::gauge!(DRAINING_METRIC).set(1.0);
    tracing::info!(
        in_flight = drain.in_flight(),
        grace_period_secs = grace.as_secs(),
        "shutting down: NOT_SERVING, refusing new requests, draining"
    );
    tokio::select! {
        () = server.as_mut() => return,
        idle = tokio::time::timeout_at(deadline, drain.wait_idle()) => {
            if idle.is_err() {
                tracing::warn!(
                    in_flight = drain.in_flight(),
                    grace_period_secs = grace.as_secs(),
                    "grace period over: cutting the requests still running"
                );
            }
        }
    }
    // GOAWAY to every connection; streams that outlive CLOSE_TIMEOUT (health
    // watchers, requests past the grace period) are cut when this returns.
    let _ = close_tx.send(());
    if tokio::time::timeout(CLOSE_TIMEOUT, server).await.is_err() {
        tracing::info!("closing the connections still open");
    }
}

/// The methods held to one request message: Generate's with a size limit
/// of its own (`generate.max_request_bytes`).
fn unary_guard(config: &Config) -> UnaryGuard {
    UnaryGuard::new(vec![
        UnaryMethod {
            path: "/samplerd.v1.Sampler/Sample",
            limit: None,
        },
        UnaryMethod {
            path: "/samplerd.v1.Sampler/ListStages",
            limit: None,
        },
        UnaryMethod {
            path: "/samplerd.v1.Sampler/SampleBatch",
            limit: None,
        },
        UnaryMethod {
            path: "/samplerd.v1.Sampler/RegisterSharedMemory",
            limit: None,
        },
        UnaryMethod {
            path: "/samplerd.v1.Sampler/UnregisterSharedMemory",
            limit: None,
        },
        UnaryMethod {
            path: "/samplerd.v1.Sampler/Tokenize",
            limit: None,
        },
        UnaryMethod {
            path: "/samplerd.v1.Sampler/Detokenize",
            limit: None,
        },
        UnaryMethod {
            path: "/samplerd.v1.Sampler/GetServerInfo",
            limit: None,
        },
        // Server-streaming, but one request message like a unary call.
        UnaryMethod {
            path: GENERATE_PATH,
            limit: Some((
                config.generate.max_request_bytes,
                "generate.max_request_bytes",
            )),
        },
    ])
}

/// The readiness task: the Sampler and "" turn SERVING once the model (if
/// any) is loaded, then follow the sampling pool's health.
fn follow_readiness(state: &AppState, reporter: HealthReporter) -> JoinHandle<()> {
    // Plugins are loaded (the registry exists); wait for the model if any.
    let generator = state.generator.clone();
    // Then follow the sampling pool: once more of its threads are stuck in
    // steps than it may replace, readiness turns NOT_SERVING (liveness
    // stays SERVING: the process itself still answers).
    let steps = state.steps.clone();
    tokio::spawn(async move {
        if let Some(g) = generator {
            while !g.ready() {
                tokio::time::sleep(MODEL_READY_POLL).await;
            }
        }
        let mut serving = None;
        loop {
            let healthy = steps.healthy();
            if serving != Some(healthy) {
                let status = if healthy {
                    reporter
                        .set_serving::<SamplerServer<SamplerService>>()
                        .await;
                    ServingStatus::Serving
                } else {
                    reporter
                        .set_not_serving::<SamplerServer<SamplerService>>()
                        .await;
                    ServingStatus::NotServing
                };
                reporter.set_service_status("", status).await;
                serving = Some(healthy);
            }
            tokio::time::sleep(STEP_POOL_POLL).await;
        }
    })
}

/// A server running on a background task (tests, benchmarks).
pub struct RunningServer {
    /// The first TCP address bound (useful with port 0); 0.0.0.0:0 when
    /// only Unix sockets are configured.
    pub addr: SocketAddr,
    /// The first Unix socket bound.
    pub unix: Option<std::path::PathBuf>,
    /// The shared state (for diagnostics in tests).
    pub state: Arc<AppState>,
    shutdown: Option<oneshot::Sender<()>>,
    task: JoinHandle<Result<(), StartError>>,
}

impl RunningServer {
    /// Stops the server and waits for it.
    pub async fn stop(mut self) -> Result<(), StartError> {
        if let Some(tx) = self.shutdown.take() {
            let _ = tx.send(());
        }
        match (&mut self.task).await {
            Ok(r) => r,
            Err(e) => Err(StartError::Task(e.to_string())),
        }
    }
}

/// Loads plugins, binds `config.listen` and serves in the background.
pub async fn spawn(
    config: Config,
    generator: Option<Arc<dyn Generator>>,
) -> Result<RunningServer, StartError> {
    let registry = load_registry(&config)?;
    let state = build_state(&config, registry, generator)?;
    let bound =
        crate::transport::listen::bind(&config.listen, config.transport.unix_socket_mode).await?;
    let addr = bound
        .tcp()
        .unwrap_or_else(|| SocketAddr::from(([0, 0, 0, 0], 0)));
    let unix = bound.unix().map(std::path::Path::to_path_buf);
    let (tx, rx) = oneshot::channel();
    let st = state.clone();
    let task = tokio::spawn(async move {
        serve(st, &config, bound, async {
            let _ = rx.await;
        })
        .await
    });
    Ok(RunningServer {
        addr,
        unix,
        state,
        shutdown: Some(tx),
        task,
    })
}
