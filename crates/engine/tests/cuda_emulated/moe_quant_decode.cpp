// kernels/moe_quant_decode.cu on the CPU emulator (emu.hpp): the decode step's grouped gate/up
// and down kernels of one format pair (iq3_s or q2_0 each) against a double-precision
// reference that dequantizes each weight by the block layouts (written out here, weight by
// weight), for random blocks. Each group is one expert with one row of x (groups share rows,
// as a decode step's do not, to check that each reads its own); gate and up rows interleaved
// or in halves.
//
// usage: moe_quant_decode gate_up_format down_format groups hidden inter interleaved seed
#include "emu.hpp"
#include "kernels.inc"

#include <random>
#include <string>

static float f16_bits(const unsigned char* b) { return emu_f16_to_f32((unsigned short)(b[0] | (b[1] << 8))); }

// Weight i (0..255) of the IQ3_S block at b: d·(1 + 2·scale) · ±grid byte.
static double iq3s_weight(const unsigned char* b, int i) {
    const int entry = i / 4, sub = i / 32;
    const int index = b[2 + entry] | (((b[66 + entry / 8] >> (entry % 8)) & 1) << 8);
    const double mag = (QT_IQ3S[index] >> (8 * (i % 4))) & 255;
    const double sign = (b[74 + i / 8] >> (i % 8)) & 1 ? -1.0 : 1.0;
    const int scale = (b[106 + sub / 2] >> (4 * (sub % 2))) & 15;
    return f16_bits(b) * (1.0 + 2.0 * scale) * sign * mag;
}

// Weight i (0..63) of the Q2_0 block at b: d·(c - 1).
static double q2_0_weight(const unsigned char* b, int i) {
    const int c = (b[2 + i / 4] >> (2 * (i % 4))) & 3;
    return f16_bits(b) * (c - 1.0);
}

struct Format {
    int block_weights, block_bytes;
    double (*weight)(const unsigned char*, int);
    // Writes sane scales over a block of random bytes.
    void (*scales)(unsigned char*, std::mt19937_64&);
};

// A random f16 of magnitude 2^-8 .. 2^-5 (a block's d), either sign.
static void f16_scale(unsigned char* b, std::mt19937_64& rng) {
    const unsigned e = 7 + rng() % 3, m = rng() % 1024;
    const unsigned short d = (unsigned short)(((rng() & 1) << 15) | (e << 10) | m);
    std::memcpy(b, &d, 2);
}

static Format format(const std::string& name) {
    if (name == "iq3_s") return {256, 110, iq3s_weight, f16_scale};
    if (name == "q2_0") return {64, 18, q2_0_weight, f16_scale};
    std::fprintf(stderr, "unknown format %s (iq3_s, q2_0)\n", name.c_str());
    std::exit(2);
}

// The format's kernels (moe_quant_decode.cu's instances).
static void gate_up_kernel(const std::string& f, const u64* groups, const u32* rows, const float* x, float* act,
                           int hidden, int inter, u64 row_bytes, int interleaved) {
    if (f == "iq3_s") moe_dec_gate_up_iq3_s(groups, rows, x, act, hidden, inter, row_bytes, interleaved);
    if (f == "q2_0") moe_dec_gate_up_q2_0(groups, rows, x, act, hidden, inter, row_bytes, interleaved);
}
static void down_kernel(const std::string& f, const u64* groups, const float* act, float* ys, int hidden, int inter,
                        u64 row_bytes) {
    if (f == "iq3_s") moe_dec_down_iq3_s(groups, act, ys, hidden, inter, row_bytes);
    if (f == "q2_0") moe_dec_down_q2_0(groups, act, ys, hidden, inter, row_bytes);
}

int main(int argc, char** argv) {
    if (argc < 8) {
        std::fprintf(stderr, "usage: %s gate_up_format down_format groups hidden inter interleaved seed\n", argv[0]);
        return 2;
    }
    const std::string gu_name = argv[1], down_name = argv[2];
    const Format gu = format(gu_name), dn = format(down_name);
    const int groups = std::stoi(argv[3]), hidden = std::stoi(argv[4]), inter = std::stoi(argv[5]);
    const int interleaved = std::stoi(argv[6]);
    std::mt19937_64 rng(std::stoull(argv[7]));
    std::uniform_real_distribution<float> uni(-1.0f, 1.0f);
    const size_t gu_row = (size_t)hidden / gu.block_weights * gu.block_bytes;
    const size_t down_row = (size_t)inter / dn.block_weights * dn.block_bytes;
    // Each expert: 2·inter gate/up rows, then hidden down rows, as one buffer.
    const size_t expert_bytes = 2 * inter * gu_row + hidden * down_row;
    std::vector<std::unique_ptr<unsigned char[]>> experts;
    for (int g = 0; g < groups; g++) {
        experts.emplace_back(new unsigned char[expert_bytes]);
        unsigned char* e = experts.back().get();
        for (size_t i = 0; i < expert_bytes; i++) e[i] = (unsigned char)rng();
        for (int r = 0; r < 2 * inter; r++)
            for (int b = 0; b < hidden / gu.block_weights; b++) gu.scales(e + r * gu_row + gu.block_bytes * b, rng);
        for (int r = 0; r < hidden; r++)
            for (int b = 0; b < inter / dn.block_weights; b++)
                dn.scales(e + 2 * inter * gu_row + r * down_row + dn.block_bytes * b, rng);
    }
    const int xrows = 2;
    std::unique_ptr<float[]> x(new float[(size_t)xrows * hidden]);
    for (int i = 0; i < xrows * hidden; i++) x[i] = uni(rng);
    std::vector<u64> table((size_t)groups * 6);
    std::vector<u32> rows(groups);
    std::vector<float> mult_gu(groups), mult_down(groups);
    for (int g = 0; g < groups; g++) {
        unsigned char* e = experts[g].get();
        mult_gu[g] = 0.5f + 0.25f * g;
        mult_down[g] = 1.5f - 0.125f * g;
        u32 mg, md;
        std::memcpy(&mg, &mult_gu[g], 4);
        std::memcpy(&md, &mult_down[g], 4);
        u64* t = &table[(size_t)g * 6];
        t[0] = (u64)e;
        t[1] = (u64)(e + 2 * inter * gu_row);
        t[2] = (u64)g;  // slot
        t[3] = 1;       // rows
        t[4] = mg;
        t[5] = md;
        rows[g] = (u32)(g % xrows);
    }
    std::unique_ptr<float[]> act(new float[(size_t)groups * inter]);
    std::unique_ptr<float[]> ys(new float[(size_t)groups * hidden]);
    const unsigned warps = 8;
    emu::launch({(unsigned)((inter + warps - 1) / warps), (unsigned)groups, 1}, {32 * warps, 1, 1}, 0, [&] {
        gate_up_kernel(gu_name, table.data(), rows.data(), x.get(), act.get(), hidden, inter, (u64)gu_row, interleaved);
    });
    const unsigned down_rows = warps * (32 / MOE_DEC_DOWN_LANES);
    emu::launch({(unsigned)((hidden + down_rows - 1) / down_rows), (unsigned)groups, 1}, {32 * warps, 1, 1}, 0,
                [&] { down_kernel(down_name, table.data(), act.get(), ys.get(), hidden, inter, (u64)down_row); });

    // Errors relative to Σ|w·x| of each dot product (the scale of its rounding).
    double gu_err = 0, down_err = 0;
    for (int g = 0; g < groups; g++) {
        const unsigned char* e = experts[g].get();
        const float* xr = x.get() + (size_t)rows[g] * hidden;
        for (int o = 0; o < inter; o++) {
            double dot[2] = {0, 0}, mag[2] = {0, 0};
            for (int m = 0; m < 2; m++) {
                const int r = interleaved ? 2 * o + m : m * inter + o;
                for (int i = 0; i < hidden; i++) {
                    const double p =
                        gu.weight(e + r * gu_row + gu.block_bytes * (i / gu.block_weights), i % gu.block_weights) * xr[i];
                    dot[m] += p;
                    mag[m] += std::fabs(p);
                }
                dot[m] *= mult_gu[g];
                mag[m] *= mult_gu[g];
            }
            const double silu = dot[0] / (1.0 + std::exp(-dot[0]));
            const double want = silu * dot[1];
            // d(silu(g)·u) ≈ silu'(g)·u·dg + silu(g)·du, silu' ≤ 1.1.
            const double scale = 1.1 * std::fabs(dot[1]) * mag[0] + std::fabs(silu) * mag[1] + 1e-30;
            gu_err = emu::worst(gu_err, std::fabs(act[(size_t)g * inter + o] - want) / scale);
        }
        const unsigned char* down = e + 2 * inter * gu_row;
        for (int o = 0; o < hidden; o++) {
            double dot = 0, mag = 0;
            for (int i = 0; i < inter; i++) {
                const double p = dn.weight(down + o * down_row + dn.block_bytes * (i / dn.block_weights), i % dn.block_weights) *
                                 act[(size_t)g * inter + i];
                dot += p;
                mag += std::fabs(p);
            }
            dot *= mult_down[g];
            mag *= mult_down[g];
            down_err = emu::worst(down_err, std::fabs(ys[(size_t)g * hidden + o] - dot) / (mag + 1e-30));
        }
    }
    bool ok = true;
    std::printf("moe_dec_gate_up_%s: max error %.3g of Σ|w·x|: %s\n", gu_name.c_str(), gu_err,
                gu_err <= 1e-5 ? "ok" : "TOO LARGE");
    ok &= gu_err <= 1e-5;
    std::printf("moe_dec_down_%s: max error %.3g of Σ|w·x|: %s\n", down_name.c_str(), down_err,
                down_err <= 1e-5 ? "ok" : "TOO LARGE");
    ok &= down_err <= 1e-5;
    return ok ? 0 : 1;
}
