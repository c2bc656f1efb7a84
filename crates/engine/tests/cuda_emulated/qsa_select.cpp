// kernels/qsa.cu `qsa_select` on the CPU emulator (emu.hpp): each query's token list (every
// token while the key blocks are few; past that, the topk best-scoring blocks in ascending
// order, ties to the lower block as the CPU's stable sort, then the tail of the incomplete
// block) against a reference written from that definition. Scores take few distinct values,
// so ties straddle the threshold, and include -0.0 and +0.0 (ordered as f32::total_cmp).
// Then `qsa_block_scores` and `qsa_block_scores_rows` (the scores qsa_select ranks): every
// complete block's score against a double reference (within f32 rounding of Σ|terms|), every other entry left as it was.
//
// usage: qsa_select rows past topk ratio seed heads d
#include "emu.hpp"
#include "kernels.inc"

#include <numeric>
#include <random>
#include <string>
#include <vector>
#include <cmath>
#include <algorithm>

int main(int argc, char** argv) {
    if (argc < 8) {
        std::fprintf(stderr, "usage: %s rows past topk ratio seed heads d\n", argv[0]);
        return 2;
    }
    const int rows = std::stoi(argv[1]), past = std::stoi(argv[2]), topk = std::stoi(argv[3]);
    const int ratio = std::stoi(argv[4]), heads = std::stoi(argv[6]), d = std::stoi(argv[7]);
    std::mt19937_64 rng(std::stoull(argv[5]));
    const int last = past + rows - 1;
    const int stride = (last + 1) / ratio + 1, cap = last + 1;
    const float values[] = {-1.5f, -0.0f, 0.0f, 0.25f, 0.5f, 0.5f, 1.0f, 2.0f, 3.5f};
    std::unique_ptr<float[]> scores(new float[(size_t)rows * stride]);
    for (size_t e = 0; e < (size_t)rows * stride; e++) scores[e] = values[rng() % 9];
    std::unique_ptr<int[]> tokens(new int[(size_t)rows * cap]), counts(new int[rows]);
    emu::launch({(unsigned)rows, 1, 1}, {256, 1, 1}, 0, [&] {
        qsa_select(scores.get(), tokens.get(), counts.get(), past, topk, ratio, stride, cap);
    });

    int wrong_rows = 0;
    for (int i = 0; i < rows; i++) {
        const int pos = past + i, complete = (pos + 1) / ratio;
        std::vector<int> want;
        if (complete <= topk) {
            for (int t = 0; t <= pos; t++) want.push_back(t);
        } else {
            const float* row = scores.get() + (size_t)i * stride;
            auto key = [](float f) {
                int32_t x;
                std::memcpy(&x, &f, 4);
                x ^= (int32_t)((uint32_t)(x >> 31) >> 1);
                return (uint32_t)x ^ 0x80000000u;
            };
            std::vector<int> blocks(complete);
            std::iota(blocks.begin(), blocks.end(), 0);
            std::stable_sort(blocks.begin(), blocks.end(), [&](int a, int b) { return key(row[a]) > key(row[b]); });
            blocks.resize(topk);
            std::sort(blocks.begin(), blocks.end());
            for (int b : blocks)
                for (int j = 0; j < ratio; j++) want.push_back(b * ratio + j);
            for (int t = complete * ratio; t <= pos; t++) want.push_back(t);
        }
        const int* got = tokens.get() + (size_t)i * cap;
        const bool same = counts[i] == (int)want.size() && std::equal(want.begin(), want.end(), got);
        if (!same && wrong_rows++ < 3)
            std::printf("query %d (position %d): %d tokens, want %zu\n", i, pos, counts[i], want.size());
    }
    std::printf("qsa_select: %d of %d token lists differ from the reference: %s\n", wrong_rows, rows,
                wrong_rows == 0 ? "ok" : "DIFFERENT");

    // The block scores, launched as flash_next.rs `qsa_select_chunk` does.
    std::uniform_real_distribution<float> u(-1.0f, 1.0f);
    const int blocks = (last + 1) / ratio;
    std::vector<float> q((size_t)rows * heads * d), keys((size_t)blocks * d);
    for (auto& x : q) x = u(rng);
    for (auto& x : keys) x = u(rng);
    const float untouched = -12345.0f;
    bool scores_ok = true;
    for (const bool tiled : {true, false}) {
    // The warp-a-pair form is for decode's few queries; on the emulator (an OS thread a CUDA
    // thread) a long context's pairs would take minutes.
    if (!tiled && (size_t)rows * stride > 5000) {
        std::printf("qsa_block_scores_rows: not run on %d × %d pairs: ok\n", rows, stride);
        continue;
    }
    std::vector<float> got((size_t)rows * stride, untouched);
    if (tiled)
        emu::launch({(unsigned)((stride + QSA_TB - 1) / QSA_TB), (unsigned)((rows + QSA_TQ - 1) / QSA_TQ), 1},
                    {128, 1, 1}, 0,
                    [&] { qsa_block_scores(q.data(), keys.data(), got.data(), rows, past, heads, d, ratio, stride); });
    else
        emu::launch({(unsigned)((stride + 7) / 8), (unsigned)rows, 1}, {256, 1, 1}, 0, [&] {
            qsa_block_scores_rows(q.data(), keys.data(), got.data(), past, heads, d, ratio, stride);
        });
    double worst = 0.0;
    int bad = 0;
    for (int i = 0; i < rows; i++) {
        const int complete = std::min((past + i + 1) / ratio, stride);
        for (int b = 0; b < stride; b++) {
            const float g = got[(size_t)i * stride + b];
            if (b >= complete) {
                bad += g != untouched;
                continue;
            }
            double want = 0.0, mag = 0.0;
            for (int h = 0; h < heads; h++) {
                double dot = 0.0;
                for (int e = 0; e < d; e++) {
                    const double t = (double)q[((size_t)i * heads + h) * d + e] * keys[(size_t)b * d + e];
                    dot += t;
                    mag += std::fabs(t);
                }
                want += std::max(dot, 0.0);
            }
            want /= std::sqrt((double)d);
            mag /= std::sqrt((double)d);
            const double err = std::fabs(g - want);
            worst = std::max(worst, err / std::max(mag, 1e-30));
            bad += err > 1e-5 * mag + 1e-30;
        }
    }
    std::printf("%s (%d queries, %d blocks, %d heads of %d): worst error %.2e of Σ|terms|, %d wrong: %s\n",
                tiled ? "qsa_block_scores" : "qsa_block_scores_rows", rows, blocks, heads, d, worst, bad,
                bad == 0 ? "ok" : "DIFFERENT");
    scores_ok &= bad == 0;
    }
    return wrong_rows == 0 && scores_ok ? 0 : 1;
}
