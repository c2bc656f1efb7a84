//! Synthetic checkpoints: the real configuration of a supported model with random weights,
//! generated in memory, so benchmarks run at full size without a download.
//!
//! The weights cost the same bytes and FLOPs per token as the real checkpoint. To keep host
//! memory and start-up time small, every tensor is a window into one shared pool of random
//! BF16 values as large as the largest tensor (the windows start at different, name-derived
//! offsets). The values are uniform in ±0.02, so activations stay finite through all layers.

use crate::checkpoint::{Checkpoint, GenerationConfig, SafetensorStore};
use crate::config::{LayerType, TextConfig};
use crate::tensor::DType;
use anyhow::{bail, Result};
use rayon::prelude::*;
use serde_json::{json, Value};
use std::path::PathBuf;
use std::sync::Arc;

/// Shapes `--synthetic` accepts.
pub const SHAPES: &[&str] = &["qwen3.8-27b"];

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
    let c = TextConfig::from_value(config)?;
    let tensors = qwen3_5_text_tensors(&c);
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

    #[test]
    fn small_synthetic_model_loads_and_gives_finite_logits() {
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
