// The device prefix of a sampler chain (server/sampling/src/device_prefix.rs
// documents the semantics; its `reference` module is the CPU twin the
// tests compare against). Part of the one source forward.cu opens.

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
// Item of a kept entry: its key above its inverted id, so that a larger
// item is a larger logit or, on a tie, a lower id (0: below every entry).
__device__ __forceinline__ unsigned int item_id(unsigned long long it) {
    return 0xFFFFFFFFu - (unsigned int)(it & 0xFFFFFFFFull);
}

// The k (<= n) largest entries of x[0..n) as items, sorted descending, in
// `items` (shared; one block of TOPK_THREADS, every thread calls it).
__device__ void block_top_k(const float* x, int n, int k, int id0, unsigned long long* items) {
    __shared__ unsigned int hist[256];
    __shared__ unsigned int prefix, mask, remaining, n_gt, n_tie_base;
    __shared__ bool gather_done;
    __shared__ unsigned int warp_sums[TOPK_THREADS / 32];
    const int tid = threadIdx.x;
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
            items[slot] = ((unsigned long long)key << 32) | (0xFFFFFFFFu - (unsigned int)(id0 + i));
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
            items[n_greater + before] = ((unsigned long long)key << 32) | (0xFFFFFFFFu - (unsigned int)(id0 + i));
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
}

// The k highest logits, one block over the whole vocabulary (the
// multi-block pair below gives the same result faster; kept as its
// reference). out: [status, count, then (id, logit bits) pairs].
extern "C" __global__ void top_k(const float* x, int n, int k, const int* status_in, unsigned int* out) {
    __shared__ unsigned long long items[TOPK_MAX];
    const int tid = threadIdx.x;
    if (*status_in != ST_OK) {
        if (tid == 0) { out[0] = (unsigned int)*status_in; out[1] = 0; }
        return;
    }
    if (k > n) k = n;
    block_top_k(x, n, k, 0, items);
    for (int i = tid; i < k; i += blockDim.x) {
        const unsigned int id = item_id(items[i]);
        out[2 + 2 * i] = id;
        out[2 + 2 * i + 1] = __float_as_uint(x[id]);
    }
    if (tid == 0) {
        out[0] = ST_OK;
        out[1] = (unsigned int)k;
    }
}

// Multi-block top-k, step 1: block b takes the slice [b·slice, (b+1)·slice)
// and writes its k best as sorted items to part[b·k ..], padded with 0.
// Every entry of the global top k is among its slice's k best, so step 2
// only has to merge these.
extern "C" __global__ void top_k_partial(const float* x, int n, int k, int slice, const int* status_in,
                                         unsigned long long* part) {
    __shared__ unsigned long long items[TOPK_MAX];
    if (*status_in != ST_OK) return;
    const int lo = blockIdx.x * slice;
    const int m = min(slice, n - lo);
    const int kk = min(k, m);
    block_top_k(x + lo, m, kk, lo, items);
    for (int i = threadIdx.x; i < k; i += blockDim.x) part[(size_t)blockIdx.x * k + i] = i < kk ? items[i] : 0ull;
}

// Multi-block top-k, step 2 (one block): the rank of each partial item in
// the union is its index in its own sorted list plus, per other list, how
// many of that list's items are larger (a binary search; items are
// distinct, ids being unique); items ranked below k are written at their
// rank — the single-block kernel's output, bit for bit.
extern "C" __global__ void top_k_merge(const float* x, int n, int k, int lists, const int* status_in,
                                       const unsigned long long* part, unsigned int* out) {
    if (*status_in != ST_OK) {
        if (threadIdx.x == 0) { out[0] = (unsigned int)*status_in; out[1] = 0; }
        return;
    }
    for (int i = threadIdx.x; i < lists * k; i += blockDim.x) {
        const unsigned long long it = part[i];
        if (it == 0ull) continue;
        const int g = i / k;
        int rank = i - g * k;
        for (int h = 0; h < lists && rank < k; ++h) {
            if (h == g) continue;
            // Items of list h larger than `it`: a prefix of the sorted list.
            const unsigned long long* l = part + (size_t)h * k;
            int a = 0, b = k;
            while (a < b) {
                const int mid = (a + b) / 2;
                if (l[mid] > it) a = mid + 1; else b = mid;
            }
            rank += a;
        }
        if (rank < k) {
            const unsigned int id = item_id(it);
            out[2 + 2 * rank] = id;
            out[2 + 2 * rank + 1] = __float_as_uint(x[id]);
        }
    }
    if (threadIdx.x == 0) {
        out[0] = ST_OK;
        out[1] = (unsigned int)min(k, n);
    }
}


// The raw logits of the survivors top_k wrote into `out` (requested k:
// the layout's stride): out[2 + 2k + i] = raw[id of survivor i].
extern "C" __global__ void survivor_raw(const float* raw, int k, unsigned int* out) {
    const int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (out[0] != ST_OK || i >= (int)out[1]) return;
    out[2 + 2 * k + i] = __float_as_uint(raw[out[2 + 2 * i]]);
}

// The raw row's log-sum-exp in the host scan's pieces (plugins/numerics
// lse.rs, PartialLse::add_block): per LSE_BLOCK logits, the block's max
// and its terms exp_term(x - m) summed in LSE_LANES f32 lanes (lane l takes
// x[16j + l] in order), the lanes then added in f64 in lane order and the
// tail (< 16 logits, in order, f32) last — m being the running max of the
// block's LSE_CHUNK (blocks first..=this). The host merges the blocks and
// chunks in f64 with its own exp and log, so the result is the scan's bit
// for bit. `fma`: the host's build has fused multiply-adds (AVX2 / AVX-512).
#define LSE_BLOCK 1024
#define LSE_LANES 16
#define LSE_CHUNK_BLOCKS 8

__device__ __forceinline__ float lse_madd(int fma, float a, float b, float c) {
    return fma ? fmaf(a, b, c) : __fadd_rn(__fmul_rn(a, b), c);
}

// numerics lse.rs exp_term: 2^n · p(f) with the same constants and order.
__device__ __forceinline__ float lse_exp_term(int fma, float x) {
    const float LOG2E = __int_as_float(0x3fb8aa3b);
    const float ROUND = 12582912.0f;
    const float xc = x > -87.0f ? x : -87.0f;
    const float k = lse_madd(fma, xc, LOG2E, ROUND);
    const float n = __fsub_rn(k, ROUND);
    const float f = lse_madd(fma, xc, LOG2E, -n);
    float p = 0.0013276445f;
    p = lse_madd(fma, p, f, 0.009675537f);
    p = lse_madd(fma, p, f, 0.055507135f);
    p = lse_madd(fma, p, f, 0.2402212f);
    p = lse_madd(fma, p, f, 0.69314694f);
    p = lse_madd(fma, p, f, 1.0f);
    const unsigned int bits = (__float_as_uint(k) - (0x4B400000u - 127u)) << 23;
    return __fmul_rn(p, __int_as_float((int)bits));
}

// One block of LSE_LANES threads per LSE_BLOCK logits; out[3b..3b+3] =
// (block max bits, f64 sum low word, high word). Skipped (the host falls
// back) unless status is ST_OK.
extern "C" __global__ void lse_blocks(const float* x, int n, int fma, const int* status, unsigned int* out) {
    __shared__ float lane_max[LSE_LANES];
    __shared__ float lane_sum[LSE_LANES];
    __shared__ float run_max, own_max;
    if (*status != ST_OK) return;
    const int b = blockIdx.x, t = threadIdx.x;
    const int first = b / LSE_CHUNK_BLOCKS * LSE_CHUNK_BLOCKS;
    if (t == 0) run_max = -F_INF;
    __syncthreads();
    for (int bb = first; bb <= b; ++bb) {
        const int s = bb * LSE_BLOCK, e = min(s + LSE_BLOCK, n);
        float m = -F_INF;
        for (int i = s + t; i < e; i += LSE_LANES) m = fmaxf(m, x[i]);
        lane_max[t] = m;
        __syncthreads();
        if (t == 0) {
            float bm = -F_INF;
            for (int l = 0; l < LSE_LANES; ++l) bm = fmaxf(bm, lane_max[l]);
            run_max = fmaxf(run_max, bm);
            own_max = bm;
        }
        __syncthreads();
    }
    const float m = run_max;
    const int s = b * LSE_BLOCK, e = min(s + LSE_BLOCK, n);
    const int full = s + (e - s) / LSE_LANES * LSE_LANES;
    double total = 0.0;
    if (m != -F_INF) {
        float acc = 0.0f;
        for (int i = s + t; i < full; i += LSE_LANES) acc = __fadd_rn(acc, lse_exp_term(fma, __fsub_rn(x[i], m)));
        lane_sum[t] = acc;
        __syncthreads();
        if (t == 0) {
            for (int l = 0; l < LSE_LANES; ++l) total = __dadd_rn(total, (double)lane_sum[l]);
            float tail = 0.0f;
            for (int i = full; i < e; ++i) tail = __fadd_rn(tail, lse_exp_term(fma, __fsub_rn(x[i], m)));
            total = __dadd_rn(total, (double)tail);
        }
    }
    if (t == 0) {
        const unsigned long long bits = (unsigned long long)__double_as_longlong(total);
        out[3 * b] = __float_as_uint(own_max);
        out[3 * b + 1] = (unsigned int)(bits & 0xFFFFFFFFull);
        out[3 * b + 2] = (unsigned int)(bits >> 32);
    }
}
