// kernels/norm.cu `attention_inputs_row` on the CPU emulator (emu.hpp) against the five
// launches it replaces: the projection row split into q, gate, k and v, `rms_norm_rope` on q
// and on k, and k and v copied into the caches' next rows. Bit for bit: the heads are normed
// by the same device function.
//
// usage: attention_inputs heads kv_heads head_dim rotary_dim threads copiers seed
#include "emu.hpp"
#include "kernels.inc"

#include <random>
#include <string>

int main(int argc, char** argv) {
    if (argc < 8) {
        std::fprintf(stderr, "usage: %s heads kv_heads head_dim rotary_dim threads copiers seed\n", argv[0]);
        return 2;
    }
    const int heads = std::stoi(argv[1]), kv_heads = std::stoi(argv[2]), d = std::stoi(argv[3]);
    const int rotary = std::stoi(argv[4]);
    const unsigned threads = (unsigned)std::stoi(argv[5]), copiers = (unsigned)std::stoi(argv[6]);
    std::mt19937_64 rng(std::stoull(argv[7]));
    std::uniform_real_distribution<float> u(-2.0f, 2.0f), wd(-0.5f, 0.5f);
    const int qd = heads * d, kvd = kv_heads * d, cols = 2 * qd + 2 * kvd;
    const float eps = 1e-6f;
    std::vector<float> qkv(cols), qw(d), kw(d), freq(rotary / 2);
    for (auto& v : qkv) v = u(rng);
    for (auto& v : qw) v = wd(rng);
    for (auto& v : kw) v = wd(rng);
    for (int i = 0; i < rotary / 2; i++) freq[i] = std::pow(10000.0f, -2.0f * i / rotary);
    const int position = 8191;

    // The fused launch: caches of 3 rows, the new row written at row 2.
    std::vector<float> q(qd, NAN), gate(qd, NAN), kc(3 * kvd, NAN), vc(3 * kvd, NAN);
    emu::launch({(unsigned)(heads + kv_heads) + copiers, 1, 1}, {threads, 1, 1}, 0, [&] {
        attention_inputs_row(qkv.data(), qw.data(), kw.data(), q.data(), gate.data(), kc.data() + 2 * kvd,
                             vc.data() + 2 * kvd, heads, kv_heads, d, eps, 1, &position, freq.data(), rotary);
    });

    // The separate launches.
    std::vector<float> q2(qd), k2(kvd);
    emu::launch({(unsigned)heads, 1, 1}, {threads, 1, 1}, 0, [&] {
        rms_norm_rope(qkv.data(), qw.data(), q2.data(), d, eps, 1, &position, freq.data(), heads, rotary);
    });
    emu::launch({(unsigned)kv_heads, 1, 1}, {threads, 1, 1}, 0, [&] {
        rms_norm_rope(qkv.data() + 2 * qd, kw.data(), k2.data(), d, eps, 1, &position, freq.data(), kv_heads, rotary);
    });

    auto differ = [](const float* a, const float* b, int n) {
        int c = 0;
        for (int i = 0; i < n; i++) c += std::memcmp(a + i, b + i, 4) != 0;
        return c;
    };
    bool ok = true;
    const int dq = differ(q.data(), q2.data(), qd);
    std::printf("q against rms_norm_rope: %d of %d values differ: %s\n", dq, qd, dq == 0 ? "ok" : "DIFFERENT");
    const int dk = differ(kc.data() + 2 * kvd, k2.data(), kvd);
    std::printf("cached k against rms_norm_rope: %d of %d differ: %s\n", dk, kvd, dk == 0 ? "ok" : "DIFFERENT");
    const int dg = differ(gate.data(), qkv.data() + qd, qd) + differ(vc.data() + 2 * kvd, qkv.data() + 2 * qd + kvd, kvd);
    std::printf("gate and cached v against the projection: %d differ: %s\n", dg, dg == 0 ? "ok" : "DIFFERENT");
    // The rows before the new one are untouched (still NaN).
    int touched = 0;
    for (int i = 0; i < 2 * kvd; i++) touched += !std::isnan(kc[i]) + !std::isnan(vc[i]);
    std::printf("earlier cache rows untouched: %d written: %s\n", touched, touched == 0 ? "ok" : "WRITTEN");
    ok &= dq == 0 && dk == 0 && dg == 0 && touched == 0;
    return ok ? 0 : 1;
}
