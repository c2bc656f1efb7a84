// y[n, out] = x[n, in] · W[out, in]ᵀ for a few rows (decode): one warp per output row reads the
// weight row once with 16-byte loads and accumulates all n input rows in f32.

template <int DT>
struct Vec16;  // 16 bytes of weights, unpacked to f32

template <>
struct Vec16<DT_BF16> {
    static const int N = 8;
    static __device__ __forceinline__ void unpack(uint4 v, float* f) {
        u32 w[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
        for (int i = 0; i < 4; i++) {
            f[2 * i] = __uint_as_float(w[i] << 16);
            f[2 * i + 1] = __uint_as_float(w[i] & 0xffff0000u);
        }
    }
};

template <>
struct Vec16<DT_F16> {
    static const int N = 8;
    static __device__ __forceinline__ void unpack(uint4 v, float* f) {
        u32 w[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
        for (int i = 0; i < 4; i++) {
            f[2 * i] = f16_to_f32((u16)(w[i] & 0xffffu));
            f[2 * i + 1] = f16_to_f32((u16)(w[i] >> 16));
        }
    }
};

template <>
struct Vec16<DT_F32> {
    static const int N = 4;
    static __device__ __forceinline__ void unpack(uint4 v, float* f) {
        f[0] = __uint_as_float(v.x);
        f[1] = __uint_as_float(v.y);
        f[2] = __uint_as_float(v.z);
        f[3] = __uint_as_float(v.w);
    }
};

// The 16-byte weight vector `v` of a row into the sums of every input row.
template <int DT, int ROWS>
__device__ __forceinline__ void matvec_vector(const uint4* wv, int v, const float* x, int in, float* acc) {
    const int EPV = Vec16<DT>::N;
    float wf[EPV];
    Vec16<DT>::unpack(__ldg(wv + v), wf);
#pragma unroll
    for (int r = 0; r < ROWS; r++) {
        const float4* xv = (const float4*)(x + (u64)r * in + (u64)v * EPV);
#pragma unroll
        for (int q = 0; q < EPV / 4; q++) {
            float4 xx = xv[q];
            acc[r] += wf[4 * q] * xx.x + wf[4 * q + 1] * xx.y + wf[4 * q + 2] * xx.z + wf[4 * q + 3] * xx.w;
        }
    }
}

template <int DT, int ROWS>
__device__ __forceinline__ void matvec_impl(const void* w, const float* x, float* y, int in, int out) {
    const int lane = threadIdx.x & 31;
    const int row = blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5);
    if (row >= out) return;
    const int EPV = Vec16<DT>::N;
    const int esize = DT == DT_F32 ? 4 : 2;
    float acc[ROWS];
#pragma unroll
    for (int r = 0; r < ROWS; r++) acc[r] = 0.0f;
    const char* wrow = (const char*)w + (u64)row * in * esize;
    if (in % EPV == 0) {
        const uint4* wv = (const uint4*)wrow;
        const int nv = in / EPV;
#pragma unroll 4
        for (int v = lane; v < nv; v += 32) matvec_vector<DT, ROWS>(wv, v, x, in, acc);
    } else {
        for (int i = lane; i < in; i += 32) {
            float wf = load_weight(wrow, DT, i);
#pragma unroll
            for (int r = 0; r < ROWS; r++) acc[r] += wf * x[(u64)r * in + i];
        }
    }
#pragma unroll
    for (int r = 0; r < ROWS; r++) {
        float s = warp_sum(acc[r]);
        if (lane == 0) y[(u64)r * out + row] = s;
    }
}

// Split-K, for matrices with too few rows to fill the GPU at a warp a row (Flash-Next's
// hyper-connection, router and shared-expert projections): a block of 8 warps takes 8 / KS
// rows, KS warps a row, each over an interleaved share of its 16-byte vectors; the partial
// sums meet in shared memory and are added in warp order (a fixed order: results repeat).
// `in` is a multiple of the vector width (the host checks).
template <int DT, int ROWS, int KS>
__device__ __forceinline__ void matvec_splitk_impl(const void* w, const float* x, float* y, int in, int out) {
    __shared__ float partial[8][ROWS];
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int row = blockIdx.x * (8 / KS) + warp / KS;
    const int slice = warp % KS;
    const int EPV = Vec16<DT>::N;
    const int esize = DT == DT_F32 ? 4 : 2;
    float acc[ROWS];
#pragma unroll
    for (int r = 0; r < ROWS; r++) acc[r] = 0.0f;
    if (row < out) {
        const uint4* wv = (const uint4*)((const char*)w + (u64)row * in * esize);
        const int nv = in / EPV;
#pragma unroll 4
        for (int v = slice * 32 + lane; v < nv; v += 32 * KS) matvec_vector<DT, ROWS>(wv, v, x, in, acc);
    }
#pragma unroll
    for (int r = 0; r < ROWS; r++) {
        const float s = warp_sum(acc[r]);
        if (lane == 0) partial[warp][r] = s;
    }
    __syncthreads();
    if (slice == 0 && lane < ROWS && row < out) {
        float t = 0.0f;
#pragma unroll
        for (int j = 0; j < KS; j++) t += partial[warp + j][lane];
        y[(u64)lane * out + row] = t;
    }
}

#define MATVEC_SPLITK(NAME, DT, ROWS, KS)                                                      \
    extern "C" __global__ void NAME(const void* w, const float* x, float* y, int in, int out) { KERNEL_START(); \
        matvec_splitk_impl<DT, ROWS, KS>(w, x, y, in, out);                                    \
    }

#define MATVEC_SPLITK_ALL(PREFIX, DT, ROWS) \
    MATVEC_SPLITK(PREFIX##_##ROWS##_k2, DT, ROWS, 2) \
    MATVEC_SPLITK(PREFIX##_##ROWS##_k4, DT, ROWS, 4) \
    MATVEC_SPLITK(PREFIX##_##ROWS##_k8, DT, ROWS, 8)

#define MATVEC(NAME, DT, ROWS)                                                                 \
    extern "C" __global__ void NAME(const void* w, const float* x, float* y, int in, int out) { KERNEL_START(); \
        matvec_impl<DT, ROWS>(w, x, y, in, out);                                               \
    }

#define MATVEC_ALL_ROWS(PREFIX, DT) \
    MATVEC(PREFIX##_1, DT, 1)       \
    MATVEC(PREFIX##_2, DT, 2)       \
    MATVEC(PREFIX##_3, DT, 3)       \
    MATVEC(PREFIX##_4, DT, 4)       \
    MATVEC(PREFIX##_5, DT, 5)       \
    MATVEC(PREFIX##_6, DT, 6)       \
    MATVEC(PREFIX##_7, DT, 7)       \
    MATVEC(PREFIX##_8, DT, 8)

MATVEC_ALL_ROWS(matvec_bf16, DT_BF16)
MATVEC_ALL_ROWS(matvec_f16, DT_F16)
MATVEC_ALL_ROWS(matvec_f32, DT_F32)

// The split-K kernels: matvec_<dt>_<rows>_k<KS>, rows 1..8, KS 2, 4, 8.
#define MATVEC_SPLITK_ALL_ROWS(PREFIX, DT) \
    MATVEC_SPLITK_ALL(PREFIX, DT, 1)       \
    MATVEC_SPLITK_ALL(PREFIX, DT, 2)       \
    MATVEC_SPLITK_ALL(PREFIX, DT, 3)       \
    MATVEC_SPLITK_ALL(PREFIX, DT, 4)       \
    MATVEC_SPLITK_ALL(PREFIX, DT, 5)       \
    MATVEC_SPLITK_ALL(PREFIX, DT, 6)       \
    MATVEC_SPLITK_ALL(PREFIX, DT, 7)       \
    MATVEC_SPLITK_ALL(PREFIX, DT, 8)

MATVEC_SPLITK_ALL_ROWS(matvec_bf16, DT_BF16)
MATVEC_SPLITK_ALL_ROWS(matvec_f16, DT_F16)
MATVEC_SPLITK_ALL_ROWS(matvec_f32, DT_F32)
