// kernels/norm.cu on the CPU emulator (emu.hpp): `rms_norm_wide` (the hyper-connection norms)
// against the two launches it replaces, `rms_norm` with a zero weight then `scale_cols`
// (kernels/hyper.cu), bit for bit, and against a double reference; its int8 copy (the q8r
// layout of common.cuh `store_q8r`) against its own output; `rms_norm_warps` against
// `rms_norm` bit for bit.
//
// usage: norm rows streams group threads seed
#include "emu.hpp"
#include "kernels.inc"

#include <cstring>
#include <random>
#include <string>
#include <vector>

int main(int argc, char** argv) {
    if (argc < 6) {
        std::fprintf(stderr, "usage: %s rows streams group threads seed\n", argv[0]);
        return 2;
    }
    const int rows = std::stoi(argv[1]), streams = std::stoi(argv[2]), group = std::stoi(argv[3]);
    const unsigned threads = (unsigned)std::stoi(argv[4]);
    std::mt19937_64 rng(std::stoull(argv[5]));
    std::uniform_real_distribution<float> u(-2.0f, 2.0f), w(-0.5f, 0.5f);
    const int span = streams * group, groups = rows * streams;
    const size_t n = (size_t)rows * span;
    const float eps = 1e-6f;
    std::unique_ptr<float[]> x(new float[n]), scale(new float[span]), zero(new float[group]);
    for (size_t i = 0; i < n; i++) x[i] = u(rng);
    for (int i = 0; i < span; i++) scale[i] = 1.0f + w(rng);
    for (int i = 0; i < group; i++) zero[i] = 0.0f;

    // The two launches rms_norm_wide replaces.
    std::unique_ptr<float[]> normed(new float[n]), two(new float[n]);
    emu::launch({(unsigned)groups, 1, 1}, {threads, 1, 1}, 0, [&] {
        rms_norm(x.get(), zero.get(), nullptr, normed.get(), group, eps, 1, nullptr, nullptr);
    });
    emu::launch({(unsigned)((n + 255) / 256), 1, 1}, {256, 1, 1}, 0,
                [&] { scale_cols(normed.get(), scale.get(), two.get(), (u64)n, span); });

    // The host asks for the int8 copy where the register path runs (backend/cuda `norm_out`).
    const bool q8 = group % 32 == 0 && group <= (int)threads * NORM_VALS;
    std::unique_ptr<float[]> one(new float[n]), xs(new float[n / 32]);
    std::unique_ptr<unsigned char[]> xq(new unsigned char[n]);
    emu::launch({(unsigned)groups, 1, 1}, {threads, 1, 1}, 0, [&] {
        rms_norm_wide(x.get(), scale.get(), one.get(), group, span, eps, q8 ? xq.get() : nullptr,
                      q8 ? xs.get() : nullptr);
    });

    bool ok = true;
    size_t differ = 0;
    for (size_t i = 0; i < n; i++) differ += std::memcmp(&one[i], &two[i], 4) != 0;
    std::printf("rms_norm_wide against rms_norm + scale_cols: %zu of %zu values differ: %s\n", differ, n,
                differ == 0 ? "ok" : "DIFFERENT");
    ok &= differ == 0;

    double err = 0;
    for (int g = 0; g < groups; g++) {
        double ss = 0;
        for (int i = 0; i < group; i++) ss += (double)x[(size_t)g * group + i] * x[(size_t)g * group + i];
        const double inv = 1.0 / std::sqrt(ss / group + eps);
        for (int i = 0; i < group; i++) {
            const size_t f = (size_t)g * group + i;
            const double ref = x[f] * inv * scale[f % span];
            err = emu::worst(err, std::fabs(one[f] - ref) / std::max(1.0, std::fabs(ref)));
        }
    }
    std::printf("rms_norm_wide against the double reference: max relative error %.3g: %s\n", err,
                err <= 1e-5 ? "ok" : "TOO LARGE");
    ok &= err <= 1e-5;

    // rms_norm_warps (a warp a group, NORM_WARPS a block) against rms_norm's one-warp blocks,
    // bit for bit: groups of 128 (the GDN output norm), a partial warp's worth, 256 (a head of
    // 256) and 32; gated and not, one_plus and not; a group count off a whole block.
    {
        size_t differ = 0, total = 0;
        for (const int gs : {128, 100, 256, 32})
            for (int variant = 0; variant < 4; variant++) {
                const int count = 37;
                const bool gated = variant & 1;
                const int plus = variant >> 1;
                const size_t len = (size_t)count * gs;
                std::vector<float> xv(len), gv(len), wv(gs), a(len, -7.0f), b(len, -7.0f);
                for (auto& f : xv) f = u(rng);
                for (auto& f : gv) f = u(rng);
                for (auto& f : wv) f = w(rng);
                const float* gp = gated ? gv.data() : nullptr;
                emu::launch({(unsigned)count, 1, 1}, {32, 1, 1}, 0, [&] {
                    rms_norm(xv.data(), wv.data(), gp, a.data(), gs, eps, plus, nullptr, nullptr);
                });
                emu::launch({(unsigned)((count + NORM_WARPS - 1) / NORM_WARPS), 1, 1}, {32 * NORM_WARPS, 1, 1}, 0,
                            [&] { rms_norm_warps(xv.data(), wv.data(), gp, b.data(), gs, (u64)count, eps, plus); });
                for (size_t i = 0; i < len; i++) differ += std::memcmp(&a[i], &b[i], 4) != 0;
                total += len;
            }
        std::printf("rms_norm_warps against rms_norm: %zu of %zu values differ: %s\n", differ, total,
                    differ == 0 ? "ok" : "DIFFERENT");
        ok &= differ == 0;
    }

    // q8r: value 32c + j at xq[16c + j] (j < 16) or xq[n/2 + 16c + j - 16], step xs[c].
    if (!q8) {
        std::printf("int8 copy: not asked for (looping path): ok\n");
        return ok ? 0 : 1;
    }
    double qerr = 0;
    for (size_t c = 0; c < n / 32; c++)
        for (int j = 0; j < 32; j++) {
            const unsigned char b = xq[(j < 16 ? 0 : n / 2) + 16 * c + (j & 15)];
            const double deq = (double)(signed char)b * xs[c];
            qerr = emu::worst(qerr, std::fabs(deq - one[32 * c + j]) / xs[c]);
        }
    std::printf("int8 copy: max |dequantised - value| %.3g steps: %s\n", qerr, qerr <= 0.5001 ? "ok" : "TOO LARGE");
    ok &= qerr <= 0.5001;
    return ok ? 0 : 1;
}
