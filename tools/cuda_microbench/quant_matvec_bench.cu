// Microbenchmark of the decode matvec kernels (kernels/quant_matvec.cu, kernels/matvec.cu) on
// the shapes of Qwen3.8-27B, against a plain read of the same bytes, with nvcc on the GPU box:
//   nvcc -O3 -arch=sm_90 -std=c++17 -o qmvb tools/cuda_microbench/quant_matvec_bench.cu && ./qmvb
// The tables are filled with plausible random values: speed does not depend on them, and the
// variants are checked against the engine's kernels on the same data.
#include <cuda_runtime.h>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <cmath>
#include <vector>
#include <random>
#include <string>

#include "../../kernels/common.cuh"
#include "quant_formats.cuh"
#include "../../kernels/quant_matvec.cu"
#include "../../kernels/matvec.cu"

#define CK(x) do { cudaError_t ck_err_ = (x); if (ck_err_ != cudaSuccess) { printf("%s:%d %s\n", __FILE__, __LINE__, cudaGetErrorString(ck_err_)); exit(1); } } while (0)

static float e4m3(unsigned b) {
    int s = b >> 7, e = (b >> 3) & 15, m = b & 7;
    float v = e == 0 ? m / 8.0f * ldexpf(1, -6) : (e == 15 && m == 7 ? 0.0f : (1 + m / 8.0f) * ldexpf(1, e - 7));
    return s ? -v : v;
}

__global__ void read_bw(const uint4* p, u64 n, u32* out) {
    u32 acc = 0;
    for (u64 i = blockIdx.x * (u64)blockDim.x + threadIdx.x; i < n; i += (u64)gridDim.x * blockDim.x) {
        uint4 v = __ldg(p + i);
        acc ^= v.x ^ v.y ^ v.z ^ v.w;
    }
    if (acc == 0x12345678u) out[0] = acc;
}

struct Timer {
    cudaEvent_t a, b;
    Timer() { cudaEventCreate(&a); cudaEventCreate(&b); }
    template <class F> float ms(F f, int iters = 50) {
        f(); CK(cudaDeviceSynchronize());
        cudaEventRecord(a);
        for (int i = 0; i < iters; i++) f();
        cudaEventRecord(b); CK(cudaEventSynchronize(b));
        float t; cudaEventElapsedTime(&t, a, b); return t / iters;
    }
};

static int sms;
static std::mt19937_64 rng(7);

static void fill_bytes(std::vector<unsigned char>& v, int fmt, int in, int rows) {
    for (auto& b : v) b = rng() & 255;
    // Keep f16 block scales finite and small for the GGUF formats.
    if (fmt == QF_IQ3_S) {
        u64 rb = in / 256 * 110;
        for (int r = 0; r < rows; r++)
            for (int s = 0; s < in / 256; s++) { v[r * rb + s * 110] = 0x00; v[r * rb + s * 110 + 1] = 0x1c; }
    }
    if (fmt == QF_NVFP4) {  // scales: E4M3 in a sane range (no NaN)
        u64 rb = in / 64 * 36;
        for (int r = 0; r < rows; r++)
            for (int s = 0; s < in / 64; s++)
                for (int k = 0; k < 4; k++) v[r * rb + s * 36 + k] = 0x30 + (rng() & 15);
    }
}

static double maxrel(const std::vector<float>& a, const std::vector<float>& b) {
    double m = 0, s = 0;
    for (size_t i = 0; i < a.size(); i++) { m = fmax(m, fabs(a[i] - b[i])); s = fmax(s, fabs(b[i])); }
    return m / (s + 1e-30);
}

#include "variants.cuh"

int main(int argc, char** argv) {
    cudaDeviceProp p; CK(cudaGetDeviceProperties(&p, 0)); sms = p.multiProcessorCount;
    printf("{\"gpu\": \"%s\", \"sms\": %d, \"results\": [\n", p.name, sms);
    // tables
    { u32 t[256]; for (int i = 0; i < 256; i++) { float f = e4m3(i); memcpy(&t[i], &f, 4); } CK(cudaMemcpyToSymbol(QT_E4M3, t, sizeof t)); }
    { float vals[16] = {0, .5, 1, 1.5, 2, 3, 4, 6, -0.f, -.5, -1, -1.5, -2, -3, -4, -6}; CK(cudaMemcpyToSymbol(QT_E2M1, vals, sizeof vals)); }
    { u32 g[512]; for (auto& x : g) { x = 0; for (int j = 0; j < 4; j++) x |= (u32)(1 + 2 * (rng() % 8)) << (8 * j); } CK(cudaMemcpyToSymbol(QT_IQ3S, g, sizeof g)); }
    Timer tm;
    bool first = true;
    auto emit = [&](const char* kernel, const char* fmt, int rows, int in, double bytes, float ms, double err) {
        printf("%s  {\"kernel\": \"%s\", \"format\": \"%s\", \"rows\": %d, \"in\": %d, \"us\": %.2f, \"gbps\": %.1f, \"max_rel_err_vs_engine\": %.3g}",
               first ? "" : ",\n", kernel, fmt, rows, in, ms * 1e3, bytes / (ms * 1e-3) / 1e9, err);
        first = false;
    };
    // Plain read bandwidth of 1 GiB.
    {
        u64 n = (1ull << 30) / 16; uint4* d; u32* o; CK(cudaMalloc(&d, n * 16)); CK(cudaMalloc(&o, 4)); CK(cudaMemset(d, 1, n * 16));
        float ms = tm.ms([&] { read_bw<<<sms * 8, 512>>>(d, n, o); }, 20);
        emit("read_bw", "-", 0, 0, n * 16.0, ms, 0);
        cudaFree(d); cudaFree(o);
    }
    struct Shape { int rows, in; const char* what; };
    Shape shapes[] = {{34816, 5120, "mlp gate_up"}, {5120, 17408, "mlp down"}, {16480, 5120, "gdn in_proj"}, {14336, 5120, "attn qkv"}, {5120, 6144, "o/out_proj"}};
    float *x, *y0, *y1;
    CK(cudaMalloc(&x, 32768 * 4)); CK(cudaMalloc(&y0, 262144 * 4)); CK(cudaMalloc(&y1, 262144 * 4));
    { std::vector<float> hx(32768); std::normal_distribution<float> nd; for (auto& v : hx) v = nd(rng); CK(cudaMemcpy(x, hx.data(), hx.size() * 4, cudaMemcpyHostToDevice)); }
    const int QMV8_WARPS = 16;
    for (int fmt : {QF_NVFP4, QF_IQ3_S}) {
        const char* fname = fmt == QF_NVFP4 ? "nvfp4" : "iq3_s";
        for (auto s : shapes) {
            u64 rb = fmt == QF_NVFP4 ? (u64)s.in / 64 * 36 : (u64)s.in / 256 * 110;
            std::vector<unsigned char> hw(rb * s.rows); fill_bytes(hw, fmt, s.in, s.rows);
            unsigned char* w; CK(cudaMalloc(&w, hw.size())); CK(cudaMemcpy(w, hw.data(), hw.size(), cudaMemcpyHostToDevice));
            double bytes = (double)hw.size();
            // exact f32 kernel (engine: quant_matvec_1, 256 threads, 32 rows per block)
            float ms = tm.ms([&] { quant_matvec_1<<<(s.rows + 31) / 32, 256>>>(fmt, w, x, y0, s.in, s.rows, rb, 1.0f); });
            emit("quant_matvec_1 (exact)", fname, s.rows, s.in, bytes, ms, 0);
            std::vector<float> ref(s.rows), got(s.rows);
            CK(cudaMemcpy(ref.data(), y0, s.rows * 4, cudaMemcpyDeviceToHost));
            // engine's int8 plan
            int spr = s.in / 256;
            int rpw = std::min(std::max(s.rows / (sms * 16), 1), 8);
            rpw = std::min(std::max(rpw, (32 + spr - 1) / spr), 8);
            if (fmt == QF_IQ3_S && rpw % 2) rpw++;
            int smem = spr * (272 + 48) + (fmt == QF_NVFP4 ? 1024 : 2048 + 64 + QMV8_WARPS * 3520);
            int warps = (s.rows + rpw - 1) / rpw;
            int blocks = (warps + QMV8_WARPS - 1) / QMV8_WARPS;
            if (fmt == QF_NVFP4) {
                CK(cudaFuncSetAttribute(quant_matvec_nvfp4_q8, cudaFuncAttributeMaxDynamicSharedMemorySize, smem));
                ms = tm.ms([&] { quant_matvec_nvfp4_q8<<<blocks, 32 * QMV8_WARPS, smem>>>(w, x, y1, s.in, s.rows, rb, 1.0f, rpw); });
            } else {
                CK(cudaFuncSetAttribute(quant_matvec_iq3s_q8, cudaFuncAttributeMaxDynamicSharedMemorySize, smem));
                ms = tm.ms([&] { quant_matvec_iq3s_q8<<<blocks, 32 * QMV8_WARPS, smem>>>(w, x, y1, s.in, s.rows, rb, 1.0f, rpw); });
            }
            CK(cudaGetLastError());
            CK(cudaMemcpy(got.data(), y1, s.rows * 4, cudaMemcpyDeviceToHost));
            char kn[96]; snprintf(kn, sizeof kn, "engine q8 rpw=%d blocks=%d", rpw, blocks);
            emit(kn, fname, s.rows, s.in, bytes, ms, maxrel(got, ref));
            run_variants(fmt, fname, hw, x, y1, s.rows, s.in, rb, bytes, ref, tm, emit);
            cudaFree(w);
        }
    }
    // BF16 lm_head
    {
        int rows = 248320, in = 5120; u16* w; CK(cudaMalloc(&w, (u64)rows * in * 2)); CK(cudaMemset(w, 0x3c, (u64)rows * in * 2));
        float ms = tm.ms([&] { matvec_bf16_1<<<(rows + 7) / 8, 256>>>(w, x, y0, in, rows); }, 20);
        emit("matvec_bf16_1 (lm_head)", "bf16", rows, in, (double)rows * in * 2, ms, 0);
        cudaFree(w);
    }
    printf("\n]}\n");
    return 0;
}
