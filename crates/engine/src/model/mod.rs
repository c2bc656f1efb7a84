//! Model definitions, one file per architecture, and the object-safe [`CausalLm`] interface the
//! scheduler and the CLI drive them through.

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
    fn snapshot(&self, seq: SeqId) -> Result<StateSnapshot>;
    fn restore(&mut self, seq: SeqId, snapshot: &StateSnapshot) -> Result<()>;
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
