//! Mapping of sampling-core errors to gRPC `Status`es. Every message names
//! the request field (or stage) and the offending value.

#![forbid(unsafe_code)]

use samplerd_sampling::{ChainError, LogitsError, SampleError};
use tonic::Status;

/// A request-level failure, before it becomes a `Status`.
#[derive(Debug, thiserror::Error)]
pub enum RequestError {
    /// A field of the request is invalid.
    #[error("{field}: {message}")]
    Invalid { field: String, message: String },
    /// The logits in `field` cannot be sampled.
    #[error("{field}: {source}")]
    Logits {
        field: &'static str,
        #[source]
        source: LogitsError,
    },
    /// The chain could not be built from the request's parameters.
    #[error("{0}")]
    Chain(String),
    /// A stage failed while sampling.
    #[error("sampling failed: {0}")]
    Plugin(SampleError),
    /// A server limit was reached.
    #[error("{0}")]
    Exhausted(String),
    /// Server-side failure unrelated to the request.
    #[error("{0}")]
    Internal(String),
    /// The step ran past its budget, found no sampling thread or panicked.
    #[error("{0}")]
    Step(#[from] crate::service::step_pool::StepFailure),
}

impl RequestError {
    pub fn invalid(field: impl Into<String>, message: impl Into<String>) -> Self {
        RequestError::Invalid {
            field: field.into(),
            message: message.into(),
        }
    }

    /// A chain error for a request: typed-parameter errors get the
    /// `params.` prefix; chain-spec errors name `params.chain`.
    pub fn from_chain(err: ChainError, explicit_chain: bool) -> Self {
        match err {
            ChainError::Param { field, message } => {
                RequestError::invalid(format!("params.{field}"), message)
            }
            other if explicit_chain => RequestError::invalid("params.chain", other.to_string()),
            other => RequestError::Chain(other.to_string()),
        }
    }

    /// A sampling error: bad logits are the caller's fault, the rest is a
    /// plugin failure (INTERNAL, naming the stage).
    pub fn from_sample(err: SampleError, logits_field: &'static str) -> Self {
        match err {
            SampleError::Logits(source) => RequestError::Logits {
                field: logits_field,
                source,
            },
            e @ SampleError::AllMasked { .. } => RequestError::invalid("params", e.to_string()),
            other => RequestError::Plugin(other),
        }
    }
}

impl From<RequestError> for Status {
    fn from(err: RequestError) -> Status {
        let msg = err.to_string();
        match err {
            RequestError::Invalid { .. } | RequestError::Logits { .. } | RequestError::Chain(_) => {
                Status::invalid_argument(msg)
            }
            RequestError::Plugin(_) | RequestError::Internal(_) => Status::internal(msg),
            RequestError::Exhausted(_) => Status::resource_exhausted(msg),
            RequestError::Step(f) => f.into(),
        }
    }
}

/// The gRPC status tonic uses for an over-size message (OUT_OF_RANGE with
/// this text) is rewritten to RESOURCE_EXHAUSTED.
pub const TOO_LARGE_MARKER: &str = "message length too large";

/// Maps tonic's over-size decode error to RESOURCE_EXHAUSTED; other
/// statuses pass through.
pub fn map_stream_status(status: Status) -> Status {
    if status.code() == tonic::Code::OutOfRange && status.message().contains(TOO_LARGE_MARKER) {
        Status::resource_exhausted(format!(
            "message too large (limits.max_message_bytes): {}",
            status.message()
        ))
    } else {
        status
    }
}
