//! The attention pass of a CPU step: each row's query groups over its own sequence's cache.
//!
//! Each group through `cpu::attention` from the f16 cache, spread over the
//! pool one (row, KV head) item at a time, dearest first.

use std::sync::Mutex;

use half::f16;

use super::backend::CpuBackend;
use crate::cpu::attention::{CachedHead, attention_group};

/// A read-only view of one sequence's cache for the attention pass.
pub(super) struct CacheView<'a> {
    pub(super) k: &'a [f16],
    pub(super) v: &'a [f16],
    pub(super) cap: usize,
    /// The sequence runs one token this step (llama.cpp's decode ordering).
    pub(super) decode: bool,
}

struct SyncPtr<T>(*mut T);
// SAFETY: only used to give pool threads disjoint parts of one buffer; every
// use documents why the parts are disjoint and outlive the parallel section.
unsafe impl<T> Sync for SyncPtr<T> {}

impl CpuBackend {
    /// Attention of every row of the step over its own sequence's cache;
    /// parallel over (row, kv head).
    pub(super) fn attention(
        &self,
        layer: usize,
        rows: &[(usize, usize)],
        views: &[CacheView<'_>],
        qkv: &[f32],
        per_thread: &[Mutex<Vec<f32>>],
        out: &mut [f32],
    ) {
        let c = &self.config;
        let (dq, hd, n_kv) = (c.q_dim(), c.head_dim, c.n_head_kv);
        let rep = c.n_head / n_kv;
        let qkv_rows = dq + 2 * n_kv * hd;
        let scale = 1.0 / (hd as f32).sqrt();
        let out_ptr = SyncPtr(out.as_mut_ptr());
        let items = rows.len() * n_kv;
        // Items (token, kv head) cost in proportion to the token's position,
        // so a prompt's even split by count left one thread the cheap early
        // tokens and the other the dear late ones (the cheap one then waited
        // for half the attention time). Threads instead take items one at a
        // time, dearest (latest rows) first.
        let next = std::sync::atomic::AtomicUsize::new(0);
        self.pool.run(&|i, _| {
            let out_ptr = &out_ptr;
            let mut buf = per_thread[i].lock().unwrap_or_else(|e| e.into_inner());
            loop {
                let taken = next.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                if taken >= items {
                    break;
                }
                let item = items - 1 - taken;
                let (t, g) = (item / n_kv, item % n_kv);
                let (seg, p) = rows[t];
                let view = &views[seg];
                let cap = view.cap;
                let (acc, rest) = buf.split_at_mut(64 * hd);
                let (q, scores) = rest.split_at_mut(rep * hd);
                let n_pos = p + 1;
                let base = (layer * n_kv + g) * cap * hd;
                let row = &qkv[t * qkv_rows + g * rep * hd..t * qkv_rows + (g + 1) * rep * hd];
                for (a, &b) in q.iter_mut().zip(row) {
                    *a = f16::from_f32(b).to_f32();
                }
                // SAFETY: item (t, g) writes only heads g*rep..(g+1)*rep of
                // row t, disjoint from every other item (each is taken
                // once); `out` outlives the parallel section.
                let o = unsafe {
                    std::slice::from_raw_parts_mut(out_ptr.0.add(t * dq + g * rep * hd), rep * hd)
                };
                let group = CachedHead {
                    q16: q,
                    k: &view.k[base..base + n_pos * hd],
                    v: &view.v[base..base + n_pos * hd],
                    n_pos,
                    scale,
                    decode: view.decode,
                    flavor: self.flavor,
                };
                attention_group(&group, rep, scores, acc, o);
            }
        });
    }
}
