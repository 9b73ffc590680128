//! The seam to the model host (`crate::generate::ModelHost`): the
//! `Generate` RPC delegates to a [`Generator`]; with none configured it
//! answers FAILED_PRECONDITION saying how to configure a model.

#![forbid(unsafe_code)]

use samplerd_api::v1::GenerateResponse;
use std::sync::Arc;

use samplerd_model::{ChatMessage, TextCodec};
use samplerd_sampling::{Chain, Vocabulary, step};
use tokio::sync::mpsc;
use tonic::Status;

/// A validated `Generate` request (`service::validate::generate`).
pub struct ValidGenerate {
    /// Completions to generate (`n`, at least 1); choice i samples with
    /// `seed + i`.
    pub choices: u32,
    pub chain: Chain,
    pub seed: u64,
    pub probs: step::ProbsRequest,
    pub prompt: Prompt,
    /// Tokens to generate at most (`max_tokens` or
    /// `generate.default_max_tokens`).
    pub max_tokens: u32,
    /// Non-empty stop strings.
    pub stop: Vec<String>,
    pub ignore_eos: bool,
    /// Each step's raw logits to return with its token, and how.
    pub return_logits: Option<crate::generate::returned_logits::ReturnLogits>,
    /// `penalize_prompt` (default true): the prompt's tail is the
    /// history of the penalties' and DRY's windows.
    pub penalize_prompt: bool,
    /// `min_tokens`: stop strings are not looked for in the first this
    /// many tokens (the chain's `token_controls` stage masks the end
    /// tokens until then).
    pub min_tokens: u32,
    /// `stop_token_ids` (sorted, inside the vocabulary): they end the
    /// generation like the end-of-generation token.
    pub stop_token_ids: Vec<u32>,
    /// `resume.token_ids`: the tokens an interrupted run already sent (at
    /// most `max_tokens`, each inside the vocabulary; what else they must
    /// satisfy is checked as the model host replays them).
    pub resume: Vec<u32>,
    /// `speculation` (None: off).
    pub speculation: Option<Speculation>,
    /// `prompt_logprobs`: top tokens per prompt position, at most
    /// `generate.max_prompt_logprobs` (None: off).
    pub prompt_logprobs: Option<u32>,
}

/// A validated `speculation`: where drafts come from and the most per pass.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Speculation {
    pub source: DraftSource,
    /// 1 to `limits.max_draft_tokens`.
    pub max_draft_tokens: usize,
}

/// `DraftSource` of the protocol, without the unset value.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum DraftSource {
    PromptLookup,
    Model,
}

impl ValidGenerate {
    /// What ends this generation at a sampled token (for the decode loop,
    /// cheap to clone into each step).
    pub fn end_rule(&self) -> EndRule {
        EndRule {
            ignore_eos: self.ignore_eos,
            stop_token_ids: self.stop_token_ids.as_slice().into(),
        }
    }
}

/// Which sampled tokens end a generation without being sent.
#[derive(Clone, Debug)]
pub struct EndRule {
    ignore_eos: bool,
    stop_token_ids: Arc<[u32]>,
}

impl EndRule {
    /// Whether `token` ends the generation: the model's end of generation
    /// (`is_eog`) unless `ignore_eos`, or one of `stop_token_ids` — those
    /// even with `ignore_eos`, as vLLM's `check_stop`
    /// (vllm/v1/core/sched/utils.py) has it.
    pub fn ends(&self, token: u32, is_eog: impl Fn(u32) -> bool) -> bool {
        (!self.ignore_eos && is_eog(token)) || self.stop_token_ids.binary_search(&token).is_ok()
    }
}

/// A Generate prompt: plain text, or chat messages for the model's
/// template (roles checked).
#[derive(Clone, Debug)]
pub enum Prompt {
    Text(String),
    Chat(Vec<ChatMessage>),
}

impl Prompt {
    /// Its text in bytes: the prompt, or the messages' roles and contents
    /// together (what `generate.max_prompt_bytes` bounds).
    pub fn bytes(&self) -> usize {
        match self {
            Prompt::Text(t) => t.len(),
            Prompt::Chat(m) => m.iter().map(|m| m.role.len() + m.content.len()).sum(),
        }
    }
}

/// One Generate request as the model host gets it: validated
/// ([`ValidGenerate`]: prompt, budgets, chain, seed), and where its
/// sampling steps (and prompt tokenization) run.
pub struct GenerateJob {
    pub request: ValidGenerate,
    /// The request's id (logs, and the crash report while its steps run).
    pub request_id: u64,
    pub steps: crate::request::step_pool::StepPool,
    /// Where its decode loop leases its logits buffer.
    pub buffers: std::sync::Arc<crate::request::buffer_pool::BufferPool>,
    /// What the generation charges its prompt and KV cache to.
    pub memory: std::sync::Arc<crate::request::memory::MemoryBudget>,
}

/// Events of one Generate stream (`Token`s, then one `Finished`); a send
/// error means the client went away: stop generating.
pub type GenerateSink = mpsc::Sender<Result<GenerateResponse, Status>>;

/// A loaded model that can generate text. Implemented by the model host.
pub trait Generator: Send + Sync + 'static {
    /// True once the model is loaded and can serve (health turns SERVING).
    fn ready(&self) -> bool;

    /// Runs one generation to completion on the calling (blocking) thread,
    /// sending events to `sink` with `blocking_send`.
    fn generate(&self, job: GenerateJob, sink: GenerateSink);

    /// The model's vocabulary for the stages of a request's chain (those
    /// flagged `SD_STAGE_NEEDS_VOCAB` refuse to build without one).
    fn vocabulary(&self) -> Option<Arc<Vocabulary>> {
        None
    }

    /// The model's tokenizer, for Tokenize and Detokenize.
    fn tokenizer(&self) -> Option<Arc<dyn TextCodec>> {
        None
    }

    /// What GetServerInfo says about the model.
    fn describe(&self) -> Option<ModelSummary> {
        None
    }
}

/// The loaded model as GetServerInfo describes it.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct ModelSummary {
    /// The file name of `model.path` (not the directory: that is the
    /// operator's business).
    pub file_name: String,
    /// `general.architecture`.
    pub architecture: String,
    /// Weight matrices per storage format (`"q4_1"` → 90).
    pub weight_types: std::collections::BTreeMap<String, u32>,
    pub n_vocab: usize,
    /// Context size of each sequence (`generate.n_ctx`, clamped).
    pub n_ctx: usize,
    /// The numerics mode the forward pass follows (`model.numerics`).
    pub numerics: String,
    /// Where the forward pass runs ("cpu-avx2", "cuda: …").
    pub device: String,
}

/// The FAILED_PRECONDITION message of Generate without a model.
pub const NO_MODEL_MESSAGE: &str = "no model is configured: start the server with `samplerd serve --model PATH` \
     or set `model.path` in samplerd.toml (env SAMPLERD_MODEL__PATH)";

/// Resolves `model.device` before the model loads and logs the choice:
/// `cuda` without a usable GPU (or in a build without the `cuda` feature)
/// is a start-up error naming the reason; `auto` falls back to the CPU.
pub fn resolve_device(
    request: samplerd_model::DeviceRequest,
) -> Result<samplerd_model::Placement, samplerd_model::cuda::DeviceError> {
    let resolved = samplerd_model::cuda::resolve(request)?;
    tracing::info!(
        device = %resolved.placement,
        reason = %resolved.reason,
        "model device chosen"
    );
    Ok(resolved.placement)
}
