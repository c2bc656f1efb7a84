// Grouped routed experts for a decode step (every group one row) in the block formats of
// Flash-Next's GGUF experts: IQ3_S gate/up, Q2_0 down. They replace moe_quant.cu's one-row
// kernels (moe_q_gate_up_1, moe_q_down_1) for these formats; the groups table and the outputs
// are the same (moe_quant.cu's header). NVFP4 experts keep moe_quant.cu's kernels: a version
// here with a shared byte → 2 × E2M1 table ran 0.93x their decode step (H200, same-run A/B).
//
// Why kernels of their own: qdecode8 decodes 8 weights a call, so every 8 weights cost their
// own dependent loads of the block's scale, sign and index bytes, and IQ3_S's grid is looked
// up in global memory; under ncu (H100) the one-row kernels read 0.4-0.5 TB/s. Here a lane
// takes 16 weights a step (one or two loads a field), the IQ3_S grid is in shared memory, the
// weights become floats without int-to-float conversions, and a down row is split over 8
// lanes, so that for Flash-Next's sizes (hidden 2560, intermediate 640) every lane has 5 steps.
//
// Arithmetic: per 16 weights Σ value · x in f32 times the step's block scale (IQ3_S
// d·(1 + 2s), Q2_0 d), then the expert's multiplier. The rounding differs
// from qdecode8's (which scales each weight first) by reassociation only.

// Shared memory a kernel's table takes, in u32 (the largest: IQ3_S's grid).
#define DEC_TABLE_WORDS 512

template <int FMT>
struct Step16;

// A byte b as the float b without an int-to-float conversion (a quarter-rate instruction):
// 0x4B0000bb is the float 2^23 + b, and subtracting 2^23 is exact.
__device__ __forceinline__ float byte_as_float(u32 word, int j) {
    return __uint_as_float(__byte_perm(word, 0x4B000000u, 0x7540u + j)) - 8388608.0f;
}

// IQ3_S: 110-byte blocks of 256 weights (a step is 16 of them). Table: the 512 grid entries
// (4 magnitude bytes each) in shared memory, 2 KiB; each byte becomes a float as above. A
// first version expanded the grid to 512 float4 (8 KiB): its 16-byte lookups at random
// entries conflict in the banks (about 12 wavefronts a lookup against about 4), and the
// decode step ran 0.925x moe_q_gate_up_1's (H200, same-run A/B).
template <>
struct Step16<QF_IQ3_S> {
    static constexpr int BLOCK_WEIGHTS = 256, BLOCK_BYTES = 110;
    __device__ static void fill(u32* t) {
        for (int i = threadIdx.x; i < 512; i += blockDim.x) t[i] = QT_IQ3S[i];
    }
    // ±v: negated where bit `bit` of `signs` is set.
    __device__ static float signed_value(float v, u32 signs, int bit) {
        return __uint_as_float(__float_as_uint(v) ^ ((signs << (31 - bit)) & 0x80000000u));
    }
    // Σ w · x over weights 16s..16s+15 of the block at b, unscaled; the scale in `scale`.
    __device__ static float dot(const unsigned char* b, int s, const u32* t, const float4* x, float& scale) {
        const u16* b16 = (const u16*)b;
        const u32 qs = (u32)b16[1 + 2 * s] | ((u32)b16[2 + 2 * s] << 16);
        const u32 qh = (b[66 + (s >> 1)] >> (4 * (s & 1))) & 15u;
        const u32 signs = b16[37 + s];
        const u32 sc = (b[106 + (s >> 2)] >> (4 * ((s >> 1) & 1))) & 15u;
        scale = f16_to_f32(b16[0]) * (float)(1 + 2 * sc);
        float acc = 0.0f;
#pragma unroll
        for (int e = 0; e < 4; e++) {
            const u32 g = t[((qs >> (8 * e)) & 255u) | (((qh >> e) & 1u) << 8)];
            acc = fmaf(signed_value(byte_as_float(g, 0), signs, 4 * e), x[e].x, acc);
            acc = fmaf(signed_value(byte_as_float(g, 1), signs, 4 * e + 1), x[e].y, acc);
            acc = fmaf(signed_value(byte_as_float(g, 2), signs, 4 * e + 2), x[e].z, acc);
            acc = fmaf(signed_value(byte_as_float(g, 3), signs, 4 * e + 3), x[e].w, acc);
        }
        return acc;
    }
};

// Q2_0: 18-byte blocks of 64 weights (f16 d, then 2-bit codes c, four a byte, low bits
// first), weight d·(c - 1). No table (the first version's 16-byte lookups of a byte's four
// values conflicted in the banks: 22 µs a layer under ncu on the H200 against moe_q_down_1's
// 13 on the H100): 0x4B000000 | c is the float 2^23 + c, less 2^23 + 1 it is c - 1 exactly.
template <>
struct Step16<QF_Q2_0> {
    static constexpr int BLOCK_WEIGHTS = 64, BLOCK_BYTES = 18;
    __device__ static void fill(u32*) {}
    __device__ static float dot(const unsigned char* b, int s, const u32*, const float4* x, float& scale) {
        const u16* b16 = (const u16*)b;
        const u32 codes = (u32)b16[1 + 2 * s] | ((u32)b16[2 + 2 * s] << 16);
        scale = f16_to_f32(b16[0]);
        float acc = 0.0f;
#pragma unroll
        for (int e = 0; e < 4; e++) {
            const float xs[4] = {x[e].x, x[e].y, x[e].z, x[e].w};
#pragma unroll
            for (int j = 0; j < 4; j++)
                acc = fmaf(__uint_as_float(((codes >> (8 * e + 2 * j)) & 3u) | 0x4B000000u) - 8388609.0f, xs[j], acc);
        }
        return acc;
    }
};

// x [n, hidden] → act [slots, inter] = silu(gate · x) · (up · x), every group one row.
// grid (ceil(inter / warps), G); a warp per output column, its gate and up rows read together
// (each lane's x loaded once for both). hidden a multiple of the format's block.
template <int FMT>
__device__ __forceinline__ void moe_dec_gate_up(const u64* groups, const u32* rows, const float* x, float* act,
                                                int hidden, int inter, u64 row_bytes, int interleaved) {
    typedef Step16<FMT> F;
    __shared__ u32 table[DEC_TABLE_WORDS];
    F::fill(table);
    __syncthreads();
    const int lane = threadIdx.x & 31;
    const int o = blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5);
    if (o >= inter) return;
    const u64* g = groups + (u64)blockIdx.y * 6;
    const unsigned char* w = (const unsigned char*)g[0];
    const int off = (int)g[2];
    const float mult = __uint_as_float((u32)g[4]);
    const unsigned char* wg = w + (u64)(interleaved ? 2 * o : o) * row_bytes;
    const unsigned char* wu = w + (u64)(interleaved ? 2 * o + 1 : inter + o) * row_bytes;
    const float4* xr = (const float4*)(x + (u64)rows[off] * hidden);
    constexpr int STEPS_PER_BLOCK = F::BLOCK_WEIGHTS / 16;
    float ag = 0.0f, au = 0.0f;
    const int steps = hidden >> 4;
#pragma unroll 2
    for (int h = lane; h < steps; h += 32) {
        const int blk = h / STEPS_PER_BLOCK, s = h % STEPS_PER_BLOCK;
        float4 xv[4];
#pragma unroll
        for (int e = 0; e < 4; e++) xv[e] = xr[4 * h + e];
        float sg, su;
        const float pg = F::dot(wg + F::BLOCK_BYTES * blk, s, table, xv, sg);
        const float pu = F::dot(wu + F::BLOCK_BYTES * blk, s, table, xv, su);
        ag = fmaf(pg, sg, ag);
        au = fmaf(pu, su, au);
    }
    const float gs = warp_sum(ag) * mult;
    const float us = warp_sum(au) * mult;
    if (lane == 0) act[(u64)off * inter + o] = silu_f(gs) * us;
}

#define MOE_DEC_DOWN_LANES 8
// act [slots, inter] → ys [slots, hidden] = act · downᵀ per group, every group one row. A warp
// takes 32 / MOE_DEC_DOWN_LANES output rows, MOE_DEC_DOWN_LANES lanes each. grid
// (ceil(hidden / (warps · 32 / MOE_DEC_DOWN_LANES)), G); inter a multiple of the block.
template <int FMT>
__device__ __forceinline__ void moe_dec_down(const u64* groups, const float* act, float* ys, int hidden, int inter,
                                             u64 row_bytes) {
    typedef Step16<FMT> F;
    __shared__ u32 table[DEC_TABLE_WORDS];
    F::fill(table);
    __syncthreads();
    const int lane = threadIdx.x & 31, sub = lane % MOE_DEC_DOWN_LANES;
    const int o = (blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5)) * (32 / MOE_DEC_DOWN_LANES) +
                  lane / MOE_DEC_DOWN_LANES;
    // Every lane stays for the shuffles; rows past the end read row 0 and write nothing.
    const bool live = o < hidden;
    const u64* g = groups + (u64)blockIdx.y * 6;
    const unsigned char* wr = (const unsigned char*)g[1] + (u64)(live ? o : 0) * row_bytes;
    const int off = (int)g[2];
    const float mult = __uint_as_float((u32)g[5]);
    const float4* a = (const float4*)(act + (u64)off * inter);
    constexpr int STEPS_PER_BLOCK = F::BLOCK_WEIGHTS / 16;
    float acc = 0.0f;
    const int steps = inter >> 4;
#pragma unroll 2
    for (int q = sub; q < steps; q += MOE_DEC_DOWN_LANES) {
        float4 av[4];
#pragma unroll
        for (int e = 0; e < 4; e++) av[e] = a[4 * q + e];
        float sc;
        const float p = F::dot(wr + F::BLOCK_BYTES * (q / STEPS_PER_BLOCK), q % STEPS_PER_BLOCK, table, av, sc);
        acc = fmaf(p, sc, acc);
    }
#pragma unroll
    for (int m = MOE_DEC_DOWN_LANES / 2; m > 0; m >>= 1) acc += __shfl_xor_sync(0xffffffffu, acc, m);
    if (live && sub == 0) ys[(u64)off * hidden + o] = acc * mult;
}

// One kernel per format (a kernel's registers are those of its largest path).
#define MOE_DEC_KERNELS(NAME, F)                                                                              \
    extern "C" __global__ void moe_dec_gate_up_##NAME(const u64* groups, const u32* rows, const float* x,      \
                                                      float* act, int hidden, int inter, u64 row_bytes,        \
                                                      int interleaved) {                                       \
        KERNEL_START();                                                                                       \
        moe_dec_gate_up<F>(groups, rows, x, act, hidden, inter, row_bytes, interleaved);                      \
    }                                                                                                         \
    extern "C" __global__ void moe_dec_down_##NAME(const u64* groups, const float* act, float* ys, int hidden, \
                                                   int inter, u64 row_bytes) {                                 \
        KERNEL_START();                                                                                       \
        moe_dec_down<F>(groups, act, ys, hidden, inter, row_bytes);                                           \
    }
MOE_DEC_KERNELS(iq3_s, QF_IQ3_S)
MOE_DEC_KERNELS(q2_0, QF_Q2_0)
