// The decode step's grouped IQ3_S gate/up experts (every group one row): Flash-Next's GGUF
// experts. It replaces moe_quant.cu's moe_q_gate_up_1 for IQ3_S rows (unless
// CAPY_MOE_DECODE_KERNELS=0); the groups table and the output are the same (moe_quant.cu's
// header).
//
// Why a kernel of its own: qdecode8 decodes 8 weights a call, so every 8 weights cost their
// own dependent loads of the block's scale, sign and index bytes, two grid lookups in global
// memory and an int-to-float conversion per weight. Here a lane takes 16 weights a step (one
// or two loads a field), x is loaded once for a column's gate and up rows, the grid is in
// shared memory and bytes become floats by prmt. Under ncu on the H200 (one Flash-Next decode
// step, same call): 25.5 µs a layer against moe_q_gate_up_1's 27.1.
//
// What did not pay (H200, same-run measurements; see docs/cuda-decode-kernels.md):
// - the grid as 512 float4 (8 KiB): 16-byte lookups at random entries conflict in the banks
//   (about 12 wavefronts a lookup against about 4 for u32), decode 0.925x;
// - the Q2_0 down rows on 8 lanes a row with 16-weight steps: 16.6 µs a layer against
//   moe_q_down_1's 12.5 (one warp a row), with or without a value table;
// - NVFP4 with a shared byte → 2 × E2M1 table: decode 0.93x.
//
// Arithmetic: per 16 weights Σ ±grid · x in f32 times the sub-block scale d·(1 + 2s), then
// the expert's multiplier. The rounding differs from qdecode8's (which scales each weight
// first) by reassociation only.

template <int FMT>
struct Step16;

// A byte b as the float b without an int-to-float conversion (a quarter-rate instruction):
// 0x4B0000bb is the float 2^23 + b, and subtracting 2^23 is exact.
__device__ __forceinline__ float byte_as_float(u32 word, int j) {
    return __uint_as_float(__byte_perm(word, 0x4B000000u, 0x7540u + j)) - 8388608.0f;
}

// IQ3_S: 110-byte blocks of 256 weights (a step is 16 of them). Table: the 512 grid entries
// (4 magnitude bytes each) in shared memory, 2 KiB; each byte becomes a float as above.
template <>
struct Step16<QF_IQ3_S> {
    static constexpr int BLOCK_WEIGHTS = 256, BLOCK_BYTES = 110, TABLE_WORDS = 512;
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

// x [n, hidden] → act [slots, inter] = silu(gate · x) · (up · x), every group one row.
// grid (ceil(inter / warps), G); a warp per output column, its gate and up rows read together
// (each lane's x loaded once for both). hidden a multiple of the format's block.
template <int FMT>
__device__ __forceinline__ void moe_dec_gate_up(const u64* groups, const u32* rows, const float* x, float* act,
                                                int hidden, int inter, u64 row_bytes, int interleaved) {
    typedef Step16<FMT> F;
    __shared__ u32 table[F::TABLE_WORDS];
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

extern "C" __global__ void moe_dec_gate_up_iq3_s(const u64* groups, const u32* rows, const float* x, float* act,
                                                  int hidden, int inter, u64 row_bytes, int interleaved) {
    KERNEL_START();
    moe_dec_gate_up<QF_IQ3_S>(groups, rows, x, act, hidden, inter, row_bytes, interleaved);
}
