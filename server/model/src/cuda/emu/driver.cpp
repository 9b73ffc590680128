// An emulated CUDA driver (libcuda.so.1) on host memory, for running the
// CUDA backend end to end without a GPU: cudarc loads it like the real
// driver when its folder is first on LD_LIBRARY_PATH (scripts/ci/
// cuda-emulated.sh). It implements the subset of the driver API the backend
// calls through cudarc, and the kernels are the backend's own CUDA C
// (kernels/*.cu) compiled into this library as C++ with the emulation
// prelude (cuda/emulation/prelude.h, in coroutine mode: fibers.h).
//
// What it refuses, as a device would, with CUDA's error code and a line on
// stderr ("cuda-emu: ...") naming the call and the values:
// - copies and memsets outside a live allocation;
// - launches whose parameter buffer is not the size the kernel's C++
//   signature packs to, whose pointer parameters are neither null nor inside
//   a live allocation, with a block of more than 1,024 threads (or a zero
//   dimension), or more dynamic shared memory than 48 KiB without the
//   kernel's opt-in attribute (227 KiB ever);
// - kernels that write past the end of an allocation they were given (each
//   allocation has a guard zone checked after the launch);
// - synchronous calls during stream capture, barrier divergence.
// Fresh allocations are filled with 0xff bytes (NaN as floats), so a kernel
// reading memory nothing wrote shows up in the results.
//
// Work runs when it is enqueued (stream order is then trivially kept, and
// events complete at once); captured work is recorded into a graph and
// replayed, with its parameters as they were at capture. One launch runs at
// a time (a process-wide lock): __shared__ variables are statics.
//
// Beyond the driver API it exports samplerd_emu_live_allocations() and
// samplerd_emu_live_bytes() for tests, samplerd_emu_last_error() (the last
// refusal's message), samplerd_emu_set_memory() (the device's size; also
// SAMPLERD_CUDA_EMU_MEMORY, in bytes, default 1 GiB) and
// samplerd_emu_launches(name) (how often a kernel has run).
#define SAMPLERD_EMU_FIBERS 1
#include "../emulation/prelude.h"
#include "fibers.h"

void emu::enter_thread(int t) {
    const BlockRunner& r = g_runner;
    threadIdx = {t % r.bdx, (t / r.bdx) % r.bdy, t / (r.bdx * r.bdy)};
    emu_tid = t;
}

// The kernels, as C++ (the order of source.rs).
#include "../kernels/forward.cu"
#include "../kernels/q32.cu"
#include "../kernels/kquant.cu"
#include "../kernels/half.cu"
#include "../kernels/sampling.cu"

#include <chrono>
#include <cstdarg>
#include <cstdio>
#include <map>
#include <string>
#include <type_traits>
#include <utility>

namespace {

using CUresult = int;
constexpr CUresult SUCCESS = 0, INVALID_VALUE = 1, OUT_OF_MEMORY = 2, NOT_INITIALIZED = 3, INVALID_DEVICE = 101,
                   INVALID_IMAGE = 200, INVALID_HANDLE = 400, NOT_FOUND = 500, ILLEGAL_ADDRESS = 700,
                   LAUNCH_FAILED = 719, NOT_SUPPORTED = 801, CAPTURE_UNSUPPORTED = 900, CAPTURE_INVALIDATED = 901,
                   CAPTURE_WRONG_THREAD = 908;

// The last refusal's message (samplerd_emu_last_error).
std::mutex g_last_mu;
std::string g_last;

void report(const char* fmt, ...) {
    char msg[512];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(msg, sizeof msg, fmt, ap);
    va_end(ap);
    fprintf(stderr, "cuda-emu: %s\n", msg);
    std::lock_guard<std::mutex> l(g_last_mu);
    g_last = msg;
}

// ---- kernels: name → signature ----------------------------------------------

struct Param {
    size_t offset, size;
    bool pointer;
};

struct Kernel {
    const char* name;
    void* fn;
    void (*invoke)(void* fn, const uint8_t* params);
    std::vector<Param> params;
    size_t buffer_bytes;  // the parameters packed as a C struct (CUDA's layout)
};

template <class... A, size_t... I>
void call(void* fn, const uint8_t* p, const size_t* offs, std::index_sequence<I...>) {
    auto load = [&](auto tag, size_t off) {
        using T = typename decltype(tag)::type;
        T v;
        memcpy(&v, p + off, sizeof(T));
        return v;
    };
    ((void (*)(A...))fn)(load(std::type_identity<A>{}, offs[I])...);
}

template <class... A> struct Layout {
    static const size_t* offsets() {
        static size_t offs[sizeof...(A) + 1];
        static bool done = false;
        if (!done) {
            size_t off = 0, i = 0;
            ((off = (off + alignof(A) - 1) / alignof(A) * alignof(A), offs[i++] = off, off += sizeof(A)), ...);
            done = true;
        }
        return offs;
    }
    static void invoke(void* fn, const uint8_t* p) { call<A...>(fn, p, offsets(), std::index_sequence_for<A...>{}); }
};

template <class... A> Kernel entry(const char* name, void (*f)(A...)) {
    Kernel k{name, (void*)f, &Layout<A...>::invoke, {}, 0};
    const size_t* offs = Layout<A...>::offsets();
    size_t i = 0, align = 1;
    ((k.params.push_back({offs[i], sizeof(A), std::is_pointer_v<A>}), ++i, align = std::max(align, alignof(A))), ...);
    const size_t end = k.params.empty() ? 0 : k.params.back().offset + k.params.back().size;
    k.buffer_bytes = (end + align - 1) / align * align;
    return k;
}

#define K(n) entry(#n, n)
#define KF(s) K(embed_##s), K(mmw_##s), K(mm_##s)
const std::vector<Kernel>& kernels() {
    static const std::vector<Kernel> all = {
        K(add_norm_quant), K(quantize_q8_1), K(quantize_q8_k), K(qkv_rope_store), K(attn_scores),
        K(attention), K(qkv_rope_store_batch), K(attn_scores_batch), K(attention_batch), K(scatter_logits),
        K(swiglu_quant), K(check_logits), K(logit_bias), K(penalties),
        K(scale_temperature), K(top_k), K(top_k_partial), K(top_k_merge), K(survivor_raw), K(lse_blocks), KF(q8_0), KF(q4_1), KF(q5_0), KF(q5_1), KF(q4_k), KF(q5_k),
        KF(q6_k), KF(f16), KF(bf16),
    };
    return all;
}

// ---- driver state -------------------------------------------------------------

// A guard zone after every allocation, checked after each launch that was
// given a pointer into it.
constexpr size_t GUARD = 256;
constexpr uint8_t GUARD_BYTE = 0xa5;

struct Alloc {
    size_t size;
};

struct Function {
    const Kernel* k;
    int max_dynamic_shared = 0;
};

struct Op {
    enum Kind { LAUNCH, COPY, SET } kind;
    const Function* f = nullptr;
    unsigned grid[3]{}, block[3]{};
    unsigned shared = 0;
    std::vector<uint8_t> params;
    uint64_t dst = 0, src = 0;
    size_t bytes = 0;
    uint8_t value = 0;
};

struct Graph {
    std::vector<Op> ops;
};

struct Stream {
    Graph* capture = nullptr;
    bool invalidated = false;
};

struct Event {
    double ms = 0;
};

struct Module {
    std::string image;
};

struct State {
    std::mutex mu;
    bool initialised = false;
    std::map<uint64_t, Alloc> allocs;  // by base address
    size_t live_bytes = 0;
    size_t total_bytes = size_t(1) << 30;
    int captures = 0;
};

State& st() {
    static State* s = [] {
        auto* s = new State;
        if (const char* m = getenv("SAMPLERD_CUDA_EMU_MEMORY")) s->total_bytes = strtoull(m, nullptr, 10);
        return s;
    }();
    return *s;
}

int g_context_tag;  // the primary context's handle points here
thread_local void* t_current_ctx = nullptr;
Stream g_default_stream;

Stream* stream_of(void* h) {
    // 0, CU_STREAM_LEGACY (1) and CU_STREAM_PER_THREAD (2) are the default stream.
    return (uintptr_t)h <= 2 ? &g_default_stream : (Stream*)h;
}

// The allocation holding [p, p + n), or null.
const std::pair<const uint64_t, Alloc>* find_alloc(uint64_t p, size_t n) {
    auto& a = st().allocs;
    auto it = a.upper_bound(p);
    if (it == a.begin()) return nullptr;
    --it;
    if (p < it->first || p + n > it->first + it->second.size || p + n < p) return nullptr;
    return &*it;
}

CUresult check_range(const char* call, const char* what, uint64_t p, size_t n) {
    if (find_alloc(p, n)) return SUCCESS;
    report("%s: %s range [0x%llx, +%zu) is not inside a live allocation", call, what, (unsigned long long)p, n);
    return INVALID_VALUE;
}

bool guard_intact(uint64_t base, size_t size) {
    const uint8_t* g = (const uint8_t*)(base + size);
    for (size_t i = 0; i < GUARD; ++i)
        if (g[i] != GUARD_BYTE) return false;
    return true;
}

// Launches run per kernel name (samplerd_emu_launches).
std::mutex g_counts_mu;
std::map<std::string, uint64_t> g_counts;

CUresult run_launch(const Function& fn, const unsigned* grid, const unsigned* block, const uint8_t* params) {
    const Kernel& k = *fn.k;
    {
        std::lock_guard<std::mutex> l(g_counts_mu);
        ++g_counts[k.name];
    }
    // Pointer parameters: null, or inside a live allocation.
    std::vector<uint64_t> bases;
    for (size_t i = 0; i < k.params.size(); ++i) {
        if (!k.params[i].pointer) continue;
        uint64_t p;
        memcpy(&p, params + k.params[i].offset, 8);
        if (p == 0) continue;
        const auto* a = find_alloc(p, 0);
        if (!a || p == a->first + a->second.size) {
            report("cuLaunchKernel %s: pointer parameter %zu (0x%llx) is not inside a live allocation", k.name, i,
                   (unsigned long long)p);
            return ILLEGAL_ADDRESS;
        }
        bases.push_back(a->first);
    }
    emu::BlockRunner& r = emu::g_runner;
    r.bdx = (int)block[0];
    r.bdy = (int)block[1];
    const int threads = (int)(block[0] * block[1] * block[2]);
    blockDim = {(int)block[0], (int)block[1], (int)block[2]};
    gridDim = {(int)grid[0], (int)grid[1], (int)grid[2]};
    struct Call {
        const Kernel* k;
        const uint8_t* p;
    } c{&k, params};
    auto body = [](void* a) {
        auto* c = (Call*)a;
        c->k->invoke(c->k->fn, c->p);
    };
    for (unsigned z = 0; z < grid[2]; ++z)
        for (unsigned y = 0; y < grid[1]; ++y)
            for (unsigned x = 0; x < grid[0]; ++x) {
                blockIdx = {(int)x, (int)y, (int)z};
                std::string e = emu::run_block(threads, body, &c);
                if (!e.empty()) {
                    report("cuLaunchKernel %s block (%u, %u, %u): %s", k.name, x, y, z, e.c_str());
                    return LAUNCH_FAILED;
                }
            }
    for (uint64_t b : bases) {
        const Alloc& a = st().allocs.at(b);
        if (!guard_intact(b, a.size)) {
            report("cuLaunchKernel %s: wrote past the end of the %zu-byte allocation at 0x%llx", k.name, a.size,
                   (unsigned long long)b);
            memset((void*)(b + a.size), GUARD_BYTE, GUARD);
            return ILLEGAL_ADDRESS;
        }
    }
    return SUCCESS;
}

CUresult run_op(const Op& op) {
    switch (op.kind) {
        case Op::LAUNCH:
            return run_launch(*op.f, op.grid, op.block, op.params.data());
        case Op::COPY:
            memmove((void*)op.dst, (const void*)op.src, op.bytes);
            return SUCCESS;
        case Op::SET:
            memset((void*)op.dst, op.value, op.bytes);
            return SUCCESS;
    }
    return SUCCESS;
}

// Runs `op` now, or records it when `s` is capturing.
CUresult enqueue(void* s, Op op) {
    Stream* str = stream_of(s);
    if (str->capture) {
        str->capture->ops.push_back(std::move(op));
        return SUCCESS;
    }
    return run_op(op);
}

// Synchronous calls are not allowed while any stream captures (the real
// driver's rule for the legacy stream; the backend never needs one).
CUresult refuse_during_capture(const char* call) {
    if (st().captures == 0) return SUCCESS;
    report("%s: a synchronous call during stream capture", call);
    return CAPTURE_UNSUPPORTED;
}

using Lock = std::lock_guard<std::mutex>;

}  // namespace

#define API extern "C" __attribute__((visibility("default")))

// ---- initialisation, device, context ------------------------------------------

API CUresult cuInit(unsigned) {
    Lock l(st().mu);
    st().initialised = true;
    return SUCCESS;
}
API CUresult cuDriverGetVersion(int* v) {
    *v = 13000;
    return SUCCESS;
}
API CUresult cuDeviceGetCount(int* n) {
    if (!st().initialised) return NOT_INITIALIZED;
    *n = 1;
    return SUCCESS;
}
API CUresult cuDeviceGet(int* d, int ordinal) {
    if (!st().initialised) return NOT_INITIALIZED;
    if (ordinal != 0) return INVALID_DEVICE;
    *d = 0;
    return SUCCESS;
}
API CUresult cuDeviceGetName(char* name, int len, int dev) {
    if (dev != 0) return INVALID_DEVICE;
    snprintf(name, (size_t)len, "samplerd emulated CUDA device");
    return SUCCESS;
}
API CUresult cuDeviceTotalMem_v2(size_t* bytes, int dev) {
    if (dev != 0) return INVALID_DEVICE;
    *bytes = st().total_bytes;
    return SUCCESS;
}
API CUresult cuDeviceGetAttribute(int* v, int attr, int dev) {
    if (dev != 0) return INVALID_DEVICE;
    switch (attr) {
        case 1: *v = 1024; break;            // MAX_THREADS_PER_BLOCK
        case 2: *v = 1024; break;            // MAX_BLOCK_DIM_X
        case 3: *v = 1024; break;            // MAX_BLOCK_DIM_Y
        case 4: *v = 64; break;              // MAX_BLOCK_DIM_Z
        case 5: *v = 0x7fffffff; break;      // MAX_GRID_DIM_X
        case 6: case 7: *v = 65535; break;   // MAX_GRID_DIM_Y / Z
        case 8: *v = 48 << 10; break;        // MAX_SHARED_MEMORY_PER_BLOCK
        case 10: *v = 32; break;             // WARP_SIZE
        case 16: *v = 1; break;              // MULTIPROCESSOR_COUNT
        case 75: *v = 9; break;              // COMPUTE_CAPABILITY_MAJOR
        case 76: *v = 0; break;              // COMPUTE_CAPABILITY_MINOR
        case 97: *v = 227 << 10; break;      // MAX_SHARED_MEMORY_PER_BLOCK_OPTIN
        case 115: *v = 0; break;             // MEMORY_POOLS_SUPPORTED: plain cuMemAlloc
        default: *v = 0; break;
    }
    return SUCCESS;
}
API CUresult cuDevicePrimaryCtxRetain(void** ctx, int dev) {
    if (!st().initialised) return NOT_INITIALIZED;
    if (dev != 0) return INVALID_DEVICE;
    *ctx = &g_context_tag;
    return SUCCESS;
}
API CUresult cuDevicePrimaryCtxRelease_v2(int dev) { return dev == 0 ? SUCCESS : INVALID_DEVICE; }
API CUresult cuCtxSetCurrent(void* ctx) {
    t_current_ctx = ctx;
    return SUCCESS;
}
API CUresult cuCtxGetCurrent(void** ctx) {
    *ctx = t_current_ctx;
    return SUCCESS;
}
API CUresult cuCtxSynchronize() {
    Lock l(st().mu);
    return refuse_during_capture("cuCtxSynchronize");
}
API CUresult cuCtxGetStreamPriorityRange(int* least, int* greatest) {
    *least = 0;
    *greatest = 0;
    return SUCCESS;
}

// ---- errors -------------------------------------------------------------------

static const char* error_name(CUresult e) {
    switch (e) {
        case SUCCESS: return "CUDA_SUCCESS";
        case INVALID_VALUE: return "CUDA_ERROR_INVALID_VALUE";
        case OUT_OF_MEMORY: return "CUDA_ERROR_OUT_OF_MEMORY";
        case NOT_INITIALIZED: return "CUDA_ERROR_NOT_INITIALIZED";
        case INVALID_DEVICE: return "CUDA_ERROR_INVALID_DEVICE";
        case INVALID_IMAGE: return "CUDA_ERROR_INVALID_IMAGE";
        case INVALID_HANDLE: return "CUDA_ERROR_INVALID_HANDLE";
        case NOT_FOUND: return "CUDA_ERROR_NOT_FOUND";
        case ILLEGAL_ADDRESS: return "CUDA_ERROR_ILLEGAL_ADDRESS";
        case LAUNCH_FAILED: return "CUDA_ERROR_LAUNCH_FAILED";
        case NOT_SUPPORTED: return "CUDA_ERROR_NOT_SUPPORTED";
        case CAPTURE_UNSUPPORTED: return "CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED";
        case CAPTURE_INVALIDATED: return "CUDA_ERROR_STREAM_CAPTURE_INVALIDATED";
        case CAPTURE_WRONG_THREAD: return "CUDA_ERROR_STREAM_CAPTURE_WRONG_THREAD";
        default: return nullptr;
    }
}
static const char* error_string(CUresult e) {
    switch (e) {
        case SUCCESS: return "no error";
        case INVALID_VALUE: return "invalid argument";
        case OUT_OF_MEMORY: return "out of memory";
        case NOT_INITIALIZED: return "initialization error";
        case INVALID_DEVICE: return "invalid device ordinal";
        case INVALID_IMAGE: return "device kernel image is invalid";
        case INVALID_HANDLE: return "invalid resource handle";
        case NOT_FOUND: return "named symbol not found";
        case ILLEGAL_ADDRESS: return "an illegal memory access was encountered";
        case LAUNCH_FAILED: return "unspecified launch failure";
        case NOT_SUPPORTED: return "operation not supported";
        case CAPTURE_UNSUPPORTED: return "operation not permitted when stream is capturing";
        case CAPTURE_INVALIDATED: return "operation failed due to a previous error during capture";
        case CAPTURE_WRONG_THREAD: return "attempt to terminate a thread-local capture sequence from another thread";
        default: return nullptr;
    }
}
API CUresult cuGetErrorName(CUresult e, const char** s) {
    *s = error_name(e);
    return *s ? SUCCESS : INVALID_VALUE;
}
API CUresult cuGetErrorString(CUresult e, const char** s) {
    *s = error_string(e);
    return *s ? SUCCESS : INVALID_VALUE;
}

// ---- memory -------------------------------------------------------------------

API CUresult cuMemAlloc_v2(uint64_t* p, size_t n) {
    Lock l(st().mu);
    if (n == 0) {
        report("cuMemAlloc: zero bytes");
        return INVALID_VALUE;
    }
    if (st().live_bytes + n > st().total_bytes) {
        report("cuMemAlloc: %zu bytes with %zu of %zu in use", n, st().live_bytes, st().total_bytes);
        return OUT_OF_MEMORY;
    }
    uint8_t* m = (uint8_t*)aligned_alloc(256, (n + GUARD + 255) / 256 * 256);
    if (!m) return OUT_OF_MEMORY;
    memset(m, 0xff, n);
    memset(m + n, GUARD_BYTE, GUARD);
    *p = (uint64_t)m;
    st().allocs[*p] = {n};
    st().live_bytes += n;
    return SUCCESS;
}
API CUresult cuMemFree_v2(uint64_t p) {
    Lock l(st().mu);
    auto it = st().allocs.find(p);
    if (it == st().allocs.end()) {
        report("cuMemFree: 0x%llx is not the start of a live allocation", (unsigned long long)p);
        return INVALID_VALUE;
    }
    if (!guard_intact(p, it->second.size))
        report("cuMemFree: the guard zone after the %zu-byte allocation at 0x%llx was overwritten", it->second.size,
               (unsigned long long)p);
    st().live_bytes -= it->second.size;
    st().allocs.erase(it);
    free((void*)p);
    return SUCCESS;
}
API CUresult cuMemGetInfo_v2(size_t* free_bytes, size_t* total) {
    Lock l(st().mu);
    *free_bytes = st().total_bytes - st().live_bytes;
    *total = st().total_bytes;
    return SUCCESS;
}
API CUresult cuMemHostAlloc(void** p, size_t n, unsigned) {
    *p = malloc(n ? n : 1);
    return *p ? SUCCESS : OUT_OF_MEMORY;
}
API CUresult cuMemFreeHost(void* p) {
    free(p);
    return SUCCESS;
}

static CUresult copy(const char* call, void* s, uint64_t dst, uint64_t src, size_t n, bool dst_dev, bool src_dev,
                     bool async) {
    Lock l(st().mu);
    if (!async)
        if (CUresult e = refuse_during_capture(call)) return e;
    if (dst_dev)
        if (CUresult e = check_range(call, "destination", dst, n)) return e;
    if (src_dev)
        if (CUresult e = check_range(call, "source", src, n)) return e;
    Op op{Op::COPY};
    op.dst = dst;
    op.src = src;
    op.bytes = n;
    return enqueue(async ? s : nullptr, std::move(op));
}
API CUresult cuMemcpyHtoD_v2(uint64_t d, const void* h, size_t n) {
    return copy("cuMemcpyHtoD", nullptr, d, (uint64_t)h, n, true, false, false);
}
API CUresult cuMemcpyDtoH_v2(void* h, uint64_t d, size_t n) {
    return copy("cuMemcpyDtoH", nullptr, (uint64_t)h, d, n, false, true, false);
}
API CUresult cuMemcpyDtoD_v2(uint64_t d, uint64_t s, size_t n) {
    return copy("cuMemcpyDtoD", nullptr, d, s, n, true, true, false);
}
API CUresult cuMemcpyHtoDAsync_v2(uint64_t d, const void* h, size_t n, void* s) {
    return copy("cuMemcpyHtoDAsync", s, d, (uint64_t)h, n, true, false, true);
}
API CUresult cuMemcpyDtoHAsync_v2(void* h, uint64_t d, size_t n, void* s) {
    return copy("cuMemcpyDtoHAsync", s, (uint64_t)h, d, n, false, true, true);
}
API CUresult cuMemcpyDtoDAsync_v2(uint64_t d, uint64_t src, size_t n, void* s) {
    return copy("cuMemcpyDtoDAsync", s, d, src, n, true, true, true);
}
static CUresult memset8(const char* call, uint64_t d, uint8_t v, size_t n, void* s, bool async) {
    Lock l(st().mu);
    if (!async)
        if (CUresult e = refuse_during_capture(call)) return e;
    if (CUresult e = check_range(call, "destination", d, n)) return e;
    Op op{Op::SET};
    op.dst = d;
    op.bytes = n;
    op.value = v;
    return enqueue(async ? s : nullptr, std::move(op));
}
API CUresult cuMemsetD8_v2(uint64_t d, unsigned char v, size_t n) { return memset8("cuMemsetD8", d, v, n, nullptr, false); }
API CUresult cuMemsetD8Async(uint64_t d, unsigned char v, size_t n, void* s) {
    return memset8("cuMemsetD8Async", d, v, n, s, true);
}

// ---- streams, events ----------------------------------------------------------

API CUresult cuStreamCreate(void** s, unsigned) {
    *s = new Stream;
    return SUCCESS;
}
API CUresult cuStreamCreateWithPriority(void** s, unsigned, int) {
    *s = new Stream;
    return SUCCESS;
}
API CUresult cuStreamDestroy_v2(void* s) {
    Lock l(st().mu);
    if ((uintptr_t)s <= 2) return INVALID_HANDLE;
    Stream* str = (Stream*)s;
    if (str->capture) {
        delete str->capture;
        --st().captures;
    }
    delete str;
    return SUCCESS;
}
API CUresult cuStreamSynchronize(void* s) {
    Lock l(st().mu);
    if (stream_of(s)->capture) {
        report("cuStreamSynchronize: the stream is capturing");
        stream_of(s)->invalidated = true;
        return CAPTURE_UNSUPPORTED;
    }
    return SUCCESS;
}
API CUresult cuStreamWaitEvent(void*, void*, unsigned) { return SUCCESS; }
API CUresult cuStreamQuery(void*) { return SUCCESS; }

static double now_ms() {
    return std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now().time_since_epoch()).count();
}
API CUresult cuEventCreate(void** e, unsigned) {
    *e = new Event;
    return SUCCESS;
}
API CUresult cuEventDestroy_v2(void* e) {
    delete (Event*)e;
    return SUCCESS;
}
API CUresult cuEventRecord(void* e, void*) {
    if (!e) return INVALID_HANDLE;
    ((Event*)e)->ms = now_ms();
    return SUCCESS;
}
API CUresult cuEventSynchronize(void* e) { return e ? SUCCESS : INVALID_HANDLE; }
API CUresult cuEventQuery(void* e) { return e ? SUCCESS : INVALID_HANDLE; }
API CUresult cuEventElapsedTime(float* ms, void* a, void* b) {
    if (!a || !b) return INVALID_HANDLE;
    *ms = (float)(((Event*)b)->ms - ((Event*)a)->ms);
    return SUCCESS;
}
API CUresult cuEventElapsedTime_v2(float* ms, void* a, void* b) { return cuEventElapsedTime(ms, a, b); }

// ---- modules, functions, launches ---------------------------------------------

// The emulated NVRTC's "PTX" starts with this line (emu/nvrtc.cpp); real PTX
// is accepted too, and its `.entry` names must then include the function.
static const char NVRTC_MARKER[] = "// samplerd emulated NVRTC";

API CUresult cuModuleLoadData(void** m, const void* image) {
    if (!image) return INVALID_VALUE;
    const char* text = (const char*)image;
    if (strncmp(text, NVRTC_MARKER, sizeof NVRTC_MARKER - 1) != 0 && !strstr(text, ".entry ")) {
        report("cuModuleLoadData: the image is neither PTX nor the emulated NVRTC's output");
        return INVALID_IMAGE;
    }
    *m = new Module{text};
    return SUCCESS;
}
API CUresult cuModuleUnload(void* m) {
    delete (Module*)m;
    return SUCCESS;
}
API CUresult cuModuleGetFunction(void** f, void* m, const char* name) {
    if (!m) return INVALID_HANDLE;
    const Module& mod = *(Module*)m;
    const bool ptx = mod.image.rfind(NVRTC_MARKER, 0) != 0;
    if (ptx && mod.image.find(std::string(".entry ") + name + "(") == std::string::npos) {
        report("cuModuleGetFunction: %s is not in the module's PTX", name);
        return NOT_FOUND;
    }
    for (const Kernel& k : kernels())
        if (strcmp(k.name, name) == 0) {
            *f = new Function{&k};
            return SUCCESS;
        }
    report("cuModuleGetFunction: no kernel named %s", name);
    return NOT_FOUND;
}
API CUresult cuFuncSetAttribute(void* f, int attr, int v) {
    if (!f) return INVALID_HANDLE;
    if (attr == 8) {  // MAX_DYNAMIC_SHARED_SIZE_BYTES
        if (v < 0 || v > (227 << 10)) {
            report("cuFuncSetAttribute: %d bytes of dynamic shared memory exceeds 227 KiB", v);
            return INVALID_VALUE;
        }
        ((Function*)f)->max_dynamic_shared = v;
    }
    return SUCCESS;
}
API CUresult cuFuncGetAttribute(int* v, int attr, void* f) {
    if (!f) return INVALID_HANDLE;
    switch (attr) {
        case 0: *v = 1024; break;  // MAX_THREADS_PER_BLOCK
        case 8: *v = ((Function*)f)->max_dynamic_shared; break;
        default: *v = 0; break;
    }
    return SUCCESS;
}
API CUresult cuFuncSetCacheConfig(void*, int) { return SUCCESS; }

API CUresult cuLaunchKernel(void* fp, unsigned gx, unsigned gy, unsigned gz, unsigned bx, unsigned by, unsigned bz,
                            unsigned shared, void* s, void** kernel_params, void** extra) {
    if (!fp) return INVALID_HANDLE;
    const Function& fn = *(Function*)fp;
    const Kernel& k = *fn.k;
    const uint64_t threads = (uint64_t)bx * by * bz;
    if (gx == 0 || gy == 0 || gz == 0 || gy > 65535 || gz > 65535 || gx > 0x7fffffffu) {
        report("cuLaunchKernel %s: grid (%u, %u, %u) is outside the device's limits", k.name, gx, gy, gz);
        return INVALID_VALUE;
    }
    if (bx == 0 || by == 0 || bz == 0 || threads > 1024 || bz > 64) {
        report("cuLaunchKernel %s: block (%u, %u, %u) has %llu threads; the device allows 1..=1024 (z <= 64)", k.name,
               bx, by, bz, (unsigned long long)threads);
        return INVALID_VALUE;
    }
    const unsigned limit = fn.max_dynamic_shared > (48 << 10) ? (unsigned)fn.max_dynamic_shared : (48u << 10);
    if (shared > limit) {
        report("cuLaunchKernel %s: %u bytes of dynamic shared memory; the limit is %u (48 KiB unless "
               "CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES raises it, 227 KiB at most)",
               k.name, shared, limit);
        return INVALID_VALUE;
    }
    std::vector<uint8_t> buf(k.buffer_bytes);
    if (kernel_params && extra) {
        report("cuLaunchKernel %s: both kernelParams and extra given", k.name);
        return INVALID_VALUE;
    }
    if (extra) {
        const void* ptr = nullptr;
        size_t size = (size_t)-1;
        for (void** e = extra; *e; e += 2) {
            if (*e == (void*)1) ptr = e[1];
            else if (*e == (void*)2) size = *(const size_t*)e[1];
            else {
                report("cuLaunchKernel %s: unknown extra option %p", k.name, *e);
                return INVALID_VALUE;
            }
        }
        if (!ptr || size != k.buffer_bytes) {
            report("cuLaunchKernel %s: the parameter buffer is %zu bytes; the kernel's %zu parameters pack to %zu",
                   k.name, size == (size_t)-1 ? 0 : size, k.params.size(), k.buffer_bytes);
            return INVALID_VALUE;
        }
        memcpy(buf.data(), ptr, size);
    } else if (kernel_params) {
        for (size_t i = 0; i < k.params.size(); ++i) {
            if (!kernel_params[i]) {
                report("cuLaunchKernel %s: kernelParams[%zu] is null (%zu parameters)", k.name, i, k.params.size());
                return INVALID_VALUE;
            }
            memcpy(buf.data() + k.params[i].offset, kernel_params[i], k.params[i].size);
        }
    } else if (!k.params.empty()) {
        report("cuLaunchKernel %s: no parameters given, the kernel takes %zu", k.name, k.params.size());
        return INVALID_VALUE;
    }
    Lock l(st().mu);
    Op op{Op::LAUNCH};
    op.f = &fn;
    op.grid[0] = gx, op.grid[1] = gy, op.grid[2] = gz;
    op.block[0] = bx, op.block[1] = by, op.block[2] = bz;
    op.shared = shared;
    op.params = std::move(buf);
    return enqueue(s, std::move(op));
}

// ---- graphs -------------------------------------------------------------------

API CUresult cuStreamBeginCapture_v2(void* s, int) {
    Lock l(st().mu);
    Stream* str = stream_of(s);
    if (str == &g_default_stream) {
        report("cuStreamBeginCapture: the legacy default stream cannot capture");
        return CAPTURE_UNSUPPORTED;
    }
    if (str->capture) return INVALID_VALUE;
    str->capture = new Graph;
    str->invalidated = false;
    ++st().captures;
    return SUCCESS;
}
API CUresult cuStreamEndCapture(void* s, void** g) {
    Lock l(st().mu);
    Stream* str = stream_of(s);
    if (!str->capture) return INVALID_VALUE;
    Graph* graph = str->capture;
    str->capture = nullptr;
    --st().captures;
    if (str->invalidated) {
        delete graph;
        *g = nullptr;
        return CAPTURE_INVALIDATED;
    }
    *g = graph;
    return SUCCESS;
}
API CUresult cuStreamIsCapturing(void* s, int* status) {
    *status = stream_of(s)->capture ? 1 : 0;
    return SUCCESS;
}
API CUresult cuGraphInstantiateWithFlags(void** exec, void* g, unsigned long long) {
    if (!g) return INVALID_VALUE;
    *exec = new Graph(*(Graph*)g);
    return SUCCESS;
}
API CUresult cuGraphLaunch(void* exec, void* s) {
    if (!exec) return INVALID_HANDLE;
    Lock l(st().mu);
    if (stream_of(s)->capture) return NOT_SUPPORTED;
    for (const Op& op : ((Graph*)exec)->ops)
        if (CUresult e = run_op(op)) {
            report("cuGraphLaunch: a replayed operation failed (%s)", error_name(e));
            return e;
        }
    return SUCCESS;
}
API CUresult cuGraphUpload(void* exec, void*) { return exec ? SUCCESS : INVALID_HANDLE; }
API CUresult cuGraphDestroy(void* g) {
    delete (Graph*)g;
    return SUCCESS;
}
API CUresult cuGraphExecDestroy(void* e) {
    delete (Graph*)e;
    return SUCCESS;
}

// ---- for tests ----------------------------------------------------------------

API uint64_t samplerd_emu_live_allocations() {
    Lock l(st().mu);
    return st().allocs.size();
}
// The message of the last refusal ("" when none); the pointer stays valid
// until the next refusal.
API const char* samplerd_emu_last_error() {
    std::lock_guard<std::mutex> l(g_last_mu);
    static thread_local std::string copy;
    copy = g_last;
    return copy.c_str();
}
// Sets the device's memory size (tests of running out of device memory);
// returns the previous size.
API uint64_t samplerd_emu_set_memory(uint64_t bytes) {
    Lock l(st().mu);
    const uint64_t old = st().total_bytes;
    st().total_bytes = bytes;
    return old;
}
// How many launches of kernel `name` have run (or been replayed from a
// graph) in this process.
API uint64_t samplerd_emu_launches(const char* name) {
    std::lock_guard<std::mutex> l(g_counts_mu);
    auto it = g_counts.find(name);
    return it == g_counts.end() ? 0 : it->second;
}
API uint64_t samplerd_emu_live_bytes() {
    Lock l(st().mu);
    return st().live_bytes;
}

// ---- the rest of what cudarc's driver module may call: not emulated ------------
// cudarc resolves each symbol on first use and panics on a missing one; these
// return CUDA_ERROR_NOT_SUPPORTED instead, a clean error.
#define UNSUPPORTED(name) \
    API CUresult name() { \
        report(#name " is not emulated"); \
        return NOT_SUPPORTED; \
    }
UNSUPPORTED(cuCtxCreate_v3)
UNSUPPORTED(cuCtxCreate_v4)
UNSUPPORTED(cuCtxDestroy_v2)
UNSUPPORTED(cuCtxGetCacheConfig)
UNSUPPORTED(cuCtxSetCacheConfig)
UNSUPPORTED(cuCtxGetLimit)
UNSUPPORTED(cuCtxSetLimit)
UNSUPPORTED(cuCtxSetFlags)
UNSUPPORTED(cuDeviceGetUuid)
UNSUPPORTED(cuDeviceGetUuid_v2)
UNSUPPORTED(cuDeviceGetDefaultMemPool)
UNSUPPORTED(cuDeviceGetMemPool)
UNSUPPORTED(cuDeviceSetMemPool)
UNSUPPORTED(cuMemAllocAsync)
UNSUPPORTED(cuMemAllocFromPoolAsync)
UNSUPPORTED(cuMemFreeAsync)
UNSUPPORTED(cuMemAllocManaged)
UNSUPPORTED(cuMemAdvise_v2)
UNSUPPORTED(cuMemPrefetchAsync_v2)
UNSUPPORTED(cuMemcpyPeerAsync)
UNSUPPORTED(cuMemPoolCreate)
UNSUPPORTED(cuMemPoolDestroy)
UNSUPPORTED(cuMemPoolGetAttribute)
UNSUPPORTED(cuMemPoolSetAttribute)
UNSUPPORTED(cuMemPoolTrimTo)
UNSUPPORTED(cuModuleLoad)
UNSUPPORTED(cuModuleGetGlobal_v2)
UNSUPPORTED(cuLaunchCooperativeKernel)
UNSUPPORTED(cuLaunchHostFunc)
UNSUPPORTED(cuStreamAttachMemAsync)
UNSUPPORTED(cuImportExternalMemory)
UNSUPPORTED(cuExternalMemoryGetMappedBuffer)
UNSUPPORTED(cuDestroyExternalMemory)
UNSUPPORTED(cuOccupancyAvailableDynamicSMemPerBlock)
UNSUPPORTED(cuOccupancyMaxActiveBlocksPerMultiprocessor)
UNSUPPORTED(cuOccupancyMaxActiveBlocksPerMultiprocessorWithFlags)
UNSUPPORTED(cuOccupancyMaxPotentialBlockSize)
UNSUPPORTED(cuOccupancyMaxPotentialBlockSizeWithFlags)
