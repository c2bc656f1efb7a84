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

// R: the rows a group may hold (1 for a decode step, where every group has one row: its own
// kernel, registers and twice the loads in flight; MOE_Q_MAX_ROWS otherwise).
template <int FMT, int R>
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
    const float* xr[R];
#pragma unroll
    for (int r = 0; r < R; r++) xr[r] = x + (u64)rows[off + min(r, cnt - 1)] * hidden;
    float ag[R], au[R];
#pragma unroll
    for (int r = 0; r < R; r++) ag[r] = au[r] = 0.0f;
    const int ngroups = hidden >> 3;
#pragma unroll (R == 1 ? 2 : 1)
    for (int q = lane; q < ngroups; q += 32) {
        float fg[8], fu[8];
        qdecode8<FMT>(wg, q, fg);
        qdecode8<FMT>(wu, q, fu);
#pragma unroll
        for (int r = 0; r < R; r++) {
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
    for (int r = 0; r < R; r++) {
        if (r < cnt) {
            const float gs = warp_sum(ag[r]) * mult;
            const float us = warp_sum(au[r]) * mult;
            if (lane == 0) act[(u64)(off + r) * inter + o] = silu_f(gs) * us;
        }
    }
}

// A warp takes MOE_Q_DOWN_RPW output rows; R as for gate_up. Measured under ncu on an H100
// (Flash-Next IQ3_S / Q2_0 experts, one decode row): 4 rows a warp took 37 µs a layer against
// 27 with one, since the kernel waits on dependent loads and a quarter of the warps hides less
// of it; so one row a warp (the 27 µs were before the one-row path R = 1).
#define MOE_Q_DOWN_RPW 1
template <int FMT, int R>
__device__ __forceinline__ void moe_q_down_impl(const u64* groups, const float* act, float* ys, int hidden, int inter,
                                                u64 row_bytes) {
    const int lane = threadIdx.x & 31;
    const int o0 = (blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5)) * MOE_Q_DOWN_RPW;
    if (o0 >= hidden) return;
    const u64* g = groups + (u64)blockIdx.y * 6;
    const unsigned char* w = (const unsigned char*)g[1];
    const int off = (int)g[2], cnt = (int)g[3];
    const float mult = __uint_as_float((u32)g[5]);
    float acc[MOE_Q_DOWN_RPW][R];
#pragma unroll
    for (int k = 0; k < MOE_Q_DOWN_RPW; k++)
#pragma unroll
        for (int r = 0; r < R; r++) acc[k][r] = 0.0f;
    const int ngroups = inter >> 3;
    for (int q = lane; q < ngroups; q += 32) {
        float a[R][8];
#pragma unroll
        for (int r = 0; r < R; r++) {
            if (r < cnt) {
                const float4* ap = (const float4*)(act + (u64)(off + r) * inter + 8 * q);
                const float4 a0 = ap[0], a1 = ap[1];
                a[r][0] = a0.x; a[r][1] = a0.y; a[r][2] = a0.z; a[r][3] = a0.w;
                a[r][4] = a1.x; a[r][5] = a1.y; a[r][6] = a1.z; a[r][7] = a1.w;
            }
        }
#pragma unroll
        for (int k = 0; k < MOE_Q_DOWN_RPW; k++) {
            if (o0 + k < hidden) {
                float f[8];
                qdecode8<FMT>(w + (u64)(o0 + k) * row_bytes, q, f);
#pragma unroll
                for (int r = 0; r < R; r++) {
                    if (r < cnt)
                        acc[k][r] += f[0] * a[r][0] + f[1] * a[r][1] + f[2] * a[r][2] + f[3] * a[r][3] +
                                     f[4] * a[r][4] + f[5] * a[r][5] + f[6] * a[r][6] + f[7] * a[r][7];
                }
            }
        }
    }
#pragma unroll
    for (int k = 0; k < MOE_Q_DOWN_RPW; k++) {
#pragma unroll
        for (int r = 0; r < R; r++) {
            if (r < cnt) {
                const float s = warp_sum(acc[k][r]) * mult;
                if (lane == 0 && o0 + k < hidden) ys[(u64)(off + r) * hidden + o0 + k] = s;
            }
        }
    }
}

#define MOE_Q_DISPATCH(CALL)                                        \
    switch (fmt) {                                                  \
        case QF_NVFP4: CALL(QF_NVFP4); break;                       \
        case QF_NVFP4R: CALL(QF_NVFP4R); break;                     \
        case QF_Q8_0: CALL(QF_Q8_0); break;                         \
        case QF_IQ3_S: CALL(QF_IQ3_S); break;                       \
        case QF_IQ3SR: CALL(QF_IQ3SR); break;                       \
        case QF_IQ3_XXS: CALL(QF_IQ3_XXS); break;                   \
        case QF_IQ2_XS: CALL(QF_IQ2_XS); break;                     \
        case QF_Q2_0: CALL(QF_Q2_0); break;                         \
        case QF_FP8: CALL(QF_FP8); break;                           \
    }

// x [n, hidden] → act [slots, inter] = silu(gate · x) · (up · x). grid (ceil(inter / warps), G);
// one warp per output column. hidden a multiple of 8 (every block format's groups). Groups of
// up to MOE_Q_MAX_ROWS rows.
extern "C" __global__ void moe_q_gate_up(const u64* groups, const u32* rows, const float* x, float* act, int fmt,
                                         int hidden, int inter, u64 row_bytes, int interleaved) { KERNEL_START();
#define MOE_Q_GU(F) moe_q_gate_up_impl<F, MOE_Q_MAX_ROWS>(groups, rows, x, act, hidden, inter, row_bytes, interleaved)
    MOE_Q_DISPATCH(MOE_Q_GU)
#undef MOE_Q_GU
}

// The same where every group has one row (every decode step): a kernel of its own, because a
// kernel's registers are those of its largest path. Within moe_q_gate_up the one-row code had
// the eight-row code's 123 registers (a quarter of an SM's warps resident, for a kernel that
// waits on dependent loads); alone it takes 64, and moe_q_down_1 40 instead of 128.
extern "C" __global__ void moe_q_gate_up_1(const u64* groups, const u32* rows, const float* x, float* act, int fmt,
                                           int hidden, int inter, u64 row_bytes, int interleaved) { KERNEL_START();
#define MOE_Q_GU1(F) moe_q_gate_up_impl<F, 1>(groups, rows, x, act, hidden, inter, row_bytes, interleaved)
    MOE_Q_DISPATCH(MOE_Q_GU1)
#undef MOE_Q_GU1
}

// act [slots, inter] → ys [slots, hidden] = act · downᵀ per group.
// grid (ceil(hidden / (warps · MOE_Q_DOWN_RPW)), G).
extern "C" __global__ void moe_q_down(const u64* groups, const float* act, float* ys, int fmt, int hidden, int inter,
                                      u64 row_bytes) { KERNEL_START();
#define MOE_Q_D(F) moe_q_down_impl<F, MOE_Q_MAX_ROWS>(groups, act, ys, hidden, inter, row_bytes)
    MOE_Q_DISPATCH(MOE_Q_D)
#undef MOE_Q_D
}

// moe_q_down where every group has one row (see moe_q_gate_up_1).
extern "C" __global__ void moe_q_down_1(const u64* groups, const float* act, float* ys, int fmt, int hidden, int inter,
                                        u64 row_bytes) { KERNEL_START();
#define MOE_Q_D1(F) moe_q_down_impl<F, 1>(groups, act, ys, hidden, inter, row_bytes)
    MOE_Q_DISPATCH(MOE_Q_D1)
#undef MOE_Q_D1
}

// Prefill's grouped experts (flash_next.rs, moe_grouped_gemm): one launch widens the same
// matrix of every expert of a chunk into out [G, rows, cols] (f32, or BF16 with out_bf16), for
// one grouped GEMM. table [G, 2] u64: the matrix's pointer, its multiplier (f32 bits in the low
// half). grid (blocks, G); each block row grid-strides over one expert's rows × (cols / 8).
extern "C" __global__ void moe_q_dequant(const u64* table, int fmt, int rows, int cols, u64 row_bytes, void* out,
                                         int out_bf16) { KERNEL_START();
    const u64* t = table + (u64)blockIdx.y * 2;
    const unsigned char* w = (const unsigned char*)t[0];
    const float mult = __uint_as_float((u32)t[1]);
    const u64 elems = (u64)rows * cols * (out_bf16 ? 2 : 4);
    void* o = (unsigned char*)out + (u64)blockIdx.y * elems;
#define MOE_Q_DQ(F) dequant_rows_impl<F>(w, nullptr, 0, rows, cols, row_bytes, mult, o, out_bf16)
    MOE_Q_DISPATCH(MOE_Q_DQ)
#undef MOE_Q_DQ
}
