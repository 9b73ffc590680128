//! samplerd-api: the Rust types and tonic stubs generated from
//! `proto/samplerd/v1/sampler.proto`, shared by the server and samplerctl.
//!
//! - [`v1`]: the public `samplerd.v1` service (`Sampler`) and its messages.
//! - [`testing::v1`]: test-only services (the `Noop` transport floor used by
//!   the benchmarks); never served by `samplerd serve`.
//! - [`FILE_DESCRIPTOR_SET`]: the encoded descriptors, for server reflection.

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
