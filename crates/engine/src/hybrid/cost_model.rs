//! When prefill should stream a layer's experts to the GPU instead of computing them on the CPU.
//!
//! Computing on the CPU costs the larger of reading the touched experts at the CPU kernels'
//! bandwidth and their FLOPs at the CPU's rate; streaming costs the larger of copying the
//! non-resident experts over PCIe and the GPU's FLOPs (the copy overlaps the GPU's work on
//! earlier experts). Both inputs come from measurements (the bench's bandwidth passes), so the
//! threshold follows the machine rather than a guess.

/// Measured rates and the model's expert shape.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct PrefillCostInputs {
    /// Routed experts per layer and per token.
    pub experts: usize,
    pub top_k: usize,
    /// Experts of the layer already resident in VRAM (never copied, never on the CPU).
    pub resident: usize,
    /// Bytes of one expert's weights.
    pub expert_bytes: f64,
    /// FLOPs of one (token, expert) pair: `2 · 3 · H · I`.
    pub pair_flops: f64,
    /// What the CPU expert kernels achieve: bytes/s of weights read, FLOP/s at prefill batches.
    pub cpu_bytes_per_s: f64,
    pub cpu_flops_per_s: f64,
    /// Host→device over PCIe, page-locked.
    pub pcie_bytes_per_s: f64,
    pub gpu_flops_per_s: f64,
}

impl PrefillCostInputs {
    /// Expected distinct non-resident experts touched by `tokens` tokens (uniform routing:
    /// the conservative case for the CPU, which reads each touched expert once).
    fn touched_host_experts(&self, tokens: usize) -> f64 {
        let host = (self.experts - self.resident) as f64;
        let p_miss = 1.0 - self.top_k as f64 / self.experts as f64;
        host * (1.0 - p_miss.powf(tokens as f64))
    }

    fn host_pairs(&self, tokens: usize) -> f64 {
        tokens as f64 * self.top_k as f64 * (self.experts - self.resident) as f64
            / self.experts as f64
    }

    /// Seconds to compute one layer's non-resident experts for `tokens` tokens on the CPU.
    pub fn cpu_seconds(&self, tokens: usize) -> f64 {
        let read = self.touched_host_experts(tokens) * self.expert_bytes / self.cpu_bytes_per_s;
        let compute = self.host_pairs(tokens) * self.pair_flops / self.cpu_flops_per_s;
        read.max(compute)
    }

    /// Seconds to stream the same experts to the GPU and compute them there.
    pub fn stream_seconds(&self, tokens: usize) -> f64 {
        let copy = self.touched_host_experts(tokens) * self.expert_bytes / self.pcie_bytes_per_s;
        let compute = self.host_pairs(tokens) * self.pair_flops / self.gpu_flops_per_s;
        copy.max(compute)
    }

    /// The smallest prefill chunk for which streaming is faster, or `None` if it never is
    /// (up to a million tokens).
    pub fn stream_threshold(&self) -> Option<usize> {
        if self.resident >= self.experts {
            return None;
        }
        let faster = |n: usize| self.stream_seconds(n) < self.cpu_seconds(n);
        let (mut lo, mut hi) = (1usize, 1usize << 20);
        if !faster(hi) {
            return None;
        }
        if faster(lo) {
            return Some(lo);
        }
        // `faster` is monotone here: CPU time grows with FLOPs while the copy saturates.
        while hi - lo > 1 {
            let mid = lo + (hi - lo) / 2;
            if faster(mid) {
                hi = mid;
            } else {
                lo = mid;
            }
        }
        Some(hi)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Flash-Next NVFP4 experts on the H200 box's measured ceilings (../shared/DESIGN.md):
    /// 53.6 GB/s page-locked PCIe, ~70 GB/s RAM read, ~1 TFLOP/s of CPU FMA.
    fn flash_next() -> PrefillCostInputs {
        PrefillCostInputs {
            experts: 512,
            top_k: 10,
            resident: 0,
            expert_bytes: 2_764_800.0,
            pair_flops: 2.0 * 3.0 * 2560.0 * 640.0,
            cpu_bytes_per_s: 70e9,
            cpu_flops_per_s: 1e12,
            pcie_bytes_per_s: 53.6e9,
            gpu_flops_per_s: 400e12,
        }
    }

    #[test]
    fn decode_stays_on_the_cpu_and_long_prefill_streams() {
        let c = flash_next();
        assert!(c.cpu_seconds(1) < c.stream_seconds(1));
        let t = c.stream_threshold().expect("long prefills must stream");
        // A whole layer (1.4 GB) over PCIe is ~26 ms; the CPU does ~10 ms of FLOPs per 100
        // tokens: the crossover is a few hundred tokens.
        assert!((100..1000).contains(&t), "threshold {t}");
        assert!(c.stream_seconds(t) < c.cpu_seconds(t));
        assert!(c.stream_seconds(t - 1) >= c.cpu_seconds(t - 1));
    }

    #[test]
    fn a_faster_link_or_a_slower_cpu_lowers_the_threshold() {
        let base = flash_next().stream_threshold().unwrap();
        let fast_link = PrefillCostInputs {
            pcie_bytes_per_s: 2.0 * 53.6e9,
            ..flash_next()
        };
        let slow_cpu = PrefillCostInputs {
            cpu_flops_per_s: 0.25e12,
            ..flash_next()
        };
        assert!(fast_link.stream_threshold().unwrap() < base);
        assert!(slow_cpu.stream_threshold().unwrap() < base);
    }

    #[test]
    fn everything_resident_never_streams() {
        let all = PrefillCostInputs {
            resident: 512,
            ..flash_next()
        };
        assert_eq!(all.stream_threshold(), None);
        assert_eq!(all.cpu_seconds(100), 0.0);
    }
}
