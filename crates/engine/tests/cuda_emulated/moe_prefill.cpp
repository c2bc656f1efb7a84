// kernels/moe_prefill.cu on the CPU emulator (emu.hpp): prefill's routed experts on the device,
// with the launches the engine plans, on random quantized experts and a skewed routing (some
// experts with several blocks of entries, some with none). Checked:
// - moe_prefill_align: every entry once, in a block of its expert, blocks of one expert
//   consecutive, padding and unused blocks marked empty; each row's combine entries in
//   ascending expert order with their weights;
// - moe_prefill_gate_up: each entry's silu(gate)·up against double sums of the BF16-rounded
//   weights and x (weights decoded by quant_matvec.cu's qdecode8, which the GPU suites hold to
//   the CPU's decoders: this test is about the tiling, the fragments and the sorting), within
//   one BF16 ulp of the output (it is rounded to BF16) plus f32 rounding of the sums;
// - moe_prefill_down: each entry's output against double sums over the kernel's own act,
//   within f32 rounding (≤ 1e-5 of Σ|terms|).
//
// usage: moe_prefill iq3s|nvfp4|q8_0 rows experts k hidden inter interleaved seed
//        max_blocks gate_up_blocks down_blocks input_buffers smem
#include "emu.hpp"
#include "kernels.inc"
#include "random_blocks.hpp"

#include <random>
#include <string>

static float bf16_round(float f) { return bf16_to_f32(f32_to_bf16(f)); }

// Row `row` of a matrix of `cols` columns, decoded and rounded to BF16 as the kernels stage it.
static std::vector<double> decoded_row(int fmt, const unsigned char* m, u64 row_bytes, int row, int cols) {
    std::vector<double> out(cols);
    for (int g = 0; g < cols / 8; g++) {
        float f[8];
        const unsigned char* r = m + (size_t)row * row_bytes;
        switch (fmt) {
            case QF_IQ3_S: qdecode8<QF_IQ3_S>(r, g, f); break;
            case QF_Q2_0: qdecode8<QF_Q2_0>(r, g, f); break;
            case QF_Q8_0: qdecode8<QF_Q8_0>(r, g, f); break;
            default: qdecode8<QF_NVFP4>(r, g, f); break;
        }
        for (int j = 0; j < 8; j++) out[8 * g + j] = bf16_round(f[j]);
    }
    return out;
}

// Whether mp_load_unit then mp_decode_unit give BF16 pairs equal to qdecode8's values rounded
// to BF16, bit for bit, over every unit of `rows` rows (the formats staged a unit at a time).
template <int FMT>
static bool units_match_groups(const unsigned char* m, u64 row_bytes, int rows, int cols) {
    bool ok = true;
    for (int r = 0; r < rows; r++)
        for (int u = 0; u < cols / 32; u++) {
            u32 pairs[16];
            mp_decode_unit<FMT>(mp_load_unit<FMT>(m + (size_t)r * row_bytes, u, true), pairs);
            for (int g = 0; g < 4; g++) {
                float f[8];
                qdecode8<FMT>(m + (size_t)r * row_bytes, 4 * u + g, f);
                for (int j = 0; j < 4; j++)
                    ok &= pairs[4 * g + j] == ((u32)f32_to_bf16(f[2 * j]) | ((u32)f32_to_bf16(f[2 * j + 1]) << 16));
            }
        }
    return ok;
}

int main(int argc, char** argv) {
    if (argc < 14) {
        std::fprintf(stderr,
                     "usage: %s iq3s|nvfp4 rows experts k hidden inter interleaved seed max_blocks gu_blocks "
                     "down_blocks input_buffers smem\n",
                     argv[0]);
        return 2;
    }
    // iq3s: IQ3_S gate/up, Q2_0 down; nvfp4 and q8_0 (32-weight blocks: k-steps past the
    // last column) for both.
    const std::string format = argv[1];
    const bool nvfp4 = format == "nvfp4", q8_0 = format == "q8_0";
    const int n = std::stoi(argv[2]), experts = std::stoi(argv[3]), k = std::stoi(argv[4]);
    const int hidden = std::stoi(argv[5]), inter = std::stoi(argv[6]), interleaved = std::stoi(argv[7]);
    std::mt19937_64 rng(std::stoull(argv[8]));
    const int max_blocks = std::stoi(argv[9]);
    const unsigned gu_blocks = std::stoul(argv[10]), down_blocks = std::stoul(argv[11]);
    const int xbufs = std::stoi(argv[12]);
    const size_t smem = std::stoul(argv[13]);
    std::uniform_real_distribution<float> uni(-1.0f, 1.0f);
    const int gu_fmt = nvfp4 ? QF_NVFP4 : q8_0 ? QF_Q8_0 : QF_IQ3_S;
    const int down_fmt = nvfp4 ? QF_NVFP4 : q8_0 ? QF_Q8_0 : QF_Q2_0;
    const int gu_bw = nvfp4 ? 64 : q8_0 ? 32 : 256, gu_bb = nvfp4 ? 36 : q8_0 ? 34 : 110;
    const int down_bw = q8_0 ? 32 : 64, down_bb = nvfp4 ? 36 : q8_0 ? 34 : 18;
    const u64 gu_row = (u64)hidden / gu_bw * gu_bb, down_row = (u64)inter / down_bw * down_bb;
    std::vector<std::unique_ptr<unsigned char[]>> gate_up, down;
    std::vector<u64> table((size_t)experts * 6);
    std::vector<float> mult_gu(experts), mult_down(experts);
    for (int e = 0; e < experts; e++) {
        gate_up.push_back(random_blocks(rng, 2 * inter * gu_row, gu_bb, nvfp4));
        down.push_back(random_blocks(rng, hidden * down_row, down_bb, nvfp4));
        mult_gu[e] = 0.5f + 0.125f * e;
        mult_down[e] = 1.5f - 0.0625f * e;
        u32 a, b;
        std::memcpy(&a, &mult_gu[e], 4);
        std::memcpy(&b, &mult_down[e], 4);
        u64* t = &table[(size_t)e * 6];
        t[0] = (u64)gate_up[e].get();
        t[1] = (u64)down[e].get();
        t[2] = t[3] = 0;  // slot and rows: the decode kernels' fields
        t[4] = a;
        t[5] = b;
    }
    // k distinct experts a row, expert e drawn with weight 1/(e+1) (the last ones rarely, so
    // that some have no entry), with random positive weights.
    std::vector<u32> ids((size_t)n * k);
    std::vector<float> weights((size_t)n * k);
    for (int r = 0; r < n; r++) {
        std::vector<double> pop(experts);
        for (int e = 0; e < experts; e++) pop[e] = 1.0 / (e + 1) / (e + 1);
        for (int j = 0; j < k; j++) {
            std::discrete_distribution<int> pick(pop.begin(), pop.end());
            const int e = pick(rng);
            pop[e] = 0;
            ids[(size_t)r * k + j] = (u32)e;
            weights[(size_t)r * k + j] = 0.1f + 0.9f * (float)(rng() % 1000) / 1000.0f;
        }
    }
    std::vector<float> x((size_t)n * hidden);
    std::vector<u16> xb((size_t)n * hidden);
    for (size_t i = 0; i < x.size(); i++) {
        x[i] = uni(rng);
        xb[i] = f32_to_bf16(x[i]);
    }
    const size_t positions = (size_t)max_blocks * MP_BM;
    std::vector<u32> sorted(positions, 0x12345678u), block_expert(max_blocks, 0x12345678u);
    std::vector<u32> combine_slots((size_t)n * k);
    std::vector<float> combine_weights((size_t)n * k);
    emu::launch({1, 1, 1}, {1024, 1, 1}, (size_t)experts * 12, [&] {
        moe_prefill_align(ids.data(), weights.data(), n, k, experts, max_blocks, sorted.data(), block_expert.data(),
                          combine_slots.data(), combine_weights.data());
    });
    // act: NaN where never written, so that a padding row read as input would show.
    std::vector<u16> act(positions * inter, 0x7fc0);
    std::vector<float> ys((size_t)n * k * hidden, NAN);
    emu::launch({gu_blocks, (unsigned)max_blocks, 1}, {32 * MP_WARPS, 1, 1}, smem, [&] {
        moe_prefill_gate_up(table.data(), 6, block_expert.data(), sorted.data(), k, xb.data(), act.data(), gu_fmt,
                            hidden, inter, gu_row, interleaved, xbufs);
    });
    emu::launch({down_blocks, (unsigned)max_blocks, 1}, {32 * MP_WARPS, 1, 1}, smem, [&] {
        moe_prefill_down(table.data(), 6, block_expert.data(), sorted.data(), act.data(), ys.data(), down_fmt, hidden,
                         inter, down_row, xbufs);
    });

    // The sorting.
    bool align_ok = true;
    std::vector<int> seen((size_t)n * k, 0), pos_of((size_t)n * k, -1);
    int used = 0, last = -1, multi = 0;
    // Blocks by how full: every entry, past the first half (the second warp half partly
    // idle), within the first half (the second half's warps skip all their products).
    int full = 0, past_half = 0, within_half = 0;
    std::vector<int> blocks_of(experts, 0);
    for (int b = 0; b < max_blocks; b++) {
        const u32 e = block_expert[b];
        if (e == MP_EMPTY) continue;
        align_ok &= b == used && (int)e >= last && e < (u32)experts;
        used = b + 1;
        last = (int)e;
        blocks_of[e]++;
        int filled = 0;
        for (int p = b * MP_BM; p < (b + 1) * MP_BM; p++) {
            if (sorted[p] == MP_EMPTY) continue;
            filled++;
            align_ok &= sorted[p] < (u32)(n * k) && ids[sorted[p]] == e;
            if (sorted[p] < (u32)(n * k)) {
                seen[sorted[p]]++;
                pos_of[sorted[p]] = p;
            }
        }
        align_ok &= filled > 0;
        if (filled == MP_BM) full++;
        else if (filled > MP_BM / 2) past_half++;
        else within_half++;
    }
    for (int b = used; b < max_blocks; b++) align_ok &= block_expert[b] == MP_EMPTY;
    for (int v : seen) align_ok &= v == 1;
    for (int e = 0; e < experts; e++) multi += blocks_of[e] > 1;
    for (int r = 0; r < n; r++)
        for (int j = 0; j < k; j++) {
            const u32 s = combine_slots[(size_t)r * k + j];
            align_ok &= s / k == (u32)r && combine_weights[(size_t)r * k + j] == weights[s];
            if (j > 0) align_ok &= ids[s] > ids[combine_slots[(size_t)r * k + j - 1]];
        }
    const int empty_experts = (int)std::count(blocks_of.begin(), blocks_of.end(), 0);
    std::printf("moe_prefill_align: %d blocks (%d experts with several, %d with none; fill: %d full, %d past "
                "half, %d within half): %s\n",
                used, multi, empty_experts, full, past_half, within_half, align_ok ? "ok" : "WRONG");

    // The 32-weight unit decode of the formats that have one (IQ3_S gate/up, Q2_0 down).
    if (gu_fmt == QF_IQ3_S) {
        bool units_ok = true;
        for (int e = 0; e < experts; e++)
            units_ok &= units_match_groups<QF_IQ3_S>(gate_up[e].get(), gu_row, 2 * inter, hidden) &&
                        units_match_groups<QF_Q2_0>(down[e].get(), down_row, hidden, inter);
        std::printf("mp_decode_unit: IQ3_S and Q2_0 units equal the rounded groups bit for bit: %s\n",
                    units_ok ? "ok" : "WRONG");
        align_ok &= units_ok;
    }

    // Every expert's rows decoded once.
    std::vector<std::vector<std::vector<double>>> gu_rows(experts), down_rows(experts);
    for (int e = 0; e < experts; e++) {
        for (int r = 0; r < 2 * inter; r++) gu_rows[e].push_back(decoded_row(gu_fmt, gate_up[e].get(), gu_row, r, hidden));
        for (int o = 0; o < hidden; o++) down_rows[e].push_back(decoded_row(down_fmt, down[e].get(), down_row, o, inter));
    }
    // Gate/up, then down on the kernel's act.
    double gu_err = 0, down_err = 0;
    for (int i = 0; i < n * k && align_ok; i++) {
        const int e = (int)ids[i], p = pos_of[i];
        const float* xr = x.data() + (size_t)(i / k) * hidden;
        std::vector<double> a(inter);
        for (int c = 0; c < inter; c++) {
            double dot[2] = {0, 0}, mag[2] = {0, 0};
            for (int m = 0; m < 2; m++) {
                const std::vector<double>& w = gu_rows[e][interleaved ? 2 * c + m : m * inter + c];
                for (int h = 0; h < hidden; h++) {
                    const double t = w[h] * bf16_round(xr[h]);
                    dot[m] += t;
                    mag[m] += std::fabs(t);
                }
                dot[m] *= mult_gu[e];
                mag[m] *= mult_gu[e];
            }
            const double silu = dot[0] / (1.0 + std::exp(-dot[0])), want = silu * dot[1];
            const double got = bf16_to_f32(act[(size_t)p * inter + c]);
            const double scale = 1.1 * std::fabs(dot[1]) * mag[0] + std::fabs(silu) * mag[1] + 1e-30;
            gu_err = emu::worst(gu_err, std::fabs(got - want) / (std::fabs(want) / 128.0 + 1e-5 * scale));
            a[c] = got;
        }
        for (int o = 0; o < hidden; o++) {
            const std::vector<double>& w = down_rows[e][o];
            double dot = 0, mag = 0;
            for (int c = 0; c < inter; c++) {
                dot += w[c] * a[c];
                mag += std::fabs(w[c] * a[c]);
            }
            const double got = ys[(size_t)i * hidden + o];
            down_err = emu::worst(down_err, std::fabs(got - mult_down[e] * dot) / (mult_down[e] * mag + 1e-30));
        }
    }
    std::printf("moe_prefill_gate_up: max error %.3g of a BF16 ulp plus 1e-5 of Σ|w·x|: %s\n", gu_err,
                gu_err <= 1.0 ? "ok" : "TOO LARGE");
    std::printf("moe_prefill_down: max error %.3g of Σ|w·act|: %s\n", down_err, down_err <= 1e-5 ? "ok" : "TOO LARGE");
    return align_ok && gu_err <= 1.0 && down_err <= 1e-5 ? 0 : 1;
}
