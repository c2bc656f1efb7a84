// kernels/norm.cu `add_rms_norm_split` on the CPU emulator (emu.hpp), every block running at
// once as on the GPU: one row of `group` values normed by `blocks` blocks that meet at a
// barrier in global memory. Checked against a double reference, against the one-block
// `add_rms_norm` (the same sum in another order), its int8 copy against its own output, and
// the barrier's counters back at zero after each call (the next call starts from them).
//
// usage: norm_split group threads add seed
#include "emu.hpp"
#include "kernels.inc"

#include <random>
#include <string>

int main(int argc, char** argv) {
    if (argc < 5) {
        std::fprintf(stderr, "usage: %s group threads add seed\n", argv[0]);
        return 2;
    }
    const int group = std::stoi(argv[1]);
    const unsigned threads = (unsigned)std::stoi(argv[2]);
    const bool add = std::stoi(argv[3]) != 0;
    std::mt19937_64 rng(std::stoull(argv[4]));
    std::uniform_real_distribution<float> u(-2.0f, 2.0f), wd(-0.5f, 0.5f);
    const unsigned blocks = (unsigned)((group + threads * NORM_SPLIT_VALS - 1) / (threads * NORM_SPLIT_VALS));
    const float eps = 1e-6f;
    std::vector<float> x0(group), y(group), w(group);
    for (auto& v : x0) v = u(rng);
    for (auto& v : y) v = u(rng);
    for (auto& v : w) v = wd(rng);

    bool ok = true;
    std::vector<float> x = x0, out(group), partials(blocks, NAN), xs(group / 32);
    std::vector<unsigned char> xq(group);
    unsigned barrier[2] = {0, 0};
    double err = 0, vs_one = 0, qerr = 0;
    size_t residual_differs = 0;
    bool counters_reset = true;
    // Two calls in a row: the second runs on the first's residual, through the same barrier.
    for (int call = 0; call < 2; call++) {
        const std::vector<float> before = x;
        emu::launch_concurrent({blocks, 1, 1}, {threads, 1, 1}, 32 * sizeof(float), [&] {
            add_rms_norm_split(x.data(), add ? y.data() : nullptr, w.data(), out.data(), group, eps, 1, xq.data(),
                               xs.data(), partials.data(), barrier);
        });
        counters_reset &= barrier[0] == 0 && barrier[1] == 0;

        std::vector<float> summed(group);
        for (int i = 0; i < group; i++) summed[i] = add ? before[i] + y[i] : before[i];
        for (int i = 0; i < group; i++) residual_differs += std::memcmp(&x[i], &summed[i], 4) != 0;
        double ss = 0;
        for (float v : summed) ss += (double)v * v;
        const double inv = 1.0 / std::sqrt(ss / group + eps);
        for (int i = 0; i < group; i++) {
            const double ref = summed[i] * inv * (1.0 + w[i]);
            err = emu::worst(err, std::fabs(out[i] - ref) / std::max(1.0, std::fabs(ref)));
        }

        // The one-block kernel on the same input.
        std::vector<float> x1 = before, out1(group);
        const unsigned one_threads = (unsigned)std::min(1024, ((group + NORM_VALS - 1) / NORM_VALS + 31) / 32 * 32);
        emu::launch({1, 1, 1}, {one_threads, 1, 1}, 0, [&] {
            if (add)
                add_rms_norm(x1.data(), y.data(), w.data(), out1.data(), group, eps, 1, nullptr, nullptr);
            else
                rms_norm(x1.data(), w.data(), nullptr, out1.data(), group, eps, 1, nullptr, nullptr);
        });
        for (int i = 0; i < group; i++)
            vs_one = emu::worst(vs_one, std::fabs(out[i] - out1[i]) / std::max(1.0f, std::fabs(out1[i])));

        for (int c = 0; c < group / 32; c++)
            for (int j = 0; j < 32; j++) {
                const unsigned char b = xq[(j < 16 ? 0 : group / 2) + 16 * c + (j & 15)];
                qerr = emu::worst(qerr, std::fabs((double)(signed char)b * xs[c] - out[32 * c + j]) / xs[c]);
            }
    }
    std::printf("%u blocks of %u threads, group %d, add %d\n", blocks, threads, group, (int)add);
    std::printf("residual x + y: %zu values differ from the sum: %s\n", residual_differs,
                residual_differs == 0 ? "ok" : "DIFFERENT");
    ok &= residual_differs == 0;
    std::printf("against the double reference: max relative error %.3g: %s\n", err, err <= 1e-5 ? "ok" : "TOO LARGE");
    ok &= err <= 1e-5;
    std::printf("against the one-block kernel: max relative difference %.3g: %s\n", vs_one,
                vs_one <= 1e-6 ? "ok" : "TOO LARGE");
    ok &= vs_one <= 1e-6;
    std::printf("int8 copy: max |dequantised - value| %.3g steps: %s\n", qerr, qerr <= 0.5001 ? "ok" : "TOO LARGE");
    ok &= qerr <= 0.5001;
    std::printf("barrier counters zero after each call: %s\n", counters_reset ? "ok" : "NOT RESET");
    ok &= counters_reset;
    return ok ? 0 : 1;
}
