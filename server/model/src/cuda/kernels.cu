// samplerd's CUDA kernels, compiled at start-up with NVRTC (no toolkit
// headers needed: f16 conversions are inline PTX, no <cuda_fp16.h>).
//
// The forward kernels mirror server/model/src/forward.rs: Q8_0 / Q4_1 weight
// blocks with f32 scales (the CPU loader's unpacked formats, uploaded as is),
// activations quantised to Q8_1 before every weight product, and the weight
// products in the CPU kernels' exact arithmetic (eight lanes of four integer
// products per block, one fma per lane and block, the same horizontal sum),
// so the GPU's logits follow the CPU's closely enough for greedy parity.
// Compiled with --fmad=false: every fused multiply-add below is explicit.
//
// The sampling kernels implement the device prefix of a sampler chain
// (server/sampling/src/device_prefix.rs documents the semantics; its
// `reference` module is the CPU twin the tests compare against).

#define F_INF __int_as_float(0x7f800000)
#define F_MAX __int_as_float(0x7f7fffff)

struct bq8_0 { float d; signed char qs[32]; };
struct bq4_1 { float d; float m; unsigned char qs[16]; };
struct bq8_1 { float d; float s; signed char qs[32]; };

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
__device__ __forceinline__ float round_f16(float f) { return h2f(f2h(f)); }

// ---------------------------------------------------------------- forward

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

// out = x / rms(x) * w per row of d values; the sum of squares in f64 like
// ggml's CPU path. One block (256 threads) per row.
extern "C" __global__ void rms_norm(const float* x, const float* w, float* out, int d, float eps) {
    __shared__ double part[256];
    const float* xr = x + (size_t)blockIdx.x * d;
    float* orow = out + (size_t)blockIdx.x * d;
    double s = 0.0;
    for (int i = threadIdx.x; i < d; i += blockDim.x) {
        const float v = xr[i];
        s += (double)__fmul_rn(v, v);
    }
    part[threadIdx.x] = s;
    __syncthreads();
    for (int o = blockDim.x / 2; o > 0; o >>= 1) {
        if (threadIdx.x < o) part[threadIdx.x] += part[threadIdx.x + o];
        __syncthreads();
    }
    const float scale = 1.0f / sqrtf(__fadd_rn((float)(part[0] / (double)d), eps));
    for (int i = threadIdx.x; i < d; i += blockDim.x) {
        orow[i] = __fmul_rn(__fmul_rn(xr[i], scale), w[i]);
    }
}

// llama.cpp's quantize_row_q8_1 (AVX2 path): one warp per 32-value block.
extern "C" __global__ void quantize_q8_1(const float* x, bq8_1* out, int n_blocks) {
    const int warp = (blockIdx.x * blockDim.x + threadIdx.x) / 32;
    const int lane = threadIdx.x % 32;
    if (warp >= n_blocks) return;
    const float v = x[(size_t)warp * 32 + lane];
    float amax = fabsf(v);
    for (int o = 16; o > 0; o >>= 1) amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, o));
    const float d = amax / 127.0f;
    const float id = amax != 0.0f ? 127.0f / amax : 0.0f;
    const int q = (int)rintf(__fmul_rn(v, id));
    int sum = q;
    for (int o = 16; o > 0; o >>= 1) sum += __shfl_xor_sync(0xffffffffu, sum, o);
    bq8_1* b = out + warp;
    b->qs[lane] = (signed char)q;
    if (lane == 0) {
        b->d = round_f16(d);
        b->s = round_f16(__fmul_rn(d, (float)sum));
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

// out[t * out_stride + out_off + r] = W[r] . x[t] for Q8_0 weights: eight
// lanes per row, lane l owning products 4l..4l+3 of every block (the CPU
// kernels' lane layout). 128 threads = 16 rows per block.
extern "C" __global__ void mm_q8_0(const bq8_0* w, const bq8_1* x, float* out, int rows, int nb, int n_tok,
                                   int out_stride, int out_off) {
    const int r = blockIdx.x * (blockDim.x / 8) + threadIdx.x / 8;
    const int l = threadIdx.x % 8;
    // Out-of-range groups compute a copy of the last row (and discard it)
    // so every lane of the warp takes part in the shuffles.
    const bool valid = r < rows;
    const bq8_0* row = w + (size_t)(valid ? r : rows - 1) * nb;
    for (int t = 0; t < n_tok; ++t) {
        const bq8_1* a = x + (size_t)t * nb;
        float acc = 0.0f;
        for (int b = 0; b < nb; ++b) {
            const float d = __fmul_rn(row[b].d, a[b].d);
            const int s = __dp4a(load_i32(row[b].qs + 4 * l), load_i32(a[b].qs + 4 * l), 0);
            acc = fmaf(d, (float)s, acc);
        }
        const float v = hsum8_group(acc);
        if (valid && l == 0) out[(size_t)t * out_stride + out_off + r] = v;
    }
}

extern "C" __global__ void mm_q4_1(const bq4_1* w, const bq8_1* x, float* out, int rows, int nb, int n_tok,
                                   int out_stride, int out_off) {
    const int r = blockIdx.x * (blockDim.x / 8) + threadIdx.x / 8;
    const int l = threadIdx.x % 8;
    const bool valid = r < rows;
    const bq4_1* row = w + (size_t)(valid ? r : rows - 1) * nb;
    for (int t = 0; t < n_tok; ++t) {
        const bq8_1* a = x + (size_t)t * nb;
        float acc = 0.0f;
        float summs = 0.0f;
        for (int b = 0; b < nb; ++b) {
            summs = __fadd_rn(summs, __fmul_rn(row[b].m, a[b].s));
            const float d = __fmul_rn(row[b].d, a[b].d);
            const int packed = load_i32(row[b].qs + 4 * (l & 3));
            const int q = l < 4 ? (packed & 0x0F0F0F0F) : ((packed >> 4) & 0x0F0F0F0F);
            const int s = __dp4a(q, load_i32(a[b].qs + 4 * l), 0);
            acc = fmaf(d, (float)s, acc);
        }
        const float v = hsum8_group(acc);
        if (valid && l == 0) out[(size_t)t * out_stride + out_off + r] = __fadd_rn(v, summs);
    }
}

// Per (token, head): adds the qkv bias (qwen2), applies RoPE (rope table
// rows precomputed on the host with the CPU's iterative theta), and for
// k heads writes K and V into the f16 cache at position pos0 + t.
// grid = (n_tok, n_head + n_kv), block = 64; dynamic shared: hd floats.
extern "C" __global__ void qkv_rope_store(float* qkv, const float* bias, const float* rope, const int* pos_ptr,
                                          int n_head, int n_kv, int hd, int n_pairs, int neox,
                                          unsigned short* kc, unsigned short* vc, int layer, int cap) {
    extern __shared__ float seg[];
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

#define ATT_THREADS 128
#define MAX_HD 256

__device__ float block_max(float v, float* red) {
    for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
    if (threadIdx.x % 32 == 0) red[threadIdx.x / 32] = v;
    __syncthreads();
    float m = red[0];
    for (int w = 1; w < ATT_THREADS / 32; ++w) m = fmaxf(m, red[w]);
    __syncthreads();
    return m;
}

__device__ double block_sum_f64(double v, double* red) {
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    if (threadIdx.x % 32 == 0) red[threadIdx.x / 32] = v;
    __syncthreads();
    double s = 0.0;
    for (int w = 0; w < ATT_THREADS / 32; ++w) s += red[w];
    __syncthreads();
    return s;
}

__device__ __forceinline__ float kq_score(const float* q, const unsigned short* k, int hd, float scale) {
    float acc = 0.0f;
    for (int i = 0; i < hd; ++i) acc = fmaf(q[i], h2f(k[i]), acc);
    return __fmul_rn(acc, scale);
}

// Causal grouped-query attention of token t, head h over cache positions
// 0..pos0+t: scores with the query rounded to f16, softmax (f64 sum),
// probabilities rounded to f16, then V . p. Two passes over K (max/sum,
// then probabilities) rather than an online softmax, so each probability is
// normalised before its f16 rounding, as on the CPU.
// grid = (n_tok, n_head), block = ATT_THREADS.
extern "C" __global__ void attention(const float* qkv, const unsigned short* kc, const unsigned short* vc,
                                     float* out, const int* pos_ptr, int layer, int cap, int n_head, int n_kv,
                                     int hd, float scale) {
    __shared__ float q[MAX_HD];
    __shared__ float p[ATT_THREADS];
    __shared__ float redf[ATT_THREADS / 32];
    __shared__ double redd[ATT_THREADS / 32];
    const int t = blockIdx.x;
    const int h = blockIdx.y;
    const int g = h / (n_head / n_kv);
    const int n_pos = *pos_ptr + t + 1;
    const int d = n_head * hd;
    const int rows = d + 2 * n_kv * hd;
    for (int i = threadIdx.x; i < hd; i += blockDim.x) q[i] = round_f16(qkv[(size_t)t * rows + h * hd + i]);
    __syncthreads();
    const size_t base = ((size_t)layer * n_kv + g) * cap * hd;
    const unsigned short* K = kc + base;
    const unsigned short* V = vc + base;
    float m = -F_INF;
    for (int ps = threadIdx.x; ps < n_pos; ps += blockDim.x) m = fmaxf(m, kq_score(q, K + (size_t)ps * hd, hd, scale));
    m = block_max(m, redf);
    double s = 0.0;
    for (int ps = threadIdx.x; ps < n_pos; ps += blockDim.x)
        s += (double)expf(__fsub_rn(kq_score(q, K + (size_t)ps * hd, hd, scale), m));
    s = block_sum_f64(s, redd);
    const float inv = (float)(1.0 / s);
    float acc0 = 0.0f, acc1 = 0.0f; // dims threadIdx.x and threadIdx.x + ATT_THREADS
    for (int c0 = 0; c0 < n_pos; c0 += ATT_THREADS) {
        const int ps = c0 + threadIdx.x;
        p[threadIdx.x] = ps < n_pos
            ? round_f16(__fmul_rn(expf(__fsub_rn(kq_score(q, K + (size_t)ps * hd, hd, scale), m)), inv))
            : 0.0f;
        __syncthreads();
        const int n = min(ATT_THREADS, n_pos - c0);
        for (int jj = 0; jj < n; ++jj) {
            const unsigned short* vr = V + (size_t)(c0 + jj) * hd;
            if (threadIdx.x < hd) acc0 = fmaf(p[jj], h2f(vr[threadIdx.x]), acc0);
            if (threadIdx.x + ATT_THREADS < hd) acc1 = fmaf(p[jj], h2f(vr[threadIdx.x + ATT_THREADS]), acc1);
        }
        __syncthreads();
    }
    float* o = out + (size_t)t * d + h * hd;
    if (threadIdx.x < hd) o[threadIdx.x] = acc0;
    if (threadIdx.x + ATT_THREADS < hd) o[threadIdx.x + ATT_THREADS] = acc1;
}

// act = silu(gate) * up; gu rows are [gate (n_ff) | up (n_ff)] per token.
extern "C" __global__ void swiglu(const float* gu, float* act, int n_tok, int n_ff) {
    const int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= n_tok * n_ff) return;
    const int t = i / n_ff, c = i % n_ff;
    const float g = gu[(size_t)t * 2 * n_ff + c];
    const float u = gu[(size_t)t * 2 * n_ff + n_ff + c];
    act[i] = __fmul_rn(__fdiv_rn(g, __fadd_rn(1.0f, expf(-g))), u);
}

extern "C" __global__ void add_inplace(float* x, const float* y, int n) {
    const int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) x[i] = __fadd_rn(x[i], y[i]);
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
        for (int i = tid; i < n; i += blockDim.x) {
            const unsigned int key = okey(x[i]);
            if ((key & mk) == pf) atomicAdd(&hist[(key >> shift) & 255u], 1u);
        }
        __syncthreads();
        if (tid == 0) {
            unsigned int cum = 0;
            int dg = 255;
            for (; dg > 0; --dg) {
                if (cum + hist[dg] >= remaining) break;
                cum += hist[dg];
            }
            remaining -= cum;
            prefix |= (unsigned int)dg << shift;
            mask |= 255u << shift;
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
        }
        __syncthreads();
        if (n_tie_base >= need && n_gt >= (unsigned int)n_greater) {
            // Every kept entry is placed; later ones cannot qualify.
            break;
        }
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
