// samplerd's CUDA kernels, compiled at start-up with NVRTC (no toolkit
// headers needed: f16 conversions are inline PTX, no <cuda_fp16.h>).
//
// The forward kernels reproduce server/model/src/forward.rs bit for bit:
// Q8_0 / Q4_1 weight blocks with f32 scales (the CPU loader's unpacked
// formats, uploaded as is), activations quantised to Q8_1 before every
// weight product, the weight products in the CPU kernels' exact arithmetic
// (eight lanes of four integer products per block, one fma per lane and
// block, the same horizontal sum), and attention / SiLU in crate::ggml's
// arithmetic (ggml's expf, the lane orders of llama.cpp's AVX2 or AVX-512
// build, whichever the CPU backend uses). Only the order of the f64 sum in
// RMSNorm differs. Compiled with --fmad=false: every fused multiply-add
// below is explicit.
//
// The sampling kernels implement the device prefix of a sampler chain
// (server/sampling/src/device_prefix.rs documents the semantics; its
// `reference` module is the CPU twin the tests compare against).

#define F_INF __int_as_float(0x7f800000)
#define F_MAX __int_as_float(0x7f7fffff)

struct bq8_0 { float d; signed char qs[32]; };
struct bq4_1 { float d; float m; unsigned char qs[16]; };
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
#endif // (cuda/emu/prelude.h defines both for the CPU emulation test)
__device__ __forceinline__ float round_f16(float f) { return h2f(f2h(f)); }

// ---------------------------------------------------------------- forward

// ggml's vectorised expf (`ggml_v_expf`), one lane, bit for bit as
// crate::ggml::expf_lane computes it: `w16` selects the AVX-512 variant
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

// out[t][:] = dequantised row tok[t] of the embedding (one block per token).
extern "C" __global__ void embed_q8_0(const bq8_0* w, const unsigned int* tok, int cols, float* out) {
    const int t = blockIdx.x;
    const bq8_0* row = w + (size_t)tok[t] * (cols / 32);
    for (int i = threadIdx.x; i < cols; i += blockDim.x) {
        const bq8_0* b = row + i / 32;
        out[(size_t)t * cols + i] = __fmul_rn(b->d, (float)b->qs[i % 32]);
    }
}

extern "C" __global__ void embed_q4_1(const bq4_1* w, const unsigned int* tok, int cols, float* out) {
    const int t = blockIdx.x;
    const bq4_1* row = w + (size_t)tok[t] * (cols / 32);
    for (int i = threadIdx.x; i < cols; i += blockDim.x) {
        const bq4_1* b = row + i / 32;
        const int j = i % 32;
        const int q = j < 16 ? (b->qs[j] & 0x0F) : (b->qs[j - 16] >> 4);
        out[(size_t)t * cols + i] = __fadd_rn(__fmul_rn(b->d, (float)q), b->m);
    }
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
// (d % 32 == 0). Replaces add + rms_norm + quantize_q8_1 (three launches).
#define NORM_THREADS 256
extern "C" __global__ void add_norm_quant(float* x, const float* add, const float* w, bq8_1* out, int d,
                                          float eps) {
    __shared__ double part[NORM_THREADS];
    float* xr = x + (size_t)blockIdx.x * d;
    const float* ar = add ? add + (size_t)blockIdx.x * d : 0;
    bq8_1* orow = out + (size_t)blockIdx.x * (d / 32);
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
        quantize_block_warp(__fmul_rn(__fmul_rn(xr[i], scale), w[i]), orow + b, lane);
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

// The weight products, W[r] . x[t] -> out[t * out_stride + out_off + r], in
// the CPU kernels' exact arithmetic: per row eight lanes, lane l the sum of
// products 4l..4l+3 of every block (integer, exact), one fma chain per
// lane over the blocks in order, then hsum_float_8 (+ the Q4_1 minimum
// term, summed in block order).
//
// One warp per row (MMW_WARPS rows per block): lane j loads blocks j,
// j + 32, ... (coalesced, all loads in flight at once) and leaves its eight
// integer sums and scale products in shared memory; lanes 0..7 then run
// the fma chains over those 32 blocks (lane 8 the minimum term), so only
// the short chains are serial.
#define MMW_WARPS 4
extern "C" __global__ void mmw_q8_0(const bq8_0* __restrict__ w, const bq8_1* __restrict__ x, float* out,
                                    int rows, int nb, int n_tok, int out_stride, int out_off) {
    __shared__ int ss[MMW_WARPS][8][33];
    __shared__ float sd[MMW_WARPS][32];
    const int wid = threadIdx.x / 32, lane = threadIdx.x % 32;
    const int r = blockIdx.x * MMW_WARPS + wid;
    if (r >= rows) return; // the whole warp: only warp-level sync below
    const bq8_0* row = w + (size_t)r * nb;
    for (int t = 0; t < n_tok; ++t) {
        const bq8_1* a = x + (size_t)t * nb;
        float acc = 0.0f;
        for (int b0 = 0; b0 < nb; b0 += 32) {
            const int b = b0 + lane;
            if (b < nb) {
                const bq8_0* wb = row + b;
                const bq8_1* ab = a + b;
#pragma unroll
                for (int l = 0; l < 8; ++l) ss[wid][l][lane] = __dp4a(load_i32(wb->qs + 4 * l), load_i32(ab->qs + 4 * l), 0);
                sd[wid][lane] = __fmul_rn(wb->d, ab->d);
            }
            __syncwarp();
            const int nblk = min(32, nb - b0);
            if (lane < 8) {
                for (int j = 0; j < nblk; ++j) acc = fmaf(sd[wid][j], (float)ss[wid][lane][j], acc);
            }
            __syncwarp();
        }
        const float v = hsum8_group(acc);
        if (lane == 0) out[(size_t)t * out_stride + out_off + r] = v;
    }
}

extern "C" __global__ void mmw_q4_1(const bq4_1* __restrict__ w, const bq8_1* __restrict__ x, float* out,
                                    int rows, int nb, int n_tok, int out_stride, int out_off) {
    __shared__ int ss[MMW_WARPS][8][33];
    __shared__ float sd[MMW_WARPS][32];
    __shared__ float sm[MMW_WARPS][32];
    const int wid = threadIdx.x / 32, lane = threadIdx.x % 32;
    const int r = blockIdx.x * MMW_WARPS + wid;
    if (r >= rows) return; // the whole warp: only warp-level sync below
    const bq4_1* row = w + (size_t)r * nb;
    for (int t = 0; t < n_tok; ++t) {
        const bq8_1* a = x + (size_t)t * nb;
        float acc = 0.0f, summs = 0.0f;
        for (int b0 = 0; b0 < nb; b0 += 32) {
            const int b = b0 + lane;
            if (b < nb) {
                const bq4_1* wb = row + b;
                const bq8_1* ab = a + b;
#pragma unroll
                for (int l = 0; l < 8; ++l) {
                    const int packed = load_i32(wb->qs + 4 * (l & 3));
                    const int q = l < 4 ? (packed & 0x0F0F0F0F) : ((packed >> 4) & 0x0F0F0F0F);
                    ss[wid][l][lane] = __dp4a(q, load_i32(ab->qs + 4 * l), 0);
                }
                sd[wid][lane] = __fmul_rn(wb->d, ab->d);
                sm[wid][lane] = __fmul_rn(wb->m, ab->s);
            }
            __syncwarp();
            const int nblk = min(32, nb - b0);
            if (lane < 8) {
                for (int j = 0; j < nblk; ++j) acc = fmaf(sd[wid][j], (float)ss[wid][lane][j], acc);
            } else if (lane == 8) {
                for (int j = 0; j < nblk; ++j) summs = __fadd_rn(summs, sm[wid][j]);
            }
            __syncwarp();
        }
        const float v = hsum8_group(acc);
        const float m = __shfl_sync(0xffffffffu, summs, 8);
        if (lane == 0) out[(size_t)t * out_stride + out_off + r] = __fadd_rn(v, m);
    }
}

// The first kernels' layout (eight threads per row, each running its lane's
// chain over every block): same results, kept for comparison
// (SAMPLERD_CUDA_MM=lanes). 128 threads = 16 rows per block. Per format:
// lane l's integer sum of four products, and whether there is a minimum
// term (Q4_1's `m * s`, summed in block order).
__device__ __forceinline__ int lane_dot(const bq8_0* w, const bq8_1* a, int l) {
    return __dp4a(load_i32(w->qs + 4 * l), load_i32(a->qs + 4 * l), 0);
}
__device__ __forceinline__ int lane_dot(const bq4_1* w, const bq8_1* a, int l) {
    const int packed = load_i32(w->qs + 4 * (l & 3));
    const int q = l < 4 ? (packed & 0x0F0F0F0F) : ((packed >> 4) & 0x0F0F0F0F);
    return __dp4a(q, load_i32(a->qs + 4 * l), 0);
}
template <class B> struct has_min { static constexpr bool value = false; };
template <> struct has_min<bq4_1> { static constexpr bool value = true; };

template <class B>
__device__ __forceinline__ void mm_lanes(const B* w, const bq8_1* x, float* out, int rows, int nb, int n_tok,
                                         int out_stride, int out_off) {
    const int r = blockIdx.x * (blockDim.x / 8) + threadIdx.x / 8;
    const int l = threadIdx.x % 8;
    // Out-of-range groups compute a copy of the last row (and discard it)
    // so every lane of the warp takes part in the shuffles.
    const bool valid = r < rows;
    const B* row = w + (size_t)(valid ? r : rows - 1) * nb;
    for (int t = 0; t < n_tok; ++t) {
        const bq8_1* a = x + (size_t)t * nb;
        float acc = 0.0f;
        float summs = 0.0f;
        for (int b = 0; b < nb; ++b) {
            if constexpr (has_min<B>::value) summs = __fadd_rn(summs, __fmul_rn(row[b].m, a[b].s));
            const float d = __fmul_rn(row[b].d, a[b].d);
            acc = fmaf(d, (float)lane_dot(row + b, a + b, l), acc);
        }
        const float v = hsum8_group(acc);
        if (valid && l == 0) out[(size_t)t * out_stride + out_off + r] = has_min<B>::value ? __fadd_rn(v, summs) : v;
    }
}

extern "C" __global__ void mm_q8_0(const bq8_0* w, const bq8_1* x, float* out, int rows, int nb, int n_tok,
                                   int out_stride, int out_off) {
    mm_lanes(w, x, out, rows, nb, n_tok, out_stride, out_off);
}

extern "C" __global__ void mm_q4_1(const bq4_1* w, const bq8_1* x, float* out, int rows, int nb, int n_tok,
                                   int out_stride, int out_off) {
    mm_lanes(w, x, out, rows, nb, n_tok, out_stride, out_off);
}

#define MAX_HD 128

// Per (token, head): adds the qkv bias (qwen2), applies RoPE (rope table
// rows precomputed on the host with the CPU's iterative theta), and for
// k heads writes K and V into the f16 cache at position pos0 + t.
// grid = (n_tok, n_head + n_kv), block = 64.
extern "C" __global__ void qkv_rope_store(float* qkv, const float* bias, const float* rope, const int* pos_ptr,
                                          int n_head, int n_kv, int hd, int n_pairs, int neox,
                                          unsigned short* kc, unsigned short* vc, int layer, int cap) {
    __shared__ float seg[MAX_HD];
    const int t = blockIdx.x;
    const int j = blockIdx.y;
    const int pos = *pos_ptr + t;
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
extern "C" __global__ void attn_scores(const float* qkv, const unsigned short* kc, float* scores, const int* pos_ptr,
                                       int layer, int cap, int n_head, int n_kv, int hd, float scale, int w) {
    __shared__ float q[MAX_HD];
    const int h = blockIdx.y;
    const int g = h / (n_head / n_kv);
    const int n_pos = *pos_ptr + 1;
    for (int i = threadIdx.x; i < hd; i += SCORE_THREADS) q[i] = round_f16(qkv[h * hd + i]);
    __syncthreads();
    const unsigned short* K = kc + ((size_t)layer * n_kv + g) * cap * hd;
    for (int ps = blockIdx.x * SCORE_THREADS + threadIdx.x; ps < n_pos; ps += gridDim.x * SCORE_THREADS)
        scores[(size_t)h * cap + ps] = kq_score(q, K + (size_t)ps * hd, hd, w, 1, scale);
}

// Causal grouped-query attention of token t, head h over cache positions
// 0..pos0+t, in crate::ggml::attention_head's exact arithmetic (`w` = 8 or
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
extern "C" __global__ void attention(const float* qkv, const unsigned short* kc, const unsigned short* vc,
                                     const float* scores, float* out, bq8_1* outq, const int* pos_ptr, int layer,
                                     int cap, int n_head, int n_kv, int hd, float scale, int w, int decode) {
    __shared__ float q[MAX_HD];
    __shared__ float ex[ATT_CHUNK];
    __shared__ float vsum[ATT_CHUNK / 8];
    __shared__ float redf[ATT_THREADS / 32];
    __shared__ float accs[MAX_LANES * MAX_HD];
    __shared__ double total;
    const int tid = threadIdx.x;
    const int t = blockIdx.x;
    const int h = blockIdx.y;
    const int g = h / (n_head / n_kv);
    const int n_pos = *pos_ptr + t + 1;
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

// silu(gate) * up per value (gu rows are [gate (n_ff) | up (n_ff)] per
// token) as ggml_vec_swiglu_f32 computes it (ggml's expf on the first
// n_ff / w * w values, libm's on the tail), quantised to Q8_1 blocks
// (n_ff % 32 == 0). One warp per block of 32 values.
extern "C" __global__ void swiglu_quant(const float* gu, bq8_1* out, int n_tok, int n_ff, int w) {
    const int warp = (blockIdx.x * blockDim.x + threadIdx.x) / 32;
    const int lane = threadIdx.x % 32;
    const int per_tok = n_ff / 32;
    if (warp >= n_tok * per_tok) return;
    const int t = warp / per_tok, c = (warp % per_tok) * 32 + lane;
    const float g = gu[(size_t)t * 2 * n_ff + c];
    const float u = gu[(size_t)t * 2 * n_ff + n_ff + c];
    const float e = c < n_ff / w * w ? ggml_expf(__fsub_rn(0.0f, g), w == 16) : expf(-g);
    quantize_block_warp(__fmul_rn(__fdiv_rn(g, __fadd_rn(1.0f, e)), u), out + warp, lane);
}

// --------------------------------------------------------------- sampling

// Status words written by the sampling kernels (read back with the result).
#define ST_OK 0
#define ST_BAD_LOGIT 1   // NaN or +inf: the host reruns on the CPU for the exact error
#define ST_NO_FINITE 2   // every candidate is -inf: the host reruns on the CPU

// Flags NaN / +inf, and a vocabulary with no finite entry (as
// TokenBuffer::load rejects them). One block of 1024 threads.
extern "C" __global__ void check_logits(const float* x, int n, int* status) {
    __shared__ int bad, finite;
    if (threadIdx.x == 0) { bad = 0; finite = 0; }
    __syncthreads();
    int b = 0, f = 0;
    for (int i = threadIdx.x; i < n; i += blockDim.x) {
        const float v = x[i];
        b |= (v != v) | (v == F_INF);
        f |= v > -F_INF;
    }
    if (b) atomicOr(&bad, 1);
    if (f) atomicOr(&finite, 1);
    __syncthreads();
    if (threadIdx.x == 0) *status = bad ? ST_BAD_LOGIT : (finite ? ST_OK : ST_NO_FINITE);
}

// `nw`, computed from the logit `old`, kept finite as the core stages do
// (plugins/core util::saturate): a masked logit stays masked, others are
// clamped to +-FLT_MAX instead of overflowing.
__device__ __forceinline__ float saturate(float old, float nw) {
    return old == -F_INF ? old : fminf(fmaxf(nw, -F_MAX), F_MAX);
}

// logit_bias: runs r = [starts[r], starts[r+1]) of (ids, bias) share one id
// and are added in the order given (one thread per run: no races, and the
// float additions happen in the CPU stage's order).
extern "C" __global__ void logit_bias(float* x, int n, const unsigned int* ids, const float* bias,
                                      const int* starts, int n_runs) {
    const int r = blockIdx.x * blockDim.x + threadIdx.x;
    if (r >= n_runs) return;
    const unsigned int id = ids[starts[r]];
    if (id >= (unsigned int)n) return;
    float v = x[id];
    for (int e = starts[r]; e < starts[r + 1]; ++e) {
        const float b = bias[e];
        v = b == -F_INF ? b : saturate(v, __fadd_rn(v, b));
    }
    x[id] = v;
}

// penalties over the window's distinct ids: the repeat rule, then
// logit -= count * frequency + (count > 0) * presence.
extern "C" __global__ void penalties(float* x, int n, const unsigned int* ids, const unsigned int* counts,
                                     int n_ids, float repeat, float frequency, float presence) {
    const int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= n_ids) return;
    const unsigned int id = ids[i];
    if (id >= (unsigned int)n) return;
    const unsigned int c = counts[i];
    const float logit = x[id];
    float l = logit <= 0.0f ? __fmul_rn(logit, repeat) : __fdiv_rn(logit, repeat);
    l = saturate(logit, l);
    const float sub = __fadd_rn(__fmul_rn((float)c, frequency), c > 0 ? presence : 0.0f);
    x[id] = saturate(logit, __fsub_rn(l, sub));
}

extern "C" __global__ void scale_temperature(float* x, int n, float t) {
    const int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) x[i] = saturate(x[i], __fdiv_rn(x[i], t));
}

// Order-preserving key of a logit (-0 and +0 equal, as float compares).
__device__ __forceinline__ unsigned int okey(float v) {
    const unsigned int u = __float_as_uint(v + 0.0f);
    return (u & 0x80000000u) ? ~u : (u | 0x80000000u);
}

#define TOPK_THREADS 1024
#define TOPK_MAX 1024

// The k highest logits (ties: lower id first), sorted descending: the CPU
// top_k stage's dense-view result, and with k = 1 the first maximum that
// greedy and temperature <= 0 keep. One block: a 4-pass radix select of the
// k-th largest key, a gather (ties taken in id order), a bitonic sort.
// out: [status, count, then (id, logit bits) pairs].
extern "C" __global__ void top_k(const float* x, int n, int k, const int* status_in, unsigned int* out) {
    __shared__ unsigned int hist[256];
    __shared__ unsigned int prefix, mask, remaining, n_gt, n_tie_base;
    __shared__ bool gather_done;
    __shared__ unsigned long long items[TOPK_MAX];
    __shared__ unsigned int warp_sums[TOPK_THREADS / 32];
    const int tid = threadIdx.x;
    if (*status_in != ST_OK) {
        if (tid == 0) { out[0] = (unsigned int)*status_in; out[1] = 0; }
        return;
    }
    if (k > n) k = n;
    if (tid == 0) { prefix = 0; mask = 0; remaining = (unsigned int)k; n_gt = 0; n_tie_base = 0; }
    __syncthreads();
    for (int shift = 24; shift >= 0; shift -= 8) {
        for (int i = tid; i < 256; i += blockDim.x) hist[i] = 0;
        __syncthreads();
        const unsigned int pf = prefix, mk = mask;
        // Most logits share the key's top byte (sign and exponent), so a
        // plain shared atomic per entry serialises on one bin: lanes with
        // the same bin add their count once (every lane runs every round,
        // as __match_any_sync needs).
        for (int c0 = 0; c0 < n; c0 += blockDim.x) {
            const int i = c0 + tid;
            const unsigned int key = i < n ? okey(x[i]) : 0u;
            const bool in = i < n && (key & mk) == pf;
            const unsigned int bin = in ? ((key >> shift) & 255u) : 0xFFFFFFFFu;
#if __CUDA_ARCH__ >= 700
            const unsigned int peers = __match_any_sync(0xffffffffu, bin);
            if (in && (tid % 32) == __ffs(peers) - 1) atomicAdd(&hist[bin], (unsigned int)__popc(peers));
#else
            if (in) atomicAdd(&hist[bin], 1u);
#endif
        }
        __syncthreads();
        // The digit of the k-th largest: the first bin, from 255 down, where
        // the running count reaches `remaining` (which the entries still
        // matching the prefix always do). Warp 0: lane l owns bins 255 - 8l
        // down to 248 - 8l; a prefix sum over lanes finds the one lane
        // whose range holds the crossing.
        if (tid < 32) {
            const unsigned int rem = remaining;
            unsigned int c[8];
            unsigned int tot = 0;
#pragma unroll
            for (int j = 0; j < 8; ++j) {
                c[j] = hist[255 - 8 * tid - j];
                tot += c[j];
            }
            unsigned int incl = tot;
            for (int o = 1; o < 32; o <<= 1) {
                const unsigned int v = __shfl_up_sync(0xffffffffu, incl, o);
                if (tid >= o) incl += v;
            }
            unsigned int cum = incl - tot;
            if (cum < rem && rem <= incl) {
                int dg = 255 - 8 * tid - 7;
#pragma unroll
                for (int j = 0; j < 8; ++j) {
                    if (cum + c[j] >= rem) {
                        dg = 255 - 8 * tid - j;
                        break;
                    }
                    cum += c[j];
                }
                remaining = rem - cum;
                prefix |= (unsigned int)dg << shift;
                mask |= 255u << shift;
            }
        }
        __syncthreads();
    }
    const unsigned int T = prefix;      // key of the k-th largest
    const unsigned int need = remaining; // how many entries equal to T to keep
    const int n_greater = k - (int)need;
    // Gather: keys above T in any order (sorted below), keys equal to T in id
    // order until `need` are taken.
    for (int c0 = 0; c0 < n; c0 += blockDim.x) {
        const int i = c0 + tid;
        const unsigned int key = i < n ? okey(x[i]) : 0u;
        if (i < n && key > T) {
            const unsigned int slot = atomicAdd(&n_gt, 1u);
            items[slot] = ((unsigned long long)key << 32) | (0xFFFFFFFFu - (unsigned int)i);
        }
        const bool tie = i < n && key == T;
        const unsigned int ballot = __ballot_sync(0xffffffffu, tie);
        const int lane = tid % 32, wid = tid / 32;
        if (lane == 0) warp_sums[wid] = __popc(ballot);
        __syncthreads();
        unsigned int before = n_tie_base;
        for (int w = 0; w < wid; ++w) before += warp_sums[w];
        before += __popc(ballot & ((1u << lane) - 1u));
        if (tie && before < need) {
            items[n_greater + before] = ((unsigned long long)key << 32) | (0xFFFFFFFFu - (unsigned int)i);
        }
        __syncthreads();
        if (tid == 0) {
            unsigned int tot = 0;
            for (int w = 0; w < TOPK_THREADS / 32; ++w) tot += warp_sums[w];
            n_tie_base += tot;
            // Every kept entry is placed; later ones cannot qualify. Decided
            // once here: threads reading n_gt themselves after the barrier
            // raced with faster warps already adding to it in the next
            // round, so some broke out and others waited at a barrier.
            gather_done = n_tie_base >= need && n_gt >= (unsigned int)n_greater;
        }
        __syncthreads();
        if (gather_done) break;
    }
    // Bitonic sort of the k items, descending (pad with 0 = below any key).
    int m = 1;
    while (m < k) m <<= 1;
    for (int i = tid; i < m; i += blockDim.x) if (i >= k) items[i] = 0ull;
    __syncthreads();
    for (int size = 2; size <= m; size <<= 1) {
        for (int stride = size / 2; stride > 0; stride >>= 1) {
            for (int i = tid; i < m; i += blockDim.x) {
                const int j = i ^ stride;
                if (j > i) {
                    const bool desc = (i & size) == 0;
                    const unsigned long long a = items[i], b = items[j];
                    if (desc ? (a < b) : (a > b)) { items[i] = b; items[j] = a; }
                }
            }
            __syncthreads();
        }
    }
    for (int i = tid; i < k; i += blockDim.x) {
        const unsigned int id = 0xFFFFFFFFu - (unsigned int)(items[i] & 0xFFFFFFFFull);
        out[2 + 2 * i] = id;
        out[2 + 2 * i + 1] = __float_as_uint(x[id]);
    }
    if (tid == 0) {
        out[0] = ST_OK;
        out[1] = (unsigned int)k;
    }
}
