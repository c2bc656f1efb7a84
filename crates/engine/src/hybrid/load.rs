//! Loading Flash-Next with hybrid expert placement: dense weights on the backend, every
//! layer's routed experts in the host expert store (in their stored format where the CPU
//! kernels read it), and a VRAM expert cache sized from what the budget leaves for experts.
//!
//! The experts are never uploaded whole: the backend only ever holds the cache's slots. With
//! room for every expert the placement is fixed (all resident, no warm-up); otherwise the
//! decayed-frequency cache decides, starting cold or from a saved hot set.

use super::expert_cache::{ExpertCache, ExpertCacheConfig};
use super::experts::{HybridExperts, Placement};
use super::host_store::pack_float_experts;
use super::memory::{anon_growth, MemoryCheck, ProcessMemory};
use crate::backend::cpu::experts::{ExpertPool, ExpertSet, ExpertShape};
use crate::backend::cpu::simd::Isa;
use crate::backend::Backend;
use crate::checkpoint::quant_experts::quantized_expert_set;
use crate::checkpoint::Checkpoint;
use crate::model::layers::moe::{read_expert_tensors, RoutedExperts};
use crate::model::qwen4_exp_text::Qwen4ExpText;
use anyhow::{Context, Result};
use std::path::PathBuf;
use std::sync::{Arc, Mutex};

/// How the routed experts are placed.
#[derive(Debug, Clone)]
pub struct HybridOptions {
    /// Device bytes the expert cache may fill (the VRAM ledger's remainder for experts).
    pub cache_bytes: usize,
    /// CPU expert workers (0: one per physical core).
    pub threads: usize,
    /// Recency half-life of the cache's frequency counts, in tokens.
    pub half_life_tokens: f32,
    /// A newcomer must beat the coldest resident expert by this fraction to replace it.
    pub admit_margin: f32,
    /// A hot set saved by an earlier run ([`ExpertCache::save_hot_set`]) to start warm from.
    pub hot_set: Option<PathBuf>,
    /// Bytes the OS lets this process page-lock (WSL2 and Windows: about half of RAM; see
    /// capy-hardware's probe); `None`: no cap known. Layers beyond it stay pageable.
    pub page_locked_limit: Option<u64>,
}

impl Default for HybridOptions {
    fn default() -> Self {
        HybridOptions {
            cache_bytes: 0,
            threads: 0,
            half_life_tokens: 256.0,
            admit_margin: 0.1,
            hot_set: None,
            page_locked_limit: None,
        }
    }
}

/// What the loader placed where.
#[derive(Debug, Clone, PartialEq, serde::Serialize)]
pub struct HybridReport {
    pub moe_layers: usize,
    pub experts_per_layer: usize,
    /// Host expert store: all layers' records.
    pub host_bytes: usize,
    /// Weight bytes of one expert as the cache holds it (its stored format).
    pub expert_bytes: usize,
    /// Slots the cache budget buys, over all layers.
    pub cache_slots: usize,
    /// Every expert resident: the placement is fixed, no cache policy runs.
    pub all_resident: bool,
    /// Row formats of the host store (gate/up, down), e.g. "nvfp4/nvfp4".
    pub formats: String,
    /// Host store bytes page-locked for the GPU's copies, and those left pageable.
    pub pinned_bytes: usize,
    pub pageable_bytes: usize,
    /// Why part of the store stayed pageable, with the numbers.
    pub warning: Option<String>,
    /// The RAM ledger (the host store) against the process's resident anonymous growth while
    /// the store was built; `None` where the OS has no counters.
    pub store_memory: Option<MemoryCheck>,
    /// Resident anonymous growth over the whole load (store, dense weights held in RAM by a
    /// CPU backend, transient upload buffers that were freed are not in it).
    pub load_anon_growth_bytes: u64,
    /// The process after the load.
    pub process_after_load: Option<ProcessMemory>,
}

/// Which layers' stores to page-lock: in layer order while they fit under `limit`.
pub fn plan_pins(layer_bytes: &[usize], limit: Option<u64>) -> Vec<bool> {
    let mut left = limit.unwrap_or(u64::MAX);
    layer_bytes
        .iter()
        .map(|&b| {
            let fits = b as u64 <= left;
            if fits {
                left -= b as u64;
            }
            fits
        })
        .collect()
}

fn gib(bytes: u64) -> f64 {
    bytes as f64 / (1u64 << 30) as f64
}

/// A Flash-Next model whose routed experts run hybrid.
pub struct HybridModel<B: Backend> {
    pub model: Qwen4ExpText<B>,
    /// The shared cache policy (`None` when every expert is resident).
    pub cache: Option<Arc<Mutex<ExpertCache>>>,
    pub report: HybridReport,
}

/// One layer's routed experts as a host [`ExpertSet`]: straight from their quantized storage
/// when the kernels read it, else packed from the float tensors.
pub fn host_expert_set(ck: &Checkpoint, prefix: &str) -> Result<ExpertSet> {
    let flash = ck.config.qwen4_exp()?;
    let m = &flash.moe;
    let shape = ExpertShape {
        hidden: ck.config.hidden_size,
        intermediate: m.moe_intermediate_size,
    };
    if let Some(set) = quantized_expert_set(&ck.weights, prefix, m.num_experts, shape)? {
        return Ok(set);
    }
    let tensors = read_expert_tensors(ck, prefix, ck.config.hidden_size, m)?;
    pack_float_experts(&tensors).with_context(|| format!("packing the routed experts {prefix}*"))
}

/// How a VRAM budget divides for hybrid Flash-Next: what the dense weights take as stored
/// (everything but the routed experts, the n-gram tables read from host memory, and the
/// tensors no text forward reads), what is held back for KV, states and activations, and the
/// rest for the expert cache.
#[derive(Debug, Clone, Copy, PartialEq, serde::Serialize)]
pub struct VramPlan {
    pub budget: u64,
    pub dense_bytes: u64,
    pub reserve: u64,
    pub cache_bytes: u64,
}

pub fn vram_plan(ck: &Checkpoint, budget: u64, reserve: u64) -> Result<VramPlan> {
    let store = ck.weights.store();
    let mut dense = 0u64;
    for name in ck.weights.names() {
        if name.contains(".mlp.experts.")
            || name.contains("ngram_embedding.")
            || crate::model::is_unused_tensor(name)
        {
            continue;
        }
        let t = if store.contains(name) {
            store.get(name)
        } else {
            ck.weights.get(name)
        }?;
        dense += t.data.len() as u64;
    }
    if dense + reserve > budget {
        anyhow::bail!(
            "the VRAM budget of {:.1} GiB cannot hold the dense weights ({:.1} GiB as stored) and the {:.1} GiB held back for KV, states and activations; raise --vram-budget or use a smaller quantization",
            gib(budget),
            gib(dense),
            gib(reserve)
        );
    }
    Ok(VramPlan {
        budget,
        dense_bytes: dense,
        reserve,
        cache_bytes: budget - dense - reserve,
    })
}

/// The model name a hot set is saved under: the checkpoint folder's name.
pub fn hot_set_model_id(ck: &Checkpoint) -> String {
    ck.dir
        .file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_default()
}

/// Loads `ck` (a `qwen4_exp_text` checkpoint) on `backend` with hybrid expert placement.
pub fn load_flash_next<B: Backend>(
    backend: B,
    ck: &Checkpoint,
    o: &HybridOptions,
) -> Result<HybridModel<B>> {
    let flash = ck.config.qwen4_exp()?;
    let layers = ck.config.num_hidden_layers;
    let experts = flash.moe.num_experts;
    let mem_before = ProcessMemory::now();
    // The host store first: its record size decides the cache's slot count.
    let sets: Vec<Arc<ExpertSet>> = (0..layers)
        .map(|l| {
            let prefix = format!(
                "{}layers.{l}.mlp.experts.",
                crate::model::layers::text_prefix(ck)
            );
            host_expert_set(ck, &prefix).map(Arc::new)
        })
        .collect::<Result<_>>()?;
    let mem_store = ProcessMemory::now();
    let layout = sets[0].layout;
    let expert_bytes = layout.weight_bytes();
    let cache_slots = o.cache_bytes / expert_bytes.max(1);
    let all_resident = cache_slots >= layers * experts;
    let cache = (!all_resident).then(|| {
        let mut c = ExpertCache::new(
            layers,
            experts,
            ExpertCacheConfig {
                slots: cache_slots,
                half_life_tokens: o.half_life_tokens,
                admit_margin: o.admit_margin,
            },
        );
        if let Some(path) = &o.hot_set {
            let warmed = ExpertCache::load_hot_set(path, &hot_set_model_id(ck), layers, experts)
                .and_then(|hot| c.warm(&hot));
            if let Err(e) = warmed {
                tracing::warn!("expert cache: starting cold: {e:#}");
            }
        }
        Arc::new(Mutex::new(c))
    });
    let pool = Arc::new(ExpertPool::new(o.threads, false));
    let pin_plan = plan_pins(
        &sets.iter().map(|s| s.bytes()).collect::<Vec<_>>(),
        o.page_locked_limit,
    );
    let mut pinned_bytes = 0usize;
    let mut pin_error: Option<anyhow::Error> = None;
    let isa = Isa::detect();
    let report = HybridReport {
        moe_layers: layers,
        experts_per_layer: experts,
        host_bytes: sets.iter().map(|s| s.bytes()).sum(),
        expert_bytes,
        cache_slots: cache_slots.min(layers * experts),
        all_resident,
        formats: format!("{}/{}", layout.format.name(), layout.down_format.name()),
        pinned_bytes: 0,
        pageable_bytes: 0,
        warning: None,
        store_memory: None,
        load_anon_growth_bytes: 0,
        process_after_load: None,
    };
    let mut make = |device: &B, layer: usize, _prefix: &str| -> Result<Box<dyn RoutedExperts<B>>> {
        let placement = match &cache {
            Some(c) => Placement::Cached(c.clone()),
            None => Placement::Fixed(vec![true; experts]),
        };
        let mut h = HybridExperts::new(
            device,
            layer,
            sets[layer].clone(),
            pool.clone(),
            isa,
            placement,
        )?;
        // After the first refusal the OS will refuse the rest too.
        if pin_plan[layer] && pin_error.is_none() {
            match h.pin_host_store(device) {
                Ok(n) => pinned_bytes += n,
                Err(e) => pin_error = Some(e),
            }
        }
        Ok(Box::new(h))
    };
    let mut model = Qwen4ExpText::load_with_experts(backend, ck, Some(&mut make))?;
    if let Some(c) = &cache {
        model.set_expert_cache(c.clone());
        // One card: device 0 of the metrics.
        super::expert_cache::register_for_metrics(c, expert_bytes, 0);
    }
    let host_bytes: usize = sets.iter().map(|s| s.bytes()).sum();
    let mut report = report;
    report.pinned_bytes = pinned_bytes;
    // Nothing pinned at all on a backend that does not pin (the CPU): nothing to warn about.
    let pins_at_all = pinned_bytes > 0 || pin_error.is_some();
    report.pageable_bytes = if pins_at_all {
        host_bytes - pinned_bytes
    } else {
        0
    };
    report.warning = match (&pin_error, o.page_locked_limit) {
        (Some(e), _) => Some(format!(
            "{:.1} GiB of the {:.1} GiB expert store stay in pageable memory (slower copies into the expert cache): {e:#}",
            gib(report.pageable_bytes as u64),
            gib(host_bytes as u64)
        )),
        (None, Some(limit)) if pins_at_all && report.pageable_bytes > 0 => Some(format!(
            "page-locked memory is capped at {:.1} GiB here (RLIMIT_MEMLOCK, or WSL2's half of RAM); {:.1} GiB of the {:.1} GiB expert store stay in pageable memory (slower copies into the expert cache)",
            gib(limit),
            gib(report.pageable_bytes as u64),
            gib(host_bytes as u64)
        )),
        _ => None,
    };
    if let Some(w) = &report.warning {
        tracing::warn!("{w}");
    }
    let mem_after = ProcessMemory::now();
    report.store_memory = mem_store
        .is_some()
        .then(|| MemoryCheck::new(host_bytes as u64, anon_growth(mem_before, mem_store)));
    report.load_anon_growth_bytes = anon_growth(mem_before, mem_after);
    report.process_after_load = mem_after;
    Ok(HybridModel {
        model,
        cache,
        report,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pins_whole_layers_in_order_while_they_fit() {
        assert_eq!(plan_pins(&[4, 4, 4], None), vec![true; 3]);
        assert_eq!(plan_pins(&[4, 4, 4], Some(9)), vec![true, true, false]);
        // A later, smaller layer still fits in what is left.
        assert_eq!(plan_pins(&[4, 6, 2], Some(7)), vec![true, false, true]);
        assert_eq!(plan_pins(&[4, 4], Some(0)), vec![false, false]);
    }
}
