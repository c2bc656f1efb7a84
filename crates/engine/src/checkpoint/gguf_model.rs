//! GGUF checkpoints as models: llama.cpp tensor names and metadata mapped back onto the
//! Hugging Face names, layouts and `config.json` the model files read.
//!
//! Two uses:
//! - **Alone** (`--model FILE.gguf`, or a folder holding one `.gguf` and no `config.json`): a
//!   `qwen35` file (Qwen3.8-27B, `qwen3_5_text`). The configuration comes from the metadata,
//!   every tensor from the file.
//! - **Experts from GGUF, the rest from safetensors** (a Hugging Face folder with a `.gguf`
//!   beside the safetensors): the file's routed-expert tensors `blk.N.ffn_{gate,up,down}_exps`
//!   replace the checkpoint's experts of layer N. For Flash-Next (`qwen4_exp_text`) only these
//!   tensors are taken, from any GGUF that has them: an experts-only file, or a whole `qwen4exp`
//!   file as llama.cpp's converter (conversion/qwen4exp.py) writes it, whose other tensors
//!   (hyper-connections, QSA indexer, PLE) are not mapped here; for a `qwen3_5_text` folder
//!   every `qwen35` tensor of the file replaces its safetensors twin.
//!
//! What llama.cpp's `convert_hf_to_gguf.py` (classes `Qwen3NextModel`,
//! `_LinearAttentionVReorderBase`, `Qwen3_5TextModel`) does to the tensors, undone here:
//! - `(1 + w)` RMSNorm weights (every `*norm.weight` except the GDN gated norm
//!   `linear_attn.norm`) are stored as `w + 1`: 1 is subtracted (exact, then the model adds
//!   it back);
//! - `A_log` is stored as `−exp(A_log)` (`blk.N.ssm_a`): `A_log = ln(−x)`;
//! - `dt_bias` is stored as `blk.N.ssm_dt.bias`;
//! - the conv1d weight `[C, 1, K]` is squeezed to `[C, K]`;
//! - when value heads outnumber key heads, the GDN value heads are reordered from grouped
//!   (`[k0v0, k0v1, …, k1v0, …]`) to tiled (`[k0v0, k1v0, …, k0v1, …]`) order in the V rows of
//!   `in_proj_qkv`, the rows of `in_proj_z`, `in_proj_a`, `in_proj_b`, `A_log`, `dt_bias`, the
//!   V channels of conv1d and the columns of `out_proj`;
//! - the MTP block is written as extra blocks after the last layer (`nextn_predict_layers`
//!   of them) plus `nextn.*` tensors: those are ignored, as transformers ignores MTP.
//!
//! Checked against files written by llama.cpp's own converter and llama-quantize
//! (tests/fixtures/llamacpp_gguf, tools/make_llamacpp_gguf_fixtures.py).
//!
//! The tokenizer is not read from the GGUF metadata: a `tokenizer.json` must sit beside the file.

use crate::config::{Architecture, TextConfig};
use crate::quant::ggml;
use crate::quant::gguf::{GgufFile, GgufTensor, GgufValue};
use crate::tensor::HostTensor;
use anyhow::{bail, Context, Result};
use serde_json::{json, Value};
use std::collections::{BTreeMap, BTreeSet};
use std::path::Path;

/// One step of undoing the converter, applied to the dequantized f32 values in this order.
#[derive(Debug, Clone, Copy, PartialEq)]
enum Undo {
    /// `w + 1` → `w`.
    MinusOne,
    /// `−exp(A_log)` → `A_log`.
    NegExpToLog,
    /// Rows `start..` hold `heads` value heads of `head_dim` rows each in tiled order: put
    /// them back in grouped order.
    UntileRows { start: usize, head_dim: usize },
    /// The same over the columns of a `[rows, heads · head_dim]` matrix.
    UntileCols { head_dim: usize },
}

#[derive(Debug, Clone)]
struct Entry {
    /// Index into the file's tensors.
    tensor: usize,
    /// For a routed-expert tensor `[E, rows, cols]`: which expert.
    expert: Option<usize>,
    /// The Hugging Face shape.
    shape: Vec<usize>,
    undo: Vec<Undo>,
}

/// GGUF tensors under their Hugging Face names.
pub struct GgufWeights {
    file: GgufFile,
    entries: BTreeMap<String, Entry>,
    /// Safetensors name prefixes whose tensors the GGUF ones replace (the experts of a layer).
    shadow_prefixes: Vec<String>,
    /// GDN value-head geometry for untiling: (key heads, value heads).
    heads: (usize, usize),
}

/// The GGUF files of a folder.
pub fn gguf_files(dir: &Path) -> Result<Vec<std::path::PathBuf>> {
    let mut found: Vec<_> = std::fs::read_dir(dir)
        .with_context(|| format!("cannot list {}", dir.display()))?
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| {
            p.extension()
                .is_some_and(|x| x.eq_ignore_ascii_case("gguf"))
        })
        .collect();
    found.sort();
    Ok(found)
}

fn meta_u64(f: &GgufFile, key: &str) -> Result<u64> {
    let v = f.meta(key).with_context(|| {
        format!(
            "{}: metadata {key} is missing; expected a llama.cpp qwen35 GGUF",
            f.path.display()
        )
    })?;
    scalar_u64(v).with_context(|| {
        format!(
            "{}: metadata {key} is {v:?}, expected an integer (or an array of equal integers)",
            f.path.display()
        )
    })
}

fn scalar_u64(v: &GgufValue) -> Option<u64> {
    match v {
        GgufValue::Array(a) => {
            let vals: Vec<u64> = a.iter().filter_map(GgufValue::as_u64).collect();
            (vals.len() == a.len() && !vals.is_empty() && vals.iter().all(|&x| x == vals[0]))
                .then(|| vals[0])
        }
        v => v.as_u64(),
    }
}

fn meta_f64(f: &GgufFile, key: &str) -> Option<f64> {
    f.meta(key).and_then(GgufValue::as_f64)
}

/// The `qwen3_5_text` `config.json` that a `qwen35` GGUF file's metadata describes.
pub fn config_from_metadata(f: &GgufFile) -> Result<Value> {
    let arch = f
        .meta("general.architecture")
        .and_then(GgufValue::as_str)
        .with_context(|| {
            format!(
                "{}: metadata general.architecture is missing",
                f.path.display()
            )
        })?;
    if arch != "qwen35" {
        bail!(
            "{}: GGUF architecture \"{arch}\" is not supported alone; expected \"qwen35\" (Qwen3.8-27B). \
             For Flash-Next, put the GGUF experts in the Hugging Face folder beside config.json and the safetensors \
             (experts from GGUF, the rest from safetensors)",
            f.path.display()
        );
    }
    let k = |s: &str| format!("{arch}.{s}");
    let blocks = meta_u64(f, &k("block_count"))? as usize;
    let mtp = f
        .meta(&k("nextn_predict_layers"))
        .and_then(scalar_u64)
        .unwrap_or(0) as usize;
    if mtp >= blocks {
        bail!(
            "{}: {arch}.nextn_predict_layers = {mtp} leaves no layers of {blocks}",
            f.path.display()
        );
    }
    let layers = blocks - mtp;
    let hidden = meta_u64(f, &k("embedding_length"))? as usize;
    let heads = meta_u64(f, &k("attention.head_count"))? as usize;
    let kv_heads = meta_u64(f, &k("attention.head_count_kv"))? as usize;
    let head_dim = f
        .meta(&k("attention.key_length"))
        .and_then(scalar_u64)
        .map(|v| v as usize)
        .unwrap_or(hidden / heads.max(1));
    let rope_dims = f
        .meta(&k("rope.dimension_count"))
        .and_then(scalar_u64)
        .map(|v| v as usize)
        .unwrap_or(head_dim / 4);
    let mut sections: Vec<u64> = f
        .meta(&k("rope.dimension_sections"))
        .and_then(GgufValue::as_array)
        .map(|a| a.iter().filter_map(GgufValue::as_u64).collect())
        .unwrap_or_else(|| vec![11, 11, 10]);
    sections.truncate(3);
    let v_heads = meta_u64(f, &k("ssm.time_step_rank"))? as usize;
    let inner = meta_u64(f, &k("ssm.inner_size"))? as usize;
    if v_heads == 0 || !inner.is_multiple_of(v_heads) {
        bail!(
            "{}: {arch}.ssm.inner_size {inner} is not a multiple of ssm.time_step_rank {v_heads}",
            f.path.display()
        );
    }
    let embd = f
        .get("token_embd.weight")
        .with_context(|| format!("{}: tensor token_embd.weight is missing", f.path.display()))?;
    let vocab = f
        .meta(&k("vocab_size"))
        .and_then(scalar_u64)
        .map(|v| v as usize)
        .unwrap_or(embd.shape()[0]);
    // Layer kinds from the tensors: a GDN block has attn_qkv, a full-attention block attn_q
    // (the converter writes only full_attention_interval, which cannot express every pattern).
    let mut layer_types = Vec::with_capacity(layers);
    for i in 0..layers {
        let linear = f.get(&format!("blk.{i}.attn_qkv.weight")).is_some();
        let full = f.get(&format!("blk.{i}.attn_q.weight")).is_some();
        layer_types.push(match (linear, full) {
            (true, false) => "linear_attention",
            (false, true) => "full_attention",
            _ => bail!(
                "{}: block {i} has {} attention tensors; expected either blk.{i}.attn_qkv.weight (Gated DeltaNet) or blk.{i}.attn_q.weight (full attention)",
                f.path.display(),
                if linear { "both kinds of" } else { "no" }
            ),
        });
    }
    // Newer converters also write which blocks are recurrent (MTP blocks last, false): it must
    // agree with the tensors, or the file is not what its metadata says.
    if let Some(flags) = f
        .meta(&k("attention.recurrent_layers"))
        .and_then(GgufValue::as_array)
    {
        if flags.len() < layers {
            bail!(
                "{}: {arch}.attention.recurrent_layers has {} entries; expected one per block ({blocks})",
                f.path.display(),
                flags.len()
            );
        }
        for (i, (flag, kind)) in flags.iter().zip(&layer_types).enumerate() {
            let recurrent = flag.as_bool().with_context(|| {
                format!(
                    "{}: {arch}.attention.recurrent_layers[{i}] is {flag:?}, expected a bool",
                    f.path.display()
                )
            })?;
            if recurrent != (*kind == "linear_attention") {
                bail!(
                    "{}: {arch}.attention.recurrent_layers[{i}] = {recurrent} but block {i} has {} tensors; the metadata and the tensors disagree",
                    f.path.display(),
                    if *kind == "linear_attention" { "Gated DeltaNet (attn_qkv)" } else { "full-attention (attn_q)" }
                );
            }
        }
    }
    let tok = |key: &str| f.meta(key).and_then(GgufValue::as_u64);
    let mut cfg = json!({
        "architectures": ["Qwen3_5ForCausalLM"],
        "model_type": "qwen3_5_text",
        "vocab_size": vocab,
        "hidden_size": hidden,
        "intermediate_size": meta_u64(f, &k("feed_forward_length"))?,
        "num_hidden_layers": layers,
        "num_attention_heads": heads,
        "num_key_value_heads": kv_heads,
        "head_dim": head_dim,
        "rms_norm_eps": meta_f64(f, &k("attention.layer_norm_rms_epsilon")).unwrap_or(1e-6),
        "max_position_embeddings": f.meta(&k("context_length")).and_then(scalar_u64).unwrap_or(262_144),
        "tie_word_embeddings": f.get("output.weight").is_none(),
        "hidden_act": "silu",
        "rope_parameters": {
            "rope_type": "default",
            "rope_theta": meta_f64(f, &k("rope.freq_base")).unwrap_or(1e7),
            "partial_rotary_factor": rope_dims as f64 / head_dim as f64,
            "mrope_section": sections,
            "mrope_interleaved": true,
        },
        "linear_conv_kernel_dim": meta_u64(f, &k("ssm.conv_kernel"))?,
        "linear_key_head_dim": meta_u64(f, &k("ssm.state_size"))?,
        "linear_num_key_heads": meta_u64(f, &k("ssm.group_count"))?,
        "linear_num_value_heads": v_heads,
        "linear_value_head_dim": inner / v_heads,
        "layer_types": layer_types,
    });
    if let Some(e) = tok("tokenizer.ggml.eos_token_id") {
        cfg["eos_token_id"] = json!(e);
    }
    if let Some(b) = tok("tokenizer.ggml.bos_token_id") {
        cfg["bos_token_id"] = json!(b);
    }
    if let Some(p) = tok("tokenizer.ggml.padding_token_id") {
        cfg["pad_token_id"] = json!(p);
    }
    Ok(cfg)
}

/// A GGUF block name → (Hugging Face name within the layer, undo steps) for `qwen35`.
fn layer_tensor(rest: &str, c: &TextConfig) -> Option<(&'static str, Vec<Undo>)> {
    let kd = c.linear_key_head_dim * c.linear_num_key_heads;
    let vd = c.linear_value_head_dim;
    let tiled = c.linear_num_value_heads != c.linear_num_key_heads;
    let untile = |start: usize, head_dim: usize| {
        if tiled {
            vec![Undo::UntileRows { start, head_dim }]
        } else {
            vec![]
        }
    };
    Some(match rest {
        "attn_norm.weight" => ("input_layernorm.weight", vec![Undo::MinusOne]),
        "post_attention_norm.weight" => ("post_attention_layernorm.weight", vec![Undo::MinusOne]),
        "attn_q.weight" => ("self_attn.q_proj.weight", vec![]),
        "attn_k.weight" => ("self_attn.k_proj.weight", vec![]),
        "attn_v.weight" => ("self_attn.v_proj.weight", vec![]),
        "attn_output.weight" => ("self_attn.o_proj.weight", vec![]),
        "attn_q_norm.weight" => ("self_attn.q_norm.weight", vec![Undo::MinusOne]),
        "attn_k_norm.weight" => ("self_attn.k_norm.weight", vec![Undo::MinusOne]),
        "attn_qkv.weight" => ("linear_attn.in_proj_qkv.weight", untile(2 * kd, vd)),
        "attn_gate.weight" => ("linear_attn.in_proj_z.weight", untile(0, vd)),
        "ssm_beta.weight" => ("linear_attn.in_proj_b.weight", untile(0, 1)),
        "ssm_alpha.weight" => ("linear_attn.in_proj_a.weight", untile(0, 1)),
        "ssm_a" => ("linear_attn.A_log", {
            let mut u = vec![Undo::NegExpToLog];
            u.extend(untile(0, 1));
            u
        }),
        "ssm_dt.bias" => ("linear_attn.dt_bias", untile(0, 1)),
        "ssm_conv1d.weight" => ("linear_attn.conv1d.weight", untile(2 * kd, vd)),
        "ssm_norm.weight" => ("linear_attn.norm.weight", vec![]),
        "ssm_out.weight" => (
            "linear_attn.out_proj.weight",
            if tiled {
                vec![Undo::UntileCols { head_dim: vd }]
            } else {
                vec![]
            },
        ),
        "ffn_gate.weight" => ("mlp.gate_proj.weight", vec![]),
        "ffn_up.weight" => ("mlp.up_proj.weight", vec![]),
        "ffn_down.weight" => ("mlp.down_proj.weight", vec![]),
        _ => return None,
    })
}

/// `blk.N.ffn_{gate,up,down}_exps.weight` → the per-expert projection name.
fn expert_tensor(rest: &str) -> Option<&'static str> {
    Some(match rest {
        "ffn_gate_exps.weight" => "gate_proj.weight",
        "ffn_up_exps.weight" => "up_proj.weight",
        "ffn_down_exps.weight" => "down_proj.weight",
        _ => return None,
    })
}

impl GgufWeights {
    /// Maps a GGUF file's tensors onto the Hugging Face names of the model `c` describes.
    /// `prefix` is where the text model's tensors live (`model.` or `model.language_model.`).
    /// `alone`: the file is the whole checkpoint (every tensor must map, and the embedding
    /// must be there); otherwise it replaces part of a safetensors checkpoint.
    pub fn map(file: GgufFile, c: &TextConfig, prefix: &str, alone: bool) -> Result<GgufWeights> {
        let path = file.path.display().to_string();
        let arch = file
            .meta("general.architecture")
            .and_then(GgufValue::as_str)
            .unwrap_or("")
            .to_string();
        let experts_only = c.architecture == Architecture::Qwen4ExpText;
        if !experts_only && arch != "qwen35" {
            bail!("{path}: GGUF architecture \"{arch}\" does not match the qwen3_5_text checkpoint; expected \"qwen35\"");
        }
        let layers = c.num_hidden_layers;
        let mut entries = BTreeMap::new();
        let mut shadow = BTreeSet::new();
        for (i, t) in file.tensors.iter().enumerate() {
            let shape = t.shape();
            let mut put =
                |hf: String, expert: Option<usize>, shape: Vec<usize>, undo: Vec<Undo>| {
                    entries.insert(
                        hf,
                        Entry {
                            tensor: i,
                            expert,
                            shape,
                            undo,
                        },
                    );
                };
            if let Some(rest) = t.name.strip_prefix("blk.") {
                let (n, rest) = rest.split_once('.').unwrap_or((rest, ""));
                let Ok(n) = n.parse::<usize>() else {
                    bail!(
                        "{path}: tensor {}: block index {n:?} is not a number",
                        t.name
                    );
                };
                if n >= layers || rest.starts_with("nextn.") {
                    continue; // the MTP block(s), ignored like transformers does
                }
                let p = format!("{prefix}layers.{n}.");
                if let Some(proj) = expert_tensor(rest) {
                    if shape.len() != 3 {
                        bail!(
                            "{path}: tensor {} has shape {shape:?}; expected [experts, rows, cols]",
                            t.name
                        );
                    }
                    for e in 0..shape[0] {
                        put(
                            format!("{p}mlp.experts.{e}.{proj}"),
                            Some(e),
                            shape[1..].to_vec(),
                            vec![],
                        );
                    }
                    shadow.insert(format!("{p}mlp.experts."));
                    continue;
                }
                if experts_only {
                    continue;
                }
                let Some((hf, undo)) = layer_tensor(rest, c) else {
                    if alone {
                        bail!(
                            "{path}: tensor {} is not a qwen35 tensor this engine knows; expected one of attn_norm, post_attention_norm, attn_q/k/v/output(_norm), attn_qkv, attn_gate, ssm_*, ffn_gate/up/down",
                            t.name
                        );
                    }
                    continue;
                };
                let hf_shape = if rest == "ssm_conv1d.weight" {
                    if shape.len() != 2 {
                        bail!("{path}: tensor {} has shape {shape:?}; expected the squeezed conv weight [channels, kernel]", t.name);
                    }
                    vec![shape[0], 1, shape[1]]
                } else {
                    shape
                };
                put(format!("{p}{hf}"), None, hf_shape, undo);
                continue;
            }
            if experts_only {
                continue;
            }
            let top = match t.name.as_str() {
                "token_embd.weight" => Some(("embed_tokens.weight", vec![])),
                "output_norm.weight" => Some(("norm.weight", vec![Undo::MinusOne])),
                _ => None,
            };
            if let Some((hf, undo)) = top {
                put(format!("{prefix}{hf}"), None, shape, undo);
            } else if t.name == "output.weight" {
                put("lm_head.weight".into(), None, shape, vec![]);
            } else if alone && !matches!(t.name.as_str(), "rope_freqs.weight") {
                bail!(
                    "{path}: tensor {} is not a qwen35 tensor this engine knows",
                    t.name
                );
            }
        }
        if alone && !entries.contains_key(&format!("{prefix}embed_tokens.weight")) {
            bail!("{path}: tensor token_embd.weight is missing");
        }
        if experts_only && shadow.is_empty() {
            bail!(
                "{path}: no routed-expert tensors (blk.N.ffn_gate_exps / ffn_up_exps / ffn_down_exps); for a qwen4_exp_text checkpoint only the experts are read from GGUF"
            );
        }
        Ok(GgufWeights {
            file,
            entries,
            shadow_prefixes: shadow.into_iter().collect(),
            heads: (c.linear_num_key_heads, c.linear_num_value_heads),
        })
    }

    pub fn path(&self) -> &Path {
        &self.file.path
    }

    pub fn file(&self) -> &GgufFile {
        &self.file
    }

    pub fn contains(&self, name: &str) -> bool {
        self.entries.contains_key(name)
    }

    pub fn names(&self) -> impl Iterator<Item = &str> {
        self.entries.keys().map(String::as_str)
    }

    /// Whether a safetensors tensor is replaced by this file's tensors.
    pub fn shadows(&self, name: &str) -> bool {
        self.entries.contains_key(name) || self.shadow_prefixes.iter().any(|p| name.starts_with(p))
    }

    /// The GGUF tensor a name maps to and, for experts, which one.
    pub fn source_of(&self, name: &str) -> Option<(&GgufTensor, Option<usize>)> {
        self.entries
            .get(name)
            .map(|e| (&self.file.tensors[e.tensor], e.expert))
    }

    /// Whether `name` is the GGUF tensor's data as it is (no converter transform to undo).
    pub fn is_verbatim(&self, name: &str) -> bool {
        self.entries.get(name).is_some_and(|e| e.undo.is_empty())
    }

    /// The tensor `name` dequantized to f32 in the Hugging Face layout.
    pub fn get(&self, name: &str) -> Result<HostTensor> {
        let e = self
            .entries
            .get(name)
            .with_context(|| format!("tensor {name} is not in {}", self.file.path.display()))?;
        let t = &self.file.tensors[e.tensor];
        let ctx = || format!("tensor {} ({name}) in {}", t.name, self.file.path.display());
        let mut data = self.file.data(t);
        let numel: usize = e.shape.iter().product();
        if let Some(x) = e.expert {
            let per = t.bytes / t.shape()[0];
            data = &data[x * per..(x + 1) * per];
        }
        let mut v = vec![0f32; numel];
        ggml::dequantize(t.ty, data, &mut v).with_context(ctx)?;
        let (nk, nv) = self.heads;
        let r = nv / nk.max(1);
        for u in &e.undo {
            match *u {
                Undo::MinusOne => v.iter_mut().for_each(|x| *x -= 1.0),
                Undo::NegExpToLog => {
                    if let Some(bad) = v
                        .iter()
                        .find(|x| x.partial_cmp(&&0.0) != Some(std::cmp::Ordering::Less))
                    {
                        bail!(
                            "{}: expected −exp(A_log) < 0 everywhere, found {bad}",
                            ctx()
                        );
                    }
                    v.iter_mut().for_each(|x| *x = (-*x).ln());
                }
                Undo::UntileRows { start, head_dim } => {
                    let rows = e.shape[0];
                    let cols = numel / rows;
                    let span = nv * head_dim;
                    if start + span != rows {
                        bail!(
                            "{}: shape {:?}: expected {nv} value heads × {head_dim} rows from row {start}, i.e. {} rows",
                            ctx(),
                            e.shape,
                            start + span
                        );
                    }
                    let block = head_dim * cols;
                    let tiled = v[start * cols..].to_vec();
                    let dst = &mut v[start * cols..];
                    for g in 0..nk {
                        for j in 0..r {
                            let (from, to) = ((j * nk + g) * block, (g * r + j) * block);
                            dst[to..to + block].copy_from_slice(&tiled[from..from + block]);
                        }
                    }
                }
                Undo::UntileCols { head_dim } => {
                    let cols = *e.shape.last().unwrap();
                    if cols != nv * head_dim {
                        bail!(
                            "{}: shape {:?}: expected {nv} value heads × {head_dim} columns",
                            ctx(),
                            e.shape
                        );
                    }
                    for row in v.chunks_exact_mut(cols) {
                        let tiled = row.to_vec();
                        for g in 0..nk {
                            for j in 0..r {
                                let (from, to) = ((j * nk + g) * head_dim, (g * r + j) * head_dim);
                                row[to..to + head_dim]
                                    .copy_from_slice(&tiled[from..from + head_dim]);
                            }
                        }
                    }
                }
            }
        }
        Ok(HostTensor::from_f32(name, e.shape.clone(), &v))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn scalar_metadata_accepts_uniform_arrays_only() {
        let a = GgufValue::Array(vec![GgufValue::U32(4), GgufValue::U32(4)]);
        assert_eq!(scalar_u64(&a), Some(4));
        let b = GgufValue::Array(vec![GgufValue::U32(4), GgufValue::U32(2)]);
        assert_eq!(scalar_u64(&b), None);
        assert_eq!(scalar_u64(&GgufValue::I32(7)), Some(7));
    }
}
