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

    /// Whether [`RoutedExperts::forward_routed_on_device`] may route these experts on the
    /// device (all of them on the backend); experts split between host and device need the
    /// routing on the host.
    fn routes_on_device(&self) -> bool {
        false
    }

    /// Routes and runs the experts without reading the routing back, adding the gated
    /// shared expert's output `shared` ([`Backend::moe_routed_on_device`]): `None` where the
    /// backend cannot.
    fn forward_routed_on_device(
        &self,
        b: &B,
        x: &B::Act,
        logits: &B::Act,
        top_k: usize,
        normalize: bool,
        shared: &B::Act,
    ) -> Option<B::Act> {
        let _ = (b, x, logits, top_k, normalize, shared);
        None
    }

    /// [`RoutedExperts::forward`], with the layer's other device work (the shared expert) to
    /// queue where the device runs it while these experts compute: `queue_device_work` runs
    /// exactly once, on this thread, before this returns. The default runs it first; experts
    /// that compute on the CPU queue it once their CPU work has started.
    fn forward_overlapped(
        &self,
        b: &B,
        x: &B::Act,
        routing: &MoeRouting,
        queue_device_work: &mut dyn FnMut(),
    ) -> B::Act {
        queue_device_work();
        self.forward(b, x, routing)
    }
}

/// Experts as backend matrices, run by [`Backend::moe_experts`].
pub struct BackendExperts<B: Backend> {
    pub experts: Vec<ExpertMatrices<B::Matrix>>,
}

impl<B: Backend> RoutedExperts<B> for BackendExperts<B> {
    fn forward(&self, b: &B, x: &B::Act, routing: &MoeRouting) -> B::Act {
        b.moe_experts(x, routing, &self.experts)
    }

    fn routes_on_device(&self) -> bool {
        true
    }

    fn forward_routed_on_device(
        &self,
        b: &B,
        x: &B::Act,
        logits: &B::Act,
        top_k: usize,
        normalize: bool,
        shared: &B::Act,
    ) -> Option<B::Act> {
        b.moe_routed_on_device(x, logits, top_k, normalize, &self.experts, Some(shared))
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

/// The `[rows, cols]` weight `name` stored quantized in a format the kernels read, or `None`
/// (float storage, or sizes the formats cannot hold).
fn quant_rows(
    ck: &Checkpoint,
    name: &str,
    want: [usize; 2],
) -> Result<Option<crate::checkpoint::QuantRows>> {
    let q = ck.weights.quant_rows(name)?;
    if let Some(q) = &q {
        if [q.rows, q.cols] != want {
            bail!(
                "routed expert {name}: stored as [{}, {}], expected {want:?} from config.json",
                q.rows,
                q.cols
            );
        }
    }
    Ok(q)
}

/// The routed experts on the backend. Quantized storage stays quantized
/// ([`Backend::quant_matrix`]: NVFP4, FP8 and GGUF block types are never expanded to f32 on
/// the CPU): per expert, `gate ‖ up` when both are stored in one format with one multiplier,
/// and `down`, each on its own. The rest (float storage, the fused `gate_up_proj` layout)
/// goes through [`read_expert_tensors`].
pub fn load_expert_matrices<B: Backend>(
    b: &B,
    ck: &Checkpoint,
    p: &str,
    hidden: usize,
    m: &MoeConfig,
) -> Result<Vec<ExpertMatrices<B::Matrix>>> {
    let all: Vec<usize> = (0..m.num_experts).collect();
    load_expert_matrices_of(b, ck, p, hidden, m, &all)
}

/// [`load_expert_matrices`] for the experts `which` only, in that order (a tensor-parallel
/// rank uploads just the experts it owns).
pub fn load_expert_matrices_of<B: Backend>(
    b: &B,
    ck: &Checkpoint,
    p: &str,
    hidden: usize,
    m: &MoeConfig,
    which: &[usize],
) -> Result<Vec<ExpertMatrices<B::Matrix>>> {
    let inter = m.moe_intermediate_size;
    if let Some(&e) = which.iter().find(|&&e| e >= m.num_experts) {
        bail!(
            "expert {e} asked for under {p}, but the layer has {} experts",
            m.num_experts
        );
    }
    if ck.weights.contains(&format!("{p}gate_up_proj")) {
        let mut all: Vec<Option<ExpertMatrices<HostTensor>>> =
            read_expert_tensors(ck, p, hidden, m)?
                .into_iter()
                .map(Some)
                .collect();
        return which
            .iter()
            .map(|&e| all[e].take().expect("distinct experts"))
            .map(|t| {
                Ok(ExpertMatrices {
                    gate_up: b.matrix(&t.gate_up)?,
                    down: b.matrix(&t.down)?,
                })
            })
            .collect();
    }
    if !ck.weights.contains(&format!("{p}0.gate_proj.weight")) {
        // Names what is expected.
        read_expert_tensors(ck, p, hidden, m)?;
    }
    which
        .iter()
        .map(|&e| {
            let name = |proj: &str| format!("{p}{e}.{proj}.weight");
            let gate_up = match (
                quant_rows(ck, &name("gate_proj"), [inter, hidden])?,
                quant_rows(ck, &name("up_proj"), [inter, hidden])?,
            ) {
                (Some(g), Some(u)) if g.format == u.format && g.multiplier == u.multiplier => {
                    let mut blocks = g.bytes;
                    blocks.extend_from_slice(&u.bytes);
                    b.quant_matrix(g.format, 2 * inter, hidden, &blocks, g.multiplier)?
                }
                _ => {
                    let gate = tensor(ck, &name("gate_proj"), &[inter, hidden])?;
                    let up = tensor(ck, &name("up_proj"), &[inter, hidden])?;
                    b.matrix(&HostTensor::concat_rows(
                        &format!("{p}{e}.gate_up_proj"),
                        &[gate, up],
                    )?)?
                }
            };
            let down = match quant_rows(ck, &name("down_proj"), [hidden, inter])? {
                Some(d) => b.quant_matrix(d.format, hidden, inter, &d.bytes, d.multiplier)?,
                None => b.matrix(&tensor(ck, &name("down_proj"), &[hidden, inter])?)?,
            };
            Ok(ExpertMatrices { gate_up, down })
        })
        .collect()
}

/// Builds a layer's routed experts instead of uploading them all to the backend (hybrid
/// placement plugs in here): gets the backend, the layer index and the experts' tensor prefix
/// (`…mlp.experts.`).
pub type ExpertLoader<'a, B> = dyn FnMut(&B, usize, &str) -> Result<Box<dyn RoutedExperts<B>>> + 'a;

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
    /// Loads `p` (`…mlp.`), the routed experts uploaded to the backend.
    pub fn load(b: &B, ck: &Checkpoint, p: &str, hidden: usize, m: &MoeConfig) -> Result<Self> {
        Self::load_with(b, ck, p, hidden, m, None)
    }

    /// Loads `p` (`…mlp.`); `experts` builds the routed experts of layer `layer` (uploaded to
    /// the backend when `None`).
    pub fn load_with(
        b: &B,
        ck: &Checkpoint,
        p: &str,
        hidden: usize,
        m: &MoeConfig,
        experts: Option<(usize, &mut ExpertLoader<'_, B>)>,
    ) -> Result<Self> {
        let gate = tensor(ck, &format!("{p}gate.weight"), &[m.num_experts, hidden])?;
        let shared_gate = tensor(ck, &format!("{p}shared_expert_gate.weight"), &[1, hidden])?;
        let prefix = format!("{p}experts.");
        let experts: Box<dyn RoutedExperts<B>> = match experts {
            Some((layer, load)) => load(b, layer, &prefix)?,
            None => Box::new(BackendExperts::<B> {
                experts: load_expert_matrices(b, ck, &prefix, hidden, m)?,
            }),
        };
        Ok(SparseMoe {
            router: b.matrix(&HostTensor::concat_rows(
                &format!("{p}router"),
                &[gate, shared_gate],
            )?)?,
            experts,
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
        let logits = b.linear(x, &self.router);
        // The shared expert's gate is one logit per row, the router's last column.
        let gated = |shared: &B::Act| b.sigmoid_gate_rows(shared, &logits, self.num_experts);
        let mut shared = None;
        if self.experts.routes_on_device() {
            // Experts all on the backend: the shared expert first (as the overlapped path
            // queues it first), then routing, experts and the gated sum in one op where the
            // backend keeps the routing on the device.
            let s = self.shared.forward(b, x);
            let (k, normalize) = (self.top_k, self.normalize);
            if let Some(out) = self
                .experts
                .forward_routed_on_device(b, x, &logits, k, normalize, &s)
            {
                return out;
            }
            shared = Some(gated(&s));
        }
        let routing = b.moe_route(
            &b.cols(&logits, 0..self.num_experts),
            self.top_k,
            self.normalize,
        );
        // The shared expert is queued while the routed experts compute (the device runs it
        // while host experts run on the CPU) and added after them: `routed + shared`, as ever.
        let mut out = self.experts.forward_overlapped(b, x, &routing, &mut || {
            shared.get_or_insert_with(|| gated(&self.shared.forward(b, x)));
        });
        let shared = shared.expect("forward_overlapped runs the device work it is given");
        b.add_assign(&mut out, &shared);
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::backend::cpu::experts::ExpertPool;
    use crate::backend::cpu::simd::Isa;
    use crate::backend::cpu::CpuBackend;
    use crate::hybrid::host_store::pack_float_experts;
    use crate::hybrid::{HybridExperts, Placement};
    use crate::model::layers::text_prefix;
    use crate::model::qwen4_exp_text::Qwen4ExpText;
    use std::sync::Arc;

    fn fixture() -> (Checkpoint, Qwen4ExpText<CpuBackend>) {
        let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("tests/fixtures/qwen4_exp_text/fused");
        let ck = Checkpoint::open(&dir).unwrap();
        let model = Qwen4ExpText::load(CpuBackend::new(), &ck).unwrap();
        (ck, model)
    }

    /// The layer as it ran before the shared expert was queued ahead: routed experts, then
    /// the shared expert and its gate, then `routed + shared`.
    fn routed_then_shared(m: &SparseMoe<CpuBackend>, b: &CpuBackend, x: &CpuTensor) -> Vec<f32> {
        let (n, hidden) = b.shape(x);
        let logits = b.linear(x, &m.router);
        let routing = b.moe_route(&b.cols(&logits, 0..m.num_experts), m.top_k, m.normalize);
        let mut out = m.experts.forward(b, x, &routing);
        let gate_logit = b.to_host(&b.cols(&logits, m.num_experts..m.num_experts + 1));
        let gate: Vec<f32> = gate_logit
            .iter()
            .flat_map(|&g| std::iter::repeat_n(g, hidden))
            .collect();
        let shared = b.sigmoid_gate(&m.shared.forward(b, x), &b.from_host(n, hidden, &gate));
        b.add_assign(&mut out, &shared);
        b.to_host(&out)
    }

    type CpuTensor = <CpuBackend as Backend>::Act;

    /// Hybrid experts behind an `Arc`, so that the test can read their times.
    struct Watched(Arc<HybridExperts<CpuBackend>>);
    impl RoutedExperts<CpuBackend> for Watched {
        fn forward(&self, b: &CpuBackend, x: &CpuTensor, routing: &MoeRouting) -> CpuTensor {
            self.0.forward(b, x, routing)
        }
        fn forward_overlapped(
            &self,
            b: &CpuBackend,
            x: &CpuTensor,
            routing: &MoeRouting,
            queue_device_work: &mut dyn FnMut(),
        ) -> CpuTensor {
            self.0.forward_overlapped(b, x, routing, queue_device_work)
        }
    }

    /// Queuing the shared expert ahead of (or inside) the routed experts leaves the result
    /// bit for bit as it was, with the experts on the backend or split with the CPU; split, the
    /// shared expert is queued inside the CPU experts' pool call.
    #[test]
    fn the_shared_expert_queued_first_gives_the_same_result() {
        let (ck, mut model) = fixture();
        let b = CpuBackend::new();
        let hidden = ck.config.hidden_size;
        let n = 3;
        let x_host: Vec<f32> = (0..n * hidden)
            .map(|i| (i * 7919 % 1000) as f32 / 500.0 - 1.0)
            .collect();
        let x = b.from_host(n, hidden, &x_host);

        let moe = &model.layers[0].moe;
        let got = b.to_host(&moe.forward(&b, &x));
        let want = routed_then_shared(moe, &b, &x);
        assert!(got
            .iter()
            .zip(&want)
            .all(|(g, w)| g.to_bits() == w.to_bits()));

        let cfg = model.flash.moe.clone();
        let prefix = format!("{}layers.0.mlp.experts.", text_prefix(&ck));
        let host = pack_float_experts(&read_expert_tensors(&ck, &prefix, hidden, &cfg).unwrap());
        let hybrid = Arc::new(
            HybridExperts::new(
                &b,
                0,
                Arc::new(host.unwrap()),
                Arc::new(ExpertPool::new(2, false)),
                Isa::detect(),
                Placement::Fixed((0..cfg.num_experts).map(|e| e % 2 == 0).collect()),
            )
            .unwrap(),
        );
        model.layers[0]
            .moe
            .set_experts(Box::new(Watched(hybrid.clone())));
        let moe = &model.layers[0].moe;
        let got = b.to_host(&moe.forward(&b, &x));
        let t = hybrid.times();
        let want = routed_then_shared(moe, &b, &x);
        assert!(got
            .iter()
            .zip(&want)
            .all(|(g, w)| g.to_bits() == w.to_bits()));
        assert_eq!(t.calls, 1);
        assert!(t.caller_queue_s > 0.0 && t.cpu_experts_s > 0.0, "{t:?}");
        assert_eq!(t.queued_during_cpu_s, t.caller_queue_s + t.resident_queue_s);
    }
}
