// A CPU emulator for the CUDA kernels in kernels/*.cu, for tests on machines without a GPU.
//
// Each block runs alone (or, with `launch_concurrent`, every block at once, for kernels whose
// blocks wait on each other), one OS thread per CUDA thread: `__syncthreads()` is a barrier of the
// block's threads, and the warp shuffles exchange through a per-warp buffer between two
// barriers of the warp's 32 threads. `__shared__` arrays become function statics (one block
// at a time, so one copy is right) and the dynamic shared memory is a heap buffer of exactly
// the launch's size, so AddressSanitizer reports a kernel that reads past what the host
// reserved, and UBSan a misaligned float4. The kernel sources are included after a textual
// rewrite (tests/cuda_emulated.rs `emulator_source`): `asm` becomes `EMU_ASM`, which aborts,
// `extern __shared__ T x[];` becomes a pointer to the dynamic buffer.
//
// What it does not model: timing, memory ordering between blocks, warp-synchronous code that
// relies on lockstep without a shuffle or barrier, and the float contraction of nvcc (the host
// compiler rounds each product); results are compared with tolerances, never bit for bit
// against a GPU.
#pragma once

#include <atomic>
#include <barrier>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <thread>
#include <vector>
#include <algorithm>
#include <atomic>

namespace emu {

struct Dim3 {
    unsigned x = 1, y = 1, z = 1;
};

struct Warp {
    std::barrier<> bar{32};
    uint32_t bits[32];
    // Each lane's operand fragments of a tensor-core product (emu_mma_bf16_16x8x16).
    uint32_t frag[32][6];
};

inline thread_local Dim3 thread_idx, block_idx;
inline Dim3 block_dim, grid_dim;
inline thread_local std::barrier<>* block_barrier = nullptr;
inline thread_local std::atomic<int>* block_count = nullptr;
inline thread_local Warp* warp = nullptr;
inline thread_local unsigned lane = 0;
// Per thread, as concurrent blocks each have their own.
inline thread_local unsigned char* dynamic_smem_base = nullptr;

template <typename T>
T* dynamic_smem() {
    return reinterpret_cast<T*>(dynamic_smem_base);
}

// The larger of a running maximum and a new error, keeping a NaN (std::max would drop it, and
// a kernel that reads unwritten memory passes).
inline double worst(double acc, double e) { return e > acc || e != e ? e : acc; }

[[noreturn]] inline void unsupported_asm() {
    std::fprintf(stderr, "emu: a kernel reached inline PTX, which the CPU emulator cannot run\n");
    std::abort();
}

// Lane `src`'s value of `v`: every lane of the warp must call it, as with the real shuffles.
template <typename T>
inline T shuffle(T v, unsigned src) {
    static_assert(sizeof(T) == 4, "32-bit shuffles only");
    Warp* w = warp;
    std::memcpy(&w->bits[lane], &v, 4);
    w->bar.arrive_and_wait();
    T r;
    std::memcpy(&r, &w->bits[src & 31u], 4);
    w->bar.arrive_and_wait();
    return r;
}

// The lanes' predicates as a bit mask (every lane of the warp calls it).
inline unsigned ballot(int pred) {
    Warp* w = warp;
    w->bits[lane] = pred != 0;
    w->bar.arrive_and_wait();
    unsigned r = 0;
    for (unsigned l = 0; l < 32; l++) r |= w->bits[l] << l;
    w->bar.arrive_and_wait();
    return r;
}

// __syncthreads_count: a barrier that returns how many of the block's threads passed a nonzero
// predicate (every thread must call it). The third barrier keeps the count's reset from racing
// the next call's additions.
inline int syncthreads_count(int pred) {
    if (pred) block_count->fetch_add(1);
    block_barrier->arrive_and_wait();
    const int r = block_count->load();
    block_barrier->arrive_and_wait();
    if (thread_idx.x == 0 && thread_idx.y == 0 && thread_idx.z == 0) block_count->store(0);
    block_barrier->arrive_and_wait();
    return r;
}

// One block's state: its shared memory (garbage, as on the GPU: a kernel that reads shared
// memory before writing it gets NaNs, not zeros), barrier and warps.
struct Block {
    std::unique_ptr<unsigned char[]> shared;
    size_t smem;
    std::barrier<> bar;
    std::atomic<int> count{0};  // __syncthreads_count's
    std::unique_ptr<Warp[]> warps;
    Block(size_t smem, unsigned threads)
        : shared(new unsigned char[smem == 0 ? 1 : smem]), smem(smem), bar(threads), warps(new Warp[threads / 32]) {
        std::memset(shared.get(), 0xff, smem);
    }
};

inline unsigned checked_threads(Dim3 block) {
    const unsigned threads = block.x * block.y * block.z;
    if (threads == 0 || threads % 32 != 0 || threads > 1024) {
        std::fprintf(stderr, "emu: block of %u threads (want a multiple of 32, at most 1024)\n", threads);
        std::abort();
    }
    return threads;
}

// Starts block (bx, by, bz)'s threads into `pool`.
template <typename Kernel>
void spawn_block(std::vector<std::thread>& pool, Block& b, Dim3 block, Dim3 idx, Kernel& kernel) {
    const unsigned threads = block.x * block.y * block.z;
    for (unsigned t = 0; t < threads; t++) {
        pool.emplace_back([&b, &kernel, block, idx, t] {
            thread_idx = {t % block.x, (t / block.x) % block.y, t / (block.x * block.y)};
            block_idx = idx;
            block_barrier = &b.bar;
            block_count = &b.count;
            warp = &b.warps[t / 32];
            lane = t % 32;
            dynamic_smem_base = b.smem == 0 ? nullptr : b.shared.get();
            kernel();
        });
    }
}

// Runs `kernel` over `grid` blocks of `block` threads (a multiple of 32) with `smem` bytes of
// dynamic shared memory, blocks in order x, y, z.
template <typename Kernel>
void launch(Dim3 grid, Dim3 block, size_t smem, Kernel kernel) {
    const unsigned threads = checked_threads(block);
    grid_dim = grid;
    block_dim = block;
    for (unsigned bz = 0; bz < grid.z; bz++)
        for (unsigned by = 0; by < grid.y; by++)
            for (unsigned bx = 0; bx < grid.x; bx++) {
                Block b(smem, threads);
                std::vector<std::thread> pool;
                pool.reserve(threads);
                spawn_block(pool, b, block, {bx, by, bz}, kernel);
                for (auto& th : pool) th.join();
            }
}

// As `launch`, with every block running at once: for kernels whose blocks wait for each
// other (as the GPU's resident blocks may). Static `__shared__` arrays would be shared by all
// blocks here, so such kernels keep their shared memory dynamic.
template <typename Kernel>
void launch_concurrent(Dim3 grid, Dim3 block, size_t smem, Kernel kernel) {
    const unsigned threads = checked_threads(block);
    grid_dim = grid;
    block_dim = block;
    const unsigned blocks = grid.x * grid.y * grid.z;
    std::vector<std::unique_ptr<Block>> state;
    std::vector<std::thread> pool;
    pool.reserve((size_t)blocks * threads);
    for (unsigned b = 0; b < blocks; b++) {
        state.emplace_back(new Block(smem, threads));
        spawn_block(pool, *state.back(), block, {b % grid.x, (b / grid.x) % grid.y, b / (grid.x * grid.y)}, kernel);
    }
    for (auto& th : pool) th.join();
}

}  // namespace emu

#define threadIdx (emu::thread_idx)
#define blockIdx (emu::block_idx)
#define blockDim (emu::block_dim)
#define gridDim (emu::grid_dim)
#define __global__
#define __device__
#define __host__
#define __forceinline__ inline
#define __restrict__ __restrict
#define __launch_bounds__(...)
#define __align__(n) alignas(n)
#define EMU_ASM(...) (emu::unsupported_asm())
#define __syncthreads() (emu::block_barrier->arrive_and_wait())
#define __syncthreads_count(pred) (emu::syncthreads_count(pred))

struct alignas(16) float4 {
    float x, y, z, w;
};
inline float4 make_float4(float x, float y, float z, float w) { return {x, y, z, w}; }
struct alignas(16) uint4 {
    unsigned x, y, z, w;
};
struct alignas(8) uint2 {
    unsigned x, y;
};
inline uint2 make_uint2(unsigned x, unsigned y) { return {x, y}; }
inline uint4 make_uint4(unsigned x, unsigned y, unsigned z, unsigned w) { return {x, y, z, w}; }
struct alignas(8) float2 {
    float x, y;
};
inline float2 make_float2(float x, float y) { return {x, y}; }
struct alignas(8) int2 {
    int x, y;
};
inline int2 make_int2(int x, int y) { return {x, y}; }

using std::max;
using std::min;

template <typename T>
inline T __shfl_sync(unsigned, T v, int src, int = 32) {
    return emu::shuffle(v, (unsigned)src);
}
template <typename T>
inline T __shfl_xor_sync(unsigned, T v, int mask, int = 32) {
    return emu::shuffle(v, emu::lane ^ (unsigned)mask);
}
template <typename T>
inline T __shfl_up_sync(unsigned, T v, unsigned d, int = 32) {
    return emu::shuffle(v, emu::lane >= d ? emu::lane - d : emu::lane);
}
template <typename T>
inline T __shfl_down_sync(unsigned, T v, unsigned d, int = 32) {
    return emu::shuffle(v, emu::lane + d < 32 ? emu::lane + d : emu::lane);
}
template <typename T>
inline T atomicAdd(T* p, T v) {
    return __atomic_fetch_add(p, v, __ATOMIC_SEQ_CST);
}
template <typename T>
inline T atomicOr(T* p, T v) {
    return __atomic_fetch_or(p, v, __ATOMIC_SEQ_CST);
}
inline void __threadfence() { std::atomic_thread_fence(std::memory_order_seq_cst); }
// A spinning thread gives its core to the others (the emulator runs more threads than cores).
inline void __nanosleep(unsigned) { std::this_thread::yield(); }
inline int __popc(unsigned v) { return __builtin_popcount(v); }
inline unsigned __ballot_sync(unsigned, int pred) { return emu::ballot(pred); }
// Every lane of the warp must reach it (the emulator has no partial masks).
inline void __syncwarp(unsigned = 0xffffffffu) { emu::warp->bar.arrive_and_wait(); }
template <typename T>
inline T __ldg(const T* p) {
    return *p;
}
inline float __uint_as_float(unsigned u) {
    float f;
    std::memcpy(&f, &u, 4);
    return f;
}
inline unsigned __float_as_uint(float f) {
    unsigned u;
    std::memcpy(&u, &f, 4);
    return u;
}
inline float __int_as_float(int i) { return __uint_as_float((unsigned)i); }
inline int __float_as_int(float f) { return (int)__float_as_uint(f); }
// A product rounded on its own (never contracted into an add).
inline float __fmul_rn(float a, float b) {
    volatile float p = a * b;
    return p;
}
inline float __fdividef(float a, float b) { return a / b; }
inline float __fmaf_rn(float a, float b, float c) { return std::fma(a, b, c); }
// PTX prmt: byte k of the result is byte (s >> 4k) & 7 of the pair y:x, or that byte's sign
// replicated where bit 3 of the selector nibble is set.
inline unsigned __byte_perm(unsigned x, unsigned y, unsigned s) {
    const unsigned long long pair = (unsigned long long)y << 32 | x;
    unsigned r = 0;
    for (int k = 0; k < 4; k++) {
        const unsigned sel = (s >> (4 * k)) & 15, b = (pair >> (8 * (sel & 7))) & 255;
        r |= (sel & 8 ? (b & 128 ? 255u : 0u) : b) << (8 * k);
    }
    return r;
}
// kernels/common.cuh `f16_to_f32` (PTX `cvt.f32.f16` on the GPU): every f16 is exact in f32.
#define CAPY_EMULATED 1
inline float emu_f16_to_f32(unsigned short h) {
    const int e = (h >> 10) & 31, m = h & 1023;
    const float mag = e == 31 ? (m ? NAN : INFINITY) : e == 0 ? std::ldexp((float)m, -24) : std::ldexp((float)(1024 + m), e - 25);
    return h & 0x8000 ? -mag : mag;
}
// kernels/common.cuh `mma_bf16_16x8x16` (PTX mma.m16n8k16 on the GPU): every lane publishes
// its a and b fragments, then computes its four outputs from the whole warp's, in the PTX
// fragment layout written out element by element (common.cuh's comment). The sums are in
// f32 in k order; the tensor cores' order and rounding inside a product are their own, so
// tests compare with tolerances.
inline void emu_mma_bf16_16x8x16(float* d, const unsigned* a, const unsigned* b) {
    emu::Warp* w = emu::warp;
    const unsigned lane = emu::lane;
    for (int i = 0; i < 4; i++) w->frag[lane][i] = a[i];
    w->frag[lane][4] = b[0];
    w->frag[lane][5] = b[1];
    w->bar.arrive_and_wait();
    auto half = [](unsigned word, int k) {
        const unsigned bits = (k & 1 ? word >> 16 : word & 0xffffu) << 16;
        float f;
        std::memcpy(&f, &bits, 4);
        return f;
    };
    // A[r][k]: lane 4·(r mod 8) + (k mod 8)/2, register (r ≥ 8) + 2·(k ≥ 8).
    auto A = [&](int r, int k) { return half(w->frag[4 * (r & 7) + ((k & 7) >> 1)][(r >> 3) + 2 * (k >> 3)], k); };
    // B[k][n]: lane 4·n + (k mod 8)/2, register 4 + (k ≥ 8).
    auto B = [&](int k, int n) { return half(w->frag[4 * n + ((k & 7) >> 1)][4 + (k >> 3)], k); };
    const int group = (int)lane >> 2, t = (int)lane & 3;
    float out[4];
    for (int i = 0; i < 4; i++) {
        const int r = group + 8 * (i >> 1), c = 2 * t + (i & 1);
        float s = d[i];
        for (int k = 0; k < 16; k++) s += A(r, k) * B(k, c);
        out[i] = s;
    }
    w->bar.arrive_and_wait();
    for (int i = 0; i < 4; i++) d[i] = out[i];
}
// The low 32 bits of the 64-bit hi:lo shifted right by shift mod 32.
inline unsigned __funnelshift_r(unsigned lo, unsigned hi, unsigned shift) {
    return (unsigned)((((unsigned long long)hi << 32) | lo) >> (shift & 31));
}
inline int __float2int_rn(float f) { return (int)std::nearbyint(f); }
// dp4a.s32.s32: c plus the products of the four signed byte pairs of a and b.
inline int __dp4a(int a, int b, int c) {
    for (int k = 0; k < 4; k++) c += (int)(signed char)(a >> (8 * k)) * (int)(signed char)(b >> (8 * k));
    return c;
}
inline float __expf(float x) { return expf(x); }
inline float rsqrtf(float x) { return 1.0f / sqrtf(x); }
