//! The CPU backend: the clear reference every other backend is tested against.
//!
//! Activations are plain `Vec<f32>` matrices; weights stay in the checkpoint's dtype (F32, F16
//! or BF16, borrowed from the memory map) and are converted inside the matmul. Matmuls,
//! attention heads and delta-rule heads run on the rayon pool.

pub mod attention;
pub mod delta_rule;
pub mod experts;
pub mod huge_pages;
pub mod hyper;
pub mod matmul;
pub mod moe;
pub mod ops;
pub mod qsa;
pub mod roofline;
pub mod simd;

use super::{
    AttentionShape, Backend, DeltaRuleMode, DeltaRuleShape, ExpertMatrices, MoeRouting, NormScale,
    QsaShape,
};
use crate::tensor::HostTensor;
use anyhow::Result;
pub use matmul::CpuMatrix;
use std::ops::Range;

/// A `[rows, cols]` f32 activation.
#[derive(Clone, Debug, PartialEq)]
pub struct CpuTensor {
    pub rows: usize,
    pub cols: usize,
    pub data: Vec<f32>,
}

impl CpuTensor {
    fn new(rows: usize, cols: usize, data: Vec<f32>) -> Self {
        debug_assert_eq!(rows * cols, data.len());
        CpuTensor { rows, cols, data }
    }
}

/// The CPU backend.
#[derive(Clone, Default)]
pub struct CpuBackend;

impl CpuBackend {
    pub fn new() -> Self {
        CpuBackend
    }
}

impl Backend for CpuBackend {
    type Act = CpuTensor;
    type Matrix = CpuMatrix;
    type Vector = Vec<f32>;

    fn name(&self) -> String {
        format!(
            "cpu ({}, {} threads)",
            simd::isa().name(),
            rayon::current_num_threads()
        )
    }

    fn matrix(&self, t: &HostTensor) -> Result<CpuMatrix> {
        CpuMatrix::from_host(t)
    }
    /// Kept in its format (dequantized row by row inside the matmul), never expanded to f32.
    fn quant_matrix(
        &self,
        format: experts::format::RowFormat,
        rows: usize,
        cols: usize,
        blocks: &[u8],
        multiplier: f32,
    ) -> Result<CpuMatrix> {
        CpuMatrix::from_quant_parts(format, cols, &[(rows, blocks, multiplier)])
    }
    fn vector(&self, values: &[f32]) -> Result<Vec<f32>> {
        Ok(values.to_vec())
    }
    fn from_host(&self, rows: usize, cols: usize, data: &[f32]) -> CpuTensor {
        assert_eq!(rows * cols, data.len());
        CpuTensor::new(rows, cols, data.to_vec())
    }
    fn from_host_with_capacity(
        &self,
        rows: usize,
        cols: usize,
        capacity: usize,
        data: &[f32],
    ) -> CpuTensor {
        assert_eq!(rows * cols, data.len());
        let mut v = Vec::with_capacity(capacity.max(rows) * cols);
        v.extend_from_slice(data);
        CpuTensor::new(rows, cols, v)
    }
    fn to_host(&self, x: &CpuTensor) -> Vec<f32> {
        x.data.clone()
    }
    fn zeros(&self, rows: usize, cols: usize) -> CpuTensor {
        CpuTensor::new(rows, cols, vec![0.0; rows * cols])
    }
    fn shape(&self, x: &CpuTensor) -> (usize, usize) {
        (x.rows, x.cols)
    }

    fn rows(&self, x: &CpuTensor, r: Range<usize>) -> CpuTensor {
        CpuTensor::new(
            r.len(),
            x.cols,
            x.data[r.start * x.cols..r.end * x.cols].to_vec(),
        )
    }
    fn cols(&self, x: &CpuTensor, c: Range<usize>) -> CpuTensor {
        let mut data = Vec::with_capacity(x.rows * c.len());
        for row in x.data.chunks_exact(x.cols) {
            data.extend_from_slice(&row[c.clone()]);
        }
        CpuTensor::new(x.rows, c.len(), data)
    }
    fn cat_rows(&self, parts: &[CpuTensor]) -> CpuTensor {
        let cols = parts.first().map_or(0, |p| p.cols);
        let mut data = Vec::with_capacity(parts.iter().map(|p| p.data.len()).sum());
        for p in parts {
            assert_eq!(p.cols, cols, "cat_rows: column counts differ");
            data.extend_from_slice(&p.data);
        }
        CpuTensor::new(data.len() / cols.max(1), cols, data)
    }
    fn append_rows(&self, dst: &mut CpuTensor, src: &CpuTensor) {
        assert_eq!(dst.cols, src.cols, "append_rows: column counts differ");
        dst.data.extend_from_slice(&src.data);
        dst.rows += src.rows;
    }
    fn truncate_rows(&self, x: &mut CpuTensor, rows: usize) {
        if rows < x.rows {
            x.data.truncate(rows * x.cols);
            x.rows = rows;
        }
    }

    fn embedding(&self, table: &CpuMatrix, ids: &[u32]) -> CpuTensor {
        let h = table.cols;
        let mut data = vec![0f32; ids.len() * h];
        for (i, &id) in ids.iter().enumerate() {
            table.row_f32(id as usize, &mut data[i * h..(i + 1) * h]);
        }
        CpuTensor::new(ids.len(), h, data)
    }
    fn linear(&self, x: &CpuTensor, w: &CpuMatrix) -> CpuTensor {
        assert_eq!(
            x.cols, w.cols,
            "linear: input has {} columns, weight expects {}",
            x.cols, w.cols
        );
        CpuTensor::new(x.rows, w.rows, matmul::linear(&x.data, x.rows, w))
    }
    fn add_assign(&self, x: &mut CpuTensor, y: &CpuTensor) {
        assert_eq!(x.data.len(), y.data.len());
        x.data.iter_mut().zip(&y.data).for_each(|(a, b)| *a += b);
    }
    fn rms_norm(
        &self,
        x: &CpuTensor,
        w: &Vec<f32>,
        eps: f32,
        scale: NormScale,
        group: usize,
    ) -> CpuTensor {
        assert_eq!(w.len(), group);
        assert_eq!(x.cols % group, 0);
        CpuTensor::new(
            x.rows,
            x.cols,
            ops::rms_norm(&x.data, w, eps, scale == NormScale::OnePlus),
        )
    }
    fn rms_norm_gated(
        &self,
        x: &CpuTensor,
        gate: &CpuTensor,
        w: &Vec<f32>,
        eps: f32,
        group: usize,
    ) -> CpuTensor {
        assert_eq!(w.len(), group);
        assert_eq!(x.data.len(), gate.data.len());
        CpuTensor::new(
            x.rows,
            x.cols,
            ops::rms_norm_gated(&x.data, &gate.data, w, eps),
        )
    }
    fn silu_mul(&self, gate: &CpuTensor, up: &CpuTensor) -> CpuTensor {
        assert_eq!(gate.data.len(), up.data.len());
        let data = gate
            .data
            .iter()
            .zip(&up.data)
            .map(|(g, u)| ops::silu(*g) * u)
            .collect();
        CpuTensor::new(gate.rows, gate.cols, data)
    }
    fn sigmoid_gate(&self, x: &CpuTensor, gate: &CpuTensor) -> CpuTensor {
        assert_eq!(x.data.len(), gate.data.len());
        let data = x
            .data
            .iter()
            .zip(&gate.data)
            .map(|(v, g)| v * ops::sigmoid(*g))
            .collect();
        CpuTensor::new(x.rows, x.cols, data)
    }
    fn rope(
        &self,
        x: &mut CpuTensor,
        positions: &[usize],
        head_dim: usize,
        rotary_dim: usize,
        inv_freq: &[f32],
    ) {
        assert_eq!(positions.len(), x.rows);
        let cols = x.cols;
        for (row, &p) in x.data.chunks_exact_mut(cols).zip(positions) {
            ops::rope_row(row, p, head_dim, rotary_dim, inv_freq);
        }
    }

    fn attention(
        &self,
        q: &CpuTensor,
        k: &CpuTensor,
        v: &CpuTensor,
        past: usize,
        shape: AttentionShape,
    ) -> CpuTensor {
        let out = attention::attention(&q.data, &k.data, &v.data, q.rows, past, shape);
        CpuTensor::new(q.rows, shape.num_heads * shape.head_dim, out)
    }
    fn causal_conv1d_silu(
        &self,
        x: &CpuTensor,
        state: &mut CpuTensor,
        weight: &CpuMatrix,
    ) -> CpuTensor {
        let (channels, taps) = (weight.rows, weight.cols);
        assert_eq!(x.cols, channels);
        assert_eq!(state.data.len(), (taps - 1) * channels);
        let mut w = vec![0f32; channels * taps];
        for c in 0..channels {
            weight.row_f32(c, &mut w[c * taps..(c + 1) * taps]);
        }
        let out = ops::causal_conv1d_silu(&x.data, x.rows, channels, &mut state.data, &w, taps);
        CpuTensor::new(x.rows, channels, out)
    }
    fn delta_rule_gates(
        &self,
        a: &CpuTensor,
        b: &CpuTensor,
        a_log: &Vec<f32>,
        dt_bias: &Vec<f32>,
    ) -> (CpuTensor, CpuTensor) {
        let h = a_log.len();
        assert_eq!(a.cols, h);
        let mut g = vec![0f32; a.data.len()];
        let mut beta = vec![0f32; b.data.len()];
        for (i, (gv, av)) in g.iter_mut().zip(&a.data).enumerate() {
            *gv = -a_log[i % h].exp() * ops::softplus(av + dt_bias[i % h]);
        }
        for (bv, x) in beta.iter_mut().zip(&b.data) {
            *bv = ops::sigmoid(*x);
        }
        (
            CpuTensor::new(a.rows, h, g),
            CpuTensor::new(b.rows, h, beta),
        )
    }
    fn gated_delta_rule(
        &self,
        q: &CpuTensor,
        k: &CpuTensor,
        v: &CpuTensor,
        g: &CpuTensor,
        beta: &CpuTensor,
        state: &mut CpuTensor,
        shape: DeltaRuleShape,
        mode: DeltaRuleMode,
    ) -> CpuTensor {
        let n = q.rows;
        let out = delta_rule::gated_delta_rule(
            &q.data,
            &k.data,
            &v.data,
            &g.data,
            &beta.data,
            &mut state.data,
            n,
            shape,
            mode,
        );
        CpuTensor::new(n, shape.num_v_heads * shape.v_head_dim, out)
    }

    // Flash-Next ops: the same functions as the trait's defaults, without the host copies.
    fn scale_cols(&self, x: &CpuTensor, scale: &CpuTensor) -> CpuTensor {
        assert_eq!(
            scale.data.len(),
            x.cols,
            "scale_cols: {} scales for {} columns",
            scale.data.len(),
            x.cols
        );
        CpuTensor::new(x.rows, x.cols, hyper::scale_cols(&x.data, &scale.data))
    }
    fn silu_scaled(&self, x: &CpuTensor, scale: f32) -> CpuTensor {
        CpuTensor::new(x.rows, x.cols, hyper::silu_scaled(&x.data, scale))
    }
    fn hc_mix(&self, normed: &CpuTensor, mix_logits: &CpuTensor, streams: usize) -> CpuTensor {
        let h = normed.cols / streams;
        CpuTensor::new(
            normed.rows,
            h,
            hyper::hc_mix(&normed.data, &mix_logits.data, normed.rows, h, streams),
        )
    }
    fn hc_inject(
        &self,
        residual: &CpuTensor,
        out: &CpuTensor,
        inject_logits: &CpuTensor,
        streams: usize,
    ) -> CpuTensor {
        let h = residual.cols / streams;
        let data = hyper::hc_inject(
            &residual.data,
            &out.data,
            &inject_logits.data,
            residual.rows,
            h,
            streams,
        );
        CpuTensor::new(residual.rows, residual.cols, data)
    }
    fn ple_gate(
        &self,
        key: &CpuTensor,
        query: &CpuTensor,
        value: &CpuTensor,
        streams: usize,
    ) -> CpuTensor {
        let h = key.cols / streams;
        CpuTensor::new(
            key.rows,
            key.cols,
            hyper::ple_gate(&key.data, &query.data, &value.data, key.rows, h, streams),
        )
    }
    fn mean_pool_rows(&self, x: &CpuTensor, group: usize) -> CpuTensor {
        CpuTensor::new(
            x.rows / group,
            x.cols,
            qsa::mean_pool_rows(&x.data, x.cols, group),
        )
    }
    fn qsa_attention(
        &self,
        q: &CpuTensor,
        k: &CpuTensor,
        v: &CpuTensor,
        index_q: &CpuTensor,
        block_keys: &CpuTensor,
        past: usize,
        shape: AttentionShape,
        qsa_shape: QsaShape,
    ) -> CpuTensor {
        let out = qsa::qsa_attention(
            &q.data,
            &k.data,
            &v.data,
            &index_q.data,
            &block_keys.data,
            q.rows,
            past,
            shape,
            qsa_shape,
        );
        CpuTensor::new(q.rows, shape.num_heads * shape.head_dim, out)
    }
    fn moe_route(&self, logits: &CpuTensor, top_k: usize, normalize: bool) -> MoeRouting {
        moe::route(&logits.data, logits.cols, top_k, normalize)
    }
    fn moe_experts(
        &self,
        x: &CpuTensor,
        routing: &MoeRouting,
        experts: &[ExpertMatrices<CpuMatrix>],
    ) -> CpuTensor {
        CpuTensor::new(
            x.rows,
            x.cols,
            moe::experts_forward(&x.data, x.cols, routing, experts),
        )
    }
}
