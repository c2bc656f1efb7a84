//! The built-in demo models: small random-weight checkpoints generated deterministically on
//! first use and cached, with a real Qwen tokenizer and chat template, so every command works
//! on a fresh machine without a download. Their output is gibberish.
//!
//! The folder written is an ordinary Hugging Face checkpoint and is loaded through the same
//! code as a downloaded one. The same writer builds larger synthetic checkpoints for
//! benchmarks ([`write_random_checkpoint`]).

use crate::checkpoint::write_safetensors;
use crate::config::{Architecture, LayerType, TextConfig};
use crate::tensor::{Bytes, DType, HostTensor};
use anyhow::{bail, Context, Result};
use half::bf16;
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use serde_json::{json, Value};
use std::path::{Path, PathBuf};

/// Bump when the demo's config or weights change, so stale caches are rebuilt.
const DEMO_VERSION: u32 = 1;
const DEMO_SEED: u64 = 0x0CA9_F1A5;

/// Names accepted by `--model` for the built-in models: `demo` (dense `qwen3_5_text`) and
/// `demo-moe` (`qwen4_exp_text`: QSA, Gated DeltaNet, sparse MoE with a shared expert,
/// hyper-connections and a sharded PLE n-gram table).
pub const DEMO_NAMES: &[&str] = &["demo", "demo-moe"];

/// True when `--model` names a built-in demo model rather than a folder.
pub fn is_demo_name(name: &str) -> bool {
    DEMO_NAMES.contains(&name)
}

/// Where generated models are cached: `$CAPY_CACHE_DIR`, else the OS cache folder.
pub fn cache_dir() -> Result<PathBuf> {
    if let Ok(dir) = std::env::var("CAPY_CACHE_DIR") {
        return Ok(PathBuf::from(dir));
    }
    directories::ProjectDirs::from("dev", "capy-flash", "capy-flash")
        .map(|d| d.cache_dir().to_path_buf())
        .context("cannot find a cache folder (no home directory?); set CAPY_CACHE_DIR")
}

/// The demo's `config.json` for a tokenizer of `tokenizer_vocab` ids ending with `eos_id`.
pub fn demo_config(tokenizer_vocab: usize, eos_id: u32) -> Value {
    json!({
        "architectures": ["Qwen3_5ForCausalLM"],
        "model_type": "qwen3_5_text",
        // Padded like the real checkpoints (248,320 for the Qwen3.5 vocabulary).
        "vocab_size": tokenizer_vocab.div_ceil(256) * 256,
        "hidden_size": 128,
        "intermediate_size": 384,
        "num_hidden_layers": 4,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 32,
        "linear_num_key_heads": 2,
        "linear_num_value_heads": 4,
        "linear_key_head_dim": 32,
        "linear_value_head_dim": 32,
        "linear_conv_kernel_dim": 4,
        "rms_norm_eps": 1e-6,
        "max_position_embeddings": 32768,
        "tie_word_embeddings": false,
        "rope_parameters": {"rope_type": "default", "rope_theta": 10000000.0, "partial_rotary_factor": 0.25, "mrope_section": [2, 1, 1], "mrope_interleaved": true},
        "eos_token_id": eos_id,
        "torch_dtype": "bfloat16",
        "capy_demo": {"version": DEMO_VERSION, "seed": DEMO_SEED, "note": "random weights: output is gibberish"}
    })
}

/// The `config.json` of the named demo model for a tokenizer of `tokenizer_vocab` ids.
fn named_demo_config(name: &str, tokenizer_vocab: usize, eos_id: u32) -> Result<Value> {
    Ok(match name {
        "demo" => demo_config(tokenizer_vocab, eos_id),
        "demo-moe" => {
            let mut c = crate::model::qwen4_exp_text::demo_config(
                tokenizer_vocab.div_ceil(256) * 256,
                eos_id,
            );
            c["torch_dtype"] = json!("bfloat16");
            c["capy_demo"] = json!({"version": DEMO_VERSION, "seed": DEMO_SEED, "note": "random weights: output is gibberish"});
            c
        }
        other => bail!(
            "unknown demo model \"{other}\"; built-in models are: {}",
            DEMO_NAMES.join(", ")
        ),
    })
}

/// Returns the folder of the named demo model, generating it on first use.
pub fn ensure_demo_model(name: &str) -> Result<PathBuf> {
    if !is_demo_name(name) {
        bail!(
            "unknown demo model \"{name}\"; built-in models are: {}",
            DEMO_NAMES.join(", ")
        );
    }
    ensure_demo_model_in(name, &cache_dir()?)
}

/// [`ensure_demo_model`] with the cache folder given.
pub fn ensure_demo_model_in(name: &str, cache: &Path) -> Result<PathBuf> {
    let dir = cache.join(format!("{name}-v{DEMO_VERSION}"));
    if dir.join("config.json").exists()
        && dir.join("model.safetensors").exists()
        && dir.join("tokenizer.json").exists()
    {
        return Ok(dir);
    }
    let tokenizer_json = crate::tokenizer::demo_tokenizer_json();
    let tokenizer = crate::tokenizer::Tokenizer::from_json_bytes(&tokenizer_json)?;
    let eos = tokenizer
        .token_to_id("<|im_end|>")
        .context("the demo tokenizer has no <|im_end|> token")?;
    let config = named_demo_config(name, tokenizer.vocab_size(), eos)?;
    let parent = dir.parent().context("cache folder has no parent")?;
    std::fs::create_dir_all(parent)
        .with_context(|| format!("cannot create {}", parent.display()))?;
    // Build in a temporary folder and rename, so an interrupted first run leaves nothing half-made.
    let tmp = parent.join(format!(
        ".{name}-v{DEMO_VERSION}.{}.partial",
        std::process::id()
    ));
    let _ = std::fs::remove_dir_all(&tmp);
    std::fs::create_dir_all(&tmp).with_context(|| format!("cannot create {}", tmp.display()))?;
    write_random_checkpoint(&config, &tmp, DType::BF16, DEMO_SEED)?;
    std::fs::write(tmp.join("tokenizer.json"), &tokenizer_json)?;
    std::fs::write(
        tmp.join("chat_template.jinja"),
        crate::tokenizer::DEMO_CHAT_TEMPLATE,
    )?;
    std::fs::write(
        tmp.join("tokenizer_config.json"),
        serde_json::to_string_pretty(&json!({
            "tokenizer_class": "Qwen2Tokenizer",
            "eos_token": "<|im_end|>",
            "pad_token": "<|endoftext|>",
            "bos_token": null,
            "add_bos_token": false,
            "model_max_length": 32768
        }))?,
    )?;
    std::fs::write(
        tmp.join("generation_config.json"),
        serde_json::to_string_pretty(
            &json!({"eos_token_id": eos, "temperature": 0.7, "top_p": 0.8, "top_k": 20}),
        )?,
    )?;
    match std::fs::rename(&tmp, &dir) {
        Ok(()) => {}
        // Another process finished first: keep its copy.
        Err(_) if dir.join("model.safetensors").exists() => {
            let _ = std::fs::remove_dir_all(&tmp);
        }
        Err(e) => {
            return Err(e)
                .with_context(|| format!("cannot move the demo model into {}", dir.display()))
        }
    }
    Ok(dir)
}

/// Normal(0, std) samples via Box-Muller (deterministic for a seed).
fn normal(rng: &mut ChaCha8Rng, std: f32) -> f32 {
    let u1: f32 = rng.random::<f32>().max(1e-12);
    let u2: f32 = rng.random::<f32>();
    (-2.0 * u1.ln()).sqrt() * (std::f32::consts::TAU * u2).cos() * std
}

fn random_tensor(
    name: &str,
    shape: Vec<usize>,
    dtype: DType,
    rng: &mut ChaCha8Rng,
    f: impl Fn(&mut ChaCha8Rng) -> f32,
) -> HostTensor {
    let n: usize = shape.iter().product();
    let bytes: Vec<u8> = match dtype {
        DType::BF16 => (0..n)
            .flat_map(|_| bf16::from_f32(f(rng)).to_le_bytes())
            .collect(),
        _ => (0..n).flat_map(|_| f(rng).to_le_bytes()).collect(),
    };
    let dtype = if dtype == DType::BF16 {
        DType::BF16
    } else {
        DType::F32
    };
    HostTensor {
        name: name.into(),
        dtype,
        shape,
        data: Bytes::from_vec(bytes),
    }
}

/// Writes `config.json` and a `model.safetensors` of random weights for a `qwen3_5_text` or
/// `qwen4_exp_text` config into `dir` (matrices in `dtype`, norms and GDN constants in F32).
pub fn write_random_checkpoint(config: &Value, dir: &Path, dtype: DType, seed: u64) -> Result<()> {
    let c = TextConfig::from_value(config)?;
    if c.architecture == Architecture::Qwen4ExpText {
        return write_random_qwen4_exp(config, &c, dir, dtype, seed);
    }
    let mut rng = ChaCha8Rng::seed_from_u64(seed);
    let (h, v, i) = (c.hidden_size, c.vocab_size, c.intermediate_size);
    let std = 0.02f32;
    let mut tensors = Vec::new();
    let mat = |name: String, rows: usize, cols: usize, rng: &mut ChaCha8Rng, scale: f32| {
        random_tensor(&name, vec![rows, cols], dtype, rng, |r| normal(r, scale))
    };
    tensors.push(mat("model.embed_tokens.weight".into(), v, h, &mut rng, 1.0));
    for (li, kind) in c.layer_types.iter().enumerate() {
        let p = format!("model.layers.{li}.");
        let small = |name: String, n: usize, rng: &mut ChaCha8Rng| {
            random_tensor(&name, vec![n], DType::F32, rng, |r| normal(r, 0.1))
        };
        tensors.push(small(format!("{p}input_layernorm.weight"), h, &mut rng));
        tensors.push(small(
            format!("{p}post_attention_layernorm.weight"),
            h,
            &mut rng,
        ));
        match kind {
            LayerType::LinearAttention => {
                let (cd, vd, nv, k) = (
                    c.linear_conv_dim(),
                    c.linear_value_dim(),
                    c.linear_num_value_heads,
                    c.linear_conv_kernel_dim,
                );
                let a = format!("{p}linear_attn.");
                tensors.push(mat(format!("{a}in_proj_qkv.weight"), cd, h, &mut rng, std));
                tensors.push(mat(format!("{a}in_proj_z.weight"), vd, h, &mut rng, std));
                tensors.push(mat(format!("{a}in_proj_b.weight"), nv, h, &mut rng, std));
                tensors.push(mat(format!("{a}in_proj_a.weight"), nv, h, &mut rng, std));
                tensors.push(random_tensor(
                    &format!("{a}conv1d.weight"),
                    vec![cd, 1, k],
                    dtype,
                    &mut rng,
                    |r| normal(r, 0.3),
                ));
                tensors.push(random_tensor(
                    &format!("{a}A_log"),
                    vec![nv],
                    DType::F32,
                    &mut rng,
                    |r| r.random_range(0.01f32..16.0).ln(),
                ));
                tensors.push(random_tensor(
                    &format!("{a}dt_bias"),
                    vec![nv],
                    DType::F32,
                    &mut rng,
                    |_| 1.0,
                ));
                tensors.push(random_tensor(
                    &format!("{a}norm.weight"),
                    vec![c.linear_value_head_dim],
                    DType::F32,
                    &mut rng,
                    |r| 1.0 + normal(r, 0.1),
                ));
                tensors.push(mat(format!("{a}out_proj.weight"), h, vd, &mut rng, std));
            }
            LayerType::FullAttention => {
                let (nh, nkv, d) = (c.num_attention_heads, c.num_key_value_heads, c.head_dim);
                let a = format!("{p}self_attn.");
                tensors.push(mat(
                    format!("{a}q_proj.weight"),
                    nh * d * 2,
                    h,
                    &mut rng,
                    std,
                ));
                tensors.push(mat(format!("{a}k_proj.weight"), nkv * d, h, &mut rng, std));
                tensors.push(mat(format!("{a}v_proj.weight"), nkv * d, h, &mut rng, std));
                tensors.push(mat(format!("{a}o_proj.weight"), h, nh * d, &mut rng, std));
                tensors.push(small(format!("{a}q_norm.weight"), d, &mut rng));
                tensors.push(small(format!("{a}k_norm.weight"), d, &mut rng));
            }
        }
        tensors.push(mat(format!("{p}mlp.gate_proj.weight"), i, h, &mut rng, std));
        tensors.push(mat(format!("{p}mlp.up_proj.weight"), i, h, &mut rng, std));
        tensors.push(mat(format!("{p}mlp.down_proj.weight"), h, i, &mut rng, std));
    }
    tensors.push(random_tensor(
        "model.norm.weight",
        vec![h],
        DType::F32,
        &mut rng,
        |r| normal(r, 0.1),
    ));
    if !c.tie_word_embeddings {
        tensors.push(mat("lm_head.weight".into(), v, h, &mut rng, std));
    }
    std::fs::create_dir_all(dir).with_context(|| format!("cannot create {}", dir.display()))?;
    std::fs::write(
        dir.join("config.json"),
        serde_json::to_string_pretty(config)?,
    )?;
    write_safetensors(&dir.join("model.safetensors"), &tensors)
}

/// How the random `qwen4_exp_text` writer draws a tensor, by name (after the reference
/// fixtures' `randomise`: unit-variance embeddings, `1/sqrt(fan_in)` matrices, small offsets
/// for the `(1 + w)` norms, decays and conv taps in their usual ranges).
#[derive(Clone, Copy)]
enum Init {
    Normal(f32),
    /// `1 + N(0, σ)`: the GDN gated norm multiplies by its weight directly.
    OnePlus(f32),
    /// `ln U(0.01, 16)`.
    ALog,
    Const(f32),
}

fn qwen4_exp_init(name: &str, shape: &[usize]) -> (Init, bool) {
    // (how, stored in the matrix dtype rather than F32)
    if name.ends_with("A_log") {
        (Init::ALog, false)
    } else if name.ends_with("dt_bias") {
        (Init::Const(1.0), false)
    } else if name.ends_with("conv1d.weight") {
        (Init::Normal(0.3), true)
    } else if name.ends_with("linear_attn.norm.weight") {
        (Init::OnePlus(0.1), false)
    } else if shape.len() == 1 {
        (Init::Normal(0.1), false)
    } else if name.ends_with("embed_tokens.weight") || name.contains("ngram_embedding.") {
        (Init::Normal(1.0), true)
    } else {
        let fan_in = *shape.last().expect("a matrix has dimensions");
        (Init::Normal(1.0 / (fan_in as f32).sqrt()), true)
    }
}

/// Uniform samples of standard deviation `std`: as good as normal ones for random weights and
/// several times cheaper to draw.
fn uniform(rng: &mut ChaCha8Rng, std: f32) -> f32 {
    (rng.random::<f32>() * 2.0 - 1.0) * std * 3f32.sqrt()
}

/// Writes a random `qwen4_exp_text` checkpoint. Every tensor is drawn in chunks, each from its
/// own generator seeded by `seed`, the tensor's name and the chunk index, so the bytes are the
/// same for a seed however many threads draw them.
fn write_random_qwen4_exp(
    config: &Value,
    c: &TextConfig,
    dir: &Path,
    dtype: DType,
    seed: u64,
) -> Result<()> {
    use rayon::prelude::*;
    const CHUNK: usize = 1 << 16;
    let dtype = if dtype == DType::BF16 {
        DType::BF16
    } else {
        DType::F32
    };
    let tensors = crate::synthetic::qwen4_exp_text_tensors(c)?
        .into_iter()
        .map(|(name, shape)| {
            let (init, matrix) = qwen4_exp_init(&name, &shape);
            let dt = if matrix { dtype } else { DType::F32 };
            let n: usize = shape.iter().product();
            let name_seed = name.bytes().fold(0xcbf2_9ce4_8422_2325u64, |h, b| {
                (h ^ b as u64).wrapping_mul(0x100_0000_01b3)
            });
            let mut bytes = vec![0u8; n * dt.size()];
            bytes
                .par_chunks_mut(CHUNK * dt.size())
                .enumerate()
                .for_each(|(ci, out)| {
                    let mut rng = ChaCha8Rng::seed_from_u64(
                        seed ^ name_seed ^ (ci as u64).wrapping_mul(0x9E37_79B9_7F4A_7C15),
                    );
                    for o in out.chunks_exact_mut(dt.size()) {
                        let v = match init {
                            Init::Normal(std) => uniform(&mut rng, std),
                            Init::OnePlus(std) => 1.0 + uniform(&mut rng, std),
                            Init::ALog => rng.random_range(0.01f32..16.0).ln(),
                            Init::Const(v) => v,
                        };
                        if dt == DType::BF16 {
                            o.copy_from_slice(&bf16::from_f32(v).to_le_bytes());
                        } else {
                            o.copy_from_slice(&v.to_le_bytes());
                        }
                    }
                });
            HostTensor {
                name,
                dtype: dt,
                shape,
                data: Bytes::from_vec(bytes),
            }
        })
        .collect::<Vec<_>>();
    std::fs::create_dir_all(dir).with_context(|| format!("cannot create {}", dir.display()))?;
    std::fs::write(
        dir.join("config.json"),
        serde_json::to_string_pretty(config)?,
    )?;
    write_safetensors(&dir.join("model.safetensors"), &tensors)
}

/// A `qwen3_5_text` config of about `target_params` parameters with the 27B's proportions
/// (head sizes, GDN/attention pattern, MLP ratio), for CPU benchmarks.
pub fn synthetic_dense_config(hidden: usize, layers: usize, vocab: usize) -> Value {
    json!({
        "model_type": "qwen3_5_text",
        "vocab_size": vocab,
        "hidden_size": hidden,
        "intermediate_size": hidden * 17 / 5 / 64 * 64,
        "num_hidden_layers": layers,
        // 24 heads at 5120 like the 27B; rounded to a multiple of the 2 KV heads.
        "num_attention_heads": (hidden * 6 / 5 / 256).div_ceil(2).max(1) * 2,
        "num_key_value_heads": 2,
        "head_dim": 256,
        "linear_num_key_heads": hidden / 320,
        "linear_num_value_heads": hidden / 320 * 3,
        "linear_key_head_dim": 128,
        "linear_value_head_dim": 128,
        "rope_parameters": {"rope_type": "default", "rope_theta": 10000000.0, "partial_rotary_factor": 0.25},
        "eos_token_id": 0
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::backend::cpu::CpuBackend;
    use crate::checkpoint::Checkpoint;
    use crate::model::{self, BatchItem, LogitsWanted};

    #[test]
    fn random_checkpoint_is_deterministic_and_loads() {
        let cfg = json!({
            "model_type": "qwen3_5_text", "vocab_size": 96, "hidden_size": 32, "intermediate_size": 64,
            "num_hidden_layers": 4, "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 16,
            "linear_num_key_heads": 1, "linear_num_value_heads": 2, "linear_key_head_dim": 8,
            "linear_value_head_dim": 8, "eos_token_id": 1
        });
        let a = tempfile::tempdir().unwrap();
        let b = tempfile::tempdir().unwrap();
        write_random_checkpoint(&cfg, a.path(), DType::BF16, 7).unwrap();
        write_random_checkpoint(&cfg, b.path(), DType::BF16, 7).unwrap();
        assert_eq!(
            std::fs::read(a.path().join("model.safetensors")).unwrap(),
            std::fs::read(b.path().join("model.safetensors")).unwrap()
        );
        let ck = Checkpoint::open(a.path()).unwrap();
        let mut lm = model::load(CpuBackend::new(), &ck).unwrap();
        let seq = lm.new_sequence();
        let logits = lm
            .forward(&[BatchItem {
                seq,
                tokens: &[3, 4, 5],
                logits: LogitsWanted::Last,
            }])
            .unwrap();
        assert_eq!(logits[0].len(), 96);
        assert!(logits[0].iter().all(|v| v.is_finite()));
    }

    #[test]
    fn demo_moe_is_reproducible_and_runs_every_flash_next_block() {
        let a = tempfile::tempdir().unwrap();
        let b = tempfile::tempdir().unwrap();
        let da = ensure_demo_model_in("demo-moe", a.path()).unwrap();
        let db = ensure_demo_model_in("demo-moe", b.path()).unwrap();
        // A second call finds the cached copy.
        assert_eq!(ensure_demo_model_in("demo-moe", a.path()).unwrap(), da);
        let bytes = std::fs::read(da.join("model.safetensors")).unwrap();
        assert!(bytes == std::fs::read(db.join("model.safetensors")).unwrap());
        drop(bytes);

        let ck = Checkpoint::open(&da).unwrap();
        assert_eq!(
            ck.config.architecture,
            crate::config::Architecture::Qwen4ExpText
        );
        let f = ck.config.qwen4_exp().unwrap();
        assert!(f.qsa.is_some() && f.ple.is_some() && f.hc_count > 1);
        assert!(f.moe.num_experts > f.moe.num_experts_per_tok);
        assert!(f.ple.as_ref().unwrap().split_ngram_parts > 1);
        assert!(ck
            .weights
            .contains("model.layers.1.ple.ple_embedding.ngram_embedding.shard_1.weight"));
        // The real tokenizer's vocabulary, padded like the published checkpoints.
        assert_eq!(ck.config.vocab_size, 248_320);

        let mut lm = model::load(CpuBackend::new(), &ck).unwrap();
        let prompt: Vec<u32> = (0..40u32).map(|i| (i * 7919 + 13) % 248_077).collect();
        let full = lm.new_sequence();
        let all = lm
            .forward(&[BatchItem {
                seq: full,
                tokens: &prompt,
                logits: LogitsWanted::All,
            }])
            .unwrap()
            .remove(0);
        assert_eq!(all.len(), 40 * 248_320);
        assert!(all.iter().all(|v| v.is_finite()));
        // Prefill then token-by-token decode gives the same logits as one pass.
        let inc = lm.new_sequence();
        lm.forward(&[BatchItem {
            seq: inc,
            tokens: &prompt[..37],
            logits: LogitsWanted::None,
        }])
        .unwrap();
        for (t, &tok) in prompt.iter().enumerate().skip(37) {
            let step = lm
                .forward(&[BatchItem {
                    seq: inc,
                    tokens: &[tok],
                    logits: LogitsWanted::Last,
                }])
                .unwrap()
                .remove(0);
            let want = &all[t * 248_320..(t + 1) * 248_320];
            let diff = step
                .iter()
                .zip(want)
                .map(|(a, b)| (a - b).abs())
                .fold(0f32, f32::max);
            assert!(diff < 1e-3, "position {t}: max |Δ| {diff}");
        }
        // The logits are not degenerate (random weights still distinguish tokens).
        let last = &all[39 * 248_320..];
        let (lo, hi) = last
            .iter()
            .fold((f32::MAX, f32::MIN), |(l, h), &v| (l.min(v), h.max(v)));
        assert!(hi - lo > 1.0, "logit range {lo}..{hi}");
    }

    #[test]
    fn synthetic_config_is_valid() {
        for (h, l) in [(1280, 8), (2048, 16), (2560, 16), (5120, 64)] {
            let c = TextConfig::from_value(&synthetic_dense_config(h, l, 4096)).unwrap();
            assert_eq!(c.num_hidden_layers, l);
        }
        // The 27B's own proportions.
        let c = TextConfig::from_value(&synthetic_dense_config(5120, 64, 248320)).unwrap();
        assert_eq!(
            (
                c.num_attention_heads,
                c.linear_num_key_heads,
                c.linear_num_value_heads,
                c.intermediate_size
            ),
            (24, 16, 48, 17408)
        );
    }
}
