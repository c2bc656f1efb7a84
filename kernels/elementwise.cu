// Element-wise and layout kernels: embedding gather, add, SwiGLU, sigmoid gate, column
// copies and splits, GDN gates, dtype conversions, RoPE, the causal depthwise conv.

extern "C" __global__ void embedding(const void* table, int dt, const u32* ids, float* out, int cols) { KERNEL_START();
    int r = blockIdx.x;
    u64 base = (u64)ids[r] * cols;
    for (int c = threadIdx.x; c < cols; c += blockDim.x) out[(u64)r * cols + c] = load_weight(table, dt, base + c);
}

extern "C" __global__ void add_assign(float* x, const float* y, u64 n) { KERNEL_START();
    for (u64 i = blockIdx.x * (u64)blockDim.x + threadIdx.x; i < n; i += (u64)gridDim.x * blockDim.x) x[i] += y[i];
}

extern "C" __global__ void silu_mul(const float* gate, const float* up, float* out, u64 n) { KERNEL_START();
    for (u64 i = blockIdx.x * (u64)blockDim.x + threadIdx.x; i < n; i += (u64)gridDim.x * blockDim.x)
        out[i] = silu_f(gate[i]) * up[i];
}

extern "C" __global__ void sigmoid_gate(const float* x, const float* gate, float* out, u64 n) { KERNEL_START();
    for (u64 i = blockIdx.x * (u64)blockDim.x + threadIdx.x; i < n; i += (u64)gridDim.x * blockDim.x)
        out[i] = x[i] * sigmoid_f(gate[i]);
}

// dst[r, c] = src[r, c0 + c] for c < ncols.
extern "C" __global__ void copy_cols(const float* src, float* dst, u64 rows, int src_cols, int c0, int ncols) { KERNEL_START();
    u64 n = rows * ncols;
    for (u64 i = blockIdx.x * (u64)blockDim.x + threadIdx.x; i < n; i += (u64)gridDim.x * blockDim.x) {
        u64 r = i / ncols;
        int c = (int)(i - r * ncols);
        dst[i] = src[r * src_cols + c0 + c];
    }
}

// Up to four consecutive column pieces in one pass: piece j is columns [b_j, b_{j+1}) of src,
// written to d_j as a [rows, b_{j+1} - b_j] matrix (unused pieces are empty ranges).
// Where every bound, the source width and every pointer allow it (split_cols4_quads), a thread
// moves four values with one 16-byte load and store per step, and indexes in 32 bits: one
// float a thread with a 64-bit division each ran a 27B prefill's splits (8192 rows, 112
// launches, 48 ms) at about 60% of the memory bandwidth. The launcher sizes the grid to match.
__device__ __forceinline__ bool aligned16(const void* p) { return ((u64)p & 15) == 0; }

extern "C" __global__ void split_cols4(const float* src, u64 rows, int src_cols, float* d0, float* d1, float* d2,
                                       float* d3, int b0, int b1, int b2, int b3, int b4) { KERNEL_START();
    const int width = b4 - b0;
    const u64 n = rows * width;
    const u64 tid = blockIdx.x * (u64)blockDim.x + threadIdx.x, stride = (u64)gridDim.x * blockDim.x;
    const bool quads = ((b0 | b1 | b2 | b3 | b4 | src_cols) & 3) == 0 && aligned16(src) && aligned16(d0) &&
                       aligned16(d1) && aligned16(d2) && aligned16(d3) && n / 4 < (1ull << 32);
    if (quads) {
        const u32 wq = (u32)width / 4, nq = (u32)(n / 4);
        for (u64 i = tid; i < nq; i += stride) {
            const u32 r = (u32)i / wq;
            const int c = b0 + 4 * (int)((u32)i - r * wq);
            const float4 v = *(const float4*)(src + (u64)r * src_cols + c);
            float* d;
            if (c < b1) d = d0 + (u64)r * (b1 - b0) + (c - b0);
            else if (c < b2) d = d1 + (u64)r * (b2 - b1) + (c - b1);
            else if (c < b3) d = d2 + (u64)r * (b3 - b2) + (c - b2);
            else d = d3 + (u64)r * (b4 - b3) + (c - b3);
            *(float4*)d = v;
        }
        return;
    }
    for (u64 i = tid; i < n; i += stride) {
        const u64 r = i / width;
        const int c = b0 + (int)(i - r * width);
        const float v = src[r * src_cols + c];
        if (c < b1) d0[r * (b1 - b0) + (c - b0)] = v;
        else if (c < b2) d1[r * (b2 - b1) + (c - b1)] = v;
        else if (c < b3) d2[r * (b3 - b2) + (c - b2)] = v;
        else d3[r * (b4 - b3) + (c - b3)] = v;
    }
}

// SwiGLU of a fused [rows, 2·inter] gate ‖ up projection: out [rows, inter] = silu(gate) · up.
// Four values a thread (16-byte loads and store, 32-bit indices) where inter is a multiple of
// 4 and the pointers are aligned, as split_cols4; the launcher sizes the grid to match.
extern "C" __global__ void silu_mul_halves(const float* gu, float* out, u64 rows, int inter) { KERNEL_START();
    const u64 n = rows * inter;
    const u64 tid = blockIdx.x * (u64)blockDim.x + threadIdx.x, stride = (u64)gridDim.x * blockDim.x;
    if ((inter & 3) == 0 && aligned16(gu) && aligned16(out) && n / 4 < (1ull << 32)) {
        const u32 iq = (u32)inter / 4, nq = (u32)(n / 4);
        for (u64 i = tid; i < nq; i += stride) {
            const u32 r = (u32)i / iq, c = (u32)i - r * iq;
            const float4* row = (const float4*)(gu + (u64)r * 2 * inter);
            const float4 g = row[c], u = row[iq + c];
            ((float4*)out)[i] = make_float4(silu_f(g.x) * u.x, silu_f(g.y) * u.y, silu_f(g.z) * u.z, silu_f(g.w) * u.w);
        }
        return;
    }
    for (u64 i = tid; i < n; i += stride) {
        const u64 r = i / inter;
        const int c = (int)(i - r * inter);
        const float* row = gu + r * 2 * inter;
        out[i] = silu_f(row[c]) * row[inter + c];
    }
}

// g = -exp(A_log) * softplus(a + dt_bias), beta = sigmoid(b); a, b, g, beta are [n, heads].
extern "C" __global__ void delta_rule_gates(const float* a, const float* b, const float* a_log, const float* dt_bias,
                                            float* g, float* beta, u64 n, int heads) { KERNEL_START();
    for (u64 i = blockIdx.x * (u64)blockDim.x + threadIdx.x; i < n; i += (u64)gridDim.x * blockDim.x) {
        int h = (int)(i % heads);
        float x = a[i] + dt_bias[h];
        float sp = x > 20.0f ? x : log1pf(expf(x));
        g[i] = -expf(a_log[h]) * sp;
        beta[i] = sigmoid_f(b[i]);
    }
}

// Four values a thread per step (one 16-byte load, one 8-byte store) where x and out are
// aligned for it: one value a thread, the prefill GEMMs' activation conversions read the 8K
// rows at about a third of the memory bandwidth (304 launches, 70 ms of a 27B prefill). The
// launcher sizes the grid for n / 4 threads; the tail (and unaligned operands) one at a time.
extern "C" __global__ void f32_to_bf16_kernel(const float* x, u16* out, u64 n) { KERNEL_START();
    const u64 tid = blockIdx.x * (u64)blockDim.x + threadIdx.x, stride = (u64)gridDim.x * blockDim.x;
    const u64 n4 = (((u64)x & 15) == 0 && ((u64)out & 7) == 0) ? n / 4 : 0;
    for (u64 i = tid; i < n4; i += stride) {
        const float4 v = ((const float4*)x)[i];
        ((uint2*)out)[i] = make_uint2((u32)f32_to_bf16(v.x) | ((u32)f32_to_bf16(v.y) << 16),
                                      (u32)f32_to_bf16(v.z) | ((u32)f32_to_bf16(v.w) << 16));
    }
    for (u64 i = 4 * n4 + tid; i < n; i += stride) out[i] = f32_to_bf16(x[i]);
}

extern "C" __global__ void f32_to_f16_kernel(const float* x, u16* out, u64 n) { KERNEL_START();
    for (u64 i = blockIdx.x * (u64)blockDim.x + threadIdx.x; i < n; i += (u64)gridDim.x * blockDim.x) out[i] = f32_to_f16(x[i]);
}

// out[i] = w[offset + i] as f32 (dequantizes a block of weight rows for the exact GEMM path).
extern "C" __global__ void weight_to_f32(const void* w, int dt, u64 offset, float* out, u64 n) { KERNEL_START();
    for (u64 i = blockIdx.x * (u64)blockDim.x + threadIdx.x; i < n; i += (u64)gridDim.x * blockDim.x) out[i] = load_weight(w, dt, offset + i);
}

// Rotate-half RoPE on the first `rotary_dim` dims of every head; one thread per (row, head, i).
extern "C" __global__ void rope(float* x, const int* positions, const float* inv_freq, u64 rows, int cols, int head_dim,
                                int rotary_dim) { KERNEL_START();
    int half = rotary_dim / 2;
    int heads = cols / head_dim;
    u64 n = rows * heads * half;
    for (u64 idx = blockIdx.x * (u64)blockDim.x + threadIdx.x; idx < n; idx += (u64)gridDim.x * blockDim.x) {
        int i = (int)(idx % half);
        u64 rh = idx / half;
        int h = (int)(rh % heads);
        u64 r = rh / heads;
        float a = inv_freq[i] * (float)positions[r];
        float c = cosf(a), s = sinf(a);
        float* head = x + r * cols + (u64)h * head_dim;
        float x1 = head[i], x2 = head[i + half];
        head[i] = x1 * c - x2 * s;
        head[i + half] = x2 * c + x1 * s;
    }
}

// Depthwise causal conv + SiLU over one sequence: x [n, C], state [K-1, C] (previous inputs,
// oldest first), weight [C, K] (tap K-1 on the current input). The conv has no recurrence, so
// every (token, channel) output is independent; inputs before the sequence come from the
// state. Taps are summed in the CPU's order (oldest first, the current input last). The state
// is updated afterwards by causal_conv1d_state.
// Taps the run kernel keeps in registers (Qwen's convolutions have 4).
#define CONV_MAX_TAPS 8
// Tokens a thread takes in turn (causal_conv1d_silu).
#define CONV_RUN 16

// grid (ceil(channels / 256), ceil(n / CONV_RUN)), 256 threads: a thread takes one channel of
// CONV_RUN consecutive tokens, its inputs sliding through registers, so that each input and
// weight is read once (a thread an output, with a 64-bit division each, read every input
// `taps` times and ran an 8K prefill's convolutions at a third of the memory bandwidth). The
// taps are summed in the same order either way; more than CONV_MAX_TAPS taps take the
// output-by-output form.
extern "C" __global__ void causal_conv1d_silu(const float* __restrict__ x, const float* __restrict__ state,
                                              const void* __restrict__ w, int dt, float* __restrict__ out, int n,
                                              int channels, int taps) { KERNEL_START();
    const int c = blockIdx.x * blockDim.x + threadIdx.x;
    const int t0 = blockIdx.y * CONV_RUN, t1 = min(t0 + CONV_RUN, n);
    if (c >= channels) return;
    // Input at position s (< 0: from the state).
    auto input = [&](int s) { return s >= 0 ? x[(u64)s * channels + c] : state[(u64)(taps - 1 + s) * channels + c]; };
    if (taps > CONV_MAX_TAPS) {
        for (int t = t0; t < t1; t++) {
            float acc = 0.0f;
            for (int j = 0; j < taps - 1; j++) acc += load_weight(w, dt, (u64)c * taps + j) * input(t - (taps - 1) + j);
            acc += load_weight(w, dt, (u64)c * taps + taps - 1) * x[(u64)t * channels + c];
            out[(u64)t * channels + c] = silu_f(acc);
        }
        return;
    }
    // win[i] holds the input at t - (CONV_MAX_TAPS - 1) + i; tap j of taps multiplies
    // win[CONV_MAX_TAPS - taps + j] (the last tap, x_t itself, is not kept).
    constexpr int W = CONV_MAX_TAPS - 1;
    const int first = CONV_MAX_TAPS - taps;
    float wt[CONV_MAX_TAPS], win[W];
#pragma unroll
    for (int i = 0; i < CONV_MAX_TAPS; i++) wt[i] = i >= first ? load_weight(w, dt, (u64)c * taps + (i - first)) : 0.0f;
#pragma unroll
    for (int i = 0; i < W; i++) win[i] = i >= first ? input(t0 - W + i) : 0.0f;
    for (int t = t0; t < t1; t++) {
        const float xt = x[(u64)t * channels + c];
        float acc = 0.0f;
#pragma unroll
        for (int i = 0; i < W; i++)
            if (i >= first) acc += wt[i] * win[i];
        acc += wt[W] * xt;
        out[(u64)t * channels + c] = silu_f(acc);
#pragma unroll
        for (int i = 0; i < W - 1; i++) win[i] = win[i + 1];
        win[W - 1] = xt;
    }
}

// causal_conv1d_silu and causal_conv1d_state in one launch, for a few tokens (decode): one
// thread per channel computes that channel's outputs (taps summed in the same order), then
// shifts the channel's state; no other thread touches the channel, so no ordering is needed.
extern "C" __global__ void causal_conv1d_silu_update(const float* __restrict__ x, float* state,
                                                     const void* __restrict__ w, int dt, float* __restrict__ out,
                                                     int n, int channels, int taps) { KERNEL_START();
    const int c = blockIdx.x * blockDim.x + threadIdx.x;
    if (c >= channels) return;
    for (int t = 0; t < n; t++) {
        float acc = 0.0f;
        for (int j = 0; j < taps - 1; j++) {
            const int s = t - (taps - 1) + j;
            const float in = s >= 0 ? x[(u64)s * channels + c] : state[(u64)(taps - 1 + s) * channels + c];
            acc += load_weight(w, dt, (u64)c * taps + j) * in;
        }
        acc += load_weight(w, dt, (u64)c * taps + taps - 1) * x[(u64)t * channels + c];
        out[(u64)t * channels + c] = silu_f(acc);
    }
    for (int j = 0; j < taps - 1; j++) {
        const int s = n - (taps - 1) + j;
        state[(u64)j * channels + c] = s >= 0 ? x[(u64)s * channels + c] : state[(u64)(j + n) * channels + c];
    }
}

// After causal_conv1d_silu (stream order): state [K-1, C] ← the last K-1 inputs (state rows
// then x rows). Row j takes input position n-(K-1)+j; rows read from the state come from a
// higher row (j + n), so walking j upwards in one thread never reads an overwritten row.
extern "C" __global__ void causal_conv1d_state(const float* __restrict__ x, float* state, int n, int channels,
                                               int taps) { KERNEL_START();
    const int c = blockIdx.x * blockDim.x + threadIdx.x;
    if (c >= channels) return;
    for (int j = 0; j < taps - 1; j++) {
        const int s = n - (taps - 1) + j;
        state[(u64)j * channels + c] = s >= 0 ? x[(u64)s * channels + c] : state[(u64)(j + n) * channels + c];
    }
}

// One row of n values (n % 32 == 0, one thread each) with its int8 copy for the next matvec
// (warp_store_q8r): the fast path's versions of sigmoid_gate and silu_mul_halves.
extern "C" __global__ void sigmoid_gate_q8(const float* x, const float* gate, float* out, int n, unsigned char* xq,
                                           float* xs) { KERNEL_START();
    const int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= n) return;  // whole warps, as n % 32 == 0
    const float o = x[i] * sigmoid_f(gate[i]);
    out[i] = o;
    warp_store_q8r(o, (u32)(i >> 5), n, xq, xs);
}

extern "C" __global__ void silu_mul_halves_q8(const float* gu, float* out, int inter, unsigned char* xq, float* xs) { KERNEL_START();
    const int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= inter) return;
    const float o = silu_f(gu[i]) * gu[inter + i];
    out[i] = o;
    warp_store_q8r(o, (u32)(i >> 5), inter, xq, xs);
}

// One decode row of a GDN layer's input side (Backend::gdn_decode_inputs), from the fused
// projection row `proj` = qkv [channels] ‖ z [v_dim] ‖ b [heads] ‖ a [heads]: thread i below
// `channels` runs the causal conv of channel i and shifts its state (as
// causal_conv1d_silu_update for one row), the next v_dim threads copy z, the last `heads`
// threads compute the gates (as delta_rule_gates). One launch instead of split_cols4,
// delta_rule_gates and causal_conv1d_silu_update.
extern "C" __global__ void gdn_decode_inputs(const float* __restrict__ proj, float* __restrict__ state,
                                             const void* __restrict__ w, int dt, int taps, int channels, int v_dim,
                                             int heads, const float* __restrict__ a_log,
                                             const float* __restrict__ dt_bias, float* __restrict__ conv_out,
                                             float* __restrict__ z, float* __restrict__ g,
                                             float* __restrict__ beta) { KERNEL_START();
    const int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < channels) {
        const int c = i;
        float acc = 0.0f;
        for (int j = 0; j < taps - 1; j++) acc += load_weight(w, dt, (u64)c * taps + j) * state[(u64)j * channels + c];
        const float x = proj[c];
        acc += load_weight(w, dt, (u64)c * taps + taps - 1) * x;
        conv_out[c] = silu_f(acc);
        for (int j = 0; j + 1 < taps - 1; j++) state[(u64)j * channels + c] = state[(u64)(j + 1) * channels + c];
        if (taps > 1) state[(u64)(taps - 2) * channels + c] = x;
    } else if (i < channels + v_dim) {
        z[i - channels] = proj[i];
    } else if (i < channels + v_dim + heads) {
        const int h = i - channels - v_dim;
        const float x = proj[channels + v_dim + heads + h] + dt_bias[h];
        const float sp = x > 20.0f ? x : log1pf(expf(x));
        g[h] = -expf(a_log[h]) * sp;
        beta[h] = sigmoid_f(proj[channels + v_dim + h]);
    }
}
