// A CPU emulation of the CUDA built-ins the kernels (kernels/*.cu) use, so
// they can be compiled as C++ and checked bit for bit against the CPU
// backend without a GPU (server/model/src/cuda/emulation/mod.rs). One
// std::thread per CUDA thread, one block at a time; __syncthreads /
// __syncwarp are barriers, shuffles / ballots exchange values through a
// per-thread slot between two warp barriers; __shared__ variables become
// statics (one block at a time).
// The emulated CUDA driver (cuda/emu/driver.cpp) defines
// SAMPLERD_EMU_FIBERS and runs a block's threads as coroutines on one OS
// thread instead (thousands of launches per token make a std::thread per
// CUDA thread too slow); it then supplies the two barriers itself.
// IEEE arithmetic: build with -ffp-contract=off and without -ffast-math so
// `a * b + c` stays two roundings, as --fmad=false makes it on the GPU.
#include <algorithm>
#include <atomic>
#include <cmath>
#include <condition_variable>
#include <cstdint>
#include <cstring>
#include <memory>
#include <mutex>
#include <thread>
#include <vector>

#define SAMPLERD_CUDA_EMULATION 1
#define __CUDA_ARCH__ 900
#define __global__
#define __device__
#define __forceinline__ inline
#define __restrict__
#define __shared__ static
using std::min;

struct Dim3 { int x, y, z; };
thread_local Dim3 threadIdx, blockIdx, blockDim, gridDim;
thread_local int emu_tid;

#ifndef SAMPLERD_EMU_FIBERS
// A reusable barrier whose participants can leave (threads that return).
struct EmuBarrier {
    std::mutex m;
    std::condition_variable cv;
    int expected, count = 0;
    unsigned long generation = 0;
    explicit EmuBarrier(int n) : expected(n) {}
    void arrive_and_wait() {
        std::unique_lock<std::mutex> l(m);
        const unsigned long g = generation;
        if (++count >= expected) {
            count = 0;
            ++generation;
            cv.notify_all();
        } else {
            cv.wait(l, [&] { return generation != g; });
        }
    }
    void arrive_and_drop() {
        std::unique_lock<std::mutex> l(m);
        --expected;
        if (count > 0 && count >= expected) {
            count = 0;
            ++generation;
            cv.notify_all();
        }
    }
};
static EmuBarrier* emu_block_barrier;
static std::vector<std::unique_ptr<EmuBarrier>> emu_warp_barriers;

inline void __syncthreads() { emu_block_barrier->arrive_and_wait(); }
inline void __syncwarp() { emu_warp_barriers[emu_tid / 32]->arrive_and_wait(); }

#else
void emu_fiber_sync_block();
void emu_fiber_sync_warp();
inline void __syncthreads() { emu_fiber_sync_block(); }
inline void __syncwarp() { emu_fiber_sync_warp(); }
#endif
static uint64_t emu_slots[1024];

// Every lane publishes `v`, then reads lane `src`'s.
template <class T> inline T emu_exchange(T v, int src) {
    const int base = emu_tid - emu_tid % 32;
    uint64_t u = 0;
    memcpy(&u, &v, sizeof(T));
    emu_slots[emu_tid] = u;
    __syncwarp();
    const uint64_t r = emu_slots[base + src];
    __syncwarp();
    T out;
    memcpy(&out, &r, sizeof(T));
    return out;
}
template <class T> inline T __shfl_xor_sync(unsigned, T v, int o) { return emu_exchange(v, (emu_tid % 32) ^ o); }
template <class T> inline T __shfl_sync(unsigned, T v, int src) { return emu_exchange(v, src); }
template <class T> inline T __shfl_down_sync(unsigned, T v, int d, int width = 32) {
    const int lane = emu_tid % 32;
    return emu_exchange(v, (lane % width) + d < width ? lane + d : lane);
}
template <class T> inline T __shfl_up_sync(unsigned, T v, int d) {
    const int lane = emu_tid % 32;
    return emu_exchange(v, lane >= d ? lane - d : lane);
}
inline unsigned int emu_gather_mask(uint64_t mine, bool (*pred)(uint64_t, uint64_t)) {
    const int base = emu_tid - emu_tid % 32;
    emu_slots[emu_tid] = mine;
    __syncwarp();
    unsigned int r = 0;
    for (int l = 0; l < 32; ++l)
        if (pred(emu_slots[base + l], mine)) r |= 1u << l;
    __syncwarp();
    return r;
}
inline unsigned int __ballot_sync(unsigned, bool p) {
    return emu_gather_mask(p, [](uint64_t other, uint64_t) { return other != 0; });
}
inline unsigned int __match_any_sync(unsigned, unsigned int v) {
    return emu_gather_mask(v, [](uint64_t other, uint64_t mine) { return other == mine; });
}
inline unsigned int atomicAdd(unsigned int* p, unsigned int v) { return std::atomic_ref<unsigned int>(*p).fetch_add(v); }
inline int atomicOr(int* p, int v) { return std::atomic_ref<int>(*p).fetch_or(v); }
inline int __popc(unsigned int v) { return __builtin_popcount(v); }
inline int __ffs(unsigned int v) { return __builtin_ffs((int)v); }
inline int __dp4a(int a, int b, int c) {
    int8_t x[4], y[4];
    memcpy(x, &a, 4);
    memcpy(y, &b, 4);
    for (int i = 0; i < 4; ++i) c += (int)x[i] * (int)y[i];
    return c;
}
inline float __fadd_rn(float a, float b) { return a + b; }
inline float __fsub_rn(float a, float b) { return a - b; }
inline float __fmul_rn(float a, float b) { return a * b; }
inline float __fdiv_rn(float a, float b) { return a / b; }
inline float __fsqrt_rn(float a) { return std::sqrt(a); }
inline double __dadd_rn(double a, double b) { return a + b; }
inline double __dmul_rn(double a, double b) { return a * b; }
inline float __int_as_float(int i) { float f; memcpy(&f, &i, 4); return f; }
inline unsigned int __float_as_uint(float f) { unsigned int u; memcpy(&u, &f, 4); return u; }
inline int __float_as_int(float f) { int i; memcpy(&i, &f, 4); return i; }
inline double __longlong_as_double(long long i) { double f; memcpy(&f, &i, 8); return f; }
inline long long __double_as_longlong(double f) { long long i; memcpy(&i, &f, 8); return i; }
inline unsigned short f2h(float f) { _Float16 h = (_Float16)f; unsigned short u; memcpy(&u, &h, 2); return u; }
inline float h2f(unsigned short h) { _Float16 f; memcpy(&f, &h, 2); return (float)f; }

#ifndef SAMPLERD_EMU_FIBERS
// Runs `kernel` over a (gx, gy) grid of `threads`-thread blocks.
template <class F> void emu_launch(int gx, int gy, int threads, F kernel) {
    for (int by = 0; by < gy; ++by)
        for (int bx = 0; bx < gx; ++bx) {
            EmuBarrier block(threads);
            emu_block_barrier = &block;
            emu_warp_barriers.clear();
            for (int w = 0; w < (threads + 31) / 32; ++w) emu_warp_barriers.emplace_back(new EmuBarrier(32));
            std::vector<std::thread> ts;
            for (int t = 0; t < threads; ++t)
                ts.emplace_back([&, t] {
                    threadIdx = {t, 0, 0};
                    blockIdx = {bx, by, 0};
                    blockDim = {threads, 1, 1};
                    gridDim = {gx, gy, 1};
                    emu_tid = t;
                    kernel();
                    emu_warp_barriers[t / 32]->arrive_and_drop();
                    emu_block_barrier->arrive_and_drop();
                });
            for (auto& th : ts) th.join();
        }
}
#endif
