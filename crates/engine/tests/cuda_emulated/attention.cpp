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
    emu::launch({(unsigned)heads, (unsigned)rows, 1}, {256, 1, 1}, 0, [&] {
        attn_combine(part_o.get(), part_ml.get(), out.get(), heads, d, splits, nullptr, nullptr, nullptr);
    });

    std::vector<double> ref((size_t)rows * heads * d);
    double mx = 0;
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
                ref[((size_t)i * heads + h) * d + e] = o / l;
                mx = std::max(mx, std::fabs(o / l));
            }
        }
    auto compare = [&](const char* what) {
        double err = 0;
        for (size_t i = 0; i < ref.size(); i++) err = emu::worst(err, std::fabs(out[i] - ref[i]));
        const bool ok = err <= 1e-5 * std::max(1.0, mx);
        std::printf("%s: max |out - ref| %.3g (|ref| <= %.3g): %s\n", what, err, mx, ok ? "ok" : "TOO LARGE");
        return ok;
    };
    bool ok = compare("attn_split + attn_combine");

    // The gated combine (Backend::attention_gated): every value times sigmoid(gate), and for one
    // row of whole int8 groups its int8 copy (the q8r layout: 32 values a group, two 16-byte
    // halves, a step per group), which must decode to within half a step of the value.
    auto gate = filled((size_t)rows * heads * d);
    for (size_t i = 0; i < ref.size(); i++) ref[i] *= 1.0 / (1.0 + std::exp(-(double)gate[i]));
    const int n = heads * d;
    const bool int8 = rows == 1 && d % 32 == 0;
    std::unique_ptr<unsigned char[]> xq(new unsigned char[int8 ? n : 1]);
    std::unique_ptr<float[]> xs(new float[int8 ? n / 32 : 1]);
    emu::launch({(unsigned)heads, (unsigned)rows, 1}, {256, 1, 1}, 0, [&] {
        attn_combine(part_o.get(), part_ml.get(), out.get(), heads, d, splits, gate.get(), int8 ? xq.get() : nullptr,
                     int8 ? xs.get() : nullptr);
    });
    ok &= compare("attn_combine with the output gate");
    if (int8) {
        double worst_steps = 0;
        for (int i = 0; i < n; i++) {
            const int c = i / 32, lane = i % 32;
            const signed char code = (signed char)xq[(lane < 16 ? 0 : n / 2) + 16 * c + (lane & 15)];
            worst_steps = emu::worst(worst_steps, std::fabs(code * xs[c] - out[i]) / xs[c]);
        }
        const bool q8_ok = worst_steps <= 0.5001;
        std::printf("its int8 copy: max |decoded - out| %.3g steps: %s\n", worst_steps, q8_ok ? "ok" : "TOO LARGE");
        ok &= q8_ok;
    }
    return ok ? 0 : 1;
}
