// samplerd's CUDA kernels, compiled at start-up with NVRTC (no toolkit
// headers needed: f16 conversions are inline PTX, no <cuda_fp16.h>). This
// file holds what every weight format shares (the activation kernels,
// RoPE, attention, SwiGLU); the weight products and embedding lookups are
// in q32.cu (Q8_0, Q4_1, Q5_0, Q5_1), kquant.cu (Q4_K, Q5_K, Q6_K) and
// half.cu (F16, BF16), the device sampling in sampling.cu; they are
// compiled as one source, in that order (cuda/source.rs).
//
// The forward kernels reproduce server/model/src/cpu/forward/ bit for bit:
// every weight matrix in the CPU loader's block format (f32 scales, the
// quants as stored, uploaded as is), the activations of each product in
// the form its weights take on the CPU (Q8_1 blocks for the 32-value
// formats, Q8_K for the K-quants, f32 rounded to f16 / bf16 for the half
// formats), the weight products in the CPU kernels' exact arithmetic
// (integer lane sums, one fma per lane and block, the same horizontal
// sums, in whichever order crate::cpu::forward picks for the step), and
// attention / SiLU in crate::ggml's arithmetic (ggml's expf, the lane
// orders of llama.cpp's AVX2 or AVX-512 build, whichever the CPU backend
// uses). Only the order of the f64 sum in RMSNorm differs. Compiled with
// --fmad=false: every fused multiply-add below is explicit.

#define F_INF __int_as_float(0x7f800000)
#define F_MAX __int_as_float(0x7f7fffff)

// Q8_1 activation blocks (llama.cpp's block_q8_1, scales widened to f32).
struct bq8_1 { float d; float s; signed char qs[32]; };

#ifndef SAMPLERD_CUDA_EMULATION
__device__ __forceinline__ unsigned short f2h(float f) {
    unsigned short h;
    asm("cvt.rn.f16.f32 %0, %1;" : "=h"(h) : "f"(f));
    return h;
}
__device__ __forceinline__ float h2f(unsigned short h) {
    float f;
    asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(h));
    return f;
}
#endif // (cuda/emulation/prelude.h defines both for the CPU emulation test)
__device__ __forceinline__ float round_f16(float f) { return h2f(f2h(f)); }

// ---------------------------------------------------------------- forward

// ggml's vectorised expf (`ggml_v_expf`), one lane, bit for bit as
// crate::ggml::expf::expf_lane computes it: `w16` selects the AVX-512 variant
// (scalef), else the AVX2 one. The CPU backend uses this in softmax and
// SiLU; the GPU must too, or the two drift apart by the size of the
// difference between llama.cpp's AVX2 and AVX-512 builds (~2e-2 relative).
__device__ __forceinline__ double pow2_f64(float n) {
    return __longlong_as_double(((long long)n + 1023LL) << 52);
}
__device__ __forceinline__ float pow2_f32(float n) { return __int_as_float(((int)n + 127) << 23); }

__device__ float ggml_expf(float x, int w16) {
    const float r = __int_as_float(0x4b400000);     // 0x1.8p23
    const float z = fmaf(x, __int_as_float(0x3fb8aa3b), r);
    const float n = __fsub_rn(z, r);
    const float b = fmaf(-n, __int_as_float(0x35bfbe8e), fmaf(-n, __int_as_float(0x3f317200), x));
    const float u = __fmul_rn(b, b);
    const float p = fmaf(fmaf(__int_as_float(0x3c072010), b, __int_as_float(0x3d2b9f17)), u,
                         fmaf(__int_as_float(0x3e2aaf33), b, __int_as_float(0x3efffedb)));
    if (fabsf(n) > 192.0f || n != n) {
        return x > 0.0f ? F_INF : (x != x ? x : 0.0f);
    }
    const float c1 = __int_as_float(0x3f7ffff6);
    if (w16) {
        const float j = fmaf(p, u, fmaf(c1, b, 1.0f));
        if (n >= -125.0f && n <= 127.0f) return __fmul_rn(j, pow2_f32(n));
        return (float)__dmul_rn((double)j, pow2_f64(n));
    }
    const float j = fmaf(p, u, __fmul_rn(c1, b));
    if (fabsf(n) > 126.0f) return (float)__dmul_rn(__dadd_rn((double)j, 1.0), pow2_f64(n));
    const float k = pow2_f32(n);
    return fmaf(j, k, k);
}

// Horizontal sums in the CPU's lane orders (crate::ggml): 16 lanes as GCC's
// _mm512_reduce_add_ps, 8 lanes as hsum_float_8, and the last step of
// GGML_F32x8_REDUCE (ggml_vec_dot_f16, AVX2).
__device__ __forceinline__ float reduce16(const float* v) {
    float t3[8], t6[4];
#pragma unroll
    for (int k = 0; k < 8; ++k) t3[k] = __fadd_rn(v[8 + k], v[k]);
#pragma unroll
    for (int m = 0; m < 4; ++m) t6[m] = __fadd_rn(t3[4 + m], t3[m]);
    return __fadd_rn(__fadd_rn(t6[0], t6[2]), __fadd_rn(t6[1], t6[3]));
}
__device__ __forceinline__ float reduce8(const float* v) {
    const float t0 = __fadd_rn(v[4], v[0]), t1 = __fadd_rn(v[5], v[1]);
    const float t2 = __fadd_rn(v[6], v[2]), t3 = __fadd_rn(v[7], v[3]);
    return __fadd_rn(__fadd_rn(t0, t2), __fadd_rn(t1, t3));
}
__device__ __forceinline__ float reduce8_vec_dot(const float* x) {
    const float t0 = __fadd_rn(x[0], x[4]), t1 = __fadd_rn(x[1], x[5]);
    const float t2 = __fadd_rn(x[2], x[6]), t3 = __fadd_rn(x[3], x[7]);
    return __fadd_rn(__fadd_rn(t0, t1), __fadd_rn(t2, t3));
}

// llama.cpp's quantize_row_q8_1 (AVX2 path) of one 32-value block held one
// value per lane of a warp; lane 0 writes the scales.
__device__ __forceinline__ void quantize_block_warp(float v, bq8_1* b, int lane) {
    float amax = fabsf(v);
    for (int o = 16; o > 0; o >>= 1) amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, o));
    const float d = __fdiv_rn(amax, 127.0f);
    const float id = amax != 0.0f ? __fdiv_rn(127.0f, amax) : 0.0f;
    const int q = (int)rintf(__fmul_rn(v, id));
    int sum = q;
    for (int o = 16; o > 0; o >>= 1) sum += __shfl_xor_sync(0xffffffffu, sum, o);
    b->qs[lane] = (signed char)q;
    if (lane == 0) {
        b->d = round_f16(d);
        b->s = round_f16(__fmul_rn(d, (float)sum));
    }
}

// One warp per 32-value block.
extern "C" __global__ void quantize_q8_1(const float* x, bq8_1* out, int n_blocks) {
    const int warp = (blockIdx.x * blockDim.x + threadIdx.x) / 32;
    const int lane = threadIdx.x % 32;
    if (warp >= n_blocks) return;
    quantize_block_warp(x[(size_t)warp * 32 + lane], out + warp, lane);
}

// Per row of d values (one block of NORM_THREADS per row): optionally the
// residual add x += add (written back), then RMSNorm (sum of squares in
// f64 like ggml's CPU path) times w, quantised straight to Q8_1 blocks
// when `out` is set (d % 32 == 0) and kept as f32 in `outf` when set (the
// input of F16/BF16 products and of quantize_q8_k). Replaces add +
// rms_norm + quantize_q8_1 (three launches).
#define NORM_THREADS 256
extern "C" __global__ void add_norm_quant(float* x, const float* add, const float* w, bq8_1* out, float* outf,
                                          int d, float eps) {
    __shared__ double part[NORM_THREADS];
    float* xr = x + (size_t)blockIdx.x * d;
    const float* ar = add ? add + (size_t)blockIdx.x * d : 0;
    bq8_1* orow = out ? out + (size_t)blockIdx.x * (d / 32) : 0;
    float* frow = outf ? outf + (size_t)blockIdx.x * d : 0;
    double s = 0.0;
    for (int i = threadIdx.x; i < d; i += NORM_THREADS) {
        float v = xr[i];
        if (ar) {
            v = __fadd_rn(v, ar[i]);
            xr[i] = v;
        }
        s += (double)__fmul_rn(v, v);
    }
    part[threadIdx.x] = s;
    __syncthreads();
    for (int o = NORM_THREADS / 2; o > 0; o >>= 1) {
        if (threadIdx.x < o) part[threadIdx.x] += part[threadIdx.x + o];
        __syncthreads();
    }
    const float scale = __fdiv_rn(1.0f, __fsqrt_rn(__fadd_rn((float)(part[0] / (double)d), eps)));
    const int lane = threadIdx.x % 32;
    for (int b = threadIdx.x / 32; b < d / 32; b += NORM_THREADS / 32) {
        const int i = b * 32 + lane;
        const float v = __fmul_rn(__fmul_rn(xr[i], scale), w[i]);
        if (frow) frow[i] = v;
        if (orow) quantize_block_warp(v, orow + b, lane); // (uniform branch: whole warps)
    }
}

__device__ __forceinline__ int load_i32(const void* p) { return *(const int*)p; }

// hsum_float_8 over the eight lanes of a row (lanes 0..7 of a group of 8).
__device__ __forceinline__ float hsum8_group(float acc) {
    // lane l holds acc[l]; t[i] = acc[i] + acc[i+4]; (t0 + t2) + (t1 + t3)
    const float hi = __shfl_down_sync(0xffffffffu, acc, 4, 8);
    const float t = __fadd_rn(acc, hi);                     // valid in lanes 0..3
    const float t2 = __shfl_down_sync(0xffffffffu, t, 2, 8); // lane 0: t2, lane 1: t3
    const float u = __fadd_rn(t, t2);                        // lane 0: t0+t2, lane 1: t1+t3
    const float u1 = __shfl_down_sync(0xffffffffu, u, 1, 8);
    return __fadd_rn(u, u1);                                 // lane 0: result
}

// Rows (one warp each) per block of the mmw_* weight-product kernels.
#define MMW_WARPS 4

#define MAX_HD 128

// One row of a batched decode step (one sequence's next token): where its
// sequence's K/V cache, attention scores and logits are, its position and
// its cache's capacity. Six 64-bit words (the host packs them as u64s).
struct BatchRow {
    unsigned short* k;
    unsigned short* v;
    float* scores;
    float* logits;
    long long pos;
    long long cap;
};

// Head j of qkv row t at position `pos` (the body of qkv_rope_store and
// qkv_rope_store_batch; see there).
__device__ __forceinline__ void rope_store_head(float* qkv, const float* bias, const float* rope, int t, int j,
                                                int pos, int n_head, int n_kv, int hd, int n_pairs, int neox,
                                                unsigned short* kc, unsigned short* vc, int layer, int cap) {
    __shared__ float seg[MAX_HD];
    const int d = n_head * hd;
    const int dkv = n_kv * hd;
    const int rows = d + 2 * dkv;
    float* row = qkv + (size_t)t * rows;
    const int off = j < n_head ? j * hd : d + (j - n_head) * hd;
    for (int i = threadIdx.x; i < hd; i += blockDim.x) {
        float v = row[off + i];
        if (bias) v = __fadd_rn(v, bias[off + i]);
        seg[i] = v;
    }
    __syncthreads();
    const float* tab = rope + (size_t)pos * n_pairs * 2;
    for (int i = threadIdx.x; i < n_pairs; i += blockDim.x) {
        const int a = neox ? i : 2 * i;
        const int b = neox ? i + n_pairs : 2 * i + 1;
        const float c = tab[2 * i], s = tab[2 * i + 1];
        const float x0 = seg[a], x1 = seg[b];
        const float ra = fmaf(x0, c, -__fmul_rn(x1, s));
        const float rb = fmaf(x0, s, __fmul_rn(x1, c));
        seg[a] = ra; // each thread owns its pair: no race
        seg[b] = rb;
    }
    __syncthreads();
    if (j < n_head) {
        for (int i = threadIdx.x; i < hd; i += blockDim.x) row[off + i] = seg[i];
    } else {
        const int g = j - n_head;
        const size_t base = (((size_t)layer * n_kv + g) * cap + pos) * hd;
        const int voff = d + dkv + g * hd;
        for (int i = threadIdx.x; i < hd; i += blockDim.x) {
            kc[base + i] = f2h(seg[i]);
            float v = row[voff + i];
            if (bias) v = __fadd_rn(v, bias[voff + i]);
            vc[base + i] = f2h(v);
        }
    }
}

// Per (token, head): adds the qkv bias (qwen2), applies RoPE (rope table
// rows precomputed on the host with the CPU's iterative theta), and for
// k heads writes K and V into the f16 cache at position pos0 + t.
// grid = (n_tok, n_head + n_kv), block = 64.
extern "C" __global__ void qkv_rope_store(float* qkv, const float* bias, const float* rope, const int* pos_ptr,
                                          int n_head, int n_kv, int hd, int n_pairs, int neox,
                                          unsigned short* kc, unsigned short* vc, int layer, int cap) {
    rope_store_head(qkv, bias, rope, blockIdx.x, blockIdx.y, *pos_ptr + blockIdx.x, n_head, n_kv, hd, n_pairs,
                    neox, kc, vc, layer, cap);
}

// The same for a batched decode step: row t is sequence t's one token, at
// rows[t].pos, its K and V stored in rows[t]'s cache.
// grid = (n_rows, n_head + n_kv), block = 64.
extern "C" __global__ void qkv_rope_store_batch(float* qkv, const float* bias, const float* rope,
                                                const BatchRow* rows, int n_head, int n_kv, int hd, int n_pairs,
                                                int neox, int layer) {
    const BatchRow r = rows[blockIdx.x];
    rope_store_head(qkv, bias, rope, blockIdx.x, blockIdx.y, (int)r.pos, n_head, n_kv, hd, n_pairs, neox, r.k, r.v,
                    layer, (int)r.cap);
}

#define ATT_THREADS 256
#define ATT_CHUNK 256                  // positions per pass step (a multiple of 4 * 16)
#define MAX_LANES 64                   // 4 vectors of 16 lanes (ggml_vec_dot_f16, AVX-512)
#define ATT_ACC (MAX_LANES * MAX_HD / ATT_THREADS)

__device__ float block_max(float v, float* red) {
    for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
    if (threadIdx.x % 32 == 0) red[threadIdx.x / 32] = v;
    __syncthreads();
    float m = red[0];
    for (int w = 1; w < ATT_THREADS / 32; ++w) m = fmaxf(m, red[w]);
    __syncthreads();
    return m;
}

// K . q16 in ggml_vec_dot_f16's order (a one-token step on the CPU): lanes
// i % 4w over full steps of 4w, the four vectors added pairwise, a
// horizontal sum, leftovers added in f64.
__device__ float kq_decode(const float* q, const unsigned short* k, int n, int w) {
    const int step = 4 * w;
    const int np = n / step * step;
    float x[16];
#pragma unroll
    for (int e = 0; e < 16; ++e) {
        float l0 = 0.0f, l1 = 0.0f, l2 = 0.0f, l3 = 0.0f;
        if (e < w) {
            for (int c = 0; c < np; c += step) {
                l0 = fmaf(q[c + e], h2f(k[c + e]), l0);
                l1 = fmaf(q[c + w + e], h2f(k[c + w + e]), l1);
                l2 = fmaf(q[c + 2 * w + e], h2f(k[c + 2 * w + e]), l2);
                l3 = fmaf(q[c + 3 * w + e], h2f(k[c + 3 * w + e]), l3);
            }
        }
        x[e] = __fadd_rn(__fadd_rn(l0, l2), __fadd_rn(l1, l3));
    }
    double s = w == 16 ? (double)reduce16(x) : (double)reduce8_vec_dot(x);
    for (int i = np; i < n; ++i) s = __dadd_rn(s, (double)__fmul_rn(q[i], h2f(k[i])));
    return (float)s;
}

// K . q16 in tinyBLAS's order (a multi-token step on the CPU): lanes i % w,
// one fma chain each, a horizontal sum, the tail added in f32.
__device__ float kq_prefill(const float* q, const unsigned short* k, int n, int w) {
    float l[16];
#pragma unroll
    for (int e = 0; e < 16; ++e) l[e] = 0.0f;
    int c = 0;
    for (; c + w <= n; c += w) {
#pragma unroll
        for (int e = 0; e < 16; ++e) {
            if (e < w) l[e] = fmaf(q[c + e], h2f(k[c + e]), l[e]);
        }
    }
    float s = w == 16 ? reduce16(l) : reduce8(l);
    for (int i = c; i < n; ++i) s = __fadd_rn(s, __fmul_rn(q[i], h2f(k[i])));
    return s;
}

__device__ __forceinline__ float kq_score(const float* q, const unsigned short* k, int hd, int w, int decode,
                                          float scale) {
    return __fmul_rn(decode ? kq_decode(q, k, hd, w) : kq_prefill(q, k, hd, w), scale);
}

// The scaled scores K . q16 of one-token steps, spread over many blocks
// (attention's own passes would otherwise compute them serially in one
// block per head): scores[h * cap + p] for p < pos0 + 1, each exactly as
// attention's kq_score computes it. grid = (blocks, n_head), block =
// SCORE_THREADS; positions are grid-strided so one launch shape (captured
// in the decode graph) serves every position.
#define SCORE_THREADS 128
__device__ __forceinline__ void scores_head(const float* qrow, const unsigned short* kc, float* scores, int n_pos,
                                            int layer, int cap, int n_head, int n_kv, int hd, float scale, int w) {
    __shared__ float q[MAX_HD];
    const int h = blockIdx.y;
    const int g = h / (n_head / n_kv);
    for (int i = threadIdx.x; i < hd; i += SCORE_THREADS) q[i] = round_f16(qrow[h * hd + i]);
    __syncthreads();
    const unsigned short* K = kc + ((size_t)layer * n_kv + g) * cap * hd;
    for (int ps = blockIdx.x * SCORE_THREADS + threadIdx.x; ps < n_pos; ps += gridDim.x * SCORE_THREADS)
        scores[(size_t)h * cap + ps] = kq_score(q, K + (size_t)ps * hd, hd, w, 1, scale);
}
extern "C" __global__ void attn_scores(const float* qkv, const unsigned short* kc, float* scores, const int* pos_ptr,
                                       int layer, int cap, int n_head, int n_kv, int hd, float scale, int w) {
    scores_head(qkv, kc, scores, *pos_ptr + 1, layer, cap, n_head, n_kv, hd, scale, w);
}

// The same for a batched decode step: grid.z = row t, sequence t's query
// (qkv row t) against its own cache, into its own scores buffer. Blocks
// whose positions lie beyond the row's own (shorter rows) do nothing.
extern "C" __global__ void attn_scores_batch(const float* qkv, const BatchRow* rows, int layer, int n_head, int n_kv,
                                             int hd, float scale, int w) {
    const int t = blockIdx.z;
    const BatchRow r = rows[t];
    const float* qrow = qkv + (size_t)t * (n_head * hd + 2 * n_kv * hd);
    scores_head(qrow, r.k, r.scores, (int)r.pos + 1, layer, (int)r.cap, n_head, n_kv, hd, scale, w);
}

// Causal grouped-query attention of token t, head h over cache positions
// 0..pos0+t, in crate::ggml::attention::attention_head's exact arithmetic (`w` = 8 or
// 16 lanes: the CPU flavour; `decode`: the step runs one token): scores
// K . q16 (query rounded to f16) in the CPU's lane order, softmax with
// ggml's expf, each vector of w exponentials summed horizontally and the
// sums accumulated in f64 in order, probabilities rounded to f16, then
// V . p16 with lanes p % nl (nl = 4w decode, w prefill) and the CPU's final
// reduction. Scores are recomputed in each pass (bit-identical) instead of
// stored, unless `scores` holds them (one-token steps, from attn_scores).
// With `outq` (hd % 32 == 0) the output is also quantised to Q8_1 there,
// which saves the separate quantize_q8_1 launch.
// grid = (n_tok, n_head), block = ATT_THREADS.
//
// attention_head is the body for head blockIdx.y of qkv row t over the
// n_pos cached positions of one sequence (attention, attention_batch).
__device__ __forceinline__ void attention_head(const float* qkv, const unsigned short* kc, const unsigned short* vc,
                                               const float* scores, float* out, bq8_1* outq, int t, int n_pos,
                                               int layer, int cap, int n_head, int n_kv, int hd, float scale, int w,
                                               int decode) {
    __shared__ float q[MAX_HD];
    __shared__ float ex[ATT_CHUNK];
    __shared__ float vsum[ATT_CHUNK / 8];
    __shared__ float redf[ATT_THREADS / 32];
    __shared__ float accs[MAX_LANES * MAX_HD];
    __shared__ double total;
    const int tid = threadIdx.x;
    const int h = blockIdx.y;
    const int g = h / (n_head / n_kv);
    const int d = n_head * hd;
    const int rows = d + 2 * n_kv * hd;
    for (int i = tid; i < hd; i += ATT_THREADS) q[i] = round_f16(qkv[(size_t)t * rows + h * hd + i]);
    if (tid == 0) total = 0.0;
    __syncthreads();
    const size_t base = ((size_t)layer * n_kv + g) * cap * hd;
    const unsigned short* K = kc + base;
    const unsigned short* V = vc + base;
    const int w16 = w == 16;
    const float* sc = scores ? scores + (size_t)h * cap : 0;
#define SCORE(ps) (sc ? sc[ps] : kq_score(q, K + (size_t)(ps) * hd, hd, w, decode, scale))
    // Pass 1: the maximum score (exact in any order).
    float m = -F_INF;
    for (int ps = tid; ps < n_pos; ps += ATT_THREADS) m = fmaxf(m, SCORE(ps));
    m = block_max(m, redf);
    // Pass 2: the softmax denominator, vector by vector as the CPU sums it.
    for (int c0 = 0; c0 < n_pos; c0 += ATT_CHUNK) {
        const int ps = c0 + tid;
        ex[tid] = ps < n_pos ? ggml_expf(__fsub_rn(SCORE(ps), m), w16)
                             : 0.0f;
        __syncthreads();
        const int nvec = (min(ATT_CHUNK, n_pos - c0) + w - 1) / w;
        if (tid < nvec) vsum[tid] = w16 ? reduce16(ex + tid * 16) : reduce8(ex + tid * 8);
        __syncthreads();
        if (tid == 0) {
            double s = total;
            for (int v = 0; v < nvec; ++v) s = __dadd_rn(s, (double)vsum[v]);
            total = s;
        }
        __syncthreads();
    }
    const float inv = (float)(1.0 / total);
    // Pass 3: probabilities (f16) and the lane accumulators acc[e][dim],
    // e = p % nl, each an fma chain over its positions in order. Thread
    // tid owns pairs i = tid + k * ATT_THREADS, e = i / hd, dim = i % hd.
    const int nl = decode ? 4 * w : w;
    const int npairs = nl * hd;
    float acc[ATT_ACC];
#pragma unroll
    for (int k = 0; k < ATT_ACC; ++k) acc[k] = 0.0f;
    for (int c0 = 0; c0 < n_pos; c0 += ATT_CHUNK) {
        const int ps = c0 + tid;
        ex[tid] = ps < n_pos
            ? round_f16(__fmul_rn(ggml_expf(__fsub_rn(SCORE(ps), m), w16), inv))
            : 0.0f;
        __syncthreads();
        const int nc = min(ATT_CHUNK, n_pos - c0);
#pragma unroll
        for (int k = 0; k < ATT_ACC; ++k) {
            const int i = tid + k * ATT_THREADS;
            if (i < npairs) {
                const int e = i / hd, dim = i % hd;
                float a = acc[k];
                for (int j = e; j < nc; j += nl) a = fmaf(ex[j], h2f(V[(size_t)(c0 + j) * hd + dim]), a);
                acc[k] = a;
            }
        }
        __syncthreads();
    }
#pragma unroll
    for (int k = 0; k < ATT_ACC; ++k) {
        const int i = tid + k * ATT_THREADS;
        if (i < npairs) accs[i] = acc[k];
    }
    __syncthreads();
    const size_t o = (size_t)t * d + h * hd;
    // hd <= MAX_HD <= ATT_THREADS: one dimension per thread, whole warps.
    if (tid < hd) {
        const int dim = tid;
        float x[16];
        float val;
        if (decode) {
#pragma unroll
            for (int e = 0; e < 16; ++e) {
                x[e] = e < w ? __fadd_rn(__fadd_rn(accs[e * hd + dim], accs[(2 * w + e) * hd + dim]),
                                         __fadd_rn(accs[(w + e) * hd + dim], accs[(3 * w + e) * hd + dim]))
                             : 0.0f;
            }
            val = w16 ? reduce16(x) : reduce8_vec_dot(x);
        } else {
#pragma unroll
            for (int e = 0; e < 16; ++e) x[e] = e < w ? accs[e * hd + dim] : 0.0f;
            val = w16 ? reduce16(x) : reduce8(x);
        }
        out[o + dim] = val;
        if (outq) quantize_block_warp(val, outq + (o + dim) / 32, tid % 32);
    }
}
#undef SCORE

extern "C" __global__ void attention(const float* qkv, const unsigned short* kc, const unsigned short* vc,
                                     const float* scores, float* out, bq8_1* outq, const int* pos_ptr, int layer,
                                     int cap, int n_head, int n_kv, int hd, float scale, int w, int decode) {
    attention_head(qkv, kc, vc, scores, out, outq, blockIdx.x, *pos_ptr + blockIdx.x + 1, layer, cap, n_head, n_kv,
                   hd, scale, w, decode);
}

// A batched decode step's attention: row t (blockIdx.x) is sequence t's
// one token over its own cache (rows[t]: positions 0..pos, capacity),
// in the one-token step's order (decode = 1), with the scores from
// attn_scores_batch in rows[t].scores when `split` is set. Out and outq as
// for attention (row t of n_rows). grid = (n_rows, n_head), block =
// ATT_THREADS.
extern "C" __global__ void attention_batch(const float* qkv, const BatchRow* rows, float* out, bq8_1* outq,
                                           int layer, int n_head, int n_kv, int hd, float scale, int w, int split) {
    const BatchRow r = rows[blockIdx.x];
    attention_head(qkv, r.k, r.v, split ? r.scores : 0, out, outq, blockIdx.x, (int)r.pos + 1, layer, (int)r.cap,
                   n_head, n_kv, hd, scale, w, 1);
}

// Row t of a batched step's logits (n_vocab floats at src + t * n_vocab)
// into its sequence's own logits buffer (rows[t].logits).
// grid = (ceil(n_vocab / ELEMENTWISE_THREADS), n_rows).
extern "C" __global__ void scatter_logits(const float* src, const BatchRow* rows, int n_vocab) {
    const int i = blockIdx.x * blockDim.x + threadIdx.x;
    const int t = blockIdx.y;
    if (i < n_vocab) rows[t].logits[i] = src[(size_t)t * n_vocab + i];
}

// silu(gate) * up per value (gu rows are [gate (n_ff) | up (n_ff)] per
// token) as ggml_vec_swiglu_f32 computes it (ggml's expf on the first
// n_ff / w * w values, libm's on the tail), quantised to Q8_1 blocks when
// `out` is set (n_ff % 32 == 0) and kept as f32 in `outf` when set. One
// warp per block of 32 values.
extern "C" __global__ void swiglu_quant(const float* gu, bq8_1* out, float* outf, int n_tok, int n_ff, int w) {
    const int warp = (blockIdx.x * blockDim.x + threadIdx.x) / 32;
    const int lane = threadIdx.x % 32;
    const int per_tok = n_ff / 32;
    if (warp >= n_tok * per_tok) return;
    const int t = warp / per_tok, c = (warp % per_tok) * 32 + lane;
    const float g = gu[(size_t)t * 2 * n_ff + c];
    const float u = gu[(size_t)t * 2 * n_ff + n_ff + c];
    const float e = c < n_ff / w * w ? ggml_expf(__fsub_rn(0.0f, g), w == 16) : expf(-g);
    const float v = __fmul_rn(__fdiv_rn(g, __fadd_rn(1.0f, e)), u);
    if (outf) outf[(size_t)t * n_ff + c] = v;
    if (out) quantize_block_warp(v, out + warp, lane);
}
