//! Qwen Sparse Attention on the CPU: indexer block selection and attention over the selected
//! tokens (reference for every backend).
//!
//! A query at position `p` sees `(p + 1) / ratio` complete key blocks. While that is at most
//! `block_topk`, it attends to every token (dense attention, exactly); past it, to the tokens of
//! the `block_topk` blocks that score highest plus the tail after the last complete block.
//! A block's score is `Σ_h relu(q_h · k_block) / sqrt(d)` over the indexer's query heads.

use super::simd;
use crate::backend::{AttentionShape, QsaShape};
use rayon::prelude::*;

/// Mean of each consecutive group of `group` rows of a `[rows, cols]` matrix.
pub fn mean_pool_rows(x: &[f32], cols: usize, group: usize) -> Vec<f32> {
    let rows = x.len() / cols.max(1);
    let blocks = rows / group;
    let mut out = vec![0f32; blocks * cols];
    for b in 0..blocks {
        let o = &mut out[b * cols..(b + 1) * cols];
        for r in b * group..(b + 1) * group {
            o.iter_mut()
                .zip(&x[r * cols..(r + 1) * cols])
                .for_each(|(a, v)| *a += v);
        }
        o.iter_mut().for_each(|v| *v /= group as f32);
    }
    out
}

/// Token positions the query at `pos` attends to, ascending; `None` when it sees all
/// `0..=pos` (the blocks fit the budget). `index_q` is the query's `[heads·d]` row,
/// `block_keys` at least `(pos + 1) / ratio` rows of `d`.
pub fn select_tokens(
    index_q: &[f32],
    block_keys: &[f32],
    pos: usize,
    s: QsaShape,
) -> Option<Vec<usize>> {
    let d = s.index_head_dim;
    let complete = (pos + 1) / s.compress_ratio;
    if complete <= s.block_topk {
        return None;
    }
    assert!(
        block_keys.len() >= complete * d,
        "qsa: {} block keys for {complete} complete blocks",
        block_keys.len() / d
    );
    let inv = 1.0 / (d as f32).sqrt();
    let scores: Vec<f32> = (0..complete)
        .map(|b| {
            let kb = &block_keys[b * d..(b + 1) * d];
            let sum: f32 = (0..s.index_heads)
                .map(|h| simd::dot(&index_q[h * d..(h + 1) * d], kb).max(0.0))
                .sum();
            sum * inv
        })
        .collect();
    let mut order: Vec<usize> = (0..complete).collect();
    // Highest first; equal scores keep the earlier block (a stable sort).
    order.sort_by(|&a, &b| scores[b].total_cmp(&scores[a]));
    let mut blocks: Vec<usize> = order[..s.block_topk].to_vec();
    blocks.sort_unstable();
    let mut tokens: Vec<usize> = blocks
        .iter()
        .flat_map(|&b| b * s.compress_ratio..(b + 1) * s.compress_ratio)
        .collect();
    tokens.extend(complete * s.compress_ratio..=pos);
    Some(tokens)
}

/// `q [n, heads·d]`, `k`/`v` `[past+n, kv_heads·d]`, `index_q [n, index_heads·di]`,
/// `block_keys [blocks, di]` → `[n, heads·d]`.
#[allow(clippy::too_many_arguments)]
pub fn qsa_attention(
    q: &[f32],
    k: &[f32],
    v: &[f32],
    index_q: &[f32],
    block_keys: &[f32],
    n: usize,
    past: usize,
    s: AttentionShape,
    qsa: QsaShape,
) -> Vec<f32> {
    let iq = qsa.index_heads * qsa.index_head_dim;
    let selections: Vec<Option<Vec<usize>>> = (0..n)
        .map(|i| select_tokens(&index_q[i * iq..(i + 1) * iq], block_keys, past + i, qsa))
        .collect();
    if selections.iter().all(Option::is_none) {
        return super::attention::attention(q, k, v, n, past, s);
    }
    let d = s.head_dim;
    let qd = s.num_heads * d;
    let kvd = s.num_kv_heads * d;
    let group = s.num_heads / s.num_kv_heads;
    assert_eq!(
        k.len(),
        (past + n) * kvd,
        "qsa_attention: cache has {} rows, expected {}",
        k.len() / kvd.max(1),
        past + n
    );
    let heads: Vec<Vec<f32>> = (0..s.num_heads)
        .into_par_iter()
        .map(|h| {
            let kvh = h / group;
            let mut out = vec![0f32; n * d];
            let mut scores = Vec::new();
            for (i, sel) in selections.iter().enumerate() {
                let qi = &q[i * qd + h * d..i * qd + (h + 1) * d];
                let dense: Vec<usize>;
                let tokens: &[usize] = match sel {
                    Some(t) => t,
                    None => {
                        dense = (0..=past + i).collect();
                        &dense
                    }
                };
                scores.clear();
                let mut max = f32::NEG_INFINITY;
                for &t in tokens {
                    let sc =
                        simd::dot(qi, &k[t * kvd + kvh * d..t * kvd + (kvh + 1) * d]) * s.scale;
                    max = max.max(sc);
                    scores.push(sc);
                }
                let mut sum = 0f32;
                for sc in scores.iter_mut() {
                    *sc = (*sc - max).exp();
                    sum += *sc;
                }
                let o = &mut out[i * d..(i + 1) * d];
                for (&t, sc) in tokens.iter().zip(&scores) {
                    simd::axpy(sc / sum, &v[t * kvd + kvh * d..t * kvd + (kvh + 1) * d], o);
                }
            }
            out
        })
        .collect();
    let mut out = vec![0f32; n * qd];
    for (h, ho) in heads.iter().enumerate() {
        for i in 0..n {
            out[i * qd + h * d..i * qd + (h + 1) * d].copy_from_slice(&ho[i * d..(i + 1) * d]);
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    const SHAPE: QsaShape = QsaShape {
        index_heads: 1,
        index_head_dim: 2,
        block_topk: 1,
        compress_ratio: 2,
    };

    #[test]
    fn dense_while_blocks_fit_then_top_block_plus_tail() {
        let keys = [1.0, 0.0, -1.0, 0.0, 0.0, 3.0];
        // Positions 0..=2: at most one complete block, which fits the budget of one.
        assert_eq!(select_tokens(&[0.0, 1.0], &keys, 2, SHAPE), None);
        // Position 4: blocks {0,1} and {2,3} complete; the query (0, 1) scores them 0 and 0 (a
        // tie: the earlier block wins); token 4 is the tail.
        assert_eq!(
            select_tokens(&[0.0, 1.0], &keys, 4, SHAPE),
            Some(vec![0, 1, 4])
        );
        // Query (-1, 0) prefers block 1.
        assert_eq!(
            select_tokens(&[-1.0, 0.0], &keys, 4, SHAPE),
            Some(vec![2, 3, 4])
        );
        // Position 5: three complete blocks, block 2 scores 3.
        assert_eq!(
            select_tokens(&[0.0, 1.0], &keys, 5, SHAPE),
            Some(vec![4, 5])
        );
    }

    #[test]
    fn pooling_averages_groups_and_drops_partial_block() {
        let x = [1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0, 8.0, 9.0, 10.0];
        assert_eq!(mean_pool_rows(&x, 2, 2), vec![2.0, 3.0, 6.0, 7.0]);
    }

    #[test]
    fn attention_over_selection_matches_dense_when_nothing_is_dropped() {
        let s = AttentionShape {
            num_heads: 2,
            num_kv_heads: 1,
            head_dim: 2,
            scale: 0.7,
        };
        let big = QsaShape {
            index_heads: 1,
            index_head_dim: 2,
            block_topk: 8,
            compress_ratio: 2,
        };
        let (n, total) = (3, 5);
        let q: Vec<f32> = (0..n * 4).map(|i| (i as f32 * 0.37).sin()).collect();
        let k: Vec<f32> = (0..total * 2).map(|i| (i as f32 * 0.91).cos()).collect();
        let v: Vec<f32> = (0..total * 2).map(|i| i as f32 * 0.1).collect();
        let dense = super::super::attention::attention(&q, &k, &v, n, 2, s);
        let sparse = qsa_attention(&q, &k, &v, &[0.0; 6], &[0.0; 4], n, 2, s, big);
        assert_eq!(dense, sparse);
    }
}
