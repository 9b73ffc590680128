//! Fuzzes request decoding and validation: arbitrary bytes decoded with
//! prost as a `SampleRequest`, a `GenerateRequest` or a `SampleBatchRequest`
//! (the first byte picks which), then the server's own path —
//! `service::sample::sample_blocking` (limits, logits encodings, parameters
//! → chain, the chain itself), `service::batch::sample_batch_blocking` (the
//! batch limits, f32/f16/bf16 rows, each row's own or the shared
//! parameters) and, for Generate, `service::validate::generate` (limits, prompt or chat messages,
//! parameters → chain) plus `ModelHost::prompt_tokens` (template, tokenizer,
//! token budget) when `SAMPLERD_MODEL` names a model.
//!
//! Oracle: undecodable bytes are a decode error; a decoded request is either
//! served or refused with INVALID_ARGUMENT / RESOURCE_EXHAUSTED naming a
//! field; never a panic, never INTERNAL (the core stages never fail on a
//! request the server accepted).

#![no_main]

use std::sync::{Arc, OnceLock};

use libfuzzer_sys::fuzz_target;
use prost::Message;
use samplerd::generate::{GenerateConfig, ModelHost};
use samplerd::request::errors::RequestError;
use samplerd_api::v1;
use tonic::Code;

fn model_host() -> Option<&'static Arc<ModelHost>> {
    static HOST: OnceLock<Option<Arc<ModelHost>>> = OnceLock::new();
    HOST.get_or_init(|| {
        let path = std::env::var_os("SAMPLERD_MODEL")?;
        let cfg = GenerateConfig {
            n_threads: 1,
            n_ctx: 512,
            ..Default::default()
        };
        Some(Arc::new(
            ModelHost::load(path.as_ref(), cfg).expect("SAMPLERD_MODEL loads"),
        ))
    })
    .as_ref()
}

fn check_refusal(e: RequestError) {
    let described = e.to_string();
    let status: tonic::Status = e.into();
    assert!(
        matches!(
            status.code(),
            // FAILED_PRECONDITION: a sparse row too short for its chain;
            // NOT_FOUND / PERMISSION_DENIED: a shared row naming a region
            // that is not registered, or is another caller's.
            Code::InvalidArgument
                | Code::ResourceExhausted
                | Code::FailedPrecondition
                | Code::NotFound
                | Code::PermissionDenied
        ),
        "request refused with {:?}: {described}",
        status.code()
    );
    assert!(!status.message().is_empty());
}

fuzz_target!(|data: &[u8]| {
    let Some((&kind, bytes)) = data.split_first() else {
        return;
    };
    let state = samplerd_fuzz::app_state();
    if kind % 3 == 2 {
        let Ok(req) = v1::SampleBatchRequest::decode(bytes) else {
            return;
        };
        match samplerd::service::batch::sample_batch_blocking(
            state,
            &req,
            &samplerd::transport::identity::Caller::Unknown,
        ) {
            Ok(rows) => {
                assert_eq!(rows.len(), req.rows.len());
                for r in rows {
                    assert!(r.probability > 0.0 && r.probability <= 1.0);
                    assert!(r.probs.len() <= req.n_probs as usize);
                }
            }
            Err(e) => check_refusal(e),
        }
    } else if kind % 3 == 0 {
        let Ok(req) = v1::SampleRequest::decode(bytes) else {
            return;
        };
        let prepared = match state.prepare_constraints_blocking(req.params.as_ref(), None) {
            Ok(p) => p,
            Err(e) => return check_refusal(e),
        };
        match samplerd::service::sample::sample_blocking(
            state,
            &req,
            &prepared,
            &samplerd::transport::identity::Caller::Unknown,
        ) {
            Ok(r) => {
                let n = req.logits.len().max(req.logits_f32le.len() / 4);
                assert!((r.token_id as usize) < n, "token {} of {n}", r.token_id);
                assert!(r.probability > 0.0 && r.probability <= 1.0);
                assert!(r.probs.len() <= req.n_probs as usize);
            }
            Err(e) => check_refusal(e),
        }
    } else {
        let Ok(req) = v1::GenerateRequest::decode(bytes) else {
            return;
        };
        let prepared = match state.prepare_constraints_blocking(req.params.as_ref(), None) {
            Ok(p) => p,
            Err(e) => return check_refusal(e),
        };
        let valid = match samplerd::service::validate::generate(
            state,
            &req,
            None,
            None,
            prepared.prebuilt(),
        ) {
            Ok(v) => v,
            Err(e) => return check_refusal(e),
        };
        if let Some(host) = model_host()
            && let Err(e) = host.prompt_tokens(&valid.prompt)
        {
            check_refusal(e);
        }
    }
});
