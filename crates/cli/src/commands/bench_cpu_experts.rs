//! `capy-flash bench cpu-experts`: read bandwidth of this machine, then the CPU expert
//! kernels on a full-size Flash-Next expert set (random valid blocks, random top-k routing);
//! prints a JSON report. Needs nothing but the binary.

use anyhow::Result;
use capy_engine::backend::cpu::experts::bench::{self, BenchParams};
use capy_engine::backend::cpu::experts::RowFormat;
use capy_engine::backend::cpu::simd::Isa;

#[derive(clap::Args, Debug, Clone)]
pub struct BenchCpuExpertsArgs {
    /// Weight format: nvfp4, fp8, iq3_s, iq3_xxs, iq2_xs, q2_0, q8_0, f16, bf16, f32.
    #[arg(long, default_value = "nvfp4")]
    pub format: String,
    /// Format of the down rows (default: --format when its block divides --intermediate, else q2_0).
    #[arg(long)]
    pub down_format: Option<String>,
    /// Worker threads, pinned to physical cores (0: one per physical core).
    #[arg(long, default_value_t = 0)]
    pub threads: usize,
    /// Tokens per call.
    #[arg(long, default_value_t = 1)]
    pub batch: usize,
    #[arg(long, default_value_t = 512)]
    pub experts: usize,
    #[arg(long, default_value_t = 10)]
    pub top_k: usize,
    #[arg(long, default_value_t = 2560)]
    pub hidden: usize,
    #[arg(long, default_value_t = 640)]
    pub intermediate: usize,
    /// Timed calls (after two warm-up calls).
    #[arg(long, default_value_t = 50)]
    pub iters: usize,
    /// Size of the bandwidth-test buffer in MiB (keep it far above the last-level cache).
    #[arg(long, default_value_t = 2048)]
    pub bandwidth_mib: usize,
    /// Random seed for weights and routing.
    #[arg(long, default_value_t = 1)]
    pub seed: u64,
}

/// Runs the bench (ISA: the detected one, or `CAPY_CPU_ISA=scalar|avx2|avx512`; math path:
/// fast, or exact with `CAPY_EXACT_MATH=1`).
pub fn run(args: BenchCpuExpertsArgs) -> Result<serde_json::Value> {
    let params = BenchParams {
        format: RowFormat::parse(&args.format)?,
        down_format: args
            .down_format
            .as_deref()
            .map(RowFormat::parse)
            .transpose()?,
        threads: args.threads,
        batch: args.batch,
        experts: args.experts,
        top_k: args.top_k,
        hidden: args.hidden,
        intermediate: args.intermediate,
        iters: args.iters,
        isa: Isa::detect(),
        path: capy_engine::backend::cpu::experts::fused::math_path(),
        bandwidth_mib: args.bandwidth_mib,
        seed: args.seed,
    };
    bench::run(&params)
}
