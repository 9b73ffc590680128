//! Compiles `proto/` with tonic-prost-build, using the protoc shipped by
//! `protoc-bin-vendored` (a fresh machine needs no system protoc), and
//! writes the file descriptor set that server reflection serves.

use std::path::PathBuf;

/// The public API (served, and listed by reflection).
const API_PROTOS: &[&str] = &["proto/samplerd/v1/sampler.proto"];
/// Test-only services (benchmarks); kept out of the reflection descriptors.
const TESTING_PROTOS: &[&str] = &["proto/samplerd/testing/v1/noop.proto"];
/// Include root for imports.
const PROTO_ROOT: &str = "proto";
/// File name of the descriptor set inside OUT_DIR.
const DESCRIPTOR_FILE: &str = "samplerd_descriptor.bin";

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let protoc = protoc_bin_vendored::protoc_bin_path()?;
    // SAFETY: build scripts are single-threaded; nothing else reads the
    // environment concurrently.
    unsafe { std::env::set_var("PROTOC", protoc) };

    let out_dir = PathBuf::from(std::env::var("OUT_DIR")?);
    tonic_prost_build::configure()
        .file_descriptor_set_path(out_dir.join(DESCRIPTOR_FILE))
        // `logits_f32le` decodes into `bytes::Bytes` (no copy into a Vec).
        .bytes(".samplerd.v1.SampleRequest.logits_f32le")
        .bytes(".samplerd.v1.SampleStreamRequest.logits_f32le")
        .bytes(".samplerd.v1.BatchRow.logits")
        .bytes(".samplerd.v1.BatchStreamRow.logits")
        .bytes(".samplerd.v1.VerifyRow.logits")
        .compile_protos(API_PROTOS, &[PROTO_ROOT])?;
    // Own out dir: this run also emits (extern-path'd) samplerd.v1 code,
    // which must not overwrite the real one.
    let testing_out = out_dir.join("testing");
    std::fs::create_dir_all(&testing_out)?;
    tonic_prost_build::configure()
        .out_dir(testing_out)
        .extern_path(".samplerd.v1", "crate::v1")
        .compile_protos(TESTING_PROTOS, &[PROTO_ROOT])?;
    println!("cargo:rerun-if-changed={PROTO_ROOT}");
    Ok(())
}
