//! Model definitions, one file per architecture, and the object-safe [`CausalLm`] interface the
//! scheduler and the CLI drive them through.

pub mod batch;
pub mod host_phases;
pub mod layers;
pub mod qwen3_5_text;
pub mod qwen4_exp_text;

use crate::backend::Backend;
use crate::checkpoint::Checkpoint;
use crate::config::{Architecture, TextConfig};
use anyhow::Result;
use std::collections::HashMap;

/// Identifies one sequence's state (KV cache, recurrent states) inside a model.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct SeqId(pub u64);

/// Which positions of a batch item need logits.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LogitsWanted {
    /// None (a prefill chunk that is not the last).
    None,
    /// The last position only (generation).
    Last,
    /// Every position (scoring).
    All,
}

/// One sequence's part of a forward batch: new tokens appended at the end of its state.
#[derive(Debug, Clone)]
pub struct BatchItem<'a> {
    pub seq: SeqId,
    pub tokens: &'a [u32],
    pub logits: LogitsWanted,
}

/// Static facts about a loaded model.
#[derive(Debug, Clone, serde::Serialize)]
pub struct ModelInfo {
    pub architecture: Architecture,
    pub vocab_size: usize,
    pub max_context: usize,
    pub eos_token_ids: Vec<u32>,
    pub num_layers: usize,
    pub hidden_size: usize,
    pub parameters: usize,
    pub weight_bytes: usize,
    pub backend: String,
}

/// Greedy continuations of `prompts`, `steps` tokens each: their sequences decoded together,
/// one batch a step, through [`CausalLm::forward_greedy`] (the tokens picked where the model
/// runs). The sequences are dropped after, also on error.
pub fn greedy_continuations(
    model: &mut dyn CausalLm,
    prompts: &[Vec<u32>],
    steps: usize,
) -> Result<Vec<Vec<u32>>> {
    let seqs: Vec<SeqId> = prompts.iter().map(|_| model.new_sequence()).collect();
    let vocab = model.info().vocab_size;
    let mut out = vec![Vec::with_capacity(steps); prompts.len()];
    let mut run = || -> Result<()> {
        for step in 0..steps {
            let last: Vec<[u32; 1]> = out
                .iter()
                .map(|t: &Vec<u32>| [t.last().copied().unwrap_or(0)])
                .collect();
            let items: Vec<BatchItem<'_>> = seqs
                .iter()
                .enumerate()
                .map(|(i, &seq)| BatchItem {
                    seq,
                    tokens: if step == 0 { &prompts[i] } else { &last[i] },
                    logits: LogitsWanted::Last,
                })
                .collect();
            let picks = model.forward_greedy(&items, vocab)?;
            for (i, pick) in picks.into_iter().enumerate() {
                out[i].push(pick.ok_or_else(|| {
                    anyhow::anyhow!("the greedy pass picked no token for prompt {i}")
                })?);
            }
        }
        Ok(())
    };
    let result = run();
    for seq in seqs {
        model.drop_sequence(seq);
    }
    result.map(|()| out)
}

/// A greedy pass picks one token per item: an item that wants every position's logits is
/// refused, naming it.
pub fn check_greedy_batch(batch: &[BatchItem<'_>]) -> Result<()> {
    match batch.iter().position(|b| b.logits == LogitsWanted::All) {
        Some(i) => anyhow::bail!(
            "batch item {i} asks for every position's logits, which a greedy pass does not \
             return: use forward for scoring"
        ),
        None => Ok(()),
    }
}

/// An opaque copy of one sequence's state, for the prefix cache and tiering.
pub struct StateSnapshot {
    pub len: usize,
    /// Backend-owned contents.
    pub data: Box<dyn std::any::Any + Send + Sync>,
    /// Bytes the snapshot holds.
    pub bytes: usize,
}

/// A causal language model with per-sequence state owned by the model.
///
/// The scheduler calls [`CausalLm::forward`] with a batch of sequences, each contributing one
/// token (decode) or a chunk of its prompt (prefill); sequences may have different lengths.
pub trait CausalLm: Send {
    fn info(&self) -> &ModelInfo;
    fn new_sequence(&mut self) -> SeqId;
    fn drop_sequence(&mut self, seq: SeqId);
    /// Tokens already in the sequence's state.
    fn sequence_len(&self, seq: SeqId) -> Option<usize>;
    /// Runs the batch; returns, per item, `[positions × vocab]` logits as asked
    /// (empty for [`LogitsWanted::None`], `vocab` values for `Last`, `n × vocab` for `All`).
    fn forward(&mut self, batch: &[BatchItem<'_>]) -> Result<Vec<Vec<f32>>>;
    /// [`CausalLm::forward`] returning each item's greedy token below `limit` instead of its
    /// logits (the first index of the largest of the first `limit` logits, as
    /// [`crate::sampling::argmax`]; `limit` keeps out ids past the tokenizer's vocabulary):
    /// `Some` for items that want `Last`, `None` for `None`; `All` is refused. A model on a
    /// device picks there and reads back one index an item instead of the logits.
    fn forward_greedy(
        &mut self,
        batch: &[BatchItem<'_>],
        limit: usize,
    ) -> Result<Vec<Option<u32>>> {
        check_greedy_batch(batch)?;
        Ok(self
            .forward(batch)?
            .iter()
            .map(|logits| {
                (!logits.is_empty())
                    .then(|| crate::sampling::argmax(&logits[..limit.min(logits.len())]))
            })
            .collect())
    }
    fn snapshot(&self, seq: SeqId) -> Result<StateSnapshot>;
    fn restore(&mut self, seq: SeqId, snapshot: &StateSnapshot) -> Result<()>;
    /// A host-memory copy of the sequence's whole state (the prefix cache's RAM and disk tiers).
    fn export_state(&self, seq: SeqId) -> Result<crate::cache::HostState> {
        let _ = seq;
        anyhow::bail!("this model cannot copy sequence state to the host (no prefix cache)")
    }
    /// Replaces the sequence's state with one [`CausalLm::export_state`] wrote for this model;
    /// a state of another shape is refused and the sequence left as it was.
    fn import_state(&mut self, seq: SeqId, state: &crate::cache::HostState) -> Result<()> {
        let _ = (seq, state);
        anyhow::bail!("this model cannot load sequence state from the host (no prefix cache)")
    }
    /// Keeps a device-side checkpoint of the sequence at its current length, replacing an
    /// older one: copies of its recurrent states (GDN conv and recurrent states, PLE n-gram
    /// context) and the row counts of its caches (KV, QSA keys), whose rows are not copied.
    /// Returns the length. The scheduler takes one at the end of a prompt, so that a parked
    /// sequence can be continued from there when the next prompt leaves its generated tokens.
    fn checkpoint(&mut self, seq: SeqId) -> Result<usize> {
        let _ = seq;
        anyhow::bail!("this model cannot checkpoint a sequence (no rollback support)")
    }
    /// Puts the sequence back to its checkpoint (recurrent states restored from the copies,
    /// caches truncated); the checkpoint stays. Returns the length. Fails, leaving the state as
    /// it was, when there is no checkpoint or the state was replaced since.
    fn rollback(&mut self, seq: SeqId) -> Result<usize> {
        let _ = seq;
        anyhow::bail!("this model cannot roll a sequence back (no checkpoint support)")
    }
    /// Bytes of the sequence's state on the model's device, its checkpoint included (the
    /// scheduler's budget for parked sequences); `None` when unknown.
    fn state_bytes(&self, seq: SeqId) -> Option<usize> {
        let _ = seq;
        None
    }
    /// The routed experts this sequence used, as heat (the expert cache that follows the
    /// conversation keeps it with the session); `None` for models without routed experts or
    /// without routing statistics.
    fn routing_heat(&self, seq: SeqId) -> Option<Vec<crate::hybrid::expert_cache::HeatEntry>> {
        let _ = seq;
        None
    }
    /// A returning session's heat: bring its hot experts into VRAM before its prompt runs
    /// (hybrid models: [`crate::hybrid::ExpertCache::warm`] and the copies it asks for).
    /// Others ignore it.
    fn prefetch_experts(&mut self, heat: &[crate::hybrid::expert_cache::HeatEntry]) {
        let _ = heat;
    }
}

/// One layer's part of a [`SeqCheckpoint`]: caches go back by truncation, recurrent states
/// (which cannot be truncated) by a copy of the layer's state.
pub enum LayerCheckpoint<L> {
    Cache(layers::attention::CacheRows),
    Copy(L),
}

/// A sequence's checkpoint (see [`CausalLm::checkpoint`]): its length and every layer's part.
pub struct SeqCheckpoint<L> {
    pub len: usize,
    pub layers: Vec<LayerCheckpoint<L>>,
}

impl<L> SeqCheckpoint<L> {
    /// Checks that `layers` (the sequence's layer states now) can go back to this checkpoint.
    pub fn check(&self, len: usize, layers: usize) -> Result<()> {
        if len < self.len || layers != self.layers.len() {
            anyhow::bail!(
                "the checkpoint ({} tokens, {} layers) does not fit the sequence ({len} tokens, {layers} layers): its state was replaced since",
                self.len,
                self.layers.len()
            );
        }
        Ok(())
    }
}

/// A checkpoint of one sequence's `layers` at `len` tokens; `attention` gives a layer's
/// attention state (its caches are truncated back), every other layer is copied.
pub fn take_checkpoint<B: Backend, L: Clone>(
    b: &B,
    len: usize,
    layers: &[L],
    attention: impl Fn(&L) -> Option<&layers::attention::AttentionState<B>>,
) -> SeqCheckpoint<L> {
    let layers = layers
        .iter()
        .map(|l| match attention(l) {
            Some(a) => LayerCheckpoint::Cache(a.cache_rows(b)),
            None => LayerCheckpoint::Copy(l.clone()),
        })
        .collect();
    SeqCheckpoint { len, layers }
}

/// Puts `layers` (holding `len` tokens) back to `ck`: everything is checked before anything
/// changes, so a failure leaves the state as it was.
pub fn roll_back<B: Backend, L: Clone>(
    b: &B,
    len: &mut usize,
    layers: &mut [L],
    ck: &SeqCheckpoint<L>,
    attention: impl Fn(&mut L) -> Option<&mut layers::attention::AttentionState<B>>,
) -> Result<()> {
    ck.check(*len, layers.len())?;
    for (l, part) in layers.iter_mut().zip(&ck.layers) {
        match (attention(l), part) {
            (Some(a), LayerCheckpoint::Cache(rows)) => a.check_truncate(b, *rows)?,
            (None, LayerCheckpoint::Copy(_)) => {}
            _ => anyhow::bail!("the checkpoint's layer kinds differ from the sequence's"),
        }
    }
    for (l, part) in layers.iter_mut().zip(&ck.layers) {
        match part {
            LayerCheckpoint::Cache(rows) => {
                if let Some(a) = attention(l) {
                    a.truncate_to(b, *rows)?;
                }
            }
            LayerCheckpoint::Copy(saved) => *l = saved.clone(),
        }
    }
    *len = ck.len;
    Ok(())
}

/// Per-sequence states of one model, keyed by [`SeqId`].
pub struct SequenceTable<S> {
    next: u64,
    pub states: HashMap<SeqId, S>,
}

impl<S> Default for SequenceTable<S> {
    fn default() -> Self {
        SequenceTable {
            next: 1,
            states: HashMap::new(),
        }
    }
}

impl<S> SequenceTable<S> {
    pub fn insert(&mut self, state: S) -> SeqId {
        let id = SeqId(self.next);
        self.next += 1;
        self.states.insert(id, state);
        id
    }
}

/// Builds the model a checkpoint describes on the given backend.
pub fn load<B: Backend>(backend: B, checkpoint: &Checkpoint) -> Result<Box<dyn CausalLm>> {
    match checkpoint.config.architecture {
        Architecture::Qwen3_5Text => Ok(Box::new(qwen3_5_text::Qwen3_5Text::load(
            backend, checkpoint,
        )?)),
        Architecture::Qwen4ExpText => Ok(Box::new(qwen4_exp_text::Qwen4ExpText::load(
            backend, checkpoint,
        )?)),
    }
}

/// What a checkpoint's weights cost: in all, and read per decoded token.
#[derive(Debug, Clone, Copy, Default, PartialEq, serde::Serialize)]
pub struct WeightUse {
    pub parameters: usize,
    /// Bytes as stored (quantized tensors at their stored size).
    pub bytes: usize,
    /// Parameters one decode step reads: one embedding row, the n-gram table rows it gathers,
    /// top-k of the routed experts, everything else whole.
    pub active_parameters: f64,
    pub active_bytes: f64,
    /// Of the active parameters, those in matrix products (2 FLOPs each per token): all but
    /// the gathered embedding and n-gram rows.
    pub active_matmul_parameters: f64,
}

/// Tensors of the checkpoint that no text forward pass reads (the MTP layer, vision).
pub fn is_unused_tensor(name: &str) -> bool {
    name.starts_with("mtp.") || name.contains("visual.")
}

/// Counts the weights the text model uses (see [`WeightUse`]), from the tensors as stored:
/// nothing is dequantized or copied.
pub fn weight_use(ck: &Checkpoint) -> WeightUse {
    let c = &ck.config;
    let moe = c.qwen4_exp().ok().map(|f| f.moe);
    let store = ck.weights.store();
    // Rows of the n-gram tables and the rows each token gathers from them.
    let ngram_rows_read = c
        .qwen4_exp()
        .ok()
        .and_then(|f| f.ple)
        .map(|p| p.ngram_heads() as f64)
        .unwrap_or(0.0);
    let mut ngram_rows = std::collections::HashMap::<String, usize>::new();
    let mut tensors = Vec::new();
    for name in ck.weights.names().filter(|n| !is_unused_tensor(n)) {
        let t = if store.contains(name) {
            store.get(name)
        } else {
            ck.weights.get(name)
        };
        let Ok(t) = t else { continue };
        // NVFP4 packs two values per stored byte.
        let params = if t.dtype == crate::tensor::DType::U8 {
            t.numel() * 2
        } else {
            t.numel()
        };
        if let Some((table, _)) = name.split_once("ngram_embedding.") {
            *ngram_rows.entry(table.to_string()).or_default() += t.shape[0];
        }
        tensors.push((name.to_string(), params, t.data.len()));
    }
    let mut u = WeightUse::default();
    for (name, params, bytes) in tensors {
        u.parameters += params;
        u.bytes += bytes;
        let tied_head = c.tie_word_embeddings && !ck.weights.contains("lm_head.weight");
        let (fraction, matmul) = if name.ends_with("embed_tokens.weight") && !tied_head {
            (1.0 / c.vocab_size.max(1) as f64, false)
        } else if let Some((table, _)) = name.split_once("ngram_embedding.") {
            (ngram_rows_read / ngram_rows[table].max(1) as f64, false)
        } else if let (Some(m), true) = (&moe, name.contains("mlp.experts.")) {
            (m.num_experts_per_tok as f64 / m.num_experts as f64, true)
        } else {
            (1.0, true)
        };
        u.active_parameters += params as f64 * fraction;
        u.active_bytes += bytes as f64 * fraction;
        if matmul {
            u.active_matmul_parameters += params as f64 * fraction;
        }
    }
    u
}

/// Checks that every id is inside the vocabulary.
pub fn check_token_ids(config: &TextConfig, ids: &[u32]) -> Result<()> {
    if let Some(bad) = ids.iter().find(|&&t| t as usize >= config.vocab_size) {
        anyhow::bail!(
            "token id {bad} is out of range: the vocabulary has {} ids (0..{})",
            config.vocab_size,
            config.vocab_size
        );
    }
    Ok(())
}
