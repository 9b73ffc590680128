//! The device sampling prefix: logit bias, penalties, temperature and top-k on the GPU.
//!
//! The device sampling prefix: logit bias, penalties, temperature and top-k
//! run over a working copy of a sequence's logits ([`DeviceOp`]), so only
//! the k survivors are copied to the host; and replacing the device logits
//! (tests).

use std::sync::Arc;
use std::time::Instant;

use cudarc::driver::{CudaSlice, CudaStream, DeviceRepr, ValidAsZeroBits};

use super::backend::CudaBackend;
use super::err::err;
use super::kernels::{self, Arg, cfg};
use super::state::{CudaState, SampleBuffers, alloc, dptr};
use crate::error::ModelError;

/// One stage of the device sampling prefix, with its per-step data.
#[derive(Clone, Copy, Debug)]
pub enum DeviceOp<'a> {
    /// Adds `bias[e]` to `logits[ids[e]]`; entries `starts[r]..starts[r+1]`
    /// share one id and are added in that order.
    LogitBias {
        ids: &'a [u32],
        bias: &'a [f32],
        starts: &'a [i32],
    },
    /// Repetition penalties over the window's distinct ids and counts.
    Penalties {
        ids: &'a [u32],
        counts: &'a [u32],
        repeat: f32,
        frequency: f32,
        presence: f32,
    },
    /// Divides every logit by `t` (> 0).
    Temperature(f32),
    /// Keeps the k (1..=[`kernels::TOPK_MAX`]) best, sorted descending, ties
    /// by lower id; ends the prefix.
    TopK(usize),
}

/// What the device prefix left.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum DeviceStatus {
    /// `candidates` holds the survivors.
    Ok,
    /// A NaN or +inf logit: the caller reruns on the CPU for the exact error.
    BadLogit,
    /// No finite logit: the caller reruns on the CPU for the exact outcome.
    NoFinite,
}

impl CudaBackend {
    /// Runs the device sampling prefix `ops` (ending with [`DeviceOp::TopK`])
    /// over a working copy of the state's logits and copies only the
    /// survivors — `(id, logit)`, sorted descending, ties by lower id — into
    /// `out`. The raw logits stay untouched on the device.
    pub fn sample_prefix(
        &self,
        st: &mut CudaState,
        ops: &[DeviceOp<'_>],
        out: &mut Vec<(u32, f32)>,
    ) -> Result<DeviceStatus, ModelError> {
        let k = final_top_k(ops)?;
        let t0 = Instant::now();
        let n = st.logits.len();
        let stream = Arc::clone(&st.stream);
        let s = &stream;
        let sb = &mut st.sample;
        s.memcpy_dtod(&st.logits, &mut sb.work)
            .map_err(|e| err("copying the logits for sampling", e))?;
        let work = dptr(&sb.work, s);
        let status = dptr(&sb.status, s);
        let single = |threads| cfg((1, 1), threads, 0);
        // SAFETY: check_logits(x, n, status): work holds n floats.
        unsafe {
            kernels::launch(
                s,
                &self.kernels.check_logits,
                single(kernels::TOPK_THREADS),
                &[Arg::Ptr(work), Arg::I32(n as i32), Arg::Ptr(status)],
            )
        }
        .map_err(ModelError::Backend)?;
        for op in &ops[..ops.len() - 1] {
            self.enqueue_op(s, sb, work, n, op)?;
        }
        // SAFETY: top_k(x, n, k, status, out): work holds n floats, out
        // 2 + 2·TOPK_MAX words, 1 <= k <= TOPK_MAX (checked above).
        unsafe {
            kernels::launch(
                s,
                &self.kernels.top_k,
                single(kernels::TOPK_THREADS),
                &[
                    Arg::Ptr(work),
                    Arg::I32(n as i32),
                    Arg::I32(k as i32),
                    Arg::Ptr(status),
                    Arg::Ptr(dptr(&sb.out, s)),
                ],
            )
        }
        .map_err(ModelError::Backend)?;
        let t1 = Instant::now();
        let words = fetch_candidates(s, sb, k, n)?;
        st.d2h_bytes += (words * size_of::<u32>()) as u64;
        let status = read_candidates(&st.sample.host_out, k, out);
        let t2 = Instant::now();
        st.timing.sampling_ns += (t1 - t0).as_nanos() as u64;
        st.timing.copy_ns += (t2 - t1).as_nanos() as u64;
        Ok(status)
    }

    /// Enqueues one stage of the prefix but the last on `work` (`n`
    /// logits), uploading its data into the sampling buffers `sb`.
    fn enqueue_op(
        &self,
        s: &Arc<CudaStream>,
        sb: &mut SampleBuffers,
        work: u64,
        n: usize,
        op: &DeviceOp<'_>,
    ) -> Result<(), ModelError> {
        match *op {
            DeviceOp::LogitBias { ids, bias, starts } => {
                let runs = starts.len().saturating_sub(1);
                if runs == 0 {
                    return Ok(());
                }
                if ids.len() != bias.len() || starts[runs] as usize != ids.len() {
                    return Err(ModelError::Backend(format!(
                        "cuda: logit_bias op has {} ids, {} biases and runs ending at {}",
                        ids.len(),
                        bias.len(),
                        starts[runs]
                    )));
                }
                upload_into(s, &mut sb.ids, ids, "bias ids")?;
                let bits: Vec<u32> = bias.iter().map(|b| b.to_bits()).collect();
                upload_into(s, &mut sb.vals, &bits, "bias values")?;
                upload_into(s, &mut sb.starts, starts, "bias runs")?;
                // SAFETY: logit_bias(x, n, ids, bias, starts, n_runs):
                // ids/bias hold starts[n_runs] entries (checked above),
                // starts n_runs + 1; ids >= n are skipped by the kernel.
                unsafe {
                    kernels::launch(
                        s,
                        &self.kernels.logit_bias,
                        kernels::per_item(runs),
                        &[
                            Arg::Ptr(work),
                            Arg::I32(n as i32),
                            Arg::Ptr(dptr(&sb.ids, s)),
                            Arg::Ptr(dptr(&sb.vals, s)),
                            Arg::Ptr(dptr(&sb.starts, s)),
                            Arg::I32(runs as i32),
                        ],
                    )
                }
                .map_err(ModelError::Backend)?;
            }
            DeviceOp::Penalties {
                ids,
                counts,
                repeat,
                frequency,
                presence,
            } => {
                if ids.is_empty() {
                    return Ok(());
                }
                if ids.len() != counts.len() {
                    return Err(ModelError::Backend(format!(
                        "cuda: penalties op has {} ids and {} counts",
                        ids.len(),
                        counts.len()
                    )));
                }
                upload_into(s, &mut sb.ids, ids, "penalty ids")?;
                upload_into(s, &mut sb.vals, counts, "penalty counts")?;
                // SAFETY: penalties(x, n, ids, counts, n_ids, repeat,
                // frequency, presence): ids/counts hold n_ids entries
                // (distinct ids, so no two threads write one logit).
                unsafe {
                    kernels::launch(
                        s,
                        &self.kernels.penalties,
                        kernels::per_item(ids.len()),
                        &[
                            Arg::Ptr(work),
                            Arg::I32(n as i32),
                            Arg::Ptr(dptr(&sb.ids, s)),
                            Arg::Ptr(dptr(&sb.vals, s)),
                            Arg::I32(ids.len() as i32),
                            Arg::F32(repeat),
                            Arg::F32(frequency),
                            Arg::F32(presence),
                        ],
                    )
                }
                .map_err(ModelError::Backend)?;
            }
            DeviceOp::Temperature(t) => {
                // SAFETY: scale_temperature(x, n, t): work holds n floats.
                unsafe {
                    kernels::launch(
                        s,
                        &self.kernels.scale_temperature,
                        kernels::per_item(n),
                        &[Arg::Ptr(work), Arg::I32(n as i32), Arg::F32(t)],
                    )
                }
                .map_err(ModelError::Backend)?;
            }
            DeviceOp::TopK(_) => {
                return Err(ModelError::Backend(
                    "cuda: top_k must be the last op of a device sampling prefix".into(),
                ));
            }
        }
        Ok(())
    }

    /// Replaces the state's device logits with `logits` (any length: the
    /// device sampling tests use other vocabularies than the model's). A
    /// later forward pass writes the model's `n_vocab` logits at the front.
    pub fn set_logits(&self, st: &mut CudaState, logits: &[f32]) -> Result<(), ModelError> {
        let n = logits.len().max(self.config.n_vocab);
        if st.logits.len() != n {
            st.logits = alloc(&st.stream, n, "logits")?;
            st.sample.work = alloc(&st.stream, n, "sampling logits")?;
            // The decode graph wrote into the old buffer.
            st.graph = None;
        }
        let mut view = st.logits.slice_mut(0..logits.len());
        st.stream
            .memcpy_htod(logits, &mut view)
            .map_err(|e| err("uploading logits", e))?;
        if logits.len() < n {
            // Entries past `logits` would be sampled too: mask them.
            let pad = vec![f32::NEG_INFINITY; n - logits.len()];
            let mut rest = st.logits.slice_mut(logits.len()..n);
            st.stream
                .memcpy_htod(&pad[..], &mut rest)
                .map_err(|e| err("uploading logits", e))?;
        }
        Ok(())
    }
}

/// Copies `src` into the front of `dst`, growing it (doubling) when short.
fn upload_into<T: DeviceRepr + ValidAsZeroBits + Copy>(
    s: &Arc<CudaStream>,
    dst: &mut CudaSlice<T>,
    src: &[T],
    what: &str,
) -> Result<(), ModelError> {
    if dst.len() < src.len() {
        *dst = alloc(s, src.len().next_power_of_two(), what)?;
    }
    let mut view = dst.slice_mut(0..src.len());
    s.memcpy_htod(src, &mut view)
        .map_err(|e| err(&format!("uploading {what}"), e))
}

/// The k of the prefix's last stage, which must be [`DeviceOp::TopK`] with
/// 1 <= k <= [`kernels::TOPK_MAX`].
fn final_top_k(ops: &[DeviceOp<'_>]) -> Result<usize, ModelError> {
    let Some(DeviceOp::TopK(k)) = ops.last() else {
        return Err(ModelError::Backend(
            "cuda: a device sampling prefix must end with top_k".into(),
        ));
    };
    let k = *k;
    if !(1..=kernels::TOPK_MAX).contains(&k) {
        return Err(ModelError::Backend(format!(
            "cuda: device top_k needs 1 <= k <= {}, got {k}",
            kernels::TOPK_MAX
        )));
    }
    Ok(k)
}

/// Copies top_k's status word, count and up to `k` (of `n`) candidates to
/// the host buffer and waits for them; returns the words copied.
fn fetch_candidates(
    s: &Arc<CudaStream>,
    sb: &mut SampleBuffers,
    k: usize,
    n: usize,
) -> Result<usize, ModelError> {
    let words = 2 + 2 * k.min(n);
    let view = sb.out.slice(0..words);
    s.memcpy_dtoh(&view, &mut sb.host_out[..words])
        .map_err(|e| err("copying the candidates", e))?;
    s.synchronize().map_err(|e| err("device sampling", e))?;
    Ok(words)
}

/// The status top_k wrote in `h` and, when it is [`DeviceStatus::Ok`], its
/// candidates into `out`.
fn read_candidates(h: &[u32], k: usize, out: &mut Vec<(u32, f32)>) -> DeviceStatus {
    let status = match h[0] {
        0 => DeviceStatus::Ok,
        1 => DeviceStatus::BadLogit,
        _ => DeviceStatus::NoFinite,
    };
    out.clear();
    if status == DeviceStatus::Ok {
        let count = (h[1] as usize).min(k);
        out.extend((0..count).map(|i| (h[2 + 2 * i], f32::from_bits(h[3 + 2 * i]))));
    }
    status
}
