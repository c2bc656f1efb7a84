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

use super::batch::BatchLayout;
use super::host_phases::HostPhases;
use super::layers::attention::{Attention, AttentionState};
use super::layers::gdn::{GatedDeltaNet, LinearState};
use super::layers::mlp::Mlp;
use super::layers::{tensor, text_prefix, vector};
use super::{
    check_greedy_batch, BatchItem, CausalLm, LayerCheckpoint, ModelInfo, SeqCheckpoint, SeqId,
    SequenceTable, StateSnapshot,
};
use crate::backend::{Backend, NormScale};
use crate::checkpoint::Checkpoint;
use crate::config::{GateActivation, LayerType, TextConfig};
use anyhow::{bail, Context, Result};
use std::collections::HashMap;

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
    Attention(AttentionState<B>),
    /// Conv history `[K-1, conv_dim]` and recurrent state `[v_heads·dk, dv]` (f32).
    Linear(LinearState<B>),
}

impl<B: Backend> Clone for LayerState<B> {
    fn clone(&self) -> Self {
        match self {
            LayerState::Attention(a) => LayerState::Attention(a.clone()),
            LayerState::Linear(l) => LayerState::Linear(l.clone()),
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
        SeqState {
            len: self.len,
            layers: self.layers.clone(),
        }
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
    /// Per sequence, its checkpoint (see [`CausalLm::checkpoint`]).
    checkpoints: HashMap<SeqId, SeqCheckpoint<LayerState<B>>>,
}

impl<B: Backend> LayerState<B> {
    fn bytes(&self, b: &B) -> usize {
        match self {
            LayerState::Attention(a) => a.bytes(b),
            LayerState::Linear(l) => l.bytes(b),
        }
    }

    fn attention(&self) -> Option<&AttentionState<B>> {
        match self {
            LayerState::Attention(a) => Some(a),
            LayerState::Linear(_) => None,
        }
    }

    fn attention_mut(&mut self) -> Option<&mut AttentionState<B>> {
        match self {
            LayerState::Attention(a) => Some(a),
            LayerState::Linear(_) => None,
        }
    }
}

impl<B: Backend> Qwen3_5Text<B> {
    pub fn load(backend: B, ck: &Checkpoint) -> Result<Self> {
        let c = ck.config.clone();
        let b = &backend;
        let prefix = text_prefix(ck);
        let (h, v) = (c.hidden_size, c.vocab_size);
        let embed_tokens = b.matrix(&tensor(
            ck,
            &format!("{prefix}embed_tokens.weight"),
            &[v, h],
        )?)?;
        let mut layers = Vec::with_capacity(c.num_hidden_layers);
        for (i, kind) in c.layer_types.iter().enumerate() {
            let p = format!("{prefix}layers.{i}.");
            let mixer = match kind {
                LayerType::LinearAttention => Mixer::Linear(GatedDeltaNet::load(
                    b,
                    ck,
                    &format!("{p}linear_attn."),
                    &c,
                    GateActivation::Silu,
                )?),
                LayerType::FullAttention => {
                    Mixer::Full(Attention::load(b, ck, &format!("{p}self_attn."), &c, None)?)
                }
            };
            layers.push(DecoderLayer {
                input_layernorm: vector(b, ck, &format!("{p}input_layernorm.weight"), h)?,
                mixer,
                post_attention_layernorm: vector(
                    b,
                    ck,
                    &format!("{p}post_attention_layernorm.weight"),
                    h,
                )?,
                mlp: Mlp::load(b, ck, &format!("{p}mlp."), h, c.intermediate_size)?,
            });
        }
        let norm = vector(b, ck, &format!("{prefix}norm.weight"), h)?;
        let lm_head = if ck.weights.contains("lm_head.weight") {
            Some(b.matrix(&tensor(ck, "lm_head.weight", &[v, h])?)?)
        } else if c.tie_word_embeddings {
            None
        } else {
            bail!(
                "tensor lm_head.weight is missing and tie_word_embeddings is false in config.json"
            );
        };
        let rot = c.rotary_dim();
        let inv_freq = (0..rot / 2)
            .map(|i| (1.0 / c.rope.theta.powf((2 * i) as f64 / rot as f64)) as f32)
            .collect();
        let super::WeightUse {
            parameters,
            bytes: weight_bytes,
            ..
        } = super::weight_use(ck);
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
            checkpoints: HashMap::new(),
        })
    }

    fn empty_state(&self) -> SeqState<B> {
        let b = &self.backend;
        let c = &self.config;
        let layers = c
            .layer_types
            .iter()
            .map(|t| match t {
                LayerType::FullAttention => LayerState::Attention(AttentionState::new(b, c, None)),
                LayerType::LinearAttention => LayerState::Linear(LinearState::new(b, c)),
            })
            .collect();
        SeqState { len: 0, layers }
    }

    /// One forward pass over `batch`; `read_out` turns the logits of the rows that want them
    /// (on the backend; `None` when no item wants any) into what the caller returns.
    fn pass<R: Default>(
        &mut self,
        batch: &[BatchItem<'_>],
        read_out: impl FnOnce(&B, &BatchLayout, Option<&B::Act>) -> R,
    ) -> Result<R> {
        self.check_batch(batch)?;
        if batch.is_empty() {
            return Ok(R::default());
        }
        let b = &self.backend;
        let mut states = self.sequences.take_batch(batch);
        let layout = BatchLayout::new(batch, states.iter().map(|s| s.len));
        let (spans, ids, positions) = (&layout.spans, &layout.ids, &layout.positions);
        let eps = self.config.rms_norm_eps as f32;
        let hsz = self.config.hidden_size;
        let mut phases = HostPhases::from_env();

        // 1. token embeddings
        let mut x = b.embedding(&self.embed_tokens, ids);
        phases.mark("embedding");
        // 2. decoder layers; each residual add is fused with the norm that reads the sum
        //    (the next block's input norm), the last one stands alone
        let mut h = match self.layers.first() {
            Some(first) => b.rms_norm(&x, &first.input_layernorm, eps, NormScale::OnePlus, hsz),
            None => x.clone(),
        };
        for (li, layer) in self.layers.iter().enumerate() {
            let mixed = match &layer.mixer {
                Mixer::Linear(gdn) => {
                    let mut layer_states: Vec<&mut LinearState<B>> = states
                        .iter_mut()
                        .map(|s| match &mut s.layers[li] {
                            LayerState::Linear(l) => l,
                            LayerState::Attention(_) => {
                                unreachable!("layer state kinds follow the layer types")
                            }
                        })
                        .collect();
                    let out = gdn.forward(b, &h, spans, &mut layer_states);
                    phases.mark("linear attention");
                    out
                }
                Mixer::Full(attn) => {
                    let mut layer_states: Vec<&mut AttentionState<B>> = states
                        .iter_mut()
                        .map(|s| match &mut s.layers[li] {
                            LayerState::Attention(a) => a,
                            LayerState::Linear(_) => {
                                unreachable!("layer state kinds follow the layer types")
                            }
                        })
                        .collect();
                    let out =
                        attn.forward(b, &h, positions, &self.inv_freq, spans, &mut layer_states);
                    phases.mark("full attention");
                    out
                }
            };
            let h_mlp = b.add_rms_norm(
                &mut x,
                &mixed,
                &layer.post_attention_layernorm,
                eps,
                NormScale::OnePlus,
                hsz,
            );
            phases.mark("residual + norm");
            let m = layer.mlp.forward(b, &h_mlp);
            phases.mark("mlp");
            match self.layers.get(li + 1) {
                Some(next) => {
                    h = b.add_rms_norm(
                        &mut x,
                        &m,
                        &next.input_layernorm,
                        eps,
                        NormScale::OnePlus,
                        hsz,
                    )
                }
                None => b.add_assign(&mut x, &m),
            }
            phases.mark("residual + norm");
        }
        // 3. final norm and lm_head on the rows that need logits
        let wanted = layout.logit_rows(b, &x, batch);
        let logits = (!wanted.is_empty()).then(|| {
            let hidden = b.rms_norm(
                &b.cat_rows(&wanted),
                &self.norm,
                eps,
                NormScale::OnePlus,
                hsz,
            );
            b.linear(&hidden, self.lm_head.as_ref().unwrap_or(&self.embed_tokens))
        });
        phases.mark("final norm + lm_head");
        // 4. hand states back, read the logits out per item
        self.sequences
            .put_back(batch, states, &layout, |st, n| st.len += n);
        let out = read_out(&self.backend, &layout, logits.as_ref());
        phases.mark("read logits (waits for the GPU)");
        phases.print(ids.len());
        Ok(out)
    }

    fn check_batch(&self, batch: &[BatchItem<'_>]) -> Result<()> {
        for (i, item) in batch.iter().enumerate() {
            let Some(state) = self.sequences.states.get(&item.seq) else {
                bail!(
                    "sequence {:?} does not exist (it was dropped or never created)",
                    item.seq
                );
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
                bail!(
                    "sequence would hold {total} tokens; the model's context is {} tokens",
                    self.info.max_context
                );
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
        self.checkpoints.remove(&seq);
    }

    fn sequence_len(&self, seq: SeqId) -> Option<usize> {
        self.sequences.states.get(&seq).map(|s| s.len)
    }

    fn forward(&mut self, batch: &[BatchItem<'_>]) -> Result<Vec<Vec<f32>>> {
        let vocab = self.info.vocab_size;
        self.pass(batch, |b, layout, logits| {
            layout.logits_per_item(b, batch, logits, vocab)
        })
    }

    fn forward_greedy(
        &mut self,
        batch: &[BatchItem<'_>],
        limit: usize,
    ) -> Result<Vec<Option<u32>>> {
        check_greedy_batch(batch)?;
        self.pass(batch, |b, layout, logits| {
            layout.greedy_per_item(b, batch, logits, limit)
        })
    }

    fn snapshot(&self, seq: SeqId) -> Result<StateSnapshot> {
        let st = self.sequences.state(seq)?;
        let b = &self.backend;
        let bytes = st.layers.iter().map(|l| l.bytes(b)).sum();
        Ok(StateSnapshot {
            len: st.len,
            data: Box::new(st.clone()),
            bytes,
        })
    }

    fn restore(&mut self, seq: SeqId, snapshot: &StateSnapshot) -> Result<()> {
        self.sequences.restore_snapshot(seq, snapshot)?;
        self.checkpoints.remove(&seq);
        Ok(())
    }

    fn checkpoint(&mut self, seq: SeqId) -> Result<usize> {
        let st = self.sequences.state(seq)?;
        let ck = super::take_checkpoint(&self.backend, st.len, &st.layers, LayerState::attention);
        let len = ck.len;
        self.checkpoints.insert(seq, ck);
        Ok(len)
    }

    fn rollback(&mut self, seq: SeqId) -> Result<usize> {
        let ck = self
            .checkpoints
            .get(&seq)
            .with_context(|| format!("sequence {seq:?} has no checkpoint to roll back to"))?;
        let st = self
            .sequences
            .states
            .get_mut(&seq)
            .with_context(|| format!("sequence {seq:?} does not exist"))?;
        super::roll_back(
            &self.backend,
            &mut st.len,
            &mut st.layers,
            ck,
            LayerState::attention_mut,
        )?;
        Ok(st.len)
    }

    fn state_bytes(&self, seq: SeqId) -> Option<usize> {
        let b = &self.backend;
        let st = self.sequences.states.get(&seq)?;
        let copies = self.checkpoints.get(&seq).map_or(0, |ck| {
            ck.layers
                .iter()
                .map(|l| match l {
                    LayerCheckpoint::Copy(l) => l.bytes(b),
                    LayerCheckpoint::Cache(_) => 0,
                })
                .sum()
        });
        Some(st.layers.iter().map(|l| l.bytes(b)).sum::<usize>() + copies)
    }

    fn export_state(&self, seq: SeqId) -> Result<crate::cache::HostState> {
        use crate::cache::state::{write_attention, write_linear};
        let st = self.sequences.state(seq)?;
        let b = &self.backend;
        let mut out = crate::cache::HostState::new(st.len);
        for l in &st.layers {
            match l {
                LayerState::Attention(a) => write_attention(&mut out, b, a),
                LayerState::Linear(l) => write_linear(&mut out, b, l),
            }
        }
        Ok(out)
    }

    fn import_state(&mut self, seq: SeqId, host: &crate::cache::HostState) -> Result<()> {
        use crate::cache::state::{read_attention, read_linear};
        if !self.sequences.states.contains_key(&seq) {
            bail!("sequence {seq:?} does not exist");
        }
        let b = &self.backend;
        let template = self.empty_state();
        let mut r = host.reader();
        let mut layers = Vec::with_capacity(template.layers.len());
        for l in &template.layers {
            layers.push(match l {
                LayerState::Attention(a) => {
                    LayerState::Attention(read_attention(&mut r, b, a, host.len)?)
                }
                LayerState::Linear(l) => LayerState::Linear(read_linear(&mut r, b, l)?),
            });
        }
        r.finish()?;
        self.checkpoints.remove(&seq);
        self.sequences.states.insert(
            seq,
            SeqState {
                len: host.len,
                layers,
            },
        );
        Ok(())
    }
}
