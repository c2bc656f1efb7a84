// Tensor-parallel all-reduce through page-locked, device-mapped host memory (no peer-to-peer).
//
// The mailbox layout is the host side's (crates/engine/src/parallel/exchange.rs, MailboxLayout):
//   [abort u64][counter u64 x ranks][length u64: 2 parities x ranks][slots f32: 2 parities x ranks x capacity]
// Per step, on each rank's stream, in order:
//   mailbox_write  : copy the partial sum into this rank's slot of the step's parity;
//   mailbox_signal : step = ++*step_dev; publish length and counter[rank] = step (system fence);
//   mailbox_wait_sum: spin until every counter >= step (or abort / timeout), then sum the slots
//                     in rank order into `out` (the same additions on every rank).
// The step lives in device memory, not in a kernel argument, so a captured CUDA graph replays
// the exchange correctly step after step. A rank that never arrives makes the waiting kernel
// give up after `timeout_ns` (globaltimer): it writes the abort word (rank + 1) and
// status = {step, missing rank + 1}, which the host reads to fail with a clear error.

typedef unsigned long long u64;

__device__ __forceinline__ u64 mb_load_volatile(const u64* p) {
    return *(const volatile u64*)p;
}

__device__ __forceinline__ u64 mb_globaltimer() {
    u64 t;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
    return t;
}

__device__ __forceinline__ float* mb_slot(unsigned char* base, int ranks, long long capacity,
                                          int parity, int rank) {
    return (float*)(base + 8 + (long long)ranks * 24 +
                    ((long long)parity * ranks + rank) * capacity * 4);
}

// Copies `n` values of `partial` (device memory) into this rank's slot of parity
// (*step_dev + 1) & 1, i.e. the step mailbox_signal is about to publish.
extern "C" __global__ void mailbox_write(const float* __restrict__ partial,
                                         unsigned char* mailbox, const u64* step_dev, int ranks,
                                         int rank, long long capacity, long long n) { KERNEL_START();
    int parity = (int)((*step_dev + 1) & 1);
    float* slot = mb_slot(mailbox, ranks, capacity, parity, rank);
    for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < n;
         i += (long long)gridDim.x * blockDim.x) {
        slot[i] = partial[i];
    }
}

// One thread: advances the step and publishes it after the slot writes (stream order puts
// mailbox_write before this kernel; the system fence orders them for the other ranks).
extern "C" __global__ void mailbox_signal(unsigned char* mailbox, u64* step_dev, int ranks,
                                          int rank, long long n) { KERNEL_START();
    if (blockIdx.x != 0 || threadIdx.x != 0) return;
    u64 step = *step_dev + 1;
    *step_dev = step;
    u64* words = (u64*)mailbox;
    __threadfence_system();
    *(volatile u64*)&words[1 + ranks + (step & 1) * ranks + rank] = (u64)n;
    __threadfence_system();
    *(volatile u64*)&words[1 + rank] = step;
    __threadfence_system();
}

// Waits for every rank's counter to reach *step_dev, then out[i] = sum over ranks of slot[i].
// Thread 0 of every block spins (a few blocks poll host memory; the sum then reads it once).
// On abort or timeout nothing is written to `out`; status = {step, missing rank + 1} and the
// abort word is set (if still clear) to rank + 1.
extern "C" __global__ void mailbox_wait_sum(unsigned char* mailbox, const u64* step_dev,
                                            int ranks, int rank, long long capacity,
                                            long long n, float* __restrict__ out,
                                            u64 timeout_ns, u64* status) { KERNEL_START();
    __shared__ int failed;
    u64* words = (u64*)mailbox;
    u64 step = *step_dev;
    if (threadIdx.x == 0) {
        failed = 0;
        u64 start = mb_globaltimer();
        for (int j = 0; j < ranks && !failed; ++j) {
            while (mb_load_volatile(&words[1 + j]) < step) {
                if (mb_load_volatile(&words[0]) != 0) {
                    failed = 1;
                    status[0] = step;
                    status[1] = (u64)j + 1;
                    break;
                }
                if (mb_globaltimer() - start > timeout_ns) {
                    failed = 1;
                    status[0] = step;
                    status[1] = (u64)j + 1;
                    atomicCAS(&words[0], 0ull, (u64)rank + 1);
                    __threadfence_system();
                    break;
                }
                __nanosleep(200);
            }
        }
        if (!failed) {
            // A rank that sent another length ran another shape: fail rather than mix them.
            for (int j = 0; j < ranks; ++j) {
                if (mb_load_volatile(&words[1 + ranks + (step & 1) * ranks + j]) != (u64)n) {
                    failed = 1;
                    status[0] = step;
                    status[1] = (u64)j + 1;
                }
            }
        }
        __threadfence_system();
    }
    __syncthreads();
    if (failed) return;
    int parity = (int)(step & 1);
    for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < n;
         i += (long long)gridDim.x * blockDim.x) {
        const volatile float* s0 = mb_slot(mailbox, ranks, capacity, parity, 0);
        float acc = s0[i];
        for (int j = 1; j < ranks; ++j) {
            const volatile float* s = mb_slot(mailbox, ranks, capacity, parity, j);
            acc += s[i];
        }
        out[i] = acc;
    }
}
