// cudaemu.h -- run CUDA C kernels on the CPU, for tests on machines without a GPU.
//
// Force-included (g++ -x c++ -include cudaemu.h) in front of a .cu file that executor.py has
// prepared (local includes pasted in with #line markers, inline PTX rewritten to emu::ptx() calls,
// `extern __shared__` arrays rewritten to the dynamic shared memory buffer).
//
// Execution model
//   * A launch runs its blocks one after another on the calling OS thread.
//   * Every thread of a block is a fiber with its own stack (a hand-written x86-64 context switch;
//     ucontext elsewhere). A fiber runs until it reaches a barrier (__syncthreads, a warp collective
//     such as __shfl_xor_sync, __syncwarp, __ballot_sync), then the next runnable fiber runs. This is
//     the Volta+ "independent thread scheduling" model: nothing is implied between two sync points.
//   * Warp collectives complete when every lane named in the mask has arrived; the last lane to
//     arrive computes every lane's result. A lane named in a mask that has exited, or lanes that
//     meet with different masks or different intrinsics, are reported as errors (UB on a GPU).
//   * __syncthreads() releases when every live thread of the block has arrived; threads that arrive
//     at different __syncthreads() call sites (source lines) are reported as errors.
//   * __shared__ variables are function statics placed in the section "emu_shared", which is filled
//     with a poison byte (0xff: NaN floats, -1 ints) before every block, so a read of shared memory
//     that no thread of this block wrote shows up. Dynamic shared memory (extern __shared__) is one
//     256 KiB buffer, poisoned the same way.
//   * The order in which runnable fibers are resumed is forward, reverse or a seeded random
//     permutation per block (emu_set_options), so missing barriers show up as order-dependent output.
#pragma once

#include <algorithm>
#include <cfloat>
#include <cstdarg>
#include <climits>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <tuple>
#include <type_traits>
#include <utility>
#include <vector>

#include <signal.h>
#include <sys/mman.h>
#include <unistd.h>

#if !defined(__x86_64__)
#include <ucontext.h>
#define EMU_UCONTEXT 1
#endif

// ---- what nvcc/NVRTC would define ---------------------------------------------------------------
// The kernels are compiled down their device path: __CUDACC__ and __CUDA_ARCH__ are defined (the
// architecture can be overridden with -DEMU_CUDA_ARCH=800).
#ifndef EMU_CUDA_ARCH
#define EMU_CUDA_ARCH 900
#endif
#define __CUDACC__ 1
#define __CUDA_ARCH__ EMU_CUDA_ARCH
#define __NVCC__ 1
#define CUDART_VERSION 12000

#if defined(EMU_SCAN)  // executor.py's preprocessor pass that finds the kernels
#define __global__ __emu_global__
#define __launch_bounds__(...) __emu_launch_bounds__(__VA_ARGS__)
#else
#define __global__
#define __launch_bounds__(...)
#endif
#define __device__
#define __host__
#define __forceinline__ inline __attribute__((always_inline))
#define __noinline__ __attribute__((noinline))
#define __align__(n) alignas(n)
#define __constant__ static
#define __managed__
#define __shared__ static  // executor.py adds EMU_SHARED_REG(name) after each declaration
// __restrict__ is understood by g++ as it is.

// ---- built-in variables ---------------------------------------------------------------------------
struct uint3 {
    unsigned int x, y, z;
};
struct dim3 {
    unsigned int x, y, z;
    constexpr dim3(unsigned int x_ = 1, unsigned int y_ = 1, unsigned int z_ = 1) : x(x_), y(y_), z(z_) {}
    constexpr dim3(uint3 v) : x(v.x), y(v.y), z(v.z) {}
    constexpr operator uint3() const { return uint3{x, y, z}; }
};
struct int2 { int x, y; };
struct int4 { int x, y, z, w; };
struct uint2 { unsigned int x, y; };
struct uint4 { unsigned int x, y, z, w; };
struct float2 { float x, y; };
struct float4 { float x, y, z, w; };
static inline float2 make_float2(float x, float y) { return float2{x, y}; }
static inline float4 make_float4(float x, float y, float z, float w) { return float4{x, y, z, w}; }

// Set by the scheduler before it resumes a fiber; a fiber never moves to another OS thread.
inline thread_local uint3 threadIdx;
inline thread_local uint3 blockIdx;
inline thread_local dim3 blockDim;
inline thread_local dim3 gridDim;
static constexpr int warpSize = 32;

// ---- runtime ----------------------------------------------------------------------------------------
namespace emu {

enum State : int { RUNNABLE = 0, WAIT_WARP = 1, WAIT_BLOCK = 2, DONE = 3 };

struct Fiber {
    void* sp = nullptr;  // saved stack pointer (x86-64)
#if defined(EMU_UCONTEXT)
    ucontext_t uc;
#endif
    uint3 tid{};
    int lane = 0, warp = 0;
    int state = RUNNABLE;
};

enum Op : int { OP_NONE = 0, OP_SHFL_IDX, OP_SHFL_UP, OP_SHFL_DOWN, OP_SHFL_XOR, OP_BALLOT, OP_ANY, OP_ALL,
                OP_SYNCWARP, OP_REDUCE_ADD, OP_REDUCE_MIN, OP_REDUCE_MAX, OP_REDUCE_AND, OP_REDUCE_OR,
                OP_REDUCE_XOR, OP_MATCH_ANY };

static const char* op_name(int op) {
    static const char* names[] = {"none", "__shfl_sync", "__shfl_up_sync", "__shfl_down_sync", "__shfl_xor_sync",
                                  "__ballot_sync", "__any_sync", "__all_sync", "__syncwarp", "__reduce_add_sync",
                                  "__reduce_min_sync", "__reduce_max_sync", "__reduce_and_sync",
                                  "__reduce_or_sync", "__reduce_xor_sync", "__match_any_sync"};
    return (op >= 0 && op <= OP_MATCH_ANY) ? names[op] : "?";
}

struct Warp {
    unsigned arrived = 0;  // lanes waiting in the current collective
    unsigned exited = 0;   // lanes whose thread has returned (this block)
    unsigned mask = 0;
    int op = OP_NONE, param_width = 32, size = 0, line = 0;
    int params[32];
    unsigned long long in[32];
    unsigned long long out[32];
};

struct Options {
    int order = 0;  // 0 forward, 1 reverse, 2 random permutation per block
    unsigned long long seed = 1;
    int shared_fill = 0xff;  // byte written over shared memory before each block, -1: none
    size_t stack_bytes = 64 * 1024;
    int strict_exit_at_barrier = 0;  // 1: a thread that exits while others wait at __syncthreads is an error
};

struct Stats {
    unsigned long long launches = 0, blocks = 0, threads = 0, switches = 0, block_barriers = 0,
                       warp_collectives = 0, exited_while_barrier = 0;
};

struct Runtime {
    Options opt;
    Stats stats;
    std::string error;  // first error of the current launch
    // current block
    std::vector<Fiber> fibers;
    std::vector<Warp> warps;
    std::vector<int> order;
    int n_threads = 0, n_live = 0, current = -1;
    int bar_arrived = 0, bar_line = 0, bar_count = 0, bar_pred_count = 0;
    void* sched_sp = nullptr;
#if defined(EMU_UCONTEXT)
    ucontext_t sched_uc;
#endif
    // fiber stacks: one mmap, a PROT_NONE guard page below each stack
    char* stacks = nullptr;
    size_t stack_stride = 0, n_stacks = 0;
    void (*invoke)(void*) = nullptr;
    void* invoke_ctx = nullptr;
    const char* kernel_name = "";
    bool aborting = false;
};

inline Runtime& rt() {
    static Runtime r;
    return r;
}

inline void fail(const char* fmt, ...) __attribute__((format(printf, 1, 2)));
inline void fail(const char* fmt, ...) {
    Runtime& R = rt();
    if (!R.error.empty()) return;
    char buf[1024];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(buf, sizeof buf, fmt, ap);
    va_end(ap);
    char where[256];
    if (R.current >= 0) {
        const Fiber& f = R.fibers[R.current];
        snprintf(where, sizeof where, "%s block (%u,%u,%u) thread (%u,%u,%u): ", R.kernel_name, blockIdx.x, blockIdx.y,
                 blockIdx.z, f.tid.x, f.tid.y, f.tid.z);
    } else {
        snprintf(where, sizeof where, "%s: ", R.kernel_name);
    }
    R.error = std::string(where) + buf;
}

// ---- context switch ----------------------------------------------------------------------------------
#if !defined(EMU_UCONTEXT)
extern "C" void emu_switch(void** save_sp, void* new_sp);
extern "C" void emu_fiber_start();
asm(R"(
    .text
    .globl emu_switch
    .hidden emu_switch
    .type emu_switch,@function
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
    .size emu_switch,.-emu_switch

    .globl emu_fiber_start
    .hidden emu_fiber_start
    .type emu_fiber_start,@function
emu_fiber_start:
    movq %r12, %rdi
    callq *%r13
    ud2
    .size emu_fiber_start,.-emu_fiber_start
)");
#endif

void fiber_main(void*);
#if defined(EMU_UCONTEXT)
void fiber_main_uc(int);
#endif

inline void init_fiber(Runtime& R, int i) {
    Fiber& f = R.fibers[i];
    char* lo = R.stacks + (size_t)i * R.stack_stride + 4096;  // above the guard page
    char* hi = lo + R.opt.stack_bytes;
#if !defined(EMU_UCONTEXT)
    uintptr_t top = (uintptr_t)hi & ~(uintptr_t)15;
    uint64_t* s = (uint64_t*)top;
    unsigned int csr[2] = {0, 0};
    asm volatile("stmxcsr %0" : "=m"(csr[0]));
    asm volatile("fnstcw %0" : "=m"(*(unsigned short*)&csr[1]));
    s[-1] = 0;
    s[-2] = 0;
    s[-3] = (uint64_t)(void*)&emu_fiber_start;  // ret address
    s[-4] = 0;                                   // rbp
    s[-5] = 0;                                   // rbx
    s[-6] = (uint64_t)(uintptr_t)i;              // r12: argument
    s[-7] = (uint64_t)(void*)&fiber_main;        // r13: function
    s[-8] = 0;                                   // r14
    s[-9] = 0;                                   // r15
    memcpy(&s[-10], csr, 8);                     // mxcsr, x87 control word
    f.sp = &s[-10];
#else
    getcontext(&f.uc);
    f.uc.uc_stack.ss_sp = lo;
    f.uc.uc_stack.ss_size = R.opt.stack_bytes;
    f.uc.uc_link = nullptr;
    makecontext(&f.uc, (void (*)())fiber_main_uc, 1, i);
#endif
}

inline void switch_to_scheduler() {
    Runtime& R = rt();
    ++R.stats.switches;
#if !defined(EMU_UCONTEXT)
    emu_switch(&R.fibers[R.current].sp, R.sched_sp);
#else
    swapcontext(&R.fibers[R.current].uc, &R.sched_uc);
#endif
}

inline void switch_to_fiber(int i) {
    Runtime& R = rt();
    R.current = i;
    const Fiber& f = R.fibers[i];
    threadIdx = f.tid;
#if !defined(EMU_UCONTEXT)
    emu_switch(&R.sched_sp, f.sp);
#else
    swapcontext(&R.sched_uc, &R.fibers[i].uc);
#endif
    R.current = -1;
}

// A fiber whose launch is being aborted never returns from a barrier: it parks for good.
inline void park_forever() {
    for (;;) switch_to_scheduler();
}

inline void release_block_barrier(Runtime& R) {
    for (auto& f : R.fibers)
        if (f.state == WAIT_BLOCK) f.state = RUNNABLE;
    R.bar_arrived = 0;
    R.bar_line = 0;
}

inline void on_thread_exit(Runtime& R) {
    Fiber& me = R.fibers[R.current];
    me.state = DONE;
    --R.n_live;
    Warp& w = R.warps[me.warp];
    w.exited |= 1u << me.lane;
    if (w.arrived && (w.mask >> me.lane & 1u))
        fail("exited while lanes 0x%08x of its warp wait in %s (line %d) with mask 0x%08x that names it", w.arrived,
             op_name(w.op), w.line, w.mask);
    if (R.bar_arrived > 0) {
        ++R.stats.exited_while_barrier;
        if (R.opt.strict_exit_at_barrier)
            fail("exited while %d threads wait at __syncthreads() (line %d)", R.bar_arrived, R.bar_line);
        if (R.bar_arrived == R.n_live) release_block_barrier(R);
    }
}

inline void fiber_main(void* arg) {
    Runtime& R = rt();
    (void)arg;
    R.invoke(R.invoke_ctx);
    on_thread_exit(R);
    park_forever();
}
#if defined(EMU_UCONTEXT)
inline void fiber_main_uc(int i) { fiber_main((void*)(intptr_t)i); }
#endif

inline unsigned long long splitmix(unsigned long long& s) {
    unsigned long long z = (s += 0x9E3779B97F4A7C15ull);
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
}

// Every __shared__ variable registers itself the first time its declaration runs (executor.py adds
// EMU_SHARED_REG after each declaration); the launcher poisons all of them before every block.
struct SharedRegion {
    void* p;
    size_t n;
};
inline std::vector<SharedRegion>& shared_regions() {
    static std::vector<SharedRegion> v;
    return v;
}
inline bool register_shared(void* p, size_t n) {
    if (rt().opt.shared_fill >= 0) memset(p, rt().opt.shared_fill, n);
    shared_regions().push_back(SharedRegion{p, n});
    return true;
}
inline size_t static_shared_bytes() {
    size_t n = 0;
    for (const auto& r : shared_regions()) n += r.n;
    return n;
}

constexpr size_t DYNAMIC_SHARED_MAX = 256 * 1024;
inline unsigned char* dynamic_shared() {
    alignas(256) static unsigned char buf[DYNAMIC_SHARED_MAX + 64];
    return buf;
}

inline bool ensure_stacks(Runtime& R, int n) {
    size_t stride = R.opt.stack_bytes + 4096;
    if (R.stacks && (size_t)n <= R.n_stacks && stride == R.stack_stride) return true;
    if (R.stacks) munmap(R.stacks, R.n_stacks * R.stack_stride);
    R.stacks = nullptr;
    void* p = mmap(nullptr, (size_t)n * stride, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
    if (p == MAP_FAILED) return false;
    R.stacks = (char*)p;
    R.stack_stride = stride;
    R.n_stacks = n;
    for (int i = 0; i < n; ++i) mprotect(R.stacks + (size_t)i * stride, 4096, PROT_NONE);
    return true;
}

// A fault inside a kernel thread (a guard page after a test buffer, a fiber stack overflow, a wild
// pointer) is reported with the kernel, block and thread, then handed to the previous handler.
inline struct sigaction* previous_action(int sig) {
    static struct sigaction segv, bus;
    return sig == SIGBUS ? &bus : &segv;
}
inline void fault_handler(int sig, siginfo_t* si, void*) {
    Runtime& R = rt();
    char buf[512];
    int n;
    if (R.current >= 0) {
        const Fiber& f = R.fibers[R.current];
        const char* what = "invalid memory access";
        const char* a = (const char*)si->si_addr;
        if (R.stacks && a >= R.stacks && a < R.stacks + R.n_stacks * R.stack_stride &&
            (size_t)(a - R.stacks) % R.stack_stride < 4096)
            what = "fiber stack overflow (raise the stack size)";
        n = snprintf(buf, sizeof buf, "cudaemu: %s: %s at address %p in block (%u,%u,%u) thread (%u,%u,%u)\n",
                     R.kernel_name, what, si->si_addr, blockIdx.x, blockIdx.y, blockIdx.z, f.tid.x, f.tid.y, f.tid.z);
    } else {
        n = snprintf(buf, sizeof buf, "cudaemu: signal %d at address %p outside kernel threads\n", sig, si->si_addr);
    }
    if (n > 0) { ssize_t ignored = write(2, buf, (size_t)n); (void)ignored; }
    sigaction(sig, previous_action(sig), nullptr);  // returning re-runs the faulting access under it
}
inline void install_fault_handler() {
    static bool done = false;
    if (done) return;
    done = true;
    static char altstack[64 * 1024];
    stack_t ss{};
    ss.ss_sp = altstack;
    ss.ss_size = sizeof altstack;
    sigaltstack(&ss, nullptr);
    struct sigaction sa {};
    sa.sa_sigaction = fault_handler;
    sa.sa_flags = SA_SIGINFO | SA_ONSTACK;
    sigemptyset(&sa.sa_mask);
    sigaction(SIGSEGV, &sa, previous_action(SIGSEGV));
    sigaction(SIGBUS, &sa, previous_action(SIGBUS));
}

// Runs one whole launch. invoke(ctx) runs the kernel body for the current thread.
inline int run_launch(const char* name, void (*invoke)(void*), void* ctx, dim3 grid, dim3 block, size_t shmem,
                      int max_threads) {
    Runtime& R = rt();
    install_fault_handler();
    R.error.clear();
    R.kernel_name = name;
    R.current = -1;
    ++R.stats.launches;
    const long long nt = (long long)block.x * block.y * block.z;
    if (block.x == 0 || block.y == 0 || block.z == 0 || grid.x == 0 || grid.y == 0 || grid.z == 0) {
        fail("invalid launch: grid (%u,%u,%u) block (%u,%u,%u) has a zero dimension", grid.x, grid.y, grid.z,
             block.x, block.y, block.z);
        return 1;
    }
    if (nt > 1024 || block.x > 1024 || block.y > 1024 || block.z > 64) {
        fail("invalid launch: block (%u,%u,%u) exceeds the CUDA limits (1024 threads, z <= 64)", block.x, block.y,
             block.z);
        return 1;
    }
    if (max_threads > 0 && nt > max_threads) {
        fail("invalid launch: %lld threads per block > __launch_bounds__(%d)", nt, max_threads);
        return 1;
    }
    if (grid.y > 65535 || grid.z > 65535 || grid.x > 2147483647u) {
        fail("invalid launch: grid (%u,%u,%u) exceeds the CUDA limits (x < 2^31, y, z <= 65535)", grid.x, grid.y,
             grid.z);
        return 1;
    }
    if (shmem > DYNAMIC_SHARED_MAX) {
        fail("invalid launch: %zu bytes of dynamic shared memory (emulator limit %zu)", shmem, DYNAMIC_SHARED_MAX);
        return 1;
    }
    if (shmem > 48 * 1024)
        fprintf(stderr, "cudaemu: warning: %s: %zu bytes of dynamic shared memory > 48 KiB need cudaFuncSetAttribute on a GPU\n",
                name, shmem);
    R.n_threads = (int)nt;
    if (!ensure_stacks(R, R.n_threads)) {
        fail("cannot allocate %d fiber stacks", R.n_threads);
        return 1;
    }
    R.fibers.assign(R.n_threads, Fiber());
    R.warps.assign((R.n_threads + 31) / 32, Warp());
    R.order.resize(R.n_threads);
    R.invoke = invoke;
    R.invoke_ctx = ctx;
    gridDim = grid;
    blockDim = block;
    for (unsigned bz = 0; bz < grid.z; ++bz)
        for (unsigned by = 0; by < grid.y; ++by)
            for (unsigned bx = 0; bx < grid.x; ++bx) {
                blockIdx = uint3{bx, by, bz};
                ++R.stats.blocks;
                R.stats.threads += R.n_threads;
                if (R.opt.shared_fill >= 0) {
                    for (const auto& r : shared_regions()) memset(r.p, R.opt.shared_fill, r.n);
                    if (shmem) memset(dynamic_shared(), R.opt.shared_fill, shmem);
                }
                if (R.opt.shared_fill >= 0)  // bytes past the requested size, to spot overruns
                    memset(dynamic_shared() + shmem, 0xA5, 64);
                for (int i = 0; i < R.n_threads; ++i) {
                    Fiber& f = R.fibers[i];
                    f = Fiber();
                    f.tid = uint3{(unsigned)(i % block.x), (unsigned)((i / block.x) % block.y),
                                  (unsigned)(i / (block.x * block.y))};
                    f.lane = i % 32;
                    f.warp = i / 32;
                    init_fiber(R, i);
                    R.order[i] = i;
                }
                for (auto& w : R.warps) w = Warp();
                R.n_live = R.n_threads;
                R.bar_arrived = 0;
                R.bar_line = 0;
                for (;;) {
                    if (R.opt.order == 1) std::reverse(R.order.begin(), R.order.end());
                    if (R.opt.order == 2)
                        for (int i = R.n_threads - 1; i > 0; --i) std::swap(R.order[i], R.order[splitmix(R.opt.seed) % (i + 1)]);
                    bool progress = false;
                    for (int k = 0; k < R.n_threads && R.error.empty(); ++k) {
                        const int i = R.order[k];
                        if (R.fibers[i].state != RUNNABLE) continue;
                        switch_to_fiber(i);
                        progress = true;
                    }
                    if (!R.error.empty()) return 1;
                    if (R.n_live == 0) break;
                    if (!progress) {  // deadlock: describe who waits for what
                        std::string s;
                        for (size_t wi = 0; wi < R.warps.size(); ++wi) {
                            const Warp& w = R.warps[wi];
                            if (!w.arrived) continue;
                            unsigned done = 0;
                            for (int l = 0; l < 32; ++l) {
                                size_t t = wi * 32 + l;
                                if (t < R.fibers.size() && R.fibers[t].state == DONE) done |= 1u << l;
                            }
                            char b[256];
                            snprintf(b, sizeof b, " warp %zu: lanes 0x%08x wait in %s (line %d) for mask 0x%08x, exited 0x%08x;",
                                     wi, w.arrived, op_name(w.op), w.line, w.mask, done);
                            s += b;
                        }
                        if (R.bar_arrived) {
                            char b[128];
                            snprintf(b, sizeof b, " %d of %d live threads wait at __syncthreads() (line %d);", R.bar_arrived,
                                     R.n_live, R.bar_line);
                            s += b;
                        }
                        fail("deadlock in block (%u,%u,%u):%s", bx, by, bz, s.c_str());
                        return 1;
                    }
                }
            }
    if (R.opt.shared_fill >= 0)
        for (size_t k = 0; k < 64; ++k)
            if (dynamic_shared()[shmem + k] != 0xA5) {
                fail("wrote past the %zu bytes of dynamic shared memory it was given", shmem);
                return 1;
            }
    return 0;
}

// ---- barriers and warp collectives --------------------------------------------------------------
inline void syncthreads_at(int line, int pred = 0) {
    Runtime& R = rt();
    Fiber& me = R.fibers[R.current];
    ++R.stats.block_barriers;
    if (R.bar_arrived == 0) {
        R.bar_line = line;
        R.bar_pred_count = 0;
    } else if (R.bar_line != line) {
        fail("__syncthreads() at line %d while other threads of the block wait at the one at line %d (divergent barrier)",
             line, R.bar_line);
        park_forever();
    }
    R.bar_pred_count += pred != 0;
    ++R.bar_arrived;
    if (R.bar_arrived == R.n_live) {
        R.bar_count = R.bar_pred_count;
        release_block_barrier(R);
        return;
    }
    me.state = WAIT_BLOCK;
    switch_to_scheduler();
    if (!R.error.empty()) park_forever();
}

inline int bar_count() { return rt().bar_count; }

// PTX shfl.sync semantics (mode idx/up/down/bfly, c = ((32 - width) << 8) | clamp).
inline int shfl_source(int op, int lane, int b, int width, bool* valid) {
    const int segmask = (32 - width) & 0x1f;
    const int cval = op == OP_SHFL_UP ? 0 : 0x1f;
    const int max_lane = (lane & segmask) | (cval & ~segmask);
    const int min_lane = lane & segmask;
    int j = lane;
    bool p = true;
    switch (op) {
        case OP_SHFL_IDX: j = min_lane | (b & ~segmask); p = j <= max_lane; break;
        case OP_SHFL_UP: j = lane - b; p = j >= max_lane; break;
        case OP_SHFL_DOWN: j = lane + b; p = j <= max_lane; break;
        case OP_SHFL_XOR: j = lane ^ b; p = j <= max_lane; break;
    }
    *valid = p;
    return p ? j : lane;
}

inline void complete_collective(Runtime& R, Warp& w) {
    ++R.stats.warp_collectives;
    const unsigned m = w.mask;
    unsigned long long acc = 0;
    switch (w.op) {
        case OP_SHFL_IDX: case OP_SHFL_UP: case OP_SHFL_DOWN: case OP_SHFL_XOR:
            for (int l = 0; l < 32; ++l) {
                if (!(m >> l & 1u)) continue;
                bool valid;
                int j = shfl_source(w.op, l, w.params[l], w.param_width, &valid);
                if (!(m >> j & 1u)) {
                    fail("%s (line %d): lane %d reads lane %d, which is not in mask 0x%08x (undefined value)",
                         op_name(w.op), w.line, l, j, m);
                    j = l;
                }
                w.out[l] = w.in[j];
            }
            break;
        case OP_BALLOT: case OP_ANY: case OP_ALL: {
            unsigned ballot = 0;
            for (int l = 0; l < 32; ++l)
                if ((m >> l & 1u) && w.in[l]) ballot |= 1u << l;
            unsigned long long r = w.op == OP_BALLOT ? ballot : w.op == OP_ANY ? (ballot != 0) : (ballot == m);
            for (int l = 0; l < 32; ++l) w.out[l] = r;
            break;
        }
        case OP_SYNCWARP: break;
        case OP_REDUCE_ADD: case OP_REDUCE_MIN: case OP_REDUCE_MAX: case OP_REDUCE_AND: case OP_REDUCE_OR:
        case OP_REDUCE_XOR: {
            bool first = true;
            const bool is_signed = w.param_width < 0;
            for (int l = 0; l < 32; ++l) {
                if (!(m >> l & 1u)) continue;
                unsigned long long v = w.in[l];
                if (first) { acc = v; first = false; continue; }
                unsigned a32 = (unsigned)acc, v32 = (unsigned)v;
                switch (w.op) {
                    case OP_REDUCE_ADD: a32 += v32; break;
                    case OP_REDUCE_MIN: a32 = is_signed ? (unsigned)std::min((int)a32, (int)v32) : std::min(a32, v32); break;
                    case OP_REDUCE_MAX: a32 = is_signed ? (unsigned)std::max((int)a32, (int)v32) : std::max(a32, v32); break;
                    case OP_REDUCE_AND: a32 &= v32; break;
                    case OP_REDUCE_OR: a32 |= v32; break;
                    case OP_REDUCE_XOR: a32 ^= v32; break;
                }
                acc = a32;
            }
            for (int l = 0; l < 32; ++l) w.out[l] = acc;
            break;
        }
        case OP_MATCH_ANY:
            for (int l = 0; l < 32; ++l) {
                if (!(m >> l & 1u)) continue;
                unsigned r = 0;
                for (int k = 0; k < 32; ++k)
                    if ((m >> k & 1u) && w.in[k] == w.in[l]) r |= 1u << k;
                w.out[l] = r;
            }
            break;
    }
    w.arrived = 0;
    for (int l = 0; l < 32; ++l) {
        if (!(m >> l & 1u)) continue;
        size_t t = (size_t)(&w - R.warps.data()) * 32 + l;
        if (t < R.fibers.size() && R.fibers[t].state == WAIT_WARP) R.fibers[t].state = RUNNABLE;
    }
}

inline unsigned long long collective(int op, unsigned mask, unsigned long long value, int param, int width, int line) {
    Runtime& R = rt();
    Fiber& me = R.fibers[R.current];
    Warp& w = R.warps[me.warp];
    const unsigned lane_bit = 1u << me.lane;
    const int warp_threads = std::min(32, R.n_threads - me.warp * 32);
    const unsigned existing = warp_threads == 32 ? 0xffffffffu : ((1u << warp_threads) - 1u);
    if (!(mask & lane_bit)) {
        fail("%s (line %d) with mask 0x%08x that does not name the calling lane %d", op_name(op), line, mask, me.lane);
        park_forever();
    }
    if (mask & ~existing) {
        fail("%s (line %d): mask 0x%08x names lanes that do not exist in this warp (0x%08x)", op_name(op), line, mask,
             existing);
        park_forever();
    }
    if (op >= OP_SHFL_IDX && op <= OP_SHFL_XOR && (width < 1 || width > 32 || (width & (width - 1)))) {
        fail("%s (line %d): width %d is not a power of two in 1..32", op_name(op), line, width);
        park_forever();
    }
    if (mask & w.exited) {  // a lane named in the mask that already exited can never arrive
        fail("%s (line %d) with mask 0x%08x, but lane %d of the warp has exited", op_name(op), line, mask,
             __builtin_ctz(mask & w.exited));
        park_forever();
    }
    if (w.arrived == 0) {
        w.mask = mask;
        w.op = op;
        w.line = line;
        w.param_width = width;
    } else if (w.mask != mask || w.op != op || w.param_width != width) {
        fail("lanes of one warp meet in different collectives: %s (line %d, mask 0x%08x) vs %s (line %d, mask 0x%08x)",
             op_name(op), line, mask, op_name(w.op), w.line, w.mask);
        park_forever();
    }
    w.in[me.lane] = value;
    w.params[me.lane] = param;
    w.arrived |= lane_bit;
    if (w.arrived == mask) {
        complete_collective(R, w);
    } else {
        me.state = WAIT_WARP;
        switch_to_scheduler();
    }
    if (!R.error.empty()) park_forever();
    return w.out[me.lane];
}

template <class T>
inline unsigned long long to_bits(T v) {
    static_assert(sizeof(T) <= 8, "shuffle of a type wider than 8 bytes");
    unsigned long long b = 0;
    memcpy(&b, &v, sizeof(T));
    return b;
}
template <class T>
inline T from_bits(unsigned long long b) {
    T v;
    memcpy(&v, &b, sizeof(T));
    return v;
}
template <class T>
inline T shfl(int op, unsigned mask, T v, int param, int width, int line) {
    return from_bits<T>(collective(op, mask, to_bits(v), param, width, line));
}

// ---- inline PTX (rewritten by executor.py from asm("..." : "=c"(out) : "c"(in), ...)) -------------
inline float half_bits_to_float(unsigned short h) {
    const unsigned sign = (unsigned)(h & 0x8000u) << 16;
    const unsigned e = (h >> 10) & 0x1f;
    unsigned m = h & 0x3ff;
    unsigned bits;
    if (e == 0x1f) bits = sign | 0x7f800000u | (m << 13) | (m ? 0x400000u : 0);  // inf / quiet NaN
    else if (e != 0) bits = sign | ((e + 112) << 23) | (m << 13);
    else if (m == 0) bits = sign;
    else {  // subnormal half -> normal float
        int ee = 113;
        while (!(m & 0x400)) { m <<= 1; --ee; }
        bits = sign | ((unsigned)ee << 23) | ((m & 0x3ff) << 13);
    }
    float f;
    memcpy(&f, &bits, 4);
    return f;
}

// float -> half, round to nearest even (cvt.rn.f16.f32); NaN -> canonical NaN 0x7fff like the GPU.
inline unsigned short float_to_half_bits_rn(float f) {
    unsigned x;
    memcpy(&x, &f, 4);
    const unsigned sign = (x >> 16) & 0x8000u;
    const unsigned ax = x & 0x7fffffffu;
    if (ax > 0x7f800000u) return 0x7fff;
    if (ax >= 0x477ff000u) return (unsigned short)(sign | 0x7c00u);  // rounds to inf (>= 65520)
    if (ax >= 0x38800000u) {                                        // normal half
        unsigned mant = ax & 0x7fffff;
        unsigned exp = (ax >> 23) - 112;
        unsigned h = (exp << 10) | (mant >> 13);
        unsigned rest = mant & 0x1fff;
        if (rest > 0x1000 || (rest == 0x1000 && (h & 1))) ++h;
        return (unsigned short)(sign | h);
    }
    if (ax < 0x33000000u) return (unsigned short)sign;  // < 2^-25: rounds to 0
    // subnormal half: value = m * 2^-24
    unsigned e = ax >> 23;
    unsigned mant = (ax & 0x7fffff) | 0x800000;
    int shift = 126 - (int)e;  // 14 + (113 - e) ... bits to drop from the 24-bit significand
    unsigned h = mant >> shift;
    unsigned rest = mant & ((1u << shift) - 1);
    unsigned halfway = 1u << (shift - 1);
    if (rest > halfway || (rest == halfway && (h & 1))) ++h;
    return (unsigned short)(sign | h);
}

enum PtxOp { PTX_CVT_F32_F16, PTX_CVT_RN_F16_F32, PTX_MOV_B32, PTX_MOV_B64, PTX_UNKNOWN };
inline PtxOp ptx_lookup(const char* text) {
    std::string s(text);
    size_t a = s.find_first_not_of(" \t\n");
    size_t b = s.find_first_of(" \t\n;", a);
    std::string op = s.substr(a, b - a);
    if (op == "cvt.f32.f16") return PTX_CVT_F32_F16;
    if (op == "cvt.rn.f16.f32") return PTX_CVT_RN_F16_F32;
    if (op == "mov.b32" || op == "mov.u32" || op == "mov.s32") return PTX_MOV_B32;
    if (op == "mov.b64" || op == "mov.u64" || op == "mov.s64") return PTX_MOV_B64;
    return PTX_UNKNOWN;
}

template <class Out, class In>
inline void ptx(PtxOp op, const char* text, Out& out, const In& in) {
    switch (op) {
        case PTX_CVT_F32_F16: {
            unsigned short h;
            memcpy(&h, &in, 2);
            float f = half_bits_to_float(h);
            memcpy(&out, &f, sizeof(float));
            return;
        }
        case PTX_CVT_RN_F16_F32: {
            float f;
            memcpy(&f, &in, 4);
            unsigned short h = float_to_half_bits_rn(f);
            memcpy(&out, &h, 2);
            return;
        }
        case PTX_MOV_B32: case PTX_MOV_B64:
            static_assert(sizeof(Out) == sizeof(In) || true, "");
            memcpy(&out, &in, std::min(sizeof(Out), sizeof(In)));
            return;
        default:
            fail("inline PTX \"%s\" is not emulated (add it to emu::ptx in cudaemu.h)", text);
            park_forever();
    }
}

}  // namespace emu

#define EMU_CAT2(a, b) a##b
#define EMU_CAT(a, b) EMU_CAT2(a, b)
#define EMU_SHARED_REG(name) \
    static const bool EMU_CAT(emu_shared_reg_, __COUNTER__) __attribute__((unused)) = ::emu::register_shared((void*)&(name), sizeof(name))

// Called by the rewritten asm statements: EMU_PTX("text", out, in)
#define EMU_PTX(text, out, in)                                           \
    do {                                                                 \
        static const ::emu::PtxOp emu_ptx_op_ = ::emu::ptx_lookup(text); \
        ::emu::ptx(emu_ptx_op_, text, out, in);                          \
    } while (0)

// ---- CUDA intrinsics ------------------------------------------------------------------------------
#define __syncthreads() ::emu::syncthreads_at(__LINE__)
inline int emu_syncthreads_count(int line, int p) { ::emu::syncthreads_at(line, p); return ::emu::bar_count(); }
#define __syncthreads_count(p) emu_syncthreads_count(__LINE__, (p))
#define __syncthreads_and(p) (emu_syncthreads_count(__LINE__, (p)) == (int)::emu::rt().n_live)
#define __syncthreads_or(p) (emu_syncthreads_count(__LINE__, (p)) != 0)
#define __syncwarp(...) ((void)::emu::collective(::emu::OP_SYNCWARP, emu_mask_or_full(__VA_ARGS__), 0, 0, 32, __LINE__))
inline unsigned emu_mask_or_full() { return 0xffffffffu; }
inline unsigned emu_mask_or_full(unsigned m) { return m; }
#define __threadfence() __atomic_thread_fence(__ATOMIC_SEQ_CST)
#define __threadfence_block() __atomic_thread_fence(__ATOMIC_SEQ_CST)

#define EMU_SHFL_WIDTH(w) (w)
#define __shfl_sync(mask, v, src, ...) ::emu::shfl(::emu::OP_SHFL_IDX, (mask), (v), (src), emu_width(__VA_ARGS__), __LINE__)
#define __shfl_up_sync(mask, v, d, ...) ::emu::shfl(::emu::OP_SHFL_UP, (mask), (v), (d), emu_width(__VA_ARGS__), __LINE__)
#define __shfl_down_sync(mask, v, d, ...) ::emu::shfl(::emu::OP_SHFL_DOWN, (mask), (v), (d), emu_width(__VA_ARGS__), __LINE__)
#define __shfl_xor_sync(mask, v, m, ...) ::emu::shfl(::emu::OP_SHFL_XOR, (mask), (v), (m), emu_width(__VA_ARGS__), __LINE__)
inline int emu_width() { return 32; }
inline int emu_width(int w) { return w; }
#define __ballot_sync(mask, p) ((unsigned)::emu::collective(::emu::OP_BALLOT, (mask), (p) != 0, 0, 32, __LINE__))
#define __any_sync(mask, p) ((int)::emu::collective(::emu::OP_ANY, (mask), (p) != 0, 0, 32, __LINE__))
#define __all_sync(mask, p) ((int)::emu::collective(::emu::OP_ALL, (mask), (p) != 0, 0, 32, __LINE__))
#define __reduce_add_sync(mask, v) ((decltype(v))::emu::collective(::emu::OP_REDUCE_ADD, (mask), (unsigned)(v), 0, std::is_signed<decltype(v)>::value ? -1 : 1, __LINE__))
#define __reduce_min_sync(mask, v) ((decltype(v))::emu::collective(::emu::OP_REDUCE_MIN, (mask), (unsigned)(v), 0, std::is_signed<decltype(v)>::value ? -1 : 1, __LINE__))
#define __reduce_max_sync(mask, v) ((decltype(v))::emu::collective(::emu::OP_REDUCE_MAX, (mask), (unsigned)(v), 0, std::is_signed<decltype(v)>::value ? -1 : 1, __LINE__))
#define __match_any_sync(mask, v) ((unsigned)::emu::collective(::emu::OP_MATCH_ANY, (mask), ::emu::to_bits(v), 0, 32, __LINE__))
// No SIMT divergence tracking: the lanes of the warp that have not exited.
inline unsigned __activemask() {
    auto& R = ::emu::rt();
    const auto& me = R.fibers[R.current];
    unsigned m = 0;
    for (int l = 0; l < 32; ++l) {
        size_t t = (size_t)me.warp * 32 + l;
        if (t < R.fibers.size() && R.fibers[t].state != ::emu::DONE) m |= 1u << l;
    }
    return m;
}

// bit casts and integer intrinsics
inline float __int_as_float(int i) { float f; memcpy(&f, &i, 4); return f; }
inline float __uint_as_float(unsigned i) { float f; memcpy(&f, &i, 4); return f; }
inline int __float_as_int(float f) { int i; memcpy(&i, &f, 4); return i; }
inline unsigned __float_as_uint(float f) { unsigned i; memcpy(&i, &f, 4); return i; }
inline double __longlong_as_double(long long i) { double d; memcpy(&d, &i, 8); return d; }
inline long long __double_as_longlong(double d) { long long i; memcpy(&i, &d, 8); return i; }
inline int __popc(unsigned x) { return __builtin_popcount(x); }
inline int __popcll(unsigned long long x) { return __builtin_popcountll(x); }
inline int __clz(int x) { return x ? __builtin_clz((unsigned)x) : 32; }
inline int __ffs(int x) { return __builtin_ffs(x); }
inline unsigned __brev(unsigned x) { x = ((x >> 1) & 0x55555555u) | ((x & 0x55555555u) << 1); x = ((x >> 2) & 0x33333333u) | ((x & 0x33333333u) << 2); x = ((x >> 4) & 0x0f0f0f0fu) | ((x & 0x0f0f0f0fu) << 4); return __builtin_bswap32(x); }
inline unsigned __byte_perm(unsigned x, unsigned y, unsigned s) {
    unsigned long long v = ((unsigned long long)y << 32) | x;
    unsigned r = 0;
    for (int k = 0; k < 4; ++k) r |= (unsigned)((v >> (8 * ((s >> (4 * k)) & 7))) & 0xff) << (8 * k);
    return r;
}
// __dp4a (sm_61+): c + the dot product of the four signed (or unsigned) bytes of a and b
inline int __dp4a(int a, int b, int c) {
    for (int k = 0; k < 32; k += 8) c += (int)(signed char)(a >> k) * (int)(signed char)(b >> k);
    return c;
}
inline unsigned __dp4a(unsigned a, unsigned b, unsigned c) {
    for (int k = 0; k < 32; k += 8) c += ((a >> k) & 0xffu) * ((b >> k) & 0xffu);
    return c;
}
inline int __mul24(int a, int b) { return (int)((long long)(a << 8 >> 8) * (b << 8 >> 8)); }
inline int __mulhi(int a, int b) { return (int)(((long long)a * b) >> 32); }
inline unsigned __umulhi(unsigned a, unsigned b) { return (unsigned)(((unsigned long long)a * b) >> 32); }
template <class T> inline T __ldg(const T* p) { return *p; }

// float intrinsics: the correctly rounded host operations (the GPU's fast-math ones are approximations)
inline float __fdividef(float a, float b) { return a / b; }
inline float __expf(float x) { return expf(x); }
inline float __logf(float x) { return logf(x); }
inline float __sinf(float x) { return sinf(x); }
inline float __cosf(float x) { return cosf(x); }
inline float __powf(float a, float b) { return powf(a, b); }
inline float __saturatef(float x) { return x < 0.f ? 0.f : (x > 1.f ? 1.f : x); }
inline float __fmaf_rn(float a, float b, float c) { return fmaf(a, b, c); }
inline float __fadd_rn(float a, float b) { return a + b; }
inline float __fmul_rn(float a, float b) { return a * b; }
inline int __float2int_rn(float x) { return (int)nearbyintf(x); }  // to nearest, ties to even
inline float rsqrtf(float x) { return 1.0f / sqrtf(x); }
inline double rsqrt(double x) { return 1.0 / sqrt(x); }
inline void sincosf_emu(float x, float* s, float* c) { *s = sinf(x); *c = cosf(x); }
#define __sincosf(x, s, c) sincosf_emu((x), (s), (c))
using std::max;
using std::min;

// ---- atomics: plain read-modify-write (blocks run on one OS thread; __atomic keeps them correct anyway)
template <class T> inline T atomicAdd(T* p, T v) { return __atomic_fetch_add(p, v, __ATOMIC_SEQ_CST); }
inline float atomicAdd(float* p, float v) { float old = *p; *p = old + v; return old; }
inline double atomicAdd(double* p, double v) { double old = *p; *p = old + v; return old; }
template <class T> inline T atomicSub(T* p, T v) { return __atomic_fetch_sub(p, v, __ATOMIC_SEQ_CST); }
template <class T> inline T atomicExch(T* p, T v) { T old = *p; *p = v; return old; }
template <class T> inline T atomicMin(T* p, T v) { T old = *p; if (v < old) *p = v; return old; }
template <class T> inline T atomicMax(T* p, T v) { T old = *p; if (v > old) *p = v; return old; }
template <class T> inline T atomicAnd(T* p, T v) { return __atomic_fetch_and(p, v, __ATOMIC_SEQ_CST); }
template <class T> inline T atomicOr(T* p, T v) { return __atomic_fetch_or(p, v, __ATOMIC_SEQ_CST); }
template <class T> inline T atomicXor(T* p, T v) { return __atomic_fetch_xor(p, v, __ATOMIC_SEQ_CST); }
template <class T> inline T atomicCAS(T* p, T cmp, T v) { T old = *p; if (old == cmp) *p = v; return old; }
inline unsigned atomicInc(unsigned* p, unsigned lim) { unsigned old = *p; *p = old >= lim ? 0 : old + 1; return old; }
#define atomicAdd_block atomicAdd
#define atomicMax_block atomicMax

// ---- half precision (cuda_fp16.h subset), bit-exact conversions ----------------------------------
struct __half {
    unsigned short x;
    __half() = default;
    __half(float f) : x(::emu::float_to_half_bits_rn(f)) {}
    operator float() const { return ::emu::half_bits_to_float(x); }
};
struct __half2 { __half x, y; };
typedef __half half;
typedef __half2 half2;
inline float __half2float(__half h) { return ::emu::half_bits_to_float(h.x); }
inline __half __float2half(float f) { __half h; h.x = ::emu::float_to_half_bits_rn(f); return h; }
inline __half __float2half_rn(float f) { return __float2half(f); }
inline unsigned short __half_as_ushort(__half h) { return h.x; }
inline __half __ushort_as_half(unsigned short u) { __half h; h.x = u; return h; }
inline short __half_as_short(__half h) { return (short)h.x; }
inline __half __short_as_half(short s) { __half h; h.x = (unsigned short)s; return h; }
inline float2 __half22float2(__half2 h) { return float2{__half2float(h.x), __half2float(h.y)}; }
inline __half2 __floats2half2_rn(float a, float b) { return __half2{__float2half(a), __float2half(b)}; }
inline __half2 __float2half2_rn(float a) { return __half2{__float2half(a), __float2half(a)}; }
inline float __low2float(__half2 h) { return __half2float(h.x); }
inline float __high2float(__half2 h) { return __half2float(h.y); }
// arithmetic on __half is computed in float and rounded once, like the hardware's f16 ops
inline __half __hadd(__half a, __half b) { return __float2half(__half2float(a) + __half2float(b)); }
inline __half __hmul(__half a, __half b) { return __float2half(__half2float(a) * __half2float(b)); }
inline __half __hsub(__half a, __half b) { return __float2half(__half2float(a) - __half2float(b)); }
inline __half __hfma(__half a, __half b, __half c) { return __float2half(fmaf(__half2float(a), __half2float(b), __half2float(c))); }
inline __half2 __hadd2(__half2 a, __half2 b) { return __half2{__hadd(a.x, b.x), __hadd(a.y, b.y)}; }
inline __half2 __hmul2(__half2 a, __half2 b) { return __half2{__hmul(a.x, b.x), __hmul(a.y, b.y)}; }
inline __half2 __hfma2(__half2 a, __half2 b, __half2 c) { return __half2{__hfma(a.x, b.x, c.x), __hfma(a.y, b.y, c.y)}; }
// bfloat16 (cuda_bf16.h subset)
struct __nv_bfloat16 { unsigned short x; };
inline float __bfloat162float(__nv_bfloat16 b) { return __uint_as_float((unsigned)b.x << 16); }
inline __nv_bfloat16 __float2bfloat16(float f) {
    unsigned u = __float_as_uint(f);
    __nv_bfloat16 b;
    if ((u & 0x7fffffffu) > 0x7f800000u) { b.x = 0x7fff; return b; }
    u += 0x7fffu + ((u >> 16) & 1u);
    b.x = (unsigned short)(u >> 16);
    return b;
}

// ---- launching ------------------------------------------------------------------------------------
namespace emu {
template <class... Args>
struct Call {
    void (*fn)(Args...);
    std::tuple<std::decay_t<Args>...> args;
};
template <class... Args>
void invoke_call(void* ctx) {
    auto* c = static_cast<Call<Args...>*>(ctx);
    std::apply(c->fn, c->args);
}

// A C++ launcher, for C++ tests: emu::launch(kernel, grid, block, shared_bytes, args...)
template <class... Args, class... Given>
int launch(void (*fn)(Args...), dim3 grid, dim3 block, size_t shmem, Given&&... given) {
    Call<Args...> c{fn, std::tuple<std::decay_t<Args>...>(std::forward<Given>(given)...)};
    return run_launch("kernel", &invoke_call<Args...>, &c, grid, block, shmem, 0);
}

// The type code the Python side gives each argument: p pointer, i/u/f + size in bytes, b bool.
template <class T>
inline bool code_matches(const char* code) {
    using U = std::remove_cv_t<T>;
    if (std::is_pointer<U>::value) return code[0] == 'p';
    if (std::is_same<U, bool>::value) return code[0] == 'b';
    if (std::is_floating_point<U>::value) return code[0] == 'f' && atoi(code + 1) == (int)sizeof(U);
    if (std::is_integral<U>::value || std::is_enum<U>::value) return (code[0] == 'i' || code[0] == 'u') && atoi(code + 1) == (int)sizeof(U);
    return code[0] == 's' && atoi(code + 1) == (int)sizeof(U);  // a struct passed by value, by size
}
template <class T>
inline std::string cxx_type_name() {
    using U = std::remove_cv_t<T>;
    if (std::is_pointer<U>::value) return "pointer";
    if (std::is_same<U, bool>::value) return "bool";
    char b[64];
    snprintf(b, sizeof b, "%s%zu", std::is_floating_point<U>::value ? "float" : std::is_integral<U>::value ? (std::is_signed<U>::value ? "int" : "uint") : "struct", 8 * sizeof(U));
    return b;
}

// cuLaunchKernel-style: args[i] points to argument i; codes is a space-separated list of type codes.
template <class... Args, size_t... I>
int launch_packed_impl(const char* name, void (*fn)(Args...), const unsigned* grid, const unsigned* block,
                       size_t shmem, void** args, const char* codes, int n_args, int max_threads,
                       std::index_sequence<I...>) {
    Runtime& R = rt();
    R.error.clear();
    R.kernel_name = name;
    if (n_args != (int)sizeof...(Args)) {
        fail("called with %d arguments; the kernel takes %zu", n_args, sizeof...(Args));
        return 1;
    }
    std::vector<std::string> code;
    {
        std::string s(codes ? codes : "");
        size_t a = 0;
        while (a < s.size()) {
            size_t b = s.find(' ', a);
            if (b == std::string::npos) b = s.size();
            if (b > a) code.push_back(s.substr(a, b - a));
            a = b + 1;
        }
    }
    bool ok[] = {true, code_matches<Args>(code[I].c_str())...};
    std::string names[] = {"", cxx_type_name<Args>()...};
    for (size_t k = 1; k <= sizeof...(Args); ++k)
        if (!ok[k]) {
            fail("argument %zu is given as %s but the kernel parameter is %s", k - 1, code[k - 1].c_str(), names[k].c_str());
            return 1;
        }
    Call<Args...> c{fn, std::tuple<std::decay_t<Args>...>(*static_cast<std::decay_t<Args>*>(args[I])...)};
    return run_launch(name, &invoke_call<Args...>, &c, dim3(grid[0], grid[1], grid[2]), dim3(block[0], block[1], block[2]),
                      shmem, max_threads);
}
template <class... Args>
int launch_packed(const char* name, void (*fn)(Args...), const unsigned* grid, const unsigned* block, size_t shmem,
                  void** args, const char* codes, int n_args, int max_threads) {
    return launch_packed_impl(name, fn, grid, block, shmem, args, codes, n_args, max_threads,
                              std::index_sequence_for<Args...>{});
}
}  // namespace emu

// ---- the C interface the Python side calls (one copy per module .so) -----------------------------------
extern "C" {
__attribute__((visibility("default"), used)) inline const char* emu_last_error() { return emu::rt().error.c_str(); }
__attribute__((visibility("default"), used)) inline void emu_set_options(int order, unsigned long long seed, int shared_fill,
                                                                 unsigned long long stack_bytes, int strict_exit) {
    auto& o = emu::rt().opt;
    o.order = order;
    o.seed = seed;
    o.shared_fill = shared_fill;
    if (stack_bytes) o.stack_bytes = (size_t)((stack_bytes + 4095) & ~4095ull);
    o.strict_exit_at_barrier = strict_exit;
}
__attribute__((visibility("default"), used)) inline void emu_get_stats(unsigned long long* out7) {
    const auto& s = emu::rt().stats;
    unsigned long long v[7] = {s.launches, s.blocks, s.threads, s.switches, s.block_barriers, s.warp_collectives,
                               s.exited_while_barrier};
    memcpy(out7, v, sizeof v);
}
__attribute__((visibility("default"), used)) inline unsigned long long emu_static_shared_bytes() { return emu::static_shared_bytes(); }
}
