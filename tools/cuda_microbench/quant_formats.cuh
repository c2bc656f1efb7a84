// What the engine prepends to kernels/quant_matvec.cu (backend/cuda/kernels.rs `quant_tables`),
// for the microbenchmarks built with nvcc: the block-format codes, equal to
// backend/cuda/mod.rs QUANT_FORMAT_CODES (a test there reads this file), and the tables as
// writable __device__ arrays the bench fills (cudaMemcpyToSymbol) where it needs values.
#pragma once
#define QF_Q8_0 1
#define QF_NVFP4 2
#define QF_IQ3_S 3
#define QF_IQ3_XXS 4
#define QF_IQ2_XS 5
#define QF_Q2_0 6
#define QF_FP8 7
#define QF_NVFP4R 8
#define QF_IQ3SR 9
__device__ u32 QT_E4M3[256];
__device__ u32 QT_E2M1[16];
__device__ u32 QT_IQ3S[512];
__device__ u32 QT_IQ3XXS[256];
__device__ u64 QT_IQ2XS[512];
__device__ unsigned char QT_KSIGNS[128];
