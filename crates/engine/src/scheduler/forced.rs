//! Forced tokens: a per-sequence queue of tokens the scheduler emits as the sequence's next
//! outputs instead of sampling them, and the thinking budget that fills it.
//!
//! A forced token is an ordinary output token in every other respect: it is fed back into the
//! model, detokenized and streamed, counted in the usage, checked against stop tokens, stop
//! strings and `max_tokens`, and seen by the sampler's penalties. The logits computed for its
//! position are discarded.
//!
//! The thinking budget ([`ThinkingBudget`]) watches the output: once the model has produced
//! `max_tokens` tokens inside its thinking block (after the `open_token`, or from the start
//! when the prompt already opened the block), the `close_sequence` ("\n</think>\n\n" in the
//! model's tokens) is queued, and generation then continues normally after it. A model that
//! closes the block itself (`close_token`) before the budget is spent is left alone.

use std::collections::VecDeque;

/// Close a thinking block after a number of tokens.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ThinkingBudget {
    /// Tokens the model may produce inside its thinking block before it is closed (0: close
    /// it at once).
    pub max_tokens: usize,
    /// The prompt ends inside the block (a chat template that opens `<think>` for the model).
    pub starts_inside: bool,
    /// The token that opens a block when the model opens it itself; `None`: only
    /// `starts_inside` opens one.
    pub open_token: Option<u32>,
    /// The token that ends the block (`</think>`).
    pub close_token: u32,
    /// What is forced when the budget is spent; it should contain `close_token`.
    pub close_sequence: Vec<u32>,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Thinking {
    /// The block has not been opened yet.
    Before,
    /// Inside the block, with this many tokens produced there.
    Inside(usize),
    /// The close sequence is queued; waiting for its `close_token` to pass.
    Closing,
    /// The block is closed; the budget has nothing more to do.
    Closed,
}

/// The forced tokens of one sequence.
#[derive(Debug, Clone, Default)]
pub struct ForcedTokens {
    queue: VecDeque<u32>,
    budget: Option<(ThinkingBudget, Thinking)>,
}

impl ForcedTokens {
    pub fn new(budget: Option<ThinkingBudget>) -> Self {
        let mut f = ForcedTokens {
            queue: VecDeque::new(),
            budget: None,
        };
        if let Some(b) = budget {
            let state = if b.starts_inside {
                Thinking::Inside(0)
            } else {
                Thinking::Before
            };
            f.budget = Some((b, state));
            f.check_budget();
        }
        f
    }

    /// Queue `tokens` to be emitted next, after any already queued.
    pub fn push(&mut self, tokens: impl IntoIterator<Item = u32>) {
        self.queue.extend(tokens);
    }

    /// The token to emit at this position instead of sampling, if any.
    pub fn pop_next(&mut self) -> Option<u32> {
        self.queue.pop_front()
    }

    pub fn is_empty(&self) -> bool {
        self.queue.is_empty()
    }

    /// Tokens produced inside the thinking block so far (`None` without a budget).
    pub fn thinking_tokens(&self) -> Option<usize> {
        match self.budget.as_ref()?.1 {
            Thinking::Inside(n) => Some(n),
            _ => None,
        }
    }

    /// Record a token emitted by the sequence (sampled or forced).
    pub fn observe(&mut self, token: u32) {
        let Some((b, state)) = self.budget.as_mut() else {
            return;
        };
        *state = match *state {
            Thinking::Before if b.open_token == Some(token) => Thinking::Inside(0),
            Thinking::Inside(_) | Thinking::Closing if token == b.close_token => Thinking::Closed,
            Thinking::Inside(n) => Thinking::Inside(n + 1),
            s => s,
        };
        self.check_budget();
    }

    fn check_budget(&mut self) {
        if let Some((b, state)) = self.budget.as_mut() {
            if let Thinking::Inside(n) = *state {
                if n >= b.max_tokens {
                    self.queue.extend(b.close_sequence.iter().copied());
                    *state = Thinking::Closing;
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const OPEN: u32 = 10;
    const CLOSE: u32 = 11;
    const NL: u32 = 12;
    const NLNL: u32 = 13;

    fn budget(max_tokens: usize, starts_inside: bool) -> ThinkingBudget {
        ThinkingBudget {
            max_tokens,
            starts_inside,
            open_token: Some(OPEN),
            close_token: CLOSE,
            close_sequence: vec![NL, CLOSE, NLNL],
        }
    }

    /// Emits `sampled` in order wherever nothing is forced; returns the output.
    fn run(f: &mut ForcedTokens, sampled: &[u32], len: usize) -> Vec<u32> {
        let mut sampled = sampled.iter().copied();
        let mut out = Vec::new();
        while out.len() < len {
            let t = match f.pop_next() {
                Some(t) => t,
                None => sampled.next().unwrap_or(0),
            };
            f.observe(t);
            out.push(t);
        }
        out
    }

    #[test]
    fn closes_after_the_budget_then_lets_the_model_continue() {
        let mut f = ForcedTokens::new(Some(budget(3, true)));
        let out = run(&mut f, &[1, 2, 3, 4, 5, 6], 9);
        assert_eq!(out, vec![1, 2, 3, NL, CLOSE, NLNL, 4, 5, 6]);
        assert!(f.is_empty());
        assert_eq!(f.thinking_tokens(), None);
    }

    #[test]
    fn a_block_the_model_opens_itself_counts_from_its_open_token() {
        let mut f = ForcedTokens::new(Some(budget(2, false)));
        let out = run(&mut f, &[1, OPEN, 2, 3, 4, 5], 8);
        assert_eq!(out, vec![1, OPEN, 2, 3, NL, CLOSE, NLNL, 4]);
    }

    #[test]
    fn a_model_that_closes_in_time_is_left_alone() {
        let mut f = ForcedTokens::new(Some(budget(3, true)));
        let out = run(&mut f, &[1, CLOSE, 2, 3, 4, 5], 6);
        assert_eq!(out, vec![1, CLOSE, 2, 3, 4, 5]);
        // Never reopened: a second block is not budgeted.
        let out = run(&mut f, &[OPEN, 1, 2, 3, 4], 5);
        assert_eq!(out, vec![OPEN, 1, 2, 3, 4]);
    }

    #[test]
    fn a_zero_budget_closes_at_once() {
        let mut f = ForcedTokens::new(Some(budget(0, true)));
        assert_eq!(run(&mut f, &[1, 2], 5), vec![NL, CLOSE, NLNL, 1, 2]);
        // Not opened, nothing forced.
        let mut f = ForcedTokens::new(Some(budget(0, false)));
        assert_eq!(run(&mut f, &[1, 2, 3], 3), vec![1, 2, 3]);
    }

    #[test]
    fn pushed_tokens_come_first_and_without_a_budget_nothing_else_is_forced() {
        let mut f = ForcedTokens::new(None);
        f.push([7, 8]);
        assert_eq!(run(&mut f, &[1, 2, 3], 5), vec![7, 8, 1, 2, 3]);
        assert_eq!(f.thinking_tokens(), None);
    }
}
