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
                for key in [
                    "eos_token_id",
                    "bos_token_id",
                    "pad_token_id",
                    "tie_word_embeddings",
                ] {
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
        let head_dim = r
            .head_dim
            .unwrap_or(r.hidden_size / r.num_attention_heads.max(1));
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
            let rope_type = p
                .get("rope_type")
                .and_then(Value::as_str)
                .unwrap_or("default");
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
                    "full_attention" | "sparse_attention" | "qsa" | "qwen_sparse_attention" => {
                        Ok(LayerType::FullAttention)
                    }
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
            Some(Value::Number(n)) => {
                vec![n.as_u64().context("eos_token_id must be a token id")? as u32]
            }
            Some(Value::Array(a)) => a
                .iter()
                .map(|v| {
                    v.as_u64()
                        .map(|x| x as u32)
                        .context("eos_token_id entries must be token ids")
                })
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
        if !self
            .num_attention_heads
            .is_multiple_of(self.num_key_value_heads)
        {
            bail!(
                "num_attention_heads ({}) must be a multiple of num_key_value_heads ({})",
                self.num_attention_heads,
                self.num_key_value_heads
            );
        }
        if !self
            .linear_num_value_heads
            .is_multiple_of(self.linear_num_key_heads)
        {
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
        if rot == 0 || rot > self.head_dim || !rot.is_multiple_of(2) {
            bail!(
                "partial_rotary_factor {} gives a rotary dimension of {rot} for head_dim {}; it must be even and in 2..=head_dim",
                self.rope.partial_rotary_factor,
                self.head_dim
            );
        }
        if self.hidden_act != "silu" {
            bail!(
                "hidden_act \"{}\" is not supported; expected \"silu\"",
                self.hidden_act
            );
        }
        if self.architecture == Architecture::Qwen3_5Text && self.intermediate_size == 0 {
            bail!("intermediate_size must be positive for a dense qwen3_5_text model");
        }
        if self.architecture == Architecture::Qwen4ExpText {
            self.qwen4_exp()?;
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

// ---------------------------------------------------------------------------------------------
// Qwen3.8-Flash-Next (`qwen4_exp_text`) specific fields

/// Activation of the GDN output gate (`output_gate_type`, else `hidden_act`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize)]
pub enum GateActivation {
    Sigmoid,
    Silu,
}

/// Sparse MoE of every Flash-Next layer.
#[derive(Debug, Clone, serde::Serialize)]
pub struct MoeConfig {
    pub num_experts: usize,
    pub num_experts_per_tok: usize,
    pub moe_intermediate_size: usize,
    pub shared_expert_intermediate_size: usize,
    /// Renormalise the top-k routing weights to sum to 1.
    pub norm_topk_prob: bool,
}

/// Qwen Sparse Attention: the indexer and its token budget.
#[derive(Debug, Clone, Copy, serde::Serialize)]
pub struct QsaConfig {
    pub indexer_n_heads: usize,
    pub indexer_head_dim: usize,
    /// Tokens selected from complete blocks per query (a multiple of `compress_ratio`).
    pub budget: usize,
    /// Consecutive token keys mean-pooled into one index block.
    pub compress_ratio: usize,
}

impl QsaConfig {
    /// Blocks each query selects.
    pub fn block_topk(&self) -> usize {
        self.budget / self.compress_ratio
    }
}

/// PLE: hashed n-gram embeddings injected before some GDN layers.
#[derive(Debug, Clone, serde::Serialize)]
pub struct PleConfig {
    /// Zero-based indices of the decoder layers that have PLE (config: one-based `ple_layer_ids`).
    pub layers: Vec<usize>,
    pub embed_dim: usize,
    pub conv_kernel_size: usize,
    pub ngram_size: usize,
    pub heads_per_ngram: usize,
    pub ngram_vocab_size_base: u64,
    pub make_ngram_vocab_size_divisible_by: u64,
    pub seed: i64,
    pub split_ngram_parts: usize,
    /// The token that starts n-gram segments and pads the context (`eos_token_id`, first).
    pub eos_token_id: u32,
}

impl PleConfig {
    /// Hashed embedding heads of one PLE layer: `heads_per_ngram` for each order 2..=ngram_size.
    pub fn ngram_heads(&self) -> usize {
        (self.ngram_size - 1) * self.heads_per_ngram
    }
    /// Width of one head's embedding row.
    pub fn head_dim(&self) -> usize {
        self.embed_dim / self.ngram_heads()
    }
}

/// The typed Flash-Next fields of a `qwen4_exp_text` config.
#[derive(Debug, Clone, serde::Serialize)]
pub struct Qwen4ExpConfig {
    pub moe: MoeConfig,
    /// Residual streams of the hyper-connections.
    pub hc_count: usize,
    pub hc_lowrank: usize,
    /// `None` when the indexer fields are all unset: the attention layers are then dense.
    pub qsa: Option<QsaConfig>,
    /// `None` when `ple_layer_ids` is empty.
    pub ple: Option<PleConfig>,
    pub output_gate: GateActivation,
}

#[derive(Deserialize)]
struct RawQwen4Exp {
    #[serde(default = "default_512")]
    moe_intermediate_size: usize,
    #[serde(default = "default_512")]
    shared_expert_intermediate_size: usize,
    #[serde(default = "default_10")]
    num_experts_per_tok: usize,
    #[serde(default = "default_512")]
    num_experts: usize,
    #[serde(default = "default_true")]
    norm_topk_prob: bool,
    #[serde(default = "default_4")]
    hc_count: usize,
    #[serde(default = "default_320")]
    hc_lowrank: usize,
    #[serde(default)]
    ple_layer_ids: Option<Vec<usize>>,
    #[serde(default)]
    ple_embed_dim: Option<usize>,
    #[serde(default = "default_4")]
    ple_conv_kernel_size: usize,
    #[serde(default = "default_3")]
    ngram_size: usize,
    #[serde(default = "default_8")]
    heads_per_ngram: usize,
    #[serde(default = "default_ngram_base")]
    ngram_vocab_size_base: u64,
    #[serde(default = "default_128_u64")]
    make_ngram_vocab_size_divisible_by: u64,
    #[serde(default = "default_seed")]
    seed: i64,
    #[serde(default = "default_512")]
    split_ngram_parts: usize,
    #[serde(default)]
    indexer_n_heads: Option<usize>,
    #[serde(default)]
    indexer_kv_heads: Option<usize>,
    #[serde(default)]
    indexer_head_dim: Option<usize>,
    #[serde(default)]
    indexer_budget: Option<usize>,
    #[serde(default)]
    indexer_compress_ratio: Option<usize>,
    #[serde(default)]
    output_gate_type: Option<String>,
}

fn default_512() -> usize {
    512
}
fn default_10() -> usize {
    10
}
fn default_true() -> bool {
    true
}
fn default_4() -> usize {
    4
}
fn default_3() -> usize {
    3
}
fn default_8() -> usize {
    8
}
fn default_320() -> usize {
    320
}
fn default_ngram_base() -> u64 {
    20_000_000
}
fn default_128_u64() -> u64 {
    128
}
fn default_seed() -> i64 {
    1234
}

impl TextConfig {
    /// Parses and checks the Flash-Next fields (the same invariants transformers' config
    /// enforces), so a checkpoint that the reference would refuse is refused here at load.
    pub fn qwen4_exp(&self) -> Result<Qwen4ExpConfig> {
        let r: RawQwen4Exp = serde_json::from_value(self.raw.clone())
            .context("qwen4_exp_text configuration is malformed")?;
        let gate_name = r
            .output_gate_type
            .clone()
            .unwrap_or_else(|| self.hidden_act.clone());
        let output_gate = match gate_name.as_str() {
            "sigmoid" => GateActivation::Sigmoid,
            "silu" => GateActivation::Silu,
            other => bail!(
                "output_gate_type \"{other}\" is not supported; expected \"sigmoid\" or \"silu\""
            ),
        };
        if r.hc_count <= 1 {
            bail!(
                "hc_count must be greater than 1 (the hyper-connection streams), found {}",
                r.hc_count
            );
        }
        if r.hc_lowrank == 0 {
            bail!("hc_lowrank must be positive, found 0");
        }
        if r.num_experts == 0 {
            bail!("num_experts must be positive, found 0");
        }
        if r.num_experts_per_tok == 0 || r.num_experts_per_tok > r.num_experts {
            bail!(
                "num_experts_per_tok must be in 1..={} (num_experts), found {}",
                r.num_experts,
                r.num_experts_per_tok
            );
        }
        if r.moe_intermediate_size == 0 || r.shared_expert_intermediate_size == 0 {
            bail!(
                "moe_intermediate_size and shared_expert_intermediate_size must be positive, found {} and {}",
                r.moe_intermediate_size,
                r.shared_expert_intermediate_size
            );
        }
        let fields = [
            ("indexer_n_heads", r.indexer_n_heads),
            ("indexer_kv_heads", r.indexer_kv_heads),
            ("indexer_head_dim", r.indexer_head_dim),
            ("indexer_budget", r.indexer_budget),
            ("indexer_compress_ratio", r.indexer_compress_ratio),
        ];
        let qsa = if fields.iter().all(|(_, v)| v.is_none()) {
            None
        } else {
            let missing: Vec<&str> = fields
                .iter()
                .filter(|(_, v)| v.is_none())
                .map(|(n, _)| *n)
                .collect();
            if !missing.is_empty() {
                bail!(
                    "QSA config is partly set: {} missing; set all five indexer_* fields or none",
                    missing.join(", ")
                );
            }
            if let Some((name, _)) = fields.iter().find(|(_, v)| *v == Some(0)) {
                bail!("QSA field {name} must be positive, found 0");
            }
            let get = |i: usize| fields[i].1.unwrap_or_default();
            let q = QsaConfig {
                indexer_n_heads: get(0),
                indexer_head_dim: get(2),
                budget: get(3),
                compress_ratio: get(4),
            };
            if get(1) != 1 {
                bail!(
                    "indexer_kv_heads must be 1 (QSA has one indexer key head), found {}",
                    get(1)
                );
            }
            if !q.budget.is_multiple_of(q.compress_ratio) {
                bail!(
                    "indexer_budget ({}) must be a multiple of indexer_compress_ratio ({})",
                    q.budget,
                    q.compress_ratio
                );
            }
            if self.rotary_dim() > q.indexer_head_dim {
                bail!(
                    "the attention's rotary dimension ({}) must fit the QSA index head (indexer_head_dim {})",
                    self.rotary_dim(),
                    q.indexer_head_dim
                );
            }
            Some(q)
        };
        let mut ple_ids = r.ple_layer_ids.clone().unwrap_or_default();
        ple_ids.sort_unstable();
        ple_ids.dedup();
        let ple = if ple_ids.is_empty() {
            None
        } else {
            let embed_dim = r.ple_embed_dim.unwrap_or(self.hidden_size);
            let heads = r.ngram_size.saturating_sub(1) * r.heads_per_ngram;
            if heads == 0 || embed_dim == 0 || !embed_dim.is_multiple_of(heads) {
                bail!(
                    "ple_embed_dim ({embed_dim}) must be a positive multiple of the n-gram heads \
                     ((ngram_size - 1) · heads_per_ngram = {heads})"
                );
            }
            if let Some(bad) = ple_ids
                .iter()
                .find(|&&id| id < 1 || id > self.num_hidden_layers)
            {
                bail!(
                    "ple_layer_ids are one-based layer ids in 1..={}, found {bad}",
                    self.num_hidden_layers
                );
            }
            let on_attention: Vec<usize> = ple_ids
                .iter()
                .copied()
                .filter(|&id| self.layer_types[id - 1] != LayerType::LinearAttention)
                .collect();
            if !on_attention.is_empty() {
                bail!("PLE is only supported on linear_attention layers, but ple_layer_ids puts it on attention layers {on_attention:?}");
            }
            let eos_token_id = *self
                .eos_token_ids
                .first()
                .context("eos_token_id must be set when PLE layers are enabled (it pads and separates n-grams)")?;
            if r.ple_conv_kernel_size == 0
                || r.split_ngram_parts == 0
                || r.make_ngram_vocab_size_divisible_by == 0
            {
                bail!("ple_conv_kernel_size, split_ngram_parts and make_ngram_vocab_size_divisible_by must be positive");
            }
            if r.ngram_vocab_size_base < 2 {
                bail!(
                    "ngram_vocab_size_base must be at least 2, found {}",
                    r.ngram_vocab_size_base
                );
            }
            Some(PleConfig {
                layers: ple_ids.iter().map(|id| id - 1).collect(),
                embed_dim,
                conv_kernel_size: r.ple_conv_kernel_size,
                ngram_size: r.ngram_size,
                heads_per_ngram: r.heads_per_ngram,
                ngram_vocab_size_base: r.ngram_vocab_size_base,
                make_ngram_vocab_size_divisible_by: r.make_ngram_vocab_size_divisible_by,
                seed: r.seed,
                split_ngram_parts: r.split_ngram_parts,
                eos_token_id,
            })
        };
        Ok(Qwen4ExpConfig {
            moe: MoeConfig {
                num_experts: r.num_experts,
                num_experts_per_tok: r.num_experts_per_tok,
                moe_intermediate_size: r.moe_intermediate_size,
                shared_expert_intermediate_size: r.shared_expert_intermediate_size,
                norm_topk_prob: r.norm_topk_prob,
            },
            hc_count: r.hc_count,
            hc_lowrank: r.hc_lowrank,
            qsa,
            ple,
            output_gate,
        })
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
        assert_eq!(
            TextConfig::from_value(&v).unwrap().eos_token_ids,
            vec![1, 2]
        );
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
