//! `capy-flash bench gpu --tp N`: the synthetic 27B split over N CUDA ranks (one card each,
//! or all on one card with `--tp-on-one-gpu` to exercise the exchange), each card within its
//! own `--vram-budget`. Reports prefill and batch-1 decode with the ratio to the slowest card's
//! bandwidth roofline, each rank's VRAM plan and ledger, and the exchange's cost per layer
//! (the startup probe's time per all-reduce of one hidden-size row, two per layer) with its
//! share of a decode step. Compare with `bench gpu` at TP=1 (same shape and budget).

use crate::backend::cuda::bench::{
    argmax, gib, greedy_steps, median, plan_vram_rank, timed_prefill, SyntheticBenchOptions,
    VramPlan,
};
use crate::backend::cuda::CudaBackend;
use crate::config::{Architecture, TextConfig};
use crate::model::{BatchItem, LogitsWanted};
use anyhow::{bail, Context, Result};
use serde_json::{json, Value};
use std::time::Instant;

/// Runs the TP benchmark and returns its JSON record.
pub fn run_synthetic_tp(opts: &SyntheticBenchOptions) -> Result<Value> {
    let ranks = opts.tp;
    let cfg = TextConfig::from_value(&crate::synthetic::config(&opts.shape)?)?;
    if cfg.architecture != Architecture::Qwen3_5Text {
        bail!(
            "bench gpu --tp runs the dense synthetic shape (qwen3.8-27b); for Flash-Next over several cards use bench hybrid"
        );
    }
    // Warm-up (2 steps), the timed steps.
    let decode_total = opts.decode_steps + 2;
    let plans = (0..ranks)
        .map(|r| plan_vram_rank(&cfg, opts.quant, opts.context, decode_total, ranks, r))
        .collect::<Result<Vec<VramPlan>>>()?;
    for (r, p) in plans.iter().enumerate() {
        eprintln!(
            "VRAM plan of rank {r} of {ranks}: weights {}, KV {}, states {}, workspace {}, reserve {} = {}{}",
            gib(p.weights),
            gib(p.kv),
            gib(p.states),
            gib(p.workspace),
            gib(p.reserve),
            gib(p.total()),
            opts.vram_budget.map_or(String::new(), |b| format!(" of a {} budget per card", gib(b)))
        );
        if let Some(budget) = opts.vram_budget {
            if p.total() > budget && !opts.tp_on_one_gpu {
                bail!(
                    "rank {r} of --tp {ranks} does not fit its card's VRAM budget: it needs {} bytes ({}) and the budget is {budget} bytes ({}). \
                     Use a smaller quantization, a shorter --context, more ranks, or a larger --vram-budget",
                    p.total(),
                    gib(p.total()),
                    gib(budget)
                );
            }
        }
    }
    let devices: Vec<usize> = if opts.tp_on_one_gpu {
        vec![opts.device; ranks]
    } else {
        super::cuda::check_gpus(ranks, super::cuda::gpu_count()?)?;
        (0..ranks).collect()
    };
    // On one card the ranks share it, so its budget is theirs together.
    let budget = match (opts.vram_budget, opts.tp_on_one_gpu) {
        (Some(b), true) => Some(b * ranks as u64),
        (b, _) => b,
    };
    let backends = devices
        .iter()
        .enumerate()
        .map(|(r, &d)| {
            CudaBackend::new(d, budget).with_context(|| format!("opening GPU {d} for rank {r}"))
        })
        .collect::<Result<Vec<_>>>()?;
    let info = backends[0].device_info().clone();
    let copy_bw = backends[0].measure_copy_bandwidth(2 << 30, 10)?;

    let t0 = Instant::now();
    let ck = crate::synthetic::checkpoint(&opts.shape, opts.seed)?;
    let (exchanges, probe) =
        super::cuda::exchanges(&backends, cfg.hidden_size, super::exchange::DEFAULT_TIMEOUT)?;
    eprintln!("tensor-parallel exchange: {}", probe.note);
    for b in &backends {
        b.set_synthetic_quant(opts.quant);
    }
    let loaded = super::load_with(backends.clone(), exchanges, &ck);
    for b in &backends {
        b.set_synthetic_quant(None);
    }
    let mut model = loaded.context("building the synthetic model over the ranks")?;
    drop(ck);
    for b in &backends {
        b.synchronize()?;
    }
    let load_s = t0.elapsed().as_secs_f64();
    let ledgers: Vec<_> = backends.iter().map(|b| b.ledger()).collect();

    let mut rng = opts.seed | 1;
    let vocab = cfg.vocab_size as u64;
    let mut token = || {
        rng ^= rng << 13;
        rng ^= rng >> 7;
        rng ^= rng << 17;
        (rng % vocab) as u32
    };
    {
        let s = model.new_sequence();
        let warm: Vec<u32> = (0..256).map(|_| token()).collect();
        let out = model.forward(&[BatchItem {
            seq: s,
            tokens: &warm,
            logits: LogitsWanted::Last,
        }])?;
        let mut next = argmax(&out[0]);
        greedy_steps(model.as_mut(), s, &mut next, 2)?;
        model.drop_sequence(s);
    }
    let seq = model.new_sequence();
    let prompt: Vec<u32> = (0..opts.context).map(|_| token()).collect();
    let (logits, prefill_s) = timed_prefill(model.as_mut(), seq, &prompt)?;
    let mut next = argmax(&logits[0]);
    greedy_steps(model.as_mut(), seq, &mut next, 2)?;
    let (mut step_s, decode_total_s) =
        greedy_steps(model.as_mut(), seq, &mut next, opts.decode_steps)?;
    let median_step_ms = median(&mut step_s) * 1e3;
    let decode_tok_s = opts.decode_steps as f64 / decode_total_s;

    // Each step reads every rank's weights but its embedding table (one row is gathered).
    let embed_bytes = (cfg.vocab_size * cfg.hidden_size * 2) as u64;
    let rank_bytes: Vec<u64> = ledgers.iter().map(|l| l.weights - embed_bytes).collect();
    // Separate cards stream their shards at once; ranks sharing one card take turns.
    let roofline_bytes = if opts.tp_on_one_gpu {
        rank_bytes.iter().sum::<u64>()
    } else {
        rank_bytes.iter().copied().max().unwrap_or(0)
    };
    let roof_tok_s = copy_bw / roofline_bytes as f64;
    let exchanges_per_token = 2 * cfg.num_hidden_layers;
    let chosen_us = match probe.kind {
        super::cuda::ExchangeKind::Mapped => probe.mapped_us,
        super::cuda::ExchangeKind::Staged => probe.staged_us,
    };
    let exchange_ms_per_token = chosen_us.map(|us| us * exchanges_per_token as f64 / 1e3);
    let quant_name = opts.quant.map_or("bf16".to_string(), |f| f.name());
    Ok(json!({
        "benchmark": "synthetic-tp",
        "shape": opts.shape,
        "weights": quant_name,
        "tp": ranks,
        "tp_on_one_gpu": opts.tp_on_one_gpu,
        "devices": devices,
        "machine": {
            "gpu": info.name,
            "compute_capability": format!("sm_{}{}", info.compute_capability.0, info.compute_capability.1),
            "host_threads": std::thread::available_parallelism().map(|n| n.get()).unwrap_or(1),
        },
        "ceilings": {
            "device_copy_bytes_per_s": copy_bw,
            "device_copy_note": "cuMemcpyDtoD of 2 GiB on rank 0's card, bytes read + written, 10 repetitions",
        },
        "vram_budget_per_card": opts.vram_budget,
        "vram_plans": plans,
        "vram_ledgers": ledgers,
        "load_seconds": load_s,
        "exchange": {
            "probe": probe,
            "exchanges_per_token": exchanges_per_token,
            "exchange_us_per_layer": chosen_us.map(|us| 2.0 * us),
            "exchange_ms_per_token": exchange_ms_per_token,
            "exchange_share_of_decode_step_ratio": exchange_ms_per_token.map(|ms| ms / median_step_ms),
        },
        "prefill": {
            "tokens": opts.context,
            "seconds": prefill_s,
            "tokens_per_s": opts.context as f64 / prefill_s,
        },
        "decode": {
            "batch": 1,
            "context_start": opts.context,
            "steps": opts.decode_steps,
            "tokens_per_s": decode_tok_s,
            "median_step_ms": median_step_ms,
            "weight_bytes_per_token_per_rank": rank_bytes,
            "roofline_tokens_per_s": roof_tok_s,
            "bandwidth_roofline_ratio": decode_tok_s / roof_tok_s,
        },
    }))
}
