// The 32-value weight formats (Q8_0, Q4_1, Q5_0, Q5_1) against Q8_1
// activations, as crate::quant's Block32 products compute them (ggml's
// ggml_vec_dot_*_q8_{0,1}, AVX2): eight int32 lanes, lane l the sum of the
// integer products of values 4l..4l+3 of a block (exact), one
// fma(d_w * d_a, lane, acc) per lane and block in block order, hsum_float_8,
// then for the formats with a minimum (Q4_1, Q5_1) `+ sum of m * s` in
// block order. The blocks are the CPU loader's (f32 scales; the quants as
// stored). Part of the one source forward.cu opens.

struct bq8_0 { float d; signed char qs[32]; };
struct bq4_1 { float d; float m; unsigned char qs[16]; };
struct bq5_0 { float d; unsigned int qh; unsigned char qs[16]; };
struct bq5_1 { float d; float m; unsigned int qh; unsigned char qs[16]; };

// Values 4l..4l+3 of a block, one per byte (signed): the operand of the
// lane's integer products, and the dequantised value's integer part.
__device__ __forceinline__ int lane_q(const bq8_0* b, int l) { return load_i32(b->qs + 4 * l); }
// Values j < 16 are the low nibbles of qs[j], j >= 16 the high nibbles of
// qs[j - 16].
__device__ __forceinline__ int nibbles4(const unsigned char* qs, int l) {
    const int packed = load_i32(qs + 4 * (l & 3));
    return l < 4 ? (packed & 0x0F0F0F0F) : ((packed >> 4) & 0x0F0F0F0F);
}
__device__ __forceinline__ int lane_q(const bq4_1* b, int l) { return nibbles4(b->qs, l); }
// The fifth bits of values 4l..4l+3 (bits 4l.. of qh) as 0x10 per byte.
__device__ __forceinline__ int fifth_bits4(unsigned int qh, int l) {
    const unsigned int h = (qh >> (4 * l)) & 0xFu;
    return (int)(((h & 1u) << 4) | ((h & 2u) << 11) | ((h & 4u) << 18) | ((h & 8u) << 25));
}
// Q5_0's signed values q - 16 as ggml expands them
// (bytes_from_nibbles_32 | andnot(bytes_from_bits_32(qh), 0xF0)): the
// nibble, or'ed with 0xF0 where the fifth bit is clear. (No carries: each
// byte of the xor is 0 or 0x10, times 15 at most 0xF0.)
__device__ __forceinline__ int lane_q(const bq5_0* b, int l) {
    return nibbles4(b->qs, l) | ((fifth_bits4(b->qh, l) ^ 0x10101010) * 15);
}
// Q5_1's unsigned 5-bit values.
__device__ __forceinline__ int lane_q(const bq5_1* b, int l) { return nibbles4(b->qs, l) | fifth_bits4(b->qh, l); }

template <class B> struct has_min { static constexpr bool value = false; };
template <> struct has_min<bq4_1> { static constexpr bool value = true; };
template <> struct has_min<bq5_1> { static constexpr bool value = true; };
template <class B> __device__ __forceinline__ float block_min(const B* b) {
    if constexpr (has_min<B>::value) return b->m;
    else return 0.0f;
}

__device__ __forceinline__ int lane_dot(int q, const bq8_1* a, int l) { return __dp4a(q, load_i32(a->qs + 4 * l), 0); }

// Value j of a block, dequantised as ggml's dequantize_row_* (and
// QMatrix::dequant_row): d * q, + m for the formats with a minimum.
template <class B> __device__ __forceinline__ float dequant32(const B* b, int j) {
    const float q = (float)(signed char)(lane_q(b, j >> 2) >> (8 * (j & 3)));
    const float v = __fmul_rn(b->d, q);
    if constexpr (has_min<B>::value) return __fadd_rn(v, b->m);
    else return v;
}

// out[t][:] = dequantised row tok[t] of the embedding (one block per token).
template <class B> __device__ __forceinline__ void embed32(const B* w, const unsigned int* tok, int cols, float* out) {
    const int t = blockIdx.x;
    const B* row = w + (size_t)tok[t] * (cols / 32);
    for (int i = threadIdx.x; i < cols; i += blockDim.x) out[(size_t)t * cols + i] = dequant32(row + i / 32, i % 32);
}

// The weight products, W[r] . x[t] -> out[t * out_stride + out_off + r].
//
// One warp per row (MMW_WARPS rows per block): lane j loads blocks j,
// j + 32, ... (coalesced, all loads in flight at once) and leaves its eight
// integer sums and scale products in shared memory; lanes 0..7 then run
// the fma chains over those 32 blocks (lane 8 the minimum term), so only
// the short chains are serial.
template <class B>
__device__ __forceinline__ void mmw32(const B* __restrict__ w, const bq8_1* __restrict__ x, float* out, int rows,
                                      int nb, int n_tok, int out_stride, int out_off) {
    __shared__ int ss[MMW_WARPS][8][33];
    __shared__ float sd[MMW_WARPS][32];
    __shared__ float sm[MMW_WARPS][32];
    const int wid = threadIdx.x / 32, lane = threadIdx.x % 32;
    const int r = blockIdx.x * MMW_WARPS + wid;
    if (r >= rows) return; // the whole warp: only warp-level sync below
    const B* row = w + (size_t)r * nb;
    for (int t = 0; t < n_tok; ++t) {
        const bq8_1* a = x + (size_t)t * nb;
        float acc = 0.0f, summs = 0.0f;
        for (int b0 = 0; b0 < nb; b0 += 32) {
            const int b = b0 + lane;
            if (b < nb) {
                const B* wb = row + b;
                const bq8_1* ab = a + b;
#pragma unroll
                for (int l = 0; l < 8; ++l) ss[wid][l][lane] = lane_dot(lane_q(wb, l), ab, l);
                sd[wid][lane] = __fmul_rn(wb->d, ab->d);
                if (has_min<B>::value) sm[wid][lane] = __fmul_rn(block_min(wb), ab->s);
            }
            __syncwarp();
            const int nblk = min(32, nb - b0);
            if (lane < 8) {
                for (int j = 0; j < nblk; ++j) acc = fmaf(sd[wid][j], (float)ss[wid][lane][j], acc);
            } else if (has_min<B>::value && lane == 8) {
                for (int j = 0; j < nblk; ++j) summs = __fadd_rn(summs, sm[wid][j]);
            }
            __syncwarp();
        }
        const float v = hsum8_group(acc);
        const float m = __shfl_sync(0xffffffffu, summs, 8);
        if (lane == 0) out[(size_t)t * out_stride + out_off + r] = has_min<B>::value ? __fadd_rn(v, m) : v;
    }
}

// The first kernels' layout (eight threads per row, each running its lane's
// chain over every block): same results, kept for comparison
// (SAMPLERD_CUDA_MM=lanes). 128 threads = 16 rows per block.
template <class B>
__device__ __forceinline__ void mm32_lanes(const B* w, const bq8_1* x, float* out, int rows, int nb, int n_tok,
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
            if constexpr (has_min<B>::value) summs = __fadd_rn(summs, __fmul_rn(block_min(row + b), a[b].s));
            const float d = __fmul_rn(row[b].d, a[b].d);
            acc = fmaf(d, (float)lane_dot(lane_q(row + b, l), a + b, l), acc);
        }
        const float v = hsum8_group(acc);
        if (valid && l == 0) out[(size_t)t * out_stride + out_off + r] = has_min<B>::value ? __fadd_rn(v, summs) : v;
    }
}

// The exported kernels of one 32-value format: embed_q<f>, mmw_q<f>, mm_q<f>.
#define Q32_KERNELS(f)                                                                                               \
    extern "C" __global__ void embed_q##f(const bq##f* w, const unsigned int* tok, int cols, float* out) {           \
        embed32(w, tok, cols, out);                                                                                  \
    }                                                                                                                \
    extern "C" __global__ void mmw_q##f(const bq##f* __restrict__ w, const bq8_1* __restrict__ x, float* out,        \
                                        int rows, int nb, int n_tok, int out_stride, int out_off) {                  \
        mmw32(w, x, out, rows, nb, n_tok, out_stride, out_off);                                                      \
    }                                                                                                                \
    extern "C" __global__ void mm_q##f(const bq##f* w, const bq8_1* x, float* out, int rows, int nb, int n_tok,      \
                                       int out_stride, int out_off) {                                                \
        mm32_lanes(w, x, out, rows, nb, n_tok, out_stride, out_off);                                                 \
    }
Q32_KERNELS(8_0)
Q32_KERNELS(4_1)
Q32_KERNELS(5_0)
Q32_KERNELS(5_1)
