//! `capy-flash bench gpu --synthetic qwen3.8-27b`: the full-size model with random BF16
//! weights on one CUDA GPU; prefill and batch-1 decode at a long context, each as a ratio to
//! the ceilings (device copy bandwidth, BF16 GEMM rate) measured in the same run.

use anyhow::Result;
use capy_engine::backend::cuda::bench::{run_synthetic, SyntheticBenchOptions};
use serde_json::Value;

#[derive(clap::Args, Debug, Clone)]
pub struct BenchGpuArgs {
    /// Synthetic shape with random weights of the real configuration.
    #[arg(long, default_value = "qwen3.8-27b")]
    pub synthetic: String,
    /// CUDA device index.
    #[arg(long, default_value_t = 0)]
    pub device: usize,
    /// Caps the bytes the engine allocates on the GPU.
    #[arg(long)]
    pub vram_budget: Option<u64>,
    /// Prompt tokens prefilled (timed) before decoding; the decode context.
    #[arg(long, default_value_t = 8192)]
    pub context: usize,
    /// Decode steps timed after the prefill.
    #[arg(long, default_value_t = 32)]
    pub decode_tokens: usize,
    /// Seed of the random weights and tokens.
    #[arg(long, default_value_t = 1)]
    pub seed: u64,
}

/// Runs the benchmark and returns its JSON record (with the command line).
pub fn run(a: BenchGpuArgs) -> Result<Value> {
    let opts = SyntheticBenchOptions {
        shape: a.synthetic.clone(),
        device: a.device,
        vram_budget: a.vram_budget,
        context: a.context,
        decode_steps: a.decode_tokens,
        seed: a.seed,
    };
    let mut record = run_synthetic(&opts)?;
    record["command"] = std::env::args().collect::<Vec<_>>().join(" ").into();
    Ok(record)
}
