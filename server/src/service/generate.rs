//! `Generate`: delegates to the model host's [`Generator`](crate::generate::generator::Generator);
//! without one, FAILED_PRECONDITION saying how to configure a model. The
//! response headers carry the seed ([`SEED_HEADER`]).

#![forbid(unsafe_code)]

use std::sync::Arc;

use samplerd_api::v1;
use tokio::sync::mpsc;
use tokio_stream::wrappers::ReceiverStream;
use tonic::metadata::MetadataValue;
use tonic::{Response, Status};

use super::state::{AppState, BoxStream};
use super::validate;
use crate::generate::generator::{GenerateJob, NO_MODEL_MESSAGE};
use crate::status::{Reason, status};

/// Events buffered ahead of a slow reader.
const EVENT_BUFFER: usize = 16;

/// The response header that carries the seed the generation uses (the
/// request's, or the server's default or random one): what a client needs
/// to resume the generation should its stream be cut before `Finished`.
pub const SEED_HEADER: &str = "samplerd-seed";

/// The `Generate` RPC: the constraint (if any) is compiled on the compile
/// pool (`service/constraint`), the chain is built on a sampling thread
/// (it calls into plugins), then the model host runs the generation on a blocking
/// thread, its sampling steps again on the sampling pool.
pub async fn handle(
    state: Arc<AppState>,
    req: v1::GenerateRequest,
) -> Result<Response<BoxStream<v1::GenerateResponse>>, Status> {
    let Some(generator) = state.generator.clone() else {
        return Err(status(Reason::NoModel, NO_MODEL_MESSAGE));
    };
    if !generator.ready() {
        return Err(status(Reason::ModelLoading, "the model is still loading"));
    }
    let vocab = generator.vocabulary();
    let tokenizer = generator.tokenizer();
    let checker = Arc::clone(&state);
    let request_id = state.request_id();
    // The constraint compiles off the sampling threads; held (with its
    // memory charge) until the generation ends.
    let prepared = Arc::new(
        state
            .prepare_constraints(req.params.as_ref(), vocab.as_ref(), request_id)
            .await?,
    );
    let held = Arc::clone(&prepared);
    let valid = state
        .steps
        .run(move || {
            // For the crash report, should a plugin kill the process.
            let _serving = samplerd_sampling::activity::serving(request_id);
            validate::generate(&checker, &req, vocab, tokenizer, held.prebuilt())
        })
        .await??;
    let permit = state.stream_permit()?;
    let seed = valid.seed;
    let span = tracing::info_span!(
        "generate",
        seq = request_id,
        chain = %super::state::chain_for_log(&valid.chain),
        seed = valid.seed
    );
    let (tx, rx) = mpsc::channel(EVENT_BUFFER);
    let job = GenerateJob {
        request: valid,
        request_id,
        steps: state.steps.clone(),
        buffers: Arc::clone(&state.pool),
        memory: Arc::clone(&state.memory),
    };
    tokio::task::spawn_blocking(move || {
        let _permit = permit;
        let _prepared = prepared;
        span.in_scope(|| generator.generate(job, tx));
    });
    let stream: BoxStream<v1::GenerateResponse> = Box::pin(ReceiverStream::new(rx));
    let mut response = Response::new(stream);
    response
        .metadata_mut()
        .insert(SEED_HEADER, MetadataValue::from(seed));
    Ok(response)
}
