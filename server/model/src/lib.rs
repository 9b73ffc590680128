//! samplerd's model host: loads a GGUF model, tokenizes its prompts and runs its forward pass.
//!
//! It loads a GGUF model (`gguf`; llama — also Mistral's GGUFs —, qwen2 or
//! qwen3 architecture; Q4_1, Q5_0, Q5_1, Q8_0, Q4_K, Q5_K, Q6_K, F16 and
//! BF16 weights kept in their block formats, `quant`, Q4_0 as the equal
//! Q8_0 blocks, anything else requantised to Q8_0), builds its tokenizer
//! and chat template from the file's metadata (`text`), and runs the
//! forward pass through a [`Backend`]: the CPU backend (`cpu`: quantised
//! weight kernels on a persistent thread pool, `pool`, an f16 KV cache per
//! [`Session`], llama.cpp's rounding reproduced by `ggml`) or, with the
//! `cuda` cargo feature, the CUDA backend (`cuda`), which gives the same
//! bits. [`cuda::resolve`] picks the device and [`Model::load_on`] loads
//! for it ([`Model::load`]: CPU). [`Model::decode_batch`] runs one decode
//! step for several sessions, reading each weight once, and
//! [`Model::decode_rows`] the verify pass of speculative decoding (a token
//! and its drafts as consecutive decode steps in one pass, every row the
//! bits of its own decode step; [`Session::truncate`] drops the rejected
//! ones); [`Utf8Streamer`]
//! turns token bytes into whole characters.
//!
//! ```no_run
//! use samplerd_model::{ChatMessage, Model, ModelOptions};
//! let model = Model::load("models/SmolLM2-135M-Instruct.Q4_1.gguf".as_ref(), &ModelOptions::default())?;
//! let prompt = model.render_chat(&[ChatMessage::new("user", "Hi!")])?;
//! let tokens = model.tokenizer().encode(&prompt, true, true)?;
//! let mut session = model.new_session()?;
//! let logits = session.prefill(&tokens)?;
//! # Ok::<(), samplerd_model::ModelError>(())
//! ```

pub mod backend;
pub mod cpu;
pub mod cuda;
pub mod error;
pub mod ggml;
pub mod gguf;
pub mod pool;
pub mod prefix;
pub mod quant;
#[cfg(test)]
mod test_rng;
pub mod text;

pub use backend::{
    Backend, DeviceOp, DevicePrefix, PrefixOutput, PrefixStage, RowOutcome, SequenceState, Survivor,
};
pub use cuda::{DeviceRequest, Placement};
pub use error::ModelError;
pub use ggml::Numerics;
pub use gguf::{Arch, Config};
pub use prefix::{CachedTokens, StepOrder};
pub use text::{ChatMessage, ChatTemplate};
pub use text::{
    FileTokenizer, TextCodec, TokenInfo, Tokenizer, Utf8Streamer, attr, read_tokenizer,
    read_vocabulary,
};

use std::path::{Path, PathBuf};
use std::sync::Arc;

/// Load-time options.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ModelOptions {
    /// Threads for the forward pass (0: all available CPUs).
    pub n_threads: usize,
    /// Context (KV-cache) size of each session; 0: the model's training
    /// context. Clamped to the training context.
    pub n_ctx: usize,
    /// Whose arithmetic order the forward pass follows (`model.numerics`).
    pub numerics: ggml::Numerics,
}

impl Default for ModelOptions {
    fn default() -> Self {
        ModelOptions {
            n_threads: 0,
            n_ctx: 4096,
            numerics: ggml::Numerics::default(),
        }
    }
}

/// A loaded model: shared weights (inside the backend), config, tokenizer
/// and chat template. Cheap to share (`Arc<Model>`); sessions are per sequence.
#[derive(Debug)]
pub struct Model {
    path: PathBuf,
    config: Config,
    tokenizer: Tokenizer,
    template: ChatTemplate,
    backend: Arc<dyn Backend>,
    n_ctx: usize,
    weight_bytes: usize,
    weight_formats: std::collections::BTreeMap<&'static str, usize>,
    numerics: ggml::Numerics,
}

impl Model {
    /// Loads `path` for the CPU backend; errors name the file and the problem.
    pub fn load(path: &Path, opts: &ModelOptions) -> Result<Arc<Model>, ModelError> {
        Self::load_on(path, opts, &Placement::Cpu)
    }

    /// Loads `path` for the backend of `placement` (see [`cuda::resolve`]).
    pub fn load_on(
        path: &Path,
        opts: &ModelOptions,
        placement: &Placement,
    ) -> Result<Arc<Model>, ModelError> {
        let mut g = gguf::GgufFile::open(path)?;
        let config = g.config()?;
        // A model the CUDA kernels cannot run yet fails before its weights
        // are read (the backend would refuse it after loading them).
        if matches!(placement, Placement::Cuda { .. })
            && cuda::built_with_cuda()
            && let Some(why) = cuda::unsupported(&config)
        {
            return Err(ModelError::Backend(why));
        }
        let tokenizer = Tokenizer::from_gguf(&g)?;
        if tokenizer.n_vocab() != config.n_vocab {
            return Err(ModelError::Metadata {
                path: path.to_path_buf(),
                key: "tokenizer.ggml.tokens".into(),
                problem: format!(
                    "{} tokens but token_embd.weight has {} rows",
                    tokenizer.n_vocab(),
                    config.n_vocab
                ),
            });
        }
        let text = |id: Option<u32>| {
            id.and_then(|i| tokenizer.token_text(i))
                .unwrap_or("")
                .to_string()
        };
        let template = ChatTemplate::new(
            g.get_str("tokenizer.chat_template")?,
            &text(tokenizer.bos()),
            &text(tokenizer.eos()),
        )?;
        let weights = Arc::new(gguf::Weights::load(&mut g, &config)?);
        let (weight_bytes, weight_formats) = (weights.nbytes(), weights.formats());
        let n_ctx = if opts.n_ctx == 0 {
            config.n_ctx_train
        } else {
            opts.n_ctx.min(config.n_ctx_train)
        };
        let backend = new_backend(
            placement,
            &config,
            weights,
            opts.n_threads,
            opts.numerics.flavor(),
        )?;
        Ok(Arc::new(Model {
            path: path.to_path_buf(),
            config,
            tokenizer,
            template,
            backend,
            n_ctx,
            weight_bytes,
            weight_formats,
            numerics: opts.numerics,
        }))
    }

    /// Whose arithmetic order the forward pass follows (`model.numerics`).
    pub fn numerics(&self) -> ggml::Numerics {
        self.numerics
    }

    /// Bytes the weight matrices take in the CPU loader's formats.
    pub fn weight_bytes(&self) -> usize {
        self.weight_bytes
    }

    /// How many weight matrices are held in each format (`"q4_K"`, …).
    pub fn weight_formats(&self) -> &std::collections::BTreeMap<&'static str, usize> {
        &self.weight_formats
    }

    pub fn path(&self) -> &Path {
        &self.path
    }
    pub fn config(&self) -> &Config {
        &self.config
    }
    pub fn tokenizer(&self) -> &Tokenizer {
        &self.tokenizer
    }
    pub fn chat_template(&self) -> &ChatTemplate {
        &self.template
    }
    /// Renders the chat template with `add_generation_prompt = true`.
    pub fn render_chat(&self, messages: &[ChatMessage]) -> Result<String, ModelError> {
        self.template.render(messages)
    }
    /// The tokens of a chat prompt (see [`text::chat_tokens`]): message content
    /// is plain text unless `parse_special_in_content`.
    pub fn chat_tokens(
        &self,
        messages: &[ChatMessage],
        parse_special_in_content: bool,
    ) -> Result<Vec<u32>, ModelError> {
        text::chat_tokens(
            &self.template,
            &self.tokenizer,
            messages,
            parse_special_in_content,
        )
    }
    pub fn n_vocab(&self) -> usize {
        self.config.n_vocab
    }
    /// Context size of each session.
    pub fn n_ctx(&self) -> usize {
        self.n_ctx
    }
    /// The backend's name ("cpu-avx2", "cpu-scalar").
    pub fn backend_name(&self) -> String {
        self.backend.name()
    }
    /// Whether the backend runs a device sampling prefix where the logits
    /// are ([`Session::prefix_next_step`]; the CUDA backend), so a decode
    /// step can copy back only the survivors.
    pub fn runs_device_prefix(&self) -> bool {
        self.backend.runs_device_prefix()
    }
    /// Per token id its bytes and attribute flags (for sampler plugins).
    pub fn vocabulary(&self) -> &[TokenInfo] {
        self.tokenizer.vocabulary()
    }
    /// A new sequence with an `n_ctx`-token KV cache (allocated now, once;
    /// an error when the backend cannot allocate it).
    pub fn new_session(&self) -> Result<Session, ModelError> {
        self.new_session_with_capacity(self.n_ctx)
    }
    /// One decode step for several sessions at once: `tokens[i]` runs on
    /// `sessions[i]`, whose [`Session::logits`] then hold the result — the
    /// same bits as `sessions[i].decode(tokens[i])`, but the weights are read
    /// once for the whole batch.
    pub fn decode_batch(
        &self,
        sessions: &mut [&mut Session],
        tokens: &[u32],
    ) -> Result<(), ModelError> {
        // Sessions that asked for a device sampling prefix (one-shot).
        let prefixes: Vec<Option<Box<DevicePrefix>>> =
            sessions.iter_mut().map(|s| s.prefix.take()).collect();
        let mut states: Vec<&mut dyn SequenceState> = Vec::with_capacity(sessions.len());
        let mut logits: Vec<&mut [f32]> = Vec::with_capacity(sessions.len());
        let mut outs: Vec<&mut PrefixOutput> = Vec::with_capacity(sessions.len());
        for s in sessions.iter_mut() {
            let Session {
                state,
                logits: l,
                prefixed,
                ..
            } = &mut **s;
            l.resize(self.config.n_vocab, 0.0);
            prefixed.outcome = RowOutcome::Dense;
            states.push(state.as_mut());
            logits.push(l.as_mut_slice());
            outs.push(&mut **prefixed);
        }
        let ran = if prefixes.iter().all(Option::is_none) {
            self.backend.forward_batch(&mut states, tokens, &mut logits)
        } else {
            let ops: Vec<Option<Vec<DeviceOp<'_>>>> = prefixes
                .iter()
                .map(|p| p.as_ref().map(|p| p.ops()))
                .collect();
            let mut rows: Vec<backend::PrefixRow<'_>> = ops
                .iter()
                .zip(outs)
                .map(|(o, out)| backend::PrefixRow {
                    prefix: o.as_deref(),
                    out,
                })
                .collect();
            self.backend
                .forward_batch_prefixed(&mut states, tokens, &mut logits, &mut rows)
        };
        drop(states);
        for (s, t) in sessions.iter_mut().zip(tokens) {
            match &ran {
                Ok(()) => s.cached.ran(std::slice::from_ref(t)),
                Err(_) => s.forget_unbooked(),
            }
        }
        ran
    }
    /// The verify pass of speculative decoding for several sessions at
    /// once: `tokens[i]` run on `sessions[i]` as consecutive decode steps,
    /// and [`Session::logits_rows`] then hold every token's logits — row
    /// `j` the same bits as the `j`-th of `tokens[i].len()` calls of
    /// [`Session::decode`] (so are the cache's positions: rejected drafts
    /// are dropped with [`Session::truncate`]). The weights are read once
    /// for every row of every session.
    pub fn decode_rows(
        &self,
        sessions: &mut [&mut Session],
        tokens: &[&[u32]],
    ) -> Result<(), ModelError> {
        backend::check_batch_shape(sessions.len(), tokens.len(), tokens.len())?;
        let mut states: Vec<&mut dyn SequenceState> = Vec::with_capacity(sessions.len());
        let mut logits: Vec<&mut [f32]> = Vec::with_capacity(sessions.len());
        for (s, t) in sessions.iter_mut().zip(tokens) {
            let Session {
                state, logits: l, ..
            } = &mut **s;
            l.resize(t.len().max(1) * self.config.n_vocab, 0.0);
            states.push(state.as_mut());
            logits.push(l.as_mut_slice());
        }
        let ran = self.backend.forward_rows(&mut states, tokens, &mut logits);
        drop(states);
        for s in sessions.iter_mut() {
            s.prefix = None;
            s.prefixed.outcome = RowOutcome::Dense;
        }
        for (s, t) in sessions.iter_mut().zip(tokens) {
            match &ran {
                // Booked as the decode steps they equal.
                Ok(()) => t.iter().for_each(|t| s.cached.ran(std::slice::from_ref(t))),
                Err(_) => {
                    s.logits.resize(self.config.n_vocab, 0.0);
                    s.forget_unbooked();
                }
            }
        }
        ran
    }
    /// A new sequence with a `capacity`-token KV cache.
    pub fn new_session_with_capacity(&self, capacity: usize) -> Result<Session, ModelError> {
        Ok(Session {
            backend: Arc::clone(&self.backend),
            state: self.backend.new_state(capacity.max(1))?,
            logits: vec![0.0; self.config.n_vocab],
            n_vocab: self.config.n_vocab,
            cached: Box::default(),
            prefix: None,
            prefixed: Box::default(),
        })
    }
}

/// The backend for `placement` over freshly loaded `weights` (the CUDA
/// backend uploads them and lets the host copy go).
fn new_backend(
    placement: &Placement,
    config: &Config,
    weights: Arc<gguf::Weights>,
    n_threads: usize,
    flavor: ggml::Flavor,
) -> Result<Arc<dyn Backend>, ModelError> {
    match placement {
        Placement::Cpu => Ok(Arc::new(cpu::CpuBackend::new(
            config.clone(),
            weights,
            n_threads,
            flavor,
        ))),
        #[cfg(feature = "cuda")]
        Placement::Cuda { ordinal, .. } => Ok(Arc::new(cuda::CudaBackend::new(
            config.clone(),
            &weights,
            cuda::CudaOptions {
                ordinal: *ordinal,
                flavor,
                ..Default::default()
            },
        )?)),
        #[cfg(not(feature = "cuda"))]
        Placement::Cuda { .. } => Err(ModelError::Backend(cuda::DeviceError::NotBuilt.to_string())),
    }
}

/// The model's tokenizer, through the model that owns it (so an
/// `Arc<Model>` serves as a shared [`TextCodec`]).
impl TextCodec for Model {
    fn encode(
        &self,
        text: &str,
        add_special: bool,
        parse_special: bool,
    ) -> Result<Vec<u32>, ModelError> {
        self.tokenizer.encode(text, add_special, parse_special)
    }

    fn vocabulary(&self) -> &[TokenInfo] {
        self.tokenizer.vocabulary()
    }
}

/// One sequence: its KV cache, the tokens in it and the last logits.
pub struct Session {
    backend: Arc<dyn Backend>,
    state: Box<dyn SequenceState>,
    /// The last pass's logits: one row, or one per token of a
    /// [`Model::decode_rows`] pass.
    logits: Vec<f32>,
    n_vocab: usize,
    /// Boxed: a session moves between threads by value every step.
    cached: Box<CachedTokens>,
    /// The device sampling prefix the next [`Model::decode_batch`] step
    /// runs (taken by that step). Boxed, as below.
    prefix: Option<Box<DevicePrefix>>,
    /// What the last pass gave when it ran a prefix
    /// ([`RowOutcome::Dense`] otherwise).
    prefixed: Box<PrefixOutput>,
}

impl std::fmt::Debug for Session {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Session")
            .field("position", &self.position())
            .field("capacity", &self.capacity())
            .finish()
    }
}

impl Session {
    /// Runs `tokens` (one or many) and returns the last position's logits.
    pub fn prefill(&mut self, tokens: &[u32]) -> Result<&[f32], ModelError> {
        self.logits.resize(self.n_vocab, 0.0);
        self.prefix = None;
        self.prefixed.outcome = RowOutcome::Dense;
        let ran = self
            .backend
            .forward(self.state.as_mut(), tokens, &mut self.logits);
        self.record(ran, tokens)?;
        Ok(&self.logits)
    }
    /// Books a forward step's tokens, or, when it failed, keeps only the
    /// positions both the cache and the books know (a backend refuses a
    /// step before running it, but what a failed step left is not trusted).
    fn record(&mut self, ran: Result<(), ModelError>, tokens: &[u32]) -> Result<(), ModelError> {
        match ran {
            Ok(()) => {
                self.cached.ran(tokens);
                Ok(())
            }
            Err(e) => {
                self.forget_unbooked();
                Err(e)
            }
        }
    }
    fn forget_unbooked(&mut self) {
        self.truncate(self.state.position().min(self.cached.tokens().len()));
    }
    /// A second session at this one's position, with a copy of its cache,
    /// books and last logits: one of several continuations of one prefill,
    /// bit for bit what prefilling the same tokens again would give.
    /// `Ok(None)` where the backend cannot copy a cache.
    pub fn fork(&mut self) -> Result<Option<Session>, ModelError> {
        let Some(state) = self.backend.fork_state(self.state.as_mut()) else {
            return Ok(None);
        };
        Ok(Some(Session {
            backend: Arc::clone(&self.backend),
            state: state?,
            logits: self.logits.clone(),
            n_vocab: self.n_vocab,
            cached: self.cached.clone(),
            prefix: None,
            prefixed: self.prefixed.clone(),
        }))
    }
    /// Runs one token and returns its logits.
    pub fn decode(&mut self, token: u32) -> Result<&[f32], ModelError> {
        self.prefill(std::slice::from_ref(&token))
    }
    /// Asks the next [`Model::decode_batch`] step to run `prefix` over
    /// this session's logits where the backend can (the CUDA backend: on
    /// the device, copying back only the survivors); see
    /// [`Session::prefixed`] for what came back.
    pub fn prefix_next_step(&mut self, prefix: DevicePrefix) {
        self.prefix = Some(Box::new(prefix));
    }
    /// What the last pass's device sampling prefix gave:
    /// [`RowOutcome::Survivors`] (then [`Session::logits`] is stale: only
    /// the survivors came back), [`RowOutcome::Fallback`] (the dense
    /// logits came back instead), or [`RowOutcome::Dense`] (no prefix ran).
    pub fn prefixed(&self) -> &PrefixOutput {
        &self.prefixed
    }
    /// The last logits computed (zeros before the first call): after a
    /// [`Model::decode_rows`] pass, its last row.
    pub fn logits(&self) -> &[f32] {
        &self.logits[self.logits.len() - self.n_vocab..]
    }
    /// The last pass's logits row by row: one row after a prefill or a
    /// decode step, one per token after a [`Model::decode_rows`] pass.
    pub fn logits_rows(&self) -> std::slice::ChunksExact<'_, f32> {
        self.logits.chunks_exact(self.n_vocab)
    }
    /// Tokens in the cache.
    pub fn position(&self) -> usize {
        self.state.position()
    }
    /// Most tokens this session can hold.
    pub fn capacity(&self) -> usize {
        self.state.capacity()
    }
    /// Drops cached positions at or after `position`.
    pub fn truncate(&mut self, position: usize) {
        self.state.truncate(position);
        self.cached.truncate(position);
    }
    /// Frees the scratch the steps so far sized (the cache stays): for a
    /// session kept idle for reuse.
    pub fn release_scratch(&mut self) {
        self.state.release_scratch();
    }
    /// The tokens in the cache, in order.
    pub fn cached_tokens(&self) -> &[u32] {
        self.cached.tokens()
    }
    /// How many leading tokens of `prompt` this session's cache can stand
    /// for, bit for bit as a fresh prefill of `prompt` ([`CachedTokens::reusable`]).
    pub fn reusable_prefix(&self, prompt: &[u32]) -> usize {
        self.cached.reusable(prompt)
    }
    /// Keeps the reusable prefix of `prompt` (and forgets the rest of the
    /// cache), so `prefill(&prompt[n..])` with the returned `n` gives the
    /// logits a fresh session's `prefill(prompt)` gives.
    pub fn reuse_prefix(&mut self, prompt: &[u32]) -> usize {
        let n = self.reusable_prefix(prompt);
        self.truncate(n);
        n
    }
    /// How many leading positions of `prompt` then `decoded` this
    /// session's cache can stand for, bit for bit as a fresh session that
    /// prefills `prompt` and then decodes `decoded` one token at a time
    /// ([`CachedTokens::reusable_replay`]).
    pub fn reusable_replay(&self, prompt: &[u32], decoded: &[u32]) -> usize {
        self.cached.reusable_replay(prompt, decoded)
    }
    /// Keeps that many positions (and forgets the rest of the cache).
    pub fn reuse_replay(&mut self, prompt: &[u32], decoded: &[u32]) -> usize {
        let n = self.reusable_replay(prompt, decoded);
        self.truncate(n);
        n
    }
}
