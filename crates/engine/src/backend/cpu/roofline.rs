//! Measured ceilings of this machine, for benchmark ratios: RAM read bandwidth (a STREAM-like
//! read pass over a buffer far larger than the caches) and f32 FMA throughput (a register-only
//! loop). Both run on the rayon pool, so they use the same threads as the kernels they judge.

use rayon::prelude::*;
use std::time::Instant;

/// Read bandwidth in bytes/s over a `bytes`-sized buffer (best of `passes`).
pub fn measure_read_bandwidth(bytes: usize, passes: usize) -> f64 {
    let n = bytes / 8;
    let buf: Vec<u64> = (0..n as u64).collect();
    let threads = rayon::current_num_threads().max(1);
    let chunk = n.div_ceil(threads * 4).max(1);
    let mut best = f64::MAX;
    for _ in 0..passes.max(1) {
        let t = Instant::now();
        let sum: u64 = buf
            .par_chunks(chunk)
            .map(|c| c.iter().fold(0u64, |a, &b| a.wrapping_add(b)))
            .sum();
        std::hint::black_box(sum);
        best = best.min(t.elapsed().as_secs_f64());
    }
    (n * 8) as f64 / best
}

/// f32 FMA throughput in FLOP/s (2 per lane per FMA) with the process's ISA.
pub fn measure_fma_peak() -> f64 {
    let threads = rayon::current_num_threads().max(1);
    let iters: u64 = 20_000_000;
    let t = Instant::now();
    let flops: f64 = (0..threads).into_par_iter().map(|_| fma_loop(iters)).sum();
    flops / t.elapsed().as_secs_f64()
}

fn fma_loop(iters: u64) -> f64 {
    #[cfg(target_arch = "x86_64")]
    {
        if super::simd::isa() >= super::simd::Isa::Avx2 {
            // SAFETY: AVX2 + FMA checked by `isa()`.
            return unsafe { fma_loop_avx2(iters) };
        }
    }
    let mut acc = [1.0f32; 8];
    for _ in 0..iters {
        for a in &mut acc {
            *a = a.mul_add(0.999_999, 1e-7);
        }
    }
    std::hint::black_box(acc);
    iters as f64 * 8.0 * 2.0
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
unsafe fn fma_loop_avx2(iters: u64) -> f64 {
    use std::arch::x86_64::*;
    // Ten independent chains hide the FMA latency on two ports.
    let m = _mm256_set1_ps(0.999_999);
    let c = _mm256_set1_ps(1e-7);
    let mut r = [_mm256_set1_ps(1.0); 10];
    for _ in 0..iters {
        for x in r.iter_mut() {
            *x = _mm256_fmadd_ps(*x, m, c);
        }
    }
    std::hint::black_box(r);
    iters as f64 * 10.0 * 8.0 * 2.0
}
