//! Flash-Next routed experts under tensor parallelism: each expert belongs to one rank
//! ([`RankShard::owns_expert`]). A rank's [`RankExperts`] hands its inner implementation (a
//! [`crate::hybrid::HybridExperts`] over the host expert store, which all ranks share as one
//! `Arc`, with that rank's own VRAM expert cache and budget; or plain backend experts) only
//! the routed pairs of the experts it owns, so its cache only ever admits those: the VRAM
//! expert cache is split across the cards. The rank's output is a partial sum; the MoE
//! layer's all-reduce adds the ranks' partial sums (with the shared expert's, whose width is
//! split like an MLP).

use super::shard::RankShard;
use crate::backend::{Backend, MoeRouting};
use crate::hybrid::split::split_routing;
use crate::model::layers::moe::RoutedExperts;

pub struct RankExperts<B: Backend> {
    inner: Box<dyn RoutedExperts<B>>,
    shard: RankShard,
}

impl<B: Backend> RankExperts<B> {
    pub fn new(inner: Box<dyn RoutedExperts<B>>, shard: RankShard) -> Self {
        RankExperts { inner, shard }
    }

    /// The routed pairs this rank computes (`None`: none of its experts were chosen).
    pub fn owned_routing(&self, routing: &MoeRouting) -> Option<MoeRouting> {
        split_routing(routing, |e| self.shard.owns_expert(e as usize)).resident
    }
}

impl<B: Backend> RoutedExperts<B> for RankExperts<B> {
    fn forward(&self, b: &B, x: &B::Act, routing: &MoeRouting) -> B::Act {
        match self.owned_routing(routing) {
            Some(owned) => self.inner.forward(b, x, &owned),
            None => {
                let (n, h) = b.shape(x);
                b.zeros(n, h)
            }
        }
    }

    /// Hands the layer's device work to the inner experts, so that a hybrid rank queues it
    /// while its CPU experts compute (the default would run it first, and the inner experts'
    /// read of `x` would then wait for it).
    fn forward_overlapped(
        &self,
        b: &B,
        x: &B::Act,
        routing: &MoeRouting,
        queue_device_work: &mut dyn FnMut(),
    ) -> B::Act {
        match self.owned_routing(routing) {
            Some(owned) => self
                .inner
                .forward_overlapped(b, x, &owned, queue_device_work),
            None => {
                queue_device_work();
                let (n, h) = b.shape(x);
                b.zeros(n, h)
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::backend::cpu::CpuBackend;
    use crate::backend::ExpertMatrices;
    use crate::model::layers::moe::BackendExperts;
    use crate::tensor::HostTensor;

    fn lcg(seed: &mut u64) -> f32 {
        *seed = seed
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        ((*seed >> 40) as f32 / (1u64 << 24) as f32) - 0.5
    }

    /// Rank `rank` of `ranks` (only the experts' ownership matters here).
    fn shard(rank: usize, ranks: usize) -> RankShard {
        RankShard {
            rank,
            ranks,
            heads: 0..1,
            kv_heads: 0..1,
            gdn_v_heads: 0..1,
            gdn_k_heads: 0..1,
            mlp: 0..1,
            vocab: 0..1,
            shared_expert: 0..1,
        }
    }

    fn experts(b: &CpuBackend, count: usize, h: usize, i: usize) -> BackendExperts<CpuBackend> {
        let mut seed = 7u64;
        let mut m = |rows: usize, cols: usize| {
            let v: Vec<f32> = (0..rows * cols).map(|_| lcg(&mut seed)).collect();
            b.matrix(&HostTensor::from_f32("w", vec![rows, cols], &v))
                .unwrap()
        };
        BackendExperts {
            experts: (0..count)
                .map(|_| ExpertMatrices {
                    gate_up: m(2 * i, h),
                    down: m(h, i),
                })
                .collect(),
        }
    }

    /// The ranks' partial sums add up to the whole layer's routed-expert output, for 2 and 3
    /// ranks, including rows none of whose experts a rank owns.
    #[test]
    fn the_ranks_partial_sums_add_up_to_all_experts() {
        let b = CpuBackend::new();
        let (e, h, i, n, k) = (6, 8, 4, 5, 2);
        let mut seed = 11u64;
        let xs: Vec<f32> = (0..n * h).map(|_| lcg(&mut seed)).collect();
        let x = b.from_host(n, h, &xs);
        // Row 0 routes to experts 0 and 2 only (both even: rank 1 of 2 owns neither).
        let routing = MoeRouting {
            top_k: k,
            experts: vec![0, 2, 1, 4, 5, 3, 2, 1, 0, 5],
            weights: vec![0.6, 0.4, 0.5, 0.5, 0.7, 0.3, 0.2, 0.8, 0.9, 0.1],
        };
        let whole = b.to_host(&experts(&b, e, h, i).forward(&b, &x, &routing));
        for ranks in [2usize, 3] {
            let mut sum = vec![0f32; n * h];
            for r in 0..ranks {
                let shard = shard(r, ranks);
                let re = RankExperts::new(Box::new(experts(&b, e, h, i)), shard.clone());
                if let Some(owned) = re.owned_routing(&routing) {
                    assert!(owned.experts.iter().all(|&x| shard.owns_expert(x as usize)));
                }
                for (s, v) in sum.iter_mut().zip(b.to_host(&re.forward(&b, &x, &routing))) {
                    *s += v;
                }
            }
            let worst = sum
                .iter()
                .zip(&whole)
                .map(|(a, c)| (a - c).abs())
                .fold(0.0, f32::max);
            assert!(worst < 1e-5, "{ranks} ranks: max |Δ| {worst}");
        }
    }

    /// Inner experts that note whether the layer's device work came to them.
    struct Spy(std::sync::Arc<std::sync::atomic::AtomicUsize>);
    impl RoutedExperts<CpuBackend> for Spy {
        fn forward(
            &self,
            b: &CpuBackend,
            x: &crate::backend::cpu::CpuTensor,
            _: &MoeRouting,
        ) -> crate::backend::cpu::CpuTensor {
            let (n, h) = b.shape(x);
            b.zeros(n, h)
        }
        fn forward_overlapped(
            &self,
            b: &CpuBackend,
            x: &crate::backend::cpu::CpuTensor,
            routing: &MoeRouting,
            queue_device_work: &mut dyn FnMut(),
        ) -> crate::backend::cpu::CpuTensor {
            self.0.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
            queue_device_work();
            self.forward(b, x, routing)
        }
    }

    /// A rank hands the layer's device work to its inner experts (a hybrid rank overlaps it
    /// with its CPU experts), and still runs it exactly once where it owns none of the chosen
    /// experts.
    #[test]
    fn the_device_work_reaches_the_inner_experts_once() {
        let b = CpuBackend::new();
        let x = b.from_host(1, 4, &[0.5, -1.0, 2.0, 0.25]);
        let shard = shard(1, 2);
        for (experts, inner_calls) in [(vec![1u32, 3], 1), (vec![0, 2], 0)] {
            let calls = std::sync::Arc::new(std::sync::atomic::AtomicUsize::new(0));
            let re = RankExperts::new(Box::new(Spy(calls.clone())), shard.clone());
            assert_eq!(
                re.owned_routing(&MoeRouting {
                    top_k: 2,
                    experts: experts.clone(),
                    weights: vec![0.5, 0.5]
                })
                .is_some(),
                inner_calls == 1
            );
            let routing = MoeRouting {
                top_k: 2,
                experts,
                weights: vec![0.5, 0.5],
            };
            let mut queued = 0;
            re.forward_overlapped(&b, &x, &routing, &mut || queued += 1);
            assert_eq!(queued, 1, "the device work runs exactly once");
            assert_eq!(
                calls.load(std::sync::atomic::Ordering::Relaxed),
                inner_calls
            );
        }
    }
}
