// kernels/sampling.cu `argmax_partial` + `argmax_final` (greedy picks on the device) on the CPU
// emulator (emu.hpp), against the host's rule (crate::sampling::argmax): the first index of the
// largest value above −∞, NaNs never winning, 0 where there is none, over each row's first
// `limit` values. Rows: random values with the maximum planted twice (the first must win);
// −0 then +0 as the only candidates; NaNs and −∞ around one finite value; nothing but NaN and
// −∞; a row whose largest value lies past the limit.
//
// usage: sampling cols limit chunk seed
#include "emu.hpp"
#include "kernels.inc"

#include <limits>
#include <random>
#include <string>

int main(int argc, char** argv) {
    if (argc < 5) {
        std::fprintf(stderr, "usage: %s cols limit chunk seed\n", argv[0]);
        return 2;
    }
    const int cols = std::stoi(argv[1]), limit = std::stoi(argv[2]), chunk = std::stoi(argv[3]);
    std::mt19937_64 rng(std::stoull(argv[4]));
    std::uniform_real_distribution<float> u(-30.0f, 30.0f);
    const float nan = std::numeric_limits<float>::quiet_NaN(), inf = std::numeric_limits<float>::infinity();
    const int rows = 5;
    std::unique_ptr<float[]> x(new float[(size_t)rows * cols]);
    std::vector<unsigned> want(rows);
    auto row = [&](int r) { return x.get() + (size_t)r * cols; };
    for (int c = 0; c < cols; c++) row(0)[c] = u(rng);
    const int first = (int)(rng() % (limit / 2)), second = first + 1 + (int)(rng() % (limit / 2 - 1));
    row(0)[first] = row(0)[second] = 40.0f;
    want[0] = first;
    for (int c = 0; c < cols; c++) row(1)[c] = -inf;
    row(1)[limit / 3] = -0.0f;
    row(1)[limit - 1] = 0.0f;
    want[1] = limit / 3;
    for (int c = 0; c < cols; c++) row(2)[c] = c % 2 ? nan : -inf;
    row(2)[limit - 2] = -1e30f;
    want[2] = limit - 2;
    for (int c = 0; c < cols; c++) row(3)[c] = c % 3 ? nan : -inf;
    want[3] = 0;
    for (int c = 0; c < cols; c++) row(4)[c] = u(rng);
    if (limit < cols) row(4)[limit] = 100.0f;  // past the limit: never picked
    row(4)[limit - 1] = 50.0f;
    want[4] = limit - 1;

    const int parts = (limit + chunk - 1) / chunk;
    std::unique_ptr<unsigned long long[]> partial(new unsigned long long[(size_t)rows * parts]);
    std::unique_ptr<unsigned[]> ids(new unsigned[rows]);
    emu::launch({(unsigned)parts, (unsigned)rows, 1}, {256, 1, 1}, 0,
                [&] { argmax_partial(x.get(), cols, limit, chunk, partial.get()); });
    emu::launch({(unsigned)rows, 1, 1}, {256, 1, 1}, 0, [&] { argmax_final(partial.get(), parts, ids.get()); });
    bool ok = true;
    for (int r = 0; r < rows; r++) {
        const bool same = ids[r] == want[r];
        std::printf("row %d: picked %u, expected %u: %s\n", r, ids[r], want[r], same ? "ok" : "WRONG");
        ok &= same;
    }
    return ok ? 0 : 1;
}
