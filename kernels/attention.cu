// Causal softmax attention of one sequence.
// - Few queries (decode): split over the KV length. `attn_split` gives, per (query, head,
//   split), the running max, the sum of exponentials and the unnormalised output over that
//   split's keys; `attn_combine` merges the splits.
// - Many queries (prefill): scores come from cuBLAS; `causal_softmax` masks and normalises
//   each row in place, then cuBLAS multiplies by V.

#define ATTN_MAX_D 256
#define ATTN_WARPS 4

// q [n, H·d], k/v [T, KVH·d]; query i sees keys 0..past+i. part_o [n, H, S, d], part_ml [n, H, S, 2].
extern "C" __global__ void attn_split(const float* q, const float* k, const float* v, float* part_o, float* part_ml, int past,
                                      int heads, int kv_heads, int d, float scale, int split_len) {
    __shared__ float sm_o[ATTN_WARPS][ATTN_MAX_D];
    __shared__ float sm_m[ATTN_WARPS], sm_l[ATTN_WARPS];
    const int h = blockIdx.x, s = blockIdx.y, i = blockIdx.z, splits = gridDim.y;
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int kvh = h / (heads / kv_heads);
    const int len = past + i + 1;
    const int t0 = s * split_len;
    const int t1 = min(t0 + split_len, len);
    const u64 qd = (u64)heads * d, kvd = (u64)kv_heads * d;
    float qv[ATTN_MAX_D / 32], acc[ATTN_MAX_D / 32];
#pragma unroll
    for (int j = 0; j < ATTN_MAX_D / 32; j++) {
        int e = lane + 32 * j;
        qv[j] = e < d ? q[i * qd + (u64)h * d + e] : 0.0f;
        acc[j] = 0.0f;
    }
    float m = -INFINITY, l = 0.0f;
    for (int t = t0 + warp; t < t1; t += ATTN_WARPS) {
        const float* kr = k + t * kvd + (u64)kvh * d;
        const float* vr = v + t * kvd + (u64)kvh * d;
        float dot = 0.0f;
#pragma unroll
        for (int j = 0; j < ATTN_MAX_D / 32; j++) {
            int e = lane + 32 * j;
            if (e < d) dot += qv[j] * kr[e];
        }
        float sc = warp_sum(dot) * scale;
        float m_new = fmaxf(m, sc);
        float corr = expf(m - m_new);
        float p = expf(sc - m_new);
        l = l * corr + p;
#pragma unroll
        for (int j = 0; j < ATTN_MAX_D / 32; j++) {
            int e = lane + 32 * j;
            if (e < d) acc[j] = acc[j] * corr + p * vr[e];
        }
        m = m_new;
    }
#pragma unroll
    for (int j = 0; j < ATTN_MAX_D / 32; j++) {
        int e = lane + 32 * j;
        if (e < d) sm_o[warp][e] = acc[j];
    }
    if (lane == 0) {
        sm_m[warp] = m;
        sm_l[warp] = l;
    }
    __syncthreads();
    float mm = -INFINITY;
    for (int w = 0; w < ATTN_WARPS; w++) mm = fmaxf(mm, sm_m[w]);
    const u64 slot = ((u64)i * heads + h) * splits + s;
    for (int e = threadIdx.x; e < d; e += blockDim.x) {
        float o = 0.0f;
        for (int w = 0; w < ATTN_WARPS; w++)
            if (sm_m[w] != -INFINITY) o += sm_o[w][e] * expf(sm_m[w] - mm);
        part_o[slot * d + e] = o;
    }
    if (threadIdx.x == 0) {
        float ll = 0.0f;
        for (int w = 0; w < ATTN_WARPS; w++)
            if (sm_m[w] != -INFINITY) ll += sm_l[w] * expf(sm_m[w] - mm);
        part_ml[slot * 2] = mm;
        part_ml[slot * 2 + 1] = ll;
    }
}

// grid (heads, n); out [n, H·d].
extern "C" __global__ void attn_combine(const float* part_o, const float* part_ml, float* out, int heads, int d, int splits) {
    const int h = blockIdx.x, i = blockIdx.y;
    const u64 base = ((u64)i * heads + h) * splits;
    float mm = -INFINITY;
    for (int s = 0; s < splits; s++) mm = fmaxf(mm, part_ml[(base + s) * 2]);
    float ll = 0.0f;
    for (int s = 0; s < splits; s++) {
        float ms = part_ml[(base + s) * 2];
        if (ms != -INFINITY) ll += part_ml[(base + s) * 2 + 1] * expf(ms - mm);
    }
    for (int e = threadIdx.x; e < d; e += blockDim.x) {
        float o = 0.0f;
        for (int s = 0; s < splits; s++) {
            float ms = part_ml[(base + s) * 2];
            if (ms != -INFINITY) o += part_o[(base + s) * d + e] * expf(ms - mm);
        }
        out[(u64)i * heads * d + (u64)h * d + e] = o / ll;
    }
}

// Online (max, sum of exp(x - max)) pairs: combining two keeps the sum relative to the larger max.
__device__ __forceinline__ void softmax_combine(float& m, float& s, float m2, float s2) {
    if (m2 == -INFINITY) return;
    if (m == -INFINITY) { m = m2; s = s2; return; }
    const float mm = fmaxf(m, m2);
    s = s * expf(m - mm) + s2 * expf(m2 - mm);
    m = mm;
}

// Row r of a head (rows_per_head rows each) sees columns 0..first_len + r; `store(t, p)` writes
// the normalised probability of column t (0 past the mask). Two passes over the row (the max and
// the sum online, then the values) instead of three: at 30K keys the scores are read from and
// written to memory, so passes are what this costs.
template <typename Store>
__device__ __forceinline__ void causal_softmax_row(const float* row, int cols, int len, Store store) {
    __shared__ float sm_m[32], sm_s[32];
    float m = -INFINITY, s = 0.0f;
    for (int t = threadIdx.x; t < len; t += blockDim.x) {
        const float x = row[t];
        if (x > m) {
            s = (m == -INFINITY ? 0.0f : s * expf(m - x)) + 1.0f;
            m = x;
        } else {
            s += expf(x - m);
        }
    }
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) {
        const float m2 = __shfl_xor_sync(0xffffffffu, m, o);
        const float s2 = __shfl_xor_sync(0xffffffffu, s, o);
        softmax_combine(m, s, m2, s2);
    }
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, warps = blockDim.x >> 5;
    if (lane == 0) { sm_m[warp] = m; sm_s[warp] = s; }
    __syncthreads();
    m = lane < warps ? sm_m[lane] : -INFINITY;
    s = lane < warps ? sm_s[lane] : 0.0f;
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) {
        const float m2 = __shfl_xor_sync(0xffffffffu, m, o);
        const float s2 = __shfl_xor_sync(0xffffffffu, s, o);
        softmax_combine(m, s, m2, s2);
    }
    const float inv = 1.0f / s;
    for (int t = threadIdx.x; t < cols; t += blockDim.x) store(t, t < len ? expf(row[t] - m) * inv : 0.0f);
}

// scores [heads · rows_per_head, cols] (already scaled), the rows of each head together,
// normalised in place.
extern "C" __global__ void causal_softmax(float* scores, int cols, int first_len, int rows_per_head) {
    float* row = scores + (u64)blockIdx.x * cols;
    const int len = min(cols, first_len + (int)(blockIdx.x % rows_per_head));
    causal_softmax_row(row, cols, len, [&](int t, float p) { row[t] = p; });
}

// As `causal_softmax`, writing the probabilities as BF16 into `probs` (the fast path's P·V runs
// on BF16 tensor cores).
extern "C" __global__ void causal_softmax_bf16(const float* scores, u16* probs, int cols, int first_len,
                                               int rows_per_head) {
    const float* row = scores + (u64)blockIdx.x * cols;
    u16* out = probs + (u64)blockIdx.x * cols;
    const int len = min(cols, first_len + (int)(blockIdx.x % rows_per_head));
    causal_softmax_row(row, cols, len, [&](int t, float p) { out[t] = f32_to_bf16(p); });
}
