//! Gated DeltaNet (linear attention with a recurrent state).

use super::{join_rows, rows_of, tensor, vector, Span};
use crate::backend::{gdn_output_norm, Backend, DeltaRuleMode, DeltaRuleShape};
use crate::checkpoint::Checkpoint;
use crate::config::{GateActivation, TextConfig};
use crate::tensor::HostTensor;
use anyhow::Result;

/// One sequence's GDN state: conv history `[K-1, conv_dim]` and recurrent state
/// `[v_heads·dk, dv]` (f32).
pub struct LinearState<B: Backend> {
    pub conv: B::Act,
    pub recurrent: B::Act,
}

impl<B: Backend> Clone for LinearState<B> {
    fn clone(&self) -> Self {
        LinearState {
            conv: self.conv.clone(),
            recurrent: self.recurrent.clone(),
        }
    }
}

impl<B: Backend> LinearState<B> {
    pub fn new(b: &B, c: &TextConfig) -> Self {
        LinearState {
            conv: b.zeros(c.linear_conv_kernel_dim - 1, c.linear_conv_dim()),
            recurrent: b.zeros(
                c.linear_num_value_heads * c.linear_key_head_dim,
                c.linear_value_head_dim,
            ),
        }
    }
    pub fn bytes(&self, b: &B) -> usize {
        let (r, c) = b.shape(&self.conv);
        let (r2, c2) = b.shape(&self.recurrent);
        (r * c + r2 * c2) * 4
    }
}

pub struct GatedDeltaNet<B: Backend> {
    /// Fused `in_proj_qkv ‖ in_proj_z ‖ in_proj_b ‖ in_proj_a`.
    in_proj: B::Matrix,
    /// Depthwise conv taps `[conv_dim, K]`.
    conv1d: B::Matrix,
    a_log: B::Vector,
    dt_bias: B::Vector,
    norm: B::Vector,
    out_proj: B::Matrix,
    shape: DeltaRuleShape,
    conv_dim: usize,
    eps: f32,
    /// Activation of the output gate `z` (silu for Qwen3.8-27B, sigmoid for Flash-Next).
    gate: GateActivation,
}

impl<B: Backend> GatedDeltaNet<B> {
    pub fn load(
        b: &B,
        ck: &Checkpoint,
        p: &str,
        c: &TextConfig,
        gate: GateActivation,
    ) -> Result<Self> {
        let h = c.hidden_size;
        let (conv_dim, vd, nv) = (
            c.linear_conv_dim(),
            c.linear_value_dim(),
            c.linear_num_value_heads,
        );
        let parts = [
            tensor(ck, &format!("{p}in_proj_qkv.weight"), &[conv_dim, h])?,
            tensor(ck, &format!("{p}in_proj_z.weight"), &[vd, h])?,
            tensor(ck, &format!("{p}in_proj_b.weight"), &[nv, h])?,
            tensor(ck, &format!("{p}in_proj_a.weight"), &[nv, h])?,
        ];
        let k = c.linear_conv_kernel_dim;
        let conv = tensor(ck, &format!("{p}conv1d.weight"), &[conv_dim, 1, k])?
            .reshaped(vec![conv_dim, k])?;
        Ok(GatedDeltaNet {
            in_proj: b.matrix(&HostTensor::concat_rows(&format!("{p}in_proj"), &parts)?)?,
            conv1d: b.matrix(&conv)?,
            a_log: vector(b, ck, &format!("{p}A_log"), nv)?,
            dt_bias: vector(b, ck, &format!("{p}dt_bias"), nv)?,
            norm: vector(b, ck, &format!("{p}norm.weight"), c.linear_value_head_dim)?,
            out_proj: b.matrix(&tensor(ck, &format!("{p}out_proj.weight"), &[h, vd])?)?,
            shape: DeltaRuleShape {
                num_k_heads: c.linear_num_key_heads,
                num_v_heads: nv,
                k_head_dim: c.linear_key_head_dim,
                v_head_dim: c.linear_value_head_dim,
            },
            conv_dim,
            eps: c.rms_norm_eps as f32,
            gate,
        })
    }

    pub fn forward(
        &self,
        b: &B,
        x: &B::Act,
        spans: &[Span],
        states: &mut [&mut LinearState<B>],
    ) -> B::Act {
        let s = self.shape;
        let vd = s.num_v_heads * s.v_head_dim;
        let nv = s.num_v_heads;
        // 1. projections of the whole batch
        let proj = b.linear(x, &self.in_proj);
        if let ([span], [state]) = (spans, &mut *states) {
            if span.len == 1 && b.shape(&proj).0 == 1 {
                return self.decode_one(b, &proj, state);
            }
        }
        let [mixed_qkv, z, beta_in, a_in] = b.split_cols(&proj, [self.conv_dim, vd, nv, nv]);
        let (g, beta) = b.delta_rule_gates(&a_in, &beta_in, &self.a_log, &self.dt_bias);
        // 2. per sequence: causal conv, then the gated delta rule on its packed `q ‖ k ‖ v`
        //    output, each carrying its state
        let mut outs = Vec::with_capacity(spans.len());
        for (span, state) in spans.iter().zip(states.iter_mut()) {
            let rows = span.rows();
            let qkv = b.causal_conv1d_silu(
                &rows_of(b, &mixed_qkv, rows.clone()),
                &mut state.conv,
                &self.conv1d,
            );
            let mode = if span.len == 1 {
                DeltaRuleMode::Recurrent
            } else {
                DeltaRuleMode::Chunked
            };
            outs.push(b.gated_delta_rule_packed(
                &qkv,
                &rows_of(b, &g, rows.clone()),
                &rows_of(b, &beta, rows),
                &mut state.recurrent,
                s,
                mode,
            ));
        }
        // 3. gated RMSNorm per value head (`norm(x) · w · act(z)`), output projection
        let core = join_rows(b, outs);
        self.output(b, &core, &z)
    }

    /// One sequence's one new token: the split, conv and gates in one backend op
    /// (`Backend::gdn_decode_inputs`), the delta rule in its recurrent form with the output
    /// norm (`Backend::gated_delta_rule_normed`).
    fn decode_one(&self, b: &B, proj: &B::Act, state: &mut LinearState<B>) -> B::Act {
        let s = self.shape;
        let [qkv, z, g, beta] = b.gdn_decode_inputs(
            proj,
            &mut state.conv,
            &self.conv1d,
            &self.a_log,
            &self.dt_bias,
            self.conv_dim,
            s.num_v_heads * s.v_head_dim,
        );
        let normed = b.gated_delta_rule_normed(
            &qkv,
            &g,
            &beta,
            &mut state.recurrent,
            s,
            &z,
            &self.norm,
            self.eps,
            self.gate,
        );
        b.linear(&normed, &self.out_proj)
    }

    /// The gated RMSNorm per value head (`norm(x) · w · act(z)`), then the output projection.
    fn output(&self, b: &B, core: &B::Act, z: &B::Act) -> B::Act {
        let normed = gdn_output_norm(
            b,
            core,
            z,
            &self.norm,
            self.eps,
            self.shape.v_head_dim,
            self.gate,
        );
        b.linear(&normed, &self.out_proj)
    }
}
