// Host references of the int8 fast path for the emulator drivers (no kernels): IQ3_S weights as
// integers with their scale, and x rounded to int8 per 32 values as the kernels round it.
// Include after kernels.inc (QT_IQ3S).
#pragma once

#include <cmath>
#include <vector>

// IQ3_S weight i (0..255) of the block at b, as (integer value, its scale d·(1 + 2·scale)).
inline void iq3s_weight(const unsigned char* b, int i, int* value, double* scale) {
    const int entry = i / 4, sub = i / 32;
    const int index = b[2 + entry] | (((b[66 + entry / 8] >> (entry % 8)) & 1) << 8);
    const int mag = (QT_IQ3S[index] >> (8 * (i % 4))) & 255;
    const int sign = (b[74 + i / 8] >> (i % 8)) & 1 ? -1 : 1;
    const int sc = (b[106 + sub / 2] >> (4 * (sub % 2))) & 15;
    *value = sign * mag;
    *scale = emu_f16_to_f32((unsigned short)(b[0] | (b[1] << 8))) * (1.0 + 2.0 * sc);
}

// x rounded as the kernels round it: q[i] and the step of each 32 values.
inline void quantize(const float* x, int n, std::vector<int>& q, std::vector<float>& step) {
    q.assign(n, 0);
    step.assign(n / 32, 0.0f);
    for (int g = 0; g < n / 32; g++) {
        float amax = 0.0f;
        for (int k = 0; k < 32; k++) amax = std::fmax(amax, std::fabs(x[32 * g + k]));
        const float inv = amax > 0.0f ? 127.0f / amax : 0.0f;
        for (int k = 0; k < 32; k++) q[32 * g + k] = (int)std::nearbyint(x[32 * g + k] * inv);
        step[g] = amax * (1.0f / 127.0f);
    }
}
