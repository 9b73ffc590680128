//! samplerd-api: the Rust types and tonic stubs generated from
//! `proto/samplerd/v1/sampler.proto`, shared by the server and samplerctl.
