//! The weights of a checkpoint as the model files see them: full-precision tensors by their
//! Hugging Face names, whatever the files store.
//!
//! - Plain safetensors tensors are borrowed from the memory map as they are.
//! - Quantized safetensors weights are dequantized to f32 when they are read (the exact path):
//!   ModelOpt NVFP4 (`weight` U8 packed E2M1 codes, `weight_scale` F8_E4M3 per 16 values,
//!   `weight_scale_2` F32 multiplier, `input_scale` unused here) and FP8 E4M3 (`weight_scale_inv`
//!   or `weight_scale`: 128×128 blocks, per row, or one per tensor). Modules the quantization
//!   config excludes are stored in BF16 and read as they are. The scale tensors are hidden from
//!   [`Weights::names`], so a dequantized weight looks exactly like a full-precision one.
//! - GGUF tensors (see [`super::gguf_model`]) are dequantized and mapped back to the Hugging
//!   Face names and layouts (undoing the llama.cpp converter's transforms); they take the place
//!   of the safetensors tensors they stand for.
//!
//! Every error names the tensor and says what was expected.

use super::gguf_model::GgufWeights;
use super::safetensors::SafetensorStore;
use crate::quant::fp8::{self, Fp8Scaling};
use crate::quant::nvfp4::{Nvfp4Matrix, GROUP};
use crate::tensor::{DType, HostTensor};
use anyhow::{bail, Context, Result};
use serde_json::Value;
use std::collections::BTreeSet;
use std::path::Path;

/// Name endings of the tensors that only describe how another tensor is quantized.
const SCALE_SUFFIXES: [&str; 6] = [
    ".weight_scale",
    ".weight_scale_2",
    ".weight_scale_inv",
    ".input_scale",
    ".k_scale",
    ".v_scale",
];

/// What the checkpoint's quantization config says (`hf_quant_config.json`, or
/// `quantization_config` in `config.json`).
#[derive(Debug, Clone, Default)]
pub struct QuantConfig {
    /// Where it was read from (for messages).
    pub source: String,
    /// `quant_algo` / `quant_method` as written (`NVFP4`, `FP8`, `MIXED_PRECISION`, `fp8`, …).
    pub algo: String,
    /// FP8 block size `[rows, cols]` (`weight_block_size`); 128×128 when absent.
    pub block: [usize; 2],
    /// Modules left in full precision (`exclude_modules` / `ignore`).
    pub exclude: Vec<String>,
}

impl QuantConfig {
    /// Reads the quantization config of a model folder, if it has one.
    pub fn from_dir(dir: &Path) -> Result<Option<QuantConfig>> {
        let hf = dir.join("hf_quant_config.json");
        if hf.is_file() {
            let v = read_json(&hf)?;
            let q = v.get("quantization").unwrap_or(&v);
            return Self::from_value(q, &hf.display().to_string()).map(Some);
        }
        let cfg = dir.join("config.json");
        if cfg.is_file() {
            let v = read_json(&cfg)?;
            let q = v
                .get("quantization_config")
                .or_else(|| v.get("text_config")?.get("quantization_config"));
            if let Some(q) = q {
                let src = format!("{} (quantization_config)", cfg.display());
                return Self::from_value(q, &src).map(Some);
            }
        }
        Ok(None)
    }

    fn from_value(q: &Value, source: &str) -> Result<QuantConfig> {
        let algo = q
            .get("quant_algo")
            .or_else(|| q.get("quant_method"))
            .and_then(Value::as_str)
            .unwrap_or("")
            .to_string();
        if let Some(g) = q.get("group_size").and_then(Value::as_u64) {
            if algo.eq_ignore_ascii_case("nvfp4") && g as usize != GROUP {
                bail!("{source}: NVFP4 group_size is {g}; ModelOpt NVFP4 uses one scale per {GROUP} values");
            }
        }
        let block = match q.get("weight_block_size") {
            None | Some(Value::Null) => [128, 128],
            Some(v) => {
                let b: Vec<usize> = v
                    .as_array()
                    .map(|a| {
                        a.iter()
                            .filter_map(|x| x.as_u64().map(|x| x as usize))
                            .collect()
                    })
                    .unwrap_or_default();
                if b.len() != 2 || b.contains(&0) {
                    bail!("{source}: weight_block_size is {v}; expected two positive integers such as [128, 128]");
                }
                [b[0], b[1]]
            }
        };
        let exclude = q
            .get("exclude_modules")
            .or_else(|| q.get("ignore"))
            .or_else(|| q.get("modules_to_not_convert"))
            .and_then(Value::as_array)
            .map(|a| {
                a.iter()
                    .filter_map(|x| x.as_str().map(str::to_owned))
                    .collect()
            })
            .unwrap_or_default();
        Ok(QuantConfig {
            source: source.to_string(),
            algo,
            block,
            exclude,
        })
    }

    /// Whether `module` (a tensor name without `.weight`) is excluded from quantization
    /// (patterns may end in `*`, and may omit the `model.` / `model.language_model.` prefix).
    pub fn is_excluded(&self, module: &str) -> bool {
        self.exclude.iter().any(|p| {
            let matches = |m: &str| match p.strip_suffix('*') {
                Some(stem) => m.starts_with(stem),
                None => m == p,
            };
            matches(module)
                || module
                    .strip_prefix("model.language_model.")
                    .or_else(|| module.strip_prefix("model."))
                    .is_some_and(|m| matches(m) || matches(&format!("model.{m}")))
        })
    }
}

fn read_json(path: &Path) -> Result<Value> {
    let text =
        std::fs::read_to_string(path).with_context(|| format!("cannot read {}", path.display()))?;
    serde_json::from_str(&text).with_context(|| format!("{} is not valid JSON", path.display()))
}

/// All tensors of a checkpoint, by Hugging Face name, in full precision.
pub struct Weights {
    store: SafetensorStore,
    quant: Option<QuantConfig>,
    gguf: Option<GgufWeights>,
    /// The names the model sees.
    names: BTreeSet<String>,
}

impl From<SafetensorStore> for Weights {
    fn from(store: SafetensorStore) -> Self {
        Weights::new(store, None, None)
    }
}

impl Weights {
    /// Safetensors tensors (quantized ones are dequantized when read), with the GGUF tensors
    /// (if any) in place of the safetensors tensors they stand for.
    pub fn new(
        store: SafetensorStore,
        quant: Option<QuantConfig>,
        gguf: Option<GgufWeights>,
    ) -> Weights {
        let mut names: BTreeSet<String> = store
            .names()
            .filter(|n| !is_scale_name(n) || !store.contains(&base_weight(n)))
            .filter(|n| gguf.as_ref().is_none_or(|g| !g.shadows(n)))
            .map(str::to_owned)
            .collect();
        if let Some(g) = &gguf {
            names.extend(g.names().map(str::to_owned));
        }
        Weights {
            store,
            quant,
            gguf,
            names,
        }
    }

    /// The raw safetensors tensors (quantized ones as stored, scales included).
    pub fn store(&self) -> &SafetensorStore {
        &self.store
    }

    pub fn quant_config(&self) -> Option<&QuantConfig> {
        self.quant.as_ref()
    }

    pub fn gguf(&self) -> Option<&GgufWeights> {
        self.gguf.as_ref()
    }

    pub fn contains(&self, name: &str) -> bool {
        self.names.contains(name)
    }

    /// The tensor names the model sees (scale tensors of quantized weights left out).
    pub fn names(&self) -> impl Iterator<Item = &str> {
        self.names.iter().map(String::as_str)
    }

    /// The file a tensor comes from (for error messages).
    pub fn file_of(&self, name: &str) -> Option<&Path> {
        if let Some(g) = &self.gguf {
            if g.contains(name) {
                return Some(g.path());
            }
        }
        self.store.file_of(name)
    }

    /// The tensor called `name`: as stored when it is a full-precision tensor, dequantized to
    /// F32 when it is a quantized weight (NVFP4, FP8, a GGUF block type).
    pub fn get(&self, name: &str) -> Result<HostTensor> {
        if let Some(g) = &self.gguf {
            if g.contains(name) {
                return g.get(name);
            }
        }
        let t = self.store.get(name)?;
        match t.dtype {
            DType::U8 if name.ends_with(".weight") => self.nvfp4(t),
            DType::F8E4M3 if name.ends_with(".weight") => self.fp8(t),
            _ => {
                if let (Some(q), Some(module)) = (&self.quant, name.strip_suffix(".weight")) {
                    let scaled = [".weight_scale", ".weight_scale_inv"]
                        .iter()
                        .find(|s| self.store.contains(&format!("{module}{s}")));
                    if let Some(s) = scaled {
                        bail!(
                            "tensor {name} is {} {:?} but has a scale tensor {module}{s}: a quantized weight must be U8 (NVFP4) or F8_E4M3 (FP8); the checkpoint does not match {}",
                            t.dtype,
                            t.shape,
                            q.source
                        );
                    }
                }
                Ok(t)
            }
        }
    }

    fn scale(&self, weight: &str, suffix: &str, format: &str) -> Result<HostTensor> {
        let module = weight.strip_suffix(".weight").unwrap_or(weight);
        let name = format!("{module}.{suffix}");
        if !self.store.contains(&name) {
            let excluded = if self.quant.as_ref().is_some_and(|q| q.is_excluded(module)) {
                " (the quantization config lists the module as excluded, yet its weight is quantized)"
            } else {
                ""
            };
            bail!(
                "{format} weight {weight}: scale tensor {name} is missing from the checkpoint{excluded}; the file is incomplete or not a {format} export"
            );
        }
        self.store.get(&name)
    }

    /// ModelOpt NVFP4: `[.., N, K/2]` codes, `[.., N, K/16]` E4M3 scales, `weight_scale_2` per
    /// tensor (or one per leading index).
    fn nvfp4(&self, w: HostTensor) -> Result<HostTensor> {
        let name = w.name.clone();
        let scale = self.scale(&name, "weight_scale", "NVFP4")?;
        let scale_2 = self.scale(&name, "weight_scale_2", "NVFP4")?;
        if w.shape.len() < 2 {
            bail!(
                "NVFP4 weight {name}: expected a 2-D (or stacked 3-D) U8 tensor of packed codes, found shape {:?}",
                w.shape
            );
        }
        let dims = w.shape.len();
        let (n, half_k) = (w.shape[dims - 2], w.shape[dims - 1]);
        let k = half_k * 2;
        let batch: usize = w.shape[..dims - 2].iter().product();
        if !k.is_multiple_of(GROUP) {
            bail!(
                "NVFP4 weight {name}: K = {k} (shape {:?}) is not a multiple of {GROUP}",
                w.shape
            );
        }
        let mut want_scale = w.shape.clone();
        want_scale[dims - 1] = k / GROUP;
        if scale.dtype != DType::F8E4M3 || scale.shape != want_scale {
            bail!(
                "NVFP4 weight {name} {:?}: expected {} as F8_E4M3 {want_scale:?} (one scale per {GROUP} values), found {} {:?}",
                w.shape,
                scale.name,
                scale.dtype,
                scale.shape
            );
        }
        let s2 = scale_2
            .to_f32()
            .with_context(|| format!("NVFP4 weight {name}: reading {}", scale_2.name))?;
        if s2.len() != 1 && s2.len() != batch {
            bail!(
                "NVFP4 weight {name} {:?}: expected {} to hold 1 value (or {batch}, one per stacked matrix), found shape {:?}",
                w.shape,
                scale_2.name,
                scale_2.shape
            );
        }
        let (codes, scales) = (w.data.as_slice(), scale.data.as_slice());
        let (mat_codes, mat_scales) = (n * half_k, n * k / GROUP);
        let mut out = Vec::with_capacity(batch * n * k);
        for b in 0..batch {
            let m = Nvfp4Matrix::new(
                &name,
                n,
                k,
                &codes[b * mat_codes..(b + 1) * mat_codes],
                &scales[b * mat_scales..(b + 1) * mat_scales],
                s2[if s2.len() == 1 { 0 } else { b }],
            )?;
            out.extend(m.to_f32());
        }
        let mut shape = w.shape.clone();
        shape[dims - 1] = k;
        Ok(HostTensor::from_f32(&name, shape, &out))
    }

    /// FP8 E4M3 with block scales (`[ceil(N/bn), ceil(K/bk)]`), row scales (`[N]`, `[N, 1]`) or
    /// one scale per tensor.
    fn fp8(&self, w: HostTensor) -> Result<HostTensor> {
        let name = w.name.clone();
        let module = name.strip_suffix(".weight").unwrap_or(&name);
        let suffix = if self.store.contains(&format!("{module}.weight_scale_inv")) {
            "weight_scale_inv"
        } else {
            "weight_scale"
        };
        let scale = self.scale(&name, suffix, "FP8")?;
        if w.shape.len() != 2 {
            bail!(
                "FP8 weight {name}: expected a 2-D F8_E4M3 tensor, found shape {:?}",
                w.shape
            );
        }
        let (n, k) = (w.shape[0], w.shape[1]);
        let s = scale
            .to_f32()
            .with_context(|| format!("FP8 weight {name}: reading {}", scale.name))?;
        let [bn, bk] = self.quant.as_ref().map(|q| q.block).unwrap_or([128, 128]);
        let block_shape = [n.div_ceil(bn), k.div_ceil(bk)];
        let (values, scaling) = if scale.shape == block_shape && s.len() != n {
            (s, Fp8Scaling::Block { rows: bn, cols: bk })
        } else if scale.shape == [n] || scale.shape == [n, 1] {
            (s, Fp8Scaling::Row)
        } else if s.len() == 1 {
            (vec![s[0]; n], Fp8Scaling::Row)
        } else if scale.shape == block_shape {
            (s, Fp8Scaling::Block { rows: bn, cols: bk })
        } else {
            bail!(
                "FP8 weight {name} [{n}, {k}]: scale tensor {} has shape {:?}; expected {block_shape:?} ({bn}×{bk} blocks), [{n}] or [{n}, 1] (rows), or one value",
                scale.name,
                scale.shape
            );
        };
        let out = fp8::dequantize(&name, w.data.as_slice(), n, k, &values, scaling)?;
        Ok(HostTensor::from_f32(&name, vec![n, k], &out))
    }
}

fn is_scale_name(n: &str) -> bool {
    SCALE_SUFFIXES.iter().any(|s| n.ends_with(s))
}

/// `x.weight_scale` → `x.weight` (and likewise for the other scale names).
fn base_weight(n: &str) -> String {
    let module = SCALE_SUFFIXES
        .iter()
        .find_map(|s| n.strip_suffix(s))
        .unwrap_or(n);
    format!("{module}.weight")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn exclusion_patterns_match_with_and_without_prefix() {
        let q = QuantConfig {
            exclude: vec!["lm_head".into(), "model.layers.0.linear_attn*".into()],
            ..Default::default()
        };
        assert!(q.is_excluded("lm_head"));
        assert!(q.is_excluded("model.layers.0.linear_attn.in_proj_qkv"));
        assert!(q.is_excluded("model.language_model.layers.0.linear_attn.out_proj"));
        assert!(!q.is_excluded("model.layers.1.linear_attn.out_proj"));
    }

    #[test]
    fn scale_names_map_to_their_weight() {
        assert_eq!(base_weight("a.b.weight_scale_2"), "a.b.weight");
        assert_eq!(base_weight("a.b.weight_scale_inv"), "a.b.weight");
        assert!(is_scale_name("a.k_proj.k_scale") && !is_scale_name("a.weight"));
    }
}
