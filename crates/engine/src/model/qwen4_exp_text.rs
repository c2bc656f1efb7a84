//! Qwen3.8-Flash-Next (`qwen4_exp_text`): a hybrid MoE decoder with sparse attention,
//! hyper-connections and PLE n-gram embeddings.
//!
//! Read beside transformers' `models/qwen4_exp/modular_qwen4_exp.py`. The residual is
//! `hc_count` streams of `hidden_size` values (the embedding copied into each). Each decoder
//! layer is:
//! - on PLE layers, `streams += ple(streams, n-grams of the tokens)`;
//! - `x = attn_mixer.read(streams)`, `streams = write_back(streams, mixer(x))`, where the token
//!   mixer is Gated DeltaNet (sigmoid output gate) or gated attention with QSA;
//! - `x = mlp_mixer.read(streams)`, `streams = write_back(streams, sparse_moe(x))`.
//!
//! There are no decoder norms besides the mixers' own, and no final norm: a last mixer reads
//! the streams for `lm_head`. `mtp.*` (the multi-token-prediction layer) and vision tensors
//! are left in the checkpoint unread.

use super::batch::BatchLayout;
use super::host_phases::HostPhases;
use super::layers::attention::{Attention, AttentionState};
use super::layers::gdn::{GatedDeltaNet, LinearState};
use super::layers::hyper::HyperConnection;
use super::layers::moe::{ExpertLoader, SparseMoe};
use super::layers::ple::{Ple, PleState};
use super::layers::{tensor, text_prefix, Span};
use super::{
    check_greedy_batch, BatchItem, CausalLm, LayerCheckpoint, ModelInfo, SeqCheckpoint, SeqId,
    SequenceTable, StateSnapshot,
};
use crate::backend::Backend;
use crate::checkpoint::Checkpoint;
use crate::config::{LayerType, Qwen4ExpConfig, TextConfig};
use crate::hybrid::expert_cache::{ExpertCache, HeatEntry};
use anyhow::{bail, Context, Result};
use std::collections::HashMap;
use std::sync::{Arc, Mutex};

enum Mixer<B: Backend> {
    Linear(GatedDeltaNet<B>),
    Attention(Attention<B>),
}

/// One decoder layer; public so that tests can hold its blocks to the reference one by one.
pub struct DecoderLayer<B: Backend> {
    pub ple: Option<Ple<B>>,
    pub attn_hyper: HyperConnection<B>,
    mixer: Mixer<B>,
    pub mlp_hyper: HyperConnection<B>,
    pub moe: SparseMoe<B>,
}

/// Per-layer state of one sequence.
pub enum LayerState<B: Backend> {
    Linear {
        gdn: LinearState<B>,
        ple: Option<PleState<B>>,
    },
    Attention(AttentionState<B>),
}

impl<B: Backend> Clone for LayerState<B> {
    fn clone(&self) -> Self {
        match self {
            LayerState::Linear { gdn, ple } => LayerState::Linear {
                gdn: gdn.clone(),
                ple: ple.clone(),
            },
            LayerState::Attention(a) => LayerState::Attention(a.clone()),
        }
    }
}

impl<B: Backend> LayerState<B> {
    pub fn bytes(&self, b: &B) -> usize {
        match self {
            LayerState::Linear { gdn, ple } => {
                gdn.bytes(b)
                    + ple.as_ref().map_or(0, |p| {
                        let (r, c) = b.shape(&p.conv);
                        r * c * 4 + p.context.len() * 4
                    })
            }
            LayerState::Attention(a) => a.bytes(b),
        }
    }

    pub fn attention(&self) -> Option<&AttentionState<B>> {
        match self {
            LayerState::Attention(a) => Some(a),
            LayerState::Linear { .. } => None,
        }
    }

    pub fn attention_mut(&mut self) -> Option<&mut AttentionState<B>> {
        match self {
            LayerState::Attention(a) => Some(a),
            LayerState::Linear { .. } => None,
        }
    }
}

/// One sequence's state: its length and every layer's caches.
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

pub struct Qwen4ExpText<B: Backend> {
    backend: B,
    config: TextConfig,
    pub flash: Qwen4ExpConfig,
    info: ModelInfo,
    embed_tokens: B::Matrix,
    pub layers: Vec<DecoderLayer<B>>,
    pub final_mixer: HyperConnection<B>,
    lm_head: Option<B::Matrix>,
    inv_freq: Vec<f32>,
    sequences: SequenceTable<SeqState<B>>,
    /// Per sequence, its checkpoint (see [`CausalLm::checkpoint`]).
    checkpoints: HashMap<SeqId, SeqCheckpoint<LayerState<B>>>,
    /// The hybrid placement's VRAM expert cache, when the routed experts run hybrid: sessions'
    /// heat is read from it and returning sessions warm it.
    expert_cache: Option<Arc<Mutex<ExpertCache>>>,
}

impl<B: Backend> Qwen4ExpText<B> {
    pub fn load(backend: B, ck: &Checkpoint) -> Result<Self> {
        Self::load_with_experts(backend, ck, None)
    }

    /// [`Qwen4ExpText::load`] with the routed experts of every MoE layer built by `experts`
    /// (hybrid placement) instead of uploaded to the backend.
    pub fn load_with_experts(
        backend: B,
        ck: &Checkpoint,
        mut experts: Option<&mut ExpertLoader<'_, B>>,
    ) -> Result<Self> {
        let c = ck.config.clone();
        let flash = c
            .qwen4_exp()
            .with_context(|| format!("in {}", ck.dir.join("config.json").display()))?;
        let b = &backend;
        let prefix = text_prefix(ck);
        let (h, v, s) = (c.hidden_size, c.vocab_size, flash.hc_count);
        let eps = c.rms_norm_eps as f32;
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
                    flash.output_gate,
                )?),
                LayerType::FullAttention => Mixer::Attention(Attention::load(
                    b,
                    ck,
                    &format!("{p}self_attn."),
                    &c,
                    flash.qsa.as_ref(),
                )?),
            };
            let ple = match &flash.ple {
                Some(pc) => match pc.layers.iter().position(|&l| l == i) {
                    Some(index) => Some(Ple::load(
                        b,
                        ck,
                        &format!("{p}ple."),
                        pc,
                        v,
                        index,
                        h,
                        s,
                        eps,
                    )?),
                    None => None,
                },
                None => None,
            };
            let hyper = |name: &str| {
                HyperConnection::load(
                    b,
                    ck,
                    &format!("{p}{name}."),
                    h,
                    s,
                    flash.hc_lowrank,
                    eps,
                    true,
                )
            };
            layers.push(DecoderLayer {
                ple,
                attn_hyper: hyper("attn_hyper_connection")?,
                mixer,
                mlp_hyper: hyper("mlp_hyper_connection")?,
                moe: SparseMoe::load_with(
                    b,
                    ck,
                    &format!("{p}mlp."),
                    h,
                    &flash.moe,
                    experts.as_deref_mut().map(|f| (i, f)),
                )?,
            });
        }
        let final_mixer = HyperConnection::load(
            b,
            ck,
            &format!("{prefix}hyper_connection_mixer."),
            h,
            s,
            flash.hc_lowrank,
            eps,
            false,
        )?;
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
        let used = super::weight_use(ck);
        let info = ModelInfo {
            architecture: c.architecture,
            vocab_size: v,
            max_context: c.max_position_embeddings,
            eos_token_ids: ck.eos_token_ids(),
            num_layers: c.num_hidden_layers,
            hidden_size: h,
            parameters: used.parameters,
            weight_bytes: used.bytes,
            backend: backend.name(),
        };
        Ok(Qwen4ExpText {
            backend,
            config: c,
            flash,
            info,
            embed_tokens,
            layers,
            final_mixer,
            lm_head,
            inv_freq,
            sequences: SequenceTable::default(),
            checkpoints: HashMap::new(),
            expert_cache: None,
        })
    }

    /// Connects the expert cache of hybrid placement (see [`crate::hybrid::load_flash_next`]).
    pub fn set_expert_cache(&mut self, cache: Arc<Mutex<ExpertCache>>) {
        self.expert_cache = Some(cache);
    }

    pub fn backend(&self) -> &B {
        &self.backend
    }

    /// RoPE inverse frequencies of the attention layers (and the QSA indexer).
    pub fn inv_freq(&self) -> &[f32] {
        &self.inv_freq
    }

    fn empty_state(&self) -> SeqState<B> {
        let b = &self.backend;
        let c = &self.config;
        let layers = self
            .layers
            .iter()
            .map(|l| match &l.mixer {
                Mixer::Linear(_) => LayerState::Linear {
                    gdn: LinearState::new(b, c),
                    ple: l.ple.as_ref().map(|p| p.new_state(b)),
                },
                Mixer::Attention(_) => {
                    LayerState::Attention(AttentionState::new(b, c, self.flash.qsa.as_ref()))
                }
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
        let s = self.flash.hc_count;
        let mut phases = HostPhases::from_env();

        // 1. token embeddings, copied into every stream
        let mut streams = b.embedding_repeated(&self.embed_tokens, ids, s);
        phases.mark("embedding");
        // 2. decoder layers
        for (li, layer) in self.layers.iter().enumerate() {
            let mut layer_states: Vec<&mut LayerState<B>> =
                states.iter_mut().map(|st| &mut st.layers[li]).collect();
            streams = layer.forward(
                b,
                streams,
                ids,
                positions,
                &self.inv_freq,
                spans,
                &mut layer_states,
                &mut phases,
            );
        }
        // 3. final mixer and lm_head on the rows that need logits
        let wanted = layout.logit_rows(b, &streams, batch);
        let logits = (!wanted.is_empty()).then(|| {
            let (hidden, _) = self.final_mixer.read(b, &b.cat_rows(&wanted));
            b.linear(&hidden, self.lm_head.as_ref().unwrap_or(&self.embed_tokens))
        });
        phases.mark("final mixer + lm_head");
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

impl<B: Backend> DecoderLayer<B> {
    /// The layer's attention, when it is an attention layer.
    pub fn attention(&self) -> Option<&Attention<B>> {
        match &self.mixer {
            Mixer::Attention(a) => Some(a),
            Mixer::Linear(_) => None,
        }
    }

    #[allow(clippy::too_many_arguments)]
    fn forward(
        &self,
        b: &B,
        streams: B::Act,
        ids: &[u32],
        positions: &[usize],
        inv_freq: &[f32],
        spans: &[Span],
        states: &mut [&mut LayerState<B>],
        phases: &mut HostPhases,
    ) -> B::Act {
        let mut streams = streams;
        // 1. PLE, then the token mixer between its hyper-connection read and write-back
        let (x, inject) = match &self.mixer {
            Mixer::Linear(gdn) => {
                let mut gdn_states = Vec::with_capacity(states.len());
                let mut ple_states = Vec::with_capacity(states.len());
                for st in states.iter_mut() {
                    let LayerState::Linear { gdn, ple } = &mut **st else {
                        unreachable!("layer state kinds follow the layer types")
                    };
                    gdn_states.push(gdn);
                    ple_states.extend(ple.as_mut());
                }
                if let Some(ple) = &self.ple {
                    let add = ple.forward(b, &streams, ids, spans, &mut ple_states);
                    b.add_assign(&mut streams, &add);
                    phases.mark("ple");
                }
                let (x, inject) = self.attn_hyper.read(b, &streams);
                phases.mark("hyper read");
                let out = gdn.forward(b, &x, spans, &mut gdn_states);
                phases.mark("linear attention");
                (out, inject)
            }
            Mixer::Attention(attn) => {
                let mut attn_states: Vec<&mut AttentionState<B>> = states
                    .iter_mut()
                    .map(|st| match &mut **st {
                        LayerState::Attention(a) => a,
                        LayerState::Linear { .. } => {
                            unreachable!("layer state kinds follow the layer types")
                        }
                    })
                    .collect();
                let (x, inject) = self.attn_hyper.read(b, &streams);
                phases.mark("hyper read");
                let out = attn.forward(b, &x, positions, inv_freq, spans, &mut attn_states);
                phases.mark("full attention");
                (out, inject)
            }
        };
        let streams =
            self.attn_hyper
                .write_back(b, &streams, &x, &inject.expect("layer mixers write back"));
        // 2. sparse MoE between the second read and write-back
        let (x, inject) = self.mlp_hyper.read(b, &streams);
        phases.mark("hyper write-back + read");
        let out = self.moe.forward(b, &x);
        phases.mark("moe");
        let streams =
            self.mlp_hyper
                .write_back(b, &streams, &out, &inject.expect("layer mixers write back"));
        phases.mark("hyper write-back + read");
        streams
    }
}

impl<B: Backend> CausalLm for Qwen4ExpText<B> {
    fn info(&self) -> &ModelInfo {
        &self.info
    }

    /// The cache's recent heat (its counts decay with a half-life of tokens, so at the end of
    /// a turn they are mostly that turn's routing; concurrent sessions blur it), as many
    /// entries as the cache has slots.
    fn routing_heat(&self, seq: SeqId) -> Option<Vec<HeatEntry>> {
        let _ = seq;
        let c = self.expert_cache.as_ref()?.lock().expect("expert cache");
        Some(c.heat(c.config().slots.max(1)))
    }

    /// Raises the returning session's experts in the cache; the layers copy in what it then
    /// holds resident at their next step.
    fn prefetch_experts(&mut self, heat: &[HeatEntry]) {
        if let Some(c) = &self.expert_cache {
            if let Err(e) = c.lock().expect("expert cache").warm(heat) {
                tracing::warn!("expert cache: session heat not used: {e:#}");
            }
        }
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
        use crate::cache::state::{write_attention, write_linear, write_ple};
        let st = self.sequences.state(seq)?;
        let b = &self.backend;
        let mut out = crate::cache::HostState::new(st.len);
        for l in &st.layers {
            match l {
                LayerState::Attention(a) => write_attention(&mut out, b, a),
                LayerState::Linear { gdn, ple } => {
                    write_linear(&mut out, b, gdn);
                    if let Some(p) = ple {
                        write_ple(&mut out, b, p);
                    }
                }
            }
        }
        Ok(out)
    }

    fn import_state(&mut self, seq: SeqId, host: &crate::cache::HostState) -> Result<()> {
        use crate::cache::state::{read_attention, read_linear, read_ple};
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
                LayerState::Linear { gdn, ple } => LayerState::Linear {
                    gdn: read_linear(&mut r, b, gdn)?,
                    ple: match ple {
                        Some(p) => Some(read_ple(&mut r, b, p)?),
                        None => None,
                    },
                },
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

/// A small `qwen4_exp_text` config for the `demo-moe` model: every Flash-Next block (QSA past
/// 256 tokens, PLE, 4 hyper-connection streams, 16 experts of which 4 are routed) at a size
/// that loads in a few hundred MB, with the given vocabulary (the real tokenizer's for a demo
/// that talks) and eos.
pub fn demo_config(vocab_size: usize, eos_token_id: u32) -> serde_json::Value {
    let dense = serde_json::json!({
        "model_type": "qwen4_exp_text",
        "architectures": ["Qwen4ExpForCausalLM"],
        "vocab_size": vocab_size,
        "hidden_size": 256,
        "num_hidden_layers": 8,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 64,
        "hidden_act": "silu",
        "output_gate_type": "sigmoid",
        "max_position_embeddings": 32768,
        "rms_norm_eps": 1e-6,
        "tie_word_embeddings": false,
        "rope_parameters": {"rope_type": "default", "rope_theta": 10000000.0, "partial_rotary_factor": 0.25,
                            "mrope_section": [11, 11, 10], "mrope_interleaved": true},
        "linear_conv_kernel_dim": 4,
        "linear_key_head_dim": 32,
        "linear_value_head_dim": 32,
        "linear_num_key_heads": 4,
        "linear_num_value_heads": 8,
        "layer_types": ["linear_attention", "linear_attention", "linear_attention", "full_attention",
                        "linear_attention", "linear_attention", "linear_attention", "full_attention"],
        "eos_token_id": eos_token_id,
        "bos_token_id": null,
        "pad_token_id": null
    });
    let flash = serde_json::json!({
        "moe_intermediate_size": 128,
        "shared_expert_intermediate_size": 128,
        "num_experts": 16,
        "num_experts_per_tok": 4,
        "norm_topk_prob": true,
        "hc_count": 4,
        "hc_lowrank": 32,
        "ple_layer_ids": [2],
        "ple_embed_dim": 256,
        "ple_conv_kernel_size": 4,
        "ngram_size": 3,
        "heads_per_ngram": 8,
        "ngram_vocab_size_base": 4096,
        "make_ngram_vocab_size_divisible_by": 128,
        "seed": 1234,
        "split_ngram_parts": 4,
        "indexer_n_heads": 4,
        "indexer_kv_heads": 1,
        "indexer_head_dim": 32,
        "indexer_budget": 256,
        "indexer_compress_ratio": 4
    });
    let mut config = dense;
    for (k, v) in flash.as_object().expect("a JSON object") {
        config[k] = v.clone();
    }
    config
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn demo_config_is_a_valid_flash_next_config() {
        let c = TextConfig::from_value(&demo_config(151_936, 151_645)).unwrap();
        let f = c.qwen4_exp().unwrap();
        assert_eq!(c.vocab_size, 151_936);
        assert_eq!(c.eos_token_ids, vec![151_645]);
        assert!(f.qsa.is_some() && f.ple.is_some());
        assert!(f.moe.num_experts > f.moe.num_experts_per_tok && f.hc_count > 1);
    }
}
