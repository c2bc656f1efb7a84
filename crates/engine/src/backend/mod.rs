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
#[cfg(feature = "cuda")]
pub mod cuda;

use crate::config::GateActivation;
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

/// [`Backend::argmax_rows`] on the host: the rows read back, each scanned by
/// [`crate::sampling::argmax`].
pub fn argmax_rows_on_host<B: Backend + ?Sized>(b: &B, x: &B::Act, limit: usize) -> Vec<u32> {
    let (rows, cols) = b.shape(x);
    if cols == 0 {
        return vec![0; rows];
    }
    b.to_host(x)
        .chunks(cols)
        .map(|row| crate::sampling::argmax(&row[..limit.min(cols)]))
        .collect()
}

/// The GDN output norm per value head of `v_head_dim` columns: `rms_norm(core) · w · act(z)`,
/// with the gate's activation silu ([`Backend::rms_norm_gated`]) or sigmoid (a plain
/// [`Backend::rms_norm`], then [`Backend::sigmoid_gate`]).
pub fn gdn_output_norm<B: Backend + ?Sized>(
    b: &B,
    core: &B::Act,
    z: &B::Act,
    w: &B::Vector,
    eps: f32,
    v_head_dim: usize,
    gate: GateActivation,
) -> B::Act {
    match gate {
        GateActivation::Silu => b.rms_norm_gated(core, z, w, eps, v_head_dim),
        GateActivation::Sigmoid => {
            b.sigmoid_gate(&b.rms_norm(core, w, eps, NormScale::Plain, v_head_dim), z)
        }
    }
}

/// [`Backend::attention_inputs`] from the plain ops: split the projection, norm and rotate q
/// and k, append k and v.
#[allow(clippy::too_many_arguments)]
pub fn attention_inputs_composed<B: Backend>(
    b: &B,
    qkv: &B::Act,
    s: AttentionShape,
    [q_norm, k_norm]: [&B::Vector; 2],
    eps: f32,
    positions: &[usize],
    rotary_dim: usize,
    inv_freq: &[f32],
    [k_cache, v_cache]: [&mut B::Act; 2],
) -> (B::Act, B::Act) {
    let (qd, kvd) = (s.num_heads * s.head_dim, s.num_kv_heads * s.head_dim);
    let [q_raw, gate, k_raw, v] = b.split_cols(qkv, [qd, qd, kvd, kvd]);
    let norm_rope = |raw: &B::Act, w: &B::Vector| {
        b.rms_norm_rope(
            raw,
            w,
            eps,
            NormScale::OnePlus,
            positions,
            s.head_dim,
            rotary_dim,
            inv_freq,
        )
    };
    let (q, k) = (norm_rope(&q_raw, q_norm), norm_rope(&k_raw, k_norm));
    b.append_rows(k_cache, &k);
    b.append_rows(v_cache, &v);
    (q, gate)
}

/// Shapes of one attention call.
#[derive(Debug, Clone, Copy)]
pub struct AttentionShape {
    pub num_heads: usize,
    pub num_kv_heads: usize,
    pub head_dim: usize,
    pub scale: f32,
}

/// Shapes of one Qwen Sparse Attention call: the indexer heads and the token budget.
#[derive(Debug, Clone, Copy)]
pub struct QsaShape {
    pub index_heads: usize,
    pub index_head_dim: usize,
    /// Blocks each query selects (`budget / compress_ratio`).
    pub block_topk: usize,
    pub compress_ratio: usize,
}

/// Router decisions for a batch: row `r` goes to experts `experts[r·k..(r+1)·k]` with `weights`.
#[derive(Debug, Clone, PartialEq)]
pub struct MoeRouting {
    pub top_k: usize,
    pub experts: Vec<u32>,
    pub weights: Vec<f32>,
}

/// One routed expert: fused `gate ‖ up` `[2I, H]` and `down` `[H, I]`.
pub struct ExpertMatrices<M> {
    pub gate_up: M,
    pub down: M,
}

/// Host memory page-locked for a backend's copies ([`Backend::pin_host`]); unpinned when
/// dropped.
pub struct HostPin {
    bytes: usize,
    _guard: Box<dyn Send + Sync>,
}

impl HostPin {
    /// A pin of `bytes` bytes that `guard` undoes when dropped.
    pub fn new(bytes: usize, guard: Box<dyn Send + Sync>) -> HostPin {
        HostPin {
            bytes,
            _guard: guard,
        }
    }
    pub fn bytes(&self) -> usize {
        self.bytes
    }
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
    /// Uploads a quantized matrix `[rows, cols]`: `blocks` holds each row's `format` blocks in
    /// order (`rows · format.row_bytes(cols)` bytes) and every weight is scaled by `multiplier`
    /// (a tensor-wide scale such as NVFP4's `weight_scale_2`; 1 when there is none). The default
    /// dequantizes to f32 on the host and calls [`Backend::matrix`]; a backend that multiplies
    /// quantized blocks directly keeps them as they are.
    fn quant_matrix(
        &self,
        format: cpu::experts::format::RowFormat,
        rows: usize,
        cols: usize,
        blocks: &[u8],
        multiplier: f32,
    ) -> Result<Self::Matrix> {
        let values = dequantize_matrix(format, rows, cols, blocks, multiplier)?;
        self.matrix(&HostTensor::from_f32(
            &format!("{} matrix", format.name()),
            vec![rows, cols],
            &values,
        ))
    }
    /// Page-locks host memory the backend copies from often (the host expert store) so the
    /// copies run as DMA at full link speed (CUDA: `cuMemHostRegister`). `Ok(None)` where the
    /// backend gains nothing from it (the CPU backend).
    ///
    /// # Safety
    /// `bytes` must stay allocated and in place until the returned pin is dropped.
    unsafe fn pin_host(&self, bytes: &[u8]) -> Result<Option<HostPin>> {
        let _ = bytes;
        Ok(None)
    }
    // Takes `self` because the backend owns the device the activation is created on.
    #[allow(clippy::wrong_self_convention)]
    fn from_host(&self, rows: usize, cols: usize, data: &[f32]) -> Self::Act;
    /// Like [`Backend::from_host`], with room for `capacity ≥ rows` rows so that
    /// [`Backend::append_rows`] grows it in place (a KV cache restored from the prefix cache).
    #[allow(clippy::wrong_self_convention)]
    fn from_host_with_capacity(
        &self,
        rows: usize,
        cols: usize,
        capacity: usize,
        data: &[f32],
    ) -> Self::Act {
        let _ = capacity;
        self.from_host(rows, cols, data)
    }
    fn to_host(&self, x: &Self::Act) -> Vec<f32>;
    /// Each row's greedy pick among its first `limit` values: the first index of the largest
    /// value above −∞, NaNs never winning, 0 where there is none ([`crate::sampling::argmax`]).
    /// The default reads the rows back; a device backend picks on the device and reads back
    /// one index a row instead of the vocabulary's logits.
    fn argmax_rows(&self, x: &Self::Act, limit: usize) -> Vec<u32> {
        argmax_rows_on_host(self, x, limit)
    }
    /// Starts the work queued so far without waiting for it. A backend that records work
    /// before launching it (CUDA graphs) launches the recording here; call it before long
    /// host work that the device should overlap.
    fn submit(&self) {}
    fn zeros(&self, rows: usize, cols: usize) -> Self::Act;
    /// `(rows, cols)` of an activation.
    fn shape(&self, x: &Self::Act) -> (usize, usize);

    // --- layout ---
    /// A copy of rows `range`.
    fn rows(&self, x: &Self::Act, range: Range<usize>) -> Self::Act;
    /// A copy of columns `range`.
    fn cols(&self, x: &Self::Act, range: Range<usize>) -> Self::Act;
    /// Consecutive column pieces from column 0: piece `i` is `widths[i]` columns wide (the
    /// widths may sum to less than `x`'s columns). A fused projection's outputs are split this
    /// way; a backend can do it in one pass instead of one copy per piece.
    fn split_cols<const N: usize>(&self, x: &Self::Act, widths: [usize; N]) -> [Self::Act; N] {
        let mut start = 0;
        widths.map(|w| {
            start += w;
            self.cols(x, start - w..start)
        })
    }
    /// Rows of all parts, in order (all with the same column count).
    fn cat_rows(&self, parts: &[Self::Act]) -> Self::Act;
    /// Appends `src`'s rows to `dst` (KV caches grow this way).
    fn append_rows(&self, dst: &mut Self::Act, src: &Self::Act);
    /// Keeps only the first `rows` rows (rolls a cache back).
    fn truncate_rows(&self, x: &mut Self::Act, rows: usize);

    // --- dense math ---
    /// Rows of `table` selected by `ids`.
    fn embedding(&self, table: &Self::Matrix, ids: &[u32]) -> Self::Act;
    /// Rows of `table` selected by `ids`, each repeated `copies` times along the columns:
    /// `[n, copies·cols]`. Hyper-connection models start every residual stream from the same
    /// embedding; a backend with its own memory overrides this to repeat there (at an 8K
    /// prefill the host round trip moves 84 MB down and 335 MB back up).
    fn embedding_repeated(&self, table: &Self::Matrix, ids: &[u32], copies: usize) -> Self::Act {
        let rows = self.embedding(table, ids);
        let (_, cols) = self.shape(&rows);
        let emb = self.to_host(&rows);
        let mut repeated = Vec::with_capacity(emb.len() * copies);
        for row in emb.chunks_exact(cols.max(1)) {
            for _ in 0..copies {
                repeated.extend_from_slice(row);
            }
        }
        self.from_host(ids.len(), copies * cols, &repeated)
    }
    /// `x · wᵀ`: `[n, in] × [out, in]ᵀ → [n, out]`.
    fn linear(&self, x: &Self::Act, w: &Self::Matrix) -> Self::Act;
    fn add_assign(&self, x: &mut Self::Act, y: &Self::Act);
    /// RMSNorm over each consecutive group of `group` columns (`group == cols` for a whole row;
    /// the head dimension for per-head q/k norms), weight of length `group`.
    fn rms_norm(
        &self,
        x: &Self::Act,
        w: &Self::Vector,
        eps: f32,
        scale: NormScale,
        group: usize,
    ) -> Self::Act;
    /// GDN output norm: `rms_norm(x) · w · silu(gate)` per group of `group` columns.
    fn rms_norm_gated(
        &self,
        x: &Self::Act,
        gate: &Self::Act,
        w: &Self::Vector,
        eps: f32,
        group: usize,
    ) -> Self::Act;
    /// `silu(gate) · up`.
    fn silu_mul(&self, gate: &Self::Act, up: &Self::Act) -> Self::Act;
    /// SwiGLU of a fused `gate ‖ up` projection `[n, 2I]`: `silu(gate) · up`, `[n, I]`.
    fn silu_mul_halves(&self, gate_up: &Self::Act) -> Self::Act {
        let inter = self.shape(gate_up).1 / 2;
        let [gate, up] = self.split_cols(gate_up, [inter, inter]);
        self.silu_mul(&gate, &up)
    }
    /// The residual add then the next norm: `x += y`, returns `rms_norm(x)` (see
    /// [`Backend::rms_norm`]). One pass over the row instead of two.
    fn add_rms_norm(
        &self,
        x: &mut Self::Act,
        y: &Self::Act,
        w: &Self::Vector,
        eps: f32,
        scale: NormScale,
        group: usize,
    ) -> Self::Act {
        self.add_assign(x, y);
        self.rms_norm(x, w, eps, scale, group)
    }
    /// `x · sigmoid(gate)`.
    fn sigmoid_gate(&self, x: &Self::Act, gate: &Self::Act) -> Self::Act;
    /// `x[r, ·] · sigmoid(logits[r, col])` for every row `r`: one gate logit per row over the
    /// whole row (the MoE shared expert's gate). The default broadcasts the column on the host;
    /// a backend that keeps work queued overrides it so that nothing waits for the device.
    fn sigmoid_gate_rows(&self, x: &Self::Act, logits: &Self::Act, col: usize) -> Self::Act {
        let (rows, cols) = self.shape(x);
        let logit = self.to_host(&self.cols(logits, col..col + 1));
        let gate: Vec<f32> = logit
            .iter()
            .flat_map(|&g| std::iter::repeat_n(g, cols))
            .collect();
        self.sigmoid_gate(x, &self.from_host(rows, cols, &gate))
    }
    /// Rotates the first `rotary_dim` dims of every head in place (rotate-half convention);
    /// row `r` is at position `positions[r]`.
    fn rope(
        &self,
        x: &mut Self::Act,
        positions: &[usize],
        head_dim: usize,
        rotary_dim: usize,
        inv_freq: &[f32],
    );

    /// One step's attention inputs from the fused projection `qkv` = [q ‖ gate ‖ k ‖ v]
    /// (`s.num_heads · d`, as many, `s.num_kv_heads · d`, as many columns): q and k normed per
    /// head (`NormScale::OnePlus`) and rotated, k and v appended to the caches. Returns
    /// (q, gate). The default composes the plain ops ([`attention_inputs_composed`]).
    #[allow(clippy::too_many_arguments)]
    fn attention_inputs(
        &self,
        qkv: &Self::Act,
        s: AttentionShape,
        norms: [&Self::Vector; 2],
        eps: f32,
        positions: &[usize],
        rotary_dim: usize,
        inv_freq: &[f32],
        caches: [&mut Self::Act; 2],
    ) -> (Self::Act, Self::Act)
    where
        Self: Sized,
    {
        attention_inputs_composed(
            self, qkv, s, norms, eps, positions, rotary_dim, inv_freq, caches,
        )
    }

    /// Per-head RMSNorm then RoPE (gated attention's q/k norms): [`Backend::rms_norm`] over
    /// groups of `head_dim`, rotated as [`Backend::rope`] does. One pass instead of two.
    #[allow(clippy::too_many_arguments)]
    fn rms_norm_rope(
        &self,
        x: &Self::Act,
        w: &Self::Vector,
        eps: f32,
        scale: NormScale,
        positions: &[usize],
        head_dim: usize,
        rotary_dim: usize,
        inv_freq: &[f32],
    ) -> Self::Act {
        let mut y = self.rms_norm(x, w, eps, scale, head_dim);
        self.rope(&mut y, positions, head_dim, rotary_dim, inv_freq);
        y
    }

    // --- per-sequence ops ---
    /// Causal softmax attention of one sequence's new queries `q` `[n, heads·d]` over its whole
    /// cache `k`, `v` `[past + n, kv_heads·d]`; query row `i` sits at position `past + i`.
    fn attention(
        &self,
        q: &Self::Act,
        k: &Self::Act,
        v: &Self::Act,
        past: usize,
        shape: AttentionShape,
    ) -> Self::Act;
    /// [`Backend::attention`] with the gated attention's output gate applied:
    /// `attention(q, k, v) · sigmoid(gate)`, `gate` shaped as the output. The default composes
    /// the two; a backend may gate the values where it writes them.
    fn attention_gated(
        &self,
        q: &Self::Act,
        k: &Self::Act,
        v: &Self::Act,
        past: usize,
        shape: AttentionShape,
        gate: &Self::Act,
    ) -> Self::Act {
        self.sigmoid_gate(&self.attention(q, k, v, past, shape), gate)
    }
    /// Depthwise causal conv (kernel `K` = `weight.cols`) with SiLU over one sequence's rows;
    /// `state` `[K-1, channels]` holds the previous inputs and is updated.
    fn causal_conv1d_silu(
        &self,
        x: &Self::Act,
        state: &mut Self::Act,
        weight: &Self::Matrix,
    ) -> Self::Act;
    /// The input side of a Gated DeltaNet layer for one decode row: `proj` (`[1, conv_dim +
    /// v_dim + 2·heads]`, the fused `qkv ‖ z ‖ b ‖ a` projection) split, the causal conv of its
    /// `qkv` part (carrying `conv_state`) and the gates from `a` and `b`. Returns
    /// `[conv output [1, conv_dim], z [1, v_dim], g [1, heads], beta [1, heads]]`. The default
    /// composes `split_cols`, `delta_rule_gates` and `causal_conv1d_silu`; a backend may do it
    /// in one pass (a decode step runs it 48 times on the 27B).
    #[allow(clippy::too_many_arguments)]
    fn gdn_decode_inputs(
        &self,
        proj: &Self::Act,
        conv_state: &mut Self::Act,
        conv_weight: &Self::Matrix,
        a_log: &Self::Vector,
        dt_bias: &Self::Vector,
        conv_dim: usize,
        v_dim: usize,
    ) -> [Self::Act; 4] {
        let heads = (self.shape(proj).1 - conv_dim - v_dim) / 2;
        let [qkv, z, b, a] = self.split_cols(proj, [conv_dim, v_dim, heads, heads]);
        let (g, beta) = self.delta_rule_gates(&a, &b, a_log, dt_bias);
        let conv = self.causal_conv1d_silu(&qkv, conv_state, conv_weight);
        [conv, z, g, beta]
    }
    /// GDN gates from the `a` and `b` projections: `g = -exp(A_log)·softplus(a + dt_bias)`,
    /// `beta = sigmoid(b)`, both `[n, v_heads]`.
    fn delta_rule_gates(
        &self,
        a: &Self::Act,
        b: &Self::Act,
        a_log: &Self::Vector,
        dt_bias: &Self::Vector,
    ) -> (Self::Act, Self::Act);
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

    /// [`Backend::gated_delta_rule`] on the packed conv output `qkv` `[n, 2·k_heads·dk +
    /// v_heads·dv]` (`q ‖ k ‖ v`), so that a backend can read the three in place.
    fn gated_delta_rule_packed(
        &self,
        qkv: &Self::Act,
        g: &Self::Act,
        beta: &Self::Act,
        state: &mut Self::Act,
        shape: DeltaRuleShape,
        mode: DeltaRuleMode,
    ) -> Self::Act {
        let kd = shape.num_k_heads * shape.k_head_dim;
        let vd = shape.num_v_heads * shape.v_head_dim;
        let [q, k, v] = self.split_cols(qkv, [kd, kd, vd]);
        self.gated_delta_rule(&q, &k, &v, g, beta, state, shape, mode)
    }

    /// A decode row's GDN core and output norm: [`Backend::gated_delta_rule_packed`] in its
    /// recurrent form, then [`gdn_output_norm`] with `z`, `w` and `gate`. The default
    /// composes the two; a backend may norm the rule's output before writing it (a 27B decode
    /// step runs this 48 times).
    #[allow(clippy::too_many_arguments)]
    fn gated_delta_rule_normed(
        &self,
        qkv: &Self::Act,
        g: &Self::Act,
        beta: &Self::Act,
        state: &mut Self::Act,
        shape: DeltaRuleShape,
        z: &Self::Act,
        w: &Self::Vector,
        eps: f32,
        gate: GateActivation,
    ) -> Self::Act {
        let core =
            self.gated_delta_rule_packed(qkv, g, beta, state, shape, DeltaRuleMode::Recurrent);
        gdn_output_norm(self, &core, z, w, eps, shape.v_head_dim, gate)
    }

    // --- Flash-Next (qwen4_exp_text) ops ---
    // Each has a default that runs the CPU reference on host copies, so a backend works before
    // it has its own kernel; the CPU backend overrides them without the copies.

    /// Multiplies every row by `scale` (`[1, cols]`), e.g. the per-column `(1 + w)` of the
    /// hyper-connection norms, whose weight spans all streams.
    fn scale_cols(&self, x: &Self::Act, scale: &Self::Act) -> Self::Act {
        let (rows, cols) = self.shape(x);
        self.from_host(
            rows,
            cols,
            &cpu::hyper::scale_cols(&self.to_host(x), &self.to_host(scale)),
        )
    }
    /// The hyper-connection norms: [`Backend::rms_norm`] over groups of `group` columns with a
    /// zero weight (`zero`: `group` zeros, as `(1 + 0)`), then [`Backend::scale_cols`] by the
    /// `(1 + w)` row `scale` (`[1, span]`), whose weight spans all streams (`span` a multiple of
    /// `group`, the row's columns a multiple of `span`). A backend may do both in one pass.
    fn wide_rms_norm(
        &self,
        x: &Self::Act,
        zero: &Self::Vector,
        scale: &Self::Act,
        eps: f32,
        group: usize,
    ) -> Self::Act {
        let normed = self.rms_norm(x, zero, eps, NormScale::OnePlus, group);
        self.scale_cols(&normed, scale)
    }
    /// `silu(x · scale)`.
    fn silu_scaled(&self, x: &Self::Act, scale: f32) -> Self::Act {
        let (rows, cols) = self.shape(x);
        self.from_host(
            rows,
            cols,
            &cpu::hyper::silu_scaled(&self.to_host(x), scale),
        )
    }
    /// `silu(x[:, cols] · scale)`: [`Backend::silu_scaled`] of a column window (a backend may
    /// read it in place instead of copying it out first).
    fn silu_scaled_cols(&self, x: &Self::Act, cols: Range<usize>, scale: f32) -> Self::Act {
        self.silu_scaled(&self.cols(x, cols), scale)
    }
    /// Hyper-connection read-out: the mean over `streams` of `sigmoid(mix) · normed`, both
    /// `[n, streams·h]`; returns `[n, h]`.
    fn hc_mix(&self, normed: &Self::Act, mix_logits: &Self::Act, streams: usize) -> Self::Act {
        let (rows, cols) = self.shape(normed);
        let out = cpu::hyper::hc_mix(
            &self.to_host(normed),
            &self.to_host(mix_logits),
            rows,
            cols / streams,
            streams,
        );
        self.from_host(rows, cols / streams, &out)
    }
    /// Hyper-connection write-back: `residual [n, s·h] + out [n, h] · 2·sigmoid(logit_s / s)` per
    /// stream `s`, with `inject_logits` `[n, s]`.
    fn hc_inject(
        &self,
        residual: &Self::Act,
        out: &Self::Act,
        inject_logits: &Self::Act,
        streams: usize,
    ) -> Self::Act {
        let (rows, cols) = self.shape(residual);
        let host = cpu::hyper::hc_inject(
            &self.to_host(residual),
            &self.to_host(out),
            &self.to_host(inject_logits),
            rows,
            cols / streams,
            streams,
        );
        self.from_host(rows, cols, &host)
    }
    /// [`Backend::hc_inject`] with the injection logits at columns `first_col..first_col + streams`
    /// of `logits` (a backend may read them in place).
    fn hc_inject_cols(
        &self,
        residual: &Self::Act,
        out: &Self::Act,
        logits: &Self::Act,
        first_col: usize,
        streams: usize,
    ) -> Self::Act {
        let inject = self.cols(logits, first_col..first_col + streams);
        self.hc_inject(residual, out, &inject, streams)
    }
    /// PLE gate: per stream `g = <key_s, query_s> / sqrt(h)`, signed square root, then
    /// `sigmoid(g) · value`; `key`, `query` `[n, s·h]`, `value` `[n, h]` → `[n, s·h]`.
    fn ple_gate(
        &self,
        key: &Self::Act,
        query: &Self::Act,
        value: &Self::Act,
        streams: usize,
    ) -> Self::Act {
        let (rows, cols) = self.shape(key);
        let host = cpu::hyper::ple_gate(
            &self.to_host(key),
            &self.to_host(query),
            &self.to_host(value),
            rows,
            cols / streams,
            streams,
        );
        self.from_host(rows, cols, &host)
    }
    /// Mean of each consecutive group of `group` rows: `[rows / group, cols]` (QSA key blocks).
    fn mean_pool_rows(&self, x: &Self::Act, group: usize) -> Self::Act {
        let (rows, cols) = self.shape(x);
        self.from_host(
            rows / group,
            cols,
            &cpu::qsa::mean_pool_rows(&self.to_host(x), cols, group),
        )
    }
    /// Qwen Sparse Attention of one sequence: each new query (at position `past + i`) attends to
    /// the `block_topk` complete key blocks its indexer query `index_q` `[n, index_heads·d]`
    /// scores highest against `block_keys` `[complete blocks, d]` (pooled, normed, rotated), plus
    /// the tail after the last complete block; exactly dense attention while the blocks fit.
    #[allow(clippy::too_many_arguments)]
    fn qsa_attention(
        &self,
        q: &Self::Act,
        k: &Self::Act,
        v: &Self::Act,
        index_q: &Self::Act,
        block_keys: &Self::Act,
        past: usize,
        shape: AttentionShape,
        qsa: QsaShape,
    ) -> Self::Act {
        let (n, _) = self.shape(q);
        let out = cpu::qsa::qsa_attention(
            &self.to_host(q),
            &self.to_host(k),
            &self.to_host(v),
            &self.to_host(index_q),
            &self.to_host(block_keys),
            n,
            past,
            shape,
            qsa,
        );
        self.from_host(n, shape.num_heads * shape.head_dim, &out)
    }
    /// MoE router: softmax over `logits` `[n, experts]`, the `top_k` largest, renormalised to sum
    /// to 1 when `normalize`.
    fn moe_route(&self, logits: &Self::Act, top_k: usize, normalize: bool) -> MoeRouting {
        let (_, experts) = self.shape(logits);
        cpu::moe::route(&self.to_host(logits), experts, top_k, normalize)
    }
    /// Whether [`Backend::moe_experts_interleaved`] is implemented: experts can then be copied
    /// from the CPU expert record layout as they are (gate and up rows alternating), one copy
    /// per matrix straight from the (page-locked) host store.
    fn takes_interleaved_experts(&self) -> bool {
        false
    }
    /// [`Backend::moe_experts`] over experts whose `gate_up` rows alternate gate 0, up 0,
    /// gate 1, … (`[2I, H]` as `I` pairs). `None` where the backend does not take that layout
    /// ([`Backend::takes_interleaved_experts`] is false).
    fn moe_experts_interleaved(
        &self,
        x: &Self::Act,
        routing: &MoeRouting,
        experts: &[ExpertMatrices<Self::Matrix>],
    ) -> Option<Self::Act> {
        let _ = (x, routing, experts);
        None
    }
    /// [`Backend::moe_route`] over the first `experts.len()` columns of `logits` (the router's
    /// output, which may carry more columns) and [`Backend::moe_experts`] on that routing, in
    /// one op that never reads the routing back; with `shared` (the shared expert's output)
    /// it also adds `shared · sigmoid(logits[:, experts.len()])`, Flash-Next's gated shared
    /// expert ([`Backend::sigmoid_gate_rows`] then [`Backend::add_assign`]). `None` where the
    /// backend cannot, and the caller routes on the host. A device backend thereby keeps a
    /// decode step free of a host round trip per MoE layer (48 a Flash-Next step).
    fn moe_routed_on_device(
        &self,
        x: &Self::Act,
        logits: &Self::Act,
        top_k: usize,
        normalize: bool,
        experts: &[ExpertMatrices<Self::Matrix>],
        shared: Option<&Self::Act>,
    ) -> Option<Self::Act> {
        let _ = (x, logits, top_k, normalize, experts, shared);
        None
    }
    /// Routed experts: row `r` gets `Σ_j w_j · down_e(silu(gate_e x) · up_e x)` over its routed
    /// experts `e`. The default runs each hit expert on its rows through [`Backend::linear`].
    fn moe_experts(
        &self,
        x: &Self::Act,
        routing: &MoeRouting,
        experts: &[ExpertMatrices<Self::Matrix>],
    ) -> Self::Act {
        let (rows, hidden) = self.shape(x);
        let mut out = vec![0f32; rows * hidden];
        for (e, rows_of_e) in cpu::moe::rows_per_expert(routing, experts.len())
            .iter()
            .enumerate()
        {
            if rows_of_e.is_empty() {
                continue;
            }
            let picked: Vec<Self::Act> = rows_of_e
                .iter()
                .map(|&(r, _)| self.rows(x, r..r + 1))
                .collect();
            let gu = self.linear(&self.cat_rows(&picked), &experts[e].gate_up);
            let act = self.silu_mul_halves(&gu);
            let y = self.to_host(&self.linear(&act, &experts[e].down));
            for (i, &(r, w)) in rows_of_e.iter().enumerate() {
                for (o, v) in out[r * hidden..(r + 1) * hidden]
                    .iter_mut()
                    .zip(&y[i * hidden..(i + 1) * hidden])
                {
                    *o += w * v;
                }
            }
        }
        self.from_host(rows, hidden, &out)
    }
}

/// Dequantizes a whole `[rows, cols]` matrix of `format` blocks to f32 (scaled by
/// `multiplier`), checking the byte count first.
pub fn dequantize_matrix(
    format: cpu::experts::format::RowFormat,
    rows: usize,
    cols: usize,
    blocks: &[u8],
    multiplier: f32,
) -> Result<Vec<f32>> {
    let row_bytes = format.row_bytes(cols)?;
    if blocks.len() != rows * row_bytes {
        anyhow::bail!(
            "{} matrix [{rows}, {cols}]: expected {} bytes ({row_bytes} per row), found {}",
            format.name(),
            rows * row_bytes,
            blocks.len()
        );
    }
    let mut values = vec![0f32; rows * cols];
    for (out, src) in values
        .chunks_exact_mut(cols)
        .zip(blocks.chunks_exact(row_bytes))
    {
        cpu::experts::format::dequantize_row_scalar(format, src, out);
        if multiplier != 1.0 {
            out.iter_mut().for_each(|v| *v *= multiplier);
        }
    }
    Ok(values)
}

#[cfg(test)]
mod tests {
    use super::cpu::experts::format::RowFormat;
    use super::cpu::experts::random_blocks;
    use super::*;

    fn ramp(n: usize, step: f32) -> Vec<f32> {
        (0..n).map(|i| (i as f32 * step).sin()).collect()
    }

    #[test]
    fn default_split_cols_takes_consecutive_pieces() {
        let be = cpu::CpuBackend::new();
        let data = ramp(3 * 10, 0.7);
        let x = be.from_host(3, 10, &data);
        let [a, b, c] = be.split_cols(&x, [4, 0, 5]);
        assert_eq!(be.shape(&b), (3, 0));
        for r in 0..3 {
            assert_eq!(a.data[r * 4..(r + 1) * 4], data[r * 10..r * 10 + 4]);
            assert_eq!(c.data[r * 5..(r + 1) * 5], data[r * 10 + 4..r * 10 + 9]);
        }
    }

    #[test]
    fn default_embedding_repeated_copies_each_row_along_the_columns() {
        let be = cpu::CpuBackend::new();
        let table = ramp(5 * 3, 0.4);
        let w = be
            .matrix(&crate::tensor::HostTensor::from_f32(
                "t",
                vec![5, 3],
                &table,
            ))
            .unwrap();
        let ids = [4, 0, 4, 2];
        let y = be.embedding_repeated(&w, &ids, 3);
        assert_eq!(be.shape(&y), (4, 9));
        for (r, &id) in ids.iter().enumerate() {
            let row = &table[id as usize * 3..id as usize * 3 + 3];
            for copy in 0..3 {
                assert_eq!(
                    y.data[r * 9 + copy * 3..r * 9 + copy * 3 + 3],
                    *row,
                    "{r} {copy}"
                );
            }
        }
        assert_eq!(be.shape(&be.embedding_repeated(&w, &[], 3)), (0, 9));
    }

    #[test]
    fn default_silu_mul_halves_is_swiglu_of_the_halves() {
        let be = cpu::CpuBackend::new();
        let data = ramp(2 * 6, 0.9);
        let y = be.silu_mul_halves(&be.from_host(2, 6, &data));
        assert_eq!(be.shape(&y), (2, 3));
        for r in 0..2 {
            for i in 0..3 {
                let (g, u) = (data[r * 6 + i], data[r * 6 + 3 + i]);
                let want = g / (1.0 + (-g).exp()) * u;
                assert!((y.data[r * 3 + i] - want).abs() <= 1e-6, "{r} {i}");
            }
        }
    }

    #[test]
    fn default_add_rms_norm_adds_in_place_then_norms() {
        let be = cpu::CpuBackend::new();
        let (xs, ys) = (ramp(2 * 8, 0.3), ramp(2 * 8, 1.1));
        let w = be.vector(&ramp(4, 0.5)).unwrap();
        let mut x = be.from_host(2, 8, &xs);
        let normed = be.add_rms_norm(
            &mut x,
            &be.from_host(2, 8, &ys),
            &w,
            1e-6,
            NormScale::OnePlus,
            4,
        );
        let sum: Vec<f32> = xs.iter().zip(&ys).map(|(a, b)| a + b).collect();
        assert_eq!(x.data, sum);
        for (gi, group) in sum.chunks_exact(4).enumerate() {
            let inv = 1.0 / (group.iter().map(|v| v * v).sum::<f32>() / 4.0 + 1e-6).sqrt();
            for (i, v) in group.iter().enumerate() {
                let want = v * inv * (1.0 + w[i]);
                assert!((normed.data[gi * 4 + i] - want).abs() <= 1e-5, "{gi} {i}");
            }
        }
    }

    #[test]
    fn default_rms_norm_rope_norms_each_head_then_rotates() {
        let be = cpu::CpuBackend::new();
        let (head_dim, rot, heads) = (8, 4, 2);
        let data = ramp(2 * heads * head_dim, 0.37);
        let w = ramp(head_dim, 0.8);
        let inv_freq = [1.0f32, 0.1];
        let positions = [3usize, 11];
        let x = be.from_host(2, heads * head_dim, &data);
        let y = be.rms_norm_rope(
            &x,
            &w,
            1e-6,
            NormScale::OnePlus,
            &positions,
            head_dim,
            rot,
            &inv_freq,
        );
        for (gi, group) in data.chunks_exact(head_dim).enumerate() {
            let inv = 1.0 / (group.iter().map(|v| v * v).sum::<f32>() / 8.0 + 1e-6).sqrt();
            let n: Vec<f32> = (0..head_dim)
                .map(|i| group[i] * inv * (1.0 + w[i]))
                .collect();
            let pos = positions[gi / heads] as f32;
            for i in 0..head_dim {
                let want = if i < rot / 2 {
                    let a = inv_freq[i] * pos;
                    n[i] * a.cos() - n[i + rot / 2] * a.sin()
                } else if i < rot {
                    let a = inv_freq[i - rot / 2] * pos;
                    n[i] * a.cos() + n[i - rot / 2] * a.sin()
                } else {
                    n[i]
                };
                let got = y.data[gi * head_dim + i];
                assert!(
                    (got - want).abs() <= 1e-5,
                    "group {gi} dim {i}: {got} vs {want}"
                );
            }
        }
    }

    #[test]
    fn default_packed_delta_rule_matches_separate_inputs() {
        let be = cpu::CpuBackend::new();
        let shape = DeltaRuleShape {
            num_k_heads: 1,
            num_v_heads: 2,
            k_head_dim: 4,
            v_head_dim: 3,
        };
        let (n, kd, vd) = (3, 4, 6);
        let qkv = ramp(n * (2 * kd + vd), 0.41);
        let cols = |c: std::ops::Range<usize>| {
            let piece: Vec<f32> = qkv
                .chunks_exact(2 * kd + vd)
                .flat_map(|row| row[c.clone()].to_vec())
                .collect();
            be.from_host(n, c.len(), &piece)
        };
        let g = be.from_host(
            n,
            2,
            &ramp(n * 2, 0.2)
                .iter()
                .map(|v| -v.abs())
                .collect::<Vec<_>>(),
        );
        let beta = be.from_host(
            n,
            2,
            &ramp(n * 2, 0.6).iter().map(|v| v.abs()).collect::<Vec<_>>(),
        );
        let mut s1 = be.from_host(2 * 4, 3, &ramp(24, 0.13));
        let mut s2 = s1.clone();
        let mode = DeltaRuleMode::Recurrent;
        let packed = be.gated_delta_rule_packed(
            &be.from_host(n, 2 * kd + vd, &qkv),
            &g,
            &beta,
            &mut s1,
            shape,
            mode,
        );
        let separate = be.gated_delta_rule(
            &cols(0..kd),
            &cols(kd..2 * kd),
            &cols(2 * kd..2 * kd + vd),
            &g,
            &beta,
            &mut s2,
            shape,
            mode,
        );
        assert_eq!(packed.data, separate.data);
        assert_eq!(s1.data, s2.data);
    }

    #[test]
    fn default_quant_matrix_multiplies_like_the_dequantized_matrix() {
        let be = cpu::CpuBackend::new();
        let (rows, cols) = (3, 256);
        for fmt in [
            RowFormat::Nvfp4,
            RowFormat::Ggml(crate::quant::GgmlType::Q8_0),
            RowFormat::Ggml(crate::quant::GgmlType::Iq3S),
        ] {
            let blocks = random_blocks(fmt, rows * cols / fmt.block_len(), 7);
            let w = be.quant_matrix(fmt, rows, cols, &blocks, 0.5).unwrap();
            let dense = dequantize_matrix(fmt, rows, cols, &blocks, 0.5).unwrap();
            let x: Vec<f32> = (0..cols).map(|i| (i as f32 * 0.37).sin()).collect();
            let y = be.to_host(&be.linear(&be.from_host(1, cols, &x), &w));
            for r in 0..rows {
                let want: f32 = dense[r * cols..(r + 1) * cols]
                    .iter()
                    .zip(&x)
                    .map(|(a, b)| a * b)
                    .sum();
                assert!(
                    (y[r] - want).abs() <= 1e-4 * (1.0 + want.abs()),
                    "{}",
                    fmt.name()
                );
            }
        }
        let err = be
            .quant_matrix(RowFormat::Nvfp4, 2, 64, &[0u8; 10], 1.0)
            .err()
            .unwrap()
            .to_string();
        assert!(err.contains("expected 72 bytes"), "{err}");
    }
}
