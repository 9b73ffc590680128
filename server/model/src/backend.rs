//! The device seam: the [`Backend`] and [`SequenceState`] traits every backend implements.
//!
//! A [`Backend`] runs the forward pass for one sequence's [`SequenceState`]
//! (its KV cache and scratch), or one decode step for several sequences at
//! once ([`Backend::forward_batch`], so the weights are read once per step
//! rather than once per sequence); and the input checks every backend makes
//! alike. The CPU backend (`cpu::CpuBackend`) and the CUDA one
//! (`cuda::CudaBackend`) implement the two traits.

#![forbid(unsafe_code)]

use crate::error::ModelError;
use std::any::Any;

/// Per-sequence state owned by a session: KV cache (allocated once, for the
/// session's whole context) plus the backend's scratch buffers.
pub trait SequenceState: Send + Any {
    /// Tokens already in the cache (the position of the next token).
    fn position(&self) -> usize;
    /// Most tokens the cache holds.
    fn capacity(&self) -> usize;
    /// Forgets every position at or after `position` (for prompt-cache reuse).
    fn truncate(&mut self, position: usize);
    /// Frees scratch buffers sized by the steps that ran (the cache stays):
    /// a state kept idle for later reuse holds only its K/V.
    fn release_scratch(&mut self) {}
    fn as_any_mut(&mut self) -> &mut dyn Any;
}

/// A forward-pass implementation over shared, read-only weights.
pub trait Backend: Send + Sync + std::fmt::Debug {
    /// "cpu-avx2", "cpu-scalar", "cuda"…
    fn name(&self) -> String;
    /// A fresh sequence with room for `capacity` tokens. Fails when its
    /// cache cannot be allocated (the CUDA backend: device memory exhausted),
    /// so the caller learns it before the first forward pass.
    fn new_state(&self, capacity: usize) -> Result<Box<dyn SequenceState>, ModelError>;
    /// Runs `tokens` at positions `state.position()..`, appends them to the
    /// cache and writes the last token's logits into `logits` (`n_vocab`).
    fn forward(
        &self,
        state: &mut dyn SequenceState,
        tokens: &[u32],
        logits: &mut [f32],
    ) -> Result<(), ModelError>;

    /// A new sequence holding a copy of `state`'s cache (its positions,
    /// with the same capacity): the start of each of several continuations
    /// of one prefilled prompt, whose decode steps then read the very bits
    /// the prefill wrote. `None` where the backend cannot copy a cache (the
    /// caller prefills each continuation instead, to the same bits).
    fn fork_state(
        &self,
        _state: &mut dyn SequenceState,
    ) -> Option<Result<Box<dyn SequenceState>, ModelError>> {
        None
    }

    /// One decode step for several sequences: runs `tokens[i]` on
    /// `states[i]` and writes its logits into `logits[i]`. Results must equal
    /// `forward` on each sequence alone (bit for bit). The default loops over
    /// [`Backend::forward`] (an error may leave the sequences before the
    /// failing one advanced); backends override it to share the weight reads
    /// between the sequences (the CPU backend checks every sequence first and
    /// runs nothing on error).
    fn forward_batch(
        &self,
        states: &mut [&mut dyn SequenceState],
        tokens: &[u32],
        logits: &mut [&mut [f32]],
    ) -> Result<(), ModelError> {
        for (st, tok, l) in batch_rows(states, tokens, logits)? {
            self.forward(st, std::slice::from_ref(tok), l)?;
        }
        Ok(())
    }

    /// Whether [`Backend::forward_batch_prefixed`] runs a prefix where the
    /// logits are (the CUDA backend), rather than returning rows dense.
    fn runs_device_prefix(&self) -> bool {
        false
    }

    /// One decode step for several sequences, each row coming back either
    /// dense or as the survivors of a device sampling prefix:
    /// `rows[i].prefix` asks for the prefix of row `i` (None: dense), and
    /// `rows[i].out` says what came back. A dense row's logits are in
    /// `logits[i]`; a row with [`RowOutcome::Survivors`] leaves `logits[i]`
    /// as it was (stale). Results must equal [`Backend::forward_batch`]
    /// (and the CPU sampling stages the prefix stands for) bit for bit. The
    /// default runs `forward_batch` and returns every row dense: the CPU
    /// backend has the logits in memory already, a prefix would save it
    /// nothing.
    fn forward_batch_prefixed(
        &self,
        states: &mut [&mut dyn SequenceState],
        tokens: &[u32],
        logits: &mut [&mut [f32]],
        rows: &mut [PrefixRow<'_>],
    ) -> Result<(), ModelError> {
        check_prefix_rows(states.len(), rows.len())?;
        self.forward_batch(states, tokens, logits)?;
        for r in rows.iter_mut() {
            r.out.outcome = RowOutcome::Dense;
        }
        Ok(())
    }

    /// Runs `tokens[i]` on `states[i]` as consecutive decode steps — every
    /// row in the arithmetic order of a one-token step — and writes every
    /// row's logits into `logits[i]` (`tokens[i].len() × n_vocab`; row `j`:
    /// the logits after token `j`). This is the verify pass of speculative
    /// decoding: a token and its drafts scored in one pass. Results must
    /// equal one [`Backend::forward`] call per token, bit for bit, so a
    /// verified run is the run decoded one token at a time. The default is
    /// that loop (an error may leave a sequence part-advanced); the CPU
    /// backend overrides it to run every row of every sequence in one step,
    /// reading each weight once, and checks everything first.
    fn forward_rows(
        &self,
        states: &mut [&mut dyn SequenceState],
        tokens: &[&[u32]],
        logits: &mut [&mut [f32]],
    ) -> Result<(), ModelError> {
        check_batch_shape(states.len(), tokens.len(), logits.len())?;
        for ((st, toks), l) in states.iter_mut().zip(tokens).zip(logits.iter_mut()) {
            let n_vocab = rows_vocab(toks.len(), l.len())?;
            for (t, row) in toks.iter().zip(l.chunks_exact_mut(n_vocab)) {
                self.forward(&mut **st, std::slice::from_ref(t), row)?;
            }
        }
        Ok(())
    }
}

/// The vocabulary size a rows buffer of `len` values implies for `n_rows`
/// rows (an error when there are no rows or they do not divide it).
pub fn rows_vocab(n_rows: usize, len: usize) -> Result<usize, ModelError> {
    if n_rows == 0 {
        return Err(ModelError::EmptyInput);
    }
    if len == 0 || !len.is_multiple_of(n_rows) {
        return Err(ModelError::Backend(format!(
            "a logits buffer of {len} entries does not hold {n_rows} rows"
        )));
    }
    Ok(len / n_rows)
}

/// A batch needs one token and one logits buffer per sequence.
pub fn check_batch_shape(states: usize, tokens: usize, logits: usize) -> Result<(), ModelError> {
    if states == 0 {
        return Err(ModelError::EmptyInput);
    }
    if tokens != states || logits != states {
        return Err(ModelError::Backend(format!(
            "a batch of {states} sequences got {tokens} tokens and {logits} logits buffers"
        )));
    }
    Ok(())
}

/// A batch's sequences with their token and logits buffer, once
/// [`check_batch_shape`] has passed.
pub fn batch_rows<'b>(
    states: &'b mut [&mut dyn SequenceState],
    tokens: &'b [u32],
    logits: &'b mut [&mut [f32]],
) -> Result<impl Iterator<Item = (&'b mut dyn SequenceState, &'b u32, &'b mut [f32])>, ModelError> {
    check_batch_shape(states.len(), tokens.len(), logits.len())?;
    Ok(states
        .iter_mut()
        .zip(tokens)
        .zip(logits.iter_mut())
        .map(|((st, tok), l)| (&mut **st, tok, &mut **l)))
}

/// `state` as a backend's own state type `T` (`backend` names the backend
/// in the error when another one created the state).
pub fn downcast_state<'a, T: SequenceState>(
    state: &'a mut dyn SequenceState,
    backend: &str,
) -> Result<&'a mut T, ModelError> {
    state.as_any_mut().downcast_mut::<T>().ok_or_else(|| {
        ModelError::Backend(format!(
            "sequence state was not created by the {backend} backend"
        ))
    })
}

/// The input checks every backend makes before a forward pass (the same
/// errors): some tokens, room for them in a cache of `capacity` positions
/// after `position`, and ids inside the vocabulary.
pub fn check_tokens(
    position: usize,
    capacity: usize,
    tokens: &[u32],
    n_vocab: usize,
) -> Result<(), ModelError> {
    let n = tokens.len();
    if n == 0 {
        return Err(ModelError::EmptyInput);
    }
    if position + n > capacity {
        return Err(ModelError::ContextFull {
            position,
            n_tokens: n,
            capacity,
        });
    }
    if let Some(&id) = tokens.iter().find(|&&t| t as usize >= n_vocab) {
        return Err(ModelError::TokenOutOfRange { id, n_vocab });
    }
    Ok(())
}

/// A logits buffer holds one value per vocabulary entry.
pub fn check_logits(len: usize, n_vocab: usize) -> Result<(), ModelError> {
    if len != n_vocab {
        return Err(ModelError::Backend(format!(
            "logits buffer has {len} entries, vocabulary {n_vocab}"
        )));
    }
    Ok(())
}

/// One stage of a device sampling prefix with its per-step data: what the
/// sampling crate's `device_prefix` plans (logit bias, penalties,
/// temperature, then top-k), as the backend runs it.
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
    /// Keeps the k best, sorted descending, ties by lower id; ends the
    /// prefix.
    TopK(usize),
}

/// One row of [`Backend::forward_batch_prefixed`]: the prefix asked for and
/// what came back.
#[derive(Debug)]
pub struct PrefixRow<'a> {
    /// The prefix to run over the row's logits (its last op a
    /// [`DeviceOp::TopK`]); None: the row comes back dense.
    pub prefix: Option<&'a [DeviceOp<'a>]>,
    pub out: &'a mut PrefixOutput,
}

/// How a row of a prefixed decode step came back.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum RowOutcome {
    /// The dense logits (no prefix asked, or a backend without one).
    #[default]
    Dense,
    /// The prefix's survivors ([`PrefixOutput::survivors`]); the dense
    /// logits were not copied.
    Survivors,
    /// The prefix was asked for but the row's logits are ones the CPU
    /// chain must see (NaN, +inf, nothing finite, or nothing finite left
    /// after the prefix): the dense logits were copied instead, so the
    /// host gives the exact error or outcome.
    Fallback,
}

/// One survivor of a device sampling prefix.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Survivor {
    pub id: u32,
    /// The logit after the prefix's stages.
    pub logit: f32,
    /// The raw logit (the model's, before any stage): for `logprob`.
    pub raw: f32,
}

/// What a prefixed row left for the host.
#[derive(Clone, Debug, Default)]
pub struct PrefixOutput {
    pub outcome: RowOutcome,
    /// With [`RowOutcome::Survivors`]: the survivors, sorted by their
    /// logit descending, ties by lower id (the CPU top-k's order).
    pub survivors: Vec<Survivor>,
    /// With [`RowOutcome::Survivors`]: log Σ exp(raw logits) of the whole
    /// row, bit for bit the host's fused scan (`samplerd_numerics::lse`).
    pub raw_lse: f32,
    /// Bytes the row's result took from the device to the host.
    pub d2h_bytes: usize,
}

/// One stage of a [`DevicePrefix`] (owned: a session carries it to its
/// next decode step).
#[derive(Clone, Debug, PartialEq)]
pub enum PrefixStage {
    /// [`DeviceOp::LogitBias`]'s data.
    LogitBias {
        ids: Vec<u32>,
        bias: Vec<f32>,
        starts: Vec<i32>,
    },
    /// [`DeviceOp::Penalties`] over [`DevicePrefix`]'s window.
    Penalties {
        repeat: f32,
        frequency: f32,
        presence: f32,
    },
    Temperature(f32),
    TopK(usize),
}

/// A device sampling prefix for one decode step: its stages and the
/// penalty window's distinct ids with their counts at this step.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct DevicePrefix {
    pub stages: Vec<PrefixStage>,
    pub window_ids: Vec<u32>,
    pub window_counts: Vec<u32>,
}

impl DevicePrefix {
    /// The stages as the backend's ops.
    pub fn ops(&self) -> Vec<DeviceOp<'_>> {
        self.stages
            .iter()
            .map(|s| match s {
                PrefixStage::LogitBias { ids, bias, starts } => {
                    DeviceOp::LogitBias { ids, bias, starts }
                }
                PrefixStage::Penalties {
                    repeat,
                    frequency,
                    presence,
                } => DeviceOp::Penalties {
                    ids: &self.window_ids,
                    counts: &self.window_counts,
                    repeat: *repeat,
                    frequency: *frequency,
                    presence: *presence,
                },
                PrefixStage::Temperature(t) => DeviceOp::Temperature(*t),
                PrefixStage::TopK(k) => DeviceOp::TopK(*k),
            })
            .collect()
    }
}

/// A prefixed batch step's rows: one per sequence.
pub(crate) fn check_prefix_rows(states: usize, rows: usize) -> Result<(), ModelError> {
    if rows != states {
        return Err(ModelError::Backend(format!(
            "a batch of {states} sequences got {rows} prefix rows"
        )));
    }
    Ok(())
}
