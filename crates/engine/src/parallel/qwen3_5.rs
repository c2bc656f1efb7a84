//! `qwen3_5_text` split over N ranks: the same decoder as `model::qwen3_5_text`, with each
//! rank's layers loaded from its shard ([`shard::layer_checkpoint`]) by the model's own layer
//! loaders, and an all-reduce after the mixer and after the MLP. Each rank runs on its own
//! thread and backend; the logits of the vocabulary shards are gathered in rank order.

use super::shard::{self, RankShard};
use super::RankExchange;
use crate::backend::{Backend, NormScale};
use crate::checkpoint::Checkpoint;
use crate::config::{GateActivation, LayerType, TextConfig};
use crate::model::layers::attention::{Attention, AttentionState};
use crate::model::layers::gdn::{GatedDeltaNet, LinearState};
use crate::model::layers::mlp::Mlp;
use crate::model::layers::{tensor, text_prefix, vector, Span};
use crate::model::qwen3_5_text::{LayerState, SeqState};
use crate::model::{
    BatchItem, CausalLm, LogitsWanted, ModelInfo, SeqId, SequenceTable, StateSnapshot,
};
use anyhow::{bail, Context, Result};

enum Mixer<B: Backend> {
    Linear(GatedDeltaNet<B>),
    Full(Attention<B>),
}

struct Layer<B: Backend> {
    input_layernorm: B::Vector,
    mixer: Mixer<B>,
    post_attention_layernorm: B::Vector,
    mlp: Mlp<B>,
}

/// One rank: its backend, its shard of every layer, the replicated embedding and norm, its
/// vocabulary rows of the head, and its end of the exchange.
struct Rank<B: Backend> {
    backend: B,
    shard: RankShard,
    /// The config of the shard's sizes (its states are created from it).
    config: TextConfig,
    embed_tokens: B::Matrix,
    layers: Vec<Layer<B>>,
    norm: B::Vector,
    head: B::Matrix,
    exchange: Box<dyn RankExchange<B>>,
}

/// What one rank computes for a batch: the states it updated and its logits columns.
struct RankOutput<B: Backend> {
    states: Vec<SeqState<B>>,
    /// `[rows, vocab shard]`.
    logits: Vec<f32>,
}

pub struct TpQwen3_5Text<B: Backend> {
    config: TextConfig,
    info: ModelInfo,
    ranks: Vec<Rank<B>>,
    inv_freq: Vec<f32>,
    /// Per sequence, one state per rank (each holds its heads' caches).
    sequences: SequenceTable<Vec<SeqState<B>>>,
}

impl<B: Backend> TpQwen3_5Text<B> {
    /// One backend and one exchange per rank, in rank order.
    pub fn load(
        backends: Vec<B>,
        exchanges: Vec<Box<dyn RankExchange<B>>>,
        ck: &Checkpoint,
    ) -> Result<Self> {
        let c = ck.config.clone();
        if backends.len() != exchanges.len() {
            bail!(
                "{} backends but {} exchanges: one of each per rank",
                backends.len(),
                exchanges.len()
            );
        }
        let plan = shard::plan(&c, backends.len())?;
        let prefix = text_prefix(ck);
        let (h, v) = (c.hidden_size, c.vocab_size);
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
            let sck = shard::layer_checkpoint(ck, &s)
                .with_context(|| format!("building the shard of rank {}", s.rank))?;
            let sc = sck.config.clone();
            let mut layers = Vec::with_capacity(sc.num_hidden_layers);
            for (i, kind) in sc.layer_types.iter().enumerate() {
                let p = format!("{prefix}layers.{i}.");
                let mixer = match kind {
                    LayerType::LinearAttention => Mixer::Linear(GatedDeltaNet::load(
                        &b,
                        &sck,
                        &format!("{p}linear_attn."),
                        &sc,
                        GateActivation::Silu,
                    )?),
                    LayerType::FullAttention => Mixer::Full(Attention::load(
                        &b,
                        &sck,
                        &format!("{p}self_attn."),
                        &sc,
                        None,
                    )?),
                };
                layers.push(Layer {
                    input_layernorm: vector(&b, &sck, &format!("{p}input_layernorm.weight"), h)?,
                    mixer,
                    post_attention_layernorm: vector(
                        &b,
                        &sck,
                        &format!("{p}post_attention_layernorm.weight"),
                        h,
                    )?,
                    mlp: Mlp::load(&b, &sck, &format!("{p}mlp."), h, sc.intermediate_size)?,
                });
            }
            ranks.push(Rank {
                embed_tokens: b.matrix(&embed)?,
                norm: vector(&b, ck, &format!("{prefix}norm.weight"), h)?,
                head: b.matrix(&shard::vocab_rows(&head, s.vocab.clone())?)?,
                layers,
                config: sc,
                shard: s,
                exchange,
                backend: b,
            });
        }
        let rot = c.rotary_dim();
        let inv_freq = (0..rot / 2)
            .map(|i| (1.0 / c.rope.theta.powf((2 * i) as f64 / rot as f64)) as f32)
            .collect();
        let crate::model::WeightUse {
            parameters,
            bytes: weight_bytes,
            ..
        } = crate::model::weight_use(ck);
        let info = ModelInfo {
            architecture: c.architecture,
            vocab_size: v,
            max_context: c.max_position_embeddings,
            eos_token_ids: ck.eos_token_ids(),
            num_layers: c.num_hidden_layers,
            hidden_size: h,
            parameters,
            weight_bytes,
            backend: format!(
                "{} × {} (tensor parallel)",
                ranks.len(),
                ranks[0].backend.name()
            ),
        };
        Ok(TpQwen3_5Text {
            config: c,
            info,
            ranks,
            inv_freq,
            sequences: SequenceTable::default(),
        })
    }

    /// The plan each rank runs.
    pub fn shards(&self) -> Vec<&RankShard> {
        self.ranks.iter().map(|r| &r.shard).collect()
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

fn empty_state<B: Backend>(b: &B, c: &TextConfig) -> SeqState<B> {
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

/// Where each batch item's tokens sit, and which rows want logits.
struct BatchLayout {
    spans: Vec<Span>,
    ids: Vec<u32>,
    positions: Vec<usize>,
    /// Row ranges of the hidden state that get logits, in batch order.
    wanted: Vec<std::ops::Range<usize>>,
}

impl<B: Backend> Rank<B> {
    /// This rank's part of the forward pass; `Err` when the exchange fails.
    fn forward(
        &mut self,
        layout: &BatchLayout,
        mut states: Vec<SeqState<B>>,
        inv_freq: &[f32],
    ) -> Result<RankOutput<B>> {
        let b = &self.backend;
        let eps = self.config.rms_norm_eps as f32;
        let hsz = self.config.hidden_size;
        let mut x = b.embedding(&self.embed_tokens, &layout.ids);
        for (li, layer) in self.layers.iter().enumerate() {
            let h = b.rms_norm(&x, &layer.input_layernorm, eps, NormScale::OnePlus, hsz);
            let mut mixed = match &layer.mixer {
                Mixer::Linear(gdn) => {
                    let mut ls: Vec<&mut LinearState<B>> = states
                        .iter_mut()
                        .map(|s| match &mut s.layers[li] {
                            LayerState::Linear(l) => l,
                            LayerState::Attention(_) => {
                                unreachable!("layer state kinds follow the layer types")
                            }
                        })
                        .collect();
                    gdn.forward(b, &h, &layout.spans, &mut ls)
                }
                Mixer::Full(attn) => {
                    let mut ls: Vec<&mut AttentionState<B>> = states
                        .iter_mut()
                        .map(|s| match &mut s.layers[li] {
                            LayerState::Attention(a) => a,
                            LayerState::Linear(_) => {
                                unreachable!("layer state kinds follow the layer types")
                            }
                        })
                        .collect();
                    attn.forward(b, &h, &layout.positions, inv_freq, &layout.spans, &mut ls)
                }
            };
            // All-reduce 1: the output projection's partial sums over this rank's heads.
            self.exchange.all_reduce(b, &mut mixed)?;
            b.add_assign(&mut x, &mixed);
            let h = b.rms_norm(
                &x,
                &layer.post_attention_layernorm,
                eps,
                NormScale::OnePlus,
                hsz,
            );
            // All-reduce 2: the down projection's partial sums over this rank's MLP columns.
            let mut m = layer.mlp.forward(b, &h);
            self.exchange.all_reduce(b, &mut m)?;
            b.add_assign(&mut x, &m);
        }
        let logits = if layout.wanted.is_empty() {
            vec![]
        } else {
            let rows: Vec<B::Act> = layout
                .wanted
                .iter()
                .map(|r| b.rows(&x, r.clone()))
                .collect();
            let hidden = b.rms_norm(&b.cat_rows(&rows), &self.norm, eps, NormScale::OnePlus, hsz);
            b.to_host(&b.linear(&hidden, &self.head))
        };
        self.exchange.finish(b)?;
        Ok(RankOutput { states, logits })
    }
}

impl<B: Backend> CausalLm for TpQwen3_5Text<B> {
    fn info(&self) -> &ModelInfo {
        &self.info
    }

    fn new_sequence(&mut self) -> SeqId {
        let s = self
            .ranks
            .iter()
            .map(|r| empty_state(&r.backend, &r.config))
            .collect();
        self.sequences.insert(s)
    }

    fn drop_sequence(&mut self, seq: SeqId) {
        self.sequences.states.remove(&seq);
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
        // Per rank, the batch's states in batch order.
        let mut per_rank: Vec<Vec<SeqState<B>>> = (0..n).map(|_| Vec::new()).collect();
        let mut layout = BatchLayout {
            spans: Vec::new(),
            ids: Vec::new(),
            positions: Vec::new(),
            wanted: Vec::new(),
        };
        for item in batch {
            let states = self
                .sequences
                .states
                .remove(&item.seq)
                .expect("checked above");
            let (start, len, past) = (layout.ids.len(), item.tokens.len(), states[0].len);
            layout.spans.push(Span { start, len, past });
            layout.ids.extend_from_slice(item.tokens);
            layout.positions.extend(past..past + len);
            match item.logits {
                LogitsWanted::None => {}
                LogitsWanted::Last => layout.wanted.push(start + len - 1..start + len),
                LogitsWanted::All => layout.wanted.push(start..start + len),
            }
            for (r, s) in states.into_iter().enumerate() {
                per_rank[r].push(s);
            }
        }
        let inv_freq = &self.inv_freq;
        let layout_ref = &layout;
        // Rank 0 runs on this thread, the others on scoped threads; the exchange is the only
        // place they meet.
        let results: Vec<Result<RankOutput<B>>> = std::thread::scope(|s| {
            let mut ranks = self.ranks.iter_mut().zip(per_rank);
            let (first, first_states) = ranks.next().expect("at least one rank");
            let handles: Vec<_> = ranks
                .map(|(rank, states)| {
                    s.spawn(move || {
                        let out = rank.forward(layout_ref, states, inv_freq);
                        if let Err(e) = &out {
                            rank.exchange.abort(&format!("{e:#}"));
                        }
                        out
                    })
                })
                .collect();
            let mut out = vec![first.forward(layout_ref, first_states, inv_freq)];
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
        let rows: usize = layout.wanted.iter().map(|r| r.len()).sum();
        let mut logits = vec![0f32; rows * vocab];
        for (rank, out) in self.ranks.iter().zip(&outputs) {
            let vr = &rank.shard.vocab;
            for row in 0..rows {
                logits[row * vocab + vr.start..row * vocab + vr.end]
                    .copy_from_slice(&out.logits[row * vr.len()..(row + 1) * vr.len()]);
            }
        }
        // Hand the states back and split the logits per item.
        let mut states_by_rank: Vec<_> =
            outputs.into_iter().map(|o| o.states.into_iter()).collect();
        let mut result = Vec::with_capacity(batch.len());
        let mut offset = 0;
        for (item, span) in batch.iter().zip(&layout.spans) {
            let mut seq_states: Vec<SeqState<B>> = states_by_rank
                .iter_mut()
                .map(|it| it.next().expect("one state per item"))
                .collect();
            for s in &mut seq_states {
                s.len += span.len;
            }
            self.sequences.states.insert(item.seq, seq_states);
            let rows = match item.logits {
                LogitsWanted::None => 0,
                LogitsWanted::Last => 1,
                LogitsWanted::All => span.len,
            };
            result.push(logits[offset..offset + rows * vocab].to_vec());
            offset += rows * vocab;
        }
        Ok(result)
    }

    fn snapshot(&self, seq: SeqId) -> Result<StateSnapshot> {
        let states = self
            .sequences
            .states
            .get(&seq)
            .with_context(|| format!("sequence {seq:?} does not exist"))?;
        let bytes = states
            .iter()
            .zip(&self.ranks)
            .flat_map(|(st, r)| {
                st.layers.iter().map(|l| match l {
                    LayerState::Attention(a) => a.bytes(&r.backend),
                    LayerState::Linear(l) => l.bytes(&r.backend),
                })
            })
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
        Ok(())
    }

    /// Every rank's state, rank after rank (each rank's layers as the plain model writes them).
    fn export_state(&self, seq: SeqId) -> Result<crate::cache::HostState> {
        use crate::cache::state::{write_attention, write_linear};
        let states = self
            .sequences
            .states
            .get(&seq)
            .with_context(|| format!("sequence {seq:?} does not exist"))?;
        let mut out = crate::cache::HostState::new(states[0].len);
        for (st, r) in states.iter().zip(&self.ranks) {
            for l in &st.layers {
                match l {
                    LayerState::Attention(a) => write_attention(&mut out, &r.backend, a),
                    LayerState::Linear(l) => write_linear(&mut out, &r.backend, l),
                }
            }
        }
        Ok(out)
    }

    fn import_state(&mut self, seq: SeqId, host: &crate::cache::HostState) -> Result<()> {
        use crate::cache::state::{read_attention, read_linear};
        if !self.sequences.states.contains_key(&seq) {
            bail!("sequence {seq:?} does not exist");
        }
        let mut r = host.reader();
        let mut states = Vec::with_capacity(self.ranks.len());
        for rank in &self.ranks {
            let b = &rank.backend;
            let template = empty_state(b, &rank.config);
            let mut layers = Vec::with_capacity(template.layers.len());
            for l in &template.layers {
                layers.push(match l {
                    LayerState::Attention(a) => {
                        LayerState::Attention(read_attention(&mut r, b, a, host.len)?)
                    }
                    LayerState::Linear(l) => LayerState::Linear(read_linear(&mut r, b, l)?),
                });
            }
            states.push(SeqState {
                len: host.len,
                layers,
            });
        }
        r.finish()?;
        self.sequences.states.insert(seq, states);
        Ok(())
    }
}
