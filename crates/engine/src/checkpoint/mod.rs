//! A checkpoint as users download it: a Hugging Face model folder.
//!
//! `config.json`, the weights (single or sharded safetensors), and the tokenizer and generation
//! files. Everything is checked before the model is built, and every error names the file.

pub mod safetensors;

use crate::config::TextConfig;
use anyhow::{bail, Context, Result};
use serde::Deserialize;
use std::path::{Path, PathBuf};

pub use self::safetensors::{write_safetensors, SafetensorStore};

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
    pub weights: SafetensorStore,
    pub generation: GenerationConfig,
}

impl Checkpoint {
    /// Opens a model folder: reads `config.json`, maps the weights, reads
    /// `generation_config.json` when present.
    pub fn open(dir: &Path) -> Result<Self> {
        if !dir.exists() {
            bail!("model folder {} does not exist", dir.display());
        }
        if !dir.is_dir() {
            bail!(
                "{} is not a folder; --model expects a Hugging Face model folder (or \"demo\")",
                dir.display()
            );
        }
        let config_path = dir.join("config.json");
        if !config_path.exists() {
            bail!(
                "{} has no config.json; is this a Hugging Face model folder?",
                dir.display()
            );
        }
        let config = TextConfig::from_file(&config_path)?;
        let weights = SafetensorStore::open_dir(dir)?;
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
