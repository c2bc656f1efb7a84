//! Parked sequences: the prefix cache's VRAM tier.
//!
//! When a turn of a session ends, its sequence is not dropped but parked: its state stays on
//! the model's device with the exact tokens it holds (the prompt part, then the generated
//! tokens fed back) and a model checkpoint at the end of the prompt part
//! ([`crate::model::CausalLm::checkpoint`]). A later request whose prompt extends those tokens
//! continues on the sequence as it is; one whose prompt leaves them after the checkpoint (an
//! agent re-rendering the previous answer) continues from the checkpoint after a rollback. In
//! both cases nothing is copied and only the new tokens are computed.
//!
//! The set is bounded by count and by the bytes of state it holds; the least recently used
//! sequence leaves first, and each session keeps at most one (its latest turn). A sequence
//! that leaves (evicted, or idle past the cache's idle time) is exported to the RAM tier once,
//! by the scheduler, and dropped.

use crate::model::SeqId;
use std::time::{Duration, Instant};

/// One parked sequence.
pub(super) struct Parked {
    pub seq: SeqId,
    pub session: String,
    /// The tokens in the sequence's state: the prompt part, then the generated tokens fed back.
    pub tokens: Vec<u32>,
    /// Length at the sequence's model checkpoint (at most `tokens.len()`).
    pub checkpoint: usize,
    /// Bytes of state on the device (`None`: the model does not say).
    pub bytes: Option<usize>,
    pub last_used: Instant,
}

/// How a parked sequence serves a prompt.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) struct ParkedMatch {
    pub index: usize,
    /// Prompt tokens it holds (resumed, not computed).
    pub depth: usize,
    /// True when the sequence must first roll back to its checkpoint.
    pub rollback: bool,
}

impl Parked {
    /// How deep this sequence serves `prompt` when at most `max_len` tokens may be resumed:
    /// all its tokens when the prompt extends them, else its checkpoint when the prompt
    /// extends that; `None` when neither leaves a token to compute.
    fn depth_for(&self, prompt: &[u32], max_len: usize) -> Option<(usize, bool)> {
        let common = self
            .tokens
            .iter()
            .zip(prompt)
            .take_while(|(a, b)| a == b)
            .count();
        if common == self.tokens.len() && self.tokens.len() <= max_len {
            return Some((self.tokens.len(), false));
        }
        (self.checkpoint > 0 && common >= self.checkpoint && self.checkpoint <= max_len)
            .then_some((self.checkpoint, true))
    }
}

/// The parked sequences and their limits.
pub(super) struct ParkedSet {
    list: Vec<Parked>,
    max_count: usize,
    max_bytes: usize,
}

impl ParkedSet {
    pub fn new(max_count: usize, max_bytes: usize) -> Self {
        ParkedSet {
            list: Vec::new(),
            max_count,
            max_bytes,
        }
    }

    /// False when parking is switched off (a limit of 0 sequences).
    pub fn enabled(&self) -> bool {
        self.max_count > 0
    }

    pub fn contains(&self, seq: SeqId) -> bool {
        self.list.iter().any(|p| p.seq == seq)
    }

    fn bytes(&self) -> usize {
        self.list.iter().filter_map(|p| p.bytes).sum()
    }

    /// The sequence that serves `prompt` deepest. A request of a session only takes that
    /// session's sequence (taking another's would leave that conversation without it); a
    /// request without a session takes any, by prefix.
    pub fn best_for(&self, prompt: &[u32], session: Option<&str>) -> Option<ParkedMatch> {
        let max_len = prompt.len().checked_sub(1)?;
        self.list
            .iter()
            .enumerate()
            .filter(|(_, p)| session.is_none_or(|s| s == p.session))
            .filter_map(|(index, p)| {
                let (depth, rollback) = p.depth_for(prompt, max_len)?;
                Some(ParkedMatch {
                    index,
                    depth,
                    rollback,
                })
            })
            .max_by_key(|m| m.depth)
    }

    /// Takes a sequence out (to continue on it).
    pub fn take(&mut self, index: usize) -> Parked {
        self.list.remove(index)
    }

    /// Parks `p`; returns the sequences that must leave: the session's older one, then the
    /// least recently used while a limit is exceeded (`p` itself when it alone exceeds the
    /// byte limit).
    pub fn park(&mut self, p: Parked) -> Vec<Parked> {
        let mut out: Vec<Parked> = Vec::new();
        if let Some(i) = self.list.iter().position(|o| o.session == p.session) {
            out.push(self.list.remove(i));
        }
        if p.bytes.unwrap_or(0) > self.max_bytes || !self.enabled() {
            out.push(p);
            return out;
        }
        self.list.push(p);
        while self.list.len() > self.max_count || self.bytes() > self.max_bytes {
            let oldest = self
                .list
                .iter()
                .enumerate()
                .min_by_key(|(_, p)| p.last_used)
                .map(|(i, _)| i)
                .expect("over a limit, so not empty");
            out.push(self.list.remove(oldest));
        }
        out
    }

    /// Takes out the sequences unused for at least `idle`.
    pub fn take_idle(&mut self, idle: Duration) -> Vec<Parked> {
        let (gone, stay) = std::mem::take(&mut self.list)
            .into_iter()
            .partition(|p| p.last_used.elapsed() >= idle);
        self.list = stay;
        gone
    }

    /// Takes out every sequence.
    pub fn take_all(&mut self) -> Vec<Parked> {
        std::mem::take(&mut self.list)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parked(seq: u64, session: &str, tokens: Vec<u32>, checkpoint: usize) -> Parked {
        Parked {
            seq: SeqId(seq),
            session: session.into(),
            tokens,
            checkpoint,
            bytes: Some(100),
            last_used: Instant::now(),
        }
    }

    #[test]
    fn a_prompt_resumes_at_the_tip_or_at_the_checkpoint() {
        let mut set = ParkedSet::new(4, 1000);
        assert!(set
            .park(parked(1, "a", vec![1, 2, 3, 4, 5, 6], 4))
            .is_empty());
        let at = |prompt: &[u32], s| set.best_for(prompt, s).map(|m| (m.depth, m.rollback));
        // Extends every token: continue as it is.
        assert_eq!(at(&[1, 2, 3, 4, 5, 6, 7], Some("a")), Some((6, false)));
        // Leaves them inside the generated tokens: back to the checkpoint.
        assert_eq!(at(&[1, 2, 3, 4, 5, 9, 9], Some("a")), Some((4, true)));
        // The very same tokens: one must be computed, so the checkpoint.
        assert_eq!(at(&[1, 2, 3, 4, 5, 6], None), Some((4, true)));
        // Diverges before the checkpoint, or is another session's.
        assert_eq!(at(&[1, 2, 3, 9, 9, 9, 9], Some("a")), None);
        assert_eq!(at(&[1, 2, 3, 4, 5, 6, 7], Some("b")), None);
        // A prompt that is the checkpoint itself leaves nothing to compute.
        assert_eq!(at(&[1, 2, 3, 4], None), None);
    }

    #[test]
    fn limits_evict_the_least_recently_used_and_a_session_keeps_one() {
        let mut set = ParkedSet::new(2, 250);
        assert!(set.park(parked(1, "a", vec![1], 0)).is_empty());
        assert!(set.park(parked(2, "b", vec![2], 0)).is_empty());
        // A's next turn replaces its older sequence and evicts nobody else.
        let out = set.park(parked(3, "a", vec![1, 5], 0));
        assert_eq!(out.iter().map(|p| p.seq).collect::<Vec<_>>(), [SeqId(1)]);
        // A third session exceeds the count: b (least recently used) leaves.
        let out = set.park(parked(4, "c", vec![3], 0));
        assert_eq!(out.iter().map(|p| p.seq).collect::<Vec<_>>(), [SeqId(2)]);
        // One larger than the byte limit is not kept.
        let mut big = parked(5, "d", vec![4], 0);
        big.bytes = Some(251);
        let out = set.park(big);
        assert_eq!(out.iter().map(|p| p.seq).collect::<Vec<_>>(), [SeqId(5)]);
        assert!(set.contains(SeqId(3)) && set.contains(SeqId(4)) && !set.contains(SeqId(5)));
        // 3 × 100 bytes exceed 250: the oldest leaves.
        let mut set = ParkedSet::new(8, 250);
        for (i, s) in ["x", "y", "z"].into_iter().enumerate() {
            let out = set.park(parked(i as u64, s, vec![i as u32], 0));
            assert_eq!(out.len(), usize::from(i == 2));
        }
        assert!(set.take_idle(Duration::from_secs(3600)).is_empty());
        assert_eq!(set.take_idle(Duration::ZERO).len(), 2);
        assert!(set.take_all().is_empty());
    }
}
