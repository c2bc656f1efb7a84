// Prefill's routed experts on the device, quantized weights read in their block format, with no
// host round trip (flash_next.rs `moe_prefill_on_device`, the fast path). Compiled after
// quant_matvec.cu (`qdecode8`) and moe_quant.cu (`MOE_Q_DISPATCH`).
//
// Why: the host path downloads each layer's routing, groups it, dequantizes every hit expert
// to BF16 in a scratch and runs grouped cuBLAS GEMMs over it. At Flash-Next's shape (8K tokens,
// top 10 of 512) the GPU then idled while the host grouped and uploaded each layer's tables
// (about half of a prefill's time on an H100), and the widened experts (~5 GB a layer) were
// written and read back. Here, as vLLM's fused MoE does:
//   moe_prefill_align   sorts the (row, pick) entries by expert into blocks of MP_BM, padded
//                       (the padding slots hold MP_EMPTY), and writes the combine's tables;
//   moe_prefill_gate_up one block of MP_BM entries × 64 intermediate columns a CTA: the
//                       expert's gate and up rows decoded into shared memory as BF16 a k-step
//                       at a time, the entries' x rows (BF16) beside them, tensor-core products
//                       (mma m16n8k16) and silu(gate)·up written as BF16;
//   moe_prefill_down    the same for down, [MP_BM entries, inter] → ys [entry, hidden] (f32);
// then moe.cu's moe_combine sums each row's entries in ascending expert order, as the host
// path does. Grids are sized for the most blocks the routing can make; the CTAs of blocks past
// the routing's count find MP_EMPTY and return.
//
// Arithmetic: the weights and x rounded to BF16, f32 sums, the expert's multiplier applied to
// the sums (the host path multiplies each weight before rounding it); the exact path
// (CAPY_EXACT_MATH=1) keeps the host path's f32 GEMMs.

#define MP_BM 128
#define MP_BK 64
#define MP_WARPS 8
// Weight rows a CTA takes. The warps tile the CTA's MP_ROWS × MP_BM products 4 × 2: warp w
// takes two m16 tiles (32 rows; gate_up: 16 columns' gate and up rows) of quarter w % 4,
// against the 8 n8 tiles (64 entries) of half w / 4. A 128-entry block decodes each weight
// once for twice the products of a 64-entry one; the n8 tiles past a block's last entry are
// skipped, so a partly filled block costs its entries only.
#define MP_ROWS 128
// Shared-memory row stride in u32 (MP_BK BF16 = 32 words, + 4 so that the fragment loads of
// a warp's 8 groups × 4 lanes fall in 32 different banks).
#define MP_STRIDE 36
#define MP_EMPTY 0xffffffffu
// The most picks per row the align kernel sorts for the combine.
#define MP_MAX_K 16

// ids [n, k] (moe_route's picks) → sorted [blocks · MP_BM]: entry indices (row · k + pick)
// grouped by expert, each expert's run starting on a block boundary and padded with MP_EMPTY;
// block_expert [max_blocks]: each block's expert (MP_EMPTY past the last block);
// combine_slots/combine_weights [n, k]: each row's entries and weights in ascending expert
// order (moe_combine's tables, with ys indexed by entry). One CTA; shared memory: 3 u32 an expert.
extern "C" __global__ void moe_prefill_align(const u32* ids, const float* weights, int n, int k, int experts,
                                             int max_blocks, u32* sorted, u32* block_expert, u32* combine_slots,
                                             float* combine_weights) { KERNEL_START();
    extern __shared__ u32 mp_align_smem[];
    u32* count = mp_align_smem;
    u32* first_block = count + experts;
    u32* cursor = first_block + experts;
    const int tid = threadIdx.x, threads = blockDim.x;
    const int entries = n * k;
    for (int e = tid; e < experts; e += threads) count[e] = 0;
    __syncthreads();
    for (int i = tid; i < entries; i += threads) atomicAdd(&count[ids[i]], 1u);
    __syncthreads();
    if (tid == 0) {
        u32 blocks = 0;
        for (int e = 0; e < experts; e++) {
            first_block[e] = blocks;
            blocks += (count[e] + MP_BM - 1) / MP_BM;
        }
        cursor[0] = blocks;  // read below, before the cursors are set
    }
    __syncthreads();
    const int used = (int)cursor[0];
    __syncthreads();
    for (int e = tid; e < experts; e += threads) {
        const u32 b0 = first_block[e], nb = (count[e] + MP_BM - 1) / MP_BM;
        for (u32 b = 0; b < nb; b++) block_expert[b0 + b] = (u32)e;
        cursor[e] = b0 * MP_BM;
    }
    for (int b = used + tid; b < max_blocks; b += threads) block_expert[b] = MP_EMPTY;
    for (int p = tid; p < used * MP_BM; p += threads) sorted[p] = MP_EMPTY;
    __syncthreads();
    // Within an expert the entries land in any order: each is computed on its own.
    for (int i = tid; i < entries; i += threads) sorted[atomicAdd(&cursor[ids[i]], 1u)] = (u32)i;
    for (int r = tid; r < n; r += threads) {
        u32 order[MP_MAX_K];
        for (int j = 0; j < k; j++) {
            int at = j;
            while (at > 0 && ids[r * k + order[at - 1]] > ids[r * k + j]) {
                order[at] = order[at - 1];
                at--;
            }
            order[at] = (u32)j;
        }
        for (int j = 0; j < k; j++) {
            combine_slots[r * k + j] = (u32)(r * k) + order[j];
            combine_weights[r * k + j] = weights[r * k + order[j]];
        }
    }
}

// The CTA's shared memory: weights [MP_ROWS][MP_STRIDE], inputs [xbufs][MP_BM][MP_STRIDE],
// the block's entries [MP_BM]. With two input buffers (xbufs, a kernel argument) the next
// k-step's inputs are in flight while this one's are multiplied: 55.8 KB a CTA, two CTAs on
// an SM of 228 KB (sm_90). An SM of ~100 KB (sm_86, sm_89, sm_120: the consumer cards) holds
// two CTAs of one buffer (37.4 KB) and only one of two; there the other CTA hides the wait.
#define MP_ENTRIES_AT(XBUFS) ((MP_ROWS + (XBUFS) * MP_BM) * MP_STRIDE)
#define MP_SMEM_BYTES(XBUFS) (MP_ENTRIES_AT(XBUFS) * 4 + MP_BM * 4)

// Weight groups of 8 a thread stages a k-step: a row's MP_BK / 8 groups shared by the
// threads t, t + MP_ROWS (MP_ROWS divides the CTA's threads): 32 weights, a unit of the
// block formats' scales.
#define MP_STAGE_GROUPS (MP_ROWS * (MP_BK / 8) / (MP_WARPS * 32))

// The formats whose blocks hold whole 32-weight units (IQ3_S: 8 units a block, with one scale
// nibble, qh byte and 4 sign bytes each; Q2_0: 2 units a block): their unit's bytes are loaded
// a k-step ahead (mp_load_unit) and decoded from registers (mp_decode_unit).
#define MP_UNIT_FORMAT(FMT) ((FMT) == QF_IQ3_S || (FMT) == QF_Q2_0)

// The bytes of one unit: IQ3_S w[0] = d | scale nibble << 16 | qh << 24, w[1..2] the 8 index
// bytes, w[3] the 4 sign bytes; Q2_0 w[0] = d, w[1..2] the 8 code bytes. All zeros past the
// matrix (decoded as zeros: d = 0).
struct MpUnit {
    u32 w[4];
};

// Unit `u` (weights 32u … 32u + 31) of a row, or zeros where !in. Blocks start at even
// offsets (110 and 18 bytes), so every field is read as whole u16s.
template <int FMT>
__device__ __forceinline__ MpUnit mp_load_unit(const unsigned char* row, int u, bool in) {
    MpUnit r = {{0, 0, 0, 0}};
    if (!in) return r;
    if (FMT == QF_IQ3_S) {
        const unsigned char* b = row + (u >> 3) * 110;
        const int s8 = u & 7;
        const u16* qs = (const u16*)(b + 2 + 8 * s8);
        const u16* sg = (const u16*)(b + 74 + 4 * s8);
        r.w[0] = *(const u16*)b | (((u32)(b[106 + (s8 >> 1)] >> (4 * (s8 & 1))) & 15) << 16) | ((u32)b[66 + s8] << 24);
        r.w[1] = qs[0] | ((u32)qs[1] << 16);
        r.w[2] = qs[2] | ((u32)qs[3] << 16);
        r.w[3] = sg[0] | ((u32)sg[1] << 16);
    } else {  // QF_Q2_0
        const unsigned char* b = row + (u >> 1) * 18;
        const u16* q = (const u16*)(b + 2 + 8 * (u & 1));
        r.w[0] = *(const u16*)b;
        r.w[1] = q[0] | ((u32)q[1] << 16);
        r.w[2] = q[2] | ((u32)q[3] << 16);
    }
    return r;
}

// A loaded unit's 32 weights as 16 BF16 pairs. Each value equals qdecode8's rounded to BF16:
// the same products, formed without the per-group address arithmetic, reloaded scales or I2F
// (moe_quant_decode.cu's `byte_times`).
template <int FMT>
__device__ __forceinline__ void mp_decode_unit(const MpUnit& r, u32* out) {
    const float d = f16_to_f32((u16)(r.w[0] & 0xffff));
    if (FMT == QF_IQ3_S) {
        const float db = d * (float)(1 + 2 * ((r.w[0] >> 16) & 15));
        const float db_lo = -8388608.0f * db;
        const u32 qh = r.w[0] >> 24;
#pragma unroll
        for (int q = 0; q < 4; q++) {
            const u32 signs = (r.w[3] >> (8 * q)) & 255;
#pragma unroll
            for (int h = 0; h < 2; h++) {
                const int i = 2 * q + h;
                const u32 grid = QT_IQ3S[((r.w[1 + (i >> 2)] >> (8 * (i & 3))) & 255) | (((qh >> i) & 1) << 8)];
                float v[4];
#pragma unroll
                for (int j = 0; j < 4; j++) v[j] = signed_value(byte_times(grid, j, db, db_lo), signs, 4 * h + j);
                out[4 * q + 2 * h] = bf16x2(v[0], v[1]);
                out[4 * q + 2 * h + 1] = bf16x2(v[2], v[3]);
            }
        }
    } else {  // QF_Q2_0: (code - 1) · d, code 2 bits
#pragma unroll
        for (int i = 0; i < 8; i++) {
            const u32 codes = (r.w[1 + (i >> 2)] >> (8 * (i & 3))) & 255;
            float v[4];
            // code - 1 as a float without I2F (the code under 2^23's exponent, less 2^23 + 1:
            // exact), times d as qdecode8 multiplies (so a zero keeps d's sign too).
#pragma unroll
            for (int j = 0; j < 4; j++)
                v[j] = (__uint_as_float(0x4B000000u | ((codes >> (2 * j)) & 3u)) - 8388609.0f) * d;
            out[2 * i] = bf16x2(v[0], v[1]);
            out[2 * i + 1] = bf16x2(v[2], v[3]);
        }
    }
}

// This thread's staged words of a k-step (16 BF16 pairs) into its shared row.
__device__ __forceinline__ void mp_store_unit(u32* ws, const u32* packed) {
    const int g0 = (threadIdx.x / MP_ROWS) * MP_STAGE_GROUPS;
    u32* dst = ws + (threadIdx.x % MP_ROWS) * MP_STRIDE + 4 * g0;
#pragma unroll
    for (int g = 0; g < MP_STAGE_GROUPS; g++)
        *(uint4*)(dst + 4 * g) = make_uint4(packed[4 * g], packed[4 * g + 1], packed[4 * g + 2], packed[4 * g + 3]);
}

// The first column of this thread's unit in the k-step at k0. A row a thread (not a row's
// groups spread over a warp): the row's pointer is the only address the staging keeps across
// k-steps, and a unit's scales are read once. Spread, the compiler kept 8 row pointers live
// beside the 64 accumulators and the kernels spilled at their 128-register bound.
__device__ __forceinline__ int mp_unit_col(int k0) {
    static_assert(MP_STAGE_GROUPS == 4, "a thread stages one 32-weight unit");
    return k0 + 8 * (threadIdx.x / MP_ROWS) * MP_STAGE_GROUPS;
}

// The other formats' k-step at k0 of this thread's staging row (`row`: null past the matrix),
// decoded a group of 8 at a time from global memory into BF16 pairs; columns at or past `cols`
// are zeros. The groups are decoded into registers before any is stored, so their global
// loads are all in flight at once.
template <int FMT>
__device__ __forceinline__ void mp_decode_groups(int k0, int cols, const unsigned char* row, u32* packed) {
    const int col0 = mp_unit_col(k0);
#pragma unroll
    for (int g = 0; g < MP_STAGE_GROUPS; g++) {
        const int col = col0 + 8 * g;
        float f[8] = {0, 0, 0, 0, 0, 0, 0, 0};
        if (row && col < cols) qdecode8<FMT>(row, col >> 3, f);
#pragma unroll
        for (int j = 0; j < 4; j++) packed[4 * g + j] = bf16x2(f[2 * j], f[2 * j + 1]);
    }
}

// The inputs of the block's entries, k0 … k0 + MP_BK - 1 of each (BF16 rows of `cols`: row
// `src_row(r, entry)` for the block's r-th entry), copied into shared memory asynchronously
// (cp.async, one commit group); padding entries and columns past `cols` are zeros.
template <typename SrcRow>
__device__ __forceinline__ void mp_stage_inputs(const u16* src, int cols, int k0, const u32* entries, u32* xs,
                                                SrcRow src_row) {
    constexpr int units = MP_BM * (MP_BK / 8) / (MP_WARPS * 32);
    const int part = threadIdx.x % (MP_BK / 8), r0 = threadIdx.x / (MP_BK / 8);
    const int col = k0 + 8 * part;
#pragma unroll
    for (int i = 0; i < units; i++) {
        const int r = r0 + i * (MP_WARPS * 32 / (MP_BK / 8));
        const u32 entry = entries[r];
        const bool in = entry != MP_EMPTY && col < cols;
        cp_async16(xs + r * MP_STRIDE + 4 * part, in ? src + (u64)src_row(r, entry) * cols + col : src, in);
    }
    cp_async_commit();
}

// One k-step of a warp's products: its two m16 tiles (shared weight rows m0, m1) against its
// 8 n8 tiles of entries (shared input rows from xs), those past its first `entries` skipped.
__device__ __forceinline__ void mp_mma_step(const u32* ws, const u32* xs, int m0, int m1, int entries,
                                            float (*acc)[8][4]) {
    const int lane = threadIdx.x & 31, group = lane >> 2, t = lane & 3;
    // One k16 step's fragments at a time: unrolled, the compiler loads all four steps' ahead
    // and NVRTC 13.0 then spills at the 128-register bound (2.7 KB a thread).
#pragma unroll 1
    for (int kk = 0; kk < MP_BK / 16; kk++) {
        const int c = kk * 8 + t;
        u32 a[2][4];
#pragma unroll
        for (int m = 0; m < 2; m++) {
            const u32* w = ws + (m ? m1 : m0) * MP_STRIDE;
            a[m][0] = w[group * MP_STRIDE + c];
            a[m][1] = w[(group + 8) * MP_STRIDE + c];
            a[m][2] = w[group * MP_STRIDE + c + 4];
            a[m][3] = w[(group + 8) * MP_STRIDE + c + 4];
        }
#pragma unroll
        for (int nt = 0; nt < 8; nt++) {
            if (nt * 8 >= entries) break;  // the same for the whole warp
            const u32* x = xs + (nt * 8 + group) * MP_STRIDE;
            const u32 b[2] = {x[c], x[c + 4]};
            mma_bf16_16x8x16(acc[0][nt], a[0], b);
            mma_bf16_16x8x16(acc[1][nt], a[1], b);
        }
    }
}

// The CTA's block of sorted entries (blockIdx.y) into shared memory, and how many it holds
// (`valid`: the align kernel fills a block from its start, so they are entries 0 … valid - 1).
// Returns the block's expert, or MP_EMPTY for a block past the routing's last (the CTA then
// returns; every thread sees the same).
__device__ __forceinline__ u32 mp_block_entries(const u32* block_expert, const u32* sorted, u32* entries, int* valid) {
    const u32 e = block_expert[blockIdx.y];
    if (e == MP_EMPTY) return e;
    u32 entry = MP_EMPTY;
    if (threadIdx.x < MP_BM) entries[threadIdx.x] = entry = sorted[(u64)blockIdx.y * MP_BM + threadIdx.x];
    *valid = __syncthreads_count(entry != MP_EMPTY);  // also the barrier before entries is read
    return e;
}

// The CTA's products over `cols` columns, a k-step at a time: its MP_ROWS weight rows (this
// thread's staging row is `row`) decoded into shared memory beside its entries' inputs
// (`src_row` of src), then each warp's two m16 tiles (shared rows m0, m1) against its 8 n8
// tiles of entries (shared input rows n0 …), into acc. Pipelined a k-step deep: for the unit
// formats the next step's weight bytes (registers) are in flight while this step's products
// run, and with two input buffers (`xbufs`) its inputs too (cp.async); with one they are
// fetched once the products are done, in flight while the decoded weights are stored.
template <int FMT, typename SrcRow>
__device__ __forceinline__ void mp_tile_products(int cols, const unsigned char* row, const u16* src, SrcRow src_row,
                                                 int m0, int m1, int n0, int valid, int xbufs, u32* smem,
                                                 float (*acc)[8][4]) {
    u32* ws = smem;
    u32* xs = ws + MP_ROWS * MP_STRIDE;
    const u32* entries = smem + MP_ENTRIES_AT(xbufs);
    const bool ahead = xbufs == 2;
#pragma unroll
    for (int m = 0; m < 2; m++)
#pragma unroll
        for (int nt = 0; nt < 8; nt++)
#pragma unroll
            for (int i = 0; i < 4; i++) acc[m][nt][i] = 0.0f;
    mp_stage_inputs(src, cols, 0, entries, xs, src_row);
    MpUnit unit;
    if (MP_UNIT_FORMAT(FMT)) unit = mp_load_unit<FMT>(row, mp_unit_col(0) >> 5, row && mp_unit_col(0) < cols);
    for (int k0 = 0, step = 0; k0 < cols; k0 += MP_BK, step ^= (int)ahead) {
        u32 packed[4 * MP_STAGE_GROUPS];
        if (MP_UNIT_FORMAT(FMT)) mp_decode_unit<FMT>(unit, packed);
        else mp_decode_groups<FMT>(k0, cols, row, packed);
        if (k0 > 0) {
            __syncthreads();  // the previous step's products are done with ws and its xs
            if (!ahead) mp_stage_inputs(src, cols, k0, entries, xs, src_row);
        }
        mp_store_unit(ws, packed);
        const int next = k0 + MP_BK;
        if (next < cols) {
            if (ahead) mp_stage_inputs(src, cols, next, entries, xs + (step ^ 1) * MP_BM * MP_STRIDE, src_row);
            if (MP_UNIT_FORMAT(FMT)) unit = mp_load_unit<FMT>(row, mp_unit_col(next) >> 5, row && mp_unit_col(next) < cols);
        }
        // This step's inputs are in; with two buffers the next step's may be in flight.
        if (ahead && next < cols) cp_async_wait<1>();
        else cp_async_wait<0>();
        __syncthreads();
        mp_mma_step(ws, xs + (step * MP_BM + n0) * MP_STRIDE, m0, m1, valid - n0, acc);
    }
}

// grid (ceil(inter / (MP_ROWS / 2)), max_blocks), MP_WARPS warps (exactly: the staging and
// the warp tiling assume it), MP_SMEM_BYTES(xbufs) of dynamic shared memory.
// xb [n, hidden] BF16 (x rounded); act [max_blocks · MP_BM, inter] BF16, rows by sorted position.
// table [experts, stride] u64: gate_up pointer, down pointer, …, gate_up multiplier at 4.
template <int FMT>
__device__ __forceinline__ void moe_prefill_gate_up_impl(const u64* table, int stride, const u32* block_expert,
                                                         const u32* sorted, int k, const u16* xb, u16* act,
                                                         int hidden, int inter, u64 row_bytes, int interleaved,
                                                         int xbufs) {
    extern __shared__ u32 mp_smem[];
    u32* entries = mp_smem + MP_ENTRIES_AT(xbufs);
    int valid;
    const u32 e = mp_block_entries(block_expert, sorted, entries, &valid);
    if (e == MP_EMPTY) return;
    const u64* ex = table + (u64)e * stride;
    const unsigned char* w = (const unsigned char*)ex[0];
    const float mult = __uint_as_float((u32)ex[4]);
    const int c0 = blockIdx.x * (MP_ROWS / 2), quarter = (threadIdx.x >> 5) & 3,
              n0 = (MP_BM / 2) * (threadIdx.x / 128);
    float acc[2][8][4];
    // Shared rows 0 … 63: the gate rows of columns c0 …; 64 … 127 their up rows.
    const int srow = threadIdx.x % MP_ROWS;
    const int staged = c0 + srow % (MP_ROWS / 2), up = srow / (MP_ROWS / 2);
    const u64 wr = interleaved ? 2 * (u64)staged + up : (u64)up * inter + staged;
    mp_tile_products<FMT>(hidden, staged < inter ? w + wr * row_bytes : nullptr, xb,
                          [k](int, u32 entry) { return entry / (u32)k; }, 16 * quarter, MP_ROWS / 2 + 16 * quarter,
                          n0, valid, xbufs, mp_smem, acc);
    const u64 pos0 = (u64)blockIdx.y * MP_BM;
    const int lane = threadIdx.x & 31, group = lane >> 2, t = lane & 3;
#pragma unroll
    for (int nt = 0; nt < 8; nt++)
#pragma unroll
        for (int i = 0; i < 4; i++) {
            const int c = c0 + 16 * quarter + group + 8 * (i >> 1), col = n0 + nt * 8 + 2 * t + (i & 1);
            if (c < inter && col < valid) {
                const float g = acc[0][nt][i] * mult, u = acc[1][nt][i] * mult;
                act[(pos0 + col) * inter + c] = f32_to_bf16(silu_f(g) * u);
            }
        }
}

// grid (ceil(hidden / MP_ROWS), max_blocks), as moe_prefill_gate_up. act as it wrote it; ys
// [n · k, hidden] f32 by entry; the down multiplier at table column 5.
template <int FMT>
__device__ __forceinline__ void moe_prefill_down_impl(const u64* table, int stride, const u32* block_expert,
                                                      const u32* sorted, const u16* act, float* ys, int hidden,
                                                      int inter, u64 row_bytes, int xbufs) {
    extern __shared__ u32 mp_smem[];
    u32* entries = mp_smem + MP_ENTRIES_AT(xbufs);
    int valid;
    const u32 e = mp_block_entries(block_expert, sorted, entries, &valid);
    if (e == MP_EMPTY) return;
    const u64* ex = table + (u64)e * stride;
    const unsigned char* w = (const unsigned char*)ex[1];
    const float mult = __uint_as_float((u32)ex[5]);
    const int o0 = blockIdx.x * MP_ROWS, quarter = (threadIdx.x >> 5) & 3,
              n0 = (MP_BM / 2) * (threadIdx.x / 128);
    float acc[2][8][4];
    // The block's act rows are its own positions (padding rows, never written, are not read).
    const int staged = o0 + threadIdx.x % MP_ROWS;
    mp_tile_products<FMT>(inter, staged < hidden ? w + (u64)staged * row_bytes : nullptr,
                          act + (u64)blockIdx.y * MP_BM * inter, [](int r, u32) { return (u32)r; }, 32 * quarter,
                          32 * quarter + 16, n0, valid, xbufs, mp_smem, acc);
    const int lane = threadIdx.x & 31, group = lane >> 2, t = lane & 3;
    // Entry by entry (one entries[] value live at a time beside the accumulators).
#pragma unroll
    for (int nt = 0; nt < 8; nt++)
#pragma unroll
        for (int j = 0; j < 2; j++) {
            const int col = n0 + nt * 8 + 2 * t + j;
            if (col >= valid) continue;
            float* y = ys + (u64)entries[col] * hidden;
#pragma unroll
            for (int m = 0; m < 2; m++)
#pragma unroll
                for (int h = 0; h < 2; h++) {
                    const int o = o0 + 32 * quarter + 16 * m + group + 8 * h;
                    if (o < hidden) y[o] = acc[m][nt][2 * h + j] * mult;
                }
        }
}

// Two CTAs an SM (at most 128 registers a thread): one stages while the other multiplies.
extern "C" __global__ void __launch_bounds__(MP_WARPS * 32, 2)
    moe_prefill_gate_up(const u64* table, int stride, const u32* block_expert, const u32* sorted, int k,
                        const u16* xb, u16* act, int fmt, int hidden, int inter, u64 row_bytes,
                        int interleaved, int xbufs) { KERNEL_START();
#define MP_GU(F)                                                                                              \
    moe_prefill_gate_up_impl<F>(table, stride, block_expert, sorted, k, xb, act, hidden, inter, row_bytes, interleaved, \
                                xbufs)
    MOE_Q_DISPATCH(MP_GU)
#undef MP_GU
}

extern "C" __global__ void __launch_bounds__(MP_WARPS * 32, 2)
    moe_prefill_down(const u64* table, int stride, const u32* block_expert, const u32* sorted, const u16* act,
                     float* ys, int fmt, int hidden, int inter, u64 row_bytes, int xbufs) { KERNEL_START();
#define MP_D(F) moe_prefill_down_impl<F>(table, stride, block_expert, sorted, act, ys, hidden, inter, row_bytes, xbufs)
    MOE_Q_DISPATCH(MP_D)
#undef MP_D
}
