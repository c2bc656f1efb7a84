//! Sparse MoE: router (softmax, top-k, renormalised), routed experts, and the shared expert
//! with its sigmoid gate.
//!
//! The routed experts sit behind [`RoutedExperts`], so where and how they run (the backend's
//! matmuls today; quantized kernels, host or GPU placement later) can change without the model.

use super::mlp::Mlp;
use super::tensor;
use crate::backend::{Backend, ExpertMatrices, MoeRouting};
use crate::checkpoint::Checkpoint;
use crate::config::MoeConfig;
use crate::tensor::{Bytes, HostTensor};
use anyhow::{bail, Result};

/// Computes the routed experts' weighted sum for a batch.
pub trait RoutedExperts<B: Backend>: Send + Sync {
    /// `x` `[n, hidden]`, the router's choice per row → `Σ_j w_j · expert_j(x)`, `[n, hidden]`.
    fn forward(&self, b: &B, x: &B::Act, routing: &MoeRouting) -> B::Act;
}

/// Experts as backend matrices, run by [`Backend::moe_experts`].
pub struct BackendExperts<B: Backend> {
    pub experts: Vec<ExpertMatrices<B::Matrix>>,
}

impl<B: Backend> RoutedExperts<B> for BackendExperts<B> {
    fn forward(&self, b: &B, x: &B::Act, routing: &MoeRouting) -> B::Act {
        b.moe_experts(x, routing, &self.experts)
    }
}

/// The `e`-th `[rows, cols]` slice of a stacked `[E, rows, cols]` tensor, sharing its bytes.
fn expert_slice(t: &HostTensor, e: usize) -> HostTensor {
    let (rows, cols) = (t.shape[1], t.shape[2]);
    let len = rows * cols * t.dtype.size();
    HostTensor {
        name: format!("{}[{e}]", t.name),
        dtype: t.dtype,
        shape: vec![rows, cols],
        data: Bytes::slice(&t.data, e * len, len),
    }
}

/// Reads routed experts stored fused (`experts.gate_up_proj` `[E, 2I, H]`, `experts.down_proj`
/// `[E, H, I]`, as transformers writes them) or per expert (`experts.{e}.gate_proj.weight`,
/// `up_proj`, `down_proj`, as published checkpoints store them), as host tensors: per expert,
/// `gate ‖ up` `[2I, H]` and `down` `[H, I]`.
pub fn read_expert_tensors(
    ck: &Checkpoint,
    p: &str,
    hidden: usize,
    m: &MoeConfig,
) -> Result<Vec<ExpertMatrices<HostTensor>>> {
    let (e_count, inter) = (m.num_experts, m.moe_intermediate_size);
    let fused = format!("{p}gate_up_proj");
    if ck.weights.contains(&fused) {
        let gate_up = tensor(ck, &fused, &[e_count, 2 * inter, hidden])?;
        let down = tensor(ck, &format!("{p}down_proj"), &[e_count, hidden, inter])?;
        return Ok((0..e_count)
            .map(|e| ExpertMatrices {
                gate_up: expert_slice(&gate_up, e),
                down: expert_slice(&down, e),
            })
            .collect());
    }
    if !ck.weights.contains(&format!("{p}0.gate_proj.weight")) {
        bail!(
            "no routed experts under {p}: expected {fused} [E, 2I, H] or {p}{{e}}.gate_proj.weight / up_proj / down_proj"
        );
    }
    (0..e_count)
        .map(|e| {
            let gate = tensor(ck, &format!("{p}{e}.gate_proj.weight"), &[inter, hidden])?;
            let up = tensor(ck, &format!("{p}{e}.up_proj.weight"), &[inter, hidden])?;
            let down = tensor(ck, &format!("{p}{e}.down_proj.weight"), &[hidden, inter])?;
            Ok(ExpertMatrices {
                gate_up: HostTensor::concat_rows(&format!("{p}{e}.gate_up_proj"), &[gate, up])?,
                down,
            })
        })
        .collect()
}

/// [`read_expert_tensors`], uploaded to the backend.
pub fn load_expert_matrices<B: Backend>(
    b: &B,
    ck: &Checkpoint,
    p: &str,
    hidden: usize,
    m: &MoeConfig,
) -> Result<Vec<ExpertMatrices<B::Matrix>>> {
    read_expert_tensors(ck, p, hidden, m)?
        .into_iter()
        .map(|t| {
            Ok(ExpertMatrices {
                gate_up: b.matrix(&t.gate_up)?,
                down: b.matrix(&t.down)?,
            })
        })
        .collect()
}

pub struct SparseMoe<B: Backend> {
    /// Fused router `gate.weight` `[E, H]` ‖ `shared_expert_gate.weight` `[1, H]`.
    router: B::Matrix,
    experts: Box<dyn RoutedExperts<B>>,
    shared: Mlp<B>,
    num_experts: usize,
    top_k: usize,
    normalize: bool,
}

impl<B: Backend> SparseMoe<B> {
    /// Loads `p` (`…mlp.`).
    pub fn load(b: &B, ck: &Checkpoint, p: &str, hidden: usize, m: &MoeConfig) -> Result<Self> {
        let gate = tensor(ck, &format!("{p}gate.weight"), &[m.num_experts, hidden])?;
        let shared_gate = tensor(ck, &format!("{p}shared_expert_gate.weight"), &[1, hidden])?;
        let experts = load_expert_matrices(b, ck, &format!("{p}experts."), hidden, m)?;
        Ok(SparseMoe {
            router: b.matrix(&HostTensor::concat_rows(
                &format!("{p}router"),
                &[gate, shared_gate],
            )?)?,
            experts: Box::new(BackendExperts::<B> { experts }),
            shared: Mlp::load(
                b,
                ck,
                &format!("{p}shared_expert."),
                hidden,
                m.shared_expert_intermediate_size,
            )?,
            num_experts: m.num_experts,
            top_k: m.num_experts_per_tok,
            normalize: m.norm_topk_prob,
        })
    }

    /// Replaces the routed experts' implementation (expert placement plugs in here).
    pub fn set_experts(&mut self, experts: Box<dyn RoutedExperts<B>>) {
        self.experts = experts;
    }

    pub fn forward(&self, b: &B, x: &B::Act) -> B::Act {
        let (n, hidden) = b.shape(x);
        let logits = b.linear(x, &self.router);
        let routing = b.moe_route(
            &b.cols(&logits, 0..self.num_experts),
            self.top_k,
            self.normalize,
        );
        let mut out = self.experts.forward(b, x, &routing);
        // The shared expert's gate is one logit per row, broadcast over the hidden size.
        let gate_logit = b.to_host(&b.cols(&logits, self.num_experts..self.num_experts + 1));
        let gate: Vec<f32> = gate_logit
            .iter()
            .flat_map(|&g| std::iter::repeat_n(g, hidden))
            .collect();
        let shared = b.sigmoid_gate(&self.shared.forward(b, x), &b.from_host(n, hidden, &gate));
        b.add_assign(&mut out, &shared);
        out
    }
}
