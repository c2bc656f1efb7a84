//! PLE (per-layer embedding): hashed n-gram embeddings injected into the hyper-connection
//! streams before some GDN layers.
//!
//! Each token's n-grams of orders 2..=`ngram_size` (ending at the token, restarting after an
//! eos) are hashed by `heads_per_ngram` heads each into per-head prime-sized slices of one big
//! table. The looked-up rows give a value and one key per stream; the normed streams gate the
//! value, and a dilated depthwise causal conv adds local context. The last `ngram_size - 1`
//! tokens and the conv history are part of the sequence state, so chunked prefill and decode
//! see the same n-grams as one full pass.
//!
//! The real table is ~51 GB, stored in `split_ngram_parts` shards: rows are read from the
//! memory-mapped shards one at a time and never copied whole.

use super::{tensor, Span, WideNorm};
use crate::backend::Backend;
use crate::checkpoint::Checkpoint;
use crate::config::PleConfig;
use crate::quant::fp8::E4M3_TO_F32;
use crate::tensor::{DType, HostTensor};
use anyhow::{bail, Context, Result};
use half::{bf16, f16};
use rayon::prelude::*;

/// Table rows one rayon task gathers; a call with fewer than two tasks' rows (a decode step
/// has 16) gathers on the calling thread, without a hand-off to the pool.
const GATHER_ROWS_PER_TASK: usize = 512;

const SPLITMIX_GAMMA: u64 = 0x9E37_79B9_7F4A_7C15;
const PRIME_1: i64 = 10007;

fn splitmix64(value: u64) -> u64 {
    let mut v = value.wrapping_add(SPLITMIX_GAMMA);
    v = (v ^ (v >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    v = (v ^ (v >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    v ^ (v >> 31)
}

/// The odd hash multipliers of one PLE layer, one per n-gram position (transformers'
/// `_build_layer_multipliers`).
pub fn layer_multipliers(
    vocab_size: usize,
    ngram_size: usize,
    ple_index: usize,
    seed: i64,
) -> Vec<i64> {
    let multiplier_max = i64::MAX / (vocab_size.max(1) as i64);
    let half_bound = (multiplier_max / 2).max(1) as u64;
    let base_seed = seed.wrapping_add(PRIME_1.wrapping_mul(ple_index as i64)) as u64;
    (0..ngram_size as u64)
        .map(|i| {
            let v = base_seed.wrapping_add(SPLITMIX_GAMMA.wrapping_mul(i + 1));
            (2 * (splitmix64(v) % half_bound) + 1) as i64
        })
        .collect()
}

fn is_prime(v: u64) -> bool {
    if v < 2 {
        return false;
    }
    if v.is_multiple_of(2) {
        return v == 2;
    }
    let mut d = 3;
    while d * d <= v {
        if v.is_multiple_of(d) {
            return false;
        }
        d += 2;
    }
    true
}

/// Table sizes of one layer's heads: head `h` of PLE layer `i` gets the `(i·heads + h + 1)`-th
/// prime at or above `base`, so every head of every layer hashes modulo a distinct prime.
pub fn head_vocab_sizes(base: u64, heads: usize, ple_index: usize) -> Vec<u64> {
    let mut sizes = Vec::with_capacity(heads);
    let mut prime = base - 1;
    for g in 0..ple_index * heads + heads {
        prime += 1;
        while !is_prime(prime) {
            prime += 1;
        }
        if g >= ple_index * heads {
            sizes.push(prime);
        }
    }
    sizes
}

/// Hashes token n-grams into table rows for one PLE layer.
#[derive(Debug, Clone)]
pub struct NgramHasher {
    pub multipliers: Vec<i64>,
    pub head_sizes: Vec<u64>,
    pub head_offsets: Vec<u64>,
    /// Rows of the padded table.
    pub table_rows: u64,
    pub ngram_size: usize,
    pub heads_per_ngram: usize,
    pub eos: u32,
}

impl NgramHasher {
    pub fn new(c: &PleConfig, vocab_size: usize, ple_index: usize) -> Self {
        let heads = c.ngram_heads();
        let head_sizes = head_vocab_sizes(c.ngram_vocab_size_base, heads, ple_index);
        let mut head_offsets = Vec::with_capacity(heads);
        let mut total = 0;
        for s in &head_sizes {
            head_offsets.push(total);
            total += s;
        }
        let div = c.make_ngram_vocab_size_divisible_by;
        NgramHasher {
            multipliers: layer_multipliers(vocab_size, c.ngram_size, ple_index, c.seed),
            head_sizes,
            head_offsets,
            table_rows: total.div_ceil(div) * div,
            ngram_size: c.ngram_size,
            heads_per_ngram: c.heads_per_ngram,
            eos: c.eos_token_id,
        }
    }

    /// Tokens of context carried between calls.
    pub fn context_len(&self) -> usize {
        self.ngram_size - 1
    }

    /// Row ids `[tokens.len(), heads]` of the new `tokens` after `context` (the previous
    /// `context_len` tokens, eos before the start); updates `context`.
    pub fn ids(&self, context: &mut Vec<u32>, tokens: &[u32]) -> Vec<u64> {
        let c = self.context_len();
        debug_assert_eq!(context.len(), c);
        let mut history = Vec::with_capacity(c + tokens.len());
        history.extend_from_slice(context);
        history.extend_from_slice(tokens);
        let heads = self.head_sizes.len();
        let mut out = Vec::with_capacity(tokens.len() * heads);
        let mut shifted = vec![0i64; self.ngram_size];
        for t in c..history.len() {
            // Token `shift` places back, or eos when that crosses the sequence start or an eos.
            let mut crossed = false;
            for (shift, slot) in shifted.iter_mut().enumerate() {
                if shift > 0 {
                    crossed |= t < shift || history[t - shift] == self.eos;
                }
                *slot = if crossed {
                    self.eos as i64
                } else {
                    history[t - shift] as i64
                };
            }
            for order in 2..=self.ngram_size {
                let mut mixed = shifted[0].wrapping_mul(self.multipliers[0]);
                for (tok, mult) in shifted[1..order].iter().zip(&self.multipliers[1..order]) {
                    mixed ^= tok.wrapping_mul(*mult);
                }
                let first = (order - 2) * self.heads_per_ngram;
                for h in first..first + self.heads_per_ngram {
                    out.push(
                        mixed.rem_euclid(self.head_sizes[h] as i64) as u64 + self.head_offsets[h],
                    );
                }
            }
        }
        context.clear();
        context.extend_from_slice(&history[history.len() - c..]);
        out
    }
}

/// How the rows of an FP8 E4M3 table part are scaled (ModelOpt's `weight_scale`).
enum Fp8Scale {
    /// One F32 scale for the whole part.
    Tensor(f32),
    /// One F32 scale per row, read in place (`[rows]` or `[rows, 1]`).
    Row(HostTensor),
}

/// One part of the table: rows of F32/F16/BF16, or FP8 E4M3 codes with their scale.
struct TablePart {
    /// First row of the part in the whole table.
    start: u64,
    weight: HostTensor,
    fp8: Option<Fp8Scale>,
}

/// The n-gram table, possibly split in shards along its rows, read in place: rows are
/// converted (FP8 ones dequantized) only as they are gathered.
pub struct NgramTable {
    /// Parts in row order.
    parts: Vec<TablePart>,
    pub rows: u64,
    pub dim: usize,
}

/// A table part as the file stores it, memory-mapped: an FP8 part stays FP8 here (reading it
/// through [`crate::checkpoint::Weights::get`] would dequantize the whole ~51 GB table).
fn stored_part(ck: &Checkpoint, name: &str) -> Result<HostTensor> {
    let store = ck.weights.store();
    if store.contains(name) {
        store.get(name)
    } else {
        ck.weights.get(name)
    }
}

/// Reads the `weight_scale` of an FP8 table part `t` named `…weight`.
fn fp8_scale(ck: &Checkpoint, t: &HostTensor) -> Result<Fp8Scale> {
    let name = format!("{}_scale", t.name);
    let store = ck.weights.store();
    if !store.contains(&name) {
        bail!(
            "PLE table part {} is FP8 E4M3 but {name} is missing; expected a per-tensor or per-row F32 scale beside it (ModelOpt FP8 layout)",
            t.name
        );
    }
    let sc = store.get(&name)?;
    if sc.dtype != DType::F32 {
        bail!("FP8 scale {name} has dtype {}; expected F32", sc.dtype);
    }
    let rows = t.shape[0];
    if sc.numel() == 1 {
        let b = sc.data.as_slice();
        return Ok(Fp8Scale::Tensor(f32::from_le_bytes([
            b[0], b[1], b[2], b[3],
        ])));
    }
    if sc.shape == [rows] || sc.shape == [rows, 1] {
        return Ok(Fp8Scale::Row(sc));
    }
    bail!(
        "FP8 scale {name} has shape {:?}; expected one value (per tensor) or [{rows}] / [{rows}, 1] (per row) for the table part of shape {:?}",
        sc.shape,
        t.shape
    )
}

impl NgramTable {
    /// Opens `{p}ngram_embedding.weight`, or the shards `{p}ngram_embedding.shard_{i}.weight`
    /// that `save_pretrained` writes (`torch.chunk` sizes: all equal but a shorter last one).
    pub fn open(ck: &Checkpoint, p: &str, rows: u64, dim: usize) -> Result<Self> {
        let whole = format!("{p}ngram_embedding.weight");
        let mut parts = Vec::new();
        if ck.weights.contains(&whole) {
            parts.push(stored_part(ck, &whole)?);
        } else {
            while ck
                .weights
                .contains(&format!("{p}ngram_embedding.shard_{}.weight", parts.len()))
            {
                let name = format!("{p}ngram_embedding.shard_{}.weight", parts.len());
                parts.push(stored_part(ck, &name)?);
            }
            if parts.is_empty() {
                bail!(
                    "PLE table missing: expected {whole} or {p}ngram_embedding.shard_0.weight, …"
                );
            }
        }
        let mut table = Vec::with_capacity(parts.len());
        let mut start = 0u64;
        for t in parts {
            if t.shape.len() != 2 || t.shape[1] != dim {
                bail!(
                    "PLE table part {} has shape {:?}; expected [rows, {dim}]",
                    t.name,
                    t.shape
                );
            }
            let fp8 = match t.dtype {
                DType::F32 | DType::F16 | DType::BF16 => None,
                DType::F8E4M3 => Some(fp8_scale(ck, &t)?),
                other => bail!(
                    "PLE table part {} has dtype {other}; expected F32, F16, BF16 or F8_E4M3 (with weight_scale)",
                    t.name
                ),
            };
            let n = t.shape[0] as u64;
            table.push(TablePart {
                start,
                weight: t,
                fp8,
            });
            start += n;
        }
        if start != rows {
            bail!(
                "PLE table {p}ngram_embedding has {start} rows across {} part(s); the config's n-gram heads need {rows}",
                table.len()
            );
        }
        Ok(NgramTable {
            parts: table,
            rows,
            dim,
        })
    }

    /// The dtype of the first part (all parts of a published table share it).
    pub fn dtype(&self) -> DType {
        self.parts[0].weight.dtype
    }

    /// Rows `ids` as f32 into `dst` (`ids.len() × dim` values).
    pub fn gather(&self, ids: &[u64], dst: &mut [f32]) {
        assert_eq!(
            dst.len(),
            ids.len() * self.dim,
            "gather: dst holds {} values for {} rows of {}",
            dst.len(),
            ids.len(),
            self.dim
        );
        if ids.len() < 2 * GATHER_ROWS_PER_TASK {
            for (row, id) in dst.chunks_exact_mut(self.dim).zip(ids) {
                self.row(*id, row);
            }
        } else {
            // A prefill gathers ~131K random rows of the memory-mapped table (8K tokens × 16
            // heads): ~90 ms on one core of the GPU box, with the GPU idle.
            dst.par_chunks_mut(self.dim)
                .zip(ids.par_iter())
                .with_min_len(GATHER_ROWS_PER_TASK)
                .for_each(|(row, id)| self.row(*id, row));
        }
    }

    /// Copies row `row` as f32 into `out` (`dim` values).
    pub fn row(&self, row: u64, out: &mut [f32]) {
        let i = self.parts.partition_point(|p| p.start <= row) - 1;
        let part = &self.parts[i];
        let t = &part.weight;
        let r = (row - part.start) as usize;
        let size = t.dtype.size();
        let bytes = &t.data.as_slice()[r * self.dim * size..(r + 1) * self.dim * size];
        if let Some(scale) = &part.fp8 {
            let s = match scale {
                Fp8Scale::Tensor(s) => *s,
                Fp8Scale::Row(v) => {
                    let b = &v.data.as_slice()[r * 4..r * 4 + 4];
                    f32::from_le_bytes([b[0], b[1], b[2], b[3]])
                }
            };
            for (o, &c) in out.iter_mut().zip(bytes) {
                *o = E4M3_TO_F32[c as usize] * s;
            }
            return;
        }
        for (o, c) in out.iter_mut().zip(bytes.chunks_exact(size)) {
            *o = match t.dtype {
                DType::F32 => f32::from_le_bytes([c[0], c[1], c[2], c[3]]),
                DType::F16 => f16::from_le_bytes([c[0], c[1]]).to_f32(),
                _ => bf16::from_le_bytes([c[0], c[1]]).to_f32(),
            };
        }
    }
}

/// One sequence's PLE state.
pub struct PleState<B: Backend> {
    /// The last `ngram_size - 1` tokens (eos before the start).
    pub context: Vec<u32>,
    /// Dilated conv history `[(K-1)·dilation, s·h]`.
    pub conv: B::Act,
}

impl<B: Backend> Clone for PleState<B> {
    fn clone(&self) -> Self {
        PleState {
            context: self.context.clone(),
            conv: self.conv.clone(),
        }
    }
}

pub struct Ple<B: Backend> {
    pub hasher: NgramHasher,
    table: NgramTable,
    /// `key_proj` `[s·h, E]` ‖ `value_proj` `[h, E]`.
    key_value: B::Matrix,
    norm_key: WideNorm<B>,
    norm_query: WideNorm<B>,
    norm_conv: WideNorm<B>,
    /// The dilated conv as an undilated one: taps `[s·h, (K-1)·dilation + 1]`, zero between the
    /// dilated ones (adding exact zeros leaves the sums unchanged).
    conv: B::Matrix,
    conv_history: usize,
    hidden: usize,
    streams: usize,
}

impl<B: Backend> Ple<B> {
    /// Loads `p` (`…layers.{i}.ple.`), the `ple_index`-th PLE layer.
    #[allow(clippy::too_many_arguments)]
    pub fn load(
        b: &B,
        ck: &Checkpoint,
        p: &str,
        c: &PleConfig,
        vocab_size: usize,
        ple_index: usize,
        hidden: usize,
        streams: usize,
        eps: f32,
    ) -> Result<Self> {
        let hasher = NgramHasher::new(c, vocab_size, ple_index);
        let ep = format!("{p}ple_embedding.");
        check_buffer(ck, &format!("{ep}layer_multipliers"), &hasher.multipliers)?;
        let sizes: Vec<i64> = hasher.head_sizes.iter().map(|&v| v as i64).collect();
        check_buffer(ck, &format!("{ep}ngram_heads_vocab_sizes"), &sizes)?;
        let offsets: Vec<i64> = hasher.head_offsets.iter().map(|&v| v as i64).collect();
        check_buffer(ck, &format!("{ep}ngram_heads_offsets"), &offsets)?;
        let table = NgramTable::open(ck, &ep, hasher.table_rows, c.head_dim())?;
        let wide = streams * hidden;
        let e = c.embed_dim;
        let key = tensor(ck, &format!("{p}key_proj.weight"), &[wide, e])?;
        let value = tensor(ck, &format!("{p}value_proj.weight"), &[hidden, e])?;
        let k = c.conv_kernel_size;
        let dilation = c.ngram_size;
        let taps = tensor(ck, &format!("{p}conv1d.weight"), &[wide, 1, k])?.to_f32()?;
        let span = (k - 1) * dilation + 1;
        let mut expanded = vec![0f32; wide * span];
        for ch in 0..wide {
            for j in 0..k {
                expanded[ch * span + j * dilation] = taps[ch * k + j];
            }
        }
        Ok(Ple {
            hasher,
            table,
            key_value: b.matrix(&HostTensor::concat_rows(
                &format!("{p}key_value"),
                &[key, value],
            )?)?,
            norm_key: WideNorm::load(b, ck, &format!("{p}norm_key.weight"), wide, hidden, eps)?,
            norm_query: WideNorm::load(b, ck, &format!("{p}norm_query.weight"), wide, hidden, eps)?,
            norm_conv: WideNorm::load(b, ck, &format!("{p}norm_conv.weight"), wide, hidden, eps)?,
            conv: b.matrix(&HostTensor::from_f32(
                &format!("{p}conv1d.dilated"),
                vec![wide, span],
                &expanded,
            ))?,
            conv_history: span - 1,
            hidden,
            streams,
        })
    }

    pub fn new_state(&self, b: &B) -> PleState<B> {
        PleState {
            context: vec![self.hasher.eos; self.hasher.context_len()],
            conv: b.zeros(self.conv_history, self.streams * self.hidden),
        }
    }

    /// The n-gram embeddings `[n, E]` of each span's new tokens, advancing the contexts.
    pub fn embeddings(
        &self,
        b: &B,
        tokens: &[u32],
        spans: &[Span],
        states: &mut [&mut PleState<B>],
    ) -> B::Act {
        let heads = self.hasher.head_sizes.len();
        let dim = self.table.dim;
        let mut emb = vec![0f32; tokens.len() * heads * dim];
        for (span, st) in spans.iter().zip(states.iter_mut()) {
            let ids = self.hasher.ids(&mut st.context, &tokens[span.rows()]);
            let dst = &mut emb[span.start * heads * dim..(span.start + span.len) * heads * dim];
            self.table.gather(&ids, dst);
        }
        b.from_host(tokens.len(), heads * dim, &emb)
    }

    /// The PLE term added to the streams `x` `[n, s·h]`.
    pub fn forward(
        &self,
        b: &B,
        x: &B::Act,
        tokens: &[u32],
        spans: &[Span],
        states: &mut [&mut PleState<B>],
    ) -> B::Act {
        let wide = self.streams * self.hidden;
        let emb = self.embeddings(b, tokens, spans, states);
        let kv = b.linear(&emb, &self.key_value);
        let key = self.norm_key.forward(b, &b.cols(&kv, 0..wide));
        let value = b.cols(&kv, wide..wide + self.hidden);
        let query = self.norm_query.forward(b, x);
        let mut gated = b.ple_gate(&key, &query, &value, self.streams);
        let normed = self.norm_conv.forward(b, &gated);
        let convs: Vec<B::Act> = spans
            .iter()
            .zip(states.iter_mut())
            .map(|(span, st)| {
                b.causal_conv1d_silu(&b.rows(&normed, span.rows()), &mut st.conv, &self.conv)
            })
            .collect();
        b.add_assign(&mut gated, &b.cat_rows(&convs));
        gated
    }
}

/// When the checkpoint holds a derived buffer (transformers saves them), it must equal what
/// the config gives; a mismatch means a different hashing scheme.
fn check_buffer(ck: &Checkpoint, name: &str, want: &[i64]) -> Result<()> {
    if !ck.weights.contains(name) {
        return Ok(());
    }
    let t = ck.weights.get(name)?;
    if t.dtype != DType::I64 {
        bail!("buffer {name} has dtype {}; expected I64", t.dtype);
    }
    let found: Vec<i64> = t
        .data
        .as_slice()
        .chunks_exact(8)
        .map(|c| i64::from_le_bytes(c.try_into().expect("8 bytes")))
        .collect();
    if found != want {
        return Err(anyhow::anyhow!(
            "the config gives {want:?}, the checkpoint stores {found:?}"
        ))
        .with_context(|| {
            format!("PLE buffer {name} does not match the n-gram hashing of config.json")
        });
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn gather_on_the_pool_equals_row_by_row() {
        let (rows, dim) = (97u64, 5);
        let values: Vec<f32> = (0..rows as usize * dim)
            .map(|i| i as f32 * 0.25 - 3.0)
            .collect();
        let split = 40;
        let parts = [(0, 0..split), (split as u64, split..rows as usize)]
            .into_iter()
            .map(|(start, r)| TablePart {
                start,
                weight: HostTensor::from_f32(
                    "part",
                    vec![r.len(), dim],
                    &values[r.start * dim..r.end * dim],
                ),
                fp8: None,
            })
            .collect();
        let table = NgramTable { parts, rows, dim };
        // Enough ids for the pool path, and few enough for the caller's.
        for n in [3 * GATHER_ROWS_PER_TASK + 7, 16] {
            let ids: Vec<u64> = (0..n as u64).map(|i| i * 7919 % rows).collect();
            let mut got = vec![0f32; n * dim];
            table.gather(&ids, &mut got);
            for (id, row) in ids.iter().zip(got.chunks_exact(dim)) {
                let at = *id as usize * dim;
                assert_eq!(row, &values[at..at + dim], "row {id}");
            }
        }
    }

    #[test]
    fn primes_are_consecutive_per_layer() {
        assert_eq!(head_vocab_sizes(50, 4, 0), vec![53, 59, 61, 67]);
        assert_eq!(head_vocab_sizes(50, 2, 1), vec![61, 67]);
        assert_eq!(head_vocab_sizes(2, 3, 0), vec![2, 3, 5]);
    }

    #[test]
    fn context_carries_across_calls_and_eos_restarts() {
        let c = PleConfig {
            layers: vec![0],
            embed_dim: 8,
            conv_kernel_size: 4,
            ngram_size: 3,
            heads_per_ngram: 2,
            ngram_vocab_size_base: 50,
            make_ngram_vocab_size_divisible_by: 8,
            seed: 1234,
            split_ngram_parts: 2,
            eos_token_id: 2,
        };
        let h = NgramHasher::new(&c, 100, 0);
        let tokens = [5, 9, 2, 7, 8, 11];
        let mut whole_ctx = vec![2, 2];
        let whole = h.ids(&mut whole_ctx, &tokens);
        let mut ctx = vec![2, 2];
        let mut parts = h.ids(&mut ctx, &tokens[..1]);
        parts.extend(h.ids(&mut ctx, &tokens[1..4]));
        parts.extend(h.ids(&mut ctx, &tokens[4..]));
        assert_eq!(whole, parts);
        assert_eq!(ctx, vec![8, 11]);
        // After the eos (token 2), token 7 hashes like a sequence start: same ids as a lone 7.
        let mut fresh = vec![2, 2];
        assert_eq!(h.ids(&mut fresh, &[7]), whole[3 * 4..4 * 4].to_vec());
    }
}
