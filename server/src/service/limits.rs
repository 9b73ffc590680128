//! `[limits]`: what one request, one connection and the whole server may
//! use, each default written once (its `Default` impl); the sampling
//! pool's, the constraint compiler's, the listener's and the connections'
//! age settings are derived from it.

#![forbid(unsafe_code)]

use serde::{Deserialize, Serialize};

/// Resource limits.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct LimitsConfig {
    /// Largest gRPC message accepted or sent, in bytes.
    pub max_message_bytes: usize,
    /// Largest vocabulary (number of logits) accepted.
    pub max_vocab: usize,
    /// Most SampleStream/Generate streams open at once (server-wide).
    pub max_concurrent_streams: usize,
    /// Most `previous_tokens` accepted in one request.
    pub max_window_tokens: usize,
    /// Token buffers kept for reuse between requests.
    pub buffer_pool_size: usize,
    /// Most candidates `n_probs` may ask for.
    pub max_n_probs: u32,
    /// Most rows in one SampleBatch request, and most sequences open at
    /// once in one SampleBatchStream.
    pub max_batch_rows: usize,
    /// Most draft tokens one `Verify` may carry (K; it sends K + 1 target
    /// rows, and K drafter rows under REJECTION).
    pub max_draft_tokens: usize,
    /// Most choices (`GenerateRequest.n`) of one Generate: each decodes
    /// as its own sequence with its own KV cache.
    pub max_choices: usize,
    /// Most shared-memory regions registered at once (all clients
    /// together; at most `service::shared_memory::MAX_REGIONS`).
    pub max_shared_regions: usize,
    /// Most bytes of shared memory registered at once (all clients
    /// together). The server maps them; the client's memory holds them.
    pub max_shared_bytes: u64,
    /// HTTP/2 flow-control window per stream, in bytes (large enough for
    /// a whole 0.6 MB logits message without waiting for window updates).
    pub http2_stream_window_bytes: u32,
    /// HTTP/2 flow-control window per connection, in bytes.
    pub http2_connection_window_bytes: u32,
    /// Most concurrent RPCs (HTTP/2 streams) on one connection, advertised
    /// in SETTINGS_MAX_CONCURRENT_STREAMS; well-behaved clients queue above
    /// it, others get REFUSED_STREAM.
    pub max_streams_per_connection: u32,
    /// Server-side cap on any request's duration (including its response
    /// stream), in seconds; a client's shorter `grpc-timeout` wins. Past it
    /// the RPC ends with DEADLINE_EXCEEDED.
    pub max_request_duration_secs: u64,
    /// Most stages in a request's `params.chain` or `params.samplers`.
    pub max_chain_stages: usize,
    /// Largest grammar text of a request's `params.constraint` (a JSON
    /// Schema, regex, grammar, or the choices together), in bytes: compiling
    /// one is work of its size, refused before any of it.
    pub max_constraint_bytes: usize,
    /// Deepest bracket nesting of a constraint's grammar (GBNF/Lark groups,
    /// regex groups and classes, JSON nesting), checked before it compiles
    /// (`service/constraint/measure.rs`). With `max_constraint_rules` it
    /// sizes the compile threads' stack.
    pub max_constraint_depth: usize,
    /// Most rules of a constraint's grammar (GBNF/Lark rules and
    /// terminals, distinct JSON Schema `$ref` targets), checked before it
    /// compiles.
    pub max_constraint_rules: usize,
    /// Most triggers of a lazy constraint (`params.constraint`'s
    /// `trigger_strings` and `trigger_tokens` together): each output token
    /// is searched for every string while the constraint waits.
    pub max_constraint_triggers: usize,
    /// Longest trigger string of a lazy constraint, in bytes; each
    /// sequence keeps this many bytes of output while it waits.
    pub max_constraint_trigger_bytes: usize,
    /// Constraint compiles running at once, each on a thread of its own
    /// (never a sampling thread).
    pub constraint_compile_threads: usize,
    /// Constraint compiles waiting for a compile thread; one more is
    /// refused at once (RESOURCE_EXHAUSTED, retryable).
    pub constraint_compile_queue: usize,
    /// How long a request waits for its constraint to compile, queueing
    /// included, in milliseconds; past it the request is refused
    /// (RESOURCE_EXHAUSTED) and that grammar is refused at once from then on.
    pub max_constraint_compile_ms: u64,
    /// Compiled constraints (and refusals) kept for reuse, by grammar and
    /// vocabulary.
    pub constraint_cache_entries: usize,
    /// What the kept compiled constraints may be charged in all (each is
    /// also charged to `memory_budget_bytes`), in bytes.
    pub constraint_cache_bytes: usize,
    /// Sampling threads (`crate::request::step_pool`: every step and every other
    /// call into plugin code runs there, never on the async runtime);
    /// 0: one per CPU.
    pub sampling_threads: usize,
    /// A sampling step's budget in milliseconds, time waiting for a thread
    /// included: past it the request fails (DEADLINE_EXCEEDED naming the
    /// stage it is in) and the thread running it is written off. The
    /// heaviest legal step of core stages takes ~0.9 s (many top_p stages
    /// over 262,144 logits on 2 cores).
    pub max_step_ms: u64,
    /// Written-off sampling threads replaced at once; past this many,
    /// readiness turns NOT_SERVING (liveness stays SERVING).
    pub max_stuck_workers: usize,
    /// What requests may hold in memory together (logits, windows, token
    /// maps, SampleStream sessions, prompts, KV caches), in bytes; past it
    /// a request is refused with RESOURCE_EXHAUSTED. 0: three quarters of
    /// the cgroup's memory limit, or 4 GiB without one.
    pub memory_budget_bytes: usize,
    /// Most open client connections; past it a new one is closed at once
    /// (logged once per 10 s with the count).
    pub max_connections: usize,
    /// Most open connections from one IP address (one client cannot lock
    /// the others out); 0: a quarter of `max_connections`. Behind a proxy
    /// every client shares the proxy's address: raise it there.
    pub max_connections_per_peer: usize,
    /// Connections a loopback peer may open beyond both caps once they
    /// refuse it, so a health check from inside the pod still connects.
    pub reserved_loopback_connections: usize,
    /// A new connection must send the HTTP/2 preface (and finish its TLS
    /// handshake) within this many milliseconds, or it is closed.
    pub handshake_timeout_ms: u64,
    /// A connection with no RPC in flight for this many seconds is closed.
    pub idle_connection_timeout_secs: u64,
    /// HTTP/2 keepalive pings to each connection every this many seconds;
    /// one unanswered for `keepalive_timeout_secs` closes it (dead peers).
    pub keepalive_interval_secs: u64,
    pub keepalive_timeout_secs: u64,
    /// A connection this many seconds old (±10 %, drawn per connection) is
    /// sent an HTTP/2 GOAWAY, so its client opens a new one — after
    /// resolving the name again — for its next call (gRFC A9
    /// MAX_CONNECTION_AGE): how a fleet behind client-side balancing
    /// spreads onto replicas added since. 0: never.
    pub max_connection_age_secs: u64,
    /// How long calls already running on a connection past its age may
    /// go on; then its remaining streams end with UNAVAILABLE
    /// (`SAMPLERD_CONNECTION_AGED`, resumable) and the connection closes
    /// (gRFC A9 MAX_CONNECTION_AGE_GRACE).
    pub max_connection_age_grace_secs: u64,
    /// The raw log-sum-exp (for `logprob`) on a helper core
    /// (`[limits.parallel_logprob]`, see `service/lse_helper.rs`).
    pub parallel_logprob: crate::service::lse_helper::ParallelLogprobConfig,
}

impl LimitsConfig {
    /// The listener's connection limits.
    pub fn connections(&self) -> crate::transport::connections::ConnectionPolicy {
        crate::transport::connections::ConnectionPolicy {
            max_connections: self.max_connections,
            max_connections_per_peer: self.connections_per_peer(),
            reserved_loopback_connections: self.reserved_loopback_connections,
            handshake_timeout: std::time::Duration::from_millis(self.handshake_timeout_ms),
            idle_timeout: std::time::Duration::from_secs(self.idle_connection_timeout_secs),
        }
    }

    /// `max_connections_per_peer`, its 0 resolved: a quarter of
    /// `max_connections` (at least 1), so at least four clients share a
    /// full server and a probe from another address finds room.
    pub fn connections_per_peer(&self) -> usize {
        match self.max_connections_per_peer {
            0 => (self.max_connections / 4).max(1),
            n => n,
        }
    }

    /// The connections' maximum age (`crate::transport::max_age`).
    pub fn connection_age(&self) -> crate::transport::max_age::AgePolicy {
        crate::transport::max_age::AgePolicy {
            max_age: (self.max_connection_age_secs > 0)
                .then(|| std::time::Duration::from_secs(self.max_connection_age_secs)),
            grace: std::time::Duration::from_secs(self.max_connection_age_grace_secs),
        }
    }

    /// The constraint compiler's settings.
    pub fn constraint(&self) -> crate::service::constraint::ConstraintConfig {
        crate::service::constraint::ConstraintConfig {
            max_bytes: self.max_constraint_bytes,
            max_depth: self.max_constraint_depth,
            max_rules: self.max_constraint_rules,
            threads: self.constraint_compile_threads,
            queue: self.constraint_compile_queue,
            max_compile: std::time::Duration::from_millis(self.max_constraint_compile_ms),
            cache_entries: self.constraint_cache_entries,
            cache_bytes: self.constraint_cache_bytes,
        }
    }

    /// The sampling pool's settings.
    pub fn step_pool(&self) -> crate::request::step_pool::StepPoolConfig {
        crate::request::step_pool::StepPoolConfig {
            threads: self.sampling_threads,
            max_step: std::time::Duration::from_millis(self.max_step_ms),
            max_stuck: self.max_stuck_workers,
        }
    }
}

impl Default for LimitsConfig {
    fn default() -> Self {
        LimitsConfig {
            max_message_bytes: 64 * 1024 * 1024,
            max_vocab: 262_144,
            max_concurrent_streams: 1024,
            // the built-in stages look at no more of a window
            max_window_tokens: samplerd_sampling::MAX_PENALTY_WINDOW,
            buffer_pool_size: 32,
            max_n_probs: 1024,
            // An engine's decode batch: 256 sequences per forward pass is
            // the large end of what serving engines schedule on one GPU.
            max_batch_rows: 256,
            // Speculative decoders draft 2-8 tokens (vLLM's and llama.cpp's
            // defaults are 5 and 16); 16 bounds a Verify to 17 rows.
            max_draft_tokens: 16,
            // Self-consistency and best-of-n sample 4-16 completions;
            // each holds a KV cache (~150 MB at SmolLM2's 8k context).
            max_choices: 16,
            max_shared_regions: 64,
            // 64 GiB of address space: 256 rows of 151,936 f32 logits take
            // 155 MB, so room for a few hundred engines' batches.
            max_shared_bytes: 64 << 30,
            http2_stream_window_bytes: 8 * 1024 * 1024,
            http2_connection_window_bytes: 32 * 1024 * 1024,
            max_streams_per_connection: 256,
            max_request_duration_secs: 600,
            max_chain_stages: 64,
            max_constraint_bytes: 1 << 20,
            // docs/RELIABILITY.md, "Constraint compilation", for the figures.
            max_constraint_depth: 512,
            max_constraint_rules: 4096,
            // llama.cpp's chat templates trigger on markers of a few to ~20
            // bytes (`<tool_call>`, "```json", `</think>`).
            max_constraint_triggers: 16,
            max_constraint_trigger_bytes: 128,
            constraint_compile_threads: 1,
            constraint_compile_queue: 8,
            max_constraint_compile_ms: 5_000,
            constraint_cache_entries: 256,
            constraint_cache_bytes: 256 << 20,
            sampling_threads: 0,
            max_step_ms: 2_000,
            max_stuck_workers: 4,
            memory_budget_bytes: 0,
            max_connections: 1024,
            max_connections_per_peer: 0,
            reserved_loopback_connections: 8,
            handshake_timeout_ms: 10_000,
            idle_connection_timeout_secs: 300,
            keepalive_interval_secs: 60,
            keepalive_timeout_secs: 20,
            // Five minutes: after a scale-up, every client has moved its
            // new calls onto the current set of replicas within 5.5 min,
            // at the cost of one reconnect (a TCP and TLS handshake, ~1 ms)
            // per connection per 4.5-5.5 min. Kubernetes sets 60 s.
            max_connection_age_secs: 300,
            // The default `max_request_duration_secs`: no call is ever cut
            // by the age, only new calls move (a lower value bounds how
            // long an old connection lingers, at the price of resuming
            // the streams it cuts).
            max_connection_age_grace_secs: 600,
            parallel_logprob: Default::default(),
        }
    }
}
