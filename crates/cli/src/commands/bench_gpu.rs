//! `capy-flash bench gpu --synthetic qwen3.8-27b [--quant bf16|nvfp4|iq3_s|…]`: the full-size
//! model with random weights on one CUDA GPU; prefill and batch-1 decode at a long context,
//! each as a ratio to the ceilings (device copy bandwidth, BF16 GEMM rate) measured in the
//! same run. `--vram-budget 15GiB` caps what the engine allocates (a smaller card played on a
//! larger one); the run prints the VRAM plan first and is refused when it does not fit.

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
    /// Projection weights: bf16, or a block format kept quantized on the GPU (nvfp4, iq3_s,
    /// iq3_xxs, iq2_xs, q8_0, q2_0, fp8). For qwen3.8-flash-next the format of the routed
    /// experts (everything else stays BF16, as in the published NVFP4 build).
    #[arg(long, default_value = "bf16")]
    pub quant: String,
    /// Caps the bytes the engine allocates on the GPU: a byte count or a size such as 15GiB,
    /// 16GB, 512MiB.
    #[arg(long, value_parser = parse_bytes)]
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
    /// Tensor-parallel ranks, one GPU each (devices 0..N), each within --vram-budget.
    #[arg(long, default_value_t = 1)]
    pub tp: usize,
    /// With --tp: put every rank on --device (exercises and times the exchange on one card;
    /// the speed is not that of N cards).
    #[arg(long)]
    pub tp_on_one_gpu: bool,
}

/// `123`, `15GiB`, `16GB`, `1.5 GiB`, `512MiB`, `64k` (binary suffixes are powers of 1024,
/// decimal ones of 1000).
pub fn parse_bytes(s: &str) -> std::result::Result<u64, String> {
    let t = s.trim();
    let split = t
        .find(|c: char| !(c.is_ascii_digit() || c == '.'))
        .unwrap_or(t.len());
    let (num, unit) = (t[..split].trim(), t[split..].trim());
    let value: f64 = num.parse().map_err(|_| {
        format!("{s:?} is not a size; expected bytes or a size such as 15GiB or 16GB")
    })?;
    let mult: f64 = match unit.to_ascii_lowercase().as_str() {
        "" | "b" => 1.0,
        "k" | "kb" => 1e3,
        "m" | "mb" => 1e6,
        "g" | "gb" => 1e9,
        "t" | "tb" => 1e12,
        "kib" => 1024.0,
        "mib" => 1024f64.powi(2),
        "gib" => 1024f64.powi(3),
        "tib" => 1024f64.powi(4),
        other => {
            return Err(format!(
                "unknown size unit {other:?} in {s:?}; use B, KB, MB, GB, TB, KiB, MiB, GiB or TiB"
            ))
        }
    };
    Ok((value * mult).round() as u64)
}

/// Runs the benchmark and returns its JSON record (with the command line).
pub fn run(a: BenchGpuArgs) -> Result<Value> {
    let quant = match a.quant.to_ascii_lowercase().as_str() {
        "bf16" | "none" => None,
        other => Some(capy_engine::backend::cpu::experts::format::RowFormat::parse(other)?),
    };
    let opts = SyntheticBenchOptions {
        shape: a.synthetic.clone(),
        quant,
        device: a.device,
        vram_budget: a.vram_budget,
        context: a.context,
        decode_steps: a.decode_tokens,
        seed: a.seed,
        tp: a.tp,
        tp_on_one_gpu: a.tp_on_one_gpu,
    };
    if a.tp == 0 {
        anyhow::bail!("--tp must be at least 1");
    }
    if a.tp_on_one_gpu && a.tp == 1 {
        anyhow::bail!(
            "--tp-on-one-gpu places the ranks of --tp N on one card; give --tp 2 or more"
        );
    }
    let mut record = if a.synthetic == "qwen3.8-flash-next" {
        if a.tp > 1 {
            anyhow::bail!(
                "--tp {}: the GPU bench splits the dense synthetic shape (qwen3.8-27b) so far; Flash-Next over several cards runs with its experts in RAM (bench hybrid)",
                a.tp
            );
        }
        // Every routed expert on the GPU: with --quant all 512 a layer in that format, in BF16
        // 64 a layer (see the record's "shape_note").
        capy_engine::backend::cuda::flash_next::run_synthetic_flash_next(&opts)?
    } else if a.tp > 1 {
        capy_engine::parallel::bench::run_synthetic_tp(&opts)?
    } else {
        run_synthetic(&opts)?
    };
    record["command"] = std::env::args().collect::<Vec<_>>().join(" ").into();
    Ok(record)
}

#[cfg(test)]
mod tests {
    use super::parse_bytes;

    #[test]
    fn sizes_parse_with_binary_and_decimal_units() {
        assert_eq!(parse_bytes("15GiB").unwrap(), 15 << 30);
        assert_eq!(parse_bytes("16GB").unwrap(), 16_000_000_000);
        assert_eq!(parse_bytes("1.5 GiB").unwrap(), 3 << 29);
        assert_eq!(parse_bytes("4096").unwrap(), 4096);
        assert_eq!(parse_bytes("512mib").unwrap(), 512 << 20);
        let e = parse_bytes("15 parsecs").unwrap_err();
        assert!(e.contains("unknown size unit"), "{e}");
        assert!(parse_bytes("GiB").unwrap_err().contains("not a size"));
    }
}
