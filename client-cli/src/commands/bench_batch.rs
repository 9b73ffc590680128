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
    SampleBatchStreamRequest, SamplingParams, SparseLogits,
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

/// A row (f32 LE bytes) as a sparse row: its `n` largest logits, ids
/// ascending, and the log-sum-exp of the others in f64 — what the client
/// kits' sparse-row helpers send.
fn sparse_row(f32le: &[u8], n: usize) -> SparseLogits {
    let values: Vec<f32> = f32le
        .chunks_exact(4)
        .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
        .collect();
    let n = n.clamp(1, values.len());
    let mut order: Vec<u32> = (0..values.len() as u32).collect();
    order.select_nth_unstable_by(n - 1, |&a, &b| {
        values[b as usize].total_cmp(&values[a as usize])
    });
    let mut ids = order[..n].to_vec();
    ids.sort_unstable();
    let rest: Vec<f64> = order[n..]
        .iter()
        .map(|&i| f64::from(values[i as usize]))
        .collect();
    let max = rest.iter().copied().fold(f64::NEG_INFINITY, f64::max);
    let rest_logsumexp = if max == f64::NEG_INFINITY {
        max
    } else {
        max + rest.iter().map(|x| (x - max).exp()).sum::<f64>().ln()
    };
    SparseLogits {
        values: ids.iter().map(|&i| values[i as usize]).collect(),
        ids,
        rest_logsumexp,
        vocab_size: values.len() as u32,
    }
}

/// One row's logits per sequence of the worker (each different, so no
/// row is a copy of another): bytes in the wire dtype, or (`--sparse N`)
/// empty bytes and the sparse row.
fn rows_logits(id: u32, args: &BenchArgs) -> Vec<(Bytes, Option<SparseLogits>)> {
    (0..args.batch)
        .map(|r| {
            let seed = u64::from(id) * 1_000_003 + u64::from(r) + 1;
            let row = random_logits(args.vocab as usize, seed);
            match args.sparse {
                0 => (encode(&row, args.dtype), None),
                n => (Bytes::new(), Some(sparse_row(&row, n as usize))),
            }
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
                        .map(|(i, (l, sparse))| BatchStreamRow {
                            sequence_id: i as u64,
                            logits: l.clone(),
                            sparse: sparse.clone(),
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
                        .map(|(l, sparse)| BatchRow {
                            logits: l.clone(),
                            sparse: sparse.clone(),
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_sparse_row_is_the_top_n_and_the_rest_as_a_log_sum_exp() {
        let row: Vec<u8> = [0.5f32, 3.0, f32::NEG_INFINITY, 2.0, 1.0]
            .iter()
            .flat_map(|v| v.to_le_bytes())
            .collect();
        let s = sparse_row(&row, 2);
        assert_eq!(
            (s.ids, s.values, s.vocab_size),
            (vec![1, 3], vec![3.0, 2.0], 5)
        );
        let want = (0.5f64.exp() + 1f64.exp()).ln();
        assert!(
            (s.rest_logsumexp - want).abs() < 1e-12,
            "{}",
            s.rest_logsumexp
        );
        assert_eq!(sparse_row(&row[..8], 2).rest_logsumexp, f64::NEG_INFINITY);
    }
}
