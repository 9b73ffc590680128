//! The CPU forward pass (llama / qwen2 / qwen3 decoder blocks).
//!
//! Per block: RMSNorm → fused q/k/v product (+ qwen2 biases) → per-head
//! RMSNorm of q and k (qwen3) → RoPE (adjacent pairs for llama GGUFs, NEOX
//! halves for qwen2/3; Llama 3.1+ frequency factors, see `rope`) → K/V
//! appended to the sequence's f16 cache → grouped-query attention over the
//! cache → output product + residual → RMSNorm → fused gate/up product →
//! SiLU·up → down product + residual. Then the final RMSNorm and the output (or tied
//! embedding) product for the last position only.
//!
//! Numerics follow llama.cpp's CPU path: activations quantised per block to
//! 8 bits before each weight product, f16 K/V cache, the query and the
//! attention probabilities rounded to f16 for the f16 products, f64 sums in
//! RMSNorm and softmax.

mod attend;
mod scratch;

use attend::CacheView;
use scratch::Scratch;

use crate::backend::{
    Backend, SequenceState, batch_rows, check_logits, check_tokens, downcast_state,
};
use crate::cpu::rope::{apply_rope, rope_table};
use crate::error::ModelError;
use crate::ggml::Flavor;
use crate::gguf::Config;
use crate::gguf::weights::{Fused, Weights};
use crate::pool::ThreadPool;
use crate::quant::{Acts, BlockQ8_1, QK, QMatrix, quantize_q8_1};
use crate::quant::{BlockQ8K, QK_K, quantize_q8_k};
use half::f16;
use half::slice::{HalfBitsSliceExt, HalfFloatSliceExt};
use std::any::Any;
use std::sync::{Arc, Mutex};

/// The CPU backend: shared weights plus the thread pool.
#[derive(Debug)]
pub struct CpuBackend {
    pub(crate) config: Config,
    pub(crate) weights: Arc<Weights>,
    pool: ThreadPool,
    /// Whose arithmetic order (`model.numerics`).
    flavor: Flavor,
    /// Scratch of batched steps (sized for the largest batch seen).
    batch_scratch: Mutex<Scratch>,
}

/// A sequence's KV cache and scratch on the CPU.
pub struct CpuState {
    cache: KvCache,
    s: Scratch,
}

/// One sequence's f16 K/V cache.
struct KvCache {
    capacity: usize,
    pos: usize,
    /// `[layer][kv_head][position][head_dim]`.
    /// Stored as raw f16 bits so a new cache is a zeroed (lazily paged)
    /// allocation rather than a 100 MB write per session.
    k: Vec<u16>,
    v: Vec<u16>,
}

/// One sequence's part of a forward step: its cache, the tokens it runs
/// and where its last token's logits go.
struct Segment<'a> {
    cache: &'a mut KvCache,
    tokens: &'a [u32],
    logits: &'a mut [f32],
}

impl SequenceState for CpuState {
    fn position(&self) -> usize {
        self.cache.pos
    }
    fn capacity(&self) -> usize {
        self.cache.capacity
    }
    fn truncate(&mut self, position: usize) {
        self.cache.pos = self.cache.pos.min(position);
    }
    fn release_scratch(&mut self) {
        self.s = Scratch::default();
    }
    fn as_any_mut(&mut self) -> &mut dyn Any {
        self
    }
}

/// Steps with at least this many rows run their per-row work (norms,
/// activation quantisation, SwiGLU, residual adds) over the pool; a decode
/// step's few rows are cheaper on one thread than the hand-off.
const PAR_MIN_ROWS: usize = 16;

struct SyncPtr<T>(*mut T);
// SAFETY: only used to give pool threads disjoint parts of one buffer; every
// use documents why the parts are disjoint and outlive the parallel section.
unsafe impl<T> Sync for SyncPtr<T> {}

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

    /// [`rms_norm`] of every row of `x` into `out`, over the pool for a prompt.
    fn norm_rows(&self, x: &[f32], w: &[f32], out: &mut [f32]) {
        let (d, eps) = (w.len(), self.config.rms_eps);
        self.pool.for_rows(out, d, PAR_MIN_ROWS, &|r, o| {
            rms_norm(&x[r.start * d..r.end * d], w, eps, o)
        });
    }

    /// `x += y` (the residual), over the pool for a prompt.
    fn add_rows(&self, x: &mut [f32], y: &[f32]) {
        let d = self.config.n_embd;
        self.pool.for_rows(x, d, PAR_MIN_ROWS, &|r, x| {
            for (a, b) in x.iter_mut().zip(&y[r.start * d..r.end * d]) {
                *a += b;
            }
        });
    }

    /// Quantises `x` (`n` rows) for the weight products that consume it, as
    /// `needs` says: to Q8_1 into `q8` (its first `x.len()/32` blocks), to Q8_K
    /// into `q8k` (for K-quant matrices, whose rows are a multiple of 256
    /// values; the loader checks this). F16 and BF16 products take `x` itself.
    /// `orders`: per row, which of ggml's arithmetic orders its products follow.
    fn quantize_acts<'a>(
        &self,
        n: usize,
        x: &'a [f32],
        q8: &'a mut [BlockQ8_1],
        q8k: &'a mut Vec<BlockQ8K>,
        needs: ActNeeds,
        orders: Orders<'a>,
    ) -> Acts<'a> {
        let pool = &self.pool;
        let cols = x.len() / n.max(1);
        let q8: &[BlockQ8_1] = if needs.q8_1 {
            let q8 = &mut q8[..x.len() / QK];
            pool.for_rows(q8, cols / QK, PAR_MIN_ROWS, &|r, q| {
                quantize_q8_1(&x[r.start * cols..r.end * cols], q)
            });
            q8
        } else {
            &[]
        };
        let q8k: &[BlockQ8K] = if needs.q8k {
            q8k.resize(x.len() / QK_K, BlockQ8K::default());
            pool.for_rows(q8k, cols / QK_K, PAR_MIN_ROWS, &|r, q| {
                quantize_q8_k(&x[r.start * cols..r.end * cols], q)
            });
            q8k
        } else {
            &[]
        };
        Acts {
            q8,
            q8k,
            tiled: orders.tiled,
            x,
            gemm: orders.gemm,
            flavor: self.flavor,
        }
    }

    fn fused(&self, f: &Fused, xq: Acts<'_>, n: usize, out: &mut [f32]) {
        match f {
            Fused::One(m) => m.matmul(&self.pool, xq, n, out),
            Fused::Many(parts) => {
                let total = f.rows();
                let mut col = 0;
                for m in parts {
                    let mut tmp = vec![0f32; n * m.rows()];
                    m.matmul(&self.pool, xq, n, &mut tmp);
                    for t in 0..n {
                        out[t * total + col..t * total + col + m.rows()]
                            .copy_from_slice(&tmp[t * m.rows()..(t + 1) * m.rows()]);
                    }
                    col += m.rows();
                }
            }
        }
    }

    /// Checks one sequence's part of a step before anything is computed.
    fn check_segment(
        &self,
        cache: &KvCache,
        tokens: &[u32],
        logits: &[f32],
    ) -> Result<(), ModelError> {
        let n_vocab = self.config.n_vocab;
        check_tokens(cache.pos, cache.capacity, tokens, n_vocab)?;
        check_logits(logits.len(), n_vocab)?;
        Ok(())
    }

    /// One forward step over every segment's tokens together: the weight
    /// products run once over all rows (each weight tile is read once for
    /// the whole batch), while RoPE, the cache append and attention use each
    /// row's own sequence and position. Every row's arithmetic is the same
    /// as when its sequence runs alone, so results are bit-identical.
    /// Callers validated every segment with [`Self::check_segment`].
    fn forward_segments(&self, segs: &mut [Segment<'_>], s: &mut Scratch) {
        let c = &self.config;
        let w = &*self.weights;
        // Row r of the step: (segment, position in its sequence).
        let rows: Vec<(usize, usize)> = segs
            .iter()
            .enumerate()
            .flat_map(|(i, g)| (0..g.tokens.len()).map(move |j| (i, g.cache.pos + j)))
            .collect();
        let n = rows.len();
        // Rows of a sequence's step of 8+ tokens mirror ggml's tiled K-quant
        // matmul, the others its vector dot (as llama.cpp running that
        // sequence alone does).
        let tiled: Vec<bool> = segs
            .iter()
            .flat_map(|g| {
                let t = g.tokens.len() >= crate::quant::TILED_MIN_ROWS;
                std::iter::repeat_n(t, g.tokens.len())
            })
            .collect();
        // F16 products of a step of 2+ tokens follow tinyBLAS (llama.cpp's
        // sgemm takes prompt steps only), one-token steps its vector dot.
        let gemm: Vec<bool> = segs
            .iter()
            .flat_map(|g| std::iter::repeat_n(g.tokens.len() >= 2, g.tokens.len()))
            .collect();
        let orders = Orders {
            tiled: &tiled,
            gemm: &gemm,
        };
        let max_cap = segs.iter().map(|g| g.cache.capacity).max().unwrap_or(1);
        self.ensure_scratch(s, n, max_cap);
        let (d, hd, dq, dkv) = (c.n_embd, c.head_dim, c.q_dim(), c.kv_dim());
        let qkv_rows = dq + 2 * dkv;
        for (t, tok) in segs.iter().flat_map(|g| g.tokens.iter()).enumerate() {
            w.tok_embd
                .dequant_row(*tok as usize, &mut s.x[t * d..(t + 1) * d]);
        }
        let x = &mut s.x[..n * d];
        for (l, lw) in w.layers.iter().enumerate() {
            // llama.cpp runs the last layer's feed-forward on the output rows
            // only (`ggml_get_rows(cur, inp_out_ids)` after the attention):
            // one row per sequence, so its products take the one-row order
            // (vector dot, never tinyBLAS or the tiled K-quant matmul). The
            // other rows' results there are never read.
            let ffn_orders = if l + 1 == w.layers.len() {
                Orders {
                    tiled: &[],
                    gemm: &[],
                }
            } else {
                orders
            };
            // Attention.
            self.norm_rows(x, &lw.attn_norm, &mut s.xn[..n * d]);
            let xq = self.quantize_acts(
                n,
                &s.xn[..n * d],
                &mut s.xq,
                &mut s.xqk,
                ActNeeds::of_fused(&lw.wqkv),
                orders,
            );
            let qkv = &mut s.qkv[..n * qkv_rows];
            self.fused(&lw.wqkv, xq, n, qkv);
            for (t, &(seg, p)) in rows.iter().enumerate() {
                let row = &mut qkv[t * qkv_rows..(t + 1) * qkv_rows];
                if let Some(b) = &lw.bqkv {
                    for (v, b) in row.iter_mut().zip(b) {
                        *v += b;
                    }
                }
                let (q, rest) = row.split_at_mut(dq);
                // qwen3: RMSNorm over each head before RoPE (llama.cpp
                // `src/models/qwen3.cpp`, build_norm on the 3-D q/k views).
                if let (Some(qn), Some(kn)) = (&lw.q_norm, &lw.k_norm) {
                    rms_norm_rows(q, qn, c.rms_eps);
                    rms_norm_rows(&mut rest[..dkv], kn, c.rms_eps);
                }
                rope_table(c, w.rope_freqs.as_deref(), p, &mut s.rope);
                for h in 0..c.n_head {
                    apply_rope(&mut q[h * hd..(h + 1) * hd], &s.rope, c.rope_neox);
                }
                for h in 0..c.n_head_kv {
                    apply_rope(&mut rest[h * hd..(h + 1) * hd], &s.rope, c.rope_neox);
                }
                // Append K and V to the sequence's cache.
                let cache = &mut *segs[seg].cache;
                let cap = cache.capacity;
                for h in 0..c.n_head_kv {
                    let base = ((l * c.n_head_kv + h) * cap + p) * hd;
                    cache.k[base..base + hd]
                        .reinterpret_cast_mut::<f16>()
                        .convert_from_f32_slice(&rest[h * hd..(h + 1) * hd]);
                    cache.v[base..base + hd]
                        .reinterpret_cast_mut::<f16>()
                        .convert_from_f32_slice(&rest[dkv + h * hd..dkv + (h + 1) * hd]);
                }
            }
            let views: Vec<CacheView<'_>> = segs
                .iter()
                .map(|g| CacheView {
                    k: g.cache.k.reinterpret_cast::<f16>(),
                    v: g.cache.v.reinterpret_cast::<f16>(),
                    cap: g.cache.capacity,
                    decode: g.tokens.len() == 1,
                })
                .collect();
            self.attention(
                l,
                &rows,
                &views,
                &s.qkv[..n * qkv_rows],
                &s.per_thread,
                &mut s.attn[..n * dq],
            );
            let aq = self.quantize_acts(
                n,
                &s.attn[..n * dq],
                &mut s.attnq,
                &mut s.attnqk,
                ActNeeds::of(&lw.wo),
                orders,
            );
            lw.wo.matmul(&self.pool, aq, n, &mut s.proj[..n * d]);
            self.add_rows(x, &s.proj[..n * d]);
            // Feed-forward.
            self.norm_rows(x, &lw.ffn_norm, &mut s.xn[..n * d]);
            let xq = self.quantize_acts(
                n,
                &s.xn[..n * d],
                &mut s.xq,
                &mut s.xqk,
                ActNeeds::of_fused(&lw.wgu),
                ffn_orders,
            );
            let gu = &mut s.gu[..n * 2 * c.n_ff];
            self.fused(&lw.wgu, xq, n, gu);
            let gu = &*gu;
            self.pool
                .for_rows(&mut s.act[..n * c.n_ff], c.n_ff, PAR_MIN_ROWS, &|r, act| {
                    for (t, a) in r.zip(act.chunks_exact_mut(c.n_ff)) {
                        let (g, u) = gu[t * 2 * c.n_ff..(t + 1) * 2 * c.n_ff].split_at(c.n_ff);
                        crate::ggml::expf::swiglu(g, u, a, self.flavor);
                    }
                });
            let actq = self.quantize_acts(
                n,
                &s.act[..n * c.n_ff],
                &mut s.actq,
                &mut s.actqk,
                ActNeeds::of(&lw.w_down),
                ffn_orders,
            );
            lw.w_down.matmul(&self.pool, actq, n, &mut s.proj[..n * d]);
            self.add_rows(x, &s.proj[..n * d]);
            record_layer(x);
        }
        // The output product for each segment's last row only.
        let n_seg = segs.len();
        let out_k = w.output().needs_q8k();
        s.lastq.resize(n_seg * d / QK, BlockQ8_1::default());
        if out_k {
            s.lastqk.resize(n_seg * d / QK_K, BlockQ8K::default());
        }
        let mut end = 0;
        for (i, g) in segs.iter().enumerate() {
            end += g.tokens.len();
            let last = &x[(end - 1) * d..end * d];
            let xn = &mut s.xn[i * d..(i + 1) * d];
            rms_norm(last, &w.output_norm, c.rms_eps, xn);
            quantize_q8_1(xn, &mut s.lastq[i * d / QK..(i + 1) * d / QK]);
            if out_k {
                quantize_q8_k(xn, &mut s.lastqk[i * d / QK_K..(i + 1) * d / QK_K]);
            }
        }
        // One output row per sequence: ggml's vector dot, never the tiled path.
        let lastq = Acts {
            q8: &s.lastq,
            q8k: if out_k { &s.lastqk } else { &[] },
            tiled: &[],
            x: &s.xn[..n_seg * d],
            gemm: &[],
            flavor: self.flavor,
        };
        if let [g] = segs {
            w.output().matmul(&self.pool, lastq, 1, g.logits);
        } else {
            s.logits.resize(n_seg * c.n_vocab, 0.0);
            w.output().matmul(&self.pool, lastq, n_seg, &mut s.logits);
            for (g, l) in segs.iter_mut().zip(s.logits.chunks_exact(c.n_vocab)) {
                g.logits.copy_from_slice(l);
            }
        }
        for g in segs.iter_mut() {
            g.cache.pos += g.tokens.len();
        }
    }
}

/// Per row of a step, which of ggml's arithmetic orders its products
/// follow ([`Acts::tiled`], [`Acts::gemm`]).
#[derive(Clone, Copy)]
struct Orders<'a> {
    tiled: &'a [bool],
    gemm: &'a [bool],
}

/// Which quantised activations a product's weights take.
#[derive(Clone, Copy)]
struct ActNeeds {
    q8_1: bool,
    q8k: bool,
}

impl ActNeeds {
    fn of(m: &QMatrix) -> Self {
        ActNeeds {
            q8_1: m.needs_q8_1(),
            q8k: m.needs_q8k(),
        }
    }

    fn of_fused(f: &Fused) -> Self {
        ActNeeds {
            q8_1: f.needs_q8_1(),
            q8k: f.needs_q8k(),
        }
    }
}

thread_local! {
    /// The residual stream after every layer, while [`trace_layers`] runs.
    static LAYER_TRACE: std::cell::RefCell<Option<Vec<Vec<f32>>>> =
        const { std::cell::RefCell::new(None) };
}

fn record_layer(x: &[f32]) {
    LAYER_TRACE.with(|t| {
        if let Some(v) = t.borrow_mut().as_mut() {
            v.push(x.to_vec());
        }
    });
}

/// Diagnostics (the GPU tests compare backends layer by layer): runs `f`
/// with per-layer recording on this thread and returns its result and the
/// residual stream after every layer of every CPU forward step `f` ran on
/// this thread (`n_tokens × n_embd` values per layer and step).
pub fn trace_layers<R>(f: impl FnOnce() -> R) -> (R, Vec<Vec<f32>>) {
    LAYER_TRACE.with(|t| *t.borrow_mut() = Some(Vec::new()));
    let r = f();
    let layers = LAYER_TRACE
        .with(|t| t.borrow_mut().take())
        .unwrap_or_default();
    (r, layers)
}

/// `out = x / rms(x) * w` per row of `w.len()` values (f64 sum like ggml).
pub(crate) fn rms_norm(x: &[f32], w: &[f32], eps: f32, out: &mut [f32]) {
    let d = w.len();
    for (xr, or) in x.chunks_exact(d).zip(out.chunks_exact_mut(d)) {
        let sum: f64 = xr.iter().map(|&v| (v * v) as f64).sum();
        let scale = 1.0 / ((sum / d as f64) as f32 + eps).sqrt();
        for ((o, &v), &g) in or.iter_mut().zip(xr).zip(w) {
            *o = (v * scale) * g;
        }
    }
}

/// `x = x / rms(x) * w` in place per row of `w.len()` values, with
/// [`rms_norm`]'s arithmetic (the per-head q/k norm of qwen3).
fn rms_norm_rows(x: &mut [f32], w: &[f32], eps: f32) {
    let d = w.len();
    for xr in x.chunks_exact_mut(d) {
        let sum: f64 = xr.iter().map(|&v| (v * v) as f64).sum();
        let scale = 1.0 / ((sum / d as f64) as f32 + eps).sqrt();
        for (v, &g) in xr.iter_mut().zip(w) {
            *v = (*v * scale) * g;
        }
    }
}

fn cpu_state(state: &mut dyn SequenceState) -> Result<&mut CpuState, ModelError> {
    downcast_state(state, "CPU")
}

impl Backend for CpuBackend {
    fn name(&self) -> String {
        format!("cpu-{}", crate::quant::kernel_name())
    }

    fn new_state(&self, capacity: usize) -> Result<Box<dyn SequenceState>, ModelError> {
        let c = &self.config;
        let len = c.n_layer * c.n_head_kv * capacity * c.head_dim;
        let mut st = CpuState {
            cache: KvCache {
                capacity,
                pos: 0,
                k: vec![0u16; len],
                v: vec![0u16; len],
            },
            s: Scratch::default(),
        };
        self.ensure_scratch(&mut st.s, 1, capacity);
        Ok(Box::new(st))
    }

    fn forward(
        &self,
        state: &mut dyn SequenceState,
        tokens: &[u32],
        logits: &mut [f32],
    ) -> Result<(), ModelError> {
        let CpuState { cache, s } = cpu_state(state)?;
        self.check_segment(cache, tokens, logits)?;
        self.forward_segments(
            &mut [Segment {
                cache,
                tokens,
                logits,
            }],
            s,
        );
        Ok(())
    }

    fn forward_batch(
        &self,
        states: &mut [&mut dyn SequenceState],
        tokens: &[u32],
        logits: &mut [&mut [f32]],
    ) -> Result<(), ModelError> {
        let mut segs = Vec::with_capacity(states.len());
        for (st, tok, l) in batch_rows(states, tokens, logits)? {
            let cache = &mut cpu_state(st)?.cache;
            let tokens = std::slice::from_ref(tok);
            self.check_segment(cache, tokens, l)?;
            segs.push(Segment {
                cache,
                tokens,
                logits: l,
            });
        }
        let mut s = self.batch_scratch.lock().unwrap_or_else(|e| e.into_inner());
        self.forward_segments(&mut segs, &mut s);
        Ok(())
    }
}

#[allow(dead_code)]
fn _assert_send_sync(b: CpuBackend, m: QMatrix) -> (Box<dyn Send + Sync>, QMatrix) {
    (Box::new(b), m)
}
