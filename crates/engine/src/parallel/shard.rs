//! The sharding plan for tensor parallelism over N ranks, and the pure functions that cut a
//! checkpoint's tensors for rank `r`.
//!
//! Megatron-style, two all-reduces per decoder layer:
//! - attention: `q_proj` (query and gate rows interleaved per head), `k_proj`, `v_proj` split by
//!   head (column-parallel); `o_proj` split by its input columns (row-parallel), so each rank's
//!   output is a partial sum over its heads. When there are fewer KV heads than ranks, each
//!   rank keeps the one KV head its query heads read (replicated, as vLLM does);
//! - Gated DeltaNet: the q/k/v channels of `in_proj_qkv` and `conv1d`, `in_proj_z`, `in_proj_b`,
//!   `in_proj_a`, `A_log`, `dt_bias` split by (value) head; `out_proj` by its input columns;
//! - MLP: `gate_proj` / `up_proj` rows split, `down_proj` columns split;
//! - `lm_head` split by vocabulary (each rank computes its ids' logits; greedy picks the best of
//!   the ranks' best, see [`argmax_across_ranks`]);
//! - embeddings, norms, the residual (and Flash-Next's hyper-connections, PLE, router, QSA
//!   indexer) replicated;
//! - Flash-Next routed experts: not cut. Each expert belongs to one rank ([`RankShard::owns_expert`]);
//!   the host expert store is one copy shared by all ranks and each rank's VRAM expert cache
//!   holds only the experts it owns, within that rank's own VRAM budget. A rank adds the
//!   contributions of the experts it owns, and the layer's all-reduce sums them with the
//!   shared expert's partial sums.
//!
//! Head counts that do not divide by N are refused with the numbers; widths that do not divide
//! (MLP, vocabulary) are split as evenly as possible.

use crate::checkpoint::{Checkpoint, SafetensorStore};
use crate::config::TextConfig;
use crate::tensor::{Bytes, HostTensor};
use anyhow::{bail, Context, Result};
use std::ops::Range;
use std::sync::Arc;

/// What rank `rank` of `ranks` holds.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RankShard {
    pub rank: usize,
    pub ranks: usize,
    /// Attention query heads and the KV heads they read.
    pub heads: Range<usize>,
    pub kv_heads: Range<usize>,
    /// GDN value heads and the key heads they read.
    pub gdn_v_heads: Range<usize>,
    pub gdn_k_heads: Range<usize>,
    /// MLP intermediate columns.
    pub mlp: Range<usize>,
    /// Vocabulary ids of this rank's `lm_head` rows.
    pub vocab: Range<usize>,
    /// Flash-Next: the shared expert's intermediate columns (empty for dense models).
    pub shared_expert: Range<usize>,
}

/// `0..total` cut into `ranks` contiguous parts that differ by at most one; part `rank`.
pub fn even_range(total: usize, ranks: usize, rank: usize) -> Range<usize> {
    let (base, extra) = (total / ranks, total % ranks);
    let start = rank * base + rank.min(extra);
    start..start + base + usize::from(rank < extra)
}

/// Query-side heads `heads` split evenly, with the key/value heads they read (`kv` divides
/// `heads`; query head `h` reads KV head `h / (heads / kv)`).
fn head_split(
    what: &str,
    heads: usize,
    kv: usize,
    ranks: usize,
    rank: usize,
) -> Result<(Range<usize>, Range<usize>)> {
    if !heads.is_multiple_of(ranks) {
        bail!(
            "tensor parallelism over {ranks} ranks needs {what} heads divisible by {ranks}, but the model has {heads}; use a --tp that divides {heads}"
        );
    }
    if kv == 0
        || !heads.is_multiple_of(kv)
        || (!kv.is_multiple_of(ranks) && !ranks.is_multiple_of(kv))
    {
        bail!(
            "tensor parallelism over {ranks} ranks cannot split {kv} {what} key/value heads (for {heads} query heads): their count must divide by {ranks} or divide {ranks}"
        );
    }
    let per = heads / ranks;
    let q = rank * per..(rank + 1) * per;
    let group = heads / kv;
    let k = q.start / group..(q.end - 1) / group + 1;
    Ok((q, k))
}

/// The plan for every rank of a `ranks`-way split of a model with config `c`.
pub fn plan(c: &TextConfig, ranks: usize) -> Result<Vec<RankShard>> {
    if ranks == 0 {
        bail!("tensor parallelism needs at least one rank (--tp 1 or more)");
    }
    let shared = match c.architecture {
        crate::config::Architecture::Qwen4ExpText => {
            c.qwen4_exp()?.moe.shared_expert_intermediate_size
        }
        crate::config::Architecture::Qwen3_5Text => 0,
    };
    // Flash-Next has no dense MLP (its intermediate_size is unset): the width split there is
    // the shared expert's.
    let mlp = if shared > 0 {
        ("shared expert intermediate", shared)
    } else {
        ("MLP intermediate", c.intermediate_size)
    };
    for (what, n) in [mlp, ("vocabulary", c.vocab_size)] {
        if n < ranks {
            bail!(
                "cannot split the {what} size {n} over {ranks} ranks: each rank needs at least one"
            );
        }
    }
    (0..ranks)
        .map(|rank| {
            let (heads, kv_heads) = head_split(
                "attention",
                c.num_attention_heads,
                c.num_key_value_heads,
                ranks,
                rank,
            )?;
            let (gdn_v_heads, gdn_k_heads) = head_split(
                "Gated DeltaNet value",
                c.linear_num_value_heads,
                c.linear_num_key_heads,
                ranks,
                rank,
            )?;
            Ok(RankShard {
                rank,
                ranks,
                heads,
                kv_heads,
                gdn_v_heads,
                gdn_k_heads,
                mlp: even_range(c.intermediate_size, ranks, rank),
                vocab: even_range(c.vocab_size, ranks, rank),
                shared_expert: even_range(shared, ranks, rank),
            })
        })
        .collect()
}

impl RankShard {
    /// Expert `e` lives (in the VRAM cache, computed) on rank `e % ranks`: consecutive expert
    /// ids spread over the cards, so a hot range of experts does not fall on one card.
    pub fn owns_expert(&self, e: usize) -> bool {
        e % self.ranks == self.rank
    }
    pub fn owned_experts(&self, num_experts: usize) -> Vec<usize> {
        (self.rank..num_experts).step_by(self.ranks).collect()
    }

    /// The config rank's layers load with: head counts and widths of its shard.
    pub fn config(&self, c: &TextConfig) -> TextConfig {
        let mut s = c.clone();
        s.num_attention_heads = self.heads.len();
        s.num_key_value_heads = self.kv_heads.len();
        s.linear_num_value_heads = self.gdn_v_heads.len();
        s.linear_num_key_heads = self.gdn_k_heads.len();
        s.intermediate_size = self.mlp.len();
        s
    }

    /// How this rank cuts the tensor `name` of a decoder layer (`None`: replicated).
    pub fn cut(&self, name: &str, c: &TextConfig) -> Option<Cut> {
        let scale = |r: &Range<usize>, k: usize| r.start * k..r.end * k;
        let (d, dk, dv) = (c.head_dim, c.linear_key_head_dim, c.linear_value_head_dim);
        let kd = c.linear_key_dim();
        let gdn_channels = || {
            let k = scale(&self.gdn_k_heads, dk);
            let v = scale(&self.gdn_v_heads, dv);
            vec![
                k.clone(),
                kd + k.start..kd + k.end,
                2 * kd + v.start..2 * kd + v.end,
            ]
        };
        let suffix = |s: &str| name.ends_with(s);
        Some(if suffix("self_attn.q_proj.weight") {
            Cut::Rows(vec![scale(&self.heads, 2 * d)])
        } else if suffix("self_attn.k_proj.weight") || suffix("self_attn.v_proj.weight") {
            Cut::Rows(vec![scale(&self.kv_heads, d)])
        } else if suffix("self_attn.o_proj.weight") {
            Cut::Cols(scale(&self.heads, d))
        } else if suffix("linear_attn.in_proj_qkv.weight") || suffix("linear_attn.conv1d.weight") {
            Cut::Rows(gdn_channels())
        } else if suffix("linear_attn.in_proj_z.weight") {
            Cut::Rows(vec![scale(&self.gdn_v_heads, dv)])
        } else if suffix("linear_attn.in_proj_b.weight")
            || suffix("linear_attn.in_proj_a.weight")
            || suffix("linear_attn.A_log")
            || suffix("linear_attn.dt_bias")
        {
            Cut::Rows(vec![self.gdn_v_heads.clone()])
        } else if suffix("linear_attn.out_proj.weight") {
            Cut::Cols(scale(&self.gdn_v_heads, dv))
        } else if suffix("mlp.gate_proj.weight") || suffix("mlp.up_proj.weight") {
            Cut::Rows(vec![self.mlp.clone()])
        } else if suffix("mlp.down_proj.weight") {
            Cut::Cols(self.mlp.clone())
        } else if suffix("shared_expert.gate_proj.weight") || suffix("shared_expert.up_proj.weight")
        {
            Cut::Rows(vec![self.shared_expert.clone()])
        } else if suffix("shared_expert.down_proj.weight") {
            Cut::Cols(self.shared_expert.clone())
        } else {
            return None;
        })
    }
}

/// How one tensor is cut for one rank.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Cut {
    /// These ranges of the first dimension, concatenated in order.
    Rows(Vec<Range<usize>>),
    /// This range of the second (last) dimension of a 2-D tensor.
    Cols(Range<usize>),
}

impl Cut {
    /// The shape a tensor of `shape` has after this cut.
    pub fn shape(&self, shape: &[usize]) -> Vec<usize> {
        let mut s = shape.to_vec();
        match self {
            Cut::Rows(r) => {
                if let Some(first) = s.first_mut() {
                    *first = r.iter().map(|r| r.len()).sum();
                }
            }
            Cut::Cols(r) => {
                if let Some(last) = s.last_mut() {
                    *last = r.len();
                }
            }
        }
        s
    }
}

/// Ranges of the first dimension of `t` (any rank of tensor), concatenated: rows of a matrix,
/// elements of a vector, channels of a `[C, 1, K]` conv.
pub fn slice_dim0(t: &HostTensor, ranges: &[Range<usize>]) -> Result<HostTensor> {
    let Some(&n) = t.shape.first() else {
        bail!("tensor {} is a scalar; it cannot be sliced", t.name);
    };
    let inner: usize = t.shape[1..].iter().product();
    let flat = t.reshaped(vec![n, inner])?.gather_rows(ranges)?;
    let mut shape = t.shape.clone();
    shape[0] = flat.shape[0];
    flat.reshaped(shape)
}

/// Columns `range` of a 2-D tensor.
pub fn slice_cols(t: &HostTensor, range: Range<usize>) -> Result<HostTensor> {
    let [rows, cols] = t.shape[..] else {
        bail!(
            "tensor {} has shape {:?}; a column split needs a 2-D tensor",
            t.name,
            t.shape
        );
    };
    if range.end > cols || range.start > range.end {
        bail!(
            "tensor {}: columns {range:?} are outside its {cols} columns",
            t.name
        );
    }
    let es = t.dtype.size();
    let src = t.data.as_slice();
    let mut out = Vec::with_capacity(rows * range.len() * es);
    for r in 0..rows {
        let row = &src[r * cols * es..(r + 1) * cols * es];
        out.extend_from_slice(&row[range.start * es..range.end * es]);
    }
    Ok(HostTensor {
        name: t.name.clone(),
        dtype: t.dtype,
        shape: vec![rows, range.len()],
        data: Bytes::from_vec(out),
    })
}

/// Applies a cut.
pub fn apply(t: &HostTensor, cut: &Cut) -> Result<HostTensor> {
    match cut {
        Cut::Rows(r) => slice_dim0(t, r),
        Cut::Cols(r) => slice_cols(t, r.clone()),
    }
    .with_context(|| format!("cutting {} for tensor parallelism", t.name))
}

/// This rank's view of the checkpoint's decoder layers: every `…layers.N.` tensor, cut for the
/// rank or copied whole, under its own name, with a config of the shard's sizes, so the model's
/// layer loaders read it unchanged. Embeddings and the head are not included (see
/// [`vocab_rows`]), nor Flash-Next's routed experts and PLE n-gram table. The shard's tensors
/// are copied into one buffer.
pub fn layer_checkpoint(ck: &Checkpoint, shard: &RankShard) -> Result<Checkpoint> {
    let c = &ck.config;
    let mut buffer = Vec::new();
    let mut entries = Vec::new();
    for name in ck.weights.names() {
        // Flash-Next's routed experts and n-gram table are never cut and are the bulk of its
        // bytes: the ranks read them from `ck` itself (one copy for all), not from the shard.
        if !name.contains("layers.")
            || crate::model::is_unused_tensor(name)
            || name.contains(".mlp.experts.")
            || name.contains("ngram_embedding.")
        {
            continue;
        }
        let t = ck.weights.get(name)?;
        let t = match shard.cut(name, c) {
            Some(cut) => apply(&t, &cut)?,
            None => t,
        };
        // Keep every tensor 8-byte aligned in the buffer.
        buffer.resize(buffer.len().div_ceil(8) * 8, 0);
        entries.push((name.to_string(), t.dtype, t.shape.clone(), buffer.len()));
        buffer.extend_from_slice(t.data.as_slice());
    }
    let store = SafetensorStore::from_buffer(
        ck.dir
            .join(format!("<tp rank {} of {}>", shard.rank, shard.ranks)),
        Arc::new(buffer),
        entries,
    )?;
    Ok(Checkpoint {
        dir: ck.dir.clone(),
        config: shard.config(c),
        weights: store.into(),
        generation: ck.generation.clone(),
    })
}

/// Rows `vocab` of the output head (`lm_head`, or the embedding when tied), as `[len, hidden]`.
pub fn vocab_rows(head: &HostTensor, vocab: Range<usize>) -> Result<HostTensor> {
    slice_dim0(head, &[vocab])
}

/// Greedy token over a vocabulary split: each rank's `(best id, its logit)`; the highest logit
/// wins, ties to the lowest id (what a plain argmax over the whole vocabulary gives).
pub fn argmax_across_ranks(best: &[(u32, f32)]) -> Option<u32> {
    best.iter()
        .copied()
        .reduce(|a, b| {
            if b.1 > a.1 || (b.1 == a.1 && b.0 < a.0) {
                b
            } else {
                a
            }
        })
        .map(|(id, _)| id)
}

/// The best `(id, logit)` of one rank's logits `values` for ids `vocab.start..`; ties to the
/// lowest id.
pub fn local_argmax(values: &[f32], vocab: &Range<usize>) -> Option<(u32, f32)> {
    crate::sampling::argmax_with_value(values)
        .or_else(|| values.first().map(|&v| (0, v)))
        .map(|(i, v)| ((vocab.start + i) as u32, v))
}

/// F32 values of a float tensor of any float dtype.
pub fn f32_values(t: &HostTensor) -> Result<Vec<f32>> {
    t.to_f32()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn fixture(name: &str) -> Checkpoint {
        Checkpoint::open(
            &std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
                .join("tests/fixtures/qwen3_5_text")
                .join(name),
        )
        .unwrap()
    }

    #[test]
    fn even_ranges_cover_the_whole_once() {
        for total in [1usize, 7, 8, 100, 385] {
            for ranks in 1..=5 {
                if total < ranks {
                    continue;
                }
                let parts: Vec<_> = (0..ranks).map(|r| even_range(total, ranks, r)).collect();
                assert_eq!(parts[0].start, 0);
                assert_eq!(parts[ranks - 1].end, total);
                for w in parts.windows(2) {
                    assert_eq!(w[0].end, w[1].start);
                    assert!(w[0].len().abs_diff(w[1].len()) <= 1);
                }
            }
        }
    }

    #[test]
    fn kv_heads_fewer_than_ranks_are_given_to_the_ranks_that_read_them() {
        assert_eq!(head_split("a", 4, 1, 2, 1).unwrap(), (2..4, 0..1));
        assert_eq!(head_split("a", 8, 2, 4, 3).unwrap(), (6..8, 1..2));
        assert_eq!(head_split("a", 8, 4, 2, 1).unwrap(), (4..8, 2..4));
    }

    #[test]
    fn indivisible_head_counts_are_refused_with_the_numbers() {
        let e = head_split("attention", 3, 1, 2, 0).unwrap_err().to_string();
        assert!(e.contains("divisible by 2") && e.contains("has 3"), "{e}");
        let e = head_split("attention", 12, 3, 2, 0)
            .unwrap_err()
            .to_string();
        assert!(e.contains("3 attention key/value heads"), "{e}");
        // The real fixture with 3 heads and 3 GDN value heads.
        let ck = fixture("multimodal_layout_gqa3x1_gdn1x3");
        let e = plan(&ck.config, 2).unwrap_err().to_string();
        assert!(e.contains("but the model has 3"), "{e}");
        assert!(plan(&ck.config, 3).is_ok());
        assert!(plan(&ck.config, 0).is_err());
    }

    /// For every cut tensor of a fixture: the ranks' shards, put back in place, are the
    /// original tensor (and replicated KV heads equal the head they copy).
    #[test]
    fn shards_put_back_together_give_the_original_tensors() {
        for (name, ranks) in [
            ("gqa4x2_gdn2x4_rot25", 2),
            ("gqa4x1_gdn2x2_rot50_8layers", 2),
            ("mha2x2_tied_layer_types", 2),
        ] {
            let ck = fixture(name);
            let c = &ck.config;
            let shards = plan(c, ranks).unwrap();
            let mut cut_count = 0;
            for tname in ck.weights.names() {
                let t = ck.weights.get(tname).unwrap();
                let cuts: Vec<_> = shards.iter().map(|s| s.cut(tname, c)).collect();
                let Some(first) = &cuts[0] else {
                    assert!(cuts.iter().all(Option::is_none));
                    continue;
                };
                cut_count += 1;
                let orig = f32_values(&t).unwrap();
                let parts: Vec<HostTensor> = cuts
                    .iter()
                    .map(|c| apply(&t, c.as_ref().unwrap()).unwrap())
                    .collect();
                match first {
                    Cut::Cols(_) => {
                        let (rows, cols) = (t.shape[0], t.shape[1]);
                        let mut back = vec![0f32; rows * cols];
                        for (p, c) in parts.iter().zip(&cuts) {
                            let Some(Cut::Cols(r)) = c else {
                                unreachable!()
                            };
                            let v = f32_values(p).unwrap();
                            for row in 0..rows {
                                back[row * cols + r.start..row * cols + r.end]
                                    .copy_from_slice(&v[row * r.len()..(row + 1) * r.len()]);
                            }
                        }
                        assert_eq!(back, orig, "{name}: {tname}");
                    }
                    Cut::Rows(first_ranges) => {
                        let inner: usize = t.shape[1..].iter().product();
                        let shared_kv = tname.contains("k_proj") || tname.contains("v_proj");
                        if shared_kv && c.num_key_value_heads < ranks {
                            for p in &parts {
                                assert_eq!(f32_values(p).unwrap().len(), c.head_dim * inner);
                            }
                            continue;
                        }
                        // Segment by segment (q, k, v of the GDN conv), rank after rank.
                        let mut back = Vec::new();
                        for seg in 0..first_ranges.len() {
                            for (p, cut) in parts.iter().zip(&cuts) {
                                let Some(Cut::Rows(rs)) = cut else {
                                    unreachable!()
                                };
                                let v = f32_values(p).unwrap();
                                let before: usize = rs[..seg].iter().map(|r| r.len()).sum();
                                back.extend_from_slice(
                                    &v[before * inner..(before + rs[seg].len()) * inner],
                                );
                            }
                        }
                        assert_eq!(back, orig, "{name}: {tname}");
                    }
                }
            }
            assert!(cut_count >= 8, "{name}: only {cut_count} tensors were cut");
        }
    }

    #[test]
    fn vocab_split_and_greedy_across_ranks() {
        let head = HostTensor::from_f32("h", vec![5, 2], &[0., 1., 2., 3., 4., 5., 6., 7., 8., 9.]);
        let a = vocab_rows(&head, even_range(5, 2, 0)).unwrap();
        let b = vocab_rows(&head, even_range(5, 2, 1)).unwrap();
        assert_eq!(a.shape, vec![3, 2]);
        let mut all = f32_values(&a).unwrap();
        all.extend(f32_values(&b).unwrap());
        assert_eq!(all, f32_values(&head).unwrap());
        let logits = [0.5f32, 3.0, 1.0, 3.0, -1.0];
        let parts = [0..3, 3..5];
        let best: Vec<_> = parts
            .iter()
            .map(|r| local_argmax(&logits[r.clone()], r).unwrap())
            .collect();
        // Tie between id 1 and id 3: the lowest id, as a whole-vocabulary argmax gives.
        assert_eq!(argmax_across_ranks(&best), Some(1));
        assert_eq!(argmax_across_ranks(&[]), None);
    }

    #[test]
    fn experts_are_owned_by_exactly_one_rank() {
        let ck = fixture("gqa4x2_gdn2x4_rot25");
        let shards = plan(&ck.config, 2).unwrap();
        for e in 0..10 {
            assert_eq!(shards.iter().filter(|s| s.owns_expert(e)).count(), 1);
        }
        assert_eq!(shards[1].owned_experts(7), vec![1, 3, 5]);
    }
}
