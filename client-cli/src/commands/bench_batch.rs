//! The batch RPCs of `samplerctl bench`: `SampleBatch` (`--batch` rows per
//! call) and `SampleBatchStream` (one stream of `--batch` sequences per
//! worker; a request is one message with a row for each). A request's
//! tokens are its rows, so tokens/s here compares with
//! `--rpc sample-stream --concurrency B` (B streams, one token each per
//! request) — the comparison an inference engine decoding B sequences per
//! step makes.

use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::Instant;

use half::{bf16, f16};
use samplerd_api::v1::{
    BatchRow, BatchStreamRow, LogitsDtype, SampleBatchRequest, SampleBatchResponse,
    SampleBatchStreamRequest, SamplingParams,
};
use tonic::codegen::Bytes;

use super::bench_worker::{OpenStream, Shared, WorkerStats, random_logits, stream_step};
use crate::cli::{BenchArgs, BenchRpc, WireDtype};
use crate::connect::Sampler;

/// `logits` (random f32 LE bytes) in the wire dtype.
fn encode(f32le: &[u8], dtype: WireDtype) -> Bytes {
    let values = f32le
        .chunks_exact(4)
        .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]));
    match dtype {
        WireDtype::F32 => Bytes::copy_from_slice(f32le),
        WireDtype::F16 => values
            .flat_map(|v| f16::from_f32(v).to_le_bytes())
            .collect::<Vec<u8>>()
            .into(),
        WireDtype::Bf16 => values
            .flat_map(|v| bf16::from_f32(v).to_le_bytes())
            .collect::<Vec<u8>>()
            .into(),
    }
}

fn proto_dtype(dtype: WireDtype) -> i32 {
    (match dtype {
        WireDtype::F32 => LogitsDtype::F32le,
        WireDtype::F16 => LogitsDtype::F16le,
        WireDtype::Bf16 => LogitsDtype::Bf16le,
    }) as i32
}

/// One row's logits per sequence of the worker (each different, so no
/// row is a copy of another).
fn rows_logits(id: u32, args: &BenchArgs) -> Vec<Bytes> {
    (0..args.batch)
        .map(|r| {
            let seed = u64::from(id) * 1_000_003 + u64::from(r) + 1;
            encode(&random_logits(args.vocab as usize, seed), args.dtype)
        })
        .collect()
}

/// A worker of either batch RPC.
pub(super) async fn worker(
    id: u32,
    mut client: Sampler,
    args: Arc<(BenchArgs, SamplingParams)>,
    shared: Arc<Shared>,
) -> WorkerStats {
    let (args, params) = &*args;
    let logits = rows_logits(id, args);
    let mut stats = WorkerStats::default();
    let mut open: Option<OpenStream<SampleBatchStreamRequest, SampleBatchResponse>> = None;
    while let Some(n) = shared.next() {
        let t0 = Instant::now();
        let result = match args.rpc {
            BenchRpc::SampleBatchStream => {
                let joining = open.is_none();
                let msg = SampleBatchStreamRequest {
                    rows: logits
                        .iter()
                        .enumerate()
                        .map(|(i, l)| BatchStreamRow {
                            sequence_id: i as u64,
                            logits: l.clone(),
                            ..Default::default()
                        })
                        .collect(),
                    dtype: proto_dtype(args.dtype),
                    // The first message's rows join with these parameters.
                    params: joining.then(|| params.clone()),
                    ..Default::default()
                };
                stream_step(&mut open, msg, |rx| client.sample_batch_stream(rx)).await
            }
            _ => client
                .sample_batch(SampleBatchRequest {
                    rows: logits
                        .iter()
                        .map(|l| BatchRow {
                            logits: l.clone(),
                            step: n,
                            ..Default::default()
                        })
                        .collect(),
                    dtype: proto_dtype(args.dtype),
                    params: Some(params.clone()),
                    ..Default::default()
                })
                .await
                .map(|r| r.into_inner()),
        };
        let tokens = result.map(|resp| resp.rows.len() as u64);
        if !stats.record(t0.elapsed().as_micros() as u64, tokens) {
            open = None;
        }
        shared.done.fetch_add(1, Ordering::Relaxed);
    }
    stats
}
