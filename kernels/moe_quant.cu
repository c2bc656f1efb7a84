// Grouped routed experts over quantized copies (the hybrid VRAM expert cache), for decode.
// Compiled after quant_matvec.cu (its `qdecode8` and tables); the dense counterparts are
// moe.cu's `moe_gate_up` / `moe_down`, and the grouped layout is the same (moe.cu's header).
// One launch per projection covers every resident expert of a layer, each read in its stored
// blocks: a cached expert is its host record's bytes, so gate and up rows may be interleaved
// (gate 0, up 0, gate 1, …: the CPU record layout) or in halves (all gate rows, then all up).
//
// groups [G, 6] u64: gate_up pointer, down pointer, first slot, row count (≤ MOE_Q_MAX_ROWS),
// gate_up multiplier and down multiplier (f32 bits in the low half).

#define MOE_Q_MAX_ROWS 8

template <int FMT>
__device__ __forceinline__ void moe_q_gate_up_impl(const u64* groups, const u32* rows, const float* x, float* act,
                                                   int hidden, int inter, u64 row_bytes, int interleaved) {
    const int lane = threadIdx.x & 31;
    const int o = blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5);
    if (o >= inter) return;
    const u64* g = groups + (u64)blockIdx.y * 6;
    const unsigned char* w = (const unsigned char*)g[0];
    const int off = (int)g[2], cnt = (int)g[3];
    const float mult = __uint_as_float((u32)g[4]);
    const unsigned char* wg = w + (u64)(interleaved ? 2 * o : o) * row_bytes;
    const unsigned char* wu = w + (u64)(interleaved ? 2 * o + 1 : inter + o) * row_bytes;
    const float* xr[MOE_Q_MAX_ROWS];
#pragma unroll
    for (int r = 0; r < MOE_Q_MAX_ROWS; r++) xr[r] = x + (u64)rows[off + min(r, cnt - 1)] * hidden;
    float ag[MOE_Q_MAX_ROWS], au[MOE_Q_MAX_ROWS];
#pragma unroll
    for (int r = 0; r < MOE_Q_MAX_ROWS; r++) ag[r] = au[r] = 0.0f;
    const int ngroups = hidden >> 3;
    for (int q = lane; q < ngroups; q += 32) {
        float fg[8], fu[8];
        qdecode8<FMT>(wg, q, fg);
        qdecode8<FMT>(wu, q, fu);
#pragma unroll
        for (int r = 0; r < MOE_Q_MAX_ROWS; r++) {
            if (r < cnt) {
                const float4 x0 = *(const float4*)(xr[r] + 8 * q);
                const float4 x1 = *(const float4*)(xr[r] + 8 * q + 4);
                ag[r] += fg[0] * x0.x + fg[1] * x0.y + fg[2] * x0.z + fg[3] * x0.w + fg[4] * x1.x + fg[5] * x1.y +
                         fg[6] * x1.z + fg[7] * x1.w;
                au[r] += fu[0] * x0.x + fu[1] * x0.y + fu[2] * x0.z + fu[3] * x0.w + fu[4] * x1.x + fu[5] * x1.y +
                         fu[6] * x1.z + fu[7] * x1.w;
            }
        }
    }
#pragma unroll
    for (int r = 0; r < MOE_Q_MAX_ROWS; r++) {
        if (r < cnt) {
            const float gs = warp_sum(ag[r]) * mult;
            const float us = warp_sum(au[r]) * mult;
            if (lane == 0) act[(u64)(off + r) * inter + o] = silu_f(gs) * us;
        }
    }
}

template <int FMT>
__device__ __forceinline__ void moe_q_down_impl(const u64* groups, const float* act, float* ys, int hidden, int inter,
                                                u64 row_bytes) {
    const int lane = threadIdx.x & 31;
    const int o = blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5);
    if (o >= hidden) return;
    const u64* g = groups + (u64)blockIdx.y * 6;
    const unsigned char* wr = (const unsigned char*)g[1] + (u64)o * row_bytes;
    const int off = (int)g[2], cnt = (int)g[3];
    const float mult = __uint_as_float((u32)g[5]);
    float acc[MOE_Q_MAX_ROWS];
#pragma unroll
    for (int r = 0; r < MOE_Q_MAX_ROWS; r++) acc[r] = 0.0f;
    const int ngroups = inter >> 3;
    for (int q = lane; q < ngroups; q += 32) {
        float f[8];
        qdecode8<FMT>(wr, q, f);
#pragma unroll
        for (int r = 0; r < MOE_Q_MAX_ROWS; r++) {
            if (r < cnt) {
                const float* a = act + (u64)(off + r) * inter + 8 * q;
                const float4 a0 = *(const float4*)a;
                const float4 a1 = *(const float4*)(a + 4);
                acc[r] += f[0] * a0.x + f[1] * a0.y + f[2] * a0.z + f[3] * a0.w + f[4] * a1.x + f[5] * a1.y +
                          f[6] * a1.z + f[7] * a1.w;
            }
        }
    }
#pragma unroll
    for (int r = 0; r < MOE_Q_MAX_ROWS; r++) {
        if (r < cnt) {
            const float s = warp_sum(acc[r]) * mult;
            if (lane == 0) ys[(u64)(off + r) * hidden + o] = s;
        }
    }
}

#define MOE_Q_DISPATCH(CALL)                                        \
    switch (fmt) {                                                  \
        case QF_NVFP4: CALL(QF_NVFP4); break;                       \
        case QF_NVFP4R: CALL(QF_NVFP4R); break;                     \
        case QF_Q8_0: CALL(QF_Q8_0); break;                         \
        case QF_IQ3_S: CALL(QF_IQ3_S); break;                       \
        case QF_IQ3_XXS: CALL(QF_IQ3_XXS); break;                   \
        case QF_IQ2_XS: CALL(QF_IQ2_XS); break;                     \
        case QF_Q2_0: CALL(QF_Q2_0); break;                         \
        case QF_FP8: CALL(QF_FP8); break;                           \
    }

// x [n, hidden] → act [slots, inter] = silu(gate · x) · (up · x). grid (ceil(inter / warps), G);
// one warp per output column. hidden a multiple of 8 (every block format's groups).
extern "C" __global__ void moe_q_gate_up(const u64* groups, const u32* rows, const float* x, float* act, int fmt,
                                         int hidden, int inter, u64 row_bytes, int interleaved) { KERNEL_START();
#define MOE_Q_GU(F) moe_q_gate_up_impl<F>(groups, rows, x, act, hidden, inter, row_bytes, interleaved)
    MOE_Q_DISPATCH(MOE_Q_GU)
#undef MOE_Q_GU
}

// act [slots, inter] → ys [slots, hidden] = act · downᵀ per group. grid (ceil(hidden / warps), G).
extern "C" __global__ void moe_q_down(const u64* groups, const float* act, float* ys, int fmt, int hidden, int inter,
                                      u64 row_bytes) { KERNEL_START();
#define MOE_Q_D(F) moe_q_down_impl<F>(groups, act, ys, hidden, inter, row_bytes)
    MOE_Q_DISPATCH(MOE_Q_D)
#undef MOE_Q_D
}
