// Sparse MoE on the GPU (CPU reference: crates/engine/src/backend/cpu/moe.rs).
// - `moe_route`: softmax over each row's router logits, the top-k (equal probabilities: the
//   lower expert first, as the CPU's stable sort), renormalised over the top-k.
// - Routed experts, grouped by expert: the host lists, per hit expert, the batch rows routed to
//   it (slot `off .. off + cnt` of a grouped layout). Groups of at most MOE_MAX_ROWS rows run
//   the grouped matvec kernels below in one launch each (decode); larger groups run cuBLAS
//   through the backend's linear layers (prefill). `moe_combine` then sums each row's expert
//   outputs with its routing weights, in ascending expert order like the CPU.

#define MOE_MAX_ROWS 8

__device__ __forceinline__ void unpack8_bf16(uint4 v, float* f) {
    u32 w[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
    for (int i = 0; i < 4; i++) {
        f[2 * i] = __uint_as_float(w[i] << 16);
        f[2 * i + 1] = __uint_as_float(w[i] & 0xffff0000u);
    }
}

__device__ __forceinline__ void unpack8_f16(uint4 v, float* f) {
    u32 w[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
    for (int i = 0; i < 4; i++) {
        f[2 * i] = f16_to_f32((u16)(w[i] & 0xffffu));
        f[2 * i + 1] = f16_to_f32((u16)(w[i] >> 16));
    }
}

// Eight weights starting at element `e` (a multiple of 8) of a row, as f32.
__device__ __forceinline__ void load8(const void* row, int dt, int e, float* f) {
    if (dt == DT_BF16) {
        unpack8_bf16(__ldg((const uint4*)((const u16*)row + e)), f);
    } else if (dt == DT_F16) {
        unpack8_f16(__ldg((const uint4*)((const u16*)row + e)), f);
    } else {
        const float4 a = __ldg((const float4*)((const float*)row + e));
        const float4 b = __ldg((const float4*)((const float*)row + e) + 1);
        f[0] = a.x; f[1] = a.y; f[2] = a.z; f[3] = a.w;
        f[4] = b.x; f[5] = b.y; f[6] = b.z; f[7] = b.w;
    }
}

__device__ __forceinline__ int dt_size(int dt) { return dt == DT_F32 ? 4 : 2; }

// Experts a lane of the top-k warp holds: up to 32 · MOE_ROUTE_PER_LANE experts.
#define MOE_ROUTE_PER_LANE 32

#define MOE_DEVICE_MAX_K 64

// A decode row's routing kept on the device (Backend::moe_routed_on_device): the k picks
// (`ids`, `weights`, readable by every lane of the calling warp) sorted by expert, the order the
// host groups them in, written as the grouped kernels' tables: group j is expert e's one row
// (slot j), its pointers (and, with stride 6, multipliers) from `table` [experts, stride] u64.
// The combine then sums the same terms in the same order as after host grouping, so the two
// paths agree bit for bit. k ≤ MOE_DEVICE_MAX_K. Each pick's place is its rank (picks of a
// lower expert, or of the same expert earlier: a stable sort), so every lane writes its picks'
// entries at once. (One thread sorting into local arrays, in a launch of its own after the
// routing, took 11.4 µs under ncu: H200, Flash-Next's top 10, 6% of a decode step's time.)
__device__ __forceinline__ void write_device_groups(const u32* ids, const float* weights, const u64* table, int stride,
                                                    int k, u64* groups, u32* rows, u32* slots, float* sorted_weights,
                                                    int lane) {
    for (int j = lane; j < k; j += 32) {
        const u32 ej = ids[j];
        int rank = 0;
        for (int i = 0; i < k; i++) {
            const u32 ei = ids[i];
            rank += ei < ej || (ei == ej && i < j);
        }
        const u64* t = table + (u64)ej * stride;
        u64* g = groups + (u64)rank * stride;
        g[0] = t[0];
        g[1] = t[1];
        g[2] = (u64)rank;
        g[3] = 1;
        for (int c = 4; c < stride; c++) g[c] = t[c];
        rows[rank] = 0;
        slots[rank] = (u32)rank;
        sorted_weights[rank] = weights[j];
    }
}

// Where moe_route_groups writes the grouped kernels' tables (write_device_groups).
struct DeviceGroupsOut {
    const u64* table;
    int stride;
    u64* groups;
    u32* rows;
    u32* slots;
    float* sorted_weights;
};

// One block per row (256 threads). logits [n, stride] (the first `experts` columns; the router's
// output may carry more, as Flash-Next's shared-expert gate) → ids, weights [n, k]; with GROUPS
// (one row), the grouped kernels' tables instead (write_device_groups), in the same launch.
template <bool GROUPS>
__device__ __forceinline__ void moe_route_impl(const float* logits, u32* ids, float* weights, int experts, int k,
                                               int normalize, int stride, DeviceGroupsOut out) {
    __shared__ float scratch[32];
    __shared__ float top_p[64];
    __shared__ u32 top_e[64];
    extern __shared__ float probs[];  // experts floats
    const int r = blockIdx.x;
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nwarps = blockDim.x >> 5;
    const float* row = logits + (u64)r * stride;
    float m = -INFINITY;
    for (int e = threadIdx.x; e < experts; e += blockDim.x) m = fmaxf(m, row[e]);
    m = warp_max(m);
    __syncthreads();
    if (lane == 0) scratch[warp] = m;
    __syncthreads();
    m = lane < nwarps ? scratch[lane] : -INFINITY;
    m = warp_max(m);
    float s = 0.0f;
    for (int e = threadIdx.x; e < experts; e += blockDim.x) {
        const float x = expf(row[e] - m);
        probs[e] = x;
        s += x;
    }
    s = block_sum(s, scratch);
    for (int e = threadIdx.x; e < experts; e += blockDim.x) probs[e] = probs[e] / s;
    __syncthreads();
    // The top k in warp 0 alone, lane l holding experts l, l + 32, … in registers: per pick a
    // lane-local argmax and five shuffle steps, no block barrier (the block-wide argmax with two
    // barriers a pick took ~10 µs for Flash-Next's top 10 of 512). Equal values: the lower
    // expert, as before and as the CPU's stable sort. Taken experts are bits of `taken`.
    if (warp == 0) {
        float p[MOE_ROUTE_PER_LANE];
#pragma unroll
        for (int i = 0; i < MOE_ROUTE_PER_LANE; i++) {
            const int e = lane + 32 * i;
            p[i] = e < experts ? probs[e] : -2.0f;
        }
        u32 taken = 0;
        float norm = 0.0f;
        for (int j = 0; j < k; j++) {
            float bp = -2.0f;
            int be = 0x7fffffff;
#pragma unroll
            for (int i = 0; i < MOE_ROUTE_PER_LANE; i++) {
                if (!((taken >> i) & 1u) && p[i] > bp) {
                    bp = p[i];
                    be = lane + 32 * i;
                }
            }
#pragma unroll
            for (int o = 16; o > 0; o >>= 1) {
                const float op = __shfl_xor_sync(0xffffffffu, bp, o);
                const int oe = __shfl_xor_sync(0xffffffffu, be, o);
                if (op > bp || (op == bp && oe < be)) {
                    bp = op;
                    be = oe;
                }
            }
            if ((be & 31) == lane) taken |= 1u << (be >> 5);
            if (lane == j % 32) {
                top_p[j] = bp;
                top_e[j] = (u32)be;
            }
            norm += bp;
        }
        // Lane j writes pick j's weight (the same sum, in pick order, as the one-thread loop it
        // replaced).
        if (!normalize) norm = 1.0f;
        __syncwarp();
        for (int j = lane; j < k; j += 32) {
            if (GROUPS) {
                top_p[j] = top_p[j] / norm;
            } else {
                ids[(u64)r * k + j] = top_e[j];
                weights[(u64)r * k + j] = top_p[j] / norm;
            }
        }
        if (GROUPS) {
            __syncwarp();
            write_device_groups(top_e, top_p, out.table, out.stride, k, out.groups, out.rows, out.slots,
                                out.sorted_weights, lane);
        }
    }
}

extern "C" __global__ void moe_route(const float* logits, u32* ids, float* weights, int experts, int k, int normalize,
                                     int stride) { KERNEL_START();
    moe_route_impl<false>(logits, ids, weights, experts, k, normalize, stride, DeviceGroupsOut{});
}

// moe_route for one decode row (grid 1) whose picks become the grouped kernels' tables at once
// (write_device_groups, k ≤ MOE_DEVICE_MAX_K): one launch where a routing launch and a
// grouping launch reading its output back were two.
extern "C" __global__ void moe_route_groups(const float* logits, int experts, int k, int normalize, int stride,
                                            const u64* table, int table_stride, u64* groups, u32* rows, u32* slots,
                                            float* sorted_weights) { KERNEL_START();
    moe_route_impl<true>(logits, nullptr, nullptr, experts, k, normalize, stride,
                         DeviceGroupsOut{table, table_stride, groups, rows, slots, sorted_weights});
}

// groups [G, 4] u64: gate_up pointer, down pointer, first slot, row count (≤ MOE_MAX_ROWS).
// rows [slots]: the batch row of each slot. x [n, hidden] → act [slots, inter] =
// silu(gate · x) · (up · x). grid (ceil(inter / warps), G); one warp per output column.
// `interleaved`: gate_up rows alternate gate, up (the hybrid cache's copies of host records)
// instead of all gate rows then all up rows.
extern "C" __global__ void moe_gate_up(const u64* groups, const u32* rows, const float* x, float* act, int dt,
                                       int hidden, int inter, int interleaved) { KERNEL_START();
    const int lane = threadIdx.x & 31;
    const int o = blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5);
    if (o >= inter) return;
    const u64* g = groups + (u64)blockIdx.y * 4;
    const char* w = (const char*)g[0];
    const int off = (int)g[2], cnt = (int)g[3];
    const u64 es = dt_size(dt);
    const char* wg = w + (u64)(interleaved ? 2 * o : o) * hidden * es;
    const char* wu = w + (u64)(interleaved ? 2 * o + 1 : inter + o) * hidden * es;
    const float* xr[MOE_MAX_ROWS];
#pragma unroll
    for (int r = 0; r < MOE_MAX_ROWS; r++) xr[r] = x + (u64)rows[off + min(r, cnt - 1)] * hidden;
    float ag[MOE_MAX_ROWS], au[MOE_MAX_ROWS];
#pragma unroll
    for (int r = 0; r < MOE_MAX_ROWS; r++) ag[r] = au[r] = 0.0f;
    if (hidden % 8 == 0) {
        for (int e = lane * 8; e < hidden; e += 32 * 8) {
            float fg[8], fu[8];
            load8(wg, dt, e, fg);
            load8(wu, dt, e, fu);
#pragma unroll
            for (int r = 0; r < MOE_MAX_ROWS; r++) {
                if (r < cnt) {
                    const float4 x0 = *(const float4*)(xr[r] + e);
                    const float4 x1 = *(const float4*)(xr[r] + e + 4);
                    ag[r] += fg[0] * x0.x + fg[1] * x0.y + fg[2] * x0.z + fg[3] * x0.w + fg[4] * x1.x + fg[5] * x1.y +
                             fg[6] * x1.z + fg[7] * x1.w;
                    au[r] += fu[0] * x0.x + fu[1] * x0.y + fu[2] * x0.z + fu[3] * x0.w + fu[4] * x1.x + fu[5] * x1.y +
                             fu[6] * x1.z + fu[7] * x1.w;
                }
            }
        }
    } else {
        for (int e = lane; e < hidden; e += 32) {
            const float fg = load_weight(wg, dt, e), fu = load_weight(wu, dt, e);
#pragma unroll
            for (int r = 0; r < MOE_MAX_ROWS; r++)
                if (r < cnt) {
                    ag[r] += fg * xr[r][e];
                    au[r] += fu * xr[r][e];
                }
        }
    }
#pragma unroll
    for (int r = 0; r < MOE_MAX_ROWS; r++) {
        if (r < cnt) {
            const float gs = warp_sum(ag[r]);
            const float us = warp_sum(au[r]);
            if (lane == 0) act[(u64)(off + r) * inter + o] = silu_f(gs) * us;
        }
    }
}

// act [slots, inter] → ys [slots, hidden] = act · downᵀ per group. grid (ceil(hidden / warps), G).
extern "C" __global__ void moe_down(const u64* groups, const float* act, float* ys, int dt, int hidden, int inter) { KERNEL_START();
    const int lane = threadIdx.x & 31;
    const int o = blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5);
    if (o >= hidden) return;
    const u64* g = groups + (u64)blockIdx.y * 4;
    const char* w = (const char*)g[1];
    const int off = (int)g[2], cnt = (int)g[3];
    const char* wr = w + (u64)o * inter * dt_size(dt);
    float acc[MOE_MAX_ROWS];
#pragma unroll
    for (int r = 0; r < MOE_MAX_ROWS; r++) acc[r] = 0.0f;
    if (inter % 8 == 0) {
        for (int e = lane * 8; e < inter; e += 32 * 8) {
            float f[8];
            load8(wr, dt, e, f);
#pragma unroll
            for (int r = 0; r < MOE_MAX_ROWS; r++) {
                if (r < cnt) {
                    const float* a = act + (u64)(off + r) * inter + e;
                    const float4 a0 = *(const float4*)a;
                    const float4 a1 = *(const float4*)(a + 4);
                    acc[r] += f[0] * a0.x + f[1] * a0.y + f[2] * a0.z + f[3] * a0.w + f[4] * a1.x + f[5] * a1.y +
                              f[6] * a1.z + f[7] * a1.w;
                }
            }
        }
    } else {
        for (int e = lane; e < inter; e += 32) {
            const float f = load_weight(wr, dt, e);
#pragma unroll
            for (int r = 0; r < MOE_MAX_ROWS; r++)
                if (r < cnt) acc[r] += f * act[(u64)(off + r) * inter + e];
        }
    }
#pragma unroll
    for (int r = 0; r < MOE_MAX_ROWS; r++) {
        if (r < cnt) {
            const float s = warp_sum(acc[r]);
            if (lane == 0) ys[(u64)(off + r) * hidden + o] = s;
        }
    }
}

// out [cnt, cols] = x[rows[r]] (rows of one expert, for the GEMM path).
extern "C" __global__ void moe_gather_rows(const float* x, const u32* rows, float* out, u64 cnt, int cols) { KERNEL_START();
    const u64 n = cnt * cols;
    for (u64 i = blockIdx.x * (u64)blockDim.x + threadIdx.x; i < n; i += (u64)gridDim.x * blockDim.x) {
        const u64 r = i / cols;
        const int c = (int)(i - r * cols);
        out[i] = x[(u64)rows[r] * cols + c];
    }
}

// moe_gather_rows into BF16 (the grouped GEMM's activations on the fast path).
extern "C" __global__ void moe_gather_rows_bf16(const float* x, const u32* rows, u16* out, u64 cnt, int cols) { KERNEL_START();
    const u64 n = cnt * cols;
    for (u64 i = blockIdx.x * (u64)blockDim.x + threadIdx.x; i < n; i += (u64)gridDim.x * blockDim.x) {
        const u64 r = i / cols;
        const int c = (int)(i - r * cols);
        out[i] = f32_to_bf16(x[(u64)rows[r] * cols + c]);
    }
}

// gu [rows, 2·inter] → act [rows, inter] = silu(gu[:, :inter]) · gu[:, inter:].
extern "C" __global__ void moe_swiglu_halves(const float* gu, float* act, u64 rows, int inter) { KERNEL_START();
    const u64 n = rows * inter;
    for (u64 i = blockIdx.x * (u64)blockDim.x + threadIdx.x; i < n; i += (u64)gridDim.x * blockDim.x) {
        const u64 r = i / inter;
        const int j = (int)(i - r * inter);
        act[i] = silu_f(gu[r * 2 * inter + j]) * gu[r * 2 * inter + inter + j];
    }
}

// gu [rows, 2·inter] with gate and up interleaved per column pair → act [rows, inter] =
// silu(gu[:, 2j]) · gu[:, 2j + 1].
extern "C" __global__ void moe_swiglu_pairs(const float* gu, float* act, u64 rows, int inter) { KERNEL_START();
    const u64 n = rows * inter;
    for (u64 i = blockIdx.x * (u64)blockDim.x + threadIdx.x; i < n; i += (u64)gridDim.x * blockDim.x) {
        const u64 r = i / inter;
        const int j = (int)(i - r * inter);
        act[i] = silu_f(gu[r * 2 * inter + 2 * j]) * gu[r * 2 * inter + 2 * j + 1];
    }
}

// moe_swiglu_halves (pairs = 0) or moe_swiglu_pairs (pairs = 1) into BF16: the down projection's
// activations for the grouped GEMM on the fast path.
extern "C" __global__ void moe_swiglu_bf16(const float* gu, u16* act, u64 rows, int inter, int pairs) { KERNEL_START();
    const u64 n = rows * inter;
    for (u64 i = blockIdx.x * (u64)blockDim.x + threadIdx.x; i < n; i += (u64)gridDim.x * blockDim.x) {
        const u64 r = i / inter;
        const int j = (int)(i - r * inter);
        const float* g = gu + r * 2 * inter;
        const float v = pairs ? silu_f(g[2 * j]) * g[2 * j + 1] : silu_f(g[j]) * g[inter + j];
        act[i] = f32_to_bf16(v);
    }
}

// out [n, hidden]: row r = Σ_t weights[r, t] · ys[slots[r, t]] (t in the host's order: ascending
// expert); k entries per row. With `shared` ([n, hidden], the shared expert's output) it adds
// shared · sigmoid(logits[r · logit_stride + col]), the gated shared expert, in the same pass
// (Backend::moe_routed_on_device); the product is rounded before the add, as when
// moe_shared_gate and add_assign compute it.
extern "C" __global__ void moe_combine(const float* ys, const u32* slots, const float* weights, float* out, u64 n,
                                       int hidden, int k, const float* shared, const float* logits, int logit_stride,
                                       int col) { KERNEL_START();
    const u64 total = n * hidden;
    for (u64 i = blockIdx.x * (u64)blockDim.x + threadIdx.x; i < total; i += (u64)gridDim.x * blockDim.x) {
        const u64 r = i / hidden;
        const int c = (int)(i - r * hidden);
        float acc = 0.0f;
        for (int t = 0; t < k; t++) acc += ys[(u64)slots[r * k + t] * hidden + c] * weights[r * k + t];
        if (shared) acc += __fmul_rn(shared[i], sigmoid_f(logits[r * logit_stride + col]));
        out[i] = acc;
    }
}

// out [n, cols] = x · sigmoid(logits[r, col]) per row r: the shared expert's gate, one logit per
// row (the router's last column), read on the device instead of broadcast from the host.
extern "C" __global__ void moe_shared_gate(const float* x, const float* logits, float* out, u64 n, int cols,
                                           int logit_stride, int col) { KERNEL_START();
    const u64 total = n * cols;
    for (u64 i = blockIdx.x * (u64)blockDim.x + threadIdx.x; i < total; i += (u64)gridDim.x * blockDim.x) {
        const u64 r = i / cols;
        out[i] = x[i] * sigmoid_f(logits[r * logit_stride + col]);
    }
}
