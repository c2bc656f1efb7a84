//! Sparse MoE on the CPU: the router's top-k and the exact f32 routed-expert sum.
//!
//! The expert math goes through the same [`matmul::linear`] kernels as every other layer. It sits
//! behind [`crate::backend::Backend::moe_experts`] so that a quantized expert kernel, or
//! host/GPU expert placement, can replace it without touching the model.

use super::matmul::{self, CpuMatrix};
use super::ops::silu;
use crate::backend::{ExpertMatrices, MoeRouting};

/// Softmax over each row of `logits` `[n, experts]`, then the `top_k` largest probabilities
/// (equal ones: the lower expert id first), renormalised to sum to 1 when `normalize`.
pub fn route(logits: &[f32], experts: usize, top_k: usize, normalize: bool) -> MoeRouting {
    assert!(
        top_k >= 1 && top_k <= experts,
        "moe: top_k {top_k} with {experts} experts"
    );
    let n = logits.len() / experts;
    let mut ids = Vec::with_capacity(n * top_k);
    let mut weights = Vec::with_capacity(n * top_k);
    let mut order: Vec<usize> = Vec::with_capacity(experts);
    for row in logits.chunks_exact(experts) {
        let max = row.iter().copied().fold(f32::NEG_INFINITY, f32::max);
        let exps: Vec<f32> = row.iter().map(|l| (l - max).exp()).collect();
        let sum: f32 = exps.iter().sum();
        let probs: Vec<f32> = exps.iter().map(|e| e / sum).collect();
        order.clear();
        order.extend(0..experts);
        order.sort_by(|&a, &b| probs[b].total_cmp(&probs[a]));
        let top = &order[..top_k];
        let norm: f32 = if normalize {
            top.iter().map(|&e| probs[e]).sum()
        } else {
            1.0
        };
        for &e in top {
            ids.push(e as u32);
            weights.push(probs[e] / norm);
        }
    }
    MoeRouting {
        top_k,
        experts: ids,
        weights,
    }
}

/// For each expert, the `(row, weight)` pairs routed to it, rows ascending.
pub fn rows_per_expert(routing: &MoeRouting, experts: usize) -> Vec<Vec<(usize, f32)>> {
    let mut per = vec![Vec::new(); experts];
    for (i, (&e, &w)) in routing.experts.iter().zip(&routing.weights).enumerate() {
        assert!(
            (e as usize) < experts,
            "moe: routed to expert {e} of {experts}"
        );
        per[e as usize].push((i / routing.top_k, w));
    }
    per
}

/// `x` `[n, hidden]` → `Σ_j w_j · down_e(silu(gate_e x) · up_e x)` per row.
pub fn experts_forward(
    x: &[f32],
    hidden: usize,
    routing: &MoeRouting,
    experts: &[ExpertMatrices<CpuMatrix>],
) -> Vec<f32> {
    let n = x.len() / hidden;
    let mut out = vec![0f32; n * hidden];
    for (e, rows) in rows_per_expert(routing, experts.len()).iter().enumerate() {
        if rows.is_empty() {
            continue;
        }
        let ex = &experts[e];
        let mut gathered = Vec::with_capacity(rows.len() * hidden);
        for &(r, _) in rows {
            gathered.extend_from_slice(&x[r * hidden..(r + 1) * hidden]);
        }
        let gu = matmul::linear(&gathered, rows.len(), &ex.gate_up);
        let inter = ex.gate_up.rows / 2;
        let mut act = vec![0f32; rows.len() * inter];
        for (a, g) in act.chunks_exact_mut(inter).zip(gu.chunks_exact(2 * inter)) {
            for j in 0..inter {
                a[j] = silu(g[j]) * g[inter + j];
            }
        }
        let y = matmul::linear(&act, rows.len(), &ex.down);
        for (i, &(r, w)) in rows.iter().enumerate() {
            out[r * hidden..(r + 1) * hidden]
                .iter_mut()
                .zip(&y[i * hidden..(i + 1) * hidden])
                .for_each(|(o, v)| *o += v * w);
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn route_takes_top_k_and_renormalises() {
        let r = route(&[0.0, 2.0, 1.0, 2.0], 4, 2, true);
        assert_eq!(r.experts, vec![1, 3]);
        assert!((r.weights[0] - 0.5).abs() < 1e-7 && (r.weights[1] - 0.5).abs() < 1e-7);
        let raw = route(&[0.0, 0.0], 2, 1, false);
        assert_eq!((raw.experts, raw.weights), (vec![0], vec![0.5]));
    }

    #[test]
    fn experts_sum_weighted_swiglu() {
        // hidden 1, intermediate 1: gate_up = [g; u], down = [d].
        let ex = |g: f32, u: f32, d: f32| ExpertMatrices {
            gate_up: CpuMatrix::from_f32(2, 1, vec![g, u]),
            down: CpuMatrix::from_f32(1, 1, vec![d]),
        };
        let experts = [ex(1.0, 2.0, 3.0), ex(-1.0, 1.0, 1.0)];
        let routing = MoeRouting {
            top_k: 2,
            experts: vec![0, 1],
            weights: vec![0.25, 0.75],
        };
        let out = experts_forward(&[2.0], 1, &routing, &experts);
        let want = 0.25 * 3.0 * silu(2.0) * 4.0 + 0.75 * silu(-2.0) * 2.0;
        assert!((out[0] - want).abs() < 1e-6, "{out:?} vs {want}");
    }
}
