//! Benchmarks on the CUDA backend: device ceilings measured in-process (copy bandwidth, BF16
//! GEMM rate) and a synthetic full-size model run whose figures are reported as ratios to
//! those ceilings.

use super::{CudaBackend, DevBuf};
use crate::backend::cpu::experts::format::RowFormat;
use crate::config::{LayerType, TextConfig};
use crate::model::{qwen3_5_text::Qwen3_5Text, BatchItem, CausalLm, LogitsWanted};
use anyhow::{Context, Result};
use cudarc::cublas::sys as blas_sys;
use cudarc::driver::{result as drv, sys as drv_sys};
use serde_json::{json, Value};
use std::time::Instant;

impl CudaBackend {
    /// Milliseconds of GPU time `work` queues, between two events on the stream.
    /// The work runs directly (no graph recording: an event cannot be recorded into one and
    /// waited on from the host).
    pub fn time_ms(&self, work: impl FnOnce()) -> Result<f32> {
        self.bind();
        let graphs = self.cuda_graphs();
        self.set_cuda_graphs(false)?;
        let ms = self.time_ms_direct(work);
        self.set_cuda_graphs(graphs)?;
        ms
    }

    fn time_ms_direct(&self, work: impl FnOnce()) -> Result<f32> {
        let start = drv::event::create(drv_sys::CUevent_flags::CU_EVENT_DEFAULT)
            .map_err(|e| anyhow::anyhow!("{e}"))?;
        let end = drv::event::create(drv_sys::CUevent_flags::CU_EVENT_DEFAULT)
            .map_err(|e| anyhow::anyhow!("{e}"))?;
        // SAFETY: events and stream are live; destroyed below.
        unsafe {
            drv::event::record(start, self.stream()).map_err(|e| anyhow::anyhow!("{e}"))?;
            work();
            drv::event::record(end, self.stream()).map_err(|e| anyhow::anyhow!("{e}"))?;
            drv::event::synchronize(end).map_err(|e| anyhow::anyhow!("CUDA work failed: {e}"))?;
            let ms = drv::event::elapsed(start, end).map_err(|e| anyhow::anyhow!("{e}"))?;
            let _ = drv::event::destroy(start);
            let _ = drv::event::destroy(end);
            Ok(ms)
        }
    }

    fn random_bf16(&self, len: usize, seed: u64) -> Result<DevBuf> {
        let mut s = seed | 1;
        let host: Vec<u16> = (0..len)
            .map(|_| {
                s ^= s << 13;
                s ^= s >> 7;
                s ^= s << 17;
                half::bf16::from_f32(((s >> 40) as f32 / (1u64 << 24) as f32) * 2.0 - 1.0).to_bits()
            })
            .collect();
        let buf = self.try_alloc(len * 2, "benchmark matrix", false)?;
        // SAFETY: the buffer holds exactly these bytes.
        unsafe { drv::memcpy_htod_async(buf.ptr, &host, self.stream()) }
            .map_err(|e| anyhow::anyhow!("{e}"))?;
        self.synchronize()?;
        Ok(buf)
    }

    /// Device-to-device copy bandwidth in bytes/s, counting bytes read and written (the
    /// convention of the DESIGN.md ceilings), over a `bytes`-sized buffer.
    pub fn measure_copy_bandwidth(&self, bytes: usize, reps: usize) -> Result<f64> {
        let src = self.try_alloc(bytes, "bandwidth probe", false)?;
        let dst = self.try_alloc(bytes, "bandwidth probe", false)?;
        for _ in 0..2 {
            self.copy_dtod(dst.ptr, src.ptr, bytes);
        }
        let ms = self.time_ms(|| {
            for _ in 0..reps {
                self.copy_dtod(dst.ptr, src.ptr, bytes);
            }
        })?;
        Ok(2.0 * bytes as f64 * reps as f64 / (ms as f64 / 1e3))
    }

    /// BF16 × BF16 → F32 GEMM rate (f32 accumulation, the prefill path's configuration) in FLOP/s
    /// on random `n × n × n` operands.
    pub fn measure_bf16_gemm_rate(&self, n: usize, reps: usize) -> Result<f64> {
        let a = self.random_bf16(n * n, 1)?;
        let b = self.random_bf16(n * n, 2)?;
        let c = self.try_alloc(n * n * 4, "benchmark output", false)?;
        let bf = blas_sys::cudaDataType::CUDA_R_16BF;
        let run = || {
            self.gemm(
                true,
                false,
                n,
                n,
                n,
                1.0,
                (a.ptr, bf, n),
                (b.ptr, bf, n),
                (c.ptr, n),
                blas_sys::cublasComputeType_t::CUBLAS_COMPUTE_32F,
            )
        };
        for _ in 0..3 {
            run();
        }
        let ms = self.time_ms(|| {
            for _ in 0..reps {
                run();
            }
        })?;
        Ok(2.0 * (n as f64).powi(3) * reps as f64 / (ms as f64 / 1e3))
    }
}

/// GPU time of the ops that dominate a long prefill and a decode step, each alone at the real
/// shapes, so a report says where the time goes.
fn op_timings(
    b: &CudaBackend,
    c: &crate::config::TextConfig,
    n: usize,
    quant: Option<RowFormat>,
) -> Result<Value> {
    use crate::backend::{AttentionShape, Backend, DeltaRuleMode, DeltaRuleShape};
    use crate::tensor::{Bytes, DType, HostTensor};
    let h = c.hidden_size;
    let gate_up = 2 * c.intermediate_size;
    let w = HostTensor {
        name: "gate_up".into(),
        dtype: DType::BF16,
        shape: vec![gate_up, h],
        data: Bytes::from_vec(vec![0x3c; gate_up * h * 2]),
    };
    b.set_synthetic_quant(quant);
    let w = b.matrix(&w);
    b.set_synthetic_quant(None);
    let w = w?;
    let w_bytes = w.bytes();
    let x = b.zeros(n, h);
    let x1 = b.zeros(1, h);
    let _ = b.linear(&x, &w);
    let _ = b.linear(&x1, &w);
    let gemm_ms = b.time_ms(|| drop(b.linear(&x, &w)))?;
    let matvec_ms = b.time_ms(|| {
        for _ in 0..10 {
            drop(b.linear(&x1, &w));
        }
    })? / 10.0;
    let s = DeltaRuleShape {
        num_k_heads: c.linear_num_key_heads,
        num_v_heads: c.linear_num_value_heads,
        k_head_dim: c.linear_key_head_dim,
        v_head_dim: c.linear_value_head_dim,
    };
    let kd = s.num_k_heads * s.k_head_dim;
    let vd = s.num_v_heads * s.v_head_dim;
    let (q, k, v) = (b.zeros(n, kd), b.zeros(n, kd), b.zeros(n, vd));
    let (g, beta) = (b.zeros(n, s.num_v_heads), b.zeros(n, s.num_v_heads));
    let mut state = b.zeros(s.num_v_heads * s.k_head_dim, s.v_head_dim);
    let gdn_ms = b.time_ms(|| {
        drop(b.gated_delta_rule(&q, &k, &v, &g, &beta, &mut state, s, DeltaRuleMode::Chunked))
    })?;
    let (q1, k1, v1) = (b.zeros(1, kd), b.zeros(1, kd), b.zeros(1, vd));
    let (g1, beta1) = (b.zeros(1, s.num_v_heads), b.zeros(1, s.num_v_heads));
    let gdn_decode_ms = b.time_ms(|| {
        for _ in 0..10 {
            drop(b.gated_delta_rule(
                &q1,
                &k1,
                &v1,
                &g1,
                &beta1,
                &mut state,
                s,
                DeltaRuleMode::Recurrent,
            ))
        }
    })? / 10.0;
    let conv_dim = c.linear_conv_dim();
    let conv_w = HostTensor {
        name: "conv".into(),
        dtype: DType::BF16,
        shape: vec![conv_dim, c.linear_conv_kernel_dim],
        data: Bytes::from_vec(vec![0; conv_dim * c.linear_conv_kernel_dim * 2]),
    };
    let conv_w = b.matrix(&conv_w)?;
    let xc = b.zeros(n, conv_dim);
    let mut conv_state = b.zeros(c.linear_conv_kernel_dim - 1, conv_dim);
    let conv_ms = b.time_ms(|| drop(b.causal_conv1d_silu(&xc, &mut conv_state, &conv_w)))?;
    let xc1 = b.zeros(1, conv_dim);
    let conv_decode_ms = b.time_ms(|| {
        for _ in 0..10 {
            drop(b.causal_conv1d_silu(&xc1, &mut conv_state, &conv_w))
        }
    })? / 10.0;
    let a = AttentionShape {
        num_heads: c.num_attention_heads,
        num_kv_heads: c.num_key_value_heads,
        head_dim: c.head_dim,
        scale: (c.head_dim as f32).powf(-0.5),
    };
    let qa = b.zeros(n, a.num_heads * a.head_dim);
    let kv = b.zeros(n, a.num_kv_heads * a.head_dim);
    let attn_ms = b.time_ms(|| drop(b.attention(&qa, &kv, &kv, 0, a)))?;
    let q1 = b.zeros(1, a.num_heads * a.head_dim);
    let kv1 = b.zeros(n + 1, a.num_kv_heads * a.head_dim);
    let attn_decode_ms = b.time_ms(|| drop(b.attention(&q1, &kv1, &kv1, n, a)))?;
    // A 512-token prefill chunk (the scheduler's default) deep into a conversation, as an
    // agent's turn prefills its new tool result: the cost that grows with the context.
    let chunk = 512;
    let mut at_depth = Vec::new();
    for past in [0usize, 8192, 28_000] {
        let qc = b.zeros(chunk, a.num_heads * a.head_dim);
        let kvc = b.zeros(past + chunk, a.num_kv_heads * a.head_dim);
        let _ = b.attention(&qc, &kvc, &kvc, past, a);
        let ms = b.time_ms(|| drop(b.attention(&qc, &kvc, &kvc, past, a)))?;
        // QKᵀ and PV: 2 FLOPs per multiply-add, query i sees past + i + 1 keys.
        let pairs = (chunk * past + chunk * (chunk + 1) / 2) as f64;
        let flop = 4.0 * (a.num_heads * a.head_dim) as f64 * pairs;
        at_depth.push(json!({"past": past, "queries": chunk, "ms": ms,
                             "tflop_per_s": flop / (ms as f64 / 1e3) / 1e12}));
    }
    // The ways of cutting that chunk up (heads per batched GEMM, scores workspace), the data
    // behind `AttentionGemmPlan::choose`.
    let mut plans = Vec::new();
    for (past, queries) in [(8192usize, 512usize), (28_000, 512), (28_000, 1424)] {
        let qc = b.zeros(queries, a.num_heads * a.head_dim);
        let kvc = b.zeros(past + queries, a.num_kv_heads * a.head_dim);
        let pairs = (queries * past + queries * (queries + 1) / 2) as f64;
        let flop = 4.0 * (a.num_heads * a.head_dim) as f64 * pairs;
        let chosen = super::AttentionGemmPlan::choose(queries, past + queries, a);
        for heads_per_call in [1usize, 2, 3, 6] {
            for scratch_elems in [16usize << 20, 64 << 20] {
                let plan = super::AttentionGemmPlan {
                    heads_per_call,
                    scratch_elems,
                };
                let _ = b.attention_with_plan(&qc, &kvc, &kvc, past, a, plan);
                let ms =
                    b.time_ms(|| drop(b.attention_with_plan(&qc, &kvc, &kvc, past, a, plan)))?;
                plans.push(
                    json!({"past": past, "queries": queries, "heads_per_call": heads_per_call,
                                  "scratch_mib": (scratch_elems * 4) >> 20, "ms": ms,
                                  "tflop_per_s": flop / (ms as f64 / 1e3) / 1e12,
                                  "default": plan == chosen}),
                );
            }
        }
    }
    let gflop = 2.0 * (n * h * gate_up) as f64 / 1e9;
    Ok(json!({
        "attention_plans_at_depth": plans,
        "attention_prefill_chunk_at_depth": at_depth,
        "tokens": n,
        "gate_up_gemm_ms": gemm_ms,
        "gate_up_gemm_tflop_per_s": gflop / gemm_ms as f64,
        "gate_up_matvec_ms": matvec_ms,
        "gate_up_matvec_bytes_per_s": w_bytes as f64 / (matvec_ms as f64 / 1e3),
        "gated_delta_rule_prefill_ms": gdn_ms,
        "gated_delta_rule_decode_ms": gdn_decode_ms,
        "causal_conv_prefill_ms": conv_ms,
        "causal_conv_decode_ms": conv_decode_ms,
        "attention_prefill_ms": attn_ms,
        "attention_decode_ms": attn_decode_ms,
    }))
}

/// What to run.
#[derive(Debug, Clone)]
pub struct SyntheticBenchOptions {
    pub shape: String,
    /// Projection weights: `None` = BF16, else random blocks of this format kept quantized.
    pub quant: Option<RowFormat>,
    pub device: usize,
    pub vram_budget: Option<u64>,
    /// Prompt tokens prefilled (and timed) before decoding.
    pub context: usize,
    pub decode_steps: usize,
    pub seed: u64,
    /// Tensor-parallel ranks (`--tp`; 1: one card, [`run_synthetic`]).
    pub tp: usize,
    /// All ranks on `device` (tests the exchange; the speed is not that of `tp` cards).
    pub tp_on_one_gpu: bool,
}

/// Where the bytes of a synthetic run will go, computed from the configuration before
/// anything is loaded (the run is refused when it exceeds the budget).
#[derive(Debug, Clone, Copy, serde::Serialize)]
pub struct VramPlan {
    pub weights: u64,
    /// KV cache (f32 K and V of every attention layer) at the capacity it grows to.
    pub kv: u64,
    /// GDN recurrent and conv states.
    pub states: u64,
    /// Activations and scratch of the longest prefill step.
    pub workspace: u64,
    /// Held back for what the ledger does not see: fragmentation of the stream-ordered pool.
    pub reserve: u64,
}

impl VramPlan {
    pub fn total(&self) -> u64 {
        self.weights + self.kv + self.states + self.workspace + self.reserve
    }
}

/// Rows a cache holds after `tokens` appended in the given steps (capacity doubles as
/// `append_rows` grows it).
fn cache_capacity(steps: &[usize]) -> usize {
    let (mut rows, mut cap) = (0usize, 0usize);
    for &s in steps {
        if rows + s > cap {
            cap = (rows + s).max(cap * 2).max(16);
        }
        rows += s;
    }
    cap
}

/// The plan of `--synthetic` with `context` prefilled tokens and `decode` steps.
pub fn plan_vram(
    c: &TextConfig,
    quant: Option<RowFormat>,
    context: usize,
    decode: usize,
) -> Result<VramPlan> {
    plan_vram_rank(c, quant, context, decode, 1, 0)
}

/// The plan of rank `rank` of `--tp ranks`: its shard of every layer matrix (the cuts of
/// parallel/shard.rs), its rows of the head, the whole embedding and the norms; KV, states
/// and workspace at its shard's head counts and MLP width.
pub fn plan_vram_rank(
    c: &TextConfig,
    quant: Option<RowFormat>,
    context: usize,
    decode: usize,
    ranks: usize,
    rank: usize,
) -> Result<VramPlan> {
    let shards = crate::parallel::shard::plan(c, ranks)?;
    let Some(shard) = shards.get(rank) else {
        anyhow::bail!("rank {rank} does not exist in --tp {ranks}");
    };
    let matrix = |name: &str, rows: usize, cols: usize| -> Result<u64> {
        Ok(match quant {
            Some(f) if CudaBackend::synthetic_quant_applies(f, name, cols) => {
                (rows * f.row_bytes(cols)?) as u64
            }
            _ => (rows * cols * 2) as u64,
        })
    };
    let mut weights = 0u64;
    let mut has_head = false;
    for (name, shape) in crate::synthetic::tensors(c)? {
        let shape = if name.contains("layers.") {
            shard
                .cut(&name, c)
                .map_or(shape.clone(), |cut| cut.shape(&shape))
        } else if name == "lm_head.weight" {
            has_head = true;
            vec![shard.vocab.len(), shape[1]]
        } else {
            shape
        };
        weights += match shape.as_slice() {
            [rows, cols] => matrix(&name, *rows, *cols)?,
            // Vectors (norm weights, per-head constants) are uploaded as f32.
            dims => (dims.iter().product::<usize>() * 4) as u64,
        };
    }
    if !has_head && ranks > 1 {
        // Tied embeddings: each rank also uploads its vocabulary rows of the embedding as head.
        weights += matrix("lm_head.weight", shard.vocab.len(), c.hidden_size)?;
    }
    let sc = shard.config(c);
    let attn_layers = sc
        .layer_types
        .iter()
        .filter(|t| **t == LayerType::FullAttention)
        .count();
    let gdn_layers = sc.num_hidden_layers - attn_layers;
    let mut steps = vec![context];
    steps.extend(std::iter::repeat_n(1, decode));
    let kv = (attn_layers * 2 * cache_capacity(&steps) * sc.num_key_value_heads * sc.head_dim * 4)
        as u64;
    let states = (gdn_layers
        * (sc.linear_num_value_heads * sc.linear_key_head_dim * sc.linear_value_head_dim
            + (sc.linear_conv_kernel_dim - 1) * sc.linear_conv_dim())
        * 4) as u64;
    // The longest step's live activations: the MLP's gate‖up output and its halves, the GDN
    // projections, a few hidden-size rows; then the fixed scratch (delta-rule workspace,
    // GEMM weight scratch, attention scores).
    let h = sc.hidden_size;
    let per_token = 4 * (4 * sc.intermediate_size + 2 * sc.linear_conv_dim() + 8 * h);
    let workspace = (context * per_token) as u64
        + (super::GDR_WORKSPACE_BYTES + (4 * super::SCRATCH_ELEMS * 4)) as u64
        // Prefill attention: f32 scores and BF16 probabilities, BF16 copies of K and V.
        + (super::ATTENTION_SCRATCH_ELEMS * 6) as u64
        + (context * 2 * sc.num_key_value_heads * sc.head_dim * 2) as u64
        + quant.map_or(0, |_| (super::QUANT_SCRATCH_ELEMS * 2) as u64);
    Ok(VramPlan {
        weights,
        kv,
        states,
        workspace,
        reserve: 256 << 20,
    })
}

pub(crate) fn gib(b: u64) -> String {
    format!("{:.2} GiB", b as f64 / (1u64 << 30) as f64)
}

/// The index of the largest logit (greedy decoding).
/// The greedy token, as the server's sampler picks it.
pub(crate) use crate::sampling::argmax;

/// Prefills `prompt` into `seq` (timed): the last row's logits, checked finite, and seconds.
pub(crate) fn timed_prefill(
    model: &mut dyn CausalLm,
    seq: crate::model::SeqId,
    prompt: &[u32],
) -> Result<(Vec<Vec<f32>>, f64)> {
    let t = Instant::now();
    let logits = model.forward(&[BatchItem {
        seq,
        tokens: prompt,
        logits: LogitsWanted::Last,
    }])?;
    let seconds = t.elapsed().as_secs_f64();
    anyhow::ensure!(
        logits[0].iter().all(|x| x.is_finite()),
        "prefill produced non-finite logits"
    );
    Ok((logits, seconds))
}

/// Drops `seq` and prefills `prompt` again into a new sequence, timed: the same prefill with
/// the buffer pool, cuBLAS and the kernels warm, where the first prefill of a prompt's size
/// also grows the pool to its buffers. Returns the new sequence and the seconds.
pub(crate) fn repeat_prefill(
    model: &mut dyn CausalLm,
    seq: crate::model::SeqId,
    prompt: &[u32],
) -> Result<(crate::model::SeqId, f64)> {
    model.drop_sequence(seq);
    let s = model.new_sequence();
    let (_, seconds) = timed_prefill(model, s, prompt)?;
    Ok((s, seconds))
}

/// A bench record's prefill section: the first prefill of the prompt's size and its warm
/// repeat ([`repeat_prefill`]), each with its ratio to the matmul roofline (`gemm_rate`,
/// FLOP/s).
pub(crate) fn prefill_record(
    tokens: usize,
    flops: f64,
    first_s: f64,
    warm_s: f64,
    gemm_rate: f64,
) -> Value {
    json!({
        "tokens": tokens,
        "seconds": first_s,
        "tokens_per_s": tokens as f64 / first_s,
        "flops": flops,
        "flop_per_s": flops / first_s,
        "matmul_roofline_ratio": flops / first_s / gemm_rate,
        "warm": {
            "note": "the same prompt prefilled again into a new sequence: the first prefill also grows the buffer pool to the prompt's sizes",
            "seconds": warm_s,
            "tokens_per_s": tokens as f64 / warm_s,
            "flop_per_s": flops / warm_s,
            "matmul_roofline_ratio": flops / warm_s / gemm_rate,
            "first_over_warm_ratio": first_s / warm_s,
        },
    })
}

/// Each step's time in ms, to a µs (the spread the median hides).
pub(crate) fn step_ms(step_s: &[f64]) -> Vec<f64> {
    step_s.iter().map(|s| (s * 1e6).round() / 1e3).collect()
}

/// Times `steps` greedy single-token decode steps of `seq`, fed from `next` (left at the
/// token to feed after them): seconds per step and seconds in all. Each step is the server's
/// greedy pass ([`CausalLm::forward_greedy`]): the token is picked where the logits are.
pub(crate) fn greedy_steps(
    model: &mut dyn CausalLm,
    seq: crate::model::SeqId,
    next: &mut u32,
    steps: usize,
) -> Result<(Vec<f64>, f64)> {
    let mut step_s = Vec::with_capacity(steps);
    let t_all = Instant::now();
    for _ in 0..steps {
        let t = Instant::now();
        let picks = model.forward_greedy(
            &[BatchItem {
                seq,
                tokens: &[*next],
                logits: LogitsWanted::Last,
            }],
            usize::MAX,
        )?;
        step_s.push(t.elapsed().as_secs_f64());
        *next = picks[0].context("the greedy pass picked no token")?;
    }
    Ok((step_s, t_all.elapsed().as_secs_f64()))
}

/// `CAPY_PROFILE_DECODE_STEPS=N`: N more eager decode steps between cuProfilerStart and
/// cuProfilerStop, so that a profiler started with its capture off (`ncu --profile-from-start
/// off`) sees exactly one decode step's kernels per step, without the load and the prefill.
pub(crate) fn profile_decode(
    backend: &CudaBackend,
    model: &mut dyn CausalLm,
    seq: crate::model::SeqId,
    next: &mut u32,
    graphs_default: bool,
) -> Result<usize> {
    let steps = match std::env::var("CAPY_PROFILE_DECODE_STEPS") {
        Ok(v) => v.parse::<usize>().with_context(|| {
            format!("CAPY_PROFILE_DECODE_STEPS must be a step count, found {v:?}")
        })?,
        Err(_) => return Ok(0),
    };
    backend.set_cuda_graphs(false)?;
    backend.synchronize()?;
    // SAFETY: no arguments; the profiler API only marks the capture range.
    unsafe { drv_sys::cuProfilerStart() }.result()?;
    let run = greedy_steps(model, seq, next, steps);
    backend.synchronize()?;
    // SAFETY: as above.
    unsafe { drv_sys::cuProfilerStop() }.result()?;
    backend.set_cuda_graphs(graphs_default)?;
    run?;
    Ok(steps)
}

/// `CAPY_PROFILE_PREFILL=1`: drops `seq` and prefills `prompt` once more into a new sequence
/// between cuProfilerStart and cuProfilerStop, so that `ncu --profile-from-start off` sees
/// one whole prefill's kernels (the decode profile's counterpart). Returns whether it ran.
pub(crate) fn profile_prefill(
    backend: &CudaBackend,
    model: &mut dyn CausalLm,
    seq: crate::model::SeqId,
    prompt: &[u32],
) -> Result<bool> {
    match std::env::var("CAPY_PROFILE_PREFILL").as_deref() {
        Ok("1") => {}
        Ok("0") | Err(_) => return Ok(false),
        Ok(other) => anyhow::bail!("CAPY_PROFILE_PREFILL must be 0 or 1, found {other:?}"),
    }
    model.drop_sequence(seq);
    let s = model.new_sequence();
    backend.synchronize()?;
    // SAFETY: no arguments; the profiler API only marks the capture range.
    unsafe { drv_sys::cuProfilerStart() }.result()?;
    let run = timed_prefill(model, s, prompt);
    backend.synchronize()?;
    // SAFETY: as above.
    unsafe { drv_sys::cuProfilerStop() }.result()?;
    model.drop_sequence(s);
    run.map(|_| true)
}

pub(crate) fn median(v: &mut [f64]) -> f64 {
    v.sort_by(|a, b| a.partial_cmp(b).unwrap());
    if v.is_empty() {
        0.0
    } else {
        v[v.len() / 2]
    }
}

/// Builds the synthetic model on the GPU, prefills `context` tokens (timed), then times
/// `decode_steps` single-token steps at that context. Returns the figures as JSON.
pub fn run_synthetic(opts: &SyntheticBenchOptions) -> Result<Value> {
    let cfg_json = crate::synthetic::config(&opts.shape)?;
    let cfg = TextConfig::from_value(&cfg_json)?;
    // Decode runs eager, then with graphs (each after two warm-up steps), then once more in
    // the default mode where that is eager.
    let decode_total_steps = 3 * opts.decode_steps + 4;
    let plan = plan_vram(&cfg, opts.quant, opts.context, decode_total_steps)?;
    let quant_name = opts.quant.map_or("bf16".to_string(), |f| f.name());
    eprintln!(
        "VRAM plan for {} ({quant_name}, {} + {} tokens): weights {}, KV {}, states {}, workspace {}, reserve {} = {}{}",
        opts.shape,
        opts.context,
        decode_total_steps,
        gib(plan.weights),
        gib(plan.kv),
        gib(plan.states),
        gib(plan.workspace),
        gib(plan.reserve),
        gib(plan.total()),
        opts.vram_budget.map_or(String::new(), |b| format!(" of a {} budget", gib(b)))
    );
    if let Some(budget) = opts.vram_budget {
        if plan.total() > budget {
            anyhow::bail!(
                "this configuration does not fit the VRAM budget: it needs {} bytes ({}: weights {} + KV {} + states {} + \
                 workspace {} + reserve {}) and the budget is {budget} bytes ({}). Use a smaller quantization, a shorter \
                 --context, or a larger --vram-budget",
                plan.total(),
                gib(plan.total()),
                plan.weights,
                plan.kv,
                plan.states,
                plan.workspace,
                plan.reserve,
                gib(budget)
            );
        }
    }
    let backend = CudaBackend::new(opts.device, opts.vram_budget)?;
    backend.set_synthetic_quant(opts.quant);
    let info = backend.device_info().clone();
    let (free_at_start, total_mem) = drv::mem_get_info().unwrap_or((0, 0));
    let copy_bw = backend.measure_copy_bandwidth(2 << 30, 10)?;
    let gemm_rate = backend.measure_bf16_gemm_rate(8192, 10)?;

    let t0 = Instant::now();
    let ck = crate::synthetic::checkpoint(&opts.shape, opts.seed)?;
    let c = ck.config.clone();
    let mut model = Qwen3_5Text::load(backend.clone(), &ck)
        .context("building the synthetic model on the GPU")?;
    drop(ck);
    backend.synchronize()?;
    backend.set_synthetic_quant(None);
    let load_s = t0.elapsed().as_secs_f64();
    let ledger_after_load = backend.ledger();

    // Bytes every decode step reads: all weights but the embedding table (one row is gathered).
    let embed_bytes = (c.vocab_size * c.hidden_size * 2) as u64;
    let weight_bytes_per_token = ledger_after_load.weights - embed_bytes;
    // Matmul parameters per token (prefill FLOPs): every matrix but the embedding, the conv
    // filters and lm_head (which runs on the last row only).
    let head_params = (c.vocab_size * c.hidden_size) as f64;
    let gdn_layer_count = c
        .layer_types
        .iter()
        .filter(|t| **t == crate::config::LayerType::LinearAttention)
        .count();
    let conv_params = (gdn_layer_count * c.linear_conv_dim() * c.linear_conv_kernel_dim) as f64;
    let matmul_params = backend.matrix_elems() as f64 - 2.0 * head_params - conv_params;

    let mut rng = opts.seed | 1;
    let mut token = || {
        rng ^= rng << 13;
        rng ^= rng >> 7;
        rng ^= rng << 17;
        (rng % c.vocab_size as u64) as u32
    };

    // Warm-up: cuBLAS heuristics, the memory pool, both attention paths.
    {
        let s = model.new_sequence();
        let warm: Vec<u32> = (0..256).map(|_| token()).collect();
        model.forward(&[BatchItem {
            seq: s,
            tokens: &warm,
            logits: LogitsWanted::Last,
        }])?;
        for _ in 0..2 {
            let t = [token()];
            model.forward(&[BatchItem {
                seq: s,
                tokens: &t,
                logits: LogitsWanted::Last,
            }])?;
        }
        model.drop_sequence(s);
        backend.synchronize()?;
    }

    let seq = model.new_sequence();
    let prompt: Vec<u32> = (0..opts.context).map(|_| token()).collect();
    let (logits, prefill_s) = timed_prefill(&mut model, seq, &prompt)?;
    let n = opts.context as f64;
    let attn_layers = c
        .layer_types
        .iter()
        .filter(|t| **t == crate::config::LayerType::FullAttention)
        .count() as f64;
    // Causal attention: QKᵀ and PV, 2 FLOPs per multiply-add, n(n+1)/2 query-key pairs per head.
    let attn_flops =
        attn_layers * 4.0 * (c.num_attention_heads * c.head_dim) as f64 * n * (n + 1.0) / 2.0;
    let prefill_flops = 2.0 * matmul_params * n + 2.0 * head_params + attn_flops;

    let mut next = argmax(&logits[0]);
    // Greedy decode steps: (seconds per step, seconds in all, work items queued).
    let mut decode = |steps: usize| -> Result<(Vec<f64>, f64, u64)> {
        let launches_before = backend.launches();
        let (step_s, total_s) = greedy_steps(&mut model, seq, &mut next, steps)?;
        Ok((step_s, total_s, backend.launches() - launches_before))
    };
    // The same steps with CUDA graphs off and on (the first steps of each mode warm it up:
    // graph instantiation, the buffer pool), so their ratio is measured in one run.
    let graphs_default = backend.cuda_graphs();
    backend.set_cuda_graphs(false)?;
    decode(2)?;
    let (eager_steps, eager_total_s, _) = decode(opts.decode_steps)?;
    backend.set_cuda_graphs(true)?;
    decode(2)?;
    let graphs_before = backend.graph_stats();
    let (graph_steps, graph_total_s, graph_launches) = decode(opts.decode_steps)?;
    let graphs_after = backend.graph_stats();
    backend.set_cuda_graphs(graphs_default)?;
    let (step_s, decode_total_s, launches) = if graphs_default {
        (graph_steps, graph_total_s, graph_launches)
    } else {
        let (s, t, l) = decode(opts.decode_steps)?;
        (s, t, l)
    };
    let eager_median_step = median(&mut eager_steps.clone());
    let launches_per_token = launches as f64 / opts.decode_steps.max(1) as f64;
    let ledger_peak = backend.ledger().peak;
    let decode_tok_s = opts.decode_steps as f64 / decode_total_s;
    let median_step = median(&mut step_s.clone());
    let context_at_end = opts.context + opts.decode_steps;
    // KV (f32) and GDN state bytes each decode step also reads.
    let kv_bytes =
        (attn_layers as usize * 2 * context_at_end * c.num_key_value_heads * c.head_dim * 4) as u64;
    let gdn_layers = c.num_hidden_layers - attn_layers as usize;
    let state_bytes = (gdn_layers
        * c.linear_num_value_heads
        * c.linear_key_head_dim
        * c.linear_value_head_dim
        * 4) as u64;
    let roof_tok_s = copy_bw / weight_bytes_per_token as f64;
    let roof_with_state = copy_bw / (weight_bytes_per_token + kv_bytes + state_bytes) as f64;

    let profiled_steps = profile_decode(&backend, &mut model, seq, &mut next, graphs_default)?;
    let (seq, warm_prefill_s) = repeat_prefill(&mut model, seq, &prompt)?;
    let profiled_prefill = profile_prefill(&backend, &mut model, seq, &prompt)?;
    drop(model);
    let ops = op_timings(&backend, &c, opts.context, opts.quant)?;
    // Per-step time beyond streaming the weights at the measured bandwidth, spread over the
    // work items queued per token: the launch overhead CUDA graphs would remove.
    let overhead_per_launch_us =
        (median_step - weight_bytes_per_token as f64 / copy_bw) / launches_per_token * 1e6;
    let reserve = total_mem.saturating_sub(free_at_start) as u64;
    let measured_workspace = ledger_peak
        .saturating_sub(ledger_after_load.weights)
        .saturating_sub(plan.kv + plan.states);
    eprintln!(
        "VRAM ledger ({}): weights {}, KV {}, states {}, workspace {} (peak {} in all), reserve {} (CUDA context, cuBLAS)",
        info.name,
        gib(ledger_after_load.weights),
        gib(plan.kv),
        gib(plan.states),
        gib(measured_workspace),
        gib(ledger_peak),
        gib(reserve)
    );

    Ok(json!({
        "benchmark": "synthetic",
        "shape": opts.shape,
        "weights": quant_name,
        "weights_note": if opts.quant.is_some() {
            "random valid blocks of this format for every projection matrix, kept quantized on the GPU (matvec dequantizes in registers; prefill dequantizes to BF16 for cuBLAS); embedding, lm_head, conv filters and norms BF16/F32"
        } else {
            "random BF16 weights"
        },
        "exact_math": backend.exact_math(),
        "machine": {
            "gpu": info.name,
            "compute_capability": format!("sm_{}{}", info.compute_capability.0, info.compute_capability.1),
            "multiprocessors": info.multiprocessors,
            "smem_per_multiprocessor": info.smem_per_multiprocessor,
            "gpu_memory_bytes": info.total_memory,
            "driver_cuda": format!("{}.{}", info.driver_version.0, info.driver_version.1),
            "nvrtc": format!("{}.{}", info.nvrtc_version.0, info.nvrtc_version.1),
            "host_threads": std::thread::available_parallelism().map(|n| n.get()).unwrap_or(1),
        },
        "ceilings": {
            "device_copy_bytes_per_s": copy_bw,
            "device_copy_note": "cuMemcpyDtoD of 2 GiB, bytes read + written, 10 repetitions",
            "bf16_gemm_flop_per_s": gemm_rate,
            "bf16_gemm_note": "cublasGemmEx 8192^3, BF16 in, F32 out, F32 accumulation, random operands, 10 repetitions",
        },
        "load_seconds": load_s,
        "vram": {
            "budget_bytes": opts.vram_budget,
            "plan": plan,
            "plan_total_bytes": plan.total(),
            "weights_bytes": ledger_after_load.weights,
            "after_load_bytes": ledger_after_load.used,
            "peak_bytes": ledger_peak,
            "workspace_measured_bytes": measured_workspace,
            "reserve_outside_ledger_bytes": reserve,
        },
        "prefill": prefill_record(opts.context, prefill_flops, prefill_s, warm_prefill_s, gemm_rate),
        "op_timings": ops,
        "decode": {
            "batch": 1,
            "context_start": opts.context,
            "steps": opts.decode_steps,
            "tokens_per_s": decode_tok_s,
            "median_step_ms": median_step * 1e3,
            "step_ms": step_ms(&step_s),
            "launches_per_token": launches_per_token,
            "overhead_per_launch_us": overhead_per_launch_us,
            "weight_bytes_per_token": weight_bytes_per_token,
            "kv_and_state_bytes_per_token": kv_bytes + state_bytes,
            "roofline_tokens_per_s": roof_tok_s,
            "bandwidth_roofline_ratio": decode_tok_s / roof_tok_s,
            "bandwidth_roofline_ratio_with_kv_and_state": decode_tok_s / roof_with_state,
            "cuda_graphs": graphs_default,
            "eager_tokens_per_s": opts.decode_steps as f64 / eager_total_s,
            "eager_median_step_ms": eager_median_step * 1e3,
            "eager_step_ms": step_ms(&eager_steps),
            "graphs_tokens_per_s": opts.decode_steps as f64 / graph_total_s,
            "graphs_over_eager_speedup_ratio": eager_total_s / graph_total_s,
            "graph_launches_per_token": (graphs_after.launched - graphs_before.launched) as f64 / opts.decode_steps.max(1) as f64,
            "graph_updates": graphs_after.updated - graphs_before.updated,
            "graph_instantiations": graphs_after.instantiated - graphs_before.instantiated,
            "graph_record_ms_per_token": (graphs_after.record_ns - graphs_before.record_ns) as f64 / 1e6 / opts.decode_steps.max(1) as f64,
            "graph_flush_ms_per_token": (graphs_after.flush_ns - graphs_before.flush_ns) as f64 / 1e6 / opts.decode_steps.max(1) as f64,
            "graph_last_update_refusal": graphs_after.last_update_refusal,
            "profiled_steps": profiled_steps,
            "profiled_prefill": profiled_prefill,
            "peer_llama_cpp_q4_k_tokens_per_s": 86.7,
            "ratio_to_peer_llama_cpp_q4_k": decode_tok_s / 86.7,
        },
    }))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rank_plans_split_the_layers_and_replicate_the_embedding() {
        let c = TextConfig::from_value(&crate::synthetic::config("qwen3.8-27b").unwrap()).unwrap();
        let q = Some(RowFormat::Nvfp4);
        let one = plan_vram(&c, q, 8192, 32).unwrap();
        let ranks: Vec<VramPlan> = (0..2)
            .map(|r| plan_vram_rank(&c, q, 8192, 32, 2, r).unwrap())
            .collect();
        let embed = (c.vocab_size * c.hidden_size * 2) as u64;
        // Everything but the embedding (and the replicated norms, a few MB) is split in two.
        let split = ranks[0].weights + ranks[1].weights - embed;
        let norms_slack = 64 << 20;
        assert!(
            split >= one.weights && split <= one.weights + norms_slack,
            "two ranks hold {split} bytes of the {} a single card holds (embedding {embed} replicated)",
            one.weights
        );
        assert!(
            ranks[0].weights < one.weights * 6 / 10,
            "{ranks:?} vs {one:?}"
        );
        assert_eq!(ranks[0].kv + ranks[1].kv, one.kv);
        assert_eq!(ranks[0].states + ranks[1].states, one.states);
        assert!(ranks[0].workspace < one.workspace);
        assert!(plan_vram_rank(&c, q, 8192, 32, 2, 2).is_err());
    }
}
