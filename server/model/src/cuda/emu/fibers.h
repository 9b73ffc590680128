// The threads of one emulated thread block as coroutines on the calling OS
// thread: a CUDA thread runs until it reaches a barrier (__syncthreads, or a
// warp's __syncwarp, which every shuffle and ballot of prelude.h passes
// through) or returns; the scheduler then runs the next runnable thread, and
// releases a barrier once every thread of its warp / block that has not
// returned is waiting at it — the semantics of prelude.h's std::thread
// barriers, without thousands of thread creations per launch. A barrier that
// can never be released (some threads wait at __syncthreads while others of
// the block wait at __syncwarp, or have diverged at different barriers) is
// reported as a failed launch, like compute-sanitizer's synccheck.
//
// The context switch is ten lines of x86-64 assembly: ucontext's
// swapcontext makes a signal-mask system call per switch, which made a
// one-token step of a tiny model ~20x slower.
#pragma once

#include <cstddef>
#include <cstdint>
#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <string>
#include <sys/mman.h>

#if !defined(__x86_64__)
#error "the emulated CUDA driver's coroutine switch is written for x86-64"
#endif

// Saves the callee-saved registers, MXCSR and the x87 control word on the
// current stack, stores the stack pointer in *save and continues on `to`.
extern "C" void emu_switch(void** save, void* to);
asm(R"(
    .text
    .globl emu_switch
    .type emu_switch, @function
emu_switch:
    pushq %rbp
    pushq %rbx
    pushq %r12
    pushq %r13
    pushq %r14
    pushq %r15
    subq $8, %rsp
    stmxcsr (%rsp)
    fnstcw 4(%rsp)
    movq %rsp, (%rdi)
    movq %rsi, %rsp
    ldmxcsr (%rsp)
    fldcw 4(%rsp)
    addq $8, %rsp
    popq %r15
    popq %r14
    popq %r13
    popq %r12
    popq %rbx
    popq %rbp
    ret
    .size emu_switch, .-emu_switch
)");

namespace emu {

enum FiberState : uint8_t { RUNNABLE, AT_WARP, AT_BLOCK, DONE };

struct Fiber {
    void* sp;
    FiberState state;
};

// 64 KiB per CUDA thread: the kernels' largest per-thread arrays are a few
// hundred bytes (attention's accumulators); the stacks are mapped once and
// only the touched pages become memory.
constexpr size_t STACK_BYTES = 64 << 10;
constexpr int MAX_THREADS = 1024;

struct BlockRunner {
    void (*body)(void*) = nullptr;
    void* arg = nullptr;
    Fiber fibers[MAX_THREADS];
    int n = 0, current = 0;
    int bdx = 1, bdy = 1;
    void* sched_sp = nullptr;
    char* stacks = nullptr;
};

inline BlockRunner g_runner;

[[noreturn]] inline void fiber_main() {
    BlockRunner& r = g_runner;
    r.body(r.arg);
    Fiber& f = r.fibers[r.current];
    f.state = DONE;
    emu_switch(&f.sp, r.sched_sp);
    __builtin_unreachable();
}

inline void park(FiberState s) {
    BlockRunner& r = g_runner;
    Fiber& f = r.fibers[r.current];
    f.state = s;
    emu_switch(&f.sp, r.sched_sp);
}

// A fresh stack for thread t that "returns" into fiber_main on the first
// switch to it (the frame emu_switch pops: MXCSR / x87 word, six registers,
// the return address; fiber_main starts with the stack as after a call).
inline void* initial_stack(char* base) {
    uintptr_t top = (uintptr_t)(base + STACK_BYTES) & ~(uintptr_t)15;
    uint64_t* sp = (uint64_t*)top;
    *--sp = 0;                       // fiber_main's (never used) return address
    *--sp = (uint64_t)&fiber_main;   // where emu_switch's ret goes
    for (int i = 0; i < 6; ++i) *--sp = 0;
    uint32_t csr;
    uint16_t cw;
    asm volatile("stmxcsr %0" : "=m"(csr));
    asm volatile("fnstcw %0" : "=m"(cw));
    --sp;
    memcpy((char*)sp, &csr, 4);
    memcpy((char*)sp + 4, &cw, 2);
    return sp;
}

// Sets the CUDA thread index variables of prelude.h for thread t.
void enter_thread(int t);

// Runs `body(arg)` as each of the block's n threads until every one has
// returned; an error message when the block's barriers cannot be released.
inline std::string run_block(int n, void (*body)(void*), void* arg) {
    BlockRunner& r = g_runner;
    if (!r.stacks) {
        void* m = mmap(nullptr, STACK_BYTES * MAX_THREADS, PROT_READ | PROT_WRITE,
                       MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
        if (m == MAP_FAILED) return "could not map the emulated threads' stacks";
        r.stacks = (char*)m;
    }
    r.body = body;
    r.arg = arg;
    r.n = n;
    for (int t = 0; t < n; ++t) r.fibers[t] = {initial_stack(r.stacks + (size_t)t * STACK_BYTES), RUNNABLE};
    for (;;) {
        for (int t = 0; t < n; ++t) {
            if (r.fibers[t].state != RUNNABLE) continue;
            r.current = t;
            enter_thread(t);
            emu_switch(&r.sched_sp, r.fibers[t].sp);
        }
        // Every thread has returned or waits at a barrier.
        bool released = false, any_live = false;
        for (int w = 0; w * 32 < n; ++w) {
            const int end = std::min(n, w * 32 + 32);
            bool live = false, all_at_warp = true;
            for (int t = w * 32; t < end; ++t) {
                if (r.fibers[t].state == DONE) continue;
                live = true;
                if (r.fibers[t].state != AT_WARP) all_at_warp = false;
            }
            if (live && all_at_warp) {
                for (int t = w * 32; t < end; ++t)
                    if (r.fibers[t].state == AT_WARP) r.fibers[t].state = RUNNABLE;
                released = true;
            }
            any_live |= live;
        }
        if (!any_live) return {};
        if (released) continue;
        bool all_at_block = true;
        for (int t = 0; t < n; ++t)
            if (r.fibers[t].state != DONE && r.fibers[t].state != AT_BLOCK) all_at_block = false;
        if (!all_at_block)
            return "barrier divergence: some threads of the block wait at __syncthreads and others at "
                   "__syncwarp (or a warp's threads at different barriers)";
        for (int t = 0; t < n; ++t)
            if (r.fibers[t].state == AT_BLOCK) r.fibers[t].state = RUNNABLE;
    }
}

}  // namespace emu

// prelude.h's barriers in coroutine mode (one translation unit).
void emu_fiber_sync_block() { emu::park(emu::AT_BLOCK); }
void emu_fiber_sync_warp() { emu::park(emu::AT_WARP); }
