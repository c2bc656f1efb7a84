// kernels/moe.cu `moe_route` on the CPU emulator (emu.hpp): each row's softmax over the router
// logits, its top k (equal probabilities: the lower expert first, as the CPU's stable sort) and
// their weights, against a double-precision reference; then `moe_route_groups` on row 0 (its
// picks written as the grouped kernels' tables) against a stable sort of moe_route's picks by
// expert. The logits are well apart except for
// planted exact duplicates, so the order is decided the same way in f32 and f64.
//
// usage: moe_route rows experts k normalize seed
#include "emu.hpp"
#include "kernels.inc"

#include <numeric>
#include <random>
#include <string>

int main(int argc, char** argv) {
    if (argc < 6) {
        std::fprintf(stderr, "usage: %s rows experts k normalize seed\n", argv[0]);
        return 2;
    }
    const int rows = std::stoi(argv[1]), experts = std::stoi(argv[2]), k = std::stoi(argv[3]);
    const int normalize = std::stoi(argv[4]);
    std::mt19937_64 rng(std::stoull(argv[5]));
    // Distinct values 1/64 apart, shuffled; then a few experts copy another's logit (ties).
    std::unique_ptr<float[]> logits(new float[(size_t)rows * experts]);
    for (int r = 0; r < rows; r++) {
        std::vector<int> order(experts);
        std::iota(order.begin(), order.end(), 0);
        std::shuffle(order.begin(), order.end(), rng);
        float* row = logits.get() + (size_t)r * experts;
        for (int e = 0; e < experts; e++) row[e] = (float)(order[e] - experts / 2) / 64.0f;
        for (int t = 0; t < 4; t++) {
            // The top expert's value copied to a random other: a tie at the very top.
            const int top = (int)(std::max_element(row, row + experts) - row);
            row[rng() % experts] = row[top];
        }
    }
    std::unique_ptr<u32[]> ids(new u32[(size_t)rows * k]);
    std::unique_ptr<float[]> weights(new float[(size_t)rows * k]);
    emu::launch({(unsigned)rows, 1, 1}, {256, 1, 1}, (size_t)experts * 4,
                [&] { moe_route(logits.get(), ids.get(), weights.get(), experts, k, normalize, experts); });

    bool ok = true;
    double werr = 0;
    int wrong = 0;
    for (int r = 0; r < rows; r++) {
        const float* row = logits.get() + (size_t)r * experts;
        std::vector<double> p(experts);
        const double m = *std::max_element(row, row + experts);
        double s = 0;
        for (int e = 0; e < experts; e++) s += p[e] = std::exp((double)row[e] - m);
        std::vector<int> order(experts);
        std::iota(order.begin(), order.end(), 0);
        std::stable_sort(order.begin(), order.end(), [&](int a, int b) { return row[a] > row[b]; });
        double norm = 0;
        for (int j = 0; j < k; j++) norm += p[order[j]] / s;
        for (int j = 0; j < k; j++) {
            wrong += ids[(size_t)r * k + j] != (u32)order[j];
            const double w = p[order[j]] / s / (normalize ? norm : 1.0);
            werr = emu::worst(werr, std::fabs(weights[(size_t)r * k + j] - w) / w);
        }
    }
    std::printf("moe_route ids: %d of %d differ from the stable top %d: %s\n", wrong, rows * k, k,
                wrong == 0 ? "ok" : "DIFFERENT");
    ok &= wrong == 0;
    std::printf("moe_route weights: max relative error %.3g: %s\n", werr, werr <= 1e-5 ? "ok" : "TOO LARGE");
    ok &= werr <= 1e-5;

    // moe_route_groups on row 0: the groups in ascending expert order (a stable sort of
    // moe_route's picks), each with its expert's table entry, slot = its place, one row, and the
    // pick's weight (bit for bit).
    const int stride = 6;
    std::vector<u64> table((size_t)experts * stride);
    for (int e = 0; e < experts; e++)
        for (int c = 0; c < stride; c++) table[(size_t)e * stride + c] = 1000ull * e + c;
    std::vector<u64> groups((size_t)k * stride, ~0ull);
    std::vector<u32> grows(k, ~0u), gslots(k, ~0u);
    std::vector<float> sorted(k, -1.0f);
    emu::launch({1, 1, 1}, {256, 1, 1}, (size_t)experts * 4, [&] {
        moe_route_groups(logits.get(), experts, k, normalize, experts, table.data(), stride, groups.data(),
                         grows.data(), gslots.data(), sorted.data());
    });
    std::vector<int> order(k);
    std::iota(order.begin(), order.end(), 0);
    std::stable_sort(order.begin(), order.end(), [&](int a, int b) { return ids[a] < ids[b]; });
    int bad = 0;
    for (int j = 0; j < k; j++) {
        const u32 e = ids[order[j]];
        const u64* g = &groups[(size_t)j * stride];
        bad += g[0] != table[(size_t)e * stride] || g[1] != table[(size_t)e * stride + 1] || g[2] != (u64)j ||
               g[3] != 1 || g[4] != table[(size_t)e * stride + 4] || g[5] != table[(size_t)e * stride + 5];
        bad += grows[j] != 0 || gslots[j] != (u32)j || sorted[j] != weights[order[j]];
    }
    std::printf("moe_route_groups: %d of %d groups differ from the stable sort by expert: %s\n", bad, k,
                bad == 0 ? "ok" : "DIFFERENT");
    ok &= bad == 0;
    return ok ? 0 : 1;
}
