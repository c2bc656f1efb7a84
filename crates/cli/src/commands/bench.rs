//! `capy-flash bench`: benchmarks that report every figure as a ratio to a ceiling measured in
//! the same run, and write a JSON record for `bench/results/`.

use anyhow::{bail, Context, Result};
use capy_engine::backend::cpu::{roofline, CpuBackend};
use capy_engine::checkpoint::Checkpoint;
use capy_engine::model::{self, BatchItem, LogitsWanted};
use capy_engine::{demo, tensor::DType};
use serde_json::{json, Value};
use std::path::PathBuf;
use std::time::Instant;

#[derive(clap::Args)]
pub struct Args {
    #[command(subcommand)]
    pub kind: Kind,
    /// Also write the JSON record to this file.
    #[arg(long, global = true)]
    pub out: Option<PathBuf>,
}

#[derive(clap::Subcommand)]
pub enum Kind {
    /// Whole-model prefill and decode on the CPU backend.
    Cpu(CpuArgs),
    /// Routed-expert kernels on a full-size Flash-Next expert set.
    CpuExperts(super::bench_cpu_experts::BenchCpuExpertsArgs),
    /// Whole-model decode and prefill on a GPU with synthetic full-size weights.
    Gpu(super::bench_gpu::BenchGpuArgs),
    /// Flash-Next routed experts behind a VRAM expert cache, misses on the CPU.
    Hybrid(super::bench_hybrid::BenchHybridArgs),
    /// Time to first token and decode tokens/s through the HTTP server vs the engine alone.
    Http(super::bench_http::BenchHttpArgs),
    /// A 20-turn coding-agent session interleaved with a second one through the HTTP API:
    /// per-turn time to first token with the prefix cache on and off, resume from RAM/disk.
    AgentReplay(super::bench_agent_replay::BenchAgentReplayArgs),
}

#[derive(clap::Args)]
pub struct CpuArgs {
    /// Model folder, "demo" or "demo-moe"; conflicts with --synthetic.
    #[arg(long, conflicts_with = "synthetic")]
    pub model: Option<String>,
    /// A synthetic shape with random BF16 weights: "1b" (dense qwen3_5_text, hidden 2048,
    /// 16 layers, vocab 32768), "HIDDEN,LAYERS,VOCAB" (dense), or "moe-mid" (qwen4_exp_text,
    /// hidden 1024, 8 layers, 64 experts of width 256, top-8).
    #[arg(long)]
    pub synthetic: Option<String>,
    /// Prompt length for the prefill measurement.
    #[arg(long, default_value_t = 256)]
    pub prompt_tokens: usize,
    /// Decode steps timed after the prefill.
    #[arg(long, default_value_t = 32)]
    pub decode_tokens: usize,
    /// Tensor parallelism over N CPU rank threads (exchanging through the host mailbox).
    #[arg(long, default_value_t = 1)]
    pub tp: usize,
}

pub fn run(a: Args) -> Result<()> {
    let mut record = match a.kind {
        Kind::Cpu(c) => bench_cpu(c)?,
        Kind::CpuExperts(c) => super::bench_cpu_experts::run(c)?,
        Kind::Gpu(g) => super::bench_gpu::run(g)?,
        Kind::Hybrid(h) => super::bench_hybrid::run_bench(h)?,
        Kind::Http(h) => super::bench_http::run(h)?,
        Kind::AgentReplay(r) => super::bench_agent_replay::run(r)?,
    };
    // Every record says what produced it (the benches that set these themselves keep theirs).
    if let Some(obj) = record.as_object_mut() {
        obj.entry("command")
            .or_insert_with(|| std::env::args().collect::<Vec<_>>().join(" ").into());
        obj.entry("commit").or_insert_with(|| commit().into());
    }
    let text = serde_json::to_string_pretty(&record)?;
    println!("{text}");
    if let Some(path) = a.out {
        std::fs::write(&path, text + "\n")
            .with_context(|| format!("cannot write {}", path.display()))?;
    }
    Ok(())
}

/// The machine as benchmarks record it.
pub fn machine() -> Value {
    let cpuinfo = std::fs::read_to_string("/proc/cpuinfo").unwrap_or_default();
    let model = cpuinfo
        .lines()
        .find(|l| l.starts_with("model name"))
        .and_then(|l| l.split(':').nth(1))
        .unwrap_or("unknown")
        .trim()
        .to_string();
    json!({
        "cpu": model,
        "logical_cpus": std::thread::available_parallelism().map(|n| n.get()).unwrap_or(1),
        "threads": rayon::current_num_threads(),
        "isa": capy_engine::backend::cpu::simd::isa().name(),
        "os": std::env::consts::OS,
    })
}

/// The commit being measured: `CAPY_COMMIT`, else `git rev-parse HEAD`, else "unknown".
pub fn commit() -> String {
    std::env::var("CAPY_COMMIT").ok().unwrap_or_else(|| {
        std::process::Command::new("git")
            .args(["rev-parse", "HEAD"])
            .output()
            .ok()
            .filter(|o| o.status.success())
            .map(|o| String::from_utf8_lossy(&o.stdout).trim().to_string())
            .unwrap_or_else(|| "unknown".into())
    })
}

fn synthetic_dir(spec: &str) -> Result<PathBuf> {
    if spec == "moe-mid" {
        let dir = demo::cache_dir()?.join("synthetic-moe-mid-bf16-v1");
        if !dir.join("model.safetensors").exists() {
            eprintln!("generating synthetic checkpoint {} (once)…", dir.display());
            let tmp = dir.with_extension("partial");
            let _ = std::fs::remove_dir_all(&tmp);
            demo::write_random_checkpoint(
                &capy_engine::synthetic::config(spec)?,
                &tmp,
                DType::BF16,
                1,
            )?;
            std::fs::rename(&tmp, &dir)?;
        }
        return Ok(dir);
    }
    let (h, l, v) = match spec {
        "1b" => (2048, 16, 32768),
        other => {
            let parts: Vec<usize> = other
                .split(',')
                .map(|p| p.trim().parse())
                .collect::<Result<_, _>>()
                .with_context(|| {
                    format!("--synthetic \"{other}\": expected \"1b\", \"moe-mid\" or HIDDEN,LAYERS,VOCAB")
                })?;
            if parts.len() != 3 {
                bail!("--synthetic \"{other}\": expected three numbers HIDDEN,LAYERS,VOCAB");
            }
            (parts[0], parts[1], parts[2])
        }
    };
    let dir = demo::cache_dir()?.join(format!("synthetic-dense-{h}x{l}-v{v}-bf16"));
    if !dir.join("model.safetensors").exists() {
        eprintln!("generating synthetic checkpoint {} (once)…", dir.display());
        let tmp = dir.with_extension("partial");
        let _ = std::fs::remove_dir_all(&tmp);
        demo::write_random_checkpoint(
            &demo::synthetic_dense_config(h, l, v),
            &tmp,
            DType::BF16,
            1,
        )?;
        std::fs::rename(&tmp, &dir)?;
    }
    Ok(dir)
}

fn bench_cpu(a: CpuArgs) -> Result<Value> {
    let dir = match (&a.model, &a.synthetic) {
        (Some(m), _) if demo::is_demo_name(m) => demo::ensure_demo_model(m)?,
        (Some(m), _) => PathBuf::from(m),
        (None, Some(s)) => synthetic_dir(s)?,
        (None, None) => bail!("give --model DIR|demo|demo-moe or --synthetic 1b|moe-mid"),
    };
    if a.prompt_tokens == 0 || a.decode_tokens == 0 {
        bail!("--prompt-tokens and --decode-tokens must be positive");
    }
    let ck = Checkpoint::open(&dir)?;
    let mut lm = if a.tp == 1 {
        model::load(CpuBackend::new(), &ck)?
    } else {
        capy_engine::parallel::load_tp(&ck, a.tp, &capy_engine::parallel::TpDevices::Cpu)?
    };
    let info = lm.info().clone();
    let used = model::weight_use(&ck);
    let vocab = info.vocab_size as u32;
    let prompt: Vec<u32> = (0..a.prompt_tokens as u32)
        .map(|i| (i * 7919 + 13) % vocab)
        .collect();

    // Ceilings of this machine, measured now.
    let bandwidth = roofline::measure_read_bandwidth(1 << 30, 3);
    let fma_peak = roofline::measure_fma_peak();

    // Prefill: one pass over the prompt.
    let seq = lm.new_sequence();
    let t = Instant::now();
    let mut last = lm
        .forward(&[BatchItem {
            seq,
            tokens: &prompt,
            logits: LogitsWanted::Last,
        }])?
        .remove(0);
    let prefill_s = t.elapsed().as_secs_f64();
    // Decode: greedy steps after the prompt.
    let t = Instant::now();
    for _ in 0..a.decode_tokens {
        let next = last
            .iter()
            .enumerate()
            .fold(
                (0, f32::NEG_INFINITY),
                |m, (i, &v)| if v > m.1 { (i, v) } else { m },
            )
            .0 as u32;
        last = lm
            .forward(&[BatchItem {
                seq,
                tokens: &[next],
                logits: LogitsWanted::Last,
            }])?
            .remove(0);
    }
    let decode_s = t.elapsed().as_secs_f64();

    let prefill_tps = a.prompt_tokens as f64 / prefill_s;
    let decode_tps = a.decode_tokens as f64 / decode_s;
    // A decode step reads every dense weight once, one embedding row, the n-gram rows it
    // gathers and only the top-k routed experts (the ACTIVE weights); each active matrix
    // weight costs 2 FLOPs per token.
    let bytes_per_token = used.active_bytes;
    let flops_per_token = 2.0 * used.active_matmul_parameters;
    Ok(json!({
        "bench": "cpu",
        "command": std::env::args().collect::<Vec<_>>().join(" "),
        "commit": commit(),
        "machine": machine(),
        "model": {"path": dir.display().to_string(), "architecture": info.architecture, "parameters": info.parameters,
                  "weight_bytes": info.weight_bytes, "active_parameters_per_token": used.active_parameters,
                  "backend": info.backend},
        "ceilings": {"ram_read_bytes_per_s": bandwidth, "fma_flops_per_s": fma_peak},
        "prefill": {"tokens": a.prompt_tokens, "seconds": prefill_s, "tokens_per_s": prefill_tps,
                     "flops_per_token": flops_per_token, "flops_ratio": prefill_tps * flops_per_token / fma_peak},
        "decode": {"context": a.prompt_tokens, "tokens": a.decode_tokens, "seconds": decode_s, "tokens_per_s": decode_tps,
                    "weight_bytes_per_token": bytes_per_token,
                    "bandwidth_ratio": decode_tps * bytes_per_token / bandwidth},
    }))
}
