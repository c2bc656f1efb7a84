// kernels/quant_matvec.cu's IQ3_S records matvecs (quant_matvec_iq3sr_q8*) on the CPU emulator
// (emu.hpp), launched as the engine plans them, on records the engine's own repack wrote
// (backend/cuda/iq3s_records.rs, from the blocks beside them), x quantized by quantize_x_q8r,
// against the same int8 rounding of x done here (amax/127 per 32 values, round to nearest
// even), integer sums of the blocks' integer weights, scales in double: f32 rounding apart,
// equal (≤ 1e-5 of Σ|terms|).
//
// usage: iq3s_records KERNEL BLOCKS_FILE RECORDS_FILE rows cols blocks seed
#include "emu.hpp"
#include "kernels.inc"
#include "q8_reference.hpp"

#include <fstream>
#include <iterator>
#include <map>
#include <random>
#include <string>
#include <vector>

typedef void (*RecordsKernel)(const unsigned char*, const unsigned char*, const float*, float*, int, int, u64, float);

#define IQ3SR_ENTRY(NAME) {#NAME, NAME}
static const std::map<std::string, RecordsKernel> kernels = {
    IQ3SR_ENTRY(quant_matvec_iq3sr_q8_1),      IQ3SR_ENTRY(quant_matvec_iq3sr_q8_2),
    IQ3SR_ENTRY(quant_matvec_iq3sr_q8_2_unroll2), IQ3SR_ENTRY(quant_matvec_iq3sr_q8k_2_4),
    IQ3SR_ENTRY(quant_matvec_iq3sr_q8k_1_2),   IQ3SR_ENTRY(quant_matvec_iq3sr_q8k_2_8),
    IQ3SR_ENTRY(quant_matvec_iq3sr_q8k_1_4),   IQ3SR_ENTRY(quant_matvec_iq3sr_q8k_1_8),
};

// `bytes` (rounded up to 16) aligned on 16 bytes, as device allocations are.
static std::unique_ptr<unsigned char[], void (*)(void*)> aligned16(size_t bytes) {
    return {(unsigned char*)std::aligned_alloc(16, (bytes + 15) / 16 * 16), std::free};
}

static std::vector<unsigned char> read_file(const char* path) {
    std::ifstream f(path, std::ios::binary);
    if (!f) {
        std::fprintf(stderr, "cannot read %s\n", path);
        std::exit(2);
    }
    return {std::istreambuf_iterator<char>(f), {}};
}

int main(int argc, char** argv) {
    if (argc < 8) {
        std::fprintf(stderr, "usage: %s KERNEL BLOCKS_FILE RECORDS_FILE rows cols blocks seed\n", argv[0]);
        return 2;
    }
    const auto k = kernels.find(argv[1]);
    if (k == kernels.end()) {
        std::fprintf(stderr, "no kernel %s in the driver's table\n", argv[1]);
        return 2;
    }
    const std::vector<unsigned char> blocks = read_file(argv[2]), records = read_file(argv[3]);
    const int rows = std::stoi(argv[4]), cols = std::stoi(argv[5]);
    const unsigned grid = std::stoul(argv[6]);
    std::mt19937_64 rng(std::stoull(argv[7]));
    const size_t row_bytes = (size_t)cols / 256 * 110;
    if (blocks.size() != row_bytes * rows || records.size() != blocks.size()) {
        std::fprintf(stderr, "expected %zu bytes of blocks and of records, found %zu and %zu\n", row_bytes * rows,
                     blocks.size(), records.size());
        return 2;
    }
    // The kernels load records 16 bytes at a time: a 16-byte aligned copy, as on the device.
    auto w = aligned16(records.size());
    std::memcpy(w.get(), records.data(), records.size());
    // x with a zero group of 32 (amax 0) and some large values.
    std::uniform_real_distribution<float> uni(-1.0f, 1.0f);
    std::vector<float> x(cols);
    for (int i = 0; i < cols; i++) x[i] = uni(rng) * (i % 97 == 0 ? 20.0f : 1.0f);
    for (int i = 32; i < 64; i++) x[i] = 0.0f;
    const int groups = cols / 32;
    auto xq = aligned16(cols);
    std::vector<float> xs(groups);
    emu::launch({(unsigned)(groups + 127) / 128, 1, 1}, {128, 1, 1}, 0,
                [&] { quantize_x_q8r(x.data(), cols, xq.get(), xs.data()); });
    const float mult = 0.75f;
    std::vector<float> y(rows, NAN);
    emu::launch({grid, 1, 1}, {256, 1, 1}, 0,
                [&] { k->second(w.get(), xq.get(), xs.data(), y.data(), cols, rows, (u64)row_bytes, mult); });

    // The reference: x rounded as quantize_x_q8r rounds it, the blocks' weights as integers.
    std::vector<int> q;
    std::vector<float> step;
    quantize(x.data(), cols, q, step);
    double worst = 0;
    for (int r = 0; r < rows; r++) {
        double sum = 0, mag = 0;
        for (int i = 0; i < cols; i++) {
            int v;
            double s;
            iq3s_weight(blocks.data() + r * row_bytes + (size_t)(i / 256) * 110, i % 256, &v, &s);
            const double t = mult * s * v * q[i] * step[i / 32];
            sum += t;
            mag += std::fabs(t);
        }
        worst = emu::worst(worst, std::fabs(y[r] - sum) / (mag + 1e-30));
    }
    std::printf("%s (%d x %d, %u blocks): max error %.3g of Σ|w·x| against the same rounding: %s\n", argv[1], rows,
                cols, grid, worst, worst <= 1e-5 ? "ok" : "TOO LARGE");
    return worst <= 1e-5 ? 0 : 1;
}
