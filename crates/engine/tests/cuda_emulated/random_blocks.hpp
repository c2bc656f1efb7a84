// Random quantized blocks for the emulator drivers' experts (host code, no kernels).
#pragma once

#include <cstring>
#include <memory>
#include <random>

// Random blocks of `block_bytes` with sane scales at their start: GGUF an f16 d of 2^-8 .. 2^-5,
// either sign; NVFP4 (`nvfp4`) four positive E4M3 scales of 2^-3 .. 2^2 (no NaN codes).
inline std::unique_ptr<unsigned char[]> random_blocks(std::mt19937_64& rng, size_t bytes, int block_bytes,
                                                      bool nvfp4) {
    std::unique_ptr<unsigned char[]> m(new unsigned char[bytes]);
    for (size_t i = 0; i < bytes; i++) m[i] = (unsigned char)rng();
    for (size_t b = 0; b < bytes / block_bytes; b++) {
        unsigned char* blk = m.get() + (size_t)block_bytes * b;
        if (nvfp4) {
            for (int k = 0; k < 4; k++) blk[k] = (unsigned char)(((4 + rng() % 6) << 3) | (rng() % 8));
        } else {
            const unsigned exp = 7 + rng() % 3, man = rng() % 1024;
            const unsigned short d = (unsigned short)(((rng() & 1) << 15) | (exp << 10) | man);
            std::memcpy(blk, &d, 2);
        }
    }
    return m;
}
