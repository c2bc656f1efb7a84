// The gated delta rule, recurrent form, parallel over value heads × value columns × key rows:
//   S ← S·e^g;  δ = β(v − Sᵀk);  S ← S + k δᵀ;  o = Sᵀq
// with q, k L2-normalised (and q scaled by 1/√dk) here, as the reference kernel does.
// Thread (lane, w) of a block owns column b = 32·blockIdx.y + lane of one head's [dk, dv] state,
// rows 32w … 32w + 31, in registers; the warps' partial sums of Sᵀk and Sᵀq meet in shared
// memory. A decode step is one token per call: splitting the rows over warps gives the call
// dk/32 times the warps (768 for the 27B) to hide the state's load latency with, where one
// warp per 32 columns left the H100 at a tenth of its bandwidth.
// Prefill runs the same kernel over all of a short chunk's tokens.

#define GDR_MAX_DK 128
#define GDR_MAX_WARPS (GDR_MAX_DK / 32)
// Value tiles one block may hold: a normed block holds a head's every value column.
#define GDR_MAX_TILES 8
// Threads a block may have: 16 warps at 32 state registers and ~80 more each (a 27B head, 128
// key rows by 128 value columns, in one block) stay within the SM's 64K registers.
#define GDR_MAX_THREADS 512

// q, k [n, NK·dk]; v [n, NV·dv]; g, beta [n, NV]; state [NV, dk, dv]; out [n, NV·dv]. q, k and
// v rows are `q_stride`, `k_stride`, `v_stride` floats apart, so they may be read in place from
// the packed conv output. grid (NV, ceil(dv / 32) / tiles), block (32, ceil(dk / 32) · tiles):
// warp y holds key rows 32·(y mod warps) … of the value tile y / warps (warps = ceil(dk / 32)).
//
// With `norm_w` set (Backend::gated_delta_rule_normed, the GDN decode tail) a block holds all
// of its head's value columns (gridDim.y = 1), and each token's output leaves normed and gated
// per head: o · rsqrt(mean(o²) + eps) · w · act(z), act silu (gate_act 0) or sigmoid (1), as
// rms_norm (gated) or rms_norm + sigmoid_gate compute it after the plain kernel: a launch fewer
// per GDN layer of a decode step. z is [n, NV·dv]. With `xq` also set (one token, dv % 32 == 0)
// the int8 copy for the output projection is stored too (warp_store_q8r).
extern "C" __global__ void __launch_bounds__(GDR_MAX_THREADS) gated_delta_rule(const float* q, const float* k, const float* v, const float* g, const float* beta,
                                            float* state, float* out, int n, int nk, int nv, int dk, int dv,
                                            int q_stride, int k_stride, int v_stride, const float* norm_w,
                                            const float* z, int gate_act, float eps, unsigned char* xq, float* xs) { KERNEL_START();
    __shared__ float qs[GDR_MAX_DK], ks[GDR_MAX_DK];
    __shared__ float norms[2][GDR_MAX_WARPS];
    __shared__ float part[2][GDR_MAX_TILES][GDR_MAX_WARPS][32];
    __shared__ float tile_ss[GDR_MAX_TILES];
    const int warps = (dk + 31) / 32;
    const int h = blockIdx.x, lane = threadIdx.x, w = threadIdx.y % warps, tile = threadIdx.y / warps;
    const int tiles = blockDim.y / warps;
    const int b = (blockIdx.y * tiles + tile) * 32 + lane;
    const int kh = h / (nv / nk);
    const int a0 = 32 * w;
    const bool active = b < dv;
    const float scale = 1.0f / sqrtf((float)dk);
    float S[32];
    float* st = state + (u64)h * dk * dv;
#pragma unroll
    for (int r = 0; r < 32; r++) S[r] = (a0 + r < dk && active) ? st[(u64)(a0 + r) * dv + b] : 0.0f;
    const float nw = norm_w && active ? norm_w[b] : 0.0f;
    for (int t = 0; t < n; t++) {
        // Every input of token t that does not depend on the state, loaded at once (in a
        // decode step, while the state's loads are in flight) rather than where first used,
        // after each barrier; on the H100 the 27B's decode step did not change measurably
        // (1.002x, bench/results/gpu-qwen3.8-27b-iq3_s-gdn-loads-session25-h100box.json).
        const int a = a0 + lane;
        const bool qk_lane = tile == 0 && a < dk;
        const float qa = qk_lane ? q[(u64)t * q_stride + (u64)kh * dk + a] : 0.0f;
        const float ka = qk_lane ? k[(u64)t * k_stride + (u64)kh * dk + a] : 0.0f;
        const float g_t = g[(u64)t * nv + h];
        const float bt = beta[(u64)t * nv + h];
        const float vb = active ? v[(u64)t * v_stride + (u64)h * dv + b] : 0.0f;
        const u64 o_at = ((u64)t * nv + h) * dv + b;
        const float zb = norm_w && active ? z[o_at] : 0.0f;
        // Lane r of the first tile's warp w brings row a0 + r of q and k, and its share of
        // their norms.
        if (tile == 0) {
            if (a < dk) {
                qs[a] = qa;
                ks[a] = ka;
            }
            const float qq_w = warp_sum(qa * qa), kk_w = warp_sum(ka * ka);
            if (lane == 0) {
                norms[0][w] = qq_w;
                norms[1][w] = kk_w;
            }
        }
        __syncthreads();
        float qq = 0.0f, kk = 0.0f;
        for (int i = 0; i < warps; i++) {
            qq += norms[0][i];
            kk += norms[1][i];
        }
        const float qinv = 1.0f / sqrtf(qq + 1e-6f);
        const float kinv = 1.0f / sqrtf(kk + 1e-6f);
        const float decay = expf(g_t);
        float kv_part = 0.0f;
#pragma unroll
        for (int r = 0; r < 32; r++) {
            if (a0 + r < dk) {
                S[r] *= decay;
                kv_part += (ks[a0 + r] * kinv) * S[r];
            }
        }
        part[0][tile][w][lane] = kv_part;
        __syncthreads();
        float kv_mem = 0.0f;
        for (int i = 0; i < warps; i++) kv_mem += part[0][tile][i][lane];
        const float delta = (vb - kv_mem) * bt;
        float o_part = 0.0f;
#pragma unroll
        for (int r = 0; r < 32; r++) {
            if (a0 + r < dk) {
                S[r] += (ks[a0 + r] * kinv) * delta;
                o_part += (qs[a0 + r] * qinv * scale) * S[r];
            }
        }
        part[1][tile][w][lane] = o_part;
        __syncthreads();
        float o = 0.0f;
        if (w == 0) {
            for (int i = 0; i < warps; i++) o += part[1][tile][i][lane];
            if (!norm_w && active) out[o_at] = o;
            if (norm_w) {
                const float ss = warp_sum(active ? o * o : 0.0f);
                if (lane == 0) tile_ss[tile] = ss;
            }
        }
        if (norm_w) {
            __syncthreads();
            if (w == 0) {
                float ss = 0.0f;
                for (int i = 0; i < tiles; i++) ss += tile_ss[i];
                const float inv = 1.0f / sqrtf(ss / (float)dv + eps);
                float r = 0.0f;
                if (active) {
                    r = o * inv * nw * (gate_act ? sigmoid_f(zb) : silu_f(zb));
                    out[o_at] = r;
                }
                if (xq) warp_store_q8r(r, (u32)((o_at - lane) >> 5), nv * dv, xq, xs);
            }
        }
        // qs, ks, the partials and tile_ss are rewritten by the next token.
        __syncthreads();
    }
    if (active) {
#pragma unroll
        for (int r = 0; r < 32; r++)
            if (a0 + r < dk) st[(u64)(a0 + r) * dv + b] = S[r];
    }
}

// ---- Chunked form (prefill) -------------------------------------------------------------
// Chunks of GDR_CHUNK tokens, as backend/cpu/delta_rule.rs `chunked`. Two kernels:
//  1. gdr_chunk_prep, parallel over (value head, chunk), needs no state: the L2-normalised
//     q̂ (·1/√dk), k̂, the cumulative log-decay c, A_ij = β_i (k̂_i·k̂_j) e^{c_i−c_j} (j < i) and the
//     UT transform by forward substitution, U = (I+A)⁻¹ βV and W = (I+A)⁻¹ β e^{c} K̂; also
//     Qe = q̂ e^{c_i}, Kd = k̂ e^{c_last−c_j}, P_ij = (q̂_i·k̂_j) e^{c_i−c_j} (j ≤ i), e^{c_last}.
//  2. gdr_chunk_scan, parallel over (value head, tile of GDR_TILE value columns), walks the
//     chunks in order with the state tile in shared memory:
//       V' = U − W S;   O = Qe S + P V';   S ← e^{c_last} S + Kdᵀ V'.
// Workspace per (head, chunk): U [64, dv], W [64, dk], Qe [64, dk], Kd [64, dk], P [64, 64], e^{c_last}
// and 3 floats of padding.
// Rows past the end of the sequence are zero (β = 0, k̂ = 0, g = 0), so they change nothing.

#define GDR_CHUNK 64
#define GDR_TILE 32

// Padded to a multiple of 4 floats, so every part of every chunk is 16-byte aligned.
__device__ __forceinline__ u64 gdr_chunk_floats(int dk, int dv) {
    return (u64)GDR_CHUNK * (dv + 3 * dk) + GDR_CHUNK * GDR_CHUNK + 4;
}

// Two blocks an SM where shared memory has room for them (sm_90: 228 KB an SM; the register
// cap costs ~260 bytes of spills); sm_120 has 128 KB, room for one, so it keeps every register.
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 1200
#define GDR_PREP_MIN_BLOCKS 1
#else
#define GDR_PREP_MIN_BLOCKS 2
#endif

// grid (NV, chunks), block 256, dynamic shared memory
//   (2·64·(dk+1) + 64·68 + 2·64) floats (backend/cuda `ChunkedDeltaRulePlan`).
// Tokens t0 + chunk·64 … of the sequence; `n` tokens in all (the last chunk may be partial).
extern "C" __global__ void __launch_bounds__(256, GDR_PREP_MIN_BLOCKS) gdr_chunk_prep(const float* q, const float* k, const float* v, const float* g,
                                          const float* beta, float* ws, int n, int t0, int nk, int nv, int dk,
                                          int dv) { KERNEL_START();
    extern __shared__ float sm[];
    const int ks_stride = dk + 1, as_stride = GDR_CHUNK + 4;
    float* Ks = sm;                            // [64][dk+1]
    float* Qs = Ks + GDR_CHUNK * ks_stride;    // [64][dk+1]
    float* At = Qs + GDR_CHUNK * ks_stride;    // Aᵀ [64][68]: rows 16-byte aligned for float4 reads
    float* cum = At + GDR_CHUNK * as_stride;
    float* bs = cum + GDR_CHUNK;
    const int h = blockIdx.x, chunk = blockIdx.y;
    const int kh = h / (nv / nk);
    const int start = t0 + chunk * GDR_CHUNK;
    const int l = min(GDR_CHUNK, n - start);
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5, nwarps = blockDim.x >> 5;
    const float scale = 1.0f / sqrtf((float)dk);
    float* base = ws + ((u64)h * gridDim.y + chunk) * gdr_chunk_floats(dk, dv);
    float* U = base;
    float* W = U + GDR_CHUNK * dv;
    float* Qe = W + GDR_CHUNK * dk;
    float* Kd = Qe + GDR_CHUNK * dk;
    float* P = Kd + GDR_CHUNK * dk;
    float* decay_out = P + GDR_CHUNK * GDR_CHUNK;

    for (int r = warp; r < GDR_CHUNK; r += nwarps) {
        if (r < l) {
            const float* qr = q + ((u64)(start + r) * nk + kh) * dk;
            const float* kr = k + ((u64)(start + r) * nk + kh) * dk;
            float qq = 0.0f, kk = 0.0f;
            for (int a = lane; a < dk; a += 32) {
                qq += qr[a] * qr[a];
                kk += kr[a] * kr[a];
            }
            qq = warp_sum(qq);
            kk = warp_sum(kk);
            const float qinv = scale / sqrtf(qq + 1e-6f), kinv = 1.0f / sqrtf(kk + 1e-6f);
            for (int a = lane; a < dk; a += 32) {
                Qs[r * ks_stride + a] = qr[a] * qinv;
                Ks[r * ks_stride + a] = kr[a] * kinv;
            }
        } else {
            for (int a = lane; a < dk; a += 32) {
                Qs[r * ks_stride + a] = 0.0f;
                Ks[r * ks_stride + a] = 0.0f;
            }
        }
    }
    if (warp == 0) {
        // Inclusive prefix sum of g over the chunk (zeros past the end), one warp, two values a lane.
        float g0 = lane < l ? g[(u64)(start + lane) * nv + h] : 0.0f;
        float g1 = lane + 32 < l ? g[(u64)(start + lane + 32) * nv + h] : 0.0f;
#pragma unroll
        for (int o = 1; o < 32; o <<= 1) {
            float y0 = __shfl_up_sync(0xffffffffu, g0, o), y1 = __shfl_up_sync(0xffffffffu, g1, o);
            if (lane >= o) {
                g0 += y0;
                g1 += y1;
            }
        }
        g1 += __shfl_sync(0xffffffffu, g0, 31);
        cum[lane] = g0;
        cum[lane + 32] = g1;
        bs[lane] = lane < l ? beta[(u64)(start + lane) * nv + h] : 0.0f;
        bs[lane + 32] = lane + 32 < l ? beta[(u64)(start + lane + 32) * nv + h] : 0.0f;
    }
    __syncthreads();
    const float clast = cum[GDR_CHUNK - 1];
    {
        // A and P in register tiles: thread (ti, tj) takes rows ti + 16r and columns tj + 16c,
        // so a step over `a` loads 12 values for 20 products (one element a thread loaded 3
        // for 2, and shared memory bandwidth bound the kernel), and a warp's 16 column rows
        // fall in 16 banks. Tiles with c > r lie above the diagonal: zero, never computed.
        const int ti = tid >> 4, tj = tid & 15;
        float kk[4][4], qk[4][4];
#pragma unroll
        for (int r = 0; r < 4; r++)
#pragma unroll
            for (int c = 0; c < 4; c++) kk[r][c] = qk[r][c] = 0.0f;
        for (int a = 0; a < dk; a++) {
            float ki[4], qi[4], kj[4];
#pragma unroll
            for (int r = 0; r < 4; r++) {
                ki[r] = Ks[(ti + 16 * r) * ks_stride + a];
                qi[r] = Qs[(ti + 16 * r) * ks_stride + a];
                kj[r] = Ks[(tj + 16 * r) * ks_stride + a];
            }
#pragma unroll
            for (int r = 0; r < 4; r++)
#pragma unroll
                for (int c = 0; c <= r; c++) {
                    kk[r][c] += ki[r] * kj[c];
                    qk[r][c] += qi[r] * kj[c];
                }
        }
#pragma unroll
        for (int r = 0; r < 4; r++)
#pragma unroll
            for (int c = 0; c < 4; c++) {
                const int i = ti + 16 * r, j = tj + 16 * c;
                const float d = j <= i ? expf(cum[i] - cum[j]) : 0.0f;
                At[j * as_stride + i] = j < i ? bs[i] * kk[r][c] * d : 0.0f;
                P[i * GDR_CHUNK + j] = c <= r ? qk[r][c] * d : 0.0f;
            }
    }
    for (int e = tid; e < GDR_CHUNK * dk; e += blockDim.x) {
        const int i = e / dk, a = e % dk;
        Qe[e] = Qs[i * ks_stride + a] * expf(cum[i]);
        Kd[e] = Ks[i * ks_stride + a] * expf(clast - cum[i]);
    }
    if (tid == 0) *decay_out = expf(clast);
    __syncthreads();
    // Forward substitution, one column of [βV | βe^{c}K̂] per thread: y_i = x_i − Σ_{j<i} A_ij y_j,
    // right-looking: once y_j is final it is written out and subtracted from the rows below
    // it, so the live values shrink from 64 to none (the left-looking form kept every y_j and
    // input live: 255 registers, one block an SM). Each x_i takes its subtractions in the same
    // order (ascending j), so the results are the same bit for bit. A is stored transposed,
    // and a float4 of its column j is one broadcast load.
    for (int col = tid; col < dv + dk; col += blockDim.x) {
        float x[GDR_CHUNK];
#pragma unroll
        for (int i = 0; i < GDR_CHUNK; i++) {
            if (col < dv)
                x[i] = i < l ? bs[i] * v[((u64)(start + i) * nv + h) * dv + col] : 0.0f;
            else
                x[i] = bs[i] * expf(cum[i]) * Ks[i * ks_stride + (col - dv)];
        }
        float* dst = col < dv ? U + col : W + (col - dv);
        const int dst_stride = col < dv ? dv : dk;
#pragma unroll
        for (int j = 0; j < GDR_CHUNK; j++) {
            dst[j * dst_stride] = x[j];
#pragma unroll
            for (int i = (j + 1) & ~3; i < GDR_CHUNK; i += 4) {
                const float4 a4 = *(const float4*)&At[j * as_stride + i];
                if (i > j) x[i] -= a4.x * x[j];
                if (i + 1 > j) x[i + 1] -= a4.y * x[j];
                if (i + 2 > j) x[i + 2] -= a4.z * x[j];
                if (i + 3 > j) x[i + 3] -= a4.w * x[j];
            }
        }
    }
}

// The scan's staging: a [64, dk] part of the workspace (W, Qe or Kd) moves to shared memory as
// float4s, thread t taking float4s t, t + 256, … (dk ≤ 128: at most 8). Each part is fetched
// into registers one phase ahead of its use and stored after the next barrier, so its global
// latency hides behind the phase in between: the scan was bound by those loads (one
// dependent round trip per few floats, three parts and P per chunk: ~50 µs a chunk).
#define GDR_SCAN_THREADS 256
#define GDR_STAGE_VECS (GDR_CHUNK * GDR_MAX_DK / 4 / GDR_SCAN_THREADS)
#define GDR_P_VECS (GDR_CHUNK * GDR_CHUNK / 4 / GDR_SCAN_THREADS)

__device__ __forceinline__ void gdr_fetch(float4 (&r)[GDR_STAGE_VECS], const float* part, int dk) {
    const int total = GDR_CHUNK * dk / 4;
#pragma unroll
    for (int i = 0; i < GDR_STAGE_VECS; i++) {
        const int e = threadIdx.x + GDR_SCAN_THREADS * i;
        if (e < total) r[i] = __ldg((const float4*)part + e);
    }
}

// Rows of `dk` floats to rows `stride` floats apart (dk and stride multiples of 4).
__device__ __forceinline__ void gdr_stage(const float4 (&r)[GDR_STAGE_VECS], float* buf, int stride, int dk) {
    const int total = GDR_CHUNK * dk / 4;
#pragma unroll
    for (int i = 0; i < GDR_STAGE_VECS; i++) {
        const int e = threadIdx.x + GDR_SCAN_THREADS * i;
        if (e < total) *(float4*)&buf[(4 * e / dk) * stride + 4 * e % dk] = r[i];
    }
}

// grid (NV, ceil(dv / 32)), block 256, dynamic shared memory
//   (dk·32 + 64·(dk+4) + 64·32 + 64·65) floats (backend/cuda `ChunkedDeltaRulePlan`). Walks
// `chunks` chunks of the workspace in order, updating state [NV, dk, dv] and writing out
// [n, NV·dv] rows t0 + chunk·64 + i (< n). dk a multiple of 4, at most 128.
extern "C" __global__ void __launch_bounds__(GDR_SCAN_THREADS) gdr_chunk_scan(const float* ws, float* state, float* out,
                                                                             int n, int t0, int chunks, int nv, int dk,
                                                                             int dv) { KERNEL_START();
    extern __shared__ float sm[];
    const int bs_stride = dk + 4;
    float* S = sm;                              // [dk][32]
    float* buf = S + dk * GDR_TILE;             // [64][dk+4]: W, then Qe, then Kd
    float* vn = buf + GDR_CHUNK * bs_stride;    // [64][32]
    float* Ps = vn + GDR_CHUNK * GDR_TILE;      // [64][65]
    const int h = blockIdx.x, b0 = blockIdx.y * GDR_TILE;
    const int tid = threadIdx.x;
    const int cols = min(GDR_TILE, dv - b0);
    float* st = state + (u64)h * dk * dv;
    for (int e = tid; e < dk * GDR_TILE; e += blockDim.x) {
        const int a = e / GDR_TILE, c = e % GDR_TILE;
        S[e] = c < cols ? st[(u64)a * dv + b0 + c] : 0.0f;
    }
    // Micro-tiles: V' and O are [64, 32] (2 rows × 4 columns a thread); S is [dk, 32]
    // (4 rows × 4 columns a thread, dk ≤ 128).
    const int ri = (tid >> 3) * 2, ci = (tid & 7) * 4;
    const u64 per_chunk = gdr_chunk_floats(dk, dv);
    float4 pre[GDR_STAGE_VECS];
    gdr_fetch(pre, ws + (u64)h * chunks * per_chunk + GDR_CHUNK * dv, dk);  // chunk 0's W
    for (int chunk = 0; chunk < chunks; chunk++) {
        const float* base = ws + ((u64)h * chunks + chunk) * per_chunk;
        const float* U = base;
        const float* W = U + GDR_CHUNK * dv;
        const float* Qe = W + GDR_CHUNK * dk;
        const float* Kd = Qe + GDR_CHUNK * dk;
        const float* P = Kd + GDR_CHUNK * dk;
        const int start = t0 + chunk * GDR_CHUNK;
        const int l = min(GDR_CHUNK, n - start);
        // This chunk's P, decay and the thread's U entries, in flight together with W.
        float4 pp[GDR_P_VECS];
#pragma unroll
        for (int i = 0; i < GDR_P_VECS; i++) pp[i] = __ldg((const float4*)P + tid + GDR_SCAN_THREADS * i);
        const float decay = __ldg(P + GDR_CHUNK * GDR_CHUNK);
        float u[2][4];
#pragma unroll
        for (int r = 0; r < 2; r++)
#pragma unroll
            for (int c = 0; c < 4; c++) u[r][c] = ci + c < cols ? __ldg(U + (ri + r) * dv + b0 + ci + c) : 0.0f;
        __syncthreads();  // the last chunk's readers of buf, vn and Ps are done
        gdr_stage(pre, buf, bs_stride, dk);
#pragma unroll
        for (int i = 0; i < GDR_P_VECS; i++) {
            const int f = 4 * (tid + GDR_SCAN_THREADS * i), row = f / GDR_CHUNK, col = f % GDR_CHUNK;
            float* d = &Ps[row * (GDR_CHUNK + 1) + col];
            d[0] = pp[i].x; d[1] = pp[i].y; d[2] = pp[i].z; d[3] = pp[i].w;
        }
        __syncthreads();
        gdr_fetch(pre, Qe, dk);
        // V' = U − W S
        {
            float acc[2][4];
#pragma unroll
            for (int r = 0; r < 2; r++)
#pragma unroll
                for (int c = 0; c < 4; c++) acc[r][c] = 0.0f;
            for (int a = 0; a < dk; a++) {
                const float4 s4 = *(const float4*)&S[a * GDR_TILE + ci];
                const float w0 = buf[ri * bs_stride + a], w1 = buf[(ri + 1) * bs_stride + a];
                acc[0][0] += w0 * s4.x; acc[0][1] += w0 * s4.y; acc[0][2] += w0 * s4.z; acc[0][3] += w0 * s4.w;
                acc[1][0] += w1 * s4.x; acc[1][1] += w1 * s4.y; acc[1][2] += w1 * s4.z; acc[1][3] += w1 * s4.w;
            }
#pragma unroll
            for (int r = 0; r < 2; r++)
#pragma unroll
                for (int c = 0; c < 4; c++) {
                    const int col = ci + c;
                    vn[(ri + r) * GDR_TILE + col] = col < cols ? u[r][c] - acc[r][c] : 0.0f;
                }
        }
        __syncthreads();
        gdr_stage(pre, buf, bs_stride, dk);
        __syncthreads();
        gdr_fetch(pre, Kd, dk);
        // O = Qe S + P V'
        {
            float acc[2][4];
#pragma unroll
            for (int r = 0; r < 2; r++)
#pragma unroll
                for (int c = 0; c < 4; c++) acc[r][c] = 0.0f;
            for (int a = 0; a < dk; a++) {
                const float4 s4 = *(const float4*)&S[a * GDR_TILE + ci];
                const float w0 = buf[ri * bs_stride + a], w1 = buf[(ri + 1) * bs_stride + a];
                acc[0][0] += w0 * s4.x; acc[0][1] += w0 * s4.y; acc[0][2] += w0 * s4.z; acc[0][3] += w0 * s4.w;
                acc[1][0] += w1 * s4.x; acc[1][1] += w1 * s4.y; acc[1][2] += w1 * s4.z; acc[1][3] += w1 * s4.w;
            }
            for (int j = 0; j <= ri + 1; j++) {
                const float4 v4 = *(const float4*)&vn[j * GDR_TILE + ci];
                const float p0 = j <= ri ? Ps[ri * (GDR_CHUNK + 1) + j] : 0.0f;
                const float p1 = Ps[(ri + 1) * (GDR_CHUNK + 1) + j];
                acc[0][0] += p0 * v4.x; acc[0][1] += p0 * v4.y; acc[0][2] += p0 * v4.z; acc[0][3] += p0 * v4.w;
                acc[1][0] += p1 * v4.x; acc[1][1] += p1 * v4.y; acc[1][2] += p1 * v4.z; acc[1][3] += p1 * v4.w;
            }
#pragma unroll
            for (int r = 0; r < 2; r++)
#pragma unroll
                for (int c = 0; c < 4; c++) {
                    const int row = ri + r, col = ci + c;
                    if (row < l && col < cols) out[((u64)(start + row) * nv + h) * dv + b0 + col] = acc[r][c];
                }
        }
        __syncthreads();
        gdr_stage(pre, buf, bs_stride, dk);
        __syncthreads();
        if (chunk + 1 < chunks) gdr_fetch(pre, base + per_chunk + GDR_CHUNK * dv, dk);  // the next chunk's W
        // S ← e^{c_last} S + Kdᵀ V': rows a0..a0+3 of S, columns ci..ci+3.
        for (int a0 = (tid >> 3) * 4; a0 < dk; a0 += (blockDim.x >> 3) * 4) {
            float acc[4][4];
#pragma unroll
            for (int r = 0; r < 4; r++) {
                const float4 s4 = *(const float4*)&S[(a0 + r) * GDR_TILE + ci];
                acc[r][0] = decay * s4.x; acc[r][1] = decay * s4.y; acc[r][2] = decay * s4.z; acc[r][3] = decay * s4.w;
            }
            for (int j = 0; j < GDR_CHUNK; j++) {
                const float4 v4 = *(const float4*)&vn[j * GDR_TILE + ci];
                const float4 k4 = *(const float4*)&buf[j * bs_stride + a0];
                const float kr[4] = {k4.x, k4.y, k4.z, k4.w};
#pragma unroll
                for (int r = 0; r < 4; r++) {
                    acc[r][0] += kr[r] * v4.x; acc[r][1] += kr[r] * v4.y; acc[r][2] += kr[r] * v4.z; acc[r][3] += kr[r] * v4.w;
                }
            }
            // Each thread reads and writes only its own S entries, so no barrier is needed here.
#pragma unroll
            for (int r = 0; r < 4; r++)
                *(float4*)&S[(a0 + r) * GDR_TILE + ci] = make_float4(acc[r][0], acc[r][1], acc[r][2], acc[r][3]);
        }
    }
    __syncthreads();
    for (int e = tid; e < dk * GDR_TILE; e += blockDim.x) {
        const int a = e / GDR_TILE, c = e % GDR_TILE;
        if (c < cols) st[(u64)a * dv + b0 + c] = S[e];
    }
}
