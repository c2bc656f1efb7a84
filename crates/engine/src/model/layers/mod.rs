//! Building blocks shared by the model files: weight loading helpers, the batch [`Span`], and
//! the Flash-Next blocks (QSA, sparse MoE, hyper-connections, PLE) next to the Gated DeltaNet,
//! gated attention and SwiGLU MLP they share with the dense model.
//!
//! Each block loads its weights from a checkpoint prefix and runs on a batch whose rows are the
//! concatenated new tokens of several sequences; blocks that mix tokens take the per-sequence
//! [`Span`]s and states and call the backend once per sequence.

pub mod attention;
pub mod gdn;
pub mod hyper;
pub mod mlp;
pub mod moe;
pub mod ple;

use crate::backend::Backend;
use crate::checkpoint::Checkpoint;
use crate::tensor::HostTensor;
use anyhow::{bail, Context, Result};
use std::borrow::Cow;

/// Where the text model's tensors live: `model.` (a causal-LM export) or
/// `model.language_model.` (the published multimodal checkpoints).
pub fn text_prefix(ck: &Checkpoint) -> &'static str {
    if ck
        .weights
        .contains("model.language_model.embed_tokens.weight")
    {
        "model.language_model."
    } else {
        "model."
    }
}

/// Reads a float tensor and checks its shape against the config.
pub fn tensor(ck: &Checkpoint, name: &str, shape: &[usize]) -> Result<HostTensor> {
    let t = ck.weights.get(name)?;
    t.expect_shape(shape)
        .with_context(|| match ck.weights.file_of(name) {
            Some(f) => format!("in {}", f.display()),
            None => String::new(),
        })?;
    if !t.dtype.is_float() {
        bail!(
            "tensor {name} has dtype {}; expected F32, F16 or BF16",
            t.dtype
        );
    }
    Ok(t)
}

pub fn vector<B: Backend>(b: &B, ck: &Checkpoint, name: &str, len: usize) -> Result<B::Vector> {
    b.vector(&tensor(ck, name, &[len])?.to_f32()?)
}

/// A `(1 + w)` norm weight that spans several streams, as a `[1, len]` row for
/// [`Backend::scale_cols`].
pub fn one_plus_row<B: Backend>(b: &B, ck: &Checkpoint, name: &str, len: usize) -> Result<B::Act> {
    let w: Vec<f32> = tensor(ck, name, &[len])?
        .to_f32()?
        .iter()
        .map(|w| 1.0 + w)
        .collect();
    Ok(b.from_host(1, len, &w))
}

/// Rows of one sequence inside a batch.
#[derive(Debug, Clone, Copy)]
pub struct Span {
    pub start: usize,
    pub len: usize,
    /// Tokens already in the sequence before this batch.
    pub past: usize,
}

impl Span {
    pub fn rows(&self) -> std::ops::Range<usize> {
        self.start..self.start + self.len
    }
}

/// Rows `range` of `x`: borrowed when they are all of its rows (a batch of one sequence, as in
/// batch-1 decode), else copied.
pub fn rows_of<'a, B: Backend>(
    b: &B,
    x: &'a B::Act,
    range: std::ops::Range<usize>,
) -> Cow<'a, B::Act> {
    if range.start == 0 && range.end == b.shape(x).0 {
        Cow::Borrowed(x)
    } else {
        Cow::Owned(b.rows(x, range))
    }
}

/// The per-sequence outputs as one batch: the one output itself when there is one sequence.
pub fn join_rows<B: Backend>(b: &B, mut parts: Vec<B::Act>) -> B::Act {
    match parts.len() {
        1 => parts.pop().expect("one part"),
        _ => b.cat_rows(&parts),
    }
}

/// RMSNorm over groups of `group` columns whose `(1 + w)` weight spans the whole row
/// (`scale` `[1, cols]`): the normalisation with a zero offset, then the per-column scale.
pub struct WideNorm<B: Backend> {
    zero: B::Vector,
    scale: B::Act,
    group: usize,
    eps: f32,
}

impl<B: Backend> WideNorm<B> {
    pub fn load(
        b: &B,
        ck: &Checkpoint,
        name: &str,
        cols: usize,
        group: usize,
        eps: f32,
    ) -> Result<Self> {
        Ok(WideNorm {
            zero: b.vector(&vec![0.0; group])?,
            scale: one_plus_row(b, ck, name, cols)?,
            group,
            eps,
        })
    }

    pub fn forward(&self, b: &B, x: &B::Act) -> B::Act {
        b.wide_rms_norm(x, &self.zero, &self.scale, self.eps, self.group)
    }
}
