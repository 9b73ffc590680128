//! The `samplerd.v1.Sampler` service: the dispatch of each RPC to its
//! module (`sample`, `stream`, `batch`, `batch_stream`, `generate`,
//! `stages`, `text` for Tokenize and Detokenize, `info`), over the shared state ([`state`]), the configured defaults
//! ([`defaults`]) and limits ([`limits`]), and the shared-memory regions
//! rows may name ([`shared_memory`]). Every sampling step, and
//! every other call into plugin code (chain builds included), runs through
//! [`crate::request::step_pool`] under its watchdog, on the sampling pool's
//! threads — never on a runtime worker: whatever a stage does, health checks,
//! /metrics and the other RPCs keep answering.

pub mod batch;
pub mod batch_stream;
pub mod constraint;
pub mod defaults;
pub mod generate;
pub mod info;
pub mod limits;
pub mod lse_helper;
pub mod prepare;
pub mod sample;
pub mod shared_memory;
pub mod stages;
pub mod state;
pub mod stream;
pub mod text;
pub mod validate;

use std::sync::Arc;

use samplerd_api::v1;
use samplerd_api::v1::sampler_server::Sampler;
use tonic::{Request, Response, Status, Streaming};

use crate::service::state::{AppState, BoxStream};
use crate::transport::connections::ConnInfo;
use crate::transport::identity::Caller;

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
        let caller = Caller::of(request.extensions());
        let message = match request
            .extensions_mut()
            .remove::<crate::transport::one_frame::Predecoded>()
        {
            Some(crate::transport::one_frame::Predecoded(message)) => message,
            None => request.into_inner(),
        };
        sample::handle(self.state.clone(), message, caller)
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
        let caller = Caller::of(request.extensions());
        stream::handle(self.state.clone(), request.into_inner(), predecoded, caller)
            .map(Response::new)
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
        let caller = Caller::of(request.extensions());
        batch::handle(self.state.clone(), request.into_inner(), caller)
            .await
            .map(Response::new)
    }

    type SampleBatchStreamStream = BoxStream<v1::SampleBatchResponse>;

    async fn sample_batch_stream(
        &self,
        request: Request<Streaming<v1::SampleBatchStreamRequest>>,
    ) -> Result<Response<Self::SampleBatchStreamStream>, Status> {
        let caller = Caller::of(request.extensions());
        batch_stream::handle(self.state.clone(), request.into_inner(), caller).map(Response::new)
    }

    async fn register_shared_memory(
        &self,
        request: Request<v1::RegisterSharedMemoryRequest>,
    ) -> Result<Response<v1::RegisterSharedMemoryResponse>, Status> {
        let ext = request.extensions();
        let caller = Caller::of(ext);
        let peer_uid = Caller::peer_uid(ext);
        let conn = ConnInfo::of(ext).cloned();
        let req = request.into_inner();
        let state = self.state.clone();
        // Opening and mapping a file: off the runtime's workers.
        tokio::task::spawn_blocking(move || {
            state.shared.register(&req, caller, peer_uid, conn.as_ref())
        })
        .await
        .map_err(|e| Status::internal(e.to_string()))??;
        Ok(Response::new(v1::RegisterSharedMemoryResponse {}))
    }

    async fn unregister_shared_memory(
        &self,
        request: Request<v1::UnregisterSharedMemoryRequest>,
    ) -> Result<Response<v1::UnregisterSharedMemoryResponse>, Status> {
        let caller = Caller::of(request.extensions());
        self.state
            .shared
            .unregister(&request.get_ref().name, &caller)?;
        Ok(Response::new(v1::UnregisterSharedMemoryResponse {}))
    }

    async fn tokenize(
        &self,
        request: Request<v1::TokenizeRequest>,
    ) -> Result<Response<v1::TokenizeResponse>, Status> {
        text::tokenize(self.state.clone(), request.into_inner())
            .await
            .map(Response::new)
    }

    async fn detokenize(
        &self,
        request: Request<v1::DetokenizeRequest>,
    ) -> Result<Response<v1::DetokenizeResponse>, Status> {
        text::detokenize(&self.state, request.get_ref()).map(Response::new)
    }

    async fn get_server_info(
        &self,
        _request: Request<v1::GetServerInfoRequest>,
    ) -> Result<Response<v1::GetServerInfoResponse>, Status> {
        Ok(Response::new(info::get(&self.state)))
    }

    async fn list_stages(
        &self,
        _request: Request<v1::ListStagesRequest>,
    ) -> Result<Response<v1::ListStagesResponse>, Status> {
        Ok(Response::new(stages::list(&self.state)))
    }
}
