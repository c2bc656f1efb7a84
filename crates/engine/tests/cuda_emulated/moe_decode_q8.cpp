// kernels/moe_quant_decode.cu's fast-path decode experts on the CPU emulator (emu.hpp): the
// IQ3_S gate/up and Q2_0 down kernels (Flash-Next's GGUF experts) or the NVFP4 pair, with the
// launches the engine plans, on random blocks. Two references each:
// - the same int8 rounding of x (amax/127 per 32 values, round to nearest even), integer sums
//   of the weights' integer values, scales in double: the kernels may differ by f32 rounding
//   only (≤ 1e-5 of Σ|terms|);
// - the dequantized weights times the unrounded x in double: the difference must stay within
//   the rounding's own bound, Σ|w| · step / 2 (a check that the rounding is the intended one).
//
// usage: moe_decode_q8 iq3s|nvfp4 groups hidden inter interleaved seed gate_up_blocks
//        gate_up_smem down_blocks down_smem
#include "emu.hpp"
#include "kernels.inc"
#include "q8_reference.hpp"
#include "random_blocks.hpp"

#include <random>
#include <string>

// Q2_0 weight i (0..63) of the block at b: (c − 1) and d.
static void q2_0_weight(const unsigned char* b, int i, int* value, double* scale) {
    *value = (int)((b[2 + i / 4] >> (2 * (i % 4))) & 3) - 1;
    *scale = emu_f16_to_f32((unsigned short)(b[0] | (b[1] << 8)));
}

// NVFP4 weight i (0..63) of the block at b: twice its E2M1 value (an integer) and half its
// E4M3 scale.
static void nvfp4_weight(const unsigned char* b, int i, int* value, double* scale) {
    static const int twice[8] = {0, 1, 2, 3, 4, 6, 8, 12};
    const int code = (b[4 + i / 2] >> (4 * (i % 2))) & 15;
    *value = code & 8 ? -twice[code & 7] : twice[code & 7];
    float s;
    std::memcpy(&s, &QT_E4M3[b[i / 16]], 4);
    *scale = 0.5 * s;
}

// A weight row against x three ways: with x rounded (exact integers, scales in double), the
// magnitude of its terms, the dequantized row against x itself, and the rounding's bound.
struct RowDot {
    double rounded = 0, rounded_mag = 0, exact = 0, bound = 0;
};
template <typename Weight>
static RowDot row_dot(const unsigned char* row, int n, int block_weights, int block_bytes, Weight weight,
                      const float* x, const std::vector<int>& q, const std::vector<float>& step) {
    RowDot r;
    for (int i = 0; i < n; i++) {
        int v;
        double s;
        weight(row + (size_t)block_bytes * (i / block_weights), i % block_weights, &v, &s);
        const double t = s * v * q[i] * step[i / 32];
        r.rounded += t;
        r.rounded_mag += std::fabs(t);
        r.exact += s * v * x[i];
        r.bound += std::fabs(s * v) * step[i / 32] * 0.5;
    }
    return r;
}

int main(int argc, char** argv) {
    if (argc < 11) {
        std::fprintf(stderr,
                     "usage: %s iq3s|nvfp4 groups hidden inter interleaved seed gu_blocks gu_smem down_blocks down_smem\n",
                     argv[0]);
        return 2;
    }
    const bool nvfp4 = std::string(argv[1]) == "nvfp4";
    const int groups = std::stoi(argv[2]), hidden = std::stoi(argv[3]), inter = std::stoi(argv[4]);
    const int interleaved = std::stoi(argv[5]);
    std::mt19937_64 rng(std::stoull(argv[6]));
    const unsigned gu_blocks = std::stoul(argv[7]), down_blocks = std::stoul(argv[9]);
    const size_t gu_smem = std::stoul(argv[8]), down_smem = std::stoul(argv[10]);
    std::uniform_real_distribution<float> uni(-1.0f, 1.0f);
    // Block weights and bytes of the gate/up and down formats.
    const int gu_bw = nvfp4 ? 64 : 256, gu_bb = nvfp4 ? 36 : 110, down_bb = nvfp4 ? 36 : 18;
    const size_t gu_row = (size_t)hidden / gu_bw * gu_bb, down_row = (size_t)inter / 64 * down_bb;
    const auto gu_weight = nvfp4 ? nvfp4_weight : iq3s_weight;
    const auto down_weight = nvfp4 ? nvfp4_weight : q2_0_weight;
    const char* gu_name = nvfp4 ? "moe_dec_gate_up_nvfp4_q8" : "moe_dec_gate_up_iq3s_q8";
    const char* down_name = nvfp4 ? "moe_dec_down_nvfp4_q8" : "moe_dec_down_q2_0_q8";
    std::vector<std::unique_ptr<unsigned char[]>> gate_up, down;
    for (int g = 0; g < groups; g++) {
        gate_up.push_back(random_blocks(rng, 2 * inter * gu_row, gu_bb, nvfp4));
        down.push_back(random_blocks(rng, hidden * down_row, down_bb, nvfp4));
    }
    // x rows with some zero groups of 32 (amax 0) and some large values.
    const int xrows = 2;
    std::unique_ptr<float[]> x(new float[(size_t)xrows * hidden]);
    for (int i = 0; i < xrows * hidden; i++) x[i] = uni(rng) * (i % 97 == 0 ? 20.0f : 1.0f);
    for (int i = 32; i < 64; i++) x[i] = 0.0f;
    std::vector<u64> table((size_t)groups * 6);
    std::vector<u32> rows(groups);
    std::vector<float> mult_gu(groups), mult_down(groups);
    for (int g = 0; g < groups; g++) {
        mult_gu[g] = 0.5f + 0.25f * g;
        mult_down[g] = 1.5f - 0.125f * g;
        u32 a, b;
        std::memcpy(&a, &mult_gu[g], 4);
        std::memcpy(&b, &mult_down[g], 4);
        u64* t = &table[(size_t)g * 6];
        t[0] = (u64)gate_up[g].get();
        t[1] = (u64)down[g].get();
        t[2] = (u64)g;  // slot
        t[3] = 1;       // rows
        t[4] = a;
        t[5] = b;
        rows[g] = (u32)(g % xrows);
    }
    std::unique_ptr<float[]> act(new float[(size_t)groups * inter]);
    std::unique_ptr<float[]> ys(new float[(size_t)groups * hidden]);
    const unsigned threads = 32 * 8;
    emu::launch({gu_blocks, (unsigned)groups, 1}, {threads, 1, 1}, gu_smem, [&] {
        (nvfp4 ? moe_dec_gate_up_nvfp4_q8 : moe_dec_gate_up_iq3s_q8)(table.data(), rows.data(), x.get(), act.get(),
                                                                     hidden, inter, (u64)gu_row, interleaved);
    });
    emu::launch({down_blocks, (unsigned)groups, 1}, {threads, 1, 1}, down_smem, [&] {
        (nvfp4 ? moe_dec_down_nvfp4_q8 : moe_dec_down_q2_0_q8)(table.data(), act.get(), ys.get(), hidden, inter,
                                                               (u64)down_row);
    });

    // Gate/up: act = silu(g)·u; errors carried through (silu' ≤ 1.1).
    double gu_err = 0, gu_bound_ratio = 0;
    std::vector<int> q;
    std::vector<float> step;
    for (int g = 0; g < groups; g++) {
        const float* xr = x.get() + (size_t)rows[g] * hidden;
        quantize(xr, hidden, q, step);
        for (int o = 0; o < inter; o++) {
            RowDot d[2];
            for (int m = 0; m < 2; m++) {
                const int r = interleaved ? 2 * o + m : m * inter + o;
                d[m] = row_dot(gate_up[g].get() + r * gu_row, hidden, gu_bw, gu_bb, gu_weight, xr, q, step);
                d[m].rounded *= mult_gu[g];
                d[m].rounded_mag *= mult_gu[g];
                d[m].exact *= mult_gu[g];
                d[m].bound *= mult_gu[g];
            }
            const double got = act[(size_t)g * inter + o];
            const double gr = d[0].rounded, ur = d[1].rounded;
            const double silu_r = gr / (1.0 + std::exp(-gr));
            const double scale = 1.1 * std::fabs(ur) * d[0].rounded_mag + std::fabs(silu_r) * d[1].rounded_mag + 1e-30;
            gu_err = emu::worst(gu_err, std::fabs(got - silu_r * ur) / scale);
            const double ge = d[0].exact, ue = d[1].exact;
            const double silu_e = ge / (1.0 + std::exp(-ge));
            const double allowed = 1.1 * std::fabs(ue) * d[0].bound + (std::fabs(silu_e) + 1.1 * d[0].bound) * d[1].bound;
            gu_bound_ratio = emu::worst(gu_bound_ratio, std::fabs(got - silu_e * ue) / (allowed * 1.001 + 1e-6 * scale + 1e-30));
        }
    }
    std::printf("%s: max error %.3g of Σ|w·x| against the same rounding: %s\n", gu_name, gu_err,
                gu_err <= 1e-5 ? "ok" : "TOO LARGE");
    std::printf("%s: max error %.3g of the rounding's bound against exact x: %s\n", gu_name, gu_bound_ratio,
                gu_bound_ratio <= 1.0 ? "ok" : "TOO LARGE");

    // Down: ys = down · act (the kernel's act as input).
    double down_err = 0, down_bound_ratio = 0;
    for (int g = 0; g < groups; g++) {
        const float* ar = act.get() + (size_t)g * inter;
        quantize(ar, inter, q, step);
        for (int o = 0; o < hidden; o++) {
            const RowDot d = row_dot(down[g].get() + o * down_row, inter, 64, down_bb, down_weight, ar, q, step);
            const double got = ys[(size_t)g * hidden + o];
            const double m = mult_down[g];
            down_err = emu::worst(down_err, std::fabs(got - m * d.rounded) / (m * d.rounded_mag + 1e-30));
            down_bound_ratio = emu::worst(
                down_bound_ratio, std::fabs(got - m * d.exact) / (m * d.bound * 1.001 + 1e-6 * m * d.rounded_mag + 1e-30));
        }
    }
    std::printf("%s: max error %.3g of Σ|w·x| against the same rounding: %s\n", down_name, down_err,
                down_err <= 1e-5 ? "ok" : "TOO LARGE");
    std::printf("%s: max error %.3g of the rounding's bound against exact x: %s\n", down_name, down_bound_ratio,
                down_bound_ratio <= 1.0 ? "ok" : "TOO LARGE");
    const bool ok = gu_err <= 1e-5 && gu_bound_ratio <= 1.0 && down_err <= 1e-5 && down_bound_ratio <= 1.0;
    return ok ? 0 : 1;
}
