// Flash-Next row ops: hyper-connection mixers (read-out and write-back), the per-column scale
// of the wide norms, the scaled SiLU of the mixer's low-rank path, and the PLE gate.
// CPU reference: crates/engine/src/backend/cpu/hyper.rs (same summation order where a loop
// runs over streams; reductions over the hidden size use a block tree).

// out[r, c] = x[r, c] · scale[c]
extern "C" __global__ void scale_cols(const float* x, const float* scale, float* out, u64 n, int cols) { KERNEL_START();
    for (u64 i = blockIdx.x * (u64)blockDim.x + threadIdx.x; i < n; i += (u64)gridDim.x * blockDim.x)
        out[i] = x[i] * scale[i % cols];
}

// out [rows, cols] = silu(x[:, col0 .. col0 + cols] · scale), x's rows `x_stride` apart (the
// mixer's low-rank columns read in place from the fused projection).
extern "C" __global__ void silu_scaled(const float* x, float* out, u64 rows, int cols, int x_stride, int col0,
                                       float scale) { KERNEL_START();
    const u64 n = rows * cols;
    for (u64 i = blockIdx.x * (u64)blockDim.x + threadIdx.x; i < n; i += (u64)gridDim.x * blockDim.x) {
        const u64 r = i / cols;
        out[i] = silu_f(x[r * x_stride + col0 + (int)(i - r * cols)] * scale);
    }
}

// Both mixers move four values a thread, indexed in 32 bits, where h is a multiple of 4 and the
// pointers are 16-byte aligned (`hc_quads`; the launcher sizes the grid to match): a float a
// thread with two 64-bit divisions each ran an 8K Flash-Next prefill's hc_inject at ~45% of
// the memory bandwidth (0.5 ms a launch on an H100), and one sigmoid a value where a row's
// stream needs one.
__device__ __forceinline__ bool hc_quads(int h, u64 n, const void* a, const void* b, const void* c) {
    return (h & 3) == 0 && ((((u64)a) | ((u64)b) | ((u64)c)) & 15) == 0 && n / 4 < (1ull << 32);
}

// normed, mix [rows, streams·h] → out [rows, h]: the mean over streams of sigmoid(mix)·normed.
extern "C" __global__ void hc_mix(const float* normed, const float* mix, float* out, u64 rows, int h, int streams) { KERNEL_START();
    const u64 n = rows * h;
    const u64 tid = blockIdx.x * (u64)blockDim.x + threadIdx.x, stride = (u64)gridDim.x * blockDim.x;
    if (hc_quads(h, n, normed, mix, out)) {
        const u32 hq = (u32)h / 4, nq = (u32)(n / 4);
        for (u64 i = tid; i < nq; i += stride) {
            const u32 r = (u32)i / hq, j = (u32)i - r * hq;
            float4 acc = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
            for (int s = 0; s < streams; s++) {
                const u64 at = ((u64)r * streams + s) * hq + j;
                const float4 m = ((const float4*)mix)[at], x = ((const float4*)normed)[at];
                acc.x += sigmoid_f(m.x) * x.x;
                acc.y += sigmoid_f(m.y) * x.y;
                acc.z += sigmoid_f(m.z) * x.z;
                acc.w += sigmoid_f(m.w) * x.w;
            }
            const float count = (float)streams;
            ((float4*)out)[i] = make_float4(acc.x / count, acc.y / count, acc.z / count, acc.w / count);
        }
        return;
    }
    for (u64 i = tid; i < n; i += stride) {
        const u64 r = i / h;
        const int j = (int)(i - r * h);
        float acc = 0.0f;
        for (int s = 0; s < streams; s++) {
            const u64 at = (r * streams + s) * h + j;
            acc += sigmoid_f(mix[at]) * normed[at];
        }
        out[i] = acc / (float)streams;
    }
}

// res [rows, streams·h] = residual + out[r] · 2·sigmoid(logits[r, col0 + s] / streams) on stream
// s, the logits' rows `logit_stride` apart (read in place from the mixer's fused projection).
extern "C" __global__ void hc_inject(const float* residual, const float* out, const float* logits, float* res, u64 rows,
                                     int h, int streams, int logit_stride, int col0) { KERNEL_START();
    const u64 n = rows * streams * h;
    const u64 tid = blockIdx.x * (u64)blockDim.x + threadIdx.x, stride = (u64)gridDim.x * blockDim.x;
    if (hc_quads(h, n, residual, out, res)) {
        const u32 hq = (u32)h / 4, nq = (u32)(n / 4);
        for (u64 i = tid; i < nq; i += stride) {
            const u32 rs = (u32)i / hq, j = (u32)i - rs * hq;
            const u32 r = rs / (u32)streams, s = rs - r * (u32)streams;
            const float w = 2.0f * sigmoid_f(logits[(u64)r * logit_stride + col0 + s] / (float)streams);
            const float4 x = ((const float4*)residual)[i], o = ((const float4*)out)[(u64)r * hq + j];
            ((float4*)res)[i] = make_float4(x.x + o.x * w, x.y + o.y * w, x.z + o.z * w, x.w + o.w * w);
        }
        return;
    }
    for (u64 i = tid; i < n; i += stride) {
        const u64 rs = i / h;
        const int j = (int)(i - rs * h);
        const u64 r = rs / streams;
        const int s = (int)(rs - r * streams);
        const float w = 2.0f * sigmoid_f(logits[r * logit_stride + col0 + s] / (float)streams);
        res[i] = residual[i] + out[r * h + j] * w;
    }
}

// One block per (row, stream): g = <key, query> / sqrt(h), g ← sign(g)·sqrt(max(|g|, 1e-6)),
// out = sigmoid(g) · value[row].
extern "C" __global__ void ple_gate(const float* key, const float* query, const float* value, float* out, int h,
                                    int streams) { KERNEL_START();
    __shared__ float scratch[32];
    const u64 rs = blockIdx.x;
    const u64 r = rs / streams;
    const float* k = key + rs * h;
    const float* q = query + rs * h;
    float dot = 0.0f;
    for (int j = threadIdx.x; j < h; j += blockDim.x) dot += k[j] * q[j];
    const float g = block_sum(dot, scratch) * (1.0f / sqrtf((float)h));
    const float sign = g > 0.0f ? 1.0f : (g < 0.0f ? -1.0f : 0.0f);
    const float gate = sigmoid_f(sqrtf(fmaxf(fabsf(g), 1e-6f)) * sign);
    for (int j = threadIdx.x; j < h; j += blockDim.x) out[rs * h + j] = gate * value[r * h + j];
}
