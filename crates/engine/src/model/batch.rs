//! What every architecture's forward pass does around its layers: lay the batch out as one
//! row block (token ids, positions, each item's span), take the items' states out of the
//! sequence table and put them back, pick the rows that need logits and split the logits per
//! item.

use super::layers::Span;
use super::{BatchItem, LogitsWanted, SeqId, SequenceTable, StateSnapshot};
use crate::backend::Backend;
use anyhow::{Context, Result};

/// A batch as one block of rows: item `i` owns rows `spans[i].rows()`.
pub struct BatchLayout {
    pub spans: Vec<Span>,
    pub ids: Vec<u32>,
    /// Absolute position of every row (the item's past length onwards).
    pub positions: Vec<usize>,
}

impl BatchLayout {
    /// `past[i]`: tokens already in item `i`'s sequence.
    pub fn new(batch: &[BatchItem<'_>], past: impl IntoIterator<Item = usize>) -> Self {
        let mut l = BatchLayout {
            spans: Vec::with_capacity(batch.len()),
            ids: Vec::new(),
            positions: Vec::new(),
        };
        for (item, past) in batch.iter().zip(past) {
            l.spans.push(Span {
                start: l.ids.len(),
                len: item.tokens.len(),
                past,
            });
            l.ids.extend_from_slice(item.tokens);
            l.positions.extend(past..past + item.tokens.len());
        }
        l
    }

    /// Rows of `x` whose logits the items asked for, in batch order (empty when none did).
    pub fn logit_rows<B: Backend>(
        &self,
        b: &B,
        x: &B::Act,
        batch: &[BatchItem<'_>],
    ) -> Vec<B::Act> {
        batch
            .iter()
            .zip(&self.spans)
            .filter_map(|(item, span)| match item.logits {
                LogitsWanted::None => None,
                LogitsWanted::Last => {
                    Some(b.rows(x, span.start + span.len - 1..span.start + span.len))
                }
                LogitsWanted::All => Some(b.rows(x, span.rows())),
            })
            .collect()
    }

    /// The logits of the rows [`BatchLayout::logit_rows`] picked (`None` where no item wanted
    /// any), read back and split per item as [`super::CausalLm::forward`] returns them.
    pub fn logits_per_item<B: Backend>(
        &self,
        b: &B,
        batch: &[BatchItem<'_>],
        logits: Option<&B::Act>,
        vocab: usize,
    ) -> Vec<Vec<f32>> {
        let host = logits.map(|l| b.to_host(l)).unwrap_or_default();
        self.split_logits(batch, &host, vocab)
    }

    /// Each `Last` item's greedy token below `limit` from the rows
    /// [`BatchLayout::logit_rows`] picked (picked by the backend, [`Backend::argmax_rows`]),
    /// `None` for the others, as [`super::CausalLm::forward_greedy`] returns them.
    pub fn greedy_per_item<B: Backend>(
        &self,
        b: &B,
        batch: &[BatchItem<'_>],
        logits: Option<&B::Act>,
        limit: usize,
    ) -> Vec<Option<u32>> {
        let mut picks = logits
            .map(|l| b.argmax_rows(l, limit))
            .unwrap_or_default()
            .into_iter();
        batch
            .iter()
            .map(|item| match item.logits {
                LogitsWanted::Last => picks.next(),
                LogitsWanted::None | LogitsWanted::All => None,
            })
            .collect()
    }

    /// Splits `logits` (the rows [`BatchLayout::logit_rows`] picked, `vocab` values each) per
    /// item: empty for `None`, one row for `Last`, every row for `All`.
    pub fn split_logits(
        &self,
        batch: &[BatchItem<'_>],
        logits: &[f32],
        vocab: usize,
    ) -> Vec<Vec<f32>> {
        let mut offset = 0;
        batch
            .iter()
            .zip(&self.spans)
            .map(|(item, span)| {
                let rows = match item.logits {
                    LogitsWanted::None => 0,
                    LogitsWanted::Last => 1,
                    LogitsWanted::All => span.len,
                };
                let part = logits[offset..offset + rows * vocab].to_vec();
                offset += rows * vocab;
                part
            })
            .collect()
    }
}

impl<S> SequenceTable<S> {
    /// Takes the batch's states out of the table for the duration of a pass (the batch was
    /// checked: every sequence exists, none twice).
    pub fn take_batch(&mut self, batch: &[BatchItem<'_>]) -> Vec<S> {
        batch
            .iter()
            .map(|it| {
                self.states
                    .remove(&it.seq)
                    .expect("batch checked before the pass")
            })
            .collect()
    }

    /// Puts the states [`SequenceTable::take_batch`] took back, `grow(state, tokens)` first
    /// recording the tokens the pass appended.
    pub fn put_back(
        &mut self,
        batch: &[BatchItem<'_>],
        states: Vec<S>,
        layout: &BatchLayout,
        mut grow: impl FnMut(&mut S, usize),
    ) {
        for ((item, mut st), span) in batch.iter().zip(states).zip(&layout.spans) {
            grow(&mut st, span.len);
            self.states.insert(item.seq, st);
        }
    }
}

impl<S: Clone + 'static> SequenceTable<S> {
    /// The state of `seq`, or an error naming it.
    pub fn state(&self, seq: SeqId) -> Result<&S> {
        self.states
            .get(&seq)
            .with_context(|| format!("sequence {seq:?} does not exist"))
    }

    /// Replaces the state of `seq` with a copy of the snapshot's (taken from this model).
    pub fn restore_snapshot(&mut self, seq: SeqId, snapshot: &StateSnapshot) -> Result<()> {
        let st = snapshot
            .data
            .downcast_ref::<S>()
            .context("snapshot was taken from a different model or backend")?;
        let slot = self
            .states
            .get_mut(&seq)
            .with_context(|| format!("sequence {seq:?} does not exist"))?;
        *slot = st.clone();
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn lays_out_and_splits_per_item() {
        let batch = [
            BatchItem {
                seq: SeqId(1),
                tokens: &[5, 6, 7],
                logits: LogitsWanted::All,
            },
            BatchItem {
                seq: SeqId(2),
                tokens: &[8],
                logits: LogitsWanted::None,
            },
            BatchItem {
                seq: SeqId(3),
                tokens: &[9, 10],
                logits: LogitsWanted::Last,
            },
        ];
        let l = BatchLayout::new(&batch, [0, 4, 10]);
        assert_eq!(l.ids, vec![5, 6, 7, 8, 9, 10]);
        assert_eq!(l.positions, vec![0, 1, 2, 4, 10, 11]);
        assert_eq!(
            (l.spans[2].start, l.spans[2].len, l.spans[2].past),
            (4, 2, 10)
        );
        // Four logit rows of vocab 2: three for the first item, one for the last.
        let logits: Vec<f32> = (0..8).map(|v| v as f32).collect();
        let out = l.split_logits(&batch, &logits, 2);
        assert_eq!(
            out,
            vec![vec![0., 1., 2., 3., 4., 5.], vec![], vec![6., 7.]]
        );

        let mut t = SequenceTable::<usize>::default();
        let ids: Vec<SeqId> = (0..3).map(|i| t.insert(i * 10)).collect();
        let batch: Vec<BatchItem> = ids
            .iter()
            .zip([&[1u32, 2][..], &[3], &[4, 5, 6]])
            .map(|(&seq, tokens)| BatchItem {
                seq,
                tokens,
                logits: LogitsWanted::None,
            })
            .collect();
        let states = t.take_batch(&batch);
        assert_eq!(states, vec![0, 10, 20]);
        assert!(t.states.is_empty());
        let l = BatchLayout::new(&batch, states.iter().copied());
        t.put_back(&batch, states, &l, |s, n| *s += n);
        assert_eq!(
            ids.iter().map(|i| t.states[i]).collect::<Vec<_>>(),
            vec![2, 11, 23]
        );
    }
}
