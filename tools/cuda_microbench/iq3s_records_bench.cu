// Microbenchmark of the IQ3_S decode matvecs (kernels/quant_matvec.cu) on the shapes of
// Qwen3.8-27B: the block-layout int8 kernel (quant_matvec_iq3s_q8, as the engine plans it)
// against the records kernels (quant_matvec_iq3sr_q8_*, plain and split-K, on the engine's
// repack: backend/cuda/iq3s_records.rs) and against a kernel that issues the records kernel's
// loads with no decode, with nvcc on the GPU box:
//   nvcc -O3 -arch=sm_90 -std=c++17 -o iq3sb tools/cuda_microbench/iq3s_records_bench.cu && ./iq3sb
// The grid table holds random odd values 1..15 like the real one (the kernel's negation relies
// on odd grid bytes); every kernel is checked against the exact f32 kernel on the same data, and
// the exact kernel on records against the exact kernel on blocks (bit for bit).
#include <cuda_runtime.h>
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>
#include <vector>

#include "../../kernels/common.cuh"
#include "quant_formats.cuh"
#include "../../kernels/quant_matvec.cu"

#define CK(x)                                                                                      \
    do {                                                                                           \
        cudaError_t ck_err_ = (x);                                                                 \
        if (ck_err_ != cudaSuccess) {                                                              \
            printf("%s:%d %s\n", __FILE__, __LINE__, cudaGetErrorString(ck_err_));                 \
            exit(1);                                                                               \
        }                                                                                          \
    } while (0)

struct Timer {
    cudaEvent_t a, b;
    Timer() { cudaEventCreate(&a); cudaEventCreate(&b); }
    template <class F> float ms(F f, int iters = 50) {
        f();
        CK(cudaDeviceSynchronize());
        cudaEventRecord(a);
        for (int i = 0; i < iters; i++) f();
        cudaEventRecord(b);
        CK(cudaEventSynchronize(b));
        float t;
        cudaEventElapsedTime(&t, a, b);
        return t / iters;
    }
};

__global__ void read_bw(const uint4* p, u64 n, u32* out) {
    u32 acc = 0;
    for (u64 i = blockIdx.x * (u64)blockDim.x + threadIdx.x; i < n; i += (u64)gridDim.x * blockDim.x) {
        uint4 v = __ldg(p + i);
        acc ^= v.x ^ v.y ^ v.z ^ v.w;
    }
    if (acc == 0x12345678u) out[0] = acc;
}

// The loads of quant_matvec_iq3sr_q8_1 (a row a half-warp, every plane of the lane's slot, x
// and its scales) with the decode left out: what the memory system gives this access pattern.
__global__ void probe_iq3sr_loads(const unsigned char* w, const unsigned char* xq, const float* xs, float* y, int in,
                                  int out, u64 row_bytes) {
    const int slot = threadIdx.x & 15;
    const int row = min((int)(blockIdx.x * IQ3SR_HALF_WARPS + (threadIdx.x >> 4)), out - 1);
    const uint4* xa = (const uint4*)xq;
    const uint4* xb = (const uint4*)(xq + (in >> 1));
    u32 acc = 0;
    for (int r = 0; r < (in >> 10); r++) {
        const unsigned char* rec = w + (u64)row * row_bytes + (u64)r * IQ3SR_RECORD;
        const unsigned char* body = iq3sr_body(rec);
        const uint4 i4 = __ldg((const uint4*)body + slot);
        const uint2 s2 = __ldg((const uint2*)(body + IQ3SR_SIGNS) + slot);
        const int c = 32 * r + 2 * slot;
        const uint4 x0 = __ldg(xa + c), x1 = __ldg(xb + c), x2 = __ldg(xa + c + 1), x3 = __ldg(xb + c + 1);
        acc ^= i4.x ^ i4.y ^ i4.z ^ i4.w ^ s2.x ^ s2.y ^ __ldg((const u16*)(body + IQ3SR_HIGH) + slot) ^
               __ldg(body + IQ3SR_SCALES + slot) ^ __ldg((const u16*)iq3sr_d(rec) + (slot >> 2)) ^ x0.x ^ x1.y ^
               x2.z ^ x3.w ^ __float_as_uint(__ldg(xs + c));
    }
    if (acc == 0x12345u) y[row] = (float)acc;
}

// Blocks → records, as backend/cuda/iq3s_records.rs `to_records` (the matrix 16-byte aligned).
static std::vector<unsigned char> to_records(const std::vector<unsigned char>& blocks) {
    std::vector<unsigned char> out(blocks.size(), 0);
    for (size_t n = 0; n < blocks.size() / 440; n++) {
        unsigned char* rec = out.data() + n * 440;
        const size_t body_at = (n * 440) % 16 == 8 ? 8 : 0, d_at = body_at ? 0 : 432;
        unsigned char* body = rec + body_at;
        for (int b = 0; b < 4; b++) {
            const unsigned char* blk = blocks.data() + n * 440 + b * 110;
            memcpy(rec + d_at + 2 * b, blk, 2);
            const unsigned char *qs = blk + 2, *qh = blk + 66, *signs = blk + 74, *scales = blk + 106;
            for (int u = 0; u < 4; u++) {
                const int slot = 4 * b + u;
                unsigned char packed[18] = {0};
                for (int k = 0; k < 16; k++) {
                    const int i = 16 * u + k;
                    const u32 index = qs[i] | (((qh[i / 8] >> (i % 8)) & 1u) << 8);
                    const int bit = 9 * k;
                    const u32 v = index << (bit % 8);
                    packed[bit / 8] |= (unsigned char)v;
                    packed[bit / 8 + 1] |= (unsigned char)(v >> 8);
                }
                memcpy(body + 16 * slot, packed, 16);
                memcpy(body + IQ3SR_HIGH + 2 * slot, packed + 16, 2);
                u32 words[2] = {0, 0};
                for (int k = 0; k < 16; k++)
                    for (int q = 0; q < 4; q++) {
                        const int wi = 64 * u + 4 * k + q;
                        words[k / 8] |= (u32)((signs[wi / 8] >> (wi % 8)) & 1) << (8 * q + 7 - k % 8);
                    }
                memcpy(body + IQ3SR_SIGNS + 8 * slot, words, 8);
                body[IQ3SR_SCALES + slot] = scales[u];
            }
        }
    }
    return out;
}

static double maxrel(const std::vector<float>& a, const std::vector<float>& b) {
    double m = 0, s = 0;
    for (size_t i = 0; i < a.size(); i++) {
        m = fmax(m, fabs(a[i] - b[i]));
        s = fmax(s, fabs(b[i]));
    }
    return m / (s + 1e-30);
}

// Record loops unrolled twice where the engine has no such kernel.
#define IQ3SR_Q8_UNROLL2(HRPW, KS)                                                                       \
    __global__ void iq3sr_q8_##HRPW##_##KS##_unroll2(const unsigned char* w, const unsigned char* xq,       \
                                                    const float* xs, float* y, int in, int out,            \
                                                    u64 row_bytes, float mult) {                           \
        KERNEL_START();                                                                                  \
        iq3sr_q8_impl<HRPW, KS, 2>(w, xq, xs, y, in, out, row_bytes, mult);                              \
    }
IQ3SR_Q8_UNROLL2(1, 1)
IQ3SR_Q8_UNROLL2(1, 2)
IQ3SR_Q8_UNROLL2(1, 4)

// Session 26: ncu showed quant_matvec_iq3sr_q8_2 on the 27B gate/up shape held at 3 blocks an SM
// by its 72 registers (24 warps; 2.75 waves of 1088 blocks) with L1TEX scoreboard stalls 59% of
// its cycles. These variants ask for 4 blocks an SM (at most 64 registers), or take 3 or 4 rows
// a half-warp (fewer blocks: 1.8 or 1.4 waves at 3 an SM).
#define IQ3SR_Q8_LB(NAME, HRPW, UNROLL, MINB)                                                        \
    __global__ void __launch_bounds__(256, MINB)                                                     \
        NAME(const unsigned char* w, const unsigned char* xq, const float* xs, float* y, int in, int out, \
             u64 row_bytes, float mult) {                                                            \
        KERNEL_START();                                                                              \
        iq3sr_q8_impl<HRPW, 1, UNROLL>(w, xq, xs, y, in, out, row_bytes, mult);                      \
    }
IQ3SR_Q8_LB(iq3sr_q8_2_lb4, 2, 1, 4)
IQ3SR_Q8_LB(iq3sr_q8_2_unroll2_lb4, 2, 2, 4)
IQ3SR_Q8_LB(iq3sr_q8_1_lb4, 1, 1, 4)
IQ3SR_Q8_LB(iq3sr_q8_3, 3, 1, 1)
IQ3SR_Q8_LB(iq3sr_q8_4, 4, 1, 1)

typedef void (*RecordsKernel)(const unsigned char*, const unsigned char*, const float*, float*, int, int, u64, float);

int main() {
    cudaDeviceProp p;
    CK(cudaGetDeviceProperties(&p, 0));
    const int sms = p.multiProcessorCount;
    std::mt19937_64 rng(7);
    printf("{\"gpu\": \"%s\", \"sms\": %d, \"results\": [\n", p.name, sms);
    {
        u32 g[512];
        for (auto& v : g) {
            v = 0;
            for (int j = 0; j < 4; j++) v |= (u32)(1 + 2 * (rng() % 8)) << (8 * j);
        }
        CK(cudaMemcpyToSymbol(QT_IQ3S, g, sizeof g));
    }
    Timer tm;
    bool first = true;
    auto emit = [&](const char* kernel, int rows, int in, double bytes, float ms, double err) {
        printf("%s  {\"kernel\": \"%s\", \"rows\": %d, \"in\": %d, \"us\": %.2f, \"gbps\": %.1f, \"max_rel_err\": %.3g}",
               first ? "" : ",\n", kernel, rows, in, ms * 1e3, bytes / (ms * 1e-3) / 1e9, err);
        first = false;
    };
    {
        const u64 n = (1ull << 30) / 16;
        uint4* d;
        u32* o;
        CK(cudaMalloc(&d, n * 16));
        CK(cudaMalloc(&o, 4));
        CK(cudaMemset(d, 1, n * 16));
        emit("read_bw", 0, 0, n * 16.0, tm.ms([&] { read_bw<<<sms * 8, 512>>>(d, n, o); }, 20), 0);
        cudaFree(d);
        cudaFree(o);
    }
    struct Shape { int rows, in; };
    const Shape shapes[] = {{34816, 5120}, {5120, 17408}, {16480, 5120}, {14336, 5120}, {5120, 6144}};
    float *x, *y0, *y1;
    unsigned char* xq;
    float* xs;
    CK(cudaMalloc(&x, 32768 * 4));
    CK(cudaMalloc(&y0, 65536 * 4));
    CK(cudaMalloc(&y1, 65536 * 4));
    CK(cudaMalloc(&xq, 32768));
    CK(cudaMalloc(&xs, 32768 / 32 * 4));
    {
        std::vector<float> hx(32768);
        std::normal_distribution<float> nd;
        for (auto& v : hx) v = nd(rng);
        CK(cudaMemcpy(x, hx.data(), hx.size() * 4, cudaMemcpyHostToDevice));
    }
    const RecordsKernel plain[] = {quant_matvec_iq3sr_q8_1, quant_matvec_iq3sr_q8_2};
    const RecordsKernel unrolled[] = {iq3sr_q8_1_1_unroll2, quant_matvec_iq3sr_q8_2_unroll2};
    struct SplitK { const char* name; RecordsKernel k; int rpw, ks; };
    const SplitK splitk[] = {{"quant_matvec_iq3sr_q8k_2_4", quant_matvec_iq3sr_q8k_2_4, 2, 4},
                             {"quant_matvec_iq3sr_q8k_1_2", quant_matvec_iq3sr_q8k_1_2, 1, 2},
                             {"quant_matvec_iq3sr_q8k_2_8", quant_matvec_iq3sr_q8k_2_8, 2, 8},
                             {"quant_matvec_iq3sr_q8k_1_4", quant_matvec_iq3sr_q8k_1_4, 1, 4},
                             {"quant_matvec_iq3sr_q8k_1_8", quant_matvec_iq3sr_q8k_1_8, 1, 8},
                             {"q8k_1_2 unroll 2", iq3sr_q8_1_2_unroll2, 1, 2},
                             {"q8k_1_4 unroll 2", iq3sr_q8_1_4_unroll2, 1, 4}};
    for (auto s : shapes) {
        const u64 rb = (u64)s.in / 256 * 110;
        std::vector<unsigned char> hw(rb * s.rows);
        for (auto& b : hw) b = rng() & 255;
        for (size_t blk = 0; blk < hw.size() / 110; blk++) {  // finite, small f16 d
            hw[blk * 110] = 0x00;
            hw[blk * 110 + 1] = 0x1c;
        }
        const std::vector<unsigned char> hr = to_records(hw);
        unsigned char *wb, *wr;
        CK(cudaMalloc(&wb, hw.size()));
        CK(cudaMalloc(&wr, hr.size()));
        CK(cudaMemcpy(wb, hw.data(), hw.size(), cudaMemcpyHostToDevice));
        CK(cudaMemcpy(wr, hr.data(), hr.size(), cudaMemcpyHostToDevice));
        const double bytes = (double)hw.size();
        std::vector<float> ref(s.rows), got(s.rows);
        auto check = [&] {
            CK(cudaGetLastError());
            CK(cudaMemcpy(got.data(), y1, s.rows * 4, cudaMemcpyDeviceToHost));
            return maxrel(got, ref);
        };
        float ms = tm.ms([&] { quant_matvec_1<<<(s.rows + 31) / 32, 256>>>(QF_IQ3_S, wb, x, y0, s.in, s.rows, rb, 1.0f); });
        CK(cudaMemcpy(ref.data(), y0, s.rows * 4, cudaMemcpyDeviceToHost));
        emit("quant_matvec_1 (exact, blocks)", s.rows, s.in, bytes, ms, 0);
        ms = tm.ms([&] { quant_matvec_1<<<(s.rows + 31) / 32, 256>>>(QF_IQ3SR, wr, x, y1, s.in, s.rows, rb, 1.0f); });
        CK(cudaMemcpy(got.data(), y1, s.rows * 4, cudaMemcpyDeviceToHost));
        const bool same = memcmp(got.data(), ref.data(), s.rows * 4) == 0;
        emit(same ? "quant_matvec_1 (exact, records): identical" : "quant_matvec_1 (exact, records): DIFFERS", s.rows,
             s.in, bytes, ms, maxrel(got, ref));
        // The block kernel as backend/cuda/mod.rs `int8_matvec_plan` launches it.
        {
            const int warps_per_block = 16, spr = s.in / 256;
            int rpw = std::min(std::max(s.rows / (sms * 16), 1), 8);
            rpw = std::min(std::max(rpw, (32 + spr - 1) / spr), 8);
            if (rpw % 2) rpw++;
            const int smem = spr * (272 + 48) + 2048 + 64 + warps_per_block * 3520;
            const int blocks = ((s.rows + rpw - 1) / rpw + warps_per_block - 1) / warps_per_block;
            CK(cudaFuncSetAttribute(quant_matvec_iq3s_q8, cudaFuncAttributeMaxDynamicSharedMemorySize, smem));
            ms = tm.ms([&] { quant_matvec_iq3s_q8<<<blocks, 32 * warps_per_block, smem>>>(wb, x, y1, s.in, s.rows, rb, 1.0f, rpw); });
            char kn[96];
            snprintf(kn, sizeof kn, "quant_matvec_iq3s_q8 (blocks) rpw=%d blocks=%d", rpw, blocks);
            emit(kn, s.rows, s.in, bytes, ms, check());
        }
        ms = tm.ms([&] { quantize_x_q8r<<<(s.in / 32 + 127) / 128, 128>>>(x, s.in, xq, xs); });
        emit("quantize_x_q8r", s.rows, s.in, s.in * 4.0, ms, 0);
        for (int h = 0; h < 2; h++) {
            const int blocks = (s.rows + 16 * (h + 1) - 1) / (16 * (h + 1));
            for (int u = 0; u < 2; u++) {
                ms = tm.ms([&] { (u ? unrolled : plain)[h]<<<blocks, 256>>>(wr, xq, xs, y1, s.in, s.rows, rb, 1.0f); });
                char kn[96];
                snprintf(kn, sizeof kn, "quant_matvec_iq3sr_q8_%d%s blocks=%d", h + 1, u ? " unroll 2" : "", blocks);
                emit(kn, s.rows, s.in, bytes, ms, check());
            }
        }
        {
            struct Variant { const char* name; RecordsKernel k; int hrpw; };
            const Variant variants[] = {{"iq3sr_q8_2 launch_bounds(256,4)", iq3sr_q8_2_lb4, 2},
                                        {"iq3sr_q8_2 unroll 2 launch_bounds(256,4)", iq3sr_q8_2_unroll2_lb4, 2},
                                        {"iq3sr_q8_1 launch_bounds(256,4)", iq3sr_q8_1_lb4, 1},
                                        {"iq3sr_q8_3", iq3sr_q8_3, 3},
                                        {"iq3sr_q8_4", iq3sr_q8_4, 4}};
            for (auto v : variants) {
                const int blocks = (s.rows + 16 * v.hrpw - 1) / (16 * v.hrpw);
                ms = tm.ms([&] { v.k<<<blocks, 256>>>(wr, xq, xs, y1, s.in, s.rows, rb, 1.0f); });
                char kn[96];
                snprintf(kn, sizeof kn, "%s blocks=%d", v.name, blocks);
                emit(kn, s.rows, s.in, bytes, ms, check());
            }
        }
        for (auto k : splitk) {
            if (s.in / 1024 < k.ks) continue;
            const int blocks = (s.rows + k.rpw * (16 / k.ks) - 1) / (k.rpw * (16 / k.ks));
            ms = tm.ms([&] { k.k<<<blocks, 256>>>(wr, xq, xs, y1, s.in, s.rows, rb, 1.0f); });
            char kn[96];
            snprintf(kn, sizeof kn, "%s blocks=%d", k.name, blocks);
            emit(kn, s.rows, s.in, bytes, ms, check());
        }
        ms = tm.ms([&] { probe_iq3sr_loads<<<(s.rows + 15) / 16, 256>>>(wr, xq, xs, y1, s.in, s.rows, rb); });
        emit("probe: records loads, no decode", s.rows, s.in, bytes, ms, 0);
        cudaFree(wb);
        cudaFree(wr);
    }
    printf("\n]}\n");
    return 0;
}
