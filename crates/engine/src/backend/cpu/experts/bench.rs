//! The `bench cpu-experts` measurement: the machine's read bandwidth, then the expert
//! kernels on a full-size expert set with random valid blocks and random top-k routing.
//!
//! Bandwidth is measured STREAM-like: every worker of the same pool sums its share of a
//! buffer much larger than the last-level cache (first touched by that worker); the best of
//! a few passes counts. Expert throughput counts the weight bytes of the distinct experts a
//! call touches (each is read once per call) over the call's time, so the ratio of the two
//! says how close the kernels come to streaming weights at memory speed.

use super::fused::{self, ActSpec, MathPath};
use super::{
    moe_experts_with, ExpertLayout, ExpertMatrix, ExpertPool, ExpertSet, ExpertShape, MoeScratch,
    RowFormat, SplitMix,
};
use crate::backend::cpu::simd::Isa;
use anyhow::{bail, Result};
use serde_json::json;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Instant;

#[derive(Debug, Clone)]
pub struct BenchParams {
    pub format: RowFormat,
    /// Format of the down rows (None: `format` when its block divides `intermediate`, else Q2_0).
    pub down_format: Option<RowFormat>,
    pub threads: usize,
    pub batch: usize,
    pub experts: usize,
    pub top_k: usize,
    pub hidden: usize,
    pub intermediate: usize,
    pub iters: usize,
    pub isa: Isa,
    /// Exact (f32 activations) or fast (int8 activations where a fused kernel exists).
    pub path: MathPath,
    /// Size of the bandwidth buffer in MiB.
    pub bandwidth_mib: usize,
    pub seed: u64,
}

/// The CPU model name, as the OS reports it.
pub fn cpu_model() -> String {
    std::fs::read_to_string("/proc/cpuinfo")
        .ok()
        .and_then(|s| {
            s.lines()
                .find(|l| l.starts_with("model name"))
                .and_then(|l| l.split(':').nth(1))
                .map(|v| v.trim().to_string())
        })
        .unwrap_or_else(|| "unknown".into())
}

fn cpu_features() -> Vec<&'static str> {
    let mut f = Vec::new();
    #[cfg(target_arch = "x86_64")]
    {
        macro_rules! check {
            ($($name:tt),*) => { $( if is_x86_feature_detected!($name) { f.push($name); } )* };
        }
        check!(
            "avx2",
            "fma",
            "f16c",
            "avx512f",
            "avx512bw",
            "avx512vl",
            "avx512vnni",
            "avx512vbmi",
            "avx512bitalg",
            "avxvnni"
        );
    }
    f
}

/// Read bandwidth in GB/s (10⁹ bytes/s) with the pool's workers.
pub fn read_bandwidth(pool: &ExpertPool, bytes: usize, passes: usize) -> f64 {
    let threads = pool.threads();
    let words = bytes / 8 / threads / 64 * 64;
    let mut buf: Vec<u64> = Vec::with_capacity(words * threads);
    // In huge pages as the expert store is (before the first touch below).
    if crate::backend::cpu::huge_pages::wanted() {
        crate::backend::cpu::huge_pages::advise(buf.spare_capacity_mut());
    }
    let base = SharedPtr(buf.as_mut_ptr());
    let base = &base;
    // First touch by the worker that will read the chunk (NUMA placement).
    pool.run(&|w| {
        // SAFETY: each worker initialises its own disjoint chunk of the allocation.
        let chunk = unsafe { std::slice::from_raw_parts_mut(base.0.add(w * words), words) };
        for (i, v) in chunk.iter_mut().enumerate() {
            *v = i as u64 ^ w as u64;
        }
    });
    // SAFETY: all `words · threads` elements were initialised above.
    unsafe { buf.set_len(words * threads) };
    let sink = AtomicU64::new(0);
    let mut best = 0f64;
    for _ in 0..passes {
        let start = Instant::now();
        pool.run(&|w| {
            let chunk = &buf[w * words..(w + 1) * words];
            // Integer sums vectorise (reassociation is exact for wrapping adds).
            let mut acc = [0u64; 8];
            for c in chunk.chunks_exact(8) {
                for (a, v) in acc.iter_mut().zip(c) {
                    *a = a.wrapping_add(*v);
                }
            }
            sink.fetch_add(
                acc.iter().fold(0u64, |a, b| a.wrapping_add(*b)),
                Ordering::Relaxed,
            );
        });
        let secs = start.elapsed().as_secs_f64();
        best = best.max((words * threads * 8) as f64 / secs / 1e9);
    }
    std::hint::black_box(sink.load(Ordering::Relaxed));
    best
}

struct SharedPtr(*mut u64);
// SAFETY: used only for disjoint per-worker chunks.
unsafe impl Sync for SharedPtr {}

/// Runs the benchmark and returns its JSON report.
pub fn run(p: &BenchParams) -> Result<serde_json::Value> {
    if p.top_k == 0 || p.top_k > p.experts {
        bail!(
            "top-k {} must be between 1 and the expert count {}",
            p.top_k,
            p.experts
        );
    }
    if !(1..=256).contains(&p.batch) {
        bail!("batch {} must be between 1 and 256", p.batch);
    }
    if p.isa > Isa::best_supported() {
        bail!(
            "ISA {} is not supported by this CPU (best: {})",
            p.isa.name(),
            Isa::best_supported().name()
        );
    }
    let pool = ExpertPool::new(p.threads, true);
    let threads = pool.threads();
    let bandwidth = read_bandwidth(&pool, p.bandwidth_mib << 20, 5);

    let shape = ExpertShape {
        hidden: p.hidden,
        intermediate: p.intermediate,
    };
    let down_format =
        p.down_format
            .unwrap_or(if p.intermediate.is_multiple_of(p.format.block_len()) {
                p.format
            } else {
                RowFormat::Ggml(crate::quant::GgmlType::Q2_0)
            });
    let layout = ExpertLayout::new(p.format, down_format, shape)?;
    let mut set = ExpertSet::zeroed(layout, p.experts);
    set.randomize(p.seed);
    let mut scratch = MoeScratch::new(shape, p.experts, p.batch, p.top_k, threads);
    // A few clock reads per worker and call (well under 1 µs of a ~100 µs call).
    scratch.record_timeline(true);
    let mut timelines = Vec::new();
    let mut rng = SplitMix(p.seed ^ 0x5eed);
    let x: Vec<f32> = (0..p.batch * p.hidden)
        .map(|_| rng.unit() * 2.0 - 1.0)
        .collect();
    let mut out = vec![0f32; x.len()];
    let mut ids = vec![0u32; p.batch * p.top_k];
    let mut weights = vec![0f32; ids.len()];
    let mut seen = vec![false; p.experts];
    let mut samples = Vec::new();
    let warmup = 2;
    for it in 0..p.iters + warmup {
        // Random distinct top-k experts per token.
        for t in 0..p.batch {
            let row = &mut ids[t * p.top_k..(t + 1) * p.top_k];
            let mut k = 0;
            while k < p.top_k {
                let e = (rng.next() % p.experts as u64) as u32;
                if !row[..k].contains(&e) {
                    row[k] = e;
                    k += 1;
                }
            }
        }
        weights.iter_mut().for_each(|w| *w = 1.0 / p.top_k as f32);
        seen.iter_mut().for_each(|s| *s = false);
        let mut distinct = 0;
        for &e in &ids {
            if !seen[e as usize] {
                seen[e as usize] = true;
                distinct += 1;
            }
        }
        out.iter_mut().for_each(|v| *v = 0.0);
        let start = Instant::now();
        moe_experts_with(
            &pool,
            p.isa,
            p.path,
            &set,
            &x,
            &ids,
            &weights,
            p.top_k,
            &mut out,
            &mut scratch,
        )?;
        let secs = start.elapsed().as_secs_f64();
        if it >= warmup {
            samples.push((secs, distinct));
            if let Some(t) = scratch.timeline() {
                timelines.push(t.summary());
            }
        }
    }
    std::hint::black_box(&out);
    // The fast path's deviation from the exact one on the last call's routing.
    let fast_vs_exact = if p.path == MathPath::Fast {
        let mut exact = vec![0f32; x.len()];
        moe_experts_with(
            &pool,
            p.isa,
            MathPath::Exact,
            &set,
            &x,
            &ids,
            &weights,
            p.top_k,
            &mut exact,
            &mut scratch,
        )?;
        let max_exact = exact.iter().fold(0f32, |m, v| m.max(v.abs())) as f64;
        let max_diff = out
            .iter()
            .zip(&exact)
            .fold(0f32, |m, (a, b)| m.max((a - b).abs())) as f64;
        let l2 = |v: &mut dyn Iterator<Item = f64>| v.map(|d| d * d).sum::<f64>().sqrt();
        let diff_l2 = l2(&mut out.iter().zip(&exact).map(|(a, b)| (a - b) as f64));
        let exact_l2 = l2(&mut exact.iter().map(|&a| a as f64));
        json!({
            "max_abs_diff_over_max_abs_exact": max_diff / max_exact,
            "l2_diff_over_l2_exact": diff_l2 / exact_l2,
        })
    } else {
        serde_json::Value::Null
    };
    let kind = |f: RowFormat, k: usize| format!("{:?}", ActSpec::new(p.isa, p.path, f, k).kind);
    let in_cache_gu = in_cache_gbps(p, &set, ExpertMatrix::Gate, p.hidden, 2 * p.intermediate);
    let in_cache_down = in_cache_gbps(p, &set, ExpertMatrix::Down, p.intermediate, p.hidden);
    // Bytes per call of gate/up and down, to weigh the two in-cache rates into one.
    let gu_bytes = (2 * p.intermediate * layout.gate_up_row_bytes) as f64;
    let down_bytes = (p.hidden * layout.down_row_bytes) as f64;
    let in_cache = (gu_bytes + down_bytes) / (gu_bytes / in_cache_gu + down_bytes / in_cache_down);
    let weight_bytes = layout.weight_bytes() as f64;
    let pairs = (p.batch * p.top_k) as f64;
    let flops_per_call = 2.0 * pairs * 3.0 * p.hidden as f64 * p.intermediate as f64;
    let total_secs: f64 = samples.iter().map(|s| s.0).sum();
    let total_bytes: f64 = samples.iter().map(|s| s.1 as f64 * weight_bytes).sum();
    let mut gbps: Vec<f64> = samples
        .iter()
        .map(|&(s, d)| d as f64 * weight_bytes / s / 1e9)
        .collect();
    gbps.sort_by(f64::total_cmp);
    let median = gbps.get(gbps.len() / 2).copied().unwrap_or(0.0);
    let mean_gbps = total_bytes / total_secs / 1e9;
    let spec = ActSpec::new(p.isa, p.path, p.format, p.hidden);
    let iq3s_decode = if spec.iq3s_shuffle {
        "vpermt2b"
    } else if spec.iq3s_gather {
        "gather"
    } else {
        "scalar loads"
    };
    Ok(json!({
        "bench": "cpu-experts",
        "machine": {
            "cpu": cpu_model(),
            "physical_cores": super::pool::physical_cores().len(),
            "logical_cpus": std::thread::available_parallelism().map_or(1, |n| n.get()),
            "features": cpu_features(),
            "best_isa": Isa::best_supported().name(),
        },
        "params": {
            "format": p.format.name(),
            "down_format": down_format.name(),
            "isa": p.isa.name(),
            "path": p.path.name(),
            "path_note": match p.path {
                MathPath::Exact => "f32 activations on the dequantised weights (CAPY_EXACT_MATH=1)",
                MathPath::Fast => "int8 activations per block, integer dot products (VNNI on AVX-512, maddubs on AVX2) where a fused kernel exists",
            },
            "kernel_gate_up": kind(p.format, p.hidden),
            "kernel_down": kind(down_format, p.intermediate),
            "vnni": fused::has_vnni(),
            "threads": threads,
            "batch": p.batch,
            "experts": p.experts,
            "top_k": p.top_k,
            "hidden": p.hidden,
            "intermediate": p.intermediate,
            "iters": p.iters,
            "bandwidth_buffer_mib": p.bandwidth_mib,
            "expert_weight_bytes": layout.weight_bytes(),
            "expert_set_bytes": set.bytes(),
        },
        "huge_pages": crate::backend::cpu::huge_pages::status(),
        "read_bandwidth_gbps": bandwidth,
        "weights_gbps_mean": mean_gbps,
        "weights_gbps_median": median,
        "bandwidth_ratio": mean_gbps / bandwidth,
        "gflops": flops_per_call * samples.len() as f64 / total_secs / 1e9,
        "ms_per_call": total_secs / samples.len().max(1) as f64 * 1e3,
        "tokens_per_s": p.batch as f64 * samples.len() as f64 / total_secs,
        "fast_vs_exact": fast_vs_exact,
        "timeline": super::timeline::CallSummary::medians_json(&timelines),
        "in_cache": {
            "note": "one thread, the kernels alone on rows that stay in cache (no memory stalls): the compute ceiling per core; ratio = threads x that rate / read bandwidth (below 1: the kernels, not memory, limit the decode)",
            "gate_up_gbps": in_cache_gu,
            "down_gbps": in_cache_down,
            "weighted_gbps": in_cache,
            "in_cache_ratio_to_bandwidth": in_cache * threads as f64 / bandwidth,
            "iq3s_decode": iq3s_decode,
        },
    }))
}

/// Single-thread GB/s of the fused kernels on the first rows of expert 0's `m` (at most
/// 128 KiB, read over and over so they stay in cache), one activation vector per call.
fn in_cache_gbps(p: &BenchParams, set: &ExpertSet, m: ExpertMatrix, k: usize, rows: usize) -> f64 {
    let fmt = match m {
        ExpertMatrix::Down => set.layout.down_format,
        _ => set.layout.format,
    };
    let spec = ActSpec::new(p.isa, p.path, fmt, k);
    // Gate and up rows are interleaved and of one size, so `rows` gate/up rows are contiguous.
    let start = set.row_range(m, 0).start;
    let rb = set.row_range(m, 0).len();
    let n = (128 * 1024 / rb).clamp(1, rows);
    let bytes = &set.record(0)[start..start + n * rb];
    let mut rng = SplitMix(p.seed ^ 0xcace);
    let x: Vec<f32> = (0..k).map(|_| rng.unit() * 2.0 - 1.0).collect();
    let sl = ActSpec::scales_len(k);
    // The activation vectors on 64-byte boundaries, as `MoeScratch` lays them out.
    let (mut f_buf, mut q_buf) = (vec![0f32; k + 16], vec![0i8; k + 64]);
    let f_at = (f_buf.as_ptr() as usize).wrapping_neg() % 64 / 4;
    let q_at = (q_buf.as_ptr() as usize).wrapping_neg() % 64;
    let (f, q) = (&mut f_buf[f_at..f_at + k], &mut q_buf[q_at..q_at + k]);
    let (mut s, mut sums) = (vec![0f32; sl], vec![0f32; sl]);
    fused::prepare(&spec, &x, f, q, &mut s, &mut sums);
    let act = [fused::Act {
        f,
        q,
        s: &s,
        sums: &sums,
    }];
    let mut out = vec![0f32; n];
    let mut scratch = vec![0f32; k];
    let mut calls = 0usize;
    let t0 = Instant::now();
    while t0.elapsed().as_secs_f64() < 0.2 || calls < 10 {
        fused::dots(&spec, bytes, rb, &act, &mut out, &mut scratch);
        calls += 1;
    }
    std::hint::black_box(&out);
    (calls * bytes.len()) as f64 / t0.elapsed().as_secs_f64() / 1e9
}
