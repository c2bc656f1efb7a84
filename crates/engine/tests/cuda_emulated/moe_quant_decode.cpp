// kernels/moe_quant_decode.cu on the CPU emulator (emu.hpp): the decode step's grouped IQ3_S
// gate/up kernel against a double-precision reference that dequantizes each weight by the
// GGUF block layout (written out here, weight by weight), for random blocks. Each group is
// one expert with one row of x (groups share rows, as a decode step's do not, to check that
// each reads its own); gate and up rows interleaved or in halves.
//
// usage: moe_quant_decode groups hidden inter interleaved seed
#include "emu.hpp"
#include "kernels.inc"

#include <random>
#include <string>

// Weight i (0..255) of the IQ3_S block at b: d·(1 + 2·scale) · ±grid byte.
static double iq3s_weight(const unsigned char* b, int i) {
    const int entry = i / 4, sub = i / 32;
    const int index = b[2 + entry] | (((b[66 + entry / 8] >> (entry % 8)) & 1) << 8);
    const double mag = (QT_IQ3S[index] >> (8 * (i % 4))) & 255;
    const double sign = (b[74 + i / 8] >> (i % 8)) & 1 ? -1.0 : 1.0;
    const int scale = (b[106 + sub / 2] >> (4 * (sub % 2))) & 15;
    const double d = emu_f16_to_f32((unsigned short)(b[0] | (b[1] << 8)));
    return d * (1.0 + 2.0 * scale) * sign * mag;
}

int main(int argc, char** argv) {
    if (argc < 6) {
        std::fprintf(stderr, "usage: %s groups hidden inter interleaved seed\n", argv[0]);
        return 2;
    }
    const int groups = std::stoi(argv[1]), hidden = std::stoi(argv[2]), inter = std::stoi(argv[3]);
    const int interleaved = std::stoi(argv[4]);
    std::mt19937_64 rng(std::stoull(argv[5]));
    std::uniform_real_distribution<float> uni(-1.0f, 1.0f);
    const size_t row_bytes = (size_t)hidden / 256 * 110;
    const size_t expert_bytes = 2 * inter * row_bytes;
    // Random blocks, each with a sane d: a random f16 of magnitude 2^-8 .. 2^-5, either sign.
    std::vector<std::unique_ptr<unsigned char[]>> experts;
    for (int g = 0; g < groups; g++) {
        experts.emplace_back(new unsigned char[expert_bytes]);
        unsigned char* e = experts.back().get();
        for (size_t i = 0; i < expert_bytes; i++) e[i] = (unsigned char)rng();
        for (size_t b = 0; b < expert_bytes / 110; b++) {
            const unsigned exp = 7 + rng() % 3, m = rng() % 1024;
            const unsigned short d = (unsigned short)(((rng() & 1) << 15) | (exp << 10) | m);
            std::memcpy(e + 110 * b, &d, 2);
        }
    }
    const int xrows = 2;
    std::unique_ptr<float[]> x(new float[(size_t)xrows * hidden]);
    for (int i = 0; i < xrows * hidden; i++) x[i] = uni(rng);
    std::vector<u64> table((size_t)groups * 6);
    std::vector<u32> rows(groups);
    std::vector<float> mult(groups);
    for (int g = 0; g < groups; g++) {
        mult[g] = 0.5f + 0.25f * g;
        u32 bits;
        std::memcpy(&bits, &mult[g], 4);
        u64* t = &table[(size_t)g * 6];
        t[0] = (u64)experts[g].get();
        t[1] = 0;       // down rows: not read by the gate/up kernel
        t[2] = (u64)g;  // slot
        t[3] = 1;       // rows
        t[4] = bits;
        t[5] = 0;
        rows[g] = (u32)(g % xrows);
    }
    std::unique_ptr<float[]> act(new float[(size_t)groups * inter]);
    const unsigned warps = 8;
    emu::launch({(unsigned)((inter + warps - 1) / warps), (unsigned)groups, 1}, {32 * warps, 1, 1}, 0, [&] {
        moe_dec_gate_up_iq3_s(table.data(), rows.data(), x.get(), act.get(), hidden, inter, (u64)row_bytes,
                              interleaved);
    });

    // The error relative to the scale of the rounding: Σ|w·x| of each dot product, carried
    // through silu(g)·u (silu' ≤ 1.1).
    double err = 0;
    for (int g = 0; g < groups; g++) {
        const unsigned char* e = experts[g].get();
        const float* xr = x.get() + (size_t)rows[g] * hidden;
        for (int o = 0; o < inter; o++) {
            double dot[2] = {0, 0}, mag[2] = {0, 0};
            for (int m = 0; m < 2; m++) {
                const int r = interleaved ? 2 * o + m : m * inter + o;
                for (int i = 0; i < hidden; i++) {
                    const double p = iq3s_weight(e + r * row_bytes + 110 * (i / 256), i % 256) * xr[i];
                    dot[m] += p;
                    mag[m] += std::fabs(p);
                }
                dot[m] *= mult[g];
                mag[m] *= mult[g];
            }
            const double silu = dot[0] / (1.0 + std::exp(-dot[0]));
            const double scale = 1.1 * std::fabs(dot[1]) * mag[0] + std::fabs(silu) * mag[1] + 1e-30;
            err = emu::worst(err, std::fabs(act[(size_t)g * inter + o] - silu * dot[1]) / scale);
        }
    }
    std::printf("moe_dec_gate_up_iq3_s: max error %.3g of Σ|w·x|: %s\n", err, err <= 1e-5 ? "ok" : "TOO LARGE");
    return err <= 1e-5 ? 0 : 1;
}
