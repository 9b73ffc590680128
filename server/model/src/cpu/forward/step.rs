//! One forward step over every segment's rows together, phase by phase.
//!
//! The token embeddings, each layer's attention and feed-forward blocks,
//! the output head.

use half::f16;
use half::slice::{HalfBitsSliceExt, HalfFloatSliceExt};

use super::attend::CacheView;
use super::backend::{CpuBackend, PAR_MIN_ROWS};
use super::norm::{rms_norm, rms_norm_rows};
use super::rows::{ActNeeds, Orders};
use super::scratch::Scratch;
use super::state::KvCache;
use super::trace::record_layer;
use crate::backend::{check_logits, check_tokens};
use crate::cpu::rope::{apply_rope, rope_table};
use crate::error::ModelError;
use crate::gguf::LayerWeights;
use crate::quant::{Acts, BlockQ8_1, BlockQ8K, QK, QK_K, quantize_q8_1, quantize_q8_k};

/// One sequence's part of a forward step: its cache, the tokens it runs
/// and where its logits go.
pub(super) struct Segment<'a> {
    pub(super) cache: &'a mut KvCache,
    pub(super) tokens: &'a [u32],
    /// The last token's logits (`n_vocab`), or with `decode_rows` every
    /// token's (`tokens.len() × n_vocab`).
    pub(super) logits: &'a mut [f32],
    /// Every token runs as its own decode step would (the one-token
    /// arithmetic order throughout) and writes its logits: the verify
    /// pass of speculative decoding. Otherwise the tokens are one step
    /// (a prompt's order when there are 2 or more).
    pub(super) decode_rows: bool,
}

impl Segment<'_> {
    /// The step order of this segment's rows: as a step of this many tokens.
    fn step_len(&self) -> usize {
        if self.decode_rows {
            1
        } else {
            self.tokens.len()
        }
    }

    /// Rows whose logits this segment takes (the last, or every one).
    fn out_rows(&self) -> usize {
        if self.decode_rows {
            self.tokens.len()
        } else {
            1
        }
    }
}

impl CpuBackend {
    /// Checks one sequence's part of a step before anything is computed
    /// (`out_rows`: the rows of logits it takes).
    pub(super) fn check_segment(
        &self,
        cache: &KvCache,
        tokens: &[u32],
        logits: &[f32],
        out_rows: usize,
    ) -> Result<(), ModelError> {
        let n_vocab = self.config.n_vocab;
        check_tokens(cache.pos, cache.capacity, tokens, n_vocab)?;
        check_logits(logits.len(), out_rows * n_vocab)?;
        Ok(())
    }

    /// One forward step over every segment's tokens together: the weight
    /// products run once over all rows (each weight tile is read once for
    /// the whole batch), while RoPE, the cache append and attention use each
    /// row's own sequence and position. Every row's arithmetic is the same
    /// as when its sequence runs alone, so results are bit-identical.
    /// Callers validated every segment with [`Self::check_segment`].
    pub(super) fn forward_segments(&self, segs: &mut [Segment<'_>], s: &mut Scratch) {
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
        // sequence alone does); decode rows are one-token steps.
        let tiled: Vec<bool> = segs
            .iter()
            .flat_map(|g| {
                let t = g.step_len() >= crate::quant::TILED_MIN_ROWS;
                std::iter::repeat_n(t, g.tokens.len())
            })
            .collect();
        // F16 products of a step of 2+ tokens follow tinyBLAS (llama.cpp's
        // sgemm takes prompt steps only), one-token steps its vector dot.
        let gemm: Vec<bool> = segs
            .iter()
            .flat_map(|g| std::iter::repeat_n(g.step_len() >= 2, g.tokens.len()))
            .collect();
        let orders = Orders {
            tiled: &tiled,
            gemm: &gemm,
        };
        let max_cap = segs.iter().map(|g| g.cache.capacity).max().unwrap_or(1);
        s.ensure(c, w, self.pool.n_threads(), n, max_cap);
        let d = c.n_embd;
        for (t, tok) in segs.iter().flat_map(|g| g.tokens.iter()).enumerate() {
            w.tok_embd
                .dequant_row(*tok as usize, &mut s.x[t * d..(t + 1) * d]);
        }
        for (l, lw) in w.layers.iter().enumerate() {
            // llama.cpp runs the last layer's feed-forward on the output rows
            // only (`ggml_get_rows(cur, inp_out_ids)` after the attention):
            // one row per sequence, so its products take the one-row order
            // (vector dot, never tinyBLAS or the tiled K-quant matmul). The
            // other rows' results there are never read (decode rows are
            // all output rows, each in that one-row order).
            let ffn_orders = if l + 1 == w.layers.len() {
                Orders {
                    tiled: &[],
                    gemm: &[],
                }
            } else {
                orders
            };
            self.attention_block(l, lw, segs, &rows, orders, s);
            self.ffn_block(lw, n, ffn_orders, s);
            record_layer(&s.x[..n * d]);
        }
        self.output_head(segs, s);
        for g in segs.iter_mut() {
            g.cache.pos += g.tokens.len();
        }
    }

    /// Layer `l`'s attention block over the step's `rows`: RMSNorm, the
    /// fused q/k/v product, each row's q/k/v into its sequence's cache
    /// ([`Self::store_qkv`]), attention, the output product and the
    /// residual add.
    fn attention_block(
        &self,
        l: usize,
        lw: &LayerWeights,
        segs: &mut [Segment<'_>],
        rows: &[(usize, usize)],
        orders: Orders<'_>,
        s: &mut Scratch,
    ) {
        let c = &self.config;
        let n = rows.len();
        let (d, dq) = (c.n_embd, c.q_dim());
        let qkv_rows = dq + 2 * c.kv_dim();
        let x = &mut s.x[..n * d];
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
        self.store_qkv(l, lw, segs, rows, qkv, &mut s.rope);
        let views: Vec<CacheView<'_>> = segs
            .iter()
            .map(|g| CacheView {
                k: g.cache.k.reinterpret_cast::<f16>(),
                v: g.cache.v.reinterpret_cast::<f16>(),
                cap: g.cache.capacity,
                decode: g.step_len() == 1,
            })
            .collect();
        self.attention(
            l,
            rows,
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
    }

    /// Each row of the q/k/v product `qkv` in place: the biases (qwen2),
    /// the per-head q/k RMSNorm (qwen3), RoPE at the row's position (`rope`:
    /// the table's scratch); then its K and V appended to its sequence's
    /// cache for layer `l`.
    fn store_qkv(
        &self,
        l: usize,
        lw: &LayerWeights,
        segs: &mut [Segment<'_>],
        rows: &[(usize, usize)],
        qkv: &mut [f32],
        rope: &mut [(f32, f32)],
    ) {
        let c = &self.config;
        let w = &*self.weights;
        let (hd, dq, dkv) = (c.head_dim, c.q_dim(), c.kv_dim());
        let qkv_rows = dq + 2 * dkv;
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
            rope_table(c, w.rope_freqs.as_deref(), p, rope);
            for h in 0..c.n_head {
                apply_rope(&mut q[h * hd..(h + 1) * hd], rope, c.rope_neox);
            }
            for h in 0..c.n_head_kv {
                apply_rope(&mut rest[h * hd..(h + 1) * hd], rope, c.rope_neox);
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
    }

    /// The feed-forward block of `n` rows: RMSNorm, the fused gate/up
    /// product, SiLU·up, the down product and the residual add, in the
    /// orders `ffn_orders`.
    fn ffn_block(&self, lw: &LayerWeights, n: usize, ffn_orders: Orders<'_>, s: &mut Scratch) {
        let c = &self.config;
        let d = c.n_embd;
        let x = &mut s.x[..n * d];
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
    }

    /// The final RMSNorm and the output product for each segment's output
    /// rows only (its last, or every decode row), into the segments' logits.
    fn output_head(&self, segs: &mut [Segment<'_>], s: &mut Scratch) {
        let c = &self.config;
        let w = &*self.weights;
        let d = c.n_embd;
        let x = &s.x;
        let n_out: usize = segs.iter().map(Segment::out_rows).sum();
        let out_k = w.output().needs_q8k();
        s.lastq.resize(n_out * d / QK, BlockQ8_1::default());
        if out_k {
            s.lastqk.resize(n_out * d / QK_K, BlockQ8K::default());
        }
        let (mut end, mut i) = (0, 0);
        for g in segs.iter() {
            end += g.tokens.len();
            for row in end - g.out_rows()..end {
                let xr = &x[row * d..(row + 1) * d];
                let xn = &mut s.xn[i * d..(i + 1) * d];
                rms_norm(xr, &w.output_norm, c.rms_eps, xn);
                quantize_q8_1(xn, &mut s.lastq[i * d / QK..(i + 1) * d / QK]);
                if out_k {
                    quantize_q8_k(xn, &mut s.lastqk[i * d / QK_K..(i + 1) * d / QK_K]);
                }
                i += 1;
            }
        }
        // Each output row is its own step's one output row: ggml's vector
        // dot, never the tiled path.
        let lastq = Acts {
            q8: &s.lastq,
            q8k: if out_k { &s.lastqk } else { &[] },
            tiled: &[],
            x: &s.xn[..n_out * d],
            gemm: &[],
            flavor: self.flavor,
        };
        if let [g] = segs {
            // A lone segment's rows are its logits buffer, in order.
            w.output().matmul(&self.pool, lastq, n_out, g.logits);
        } else {
            s.logits.resize(n_out * c.n_vocab, 0.0);
            w.output().matmul(&self.pool, lastq, n_out, &mut s.logits);
            let mut from = 0;
            for g in segs.iter_mut() {
                let len = g.out_rows() * c.n_vocab;
                g.logits.copy_from_slice(&s.logits[from..from + len]);
                from += len;
            }
        }
    }
}
