//! Gated softmax attention, dense or Qwen Sparse Attention (QSA).
//!
//! QSA adds an indexer: its own query heads and one key head. The indexer's per-token keys are
//! kept raw in the sequence state; every complete block of `compress_ratio` of them is
//! mean-pooled, normed and rotated (at the block's first position) once, into `block_keys`.
//! Each query then attends to its top `budget / compress_ratio` blocks plus the tail, which is
//! exactly dense attention while the sequence fits the budget.

use super::{join_rows, rows_of, tensor, vector, Span};
use crate::backend::{AttentionShape, Backend, NormScale, QsaShape};
use crate::checkpoint::Checkpoint;
use crate::config::{QsaConfig, TextConfig};
use crate::tensor::HostTensor;
use anyhow::{bail, Result};

/// One sequence's attention state.
pub struct AttentionState<B: Backend> {
    /// KV cache `[len, kv_heads·d]` each.
    pub k: B::Act,
    pub v: B::Act,
    /// QSA only: the indexer's raw per-token keys `[len, index_d]` and the pooled, normed and
    /// rotated keys of the complete blocks `[len / ratio, index_d]`.
    pub index: Option<(B::Act, B::Act)>,
}

impl<B: Backend> Clone for AttentionState<B> {
    fn clone(&self) -> Self {
        AttentionState {
            k: self.k.clone(),
            v: self.v.clone(),
            index: self.index.clone(),
        }
    }
}

impl<B: Backend> AttentionState<B> {
    pub fn new(b: &B, c: &TextConfig, qsa: Option<&QsaConfig>) -> Self {
        let kvd = c.num_key_value_heads * c.head_dim;
        AttentionState {
            k: b.zeros(0, kvd),
            v: b.zeros(0, kvd),
            index: qsa.map(|q| {
                (
                    b.zeros(0, q.indexer_head_dim),
                    b.zeros(0, q.indexer_head_dim),
                )
            }),
        }
    }
    /// Row counts of the caches now (what [`AttentionState::truncate_to`] goes back to).
    pub fn cache_rows(&self, b: &B) -> CacheRows {
        CacheRows {
            kv: b.shape(&self.k).0,
            index: self
                .index
                .as_ref()
                .map(|(raw, blocks)| (b.shape(raw).0, b.shape(blocks).0)),
        }
    }

    /// Truncates the caches back to `rows` (taken from this state earlier). Exact: keys and
    /// values are per token, and the QSA block keys past the kept ones are pooled again from
    /// the raw keys as the sequence grows.
    pub fn truncate_to(&mut self, b: &B, rows: CacheRows) -> Result<()> {
        self.check_truncate(b, rows)?;
        b.truncate_rows(&mut self.k, rows.kv);
        b.truncate_rows(&mut self.v, rows.kv);
        if let (Some((raw, blocks)), Some((want_raw, want_blocks))) = (&mut self.index, rows.index)
        {
            b.truncate_rows(raw, want_raw);
            b.truncate_rows(blocks, want_blocks);
        }
        Ok(())
    }

    /// Fails unless the caches hold at least `rows` (so [`AttentionState::truncate_to`] can go
    /// back to them).
    pub fn check_truncate(&self, b: &B, rows: CacheRows) -> Result<()> {
        let now = self.cache_rows(b);
        let shorter = |have: usize, want: usize| want <= have;
        let fits = shorter(now.kv, rows.kv)
            && match (now.index, rows.index) {
                (Some((raw, blocks)), Some((want_raw, want_blocks))) => {
                    shorter(raw, want_raw) && shorter(blocks, want_blocks)
                }
                (None, None) => true,
                _ => false,
            };
        if !fits {
            bail!(
                "cannot roll the attention caches back to {rows:?}: they hold {now:?} (the state was replaced since the checkpoint)"
            );
        }
        Ok(())
    }

    pub fn bytes(&self, b: &B) -> usize {
        let mut acts = vec![&self.k, &self.v];
        if let Some((raw, blocks)) = &self.index {
            acts.extend([raw, blocks]);
        }
        acts.iter()
            .map(|a| {
                let (r, c) = b.shape(a);
                r * c * 4
            })
            .sum()
    }
}

/// Rows of one attention state's caches: K and V, and the QSA indexer's raw and block keys.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct CacheRows {
    pub kv: usize,
    pub index: Option<(usize, usize)>,
}

/// The QSA indexer of one attention layer.
pub struct QsaIndexer<B: Backend> {
    /// `index_qk_proj`: `index_heads` query heads then one key head.
    qk_proj: B::Matrix,
    q_norm: B::Vector,
    k_norm: B::Vector,
    shape: QsaShape,
}

pub struct Attention<B: Backend> {
    /// `q_proj` with rows regrouped to `[queries; gates]`, then `k_proj` and `v_proj`: one
    /// matrix, since all three read the same input.
    qkv_proj: B::Matrix,
    o_proj: B::Matrix,
    q_norm: B::Vector,
    k_norm: B::Vector,
    indexer: Option<QsaIndexer<B>>,
    shape: AttentionShape,
    rotary_dim: usize,
    eps: f32,
}

impl<B: Backend> Attention<B> {
    /// Loads `p` (`…self_attn.`); with `qsa`, also its `indexer.`.
    pub fn load(
        b: &B,
        ck: &Checkpoint,
        p: &str,
        c: &TextConfig,
        qsa: Option<&QsaConfig>,
    ) -> Result<Self> {
        if c.attention_bias {
            bail!(
                "attention_bias = true is not supported by {} checkpoints",
                c.architecture.model_type()
            );
        }
        let (h, nh, nkv, d) = (
            c.hidden_size,
            c.num_attention_heads,
            c.num_key_value_heads,
            c.head_dim,
        );
        let q = tensor(ck, &format!("{p}q_proj.weight"), &[nh * d * 2, h])?;
        let queries = (0..nh).map(|i| i * 2 * d..i * 2 * d + d);
        let gates = (0..nh).map(|i| i * 2 * d + d..(i + 1) * 2 * d);
        let regrouped: Vec<_> = queries.chain(gates).collect();
        let indexer = match qsa {
            None => None,
            Some(q) => {
                let (ih, id) = (q.indexer_n_heads, q.indexer_head_dim);
                let ip = format!("{p}indexer.");
                Some(QsaIndexer {
                    qk_proj: b.matrix(&tensor(
                        ck,
                        &format!("{ip}index_qk_proj.weight"),
                        &[(ih + 1) * id, h],
                    )?)?,
                    q_norm: vector(b, ck, &format!("{ip}q_layernorm.weight"), id)?,
                    k_norm: vector(b, ck, &format!("{ip}k_layernorm.weight"), id)?,
                    shape: QsaShape {
                        index_heads: ih,
                        index_head_dim: id,
                        block_topk: q.block_topk(),
                        compress_ratio: q.compress_ratio,
                    },
                })
            }
        };
        let qkv = [
            q.gather_rows(&regrouped)?,
            tensor(ck, &format!("{p}k_proj.weight"), &[nkv * d, h])?,
            tensor(ck, &format!("{p}v_proj.weight"), &[nkv * d, h])?,
        ];
        Ok(Attention {
            qkv_proj: b.matrix(&HostTensor::concat_rows(&format!("{p}qkv_proj"), &qkv)?)?,
            o_proj: b.matrix(&tensor(ck, &format!("{p}o_proj.weight"), &[h, nh * d])?)?,
            q_norm: vector(b, ck, &format!("{p}q_norm.weight"), d)?,
            k_norm: vector(b, ck, &format!("{p}k_norm.weight"), d)?,
            indexer,
            shape: AttentionShape {
                num_heads: nh,
                num_kv_heads: nkv,
                head_dim: d,
                scale: (d as f32).powf(-0.5),
            },
            rotary_dim: c.rotary_dim(),
            eps: c.rms_norm_eps as f32,
        })
    }

    pub fn forward(
        &self,
        b: &B,
        x: &B::Act,
        positions: &[usize],
        inv_freq: &[f32],
        spans: &[Span],
        states: &mut [&mut AttentionState<B>],
    ) -> B::Act {
        let s = self.shape;
        let (qd, kvd) = (s.num_heads * s.head_dim, s.num_kv_heads * s.head_dim);
        // 1. projections, per-head q/k norms with the rotary embedding; one sequence's caches
        // take its k and v at once (one fused step on the GPU)
        let qkv = b.linear(x, &self.qkv_proj);
        let norm_rope = |raw: &B::Act, w: &B::Vector, head_dim: usize| {
            b.rms_norm_rope(
                raw,
                w,
                self.eps,
                NormScale::OnePlus,
                positions,
                head_dim,
                self.rotary_dim,
                inv_freq,
            )
        };
        let (q, gate, kv) = match states {
            [state] => {
                let (q, gate) = b.attention_inputs(
                    &qkv,
                    s,
                    [&self.q_norm, &self.k_norm],
                    self.eps,
                    positions,
                    self.rotary_dim,
                    inv_freq,
                    [&mut state.k, &mut state.v],
                );
                (q, gate, None)
            }
            _ => {
                let [q_raw, gate, k_raw, v] = b.split_cols(&qkv, [qd, qd, kvd, kvd]);
                let q = norm_rope(&q_raw, &self.q_norm, s.head_dim);
                let k = norm_rope(&k_raw, &self.k_norm, s.head_dim);
                (q, gate, Some((k, v)))
            }
        };
        // QSA: indexer queries (normed, rotated) and raw keys of the whole batch
        let index = self.indexer.as_ref().map(|ix| {
            let iq = ix.shape.index_heads * ix.shape.index_head_dim;
            let qk = b.linear(x, &ix.qk_proj);
            let [q_index_raw, raw_k] = b.split_cols(&qk, [iq, ix.shape.index_head_dim]);
            let q_index = norm_rope(&q_index_raw, &ix.q_norm, ix.shape.index_head_dim);
            (q_index, raw_k)
        });
        // 2. per sequence: append to the caches, attend (one dense sequence's rows are the
        //    whole batch: its output gate goes in with the attention)
        let gate_inline = self.indexer.is_none() && spans.len() == 1;
        let mut outs = Vec::with_capacity(spans.len());
        for (span, state) in spans.iter().zip(states.iter_mut()) {
            if let Some((k, v)) = &kv {
                b.append_rows(&mut state.k, &rows_of(b, k, span.rows()));
                b.append_rows(&mut state.v, &rows_of(b, v, span.rows()));
            }
            let q_span = rows_of(b, &q, span.rows());
            match (&self.indexer, &index, &mut state.index) {
                (Some(ix), Some((q_index, raw_k)), Some((raw_cache, blocks))) => {
                    b.append_rows(raw_cache, &rows_of(b, raw_k, span.rows()));
                    self.extend_blocks(b, ix, raw_cache, blocks, span.past + span.len, inv_freq);
                    outs.push(b.qsa_attention(
                        &q_span,
                        &state.k,
                        &state.v,
                        &rows_of(b, q_index, span.rows()),
                        blocks,
                        span.past,
                        s,
                        ix.shape,
                    ));
                }
                (None, None, None) if gate_inline => {
                    outs.push(b.attention_gated(&q_span, &state.k, &state.v, span.past, s, &gate))
                }
                (None, None, None) => {
                    outs.push(b.attention(&q_span, &state.k, &state.v, span.past, s))
                }
                _ => unreachable!("attention states are created with the layer's indexer"),
            }
        }
        // 3. sigmoid output gate (unless applied above), output projection
        let attn = if gate_inline {
            join_rows(b, outs)
        } else {
            b.sigmoid_gate(&join_rows(b, outs), &gate)
        };
        b.linear(&attn, &self.o_proj)
    }

    /// The QSA token selection of every row of one whole sequence `x` `[n, hidden]` (positions
    /// `0..n`): `None` for a dense layer, else per row `None` (all tokens) or the positions.
    /// The forward pass makes the same choice inside [`Backend::qsa_attention`]; this exposes
    /// it so that tests can hold it to the reference on its own.
    pub fn qsa_selections(
        &self,
        b: &B,
        x: &B::Act,
        inv_freq: &[f32],
    ) -> Option<Vec<Option<Vec<usize>>>> {
        let ix = self.indexer.as_ref()?;
        let (n, _) = b.shape(x);
        let positions: Vec<usize> = (0..n).collect();
        let (iq, id) = (
            ix.shape.index_heads * ix.shape.index_head_dim,
            ix.shape.index_head_dim,
        );
        let qk = b.linear(x, &ix.qk_proj);
        let [q_index_raw, raw] = b.split_cols(&qk, [iq, id]);
        let q_index = b.rms_norm_rope(
            &q_index_raw,
            &ix.q_norm,
            self.eps,
            NormScale::OnePlus,
            &positions,
            id,
            self.rotary_dim,
            inv_freq,
        );
        let mut blocks = b.zeros(0, id);
        self.extend_blocks(b, ix, &raw, &mut blocks, n, inv_freq);
        let (q_host, k_host) = (b.to_host(&q_index), b.to_host(&blocks));
        Some(
            (0..n)
                .map(|p| {
                    crate::backend::cpu::qsa::select_tokens(
                        &q_host[p * iq..(p + 1) * iq],
                        &k_host,
                        p,
                        ix.shape,
                    )
                })
                .collect(),
        )
    }

    /// Pools the blocks that became complete: mean of their raw keys, `(1 + w)` norm, RoPE at
    /// the block's first position.
    fn extend_blocks(
        &self,
        b: &B,
        ix: &QsaIndexer<B>,
        raw: &B::Act,
        blocks: &mut B::Act,
        len: usize,
        inv_freq: &[f32],
    ) {
        let r = ix.shape.compress_ratio;
        let done = b.shape(blocks).0;
        let complete = len / r;
        if complete <= done {
            return;
        }
        let pooled = b.mean_pool_rows(&b.rows(raw, done * r..complete * r), r);
        let starts: Vec<usize> = (done..complete).map(|blk| blk * r).collect();
        let keys = b.rms_norm_rope(
            &pooled,
            &ix.k_norm,
            self.eps,
            NormScale::OnePlus,
            &starts,
            ix.shape.index_head_dim,
            self.rotary_dim,
            inv_freq,
        );
        b.append_rows(blocks, &keys);
    }
}
