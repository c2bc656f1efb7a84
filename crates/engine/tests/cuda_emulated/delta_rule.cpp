// kernels/delta_rule.cu on the CPU emulator (emu.hpp), against a double-precision reference of
// the gated delta rule: the chunked prefill kernels (gdr_chunk_prep + gdr_chunk_scan, launched
// segment by segment with the host's launch plan, passed on the command line by
// tests/cuda_emulated.rs) and the recurrent decode kernel (gated_delta_rule), plain and with the
// GDN output norm (both gate activations).
//
// usage: delta_rule n nk nv dk dv seg_chunks per_chunk prep_smem scan_smem tile seed [dump]
// Prints the largest errors; exits 1 where one is over the tolerance. With `dump`, writes the
// chunked output and state as raw f32 to that path (to compare two kernel versions bit for bit).
#include "emu.hpp"
#include "kernels.inc"

#include <random>
#include <string>

int main(int argc, char** argv) {
    if (argc < 12) {
        std::fprintf(stderr, "usage: %s n nk nv dk dv seg_chunks per_chunk prep_smem scan_smem tile seed [dump]\n", argv[0]);
        return 2;
    }
    auto arg = [&](int i) { return std::stoll(argv[i]); };
    const int n = (int)arg(1), nk = (int)arg(2), nv = (int)arg(3), dk = (int)arg(4), dv = (int)arg(5);
    const int seg_chunks = (int)arg(6);
    const size_t per_chunk = (size_t)arg(7), prep_smem = (size_t)arg(8), scan_smem = (size_t)arg(9);
    const unsigned tile = (unsigned)arg(10);
    std::mt19937_64 rng((uint64_t)arg(11));
    std::uniform_real_distribution<float> u(-1.0f, 1.0f), decay(0.02f, 1.5f), gate(0.05f, 0.95f);

    // Heap buffers of the exact sizes, so AddressSanitizer catches a read or write past them.
    auto filled = [&](size_t len, auto& dist, float sign) {
        std::unique_ptr<float[]> b(new float[len]);
        for (size_t i = 0; i < len; i++) b[i] = sign * dist(rng);
        return b;
    };
    auto q = filled((size_t)n * nk * dk, u, 1.0f), k = filled((size_t)n * nk * dk, u, 1.0f);
    auto v = filled((size_t)n * nv * dv, u, 1.0f);
    auto g = filled((size_t)n * nv, decay, -1.0f), beta = filled((size_t)n * nv, gate, 1.0f);
    auto state0 = filled((size_t)nv * dk * dv, u, 0.5f);

    // Reference, in double: S ← S·e^g; δ = β(v − Sᵀk̂); S ← S + k̂ δᵀ; o = Sᵀq̂.
    std::vector<double> ref_out, ref_state;
    auto reference = [&](int n) {
    ref_out.assign((size_t)n * nv * dv, 0.0);
    ref_state.assign((size_t)nv * dk * dv, 0.0);
    for (int h = 0; h < nv; h++) {
        const int kh = h / (nv / nk);
        std::vector<double> S(state0.get() + (size_t)h * dk * dv, state0.get() + (size_t)(h + 1) * dk * dv);
        std::vector<double> qh(dk), khat(dk), kv(dv);
        for (int t = 0; t < n; t++) {
            double qq = 0, kk = 0;
            for (int a = 0; a < dk; a++) {
                qh[a] = q[((size_t)t * nk + kh) * dk + a];
                khat[a] = k[((size_t)t * nk + kh) * dk + a];
                qq += qh[a] * qh[a];
                kk += khat[a] * khat[a];
            }
            const double qinv = 1.0 / std::sqrt(qq + 1e-6) / std::sqrt((double)dk), kinv = 1.0 / std::sqrt(kk + 1e-6);
            const double e = std::exp((double)g[(size_t)t * nv + h]), b = beta[(size_t)t * nv + h];
            for (auto& s : S) s *= e;
            for (int c = 0; c < dv; c++) {
                double acc = 0;
                for (int a = 0; a < dk; a++) acc += S[(size_t)a * dv + c] * khat[a] * kinv;
                kv[c] = b * (v[((size_t)t * nv + h) * dv + c] - acc);
            }
            for (int a = 0; a < dk; a++)
                for (int c = 0; c < dv; c++) S[(size_t)a * dv + c] += khat[a] * kinv * kv[c];
            for (int c = 0; c < dv; c++) {
                double o = 0;
                for (int a = 0; a < dk; a++) o += S[(size_t)a * dv + c] * qh[a] * qinv;
                ref_out[((size_t)t * nv + h) * dv + c] = o;
            }
        }
        std::copy(S.begin(), S.end(), ref_state.begin() + (size_t)h * dk * dv);
    }
    };

    auto compare = [&](const char* what, const float* out, const float* state) {
        double eo = 0, es = 0, mo = 0, ms = 0;
        for (size_t i = 0; i < ref_out.size(); i++) {
            eo = emu::worst(eo, std::fabs(out[i] - ref_out[i]));
            mo = std::max(mo, std::fabs(ref_out[i]));
        }
        for (size_t i = 0; i < ref_state.size(); i++) {
            es = emu::worst(es, std::fabs(state[i] - ref_state[i]));
            ms = std::max(ms, std::fabs(ref_state[i]));
        }
        // f32 against double over a few hundred tokens: ~1e-6 of the largest value (measured);
        // a wrong index, a missed barrier or a stale buffer is of the order of the values.
        const bool ok = eo <= 2e-5 * mo && es <= 2e-5 * ms;
        std::printf("%s: max |out - ref| %.3g (|ref| <= %.3g), max |state - ref| %.3g (|ref| <= %.3g): %s\n", what, eo,
                    mo, es, ms, ok ? "ok" : "TOO LARGE");
        return ok;
    };

    // Chunked prefill, segment by segment as the host launches it.
    reference(n);
    const int chunks = (n + 63) / 64;
    std::unique_ptr<float[]> ws(new float[(size_t)seg_chunks * nv * per_chunk]);
    std::unique_ptr<float[]> out(new float[(size_t)n * nv * dv]);
    std::unique_ptr<float[]> state(new float[(size_t)nv * dk * dv]);
    std::copy(state0.get(), state0.get() + (size_t)nv * dk * dv, state.get());
    for (int c0 = 0; c0 < chunks; c0 += seg_chunks) {
        const int seg = std::min(seg_chunks, chunks - c0), t0 = c0 * 64;
        emu::launch({(unsigned)nv, (unsigned)seg, 1}, {256, 1, 1}, prep_smem, [&] {
            gdr_chunk_prep(q.get(), k.get(), v.get(), g.get(), beta.get(), ws.get(), n, t0, nk, nv, dk, dv);
        });
        emu::launch({(unsigned)nv, (dv + tile - 1) / tile, 1}, {256, 1, 1}, scan_smem,
                    [&] { gdr_chunk_scan(ws.get(), state.get(), out.get(), n, t0, seg, nv, dk, dv); });
    }
    bool ok = compare("chunked (gdr_chunk_prep + gdr_chunk_scan)", out.get(), state.get());
    if (argc > 12) {
        FILE* f = std::fopen(argv[12], "wb");
        std::fwrite(out.get(), 4, (size_t)n * nv * dv, f);
        std::fwrite(state.get(), 4, (size_t)nv * dk * dv, f);
        std::fclose(f);
    }

    // The recurrent decode kernel over the first tokens (a barrier per token per block makes
    // it the slow part of the emulation).
    const int nr = std::min(n, 24);
    reference(nr);
    std::copy(state0.get(), state0.get() + (size_t)nv * dk * dv, state.get());
    const unsigned warps = (unsigned)(dk + 31) / 32, tiles = (unsigned)(dv + 31) / 32;
    emu::launch({(unsigned)nv, tiles, 1}, {32, warps, 1}, 0, [&] {
        gated_delta_rule(q.get(), k.get(), v.get(), g.get(), beta.get(), state.get(), out.get(), nr, nk, nv, dk, dv,
                         nk * dk, nk * dk, nv * dv, nullptr, nullptr, 0, 0.0f, nullptr, nullptr);
    });
    ok &= compare("recurrent (gated_delta_rule)", out.get(), state.get());

    // The normed form (Backend::gated_delta_rule_normed): a block holds a head's every value
    // tile, and each output row leaves as rms_norm(o) · w · act(z), for both activations; the
    // reference norms the double-precision output the same way.
    auto w = filled((size_t)dv, u, 1.0f), z = filled((size_t)nr * nv * dv, u, 2.0f);
    const float eps = 1e-6f;
    const std::vector<double> plain_out = ref_out;
    for (int act = 0; act < 2; act++) {
        ref_out = plain_out;
        for (int t = 0; t < nr; t++)
            for (int h = 0; h < nv; h++) {
                double* o = &ref_out[((size_t)t * nv + h) * dv];
                double ss = 0;
                for (int c = 0; c < dv; c++) ss += o[c] * o[c];
                const double inv = 1.0 / std::sqrt(ss / dv + eps);
                for (int c = 0; c < dv; c++) {
                    const double zc = z[((size_t)t * nv + h) * dv + c];
                    const double gate = act ? 1.0 / (1.0 + std::exp(-zc)) : zc / (1.0 + std::exp(-zc));
                    o[c] = o[c] * inv * w[c] * gate;
                }
            }
        std::copy(state0.get(), state0.get() + (size_t)nv * dk * dv, state.get());
        emu::launch({(unsigned)nv, 1, 1}, {32, warps * tiles, 1}, 0, [&] {
            gated_delta_rule(q.get(), k.get(), v.get(), g.get(), beta.get(), state.get(), out.get(), nr, nk, nv, dk,
                             dv, nk * dk, nk * dk, nv * dv, w.get(), z.get(), act, eps, nullptr, nullptr);
        });
        ok &= compare(act ? "recurrent, normed, sigmoid gate" : "recurrent, normed, silu gate", out.get(), state.get());
    }
    return ok ? 0 : 1;
}
