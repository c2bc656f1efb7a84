//! The synthetic full-size benchmark on the GPU (ignored by default: it needs an H200-class
//! GPU and minutes). Run it with
//! `CAPY_BENCH_OUT=bench/results/gpu-qwen3.8-27b-bf16.json cargo test -p capy-engine --release --test cuda_bench -- --ignored --nocapture`
//! (optional: `CAPY_BENCH_QUANT` (bf16, nvfp4, iq3_s, …), `CAPY_BENCH_VRAM_BUDGET` (bytes),
//! `CAPY_BENCH_CONTEXT`, `CAPY_BENCH_DECODE_STEPS`, `CAPY_BENCH_COMMAND`, `CAPY_COMMIT`).
#![cfg(feature = "cuda")]

use capy_engine::backend::cuda::bench::{run_synthetic, SyntheticBenchOptions};

fn env_usize(name: &str, default: usize) -> usize {
    std::env::var(name)
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

#[test]
#[ignore = "full-size GPU benchmark; run with --ignored on a GPU machine"]
fn synthetic_qwen3_8_27b() {
    if let Err(e) = capy_engine::backend::cuda::driver_version() {
        println!("skipping: {e:#}");
        return;
    }
    let quant = match std::env::var("CAPY_BENCH_QUANT").as_deref() {
        Err(_) | Ok("bf16") => None,
        Ok(other) => Some(
            capy_engine::backend::cpu::experts::format::RowFormat::parse(other)
                .unwrap_or_else(|e| panic!("{e:#}")),
        ),
    };
    let opts = SyntheticBenchOptions {
        shape: "qwen3.8-27b".into(),
        quant,
        device: 0,
        vram_budget: std::env::var("CAPY_BENCH_VRAM_BUDGET")
            .ok()
            .and_then(|v| v.parse().ok()),
        context: env_usize("CAPY_BENCH_CONTEXT", 8192),
        decode_steps: env_usize("CAPY_BENCH_DECODE_STEPS", 32),
        seed: 1,
        tp: 1,
        tp_on_one_gpu: false,
    };
    let mut report = run_synthetic(&opts).unwrap_or_else(|e| panic!("{e:#}"));
    report["command"] = std::env::var("CAPY_BENCH_COMMAND")
        .unwrap_or_else(|_| "cargo test -p capy-engine --test cuda_bench -- --ignored".into())
        .into();
    report["commit"] = std::env::var("CAPY_COMMIT")
        .unwrap_or_else(|_| "unknown".into())
        .into();
    let text = serde_json::to_string_pretty(&report).unwrap();
    println!("{text}");
    if let Ok(path) = std::env::var("CAPY_BENCH_OUT") {
        std::fs::write(&path, text + "\n").unwrap_or_else(|e| panic!("cannot write {path}: {e}"));
    }
}
