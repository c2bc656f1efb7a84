//! A [`CausalLm`] whose output is a script, for testing the layers above the model.
//!
//! A random tiny model cannot produce a tool call or a reasoning block, so tests of the
//! scheduler, the output parser and the HTTP adapters inject the model's output here: the
//! n-th position that asks for logits puts a large logit on `script[n]` (after the script, on
//! `end_token`), so greedy and ordinary sampling both follow the script while every other layer
//! (tokenizer, detokenizer, stop handling, parser, adapters) stays real.

use crate::config::Architecture;
use crate::model::{BatchItem, CausalLm, LogitsWanted, ModelInfo, SeqId, StateSnapshot};
use anyhow::{bail, Result};
use std::collections::HashMap;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use crate::hybrid::expert_cache::HeatEntry;

/// Observations tests make of a [`ScriptedLm`] from outside the scheduler thread.
#[derive(Debug, Default)]
pub struct ScriptedStats {
    /// Sequences currently alive in the model.
    pub live_sequences: AtomicUsize,
    /// Largest batch (items) seen in one forward call.
    pub max_batch_items: AtomicUsize,
    /// Forward calls that mixed a prefill chunk with decode tokens.
    pub mixed_steps: AtomicUsize,
    /// Largest number of tokens in one batch item.
    pub max_item_tokens: AtomicUsize,
    pub forward_calls: AtomicUsize,
    /// Every heat passed to [`CausalLm::prefetch_experts`], in order.
    pub prefetched: Mutex<Vec<Vec<HeatEntry>>>,
}

pub struct ScriptedLm {
    info: ModelInfo,
    script: Vec<u32>,
    end_token: u32,
    step_delay: Duration,
    next_id: u64,
    /// Per sequence: (tokens in state, logits positions produced so far).
    seqs: HashMap<SeqId, (usize, usize)>,
    stats: Arc<ScriptedStats>,
    /// Routed experts per layer, when the model pretends to be a MoE (see
    /// [`ScriptedLm::with_experts`]).
    experts: Option<(u32, u32)>,
    /// Per sequence: the length at its checkpoint.
    checkpoints: HashMap<SeqId, usize>,
    /// Per sequence: how often each expert (index `token % experts`) was routed to.
    routed: HashMap<SeqId, Vec<u32>>,
}

impl ScriptedLm {
    /// `end_token` should be one of `eos_token_ids` so a finished script ends generation.
    pub fn new(vocab_size: usize, max_context: usize, script: Vec<u32>, end_token: u32) -> Self {
        let info = ModelInfo {
            architecture: Architecture::Qwen3_5Text,
            vocab_size,
            max_context,
            eos_token_ids: vec![end_token],
            num_layers: 0,
            hidden_size: 0,
            parameters: 0,
            weight_bytes: 0,
            backend: "scripted".into(),
        };
        ScriptedLm {
            info,
            script,
            end_token,
            step_delay: Duration::ZERO,
            next_id: 1,
            seqs: HashMap::new(),
            stats: Arc::default(),
            experts: None,
            routed: HashMap::new(),
            checkpoints: HashMap::new(),
        }
    }

    /// Pretends to route every computed token `t` to expert `t % experts` of each of `layers`
    /// layers, so the expert heat that follows a session can be tested.
    pub fn with_experts(mut self, layers: u32, experts: u32) -> Self {
        self.experts = Some((layers, experts.max(1)));
        self
    }

    /// Sleeps this long in every forward call (to make requests overlap in tests).
    pub fn with_step_delay(mut self, delay: Duration) -> Self {
        self.step_delay = delay;
        self
    }

    pub fn with_eos_ids(mut self, ids: Vec<u32>) -> Self {
        self.info.eos_token_ids = ids;
        self
    }

    pub fn stats(&self) -> Arc<ScriptedStats> {
        self.stats.clone()
    }
}

impl CausalLm for ScriptedLm {
    fn info(&self) -> &ModelInfo {
        &self.info
    }

    fn new_sequence(&mut self) -> SeqId {
        let id = SeqId(self.next_id);
        self.next_id += 1;
        self.seqs.insert(id, (0, 0));
        self.stats
            .live_sequences
            .store(self.seqs.len(), Ordering::Relaxed);
        id
    }

    fn drop_sequence(&mut self, seq: SeqId) {
        self.seqs.remove(&seq);
        self.routed.remove(&seq);
        self.checkpoints.remove(&seq);
        self.stats
            .live_sequences
            .store(self.seqs.len(), Ordering::Relaxed);
    }

    fn sequence_len(&self, seq: SeqId) -> Option<usize> {
        self.seqs.get(&seq).map(|s| s.0)
    }

    fn forward(&mut self, batch: &[BatchItem<'_>]) -> Result<Vec<Vec<f32>>> {
        if !self.step_delay.is_zero() {
            std::thread::sleep(self.step_delay);
        }
        let s = &self.stats;
        s.forward_calls.fetch_add(1, Ordering::Relaxed);
        s.max_batch_items.fetch_max(batch.len(), Ordering::Relaxed);
        let longest = batch.iter().map(|b| b.tokens.len()).max().unwrap_or(0);
        s.max_item_tokens.fetch_max(longest, Ordering::Relaxed);
        if longest > 1 && batch.iter().any(|b| b.tokens.len() == 1) {
            s.mixed_steps.fetch_add(1, Ordering::Relaxed);
        }
        let mut out = Vec::with_capacity(batch.len());
        for item in batch {
            let Some(state) = self.seqs.get_mut(&item.seq) else {
                bail!("unknown sequence {:?}", item.seq)
            };
            if state.0 + item.tokens.len() > self.info.max_context {
                bail!(
                    "sequence {:?} would exceed the context of {} tokens",
                    item.seq,
                    self.info.max_context
                );
            }
            state.0 += item.tokens.len();
            if let Some((_, experts)) = self.experts {
                let counts = self
                    .routed
                    .entry(item.seq)
                    .or_insert_with(|| vec![0; experts as usize]);
                for t in item.tokens {
                    counts[(t % experts) as usize] += 1;
                }
            }
            let rows = match item.logits {
                LogitsWanted::None => 0,
                LogitsWanted::Last => 1,
                LogitsWanted::All => item.tokens.len(),
            };
            let mut logits = vec![0.0f32; rows * self.info.vocab_size];
            for row in logits.chunks_exact_mut(self.info.vocab_size) {
                let next = self.script.get(state.1).copied().unwrap_or(self.end_token);
                row[next as usize] = 40.0;
                state.1 += 1;
            }
            out.push(logits);
        }
        Ok(out)
    }

    fn snapshot(&self, seq: SeqId) -> Result<StateSnapshot> {
        let Some(&state) = self.seqs.get(&seq) else {
            bail!("unknown sequence {seq:?}")
        };
        Ok(StateSnapshot {
            len: state.0,
            data: Box::new(state),
            bytes: 16,
        })
    }

    fn restore(&mut self, seq: SeqId, snapshot: &StateSnapshot) -> Result<()> {
        let Some(state) = snapshot.data.downcast_ref::<(usize, usize)>() else {
            bail!("the snapshot is not a ScriptedLm snapshot")
        };
        self.seqs.insert(seq, *state);
        Ok(())
    }

    /// Only the length: the script restarts for every request, cached or not, so a request
    /// resumed from the prefix cache produces exactly what an uncached one does.
    fn export_state(&self, seq: SeqId) -> Result<crate::cache::HostState> {
        let Some(&state) = self.seqs.get(&seq) else {
            bail!("unknown sequence {seq:?}")
        };
        let mut out = crate::cache::HostState::new(state.0);
        out.push_ids(&[state.0 as u32]);
        Ok(out)
    }

    fn import_state(&mut self, seq: SeqId, host: &crate::cache::HostState) -> Result<()> {
        let Some(slot) = self.seqs.get_mut(&seq) else {
            bail!("unknown sequence {seq:?}")
        };
        let mut r = host.reader();
        let len = r.ids(1, "scripted length")?[0] as usize;
        r.finish()?;
        if len != host.len {
            bail!("a scripted state of {len} tokens claims {}", host.len);
        }
        *slot = (len, 0);
        self.checkpoints.remove(&seq);
        Ok(())
    }

    /// The scheduler checkpoints every request once before its first logits (at the end of
    /// its prompt), so the script restarts here: a request continued on a parked sequence
    /// produces exactly what an uncached one does.
    fn checkpoint(&mut self, seq: SeqId) -> Result<usize> {
        let Some(state) = self.seqs.get_mut(&seq) else {
            bail!("unknown sequence {seq:?}")
        };
        state.1 = 0;
        self.checkpoints.insert(seq, state.0);
        Ok(state.0)
    }

    fn rollback(&mut self, seq: SeqId) -> Result<usize> {
        let (Some(state), Some(&len)) = (self.seqs.get_mut(&seq), self.checkpoints.get(&seq))
        else {
            bail!("sequence {seq:?} does not exist or has no checkpoint")
        };
        if state.0 < len {
            bail!(
                "sequence {seq:?} holds {} tokens, fewer than its checkpoint's {len}",
                state.0
            );
        }
        *state = (len, 0);
        Ok(len)
    }

    /// Four bytes per token in the state (enough to test the parked sequences' budget).
    fn state_bytes(&self, seq: SeqId) -> Option<usize> {
        self.seqs.get(&seq).map(|s| s.0 * 4)
    }

    /// The experts this sequence's computed tokens routed to (resumed tokens were computed
    /// by an earlier turn and counted there).
    fn routing_heat(&self, seq: SeqId) -> Option<Vec<HeatEntry>> {
        let (layers, _) = self.experts?;
        let counts = self.routed.get(&seq)?;
        Some(
            (0..layers)
                .flat_map(|layer| {
                    counts
                        .iter()
                        .enumerate()
                        .filter(|(_, &n)| n > 0)
                        .map(move |(e, &n)| HeatEntry {
                            layer,
                            expert: e as u32,
                            score: n as f32,
                        })
                })
                .collect(),
        )
    }

    fn prefetch_experts(&mut self, heat: &[HeatEntry]) {
        self.stats
            .prefetched
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .push(heat.to_vec());
    }
}
