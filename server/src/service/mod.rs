//! The `samplerd.v1.Sampler` service: the dispatch of each RPC to its
//! module (`sample`, `stream`, `batch`, `batch_stream`, `generate`,
//! `stages`), over the shared state ([`state`]), the configured defaults
//! ([`defaults`]) and limits ([`limits`]). Every sampling step, and
//! every other call into plugin code (chain builds included), runs through
//! [`crate::request::step_pool`] under its watchdog, on the sampling pool's
//! threads — never on a runtime worker: whatever a stage does, health checks,
//! /metrics and the other RPCs keep answering.

pub mod batch;
pub mod batch_stream;
pub mod constraint;
pub mod defaults;
pub mod generate;
pub mod limits;
pub mod lse_helper;
pub mod prepare;
pub mod sample;
pub mod stages;
pub mod state;
pub mod stream;
pub mod validate;

use std::sync::Arc;

use samplerd_api::v1;
use samplerd_api::v1::sampler_server::Sampler;
use tonic::{Request, Response, Status, Streaming};

use crate::service::state::{AppState, BoxStream};

/// The tonic service.
#[derive(Clone)]
pub struct SamplerService {
    pub state: Arc<AppState>,
}

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
