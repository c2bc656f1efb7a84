// Experimental variants of the NVFP4 int8 decode matvec, compared with the engine's kernels by
// quant_matvec_bench.cu. A variant that wins moves into kernels/quant_matvec.cu.

// The engine kernel's access pattern with no arithmetic: is it the loads or the decode?
extern "C" __global__ void probe_nvfp4_loads(const unsigned char* w, const float* x, float* y, int in, int out,
                                             u64 row_bytes, float mult, int rpw) {
    const int spr = in >> 8;
    const int lane = threadIdx.x & 31;
    const int warps = gridDim.x * (blockDim.x >> 5);
    for (int row0 = (blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5)) * rpw; row0 < out; row0 += warps * rpw) {
        const int nrows = min(rpw, out - row0);
        u32 acc = 0;
        const uint4* base = (const uint4*)(w + (u64)row0 * row_bytes);
        for (int t = lane; t < nrows * spr; t += 32) {
#pragma unroll
            for (int k = 0; k < 9; k++) { uint4 v = base[(u64)t * 9 + k]; acc ^= v.x ^ v.y ^ v.z ^ v.w; }
        }
        if (acc == 0x12345u) y[row0] = (float)acc;
    }
}

// Decode of one 144-byte super-block (4 NVFP4 blocks, 256 weights) against int8 x.
__device__ __forceinline__ float nvfp4_sb_dot(const u32* wd, const unsigned char* xb, const float* xsb, const float* e4m3) {
    float p = 0.0f;
#pragma unroll
    for (int b = 0; b < 4; b++) {
        const u32 sc = wd[9 * b];
#pragma unroll
        for (int h = 0; h < 2; h++) {
            float part = 0.0f;
#pragma unroll
            for (int sub2 = 0; sub2 < 2; sub2++) {
                const int sub = 2 * h + sub2;
                const int2 a = e2m1x8_to_i8(wd[9 * b + 1 + 2 * sub]);
                const int2 c = e2m1x8_to_i8(wd[9 * b + 2 + 2 * sub]);
                const uint4 xv = *(const uint4*)(xb + 64 * b + 16 * sub);
                int isum = dp4a_s32(a.x, (int)xv.x, 0);
                isum = dp4a_s32(a.y, (int)xv.y, isum);
                isum = dp4a_s32(c.x, (int)xv.z, isum);
                isum = dp4a_s32(c.y, (int)xv.w, isum);
                part += (float)isum * e4m3[(sc >> (8 * sub)) & 255];
            }
            p += part * xsb[2 * b + h];
        }
    }
    return p;
}

// Pipelined: every lane keeps the next super-block's 9 loads in flight while it decodes the
// current one; one row per warp pass of `rpw` rows as before; grid-stride (persistent grid).
extern "C" __global__ void nvfp4_q8_pipe(const unsigned char* w, const float* x, float* y, int in, int out,
                                         u64 row_bytes, float mult, int rpw) {
    extern __shared__ __align__(16) unsigned char qsm[];
    const int spr = in >> 8;
    unsigned char* xq = qsm;
    float* xs = (float*)(qsm + spr * QX_STRIDE);
    float* e4m3 = xs + spr * QS_STRIDE;
    for (int i = threadIdx.x; i < 256; i += blockDim.x) e4m3[i] = __uint_as_float(QT_E4M3[i]);
    quantize_x_q8(x, in, xq, xs, true);
    __syncthreads();
    const int lane = threadIdx.x & 31;
    const int warps = gridDim.x * (blockDim.x >> 5);
    for (int row0 = (blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5)) * rpw; row0 < out; row0 += warps * rpw) {
        const int nrows = min(rpw, out - row0);
        const int tasks = nrows * spr;
        float acc[8];
#pragma unroll
        for (int o = 0; o < 8; o++) acc[o] = 0.0f;
        const uint4* base = (const uint4*)(w + (u64)row0 * row_bytes);
        uint4 cur[9], nxt[9];
        int t = lane;
        if (t < tasks) {
#pragma unroll
            for (int k = 0; k < 9; k++) cur[k] = base[(u64)t * 9 + k];
        }
        for (; t < tasks; t += 32) {
            const int tn = t + 32;
            if (tn < tasks) {
#pragma unroll
                for (int k = 0; k < 9; k++) nxt[k] = base[(u64)tn * 9 + k];
            }
            const int o = t / spr, s = t - o * spr;
            const float p = nvfp4_sb_dot((const u32*)cur, xq + s * QX_STRIDE, xs + s * QS_STRIDE, e4m3);
#pragma unroll
            for (int oo = 0; oo < 8; oo++)
                if (oo == o) acc[oo] += p;
#pragma unroll
            for (int k = 0; k < 9; k++) cur[k] = nxt[k];
        }
#pragma unroll
        for (int oo = 0; oo < 8; oo++) {
            if (oo < nrows) {
                const float s = warp_sum(acc[oo]);
                if (lane == 0) y[row0 + oo] = s * mult * 0.5f;
            }
        }
    }
}

// x quantized once by a separate kernel (into global memory, the shared layout), so that the
// matvec blocks start loading weights at once.
extern "C" __global__ void quantize_x_global(const float* x, int in, unsigned char* xq, float* xs) {
    quantize_x_q8(x, in, xq, xs, true);
}

// As nvfp4_q8_pipe, but x comes pre-quantized from global memory (copied to shared memory
// with 16-byte loads), no per-block quantization.
extern "C" __global__ void nvfp4_q8_pre(const unsigned char* w, const unsigned char* xq_g, const float* xs_g, float* y,
                                        int in, int out, u64 row_bytes, float mult, int rpw) {
    extern __shared__ __align__(16) unsigned char qsm[];
    const int spr = in >> 8;
    unsigned char* xq = qsm;
    float* xs = (float*)(qsm + spr * QX_STRIDE);
    float* e4m3 = xs + spr * QS_STRIDE;
    const int lane = threadIdx.x & 31;
    const int warps = gridDim.x * (blockDim.x >> 5);
    const int row_first = (blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5)) * rpw;
    // Issue this warp's first weight loads before waiting on the shared-memory fill.
    uint4 cur[9], nxt[9];
    {
        const int nrows = row_first < out ? min(rpw, out - row_first) : 0;
        const uint4* base = (const uint4*)(w + (u64)row_first * row_bytes);
        if (lane < nrows * spr) {
#pragma unroll
            for (int k = 0; k < 9; k++) cur[k] = base[(u64)lane * 9 + k];
        }
    }
    for (int i = threadIdx.x; i < 256; i += blockDim.x) e4m3[i] = __uint_as_float(QT_E4M3[i]);
    for (int i = threadIdx.x; i < spr * QX_STRIDE / 16; i += blockDim.x) ((uint4*)xq)[i] = ((const uint4*)xq_g)[i];
    for (int i = threadIdx.x; i < spr * QS_STRIDE; i += blockDim.x) xs[i] = xs_g[i];
    __syncthreads();
    for (int row0 = row_first; row0 < out; row0 += warps * rpw) {
        const int nrows = min(rpw, out - row0);
        const int tasks = nrows * spr;
        float acc[8];
#pragma unroll
        for (int o = 0; o < 8; o++) acc[o] = 0.0f;
        const uint4* base = (const uint4*)(w + (u64)row0 * row_bytes);
        const int next_row0 = row0 + warps * rpw;
        for (int t = lane; t < tasks; t += 32) {
            const int tn = t + 32;
            if (tn < tasks) {
#pragma unroll
                for (int k = 0; k < 9; k++) nxt[k] = base[(u64)tn * 9 + k];
            } else if (next_row0 < out && lane < min(rpw, out - next_row0) * spr) {
                const uint4* nb = (const uint4*)(w + (u64)next_row0 * row_bytes);
#pragma unroll
                for (int k = 0; k < 9; k++) nxt[k] = nb[(u64)lane * 9 + k];
            }
            const int o = t / spr, s = t - o * spr;
            const float p = nvfp4_sb_dot((const u32*)cur, xq + s * QX_STRIDE, xs + s * QS_STRIDE, e4m3);
#pragma unroll
            for (int oo = 0; oo < 8; oo++)
                if (oo == o) acc[oo] += p;
#pragma unroll
            for (int k = 0; k < 9; k++) cur[k] = nxt[k];
        }
#pragma unroll
        for (int oo = 0; oo < 8; oo++) {
            if (oo < nrows) {
                const float s = warp_sum(acc[oo]);
                if (lane == 0) y[row0 + oo] = s * mult * 0.5f;
            }
        }
    }
}

template <class Emit>
void run_variants(int fmt, const char* fname, unsigned char* w, float* x, float* y, int rows, int in, u64 rb,
                  double bytes, const std::vector<float>& ref, Timer& tm, Emit emit) {
    if (fmt != QF_NVFP4) return;
    const int spr = in / 256;
    const int smem = spr * (272 + 48) + 1024;
    std::vector<float> got(rows);
    auto check = [&] { CK(cudaGetLastError()); CK(cudaMemcpy(got.data(), y, rows * 4, cudaMemcpyDeviceToHost)); return maxrel(got, ref); };
    unsigned char* xq; float* xs;
    CK(cudaMalloc(&xq, spr * QX_STRIDE)); CK(cudaMalloc(&xs, spr * QS_STRIDE * 4));
    for (int rpw : {1, 2, 4, 8}) {
        for (int warps_pb : {4, 8}) {  // 16 warps: the pipelined variant runs out of registers
            int warps = (rows + rpw - 1) / rpw;
            int full = (warps + warps_pb - 1) / warps_pb;
            for (int bps : {0, 2, 4, 8}) {  // 0: one warp pass (engine), else persistent blocks per SM
                int blocks = bps ? std::min(full, sms * bps) : full;
                char kn[128];
                if (bps == 0 || blocks < full) {
                    CK(cudaFuncSetAttribute(probe_nvfp4_loads, cudaFuncAttributeMaxDynamicSharedMemorySize, smem));
                    float ms = tm.ms([&] { probe_nvfp4_loads<<<blocks, 32 * warps_pb, 0>>>(w, x, y, in, rows, rb, 1.0f, rpw); });
                    snprintf(kn, sizeof kn, "probe loads-only rpw=%d wpb=%d blocks=%d", rpw, warps_pb, blocks);
                    emit(kn, fname, rows, in, bytes, ms, 0);
                    CK(cudaFuncSetAttribute(nvfp4_q8_pipe, cudaFuncAttributeMaxDynamicSharedMemorySize, smem));
                    ms = tm.ms([&] { nvfp4_q8_pipe<<<blocks, 32 * warps_pb, smem>>>(w, x, y, in, rows, rb, 1.0f, rpw); });
                    snprintf(kn, sizeof kn, "pipe rpw=%d wpb=%d blocks=%d", rpw, warps_pb, blocks);
                    emit(kn, fname, rows, in, bytes, ms, check());
                    CK(cudaFuncSetAttribute(nvfp4_q8_pre, cudaFuncAttributeMaxDynamicSharedMemorySize, smem));
                    ms = tm.ms([&] {
                        quantize_x_global<<<1, 256>>>(x, in, xq, xs);
                        nvfp4_q8_pre<<<blocks, 32 * warps_pb, smem>>>(w, xq, xs, y, in, rows, rb, 1.0f, rpw);
                    });
                    snprintf(kn, sizeof kn, "pre+quantize rpw=%d wpb=%d blocks=%d", rpw, warps_pb, blocks);
                    emit(kn, fname, rows, in, bytes, ms, check());
                }
            }
        }
    }
    cudaFree(xq); cudaFree(xs);
}
