//! samplerd-api: the Rust types and tonic stubs generated from
//! `proto/samplerd/v1/sampler.proto`, shared by the server and samplerctl.
//!
//! - [`v1`]: the public `samplerd.v1` service (`Sampler`) and its messages.
//! - [`testing::v1`]: test-only services (the `Noop` transport floor used by
//!   the benchmarks); never served by `samplerd serve`.
//! - [`FILE_DESCRIPTOR_SET`]: the encoded descriptors, for server reflection.
//! - [`code_name`]: the canonical name of a status code (`INVALID_ARGUMENT`),
//!   as gRPC's documentation and other languages' clients spell it.

#![forbid(unsafe_code)]

use tonic::Code;

/// The `samplerd.v1` package.
pub mod v1 {
    tonic::include_proto!("samplerd.v1");
}

/// Test-only packages.
pub mod testing {
    /// The `samplerd.testing.v1` package.
    pub mod v1 {
        include!(concat!(env!("OUT_DIR"), "/testing/samplerd.testing.v1.rs"));
    }
}

/// The encoded `FileDescriptorSet` of every proto in this crate (for
/// tonic-reflection).
pub const FILE_DESCRIPTOR_SET: &[u8] = tonic::include_file_descriptor_set!("samplerd_descriptor");

/// The canonical gRPC name of a status code, e.g. `INVALID_ARGUMENT` (tonic's
/// `Debug` gives `InvalidArgument`; metrics labels and samplerctl's messages
/// use the name other gRPC clients print).
pub fn code_name(code: Code) -> &'static str {
    match code {
        Code::Ok => "OK",
        Code::Cancelled => "CANCELLED",
        Code::Unknown => "UNKNOWN",
        Code::InvalidArgument => "INVALID_ARGUMENT",
        Code::DeadlineExceeded => "DEADLINE_EXCEEDED",
        Code::NotFound => "NOT_FOUND",
        Code::AlreadyExists => "ALREADY_EXISTS",
        Code::PermissionDenied => "PERMISSION_DENIED",
        Code::ResourceExhausted => "RESOURCE_EXHAUSTED",
        Code::FailedPrecondition => "FAILED_PRECONDITION",
        Code::Aborted => "ABORTED",
        Code::OutOfRange => "OUT_OF_RANGE",
        Code::Unimplemented => "UNIMPLEMENTED",
        Code::Internal => "INTERNAL",
        Code::Unavailable => "UNAVAILABLE",
        Code::DataLoss => "DATA_LOSS",
        Code::Unauthenticated => "UNAUTHENTICATED",
    }
}
