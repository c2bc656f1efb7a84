// The gated delta rule, recurrent form, parallel over value heads × value columns: four lanes
// share one column of one head's [dk, dv] state (each holds every fourth row in registers) and
// walk the tokens in order:
//   S ← S·e^g;  δ = β(v − Sᵀk);  S ← S + k δᵀ;  o = Sᵀq
// with q, k L2-normalised (and q scaled by 1/√dk) here, as the reference kernel does. The next
// token's inputs are loaded while the current one is computed. Prefill runs the same kernel
// over all of a chunk's tokens.

#define GDR_MAX_DK 128
#define GDR_PARTS 4
#define GDR_ROWS (GDR_MAX_DK / GDR_PARTS)
#define GDR_COLS (32 / GDR_PARTS)

// q, k [n, NK·dk]; v [n, NV·dv]; g, beta [n, NV]; state [NV, dk, dv]; out [n, NV·dv].
// grid (NV, ceil(dv / 8)), block 32.
extern "C" __global__ void gated_delta_rule(const float* __restrict__ q, const float* __restrict__ k, const float* __restrict__ v,
                                            const float* __restrict__ g, const float* __restrict__ beta, float* __restrict__ state,
                                            float* __restrict__ out, int n, int nk, int nv, int dk, int dv) {
    __shared__ float qs[GDR_MAX_DK], ks[GDR_MAX_DK];
    const int h = blockIdx.x, lane = threadIdx.x;
    const int part = lane % GDR_PARTS;
    const int b = blockIdx.y * GDR_COLS + lane / GDR_PARTS;
    const int kh = h / (nv / nk);
    const bool active = b < dv;
    const float scale = 1.0f / sqrtf((float)dk);
    float S[GDR_ROWS];
    float* st = state + (u64)h * dk * dv;
#pragma unroll
    for (int j = 0; j < GDR_ROWS; j++) {
        int a = j * GDR_PARTS + part;
        S[j] = (a < dk && active) ? st[(u64)a * dv + b] : 0.0f;
    }
    // Inputs of the next token, loaded ahead.
    float nq[GDR_MAX_DK / 32], nkk[GDR_MAX_DK / 32], nvb = 0.0f, ng = 0.0f, nb = 0.0f;
    auto load = [&](int t) {
#pragma unroll
        for (int i = 0; i < GDR_MAX_DK / 32; i++) {
            int a = lane + 32 * i;
            nq[i] = a < dk ? q[((u64)t * nk + kh) * dk + a] : 0.0f;
            nkk[i] = a < dk ? k[((u64)t * nk + kh) * dk + a] : 0.0f;
        }
        nvb = active ? v[((u64)t * nv + h) * dv + b] : 0.0f;
        ng = g[(u64)t * nv + h];
        nb = beta[(u64)t * nv + h];
    };
    if (n > 0) load(0);
    for (int t = 0; t < n; t++) {
        float qq = 0.0f, kk = 0.0f;
#pragma unroll
        for (int i = 0; i < GDR_MAX_DK / 32; i++) {
            int a = lane + 32 * i;
            if (a < dk) {
                qs[a] = nq[i];
                ks[a] = nkk[i];
            }
            qq += nq[i] * nq[i];
            kk += nkk[i] * nkk[i];
        }
        const float vb = nvb, gt = ng, bt = nb;
        if (t + 1 < n) load(t + 1);
        qq = warp_sum(qq);
        kk = warp_sum(kk);
        __syncwarp();
        const float qinv = 1.0f / sqrtf(qq + 1e-6f);
        const float kinv = 1.0f / sqrtf(kk + 1e-6f);
        const float decay = expf(gt);
        float kv_mem = 0.0f;
#pragma unroll
        for (int j = 0; j < GDR_ROWS; j++) {
            int a = j * GDR_PARTS + part;
            if (a < dk) {
                S[j] *= decay;
                kv_mem += (ks[a] * kinv) * S[j];
            }
        }
#pragma unroll
        for (int o = 1; o < GDR_PARTS; o <<= 1) kv_mem += __shfl_xor_sync(0xffffffffu, kv_mem, o);
        const float delta = (vb - kv_mem) * bt;
        float acc = 0.0f;
#pragma unroll
        for (int j = 0; j < GDR_ROWS; j++) {
            int a = j * GDR_PARTS + part;
            if (a < dk) {
                S[j] += (ks[a] * kinv) * delta;
                acc += (qs[a] * qinv * scale) * S[j];
            }
        }
#pragma unroll
        for (int o = 1; o < GDR_PARTS; o <<= 1) acc += __shfl_xor_sync(0xffffffffu, acc, o);
        if (active && part == 0) out[((u64)t * nv + h) * dv + b] = acc;
        __syncwarp();
    }
    if (active) {
#pragma unroll
        for (int j = 0; j < GDR_ROWS; j++) {
            int a = j * GDR_PARTS + part;
            if (a < dk) st[(u64)a * dv + b] = S[j];
        }
    }
}
