// Qwen Sparse Attention (CPU reference: crates/engine/src/backend/cpu/qsa.rs).
//
// Per query at position p = past + i, `complete = (p + 1) / ratio` key blocks exist.
// 1. `qsa_block_scores`: score[i, b] = Σ_h relu(q_h · key_b) / sqrt(d) for b < complete.
// 2. `qsa_select`: while complete ≤ topk the query sees every token 0..=p; past it, the topk
//    blocks with the highest scores (ties: the lower block, as the CPU's stable sort), found by
//    a bitwise search for the topk-th largest score in IEEE total order, listed in ascending
//    block order, then the tail complete·ratio..=p. Output: a token list per query.
// 3. `qsa_attn_split` + `attn_combine` (attention.cu): softmax attention over each query's
//    token list, split over the list like the dense decode kernel.

#define QSA_MAX_D 256
#define QSA_WARPS 4

// x [blocks·group, cols] → out [blocks, cols]: the mean of each group of rows.
extern "C" __global__ void mean_pool_rows(const float* x, float* out, u64 blocks, int cols, int group) { KERNEL_START();
    const u64 n = blocks * cols;
    for (u64 i = blockIdx.x * (u64)blockDim.x + threadIdx.x; i < n; i += (u64)gridDim.x * blockDim.x) {
        const u64 b = i / cols;
        const int c = (int)(i - b * cols);
        float acc = 0.0f;
        for (int r = 0; r < group; r++) acc += x[(b * group + r) * cols + c];
        out[i] = acc / (float)group;
    }
}

// grid (ceil(stride / 8), n), 8 warps; one warp per (query, block). index_q [n, heads·d],
// keys [blocks, d], scores [n, stride].
extern "C" __global__ void qsa_block_scores(const float* index_q, const float* keys, float* scores, int past, int heads,
                                            int d, int ratio, int stride) { KERNEL_START();
    const int lane = threadIdx.x & 31;
    const int b = blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5);
    const int i = blockIdx.y;
    const int complete = (past + i + 1) / ratio;
    if (b >= complete || b >= stride) return;
    const float* q = index_q + (u64)i * heads * d;
    const float* k = keys + (u64)b * d;
    float sum = 0.0f;
    for (int h = 0; h < heads; h++) {
        float dot = 0.0f;
        for (int e = lane; e < d; e += 32) dot += q[h * d + e] * k[e];
        dot = warp_sum(dot);
        sum += fmaxf(dot, 0.0f);
    }
    if (lane == 0) scores[(u64)i * stride + b] = sum * (1.0f / sqrtf((float)d));
}

// IEEE total order as an unsigned key (Rust's f32::total_cmp, shifted to unsigned).
__device__ __forceinline__ u32 total_key(float f) {
    int x = __float_as_int(f);
    x ^= (int)(((u32)(x >> 31)) >> 1);
    return ((u32)x) ^ 0x80000000u;
}

// Exclusive prefix count of `flag` over the block's threads; `total` gets the block's count.
__device__ __forceinline__ int block_exclusive_count(int flag, int* warp_counts, int* total) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nwarps = blockDim.x >> 5;
    const unsigned ballot = __ballot_sync(0xffffffffu, flag);
    const int in_warp = __popc(ballot & ((1u << lane) - 1u));
    __syncthreads();
    if (lane == 0) warp_counts[warp] = __popc(ballot);
    __syncthreads();
    int before = 0, all = 0;
    for (int w = 0; w < nwarps; w++) {
        const int c = warp_counts[w];
        if (w < warp) before += c;
        all += c;
    }
    *total = all;
    return before + in_warp;
}

// One block per query (blockDim 256); tokens [n, cap], counts [n].
extern "C" __global__ void qsa_select(const float* scores, int* tokens, int* counts, int past, int topk, int ratio,
                                      int stride, int cap) { KERNEL_START();
    __shared__ float scratch[32];
    __shared__ int warp_counts[32];
    const int i = blockIdx.x;
    const int pos = past + i;
    const int complete = (pos + 1) / ratio;
    int* out = tokens + (u64)i * cap;
    if (complete <= topk) {
        for (int t = threadIdx.x; t <= pos; t += blockDim.x) out[t] = t;
        if (threadIdx.x == 0) counts[i] = pos + 1;
        return;
    }
    const float* row = scores + (u64)i * stride;
    // The topk-th largest key: the largest T with #{key ≥ T} ≥ topk.
    u32 thresh = 0;
    for (int bit = 31; bit >= 0; bit--) {
        const u32 cand = thresh | (1u << bit);
        float c = 0.0f;
        for (int b = threadIdx.x; b < complete; b += blockDim.x) c += total_key(row[b]) >= cand ? 1.0f : 0.0f;
        if (block_sum(c, scratch) >= (float)topk) thresh = cand;
    }
    float above = 0.0f;
    for (int b = threadIdx.x; b < complete; b += blockDim.x) above += total_key(row[b]) > thresh ? 1.0f : 0.0f;
    // Blocks equal to the threshold fill the rest, lowest index first.
    const int equal_needed = topk - (int)block_sum(above, scratch);
    int equal_before = 0, selected_before = 0;
    const int rounds = (complete + blockDim.x - 1) / blockDim.x;
    for (int rd = 0; rd < rounds; rd++) {
        const int b = rd * blockDim.x + threadIdx.x;
        const u32 key = b < complete ? total_key(row[b]) : 0u;
        const int eq = b < complete && key == thresh;
        int eq_total, sel_total;
        const int eq_rank = equal_before + block_exclusive_count(eq, warp_counts, &eq_total);
        const int sel = b < complete && (key > thresh || (eq && eq_rank < equal_needed));
        const int slot = selected_before + block_exclusive_count(sel, warp_counts, &sel_total);
        if (sel)
            for (int j = 0; j < ratio; j++) out[slot * ratio + j] = b * ratio + j;
        equal_before += eq_total;
        selected_before += sel_total;
    }
    const int tail0 = complete * ratio;
    for (int t = tail0 + threadIdx.x; t <= pos; t += blockDim.x) out[topk * ratio + (t - tail0)] = t;
    if (threadIdx.x == 0) counts[i] = topk * ratio + (pos + 1 - tail0);
}

// As attn_split (attention.cu) over each query's token list: grid (heads, splits, n), 128
// threads. q [n, H·d], k/v [T, KVH·d]; part_o [n, H, S, d], part_ml [n, H, S, 2].
extern "C" __global__ void qsa_attn_split(const float* q, const float* k, const float* v, const int* tokens,
                                          const int* counts, float* part_o, float* part_ml, int heads, int kv_heads,
                                          int d, float scale, int split_len, int cap) { KERNEL_START();
    __shared__ float sm_o[QSA_WARPS][QSA_MAX_D];
    __shared__ float sm_m[QSA_WARPS], sm_l[QSA_WARPS];
    const int h = blockIdx.x, s = blockIdx.y, i = blockIdx.z, splits = gridDim.y;
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int kvh = h / (heads / kv_heads);
    const int len = counts[i];
    const int t0 = s * split_len;
    const int t1 = min(t0 + split_len, len);
    const int* list = tokens + (u64)i * cap;
    const u64 qd = (u64)heads * d, kvd = (u64)kv_heads * d;
    float qv[QSA_MAX_D / 32], acc[QSA_MAX_D / 32];
#pragma unroll
    for (int j = 0; j < QSA_MAX_D / 32; j++) {
        int e = lane + 32 * j;
        qv[j] = e < d ? q[i * qd + (u64)h * d + e] : 0.0f;
        acc[j] = 0.0f;
    }
    float m = -INFINITY, l = 0.0f;
    for (int x = t0 + warp; x < t1; x += QSA_WARPS) {
        const u64 t = (u64)list[x];
        const float* kr = k + t * kvd + (u64)kvh * d;
        const float* vr = v + t * kvd + (u64)kvh * d;
        float dot = 0.0f;
#pragma unroll
        for (int j = 0; j < QSA_MAX_D / 32; j++) {
            int e = lane + 32 * j;
            if (e < d) dot += qv[j] * kr[e];
        }
        float sc = warp_sum(dot) * scale;
        float m_new = fmaxf(m, sc);
        float corr = expf(m - m_new);
        float p = expf(sc - m_new);
        l = l * corr + p;
#pragma unroll
        for (int j = 0; j < QSA_MAX_D / 32; j++) {
            int e = lane + 32 * j;
            if (e < d) acc[j] = acc[j] * corr + p * vr[e];
        }
        m = m_new;
    }
#pragma unroll
    for (int j = 0; j < QSA_MAX_D / 32; j++) {
        int e = lane + 32 * j;
        if (e < d) sm_o[warp][e] = acc[j];
    }
    if (lane == 0) {
        sm_m[warp] = m;
        sm_l[warp] = l;
    }
    __syncthreads();
    float mm = -INFINITY;
    for (int w = 0; w < QSA_WARPS; w++) mm = fmaxf(mm, sm_m[w]);
    const u64 slot = ((u64)i * heads + h) * splits + s;
    for (int e = threadIdx.x; e < d; e += blockDim.x) {
        float o = 0.0f;
        for (int w = 0; w < QSA_WARPS; w++)
            if (sm_m[w] != -INFINITY) o += sm_o[w][e] * expf(sm_m[w] - mm);
        part_o[slot * d + e] = o;
    }
    if (threadIdx.x == 0) {
        float ll = 0.0f;
        for (int w = 0; w < QSA_WARPS; w++)
            if (sm_m[w] != -INFINITY) ll += sm_l[w] * expf(sm_m[w] - mm);
        part_ml[slot * 2] = mm;
        part_ml[slot * 2 + 1] = ll;
    }
}
