// Shared helpers, prepended to every kernel file before NVRTC compiles it. No CUDA headers
// are included, so the kernels compile with NVRTC alone (no toolkit include path needed).

typedef unsigned short u16;
typedef unsigned int u32;
typedef unsigned long long u64;

#ifndef INFINITY
#define INFINITY __int_as_float(0x7f800000)
#endif

// Programmatic dependent launch (sm_90 and later). The host launches kernels with the
// programmatic-serialization attribute, so a kernel's blocks may be scheduled while the
// previous kernel in the stream is still finishing: the launch latency and the grid's ramp-up
// overlap its predecessor's tail (a decode step is ~800 launches, most of them a few µs).
// Every kernel therefore begins with KERNEL_START(): `griddepcontrol.wait` returns once every
// earlier kernel has completed and its writes are visible, and nothing may read or write
// global memory before it (a buffer this kernel writes may still be read by the previous
// one). Then `launch_dependents` lets the next kernel's blocks queue behind this grid's.
// Launched without the attribute (or before sm_90) both are no-ops. A unit test
// (backend/cuda/kernels.rs) holds every __global__ function to this.
__device__ __forceinline__ void pdl_wait() {
#if __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
}
__device__ __forceinline__ void pdl_launch_dependents() {
#if __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
}
#define KERNEL_START() \
    do {                   \
        pdl_wait();        \
        pdl_launch_dependents(); \
    } while (0)

// Weight dtype codes passed from the host (backend/cuda/mod.rs `WeightType`).
#define DT_F32 0
#define DT_BF16 1
#define DT_F16 2

__device__ __forceinline__ float bf16_to_f32(u16 b) { return __uint_as_float(((u32)b) << 16); }

__device__ __forceinline__ float f16_to_f32(u16 h) {
#ifdef CAPY_EMULATED
    return emu_f16_to_f32(h);  // the CPU emulator's (tests/cuda_emulated/emu.hpp)
#else
    float f;
    asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(h));
    return f;
#endif
}

// One warp's tensor-core product d += a·b (PTX mma.m16n8k16, BF16 operands, f32 sums): a is
// 16×16 row-major, b 16×8 column-major, in the PTX fragment layout (lane = 4·group + t):
//   a[0] row group, cols 2t..2t+1; a[1] row group+8, same cols; a[2], a[3] the same rows at
//   cols 2t+8..2t+9; b[0] rows (k) 2t..2t+1 of col group, b[1] rows 2t+8..2t+9;
//   d[0], d[1] row group, cols 2t..2t+1; d[2], d[3] row group+8.
// Each u32 holds two BF16 values, the lower index in the low half. Every lane must call it.
__device__ __forceinline__ void mma_bf16_16x8x16(float* d, const u32* a, const u32* b) {
#ifdef CAPY_EMULATED
    emu_mma_bf16_16x8x16(d, a, b);  // tests/cuda_emulated/emu.hpp
#else
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
        "{%0,%1,%2,%3};"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
#endif
}

// Round to nearest even, NaN kept quiet.
__device__ __forceinline__ u16 f32_to_bf16(float f) {
    u32 x = __float_as_uint(f);
    if ((x & 0x7fffffffu) > 0x7f800000u) return (u16)((x >> 16) | 0x40u);
    u32 r = 0x7fffu + ((x >> 16) & 1u);
    return (u16)((x + r) >> 16);
}

// Two floats rounded to BF16 (nearest even) and packed, lo in the low half: one cvt on sm_80+
// instead of two software roundings. Equal to f32_to_bf16's for every non-NaN input (a NaN
// becomes the canonical 0x7fff).
__device__ __forceinline__ u32 bf16x2(float lo, float hi) {
#ifdef CAPY_EMULATED
    return (u32)f32_to_bf16(lo) | ((u32)f32_to_bf16(hi) << 16);
#else
    u32 r;
    asm("cvt.rn.bf16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(hi), "f"(lo));
    return r;
#endif
}

// 16 bytes from global to shared memory without passing through registers (cp.async, sm_80+),
// or 16 zero bytes where !valid (src is then not read). Completes at cp_async_wait.
__device__ __forceinline__ void cp_async16(void* dst, const void* src, bool valid) {
#ifdef CAPY_EMULATED
    if (valid) std::memcpy(dst, src, 16);
    else std::memset(dst, 0, 16);
#else
    const u32 d = (u32)__cvta_generic_to_shared(dst);
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;" ::"r"(d), "l"(src), "r"(valid ? 16 : 0));
#endif
}
// Closes the group of cp_async16 issued since the last commit.
__device__ __forceinline__ void cp_async_commit() {
#ifndef CAPY_EMULATED
    asm volatile("cp.async.commit_group;");
#endif
}
// Waits until at most N committed groups are still in flight (this thread's copies only: a
// barrier after it makes every thread's visible).
template <int N>
__device__ __forceinline__ void cp_async_wait() {
#ifndef CAPY_EMULATED
    asm volatile("cp.async.wait_group %0;" ::"n"(N));
#endif
}

__device__ __forceinline__ u16 f32_to_f16(float f) {
    u16 h;
    asm("cvt.rn.f16.f32 %0, %1;" : "=h"(h) : "f"(f));
    return h;
}

// Element `i` of a weight buffer of dtype `dt`, as f32.
__device__ __forceinline__ float load_weight(const void* w, int dt, u64 i) {
    if (dt == DT_BF16) return bf16_to_f32(((const u16*)w)[i]);
    if (dt == DT_F16) return f16_to_f32(((const u16*)w)[i]);
    return ((const float*)w)[i];
}

__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}

__device__ __forceinline__ float warp_max(float v) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
    return v;
}

// A block-wide reduction (blockDim.x a multiple of 32, at most 1024) by `warp_reduce`, whose
// identity pads the missing warps; every thread gets the result.
template <typename WarpReduce>
__device__ __forceinline__ float block_reduce(float v, float* scratch, float identity, WarpReduce warp_reduce) {
    int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nwarps = blockDim.x >> 5;
    v = warp_reduce(v);
    __syncthreads();
    if (lane == 0) scratch[warp] = v;
    __syncthreads();
    return warp_reduce(lane < nwarps ? scratch[lane] : identity);
}

__device__ __forceinline__ float block_sum(float v, float* scratch) {
    return block_reduce(v, scratch, 0.0f, [](float x) { return warp_sum(x); });
}

__device__ __forceinline__ float block_max(float v, float* scratch) {
    return block_reduce(v, scratch, -INFINITY, [](float x) { return warp_max(x); });
}

__device__ __forceinline__ float silu_f(float x) { return x / (1.0f + expf(-x)); }
__device__ __forceinline__ float sigmoid_f(float x) { return 1.0f / (1.0f + expf(-x)); }

// The int8 activations the records matvecs read (kernels/quant_matvec.cu `quantize_x_q8r`),
// written by the kernel that produces x: a whole warp calls this with lane j holding value
// 32c + j of a row of `in` values; plane A (values 0..15 of each 32) at 16c, plane B at
// in/2 + 16c, xs[c] = amax / 127. Bit-identical to `quantize_x_q8r` on the same values.
// The int8 step of a group with largest magnitude amax (xs) and its inverse: the fast
// reciprocal, as a decode step quantizes ~250 rows and IEEE division is a subroutine call.
__device__ __forceinline__ float q8_inv_step(float amax) { return amax > 0.0f ? __fdividef(127.0f, amax) : 0.0f; }
__device__ __forceinline__ float q8_step(float amax) { return amax * (1.0f / 127.0f); }

// Stores lane j's value o of group c, whose magnitudes peak at amax (the warp's maximum).
__device__ __forceinline__ void store_q8r(float o, float amax, u32 c, u32 in, unsigned char* xq, float* xs) {
    const int lane = threadIdx.x & 31;
    xq[(lane < 16 ? 0u : in >> 1) + 16 * c + (lane & 15)] = (unsigned char)(__float2int_rn(o * q8_inv_step(amax)) & 255);
    if (lane == 0) xs[c] = q8_step(amax);
}

// Every lane of the warp must call it (it shuffles).
__device__ __forceinline__ void warp_store_q8r(float o, u32 c, int in, unsigned char* xq, float* xs) {
    store_q8r(o, warp_max(fabsf(o)), c, (u32)in, xq, xs);
}

// 8 E2M1 codes (nibble j = weight j) as int8 2·value (the fast NVFP4 matvecs of
// quant_matvec.cu and moe_quant_decode.cu): .x weights 0,2,4,6 and .y 1,3,5,7
// (the byte-permute lookup of llama.cpp's get_int_from_table_16).
__device__ __forceinline__ int2 e2m1x8_to_i8(u32 q4) {
    const u32 t0 = 0x03020100u, t1 = 0x0C080604u, t2 = 0xFDFEFF00u, t3 = 0xF4F8FAFCu;
    const u32 sel = 0x32103210u | ((q4 & 0x88888888u) >> 1);
    u32 tmp[2];
#pragma unroll
    for (int i = 0; i < 2; i++) {
        const u32 q = (q4 >> (16 * i)) & 0x7777u;
        const u32 lo = __byte_perm(t0, t1, q);
        const u32 hi = __byte_perm(t2, t3, q);
        tmp[i] = __byte_perm(lo, hi, (sel >> (16 * i)) & 0xFFFFu);
    }
    return make_int2((int)__byte_perm(tmp[0], tmp[1], 0x6420), (int)__byte_perm(tmp[0], tmp[1], 0x7531));
}
