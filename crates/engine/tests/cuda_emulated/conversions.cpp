// The prefill's BF16 conversions on the CPU emulator (emu.hpp): kernels/elementwise.cu
// `f32_to_bf16_kernel` (four values a thread where x and out are aligned) against the scalar
// `f32_to_bf16` of every value, at aligned and unaligned operands and lengths with a tail, with
// the values just past the end untouched; kernels/moe.cu `moe_gather_rows_bf16` and
// `moe_swiglu_bf16` against the f32 kernels they stand for (`moe_gather_rows`,
// `moe_swiglu_halves`, `moe_swiglu_pairs`) followed by the same rounding, bit for bit; and
// `split_cols4` and `silu_mul_halves` (four values a thread where widths and pointers allow)
// against a plain copy and the scalar SwiGLU, for widths that take the four-value path and
// widths that do not; `causal_conv1d_silu` (a channel's run of tokens a thread) against its
// sums written output by output.
//
// usage: conversions n rows cols seed
#include "emu.hpp"
#include "kernels.inc"

#include <cmath>
#include <cstring>
#include <limits>
#include <random>
#include <string>
#include <vector>

static unsigned blocks_for(size_t threads) { return (unsigned)std::max<size_t>(1, (threads + 255) / 256); }

static bool check(const char* what, size_t differ, size_t total) {
    std::printf("%s: %zu of %zu values differ: %s\n", what, differ, total, differ ? "FAILED" : "ok");
    return differ == 0;
}

int main(int argc, char** argv) {
    if (argc < 5) {
        std::fprintf(stderr, "usage: %s n rows cols seed\n", argv[0]);
        return 2;
    }
    const size_t n = std::stoul(argv[1]);
    const int rows = std::stoi(argv[2]), cols = std::stoi(argv[3]);
    std::mt19937_64 rng(std::stoull(argv[4]));
    std::uniform_real_distribution<float> u(-3.0f, 3.0f);
    bool ok = true;

    // Values with every rounding case: ties to even both ways, NaN, infinities, denormals.
    std::vector<float> x(n + 8);
    const float special[] = {std::numeric_limits<float>::quiet_NaN(), std::numeric_limits<float>::infinity(),
                             -std::numeric_limits<float>::infinity(), 1.0f + 1.0f / 256.0f, 1.0f + 3.0f / 256.0f,
                             -0.0f, 1e-40f, 3.0e38f};
    for (size_t i = 0; i < x.size(); i++) x[i] = i % 5 == 0 ? special[(i / 5) % 8] : u(rng);
    // (x offset, out offset): aligned; x off by one float (no float4 loads); out off by one u16.
    for (auto [xo, oo] : {std::pair<size_t, size_t>{0, 0}, {1, 0}, {0, 1}}) {
        std::vector<u16> out(n + 8, 0xabcd);
        const float* xp = x.data() + xo;
        u16* op = out.data() + oo;
        emu::launch({blocks_for((n + 3) / 4), 1, 1}, {256, 1, 1}, 0, [&] { f32_to_bf16_kernel(xp, op, (u64)n); });
        size_t differ = 0;
        for (size_t i = 0; i < n; i++) differ += op[i] != f32_to_bf16(xp[i]);
        for (size_t i = n + oo; i < out.size(); i++) differ += out[i] != 0xabcd;
        for (size_t i = 0; i < oo; i++) differ += out[i] != 0xabcd;
        const std::string what = "f32_to_bf16_kernel n=" + std::to_string(n) + " x+" + std::to_string(xo) +
                                 " out+" + std::to_string(oo);
        ok &= check(what.c_str(), differ, n);
    }

    // Gather: slot r takes row rows_of[r] of a [src_rows, cols] activation.
    const int src_rows = rows + 3;
    std::vector<float> src((size_t)src_rows * cols);
    for (auto& v : src) v = u(rng);
    std::vector<u32> rows_of(rows);
    for (auto& r : rows_of) r = (u32)(rng() % src_rows);
    const size_t total = (size_t)rows * cols;
    std::vector<float> gathered(total);
    std::vector<u16> gathered_bf16(total);
    emu::launch({blocks_for(total), 1, 1}, {256, 1, 1}, 0,
                [&] { moe_gather_rows(src.data(), rows_of.data(), gathered.data(), (u64)rows, cols); });
    emu::launch({blocks_for(total), 1, 1}, {256, 1, 1}, 0,
                [&] { moe_gather_rows_bf16(src.data(), rows_of.data(), gathered_bf16.data(), (u64)rows, cols); });
    size_t differ = 0;
    for (size_t i = 0; i < total; i++) differ += gathered_bf16[i] != f32_to_bf16(gathered[i]);
    ok &= check("moe_gather_rows_bf16", differ, total);

    // SwiGLU over [rows, 2·inter] gate/up outputs, halves and interleaved pairs.
    const int inter = cols;
    std::vector<float> gu((size_t)rows * 2 * inter);
    for (auto& v : gu) v = u(rng);
    for (int pairs = 0; pairs < 2; pairs++) {
        std::vector<float> act(total);
        std::vector<u16> act_bf16(total);
        emu::launch({blocks_for(total), 1, 1}, {256, 1, 1}, 0, [&] {
            if (pairs) moe_swiglu_pairs(gu.data(), act.data(), (u64)rows, inter);
            else moe_swiglu_halves(gu.data(), act.data(), (u64)rows, inter);
        });
        emu::launch({blocks_for(total), 1, 1}, {256, 1, 1}, 0,
                    [&] { moe_swiglu_bf16(gu.data(), act_bf16.data(), (u64)rows, inter, pairs); });
        differ = 0;
        for (size_t i = 0; i < total; i++) differ += act_bf16[i] != f32_to_bf16(act[i]);
        ok &= check(pairs ? "moe_swiglu_bf16 pairs" : "moe_swiglu_bf16 halves", differ, total);
    }
    // split_cols4: four pieces of a [rows, src_cols] matrix starting at column b0, the grid as
    // the launcher sizes it (a quarter of the values where every bound is a multiple of 4).
    const int q = std::max(4, cols / 4 * 4);
    const int layouts[2][5] = {{4, 4 + q, 4 + q + 8, 4 + 2 * q + 8, 4 + 2 * q + 16},
                               {1, 1 + q + 1, 1 + q + 4, 1 + 2 * q + 6, 1 + 2 * q + 9}};
    for (const auto& b : layouts) {
        const int src_cols = b[4] + 4;
        std::vector<float> m((size_t)rows * src_cols);
        for (auto& v : m) v = u(rng);
        std::vector<std::vector<float>> d(4);
        for (int j = 0; j < 4; j++) d[j].assign((size_t)rows * (b[j + 1] - b[j]), -7.0f);
        const bool quads = ((b[0] | b[1] | b[2] | b[3] | b[4] | src_cols) & 3) == 0;
        const size_t n = (size_t)rows * (b[4] - b[0]);
        emu::launch({blocks_for(quads ? n / 4 : n), 1, 1}, {256, 1, 1}, 0, [&] {
            split_cols4(m.data(), (u64)rows, src_cols, d[0].data(), d[1].data(), d[2].data(), d[3].data(), b[0],
                        b[1], b[2], b[3], b[4]);
        });
        differ = 0;
        for (int r = 0; r < rows; r++)
            for (int j = 0; j < 4; j++)
                for (int c = b[j]; c < b[j + 1]; c++)
                    differ += d[j][(size_t)r * (b[j + 1] - b[j]) + (c - b[j])] != m[(size_t)r * src_cols + c];
        ok &= check(quads ? "split_cols4 four a thread" : "split_cols4 one a thread", differ, n);
    }

    // silu_mul_halves over [rows, 2·inter], inter a multiple of 4 and not.
    for (const int half : {q, q + 1}) {
        std::vector<float> g((size_t)rows * 2 * half), out((size_t)rows * half, -7.0f);
        for (auto& v : g) v = u(rng);
        const size_t n = (size_t)rows * half;
        emu::launch({blocks_for(half % 4 == 0 ? n / 4 : n), 1, 1}, {256, 1, 1}, 0,
                    [&] { silu_mul_halves(g.data(), out.data(), (u64)rows, half); });
        differ = 0;
        for (int r = 0; r < rows; r++)
            for (int c = 0; c < half; c++) {
                const float* row = g.data() + (size_t)r * 2 * half;
                const float want = silu_f(row[c]) * row[half + c];
                differ += std::memcmp(&want, &out[(size_t)r * half + c], 4) != 0;
            }
        ok &= check(half % 4 == 0 ? "silu_mul_halves four a thread" : "silu_mul_halves one a thread", differ, n);
    }

    // causal_conv1d_silu over `rows` tokens (runs of CONV_RUN a thread, the last partial) of
    // `cols` channels, taps in the register window and past it, against the same sums written
    // output by output (bit for bit: the same products in the same order).
    for (const int taps : {4, 2, CONV_MAX_TAPS + 2}) {
        const int tokens = rows * 7, channels = cols;
        std::vector<float> xs((size_t)tokens * channels), state((size_t)(taps - 1) * channels);
        std::vector<float> w((size_t)channels * taps), out((size_t)tokens * channels, -7.0f);
        for (auto& v : xs) v = u(rng);
        for (auto& v : state) v = u(rng);
        for (auto& v : w) v = u(rng);
        emu::launch({(unsigned)((channels + 255) / 256), (unsigned)((tokens + CONV_RUN - 1) / CONV_RUN), 1},
                    {256, 1, 1}, 0, [&] {
                        causal_conv1d_silu(xs.data(), state.data(), w.data(), DT_F32, out.data(), tokens, channels,
                                           taps);
                    });
        differ = 0;
        for (int t = 0; t < tokens; t++)
            for (int c = 0; c < channels; c++) {
                float acc = 0.0f;
                for (int j = 0; j < taps - 1; j++) {
                    const int at = t - (taps - 1) + j;
                    const float in = at >= 0 ? xs[(size_t)at * channels + c] : state[(size_t)(taps - 1 + at) * channels + c];
                    acc += w[(size_t)c * taps + j] * in;
                }
                acc += w[(size_t)c * taps + taps - 1] * xs[(size_t)t * channels + c];
                const float want = silu_f(acc);
                differ += std::memcmp(&want, &out[(size_t)t * channels + c], 4) != 0;
            }
        const std::string what = "causal_conv1d_silu " + std::to_string(tokens) + " tokens, " + std::to_string(taps) + " taps";
        ok &= check(what.c_str(), differ, (size_t)tokens * channels);
    }
    return ok ? 0 : 1;
}
