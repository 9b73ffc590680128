//! The seam to the model host (`crate::generate::ModelHost`): the
//! `Generate` RPC delegates to a [`Generator`]; with none configured it
//! answers FAILED_PRECONDITION saying how to configure a model.

#![forbid(unsafe_code)]

use samplerd_api::v1::GenerateResponse;
use std::sync::Arc;

use samplerd_sampling::Vocabulary;
use tokio::sync::mpsc;
use tonic::Status;

use crate::service::validate::ValidGenerate;

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
