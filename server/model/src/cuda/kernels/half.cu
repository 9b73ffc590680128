// F16 and BF16 weights (32 stored values per block, uploaded as is) against
// the f32 activations rounded to the weights' type, as crate::quant::format::half /
// crate::ggml::half::dot_half_row compute them: per output one of llama.cpp's
// orders, picked by the launch exactly as crate::cpu::forward picks it —
//   gemm (tinyBLAS, steps of 2+ tokens): w accumulators (the flavour's
//     lanes, 8 or 16), lane i % w an fma chain, then the horizontal sum;
//   vector dot (ggml_vec_dot_f16 / _bf16, one-token steps, the last
//     layer's feed-forward, the output head): 4w accumulators for F16, 32
//     for BF16, the build's reductions, leftovers added in f64;
//   pairs (BF16 in an AVX-512 build on a CPU with AVX-512 BF16, where the
//     CPU backend uses vdpbf16ps): 16 lanes (gemm) or two sets of 16
//     (vector dot), each adding the odd element's product, then the even
//     one's.
// Part of the one source forward.cu opens.

struct bh_f16 { unsigned short v[32]; };
struct bh_bf16 { unsigned short v[32]; };

// f32 -> bf16 as the half crate rounds it (nearest even; a NaN keeps its
// high bits with the quiet bit set), widened back (exact).
__device__ __forceinline__ float round_bf16(float f) {
    const unsigned int x = __float_as_uint(f);
    unsigned int h = x >> 16;
    if ((x & 0x7fffffffu) > 0x7f800000u) h |= 0x40u;
    else if ((x & 0x8000u) != 0 && (x & 0x17fffu) != 0) h += 1;
    return __int_as_float((int)((h & 0xffffu) << 16));
}
template <bool BF> __device__ __forceinline__ float half_val(unsigned short b) {
    if constexpr (BF) return __int_as_float((int)((unsigned int)b << 16));
    else return h2f(b);
}
template <bool BF> __device__ __forceinline__ float half_act(float f) {
    if constexpr (BF) return round_bf16(f);
    else return round_f16(f);
}
template <bool BF> __device__ __forceinline__ float half_prod(const unsigned short* w, const float* x, int i) {
    return __fmul_rn(half_val<BF>(w[i]), half_act<BF>(x[i]));
}

// How many accumulators the order has (at most 64).
template <bool BF> __device__ __forceinline__ int half_chains(int w, int gemm, int pairs) {
    if (pairs) return gemm ? 16 : 32;
    return gemm ? w : (BF ? 32 : 4 * w);
}

// Accumulator k of one row times one token's activations (`cols` values).
template <bool BF>
__device__ float half_chain(const unsigned short* wr, const float* x, int cols, int k, int w, int gemm, int pairs) {
    float acc = 0.0f;
    if (pairs) {
        // Lane k % 16 of the 32-value chunks (gemm), or of every other one
        // (vector dot: the second set starts at 32), only whole chunks.
        const int j = k % 16, stride = gemm ? 32 : 64, lim = gemm ? cols : cols / 64 * 64;
        for (int base = 32 * (k / 16); base < lim; base += stride) {
            acc = __fadd_rn(acc, half_prod<BF>(wr, x, base + 2 * j + 1));
            acc = __fadd_rn(acc, half_prod<BF>(wr, x, base + 2 * j));
        }
        return acc;
    }
    const int step = half_chains<BF>(w, gemm, 0), full = cols / step * step;
    for (int i = k; i < full; i += step) acc = fmaf(half_val<BF>(wr[i]), half_act<BF>(x[i]), acc);
    return acc;
}

// The result from the accumulators `a` (half_chains of them), the order's
// reductions and leftovers.
template <bool BF>
__device__ float half_reduce(const float* a, const unsigned short* wr, const float* x, int cols, int w, int gemm,
                             int pairs) {
    if (pairs) {
        if (gemm) return reduce16(a);
        double s = __dadd_rn((double)reduce16(a), (double)reduce16(a + 16));
        for (int i = cols / 64 * 64; i < cols; ++i) s = __dadd_rn(s, (double)half_prod<BF>(wr, x, i));
        return (float)s;
    }
    const int step = half_chains<BF>(w, gemm, 0), full = cols / step * step;
    if (gemm) {
        float s = w == 16 ? reduce16(a) : reduce8(a);
        for (int i = full; i < cols; ++i) s = __fadd_rn(s, half_prod<BF>(wr, x, i));
        return s;
    }
    double s;
    if (!BF) {
        // GGML_F16_VEC_REDUCE: the four vectors pairwise, then horizontally.
        float v[16];
#pragma unroll
        for (int e = 0; e < 16; ++e)
            v[e] = e < w ? __fadd_rn(__fadd_rn(a[e], a[2 * w + e]), __fadd_rn(a[w + e], a[3 * w + e])) : 0.0f;
        s = w == 16 ? (double)reduce16(v) : (double)reduce8_vec_dot(v);
    } else if (w == 16) {
        // ggml_vec_dot_bf16, AVX-512F: two accumulators, each reduced.
        s = __dadd_rn((double)reduce16(a), (double)reduce16(a + 16));
    } else {
        // ggml_vec_dot_bf16, AVX2: (c1 + c3) + (c2 + c4), then hsum_float_8.
        float v[8];
#pragma unroll
        for (int e = 0; e < 8; ++e) v[e] = __fadd_rn(__fadd_rn(a[e], a[16 + e]), __fadd_rn(a[8 + e], a[24 + e]));
        s = (double)reduce8(v);
    }
    for (int i = full; i < cols; ++i) s = __dadd_rn(s, (double)half_prod<BF>(wr, x, i));
    return (float)s;
}

// One warp per row (MMW_WARPS rows per block): the accumulators of
// 32 / chains tokens at a time (or the 64 of one token, two per lane) run
// in parallel, land in shared memory, and one lane per token reduces them.
// `nb` counts 32-value blocks; w, gemm, pairs: the order (see the top).
template <bool BF>
__device__ __forceinline__ void mmw_half(const unsigned short* __restrict__ w, const float* __restrict__ x, float* out,
                                         int rows, int nb, int n_tok, int out_stride, int out_off, int lw, int gemm,
                                         int pairs) {
    __shared__ float sacc[MMW_WARPS][64];
    const int wid = threadIdx.x / 32, lane = threadIdx.x % 32;
    const int r = blockIdx.x * MMW_WARPS + wid;
    if (r >= rows) return; // the whole warp: only warp-level sync below
    const int cols = nb * 32;
    const unsigned short* wr = w + (size_t)r * cols;
    const int nc = half_chains<BF>(lw, gemm, pairs);
    const int per = nc >= 32 ? 1 : 32 / nc; // tokens per round
    for (int t0 = 0; t0 < n_tok; t0 += per) {
        for (int p = lane; p < per * nc; p += 32) {
            const int t = t0 + p / nc;
            if (t < n_tok) sacc[wid][p] = half_chain<BF>(wr, x + (size_t)t * cols, cols, p % nc, lw, gemm, pairs);
        }
        __syncwarp();
        if (lane < per && t0 + lane < n_tok) {
            const int t = t0 + lane;
            out[(size_t)t * out_stride + out_off + r] =
                half_reduce<BF>(&sacc[wid][lane * nc], wr, x + (size_t)t * cols, cols, lw, gemm, pairs);
        }
        __syncwarp();
    }
}

// The eight-threads-per-row layout (SAMPLERD_CUDA_MM=lanes): thread l runs
// accumulators l, l + 8, ... of each token; same bits as mmw_half.
template <bool BF>
__device__ __forceinline__ void mm_half_lanes(const unsigned short* w, const float* x, float* out, int rows, int nb,
                                              int n_tok, int out_stride, int out_off, int lw, int gemm, int pairs) {
    __shared__ float sacc[32][64]; // a group per row (blockDim.x <= 256)
    const int g = threadIdx.x / 8, l = threadIdx.x % 8;
    const int r = blockIdx.x * (blockDim.x / 8) + g;
    // Out-of-range groups compute a copy of the last row (and discard it)
    // so every lane of the warp reaches the same barriers.
    const bool valid = r < rows;
    const int cols = nb * 32;
    const unsigned short* wr = w + (size_t)(valid ? r : rows - 1) * cols;
    const int nc = half_chains<BF>(lw, gemm, pairs);
    for (int t = 0; t < n_tok; ++t) {
        const float* xt = x + (size_t)t * cols;
        for (int k = l; k < nc; k += 8) sacc[g][k] = half_chain<BF>(wr, xt, cols, k, lw, gemm, pairs);
        __syncwarp();
        if (valid && l == 0)
            out[(size_t)t * out_stride + out_off + r] = half_reduce<BF>(sacc[g], wr, xt, cols, lw, gemm, pairs);
        __syncwarp();
    }
}

// The exported kernels of one half format: embed_<f>, mmw_<f>, mm_<f>.
#define HALF_KERNELS(f, BF)                                                                                          \
    extern "C" __global__ void embed_##f(const bh_##f* w, const unsigned int* tok, int cols, float* out) {           \
        const int t = blockIdx.x;                                                                                    \
        const unsigned short* row = (const unsigned short*)w + (size_t)tok[t] * cols;                                \
        for (int i = threadIdx.x; i < cols; i += blockDim.x) out[(size_t)t * cols + i] = half_val<BF>(row[i]);       \
    }                                                                                                                \
    extern "C" __global__ void mmw_##f(const bh_##f* __restrict__ w, const float* __restrict__ x, float* out,        \
                                       int rows, int nb, int n_tok, int out_stride, int out_off, int lw,             \
                                       int gemm, int pairs) {                                                        \
        mmw_half<BF>((const unsigned short*)w, x, out, rows, nb, n_tok, out_stride, out_off, lw, gemm, pairs);       \
    }                                                                                                                \
    extern "C" __global__ void mm_##f(const bh_##f* w, const float* x, float* out, int rows, int nb, int n_tok,      \
                                      int out_stride, int out_off, int lw, int gemm, int pairs) {                    \
        mm_half_lanes<BF>((const unsigned short*)w, x, out, rows, nb, n_tok, out_stride, out_off, lw, gemm, pairs);  \
    }
HALF_KERNELS(f16, false)
HALF_KERNELS(bf16, true)
