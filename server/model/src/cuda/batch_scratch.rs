//! The batched decode step's device memory and counters, kept by the
//! backend between steps (the step itself: `batch`).

use std::sync::Arc;

use cudarc::driver::{CudaEvent, CudaSlice, CudaStream};

use super::state::Scratch;

/// What the batched steps have done so far (tests and diagnostics).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct BatchStats {
    /// Batched passes run (steps of two or more sequences).
    pub passes: u64,
    /// Rows (sequence steps) those passes ran.
    pub rows: u64,
    /// The most rows one pass ran.
    pub largest: usize,
}

/// The backend's batched-step state: the scratch (once a batch has run)
/// and the counters.
#[derive(Default)]
pub(super) struct Batcher {
    pub(super) scratch: Option<BatchScratch>,
    pub(super) stats: BatchStats,
}

/// Device memory and stream of the batched step, sized for `rows` rows.
pub(super) struct BatchScratch {
    pub(super) stream: Arc<CudaStream>,
    pub(super) rows: usize,
    /// Per-token scratch for `rows` tokens.
    pub(super) scratch: Scratch,
    /// The rows' descriptors (`rows × batch::ROW_WORDS` words).
    pub(super) desc: CudaSlice<u64>,
    /// The rows' logits before they are copied out (`rows × n_vocab`).
    pub(super) logits: CudaSlice<f32>,
    /// One per row: its sequence's stream up to the step.
    pub(super) ready: Vec<CudaEvent>,
    /// The step's end, waited for by every row's sequence stream.
    pub(super) done: CudaEvent,
    /// The descriptors as uploaded (reused).
    pub(super) host_desc: Vec<u64>,
}
