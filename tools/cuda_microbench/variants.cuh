// Variants of the NVFP4 int8 decode matvec, compared with the engine's kernels by
// quant_matvec_bench.cu. Session 8 measured prefetching and pre-quantizing x on the 36-byte
// block layout (bench/results/quant-matvec-microbench-h200box.json, the first run); this file
// measures the record layout (QF_NVFP4R, kernels/quant_matvec.cu): block count, rows per warp
// and warps per block, against the same access pattern with no arithmetic.

// Blocks (36 bytes: 4 scales, 32 code bytes, per 64 weights) → records (64 scales, 512 code
// bytes, per 1024 weights), row by row: the engine's repack (backend/cuda/nvfp4_records.rs).
static std::vector<unsigned char> to_records(const std::vector<unsigned char>& blocks, int rows, int in) {
    std::vector<unsigned char> out(blocks.size());
    const u64 rb = (u64)in / 64 * 36;
    for (int r = 0; r < rows; r++)
        for (int rec = 0; rec < in / 1024; rec++) {
            unsigned char* o = out.data() + r * rb + rec * 576;
            for (int b = 0; b < 16; b++) {
                const unsigned char* src = blocks.data() + r * rb + (rec * 16 + b) * 36;
                memcpy(o + 4 * b, src, 4);
                memcpy(o + 64 + 32 * b, src + 4, 32);
            }
        }
    return out;
}

// The record kernel's loads (codes and scales, RPW rows per warp) with no decode.
template <int RPW>
__global__ void probe_records_loads(const unsigned char* w, float* y, int in, int out, u64 row_bytes) {
    const int lane = threadIdx.x & 31;
    const int warps = gridDim.x * (blockDim.x >> 5);
    for (int row0 = (blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5)) * RPW; row0 < out; row0 += warps * RPW) {
        u32 acc = 0;
        for (int r = 0; r < (in >> 10); r++)
#pragma unroll
            for (int o = 0; o < RPW; o++) {
                const unsigned char* rec = w + (u64)min(row0 + o, out - 1) * row_bytes + (u64)r * 576;
                const uint4 v = __ldg((const uint4*)(rec + 64) + lane);
                acc ^= v.x ^ v.y ^ v.z ^ v.w ^ __ldg((const u16*)rec + lane);
            }
        if (acc == 0x12345u) y[row0] = (float)acc;
    }
}

template <class Emit>
void run_variants(int fmt, const char* fname, const std::vector<unsigned char>& hw, float* x, float* y, int rows,
                  int in, u64 rb, double bytes, const std::vector<float>& ref, Timer& tm, Emit emit) {
    if (fmt != QF_NVFP4 || in % 1024) return;
    std::vector<unsigned char> hr = to_records(hw, rows, in);
    unsigned char* w; CK(cudaMalloc(&w, hr.size())); CK(cudaMemcpy(w, hr.data(), hr.size(), cudaMemcpyHostToDevice));
    unsigned char* xq; float* xs;
    CK(cudaMalloc(&xq, in)); CK(cudaMalloc(&xs, in / 32 * 4));
    std::vector<float> got(rows);
    auto check = [&] { CK(cudaGetLastError()); CK(cudaMemcpy(got.data(), y, rows * 4, cudaMemcpyDeviceToHost)); return maxrel(got, ref); };
    // The exact f32 kernel on records must equal the one on blocks bit for bit.
    quant_matvec_1<<<(rows + 31) / 32, 256>>>(QF_NVFP4R, w, x, y, in, rows, rb, 1.0f);
    { double e = check(); char kn[64]; snprintf(kn, sizeof kn, "records quant_matvec_1 (exact) err=%g", e);
      float ms = tm.ms([&] { quant_matvec_1<<<(rows + 31) / 32, 256>>>(QF_NVFP4R, w, x, y, in, rows, rb, 1.0f); });
      emit(kn, fname, rows, in, bytes, ms, e); }
    {
        float ms = tm.ms([&] { quantize_x_q8r<<<(in / 32 + 127) / 128, 128>>>(x, in, xq, xs); });
        emit("quantize_x_q8r alone", fname, rows, in, in * 4.0, ms, 0);
    }
    for (int wpb : {4, 8, 16}) {
        for (int bps : {0, 4, 8, 16}) {  // 0: one warp pass over the rows, else blocks per SM
            auto launch = [&](auto kernel, int rpw, bool quantize) {
                int warps = (rows + rpw - 1) / rpw;
                int full = (warps + wpb - 1) / wpb;
                int blocks = bps ? std::min(full, sms * bps) : full;
                if (bps && blocks == full) return;
                float ms = tm.ms([&] {
                    if (quantize) quantize_x_q8r<<<(in / 32 + 127) / 128, 128>>>(x, in, xq, xs);
                    kernel<<<blocks, 32 * wpb>>>(w, xq, xs, y, in, rows, rb, 1.0f);
                });
                char kn[128];
                snprintf(kn, sizeof kn, "records q8%s rpw=%d wpb=%d blocks=%d", quantize ? "+quantize" : "", rpw, wpb, blocks);
                emit(kn, fname, rows, in, bytes, ms, check());
            };
            launch(quant_matvec_nvfp4r_q8_1, 1, true);
            launch(quant_matvec_nvfp4r_q8_2, 2, true);
            launch(quant_matvec_nvfp4r_q8_4, 4, true);
            launch(quant_matvec_nvfp4r_q8_2, 2, false);
            int warps = (rows + 1) / 2, full = (warps + wpb - 1) / wpb, blocks = bps ? std::min(full, sms * bps) : full;
            if (!bps || blocks < full) {
                float ms = tm.ms([&] { probe_records_loads<2><<<blocks, 32 * wpb>>>(w, y, in, rows, rb); });
                char kn[128]; snprintf(kn, sizeof kn, "probe records loads-only rpw=2 wpb=%d blocks=%d", wpb, blocks);
                emit(kn, fname, rows, in, bytes, ms, 0);
            }
        }
    }
    cudaFree(w); cudaFree(xq); cudaFree(xs);
}
