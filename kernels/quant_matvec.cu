// Quantized weights (backend/cpu/experts/format.rs `RowFormat`): every row is a run of blocks,
// decoded here 8 weights at a time ("groups"), exactly as the CPU's scalar reference does.
//   quant_matvec_<rows>: y[n, out] = mult · x[n, in] · W[out, in]ᵀ for a few rows (decode);
//     one warp per QMV_RPW output rows, each lane a group of 8 columns per step, so every
//     x value loaded serves QMV_RPW weight rows.
//   quant_dequant_rows: rows of W (optionally picked by ids) widened to f32 or BF16 (prefill
//     GEMM operands, embedding lookups).
// The value tables (QT_E4M3, QT_E2M1: f32 bit patterns), lattices and sign tables (QT_*) are
// generated from quant/{fp8,nvfp4,iq_tables}.rs and prepended by
// backend/cuda/kernels.rs.

#define QF_Q8_0 1
#define QF_NVFP4 2
#define QF_IQ3_S 3
#define QF_IQ3_XXS 4
#define QF_IQ2_XS 5
#define QF_Q2_0 6
#define QF_FP8 7

#define QMV_RPW 4

__device__ __forceinline__ float qf16(const unsigned char* p) {
    return f16_to_f32((u16)(p[0] | (p[1] << 8)));
}

__device__ __forceinline__ int qf_block_len(int fmt) {
    return fmt == QF_Q8_0 ? 32 : fmt == QF_NVFP4 ? 64 : fmt == QF_Q2_0 ? 64 : fmt == QF_FP8 ? 128 : 256;
}
__device__ __forceinline__ int qf_block_bytes(int fmt) {
    switch (fmt) {
        case QF_Q8_0: return 34;
        case QF_NVFP4: return 36;
        case QF_IQ3_S: return 110;
        case QF_IQ3_XXS: return 98;
        case QF_IQ2_XS: return 74;
        case QF_Q2_0: return 18;
        default: return 132;
    }
}

__device__ __forceinline__ float qsign(float v, unsigned bits, int j) { return (bits >> j) & 1 ? -v : v; }

// Weights 8g … 8g+7 of the row starting at `row`.
template <int FMT>
__device__ __forceinline__ void qdecode8(const unsigned char* row, int g, float* w) {
    if (FMT == QF_NVFP4) {
        const unsigned char* b = row + (g >> 3) * 36;
        const int sub = g & 7;
        const float s = __uint_as_float(QT_E4M3[b[sub >> 1]]);
        const u32 codes = *(const u32*)(b + 4 + 4 * sub);
        // E2M1 from registers instead of a table: twice the magnitudes {0, .5, 1, 1.5, 2, 3, 4, 6}
        // as bytes, picked by __byte_perm; the sign is bit 3. Same values as QT_E2M1.
#pragma unroll
        for (int j = 0; j < 8; j++) {
            const u32 c = (codes >> (4 * j)) & 15;
            const float m = (float)__byte_perm(0x03020100u, 0x0C080604u, c & 7) * 0.5f;
            w[j] = (c & 8 ? -m : m) * s;
        }
    } else if (FMT == QF_Q8_0) {
        const unsigned char* b = row + (g >> 2) * 34;
        const float d = qf16(b);
        const unsigned char* q = b + 2 + 8 * (g & 3);
#pragma unroll
        for (int j = 0; j < 8; j++) w[j] = (float)(signed char)q[j] * d;
    } else if (FMT == QF_Q2_0) {
        const unsigned char* b = row + (g >> 3) * 18;
        const float d = qf16(b);
        const unsigned char* q = b + 2 + 2 * (g & 7);
#pragma unroll
        for (int j = 0; j < 8; j++) w[j] = (float)((int)((q[j >> 2] >> (2 * (j & 3))) & 3) - 1) * d;
    } else if (FMT == QF_FP8) {
        const unsigned char* b = row + (g >> 4) * 132;
        const float s = *(const float*)b;
        const unsigned char* q = b + 4 + 8 * (g & 15);
#pragma unroll
        for (int j = 0; j < 8; j++) w[j] = __uint_as_float(QT_E4M3[q[j]]) * s;
    } else if (FMT == QF_IQ3_S) {
        const unsigned char* b = row + (g >> 5) * 110;
        const int i8 = g & 31;
        const float d = qf16(b);
        const int sub = i8 >> 2;
        const int s = (b[106 + (sub >> 1)] >> (4 * (sub & 1))) & 15;
        const float db = d * (float)(1 + 2 * s);
        const unsigned signs = b[74 + i8];
#pragma unroll
        for (int h = 0; h < 2; h++) {
            const int i = 2 * i8 + h;
            const int index = b[2 + i] | (((b[66 + (i >> 3)] >> (i & 7)) & 1) << 8);
            const u32 grid = QT_IQ3S[index];
#pragma unroll
            for (int j = 0; j < 4; j++) w[4 * h + j] = qsign(db * (float)((grid >> (8 * j)) & 255), signs, 4 * h + j);
        }
    } else if (FMT == QF_IQ3_XXS) {
        const unsigned char* b = row + (g >> 5) * 98;
        const int i8 = g & 31;
        const int sub = i8 >> 2, l = i8 & 3;
        const float d = qf16(b);
        const unsigned char* a = b + 66 + 4 * sub;
        const u32 aux = a[0] | (a[1] << 8) | (a[2] << 16) | ((u32)a[3] << 24);
        const float db = d * (0.5f + (float)(aux >> 28)) * 0.5f;
        const unsigned signs = QT_KSIGNS[(aux >> (7 * l)) & 127];
#pragma unroll
        for (int h = 0; h < 2; h++) {
            const u32 grid = QT_IQ3XXS[b[2 + 8 * sub + 2 * l + h]];
#pragma unroll
            for (int j = 0; j < 4; j++) w[4 * h + j] = qsign(db * (float)((grid >> (8 * j)) & 255), signs, 4 * h + j);
        }
    } else if (FMT == QF_IQ2_XS) {
        const unsigned char* b = row + (g >> 5) * 74;
        const int i8 = g & 31;
        const float d = qf16(b);
        const u16 q = (u16)(b[2 + 2 * i8] | (b[3 + 2 * i8] << 8));
        const int s = (b[66 + i8 / 4] >> (4 * ((i8 / 2) % 2))) & 15;
        const float db = d * (0.5f + (float)s) * 0.25f;
        const u64 grid = QT_IQ2XS[q & 511];
        const unsigned signs = QT_KSIGNS[q >> 9];
#pragma unroll
        for (int j = 0; j < 8; j++) w[j] = qsign(db * (float)((grid >> (8 * j)) & 255), signs, j);
    }
}

template <int FMT, int ROWS>
__device__ __forceinline__ void quant_matvec_impl(const unsigned char* w, const float* x, float* y, int in, int out,
                                                  u64 row_bytes, float mult) {
    const int lane = threadIdx.x & 31;
    const int row0 = (blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5)) * QMV_RPW;
    if (row0 >= out) return;
    float acc[QMV_RPW][ROWS];
#pragma unroll
    for (int o = 0; o < QMV_RPW; o++)
#pragma unroll
        for (int r = 0; r < ROWS; r++) acc[o][r] = 0.0f;
    const int groups = in >> 3;
    // Two groups a lane per step where registers allow, so that twice the weight loads are in
    // flight before the arithmetic that needs them (decode is bound by memory latency here).
#pragma unroll (ROWS <= 4 ? 2 : 1)
    for (int g = lane; g < groups; g += 32) {
        float xv[ROWS][8];
#pragma unroll
        for (int r = 0; r < ROWS; r++) {
            const float4* xp = (const float4*)(x + (u64)r * in + 8 * g);
            const float4 a = xp[0], b = xp[1];
            xv[r][0] = a.x; xv[r][1] = a.y; xv[r][2] = a.z; xv[r][3] = a.w;
            xv[r][4] = b.x; xv[r][5] = b.y; xv[r][6] = b.z; xv[r][7] = b.w;
        }
#pragma unroll
        for (int o = 0; o < QMV_RPW; o++) {
            if (row0 + o < out) {
                float wf[8];
                qdecode8<FMT>(w + (u64)(row0 + o) * row_bytes, g, wf);
#pragma unroll
                for (int r = 0; r < ROWS; r++) {
                    float s = 0.0f;
#pragma unroll
                    for (int j = 0; j < 8; j++) s += wf[j] * xv[r][j];
                    acc[o][r] += s;
                }
            }
        }
    }
#pragma unroll
    for (int o = 0; o < QMV_RPW; o++) {
#pragma unroll
        for (int r = 0; r < ROWS; r++) {
            const float s = warp_sum(acc[o][r]);
            if (lane == 0 && row0 + o < out) y[(u64)r * out + row0 + o] = s * mult;
        }
    }
}

template <int ROWS>
__device__ __forceinline__ void quant_matvec_any(int fmt, const unsigned char* w, const float* x, float* y, int in,
                                                 int out, u64 row_bytes, float mult) {
    switch (fmt) {
        case QF_NVFP4: quant_matvec_impl<QF_NVFP4, ROWS>(w, x, y, in, out, row_bytes, mult); break;
        case QF_Q8_0: quant_matvec_impl<QF_Q8_0, ROWS>(w, x, y, in, out, row_bytes, mult); break;
        case QF_IQ3_S: quant_matvec_impl<QF_IQ3_S, ROWS>(w, x, y, in, out, row_bytes, mult); break;
        case QF_IQ3_XXS: quant_matvec_impl<QF_IQ3_XXS, ROWS>(w, x, y, in, out, row_bytes, mult); break;
        case QF_IQ2_XS: quant_matvec_impl<QF_IQ2_XS, ROWS>(w, x, y, in, out, row_bytes, mult); break;
        case QF_Q2_0: quant_matvec_impl<QF_Q2_0, ROWS>(w, x, y, in, out, row_bytes, mult); break;
        case QF_FP8: quant_matvec_impl<QF_FP8, ROWS>(w, x, y, in, out, row_bytes, mult); break;
    }
}

// grid ceil(out / (8 · QMV_RPW)), block 256 (8 warps).
#define QMATVEC(ROWS)                                                                                      \
    extern "C" __global__ void quant_matvec_##ROWS(int fmt, const unsigned char* w, const float* x, float* y, \
                                                   int in, int out, u64 row_bytes, float mult) {             \
        quant_matvec_any<ROWS>(fmt, w, x, y, in, out, row_bytes, mult);                                      \
    }
QMATVEC(1)
QMATVEC(2)
QMATVEC(3)
QMATVEC(4)
QMATVEC(5)
QMATVEC(6)
QMATVEC(7)
QMATVEC(8)

template <int FMT>
__device__ __forceinline__ void dequant_rows_impl(const unsigned char* w, const u32* ids, u64 row0, int rows, int cols,
                                                  u64 row_bytes, float mult, void* out, int out_bf16) {
    const u64 groups_per_row = cols >> 3;
    const u64 total = (u64)rows * groups_per_row;
    for (u64 e = blockIdx.x * (u64)blockDim.x + threadIdx.x; e < total; e += (u64)gridDim.x * blockDim.x) {
        const u64 r = e / groups_per_row;
        const int g = (int)(e % groups_per_row);
        const u64 src = ids ? (u64)ids[r] : row0 + r;
        float wf[8];
        qdecode8<FMT>(w + src * row_bytes, g, wf);
        if (out_bf16) {
            u32 packed[4];
#pragma unroll
            for (int j = 0; j < 4; j++)
                packed[j] = (u32)f32_to_bf16(wf[2 * j] * mult) | ((u32)f32_to_bf16(wf[2 * j + 1] * mult) << 16);
            *(uint4*)((u16*)out + r * cols + 8 * g) = make_uint4(packed[0], packed[1], packed[2], packed[3]);
        } else {
            float4* o = (float4*)((float*)out + r * cols + 8 * g);
            o[0] = make_float4(wf[0] * mult, wf[1] * mult, wf[2] * mult, wf[3] * mult);
            o[1] = make_float4(wf[4] * mult, wf[5] * mult, wf[6] * mult, wf[7] * mult);
        }
    }
}

// Grid-stride over rows × (cols / 8) groups. Output row r is W row ids[r] (ids non-null) or
// row0 + r, written to out [rows, cols] as f32 or (out_bf16) BF16.
extern "C" __global__ void quant_dequant_rows(int fmt, const unsigned char* w, const u32* ids, u64 row0, int rows,
                                              int cols, u64 row_bytes, float mult, void* out, int out_bf16) {
    switch (fmt) {
        case QF_NVFP4: dequant_rows_impl<QF_NVFP4>(w, ids, row0, rows, cols, row_bytes, mult, out, out_bf16); break;
        case QF_Q8_0: dequant_rows_impl<QF_Q8_0>(w, ids, row0, rows, cols, row_bytes, mult, out, out_bf16); break;
        case QF_IQ3_S: dequant_rows_impl<QF_IQ3_S>(w, ids, row0, rows, cols, row_bytes, mult, out, out_bf16); break;
        case QF_IQ3_XXS: dequant_rows_impl<QF_IQ3_XXS>(w, ids, row0, rows, cols, row_bytes, mult, out, out_bf16); break;
        case QF_IQ2_XS: dequant_rows_impl<QF_IQ2_XS>(w, ids, row0, rows, cols, row_bytes, mult, out, out_bf16); break;
        case QF_Q2_0: dequant_rows_impl<QF_Q2_0>(w, ids, row0, rows, cols, row_bytes, mult, out, out_bf16); break;
        case QF_FP8: dequant_rows_impl<QF_FP8>(w, ids, row0, rows, cols, row_bytes, mult, out, out_bf16); break;
    }
}
