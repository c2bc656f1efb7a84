//! The hybrid expert bench: Flash-Next's routed experts at full size, decode at batch 1, with
//! Zipf-skewed routing, a VRAM expert cache sized from the budget, and the misses computed on
//! the CPU; then the same with the cache disabled (every routed expert on the CPU).
//!
//! It runs the MoE layers' routed experts only (the dense part of a layer is the CUDA bench's
//! business) over `layers` simulated layers and scales per-token figures to the model's layer
//! count; the cache's slots are scaled the same way, so each simulated layer sees the share of
//! VRAM a real layer gets. Every figure is paired with the roofline of the same run: CPU
//! expert bytes ÷ measured RAM read bandwidth + resident bytes ÷ device bandwidth + copied
//! bytes ÷ measured upload rate.

use super::expert_cache::{ExpertCache, ExpertCacheConfig, ExpertCacheStats};
use super::experts::{upload, ForwardTimes, HybridExperts, Placement};
use super::zipf::ZipfRouter;
use crate::backend::cpu::experts::bench::read_bandwidth;
use crate::backend::cpu::experts::timeline::CallSummary;
use crate::backend::cpu::experts::{ExpertLayout, ExpertPool, ExpertSet, ExpertShape, RowFormat};
use crate::backend::cpu::simd::Isa;
use crate::backend::{Backend, MoeRouting};
use crate::model::layers::moe::RoutedExperts;
use anyhow::Result;
use serde_json::{json, Value};
use std::sync::{Arc, Mutex};
use std::time::Instant;

/// The down projection's format for routed experts whose gate/up are in `format`: the same
/// where its block divides the intermediate width (the rows `down` reads), else Q2_0, as the
/// GSQ-RCO checkpoints store a 640-wide down projection whose width no 256-weight block divides.
pub fn default_down_format(format: RowFormat, intermediate: usize) -> Result<RowFormat> {
    if intermediate.is_multiple_of(format.block_len()) {
        Ok(format)
    } else {
        RowFormat::parse("q2_0")
    }
}

/// What to run.
#[derive(Debug, Clone)]
pub struct HybridBenchOptions {
    pub format: RowFormat,
    pub down_format: RowFormat,
    /// Simulated MoE layers (host RAM: `layers × experts × expert bytes`).
    pub layers: usize,
    /// Layers of the model the figures are scaled to (48 for Flash-Next).
    pub model_layers: usize,
    pub experts: usize,
    pub top_k: usize,
    pub hidden: usize,
    pub intermediate: usize,
    /// VRAM left for the expert cache over the whole model, in bytes (0: all on CPU).
    pub cache_bytes: u64,
    pub zipf_exponent: f64,
    pub warmup_tokens: usize,
    pub tokens: usize,
    /// CPU expert workers (0: one per physical core).
    pub threads: usize,
    pub seed: u64,
    /// Device read bandwidth (bytes/s) for the resident side's roofline; `None` on the CPU
    /// stand-in (the resident side then counts at the RAM bandwidth).
    pub device_bandwidth: Option<f64>,
    /// Size of the RAM bandwidth probe (far above the last-level cache).
    pub bandwidth_probe_bytes: usize,
}

struct RunFigures {
    seconds_per_token: f64,
    /// Each timed token's seconds (simulated layers), in order: a mean far above the median
    /// means a few slow tokens (a worker descheduled mid-task holds the whole layer).
    token_seconds: Vec<f64>,
    stats: ExpertCacheStats,
    admissions_bytes_per_token: f64,
    /// The timed tokens' phases, summed over layers.
    times: ForwardTimes,
    /// The timed tokens' CPU experts calls, each call's timeline.
    cpu_calls: Vec<CallSummary>,
}

fn run_once<B: Backend>(
    b: &B,
    o: &HybridBenchOptions,
    sets: &[Arc<ExpertSet>],
    pool: &Arc<ExpertPool>,
    slots: usize,
) -> Result<RunFigures> {
    let cache = Arc::new(Mutex::new(ExpertCache::new(
        o.layers,
        o.experts,
        ExpertCacheConfig {
            slots,
            ..ExpertCacheConfig::default()
        },
    )));
    let layers: Vec<HybridExperts<B>> = sets
        .iter()
        .enumerate()
        .map(|(l, set)| {
            HybridExperts::new(
                b,
                l,
                set.clone(),
                pool.clone(),
                Isa::detect(),
                Placement::Cached(cache.clone()),
            )
        })
        .collect::<Result<_>>()?;
    for l in &layers {
        l.record_cpu_calls();
    }
    let mut router = ZipfRouter::new(o.layers, o.experts, o.top_k, o.zipf_exponent, o.seed);
    let x_host: Vec<f32> = (0..o.hidden)
        .map(|i| ((i * 7919 % 1000) as f32 / 500.0 - 1.0) * 0.1)
        .collect();
    let x = b.from_host(1, o.hidden, &x_host);
    let step = |routes: &[MoeRouting]| {
        for (l, r) in routes.iter().enumerate() {
            let y = layers[l].forward(b, &x, r);
            // The next layer needs this one's output: wait for it, as decode does.
            std::hint::black_box(b.to_host(&y));
        }
    };
    for _ in 0..o.warmup_tokens {
        let routes: Vec<MoeRouting> = (0..o.layers).map(|l| router.route(l, 1)).collect();
        step(&routes);
    }
    let before = cache.lock().expect("cache").stats();
    let times_of = |layers: &[HybridExperts<B>]| {
        let mut t = ForwardTimes::default();
        for l in layers {
            t.add(&l.times());
        }
        t
    };
    let times_before = times_of(&layers);
    let take_cpu_calls = |layers: &[HybridExperts<B>]| -> Vec<CallSummary> {
        layers.iter().flat_map(|l| l.take_cpu_calls()).collect()
    };
    take_cpu_calls(&layers); // the warm-up's
    let routes: Vec<Vec<MoeRouting>> = (0..o.tokens)
        .map(|_| (0..o.layers).map(|l| router.route(l, 1)).collect())
        .collect();
    let t0 = Instant::now();
    let mut token_seconds = Vec::with_capacity(routes.len());
    for r in &routes {
        let t = Instant::now();
        step(r);
        token_seconds.push(t.elapsed().as_secs_f64());
    }
    let seconds = t0.elapsed().as_secs_f64();
    let times_after = times_of(&layers);
    let cpu_calls = take_cpu_calls(&layers);
    let after = cache.lock().expect("cache").stats();
    let stats = ExpertCacheStats {
        lookups: after.lookups - before.lookups,
        hits: after.hits - before.hits,
        admissions: after.admissions - before.admissions,
        evictions: after.evictions - before.evictions,
        tokens: after.tokens - before.tokens,
    };
    let expert_bytes = sets[0].layout.weight_bytes() as f64;
    Ok(RunFigures {
        seconds_per_token: seconds / o.tokens as f64,
        token_seconds,
        admissions_bytes_per_token: stats.admissions as f64 * expert_bytes / o.tokens as f64,
        stats,
        times: times_after.since(&times_before),
        cpu_calls,
    })
}

/// The spread of a run's per-token times, scaled to the model's layers, and the placement's
/// roofline (`roofline_s`, the run's mean per token) over the median token: a few slow tokens
/// (a descheduled worker, a burst of another tenant's memory traffic) move the mean, not this.
fn token_time_spread(token_seconds: &[f64], scale: f64, roofline_s: f64) -> Value {
    let mut sorted: Vec<f64> = token_seconds.iter().map(|s| s * scale).collect();
    sorted.sort_by(f64::total_cmp);
    let at = |q: f64| sorted[((sorted.len() - 1) as f64 * q).round() as usize];
    let mean = sorted.iter().sum::<f64>() / sorted.len() as f64;
    json!({
        "p10_s": at(0.1),
        "median_s": at(0.5),
        "p90_s": at(0.9),
        "max_s": at(1.0),
        "median_moe_tokens_per_s": 1.0 / at(0.5),
        "mean_over_median_ratio": mean / at(0.5),
        "placement_roofline_over_median_token_ratio": roofline_s / at(0.5),
    })
}

/// A run's time per token (scaled to the model's layers) by phase of the layers' calls, the
/// rest being the bench's own wait for each layer's output (device work not overlapped); and
/// the CPU phase against its share of the roofline (`cpu_roofline_s`).
fn where_the_time_goes(f: &RunFigures, tokens: usize, scale: f64, cpu_roofline_s: f64) -> Value {
    let t = &f.times;
    let per = |s: f64| s / tokens as f64 * scale;
    let total = f.seconds_per_token * scale;
    json!({
        "note": "seconds per token on the calling thread, scaled to the model's layers; read_x waits for the device's queued work; where experts ran on the CPU, the caller's and the resident experts' device work is queued inside cpu_experts (queued_during_cpu_experts_s of caller_queue_s + resident_queue_s; the phases less that add up to the calls' time; this bench hands no caller work); output_wait is the rest: waiting for each layer's output",
        "policy_s": per(t.policy_s),
        "read_x_s": per(t.read_x_s),
        "caller_queue_s": per(t.caller_queue_s),
        "resident_queue_s": per(t.resident_queue_s),
        "cpu_experts_s": per(t.cpu_experts_s),
        "queued_during_cpu_experts_s": per(t.queued_during_cpu_s),
        "merge_s": per(t.merge_s),
        "admit_s": per(t.admit_s),
        "output_wait_s": (total - per(t.total_s())).max(0.0),
        "cpu_experts_share_ratio": per(t.cpu_experts_s) / total,
        "cpu_experts_over_cpu_roofline_ratio": if cpu_roofline_s > 0.0 { per(t.cpu_experts_s) / cpu_roofline_s } else { 0.0 },
    })
}

/// Runs the bench with the cache and without it; returns the JSON report.
pub fn run<B: Backend>(b: &B, o: &HybridBenchOptions) -> Result<Value> {
    let shape = ExpertShape {
        hidden: o.hidden,
        intermediate: o.intermediate,
    };
    let layout = ExpertLayout::new(o.format, o.down_format, shape)?;
    let expert_bytes = layout.weight_bytes() as f64;
    let pool = Arc::new(ExpertPool::new(
        if o.threads == 0 {
            crate::backend::cpu::experts::pool::physical_cores().len()
        } else {
            o.threads
        },
        true,
    ));
    eprintln!(
        "hybrid bench: {} layers × {} experts of {:.2} MB ({}) in host RAM ({:.1} GB)…",
        o.layers,
        o.experts,
        expert_bytes / 1e6,
        o.format.name(),
        o.layers as f64 * o.experts as f64 * layout.record_bytes as f64 / 1e9
    );
    let mem_before = super::memory::ProcessMemory::now();
    let sets = super::memory::synthetic_store(layout, o.layers, o.experts, o.seed);
    let mem_store = super::memory::ProcessMemory::now();
    let store_bytes: u64 = sets.iter().map(|s| s.bytes() as u64).sum();
    let store_check = super::memory::MemoryCheck::new(
        store_bytes,
        super::memory::anon_growth(mem_before, mem_store),
    );
    // Page-locked as the loader keeps it, so the cache's copies are DMA from the store. The
    // pins are declared after `sets` and so dropped before them.
    let pins: Vec<_> = sets
        .iter()
        // SAFETY: each set is an `Arc`ed allocation that outlives `pins` (declared after it).
        .map(|s| unsafe { b.pin_host(s.as_bytes()) })
        .collect::<Result<_>>()?;
    let pinned_bytes: usize = pins.iter().flatten().map(|p| p.bytes()).sum();
    // read_bandwidth reports GB/s.
    let ram_bandwidth = read_bandwidth(&pool, o.bandwidth_probe_bytes, 3) * 1e9;

    // Upload rate of expert records (host → device as the cache copies them).
    let probe = 16.min(o.experts);
    let t0 = Instant::now();
    let copies: Vec<_> = (0..probe)
        .map(|e| upload(b, &sets[0], e))
        .collect::<Result<_>>()?;
    let probe_x = b.zeros(1, 1);
    std::hint::black_box(b.to_host(&probe_x));
    let upload_rate = probe as f64 * expert_bytes / t0.elapsed().as_secs_f64();
    drop(copies);

    let total_experts = o.model_layers * o.experts;
    let model_slots = (o.cache_bytes as f64 / expert_bytes) as usize;
    let slots = (model_slots.min(total_experts) * o.layers) / o.model_layers;
    let device_bandwidth = o.device_bandwidth.unwrap_or(ram_bandwidth);
    let scale = o.model_layers as f64 / o.layers as f64;

    let report = |f: &RunFigures| -> Value {
        let lookups_per_token = f.stats.lookups as f64 / o.tokens as f64;
        let host_per_token = (f.stats.lookups - f.stats.hits) as f64 / o.tokens as f64;
        let resident_per_token = lookups_per_token - host_per_token;
        let roofline_s = (host_per_token * expert_bytes / ram_bandwidth
            + resident_per_token * expert_bytes / device_bandwidth
            + f.admissions_bytes_per_token / upload_rate)
            * scale;
        let measured_s = f.seconds_per_token * scale;
        json!({
            "moe_seconds_per_token": measured_s,
            "moe_tokens_per_s": 1.0 / measured_s,
            "hit_rate": f.stats.hit_rate(),
            "cpu_experts_per_token": host_per_token * scale,
            "gpu_experts_per_token": resident_per_token * scale,
            "copied_bytes_per_token": f.admissions_bytes_per_token * scale,
            "placement_roofline_seconds_per_token": roofline_s,
            "placement_roofline_ratio": roofline_s / measured_s,
            "cpu_expert_bytes_per_s": host_per_token * expert_bytes / f.seconds_per_token,
            "cpu_bandwidth_ratio": host_per_token * expert_bytes / f.seconds_per_token / ram_bandwidth,
            "where_the_time_goes": where_the_time_goes(f, o.tokens, scale, host_per_token * expert_bytes / ram_bandwidth * scale),
            "token_time_spread": token_time_spread(&f.token_seconds, scale, roofline_s),
            "cpu_call_timeline": CallSummary::medians_json(&f.cpu_calls),
        })
    };
    eprintln!(
        "with the expert cache ({slots} slots over {} simulated layers)…",
        o.layers
    );
    let cached = run_once(b, o, &sets, &pool, slots)?;
    eprintln!("all routed experts on the CPU…");
    let all_cpu = run_once(b, o, &sets, &pool, 0)?;
    let hit = cached.stats.hit_rate();
    Ok(json!({
        "bench": "hybrid-experts",
        "backend": b.name(),
        "format": o.format.name(),
        "down_format": o.down_format.name(),
        "shape": {"layers_simulated": o.layers, "model_layers": o.model_layers, "experts": o.experts,
                   "top_k": o.top_k, "hidden": o.hidden, "intermediate": o.intermediate},
        "expert_bytes": expert_bytes,
        "zipf_exponent": o.zipf_exponent,
        "tokens": o.tokens,
        "warmup_tokens": o.warmup_tokens,
        "threads": pool.threads(),
        "isa": Isa::detect().name(),
        "cache_bytes": o.cache_bytes,
        "cache_slots_model": model_slots.min(total_experts),
        "cache_slots_simulated": slots,
        "measured": {
            "ram_read_bytes_per_s": ram_bandwidth,
            "device_bytes_per_s": device_bandwidth,
            "device_bandwidth_measured": o.device_bandwidth.is_some(),
            "expert_upload_bytes_per_s": upload_rate,
        },
        "host_store_ledger": {
            "ledger_bytes": store_check.ledger_bytes,
            "anon_growth_bytes": store_check.measured_bytes,
            "page_locked_bytes": pinned_bytes,
            "measured_to_ledger_ratio": store_check.measured_to_ledger_ratio,
            "within_5_percent": store_check.within_5_percent,
            "process_after_store": mem_store,
            "huge_pages": crate::backend::cpu::huge_pages::status(),
        },
        "with_cache": report(&cached),
        "all_on_cpu": report(&all_cpu),
        "cache_speedup_ratio": all_cpu.seconds_per_token / cached.seconds_per_token,
        "speedup_predicted_by_hit_rate_ratio": 1.0 / (1.0 - hit).max(1e-9),
        "note": "routed experts of the MoE layers only (dense layer work is in the CUDA bench); per-token figures scaled from the simulated layers to the model's",
    }))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::backend::cpu::CpuBackend;
    use crate::quant::GgmlType;

    #[test]
    fn down_keeps_the_format_whose_block_divides_the_intermediate_width() {
        let q8 = RowFormat::Ggml(GgmlType::Q8_0);
        assert_eq!(default_down_format(q8, 640).unwrap(), q8);
        let iq3 = RowFormat::parse("iq3_s").unwrap();
        assert_eq!(default_down_format(iq3, 1024).unwrap(), iq3);
        // 640 is no multiple of IQ3_S's 256-weight block.
        let down = default_down_format(iq3, 640).unwrap();
        assert_eq!(down, RowFormat::parse("q2_0").unwrap());
        assert!(640usize.is_multiple_of(down.block_len()));
    }

    #[test]
    fn small_run_reports_consistent_figures() {
        let o = HybridBenchOptions {
            format: RowFormat::Ggml(GgmlType::Q8_0),
            down_format: RowFormat::Ggml(GgmlType::Q8_0),
            layers: 2,
            model_layers: 4,
            experts: 16,
            top_k: 2,
            hidden: 64,
            intermediate: 32,
            cache_bytes: 8 * 64 * 32 * 3 * 34 / 32,
            zipf_exponent: 1.2,
            warmup_tokens: 8,
            tokens: 16,
            threads: 1,
            seed: 3,
            device_bandwidth: None,
            bandwidth_probe_bytes: 1 << 24,
        };
        let r = run(&CpuBackend::new(), &o).unwrap();
        assert_eq!(r["cache_slots_model"], 8);
        assert_eq!(r["cache_slots_simulated"], 4);
        let with = &r["with_cache"];
        let cpu = &r["all_on_cpu"];
        assert_eq!(cpu["hit_rate"], 0.0);
        let per_token = cpu["cpu_experts_per_token"].as_f64().unwrap();
        assert!(
            (per_token - 8.0).abs() < 1e-9,
            "4 layers × top-2: {per_token}"
        );
        let h = with["hit_rate"].as_f64().unwrap();
        assert!(h > 0.0 && h < 1.0, "{h}");
        let split = with["cpu_experts_per_token"].as_f64().unwrap()
            + with["gpu_experts_per_token"].as_f64().unwrap();
        assert!((split - 8.0).abs() < 1e-9);
        assert!(with["placement_roofline_ratio"].as_f64().unwrap() > 0.0);
        for run in [with, cpu] {
            let spread = &run["token_time_spread"];
            let q = |k: &str| spread[k].as_f64().unwrap();
            assert!(q("p10_s") > 0.0 && q("p10_s") <= q("median_s"), "{spread}");
            assert!(
                q("median_s") <= q("p90_s") && q("p90_s") <= q("max_s"),
                "{spread}"
            );
            // The per-token times are parts of the run's time (the loop's own steps between
            // tokens are the rest, so their mean is at most the run's time per token).
            let mean = q("mean_over_median_ratio") * q("median_s");
            let roofline = run["placement_roofline_seconds_per_token"]
                .as_f64()
                .unwrap();
            let over_median = q("placement_roofline_over_median_token_ratio");
            assert!(
                (over_median * q("median_s") - roofline).abs() <= roofline * 1e-9,
                "{spread}"
            );
            let whole = run["moe_seconds_per_token"].as_f64().unwrap();
            assert!(mean > 0.0 && mean <= whole * (1.0 + 1e-9), "{mean} {whole}");
        }
        // Both runs record each CPU call's timeline; its marks come in order. Without the
        // cache every layer of every timed token calls the CPU.
        for run in [with, cpu] {
            let t = &run["cpu_call_timeline"];
            assert!(t["calls"].as_u64().unwrap() > 0, "{t}");
            let f = |k: &str| t[k].as_f64().unwrap_or_else(|| panic!("{k} in {t}"));
            assert!(f("before_job_us") <= f("gate_up_end_last_us"), "{t}");
            assert!(f("gate_up_end_last_us") <= f("down_end_last_us"), "{t}");
            assert!(f("down_end_last_us") <= f("total_us"), "{t}");
        }
        assert_eq!(
            cpu["cpu_call_timeline"]["calls"],
            2 * 16,
            "2 layers × 16 tokens"
        );
        // The phases are measured parts of the token's time: none negative, the CPU's share
        // present wherever experts ran on the CPU, and together no more than the whole once
        // the resident queuing done inside the CPU phase is counted once.
        for run in [with, cpu] {
            let t = &run["where_the_time_goes"];
            let phases: Vec<f64> = [
                "policy_s",
                "read_x_s",
                "caller_queue_s",
                "resident_queue_s",
                "cpu_experts_s",
                "merge_s",
                "admit_s",
            ]
            .iter()
            .map(|k| t[*k].as_f64().unwrap())
            .collect();
            assert!(phases.iter().all(|&p| p >= 0.0), "{t}");
            assert!(t["cpu_experts_s"].as_f64().unwrap() > 0.0, "{t}");
            let inside = t["queued_during_cpu_experts_s"].as_f64().unwrap();
            let queued =
                t["caller_queue_s"].as_f64().unwrap() + t["resident_queue_s"].as_f64().unwrap();
            assert!(inside >= 0.0, "{t}");
            assert!(inside <= queued * (1.0 + 1e-9), "{t}");
            assert!(inside <= t["cpu_experts_s"].as_f64().unwrap(), "{t}");
            let whole = run["moe_seconds_per_token"].as_f64().unwrap();
            assert!(
                phases.iter().sum::<f64>() - inside <= whole * (1.0 + 1e-9),
                "{t}"
            );
        }
    }
}
