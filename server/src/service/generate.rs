//! `Generate`: delegates to the model host's [`Generator`](crate::model::Generator);
//! without one, FAILED_PRECONDITION saying how to configure a model.

use std::sync::Arc;

use samplerd_api::v1;
use tokio::sync::mpsc;
use tokio_stream::wrappers::ReceiverStream;
use tonic::Status;

use super::{AppState, BoxStream};
use crate::model::{NO_MODEL_MESSAGE, ResolvedSampling};

/// Events buffered ahead of a slow reader.
const EVENT_BUFFER: usize = 16;

/// The `Generate` RPC.
pub fn handle(
    state: Arc<AppState>,
    req: v1::GenerateRequest,
) -> Result<BoxStream<v1::GenerateResponse>, Status> {
    let Some(generator) = state.generator.clone() else {
        return Err(Status::failed_precondition(NO_MODEL_MESSAGE));
    };
    if !generator.ready() {
        return Err(Status::unavailable("the model is still loading"));
    }
    let (chain, seed) = state.defaults.resolve_with_vocab(
        &state.registry,
        req.params.as_ref(),
        generator.vocabulary(),
    )?;
    let permit = state.stream_permit()?;
    let span = tracing::info_span!("generate", request_id = state.request_id(), chain = %chain.describe(), seed);
    let (tx, rx) = mpsc::channel(EVENT_BUFFER);
    tokio::task::spawn_blocking(move || {
        let _permit = permit;
        span.in_scope(|| generator.generate(req, ResolvedSampling { chain, seed }, tx));
    });
    Ok(Box::pin(ReceiverStream::new(rx)))
}
