// QSA prefill's masked dense attention on the CPU emulator (emu.hpp): kernels/qsa.cu
// `qsa_token_mask` turns token lists shaped as `qsa_select` writes them (chosen blocks of
// `ratio` tokens, then the tail up to the query) into block bitmaps, and kernels/attention.cu
// `causal_softmax` / `causal_softmax_bf16` with that mask must give each listed token its
// softmax weight over exactly the list (double reference) and every other token 0.
//
// usage: qsa_mask rows past ratio topk seed
#include "emu.hpp"
#include "kernels.inc"

#include <algorithm>
#include <cmath>
#include <random>
#include <string>
#include <vector>

int main(int argc, char** argv) {
    if (argc < 6) {
        std::fprintf(stderr, "usage: %s rows past ratio topk seed\n", argv[0]);
        return 2;
    }
    const int rows = std::stoi(argv[1]), past = std::stoi(argv[2]), ratio = std::stoi(argv[3]);
    const int topk = std::stoi(argv[4]);
    std::mt19937_64 rng(std::stoull(argv[5]));
    std::uniform_real_distribution<float> u(-4.0f, 4.0f);
    const int cols = past + rows, cap = (topk + 1) * ratio;
    const int words = ((cols + ratio - 1) / ratio + 1 + 31) / 32;
    // Token lists: every token up to the query while its complete blocks fit the budget, else
    // `topk` random blocks and the tail.
    std::vector<int> tokens((size_t)rows * cap, -1), counts(rows);
    std::vector<std::vector<char>> listed(rows, std::vector<char>(cols, 0));
    for (int i = 0; i < rows; i++) {
        const int pos = past + i, complete = (pos + 1) / ratio;
        std::vector<int> list;
        if (complete <= topk) {
            for (int t = 0; t <= pos; t++) list.push_back(t);
        } else {
            std::vector<int> blocks(complete);
            for (int b = 0; b < complete; b++) blocks[b] = b;
            std::shuffle(blocks.begin(), blocks.end(), rng);
            blocks.resize(topk);
            std::sort(blocks.begin(), blocks.end());
            for (int b : blocks)
                for (int j = 0; j < ratio; j++) list.push_back(b * ratio + j);
            for (int t = complete * ratio; t <= pos; t++) list.push_back(t);
        }
        counts[i] = (int)list.size();
        for (size_t j = 0; j < list.size(); j++) {
            tokens[(size_t)i * cap + j] = list[j];
            listed[i][list[j]] = 1;
        }
    }
    std::vector<u32> mask((size_t)rows * words, 0xdeadbeefu);
    emu::launch({(unsigned)rows, 1, 1}, {256, 1, 1}, (size_t)words * 4, [&] {
        qsa_token_mask(tokens.data(), counts.data(), mask.data(), cap, ratio, words);
    });
    std::vector<float> scores((size_t)rows * cols);
    for (auto& s : scores) s = u(rng);

    // The reference: softmax over each row's listed tokens, in double.
    std::vector<double> want((size_t)rows * cols, 0.0);
    for (int i = 0; i < rows; i++) {
        double m = -INFINITY, s = 0.0;
        for (int t = 0; t < cols; t++)
            if (listed[i][t]) m = std::max(m, (double)scores[(size_t)i * cols + t]);
        for (int t = 0; t < cols; t++)
            if (listed[i][t]) s += std::exp((double)scores[(size_t)i * cols + t] - m);
        for (int t = 0; t < cols; t++)
            if (listed[i][t]) want[(size_t)i * cols + t] = std::exp((double)scores[(size_t)i * cols + t] - m) / s;
    }
    bool ok = true;
    // The f32 softmax in place, all rows one head (rows_per_head = rows, first_len = past + 1).
    std::vector<float> f32 = scores;
    emu::launch({(unsigned)rows, 1, 1}, {256, 1, 1}, 0,
                [&] { causal_softmax(f32.data(), cols, past + 1, rows, mask.data(), words, ratio); });
    std::vector<u16> bf16((size_t)rows * cols);
    emu::launch({(unsigned)rows, 1, 1}, {256, 1, 1}, 0, [&] {
        causal_softmax_bf16(scores.data(), bf16.data(), cols, past + 1, rows, mask.data(), words, ratio);
    });
    double worst = 0.0, worst_bf16 = 0.0;
    size_t leaked = 0;
    for (size_t e = 0; e < want.size(); e++) {
        const bool in = listed[e / cols][e % cols];
        if (!in) leaked += f32[e] != 0.0f || bf16[e] != 0;
        worst = std::max(worst, std::fabs((double)f32[e] - want[e]));
        worst_bf16 = std::max(worst_bf16, std::fabs((double)bf16_to_f32(bf16[e]) - want[e]) / std::max(want[e], 1e-30));
    }
    const bool f32_ok = worst <= 1e-6 && leaked == 0;
    std::printf("masked causal_softmax (%d rows, %d columns): max |err| %.2e, %zu unlisted non-zero: %s\n", rows,
                cols, worst, leaked, f32_ok ? "ok" : "FAILED");
    // BF16 keeps 8 bits: a relative error of at most 2^-8 on every listed weight.
    const bool bf16_ok = worst_bf16 <= 1.0 / 256.0 && leaked == 0;
    std::printf("masked causal_softmax_bf16: max relative err %.2e: %s\n", worst_bf16, bf16_ok ? "ok" : "FAILED");
    ok &= f32_ok && bf16_ok;
    return ok ? 0 : 1;
}
