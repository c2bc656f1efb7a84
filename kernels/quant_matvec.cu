// Quantized weights (backend/cpu/experts/format.rs `RowFormat`): every row is a run of blocks,
// decoded here 8 weights at a time ("groups"), exactly as the CPU's scalar reference does.
//   quant_matvec_<rows>: y[n, out] = mult · x[n, in] · W[out, in]ᵀ for a few rows (decode);
//     one warp per QMV_RPW output rows, each lane a group of 8 columns per step, so every
//     x value loaded serves QMV_RPW weight rows.
//   quant_dequant_rows: rows of W (optionally picked by ids) widened to f32 or BF16 (prefill
//     GEMM operands, embedding lookups).
// The block-format codes (QF_*: backend/cuda/mod.rs `QUANT_FORMAT_CODES`), the value tables
// (QT_E4M3, QT_E2M1: f32 bit patterns), lattices and sign tables (QT_*) are generated from the
// host's constants and quant/{fp8,nvfp4,iq_tables}.rs and prepended by backend/cuda/kernels.rs.
//
// QF_NVFP4R, NVFP4 repacked for the GPU (backend/cuda/nvfp4_records.rs): each row a run of
// 1024-weight records, 64 E4M3 scales (one per 16 weights) then 512 code bytes (byte k:
// weights 2k, 2k+1), so that a warp reads a record's codes as 32 consecutive 16-byte loads.
#define NVFP4R_RECORD 576
// IQ3_S repacked for the GPU (backend/cuda/iq3s_records.rs): each row a run of 1024-weight
// records (4 blocks, 440 bytes), a 432-byte body of 16 slots of 64 weights, one per lane of a
// half-warp, in four planes (slot i: 16 bytes of packed 9-bit grid indices at 16i, 8 bytes of
// signs at IQ3SR_SIGNS + 8i, the indices' top 16 bits at IQ3SR_HIGH + 2i, two 4-bit scales at
// IQ3SR_SCALES + i), and the 4 blocks' f16 d before the body when the record's address is
// 8 mod 16, after it otherwise, so that the body is always 16-byte aligned (QF_IQ3SR).
#define IQ3SR_RECORD 440
#define IQ3SR_BODY 432
#define IQ3SR_SIGNS 256
#define IQ3SR_HIGH 384
#define IQ3SR_SCALES 416

#define QMV_RPW 4

__device__ __forceinline__ float qf16(const unsigned char* p) {
    return f16_to_f32((u16)(p[0] | (p[1] << 8)));
}

__device__ __forceinline__ int qf_block_len(int fmt) {
    return fmt == QF_Q8_0 ? 32 : fmt == QF_NVFP4 ? 64 : fmt == QF_Q2_0 ? 64 : fmt == QF_FP8 ? 128 : fmt == QF_NVFP4R ? 1024
         : fmt == QF_IQ3SR ? 1024 : 256;
}
__device__ __forceinline__ int qf_block_bytes(int fmt) {
    switch (fmt) {
        case QF_Q8_0: return 34;
        case QF_NVFP4: return 36;
        case QF_IQ3_S: return 110;
        case QF_IQ3_XXS: return 98;
        case QF_IQ2_XS: return 74;
        case QF_Q2_0: return 18;
        case QF_NVFP4R: return NVFP4R_RECORD;
        case QF_IQ3SR: return IQ3SR_RECORD;
        default: return 132;
    }
}

__device__ __forceinline__ float qsign(float v, unsigned bits, int j) { return (bits >> j) & 1 ? -v : v; }

// Where the record at `rec` keeps its body and its 4 f16 d values (QF_IQ3SR).
__device__ __forceinline__ const unsigned char* iq3sr_body(const unsigned char* rec) { return rec + ((u64)rec & 8); }
__device__ __forceinline__ const unsigned char* iq3sr_d(const unsigned char* rec) {
    return rec + ((u64)rec & 8 ? 0 : IQ3SR_BODY);
}

// Grid index k (0..15) of slot `slot` of a record body: bits 9k..9k+8 of the slot's 144 bits
// (16 bytes at 16·slot, then 2 at IQ3SR_HIGH + 2·slot).
__device__ __forceinline__ u32 iq3sr_index(const unsigned char* body, int slot, int k) {
    const int bit = 9 * k, byte = bit >> 3;
    const u32 lo = byte < 16 ? body[16 * slot + byte] : body[IQ3SR_HIGH + 2 * slot + byte - 16];
    const u32 hi = byte + 1 < 16 ? body[16 * slot + byte + 1] : body[IQ3SR_HIGH + 2 * slot + byte + 1 - 16];
    return ((lo | (hi << 8)) >> (bit & 7)) & 511u;
}

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
    } else if (FMT == QF_NVFP4R) {
        const unsigned char* rec = row + (g >> 7) * NVFP4R_RECORD;
        const int gi = g & 127;
        const float s = __uint_as_float(QT_E4M3[rec[gi >> 1]]);
        const u32 codes = *(const u32*)(rec + 64 + 4 * gi);
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
    } else if (FMT == QF_IQ3SR) {
        const unsigned char* rec = row + (g >> 7) * IQ3SR_RECORD;
        const unsigned char* body = iq3sr_body(rec);
        const int gi = g & 127, slot = gi >> 3, k0 = 2 * (gi & 7), sub = k0 >> 3;
        const float d = qf16(iq3sr_d(rec) + 2 * (slot >> 2));
        const int s = (body[IQ3SR_SCALES + slot] >> (4 * sub)) & 15;
        const float db = d * (float)(1 + 2 * s);
        const u32 signs = *(const u32*)(body + IQ3SR_SIGNS + 8 * slot + 4 * sub);
#pragma unroll
        for (int h = 0; h < 2; h++) {
            const int k = k0 + h;
            const u32 grid = QT_IQ3S[iq3sr_index(body, slot, k)];
#pragma unroll
            for (int j = 0; j < 4; j++) w[4 * h + j] = qsign(db * (float)((grid >> (8 * j)) & 255), signs, 8 * j + 7 - (k & 7));
        }
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
        case QF_NVFP4R: quant_matvec_impl<QF_NVFP4R, ROWS>(w, x, y, in, out, row_bytes, mult); break;
        case QF_Q8_0: quant_matvec_impl<QF_Q8_0, ROWS>(w, x, y, in, out, row_bytes, mult); break;
        case QF_IQ3_S: quant_matvec_impl<QF_IQ3_S, ROWS>(w, x, y, in, out, row_bytes, mult); break;
        case QF_IQ3SR: quant_matvec_impl<QF_IQ3SR, ROWS>(w, x, y, in, out, row_bytes, mult); break;
        case QF_IQ3_XXS: quant_matvec_impl<QF_IQ3_XXS, ROWS>(w, x, y, in, out, row_bytes, mult); break;
        case QF_IQ2_XS: quant_matvec_impl<QF_IQ2_XS, ROWS>(w, x, y, in, out, row_bytes, mult); break;
        case QF_Q2_0: quant_matvec_impl<QF_Q2_0, ROWS>(w, x, y, in, out, row_bytes, mult); break;
        case QF_FP8: quant_matvec_impl<QF_FP8, ROWS>(w, x, y, in, out, row_bytes, mult); break;
    }
}

// grid ceil(out / (8 · QMV_RPW)), block 256 (8 warps).
#define QMATVEC(ROWS)                                                                                      \
    extern "C" __global__ void quant_matvec_##ROWS(int fmt, const unsigned char* w, const float* x, float* y, \
                                                   int in, int out, u64 row_bytes, float mult) { KERNEL_START();             \
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
                                              int cols, u64 row_bytes, float mult, void* out, int out_bf16) { KERNEL_START();
    switch (fmt) {
        case QF_NVFP4: dequant_rows_impl<QF_NVFP4>(w, ids, row0, rows, cols, row_bytes, mult, out, out_bf16); break;
        case QF_NVFP4R: dequant_rows_impl<QF_NVFP4R>(w, ids, row0, rows, cols, row_bytes, mult, out, out_bf16); break;
        case QF_Q8_0: dequant_rows_impl<QF_Q8_0>(w, ids, row0, rows, cols, row_bytes, mult, out, out_bf16); break;
        case QF_IQ3_S: dequant_rows_impl<QF_IQ3_S>(w, ids, row0, rows, cols, row_bytes, mult, out, out_bf16); break;
        case QF_IQ3SR: dequant_rows_impl<QF_IQ3SR>(w, ids, row0, rows, cols, row_bytes, mult, out, out_bf16); break;
        case QF_IQ3_XXS: dequant_rows_impl<QF_IQ3_XXS>(w, ids, row0, rows, cols, row_bytes, mult, out, out_bf16); break;
        case QF_IQ2_XS: dequant_rows_impl<QF_IQ2_XS>(w, ids, row0, rows, cols, row_bytes, mult, out, out_bf16); break;
        case QF_Q2_0: dequant_rows_impl<QF_Q2_0>(w, ids, row0, rows, cols, row_bytes, mult, out, out_bf16); break;
        case QF_FP8: dequant_rows_impl<QF_FP8>(w, ids, row0, rows, cols, row_bytes, mult, out, out_bf16); break;
    }
}

// ---------------------------------------------------------------------------------------------
// Fast-path decode matvec (not exact math): one input row, x quantized to int8 per 32 values in
// shared memory (as llama.cpp's q8_1), weights decoded to int8 in registers and multiplied with
// dp4a, scales applied once per 16 (NVFP4) or 32 (IQ3_S) weights. The scalar kernels above do
// ~7 instructions per weight and reach ~0.75 TB/s; these do ~1.5 (NVFP4) and ~3 (IQ3_S).
// Layout in shared memory, per 256 input values ("super-block" s): 256 int8 at s·QX_STRIDE
// (16 bytes of padding so lanes reading different super-blocks hit different banks), 8 f32 x
// scales at s·QS_STRIDE floats, then the E4M3 (NVFP4) or IQ3_S grid table.
#define QX_STRIDE 272
#define QS_STRIDE 12

__device__ __forceinline__ int dp4a_s32(int a, int b, int c) {
#ifdef CAPY_EMULATED
    return __dp4a(a, b, c);  // the CPU emulator's (tests/cuda_emulated/emu.hpp)
#else
    int r;
    asm("dp4a.s32.s32 %0, %1, %2, %3;" : "=r"(r) : "r"(a), "r"(b), "r"(c));
    return r;
#endif
}

// The 32 values at x (16-byte aligned) into v; returns their largest magnitude.
__device__ __forceinline__ float load32_amax(const float* x, float* v) {
    const float4* xp = (const float4*)x;
#pragma unroll
    for (int k = 0; k < 8; k++) {
        const float4 a = xp[k];
        v[4 * k] = a.x; v[4 * k + 1] = a.y; v[4 * k + 2] = a.z; v[4 * k + 3] = a.w;
    }
    float amax = 0.0f;
#pragma unroll
    for (int k = 0; k < 32; k++) amax = fmaxf(amax, fabsf(v[k]));
    return amax;
}

// x[0..in) → int8 per 32 values (scale amax/127), stored at super-block s, group g (of 32) as
// bytes s·QX_STRIDE + 32g …; `nvfp4_order` stores each 8 as [0,2,4,6,1,3,5,7] to match
// e2m1x8_to_i8. Every thread of the block takes part; ends with __syncthreads.
__device__ __forceinline__ void quantize_x_q8(const float* x, int in, unsigned char* xq, float* xs, bool nvfp4_order) {
    for (int g = threadIdx.x; g < (in >> 5); g += blockDim.x) {
        float v[32];
        const float amax = load32_amax(x + 32 * (u64)g, v);
        const float d = amax / 127.0f;
        const float inv = amax > 0.0f ? 127.0f / amax : 0.0f;
        u32 packed[8];
#pragma unroll
        for (int e = 0; e < 4; e++) {
            int q[8];
#pragma unroll
            for (int j = 0; j < 8; j++) q[j] = __float2int_rn(v[8 * e + j] * inv);
            if (nvfp4_order) {
                packed[2 * e] = (q[0] & 255) | ((q[2] & 255) << 8) | ((q[4] & 255) << 16) | ((u32)(q[6] & 255) << 24);
                packed[2 * e + 1] = (q[1] & 255) | ((q[3] & 255) << 8) | ((q[5] & 255) << 16) | ((u32)(q[7] & 255) << 24);
            } else {
                packed[2 * e] = (q[0] & 255) | ((q[1] & 255) << 8) | ((q[2] & 255) << 16) | ((u32)(q[3] & 255) << 24);
                packed[2 * e + 1] = (q[4] & 255) | ((q[5] & 255) << 8) | ((q[6] & 255) << 16) | ((u32)(q[7] & 255) << 24);
            }
        }
        uint4* dst = (uint4*)(xq + (g >> 3) * QX_STRIDE + 32 * (g & 7));
        dst[0] = make_uint4(packed[0], packed[1], packed[2], packed[3]);
        dst[1] = make_uint4(packed[4], packed[5], packed[6], packed[7]);
        xs[(g >> 3) * QS_STRIDE + (g & 7)] = d;
    }
}

// NVFP4, in % 256 == 0, rows 16-byte aligned (row_bytes = in/256 · 144). Each warp takes `rpw`
// consecutive rows (contiguous bytes), each lane 4 whole blocks (256 weights, 9 aligned uint4)
// per step. Grid-stride over warps; block any multiple of 32 threads.
// Dynamic shared memory: (in/256)·(QX_STRIDE + 4·QS_STRIDE) + 1024 bytes.
extern "C" __global__ void quant_matvec_nvfp4_q8(const unsigned char* w, const float* x, float* y, int in, int out,
                                                  u64 row_bytes, float mult, int rpw) { KERNEL_START();
    extern __shared__ __align__(16) unsigned char qsm[];
    const int spr = in >> 8;
    unsigned char* xq = qsm;
    float* xs = (float*)(qsm + spr * QX_STRIDE);
    float* e4m3 = xs + spr * QS_STRIDE;
    for (int i = threadIdx.x; i < 256; i += blockDim.x) e4m3[i] = __uint_as_float(QT_E4M3[i]);
    quantize_x_q8(x, in, xq, xs, true);
    __syncthreads();
    const int lane = threadIdx.x & 31;
    const int warps = gridDim.x * (blockDim.x >> 5);
    for (int row0 = (blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5)) * rpw; row0 < out; row0 += warps * rpw) {
        const int nrows = min(rpw, out - row0);
        float acc[8];
#pragma unroll
        for (int o = 0; o < 8; o++) acc[o] = 0.0f;
        const uint4* base = (const uint4*)(w + (u64)row0 * row_bytes);
        for (int t = lane; t < nrows * spr; t += 32) {
            uint4 v[9];
#pragma unroll
            for (int k = 0; k < 9; k++) v[k] = base[(u64)t * 9 + k];
            const u32* wd = (const u32*)v;
            const int o = t / spr, s = t - o * spr;
            const unsigned char* xb = xq + s * QX_STRIDE;
            const float* xsb = xs + s * QS_STRIDE;
            float p = 0.0f;
#pragma unroll
            for (int b = 0; b < 4; b++) {
                const u32 sc = wd[9 * b];
#pragma unroll
                for (int h = 0; h < 2; h++) {
                    float part = 0.0f;
#pragma unroll
                    for (int sub2 = 0; sub2 < 2; sub2++) {
                        const int sub = 2 * h + sub2;
                        const int2 a = e2m1x8_to_i8(wd[9 * b + 1 + 2 * sub]);
                        const int2 c = e2m1x8_to_i8(wd[9 * b + 2 + 2 * sub]);
                        const uint4 xv = *(const uint4*)(xb + 64 * b + 16 * sub);
                        int isum = dp4a_s32(a.x, (int)xv.x, 0);
                        isum = dp4a_s32(a.y, (int)xv.y, isum);
                        isum = dp4a_s32(c.x, (int)xv.z, isum);
                        isum = dp4a_s32(c.y, (int)xv.w, isum);
                        part += (float)isum * e4m3[(sc >> (8 * sub)) & 255];
                    }
                    p += part * xsb[2 * b + h];
                }
            }
#pragma unroll
            for (int oo = 0; oo < 8; oo++)
                if (oo == o) acc[oo] += p;
        }
#pragma unroll
        for (int oo = 0; oo < 8; oo++) {
            if (oo < nrows) {
                const float s = warp_sum(acc[oo]);
                // 0.5: the int8 table holds twice the E2M1 values.
                if (lane == 0) y[row0 + oo] = s * mult * 0.5f;
            }
        }
    }
}

// IQ3_S (110-byte blocks of 256 weights, 2-byte aligned): rows are not 16-byte aligned, so
// each warp copies 32 blocks at a time of its rows' contiguous bytes into its shared buffer
// with aligned uint4 loads, then each lane decodes one block from there (grid values signed
// by a mask table, dp4a against x). Needs rpw·row_bytes % 16 == 0 and row_bytes % 8 == 0.
// Dynamic shared memory: (in/256)·(QX_STRIDE + 4·QS_STRIDE) + 2048 + 64 + warps·3520 bytes.
#define IQ3S_CHUNK 32
extern "C" __global__ void quant_matvec_iq3s_q8(const unsigned char* w, const float* x, float* y, int in, int out,
                                                 u64 row_bytes, float mult, int rpw) { KERNEL_START();
    extern __shared__ __align__(16) unsigned char qsm[];
    const int spr = in >> 8;
    unsigned char* xq = qsm;
    float* xs = (float*)(qsm + spr * QX_STRIDE);
    u32* grid = (u32*)(xs + spr * QS_STRIDE);
    u32* smask = grid + 512;
    unsigned char* wbuf = (unsigned char*)(smask + 16) + (threadIdx.x >> 5) * (IQ3S_CHUNK * 110);
    for (int i = threadIdx.x; i < 512; i += blockDim.x) grid[i] = QT_IQ3S[i];
    if (threadIdx.x < 16) {
        const u32 t = ((u32)threadIdx.x * 0x00204081u) & 0x01010101u;
        smask[threadIdx.x] = t * 0xFFu;
    }
    quantize_x_q8(x, in, xq, xs, false);
    __syncthreads();
    const int lane = threadIdx.x & 31;
    const int warps = gridDim.x * (blockDim.x >> 5);
    for (int row0 = (blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5)) * rpw; row0 < out; row0 += warps * rpw) {
        const int nrows = min(rpw, out - row0);
        const int nblocks = nrows * spr;
        float acc[8];
#pragma unroll
        for (int o = 0; o < 8; o++) acc[o] = 0.0f;
        const unsigned char* base = w + (u64)row0 * row_bytes;
        for (int c0 = 0; c0 < nblocks; c0 += IQ3S_CHUNK) {
            const int nb = min(IQ3S_CHUNK, nblocks - c0);
            const int bytes = nb * 110;
            const int n16 = bytes >> 4;
            const uint4* src = (const uint4*)(base + (u64)c0 * 110);
            uint4 v[7];
#pragma unroll
            for (int k = 0; k < 7; k++)
                if (lane + 32 * k < n16) v[k] = src[lane + 32 * k];
            __syncwarp();
#pragma unroll
            for (int k = 0; k < 7; k++)
                if (lane + 32 * k < n16) ((uint4*)wbuf)[lane + 32 * k] = v[k];
            if ((bytes & 15) && lane == 0) ((u64*)wbuf)[2 * n16] = ((const u64*)src)[2 * n16];
            __syncwarp();
            if (lane < nb) {
                const u16* h = (const u16*)(wbuf + 110 * lane);
                u32 bw[28];
#pragma unroll
                for (int k = 0; k < 27; k++) bw[k] = (u32)h[2 * k] | ((u32)h[2 * k + 1] << 16);
                bw[27] = h[54];
#define IQB(n) ((bw[(n) >> 2] >> (8 * ((n) & 3))) & 255u)
                const float d = f16_to_f32((u16)(bw[0] & 0xFFFFu));
                const int k = c0 + lane;
                const int o = k / spr, s = k - o * spr;
                const unsigned char* xb = xq + s * QX_STRIDE;
                const float* xsb = xs + s * QS_STRIDE;
                float p = 0.0f;
#pragma unroll
                for (int sb = 0; sb < 8; sb++) {
                    const u32 sc = (IQB(106 + (sb >> 1)) >> (4 * (sb & 1))) & 15u;
                    const u32 qh = IQB(66 + sb);
                    const uint4 xa = *(const uint4*)(xb + 32 * sb);
                    const uint4 xc = *(const uint4*)(xb + 32 * sb + 16);
                    const u32 xw[8] = {xa.x, xa.y, xa.z, xa.w, xc.x, xc.y, xc.z, xc.w};
                    int isum = 0;
#pragma unroll
                    for (int ii = 0; ii < 8; ii++) {
                        const int i = 8 * sb + ii;
                        const u32 idx = IQB(2 + i) | (((qh >> ii) & 1u) << 8);
                        const u32 g = grid[idx];
                        const u32 m = smask[(IQB(74 + (i >> 1)) >> (4 * (ii & 1))) & 15u];
                        isum = dp4a_s32((int)((g ^ m) + (m & 0x01010101u)), (int)xw[ii], isum);
                    }
                    p += (float)(1 + 2 * (int)sc) * (float)isum * xsb[sb];
                }
#undef IQB
#pragma unroll
                for (int oo = 0; oo < 8; oo++)
                    if (oo == o) acc[oo] += d * p;
            }
        }
#pragma unroll
        for (int oo = 0; oo < 8; oo++) {
            if (oo < nrows) {
                const float s = warp_sum(acc[oo]);
                if (lane == 0) y[row0 + oo] = s * mult;
            }
        }
    }
}

// ---------------------------------------------------------------------------------------------
// Fast-path decode matvec for NVFP4 records (QF_NVFP4R), one input row. x is quantized once per
// matvec by quantize_x_q8r into global memory (int8 per 32 values, two 16-byte planes so that a
// warp's 16-byte reads are consecutive; read through L1 by every warp), so the matvec blocks
// need no shared memory, no barrier and no prologue: they issue weight loads at once.
// Each lane takes 32 weights (one 16-byte load of codes, 2 scale bytes) of a record per row.
// E2M1 → int8 uses one table for magnitudes: a nibble with its sign bit set selects a byte in
// prmt's sign-replicate mode, which gives 0 for the (non-negative) table, so
//   w·x = dp4a(|w| where w ≥ 0, x) − dp4a(|w| where w < 0, x),
// the second from the codes with their sign bits flipped: 4 prmt, 2 shifts, 1 xor and 4 dp4a
// per 8 weights, no sign merge.

// x [in] → xq (plane A: values 32c..32c+15 at 16c; plane B at in/2 + 16c: 32c+16..32c+31),
// xs[c] = amax/127 of group c. One thread per group of 32; in % 32 == 0.
extern "C" __global__ void quantize_x_q8r(const float* x, int in, unsigned char* xq, float* xs) { KERNEL_START();
    const int c = blockIdx.x * blockDim.x + threadIdx.x;
    if (c >= (in >> 5)) return;
    float v[32];
    const float amax = load32_amax(x + 32 * (u64)c, v);
    const float inv = q8_inv_step(amax);
    u32 packed[8];
#pragma unroll
    for (int e = 0; e < 8; e++) {
        u32 word = 0;
#pragma unroll
        for (int j = 0; j < 4; j++) word |= ((u32)__float2int_rn(v[4 * e + j] * inv) & 255u) << (8 * j);
        packed[e] = word;
    }
    *(uint4*)(xq + 16 * (u64)c) = make_uint4(packed[0], packed[1], packed[2], packed[3]);
    *(uint4*)(xq + (in >> 1) + 16 * (u64)c) = make_uint4(packed[4], packed[5], packed[6], packed[7]);
    xs[c] = q8_step(amax);
}

// prmt.b32 in its generic mode: a selector nibble with bit 3 set yields the selected byte's
// sign replicated (written as asm so that no intrinsic masks the selector to 3 bits).
__device__ __forceinline__ u32 prmt_sx(u32 lo, u32 hi, u32 sel) {
#ifdef CAPY_EMULATED
    return __byte_perm(lo, hi, sel);  // the emulator models prmt's sign mode (emu.hpp)
#else
    u32 r;
    asm("prmt.b32 %0, %1, %2, %3;" : "=r"(r) : "r"(lo), "r"(hi), "r"(sel));
    return r;
#endif
}

// Two E4M3 scales (low byte first) as f32.
__device__ __forceinline__ float2 e4m3x2_to_f32(u32 two) {
#if __CUDA_ARCH__ >= 890
    u32 h2;
    asm("cvt.rn.f16x2.e4m3x2 %0, %1;" : "=r"(h2) : "h"((u16)two));
    return make_float2(f16_to_f32((u16)(h2 & 0xFFFFu)), f16_to_f32((u16)(h2 >> 16)));
#else
    return make_float2(__uint_as_float(QT_E4M3[two & 255u]), __uint_as_float(QT_E4M3[(two >> 8) & 255u]));
#endif
}

// 32 weights (codes: 4 words, nibble j of word i = weight 8i + j; scales: 2 E4M3) against 32
// int8 x values (xa: 0..15, xb: 16..31): Σ w·x / xs, in units of half an E2M1 step.
__device__ __forceinline__ float nvfp4r_chunk_dot(uint4 codes, u32 scales, uint4 xa, uint4 xb) {
    const u32 mag_lo = 0x03020100u, mag_hi = 0x0C080604u;  // twice {0, .5, 1, 1.5, 2, 3, 4, 6}
    const u32 q[4] = {codes.x, codes.y, codes.z, codes.w};
    const u32 xv[8] = {xa.x, xa.y, xa.z, xa.w, xb.x, xb.y, xb.z, xb.w};
    int pos[2] = {0, 0}, neg[2] = {0, 0};
#pragma unroll
    for (int i = 0; i < 4; i++) {
        const u32 n = q[i] ^ 0x88888888u;
        pos[i >> 1] = dp4a_s32((int)prmt_sx(mag_lo, mag_hi, q[i]), (int)xv[2 * i], pos[i >> 1]);
        pos[i >> 1] = dp4a_s32((int)prmt_sx(mag_lo, mag_hi, q[i] >> 16), (int)xv[2 * i + 1], pos[i >> 1]);
        neg[i >> 1] = dp4a_s32((int)prmt_sx(mag_lo, mag_hi, n), (int)xv[2 * i], neg[i >> 1]);
        neg[i >> 1] = dp4a_s32((int)prmt_sx(mag_lo, mag_hi, n >> 16), (int)xv[2 * i + 1], neg[i >> 1]);
    }
    const float2 s = e4m3x2_to_f32(scales);
    return (float)(pos[0] - neg[0]) * s.x + (float)(pos[1] - neg[1]) * s.y;
}

// Record r (1024 weights) of rows row0..row0+RPW-1 (clamped to the last row) against x, added
// into acc: each lane's 32 weights of every row, then x's 32 int8 values and their scale. The
// step both records kernels repeat.
template <int RPW>
__device__ __forceinline__ void nvfp4r_record(const unsigned char* w, const uint4* xa_plane, const uint4* xb_plane,
                                              const float* xs, int r, int lane, int row0, int out, u64 row_bytes,
                                              float (&acc)[RPW]) {
    const int c = 32 * r + lane;
    uint4 codes[RPW];
    u32 sc[RPW];
#pragma unroll
    for (int o = 0; o < RPW; o++) {
        const int row = min(row0 + o, out - 1);
        const unsigned char* rec = w + (u64)row * row_bytes + (u64)r * NVFP4R_RECORD;
        codes[o] = __ldg((const uint4*)(rec + 64) + lane);
        sc[o] = __ldg((const u16*)rec + lane);
    }
    const uint4 xa = __ldg(xa_plane + c), xb = __ldg(xb_plane + c);
    const float xscale = __ldg(xs + c);
#pragma unroll
    for (int o = 0; o < RPW; o++) acc[o] += nvfp4r_chunk_dot(codes[o], sc[o], xa, xb) * xscale;
}

// y[out] = mult · W[out, in] · x with W in NVFP4 records (in % 1024 == 0), x from
// quantize_x_q8r. Each warp takes RPW consecutive rows per pass, grid-stride over warps; any
// block of whole warps.
template <int RPW>
__device__ __forceinline__ void nvfp4r_q8_impl(const unsigned char* w, const unsigned char* xq, const float* xs,
                                               float* y, int in, int out, u64 row_bytes, float mult) {
    const int lane = threadIdx.x & 31;
    const int warps = gridDim.x * (blockDim.x >> 5);
    const int records = in >> 10;
    const uint4* xa_plane = (const uint4*)xq;
    const uint4* xb_plane = (const uint4*)(xq + (in >> 1));
    for (int row0 = (blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5)) * RPW; row0 < out; row0 += warps * RPW) {
        float acc[RPW];
#pragma unroll
        for (int o = 0; o < RPW; o++) acc[o] = 0.0f;
#pragma unroll 2
        for (int r = 0; r < records; r++) nvfp4r_record<RPW>(w, xa_plane, xb_plane, xs, r, lane, row0, out, row_bytes, acc);
#pragma unroll
        for (int o = 0; o < RPW; o++) {
            const float s = warp_sum(acc[o]);
            // 0.5: the int8 table holds twice the E2M1 values.
            if (lane == 0 && row0 + o < out) y[row0 + o] = s * mult * 0.5f;
        }
    }
}

#define NVFP4R_Q8(RPW)                                                                                  \
    extern "C" __global__ void quant_matvec_nvfp4r_q8_##RPW(const unsigned char* w, const unsigned char* xq, \
                                                            const float* xs, float* y, int in, int out,     \
                                                            u64 row_bytes, float mult) { KERNEL_START();                    \
        nvfp4r_q8_impl<RPW>(w, xq, xs, y, in, out, row_bytes, mult);                                        \
    }
NVFP4R_Q8(1)
NVFP4R_Q8(2)
NVFP4R_Q8(4)

// The records matvec with each row's records split over KS warps of the block (record r to
// warp r mod KS), for matrices with too few rows to fill the GPU a warp a row: the 27B's
// down and output projections have 5120 rows, 320 blocks of the kernel above, 2.4 an SM, and
// read at 0.6 of bandwidth against 0.85 for the 34816-row gate_up. Each warp's partial sums
// meet in shared memory and the first warp of each KS adds them in order (deterministic).
// Block 256 threads; grid ceil(out / (RPW · 8 / KS)); no grid-stride loop.
template <int RPW, int KS>
__device__ __forceinline__ void nvfp4r_q8_splitk_impl(const unsigned char* w, const unsigned char* xq, const float* xs,
                                                      float* y, int in, int out, u64 row_bytes, float mult) {
    __shared__ float part[8][RPW];
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int slice = warp % KS;
    const int row0 = (blockIdx.x * (8 / KS) + warp / KS) * RPW;
    const int records = in >> 10;
    const uint4* xa_plane = (const uint4*)xq;
    const uint4* xb_plane = (const uint4*)(xq + (in >> 1));
    float acc[RPW];
#pragma unroll
    for (int o = 0; o < RPW; o++) acc[o] = 0.0f;
#pragma unroll 2
    for (int r = slice; r < records; r += KS) nvfp4r_record<RPW>(w, xa_plane, xb_plane, xs, r, lane, row0, out, row_bytes, acc);
#pragma unroll
    for (int o = 0; o < RPW; o++) {
        const float s = warp_sum(acc[o]);
        if (lane == 0) part[warp][o] = s;
    }
    __syncthreads();
    if (slice == 0 && lane < RPW && row0 + lane < out) {
        float s = 0.0f;
#pragma unroll
        for (int j = 0; j < KS; j++) s += part[warp + j][lane];
        y[row0 + lane] = s * mult * 0.5f;
    }
}

#define NVFP4R_Q8_SPLITK(RPW, KS)                                                                           \
    extern "C" __global__ void quant_matvec_nvfp4r_q8k_##RPW##_##KS(const unsigned char* w, const unsigned char* xq, \
                                                                    const float* xs, float* y, int in, int out,  \
                                                                    u64 row_bytes, float mult) { KERNEL_START();                 \
        nvfp4r_q8_splitk_impl<RPW, KS>(w, xq, xs, y, in, out, row_bytes, mult);                                  \
    }
NVFP4R_Q8_SPLITK(2, 2)
NVFP4R_Q8_SPLITK(2, 4)
NVFP4R_Q8_SPLITK(2, 8)
NVFP4R_Q8_SPLITK(1, 2)
NVFP4R_Q8_SPLITK(1, 4)
NVFP4R_Q8_SPLITK(1, 8)

// ---------------------------------------------------------------------------------------------
// Fast-path decode matvec for IQ3_S records (QF_IQ3SR), one input row, x in quantize_x_q8r's
// int8 layout (written by x's producer, or by quantize_x_q8r): like the NVFP4 records kernels,
// no x prologue, every weight load issued at once. Each half-warp takes its own rows; lane i of
// a half decodes slot i of a record (64 weights: one 16-byte load of packed indices, 8 bytes of
// signs, 2 of index top bits, 1 of scales, 2 of d), so the two halves of a warp read x at the
// same addresses, and a row's slot is a run of consecutive loads for each plane.
// Per 4 weights (grid entry k of the slot): the entry's byte offset in the grid (a shift or a
// funnel shift, an and), the entry from the grid in shared memory, the sign mask (the signs of
// entry k sit at the byte tops of its word shifted left by k % 8, so one prmt in sign-replicate
// mode spreads them to bytes), the negation in one lop3 (every grid byte g is odd, and an odd
// g xor 0xFE is −g), one dp4a. The 2 KiB grid is copied into shared memory per block.

// The grid lookups at random indices meet in the banks (~3.5 wavefronts a warp lookup), but
// they do not bound these kernels: copies of the table side by side, so that each lane reads
// its own bank, made them slower on an H100 (8 copies 0.88x, 32 copies ~0.6x, with the grid
// capped at the resident blocks ~0.75x; bench/results/iq3s-records-grid-copies-microbench-
// h100box.json; the kernels of that run are in git at 03b28da). Probably the larger
// shared-memory carve-out leaves too little L1 for the x and record loads (not measured).

// Half-warps per block (256 threads).
#define IQ3SR_HALF_WARPS 16

// Byte offset of grid entry k (0..15) of a slot in a u32 table: its 9-bit index times 4, from
// the slot's packed indices q (words 0..3: bits 0..127, word 4: bits 128..143).
__device__ __forceinline__ u32 iq3sr_grid_offset(const u32 (&q)[5], int k) {
    const int bit = 9 * k, word = bit >> 5, at = bit & 31;
    u32 v;
    if (at < 2) v = q[word] << (2 - at);
    else if (at <= 23) v = q[word] >> (at - 2);
    else v = __funnelshift_r(q[word], q[word + 1], at - 2);
    return v & 0x7FCu;
}

// One slot of one row against its 64 int8 x values (xv: the slot's two groups of 32, each as
// plane A then plane B) and their two scales: Σ w·x, w = d · (2s + 1) · signed grid value.
__device__ __forceinline__ float iq3sr_slot_dot(const u32* grid, uint4 idx, u32 high, uint2 signs, u32 scales, float d,
                                                const uint4 (&xv)[4], float2 xs) {
    const u32 q[5] = {idx.x, idx.y, idx.z, idx.w, high};
    int isum[2] = {0, 0};
#pragma unroll
    for (int k = 0; k < 16; k++) {
        const u32 g = *(const u32*)((const unsigned char*)grid + iq3sr_grid_offset(q, k));
        const u32 mask = prmt_sx((k < 8 ? signs.x : signs.y) << (k & 7), 0u, 0xBA98u);
        const uint4 x4 = xv[k >> 2];
        const u32 x = (k & 3) == 0 ? x4.x : (k & 3) == 1 ? x4.y : (k & 3) == 2 ? x4.z : x4.w;
        isum[k >> 3] = dp4a_s32((int)(g ^ (mask & 0xFEFEFEFEu)), (int)x, isum[k >> 3]);
    }
    const int s0 = (int)((scales << 1) & 30u) + 1, s1 = (int)((scales >> 3) & 30u) + 1;
    return d * ((float)(isum[0] * s0) * xs.x + (float)(isum[1] * s1) * xs.y);
}

// Record r of rows row0..row0+HRPW-1 (clamped to the last row) against x, added into acc: the
// lane's slot of every row, then x's 64 int8 values of those columns and their two scales.
template <int HRPW>
__device__ __forceinline__ void iq3sr_record(const u32* grid, const unsigned char* w, const uint4* xa_plane,
                                             const uint4* xb_plane, const float* xs, int r, int slot, int row0, int out,
                                             u64 row_bytes, float (&acc)[HRPW]) {
    uint4 idx[HRPW];
    uint2 signs[HRPW];
    u32 high[HRPW], scales[HRPW];
    u16 dbits[HRPW];
#pragma unroll
    for (int o = 0; o < HRPW; o++) {
        const int row = min(row0 + o, out - 1);
        const unsigned char* rec = w + (u64)row * row_bytes + (u64)r * IQ3SR_RECORD;
        const unsigned char* body = iq3sr_body(rec);
        idx[o] = __ldg((const uint4*)body + slot);
        signs[o] = __ldg((const uint2*)(body + IQ3SR_SIGNS) + slot);
        high[o] = __ldg((const u16*)(body + IQ3SR_HIGH) + slot);
        scales[o] = __ldg(body + IQ3SR_SCALES + slot);
        dbits[o] = __ldg((const u16*)iq3sr_d(rec) + (slot >> 2));
    }
    const int c = 32 * r + 2 * slot;  // the slot's two groups of 32 in x
    const uint4 xv[4] = {__ldg(xa_plane + c), __ldg(xb_plane + c), __ldg(xa_plane + c + 1), __ldg(xb_plane + c + 1)};
    const float2 xscale = __ldg((const float2*)xs + (c >> 1));
#pragma unroll
    for (int o = 0; o < HRPW; o++)
        acc[o] += iq3sr_slot_dot(grid, idx[o], high[o], signs[o], scales[o], f16_to_f32(dbits[o]), xv, xscale);
}

// y[out] = mult · W[out, in] · x with W in IQ3_S records (in % 1024 == 0), x from
// quantize_x_q8r. Each half-warp takes HRPW consecutive rows; KS == 1: block 256 threads, grid
// ceil(out / (16 · HRPW)). KS > 1 (few rows): each row's records are split over KS half-warps
// (record r to the half-warp r mod KS) whose partial sums meet in shared memory and are added in
// a fixed order (deterministic); grid ceil(out / (HRPW · 16 / KS)). UNROLL records a step of the
// record loop: 2 keeps more loads in flight, which pays where the grid is a single wave
// (tools/cuda_microbench/iq3s_records_bench.cu).
template <int HRPW, int KS, int UNROLL = 1>
__device__ __forceinline__ void iq3sr_q8_impl(const unsigned char* w, const unsigned char* xq, const float* xs,
                                              float* y, int in, int out, u64 row_bytes, float mult) {
    __shared__ u32 grid[512];
    for (int i = threadIdx.x; i < 512; i += blockDim.x) grid[i] = QT_IQ3S[i];
    __syncthreads();
    const int slot = threadIdx.x & 15, half_warp = threadIdx.x >> 4;
    const int slice = half_warp % KS;
    const int row0 = (blockIdx.x * (IQ3SR_HALF_WARPS / KS) + half_warp / KS) * HRPW;
    const int records = in >> 10;
    const uint4* xa_plane = (const uint4*)xq;
    const uint4* xb_plane = (const uint4*)(xq + (in >> 1));
    float acc[HRPW];
#pragma unroll
    for (int o = 0; o < HRPW; o++) acc[o] = 0.0f;
#pragma unroll UNROLL
    for (int r = slice; r < records; r += KS)
        iq3sr_record<HRPW>(grid, w, xa_plane, xb_plane, xs, r, slot, row0, out, row_bytes, acc);
    // Sum over the half-warp (both halves shuffle together: offsets below 16 stay in a half).
#pragma unroll
    for (int o = 0; o < HRPW; o++)
#pragma unroll
        for (int off = 8; off > 0; off >>= 1) acc[o] += __shfl_xor_sync(0xffffffffu, acc[o], off);
    if constexpr (KS == 1) {
        if (slot < HRPW && row0 + slot < out) {
            float s = acc[0];
#pragma unroll
            for (int o = 1; o < HRPW; o++)
                if (slot == o) s = acc[o];
            y[row0 + slot] = s * mult;
        }
    } else {
        __shared__ float part[IQ3SR_HALF_WARPS][HRPW];
        if (slot == 0) {
#pragma unroll
            for (int o = 0; o < HRPW; o++) part[half_warp][o] = acc[o];
        }
        __syncthreads();
        if (slice == 0 && slot < HRPW && row0 + slot < out) {
            float s = 0.0f;
#pragma unroll
            for (int j = 0; j < KS; j++) s += part[half_warp + j][slot];
            y[row0 + slot] = s * mult;
        }
    }
}

#define IQ3SR_Q8(HRPW)                                                                                  \
    extern "C" __global__ void quant_matvec_iq3sr_q8_##HRPW(const unsigned char* w, const unsigned char* xq, \
                                                            const float* xs, float* y, int in, int out,     \
                                                            u64 row_bytes, float mult) { KERNEL_START();     \
        iq3sr_q8_impl<HRPW, 1>(w, xq, xs, y, in, out, row_bytes, mult);                                     \
    }
IQ3SR_Q8(1)
IQ3SR_Q8(2)

extern "C" __global__ void quant_matvec_iq3sr_q8_2_unroll2(const unsigned char* w, const unsigned char* xq,
                                                          const float* xs, float* y, int in, int out, u64 row_bytes,
                                                          float mult) { KERNEL_START();
    iq3sr_q8_impl<2, 1, 2>(w, xq, xs, y, in, out, row_bytes, mult);
}

#define IQ3SR_Q8_SPLITK(HRPW, KS)                                                                             \
    extern "C" __global__ void quant_matvec_iq3sr_q8k_##HRPW##_##KS(const unsigned char* w, const unsigned char* xq, \
                                                                    const float* xs, float* y, int in, int out,  \
                                                                    u64 row_bytes, float mult) { KERNEL_START();  \
        iq3sr_q8_impl<HRPW, KS>(w, xq, xs, y, in, out, row_bytes, mult);                                          \
    }
IQ3SR_Q8_SPLITK(2, 4)
IQ3SR_Q8_SPLITK(1, 2)
IQ3SR_Q8_SPLITK(2, 8)
IQ3SR_Q8_SPLITK(1, 4)
IQ3SR_Q8_SPLITK(1, 8)
