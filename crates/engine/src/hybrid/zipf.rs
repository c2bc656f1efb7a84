//! Skewed expert routing for benchmarks: real MoE routers use a few experts far more than the
//! rest, which is what a VRAM expert cache lives on. Uniform random routing would make every
//! cache look useless, so the benches draw experts from a Zipf-like popularity instead.

use crate::backend::MoeRouting;
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;

/// Draws `top_k` distinct experts per token with popularity `∝ 1 / rank^exponent`, each layer
/// with its own random ranking of the experts.
pub struct ZipfRouter {
    experts: usize,
    top_k: usize,
    /// Per layer: the expert at each popularity rank.
    ranking: Vec<Vec<u32>>,
    /// Cumulative popularity by rank, ending at 1.
    cdf: Vec<f64>,
    rng: ChaCha8Rng,
}

impl ZipfRouter {
    pub fn new(layers: usize, experts: usize, top_k: usize, exponent: f64, seed: u64) -> Self {
        assert!(
            top_k >= 1 && top_k <= experts,
            "top_k {top_k} of {experts} experts"
        );
        let mut rng = ChaCha8Rng::seed_from_u64(seed);
        let ranking = (0..layers)
            .map(|_| {
                let mut ids: Vec<u32> = (0..experts as u32).collect();
                for i in (1..ids.len()).rev() {
                    ids.swap(i, rng.random_range(0..=i));
                }
                ids
            })
            .collect();
        let weights: Vec<f64> = (1..=experts).map(|r| (r as f64).powf(-exponent)).collect();
        let total: f64 = weights.iter().sum();
        let mut acc = 0.0;
        let cdf = weights
            .iter()
            .map(|w| {
                acc += w / total;
                acc
            })
            .collect();
        ZipfRouter {
            experts,
            top_k,
            ranking,
            cdf,
            rng,
        }
    }

    /// Probability that a single draw picks one of the `n` most popular experts.
    pub fn mass_of_top(&self, n: usize) -> f64 {
        if n == 0 {
            0.0
        } else {
            self.cdf[n.min(self.experts) - 1]
        }
    }

    /// The `n` most popular experts of `layer`.
    pub fn top(&self, layer: usize, n: usize) -> &[u32] {
        &self.ranking[layer][..n.min(self.experts)]
    }

    fn draw_rank(&mut self) -> usize {
        let u: f64 = self.rng.random();
        self.cdf.partition_point(|&c| c < u).min(self.experts - 1)
    }

    /// Routing for `tokens` tokens at `layer`: distinct experts per token, weights decreasing
    /// and summing to 1 (as the renormalised softmax gives).
    pub fn route(&mut self, layer: usize, tokens: usize) -> MoeRouting {
        let mut experts = Vec::with_capacity(tokens * self.top_k);
        let mut weights = Vec::with_capacity(tokens * self.top_k);
        let mut chosen = Vec::with_capacity(self.top_k);
        for _ in 0..tokens {
            chosen.clear();
            while chosen.len() < self.top_k {
                let rank = self.draw_rank();
                let e = self.ranking[layer][rank];
                if !chosen.contains(&e) {
                    chosen.push(e);
                }
            }
            let mut w: Vec<f32> = (0..self.top_k)
                .map(|_| self.rng.random_range(0.0f32..1.0).exp())
                .collect();
            w.sort_by(|a, b| b.total_cmp(a));
            let sum: f32 = w.iter().sum();
            experts.extend_from_slice(&chosen);
            weights.extend(w.iter().map(|x| x / sum));
        }
        MoeRouting {
            top_k: self.top_k,
            experts,
            weights,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn routes_are_distinct_normalised_and_skewed() {
        let mut z = ZipfRouter::new(2, 64, 8, 1.0, 7);
        let mut counts = vec![0usize; 64];
        for _ in 0..500 {
            let r = z.route(1, 1);
            let mut e = r.experts.clone();
            e.sort_unstable();
            e.dedup();
            assert_eq!(e.len(), 8);
            assert!((r.weights.iter().sum::<f32>() - 1.0).abs() < 1e-5);
            for x in r.experts {
                counts[x as usize] += 1;
            }
        }
        let top: usize = z.top(1, 8).iter().map(|&e| counts[e as usize]).sum();
        // 8 of 64 experts (12.5 %) take far more than 12.5 % of the draws.
        assert!(top as f64 > 0.3 * 4000.0, "top-8 share {top} of 4000");
        assert!(z.mass_of_top(64) > 0.999_999);
        assert!(z.mass_of_top(8) > 0.4 && z.mass_of_top(8) < 0.7);
    }

    #[test]
    fn same_seed_same_routing() {
        let mut a = ZipfRouter::new(3, 32, 4, 1.1, 1);
        let mut b = ZipfRouter::new(3, 32, 4, 1.1, 1);
        assert_eq!(a.route(2, 5), b.route(2, 5));
        assert_ne!(a.top(0, 32), a.top(1, 32));
    }
}
