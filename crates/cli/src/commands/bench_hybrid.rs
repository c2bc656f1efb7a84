//! `capy-flash bench hybrid`: Flash-Next's routed experts at full size behind a VRAM expert
//! cache sized from `--vram-budget`, misses on the CPU, Zipf-skewed routing; compared with
//! every routed expert on the CPU. See `capy_engine::hybrid::bench`.

use super::bench_gpu::parse_bytes;
use anyhow::{bail, Result};
use capy_engine::backend::cpu::experts::RowFormat;
use capy_engine::backend::cpu::CpuBackend;
use capy_engine::hybrid::bench::{run, HybridBenchOptions};
use serde_json::{json, Value};

/// Flash-Next's dense weights in BF16 (../shared/MODELS.md: ≈ 8.6 GB).
const DENSE_BYTES: u64 = 8_600_000_000;
/// KV per token with int8 KV (MODELS.md: ≈ 14.6 KB) and GDN state per sequence (≈ 113 MB).
const KV_BYTES_PER_TOKEN: u64 = 14_600;
const GDN_STATE_BYTES: u64 = 113_000_000;
/// Workspace and allocator slack kept free.
const RESERVE_BYTES: u64 = 1 << 30;

#[derive(clap::Args, Debug, Clone)]
pub struct BenchHybridArgs {
    /// Routed expert format (gate/up): nvfp4, iq3_s, iq3_xxs, iq2_xs, q2_0, q8_0, fp8, bf16.
    #[arg(long, default_value = "nvfp4")]
    pub format: String,
    /// Down-projection format (default: --format when its block divides 640, else q2_0).
    #[arg(long)]
    pub down_format: Option<String>,
    /// The card's VRAM budget; the expert cache gets what the dense weights, KV, states and
    /// reserve leave.
    #[arg(long, value_parser = parse_bytes, default_value = "15GiB")]
    pub vram_budget: u64,
    /// Context the KV share is sized for.
    #[arg(long, default_value_t = 8192)]
    pub context: u64,
    /// `cuda` (resident experts on GPU 0) or `cpu` (the CPU stand-in, for a machine without
    /// a GPU: both sides on the CPU).
    #[arg(long, default_value = "cuda")]
    pub backend: String,
    /// Simulated MoE layers (host RAM ≈ layers × 1.4 GB for NVFP4); figures scale to 48.
    #[arg(long, default_value_t = 12)]
    pub layers: usize,
    #[arg(long, default_value_t = 512)]
    pub experts: usize,
    #[arg(long, default_value_t = 10)]
    pub top_k: usize,
    #[arg(long, default_value_t = 2560)]
    pub hidden: usize,
    #[arg(long, default_value_t = 640)]
    pub intermediate: usize,
    /// Popularity exponent of the routing (∝ 1 / rank^s).
    #[arg(long, default_value_t = 1.0)]
    pub zipf: f64,
    /// Tokens routed before timing: the cache's scores decay with a 256-token half-life, so
    /// it reaches its steady state only after a few half-lives.
    #[arg(long, default_value_t = 768)]
    pub warmup_tokens: usize,
    #[arg(long, default_value_t = 64)]
    pub tokens: usize,
    /// CPU expert workers (0: one per physical core).
    #[arg(long, default_value_t = 0)]
    pub threads: usize,
    #[arg(long, default_value_t = 1)]
    pub seed: u64,
    /// Measure memory instead of speed: every layer's experts at full size in host RAM
    /// (page-locked as the loader does), the dense weights and the expert cache on the device;
    /// peak resident RAM against --promise and the RAM/VRAM ledgers against the OS and driver.
    #[arg(long)]
    pub footprint: bool,
    /// The configuration table's RAM promise for --footprint (default: 75GiB for nvfp4, the
    /// NVFP4 default build; 56GiB otherwise, the 64 GB edition's GSQ-RCO experts).
    #[arg(long, value_parser = parse_bytes)]
    pub promise: Option<u64>,
}

/// Flash-Next's MoE layers (MODELS.md; the MTP layer's experts are not loaded).
const MODEL_LAYERS: usize = 48;
/// The largest dense tensor: the BF16 embedding, 248320 × 2560.
const LARGEST_DENSE_TENSOR: u64 = 248_320 * 2560 * 2;

pub fn run_bench(a: BenchHybridArgs) -> Result<Value> {
    let format = RowFormat::parse(&a.format)?;
    let down_format = match &a.down_format {
        Some(f) => RowFormat::parse(f)?,
        None => capy_engine::hybrid::bench::default_down_format(format, a.intermediate)?,
    };
    let kv = a.context * KV_BYTES_PER_TOKEN;
    let fixed = DENSE_BYTES + kv + GDN_STATE_BYTES + RESERVE_BYTES;
    if a.vram_budget <= fixed {
        bail!(
            "--vram-budget {} B leaves nothing for experts: dense weights {DENSE_BYTES} B + KV {kv} B + GDN state {GDN_STATE_BYTES} B + reserve {RESERVE_BYTES} B = {fixed} B",
            a.vram_budget
        );
    }
    let cache_bytes = a.vram_budget - fixed;
    let ledger = json!({
        "vram_budget": a.vram_budget, "dense_weights": DENSE_BYTES, "kv": kv,
        "gdn_state": GDN_STATE_BYTES, "reserve": RESERVE_BYTES, "expert_cache": cache_bytes,
    });
    eprintln!("VRAM ledger (bytes): {ledger}");
    if a.footprint {
        return footprint(&a, format, down_format, cache_bytes, ledger);
    }
    let mut opts = HybridBenchOptions {
        format,
        down_format,
        layers: a.layers,
        model_layers: MODEL_LAYERS,
        experts: a.experts,
        top_k: a.top_k,
        hidden: a.hidden,
        intermediate: a.intermediate,
        cache_bytes,
        zipf_exponent: a.zipf,
        warmup_tokens: a.warmup_tokens,
        tokens: a.tokens,
        threads: a.threads,
        seed: a.seed,
        device_bandwidth: None,
        bandwidth_probe_bytes: 1 << 31,
    };
    let mut record = match a.backend.as_str() {
        "cpu" => run(&CpuBackend::new(), &opts)?,
        "cuda" => run_cuda(&mut opts)?,
        other => bail!("--backend {other:?}: expected cuda or cpu"),
    };
    record["vram_ledger"] = ledger;
    Ok(record)
}

fn run_cuda(opts: &mut HybridBenchOptions) -> Result<Value> {
    use capy_engine::backend::cuda::CudaBackend;
    let b = CudaBackend::new(0, None)?;
    // The 27B bench's convention: weight bytes ÷ device copy bandwidth (read + write).
    opts.device_bandwidth = Some(b.measure_copy_bandwidth(1 << 30, 20)?);
    run(&b, opts)
}

fn footprint(
    a: &BenchHybridArgs,
    format: RowFormat,
    down_format: RowFormat,
    cache_bytes: u64,
    ledger: Value,
) -> Result<Value> {
    use capy_engine::backend::cpu::experts::{ExpertLayout, ExpertShape};
    use capy_engine::hybrid::memory::{full_size_footprint, FootprintOptions};
    let promise = a.promise.unwrap_or(if format == RowFormat::Nvfp4 {
        75 << 30
    } else {
        56 << 30
    });
    let o = FootprintOptions {
        layout: ExpertLayout::new(
            format,
            down_format,
            ExpertShape {
                hidden: a.hidden,
                intermediate: a.intermediate,
            },
        )?,
        layers: a.layers,
        experts: a.experts,
        dense_bytes: DENSE_BYTES,
        largest_dense_tensor_bytes: LARGEST_DENSE_TENSOR,
        cache_bytes,
        promise_bytes: promise,
        seed: a.seed,
    };
    let mut record = match a.backend.as_str() {
        "cpu" => full_size_footprint(&CpuBackend::new(), &o, &|| None)?,
        "cuda" => {
            use capy_engine::backend::cuda::CudaBackend;
            let b = CudaBackend::new(0, Some(a.vram_budget))?;
            let used = || {
                let l = b.ledger();
                b.device_memory_used()
                    .ok()
                    .map(|d| (l.used + b.pooled_bytes(), d))
            };
            full_size_footprint(&b, &o, &used)?
        }
        other => bail!("--backend {other:?}: expected cuda or cpu"),
    };
    record["bench"] = json!("hybrid-footprint");
    record["backend"] = json!(a.backend);
    record["vram_budget"] = json!(a.vram_budget);
    record["vram_plan"] = ledger;
    if a.layers != MODEL_LAYERS || a.experts != 512 {
        record["note_scale"] = json!(format!(
            "{} layers × {} experts: not the full model ({MODEL_LAYERS} × 512), so the promise does not apply",
            a.layers, a.experts
        ));
    }
    Ok(record)
}
