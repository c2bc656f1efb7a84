//! `config.json` of the supported checkpoints, parsed and checked once at load.
//!
//! The published checkpoints are multimodal wrappers (`model_type: qwen3_5` with a `text_config`);
//! `save_pretrained` of a text-only model writes the text part directly (`qwen3_5_text`). Both
//! are accepted and reduced to one [`TextConfig`].

use anyhow::{bail, Context, Result};
use serde::Deserialize;
use serde_json::Value;
use std::path::Path;

/// The architectures this engine implements.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize)]
pub enum Architecture {
    /// Qwen3.8-27B: dense hybrid (Gated DeltaNet + gated full attention).
    Qwen3_5Text,
    /// Qwen3.8-Flash-Next: hybrid MoE with sparse attention, hyper-connections and PLE.
    Qwen4ExpText,
}

impl Architecture {
    pub fn model_type(self) -> &'static str {
        match self {
            Architecture::Qwen3_5Text => "qwen3_5_text",
            Architecture::Qwen4ExpText => "qwen4_exp_text",
        }
    }
}

/// What kind of token mixer a decoder layer has.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize)]
pub enum LayerType {
    /// Gated DeltaNet (linear attention with a recurrent state).
    LinearAttention,
    /// Gated softmax attention over the whole context.
    FullAttention,
}

/// RoPE parameters (`rope_parameters`, or the legacy top-level fields).
#[derive(Debug, Clone, serde::Serialize)]
pub struct RopeConfig {
    pub theta: f64,
    pub partial_rotary_factor: f64,
    /// Interleaved MRoPE sections; for text-only input every section sees the same position,
    /// so they do not change the result, but they are kept to report the configuration.
    pub mrope_section: Vec<usize>,
}

/// The text model's configuration, with every derived size the model code needs.
#[derive(Debug, Clone, serde::Serialize)]
pub struct TextConfig {
    pub architecture: Architecture,
    pub vocab_size: usize,
    pub hidden_size: usize,
    pub intermediate_size: usize,
    pub num_hidden_layers: usize,
    pub num_attention_heads: usize,
    pub num_key_value_heads: usize,
    pub head_dim: usize,
    pub rms_norm_eps: f64,
    pub max_position_embeddings: usize,
    pub tie_word_embeddings: bool,
    pub attention_bias: bool,
    pub hidden_act: String,
    pub rope: RopeConfig,
    pub linear_conv_kernel_dim: usize,
    pub linear_key_head_dim: usize,
    pub linear_value_head_dim: usize,
    pub linear_num_key_heads: usize,
    pub linear_num_value_heads: usize,
    pub layer_types: Vec<LayerType>,
    pub eos_token_ids: Vec<u32>,
    pub bos_token_id: Option<u32>,
    pub pad_token_id: Option<u32>,
    /// The original JSON of the text part, for architecture-specific fields (MoE, QSA, PLE, …).
    #[serde(skip)]
    pub raw: Value,
}

#[derive(Deserialize)]
struct RawText {
    vocab_size: usize,
    hidden_size: usize,
    #[serde(default)]
    intermediate_size: Option<usize>,
    num_hidden_layers: usize,
    num_attention_heads: usize,
    num_key_value_heads: usize,
    #[serde(default)]
    head_dim: Option<usize>,
    #[serde(default = "default_eps")]
    rms_norm_eps: f64,
    #[serde(default = "default_max_pos")]
    max_position_embeddings: usize,
    #[serde(default)]
    tie_word_embeddings: bool,
    #[serde(default)]
    attention_bias: bool,
    #[serde(default = "default_act")]
    hidden_act: String,
    #[serde(default)]
    rope_parameters: Option<Value>,
    #[serde(default)]
    rope_theta: Option<f64>,
    #[serde(default)]
    partial_rotary_factor: Option<f64>,
    #[serde(default = "default_conv")]
    linear_conv_kernel_dim: usize,
    #[serde(default = "default_128")]
    linear_key_head_dim: usize,
    #[serde(default = "default_128")]
    linear_value_head_dim: usize,
    #[serde(default = "default_16")]
    linear_num_key_heads: usize,
    #[serde(default = "default_32")]
    linear_num_value_heads: usize,
    #[serde(default)]
    layer_types: Option<Vec<String>>,
    #[serde(default)]
    full_attention_interval: Option<usize>,
    #[serde(default)]
    eos_token_id: Option<Value>,
    #[serde(default)]
    bos_token_id: Option<u32>,
    #[serde(default)]
    pad_token_id: Option<u32>,
}

fn default_eps() -> f64 {
    1e-6
}
fn default_max_pos() -> usize {
    32768
}
fn default_act() -> String {
    "silu".into()
}
fn default_conv() -> usize {
    4
}
fn default_128() -> usize {
    128
}
fn default_16() -> usize {
    16
}
fn default_32() -> usize {
    32
}

impl TextConfig {
    /// Reads and checks `config.json` from a checkpoint folder.
    pub fn from_file(path: &Path) -> Result<Self> {
        let text = std::fs::read_to_string(path)
            .with_context(|| format!("cannot read {}", path.display()))?;
        let value: Value = serde_json::from_str(&text)
            .with_context(|| format!("{} is not valid JSON", path.display()))?;
        Self::from_value(&value).with_context(|| format!("in {}", path.display()))
    }

    /// Parses a `config.json` value (wrapper or text part).
    pub fn from_value(value: &Value) -> Result<Self> {
        let model_type = value
            .get("model_type")
            .and_then(Value::as_str)
            .context("config has no \"model_type\"; expected \"qwen3_5\", \"qwen3_5_text\", \"qwen4_exp\" or \"qwen4_exp_text\"")?;
        let (architecture, text) = match model_type {
            "qwen3_5_text" => (Architecture::Qwen3_5Text, value.clone()),
            "qwen4_exp_text" => (Architecture::Qwen4ExpText, value.clone()),
            "qwen3_5" | "qwen4_exp" => {
                let arch = if model_type == "qwen3_5" {
                    Architecture::Qwen3_5Text
                } else {
                    Architecture::Qwen4ExpText
                };
                let mut text = value.get("text_config").cloned().with_context(|| {
                    format!("model_type \"{model_type}\" needs a \"text_config\" object")
                })?;
                // Token ids often live only on the wrapper.
                for key in ["eos_token_id", "bos_token_id", "pad_token_id", "tie_word_embeddings"] {
                    if text.get(key).is_none() {
                        if let Some(v) = value.get(key) {
                            text[key] = v.clone();
                        }
                    }
                }
                (arch, text)
            }
            other => bail!(
                "unsupported model_type \"{other}\": Capy Flash runs Qwen3.8-27B (\"qwen3_5\") and \
                 Qwen3.8-Flash-Next (\"qwen4_exp\") only"
            ),
        };
        let raw: RawText =
            serde_json::from_value(text.clone()).context("text configuration is malformed")?;
        Self::from_raw(architecture, raw, text)
    }

    fn from_raw(architecture: Architecture, r: RawText, raw: Value) -> Result<Self> {
        let head_dim = r.head_dim.unwrap_or(r.hidden_size / r.num_attention_heads.max(1));
        let rope = match &r.rope_parameters {
            Some(p) => RopeConfig {
                theta: p
                    .get("rope_theta")
                    .and_then(Value::as_f64)
                    .or(r.rope_theta)
                    .unwrap_or(10000.0),
                partial_rotary_factor: p
                    .get("partial_rotary_factor")
                    .and_then(Value::as_f64)
                    .or(r.partial_rotary_factor)
                    .unwrap_or(0.25),
                mrope_section: p
                    .get("mrope_section")
                    .and_then(|v| serde_json::from_value(v.clone()).ok())
                    .unwrap_or_else(|| vec![11, 11, 10]),
            },
            None => RopeConfig {
                theta: r.rope_theta.unwrap_or(10000.0),
                partial_rotary_factor: r.partial_rotary_factor.unwrap_or(0.25),
                mrope_section: vec![11, 11, 10],
            },
        };
        if let Some(p) = &r.rope_parameters {
            let rope_type = p.get("rope_type").and_then(Value::as_str).unwrap_or("default");
            if rope_type != "default" {
                bail!("rope_type \"{rope_type}\" is not supported; expected \"default\"");
            }
        }
        let layer_types = match &r.layer_types {
            Some(types) => types
                .iter()
                .enumerate()
                .map(|(i, t)| match t.as_str() {
                    "linear_attention" => Ok(LayerType::LinearAttention),
                    // Flash-Next names its attention layers after QSA; the model file decides
                    // what they compute.
                    "full_attention" | "sparse_attention" | "qsa" => Ok(LayerType::FullAttention),
                    other => bail!("layer_types[{i}] is \"{other}\"; expected \"linear_attention\" or \"full_attention\""),
                })
                .collect::<Result<Vec<_>>>()?,
            None => {
                let interval = r.full_attention_interval.unwrap_or(4).max(1);
                (0..r.num_hidden_layers)
                    .map(|i| {
                        if (i + 1) % interval == 0 {
                            LayerType::FullAttention
                        } else {
                            LayerType::LinearAttention
                        }
                    })
                    .collect()
            }
        };
        let eos_token_ids = match &r.eos_token_id {
            None | Some(Value::Null) => vec![],
            Some(Value::Number(n)) => vec![n.as_u64().context("eos_token_id must be a token id")? as u32],
            Some(Value::Array(a)) => a
                .iter()
                .map(|v| v.as_u64().map(|x| x as u32).context("eos_token_id entries must be token ids"))
                .collect::<Result<_>>()?,
            Some(other) => bail!("eos_token_id must be an id or a list of ids, found {other}"),
        };
        let cfg = TextConfig {
            architecture,
            vocab_size: r.vocab_size,
            hidden_size: r.hidden_size,
            intermediate_size: r.intermediate_size.unwrap_or(0),
            num_hidden_layers: r.num_hidden_layers,
            num_attention_heads: r.num_attention_heads,
            num_key_value_heads: r.num_key_value_heads,
            head_dim,
            rms_norm_eps: r.rms_norm_eps,
            max_position_embeddings: r.max_position_embeddings,
            tie_word_embeddings: r.tie_word_embeddings,
            attention_bias: r.attention_bias,
            hidden_act: r.hidden_act,
            rope,
            linear_conv_kernel_dim: r.linear_conv_kernel_dim,
            linear_key_head_dim: r.linear_key_head_dim,
            linear_value_head_dim: r.linear_value_head_dim,
            linear_num_key_heads: r.linear_num_key_heads,
            linear_num_value_heads: r.linear_num_value_heads,
            layer_types,
            eos_token_ids,
            bos_token_id: r.bos_token_id,
            pad_token_id: r.pad_token_id,
            raw,
        };
        cfg.validate()?;
        Ok(cfg)
    }

    /// Checks the invariants the model code relies on, so a bad config fails at load with the
    /// reason instead of producing garbage or panicking in the middle of a forward pass.
    pub fn validate(&self) -> Result<()> {
        let positive = [
            ("vocab_size", self.vocab_size),
            ("hidden_size", self.hidden_size),
            ("num_hidden_layers", self.num_hidden_layers),
            ("num_attention_heads", self.num_attention_heads),
            ("num_key_value_heads", self.num_key_value_heads),
            ("head_dim", self.head_dim),
            ("linear_conv_kernel_dim", self.linear_conv_kernel_dim),
            ("linear_key_head_dim", self.linear_key_head_dim),
            ("linear_value_head_dim", self.linear_value_head_dim),
            ("linear_num_key_heads", self.linear_num_key_heads),
            ("linear_num_value_heads", self.linear_num_value_heads),
        ];
        for (name, v) in positive {
            if v == 0 {
                bail!("{name} must be positive, found 0");
            }
        }
        if self.num_attention_heads % self.num_key_value_heads != 0 {
            bail!(
                "num_attention_heads ({}) must be a multiple of num_key_value_heads ({})",
                self.num_attention_heads,
                self.num_key_value_heads
            );
        }
        if self.linear_num_value_heads % self.linear_num_key_heads != 0 {
            bail!(
                "linear_num_value_heads ({}) must be a multiple of linear_num_key_heads ({})",
                self.linear_num_value_heads,
                self.linear_num_key_heads
            );
        }
        if self.layer_types.len() != self.num_hidden_layers {
            bail!(
                "layer_types has {} entries but num_hidden_layers is {}",
                self.layer_types.len(),
                self.num_hidden_layers
            );
        }
        let rot = self.rotary_dim();
        if rot == 0 || rot > self.head_dim || rot % 2 != 0 {
            bail!(
                "partial_rotary_factor {} gives a rotary dimension of {rot} for head_dim {}; it must be even and in 2..=head_dim",
                self.rope.partial_rotary_factor,
                self.head_dim
            );
        }
        if self.hidden_act != "silu" {
            bail!("hidden_act \"{}\" is not supported; expected \"silu\"", self.hidden_act);
        }
        if self.architecture == Architecture::Qwen3_5Text && self.intermediate_size == 0 {
            bail!("intermediate_size must be positive for a dense qwen3_5_text model");
        }
        Ok(())
    }

    /// Number of leading dimensions of each attention head that RoPE rotates.
    pub fn rotary_dim(&self) -> usize {
        (self.head_dim as f64 * self.rope.partial_rotary_factor) as usize
    }

    /// Width of the GDN causal conv: q, k and v channels.
    pub fn linear_conv_dim(&self) -> usize {
        2 * self.linear_key_dim() + self.linear_value_dim()
    }
    pub fn linear_key_dim(&self) -> usize {
        self.linear_num_key_heads * self.linear_key_head_dim
    }
    pub fn linear_value_dim(&self) -> usize {
        self.linear_num_value_heads * self.linear_value_head_dim
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn tiny() -> Value {
        json!({
            "model_type": "qwen3_5_text", "vocab_size": 64, "hidden_size": 32,
            "intermediate_size": 48, "num_hidden_layers": 4, "num_attention_heads": 4,
            "num_key_value_heads": 2, "head_dim": 16, "linear_num_key_heads": 2,
            "linear_num_value_heads": 4, "linear_key_head_dim": 8, "linear_value_head_dim": 8,
            "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.25},
            "eos_token_id": [1, 2]
        })
    }

    #[test]
    fn parses_text_config_and_derives_layer_pattern() {
        let c = TextConfig::from_value(&tiny()).unwrap();
        assert_eq!(c.rotary_dim(), 4);
        assert_eq!(
            c.layer_types,
            vec![
                LayerType::LinearAttention,
                LayerType::LinearAttention,
                LayerType::LinearAttention,
                LayerType::FullAttention
            ]
        );
        assert_eq!(c.eos_token_ids, vec![1, 2]);
        assert_eq!(c.linear_conv_dim(), 2 * 16 + 32);
    }

    #[test]
    fn unwraps_multimodal_wrapper() {
        let v = json!({"model_type": "qwen3_5", "text_config": tiny(), "eos_token_id": 7});
        let mut inner = tiny();
        inner.as_object_mut().unwrap().remove("eos_token_id");
        let v2 = json!({"model_type": "qwen3_5", "text_config": inner, "eos_token_id": 7});
        assert_eq!(TextConfig::from_value(&v).unwrap().eos_token_ids, vec![1, 2]);
        assert_eq!(TextConfig::from_value(&v2).unwrap().eos_token_ids, vec![7]);
    }

    #[test]
    fn refuses_unknown_model_type_and_bad_invariants() {
        let mut v = tiny();
        v["model_type"] = json!("llama");
        let e = TextConfig::from_value(&v).unwrap_err().to_string();
        assert!(e.contains("unsupported model_type \"llama\""), "{e}");

        let mut v = tiny();
        v["num_key_value_heads"] = json!(3);
        let e = format!("{:#}", TextConfig::from_value(&v).unwrap_err());
        assert!(e.contains("multiple of num_key_value_heads (3)"), "{e}");

        let mut v = tiny();
        v["layer_types"] = json!(["linear_attention"]);
        let e = format!("{:#}", TextConfig::from_value(&v).unwrap_err());
        assert!(e.contains("layer_types has 1 entries"), "{e}");
    }
}
