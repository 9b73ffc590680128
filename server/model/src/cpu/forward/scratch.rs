//! The CPU forward pass's scratch: every per-step buffer, sized for the largest step seen.
//!
//! Kept across steps (a session's own, or the backend's for batched steps).

use std::sync::Mutex;

use crate::gguf::{Config, Weights};
use crate::quant::{BlockQ8_1, BlockQ8K, QK};

#[derive(Default)]
pub(super) struct Scratch {
    pub(super) n_tok: usize,
    pub(super) x: Vec<f32>,
    pub(super) xn: Vec<f32>,
    pub(super) xq: Vec<BlockQ8_1>,
    pub(super) qkv: Vec<f32>,
    pub(super) attn: Vec<f32>,
    pub(super) attnq: Vec<BlockQ8_1>,
    pub(super) proj: Vec<f32>,
    pub(super) gu: Vec<f32>,
    pub(super) act: Vec<f32>,
    pub(super) actq: Vec<BlockQ8_1>,
    /// Q8_K copies of `xq` / `attnq` / `actq` / `lastq`, filled only for
    /// products with K-quant weights (sized on first use).
    pub(super) xqk: Vec<BlockQ8K>,
    pub(super) attnqk: Vec<BlockQ8K>,
    pub(super) actqk: Vec<BlockQ8K>,
    pub(super) lastqk: Vec<BlockQ8K>,
    pub(super) rope: Vec<(f32, f32)>,
    /// Per pool thread: attention scratch (lane accumulators, a group's
    /// queries, their scores).
    pub(super) per_thread: Vec<Mutex<Vec<f32>>>,
    /// Capacity (positions) `per_thread` is sized for.
    pub(super) per_thread_cap: usize,
    /// A batch's last rows, normalised and quantised for the output product.
    pub(super) lastq: Vec<BlockQ8_1>,
    /// A batch's logits before they are copied to each sequence.
    pub(super) logits: Vec<f32>,
}

impl std::fmt::Debug for Scratch {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Scratch")
            .field("n_tok", &self.n_tok)
            .finish()
    }
}

impl Scratch {
    /// Sizes the buffers for a step of `n` rows of a model of `c` and `w`
    /// over caches of up to `capacity` positions (attention scratch for
    /// each of the pool's `n_threads`).
    pub(super) fn ensure(
        &mut self,
        c: &Config,
        w: &Weights,
        n_threads: usize,
        n: usize,
        capacity: usize,
    ) {
        let s = self;
        if s.per_thread.len() != n_threads || s.per_thread_cap < capacity {
            let rep = c.n_head / c.n_head_kv;
            let per = 64 * c.head_dim + rep * c.head_dim + rep * capacity.div_ceil(16) * 16;
            s.per_thread = (0..n_threads)
                .map(|_| Mutex::new(vec![0f32; per]))
                .collect();
            s.per_thread_cap = capacity;
            s.rope = vec![(0.0, 0.0); c.rope_dim / 2];
        }
        if s.n_tok >= n {
            return;
        }
        let d = c.n_embd;
        let qkv = w.layers.first().map(|l| l.wqkv.rows()).unwrap_or(0);
        let gu = w.layers.first().map(|l| l.wgu.rows()).unwrap_or(0);
        s.n_tok = n;
        s.x.resize(n * d, 0.0);
        s.xn.resize(n * d, 0.0);
        s.xq.resize(n * d / QK, BlockQ8_1::default());
        s.qkv.resize(n * qkv, 0.0);
        s.attn.resize(n * c.q_dim(), 0.0);
        s.attnq.resize(n * c.q_dim() / QK, BlockQ8_1::default());
        s.proj.resize(n * d, 0.0);
        s.gu.resize(n * gu, 0.0);
        s.act.resize(n * c.n_ff, 0.0);
        s.actq.resize(n * c.n_ff / QK, BlockQ8_1::default());
    }
}
