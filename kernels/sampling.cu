// Greedy picks on the device (Backend::argmax_rows): each row's first index of its largest
// value above −∞, NaNs never winning, 0 where there is none, as crate::sampling::argmax picks
// on the host. A decode step then reads back 4 bytes a row instead of its logits (1 MB for
// the 248K-token vocabulary: a tenth of a millisecond of a 9 ms 27B step, plus the host's scan).
//
// A candidate is one 64-bit key: the value's bits mapped to an unsigned order in the high half
// (above 0, the key of "no candidate"), the index's complement in the low half, so the largest
// key holds the largest value and, among equal values, the lowest index. −0 counts as +0: the
// host compares them equal.

__device__ __forceinline__ u64 argmax_key(float v, u32 i) {
    if (!(v > -INFINITY)) return 0ull;  // NaN and −∞: no candidate
    const u32 raw = __float_as_uint(v == 0.0f ? 0.0f : v);
    const u32 ordered = (raw & 0x80000000u) ? ~raw : (raw | 0x80000000u);
    return ((u64)ordered << 32) | (u64)(~i);
}

// The warp's largest key, in every lane (two 32-bit shuffles a step).
__device__ __forceinline__ u64 warp_max_key(u64 k) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) {
        const u32 hi = __shfl_xor_sync(0xffffffffu, (u32)(k >> 32), o);
        const u32 lo = __shfl_xor_sync(0xffffffffu, (u32)k, o);
        const u64 other = ((u64)hi << 32) | lo;
        k = other > k ? other : k;
    }
    return k;
}

// The block's largest key, in thread 0 (blockDim.x a multiple of 32).
__device__ __forceinline__ u64 block_max_key(u64 k) {
    __shared__ u64 warp_best[32];
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, warps = blockDim.x >> 5;
    k = warp_max_key(k);
    if (lane == 0) warp_best[warp] = k;
    __syncthreads();
    if (warp == 0) k = warp_max_key(lane < warps ? warp_best[lane] : 0ull);
    return k;
}

// grid (parts, rows), block 256: part p of row r scans columns [p·chunk, (p+1)·chunk) of the
// first `cols` of x [rows, stride] into partial[r · parts + p].
extern "C" __global__ void argmax_partial(const float* x, int stride, int cols, int chunk, u64* partial) { KERNEL_START();
    const float* row = x + (u64)blockIdx.y * stride;
    const int c0 = blockIdx.x * chunk, c1 = min(cols, c0 + chunk);
    u64 best = 0ull;
    for (int c = c0 + threadIdx.x; c < c1; c += blockDim.x) {
        const u64 k = argmax_key(row[c], (u32)c);
        best = k > best ? k : best;
    }
    best = block_max_key(best);
    if (threadIdx.x == 0) partial[(u64)blockIdx.y * gridDim.x + blockIdx.x] = best;
}

// grid (rows), block 256: ids[r] from row r's `parts` partial keys.
extern "C" __global__ void argmax_final(const u64* partial, int parts, u32* ids) { KERNEL_START();
    u64 best = 0ull;
    for (int p = threadIdx.x; p < parts; p += blockDim.x) {
        const u64 k = partial[(u64)blockIdx.x * parts + p];
        best = k > best ? k : best;
    }
    best = block_max_key(best);
    if (threadIdx.x == 0) ids[blockIdx.x] = best ? ~(u32)best : 0u;
}
