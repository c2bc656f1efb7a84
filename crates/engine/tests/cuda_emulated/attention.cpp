// kernels/attention.cu `attn_split` + `attn_combine` (decode attention, split over the KV
// length, up to 6 query heads of one KV head a block) on the CPU emulator (emu.hpp), against a
// double-precision causal softmax: query i at position past + i sees keys 0..past + i.
//
// usage: attention rows past heads kv_heads d split_len seed
#include "emu.hpp"
#include "kernels.inc"

#include <random>
#include <string>

int main(int argc, char** argv) {
    if (argc < 8) {
        std::fprintf(stderr, "usage: %s rows past heads kv_heads d split_len seed\n", argv[0]);
        return 2;
    }
    const int rows = std::stoi(argv[1]), past = std::stoi(argv[2]), heads = std::stoi(argv[3]);
    const int kv_heads = std::stoi(argv[4]), d = std::stoi(argv[5]), split_len = std::stoi(argv[6]);
    std::mt19937_64 rng(std::stoull(argv[7]));
    std::uniform_real_distribution<float> u(-1.0f, 1.0f);
    const int T = past + rows, splits = (T + split_len - 1) / split_len;
    const int group = heads / kv_heads, blocks = kv_heads * ((group + 5) / 6);
    const float scale = 1.0f / std::sqrt((float)d);
    auto filled = [&](size_t len) {
        std::unique_ptr<float[]> b(new float[len]);
        for (size_t i = 0; i < len; i++) b[i] = u(rng);
        return b;
    };
    auto q = filled((size_t)rows * heads * d), k = filled((size_t)T * kv_heads * d), v = filled((size_t)T * kv_heads * d);
    std::unique_ptr<float[]> part_o(new float[(size_t)rows * heads * splits * d]);
    std::unique_ptr<float[]> part_ml(new float[(size_t)rows * heads * splits * 2]);
    std::unique_ptr<float[]> out(new float[(size_t)rows * heads * d]);
    emu::launch({(unsigned)blocks, (unsigned)splits, (unsigned)rows}, {128, 1, 1}, 0, [&] {
        attn_split(q.get(), k.get(), v.get(), part_o.get(), part_ml.get(), past, heads, kv_heads, d, scale, split_len);
    });
    emu::launch({(unsigned)heads, (unsigned)rows, 1}, {256, 1, 1}, 0,
                [&] { attn_combine(part_o.get(), part_ml.get(), out.get(), heads, d, splits); });

    double err = 0, mx = 0;
    for (int i = 0; i < rows; i++)
        for (int h = 0; h < heads; h++) {
            const int kvh = h / group, len = past + i + 1;
            const float* qh = q.get() + ((size_t)i * heads + h) * d;
            std::vector<double> p(len);
            double m = -1e300, l = 0;
            for (int t = 0; t < len; t++) {
                double dot = 0;
                for (int e = 0; e < d; e++) dot += (double)qh[e] * k[((size_t)t * kv_heads + kvh) * d + e];
                m = std::max(m, p[t] = dot * scale);
            }
            for (auto& x : p) l += x = std::exp(x - m);
            for (int e = 0; e < d; e++) {
                double o = 0;
                for (int t = 0; t < len; t++) o += p[t] * v[((size_t)t * kv_heads + kvh) * d + e];
                o /= l;
                err = emu::worst(err, std::fabs(out[((size_t)i * heads + h) * d + e] - o));
                mx = std::max(mx, std::fabs(o));
            }
        }
    const bool ok = err <= 1e-5 * std::max(1.0, mx);
    std::printf("attn_split + attn_combine: max |out - ref| %.3g (|ref| <= %.3g): %s\n", err, mx, ok ? "ok" : "TOO LARGE");
    return ok ? 0 : 1;
}
