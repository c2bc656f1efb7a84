//! The backend boundary: the small set of ops every model definition is written in.
//!
//! A model file (`model/*.rs`) never touches memory directly; it calls these ops on
//! [`Backend::Act`] (activations, a row-major `[rows, cols]` f32 matrix) and weights uploaded
//! through [`Backend::matrix`] / [`Backend::vector`]. The CPU backend (`backend/cpu`) is the
//! clear, tested reference; the CUDA backend implements the same trait, and tests hold the two
//! together.
//!
//! Rows are tokens. A batch concatenates the rows of several sequences; ops that mix tokens
//! (attention, causal conv, the delta rule) are called once per sequence on its rows, the
//! others on the whole batch at once.

pub mod cpu;

use crate::tensor::HostTensor;
use anyhow::Result;
use std::ops::Range;

/// How an RMSNorm applies its weight.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum NormScale {
    /// `x̂ · (1 + w)`: Qwen3.5's zero-centred norms (weights stored as offsets from 1).
    OnePlus,
    /// `x̂ · w`: plain RMSNorm (the GDN gated norm).
    Plain,
}

/// Which algorithm the gated delta rule runs; both give the same result.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DeltaRuleMode {
    /// Chunks of 64 tokens with the UT transform (prefill).
    Chunked,
    /// One token at a time (decode).
    Recurrent,
}

/// Shapes of one gated-delta-rule call.
#[derive(Debug, Clone, Copy)]
pub struct DeltaRuleShape {
    pub num_k_heads: usize,
    pub num_v_heads: usize,
    pub k_head_dim: usize,
    pub v_head_dim: usize,
}

/// Shapes of one attention call.
#[derive(Debug, Clone, Copy)]
pub struct AttentionShape {
    pub num_heads: usize,
    pub num_kv_heads: usize,
    pub head_dim: usize,
    pub scale: f32,
}

pub trait Backend: Send + Sync + 'static {
    /// Activations: `[rows, cols]` f32, row-major.
    type Act: Clone + Send + Sync;
    /// A weight matrix `[out, in]` (linear layers, embeddings) in the backend's layout.
    type Matrix: Send + Sync;
    /// A parameter vector (norm weights, conv taps, per-head constants), f32.
    type Vector: Send + Sync;

    fn name(&self) -> String;

    // --- weights and transfers ---
    /// Uploads a 2-D float tensor `[out, in]`.
    fn matrix(&self, t: &HostTensor) -> Result<Self::Matrix>;
    fn vector(&self, values: &[f32]) -> Result<Self::Vector>;
    fn from_host(&self, rows: usize, cols: usize, data: &[f32]) -> Self::Act;
    fn to_host(&self, x: &Self::Act) -> Vec<f32>;
    fn zeros(&self, rows: usize, cols: usize) -> Self::Act;
    /// `(rows, cols)` of an activation.
    fn shape(&self, x: &Self::Act) -> (usize, usize);

    // --- layout ---
    /// A copy of rows `range`.
    fn rows(&self, x: &Self::Act, range: Range<usize>) -> Self::Act;
    /// A copy of columns `range`.
    fn cols(&self, x: &Self::Act, range: Range<usize>) -> Self::Act;
    /// Rows of all parts, in order (all with the same column count).
    fn cat_rows(&self, parts: &[Self::Act]) -> Self::Act;
    /// Appends `src`'s rows to `dst` (KV caches grow this way).
    fn append_rows(&self, dst: &mut Self::Act, src: &Self::Act);
    /// Keeps only the first `rows` rows (rolls a cache back).
    fn truncate_rows(&self, x: &mut Self::Act, rows: usize);

    // --- dense math ---
    /// Rows of `table` selected by `ids`.
    fn embedding(&self, table: &Self::Matrix, ids: &[u32]) -> Self::Act;
    /// `x · wᵀ`: `[n, in] × [out, in]ᵀ → [n, out]`.
    fn linear(&self, x: &Self::Act, w: &Self::Matrix) -> Self::Act;
    fn add_assign(&self, x: &mut Self::Act, y: &Self::Act);
    /// RMSNorm over each consecutive group of `group` columns (`group == cols` for a whole row;
    /// the head dimension for per-head q/k norms), weight of length `group`.
    fn rms_norm(&self, x: &Self::Act, w: &Self::Vector, eps: f32, scale: NormScale, group: usize) -> Self::Act;
    /// GDN output norm: `rms_norm(x) · w · silu(gate)` per group of `group` columns.
    fn rms_norm_gated(&self, x: &Self::Act, gate: &Self::Act, w: &Self::Vector, eps: f32, group: usize) -> Self::Act;
    /// `silu(gate) · up`.
    fn silu_mul(&self, gate: &Self::Act, up: &Self::Act) -> Self::Act;
    /// `x · sigmoid(gate)`.
    fn sigmoid_gate(&self, x: &Self::Act, gate: &Self::Act) -> Self::Act;
    /// Rotates the first `rotary_dim` dims of every head in place (rotate-half convention);
    /// row `r` is at position `positions[r]`.
    fn rope(&self, x: &mut Self::Act, positions: &[usize], head_dim: usize, rotary_dim: usize, inv_freq: &[f32]);

    // --- per-sequence ops ---
    /// Causal softmax attention of one sequence's new queries `q` `[n, heads·d]` over its whole
    /// cache `k`, `v` `[past + n, kv_heads·d]`; query row `i` sits at position `past + i`.
    fn attention(&self, q: &Self::Act, k: &Self::Act, v: &Self::Act, past: usize, shape: AttentionShape) -> Self::Act;
    /// Depthwise causal conv (kernel `K` = `weight.cols`) with SiLU over one sequence's rows;
    /// `state` `[K-1, channels]` holds the previous inputs and is updated.
    fn causal_conv1d_silu(&self, x: &Self::Act, state: &mut Self::Act, weight: &Self::Matrix) -> Self::Act;
    /// GDN gates from the `a` and `b` projections: `g = -exp(A_log)·softplus(a + dt_bias)`,
    /// `beta = sigmoid(b)`, both `[n, v_heads]`.
    fn delta_rule_gates(&self, a: &Self::Act, b: &Self::Act, a_log: &Self::Vector, dt_bias: &Self::Vector) -> (Self::Act, Self::Act);
    /// The gated delta rule over one sequence: q, k `[n, k_heads·dk]` (L2-normalised inside),
    /// v `[n, v_heads·dv]`, g and beta `[n, v_heads]`; `state` `[v_heads·dk, dv]` is updated.
    /// Returns `[n, v_heads·dv]`.
    #[allow(clippy::too_many_arguments)]
    fn gated_delta_rule(
        &self,
        q: &Self::Act,
        k: &Self::Act,
        v: &Self::Act,
        g: &Self::Act,
        beta: &Self::Act,
        state: &mut Self::Act,
        shape: DeltaRuleShape,
        mode: DeltaRuleMode,
    ) -> Self::Act;
}
