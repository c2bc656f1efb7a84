//! A checkpoint as users download it: a Hugging Face model folder.
//!
//! `config.json`, the weights (single or sharded safetensors), and the tokenizer and generation
//! files. Everything is checked before the model is built, and every error names the file.

pub mod gguf_model;
pub mod quant_experts;
pub mod safetensors;
pub mod weights;

use crate::config::TextConfig;
use anyhow::{bail, Context, Result};
use serde::Deserialize;
use std::path::{Path, PathBuf};

pub use self::quant_experts::{quantized_expert_set, QuantRows};
pub use self::safetensors::{write_safetensors, SafetensorStore};
pub use self::weights::{QuantConfig, Weights};

/// `generation_config.json`: the checkpoint's default sampling settings.
#[derive(Debug, Clone, Default, Deserialize, serde::Serialize)]
pub struct GenerationConfig {
    #[serde(default)]
    pub temperature: Option<f32>,
    #[serde(default)]
    pub top_p: Option<f32>,
    #[serde(default)]
    pub top_k: Option<usize>,
    #[serde(default)]
    pub min_p: Option<f32>,
    #[serde(default)]
    pub repetition_penalty: Option<f32>,
    #[serde(default)]
    pub presence_penalty: Option<f32>,
    #[serde(default)]
    pub do_sample: Option<bool>,
    #[serde(default)]
    pub eos_token_id: Option<serde_json::Value>,
}

/// An opened checkpoint folder.
pub struct Checkpoint {
    pub dir: PathBuf,
    pub config: TextConfig,
    /// Every tensor by its Hugging Face name, in full precision (quantized safetensors and
    /// GGUF tensors are dequantized when read; see [`weights`]).
    pub weights: Weights,
    pub generation: GenerationConfig,
}

impl Checkpoint {
    /// Opens a model: a Hugging Face folder (`config.json`, safetensors, optionally quantized,
    /// optionally with a `.gguf` of routed experts beside them), a GGUF file, or a folder that
    /// holds one GGUF file and no `config.json`. Reads `generation_config.json` when present.
    pub fn open(dir: &Path) -> Result<Self> {
        if !dir.exists() {
            bail!("model folder {} does not exist", dir.display());
        }
        if dir.is_file()
            && dir
                .extension()
                .is_some_and(|x| x.eq_ignore_ascii_case("gguf"))
        {
            return Self::open_gguf(dir);
        }
        if !dir.is_dir() {
            bail!(
                "{} is not a folder; --model expects a Hugging Face model folder, a .gguf file (or \"demo\")",
                dir.display()
            );
        }
        let config_path = dir.join("config.json");
        let ggufs = gguf_model::gguf_files(dir)?;
        if !config_path.exists() {
            match ggufs.as_slice() {
                [one] => return Self::open_gguf(one),
                [] => bail!(
                    "{} has no config.json; is this a Hugging Face model folder?",
                    dir.display()
                ),
                many => bail!(
                    "{} has no config.json and {} GGUF files ({}); pass --model FILE.gguf to choose one",
                    dir.display(),
                    many.len(),
                    many.iter()
                        .map(|p| p.file_name().unwrap_or_default().to_string_lossy().into_owned())
                        .collect::<Vec<_>>()
                        .join(", ")
                ),
            }
        }
        let config = TextConfig::from_file(&config_path)?;
        let store = SafetensorStore::open_dir(dir)?;
        let quant = QuantConfig::from_dir(dir)?;
        let gguf = match ggufs.as_slice() {
            [] => None,
            [one] => {
                let prefix = if store.contains("model.language_model.embed_tokens.weight") {
                    "model.language_model."
                } else {
                    "model."
                };
                let file = crate::quant::gguf::GgufFile::open(one)?;
                Some(gguf_model::GgufWeights::map(file, &config, prefix, false)?)
            }
            many => bail!(
                "{} has {} GGUF files beside its safetensors; expected at most one (the routed experts)",
                dir.display(),
                many.len()
            ),
        };
        let weights = Weights::new(store, quant, gguf);
        Self::finish(dir, config, weights)
    }

    /// A GGUF file alone: the configuration from its metadata, every tensor from the file.
    fn open_gguf(path: &Path) -> Result<Self> {
        let file = crate::quant::gguf::GgufFile::open(path)?;
        let cfg = gguf_model::config_from_metadata(&file)?;
        let config = TextConfig::from_value(&cfg)
            .with_context(|| format!("configuration from the metadata of {}", path.display()))?;
        let gguf = gguf_model::GgufWeights::map(file, &config, "model.", true)?;
        let weights = Weights::new(SafetensorStore::open_files(&[])?, None, Some(gguf));
        let dir = path.parent().map(Path::to_path_buf).unwrap_or_default();
        Self::finish(&dir, config, weights)
    }

    fn finish(dir: &Path, config: TextConfig, weights: Weights) -> Result<Self> {
        let gen_path = dir.join("generation_config.json");
        let generation = if gen_path.exists() {
            let text = std::fs::read_to_string(&gen_path)
                .with_context(|| format!("cannot read {}", gen_path.display()))?;
            serde_json::from_str(&text)
                .with_context(|| format!("{} is malformed", gen_path.display()))?
        } else {
            GenerationConfig::default()
        };
        Ok(Checkpoint {
            dir: dir.to_path_buf(),
            config,
            weights,
            generation,
        })
    }

    /// End-of-sequence ids: the generation config's, else the model config's.
    pub fn eos_token_ids(&self) -> Vec<u32> {
        let from_gen: Vec<u32> = match &self.generation.eos_token_id {
            Some(serde_json::Value::Number(n)) => {
                n.as_u64().map(|v| vec![v as u32]).unwrap_or_default()
            }
            Some(serde_json::Value::Array(a)) => a
                .iter()
                .filter_map(|v| v.as_u64().map(|v| v as u32))
                .collect(),
            _ => vec![],
        };
        if from_gen.is_empty() {
            self.config.eos_token_ids.clone()
        } else {
            from_gen
        }
    }
}
