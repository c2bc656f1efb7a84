// Causal softmax attention of one sequence.
// - Few queries (decode): split over the KV length. `attn_split` gives, per (query, head,
//   split), the running max, the sum of exponentials and the unnormalised output over that
//   split's keys; `attn_combine` merges the splits.
// - Many queries (prefill): scores come from cuBLAS; `causal_softmax` masks and normalises
//   each row in place, then cuBLAS multiplies by V.

#define ATTN_MAX_D 256
#define ATTN_WARPS 4

#define ATTN_GQA_MAX 6

// The end of a split block: each warp left its running (max, sum, unnormalised output) per
// query head in shared memory; they are merged into the split's partials.
__device__ __forceinline__ void attn_split_store(float (*sm_o)[ATTN_GQA_MAX][ATTN_MAX_D], float (*sm_m)[ATTN_GQA_MAX],
                                                 float (*sm_l)[ATTN_GQA_MAX], float* part_o, float* part_ml, int i,
                                                 int heads, int h0, int nh, int d, int s, int splits) {
    for (int g = 0; g < nh; g++) {
        float mm = -INFINITY;
        for (int w = 0; w < ATTN_WARPS; w++) mm = fmaxf(mm, sm_m[w][g]);
        const u64 slot = ((u64)i * heads + h0 + g) * splits + s;
        for (int e = threadIdx.x; e < d; e += blockDim.x) {
            float o = 0.0f;
            for (int w = 0; w < ATTN_WARPS; w++)
                if (sm_m[w][g] != -INFINITY) o += sm_o[w][g][e] * expf(sm_m[w][g] - mm);
            part_o[slot * d + e] = o;
        }
        if (threadIdx.x == 0) {
            float ll = 0.0f;
            for (int w = 0; w < ATTN_WARPS; w++)
                if (sm_m[w][g] != -INFINITY) ll += sm_l[w][g] * expf(sm_m[w][g] - mm);
            part_ml[slot * 2] = mm;
            part_ml[slot * 2 + 1] = ll;
        }
    }
}

// q [n, H·d], k/v [T, KVH·d]; query i sees keys 0..past+i. part_o [n, H, S, d], part_ml [n, H, S, 2].
// grid (KVH · ceil(G / ATTN_GQA_MAX), S, n), block ATTN_WARPS·32, G = H / KVH query heads per KV
// head. A block takes up to ATTN_GQA_MAX query heads of one KV head, so each key and value row
// is read once for all of them: with one block per query head a decode step read the cache G
// times over (6 for the 27B), and attention was bound by those reads.
extern "C" __global__ void attn_split(const float* q, const float* k, const float* v, float* part_o, float* part_ml, int past,
                                      int heads, int kv_heads, int d, float scale, int split_len) { KERNEL_START();
    __shared__ float sm_o[ATTN_WARPS][ATTN_GQA_MAX][ATTN_MAX_D];
    __shared__ float sm_m[ATTN_WARPS][ATTN_GQA_MAX], sm_l[ATTN_WARPS][ATTN_GQA_MAX];
    const int group = heads / kv_heads;
    const int chunks = (group + ATTN_GQA_MAX - 1) / ATTN_GQA_MAX;
    const int kvh = blockIdx.x / chunks;
    const int h0 = kvh * group + (blockIdx.x % chunks) * ATTN_GQA_MAX;
    const int nh = min(ATTN_GQA_MAX, kvh * group + group - h0);
    const int s = blockIdx.y, i = blockIdx.z, splits = gridDim.y;
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int len = past + i + 1;
    const int t0 = s * split_len;
    const int t1 = min(t0 + split_len, len);
    const u64 qd = (u64)heads * d, kvd = (u64)kv_heads * d;
    float qv[ATTN_GQA_MAX][ATTN_MAX_D / 32], acc[ATTN_GQA_MAX][ATTN_MAX_D / 32];
    float m[ATTN_GQA_MAX], l[ATTN_GQA_MAX];
#pragma unroll
    for (int g = 0; g < ATTN_GQA_MAX; g++) {
        m[g] = -INFINITY;
        l[g] = 0.0f;
#pragma unroll
        for (int j = 0; j < ATTN_MAX_D / 32; j++) {
            const int e = lane + 32 * j;
            qv[g][j] = (g < nh && e < d) ? q[i * qd + (u64)(h0 + g) * d + e] : 0.0f;
            acc[g][j] = 0.0f;
        }
    }
    // The next key's row is loaded while this one is scored: a warp otherwise waited a full
    // memory round trip per key, and at 8 warps an SM the cache was read at 1.2 TB/s.
    float kv[ATTN_MAX_D / 32], vv[ATTN_MAX_D / 32], kn[ATTN_MAX_D / 32], vn[ATTN_MAX_D / 32];
    auto load_kv = [&](int t, float* kd, float* vd) {
        const float* kr = k + (u64)t * kvd + (u64)kvh * d;
        const float* vr = v + (u64)t * kvd + (u64)kvh * d;
#pragma unroll
        for (int j = 0; j < ATTN_MAX_D / 32; j++) {
            const int e = lane + 32 * j;
            kd[j] = (t < t1 && e < d) ? kr[e] : 0.0f;
            vd[j] = (t < t1 && e < d) ? vr[e] : 0.0f;
        }
    };
    load_kv(t0 + warp, kv, vv);
    for (int t = t0 + warp; t < t1; t += ATTN_WARPS) {
        load_kv(t + ATTN_WARPS, kn, vn);
#pragma unroll
        for (int g = 0; g < ATTN_GQA_MAX; g++) {
            if (g < nh) {
                float dot = 0.0f;
#pragma unroll
                for (int j = 0; j < ATTN_MAX_D / 32; j++) dot += qv[g][j] * kv[j];
                const float sc = warp_sum(dot) * scale;
                const float m_new = fmaxf(m[g], sc);
                const float corr = expf(m[g] - m_new);
                const float p = expf(sc - m_new);
                l[g] = l[g] * corr + p;
#pragma unroll
                for (int j = 0; j < ATTN_MAX_D / 32; j++) acc[g][j] = acc[g][j] * corr + p * vv[j];
                m[g] = m_new;
            }
        }
#pragma unroll
        for (int j = 0; j < ATTN_MAX_D / 32; j++) {
            kv[j] = kn[j];
            vv[j] = vn[j];
        }
    }
#pragma unroll
    for (int g = 0; g < ATTN_GQA_MAX; g++) {
        if (g < nh) {
#pragma unroll
            for (int j = 0; j < ATTN_MAX_D / 32; j++) {
                const int e = lane + 32 * j;
                if (e < d) sm_o[warp][g][e] = acc[g][j];
            }
            if (lane == 0) {
                sm_m[warp][g] = m[g];
                sm_l[warp][g] = l[g];
            }
        }
    }
    __syncthreads();
    attn_split_store(sm_o, sm_m, sm_l, part_o, part_ml, i, heads, h0, nh, d, s, splits);
}


#define ATTN_COMBINE_MAX_SPLITS 1024

// grid (heads, n), block 256; out [n, H·d]. Each split's weight e^{m_s − max} is formed once in
// shared memory; then every output value sums its splits with independent loads (a decode step
// at 8K context has 65 splits: a loop of dependent loads and exponentials per value took 20 µs).
// With `gate` set ([n, H·d], Backend::attention_gated) every value leaves multiplied by
// sigmoid(gate), the gated attention's output gate: a launch fewer per attention layer of a
// decode step. With `xq` also set (one row, d % 32 == 0) its int8 copy for the output
// projection is stored too (warp_store_q8r).
extern "C" __global__ void attn_combine(const float* part_o, const float* part_ml, float* out, int heads, int d, int splits,
                                        const float* gate, unsigned char* xq, float* xs) { KERNEL_START();
    __shared__ float wt[ATTN_COMBINE_MAX_SPLITS];
    __shared__ float scratch[32];
    __shared__ float total;
    const int h = blockIdx.x, i = blockIdx.y;
    const u64 base = ((u64)i * heads + h) * splits;
    float mx = -INFINITY;
    for (int s = threadIdx.x; s < splits; s += blockDim.x) mx = fmaxf(mx, part_ml[(base + s) * 2]);
    mx = block_max(mx, scratch);
    float ll = 0.0f;
    for (int s = threadIdx.x; s < splits; s += blockDim.x) {
        const float ms = part_ml[(base + s) * 2];
        const float w = ms == -INFINITY ? 0.0f : expf(ms - mx);
        wt[s] = w;
        ll += part_ml[(base + s) * 2 + 1] * w;
    }
    ll = block_sum(ll, scratch);
    if (threadIdx.x == 0) total = ll;
    __syncthreads();
    const float inv = 1.0f / total;
    for (int e = threadIdx.x; e < d; e += blockDim.x) {
        float o0 = 0.0f, o1 = 0.0f, o2 = 0.0f, o3 = 0.0f;
        int s = 0;
        for (; s + 4 <= splits; s += 4) {
            o0 += part_o[(base + s) * d + e] * wt[s];
            o1 += part_o[(base + s + 1) * d + e] * wt[s + 1];
            o2 += part_o[(base + s + 2) * d + e] * wt[s + 2];
            o3 += part_o[(base + s + 3) * d + e] * wt[s + 3];
        }
        for (; s < splits; s++) o0 += part_o[(base + s) * d + e] * wt[s];
        const u64 at = (u64)i * heads * d + (u64)h * d + e;
        float o = ((o0 + o1) + (o2 + o3)) * inv;
        if (gate) o *= sigmoid_f(gate[at]);
        out[at] = o;
        // d % 32 == 0: the warp's 32 values are one whole int8 group.
        if (xq) warp_store_q8r(o, (u32)((at - (threadIdx.x & 31)) >> 5), heads * d, xq, xs);
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

// The softmax's exponential: accurate on the exact path; where the probabilities are rounded
// to BF16 (8 bits), the approximate ex2 (relative error ~2^-21) in 2 instructions instead of
// expf's ~10, which bound the prefill softmax (it does a few instructions per score read).
template <bool FAST>
__device__ __forceinline__ float softmax_exp(float x) {
    return FAST ? __expf(x) : expf(x);
}

// Row r of a head (rows_per_head rows each) sees columns 0..first_len + r; `store(t, p)` writes
// the normalised probability of column t (0 past the mask). Two passes over the row (the max and
// the sum online, then the values) instead of three: at 30K keys the scores are read from and
// written to memory, so passes are what this costs. `visible(t)` (for t < len): QSA's token
// mask (TokenMask, below), else every column.
template <bool FAST, typename Store, typename Visible>
__device__ __forceinline__ void causal_softmax_row(const float* row, int cols, int len, Store store, Visible visible) {
    __shared__ float sm_m[32], sm_s[32];
    float m = -INFINITY, s = 0.0f;
    for (int t = threadIdx.x; t < len; t += blockDim.x) {
        if (!visible(t)) continue;
        const float x = row[t];
        if (x > m) {
            s = (m == -INFINITY ? 0.0f : s * softmax_exp<FAST>(m - x)) + 1.0f;
            m = x;
        } else {
            s += softmax_exp<FAST>(x - m);
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
    for (int t = threadIdx.x; t < cols; t += blockDim.x)
        store(t, t < len && visible(t) ? softmax_exp<FAST>(row[t] - m) * inv : 0.0f);
}

// QSA prefill through the dense GEMM path: `mask` [rows, mask_words] u32 per query row, bit b
// set where the query's token list (qsa_select) holds block b (tokens b·ratio ..); null: every
// token visible. A query always sees its own token (its tail block), so no row is all masked.
struct TokenMask {
    const u32* row;
    int ratio;
    // log2(ratio) where ratio is a power of two (QSA's 4), else -1: a shift, not a division
    // (~20 instructions), per score.
    int shift;
    __device__ __forceinline__ bool operator()(int t) const {
        if (!row) return true;
        const int b = shift >= 0 ? t >> shift : t / ratio;
        return (row[b >> 5] >> (b & 31)) & 1u;
    }
};

__device__ __forceinline__ TokenMask token_mask(const u32* mask, int mask_words, int ratio, int row) {
    const int shift = ratio > 0 && (ratio & (ratio - 1)) == 0 ? __popc((u32)ratio - 1) : -1;
    return TokenMask{mask ? mask + (u64)row * mask_words : nullptr, ratio, shift};
}

// scores [heads · rows_per_head, cols] (already scaled), the rows of each head together,
// normalised in place.
// mask/mask_words/ratio: QSA's token mask for the launch's rows (TokenMask), or null.
extern "C" __global__ void causal_softmax(float* scores, int cols, int first_len, int rows_per_head, const u32* mask,
                                          int mask_words, int ratio) { KERNEL_START();
    float* row = scores + (u64)blockIdx.x * cols;
    const int r = (int)(blockIdx.x % rows_per_head);
    const int len = min(cols, first_len + r);
    causal_softmax_row<false>(row, cols, len, [&](int t, float p) { row[t] = p; },
                              token_mask(mask, mask_words, ratio, r));
}

// As `causal_softmax`, writing the probabilities as BF16 into `probs` (the fast path's P·V runs
// on BF16 tensor cores).
extern "C" __global__ void causal_softmax_bf16(const float* scores, u16* probs, int cols, int first_len,
                                               int rows_per_head, const u32* mask, int mask_words, int ratio) { KERNEL_START();
    const float* row = scores + (u64)blockIdx.x * cols;
    u16* out = probs + (u64)blockIdx.x * cols;
    const int r = (int)(blockIdx.x % rows_per_head);
    const int len = min(cols, first_len + r);
    causal_softmax_row<true>(row, cols, len, [&](int t, float p) { out[t] = f32_to_bf16(p); },
                       token_mask(mask, mask_words, ratio, r));
}
