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

// The same byte times m, exactly rounded as (float)b · m is, in one FFMA: (2^23 + b) · m plus
// m_lo = -2^23 · m (exact: a power-of-two multiple of m).
__device__ __forceinline__ float byte_times(u32 word, int j, float m, float m_lo) {
    return __fmaf_rn(__uint_as_float(__byte_perm(word, 0x4B000000u, 0x7540u + j)), m, m_lo);
}

// ±v: negated where bit `bit` of `signs` is set.
__device__ __forceinline__ float signed_value(float v, u32 signs, int bit) {
    return __uint_as_float(__float_as_uint(v) ^ ((signs << (31 - bit)) & 0x80000000u));
}

// IQ3_S: 110-byte blocks of 256 weights (a step is 16 of them). Table: the 512 grid entries
// (4 magnitude bytes each) in shared memory, 2 KiB; each byte becomes a float as above.
template <>
struct Step16<QF_IQ3_S> {
    static constexpr int BLOCK_WEIGHTS = 256, BLOCK_BYTES = 110, TABLE_WORDS = 512;
    __device__ static void fill(u32* t) {
        for (int i = threadIdx.x; i < 512; i += blockDim.x) t[i] = QT_IQ3S[i];
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

// ---------------------------------------------------------------------------------------------
// The fast path's grouped decode experts (not CAPY_EXACT_MATH; every group one row): int8
// activations and dp4a, as the dense fast matvecs (quant_matvec.cu). The f32 kernels above
// (and moe_quant.cu's one-row kernels) spend about 7 instructions a weight and, under ncu on
// the H200, read Flash-Next's experts at 0.55 TB/s (gate/up, 25.5 µs a layer) and 0.25 TB/s
// (Q2_0 down, 16.6 µs): the issue rate, not memory, bounds them. Here a weight costs about 2
// instructions for IQ3_S and 1 for Q2_0.
//
// GGUF blocks are 2-byte aligned (110 and 18 bytes), so each warp first copies its rows'
// contiguous bytes into shared memory with 8-byte loads, all issued before the block's
// prologue (the grid table, x quantized to int8 per 32 values), and decodes from there.
//
// Rounding: x is rounded to int8 per 32 values (step amax/127, as quantize_x_q8r); the integer
// sums are exact and the scales are applied in f32, per sub-block.

#define MQ8_WARPS 8

// The order the int8 values of x are stored in, to match a format's packing of weights.
#define MQ8_NATURAL 0
// Each 16 values 4×4-transposed (byte 4j + i of a 16 holds value 4i + j): Q2_0's 2-bit fields.
#define MQ8_Q2_0_ORDER 1
// Each 8 values as [0, 2, 4, 6, 1, 3, 5, 7]: e2m1x8_to_i8's even and odd weights (NVFP4).
#define MQ8_NVFP4_ORDER 2

// x[0..n) (n % 32 == 0) → int8 per 32 values, step[g] = amax/127, by the block's threads one
// group a thread, stored in `order`; sum16 (when non-null): the sum of each 16 int8 values.
__device__ __forceinline__ void mq8_quantize(const float* x, int n, signed char* xq, float* step, int* sum16,
                                             int order) {
    for (int g = threadIdx.x; g < (n >> 5); g += blockDim.x) {
        float v[32];
        float amax = 0.0f;
#pragma unroll
        for (int k = 0; k < 8; k++) {
            const float4 a = ((const float4*)(x + 32 * (u64)g))[k];
            v[4 * k] = a.x; v[4 * k + 1] = a.y; v[4 * k + 2] = a.z; v[4 * k + 3] = a.w;
        }
#pragma unroll
        for (int k = 0; k < 32; k++) amax = fmaxf(amax, fabsf(v[k]));
        const float inv = q8_inv_step(amax);
        int s[2] = {0, 0};
#pragma unroll
        for (int k = 0; k < 32; k++) {
            const int q = __float2int_rn(v[k] * inv);
            s[k >> 4] += q;
            const int at = order == MQ8_Q2_0_ORDER   ? (k & ~15) | ((k & 3) << 2) | ((k >> 2) & 3)
                           : order == MQ8_NVFP4_ORDER ? (k & ~7) | ((k & 1) << 2) | ((k >> 1) & 3)
                                                      : k;
            xq[32 * g + at] = (signed char)q;
        }
        step[g] = q8_step(amax);
        if (sum16) {
            sum16[2 * g] = s[0];
            sum16[2 * g + 1] = s[1];
        }
    }
}

// Copies two runs of bytes (each a multiple of 8 long, 8-byte aligned) into one contiguous
// buffer with the warp's lanes, in two steps so that every load is in flight before the first
// store: up to MAX 8-byte words a lane are held in registers.
template <int MAX>
struct Mq8Stage {
    uint2 v[MAX];
    int words_a, words;
    __device__ __forceinline__ void load(const unsigned char* a, int bytes_a, const unsigned char* b, int bytes_b,
                                         int lane) {
        words_a = bytes_a >> 3;
        words = words_a + (bytes_b >> 3);
#pragma unroll
        for (int k = 0; k < MAX; k++) {
            const int t = lane + 32 * k;
            if (t < words_a) v[k] = ((const uint2*)a)[t];
            else if (t < words) v[k] = ((const uint2*)b)[t - words_a];
        }
    }
    __device__ __forceinline__ void store(unsigned char* dst, int lane) const {
#pragma unroll
        for (int k = 0; k < MAX; k++)
            if (lane + 32 * k < words) ((uint2*)dst)[lane + 32 * k] = v[k];
    }
};

// 8-byte words a lane stages: Flash-Next's four IQ3_S rows of 2560 weights (4400 bytes), eight
// Q2_0 rows of 640 (1440 bytes), two NVFP4 rows of 2560 and eight of 640 (2880 bytes each) fit
// (the host checks: flash_next.rs `decode_q8_*_plan`).
#define MQ8_IQ3S_STAGE 18
#define MQ8_Q2_0_STAGE 6
#define MQ8_NVFP4_STAGE 12

__device__ __forceinline__ u32 mq8_u16(const unsigned char* p) { return *(const u16*)p; }

// x [n, hidden] → act [slots, inter] = silu(gate · x) · (up · x), IQ3_S rows, every group one
// row; grid (inter / (2 · MQ8_WARPS), G), block 32 · MQ8_WARPS. A warp takes two output
// columns: their gate and up rows (4 · row_bytes bytes: one run when interleaved, else the two
// gate rows then the two up rows), 8 lanes a row, lane j decoding sub-block j of each block.
// Needs hidden % 256 == 0, inter % 2 == 0, 4 · row_bytes ≤ 8 · 32 · MQ8_IQ3S_STAGE, and
// 8-byte aligned matrices (2 · row_bytes is a multiple of 8 for IQ3_S).
// Dynamic shared memory: hidden + hidden / 8 + 2048 + MQ8_WARPS · 4 · row_bytes bytes.
extern "C" __global__ void moe_dec_gate_up_iq3s_q8(const u64* groups, const u32* rows, const float* x, float* act,
                                                   int hidden, int inter, u64 row_bytes, int interleaved) {
    KERNEL_START();
    extern __shared__ uint4 mq8_smem4[];  // uint4: 16-byte aligned
    unsigned char* mq8_smem = (unsigned char*)mq8_smem4;
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    signed char* xq = (signed char*)mq8_smem;
    float* step = (float*)(mq8_smem + hidden);
    u32* grid = (u32*)(step + (hidden >> 5));
    unsigned char* wbuf = (unsigned char*)(grid + 512) + (u64)warp * 4 * row_bytes;
    const u64* g = groups + (u64)blockIdx.y * 6;
    const unsigned char* w = (const unsigned char*)g[0];
    const int off = (int)g[2];
    const float mult = __uint_as_float((u32)g[4]);
    const int o0 = 2 * (blockIdx.x * MQ8_WARPS + warp);
    const bool active = o0 < inter;
    // The warp's rows into registers first: their loads overlap the prologue.
    const int pair = 2 * (int)row_bytes;
    Mq8Stage<MQ8_IQ3S_STAGE> staged;
    if (active) {
        const unsigned char* gate = w + (u64)(interleaved ? 2 * o0 : o0) * row_bytes;
        const unsigned char* up = interleaved ? gate + pair : w + (u64)(inter + o0) * row_bytes;
        staged.load(gate, pair, up, pair, lane);
    }
    for (int i = threadIdx.x; i < 512; i += blockDim.x) grid[i] = QT_IQ3S[i];
    mq8_quantize(x + (u64)rows[off] * hidden, hidden, xq, step, nullptr, MQ8_NATURAL);
    if (active) staged.store(wbuf, lane);
    __syncthreads();
    if (!active) return;
    // Row r of the staged four: interleaved g0 u0 g1 u1 (one run), else g0 g1 u0 u1.
    const int r = lane >> 3, j = lane & 7;
    const unsigned char* row = wbuf + (u64)r * row_bytes;
    const int blocks = hidden >> 8;
    float acc = 0.0f;
    for (int b = 0; b < blocks; b++) {
        const unsigned char* blk = row + 110 * b;
        const float d = f16_to_f32((u16)mq8_u16(blk));
        const u32 qs01 = mq8_u16(blk + 2 + 8 * j) | (mq8_u16(blk + 4 + 8 * j) << 16);
        const u32 qs23 = mq8_u16(blk + 6 + 8 * j) | (mq8_u16(blk + 8 + 8 * j) << 16);
        const u32 qh = blk[66 + j];
        const u32 signs = mq8_u16(blk + 74 + 4 * j) | (mq8_u16(blk + 76 + 4 * j) << 16);
        const u32 sc = (blk[106 + (j >> 1)] >> (4 * (j & 1))) & 15u;
        const int s = 8 * b + j;
        const uint4 xa = ((const uint4*)(xq + 32 * s))[0];
        const uint4 xb = ((const uint4*)(xq + 32 * s))[1];
        const u32 xw[8] = {xa.x, xa.y, xa.z, xa.w, xb.x, xb.y, xb.z, xb.w};
        int isum = 0;
#pragma unroll
        for (int e = 0; e < 8; e++) {
            const u32 q = e < 4 ? qs01 : qs23;
            const u32 idx = ((q >> (8 * (e & 3))) & 255u) | (((qh >> e) & 1u) << 8);
            // 0xFE in the bytes whose sign bit is set (every grid byte is odd, and an odd g
            // xor 0xFE is −g in two's complement). The entry's 4 sign bits are spread by
            // arithmetic: a 16-entry table lookup conflicted in the banks (under ncu on an
            // H100 the kernel took 22 µs a layer with it, bound by shared-memory wavefronts).
            const u32 neg = ((((signs >> (4 * e)) & 15u) * 0x00204081u) & 0x01010101u) * 0xFEu;
            const u32 v = grid[idx] ^ neg;
            isum = __dp4a((int)v, (int)xw[e], isum);
        }
        acc = fmaf(d * (float)(1 + 2 * (int)sc) * step[s], (float)isum, acc);
    }
#pragma unroll
    for (int m = 1; m < 8; m <<= 1) acc += __shfl_xor_sync(0xffffffffu, acc, m);
    // Lanes 0, 8, 16, 24 hold rows 0..3; each column's gate meets its up row.
    const int up_from = interleaved ? 8 : 16;
    const float up = __shfl_down_sync(0xffffffffu, acc, up_from);
    const bool gate_lane = interleaved ? (lane == 0 || lane == 16) : (lane == 0 || lane == 8);
    if (gate_lane) {
        const int o = o0 + (interleaved ? lane >> 4 : lane >> 3);
        act[(u64)off * inter + o] = silu_f(acc * mult) * (up * mult);
    }
}

// act [slots, inter] → ys [slots, hidden] = act · downᵀ per group, Q2_0 rows (64 weights in 18
// bytes: f16 d, then 16 bytes of 2-bit codes c, weight 4b + i in bits 2i of byte b, value
// (c − 1)·d), every group one row; grid (ceil(hidden / (8 · MQ8_WARPS)), G), block
// 32 · MQ8_WARPS. A warp takes 8 consecutive rows, 4 lanes a row, lane q decoding the 16
// weights of code word q of each block: (word >> 2i) & 0x03030303 are the codes of weights
// 16q + 4t + i (t = 0..3), against x stored transposed per 16 (MQ8_Q2_0_ORDER), and
// Σ (c − 1)·x = Σ c·x − Σ x. Needs hidden % 8 == 0, inter % 64 == 0, 8 · row_bytes ≤ 8 · 32 · MQ8_Q2_0_STAGE
// and 8-byte aligned matrices (8 · row_bytes is a multiple of 8).
// Dynamic shared memory: inter + inter / 8 + inter / 4 + MQ8_WARPS · 8 · row_bytes bytes.
extern "C" __global__ void moe_dec_down_q2_0_q8(const u64* groups, const float* act, float* ys, int hidden, int inter,
                                                u64 row_bytes) {
    KERNEL_START();
    extern __shared__ uint4 mq8_smem4[];  // uint4: 16-byte aligned
    unsigned char* mq8_smem = (unsigned char*)mq8_smem4;
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    signed char* xq = (signed char*)mq8_smem;
    float* step = (float*)(mq8_smem + inter);
    int* sum16 = (int*)(step + (inter >> 5));
    unsigned char* wbuf = (unsigned char*)(sum16 + (inter >> 4)) + (u64)warp * 8 * row_bytes;
    const u64* g = groups + (u64)blockIdx.y * 6;
    const unsigned char* w = (const unsigned char*)g[1];
    const int off = (int)g[2];
    const float mult = __uint_as_float((u32)g[5]);
    const int o0 = 8 * (blockIdx.x * MQ8_WARPS + warp);
    const int nrows = min(8, hidden - o0);
    Mq8Stage<MQ8_Q2_0_STAGE> staged;
    const unsigned char* first = w + (u64)o0 * row_bytes;
    if (nrows > 0) staged.load(first, nrows * (int)row_bytes, first, 0, lane);
    mq8_quantize(act + (u64)off * inter, inter, xq, step, sum16, MQ8_Q2_0_ORDER);
    if (nrows > 0) staged.store(wbuf, lane);
    __syncthreads();
    const int r = lane >> 2, q = lane & 3;
    if (r >= nrows) return;
    const unsigned char* row = wbuf + (u64)r * row_bytes;
    const int blocks = inter >> 6;
    float acc = 0.0f;
    for (int b = 0; b < blocks; b++) {
        const unsigned char* blk = row + 18 * b;
        const float d = f16_to_f32((u16)mq8_u16(blk));
        const u32 codes = mq8_u16(blk + 2 + 4 * q) | (mq8_u16(blk + 4 + 4 * q) << 16);
        const int sx = 4 * b + q;  // this lane's 16 values
        const uint4 xv = *(const uint4*)(xq + 16 * sx);
        int isum = __dp4a((int)(codes & 0x03030303u), (int)xv.x, 0);
        isum = __dp4a((int)((codes >> 2) & 0x03030303u), (int)xv.y, isum);
        isum = __dp4a((int)((codes >> 4) & 0x03030303u), (int)xv.z, isum);
        isum = __dp4a((int)((codes >> 6) & 0x03030303u), (int)xv.w, isum);
        acc = fmaf(d * step[sx >> 1], (float)(isum - sum16[sx]), acc);
    }
    acc += __shfl_xor_sync(0xffffffffu, acc, 1);
    acc += __shfl_xor_sync(0xffffffffu, acc, 2);
    if (q == 0) ys[(u64)off * hidden + o0 + r] = acc * mult;
}

// Σ w·x over the 16 weights of scale `sub` of the (staged, 4-byte aligned) NVFP4 block at blk,
// w twice the E2M1 values, against their int8 x at x16 (MQ8_NVFP4_ORDER).
__device__ __forceinline__ int mq8_nvfp4_dot16(const unsigned char* blk, int sub, const signed char* x16) {
    const int2 a = e2m1x8_to_i8(*(const u32*)(blk + 4 + 8 * sub));
    const int2 c = e2m1x8_to_i8(*(const u32*)(blk + 8 + 8 * sub));
    const uint4 xv = *(const uint4*)x16;
    int isum = __dp4a(a.x, (int)xv.x, 0);
    isum = __dp4a(a.y, (int)xv.y, isum);
    isum = __dp4a(c.x, (int)xv.z, isum);
    return __dp4a(c.y, (int)xv.w, isum);
}

// NVFP4 (36-byte blocks of 64 weights: four E4M3 scales, one per 16, then 32 code bytes, weight
// 2k in the low nibble of byte k; 4-byte aligned), the fast path's gate/up: as the IQ3_S kernel,
// but a warp takes one column (its gate and up rows, 2 · row_bytes bytes), 16 lanes a row, lane
// j decoding the 16-weight groups j, j + 16, … (two code words through e2m1x8_to_i8, against
// x in MQ8_NVFP4_ORDER; the int8 values are twice the E2M1 values, hence the 0.5).
// grid (ceil(inter / MQ8_WARPS), G). Needs hidden % 128 == 0 (row_bytes a multiple of 8),
// 2 · row_bytes ≤ 8 · 32 · MQ8_NVFP4_STAGE and 8-byte aligned matrices.
// Dynamic shared memory: hidden + hidden / 8 + 1024 + MQ8_WARPS · 2 · row_bytes bytes.
extern "C" __global__ void moe_dec_gate_up_nvfp4_q8(const u64* groups, const u32* rows, const float* x, float* act,
                                                    int hidden, int inter, u64 row_bytes, int interleaved) {
    KERNEL_START();
    extern __shared__ uint4 mq8_smem4[];
    unsigned char* mq8_smem = (unsigned char*)mq8_smem4;
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    signed char* xq = (signed char*)mq8_smem;
    float* step = (float*)(mq8_smem + hidden);
    float* e4m3 = step + (hidden >> 5);
    unsigned char* wbuf = (unsigned char*)(e4m3 + 256) + (u64)warp * 2 * row_bytes;
    const u64* g = groups + (u64)blockIdx.y * 6;
    const unsigned char* w = (const unsigned char*)g[0];
    const int off = (int)g[2];
    const float mult = __uint_as_float((u32)g[4]);
    const int o = blockIdx.x * MQ8_WARPS + warp;
    const bool active = o < inter;
    Mq8Stage<MQ8_NVFP4_STAGE> staged;
    if (active) {
        const unsigned char* gate = w + (u64)(interleaved ? 2 * o : o) * row_bytes;
        const unsigned char* up = interleaved ? gate + row_bytes : w + (u64)(inter + o) * row_bytes;
        staged.load(gate, (int)row_bytes, up, (int)row_bytes, lane);
    }
    for (int i = threadIdx.x; i < 256; i += blockDim.x) e4m3[i] = __uint_as_float(QT_E4M3[i]);
    mq8_quantize(x + (u64)rows[off] * hidden, hidden, xq, step, nullptr, MQ8_NVFP4_ORDER);
    if (active) staged.store(wbuf, lane);
    __syncthreads();
    if (!active) return;
    const unsigned char* row = wbuf + (u64)(lane >> 4) * row_bytes;  // gate, then up
    float acc = 0.0f;
    for (int q = lane & 15; q < (hidden >> 4); q += 16) {
        const unsigned char* blk = row + 36 * (q >> 2);
        const int sub = q & 3;
        acc = fmaf(e4m3[blk[sub]] * step[q >> 1], (float)mq8_nvfp4_dot16(blk, sub, xq + 16 * q), acc);
    }
#pragma unroll
    for (int m = 1; m < 16; m <<= 1) acc += __shfl_xor_sync(0xffffffffu, acc, m);
    const float up = __shfl_down_sync(0xffffffffu, acc, 16);
    if (lane == 0) act[(u64)off * inter + o] = silu_f(0.5f * acc * mult) * (0.5f * up * mult);
}

// NVFP4 down rows, the fast path: as the Q2_0 down kernel (8 rows a warp, 4 lanes a row), lane q
// decoding the 16 weights of scale q of each block. grid (ceil(hidden / (8 · MQ8_WARPS)), G).
// Needs hidden % 8 == 0, inter % 64 == 0, 8 · row_bytes ≤ 8 · 32 · MQ8_NVFP4_STAGE and 8-byte
// aligned matrices. Dynamic shared memory: inter + inter / 8 + 1024 + MQ8_WARPS · 8 · row_bytes.
extern "C" __global__ void moe_dec_down_nvfp4_q8(const u64* groups, const float* act, float* ys, int hidden, int inter,
                                                 u64 row_bytes) {
    KERNEL_START();
    extern __shared__ uint4 mq8_smem4[];
    unsigned char* mq8_smem = (unsigned char*)mq8_smem4;
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    signed char* xq = (signed char*)mq8_smem;
    float* step = (float*)(mq8_smem + inter);
    float* e4m3 = step + (inter >> 5);
    unsigned char* wbuf = (unsigned char*)(e4m3 + 256) + (u64)warp * 8 * row_bytes;
    const u64* g = groups + (u64)blockIdx.y * 6;
    const unsigned char* w = (const unsigned char*)g[1];
    const int off = (int)g[2];
    const float mult = __uint_as_float((u32)g[5]);
    const int o0 = 8 * (blockIdx.x * MQ8_WARPS + warp);
    const bool active = o0 < hidden;
    Mq8Stage<MQ8_NVFP4_STAGE> staged;
    const unsigned char* first = w + (u64)o0 * row_bytes;
    if (active) staged.load(first, 8 * (int)row_bytes, first, 0, lane);
    for (int i = threadIdx.x; i < 256; i += blockDim.x) e4m3[i] = __uint_as_float(QT_E4M3[i]);
    mq8_quantize(act + (u64)off * inter, inter, xq, step, nullptr, MQ8_NVFP4_ORDER);
    if (active) staged.store(wbuf, lane);
    __syncthreads();
    if (!active) return;
    const int r = lane >> 2, sub = lane & 3;
    const unsigned char* row = wbuf + (u64)r * row_bytes;
    float acc = 0.0f;
    for (int b = 0; b < (inter >> 6); b++) {
        const unsigned char* blk = row + 36 * b;
        const int q = 4 * b + sub;
        acc = fmaf(e4m3[blk[sub]] * step[q >> 1], (float)mq8_nvfp4_dot16(blk, sub, xq + 16 * q), acc);
    }
    acc += __shfl_xor_sync(0xffffffffu, acc, 1);
    acc += __shfl_xor_sync(0xffffffffu, acc, 2);
    if (sub == 0) ys[(u64)off * hidden + o0 + r] = 0.5f * acc * mult;
}
