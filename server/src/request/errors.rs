//! Mapping of request and sampling-core errors to gRPC `Status`es. Every
//! message names the request field (or stage) and the offending value;
//! every status also carries its machine-readable reason and details
//! ([`crate::status`]).

#![forbid(unsafe_code)]

use samplerd_sampling::params::CONSTRAINT_STAGE;
use samplerd_sampling::{ChainError, LogitsError, SampleError, SparseRefusal};
use tonic::Status;

use crate::status::{Failure, Reason, ResourceKind};

/// A request-level failure, before it becomes a `Status`.
#[derive(Debug, thiserror::Error)]
pub enum RequestError {
    /// A field of the request is invalid; `kind` says how.
    #[error("{field}: {message}")]
    Invalid {
        field: String,
        message: String,
        kind: InvalidKind,
    },
    /// The logits in `field` cannot be sampled.
    #[error("{field}: {source}")]
    Logits {
        field: String,
        #[source]
        source: LogitsError,
    },
    /// A stage failed while sampling.
    #[error("sampling failed: {0}")]
    Plugin(SampleError),
    /// A sparse row too short for the chain: the proof could not show that
    /// the outcome is the dense row's (FAILED_PRECONDITION).
    #[error("{0}")]
    Sparse(SparseRefusal),
    /// A server limit was reached: admission or the memory budget
    /// (`limit` is its config key).
    #[error("{message}")]
    Exhausted {
        message: String,
        reason: Reason,
        limit: &'static str,
    },
    /// A field refused for `reason` (a shared-memory file or region the
    /// caller may not use, or that is gone or full).
    #[error("{field}: {message}")]
    Refused {
        field: String,
        message: String,
        reason: Reason,
    },
    /// Server-side failure unrelated to the request.
    #[error("{0}")]
    Internal(String),
    /// The step ran past its budget, found no sampling thread or panicked.
    #[error("{0}")]
    Step(#[from] crate::request::step_pool::StepFailure),
    /// A failure of one row of a batch that names no field.
    #[error("rows[{row}]: {inner}")]
    InRow {
        row: usize,
        inner: Box<RequestError>,
    },
}

/// How a field is invalid (its [`Reason`], and what the details name).
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum InvalidKind {
    /// Malformed, missing, or in conflict with another field.
    Field,
    /// A value outside the range its stage accepts.
    OutOfRange,
    /// Larger than the limit of this config key.
    Limit(&'static str),
    /// Logits that cannot be sampled.
    Logits,
    /// No token left to draw.
    AllMasked,
    /// No loaded plugin provides this stage.
    UnknownStage(String),
    /// No vocabulary of this name is configured.
    UnknownVocabulary(String),
    /// A constraint that does not compile.
    Constraint,
}

impl RequestError {
    /// A malformed field ([`InvalidKind::Field`]).
    pub fn invalid(field: impl Into<String>, message: impl Into<String>) -> Self {
        Self::invalid_as(InvalidKind::Field, field, message)
    }

    /// A field larger than the limit `key` sets.
    pub fn limit(field: impl Into<String>, key: &'static str, message: impl Into<String>) -> Self {
        Self::invalid_as(InvalidKind::Limit(key), field, message)
    }

    pub fn invalid_as(
        kind: InvalidKind,
        field: impl Into<String>,
        message: impl Into<String>,
    ) -> Self {
        RequestError::Invalid {
            field: field.into(),
            message: message.into(),
            kind,
        }
    }

    /// A field refused for `reason`.
    pub fn refused(reason: Reason, field: impl Into<String>, message: impl Into<String>) -> Self {
        RequestError::Refused {
            field: field.into(),
            message: message.into(),
            reason,
        }
    }

    /// A refusal by admission or the memory budget.
    pub fn exhausted(reason: Reason, limit: &'static str, message: impl Into<String>) -> Self {
        RequestError::Exhausted {
            message: message.into(),
            reason,
            limit,
        }
    }

    /// A chain error for a request: typed-parameter errors get the
    /// `params.` prefix; the rest name `params.chain` (an explicit chain)
    /// or `params`.
    pub fn from_chain(err: ChainError, explicit_chain: bool) -> Self {
        let kind = chain_error_kind(&err);
        match err {
            // The server's own fault: it compiles constraints beforehand.
            e @ ChainError::NotPrebuilt { .. } => RequestError::Internal(e.to_string()),
            ChainError::Param { field, message } => {
                Self::invalid_as(kind, format!("params.{field}"), message)
            }
            other if explicit_chain => Self::invalid_as(kind, "params.chain", other.to_string()),
            other => Self::invalid_as(kind, "params", other.to_string()),
        }
    }

    /// A sampling error: bad logits are the caller's fault, the rest is a
    /// plugin failure (INTERNAL, naming the stage).
    pub fn from_sample(err: SampleError, logits_field: &'static str) -> Self {
        match err {
            SampleError::Logits(source) => RequestError::Logits {
                field: logits_field.into(),
                source,
            },
            e @ SampleError::AllMasked { .. } => {
                Self::invalid_as(InvalidKind::AllMasked, "params", e.to_string())
            }
            SampleError::Sparse(r) => RequestError::Sparse(r),
            other => RequestError::Plugin(other),
        }
    }

    /// This error under the message field `path` (a Verify's row): a
    /// field path gains the `path.` prefix; any other error is unchanged.
    pub fn under(self, path: &str) -> Self {
        match self {
            RequestError::Invalid {
                field,
                message,
                kind,
            } => RequestError::Invalid {
                field: format!("{path}.{field}"),
                message,
                kind,
            },
            RequestError::Logits { field, source } => RequestError::Logits {
                field: format!("{path}.{field}"),
                source,
            },
            RequestError::Refused {
                field,
                message,
                reason,
            } => RequestError::Refused {
                field: format!("{path}.{field}"),
                message,
                reason,
            },
            other => other,
        }
    }

    /// This error as row `row` of a batch: a field path gains the
    /// `rows[row].` prefix, any other error the `rows[row]: ` one.
    pub fn in_row(self, row: usize) -> Self {
        match self {
            RequestError::Invalid {
                field,
                message,
                kind,
            } => RequestError::Invalid {
                field: format!("rows[{row}].{field}"),
                message,
                kind,
            },
            RequestError::Logits { field, source } => RequestError::Logits {
                field: format!("rows[{row}].{field}"),
                source,
            },
            RequestError::Refused {
                field,
                message,
                reason,
            } => RequestError::Refused {
                field: format!("rows[{row}].{field}"),
                message,
                reason,
            },
            e @ RequestError::InRow { .. } => e,
            other => RequestError::InRow {
                row,
                inner: Box::new(other),
            },
        }
    }

    /// The failure with its reason and details.
    pub fn failure(&self) -> Failure {
        let msg = self.to_string();
        match self {
            RequestError::Invalid { field, kind, .. } => {
                let (reason, f) = match kind {
                    InvalidKind::Field => (Reason::InvalidField, None),
                    InvalidKind::OutOfRange => (Reason::ParamOutOfRange, None),
                    InvalidKind::Limit(_) => (Reason::LimitExceeded, None),
                    InvalidKind::Logits => (Reason::InvalidLogits, None),
                    InvalidKind::AllMasked => (Reason::AllTokensMasked, None),
                    InvalidKind::UnknownStage(name) => (
                        Reason::UnknownStage,
                        Some((ResourceKind::Stage, name.clone())),
                    ),
                    InvalidKind::UnknownVocabulary(name) => (
                        Reason::UnknownVocabulary,
                        Some((ResourceKind::Vocabulary, name.clone())),
                    ),
                    InvalidKind::Constraint => (Reason::InvalidConstraint, None),
                };
                let mut out = Failure::new(reason, msg).field(field.clone());
                if let InvalidKind::Limit(key) = kind {
                    out = out.limit(key);
                }
                if let Some((kind, name)) = f {
                    out = out.resource(kind, name);
                }
                out
            }
            RequestError::Logits { field, source } => {
                let out = match source {
                    LogitsError::AllMasked => Failure::new(Reason::AllTokensMasked, msg),
                    // Only reached from the core's own bound; the host
                    // checks limits.max_vocab first.
                    LogitsError::TooLarge { .. } => {
                        Failure::new(Reason::LimitExceeded, msg).limit("limits.max_vocab")
                    }
                    _ => Failure::new(Reason::InvalidLogits, msg),
                };
                out.field(field.clone())
            }
            RequestError::Plugin(e) => match e {
                SampleError::Plugin { stage, .. }
                | SampleError::Misbehaved { stage, .. }
                | SampleError::NoSelection { stage }
                | SampleError::AllMasked { stage } => {
                    Failure::new(Reason::StageFailed, msg).stage(stage)
                }
                // The constraint stage refuses because of the request's
                // grammar: the field that carries it is named too.
                SampleError::Refused { stage, .. } if stage == CONSTRAINT_STAGE => {
                    const FIELD: &str = "params.constraint";
                    Failure::new(Reason::StageRefused, format!("{FIELD}: {msg}"))
                        .stage(stage)
                        .field(FIELD)
                }
                SampleError::Refused { stage, .. } => {
                    Failure::new(Reason::StageRefused, msg).stage(stage)
                }
                _ => Failure::new(Reason::Internal, msg),
            },
            RequestError::Exhausted { reason, limit, .. } => {
                Failure::new(*reason, msg).limit(limit)
            }
            RequestError::Sparse(r) => {
                let mut out =
                    Failure::new(Reason::SparseInsufficient, msg).entries("entries_sent", r.sent);
                if let Some(stage) = &r.stage {
                    out = out.stage(stage);
                }
                if let Some(field) = r.field {
                    out = out.field(field);
                }
                if let Some(n) = r.entries_needed {
                    out = out.entries("entries_needed", n);
                }
                out
            }
            RequestError::Refused { field, reason, .. } => {
                Failure::new(*reason, msg).field(field.clone())
            }
            RequestError::Internal(_) => Failure::new(Reason::Internal, msg),
            RequestError::Step(f) => f.failure(),
            RequestError::InRow { row, inner } => inner
                .failure()
                .with_message(format!("rows[{row}]: {inner}")),
        }
    }
}

/// The kind of a chain-building error: a stage's own refusal of a value is
/// a range error (the core stages refuse only ranges; a plugin's other
/// refusals read the same way to a client), the constraint stage's is a
/// constraint that does not compile.
pub fn chain_error_kind(err: &ChainError) -> InvalidKind {
    match err {
        ChainError::UnknownStage { name, .. } => {
            InvalidKind::UnknownStage(name.excerpt().into_owned())
        }
        ChainError::Param { field, .. } if field.starts_with(CONSTRAINT_STAGE) => {
            InvalidKind::Constraint
        }
        ChainError::Invalid { stage, .. } if stage == CONSTRAINT_STAGE => InvalidKind::Constraint,
        ChainError::Param { .. } | ChainError::Invalid { .. } => InvalidKind::OutOfRange,
        _ => InvalidKind::Field,
    }
}

impl From<RequestError> for Status {
    fn from(err: RequestError) -> Status {
        err.failure().into_status()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn each_kind_of_error_has_its_reason() {
        let cases = [
            (RequestError::invalid("f", "bad"), Reason::InvalidField),
            (
                RequestError::limit("n_probs", "limits.max_n_probs", "big"),
                Reason::LimitExceeded,
            ),
            (RequestError::Internal("oops".into()), Reason::Internal),
            (
                RequestError::Plugin(SampleError::NotLoaded),
                Reason::Internal,
            ),
            (
                RequestError::exhausted(
                    Reason::Overloaded,
                    "generate.max_queued_generations",
                    "full",
                ),
                Reason::Overloaded,
            ),
            (
                RequestError::from_chain(
                    ChainError::UnknownStage {
                        name: samplerd_sampling::echo::Echo::new("x"),
                        known: "y".into(),
                    },
                    true,
                ),
                Reason::UnknownStage,
            ),
        ];
        for (e, want) in cases {
            assert_eq!(e.failure().reason(), want, "{e}");
        }
    }

    #[test]
    fn a_row_prefixes_the_field_once_and_wraps_the_rest() {
        let e = RequestError::invalid("params.top_p", "too big").in_row(3);
        assert_eq!(e.to_string(), "rows[3].params.top_p: too big");
        let e = RequestError::Internal("oops".into()).in_row(2).in_row(2);
        assert_eq!(e.to_string(), "rows[2]: oops");
        assert_eq!(Status::from(e).message(), "rows[2]: oops");
    }
}
