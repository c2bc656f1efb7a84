// Qwen Sparse Attention (CPU reference: crates/engine/src/backend/cpu/qsa.rs).
//
// Per query at position p = past + i, `complete = (p + 1) / ratio` key blocks exist.
// 1. `qsa_block_scores`: score[i, b] = Σ_h relu(q_h · key_b) / sqrt(d) for b < complete.
// 2. `qsa_select`: while complete ≤ topk the query sees every token 0..=p; past it, the topk
//    blocks with the highest scores (ties: the lower block, as the CPU's stable sort), found by
//    a bitwise search for the topk-th largest score in IEEE total order, listed in ascending
//    block order, then the tail complete·ratio..=p. Output: a token list per query.
// 3. `qsa_attn_split` + `attn_combine` (attention.cu): softmax attention over each query's
//    token list, split over the list like the dense decode kernel (decode: few queries);
//    prefill: `qsa_token_mask` turns the lists into a block bitmap per query, and the dense
//    GEMM attention (cuBLAS scores, attention.cu `causal_softmax` with that mask, cuBLAS P·V)
//    attends over exactly those tokens on tensor cores.

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

// grid (ceil(stride / 8), n), 8 warps: a warp a (query, block), for a few queries (decode),
// where qsa_block_scores' tiles would be mostly padding. index_q [n, heads·d], keys [blocks, d],
// scores [n, stride], as qsa_block_scores.
extern "C" __global__ void qsa_block_scores_rows(const float* index_q, const float* keys, float* scores, int past,
                                                 int heads, int d, int ratio, int stride) { KERNEL_START();
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

// Tile of qsa_block_scores: QSA_TQ queries × QSA_TB key blocks a CTA of 128 threads, each
// thread 4 × 4 of them; the queries' and keys' dimensions staged QSA_TD at a time.
#define QSA_TQ 32
#define QSA_TB 64
#define QSA_TD 32

// grid (ceil(stride / QSA_TB), ceil(n / QSA_TQ)), 128 threads. index_q [n, heads·d] (queries at
// positions past …), keys [blocks, d], scores [n, stride]: score[i, b] for b < (past + i + 1) /
// ratio (and < stride); other entries are left as they are.
// Why tiled: with a warp per (query, block) and a shuffle reduction per head, an 8K prefill's
// indexer took 4.5 ms a layer on an H100 (~2 TFLOP/s). Here each staged value is used 4 times
// from registers and each (query, block) pair sums its dimensions in order with FMAs.
extern "C" __global__ void __launch_bounds__(128) qsa_block_scores(const float* index_q, const float* keys, float* scores,
                                                                   int n, int past, int heads, int d, int ratio,
                                                                   int stride) { KERNEL_START();
    // Transposed ([dimension][query or block]) so that a thread reads its 4 as one float4;
    // rows padded by 4 floats.
    __align__(16) __shared__ float qs[QSA_TD][QSA_TQ + 4];
    __align__(16) __shared__ float ks[QSA_TD][QSA_TB + 4];
    const int tid = threadIdx.x;
    const int i0 = blockIdx.y * QSA_TQ, b0 = blockIdx.x * QSA_TB;
    const int i_last = min(i0 + QSA_TQ, n) - 1;
    // Blocks complete for the CTA's last query: the keys that exist, and past them no score.
    const int blocks = min((past + i_last + 1) / ratio, stride);
    if (b0 >= blocks) return;
    const int tq = tid / 16, tb = tid % 16;
    float sum[4][4];
#pragma unroll
    for (int a = 0; a < 4; a++)
#pragma unroll
        for (int b = 0; b < 4; b++) sum[a][b] = 0.0f;
    for (int h = 0; h < heads; h++) {
        float dot[4][4];
#pragma unroll
        for (int a = 0; a < 4; a++)
#pragma unroll
            for (int b = 0; b < 4; b++) dot[a][b] = 0.0f;
        for (int e0 = 0; e0 < d; e0 += QSA_TD) {
            // Coalesced along the dimension: lane = dimension, warps over rows; zeros past the
            // queries, the blocks and d.
            const int c = tid % QSA_TD, e = e0 + c;
            for (int r = tid / QSA_TD; r < QSA_TQ; r += 128 / QSA_TD) {
                const int i = i0 + r;
                qs[c][r] = i < n && e < d ? index_q[(u64)i * heads * d + h * d + e] : 0.0f;
            }
            for (int r = tid / QSA_TD; r < QSA_TB; r += 128 / QSA_TD) {
                const int b = b0 + r;
                ks[c][r] = b < blocks && e < d ? keys[(u64)b * d + e] : 0.0f;
            }
            __syncthreads();
#pragma unroll 8
            for (int j = 0; j < QSA_TD; j++) {
                const float4 q = *(const float4*)&qs[j][4 * tq];
                const float4 k = *(const float4*)&ks[j][4 * tb];
                const float qv[4] = {q.x, q.y, q.z, q.w}, kv[4] = {k.x, k.y, k.z, k.w};
#pragma unroll
                for (int a = 0; a < 4; a++)
#pragma unroll
                    for (int b = 0; b < 4; b++) dot[a][b] = fmaf(qv[a], kv[b], dot[a][b]);
            }
            __syncthreads();
        }
#pragma unroll
        for (int a = 0; a < 4; a++)
#pragma unroll
            for (int b = 0; b < 4; b++) sum[a][b] += fmaxf(dot[a][b], 0.0f);
    }
    const float inv = 1.0f / sqrtf((float)d);
#pragma unroll
    for (int a = 0; a < 4; a++) {
        const int i = i0 + 4 * tq + a;
        if (i >= n) continue;
        const int complete = min((past + i + 1) / ratio, stride);
#pragma unroll
        for (int b = 0; b < 4; b++) {
            const int blk = b0 + 4 * tb + b;
            if (blk < complete) scores[(u64)i * stride + blk] = sum[a][b] * inv;
        }
    }
}

// IEEE total order as an unsigned key (Rust's f32::total_cmp, shifted to unsigned).
__device__ __forceinline__ u32 total_key(float f) {
    int x = __float_as_int(f);
    x ^= (int)(((u32)(x >> 31)) >> 1);
    return ((u32)x) ^ 0x80000000u;
}

// Exclusive prefix sum of `v` over the block's threads (in thread order); `total` gets the
// block's sum. `warp_sums` holds 32 ints; two barriers, so it may be called again at once.
__device__ __forceinline__ int block_exclusive_sum(int v, int* warp_sums, int* total) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nwarps = blockDim.x >> 5;
    int incl = v;
#pragma unroll
    for (int o = 1; o < 32; o <<= 1) {
        const int y = __shfl_up_sync(0xffffffffu, incl, o);
        if (lane >= o) incl += y;
    }
    if (lane == 31) warp_sums[warp] = incl;
    __syncthreads();
    int before = 0, all = 0;
    for (int w = 0; w < nwarps; w++) {
        const int c = warp_sums[w];
        if (w < warp) before += c;
        all += c;
    }
    __syncthreads();
    *total = all;
    return before + incl - v;
}

// One block per query (blockDim 256); tokens [n, cap], counts [n].
// The topk-th largest key T (keys: total_key of the scores) by radix select, 8 bits a pass from
// the top: a pass counts the candidates' digits in a shared histogram, then warp 0 finds the
// digit where the count from the top reaches the keys still wanted. Four passes of three
// barriers, where a bitwise search took 32 block sums (64 barriers, ~28 µs a query at 8K).
// Then each thread lists its contiguous run of blocks: those above T, and of those equal to T
// the lowest-indexed ones still needed (ranks from a block prefix sum), in ascending order.
extern "C" __global__ void qsa_select(const float* scores, int* tokens, int* counts, int past, int topk, int ratio,
                                      int stride, int cap) { KERNEL_START();
    __shared__ int hist[256];
    __shared__ int warp_sums[32];
    __shared__ int found[2];
    const int i = blockIdx.x, tid = threadIdx.x, lane = tid & 31;
    const int pos = past + i;
    const int complete = (pos + 1) / ratio;
    int* out = tokens + (u64)i * cap;
    if (complete <= topk) {
        for (int t = tid; t <= pos; t += blockDim.x) out[t] = t;
        if (tid == 0) counts[i] = pos + 1;
        return;
    }
    const float* row = scores + (u64)i * stride;
    const int per = (complete + blockDim.x - 1) / blockDim.x;
    const int b0 = min(tid * per, complete), b1 = min(b0 + per, complete);
    u32 prefix = 0, mask = 0;
    int wanted = topk;  // keys ≥ the prefix still to take, counting down the ones above it
    if (topk <= 0) prefix = 0xffffffffu;  // nothing above it, none equal wanted: no blocks
    for (int shift = 24; shift >= 0 && topk > 0; shift -= 8) {
        for (int d = tid; d < 256; d += blockDim.x) hist[d] = 0;
        __syncthreads();
        for (int b = b0; b < b1; b++) {
            const u32 key = total_key(row[b]);
            if ((key & mask) == prefix) atomicAdd(&hist[(key >> shift) & 255u], 1);
        }
        __syncthreads();
        if (tid < 32) {
            // Lane l takes digits 255 − 8l down to 248 − 8l: counts from the top in lane order.
            int c[8], sum = 0;
#pragma unroll
            for (int j = 0; j < 8; j++) sum += c[j] = hist[255 - 8 * lane - j];
            int incl = sum;
#pragma unroll
            for (int o = 1; o < 32; o <<= 1) {
                const int y = __shfl_up_sync(0xffffffffu, incl, o);
                if (lane >= o) incl += y;
            }
            int above = incl - sum;  // candidates with a higher digit than this lane's first
            if (above < wanted && incl >= wanted) {
#pragma unroll
                for (int j = 0; j < 8; j++) {
                    if (above < wanted && above + c[j] >= wanted) {
                        found[0] = 255 - 8 * lane - j;
                        found[1] = wanted - above;
                    }
                    above += c[j];
                }
            }
        }
        __syncthreads();
        prefix |= (u32)found[0] << shift;
        mask |= 255u << shift;
        wanted = found[1];
        // found and hist are rewritten only after the next pass's first barrier.
    }
    const u32 thresh = prefix;
    const int equal_needed = wanted;  // keys equal to T to take, lowest blocks first
    int eq = 0;
    for (int b = b0; b < b1; b++) eq += total_key(row[b]) == thresh;
    int eq_total, sel_total;
    int eq_rank = block_exclusive_sum(eq, warp_sums, &eq_total);
    int sel = 0;
    for (int b = b0, r = eq_rank; b < b1; b++) {
        const u32 key = total_key(row[b]);
        sel += key > thresh || (key == thresh && r++ < equal_needed);
    }
    int slot = block_exclusive_sum(sel, warp_sums, &sel_total);
    for (int b = b0; b < b1; b++) {
        const u32 key = total_key(row[b]);
        if (key > thresh || (key == thresh && eq_rank++ < equal_needed)) {
            for (int j = 0; j < ratio; j++) out[slot * ratio + j] = b * ratio + j;
            slot++;
        }
    }
    const int tail0 = complete * ratio;
    for (int t = tail0 + tid; t <= pos; t += blockDim.x) out[topk * ratio + (t - tail0)] = t;
    if (tid == 0) counts[i] = topk * ratio + (pos + 1 - tail0);
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
    // A warp takes keys t0 + warp, t0 + warp + QSA_WARPS, …, 32 at a time: lane c fetches the
    // c-th one's token index up front (one round trip for all 32), and the next key's rows load
    // while this one is scored. Each key used to wait for its index, then for its rows: two
    // dependent round trips a key, ~80 µs a layer at 8K context.
    float kv[QSA_MAX_D / 32], vv[QSA_MAX_D / 32], kn[QSA_MAX_D / 32], vn[QSA_MAX_D / 32];
    auto load_rows = [&](u64 t, float* kd, float* vd) {
        const float* kr = k + t * kvd + (u64)kvh * d;
        const float* vr = v + t * kvd + (u64)kvh * d;
#pragma unroll
        for (int j = 0; j < QSA_MAX_D / 32; j++) {
            const int e = lane + 32 * j;
            kd[j] = e < d ? kr[e] : 0.0f;
            vd[j] = e < d ? vr[e] : 0.0f;
        }
    };
    for (int base = t0 + warp; base < t1; base += 32 * QSA_WARPS) {
        const int mine = base + QSA_WARPS * lane;
        const int tok = mine < t1 ? list[mine] : 0;
        const int cnt = min(32, (t1 - base + QSA_WARPS - 1) / QSA_WARPS);
        load_rows((u64)__shfl_sync(0xffffffffu, tok, 0), kv, vv);
        for (int c = 0; c < cnt; c++) {
            const int next = __shfl_sync(0xffffffffu, tok, min(c + 1, 31));
            if (c + 1 < cnt) load_rows((u64)next, kn, vn);
            float dot = 0.0f;
#pragma unroll
            for (int j = 0; j < QSA_MAX_D / 32; j++) {
                int e = lane + 32 * j;
                if (e < d) dot += qv[j] * kv[j];
            }
            float sc = warp_sum(dot) * scale;
            float m_new = fmaxf(m, sc);
            float corr = expf(m - m_new);
            float p = expf(sc - m_new);
            l = l * corr + p;
#pragma unroll
            for (int j = 0; j < QSA_MAX_D / 32; j++) {
                int e = lane + 32 * j;
                if (e < d) acc[j] = acc[j] * corr + p * vv[j];
            }
            m = m_new;
#pragma unroll
            for (int j = 0; j < QSA_MAX_D / 32; j++) {
                kv[j] = kn[j];
                vv[j] = vn[j];
            }
        }
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

// tokens [n, cap], counts [n] (qsa_select) → mask [n, words] u32: bit b of a row set where the
// row's list holds a token of block b = t / ratio (the selected blocks and the tail's). One
// block per row, the row's bitmap built in shared memory (words · 4 bytes, dynamic).
extern "C" __global__ void qsa_token_mask(const int* tokens, const int* counts, u32* mask, int cap, int ratio,
                                          int words) { KERNEL_START();
    extern __shared__ u32 bits[];
    const int i = blockIdx.x;
    for (int w = threadIdx.x; w < words; w += blockDim.x) bits[w] = 0;
    __syncthreads();
    const int* list = tokens + (u64)i * cap;
    const int len = counts[i];
    for (int j = threadIdx.x; j < len; j += blockDim.x) {
        const int b = list[j] / ratio;
        atomicOr(&bits[b >> 5], 1u << (b & 31));
    }
    __syncthreads();
    for (int w = threadIdx.x; w < words; w += blockDim.x) mask[(u64)i * words + w] = bits[w];
}
