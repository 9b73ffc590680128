//! The kernel launches of one forward pass.
//!
//! The kernel launches of one forward pass, enqueued on the pass's stream
//! ([`Pass`]): the embedding, each layer's norms, weight products, RoPE and
//! cache store, attention and SwiGLU, and the output head. A pass is either
//! n consecutive tokens of one sequence or one token of each of n sequences
//! (a batched decode step, `batch`); only RoPE + cache store, attention and
//! the output head differ between the two.

use cudarc::driver::{CudaSlice, CudaStream};

use super::backend::CudaBackend;
use super::format::{ActKind, Order};
use super::kernels::{self, Arg, cfg};
use super::options::MmKernel;
use super::state::{CudaState, Scratch, dptr};
use super::upload::{DevFused, DevMatrix, Needs};
use crate::error::ModelError;
use crate::quant::QK;
use crate::quant::QK_K;

/// Device addresses of one product input's activations in each form (only
/// those some matrix reads are written).
#[derive(Clone, Copy, Debug)]
struct Acts {
    q8_1: u64,
    q8k: u64,
    f32: u64,
}

/// Where a pass's launches go: its stream, its per-token scratch (one row
/// per token of the step), and whose cache the rows attend over.
#[derive(Clone, Copy)]
pub(super) struct Pass<'a> {
    pub(super) s: &'a CudaStream,
    pub(super) sc: &'a Scratch,
    pub(super) rows: Rows<'a>,
}

/// The sequences behind a pass's rows.
#[derive(Clone, Copy)]
pub(super) enum Rows<'a> {
    /// Consecutive tokens of one sequence from its position (`pos_dev`), in
    /// the orders of a step of that many tokens.
    Seq(&'a CudaState),
    /// Row t is one token of sequence t (a batched decode step): `desc`
    /// holds the rows' `BatchRow` descriptors (cache, scores, logits,
    /// position, capacity), `max_pos` their largest position. Every row in
    /// the one-token step's orders, so each has the bits of its sequence
    /// stepped alone.
    Batch { desc: u64, max_pos: usize },
}

impl<'a> Pass<'a> {
    /// A pass over one sequence, on its stream and scratch.
    pub(super) fn seq(st: &'a CudaState) -> Self {
        Pass {
            s: &st.stream,
            sc: &st.scratch,
            rows: Rows::Seq(st),
        }
    }
}

impl CudaBackend {
    /// `out[t * stride + off + r] = W[r] · x[t]` for the n tokens, in `m`'s
    /// format and the CPU's `order` for this product.
    #[allow(clippy::too_many_arguments)]
    fn mm(
        &self,
        p: Pass,
        m: &DevMatrix,
        a: Acts,
        out: u64,
        n: usize,
        stride: usize,
        off: usize,
        order: Order,
    ) -> Result<(), ModelError> {
        let s = p.s;
        let k = self.kernels.format(m.format);
        let (f, grid, threads) = match self.opts.mm {
            MmKernel::Warp => (
                &k.mmw,
                (m.rows as u32).div_ceil(kernels::MMW_ROWS_PER_BLOCK),
                kernels::MMW_ROWS_PER_BLOCK * 32,
            ),
            MmKernel::Lanes => (
                &k.mm,
                (m.rows as u32).div_ceil(kernels::MM_ROWS_PER_BLOCK),
                kernels::MM_THREADS,
            ),
        };
        let acts = m.format.acts();
        let x = match acts {
            ActKind::Q8_1 => a.q8_1,
            ActKind::Q8K => a.q8k,
            ActKind::F32 => a.f32,
        };
        let mut args = vec![
            Arg::Ptr(dptr(&m.data, s)),
            Arg::Ptr(x),
            Arg::Ptr(out),
            Arg::I32(m.rows as i32),
            Arg::I32(m.format.kernel_blocks(m.cols) as i32),
            Arg::I32(n as i32),
            Arg::I32(stride as i32),
            Arg::I32(off as i32),
        ];
        // The order, for the formats that have several.
        match acts {
            ActKind::Q8_1 => {}
            ActKind::Q8K => args.push(Arg::I32(order.tiled as i32)),
            ActKind::F32 => args.extend([
                Arg::I32(self.lanes),
                Arg::I32(order.gemm as i32),
                Arg::I32(self.bf16_pairs as i32),
            ]),
        }
        // SAFETY: mm*_<format>(w, x, out, rows, nb, n_tok, out_stride,
        // out_off[, tiled | , w, gemm, pairs]): `w` holds rows × nb blocks
        // of the format, `x` n tokens of the activations it reads (Q8_1 or
        // Q8_K blocks, or floats, each scratch sized for n tokens of the
        // widest activation, and written for this input: `Needs`) and `out`
        // n × stride floats with off + rows <= stride.
        unsafe { kernels::launch(s, f, cfg((grid, 1), threads, 0), &args) }
            .map_err(ModelError::Backend)
    }

    #[allow(clippy::too_many_arguments)]
    fn fused(
        &self,
        p: Pass,
        f: &DevFused,
        a: Acts,
        out: u64,
        n: usize,
        stride: usize,
        order: Order,
    ) -> Result<(), ModelError> {
        let mut off = 0;
        for m in f.parts() {
            self.mm(p, m, a, out, n, stride, off, order)?;
            off += m.rows;
        }
        Ok(())
    }

    /// The activations in the scratch (Q8_1 in xq, Q8_K in xqk) and the f32
    /// values at `f32`.
    fn acts(&self, p: Pass, f32: u64) -> Acts {
        let (s, sc) = (p.s, p.sc);
        Acts {
            q8_1: dptr(&sc.xq, s),
            q8k: dptr(&sc.xqk, s),
            f32,
        }
    }

    /// `x += add` (when `add` is not null), then RMSNorm with `w` of `rows`
    /// rows of n_embd from `x`, into the activation forms `needs` asks for.
    fn add_norm_quant(
        &self,
        p: Pass,
        x: u64,
        add: u64,
        w: &CudaSlice<f32>,
        rows: usize,
        needs: Needs,
    ) -> Result<Acts, ModelError> {
        let s = p.s;
        let d = self.config.n_embd;
        let a = self.acts(p, dptr(&p.sc.xa, s));
        let keep_f32 = needs.f32 || needs.q8k;
        // SAFETY: add_norm_quant(x, add, w, out, outf, d, eps): x (and add,
        // unless null) hold rows × d floats, w d floats, the xq scratch
        // n_tok × widest / 32 >= rows × d / 32 blocks and xa n_tok × widest
        // >= rows × d floats (either may be null: not written); one
        // NORM_THREADS block per row.
        unsafe {
            kernels::launch(
                s,
                &self.kernels.add_norm_quant,
                cfg((rows as u32, 1), kernels::NORM_THREADS, 0),
                &[
                    Arg::Ptr(x),
                    Arg::Ptr(add),
                    Arg::Ptr(dptr(w, s)),
                    Arg::Ptr(if needs.q8_1 { a.q8_1 } else { 0 }),
                    Arg::Ptr(if keep_f32 { a.f32 } else { 0 }),
                    Arg::I32(d as i32),
                    Arg::F32(self.config.rms_eps),
                ],
            )
        }
        .map_err(ModelError::Backend)?;
        if needs.q8k {
            self.quantize_q8_k(p, a.f32, rows * d)?;
        }
        Ok(a)
    }

    fn quantize(&self, p: Pass, x: u64, n_values: usize) -> Result<(), ModelError> {
        let s = p.s;
        let blocks = n_values / QK;
        // SAFETY: quantize_q8_1(x, out, n_blocks): x holds n_values floats,
        // the xq scratch n_tok × widest/32 blocks >= n_values/32.
        unsafe {
            kernels::launch(
                s,
                &self.kernels.quantize_q8_1,
                kernels::per_warp(blocks),
                &[
                    Arg::Ptr(x),
                    Arg::Ptr(dptr(&p.sc.xq, s)),
                    Arg::I32(blocks as i32),
                ],
            )
        }
        .map_err(ModelError::Backend)
    }

    /// Q8_K blocks of the `n_values` floats at `x` into the xqk scratch
    /// (K-quant rows are whole super-blocks, so n_values % 256 == 0).
    fn quantize_q8_k(&self, p: Pass, x: u64, n_values: usize) -> Result<(), ModelError> {
        let s = p.s;
        debug_assert!(n_values.is_multiple_of(QK_K));
        let blocks = n_values / QK_K;
        // SAFETY: quantize_q8_k(x, out, n_blocks): x holds n_values floats,
        // the xqk scratch (allocated when a matrix takes Q8_K, which is when
        // this runs) n_tok × ceil(widest / 256) blocks >= n_values / 256.
        unsafe {
            kernels::launch(
                s,
                &self.kernels.quantize_q8_k,
                kernels::per_warp(blocks),
                &[
                    Arg::Ptr(x),
                    Arg::Ptr(dptr(&p.sc.xqk, s)),
                    Arg::I32(blocks as i32),
                ],
            )
        }
        .map_err(ModelError::Backend)
    }

    /// Enqueues the forward pass of `n` tokens (already uploaded, position
    /// in `pos_dev`) on the state's stream; the last token's logits land in
    /// `st.logits`. Nine launches per layer (ten for one-token steps, whose
    /// attention scores have their own kernel): add + norm + quantise,
    /// q/k/v, RoPE + cache store, attention + quantise, output product,
    /// add + norm + quantise, gate/up, SiLU·up + quantise, down; plus a
    /// Q8_K quantisation before each K-quant product's input.
    pub(super) fn enqueue_forward(&self, st: &CudaState, n: usize) -> Result<(), ModelError> {
        let p = Pass::seq(st);
        self.enqueue_embed(p, n)?;
        for l in 0..self.weights.layers.len() {
            self.enqueue_layer(p, n, l)?;
        }
        self.enqueue_output(st, n)
    }

    /// The n token ids in the scratch's `tokens` looked up into `x`.
    pub(super) fn enqueue_embed(&self, p: Pass, n: usize) -> Result<(), ModelError> {
        let s = p.s;
        let w = &self.weights;
        let embed = &self.kernels.format(w.tok_embd.format).embed;
        // SAFETY: embed_<format>(w, tok, cols, out): n token ids (checked <
        // n_vocab) index rows of the n_vocab × d embedding in its format
        // (d a multiple of its block); out holds n × d floats.
        unsafe {
            kernels::launch(
                s,
                embed,
                cfg((n as u32, 1), kernels::ELEMENTWISE_THREADS, 0),
                &[
                    Arg::Ptr(dptr(&w.tok_embd.data, s)),
                    Arg::Ptr(dptr(&p.sc.tokens, s)),
                    Arg::I32(self.config.n_embd as i32),
                    Arg::Ptr(dptr(&p.sc.x, s)),
                ],
            )
        }
        .map_err(ModelError::Backend)
    }

    /// Layer `l`; starts by adding the previous layer's down product.
    pub(super) fn enqueue_layer(&self, p: Pass, n: usize, l: usize) -> Result<(), ModelError> {
        // The CPU's orders (crate::cpu::forward): the last layer's feed-forward
        // runs on the output rows only in llama.cpp, so in the one-row
        // orders whatever the step's size. A batched step's rows are each
        // a one-token step of their own sequence.
        let step = match p.rows {
            Rows::Seq(_) => n,
            Rows::Batch { .. } => 1,
        };
        let order = Order::of_step(step, false);
        let ffn_order = Order::of_step(step, l + 1 == self.weights.layers.len());
        self.enqueue_attention_block(p, n, l, order)?;
        self.enqueue_ffn_block(p, n, l, ffn_order)
    }

    /// Layer `l`'s attention block: the previous down product added and
    /// RMSNorm, the q/k/v product, RoPE + cache store, attention, and the
    /// output product into `proj`.
    fn enqueue_attention_block(
        &self,
        p: Pass,
        n: usize,
        l: usize,
        order: Order,
    ) -> Result<(), ModelError> {
        let c = &self.config;
        let s = p.s;
        let lw = &self.weights.layers[l];
        let d = c.n_embd;
        let qkv_rows = d + 2 * c.n_head_kv * c.head_dim;
        let sc = p.sc;
        let (x, xq) = (dptr(&sc.x, s), dptr(&sc.xq, s));
        let (qkv, attn, proj) = (dptr(&sc.qkv, s), dptr(&sc.attn, s), dptr(&sc.proj, s));
        let needs = Needs::of(lw.wqkv.parts());
        let a =
            self.add_norm_quant(p, x, if l == 0 { 0 } else { proj }, &lw.attn_norm, n, needs)?;
        self.fused(p, &lw.wqkv, a, qkv, n, qkv_rows, order)?;
        match p.rows {
            Rows::Seq(st) => self.enqueue_rope_store(st, n, l, qkv)?,
            Rows::Batch { desc, .. } => self.enqueue_rope_store_batch(p, n, l, desc)?,
        }
        // hd % 32 == 0: each head's output is whole Q8_1 blocks, quantised
        // by the attention kernel itself (when the output matrix takes Q8_1).
        let needs = Needs::of(std::slice::from_ref(&lw.wo));
        let fused_quant = needs.q8_1 && c.head_dim.is_multiple_of(QK);
        let outq = if fused_quant { xq } else { 0 };
        match p.rows {
            Rows::Seq(st) => self.enqueue_attention(st, n, l, outq)?,
            Rows::Batch { desc, max_pos } => {
                self.enqueue_attention_batch(p, n, l, desc, max_pos, outq)?
            }
        }
        if needs.q8_1 && !fused_quant {
            self.quantize(p, attn, n * d)?;
        }
        if needs.q8k {
            self.quantize_q8_k(p, attn, n * d)?;
        }
        self.mm(p, &lw.wo, self.acts(p, attn), proj, n, d, 0, order)
    }

    /// Layer `l`'s biases, RoPE and K/V cache store over the q/k/v rows at
    /// `qkv` (one launch).
    fn enqueue_rope_store(
        &self,
        st: &CudaState,
        n: usize,
        l: usize,
        qkv: u64,
    ) -> Result<(), ModelError> {
        let c = &self.config;
        let s = &st.stream;
        let lw = &self.weights.layers[l];
        let hd = c.head_dim;
        let (kc, vc, pos) = (dptr(&st.k, s), dptr(&st.v, s), dptr(&st.pos_dev, s));
        let bias = lw.bqkv.as_ref().map_or(0, |b| dptr(b, s));
        // SAFETY: qkv_rope_store(qkv, bias, rope, pos, n_head, n_kv, hd,
        // n_pairs, neox, k, v, layer, cap): qkv holds n rows of qkv_rows,
        // bias qkv_rows floats or null, the rope table covers positions
        // < rope_positions (checked), the cache n_layer × n_kv × cap × hd
        // halves with pos + n <= cap (checked); hd <= MAX_HD (checked).
        unsafe {
            kernels::launch(
                s,
                &self.kernels.qkv_rope_store,
                cfg((n as u32, (c.n_head + c.n_head_kv) as u32), 64, 0),
                &[
                    Arg::Ptr(qkv),
                    Arg::Ptr(bias),
                    Arg::Ptr(dptr(&self.rope, s)),
                    Arg::Ptr(pos),
                    Arg::I32(c.n_head as i32),
                    Arg::I32(c.n_head_kv as i32),
                    Arg::I32(hd as i32),
                    Arg::I32((c.rope_dim / 2) as i32),
                    Arg::I32(c.rope_neox as i32),
                    Arg::Ptr(kc),
                    Arg::Ptr(vc),
                    Arg::I32(l as i32),
                    Arg::I32(st.capacity as i32),
                ],
            )
        }
        .map_err(ModelError::Backend)
    }

    /// A batched step's biases, RoPE and K/V store: row t at its own
    /// sequence's position, into its own cache (one launch for all rows).
    fn enqueue_rope_store_batch(
        &self,
        p: Pass,
        n: usize,
        l: usize,
        desc: u64,
    ) -> Result<(), ModelError> {
        let c = &self.config;
        let s = p.s;
        let lw = &self.weights.layers[l];
        let bias = lw.bqkv.as_ref().map_or(0, |b| dptr(b, s));
        // SAFETY: qkv_rope_store_batch(qkv, bias, rope, rows, n_head, n_kv,
        // hd, n_pairs, neox, layer): qkv holds n rows of qkv_rows (the
        // scratch is sized for the batch), bias qkv_rows floats or null,
        // `rows` n descriptors, each naming its sequence's live cache
        // (n_layer × n_kv × cap × hd halves) with pos < cap and pos <
        // rope_positions (each row checked like a one-token step).
        unsafe {
            kernels::launch(
                s,
                &self.kernels.qkv_rope_store_batch,
                cfg((n as u32, (c.n_head + c.n_head_kv) as u32), 64, 0),
                &[
                    Arg::Ptr(dptr(&p.sc.qkv, s)),
                    Arg::Ptr(bias),
                    Arg::Ptr(dptr(&self.rope, s)),
                    Arg::Ptr(desc),
                    Arg::I32(c.n_head as i32),
                    Arg::I32(c.n_head_kv as i32),
                    Arg::I32(c.head_dim as i32),
                    Arg::I32((c.rope_dim / 2) as i32),
                    Arg::I32(c.rope_neox as i32),
                    Arg::I32(l as i32),
                ],
            )
        }
        .map_err(ModelError::Backend)
    }

    /// A batched step's attention: row t over its own sequence's cache, in
    /// the one-token step's order, scores first in their own wide kernel
    /// (`split_scores`) as for a one-token step. One launch each for all
    /// rows: a launch per sequence would cost B × 2 launches per layer
    /// (each a few microseconds of launch overhead at batch 8), the
    /// descriptors cost one upload of 48 bytes per row per step.
    fn enqueue_attention_batch(
        &self,
        p: Pass,
        n: usize,
        l: usize,
        desc: u64,
        max_pos: usize,
        outq: u64,
    ) -> Result<(), ModelError> {
        let c = &self.config;
        let s = p.s;
        let hd = c.head_dim;
        let qkv = dptr(&p.sc.qkv, s);
        let scale = 1.0 / (hd as f32).sqrt();
        let split = self.opts.split_scores;
        if split {
            // Enough blocks for the longest row (grid-strided beyond);
            // shorter rows' extra blocks return at once.
            let blocks = ((max_pos + 1) as u32)
                .div_ceil(kernels::SCORE_THREADS)
                .min(kernels::SCORE_MAX_BLOCKS);
            let mut config = cfg((blocks, c.n_head as u32), kernels::SCORE_THREADS, 0);
            config.grid_dim.2 = n as u32;
            // SAFETY: attn_scores_batch(qkv, rows, layer, n_head, n_kv, hd,
            // scale, w): qkv holds n rows, `rows` n descriptors whose caches
            // are as in qkv_rope_store_batch and whose scores buffers hold
            // n_head × cap floats (allocated with each state), written for
            // positions <= pos < cap; hd <= MAX_HD (checked at load).
            unsafe {
                kernels::launch(
                    s,
                    &self.kernels.attn_scores_batch,
                    config,
                    &[
                        Arg::Ptr(qkv),
                        Arg::Ptr(desc),
                        Arg::I32(l as i32),
                        Arg::I32(c.n_head as i32),
                        Arg::I32(c.n_head_kv as i32),
                        Arg::I32(hd as i32),
                        Arg::F32(scale),
                        Arg::I32(self.lanes),
                    ],
                )
            }
            .map_err(ModelError::Backend)?;
        }
        // SAFETY: attention_batch(qkv, rows, out, outq, layer, n_head, n_kv,
        // hd, scale, w, split): as above; out (the attn scratch) holds n × d
        // floats, outq (the xq scratch, or null) n × d / 32 blocks.
        unsafe {
            kernels::launch(
                s,
                &self.kernels.attention_batch,
                cfg((n as u32, c.n_head as u32), kernels::ATT_THREADS, 0),
                &[
                    Arg::Ptr(qkv),
                    Arg::Ptr(desc),
                    Arg::Ptr(dptr(&p.sc.attn, s)),
                    Arg::Ptr(outq),
                    Arg::I32(l as i32),
                    Arg::I32(c.n_head as i32),
                    Arg::I32(c.n_head_kv as i32),
                    Arg::I32(hd as i32),
                    Arg::F32(scale),
                    Arg::I32(self.lanes),
                    Arg::I32(split as i32),
                ],
            )
        }
        .map_err(ModelError::Backend)
    }

    /// Layer `l`'s attention of the step's `n` rows over the cache, into
    /// `attn` and, where `outq` is not null, quantised to Q8_1 there:
    /// one-token steps with their scores in their own wide kernel first
    /// (`split_scores`).
    fn enqueue_attention(
        &self,
        st: &CudaState,
        n: usize,
        l: usize,
        outq: u64,
    ) -> Result<(), ModelError> {
        let c = &self.config;
        let s = &st.stream;
        let hd = c.head_dim;
        let sc = &st.scratch;
        let (qkv, attn) = (dptr(&sc.qkv, s), dptr(&sc.attn, s));
        let (kc, vc, pos) = (dptr(&st.k, s), dptr(&st.v, s), dptr(&st.pos_dev, s));
        let scale = 1.0 / (hd as f32).sqrt();
        let split = n == 1 && self.opts.split_scores;
        // The parameters `attn_scores` and `attention` share after their
        // pointers: layer, cap, n_head, n_kv, hd, scale, w.
        let head = [
            Arg::I32(l as i32),
            Arg::I32(st.capacity as i32),
            Arg::I32(c.n_head as i32),
            Arg::I32(c.n_head_kv as i32),
            Arg::I32(hd as i32),
            Arg::F32(scale),
            Arg::I32(self.lanes),
        ];
        if split {
            let blocks = (st.capacity as u32)
                .div_ceil(kernels::SCORE_THREADS)
                .min(kernels::SCORE_MAX_BLOCKS);
            // SAFETY: attn_scores(qkv, k, scores, pos, layer, cap, n_head,
            // n_kv, hd, scale, w): one token's qkv row, the cache as above,
            // scores n_head × cap floats (allocated with the state), written
            // for positions <= pos < cap; hd <= MAX_HD.
            unsafe {
                kernels::launch(
                    s,
                    &self.kernels.attn_scores,
                    cfg((blocks, c.n_head as u32), kernels::SCORE_THREADS, 0),
                    &[
                        &[
                            Arg::Ptr(qkv),
                            Arg::Ptr(kc),
                            Arg::Ptr(dptr(&st.scores, s)),
                            Arg::Ptr(pos),
                        ][..],
                        &head,
                    ]
                    .concat(),
                )
            }
            .map_err(ModelError::Backend)?;
        }
        // SAFETY: attention(qkv, k, v, scores, out, outq, pos, layer, cap,
        // n_head, n_kv, hd, scale, w, decode): as above; scores null or
        // attn_scores' output (n == 1); out holds n × d floats, outq (the
        // xq scratch, or null) n × d / 32 blocks; hd <= MAX_HD (checked at
        // load), w is 8 or 16.
        unsafe {
            kernels::launch(
                s,
                &self.kernels.attention,
                cfg((n as u32, c.n_head as u32), kernels::ATT_THREADS, 0),
                &[
                    &[
                        Arg::Ptr(qkv),
                        Arg::Ptr(kc),
                        Arg::Ptr(vc),
                        Arg::Ptr(if split { dptr(&st.scores, s) } else { 0 }),
                        Arg::Ptr(attn),
                        Arg::Ptr(outq),
                        Arg::Ptr(pos),
                    ][..],
                    &head,
                    // The CPU's one-token steps sum in ggml_vec_dot_f16's
                    // order, longer ones in tinyBLAS's.
                    &[Arg::I32((n == 1) as i32)],
                ]
                .concat(),
            )
        }
        .map_err(ModelError::Backend)
    }

    /// Layer `l`'s feed-forward block: the attention output added and
    /// RMSNorm, the gate/up product, SiLU·up (quantised for the down
    /// product) and the down product into `proj`.
    fn enqueue_ffn_block(
        &self,
        p: Pass,
        n: usize,
        l: usize,
        ffn_order: Order,
    ) -> Result<(), ModelError> {
        let c = &self.config;
        let s = p.s;
        let lw = &self.weights.layers[l];
        let d = c.n_embd;
        let sc = p.sc;
        let (x, xq, xa) = (dptr(&sc.x, s), dptr(&sc.xq, s), dptr(&sc.xa, s));
        let (proj, gu) = (dptr(&sc.proj, s), dptr(&sc.gu, s));
        let needs = Needs::of(lw.wgu.parts());
        let a = self.add_norm_quant(p, x, proj, &lw.ffn_norm, n, needs)?;
        self.fused(p, &lw.wgu, a, gu, n, 2 * c.n_ff, ffn_order)?;
        let warps = n * c.n_ff / QK;
        let needs = Needs::of(std::slice::from_ref(&lw.w_down));
        // SAFETY: swiglu_quant(gu, out, outf, n, n_ff, w): gu holds n ×
        // 2·n_ff floats, the xq scratch n × n_ff / 32 blocks and xa n × n_ff
        // floats (either null: not written); n_ff % 32 == 0 (the down
        // matrix's columns).
        unsafe {
            kernels::launch(
                s,
                &self.kernels.swiglu_quant,
                kernels::per_warp(warps),
                &[
                    Arg::Ptr(gu),
                    Arg::Ptr(if needs.q8_1 { xq } else { 0 }),
                    Arg::Ptr(if needs.f32 || needs.q8k { xa } else { 0 }),
                    Arg::I32(n as i32),
                    Arg::I32(c.n_ff as i32),
                    Arg::I32(self.lanes),
                ],
            )
        }
        .map_err(ModelError::Backend)?;
        if needs.q8k {
            self.quantize_q8_k(p, xa, n * c.n_ff)?;
        }
        self.mm(p, &lw.w_down, self.acts(p, xa), proj, n, d, 0, ffn_order)
    }

    /// The last layer's residual add, the final norm and the output product,
    /// for the last token only.
    pub(super) fn enqueue_output(&self, st: &CudaState, n: usize) -> Result<(), ModelError> {
        let p = Pass::seq(st);
        let s = p.s;
        let d = self.config.n_embd;
        let w = &self.weights;
        let last = ((n - 1) * d * size_of::<f32>()) as u64;
        let (x, proj) = (dptr(&st.scratch.x, s), dptr(&st.scratch.proj, s));
        let add = if w.layers.is_empty() { 0 } else { proj + last };
        let out = w.output();
        let needs = Needs::of(std::slice::from_ref(out));
        let a = self.add_norm_quant(p, x + last, add, &w.output_norm, 1, needs)?;
        // One output row: the one-row orders (as on the CPU).
        let order = Order::of_step(1, true);
        self.mm(p, out, a, dptr(&st.logits, s), 1, out.rows, 0, order)
    }

    /// A batched step's head: every row's last residual add, the final
    /// norm and the output product (one-row orders, as each sequence's own
    /// step), into `logits` (n rows of n_vocab), then each row copied into
    /// its sequence's logits buffer (the descriptors at `desc`).
    pub(super) fn enqueue_output_batch(
        &self,
        p: Pass,
        n: usize,
        desc: u64,
        logits: u64,
    ) -> Result<(), ModelError> {
        let s = p.s;
        let w = &self.weights;
        let (x, proj) = (dptr(&p.sc.x, s), dptr(&p.sc.proj, s));
        let add = if w.layers.is_empty() { 0 } else { proj };
        let out = w.output();
        let needs = Needs::of(std::slice::from_ref(out));
        let a = self.add_norm_quant(p, x, add, &w.output_norm, n, needs)?;
        let order = Order::of_step(1, true);
        self.mm(p, out, a, logits, n, out.rows, 0, order)?;
        // SAFETY: scatter_logits(src, rows, n_vocab): src holds n × n_vocab
        // floats (the batch's logits, n_vocab = the output rows), `rows` n
        // descriptors whose logits buffers hold at least n_vocab floats
        // (checked before the step).
        unsafe {
            kernels::launch(
                s,
                &self.kernels.scatter_logits,
                cfg(
                    (
                        (out.rows as u32).div_ceil(kernels::ELEMENTWISE_THREADS),
                        n as u32,
                    ),
                    kernels::ELEMENTWISE_THREADS,
                    0,
                ),
                &[Arg::Ptr(logits), Arg::Ptr(desc), Arg::I32(out.rows as i32)],
            )
        }
        .map_err(ModelError::Backend)
    }
}
