// The K-quants (Q4_K, Q5_K, Q6_K: 256-value super-blocks) against Q8_K
// activations, as crate::quant computes them (ggml's
// quantize_row_q8_K_ref and ggml_vec_dot_q{4,5,6}_K_q8_K, AVX2, or for a
// step of 8+ tokens ggml's tiled matmul). The blocks are the CPU loader's:
// f32 d / dmin, the 6-bit sub-block scales and minimums of Q4_K / Q5_K
// unpacked to bytes, the quants as stored. Part of the one source
// forward.cu opens.
//
// The integer lanes are crate::quant::kernels::scalar's: lane l sums, over the
// eight 32-value chunks of a super-block, the products of the chunk's
// values 4l..4l+3 times their sub-block scale (exact in any order; Q6_K
// subtracts its 32 * scale * bsum correction per lane as ggml does). The
// vector-dot order then runs one fma(d_a * d_w, lane, acc) per lane and
// super-block and hsum_float_8, plus the minimum term (Q4_K: four f32
// lanes of fma(-d_a * dmin, prod_k, acc_k), summed (m0 + m2) + (m1 + m3);
// Q5_K: one fma chain over the four products' sum). The tiled order sums
// each super-block's lanes (s1) and minimum products (s2) in integers and
// runs one chain: acc = fma(fma(-dmin, s2, d * s1), d_a, acc).

#define QK_K 256

struct bq4_K { float d; float dmin; unsigned char sc[8]; unsigned char m[8]; unsigned char qs[128]; };
struct bq5_K {
    float d;
    float dmin;
    unsigned char sc[8];
    unsigned char m[8];
    unsigned char qh[32];
    unsigned char qs[128];
};
struct bq6_K { float d; unsigned char ql[128]; unsigned char qh[64]; signed char scales[16]; };
struct bq8_K { float d; signed char qs[256]; short bsums[16]; };

// ggml's nearest_int: round half to even through the 1.5 * 2^23 trick.
__device__ __forceinline__ int nearest_int(float f) {
    const float v = __fadd_rn(f, 12582912.0f);
    return (__float_as_int(v) & 0x007fffff) - 0x00400000;
}

// quantize_row_q8_K_ref of 256-value blocks, one warp per block (lane l
// holds values 8l..8l+7): the scale from the first value of largest
// magnitude, iscale = -127 / max, q = min(nearest_int(iscale * x), 127),
// d = 1 / iscale, bsums per 16 values; an all-zero block is all zeros.
extern "C" __global__ void quantize_q8_k(const float* x, bq8_K* out, int n_blocks) {
    const int warp = (blockIdx.x * blockDim.x + threadIdx.x) / 32;
    const int lane = threadIdx.x % 32;
    if (warp >= n_blocks) return;
    const float* xb = x + (size_t)warp * QK_K;
    bq8_K* b = out + warp;
    float v[8];
    float amax = 0.0f;
    int at = -1;
#pragma unroll
    for (int k = 0; k < 8; ++k) {
        v[k] = xb[8 * lane + k];
        if (fabsf(v[k]) > amax) {
            amax = fabsf(v[k]);
            at = 8 * lane + k;
        }
    }
    // The largest magnitude, ties to the lower index (the CPU's strict `>`
    // in index order); every lane ends with the same pair.
    for (int o = 16; o > 0; o >>= 1) {
        const float oa = __shfl_xor_sync(0xffffffffu, amax, o);
        const int oi = __shfl_xor_sync(0xffffffffu, at, o);
        if (oa > amax || (oa == amax && oi < at)) {
            amax = oa;
            at = oi;
        }
    }
    // (amax is the same on every lane.)
    const float iscale = amax != 0.0f ? __fdiv_rn(-127.0f, xb[at]) : 0.0f;
    int sum = 0;
#pragma unroll
    for (int k = 0; k < 8; ++k) {
        const int q = amax != 0.0f ? min(nearest_int(__fmul_rn(iscale, v[k])), 127) : 0;
        b->qs[8 * lane + k] = (signed char)q;
        sum += q;
    }
    if (lane == 0) b->d = amax != 0.0f ? __fdiv_rn(1.0f, iscale) : 0.0f;
    const int pair = sum + __shfl_xor_sync(0xffffffffu, sum, 1);
    if ((lane & 1) == 0) b->bsums[lane / 2] = (short)pair;
}

// Integer lane l (0..7) of a super-block times a Q8_K block.
__device__ __forceinline__ int klane(const bq4_K* w, const bq8_K* a, int l) {
    int s = 0;
#pragma unroll
    for (int j = 0; j < 4; ++j) {
        const int packed = load_i32(w->qs + 32 * j + 4 * l);
        const int lo = __dp4a(packed & 0x0F0F0F0F, load_i32(a->qs + 64 * j + 4 * l), 0);
        const int hi = __dp4a((packed >> 4) & 0x0F0F0F0F, load_i32(a->qs + 64 * j + 32 + 4 * l), 0);
        s += (int)w->sc[2 * j] * lo + (int)w->sc[2 * j + 1] * hi;
    }
    return s;
}
// Q5_K: chunk c's low four bits are nibble c % 2 of qs[32 (c / 2) + e], the
// fifth is bit c of qh[e].
__device__ __forceinline__ int klane(const bq5_K* w, const bq8_K* a, int l) {
    const int qh = load_i32(w->qh + 4 * l);
    int s = 0;
#pragma unroll
    for (int c = 0; c < 8; ++c) {
        const int lo = (load_i32(w->qs + 32 * (c / 2) + 4 * l) >> (4 * (c & 1))) & 0x0F0F0F0F;
        const int q = lo | (((qh >> c) & 0x01010101) << 4);
        s += (int)w->sc[c] * __dp4a(q, load_i32(a->qs + 32 * c + 4 * l), 0);
    }
    return s;
}
// Q6_K: chunk c = 4n + c' takes nibble c' / 2 of ql[64n + 32 (c' % 2) + e]
// and bits 2c', 2c' + 1 of qh[32n + e] (values 0..63, the -32 folded into
// the correction below, as ggml's AVX2 kernel does it).
__device__ __forceinline__ int klane(const bq6_K* w, const bq8_K* a, int l) {
    int s = 0;
#pragma unroll
    for (int c = 0; c < 8; ++c) {
        const int n = c / 4, cc = c % 4;
        const int lo = (load_i32(w->ql + 64 * n + 32 * (cc & 1) + 4 * l) >> (4 * (cc >> 1))) & 0x0F0F0F0F;
        const int hi = (load_i32(w->qh + 32 * n + 4 * l) >> (2 * cc)) & 0x03030303;
        s += (int)w->scales[2 * c + l / 4] * __dp4a(lo | (hi << 4), load_i32(a->qs + 32 * c + 4 * l), 0);
    }
    const int corr = (int)w->scales[2 * l] * a->bsums[2 * l] + (int)w->scales[2 * l + 1] * a->bsums[2 * l + 1];
    return s - corr * 32;
}

// The minimum terms: none (Q6_K), four f32 lanes (Q4_K), one chain (Q5_K).
#define KMIN_NONE 0
#define KMIN_LANES 1
#define KMIN_CHAIN 2
template <class B> struct kmin_kind { static constexpr int value = KMIN_NONE; };
template <> struct kmin_kind<bq4_K> { static constexpr int value = KMIN_LANES; };
template <> struct kmin_kind<bq5_K> { static constexpr int value = KMIN_CHAIN; };

// Minimum product k (0..3): m[2k] * (sum of values 64k..64k+31) + m[2k+1]
// * (sum of the next 32), from the activation's 16-value sums.
template <class B> __device__ __forceinline__ int kmin(const B* w, const bq8_K* a, int k) {
    if constexpr (kmin_kind<B>::value == KMIN_NONE) {
        return 0;
    } else {
        const int s0 = (int)a->bsums[4 * k] + a->bsums[4 * k + 1];
        const int s1 = (int)a->bsums[4 * k + 2] + a->bsums[4 * k + 3];
        return (int)w->m[2 * k] * s0 + (int)w->m[2 * k + 1] * s1;
    }
}
template <class B> __device__ __forceinline__ float kdmin(const B* w) {
    if constexpr (kmin_kind<B>::value == KMIN_NONE) return 0.0f;
    else return w->dmin;
}

// One super-block of the tiled order.
template <class B> __device__ __forceinline__ float tiled_step(const B* w, int s1, int s2, float d8, float acc) {
    return fmaf(fmaf(-kdmin(w), (float)s2, __fmul_rn(w->d, (float)s1)), d8, acc);
}

// The vector-dot order's result from lanes 0..7's accumulators and the
// minimum term's (lanes m0..m0+3 for KMIN_LANES, lane m0 for KMIN_CHAIN):
// valid in lane 0. Every lane of the warp calls it.
template <class B> __device__ __forceinline__ float kfinish(float acc, float accm, int m0) {
    const float v = hsum8_group(acc);
    if constexpr (kmin_kind<B>::value == KMIN_LANES) {
        const float a0 = __shfl_sync(0xffffffffu, accm, m0), a1 = __shfl_sync(0xffffffffu, accm, m0 + 1);
        const float a2 = __shfl_sync(0xffffffffu, accm, m0 + 2), a3 = __shfl_sync(0xffffffffu, accm, m0 + 3);
        return __fadd_rn(v, __fadd_rn(__fadd_rn(a0, a2), __fadd_rn(a1, a3)));
    } else if constexpr (kmin_kind<B>::value == KMIN_CHAIN) {
        return __fadd_rn(v, __shfl_sync(0xffffffffu, accm, m0));
    } else {
        return v;
    }
}

// One warp per row (MMW_WARPS rows per block), KB super-blocks per round:
// lane (8k + l) forms integer lane l of super-block b0 + k (and, l < 4,
// its minimum product l) into shared memory; then lanes 0..7 run the fma
// chains of the vector-dot order (lanes 8..11 or 8 the minimum term), or
// lane 0 the chain of the tiled order (`tiled`).
#define KB 4
template <class B>
__device__ __forceinline__ void mmw_k(const B* __restrict__ w, const bq8_K* __restrict__ x, float* out, int rows,
                                      int nb, int n_tok, int out_stride, int out_off, int tiled) {
    __shared__ int ss[MMW_WARPS][8][KB];
    __shared__ int sp[MMW_WARPS][4][KB];
    constexpr int MK = kmin_kind<B>::value;
    const int wid = threadIdx.x / 32, lane = threadIdx.x % 32;
    const int r = blockIdx.x * MMW_WARPS + wid;
    if (r >= rows) return; // the whole warp: only warp-level sync below
    const B* row = w + (size_t)r * nb;
    const int kb = lane / 8, l = lane % 8;
    for (int t = 0; t < n_tok; ++t) {
        const bq8_K* a = x + (size_t)t * nb;
        float acc = 0.0f, accm = 0.0f;
        for (int b0 = 0; b0 < nb; b0 += KB) {
            const int b = b0 + kb;
            if (b < nb) {
                ss[wid][l][kb] = klane(row + b, a + b, l);
                if (MK != KMIN_NONE && l < 4) sp[wid][l][kb] = kmin(row + b, a + b, l);
            }
            __syncwarp();
            const int nblk = min(KB, nb - b0);
            if (tiled) {
                if (lane == 0) {
                    for (int j = 0; j < nblk; ++j) {
                        int s1 = 0, s2 = 0;
                        for (int i = 0; i < 8; ++i) s1 += ss[wid][i][j];
                        if (MK != KMIN_NONE)
                            for (int i = 0; i < 4; ++i) s2 += sp[wid][i][j];
                        acc = tiled_step(row + b0 + j, s1, s2, a[b0 + j].d, acc);
                    }
                }
            } else if (lane < 8) {
                for (int j = 0; j < nblk; ++j)
                    acc = fmaf(__fmul_rn(a[b0 + j].d, row[b0 + j].d), (float)ss[wid][lane][j], acc);
            } else if (MK == KMIN_LANES && lane < 12) {
                for (int j = 0; j < nblk; ++j)
                    accm = fmaf(__fmul_rn(-a[b0 + j].d, kdmin(row + b0 + j)), (float)sp[wid][lane - 8][j], accm);
            } else if (MK == KMIN_CHAIN && lane == 8) {
                for (int j = 0; j < nblk; ++j) {
                    const int p = sp[wid][0][j] + sp[wid][1][j] + sp[wid][2][j] + sp[wid][3][j];
                    accm = fmaf(__fmul_rn(-a[b0 + j].d, kdmin(row + b0 + j)), (float)p, accm);
                }
            }
            __syncwarp();
        }
        const float v = tiled ? acc : kfinish<B>(acc, accm, 8); // (`tiled` is uniform)
        if (lane == 0) out[(size_t)t * out_stride + out_off + r] = v;
    }
}

// The eight-threads-per-row layout (SAMPLERD_CUDA_MM=lanes): thread l runs
// lane l's chain over every super-block (threads 0..3 also the Q4_K
// minimum lanes; the Q5_K chain and the tiled order's sums are formed in
// every thread from the group's integers). Same bits as mmw_k.
template <class B>
__device__ __forceinline__ void mm_k_lanes(const B* w, const bq8_K* x, float* out, int rows, int nb, int n_tok,
                                           int out_stride, int out_off, int tiled) {
    constexpr int MK = kmin_kind<B>::value;
    const int r = blockIdx.x * (blockDim.x / 8) + threadIdx.x / 8;
    const int l = threadIdx.x % 8;
    const int g0 = threadIdx.x % 32 - l; // the group's first lane in the warp
    // Out-of-range groups compute a copy of the last row (and discard it)
    // so every lane of the warp takes part in the shuffles.
    const bool valid = r < rows;
    const B* row = w + (size_t)(valid ? r : rows - 1) * nb;
    for (int t = 0; t < n_tok; ++t) {
        const bq8_K* a = x + (size_t)t * nb;
        float acc = 0.0f, accm = 0.0f;
        for (int b = 0; b < nb; ++b) {
            const int s = klane(row + b, a + b, l);
            const int p = l < 4 ? kmin(row + b, a + b, l) : 0;
            if (tiled) {
                int s1 = s, s2 = p;
                for (int o = 4; o > 0; o >>= 1) {
                    s1 += __shfl_xor_sync(0xffffffffu, s1, o);
                    s2 += __shfl_xor_sync(0xffffffffu, s2, o);
                }
                acc = tiled_step(row + b, s1, s2, a[b].d, acc);
            } else {
                acc = fmaf(__fmul_rn(a[b].d, row[b].d), (float)s, acc);
                const float dmin = __fmul_rn(-a[b].d, kdmin(row + b));
                if (MK == KMIN_LANES && l < 4) accm = fmaf(dmin, (float)p, accm);
                if (MK == KMIN_CHAIN) {
                    int pt = p;
                    for (int o = 4; o > 0; o >>= 1) pt += __shfl_xor_sync(0xffffffffu, pt, o);
                    accm = fmaf(dmin, (float)pt, accm);
                }
            }
        }
        const float v = tiled ? acc : kfinish<B>(acc, accm, g0);
        if (valid && l == 0) out[(size_t)t * out_stride + out_off + r] = v;
    }
}

// Value v (0..255) of a super-block, dequantised as ggml's
// dequantize_row_q*_K (and QMatrix::dequant_row): d * sc * q - dmin * m
// per 32-value sub-block, Q6_K (d * scale) * (q - 32).
__device__ __forceinline__ float dequant_k(const bq4_K* b, int v) {
    const int s = v / 32, e = v % 32;
    const int q = (b->qs[32 * (s / 2) + e] >> (4 * (s & 1))) & 0xF;
    return __fsub_rn(__fmul_rn(__fmul_rn(b->d, (float)b->sc[s]), (float)q), __fmul_rn(b->dmin, (float)b->m[s]));
}
__device__ __forceinline__ float dequant_k(const bq5_K* b, int v) {
    const int s = v / 32, e = v % 32;
    const int q = ((b->qs[32 * (s / 2) + e] >> (4 * (s & 1))) & 0xF) | (((b->qh[e] >> s) & 1) << 4);
    return __fsub_rn(__fmul_rn(__fmul_rn(b->d, (float)b->sc[s]), (float)q), __fmul_rn(b->dmin, (float)b->m[s]));
}
__device__ __forceinline__ float dequant_k(const bq6_K* b, int v) {
    const int c = v / 32, e = v % 32, n = c / 4, cc = c % 4;
    const int lo = (b->ql[64 * n + 32 * (cc & 1) + e] >> (4 * (cc >> 1))) & 0xF;
    const int q = lo | (((b->qh[32 * n + e] >> (2 * cc)) & 3) << 4);
    return __fmul_rn(__fmul_rn(b->d, (float)b->scales[v / 16]), (float)(q - 32));
}

// The exported kernels of one K-quant: embed_q<f>_k, mmw_q<f>_k, mm_q<f>_k.
#define K_KERNELS(f)                                                                                                 \
    extern "C" __global__ void embed_q##f##_k(const bq##f##_K* w, const unsigned int* tok, int cols, float* out) {   \
        const int t = blockIdx.x;                                                                                    \
        const bq##f##_K* row = w + (size_t)tok[t] * (cols / QK_K);                                                   \
        for (int i = threadIdx.x; i < cols; i += blockDim.x)                                                         \
            out[(size_t)t * cols + i] = dequant_k(row + i / QK_K, i % QK_K);                                         \
    }                                                                                                                \
    extern "C" __global__ void mmw_q##f##_k(const bq##f##_K* __restrict__ w, const bq8_K* __restrict__ x,            \
                                            float* out, int rows, int nb, int n_tok, int out_stride, int out_off,    \
                                            int tiled) {                                                             \
        mmw_k(w, x, out, rows, nb, n_tok, out_stride, out_off, tiled);                                               \
    }                                                                                                                \
    extern "C" __global__ void mm_q##f##_k(const bq##f##_K* w, const bq8_K* x, float* out, int rows, int nb,         \
                                           int n_tok, int out_stride, int out_off, int tiled) {                      \
        mm_k_lanes(w, x, out, rows, nb, n_tok, out_stride, out_off, tiled);                                          \
    }
K_KERNELS(4)
K_KERNELS(5)
K_KERNELS(6)
