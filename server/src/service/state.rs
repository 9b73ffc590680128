//! What the RPC handlers share: the state ([`AppState`]: the registry,
//! the configured defaults and limits, the pools and budgets, the
//! constraint compiler, the model host), the response stream type
//! ([`BoxStream`]) and how a request's chain is logged ([`chain_for_log`]).

#![forbid(unsafe_code)]

use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};

use samplerd_sampling::spec::LogDetail;
use samplerd_sampling::{Chain, StageRegistry};
use tokio::sync::Semaphore;
use tokio_stream::Stream;
use tonic::Status;

use crate::generate::GenerateConfig;
use crate::generate::generator::Generator;
use crate::request::buffer_pool::BufferPool;
use crate::request::step_pool::StepPool;
use crate::request::{memory, vocabularies};
use crate::service::constraint;
use crate::service::defaults::Defaults;
use crate::service::limits::LimitsConfig;
use crate::service::lse_helper::LseHelper;
use crate::service::shared_memory::{SharedMemoryConfig, SharedRegions};
use crate::status::{Failure, Reason};

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
    /// The shared-memory regions clients registered.
    pub shared: Arc<SharedRegions>,
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
        let shared = SharedRegions::new(SharedMemoryConfig::new(
            &crate::transport::listen::TransportConfig::default(),
            &limits,
        ));
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
            shared,
            next_request_id: AtomicU64::new(1),
        })
    }

    /// A sequence number for the request (its log span's `seq`, beside the
    /// `rpc` span's `request_id`; the crash report).
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
}

/// Boxed response stream type.
pub type BoxStream<T> = Pin<Box<dyn Stream<Item = Result<T, Status>> + Send + 'static>>;
