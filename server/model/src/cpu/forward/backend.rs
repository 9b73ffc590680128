//! [`CpuBackend`]: the weights, thread pool and arithmetic order a CPU step runs with.

use std::sync::{Arc, Mutex};

use super::scratch::Scratch;
use crate::ggml::Flavor;
use crate::gguf::{Config, Weights};
use crate::pool::ThreadPool;

/// The CPU backend: shared weights plus the thread pool.
#[derive(Debug)]
pub struct CpuBackend {
    pub(super) config: Config,
    pub(super) weights: Arc<Weights>,
    pub(super) pool: ThreadPool,
    /// Whose arithmetic order (`model.numerics`).
    pub(super) flavor: Flavor,
    /// Scratch of batched steps (sized for the largest batch seen).
    pub(super) batch_scratch: Mutex<Scratch>,
}

/// Steps with at least this many rows run their per-row work (norms,
/// activation quantisation, SwiGLU, residual adds) over the pool; a decode
/// step's few rows are cheaper on one thread than the hand-off.
pub(super) const PAR_MIN_ROWS: usize = 16;

impl CpuBackend {
    pub fn new(config: Config, weights: Arc<Weights>, n_threads: usize, flavor: Flavor) -> Self {
        CpuBackend {
            config,
            weights,
            pool: ThreadPool::new(n_threads),
            flavor,
            batch_scratch: Mutex::new(Scratch::default()),
        }
    }

    pub fn n_threads(&self) -> usize {
        self.pool.n_threads()
    }
}
