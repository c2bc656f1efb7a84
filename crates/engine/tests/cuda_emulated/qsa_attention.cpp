// kernels/qsa.cu `qsa_attn_split` and kernels/attention.cu `attn_combine` on the CPU emulator
// (emu.hpp): softmax attention of each query head over its query's token list, split into parts
// of `split` tokens as the host launches it, against a double-precision reference.
//
// usage: qsa_attention rows tokens heads kv_heads d split seed
#include "emu.hpp"
#include "kernels.inc"

#include <random>
#include <string>

int main(int argc, char** argv) {
    if (argc < 8) {
        std::fprintf(stderr, "usage: %s rows tokens heads kv_heads d split seed\n", argv[0]);
        return 2;
    }
    const int rows = std::stoi(argv[1]), T = std::stoi(argv[2]), heads = std::stoi(argv[3]);
    const int kv_heads = std::stoi(argv[4]), d = std::stoi(argv[5]), split = std::stoi(argv[6]);
    std::mt19937_64 rng(std::stoull(argv[7]));
    std::uniform_real_distribution<float> u(-1.0f, 1.0f);
    const int cap = T, splits = (cap + split - 1) / split;
    const float scale = 1.0f / std::sqrt((float)d);
    auto filled = [&](size_t len) {
        std::unique_ptr<float[]> b(new float[len]);
        for (size_t i = 0; i < len; i++) b[i] = u(rng);
        return b;
    };
    auto q = filled((size_t)rows * heads * d), k = filled((size_t)T * kv_heads * d), v = filled((size_t)T * kv_heads * d);
    // Each query's list: a random ascending subset of the tokens (some short, one empty-tailed).
    std::unique_ptr<int[]> tokens(new int[(size_t)rows * cap]), counts(new int[rows]);
    for (int i = 0; i < rows; i++) {
        int c = 0;
        const int keep = 1 + (int)(rng() % 4);  // keep about 1 in `keep`
        for (int t = 0; t < T; t++)
            if (rng() % keep == 0 || t == T - 1 - i) tokens[(size_t)i * cap + c++] = t;
        counts[i] = c;
    }
    std::unique_ptr<float[]> part_o(new float[(size_t)rows * heads * splits * d]);
    std::unique_ptr<float[]> part_ml(new float[(size_t)rows * heads * splits * 2]);
    std::unique_ptr<float[]> out(new float[(size_t)rows * heads * d]);
    emu::launch({(unsigned)heads, (unsigned)splits, (unsigned)rows}, {128, 1, 1}, 0, [&] {
        qsa_attn_split(q.get(), k.get(), v.get(), tokens.get(), counts.get(), part_o.get(), part_ml.get(), heads,
                       kv_heads, d, scale, split, cap);
    });
    emu::launch({(unsigned)heads, (unsigned)rows, 1}, {256, 1, 1}, 0,
                [&] { attn_combine(part_o.get(), part_ml.get(), out.get(), heads, d, splits, nullptr, nullptr, nullptr); });

    double err = 0, mx = 0;
    for (int i = 0; i < rows; i++)
        for (int h = 0; h < heads; h++) {
            const int kvh = h / (heads / kv_heads);
            const float* qh = q.get() + ((size_t)i * heads + h) * d;
            std::vector<double> sc(counts[i]);
            double m = -1e300, l = 0;
            for (int x = 0; x < counts[i]; x++) {
                const float* kr = k.get() + ((size_t)tokens[(size_t)i * cap + x] * kv_heads + kvh) * d;
                double dot = 0;
                for (int e = 0; e < d; e++) dot += (double)qh[e] * kr[e];
                sc[x] = dot * scale;
                m = std::max(m, sc[x]);
            }
            for (auto& s : sc) l += s = std::exp(s - m);
            for (int e = 0; e < d; e++) {
                double o = 0;
                for (int x = 0; x < counts[i]; x++)
                    o += sc[x] * v[((size_t)tokens[(size_t)i * cap + x] * kv_heads + kvh) * d + e];
                o /= l;
                err = emu::worst(err, std::fabs(out[((size_t)i * heads + h) * d + e] - o));
                mx = std::max(mx, std::fabs(o));
            }
        }
    const bool ok = err <= 1e-5 * std::max(1.0, mx);
    std::printf("qsa_attn_split + attn_combine: max |out - ref| %.3g (|ref| <= %.3g): %s\n", err, mx,
                ok ? "ok" : "TOO LARGE");
    return ok ? 0 : 1;
}
