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

// scores [rows, cols] (already scaled); row r may see columns 0..first_len + r; the rest become 0.
extern "C" __global__ void causal_softmax(float* scores, int cols, int first_len) {
    __shared__ float scratch[32];
    const int r = blockIdx.x;
    float* row = scores + (u64)r * cols;
    const int len = min(cols, first_len + r);
    float m = -INFINITY;
    for (int t = threadIdx.x; t < len; t += blockDim.x) m = fmaxf(m, row[t]);
    // block max through the sum helper's scratch: reduce per warp, then across warps
    m = warp_max(m);
    __syncthreads();
    if ((threadIdx.x & 31) == 0) scratch[threadIdx.x >> 5] = m;
    __syncthreads();
    m = (threadIdx.x & 31) < (blockDim.x >> 5) ? scratch[threadIdx.x & 31] : -INFINITY;
    m = warp_max(m);
    float sum = 0.0f;
    for (int t = threadIdx.x; t < len; t += blockDim.x) {
        float e = expf(row[t] - m);
        row[t] = e;
        sum += e;
    }
    sum = block_sum(sum, scratch);
    const float inv = 1.0f / sum;
    for (int t = threadIdx.x; t < cols; t += blockDim.x) row[t] = t < len ? row[t] * inv : 0.0f;
}
