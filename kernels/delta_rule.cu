// The gated delta rule, recurrent form, parallel over value heads × value columns: each thread
// owns one column of one head's [dk, dv] state in registers and walks the tokens in order:
//   S ← S·e^g;  δ = β(v − Sᵀk);  S ← S + k δᵀ;  o = Sᵀq
// with q, k L2-normalised (and q scaled by 1/√dk) here, as the reference kernel does.
// Prefill runs the same kernel over all of a chunk's tokens.

#define GDR_MAX_DK 128

// q, k [n, NK·dk]; v [n, NV·dv]; g, beta [n, NV]; state [NV, dk, dv]; out [n, NV·dv].
// grid (NV, ceil(dv / 32)), block 32.
extern "C" __global__ void gated_delta_rule(const float* q, const float* k, const float* v, const float* g, const float* beta,
                                            float* state, float* out, int n, int nk, int nv, int dk, int dv) {
    __shared__ float qs[GDR_MAX_DK], ks[GDR_MAX_DK];
    const int h = blockIdx.x, lane = threadIdx.x;
    const int b = blockIdx.y * 32 + lane;
    const int kh = h / (nv / nk);
    const bool active = b < dv;
    const float scale = 1.0f / sqrtf((float)dk);
    float S[GDR_MAX_DK];
    float* st = state + (u64)h * dk * dv;
#pragma unroll
    for (int a = 0; a < GDR_MAX_DK; a++) S[a] = (a < dk && active) ? st[(u64)a * dv + b] : 0.0f;
    for (int t = 0; t < n; t++) {
        const float* qr = q + ((u64)t * nk + kh) * dk;
        const float* kr = k + ((u64)t * nk + kh) * dk;
        float qq = 0.0f, kk = 0.0f;
        for (int a = lane; a < dk; a += 32) {
            float qa = qr[a], ka = kr[a];
            qs[a] = qa;
            ks[a] = ka;
            qq += qa * qa;
            kk += ka * ka;
        }
        qq = warp_sum(qq);
        kk = warp_sum(kk);
        __syncwarp();
        const float qinv = 1.0f / sqrtf(qq + 1e-6f);
        const float kinv = 1.0f / sqrtf(kk + 1e-6f);
        const float decay = expf(g[(u64)t * nv + h]);
        const float bt = beta[(u64)t * nv + h];
        float kv_mem = 0.0f;
#pragma unroll
        for (int a = 0; a < GDR_MAX_DK; a++) {
            if (a < dk) {
                S[a] *= decay;
                kv_mem += (ks[a] * kinv) * S[a];
            }
        }
        const float vb = active ? v[((u64)t * nv + h) * dv + b] : 0.0f;
        const float delta = (vb - kv_mem) * bt;
        float o = 0.0f;
#pragma unroll
        for (int a = 0; a < GDR_MAX_DK; a++) {
            if (a < dk) {
                S[a] += (ks[a] * kinv) * delta;
                o += (qs[a] * qinv * scale) * S[a];
            }
        }
        if (active) out[((u64)t * nv + h) * dv + b] = o;
        __syncwarp();
    }
    if (active) {
#pragma unroll
        for (int a = 0; a < GDR_MAX_DK; a++)
            if (a < dk) st[(u64)a * dv + b] = S[a];
    }
}
