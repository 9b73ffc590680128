//! The `samplerd.v1.Sampler` service: shared state ([`AppState`]), the
//! configured defaults ([`Defaults`]) and one module per RPC
//! (`sample`, `stream`, `batch`, `batch_stream`, `generate`, `stages`). Every sampling step, and
//! every other call into plugin code (chain builds included), runs through
//! [`crate::request::step_pool`] under its watchdog, on the sampling pool's
//! threads — never on a runtime worker: whatever a stage does, health checks,
//! /metrics and the other RPCs keep answering.

pub mod batch;
pub mod batch_stream;
pub mod constraint;
pub mod generate;
pub mod lse_helper;
pub mod sample;
pub mod stages;
pub mod stream;
pub mod validate;

use std::collections::hash_map::RandomState;
use std::hash::{BuildHasher, Hasher};
use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};

use samplerd_api::v1;
use samplerd_api::v1::sampler_server::Sampler;
use samplerd_sampling::spec::LogDetail;
use samplerd_sampling::{Chain, ChainError, ChainSpec, SamplingParams, StageRegistry};
use tokio::sync::Semaphore;
use tokio_stream::Stream;
use tonic::{Request, Response, Status, Streaming};

use crate::app::config::{Config, LimitsConfig, SeedSetting};
use crate::generate::GenerateConfig;
use crate::generate::generator::Generator;
use crate::request::buffer_pool::BufferPool;
use crate::request::{memory, vocabularies};
use crate::request::errors::RequestError;
use crate::request::step_pool::StepPool;
use crate::status::{Failure, Reason};
use lse_helper::LseHelper;

/// A request's chain as its log span records it. Its text (a grammar, a
/// stage's strings) is the client's content: at INFO only each text's
/// length and a short hash; with DEBUG on, the first bytes of each, as an
/// error message quotes them ([`samplerd_sampling::echo`]).
pub fn chain_for_log(chain: &Chain) -> String {
    let detail = if tracing::enabled!(tracing::Level::DEBUG) {
        LogDetail::Excerpt
    } else {
        LogDetail::Digest
    };
    chain.spec().for_log(detail).to_string()
}

/// The configured defaults: typed parameters, seed setting and the
/// default chain (built once at start-up).
pub struct Defaults {
    /// Typed defaults (config `[sampling]` + `chain.order`).
    pub params: SamplingParams,
    /// Config `sampling.seed`.
    pub seed: SeedSetting,
    /// The default chain's spec.
    pub spec: ChainSpec,
    /// The default chain, shared by every request that sets no parameter.
    pub chain: Chain,
    /// Config `limits.max_chain_stages`: longest chain a request may ask for.
    pub max_chain_stages: usize,
}

/// Which part of the configuration a default-chain error comes from.
#[derive(Debug, thiserror::Error)]
#[error("{key}: {error}")]
pub struct DefaultChainError {
    /// The config key: `sampling.<field>` for a stage's refusal of a typed
    /// default, else `chain.stages`, `chain.order` or `sampling`.
    pub key: String,
    pub error: ChainError,
}

impl Defaults {
    /// Builds the default chain from the configuration: `chain.stages` when
    /// set, else `[sampling]` in `chain.order`.
    pub fn build(cfg: &Config, registry: &StageRegistry) -> Result<Self, DefaultChainError> {
        let params = cfg.sampling.params(&cfg.chain.order);
        let chain = if cfg.chain.stages.is_empty() {
            registry.build_typed(&params, None).map_err(|error| {
                let key = match &error {
                    ChainError::Param { field, .. } => format!("sampling.{field}"),
                    _ if cfg.chain.order.is_empty() => "sampling".to_string(),
                    _ => "chain.order".to_string(),
                };
                DefaultChainError { key, error }
            })?
        } else {
            let spec = ChainSpec {
                stages: cfg.chain.stages.clone(),
            };
            registry
                .build_chain(&spec, None)
                .map_err(|error| DefaultChainError {
                    key: "chain.stages".to_string(),
                    error,
                })?
        };
        Ok(Defaults {
            params,
            seed: cfg.sampling.seed,
            spec: chain.spec().clone(),
            chain,
            max_chain_stages: cfg.limits.max_chain_stages,
        })
    }

    /// The configured seed, or a fresh one for `seed = "random"`.
    pub fn default_seed(&self) -> u64 {
        match self.seed {
            SeedSetting::Fixed(s) => s,
            SeedSetting::Random => random_seed(),
        }
    }
}

/// A fresh, unpredictable seed (std's per-process random hasher keys,
/// mixed with a counter).
fn random_seed() -> u64 {
    static COUNTER: AtomicU64 = AtomicU64::new(0);
    let mut h = RandomState::new().build_hasher();
    h.write_u64(COUNTER.fetch_add(1, Ordering::Relaxed));
    h.finish()
}

/// Everything the handlers share.
pub struct AppState {
    pub registry: Arc<StageRegistry>,
    pub defaults: Defaults,
    pub limits: LimitsConfig,
    /// `[generate]`: the limits a Generate request is validated against.
    pub generate: GenerateConfig,
    /// `limits.memory_budget_bytes` and what requests hold of it.
    pub memory: Arc<memory::MemoryBudget>,
    pub pool: Arc<BufferPool>,
    /// The raw log-sum-exp's helper core (`limits.parallel_logprob`).
    pub lse: LseHelper,
    /// Permits for open SampleStream/Generate streams.
    pub streams: Arc<Semaphore>,
    /// Open SampleStream sessions (for tests and diagnostics).
    pub open_sessions: AtomicUsize,
    pub generator: Option<Arc<dyn Generator>>,
    /// The threads that run sampling steps (`limits.sampling_threads`).
    pub steps: StepPool,
    /// `[vocabularies]`, for requests that name one.
    pub vocabularies: vocabularies::Vocabularies,
    /// Compiles requests' constraints off the sampling threads, within the
    /// `limits.*constraint*` limits, and caches them.
    pub constraints: constraint::Constraints,
    next_request_id: AtomicU64,
}

impl AppState {
    pub fn new(
        registry: Arc<StageRegistry>,
        defaults: Defaults,
        limits: LimitsConfig,
        generate: GenerateConfig,
        generator: Option<Arc<dyn Generator>>,
    ) -> std::io::Result<Self> {
        let memory = memory::MemoryBudget::new(limits.memory_budget_bytes);
        Ok(AppState {
            constraints: constraint::Constraints::new(
                limits.constraint(),
                Arc::clone(&registry),
                Arc::clone(&memory),
            ),
            registry,
            defaults,
            pool: Arc::new(BufferPool::new(limits.buffer_pool_size, limits.max_vocab)),
            lse: LseHelper::new(&limits.parallel_logprob),
            streams: Arc::new(Semaphore::new(limits.max_concurrent_streams)),
            steps: StepPool::start(limits.step_pool())?,
            memory,
            limits,
            generate,
            open_sessions: AtomicUsize::new(0),
            generator,
            vocabularies: Default::default(),
            next_request_id: AtomicU64::new(1),
        })
    }

    /// A new request id (for the request's log span).
    pub fn request_id(&self) -> u64 {
        self.next_request_id.fetch_add(1, Ordering::Relaxed)
    }

    /// Number of open SampleStream sessions.
    pub fn open_sessions(&self) -> usize {
        self.open_sessions.load(Ordering::Relaxed)
    }

    /// A stream permit, or RESOURCE_EXHAUSTED naming the limit.
    pub fn stream_permit(&self) -> Result<tokio::sync::OwnedSemaphorePermit, Status> {
        self.streams.clone().try_acquire_owned().map_err(|_| {
            Failure::new(
                Reason::Overloaded,
                format!(
                    "too many open streams: limits.max_concurrent_streams = {}",
                    self.limits.max_concurrent_streams
                ),
            )
            .limit("limits.max_concurrent_streams")
            .into_status()
        })
    }

    /// The compiled constraint stages of parameters `p` (against
    /// `params.vocabulary`'s vocabulary, or `vocab` when given: Generate's
    /// model vocabulary), compiled off the sampling threads: what
    /// validation then builds the chain with.
    pub async fn prepare_constraints(
        &self,
        p: Option<&v1::SamplingParams>,
        vocab: Option<&Arc<samplerd_sampling::Vocabulary>>,
        request: u64,
    ) -> Result<constraint::Prepared, RequestError> {
        let vocab = match vocab {
            Some(v) => v,
            None => match self.named_vocabulary(p)? {
                Some(v) => v,
                None => return Ok(constraint::Prepared::default()),
            },
        };
        self.constraints
            .prepare(&self.defaults, p, Some(vocab), request)
            .await
    }

    /// [`prepare_constraints`](Self::prepare_constraints) without a
    /// runtime (the protobuf fuzz target).
    pub fn prepare_constraints_blocking(
        &self,
        p: Option<&v1::SamplingParams>,
        vocab: Option<&Arc<samplerd_sampling::Vocabulary>>,
    ) -> Result<constraint::Prepared, RequestError> {
        let vocab = match vocab {
            Some(v) => v,
            None => match self.named_vocabulary(p)? {
                Some(v) => v,
                None => return Ok(constraint::Prepared::default()),
            },
        };
        self.constraints
            .prepare_blocking(&self.defaults, p, Some(vocab))
    }

    /// The vocabulary a constraint compiles against when the caller has
    /// none of its own: the one `params.vocabulary` names, or `None` when
    /// nothing needs compiling — the name is unknown (validation refuses
    /// it before any chain is built), or no stage needs one. Empty while a
    /// stage needs one is refused here as validation would, naming
    /// `params.vocabulary` (a compile without would only say that the
    /// stage has no vocabulary).
    fn named_vocabulary(
        &self,
        p: Option<&v1::SamplingParams>,
    ) -> Result<Option<&Arc<samplerd_sampling::Vocabulary>>, RequestError> {
        match p.map(|p| p.vocabulary.as_str()).filter(|n| !n.is_empty()) {
            None => validate::vocabulary_needed(self, p).map(|()| None),
            Some(n) => Ok(self.vocabularies.get(n)),
        }
    }
}

/// The tonic service.
#[derive(Clone)]
pub struct SamplerService {
    pub state: Arc<AppState>,
}

/// Boxed response stream type.
pub type BoxStream<T> = Pin<Box<dyn Stream<Item = Result<T, Status>> + Send + 'static>>;

#[tonic::async_trait]
impl Sampler for SamplerService {
    async fn sample(
        &self,
        mut request: Request<v1::SampleRequest>,
    ) -> Result<Response<v1::SampleResponse>, Status> {
        let message = match request
            .extensions_mut()
            .remove::<crate::transport::one_frame::Predecoded>()
        {
            Some(crate::transport::one_frame::Predecoded(message)) => message,
            None => request.into_inner(),
        };
        sample::handle(self.state.clone(), message)
            .await
            .map(Response::new)
    }

    type SampleStreamStream = BoxStream<v1::SampleResponse>;

    async fn sample_stream(
        &self,
        request: Request<Streaming<v1::SampleStreamRequest>>,
    ) -> Result<Response<Self::SampleStreamStream>, Status> {
        let predecoded = request
            .extensions()
            .get::<crate::transport::one_frame::PredecodedStream>()
            .cloned()
            .unwrap_or_default();
        stream::handle(self.state.clone(), request.into_inner(), predecoded).map(Response::new)
    }

    type GenerateStream = BoxStream<v1::GenerateResponse>;

    async fn generate(
        &self,
        request: Request<v1::GenerateRequest>,
    ) -> Result<Response<Self::GenerateStream>, Status> {
        generate::handle(self.state.clone(), request.into_inner()).await
    }

    async fn sample_batch(
        &self,
        request: Request<v1::SampleBatchRequest>,
    ) -> Result<Response<v1::SampleBatchResponse>, Status> {
        batch::handle(self.state.clone(), request.into_inner())
            .await
            .map(Response::new)
    }

    type SampleBatchStreamStream = BoxStream<v1::SampleBatchResponse>;

    async fn sample_batch_stream(
        &self,
        request: Request<Streaming<v1::SampleBatchStreamRequest>>,
    ) -> Result<Response<Self::SampleBatchStreamStream>, Status> {
        batch_stream::handle(self.state.clone(), request.into_inner()).map(Response::new)
    }

    async fn list_stages(
        &self,
        _request: Request<v1::ListStagesRequest>,
    ) -> Result<Response<v1::ListStagesResponse>, Status> {
        Ok(Response::new(stages::list(&self.state)))
    }
}
