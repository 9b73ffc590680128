//! The gRPC statuses samplerd sends: a code, the human message (which names
//! the field, the value and the config key) and, in
//! `grpc-status-details-bin`, the standard `google.rpc` details — an
//! `ErrorInfo` with a stable machine-readable [`Reason`] on every error,
//! plus `BadRequest`, `ResourceInfo` and `RetryInfo` where they apply.
//!
//! Clients branch on the reason, never on the English text: the text may
//! be reworded, the reasons are part of the API (docs/API.md lists them;
//! `server/tests/error_details.rs` and `tests/python/test_error_details.py`
//! reach each one).

#![forbid(unsafe_code)]

use std::collections::HashMap;
use std::time::Duration;

use samplerd_sampling::echo::{self, MAX_ECHO_BYTES};
use tonic::{Code, Status};
use tonic_types::{ErrorDetails, StatusExt};

/// `ErrorInfo.domain` of every samplerd error.
pub const ERROR_DOMAIN: &str = "samplerd.v1";

/// The `RetryInfo` delay on a refusal that frees up by itself (a full
/// queue, a spent budget, a model still loading). The server cannot know
/// when a slot frees; this is the shortest wait worth a retry — about one
/// default Generate's duration — and clients add their own backoff.
pub const RETRY_AFTER: Duration = Duration::from_secs(1);

/// The trailer gRPC's built-in retry reads for the server's wait (gRFC
/// A6 "server pushback"): it cannot read `RetryInfo`, which sits inside
/// `grpc-status-details-bin`. Sent with every `RetryInfo` (the same delay),
/// and as `-1` — do not retry — on a RESOURCE_EXHAUSTED that does not free
/// up by itself (a message over its size limit), which the published
/// retry policy (clients/service-config.json) would otherwise retry.
pub const PUSHBACK_HEADER: &str = "grpc-retry-pushback-ms";

/// Why a call failed, for machines (`google.rpc.ErrorInfo.reason`). Each
/// has one gRPC code.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Reason {
    /// A field is malformed, missing or conflicts with another.
    InvalidField,
    /// A value is outside the range its stage accepts.
    ParamOutOfRange,
    /// A request is larger than a configured limit (metadata `limit`).
    LimitExceeded,
    /// Logits are empty, NaN or +inf, or their bytes are not whole f32s.
    InvalidLogits,
    /// The chain left no token to draw.
    AllTokensMasked,
    /// `params.chain` names a stage no plugin provides.
    UnknownStage,
    /// `params.vocabulary` names no configured vocabulary.
    UnknownVocabulary,
    /// A JSON Schema, regex or grammar does not compile.
    InvalidConstraint,
    /// A request message that does not decode: not protobuf of the
    /// method's type, corrupt compressed data, a bad compressed flag or a
    /// message cut short.
    MalformedMessage,
    /// Admission: every generation slot and queue place, or stream place,
    /// is taken.
    Overloaded,
    /// The memory budget for open sessions is spent.
    BudgetExceeded,
    /// A constraint's compile ran past `limits.max_constraint_compile_ms`.
    ConstraintTooCostly,
    /// A message is above its size limit.
    MessageTooLarge,
    /// A plugin stage returned an error or broke a post-check.
    StageFailed,
    /// A stage refused the request's input while sampling (`SD_ERR_INPUT`:
    /// a grammar that outgrew its parser's limits, a token it does not
    /// allow).
    StageRefused,
    /// A sampling step ran past `limits.max_step_ms`.
    StepStuck,
    /// Every sampling thread is held by stuck steps.
    NoSamplingThread,
    /// A sampling step panicked.
    StepPanicked,
    /// A sparse row cannot stand for its dense row in this chain: some
    /// stage's outcome could depend on the entries not sent (metadata
    /// `stage`, `entries_sent`, `entries_needed` where known).
    SparseInsufficient,
    /// A shared-memory file or region the caller may not use: another
    /// identity's region, a file outside `transport.shared_memory_dirs`,
    /// behind a symlink or of another owner.
    SharedMemoryDenied,
    /// A shared-memory region name that is not registered.
    UnknownRegion,
    /// A shared-memory region name that is taken.
    RegionExists,
    /// A shared-memory region truncated while it was read (it is
    /// unregistered).
    RegionLost,
    /// `limits.max_shared_regions` or `limits.max_shared_bytes` is reached.
    SharedMemoryFull,
    /// Generate on a server started without a model.
    NoModel,
    /// Generate before the model finished loading.
    ModelLoading,
    /// A missing or wrong bearer token.
    Unauthenticated,
    /// The client's deadline, or `limits.max_request_duration_secs`, ran out.
    DeadlineExceeded,
    /// The server is draining after SIGTERM.
    ShuttingDown,
    /// A stream outlived its connection's maximum age and grace
    /// (`limits.max_connection_age_grace_secs`): resume it elsewhere.
    ConnectionAged,
    /// A unary call (or Generate) with zero or two request messages.
    WrongMessageCount,
    /// A request compressed with an encoding the server does not accept
    /// (metadata `grpc-accept-encoding` lists the ones it does).
    UnsupportedEncoding,
    /// A method (or service) the server does not serve.
    UnknownMethod,
    /// Any other server-side failure.
    Internal,
}

impl Reason {
    /// Every reason, in docs/API.md's order.
    pub const ALL: [Reason; 34] = [
        Reason::InvalidField,
        Reason::ParamOutOfRange,
        Reason::LimitExceeded,
        Reason::InvalidLogits,
        Reason::AllTokensMasked,
        Reason::UnknownStage,
        Reason::UnknownVocabulary,
        Reason::InvalidConstraint,
        Reason::MalformedMessage,
        Reason::Overloaded,
        Reason::BudgetExceeded,
        Reason::ConstraintTooCostly,
        Reason::MessageTooLarge,
        Reason::StageFailed,
        Reason::StageRefused,
        Reason::StepStuck,
        Reason::NoSamplingThread,
        Reason::StepPanicked,
        Reason::SparseInsufficient,
        Reason::SharedMemoryDenied,
        Reason::UnknownRegion,
        Reason::RegionExists,
        Reason::RegionLost,
        Reason::SharedMemoryFull,
        Reason::NoModel,
        Reason::ModelLoading,
        Reason::Unauthenticated,
        Reason::DeadlineExceeded,
        Reason::ShuttingDown,
        Reason::ConnectionAged,
        Reason::WrongMessageCount,
        Reason::UnsupportedEncoding,
        Reason::UnknownMethod,
        Reason::Internal,
    ];

    /// The wire name (`SAMPLERD_` and the reason in upper snake case).
    pub const fn as_str(self) -> &'static str {
        match self {
            Reason::InvalidField => "SAMPLERD_INVALID_FIELD",
            Reason::ParamOutOfRange => "SAMPLERD_PARAM_OUT_OF_RANGE",
            Reason::LimitExceeded => "SAMPLERD_LIMIT_EXCEEDED",
            Reason::InvalidLogits => "SAMPLERD_INVALID_LOGITS",
            Reason::AllTokensMasked => "SAMPLERD_ALL_TOKENS_MASKED",
            Reason::UnknownStage => "SAMPLERD_UNKNOWN_STAGE",
            Reason::UnknownVocabulary => "SAMPLERD_UNKNOWN_VOCABULARY",
            Reason::InvalidConstraint => "SAMPLERD_INVALID_CONSTRAINT",
            Reason::MalformedMessage => "SAMPLERD_MALFORMED_MESSAGE",
            Reason::Overloaded => "SAMPLERD_OVERLOADED",
            Reason::BudgetExceeded => "SAMPLERD_BUDGET_EXCEEDED",
            Reason::ConstraintTooCostly => "SAMPLERD_CONSTRAINT_TOO_COSTLY",
            Reason::MessageTooLarge => "SAMPLERD_MESSAGE_TOO_LARGE",
            Reason::StageFailed => "SAMPLERD_STAGE_FAILED",
            Reason::StageRefused => "SAMPLERD_STAGE_REFUSED",
            Reason::StepStuck => "SAMPLERD_STEP_STUCK",
            Reason::NoSamplingThread => "SAMPLERD_NO_SAMPLING_THREAD",
            Reason::StepPanicked => "SAMPLERD_STEP_PANICKED",
            Reason::SparseInsufficient => "SAMPLERD_SPARSE_INSUFFICIENT",
            Reason::SharedMemoryDenied => "SAMPLERD_SHARED_MEMORY_DENIED",
            Reason::UnknownRegion => "SAMPLERD_UNKNOWN_REGION",
            Reason::RegionExists => "SAMPLERD_REGION_EXISTS",
            Reason::RegionLost => "SAMPLERD_SHARED_REGION_LOST",
            Reason::SharedMemoryFull => "SAMPLERD_SHARED_MEMORY_FULL",
            Reason::NoModel => "SAMPLERD_NO_MODEL",
            Reason::ModelLoading => "SAMPLERD_MODEL_LOADING",
            Reason::Unauthenticated => "SAMPLERD_UNAUTHENTICATED",
            Reason::DeadlineExceeded => "SAMPLERD_DEADLINE_EXCEEDED",
            Reason::ShuttingDown => "SAMPLERD_SHUTTING_DOWN",
            Reason::ConnectionAged => "SAMPLERD_CONNECTION_AGED",
            Reason::WrongMessageCount => "SAMPLERD_WRONG_MESSAGE_COUNT",
            Reason::UnsupportedEncoding => "SAMPLERD_UNSUPPORTED_ENCODING",
            Reason::UnknownMethod => "SAMPLERD_UNKNOWN_METHOD",
            Reason::Internal => "SAMPLERD_INTERNAL",
        }
    }

    /// The gRPC code a status with this reason has.
    pub const fn code(self) -> Code {
        match self {
            Reason::InvalidField
            | Reason::ParamOutOfRange
            | Reason::LimitExceeded
            | Reason::InvalidLogits
            | Reason::AllTokensMasked
            | Reason::UnknownStage
            | Reason::UnknownVocabulary
            | Reason::InvalidConstraint
            | Reason::StageRefused
            // gRPC's table of status codes has INTERNAL for a request that
            // does not parse; the fault and the fix are the client's, and
            // INTERNAL stays what it says (the server's own failures, what
            // alerts watch), so a malformed message is INVALID_ARGUMENT.
            | Reason::MalformedMessage => Code::InvalidArgument,
            Reason::Overloaded
            | Reason::BudgetExceeded
            | Reason::ConstraintTooCostly
            | Reason::MessageTooLarge
            | Reason::SharedMemoryFull => Code::ResourceExhausted,
            Reason::SharedMemoryDenied => Code::PermissionDenied,
            Reason::UnknownRegion => Code::NotFound,
            Reason::RegionExists => Code::AlreadyExists,
            Reason::RegionLost => Code::Aborted,
            Reason::StageFailed | Reason::StepPanicked | Reason::Internal => Code::Internal,
            Reason::StepStuck | Reason::DeadlineExceeded => Code::DeadlineExceeded,
            Reason::NoSamplingThread
            | Reason::ModelLoading
            | Reason::ShuttingDown
            | Reason::ConnectionAged => Code::Unavailable,
            Reason::NoModel | Reason::SparseInsufficient => Code::FailedPrecondition,
            Reason::Unauthenticated => Code::Unauthenticated,
            Reason::WrongMessageCount | Reason::UnsupportedEncoding | Reason::UnknownMethod => {
                Code::Unimplemented
            }
        }
    }

    /// The [`PUSHBACK_HEADER`] value: the `RetryInfo` delay in
    /// milliseconds, `-1` for a RESOURCE_EXHAUSTED that retrying cannot
    /// fix, none otherwise (the client's own backoff).
    fn pushback(self) -> Option<&'static str> {
        const RETRY_AFTER_MS: &str = "1000";
        debug_assert_eq!(RETRY_AFTER.as_millis().to_string(), RETRY_AFTER_MS);
        if self.retryable() {
            Some(RETRY_AFTER_MS)
        } else if matches!(self.code(), Code::ResourceExhausted) {
            Some("-1")
        } else {
            None
        }
    }

    /// Whether the refusal frees up by itself, so that the status carries
    /// a `RetryInfo`.
    const fn retryable(self) -> bool {
        matches!(
            self,
            Reason::Overloaded
                | Reason::BudgetExceeded
                | Reason::NoSamplingThread
                | Reason::ModelLoading
        )
    }
}

/// What a `ResourceInfo` names: the kind of thing that was not found.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ResourceKind {
    Stage,
    Vocabulary,
}

impl ResourceKind {
    /// `ResourceInfo.resource_type`.
    pub const fn type_name(self) -> &'static str {
        match self {
            ResourceKind::Stage => "samplerd.v1.Stage",
            ResourceKind::Vocabulary => "samplerd.v1.Vocabulary",
        }
    }
}

/// One failure on its way to a [`Status`]: the reason, the human message,
/// and what the details say besides.
#[derive(Clone, Debug)]
pub struct Failure {
    reason: Reason,
    message: String,
    /// The request field path (`BadRequest.field_violations[0].field`).
    field: Option<String>,
    /// `ErrorInfo.metadata`: `limit` (a config key), `stage` (a stage name).
    metadata: HashMap<String, String>,
    resource: Option<(ResourceKind, String)>,
}

impl Failure {
    pub fn new(reason: Reason, message: impl Into<String>) -> Self {
        Failure {
            reason,
            message: message.into(),
            field: None,
            metadata: HashMap::new(),
            resource: None,
        }
    }

    /// The field at fault, with its description (the message without the
    /// field prefix) as the `BadRequest` violation.
    pub fn field(mut self, path: impl Into<String>) -> Self {
        self.field = Some(path.into());
        self
    }

    /// The configuration key whose limit was reached.
    pub fn limit(self, key: &str) -> Self {
        self.meta("limit", key)
    }

    /// The stage at fault.
    pub fn stage(self, name: &str) -> Self {
        self.meta("stage", name)
    }

    /// A count of entries (a sparse row's `entries_sent`, `entries_needed`).
    pub fn entries(self, key: &str, n: usize) -> Self {
        self.meta(key, &n.to_string())
    }

    /// The named thing that does not exist (a client's name: cut to
    /// [`MAX_ECHO_BYTES`] here whatever the caller passed).
    pub fn resource(mut self, kind: ResourceKind, name: impl Into<String>) -> Self {
        let name = name.into();
        let name = match echo::excerpt(&name, MAX_ECHO_BYTES) {
            std::borrow::Cow::Borrowed(_) => name,
            cut => cut.into_owned(),
        };
        self.resource = Some((kind, name));
        self
    }

    fn meta(mut self, key: &str, value: &str) -> Self {
        self.metadata.insert(key.to_owned(), value.to_owned());
        self
    }

    /// The same failure with another human message.
    pub fn with_message(mut self, message: impl Into<String>) -> Self {
        self.message = message.into();
        self
    }

    pub fn reason(&self) -> Reason {
        self.reason
    }

    /// The status: the reason's code, the message (cut to
    /// [`MAX_MESSAGE_BYTES`] as sent), the details encoded as a
    /// `google.rpc.Status`; `grpc-message` and `grpc-status-details-bin`
    /// together stay within [`MAX_TRAILER_BYTES`].
    pub fn into_status(self) -> Status {
        let message = clip_message(&self.message, MAX_MESSAGE_BYTES);
        let status = self.build(&message, true);
        if trailer_bytes(&status) <= MAX_TRAILER_BYTES {
            return status;
        }
        // Only metadata or a field path past every per-value bound gets
        // here: the `ErrorInfo` alone (reason and domain) and a short
        // message.
        let message = clip_message(&self.message, MAX_MESSAGE_BYTES / 4);
        let mut bare = Failure::new(self.reason, String::new());
        bare.metadata = self
            .metadata
            .iter()
            .map(|(k, v)| (k.clone(), clip_message(v, 64)))
            .collect();
        let status = bare.build(&message, false);
        if trailer_bytes(&status) <= MAX_TRAILER_BYTES {
            status
        } else {
            Failure::new(self.reason, "").build(&message, false)
        }
    }

    /// The status with `message`; `all` adds the details beyond the
    /// `ErrorInfo`.
    fn build(&self, message: &str, all: bool) -> Status {
        let mut details = ErrorDetails::new();
        details.set_error_info(self.reason.as_str(), ERROR_DOMAIN, self.metadata.clone());
        if all {
            if let Some(field) = &self.field {
                let prefix = format!("{field}: ");
                let description = message.strip_prefix(&prefix).unwrap_or(message);
                details.add_bad_request_violation(field.clone(), description.to_owned());
            }
            if let Some((kind, name)) = &self.resource {
                details.set_resource_info(kind.type_name(), name.clone(), "", "not found");
            }
        }
        if self.reason.retryable() {
            details.set_retry_info(Some(RETRY_AFTER));
        }
        let mut status =
            Status::with_error_details(self.reason.code(), message.to_owned(), details);
        if let Some(ms) = self.reason.pushback() {
            status.metadata_mut().insert(
                PUSHBACK_HEADER,
                tonic::metadata::MetadataValue::from_static(ms),
            );
        }
        status
    }
}

/// The most bytes of `grpc-message` as sent (percent-encoded): a message
/// quotes each client value with at most [`MAX_ECHO_BYTES`], so only a
/// message naming several long values comes near it.
pub const MAX_MESSAGE_BYTES: usize = 1024;

/// The most bytes of `grpc-message` and `grpc-status-details-bin` together,
/// as sent. Far under the smallest limit a client applies to the metadata
/// of a response (grpcio's and grpc-go's default is 8 KiB for all of it),
/// so every client can read every samplerd error.
pub const MAX_TRAILER_BYTES: usize = 4096;

/// The bytes `grpc-message` takes on the wire: tonic percent-encodes
/// controls, non-ASCII bytes, the space and the characters of
/// `tonic::status`'s `ENCODING_SET` into three bytes each.
fn encoded_len(s: &str) -> usize {
    s.bytes()
        .map(|b| match b {
            0x21..=0x7e if !b"\"#%<>`?{}".contains(&b) => 1,
            _ => 3,
        })
        .sum()
}

/// What a status's message and details take in the trailers (the details
/// travel base64-encoded; counted here with padding, a byte or two over).
pub fn trailer_bytes(status: &Status) -> usize {
    encoded_len(status.message()) + status.details().len().div_ceil(3) * 4
}

/// `message`, or as much of it as fits in `max` encoded bytes with `…` and
/// its full length in bytes.
fn clip_message(message: &str, max: usize) -> String {
    if encoded_len(message) <= max {
        return message.to_owned();
    }
    let suffix = format!("… ({} bytes)", message.len());
    let budget = max.saturating_sub(encoded_len(&suffix));
    let mut used = 0;
    let mut end = 0;
    for (i, c) in message.char_indices() {
        let mut buf = [0; 4];
        used += encoded_len(c.encode_utf8(&mut buf));
        if used > budget {
            break;
        }
        end = i + c.len_utf8();
    }
    format!("{}{suffix}", &message[..end])
}

impl From<Failure> for Status {
    fn from(f: Failure) -> Status {
        f.into_status()
    }
}

/// A status with only an `ErrorInfo` of `reason` (its code) and `message`.
pub fn status(reason: Reason, message: impl Into<String>) -> Status {
    Failure::new(reason, message).into_status()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reasons_are_unique_upper_snake_case_with_the_prefix() {
        let mut seen = std::collections::HashSet::new();
        for r in Reason::ALL {
            let s = r.as_str();
            assert!(seen.insert(s), "{s} twice");
            let rest = s.strip_prefix("SAMPLERD_").expect(s);
            assert!(
                rest.chars().all(|c| c.is_ascii_uppercase() || c == '_'),
                "{s}"
            );
        }
    }

    #[test]
    fn docs_api_lists_every_reason_and_no_other() {
        let doc = include_str!(concat!(env!("CARGO_MANIFEST_DIR"), "/../docs/API.md"));
        let listed: std::collections::BTreeSet<&str> = doc
            .lines()
            .filter_map(|l| l.strip_prefix("| `SAMPLERD_"))
            .filter_map(|l| l.split('`').next())
            .collect();
        let ours: std::collections::BTreeSet<&str> = Reason::ALL
            .iter()
            .map(|r| r.as_str().strip_prefix("SAMPLERD_").unwrap())
            .collect();
        assert_eq!(
            listed, ours,
            "docs/API.md's error table against Reason::ALL"
        );
    }

    #[test]
    fn details_round_trip_through_the_status() {
        let st = Failure::new(Reason::LimitExceeded, "n_probs: 2000 exceeds the limit")
            .field("n_probs")
            .limit("limits.max_n_probs")
            .into_status();
        assert_eq!(st.code(), Code::InvalidArgument);
        assert_eq!(st.message(), "n_probs: 2000 exceeds the limit");
        let d = st.get_error_details();
        let info = d.error_info().expect("ErrorInfo");
        assert_eq!(info.reason, "SAMPLERD_LIMIT_EXCEEDED");
        assert_eq!(info.domain, ERROR_DOMAIN);
        assert_eq!(info.metadata["limit"], "limits.max_n_probs");
        let v = &d.bad_request().expect("BadRequest").field_violations;
        assert_eq!(v.len(), 1);
        assert_eq!(v[0].field, "n_probs");
        assert_eq!(v[0].description, "2000 exceeds the limit");
        assert!(d.retry_info().is_none());
    }

    /// Whatever a caller passes, the status stays within its bounds: the
    /// message cut with its length, a resource name cut, and past the cap
    /// (metadata no request sets this large) the ErrorInfo alone.
    #[test]
    fn a_status_stays_within_its_bounds() {
        let long = "é x".repeat(300_000);
        let st = Failure::new(Reason::InvalidField, format!("f: {long}"))
            .field("f")
            .resource(ResourceKind::Vocabulary, long.clone())
            .into_status();
        assert!(
            trailer_bytes(&st) <= MAX_TRAILER_BYTES,
            "{}",
            trailer_bytes(&st)
        );
        assert!(encoded_len(st.message()) <= MAX_MESSAGE_BYTES);
        assert!(
            st.message()
                .ends_with(&format!("… ({} bytes)", long.len() + 3))
        );
        let d = st.get_error_details();
        assert!(d.resource_info().unwrap().resource_name.len() <= MAX_ECHO_BYTES + 3);
        assert_eq!(d.bad_request().unwrap().field_violations[0].field, "f");
        let st = Failure::new(Reason::InvalidField, "m")
            .stage(&"s".repeat(10_000))
            .into_status();
        assert!(
            trailer_bytes(&st) <= MAX_TRAILER_BYTES,
            "{}",
            trailer_bytes(&st)
        );
        assert_eq!(
            st.get_details_error_info().unwrap().reason,
            "SAMPLERD_INVALID_FIELD"
        );
    }

    #[test]
    fn retryable_refusals_carry_retry_info_and_lookups_resource_info() {
        let st = status(Reason::Overloaded, "full");
        assert_eq!(st.code(), Code::ResourceExhausted);
        let delay = st.get_details_retry_info().and_then(|r| r.retry_delay);
        assert_eq!(delay, Some(RETRY_AFTER));
        // The same delay for gRPC's built-in retry, which cannot read it.
        assert_eq!(st.metadata().get(PUSHBACK_HEADER).unwrap(), "1000");
        // A refusal that does not free up: "do not retry"; others: none.
        let st = status(Reason::MessageTooLarge, "too large");
        assert_eq!(st.metadata().get(PUSHBACK_HEADER).unwrap(), "-1");
        let st = status(Reason::ShuttingDown, "draining");
        assert!(st.metadata().get(PUSHBACK_HEADER).is_none());
        let st = Failure::new(Reason::UnknownStage, "params.chain[0].name: unknown")
            .field("params.chain[0].name")
            .resource(ResourceKind::Stage, "nope")
            .into_status();
        let r = st.get_details_resource_info().expect("ResourceInfo");
        assert_eq!(
            (r.resource_type.as_str(), r.resource_name.as_str()),
            ("samplerd.v1.Stage", "nope")
        );
    }
}
