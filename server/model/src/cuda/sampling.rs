//! The device sampling prefix: logit bias, penalties, temperature and top-k on the GPU.
//!
//! The device sampling prefix: logit bias, penalties, temperature and
//! top-k run over a working copy of a sequence's logits ([`DeviceOp`]), so
//! only the k survivors — with their raw logits and the raw row's
//! log-sum-exp in the host scan's pieces — are copied to the host; the
//! decode step whose rows come back that way
//! ([`Backend::forward_batch_prefixed`](crate::backend::Backend::forward_batch_prefixed));
//! and replacing the device logits (tests).

use std::sync::Arc;
use std::time::Instant;

use cudarc::driver::{CudaSlice, CudaStream, DeviceRepr, ValidAsZeroBits};
use samplerd_numerics::lse::{CHUNK, PartialLse};

use super::backend::CudaBackend;
use super::err::err;
use super::kernels::{self, Arg, cfg};
use super::state::{CudaState, SampleBuffers, alloc, dptr};
pub use crate::backend::DeviceOp;
use crate::backend::{
    PrefixOutput, PrefixRow, RowOutcome, SequenceState, Survivor, batch_rows, check_logits,
    downcast_state,
};
use crate::error::ModelError;

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

/// Which top-k kernel ends the prefix: the same result either way.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum TopK {
    /// One block over the whole vocabulary (its other SMs idle).
    SingleBlock,
    /// Per-slice candidates on many blocks, then one merge block.
    MultiBlock,
}

/// Where a row's results sit in the sampling output buffer (u32 words):
/// `[status, count, k × (id, logit bits), k × raw logit bits, then per
/// LSE block (max bits, f64 sum low, high)]`.
#[derive(Clone, Copy, Debug)]
struct Layout {
    k: usize,
    /// LSE blocks (0: no log-sum-exp asked).
    blocks: usize,
}

impl Layout {
    fn raw(&self) -> usize {
        2 + 2 * self.k
    }
    fn lse(&self) -> usize {
        2 + 3 * self.k
    }
    fn words(&self) -> usize {
        self.lse() + 3 * self.blocks
    }
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
        self.sample_prefix_with(st, ops, TopK::MultiBlock, out)
    }

    /// [`Self::sample_prefix`] with the given top-k kernel (the
    /// single-block one is the multi-block one's reference in the tests).
    pub fn sample_prefix_with(
        &self,
        st: &mut CudaState,
        ops: &[DeviceOp<'_>],
        top_k: TopK,
        out: &mut Vec<(u32, f32)>,
    ) -> Result<DeviceStatus, ModelError> {
        let t0 = Instant::now();
        let layout = self.enqueue_prefix(st, ops, false, top_k)?;
        let t1 = Instant::now();
        let h = fetch_words(st, layout.raw())?;
        let status = read_candidates(h, layout.k, out);
        let t2 = Instant::now();
        st.timing.sampling_ns += (t1 - t0).as_nanos() as u64;
        st.timing.copy_ns += (t2 - t1).as_nanos() as u64;
        Ok(status)
    }

    /// [`Self::sample_prefix`] as a decode step of Generate takes it: the
    /// survivors with their raw logits and the raw row's log-sum-exp
    /// (`out.outcome`: [`RowOutcome::Survivors`], or
    /// [`RowOutcome::Fallback`] with nothing else filled in when the host
    /// must see the dense logits).
    pub fn sample_prefix_row(
        &self,
        st: &mut CudaState,
        ops: &[DeviceOp<'_>],
        out: &mut PrefixOutput,
    ) -> Result<(), ModelError> {
        let t0 = Instant::now();
        let layout = self.enqueue_prefix(st, ops, true, TopK::MultiBlock)?;
        let t1 = Instant::now();
        let words = layout.words();
        let n = st.logits.len();
        let h = fetch_words(st, words)?;
        read_row(h, layout, n, out);
        out.d2h_bytes = words * size_of::<u32>();
        let t2 = Instant::now();
        st.timing.sampling_ns += (t1 - t0).as_nanos() as u64;
        st.timing.copy_ns += (t2 - t1).as_nanos() as u64;
        Ok(())
    }

    /// The CUDA side of
    /// [`Backend::forward_batch_prefixed`](crate::backend::Backend::forward_batch_prefixed):
    /// every row's decode step ([`Self::enqueue_decode_batch`]), then every
    /// prefixed row's sampling kernels on its stream, all enqueued before
    /// the first wait; then per row one copy of its results (the survivors,
    /// or the dense logits) and one wait for its stream.
    pub(super) fn forward_batch_prefixed_cuda(
        &self,
        states: &mut [&mut dyn SequenceState],
        tokens: &[u32],
        logits: &mut [&mut [f32]],
        rows: &mut [PrefixRow<'_>],
    ) -> Result<(), ModelError> {
        crate::backend::check_prefix_rows(states.len(), rows.len())?;
        for (st, tok, l) in batch_rows(states, tokens, logits)? {
            self.check_input(downcast(st)?, std::slice::from_ref(tok))?;
            check_logits(l.len(), self.config.n_vocab)?;
        }
        for r in rows.iter() {
            if let Some(ops) = r.prefix {
                final_top_k(ops)?;
            }
        }
        let mut cuda = states
            .iter_mut()
            .map(|st| downcast(&mut **st))
            .collect::<Result<Vec<_>, _>>()?;
        self.enqueue_decode_batch(&mut cuda, tokens)?;
        let mut layouts = Vec::with_capacity(rows.len());
        for (st, r) in cuda.iter_mut().zip(rows.iter()) {
            layouts.push(match r.prefix {
                Some(ops) => Some(self.enqueue_prefix(st, ops, true, TopK::MultiBlock)?),
                None => None,
            });
        }
        for (((st, l), r), layout) in cuda
            .iter_mut()
            .zip(logits.iter_mut())
            .zip(rows.iter_mut())
            .zip(layouts)
        {
            let Some(layout) = layout else {
                self.copy_logits(st, l)?;
                r.out.outcome = RowOutcome::Dense;
                continue;
            };
            let t0 = Instant::now();
            let words = layout.words();
            let n = st.logits.len();
            let h = fetch_words(st, words)?;
            read_row(h, layout, n, r.out);
            r.out.d2h_bytes = words * size_of::<u32>();
            st.timing.copy_ns += t0.elapsed().as_nanos() as u64;
            if r.out.outcome == RowOutcome::Fallback {
                self.copy_logits(st, l)?;
                r.out.d2h_bytes += size_of_val(*l);
            }
        }
        Ok(())
    }

    /// Enqueues the prefix `ops` over a working copy of the state's
    /// logits: the logit check, the stages, top_k into the output buffer,
    /// the survivors' raw logits and (`lse`) the raw row's log-sum-exp
    /// blocks. Nothing is waited for.
    fn enqueue_prefix(
        &self,
        st: &mut CudaState,
        ops: &[DeviceOp<'_>],
        lse: bool,
        top_k: TopK,
    ) -> Result<Layout, ModelError> {
        let k = final_top_k(ops)?;
        let n = st.logits.len();
        let layout = Layout {
            k,
            blocks: if lse {
                n.div_ceil(kernels::LSE_BLOCK)
            } else {
                0
            },
        };
        let stream = Arc::clone(&st.stream);
        let s = &stream;
        let sb = &mut st.sample;
        if sb.out.len() < layout.words() {
            sb.out = alloc(s, layout.words(), "candidates")?;
        }
        if sb.host_out.len() < layout.words() {
            sb.host_out.resize(layout.words(), 0);
        }
        s.memcpy_dtod(&st.logits, &mut sb.work)
            .map_err(|e| err("copying the logits for sampling", e))?;
        let work = dptr(&sb.work, s);
        let raw = dptr(&st.logits, s);
        let status = dptr(&sb.status, s);
        let out = dptr(&sb.out, s);
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
        if top_k == TopK::SingleBlock {
            // SAFETY: top_k(x, n, k, status, out): work holds n floats, out
            // at least 2 + 3k words (sized above), 1 <= k <= TOPK_MAX
            // (checked).
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
                        Arg::Ptr(out),
                    ],
                )
            }
            .map_err(ModelError::Backend)?;
        } else {
            let lists = n.div_ceil(kernels::TOPK_SLICE);
            if sb.part.len() < lists * k {
                sb.part = alloc(s, lists * k, "top-k candidates")?;
            }
            let part = dptr(&sb.part, s);
            // SAFETY: top_k_partial(x, n, k, slice, status, part): work
            // holds n floats; `lists` blocks of `slice` cover them; part
            // holds lists · k items (sized above); 1 <= k <= TOPK_MAX.
            unsafe {
                kernels::launch(
                    s,
                    &self.kernels.top_k_partial,
                    cfg((lists as u32, 1), kernels::TOPK_THREADS, 0),
                    &[
                        Arg::Ptr(work),
                        Arg::I32(n as i32),
                        Arg::I32(k as i32),
                        Arg::I32(kernels::TOPK_SLICE as i32),
                        Arg::Ptr(status),
                        Arg::Ptr(part),
                    ],
                )
            }
            .map_err(ModelError::Backend)?;
            // SAFETY: top_k_merge(x, n, k, lists, status, part, out): part
            // holds lists · k items written above, out 2 + 3k words.
            unsafe {
                kernels::launch(
                    s,
                    &self.kernels.top_k_merge,
                    single(kernels::TOPK_THREADS),
                    &[
                        Arg::Ptr(work),
                        Arg::I32(n as i32),
                        Arg::I32(k as i32),
                        Arg::I32(lists as i32),
                        Arg::Ptr(status),
                        Arg::Ptr(part),
                        Arg::Ptr(out),
                    ],
                )
            }
            .map_err(ModelError::Backend)?;
        }
        // SAFETY: survivor_raw(raw, k, out): raw holds n floats and the
        // ids top_k wrote are below n; out holds 2 + 3k words.
        unsafe {
            kernels::launch(
                s,
                &self.kernels.survivor_raw,
                kernels::per_item(k),
                &[Arg::Ptr(raw), Arg::I32(k as i32), Arg::Ptr(out)],
            )
        }
        .map_err(ModelError::Backend)?;
        if layout.blocks > 0 {
            let fma = samplerd_numerics::features().isa() != samplerd_numerics::Isa::Baseline;
            // SAFETY: lse_blocks(x, n, fma, status, out): raw holds n
            // floats; out + lse() words has 3 words per block (sized above).
            unsafe {
                kernels::launch(
                    s,
                    &self.kernels.lse_blocks,
                    cfg((layout.blocks as u32, 1), kernels::LSE_LANES, 0),
                    &[
                        Arg::Ptr(raw),
                        Arg::I32(n as i32),
                        Arg::I32(fma as i32),
                        Arg::Ptr(status),
                        Arg::Ptr(out + (layout.lse() * size_of::<u32>()) as u64),
                    ],
                )
            }
            .map_err(ModelError::Backend)?;
        }
        Ok(layout)
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

/// Copies the first `words` of the state's sampling output to the host
/// and waits for them.
fn fetch_words(st: &mut CudaState, words: usize) -> Result<&[u32], ModelError> {
    let s = &st.stream;
    let sb = &mut st.sample;
    let view = sb.out.slice(0..words);
    s.memcpy_dtoh(&view, &mut sb.host_out[..words])
        .map_err(|e| err("copying the candidates", e))?;
    s.synchronize().map_err(|e| err("device sampling", e))?;
    st.d2h_bytes += (words * size_of::<u32>()) as u64;
    Ok(&st.sample.host_out[..words])
}

fn status_of(word: u32) -> DeviceStatus {
    match word {
        0 => DeviceStatus::Ok,
        1 => DeviceStatus::BadLogit,
        _ => DeviceStatus::NoFinite,
    }
}

/// The status top_k wrote in `h` and, when it is [`DeviceStatus::Ok`], its
/// candidates into `out`.
fn read_candidates(h: &[u32], k: usize, out: &mut Vec<(u32, f32)>) -> DeviceStatus {
    let status = status_of(h[0]);
    out.clear();
    if status == DeviceStatus::Ok {
        let count = (h[1] as usize).min(k);
        out.extend((0..count).map(|i| (h[2 + 2 * i], f32::from_bits(h[3 + 2 * i]))));
    }
    status
}

/// One prefixed row's results from the words `h` (`n` logits): the
/// survivors with their raw logits and the log-sum-exp merged from the
/// device's blocks as the host scan merges its own (`PartialLse`), or
/// [`RowOutcome::Fallback`] when the logits are ones only the CPU chain
/// may judge (bad, none finite, or the best survivor −∞).
fn read_row(h: &[u32], layout: Layout, n: usize, out: &mut PrefixOutput) {
    out.survivors.clear();
    let count = (h[1] as usize).min(layout.k);
    let fallback = status_of(h[0]) != DeviceStatus::Ok
        || count == 0
        || f32::from_bits(h[3]) == f32::NEG_INFINITY;
    if fallback {
        out.outcome = RowOutcome::Fallback;
        out.raw_lse = f32::NAN;
        return;
    }
    out.survivors.extend((0..count).map(|i| Survivor {
        id: h[2 + 2 * i],
        logit: f32::from_bits(h[3 + 2 * i]),
        raw: f32::from_bits(h[layout.raw() + i]),
    }));
    let blocks = &h[layout.lse()..layout.words()];
    debug_assert_eq!(blocks.len(), 3 * n.div_ceil(kernels::LSE_BLOCK));
    let per_chunk = CHUNK / kernels::LSE_BLOCK;
    let mut total = PartialLse::EMPTY;
    for chunk in blocks.chunks(3 * per_chunk) {
        let mut part = PartialLse::EMPTY;
        for b in chunk.chunks_exact(3) {
            let sum = f64::from_bits(u64::from(b[1]) | (u64::from(b[2]) << 32));
            part.add_block_with(f32::from_bits(b[0]), |_| sum);
        }
        total = total.merge(part);
    }
    out.raw_lse = total.log_sum_exp();
    out.outcome = RowOutcome::Survivors;
}

fn downcast(state: &mut dyn SequenceState) -> Result<&mut CudaState, ModelError> {
    downcast_state(state, "CUDA")
}
