//! `qwen4_exp_text` (Flash-Next) split over N ranks: the decoder of `model::qwen4_exp_text`,
//! each rank running its shard on its own thread and backend, with two all-reduces per layer.
//!
//! What each rank holds (the plan is [`shard::plan`]):
//! - attention (with QSA): its query heads and the KV heads they read (replicated when there
//!   are fewer KV heads than ranks); `o_proj` by its input columns, so the output is a partial
//!   sum. The QSA indexer is replicated: its selection of key blocks is one choice per token
//!   shared by every attention head (the indexer's heads are summed into one score), so cutting
//!   its heads would need a third exchange per attention layer for a few small matmuls;
//! - Gated DeltaNet: its value heads and the key heads they read; `out_proj` by columns;
//! - sparse MoE: the router replicated (every rank routes every row identically); the shared
//!   expert's width split like an MLP; each routed expert computed by the one rank that owns it
//!   ([`RankExperts`]), read from one copy of the weights for all ranks (each rank uploads only
//!   the experts it owns; with hybrid placement they share one host expert store). The routed
//!   partial sum and the shared expert's partial sum are one sum, reduced in one exchange;
//! - hyper-connection mixers, PLE (its n-gram table read in place from the one checkpoint) and
//!   the embedding replicated: they are cheap, and the residual streams they read must be the
//!   same on every rank anyway;
//! - `lm_head` by vocabulary rows; the logits are gathered in rank order.
//!
//! Because the all-reduce gives every rank the same sums in the same order and every
//! replicated step is the same computation, the residual streams stay identical on all ranks.

use super::experts::RankExperts;
use super::shard::{self, RankShard};
use super::RankExchange;
use crate::backend::Backend;
use crate::backend::{ExpertMatrices, MoeRouting};
use crate::checkpoint::Checkpoint;
use crate::config::{LayerType, MoeConfig, Qwen4ExpConfig, TextConfig};
use crate::hybrid::expert_cache::{ExpertCache, HeatEntry};
use crate::model::batch::BatchLayout;
use crate::model::layers::attention::{Attention, AttentionState};
use crate::model::layers::gdn::{GatedDeltaNet, LinearState};
use crate::model::layers::hyper::HyperConnection;
use crate::model::layers::moe::{load_expert_matrices_of, RoutedExperts, SparseMoe};
use crate::model::layers::ple::{Ple, PleState};
use crate::model::layers::{tensor, text_prefix, Span};
use crate::model::qwen4_exp_text::{LayerState, SeqState};
use crate::model::{
    BatchItem, CausalLm, LayerCheckpoint, LogitsWanted, ModelInfo, SeqCheckpoint, SeqId,
    SequenceTable, StateSnapshot,
};
use anyhow::{bail, Context, Result};
use std::collections::HashMap;
use std::sync::{Arc, Mutex};

enum Mixer<B: Backend> {
    Linear(GatedDeltaNet<B>),
    Attention(Attention<B>),
}

struct DecoderLayer<B: Backend> {
    ple: Option<Ple<B>>,
    attn_hyper: HyperConnection<B>,
    mixer: Mixer<B>,
    mlp_hyper: HyperConnection<B>,
    moe: SparseMoe<B>,
}

/// One rank: its backend, its shard of every layer, the replicated embedding and mixers, its
/// vocabulary rows of the head, and its end of the exchange.
struct Rank<B: Backend> {
    backend: B,
    shard: RankShard,
    /// The config of the shard's sizes (its states are created from it).
    config: TextConfig,
    embed_tokens: B::Matrix,
    layers: Vec<DecoderLayer<B>>,
    final_mixer: HyperConnection<B>,
    head: B::Matrix,
    exchange: Box<dyn RankExchange<B>>,
    /// This rank's VRAM expert cache (hybrid placement with fewer slots than experts).
    expert_cache: Option<Arc<Mutex<ExpertCache>>>,
}

/// What one rank computes for a batch: the states it updated and its logits columns.
struct RankOutput<B: Backend> {
    states: Vec<SeqState<B>>,
    /// `[rows, vocab shard]`.
    logits: Vec<f32>,
}

/// Builds rank `shard.rank`'s routed experts of layer `layer` (tensor prefix `…mlp.experts.`)
/// on its backend. It is given only the routed pairs of the experts the rank owns.
pub type RankExpertLoader<'a, B> =
    dyn FnMut(&B, &RankShard, usize, &str) -> Result<Box<dyn RoutedExperts<B>>> + 'a;

/// The routed experts a rank owns, uploaded to its backend; `local[e]` is expert `e`'s index
/// in `experts` (`None` for the other ranks' experts, which never reach this rank).
pub struct OwnedExperts<B: Backend> {
    experts: Vec<ExpertMatrices<B::Matrix>>,
    local: Vec<Option<u32>>,
}

impl<B: Backend> OwnedExperts<B> {
    /// Uploads the experts `shard` owns of the layer under `prefix` from `ck`.
    pub fn load(
        b: &B,
        ck: &Checkpoint,
        prefix: &str,
        moe: &MoeConfig,
        shard: &RankShard,
    ) -> Result<Self> {
        let owned = shard.owned_experts(moe.num_experts);
        let mut local = vec![None; moe.num_experts];
        for (i, &e) in owned.iter().enumerate() {
            local[e] = Some(i as u32);
        }
        Ok(OwnedExperts {
            experts: load_expert_matrices_of(b, ck, prefix, ck.config.hidden_size, moe, &owned)?,
            local,
        })
    }
}

impl<B: Backend> RoutedExperts<B> for OwnedExperts<B> {
    fn forward(&self, b: &B, x: &B::Act, routing: &MoeRouting) -> B::Act {
        let experts = routing
            .experts
            .iter()
            .map(|&e| {
                self.local[e as usize].unwrap_or_else(|| {
                    panic!("expert {e} was routed to a rank that does not own it")
                })
            })
            .collect();
        let local = MoeRouting {
            top_k: routing.top_k,
            experts,
            weights: routing.weights.clone(),
        };
        b.moe_experts(x, &local, &self.experts)
    }
}

pub struct TpQwen4ExpText<B: Backend> {
    config: TextConfig,
    flash: Qwen4ExpConfig,
    info: ModelInfo,
    ranks: Vec<Rank<B>>,
    inv_freq: Vec<f32>,
    /// Per sequence, one state per rank (each holds its heads' caches).
    sequences: SequenceTable<Vec<SeqState<B>>>,
    /// Per sequence, one checkpoint per rank (see [`CausalLm::checkpoint`]).
    checkpoints: HashMap<SeqId, Vec<SeqCheckpoint<LayerState<B>>>>,
}

impl<B: Backend> TpQwen4ExpText<B> {
    /// One backend and one exchange per rank, in rank order; each rank uploads the routed
    /// experts it owns to its backend.
    pub fn load(
        backends: Vec<B>,
        exchanges: Vec<Box<dyn RankExchange<B>>>,
        ck: &Checkpoint,
    ) -> Result<Self> {
        let moe = ck.config.qwen4_exp()?.moe;
        let mut owned = |b: &B, s: &RankShard, _layer: usize, prefix: &str| {
            Ok(Box::new(OwnedExperts::load(b, ck, prefix, &moe, s)?) as Box<dyn RoutedExperts<B>>)
        };
        Self::load_with_experts(backends, exchanges, ck, &mut owned)
    }

    /// [`TpQwen4ExpText::load`] with each rank's routed experts built by `experts` (hybrid
    /// placement plugs in here); each is wrapped in a [`RankExperts`], so it only ever sees
    /// the pairs of the experts its rank owns.
    pub fn load_with_experts(
        backends: Vec<B>,
        exchanges: Vec<Box<dyn RankExchange<B>>>,
        ck: &Checkpoint,
        experts: &mut RankExpertLoader<'_, B>,
    ) -> Result<Self> {
        let c = ck.config.clone();
        let flash = c
            .qwen4_exp()
            .with_context(|| format!("in {}", ck.dir.join("config.json").display()))?;
        if backends.len() != exchanges.len() {
            bail!(
                "{} backends but {} exchanges: one of each per rank",
                backends.len(),
                exchanges.len()
            );
        }
        let plan = shard::plan(&c, backends.len())?;
        let prefix = text_prefix(ck);
        let (h, v, streams) = (c.hidden_size, c.vocab_size, flash.hc_count);
        let eps = c.rms_norm_eps as f32;
        let embed = tensor(ck, &format!("{prefix}embed_tokens.weight"), &[v, h])?;
        let head = if ck.weights.contains("lm_head.weight") {
            tensor(ck, "lm_head.weight", &[v, h])?
        } else if c.tie_word_embeddings {
            embed.clone()
        } else {
            bail!(
                "tensor lm_head.weight is missing and tie_word_embeddings is false in config.json"
            );
        };
        let mut ranks = Vec::with_capacity(plan.len());
        for ((s, b), exchange) in plan.into_iter().zip(backends).zip(exchanges) {
            // The cut tensors (attention, GDN, shared expert) come from the shard; the
            // replicated blocks (PLE with its table, mixers) and the routed experts from `ck`.
            let sck = shard::layer_checkpoint(ck, &s)
                .with_context(|| format!("building the shard of rank {}", s.rank))?;
            let sc = sck.config.clone();
            let rank_moe = MoeConfig {
                shared_expert_intermediate_size: s.shared_expert.len(),
                ..flash.moe.clone()
            };
            let mut layers = Vec::with_capacity(sc.num_hidden_layers);
            for (i, kind) in sc.layer_types.iter().enumerate() {
                let p = format!("{prefix}layers.{i}.");
                let mixer = match kind {
                    LayerType::LinearAttention => Mixer::Linear(GatedDeltaNet::load(
                        &b,
                        &sck,
                        &format!("{p}linear_attn."),
                        &sc,
                        flash.output_gate,
                    )?),
                    LayerType::FullAttention => Mixer::Attention(Attention::load(
                        &b,
                        &sck,
                        &format!("{p}self_attn."),
                        &sc,
                        flash.qsa.as_ref(),
                    )?),
                };
                let ple = match &flash.ple {
                    Some(pc) => match pc.layers.iter().position(|&l| l == i) {
                        Some(index) => Some(Ple::load(
                            &b,
                            ck,
                            &format!("{p}ple."),
                            pc,
                            v,
                            index,
                            h,
                            streams,
                            eps,
                        )?),
                        None => None,
                    },
                    None => None,
                };
                let hyper = |name: &str| {
                    HyperConnection::load(
                        &b,
                        ck,
                        &format!("{p}{name}."),
                        h,
                        streams,
                        flash.hc_lowrank,
                        eps,
                        true,
                    )
                };
                let mut rank_experts = |b: &B, layer: usize, ep: &str| {
                    Ok(
                        Box::new(RankExperts::new(experts(b, &s, layer, ep)?, s.clone()))
                            as Box<dyn RoutedExperts<B>>,
                    )
                };
                layers.push(DecoderLayer {
                    ple,
                    attn_hyper: hyper("attn_hyper_connection")?,
                    mixer,
                    mlp_hyper: hyper("mlp_hyper_connection")?,
                    moe: SparseMoe::load_with(
                        &b,
                        &sck,
                        &format!("{p}mlp."),
                        h,
                        &rank_moe,
                        Some((i, &mut rank_experts)),
                    )
                    .with_context(|| format!("rank {} of {}, layer {i}", s.rank, s.ranks))?,
                });
            }
            ranks.push(Rank {
                embed_tokens: b.matrix(&embed)?,
                final_mixer: HyperConnection::load(
                    &b,
                    ck,
                    &format!("{prefix}hyper_connection_mixer."),
                    h,
                    streams,
                    flash.hc_lowrank,
                    eps,
                    false,
                )?,
                head: b.matrix(&shard::vocab_rows(&head, s.vocab.clone())?)?,
                layers,
                config: sc,
                shard: s,
                exchange,
                backend: b,
                expert_cache: None,
            });
        }
        let rot = c.rotary_dim();
        let inv_freq = (0..rot / 2)
            .map(|i| (1.0 / c.rope.theta.powf((2 * i) as f64 / rot as f64)) as f32)
            .collect();
        let used = crate::model::weight_use(ck);
        let info = ModelInfo {
            architecture: c.architecture,
            vocab_size: v,
            max_context: c.max_position_embeddings,
            eos_token_ids: ck.eos_token_ids(),
            num_layers: c.num_hidden_layers,
            hidden_size: h,
            parameters: used.parameters,
            weight_bytes: used.bytes,
            backend: format!(
                "{} × {} (tensor parallel)",
                ranks.len(),
                ranks[0].backend.name()
            ),
        };
        Ok(TpQwen4ExpText {
            config: c,
            flash,
            info,
            ranks,
            inv_freq,
            sequences: SequenceTable::default(),
            checkpoints: HashMap::new(),
        })
    }

    /// The plan each rank runs.
    pub fn shards(&self) -> Vec<&RankShard> {
        self.ranks.iter().map(|r| &r.shard).collect()
    }

    /// Connects rank `rank`'s VRAM expert cache (hybrid placement): its heat is reported and
    /// returning sessions warm it.
    pub fn set_expert_cache(&mut self, rank: usize, cache: Arc<Mutex<ExpertCache>>) {
        self.ranks[rank].expert_cache = Some(cache);
    }

    /// Rank `rank`'s VRAM expert cache, when it has one.
    pub fn expert_cache(&self, rank: usize) -> Option<&Arc<Mutex<ExpertCache>>> {
        self.ranks.get(rank)?.expert_cache.as_ref()
    }

    fn empty_state(&self, rank: &Rank<B>) -> SeqState<B> {
        let b = &rank.backend;
        let layers = rank
            .layers
            .iter()
            .map(|l| match &l.mixer {
                Mixer::Linear(_) => LayerState::Linear {
                    gdn: LinearState::new(b, &rank.config),
                    ple: l.ple.as_ref().map(|p| p.new_state(b)),
                },
                Mixer::Attention(_) => LayerState::Attention(AttentionState::new(
                    b,
                    &rank.config,
                    self.flash.qsa.as_ref(),
                )),
            })
            .collect();
        SeqState { len: 0, layers }
    }

    fn check_batch(&self, batch: &[BatchItem<'_>]) -> Result<()> {
        for (i, item) in batch.iter().enumerate() {
            let Some(states) = self.sequences.states.get(&item.seq) else {
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
            crate::model::check_token_ids(&self.config, item.tokens)?;
            let total = states[0].len + item.tokens.len();
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
    /// The layer on this rank's shard; `Err` when an exchange fails.
    #[allow(clippy::too_many_arguments)]
    fn forward(
        &self,
        b: &B,
        exchange: &mut dyn RankExchange<B>,
        streams: B::Act,
        ids: &[u32],
        positions: &[usize],
        inv_freq: &[f32],
        spans: &[Span],
        states: &mut [&mut LayerState<B>],
    ) -> Result<B::Act> {
        let mut streams = streams;
        // 1. PLE (replicated), then the token mixer on this rank's heads
        let (mut mixed, inject) = match &self.mixer {
            Mixer::Linear(gdn) => {
                let mut gdn_states = Vec::with_capacity(states.len());
                let mut ple_states: Vec<&mut PleState<B>> = Vec::with_capacity(states.len());
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
                }
                let (x, inject) = self.attn_hyper.read(b, &streams);
                (gdn.forward(b, &x, spans, &mut gdn_states), inject)
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
                (
                    attn.forward(b, &x, positions, inv_freq, spans, &mut attn_states),
                    inject,
                )
            }
        };
        // All-reduce 1: the output projection's partial sums over this rank's heads.
        exchange.all_reduce(b, &mut mixed)?;
        let streams = self.attn_hyper.write_back(
            b,
            &streams,
            &mixed,
            &inject.expect("layer mixers write back"),
        );
        // 2. sparse MoE: this rank's routed experts plus its columns of the shared expert
        let (x, inject) = self.mlp_hyper.read(b, &streams);
        let mut out = self.moe.forward(b, &x);
        // All-reduce 2: the routed and shared partial sums together.
        exchange.all_reduce(b, &mut out)?;
        Ok(self
            .mlp_hyper
            .write_back(b, &streams, &out, &inject.expect("layer mixers write back")))
    }
}

impl<B: Backend> Rank<B> {
    /// This rank's part of the forward pass; `Err` when an exchange fails.
    fn forward(
        &mut self,
        batch: &[BatchItem<'_>],
        layout: &BatchLayout,
        mut states: Vec<SeqState<B>>,
        inv_freq: &[f32],
        streams_count: usize,
    ) -> Result<RankOutput<B>> {
        let b = &self.backend;
        let h = self.config.hidden_size;
        // 1. token embeddings, copied into every stream
        let emb = b.to_host(&b.embedding(&self.embed_tokens, &layout.ids));
        let repeated: Vec<f32> = emb
            .chunks_exact(h)
            .flat_map(|row| (0..streams_count).flat_map(move |_| row.iter().copied()))
            .collect();
        let mut streams = b.from_host(layout.ids.len(), streams_count * h, &repeated);
        // 2. decoder layers
        for (li, layer) in self.layers.iter().enumerate() {
            let mut layer_states: Vec<&mut LayerState<B>> =
                states.iter_mut().map(|st| &mut st.layers[li]).collect();
            streams = layer.forward(
                b,
                self.exchange.as_mut(),
                streams,
                &layout.ids,
                &layout.positions,
                inv_freq,
                &layout.spans,
                &mut layer_states,
            )?;
        }
        // 3. final mixer and this rank's vocabulary rows of lm_head
        let wanted = layout.logit_rows(b, &streams, batch);
        let logits = if wanted.is_empty() {
            vec![]
        } else {
            let (hidden, _) = self.final_mixer.read(b, &b.cat_rows(&wanted));
            b.to_host(&b.linear(&hidden, &self.head))
        };
        self.exchange.finish(b)?;
        Ok(RankOutput { states, logits })
    }
}

impl<B: Backend> CausalLm for TpQwen4ExpText<B> {
    fn info(&self) -> &ModelInfo {
        &self.info
    }

    /// The ranks' caches' heat together (each cache holds only its rank's experts, so the
    /// entries do not overlap), as many entries per rank as its cache has slots.
    fn routing_heat(&self, seq: SeqId) -> Option<Vec<HeatEntry>> {
        let _ = seq;
        let mut heat = Vec::new();
        let mut any = false;
        for r in &self.ranks {
            if let Some(c) = &r.expert_cache {
                let c = c.lock().expect("expert cache");
                heat.extend(c.heat(c.config().slots.max(1)));
                any = true;
            }
        }
        any.then_some(heat)
    }

    /// Warms each rank's cache with the returning session's experts that rank owns.
    fn prefetch_experts(&mut self, heat: &[HeatEntry]) {
        for r in &self.ranks {
            if let Some(c) = &r.expert_cache {
                let mine: Vec<HeatEntry> = heat
                    .iter()
                    .filter(|e| r.shard.owns_expert(e.expert as usize))
                    .cloned()
                    .collect();
                if let Err(e) = c.lock().expect("expert cache").warm(&mine) {
                    tracing::warn!(
                        "expert cache of rank {}: session heat not used: {e:#}",
                        r.shard.rank
                    );
                }
            }
        }
    }

    fn new_sequence(&mut self) -> SeqId {
        let s = self.ranks.iter().map(|r| self.empty_state(r)).collect();
        self.sequences.insert(s)
    }

    fn drop_sequence(&mut self, seq: SeqId) {
        self.sequences.states.remove(&seq);
        self.checkpoints.remove(&seq);
    }

    fn sequence_len(&self, seq: SeqId) -> Option<usize> {
        self.sequences.states.get(&seq).map(|s| s[0].len)
    }

    fn forward(&mut self, batch: &[BatchItem<'_>]) -> Result<Vec<Vec<f32>>> {
        self.check_batch(batch)?;
        if batch.is_empty() {
            return Ok(vec![]);
        }
        let n = self.ranks.len();
        let taken = self.sequences.take_batch(batch);
        let layout = BatchLayout::new(batch, taken.iter().map(|s| s[0].len));
        // Per rank, the batch's states in batch order.
        let mut per_rank: Vec<Vec<SeqState<B>>> = (0..n).map(|_| Vec::new()).collect();
        for states in taken {
            for (r, s) in states.into_iter().enumerate() {
                per_rank[r].push(s);
            }
        }
        let (inv_freq, layout_ref, streams) = (&self.inv_freq, &layout, self.flash.hc_count);
        // Rank 0 runs on this thread, the others on scoped threads; the exchange is the only
        // place they meet.
        let results: Vec<Result<RankOutput<B>>> = std::thread::scope(|s| {
            let mut ranks = self.ranks.iter_mut().zip(per_rank);
            let (first, first_states) = ranks.next().expect("at least one rank");
            let handles: Vec<_> = ranks
                .map(|(rank, states)| {
                    s.spawn(move || {
                        let out = rank.forward(batch, layout_ref, states, inv_freq, streams);
                        if let Err(e) = &out {
                            rank.exchange.abort(&format!("{e:#}"));
                        }
                        out
                    })
                })
                .collect();
            let mut out = vec![first.forward(batch, layout_ref, first_states, inv_freq, streams)];
            if let Err(e) = &out[0] {
                first.exchange.abort(&format!("{e:#}"));
            }
            out.extend(handles.into_iter().map(|h| match h.join() {
                Ok(r) => r,
                Err(_) => Err(anyhow::anyhow!("a tensor-parallel rank thread panicked")),
            }));
            out
        });
        let mut outputs = Vec::with_capacity(n);
        for (r, res) in results.into_iter().enumerate() {
            // The batch's sequences are lost with a failed exchange: the engine stops here.
            outputs.push(res.with_context(|| format!("tensor-parallel rank {r} of {n}"))?);
        }
        // Gather the vocabulary shards row by row, in rank order.
        let vocab = self.info.vocab_size;
        let rows: usize = batch
            .iter()
            .zip(&layout.spans)
            .map(|(item, span)| match item.logits {
                LogitsWanted::None => 0,
                LogitsWanted::Last => 1,
                LogitsWanted::All => span.len,
            })
            .sum();
        let mut logits = vec![0f32; rows * vocab];
        for (rank, out) in self.ranks.iter().zip(&outputs) {
            let vr = &rank.shard.vocab;
            for row in 0..rows {
                logits[row * vocab + vr.start..row * vocab + vr.end]
                    .copy_from_slice(&out.logits[row * vr.len()..(row + 1) * vr.len()]);
            }
        }
        // Hand the states back (one per rank for each item) and split the logits per item.
        let mut by_rank: Vec<_> = outputs.into_iter().map(|o| o.states.into_iter()).collect();
        let states: Vec<Vec<SeqState<B>>> = batch
            .iter()
            .map(|_| {
                by_rank
                    .iter_mut()
                    .map(|it| it.next().expect("one state per item"))
                    .collect()
            })
            .collect();
        self.sequences.put_back(batch, states, &layout, |st, len| {
            for s in st {
                s.len += len;
            }
        });
        Ok(layout.split_logits(batch, &logits, vocab))
    }

    fn snapshot(&self, seq: SeqId) -> Result<StateSnapshot> {
        let states = self.sequences.state(seq)?;
        let bytes = states
            .iter()
            .zip(&self.ranks)
            .flat_map(|(st, r)| st.layers.iter().map(|l| l.bytes(&r.backend)))
            .sum();
        Ok(StateSnapshot {
            len: states[0].len,
            data: Box::new(states.clone()),
            bytes,
        })
    }

    fn restore(&mut self, seq: SeqId, snapshot: &StateSnapshot) -> Result<()> {
        let st = snapshot
            .data
            .downcast_ref::<Vec<SeqState<B>>>()
            .context("snapshot was taken from a different model, backend or --tp")?;
        if st.len() != self.ranks.len() {
            bail!(
                "snapshot holds {} ranks' states; this model runs {} ranks",
                st.len(),
                self.ranks.len()
            );
        }
        let slot = self
            .sequences
            .states
            .get_mut(&seq)
            .with_context(|| format!("sequence {seq:?} does not exist"))?;
        *slot = st.clone();
        self.checkpoints.remove(&seq);
        Ok(())
    }

    fn checkpoint(&mut self, seq: SeqId) -> Result<usize> {
        let states = self.sequences.state(seq)?;
        let cks: Vec<_> = states
            .iter()
            .zip(&self.ranks)
            .map(|(st, r)| {
                crate::model::take_checkpoint(&r.backend, st.len, &st.layers, LayerState::attention)
            })
            .collect();
        let len = cks[0].len;
        self.checkpoints.insert(seq, cks);
        Ok(len)
    }

    fn rollback(&mut self, seq: SeqId) -> Result<usize> {
        let cks = self
            .checkpoints
            .get(&seq)
            .with_context(|| format!("sequence {seq:?} has no checkpoint to roll back to"))?;
        let states = self
            .sequences
            .states
            .get_mut(&seq)
            .with_context(|| format!("sequence {seq:?} does not exist"))?;
        // Check every rank before changing any, so a failure leaves all ranks as they were.
        for (st, ck) in states.iter().zip(cks) {
            ck.check(st.len, st.layers.len())?;
        }
        let mut rolled = Vec::with_capacity(states.len());
        for ((st, ck), r) in states.iter().zip(cks).zip(&self.ranks) {
            let mut copy = st.clone();
            crate::model::roll_back(
                &r.backend,
                &mut copy.len,
                &mut copy.layers,
                ck,
                LayerState::attention_mut,
            )?;
            rolled.push(copy);
        }
        *states = rolled;
        Ok(states[0].len)
    }

    fn state_bytes(&self, seq: SeqId) -> Option<usize> {
        let states = self.sequences.states.get(&seq)?;
        let cks = self.checkpoints.get(&seq);
        Some(
            states
                .iter()
                .zip(&self.ranks)
                .enumerate()
                .map(|(i, (st, r))| {
                    let b = &r.backend;
                    let copies: usize = cks.map_or(0, |cks| {
                        cks[i]
                            .layers
                            .iter()
                            .map(|l| match l {
                                LayerCheckpoint::Copy(l) => l.bytes(b),
                                LayerCheckpoint::Cache(_) => 0,
                            })
                            .sum()
                    });
                    st.layers.iter().map(|l| l.bytes(b)).sum::<usize>() + copies
                })
                .sum(),
        )
    }

    /// Every rank's state, rank after rank (each rank's layers as the plain model writes them).
    fn export_state(&self, seq: SeqId) -> Result<crate::cache::HostState> {
        use crate::cache::state::{write_attention, write_linear, write_ple};
        let states = self.sequences.state(seq)?;
        let mut out = crate::cache::HostState::new(states[0].len);
        for (st, r) in states.iter().zip(&self.ranks) {
            let b = &r.backend;
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
        }
        Ok(out)
    }

    fn import_state(&mut self, seq: SeqId, host: &crate::cache::HostState) -> Result<()> {
        use crate::cache::state::{read_attention, read_linear, read_ple};
        if !self.sequences.states.contains_key(&seq) {
            bail!("sequence {seq:?} does not exist");
        }
        let mut r = host.reader();
        let mut states = Vec::with_capacity(self.ranks.len());
        for rank in &self.ranks {
            let b = &rank.backend;
            let template = self.empty_state(rank);
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
            states.push(SeqState {
                len: host.len,
                layers,
            });
        }
        r.finish()?;
        self.checkpoints.remove(&seq);
        self.sequences.states.insert(seq, states);
        Ok(())
    }
}

/// Flash-Next over the ranks of `backends` with hybrid expert placement: every layer's routed
/// experts in ONE host expert store that all ranks read (shared `Arc`s, page-locked once,
/// portable to every card), and per rank a VRAM expert cache of `o.cache_bytes` (each card's
/// own budget) that only ever admits the experts that rank owns, so the cache is split across
/// the cards. Each rank computes its uncached experts on its own CPU worker pool (the pool runs
/// one job at a time, and the ranks run at once): `o.threads` (0: the physical cores) divided
/// among the ranks.
pub fn load_hybrid<B: Backend>(
    backends: Vec<B>,
    exchanges: Vec<Box<dyn RankExchange<B>>>,
    ck: &Checkpoint,
    o: &crate::hybrid::HybridOptions,
) -> Result<TpQwen4ExpText<B>> {
    use crate::backend::cpu::experts::ExpertPool;
    use crate::backend::cpu::simd::Isa;
    use crate::hybrid::expert_cache::ExpertCacheConfig;
    use crate::hybrid::load::host_expert_set;
    use crate::hybrid::{HybridExperts, Placement};
    let ranks = backends.len();
    let flash = ck.config.qwen4_exp()?;
    let (layers, experts) = (ck.config.num_hidden_layers, flash.moe.num_experts);
    let prefix = text_prefix(ck);
    let sets: Vec<Arc<crate::backend::cpu::experts::ExpertSet>> = (0..layers)
        .map(|l| host_expert_set(ck, &format!("{prefix}layers.{l}.mlp.experts.")).map(Arc::new))
        .collect::<Result<_>>()?;
    let expert_bytes = sets[0].layout.weight_bytes().max(1);
    let slots = o.cache_bytes / expert_bytes;
    let plan = shard::plan(&ck.config, ranks)?;
    // Per rank: its cache (None when every expert it owns fits) and its CPU worker pool.
    let caches: Vec<Option<Arc<Mutex<ExpertCache>>>> = plan
        .iter()
        .map(|s| {
            let owned = layers * s.owned_experts(experts).len();
            (slots < owned).then(|| {
                Arc::new(Mutex::new(ExpertCache::new(
                    layers,
                    experts,
                    ExpertCacheConfig {
                        slots,
                        half_life_tokens: o.half_life_tokens,
                        admit_margin: o.admit_margin,
                    },
                )))
            })
        })
        .collect();
    let cores = crate::backend::cpu::experts::pool::physical_cores().len();
    let threads = if o.threads == 0 { cores } else { o.threads };
    let pools: Vec<Arc<ExpertPool>> = (0..ranks)
        .map(|_| Arc::new(ExpertPool::new((threads / ranks).max(1), false)))
        .collect();
    let isa = Isa::detect();
    let pin_plan = crate::hybrid::load::plan_pins(
        &sets.iter().map(|s| s.bytes()).collect::<Vec<_>>(),
        o.page_locked_limit,
    );
    let mut make = |b: &B, s: &RankShard, layer: usize, _prefix: &str| {
        let placement = match &caches[s.rank] {
            Some(c) => Placement::Cached(c.clone()),
            None => Placement::Fixed((0..experts).map(|e| s.owns_expert(e)).collect()),
        };
        let mut h = HybridExperts::new(
            b,
            layer,
            sets[layer].clone(),
            pools[s.rank].clone(),
            isa,
            placement,
        )?;
        // The store is registered portable: pinned once (through rank 0, in layer order while
        // under the OS's page-locked limit), every card's copies from it are DMA. A refusal
        // leaves it pageable: slower copies, the same results.
        if s.rank == 0 && pin_plan[layer] {
            if let Err(e) = h.pin_host_store(b) {
                tracing::warn!("layer {layer}: the expert store stays pageable: {e:#}");
            }
        }
        Ok(Box::new(h) as Box<dyn RoutedExperts<B>>)
    };
    let mut model = TpQwen4ExpText::load_with_experts(backends, exchanges, ck, &mut make)?;
    for (rank, cache) in caches.into_iter().enumerate() {
        if let Some(c) = cache {
            // Rank r runs on GPU r (parallel::cuda_backends).
            crate::hybrid::expert_cache::register_for_metrics(&c, expert_bytes, rank);
            model.set_expert_cache(rank, c);
        }
    }
    Ok(model)
}
