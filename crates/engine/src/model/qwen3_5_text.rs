//! Qwen3.8-27B (`qwen3_5_text`): a dense hybrid decoder.
//!
//! Read beside transformers' `models/qwen3_5/modeling_qwen3_5.py`. Each decoder layer is
//! `x + mixer(norm(x))` then `x + mlp(norm(x))`, where the mixer is Gated DeltaNet (three
//! layers in four) or gated full attention (every fourth). Norms scale by `(1 + w)`, except
//! the GDN output norm, which scales by `w` and gates with `silu(z)`.
//!
//! Two re-layouts happen once at load, so that the forward pass is a few large matmuls:
//! - `q_proj` stores each head's query and output gate interleaved (`[q_h, gate_h]` per head);
//!   its rows are regrouped to `[all queries; all gates]`;
//! - projections that read the same input are fused: GDN `in_proj_{qkv,z,b,a}` into one
//!   matrix, MLP `gate_proj` and `up_proj` into one.

use super::{BatchItem, CausalLm, LogitsWanted, ModelInfo, SeqId, SequenceTable, StateSnapshot};
use crate::backend::{AttentionShape, Backend, DeltaRuleMode, DeltaRuleShape, NormScale};
use crate::checkpoint::Checkpoint;
use crate::config::{LayerType, TextConfig};
use crate::tensor::HostTensor;
use anyhow::{bail, Context, Result};

/// Where the text model's tensors live: `model.` (a causal-LM export) or
/// `model.language_model.` (the published multimodal checkpoints).
fn text_prefix(ck: &Checkpoint) -> &'static str {
    if ck.weights.contains("model.language_model.embed_tokens.weight") {
        "model.language_model."
    } else {
        "model."
    }
}

/// Reads a tensor and checks its shape against the config.
fn tensor(ck: &Checkpoint, name: &str, shape: &[usize]) -> Result<HostTensor> {
    let t = ck.weights.get(name)?;
    t.expect_shape(shape).with_context(|| match ck.weights.file_of(name) {
        Some(f) => format!("in {}", f.display()),
        None => String::new(),
    })?;
    if !t.dtype.is_float() {
        bail!("tensor {name} has dtype {}; expected F32, F16 or BF16", t.dtype);
    }
    Ok(t)
}

fn vector<B: Backend>(b: &B, ck: &Checkpoint, name: &str, len: usize) -> Result<B::Vector> {
    b.vector(&tensor(ck, name, &[len])?.to_f32()?)
}

// ---------------------------------------------------------------------------------------------
// Gated DeltaNet (linear attention)

struct GatedDeltaNet<B: Backend> {
    /// Fused `in_proj_qkv ‖ in_proj_z ‖ in_proj_b ‖ in_proj_a`.
    in_proj: B::Matrix,
    /// Depthwise conv taps `[conv_dim, K]`.
    conv1d: B::Matrix,
    a_log: B::Vector,
    dt_bias: B::Vector,
    norm: B::Vector,
    out_proj: B::Matrix,
    shape: DeltaRuleShape,
    conv_dim: usize,
    eps: f32,
}

impl<B: Backend> GatedDeltaNet<B> {
    fn load(b: &B, ck: &Checkpoint, p: &str, c: &TextConfig) -> Result<Self> {
        let h = c.hidden_size;
        let (conv_dim, vd, nv) = (c.linear_conv_dim(), c.linear_value_dim(), c.linear_num_value_heads);
        let parts = [
            tensor(ck, &format!("{p}in_proj_qkv.weight"), &[conv_dim, h])?,
            tensor(ck, &format!("{p}in_proj_z.weight"), &[vd, h])?,
            tensor(ck, &format!("{p}in_proj_b.weight"), &[nv, h])?,
            tensor(ck, &format!("{p}in_proj_a.weight"), &[nv, h])?,
        ];
        let k = c.linear_conv_kernel_dim;
        let conv = tensor(ck, &format!("{p}conv1d.weight"), &[conv_dim, 1, k])?.reshaped(vec![conv_dim, k])?;
        Ok(GatedDeltaNet {
            in_proj: b.matrix(&HostTensor::concat_rows(&format!("{p}in_proj"), &parts)?)?,
            conv1d: b.matrix(&conv)?,
            a_log: vector(b, ck, &format!("{p}A_log"), nv)?,
            dt_bias: vector(b, ck, &format!("{p}dt_bias"), nv)?,
            norm: vector(b, ck, &format!("{p}norm.weight"), c.linear_value_head_dim)?,
            out_proj: b.matrix(&tensor(ck, &format!("{p}out_proj.weight"), &[h, vd])?)?,
            shape: DeltaRuleShape {
                num_k_heads: c.linear_num_key_heads,
                num_v_heads: nv,
                k_head_dim: c.linear_key_head_dim,
                v_head_dim: c.linear_value_head_dim,
            },
            conv_dim,
            eps: c.rms_norm_eps as f32,
        })
    }

    fn forward(&self, b: &B, x: &B::Act, spans: &[Span], states: &mut [&mut LayerState<B>]) -> B::Act {
        let s = self.shape;
        let kd = s.num_k_heads * s.k_head_dim;
        let vd = s.num_v_heads * s.v_head_dim;
        let nv = s.num_v_heads;
        // 1. projections of the whole batch
        let proj = b.linear(x, &self.in_proj);
        let mixed_qkv = b.cols(&proj, 0..self.conv_dim);
        let z = b.cols(&proj, self.conv_dim..self.conv_dim + vd);
        let beta_in = b.cols(&proj, self.conv_dim + vd..self.conv_dim + vd + nv);
        let a_in = b.cols(&proj, self.conv_dim + vd + nv..self.conv_dim + vd + 2 * nv);
        let (g, beta) = b.delta_rule_gates(&a_in, &beta_in, &self.a_log, &self.dt_bias);
        // 2. per sequence: causal conv, then the gated delta rule, each carrying its state
        let mut outs = Vec::with_capacity(spans.len());
        for (span, state) in spans.iter().zip(states.iter_mut()) {
            let LayerState::Linear { conv, recurrent } = &mut **state else {
                unreachable!("layer state kinds follow the layer types")
            };
            let rows = span.rows();
            let qkv = b.causal_conv1d_silu(&b.rows(&mixed_qkv, rows.clone()), conv, &self.conv1d);
            let q = b.cols(&qkv, 0..kd);
            let k = b.cols(&qkv, kd..2 * kd);
            let v = b.cols(&qkv, 2 * kd..2 * kd + vd);
            let mode = if span.len == 1 { DeltaRuleMode::Recurrent } else { DeltaRuleMode::Chunked };
            outs.push(b.gated_delta_rule(
                &q,
                &k,
                &v,
                &b.rows(&g, rows.clone()),
                &b.rows(&beta, rows),
                recurrent,
                s,
                mode,
            ));
        }
        // 3. gated RMSNorm per value head, output projection
        let core = b.cat_rows(&outs);
        let normed = b.rms_norm_gated(&core, &z, &self.norm, self.eps, s.v_head_dim);
        b.linear(&normed, &self.out_proj)
    }
}

// ---------------------------------------------------------------------------------------------
// Gated full attention

struct Attention<B: Backend> {
    /// `q_proj` with rows regrouped to `[queries; gates]`.
    q_proj: B::Matrix,
    k_proj: B::Matrix,
    v_proj: B::Matrix,
    o_proj: B::Matrix,
    q_norm: B::Vector,
    k_norm: B::Vector,
    shape: AttentionShape,
    rotary_dim: usize,
    eps: f32,
}

impl<B: Backend> Attention<B> {
    fn load(b: &B, ck: &Checkpoint, p: &str, c: &TextConfig) -> Result<Self> {
        if c.attention_bias {
            bail!("attention_bias = true is not supported by qwen3_5_text checkpoints");
        }
        let (h, nh, nkv, d) = (c.hidden_size, c.num_attention_heads, c.num_key_value_heads, c.head_dim);
        let q = tensor(ck, &format!("{p}q_proj.weight"), &[nh * d * 2, h])?;
        let queries = (0..nh).map(|i| i * 2 * d..i * 2 * d + d);
        let gates = (0..nh).map(|i| i * 2 * d + d..(i + 1) * 2 * d);
        let regrouped: Vec<_> = queries.chain(gates).collect();
        Ok(Attention {
            q_proj: b.matrix(&q.gather_rows(&regrouped)?)?,
            k_proj: b.matrix(&tensor(ck, &format!("{p}k_proj.weight"), &[nkv * d, h])?)?,
            v_proj: b.matrix(&tensor(ck, &format!("{p}v_proj.weight"), &[nkv * d, h])?)?,
            o_proj: b.matrix(&tensor(ck, &format!("{p}o_proj.weight"), &[h, nh * d])?)?,
            q_norm: vector(b, ck, &format!("{p}q_norm.weight"), d)?,
            k_norm: vector(b, ck, &format!("{p}k_norm.weight"), d)?,
            shape: AttentionShape { num_heads: nh, num_kv_heads: nkv, head_dim: d, scale: (d as f32).powf(-0.5) },
            rotary_dim: c.rotary_dim(),
            eps: c.rms_norm_eps as f32,
        })
    }

    fn forward(
        &self,
        b: &B,
        x: &B::Act,
        positions: &[usize],
        inv_freq: &[f32],
        spans: &[Span],
        states: &mut [&mut LayerState<B>],
    ) -> B::Act {
        let s = self.shape;
        let qd = s.num_heads * s.head_dim;
        // 1. projections, per-head q/k norms, rotary embedding
        let q_and_gate = b.linear(x, &self.q_proj);
        let gate = b.cols(&q_and_gate, qd..2 * qd);
        let mut q = b.rms_norm(&b.cols(&q_and_gate, 0..qd), &self.q_norm, self.eps, NormScale::OnePlus, s.head_dim);
        let mut k = b.rms_norm(&b.linear(x, &self.k_proj), &self.k_norm, self.eps, NormScale::OnePlus, s.head_dim);
        let v = b.linear(x, &self.v_proj);
        b.rope(&mut q, positions, s.head_dim, self.rotary_dim, inv_freq);
        b.rope(&mut k, positions, s.head_dim, self.rotary_dim, inv_freq);
        // 2. per sequence: append to the KV cache, attend over it
        let mut outs = Vec::with_capacity(spans.len());
        for (span, state) in spans.iter().zip(states.iter_mut()) {
            let LayerState::Attention { k: k_cache, v: v_cache } = &mut **state else {
                unreachable!("layer state kinds follow the layer types")
            };
            b.append_rows(k_cache, &b.rows(&k, span.rows()));
            b.append_rows(v_cache, &b.rows(&v, span.rows()));
            outs.push(b.attention(&b.rows(&q, span.rows()), k_cache, v_cache, span.past, s));
        }
        // 3. sigmoid output gate, output projection
        let attn = b.sigmoid_gate(&b.cat_rows(&outs), &gate);
        b.linear(&attn, &self.o_proj)
    }
}

// ---------------------------------------------------------------------------------------------
// SwiGLU MLP

struct Mlp<B: Backend> {
    /// Fused `gate_proj ‖ up_proj`.
    gate_up: B::Matrix,
    down: B::Matrix,
    intermediate: usize,
}

impl<B: Backend> Mlp<B> {
    fn load(b: &B, ck: &Checkpoint, p: &str, c: &TextConfig) -> Result<Self> {
        let (h, i) = (c.hidden_size, c.intermediate_size);
        let gate = tensor(ck, &format!("{p}gate_proj.weight"), &[i, h])?;
        let up = tensor(ck, &format!("{p}up_proj.weight"), &[i, h])?;
        Ok(Mlp {
            gate_up: b.matrix(&HostTensor::concat_rows(&format!("{p}gate_up_proj"), &[gate, up])?)?,
            down: b.matrix(&tensor(ck, &format!("{p}down_proj.weight"), &[h, i])?)?,
            intermediate: i,
        })
    }

    fn forward(&self, b: &B, x: &B::Act) -> B::Act {
        let gu = b.linear(x, &self.gate_up);
        let act = b.silu_mul(&b.cols(&gu, 0..self.intermediate), &b.cols(&gu, self.intermediate..2 * self.intermediate));
        b.linear(&act, &self.down)
    }
}

// ---------------------------------------------------------------------------------------------
// Decoder layer and model

enum Mixer<B: Backend> {
    Linear(GatedDeltaNet<B>),
    Full(Attention<B>),
}

struct DecoderLayer<B: Backend> {
    input_layernorm: B::Vector,
    mixer: Mixer<B>,
    post_attention_layernorm: B::Vector,
    mlp: Mlp<B>,
}

/// Per-layer state of one sequence.
pub enum LayerState<B: Backend> {
    /// KV cache `[len, kv_heads·d]` each.
    Attention { k: B::Act, v: B::Act },
    /// Conv history `[K-1, conv_dim]` and recurrent state `[v_heads·dk, dv]` (f32).
    Linear { conv: B::Act, recurrent: B::Act },
}

impl<B: Backend> Clone for LayerState<B> {
    fn clone(&self) -> Self {
        match self {
            LayerState::Attention { k, v } => LayerState::Attention { k: k.clone(), v: v.clone() },
            LayerState::Linear { conv, recurrent } => LayerState::Linear { conv: conv.clone(), recurrent: recurrent.clone() },
        }
    }
}

/// One sequence's state: its length and every layer's cache.
pub struct SeqState<B: Backend> {
    pub len: usize,
    pub layers: Vec<LayerState<B>>,
}

impl<B: Backend> Clone for SeqState<B> {
    fn clone(&self) -> Self {
        SeqState { len: self.len, layers: self.layers.clone() }
    }
}

/// Rows of one sequence inside a batch.
#[derive(Debug, Clone, Copy)]
struct Span {
    start: usize,
    len: usize,
    /// Tokens already in the sequence before this batch.
    past: usize,
}

impl Span {
    fn rows(&self) -> std::ops::Range<usize> {
        self.start..self.start + self.len
    }
}

pub struct Qwen3_5Text<B: Backend> {
    backend: B,
    config: TextConfig,
    info: ModelInfo,
    embed_tokens: B::Matrix,
    layers: Vec<DecoderLayer<B>>,
    norm: B::Vector,
    /// `None` when the head is tied to the embedding.
    lm_head: Option<B::Matrix>,
    inv_freq: Vec<f32>,
    sequences: SequenceTable<SeqState<B>>,
}

impl<B: Backend> Qwen3_5Text<B> {
    pub fn load(backend: B, ck: &Checkpoint) -> Result<Self> {
        let c = ck.config.clone();
        let b = &backend;
        let prefix = text_prefix(ck);
        let (h, v) = (c.hidden_size, c.vocab_size);
        let embed_tokens = b.matrix(&tensor(ck, &format!("{prefix}embed_tokens.weight"), &[v, h])?)?;
        let mut layers = Vec::with_capacity(c.num_hidden_layers);
        for (i, kind) in c.layer_types.iter().enumerate() {
            let p = format!("{prefix}layers.{i}.");
            let mixer = match kind {
                LayerType::LinearAttention => Mixer::Linear(GatedDeltaNet::load(b, ck, &format!("{p}linear_attn."), &c)?),
                LayerType::FullAttention => Mixer::Full(Attention::load(b, ck, &format!("{p}self_attn."), &c)?),
            };
            layers.push(DecoderLayer {
                input_layernorm: vector(b, ck, &format!("{p}input_layernorm.weight"), h)?,
                mixer,
                post_attention_layernorm: vector(b, ck, &format!("{p}post_attention_layernorm.weight"), h)?,
                mlp: Mlp::load(b, ck, &format!("{p}mlp."), &c)?,
            });
        }
        let norm = vector(b, ck, &format!("{prefix}norm.weight"), h)?;
        let lm_head = if ck.weights.contains("lm_head.weight") {
            Some(b.matrix(&tensor(ck, "lm_head.weight", &[v, h])?)?)
        } else if c.tie_word_embeddings {
            None
        } else {
            bail!("tensor lm_head.weight is missing and tie_word_embeddings is false in config.json");
        };
        let rot = c.rotary_dim();
        let inv_freq =
            (0..rot / 2).map(|i| (1.0 / c.rope.theta.powf((2 * i) as f64 / rot as f64)) as f32).collect();
        let parameters = ck
            .weights
            .names()
            .filter(|n| !n.starts_with("mtp.") && !n.contains("visual."))
            .filter_map(|n| ck.weights.get(n).ok())
            .map(|t| t.numel())
            .sum();
        let weight_bytes = ck
            .weights
            .names()
            .filter(|n| !n.starts_with("mtp.") && !n.contains("visual."))
            .filter_map(|n| ck.weights.get(n).ok())
            .map(|t| t.data.len())
            .sum();
        let info = ModelInfo {
            architecture: c.architecture,
            vocab_size: v,
            max_context: c.max_position_embeddings,
            eos_token_ids: ck.eos_token_ids(),
            num_layers: c.num_hidden_layers,
            hidden_size: h,
            parameters,
            weight_bytes,
            backend: backend.name(),
        };
        Ok(Qwen3_5Text {
            backend,
            config: c,
            info,
            embed_tokens,
            layers,
            norm,
            lm_head,
            inv_freq,
            sequences: SequenceTable::default(),
        })
    }

    fn empty_state(&self) -> SeqState<B> {
        let b = &self.backend;
        let c = &self.config;
        let layers = c
            .layer_types
            .iter()
            .map(|t| match t {
                LayerType::FullAttention => LayerState::Attention {
                    k: b.zeros(0, c.num_key_value_heads * c.head_dim),
                    v: b.zeros(0, c.num_key_value_heads * c.head_dim),
                },
                LayerType::LinearAttention => LayerState::Linear {
                    conv: b.zeros(c.linear_conv_kernel_dim - 1, c.linear_conv_dim()),
                    recurrent: b.zeros(c.linear_num_value_heads * c.linear_key_head_dim, c.linear_value_head_dim),
                },
            })
            .collect();
        SeqState { len: 0, layers }
    }

    fn check_batch(&self, batch: &[BatchItem<'_>]) -> Result<()> {
        for (i, item) in batch.iter().enumerate() {
            let Some(state) = self.sequences.states.get(&item.seq) else {
                bail!("sequence {:?} does not exist (it was dropped or never created)", item.seq);
            };
            if batch[..i].iter().any(|o| o.seq == item.seq) {
                bail!("sequence {:?} appears twice in one batch", item.seq);
            }
            if item.tokens.is_empty() {
                bail!("batch item for sequence {:?} has no tokens", item.seq);
            }
            super::check_token_ids(&self.config, item.tokens)?;
            let total = state.len + item.tokens.len();
            if total > self.info.max_context {
                bail!("sequence would hold {total} tokens; the model's context is {} tokens", self.info.max_context);
            }
        }
        Ok(())
    }
}

impl<B: Backend> CausalLm for Qwen3_5Text<B> {
    fn info(&self) -> &ModelInfo {
        &self.info
    }

    fn new_sequence(&mut self) -> SeqId {
        let s = self.empty_state();
        self.sequences.insert(s)
    }

    fn drop_sequence(&mut self, seq: SeqId) {
        self.sequences.states.remove(&seq);
    }

    fn sequence_len(&self, seq: SeqId) -> Option<usize> {
        self.sequences.states.get(&seq).map(|s| s.len)
    }

    fn forward(&mut self, batch: &[BatchItem<'_>]) -> Result<Vec<Vec<f32>>> {
        self.check_batch(batch)?;
        if batch.is_empty() {
            return Ok(vec![]);
        }
        let b = &self.backend;
        // Take the batch's states out of the table for the duration of the pass.
        let mut states: Vec<SeqState<B>> =
            batch.iter().map(|it| self.sequences.states.remove(&it.seq).expect("checked above")).collect();
        let mut spans = Vec::with_capacity(batch.len());
        let mut ids = Vec::new();
        let mut positions = Vec::new();
        for (item, st) in batch.iter().zip(&states) {
            spans.push(Span { start: ids.len(), len: item.tokens.len(), past: st.len });
            ids.extend_from_slice(item.tokens);
            positions.extend(st.len..st.len + item.tokens.len());
        }
        let eps = self.config.rms_norm_eps as f32;
        let hsz = self.config.hidden_size;

        // 1. token embeddings
        let mut x = b.embedding(&self.embed_tokens, &ids);
        // 2. decoder layers
        for (li, layer) in self.layers.iter().enumerate() {
            let mut layer_states: Vec<&mut LayerState<B>> = states.iter_mut().map(|s| &mut s.layers[li]).collect();
            let h = b.rms_norm(&x, &layer.input_layernorm, eps, NormScale::OnePlus, hsz);
            let mixed = match &layer.mixer {
                Mixer::Linear(gdn) => gdn.forward(b, &h, &spans, &mut layer_states),
                Mixer::Full(attn) => attn.forward(b, &h, &positions, &self.inv_freq, &spans, &mut layer_states),
            };
            b.add_assign(&mut x, &mixed);
            let h = b.rms_norm(&x, &layer.post_attention_layernorm, eps, NormScale::OnePlus, hsz);
            let m = layer.mlp.forward(b, &h);
            b.add_assign(&mut x, &m);
        }
        // 3. final norm and lm_head on the rows that need logits
        let mut wanted = Vec::new();
        for (item, span) in batch.iter().zip(&spans) {
            match item.logits {
                LogitsWanted::None => {}
                LogitsWanted::Last => wanted.push(b.rows(&x, span.start + span.len - 1..span.start + span.len)),
                LogitsWanted::All => wanted.push(b.rows(&x, span.rows())),
            }
        }
        let logits = if wanted.is_empty() {
            vec![]
        } else {
            let hidden = b.rms_norm(&b.cat_rows(&wanted), &self.norm, eps, NormScale::OnePlus, hsz);
            b.to_host(&b.linear(&hidden, self.lm_head.as_ref().unwrap_or(&self.embed_tokens)))
        };
        // 4. hand states back, split logits per item
        let vocab = self.info.vocab_size;
        let mut out = Vec::with_capacity(batch.len());
        let mut offset = 0;
        for ((item, mut st), span) in batch.iter().zip(states.drain(..)).zip(&spans) {
            st.len += span.len;
            self.sequences.states.insert(item.seq, st);
            let rows = match item.logits {
                LogitsWanted::None => 0,
                LogitsWanted::Last => 1,
                LogitsWanted::All => span.len,
            };
            out.push(logits[offset..offset + rows * vocab].to_vec());
            offset += rows * vocab;
        }
        Ok(out)
    }

    fn snapshot(&self, seq: SeqId) -> Result<StateSnapshot> {
        let st = self.sequences.states.get(&seq).with_context(|| format!("sequence {seq:?} does not exist"))?;
        let b = &self.backend;
        let bytes = st
            .layers
            .iter()
            .map(|l| match l {
                LayerState::Attention { k, v } => {
                    let (r, c) = b.shape(k);
                    let (r2, c2) = b.shape(v);
                    (r * c + r2 * c2) * 4
                }
                LayerState::Linear { conv, recurrent } => {
                    let (r, c) = b.shape(conv);
                    let (r2, c2) = b.shape(recurrent);
                    (r * c + r2 * c2) * 4
                }
            })
            .sum();
        Ok(StateSnapshot { len: st.len, data: Box::new(st.clone()), bytes })
    }

    fn restore(&mut self, seq: SeqId, snapshot: &StateSnapshot) -> Result<()> {
        let st = snapshot
            .data
            .downcast_ref::<SeqState<B>>()
            .context("snapshot was taken from a different model or backend")?;
        let slot = self.sequences.states.get_mut(&seq).with_context(|| format!("sequence {seq:?} does not exist"))?;
        *slot = st.clone();
        Ok(())
    }
}
