// Grouped routed experts for a decode step (every group one row) in the layout Flash-Next's
// IQ3_S experts come in: IQ3_S gate/up rows, Q2_0 down rows. They replace moe_quant.cu's
// one-row kernels (moe_q_gate_up_1, moe_q_down_1) for those formats; the groups table and
// the outputs are the same (moe_quant.cu's header).
//
// Why their own kernels: qdecode8 decodes 8 weights a call, so every 8 weights cost their own
// dependent byte loads (the block's scale, sign and index bytes) and two lookups of a grid in
// global memory; under ncu (H100) the one-row kernels read 0.4-0.5 TB/s. Here a lane takes 16
// weights a step (one u16 load each for signs and, twice, indices), the IQ3_S grid and a Q2_0
// byte table are expanded to f32 in shared memory (one 16-byte load gives 4 weights), and the
// down rows are split over 8 lanes each, so that every lane has 5 steps of equal work for
// Flash-Next's sizes (hidden 2560, intermediate 640).
//
// Arithmetic: per 16 weights Σ ±grid · x in f32, times the sub-block scale d·(1 + 2s) (IQ3_S)
// or Σ (c - 1) · x times d (Q2_0); then the expert's multiplier. The rounding differs from
// qdecode8's (which scales each weight first) by float reassociation only.

// The IQ3_S grid's 512 entries as 4 floats each (8 KiB), built per block from QT_IQ3S.
__device__ __forceinline__ void iq3s_grid_f32(float4* grid) {
    for (int i = threadIdx.x; i < 512; i += blockDim.x) {
        const u32 g = QT_IQ3S[i];
        grid[i] = make_float4((float)(g & 255), (float)((g >> 8) & 255), (float)((g >> 16) & 255), (float)(g >> 24));
    }
}

// ±v: negated where bit `bit` of `signs` is set.
__device__ __forceinline__ float iq3s_signed(float v, u32 signs, int bit) {
    return __uint_as_float(__float_as_uint(v) ^ ((signs << (31 - bit)) & 0x80000000u));
}

// Σ w · x over the 16 weights of half sub-block `hs` (0..15) of the IQ3_S block at `b`,
// unscaled by d·(1 + 2s) (returned in `db`).
__device__ __forceinline__ float iq3s_half_dot(const unsigned char* b, int hs, const float4* grid, const float4* xv,
                                               float& db) {
    const u16* b16 = (const u16*)b;
    const u32 qs = (u32)b16[1 + 2 * hs] | ((u32)b16[2 + 2 * hs] << 16);
    const u32 qh = (b[66 + (hs >> 1)] >> (4 * (hs & 1))) & 15u;
    const u32 signs = b16[37 + hs];
    const u32 s = (b[106 + (hs >> 2)] >> (4 * ((hs >> 1) & 1))) & 15u;
    db = f16_to_f32(b16[0]) * (float)(1 + 2 * s);
    float acc = 0.0f;
#pragma unroll
    for (int e = 0; e < 4; e++) {
        const float4 g = grid[((qs >> (8 * e)) & 255u) | (((qh >> e) & 1u) << 8)];
        const float4 x = xv[e];
        acc = fmaf(iq3s_signed(g.x, signs, 4 * e), x.x, acc);
        acc = fmaf(iq3s_signed(g.y, signs, 4 * e + 1), x.y, acc);
        acc = fmaf(iq3s_signed(g.z, signs, 4 * e + 2), x.z, acc);
        acc = fmaf(iq3s_signed(g.w, signs, 4 * e + 3), x.w, acc);
    }
    return acc;
}

// x [n, hidden] → act [slots, inter] = silu(gate · x) · (up · x) for IQ3_S gate and up rows,
// every group one row. grid (ceil(inter / warps), G); a warp per output column, its gate and
// up rows read together (each lane's x loaded once for both). hidden a multiple of 256.
extern "C" __global__ void moe_iq3s_gate_up_1(const u64* groups, const u32* rows, const float* x, float* act,
                                              int hidden, int inter, u64 row_bytes, int interleaved) { KERNEL_START();
    __shared__ float4 grid[512];
    iq3s_grid_f32(grid);
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
    float ag = 0.0f, au = 0.0f;
    const int halves = hidden >> 4;
#pragma unroll 2
    for (int h = lane; h < halves; h += 32) {
        const int blk = h >> 4, hs = h & 15;
        float4 xv[4];
#pragma unroll
        for (int e = 0; e < 4; e++) xv[e] = xr[4 * h + e];
        float dg, du;
        const float pg = iq3s_half_dot(wg + 110 * blk, hs, grid, xv, dg);
        const float pu = iq3s_half_dot(wu + 110 * blk, hs, grid, xv, du);
        ag = fmaf(pg, dg, ag);
        au = fmaf(pu, du, au);
    }
    const float gs = warp_sum(ag) * mult;
    const float us = warp_sum(au) * mult;
    if (lane == 0) act[(u64)off * inter + o] = silu_f(gs) * us;
}

// A Q2_0 byte's four codes c as the weights c - 1 (the block scale applied after the sum).
__device__ __forceinline__ void q2_0_byte_f32(float4* table) {
    for (int i = threadIdx.x; i < 256; i += blockDim.x)
        table[i] = make_float4((float)((i & 3) - 1), (float)(((i >> 2) & 3) - 1), (float)(((i >> 4) & 3) - 1),
                               (float)((i >> 6) - 1));
}

#define MOE_Q2_DOWN_LANES 8
// act [slots, inter] → ys [slots, hidden] = act · downᵀ per group, Q2_0 down rows, every group
// one row. A warp takes 32 / MOE_Q2_DOWN_LANES output rows, MOE_Q2_DOWN_LANES lanes each,
// 16 weights a step. grid (ceil(hidden / (warps · 32 / MOE_Q2_DOWN_LANES)), G); inter a
// multiple of 64.
extern "C" __global__ void moe_q2_0_down_1(const u64* groups, const float* act, float* ys, int hidden, int inter,
                                           u64 row_bytes) { KERNEL_START();
    __shared__ float4 table[256];
    q2_0_byte_f32(table);
    __syncthreads();
    const int lane = threadIdx.x & 31, sub = lane % MOE_Q2_DOWN_LANES;
    const int o = (blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5)) * (32 / MOE_Q2_DOWN_LANES) +
                  lane / MOE_Q2_DOWN_LANES;
    // Every lane stays for the shuffles; rows past the end read row 0 and write nothing.
    const bool live = o < hidden;
    const u64* g = groups + (u64)blockIdx.y * 6;
    const unsigned char* wr = (const unsigned char*)g[1] + (u64)(live ? o : 0) * row_bytes;
    const int off = (int)g[2];
    const float mult = __uint_as_float((u32)g[5]);
    const float4* a = (const float4*)(act + (u64)off * inter);
    float acc = 0.0f;
    const int quarters = inter >> 4;
#pragma unroll 2
    for (int q = sub; q < quarters; q += MOE_Q2_DOWN_LANES) {
        const unsigned char* b = wr + 18 * (q >> 2);
        const u16* b16 = (const u16*)b;
        const u32 codes = (u32)b16[1 + 2 * (q & 3)] | ((u32)b16[2 + 2 * (q & 3)] << 16);
        float p = 0.0f;
#pragma unroll
        for (int j = 0; j < 4; j++) {
            const float4 v = table[(codes >> (8 * j)) & 255u];
            const float4 y = a[4 * q + j];
            p = fmaf(v.x, y.x, p);
            p = fmaf(v.y, y.y, p);
            p = fmaf(v.z, y.z, p);
            p = fmaf(v.w, y.w, p);
        }
        acc = fmaf(p, f16_to_f32(b16[0]), acc);
    }
#pragma unroll
    for (int m = MOE_Q2_DOWN_LANES / 2; m > 0; m >>= 1) acc += __shfl_xor_sync(0xffffffffu, acc, m);
    if (live && sub == 0) ys[(u64)off * hidden + o] = acc * mult;
}
