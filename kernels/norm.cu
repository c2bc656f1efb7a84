// RMSNorm over consecutive groups of `group` values (one block per group), optionally scaled by
// (1 + w) and gated by silu(gate) (the GDN output norm); add_rms_norm first adds the residual
// branch into x in place (each block owns its group, so the sum it norms is its own).
//
// A decode step norms one 5120-value row per call, so a call is one block: its time is the
// latency of its loads, not bandwidth. Each thread therefore loads its (up to) NORM_VALS values
// at once into registers and keeps them for the second pass; the launcher gives a block
// ceil(group / NORM_VALS) threads (up to 1024). Larger groups take the looping path.

#define NORM_VALS 8

// Every load of the register path is issued before the first store: without `__restrict__`
// and this order, each store to x or out could alias a later load of add, w or gate, so the
// compiler kept them in program order and a row took 16 dependent memory round trips (8 µs).
//
// With `xq` set (one row, group % 32 == 0, blockDim.x % 32 == 0, the register path) the output
// is also quantized as `quantize_x_q8r` does (warp_store_q8r), so the int8 matvec that reads it
// next needs no quantize launch of its own.
__device__ __forceinline__ void rms_norm_group(float* __restrict__ x, const float* __restrict__ add,
                                               const float* __restrict__ w, const float* __restrict__ gate,
                                               float* __restrict__ out, int group, float eps, int one_plus,
                                               unsigned char* __restrict__ xq, float* __restrict__ xs) {
    __shared__ float scratch[32];
    const u64 base = (u64)blockIdx.x * group;
    const int stride = blockDim.x;
    float ss = 0.0f;
    if (group <= stride * NORM_VALS) {
        // This block's row, indexed in 32 bits (a row is at most 8192 values).
        float* __restrict__ xr = x + base;
        float* __restrict__ outr = out + base;
        const float* __restrict__ addr = add ? add + base : nullptr;
        const float* __restrict__ gater = gate ? gate + base : nullptr;
        float v[NORM_VALS], a[NORM_VALS], scale[NORM_VALS], gt[NORM_VALS];
#pragma unroll
        for (int k = 0; k < NORM_VALS; k++) {
            const int i = threadIdx.x + k * stride;
            const bool in = i < group;
            v[k] = in ? xr[i] : 0.0f;
            a[k] = in && addr ? addr[i] : 0.0f;
            scale[k] = in ? (one_plus ? 1.0f + w[i] : w[i]) : 0.0f;
            gt[k] = in && gater ? gater[i] : 0.0f;
        }
        if (addr) {
#pragma unroll
            for (int k = 0; k < NORM_VALS; k++) {
                const int i = threadIdx.x + k * stride;
                v[k] += a[k];
                if (i < group) xr[i] = v[k];
            }
        }
#pragma unroll
        for (int k = 0; k < NORM_VALS; k++) ss += v[k] * v[k];
        ss = block_sum(ss, scratch);
        const float inv = 1.0f / sqrtf(ss / (float)group + eps);
        const int warp_first = threadIdx.x & ~31;
#pragma unroll
        for (int k = 0; k < NORM_VALS; k++) {
            const int i = threadIdx.x + k * stride;
            float o = v[k] * inv * scale[k];
            if (gater) o *= silu_f(gt[k]);
            if (i < group) outr[i] = o;
            // A warp's 32 values are consecutive and either all in the group or all past it
            // (zeros there), so every lane shuffles and only whole groups are stored.
            if (xq) {
                const float amax = warp_max(fabsf(o));
                if (warp_first + k * stride < group)
                    store_q8r(o, amax, (u32)((base + warp_first + k * stride) >> 5), gridDim.x * (u32)group, xq, xs);
            }
        }
        return;
    }
    for (int i = threadIdx.x; i < group; i += stride) {
        float v = x[base + i];
        if (add) {
            v += add[base + i];
            x[base + i] = v;
        }
        ss += v * v;
    }
    ss = block_sum(ss, scratch);
    const float inv = 1.0f / sqrtf(ss / (float)group + eps);
    for (int i = threadIdx.x; i < group; i += stride) {
        const float scale = one_plus ? 1.0f + w[i] : w[i];
        float o = x[base + i] * inv * scale;
        if (gate) o *= silu_f(gate[base + i]);
        out[base + i] = o;
    }
}

// xq/xs: null, or the int8 copy of out for the next matvec (see rms_norm_group).
extern "C" __global__ void rms_norm(const float* x, const float* w, const float* gate, float* out, int group, float eps,
                                    int one_plus, unsigned char* xq, float* xs) { KERNEL_START();
    rms_norm_group((float*)x, nullptr, w, gate, out, group, eps, one_plus, xq, xs);
}

// Many groups of at most 32·NORM_VALS values (a prefill's per-head norms: the GDN output norm
// takes 8192 × 48 groups of 128), a warp each and NORM_WARPS groups a block (grid
// ceil(groups / NORM_WARPS)). The same values a lane and the same sums as rms_norm's one-warp
// blocks, bit for bit; those left half of an SM's warp slots empty (32 blocks an SM at most)
// and ran the GDN output norm at 40% of the memory bandwidth. No int8 copy (one-row tensors
// take rms_norm).
#define NORM_WARPS 8
extern "C" __global__ void rms_norm_warps(const float* __restrict__ x, const float* __restrict__ w,
                                          const float* __restrict__ gate, float* __restrict__ out, int group,
                                          u64 groups, float eps, int one_plus) { KERNEL_START();
    const u64 g = (u64)blockIdx.x * NORM_WARPS + (threadIdx.x >> 5);
    if (g >= groups) return;
    const int lane = threadIdx.x & 31;
    const float* __restrict__ xr = x + g * group;
    const float* __restrict__ gr = gate ? gate + g * group : nullptr;
    float* __restrict__ outr = out + g * group;
    float v[NORM_VALS], scale[NORM_VALS], gt[NORM_VALS];
#pragma unroll
    for (int k = 0; k < NORM_VALS; k++) {
        const int i = lane + 32 * k;
        const bool in = i < group;
        v[k] = in ? xr[i] : 0.0f;
        scale[k] = in ? (one_plus ? 1.0f + w[i] : w[i]) : 0.0f;
        gt[k] = in && gr ? gr[i] : 0.0f;
    }
    float ss = 0.0f;
#pragma unroll
    for (int k = 0; k < NORM_VALS; k++) ss += v[k] * v[k];
    ss = warp_sum(ss);
    const float inv = 1.0f / sqrtf(ss / (float)group + eps);
#pragma unroll
    for (int k = 0; k < NORM_VALS; k++) {
        const int i = lane + 32 * k;
        float o = v[k] * inv * scale[k];
        if (gr) o *= silu_f(gt[k]);
        if (i < group) outr[i] = o;
    }
}

// x += y, out = rms_norm(x).
extern "C" __global__ void add_rms_norm(float* x, const float* y, const float* w, float* out, int group, float eps,
                                        int one_plus, unsigned char* xq, float* xs) { KERNEL_START();
    rms_norm_group(x, y, w, nullptr, out, group, eps, one_plus, xq, xs);
}

// One row too wide for one SM's loads (a decode step's 5120-value residual rows): x += y (when
// y is set), out = rms_norm(x), split over gridDim.x blocks of NORM_SPLIT_VALS values a thread.
// A single block took ~7 µs a row under ncu, most of it waiting on its own ~60 KB of loads;
// ten blocks each load a tenth. The blocks meet once, to add their partial sums of squares:
// each stores its partial, fences, and counts itself in `barrier[0]`; thread 0 of every block
// spins until all have arrived, then every block adds the partials in the same order (so
// every block divides by the same bits). The last block to leave zeroes both counters for
// the next call: that call's blocks start only after this grid has completed.
//
// Safe because all gridDim.x blocks are resident at once: the host launches at most 64 small
// blocks, and with programmatic dependent launch the next kernel's blocks are admitted only
// after every block of this grid has started. `partials` holds gridDim.x floats, `barrier`
// two zeroed u32s (backend/cuda `NormBarrier`). xq/xs as in rms_norm_group (one row).
#define NORM_SPLIT_VALS 4
__device__ __forceinline__ unsigned load_volatile_u32(const unsigned* p) { return *(const volatile unsigned*)p; }
__device__ __forceinline__ float load_volatile_f32(const float* p) { return *(const volatile float*)p; }

extern "C" __global__ void add_rms_norm_split(float* __restrict__ x, const float* __restrict__ y,
                                              const float* __restrict__ w, float* __restrict__ out, int group,
                                              float eps, int one_plus, unsigned char* __restrict__ xq,
                                              float* __restrict__ xs, float* partials, unsigned* barrier) {
    KERNEL_START();
    extern __shared__ float norm_split_scratch[];
    const int stride = blockDim.x;
    const int first = blockIdx.x * stride * NORM_SPLIT_VALS;
    float v[NORM_SPLIT_VALS], a[NORM_SPLIT_VALS], scale[NORM_SPLIT_VALS];
#pragma unroll
    for (int k = 0; k < NORM_SPLIT_VALS; k++) {
        const int i = first + threadIdx.x + k * stride;
        const bool in = i < group;
        v[k] = in ? x[i] : 0.0f;
        a[k] = in && y ? y[i] : 0.0f;
        scale[k] = in ? (one_plus ? 1.0f + w[i] : w[i]) : 0.0f;
    }
    float ss = 0.0f;
#pragma unroll
    for (int k = 0; k < NORM_SPLIT_VALS; k++) {
        const int i = first + threadIdx.x + k * stride;
        if (y) {
            v[k] += a[k];
            if (i < group) x[i] = v[k];
        }
        ss += v[k] * v[k];
    }
    ss = block_sum(ss, norm_split_scratch);
    if (threadIdx.x == 0) {
        partials[blockIdx.x] = ss;
        __threadfence();
        atomicAdd(&barrier[0], 1u);
        while (load_volatile_u32(&barrier[0]) < gridDim.x) __nanosleep(32);
        __threadfence();
        if (atomicAdd(&barrier[1], 1u) == gridDim.x - 1) {
            barrier[0] = 0;
            barrier[1] = 0;
        }
    }
    __syncthreads();
    float p = 0.0f;
    for (int b = threadIdx.x & 31; b < (int)gridDim.x; b += 32) p += load_volatile_f32(&partials[b]);
    const float total = warp_sum(p);
    const float inv = 1.0f / sqrtf(total / (float)group + eps);
    const int warp_first = first + (threadIdx.x & ~31);
#pragma unroll
    for (int k = 0; k < NORM_SPLIT_VALS; k++) {
        const int i = first + threadIdx.x + k * stride;
        const float o = v[k] * inv * scale[k];
        if (i < group) out[i] = o;
        // A warp's 32 values are all in the row or all past it (group and the block's span
        // are multiples of 32).
        if (xq) {
            const float amax = warp_max(fabsf(o));
            if (warp_first + k * stride < group) store_q8r(o, amax, (u32)((warp_first + k * stride) >> 5), (u32)group, xq, xs);
        }
    }
}

// The hyper-connection norms: RMSNorm over groups of `group` values, each value then scaled by
// its column's `scale` (the (1 + w) row of `span` values, span a multiple of group, spanning
// all streams): group g takes scale[(g·group) mod span + i]. One launch where rms_norm with a
// zero weight and scale_cols took two; the same products in the same order, so the same bits.
extern "C" __global__ void rms_norm_wide(const float* x, const float* scale, float* out, int group, int span, float eps,
                                         unsigned char* xq, float* xs) { KERNEL_START();
    rms_norm_group((float*)x, nullptr, scale + ((u64)blockIdx.x * group) % span, nullptr, out, group, eps, 0, xq, xs);
}

// Per-head RMSNorm then rotate-half RoPE on the first rotary_dim dims of the head (as the
// `rope` kernel), one head per block: x → out at `pos`. The partner of each rotated dim is
// normed again from x, so no value has to wait for another thread's.
__device__ __forceinline__ void norm_rope_head(const float* x, const float* w, float* out, int head_dim, float eps,
                                               int one_plus, float pos, const float* inv_freq, int rotary_dim,
                                               float* scratch) {
    float ss = 0.0f;
    for (int i = threadIdx.x; i < head_dim; i += blockDim.x) {
        const float v = x[i];
        ss += v * v;
    }
    ss = block_sum(ss, scratch);
    const float inv = 1.0f / sqrtf(ss / (float)head_dim + eps);
    const int half = rotary_dim / 2;
    for (int i = threadIdx.x; i < head_dim; i += blockDim.x) {
        float o = x[i] * inv * (one_plus ? 1.0f + w[i] : w[i]);
        if (i < 2 * half) {
            const int j = i < half ? i + half : i - half;
            const float partner = x[j] * inv * (one_plus ? 1.0f + w[j] : w[j]);
            const float a = inv_freq[i < half ? i : j] * pos;
            const float c = cosf(a), s = sinf(a);
            o = i < half ? o * c - partner * s : o * c + partner * s;
        }
        out[i] = o;
    }
}

// One block per (row, head).
extern "C" __global__ void rms_norm_rope(const float* x, const float* w, float* out, int head_dim, float eps,
                                         int one_plus, const int* positions, const float* inv_freq, int heads,
                                         int rotary_dim) { KERNEL_START();
    __shared__ float scratch[32];
    const u64 base = (u64)blockIdx.x * head_dim;
    norm_rope_head(x + base, w, out + base, head_dim, eps, one_plus, (float)positions[blockIdx.x / heads], inv_freq,
                   rotary_dim, scratch);
}

// One decode row's attention inputs from the fused projection row qkv = [q ‖ gate ‖ k ‖ v]
// (heads·d, heads·d, kv_heads·d, kv_heads·d values): blocks 0..heads norm and rotate the q
// heads into q_out, the next kv_heads blocks the k heads straight into the key cache's next
// row (k_row), and the rest copy the gate into gate_out and v into the value cache's next row.
// One launch where split_cols4, two rms_norm_rope and two cache appends (copies, which also
// break the programmatic overlap of the kernels around them) took five; the heads are normed
// by the same code as rms_norm_rope, so the values are the same bits.
extern "C" __global__ void attention_inputs_row(const float* qkv, const float* qw, const float* kw, float* q_out,
                                                float* gate_out, float* k_row, float* v_row, int heads, int kv_heads,
                                                int head_dim, float eps, int one_plus, const int* positions,
                                                const float* inv_freq, int rotary_dim) { KERNEL_START();
    __shared__ float scratch[32];
    const int qd = heads * head_dim, kvd = kv_heads * head_dim;
    const int b = blockIdx.x;
    if (b < heads + kv_heads) {
        const float pos = (float)positions[0];
        if (b < heads)
            norm_rope_head(qkv + b * head_dim, qw, q_out + b * head_dim, head_dim, eps, one_plus, pos, inv_freq,
                           rotary_dim, scratch);
        else
            norm_rope_head(qkv + 2 * qd + (b - heads) * head_dim, kw, k_row + (b - heads) * head_dim, head_dim, eps,
                           one_plus, pos, inv_freq, rotary_dim, scratch);
        return;
    }
    const int copiers = gridDim.x - heads - kv_heads;
    for (int i = (b - heads - kv_heads) * blockDim.x + threadIdx.x; i < qd + kvd; i += copiers * blockDim.x) {
        if (i < qd)
            gate_out[i] = qkv[qd + i];
        else
            v_row[i - qd] = qkv[2 * qd + kvd + (i - qd)];
    }
}
