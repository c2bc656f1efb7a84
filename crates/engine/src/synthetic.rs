//! Synthetic checkpoints: the real configuration of a supported model with random weights,
//! generated in memory, so benchmarks run at full size without a download.
//!
//! The weights cost the same bytes and FLOPs per token as the real checkpoint. To keep host
//! memory and start-up time small, every tensor is a window into one shared pool of random
//! BF16 values as large as the largest tensor (the windows start at different, name-derived
//! offsets). The values are uniform in ±0.02, so activations stay finite through all layers.

use crate::checkpoint::{Checkpoint, GenerationConfig, SafetensorStore};
use crate::config::{Architecture, LayerType, TextConfig};
use crate::tensor::DType;
use anyhow::{bail, Result};
use rayon::prelude::*;
use serde_json::{json, Value};
use std::path::PathBuf;
use std::sync::Arc;

/// Shapes `--synthetic` accepts.
pub const SHAPES: &[&str] = &["qwen3.8-27b", "moe-mid"];

/// `config.json` of a synthetic shape.
pub fn config(shape: &str) -> Result<Value> {
    match shape {
        // MODELS.md: Qwen3.8-27B (qwen3_5_text).
        "qwen3.8-27b" => Ok(json!({
            "model_type": "qwen3_5_text",
            "vocab_size": 248320,
            "hidden_size": 5120,
            "intermediate_size": 17408,
            "num_hidden_layers": 64,
            "num_attention_heads": 24,
            "num_key_value_heads": 4,
            "head_dim": 256,
            "linear_num_key_heads": 16,
            "linear_num_value_heads": 48,
            "linear_key_head_dim": 128,
            "linear_value_head_dim": 128,
            "linear_conv_kernel_dim": 4,
            "full_attention_interval": 4,
            "rms_norm_eps": 1e-6,
            "max_position_embeddings": 262144,
            "tie_word_embeddings": false,
            "rope_parameters": {"rope_type": "default", "rope_theta": 10000000.0, "partial_rotary_factor": 0.25, "mrope_section": [11, 11, 10]},
            "eos_token_id": 248044
        })),
        // A mid-size Flash-Next (qwen4_exp_text) for CPU benchmarks: hidden 1024, 8 layers
        // (3 GDN : 1 QSA), 64 routed experts of width 256 with top-8 and a shared expert,
        // 4 hyper-connection streams, one PLE layer with a 4-way sharded n-gram table (~0.5M
        // rows), and a QSA budget of 128 tokens so that a 256-token prompt runs past it.
        "moe-mid" => Ok(json!({
            "model_type": "qwen4_exp_text",
            "architectures": ["Qwen4ExpForCausalLM"],
            "vocab_size": 32768,
            "hidden_size": 1024,
            "num_hidden_layers": 8,
            "num_attention_heads": 8,
            "num_key_value_heads": 2,
            "head_dim": 128,
            "output_gate_type": "sigmoid",
            "max_position_embeddings": 32768,
            "rms_norm_eps": 1e-6,
            "tie_word_embeddings": false,
            "rope_parameters": {"rope_type": "default", "rope_theta": 10000000.0, "partial_rotary_factor": 0.25},
            "linear_conv_kernel_dim": 4,
            "linear_key_head_dim": 128,
            "linear_value_head_dim": 128,
            "linear_num_key_heads": 4,
            "linear_num_value_heads": 8,
            "layer_types": ["linear_attention", "linear_attention", "linear_attention", "full_attention",
                            "linear_attention", "linear_attention", "linear_attention", "full_attention"],
            "moe_intermediate_size": 256,
            "shared_expert_intermediate_size": 256,
            "num_experts": 64,
            "num_experts_per_tok": 8,
            "norm_topk_prob": true,
            "hc_count": 4,
            "hc_lowrank": 128,
            "ple_layer_ids": [2],
            "ple_embed_dim": 1024,
            "ple_conv_kernel_size": 4,
            "ngram_size": 3,
            "heads_per_ngram": 8,
            "ngram_vocab_size_base": 32768,
            "make_ngram_vocab_size_divisible_by": 128,
            "seed": 1234,
            "split_ngram_parts": 4,
            "indexer_n_heads": 4,
            "indexer_kv_heads": 1,
            "indexer_head_dim": 64,
            "indexer_budget": 128,
            "indexer_compress_ratio": 4,
            "eos_token_id": 0
        })),
        other => bail!("unknown synthetic shape \"{other}\"; expected one of {SHAPES:?}"),
    }
}

/// Names and shapes of every tensor a `qwen3_5_text` checkpoint of this config holds.
pub fn qwen3_5_text_tensors(c: &TextConfig) -> Vec<(String, Vec<usize>)> {
    let (h, v, i) = (c.hidden_size, c.vocab_size, c.intermediate_size);
    let (nh, nkv, d) = (c.num_attention_heads, c.num_key_value_heads, c.head_dim);
    let (conv, vd, nv) = (
        c.linear_conv_dim(),
        c.linear_value_dim(),
        c.linear_num_value_heads,
    );
    let mut t: Vec<(String, Vec<usize>)> = vec![("model.embed_tokens.weight".into(), vec![v, h])];
    for (li, kind) in c.layer_types.iter().enumerate() {
        let p = format!("model.layers.{li}.");
        t.push((format!("{p}input_layernorm.weight"), vec![h]));
        t.push((format!("{p}post_attention_layernorm.weight"), vec![h]));
        match kind {
            LayerType::LinearAttention => {
                let a = format!("{p}linear_attn.");
                t.push((format!("{a}in_proj_qkv.weight"), vec![conv, h]));
                t.push((format!("{a}in_proj_z.weight"), vec![vd, h]));
                t.push((format!("{a}in_proj_b.weight"), vec![nv, h]));
                t.push((format!("{a}in_proj_a.weight"), vec![nv, h]));
                t.push((
                    format!("{a}conv1d.weight"),
                    vec![conv, 1, c.linear_conv_kernel_dim],
                ));
                t.push((format!("{a}A_log"), vec![nv]));
                t.push((format!("{a}dt_bias"), vec![nv]));
                t.push((format!("{a}norm.weight"), vec![c.linear_value_head_dim]));
                t.push((format!("{a}out_proj.weight"), vec![h, vd]));
            }
            LayerType::FullAttention => {
                let a = format!("{p}self_attn.");
                t.push((format!("{a}q_proj.weight"), vec![nh * d * 2, h]));
                t.push((format!("{a}k_proj.weight"), vec![nkv * d, h]));
                t.push((format!("{a}v_proj.weight"), vec![nkv * d, h]));
                t.push((format!("{a}o_proj.weight"), vec![h, nh * d]));
                t.push((format!("{a}q_norm.weight"), vec![d]));
                t.push((format!("{a}k_norm.weight"), vec![d]));
            }
        }
        t.push((format!("{p}mlp.gate_proj.weight"), vec![i, h]));
        t.push((format!("{p}mlp.up_proj.weight"), vec![i, h]));
        t.push((format!("{p}mlp.down_proj.weight"), vec![h, i]));
    }
    t.push(("model.norm.weight".into(), vec![h]));
    if !c.tie_word_embeddings {
        t.push(("lm_head.weight".into(), vec![v, h]));
    }
    t
}

/// Rows of each part when `rows` are split in `parts` shards the way `save_pretrained` splits
/// the PLE table (`torch.chunk`: equal parts of `ceil(rows / parts)`, a shorter last one, and
/// fewer parts when they would be empty).
pub fn chunk_rows(rows: usize, parts: usize) -> Vec<usize> {
    let size = rows.div_ceil(parts.max(1)).max(1);
    (0..rows.div_ceil(size))
        .map(|i| size.min(rows - i * size))
        .collect()
}

/// Names and shapes of every tensor a `qwen4_exp_text` checkpoint of this config holds (fused
/// experts, the PLE table in `split_ngram_parts` shards; no `mtp.*`, no derived buffers).
pub fn qwen4_exp_text_tensors(c: &TextConfig) -> Result<Vec<(String, Vec<usize>)>> {
    let f = c.qwen4_exp()?;
    let (h, v, s, r) = (c.hidden_size, c.vocab_size, f.hc_count, f.hc_lowrank);
    let (nh, nkv, d) = (c.num_attention_heads, c.num_key_value_heads, c.head_dim);
    let (conv, vd, nv) = (
        c.linear_conv_dim(),
        c.linear_value_dim(),
        c.linear_num_value_heads,
    );
    let wide = s * h;
    let hyper = |t: &mut Vec<(String, Vec<usize>)>, p: String, inject: bool| {
        t.push((format!("{p}hc_norm.weight"), vec![wide]));
        t.push((format!("{p}input_mix_weight_down.weight"), vec![r, wide]));
        t.push((format!("{p}input_mix_weight_up.weight"), vec![wide, r]));
        if inject {
            t.push((format!("{p}block_inject_weight.weight"), vec![s, wide]));
        }
    };
    let mut t: Vec<(String, Vec<usize>)> = vec![("model.embed_tokens.weight".into(), vec![v, h])];
    for (li, kind) in c.layer_types.iter().enumerate() {
        let p = format!("model.layers.{li}.");
        hyper(&mut t, format!("{p}attn_hyper_connection."), true);
        hyper(&mut t, format!("{p}mlp_hyper_connection."), true);
        if let Some(pc) = &f.ple {
            if let Some(index) = pc.layers.iter().position(|&l| l == li) {
                let q = format!("{p}ple.");
                let e = pc.embed_dim;
                t.push((format!("{q}key_proj.weight"), vec![wide, e]));
                t.push((format!("{q}value_proj.weight"), vec![h, e]));
                t.push((
                    format!("{q}conv1d.weight"),
                    vec![wide, 1, pc.conv_kernel_size],
                ));
                for n in ["norm_key", "norm_query", "norm_conv"] {
                    t.push((format!("{q}{n}.weight"), vec![wide]));
                }
                let rows = crate::model::layers::ple::NgramHasher::new(pc, v, index).table_rows;
                for (i, n) in chunk_rows(rows as usize, pc.split_ngram_parts)
                    .into_iter()
                    .enumerate()
                {
                    t.push((
                        format!("{q}ple_embedding.ngram_embedding.shard_{i}.weight"),
                        vec![n, pc.head_dim()],
                    ));
                }
            }
        }
        match kind {
            LayerType::LinearAttention => {
                let a = format!("{p}linear_attn.");
                t.push((format!("{a}in_proj_qkv.weight"), vec![conv, h]));
                t.push((format!("{a}in_proj_z.weight"), vec![vd, h]));
                t.push((format!("{a}in_proj_b.weight"), vec![nv, h]));
                t.push((format!("{a}in_proj_a.weight"), vec![nv, h]));
                t.push((
                    format!("{a}conv1d.weight"),
                    vec![conv, 1, c.linear_conv_kernel_dim],
                ));
                t.push((format!("{a}A_log"), vec![nv]));
                t.push((format!("{a}dt_bias"), vec![nv]));
                t.push((format!("{a}norm.weight"), vec![c.linear_value_head_dim]));
                t.push((format!("{a}out_proj.weight"), vec![h, vd]));
            }
            LayerType::FullAttention => {
                let a = format!("{p}self_attn.");
                t.push((format!("{a}q_proj.weight"), vec![nh * d * 2, h]));
                t.push((format!("{a}k_proj.weight"), vec![nkv * d, h]));
                t.push((format!("{a}v_proj.weight"), vec![nkv * d, h]));
                t.push((format!("{a}o_proj.weight"), vec![h, nh * d]));
                t.push((format!("{a}q_norm.weight"), vec![d]));
                t.push((format!("{a}k_norm.weight"), vec![d]));
                if let Some(q) = &f.qsa {
                    let (ih, id) = (q.indexer_n_heads, q.indexer_head_dim);
                    t.push((
                        format!("{a}indexer.index_qk_proj.weight"),
                        vec![(ih + 1) * id, h],
                    ));
                    t.push((format!("{a}indexer.q_layernorm.weight"), vec![id]));
                    t.push((format!("{a}indexer.k_layernorm.weight"), vec![id]));
                }
            }
        }
        let m = format!("{p}mlp.");
        let (e, i, si) = (
            f.moe.num_experts,
            f.moe.moe_intermediate_size,
            f.moe.shared_expert_intermediate_size,
        );
        t.push((format!("{m}gate.weight"), vec![e, h]));
        t.push((format!("{m}experts.gate_up_proj"), vec![e, 2 * i, h]));
        t.push((format!("{m}experts.down_proj"), vec![e, h, i]));
        t.push((format!("{m}shared_expert.gate_proj.weight"), vec![si, h]));
        t.push((format!("{m}shared_expert.up_proj.weight"), vec![si, h]));
        t.push((format!("{m}shared_expert.down_proj.weight"), vec![h, si]));
        t.push((format!("{m}shared_expert_gate.weight"), vec![1, h]));
    }
    hyper(&mut t, "model.hyper_connection_mixer.".into(), false);
    if !c.tie_word_embeddings {
        t.push(("lm_head.weight".into(), vec![v, h]));
    }
    Ok(t)
}

/// Names and shapes of every tensor of a checkpoint of this config, for its architecture.
pub fn tensors(c: &TextConfig) -> Result<Vec<(String, Vec<usize>)>> {
    match c.architecture {
        Architecture::Qwen3_5Text => Ok(qwen3_5_text_tensors(c)),
        Architecture::Qwen4ExpText => qwen4_exp_text_tensors(c),
    }
}

/// Random BF16 values, kept as `u16` so the buffer is 2-byte aligned.
struct Pool(Vec<u16>);

impl AsRef<[u8]> for Pool {
    fn as_ref(&self) -> &[u8] {
        // SAFETY: u16 has no padding; the byte view covers exactly the same memory.
        unsafe { std::slice::from_raw_parts(self.0.as_ptr() as *const u8, self.0.len() * 2) }
    }
}

fn fnv1a(s: &str) -> u64 {
    s.bytes().fold(0xcbf29ce484222325u64, |h, b| {
        (h ^ b as u64).wrapping_mul(0x100000001b3)
    })
}

/// Fills a pool of `len` BF16 values uniform in ±0.02 from `seed` (parallel, deterministic).
fn random_pool(len: usize, seed: u64) -> Pool {
    let mut v = vec![0u16; len];
    v.par_chunks_mut(1 << 20)
        .enumerate()
        .for_each(|(ci, chunk)| {
            let mut s = (seed ^ (ci as u64).wrapping_mul(0x9E3779B97F4A7C15)) | 1;
            for x in chunk {
                s ^= s << 13;
                s ^= s >> 7;
                s ^= s << 17;
                let u = (s >> 40) as f32 / (1u64 << 24) as f32; // [0, 1)
                *x = half::bf16::from_f32((u * 2.0 - 1.0) * 0.02).to_bits();
            }
        });
    Pool(v)
}

/// A checkpoint of `config` (a `config.json` value) with random BF16 weights.
pub fn checkpoint_from_config(config: &Value, seed: u64) -> Result<Checkpoint> {
    checkpoint_from_config_keeping(config, seed, |_| true)
}

/// [`checkpoint_from_config`] with only the tensors whose names pass `keep` (a bench that
/// builds the routed experts itself leaves them out, so the random pool is sized by the
/// largest tensor it does read).
pub fn checkpoint_from_config_keeping(
    config: &Value,
    seed: u64,
    keep: impl Fn(&str) -> bool,
) -> Result<Checkpoint> {
    let c = TextConfig::from_value(config)?;
    let mut tensors = tensors(&c)?;
    tensors.retain(|(name, _)| keep(name));
    let largest = tensors
        .iter()
        .map(|(_, s)| s.iter().product::<usize>())
        .max()
        .unwrap_or(0);
    // A little slack past the largest tensor so that windows start at different offsets.
    let slack = 1 << 16;
    let pool_len = largest + slack;
    let pool = Arc::new(random_pool(pool_len, seed));
    let entries = tensors
        .into_iter()
        .map(|(name, shape)| {
            let numel: usize = shape.iter().product();
            let room = pool_len - numel;
            // 8-element (16-byte) aligned offsets, for vectorised loads.
            let start = ((fnv1a(&name) as usize) % (room / 8 + 1)) * 8;
            (name, DType::BF16, shape, start * 2)
        })
        .collect();
    let label = PathBuf::from(format!(
        "<synthetic {} seed {seed}>",
        c.architecture.model_type()
    ));
    let weights = SafetensorStore::from_buffer(label.clone(), pool, entries)?;
    Ok(Checkpoint {
        dir: label,
        config: c,
        weights: weights.into(),
        generation: GenerationConfig::default(),
    })
}

/// A checkpoint of one of [`SHAPES`] with random BF16 weights.
pub fn checkpoint(shape: &str, seed: u64) -> Result<Checkpoint> {
    checkpoint_from_config(&config(shape)?, seed)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::backend::cpu::CpuBackend;
    use crate::model::{BatchItem, CausalLm, LogitsWanted};

    #[test]
    fn full_size_config_matches_models_md() {
        let c = TextConfig::from_value(&config("qwen3.8-27b").unwrap()).unwrap();
        assert_eq!(
            c.layer_types
                .iter()
                .filter(|t| **t == LayerType::FullAttention)
                .count(),
            16
        );
        assert_eq!(c.layer_types[3], LayerType::FullAttention);
        assert_eq!(c.rotary_dim(), 64);
        let params: usize = qwen3_5_text_tensors(&c)
            .iter()
            .map(|(_, s)| s.iter().product::<usize>())
            .sum();
        // About 27B parameters (MODELS.md), embedding and head included.
        assert!(
            (26_000_000_000..29_000_000_000).contains(&params),
            "{params} parameters"
        );
    }

    /// The 27B's configuration at a tiny width.
    fn tiny_27b_config() -> Value {
        let mut cfg = config("qwen3.8-27b").unwrap();
        for (k, v) in [
            ("vocab_size", 96),
            ("hidden_size", 64),
            ("intermediate_size", 96),
            ("num_hidden_layers", 4),
            ("num_attention_heads", 4),
            ("num_key_value_heads", 2),
            ("head_dim", 16),
            ("linear_num_key_heads", 2),
            ("linear_num_value_heads", 4),
            ("linear_key_head_dim", 16),
            ("linear_value_head_dim", 16),
        ] {
            cfg[k] = json!(v);
        }
        cfg
    }

    #[test]
    fn a_checkpoint_keeps_only_the_tensors_asked_for() {
        let cfg = tiny_27b_config();
        let all = checkpoint_from_config_keeping(&cfg, 1, |_| true).unwrap();
        let some = checkpoint_from_config_keeping(&cfg, 1, |n| !n.contains(".mlp.")).unwrap();
        let (n_all, n_some) = (all.weights.names().count(), some.weights.names().count());
        assert!(n_some > 0 && n_some < n_all, "{n_some} of {n_all}");
        assert!(some.weights.names().all(|n| !n.contains(".mlp.")));
        assert!(all.weights.names().any(|n| n.contains(".mlp.")));
    }

    #[test]
    fn small_synthetic_model_loads_and_gives_finite_logits() {
        let cfg = tiny_27b_config();
        let ck = checkpoint_from_config(&cfg, 7).unwrap();
        let mut m = crate::model::qwen3_5_text::Qwen3_5Text::load(CpuBackend::new(), &ck).unwrap();
        let s = m.new_sequence();
        let out = m
            .forward(&[BatchItem {
                seq: s,
                tokens: &[1, 2, 3, 4, 5],
                logits: LogitsWanted::Last,
            }])
            .unwrap();
        assert_eq!(out[0].len(), 96);
        assert!(out[0].iter().all(|x| x.is_finite()));
        // Different seeds give different weights.
        let other = checkpoint_from_config(&cfg, 8).unwrap();
        let a = ck
            .weights
            .get("model.norm.weight")
            .unwrap()
            .to_f32()
            .unwrap();
        let b = other
            .weights
            .get("model.norm.weight")
            .unwrap()
            .to_f32()
            .unwrap();
        assert_ne!(a, b);
    }
}
